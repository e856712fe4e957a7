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
//! - `admit` passes each arrival through an ordered list of gates
//!   (session and retry budgets, the policy's refusals, capacity, quota —
//!   [`quota`] reserves tokens, requests and concurrency — and the
//!   estimated wait against the tier's SLO), refusing early with a reason
//!   and a Retry-After;
//! - [`queue`] orders waiting work: tiers by priority plus aging, tenants
//!   within a tier by weighted service (VTC), requests within a tenant by
//!   arrival, or by deadline for completion-window tiers;
//! - [`replica`] runs continuous batching under a sequence and token
//!   budget, with paged KV memory (vLLM-style 16-token blocks taken as a
//!   sequence's context grows, the prefix cache shared and reference-counted
//!   in the same pool) so it is never over-committed: when blocks run out,
//!   the lowest-ranked sequence there is preempted and recomputed later.
//!   Lower tiers' preemptible work is also preempted when a higher tier
//!   would otherwise wait, on every replica; an external replica (an HTTP
//!   upstream) only has its slots filled, the upstream runs the batch (and
//!   the environment cancels a preempted sequence's upstream request);
//! - [`swap`] moves queues, running work, quotas and fair share to a new
//!   policy version by name while requests wait and run.

mod admit;
mod bucket;
pub mod budget;
pub mod cache;
pub mod canary;
mod exception;
pub mod forecast;
pub mod hold;
pub mod live;
pub mod plan;
pub mod queue;
pub mod quota;
pub mod ratelimit;
pub mod replica;
mod reserve;
pub mod route;
pub mod scoped;
pub mod semantic;
mod sizes;
pub mod swap;
#[cfg(test)]
mod testkit;
mod timers;

use crate::graph::signal::TierField;
use crate::graph::{DecisionGraph, PoolId, Request, Signals, TenantId, TierId};
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
    /// A new policy version no longer has the request's tier, tenant or
    /// variant (or no replica for it) while it waited: re-submit it to be
    /// decided under the new version.
    PolicyChanged,
    /// Another tier reclaimed the share of the pool it reserves (`reserve`):
    /// this request waited for it, or was preempted by it.
    Reservation,
    /// The tier's own quota (`tier T { quota { … } }`): tokens, requests,
    /// concurrency or GPU-seconds shared by all its requests.
    TierQuota,
    /// The model's quota (`model M { quota { … } }`).
    ModelQuota,
    /// The fleet's shared state store is unreachable and the operator
    /// chose to refuse meanwhile (`[state] on_unavailable = "refuse"`).
    SharedState,
    /// The request could not meet its tier's TTFT SLO even alone on an
    /// idle replica (its prompt's prefill takes longer): no wait, load or
    /// fairness is to blame, and retrying will not help.
    Infeasible,
    /// The policy holds the tier's work out of dispatch while a condition
    /// is true (`admit T { when … => hold }`).
    Held,
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
            Reason::PolicyChanged => "policy-changed",
            Reason::Reservation => "reservation",
            Reason::TierQuota => "tier-quota",
            Reason::ModelQuota => "model-quota",
            Reason::SharedState => "shared-state-unavailable",
            Reason::Infeasible => "infeasible",
            Reason::Held => "held",
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
    /// The request's own completion window from its arrival, in place of
    /// its tier's `slo { window }`: a batch item carries what is left of
    /// its batch's window, so its deadline is the batch's.
    pub window: Option<Micros>,
    /// The tenant's quotas (requests, tokens, concurrency, GPU-seconds)
    /// were already claimed for this request across a fleet of replicas
    /// (the gateway's shared state): the scheduler counts it in flight but
    /// does not charge its own buckets again. Only the tenant the request
    /// names (by `tenant` or its key) was claimed; a rule that moves it to
    /// another tenant is charged here, at [`Config::quota_scale`].
    pub quota_claimed: bool,
    /// What a fleet's claim covered besides the tenant (its tier's and
    /// model's quotas) and the fleet's level of the tenant's buckets
    /// ([`quota::FleetClaim`]); `None` outside a fleet.
    pub fleet: Option<Box<quota::FleetClaim>>,
    /// The request's content hash ([`cache::content_key`]) when it is
    /// cacheable; `None` when it is not (it is then never looked up).
    pub cache: Option<cache::Key>,
    /// Its question's embedding and context hash, when it is cacheable and
    /// some tier has a semantic cache ([`semantic`]); `None` otherwise (and
    /// in a replay, which has no prompts).
    pub semantic: Option<semantic::Probe>,
}

// An arrival (with its own window) is a little over clippy's 200 bytes;
// an event is built once and moved into `handle`, so boxing it would only
// add an allocation per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Arrive(Arrival),
    /// The step that replica `replica` was running has finished.
    StepDone {
        replica: usize,
    },
    /// A replica failed or was drained: its running sequences go back to
    /// the head of their queues (nothing is lost) and it takes no work.
    /// Sequences on an external replica stay: the upstream owns them until
    /// they are reported complete or cancelled. One that no live replica
    /// could run again after a policy swap is refused (`policy-changed`).
    ReplicaDown {
        replica: usize,
    },
    /// A replica is (back) in service.
    ReplicaUp {
        replica: usize,
    },
    /// Time passed: queue timeouts, delays and batching holds fire.
    Tick,
    /// The client went away. Wherever the request is (delayed, queued or
    /// running) it is removed, its memory and batch slot freed, its quota
    /// released (charging what was served), and [`Action::Cancelled`]
    /// emitted. An unknown or finished id is ignored.
    Cancel {
        id: ReqId,
    },
    /// An external replica's upstream finished request `id` after
    /// producing `output_tokens`: it ends with [`Action::Finished`] and its
    /// slot is refilled. Ignored unless `id` runs on an external replica.
    Complete {
        id: ReqId,
        output_tokens: u32,
    },
    /// An external replica's upstream produced request `id`'s first token
    /// (for the tier's TTFT signals; the schedule does not change).
    FirstToken {
        id: ReqId,
    },
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
        /// When it must be finished: its own window ([`Arrival::window`])
        /// or else its tier's `slo { window }`, from its arrival; `None`
        /// for work without a completion window.
        deadline: Option<Micros>,
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
    /// `wasted_gpu_seconds` is the part of it that did not serve the
    /// answer: recomputing KV it had before a preemption, and an
    /// upstream's attempts that were preempted.
    Finished {
        id: ReqId,
        gpu_seconds: f64,
        wasted_gpu_seconds: f64,
    },
    /// A running sequence was preempted to make room; it is queued again.
    Preempted {
        id: ReqId,
        replica: usize,
        by: ReqId,
    },
    /// The request was cancelled ([`Event::Cancel`]); nothing more will
    /// happen to it.
    Cancelled { id: ReqId },
    /// Answered from its tier's exact cache, after the policy decided it and
    /// its requests quota was charged: it takes no queue, replica or GPU
    /// time; nothing more will happen to it. `payload` is what was stored
    /// (`None` in a replay).
    CacheHit {
        id: ReqId,
        key: cache::Key,
        payload: Option<std::sync::Arc<str>>,
        /// The cosine similarity of a semantic cache's hit; `None` for the
        /// exact cache.
        similarity: Option<f32>,
    },
    /// Cacheable and not in its tier's cache: it goes on through admission,
    /// and a complete answer may be stored under `key`
    /// ([`Scheduler::cache_store`]).
    CacheMiss { id: ReqId, key: cache::Key },
}

/// One (tier, tenant) queue, for the gateway's `/admin/queues` and metrics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueRow {
    pub tier: String,
    pub tenant: Option<String>,
    /// Requests queued.
    pub depth: usize,
    /// Requests held outside the queue (a delay window, a batching hold).
    pub parked: usize,
    /// How long the oldest queued request has waited (0 when none).
    pub oldest_wait: Micros,
    /// Weighted service received (the VTC counter, decayed to now).
    pub served: f64,
    /// This tenant's part of the service its tier has given, 0 to 1.
    pub share: f64,
}

/// Tunables that are not policy: how the scheduler itself behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub mode: Mode,
    /// Aging for tiers that declare none and are not `may_starve`.
    pub default_aging: Micros,
    /// Admission refuses when the estimated time to first token exceeds
    /// the tier's TTFT SLO times this factor (or the estimated wait exceeds
    /// the completion window, for batch tiers). 1 keeps the SLO's word.
    pub admission_slack: f64,
    /// Prefill tokens and generated tokens weigh this much in fair share.
    pub vtc_input_weight: f64,
    pub vtc_output_weight: f64,
    /// Service older than about this much counts less in fair share
    /// (exponential decay); `None` keeps all history.
    pub fairness_window: Option<Micros>,
    /// A sequence may be preempted at most this many times (thrash budget).
    pub max_preemptions_per_seq: u32,
    /// Whether a tenant asking within its weighted share may take a slot
    /// from its own tier's running work of a tenant above it (on replicas
    /// kiln steps; [`Scheduler::fair_preempts`]). On by default; off to
    /// compare.
    pub fair_preemption: bool,
    /// Minute of day at time 0 and weekday (0 = Monday), for time-of-day rules.
    pub start_minute_of_day: u32,
    pub start_weekday: u8,
    /// The date at time 0 (days since 1970-01-01), with the two above.
    pub start_date: i32,
    /// The Unix time (ms) of time 0 on a wall clock: the clock signals
    /// (`time`, `weekday`, `date`, `day`) then read the policy's time zone
    /// at `start_unix_ms + now`, daylight saving included, instead of the
    /// three above.
    pub start_unix_ms: Option<i64>,
    /// How requests are sent to replicas ([`route`]).
    pub routing: route::Routing,
    /// Seeds everything random in the core (the `random` router).
    pub seed: u64,
    /// How much longer work without a first-token SLO (batch, background)
    /// may make the steps of work with one, on a replica both run on (see
    /// [`replica::Replica::backfill_slack`]): backfill uses idle capacity
    /// without slowing interactive work by more than this.
    pub backfill_slack: f64,
    /// The same for backfill *prefill* in a step that prefills other work
    /// (a first token waits for that step). 1%: at 10% a ServeGen mix
    /// whose interactive tier is 85% of the work (prefill-bound) lost 8%
    /// of its capacity at SLO to batch prompts sharing those steps
    /// (0.1146x against 0.1250x with no batch); at 1% none. A lower slack
    /// for every step instead starved the batch's decodes: its sequences
    /// held their slots and interactive work was refused for room
    /// (BENCHMARKS.md, "Backfill prefill").
    pub backfill_prefill_slack: f64,
    /// Share of each tenant's quotas this scheduler enforces by itself: 1
    /// alone; 1/N in each of N replicas sharing state, for requests not
    /// claimed across the fleet (while the shared store is down, with
    /// `on_unavailable = "local"`), so that together they stay within it.
    pub quota_scale: f64,
    /// Record each admitted or quota-refused request's rate limits
    /// ([`Scheduler::rate_limits`]) for its answer's `x-ratelimit-*`
    /// headers (the gateway does; a replay has no use for them).
    pub rate_limits: bool,
    /// HTTP upstreams are shared with other replicas of a fleet: an
    /// external replica runs nothing until the fleet grants it slots
    /// ([`Scheduler::set_slot_cap`]), so no start or swap can overshoot.
    pub shared_upstreams: bool,
    /// Memory bounds of the exact caches beyond each tier's `entries`.
    pub cache_bounds: cache::Bounds,
    /// A replay: a request that missed its tier's cache is stored as it
    /// finishes (its answer's size estimated from its output tokens). The
    /// gateway stores answers itself once they are complete.
    pub cache_on_finish: bool,
    /// How long an admitted request whose admission set no queue bound
    /// (anything but `queue max_wait`) may wait in the queue before it is
    /// refused with `timeout`; a request with a completion window waits at
    /// least until its deadline. `None` (the default, and every replay's
    /// unless set) waits without a bound. The gateway sets it from
    /// `[limits] default_queue_bound`, so that nothing it accepted hangs.
    pub default_max_wait: Option<Micros>,
    /// Admission is blind to a prompt's size below this quantile of the
    /// tier's recent prompts (each is priced as that long), so a tenant's
    /// place in fair order, not the length of its prompts, decides what of
    /// it is admitted; `None` prices each prompt as it is. See
    /// `docs/fair-admission.md`.
    pub admission_size_quantile: Option<f64>,
}

/// A replica for `spec` under `cfg` (see [`Config::shared_upstreams`]).
pub(crate) fn replica_for(cfg: &Config, spec: plan::ReplicaSpec) -> Replica {
    let mut r = Replica::new(spec);
    if cfg.shared_upstreams && r.spec.external {
        r.slot_cap = Some(0);
    }
    r
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Kiln,
            default_aging: 60 * SEC,
            admission_slack: 1.0,
            vtc_input_weight: 1.0,
            vtc_output_weight: 2.0,
            fairness_window: Some(600 * SEC),
            max_preemptions_per_seq: 2,
            fair_preemption: true,
            start_minute_of_day: 12 * 60,
            start_weekday: 0,
            start_date: crate::graph::IDLE_DATE,
            start_unix_ms: None,
            routing: route::Routing::Kiln,
            seed: 0,
            backfill_slack: 0.1,
            backfill_prefill_slack: 0.01,
            quota_scale: 1.0,
            rate_limits: false,
            shared_upstreams: false,
            cache_bounds: cache::Bounds::default(),
            cache_on_finish: false,
            default_max_wait: None,
            admission_size_quantile: Some(0.9),
        }
    }
}

/// The request an estimate is for.
pub(crate) struct Estimating<'a> {
    pub key: (u16, u16),
    pub tier: TierId,
    pub tenant: Option<TenantId>,
    pub prompt: u64,
    pub output: u32,
    /// The request's own completion window ([`Arrival::window`]), if any.
    pub window: Option<Micros>,
    /// For a request already queued: the fair-share cost and tokens of its
    /// tenant's work queued before it (a new one has all of it before it).
    pub own: Option<(f64, f64)>,
    /// Its prompt's prefix blocks: what a replica holds of them it does not
    /// prefill again.
    pub prefix: &'a [u64],
    /// Admission's size-neutral reference ([`sizes`]): a prompt shorter
    /// than this many tokens (after its cached prefix) is priced as this
    /// long; 0 prices each prompt as it is.
    pub reference: u64,
}

/// A wait estimate: when the request would start (as estimated from the
/// queues, before correction), when its first token would come (corrected
/// by the estimator's recent error), and whether its tenant is above its
/// fair share.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Estimate {
    pub raw_start: Micros,
    pub first_token: Micros,
    /// Its last token: the first, then its own decode in the batch it
    /// joins. What a completion window is held against.
    pub finish: Micros,
    /// Its limit is a completion window (its tier has no TTFT SLO): held
    /// against [`Self::finish`], not the first token.
    pub by_window: bool,
    pub above_share: bool,
    /// Nothing queued goes ahead of it (its wait is the next slot).
    pub first_in_order: bool,
    /// Its replicas were contended ([`Scheduler::contended`]) when it was
    /// made: read once per arrival, passed on rather than read again.
    pub contended: bool,
}

/// How far off wait estimates run: a running estimate of a high quantile
/// of (actual wait / estimated wait) over requests that started, learnt
/// by stochastic approximation in the log domain (no history kept, the
/// same sequence of events gives the same value). Estimates are
/// multiplied by it, so admission under a TTFT SLO keeps its word for
/// that share of requests whatever the workload's mix. On contended
/// replicas never by less than 1; below [`CONTENDED`] by less too, so a
/// pool with room does not refuse work on waits it overestimates (3-5x at
/// 42% load on an L4, where every refusal was of work fifo served in
/// time).
#[derive(Debug, Clone, Copy, Default)]
struct Misestimate {
    /// ln of the quantile.
    log_q: f64,
}

impl Misestimate {
    /// The quantile learnt: 80% of recent requests started no later than
    /// their estimate times this (admission then keeps its word for well
    /// over 95% of admitted requests: the estimate is checked against the
    /// SLO with the rest of its margin; see BENCHMARKS.md).
    const QUANTILE: f64 = 0.8;
    const STEP: f64 = 0.02;

    fn note(&mut self, estimated: Micros, actual: Micros) {
        // 10 ms either side keeps tiny waits from dominating.
        let r = ((actual as f64 + 10_000.0) / (estimated as f64 + 10_000.0)).ln();
        let below = if r <= self.log_q { 1.0 } else { 0.0 };
        self.log_q = (self.log_q + Self::STEP * (Self::QUANTILE - below) / (1.0 - Self::QUANTILE))
            .clamp(-3.0, 5.0);
    }

    fn factor(&self) -> f64 {
        self.log_q.exp()
    }
}

type MisKey = ((u16, u16), TierId, Option<TenantId>);

