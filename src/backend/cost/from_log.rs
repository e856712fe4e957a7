//! Calibration from a decision log: fitting the replay's roofline to the
//! times the gateway recorded for requests its HTTP upstreams served.
//!
//! A decision-log line of a served request carries its arrival (`at_ms`),
//! the wait in kiln's queue (`queue_ms`), the time to first token and the
//! end-to-end time (both from arrival, so both include the queue), the
//! prompt and output tokens, the route (`model.variant on pool`) and the
//! replica it ran on (`decision.replica`). The engine's steps are not in
//! the log, so each line is turned into two observations of the roofline
//! `step(p, b, C) = max(bytes / B, flops / F) + o + s·b` ([`super::replica`];
//! `s` is the cost of each decoding sequence, the output head and sampling)
//! at the load the line met:
//!
//! - **Time to first token on the replica** (`ttft − queue`): the prompt's
//!   prefill step beside the `b₀` sequences already decoding on its replica
//!   (lines of the same replica running at its start; in a log without
//!   replicas, lines of the same pool divided by the pool's replicas), plus
//!   on average half of the step in flight when it arrived:
//!   `step(prompt, b₀, C₀) + ½ · min(b₀, 1) · step(0, max(b₀, 1), C₀)`.
//! - **Inter-token time** (`(e2e − ttft) / (output − 1)`): decode steps at
//!   the time-averaged batch `b̄` over its decode (itself plus the others
//!   running on its replica), each other prompt prefilled in that span
//!   adding its prefill to one of the steps:
//!   `step(0, b̄, C̄) + m/n · (step(p̄, b̄, C̄) − step(0, b̄, C̄))` with `m`
//!   such prompts per replica, of `p̄` tokens on average, over `n` tokens.
//!   A prompt counts by the share of its prefill (its start to its first
//!   token) inside the span.
//!
//! Context `C` is the batch times the pool's mean `prompt + output / 2`.
//! Queueing in kiln is excluded (it is recorded); queueing inside the engine
//! is what the batch terms model.
//!
//! `(B, F, o, s)` minimise the squared log error of both predictions over
//! two thirds of the lines (Nelder–Mead in log space, from the current
//! cost model's figures, with restarts); the other third is held back and
//! the report gives the median and p90 absolute relative error of TTFT,
//! inter-token time and end-to-end time on the replica there, before and
//! after. The fit is written as the variant's `mbu`, `mfu`,
//! `step_overhead_ms` and `seq_overhead_ms` (relative to the pool's GPU
//! figures); a device faster
//! than its figures gets a `time_factor` below 1 instead of a factor above
//! 1, so the file always loads.

use super::calibration::{Calibration, VariantOverride};
use super::{compute_rate, CostModel, ReplicaModel};
use crate::graph::DecisionGraph;
use crate::traffic::Record;
use miette::Diagnostic;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Lines a (pool, model, variant) needs before it is fitted.
pub const MIN_LINES: usize = 12;

/// Why no calibration could be fitted from the logs.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Diagnostic)]
pub enum FromLogError {
    #[error("no (pool, model, variant) in the logs has {MIN_LINES} or more served lines with timings ({lines} usable lines in all, {malformed} malformed lines skipped)")]
    #[diagnostic(
        code(kiln::calibrate::log_too_short),
        help("a decision log of an HTTP upstream records queue_ms, ttft_ms and e2e_ms for each served request; pass a longer log, or several (kiln calibrate --from-log a.jsonl b.jsonl …); where lines were malformed, `kiln traffic stats LOG` shows the first one and its bad field")
    )]
    TooFewLines { lines: usize, malformed: usize },
}

/// Lines left out of the fit, by why.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// Not JSON of the traffic format (counted by the reader).
    pub malformed: usize,
    /// Refused, failed, cancelled or answered from the cache.
    pub not_served: usize,
    /// Served, but without `queue_ms`, `ttft_ms` or `e2e_ms` (a replayed
    /// trace rather than a gateway's log), or without output tokens.
    pub no_timing: usize,
    /// Timings that cannot be (negative, not finite, TTFT before the
    /// queue ended, end before the first token).
    pub bad_timing: usize,
    /// Without a route, or a route naming a model, variant or pool the
    /// policy lacks, or one the cost model cannot size.
    pub unknown_route: usize,
    /// Of a (pool, model, variant) with fewer than [`MIN_LINES`] lines.
    pub too_few: usize,
}

impl Skipped {
    pub fn total(&self) -> usize {
        self.malformed
            + self.not_served
            + self.no_timing
            + self.bad_timing
            + self.unknown_route
            + self.too_few
    }
}

/// One served request, seconds from the start of the log.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Line {
    /// Wait in kiln's queue, seconds.
    queue: f64,
    start: f64,
    first: f64,
    end: f64,
    prompt: f64,
    output: f64,
    /// The replica it ran on, where the log says.
    replica: Option<u32>,
}

/// What a line is turned into: its load and its two measured times.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Obs {
    prompt: f64,
    /// Sequences decoding on its replica when it started, and their context.
    b0: f64,
    c0: f64,
    /// Mean batch over its decode, and the batch's context.
    bbar: f64,
    cbar: f64,
    /// Other prompts prefilled during its decode per replica (each counted
    /// by the share of its prefill inside the span), their mean size.
    m: f64,
    pbar: f64,
    /// Decode steps (output − 1).
    n: f64,
    ttft: f64,
    /// `None` for a single-token answer.
    itl: Option<f64>,
}

