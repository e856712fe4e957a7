//! `kiln plan`: the fewest GPUs per pool at which every tier meets its SLOs
//! on the recorded traffic, with headroom, found by replaying it.
//!
//! **Units.** A pool is sized in *rounds*: one round is one replica of each
//! variant the planner places there ([`Plan::from_graph`] places whole
//! gangs round-robin), so a round is `gpus_per_replica` GPUs for a pool
//! serving one variant. GPUs left over that cannot hold a whole round would
//! sit idle, so the plan never asks for them.
//!
//! **Search** (deterministic, [`search`]): start at the policy's counts; if
//! they fail, double every pool until the verdict passes or the upper bound
//! ([`Options::max_gpus_per_pool`], at most [`limits::MAX_POOL_GPUS`])
//! fails too. Then coordinate descent:
//! for each pool in declaration order, holding the others, try one round
//! fewer; when that passes, binary search the smallest passing count below.
//! Passes repeat until none shrinks, so at the end each pool one round
//! smaller fails with the others as planned. This is a local minimum,
//! not a global one: a cheaper split of load between pools (shrinking one
//! only after growing another) is not explored, and the verdict is assumed
//! monotone in each pool's size. Every evaluated point is cached, and the
//! replays are bounded by [`Options::max_replays`].
//!
//! [`Plan::from_graph`]: crate::sched::plan::Plan::from_graph

use crate::backend::cost::{CostModel, GpuSpec};
use crate::graph::{limits, DecisionGraph};
use crate::replay::capacity::{self, Thresholds, Verdict};
use crate::replay::report::Report;
use crate::replay::{self, PoolUse};
use crate::traffic::Record;
use crate::{chart, table};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// Hours in the month costs are quoted for (365 × 24 / 12).
pub const HOURS_PER_MONTH: f64 = 730.0;

/// Why a plan cannot be made.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum PlanError {
    #[error("--gpu-kind names pool `{pool}`, which the policy does not declare")]
    #[diagnostic(code(kiln::plan::pool), help("the policy's pools: {known}"))]
    UnknownPool { pool: String, known: String },
    #[error("--gpu-kind `{arg}`: expected POOL=KIND")]
    #[diagnostic(
        code(kiln::plan::gpu_kind),
        help("for example --gpu-kind h100=H200-SXM")
    )]
    BadGpuKind { arg: String },
    #[error("unknown GPU kind `{kind}` for pool `{pool}`")]
    #[diagnostic(code(kiln::plan::kind), help("kinds kiln knows: {known}"))]
    UnknownKind {
        pool: String,
        kind: String,
        known: String,
    },
    #[error("{what} must be {range}, got {got}")]
    #[diagnostic(code(kiln::plan::range), help("{help}"))]
    OutOfRange {
        what: &'static str,
        range: &'static str,
        got: String,
        help: &'static str,
    },
    #[error("the policy places no replica in any pool: nothing to size")]
    #[diagnostic(
        code(kiln::plan::empty),
        help("route tiers to variants whose `pools` list a pool with a GPU kind kiln knows")
    )]
    NothingToSize,
    #[error("tier `{tier}` misses its SLO even at {gpus} GPUs (the upper bound of the search)")]
    #[diagnostic(
        code(kiln::plan::infeasible),
        help("more GPUs do not help: look at the tier's SLO (a TTFT below one prefill of its prompts?), its quotas and its routes; `kiln simulate` shows why requests miss")
    )]
    Infeasible { tier: String, gpus: u32 },
    #[error("the replay budget ({replays} replays) ran out before any size passed")]
    #[diagnostic(code(kiln::plan::budget), help("raise --max-replays"))]
    Budget { replays: u32 },
}

/// What `kiln plan` is asked.
#[derive(Debug, Clone)]
pub struct Options {
    /// Spare capacity, 0.2 = 20%: the plan must pass at the arrival rate
    /// times `1 + headroom`.
    pub headroom: f64,
    /// Growth what-if: arrival times divided by this too.
    pub time_scale: f64,
    pub thresholds: Thresholds,
    /// `(pool, kind)`: replan the pool on another GPU kind.
    pub gpu_kinds: Vec<(String, String)>,
    pub max_replays: u32,
    /// The search's upper bound per pool (at most
    /// [`limits::MAX_POOL_GPUS`]).
    pub max_gpus_per_pool: u32,
    pub seed: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            headroom: 0.2,
            time_scale: 1.0,
            thresholds: Thresholds::default(),
            gpu_kinds: Vec::new(),
            max_replays: 40,
            max_gpus_per_pool: limits::MAX_POOL_GPUS,
            seed: 0,
        }
    }
}