/// Queued work started recently is counted over about this long.
pub const DRAIN_WINDOW: Micros = 10 * SEC;

/// For fair share's own preemption, what each tenant asks and is admitted
/// is read over about this long: long enough that a light tenant's few
/// requests are not read as a burst above its share, short enough to see a
/// flood within it.
const SHARE_WINDOW: Micros = 60 * SEC;

/// A tenant whose [`Scheduler::share_used`] is over this is using about its
/// weighted share: admission prices it size-neutrally, and its sequences go
/// before those of tenants under it when KV blocks run out.
const USING_ITS_SHARE: f64 = 0.9;

/// A tenant whose [`Scheduler::share_used`] is over this is above its
/// weighted share (5% of slack for rates read over a decaying window).
const ABOVE_ITS_SHARE: f64 = 1.05;

/// A replica's real load is read over about this long. A flood arriving
/// at a pool idle for longer reads contended after about 27 s. 10 s read
/// it in 9 s, but an overloaded one-GPU pool then read below the line in
/// its lulls, and its batch tier's deadlines slipped (`tests/simulate.rs`
/// batch report: 6 s late to 11 s).
const LOAD_WINDOW: Micros = 30 * SEC;

/// Below this real load (over [`LOAD_WINDOW`]) a variant's replicas have
/// room: whatever each tenant sends, none takes capacity another is due.
/// There admission prices no tenant as above its share, counts no later
/// arrival as going ahead, lets the learnt factor shorten waits it
/// overestimates, overlaps the replica's pending prefill with the wait,
/// and sheds nothing. Read against the admitted total alone, a tenant
/// sending more than its weight's part of an L4 at 42% load was priced as
/// over its share and refused 6% of its requests, all of which fifo served
/// in time (issue 26). At 0.8 a KV-bound 70B pair under a flood read below
/// the line at moments and its fairness moved; at 0.6 no overloaded mix of
/// the bench does.
const CONTENDED: f64 = 0.6;

/// A sum decayed exponentially over `WINDOW`: added to as things happen,
/// read as a rate that follows the recent past. No history kept, so the
/// same sequence of events gives the same value.
#[derive(Debug, Clone, Copy, Default)]
struct Decayed<const WINDOW: Micros> {
    sum: f64,
    at: Micros,
}

impl<const WINDOW: Micros> Decayed<WINDOW> {
    fn decayed(&self, now: Micros) -> f64 {
        let dt = now.saturating_sub(self.at) as f64 / WINDOW as f64;
        self.sum * (-dt).exp()
    }

    fn add(&mut self, now: Micros, x: f64) {
        self.sum = (self.decayed(now) + x).max(0.0);
        self.at = now;
    }

    /// Per second, as if the sum had always been accumulating.
    fn rate(&self, now: Micros) -> f64 {
        self.decayed(now) / (WINDOW as f64 / SEC as f64)
    }
}

/// How fast queued work starts on a variant's replicas: tokens started,
/// so the rate follows the load.
type Drain = Decayed<DRAIN_WINDOW>;

/// The work a replica's steps did (at its saturated throughput, so a
/// second of it is a second of full capacity): its rate is the replica's
/// real load.
#[derive(Debug, Clone, Copy, Default)]
struct Load {
    work: Decayed<LOAD_WINDOW>,
    since: Option<Micros>,
}

impl Load {
    fn add(&mut self, now: Micros, work: f64) {
        self.work.add(now, work.max(0.0));
        self.since.get_or_insert(now);
    }

    /// Seconds of work a second. Until a whole window has passed since the
    /// first step, a constant load `u` would have summed only
    /// `u * window * (1 - e^(-t/window))`, so that is what it is divided by.
    fn rate(&self, now: Micros) -> f64 {
        let Some(since) = self.since else {
            return 0.0;
        };
        let t = now.saturating_sub(since) as f64 / LOAD_WINDOW as f64;
        let span = (LOAD_WINDOW as f64 / SEC as f64) * (1.0 - (-t).exp());
        if span > 0.0 {
            self.work.decayed(now) / span
        } else {
            0.0
        }
    }
}

/// What the scheduler remembers about a request it holds.
#[derive(Debug, Clone)]
struct Held {
    tenant: Option<TenantId>,
    /// Reserved quota tokens, refunded in part when the request finishes.
    reserved_tokens: f64,
    /// What it reserved of its tier's and model's quotas ([`scoped`]).
    scoped: Option<scoped::Scoped>,
}

/// The scheduler. Owns queues, replicas and quota state; borrows nothing.
pub struct Scheduler {
    /// The graph in force: `base` with today's exceptions applied.
    graph: std::sync::Arc<DecisionGraph>,
    /// The policy version as compiled ([`exception`]).
    base: std::sync::Arc<DecisionGraph>,
    /// Which of `base`'s exceptions `graph` applies.
    exceptions_active: Vec<bool>,
    /// The day `exceptions_active` was last worked out for.
    exceptions_date: Option<i32>,
    cfg: Config,
    now: Micros,
    replicas: Vec<Replica>,
    /// Replicas by (model, variant), for dispatch.
    by_variant: HashMap<(u16, u16), Vec<usize>>,
    queues: Queues,
    quotas: Quotas,
    /// Tier and model quotas.
    scoped: scoped::ScopedQuotas,
    /// Tenants' and tiers' money budgets.
    budgets: budget::Budgets,
    /// The rate limits of requests the quota gate saw during the last
    /// [`Scheduler::handle`] (with [`Config::rate_limits`]).
    limits_out: Vec<(ReqId, ratelimit::RateLimits)>,
    held: HashMap<ReqId, Held>,
    /// Requests waiting for a delay window or a batching hold.
    timers: timers::Timers,
    sessions: HashMap<String, (TierId, u64)>,
    /// Draining replicas whose variant a policy swap dropped, by the names
    /// they had, so a later version that has them again can take them.
    gone: HashMap<usize, swap::ReplicaKey>,
    signals: Signals,
    /// Baselines decide on an idle fleet: the policy classifies and routes
    /// for them, but its admission control and quotas are kiln's, not theirs.
    idle: Signals,
    /// A canary version deciding part of the traffic ([`canary`]).
    canary: Option<canary::Canary>,
    /// Whether the canary decided the last arrival.
    last_canary: bool,
    /// The clock signals, read once a minute: (minute since time 0, what
    /// the clock read).
    civil: Option<(u64, crate::units::calendar::Civil)>,
    out: Vec<Action>,
    /// Queued work started per (model, variant), for wait estimates.
    drain: HashMap<(u16, u16), Drain>,
    /// Per replica, the work its steps did lately at its saturated
    /// throughput: its real load, 0 to 1 ([`Load`]).
    load: HashMap<usize, Load>,
    /// How far off wait estimates have run, per (model, variant, tier).
    /// (Per tenant was tried: a tenant pushed back by others then learnt a
    /// larger factor, was refused more and fell below its share; on
    /// generated mixes the worst deviation went from 7% to over 200%.)
    /// By route, tier and kind of estimate (first in fair order or not).
    misestimate: HashMap<((u16, u16), TierId, bool), Misestimate>,
    /// Recent sizes of prompts to prefill, per (model, variant) and tier:
    /// admission's size-neutral reference ([`sizes`]).
    sizes: HashMap<((u16, u16), TierId), sizes::Sizes>,
    /// Work admitted lately per (model, variant, tier, tenant), as
    /// (fair-share cost, tokens), for what will arrive while one waits.
    incoming: HashMap<MisKey, (Drain, Drain)>,
    /// Work admitted per (model, variant, tier, tenant) in fair-share cost
    /// over [`SHARE_WINDOW`] ([`Self::fair_preempts`]).
    admitted: HashMap<MisKey, Decayed<SHARE_WINDOW>>,
    /// What each reached admission's wait check with over [`SHARE_WINDOW`],
    /// refused or not, in fair-share cost: what it asks
    /// ([`Self::fair_preempts`]).
    asked: HashMap<MisKey, Decayed<SHARE_WINDOW>>,
    /// When `asked` began: shares read over a fraction of the window say
    /// little (in its first seconds every tenant reads as asking only what
    /// it was admitted).
    asked_since: Option<Micros>,
    /// When a request of each tier last started (to tell a request that
    /// was overtaken by a higher tier from one that only lacked room).
    tier_started: Vec<Micros>,
    /// Per tier, while the policy holds it ([`hold`]): the request the
    /// hold is re-decided with.
    holds: Vec<Option<Request>>,
    /// Chooses a replica for each queued request ([`route`]).
    router: route::Router,
    /// Per replica, tokens of queued (or parked) requests routed to it:
    /// added when a routed request is held ([`Self::pin`]), taken off when
    /// it leaves the queue ([`Self::unpin`]: it starts, expires, is
    /// cancelled or refused by a swap). Kept here, not in the queues.
    pinned: Vec<u64>,
    /// The requests counted in `pinned`, per replica, to release them when
    /// their replica goes down or drains.
    pinned_ids: Vec<rustc_hash::FxHashSet<ReqId>>,
    /// The measured signals' windows ([`live`]).
    live: live::Live,
    /// Buffers for [`Self::refresh_signals`], kept between arrivals.
    scratch: Scratch,
    /// Per pool, the tiers reserving a share of it ([`reserve`]).
    reserves: Vec<Vec<(TierId, f64)>>,
    /// The tiers' exact caches ([`cache`]).
    caches: cache::Caches,
    /// The tiers' semantic caches ([`semantic`]).
    semantic: semantic::SemanticCaches,
    /// Requests that missed their tier's cache, until they end: where a
    /// complete answer would be stored (replays, [`Config::cache_on_finish`]).
    cache_pending: HashMap<ReqId, (TierId, cache::Key, u32)>,
}

/// Per-pool sums [`Scheduler::refresh_signals`] builds on every arrival.
#[derive(Debug, Default)]
struct Scratch {
    /// (KV tokens held, KV capacity)
    kv: Vec<(u64, u64)>,
    running: Vec<usize>,
    /// Replicas in service.
    capacity: Vec<f64>,
    pools: Vec<PoolId>,
}

