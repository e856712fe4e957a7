//! Canary decisions: while a new policy version is in canary, the requests
//! of its stage's scope are decided by the canary graph instead of the
//! active one: every request of a pinned tenant (`canary { tenants […] }`),
//! and, of the requests whose tenant, tier and requested model are each in
//! the stage's lists (an empty list takes any), a share chosen by a stable
//! hash of the request id. The tier is the one the *canary* version
//! classifies the request into: a stage scoped to a tier takes the traffic
//! the new version puts there, even a tier only it declares. The scheduler keeps running the active graph (its tiers,
//! quotas and replicas); the canary's decision is carried into the active
//! graph's ids by name, like a hot swap does. When something the canary
//! decided does not exist in the active graph (a new tier, tenant, variant
//! or pool), the request is decided by the active graph instead: a canary
//! can change *how* traffic is decided, not what the fleet is.
//!
//! Pure: selection depends only on the request id and the request.

use super::swap::Remap;
use super::ReqId;
use crate::graph::{Decision, DecisionGraph, ModelId, Request, Signals, TenantId, TierId};
use std::sync::Arc;

/// The traffic a canary stage decides, in the canary graph's ids.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scope {
    /// Tenants whose every request the canary decides.
    pub pinned: Vec<TenantId>,
    /// The rest restrict together; an empty list takes any.
    pub tenants: Vec<TenantId>,
    pub tiers: Vec<TierId>,
    pub models: Vec<ModelId>,
    /// Share of the requests in scope, 0 to 100 (%).
    pub share: f64,
}

/// A canary version and the traffic it decides.
#[derive(Debug, Clone)]
pub struct Canary {
    graph: Arc<DecisionGraph>,
    scope: Scope,
    /// Canary ids → active ids, by name.
    map: Remap,
    models: Vec<Option<ModelId>>,
    /// The active signals in the canary's ids, refilled per decision.
    signals: Signals,
}