impl Options {
    /// Refuses hostile figures: headroom 0–1000%, time scale in (0, 1000].
    pub fn validate(&self) -> Result<(), PlanError> {
        if !(self.headroom.is_finite() && (0.0..=10.0).contains(&self.headroom)) {
            return Err(PlanError::OutOfRange {
                what: "--headroom",
                range: "0% to 1000%",
                got: format!("{}%", self.headroom * 100.0),
                help: "write it as a percentage, like 20%",
            });
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0 && self.time_scale <= 1000.0) {
            return Err(PlanError::OutOfRange {
                what: "--time-scale",
                range: "above 0 and at most 1000",
                got: self.time_scale.to_string(),
                help: "2 replays the same requests in half the time (twice the load)",
            });
        }
        for t in [self.thresholds.ttft, self.thresholds.window] {
            if !(0.0..=1.0).contains(&t) {
                return Err(PlanError::OutOfRange {
                    what: "an SLO threshold",
                    range: "a share from 0 to 1",
                    got: t.to_string(),
                    help: "0.99 = 99% of a tier's requests meet the SLO",
                });
            }
        }
        Ok(())
    }

    /// The factor arrival times are divided by.
    pub fn scale(&self) -> f64 {
        (1.0 + self.headroom) * self.time_scale
    }
}

/// Parses `POOL=KIND`.
pub fn parse_gpu_kind(arg: &str) -> Result<(String, String), PlanError> {
    match arg.split_once('=') {
        Some((p, k)) if !p.trim().is_empty() && !k.trim().is_empty() => {
            Ok((p.trim().to_string(), k.trim().to_string()))
        }
        _ => Err(PlanError::BadGpuKind { arg: arg.into() }),
    }
}

/// Puts pools on other GPU kinds: `kind`, and the per-GPU memory the cost
/// model sizes KV capacity from, become the kind's datasheet figures.
pub fn apply_gpu_kinds(g: &mut DecisionGraph, kinds: &[(String, String)]) -> Result<(), PlanError> {
    for (pool, kind) in kinds {
        let known = g
            .pools
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let Some(p) = g.pools.iter_mut().find(|p| &p.name == pool) else {
            return Err(PlanError::UnknownPool {
                pool: pool.clone(),
                known,
            });
        };
        let Some(spec) = GpuSpec::builtin(kind) else {
            return Err(PlanError::UnknownKind {
                pool: pool.clone(),
                kind: kind.clone(),
                known: GpuSpec::builtins()
                    .into_iter()
                    .map(|s| s.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        };
        p.kind = kind.clone();
        p.gpu_memory = spec.memory;
    }
    Ok(())
}

// ---------------------------------------------------------------- search

/// Where the search over rounds ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Searched {
    /// Rounds per searched pool at the plan; `None` when no size passed.
    pub rounds: Option<Vec<u32>>,
    /// Every evaluated point, in order, with its verdict.
    pub points: Vec<(Vec<u32>, Verdict)>,
    /// The budget ran out: the plan passes but may not be minimal.
    pub budget_exhausted: bool,
    /// The verdict one round smaller in each pool (`None`: a pool at one
    /// round, or not evaluated when the budget ran out).
    pub smaller: Vec<Option<Verdict>>,
}

/// Finds rounds per pool where `eval` passes and each pool one round
/// smaller fails (see the module doc). `start` and `max` are rounds per
/// pool (at least 1); `eval` is called at most `budget` times, never twice
/// at one point.
pub fn search(
    start: &[u32],
    max: &[u32],
    budget: u32,
    mut eval: impl FnMut(&[u32]) -> Verdict,
) -> Searched {
    let n = start.len();
    let max: Vec<u32> = (0..n)
        .map(|i| max.get(i).copied().unwrap_or(1).max(1))
        .collect();
    let mut x: Vec<u32> = (0..n).map(|i| start[i].clamp(1, max[i])).collect();
    let mut cache: BTreeMap<Vec<u32>, Verdict> = BTreeMap::new();
    let mut points = Vec::new();
    let mut exhausted = false;
    let mut at = |y: &[u32], exhausted: &mut bool| -> Option<Verdict> {
        if let Some(v) = cache.get(y) {
            return Some(v.clone());
        }
        if points.len() as u32 >= budget {
            *exhausted = true;
            return None;
        }
        let v = eval(y);
        cache.insert(y.to_vec(), v.clone());
        points.push((y.to_vec(), v.clone()));
        Some(v)
    };
    // Grow until it passes.
    loop {
        match at(&x, &mut exhausted) {
            Some(v) if v.pass => break,
            Some(_) if x == max => {
                return Searched {
                    rounds: None,
                    points,
                    budget_exhausted: false,
                    smaller: vec![None; n],
                }
            }
            Some(_) => {
                for i in 0..n {
                    x[i] = x[i].saturating_mul(2).min(max[i]);
                }
            }
            None => {
                return Searched {
                    rounds: None,
                    points,
                    budget_exhausted: true,
                    smaller: vec![None; n],
                }
            }
        }
    }
    // Coordinate descent.
    'passes: loop {
        let mut changed = false;
        for i in 0..n {
            if x[i] <= 1 {
                continue;
            }
            let mut y = x.clone();
            y[i] -= 1;
            match at(&y, &mut exhausted) {
                None => break 'passes,
                Some(v) if !v.pass => continue,
                Some(_) => {}
            }
            // y passes: the smallest passing count is in (0, y[i]].
            let (mut lo, mut hi) = (0u32, y[i]);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                y[i] = mid;
                match at(&y, &mut exhausted) {
                    None => {
                        x[i] = hi;
                        break 'passes;
                    }
                    Some(v) if v.pass => hi = mid,
                    Some(_) => lo = mid,
                }
            }
            x[i] = hi;
            changed = true;
        }
        if !changed {
            break;
        }
    }
    let smaller = (0..n)
        .map(|i| {
            (x[i] > 1)
                .then(|| {
                    let mut y = x.clone();
                    y[i] -= 1;
                    cache.get(&y).cloned()
                })
                .flatten()
        })
        .collect();
    Searched {
        rounds: Some(x),
        points,
        budget_exhausted: exhausted,
        smaller,
    }
}

