//! One model replica running continuous batching: every step decodes one
//! token for each running sequence and spends what is left of the step's
//! token budget on prompt prefill (chunked, as vLLM's v1 scheduler does).
//!
//! KV memory is paged, as in vLLM's PagedAttention: the replica's
//! `spec.kv_capacity` tokens form a pool of blocks of [`KV_BLOCK_TOKENS`]
//! tokens. A sequence takes the blocks for its prompt when it starts (less
//! the blocks it finds in the prefix cache), which covers every chunk of
//! its prefill, then one more block each time its context crosses a block
//! boundary as it decodes ([`Replica::make_room`] finds that block before
//! each step). Nothing is reserved for output it has not produced yet.
//!
//! The prefix cache lives in the same pool. A trace's prefix hashes
//! (`Waiting::prefix_blocks`, one per [`BLOCK_TOKENS`] prompt tokens, i.e.
//! [`PREFIX_KV_BLOCKS`] KV blocks) name shared prompt blocks: once a
//! sequence has prefilled a whole prefix block, those KV blocks become a
//! reference-counted entry, shared (not duplicated) by every running
//! sequence whose prompt starts the same way. When the last user ends, the
//! entry stays cached with no references and is evicted least recently
//! used first when free blocks are needed; evictable blocks count as free.
//! Every operation touches only the blocks and entries concerned (a hash
//! map from prefix hash to entry, a B-tree of unreferenced entries by
//! last-use stamp), never the whole cache.
//!
//! When a decoding sequence needs a block and none is free, the lowest
//! ranked running sequence (lowest tier priority, then the one that started
//! last) is preempted within its thrash budget — possibly the one that
//! needs the block; see [`Replica::make_room`] for why this cannot
//! deadlock. An external replica (an HTTP upstream) keeps what it did
//! before paging: a sequence holds the blocks for its whole prompt and
//! output from start to end, and is never preempted for blocks (a higher
//! tier may still preempt it for its slot; the environment then cancels
//! the upstream's request).

use super::plan::ReplicaSpec;
use super::queue::Waiting;
use super::{Action, Micros, ReqId, SEC};
use std::collections::BTreeMap;

/// Tokens in one KV block (vLLM's default block size).
pub const KV_BLOCK_TOKENS: u32 = 16;
/// Tokens in one prefix block of a trace's prompt hashes.
pub const BLOCK_TOKENS: u32 = 512;
/// KV blocks in one prefix block.
pub const PREFIX_KV_BLOCKS: u64 = (BLOCK_TOKENS / KV_BLOCK_TOKENS) as u64;
/// Unreferenced prefix entries kept at most, whatever the pool: bounds the
/// bookkeeping of a replica whose pool is effectively unbounded (an
/// external upstream). 65,536 entries are 33.5M tokens, more KV than any
/// one replica the cost model sizes holds.
const MAX_CACHED_ENTRIES: usize = 1 << 16;

/// KV blocks that hold `tokens` tokens.
pub fn kv_blocks(tokens: u64) -> u64 {
    tokens.div_ceil(u64::from(KV_BLOCK_TOKENS))
}

#[derive(Debug, Clone)]
pub struct Seq {
    pub w: Waiting,
    /// Prompt (plus, after a preemption, regenerated) tokens still to prefill.
    pub prefill_left: u32,
    /// Of those, tokens it had computed before a preemption.
    redo_left: u32,
    pub generated: u32,
    pub started: Micros,
    pub first_token_sent: bool,
    /// KV tokens this sequence may need at most (prompt and output): it
    /// can only run on a replica whose pool holds that many.
    pub kv: u64,
    /// GPU-seconds used so far.
    pub gpu_seconds: f64,
    /// Its prefill goes before that of lower-ranked sequences in a step's
    /// token budget (the scheduler sets its tier's priority; 0 for all
    /// under the baselines, which prefill in start order as vLLM does).
    pub rank: i64,
    /// Its prefill only fills what the step-time cap leaves (work with no
    /// first-token deadline: it must not make steps long for those with).
    pub capped: bool,
    /// Capped work of a preemptible tier: while protected work runs on
    /// the replica it only fills the steps' slack ([`Replica::backfill_slack`]).
    /// (A tier the policy says may not be preempted is not held back.)
    pub yields: bool,
    /// Tokens of prefix the caller found cached when it was made (the
    /// replica checks them again when it admits it).
    hit_tokens: u32,
    /// Context tokens with KV blocks: the shared prefix entries, then the
    /// private blocks (the prompt's uncached part and what was decoded).
    ctx: u64,
    /// Private blocks held (at most one more than the private tokens need:
    /// the block found for the next token before a step).
    blocks: u64,
    /// Prefix entries referenced, a leading part of `w.prefix_blocks`.
    shared: Vec<u64>,
    /// Tokens prefilled in the step in flight.
    step_prefill: u32,
    step_decode: bool,
}

impl Seq {
    /// A sequence resumes after preemption by recomputing the KV cache of
    /// its prompt and of what it had generated (the recompute cost).
    pub fn from_waiting(mut w: Waiting, cached_prefix: u32) -> Seq {
        let recompute = w.prompt_tokens.saturating_add(w.generated);
        let kv = u64::from(w.prompt_tokens) + u64::from(w.output_tokens);
        let prefill_left = recompute.saturating_sub(cached_prefix).max(1);
        // What it had computed before, less what the prefix cache still
        // holds, is prefilled again for nothing.
        let redo = std::mem::take(&mut w.redo_tokens)
            .saturating_sub(cached_prefix)
            .min(prefill_left);
        Seq {
            prefill_left,
            redo_left: redo,
            generated: w.generated,
            started: 0,
            first_token_sent: w.generated > 0,
            kv,
            gpu_seconds: w.gpu_seconds,
            rank: 0,
            capped: false,
            yields: false,
            hit_tokens: cached_prefix,
            ctx: 0,
            blocks: 0,
            shared: Vec::new(),
            step_prefill: 0,
            step_decode: false,
            w,
        }
    }

    /// Adds its `share` of the step just done; the part of it spent
    /// prefilling tokens it had computed before a preemption is wasted.
    pub fn charge(&mut self, share: f64) {
        self.gpu_seconds += share;
        if self.redo_left > 0 && self.step_prefill > 0 {
            let redo = self.step_prefill.min(self.redo_left);
            self.w.wasted_gpu_seconds += share * f64::from(redo) / f64::from(self.step_prefill);
            self.redo_left -= redo;
        }
    }

    /// Context tokens in private blocks.
    fn private_tokens(&self) -> u64 {
        self.ctx
            .saturating_sub(self.shared.len() as u64 * u64::from(BLOCK_TOKENS))
    }

    /// Whether the block for the next decoded token is held.
    fn has_room(&self) -> bool {
        kv_blocks(self.private_tokens() + 1) <= self.blocks
    }

    /// KV blocks held, its share of prefix entries included.
    pub fn kv_blocks_held(&self) -> u64 {
        self.blocks + self.shared.len() as u64 * PREFIX_KV_BLOCKS
    }
}

/// A prefix entry: [`PREFIX_KV_BLOCKS`] blocks shared by `refs` sequences,
/// or cached (`refs == 0`) and evictable, last used at `stamp`.
#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
    stamp: u64,
}

/// The block pool's accounting; the pool size is the spec's (it may change
/// with a policy swap).
#[derive(Debug, Default)]
struct Blocks {
    /// Blocks held privately by running sequences.
    private: u64,
    /// Blocks of referenced entries.
    shared: u64,
    /// Blocks of unreferenced (cached, evictable) entries.
    cached: u64,
    entries: rustc_hash::FxHashMap<u64, Entry>,
    /// Unreferenced entries by last-use stamp, oldest first.
    lru: BTreeMap<u64, u64>,
    clock: u64,
}

