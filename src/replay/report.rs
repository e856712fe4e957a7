//! What a simulation shows: per tier and per tenant, latency percentiles,
//! SLO attainment, goodput, rejects by reason, preemptions and fallbacks,
//! plus fleet utilization. Rendered for terminals, as markdown, or as JSON
//! (schema: the serde form of [`Report`], documented in README).

use super::Outcome;
use crate::graph::DecisionGraph;
use crate::sched::{Micros, MS, SEC};
use crate::table::{self, Left, Right};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Group {
    pub name: String,
    pub requests: u64,
    pub finished: u64,
    pub rejected: u64,
    pub rejects_by_reason: BTreeMap<String, u64>,
    /// Requests that did not start on arrival, by why they waited.
    pub waits_by_reason: BTreeMap<String, u64>,
    /// Milliseconds, over finished requests.
    pub ttft_ms: Option<Percentiles>,
    pub e2e_ms: Option<Percentiles>,
    /// Share of all requests (rejected ones count as misses) that met the
    /// tier's SLO, 0–1.
    pub slo_attainment: f64,
    /// Share of the admitted requests (those not refused) that met it, 0–1
    /// (1 when every request was refused).
    pub slo_attainment_admitted: f64,
    /// Share of all requests (refused = miss) whose first token came within
    /// the tier's TTFT SLO; absent for a group without one.
    pub ttft_attainment: Option<f64>,
    /// Share of all requests (refused = miss) with a completion window (a
    /// batch item's own, else their tier's) that finished inside it;
    /// absent for a group without any.
    pub window_attainment: Option<f64>,
    /// Requests that met their SLO, per second of the run.
    pub goodput_rps: f64,
    pub preemptions: u64,
    pub fallbacks: u64,
    /// Requests with a completion window (a batch item's own, else their
    /// tier's) that finished after it, or were refused because they could
    /// not make it.
    pub deadline_misses: u64,
    /// GPU time the group's requests used, and what it cost per GPU-hour:
    /// the tenant's `cost`, else the pool's `price` (0 where neither is
    /// declared).
    pub gpu_seconds: f64,
    pub cost: f64,
    /// The part of `gpu_seconds` that had a price (the cost gate's
    /// coverage); not in the report's JSON.
    #[serde(skip)]
    pub priced_gpu_seconds: f64,
    /// Requests answered from their tier's exact cache (no queue, no GPU
    /// time); absent for a tier without one and a group with none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_hits: Option<u64>,
    /// The part of `gpu_seconds` spent recomputing KV that preemptions
    /// threw away (useful GPU time is the rest); absent when none was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wasted_gpu_seconds: Option<f64>,
    /// What the requests that met their SLO are worth, at their model's
    /// `value` per answered request (a late or refused answer earns
    /// nothing); absent when no model of the group declares a value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The scheduler (and, when not kiln's, the routing: `fifo/random`).
    pub scheduler: String,
    /// How requests were sent to replicas (`kiln`, `round-robin`, …).
    pub routing: String,
    pub requests: u64,
    /// From the first arrival to the last completion, seconds.
    pub duration_s: f64,
    pub gpus: u32,
    /// The share of the fleet's capacity the run used, 0–1: each step's
    /// work priced at the replica's saturated (roofline) throughput, over
    /// available GPU-seconds. A true load figure: a replica stepping a
    /// small batch all the time is lightly loaded, not busy.
    pub busy: f64,
    /// GPU-seconds during which any step ran, over available GPU-seconds
    /// (what `busy` used to be: near 1 for any steady trickle); JSON only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stepping: Option<f64>,
    /// Prompt tokens prefilled per second over the run (on replicas that
    /// run their steps here; external upstreams are not counted).
    pub prefill_tok_s: f64,
    /// Output tokens produced per second over the run.
    pub decode_tok_s: f64,
    /// The pool's roofline capacity: summed over replicas, a full
    /// `max_batch_tokens` prefill chunk per step, and a full batch (as many
    /// sequences as `max_batch` and KV memory allow at the run's mean
    /// context) decoding, from each replica's cost model.
    pub prefill_capacity_tok_s: f64,
    pub decode_capacity_tok_s: f64,
    /// Achieved over capacity, 0–1 (and above, were a cost model to run
    /// faster than its own roofline).
    pub prefill_load: f64,
    pub decode_load: f64,
    /// Largest gap in weighted service (tokens/weight) seen between tenants
    /// of one tier that both had work waiting: the VTC fairness measure
    /// (smaller is fairer).
    pub max_service_gap: f64,
    pub tiers: Vec<Group>,
    pub tenants: Vec<Group>,
    /// Per `model.variant`, over the requests that started on one of its
    /// replicas (a refused request ran on none); JSON only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<Group>,
    /// Per batch (the `x-kiln-batch` header of its items), by batch id;
    /// absent when the traffic has no batch items.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub batches: Vec<BatchGroup>,
}

