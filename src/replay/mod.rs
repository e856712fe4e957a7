//! The replay simulator: recorded arrivals drive the scheduler core through
//! a discrete-event loop; replicas "run" steps for the time the cost model
//! gives. Same inputs, same output, bit for bit: events are ordered by time
//! and then by the order they were created.

pub mod capacity;
pub mod report;

use crate::driver::{Driver, Sink};
use crate::graph::{TenantId, TierId};
use crate::sched::{Action, Arrival, Event, Micros, ReqId, Scheduler};
use std::collections::HashMap;

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Outcome {
    pub id: ReqId,
    pub arrival: Micros,
    pub tier: Option<TierId>,
    pub tenant: Option<TenantId>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub started: Option<Micros>,
    pub first_token: Option<Micros>,
    pub finished: Option<Micros>,
    pub rejected: Option<(crate::sched::Reason, u16)>,
    pub preemptions: u32,
    pub fallback_step: Option<u8>,
    /// The replica it (last) started on.
    pub replica: Option<usize>,
    /// The (model, variant) of that replica: what it ran as.
    pub variant: Option<(u16, u16)>,
    /// The pool of that replica.
    pub pool: Option<crate::graph::PoolId>,
    /// Why it did not start on arrival, when it waited.
    pub waited_for: Option<crate::sched::Reason>,
    pub gpu_seconds: f64,
    /// The part of `gpu_seconds` that recomputed KV lost to a preemption.
    pub wasted_gpu_seconds: f64,
    /// When it had to be finished (its own window, a batch item's, or its
    /// tier's), µs on the replay clock.
    pub deadline: Option<Micros>,
    /// The batch it belongs to (its `x-kiln-batch` header), if any.
    pub batch: Option<String>,
    /// Answered from its tier's exact cache: started, first token and
    /// finished at its arrival, no replica, no GPU time.
    pub cache_hit: bool,
}

/// Runs every arrival (sorted by time) to completion or rejection.
/// `progress` is told how many arrivals have been fed so far.
pub fn run(
    sched: &mut Scheduler,
    arrivals: Vec<(Micros, Arrival)>,
    progress: impl FnMut(usize, usize),
) -> Vec<Outcome> {
    run_inner(sched, arrivals, progress, &mut |_: &Scheduler, _: u64| {})
}

/// The replay's [`Sink`]: each action written into its request's outcome.
struct Outcomes {
    outcomes: Vec<Outcome>,
    index: HashMap<ReqId, usize>,
}

impl Outcomes {
    fn get(&mut self, id: ReqId) -> Option<&mut Outcome> {
        let i = *self.index.get(&id)?;
        self.outcomes.get_mut(i)
    }
}

impl Sink for Outcomes {
    fn act(&mut self, t: Micros, action: &Action, sched: &Scheduler) {
        match *action {
            Action::Decided {
                id,
                tier,
                tenant,
                fallback_step,
                deadline,
            } => {
                if let Some(o) = self.get(id) {
                    o.tier = Some(tier);
                    o.tenant = tenant;
                    o.fallback_step = fallback_step;
                    o.deadline = deadline;
                }
            }
            Action::Reject {
                id, reason, status, ..
            } => {
                if let Some(o) = self.get(id) {
                    o.rejected = Some((reason, status));
                }
            }
            Action::Started {
                id,
                replica,
                waited_for,
            } => {
                if let Some(o) = self.get(id) {
                    if o.started.is_none() {
                        o.started = Some(t);
                        o.waited_for = waited_for;
                    }
                    o.replica = Some(replica);
                    let spec = sched.replicas().get(replica).map(|r| &r.spec);
                    o.variant = spec.map(|s| (s.model, s.variant));
                    o.pool = spec.map(|s| s.pool);
                }
            }
            Action::FirstToken { id } => {
                if let Some(o) = self.get(id) {
                    o.first_token = Some(t);
                }
            }
            Action::Finished {
                id,
                gpu_seconds,
                wasted_gpu_seconds,
            } => {
                if let Some(o) = self.get(id) {
                    o.finished = Some(t);
                    o.gpu_seconds = gpu_seconds;
                    o.wasted_gpu_seconds = wasted_gpu_seconds;
                }
            }
            Action::Preempted { id, .. } => {
                if let Some(o) = self.get(id) {
                    o.preemptions += 1;
                }
            }
            Action::CacheHit { id, .. } => {
                if let Some(o) = self.get(id) {
                    o.cache_hit = true;
                    o.started = Some(t);
                    o.first_token = Some(t);
                    o.finished = Some(t);
                }
            }
            // Timers are the driver's; the replay never cancels.
            Action::Step { .. }
            | Action::WakeAt(_)
            | Action::Cancelled { .. }
            | Action::CacheMiss { .. } => {}
        }
    }
}