impl Scheduler {
    /// Builds a scheduler for a graph and a deployment plan (replicas with
    /// their cost models).
    pub fn new(graph: std::sync::Arc<DecisionGraph>, plan: Plan, cfg: Config) -> Scheduler {
        let graph_tiers = graph.tiers.len();
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
                replica_for(&cfg, spec)
            })
            .collect();
        let signals = Signals::idle(&graph);
        let idle = signals.clone();
        let quotas = Quotas::scaled(&graph, cfg.quota_scale);
        let scoped = scoped::ScopedQuotas::scaled(&graph, cfg.quota_scale);
        let budgets = budget::Budgets::new(&graph, cfg.quota_scale);
        let queues = Queues::new(&graph, &cfg);
        let router = route::Router::new(cfg.routing, cfg.seed);
        let pinned = vec![0; replicas.len()];
        let live = live::Live::new(&graph);
        let reserves = Scheduler::reserves_of(&graph);
        let caches = cache::Caches::new(&graph, cfg.cache_bounds);
        let semantic = semantic::SemanticCaches::new(&graph, cfg.cache_bounds);
        let exceptions_active = vec![false; graph.exceptions.len()];
        let mut s = Scheduler {
            caches,
            semantic,
            cache_pending: HashMap::default(),
            base: graph.clone(),
            exceptions_active,
            exceptions_date: None,
            graph,
            cfg,
            now: 0,
            replicas,
            by_variant,
            queues,
            quotas,
            budgets,
            scoped,
            limits_out: Vec::new(),
            held: HashMap::default(),
            timers: timers::Timers::default(),
            sessions: HashMap::default(),
            gone: HashMap::default(),
            signals,
            idle,
            canary: None,
            last_canary: false,
            civil: None,
            out: Vec::new(),
            tier_started: vec![0; graph_tiers],
            holds: vec![None; graph_tiers],
            drain: HashMap::default(),
            load: HashMap::default(),
            misestimate: HashMap::default(),
            sizes: HashMap::default(),
            incoming: HashMap::default(),
            admitted: HashMap::default(),
            asked: HashMap::default(),
            asked_since: None,
            router,
            pinned,
            pinned_ids: Vec::new(),
            live,
            scratch: Scratch::default(),
            reserves,
        };
        s.follow_exceptions_now();
        s
    }

    /// Sets (or with `None` ends) the canary: the version that decides the
    /// requests it selects (see [`canary`]). Takes effect at the next
    /// arrival; queued and running work is untouched.
    pub fn set_canary(&mut self, c: Option<canary::Canary>) {
        self.canary = c;
    }

    pub fn canary(&self) -> Option<&canary::Canary> {
        self.canary.as_ref()
    }

    /// Whether the canary (not the active graph) decided the last arrival.
    pub fn last_arrival_canary(&self) -> bool {
        self.last_canary
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

    /// The policy version in force (the last one swapped in).
    pub fn graph(&self) -> &std::sync::Arc<DecisionGraph> {
        &self.graph
    }

    /// The live signals policies read, as of the last arrival.
    /// A fleet sharing an upstream granted this (external) replica `cap`
    /// of its slots (`None`: all). Work beyond it waits; feed a
    /// [`Event::Tick`] after raising it so waiting work starts.
    pub fn set_slot_cap(&mut self, replica: usize, cap: Option<u32>) {
        if let Some(r) = self.replicas.get_mut(replica) {
            r.slot_cap = cap;
        }
    }

    /// The share of every quota (tenants', tiers', models') this
    /// scheduler enforces by itself ([`Config::quota_scale`]): a fleet
    /// that grew or shrank to N replicas sets 1/N. Each bucket keeps the
    /// share of its capacity it had.
    pub fn set_quota_scale(&mut self, scale: f64) {
        if (scale - self.quotas.scale()).abs() < 1e-12 {
            return;
        }
        let g = self.graph.clone();
        self.quotas = self.quotas.rescaled(&g, scale, self.now);
        self.scoped = self.scoped.rescaled(&g, scale, self.now);
        self.budgets = self.budgets.rescaled(scale);
        self.cfg.quota_scale = self.quotas.scale();
    }

    /// Sets quotas' buckets to the levels a fleet holds: each keeps the
    /// share of its capacity the fleet has left, so `quota.remaining`
    /// reads the fleet's value and a replica that loses the fleet goes on
    /// from its part of what was left.
    pub fn mirror_quotas(&mut self, levels: &[(quota::Scope, quota::Level)]) {
        for (scope, level) in levels {
            match *scope {
                quota::Scope::Tenant(t) => self.quotas.mirror(t, level, self.now),
                quota::Scope::Tier(t) => self.scoped.mirror(true, t, level, self.now),
                quota::Scope::Model(m) => self.scoped.mirror(false, m, level, self.now),
            }
        }
    }

    /// What this scheduler took of every quota by itself since the last
    /// call (requests a fleet did not claim), for the fleet to charge.
    pub fn take_quota_spend(&mut self) -> Vec<(quota::Scope, quota::Spent)> {
        let mut out: Vec<(quota::Scope, quota::Spent)> = self
            .quotas
            .take_spent()
            .into_iter()
            .map(|(t, s)| (quota::Scope::Tenant(t), s))
            .collect();
        for (tier, id, s) in self.scoped.take_spent() {
            let scope = if tier {
                quota::Scope::Tier(id)
            } else {
                quota::Scope::Model(id)
            };
            out.push((scope, s));
        }
        out
    }

    /// What replica `replica`'s engine reports it holds (`None`: nothing
    /// fresh). The pool signals read it at the next arrival: its running
    /// requests replace the scheduler's count, its waiting ones add to
    /// `queued`, its KV usage is the pool's `kv_occupancy`.
    pub fn set_engine_load(&mut self, replica: usize, load: Option<replica::EngineSignals>) {
        if let Some(r) = self.replicas.get_mut(replica) {
            r.engine = load;
        }
    }

    /// Whether HTTP upstreams are shared with a fleet
    /// ([`Config::shared_upstreams`]).
    pub fn shares_upstreams(&self) -> bool {
        self.cfg.shared_upstreams
    }

    /// Starts counting fair-share service for a fleet's shared counters
    /// ([`queue::Queues::take_service`]).
    pub fn share_service(&mut self) {
        self.queues.share_service();
    }

    /// Service charged since the last call (see [`Scheduler::share_service`]).
    pub fn take_service(&mut self) -> Vec<queue::ServiceCount> {
        self.queues.take_service()
    }

    /// Queues with work waiting, and each tier's fair-share decay window.
    pub fn fair_share_view(&self) -> (Vec<queue::QueueKey>, Vec<Option<Micros>>) {
        let decays = (0..self.graph.tiers.len())
            .map(|t| self.queues.decay(t as TierId))
            .collect();
        (self.queues.active(), decays)
    }

    /// Sets fair-share counters to the fleet's values.
    pub fn set_service(&mut self, counts: &[queue::ServiceCount]) {
        for c in counts {
            self.queues.set_service(c);
        }
    }

    /// What an external replica needs of a shared upstream: sequences it
    /// runs, and the tenants with work queued that it could take (with
    /// how many requests).
    pub fn demand(&self, replica: usize) -> Option<(u32, queue::Backlog)> {
        let r = self.replicas.get(replica)?;
        let backlog = self.queues.backlog_of((r.spec.model, r.spec.variant));
        Some((r.running.len() as u32, backlog))
    }

    pub fn signals(&self) -> &Signals {
        &self.signals
    }

    /// Sequences running on replica `r` (0 for an unknown replica).
    pub fn running_on(&self, r: usize) -> usize {
        self.replicas.get(r).map_or(0, |x| x.running.len())
    }

    /// Requests delayed or held for a batch (not in [`Self::waiting`]).
    pub fn parked(&self) -> usize {
        self.queues.parked()
    }

    /// Every (tier, tenant) with work waiting or service received, in tier
    /// then tenant order (no tenant first), with names from the graph.
    pub fn queue_snapshot(&self) -> Vec<QueueRow> {
        let stats = self.queues.stats();
        let mut tier_total: HashMap<TierId, f64> = HashMap::default();
        for q in &stats {
            *tier_total.entry(q.tier).or_default() += q.served;
        }
        stats
            .into_iter()
            .map(|q| {
                let total = tier_total.get(&q.tier).copied().unwrap_or(0.0);
                QueueRow {
                    tier: self
                        .graph
                        .tiers
                        .get(q.tier as usize)
                        .map_or_else(|| format!("#{}", q.tier), |t| t.name.clone()),
                    tenant: q.tenant.map(|t| {
                        self.graph
                            .tenants
                            .get(t as usize)
                            .map_or_else(|| format!("#{t}"), |x| x.name.clone())
                    }),
                    depth: q.depth,
                    parked: q.parked,
                    oldest_wait: q.oldest.map_or(0, |a| self.now.saturating_sub(a)),
                    served: q.served,
                    share: if total > 0.0 {
                        (q.served / total).clamp(0.0, 1.0)
                    } else {
                        0.0
                    },
                }
            })
            .collect()
    }

    /// Feeds one event at time `now` (never earlier than the last one) and
    /// returns the actions it caused. The slice is valid until the next call.
    pub fn handle(&mut self, now: Micros, event: Event) -> &[Action] {
        self.out.clear();
        self.limits_out.clear();
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
            Event::Cancel { id } => self.cancel(id),
            Event::Complete { id, output_tokens } => self.complete(id, output_tokens),
            Event::FirstToken { id } => {
                self.live.first_token(self.now, id);
                return &self.out;
            }
        }
        self.settle();
        self.settle_cache();
        self.live.observe(&self.graph, self.now, &self.out);
        &self.out
    }

    /// The rate limits the quota gate found for request `id` during the
    /// last [`Scheduler::handle`] (after its reservation, or at its
    /// refusal): for the `x-ratelimit-*` headers and a quota refusal's
    /// message. Only with [`Config::rate_limits`].
    pub fn rate_limits(&self, id: ReqId) -> Option<ratelimit::RateLimits> {
        self.limits_out
            .iter()
            .rev()
            .find(|(i, _)| *i == id)
            .map(|(_, l)| *l)
    }

    /// The tiers' exact caches (for metrics and tests).
    pub fn caches(&self) -> &cache::Caches {
        &self.caches
    }

    /// The tiers' semantic caches (for metrics and tests).
    pub fn semantic_caches(&self) -> &semantic::SemanticCaches {
        &self.semantic
    }

    /// Stores a complete answer of `tier` under `key` (the gateway's, once
    /// the answer was served whole). Ignored unless the tier has an exact
    /// cache; an answer over the byte bound is not kept.
    pub fn cache_store(
        &mut self,
        now: Micros,
        tier: TierId,
        key: cache::Key,
        payload: std::sync::Arc<str>,
    ) -> Result<(), cache::NotStored> {
        self.cache_store_content(now, tier, key, None, payload)
    }

    /// [`Scheduler::cache_store`] of a request whose content hash is
    /// `content`: [`Scheduler::exact_holds`] then knows it.
    pub fn cache_store_content(
        &mut self,
        now: Micros,
        tier: TierId,
        key: cache::Key,
        content: Option<cache::Key>,
        payload: std::sync::Arc<str>,
    ) -> Result<(), cache::NotStored> {
        self.now = self.now.max(now);
        let bytes = payload.len() as u64;
        if payload.len() as u64 <= self.caches.bounds().max_entry_bytes {
            self.semantic.store(&key, payload.clone(), self.now);
        }
        self.caches
            .insert_content(tier, key, content, bytes, Some(payload), self.now)
    }

    /// Whether some tier's exact cache holds an answer for a request of
    /// this content hash, in any scope (the gateway then does not embed the
    /// request for the semantic cache: the exact lookup comes first).
    pub fn exact_holds(&self, content: &cache::Key) -> bool {
        self.caches.holds_content(content)
    }

    /// Drops the semantic caches' expired entries at `now` (before their
    /// sizes are reported). The scheduler's own time is left as it is: a
    /// scrape must not move it (a replay and the gateway agree to the
    /// microsecond).
    pub fn purge_semantic(&mut self, now: Micros) {
        self.semantic.purge(now.max(self.now));
    }

    /// After every event: requests that ended leave the pending stores; in
    /// a replay, those that finished are stored.
    fn settle_cache(&mut self) {
        if self.cache_pending.is_empty() {
            return;
        }
        for a in &self.out {
            let (id, finished) = match *a {
                Action::Finished { id, .. } => (id, true),
                Action::Reject { id, .. } | Action::Cancelled { id } => (id, false),
                _ => continue,
            };
            let Some((tier, key, output)) = self.cache_pending.remove(&id) else {
                continue;
            };
            if finished && self.cfg.cache_on_finish {
                // About four bytes of answer per output token.
                let bytes = u64::from(output).saturating_mul(4);
                let _ = self.caches.insert(tier, key, bytes, None, self.now);
            }
        }
    }

    /// What request `id`'s answer reports of the quotas that apply to it
    /// (tenant first, then tier, then model), now: `x-ratelimit-*`, and
    /// for a quota refusal which quota refused.
    pub(super) fn note_limits(
        &mut self,
        id: ReqId,
        tenant: Option<TenantId>,
        tier: TierId,
        model: Option<u16>,
        refused: Option<Reason>,
    ) {
        if !self.cfg.rate_limits {
            return;
        }
        let mut views = Vec::with_capacity(3);
        views.extend(tenant.and_then(|t| self.quotas.view(t, self.now)));
        views.extend(self.scoped.view_tier(tier, self.now));
        views.extend(model.and_then(|m| self.scoped.view_model(m, self.now)));
        let limits = ratelimit::RateLimits::of(&views, refused);
        self.limits_out.push((id, limits));
    }

    /// Looks an admitted-so-far arrival up in its tier's exact cache. On a
    /// hit its requests quota is charged (one request; tokens and
    /// GPU-seconds are not: it uses none), [`Action::CacheHit`] answers it
    /// and `true` says it is done; a quota refusal is a refusal like any
    /// other (also `true`). On a miss, [`Action::CacheMiss`] gives the key.
    fn cache_lookup(
        &mut self,
        a: &admit::Admitting<'_>,
        content: Option<cache::Key>,
        probe: Option<&semantic::Probe>,
    ) -> bool {
        let (id, tier, tenant, target, output, quota_claimed) =
            (a.id, a.tier, a.tenant, a.target, a.output, a.quota_claimed);
        if self.cfg.mode != Mode::Kiln {
            return false;
        }
        let exact = self.caches.spec(tier);
        let sem = self.semantic.spec(tier);
        let (Some(content), Some(target)) = (content, target) else {
            return false;
        };
        if exact.is_none() && sem.is_none() {
            return false;
        }
        let g = self.graph.clone();
        let tier_name = g.tiers.get(tier as usize).map_or("", |t| t.name.as_str());
        let tenant_of = |shared: bool| {
            if shared {
                None
            } else {
                Some(
                    tenant
                        .and_then(|t| g.tenants.get(t as usize))
                        .map_or("", |t| t.name.as_str()),
                )
            }
        };
        let variant = g.variant_name(target.model, target.variant);
        // The exact key also names a semantic miss's answer, so the
        // gateway stores it once for both caches.
        let key = cache::scoped_key(
            &content,
            tier_name,
            tenant_of(exact.is_some_and(|e| e.shared)),
            &variant,
        );
        let mut hit = match exact {
            Some(_) => self
                .caches
                .get(tier, &key, self.now)
                .map(|e| (e.payload.clone(), None)),
            None => None,
        };
        if let (None, Some(spec), Some(p)) = (&hit, sem, probe) {
            let scope = semantic::SemanticCaches::scope(
                &p.context,
                tier_name,
                tenant_of(spec.shared),
                &variant,
            );
            match self.semantic.lookup(tier, &scope, &p.vector, self.now) {
                Some((payload, sim)) => hit = Some((Some(payload), Some(sim))),
                None => self.semantic.note_miss(key, tier, scope, p.vector.clone()),
            }
        }
        let Some((payload, similarity)) = hit else {
            if self.cfg.cache_on_finish && exact.is_some() {
                self.cache_pending.insert(id, (tier, key, output));
            }
            self.out.push(Action::CacheMiss { id, key });
            return false;
        };
        let charged = match (tenant, quota_claimed) {
            (Some(t), false) => Some((t, self.quotas.reserve(&g, t, 0.0, self.now))),
            _ => None,
        };
        let refused = charged
            .as_ref()
            .and_then(|(_, c)| c.as_ref().err().map(|(r, _)| *r));
        self.note_limits(id, tenant, tier, Some(target.model), refused);
        match charged {
            Some((t, Ok(_))) => self.quotas.release(t, 0.0, 0.0),
            Some((_, Err((reason, retry)))) => {
                self.out.push(Action::Reject {
                    id,
                    reason,
                    status: 429,
                    retry_after: Some(retry),
                });
                return true;
            }
            None => {}
        }
        self.out.push(Action::CacheHit {
            id,
            key,
            payload,
            similarity,
        });
        true
    }

    /// After every event: timers fire, expired waits are refused, idle
    /// capacity is filled, and the next wake-up is asked for.
    fn settle(&mut self) {
        self.fire_timers();
        self.review_holds();
        self.expire_queued();
        self.dispatch_all();
        if let Some(t) = self.next_wake() {
            self.out.push(Action::WakeAt(t));
        }
    }

    /// Forgets a held request, releasing its quota reservation and
    /// charging `used` tokens.
    fn end_held(&mut self, id: ReqId, used: f64) {
        if let Some(h) = self.held.remove(&id) {
            if let Some(t) = h.tenant {
                self.quotas.release(t, h.reserved_tokens, used);
            }
            if let Some(q) = h.scoped {
                self.scoped.release(q, used);
            }
        }
    }

    /// Where request `id` runs: (replica, position in its batch).
    fn find_running(&self, id: ReqId) -> Option<(usize, usize)> {
        self.replicas
            .iter()
            .enumerate()
            .find_map(|(r, rep)| rep.position(id).map(|i| (r, i)))
    }

    /// The GPU time an external replica's sequence used: wall time since
    /// it started times the replica's GPUs, split evenly among the
    /// sequences running there now. An approximation (the upstream's batch
    /// varied over the request's life, and its steps are not seen here),
    /// but an honest one: it never counts a GPU-second twice.
    fn external_share(&self, r: usize, i: usize) -> f64 {
        let Some(rep) = self.replicas.get(r) else {
            return 0.0;
        };
        let Some(s) = rep.running.get(i) else {
            return 0.0;
        };
        let wall = self.now.saturating_sub(s.started) as f64 / SEC as f64;
        wall * f64::from(rep.spec.gpus) / rep.running.len().max(1) as f64
    }

    fn cancel(&mut self, id: ReqId) {
        if !self.held.contains_key(&id) {
            return; // unknown, finished or refused: nothing to do
        }
        let mut used = 0.0;
        if let Some(w) = self.queues.unpark(id) {
            self.timers.remove(id);
            self.unpin(&w);
            used = swap::served_tokens(&w);
        } else if let Some(w) = self.queues.remove(id) {
            self.unpin(&w);
            used = swap::served_tokens(&w);
            // It was charged fair-share service for output it never made.
            if w.started {
                let unused = w.output_tokens.saturating_sub(w.generated);
                self.queues.refund(&self.graph, &self.cfg, &w, unused);
            }
        } else if let Some((r, i)) = self.find_running(id) {
            let external = self.replicas[r].spec.external;
            let share = if external {
                self.external_share(r, i)
            } else {
                0.0
            };
            let pool = self.replicas[r].spec.pool;
            let s = self.replicas[r].evict(i);
            if let Some(t) = s.w.tenant {
                if share > 0.0 {
                    self.quotas
                        .charge_gpu(t, share, self.now, s.w.claims.tenant);
                }
            }
            self.charge_budgets(&s.w, pool, share);
            if share > 0.0 {
                self.scoped
                    .charge_gpu(s.w.tier, s.w.model, share, self.now, s.w.claims.scoped);
            }
            // An external replica's progress is unknown: its prompt is
            // charged, and fair share keeps what it was charged.
            used = f64::from(s.w.prompt_tokens) + f64::from(s.generated);
            if !external {
                let unused = s.w.output_tokens.saturating_sub(s.generated);
                self.queues.refund(&self.graph, &self.cfg, &s.w, unused);
            }
        }
        self.end_held(id, used);
        self.out.push(Action::Cancelled { id });
    }

    fn complete(&mut self, id: ReqId, output_tokens: u32) {
        let Some((r, i)) = self.find_running(id) else {
            return;
        };
        if !self.replicas[r].spec.external {
            return; // its steps are the scheduler's to count
        }
        let share = self.external_share(r, i);
        let now = self.now;
        let rep = &mut self.replicas[r];
        let s = rep.evict(i);
        rep.note_call(now.saturating_sub(s.started) as f64 / SEC as f64);
        rep.remember_prefix(&s.w.prefix_blocks);
        // The upstream's steps are not seen: its work is the prompt and the
        // output at the roofline's saturated throughput, counted at the end.
        let work = rep.saturated_work(s.w.prompt_tokens, output_tokens);
        let pool = rep.spec.pool;
        self.live.work(self.now, pool, work);
        if let Some(t) = s.w.tenant {
            self.quotas
                .charge_gpu(t, share, self.now, s.w.claims.tenant);
        }
        self.scoped
            .charge_gpu(s.w.tier, s.w.model, share, self.now, s.w.claims.scoped);
        self.charge_budgets(&s.w, pool, share);
        // Fair share was charged for the output budget at dispatch.
        let unused =
            s.w.output_tokens
                .saturating_sub(s.generated)
                .saturating_sub(output_tokens);
        self.queues.refund(&self.graph, &self.cfg, &s.w, unused);
        let used = f64::from(s.w.prompt_tokens) + f64::from(output_tokens);
        self.end_held(id, used);
        self.out.push(Action::Finished {
            id,
            gpu_seconds: s.gpu_seconds + share,
            wasted_gpu_seconds: s.w.wasted_gpu_seconds,
        });
    }

    /// Charges `gpu_seconds` of `w`'s work on `pool` to its tenant's and
    /// tier's money budgets, in the period the policy's calendar is in.
    fn charge_budgets(&mut self, w: &Waiting, pool: PoolId, gpu_seconds: f64) {
        if gpu_seconds <= 0.0 || !self.budgets.any() {
            return;
        }
        let c = self.civil_now();
        self.budgets
            .charge(&self.graph, (w.tenant, w.tier, pool), gpu_seconds, &c);
    }

    /// What the clock reads now: in the policy's zone from a wall-clock
    /// start, else counted from the configured start (cached per minute).
    fn civil_now(&mut self) -> crate::units::calendar::Civil {
        let key = self.civil_key();
        if let Some((m, c)) = self.civil {
            if m == key {
                return c;
            }
        }
        let c = self.civil_read();
        self.civil = Some((key, c));
        c
    }

    /// The minute the clock reads: the wall clock's, or since time 0.
    fn civil_key(&self) -> u64 {
        let minute = self.now / (60 * SEC);
        self.wall_ms()
            .map_or(minute, |ms| (ms.max(0) / 60_000) as u64)
    }

    fn wall_ms(&self) -> Option<i64> {
        self.cfg
            .start_unix_ms
            .map(|ms| ms.saturating_add((self.now / 1000) as i64))
    }

    fn civil_read(&self) -> crate::units::calendar::Civil {
        use crate::units::calendar;
        match self.wall_ms() {
            Some(ms) => calendar::civil_at(ms, self.graph.timezone.as_ref()),
            None => calendar::civil_after(
                self.cfg.start_date,
                self.cfg.start_minute_of_day,
                self.cfg.start_weekday,
                self.now / (60 * SEC),
            ),
        }
    }

    /// What a fleet keeps of each budget's period ([`budget::Budgets::sync`]).
    pub fn sync_budgets(&mut self, s: &[budget::BudgetSync]) {
        if !self.budgets.any() {
            return;
        }
        let c = self.civil_now();
        let g = self.graph.clone();
        self.budgets.sync(&g, s, &c);
    }

    /// Every money budget: its share here and what this period spent.
    pub fn budgets(&self) -> Vec<budget::BudgetView> {
        if !self.budgets.any() {
            return Vec::new();
        }
        self.budgets.view(&self.graph, &self.civil_read())
    }

    fn refresh_signals(&mut self) {
        let c = self.civil_now();
        self.follow_exceptions(c.date);
        let g = &self.graph;
        self.signals.time_of_day = c.minute;
        self.signals.weekday = c.weekday;
        self.signals.date = c.date;
        self.signals.day = c.day;
        // One pass over the replicas, into buffers kept between arrivals.
        let np = self.signals.pools.len();
        let sc = &mut self.scratch;
        sc.kv.clear();
        sc.kv.resize(np, (0, 0));
        sc.capacity.clear();
        sc.capacity.resize(np, 0.0);
        sc.running.clear();
        sc.running.resize(np, 0);
        let mut engines = false;
        for r in &self.replicas {
            let p = r.spec.pool as usize;
            if let (Some(kv), Some(run), Some(cap)) = (
                sc.kv.get_mut(p),
                sc.running.get_mut(p),
                sc.capacity.get_mut(p),
            ) {
                kv.0 += r.kv_used();
                kv.1 += r.spec.kv_capacity;
                // An engine-aware upstream's engine says what it runs
                // (other clients' requests included).
                *run += match r.engine {
                    Some(e) => e.running.max(0.0).round() as usize,
                    None => r.running.len(),
                };
                engines |= r.engine.is_some();
                if r.up && !r.draining {
                    *cap += 1.0;
                }
            }
        }
        for (p, slot) in self.signals.pools.iter_mut().enumerate() {
            let (used, cap) = sc.kv[p];
            slot.kv_occupancy = if cap == 0 {
                0.0
            } else {
                100.0 * used as f64 / cap as f64
            };
            slot.running = sc.running[p] as f64;
            slot.queued = 0.0;
        }
        if engines {
            // Engines' own queues count as queued; their KV usage (the
            // mean over the pool's upstreams that publish one) is the
            // pool's occupancy (kiln does not size an upstream's cache).
            let mut kv = vec![(0.0f64, 0u32); np];
            for r in &self.replicas {
                let (Some(e), Some(slot)) =
                    (r.engine, self.signals.pools.get_mut(r.spec.pool as usize))
                else {
                    continue;
                };
                slot.queued += e.waiting.max(0.0);
                if let (Some(u), Some(k)) = (e.kv_cache, kv.get_mut(r.spec.pool as usize)) {
                    k.0 += u;
                    k.1 += 1;
                }
            }
            for (slot, (sum, n)) in self.signals.pools.iter_mut().zip(kv) {
                if n > 0 {
                    slot.kv_occupancy = 100.0 * sum / f64::from(n);
                }
            }
        }
        // Queued work counts for the pool its route named, or for every
        // pool hosting its variant when the route named none.
        for (&(key, pool), &n) in self.queues.route_lens() {
            match pool {
                Some(p) => {
                    if let Some(slot) = self.signals.pools.get_mut(p as usize) {
                        slot.queued += n as f64;
                    }
                }
                None => {
                    sc.pools.clear();
                    for &r in self.by_variant.get(&key).into_iter().flatten() {
                        if let Some(x) = self.replicas.get(r) {
                            if !sc.pools.contains(&x.spec.pool) {
                                sc.pools.push(x.spec.pool);
                            }
                        }
                    }
                    for &p in &sc.pools {
                        if let Some(slot) = self.signals.pools.get_mut(p as usize) {
                            slot.queued += n as f64;
                        }
                    }
                }
            }
        }
        for (t, m) in self.signals.tiers.iter_mut().enumerate() {
            let t = t as TierId;
            m.set(
                TierField::OldestWait,
                self.queues.oldest_wait(t, self.now) as f64 / 1000.0,
            );
            m.set(TierField::Queued, self.queues.tier_len(t) as f64);
        }
        for (t, s) in self.signals.tenants.iter_mut().enumerate() {
            s.quota_remaining = self.quotas.remaining_percent(t as TenantId, self.now);
            s.in_flight = self.quotas.in_flight(t as TenantId);
        }
        self.live
            .fill(self.now, &mut self.signals, &self.scratch.capacity);
        if self.budgets.any() {
            for (t, s) in self.signals.tenants.iter_mut().enumerate() {
                s.budget_remaining = self.budgets.tenant_remaining(t as TenantId, &c);
            }
            for (t, m) in self.signals.tiers.iter_mut().enumerate() {
                m.set(
                    TierField::BudgetRemaining,
                    self.budgets.tier_remaining(t as TierId, &c),
                );
            }
        }
        let _ = g;
    }

    fn reject(&mut self, id: ReqId, reason: Reason, status: u16, retry_after: Option<Micros>) {
        if let Some(h) = self.held.remove(&id) {
            if let Some(t) = h.tenant {
                self.quotas.release(t, h.reserved_tokens, 0.0);
            }
            if let Some(q) = h.scoped {
                self.scoped.release(q, 0.0);
            }
        }
        self.out.push(Action::Reject {
            id,
            reason,
            status,
            retry_after,
        });
    }

    /// Routes a request being queued ([`route`]): the replica it is held
    /// for and until when, or `(None, 0)` when no replica is usable. Under
    /// `kiln` routing tiers with `prefix_affinity` are routed by cached
    /// prefix and load, the others by load alone; both are soft pins. The
    /// baselines pin strictly.
    fn route(
        &mut self,
        tier: TierId,
        candidates: &[usize],
        blocks: &[u64],
        prompt: u32,
        kv_need: u64,
    ) -> (Option<usize>, Micros) {
        let by_prefix = self
            .graph
            .tiers
            .get(tier as usize)
            .is_some_and(|t| t.prefix_affinity);
        // Under kiln routing a tier without prefix affinity is not routed:
        // it waits in its pool's queue and the first replica with room
        // takes it (a pin would only keep it from an idle replica).
        if !by_prefix && self.router.mode() == route::Routing::Kiln {
            return (None, 0);
        }
        let cands: Vec<route::Candidate> = candidates
            .iter()
            .filter_map(|&r| {
                let rep = self.replicas.get(r)?;
                let usable = rep.up
                    && !rep.draining
                    && rep.spec.only_tier.is_none_or(|t| t == tier)
                    && rep.pool_tokens() >= kv_need;
                usable.then(|| self.candidate(r, blocks, prompt, kv_need))
            })
            .collect();
        match self.router.choose(&cands) {
            Some(c) if c.hold > 0 => (Some(c.replica), self.now.saturating_add(c.hold)),
            _ => (None, 0),
        }
    }

    /// How replica `r` looks to a request: prefill time its cached prefix
    /// saves (from its cost model), expected queueing there (a full batch
    /// waits for a slot, plus the tokens routed to it ahead, at its
    /// throughput) and its outstanding tokens.
    fn candidate(&self, r: usize, blocks: &[u64], prompt: u32, kv_need: u64) -> route::Candidate {
        let rep = &self.replicas[r];
        let cached = rep.cached_prefix_tokens(blocks).min(prompt);
        let saved = if cached > 0 {
            let secs = |p: u32| {
                let t = rep.spec.cost.step_time(p, 0, 0);
                if t.is_finite() {
                    t.max(0.0)
                } else {
                    0.0
                }
            };
            let d = (secs(prompt) - secs(prompt - cached)).max(0.0);
            (d * SEC as f64) as Micros
        } else {
            0
        };
        let pinned = self.pinned.get(r).copied().unwrap_or(0);
        let full = rep.free_seq_slots() == 0 || rep.kv_free() < kv_need;
        let slot_wait = if full { rep.time_to_free() } else { 0 };
        // A replica mid-step takes new work when the step ends.
        let step_wait = if rep.busy && !rep.spec.external {
            rep.step_until.saturating_sub(self.now)
        } else {
            0
        };
        let slot_wait = slot_wait.max(step_wait);
        // Prompts already running there still to prefill come first too
        // (chunked prefill shares each step's token budget).
        let backlog: u64 = rep.running.iter().map(|s| u64::from(s.prefill_left)).sum();
        let queue_wait = (pinned.saturating_add(backlog) as f64 / rep.throughput_tokens_per_s()
            * SEC as f64) as Micros;
        route::Candidate {
            replica: r,
            saved,
            wait: slot_wait.saturating_add(queue_wait),
            load: pinned.saturating_add(rep.outstanding_tokens()),
        }
    }

    /// Counts a routed request's tokens against its replica.
    fn pin(&mut self, w: &Waiting) {
        if let Some(r) = w.affinity {
            if self.pinned.len() <= r {
                self.pinned.resize(r + 1, 0);
            }
            if self.pinned_ids.len() <= r {
                self.pinned_ids.resize_with(r + 1, Default::default);
            }
            self.pinned[r] = self.pinned[r].saturating_add(w.tokens());
            self.pinned_ids[r].insert(w.id);
        }
    }

    /// Requests routed to replica `r`, which went down or drains, are
    /// routed no more: any replica of their route may take them. (Queued
    /// ones go back in line as new arrivals would: a rare event.)
    fn release_pins(&mut self, r: usize) {
        let Some(ids) = self.pinned_ids.get_mut(r).map(std::mem::take) else {
            return;
        };
        let mut ids: Vec<ReqId> = ids.into_iter().collect();
        ids.sort_unstable();
        for id in ids {
            if let Some(mut w) = self.queues.remove(id) {
                self.unpin(&w);
                w.affinity = None;
                w.pin_until = 0;
                self.queues.push(w, &self.cfg);
            } else if let Some(mut w) = self.queues.unpark(id) {
                self.unpin(&w);
                w.affinity = None;
                w.pin_until = 0;
                self.queues.park(w);
            }
        }
    }

    /// Takes a routed request's tokens off its replica (it left the queue).
    fn unpin(&mut self, w: &Waiting) {
        let Some(r) = w.affinity else { return };
        if let Some(p) = self.pinned.get_mut(r) {
            *p = p.saturating_sub(w.tokens());
        }
        if let Some(ids) = self.pinned_ids.get_mut(r) {
            ids.remove(&w.id);
        }
    }

    /// Tokens of queued requests routed to replica `r` (see `pinned`).
    pub fn pinned_tokens(&self, r: usize) -> u64 {
        self.pinned.get(r).copied().unwrap_or(0)
    }

    fn all_idle(&self, replicas: &[usize]) -> bool {
        replicas
            .iter()
            .all(|&r| self.replicas[r].running.is_empty())
    }

    /// When a delay window opens: the next time the clock reads `minute`.
    fn time_at_minute(&mut self, minute: u32) -> Micros {
        let now_min = u64::from(self.civil_now().minute);
        let delta = (u64::from(minute) + 1440 - now_min) % 1440;
        let into_minute = self.now % (60 * SEC);
        self.now + delta * 60 * SEC - if delta > 0 { into_minute } else { 0 }
    }

    /// The longest wait the tier's SLO tolerates before the first token
    /// (for work with a completion window, before the request starts: its
    /// own `window`, a batch item's, else its tier's).
    fn wait_limit(&self, tier: TierId, window: Option<Micros>) -> Option<Micros> {
        let slo = &self.graph.tiers.get(tier as usize)?.slo;
        if let Some(ttft) = slo.ttft {
            return Some((ttft * 1000.0 * self.cfg.admission_slack) as Micros);
        }
        window.or_else(|| self.tier_window(tier))
    }

    /// The tier's `slo { window }`, µs.
    fn tier_window(&self, tier: TierId) -> Option<Micros> {
        self.graph
            .tiers
            .get(tier as usize)?
            .slo
            .window
            .map(|w| (w * 1000.0) as Micros)
    }

    /// A request's completion window from now: its own (`own`, a batch
    /// item's) in place of its tier's, if either.
    fn request_window(&self, tier: TierId, own: Option<Micros>) -> Option<Micros> {
        own.or_else(|| self.tier_window(tier))
    }

    /// Estimated time before request `q` gets its first token on one of
    /// `replicas`, under the order the queues will actually use: the work
    /// ordered ahead of it ([`Queues::ahead`]: higher-ranked tiers, its own
    /// tenant's queue, and what fair share lets each other tenant of its
    /// tier take first), drained at the rate these replicas have been
    /// starting queued work (or their modelled throughput, if higher),
    /// then its own prefill. With nothing ahead it starts as soon as a
    /// batch slot is free. Also says whether its tenant is above its fair
    /// share (so a refusal can say `fairness`).
    fn estimate_for(&self, q: &Estimating, replicas: &[usize]) -> Estimate {
        self.estimate_given(q, replicas, self.contended(replicas))
    }

    /// [`Self::estimate_for`] where whether `replicas` are contended is
    /// already known at this instant (one `exp` per replica to read it).
    fn estimate_given(&self, q: &Estimating, replicas: &[usize], contended: bool) -> Estimate {
        let cost = self.cfg.vtc_input_weight * q.prompt as f64
            + self.cfg.vtc_output_weight * f64::from(q.output);
        // Later arrivals that fair share puts ahead: each tenant's recent
        // admitted rate over the tier's wait limit.
        // On replicas with room, later arrivals start beside it, not
        // before it: only contended ones make it wait for them.
        let horizon = if contended {
            self.wait_limit(q.tier, q.window).unwrap_or(0) as f64 / SEC as f64
        } else {
            0.0
        };
        let incoming = |slot: usize| -> (f64, f64) {
            let tenant = slot.checked_sub(1).map(|t| t as TenantId);
            self.incoming
                .get(&(q.key, q.tier, tenant))
                .map_or((0.0, 0.0), |(c, t)| {
                    (c.rate(self.now) * horizon, t.rate(self.now) * horizon)
                })
        };
        let ahead = self.queues.ahead(
            &self.graph,
            &self.cfg,
            q.key,
            q.tier,
            q.tenant,
            cost,
            q.own,
            &incoming,
        );
        // A tier with a reserved share of these replicas is not behind the
        // other tiers' queues: it drains at (at least) its share.
        let reserved = self.reserved_of(q.tier, replicas);
        let (ahead_tokens, share) = if reserved > 0.0 {
            let others = self.queues.other_tiers_ahead(&self.cfg, q.key, q.tier);
            let share = if others > 0.0 { reserved / 100.0 } else { 1.0 };
            ((ahead.tokens - others).max(0.0), share)
        } else {
            (ahead.tokens, 1.0)
        };
        // Size-neutral pricing ([`sizes`]) for a tenant that others are
        // ahead of in fair order: that is where its short prompts would
        // pass where its long ones fail. So is a tenant using about its
        // share (over 90% of it) when it happens to be first: a backlogged
        // low-weight tenant is, whenever its own queue runs empty, and
        // priced at its own size then it was served short requests (+16%
        // in requests on a 70B pair). A tenant alone, or clearly below its
        // share, is priced at its own size (and the reference is not priced
        // at all: this runs on every arrival).
        let used = if contended {
            self.share_used(q.key, q.tier, q.tenant)
        } else {
            0.0
        };
        let above_share = contended && (used > ABOVE_ITS_SHARE || ahead.above_share);
        let reference = if above_share || used > USING_ITS_SHARE {
            q.reference
        } else {
            0
        };
        // Work whose limit is a completion window is held against its
        // finish, and its wait is priced by work, not by a fixed mix of
        // prefill and decode: a decode-heavy queue on a replica running one
        // sequence drains at a fraction of that mix's token rate, and the
        // running sequences' remaining work is ahead of it too (before,
        // six 500-token answers were all admitted inside a 1 s window on a
        // replica that finishes one in 0.55 s).
        let by_window = self
            .graph
            .tiers
            .get(q.tier as usize)
            .is_some_and(|t| t.slo.ttft.is_none());
        let prompt32 = q.prompt.min(u64::from(u32::MAX)) as u32;
        let (mut running_left, mut shape_rate, mut decode, mut n_up) = (0.0, 0.0, f64::MAX, 0usize);
        // A replica takes new work at its next step boundary.
        let (mut rate, mut prefill, mut prefill_ref) = (0.0, [Micros::MAX; 2], [Micros::MAX; 2]);
        // Its own prefill with no other prompt pending.
        let mut alone = Micros::MAX;
        let (mut room_at, mut boundary) = (Micros::MAX, Micros::MAX);
        // A replica running nothing, with room: dispatch runs on every
        // event, so whatever still waits cannot use it (pinned to another
        // replica by prefix affinity, or held), and a new request starts
        // there at once, whatever the queue holds.
        let mut idle_now = false;
        for &r in replicas {
            let Some(rep) = self.replicas.get(r).filter(|x| x.up && !x.draining) else {
                continue;
            };
            let step_left = if rep.busy && !rep.spec.external {
                rep.step_until.saturating_sub(self.now)
            } else {
                0
            };
            boundary = boundary.min(step_left);
            // A slot is only room if the memory for its prompt is free too
            // (paged KV: the output's blocks come as it decodes).
            if rep.free_seq_slots() > 0 && rep.kv_free() >= q.prompt {
                room_at = room_at.min(step_left);
                idle_now |= rep.running.is_empty() && step_left == 0 && rep.slot_cap != Some(0);
            }
            rate += rep.throughput_tokens_per_s();
            if by_window {
                n_up += 1;
                running_left += rep.remaining_work_secs();
                let work = rep.saturated_work(prompt32, q.output);
                // Tokens (prompt and output, as the queue counts them) a
                // second, for work shaped like this request.
                let tokens = q.prompt as f64 + f64::from(q.output);
                if work > 0.0 && work.is_finite() {
                    shape_rate += tokens / work;
                }
                decode = decode.min(rep.decode_secs(prompt32, q.output));
            }
            let cached = u64::from(rep.cached_prefix_tokens(q.prefix));
            let tokens = q.prompt.saturating_sub(cached);
            let rank = self.start_rank(r, q.tier);
            // At the next step boundary (if it starts at once) and later.
            for (i, ahead) in rep.prefill_ahead(rank).iter().enumerate() {
                let own = rep.first_token_after(ahead, tokens);
                prefill[i] = prefill[i].min(own);
                // Read only where the pool has room (below): one more
                // cost-model step per replica on every arrival otherwise.
                if !contended {
                    alone = alone.min(rep.first_token_alone(ahead, tokens));
                }
                prefill_ref[i] = prefill_ref[i].min(if reference > tokens {
                    rep.first_token_after(ahead, reference)
                } else {
                    own
                });
            }
        }
        if prefill[1] == Micros::MAX {
            return Estimate {
                raw_start: u64::MAX / 4,
                first_token: u64::MAX / 4,
                finish: u64::MAX / 4,
                by_window,
                above_share: ahead.above_share && contended,
                first_in_order: false,
                contended,
            };
        }
        let rate = rate.max(self.drain_rate(q.key)) * share;
        let start = if idle_now && self.cfg.mode == Mode::Kiln {
            0
        } else if ahead_tokens <= 0.0 {
            if room_at < Micros::MAX {
                room_at
            } else {
                // The first slot to free, or at once where it may preempt.
                let mut soonest = Micros::MAX;
                // Read once, not per running sequence (a pass over tenants).
                let fair = self.fair_preempts(q.key, q.tier, q.tenant);
                for &r in replicas {
                    let Some(rep) = self.replicas.get(r).filter(|x| x.up && !x.draining) else {
                        continue;
                    };
                    let preempt = self.cfg.mode == Mode::Kiln
                        && (rep
                            .running
                            .iter()
                            .any(|x| self.may_preempt(r, x, q.tier, q.tenant, fair))
                            || self.may_reclaim(r, q.tier));
                    soonest = soonest.min(if preempt { 0 } else { rep.time_to_free() });
                }
                soonest.saturating_add(boundary)
            }
        } else if by_window && shape_rate > 0.0 && n_up > 0 {
            // The running work's remainder spread over the replicas, then
            // the queue ahead at the rate work shaped like this drains.
            // The measured drain where it is faster: the queue's own mix
            // (this request's shape stands for it only until work flows;
            // a long prompt priced alone reads a KV-bound replica 4-5x
            // slower than the mix it is in drains).
            let wrate = shape_rate.max(self.drain_rate(q.key)) * share;
            let secs = running_left / n_up as f64 + ahead_tokens / wrate;
            ((secs * SEC as f64) as Micros).saturating_add(boundary)
        } else if rate <= 0.0 {
            u64::MAX / 4
        } else {
            (((ahead_tokens / rate) * SEC as f64) as Micros).saturating_add(boundary)
        };
        // Starting at the next boundary, where the step in flight is done.
        let next = (idle_now && self.cfg.mode == Mode::Kiln)
            || (ahead_tokens <= 0.0 && room_at < Micros::MAX);
        let i = usize::from(!next);
        let prefill = if reference > 0 {
            prefill_ref[i]
        } else {
            prefill[i]
        };
        // Corrected by how far off such estimates have been lately, learnt
        // apart for the two kinds: a request first in fair order (nothing
        // queued ahead of it, it waits for the next slot to free) and one
        // behind queued work (the queue-drain estimate). One factor for
        // both made a light tenant pay for backlogged tenants' queue-drain
        // misestimates, 11-20x on a KV-bound 70B pair: it was refused a
        // fifth of its requests asking 2% of the pool (issue 26).
        let first_in_order = ahead_tokens <= 0.0;
        // Not for a completion window: its estimate counts the work ahead
        // and running (not a fixed token mix), and a quantile learnt from
        // waits that higher tiers' later arrivals stretch refused work an
        // hour's window would have finished (8.5x on the Azure hour's batch
        // tier).
        let factor = if by_window {
            1.0
        } else {
            // Trusted below 1 only where the pool has room: under
            // contention an optimistic factor admits work that then waits
            // behind fair order's later arrivals.
            let f = self
                .misestimate
                .get(&(q.key, q.tier, first_in_order))
                .map_or(1.0, |m| m.factor());
            if contended {
                f.max(1.0)
            } else {
                f
            }
        };
        // On replicas with room, what they have pending is worked off
        // while it waits for its turn: the two overlap rather than add (at
        // 42% load on an L4 they added to 3-5 s for waits fifo served
        // under 3 s).
        let prefill = if contended || next {
            prefill
        } else {
            prefill.saturating_sub(start).max(alone.min(prefill))
        };
        let corrected = (start as f64 * factor) as Micros;
        let first_token = corrected.saturating_add(prefill);
        let finish = if by_window && decode.is_finite() && decode < f64::MAX {
            first_token.saturating_add((decode * SEC as f64) as Micros)
        } else {
            first_token
        };
        Estimate {
            raw_start: start,
            first_token,
            finish,
            by_window,
            above_share,
            first_in_order,
            contended,
        }
    }

    /// Whether `replicas` have lately been loaded past [`CONTENDED`] (their
    /// mean real load, replicas down or draining left out). Until their
    /// load has been read for a whole [`LOAD_WINDOW`] they count as
    /// contended: a pool is not judged idle on its first few seconds.
    fn contended(&self, replicas: &[usize]) -> bool {
        let (mut sum, mut n) = (0.0, 0usize);
        for &r in replicas {
            if self.replicas.get(r).is_some_and(|x| x.up && !x.draining) {
                let load = self.load.get(&r).copied().unwrap_or_default();
                if load
                    .since
                    .is_none_or(|t| self.now.saturating_sub(t) < LOAD_WINDOW)
                {
                    return true;
                }
                sum += load.rate(self.now);
                n += 1;
            }
        }
        n == 0 || sum / n as f64 >= CONTENDED
    }

    /// Notes the size of an arriving prompt (what the best of `replicas`
    /// would prefill of it, after its cached prefix) among its route and
    /// tier's recent ones; returns admission's size-neutral reference
    /// ([`sizes`]), in tokens (0: none yet, or turned off).
    fn note_prompt_size(
        &mut self,
        key: (u16, u16),
        tier: TierId,
        prompt: u64,
        prefix: &[u64],
        replicas: &[usize],
    ) -> u64 {
        if self.cfg.admission_size_quantile.is_none() {
            return 0;
        }
        let cached = replicas
            .iter()
            .filter_map(|&r| self.replicas.get(r))
            .map(|r| u64::from(r.cached_prefix_tokens(prefix)))
            .max()
            .unwrap_or(0);
        self.sizes
            .entry((key, tier))
            .or_default()
            .record(prompt.saturating_sub(cached));
        self.size_reference(key, tier)
    }

    /// Admission's size-neutral reference for (model, variant) and tier,
    /// in tokens: the configured quantile of recent prompt sizes, once 50
    /// have been seen (0 until then, or when turned off).
    fn size_reference(&self, key: (u16, u16), tier: TierId) -> u64 {
        let Some(q) = self.cfg.admission_size_quantile else {
            return 0;
        };
        self.sizes
            .get(&(key, tier))
            .and_then(|s| s.quantile(q, 50))
            .unwrap_or(0)
    }

    /// Whether a request of `tenant` may take a slot from its own tier's
    /// work of tenants above their weighted share ([`Self::may_preempt`]):
    /// in a tier with a TTFT SLO, its tenant *asks* (refused or not, over
    /// [`SHARE_WINDOW`]) no more than its weight's part of what the tier
    /// admits. (By what it was admitted, a backlogged tenant held at about
    /// its share reads a little under or over it from one minute to the
    /// next; backlogged tenants then took slots from each other, a weight-1
    /// tenant among 24 losing 13% of its tokens on a 70B pair.)
    fn fair_preempts(&self, key: (u16, u16), tier: TierId, tenant: Option<TenantId>) -> bool {
        self.cfg.mode == Mode::Kiln
            && self.cfg.fair_preemption
            && self
                .graph
                .tiers
                .get(tier as usize)
                .is_some_and(|t| t.slo.ttft.is_some())
            && self
                .asked_since
                .is_some_and(|t| self.now.saturating_sub(t) >= SHARE_WINDOW / 2)
            && {
                let asked = self
                    .asked
                    .get(&(key, tier, tenant))
                    .map_or(0.0, |c| c.rate(self.now));
                self.share_of(key, tier, tenant, Some(asked), true) <= 1.0
            }
    }

    /// Whether `tenant` has lately been admitted more of its tier's work
    /// (in fair-share cost) than its weight's part among the tenants that
    /// sent any (by more than 5%).
    fn above_share(&self, key: (u16, u16), tier: TierId, tenant: Option<TenantId>) -> bool {
        self.share_used(key, tier, tenant) > ABOVE_ITS_SHARE
    }

    /// The tenant's recent admitted rate over its weighted part of the
    /// route and tier's (among tenants with recent work), over the 10 s of
    /// [`DRAIN_WINDOW`]; 0 when nothing was admitted lately, or when no
    /// other tenant sent any (alone).
    fn share_used(&self, key: (u16, u16), tier: TierId, tenant: Option<TenantId>) -> f64 {
        self.share_of(key, tier, tenant, None, false)
    }

    /// [`Self::share_used`], with `own` in place of the tenant's own
    /// admitted rate where given (what it asks), and read over
    /// [`SHARE_WINDOW`] where `long`. (Read over 10 s, a weight-1 tenant of
    /// 12 that sent two requests in a few seconds is above its share.)
    fn share_of(
        &self,
        key: (u16, u16),
        tier: TierId,
        tenant: Option<TenantId>,
        own: Option<f64>,
        long: bool,
    ) -> f64 {
        let mut mine = 0.0;
        let mut others = false;
        let (mut total, mut weights, mut my_w) = (0.0, 0.0, 1.0);
        for slot in 0..=self.graph.tenants.len() {
            let t = slot.checked_sub(1).map(|x| x as TenantId);
            let rate = if long {
                self.admitted
                    .get(&(key, tier, t))
                    .map_or(0.0, |c| c.rate(self.now))
            } else {
                self.incoming
                    .get(&(key, tier, t))
                    .map_or(0.0, |(c, _)| c.rate(self.now))
            };
            let w = t
                .and_then(|t| self.graph.tenants.get(t as usize))
                .map_or(1.0, |x| x.weight.max(1e-9));
            if t == tenant {
                mine = own.unwrap_or(rate);
                my_w = w;
            }
            if rate > 1e-9 || t == tenant {
                total += rate;
                weights += w;
                others |= t != tenant;
            }
        }
        if others && total > 0.0 && weights > 0.0 {
            mine / (total * my_w / weights)
        } else {
            0.0
        }
    }

    /// Tokens per second the queues of (model, variant) have been starting
    /// lately (decayed over [`DRAIN_WINDOW`]).
    fn drain_rate(&self, key: (u16, u16)) -> f64 {
        self.drain.get(&key).map_or(0.0, |d| d.rate(self.now))
    }

    /// The `estimated_wait` signal policies read: for the request's route
    /// under an idle decision, or 0 when unknown.
    fn estimate_wait(&self, req: &Request, window: Option<Micros>) -> Micros {
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
                    let q = Estimating {
                        key: (t.model, t.variant),
                        tier: d.tier,
                        tenant: d.tenant,
                        prompt: req.prompt_tokens,
                        output: d.max_tokens.min(u64::from(u32::MAX)) as u32,
                        window,
                        own: None,
                        prefix: &[],
                        reference: 0,
                    };
                    self.estimate_for(&q, &reps).first_token
                }
            }
            None => 0,
        }
    }

    fn fire_timers(&mut self) {
        if self.timers.is_empty() {
            return;
        }
        for id in self.timers.take_due(self.now) {
            if let Some(w) = self.queues.unpark(id) {
                self.queues.push(w, &self.cfg);
            }
        }
    }

    fn expire_queued(&mut self) {
        for w in self.queues.take_expired(self.now) {
            self.unpin(&w);
            if w.waiting_for == Some(Reason::Held) && self.is_held(w.tier) {
                // Its bound passed while the policy still held its tier.
                self.reject(w.id, Reason::Held, 503, Some(30 * SEC));
            } else {
                self.reject(w.id, Reason::Timeout, 503, Some(5 * SEC));
            }
        }
    }

    /// The earliest timer, queue expiry or soft-pin lapse (the queues
    /// keep the lapses: a request held for a busy replica is looked at
    /// again then, as an idle replica asks for nothing by itself).
    fn next_wake(&self) -> Option<Micros> {
        let timer = self.timers.next();
        let expiry = self.queues.next_expiry();
        [timer, expiry, self.hold_wake()]
            .into_iter()
            .flatten()
            .filter(|&t| t > self.now)
            .min()
    }

    fn replica_down(&mut self, r: usize) {
        if r < self.replicas.len() {
            self.release_pins(r);
        }
        let Some(rep) = self.replicas.get_mut(r) else {
            return;
        };
        rep.up = false;
        if rep.spec.external {
            // Its requests are the upstream's: tokens already streamed
            // cannot be taken back, so they stay until the environment
            // reports each one complete or cancelled.
            return;
        }
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
            let servable = swap::servable(&self.by_variant, &self.replicas, &s.w);
            let id = s.w.id;
            self.requeue(s.w, r, id, servable);
        }
    }

    /// Puts a sequence taken off replica `r` back at the head of its line
    /// (announcing `Preempted` by `by`), or, when no live replica could run
    /// it again (a policy swap drained or shrank them, or removed its
    /// variant), refuses it with `policy-changed` to be re-decided.
    fn requeue(&mut self, w: Waiting, r: usize, by: ReqId, servable: bool) {
        if !servable {
            let used = swap::served_tokens(&w);
            self.refuse_changed(w.id, used);
            return;
        }
        self.out.push(Action::Preempted {
            id: w.id,
            replica: r,
            by,
        });
        self.queues.push_front(w);
    }

    fn step_done(&mut self, r: usize) {
        let now = self.now;
        // The calendar only where a budget is charged: this is every step.
        let civil = self.budgets.any().then(|| self.civil_now());
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
                s.charge(share);
                if let Some(t) = s.w.tenant {
                    self.quotas.charge_gpu(t, share, now, s.w.claims.tenant);
                }
                self.scoped
                    .charge_gpu(s.w.tier, s.w.model, share, now, s.w.claims.scoped);
                if let Some(c) = &civil {
                    self.budgets.charge(
                        &self.graph,
                        (s.w.tenant, s.w.tier, rep.spec.pool),
                        share,
                        c,
                    );
                }
            }
        }
        let (prefill, decodes, context) = rep.step_shape;
        let work = rep.saturated_secs(prefill, decodes, context);
        rep.work_seconds += work;
        self.load.entry(r).or_default().add(now, work);
        let pool = rep.spec.pool;
        let done = rep.finish_step(now, &mut self.out);
        self.live.work(now, pool, work);
        for (id, seq) in done {
            let served_in = f64::from(seq.w.prompt_tokens);
            let served_out = f64::from(seq.generated);
            if let Some(h) = self.held.remove(&id) {
                if let Some(t) = h.tenant {
                    let used = served_in + served_out;
                    self.quotas.release(t, h.reserved_tokens, used);
                }
                if let Some(q) = h.scoped {
                    self.scoped.release(q, served_in + served_out);
                }
            }
            let _ = served_in;
        }
    }

    /// Fills every idle replica: decodes continue, new work is admitted in
    /// queue order under the replica's budgets, preempting if needed.
    fn dispatch_all(&mut self) {
        self.fill_upstreams();
        for r in 0..self.replicas.len() {
            let rep = &self.replicas[r];
            if !rep.up || rep.spec.external {
                continue;
            }
            if rep.busy {
                continue;
            }
            self.make_room(r);
            if !self.replicas[r].draining {
                self.fill(r, usize::MAX);
            }
            let now = self.now;
            self.replicas[r].step_cap = self.step_cap(r);
            self.replicas[r].backfill_slack =
                (self.cfg.mode == Mode::Kiln).then_some(self.cfg.backfill_slack);
            self.replicas[r].backfill_prefill_slack = self.cfg.backfill_prefill_slack;
            if let Some(until) = self.replicas[r].start_step(now) {
                self.out.push(Action::Step { replica: r, until });
            }
        }
    }

    /// Fills the slots of external replicas (HTTP upstreams run their own
    /// batches; kiln only decides what is sent), one request at a time to
    /// the least loaded replica with room: the share of its slots in use,
    /// then its outstanding tokens, then its index. Filling them in index
    /// order sent everything to the first upstream until its `concurrency`
    /// was full (on two llama.cpp servers, 53 of 60 requests to one, each
    /// slowed by the others in its batch, while the other idled); a
    /// simulated replica takes new work only between its steps, so the
    /// replay spread the same requests, and predicted half the latency.
    fn fill_upstreams(&mut self) {
        // Nothing queued, nothing to place (the common case on a quiet
        // gateway): no keys, no picks.
        if self.queues.is_empty() {
            return;
        }
        let load = |rep: &Replica| -> (f64, u64) {
            let used = rep.running.len() as f64 / f64::from(rep.slots().max(1));
            (used, rep.outstanding_tokens())
        };
        // (share of slots used, outstanding tokens, replica): computed once,
        // and again only for the replica that took a request.
        let mut open: Vec<(f64, u64, usize)> = self
            .replicas
            .iter()
            .enumerate()
            .filter(|(_, rep)| rep.up && rep.spec.external && !rep.draining)
            .map(|(r, rep)| {
                let (used, tokens) = load(rep);
                (used, tokens, r)
            })
            .collect();
        while !open.is_empty() {
            open.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            // The least loaded that starts something; one that starts
            // nothing now (full, or nothing queued it can serve) is done.
            let mut took = None;
            let mut done = 0;
            for (i, &(_, _, r)) in open.iter().enumerate() {
                if self.fill(r, 1) > 0 {
                    took = Some(i);
                    break;
                }
                done = i + 1;
            }
            let Some(i) = took else {
                break;
            };
            if self.queues.is_empty() {
                break;
            }
            let r = open[i].2;
            let (used, tokens) = load(&self.replicas[r]);
            open[i] = (used, tokens, r);
            open.drain(..done);
        }
    }

    /// Starts queued work on replica `r`, at most `limit` requests; returns
    /// how many started.
    fn fill(&mut self, r: usize, limit: usize) -> usize {
        // The spec's plain fields: cloning it (its cost model is an `Arc`)
        // on every fill of every replica was a fifth of replay time.
        struct Spec {
            pool: PoolId,
            model: u16,
            variant: u16,
            only_tier: Option<TierId>,
            external: bool,
            max_batch: u32,
            max_batch_tokens: u32,
        }
        let Some(rep) = self.replicas.get(r) else {
            return 0;
        };
        let spec = Spec {
            pool: rep.spec.pool,
            model: rep.spec.model,
            variant: rep.spec.variant,
            only_tier: rep.spec.only_tier,
            external: rep.spec.external,
            max_batch: rep.spec.max_batch,
            max_batch_tokens: rep.spec.max_batch_tokens,
        };
        let mut started = 0;
        while started < limit {
            // Work waits here, in fair order, not inside the batch: a new
            // sequence starts only when its prompt fits in the next step's
            // token budget beside the prefill already admitted and the
            // decodes (as vLLM schedules new prefills within a step's
            // budget). Otherwise a request that "started" could wait many
            // steps behind others' prefill, where neither fair share nor its
            // admission estimate can see it.
            let budget = u64::from(
                spec.max_batch_tokens
                    .saturating_sub(self.replicas[r].decoding())
                    .max(1),
            );
            let has_room = self.replicas[r].free_seq_slots() > 0;
            // Backfill only when nothing else wants this replica.
            let others_waiting =
                self.queues
                    .any_non_backfill_for(spec.model, spec.variant, spec.pool);
            let slot = queue::Slot {
                replica: r,
                model: spec.model,
                variant: spec.variant,
                pool: spec.pool,
                only_tier: spec.only_tier,
                allow_backfill: !others_waiting,
            };
            let pick = self.queues.pick(&self.graph, &self.cfg, self.now, slot);
            let Some(mut w) = pick else {
                break;
            };
            // A tier reclaiming its reserved share of this pool ([`reserve`])
            // goes first, and other work may not start into its shortfall.
            let claims = self.claims(r, &slot);
            if claims.iter().any(|c| c.tier != w.tier) {
                match self.claimant_instead(r, w, &claims, slot) {
                    Some(x) => w = x,
                    None => break,
                }
            }
            // Its prompt would not start in the next step: it waits in line
            // (a long prompt alone still starts, chunked). Prefill ranked
            // below it goes after it, so only the rest counts.
            let prompt = u64::from(w.prompt_tokens) + u64::from(w.generated);
            let pending = self.replicas[r].pending_prefill(self.start_rank(r, w.tier));
            if !spec.external && pending > 0 && pending + prompt > budget {
                self.queues.push_front(w);
                break;
            }
            // Prefix caching is on whatever the routing (as vLLM's
            // automatic prefix caching is); routing only chose the replica.
            let cached = self.replicas[r].cached_prefix_tokens(&w.prefix_blocks);
            // Paged KV: blocks for its uncached prompt and a watermark.
            if !has_room || !self.replicas[r].can_start(&w, cached) {
                // Make room by preempting lower, preemptible work, or stop.
                if self.cfg.mode == Mode::Kiln
                    && (self.try_preempt(r, &w) || self.try_reclaim(r, &w))
                {
                    self.queues.push_front(w);
                    continue;
                }
                self.queues.push_front(w);
                break;
            }
            // The last few batch slots and KV blocks are for tenants within
            // their share: one above it may not fill the batch, or a polite
            // tenant's next request waits for a slot to free (fair share
            // decides who goes first, this keeps room for them to go).
            // (Only on batches of 16 or more, where a sixteenth is at least
            // a slot, and never on an idle replica: a small batch keeps no
            // reserve, and a held request always starts once the replica
            // empties, so nothing waits forever.)
            let slots = spec.max_batch / 16;
            if self.cfg.mode == Mode::Kiln
                && !spec.external
                && slots > 0
                && !self.replicas[r].running.is_empty()
                && self.above_share((w.model, w.variant), w.tier, w.tenant)
            {
                let rep = &self.replicas[r];
                let blocks = rep.pool_tokens() / 20 + u64::from(w.prompt_tokens);
                if rep.free_seq_slots() <= slots || rep.kv_free() < blocks {
                    self.queues.push_front(w);
                    break;
                }
            }
            self.queues.charge(&self.graph, &self.cfg, &w);
            if w.arrival < self.now {
                // It had queued: its start is the queue draining.
                let now = self.now;
                self.drain
                    .entry((w.model, w.variant))
                    .or_default()
                    .add(now, w.tokens() as f64);
            }
            // Only a first start after an ordinary wait says how good the
            // estimate was (not a delay window, a batching hold or a
            // resumption after preemption).
            if let (Some((est, first)), false) = (w.est_start, w.started) {
                if !matches!(w.waiting_for, Some(Reason::Delay | Reason::Batching)) {
                    let waited = self.now.saturating_sub(w.arrival);
                    self.misestimate
                        .entry(((w.model, w.variant), w.tier, first))
                        .or_default()
                        .note(est, waited);
                }
            }
            let id = w.id;
            let waited_for = if self.now > w.arrival {
                match w.waiting_for {
                    // A higher tier started while it waited: it was
                    // overtaken, which says more than "no room".
                    None | Some(Reason::Saturation) if self.overtaken(&w) => Some(Reason::Priority),
                    // Nothing more specific: it queued behind earlier work.
                    other => other.or(Some(Reason::Saturation)),
                }
            } else {
                None
            };
            if let Some(t) = self.tier_started.get_mut(w.tier as usize) {
                *t = self.now;
            }
            // Routed once: a preempted or requeued request goes anywhere.
            self.unpin(&w);
            w.affinity = None;
            w.pin_until = 0;
            let now = self.now;
            // Best-effort work prefills after its tier's other work.
            let rank = self
                .start_rank(r, w.tier)
                .saturating_sub(i64::from(w.best_effort));
            let mut seq = Seq::from_waiting(w, cached);
            seq.rank = rank;
            // Work without a first-token deadline must not make steps long
            // for work with one.
            seq.capped = self.cfg.mode == Mode::Kiln
                && self
                    .graph
                    .tiers
                    .get(seq.w.tier as usize)
                    .is_some_and(|t| t.slo.ttft.is_none());
            seq.yields = seq.capped && seq.w.preemptible(&self.graph);
            self.replicas[r].admit(seq, now);
            self.out.push(Action::Started {
                id,
                replica: r,
                waited_for,
            });
            started += 1;
        }
        started
    }

    /// Before a step on replica `r`: decoding sequences get the KV block
    /// their next token needs, preempting (recompute on resume) where the
    /// pool has none; see [`Replica::make_room`]. A preempted sequence
    /// keeps its place at the head of its queue, as in [`Self::try_preempt`];
    /// one that can never fit here again is re-queued for another replica
    /// or, if none could take it, refused (`policy-changed`: only a swap
    /// shrinks a replica below what the 413 gate let in).
    fn make_room(&mut self, r: usize) {
        // Sequences inside their tier's reserved share are kept.
        let protected = self.protected_tiers(r);
        // Within a priority, a tenant using under 90% of its weighted share
        // keeps its sequences while a tenant at or above it has one to give
        // up (the newest of those, as before): what the pool must shed comes
        // from who uses its share. Newest first alone evicted the polite
        // tenant's sequences, which start last because they arrive into a
        // full pool (on a KV-bound 70B pair, 240 of a tenant's asking 70% of
        // its share against 12 of the backlogged one's). Only looked at when
        // the blocks may run out this step (one per running sequence).
        let rep = &self.replicas[r];
        let tight = rep.kv_free() < rep.running.len() as u64 * u64::from(replica::KV_BLOCK_TOKENS);
        let giving: Vec<(TierId, Option<TenantId>)> = if self.cfg.mode == Mode::Kiln && tight {
            let key = (rep.spec.model, rep.spec.variant);
            let mut v: Vec<(TierId, Option<TenantId>)> =
                rep.running.iter().map(|s| (s.w.tier, s.w.tenant)).collect();
            v.sort_unstable();
            v.dedup();
            v.retain(|&(tier, tenant)| self.share_used(key, tier, tenant) > USING_ITS_SHARE);
            v
        } else {
            Vec::new()
        };
        let graph = &self.graph;
        let rank = |w: &Waiting| {
            if protected.contains(&w.tier) {
                return i64::MAX;
            }
            let priority = graph
                .tiers
                .get(w.tier as usize)
                .map_or(i64::MIN / 2, |t| t.priority);
            let keeps = i64::from(!giving.contains(&(w.tier, w.tenant)));
            priority.saturating_mul(2).saturating_add(keeps)
        };
        let (max, now) = (self.cfg.max_preemptions_per_seq, self.now);
        let within = |s: &Seq| thrash_budget_allows(graph, max, now, s);
        let room = self.replicas[r].make_room(&rank, &within);
        for (mut seq, by) in room.preempted {
            seq.w.generated = seq.generated;
            seq.w.gpu_seconds = seq.gpu_seconds;
            seq.w.preemptions += 1;
            seq.w.waiting_for = Some(Reason::Preempted);
            // An orphan (its variant left with a policy swap; it was
            // finishing here under a stand-in) has nowhere to go back to.
            let servable =
                !seq.w.orphan && swap::servable(&self.by_variant, &self.replicas, &seq.w);
            self.preempted_out(seq.w, r, by, servable);
        }
        for mut seq in room.unfit {
            seq.w.generated = seq.generated;
            seq.w.gpu_seconds = seq.gpu_seconds;
            let elsewhere = self
                .by_variant
                .get(&(seq.w.model, seq.w.variant))
                .is_some_and(|rs| {
                    rs.iter().any(|&x| {
                        x != r
                            && self.replicas[x].up
                            && !self.replicas[x].draining
                            && seq.w.pool.is_none_or(|p| self.replicas[x].spec.pool == p)
                            && seq.kv <= self.replicas[x].pool_tokens()
                    })
                });
            seq.w.waiting_for = Some(Reason::Preempted);
            let id = seq.w.id;
            self.requeue(seq.w, r, id, elsewhere);
        }
    }

    /// Preempts the lowest-priority preemptible sequence on replica `r`
    /// that `w`'s tier may preempt, if any, within the thrash budget.
    ///
    /// On an external replica (an HTTP upstream) too: the environment
    /// cancels the upstream's request when it sees `Preempted` (the slot
    /// the scheduler counts is then free there as well), and what the
    /// client sees is the victim's tier's `on_preempt`.
    fn try_preempt(&mut self, r: usize, w: &Waiting) -> bool {
        // Nothing is preempted for work that could never fit here.
        let most = u64::from(w.prompt_tokens) + u64::from(w.output_tokens);
        if most > self.replicas[r].pool_tokens() {
            return false;
        }
        let Some(tier) = self.graph.tiers.get(w.tier as usize) else {
            return false;
        };
        let lends = w.tenant.and_then(|t| self.quotas.cohort(t)).is_some();
        let fair = self.fair_preempts((w.model, w.variant), w.tier, w.tenant);
        if tier.preempts.is_empty() && !lends && !fair {
            return false;
        }
        let victim = self.replicas[r]
            .running
            .iter()
            .enumerate()
            .filter(|(_, s)| self.may_preempt(r, s, w.tier, w.tenant, fair))
            // lowest priority first, then the one that started last (least work lost)
            .min_by_key(|(_, s)| {
                (
                    self.graph
                        .tiers
                        .get(s.w.tier as usize)
                        .map_or(i64::MIN, |t| t.priority),
                    std::cmp::Reverse(s.started),
                )
            })
            .map(|(i, _)| i);
        // Work with a first-token SLO takes a slot from work without one
        // (batch, background) at once: that work only backfills, and its
        // recompute costs less than the wait would cost the SLO (measured:
        // benches/batch.rs, tests/batch_backfill.rs). Otherwise
        // only when waiting for a slot to free would miss the SLO (half of
        // it, leaving the rest for the request itself): preemption costs a
        // recompute, so it is not spent where patience suffices.
        let backfill_victim = victim.is_some_and(|i| {
            self.replicas[r].running.get(i).is_some_and(|s| {
                self.graph
                    .tiers
                    .get(s.w.tier as usize)
                    .is_some_and(|t| t.slo.ttft.is_none())
            })
        });
        // A request with a completion window counts its own (a batch
        // item's).
        let budget = tier
            .slo
            .ttft
            .map(|ms| (ms * 1000.0 / 2.0) as Micros)
            .or_else(|| w.deadline.map(|d| d.saturating_sub(w.arrival) / 2));
        // (Not on an upstream: a preempted call there loses all its
        // progress, so patience still comes first. Its calls' own times
        // say when a slot frees there: the cost model may think the
        // upstream far faster than it is, and then every wait looked short
        // and nothing was preempted however tight the SLO.)
        let at_once = tier.slo.ttft.is_some() && backfill_victim && !self.replicas[r].spec.external;
        if let (Some(budget), false) = (budget, at_once) {
            let waited = self.now.saturating_sub(w.arrival);
            let to_free = self.replicas[r].observed_time_to_free(self.now);
            if waited.saturating_add(to_free) <= budget {
                return false;
            }
        }
        let Some(i) = victim else {
            return false;
        };
        // An upstream's GPU time so far is charged as a cancellation's is
        // (its steps are not seen here); its progress is unknown, so it
        // starts again from its prompt, charged again when it does.
        let share = if self.replicas[r].spec.external {
            self.external_share(r, i)
        } else {
            0.0
        };
        let pool = self.replicas[r].spec.pool;
        let mut seq = self.replicas[r].evict(i);
        if let (Some(t), true) = (seq.w.tenant, share > 0.0) {
            self.quotas
                .charge_gpu(t, share, self.now, seq.w.claims.tenant);
        }
        self.charge_budgets(&seq.w, pool, share);
        // Keeps its place: back at the head of its tenant's queue, with its
        // generated tokens; the KV cache is recomputed when it resumes.
        seq.w.preemptions += 1;
        seq.w.generated = seq.generated;
        seq.w.gpu_seconds = seq.gpu_seconds + share;
        // An upstream starts again from its prompt: this attempt's time
        // served nothing.
        seq.w.wasted_gpu_seconds += share;
        seq.w.waiting_for = Some(Reason::Preempted);
        self.preempted_out(seq.w, r, w.id, true);
        true
    }

    /// A sequence preempted off replica `r` by `by`: requeued (see
    /// [`Self::requeue`]), or, when its tier says `on_preempt reject`,
    /// announced and refused (503 `preempted`, Retry-After when the
    /// replica should have room again).
    fn preempted_out(&mut self, w: Waiting, r: usize, by: ReqId, servable: bool) {
        let reject = self
            .graph
            .tiers
            .get(w.tier as usize)
            .is_some_and(|t| t.on_preempt == crate::graph::OnPreempt::Reject);
        if !reject || !servable {
            self.requeue(w, r, by, servable);
            return;
        }
        self.out.push(Action::Preempted {
            id: w.id,
            replica: r,
            by,
        });
        // Fair share keeps what it was charged for what it did; the output
        // it will not make is given back.
        let unused = w.output_tokens.saturating_sub(w.generated);
        self.queues.refund(&self.graph, &self.cfg, &w, unused);
        let retry = self.replicas[r].time_to_free().max(SEC);
        self.end_held(w.id, swap::served_tokens(&w));
        self.out.push(Action::Reject {
            id: w.id,
            reason: Reason::Preempted,
            status: 503,
            retry_after: Some(retry),
        });
    }

    /// Under kiln, the longest a step may take for prefill of work without
    /// a TTFT SLO: a quarter of the tightest TTFT SLO of the policy, so a
    /// first token waits at most about that for the step in flight.
    /// The cap on capped prefill in replica `r`'s next step: a quarter of
    /// the tightest TTFT SLO among the tiers that replica could meet at
    /// all. A tier whose SLO not even a one-token prompt meets on an idle
    /// replica (`ttft 1ms`) has all its requests refused as `infeasible`:
    /// it protects nothing, and capping steps for it slowed the whole pool
    /// twelvefold.
    fn step_cap(&self, r: usize) -> Option<f64> {
        if self.cfg.mode != Mode::Kiln {
            return None;
        }
        let floor = self.replicas.get(r).map_or(0, |x| x.idle_floor);
        self.graph
            .tiers
            .iter()
            .filter_map(|t| t.slo.ttft)
            .filter(|&ms| (ms * 1000.0) as Micros >= floor)
            .map(|ms| ms / 1000.0 / 4.0)
            .min_by(f64::total_cmp)
    }

    /// The prefill rank of a tier's sequences: its priority under kiln, the
    /// same for all under the baselines (they prefill in start order).
    fn rank_of(&self, tier: TierId) -> i64 {
        match self.cfg.mode {
            Mode::Kiln => self
                .graph
                .tiers
                .get(tier as usize)
                .map_or(0, |t| t.priority),
            _ => 0,
        }
    }

    /// Whether a request of `tier` and `tenant` may preempt sequence `s`
    /// running on replica `r`: a lower tier it may preempt, or work a
    /// cohort member runs on borrowed quota, which the lender reclaims
    /// (either preemptible), or its own tier's work of a tenant above its
    /// share while its own tenant asks within its share (`fair`, the
    /// caller's [`Self::fair_preempts`] for it); within its thrash budget,
    /// and able to come back here.
    fn may_preempt(
        &self,
        r: usize,
        s: &Seq,
        tier: TierId,
        tenant: Option<TenantId>,
        fair: bool,
    ) -> bool {
        let Some(t) = self.graph.tiers.get(tier as usize) else {
            return false;
        };
        if s.w.orphan {
            return false;
        }
        let cohort = tenant.and_then(|t| self.quotas.cohort(t));
        let reclaim = s.w.borrowed
            && cohort.is_some()
            && s.w.tenant != tenant
            && s.w.tenant.and_then(|t| self.quotas.cohort(t)) == cohort;
        // Fair share's own preemption: work of a tenant above its weighted
        // share gives its slot to a tenant within its share, in the same
        // tier, on a replica kiln steps (an upstream's call would lose all
        // its progress; there the batch's reserve and fair order act
        // alone). Without it a within-share tenant arriving at a pool
        // that over-share work filled waits for a sequence to end: on a
        // KV-bound 70B pair one asking 70% of its share got 79% of it in
        // time (issue 26).
        let fair = fair
            && s.w.tier == tier
            && s.w.tenant != tenant
            && !s.w.best_effort
            && !self.replicas.get(r).is_some_and(|x| x.spec.external)
            && self.share_of((s.w.model, s.w.variant), tier, s.w.tenant, None, true)
                > ABOVE_ITS_SHARE;
        if !fair && !s.w.preemptible(&self.graph) {
            return false;
        }
        (t.preempts.contains(&s.w.tier) || reclaim || fair)
            && self.within_thrash_budget(s)
            && self
                .replicas
                .get(r)
                .is_some_and(|x| s.kv <= x.pool_tokens())
    }

    /// Whether running `s` may be preempted once more: within the thrash
    /// budget ([`Config::max_preemptions_per_seq`]), or, for work that only
    /// backfills (its tier has no first-token SLO) and has a completion
    /// deadline, while less than half of its window is spent (and never
    /// past [`THRASH_CEILING`] budgets). The budget
    /// keeps a sequence from never finishing; a window half left still
    /// holds that promise (its second half keeps the budget), while a
    /// budget spent early made batch sequences immune, and on the Azure
    /// hour at 90% load the interactive tier waited behind them (96.5% of
    /// its requests in time; 97.1% with this rule, the batch tier still
    /// 100% inside its hour).
    pub(crate) fn within_thrash_budget(&self, s: &Seq) -> bool {
        thrash_budget_allows(&self.graph, self.cfg.max_preemptions_per_seq, self.now, s)
    }

    /// Whether a request of a higher-priority tier started after `w` arrived.
    fn overtaken(&self, w: &Waiting) -> bool {
        let Some(mine) = self.graph.tiers.get(w.tier as usize).map(|t| t.priority) else {
            return false;
        };
        self.graph
            .tiers
            .iter()
            .zip(&self.tier_started)
            .any(|(t, &at)| t.priority > mine && at > w.arrival)
    }

    /// Tokens of KV cache held by running sequences across replicas (whole
    /// blocks; cached prefix blocks no one uses are not counted), and capacity.
    pub fn kv_usage(&self) -> (u64, u64) {
        self.replicas.iter().fold((0, 0), |(u, c), r| {
            (u + r.kv_used(), c + r.spec.kv_capacity)
        })
    }

    pub fn pool_of(&self, r: usize) -> Option<PoolId> {
        self.replicas.get(r).map(|x| x.spec.pool)
    }
}