/// The roofline inputs of a replica: what a step reads and computes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Shape {
    pub weight_bytes: f64,
    pub params: f64,
    pub kv_bytes_per_token: f64,
    pub attention_flops_per_pair: f64,
}

impl Shape {
    pub fn of(r: &ReplicaModel) -> Shape {
        Shape {
            weight_bytes: r.weight_bytes,
            params: r.params,
            kv_bytes_per_token: r.kv_bytes_per_token,
            attention_flops_per_pair: r.attention_flops_per_pair,
        }
    }
}

/// Effective bandwidth (bytes/s), compute (FLOP/s) and step overhead (s).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Rates {
    pub bandwidth: f64,
    pub flops: f64,
    pub overhead: f64,
    /// Seconds per decoding sequence per step (the output head and
    /// sampling; `seq_overhead_ms`).
    pub per_seq: f64,
}

impl Rates {
    /// The rates a replica model runs at (its time factor folded in).
    pub fn of(r: &ReplicaModel) -> Rates {
        let k = if r.time_factor > 0.0 && r.time_factor.is_finite() {
            r.time_factor
        } else {
            1.0
        };
        Rates {
            bandwidth: r.effective_bandwidth / k,
            flops: r.effective_flops / k,
            overhead: r.efficiency.step_overhead * k,
            per_seq: r.efficiency.seq_overhead * k,
        }
    }

    /// The roofline with fractional batch and prefill (averages).
    fn step(&self, s: &Shape, p: f64, b: f64, c: f64) -> f64 {
        if p <= 0.0 && b <= 0.0 {
            return 0.0;
        }
        let bytes = s.weight_bytes + c * s.kv_bytes_per_token;
        let pairs = p * (p + 1.0) / 2.0 + c;
        let flops = 2.0 * s.params * (p + b) + s.attention_flops_per_pair * pairs;
        (bytes / self.bandwidth).max(flops / self.flops) + self.overhead + self.per_seq * b
    }

    fn ttft(&self, s: &Shape, o: &Obs) -> f64 {
        let prefill = self.step(s, o.prompt, o.b0, o.c0);
        let in_flight = if o.b0 > 0.0 {
            let b = o.b0.max(1.0);
            0.5 * o.b0.min(1.0) * self.step(s, 0.0, b, o.c0 * b / o.b0)
        } else {
            0.0
        };
        prefill + in_flight
    }

    fn itl(&self, s: &Shape, o: &Obs) -> f64 {
        let decode = self.step(s, 0.0, o.bbar, o.cbar);
        let with_prefill = self.step(s, o.pbar, o.bbar, o.cbar);
        decode + o.m / o.n.max(1.0) * (with_prefill - decode)
    }
}

/// Median and p90 of absolute relative errors.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Stat {
    pub points: usize,
    pub median: f64,
    pub p90: f64,
}

impl Stat {
    fn of(mut e: Vec<f64>) -> Stat {
        e.retain(|x| x.is_finite());
        e.sort_by(f64::total_cmp);
        let n = e.len();
        let q = |f: f64| -> f64 {
            if n == 0 {
                return 0.0;
            }
            let i = ((n - 1) as f64 * f).round() as usize;
            e[i.min(n - 1)]
        };
        Stat {
            points: n,
            median: q(0.5),
            p90: q(0.9),
        }
    }
}

/// The error of a cost model on held-back lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Errors {
    /// Time to first token on the replica (`ttft − queue`).
    pub ttft: Stat,
    /// `(e2e − ttft) / (output − 1)`.
    pub itl: Stat,
    /// End-to-end on the replica (`e2e − queue`).
    pub e2e: Stat,
}

/// A line's time on its replica, start to end: as measured, and as
/// `rates` predict it (first token, then its inter-token times).
fn end_to_end(rates: &Rates, s: &Shape, o: &Obs) -> (f64, f64) {
    match o.itl {
        Some(i) => (o.ttft + i * o.n, rates.ttft(s, o) + rates.itl(s, o) * o.n),
        None => (o.ttft, rates.ttft(s, o)),
    }
}

fn errors(rates: &Rates, s: &Shape, held: &[Obs]) -> Errors {
    let rel = |pred: f64, t: f64| (pred / t - 1.0).abs();
    let ttft = held.iter().map(|o| rel(rates.ttft(s, o), o.ttft)).collect();
    let itl = held
        .iter()
        .filter_map(|o| o.itl.map(|t| rel(rates.itl(s, o), t)))
        .collect();
    let e2e = held
        .iter()
        .map(|o| {
            let (measured, pred) = end_to_end(rates, s, o);
            rel(pred, measured)
        })
        .collect();
    Errors {
        ttft: Stat::of(ttft),
        itl: Stat::of(itl),
        e2e: Stat::of(e2e),
    }
}

