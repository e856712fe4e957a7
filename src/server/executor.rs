//! The executor: the one task that owns the scheduler core and feeds it
//! real time. Request handlers submit arrivals and cancellations over a
//! channel; the executor turns the scheduler's actions into progress
//! messages for each handler, sleeps until the next simulated step ends or
//! timer fires, and applies policy swaps between two events, so every
//! request is decided wholly by one version.
//!
//! Why one task: the scheduler is a pure state machine with `&mut self`
//! methods; serialising events through a channel keeps it lock-free. The
//! timers and the order of events are the [`crate::driver`]'s, the same
//! code the replay runs; the executor adds only the clock (wall or
//! virtual) and a [`Sink`] that turns actions into progress messages.

use crate::backend::Backend;
use crate::driver::{Clock, Driver, Sink};
use crate::graph::{DecisionGraph, Signals, TenantId, TierId};
use crate::sched::canary::Canary;
use crate::sched::plan::Plan;
use crate::sched::ratelimit::RateLimits;
use crate::sched::{Action, Arrival, Event, Micros, QueueRow, Reason, ReqId, Scheduler};
use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// What a handler hears about its request.
#[derive(Clone)]
pub enum Progress {
    Decided {
        tier: TierId,
        tenant: Option<TenantId>,
        fallback_step: Option<u8>,
        version: Arc<str>,
        graph: Arc<DecisionGraph>,
        /// The live signals the decision saw (for explain).
        signals: Arc<Signals>,
        /// Set when a canary version decided it (tier and tenant ids are
        /// still the active graph's).
        canary: Option<Arc<CanaryDecided>>,
        /// Scheduler time of the arrival.
        at: Micros,
        /// Its rate limits after admission reserved its quotas
        /// (`x-ratelimit-*`), where the quota gate saw it at arrival.
        limits: Option<RateLimits>,
    },
    Started {
        replica: usize,
        /// `model.variant on pool` (shared: the same for every request
        /// the replica starts).
        route: Arc<str>,
        backend: Backend,
        waited_for: Option<Reason>,
        /// Scheduler time of the start, for queue-wait accounting.
        at: Micros,
    },
    /// Simulated backends: `n` more output tokens exist, and the sequence
    /// has used `gpu_seconds` so far (what a client that leaves now is
    /// charged).
    Tokens {
        n: u32,
        gpu_seconds: f64,
    },
    FirstToken,
    Finished {
        gpu_seconds: f64,
        /// The part of it that served nothing (recomputing KV lost to a
        /// preemption).
        wasted_gpu_seconds: f64,
        /// Scheduler time of the end.
        at: Micros,
    },
    Rejected {
        reason: Reason,
        status: u16,
        retry_after: Option<Micros>,
        /// Its rate limits at the refusal, and which quota refused.
        limits: Option<RateLimits>,
    },
    Preempted {
        by: ReqId,
    },
    /// Answered from its tier's exact cache: nothing more will come.
    CacheHit {
        key: crate::sched::cache::Key,
        payload: Option<Arc<str>>,
        /// A semantic cache's similarity; `None` for the exact cache.
        similarity: Option<f32>,
    },
    /// Cacheable, not cached: a complete answer may be stored under `key`.
    CacheMiss {
        key: crate::sched::cache::Key,
    },
}

/// A request a canary version decided: its version, graph, and the
/// signals it saw in that graph's ids (for explain and the log).
pub struct CanaryDecided {
    pub version: Arc<str>,
    pub graph: Arc<DecisionGraph>,
    pub signals: Arc<Signals>,
}

/// What a request holds on a quota outside this executor (the fleet's
/// shared quota, [`super::fleet::Claim`]), settled as the scheduler reports
/// how the request ended. A trait, so that the executor, which the fleet
/// drives, does not depend on the fleet.
pub trait Settle: Send + Sync {
    /// Ended having produced `output` tokens and used `gpu_seconds`.
    fn finish(&self, output: u32, gpu_seconds: f64);
    /// Refused before it ran: everything is given back.
    fn refund(&self);
}

