//! Helpers for the scheduler's unit tests: small policies, a linear cost
//! model, plans and requests.

use super::plan::{Costing, Plan, StepCost};
use super::queue::Waiting;
use super::{Action, Arrival, Config, Event, Micros, ReqId, Scheduler};
use crate::graph::{DecisionGraph, Request};
use std::sync::Arc;

/// 1 ms per step plus 0.01 ms per prefill token and 0.1 ms per decode.
#[derive(Debug)]
pub struct Linear;

impl StepCost for Linear {
    fn step_time(&self, prefill: u32, decode: u32, _context: u64) -> f64 {
        0.001 + f64::from(prefill) * 0.000_01 + f64::from(decode) * 0.000_1
    }
}

pub fn graph(text: &str) -> Arc<DecisionGraph> {
    let c = crate::compile::compile_str("t.kiln", text);
    let msgs: Vec<_> = c
        .diagnostics
        .items
        .iter()
        .map(|d| d.message.clone())
        .collect();
    match c.graph {
        Some(g) => Arc::new(g),
        None => panic!("policy does not compile: {msgs:?}"),
    }
}

/// The plan for `g` with the linear cost model; replicas in pools named
/// `ext…` are external.
pub fn plan(g: &DecisionGraph, kv: u64) -> Plan {
    let mut plan = Plan::from_graph(g, |_, _, _| {
        Some(Costing {
            cost: Arc::new(Linear),
            kv_capacity: kv,
        })
    });
    for r in &mut plan.replicas {
        r.external = g
            .pools
            .get(r.pool as usize)
            .is_some_and(|p| p.name.starts_with("ext"));
    }
    plan
}

pub fn sched(g: &Arc<DecisionGraph>) -> Scheduler {
    Scheduler::new(g.clone(), plan(g, 1_000_000), Config::default())
}

pub fn arrival(id: ReqId, tenant: &str, model: &str, prompt: u64, output: u32) -> Arrival {
    Arrival {
        quota_claimed: false,
        fleet: None,
        cache: None,
        semantic: None,
        window: None,
        id,
        request: Request {
            tenant: Some(tenant.into()),
            model: model.into(),
            prompt_tokens: prompt,
            max_tokens: u64::from(output),
            ..Default::default()
        },
        output_tokens: output,
        prefix_blocks: Vec::new(),
    }
}

pub fn arrive(s: &mut Scheduler, now: Micros, a: Arrival) -> Vec<Action> {
    s.handle(now, Event::Arrive(a)).to_vec()
}

pub fn waiting(id: ReqId, tier: u16, tenant: Option<u32>) -> Waiting {
    Waiting {
        id,
        tier,
        tenant,
        arrival: id,
        deadline: None,
        expires: None,
        prompt_tokens: 10,
        output_tokens: 5,
        generated: 0,
        model: 0,
        variant: 0,
        pool: None,
        prefix_blocks: Vec::new(),
        affinity: None,
        pin_until: 0,
        est_start: None,
        preemptions: 0,
        backfill: false,
        borrowed: false,
        waiting_for: None,
        gpu_seconds: 0.0,
        wasted_gpu_seconds: 0.0,
        redo_tokens: 0,
        claims: Default::default(),
        started: false,
        orphan: false,
        preemptible_item: false,
        best_effort: false,
    }
}

/// One pool of one GPU, model `m` with one replica that runs one sequence
/// at a time; an external pool `ext` whose replica of `m.api` takes two;
/// tiers hi (preempts lo) and lo; tenants chat (hi) and bulk (lo).
pub const BASE: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
pool ext { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] max_batch 1 } }
model api { variant up { precision fp16 memory 10GB pools [ext] max_batch 2 } }
tier hi { priority 100 slo { ttft 10s } preempts [lo] }
tier lo { priority 10 slo { window 1h } preemptible }
tenant chat { owner "o" tiers [hi] quota { tokens 60k/min concurrent 4 } }
tenant bulk { owner "o" tiers [lo] }
classify {
  when tenant == chat => tier hi
  default => tier lo
}
route [hi, lo] m { default => fp16 }
route [hi, lo] api { default => up }
"#;

/// Ids of the actions of one kind.
pub fn ids(acts: &[Action], f: impl Fn(&Action) -> Option<ReqId>) -> Vec<ReqId> {
    acts.iter().filter_map(f).collect()
}

pub fn started(acts: &[Action]) -> Vec<ReqId> {
    ids(acts, |a| match a {
        Action::Started { id, .. } => Some(*id),
        _ => None,
    })
}