/// The fit of one (pool, model, variant).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupFit {
    pub pool: String,
    pub model: String,
    pub variant: String,
    /// The GPU the factors are relative to (the pool's kind).
    pub gpu: String,
    /// Replicas of the variant on the pool in the replay's plan: the load
    /// a line met on its replica is the pool's divided by this.
    pub replicas: usize,
    pub lines: usize,
    pub fitted: usize,
    pub held_back: usize,
    /// The cost model's rates before, and the fitted ones.
    pub before_rates: Rates,
    pub rates: Rates,
    /// What is written: `[model.M.variant.V]`.
    pub mbu: f64,
    pub mfu: f64,
    pub step_overhead_ms: f64,
    /// Per decoding sequence and step; `None` where the fit found none.
    pub seq_overhead_ms: Option<f64>,
    /// Below 1 only when the device beats its datasheet figures.
    pub time_factor: f64,
    /// The pull toward the cost model's rates of the fit that was kept
    /// ([`PRIOR_WEIGHTS`], 0 = free); `None`: the cost model's own rates
    /// did clearly better on the held-back lines than every fit, and they
    /// are written unchanged.
    pub prior_weight: Option<f64>,
    /// Held-back error with the cost model before calibration, and after.
    pub before: Errors,
    pub after: Errors,
    /// Mean recorded queue wait in kiln, and mean decode batch per replica.
    pub mean_queue_ms: f64,
    pub mean_batch: f64,
}

/// Everything `kiln calibrate --from-log` prints.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    pub lines: usize,
    pub skipped: Skipped,
    pub groups: Vec<GroupFit>,
    pub notes: Vec<String>,
}

/// A finished calibration from logs.
#[derive(Debug, Clone, PartialEq)]
pub struct FromLog {
    pub report: Report,
    pub calibration: Calibration,
}

/// A route `model.variant on pool` resolved against the policy.
fn resolve(g: &DecisionGraph, route: &str) -> Option<(u16, u16, u16)> {
    let (mv, pool) = route.rsplit_once(" on ")?;
    let p = g.pool_id(pool.trim())?;
    // Names may hold dots: try every split.
    for (i, _) in mv.match_indices('.') {
        let (m, v) = (&mv[..i], &mv[i + 1..]);
        if let Some(mid) = g.model_id(m) {
            if let Some(vid) = g
                .models
                .get(usize::from(mid))
                .and_then(|model| model.variants.iter().position(|x| x.name == v))
            {
                return Some((mid, vid as u16, p));
            }
        }
    }
    None
}

/// The served line of a record, or why it is not one.
fn line_of(r: &Record, skipped: &mut Skipped) -> Option<Line> {
    let d = r.decision.as_ref();
    let refused = d.is_some_and(|d| {
        d.reason.is_some()
            || d.status.is_some_and(|s| !(200..300).contains(&s))
            || d.cache.as_deref() == Some("hit")
            || matches!(d.admission.as_deref(), Some("reject"))
    });
    if refused {
        skipped.not_served += 1;
        return None;
    }
    let (Some(q), Some(t), Some(e)) = (r.queue_ms, r.ttft_ms, r.e2e_ms) else {
        skipped.no_timing += 1;
        return None;
    };
    if r.output_tokens == 0 {
        skipped.no_timing += 1;
        return None;
    }
    let ok = [r.at_ms, q, t, e]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
        && q <= t
        && t <= e
        && t > q
        && r.output_tokens <= u64::from(u32::MAX)
        && r.prompt_tokens <= u64::from(u32::MAX);
    if !ok {
        skipped.bad_timing += 1;
        return None;
    }
    Some(Line {
        queue: q / 1e3,
        start: (r.at_ms + q) / 1e3,
        first: (r.at_ms + t) / 1e3,
        end: (r.at_ms + e) / 1e3,
        prompt: r.prompt_tokens as f64,
        output: r.output_tokens as f64,
        replica: d.and_then(|d| d.replica),
    })
}

/// Running-count and its integral over time, for interval queries.
struct Load {
    /// Event times, ascending, and the count right after each.
    times: Vec<f64>,
    count: Vec<f64>,
    /// ∫ count dt from the first event to each event time.
    area: Vec<f64>,
    /// Prefills (start, first token, prompt tokens), by start, and the
    /// longest of them.
    prefills: Vec<(f64, f64, f64)>,
    longest: f64,
}

impl Load {
    fn new(lines: &[Line]) -> Load {
        let mut ev: Vec<(f64, f64)> = Vec::with_capacity(lines.len() * 2);
        for l in lines {
            ev.push((l.start, 1.0));
            ev.push((l.end, -1.0));
        }
        // Ends before starts at the same instant.
        ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut times = Vec::with_capacity(ev.len());
        let mut count = Vec::with_capacity(ev.len());
        let mut area = Vec::with_capacity(ev.len());
        let (mut c, mut a, mut last) = (0.0f64, 0.0f64, f64::NAN);
        for (t, d) in ev {
            if last.is_finite() {
                a += c * (t - last);
            }
            c += d;
            last = t;
            times.push(t);
            count.push(c);
            area.push(a);
        }
        let mut prefills: Vec<(f64, f64, f64)> =
            lines.iter().map(|l| (l.start, l.first, l.prompt)).collect();
        prefills.sort_by(|a, b| a.0.total_cmp(&b.0));
        let longest = prefills.iter().map(|p| p.1 - p.0).fold(0.0f64, f64::max);
        Load {
            times,
            count,
            area,
            prefills,
            longest,
        }
    }

    /// Index of the last event at or before `t`.
    fn at(&self, t: f64) -> Option<usize> {
        let i = self.times.partition_point(|x| *x <= t);
        i.checked_sub(1)
    }