/// How many thrash budgets a backfill sequence with its window half left
/// may spend at most (32 preemptions at the default budget of 2; the Azure
/// hour's batch sequences needed at most 22).
const THRASH_CEILING: u32 = 16;

/// [`Scheduler::within_thrash_budget`], on its parts (so that it can be
/// asked while a replica is borrowed).
fn thrash_budget_allows(graph: &DecisionGraph, max: u32, now: Micros, s: &Seq) -> bool {
    if s.w.preemptions < max {
        return true;
    }
    // Never past sixteen budgets: a replica whose KV growth evicts the same
    // backfill sequences step after step would otherwise thrash for half a
    // window (a day's window, in a proptest) without finishing anything.
    if s.w.preemptions >= max.saturating_mul(THRASH_CEILING) {
        return false;
    }
    let backfill = graph
        .tiers
        .get(s.w.tier as usize)
        .is_some_and(|t| t.slo.ttft.is_none());
    backfill
        && s.w
            .deadline
            .is_some_and(|d| d.saturating_sub(now) > d.saturating_sub(s.w.arrival) / 2)
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;

    fn cancelled(acts: &[Action]) -> Vec<ReqId> {
        ids(acts, |a| match a {
            Action::Cancelled { id } => Some(*id),
            _ => None,
        })
    }

    /// Where each started request went.
    fn started_on(acts: &[Action]) -> Vec<(ReqId, usize)> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Started { id, replica, .. } => Some((*id, *replica)),
                _ => None,
            })
            .collect()
    }

    /// `estimated_wait` is worked out only for a policy that reads it
    /// (`DecisionGraph::reads_estimated_wait`); one that does still has
    /// it: behind a long request on the only slot, the next one's estimate
    /// is its wait, and the rule refuses it. Without the rule it queues.
    #[test]
    fn a_policy_that_reads_estimated_wait_is_given_it() {
        let policy = |admit: &str| {
            graph(&format!(
                r#"
pool p {{ gpus 1 kind "H100-80GB" memory 80GB }}
model m {{ variant v {{ precision fp16 memory 10GB pools [p] max_batch 1 }} }}
tier t {{ priority 10 }}
tenant a {{ owner "o" tiers [t] }}
classify {{ default => tier t }}
route [t] m {{ default => v }}
{admit}
"#
            ))
        };
        let rejected = |acts: &[Action]| {
            ids(acts, |a| match a {
                Action::Reject { id, .. } => Some(*id),
                _ => None,
            })
        };
        let reads = policy(
            "admit t {\n  when estimated_wait > 50ms => reject 503 \"busy\"\n  default => accept\n}",
        );
        assert!(reads.reads_estimated_wait());
        let mut s = sched(&reads);
        assert_eq!(
            started(&arrive(&mut s, 0, arrival(0, "a", "m", 100, 2000))),
            [0]
        );
        assert_eq!(
            rejected(&arrive(&mut s, MS, arrival(1, "a", "m", 100, 10))),
            [1]
        );
        let ignores = policy("");
        assert!(!ignores.reads_estimated_wait());
        let mut s = sched(&ignores);
        assert_eq!(
            started(&arrive(&mut s, 0, arrival(0, "a", "m", 100, 2000))),
            [0]
        );
        assert!(rejected(&arrive(&mut s, MS, arrival(1, "a", "m", 100, 10))).is_empty());
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn upstreams_are_filled_least_loaded_first_not_in_index_order() {
        // Three HTTP upstreams of four slots each. Filled in index order,
        // the first took every request until its four slots were full
        // while the others idled (a real engine slows every sequence it
        // runs for each one beside it).
        let g = graph(
            r#"
pool ext { gpus 3 kind "H100-80GB" memory 80GB }
model api { variant up { precision fp16 memory 10GB pools [ext] max_batch 4 } }
tier t { priority 10 }
tenant a { owner "o" tiers [t] }
classify { default => tier t }
route [t] api { default => up }
"#,
        );
        let mut s = sched(&g);
        assert_eq!(s.replicas.len(), 3);
        assert!(s.replicas.iter().all(|r| r.spec.external));
        let mut on = Vec::new();
        for id in 0..6 {
            on.extend(started_on(&arrive(
                &mut s,
                id * MS,
                arrival(id, "a", "api", 100, 20),
            )));
        }
        let per = |r: usize| on.iter().filter(|(_, x)| *x == r).count();
        assert_eq!((per(0), per(1), per(2)), (2, 2, 2), "{on:?}");
        // Arrivals of one instant too; and twelve fill all twelve slots.
        let mut s = sched(&g);
        for id in 0..6 {
            arrive(&mut s, 0, arrival(id, "a", "api", 100, 20));
        }
        let running =
            |s: &Scheduler| -> Vec<usize> { s.replicas.iter().map(|r| r.running.len()).collect() };
        assert_eq!(running(&s), [2, 2, 2]);
        for id in 6..13 {
            arrive(&mut s, 0, arrival(id, "a", "api", 100, 20));
        }
        assert_eq!(running(&s), [4, 4, 4]);
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn cancel_takes_a_queued_request_out_and_releases_its_quota() {
        let g = graph(BASE);
        let mut s = sched(&g);
        // chat: tokens 60k/min, concurrent 4.
        for id in 0..4 {
            arrive(&mut s, 0, arrival(id, "chat", "m", 100, 5));
        }
        assert_eq!(s.waiting(), 3);
        assert_eq!(s.quotas.in_flight(0), 4);
        let acts = s.handle(MS, Event::Cancel { id: 2 }).to_vec();
        assert_eq!(cancelled(&acts), vec![2]);
        assert_eq!(s.waiting(), 2);
        assert_eq!(s.quotas.in_flight(0), 3);
        // Never started: nothing charged, the whole reservation refunded.
        assert!(!s.held.contains_key(&2));
        // Cancelling again, or an unknown id, does nothing.
        let acts = s.handle(MS, Event::Cancel { id: 2 }).to_vec();
        assert!(cancelled(&acts).is_empty());
        let acts = s.handle(MS, Event::Cancel { id: 99 }).to_vec();
        // (Only the wake-up for the end of the others' routing hold.)
        assert!(
            acts.iter().all(|a| matches!(a, Action::WakeAt(_))),
            "{acts:?}"
        );
    }

    #[test]
    fn cancel_frees_a_running_sequence_memory_at_once() {
        let g = graph(BASE);
        let mut s = sched(&g);
        let acts = arrive(&mut s, 0, arrival(0, "bulk", "m", 100, 50));
        assert_eq!(started(&acts), vec![0]);
        arrive(&mut s, 0, arrival(1, "bulk", "m", 100, 50));
        // Paged KV: the prompt's blocks (100 tokens, 7 blocks of 16), not
        // prompt and output reserved up front.
        assert_eq!(s.replicas[0].kv_used(), 112);
        let acts = s.handle(MS / 2, Event::Cancel { id: 0 }).to_vec();
        assert_eq!(cancelled(&acts), vec![0]);
        assert_eq!(s.replicas[0].kv_used(), 0);
        assert_eq!(s.running_on(0), 0);
        // The step in flight ends; the freed slot goes to the next one.
        let until = s.replicas[0].step_until;
        let acts = s.handle(until, Event::StepDone { replica: 0 }).to_vec();
        assert_eq!(started(&acts), vec![1]);
        assert!(!acts.iter().any(|a| matches!(a, Action::Finished { .. })));
    }

    #[test]
    fn cancel_charges_what_a_started_request_was_served() {
        let g = graph(BASE);
        let mut s = sched(&g);
        arrive(&mut s, 0, arrival(0, "chat", "m", 1000, 500));
        let before = s.quotas.remaining_percent(0, 0);
        // Run two steps: the prompt is prefilled and one token generated.
        for _ in 0..2 {
            let until = s.replicas[0].step_until;
            s.handle(until, Event::StepDone { replica: 0 });
        }
        let generated = s.replicas[0].running[0].generated;
        assert!(generated >= 1);
        let now = s.now();
        s.handle(now, Event::Cancel { id: 0 });
        // 1500 reserved of a 60k bucket (refilling 1000 a second); the
        // prompt and the generated tokens stay charged.
        let after = s.quotas.remaining_percent(0, now);
        let charged = 60_000.0 * (100.0 - after) / 100.0 + now as f64 / 1000.0;
        let expect = 1000.0 + f64::from(generated);
        assert!((charged - expect).abs() < 1.0, "{charged} vs {expect}");
        assert!(after > before);
        assert_eq!(s.quotas.in_flight(0), 0);
    }

    #[test]
    fn cancel_drops_a_delayed_request_and_its_timer() {
        let text = BASE.replace(
            "route [hi, lo] m",
            "admit lo {\n  when time in 08:00..20:00 => delay until 20:00\n  default => accept\n}\nroute [hi, lo] m",
        );
        let g = graph(&text);
        let mut s = sched(&g);
        let acts = arrive(&mut s, 0, arrival(0, "bulk", "m", 10, 2));
        assert!(acts.iter().any(|a| matches!(a, Action::WakeAt(_))));
        assert_eq!(s.parked(), 1);
        let acts = s.handle(SEC, Event::Cancel { id: 0 }).to_vec();
        assert_eq!(acts, vec![Action::Cancelled { id: 0 }]);
        assert_eq!(s.parked(), 0);
        assert!(s.timers.is_empty());
        let acts = s.handle(9 * 3600 * SEC, Event::Tick).to_vec();
        assert!(acts.is_empty(), "{acts:?}");
    }

    #[test]
    fn external_replicas_fill_slots_without_steps_and_finish_on_complete() {
        let g = graph(BASE);
        let mut s = sched(&g);
        let ext = s
            .replicas
            .iter()
            .position(|r| r.spec.external)
            .expect("an external replica");
        let mut acts = Vec::new();
        for id in 0..3 {
            acts.extend(arrive(&mut s, 0, arrival(id, "bulk", "api", 100, 10)));
        }
        assert_eq!(started(&acts), vec![0, 1], "two slots, queue order");
        assert!(!acts.iter().any(|a| matches!(a, Action::Step { .. })));
        assert_eq!(s.running_on(ext), 2);
        // Completion: finished with wall time x GPUs / sequences there.
        let acts = s
            .handle(
                2 * SEC,
                Event::Complete {
                    id: 1,
                    output_tokens: 7,
                },
            )
            .to_vec();
        let gpu = acts.iter().find_map(|a| match a {
            Action::Finished {
                id: 1, gpu_seconds, ..
            } => Some(*gpu_seconds),
            _ => None,
        });
        assert_eq!(gpu, Some(1.0));
        assert_eq!(started(&acts), vec![2], "the slot is refilled at once");
        assert!(!acts.iter().any(|a| matches!(a, Action::Step { .. })));
        // Complete for a queued, unknown or internal request does nothing.
        arrive(&mut s, 2 * SEC, arrival(3, "bulk", "api", 100, 10));
        arrive(&mut s, 2 * SEC, arrival(4, "bulk", "m", 100, 10));
        for id in [3, 4, 77] {
            let acts = s
                .handle(
                    2 * SEC,
                    Event::Complete {
                        id,
                        output_tokens: 1,
                    },
                )
                .to_vec();
            assert!(
                !acts.iter().any(|a| matches!(a, Action::Finished { .. })),
                "{id}: {acts:?}"
            );
        }
        assert!(s.held.contains_key(&3) && s.held.contains_key(&4));
    }

    #[test]
    fn work_on_an_external_replica_is_preempted_for_a_protected_tier() {
        let g = graph(BASE);
        let mut s = sched(&g);
        let ext = s.replicas.iter().position(|r| r.spec.external).unwrap();
        arrive(&mut s, 0, arrival(0, "bulk", "api", 100, 10));
        arrive(&mut s, 0, arrival(1, "bulk", "api", 100, 10));
        // hi preempts lo; at once it would wait, under the estimate, less
        // than half its TTFT SLO, so it waits...
        let acts = arrive(&mut s, SEC, arrival(2, "chat", "api", 100, 10));
        assert!(!acts.iter().any(|a| matches!(a, Action::Preempted { .. })));
        // ...and once it has waited long enough, a lo request is preempted
        // (its upstream request is the environment's to cancel) and hi
        // starts in its slot.
        let acts = s.handle(30 * SEC, Event::Tick).to_vec();
        let victim = acts.iter().find_map(|a| match a {
            Action::Preempted { id, replica, by: 2 } if *replica == ext => Some(*id),
            _ => None,
        });
        let Some(v) = victim else {
            panic!("nothing preempted: {acts:?}");
        };
        let other = 1 - v;
        assert_eq!(started(&acts), vec![2]);
        assert_eq!(s.running_on(ext), 2);
        // It is queued again at the head (not refused), and starts again
        // when a slot frees.
        assert_eq!(s.waiting(), 1);
        assert!(s.held.contains_key(&v));
        // A completion for it that crossed the preemption does nothing.
        let acts = s
            .handle(
                30 * SEC,
                Event::Complete {
                    id: v,
                    output_tokens: 3,
                },
            )
            .to_vec();
        assert!(!acts.iter().any(|a| matches!(a, Action::Finished { .. })));
        assert_eq!(s.waiting(), 1);
        // A replica going down takes back nothing (the upstream owns it).
        let acts = s
            .handle(31 * SEC, Event::ReplicaDown { replica: ext })
            .to_vec();
        assert!(!acts.iter().any(|a| matches!(a, Action::Preempted { .. })));
        assert_eq!(s.running_on(ext), 2);
        // It still completes what runs, but takes nothing new while down.
        let acts = s
            .handle(
                32 * SEC,
                Event::Complete {
                    id: other,
                    output_tokens: 10,
                },
            )
            .to_vec();
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Finished { id, .. } if *id == other)));
        assert!(started(&acts).is_empty());
        let acts = s
            .handle(33 * SEC, Event::ReplicaUp { replica: ext })
            .to_vec();
        assert_eq!(started(&acts), vec![v], "the preempted request resumes");
        let acts = s
            .handle(
                34 * SEC,
                Event::Complete {
                    id: v,
                    output_tokens: 10,
                },
            )
            .to_vec();
        let total = acts.iter().find_map(|a| match a {
            Action::Finished {
                id,
                gpu_seconds,
                wasted_gpu_seconds,
            } if *id == v => Some((*gpu_seconds, *wasted_gpu_seconds)),
            _ => None,
        });
        // Both runs' GPU time: the first (30 s of wall time over two
        // sequences) and the second; the first served nothing (the
        // upstream started again from the prompt).
        assert!(
            total.is_some_and(|(x, w)| x > 14.0 && w > 14.0 && w < x),
            "{total:?}"
        );
    }

    /// On an upstream, a protected request waits for a slot when the
    /// upstream's calls, as timed, free one within half its TTFT SLO, and
    /// preempts at once when they would not: the cost model thinks `api`
    /// answers these in milliseconds, so before the calls were timed an
    /// upstream taking seconds was never preempted on arrival.
    #[test]
    fn an_upstreams_timed_calls_decide_between_patience_and_preemption() {
        let g = graph(BASE); // hi: ttft 10s, so it waits at most 5 s for a slot
        for (call, preempts) in [(SEC, false), (4 * SEC, false), (8 * SEC, true)] {
            let mut s = sched(&g);
            let ext = s.replicas.iter().position(|r| r.spec.external).unwrap();
            for id in 0..4 {
                arrive(&mut s, 0, arrival(id, "bulk", "api", 100, 10));
            }
            // The first two calls take `call`; the next two start then.
            let mut acts = Vec::new();
            for id in 0..2 {
                acts.extend(
                    s.handle(
                        call,
                        Event::Complete {
                            id,
                            output_tokens: 10,
                        },
                    )
                    .to_vec(),
                );
            }
            assert_eq!(started(&acts), vec![2, 3]);
            let at = call + SEC / 10;
            let acts = arrive(&mut s, at, arrival(9, "chat", "api", 100, 10));
            let preempted = acts
                .iter()
                .any(|a| matches!(a, Action::Preempted { by: 9, replica, .. } if *replica == ext));
            assert_eq!(preempted, preempts, "calls of {call} µs: {acts:?}");
            assert_eq!(started(&acts).contains(&9), preempts);
        }
    }

    #[test]
    fn a_tier_that_rejects_on_preemption_is_refused_not_requeued() {
        let g = graph(&BASE.replace(
            "slo { window 1h } preemptible }",
            "slo { window 1h } preemptible on_preempt reject }",
        ));
        for ext in [false, true] {
            let model = if ext { "api" } else { "m" };
            let mut s = sched(&g);
            let r = s
                .replicas
                .iter()
                .position(|r| r.spec.external == ext)
                .unwrap();
            let mut acts = arrive(&mut s, 0, arrival(0, "bulk", model, 100, 100_000));
            acts.extend(arrive(&mut s, 0, arrival(1, "bulk", model, 100, 100_000)));
            // Steps run until hi arrives, and on until the preemption.
            let mut hi_sent = false;
            let mut step = None;
            for _ in 0..10_000 {
                if acts
                    .iter()
                    .any(|a| matches!(a, Action::Preempted { by: 2, .. }))
                {
                    break;
                }
                if let Some(next) = acts.iter().find_map(|a| match a {
                    Action::Step { replica, until } => Some((*replica, *until)),
                    _ => None,
                }) {
                    step = Some(next);
                }
                let at = step.map_or(SEC, |(_, u)| u);
                if !hi_sent && at >= SEC {
                    hi_sent = true;
                    acts = arrive(&mut s, SEC, arrival(2, "chat", model, 100, 10));
                    continue;
                }
                acts = match step.take() {
                    Some((replica, until)) => s.handle(until, Event::StepDone { replica }).to_vec(),
                    None => s.handle(30 * SEC, Event::Tick).to_vec(),
                };
            }
            let victim = acts.iter().find_map(|a| match a {
                Action::Preempted { id, replica, by: 2 } if *replica == r => Some(*id),
                _ => None,
            });
            let Some(v) = victim else {
                panic!("nothing preempted on {model}: {acts:?}");
            };
            let refused = acts.iter().find_map(|a| match a {
                Action::Reject {
                    id,
                    reason,
                    status,
                    retry_after,
                } if *id == v => Some((*reason, *status, *retry_after)),
                _ => None,
            });
            assert!(
                matches!(refused, Some((Reason::Preempted, 503, Some(x))) if x >= SEC),
                "{model}: {refused:?}"
            );
            assert!(started(&acts).contains(&2));
            assert!(!s.held.contains_key(&v));
            assert!(s.queues.remove(v).is_none());
        }
    }

    #[test]
    fn estimates_stay_finite_for_external_replicas() {
        let g = graph(BASE);
        let mut s = sched(&g);
        let ext = s.replicas.iter().position(|r| r.spec.external).unwrap();
        for id in 0..2 {
            arrive(&mut s, 0, arrival(id, "bulk", "api", 100, 400_000));
        }
        assert_eq!(s.running_on(ext), 2);
        let r = &s.replicas[ext];
        assert!(r.throughput_tokens_per_s().is_finite());
        assert!(r.throughput_tokens_per_s() > 0.0);
        assert!(r.time_to_free() > 0);
        let q = Estimating {
            key: (1, 0),
            tier: 1,
            tenant: Some(1),
            prompt: 100,
            output: 10,
            window: None,
            own: None,
            prefix: &[],
            reference: 0,
        };
        let est = s.estimate_for(&q, &[ext]).first_token;
        assert!(est < u64::MAX / 4, "{est}");
    }

    #[test]
    fn pinned_tokens_follow_routed_requests_in_and_out_of_the_queue() {
        let g = graph(BASE);
        let cfg = Config {
            routing: route::Routing::LeastLoaded,
            ..Config::default()
        };
        let mut s = Scheduler::new(g.clone(), plan(&g, 1_000_000), cfg);
        // One slot on m's replica: the first starts, the others wait for it.
        for id in 0..3 {
            arrive(&mut s, 0, arrival(id, "bulk", "m", 100, 5));
        }
        let r = s.replicas[0].running[0].w.clone();
        assert_eq!(r.affinity, None, "a started request is routed no more");
        assert_eq!(s.pinned_tokens(0), 2 * 105);
        s.handle(MS, Event::Cancel { id: 2 });
        assert_eq!(s.pinned_tokens(0), 105);
        // Steps run until everything finished: nothing is left pinned.
        for _ in 0..64 {
            let until = s.replicas[0].step_until;
            s.handle(until, Event::StepDone { replica: 0 });
        }
        assert_eq!(s.waiting(), 0);
        assert_eq!(s.pinned_tokens(0), 0);
        assert!(s.replicas[0].prefilled_tokens >= 200);
        assert_eq!(s.replicas[0].decoded_tokens, 10);
    }

    #[test]
    fn a_baseline_router_pins_strictly_and_kiln_lets_another_replica_take_it() {
        let text = r#"
pool p { gpus 2 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] max_batch 1 } }
tier t { priority 1 slo { ttft 10s } }
tenant x { owner "o" tiers [t] }
classify { default => tier t }
route t m { default => fp16 }
"#;
        let g = graph(text);
        let run = |routing| {
            let cfg = Config {
                routing,
                ..Config::default()
            };
            let mut s = Scheduler::new(g.clone(), plan(&g, 1_000_000), cfg);
            let mut on = HashMap::default();
            let mut note = |acts: &[Action]| {
                for a in acts {
                    if let Action::Started { id, replica, .. } = a {
                        on.insert(*id, *replica);
                    }
                }
            };
            // A long request, a short one, then one more for either.
            note(&arrive(&mut s, 0, arrival(0, "x", "m", 100, 400)));
            note(&arrive(&mut s, 0, arrival(1, "x", "m", 100, 1)));
            note(&arrive(&mut s, 0, arrival(2, "x", "m", 100, 1)));
            for _ in 0..2000 {
                let Some((r, until)) = s
                    .replicas
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| x.busy)
                    .map(|(i, x)| (i, x.step_until))
                    .min_by_key(|&(_, t)| t)
                else {
                    break;
                };
                note(s.handle(until, Event::StepDone { replica: r }));
            }
            (on[&0], on[&1], on[&2])
        };
        // Round robin sent the third to the first replica, and it waits
        // there behind the long one though the second is free.
        let (a, b, c) = run(route::Routing::RoundRobin);
        assert_ne!(a, b);
        assert_eq!(c, a);
        // Kiln's soft pin lets the free replica take it once the hold ends.
        let (a, _, c) = run(route::Routing::Kiln);
        assert_ne!(c, a);
    }

    #[test]
    fn queue_snapshot_names_each_queue_with_its_share() {
        let g = graph(BASE);
        let mut s = sched(&g);
        for id in 0..3 {
            arrive(&mut s, id * MS, arrival(id, "bulk", "m", 100, 5));
        }
        arrive(&mut s, 3 * MS, arrival(3, "chat", "m", 100, 5));
        let rows = s.queue_snapshot();
        let bulk = rows
            .iter()
            .find(|r| r.tenant.as_deref() == Some("bulk"))
            .expect("a bulk row");
        assert_eq!(bulk.tier, "lo");
        assert_eq!(bulk.depth, 2);
        assert_eq!(bulk.oldest_wait, 2 * MS);
        assert!(bulk.served > 0.0);
        assert_eq!(bulk.share, 1.0, "the only tenant served in lo");
        let chat = rows
            .iter()
            .find(|r| r.tenant.as_deref() == Some("chat"))
            .expect("a chat row");
        assert_eq!((chat.tier.as_str(), chat.depth), ("hi", 1));
        assert_eq!(chat.share, 0.0, "not served yet");
        for r in &rows {
            assert!((0.0..=1.0).contains(&r.share));
        }
        let json = serde_json::to_string(&rows).unwrap();
        assert!(json.contains("\"oldest_wait\""), "{json}");
        assert!(std::sync::Arc::ptr_eq(s.graph(), &g));
    }

    /// The month-end close, in the policy's zone: finance's work runs in
    /// tier `close` from the 28th through the 2nd, Berlin time.
    const CLOSE: &str = r#"
