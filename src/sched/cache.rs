//! The exact-response cache a tier declares (`exact_cache`, `cache { exact
//! { entries 10000, ttl 10m } }`): which requests may be answered from it,
//! the key an answer is stored under, and the store itself (least recently
//! used first out, a time to live, and byte bounds).
//!
//! Pure like the rest of the scheduler: time is the scheduler's [`Micros`],
//! passed in; the gateway and `kiln simulate` run this same code (the
//! gateway with the answers' bodies, the replay with their sizes only).
//!
//! **What is cacheable.** Only a request whose answer is determined by its
//! body: `temperature` 0, or a `seed`; one choice (`n` absent or 1). Any
//! other request is never looked up nor stored.
//!
//! **The key.** SHA-256 of the request's canonical JSON (keys sorted, no
//! whitespace, integral numbers written as integers, so `0` and `0.0` are
//! one temperature), without the fields that do not change the answer:
//! [`IGNORED`] (`stream`, `stream_options`, `user`, `metadata`, `store`).
//! Everything else (messages, tools, `max_tokens`, `stop`, `logprobs`,
//! `response_format`, …) is part of it: a field we do not know could change
//! the answer, so it separates answers. The scheduler then binds that
//! content hash to the tier, the tenant (unless the tier's cache is
//! `shared`) and the routed `model.variant` ([`scoped_key`]).
//!
//! **Memory.** Each tier's store holds at most its `entries`; one answer is
//! at most [`Bounds::max_entry_bytes`] and all tiers' answers together at
//! most [`Bounds::max_total_bytes`], so a hostile client that sends many
//! distinct deterministic requests with long answers evicts its own entries
//! and never grows the gateway.

use super::Micros;
use crate::graph::{DecisionGraph, ExactSpec, TierId};
use hashlink::LruCache;
use rustc_hash::FxBuildHasher;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// A SHA-256 digest: a request's content hash, or a scoped cache key.
pub type Key = [u8; 32];

/// Request fields that do not change the answer: left out of the key, so a
/// streamed and a plain request (or two end users) share one answer.
pub const IGNORED: &[&str] = &["stream", "stream_options", "user", "metadata", "store"];

/// Bytes an entry costs beyond its answer: its key and bookkeeping.
pub const ENTRY_OVERHEAD: u64 = 128;

/// Whether a request body's answer is determined by the body: temperature
/// 0 or a seed, and one choice.
pub fn cacheable(body: &Value) -> bool {
    let Some(o) = body.as_object() else {
        return false;
    };
    let one_choice = match o.get("n") {
        None | Some(Value::Null) => true,
        Some(n) => n.as_f64() == Some(1.0),
    };
    let greedy = o
        .get("temperature")
        .and_then(Value::as_f64)
        .is_some_and(|t| t == 0.0);
    let seeded = matches!(o.get("seed"), Some(s) if s.is_number());
    one_choice && (greedy || seeded)
}

/// The request's content hash, or `None` when it is not [`cacheable`].
pub fn content_key(body: &Value) -> Option<Key> {
    if !cacheable(body) {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"kiln-exact-v1\n");
    canonical(body, &mut h, true);
    Some(h.finalize().into())
}

/// Feeds the canonical JSON of `v` into `h`: object keys sorted, no
/// whitespace, integral numbers as integers; at the top level the
/// [`IGNORED`] fields are left out.
fn canonical(v: &Value, h: &mut Sha256, top: bool) {
    match v {
        Value::Null => h.update(b"null"),
        Value::Bool(b) => h.update(if *b { &b"true"[..] } else { &b"false"[..] }),
        Value::Number(n) => {
            let text = match n.as_f64() {
                Some(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 9.0e15 => {
                    format!("{}", x as i64)
                }
                _ => n.to_string(),
            };
            h.update(text.as_bytes());
        }
        Value::String(s) => {
            // serde_json escapes a string one way only.
            h.update(Value::String(s.clone()).to_string().as_bytes());
        }
        Value::Array(items) => {
            h.update(b"[");
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                canonical(x, h, false);
            }
            h.update(b"]");
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map
                .keys()
                .filter(|k| !(top && IGNORED.contains(&k.as_str())))
                .collect();
            keys.sort();
            h.update(b"{");
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                h.update(Value::String((*k).clone()).to_string().as_bytes());
                h.update(b":");
                if let Some(x) = map.get(*k) {
                    canonical(x, h, false);
                }
            }
            h.update(b"}");
        }
    }
}

