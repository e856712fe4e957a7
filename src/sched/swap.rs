//! Hot swap: a new policy version becomes active while requests wait and
//! run. Everything moves from the old graph to the new by name (tiers,
//! tenants, models and variants, pools), since ids are positions and differ
//! between versions. Replicas keep their indices; what the new version can
//! no longer serve while it waits is refused with `policy-changed` so the
//! gateway re-decides it, and what runs keeps running.

use super::plan::{Plan, ReplicaSpec};
use super::queue::Waiting;
use super::replica::Replica;
use super::{Action, Micros, Reason, ReqId, Scheduler};
use crate::graph::{DecisionGraph, PoolId, Signals, TenantId, TierId};
use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;

/// A model or variant id that no longer exists (a draining replica, or a
/// sequence on one, whose variant the new version dropped). It matches no
/// queue a live replica serves and indexes nothing.
pub const GONE: u16 = u16::MAX;

/// Old ids to new ones, by name; `None` where the name is gone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Remap {
    pub tiers: Vec<Option<TierId>>,
    pub tenants: Vec<Option<TenantId>>,
    /// By old model, then old variant: the new (model, variant).
    pub variants: Vec<Vec<Option<(u16, u16)>>>,
    pub pools: Vec<Option<PoolId>>,
    /// Where running work whose tier vanished goes: the new graph's lowest
    /// priority tier (the first, on a tie).
    pub stand_in: TierId,
}

fn by_name<'a, T: 'a, I: TryFrom<usize>>(
    old: impl Iterator<Item = &'a T>,
    new: &'a [T],
    name: impl Fn(&T) -> &str,
) -> Vec<Option<I>> {
    let index: HashMap<&str, usize> = new.iter().enumerate().map(|(i, x)| (name(x), i)).collect();
    old.map(|x| index.get(name(x)).and_then(|&i| I::try_from(i).ok()))
        .collect()
}

impl Remap {
    pub fn new(old: &DecisionGraph, new: &DecisionGraph) -> Remap {
        let models: Vec<Option<u16>> = by_name(old.models.iter(), &new.models, |m| m.name.as_str());
        let variants = old
            .models
            .iter()
            .zip(&models)
            .map(
                |(om, nm)| match nm.and_then(|m| new.models.get(m as usize).map(|x| (m, x))) {
                    Some((m, nmodel)) => {
                        by_name::<_, u16>(om.variants.iter(), &nmodel.variants, |v| v.name.as_str())
                            .into_iter()
                            .map(|v| v.map(|v| (m, v)))
                            .collect()
                    }
                    None => vec![None; om.variants.len()],
                },
            )
            .collect();
        let stand_in = new
            .tiers
            .iter()
            .enumerate()
            .min_by_key(|(i, t)| (t.priority, *i))
            .map_or(0, |(i, _)| i as TierId);
        Remap {
            tiers: by_name(old.tiers.iter(), &new.tiers, |t| t.name.as_str()),
            tenants: by_name(old.tenants.iter(), &new.tenants, |t| t.name.as_str()),
            variants,
            pools: by_name(old.pools.iter(), &new.pools, |p| p.name.as_str()),
            stand_in,
        }
    }

    pub fn tier(&self, t: TierId) -> Option<TierId> {
        self.tiers.get(t as usize).copied().flatten()
    }

    pub fn tenant(&self, t: TenantId) -> Option<TenantId> {
        self.tenants.get(t as usize).copied().flatten()
    }

    pub fn variant(&self, model: u16, variant: u16) -> Option<(u16, u16)> {
        self.variants
            .get(model as usize)
            .and_then(|v| v.get(variant as usize))
            .copied()
            .flatten()
    }

    pub fn pool(&self, p: PoolId) -> Option<PoolId> {
        self.pools.get(p as usize).copied().flatten()
    }

