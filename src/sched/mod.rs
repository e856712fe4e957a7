//! The scheduler core: a pure, event-driven state machine. Events go in
//! (a request arrived, a batch step finished, a tick), actions come out
//! (start this step on this replica, reject that request, preempt that
//! sequence). Time is injected as microseconds; there is no I/O, no clock
//! and no global state, so the live gateway and the replay simulator run the
//! same code and a replay is reproducible bit for bit.
//!
//! What decides what:
//! - the [`DecisionGraph`] says which tier, tenant, variant and pool a
//!   request is entitled to (fed live signals from this scheduler);
//! - [`quota`] reserves tokens, requests and concurrency at admission;
//! - admission compares the estimated wait with the tier's SLO and refuses
//!   early, with a reason and a Retry-After;
//! - [`queue`] orders waiting work: tiers by priority plus aging, tenants
//!   within a tier by weighted service (VTC), requests within a tenant by
//!   arrival, or by deadline for completion-window tiers;
//! - [`replica`] runs continuous batching under a sequence and token
//!   budget, with KV memory reserved per sequence so it is never
//!   over-committed, and preempts lower tiers' preemptible work when a
//!   higher tier would otherwise wait.

pub mod plan;
pub mod queue;
pub mod quota;
pub mod replica;

use crate::graph::{Admission, DecisionGraph, PoolId, Request, Signals, TenantId, TierId};
use plan::Plan;
use queue::{Queues, Waiting};
use quota::Quotas;
use replica::{Replica, Seq};
use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;

/// Microseconds since the start of the run.
pub type Micros = u64;
pub type ReqId = u64;

pub const MS: Micros = 1_000;
pub const SEC: Micros = 1_000_000;

/// Why a request waited or was refused. Every wait and every rejection
/// carries one, so "why did my request wait" has an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// A higher tier was served first.
    Priority,
    /// Another tenant of the tier had received less service.
    Fairness,
    /// Tokens, requests or GPU-seconds quota.
    Quota,
    /// The tenant's concurrent request limit.
    Concurrency,
    /// No replica of the routed variant had room (batch or KV memory).
    Saturation,
    /// The variant needs more GPUs in one pool than are free.
    Gang,
    /// Backfill work waits for idle capacity.
    Backfill,
    /// The request's completion window cannot be met.
    Deadline,
    /// The estimated wait exceeds what the tier's SLO allows.
    Overload,
    /// The policy decided to reject.
    Policy,
    /// It waited in a queue longer than its max wait.
    Timeout,
    /// The policy delays this work until a window opens.
    Delay,
    /// Held briefly so a batch can form (a tier's max added wait).
    Batching,
    /// Preempted by a higher tier; it keeps its place in line.
    Preempted,
    /// The agentic session used its step budget.
    SessionBudget,
    /// The tenant's retry budget is spent.
    RetryBudget,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Priority => "priority",
            Reason::Fairness => "fairness",
            Reason::Quota => "quota",
            Reason::Concurrency => "concurrency",
            Reason::Saturation => "saturation",
            Reason::Gang => "gang",
            Reason::Backfill => "backfill",
            Reason::Deadline => "deadline",
            Reason::Overload => "overload",
            Reason::Policy => "policy",
            Reason::Timeout => "timeout",
            Reason::Delay => "delay",
            Reason::Batching => "batching",
            Reason::Preempted => "preempted",
            Reason::SessionBudget => "session-budget",
            Reason::RetryBudget => "retry-budget",
        }
    }
}

/// Which scheduler runs: kiln's, or a baseline for honest comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Priority with aging, weighted fair share, quotas, admission control,
    /// preemption, backfill and deadlines, all from the policy.
    #[default]
    Kiln,
    /// First come first served with continuous batching (vLLM's default).
    Fifo,
    /// Strict tier priority, first come first served within a tier.
    Priority,
    /// Each tier gets a fixed share of the replicas, FIFO within it.
    Static,
}