impl Blocks {
    /// Blocks free now or freeable by eviction.
    fn available(&self, pool: u64) -> u64 {
        pool.saturating_sub(self.private + self.shared)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Drops the least recently used unreferenced entry.
    fn evict_one(&mut self) -> bool {
        let Some((_, hash)) = self.lru.pop_first() else {
            return false;
        };
        self.entries.remove(&hash);
        self.cached = self.cached.saturating_sub(PREFIX_KV_BLOCKS);
        true
    }

    /// Makes `n` blocks free, evicting cached entries as needed.
    fn make_free(&mut self, pool: u64, n: u64) -> bool {
        if n > self.available(pool) {
            return false;
        }
        while pool.saturating_sub(self.private + self.shared + self.cached) < n {
            if !self.evict_one() {
                return false;
            }
        }
        true
    }

    /// Takes `n` private blocks if the pool has them.
    fn take(&mut self, pool: u64, n: u64) -> bool {
        if n == 0 {
            return true;
        }
        if !self.make_free(pool, n) {
            return false;
        }
        self.private += n;
        true
    }

    /// References an existing entry (it stops being evictable).
    fn acquire(&mut self, hash: u64) -> bool {
        let Some(e) = self.entries.get_mut(&hash) else {
            return false;
        };
        if e.refs == 0 {
            self.lru.remove(&e.stamp);
            self.cached = self.cached.saturating_sub(PREFIX_KV_BLOCKS);
            self.shared += PREFIX_KV_BLOCKS;
        }
        e.refs = e.refs.saturating_add(1);
        true
    }

    /// Drops one reference; the last one leaves the entry cached.
    fn release(&mut self, hash: u64) {
        let stamp = self.tick();
        let Some(e) = self.entries.get_mut(&hash) else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            e.stamp = stamp;
            self.lru.insert(stamp, hash);
            self.shared = self.shared.saturating_sub(PREFIX_KV_BLOCKS);
            self.cached += PREFIX_KV_BLOCKS;
        }
    }

    /// Keeps unreferenced entries within [`MAX_CACHED_ENTRIES`].
    fn trim(&mut self) {
        while self.lru.len() > MAX_CACHED_ENTRIES {
            self.evict_one();
        }
    }
}

/// An external replica's engine load, as its own metrics say: requests
/// running and waiting in the engine, KV-cache usage (0–1) where known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSignals {
    pub running: f64,
    pub waiting: f64,
    pub kv_cache: Option<f64>,
}

/// Prefill queued ahead of a new prompt on a replica, and the decodes its
/// steps run beside ([`Replica::prefill_ahead`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillAhead {
    pending: u64,
    decodes: u32,
    context: u64,
}

#[derive(Debug)]
pub struct Replica {
    pub spec: ReplicaSpec,
    pub running: Vec<Seq>,
    /// Slots of a shared upstream this replica of a fleet holds now
    /// ([`super::Scheduler::set_slot_cap`]); `None`: all of `max_batch`.
    pub slot_cap: Option<u32>,
    /// What an engine-aware upstream's engine reports it holds, from its
    /// last fresh scrape ([`super::Scheduler::set_engine_load`]).
    pub engine: Option<EngineSignals>,
    pub busy: bool,
    /// In service (a replica that went down takes no work until it is up).
    pub up: bool,
    /// A policy swap left it out of the plan: it takes no new work and
    /// finishes what runs. It keeps its index, as replicas are named by it.
    pub draining: bool,
    /// An external replica's upstream calls as they really took, start to
    /// answer (seconds, a moving mean of completed calls): the upstream's
    /// progress is not seen, and the cost model may not know its speed.
    pub call_secs: Option<f64>,
    blocks: Blocks,
    /// Seconds the replica has spent running steps (for utilization).
    pub busy_seconds: f64,
    /// The work of those steps at the roofline's saturated throughput
    /// ([`Self::saturated_secs`]): what of its capacity it really used.
    pub work_seconds: f64,
    /// Duration of the step in flight (or the last one), seconds.
    pub last_step: f64,
    /// Steps take at most this long (seconds) for capped sequences'
    /// prefill: the scheduler sets it from the tightest TTFT SLO it serves,
    /// so a first token never waits behind a long batch-work step.
    pub step_cap: Option<f64>,
    /// While a sequence of a tier with a first-token deadline runs here,
    /// capped work (tiers without one: batch, background) may make its
    /// steps at most this much longer (0.1: 10%); the rest of that work
    /// sits the step out, its KV kept. `None` (the baselines): no limit.
    pub backfill_slack: Option<f64>,
    /// In such a step that also prefills (a first token waits for it),
    /// capped work's prefill may make it at most this much longer (0.01),
    /// its decodes still [`Self::backfill_slack`].
    pub backfill_prefill_slack: f64,
    /// The step in flight as (prefill tokens, decoding sequences, context
    /// tokens): what a real GPU backend runs for it.
    pub step_shape: (u32, u32, u64),
    /// When the step in flight ends: a completion reported earlier belongs
    /// to a step lost when the replica went down, and is ignored.
    pub step_until: Micros,
    rate: f64,
    /// Seconds per prompt token in full prefill chunks (for utilization).
    prefill_secs: f64,
    /// Prompt tokens prefilled, and output tokens produced, by finished
    /// steps (for throughput against the roofline in reports).
    pub prefilled_tokens: u64,
    pub decoded_tokens: u64,
    /// The zero-load time to a one-token prompt's first token: no TTFT
    /// SLO below it can be met here (kept, as the step cap reads it on
    /// every step).
    pub idle_floor: Micros,
}

/// What [`Replica::make_room`] took off a replica.
#[derive(Debug, Default)]
pub struct Room {
    /// Sequences preempted for a block, each with the sequence that needed
    /// it (its own id when it was preempted for its own block).
    pub preempted: Vec<(Seq, ReqId)>,
    /// Sequences that can never finish here: alone, they would need more
    /// blocks than the pool has (only after a policy swap shrank it).
    pub unfit: Vec<Seq>,
}

/// A cost model's step time made usable: a broken one (NaN, infinite,
/// negative) reads as one second, a tiny one as at least a nanosecond.
fn sane_secs(secs: f64) -> f64 {
    if secs.is_finite() {
        secs.max(1e-9)
    } else {
        1.0
    }
}

/// Seconds per prompt token when prefill runs in full chunks.
fn prefill_secs_per_token(spec: &ReplicaSpec) -> f64 {
    let chunk = spec.max_batch_tokens.max(1);
    sane_secs(spec.cost.step_time(chunk, 0, 0)) / f64::from(chunk)
}

/// Token throughput for wait estimates: a mix of prefill (fast) and decode
/// at a moderate batch (slow), weighted 4:1 as prompts usually are longer
/// than outputs. Always finite and positive.
fn throughput(spec: &ReplicaSpec) -> f64 {
    let b = spec.max_batch.clamp(1, 64);
    let decode = f64::from(b) / sane_secs(spec.cost.step_time(0, b, u64::from(b) * 1024));
    let chunk = spec.max_batch_tokens.max(1);
    let prefill = f64::from(chunk) / sane_secs(spec.cost.step_time(chunk, 0, 0));
    let rate = 1.0 / (0.8 / prefill + 0.2 / decode);
    if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        1.0
    }
}

impl Replica {
    /// The time a step's work takes at this replica's saturated throughput
    /// (the roofline's: full prefill chunks, and a full batch of decodes at
    /// the step's context per sequence), seconds. Summed over a window and
    /// divided by the window, it is the replica's real utilization.
    pub fn saturated_secs(&self, prefill: u32, decodes: u32, context: u64) -> f64 {
        let mut secs = 0.0;
        if prefill > 0 {
            secs += f64::from(prefill) * self.prefill_secs;
        }
        if decodes > 0 {
            let per_seq = (context / u64::from(decodes)).max(1);
            let fit = (self.spec.kv_capacity / per_seq).clamp(1, u64::from(u32::MAX)) as u32;
            let batch = self.spec.max_batch.min(fit).max(1);
            let t = sane_secs(self.spec.cost.step_time(
                0,
                batch,
                u64::from(batch).saturating_mul(per_seq),
            ));
            secs += f64::from(decodes) * t / f64::from(batch);
        }
        secs
    }

    /// [`Self::saturated_secs`] for a whole request: its prompt, then its
    /// output one decode step per token at half its final context.
    pub fn saturated_work(&self, prompt: u32, output: u32) -> f64 {
        let ctx = u64::from(prompt) + u64::from(output) / 2;
        self.saturated_secs(prompt, 0, 0) + f64::from(output) * self.saturated_secs(0, 1, ctx)
    }

    /// Tokens its running sequences still have to process: what is left
    /// of each prefill and each answer.
    pub fn outstanding_tokens(&self) -> u64 {
        self.running
            .iter()
            .map(|s| {
                u64::from(s.prefill_left) + u64::from(s.w.output_tokens.saturating_sub(s.generated))
            })
            .sum()
    }