    /// Moves a request's ids to the new graph `g`. Waiting work whose tier,
    /// tenant (when it had one) or variant is gone cannot be placed: false,
    /// and it must be re-decided. Running work (`running`) always maps: a
    /// vanished tier becomes the stand-in (and the sequence an orphan,
    /// never preempted), a vanished tenant none, a vanished variant
    /// [`GONE`]. A vanished pool pin is lifted.
    pub fn waiting(&self, w: &mut Waiting, g: &DecisionGraph, running: bool) -> bool {
        let tier = match self.tier(w.tier) {
            Some(t) => t,
            None if running => {
                w.orphan = true;
                self.stand_in
            }
            None => return false,
        };
        let tenant = match w.tenant {
            None => None,
            Some(t) => match self.tenant(t) {
                Some(t) => Some(t),
                None if running => None,
                None => return false,
            },
        };
        let (model, variant) = match self.variant(w.model, w.variant) {
            Some(mv) => mv,
            None if running => (GONE, GONE),
            None => return false,
        };
        w.tier = tier;
        w.tenant = tenant;
        w.model = model;
        w.variant = variant;
        w.pool = w.pool.and_then(|p| self.pool(p));
        w.backfill = g.tiers.get(tier as usize).is_some_and(|t| t.backfill_only);
        true
    }
}

/// What a replica is, by name, for matching across versions: pool, model,
/// variant, and whether it is external.
pub(super) type ReplicaKey = (String, String, String, bool);

fn key_of(g: &DecisionGraph, s: &ReplicaSpec) -> Option<ReplicaKey> {
    let pool = g.pools.get(s.pool as usize)?;
    let model = g.models.get(s.model as usize)?;
    let variant = model.variants.get(s.variant as usize)?;
    Some((
        pool.name.clone(),
        model.name.clone(),
        variant.name.clone(),
        s.external,
    ))
}