    /// Requests running at `t` (after any that start or end exactly then).
    fn count_at(&self, t: f64) -> f64 {
        self.at(t)
            .and_then(|i| self.count.get(i).copied())
            .unwrap_or(0.0)
    }

    fn integral_to(&self, t: f64) -> f64 {
        match self.at(t) {
            Some(i) => self.area[i] + self.count[i] * (t - self.times[i]),
            None => 0.0,
        }
    }

    /// Mean number running over `[a, b]`.
    fn mean(&self, a: f64, b: f64) -> f64 {
        if b <= a {
            return self.count_at(a);
        }
        (self.integral_to(b) - self.integral_to(a)) / (b - a)
    }

    /// Prompts prefilled during `[a, b]` and their tokens: each prompt
    /// spread evenly over its prefill (start to first token) and counted
    /// by the share of it inside the span. (Counting only the prompts that
    /// started inside a line's decode missed those still prefilling when it
    /// began, and the engine's time per token of work, prompt or decode,
    /// measured flat across loads once they were counted.)
    fn prefilling(&self, a: f64, b: f64) -> (f64, f64) {
        if b <= a {
            return (0.0, 0.0);
        }
        let from = self.prefills.partition_point(|p| p.0 < a - self.longest);
        let (mut n, mut tokens) = (0.0, 0.0);
        for &(start, first, prompt) in &self.prefills[from..] {
            if start >= b {
                break;
            }
            let span = first - start;
            if span <= 0.0 {
                continue;
            }
            let inside = ((b.min(first) - a.max(start)) / span).clamp(0.0, 1.0);
            n += inside;
            tokens += prompt * inside;
        }
        (n, tokens)
    }
}

/// The observations of a group's lines (in start order) on `replicas`.
///
/// Where every line names the replica it ran on (a gateway's log since the
/// `replica` field), its batch is the lines that ran on that replica.
/// Otherwise the pool's running lines are spread evenly over its replicas:
/// an average that reads half a sequence where one replica ran one and the
/// other none.
fn observations(lines: &[Line], replicas: usize) -> Vec<Obs> {
    let n = lines.len().max(1) as f64;
    let ctx = lines.iter().map(|l| l.prompt + l.output / 2.0).sum::<f64>() / n;
    let named: Option<Vec<u32>> = lines.iter().map(|l| l.replica).collect();
    let Some(named) = named else {
        let load = Load::new(lines);
        let r = replicas.max(1) as f64;
        return lines.iter().map(|l| observe(l, &load, r, ctx)).collect();
    };
    let mut own: BTreeMap<u32, Vec<Line>> = BTreeMap::new();
    for (l, id) in lines.iter().zip(&named) {
        own.entry(*id).or_default().push(*l);
    }
    let loads: BTreeMap<u32, Load> = own
        .into_iter()
        .map(|(id, ls)| (id, Load::new(&ls)))
        .collect();
    // In start order, as the lines came (the held-back third is every
    // third of them).
    lines
        .iter()
        .zip(&named)
        .filter_map(|(l, id)| loads.get(id).map(|load| observe(l, load, 1.0, ctx)))
        .collect()
}

/// The observation of line `l` among running counts `load`, spread over
/// `r` replicas, with `ctx` the pool's mean context per sequence.
fn observe(l: &Line, load: &Load, r: f64, ctx: f64) -> Obs {
    // Itself is running at its start: the others are the batch.
    let b0 = ((load.count_at(l.start) - 1.0).max(0.0)) / r;
    let others = (load.mean(l.first, l.end) - 1.0).max(0.0);
    let bbar = 1.0 + others / r;
    let (m, tokens) = load.prefilling(l.first, l.end);
    let steps = (l.output - 1.0).max(0.0);
    let itl = (steps >= 1.0).then(|| (l.end - l.first) / steps);
    Obs {
        prompt: l.prompt.max(1.0),
        b0,
        c0: b0 * ctx,
        bbar,
        cbar: bbar * ctx,
        m: m / r,
        pbar: if m > 0.0 { tokens / m } else { 0.0 },
        n: steps,
        ttft: l.first - l.start,
        itl: itl.filter(|t| *t > 0.0),
    }
}

/// Squared log error, capped so that a few wild lines cannot pull the fit.
fn loss(pred: f64, t: f64) -> f64 {
    let x = (pred / t).ln();
    if x.is_finite() {
        (x * x).min(4.0)
    } else {
        4.0
    }
}

fn objective(rates: &Rates, s: &Shape, obs: &[Obs]) -> f64 {
    obs.iter()
        .map(|o| {
            let t = loss(rates.ttft(s, o), o.ttft);
            let d = o.itl.map_or(0.0, |i| loss(rates.itl(s, o), i));
            t + d
        })
        .sum()
}

/// The fitted parameters, in log space: bandwidth, compute, step
/// overhead, per-sequence overhead.
const PARAMS: usize = 4;

fn rates_of(x: &[f64; PARAMS]) -> Rates {
    Rates {
        bandwidth: x[0].exp(),
        flops: x[1].exp(),
        overhead: x[2].exp(),
        per_seq: x[3].exp(),
    }
}

