//! `kiln report`: the workload inventory and baseline demand of recorded
//! traffic, per tenant, per model and (with a policy, from a replay) per
//! tier, plus the fleet. Rendered as markdown, JSON (the serde form of
//! [`Inventory`]) or a self-contained HTML page with inline SVG charts.
//!
//! Everything here is a pure function of the records (and the replay's
//! outcomes), so the same traffic gives the same bytes.

use crate::chart;
use crate::graph::DecisionGraph;
use crate::replay::{self, report as sim};
use crate::traffic::stats::Percentiles;
use crate::traffic::Record;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// 1970-01-05T00:00:00Z, a Monday: where at_ms 0 is placed when the
/// traffic's wall-clock start is not given (traces count from 0).
pub const ASSUMED_START_MS: i64 = 4 * 86_400_000;

/// The peak-to-mean window, seconds.
pub const PEAK_WINDOW_S: f64 = 60.0;

/// How a retry is recognised, stated in every report.
pub const RETRY_RULE: &str = "a record whose headers carry `x-kiln-retry` (any value but `0`/`false`) or a non-zero `x-stainless-retry-count` (the OpenAI SDKs' retry counter); traces without such headers (the Azure, Mooncake and ServeGen imports) report 0";

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ReportError {
    #[error("--start {value:?} is not an RFC 3339 time: {why}")]
    #[diagnostic(
        code(kiln::report::start),
        help(
            "give a UTC or offset time such as 2023-11-16T18:15:46Z or 2023-11-16T10:15:46-08:00"
        )
    )]
    BadStart { value: String, why: String },
}

/// How to build an inventory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Unix milliseconds of at_ms 0; `None`: [`ASSUMED_START_MS`].
    pub start_ms: Option<i64>,
    /// `start_ms` is a decision log's first arrival, not `--start`.
    pub start_from_log: bool,
    /// The window saturation episodes are found in, seconds.
    pub episode_window_s: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            start_ms: None,
            start_from_log: false,
            episode_window_s: super::baseline::EPISODE_WINDOW_S,
        }
    }
}

/// One row: a tenant, a model, a tier or the fleet.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub name: String,
    pub requests: u64,
    /// Requests per second over the whole trace's span (rows add up).
    pub rate_rps: f64,
    pub prompt_tokens: Percentiles,
    pub output_tokens: Percentiles,
    pub prompt_tokens_total: u64,
    pub output_tokens_total: u64,
    /// Share of the fleet's prompt + output tokens, 0–1.
    pub token_share: f64,
    /// Requests arriving in each hour of day, UTC (0–23, summed over days).
    pub by_hour: Vec<u64>,
    /// Prompt + output tokens of those requests, per hour of day.
    pub tokens_by_hour: Vec<u64>,
    /// Requests per weekday, Monday first.
    pub by_weekday: Vec<u64>,
    /// Coefficient of variation of inter-arrival times (0 regular, about 1
    /// Poisson, above 1 bursty); absent under 3 requests or with no gaps.
    pub interarrival_cv: Option<f64>,
    /// Busiest window's request rate over the mean rate (≥ 1).
    pub peak_to_mean: Option<f64>,
    pub retries: u64,
}

/// How many requests of each tenant a tier received (replay decision).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Placement {
    pub tier: String,
    pub tenant: String,
    pub requests: u64,
}

/// SLO attainment of a tier or tenant in the replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attainment {
    pub name: String,
    pub requests: u64,
    pub rejected: u64,
    pub ttft_attainment: Option<f64>,
    pub window_attainment: Option<f64>,
    pub slo_attainment: f64,
}

/// What the replay under `--policy` adds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicySection {
    pub tiers: Vec<Row>,
    pub placement: Vec<Placement>,
    pub slo_tiers: Vec<Attainment>,
    pub slo_tenants: Vec<Attainment>,
}

/// One histogram bucket: token counts in `[lo, hi)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bucket {
    pub lo: u64,
    pub hi: u64,
    pub requests: u64,
}

/// The workload inventory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inventory {
    pub requests: u64,
    /// First to last arrival, seconds.
    pub span_s: f64,
    /// The wall-clock time of at_ms 0, RFC 3339.
    pub start: String,
    /// True when `start` is the assumed Monday 00:00 UTC, not given.
    pub start_assumed: bool,
    /// True when `start` is a decision log's first arrival.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub start_from_log: bool,
    pub peak_window_s: f64,
    pub retry_rule: &'static str,
    pub fleet: Row,
    pub tenants: Vec<Row>,
    pub models: Vec<Row>,
    /// Present with `--policy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicySection>,
    /// Log-2 buckets of the fleet's prompt and output tokens.
    pub prompt_histogram: Vec<Bucket>,
    pub output_histogram: Vec<Bucket>,
    /// What the gateway recorded of its service (a decision log's waits,
    /// latencies, statuses and saturation episodes); absent for traffic
    /// that records no outcomes, such as the public traces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded: Option<super::baseline::Recorded>,
}