/// A request as the scheduler receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    pub id: ReqId,
    pub request: Request,
    /// Tokens the model will produce (known in replay; the gateway learns
    /// it as the stream ends and passes `max_tokens` until then).
    pub output_tokens: u32,
    /// Prompt prefix blocks (512 tokens each) for prefix affinity.
    pub prefix_blocks: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Arrive(Arrival),
    /// The step that replica `replica` was running has finished.
    StepDone {
        replica: usize,
    },
    /// A replica failed or was drained: its running sequences go back to
    /// the head of their queues (nothing is lost) and it takes no work.
    ReplicaDown {
        replica: usize,
    },
    /// A replica is (back) in service.
    ReplicaUp {
        replica: usize,
    },
    /// Time passed: queue timeouts, delays and batching holds fire.
    Tick,
}

/// What the environment must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The policy's decision for an arriving request (before quotas and
    /// admission control, which may still refuse it).
    Decided {
        id: ReqId,
        tier: TierId,
        tenant: Option<TenantId>,
        fallback_step: Option<u8>,
    },
    /// Run one step on `replica`; report [`Event::StepDone`] at `until`.
    Step { replica: usize, until: Micros },
    /// Ask for a [`Event::Tick`] at this time (the earliest pending timer).
    WakeAt(Micros),
    /// The request was refused; nothing more will happen to it.
    Reject {
        id: ReqId,
        reason: Reason,
        status: u16,
        retry_after: Option<Micros>,
    },
    /// The request started on a replica (it may be preempted later);
    /// `waited_for` says why it did not start on arrival, if it waited.
    Started {
        id: ReqId,
        replica: usize,
        waited_for: Option<Reason>,
    },
    /// The first output token was produced.
    FirstToken { id: ReqId },
    /// The request produced its last token, having used this much GPU time
    /// (its share of every step it was part of, times the replica's GPUs).
    Finished { id: ReqId, gpu_seconds: f64 },
    /// A running sequence was preempted to make room; it is queued again.
    Preempted {
        id: ReqId,
        replica: usize,
        by: ReqId,
    },
}

/// Tunables that are not policy: how the scheduler itself behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub mode: Mode,
    /// Aging for tiers that declare none and are not `may_starve`.
    pub default_aging: Micros,
    /// Admission refuses when the estimated wait exceeds the tier's TTFT
    /// SLO times this factor (or the completion window, for batch tiers).
    pub admission_slack: f64,
    /// Prefill tokens and generated tokens weigh this much in fair share.
    pub vtc_input_weight: f64,
    pub vtc_output_weight: f64,
    /// Service older than about this much counts less in fair share
    /// (exponential decay); `None` keeps all history.
    pub fairness_window: Option<Micros>,
    /// A sequence may be preempted at most this many times (thrash budget).
    pub max_preemptions_per_seq: u32,
    /// Minute of day at time 0 and weekday (0 = Monday), for time-of-day rules.
    pub start_minute_of_day: u32,
    pub start_weekday: u8,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Kiln,
            default_aging: 60 * SEC,
            admission_slack: 4.0,
            vtc_input_weight: 1.0,
            vtc_output_weight: 2.0,
            fairness_window: Some(600 * SEC),
            max_preemptions_per_seq: 2,
            start_minute_of_day: 12 * 60,
            start_weekday: 0,
        }
    }
}

/// What the scheduler remembers about a request it holds.
#[derive(Debug, Clone)]
struct Held {
    tenant: Option<TenantId>,
    /// Reserved quota tokens, refunded in part when the request finishes.
    reserved_tokens: f64,
}

/// The scheduler. Owns queues, replicas and quota state; borrows nothing.
pub struct Scheduler {
    graph: std::sync::Arc<DecisionGraph>,
    cfg: Config,
    now: Micros,
    replicas: Vec<Replica>,
    /// Replicas by (model, variant), for dispatch.
    by_variant: HashMap<(u16, u16), Vec<usize>>,
    queues: Queues,
    quotas: Quotas,
    held: HashMap<ReqId, Held>,
    /// Requests waiting for a delay window or a batching hold.
    timers: Vec<(Micros, ReqId)>,
    sessions: HashMap<String, (TierId, u64)>,
    signals: Signals,
    /// Baselines decide on an idle fleet: the policy classifies and routes
    /// for them, but its admission control and quotas are kiln's, not theirs.
    idle: Signals,
    out: Vec<Action>,
}