/// The key an answer is stored under: the content hash bound to the tier,
/// the tenant (`None` when the tier's cache is shared) and the routed
/// `model.variant`. Names, not ids, so a key means the same thing in the
/// decision log and across policy versions.
pub fn scoped_key(content: &Key, tier: &str, tenant: Option<&str>, variant: &str) -> Key {
    let mut h = Sha256::new();
    h.update(b"kiln-exact-scope-v1\n");
    for part in [tier, variant] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    match tenant {
        Some(t) => {
            h.update(b"t");
            h.update((t.len() as u64).to_le_bytes());
            h.update(t.as_bytes());
        }
        None => h.update(b"*"),
    }
    h.update(content);
    h.finalize().into()
}

/// A key as the decision log and explain show it: its first 16 bytes in
/// hex (enough to tell entries apart, short enough to read).
pub fn show_key(k: &Key) -> String {
    k.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Parses a key written by [`show_key`] (or a full 64-digit one) back into
/// the bytes the replay compares; `None` for anything else.
pub fn parse_key(s: &str) -> Option<Key> {
    if !(s.len() == 32 || s.len() == 64) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut k = [0u8; 32];
    for (i, slot) in k.iter_mut().enumerate().take(s.len() / 2) {
        *slot = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(k)
}

/// Memory bounds beyond each tier's `entries`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The largest answer stored (bytes); a longer one is served, not kept.
    pub max_entry_bytes: u64,
    /// All tiers' stored answers together (bytes).
    pub max_total_bytes: u64,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            max_entry_bytes: 1 << 20,
            max_total_bytes: 256 << 20,
        }
    }
}

/// One stored answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// When it stops being served.
    pub expires: Micros,
    /// What it costs of the byte bound (answer plus [`ENTRY_OVERHEAD`]).
    pub bytes: u64,
    /// The answer's body (the gateway's); `None` in a replay, which only
    /// needs to know that there is one.
    pub payload: Option<Arc<str>>,
    /// The request's content hash, where the caller gave it
    /// ([`Caches::insert_content`]).
    pub content: Option<Key>,
}

/// Why an answer was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStored {
    /// The tier has no exact cache.
    NoCache,
    /// The answer is over [`Bounds::max_entry_bytes`].
    TooLarge,
    /// Other tiers hold the whole byte bound.
    Full,
}

struct TierStore {
    spec: ExactSpec,
    lru: LruCache<Key, Entry, FxBuildHasher>,
    bytes: u64,
}

/// Every tier's exact cache.
pub struct Caches {
    tiers: Vec<Option<TierStore>>,
    bounds: Bounds,
    bytes: u64,
    /// Entries per content hash, over every tier and scope
    /// ([`Caches::holds_content`]).
    contents: rustc_hash::FxHashMap<Key, u32>,
}

/// One entry fewer under `e`'s content hash.
fn forget(contents: &mut rustc_hash::FxHashMap<Key, u32>, e: &Entry) {
    let Some(c) = e.content else { return };
    if let Some(n) = contents.get_mut(&c) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            contents.remove(&c);
        }
    }
}