pub enum Command {
    Submit {
        arrival: Arrival,
        events: mpsc::UnboundedSender<Progress>,
        /// Its claim on the fleet's shared quota, released as it ends.
        claim: Option<Arc<dyn Settle>>,
    },
    Cancel(ReqId),
    /// Stores a complete answer in a tier's exact cache (ignored when the
    /// graph it was decided with is no longer the active one); the reply is
    /// how many answers the tier's cache holds afterwards.
    CacheStore {
        graph: Arc<DecisionGraph>,
        tier: TierId,
        key: crate::sched::cache::Key,
        /// The request's content hash ([`Command::ExactHolds`]).
        content: Option<crate::sched::cache::Key>,
        payload: Arc<str>,
        /// The entries the tier's exact and semantic caches hold after.
        done: oneshot::Sender<(usize, usize)>,
    },
    /// Whether some tier's exact cache holds an answer for this content
    /// hash (the gateway then does not embed the request).
    ExactHolds {
        content: crate::sched::cache::Key,
        reply: oneshot::Sender<bool>,
    },
    /// An HTTP upstream produced the request's first token.
    FirstToken(ReqId),
    /// An HTTP upstream finished the request.
    Complete {
        id: ReqId,
        output_tokens: u32,
    },
    /// An HTTP upstream's request ended for its client, served or not:
    /// its first token first when it came with the end (a whole answer),
    /// then `Complete`, then `Cancel` (a no-op unless a preemption crossed
    /// the end and queued it again). One message where there were three.
    Ended {
        id: ReqId,
        output_tokens: u32,
        first_token: bool,
    },
    Swap {
        graph: Arc<DecisionGraph>,
        plan: Plan,
        version: Arc<str>,
        done: oneshot::Sender<Vec<ReqId>>,
    },
    Snapshot(oneshot::Sender<Snapshot>),
    /// Starts (with a canary and its version) or ends a canary.
    SetCanary {
        canary: Option<(Canary, Arc<str>)>,
        done: oneshot::Sender<()>,
    },
    /// The active graph and the live signals as of the last arrival.
    Signals(oneshot::Sender<(Arc<DecisionGraph>, Signals)>),
    /// The scheduler's drain estimate for `items` requests like this one
    /// (the Batches API's predicted finish), with the graph it read.
    Forecast {
        request: crate::graph::Request,
        items: u64,
        reply: oneshot::Sender<(Arc<DecisionGraph>, Option<crate::sched::forecast::Forecast>)>,
    },
    /// An upstream just failed: fold breaker states in now, not at the
    /// next periodic check, so a resent request avoids it.
    CheckHealth,
    /// What a replica of a fleet shares: fair-share service charged since
    /// the last call, busy queues, and what each HTTP upstream needs.
    FleetView(oneshot::Sender<FleetView>),
    /// What the fleet keeps of each money budget's current period.
    SyncBudgets(Vec<crate::sched::budget::BudgetSync>),
    /// The fleet's fair-share counters and this replica's slots of each
    /// shared upstream, as read for `graph` (ignored after a swap).
    FleetApply {
        graph: Arc<DecisionGraph>,
        service: Vec<crate::sched::queue::ServiceCount>,
        slots: Vec<(usize, u32)>,
        /// The fleet's quota levels, and the share of each quota this
        /// replica enforces alone (1/the fleet's size).
        quotas: Vec<(crate::sched::quota::Scope, crate::sched::quota::Level)>,
        scale: f64,
    },
    /// A CUDA replica finished the step that was to end at `until`.
    StepRan {
        replica: usize,
        until: Micros,
        result: Result<Duration, String>,
    },
}

/// See [`Command::FleetView`].
pub struct FleetView {
    pub graph: Arc<DecisionGraph>,
    pub service: Vec<crate::sched::queue::ServiceCount>,
    /// Queues with work waiting: (model, variant), tier.
    pub active: Vec<((u16, u16), crate::graph::TierId)>,
    /// Fair-share decay window per tier, µs.
    pub decays: Vec<Option<Micros>>,
    pub upstreams: Vec<UpstreamDemand>,
    /// Quota this replica took by itself since the last view.
    pub spend: Vec<(crate::sched::quota::Scope, crate::sched::quota::Spent)>,
}

/// One HTTP upstream replica's needs, for the fleet's split of its slots.
pub struct UpstreamDemand {
    pub replica: usize,
    /// The upstream's URL and what it serves: the same on every replica
    /// of the fleet.
    pub key: String,
    pub capacity: u32,
    /// The slots it may use now (its grant in force).
    pub in_force: u32,
    pub busy: u32,
    pub queued: usize,
    /// Tenants with work queued for it, with their fair-share weights.
    pub tenants: Vec<(String, f64)>,
}

