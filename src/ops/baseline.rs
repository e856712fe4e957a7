//! The service a gateway recorded, from its own decision log: waits, time
//! to first token and end-to-end latency, how requests ended, and when the
//! fleet was saturated and who was there. This is the baseline of today
//! that a rollout plan starts from (`kiln report` on a decision log); the
//! demand side is [`super::report`]'s inventory.
//!
//! Public traces carry no outcomes, so there is no section for them: it is
//! built only from records that say how they ended.

use crate::graph::BATCH_HEADER;
use crate::sched::Reason;
use crate::traffic::stats::Percentiles;
use crate::traffic::Record;
use serde::Serialize;
use std::collections::BTreeMap;

/// The window episodes are found in by default, seconds (aligned on the
/// first arrival, as the inventory's peak window is).
pub const EPISODE_WINDOW_S: f64 = 60.0;

/// Refused for capacity (not a tenant's own limit, a policy rule or a bad
/// request): what saturation looks like at the door.
const CAPACITY_REASONS: [Reason; 6] = [
    Reason::Overload,
    Reason::Saturation,
    Reason::Fairness,
    Reason::Priority,
    Reason::Timeout,
    Reason::Deadline,
];

/// A window's share of requests refused for capacity that makes it
/// saturated, and the queue wait of its non-batch requests (p95) that
/// does too.
const REFUSED_SHARE: f64 = 0.05;
const QUEUE_P95_MS: u64 = 1_000;

/// How an episode is found, stated in every report.
pub fn episode_rule(window_s: f64) -> String {
    format!("consecutive {window_s} s windows (aligned on the first arrival) in which at least 5% of requests (and at least 2) were refused for capacity (overload, saturation, fairness, priority, timeout, deadline), or the 95th-percentile queue wait of requests other than batch items was 1 s or more (over at least 5 of them)")
}

/// How one tier, tenant or the fleet was served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Service {
    pub name: String,
    pub requests: u64,
    /// Answered with a 2xx status.
    pub served: u64,
    /// Requests by the HTTP status they got (`none` where none went out:
    /// the client left first).
    pub statuses: BTreeMap<String, u64>,
    /// Requests refused or failed, by the recorded reason.
    pub reasons: BTreeMap<String, u64>,
    /// Milliseconds, nearest-rank, over the requests that recorded one.
    pub queue_ms: Option<Percentiles>,
    pub ttft_ms: Option<Percentiles>,
    pub e2e_ms: Option<Percentiles>,
}

/// A tenant present during an episode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Present {
    pub tenant: String,
    pub requests: u64,
    pub refused_for_capacity: u64,
}

/// A run of saturated windows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Episode {
    /// Seconds from the first arrival.
    pub start_s: f64,
    pub duration_s: f64,
    /// RFC 3339 wall-clock time of its start (on the report's clock).
    pub start: String,
    pub requests: u64,
    pub refused_for_capacity: u64,
    /// The largest p95 queue wait of its windows' non-batch requests, ms.
    pub queue_p95_ms: u64,
    /// Tenants with requests in it, most requests first.
    pub tenants: Vec<Present>,
}

/// What the decision log says of the service.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recorded {
    /// Records that say how they ended (a status or a latency).
    pub requests: u64,
    pub fleet: Service,
    pub tiers: Vec<Service>,
    pub tenants: Vec<Service>,
    pub episodes: Vec<Episode>,
    pub episode_rule: String,
    pub episode_window_s: f64,
}

/// Whether a record says how it ended.
fn ended(r: &Record) -> bool {
    r.decision.as_ref().is_some_and(|d| d.status.is_some())
        || r.ttft_ms.is_some()
        || r.e2e_ms.is_some()
}

fn status(r: &Record) -> Option<u16> {
    r.decision.as_ref().and_then(|d| d.status)
}

fn reason(r: &Record) -> Option<&str> {
    r.decision.as_ref().and_then(|d| d.reason.as_deref())
}

fn refused_for_capacity(r: &Record) -> bool {
    !status(r).is_some_and(|s| (200..300).contains(&s))
        && reason(r).is_some_and(|x| CAPACITY_REASONS.iter().any(|c| c.name() == x))
}

fn ms(x: Option<f64>) -> Option<u64> {
    x.filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v.round().min(u64::MAX as f64) as u64)
}

fn percentiles(v: Vec<u64>) -> Option<Percentiles> {
    (!v.is_empty()).then(|| Percentiles::of(v))
}