impl Scheduler {
    /// Builds a scheduler for a graph and a deployment plan (replicas with
    /// their cost models).
    pub fn new(graph: std::sync::Arc<DecisionGraph>, plan: Plan, cfg: Config) -> Scheduler {
        let mut by_variant: HashMap<(u16, u16), Vec<usize>> = HashMap::default();
        let replicas: Vec<Replica> = plan
            .replicas
            .into_iter()
            .enumerate()
            .map(|(i, spec)| {
                by_variant
                    .entry((spec.model, spec.variant))
                    .or_default()
                    .push(i);
                Replica::new(spec)
            })
            .collect();
        let signals = Signals::idle(&graph);
        let idle = signals.clone();
        let quotas = Quotas::new(&graph);
        let queues = Queues::new(&graph, &cfg);
        Scheduler {
            graph,
            cfg,
            now: 0,
            replicas,
            by_variant,
            queues,
            quotas,
            held: HashMap::default(),
            timers: Vec::new(),
            sessions: HashMap::default(),
            signals,
            idle,
            out: Vec::new(),
        }
    }

    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    pub fn now(&self) -> Micros {
        self.now
    }

    /// Requests waiting in queues (not running, not delayed).
    pub fn waiting(&self) -> usize {
        self.queues.len()
    }

    /// The largest gap in weighted service between backlogged tenants of
    /// one tier right now (the VTC fairness measure; see [`queue`]).
    pub fn service_gap(&self) -> f64 {
        self.queues.backlog_gap()
    }

    /// Feeds one event at time `now` (never earlier than the last one) and
    /// returns the actions it caused. The slice is valid until the next call.
    pub fn handle(&mut self, now: Micros, event: Event) -> &[Action] {
        self.out.clear();
        self.now = self.now.max(now);
        self.queues.set_now(self.now);
        match event {
            Event::Arrive(a) => self.arrive(a),
            Event::StepDone { replica } => self.step_done(replica),
            Event::ReplicaDown { replica } => self.replica_down(replica),
            Event::ReplicaUp { replica } => {
                if let Some(r) = self.replicas.get_mut(replica) {
                    r.up = true;
                }
            }
            Event::Tick => {}
        }
        self.fire_timers();
        self.expire_queued();
        self.dispatch_all();
        if let Some(t) = self.next_wake() {
            self.out.push(Action::WakeAt(t));
        }
        &self.out
    }

    fn refresh_signals(&mut self) {
        let g = &self.graph;
        let minute = (u64::from(self.cfg.start_minute_of_day) + self.now / (60 * SEC)) % 1440;
        let day = (u64::from(self.cfg.start_weekday)
            + (u64::from(self.cfg.start_minute_of_day) + self.now / (60 * SEC)) / 1440)
            % 7;
        self.signals.time_of_day = minute as u16;
        self.signals.weekday = day as u8;
        for (p, slot) in self.signals.pools.iter_mut().enumerate() {
            let (mut used, mut cap, mut depth) = (0u64, 0u64, 0usize);
            for r in self.replicas.iter().filter(|r| r.spec.pool as usize == p) {
                used += r.kv_used();
                cap += r.spec.kv_capacity;
                depth += r.running.len();
            }
            slot.utilization = if cap == 0 {
                0.0
            } else {
                100.0 * used as f64 / cap as f64
            };
            slot.queue_depth = depth as f64;
        }
        for (t, m) in self.signals.tiers.iter_mut().enumerate() {
            m.wait_p95 = self.queues.oldest_wait(t as TierId, self.now) as f64 / 1000.0;
        }
        for (t, s) in self.signals.tenants.iter_mut().enumerate() {
            s.quota_remaining = self.quotas.remaining_percent(t as TenantId, self.now);
            s.in_flight = self.quotas.in_flight(t as TenantId);
        }
        let _ = g;
    }