/// The scheduler's state, for `/admin/queues`, `/readyz` and the gauges.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub version: String,
    pub queues: Vec<QueueRow>,
    pub replicas: Vec<ReplicaRow>,
    pub in_flight: usize,
    /// Arrivals the scheduler has been given since the start.
    pub arrivals: u64,
    /// Entries each tier's semantic cache holds, expired ones dropped
    /// (for `kiln_cache_entries`, so it falls as entries expire).
    #[serde(skip)]
    pub semantic_entries: Vec<(String, usize)>,
    /// Tenants' and tiers' money budgets (for `kiln_budget_*`).
    #[serde(skip)]
    pub budgets: Vec<crate::sched::budget::BudgetView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplicaRow {
    pub index: usize,
    pub pool: String,
    pub model: String,
    pub variant: String,
    pub backend: String,
    pub up: bool,
    pub draining: bool,
    /// Whether an HTTP upstream's circuit breaker lets requests through.
    pub available: bool,
    pub running: usize,
    pub slots: u32,
    pub kv_used_tokens: u64,
    pub kv_capacity_tokens: u64,
    /// Share of wall time spent running steps (simulated replicas).
    pub busy_fraction: f64,
    /// An engine-aware upstream's gate: the engine's load, the slots kiln
    /// may fill, or why it fell back to the static `concurrency`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::backend::http::EngineStatus>,
}

/// A cheap, cloneable handle to the executor task.
#[derive(Clone)]
pub struct ExecHandle {
    tx: mpsc::UnboundedSender<Command>,
}

impl ExecHandle {
    pub fn send(&self, c: Command) -> bool {
        self.tx.send(c).is_ok()
    }

    pub async fn snapshot(&self) -> Option<Snapshot> {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::Snapshot(tx)) {
            return None;
        }
        rx.await.ok()
    }

    /// See [`Command::ExactHolds`]; `false` when the executor is gone.
    pub async fn exact_holds(&self, content: crate::sched::cache::Key) -> bool {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::ExactHolds { content, reply: tx }) {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// The active graph and live signals, for rollback conditions.
    pub async fn signals(&self) -> Option<(Arc<DecisionGraph>, Signals)> {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::Signals(tx)) {
            return None;
        }
        rx.await.ok()
    }

    /// See [`Command::FleetView`].
    pub async fn fleet_view(&self) -> Option<FleetView> {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::FleetView(tx)) {
            return None;
        }
        rx.await.ok()
    }

    /// See [`Command::Forecast`].
    pub async fn forecast(
        &self,
        request: crate::graph::Request,
        items: u64,
    ) -> Option<(Arc<DecisionGraph>, Option<crate::sched::forecast::Forecast>)> {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::Forecast {
            request,
            items,
            reply: tx,
        }) {
            return None;
        }
        rx.await.ok()
    }

    /// Starts or ends a canary; true once the executor applied it.
    pub async fn set_canary(&self, canary: Option<(Canary, Arc<str>)>) -> bool {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::SetCanary { canary, done: tx }) {
            return false;
        }
        rx.await.is_ok()
    }
}

struct Entry {
    events: mpsc::UnboundedSender<Progress>,
    claim: Option<Arc<dyn Settle>>,
    /// Tokens reported to the handler so far, and the sequence's length.
    sent: u32,
    target: u32,
}

/// The gateway's [`Sink`]: actions become progress messages for the
/// handler that submitted each request.
struct Handlers {
    reqs: HashMap<ReqId, Entry>,
    graph: Arc<DecisionGraph>,
    version: Arc<str>,
    canary_version: Option<Arc<str>>,
    /// Backends by `ReplicaSpec::tag`.
    backends: Arc<Vec<Backend>>,
    /// Each replica's route, written when a request first starts there;
    /// emptied by a swap (the only change of graph or replicas).
    routes: Vec<Option<Arc<str>>>,
    /// Set while an arrival is fed: its decision carries the live signals
    /// it saw (for explain), copied once.
    arriving: bool,
    /// The executor's own channel, for results of work it hands to
    /// blocking threads (CUDA steps).
    self_tx: Option<mpsc::UnboundedSender<Command>>,
    /// CUDA replicas' KV changes between steps, and their steps.
    #[cfg(feature = "cuda")]
    cuda: crate::backend::cuda::step::Steps,
}