policy { timezone "Europe/Berlin" }
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier close { priority 60 slo { window 6h } }
tier lo { priority 10 slo { window 24h } }
tenant fin { owner "o" tiers [close, lo] }
classify {
  when tenant == fin and day in 28..2 => tier close
  default => tier lo
}
route [close, lo] m { default => fp16 }
"#;

    #[test]
    fn date_signals_read_the_policys_zone_on_a_wall_clock() {
        let g = graph(CLOSE);
        let cfg = Config {
            // 2026-01-27 22:30 UTC: 23:30 on the 27th in Berlin.
            start_unix_ms: Some(1_769_553_000_000),
            ..Config::default()
        };
        let mut s = Scheduler::new(g.clone(), plan(&g, 1_000_000), cfg);
        let close = g.tier_id("close").unwrap();
        let lo = g.tier_id("lo").unwrap();
        let hour = 3600 * SEC;
        let tier_at = |s: &mut Scheduler, id: ReqId, at: Micros| {
            arrive(s, at, arrival(id, "fin", "m", 10, 5))
                .iter()
                .find_map(|a| match a {
                    Action::Decided { tier, .. } => Some(*tier),
                    _ => None,
                })
        };
        assert_eq!(tier_at(&mut s, 1, 0), Some(lo));
        assert_eq!(
            (s.signals().day, s.signals().time_of_day),
            (27, 23 * 60 + 30)
        );
        // An hour later it is the 28th in Berlin, still the 27th in UTC.
        assert_eq!(tier_at(&mut s, 2, hour), Some(close));
        assert_eq!(s.signals().day, 28);
        assert_eq!(
            s.signals().date,
            crate::units::calendar::date_days(2026, 1, 28).unwrap()
        );
        // Every hour for two weeks: `close` exactly from the 28th to the 2nd.
        for h in 2..(14 * 24) {
            let t = tier_at(&mut s, 100 + h, h * hour).unwrap();
            let day = s.signals().day;
            assert_eq!(t == close, day >= 28 || day <= 2, "hour {h}: day {day}");
        }
    }
}
