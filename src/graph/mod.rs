//! The immutable decision graph: what a policy compiles to, and what the
//! gateway holds behind an `ArcSwap` and evaluates per request. Names are
//! resolved to dense ids; every value is in base units; conditions are
//! typed trees over request attributes and live signals.

mod cond;
mod eval;
pub mod exception;
mod input;
pub mod limits;
pub mod signal;
pub mod trace;
mod view;

pub use cond::{Cond, Sig, Test, TestOp};
pub use eval::{Admission, Decision, Target};
pub use exception::{Exception, Subject};
pub use input::{
    Request, Retry, Signals, SignalsInput, TierMetrics, BATCH_HEADER, BATCH_PREEMPTIBLE_HEADER,
    BATCH_TRY_HEADER, IDLE_DATE, RETRY_HEADER, SDK_RETRY_HEADER,
};
pub use view::{DecisionView, FiredRule};

use crate::source::Span;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub type PoolId = u16;
pub type ModelId = u16;
pub type TierId = u16;
pub type TenantId = u32;
pub type CohortId = u16;
pub type RuleId = u32;

#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub name: String,
    pub gpus: u32,
    pub kind: String,
    /// Memory of one GPU, bytes.
    pub gpu_memory: f64,
    pub labels: BTreeMap<String, String>,
    /// When set, only these tiers may run here.
    pub allow_tiers: Option<Vec<TierId>>,
    pub deny_tiers: Vec<TierId>,
    pub allow_tenants: Option<Vec<TenantId>>,
    pub deny_tenants: Vec<TenantId>,
    /// Sliding window of its measured signals, ms.
    pub signal_window: f64,
    /// `price 3.2/h`: what one of its GPUs costs an hour.
    pub price_per_gpu_hour: Option<f64>,
    /// Who owns the pool (`owner "gpu-infra"`) and whom to escalate to.
    pub owner: Owner,
    pub span: Span,
}

/// Who owns a tier, pool, tenant, cohort or the policy (`owner "team"`),
/// and the contact to escalate to when the owner does not answer
/// (`escalation "oncall-lead"`). Owners label alerts and dashboards, head
/// playbook sections, and approve changes to what they own where an
/// approval rule says `require owner for [...]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Owner {
    pub owner: Option<String>,
    pub escalation: Option<String>,
}

impl Owner {
    /// This one where it names an owner, else `fallback`'s; the escalation
    /// contact chains up the same way on its own (a team without an
    /// escalation contact escalates to the policy's).
    pub fn or(&self, fallback: &Owner) -> Owner {
        Owner {
            owner: self.owner.clone().or_else(|| fallback.owner.clone()),
            escalation: self
                .escalation
                .clone()
                .or_else(|| fallback.escalation.clone()),
        }
    }
}