impl Handlers {
    fn send(&self, id: ReqId, p: Progress) {
        if let Some(e) = self.reqs.get(&id) {
            let _ = e.events.send(p);
        }
    }

    /// What a decision saw: the live signals, and the canary's view when a
    /// canary version decided.
    fn decided_context(&self, sched: &Scheduler) -> (Arc<Signals>, Option<Arc<CanaryDecided>>) {
        if !self.arriving {
            return (Arc::default(), None);
        }
        let signals = Arc::new(sched.signals().clone());
        let canary = if sched.last_arrival_canary() {
            match (sched.canary(), &self.canary_version) {
                (Some(c), Some(v)) => Some(Arc::new(CanaryDecided {
                    version: v.clone(),
                    graph: c.graph().clone(),
                    signals: Arc::new(c.signals().clone()),
                })),
                _ => None,
            }
        } else {
            None
        };
        (signals, canary)
    }

    /// `model.variant on pool` for replica `i`, written once per replica,
    /// not per request.
    fn route(&mut self, i: usize, spec: &crate::sched::plan::ReplicaSpec) -> Arc<str> {
        if let Some(Some(r)) = self.routes.get(i) {
            return r.clone();
        }
        let g = &self.graph;
        let route: Arc<str> = format!(
            "{} on {}",
            g.variant_name(spec.model, spec.variant),
            g.pools
                .get(spec.pool as usize)
                .map(|p| p.name.as_str())
                .unwrap_or("?")
        )
        .into();
        if self.routes.len() <= i {
            self.routes.resize(i + 1, None);
        }
        self.routes[i] = Some(route.clone());
        route
    }

    /// Frees a sequence's KV blocks on its CUDA replica (at its next step).
    fn release_gpu_kv(&mut self, id: ReqId) {
        #[cfg(feature = "cuda")]
        self.cuda.release(id);
        let _ = id;
    }
}

impl Sink for Handlers {
    fn act(&mut self, now: Micros, action: &Action, sched: &Scheduler) {
        match *action {
            Action::Decided {
                id,
                tier,
                tenant,
                fallback_step,
                ..
            } => {
                if self.reqs.contains_key(&id) {
                    let (signals, canary) = self.decided_context(sched);
                    self.send(
                        id,
                        Progress::Decided {
                            tier,
                            tenant,
                            fallback_step,
                            version: self.version.clone(),
                            graph: self.graph.clone(),
                            signals,
                            canary,
                            at: now,
                            limits: sched.rate_limits(id),
                        },
                    );
                }
            }
            // Timers are the driver's.
            Action::Step { .. } | Action::WakeAt(_) => {}
            Action::Reject {
                id,
                reason,
                status,
                retry_after,
            } => {
                if let Some(e) = self.reqs.remove(&id) {
                    // A request re-decided after a policy swap is sent
                    // again on the same claim.
                    if reason != Reason::PolicyChanged {
                        if let Some(c) = &e.claim {
                            c.refund();
                        }
                    }
                    let _ = e.events.send(Progress::Rejected {
                        reason,
                        status,
                        retry_after,
                        limits: sched.rate_limits(id),
                    });
                }
            }
            Action::Started {
                id,
                replica,
                waited_for,
            } => {
                let rep = sched.replicas().get(replica);
                let backend = rep
                    .and_then(|r| self.backends.get(r.spec.tag as usize))
                    .cloned()
                    .unwrap_or(Backend::Sim);
                let seq = rep.and_then(|r| r.running.iter().find(|s| s.w.id == id));
                let target = seq.map(|s| s.w.output_tokens);
                #[cfg(feature = "cuda")]
                if matches!(backend, Backend::Cuda(_)) {
                    let tokens = seq
                        .map(|s| u64::from(s.w.prompt_tokens) + u64::from(s.w.output_tokens))
                        .unwrap_or(0);
                    self.cuda.started(id, replica, tokens);
                }
                let route = rep
                    .map(|r| self.route(replica, &r.spec))
                    .unwrap_or_else(|| Arc::from(""));
                if let Some(e) = self.reqs.get_mut(&id) {
                    if let Some(t) = target {
                        e.target = t;
                    }
                    let _ = e.events.send(Progress::Started {
                        replica,
                        route,
                        backend,
                        waited_for,
                        at: now,
                    });
                }
            }
            Action::FirstToken { id } => self.send(id, Progress::FirstToken),
            Action::Finished {
                id,
                gpu_seconds,
                wasted_gpu_seconds,
            } => {
                self.release_gpu_kv(id);
                if let Some(e) = self.reqs.remove(&id) {
                    if let Some(c) = &e.claim {
                        c.finish(e.target.max(e.sent), gpu_seconds);
                    }
                    if e.target > e.sent {
                        let _ = e.events.send(Progress::Tokens {
                            n: e.target - e.sent,
                            gpu_seconds,
                        });
                    }
                    let _ = e.events.send(Progress::Finished {
                        gpu_seconds,
                        wasted_gpu_seconds,
                        at: now,
                    });
                }
            }
            Action::Preempted { id, by, .. } => {
                self.release_gpu_kv(id);
                self.send(id, Progress::Preempted { by });
            }
            Action::Cancelled { id } => {
                self.release_gpu_kv(id);
                if let Some(e) = self.reqs.remove(&id) {
                    if let Some(c) = &e.claim {
                        c.finish(e.sent, 0.0);
                    }
                }
            }
            Action::CacheHit {
                id,
                key,
                ref payload,
                similarity,
            } => {
                if let Some(e) = self.reqs.remove(&id) {
                    // One request, no tokens, no GPU time.
                    if let Some(c) = &e.claim {
                        c.finish(0, 0.0);
                    }
                    let _ = e.events.send(Progress::CacheHit {
                        key,
                        payload: payload.clone(),
                        similarity,
                    });
                }
            }
            Action::CacheMiss { id, key } => self.send(id, Progress::CacheMiss { key }),
        }
    }

