//! Prefix blocks computed from a prompt's tokens, as vLLM's automatic
//! prefix caching and llm-d's prefix-aware scorer name them: the prompt is
//! cut into full blocks of [`BLOCK_TOKENS`] tokens (the unit the
//! scheduler's prefix cache and prefix-affinity routing count in, the
//! recorded-traffic format's `prefix_blocks`), and block `k`'s id is a hash
//! of block `k - 1`'s id and block `k`'s tokens. Two prompts therefore
//! share their leading ids exactly as far as they share whole leading
//! blocks, and a change in block `k` changes ids `k..` only.
//!
//! The hash is rustc-hash's `FxHasher` over the previous id and the
//! block's tokens as little-endian bytes: no random seed, so the same
//! prompt gets the same ids in every process and run (on a 64-bit host;
//! the decision log records the ids themselves, so a replay never has to
//! recompute them).
//!
//! The work is bounded: at most [`MAX_PREFIX_BLOCKS`] blocks (whatever the
//! prompt's length, so a hostile prompt costs at most
//! [`MAX_PREFIX_TOKENS`] tokens of buffer), and the tokens come from the
//! same pass that counts the prompt (see `openai::Tokenizer::prompt`).
//! A trailing partial block has no id (vLLM caches full blocks only).

use crate::sched::replica::BLOCK_TOKENS;
use rustc_hash::FxHasher;
use std::hash::Hasher;

/// Blocks hashed per request at most: 256 × 512 = 131,072 tokens, longer
/// than the context of the models kiln serves; the rest of a longer prompt
/// has no ids (it is counted, not cached).
pub const MAX_PREFIX_BLOCKS: usize = 256;

/// Tokens kept for hashing at most.
pub const MAX_PREFIX_TOKENS: usize = MAX_PREFIX_BLOCKS * BLOCK_TOKENS as usize;

/// The id the chain starts from (what block 0 is chained to).
const CHAIN_SEED: u64 = 0x6b69_6c6e_5f70_6678; // "kiln_pfx"

/// Marks the start of a chat message in the token stream: not a token of
/// the vocabulary, so message boundaries cannot be confused with text.
pub const MESSAGE_MARK: u32 = u32::MAX;
/// Marks the end of a chat message's role (and name) and the start of its
/// content.
pub const CONTENT_MARK: u32 = u32::MAX - 1;