fn service(name: String, recs: &[&Record]) -> Service {
    let mut statuses = BTreeMap::new();
    let mut reasons = BTreeMap::new();
    let mut served = 0;
    for r in recs {
        let s = status(r);
        *statuses
            .entry(s.map_or_else(|| "none".to_string(), |s| s.to_string()))
            .or_insert(0u64) += 1;
        if s.is_some_and(|s| (200..300).contains(&s)) {
            served += 1;
        } else if let Some(x) = reason(r) {
            *reasons.entry(x.to_string()).or_insert(0u64) += 1;
        }
    }
    Service {
        name,
        requests: recs.len() as u64,
        served,
        statuses,
        reasons,
        queue_ms: percentiles(recs.iter().filter_map(|r| ms(r.queue_ms)).collect()),
        ttft_ms: percentiles(recs.iter().filter_map(|r| ms(r.ttft_ms)).collect()),
        e2e_ms: percentiles(recs.iter().filter_map(|r| ms(r.e2e_ms)).collect()),
    }
}

fn grouped(recs: &[&Record], key: impl Fn(&Record) -> String) -> Vec<Service> {
    let mut by: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for r in recs {
        by.entry(key(r)).or_default().push(r);
    }
    by.into_iter().map(|(k, v)| service(k, &v)).collect()
}

/// Whom a record's request was for: its decided tenant, else the tenant
/// or key it came with.
pub(super) fn tenant_of(r: &Record) -> String {
    r.decision
        .as_ref()
        .and_then(|d| d.tenant.clone())
        .or_else(|| r.tenant.clone())
        .or_else(|| r.api_key.clone())
        .unwrap_or_else(|| "-".into())
}

/// One window's figures.
#[derive(Default)]
struct Window<'a> {
    recs: Vec<&'a Record>,
    refused: u64,
    queue: Vec<u64>,
}

impl Window<'_> {
    fn queue_p95(&self) -> Option<u64> {
        (self.queue.len() >= 5).then(|| Percentiles::of(self.queue.clone()).p95)
    }

    fn saturated(&self) -> bool {
        let n = self.recs.len() as f64;
        (self.refused >= 2 && self.refused as f64 >= REFUSED_SHARE * n)
            || self.queue_p95().is_some_and(|q| q >= QUEUE_P95_MS)
    }
}