    /// Tokens produced by the step that just ended, for sequences that
    /// keep running (finished ones were settled by their action).
    fn stepped(&mut self, replica: usize, sched: &Scheduler) {
        let Some(rep) = sched.replicas().get(replica) else {
            return;
        };
        for s in &rep.running {
            if let Some(e) = self.reqs.get_mut(&s.w.id) {
                if s.generated > e.sent {
                    let _ = e.events.send(Progress::Tokens {
                        n: s.generated - e.sent,
                        gpu_seconds: s.gpu_seconds,
                    });
                    e.sent = s.generated;
                }
            }
        }
    }

    /// Runs the step the scheduler just started on a CUDA replica on its
    /// GPU; its end comes back as `StepRan`.
    fn run_step(&mut self, r: usize, until: Micros, sched: &Scheduler) -> bool {
        #[cfg(feature = "cuda")]
        {
            let Some(rep) = sched.replicas().get(r) else {
                return false;
            };
            let Some(Backend::Cuda(slot)) = self.backends.get(rep.spec.tag as usize).cloned()
            else {
                return false;
            };
            let Some(tx) = self.self_tx.clone() else {
                return false;
            };
            self.cuda.run(r, slot, rep.step_shape, move |result| {
                let _ = tx.send(Command::StepRan {
                    replica: r,
                    until,
                    result,
                });
            });
            true
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (r, until, sched, &self.self_tx);
            false
        }
    }
}

pub struct Executor<C: Clock> {
    driver: Driver,
    handlers: Handlers,
    clock: C,
    /// Last known health of each replica's HTTP upstream (true for the
    /// simulator), so a breaker that opens takes the replica out of
    /// dispatch and one that closes puts it back.
    healthy: Vec<bool>,
    /// A fleet's grant of each replica's shared upstream slots (an
    /// engine-aware upstream's gate may cap it lower).
    fleet_caps: Vec<Option<u32>>,
    /// Whether some upstream's engine is scraped (its gate is folded in
    /// at every arrival, not only every `HEALTH_EVERY`).
    engines: bool,
    arrivals: u64,
}