impl Scheduler {
    /// Activates a new policy version (and its deployment plan) while
    /// requests wait and run, and returns the actions that caused; the
    /// slice is valid until the next call. See the module documentation
    /// for what moves where.
    ///
    /// - Replicas keep their indices: each replica of `plan` takes over the
    ///   first old replica not yet taken with the same pool, model,
    ///   variant and externality (by name), keeping its running work, step
    ///   in flight and prefix cache under the new spec; the rest are
    ///   appended. Old replicas left over drain: no new work, what runs
    ///   finishes.
    /// - Queued and delayed requests move to the new ids; one whose tier,
    ///   tenant or variant is gone, or that no replica of the new plan can
    ///   run, is refused with [`Reason::PolicyChanged`] (503, retry at once)
    ///   to be re-decided. Running sequences keep running (see
    ///   [`Remap::waiting`]).
    /// - Quotas are resized, not reset; fair-share counters, sessions and
    ///   queue order survive by name.
    pub fn swap(&mut self, now: Micros, graph: Arc<DecisionGraph>, plan: Plan) -> &[Action] {
        self.out.clear();
        self.now = self.now.max(now);
        self.queues.set_now(self.now);
        let old = self.graph.clone();
        let map = Remap::new(&old, &graph);
        if let Some(c) = self.canary.as_mut() {
            c.rebase(&graph);
        }

        // Replicas: match by name, in order; the rest drain. A replica
        // whose variant an earlier version dropped is known by the names it
        // had, and is taken again once idle (its sequences' ids are gone).
        let keys: Vec<Option<ReplicaKey>> = self
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| key_of(&old, &r.spec).or_else(|| self.gone.get(&i).cloned()))
            .collect();
        let mut taken = vec![false; self.replicas.len()];
        for spec in plan.replicas {
            let key = key_of(&graph, &spec);
            let found = key.and_then(|k| {
                (0..keys.len()).find(|&i| {
                    !taken[i]
                        && keys[i].as_ref() == Some(&k)
                        && (!self.gone.contains_key(&i) || self.replicas[i].running.is_empty())
                })
            });
            match found {
                Some(i) => {
                    taken[i] = true;
                    self.gone.remove(&i);
                    let r = &mut self.replicas[i];
                    r.respec(spec);
                    r.draining = false;
                }
                None => {
                    taken.push(true);
                    self.replicas.push(super::replica_for(&self.cfg, spec));
                }
            }
        }
        for (i, r) in self.replicas.iter_mut().enumerate() {
            if taken.get(i).copied().unwrap_or(true) {
                continue;
            }
            r.draining = true;
            let (m, v) = map
                .variant(r.spec.model, r.spec.variant)
                .unwrap_or((GONE, GONE));
            if m == GONE {
                if let Some(Some(k)) = keys.get(i) {
                    self.gone.insert(i, k.clone());
                }
            }
            r.spec.model = m;
            r.spec.variant = v;
            r.spec.pool = map.pool(r.spec.pool).unwrap_or(GONE);
            r.spec.only_tier = r.spec.only_tier.and_then(|t| map.tier(t));
        }
        // What runs keeps running, under new ids.
        for r in &mut self.replicas {
            for s in &mut r.running {
                map.waiting(&mut s.w, &graph, true);
            }
        }
        for h in self.held.values_mut() {
            h.tenant = h.tenant.and_then(|t| map.tenant(t));
            h.scoped = h.scoped.map(|q| super::scoped::Scoped {
                tier: q.tier.and_then(|t| map.tier(t)),
                model: q.model.and_then(|m| super::scoped::map_model(&map, m)),
                tokens: q.tokens,
            });
        }
        self.quotas = self.quotas.remap(&graph, &map.tenants, self.now);
        self.scoped = self.scoped.remap(&graph, &map, self.now);
        self.budgets = self.budgets.remap(&graph, &map.tenants, &map.tiers);
        self.sessions = std::mem::take(&mut self.sessions)
            .into_iter()
            .filter_map(|(k, (t, n))| map.tier(t).map(|t| (k, (t, n))))
            .collect();
        self.live
            .remap(&graph, |t| map.tier(t), |t| map.tenant(t), |p| map.pool(p));
        self.tier_started = vec![0; graph.tiers.len()];
        // Who asks and is admitted what is read anew under the new ids
        // (fair share's own preemption waits until half a window is read).
        self.admitted.clear();
        self.asked.clear();
        self.asked_since = None;
        // A new version decides anew whether to hold.
        self.holds = vec![None; graph.tiers.len()];
        self.signals = Signals::idle(&graph);
        self.idle = self.signals.clone();
        self.by_variant = HashMap::default();
        for (i, r) in self.replicas.iter().enumerate() {
            if !r.draining {
                self.by_variant
                    .entry((r.spec.model, r.spec.variant))
                    .or_default()
                    .push(i);
            }
        }
        self.reserves = Scheduler::reserves_of(&graph);
        self.graph = graph.clone();
        self.base = graph.clone();
        self.exceptions_active = vec![false; graph.exceptions.len()];
        self.exceptions_date = None;
        // The new version may read another time zone.
        self.civil = None;
        // Tier ids and caches change with the version: start them afresh.
        self.caches = super::cache::Caches::new(&graph, self.cfg.cache_bounds);
        self.semantic = super::semantic::SemanticCaches::new(&graph, self.cfg.cache_bounds);
        self.cache_pending.clear();
        let (by_variant, replicas) = (&self.by_variant, &self.replicas);
        let dropped = self.queues.remap(&graph, &self.cfg, &map, |w| {
            servable(by_variant, replicas, w)
        });
        for w in dropped {
            self.timers.remove(w.id);
            self.unpin(&w);
            self.refuse_changed(w.id, served_tokens(&w));
        }
        for r in 0..self.replicas.len() {
            if self.replicas[r].draining {
                self.release_pins(r);
            }
        }
        // Last: what the new version grants today, over what it declares.
        self.follow_exceptions_now();
        self.settle();
        &self.out
    }

    /// Refuses a request the policy change left without a place: the
    /// gateway re-submits it to be decided under the new version.
    pub(super) fn refuse_changed(&mut self, id: ReqId, used: f64) {
        self.end_held(id, used);
        self.out.push(Action::Reject {
            id,
            reason: Reason::PolicyChanged,
            status: 503,
            retry_after: Some(0),
        });
    }
}