/// Nelder–Mead over `x` (log rates), `iters` iterations from a simplex of
/// `step` around `x0`.
fn nelder_mead<const N: usize>(
    f: &dyn Fn(&[f64; N]) -> f64,
    x0: [f64; N],
    step: f64,
    iters: usize,
) -> [f64; N] {
    let mut pts: Vec<([f64; N], f64)> = Vec::with_capacity(N + 1);
    pts.push((x0, f(&x0)));
    for i in 0..N {
        let mut x = x0;
        x[i] += step;
        pts.push((x, f(&x)));
    }
    for _ in 0..iters {
        pts.sort_by(|a, b| a.1.total_cmp(&b.1));
        let (best, worst) = (pts[0].1, pts[N].1);
        if (worst - best).abs() <= 1e-12 * (1.0 + best.abs()) {
            break;
        }
        let mut c = [0.0; N];
        for p in &pts[..N] {
            for (cj, pj) in c.iter_mut().zip(p.0.iter()) {
                *cj += pj / N as f64;
            }
        }
        let along = |t: f64| -> [f64; N] {
            let mut x = [0.0; N];
            for j in 0..N {
                x[j] = c[j] + t * (pts[N].0[j] - c[j]);
            }
            x
        };
        let xr = along(-1.0);
        let fr = f(&xr);
        if fr < pts[0].1 {
            let xe = along(-2.0);
            let fe = f(&xe);
            pts[N] = if fe < fr { (xe, fe) } else { (xr, fr) };
        } else if fr < pts[N - 1].1 {
            pts[N] = (xr, fr);
        } else {
            let xc = if fr < pts[N].1 {
                along(-0.5)
            } else {
                along(0.5)
            };
            let fc = f(&xc);
            if fc < pts[N].1.min(fr) {
                pts[N] = (xc, fc);
            } else {
                let b = pts[0].0;
                for p in pts.iter_mut().skip(1) {
                    for (pj, bj) in p.0.iter_mut().zip(b.iter()) {
                        *pj = bj + 0.5 * (*pj - bj);
                    }
                    p.1 = f(&p.0);
                }
            }
        }
    }
    pts.sort_by(|a, b| a.1.total_cmp(&b.1));
    pts[0].0
}

/// How far (a factor) the fitted rates may move from the cost model's:
/// beyond it a rate only stands for "never the bound" (a device whose steps
/// are all compute-bound fits any bandwidth above some value), and the
/// file would carry absurd figures.
const MAX_RATE_FACTOR: f64 = 1e4;

/// How strongly a fit may be pulled toward the cost model's rates: the
/// fitting loss gets `w × Σ (ln fitted − ln before)²` over the three rates,
/// a prior that weighs against a few lines and fades against many. Tried
/// in this order (free first), then the cost model's own rates; a later
/// one is kept only where its error on the held-back lines is lower by more
/// than [`HELD_GAIN`].
///
/// Why: a log of a few dozen lines from a noisy engine (a CPU llama.cpp
/// on a shared machine) fitted freely can be far off the engine's own
/// load: CI saw a fit 2-5x too slow on the very load it was fitted on, and
/// here the held-back lines said so (TTFT error 10% before, 45% after)
/// while the fit was written anyway. Now a fit is written only where it
/// beats the figures it started from on lines it did not see.
const PRIOR_WEIGHTS: [f64; 4] = [0.0, 0.3, 3.0, 30.0];

/// The share by which a more cautious choice must lower the held-back
/// loss to be kept: less is noise between near-equal fits (the rates trade
/// off against each other along a flat valley).
const HELD_GAIN: f64 = 0.02;

/// Fits `(B, F, o)` to observations, starting from `start` and pulled
/// toward it with `prior_weight` ([`PRIOR_WEIGHTS`]).
fn fit_rates(s: &Shape, obs: &[Obs], start: &Rates, prior_weight: f64) -> Rates {
    let ln = |v: f64, floor: f64| v.max(floor).ln();
    let x0 = [
        ln(start.bandwidth, 1.0),
        ln(start.flops, 1.0),
        ln(start.overhead, 1e-6),
        ln(start.per_seq, 1e-6),
    ];
    let span = MAX_RATE_FACTOR.ln();
    let lo = [x0[0] - span, x0[1] - span, 1e-7f64.ln(), 1e-7f64.ln()];
    let hi = [x0[0] + span, x0[1] + span, 10.0f64.ln(), 10.0f64.ln()];
    let clamp = |x: &[f64; PARAMS]| -> [f64; PARAMS] {
        let mut y = *x;
        for (i, v) in y.iter_mut().enumerate() {
            *v = v.clamp(lo[i], hi[i]);
        }
        y
    };
    let pull = prior_weight.max(0.0);
    let f = |x: &[f64; PARAMS]| {
        let y = clamp(x);
        // The pull is on the three roofline figures: the per-sequence
        // cost starts at 0 (none) for most devices, where a pull in log
        // space would hold it there at any weight.
        let away: f64 = y[..3]
            .iter()
            .zip(x0[..3].iter())
            .map(|(a, b)| (a - b) * (a - b))
            .sum();
        objective(&rates_of(&y), s, obs) + pull * away
    };
    let mut x = clamp(&x0);
    // A device may be orders of magnitude off the cost model's figures:
    // scale both rates together first, on a coarse grid.
    let mut best = (f(&x), x);
    for k in -12..=12 {
        for ko in [-4.0, -2.0, 0.0, 2.0, 4.0] {
            // The per-sequence cost: as it starts, or 0.3 ms, 3 ms, 30 ms.
            for ks in [x[3], 3e-4f64.ln(), 3e-3f64.ln(), 3e-2f64.ln()] {
                let shift = f64::from(k) * 0.75;
                let y = clamp(&[x[0] + shift, x[1] + shift, x[2] + ko, ks]);
                let v = f(&y);
                if v < best.0 {
                    best = (v, y);
                }
            }
        }
    }
    x = best.1;
    for step in [1.5, 0.5, 0.2, 0.05] {
        x = clamp(&nelder_mead(&f, x, step, 400));
    }
    rates_of(&x)
}