/// What became of one batch's items in a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchGroup {
    /// The batch id (its items' `x-kiln-batch` header).
    pub id: String,
    pub items: u64,
    /// Items that finished (late or not).
    pub completed: u64,
    pub rejected: u64,
    /// Items that finished after their deadline, or were refused because
    /// they could not make it.
    pub deadline_misses: u64,
    /// When its last item finished, seconds from the start of the trace;
    /// absent when none finished.
    pub finished_s: Option<f64>,
    /// When its window ends (the latest of its items' deadlines), seconds
    /// from the start of the trace; absent when no item had one.
    pub deadline_s: Option<f64>,
    /// GPU time its items used, and what it cost at each item's tenant's
    /// `cost` per GPU-hour.
    pub gpu_seconds: f64,
    pub cost: f64,
}

fn pct(mut v: Vec<f64>) -> Option<Percentiles> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        (v[i] * 1000.0).round() / 1000.0
    };
    Some(Percentiles {
        p50: at(0.50),
        p90: at(0.90),
        p95: at(0.95),
        p99: at(0.99),
    })
}

/// Did this request meet its tier's SLO?
pub fn met_slo(g: &DecisionGraph, o: &Outcome) -> bool {
    let (Some(fin), None) = (o.finished, o.rejected) else {
        return false;
    };
    let Some(t) = o.tier.and_then(|t| g.tiers.get(t as usize)) else {
        return true;
    };
    let ms = |x: Micros| x as f64 / MS as f64;
    let e2e = ms(fin - o.arrival);
    let ttft = o.first_token.map_or(e2e, |f| ms(f - o.arrival));
    t.slo.ttft.is_none_or(|s| ttft <= s)
        && t.slo.e2e_p95.is_none_or(|s| e2e <= s)
        && o.deadline.is_none_or(|d| fin <= d)
}

/// Finished after its deadline, or refused because it could not make it.
fn missed_deadline(o: &Outcome) -> bool {
    let Some(d) = o.deadline else { return false };
    let late = o.finished.is_some_and(|f| f > d);
    let refused = matches!(o.rejected, Some((crate::sched::Reason::Deadline, _)));
    late || refused
}