/// Tokens a request has been served: its prompt and what it generated, once
/// it has run; nothing before.
pub(super) fn served_tokens(w: &Waiting) -> f64 {
    if w.started {
        f64::from(w.prompt_tokens) + f64::from(w.generated)
    } else {
        0.0
    }
}

/// Whether a live (not draining) replica could ever run `w`: one of its
/// variant, in its pool when it is pinned to one, with the KV memory for it (whole blocks of its pool).
pub(super) fn servable(
    by_variant: &HashMap<(u16, u16), Vec<usize>>,
    replicas: &[Replica],
    w: &Waiting,
) -> bool {
    let kv = u64::from(w.prompt_tokens) + u64::from(w.output_tokens);
    by_variant.get(&(w.model, w.variant)).is_some_and(|rs| {
        rs.iter().any(|&r| {
            replicas
                .get(r)
                .is_some_and(|x| w.pool.is_none_or(|p| x.spec.pool == p) && kv <= x.pool_tokens())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Event, MS};
    use super::*;

    /// BASE with tiers and tenants declared in another order (so every id
    /// differs), a new tenant, and a new variant of `m` on a new pool.
    const REORDERED: &str = r#"
pool q { gpus 1 kind "H100-80GB" memory 80GB }
pool p { gpus 1 kind "H100-80GB" memory 80GB }
pool ext { gpus 1 kind "H100-80GB" memory 80GB }
model api { variant up { precision fp16 memory 10GB pools [ext] max_batch 2 } }
model m {
  variant int4 { memory 5GB pools [q] max_batch 4 }
  variant fp16 { memory 10GB pools [p] max_batch 1 }
}
tier lo { priority 10 slo { window 1h } preemptible }
tier hi { priority 100 slo { ttft 10s } preempts [lo] }
tenant newbie { owner "o" tiers [lo] }
tenant bulk { owner "o" tiers [lo] }
tenant chat { owner "o" tiers [hi] quota { tokens 30k/min concurrent 4 } }
classify {
  when tenant == chat => tier hi
  default => tier lo
}
route [hi, lo] m {
  when tenant == newbie => int4
  default => fp16
}
route [hi, lo] api { default => up }
"#;

    /// Only the hi tier, the chat tenant and model m's int4 variant.
    const SMALL: &str = r#"
pool q { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant int4 { memory 5GB pools [q] max_batch 4 } }
tier hi { priority 100 slo { ttft 10s } }
tenant chat { owner "o" tiers [hi] }
classify { default => tier hi }
route hi m { default => int4 }
"#;

    fn rejected_changed(acts: &[Action]) -> Vec<ReqId> {
        ids(acts, |a| match a {
            Action::Reject {
                id,
                reason: Reason::PolicyChanged,
                status: 503,
                retry_after: Some(0),
            } => Some(*id),
            _ => None,
        })
    }

    #[test]
    fn remap_goes_by_name() {
        let (a, b) = (graph(BASE), graph(REORDERED));
        let m = Remap::new(&a, &b);
        // BASE: tiers [hi, lo], tenants [chat, bulk], pools [p, ext],
        // models [m.fp16, api.up].
        assert_eq!(m.tiers, vec![Some(1), Some(0)]);
        assert_eq!(m.tenants, vec![Some(2), Some(1)]);
        assert_eq!(m.pools, vec![Some(1), Some(2)]);
        assert_eq!(m.variant(0, 0), Some((1, 1)));
        assert_eq!(m.variant(1, 0), Some((0, 0)));
        assert_eq!(m.variant(9, 9), None);
        assert_eq!(m.stand_in, 0, "lo has the lowest priority");
        let back = Remap::new(&b, &graph(SMALL));
        assert_eq!(back.tiers, vec![None, Some(0)]);
        assert_eq!(back.tenants, vec![None, None, Some(0)]);
        assert_eq!(back.variant(1, 0), Some((0, 0)));
        assert_eq!(back.variant(1, 1), None);
    }

    #[test]
    fn waiting_work_that_cannot_map_is_refused_running_work_is_kept() {
        let (a, b) = (graph(BASE), graph(SMALL));
        let m = Remap::new(&a, &b);
        // bulk in lo on m.fp16: nothing of it is left.
        let w = waiting(1, 1, Some(1));
        assert!(!m.waiting(&mut w.clone(), &b, false));
        let mut r = w.clone();
        assert!(m.waiting(&mut r, &b, true));
        assert_eq!(
            (r.tier, r.tenant, r.model, r.variant),
            (0, None, GONE, GONE)
        );
        assert!(r.orphan);
        // chat in hi pinned to pool p (gone): the pin is lifted.
        let mut c = waiting(2, 0, Some(0));
        c.pool = Some(0);
        c.model = 0;
        assert!(!m.waiting(&mut c.clone(), &b, false), "m.fp16 is gone");
        let m2 = Remap::new(&a, &graph(REORDERED));
        assert!(m2.waiting(&mut c, &graph(REORDERED), false));
        assert_eq!(
            (c.tier, c.tenant, c.pool, c.model, c.variant),
            (1, Some(2), Some(1), 1, 1)
        );
        assert!(!c.orphan);
    }

    #[test]
    fn a_swap_keeps_what_runs_and_waits_under_new_ids() {
        let g = graph(BASE);
        let mut s = sched(&g);
        arrive(&mut s, 0, arrival(0, "bulk", "m", 100, 20));
        for id in 1..4 {
            arrive(&mut s, MS, arrival(id, "bulk", "m", 100, 20));
        }
        arrive(&mut s, MS, arrival(4, "chat", "api", 100, 20));
        let g2 = graph(REORDERED);
        let before: Vec<_> = s.replicas.iter().map(|r| r.spec.tag).collect();
        let acts = s.swap(2 * MS, g2.clone(), plan(&g2, 1_000_000)).to_vec();
        assert!(rejected_changed(&acts).is_empty(), "{acts:?}");
        assert!(Arc::ptr_eq(s.graph(), &g2));
        // p's replica and ext's keep their indices and their work; q's is new.
        assert_eq!(s.replicas.len(), 3);
        assert_eq!(s.replicas[0].running[0].w.id, 0);
        assert_eq!(s.replicas[0].running[0].w.tier, 0, "lo is tier 0 now");
        assert_eq!(s.replicas[0].running[0].w.tenant, Some(1));
        assert_eq!(
            (s.replicas[0].spec.model, s.replicas[0].spec.variant),
            (1, 1)
        );
        assert!(s.replicas[1].spec.external);
        assert_eq!(s.running_on(1), 1);
        assert!(s.replicas.iter().all(|r| !r.draining));
        assert_eq!(before.len(), 2);
        // Queued work still runs in its order, to the end.
        let mut order = Vec::new();
        let mut t = 2 * MS;
        for _ in 0..10_000 {
            if s.held.is_empty() || s.held.keys().all(|&id| id == 4) {
                break;
            }
            t = s.replicas[0].step_until.max(t);
            let acts = s.handle(t, Event::StepDone { replica: 0 }).to_vec();
            order.extend(started(&acts));
        }
        assert_eq!(order, vec![1, 2, 3]);
        // The quota was resized: chat still has one request in flight.
        assert_eq!(s.quotas.in_flight(2), 1);
        let acts = s
            .handle(
                t,
                Event::Complete {
                    id: 4,
                    output_tokens: 3,
                },
            )
            .to_vec();
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Finished { id: 4, .. })));
        assert_eq!(s.quotas.in_flight(2), 0);
    }

    #[test]
    fn a_swap_to_a_smaller_policy_refuses_what_waits_and_drains_what_runs() {
        let g = graph(BASE);
        let mut s = sched(&g);
        arrive(&mut s, 0, arrival(0, "bulk", "m", 100, 20));
        arrive(&mut s, 0, arrival(1, "chat", "m", 100, 20));
        arrive(&mut s, 0, arrival(2, "bulk", "api", 100, 20));
        arrive(&mut s, 0, arrival(3, "chat", "api", 100, 20));
        arrive(&mut s, 0, arrival(4, "chat", "api", 100, 20));
        assert_eq!(s.waiting(), 2);
        let small = graph(SMALL);
        let acts = s.swap(MS, small.clone(), plan(&small, 1_000_000)).to_vec();
        // Queued: 1 (chat on m.fp16, gone) and 4 (api.up, gone).
        assert_eq!(rejected_changed(&acts), vec![1, 4]);
        assert_eq!(s.waiting(), 0);
        // Running work keeps running on draining replicas (indices kept).
        assert_eq!(s.replicas.len(), 3);
        assert!(s.replicas[0].draining && s.replicas[1].draining);
        assert!(!s.replicas[2].draining);
        assert!(s.replicas[0].running[0].w.orphan);
        assert_eq!(s.sessions.len(), 0);
        // New work goes to the new replica only.
        let acts = arrive(&mut s, 2 * MS, arrival(5, "chat", "m", 100, 5));
        assert!(acts.iter().any(|a| matches!(
            a,
            Action::Started {
                id: 5,
                replica: 2,
                ..
            }
        )));
        // The drained work finishes.
        let mut done = Vec::new();
        let mut t = 2 * MS;
        for _ in 0..1000 {
            t = s.replicas[0].step_until.max(t);
            let acts = s.handle(t, Event::StepDone { replica: 0 }).to_vec();
            done.extend(ids(&acts, |a| match a {
                Action::Finished { id, .. } => Some(*id),
                _ => None,
            }));
            if done.contains(&0) {
                break;
            }
        }
        assert!(done.contains(&0));
        for id in [2, 3] {
            let acts = s
                .handle(
                    t,
                    Event::Complete {
                        id,
                        output_tokens: 20,
                    },
                )
                .to_vec();
            assert!(acts.iter().any(|a| matches!(a, Action::Finished { .. })));
        }
        assert!(s.replicas[..2]
            .iter()
            .all(|r| r.running.is_empty() && r.kv_used() == 0));
        // A draining replica that goes down gives up work no one can run.
        assert!(s.quotas.in_flight(0) <= 1);
    }

    #[test]
    fn a_draining_replica_comes_back_when_a_later_version_has_it_again() {
        let two = BASE.replace("pool p { gpus 1 kind", "pool p { gpus 2 kind");
        let (g2, g1) = (graph(&two), graph(BASE));
        let mut s = sched(&g2);
        assert_eq!(s.replicas.len(), 3, "two of m.fp16, one of api.up");
        arrive(&mut s, 0, arrival(0, "bulk", "m", 100, 20));
        arrive(&mut s, 0, arrival(1, "bulk", "m", 100, 20));
        s.swap(MS, g1.clone(), plan(&g1, 1_000_000));
        let draining: Vec<usize> = (0..s.replicas.len())
            .filter(|&i| s.replicas[i].draining)
            .collect();
        assert_eq!(draining.len(), 1);
        assert_eq!(s.running_on(draining[0]), 1, "it finishes what runs");
        // Back to two: the draining one is taken again, nothing appended.
        s.swap(2 * MS, g2.clone(), plan(&g2, 1_000_000));
        assert_eq!(s.replicas.len(), 3);
        assert!(s.replicas.iter().all(|r| !r.draining));
        // A replica whose variant a version dropped is known by its old
        // names, and taken again once idle.
        let small = graph(SMALL);
        s.swap(3 * MS, small.clone(), plan(&small, 1_000_000));
        assert_eq!(s.replicas.len(), 4);
        assert_eq!(s.gone.len(), 3);
        assert_eq!(
            (s.replicas[0].spec.model, s.replicas[0].spec.variant),
            (GONE, GONE)
        );
        // Replicas 0 and 1 still run requests 0 and 1 (under gone ids):
        // not taken; the idle external one is.
        assert_eq!((s.running_on(0), s.running_on(1)), (1, 1));
        s.swap(4 * MS, g1.clone(), plan(&g1, 1_000_000));
        assert_eq!(s.replicas.len(), 5, "a fresh one for m.fp16");
        let live: Vec<usize> = (0..5).filter(|&i| !s.replicas[i].draining).collect();
        assert_eq!(live, vec![2, 4]);
        // Once idle, they are taken again, first in order.
        let mut t = 4 * MS;
        while s.running_on(0) + s.running_on(1) > 0 {
            let r = if s.running_on(0) > 0 { 0 } else { 1 };
            t = s.replicas[r].step_until.max(t);
            s.handle(t, Event::StepDone { replica: r });
        }
        s.swap(t, small.clone(), plan(&small, 1_000_000));
        assert_eq!(s.replicas.len(), 5, "q's replica is taken again");
        s.swap(t, g2.clone(), plan(&g2, 1_000_000));
        assert_eq!(s.replicas.len(), 5);
        let live: Vec<usize> = (0..5).filter(|&i| !s.replicas[i].draining).collect();
        assert_eq!(live, vec![0, 1, 2]);
        assert_eq!(s.by_variant.get(&(0, 0)), Some(&vec![0, 1]));
    }

    #[test]
    fn a_running_orphan_is_never_preempted() {
        // hi preempts lo; after the swap lo is gone and bulk's running
        // request is an orphan in the stand-in tier.
        let g = graph(BASE);
        let mut s = sched(&g);
        arrive(&mut s, 0, arrival(0, "bulk", "m", 100, 100_000));
        let no_lo = BASE
            .replace(
                "tier lo { priority 10 slo { window 1h } preemptible }",
                "tier lo2 { priority 10 slo { window 1h } preemptible }",
            )
            .replace("preempts [lo]", "preempts [lo2]")
            .replace("tiers [lo]", "tiers [lo2]")
            .replace("default => tier lo", "default => tier lo2")
            .replace("[hi, lo]", "[hi, lo2]");
        let g2 = graph(&no_lo);
        s.swap(MS, g2.clone(), plan(&g2, 1_000_000));
        assert!(s.replicas[0].running[0].w.orphan);
        let mut acts = arrive(&mut s, 2 * MS, arrival(1, "chat", "m", 100, 5));
        for k in 1..200u64 {
            let t = s.replicas[0].step_until.max(k * 100 * MS);
            acts.extend(s.handle(t, Event::StepDone { replica: 0 }).to_vec());
        }
        assert!(!acts.iter().any(|a| matches!(a, Action::Preempted { .. })));
        assert_eq!(s.replicas[0].running[0].w.id, 0);
    }

    #[test]
    fn a_sequence_a_shrunk_pool_can_never_hold_is_refused_not_looped() {
        let g = graph(BASE);
        let mut s = sched(&g);
        arrive(&mut s, 0, arrival(0, "bulk", "m", 100, 2000));
        let r = s.replicas.iter().position(|x| !x.spec.external).unwrap();
        assert_eq!(s.running_on(r), 1);
        // The same policy on 10 KV blocks: the prompt (7 blocks) fits, the
        // output never will, and no other replica could take it.
        s.swap(MS, g.clone(), plan(&g, 160));
        let mut refused = Vec::new();
        for _ in 0..200 {
            let until = s.replicas[r].step_until.max(s.now());
            let acts = s.handle(until, Event::StepDone { replica: r }).to_vec();
            refused.extend(rejected_changed(&acts));
            if s.running_on(r) == 0 {
                break;
            }
        }
        assert_eq!(refused, vec![0]);
        assert_eq!(s.running_on(r), 0);
        assert_eq!(s.waiting(), 0);
        assert_eq!(s.replicas[r].kv_used(), 0);
    }
}