fn tenant_of(r: &Record) -> String {
    r.tenant
        .clone()
        .or_else(|| r.api_key.clone())
        .unwrap_or_else(|| "-".into())
}

/// Coefficient of variation (population) of the gaps between sorted
/// arrival times; `None` under two gaps or when every gap is 0.
pub fn interarrival_cv(sorted_ms: &[f64]) -> Option<f64> {
    if sorted_ms.len() < 3 {
        return None;
    }
    let gaps: Vec<f64> = sorted_ms.windows(2).map(|w| w[1] - w[0]).collect();
    let n = gaps.len() as f64;
    let mean = gaps.iter().sum::<f64>() / n;
    if !(mean.is_finite() && mean > 0.0) {
        return None;
    }
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n;
    Some(round6(var.sqrt() / mean))
}

/// Busiest window's count over the mean count per window, the windows
/// being `window_ms` long and aligned on `t0`, `windows` of them (the
/// mean is over all of them, so the ratio is at least 1).
pub fn peak_to_mean(sorted_ms: &[f64], t0: f64, window_ms: f64, windows: usize) -> Option<f64> {
    if sorted_ms.is_empty() || windows == 0 || window_ms <= 0.0 {
        return None;
    }
    let mut counts = vec![0u64; windows];
    for &t in sorted_ms {
        let i = (((t - t0) / window_ms).floor().max(0.0) as usize).min(windows - 1);
        counts[i] += 1;
    }
    let peak = counts.iter().copied().max().unwrap_or(0) as f64;
    let mean = sorted_ms.len() as f64 / windows as f64;
    Some(round6(peak / mean))
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Hour of day (UTC) and weekday (0 = Monday) of an arrival.
pub fn hour_and_weekday(start_ms: i64, at_ms: f64) -> (usize, usize) {
    let t = start_ms.saturating_add(at_ms.floor() as i64);
    let day = t.div_euclid(86_400_000);
    let hour = t.rem_euclid(86_400_000) / 3_600_000;
    // 1970-01-01 was a Thursday (3 with Monday 0).
    (hour as usize, (day + 3).rem_euclid(7) as usize)
}

/// Is this record a client retry? See [`RETRY_RULE`]; the same rule as
/// admission's retry budget ([`crate::graph::Retry`]).
pub fn is_retry(r: &Record) -> bool {
    crate::graph::Retry::of(&r.headers) == Some(crate::graph::Retry::Client)
}

/// The frame every row is measured in: the fleet's first arrival, span
/// and peak windows.
struct Frame {
    start_ms: i64,
    t0: f64,
    span_s: f64,
    windows: usize,
    fleet_tokens: u64,
}

fn row(name: String, recs: &[&Record], f: &Frame) -> Row {
    let mut times: Vec<f64> = recs.iter().map(|r| r.at_ms).collect();
    times.sort_by(f64::total_cmp);
    let (mut by_hour, mut tokens_by_hour, mut by_weekday) = (vec![0; 24], vec![0; 24], vec![0; 7]);
    let (mut pt, mut ot, mut retries) = (0u64, 0u64, 0u64);
    for r in recs {
        let (h, d) = hour_and_weekday(f.start_ms, r.at_ms);
        by_hour[h] += 1;
        let tokens = r.prompt_tokens.saturating_add(r.output_tokens);
        tokens_by_hour[h] += tokens;
        by_weekday[d] += 1;
        pt = pt.saturating_add(r.prompt_tokens);
        ot = ot.saturating_add(r.output_tokens);
        retries += u64::from(is_retry(r));
    }
    let share = if f.fleet_tokens > 0 {
        round6((pt.saturating_add(ot)) as f64 / f.fleet_tokens as f64)
    } else {
        0.0
    };
    Row {
        name,
        requests: recs.len() as u64,
        rate_rps: if f.span_s > 0.0 {
            round6(recs.len() as f64 / f.span_s)
        } else {
            0.0
        },
        prompt_tokens: Percentiles::of(recs.iter().map(|r| r.prompt_tokens).collect()),
        output_tokens: Percentiles::of(recs.iter().map(|r| r.output_tokens).collect()),
        prompt_tokens_total: pt,
        output_tokens_total: ot,
        token_share: share,
        by_hour,
        tokens_by_hour,
        by_weekday,
        interarrival_cv: interarrival_cv(&times),
        peak_to_mean: peak_to_mean(&times, f.t0, PEAK_WINDOW_S * 1000.0, f.windows),
        retries,
    }
}

fn rows_by(records: &[Record], f: &Frame, key: impl Fn(usize, &Record) -> String) -> Vec<Row> {
    let mut by: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        by.entry(key(i, r)).or_default().push(r);
    }
    by.into_iter().map(|(k, v)| row(k, &v, f)).collect()
}