impl Caches {
    /// Empty stores for the tiers of `g` that declare an exact cache.
    pub fn new(g: &DecisionGraph, bounds: Bounds) -> Caches {
        let tiers = g
            .tiers
            .iter()
            .map(|t| {
                t.cache.exact.map(|spec| TierStore {
                    spec,
                    lru: LruCache::with_hasher(spec.max_entries as usize, FxBuildHasher),
                    bytes: 0,
                })
            })
            .collect();
        Caches {
            tiers,
            bounds,
            bytes: 0,
            contents: rustc_hash::FxHashMap::default(),
        }
    }

    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// The tier's exact cache, if it has one.
    pub fn spec(&self, tier: TierId) -> Option<ExactSpec> {
        self.store(tier).map(|s| s.spec)
    }

    fn store(&self, tier: TierId) -> Option<&TierStore> {
        self.tiers.get(tier as usize).and_then(Option::as_ref)
    }

    /// The live answer under `key`, marked most recently used; an expired
    /// one is dropped and not returned.
    pub fn get(&mut self, tier: TierId, key: &Key, now: Micros) -> Option<&Entry> {
        let s = self.tiers.get_mut(tier as usize)?.as_mut()?;
        let expired = s.lru.peek(key)?.expires <= now;
        if expired {
            if let Some(e) = s.lru.remove(key) {
                s.bytes = s.bytes.saturating_sub(e.bytes);
                self.bytes = self.bytes.saturating_sub(e.bytes);
                forget(&mut self.contents, &e);
            }
            return None;
        }
        s.lru.get(key)
    }

    /// Stores an answer of `answer_bytes` under `key` for the tier's time
    /// to live, evicting the tier's least recently used answers to stay
    /// within its `entries` and the byte bounds.
    pub fn insert(
        &mut self,
        tier: TierId,
        key: Key,
        answer_bytes: u64,
        payload: Option<Arc<str>>,
        now: Micros,
    ) -> Result<(), NotStored> {
        self.insert_content(tier, key, None, answer_bytes, payload, now)
    }

    /// [`Caches::insert`] of the answer to a request of content hash
    /// `content` (counted for [`Caches::holds_content`]).
    pub fn insert_content(
        &mut self,
        tier: TierId,
        key: Key,
        content: Option<Key>,
        answer_bytes: u64,
        payload: Option<Arc<str>>,
        now: Micros,
    ) -> Result<(), NotStored> {
        let bounds = self.bounds;
        let Some(s) = self.tiers.get_mut(tier as usize).and_then(Option::as_mut) else {
            return Err(NotStored::NoCache);
        };
        if answer_bytes > bounds.max_entry_bytes {
            return Err(NotStored::TooLarge);
        }
        let bytes = answer_bytes.saturating_add(ENTRY_OVERHEAD);
        if let Some(old) = s.lru.remove(&key) {
            s.bytes = s.bytes.saturating_sub(old.bytes);
            self.bytes = self.bytes.saturating_sub(old.bytes);
            forget(&mut self.contents, &old);
        }
        let max_entries = s.spec.max_entries.max(1) as usize;
        while s.lru.len() >= max_entries
            || self.bytes.saturating_add(bytes) > bounds.max_total_bytes
        {
            let Some((_, e)) = s.lru.remove_lru() else {
                return Err(NotStored::Full);
            };
            s.bytes = s.bytes.saturating_sub(e.bytes);
            self.bytes = self.bytes.saturating_sub(e.bytes);
            forget(&mut self.contents, &e);
        }
        if let Some(c) = content {
            *self.contents.entry(c).or_insert(0) += 1;
        }
        let expires = now.saturating_add(s.spec.ttl_us);
        s.lru.insert(
            key,
            Entry {
                expires,
                bytes,
                payload,
                content,
            },
        );
        s.bytes = s.bytes.saturating_add(bytes);
        self.bytes = self.bytes.saturating_add(bytes);
        Ok(())
    }

    /// Answers stored for the tier (expired ones until they are touched or
    /// evicted).
    pub fn len(&self, tier: TierId) -> usize {
        self.store(tier).map_or(0, |s| s.lru.len())
    }