fn group<'a>(
    g: &DecisionGraph,
    name: String,
    items: impl Iterator<Item = &'a Outcome>,
    duration_s: f64,
) -> Group {
    let mut gr = Group {
        name,
        requests: 0,
        finished: 0,
        rejected: 0,
        rejects_by_reason: BTreeMap::new(),
        waits_by_reason: BTreeMap::new(),
        ttft_ms: None,
        e2e_ms: None,
        slo_attainment: 0.0,
        slo_attainment_admitted: 0.0,
        ttft_attainment: None,
        window_attainment: None,
        goodput_rps: 0.0,
        preemptions: 0,
        fallbacks: 0,
        deadline_misses: 0,
        gpu_seconds: 0.0,
        cost: 0.0,
        priced_gpu_seconds: 0.0,
        cache_hits: None,
        wasted_gpu_seconds: None,
        value: None,
    };
    let mut hits = 0u64;
    let mut wasted = 0.0;
    let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
    let mut met = 0u64;
    // (with the SLO, met it) for TTFT and for the completion window
    let (mut ttft_slo, mut window_slo) = ((0u64, 0u64), (0u64, 0u64));
    for o in items {
        hits += u64::from(o.cache_hit);
        gr.requests += 1;
        let slo = o.tier.and_then(|t| g.tiers.get(t as usize)).map(|t| &t.slo);
        let served = o.rejected.is_none();
        if let Some(limit) = slo.and_then(|s| s.ttft) {
            ttft_slo.0 += 1;
            let ok = o
                .first_token
                .is_some_and(|f| (f - o.arrival) as f64 / MS as f64 <= limit);
            ttft_slo.1 += u64::from(served && ok);
        }
        if let Some(d) = o.deadline {
            window_slo.0 += 1;
            let ok = o.finished.is_some_and(|f| f <= d);
            window_slo.1 += u64::from(served && ok);
        }
        gr.preemptions += u64::from(o.preemptions);
        if o.fallback_step.is_some() {
            gr.fallbacks += 1;
        }
        gr.deadline_misses += u64::from(missed_deadline(o));
        gr.gpu_seconds += o.gpu_seconds;
        wasted += o.wasted_gpu_seconds;
        if let Some(c) = cost_of(g, o) {
            gr.cost += c;
            gr.priced_gpu_seconds += o.gpu_seconds;
        }
        if let Some(r) = o.waited_for {
            *gr.waits_by_reason.entry(r.name().to_string()).or_default() += 1;
        }
        if let Some((r, _)) = o.rejected {
            gr.rejected += 1;
            *gr.rejects_by_reason
                .entry(r.name().to_string())
                .or_default() += 1;
        }
        if let Some(f) = o.finished {
            gr.finished += 1;
            e2e.push((f - o.arrival) as f64 / MS as f64);
            if let Some(t) = o.first_token {
                ttft.push((t - o.arrival) as f64 / MS as f64);
            }
        }
        if met_slo(g, o) {
            met += 1;
        }
        if let Some(v) = value_of(g, o) {
            let earned = if met_slo(g, o) { v } else { 0.0 };
            *gr.value.get_or_insert(0.0) += earned;
        }
    }
    gr.value = gr.value.map(round);
    gr.gpu_seconds = round(gr.gpu_seconds);
    gr.cost = round(gr.cost);
    gr.cache_hits = (hits > 0).then_some(hits);
    gr.wasted_gpu_seconds = Some(round(wasted)).filter(|w| *w > 0.0);
    gr.ttft_ms = pct(ttft);
    gr.e2e_ms = pct(e2e);
    if gr.requests > 0 {
        gr.slo_attainment = round(met as f64 / gr.requests as f64);
    }
    let share = |(n, ok): (u64, u64)| (n > 0).then(|| round(ok as f64 / n as f64));
    gr.ttft_attainment = share(ttft_slo);
    gr.window_attainment = share(window_slo);
    let admitted = gr.requests - gr.rejected;
    gr.slo_attainment_admitted = if admitted > 0 {
        round(met as f64 / admitted as f64)
    } else {
        1.0
    };
    if duration_s > 0.0 {
        gr.goodput_rps = round(met as f64 / duration_s);
    }
    gr
}