// ------------------------------------------------------------- the plan

/// One pool at the planned size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolPlan {
    pub pool: String,
    pub kind: String,
    /// GPUs the policy declares now.
    pub policy_gpus: u32,
    /// GPUs planned (whole rounds of replicas).
    pub gpus: u32,
    pub replicas: u32,
    /// GPUs one round of replicas takes (one replica of each variant placed
    /// here); the step the search moves in.
    pub gpus_per_round: u32,
    /// Whether the search sized this pool (false: no replica is placed on
    /// it, and it keeps the policy's count).
    pub searched: bool,
    /// Busy GPU-seconds over available GPU-seconds (pool GPUs × the run's
    /// duration), 0–1, in the replay at the planned size.
    pub busy: f64,
    /// Per GPU-hour: the tenants' `cost` rates, weighted by each tenant's
    /// GPU-seconds on this pool in the replay; `None` when no tenant that
    /// ran here states one.
    pub cost_per_gpu_hour: Option<f64>,
    /// GPUs × [`HOURS_PER_MONTH`] × `cost_per_gpu_hour`.
    pub cost_per_month: Option<f64>,
    /// The tier that fails first with one replica (round) fewer here; at
    /// one round, the tier with the least margin at the planned size among
    /// those that ran on this pool.
    pub binding_tier: Option<String>,
    /// The verdict with one round fewer in this pool, others as planned.
    pub one_smaller: Option<Check>,
}

/// A verdict at a size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub gpus: u32,
    pub replicas: u32,
    pub pass: bool,
    pub binding: Option<String>,
}

/// One point the search replayed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// GPUs per pool, in pool order.
    pub gpus: Vec<u32>,
    pub total_gpus: u32,
    pub pass: bool,
    pub binding: Option<String>,
    /// Per tier with an SLO: the lower of its TTFT and window attainment.
    pub attainment: BTreeMap<String, f64>,
}

/// A capacity plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityPlan {
    pub headroom: f64,
    pub time_scale: f64,
    /// Arrival times were divided by this: `(1 + headroom) × time_scale`.
    pub scale: f64,
    pub thresholds: BTreeMap<&'static str, f64>,
    pub gpu_kinds: BTreeMap<String, String>,
    pub pools: Vec<PoolPlan>,
    pub total_gpus: u32,
    pub policy_gpus: u32,
    pub cost_per_month: Option<f64>,
    /// Fleet-wide roofline load at the planned size (achieved over
    /// capacity) from the replay report.
    pub prefill_load: f64,
    pub decode_load: f64,
    /// Per tier at the planned size (see [`Point::attainment`]).
    pub attainment: BTreeMap<String, f64>,
    pub replays: u32,
    pub max_replays: u32,
    /// The budget ran out: the plan passes but one round fewer somewhere
    /// may pass too.
    pub budget_exhausted: bool,
    pub points: Vec<Point>,
}