    fn reject(&mut self, id: ReqId, reason: Reason, status: u16, retry_after: Option<Micros>) {
        if let Some(h) = self.held.remove(&id) {
            if let Some(t) = h.tenant {
                self.quotas.release(t, h.reserved_tokens, 0.0);
            }
        }
        self.out.push(Action::Reject {
            id,
            reason,
            status,
            retry_after,
        });
    }

    fn arrive(&mut self, a: Arrival) {
        self.refresh_signals();
        let graph = self.graph.clone();
        let mut req = a.request.clone();
        // Agentic sessions keep the tier of their first step.
        let session_tier = req
            .session
            .as_ref()
            .and_then(|s| self.sessions.get(s))
            .map(|(t, _)| *t);
        let estimate = self.estimate_wait(&req);
        self.signals.estimated_wait = estimate as f64 / 1000.0;
        let baseline = self.cfg.mode != Mode::Kiln;
        let d = graph.decide(&req, if baseline { &self.idle } else { &self.signals });
        let mut tier = d.tier;
        if let Some(t) = session_tier {
            tier = t;
        }
        let tenant = d.tenant;
        self.out.push(Action::Decided {
            id: a.id,
            tier,
            tenant,
            fallback_step: d.fallback_step,
        });
        // Session step budget.
        if let (Some(s), Some(tn)) = (req.session.clone(), tenant) {
            let budget = graph.tenants[tn as usize].session_steps;
            let entry = self.sessions.entry(s).or_insert((tier, 0));
            entry.1 += 1;
            if budget.is_some_and(|b| entry.1 > b) {
                self.out.push(Action::Reject {
                    id: a.id,
                    reason: Reason::SessionBudget,
                    status: 429,
                    retry_after: None,
                });
                return;
            }
        }
        let target = match d.admission {
            // A baseline has no admission control: only "no such model"
            // stops it.
            Admission::Reject(r) if baseline && d.target.is_some() => {
                let _ = r;
                d.target
            }
            Admission::Reject(r) => {
                let reason = match r.reason {
                    "quota" => Reason::Quota,
                    "concurrency" => Reason::Concurrency,
                    _ => Reason::Policy,
                };
                self.out.push(Action::Reject {
                    id: a.id,
                    reason,
                    status: r.status,
                    retry_after: r.retry_after.map(|ms| (ms * 1000.0) as Micros),
                });
                return;
            }
            _ => d.target,
        };
        let Some(target) = target else {
            self.out.push(Action::Reject {
                id: a.id,
                reason: Reason::Policy,
                status: 404,
                retry_after: None,
            });
            return;
        };
        req.max_tokens = d.max_tokens;
        let output = a
            .output_tokens
            .min(d.max_tokens.clamp(1, u64::from(u32::MAX)) as u32)
            .max(1);
        // Replicas of the routed variant, preferring the routed pool.
        let candidates: Vec<usize> = self
            .by_variant
            .get(&(target.model, target.variant))
            .map(|v| {
                v.iter()
                    .copied()
                    .filter(|&r| target.pool.is_none_or(|p| self.replicas[r].spec.pool == p))
                    .collect()
            })
            .unwrap_or_default();
        if candidates.is_empty() {
            let gpus = graph.models[target.model as usize].variants[target.variant as usize]
                .gpus_per_replica;
            let reason = if gpus > 1 {
                Reason::Gang
            } else {
                Reason::Saturation
            };
            self.out.push(Action::Reject {
                id: a.id,
                reason,
                status: 503,
                retry_after: Some(10 * SEC),
            });
            return;
        }
        // A request larger than any replica's KV memory could never start.
        let kv_need = req.prompt_tokens.saturating_add(u64::from(output));
        let kv_max = candidates
            .iter()
            .map(|&r| self.replicas[r].spec.kv_capacity)
            .max()
            .unwrap_or(0);
        if kv_need > kv_max {
            self.out.push(Action::Reject {
                id: a.id,
                reason: Reason::Saturation,
                status: 413,
                retry_after: None,
            });
            return;
        }
        // Retries draw on the tenant's retry budget.
        if let Some(t) = tenant {
            let retry = req.header("x-kiln-retry").is_some();
            if self.cfg.mode == Mode::Kiln && !self.quotas.note_request(&graph, t, retry, self.now)
            {
                self.out.push(Action::Reject {
                    id: a.id,
                    reason: Reason::RetryBudget,
                    status: 429,
                    retry_after: Some(10 * SEC),
                });
                return;
            }
        }
        // Quota: reserve at admission, not after the fact.
        let need = f64::from(output) + req.prompt_tokens as f64;
        let mut borrowed = false;
        let reserved = match tenant {
            Some(t) if self.cfg.mode == Mode::Kiln => {
                match self.quotas.reserve(&graph, t, need, self.now) {
                    Ok(b) => {
                        borrowed = b;
                        need
                    }
                    Err((reason, retry)) => {
                        self.out.push(Action::Reject {
                            id: a.id,
                            reason,
                            status: 429,
                            retry_after: Some(retry),
                        });
                        return;
                    }
                }
            }
            Some(t) => {
                self.quotas.track(t);
                0.0
            }
            None => 0.0,
        };
        // Early, honest refusal instead of a timeout.
        if self.cfg.mode == Mode::Kiln {
            if let Some(limit) = self.wait_limit(tier) {
                let est = self.estimate_wait_for(tier, &candidates);
                if est > limit {
                    if let Some(t) = tenant {
                        self.quotas.release(t, reserved, 0.0);
                    }
                    let reason = if graph.tiers[tier as usize].slo.window.is_some() {
                        Reason::Deadline
                    } else {
                        Reason::Overload
                    };
                    self.out.push(Action::Reject {
                        id: a.id,
                        reason,
                        status: 429,
                        retry_after: Some(est.saturating_sub(limit).max(SEC)),
                    });
                    return;
                }
            }
        }
        self.held.insert(
            a.id,
            Held {
                tenant,
                reserved_tokens: reserved,
            },
        );
        let window = graph.tiers[tier as usize]
            .slo
            .window
            .map(|w| self.now.saturating_add((w * 1000.0) as Micros));
        let max_wait = match d.admission {
            Admission::Queue { max_wait } if !baseline => {
                Some(self.now.saturating_add((max_wait * 1000.0) as Micros))
            }
            _ => None,
        };
        let w = Waiting {
            id: a.id,
            tier,
            tenant,
            arrival: self.now,
            deadline: window,
            expires: max_wait,
            // kv_need <= a replica's KV capacity bounds this; clamp anyway.
            prompt_tokens: req.prompt_tokens.min(u64::from(u32::MAX)) as u32,
            output_tokens: output,
            generated: 0,
            model: target.model,
            variant: target.variant,
            pool: target.pool,
            affinity: self.affinity(tier, &candidates, &a.prefix_blocks),
            prefix_blocks: a.prefix_blocks,
            preemptions: 0,
            backfill: graph.tiers[tier as usize].backfill_only,
            borrowed,
            waiting_for: None,
            gpu_seconds: 0.0,
        };
        let mut w = w;
        if let (Admission::Delay { until }, false) = (d.admission, baseline) {
            w.waiting_for = Some(Reason::Delay);
            let at = self.time_at_minute(u32::from(until));
            self.timers.push((at, a.id));
            self.queues.park(w);
            return;
        }
        if let Some(hold) = graph.tiers[tier as usize].batch_max_wait {
            // Batch-eligible work may wait briefly for a batch to form; it
            // never does when a replica could start it with others already.
            if hold > 0.0 && self.cfg.mode == Mode::Kiln && self.all_idle(&candidates) {
                let at = self.now.saturating_add((hold * 1000.0) as Micros);
                self.timers.push((at, a.id));
                w.waiting_for = Some(Reason::Batching);
                self.queues.park(w);
                return;
            }
        }
        // Why it will wait, if it does: no room on any replica of its route,
        // or (backfill) capacity reserved for others.
        if w.backfill {
            w.waiting_for = Some(Reason::Backfill);
        } else if candidates.iter().all(|&r| {
            self.replicas[r].free_seq_slots() == 0 || self.replicas[r].kv_free() < kv_need
        }) {
            w.waiting_for = Some(Reason::Saturation);
        } else if self.queues.tokens_above(&graph, tier) > 0 {
            w.waiting_for = Some(Reason::Priority);
        } else if self.queues.others_queued(tier, tenant) {
            w.waiting_for = Some(Reason::Fairness);
        }
        self.queues.push(w, &self.cfg);
    }