fn round(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

/// Per batch id, in id order: items, completions, misses, and the last
/// finish against the batch's deadline.
/// What one request's GPU time cost: its tenant's `cost`, else its
/// pool's `price`, per GPU-hour; `None` when neither is declared.
/// The `value` of the model a request ran as (`None`: it ran nowhere, or
/// its model declares none).
fn value_of(g: &DecisionGraph, o: &Outcome) -> Option<f64> {
    let (m, _) = o.variant?;
    g.models.get(usize::from(m))?.value_per_request
}

fn cost_of(g: &DecisionGraph, o: &Outcome) -> Option<f64> {
    g.gpu_hour_price(o.tenant, o.pool)
        .map(|rate| o.gpu_seconds / 3600.0 * rate)
}

fn batches(g: &DecisionGraph, outcomes: &[Outcome]) -> Vec<BatchGroup> {
    let mut by_id: BTreeMap<&str, BatchGroup> = BTreeMap::new();
    let secs = |t: Micros| round(t as f64 / SEC as f64);
    for o in outcomes {
        let Some(id) = o.batch.as_deref() else {
            continue;
        };
        let b = by_id.entry(id).or_insert_with(|| BatchGroup {
            id: id.to_string(),
            items: 0,
            completed: 0,
            rejected: 0,
            deadline_misses: 0,
            finished_s: None,
            deadline_s: None,
            gpu_seconds: 0.0,
            cost: 0.0,
        });
        b.items += 1;
        b.gpu_seconds += o.gpu_seconds;
        b.cost += cost_of(g, o).unwrap_or(0.0);
        b.rejected += u64::from(o.rejected.is_some());
        b.deadline_misses += u64::from(missed_deadline(o));
        if let (Some(f), None) = (o.finished, o.rejected) {
            b.completed += 1;
            b.finished_s = Some(b.finished_s.map_or(secs(f), |x| x.max(secs(f))));
        }
        if let Some(d) = o.deadline {
            b.deadline_s = Some(b.deadline_s.map_or(secs(d), |x| x.max(secs(d))));
        }
    }
    by_id
        .into_values()
        .map(|mut b| {
            b.gpu_seconds = round(b.gpu_seconds);
            b.cost = round(b.cost);
            b
        })
        .collect()
}

/// A batch's last finish against its deadline, in words.
fn batch_timing(b: &BatchGroup) -> String {
    match (b.finished_s, b.deadline_s) {
        (Some(f), Some(d)) if f <= d => format!(
            "finished {f:.0} s, deadline {d:.0} s ({:.0} s early)",
            d - f
        ),
        (Some(f), Some(d)) => format!("finished {f:.0} s, deadline {d:.0} s ({:.0} s late)", f - d),
        (Some(f), None) => format!("finished {f:.0} s, no deadline"),
        (None, Some(d)) => format!("nothing finished, deadline {d:.0} s"),
        (None, None) => "nothing finished".to_string(),
    }
}

/// What the fleet did over a replay, for [`build`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Fleet {
    /// Summed over replicas (step time × the replica's GPUs).
    pub busy_gpu_seconds: f64,
    /// The same steps' work at the roofline's saturated throughput.
    pub work_gpu_seconds: f64,
    pub gpus: u32,
    /// The largest VTC service gap seen.
    pub service_gap: f64,
    pub prefilled_tokens: u64,
    pub decoded_tokens: u64,
    /// Roofline capacity, tokens per second (see [`Report`]).
    pub prefill_capacity_tok_s: f64,
    pub decode_capacity_tok_s: f64,
}

/// Builds the report for a scheduler (named `scheduler`) and routing.
pub fn build(
    g: &DecisionGraph,
    scheduler: &str,
    routing: &str,
    outcomes: &[Outcome],
    fleet: &Fleet,
) -> Report {
    let (busy_gpu_seconds, work_gpu_seconds, gpus, service_gap) = (
        fleet.busy_gpu_seconds,
        fleet.work_gpu_seconds,
        fleet.gpus,
        fleet.service_gap,
    );
    let start = outcomes.iter().map(|o| o.arrival).min().unwrap_or(0);
    let end = outcomes
        .iter()
        .filter_map(|o| o.finished.or(Some(o.arrival)))
        .max()
        .unwrap_or(start);
    let duration_s = (end - start) as f64 / SEC as f64;
    let tiers = g
        .tiers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut gr = group(
                g,
                t.name.clone(),
                outcomes.iter().filter(|o| o.tier == Some(i as u16)),
                duration_s,
            );
            if t.cache.exact.is_some() {
                gr.cache_hits = Some(gr.cache_hits.unwrap_or(0));
            }
            gr
        })
        .filter(|gr| gr.requests > 0)
        .collect();
    let mut tenants: Vec<Group> = g
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            group(
                g,
                t.name.clone(),
                outcomes.iter().filter(|o| o.tenant == Some(i as u32)),
                duration_s,
            )
        })
        .filter(|gr| gr.requests > 0)
        .collect();
    let anonymous = group(
        g,
        "(no tenant)".into(),
        outcomes.iter().filter(|o| o.tenant.is_none()),
        duration_s,
    );
    if anonymous.requests > 0 {
        tenants.push(anonymous);
    }
    let mut ran_as: BTreeMap<(u16, u16), Vec<&Outcome>> = BTreeMap::new();
    for o in outcomes {
        if let Some(v) = o.variant {
            ran_as.entry(v).or_default().push(o);
        }
    }
    let models: Vec<Group> = ran_as
        .into_iter()
        .map(|((m, v), os)| {
            let model = g.models.get(usize::from(m));
            let name = format!(
                "{}.{}",
                model.map_or("?", |m| m.name.as_str()),
                model
                    .and_then(|x| x.variants.get(usize::from(v)))
                    .map_or("?", |v| v.name.as_str())
            );
            group(g, name, os.into_iter(), duration_s)
        })
        .collect();
    let of_fleet = |gpu_s: f64| {
        if duration_s > 0.0 && gpus > 0 {
            gpu_s / (duration_s * f64::from(gpus))
        } else {
            0.0
        }
    };
    let (util, stepping) = (of_fleet(work_gpu_seconds), of_fleet(busy_gpu_seconds));
    let per_s = |tokens: u64| {
        if duration_s > 0.0 {
            tokens as f64 / duration_s
        } else {
            0.0
        }
    };
    let load = |achieved: f64, cap: f64| {
        if cap > 0.0 && cap.is_finite() {
            round(achieved / cap)
        } else {
            0.0
        }
    };
    let (prefill, decode) = (per_s(fleet.prefilled_tokens), per_s(fleet.decoded_tokens));
    let finite = |x: f64| if x.is_finite() { x } else { 0.0 };
    Report {
        scheduler: scheduler.to_string(),
        routing: routing.to_string(),
        requests: outcomes.len() as u64,
        duration_s: round(duration_s),
        gpus,
        busy: round(util.min(1.0)),
        stepping: Some(round(stepping.min(1.0))),
        prefill_tok_s: round(prefill),
        decode_tok_s: round(decode),
        prefill_capacity_tok_s: round(finite(fleet.prefill_capacity_tok_s)),
        decode_capacity_tok_s: round(finite(fleet.decode_capacity_tok_s)),
        prefill_load: load(prefill, fleet.prefill_capacity_tok_s),
        decode_load: load(decode, fleet.decode_capacity_tok_s),
        max_service_gap: round(service_gap),
        tiers,
        tenants,
        models,
        batches: batches(g, outcomes),
    }
}