/// Log-2 buckets: `[0, 1)`, `[1, 2)`, `[2, 4)`, … up to the largest value.
pub fn histogram(values: impl Iterator<Item = u64>) -> Vec<Bucket> {
    let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
    for v in values {
        let k = if v == 0 { 0 } else { 64 - v.leading_zeros() };
        *counts.entry(k).or_default() += 1;
    }
    let Some(&top) = counts.keys().next_back() else {
        return Vec::new();
    };
    (0..=top)
        .map(|k| {
            let (lo, hi) = if k == 0 {
                (0, 1)
            } else {
                (1u64 << (k - 1), 1u64.checked_shl(k).unwrap_or(u64::MAX))
            };
            Bucket {
                lo,
                hi,
                requests: counts.get(&k).copied().unwrap_or(0),
            }
        })
        .collect()
}

/// Replays `records` as `kiln simulate` does by default (kiln's scheduler
/// and routing, seed 0, scale 1): the outcomes (ids are positions in
/// `records`) and the simulation report.
pub fn replay(
    g: &std::sync::Arc<DecisionGraph>,
    cost: &crate::backend::cost::CostModel,
    records: &[Record],
) -> (Vec<replay::Outcome>, sim::Report) {
    use crate::sched::route::Routing;
    use crate::sched::{Config, Mode, Scheduler};
    let cfg = Config {
        mode: Mode::Kiln,
        routing: Routing::Kiln,
        seed: 0,
        cache_on_finish: true,
        ..Config::default()
    };
    let mut sched = Scheduler::new(g.clone(), replay::plan(g, cost), cfg);
    let (outcomes, gap) = replay::run_measured(&mut sched, replay::arrivals(records), |_, _| {});
    let fleet = replay::fleet(&sched, &outcomes, gap);
    let rep = sim::build(g, "kiln", Routing::Kiln.name(), &outcomes, &fleet);
    (outcomes, rep)
}

/// The replay's decision and attainment, for [`build`].
pub struct Replayed<'a> {
    pub graph: &'a DecisionGraph,
    pub outcomes: &'a [replay::Outcome],
    pub report: &'a sim::Report,
}