impl Pool {
    /// Isolation: may this tier (and tenant, when known) use the pool?
    pub fn admits(&self, tier: TierId, tenant: Option<TenantId>) -> bool {
        if self.deny_tiers.contains(&tier) {
            return false;
        }
        if let Some(a) = &self.allow_tiers {
            if !a.contains(&tier) {
                return false;
            }
        }
        if let Some(t) = tenant {
            if self.deny_tenants.contains(&t) {
                return false;
            }
            if let Some(a) = &self.allow_tenants {
                if !a.contains(&t) {
                    return false;
                }
            }
        }
        true
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
    Fp8,
    Int8,
    Int4,
}

impl Precision {
    pub const NAMES: [&'static str; 6] = ["fp32", "bf16", "fp16", "fp8", "int8", "int4"];

    pub fn parse(s: &str) -> Option<Precision> {
        Some(match s {
            "fp32" => Precision::Fp32,
            "bf16" => Precision::Bf16,
            "fp16" => Precision::Fp16,
            "fp8" => Precision::Fp8,
            "int8" => Precision::Int8,
            "int4" => Precision::Int4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp8 => "fp8",
            Precision::Int8 => "int8",
            Precision::Int4 => "int4",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    pub name: String,
    pub precision: Precision,
    /// Weights plus reserved KV memory for one replica, bytes.
    pub memory: f64,
    pub gpus_per_replica: u32,
    pub pools: Vec<PoolId>,
    pub quality: Option<String>,
    /// Continuous batching limits per replica: sequences in a step, and
    /// tokens (prefill chunks plus decodes) in a step.
    pub max_batch: u32,
    /// `None`: the engine's default for the pool's GPU
    /// ([`Variant::batch_tokens_on`]).
    pub max_batch_tokens: Option<u32>,
    pub span: Span,
}

impl Variant {
    /// Tokens in one step of a replica of this variant on `pool`: what the
    /// policy says, else what the engine would choose on that GPU.
    pub fn batch_tokens_on(&self, pool: &Pool) -> u32 {
        self.max_batch_tokens
            .unwrap_or_else(|| default_batch_tokens(pool))
    }
}

/// The step's token budget an engine picks when it is not told: vLLM's
/// OpenAI server (`EngineArgs.get_batch_defaults`) takes 8,192 tokens on
/// GPUs with at least 70 GiB that are not A100s, and 2,048 on every other
/// GPU (larger chunks cost A100s throughput, vLLM PR 17885); SGLang's
/// `chunked_prefill_size` also shrinks with the GPU. A step of 8,192
/// prefill tokens takes about 2 s on an L4, so modelling it there would
/// put seconds of other prompts in front of a short prompt's first token
/// that the engine never does.
pub fn default_batch_tokens(pool: &Pool) -> u32 {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    if pool.gpu_memory >= 70.0 * GIB && !pool.kind.to_ascii_lowercase().contains("a100") {
        8192
    } else {
        2048
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub name: String,
    pub variants: Vec<Variant>,
    /// Parameter count, for the simulator's cost model (`params 70B`).
    pub params: Option<f64>,
    /// KV-cache bytes per token at 16-bit precision (`kv_per_token 320KB`).
    pub kv_per_token: Option<f64>,
    /// Limits shared by all requests for the model (`quota { … }`).
    pub quota: Quota,
    /// What one answered request is worth to the business, in the
    /// currency of prices (`value 0.04`), for reports; `None`: not said.
    pub value_per_request: Option<f64>,
    pub span: Span,
}

/// A money budget (`budget 500/day`, `budget 12k/month`): currency a
/// tenant's or tier's GPU time may cost per calendar day or month in the
/// policy's time zone, at the prices `gpu_hour_price` gives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub amount: f64,
    pub period: BudgetPeriod,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BudgetPeriod {
    Day,
    Month,
}

impl BudgetPeriod {
    pub fn name(self) -> &'static str {
        match self {
            BudgetPeriod::Day => "day",
            BudgetPeriod::Month => "month",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Slo {
    /// Time to first token target, ms.
    pub ttft: Option<f64>,
    /// End-to-end p95 target, ms.
    pub e2e_p95: Option<f64>,
    /// Completion window for batch work, ms.
    pub window: Option<f64>,
    /// The share of the tier's requests that may end in an error (a 5xx:
    /// no capacity, a queue timeout, an upstream's failure), in percent.
    pub error_rate: Option<f64>,
    /// The service the tier must get while it has work waiting.
    pub throughput: Option<Throughput>,
    /// What a completion window is: a hard deadline (work that would
    /// miss it is refused at admission, the default) or a soft one (it is
    /// admitted, runs late, and counts a miss).
    pub deadline: Deadline,
}

impl Slo {
    pub fn is_empty(&self) -> bool {
        self.ttft.is_none()
            && self.e2e_p95.is_none()
            && self.window.is_none()
            && self.error_rate.is_none()
            && self.throughput.is_none()
    }
}

/// A throughput objective: served tokens or finished requests a second,
/// either or both.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Throughput {
    pub tokens_per_s: Option<f64>,
    pub requests_per_s: Option<f64>,
}

/// `slo { deadline hard|soft }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Deadline {
    #[default]
    Hard,
    Soft,
}

impl Deadline {
    pub const NAMES: [&'static str; 2] = ["hard", "soft"];

    pub fn parse(s: &str) -> Option<Deadline> {
        match s {
            "hard" => Some(Deadline::Hard),
            "soft" => Some(Deadline::Soft),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Deadline::Hard => "hard",
            Deadline::Soft => "soft",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tier {
    pub name: String,
    pub priority: i64,
    pub slo: Slo,
    /// Continuous batching: how long a request may wait for a batch, ms.
    /// `None`: joins the next step, never waits for a batch to fill.
    pub batch_max_wait: Option<f64>,
    pub preemptible: bool,
    pub preempts: Vec<TierId>,
    pub backfill_only: bool,
    /// One priority level gained per this much waiting, ms.
    pub aging: Option<f64>,
    /// This tier may starve: its waiting requests gain no priority with age
    /// (without it, a tier with no `aging` ages one level a minute).
    pub may_starve: bool,
    /// Models this tier may use; `None` means every model.
    pub models: Option<Vec<ModelId>>,
    /// Prefer the replica that already holds the request's prompt prefix.
    pub prefix_affinity: bool,
    /// The tier's response caches (`exact_cache`, `cache { exact { … }
    /// semantic { … } }`); empty when it has none.
    pub cache: TierCache,
    /// Sliding window of its measured signals, ms.
    pub signal_window: f64,
    /// What a preempted request of this (preemptible) tier becomes.
    pub on_preempt: OnPreempt,
    /// Guaranteed shares of shared pools (`reserve { shared 25% }`): lent
    /// to other tiers while this one has no work waiting there, reclaimed
    /// when it has (see `sched::reserve`).
    pub reserve: Vec<Reserve>,
    /// How long fair share between this tier's tenants remembers service,
    /// ms (`fair_share { window 5m }`); `None` takes the scheduler's.
    pub fair_share_window: Option<f64>,
    /// Limits shared by all of the tier's requests (`quota { … }`), beside
    /// each tenant's own.
    pub quota: Quota,
    /// The Batches API `completion_window`s a batch whose items classify
    /// into this tier may ask for, ms, as written (`completion_windows
    /// [1h, 24h]`); never empty: `[24h]` when the policy names none.
    pub completion_windows: Vec<f64>,
    /// What the tier's GPU time may cost per day or month.
    pub budget: Option<Budget>,
    pub owner: Owner,
    pub span: Span,
}

/// A tier's response caches, as the policy declares them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TierCache {
    /// Identical deterministic requests are answered from a cache
    /// (`exact_cache`, or `cache { exact { entries 10000, ttl 10m } }`).
    pub exact: Option<ExactSpec>,
    /// Requests whose prompt embeds close to a cached one's are answered
    /// from it (`cache { semantic { similarity 0.92 } }`). The gateway
    /// serves it with an embedding model (`[cache] embedding_model`) and
    /// refuses a policy that asks for it without one.
    pub semantic: Option<SemanticSpec>,
}

impl TierCache {
    pub fn is_empty(&self) -> bool {
        self.exact.is_none() && self.semantic.is_none()
    }
}

/// An exact-response cache: at most `max_entries` answers, each kept for
/// `ttl_us`; keyed by tenant unless `shared`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExactSpec {
    pub max_entries: u32,
    pub ttl_us: u64,
    /// Tenants of the tier share answers (default: each tenant its own).
    pub shared: bool,
}

impl ExactSpec {
    /// What the bare `exact_cache` flag (and `cache { exact }`) means.
    pub const DEFAULT: ExactSpec = ExactSpec {
        max_entries: 10_000,
        ttl_us: 600 * 1_000_000,
        shared: false,
    };
}

/// A semantic cache: an answer is reused for a prompt whose embedding is at
/// least `min_similarity` (cosine) from the cached prompt's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SemanticSpec {
    pub min_similarity: f32,
    pub max_entries: u32,
    pub ttl_us: u64,
    pub shared: bool,
}

/// A tier's reserved share of one pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reserve {
    pub pool: PoolId,
    /// Percent of each replica's batch slots and KV blocks in the pool,
    /// above 0 and at most 100.
    pub share: f64,
    pub span: Span,
}

/// What happens to a request of a preemptible tier when it is preempted
/// (`on_preempt` on the tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnPreempt {
    /// Back to the head of its queue, recomputed when it starts again; its
    /// client keeps waiting (a stream whose answer has begun ends with a
    /// `preempted` error event: kiln does not splice two generations).
    #[default]
    Requeue,
    /// Refused: 503 with Retry-After and reason `preempted`.
    Reject,
}

impl OnPreempt {
    pub const NAMES: &'static [&'static str] = &["requeue", "reject"];

    pub fn parse(s: &str) -> Option<OnPreempt> {
        match s {
            "requeue" => Some(OnPreempt::Requeue),
            "reject" => Some(OnPreempt::Reject),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OnPreempt::Requeue => "requeue",
            OnPreempt::Reject => "reject",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Quota {
    /// Tokens per second (prompt + completion).
    pub tokens: Option<f64>,
    /// Requests per second.
    pub requests: Option<f64>,
    pub concurrent: Option<u64>,
    /// GPU-seconds per second (GPU-seconds/day ÷ 86400).
    pub gpu_seconds: Option<f64>,
}

impl Quota {
    pub fn is_limited(&self) -> bool {
        self.tokens.is_some()
            || self.requests.is_some()
            || self.concurrent.is_some()
            || self.gpu_seconds.is_some()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub name: String,
    pub owner: Option<String>,
    /// Whom to escalate to when the owner does not answer.
    pub escalation: Option<String>,
    /// Tiers granted, the first is where the tenant lands when classify
    /// picks a tier it is not granted.
    pub tiers: Vec<TierId>,
    pub cohort: Option<CohortId>,
    pub quota: Quota,
    pub weight: f64,
    /// Share of its quota it may borrow from idle cohort capacity, 0–100.
    pub borrow: f64,
    /// Share of its quota it lends to its cohort when idle, 0–100.
    pub lend: f64,
    /// Share of requests that may be retries, 0–100.
    pub retry_budget: Option<f64>,
    /// Agentic session step budget.
    pub session_steps: Option<u64>,
    /// Cost per GPU-hour.
    pub cost_per_gpu_hour: Option<f64>,
    /// What the tenant's GPU time may cost per day or month.
    pub budget: Option<Budget>,
    pub api_keys: Vec<String>,
    /// Sliding window of its measured signals, ms.
    pub signal_window: f64,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Cohort {
    pub name: String,
    pub owner: Option<String>,
    pub escalation: Option<String>,
    pub span: Span,
}

/// Where a rule lives, for explain traces and test coverage.
#[derive(Debug, Clone, PartialEq)]
pub struct RuleInfo {
    /// `classify`, `route interactive llama-70b`, `admit batch`, `fallback batch`
    pub block: String,
    /// 1-based position in its block.
    pub index: usize,
    /// The rule as the formatter prints it.
    pub text: String,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RuleSet<O> {
    pub rules: Vec<(RuleId, Cond, O)>,
    pub default: (RuleId, O),
    /// Rules that can only match named tenants, indexed by tenant, so a
    /// decision skips the rules of other teams (built by [`RuleSet::index`]).
    pub by_tenant: Option<TenantIndex>,
}

/// Positions (into `rules`) of the rules each tenant can match, and of the
/// rules that do not depend on the tenant. Both sorted: a decision merges
/// them and keeps first-match order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TenantIndex {
    pub pinned: Vec<Vec<u32>>,
    pub unpinned: Vec<u32>,
}

impl<O> RuleSet<O> {
    /// Builds the tenant index when it pays: when at least a few rules test
    /// `tenant == X` or `tenant in [..]` at their top level.
    pub fn index(&mut self, tenants: usize) {
        let mut ix = TenantIndex {
            pinned: vec![Vec::new(); tenants],
            unpinned: Vec::new(),
        };
        let mut pinned_rules = 0;
        for (pos, (_, cond, _)) in self.rules.iter().enumerate() {
            match cond.pinned_tenants() {
                Some(ids) => {
                    pinned_rules += 1;
                    for id in ids {
                        if let Some(v) = ix.pinned.get_mut(*id as usize) {
                            v.push(pos as u32);
                        }
                    }
                }
                None => ix.unpinned.push(pos as u32),
            }
        }
        self.by_tenant = (pinned_rules >= 8).then_some(ix);
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ClassifyOutcome {
    pub tier: TierId,
    pub tenant: Option<TenantId>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RouteOutcome {
    Target(Target),
    Fallback,
    Reject(Arc<Reject>),
}

#[derive(Debug, Clone, PartialEq)]
pub enum AdmitOutcome {
    Accept,
    Queue {
        max_wait: f64,
    },
    Delay {
        until: u16,
    },
    /// Keep the tier's work out of dispatch while the condition holds;
    /// each request waits at most `max_wait` ms (else the tier's bound).
    Hold {
        max_wait: Option<f64>,
    },
    Degrade {
        variant: Option<u16>,
        max_tokens: Option<u64>,
    },
    Reject(Arc<Reject>),
    Fallback,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Reject {
    pub status: u16,
    pub message: String,
    /// ms
    pub retry_after: Option<f64>,
    /// Reason code: `policy`, `quota`, `concurrency`, `unknown-model`, `unknown-tenant`.
    pub reason: &'static str,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Route(Target),
    /// Wait up to `max_wait` ms for capacity; on timeout the scheduler
    /// applies the next step (or rejects with 503 when this is the last).
    Queue {
        max_wait: f64,
    },
    Demote(TierId),
    Reject(Arc<Reject>),
}

/// How a response served by a substitute reports its model in the OpenAI
/// body's `model` field (headers always name both models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseModel {
    /// The model that produced the tokens (the default: it is what ran).
    #[default]
    Served,
    /// The model the client asked for, for clients that compare it.
    Requested,
}

impl ResponseModel {
    pub const NAMES: [&'static str; 2] = ["served", "requested"];

    pub fn parse(s: &str) -> Option<ResponseModel> {
        match s {
            "served" => Some(ResponseModel::Served),
            "requested" => Some(ResponseModel::Requested),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ResponseModel::Served => "served",
            ResponseModel::Requested => "requested",
        }
    }
}

/// `model A { served_by B { tiers [..] } }`: requests for `model` (A) in
/// these tiers may be served by `by` (B). Directional and not transitive.
#[derive(Debug, Clone, PartialEq)]
pub struct Substitution {
    pub model: ModelId,
    pub by: ModelId,
    pub tiers: Vec<TierId>,
    pub response_model: ResponseModel,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FallbackChain {
    pub steps: Vec<(RuleId, Step)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rollback {
    pub cond: Cond,
    /// How long the condition must hold, ms.
    pub hold: Option<f64>,
    pub text: String,
    /// The `rollback when …` line, for diagnostics.
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rollout {
    pub shadow: Option<f64>,
    pub canary_share: Option<f64>,
    pub canary_tenants: Vec<TenantId>,
    pub canary_duration: Option<f64>,
    /// `stage NAME { … }` blocks, in order (never together with a canary).
    pub stages: Vec<RolloutStage>,
    pub rollbacks: Vec<Rollback>,
}

/// One stage of a staged rollout: the canary version decides the requests
/// in its scope (every list it names restricts; an empty list does not),
/// sampled by `share`, for at least `duration`, and until its gates hold.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutStage {
    pub name: String,
    /// % of the scoped requests; `None` is all of them.
    pub share: Option<f64>,
    pub tenants: Vec<TenantId>,
    pub tiers: Vec<TierId>,
    pub models: Vec<ModelId>,
    /// ms
    pub duration: Option<f64>,
    /// `gate when …` lines: read like rollback conditions.
    pub gates: Vec<Rollback>,
    pub span: Span,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Any,
    PriorityIncrease,
    QuotaIncrease,
    PreemptionChange,
    TierChange,
    TenantChange,
    RouteChange,
    PoolChange,
    RolloutChange,
    ApprovalChange,
    Rollback,
    /// An `exception` added, removed or changed.
    ExceptionChange,
}

impl ChangeKind {
    pub const ALL: [ChangeKind; 12] = [
        ChangeKind::Any,
        ChangeKind::PriorityIncrease,
        ChangeKind::QuotaIncrease,
        ChangeKind::PreemptionChange,
        ChangeKind::TierChange,
        ChangeKind::TenantChange,
        ChangeKind::RouteChange,
        ChangeKind::PoolChange,
        ChangeKind::RolloutChange,
        ChangeKind::ApprovalChange,
        ChangeKind::Rollback,
        ChangeKind::ExceptionChange,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ChangeKind::Any => "any",
            ChangeKind::PriorityIncrease => "priority_increase",
            ChangeKind::QuotaIncrease => "quota_increase",
            ChangeKind::PreemptionChange => "preemption_change",
            ChangeKind::TierChange => "tier_change",
            ChangeKind::TenantChange => "tenant_change",
            ChangeKind::RouteChange => "route_change",
            ChangeKind::PoolChange => "pool_change",
            ChangeKind::RolloutChange => "rollout_change",
            ChangeKind::ApprovalChange => "approval_change",
            ChangeKind::Rollback => "rollback",
            ChangeKind::ExceptionChange => "exception_change",
        }
    }

    /// Escalations need the stricter approval rule.
    pub fn is_escalation(self) -> bool {
        matches!(
            self,
            ChangeKind::PriorityIncrease | ChangeKind::QuotaIncrease | ChangeKind::PreemptionChange
        )
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApprovalRule {
    pub count: u32,
    /// The approvers' group; empty for `require owner`.
    pub group: String,
    /// `require owner for [...]`: the owner of each thing the change
    /// touches must approve (one approval per distinct owner).
    pub owner: bool,
    pub kinds: Vec<ChangeKind>,
}

/// A compiled, validated policy. Immutable: a new policy is a new graph.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionGraph {
    pub pools: Vec<Pool>,
    pub models: Vec<Model>,
    pub tiers: Vec<Tier>,
    pub tenants: Vec<Tenant>,
    pub cohorts: Vec<Cohort>,
    pub classify: RuleSet<ClassifyOutcome>,
    /// Indexed by `tier * models.len() + model`.
    pub routes: Vec<Option<RuleSet<RouteOutcome>>>,
    /// Indexed by tier; `None` admits everything.
    pub admits: Vec<Option<RuleSet<AdmitOutcome>>>,
    /// Indexed by tier.
    pub fallbacks: Vec<Option<FallbackChain>>,
    pub rollout: Option<Rollout>,
    pub approvals: Vec<ApprovalRule>,
    pub rules: Vec<RuleInfo>,
    /// Variant names that `degrade variant` outcomes move to, resolved
    /// against the request's model at decision time.
    pub degrade_names: Vec<String>,
    /// The model a `degrade variant MODEL.VARIANT` names, by the same index
    /// as `degrade_names` (`None` for a bare variant name: the request's
    /// own model).
    pub degrade_models: Vec<Option<ModelId>>,
    /// Declared cross-model substitutions (`served_by`).
    pub substitutions: Vec<Substitution>,
    /// `policy { timezone "…" }`: the zone `time`, `weekday`, `date` and
    /// `day` read (UTC without one).
    pub timezone: Option<crate::units::calendar::Zone>,
    /// `policy { owner "…" escalation "…" }`: who owns the policy itself,
    /// and what a tier, pool or tenant without an owner falls back to.
    pub owner: Owner,
    /// Time-boxed grants (`exception NAME { … }`), not applied here: see
    /// [`DecisionGraph::on_date`].
    pub exceptions: Vec<Exception>,
    pub(crate) index: Names,
    pub(crate) builtin: Builtin,
    /// [`DecisionGraph::headers_read`], worked out at its first call.
    headers_read: Memo<Vec<String>>,
    /// [`DecisionGraph::reads_estimated_wait`], likewise.
    reads_wait: Memo<bool>,
}

/// A value worked out once from a graph that no longer changes. It takes
/// no part in comparing graphs, and a clone (which may still be changed)
/// starts without it.
#[derive(Debug, Default)]
struct Memo<T>(std::sync::OnceLock<T>);

impl<T> Clone for Memo<T> {
    fn clone(&self) -> Self {
        Memo(std::sync::OnceLock::new())
    }
}

impl<T> PartialEq for Memo<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Names {
    pub pools: HashMap<String, PoolId>,
    pub models: HashMap<String, ModelId>,
    pub tiers: HashMap<String, TierId>,
    pub tenants: HashMap<String, TenantId>,
    pub api_keys: HashMap<String, TenantId>,
}

/// Rejections the graph makes itself, not written in the policy.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Builtin {
    pub unknown_model: Reject,
    pub quota: Reject,
    pub concurrency: Reject,
    pub model_not_allowed: Reject,
    pub pool_fenced: Reject,
}

impl Default for Builtin {
    fn default() -> Self {
        Builtin {
            unknown_model: Reject {
                status: 404,
                message: "the model is not served by this policy".into(),
                retry_after: None,
                reason: "unknown-model",
            },
            quota: Reject {
                status: 429,
                message: "the tenant's quota is exhausted".into(),
                retry_after: Some(60_000.0),
                reason: "quota",
            },
            concurrency: Reject {
                status: 429,
                message: "the tenant has reached its concurrent request limit".into(),
                retry_after: Some(1_000.0),
                reason: "concurrency",
            },
            model_not_allowed: Reject {
                status: 403,
                message: "the tier may not use this model".into(),
                retry_after: None,
                reason: "model-not-allowed",
            },
            pool_fenced: Reject {
                status: 403,
                message: "the tenant may not use the pool this request routes to".into(),
                retry_after: None,
                reason: "pool-fenced",
            },
        }
    }
}

impl DecisionGraph {
    /// What one GPU-hour of `tenant`'s work on `pool` costs: the tenant's
    /// `cost` (an internal rate, which overrides), else the pool's
    /// `price`; `None` when neither is declared (the work is unpriced).
    pub fn gpu_hour_price(&self, tenant: Option<TenantId>, pool: Option<PoolId>) -> Option<f64> {
        tenant
            .and_then(|t| self.tenants.get(t as usize))
            .and_then(|t| t.cost_per_gpu_hour)
            .or_else(|| {
                pool.and_then(|p| self.pools.get(usize::from(p)))
                    .and_then(|p| p.price_per_gpu_hour)
            })
    }

    /// Who owns tier `t`: its own owner, else the policy's (the escalation
    /// contact falls back on its own).
    pub fn tier_owner(&self, t: TierId) -> Owner {
        self.tiers
            .get(usize::from(t))
            .map_or_else(|| self.owner.clone(), |t| t.owner.or(&self.owner))
    }

    /// Who owns pool `p`: its own owner, else the policy's.
    pub fn pool_owner(&self, p: PoolId) -> Owner {
        self.pools
            .get(usize::from(p))
            .map_or_else(|| self.owner.clone(), |p| p.owner.or(&self.owner))
    }

    /// Who owns tenant `t`: its own owner, else its cohort's, else the
    /// policy's.
    pub fn tenant_owner(&self, t: TenantId) -> Owner {
        let Some(t) = self.tenants.get(t as usize) else {
            return self.owner.clone();
        };
        let own = Owner {
            owner: t.owner.clone(),
            escalation: t.escalation.clone(),
        };
        let cohort = t
            .cohort
            .and_then(|c| self.cohorts.get(usize::from(c)))
            .map(|c| Owner {
                owner: c.owner.clone(),
                escalation: c.escalation.clone(),
            })
            .unwrap_or_default();
        own.or(&cohort.or(&self.owner))
    }

    /// The request headers the policy's classify, route and admit rules
    /// read (`header("…")`), lowercased, sorted, each once: what a request
    /// record needs to be decided again the same way. Every request's
    /// record reads it, so it is worked out once (a walk of every rule).
    pub fn headers_read(&self) -> &[String] {
        self.headers_read.0.get_or_init(|| self.find_headers_read())
    }

    /// Whether a classify, route or admit rule reads `estimated_wait`.
    /// Working the signal out costs the scheduler a decision and a wait
    /// estimate per arrival, which a policy that never reads it is spared;
    /// worked out once per graph.
    pub fn reads_estimated_wait(&self) -> bool {
        *self.reads_wait.0.get_or_init(|| {
            self.rule_conditions()
                .any(|c| c.any_test(&|t: &Test| t.sig == Sig::EstimatedWait))
        })
    }

    /// The conditions of every classify, route and admit rule.
    fn rule_conditions(&self) -> impl Iterator<Item = &Cond> {
        fn of<O>(rules: &[(RuleId, Cond, O)]) -> impl Iterator<Item = &Cond> {
            rules.iter().map(|(_, c, _)| c)
        }
        of(&self.classify.rules)
            .chain(self.routes.iter().flatten().flat_map(|rs| of(&rs.rules)))
            .chain(self.admits.iter().flatten().flat_map(|rs| of(&rs.rules)))
    }

    fn find_headers_read(&self) -> Vec<String> {
        let mut names = Vec::new();
        for c in self.rule_conditions() {
            c.headers_read(&mut names);
        }
        let mut out: Vec<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        out.sort();
        out.dedup();
        out
    }

    pub(crate) fn empty() -> Self {
        DecisionGraph {
            pools: Vec::new(),
            models: Vec::new(),
            tiers: Vec::new(),
            tenants: Vec::new(),
            cohorts: Vec::new(),
            classify: RuleSet {
                rules: Vec::new(),
                default: (
                    0,
                    ClassifyOutcome {
                        tier: 0,
                        tenant: None,
                    },
                ),
                by_tenant: None,
            },
            routes: Vec::new(),
            admits: Vec::new(),
            fallbacks: Vec::new(),
            rollout: None,
            approvals: Vec::new(),
            rules: Vec::new(),
            degrade_names: Vec::new(),
            degrade_models: Vec::new(),
            substitutions: Vec::new(),
            timezone: None,
            owner: Owner::default(),
            exceptions: Vec::new(),
            index: Names::default(),
            builtin: Builtin::default(),
            headers_read: Memo::default(),
            reads_wait: Memo::default(),
        }
    }

    /// The graph with every source span cleared. Two policies that differ
    /// only in layout or comments normalize to equal graphs.
    pub fn normalized(&self) -> DecisionGraph {
        let mut g = self.clone();
        let z = Span::default();
        g.pools.iter_mut().for_each(|p| p.span = z);
        g.tiers.iter_mut().for_each(|t| t.span = z);
        g.tenants.iter_mut().for_each(|t| t.span = z);
        g.cohorts.iter_mut().for_each(|c| c.span = z);
        g.rules.iter_mut().for_each(|r| r.span = z);
        g.substitutions.iter_mut().for_each(|s| s.span = z);
        g.exceptions.iter_mut().for_each(|e| {
            e.span = z;
            e.reserve.iter_mut().for_each(|r| r.span = z);
        });
        for m in &mut g.models {
            m.span = z;
            m.variants.iter_mut().for_each(|v| v.span = z);
        }
        g
    }

    pub fn pool_id(&self, name: &str) -> Option<PoolId> {
        self.index.pools.get(name).copied()
    }
    pub fn model_id(&self, name: &str) -> Option<ModelId> {
        self.index.models.get(name).copied()
    }
    pub fn tier_id(&self, name: &str) -> Option<TierId> {
        self.index.tiers.get(name).copied()
    }
    pub fn tenant_id(&self, name: &str) -> Option<TenantId> {
        self.index.tenants.get(name).copied()
    }
    pub fn tenant_for_key(&self, key: &str) -> Option<TenantId> {
        self.index.api_keys.get(key).copied()
    }

    pub fn route_set(&self, tier: TierId, model: ModelId) -> Option<&RuleSet<RouteOutcome>> {
        let i = tier as usize * self.models.len() + model as usize;
        self.routes.get(i).and_then(|r| r.as_ref())
    }

    /// `model.variant` for display.
    pub fn variant_name(&self, model: ModelId, variant: u16) -> String {
        match self.models.get(model as usize) {
            Some(m) => match m.variants.get(variant as usize) {
                Some(v) => format!("{}.{}", m.name, v.name),
                None => m.name.clone(),
            },
            None => "?".into(),
        }
    }

    /// The declaration by which `by` may serve requests for `model` in
    /// `tier`, if the policy makes one (never for `model == by`).
    pub fn substitution(&self, model: ModelId, by: ModelId, tier: TierId) -> Option<&Substitution> {
        self.substitutions
            .iter()
            .find(|s| s.model == model && s.by == by && s.tiers.contains(&tier))
    }

    pub fn tier_allows_model(&self, tier: TierId, model: ModelId) -> bool {
        match self
            .tiers
            .get(tier as usize)
            .and_then(|t| t.models.as_ref())
        {
            Some(ms) => ms.contains(&model),
            None => true,
        }
    }
}
