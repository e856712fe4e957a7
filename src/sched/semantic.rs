//! The semantic cache a tier declares (`cache { semantic { similarity
//! 0.92, entries 5000, ttl 1h } }`), inside the scheduler beside the exact
//! one ([`super::cache`]): looked up at the same point (after the policy
//! classified, routed and admitted the request), charged the same way (one
//! request of the requests quota, no tokens, no GPU time).
//!
//! The gateway splits a request ([`question`]) into its question (the text
//! of the last user message, or a completion's prompt) and everything else,
//! hashed exactly: the system prompt, earlier turns, `max_tokens`, tools,
//! sampling fields, and every non-text part of the last message (images,
//! audio, files: hashed as sent, in place, so another image or none is
//! another scope). It then embeds the question's compared part
//! (`embed::Embedder::question_start`: the last paragraph, or the last
//! [`crate::embed`] window of a long text) and folds into the context hash
//! ([`context`]) the question's text before that part, exactly, and its
//! guard signature ([`crate::embed::guard`]: negations, numbers, dates,
//! names). Only requests whose context is identical are compared, by
//! cosine similarity of their compared parts; so a cached answer is never
//! reused for another system prompt, conversation, length limit, tool set,
//! image, long document, or a question differing in a number, a date, a
//! name or a negation. The scope also binds the tier, the tenant (unless
//! `shared`) and the routed `model.variant`, as the exact cache's key does.
//! The end user (`user`) is not part of it, as for the exact cache.
//!
//! Pure: the vectors come in with the arrival, time is the scheduler's.
//! A replay has no prompts, hence no probes: `kiln simulate` counts no
//! semantic hits (README says so).

use super::cache::{self, Bounds, Key};
use super::Micros;
use crate::embed::SemanticCache;
use crate::graph::{DecisionGraph, SemanticSpec, TierId};
use hashlink::LinkedHashMap;
use rustc_hash::FxHashMap as HashMap;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// A cacheable request split for the semantic cache.
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    /// The content hash of the request with its question's text left out
    /// (non-text parts stay, in place).
    pub rest: Key,
    /// The question's text (a chat message's text parts joined by `\n`).
    pub text: String,
}

/// The question of a cacheable request: the last message's text when it is
/// the user's (`chat`), or the prompt (a completion, when it is one
/// string). `None` when the request is not cacheable or has no such text.
pub fn question(body: &Value, chat: bool) -> Option<Question> {
    let mut rest = body.clone();
    let text = if chat {
        let msgs = rest.get_mut("messages")?.as_array_mut()?;
        let last = msgs.last_mut()?;
        if last.get("role").and_then(Value::as_str) != Some("user") {
            return None;
        }
        let content = last.get_mut("content")?;
        match content {
            Value::String(s) => {
                let t = std::mem::take(s);
                *content = Value::Null;
                t
            }
            Value::Array(parts) => {
                // Text parts give their text and keep their place; any
                // other part (an image, audio, a file) stays as it is, so
                // it is hashed exactly into the context.
                let mut texts = Vec::new();
                for p in parts.iter_mut() {
                    let is_text = match p.get("type") {
                        Some(t) => t.as_str() == Some("text"),
                        None => true,
                    };
                    if !is_text {
                        continue;
                    }
                    if let Some(t) = p.get_mut("text") {
                        if let Value::String(s) = t {
                            texts.push(std::mem::take(s));
                        }
                        *t = Value::Null;
                    }
                }
                texts.join("\n")
            }
            _ => return None,
        }
    } else {
        let p = rest.get_mut("prompt")?;
        let t = p.as_str()?.to_string();
        *p = Value::Null;
        t
    };
    if text.trim().is_empty() {
        return None;
    }
    let rest = cache::content_key(&rest)?;
    Some(Question { rest, text })
}