/// A tier's attainment as [`capacity::judge`] judges it.
fn attainment(r: &Report) -> BTreeMap<String, f64> {
    r.tiers
        .iter()
        .filter_map(|t| {
            let a = match (t.ttft_attainment, t.window_attainment) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => a.or(b)?,
            };
            Some((t.name.clone(), a))
        })
        .collect()
}

/// The planner's view of one policy: which pools are sized and in what
/// steps, and a replay at any size.
pub struct Planner<'a> {
    graph: DecisionGraph,
    cost: &'a CostModel,
    records: &'a [Record],
    opts: Options,
    /// Pool index and GPUs per round of each searched pool.
    searched: Vec<(usize, u32)>,
}

impl<'a> Planner<'a> {
    /// `graph` already carries any `--gpu-kind` change, `cost` was built
    /// from it.
    pub fn new(
        graph: DecisionGraph,
        cost: &'a CostModel,
        records: &'a [Record],
        opts: Options,
    ) -> Result<Planner<'a>, PlanError> {
        opts.validate()?;
        // One round of every variant that may go on a pool: plan with room
        // for exactly that, and see what the planner places.
        let mut roomy = graph.clone();
        for (pi, p) in roomy.pools.iter_mut().enumerate() {
            let room: u32 = graph
                .models
                .iter()
                .flat_map(|m| &m.variants)
                .filter(|v| v.pools.iter().any(|&q| usize::from(q) == pi))
                .map(|v| v.gpus_per_replica)
                .fold(0u32, u32::saturating_add);
            p.gpus = room.min(limits::MAX_POOL_GPUS);
        }
        let plan = replay::plan(&roomy, cost);
        let mut searched = Vec::new();
        for pi in 0..graph.pools.len() {
            let mut seen: Vec<(u16, u16)> = Vec::new();
            let mut round = 0u32;
            for r in plan.replicas.iter().filter(|r| usize::from(r.pool) == pi) {
                if !seen.contains(&(r.model, r.variant)) {
                    seen.push((r.model, r.variant));
                    round = round.saturating_add(r.gpus);
                }
            }
            if round > 0 {
                searched.push((pi, round));
            }
        }
        if searched.is_empty() {
            return Err(PlanError::NothingToSize);
        }
        Ok(Planner {
            graph,
            cost,
            records,
            opts,
            searched,
        })
    }

    /// The graph with searched pools at `rounds`.
    fn sized(&self, rounds: &[u32]) -> DecisionGraph {
        let mut g = self.graph.clone();
        for (&(pi, unit), &k) in self.searched.iter().zip(rounds) {
            if let Some(p) = g.pools.get_mut(pi) {
                p.gpus = unit.saturating_mul(k).min(limits::MAX_POOL_GPUS);
            }
        }
        g
    }

    /// Replays at `rounds`; `progress` as [`replay::run`]'s.
    pub fn replay(
        &self,
        rounds: &[u32],
        progress: impl FnMut(usize, usize),
    ) -> (Arc<DecisionGraph>, Report, Vec<PoolUse>) {
        let g = Arc::new(self.sized(rounds));
        let cfg = crate::sched::Config {
            seed: self.opts.seed,
            ..crate::sched::Config::default()
        };
        let (r, u) = replay::replay_by_pool(
            &g,
            self.cost,
            self.records,
            cfg,
            "kiln",
            self.opts.scale(),
            progress,
        );
        (g, r, u)
    }

    fn replicas(&self, g: &DecisionGraph) -> Vec<u32> {
        let plan = replay::plan(g, self.cost);
        let mut n = vec![0u32; g.pools.len()];
        for r in &plan.replicas {
            if let Some(c) = n.get_mut(usize::from(r.pool)) {
                *c += 1;
            }
        }
        n
    }

    /// Searches and describes the plan. `progress(replay, done, total)`
    /// reports each replay's progress.
    pub fn plan(
        &self,
        mut progress: impl FnMut(u32, usize, usize),
    ) -> Result<CapacityPlan, PlanError> {
        let th = self.opts.thresholds;
        let start: Vec<u32> = self
            .searched
            .iter()
            .map(|&(pi, unit)| self.graph.pools[pi].gpus / unit.max(1))
            .collect();
        let max: Vec<u32> = self
            .searched
            .iter()
            .map(|&(_, unit)| {
                let cap = self.opts.max_gpus_per_pool.clamp(1, limits::MAX_POOL_GPUS);
                (cap / unit.max(1)).max(1)
            })
            .collect();
        let mut reports: Vec<(Vec<u32>, Report, Vec<PoolUse>)> = Vec::new();
        let mut n = 0u32;
        let found = search(&start, &max, self.opts.max_replays, |rounds| {
            n += 1;
            let (_, r, u) = self.replay(rounds, |d, t| progress(n, d, t));
            let v = capacity::judge(&r, th);
            reports.push((rounds.to_vec(), r, u));
            v
        });
        let gpus_at = |rounds: &[u32]| -> Vec<u32> {
            let g = self.sized(rounds);
            g.pools.iter().map(|p| p.gpus).collect()
        };
        let points: Vec<Point> = reports
            .iter()
            .zip(&found.points)
            .map(|((rounds, r, _), (_, v))| {
                let gpus = gpus_at(rounds);
                Point {
                    total_gpus: gpus.iter().sum(),
                    gpus,
                    pass: v.pass,
                    binding: v.binding.clone(),
                    attainment: attainment(r),
                }
            })
            .collect();
        let Some(rounds) = found.rounds.clone() else {
            if found.budget_exhausted {
                return Err(PlanError::Budget {
                    replays: found.points.len() as u32,
                });
            }
            let last = points.last();
            return Err(PlanError::Infeasible {
                tier: last
                    .and_then(|p| p.binding.clone())
                    .unwrap_or_else(|| "?".into()),
                gpus: last.map_or(0, |p| p.total_gpus),
            });
        };
        // The planned size was replayed (it passed); reuse that replay.
        let planned = reports
            .iter()
            .find(|(r, _, _)| *r == rounds)
            .map(|(_, r, u)| (r.clone(), u.clone()));
        let g = self.sized(&rounds);
        let (report, uses) = match planned {
            Some(x) => x,
            None => {
                let (_, r, u) = self.replay(&rounds, |_, _| {});
                (r, u)
            }
        };
        let verdict = capacity::judge(&report, th);
        let replicas = self.replicas(&g);
        let mut pools = Vec::new();
        for (pi, p) in g.pools.iter().enumerate() {
            let idx = self.searched.iter().position(|&(q, _)| q == pi);
            let unit = idx.map_or(0, |i| self.searched[i].1);
            let one_smaller = idx.and_then(|i| {
                let v = found.smaller.get(i)?.clone()?;
                let mut y = rounds.clone();
                y[i] -= 1;
                let gs = self.sized(&y);
                Some(Check {
                    gpus: gs.pools[pi].gpus,
                    replicas: self.replicas(&gs)[pi],
                    pass: v.pass,
                    binding: v.binding,
                })
            });
            let use_ = uses.get(pi).cloned().unwrap_or_default();
            let avail = f64::from(p.gpus) * report.duration_s;
            let busy = if avail > 0.0 {
                round3(use_.busy_gpu_seconds / avail)
            } else {
                0.0
            };
            let (mut w, mut ws) = (0.0, 0.0);
            for (t, s) in use_.tenant_gpu_seconds.iter().enumerate() {
                if let Some(rate) = g.tenants.get(t).and_then(|t| t.cost_per_gpu_hour) {
                    if *s > 0.0 {
                        w += s;
                        ws += s * rate;
                    }
                }
            }
            let rate = (w > 0.0).then(|| round3(ws / w));
            let binding_tier = match &one_smaller {
                Some(c) if !c.pass => c.binding.clone(),
                _ => capacity::least_margin(&report, th, |t| {
                    g.tier_id(t)
                        .and_then(|t| use_.tier_gpu_seconds.get(usize::from(t)))
                        .is_some_and(|s| *s > 0.0)
                })
                .map(|(_, tier)| tier)
                .or_else(|| verdict.binding.clone()),
            };
            pools.push(PoolPlan {
                pool: p.name.clone(),
                kind: p.kind.clone(),
                policy_gpus: self.graph.pools[pi].gpus,
                gpus: p.gpus,
                replicas: replicas[pi],
                gpus_per_round: unit,
                searched: idx.is_some(),
                busy,
                cost_per_gpu_hour: rate,
                cost_per_month: rate.map(|r| round3(f64::from(p.gpus) * HOURS_PER_MONTH * r)),
                binding_tier,
                one_smaller,
            });
        }
        let costs: Vec<f64> = pools.iter().filter_map(|p| p.cost_per_month).collect();
        Ok(CapacityPlan {
            headroom: self.opts.headroom,
            time_scale: self.opts.time_scale,
            scale: self.opts.scale(),
            thresholds: [("ttft", th.ttft), ("window", th.window)].into(),
            gpu_kinds: self.opts.gpu_kinds.iter().cloned().collect(),
            total_gpus: pools.iter().map(|p| p.gpus).sum(),
            policy_gpus: self.graph.pools.iter().map(|p| p.gpus).sum(),
            cost_per_month: (!costs.is_empty()).then(|| round3(costs.iter().sum())),
            prefill_load: report.prefill_load,
            decode_load: report.decode_load,
            attainment: attainment(&report),
            pools,
            replays: found.points.len() as u32,
            max_replays: self.opts.max_replays,
            budget_exhausted: found.budget_exhausted,
            points,
        })
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

// ------------------------------------------------------------- rendering

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn money(x: Option<f64>) -> String {
    x.map_or("-".into(), |c| format!("{c:.0}"))
}

fn verdict(c: &Option<Check>) -> String {
    match c {
        None => "- (one replica)".into(),
        Some(c) => format!(
            "{} at {} GPUs / {} replica{}{}",
            if c.pass { "PASSES" } else { "fails" },
            c.gpus,
            c.replicas,
            if c.replicas == 1 { "" } else { "s" },
            c.binding
                .as_ref()
                .filter(|_| !c.pass)
                .map_or(String::new(), |b| format!(" ({b})"))
        ),
    }
}

/// The plan as a table, for terminals or as markdown.
pub fn render(p: &CapacityPlan, markdown: bool) -> String {
    let mut s = String::new();
    let kinds = if p.gpu_kinds.is_empty() {
        String::new()
    } else {
        let k: Vec<String> = p
            .gpu_kinds
            .iter()
            .map(|(a, b)| format!("{a}={b}"))
            .collect();
        format!(", GPU kinds {}", k.join(", "))
    };
    let head = format!(
        "Capacity plan: {} GPUs (policy: {}), every tier at ≥{} TTFT / ≥{} window attainment at {:.2}× the recorded arrival rate (headroom {}, time scale {}{kinds}).",
        p.total_gpus,
        p.policy_gpus,
        pct(p.thresholds.get("ttft").copied().unwrap_or(0.0)),
        pct(p.thresholds.get("window").copied().unwrap_or(0.0)),
        p.scale,
        pct(p.headroom),
        p.time_scale,
    );
    let _ = writeln!(s, "{head}\n");
    let cols = [
        "pool",
        "kind",
        "GPUs",
        "replicas",
        "busy",
        "$/GPU-h",
        "$/month",
        "binding tier",
        "planned size",
        "one replica smaller",
    ];
    let rows: Vec<Vec<String>> = p
        .pools
        .iter()
        .map(|x| {
            vec![
                x.pool.clone(),
                x.kind.clone(),
                format!("{} (was {})", x.gpus, x.policy_gpus),
                format!("{} × {} GPUs", x.replicas, x.gpus_per_round),
                pct(x.busy),
                x.cost_per_gpu_hour
                    .map_or("-".into(), |r| format!("{r:.2}")),
                money(x.cost_per_month),
                x.binding_tier.clone().unwrap_or_else(|| "-".into()),
                if x.searched { "passes" } else { "not sized" }.into(),
                if x.searched {
                    verdict(&x.one_smaller)
                } else {
                    "-".into()
                },
            ]
        })
        .collect();
    if markdown {
        let _ = writeln!(s, "| {} |", cols.join(" | "));
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---|---|---|");
        for r in &rows {
            let _ = writeln!(s, "| {} |", r.join(" | "));
        }
    } else {
        let mut t = table::new(&cols.map(|c| (c, table::Left)));
        for r in rows {
            t.add_row(r);
        }
        s.push_str(&table::render(&t, ""));
    }
    let att: Vec<String> = p
        .attainment
        .iter()
        .map(|(t, a)| format!("{t} {}", pct(*a)))
        .collect();
    let _ = writeln!(
        s,
        "\nAt the planned size: SLO attainment {}; fleet prefill load {}, decode load {} (achieved over roofline capacity). Total cost per month: {}.",
        if att.is_empty() { "-".into() } else { att.join(", ") },
        pct(p.prefill_load),
        pct(p.decode_load),
        money(p.cost_per_month),
    );
    let _ = writeln!(
        s,
        "busy: GPU-seconds a step ran over the pool's GPU-seconds. $/GPU-h: tenants' `cost` rates weighted by their GPU-seconds on the pool; $/month = GPUs × {HOURS_PER_MONTH} h × that rate."
    );
    let _ = writeln!(
        s,
        "Search: {} of at most {} replays (coordinate descent over whole replicas per pool; a local minimum, not a global one){}.",
        p.replays,
        p.max_replays,
        if p.budget_exhausted {
            "; the budget ran out, so a pool may still shrink"
        } else {
            ""
        }
    );
    s
}

/// The plot: SLO attainment per tier against total GPUs, one dot per
/// evaluated point (filled: the point passed), the thresholds dashed and
/// labelled right of the plot, the planned size a dashed vertical line
/// labelled above it; the legend (one entry a tier) above the plot.
pub fn svg(p: &CapacityPlan) -> Result<String, chart::ChartError> {
    const COLORS: [chart::Rgb; 6] = [
        chart::Rgb(0x1f, 0x77, 0xb4),
        chart::Rgb(0xd6, 0x27, 0x28),
        chart::Rgb(0x2c, 0xa0, 0x2c),
        chart::Rgb(0x94, 0x67, 0xbd),
        chart::Rgb(0xff, 0x7f, 0x0e),
        chart::Rgb(0x17, 0xbe, 0xcf),
    ];
    let tiers: Vec<&String> = {
        let mut t: Vec<&String> = p.points.iter().flat_map(|x| x.attainment.keys()).collect();
        t.sort();
        t.dedup();
        t
    };
    let xmax = p
        .points
        .iter()
        .map(|x| x.total_gpus)
        .chain([p.total_gpus])
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let ymin = p
        .points
        .iter()
        .flat_map(|x| x.attainment.values())
        .chain(p.thresholds.values())
        .fold(0.9f64, |a, &b| a.min(b))
        .clamp(0.0, 0.9);
    let ymin = (ymin * 10.0).floor() / 10.0;
    let dots = tiers
        .iter()
        .enumerate()
        .map(|(ti, t)| chart::Dots {
            label: (*t).clone(),
            points: p
                .points
                .iter()
                .filter_map(|pt| {
                    pt.attainment
                        .get(*t)
                        .map(|a| (f64::from(pt.total_gpus), a.max(ymin), pt.pass))
                })
                .collect(),
            color: COLORS[ti % COLORS.len()],
        })
        .collect();
    let mut rules: Vec<chart::Rule> = p
        .thresholds
        .iter()
        .map(|(k, v)| chart::Rule {
            at: *v,
            vertical: false,
            label: format!("{k} {:.0}%", v * 100.0),
            color: chart::Rgb(0x88, 0x88, 0x88),
        })
        .collect();
    rules.push(chart::Rule {
        at: f64::from(p.total_gpus),
        vertical: true,
        label: format!("planned: {} GPUs", p.total_gpus),
        color: chart::Rgb(0x2c, 0xa0, 0x2c),
    });
    let panel = chart::Panel {
        title: format!(
            "SLO attainment per tier against total GPUs ({} replays)",
            p.replays
        ),
        x_desc: "total GPUs".into(),
        y_desc: "SLO attainment".into(),
        x: (0.0, xmax * 1.05),
        y: (ymin, 1.0),
        x_ticks: |g| format!("{g:.0}"),
        y_ticks: chart::percent,
        lines: Vec::new(),
        dots,
        rules,
        notes: vec!["filled: the plan passed at that size".into()],
    };
    chart::xy(560, 320, &[panel], &[])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pass_at(need: Vec<u32>) -> impl FnMut(&[u32]) -> Verdict {
        move |x| {
            let fail = x.iter().zip(&need).position(|(a, b)| a < b);
            Verdict {
                pass: fail.is_none(),
                binding: Some(format!("t{}", fail.unwrap_or(0))),
            }
        }
    }

    #[test]
    fn shrinks_each_pool_to_its_own_threshold() {
        let f = search(&[8, 8], &[4096, 4096], 64, pass_at(vec![3, 5]));
        assert_eq!(f.rounds, Some(vec![3, 5]));
        assert!(!f.budget_exhausted);
        let s: Vec<bool> = f.smaller.iter().map(|v| v.as_ref().unwrap().pass).collect();
        assert_eq!(s, vec![false, false]);
        assert_eq!(
            f.smaller[1].as_ref().unwrap().binding.as_deref(),
            Some("t1")
        );
        // Deterministic, and never the same point twice.
        let again = search(&[8, 8], &[4096, 4096], 64, pass_at(vec![3, 5]));
        assert_eq!(again, f);
        let mut pts: Vec<_> = f.points.iter().map(|(p, _)| p.clone()).collect();
        pts.sort();
        pts.dedup();
        assert_eq!(pts.len(), f.points.len());
    }

    #[test]
    fn grows_by_doubling_when_the_policy_fails() {
        let f = search(&[1, 2], &[100, 100], 64, pass_at(vec![7, 9]));
        assert_eq!(f.rounds, Some(vec![7, 9]));
        // 1,2 → 2,4 → 4,8 → 8,16: the first three fail.
        assert_eq!(f.points[3].0, vec![8, 16]);
        assert!(f.points[..3].iter().all(|(_, v)| !v.pass));
    }

    #[test]
    fn fails_at_the_upper_bound_and_names_the_tier() {
        let f = search(&[1], &[16], 64, pass_at(vec![17]));
        assert_eq!(f.rounds, None);
        assert!(!f.budget_exhausted);
        assert_eq!(f.points.last().unwrap().0, vec![16]);
        assert_eq!(f.points.last().unwrap().1.binding.as_deref(), Some("t0"));
    }

    #[test]
    fn the_budget_bounds_the_replays() {
        let f = search(&[64, 64], &[4096, 4096], 5, pass_at(vec![3, 40]));
        assert_eq!(f.points.len(), 5);
        assert!(f.budget_exhausted);
        // Whatever it returns passes.
        let r = f.rounds.unwrap();
        assert!(r[0] >= 3 && r[1] >= 40);
    }

    #[test]
    fn options_refuse_hostile_figures() {
        let bad = |o: Options| o.validate().is_err();
        assert!(bad(Options {
            headroom: -0.1,
            ..Options::default()
        }));
        assert!(bad(Options {
            headroom: 10.5,
            ..Options::default()
        }));
        assert!(bad(Options {
            time_scale: 0.0,
            ..Options::default()
        }));
        assert!(bad(Options {
            time_scale: f64::NAN,
            ..Options::default()
        }));
        assert!(bad(Options {
            time_scale: 1001.0,
            ..Options::default()
        }));
        assert!(Options::default().validate().is_ok());
        assert!((Options::default().scale() - 1.2).abs() < 1e-12);
        assert!(parse_gpu_kind("h100").is_err());
        assert_eq!(
            parse_gpu_kind("h100=H200-SXM").unwrap(),
            ("h100".into(), "H200-SXM".into())
        );
    }

    proptest! {
        // Random monotone predicates: per-pool minimums plus a joint
        // weighted-sum constraint (load that either pool can carry).
        #[test]
        fn found_size_passes_and_each_pool_one_smaller_fails(
            need in proptest::collection::vec(1u32..40, 1..4),
            weights in proptest::collection::vec(1u32..4, 3),
            total in 0u32..120,
            start in proptest::collection::vec(1u32..64, 3),
        ) {
            let n = need.len();
            let ok = |x: &[u32]| {
                x.iter().zip(&need).all(|(a, b)| a >= b)
                    && x.iter().zip(&weights).map(|(a, w)| a * w).sum::<u32>() >= total
            };
            let f = search(&start[..n], &vec![256; n], 400, |x| Verdict {
                pass: ok(x),
                binding: None,
            });
            let r = f.rounds.clone().expect("256 each always passes here");
            prop_assert!(ok(&r));
            prop_assert!(!f.budget_exhausted);
            for i in 0..n {
                if r[i] > 1 {
                    let mut y = r.clone();
                    y[i] -= 1;
                    prop_assert!(!ok(&y), "pool {} can shrink: {:?}", i, r);
                    prop_assert_eq!(f.smaller[i].as_ref().map(|v| v.pass), Some(false));
                }
            }
        }
    }
}