    /// With prefix affinity, the replica that already holds the longest
    /// prefix of this prompt.
    fn affinity(&self, tier: TierId, candidates: &[usize], blocks: &[u64]) -> Option<usize> {
        if blocks.is_empty() || !self.graph.tiers[tier as usize].prefix_affinity {
            return None;
        }
        candidates
            .iter()
            .map(|&r| (self.replicas[r].prefix_match(blocks), std::cmp::Reverse(r)))
            .filter(|(n, _)| *n > 0)
            .max()
            .map(|(_, std::cmp::Reverse(r))| r)
    }

    fn all_idle(&self, replicas: &[usize]) -> bool {
        replicas
            .iter()
            .all(|&r| self.replicas[r].running.is_empty())
    }

    /// When a delay window opens: the next time the clock reads `minute`.
    fn time_at_minute(&self, minute: u32) -> Micros {
        let now_min = (u64::from(self.cfg.start_minute_of_day) + self.now / (60 * SEC)) % 1440;
        let delta = (u64::from(minute) + 1440 - now_min) % 1440;
        let into_minute = self.now % (60 * SEC);
        self.now + delta * 60 * SEC - if delta > 0 { into_minute } else { 0 }
    }

    /// The longest wait the tier's SLO tolerates before the first token.
    fn wait_limit(&self, tier: TierId) -> Option<Micros> {
        let slo = &self.graph.tiers[tier as usize].slo;
        if let Some(ttft) = slo.ttft {
            return Some((ttft * 1000.0 * self.cfg.admission_slack) as Micros);
        }
        slo.window.map(|w| (w * 1000.0) as Micros)
    }