/// A line this many times slower than the fit, start to end on its
/// replica, is taken for noise and left out of the next pass. (End to end:
/// a clean log has first tokens 2x off the fit, where a prompt met a
/// long prefill the averages do not see; its end-to-end times stay
/// within about 15%.)
const SLOWED: f64 = 1.5;

/// Refits after leaving out slowed lines at most this many times.
const ROBUST_PASSES: usize = 4;

/// Whether a line ran far slower than `rates` say it should.
fn slowed(rates: &Rates, s: &Shape, o: &Obs) -> bool {
    let (measured, predicted) = end_to_end(rates, s, o);
    measured > SLOWED * predicted
}

/// [`fit_rates`], then again without the lines the fit finds [`SLOWED`]
/// (from all of them each pass, so a line can come back), until they stop
/// changing. An engine's noise is one-sided: a neighbour, a GC pause, a
/// swapped page only ever slow a step. The squared error follows those
/// slow lines, so a fit on a busy machine came out slower than the engine
/// on most of its own lines (CI saw 2-5x on the very load it was fitted
/// on; three lines in ten slowed 2.5-4x made a fit 1.4x too slow on the
/// other seven). More than half the lines slowed is not noise: the fit
/// keeps them.
fn fit_robust(s: &Shape, obs: &[Obs], start: &Rates, prior_weight: f64) -> Rates {
    let mut rates = fit_rates(s, obs, start, prior_weight);
    let mut left_out = 0;
    for _ in 0..ROBUST_PASSES {
        let kept: Vec<Obs> = obs
            .iter()
            .filter(|o| !slowed(&rates, s, o))
            .copied()
            .collect();
        let out = obs.len() - kept.len();
        if out == left_out || kept.len() * 2 < obs.len() {
            break;
        }
        left_out = out;
        rates = fit_rates(s, &kept, start, prior_weight);
    }
    rates
}

/// How a choice of rates does on held-back lines: the median absolute log
/// error of the first token plus that of the inter-token time (what the
/// report prints, as ratios). A median, so that the lines a neighbour
/// slowed do not choose the slow fit that [`fit_robust`] avoided.
fn held_score(rates: &Rates, s: &Shape, held: &[Obs]) -> f64 {
    let med = |v: Vec<f64>| Stat::of(v).median;
    let ttft = held
        .iter()
        .map(|o| (rates.ttft(s, o) / o.ttft).ln().abs())
        .collect();
    let itl = held
        .iter()
        .filter_map(|o| o.itl.map(|i| (rates.itl(s, o) / i).ln().abs()))
        .collect();
    med(ttft) + med(itl)
}