fn fmt_pct(p: &Option<Percentiles>) -> String {
    match p {
        Some(p) => format!("{:.0} / {:.0} / {:.0}", p.p50, p.p95, p.p99),
        None => "-".into(),
    }
}

fn rejects(gr: &Group) -> String {
    by_reason(&gr.rejects_by_reason)
}

fn by_reason(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    m.iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Markdown tables, one row per tier and per tenant for each report.
pub fn markdown(reports: &[Report]) -> String {
    let mut s = String::new();
    for r in reports {
        let _ = writeln!(
            s,
            "### scheduler `{}`: {} requests over {:.0} s on {} GPUs, busy {:.1}%, prefill load {:.1}% ({:.0} of {:.0} tok/s), decode load {:.1}% ({:.0} of {:.0} tok/s), max service gap {:.0}\n",
            r.scheduler,
            r.requests,
            r.duration_s,
            r.gpus,
            r.busy * 100.0,
            r.prefill_load * 100.0,
            r.prefill_tok_s,
            r.prefill_capacity_tok_s,
            r.decode_load * 100.0,
            r.decode_tok_s,
            r.decode_capacity_tok_s,
            r.max_service_gap
        );
        for (title, groups) in [("tier", &r.tiers), ("tenant", &r.tenants)] {
            let _ = writeln!(
                s,
                "| {title} | requests | TTFT ms p50/p95/p99 | E2E ms p50/p95/p99 | SLO met | SLO met (admitted) | goodput/s | rejects | waited (why) | preemptions | fallbacks | deadline misses |"
            );
            let _ = writeln!(
                s,
                "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"
            );
            for gr in groups.iter() {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {:.1}% | {:.1}% | {:.2} | {} | {} | {} | {} | {} |",
                    gr.name,
                    gr.requests,
                    fmt_pct(&gr.ttft_ms),
                    fmt_pct(&gr.e2e_ms),
                    gr.slo_attainment * 100.0,
                    gr.slo_attainment_admitted * 100.0,
                    gr.goodput_rps,
                    rejects(gr),
                    by_reason(&gr.waits_by_reason),
                    gr.preemptions,
                    gr.fallbacks,
                    gr.deadline_misses
                );
            }
            s.push('\n');
        }
        let cached: Vec<&Group> = r.tiers.iter().filter(|t| t.cache_hits.is_some()).collect();
        if !cached.is_empty() {
            let _ = writeln!(s, "| tier | cache hits | of requests |");
            let _ = writeln!(s, "|---|---:|---:|");
            for t in cached {
                let hits = t.cache_hits.unwrap_or(0);
                let share = if t.requests > 0 {
                    hits as f64 / t.requests as f64 * 100.0
                } else {
                    0.0
                };
                let _ = writeln!(s, "| {} | {} | {:.1}% |", t.name, hits, share);
            }
            s.push('\n');
        }
        if !r.batches.is_empty() {
            let _ = writeln!(
                s,
                "| batch | items | completed | rejected | deadline misses | finished s | deadline s |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
            let opt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0}"));
            for b in &r.batches {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    b.id,
                    b.items,
                    b.completed,
                    b.rejected,
                    b.deadline_misses,
                    opt(b.finished_s),
                    opt(b.deadline_s)
                );
            }
            s.push('\n');
        }
    }
    s
}