    /// The running sequences' remaining work at saturated throughput
    /// (what is left of each one's prefill and output), seconds.
    pub fn remaining_work_secs(&self) -> f64 {
        self.running
            .iter()
            .map(|s| {
                let left = s.w.output_tokens.saturating_sub(s.generated);
                let ctx =
                    u64::from(s.w.prompt_tokens) + u64::from(s.generated) + u64::from(left) / 2;
                self.saturated_secs(s.prefill_left, 0, 0)
                    + f64::from(left) * self.saturated_secs(0, 1, ctx)
            })
            .sum()
    }

    /// How long a request's `output` takes to decode here after its first
    /// token, in the batch it joins (what runs now and itself, up to the
    /// batch's size), at half its final context per sequence, seconds.
    pub fn decode_secs(&self, prompt: u32, output: u32) -> f64 {
        let batch = (self.running.len() as u32)
            .saturating_add(1)
            .min(self.spec.max_batch.max(1));
        let ctx = u64::from(prompt) + u64::from(output) / 2;
        f64::from(output.saturating_sub(1))
            * sane_secs(self.spec.cost.step_time(
                0,
                batch,
                u64::from(batch).saturating_mul(ctx.max(1)),
            ))
    }

    pub fn new(spec: ReplicaSpec) -> Replica {
        let rate = throughput(&spec);
        let prefill_secs = prefill_secs_per_token(&spec);
        let mut r = Replica {
            prefill_secs,
            spec,
            running: Vec::new(),
            slot_cap: None,
            engine: None,
            busy: false,
            up: true,
            draining: false,
            call_secs: None,
            blocks: Blocks::default(),
            busy_seconds: 0.0,
            work_seconds: 0.0,
            last_step: 0.0,
            step_cap: None,
            backfill_slack: None,
            backfill_prefill_slack: 0.0,
            step_shape: (0, 0, 0),
            step_until: 0,
            rate,
            prefilled_tokens: 0,
            decoded_tokens: 0,
            idle_floor: 0,
        };
        r.idle_floor = r.idle_first_token_time(1);
        r
    }

    /// Takes a new spec (a policy swap) keeping what runs, its step in
    /// flight and its prefix cache. If the new pool is smaller than what
    /// runs, nothing is evicted at once: the replica admits nothing until
    /// it is under, and decoding sequences that need a block preempt.
    pub fn respec(&mut self, spec: ReplicaSpec) {
        self.rate = throughput(&spec);
        self.prefill_secs = prefill_secs_per_token(&spec);
        self.spec = spec;
        self.idle_floor = self.idle_first_token_time(1);
    }

    /// KV blocks in the pool.
    pub fn pool_blocks(&self) -> u64 {
        self.spec.kv_capacity / u64::from(KV_BLOCK_TOKENS)
    }

    /// Tokens the pool holds (`kv_capacity` rounded down to whole blocks):
    /// the most KV one sequence can ever have here.
    pub fn pool_tokens(&self) -> u64 {
        self.pool_blocks() * u64::from(KV_BLOCK_TOKENS)
    }

    /// Tokens of KV held by running sequences, in whole blocks, shared
    /// prefix blocks counted once. Cached prefix blocks no sequence uses
    /// are not included (they are free for the taking: see [`Self::kv_free`]).
    pub fn kv_used(&self) -> u64 {
        (self.blocks.private + self.blocks.shared) * u64::from(KV_BLOCK_TOKENS)
    }

    /// Tokens of cached prefix blocks that no running sequence uses.
    pub fn kv_cached(&self) -> u64 {
        self.blocks.cached * u64::from(KV_BLOCK_TOKENS)
    }

    /// Tokens of KV allocatable now, evictable cached blocks counted free.
    pub fn kv_free(&self) -> u64 {
        self.blocks.available(self.pool_blocks()) * u64::from(KV_BLOCK_TOKENS)
    }

    /// Blocks kept free when admitting next to running work (vLLM's
    /// watermark): 1% of the pool, at least one block, so that the
    /// sequences running can grow a little before anything is preempted.
    pub fn watermark_blocks(&self) -> u64 {
        (self.pool_blocks() / 100).max(1)
    }

    pub fn free_seq_slots(&self) -> u32 {
        self.slots().saturating_sub(self.running.len() as u32)
    }

    /// Sequences it may run at once: its batch size, or fewer where a
    /// fleet sharing its upstream granted this replica fewer slots.
    pub fn slots(&self) -> u32 {
        match self.slot_cap {
            Some(c) => c.min(self.spec.max_batch),
            None => self.spec.max_batch,
        }
    }

    pub fn throughput_tokens_per_s(&self) -> f64 {
        self.rate
    }

    /// Estimated time until the first running sequence finishes and frees
    /// its slot and memory (for an external replica, from the cost model
    /// and each sequence's remaining budget: its progress is unknown here).
    pub fn time_to_free(&self) -> Micros {
        let context: u64 = self
            .running
            .iter()
            .map(|s| u64::from(s.w.prompt_tokens) + u64::from(s.generated))
            .sum();
        let step = sane_secs(
            self.spec
                .cost
                .step_time(0, self.running.len() as u32, context),
        )
        .max(1e-6);
        let steps = self
            .running
            .iter()
            .map(|s| {
                let prefill_steps = s.prefill_left.div_ceil(self.spec.max_batch_tokens.max(1));
                prefill_steps.saturating_add(s.w.output_tokens.saturating_sub(s.generated))
            })
            .min()
            .unwrap_or(0);
        // A float-to-integer cast saturates: no overflow however large.
        (f64::from(steps) * step * SEC as f64) as Micros
    }

    /// An external replica's completed call took `secs`: its moving mean
    /// (a fifth for the newest, so a slower or faster upstream is learnt
    /// within a few calls).
    pub fn note_call(&mut self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        self.call_secs = Some(match self.call_secs {
            Some(m) => 0.8 * m + 0.2 * secs,
            None => secs,
        });
    }

    /// When the first slot should free at `now`. On an external replica
    /// whose calls have been timed, from those times: a call is expected
    /// to take the mean, so the soonest is the running call closest to it
    /// (none past it counts as free at once). Otherwise
    /// [`Self::time_to_free`].
    pub fn observed_time_to_free(&self, now: Micros) -> Micros {
        match (self.spec.external, self.call_secs) {
            (true, Some(mean)) => {
                let mean = (mean * SEC as f64) as Micros;
                self.running
                    .iter()
                    .map(|s| mean.saturating_sub(now.saturating_sub(s.started)))
                    .min()
                    .unwrap_or(0)
            }
            _ => self.time_to_free(),
        }
    }

    /// Sequences past their prefill (each decodes a token per step).
    pub fn decoding(&self) -> u32 {
        self.running.iter().filter(|s| s.prefill_left == 0).count() as u32
    }

    /// Prompt tokens admitted here and not yet prefilled, of sequences
    /// ranked at least `rank` (those whose prefill goes first).
    pub fn pending_prefill(&self, rank: i64) -> u64 {
        self.running
            .iter()
            .filter(|s| s.rank >= rank)
            .map(|s| u64::from(s.prefill_left))
            .sum()
    }

    /// Estimated time from starting here to the first token of a prompt of
    /// `tokens` ranked `rank`: the prefill already admitted at that rank or
    /// above goes first, in steps that also decode every
    /// sequence past its prefill, so each step has the token budget less
    /// the decodes for prefill. Finite whatever the cost model says.
    ///
    /// `next_boundary`: the request starts at the next step boundary (a
    /// slot is free now), where the chunks the step in flight prefills are
    /// done (callers add the step's remaining time; counting those chunks
    /// again read a full chunk, over a second on an L4, twice, and refused
    /// requests at 40% load that fifo served in time). For a request that
    /// waits for a slot, what is pending now, in-flight chunk included,
    /// stands for what will be pending when it starts (the replica will be
    /// mid-work then too): counting it without the chunk left queued
    /// requests late, 9.5% of those admitted at 2.6x overload on one H100
    /// against 2.3%.
    pub fn first_token_time(&self, tokens: u64, rank: i64, next_boundary: bool) -> Micros {
        let ahead = self.prefill_ahead(rank);
        self.first_token_after(&ahead[usize::from(!next_boundary)], tokens)
    }

