//! The semantic cache: prompt embeddings → cached values, per scope.
//!
//! Pure: no I/O, no clock (time is `now_us`, microseconds, passed in), no
//! global state, deterministic iteration (FxHash, ordered maps). The same
//! code answers in the gateway and in a replay.
//!
//! Memory is bounded by `max_entries` over all scopes together: an insert
//! into a full cache first drops expired entries, then the least recently
//! used one, whichever scope it is in. A scope with no entries left is
//! removed, so scopes never outnumber entries. Each entry costs its vector
//! (`dim × 4` bytes: 1,536 for all-MiniLM-L6-v2) plus its value and about
//! 100 bytes of bookkeeping; 5,000 entries of 384 dimensions hold about
//! 8 MB of vectors.
//!
//! Lookup is a linear scan of the scope's vectors, stored row after row in
//! one buffer (one dot product per live entry; vectors are L2-normalised on
//! insert, so the dot product is the cosine). BENCHMARKS.md ("Semantic
//! cache") measures it at 1k, 5k and 50k entries against the embedding
//! itself: the scan stays well under the cost of embedding the prompt at
//! the sizes a policy declares, so an approximate index (and its recall
//! loss) is not worth having here.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;

/// A vector the cache cannot compare.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum CacheError {
    #[error("embedding has {got} dimensions, but this cache holds {expected}-dimensional vectors")]
    #[diagnostic(
        code(kiln::semantic_cache::dimension),
        help("embed every prompt of a cache with the same model; a cache built for one model cannot take another's vectors")
    )]
    Dimension { expected: usize, got: usize },

    #[error("embedding is empty")]
    #[diagnostic(
        code(kiln::semantic_cache::empty),
        help("pass the embedder's output; a vector needs at least one dimension")
    )]
    Empty,

    #[error("embedding has a non-finite component (NaN or infinite) at index {index}")]
    #[diagnostic(
        code(kiln::semantic_cache::not_finite),
        help("the embedding model produced an invalid vector: treat the request as a cache miss and do not cache it")
    )]
    NotFinite { index: usize },

    #[error("embedding is the zero vector: its cosine similarity is undefined")]
    #[diagnostic(
        code(kiln::semantic_cache::zero),
        help("treat the request as a cache miss and do not cache it")
    )]
    Zero,
}

/// Counters since the cache was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups with no live entry at or above the similarity.
    pub misses: u64,
    /// Entries dropped for the bound (least recently used first).
    pub evicted: u64,
    /// Entries dropped because their time to live had passed.
    pub expired: u64,
}

struct Entry<V> {
    scope: u32,
    /// What it costs of [`SemanticCache::bytes`].
    bytes: u64,
    /// Row of this entry in its scope's `rows`.
    row: usize,
    value: V,
    inserted_us: u64,
    /// Keys in `by_insert` and `by_use`.
    seq: u64,
    used: u64,
}

struct Scope {
    key: String,
    /// Vectors, `dim` floats each, row `i` belonging to `slots[i]`.
    rows: Vec<f32>,
    slots: Vec<usize>,
    /// When each row's entry expires (its insert plus the time to live).
    expires_us: Vec<u64>,
}

/// Nearest-neighbour cache of values by embedding, per scope (a tenant,
/// model and variant key), bounded in entries over all scopes, with a time
/// to live and least-recently-used eviction.
pub struct SemanticCache<V> {
    max_entries: usize,
    ttl_us: u64,
    min_similarity: f32,
    /// Set by the first insert; every vector must match it.
    dim: Option<usize>,
    entries: Vec<Option<Entry<V>>>,
    free: Vec<usize>,
    scopes: Vec<Option<Scope>>,
    free_scopes: Vec<u32>,
    scope_ids: HashMap<String, u32>,
    /// Insertion order = expiry order (one time to live for all entries).
    by_insert: BTreeMap<u64, usize>,
    /// Least recently used first.
    by_use: BTreeMap<u64, usize>,
    clock: u64,
    len: usize,
    /// Bytes held: each entry's value (as the caller weighs it), vector and
    /// [`ENTRY_OVERHEAD`].
    bytes: u64,
    stats: CacheStats,
}