/// Builds the inventory of `records` (sorted by arrival, as
/// `traffic::read` returns them; outcome ids are their positions).
pub fn build(records: &[Record], opts: Options, replayed: Option<Replayed<'_>>) -> Inventory {
    let t0 = records
        .iter()
        .map(|r| r.at_ms)
        .fold(f64::INFINITY, f64::min);
    let t1 = records
        .iter()
        .map(|r| r.at_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let span_ms = if records.is_empty() { 0.0 } else { t1 - t0 };
    let window_ms = PEAK_WINDOW_S * 1000.0;
    let frame = Frame {
        start_ms: opts.start_ms.unwrap_or(ASSUMED_START_MS),
        t0: if records.is_empty() { 0.0 } else { t0 },
        span_s: span_ms / 1000.0,
        windows: (span_ms / window_ms).floor() as usize + 1,
        fleet_tokens: records.iter().fold(0u64, |a, r| {
            a.saturating_add(r.prompt_tokens)
                .saturating_add(r.output_tokens)
        }),
    };
    let all: Vec<&Record> = records.iter().collect();
    let policy = replayed.map(|rp| {
        let mut tier_of = vec!["(none)".to_string(); records.len()];
        for o in rp.outcomes {
            if let (Some(slot), Some(t)) = (
                tier_of.get_mut(o.id as usize),
                o.tier.and_then(|t| rp.graph.tiers.get(t as usize)),
            ) {
                *slot = t.name.clone();
            }
        }
        let tiers = rows_by(records, &frame, |i, _| tier_of[i].clone());
        let mut placement: BTreeMap<(String, String), u64> = BTreeMap::new();
        for (i, r) in records.iter().enumerate() {
            *placement
                .entry((tier_of[i].clone(), tenant_of(r)))
                .or_default() += 1;
        }
        let att = |g: &sim::Group| Attainment {
            name: g.name.clone(),
            requests: g.requests,
            rejected: g.rejected,
            ttft_attainment: g.ttft_attainment,
            window_attainment: g.window_attainment,
            slo_attainment: g.slo_attainment,
        };
        PolicySection {
            tiers,
            placement: placement
                .into_iter()
                .map(|((tier, tenant), requests)| Placement {
                    tier,
                    tenant,
                    requests,
                })
                .collect(),
            slo_tiers: rp.report.tiers.iter().map(att).collect(),
            slo_tenants: rp.report.tenants.iter().map(att).collect(),
        }
    });
    Inventory {
        requests: records.len() as u64,
        span_s: round6(frame.span_s),
        start: format_rfc3339(frame.start_ms),
        start_assumed: opts.start_ms.is_none(),
        start_from_log: opts.start_ms.is_some() && opts.start_from_log,
        peak_window_s: PEAK_WINDOW_S,
        retry_rule: RETRY_RULE,
        fleet: row("(fleet)".into(), &all, &frame),
        tenants: rows_by(records, &frame, |_, r| tenant_of(r)),
        models: rows_by(records, &frame, |_, r| r.model.clone()),
        policy,
        prompt_histogram: histogram(records.iter().map(|r| r.prompt_tokens)),
        output_histogram: histogram(records.iter().map(|r| r.output_tokens)),
        recorded: super::baseline::recorded(records, opts.episode_window_s, |at_ms| {
            format_rfc3339(frame.start_ms.saturating_add(at_ms.floor() as i64))
        }),
    }
}

// ---- time ----

/// Unix milliseconds as RFC 3339 UTC (`1970-01-05T00:00:00Z`, with
/// milliseconds when there are any). Past the years jiff holds (±9999)
/// the nearest it does.
pub fn format_rfc3339(ms: i64) -> String {
    let t = jiff::Timestamp::from_millisecond(ms).unwrap_or(if ms < 0 {
        jiff::Timestamp::MIN
    } else {
        jiff::Timestamp::MAX
    });
    let f = if ms.rem_euclid(1000) == 0 {
        "%Y-%m-%dT%H:%M:%SZ"
    } else {
        "%Y-%m-%dT%H:%M:%S%.3fZ"
    };
    t.strftime(f).to_string()
}

/// Parses an RFC 3339 time (`2023-11-16T18:15:46Z`, fractions and
/// `±HH:MM` offsets allowed) into Unix milliseconds, with jiff's parser
/// (which also takes the other ISO 8601 spellings of an instant; a time
/// without a zone or offset is refused, as it names no instant).
pub fn parse_rfc3339(s: &str) -> Result<i64, ReportError> {
    s.parse::<jiff::Timestamp>()
        .map(|t| t.as_millisecond())
        .map_err(|e| ReportError::BadStart {
            value: s.to_string(),
            why: e.to_string(),
        })
}

// ---- rendering ----

const WEEKDAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.1}%", v * 100.0))
}

fn p3(p: &Percentiles) -> String {
    format!("{}/{}/{}", p.p50, p.p95, p.p99)
}

/// Markdown table cell: pipes and newlines would break the table.
fn md(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace(['\n', '\r'], " ")
}

fn clock_note(inv: &Inventory) -> String {
    if inv.start_assumed {
        format!(
            "at_ms 0 is taken as {} (an assumed Monday 00:00 UTC: the traffic records no wall-clock start; pass --start RFC3339)",
            inv.start
        )
    } else if inv.start_from_log {
        format!(
            "at_ms 0 is {} (the decision log's first arrival)",
            inv.start
        )
    } else {
        format!("at_ms 0 is {} (--start)", inv.start)
    }
}

fn md_rows(s: &mut String, title: &str, rows: &[Row], fleet: Option<&Row>) {
    let _ = writeln!(s, "\n## Per {title}\n");
    let _ = writeln!(
        s,
        "| {title} | requests | req/s | prompt p50/p95/p99 | output p50/p95/p99 | token share | inter-arrival CV | peak/mean | retries |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows.iter().chain(fleet) {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {} | {} | {:.1}% | {} | {} | {} |",
            md(&r.name),
            r.requests,
            r.rate_rps,
            p3(&r.prompt_tokens),
            p3(&r.output_tokens),
            r.token_share * 100.0,
            opt(r.interarrival_cv, 2),
            opt(r.peak_to_mean, 2),
            r.retries
        );
    }
}