/// The recorded service of `records` (sorted by arrival), or `None` when
/// none says how it ended. `clock` turns at_ms into RFC 3339 time.
pub fn recorded(
    records: &[Record],
    window_s: f64,
    clock: impl Fn(f64) -> String,
) -> Option<Recorded> {
    let recs: Vec<&Record> = records.iter().filter(|r| ended(r)).collect();
    if recs.is_empty() {
        return None;
    }
    let t0 = recs.iter().map(|r| r.at_ms).fold(f64::INFINITY, f64::min);
    let t1 = recs
        .iter()
        .map(|r| r.at_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let window_ms = window_s.max(0.001) * 1000.0;
    // Bounded by the records: at most one window per record is non-empty,
    // and empty ones are never saturated, so only those are kept.
    let mut windows: BTreeMap<u64, Window<'_>> = BTreeMap::new();
    for r in &recs {
        let i = ((r.at_ms - t0) / window_ms).floor().max(0.0) as u64;
        let w = windows.entry(i).or_default();
        w.recs.push(r);
        w.refused += u64::from(refused_for_capacity(r));
        if !r.headers.contains_key(BATCH_HEADER) {
            w.queue.extend(ms(r.queue_ms));
        }
    }
    let mut episodes: Vec<Episode> = Vec::new();
    let mut last: Option<u64> = None;
    for (&i, w) in windows.iter().filter(|(_, w)| w.saturated()) {
        let joined = last.is_some_and(|l| l + 1 == i) && !episodes.is_empty();
        last = Some(i);
        if !joined {
            let start_ms = t0 + i as f64 * window_ms;
            episodes.push(Episode {
                start_s: round3((start_ms - t0) / 1000.0),
                duration_s: 0.0,
                start: clock(start_ms),
                requests: 0,
                refused_for_capacity: 0,
                queue_p95_ms: 0,
                tenants: Vec::new(),
            });
        }
        let Some(e) = episodes.last_mut() else {
            continue;
        };
        // Its windows run to the last arrival at most (every window here
        // holds a record, so that is not before the window's start).
        let end_ms = (t0 + (i + 1) as f64 * window_ms).min(t1);
        e.duration_s = round3(((end_ms - t0) / 1000.0 - e.start_s).max(0.0));
        e.requests += w.recs.len() as u64;
        e.refused_for_capacity += w.refused;
        e.queue_p95_ms = e.queue_p95_ms.max(w.queue_p95().unwrap_or(0));
        for r in &w.recs {
            let t = tenant_of(r);
            let refused = u64::from(refused_for_capacity(r));
            match e.tenants.iter_mut().find(|p| p.tenant == t) {
                Some(p) => {
                    p.requests += 1;
                    p.refused_for_capacity += refused;
                }
                None => e.tenants.push(Present {
                    tenant: t,
                    requests: 1,
                    refused_for_capacity: refused,
                }),
            }
        }
    }
    for e in &mut episodes {
        e.tenants.sort_by(|a, b| {
            b.requests
                .cmp(&a.requests)
                .then_with(|| a.tenant.cmp(&b.tenant))
        });
    }
    Some(Recorded {
        requests: recs.len() as u64,
        fleet: service("(fleet)".into(), &recs),
        tiers: grouped(&recs, |r| {
            r.decision
                .as_ref()
                .and_then(|d| d.tier.clone())
                .unwrap_or_else(|| "(none)".into())
        }),
        tenants: grouped(&recs, tenant_of),
        episodes,
        episode_rule: episode_rule(window_s),
        episode_window_s: window_s,
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// A table of the section, format-neutral: `kiln report` renders it as
/// markdown or HTML.
pub struct Table {
    pub title: String,
    pub head: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
}

fn p3(p: &Option<Percentiles>) -> String {
    p.as_ref()
        .map_or("-".into(), |p| format!("{}/{}/{}", p.p50, p.p95, p.p99))
}

/// `a 3, b 1`: counts, largest first (`-` for none).
pub(super) fn mix(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    let mut v: Vec<(&String, &u64)> = m.iter().collect();
    v.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    v.iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn service_rows(rows: &[Service], fleet: Option<&Service>) -> Vec<Vec<String>> {
    rows.iter()
        .chain(fleet)
        .map(|s| {
            vec![
                s.name.clone(),
                s.requests.to_string(),
                format!(
                    "{:.1}%",
                    100.0 * s.served as f64 / (s.requests.max(1)) as f64
                ),
                mix(&s.statuses),
                mix(&s.reasons),
                p3(&s.queue_ms),
                p3(&s.ttft_ms),
                p3(&s.e2e_ms),
            ]
        })
        .collect()
}

/// The section's tables: per tier, per tenant (with the fleet), and the
/// saturation episodes.
pub fn tables(rec: &Recorded) -> Vec<Table> {
    const HEAD: [&str; 8] = [
        "",
        "requests",
        "served (2xx)",
        "statuses",
        "refused or failed, by reason",
        "queue ms p50/p95/p99",
        "TTFT ms p50/p95/p99",
        "e2e ms p50/p95/p99",
    ];
    let head = |first: &'static str| {
        let mut h = HEAD.to_vec();
        h[0] = first;
        h
    };
    vec![
        Table {
            title: "Recorded service per tier (from the decision log)".into(),
            head: head("tier"),
            rows: service_rows(&rec.tiers, None),
        },
        Table {
            title: "Recorded service per tenant (from the decision log)".into(),
            head: head("tenant"),
            rows: service_rows(&rec.tenants, Some(&rec.fleet)),
        },
        Table {
            title: format!("Saturation episodes ({})", rec.episodes.len()),
            head: vec![
                "start",
                "from first arrival",
                "lasted",
                "requests",
                "refused for capacity",
                "queue p95 ms",
                "tenants present (requests, refused)",
            ],
            rows: rec
                .episodes
                .iter()
                .map(|e| {
                    vec![
                        e.start.clone(),
                        format!("{:.0} s", e.start_s),
                        format!("{:.0} s", e.duration_s),
                        e.requests.to_string(),
                        e.refused_for_capacity.to_string(),
                        e.queue_p95_ms.to_string(),
                        e.tenants
                            .iter()
                            .map(|p| {
                                format!("{} ({}, {})", p.tenant, p.requests, p.refused_for_capacity)
                            })
                            .collect::<Vec<_>>()
                            .join("; "),
                    ]
                })
                .collect(),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::Decision;

    fn rec(at_s: f64, tenant: &str, status: u16, reason: Option<&str>, queue_ms: f64) -> Record {
        Record {
            at_ms: at_s * 1000.0,
            tenant: Some(tenant.into()),
            model: "m".into(),
            decision: Some(Decision {
                tier: Some("chat".into()),
                tenant: Some(tenant.into()),
                status: Some(status),
                reason: reason.map(str::to_string),
                ..Decision::default()
            }),
            queue_ms: Some(queue_ms),
            ttft_ms: (status == 200).then_some(queue_ms + 100.0),
            e2e_ms: (status == 200).then_some(queue_ms + 900.0),
            ..Record::default()
        }
    }

    fn clock(at_ms: f64) -> String {
        format!("t+{}", at_ms / 1000.0)
    }

    /// Calm for two minutes, a flood from 120 s to 240 s (a quarter of the
    /// requests refused `overload`), calm again.
    fn log() -> Vec<Record> {
        let mut v = Vec::new();
        for s in 0..360 {
            let at = f64::from(s);
            v.push(rec(at, "polite", 200, None, 20.0));
            if (120..240).contains(&s) {
                for k in 0..4 {
                    let refused = k == 0;
                    v.push(rec(
                        at + 0.1 * f64::from(k),
                        "flood",
                        if refused { 429 } else { 200 },
                        refused.then_some("overload"),
                        if refused { 0.0 } else { 300.0 },
                    ));
                }
            }
        }
        v
    }

    #[test]
    fn a_flood_is_one_episode_with_its_tenants() {
        let r = recorded(&log(), 60.0, clock).unwrap();
        assert_eq!(r.episodes.len(), 1, "{:?}", r.episodes);
        let e = &r.episodes[0];
        assert_eq!((e.start_s, e.duration_s), (120.0, 120.0));
        assert_eq!(e.start, "t+120");
        assert_eq!(e.refused_for_capacity, 120);
        assert_eq!(e.tenants[0].tenant, "flood");
        assert_eq!(e.tenants[0].requests, 480);
        assert_eq!(e.tenants[1].tenant, "polite");
        assert_eq!(e.tenants[1].refused_for_capacity, 0);
        let flood = r.tenants.iter().find(|t| t.name == "flood").unwrap();
        assert_eq!(flood.served, 360);
        assert_eq!(flood.reasons.get("overload"), Some(&120));
        assert_eq!(flood.statuses.get("429"), Some(&120));
        assert_eq!(r.fleet.requests, 360 + 480);
        let ttft = r.tenants[1].ttft_ms.as_ref().unwrap();
        assert_eq!((ttft.p50, ttft.p99), (120, 120));
    }

    #[test]
    fn long_queues_are_saturation_but_not_a_batchs_own() {
        let mut v: Vec<Record> = (0..120)
            .map(|s| rec(f64::from(s), "a", 200, None, 10.0))
            .collect();
        // Batch items waiting minutes are their tier's design, not
        // saturation.
        for s in 0..60 {
            let mut b = rec(f64::from(s), "bulk", 200, None, 120_000.0);
            b.headers.insert(BATCH_HEADER.into(), "batch_1".into());
            v.push(b);
        }
        assert!(recorded(&v, 60.0, clock).unwrap().episodes.is_empty());
        // Interactive requests waiting 1.5 s in the second minute are.
        for s in 60..120 {
            v.push(rec(f64::from(s) + 0.5, "a", 200, None, 1_500.0));
        }
        v.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
        let e = recorded(&v, 60.0, clock).unwrap().episodes;
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].start_s, 60.0);
        assert_eq!(e[0].queue_p95_ms, 1_500);
    }

    #[test]
    fn a_quota_refusal_is_not_saturation_and_traces_have_no_section() {
        let v: Vec<Record> = (0..120)
            .map(|s| rec(f64::from(s), "a", 429, Some("quota"), 0.0))
            .collect();
        let r = recorded(&v, 60.0, clock).unwrap();
        assert!(r.episodes.is_empty());
        assert_eq!(r.tiers[0].reasons.get("quota"), Some(&120));
        assert_eq!(r.tiers[0].ttft_ms, None);
        let trace: Vec<Record> = (0..10)
            .map(|s| Record {
                at_ms: f64::from(s),
                model: "m".into(),
                ..Record::default()
            })
            .collect();
        assert!(recorded(&trace, 60.0, clock).is_none());
    }
}