    /// What goes before a new prompt ranked `rank` in one pass over the
    /// running sequences: at the next step boundary (`[0]`) and as it
    /// stands now (`[1]`), for [`Self::first_token_after`]. (Admission
    /// prices both, at two sizes, on every arrival.)
    pub fn prefill_ahead(&self, rank: i64) -> [PrefillAhead; 2] {
        let mut out = [PrefillAhead::default(); 2];
        let in_flight = self.busy && !self.spec.external;
        for s in &self.running {
            let next = if in_flight {
                s.prefill_left.saturating_sub(s.step_prefill)
            } else {
                s.prefill_left
            };
            for (a, left) in out.iter_mut().zip([next, s.prefill_left]) {
                if left > 0 {
                    if s.rank >= rank {
                        a.pending += u64::from(left);
                    }
                } else {
                    a.decodes += 1;
                    a.context += u64::from(s.w.prompt_tokens) + u64::from(s.generated);
                }
            }
        }
        out
    }

    /// [`Self::first_token_time`] of a prompt of `tokens` behind `ahead`.
    pub fn first_token_after(&self, ahead: &PrefillAhead, tokens: u64) -> Micros {
        self.prefill_time(
            ahead.pending.saturating_add(tokens.max(1)),
            ahead.decodes,
            ahead.context,
        )
    }

    /// [`Self::first_token_after`] with no other prompt pending: its own
    /// prefill beside the decodes of `ahead`.
    pub fn first_token_alone(&self, ahead: &PrefillAhead, tokens: u64) -> Micros {
        self.prefill_time(tokens.max(1), ahead.decodes, ahead.context)
    }

    /// How long one request takes here from start to last token when
    /// nothing else runs: its prefill, then one single-sequence decode
    /// step per output token at half its final context, seconds. A batch
    /// allowed `n` items at once finishes no faster than `n` per this.
    pub fn idle_latency_secs(&self, prompt: u32, output: u32) -> f64 {
        let ctx = u64::from(prompt) + u64::from(output) / 2;
        let prefill = self.idle_first_token_time(u64::from(prompt)) as f64 / SEC as f64;
        prefill + f64::from(output) * sane_secs(self.spec.cost.step_time(0, 1, ctx.max(1)))
    }

    /// The time before a prompt of `tokens` gets its first token here when
    /// nothing else runs: its zero-load TTFT, what no wait can improve.
    pub fn idle_first_token_time(&self, tokens: u64) -> Micros {
        self.prefill_time(tokens.max(1), 0, 0)
    }

    /// Steps to prefill `work` tokens beside `decodes` decoding sequences
    /// of `context` tokens, chunked as the engine chunks it: full chunks of
    /// the step's token budget, then one step with the remainder. (Pricing
    /// the remainder as a full chunk made every prompt just over a chunk
    /// cost two full steps, and refused it on an idle replica.)
    fn prefill_time(&self, work: u64, decodes: u32, context: u64) -> Micros {
        let budget = u64::from(self.spec.max_batch_tokens.saturating_sub(decodes).max(1));
        let (full, rest) = (work / budget, work % budget);
        let mut secs = 0.0;
        if full > 0 {
            secs +=
                full as f64 * sane_secs(self.spec.cost.step_time(budget as u32, decodes, context));
        }
        if rest > 0 {
            secs += sane_secs(self.spec.cost.step_time(rest as u32, decodes, context));
        }
        (secs * SEC as f64) as Micros
    }

    /// Leading prompt blocks this replica holds (in use or cached), in tokens.
    pub fn cached_prefix_tokens(&self, blocks: &[u64]) -> u32 {
        (self.prefix_match(blocks) as u32).saturating_mul(BLOCK_TOKENS)
    }