/// The inventory as markdown.
pub fn markdown(inv: &Inventory) -> String {
    let mut s = String::from("# Workload inventory\n\n");
    let _ = writeln!(
        s,
        "{} requests over {:.1} s (first to last arrival); {}.\n",
        inv.requests,
        inv.span_s,
        clock_note(inv)
    );
    let _ = writeln!(
        s,
        "- Token percentiles are nearest-rank; token share is prompt + output tokens over the fleet's.\n\
         - Inter-arrival CV: standard deviation over mean of the gaps between arrivals (0 regular, about 1 Poisson, above 1 bursty).\n\
         - Peak/mean: the busiest {:.0} s window's request rate over the mean rate, windows aligned on the first arrival.\n\
         - Retries: {}.",
        inv.peak_window_s, inv.retry_rule
    );
    md_rows(&mut s, "tenant", &inv.tenants, Some(&inv.fleet));
    md_rows(&mut s, "model", &inv.models, None);
    if let Some(p) = &inv.policy {
        md_rows(&mut s, "tier", &p.tiers, None);
        let _ = writeln!(
            s,
            "\n## Where requests land (tier × tenant, from the replay)\n\n| tier | tenant | requests |\n|---|---|---:|"
        );
        for x in &p.placement {
            let _ = writeln!(
                s,
                "| {} | {} | {} |",
                md(&x.tier),
                md(&x.tenant),
                x.requests
            );
        }
        for (what, rows) in [("tier", &p.slo_tiers), ("tenant", &p.slo_tenants)] {
            let _ = writeln!(
                s,
                "\n## SLO attainment per {what} (replay, kiln scheduler)\n\n| {what} | requests | rejected | TTFT attainment | window attainment | SLO attainment |\n|---|---:|---:|---:|---:|---:|"
            );
            for a in rows {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} |",
                    md(&a.name),
                    a.requests,
                    a.rejected,
                    pct(a.ttft_attainment),
                    pct(a.window_attainment),
                    pct(Some(a.slo_attainment))
                );
            }
        }
    }
    if let Some(rec) = &inv.recorded {
        let _ = writeln!(
            s,
            "\n## Recorded service\n\n{} of the requests say how they ended. Latencies are in milliseconds, nearest-rank. Saturation episodes: {}.",
            rec.requests, rec.episode_rule
        );
        for t in super::baseline::tables(rec) {
            let _ = writeln!(s, "\n### {}\n", md(&t.title));
            let _ = writeln!(s, "| {} |", t.head.join(" | "));
            let _ = writeln!(s, "|---|{}", "---:|".repeat(t.head.len().saturating_sub(1)));
            for r in &t.rows {
                let cells: Vec<String> = r.iter().map(|c| md(c)).collect();
                let _ = writeln!(s, "| {} |", cells.join(" | "));
            }
            if t.rows.is_empty() {
                let _ = writeln!(s, "\n(none)");
            }
        }
    }
    let _ = writeln!(
        s,
        "\n## Arrivals by hour of day (UTC)\n\n| hour | requests | tokens |\n|---:|---:|---:|"
    );
    for h in 0..24 {
        if inv.fleet.by_hour[h] > 0 {
            let _ = writeln!(
                s,
                "| {h:02} | {} | {} |",
                inv.fleet.by_hour[h], inv.fleet.tokens_by_hour[h]
            );
        }
    }
    let _ = writeln!(
        s,
        "\n(hours without arrivals left out)\n\n## Arrivals by weekday\n"
    );
    let _ = writeln!(
        s,
        "| {} |\n|{}\n| {} |",
        WEEKDAYS.join(" | "),
        "---:|".repeat(7),
        inv.fleet
            .by_weekday
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" | ")
    );
    s
}

/// Escapes text for HTML and SVG content and attribute values.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

const SVG_W: u32 = 640;

/// Vertical bars, one per label.
fn bars_svg(
    title: &str,
    labels: &[String],
    values: &[u64],
    color: chart::Rgb,
) -> Result<String, chart::ChartError> {
    chart::bars(title, labels, values, color, SVG_W, 200)
}

/// Horizontal bars: the tenants' token shares.
fn share_svg(rows: &[Row]) -> Result<String, chart::ChartError> {
    let shares: Vec<(String, f64)> = rows
        .iter()
        .map(|r| (r.name.clone(), r.token_share))
        .collect();
    chart::shares(
        "Token share per tenant (prompt + output)",
        &shares,
        chart::Rgb(0x2c, 0xa0, 0x2c),
        SVG_W,
    )
}

fn bucket_label(b: &Bucket) -> String {
    let k = |x: u64| {
        if x >= 1 << 20 {
            format!("{}M", x >> 20)
        } else if x >= 1024 {
            format!("{}k", x >> 10)
        } else {
            x.to_string()
        }
    };
    if b.lo == 0 {
        "0".into()
    } else {
        k(b.lo)
    }
}