/// Bytes an entry costs beyond its value and its vector: its slot, its
/// places in both orders and its scope's bookkeeping.
pub const ENTRY_OVERHEAD: u64 = 128;

impl<V: Clone> SemanticCache<V> {
    /// A cache of at most `max_entries` entries (0: it stores nothing),
    /// each live for `ttl_us` microseconds after its insert, answering
    /// lookups whose cosine similarity is at least `min_similarity` (a NaN
    /// never matches; the policy compiler checks the range).
    pub fn new(max_entries: usize, ttl_us: u64, min_similarity: f32) -> Self {
        SemanticCache {
            max_entries,
            ttl_us,
            min_similarity,
            dim: None,
            entries: Vec::new(),
            free: Vec::new(),
            scopes: Vec::new(),
            free_scopes: Vec::new(),
            scope_ids: HashMap::default(),
            by_insert: BTreeMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
            len: 0,
            bytes: 0,
            stats: CacheStats::default(),
        }
    }

    /// The nearest live entry in `scope` whose cosine similarity to `v` is
    /// at least the cache's `min_similarity`, with that similarity. A hit
    /// counts as a use (it moves the entry to the back of the eviction
    /// order). Entries past their time to live are dropped first.
    pub fn lookup(
        &mut self,
        scope: &str,
        v: &[f32],
        now_us: u64,
    ) -> Result<Option<(V, f32)>, CacheError> {
        let q = self.normalised(v)?;
        self.expire(now_us);
        let best = self.scope_ids.get(scope).and_then(|&sid| {
            let s = self.scopes.get(sid as usize)?.as_ref()?;
            nearest(&s.rows, &s.expires_us, q.len(), &q, now_us)
                .map(|(row, sim)| (s.slots.get(row).copied(), sim))
        });
        match best {
            Some((Some(slot), sim)) if sim >= self.min_similarity => {
                self.clock += 1;
                let tick = self.clock;
                let Some(e) = self.entries.get_mut(slot).and_then(Option::as_mut) else {
                    self.stats.misses += 1;
                    return Ok(None);
                };
                self.by_use.remove(&e.used);
                e.used = tick;
                self.by_use.insert(tick, slot);
                self.stats.hits += 1;
                Ok(Some((e.value.clone(), sim)))
            }
            _ => {
                self.stats.misses += 1;
                Ok(None)
            }
        }
    }

    /// Caches `value` under `v` in `scope`, dropping expired entries and
    /// then, if the cache is full, the least recently used one. The value
    /// weighs nothing in [`SemanticCache::bytes`]; see
    /// [`SemanticCache::insert_sized`].
    pub fn insert(
        &mut self,
        scope: &str,
        v: Vec<f32>,
        value: V,
        now_us: u64,
    ) -> Result<(), CacheError> {
        self.insert_sized(scope, v, value, 0, now_us)
    }