/// Plain text for terminals.
pub fn human(reports: &[Report]) -> String {
    let mut s = String::new();
    for r in reports {
        let _ = writeln!(
            s,
            "scheduler {}: {} requests, {:.0} s, {} GPUs, busy {:.1}%, max service gap {:.0}",
            r.scheduler,
            r.requests,
            r.duration_s,
            r.gpus,
            r.busy * 100.0,
            r.max_service_gap
        );
        let _ = writeln!(
            s,
            "  load vs roofline: prefill {:.1}% ({:.0} of {:.0} tok/s), decode {:.1}% ({:.0} of {:.0} tok/s)",
            r.prefill_load * 100.0,
            r.prefill_tok_s,
            r.prefill_capacity_tok_s,
            r.decode_load * 100.0,
            r.decode_tok_s,
            r.decode_capacity_tok_s
        );
        // Tiers, then tenants under a header of their own: one table, so
        // the two line up.
        fn head(title: &str) -> [&str; 8] {
            [
                title,
                "requests",
                "TTFT ms p50/p95/p99",
                "E2E ms p50/p95/p99",
                "SLO met",
                "admitted",
                "goodput/s",
                "rejects",
            ]
        }
        let aligns = [Left, Right, Right, Right, Right, Right, Right, Left];
        let mut t = table::new(&head("tier").into_iter().zip(aligns).collect::<Vec<_>>());
        for (title, groups) in [("tier", &r.tiers), ("tenant", &r.tenants)] {
            if title == "tenant" {
                t.add_row(head(title).to_vec());
            }
            for gr in groups.iter() {
                t.add_row(vec![
                    gr.name.clone(),
                    gr.requests.to_string(),
                    fmt_pct(&gr.ttft_ms),
                    fmt_pct(&gr.e2e_ms),
                    format!("{:.1}%", gr.slo_attainment * 100.0),
                    format!("{:.1}%", gr.slo_attainment_admitted * 100.0),
                    format!("{:.2}", gr.goodput_rps),
                    rejects(gr),
                ]);
            }
        }
        s.push_str(&table::render(&t, "  "));
        reclaimed(&mut s, &r.tiers);
        for m in r.models.iter().filter(|m| m.value.is_some()) {
            let value = m.value.unwrap_or(0.0);
            let per_cost = if m.cost > 0.0 {
                format!(" ({:.2}x)", value / m.cost)
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "  value, model {}: {:.2} earned by answers within their SLO, against a cost of {:.2}{}",
                m.name, value, m.cost, per_cost
            );
        }
        for t in r.tiers.iter().filter(|t| t.cache_hits.is_some()) {
            let hits = t.cache_hits.unwrap_or(0);
            let share = if t.requests > 0 {
                hits as f64 / t.requests as f64 * 100.0
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                "  cache hits, tier {}: {} of {} requests ({:.1}%)",
                t.name, hits, t.requests, share
            );
        }
        if !r.batches.is_empty() {
            let mut t = table::new(&[
                ("batch", Left),
                ("items", Right),
                ("completed", Right),
                ("rejected", Right),
                ("deadline misses", Right),
                ("finish vs deadline", Left),
            ]);
            for b in &r.batches {
                t.add_row(vec![
                    b.id.clone(),
                    b.items.to_string(),
                    b.completed.to_string(),
                    b.rejected.to_string(),
                    b.deadline_misses.to_string(),
                    batch_timing(b),
                ]);
            }
            s.push_str(&table::render(&t, "  "));
        }
        s.push('\n');
    }
    s
}