fn html_table(s: &mut String, head: &[&str], rows: Vec<Vec<String>>) {
    s.push_str("<table><tr>");
    for h in head {
        let _ = write!(s, "<th>{}</th>", escape(h));
    }
    s.push_str("</tr>\n");
    for r in rows {
        s.push_str("<tr>");
        for c in r {
            let _ = write!(s, "<td>{}</td>", escape(&c));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</table>\n");
}

fn row_cells(r: &Row) -> Vec<String> {
    vec![
        r.name.clone(),
        r.requests.to_string(),
        format!("{:.3}", r.rate_rps),
        p3(&r.prompt_tokens),
        p3(&r.output_tokens),
        format!("{:.1}%", r.token_share * 100.0),
        opt(r.interarrival_cv, 2),
        opt(r.peak_to_mean, 2),
        r.retries.to_string(),
    ]
}

/// A self-contained HTML page: inline CSS and SVG, no scripts, no
/// external resources. Every string from traffic or policy is escaped.
/// The inventory as a self-contained HTML page (inline SVG charts).
pub fn html(inv: &Inventory) -> Result<String, chart::ChartError> {
    let mut s = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>kiln report: workload inventory</title>\n<style>\nbody{font-family:system-ui,sans-serif;margin:2em;max-width:1000px;color:#222}\ntable{border-collapse:collapse;margin:0.5em 0 1.5em}\nth,td{border:1px solid #ccc;padding:3px 8px;text-align:right}\nth:first-child,td:first-child{text-align:left}\nth{background:#f3f3f3}\nsvg{display:block;margin:0.5em 0 1.5em}\n.note{color:#555;font-size:0.9em}\n</style></head><body>\n<h1>Workload inventory</h1>\n",
    );
    let _ = writeln!(
        s,
        "<p>{} requests over {:.1} s (first to last arrival); {}.</p>",
        inv.requests,
        inv.span_s,
        escape(&clock_note(inv))
    );
    let _ = writeln!(
        s,
        "<p class=\"note\">Inter-arrival CV: standard deviation over mean of the gaps between arrivals (0 regular, about 1 Poisson, above 1 bursty). Peak/mean: the busiest {:.0} s window's request rate over the mean rate, windows aligned on the first arrival. Retries: {}.</p>",
        inv.peak_window_s,
        escape(inv.retry_rule)
    );
    let head = [
        "",
        "requests",
        "req/s",
        "prompt p50/p95/p99",
        "output p50/p95/p99",
        "token share",
        "inter-arrival CV",
        "peak/mean",
        "retries",
    ];
    let table = |s: &mut String, title: &str, rows: &[Row], fleet: Option<&Row>| {
        let _ = writeln!(s, "<h2>Per {}</h2>", escape(title));
        let mut h = head;
        h[0] = title;
        html_table(s, &h, rows.iter().chain(fleet).map(row_cells).collect());
    };
    table(&mut s, "tenant", &inv.tenants, Some(&inv.fleet));
    table(&mut s, "model", &inv.models, None);
    if let Some(p) = &inv.policy {
        table(&mut s, "tier", &p.tiers, None);
        s.push_str("<h2>Where requests land (tier × tenant, from the replay)</h2>\n");
        html_table(
            &mut s,
            &["tier", "tenant", "requests"],
            p.placement
                .iter()
                .map(|x| vec![x.tier.clone(), x.tenant.clone(), x.requests.to_string()])
                .collect(),
        );
        for (what, rows) in [("tier", &p.slo_tiers), ("tenant", &p.slo_tenants)] {
            let _ = writeln!(
                s,
                "<h2>SLO attainment per {what} (replay, kiln scheduler)</h2>"
            );
            html_table(
                &mut s,
                &[
                    what,
                    "requests",
                    "rejected",
                    "TTFT attainment",
                    "window attainment",
                    "SLO attainment",
                ],
                rows.iter()
                    .map(|a| {
                        vec![
                            a.name.clone(),
                            a.requests.to_string(),
                            a.rejected.to_string(),
                            pct(a.ttft_attainment),
                            pct(a.window_attainment),
                            pct(Some(a.slo_attainment)),
                        ]
                    })
                    .collect(),
            );
        }
    }
    if let Some(rec) = &inv.recorded {
        let _ = writeln!(
            s,
            "<h2>Recorded service</h2>\n<p class=\"note\">{} of the requests say how they ended. Latencies are in milliseconds, nearest-rank. Saturation episodes: {}.</p>",
            rec.requests,
            escape(&rec.episode_rule)
        );
        for t in super::baseline::tables(rec) {
            let _ = writeln!(s, "<h3>{}</h3>", escape(&t.title));
            html_table(&mut s, &t.head, t.rows);
        }
    }
    s.push_str("<h2>Demand by hour of day (UTC)</h2>\n");
    let hours: Vec<String> = (0..24).map(|h| format!("{h:02}")).collect();
    s.push_str(&bars_svg(
        "Requests by hour of day (UTC)",
        &hours,
        &inv.fleet.by_hour,
        chart::Rgb(0x1f, 0x77, 0xb4),
    )?);
    s.push_str(&bars_svg(
        "Tokens (prompt + output) by hour of day (UTC)",
        &hours,
        &inv.fleet.tokens_by_hour,
        chart::Rgb(0xff, 0x7f, 0x0e),
    )?);
    let days: Vec<String> = WEEKDAYS.iter().map(|d| d.to_string()).collect();
    s.push_str(&bars_svg(
        "Requests by weekday",
        &days,
        &inv.fleet.by_weekday,
        chart::Rgb(0x94, 0x67, 0xbd),
    )?);
    s.push_str("<h2>Token share per tenant</h2>\n");
    s.push_str(&share_svg(&inv.tenants)?);
    s.push_str("<h2>Token distributions</h2>\n<p class=\"note\">Log-2 buckets: a bar counts the requests with lower bound ≤ tokens &lt; twice it.</p>\n");
    for (title, hist, color) in [
        (
            "Prompt tokens per request",
            &inv.prompt_histogram,
            chart::Rgb(0x17, 0xbe, 0xcf),
        ),
        (
            "Output tokens per request",
            &inv.output_histogram,
            chart::Rgb(0xd6, 0x27, 0x28),
        ),
    ] {
        let labels: Vec<String> = hist.iter().map(bucket_label).collect();
        let values: Vec<u64> = hist.iter().map(|b| b.requests).collect();
        s.push_str(&bars_svg(title, &labels, &values, color)?);
    }
    s.push_str("</body></html>\n");
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    #[test]
    fn cv_of_a_regular_series_is_zero() {
        let t: Vec<f64> = (0..100).map(|i| i as f64 * 250.0).collect();
        assert_eq!(interarrival_cv(&t), Some(0.0));
        assert_eq!(interarrival_cv(&t[..2]), None);
        assert_eq!(interarrival_cv(&[5.0, 5.0, 5.0]), None);
    }

    #[test]
    fn cv_of_poisson_arrivals_is_about_one() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut t = 0.0;
        let times: Vec<f64> = (0..20_000)
            .map(|_| {
                let u: f64 = rng.random();
                t += -(1.0 - u).ln() * 100.0;
                t
            })
            .collect();
        let cv = interarrival_cv(&times).unwrap();
        assert!((cv - 1.0).abs() < 0.03, "cv {cv}");
        // Bursts (ten arrivals 1 ms apart, 10 s between bursts) are well above 1.
        let bursty: Vec<f64> = (0..1000)
            .map(|i| (i / 10) as f64 * 10_000.0 + (i % 10) as f64)
            .collect();
        assert!(interarrival_cv(&bursty).unwrap() > 2.5);
    }

    #[test]
    fn hours_and_weekdays() {
        // The assumed start is Monday 00:00 UTC.
        assert_eq!(hour_and_weekday(ASSUMED_START_MS, 0.0), (0, 0));
        assert_eq!(hour_and_weekday(ASSUMED_START_MS, 3_599_999.0), (0, 0));
        assert_eq!(hour_and_weekday(ASSUMED_START_MS, 3_600_000.0), (1, 0));
        assert_eq!(
            hour_and_weekday(ASSUMED_START_MS, 86_400_000.0 * 6.5),
            (12, 6)
        );
        assert_eq!(
            hour_and_weekday(ASSUMED_START_MS, 86_400_000.0 * 7.0),
            (0, 0)
        );
        // 2023-11-16 was a Thursday.
        let s = parse_rfc3339("2023-11-16T18:15:46Z").unwrap();
        assert_eq!(hour_and_weekday(s, 0.0), (18, 3));
        assert_eq!(hour_and_weekday(s, 6.0 * 3_600_000.0), (0, 4));
    }

    #[test]
    fn rfc3339_round_trips_and_rejects_garbage() {
        assert_eq!(format_rfc3339(ASSUMED_START_MS), "1970-01-05T00:00:00Z");
        let t = parse_rfc3339("2023-11-16T10:15:46.5-08:00").unwrap();
        assert_eq!(format_rfc3339(t), "2023-11-16T18:15:46.500Z");
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z").unwrap(), 0);
        // ISO 8601's basic offset is the same instant (jiff reads both).
        assert_eq!(
            parse_rfc3339("2023-11-16T18:15:46+0800").unwrap(),
            parse_rfc3339("2023-11-16T18:15:46+08:00").unwrap()
        );
        // Any instant jiff holds, to the millisecond, both ways.
        for ms in [
            -62_135_596_800_000i64,
            -1,
            0,
            1,
            999,
            1_700_000_000_123,
            253_402_000_000_001,
        ] {
            assert_eq!(parse_rfc3339(&format_rfc3339(ms)).unwrap(), ms, "{ms}");
        }
        // Past jiff's range (±9999 years): its nearest, no panic.
        assert!(format_rfc3339(i64::MAX).starts_with("9999-12-"));
        assert!(
            format_rfc3339(i64::MIN).contains("9999-01-"),
            "{}",
            format_rfc3339(i64::MIN)
        );
        assert_eq!(
            parse_rfc3339("2024-02-29T00:00:00Z").unwrap() % 86_400_000,
            0
        );
        for bad in [
            "",
            "2023-11-16",
            "2023-11-16T18:15:46",
            "2023-02-30T00:00:00Z",
            "2023-11-16T25:00:00Z",
            "2023-11-16T18:15:46.Z",
            "2023-1a-16T18:15:46Z",
            "2023-11-16T18:15:46Zé",
        ] {
            assert!(parse_rfc3339(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn peak_to_mean_bounds() {
        // Regular arrivals filling the windows: exactly 1.
        let t: Vec<f64> = (0..600).map(|i| i as f64 * 1000.0).collect();
        assert_eq!(peak_to_mean(&t, 0.0, 60_000.0, 10), Some(1.0));
        // Everything in one of ten windows: 10.
        let t = vec![1.0; 50];
        assert_eq!(peak_to_mean(&t, 0.0, 60_000.0, 10), Some(10.0));
    }

    proptest::proptest! {
        #[test]
        fn peak_to_mean_is_at_least_one(mut times in proptest::collection::vec(0.0f64..3_600_000.0, 1..300)) {
            times.sort_by(f64::total_cmp);
            let recs: Vec<Record> = times.iter().map(|&t| Record { at_ms: t, tenant: Some("a".into()), ..Record::default() }).collect();
            let inv = build(&recs, Options::default(), None);
            let p = inv.fleet.peak_to_mean.unwrap();
            proptest::prop_assert!(p >= 1.0 - 1e-9, "{}", p);
            proptest::prop_assert_eq!(inv.fleet.by_hour.iter().sum::<u64>(), recs.len() as u64);
            proptest::prop_assert_eq!(inv.fleet.by_weekday.iter().sum::<u64>(), recs.len() as u64);
        }
    }

    #[test]
    fn rows_shares_histograms_and_retries() {
        let mk = |at_ms: f64, t: &str, p: u64, o: u64| Record {
            at_ms,
            tenant: Some(t.into()),
            model: "m".into(),
            prompt_tokens: p,
            output_tokens: o,
            ..Record::default()
        };
        let mut recs = vec![
            mk(0.0, "a", 100, 0),
            mk(1000.0, "b", 200, 100),
            mk(3_600_000.0, "a", 0, 600),
        ];
        recs[1]
            .headers
            .insert("x-stainless-retry-count".into(), "2".into());
        let mut not_retry = mk(3_600_000.0, "a", 0, 0);
        not_retry
            .headers
            .insert("x-kiln-retry".into(), "false".into());
        recs.push(not_retry);
        let inv = build(&recs, Options::default(), None);
        assert_eq!(inv.tenants.len(), 2);
        let a = &inv.tenants[0];
        assert_eq!(
            (a.requests, a.prompt_tokens_total, a.output_tokens_total),
            (3, 100, 600)
        );
        assert!((a.token_share - 0.7).abs() < 1e-9);
        assert_eq!(inv.tenants[1].retries, 1);
        assert_eq!(inv.fleet.retries, 1);
        assert_eq!(inv.fleet.by_hour[0], 2);
        assert_eq!(inv.fleet.by_hour[1], 2);
        assert_eq!(inv.fleet.tokens_by_hour[1], 600);
        assert_eq!(inv.models[0].requests, 4);
        // 0, 0, 100, 200, 100, 600, 0, 0 → buckets [0,1) [1,2) … [512,1024)
        let h = histogram([0, 1, 2, 3, 600].into_iter());
        assert_eq!(h.len(), 11);
        assert_eq!((h[0].requests, h[1].requests, h[2].requests), (1, 1, 2));
        assert_eq!((h[10].lo, h[10].hi, h[10].requests), (512, 1024, 1));
        assert!(histogram(std::iter::empty()).is_empty());
        let empty = build(&[], Options::default(), None);
        assert_eq!(empty.requests, 0);
        assert!(markdown(&empty).contains("0 requests"));
    }

    #[test]
    fn html_escapes_hostile_names() {
        let recs = vec![Record {
            at_ms: 0.0,
            tenant: Some("<script>alert('x')</script>&\"".into()),
            model: "m<b>".into(),
            prompt_tokens: 5,
            ..Record::default()
        }];
        let page = html(&build(&recs, Options::default(), None)).unwrap();
        assert!(!page.contains("<script"));
        assert!(!page.contains("m<b>"));
        assert!(page.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"));
        assert!(page.contains("<svg"));
        let md = markdown(&build(&recs, Options::default(), None));
        assert!(md.contains("m&lt;b&gt;") && !md.contains("<script"));
    }
}