    /// Leading prompt blocks (of [`BLOCK_TOKENS`]) this replica holds, in
    /// use or cached, for choosing among replicas.
    pub fn prefix_match(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.blocks.entries.contains_key(b))
            .count()
    }

    /// Prefix blocks of `w`'s prompt a start here would share: leading
    /// entries held, whole blocks of the prompt, within `cached` tokens.
    fn hits(&self, w: &Waiting, cached: u32) -> usize {
        let limit = (cached / BLOCK_TOKENS).min(w.prompt_tokens / BLOCK_TOKENS) as usize;
        let n = w.prefix_blocks.len().min(limit);
        self.prefix_match(&w.prefix_blocks[..n])
    }

    /// Whether `w` may start here now, with `cached` tokens of its prompt
    /// found in the prefix cache (see [`Self::cached_prefix_tokens`]): the
    /// blocks for its uncached prompt (and regenerated tokens), plus the
    /// [watermark](Self::watermark_blocks) when others run, are free or
    /// evictable, and its prompt and output fit the pool at all. An
    /// external replica needs blocks for the whole prompt and output.
    pub fn can_start(&self, w: &Waiting, cached: u32) -> bool {
        let pool = self.pool_blocks();
        let avail = self.blocks.available(pool);
        let most = u64::from(w.prompt_tokens) + u64::from(w.output_tokens);
        if self.spec.external {
            return kv_blocks(most) <= avail;
        }
        if most > self.pool_tokens() {
            return false;
        }
        let hits = self.hits(w, cached);
        let pinned = w.prefix_blocks[..hits]
            .iter()
            .filter(|h| self.blocks.entries.get(h).is_some_and(|e| e.refs == 0))
            .count() as u64;
        let hit_tokens = hits as u64 * u64::from(BLOCK_TOKENS);
        let uncached = (u64::from(w.prompt_tokens) + u64::from(w.generated))
            .saturating_sub(hit_tokens)
            .max(1);
        let headroom = if self.running.is_empty() {
            0
        } else {
            self.watermark_blocks()
        };
        kv_blocks(uncached) + pinned * PREFIX_KV_BLOCKS + headroom <= avail
    }

    /// Starts a sequence: it shares the cached prefix blocks it was made
    /// with (those still held) and takes blocks for the rest of its prompt.
    /// The caller checks [`Self::can_start`] first; without room the
    /// blocks are recorded anyway (the pool reads as full until they go).
    pub fn admit(&mut self, mut s: Seq, now: Micros) {
        let pool = self.pool_blocks();
        if self.spec.external {
            s.blocks = kv_blocks(s.kv);
            s.ctx = s.kv;
        } else {
            let hits = self.hits(&s.w, s.hit_tokens);
            for k in 0..hits {
                let h = s.w.prefix_blocks[k];
                if self.blocks.acquire(h) {
                    s.shared.push(h);
                }
            }
            let shared = s.shared.len() as u64 * u64::from(BLOCK_TOKENS);
            let recompute = u64::from(s.w.prompt_tokens) + u64::from(s.w.generated);
            let left = recompute.saturating_sub(shared).max(1);
            s.prefill_left = u32::try_from(left).unwrap_or(u32::MAX);
            s.ctx = shared + u64::from(s.prefill_left);
            s.blocks = kv_blocks(u64::from(s.prefill_left));
        }
        if !self.blocks.take(pool, s.blocks) {
            self.blocks.private += s.blocks;
        }
        s.started = now;
        s.w.started = true;
        self.running.push(s);
    }

    /// Takes sequence `i` off the replica, freeing its blocks (its shared
    /// prefix blocks stay cached once no one uses them).
    pub fn evict(&mut self, i: usize) -> Seq {
        let mut s = self.running.swap_remove(i);
        self.release(&mut s);
        s
    }

    fn release(&mut self, s: &mut Seq) {
        // Taken off (or done): the tokens whose KV it computed, which a
        // resume recomputes.
        s.w.redo_tokens =
            s.w.prompt_tokens
                .saturating_add(s.generated)
                .saturating_sub(s.prefill_left);
        self.blocks.private = self.blocks.private.saturating_sub(s.blocks);
        s.blocks = 0;
        // The tail first, so that it is evicted before the head.
        for h in s.shared.drain(..).rev() {
            self.blocks.release(h);
        }
        self.blocks.trim();
        s.ctx = 0;
    }

    /// Where request `id` runs on this replica, if it does.
    pub fn position(&self, id: ReqId) -> Option<usize> {
        self.running.iter().position(|s| s.w.id == id)
    }

    /// Remembers a finished prompt's blocks as cached prefix (for an
    /// external replica, whose upstream's cache is not seen; sequences
    /// here share their blocks as they prefill). A block already held is
    /// only marked used; a new one takes free blocks, evicting older
    /// cached ones, or is not remembered when the pool has no room.
    pub fn remember_prefix(&mut self, blocks: &[u64]) {
        let pool = self.pool_blocks();
        // The tail first, so that it is evicted before the head.
        for &h in blocks.iter().rev() {
            let stamp = self.blocks.tick();
            match self.blocks.entries.get_mut(&h) {
                Some(e) if e.refs == 0 => {
                    self.blocks.lru.remove(&e.stamp);
                    e.stamp = stamp;
                    self.blocks.lru.insert(stamp, h);
                }
                Some(_) => {}
                None => {
                    if !self.blocks.make_free(pool, PREFIX_KV_BLOCKS) {
                        break;
                    }
                    self.blocks.entries.insert(h, Entry { refs: 0, stamp });
                    self.blocks.lru.insert(stamp, h);
                    self.blocks.cached += PREFIX_KV_BLOCKS;
                }
            }
        }
        self.blocks.trim();
    }

    /// Whole prefix blocks `s` has prefilled become shared entries: its
    /// private copy is dropped if another sequence made the entry first.
    fn share_prefilled(blocks: &mut Blocks, s: &mut Seq) {
        let computed = s.ctx.saturating_sub(u64::from(s.prefill_left));
        let whole = (u64::from(s.w.prompt_tokens) / u64::from(BLOCK_TOKENS))
            .min(computed / u64::from(BLOCK_TOKENS))
            .min(s.w.prefix_blocks.len() as u64) as usize;
        while s.shared.len() < whole && s.blocks >= PREFIX_KV_BLOCKS {
            let h = s.w.prefix_blocks[s.shared.len()];
            s.blocks -= PREFIX_KV_BLOCKS;
            blocks.private = blocks.private.saturating_sub(PREFIX_KV_BLOCKS);
            if !blocks.acquire(h) {
                let stamp = blocks.tick();
                blocks.entries.insert(h, Entry { refs: 1, stamp });
                blocks.shared += PREFIX_KV_BLOCKS;
            }
            s.shared.push(h);
        }
    }

    /// Before a step: every decoding sequence gets the block its next token
    /// needs. When the pool has none (free or evictable), the lowest-ranked
    /// running sequence is preempted — lowest `rank` (the tier's priority),
    /// then the one that started last — among those `within_budget`
    /// (the thrash budget) and not orphans, the one that needs the block included
    /// (vLLM preempts itself too). If none may be chosen, the sequence that
    /// needs the block stalls: it skips this step, the others run.
    ///
    /// No deadlock: when every sequence here would stall (nothing could
    /// run), the lowest-ranked one is preempted even past its budget (the
    /// budget bounds thrash, it must not stop the replica), so the
    /// highest-ranked always runs. A sequence alone that still cannot get
    /// a block needs more than the whole pool: it can never finish here
    /// and is handed back in [`Room::unfit`] rather than retried. Each
    /// round removes a sequence or gives one a block, so this ends.
    pub fn make_room(
        &mut self,
        rank: &dyn Fn(&Waiting) -> i64,
        within_budget: &dyn Fn(&Seq) -> bool,
    ) -> Room {
        let mut room = Room::default();
        if self.spec.external {
            return room;
        }
        let pool = self.pool_blocks();
        loop {
            let mut stalled = false;
            let mut i = 0;
            while i < self.running.len() {
                let s = &self.running[i];
                if s.prefill_left > 0 || s.has_room() {
                    i += 1;
                    continue;
                }
                if self.blocks.take(pool, 1) {
                    self.running[i].blocks += 1;
                    i += 1;
                    continue;
                }
                let needy = s.w.id;
                if self.running.len() == 1 || s.kv_blocks_held() + 1 > pool {
                    // Alone (or as if alone), it needs more than the pool.
                    let mut s = self.running.swap_remove(i);
                    self.release(&mut s);
                    room.unfit.push(s);
                    continue;
                }
                let victim = self.lowest(rank, |s| within_budget(s) && !s.w.orphan);
                match victim {
                    Some(v) => {
                        let seq = self.evict(v);
                        room.preempted.push((seq, needy));
                        // Whoever sits at `i` now (the same one, or the
                        // one moved into its place) is looked at again.
                        if v < i {
                            i = 0;
                        }
                    }
                    None => {
                        stalled = true;
                        i += 1;
                    }
                }
            }
            let runnable = self
                .running
                .iter()
                .any(|s| s.prefill_left > 0 || s.has_room());
            if !stalled || runnable || self.running.is_empty() {
                return room;
            }
            // Every sequence stalls: the lowest-ranked goes, budget or not.
            if let Some(v) = self.lowest(rank, |_| true) {
                let seq = self.evict(v);
                let by = seq.w.id;
                room.preempted.push((seq, by));
            }
        }
    }

    /// The lowest-ranked running sequence that `eligible` allows.
    fn lowest(
        &self,
        rank: &dyn Fn(&Waiting) -> i64,
        eligible: impl Fn(&Seq) -> bool,
    ) -> Option<usize> {
        self.running
            .iter()
            .enumerate()
            .filter(|(_, s)| eligible(s))
            .min_by_key(|(_, s)| (rank(&s.w), std::cmp::Reverse(s.started)))
            .map(|(i, _)| i)
    }

    /// Plans and starts the next step; returns when it ends. A decoding
    /// sequence without the block for its next token (see
    /// [`Self::make_room`]) sits the step out.
    pub fn start_step(&mut self, now: Micros) -> Option<Micros> {
        if self.running.is_empty() || self.busy {
            return None;
        }
        let external = self.spec.external;
        // Capped work near its deadline (the last tenth of its window) is
        // protected like the work it would otherwise yield to.
        let urgent = |s: &Seq| {
            s.w.deadline.is_some_and(|d| {
                let span = d.saturating_sub(s.w.arrival);
                now.saturating_add(span / 10) >= d
            })
        };
        // Protected steps: while protected work runs, capped work only
        // fills what keeps the step within the slack of protected work's
        // own step time.
        let protect = match self.backfill_slack {
            Some(slack) if !external && self.running.iter().any(|s| !s.capped || urgent(s)) => {
                Some(slack)
            }
            _ => None,
        };
        let mut budget = self.spec.max_batch_tokens;
        let mut decodes = 0u32;
        let mut context = 0u64;
        let mut deferred: Vec<usize> = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            s.step_prefill = 0;
            s.step_decode = false;
            if s.prefill_left == 0 && budget > 0 && (external || s.has_room()) {
                if protect.is_some() && s.yields && !urgent(s) {
                    deferred.push(i);
                    continue;
                }
                s.step_decode = true;
                decodes += 1;
                budget -= 1;
                context += u64::from(s.w.prompt_tokens) + u64::from(s.generated);
            }
        }
        let mut prefill = 0u32;
        // Prefill in rank order (then start order): a high tier's prompt is
        // not queued inside the batch behind a low tier's long one.
        let ranked = self
            .running
            .iter()
            .filter(|s| s.prefill_left > 0)
            .any(|s| s.rank != self.running.first().map_or(0, |f| f.rank));
        let mut order: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].prefill_left > 0)
            .collect();
        if ranked {
            order.sort_by_key(|&i| (std::cmp::Reverse(self.running[i].rank), i));
        }
        // Capped prefill may only take what keeps the step under the cap
        // (found by bisection: step time grows with prefill tokens).
        let capped_budget = match self.step_cap {
            Some(cap) if order.iter().any(|&i| self.running[i].capped) => {
                let (mut lo, mut hi) = (0u32, budget);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if self.spec.cost.step_time(mid, decodes, context) <= cap {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                lo
            }
            _ => budget,
        };
        let mut deferred_prefill: Vec<usize> = Vec::new();
        for i in order {
            let s = &mut self.running[i];
            if budget == 0 {
                break;
            }
            if protect.is_some() && s.yields && !urgent(s) {
                deferred_prefill.push(i);
                continue;
            }
            let room = if s.capped {
                budget.min(capped_budget.saturating_sub(prefill))
            } else {
                budget
            };
            // A capped sequence alone still moves (at least a block).
            let room = if room == 0 && prefill == 0 && decodes == 0 {
                budget.min(KV_BLOCK_TOKENS)
            } else {
                room
            };
            let chunk = s.prefill_left.min(room);
            if chunk == 0 {
                continue;
            }
            s.step_prefill = chunk;
            budget -= chunk;
            prefill += chunk;
        }
        // The protected step's time, and what capped work may add to it:
        // its decodes first (each costs little), then its prefill.
        if let Some(slack) = protect {
            let base = sane_secs(self.spec.cost.step_time(prefill, decodes, context));
            let limit = base * (1.0 + slack.max(0.0));
            for i in deferred {
                let s = &mut self.running[i];
                if budget == 0 {
                    break;
                }
                let ctx = u64::from(s.w.prompt_tokens) + u64::from(s.generated);
                if self
                    .spec
                    .cost
                    .step_time(prefill, decodes + 1, context + ctx)
                    > limit
                {
                    break;
                }
                s.step_decode = true;
                decodes += 1;
                budget -= 1;
                context += ctx;
            }
            // Where the step prefills, a first token waits for it: capped
            // prefill (compute, like the prompt beside it) gets the smaller
            // slack; its decodes above cost little and let its sequences
            // finish and free their slots.
            let limit = if prefill > 0 {
                limit.min(base * (1.0 + self.backfill_prefill_slack.max(0.0)))
            } else {
                limit
            };
            for i in deferred_prefill {
                if budget == 0 {
                    break;
                }
                let left = self.running[i].prefill_left.min(budget);
                let (mut lo, mut hi) = (0u32, left);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if self.spec.cost.step_time(prefill + mid, decodes, context) <= limit {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                if lo == 0 {
                    break;
                }
                self.running[i].step_prefill = lo;
                budget -= lo;
                prefill += lo;
            }
        }

        if prefill == 0 && decodes == 0 {
            return None;
        }
        let secs = self.spec.cost.step_time(prefill, decodes, context);
        // A cost model must give a finite, positive time; a broken one
        // (NaN, infinite) is treated as one second rather than stalling.
        let secs = if secs.is_finite() {
            secs.max(1e-6)
        } else {
            1.0
        };
        self.busy = true;
        self.busy_seconds += secs;
        self.last_step = secs;
        self.step_until = now.saturating_add(((secs * SEC as f64).ceil() as Micros).max(1));
        self.step_shape = (prefill, decodes, context);
        Some(self.step_until)
    }

    /// Applies the finished step: prefill progress, one token per decoding
    /// sequence, first tokens and completions. Returns finished sequences.
    pub fn finish_step(&mut self, _now: Micros, out: &mut Vec<Action>) -> Vec<(ReqId, Seq)> {
        self.busy = false;
        let external = self.spec.external;
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            let mut produced = false;
            if s.step_prefill > 0 {
                self.prefilled_tokens += u64::from(s.step_prefill);
                s.prefill_left -= s.step_prefill.min(s.prefill_left);
                if !external {
                    Self::share_prefilled(&mut self.blocks, s);
                }
                // The step that completes the prefill samples a token.
                produced = s.prefill_left == 0;
            } else if s.step_decode {
                // The token fed in has its KV written.
                if !external {
                    s.ctx += 1;
                }
                produced = true;
            }
            s.step_prefill = 0;
            s.step_decode = false;
            if produced {
                self.decoded_tokens += 1;
                s.generated += 1;
                if !s.first_token_sent {
                    s.first_token_sent = true;
                    out.push(Action::FirstToken { id: s.w.id });
                }
            }
            if s.generated >= s.w.output_tokens {
                let mut s = self.running.swap_remove(i);
                // Its prompt's shared blocks stay cached.
                self.release(&mut s);
                out.push(Action::Finished {
                    id: s.w.id,
                    gpu_seconds: s.gpu_seconds,
                    wasted_gpu_seconds: s.w.wasted_gpu_seconds,
                });
                done.push((s.w.id, s));
            } else {
                i += 1;
            }
        }
        done
    }

    /// Checks the block accounting against the running sequences: blocks
    /// held plus cached fit the pool, every entry's references are the
    /// sequences sharing it, and the cache's lists agree. O(blocks held
    /// and entries): for tests and debugging, not for every event.
    pub fn check_blocks(&self) -> Result<(), String> {
        let b = &self.blocks;
        let pool = self.pool_blocks();
        if b.private + b.shared + b.cached > pool {
            return Err(format!(
                "over-committed: {} private + {} shared + {} cached > {pool}",
                b.private, b.shared, b.cached
            ));
        }
        let private: u64 = self.running.iter().map(|s| s.blocks).sum();
        if private != b.private {
            return Err(format!("private blocks {} != held {private}", b.private));
        }
        let mut refs: rustc_hash::FxHashMap<u64, u32> = Default::default();
        for s in &self.running {
            if !self.spec.external && s.blocks < kv_blocks(s.private_tokens()) {
                return Err(format!("{} holds fewer blocks than its context", s.w.id));
            }
            for h in &s.shared {
                *refs.entry(*h).or_default() += 1;
            }
        }
        let (mut shared, mut cached) = (0u64, 0u64);
        for (h, e) in &b.entries {
            if refs.get(h).copied().unwrap_or(0) != e.refs {
                return Err(format!(
                    "entry {h}: {} refs, {:?} users",
                    e.refs,
                    refs.get(h)
                ));
            }
            if e.refs == 0 {
                cached += PREFIX_KV_BLOCKS;
                if b.lru.get(&e.stamp) != Some(h) {
                    return Err(format!("cached entry {h} not in the LRU"));
                }
            } else {
                shared += PREFIX_KV_BLOCKS;
            }
        }
        if refs.keys().any(|h| !b.entries.contains_key(h)) {
            return Err("a sequence shares an entry that is gone".into());
        }
        if shared != b.shared
            || cached != b.cached
            || b.lru.len() as u64 * PREFIX_KV_BLOCKS != cached
        {
            return Err(format!(
                "shared {} / cached {} blocks, entries say {shared} / {cached}",
                b.shared, b.cached
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::StepCost;
    use super::super::testkit::{waiting, Linear};
    use super::*;
    use std::sync::Arc;

    #[derive(Debug)]
    struct Broken(f64);

    impl StepCost for Broken {
        fn step_time(&self, _: u32, _: u32, _: u64) -> f64 {
            self.0
        }
    }

    fn spec(cost: Arc<dyn StepCost>, max_batch: u32, external: bool) -> ReplicaSpec {
        ReplicaSpec {
            pool: 0,
            model: 0,
            variant: 0,
            gpus: 1,
            kv_capacity: u64::MAX,
            max_batch,
            max_batch_tokens: 0,
            cost,
            only_tier: None,
            external,
            tag: 0,
        }
    }

    #[test]
    fn estimates_are_finite_whatever_the_cost_model_says() {
        for secs in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -1.0, 1e300] {
            for max_batch in [0, 1, u32::MAX] {
                let mut r = Replica::new(spec(Arc::new(Broken(secs)), max_batch, true));
                let rate = r.throughput_tokens_per_s();
                assert!(rate.is_finite() && rate > 0.0, "{secs} {max_batch}: {rate}");
                let mut w = waiting(0, 0, None);
                w.prompt_tokens = u32::MAX;
                w.output_tokens = u32::MAX;
                r.admit(Seq::from_waiting(w, 0), 0);
                let _ = r.time_to_free();
            }
        }
    }

    #[test]
    fn respec_keeps_what_runs_and_admits_nothing_over_the_new_limits() {
        let mut r = Replica::new(spec(Arc::new(Linear), 4, false));
        for id in 0..3 {
            r.admit(Seq::from_waiting(waiting(id, 0, None), 0), 0);
        }
        assert!(r.running.iter().all(|s| s.w.started));
        let mut small = spec(Arc::new(Linear), 2, false);
        small.kv_capacity = 20;
        r.respec(small);
        assert_eq!(r.running.len(), 3);
        assert_eq!(r.free_seq_slots(), 0);
        assert_eq!(r.kv_free(), 0);
    }

    #[test]
    fn finished_prompts_are_remembered_for_affinity() {
        let mut r = Replica::new(spec(Arc::new(Linear), 4, false));
        r.remember_prefix(&[1, 2, 3]);
        assert_eq!(r.prefix_match(&[1, 2, 9]), 2);
        assert_eq!(r.cached_prefix_tokens(&[1, 2, 3]), 3 * BLOCK_TOKENS);
        assert_eq!(r.position(5), None);
    }

    /// A replica of `kv` tokens taking prefill chunks of 4,096 tokens.
    fn paged(kv: u64, max_batch: u32) -> Replica {
        let mut sp = spec(Arc::new(Linear), max_batch, false);
        sp.kv_capacity = kv;
        sp.max_batch_tokens = 4096;
        Replica::new(sp)
    }

    /// A step's prefill budget goes to higher-ranked sequences first, and
    /// capped sequences only get what keeps the step under the cap.
    #[test]
    fn prefill_goes_by_rank_and_capped_work_keeps_steps_short() {
        let mut r = paged(1_000_000, 8);
        // Started first: a low-ranked, capped 6,000-token prompt.
        let mut low = Seq::from_waiting(seq(0, 6000, 5, &[]), 0);
        low.capped = true;
        r.admit(low, 0);
        let mut high = Seq::from_waiting(seq(1, 3000, 5, &[]), 0);
        high.rank = 100;
        r.admit(high, 0);
        r.start_step(0);
        let chunk = |r: &Replica, id: ReqId| {
            r.running
                .iter()
                .find(|s| s.w.id == id)
                .map_or(0, |s| s.step_prefill)
        };
        assert_eq!(chunk(&r, 1), 3000, "the high-ranked prompt goes first");
        assert_eq!(chunk(&r, 0), 1096, "the rest of the 4,096 budget");
        // With a cap of 21 ms (Linear: 1 ms + 0.01 ms a prefill token), the
        // capped prompt only fills the step up to it.
        let mut r = paged(1_000_000, 8);
        r.step_cap = Some(0.021);
        let mut low = Seq::from_waiting(seq(0, 6000, 5, &[]), 0);
        low.capped = true;
        r.admit(low, 0);
        let until = r.start_step(0).unwrap();
        assert_eq!(chunk(&r, 0), 2000);
        assert!(until <= 21_000, "{until}");
        // An uncapped prompt is not held to the cap.
        let mut r = paged(1_000_000, 8);
        r.step_cap = Some(0.021);
        r.admit(Seq::from_waiting(seq(0, 6000, 5, &[]), 0), 0);
        r.start_step(0);
        assert_eq!(chunk(&r, 0), 4096);
        // A cap no step can meet still lets capped work move.
        let mut r = paged(1_000_000, 8);
        r.step_cap = Some(0.0);
        let mut low = Seq::from_waiting(seq(0, 6000, 5, &[]), 0);
        low.capped = true;
        r.admit(low, 0);
        assert!(r.start_step(0).is_some());
        assert!(chunk(&r, 0) > 0);
        assert_eq!(r.pending_prefill(0), 6000);
        assert_eq!(r.pending_prefill(1), 0, "nothing ranked above 0");
    }

    /// Batch prefill beside work with a first-token SLO: a tenth more on a
    /// step that only decodes, a hundredth on one that prefills (a first
    /// token waits for that step).
    #[test]
    fn batch_prefill_barely_lengthens_a_step_that_prefills_a_first_token() {
        let batch = |r: &mut Replica| {
            let mut low = Seq::from_waiting(seq(9, 6000, 5, &[]), 0);
            low.capped = true;
            low.yields = true;
            r.admit(low, 0);
        };
        let chunk = |r: &Replica| {
            r.running
                .iter()
                .find(|s| s.w.id == 9)
                .map_or(0, |s| s.step_prefill)
        };
        let slack = |r: &mut Replica| {
            r.backfill_slack = Some(0.1);
            r.backfill_prefill_slack = 0.01;
        };
        // Linear: 1 ms a step, 0.01 ms a prefill token, 0.1 ms a decode.
        // A 2,000-token prompt: 21 ms; 1% more is 21 batch tokens (10%
        // would be 210).
        let mut r = paged(1_000_000, 8);
        slack(&mut r);
        let mut high = Seq::from_waiting(seq(1, 2000, 5, &[]), 0);
        high.rank = 100;
        r.admit(high, 0);
        batch(&mut r);
        r.start_step(0);
        assert!((20..=21).contains(&chunk(&r)), "{}", chunk(&r));
        // A step where it only decodes (1.1 ms): 10% more, 11 tokens.
        let mut r = paged(1_000_000, 8);
        slack(&mut r);
        let mut high = Seq::from_waiting(seq(1, 10, 50, &[]), 0);
        high.rank = 100;
        r.admit(high, 0);
        let mut out = Vec::new();
        r.start_step(0);
        r.finish_step(0, &mut out);
        batch(&mut r);
        r.start_step(0);
        assert!(r.running.iter().any(|s| s.w.id == 1 && s.step_decode));
        assert!((10..=11).contains(&chunk(&r)), "{}", chunk(&r));
    }

    #[test]
    fn a_request_starting_at_the_next_boundary_does_not_pay_for_the_chunk_in_flight() {
        let mut r = paged(1_000_000, 8);
        r.admit(Seq::from_waiting(seq(0, 6000, 5, &[]), 0), 0);
        // Before the step starts, both read the whole 6,000 pending.
        assert_eq!(
            r.first_token_time(100, 0, true),
            r.first_token_time(100, 0, false)
        );
        r.start_step(0);
        assert_eq!(r.running[0].step_prefill, 4096);
        let next = r.first_token_time(100, 0, true);
        let later = r.first_token_time(100, 0, false);
        // At the boundary 1,904 of the prompt and our 100 are left: one
        // step. Later, the pending 6,000 stand for what it will meet: the
        // chunk in flight counted again, one full step more.
        let one = sane_secs(r.spec.cost.step_time(2004, 0, 0));
        let full = sane_secs(r.spec.cost.step_time(4096, 0, 0));
        assert!((next as f64 / SEC as f64 - one).abs() < 1e-5, "{next}");
        assert!(
            (later.saturating_sub(next) as f64 / SEC as f64 - full).abs() < 1e-5,
            "{later} {next}"
        );
    }

    fn seq(id: ReqId, prompt: u32, output: u32, prefix: &[u64]) -> Waiting {
        let mut w = waiting(id, 0, None);
        w.prompt_tokens = prompt;
        w.output_tokens = output;
        w.prefix_blocks = prefix.to_vec();
        w
    }

    /// Every running sequence at the same tier: ranked by start only.
    fn flat(_: &Waiting) -> i64 {
        0
    }

    /// Runs one step (blocks found first); returns what was preempted and
    /// what finished.
    fn step(r: &mut Replica, now: Micros, budget: u32) -> (Room, Vec<ReqId>) {
        let room = r.make_room(&flat, &|s: &Seq| s.w.preemptions < budget);
        let mut out = Vec::new();
        let done = match r.start_step(now) {
            Some(_) => r.finish_step(now, &mut out),
            None => Vec::new(),
        };
        r.check_blocks().unwrap();
        (room, done.into_iter().map(|(id, _)| id).collect())
    }

    #[test]
    fn a_sequence_takes_its_prompt_blocks_then_one_per_16_decoded_tokens() {
        let mut r = paged(16 * 1000, 8);
        let w = seq(0, 100, 40, &[]);
        assert!(r.can_start(&w, 0));
        r.admit(Seq::from_waiting(w, 0), 0);
        // 100 prompt tokens: 7 blocks, nothing for the output yet.
        assert_eq!(r.kv_used(), 7 * 16);
        assert_eq!(r.kv_free(), (1000 - 7) * 16);
        r.check_blocks().unwrap();
        // The prefill step samples token 1; then each decode writes one KV
        // token: 100 → 112 needs no block, 113 a new one.
        let mut used = Vec::new();
        for t in 0..20 {
            step(&mut r, t, 2);
            used.push(r.kv_used() / 16);
        }
        assert_eq!(r.running[0].generated, 20);
        // Context after 20 steps: 100 prefilled + 19 decoded = 119 tokens.
        assert_eq!(r.running[0].ctx, 119);
        assert_eq!(r.kv_used(), 8 * 16);
        assert_eq!(used.first(), Some(&7));
        // The 8th block came before the 13th decode (writing token 113).
        assert_eq!(used.iter().filter(|&&b| b == 7).count(), 13);
        for t in 20..60 {
            step(&mut r, t, 2);
        }
        assert!(r.running.is_empty());
        assert_eq!((r.kv_used(), r.kv_cached()), (0, 0));
    }

    #[test]
    fn two_running_sequences_share_a_prefix_once() {
        let mut r = paged(16 * 1000, 8);
        // 1,100 tokens: two whole 512-token prefix blocks and a tail.
        r.admit(Seq::from_waiting(seq(0, 1100, 50, &[7, 8, 9]), 0), 0);
        assert_eq!(r.kv_used(), kv_blocks(1100) * 16);
        assert_eq!(r.cached_prefix_tokens(&[7, 8, 9]), 0, "not prefilled yet");
        step(&mut r, 0, 2);
        // Prefilled: its two whole blocks are shared entries now.
        assert_eq!(r.prefix_match(&[7, 8, 9]), 2);
        assert_eq!(r.cached_prefix_tokens(&[7, 8]), 2 * BLOCK_TOKENS);
        let before = r.kv_used();
        let w = seq(1, 1100, 50, &[7, 8, 9]);
        let cached = r.cached_prefix_tokens(&w.prefix_blocks);
        assert!(r.can_start(&w, cached));
        r.admit(Seq::from_waiting(w, cached), 1);
        // The second takes blocks for its 76-token tail only.
        assert_eq!(r.running[1].prefill_left, 1100 - 1024);
        assert_eq!(r.kv_used() - before, kv_blocks(76) * 16);
        assert_eq!(r.blocks.entries[&7].refs, 2);
        r.check_blocks().unwrap();
        // Both finish: the prefix stays cached, unreferenced, evictable.
        for t in 1..60 {
            step(&mut r, t, 2);
        }
        assert!(r.running.is_empty());
        assert_eq!(r.kv_used(), 0);
        assert_eq!(r.kv_cached(), 2 * PREFIX_KV_BLOCKS * 16);
        assert_eq!(r.kv_free(), 16 * 1000, "cached blocks count as free");
        assert_eq!(r.prefix_match(&[7, 8, 9]), 2);
    }

    #[test]
    fn cached_prefixes_are_evicted_least_recently_used_tail_first() {
        // Room for three prefix blocks and 16 blocks more.
        let mut r = paged(16 * (3 * PREFIX_KV_BLOCKS + 16), 8);
        r.remember_prefix(&[1, 2]);
        r.remember_prefix(&[3]);
        assert_eq!(r.kv_cached(), 3 * PREFIX_KV_BLOCKS * 16);
        // Using [1, 2] again makes 3 the least recently used.
        r.remember_prefix(&[1, 2]);
        // A prompt of 40 blocks needs 24 blocks beyond the free 16: one
        // entry goes, the oldest.
        let w = seq(0, 40 * 16, 4, &[]);
        assert!(r.can_start(&w, 0));
        r.admit(Seq::from_waiting(w, 0), 0);
        assert_eq!(r.prefix_match(&[3]), 0);
        assert_eq!(r.prefix_match(&[1, 2]), 2);
        r.check_blocks().unwrap();
        // Next to go is the tail of [1, 2], then its head.
        r.evict(0);
        let w = seq(1, (16 + 2 * PREFIX_KV_BLOCKS as u32) * 16, 4, &[]);
        r.admit(Seq::from_waiting(w, 0), 0);
        assert_eq!(r.prefix_match(&[1, 2]), 1, "the tail went first");
        r.check_blocks().unwrap();
    }

    #[test]
    fn a_decode_without_a_free_block_preempts_the_latest_started() {
        // 10 blocks: two prompts of 64 tokens (4 blocks each) and 2 free.
        let mut r = paged(16 * 10, 8);
        r.admit(Seq::from_waiting(seq(0, 64, 90, &[]), 0), 0);
        let w = seq(1, 64, 90, &[]);
        assert!(r.can_start(&w, 0), "prompt blocks and a 1-block watermark");
        r.admit(Seq::from_waiting(w, 0), 1);
        let mut preempted = Vec::new();
        for t in 0..40 {
            let (room, _) = step(&mut r, t, 2);
            preempted.extend(room.preempted.iter().map(|(s, by)| (s.w.id, *by)));
            assert!(room.unfit.is_empty());
        }
        // Both grew a block each; the third block needed finds none: the one
        // that started last goes (recompute later), the first runs on.
        assert_eq!(preempted, vec![(1, 0)]);
        assert_eq!(r.running.len(), 1);
        assert_eq!(r.running[0].w.id, 0);
        assert_eq!(r.running[0].generated, 40);
    }

    #[test]
    fn at_its_thrash_budget_a_sequence_is_spared_and_one_that_needs_a_block_stalls() {
        let mut r = paged(16 * 10, 8);
        r.admit(Seq::from_waiting(seq(0, 64, 100, &[]), 0), 0);
        let mut w = seq(1, 64, 100, &[]);
        w.preemptions = 2;
        r.admit(Seq::from_waiting(w, 0), 1);
        // Sequence 1 is at its budget of 2: when 0 needs a block, 0 itself
        // is the only one that may go (vLLM preempts itself too).
        let mut preempted = Vec::new();
        for t in 0..40 {
            let (room, _) = step(&mut r, t, 2);
            preempted.extend(room.preempted.iter().map(|(s, by)| (s.w.id, *by)));
        }
        assert_eq!(preempted, vec![(0, 0)]);
        assert_eq!(r.running[0].w.id, 1);
        // Both at their budget: the one that needs a block stalls while the
        // other runs; neither is preempted for it.
        let mut r = paged(16 * 10, 8);
        for (id, prompt) in [(0, 64), (1, 72)] {
            let mut w = seq(id, prompt, 50, &[]);
            w.preemptions = 2;
            r.admit(Seq::from_waiting(w, 0), id);
        }
        // After the prefill 0 fills its 4 blocks, 1 has 5 with room to 80
        // tokens, 1 block is free (0 takes it); then 1 runs out while 0 has room.
        let mut stalled_alone = false;
        for t in 0..12 {
            let gen = |r: &Replica| (r.running[0].generated, r.running[1].generated);
            let (g0, g1) = gen(&r);
            let (room, _) = step(&mut r, t, 2);
            assert!(room.preempted.is_empty(), "step {t}");
            let (h0, h1) = gen(&r);
            stalled_alone |= h0 > g0 && h1 == g1;
        }
        assert!(stalled_alone, "1 sat a step out while 0 decoded");
        assert_eq!(r.running.len(), 2);
    }

    #[test]
    fn when_every_sequence_would_stall_the_lowest_goes_past_its_budget() {
        let mut r = paged(16 * 10, 8);
        for id in 0..2 {
            let mut w = seq(id, 64, 90, &[]);
            w.preemptions = 2;
            r.admit(Seq::from_waiting(w, 0), id);
        }
        let (mut preempted, mut finished) = (Vec::new(), Vec::new());
        let mut steps = 0;
        while !r.running.is_empty() && steps < 1000 {
            let (room, done) = step(&mut r, steps, 2);
            preempted.extend(room.preempted.iter().map(|(s, _)| s.w.id));
            assert!(room.unfit.is_empty());
            finished.extend(done);
            steps += 1;
        }
        assert_eq!(finished, vec![0]);
        // Both need their 6th block at once: the later one goes (over its
        // budget), and the first finishes.
        assert_eq!(preempted, vec![1]);
        assert!(r.running.is_empty(), "it finished: no deadlock");
    }

    #[test]
    fn a_lone_sequence_that_can_never_fit_is_handed_back_not_retried() {
        let mut r = paged(16 * 100, 8);
        r.admit(Seq::from_waiting(seq(0, 64, 1000, &[]), 0), 0);
        // A swap shrinks the pool to 5 blocks: 4 for the prompt, 1 to grow.
        let mut small = r.spec.clone();
        small.kv_capacity = 16 * 5;
        r.respec(small);
        assert!(!r.can_start(&seq(1, 64, 1000, &[]), 0), "never fits");
        let mut unfit = Vec::new();
        let mut steps = 0;
        while !r.running.is_empty() && steps < 1000 {
            let (room, _) = step(&mut r, steps, 2);
            unfit.extend(room.unfit.iter().map(|s| (s.w.id, s.generated)));
            assert!(room.preempted.is_empty());
            steps += 1;
        }
        // It ran until its context filled the pool (80 tokens: 64 + 16),
        // then was handed back once.
        assert_eq!(unfit, vec![(0, 17)]);
        assert!(steps < 30, "{steps} steps");
        assert_eq!(r.kv_used(), 0);
    }

    #[test]
    fn external_replicas_hold_prompt_and_output_and_never_preempt() {
        let mut sp = spec(Arc::new(Linear), 4, true);
        sp.kv_capacity = 16 * 100;
        let mut r = Replica::new(sp);
        let w = seq(0, 100, 60, &[]);
        assert!(r.can_start(&w, 0));
        r.admit(Seq::from_waiting(w, 0), 0);
        assert_eq!(r.kv_used(), 10 * 16);
        let room = r.make_room(&flat, &|_: &Seq| false);
        assert!(room.preempted.is_empty() && room.unfit.is_empty());
        r.check_blocks().unwrap();
        r.evict(0);
        assert_eq!(r.kv_used(), 0);
    }
}