    /// [`SemanticCache::insert`] of a value of `value_bytes` bytes: the
    /// entry then costs that, its vector and [`ENTRY_OVERHEAD`] of
    /// [`SemanticCache::bytes`] (a caller bounds bytes with
    /// [`SemanticCache::evict_lru`]).
    pub fn insert_sized(
        &mut self,
        scope: &str,
        v: Vec<f32>,
        value: V,
        value_bytes: u64,
        now_us: u64,
    ) -> Result<(), CacheError> {
        let v = self.normalised(&v)?;
        self.dim.get_or_insert(v.len());
        self.expire(now_us);
        if self.max_entries == 0 {
            return Ok(());
        }
        while self.len >= self.max_entries {
            let Some((_, slot)) = self.by_use.pop_first() else {
                break;
            };
            self.remove(slot);
            self.stats.evicted += 1;
        }
        let sid = match self.scope_ids.get(scope) {
            Some(&sid) => sid,
            None => {
                let s = Scope {
                    key: scope.to_string(),
                    rows: Vec::new(),
                    slots: Vec::new(),
                    expires_us: Vec::new(),
                };
                let sid = match self.free_scopes.pop() {
                    Some(sid) => {
                        if let Some(cell) = self.scopes.get_mut(sid as usize) {
                            *cell = Some(s);
                        }
                        sid
                    }
                    None => {
                        self.scopes.push(Some(s));
                        u32::try_from(self.scopes.len() - 1).unwrap_or(u32::MAX)
                    }
                };
                self.scope_ids.insert(scope.to_string(), sid);
                sid
            }
        };
        let slot = self.free.pop().unwrap_or(self.entries.len());
        let Some(s) = self.scopes.get_mut(sid as usize).and_then(Option::as_mut) else {
            return Ok(());
        };
        let row = s.slots.len();
        s.rows.extend_from_slice(&v);
        s.slots.push(slot);
        s.expires_us.push(now_us.saturating_add(self.ttl_us));
        self.clock += 1;
        let bytes = value_bytes
            .saturating_add(v.len() as u64 * 4)
            .saturating_add(ENTRY_OVERHEAD);
        self.bytes = self.bytes.saturating_add(bytes);
        let e = Entry {
            scope: sid,
            bytes,
            row,
            value,
            inserted_us: now_us,
            seq: self.clock,
            used: self.clock,
        };
        if slot == self.entries.len() {
            self.entries.push(Some(e));
        } else if let Some(cell) = self.entries.get_mut(slot) {
            *cell = Some(e);
        }
        self.by_insert.insert(self.clock, slot);
        self.by_use.insert(self.clock, slot);
        self.len += 1;
        Ok(())
    }

    /// Live and not yet dropped entries, over all scopes (expired entries
    /// are dropped by the next lookup, insert or [`SemanticCache::purge`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes the entries hold (see [`SemanticCache::insert_sized`]).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The cost [`SemanticCache::insert_sized`] will charge for a value of
    /// `value_bytes` and a vector of `dim` dimensions.
    pub fn entry_bytes(value_bytes: u64, dim: usize) -> u64 {
        value_bytes
            .saturating_add(dim as u64 * 4)
            .saturating_add(ENTRY_OVERHEAD)
    }

    /// Drops every entry whose time to live has passed at `now_us` (so a
    /// count of entries falls as they expire, not only at the next insert).
    pub fn purge(&mut self, now_us: u64) {
        self.expire(now_us);
    }

    /// Drops the least recently used entry; `false` when there is none.
    pub fn evict_lru(&mut self) -> bool {
        let Some((_, slot)) = self.by_use.pop_first() else {
            return false;
        };
        self.remove(slot);
        self.stats.evicted += 1;
        true
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries in one scope.
    pub fn scope_len(&self, scope: &str) -> usize {
        self.scope_ids
            .get(scope)
            .and_then(|&sid| self.scopes.get(sid as usize))
            .and_then(Option::as_ref)
            .map_or(0, |s| s.slots.len())
    }

    /// Hits, misses and evictions so far.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    pub fn min_similarity(&self) -> f32 {
        self.min_similarity
    }

    /// `v` checked against the cache's dimension and scaled to unit length.
    fn normalised(&self, v: &[f32]) -> Result<Vec<f32>, CacheError> {
        if v.is_empty() {
            return Err(CacheError::Empty);
        }
        if let Some(expected) = self.dim {
            if v.len() != expected {
                return Err(CacheError::Dimension {
                    expected,
                    got: v.len(),
                });
            }
        }
        if let Some(index) = v.iter().position(|x| !x.is_finite()) {
            return Err(CacheError::NotFinite { index });
        }
        // In f64: a vector of large finite components must not overflow.
        let norm = v
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        if norm == 0.0 || !norm.is_finite() {
            return Err(CacheError::Zero);
        }
        Ok(v.iter().map(|&x| (f64::from(x) / norm) as f32).collect())
    }

    /// Drops every entry whose time to live has passed at `now_us`.
    fn expire(&mut self, now_us: u64) {
        while let Some((&seq, &slot)) = self.by_insert.first_key_value() {
            let expired = self
                .entries
                .get(slot)
                .and_then(Option::as_ref)
                .is_none_or(|e| {
                    e.seq != seq || now_us >= e.inserted_us.saturating_add(self.ttl_us)
                });
            if !expired {
                break;
            }
            self.remove(slot);
            self.stats.expired += 1;
        }
    }