fn run_inner(
    sched: &mut Scheduler,
    arrivals: Vec<(Micros, Arrival)>,
    mut progress: impl FnMut(usize, usize),
    observe: &mut dyn FnMut(&Scheduler, u64),
) -> Vec<Outcome> {
    let n = arrivals.len();
    let mut sink = Outcomes {
        outcomes: Vec::with_capacity(n),
        index: HashMap::with_capacity(n),
    };
    for (i, (t, a)) in arrivals.iter().enumerate() {
        sink.index.insert(a.id, i);
        sink.outcomes.push(Outcome {
            id: a.id,
            arrival: *t,
            prompt_tokens: a.request.prompt_tokens.min(u64::from(u32::MAX)) as u32,
            output_tokens: a.output_tokens,
            batch: a.request.batch().map(str::to_string),
            ..Outcome::default()
        });
    }
    let mut driver = Driver::new(&mut *sched);
    let mut pending = arrivals.into_iter().peekable();
    let mut fed = 0usize;
    loop {
        // At equal times arrivals go first: a timer fires once the clock
        // has passed its time (see the driver's order).
        let arrival_next = match (pending.peek(), driver.next_timer()) {
            (Some((at, _)), Some(t)) => *at <= t,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        // Observed before the event: the state the previous one left.
        observe(driver.sched(), driver.events() + 1);
        if arrival_next {
            let Some((at, a)) = pending.next() else { break };
            fed += 1;
            if fed.is_multiple_of(4096) {
                progress(fed, n);
            }
            driver.feed(at, Event::Arrive(a), &mut sink);
        } else {
            driver.fire_next(&mut sink);
        }
    }
    progress(n, n);
    sink.outcomes
}

/// Like [`run`], also sampling the VTC fairness measure (the largest gap in
/// weighted service between backlogged tenants of a tier) every 64 events;
/// returns the outcomes and the largest gap seen.
/// [`run`], calling `observe` with the scheduler before every event (for
/// tests and tools that watch the live signals as the replay goes).
pub fn run_observing(
    sched: &mut Scheduler,
    arrivals: Vec<(Micros, Arrival)>,
    observe: &mut dyn FnMut(&Scheduler, u64),
) -> Vec<Outcome> {
    run_inner(sched, arrivals, |_, _| {}, observe)
}

pub fn run_measured(
    sched: &mut Scheduler,
    arrivals: Vec<(Micros, Arrival)>,
    progress: impl FnMut(usize, usize),
) -> (Vec<Outcome>, f64) {
    let mut gap: f64 = 0.0;
    let outcomes = run_inner(sched, arrivals, progress, &mut |s: &Scheduler, i: u64| {
        if i.is_multiple_of(64) {
            gap = gap.max(s.service_gap());
        }
    });
    (outcomes, gap)
}

/// The deployment the replay runs: replicas placed by the policy's routes,
/// each with the roofline cost model of its GPU kind (the planner the
/// gateway uses, with every pool simulated).
pub fn plan(
    g: &crate::graph::DecisionGraph,
    cost: &crate::backend::cost::CostModel,
) -> crate::sched::plan::Plan {
    crate::backend::deploy::simulated(g, cost)
}

/// Turns recorded traffic into arrivals (ids are positions in the trace).
/// A batch item's `deadline_ms` becomes its own window: what is left of
/// its batch's window when it arrives.
pub fn arrivals(records: &[crate::traffic::Record]) -> Vec<(Micros, Arrival)> {
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let at_ms = r.at_ms.max(0.0);
            let at = (at_ms * 1000.0).round() as Micros;
            let window = r
                .deadline_ms
                .filter(|d| d.is_finite())
                .map(|d| ((d - at_ms).max(0.0) * 1000.0).round() as Micros);
            (
                at,
                Arrival {
                    window,
                    id: i as ReqId,
                    request: r.request(),
                    output_tokens: r.output_tokens.min(u64::from(u32::MAX)) as u32,
                    prefix_blocks: r.prefix_blocks.clone(),
                    quota_claimed: false,
                    fleet: None,
                    cache: r
                        .cache_key
                        .as_deref()
                        .and_then(crate::sched::cache::parse_key),
                    // A recording has no prompts to embed.
                    semantic: None,
                },
            )
        })
        .collect()
}