/// A stable 64-bit mix of the request id (splitmix64's finalizer).
fn mix(id: ReqId) -> u64 {
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether request `id` falls in a share (0 to 100 %) of traffic: the same
/// id always gives the same answer, and over many ids the share holds.
pub fn in_share(id: ReqId, share: f64) -> bool {
    if share.is_nan() || share <= 0.0 {
        return false;
    }
    let bucket = mix(id) % 10_000;
    (bucket as f64) < share * 100.0
}

/// Signals of the active graph moved into another graph's ids by name
/// (`map` from [`Remap::new`]`(other, active)`); what the active graph
/// does not know reads as idle. `out` must be sized for the other graph
/// (`Signals::idle(other)`).
pub fn map_signals(map: &Remap, active: &Signals, out: &mut Signals) {
    for (i, slot) in out.pools.iter_mut().enumerate() {
        *slot = map
            .pools
            .get(i)
            .copied()
            .flatten()
            .and_then(|a| active.pools.get(a as usize).copied())
            .unwrap_or_default();
    }
    for (i, slot) in out.tiers.iter_mut().enumerate() {
        *slot = map
            .tiers
            .get(i)
            .copied()
            .flatten()
            .and_then(|a| active.tiers.get(a as usize).copied())
            .unwrap_or_default();
    }
    for (i, slot) in out.tenants.iter_mut().enumerate() {
        *slot = map
            .tenants
            .get(i)
            .copied()
            .flatten()
            .and_then(|a| active.tenants.get(a as usize).copied())
            .unwrap_or_default();
    }
    out.estimated_wait = active.estimated_wait;
    out.time_of_day = active.time_of_day;
    out.weekday = active.weekday;
    out.error_rate = active.error_rate;
}

impl Canary {
    /// A `canary { … }`: every request of `tenants` (ids of `graph`) and
    /// `share` of the others.
    pub fn new(
        graph: Arc<DecisionGraph>,
        active: &DecisionGraph,
        tenants: Vec<TenantId>,
        share: f64,
    ) -> Canary {
        let scope = Scope {
            pinned: tenants,
            share,
            ..Scope::default()
        };
        Canary::staged(graph, active, scope)
    }

    /// A canary stage deciding `scope` (ids of `graph`).
    pub fn staged(graph: Arc<DecisionGraph>, active: &DecisionGraph, mut scope: Scope) -> Canary {
        let map = Remap::new(&graph, active);
        let models = graph
            .models
            .iter()
            .map(|m| active.model_id(&m.name))
            .collect();
        let signals = Signals::idle(&graph);
        scope.share = if scope.share.is_finite() {
            scope.share.clamp(0.0, 100.0)
        } else {
            0.0
        };
        Canary {
            graph,
            scope,
            map,
            models,
            signals,
        }
    }

    pub fn graph(&self) -> &Arc<DecisionGraph> {
        &self.graph
    }

    /// The signals of the last decision the canary made, in its ids.
    pub fn signals(&self) -> &Signals {
        &self.signals
    }

    pub fn share(&self) -> f64 {
        self.scope.share
    }

    /// Names of the pinned tenants.
    pub fn tenant_names(&self) -> Vec<String> {
        self.scope
            .pinned
            .iter()
            .filter_map(|t| self.graph.tenants.get(*t as usize))
            .map(|t| t.name.clone())
            .collect()
    }

    fn tenant_of(&self, req: &Request) -> Option<TenantId> {
        match &req.tenant {
            Some(n) => self.graph.tenant_id(n),
            None => req
                .api_key
                .as_deref()
                .and_then(|k| self.graph.tenant_for_key(k)),
        }
    }

    fn pinned(&self, req: &Request) -> bool {
        !self.scope.pinned.is_empty()
            && self
                .tenant_of(req)
                .is_some_and(|t| self.scope.pinned.contains(&t))
    }

    /// Does the canary decide this request? (The tier is checked once the
    /// canary classified it: [`Canary::decide`].)
    pub fn selects(&self, id: ReqId, req: &Request) -> bool {
        if self.pinned(req) {
            return true;
        }
        let s = &self.scope;
        if !s.tenants.is_empty() && !self.tenant_of(req).is_some_and(|t| s.tenants.contains(&t)) {
            return false;
        }
        if !s.models.is_empty()
            && !self
                .graph
                .model_id(&req.model)
                .is_some_and(|m| s.models.contains(&m))
        {
            return false;
        }
        in_share(id, s.share)
    }

    /// Whether a decision of the canary graph is in the stage's tiers.
    fn in_tiers(&self, tier: TierId, req: &Request) -> bool {
        self.scope.tiers.is_empty() || self.scope.tiers.contains(&tier) || self.pinned(req)
    }

    /// The active graph changed under the canary (a swap): map anew.
    pub(super) fn rebase(&mut self, active: &DecisionGraph) {
        self.map = Remap::new(&self.graph, active);
        self.models = self
            .graph
            .models
            .iter()
            .map(|m| active.model_id(&m.name))
            .collect();
    }

    /// The canary's decision for `req`, in the active graph's ids; `None`
    /// when it names something the active graph does not have. `cg` is
    /// this canary's graph (a clone of [`Canary::graph`], so the decision
    /// borrows it and not the canary).
    pub(super) fn decide<'g>(
        &mut self,
        cg: &'g DecisionGraph,
        req: &Request,
        active: &Signals,
    ) -> Option<Decision<'g>> {
        map_signals(&self.map, active, &mut self.signals);
        let d = cg.decide(req, &self.signals);
        if !self.in_tiers(d.tier, req) {
            return None;
        }
        self.map_decision(d)
    }

    fn map_decision<'g>(&self, d: Decision<'g>) -> Option<Decision<'g>> {
        let m = &self.map;
        let tenant = match d.tenant {
            Some(t) => Some(m.tenant(t)?),
            None => None,
        };
        let model = match d.model {
            Some(x) => Some(self.models.get(x as usize).copied().flatten()?),
            None => None,
        };
        let target = match d.target {
            Some(t) => {
                let (model, variant) = m.variant(t.model, t.variant)?;
                let pool = match t.pool {
                    Some(p) => Some(m.pool(p)?),
                    None => None,
                };
                Some(crate::graph::Target {
                    model,
                    variant,
                    pool,
                })
            }
            None => None,
        };
        let fallback_chain = match d.fallback_chain {
            Some(t) => Some(m.tier(t)?),
            None => None,
        };
        Some(Decision {
            tenant,
            tier: m.tier(d.tier)?,
            model,
            target,
            // A degrade's variant is already in `target`; nothing else in
            // an admission carries ids.
            admission: d.admission,
            fallback_step: d.fallback_step,
            fallback_chain,
            max_tokens: d.max_tokens,
            classify_rule: d.classify_rule,
            route_rule: d.route_rule,
            admit_rule: d.admit_rule,
            step_rule: d.step_rule,
            demote_rule: d.demote_rule,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{arrival, arrive, graph, plan, sched, BASE};
    use super::super::{Action, Config, Scheduler};
    use super::*;

    /// BASE with bulk classified into `hi` and an extra tier and tenant.
    const NEW: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
pool ext { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] max_batch 1 } }
model api { variant up { precision fp16 memory 10GB pools [ext] max_batch 2 } }
tier hi { priority 100 slo { ttft 10s } preempts [lo] }
tier lo { priority 10 slo { window 1h } preemptible }
tier extra { priority 5 }
tenant chat { owner "o" tiers [hi] quota { tokens 60k/min concurrent 4 } }
tenant bulk { owner "o" tiers [lo, hi] }
tenant fresh { owner "o" tiers [extra] }
classify {
  when tenant == chat => tier hi
  when tenant == bulk => tier hi
  when tenant == fresh => tier extra
  default => tier lo
}
route [hi, lo, extra] m { default => fp16 }
route [hi, lo, extra] api { default => up }
"#;

    fn decided_tier(acts: &[Action]) -> Option<u16> {
        acts.iter().find_map(|a| match a {
            Action::Decided { tier, .. } => Some(*tier),
            _ => None,
        })
    }

    #[test]
    fn share_is_stable_and_close_to_its_value() {
        let n = 20_000u64;
        let picked = (0..n).filter(|&i| in_share(i, 10.0)).count() as f64;
        assert!((picked / n as f64 - 0.10).abs() < 0.01, "{picked}");
        assert!((0..100).all(|i| in_share(i, 10.0) == in_share(i, 10.0)));
        assert!(!(0..1000).any(|i| in_share(i, 0.0)));
        assert!((0..1000).all(|i| in_share(i, 100.0)));
        assert!(!in_share(1, f64::NAN));
    }

    #[test]
    fn named_tenants_are_decided_by_the_canary_in_active_ids() {
        let old = graph(BASE);
        let new = graph(NEW);
        let mut s = sched(&old);
        let bulk = new.tenant_id("bulk").unwrap();
        s.set_canary(Some(Canary::new(new.clone(), &old, vec![bulk], 0.0)));
        let hi = old.tier_id("hi").unwrap();
        let lo = old.tier_id("lo").unwrap();
        // bulk: the canary classifies it into hi.
        let acts = arrive(&mut s, 0, arrival(1, "bulk", "m", 10, 5));
        assert_eq!(decided_tier(&acts), Some(hi));
        assert!(s.last_arrival_canary());
        // chat is not a canary tenant; with share 0 the active graph decides.
        let acts = arrive(&mut s, 1, arrival(2, "chat", "m", 10, 5));
        assert_eq!(decided_tier(&acts), Some(hi));
        assert!(!s.last_arrival_canary());
        // Without the canary, bulk is lo again.
        s.set_canary(None);
        let acts = arrive(&mut s, 2, arrival(3, "bulk", "m", 10, 5));
        assert_eq!(decided_tier(&acts), Some(lo));
        assert!(!s.last_arrival_canary());
    }

    #[test]
    fn a_decision_the_active_graph_cannot_hold_falls_back_to_it() {
        let old = graph(BASE);
        let new = graph(NEW);
        let mut s = sched(&old);
        s.set_canary(Some(Canary::new(new.clone(), &old, Vec::new(), 100.0)));
        // `fresh` is only in the canary: its tier `extra` does not exist in
        // the active graph, so the active graph decides (default → lo).
        let acts = arrive(&mut s, 0, arrival(1, "fresh", "m", 10, 5));
        assert_eq!(decided_tier(&acts), Some(old.tier_id("lo").unwrap()));
        assert!(!s.last_arrival_canary());
        // Share 100: everyone else is the canary's.
        arrive(&mut s, 1, arrival(2, "bulk", "m", 10, 5));
        assert!(s.last_arrival_canary());
    }

    #[test]
    fn the_canary_survives_a_swap_of_the_active_graph() {
        let old = graph(BASE);
        let new = graph(NEW);
        let mut s = Scheduler::new(old.clone(), plan(&old, 1_000_000), Config::default());
        let bulk = new.tenant_id("bulk").unwrap();
        s.set_canary(Some(Canary::new(new.clone(), &old, vec![bulk], 0.0)));
        // Swap the active graph to the canary's own: ids are rebased.
        s.swap(0, new.clone(), plan(&new, 1_000_000));
        let acts = arrive(&mut s, 1, arrival(1, "bulk", "m", 10, 5));
        assert_eq!(decided_tier(&acts), new.tier_id("hi"));
        assert!(s.last_arrival_canary());
        assert_eq!(
            s.canary().map(|c| c.tenant_names()),
            Some(vec!["bulk".into()])
        );
    }

    /// Which of `cases` (tenant, model) the canary decided.
    fn decided_by_canary(s: &mut Scheduler, cases: &[(&str, &str)]) -> Vec<bool> {
        cases
            .iter()
            .enumerate()
            .map(|(i, (t, m))| {
                let id = 100 + i as u64;
                arrive(s, id, arrival(id, t, m, 10, 5));
                s.last_arrival_canary()
            })
            .collect()
    }

    #[test]
    fn a_stage_scope_picks_exactly_its_tiers_models_and_tenants() {
        let old = graph(BASE);
        let new = graph(NEW);
        let id = |n: &str| new.tenant_id(n).unwrap();
        let cases = [
            ("chat", "m"),
            ("bulk", "m"),
            ("fresh", "m"),
            ("chat", "api"),
            ("bulk", "api"),
        ];
        // Tier hi as the *canary* classifies (it moves bulk into hi; the
        // active version has bulk in lo) and model m: all of that scope.
        let mut s = sched(&old);
        let scope = Scope {
            tiers: vec![new.tier_id("hi").unwrap()],
            models: vec![new.model_id("m").unwrap()],
            share: 100.0,
            ..Scope::default()
        };
        s.set_canary(Some(Canary::staged(new.clone(), &old, scope)));
        assert_eq!(
            decided_by_canary(&mut s, &cases),
            [true, true, false, false, false]
        );
        // Tenants restrict too: bulk only, any model.
        let mut s = sched(&old);
        let scope = Scope {
            tenants: vec![id("bulk")],
            share: 100.0,
            ..Scope::default()
        };
        s.set_canary(Some(Canary::staged(new.clone(), &old, scope)));
        assert_eq!(
            decided_by_canary(&mut s, &cases),
            [false, true, false, false, true]
        );
        // All three together: bulk's requests for m that the canary puts in hi.
        let mut s = sched(&old);
        let scope = Scope {
            tenants: vec![id("bulk"), id("fresh")],
            tiers: vec![new.tier_id("hi").unwrap()],
            models: vec![new.model_id("m").unwrap()],
            share: 100.0,
            ..Scope::default()
        };
        s.set_canary(Some(Canary::staged(new.clone(), &old, scope)));
        assert_eq!(
            decided_by_canary(&mut s, &cases),
            [false, true, false, false, false]
        );
    }

    #[test]
    fn a_stage_share_samples_within_its_scope_only() {
        let old = graph(BASE);
        let new = graph(NEW);
        let scope = Scope {
            models: vec![new.model_id("m").unwrap()],
            share: 30.0,
            ..Scope::default()
        };
        let c = Canary::staged(new.clone(), &old, scope);
        let req = |model: &str| arrival(0, "chat", model, 10, 5).request;
        let (inside, outside) = (req("m"), req("api"));
        let n = 10_000u64;
        // In scope: exactly the ids the stable share picks, the same each time.
        assert!((0..n).all(|i| c.selects(i, &inside) == in_share(i, 30.0)));
        let picked = (0..n).filter(|&i| c.selects(i, &inside)).count() as f64;
        assert!((picked / n as f64 - 0.30).abs() < 0.02, "{picked}");
        // Out of scope: never, whatever the id.
        assert!(!(0..n).any(|i| c.selects(i, &outside)));
    }
}