    /// Removes the entry in `slot` from its scope and both orders.
    fn remove(&mut self, slot: usize) {
        let Some(e) = self.entries.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.free.push(slot);
        self.len -= 1;
        self.bytes = self.bytes.saturating_sub(e.bytes);
        self.by_insert.remove(&e.seq);
        self.by_use.remove(&e.used);
        let dim = self.dim.unwrap_or(0);
        let Some(s) = self
            .scopes
            .get_mut(e.scope as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        // Swap the last row into the removed one.
        let last = s.slots.len().saturating_sub(1);
        if e.row != last {
            s.rows
                .copy_within(last * dim..(last + 1) * dim, e.row * dim);
            if let Some(&moved) = s.slots.get(last) {
                if let Some(m) = self.entries.get_mut(moved).and_then(Option::as_mut) {
                    m.row = e.row;
                }
            }
        }
        s.slots.swap_remove(e.row);
        s.expires_us.swap_remove(e.row);
        s.rows.truncate(s.slots.len() * dim);
        if s.slots.is_empty() {
            let key = std::mem::take(&mut s.key);
            self.scope_ids.remove(&key);
            if let Some(cell) = self.scopes.get_mut(e.scope as usize) {
                *cell = None;
            }
            self.free_scopes.push(e.scope);
        }
    }
}

/// Row of `rows` (each `dim` long) not expired at `now_us` with the
/// greatest dot product with `q`, and that product; the first of equals
/// wins.
fn nearest(
    rows: &[f32],
    expires_us: &[u64],
    dim: usize,
    q: &[f32],
    now_us: u64,
) -> Option<(usize, f32)> {
    let mut best: Option<(usize, f32)> = None;
    if dim == 0 {
        return None;
    }
    for (i, (row, &exp)) in rows.chunks_exact(dim).zip(expires_us).enumerate() {
        if now_us >= exp {
            continue;
        }
        let d = dot(row, q);
        if best.is_none_or(|(_, b)| d > b) {
            best = Some((i, d));
        }
    }
    best
}

/// Dot product in eight independent lanes, so the compiler vectorises it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for ((s, x), y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HOUR: u64 = 3_600_000_000;

    fn unit(angle: f32) -> Vec<f32> {
        vec![angle.cos(), angle.sin(), 0.0]
    }

    #[test]
    fn a_near_vector_hits_and_a_far_one_misses() {
        let mut c = SemanticCache::new(10, HOUR, 0.9);
        c.insert("t/m", unit(0.0), "a", 0).unwrap();
        let (v, sim) = c.lookup("t/m", &unit(0.1), 1).unwrap().unwrap();
        assert_eq!(v, "a");
        assert!((sim - 0.1f32.cos()).abs() < 1e-6, "{sim}");
        assert_eq!(c.lookup("t/m", &unit(1.0), 2).unwrap(), None);
        assert_eq!(
            c.stats(),
            CacheStats {
                hits: 1,
                misses: 1,
                ..CacheStats::default()
            }
        );
    }

    #[test]
    fn the_nearest_of_several_answers() {
        let mut c = SemanticCache::new(10, HOUR, 0.5);
        c.insert("s", unit(0.0), 0, 0).unwrap();
        c.insert("s", unit(0.3), 1, 0).unwrap();
        c.insert("s", unit(0.6), 2, 0).unwrap();
        assert_eq!(c.lookup("s", &unit(0.35), 1).unwrap().map(|h| h.0), Some(1));
        assert_eq!(c.lookup("s", &unit(0.55), 1).unwrap().map(|h| h.0), Some(2));
    }