/// What the fleet did in a finished replay, for [`report::build`]: busy
/// GPU time, tokens prefilled and produced, and the roofline capacity of
/// the replicas that run their steps here (external upstreams excluded),
/// decode capacity at the run's mean context.
pub fn fleet(sched: &Scheduler, outcomes: &[Outcome], service_gap: f64) -> report::Fleet {
    let gpus: u32 = sched.graph().pools.iter().map(|p| p.gpus).sum();
    let n = outcomes.len().max(1) as f64;
    // Mean context a decoding sequence holds: its prompt and half its output.
    let context = outcomes
        .iter()
        .map(|o| f64::from(o.prompt_tokens) + f64::from(o.output_tokens) / 2.0)
        .sum::<f64>()
        / n;
    let kv_per_seq = outcomes
        .iter()
        .map(|o| f64::from(o.prompt_tokens) + f64::from(o.output_tokens))
        .sum::<f64>()
        / n;
    let rate = |tokens: f64, secs: f64| {
        if secs.is_finite() && secs > 0.0 && tokens.is_finite() {
            tokens / secs
        } else {
            0.0
        }
    };
    let mut f = report::Fleet {
        gpus,
        service_gap,
        ..report::Fleet::default()
    };
    for r in sched.replicas() {
        f.busy_gpu_seconds += r.busy_seconds * f64::from(r.spec.gpus);
        f.work_gpu_seconds += r.work_seconds * f64::from(r.spec.gpus);
        f.prefilled_tokens += r.prefilled_tokens;
        f.decoded_tokens += r.decoded_tokens;
        if r.spec.external {
            continue;
        }
        let chunk = r.spec.max_batch_tokens.max(1);
        f.prefill_capacity_tok_s += rate(f64::from(chunk), r.spec.cost.step_time(chunk, 0, 0));
        let fit = if kv_per_seq > 0.0 {
            (r.spec.kv_capacity as f64 / kv_per_seq).floor()
        } else {
            f64::from(r.spec.max_batch)
        };
        let batch = f64::from(r.spec.max_batch).min(fit).clamp(1.0, 65_536.0) as u32;
        let ctx = (f64::from(batch) * context).min(u64::MAX as f64 / 2.0) as u64;
        f.decode_capacity_tok_s += rate(f64::from(batch), r.spec.cost.step_time(0, batch, ctx));
    }
    f
}

/// What one pool did in a replay, for capacity plans.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PoolUse {
    /// GPU-seconds during which a step ran on the pool's replicas.
    pub busy_gpu_seconds: f64,
    /// GPU-seconds of finished requests on the pool, by tenant id (the
    /// last slot: requests without a tenant).
    pub tenant_gpu_seconds: Vec<f64>,
    /// The same by tier id (the last slot: requests without a tier).
    pub tier_gpu_seconds: Vec<f64>,
}

/// One whole replay of recorded traffic into a report: the deployment
/// [`plan`] (tier-partitioned for the `static` baseline), a fresh
/// scheduler, arrival times divided by `scale`, and the fleet's figures.
/// `kiln simulate` and `kiln plan` both replay through this.
pub fn replay_at(
    g: &std::sync::Arc<crate::graph::DecisionGraph>,
    cost: &crate::backend::cost::CostModel,
    records: &[crate::traffic::Record],
    cfg: crate::sched::Config,
    name: &str,
    scale: f64,
    progress: impl FnMut(usize, usize),
) -> report::Report {
    replay_by_pool(g, cost, records, cfg, name, scale, progress).0
}

/// [`replay_at`], with what each pool (by pool id) did.
pub fn replay_by_pool(
    g: &std::sync::Arc<crate::graph::DecisionGraph>,
    cost: &crate::backend::cost::CostModel,
    records: &[crate::traffic::Record],
    cfg: crate::sched::Config,
    name: &str,
    scale: f64,
    progress: impl FnMut(usize, usize),
) -> (report::Report, Vec<PoolUse>) {
    let mut p = plan(g, cost);
    if cfg.mode == crate::sched::Mode::Static {
        p.partition_by_tier(g);
    }
    let routing = cfg.routing;
    // A replay stores what missed its tier's cache as it finishes.
    let cfg = crate::sched::Config {
        cache_on_finish: true,
        ..cfg
    };
    let mut sched = Scheduler::new(g.clone(), p, cfg);
    let arrivals = arrivals(records)
        .into_iter()
        .map(|(t, a)| (capacity::scale_times(t, scale), a))
        .collect();
    let (outcomes, gap) = run_measured(&mut sched, arrivals, progress);
    let fleet = fleet(&sched, &outcomes, gap);
    let tenants = g.tenants.len();
    let mut pools = vec![
        PoolUse {
            busy_gpu_seconds: 0.0,
            tenant_gpu_seconds: vec![0.0; tenants + 1],
            tier_gpu_seconds: vec![0.0; g.tiers.len() + 1],
        };
        g.pools.len()
    ];
    let replicas = sched.replicas();
    for r in replicas {
        if let Some(u) = pools.get_mut(usize::from(r.spec.pool)) {
            u.busy_gpu_seconds += r.busy_seconds * f64::from(r.spec.gpus);
        }
    }
    for o in &outcomes {
        let Some(pool) = o.replica.and_then(|i| replicas.get(i)).map(|r| r.spec.pool) else {
            continue;
        };
        let Some(u) = pools.get_mut(usize::from(pool)) else {
            continue;
        };
        let t = o.tenant.map_or(tenants, |t| (t as usize).min(tenants));
        if let Some(slot) = u.tenant_gpu_seconds.get_mut(t) {
            *slot += o.gpu_seconds;
        }
        let tiers = u.tier_gpu_seconds.len() - 1;
        let t = o.tier.map_or(tiers, |t| usize::from(t).min(tiers));
        if let Some(slot) = u.tier_gpu_seconds.get_mut(t) {
            *slot += o.gpu_seconds;
        }
    }
    let rep = report::build(g, name, routing.name(), &outcomes, &fleet);
    (rep, pools)
}
