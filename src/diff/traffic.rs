//! The dry run: recorded requests decided by both graphs (decision diff),
//! and both policies replayed through the simulator on the same traffic
//! (impact), compared per tier and per tenant.

use crate::graph::{DecisionGraph, DecisionView, Signals};
use crate::replay::report::{BatchGroup, Group, Report};
use crate::sched::{Micros, SEC};
use crate::traffic::Record;
use serde::Serialize;
use std::collections::BTreeMap;

/// How many changed requests are shown with both decisions.
pub const SAMPLES: usize = 8;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Transition {
    /// tier, tenant, variant, route (pool), admission or fallback_step
    pub kind: String,
    pub old: String,
    pub new: String,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Position of the request in the merged traffic (0-based).
    pub index: usize,
    pub request: String,
    pub old: DecisionView,
    pub new: DecisionView,
    /// Both explanations, condition by condition (rule ids index each
    /// policy's own rules).
    pub old_trace: crate::graph::trace::Trace,
    pub new_trace: crate::graph::trace::Trace,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionDiff {
    pub requests: u64,
    /// Requests whose decision differs in at least one field.
    pub changed: u64,
    /// Changed requests per kind of change (a request may count in several).
    pub by_kind: BTreeMap<String, u64>,
    /// Most frequent transitions first.
    pub transitions: Vec<Transition>,
    pub samples: Vec<Sample>,
}

/// Describes a request in one line, for samples.
pub fn describe(r: &crate::graph::Request) -> String {
    let mut s = String::new();
    if let Some(t) = &r.tenant {
        s.push_str(&format!("tenant={t} "));
    }
    if let Some(k) = &r.api_key {
        s.push_str(&format!("api_key={k} "));
    }
    s.push_str(&format!("model={}", r.model));
    for (k, v) in &r.headers {
        s.push_str(&format!(" {k}={v}"));
    }
    for t in &r.tags {
        s.push_str(&format!(" tag={t}"));
    }
    if r.session.is_some() {
        s.push_str(" session");
    }
    s.push_str(&format!(" prompt={} max={}", r.prompt_tokens, r.max_tokens));
    s
}

fn split_route(route: &Option<String>) -> (String, String) {
    match route {
        Some(r) => match r.split_once(" on ") {
            Some((v, p)) => (v.to_string(), p.to_string()),
            None => (r.clone(), "(any)".into()),
        },
        None => ("(none)".into(), "(none)".into()),
    }
}

/// Decides every request under both graphs, with the signals of an idle
/// fleet at the time of day the request arrived (the run starting at
/// `start_minute` on `start_weekday`).
pub fn decisions(
    old: &DecisionGraph,
    new: &DecisionGraph,
    records: &[Record],
    start_minute: u32,
    start_weekday: u8,
) -> DecisionDiff {
    let mut so = Signals::idle(old);
    let mut sn = Signals::idle(new);
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    let mut trans: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    let mut samples = Vec::new();
    let mut changed = 0;
    for (i, r) in records.iter().enumerate() {
        let at = (r.at_ms.max(0.0) * 1000.0) as Micros;
        let minutes = u64::from(start_minute) + at / (60 * SEC);
        let (minute, day) = (
            (minutes % 1440) as u16,
            ((u64::from(start_weekday) + minutes / 1440) % 7) as u8,
        );
        so.time_of_day = minute;
        sn.time_of_day = minute;
        so.weekday = day;
        sn.weekday = day;
        let req = r.request();
        let a = old.view(&old.decide(&req, &so));
        let b = new.view(&new.decide(&req, &sn));
        let (va, pa) = split_route(&a.route);
        let (vb, pb) = split_route(&b.route);
        let fields: [(&str, String, String); 6] = [
            ("tier", a.tier.clone(), b.tier.clone()),
            (
                "tenant",
                a.tenant.clone().unwrap_or_else(|| "(none)".into()),
                b.tenant.clone().unwrap_or_else(|| "(none)".into()),
            ),
            ("variant", va, vb),
            ("route", pa, pb),
            ("admission", admission(&a), admission(&b)),
            (
                "fallback_step",
                a.fallback_step.map_or("none".into(), |s| s.to_string()),
                b.fallback_step.map_or("none".into(), |s| s.to_string()),
            ),
        ];
        let mut any = false;
        for (kind, x, y) in fields {
            // A variant change also moves the route; count it once, as variant.
            if x != y && !(kind == "route" && any && by_variant_changed(&a, &b)) {
                any = true;
                *by_kind.entry(kind.to_string()).or_default() += 1;
                *trans.entry((kind.to_string(), x, y)).or_default() += 1;
            }
        }
        if any {
            changed += 1;
            if samples.len() < SAMPLES {
                samples.push(Sample {
                    index: i,
                    request: describe(&req),
                    old: a,
                    new: b,
                    old_trace: old.explain(&req, &so).1,
                    new_trace: new.explain(&req, &sn).1,
                });
            }
        }
    }
    let mut transitions: Vec<Transition> = trans
        .into_iter()
        .map(|((kind, old, new), count)| Transition {
            kind,
            old,
            new,
            count,
        })
        .collect();
    transitions.sort_by(|x, y| {
        y.count
            .cmp(&x.count)
            .then_with(|| (&x.kind, &x.old, &x.new).cmp(&(&y.kind, &y.old, &y.new)))
    });
    transitions.truncate(20);
    DecisionDiff {
        requests: records.len() as u64,
        changed,
        by_kind,
        transitions,
        samples,
    }
}

fn by_variant_changed(a: &DecisionView, b: &DecisionView) -> bool {
    split_route(&a.route).0 != split_route(&b.route).0
}

fn admission(v: &DecisionView) -> String {
    match v.status {
        Some(s) => format!("{} {s}", v.admission),
        None => v.admission.clone(),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricDelta {
    pub metric: String,
    pub old: f64,
    pub new: f64,
    pub delta: f64,
    /// Relative change, when the old value is not zero.
    pub pct: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupDelta {
    pub name: String,
    pub metrics: Vec<MetricDelta>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Impact {
    pub old: Report,
    pub new: Report,
    pub tiers: Vec<GroupDelta>,
    pub tenants: Vec<GroupDelta>,
    /// Per batch id (items with an `x-kiln-batch` header), in id order:
    /// items, completed, deadline misses, last finish and deadline (s);
    /// absent when the traffic has no batch items.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub batches: Vec<GroupDelta>,
    pub fleet: Vec<MetricDelta>,
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub fn metric(name: &str, old: f64, new: f64) -> MetricDelta {
    MetricDelta {
        metric: name.to_string(),
        old: round(old),
        new: round(new),
        delta: round(new - old),
        pct: (old != 0.0).then(|| round((new - old) / old.abs() * 100.0)),
    }
}

/// The metrics compared for one group, in report order.
pub fn group_metrics(old: Option<&Group>, new: Option<&Group>) -> Vec<MetricDelta> {
    let f = |g: Option<&Group>, get: &dyn Fn(&Group) -> f64| g.map_or(0.0, get);
    let p = |g: Option<&Group>, get: &dyn Fn(&Group) -> Option<f64>| g.and_then(get).unwrap_or(0.0);
    let mut v = vec![
        metric(
            "requests",
            f(old, &|g| g.requests as f64),
            f(new, &|g| g.requests as f64),
        ),
        metric(
            "ttft_p50_ms",
            p(old, &|g| g.ttft_ms.as_ref().map(|x| x.p50)),
            p(new, &|g| g.ttft_ms.as_ref().map(|x| x.p50)),
        ),
        metric(
            "ttft_p95_ms",
            p(old, &|g| g.ttft_ms.as_ref().map(|x| x.p95)),
            p(new, &|g| g.ttft_ms.as_ref().map(|x| x.p95)),
        ),
        metric(
            "ttft_p99_ms",
            p(old, &|g| g.ttft_ms.as_ref().map(|x| x.p99)),
            p(new, &|g| g.ttft_ms.as_ref().map(|x| x.p99)),
        ),
        metric(
            "e2e_p50_ms",
            p(old, &|g| g.e2e_ms.as_ref().map(|x| x.p50)),
            p(new, &|g| g.e2e_ms.as_ref().map(|x| x.p50)),
        ),
        metric(
            "e2e_p95_ms",
            p(old, &|g| g.e2e_ms.as_ref().map(|x| x.p95)),
            p(new, &|g| g.e2e_ms.as_ref().map(|x| x.p95)),
        ),
        metric(
            "e2e_p99_ms",
            p(old, &|g| g.e2e_ms.as_ref().map(|x| x.p99)),
            p(new, &|g| g.e2e_ms.as_ref().map(|x| x.p99)),
        ),
        metric(
            "slo_attainment",
            f(old, &|g| g.slo_attainment),
            f(new, &|g| g.slo_attainment),
        ),
        metric(
            "goodput_rps",
            f(old, &|g| g.goodput_rps),
            f(new, &|g| g.goodput_rps),
        ),
        metric(
            "rejected",
            f(old, &|g| g.rejected as f64),
            f(new, &|g| g.rejected as f64),
        ),
        metric(
            "preemptions",
            f(old, &|g| g.preemptions as f64),
            f(new, &|g| g.preemptions as f64),
        ),
        metric(
            "fallbacks",
            f(old, &|g| g.fallbacks as f64),
            f(new, &|g| g.fallbacks as f64),
        ),
        metric(
            "gpu_seconds",
            f(old, &|g| g.gpu_seconds),
            f(new, &|g| g.gpu_seconds),
        ),
        metric("cost", f(old, &|g| g.cost), f(new, &|g| g.cost)),
    ];
    // Only where a model declares a value: other diffs read as before.
    if old.or(new).is_some_and(|g| g.value.is_some()) || new.is_some_and(|g| g.value.is_some()) {
        v.push(metric("value", p(old, &|g| g.value), p(new, &|g| g.value)));
    }
    v
}

fn deltas(old: &[Group], new: &[Group]) -> Vec<GroupDelta> {
    let mut names: Vec<&str> = old
        .iter()
        .chain(new.iter())
        .map(|g| g.name.as_str())
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    names.retain(|n| seen.insert(*n));
    names
        .into_iter()
        .map(|n| GroupDelta {
            name: n.to_string(),
            metrics: group_metrics(
                old.iter().find(|g| g.name == n),
                new.iter().find(|g| g.name == n),
            ),
        })
        .collect()
}

/// The metrics compared for one batch (0 where a side lacks it).
pub fn batch_metrics(old: Option<&BatchGroup>, new: Option<&BatchGroup>) -> Vec<MetricDelta> {
    let f = |b: Option<&BatchGroup>, get: &dyn Fn(&BatchGroup) -> f64| b.map_or(0.0, get);
    let p = |b: Option<&BatchGroup>, get: &dyn Fn(&BatchGroup) -> Option<f64>| {
        b.and_then(get).unwrap_or(0.0)
    };
    vec![
        metric(
            "items",
            f(old, &|b| b.items as f64),
            f(new, &|b| b.items as f64),
        ),
        metric(
            "completed",
            f(old, &|b| b.completed as f64),
            f(new, &|b| b.completed as f64),
        ),
        metric(
            "deadline_misses",
            f(old, &|b| b.deadline_misses as f64),
            f(new, &|b| b.deadline_misses as f64),
        ),
        metric(
            "finished_s",
            p(old, &|b| b.finished_s),
            p(new, &|b| b.finished_s),
        ),
        metric(
            "deadline_s",
            p(old, &|b| b.deadline_s),
            p(new, &|b| b.deadline_s),
        ),
    ]
}

fn batch_deltas(old: &[BatchGroup], new: &[BatchGroup]) -> Vec<GroupDelta> {
    let ids: std::collections::BTreeSet<&str> = old
        .iter()
        .chain(new.iter())
        .map(|b| b.id.as_str())
        .collect();
    ids.into_iter()
        .map(|id| GroupDelta {
            name: id.to_string(),
            metrics: batch_metrics(
                old.iter().find(|b| b.id == id),
                new.iter().find(|b| b.id == id),
            ),
        })
        .collect()
}

pub fn impact(old: Report, new: Report) -> Impact {
    let tiers = deltas(&old.tiers, &new.tiers);
    let tenants = deltas(&old.tenants, &new.tenants);
    let batches = batch_deltas(&old.batches, &new.batches);
    let fleet = vec![
        metric("busy", old.busy, new.busy),
        metric("prefill_load", old.prefill_load, new.prefill_load),
        metric("decode_load", old.decode_load, new.decode_load),
        metric("duration_s", old.duration_s, new.duration_s),
        metric("max_service_gap", old.max_service_gap, new.max_service_gap),
    ];
    Impact {
        old,
        new,
        tiers,
        tenants,
        batches,
        fleet,
    }
}