    /// Estimated wait before a request of `tier` starts on one of
    /// `replicas`: queued work at the same or higher priority, at the
    /// replicas' current token throughput.
    fn estimate_wait_for(&self, tier: TierId, replicas: &[usize]) -> Micros {
        let ahead = self.queues.tokens_at_or_above(&self.graph, tier);
        let mut free_slots = 0u64;
        let mut rate = 0.0; // tokens per second across replicas
        for &r in replicas {
            let rep = &self.replicas[r];
            free_slots += u64::from(rep.free_seq_slots());
            rate += rep.throughput_tokens_per_s();
        }
        if ahead == 0 && free_slots > 0 {
            return 0;
        }
        if rate <= 0.0 {
            return u64::MAX / 4;
        }
        ((ahead as f64 / rate) * SEC as f64) as Micros
    }

    /// The `estimated_wait` signal policies read: for the request's route
    /// under an idle decision, or 0 when unknown.
    fn estimate_wait(&self, req: &Request) -> Micros {
        let d = self.graph.decide(req, &self.signals);
        match d.target {
            Some(t) => {
                let reps: Vec<usize> = self
                    .by_variant
                    .get(&(t.model, t.variant))
                    .cloned()
                    .unwrap_or_default();
                if reps.is_empty() {
                    0
                } else {
                    self.estimate_wait_for(d.tier, &reps)
                }
            }
            None => 0,
        }
    }

