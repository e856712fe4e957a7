//! Shadowing: a proposed version decides every request beside the active
//! one, enforcing nothing; what differs is counted and sampled for the
//! rollout's report.

use super::lock;
use super::view::{ShadowCounts, ShadowSample};
use super::Policy;
use crate::graph::{DecisionGraph, Request, Signals};
use crate::sched::canary::map_signals;
use crate::sched::swap::Remap;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Shadow differences kept as samples.
const SHADOW_SAMPLES: usize = 20;

/// A version deciding every request in parallel, enforcing nothing.
pub struct Shadow {
    pub version: Arc<str>,
    graph: Arc<DecisionGraph>,
    /// The active version `map` was built against.
    active: Arc<str>,
    map: Remap,
    /// Idle signals for `graph`, cloned per request (names shared).
    idle: Signals,
    decided: AtomicU64,
    differ: AtomicU64,
    by_field: Mutex<BTreeMap<String, u64>>,
    samples: Mutex<VecDeque<ShadowSample>>,
}

impl Shadow {
    /// `policy` shadowing `active`.
    pub fn new(policy: &Policy, active: &Policy) -> Shadow {
        Shadow {
            version: policy.version.clone(),
            graph: policy.graph.clone(),
            active: active.version.clone(),
            map: Remap::new(&policy.graph, &active.graph),
            idle: Signals::idle(&policy.graph),
            decided: AtomicU64::new(0),
            differ: AtomicU64::new(0),
            by_field: Mutex::new(BTreeMap::new()),
            samples: Mutex::new(VecDeque::new()),
        }
    }

    pub fn counts(&self) -> ShadowCounts {
        ShadowCounts {
            decided: self.decided.load(Ordering::Relaxed),
            differ: self.differ.load(Ordering::Relaxed),
            by_field: lock(&self.by_field).clone(),
            samples: lock(&self.samples).iter().cloned().collect(),
        }
    }
}

/// Decides `req` with the shadow version too and counts what differs.
/// `graph` and `signals` are what the active `version` decided with. The
/// fields that differed (`tier`, `tenant`, `route`, `admission`; none when
/// the decisions agree), or `None` when the active version changed under
/// the shadow and nothing was compared.
pub fn shadow_compare(
    sh: &Shadow,
    version: &str,
    req: &Request,
    graph: &DecisionGraph,
    signals: &Signals,
) -> Option<Vec<&'static str>> {
    if sh.active.as_ref() != version {
        return None;
    }
    let a = graph.decide(req, signals);
    let mut mapped = sh.idle.clone();
    map_signals(&sh.map, signals, &mut mapped);
    let b = sh.graph.decide(req, &mapped);
    let tier = |g: &DecisionGraph, t: u16| {
        g.tiers
            .get(t as usize)
            .map(|x| x.name.clone())
            .unwrap_or_default()
    };
    let tenant = |g: &DecisionGraph, t: Option<u32>| {
        t.and_then(|t| g.tenants.get(t as usize))
            .map(|x| x.name.clone())
            .unwrap_or_else(|| "(none)".into())
    };
    let route = |g: &DecisionGraph, t: Option<crate::graph::Target>| {
        t.map(|t| g.target_name(&t))
            .unwrap_or_else(|| "(none)".into())
    };
    let fields = [
        ("tier", tier(graph, a.tier), tier(&sh.graph, b.tier)),
        (
            "tenant",
            tenant(graph, a.tenant),
            tenant(&sh.graph, b.tenant),
        ),
        ("route", route(graph, a.target), route(&sh.graph, b.target)),
        (
            "admission",
            a.admission.kind().to_string(),
            b.admission.kind().to_string(),
        ),
    ];
    let differ: Vec<&(&'static str, String, String)> =
        fields.iter().filter(|(_, x, y)| x != y).collect();
    sh.decided.fetch_add(1, Ordering::Relaxed);
    let names: Vec<&'static str> = differ.iter().map(|(f, _, _)| *f).collect();
    if differ.is_empty() {
        return Some(names);
    }
    sh.differ.fetch_add(1, Ordering::Relaxed);
    {
        let mut m = lock(&sh.by_field);
        for f in &names {
            *m.entry((*f).to_string()).or_default() += 1;
        }
    }
    let request = crate::diff::traffic::describe(req);
    let mut s = lock(&sh.samples);
    for (f, x, y) in differ {
        tracing::debug!(version = %sh.version, field = f, active = %x, proposed = %y, request = %request, "shadow decision differs");
        if s.len() >= SHADOW_SAMPLES {
            s.pop_front();
        }
        s.push_back(ShadowSample {
            request: request.clone(),
            field: (*f).to_string(),
            active: x.clone(),
            proposed: y.clone(),
        });
    }
    Some(names)
}