/// The context hash a probe is compared under: the request without its
/// question ([`Question::rest`]), the question's text before `start` (where
/// its embedded part begins), exactly, and the guard signature of the whole
/// question.
pub fn context(rest: &Key, text: &str, start: usize) -> Key {
    let mut h = Sha256::new();
    h.update(b"kiln-semantic-context-v2\n");
    h.update(rest);
    let head = text.get(..start).unwrap_or(text);
    h.update((head.len() as u64).to_le_bytes());
    h.update(head.as_bytes());
    for part in crate::embed::guard::signature(text) {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

/// What the gateway computed for a cacheable request while some tier of
/// the policy has a semantic cache.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// SHA-256 of the request without its question ([`super::cache`]'s
    /// canonical form, the question's text left out).
    pub context: Key,
    /// The question's embedding (L2-normalised by the embedder; the cache
    /// normalises again).
    pub vector: Arc<[f32]>,
}

/// Misses waiting for their answer to be stored: bounded, oldest dropped
/// first (an answer that never completes must not hold memory).
const MAX_PENDING: usize = 4096;

struct Tier {
    spec: SemanticSpec,
    cache: SemanticCache<Arc<str>>,
}

/// The tiers' semantic caches, and the misses whose answers may be stored.
pub struct SemanticCaches {
    tiers: HashMap<TierId, Tier>,
    pending: LinkedHashMap<Key, (TierId, String, Arc<[f32]>)>,
    /// The same bounds as the exact caches', counted apart: an answer of
    /// at most `max_entry_bytes`, all tiers' entries (answers, vectors,
    /// bookkeeping) at most `max_total_bytes`.
    bounds: Bounds,
}

impl SemanticCaches {
    /// Empty caches for the tiers of `g` that declare one, within `bounds`.
    pub fn new(g: &DecisionGraph, bounds: Bounds) -> SemanticCaches {
        let tiers = g
            .tiers
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                let spec = t.cache.semantic?;
                let cache =
                    SemanticCache::new(spec.max_entries as usize, spec.ttl_us, spec.min_similarity);
                Some((i as TierId, Tier { spec, cache }))
            })
            .collect();
        SemanticCaches {
            tiers,
            pending: LinkedHashMap::new(),
            bounds,
        }
    }

    pub fn spec(&self, tier: TierId) -> Option<SemanticSpec> {
        self.tiers.get(&tier).map(|t| t.spec)
    }

    /// Where a probe is compared: its context, tier, tenant (`None` when
    /// shared) and variant, length-prefixed so no two scopes collide.
    pub fn scope(context: &Key, tier: &str, tenant: Option<&str>, variant: &str) -> String {
        let mut s = String::with_capacity(128);
        for part in [tier, variant, tenant.unwrap_or("*")] {
            s.push_str(&part.len().to_string());
            s.push(':');
            s.push_str(part);
        }
        s.push_str(if tenant.is_some() { "t" } else { "*" });
        for b in context {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// The nearest cached answer in `scope` at least as similar as the
    /// tier's threshold, with its similarity. A vector the cache refuses
    /// (wrong dimension, not finite) is a miss.
    pub fn lookup(
        &mut self,
        tier: TierId,
        scope: &str,
        vector: &[f32],
        now: Micros,
    ) -> Option<(Arc<str>, f32)> {
        let t = self.tiers.get_mut(&tier)?;
        t.cache.lookup(scope, vector, now).ok().flatten()
    }

    /// A miss whose complete answer, stored under `key`, is to be cached
    /// under `vector` in `scope`.
    pub fn note_miss(&mut self, key: Key, tier: TierId, scope: String, vector: Arc<[f32]>) {
        if !self.tiers.contains_key(&tier) {
            return;
        }
        self.pending.replace(key, (tier, scope, vector));
        while self.pending.len() > MAX_PENDING {
            self.pending.pop_front();
        }
    }

    /// Stores the answer of a noted miss; `false` when `key` was not noted
    /// (or was dropped), the answer is over the entry bound, other tiers
    /// hold the whole byte bound, or the cache refused the vector. The
    /// tier's least recently used entries make room.
    pub fn store(&mut self, key: &Key, payload: Arc<str>, now: Micros) -> bool {
        let Some((tier, scope, vector)) = self.pending.remove(key) else {
            return false;
        };
        let answer = payload.len() as u64;
        if answer > self.bounds.max_entry_bytes {
            return false;
        }
        let need = SemanticCache::<Arc<str>>::entry_bytes(answer, vector.len());
        let others: u64 = self
            .tiers
            .iter()
            .filter(|(id, _)| **id != tier)
            .map(|(_, t)| t.cache.bytes())
            .sum();
        let Some(t) = self.tiers.get_mut(&tier) else {
            return false;
        };
        t.cache.purge(now);
        while others.saturating_add(t.cache.bytes()).saturating_add(need)
            > self.bounds.max_total_bytes
        {
            if !t.cache.evict_lru() {
                return false;
            }
        }
        t.cache
            .insert_sized(&scope, vector.to_vec(), payload, answer, now)
            .is_ok()
    }

    /// Drops every tier's expired entries (the gateway does before it
    /// reports how many there are).
    pub fn purge(&mut self, now: Micros) {
        for t in self.tiers.values_mut() {
            t.cache.purge(now);
        }
    }

    /// Entries cached for `tier`.
    pub fn len(&self, tier: TierId) -> usize {
        self.tiers.get(&tier).map_or(0, |t| t.cache.len())
    }

    /// Bytes all tiers' semantic caches hold.
    pub fn total_bytes(&self) -> u64 {
        self.tiers.values().map(|t| t.cache.bytes()).sum()
    }

    /// Misses waiting for their answer.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_answers_are_bounded_in_bytes() {
        let g = super::super::testkit::graph(
            "pool p { gpus 1 kind \"H100-80GB\" memory 80GB }\n\
             model m { variant fp16 { memory 10GB pools [p] } }\n\
             tier a { priority 2 cache { semantic { similarity 0.9, entries 100, ttl 1h } } }\n\
             classify { default => tier a }\nroute [a] m { default => fp16 }\n",
        );
        let each = SemanticCache::<Arc<str>>::entry_bytes(50, 3);
        let bounds = Bounds {
            max_entry_bytes: 60,
            max_total_bytes: 2 * each,
        };
        let mut c = SemanticCaches::new(&g, bounds);
        let answer: Arc<str> = Arc::from("x".repeat(50));
        for i in 0..3u8 {
            let v: Arc<[f32]> = Arc::from(vec![1.0, f32::from(i), 0.0]);
            c.note_miss([i; 32], 0, format!("s{i}"), v);
            assert!(c.store(&[i; 32], answer.clone(), 0));
            assert!(c.total_bytes() <= bounds.max_total_bytes);
        }
        assert_eq!(c.len(0), 2, "the least recently used made room");
        // An answer over the entry bound is not kept.
        c.note_miss([9; 32], 0, "s9".into(), Arc::from(vec![0.0, 1.0, 0.0]));
        assert!(!c.store(&[9; 32], Arc::from("y".repeat(61)), 0));
        assert_eq!(c.len(0), 2);
        // Expired entries go at a purge.
        c.purge(3_600_000_001);
        assert_eq!((c.len(0), c.total_bytes()), (0, 0));
    }

    #[test]
    fn scopes_separate_tenant_shared_variant_and_context() {
        let c = [1u8; 32];
        let d = [2u8; 32];
        let a = SemanticCaches::scope(&c, "t", Some("x"), "m.fp16");
        assert_ne!(a, SemanticCaches::scope(&c, "t", Some("y"), "m.fp16"));
        assert_ne!(a, SemanticCaches::scope(&c, "t", None, "m.fp16"));
        assert_ne!(a, SemanticCaches::scope(&c, "t", Some("x"), "m.int4"));
        assert_ne!(a, SemanticCaches::scope(&d, "t", Some("x"), "m.fp16"));
        // A tenant literally named `*` is not the shared scope.
        assert_ne!(
            SemanticCaches::scope(&c, "t", Some("*"), "v"),
            SemanticCaches::scope(&c, "t", None, "v")
        );
        // Length prefixes: no two splits of one string collide.
        assert_ne!(
            SemanticCaches::scope(&c, "ab", Some("c"), "v"),
            SemanticCaches::scope(&c, "a", Some("bc"), "v")
        );
    }
}