/// Where another tier's reserved share was reclaimed: the requests of each
/// tier that waited for it, or were preempted by it, before they started.
fn reclaimed(s: &mut String, tiers: &[Group]) {
    for gr in tiers {
        let n = gr
            .waits_by_reason
            .get(crate::sched::Reason::Reservation.name())
            .copied()
            .unwrap_or(0);
        if n > 0 {
            let _ = writeln!(
                s,
                "  reservation reclaimed: {n} request(s) of tier {} waited or were preempted for another tier's reserved share",
                gr.name
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRICED: &str = r#"
pool h100 { gpus 2 kind "H100-80GB" memory 80GB price 3.2/h }
pool l40s { gpus 2 kind "L40S-48GB" memory 48GB price 1.1/h }
pool free { gpus 1 kind "L4-24GB" memory 24GB }
model m { variant fp16 { memory 10GB pools [h100, l40s, free] } }
tier t { priority 1 slo { window 1h } }
tenant a { owner "o" tiers [t] }
tenant b { owner "o" tiers [t] cost 2/h }
classify { default => tier t }
route [t] m { default => fp16 }
"#;

    /// Value is earned by answers within their SLO, at their model's
    /// `value`; a group whose models declare none has no value at all.
    #[test]
    fn value_is_earned_by_answers_within_their_slo() {
        let text = PRICED
            .replace("model m {", "model m { value 0.25")
            .replace("tier t { priority 1 slo { window 1h } }", "tier t { priority 1 slo { ttft 1s } }")
            + "model n { variant fp16 { memory 10GB pools [h100] } }\nroute [t] n { default => fp16 }\n";
        let g = crate::compile::compile_str("t.kiln", &text).graph.unwrap();
        let (m, n) = (g.model_id("m").unwrap(), g.model_id("n").unwrap());
        let o = |model: u16, ttft_ms: u64, refused: bool| Outcome {
            tier: Some(0),
            variant: Some((model, 0)),
            arrival: 0,
            first_token: Some(ttft_ms * MS),
            finished: Some((ttft_ms + 100) * MS),
            rejected: refused.then_some((crate::sched::Reason::Overload, 429)),
            ..Outcome::default()
        };
        let on_time = o(m, 500, false);
        let late = o(m, 2000, false);
        let refused = o(m, 500, true);
        let other = o(n, 500, false);
        let all = [on_time.clone(), on_time, late, refused, other.clone()];
        let gr = group(&g, "all".into(), all.iter(), 60.0);
        assert_eq!(gr.value, Some(0.5));
        let gr = group(&g, "n".into(), [other].iter(), 60.0);
        assert_eq!(gr.value, None);
    }

    /// Cost is each request's GPU time at its tenant's `cost`, else its
    /// pool's `price`; time with neither counts as unpriced.
    #[test]
    fn cost_reads_the_pools_price_unless_the_tenant_sets_its_own() {
        let g = crate::compile::compile_str("t.kiln", PRICED).graph.unwrap();
        let (h100, l40s, free) = (
            g.pool_id("h100").unwrap(),
            g.pool_id("l40s").unwrap(),
            g.pool_id("free").unwrap(),
        );
        let (a, b) = (g.tenant_id("a").unwrap(), g.tenant_id("b").unwrap());
        for n in 1..30u32 {
            let secs = 360.0 * f64::from(n);
            let o = |tenant, pool| Outcome {
                tenant: Some(tenant),
                pool: Some(pool),
                gpu_seconds: secs,
                ..Outcome::default()
            };
            let outcomes = [o(a, h100), o(a, l40s), o(b, h100), o(a, free)];
            let gr = group(&g, "all".into(), outcomes.iter(), 60.0);
            // a: 3.2 + 1.1 per hour on the priced pools; b: its own 2/h.
            let want = round(secs / 3600.0 * (3.2 + 1.1 + 2.0));
            assert!((gr.cost - want).abs() < 1e-6, "{n}: {} vs {want}", gr.cost);
            assert!((gr.priced_gpu_seconds - 3.0 * secs).abs() < 1e-6);
            assert!((gr.gpu_seconds - 4.0 * secs).abs() < 1e-6);
        }
        let near = |x: Option<f64>, y: f64| x.is_some_and(|x| (x - y).abs() < 1e-9);
        assert_eq!(g.gpu_hour_price(Some(a), Some(free)), None);
        assert!(near(g.gpu_hour_price(Some(b), Some(free)), 2.0));
        assert!(near(g.gpu_hour_price(Some(b), Some(h100)), 2.0));
        assert!(near(g.gpu_hour_price(None, Some(l40s)), 1.1));
    }
}