    #[test]
    fn scopes_never_answer_for_each_other() {
        let mut c = SemanticCache::new(10, HOUR, 0.5);
        c.insert("tenant-a/m", unit(0.0), "a", 0).unwrap();
        assert_eq!(c.lookup("tenant-b/m", &unit(0.0), 1).unwrap(), None);
        assert_eq!(c.lookup("tenant-a/m2", &unit(0.0), 1).unwrap(), None);
        c.insert("tenant-b/m", unit(0.0), "b", 2).unwrap();
        assert_eq!(
            c.lookup("tenant-a/m", &unit(0.0), 3).unwrap().unwrap().0,
            "a"
        );
        assert_eq!(
            c.lookup("tenant-b/m", &unit(0.0), 3).unwrap().unwrap().0,
            "b"
        );
        assert_eq!(
            (c.scope_len("tenant-a/m"), c.scope_len("tenant-b/m")),
            (1, 1)
        );
    }

    #[test]
    fn the_threshold_is_inclusive() {
        // The similarity the cache reports, then caches at exactly it and
        // at the next float above it.
        let mut probe = SemanticCache::new(10, HOUR, -1.0);
        probe.insert("s", unit(0.0), (), 0).unwrap();
        let (_, sim) = probe.lookup("s", &unit(0.4), 0).unwrap().unwrap();
        assert!(sim > 0.0);
        let above = f32::from_bits(sim.to_bits() + 1);
        for (min, hit) in [(sim, true), (above, false)] {
            let mut c = SemanticCache::new(10, HOUR, min);
            c.insert("s", unit(0.0), (), 0).unwrap();
            assert_eq!(
                c.lookup("s", &unit(0.4), 0).unwrap().is_some(),
                hit,
                "{min}"
            );
        }
    }

    #[test]
    fn a_nan_threshold_never_hits() {
        let mut c = SemanticCache::new(10, HOUR, f32::NAN);
        c.insert("s", unit(0.0), (), 0).unwrap();
        assert_eq!(c.lookup("s", &unit(0.0), 0).unwrap(), None);
    }

    #[test]
    fn entries_expire_after_their_time_to_live() {
        let mut c = SemanticCache::new(10, 1_000, 0.9);
        c.insert("s", unit(0.0), "a", 5_000).unwrap();
        assert!(c.lookup("s", &unit(0.0), 5_999).unwrap().is_some());
        assert_eq!(c.lookup("s", &unit(0.0), 6_000).unwrap(), None);
        assert_eq!(c.len(), 0);
        assert_eq!(c.stats().expired, 1);
        // A hit does not extend the time to live.
        c.insert("s", unit(0.0), "b", 10_000).unwrap();
        assert!(c.lookup("s", &unit(0.0), 10_900).unwrap().is_some());
        assert_eq!(c.lookup("s", &unit(0.0), 11_000).unwrap(), None);
    }

    #[test]
    fn an_entry_from_the_past_is_not_served_when_time_goes_back_and_forth() {
        // Time is the caller's: an insert stamped later than the next one
        // must not keep an expired entry alive behind it.
        let mut c = SemanticCache::new(10, 1_000, 0.9);
        c.insert("s", unit(0.0), "late", 10_000).unwrap();
        c.insert("s", unit(0.0), "early", 1_000).unwrap();
        assert_eq!(c.lookup("s", &unit(0.0), 2_500).unwrap().unwrap().0, "late");
        c.insert("t", unit(0.0), "x", 0).unwrap();
        assert_eq!(c.lookup("t", &unit(0.0), 2_500).unwrap(), None);
    }