    /// Whether an answer to a request of content hash `content` is stored
    /// in any tier and scope (possibly expired, until it is touched).
    pub fn holds_content(&self, content: &Key) -> bool {
        self.contents.contains_key(content)
    }

    /// Bytes held by every tier's answers.
    pub fn total_bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes held by one tier's answers.
    pub fn tier_bytes(&self, tier: TierId) -> u64 {
        self.store(tier).map_or(0, |s| s.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn graph(cache: &str) -> std::sync::Arc<DecisionGraph> {
        super::super::testkit::graph(&format!(
            "pool p {{ gpus 1 kind \"H100-80GB\" memory 80GB }}\n\
             model m {{ variant fp16 {{ memory 10GB pools [p] }} }}\n\
             tier a {{ priority 2 {cache} }}\ntier b {{ priority 1 }}\n\
             classify {{ default => tier a }}\nroute [a, b] m {{ default => fp16 }}\n"
        ))
    }

    fn key(n: u8) -> Key {
        [n; 32]
    }

    #[test]
    fn canonical_key_ignores_order_whitespace_and_delivery_fields() {
        let a: Value = serde_json::from_str(
            r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        let b: Value = serde_json::from_str(
            r#"{ "messages" : [ { "content":"hi", "role":"user" } ],
                 "temperature": 0.0, "model": "m", "stream": true,
                 "stream_options": {"include_usage": true}, "user": "u-17" }"#,
        )
        .unwrap();
        assert_eq!(content_key(&a), content_key(&b));
        assert!(content_key(&a).is_some());
        let c = json!({"model":"m","temperature":0,"messages":[{"role":"user","content":"hi!"}]});
        assert_ne!(content_key(&a), content_key(&c));
        let d = json!({"model":"m","temperature":0,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]});
        assert_ne!(
            content_key(&a),
            content_key(&d),
            "max_tokens changes the answer"
        );
        // A nested `user` (a message field) is content, not the end user.
        let e = json!({"model":"m","temperature":0,"messages":[{"role":"user","content":"hi","user":"x"}]});
        assert_ne!(content_key(&a), content_key(&e));
    }

    #[test]
    fn only_deterministic_single_choice_requests_are_cacheable() {
        assert!(cacheable(&json!({"temperature": 0})));
        assert!(cacheable(&json!({"temperature": 0.7, "seed": 3})));
        assert!(cacheable(&json!({"temperature": 0, "n": 1})));
        assert!(!cacheable(&json!({"temperature": 0.7})));
        assert!(!cacheable(&json!({})), "the default temperature samples");
        assert!(!cacheable(&json!({"temperature": 0, "n": 2})));
        assert!(!cacheable(&json!({"temperature": "0"})));
        assert!(!cacheable(&json!({"seed": "3", "temperature": 1})));
        assert!(!cacheable(&json!([1, 2])));
    }

    #[test]
    fn scope_separates_tenants_unless_shared() {
        let c = key(1);
        let a = scoped_key(&c, "t", Some("acme"), "m.fp16");
        let b = scoped_key(&c, "t", Some("globex"), "m.fp16");
        assert_ne!(a, b);
        assert_ne!(a, scoped_key(&c, "t", None, "m.fp16"));
        assert_ne!(a, scoped_key(&c, "t", Some("acme"), "m.int4"));
        assert_ne!(a, scoped_key(&c, "u", Some("acme"), "m.fp16"));
        // Length-prefixed: moving a character between parts changes the key.
        assert_ne!(
            scoped_key(&c, "ab", Some("c"), "m"),
            scoped_key(&c, "a", Some("bc"), "m")
        );
        assert_eq!(
            parse_key(&show_key(&a)).map(|k| k[..16].to_vec()),
            Some(a[..16].to_vec())
        );
        assert_eq!(parse_key("zz"), None);
    }

    #[test]
    fn ttl_expires_entries() {
        let g = graph("cache { exact { entries 10, ttl 2s } }");
        let mut c = Caches::new(&g, Bounds::default());
        c.insert(0, key(1), 10, None, 1_000).unwrap();
        assert!(c.get(0, &key(1), 1_000 + 1_999_999).is_some());
        assert!(c.get(0, &key(1), 1_000 + 2_000_000).is_none());
        assert_eq!(c.len(0), 0, "an expired entry is dropped when touched");
        assert_eq!(c.total_bytes(), 0);
    }

    #[test]
    fn content_hashes_are_known_while_their_entries_are_held() {
        let g = graph("cache { exact { entries 2, ttl 2s } }");
        let mut c = Caches::new(&g, Bounds::default());
        let (a, b, d) = (key(10), key(11), key(12));
        c.insert_content(0, key(1), Some(a), 10, None, 0).unwrap();
        c.insert_content(0, key(2), Some(a), 10, None, 0).unwrap();
        assert!(c.holds_content(&a) && !c.holds_content(&b));
        // Evicted by the entry bound: one of the two answers of `a` left.
        c.insert_content(0, key(3), Some(b), 10, None, 0).unwrap();
        assert!(c.holds_content(&a) && c.holds_content(&b));
        c.insert_content(0, key(4), Some(d), 10, None, 0).unwrap();
        assert!(!c.holds_content(&a), "both answers of a were evicted");
        // Expired and touched: forgotten.
        assert!(c.get(0, &key(3), 3_000_000).is_none());
        assert!(!c.holds_content(&b));
        // Replaced under the same key: counted once.
        c.insert_content(0, key(4), Some(d), 10, None, 0).unwrap();
        assert!(c.get(0, &key(4), 3_000_000).is_none());
        assert!(!c.holds_content(&d));
    }

    #[test]
    fn lru_evicts_the_least_recently_used_at_the_entry_bound() {
        let g = graph("cache { exact { entries 2 } }");
        let mut c = Caches::new(&g, Bounds::default());
        c.insert(0, key(1), 10, None, 0).unwrap();
        c.insert(0, key(2), 10, None, 0).unwrap();
        assert!(c.get(0, &key(1), 1).is_some()); // 1 is now the most recent
        c.insert(0, key(3), 10, None, 2).unwrap();
        assert_eq!(c.len(0), 2);
        assert!(c.get(0, &key(2), 3).is_none(), "2 was least recently used");
        assert!(c.get(0, &key(1), 3).is_some());
        assert!(c.get(0, &key(3), 3).is_some());
        assert_eq!(c.insert(1, key(4), 10, None, 0), Err(NotStored::NoCache));
    }

    #[test]
    fn byte_bounds_hold_per_entry_and_in_total() {
        let g = graph("exact_cache");
        let bounds = Bounds {
            max_entry_bytes: 1_000,
            max_total_bytes: 3 * (1_000 + ENTRY_OVERHEAD),
        };
        let mut c = Caches::new(&g, bounds);
        assert_eq!(
            c.insert(0, key(9), 1_001, None, 0),
            Err(NotStored::TooLarge)
        );
        for i in 0..10 {
            c.insert(0, key(i), 1_000, None, 0).unwrap();
            assert!(c.total_bytes() <= bounds.max_total_bytes);
        }
        assert_eq!(c.len(0), 3);
        assert_eq!(c.tier_bytes(0), c.total_bytes());
        // Replacing an entry does not count it twice.
        c.insert(0, key(9), 1_000, None, 0).unwrap();
        c.insert(0, key(9), 10, None, 0).unwrap();
        assert_eq!(
            c.total_bytes(),
            2 * (1_000 + ENTRY_OVERHEAD) + 10 + ENTRY_OVERHEAD
        );
    }

    #[test]
    fn the_exact_cache_flag_takes_the_defaults() {
        let g = graph("exact_cache");
        assert_eq!(g.tiers[0].cache.exact, Some(ExactSpec::DEFAULT));
        assert_eq!(g.tiers[1].cache.exact, None);
    }
}