/// Block ids of `tokens`: one per full block of [`BLOCK_TOKENS`], at most
/// [`MAX_PREFIX_BLOCKS`].
pub fn chain(tokens: &[u32]) -> Vec<u64> {
    let block = BLOCK_TOKENS as usize;
    // Most prompts are shorter than a block: no buffers for them (a 2 KB
    // one made glibc's malloc consolidate its free lists every request).
    if tokens.len() < block {
        return Vec::new();
    }
    let mut ids = Vec::with_capacity((tokens.len() / block).min(MAX_PREFIX_BLOCKS));
    let mut bytes = Vec::with_capacity(block * 4);
    let mut prev = CHAIN_SEED;
    for chunk in tokens.chunks_exact(block).take(MAX_PREFIX_BLOCKS) {
        bytes.clear();
        for t in chunk {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut h = FxHasher::default();
        h.write_u64(prev);
        h.write(&bytes);
        prev = h.finish();
        ids.push(prev);
    }
    ids
}

/// The leading tokens of a prompt, collected while it is counted: at most
/// `cap` of them, and none after [`PrefixTokens::close`] (after content
/// whose tokens are not known, such as an image, nothing further can be a
/// shared prefix).
#[derive(Debug, Clone, Default)]
pub struct PrefixTokens {
    tokens: Vec<u32>,
    cap: usize,
    closed: bool,
}

impl PrefixTokens {
    /// Collects up to `cap` tokens (0: none, the prompt is only counted).
    pub fn new(cap: usize) -> PrefixTokens {
        PrefixTokens {
            tokens: Vec::new(),
            cap: cap.min(MAX_PREFIX_TOKENS),
            closed: false,
        }
    }

    /// Whether more tokens would be kept.
    pub fn wants(&self) -> bool {
        !self.closed && self.tokens.len() < self.cap
    }

    /// Appends what fits of `tokens`.
    pub fn push(&mut self, tokens: &[u32]) {
        if !self.wants() {
            return;
        }
        let room = self.cap - self.tokens.len();
        self.tokens
            .extend_from_slice(&tokens[..tokens.len().min(room)]);
    }

    /// Keeps nothing more.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// The tokens kept.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Their block ids.
    pub fn blocks(&self) -> Vec<u64> {
        chain(&self.tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32)
            .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 100_000)
            .collect()
    }

    const B: usize = BLOCK_TOKENS as usize;

    #[test]
    fn full_blocks_only() {
        assert!(chain(&prompt(B - 1, 0)).is_empty());
        assert_eq!(chain(&prompt(B, 0)).len(), 1);
        assert_eq!(chain(&prompt(3 * B + 7, 0)).len(), 3);
    }

    #[test]
    fn a_shared_prefix_shares_its_leading_ids() {
        let mut a = prompt(3 * B, 1);
        let mut b = a.clone();
        a.extend(prompt(2 * B, 2));
        b.extend(prompt(2 * B, 3));
        let (ha, hb) = (chain(&a), chain(&b));
        assert_eq!(ha.len(), 5);
        assert_eq!(ha[..3], hb[..3]);
        assert!(ha[3..].iter().zip(&hb[3..]).all(|(x, y)| x != y));
    }

    #[test]
    fn one_changed_token_changes_its_block_and_every_later_one() {
        let a = prompt(6 * B, 9);
        let ha = chain(&a);
        for k in 0..6 {
            let mut b = a.clone();
            // Any token of block k: its first, a middle one, its last.
            for at in [k * B, k * B + B / 2, k * B + B - 1] {
                b[at] ^= 1;
                let hb = chain(&b);
                assert_eq!(ha[..k], hb[..k], "blocks before {k} keep their ids");
                for j in k..6 {
                    assert_ne!(ha[j], hb[j], "block {j} after a change in {k}");
                }
                b[at] ^= 1;
            }
        }
    }

    #[test]
    fn ids_depend_on_position_not_only_content() {
        // The same block twice: different ids (the chain covers what came
        // before), so a repeated block is not a cache hit out of place.
        let blk = prompt(B, 4);
        let mut twice = blk.clone();
        twice.extend(&blk);
        let h = chain(&twice);
        assert_ne!(h[0], h[1]);
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn ids_are_stable_across_runs() {
        // A fixed value: the hash has no per-process seed, so a gateway
        // restarted tomorrow names today's prefixes the same way.
        let h = chain(&vec![0u32; B]);
        assert_eq!(h, chain(&vec![0u32; B]));
        assert_eq!(h, vec![FIXED_ZERO_BLOCK]);
    }

    // chain(&[0; 512]), computed once and kept: it changes only if the
    // hash does, which would break affinity across a gateway upgrade.
    const FIXED_ZERO_BLOCK: u64 = 1_401_925_489_665_511_338;

    #[test]
    fn the_work_is_bounded() {
        let long = vec![7u32; (MAX_PREFIX_BLOCKS + 10) * B];
        assert_eq!(chain(&long).len(), MAX_PREFIX_BLOCKS);
        let mut p = PrefixTokens::new(usize::MAX);
        for _ in 0..(MAX_PREFIX_BLOCKS + 10) {
            p.push(&long[..B]);
        }
        assert_eq!(p.tokens().len(), MAX_PREFIX_TOKENS);
        assert!(!p.wants());
        let mut p = PrefixTokens::new(B + 1);
        p.push(&long[..B]);
        p.close();
        p.push(&long[..B]);
        assert_eq!(p.tokens().len(), B);
        assert!(PrefixTokens::new(0).blocks().is_empty());
    }
}