    #[test]
    fn a_full_cache_drops_the_least_recently_used_entry_of_any_scope() {
        let mut c = SemanticCache::new(3, HOUR, 0.99);
        c.insert("a", unit(0.0), 0, 0).unwrap();
        c.insert("b", unit(1.0), 1, 1).unwrap();
        c.insert("a", unit(2.0), 2, 2).unwrap();
        // Use the oldest: the one inserted second is now least recent.
        assert!(c.lookup("a", &unit(0.0), 3).unwrap().is_some());
        c.insert("a", unit(3.0), 3, 4).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c.stats().evicted, 1);
        assert_eq!(c.scope_len("b"), 0, "scope b's only entry was evicted");
        assert!(c.lookup("a", &unit(0.0), 5).unwrap().is_some());
        assert!(c.lookup("a", &unit(2.0), 5).unwrap().is_some());
        assert!(c.lookup("a", &unit(3.0), 5).unwrap().is_some());
    }

    #[test]
    fn bytes_count_values_vectors_and_overhead_and_fall_as_entries_go() {
        let mut c = SemanticCache::new(10, 1_000, 0.9);
        let each = SemanticCache::<()>::entry_bytes(100, 3);
        assert_eq!(each, 100 + 12 + ENTRY_OVERHEAD);
        c.insert_sized("s", unit(0.0), (), 100, 0).unwrap();
        c.insert_sized("t", unit(1.0), (), 100, 500).unwrap();
        assert_eq!(c.bytes(), 2 * each);
        assert!(c.evict_lru());
        assert_eq!((c.len(), c.bytes()), (1, each));
        assert_eq!(c.scope_len("s"), 0, "the least recently used went");
        // Expiry without a lookup or insert: purge drops it.
        c.purge(1_500);
        assert_eq!((c.len(), c.bytes()), (0, 0));
        assert!(!c.evict_lru());
    }

    #[test]
    fn a_cache_of_no_entries_stores_nothing() {
        let mut c = SemanticCache::new(0, HOUR, 0.0);
        c.insert("s", unit(0.0), (), 0).unwrap();
        assert!(c.is_empty());
        assert_eq!(c.lookup("s", &unit(0.0), 0).unwrap(), None);
    }

    #[test]
    fn vectors_of_another_dimension_are_refused() {
        let mut c = SemanticCache::new(10, HOUR, 0.5);
        c.insert("s", vec![1.0, 0.0, 0.0], (), 0).unwrap();
        let want = CacheError::Dimension {
            expected: 3,
            got: 2,
        };
        assert_eq!(c.insert("s", vec![1.0, 0.0], (), 0), Err(want.clone()));
        assert_eq!(c.lookup("s", &[1.0, 0.0], 0), Err(want));
        assert_eq!(c.lookup("s", &[], 0), Err(CacheError::Empty));
        assert_eq!(
            c.insert("s", vec![1.0, f32::NAN, 0.0], (), 0),
            Err(CacheError::NotFinite { index: 1 })
        );
        assert_eq!(c.lookup("s", &[0.0; 3], 0), Err(CacheError::Zero));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn vectors_need_not_be_unit_length() {
        let mut c = SemanticCache::new(10, HOUR, 0.999);
        c.insert("s", vec![3e30, 4e30], (), 0).unwrap();
        let (_, sim) = c.lookup("s", &[0.6e-30, 0.8e-30], 0).unwrap().unwrap();
        assert!((sim - 1.0).abs() < 1e-6, "{sim}");
    }

    #[test]
    fn the_dot_product_covers_every_lane_and_the_tail() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b = vec![1.0; 19];
        assert_eq!(dot(&a, &b), (0..19).sum::<i32>() as f32);
    }

    proptest! {
        /// Over any sequence of inserts and lookups in a few scopes, the
        /// bound holds, every answer comes from the scope asked, and what
        /// the cache counts is what it holds.
        #[test]
        fn bounded_and_scoped(
            ops in proptest::collection::vec((0u8..3, 0u8..8, any::<bool>(), 0u64..50), 1..200),
            max in 0usize..6,
        ) {
            let mut c = SemanticCache::new(max, 120, 0.95);
            let mut now = 0;
            for (scope, angle, is_insert, dt) in ops {
                now += dt;
                let key = format!("scope-{scope}");
                let v = unit(f32::from(angle) * 0.5);
                if is_insert {
                    c.insert(&key, v, key.clone(), now).unwrap();
                } else if let Some((val, sim)) = c.lookup(&key, &v, now).unwrap() {
                    prop_assert_eq!(val, key.clone());
                    prop_assert!(sim >= 0.95);
                }
                prop_assert!(c.len() <= max);
                prop_assert_eq!(c.bytes(), c.len() as u64 * SemanticCache::<String>::entry_bytes(0, 3));
                let held: usize = (0..3).map(|s| c.scope_len(&format!("scope-{s}"))).sum();
                prop_assert_eq!(held, c.len());
                prop_assert_eq!(c.by_use.len(), c.len());
                prop_assert_eq!(c.by_insert.len(), c.len());
            }
        }
    }
}