/// A rate the lines never found binding is written as its datasheet
/// figure (utilisation 1), or the lowest value above it that fits as
/// well, not as whatever the fit drifted to: a CPU engine whose every
/// step is compute-bound fits any bandwidth above some value, and one 10⁴
/// times the sheet's made `time_factor` 10⁻⁴ and every other figure in the
/// file 10⁴ times too large (the same model, written so that nobody could
/// read it). Lowered only as far as the fitting loss stays within a
/// thousandth.
fn never_the_bound(rates: Rates, s: &Shape, obs: &[Obs], bandwidth: f64, flops: f64) -> Rates {
    let loss = |r: &Rates| objective(r, s, obs);
    let within = loss(&rates) * 1.001 + 1e-12;
    // The lowest value (down to the sheet's) at which the loss holds:
    // bisection in log space between the sheet and the fit.
    let lowest = |fitted: f64, sheet: f64, with: &dyn Fn(f64) -> Rates| -> f64 {
        if !(sheet > 0.0 && fitted > sheet) {
            return fitted;
        }
        if loss(&with(sheet)) <= within {
            return sheet;
        }
        let (mut lo, mut hi) = (sheet.ln(), fitted.ln());
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if loss(&with(mid.exp())) <= within {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi.exp()
    };
    let bandwidth = lowest(rates.bandwidth, bandwidth, &|b| Rates {
        bandwidth: b,
        ..rates
    });
    let rates = Rates { bandwidth, ..rates };
    let flops = lowest(rates.flops, flops, &|f| Rates { flops: f, ..rates });
    Rates { flops, ..rates }
}

/// Significant digits kept in the file.
fn sig(v: f64) -> f64 {
    format!("{v:.5e}").parse().unwrap_or(v)
}

/// Fits the cost model of every (pool, model, variant) with enough served
/// lines in `records` (a policy's decision logs, any order), relative to
/// `base` (the calibration the cost model `cost` was built with, if any),
/// and returns the report and `base` with the fitted variants' factors set.
/// `malformed` is the number of lines the reader skipped.
pub fn calibrate_from_log(
    g: &DecisionGraph,
    cost: &CostModel,
    base: Option<&Calibration>,
    records: &[Record],
    malformed: usize,
) -> Result<FromLog, FromLogError> {
    let mut skipped = Skipped {
        malformed,
        ..Skipped::default()
    };
    let mut groups: BTreeMap<(u16, u16, u16), Vec<Line>> = BTreeMap::new();
    let mut usable = 0;
    for r in records {
        let Some(l) = line_of(r, &mut skipped) else {
            continue;
        };
        let key = r
            .decision
            .as_ref()
            .and_then(|d| d.route.as_deref())
            .and_then(|route| resolve(g, route));
        match key.filter(|(m, v, p)| cost.replica(*m, *v, *p).is_some()) {
            Some(k) => {
                usable += 1;
                groups.entry(k).or_default().push(l);
            }
            None => skipped.unknown_route += 1,
        }
    }
    let plan = crate::backend::deploy::simulated(g, cost);
    let mut calibration = base.cloned().unwrap_or_default();
    let mut fits = Vec::new();
    let mut notes = Vec::new();
    let mut written: BTreeMap<(u16, u16), usize> = BTreeMap::new();
    for ((m, v, p), mut lines) in groups {
        let Some(replica) = cost.replica(m, v, p) else {
            continue;
        };
        if lines.len() < MIN_LINES {
            skipped.too_few += lines.len();
            continue;
        }
        lines.sort_by(|a, b| a.start.total_cmp(&b.start));
        let replicas = plan
            .replicas
            .iter()
            .filter(|s| s.pool == p && s.model == m && s.variant == v)
            .count()
            .max(1);
        let obs = observations(&lines, replicas);
        // Every third line is held back.
        let mut train = Vec::with_capacity(obs.len());
        let mut held = Vec::with_capacity(obs.len() / 3 + 1);
        for (i, o) in obs.iter().enumerate() {
            if i % 3 == 2 {
                held.push(*o);
            } else {
                train.push(*o);
            }
        }
        let shape = Shape::of(replica);
        let before_rates = Rates::of(replica);
        // The free fit, or one pulled toward the cost model's rates, or
        // those rates themselves: each only if clearly better on the
        // held-back lines than the choice before it.
        let held_loss = |r: &Rates| held_score(r, &shape, &held);
        // PRIOR_WEIGHTS[0] is the free fit (no pull).
        let free = fit_robust(&shape, &train, &before_rates, PRIOR_WEIGHTS[0]);
        let mut choice = (held_loss(&free), free, Some(PRIOR_WEIGHTS[0]));
        let cautious = PRIOR_WEIGHTS[1..]
            .iter()
            .map(|&w| (fit_robust(&shape, &train, &before_rates, w), Some(w)))
            .chain(std::iter::once((before_rates, None)));
        for (r, w) in cautious {
            let l = held_loss(&r);
            if l < choice.0 * (1.0 - HELD_GAIN) {
                choice = (l, r, w);
            }
        }
        let (_, rates, prior_weight) = choice;
        let tp = f64::from(replica.tp.max(1));
        let rates = never_the_bound(
            rates,
            &shape,
            &train,
            tp * replica.gpu.hbm_bandwidth,
            tp * compute_rate(&replica.gpu, replica.precision),
        );
        let mut mbu = rates.bandwidth / (tp * replica.gpu.hbm_bandwidth);
        let mut mfu = rates.flops / (tp * compute_rate(&replica.gpu, replica.precision));
        let mut overhead = rates.overhead;
        let mut per_seq = rates.per_seq;
        let top = mbu.max(mfu);
        let time_factor = if top > 1.0 { sig(1.0 / top) } else { 1.0 };
        if time_factor < 1.0 {
            mbu = (mbu * time_factor).min(1.0);
            mfu = (mfu * time_factor).min(1.0);
            overhead /= time_factor;
            per_seq /= time_factor;
            notes.push(format!(
                "{}.{} on {}: the fitted rates beat the {} figures ({:.4e} B/s, {:.4e} FLOP/s); written as time_factor {} with factors ≤ 1",
                replica.model_name,
                replica.variant_name,
                replica.pool_name,
                replica.gpu.name,
                rates.bandwidth,
                rates.flops,
                time_factor
            ));
        }
        let (mbu, mfu) = (sig(mbu).clamp(1e-9, 1.0), sig(mfu).clamp(1e-9, 1.0));
        let step_overhead_ms = sig(overhead * 1e3).max(0.0);
        // Below a microsecond it is the fit's floor, not a cost: not written.
        let seq_overhead_ms = Some(sig(per_seq * 1e3)).filter(|v| *v >= 1e-3);
        let mean_queue_ms =
            lines.iter().map(|l| l.queue).sum::<f64>() / lines.len().max(1) as f64 * 1e3;
        let mean_batch =
            held.iter().chain(&train).map(|o| o.bbar).sum::<f64>() / obs.len().max(1) as f64;
        let fit = GroupFit {
            pool: replica.pool_name.clone(),
            model: replica.model_name.clone(),
            variant: replica.variant_name.clone(),
            gpu: replica.gpu.name.clone(),
            replicas,
            lines: lines.len(),
            fitted: train.len(),
            held_back: held.len(),
            before: errors(&before_rates, &shape, &held),
            after: errors(&rates, &shape, &held),
            before_rates,
            rates,
            mbu,
            mfu,
            step_overhead_ms,
            seq_overhead_ms,
            time_factor,
            prior_weight,
            mean_queue_ms,
            mean_batch,
        };
        // The file has one table per variant: a variant logged on several
        // pools keeps the fit with the most lines.
        let slot = written.entry((m, v)).or_insert(usize::MAX);
        if *slot == usize::MAX
            || fits
                .get(*slot)
                .is_some_and(|f: &GroupFit| f.lines < fit.lines)
        {
            if *slot != usize::MAX {
                notes.push(format!(
                    "{}.{} was logged on several pools; the file keeps the fit on {} (most lines)",
                    fit.model, fit.variant, fit.pool
                ));
            }
            let mo = calibration.models.entry(fit.model.clone()).or_default();
            let vo = mo
                .variants
                .entry(fit.variant.clone())
                .or_insert_with(VariantOverride::default);
            vo.mbu = Some(fit.mbu);
            vo.mfu = Some(fit.mfu);
            vo.step_overhead_ms = Some(fit.step_overhead_ms);
            vo.seq_overhead_ms = fit.seq_overhead_ms;
            vo.time_factor = (fit.time_factor < 1.0).then_some(fit.time_factor);
            *slot = fits.len();
        }
        fits.push(fit);
    }
    if fits.is_empty() {
        return Err(FromLogError::TooFewLines {
            lines: usable,
            malformed: skipped.malformed,
        });
    }
    Ok(FromLog {
        report: Report {
            lines: records.len() + malformed,
            skipped,
            groups: fits,
            notes,
        },
        calibration,
    })
}

fn pct(v: f64) -> String {
    let v = v * 100.0;
    if v.abs() < 0.05 {
        "0.0%".into()
    } else {
        format!("{v:.1}%")
    }
}

/// The human report.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kiln calibrate --from-log: {} lines, {} fitted groups, {} lines skipped",
        r.lines,
        r.groups.len(),
        r.skipped.total()
    );
    let k = &r.skipped;
    if k.total() > 0 {
        let _ = writeln!(
            s,
            "skipped: {} malformed, {} not served, {} without timings, {} with impossible timings, {} of unknown routes, {} in groups under {MIN_LINES} lines",
            k.malformed, k.not_served, k.no_timing, k.bad_timing, k.unknown_route, k.too_few
        );
    }
    for g in &r.groups {
        let _ = writeln!(
            s,
            "\n{}.{} on pool {} ({}): {} lines on {} replica(s), mean decode batch {:.2} per replica, mean queue in kiln {:.1} ms",
            g.model, g.variant, g.pool, g.gpu, g.lines, g.replicas, g.mean_batch, g.mean_queue_ms
        );
        let _ = writeln!(
            s,
            "  fit on {} lines: bandwidth {:.4e} B/s, compute {:.4e} FLOP/s, step overhead {:.3} ms, per decoding sequence {:.3} ms (before: {:.4e} B/s, {:.4e} FLOP/s, {:.3} ms, {:.3} ms)",
            g.fitted,
            g.rates.bandwidth,
            g.rates.flops,
            g.rates.overhead * 1e3,
            g.rates.per_seq * 1e3,
            g.before_rates.bandwidth,
            g.before_rates.flops,
            g.before_rates.overhead * 1e3,
            g.before_rates.per_seq * 1e3
        );
        let _ = match g.prior_weight {
            Some(0.0) => writeln!(
                s,
                "  kept: the free fit, by its error on the held-back lines (also tried: pulls {:?} toward the figures before, and those figures)",
                &PRIOR_WEIGHTS[1..]
            ),
            Some(w) => writeln!(
                s,
                "  kept: the fit with pull {w} toward the figures before (tried {PRIOR_WEIGHTS:?}), by its error on the held-back lines"
            ),
            None => writeln!(
                s,
                "  kept: the figures before; they had clearly less error on the held-back lines than every fit (pulls {PRIOR_WEIGHTS:?} toward them)"
            ),
        };
        let _ = writeln!(
            s,
            "  written: mbu {}, mfu {}, step_overhead_ms {}{}{}",
            g.mbu,
            g.mfu,
            g.step_overhead_ms,
            g.seq_overhead_ms
                .map(|v| format!(", seq_overhead_ms {v}"))
                .unwrap_or_default(),
            if g.time_factor < 1.0 {
                format!(", time_factor {}", g.time_factor)
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            s,
            "  error on {} held-back lines     before (median / p90)    after (median / p90)",
            g.held_back
        );
        let row = |s: &mut String, what: &str, b: &Stat, a: &Stat| {
            let _ = writeln!(
                s,
                "    {what:<28} {:>8} / {:<8}        {:>8} / {:<8}",
                pct(b.median),
                pct(b.p90),
                pct(a.median),
                pct(a.p90)
            );
        };
        row(&mut s, "TTFT on the replica", &g.before.ttft, &g.after.ttft);
        row(&mut s, "inter-token time", &g.before.itl, &g.after.itl);
        row(
            &mut s,
            "end-to-end on the replica",
            &g.before.e2e,
            &g.after.e2e,
        );
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

#[cfg(test)]
mod tests;
