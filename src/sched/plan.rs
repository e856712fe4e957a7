//! Deployment: which replicas run where. A replica of a variant needing N
//! GPUs is placed on N GPUs of one pool at once or not at all (gang
//! placement); GPUs that cannot hold a whole replica stay idle and are
//! reported, never partially reserved.

use crate::graph::limits;
use crate::graph::{DecisionGraph, PoolId, RouteOutcome, Step, TierId};
use std::sync::Arc;

/// The time one continuous-batching step takes on a replica.
pub trait StepCost: Send + Sync + std::fmt::Debug {
    /// Seconds for a step that prefills `prefill_tokens` and decodes one
    /// token for each of `decode_seqs` sequences holding `context_tokens`.
    fn step_time(&self, prefill_tokens: u32, decode_seqs: u32, context_tokens: u64) -> f64;
}

#[derive(Debug, Clone)]
pub struct ReplicaSpec {
    pub pool: PoolId,
    pub model: u16,
    pub variant: u16,
    pub gpus: u32,
    /// KV cache capacity in tokens.
    pub kv_capacity: u64,
    pub max_batch: u32,
    pub max_batch_tokens: u32,
    pub cost: Arc<dyn StepCost>,
    /// In the `static` baseline, the only tier this replica serves.
    pub only_tier: Option<TierId>,
    /// The batch runs elsewhere (an HTTP upstream such as vLLM): the
    /// scheduler fills its `max_batch` slots in queue order and emits
    /// `Started`, but never `Step` or `FirstToken`, and never preempts (or,
    /// when it goes down, re-queues) work on it; the environment reports
    /// each request's end with `Event::Complete` (or `Event::Cancel`).
    pub external: bool,
    /// An opaque label for the environment (the gateway: which backend
    /// serves this replica). The scheduler carries it and never reads it.
    pub tag: u32,
}

#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub replicas: Vec<ReplicaSpec>,
    /// (model, variant, pool): variants that got no replica, with why.
    pub unplaced: Vec<(u16, u16, PoolId, String)>,
}

/// What a (variant, pool) pair costs, supplied by the backend.
pub struct Costing {
    pub cost: Arc<dyn StepCost>,
    pub kv_capacity: u64,
}

impl Plan {
    /// Places replicas of every variant the policy routes to, pool by pool,
    /// round-robin in order of how often the policy names them, whole gangs
    /// only. `costing` gives each (model, variant, pool) its cost model, or
    /// `None` when it cannot run there.
    pub fn from_graph(
        g: &DecisionGraph,
        mut costing: impl FnMut(u16, u16, PoolId) -> Option<Costing>,
    ) -> Plan {
        // Demand: how many route and fallback targets name each pair.
        let mut demand: Vec<((u16, u16, PoolId), u32)> = Vec::new();
        let mut bump = |m: u16, v: u16, p: Option<PoolId>| {
            let pools: Vec<PoolId> = match p {
                Some(p) => vec![p],
                None => g.models[m as usize].variants[v as usize].pools.clone(),
            };
            // An unpinned target runs on its variant's first pool.
            if let Some(&p) = pools.first() {
                match demand.iter_mut().find(|(k, _)| *k == (m, v, p)) {
                    Some((_, n)) => *n += 1,
                    None => demand.push(((m, v, p), 1)),
                }
            }
        };
        for rs in g.routes.iter().flatten() {
            for o in rs.rules.iter().map(|(_, _, o)| o).chain([&rs.default.1]) {
                if let RouteOutcome::Target(t) = o {
                    bump(t.model, t.variant, t.pool);
                }
            }
        }
        for ch in g.fallbacks.iter().flatten() {
            for (_, s) in &ch.steps {
                if let Step::Route(t) = s {
                    bump(t.model, t.variant, t.pool);
                }
            }
        }
        // `degrade variant MODEL.VARIANT` (a substitute's variant, or the
        // model's own) needs replicas of that variant too.
        for (name, m) in g.degrade_names.iter().zip(&g.degrade_models) {
            let Some(m) = *m else { continue };
            let found = g
                .models
                .get(m as usize)
                .and_then(|x| x.variants.iter().position(|v| &v.name == name));
            if let Some(v) = found {
                bump(m, v as u16, None);
            }
        }
        demand.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut plan = Plan::default();
        for (pi, pool) in g.pools.iter().enumerate() {
            let pi = pi as PoolId;
            // `kiln check` bounds a pool's GPUs; a graph built otherwise
            // still never plans more than the limits allow.
            let mut free = pool.gpus.min(limits::MAX_POOL_GPUS);
            let mut wanted: Vec<(u16, u16, u32, Costing)> = Vec::new();
            for &((m, v, p), _) in &demand {
                if p != pi {
                    continue;
                }
                let gpus = g.models[m as usize].variants[v as usize].gpus_per_replica;
                match costing(m, v, pi) {
                    Some(c) => wanted.push((m, v, gpus, c)),
                    None => {
                        plan.unplaced
                            .push((m, v, pi, "the cost model cannot run it here".into()))
                    }
                }
            }
            // Round-robin whole replicas until nothing more fits.
            let mut placed_any = true;
            let mut counts = vec![0u32; wanted.len()];
            while placed_any {
                placed_any = false;
                for (i, (m, v, gpus, c)) in wanted.iter().enumerate() {
                    if plan.replicas.len() >= limits::MAX_REPLICAS {
                        break;
                    }
                    // A variant needs at least one GPU a replica: a zero
                    // would place replicas without end.
                    if *gpus >= 1 && *gpus <= free {
                        free -= gpus;
                        counts[i] += 1;
                        placed_any = true;
                        let var = &g.models[*m as usize].variants[*v as usize];
                        plan.replicas.push(ReplicaSpec {
                            pool: pi,
                            model: *m,
                            variant: *v,
                            gpus: *gpus,
                            kv_capacity: c.kv_capacity,
                            max_batch: var.max_batch,
                            max_batch_tokens: var.batch_tokens_on(&g.pools[usize::from(pi)]),
                            cost: c.cost.clone(),
                            only_tier: None,
                            external: false,
                            tag: 0,
                        });
                    }
                }
            }
            for (i, (m, v, gpus, _)) in wanted.iter().enumerate() {
                if counts[i] == 0 {
                    plan.unplaced.push((
                        *m,
                        *v,
                        pi,
                        format!("needs {gpus} GPUs in one pool; {free} left free"),
                    ));
                }
            }
        }
        plan
    }

    /// The `static` baseline: replicas of each variant are split evenly
    /// between the tiers that route to it.
    pub fn partition_by_tier(&mut self, g: &DecisionGraph) {
        let nm = g.models.len();
        let mut users: std::collections::HashMap<(u16, u16), Vec<TierId>> = Default::default();
        for (i, rs) in g.routes.iter().enumerate() {
            let Some(rs) = rs else { continue };
            let tier = (i / nm.max(1)) as TierId;
            for o in rs.rules.iter().map(|(_, _, o)| o).chain([&rs.default.1]) {
                if let RouteOutcome::Target(t) = o {
                    let e = users.entry((t.model, t.variant)).or_default();
                    if !e.contains(&tier) {
                        e.push(tier);
                    }
                }
            }
        }
        let mut seen: std::collections::HashMap<(u16, u16), usize> = Default::default();
        for r in &mut self.replicas {
            let Some(tiers) = users.get(&(r.model, r.variant)) else {
                continue;
            };
            if tiers.is_empty() {
                continue;
            }
            let n = seen.entry((r.model, r.variant)).or_default();
            r.only_tier = Some(tiers[*n % tiers.len()]);
            *n += 1;
        }
    }
}
