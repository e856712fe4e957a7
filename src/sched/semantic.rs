//! The semantic cache a tier declares (`cache { semantic { similarity
//! 0.92, entries 5000, ttl 1h } }`), inside the scheduler beside the exact
//! one ([`super::cache`]): looked up at the same point (after the policy
//! classified, routed and admitted the request), charged the same way (one
//! request of the requests quota, no tokens, no GPU time).
//!
//! The gateway embeds the request's question (the last user message, or a
//! completion's prompt) before the request reaches the scheduler, and
//! hashes everything else of the request ([`Probe::context`]): the system
//! prompt, earlier turns, `max_tokens`, sampling fields. Only requests whose
//! context is identical are compared, by cosine similarity of their
//! questions, so a cached answer is never reused for another system prompt,
//! another conversation, another length limit or another tool set. The scope
//! also binds the tier, the tenant (unless `shared`) and the routed
//! `model.variant`, as the exact cache's key does.
//!
//! Pure: the vectors come in with the arrival, time is the scheduler's.
//! A replay has no prompts, hence no probes: `kiln simulate` counts no
//! semantic hits (README says so).

use super::cache::Key;
use super::Micros;
use crate::embed::SemanticCache;
use crate::graph::{DecisionGraph, SemanticSpec, TierId};
use hashlink::LinkedHashMap;
use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;

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
}

impl SemanticCaches {
    /// Empty caches for the tiers of `g` that declare one.
    pub fn new(g: &DecisionGraph) -> SemanticCaches {
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
    /// (or was dropped) or the cache refused the vector.
    pub fn store(&mut self, key: &Key, payload: Arc<str>, now: Micros) -> bool {
        let Some((tier, scope, vector)) = self.pending.remove(key) else {
            return false;
        };
        let Some(t) = self.tiers.get_mut(&tier) else {
            return false;
        };
        t.cache
            .insert(&scope, vector.to_vec(), payload, now)
            .is_ok()
    }

    /// Entries cached for `tier`.
    pub fn len(&self, tier: TierId) -> usize {
        self.tiers.get(&tier).map_or(0, |t| t.cache.len())
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