/// The smaller of two slot caps (`None`: no cap).
fn min_cap(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// How often upstream health is folded into the scheduler.
const HEALTH_EVERY: Duration = Duration::from_millis(200);

impl<C: Clock> Executor<C> {
    pub fn new(
        sched: Scheduler,
        graph: Arc<DecisionGraph>,
        version: Arc<str>,
        backends: Arc<Vec<Backend>>,
        clock: C,
    ) -> Executor<C> {
        let engines = backends
            .iter()
            .any(|b| matches!(b, Backend::Http(u) if u.engine().scraped()));
        Executor {
            driver: Driver::new(sched),
            handlers: Handlers {
                reqs: HashMap::default(),
                graph,
                version,
                canary_version: None,
                backends,
                routes: Vec::new(),
                arriving: false,
                self_tx: None,
                #[cfg(feature = "cuda")]
                cuda: Default::default(),
            },
            clock,
            healthy: Vec::new(),
            fleet_caps: Vec::new(),
            engines,
            arrivals: 0,
        }
    }

    /// Starts the executor on the current tokio runtime.
    pub fn spawn(mut self) -> (ExecHandle, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.handlers.self_tx = Some(tx.clone());
        let task = tokio::spawn(self.run(rx));
        (ExecHandle { tx }, task)
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        let has_http = self
            .handlers
            .backends
            .iter()
            .any(|b| matches!(b, Backend::Http(_)));
        let mut health = tokio::time::interval(HEALTH_EVERY);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next = self.driver.next_timer();
            let cmd = tokio::select! {
                biased;
                c = rx.recv() => Some(c),
                _ = self.clock.passed(next.unwrap_or(Micros::MAX)), if next.is_some() => None,
                _ = health.tick(), if has_http => {
                    self.check_health();
                    None
                }
            };
            match cmd {
                Some(None) => break,
                Some(Some(c)) => {
                    self.command(c);
                    // Drain what queued meanwhile before sleeping again.
                    for _ in 0..256 {
                        match rx.try_recv() {
                            Ok(c) => self.command(c),
                            Err(_) => break,
                        }
                    }
                }
                None => {}
            }
            let now = self.clock.now();
            self.driver.fire_due(now, &mut self.handlers);
        }
    }

    fn fleet_view(&mut self) -> FleetView {
        let graph = self.handlers.graph.clone();
        let backends = self.handlers.backends.clone();
        let sched = self.driver.sched_mut();
        sched.share_service();
        let service = sched.take_service();
        let spend = sched.take_quota_spend();
        let (active, decays) = sched.fair_share_view();
        let mut upstreams = Vec::new();
        for (i, r) in sched.replicas().iter().enumerate() {
            let Some(Backend::Http(u)) = backends.get(r.spec.tag as usize) else {
                continue;
            };
            let Some((busy, backlog)) = sched.demand(i) else {
                continue;
            };
            let tenants = backlog
                .iter()
                .map(
                    |(t, _)| match t.and_then(|t| graph.tenants.get(t as usize)) {
                        Some(tn) => (tn.name.clone(), tn.weight.max(1e-9)),
                        None => ("-".to_string(), 1.0),
                    },
                )
                .collect();
            upstreams.push(UpstreamDemand {
                replica: i,
                key: format!(
                    "{}|{}",
                    u.base_url(),
                    graph.variant_name(r.spec.model, r.spec.variant)
                ),
                capacity: r.spec.max_batch,
                in_force: r.slots(),
                busy,
                queued: backlog.iter().map(|(_, n)| n).sum(),
                tenants,
            });
        }
        FleetView {
            graph,
            service,
            spend,
            active,
            decays,
            upstreams,
        }
    }

    /// Feeds one event at `now`, after every timer the clock has passed.
    fn feed(&mut self, now: Micros, event: Event) {
        self.driver.fire_due(now, &mut self.handlers);
        self.handlers.arriving = matches!(event, Event::Arrive(_));
        self.driver.feed(now, event, &mut self.handlers);
        self.handlers.arriving = false;
    }

    /// Cancels a request the executor still tracks (a no-op otherwise).
    fn cancel(&mut self, now: Micros, id: ReqId) {
        if self.handlers.reqs.remove(&id).is_some() {
            self.feed(now, Event::Cancel { id });
        }
    }

    fn command(&mut self, c: Command) {
        let now = self.clock.now();
        match c {
            Command::Submit {
                arrival,
                events,
                claim,
            } => {
                let id = arrival.id;
                self.arrivals += 1;
                self.handlers.reqs.insert(
                    id,
                    Entry {
                        events,
                        claim,
                        sent: 0,
                        target: 0,
                    },
                );
                if self.engines {
                    // The latest scrape decides whether it may start now.
                    self.engine_gates(now);
                }
                self.feed(now, Event::Arrive(arrival));
            }
            Command::Cancel(id) => self.cancel(now, id),
            Command::CacheStore {
                graph,
                tier,
                key,
                content,
                payload,
                done,
            } => {
                let sched = self.driver.sched_mut();
                if Arc::ptr_eq(&graph, &self.handlers.graph) {
                    let _ = sched.cache_store_content(now, tier, key, content, payload);
                }
                let _ = done.send((sched.caches().len(tier), sched.semantic_caches().len(tier)));
            }
            Command::Complete { id, output_tokens } => {
                self.feed(now, Event::Complete { id, output_tokens });
            }
            Command::FirstToken(id) => self.feed(now, Event::FirstToken { id }),
            Command::Ended {
                id,
                output_tokens,
                first_token,
            } => {
                if first_token {
                    self.feed(now, Event::FirstToken { id });
                }
                self.feed(now, Event::Complete { id, output_tokens });
                self.cancel(now, id);
            }
            Command::Swap {
                graph,
                plan,
                version,
                done,
            } => {
                self.driver.fire_due(now, &mut self.handlers);
                self.handlers.graph = graph.clone();
                self.handlers.routes.clear();
                self.handlers.version = version;
                let actions = self.driver.swap(now, graph, plan, &mut self.handlers);
                let redecide: Vec<ReqId> = actions
                    .iter()
                    .filter_map(|a| match a {
                        Action::Reject {
                            id,
                            reason: Reason::PolicyChanged,
                            ..
                        } => Some(*id),
                        _ => None,
                    })
                    .collect();
                let _ = done.send(redecide);
            }
            Command::FleetView(reply) => {
                let _ = reply.send(self.fleet_view());
            }
            Command::SyncBudgets(s) => {
                self.driver.sched_mut().sync_budgets(&s);
            }
            Command::FleetApply {
                graph,
                service,
                slots,
                quotas,
                scale,
            } => {
                if Arc::ptr_eq(&graph, &self.handlers.graph) {
                    let sched = self.driver.sched_mut();
                    sched.set_quota_scale(scale);
                    sched.mirror_quotas(&quotas);
                    sched.set_service(&service);
                    for (r, cap) in slots {
                        if self.fleet_caps.len() <= r {
                            self.fleet_caps.resize(r + 1, None);
                        }
                        self.fleet_caps[r] = Some(cap);
                        sched.set_slot_cap(r, Some(cap));
                    }
                    // An engine's gate tightens the grant.
                    self.engine_gates(now);
                    self.feed(now, Event::Tick);
                }
            }
            Command::Snapshot(reply) => {
                self.driver.sched_mut().purge_semantic(now);
                let _ = reply.send(self.snapshot());
            }
            Command::ExactHolds { content, reply } => {
                let _ = reply.send(self.driver.sched().exact_holds(&content));
            }
            Command::SetCanary { canary, done } => {
                match canary {
                    Some((c, v)) => {
                        self.driver.sched_mut().set_canary(Some(c));
                        self.handlers.canary_version = Some(v);
                    }
                    None => {
                        self.driver.sched_mut().set_canary(None);
                        self.handlers.canary_version = None;
                    }
                }
                let _ = done.send(());
            }
            Command::Signals(reply) => {
                let _ = reply.send((
                    self.handlers.graph.clone(),
                    self.driver.sched().signals().clone(),
                ));
            }
            Command::Forecast {
                request,
                items,
                reply,
            } => {
                let f = self.driver.sched().forecast(&request, items);
                let _ = reply.send((self.handlers.graph.clone(), f));
            }
            Command::CheckHealth => self.check_health(),
            Command::StepRan {
                replica,
                until,
                result,
            } => {
                if let Err(e) = &result {
                    tracing::error!(
                        replica,
                        "GPU step failed: {e}; replica taken out of service"
                    );
                }
                self.driver.fire_due(now, &mut self.handlers);
                self.driver
                    .step_ran(now, replica, until, result.is_ok(), &mut self.handlers);
            }
        }
    }

    /// Folds upstream breakers into the scheduler: a replica whose upstream
    /// cannot take requests goes down (its queue waits for others), and
    /// comes back up when the breaker lets requests through again.
    fn check_health(&mut self) {
        let now = self.clock.now();
        let states: Vec<bool> = self
            .driver
            .sched()
            .replicas()
            .iter()
            .map(|r| {
                self.handlers
                    .backends
                    .get(r.spec.tag as usize)
                    .is_none_or(Backend::ready)
            })
            .collect();
        self.healthy.resize(states.len(), true);
        for (r, ok) in states.into_iter().enumerate() {
            if self.healthy[r] == ok {
                continue;
            }
            self.healthy[r] = ok;
            let event = if ok {
                tracing::info!(replica = r, "upstream available again");
                Event::ReplicaUp { replica: r }
            } else {
                tracing::warn!(replica = r, "upstream unavailable: taken out of dispatch");
                Event::ReplicaDown { replica: r }
            };
            self.feed(now, event);
        }
        self.engine_gates(now);
    }

    /// Folds engine-aware upstreams' gates into the scheduler's slot caps
    /// (with a fleet's grant of a shared upstream, the smaller); a raised
    /// cap starts waiting work at once.
    fn engine_gates(&mut self, now: Micros) {
        let unbounded = |c: Option<u32>| c.unwrap_or(u32::MAX);
        let mut changes = Vec::new();
        let mut loads = Vec::new();
        let mut raised = false;
        {
            let sched = self.driver.sched();
            let shared = sched.shares_upstreams();
            for (r, rep) in sched.replicas().iter().enumerate() {
                let Some(Backend::Http(u)) = self.handlers.backends.get(rep.spec.tag as usize)
                else {
                    continue;
                };
                let Some(gate) = u.slot_gate() else {
                    continue;
                };
                // A fresh scrape feeds the pool signals.
                let load = gate.load.filter(|_| gate.state != "fallback").map(|l| {
                    crate::sched::replica::EngineSignals {
                        running: l.running,
                        waiting: l.waiting,
                        kv_cache: l.kv_cache,
                    }
                });
                if rep.engine != load {
                    loads.push((r, load));
                }
                let fleet = match self.fleet_caps.get(r).copied().flatten() {
                    Some(c) => Some(c),
                    // A shared upstream runs nothing until the fleet grants.
                    None if shared && rep.spec.external => Some(0),
                    None => None,
                };
                let want = min_cap(fleet, Some(gate.cap));
                if rep.slot_cap != want {
                    raised |= unbounded(want) > unbounded(rep.slot_cap);
                    changes.push((r, want));
                }
            }
        }
        let sched = self.driver.sched_mut();
        for (r, cap) in changes {
            sched.set_slot_cap(r, cap);
        }
        for (r, load) in loads {
            sched.set_engine_load(r, load);
        }
        if raised {
            self.feed(now, Event::Tick);
        }
    }

    fn snapshot(&self) -> Snapshot {
        let g = &self.handlers.graph;
        let sched = self.driver.sched();
        let elapsed = (self.clock.now() as f64 / 1e6).max(1e-9);
        let replicas = sched
            .replicas()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let backend = self.handlers.backends.get(r.spec.tag as usize);
                let model = g.models.get(r.spec.model as usize);
                ReplicaRow {
                    index: i,
                    pool: g
                        .pools
                        .get(r.spec.pool as usize)
                        .map(|p| p.name.clone())
                        .unwrap_or_default(),
                    model: model.map(|m| m.name.clone()).unwrap_or_default(),
                    variant: model
                        .and_then(|m| m.variants.get(r.spec.variant as usize))
                        .map(|v| v.name.clone())
                        .unwrap_or_default(),
                    backend: backend.map(Backend::name).unwrap_or_else(|| "sim".into()),
                    up: r.up,
                    draining: r.draining,
                    available: match backend {
                        Some(b @ Backend::Http(_)) => b.ready(),
                        _ => r.up,
                    },
                    running: r.running.len(),
                    slots: r.spec.max_batch,
                    kv_used_tokens: r.kv_used(),
                    kv_capacity_tokens: r.spec.kv_capacity,
                    engine: match backend {
                        Some(Backend::Http(u)) => u.slot_gate(),
                        _ => None,
                    },
                    busy_fraction: if r.spec.external {
                        f64::from(r.running.len() as u32) / f64::from(r.spec.max_batch.max(1))
                    } else {
                        (r.busy_seconds / elapsed).min(1.0)
                    },
                }
            })
            .collect();
        Snapshot {
            version: self.handlers.version.to_string(),
            queues: sched.queue_snapshot(),
            replicas,
            in_flight: self.handlers.reqs.len(),
            arrivals: self.arrivals,
            semantic_entries: g
                .tiers
                .iter()
                .enumerate()
                .filter(|(_, t)| t.cache.semantic.is_some())
                .map(|(i, t)| {
                    (
                        t.name.clone(),
                        sched.semantic_caches().len(i as crate::graph::TierId),
                    )
                })
                .collect(),
            budgets: sched.budgets(),
        }
    }
}