    fn fire_timers(&mut self) {
        if self.timers.is_empty() {
            return;
        }
        let now = self.now;
        let mut due: Vec<ReqId> = Vec::new();
        self.timers.retain(|&(t, id)| {
            if t <= now {
                due.push(id);
                false
            } else {
                true
            }
        });
        due.sort_unstable();
        for id in due {
            if let Some(w) = self.queues.unpark(id) {
                self.queues.push(w, &self.cfg);
            }
        }
    }

    fn expire_queued(&mut self) {
        for w in self.queues.take_expired(self.now) {
            self.reject(w.id, Reason::Timeout, 503, Some(5 * SEC));
        }
    }

    fn next_wake(&self) -> Option<Micros> {
        let timer = self.timers.iter().map(|(t, _)| *t).min();
        let expiry = self.queues.next_expiry();
        match (timer, expiry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
        .filter(|&t| t > self.now)
    }

    fn replica_down(&mut self, r: usize) {
        let Some(rep) = self.replicas.get_mut(r) else {
            return;
        };
        rep.up = false;
        // A step in flight is lost with the replica; its StepDone, if it
        // still arrives, finds nothing to apply.
        rep.busy = false;
        let mut seqs = Vec::new();
        while !rep.running.is_empty() {
            seqs.push(rep.evict(0));
        }
        for mut s in seqs {
            s.w.generated = s.generated;
            s.w.gpu_seconds = s.gpu_seconds;
            s.w.waiting_for = Some(Reason::Saturation);
            self.out.push(Action::Preempted {
                id: s.w.id,
                replica: r,
                by: s.w.id,
            });
            self.queues.push_front(s.w);
        }
    }

    fn step_done(&mut self, r: usize) {
        let now = self.now;
        let Some(rep) = self.replicas.get_mut(r) else {
            return;
        };
        if !rep.up || !rep.busy || now < rep.step_until {
            return; // a step lost with a replica that went down
        }
        // GPU-seconds: the step's GPU time, shared by its sequences.
        if !rep.running.is_empty() {
            let share = rep.last_step * f64::from(rep.spec.gpus) / rep.running.len() as f64;
            for s in rep.running.iter_mut() {
                s.gpu_seconds += share;
                if let Some(t) = s.w.tenant {
                    self.quotas.charge_gpu(t, share, now);
                }
            }
        }
        let done = rep.finish_step(now, &mut self.out);
        for (id, seq) in done {
            let served_in = f64::from(seq.w.prompt_tokens);
            let served_out = f64::from(seq.generated);
            if let Some(h) = self.held.remove(&id) {
                if let Some(t) = h.tenant {
                    let used = served_in + served_out;
                    self.quotas.release(t, h.reserved_tokens, used);
                }
            }
            let _ = served_in;
        }
    }

    /// Fills every idle replica: decodes continue, new work is admitted in
    /// queue order under the replica's budgets, preempting if needed.
    fn dispatch_all(&mut self) {
        for r in 0..self.replicas.len() {
            if self.replicas[r].busy || !self.replicas[r].up {
                continue;
            }
            self.fill(r);
            let now = self.now;
            if let Some(until) = self.replicas[r].start_step(now) {
                self.out.push(Action::Step { replica: r, until });
            }
        }
    }

    fn fill(&mut self, r: usize) {
        let spec = self.replicas[r].spec.clone();
        loop {
            let has_room = self.replicas[r].free_seq_slots() > 0;
            let kv_free = self.replicas[r].kv_free();
            let _ = kv_free;
            // Backfill only when nothing else wants this replica.
            let others_waiting =
                self.queues
                    .any_non_backfill_for(spec.model, spec.variant, spec.pool);
            let pick = self.queues.pick(
                &self.graph,
                &self.cfg,
                self.now,
                queue::Slot {
                    replica: r,
                    model: spec.model,
                    variant: spec.variant,
                    pool: spec.pool,
                    only_tier: spec.only_tier,
                    allow_backfill: !others_waiting,
                },
            );
            let Some(w) = pick else {
                break;
            };
            if !has_room || u64::from(w.prompt_tokens) + u64::from(w.output_tokens) > kv_free {
                // Make room by preempting lower, preemptible work, or stop.
                if self.cfg.mode == Mode::Kiln && self.try_preempt(r, &w) {
                    self.queues.push_front(w);
                    continue;
                }
                self.queues.push_front(w);
                break;
            }
            self.queues.charge(&self.graph, &self.cfg, &w);
            let id = w.id;
            let waited_for = if self.now > w.arrival {
                // Nothing more specific: it queued behind earlier work.
                w.waiting_for.or(Some(Reason::Saturation))
            } else {
                None
            };
            let cached = if self.graph.tiers[w.tier as usize].prefix_affinity {
                self.replicas[r].cached_prefix_tokens(&w.prefix_blocks)
            } else {
                0
            };
            let now = self.now;
            self.replicas[r].admit(Seq::from_waiting(w, cached), now);
            self.out.push(Action::Started {
                id,
                replica: r,
                waited_for,
            });
        }
    }

    /// Preempts the lowest-priority preemptible sequence on replica `r`
    /// that `w`'s tier may preempt, if any, within the thrash budget.
    fn try_preempt(&mut self, r: usize, w: &Waiting) -> bool {
        let tier = &self.graph.tiers[w.tier as usize];
        let lends = w.tenant.and_then(|t| self.quotas.cohort(t)).is_some();
        if tier.preempts.is_empty() && !lends {
            return false;
        }
        // Only when waiting for a slot to free would miss the SLO (half of
        // it, leaving the rest for the request itself): preemption costs a
        // recompute, so it is not spent where patience suffices.
        let budget = tier
            .slo
            .ttft
            .or(tier.slo.window)
            .map(|ms| (ms * 1000.0 / 2.0) as Micros);
        if let Some(budget) = budget {
            let waited = self.now.saturating_sub(w.arrival);
            if waited + self.replicas[r].time_to_free() <= budget {
                return false;
            }
        }
        let cohort = w.tenant.and_then(|t| self.quotas.cohort(t));
        let victim = self.replicas[r]
            .running
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                // Lower tiers this tier may preempt, or work a cohort member
                // runs on borrowed quota, which the lender reclaims.
                let reclaim = s.w.borrowed
                    && cohort.is_some()
                    && s.w.tenant != w.tenant
                    && s.w.tenant.and_then(|t| self.quotas.cohort(t)) == cohort;
                (tier.preempts.contains(&s.w.tier) || reclaim)
                    && self.graph.tiers[s.w.tier as usize].preemptible
                    && s.w.preemptions < self.cfg.max_preemptions_per_seq
            })
            // lowest priority first, then the one that started last (least work lost)
            .min_by_key(|(_, s)| {
                (
                    self.graph.tiers[s.w.tier as usize].priority,
                    std::cmp::Reverse(s.started),
                )
            })
            .map(|(i, _)| i);
        let Some(i) = victim else {
            return false;
        };
        let mut seq = self.replicas[r].evict(i);
        self.out.push(Action::Preempted {
            id: seq.w.id,
            replica: r,
            by: w.id,
        });
        // Keeps its place: back at the head of its tenant's queue, with its
        // generated tokens; the KV cache is recomputed when it resumes.
        seq.w.preemptions += 1;
        seq.w.generated = seq.generated;
        seq.w.gpu_seconds = seq.gpu_seconds;
        seq.w.waiting_for = Some(Reason::Preempted);
        self.queues.push_front(seq.w);
        true
    }

    /// Tokens of KV cache reserved across replicas, and capacity.
    pub fn kv_usage(&self) -> (u64, u64) {
        self.replicas.iter().fold((0, 0), |(u, c), r| {
            (u + r.kv_used(), c + r.spec.kv_capacity)
        })
    }

    pub fn pool_of(&self, r: usize) -> Option<PoolId> {
        self.replicas.get(r).map(|x| x.spec.pool)
    }
}
