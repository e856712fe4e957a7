//! Prometheus metrics for the gateway, on a registry of their own, served as
//! text exposition format 0.0.4 (`GET /metrics`).
//!
//! Per-request events ([`Metrics::request_done`], [`Metrics::ttft`], …) are
//! counters and histograms labelled by tier, tenant, pool and model; an
//! absent label is `"none"`. The queue and replica gauges are refilled from
//! a periodic snapshot of the scheduler: [`Metrics::reset_gauges`], then
//! [`Metrics::set_queue`] and [`Metrics::set_replica`] for what exists now,
//! so tiers, tenants and replicas that vanished stop being exported.
//!
//! Recording is panic-free: a label set of the wrong arity (a bug) is
//! skipped, negative or non-finite amounts are ignored.

use prometheus::core::{Collector, MetricVec, MetricVecBuilder};
use prometheus::{CounterVec, GaugeVec, HistogramOpts, HistogramVec, Opts, Registry, TextEncoder};

/// Queue wait and time to first token: 1 ms to 60 s.
const FAST_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// End-to-end latency: 10 ms to 10 min (long generations and batch work).
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Labels of a request that was dispatched (or meant to be) to a replica.
/// Use `"none"` for an absent tenant, pool or model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Labels<'a> {
    pub tier: &'a str,
    pub tenant: &'a str,
    pub pool: &'a str,
    pub model: &'a str,
}

impl Labels<'_> {
    /// tier, tenant, pool, model, variant: `model` may be `model.variant`
    /// (a route), split here into its own label.
    fn values(&self) -> [&str; 5] {
        let (model, variant) = model_variant(self.model);
        [self.tier, self.tenant, self.pool, model, variant]
    }
}

/// `model.variant` as the `model` and `variant` labels (`none` for a
/// variant a name does not carry).
pub fn model_variant(name: &str) -> (&str, &str) {
    name.split_once('.').unwrap_or((name, "none"))
}

/// How a request ended, the `outcome` label of `kiln_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Completed (the response was sent in full).
    Ok,
    /// Refused by admission or the policy.
    Rejected,
    /// The client went away before the end.
    Cancelled,
    /// The backend failed.
    UpstreamError,
    /// It ran out of time (queue wait or deadline).
    Timeout,
    /// Preempted after its answer began (a stream; its tier requeues
    /// preempted work, which cannot continue a stream already begun).
    Preempted,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Rejected => "rejected",
            Outcome::Cancelled => "cancelled",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Timeout => "timeout",
            Outcome::Preempted => "preempted",
        }
    }
}

/// The gateway's metrics: a registry and its collectors. Share it behind
/// an `Arc`; every method takes `&self`.
pub struct Metrics {
    registry: Registry,
    /// `None` only if a definition were invalid (a bug the tests catch):
    /// then nothing is recorded and `render` is empty.
    c: Option<Collectors>,
    /// What [`Metrics::prime`] last exported at zero, and for which policy
    /// version: the queue and replica gauges are re-zeroed from it after
    /// each [`Metrics::reset_gauges`].
    primed: std::sync::Mutex<Option<(String, Catalog)>>,
}

/// The label values a policy and its replicas can produce. Every series
/// of it is exported at zero from the first scrape (and again after a
/// swap), so dashboards and alerts read a flat 0, not "no data", before
/// anything happened. Old series stay: a counter that vanished would break
/// `rate()` over the swap.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Catalog {
    pub tiers: Vec<CatalogTier>,
    /// (pool, `model.variant`) of each replica group.
    pub replicas: Vec<(String, String)>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct CatalogTier {
    pub name: String,
    /// Tenants granted the tier, and `none` (a request no tenant claimed).
    pub tenants: Vec<String>,
    /// (pool, `model.variant`) its requests may be served on.
    pub routes: Vec<(String, String)>,
    /// Steps of its fallback chain (`kiln_fallbacks_total{step}` 1..=n).
    pub fallback_steps: u8,
    /// Whether it declares a TTFT SLO (it can then refuse with `overload`).
    pub ttft_slo: bool,
    /// Whether it has an exact response cache (`kiln_cache_*{kind="exact"}`).
    pub exact_cache: bool,
    /// Whether it has a semantic cache (`kiln_cache_*{kind="semantic"}`).
    pub semantic_cache: bool,
}

impl Catalog {
    /// What `g` can label, served by `replicas` (pool, model, variant).
    pub fn of<'a>(
        g: &crate::graph::DecisionGraph,
        replicas: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>,
    ) -> Catalog {
        use std::collections::BTreeSet;
        let replicas: BTreeSet<(&str, &str, &str)> = replicas.into_iter().collect();
        let models = g.models.len();
        let tiers = g
            .tiers
            .iter()
            .enumerate()
            .map(|(ti, tier)| {
                let id = ti as crate::graph::TierId;
                let mut tenants: Vec<String> = g
                    .tenants
                    .iter()
                    .filter(|t| t.tiers.contains(&id))
                    .map(|t| t.name.clone())
                    .collect();
                tenants.push("none".into());
                let routes: BTreeSet<(String, String)> = replicas
                    .iter()
                    .filter(|(pool, model, _)| {
                        let routed =
                            g.models
                                .iter()
                                .position(|m| m.name == *model)
                                .is_some_and(|mi| {
                                    matches!(g.routes.get(ti * models + mi), Some(Some(_)))
                                });
                        let admitted = g
                            .pools
                            .iter()
                            .find(|p| p.name == *pool)
                            .is_some_and(|p| p.admits(id, None));
                        routed && admitted
                    })
                    .map(|(pool, model, variant)| (pool.to_string(), format!("{model}.{variant}")))
                    .collect();
                CatalogTier {
                    name: tier.name.clone(),
                    tenants,
                    routes: routes.into_iter().collect(),
                    fallback_steps: g
                        .fallbacks
                        .get(ti)
                        .and_then(|f| f.as_ref())
                        .map_or(0, |f| f.steps.len().min(usize::from(u8::MAX)) as u8),
                    ttft_slo: tier.slo.ttft.is_some(),
                    exact_cache: tier.cache.exact.is_some(),
                    semantic_cache: tier.cache.semantic.is_some(),
                }
            })
            .collect();
        let replicas = replicas
            .iter()
            .map(|(pool, model, variant)| (pool.to_string(), format!("{model}.{variant}")))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        Catalog { tiers, replicas }
    }
}

/// At most this many series are created by priming: a policy with
/// thousands of tenants must not turn `/metrics` into megabytes of zeros.
/// Past it, the per-route series (histograms, tokens, cost) are left to
/// appear when first used; the per-tier ones are still primed.
const PRIME_BUDGET: usize = 100_000;

/// Series one (tier, tenant, pool, model) route adds when primed: the
/// outcomes, three histograms (buckets, sum, count), tokens by kind,
/// GPU-seconds and cost.
const SERIES_PER_ROUTE: usize = 6 + 3 * 18 + 2 + 2;

/// The refusals a tier's requests can meet, with the status the gateway
/// gives each (README, "Errors"): quota and concurrency need a tenant,
/// overload a TTFT SLO.
const PRIMED_REJECTS: &[(&str, &str)] = &[
    ("quota", "429"),
    ("concurrency", "429"),
    ("overload", "429"),
    ("timeout", "503"),
    ("saturation", "503"),
];

const OUTCOMES: [Outcome; 6] = [
    Outcome::Ok,
    Outcome::Rejected,
    Outcome::Cancelled,
    Outcome::UpstreamError,
    Outcome::Timeout,
    Outcome::Preempted,
];

struct Collectors {
    requests: CounterVec,
    rejects: CounterVec,
    queue_wait: HistogramVec,
    ttft: HistogramVec,
    e2e: HistogramVec,
    tokens: CounterVec,
    gpu_seconds: CounterVec,
    gpu_wasted: CounterVec,
    cost: CounterVec,
    preemptions: CounterVec,
    fallbacks: CounterVec,
    retries: CounterVec,
    deadline_misses: CounterVec,
    policy_swaps: CounterVec,
    keys_reloads: CounterVec,
    policy_info: GaugeVec,
    queue_depth: GaugeVec,
    queue_oldest: GaugeVec,
    replicas: GaugeVec,
    slots_used: GaugeVec,
    slots: GaugeVec,
    kv_used: GaugeVec,
    kv_capacity: GaugeVec,
    kv_usage: GaugeVec,
    busy: GaugeVec,
    shadow: CounterVec,
    shadow_diffs: CounterVec,
    canary: CounterVec,
    stages: CounterVec,
    rollbacks: CounterVec,
    override_refusals: CounterVec,
    approvals: CounterVec,
    batch_items: GaugeVec,
    batch_predicted_miss: GaugeVec,
    batch_deadline_misses: CounterVec,
    shared_up: GaugeVec,
    shared_errors: CounterVec,
    shared_unclaimed: CounterVec,
    upstream_breaker: GaugeVec,
    budget_limit: GaugeVec,
    budget_spent: GaugeVec,
    cache_hits: CounterVec,
    cache_misses: CounterVec,
    cache_entries: GaugeVec,
    cache_skipped: CounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

const RTPM: &[&str] = &["tier", "tenant", "pool", "model", "variant"];
const TT: &[&str] = &["tier", "tenant"];
const PM: &[&str] = &["pool", "model", "variant"];

/// The `reason` label of `kiln_retries_total`, each exported at 0.
pub const RETRY_REASONS: [&str; 4] = ["client", "batch_item", "upstream_failed", "upstream_unsent"];

/// The reasons of `kiln_gpu_seconds_wasted_total`.
pub const WASTE_REASONS: [&str; 4] = ["recompute", "abandoned", "failed", "preempted"];

/// Why the GPU time of a request that ran served no answer, by how it
/// ended; `None` for a served one (only its recompute was wasted).
pub fn waste_reason(o: Outcome) -> Option<&'static str> {
    match o {
        Outcome::Ok => None,
        Outcome::Cancelled => Some("abandoned"),
        Outcome::UpstreamError | Outcome::Timeout => Some("failed"),
        Outcome::Rejected | Outcome::Preempted => Some("preempted"),
    }
}

impl Collectors {
    /// The gauges of one (pool, model) replica group.
    fn replica_gauges(&self) -> [&GaugeVec; 7] {
        [
            &self.replicas,
            &self.slots_used,
            &self.slots,
            &self.kv_used,
            &self.kv_capacity,
            &self.kv_usage,
            &self.busy,
        ]
    }

    fn new(r: &Registry) -> prometheus::Result<Collectors> {
        let policy_swaps = counter(
            r,
            "kiln_policy_swaps_total",
            "Policy reloads attempted, by result (ok or error).",
            &["result"],
        )?;
        let keys_reloads = counter(
            r,
            "kiln_keys_reloads_total",
            "Reloads of the keys and admin tokens (SIGHUP, the file changing, POST /admin/keys/reload), by result (ok, or error: the keys in use stay).",
            &["result"],
        )?;
        // Both results are exported from the start, at 0.
        for result in ["ok", "error"] {
            policy_swaps.get_metric_with_label_values(&[result])?;
            keys_reloads.get_metric_with_label_values(&[result])?;
        }
        Ok(Collectors {
            requests: counter(
                r,
                "kiln_requests_total",
                "Requests finished, by how they ended (ok, rejected, cancelled, upstream_error, timeout, preempted: a stream ended because its upstream work was preempted).",
                &["tier", "tenant", "pool", "model", "variant", "outcome"],
            )?,
            rejects: counter(
                r,
                "kiln_rejects_total",
                "Requests refused, by reason and the HTTP status returned.",
                &["tier", "tenant", "reason", "status"],
            )?,
            queue_wait: histogram(
                r,
                "kiln_queue_wait_seconds",
                "Time a request waited in the gateway's queue before it started on a replica.",
                FAST_BUCKETS,
            )?,
            ttft: histogram(
                r,
                "kiln_ttft_seconds",
                "Time from arrival at the gateway to the first output token.",
                FAST_BUCKETS,
            )?,
            e2e: histogram(
                r,
                "kiln_e2e_seconds",
                "Time from arrival at the gateway to the last output token.",
                E2E_BUCKETS,
            )?,
            tokens: counter(
                r,
                "kiln_tokens_total",
                "Tokens processed, by kind: prompt (input) or completion (output).",
                &["tier", "tenant", "pool", "model", "variant", "kind"],
            )?,
            gpu_seconds: counter(
                r,
                "kiln_gpu_seconds_total",
                "GPU time used by finished requests (their share of each batch step, times the replica's GPUs).",
                RTPM,
            )?,
            gpu_wasted: counter(
                r,
                "kiln_gpu_seconds_wasted_total",
                "The part of kiln_gpu_seconds_total that served no answer, by reason: recompute (a served request recomputing the KV cache it lost to a preemption, and an upstream's preempted attempts), abandoned (its client left during the answer), failed (the upstream failed or timed out after it started), preempted (preempted and refused, `on_preempt reject`). Useful GPU time is the total less this.",
                &["tier", "tenant", "pool", "reason"],
            )?,
            cost: counter(
                r,
                "kiln_cost_usd_total",
                "Cost of the GPU time used by finished requests, in US dollars, at the tenant's `cost` per GPU-hour (nothing for a tenant without one).",
                RTPM,
            )?,
            preemptions: counter(
                r,
                "kiln_preemptions_total",
                "Running requests preempted, each time: for a tier that preempts theirs, or for KV-cache blocks a longer sequence needed.",
                TT,
            )?,
            fallbacks: counter(
                r,
                "kiln_fallbacks_total",
                "Requests routed to a fallback, by the index of the fallback step taken.",
                &["tier", "tenant", "step"],
            )?,
            retries: counter(
                r,
                "kiln_retries_total",
                "Retries, each counted once, by reason: client (a request its client marked as a retry: x-kiln-retry, or the OpenAI SDKs' non-zero x-stainless-retry-count), batch_item (the batch runner sent an item again after a refusal or a failure), upstream_failed and upstream_unsent (the gateway queued a request again after an upstream failed it, or never received it).",
                &["tier", "tenant", "reason"],
            )?,
            deadline_misses: counter(
                r,
                "kiln_deadline_misses_total",
                "Requests that finished after their tier's completion window (`slo { window }`).",
                TT,
            )?,
            policy_swaps,
            keys_reloads,
            policy_info: gauge(
                r,
                "kiln_policy_info",
                "The policy version in force (always 1; the version is the label).",
                &["version"],
            )?,
            queue_depth: gauge(
                r,
                "kiln_queue_depth",
                "Requests waiting in the scheduler's queues now (not those delayed or held for a batch).",
                TT,
            )?,
            queue_oldest: gauge(
                r,
                "kiln_queue_oldest_wait_seconds",
                "How long the oldest request waiting in the queue has waited.",
                TT,
            )?,
            replicas: gauge(
                r,
                "kiln_replicas",
                "Replicas serving the model in the pool.",
                PM,
            )?,
            slots_used: gauge(
                r,
                "kiln_replica_slots_used",
                "Batch slots (sequences) running, summed over the replicas.",
                PM,
            )?,
            slots: gauge(
                r,
                "kiln_replica_slots",
                "Batch slots (maximum concurrent sequences), summed over the replicas.",
                PM,
            )?,
            kv_used: gauge(
                r,
                "kiln_kv_cache_used_tokens",
                "KV cache reserved by running sequences, in tokens, summed over the replicas.",
                PM,
            )?,
            kv_capacity: gauge(
                r,
                "kiln_kv_cache_capacity_tokens",
                "KV cache capacity in tokens, summed over the replicas.",
                PM,
            )?,
            kv_usage: gauge(
                r,
                "kiln_kv_cache_usage_ratio",
                "KV cache used over capacity (0 to 1), over the replicas.",
                PM,
            )?,
            busy: gauge(
                r,
                "kiln_replica_busy_ratio",
                "Fraction of time the replicas spent running batch steps (0 to 1), averaged over the replicas.",
                PM,
            )?,
            shadow: counter(
                r,
                "kiln_shadow_decisions_total",
                "Requests a shadowed policy version also decided, by whether its decision was the same or differed.",
                &["version", "result"],
            )?,
            shadow_diffs: counter(
                r,
                "kiln_shadow_differences_total",
                "Decision fields (tier, tenant, route, admission) a shadowed version decided differently.",
                &["version", "field"],
            )?,
            canary: counter(
                r,
                "kiln_canary_requests_total",
                "Requests decided by a canary policy version.",
                &["version"],
            )?,
            stages: counter(
                r,
                "kiln_rollout_stages_total",
                "Canary stages a rollout began, by version and stage name.",
                &["version", "stage"],
            )?,
            rollbacks: counter(
                r,
                "kiln_rollbacks_total",
                "Rollouts rolled back, by trigger (automatic: a rollback condition tripped; manual).",
                &["trigger"],
            )?,
            override_refusals: counter(
                r,
                "kiln_override_refusals_total",
                "Requests refused by an operator's override (pause or throttle of a tier or tenant).",
                &["action", "scope", "name"],
            )?,
            approvals: counter(
                r,
                "kiln_approvals_total",
                "Signed approvals presented, by result (accepted or the refusal's code).",
                &["result"],
            )?,
            batch_items: gauge(
                r,
                "kiln_batch_items",
                "Items of unfinished batches by state (pending: not yet handed to the scheduler; in_flight; completed; failed), per tenant and tier.",
                &["tenant", "tier", "state"],
            )?,
            batch_predicted_miss: gauge(
                r,
                "kiln_batch_predicted_miss",
                "1 when the scheduler's estimate says an unfinished batch will finish after its completion window.",
                &["batch", "tenant", "tier"],
            )?,
            batch_deadline_misses: counter(
                r,
                "kiln_batch_deadline_misses_total",
                "Batch items that finished after their batch's completion window, or expired unrun.",
                &["tenant", "tier"],
            )?,
            shared_up: gauge(
                r,
                "kiln_shared_state_up",
                "1 while this replica reaches the shared state store (Redis, `[state]`), 0 while it does not (then `on_unavailable` applies).",
                &[],
            )?,
            shared_errors: counter(
                r,
                "kiln_shared_state_errors_total",
                "Calls to the shared state store that failed or timed out.",
                &[],
            )?,
            shared_unclaimed: counter(
                r,
                "kiln_shared_state_unclaimed_total",
                "Requests decided without the shared store while it was unreachable: served on local limits (`local`) or refused (`refused`).",
                &["action"],
            )?,
            upstream_breaker: gauge(
                r,
                "kiln_upstream_breaker_open",
                "1 while an HTTP upstream's circuit breaker refuses requests (open, or half-open with its trial in flight), 0 while it lets them through.",
                &["pool", "upstream"],
            )?,
            budget_limit: gauge(
                r,
                "kiln_budget_limit",
                "A tenant's or tier's money `budget` for one period (`day` or `month` of the policy's calendar), in the currency of `price` and `cost`: this replica's share of it (1/N of N replicas).",
                &["scope", "name", "period"],
            )?,
            budget_spent: gauge(
                r,
                "kiln_budget_spent",
                "What the tenant's or tier's GPU time has cost so far this period on this replica (its GPU-seconds at the pool's `price`, or the tenant's `cost`), against `kiln_budget_limit`; 0 when a new period begins.",
                &["scope", "name", "period"],
            )?,
            cache_hits: counter(
                r,
                "kiln_cache_hits_total",
                "Requests answered from their tier's response cache (`kind` exact or semantic): no queue, no replica, no GPU time.",
                &["tier", "tenant", "kind"],
            )?,
            cache_misses: counter(
                r,
                "kiln_cache_misses_total",
                "Cacheable requests (temperature 0 or a seed, one choice) their tier's response cache did not hold.",
                &["tier", "tenant", "kind"],
            )?,
            cache_entries: gauge(
                r,
                "kiln_cache_entries",
                "Answers held by each tier's response cache.",
                &["tier", "kind"],
            )?,
            cache_skipped: counter(
                r,
                "kiln_cache_skipped_total",
                "Cacheable requests of a tier with a semantic cache whose semantic lookup was skipped (`reason`: busy, every embedding slot taken for the whole budget; budget, the embedding overran it; error, the model failed; exact, an exact cache held the content for another tier or tenant): served fresh, `x-kiln-cache: skipped`.",
                &["reason"],
            )?,
        })
    }
}

/// One replica's load, as `/admin/queues` shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaLoad {
    /// Sequences running, and the batch slots there are.
    pub running: usize,
    pub slots: usize,
    /// KV cache tokens in use, and its capacity.
    pub kv_used: u64,
    pub kv_capacity: u64,
    /// Share of time spent running steps.
    pub busy_fraction: f64,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let c = match Collectors::new(&registry) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(error = %e, "invalid metric definition; metrics are disabled");
                None
            }
        };
        Metrics {
            registry,
            c,
            primed: std::sync::Mutex::new(None),
        }
    }

    /// Exports every series of `cat` at zero, once per policy `version`
    /// (a repeat for the same version only re-zeroes the gauges that
    /// [`Metrics::reset_gauges`] dropped). Returns how many series it
    /// touched.
    pub fn prime(&self, version: &str, cat: &Catalog) -> usize {
        let Some(c) = &self.c else { return 0 };
        let Ok(mut primed) = self.primed.lock() else {
            return 0;
        };
        if primed
            .as_ref()
            .is_some_and(|(v, old)| v == version && old == cat)
        {
            drop(primed);
            self.zero_gauges(cat);
            return 0;
        }
        let routes: usize = cat
            .tiers
            .iter()
            .map(|t| t.tenants.len().saturating_mul(t.routes.len()))
            .fold(0usize, usize::saturating_add);
        let with_routes = routes.saturating_mul(SERIES_PER_ROUTE) <= PRIME_BUDGET;
        if !with_routes {
            tracing::warn!(
                routes,
                "too many tier, tenant and route combinations to export each at zero; per-route series appear when first used"
            );
        }
        let mut b = Budget {
            left: PRIME_BUDGET,
            made: 0,
        };
        for t in &cat.tiers {
            for tenant in &t.tenants {
                let (tier, tenant) = (t.name.as_str(), tenant.as_str());
                b.touch(&c.preemptions, &[tier, tenant]);
                b.touch(&c.deadline_misses, &[tier, tenant]);
                for reason in RETRY_REASONS {
                    b.touch(&c.retries, &[tier, tenant, reason]);
                }
                b.touch(&c.batch_deadline_misses, &[tenant, tier]);
                if t.exact_cache {
                    b.touch(&c.cache_hits, &[tier, tenant, "exact"]);
                    b.touch(&c.cache_misses, &[tier, tenant, "exact"]);
                }
                if t.semantic_cache {
                    b.touch(&c.cache_hits, &[tier, tenant, "semantic"]);
                    b.touch(&c.cache_misses, &[tier, tenant, "semantic"]);
                }
                for step in 1..=t.fallback_steps {
                    let mut buf = [0u8; 5];
                    let step = decimal(u16::from(step), &mut buf);
                    b.touch(&c.fallbacks, &[tier, tenant, step]);
                }
                for &(reason, status) in PRIMED_REJECTS {
                    let needs_tenant = matches!(reason, "quota" | "concurrency");
                    if (needs_tenant && tenant == "none") || (reason == "overload" && !t.ttft_slo) {
                        continue;
                    }
                    b.touch(&c.rejects, &[tier, tenant, reason, status]);
                }
                if !with_routes {
                    continue;
                }
                for (pool, model) in &t.routes {
                    let (m, variant) = model_variant(model);
                    let v = [tier, tenant, pool.as_str(), m, variant];
                    for o in OUTCOMES {
                        b.touch(
                            &c.requests,
                            &[tier, tenant, pool.as_str(), m, variant, o.as_str()],
                        );
                    }
                    for kind in ["prompt", "completion"] {
                        b.touch(&c.tokens, &[tier, tenant, pool.as_str(), m, variant, kind]);
                    }
                    b.touch(&c.gpu_seconds, &v);
                    b.touch(&c.cost, &v);
                    for reason in WASTE_REASONS {
                        b.touch(&c.gpu_wasted, &[tier, tenant, pool.as_str(), reason]);
                    }
                    for h in [&c.queue_wait, &c.ttft, &c.e2e] {
                        b.touch(h, &v);
                    }
                }
            }
        }
        for result in ["ok", "error"] {
            b.touch(&c.policy_swaps, &[result]);
            b.touch(&c.keys_reloads, &[result]);
        }
        for action in ["local", "refused"] {
            b.touch(&c.shared_unclaimed, &[action]);
        }
        if cat.tiers.iter().any(|t| t.semantic_cache) {
            for reason in super::cache::Skip::ALL {
                b.touch(&c.cache_skipped, &[reason.as_str()]);
            }
        }
        *primed = Some((version.to_string(), cat.clone()));
        drop(primed);
        self.zero_gauges(cat);
        b.made
    }

    /// Sets the queue and replica gauges of `cat` that have no series to 0.
    fn zero_gauges(&self, cat: &Catalog) {
        let Some(c) = &self.c else { return };
        for t in cat.tiers.iter().filter(|t| t.semantic_cache) {
            let _ = get(&c.cache_entries, &[t.name.as_str(), "semantic"]);
        }
        for t in cat.tiers.iter().filter(|t| t.exact_cache) {
            let _ = get(&c.cache_entries, &[t.name.as_str(), "exact"]);
        }
        for t in &cat.tiers {
            for tenant in &t.tenants {
                let v = [t.name.as_str(), tenant.as_str()];
                let _ = get(&c.queue_depth, &v);
                let _ = get(&c.queue_oldest, &v);
            }
        }
        for (pool, model) in &cat.replicas {
            let (m, variant) = model_variant(model);
            let v = [pool.as_str(), m, variant];
            for g in c.replica_gauges() {
                let _ = get(g, &v);
            }
        }
    }

    /// Every metric with at least one series, in Prometheus text exposition
    /// format 0.0.4.
    pub fn render(&self) -> String {
        let families = self.registry.gather();
        let mut out = String::with_capacity(16 * 1024);
        if let Err(e) = TextEncoder::new().encode_utf8(&families, &mut out) {
            tracing::warn!(error = %e, "could not encode metrics");
        }
        out
    }

    /// The `Content-Type` of [`Metrics::render`]'s output.
    pub fn content_type() -> &'static str {
        "text/plain; version=0.0.4; charset=utf-8"
    }

    /// A request ended.
    pub fn request_done(&self, l: &Labels, outcome: Outcome) {
        let Some(c) = &self.c else { return };
        let [tier, tenant, pool, model, variant] = l.values();
        add(
            &c.requests,
            &[tier, tenant, pool, model, variant, outcome.as_str()],
            1.0,
        );
    }

    /// A request was refused with HTTP `status` for `reason` (a scheduler
    /// reason such as `quota` or `overload`).
    pub fn rejected(&self, tier: &str, tenant: &str, reason: &str, status: u16) {
        let Some(c) = &self.c else { return };
        let mut buf = [0u8; 5];
        let status = decimal(status, &mut buf);
        add(&c.rejects, &[tier, tenant, reason, status], 1.0);
    }

    pub fn queue_wait(&self, l: &Labels, seconds: f64) {
        if let Some(c) = &self.c {
            observe(&c.queue_wait, l, seconds);
        }
    }

    pub fn ttft(&self, l: &Labels, seconds: f64) {
        if let Some(c) = &self.c {
            observe(&c.ttft, l, seconds);
        }
    }

    pub fn e2e(&self, l: &Labels, seconds: f64) {
        if let Some(c) = &self.c {
            observe(&c.e2e, l, seconds);
        }
    }

    pub fn tokens(&self, l: &Labels, prompt: u64, completion: u64) {
        let Some(c) = &self.c else { return };
        let [tier, tenant, pool, model, variant] = l.values();
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            add(
                &c.tokens,
                &[tier, tenant, pool, model, variant, kind],
                n as f64,
            );
        }
    }

    pub fn gpu_seconds(&self, l: &Labels, seconds: f64, cost_usd: f64) {
        let Some(c) = &self.c else { return };
        let v = l.values();
        add(&c.gpu_seconds, &v, seconds);
        add(&c.cost, &v, cost_usd);
    }

    /// GPU time that served no answer (one of [`WASTE_REASONS`]); a
    /// part of what [`Self::gpu_seconds`] counted.
    pub fn gpu_wasted(&self, l: &Labels, reason: &str, seconds: f64) {
        let Some(c) = &self.c else { return };
        if seconds > 0.0 {
            add(&c.gpu_wasted, &[l.tier, l.tenant, l.pool, reason], seconds);
        }
    }

    pub fn preempted(&self, tier: &str, tenant: &str) {
        if let Some(c) = &self.c {
            add(&c.preemptions, &[tier, tenant], 1.0);
        }
    }

    pub fn fallback(&self, tier: &str, tenant: &str, step: u8) {
        let Some(c) = &self.c else { return };
        let mut buf = [0u8; 5];
        let step = decimal(u16::from(step), &mut buf);
        add(&c.fallbacks, &[tier, tenant, step], 1.0);
    }

    /// A retry (one of [`RETRY_REASONS`]), counted once.
    pub fn retry(&self, tier: &str, tenant: &str, reason: &str) {
        if let Some(c) = &self.c {
            add(&c.retries, &[tier, tenant, reason], 1.0);
        }
    }

    pub fn deadline_miss(&self, tier: &str, tenant: &str) {
        if let Some(c) = &self.c {
            add(&c.deadline_misses, &[tier, tenant], 1.0);
        }
    }

    /// A policy reload was attempted.
    pub fn policy_swap(&self, ok: bool) {
        if let Some(c) = &self.c {
            add(&c.policy_swaps, &[if ok { "ok" } else { "error" }], 1.0);
        }
    }

    /// A reload of the keys was attempted.
    pub fn keys_reload(&self, ok: bool) {
        if let Some(c) = &self.c {
            add(&c.keys_reloads, &[if ok { "ok" } else { "error" }], 1.0);
        }
    }

    /// `kiln_policy_info{version="…"} 1`, replacing the previous version's
    /// series.
    /// The shared store's health, from the heartbeat: up or not, and the
    /// store's count of failed calls so far.
    pub fn shared_state(&self, up: bool, failures: u64) {
        let Some(c) = &self.c else { return };
        if let Some(g) = get(&c.shared_up, &[]) {
            g.set(if up { 1.0 } else { 0.0 });
        }
        if let Some(e) = get(&c.shared_errors, &[]) {
            let seen = e.get() as u64;
            if failures > seen {
                e.inc_by((failures - seen) as f64);
            }
        }
    }

    /// A cacheable request of `tier` was answered from its `kind`
    /// (`exact` or `semantic`) cache (`hit`) or served fresh.
    pub fn cache_lookup(&self, tier: &str, tenant: &str, kind: &str, hit: bool) {
        let Some(c) = &self.c else { return };
        let vec = if hit { &c.cache_hits } else { &c.cache_misses };
        if let Some(e) = get(vec, &[tier, tenant, kind]) {
            e.inc();
        }
    }

    /// A semantic lookup was skipped, for `reason`.
    pub fn cache_skipped(&self, reason: &str) {
        let Some(c) = &self.c else { return };
        if let Some(e) = get(&c.cache_skipped, &[reason]) {
            e.inc();
        }
    }

    /// How many answers the tier's `kind` cache holds.
    pub fn cache_entries(&self, tier: &str, kind: &str, entries: usize) {
        let Some(c) = &self.c else { return };
        if let Some(g) = get(&c.cache_entries, &[tier, kind]) {
            g.set(entries as f64);
        }
    }

    /// A request decided without the shared store (`local` or `refused`).
    pub fn shared_unclaimed(&self, action: &str) {
        let Some(c) = &self.c else { return };
        if let Some(e) = get(&c.shared_unclaimed, &[action]) {
            e.inc();
        }
    }

    pub fn set_policy_version(&self, version: &str) {
        let Some(c) = &self.c else { return };
        c.policy_info.reset();
        if let Some(g) = get(&c.policy_info, &[version]) {
            g.set(1.0);
        }
    }

    /// Adds a queue of the snapshot: depths add up and the oldest wait is
    /// the largest, should the same tier and tenant come more than once.
    pub fn set_queue(&self, tier: &str, tenant: &str, depth: usize, oldest_wait_s: f64) {
        let Some(c) = &self.c else { return };
        let v = [tier, tenant];
        if let Some(g) = get(&c.queue_depth, &v) {
            g.add(depth as f64);
        }
        if let Some(g) = get(&c.queue_oldest, &v) {
            if oldest_wait_s.is_finite() && oldest_wait_s > g.get() {
                g.set(oldest_wait_s);
            }
        }
    }

    /// Adds one replica of the snapshot to its (pool, model) aggregate:
    /// replicas, slots and KV cache add up, the KV usage ratio is
    /// recomputed and the busy fraction averaged. Call it once per replica
    /// (or once per pair with totals) after [`Metrics::reset_gauges`].
    pub fn set_replica(&self, pool: &str, model: &str, load: ReplicaLoad) {
        let ReplicaLoad {
            running,
            slots,
            kv_used,
            kv_capacity,
            busy_fraction,
        } = load;
        let Some(c) = &self.c else { return };
        let (model, variant) = model_variant(model);
        let v = [pool, model, variant];
        let n = add_gauge(&c.replicas, &v, 1.0).max(1.0);
        add_gauge(&c.slots_used, &v, running as f64);
        add_gauge(&c.slots, &v, slots as f64);
        let used = add_gauge(&c.kv_used, &v, kv_used as f64);
        let capacity = add_gauge(&c.kv_capacity, &v, kv_capacity as f64);
        let ratio = if capacity > 0.0 {
            (used / capacity).clamp(0.0, 1.0)
        } else {
            0.0
        };
        if let Some(g) = get(&c.kv_usage, &v) {
            g.set(ratio);
        }
        if let Some(g) = get(&c.busy, &v) {
            let x = if busy_fraction.is_finite() {
                busy_fraction.clamp(0.0, 1.0)
            } else {
                0.0
            };
            let mean = g.get();
            g.set(mean + (x - mean) / n);
        }
    }

    /// A shadowed version decided a request too; `fields` are those it
    /// decided differently.
    pub fn shadow(&self, version: &str, fields: &[&str]) {
        let Some(c) = &self.c else { return };
        let result = if fields.is_empty() { "same" } else { "differs" };
        add(&c.shadow, &[version, result], 1.0);
        for f in fields {
            add(&c.shadow_diffs, &[version, f], 1.0);
        }
    }

    pub fn canary_request(&self, version: &str) {
        if let Some(c) = &self.c {
            add(&c.canary, &[version], 1.0);
        }
    }

    pub fn rollout_stage(&self, version: &str, stage: &str) {
        if let Some(c) = &self.c {
            add(&c.stages, &[version, stage], 1.0);
        }
    }

    pub fn rollback(&self, trigger: &str) {
        if let Some(c) = &self.c {
            add(&c.rollbacks, &[trigger], 1.0);
        }
    }

    pub fn override_refusal(&self, action: &str, scope: &str, name: &str) {
        if let Some(c) = &self.c {
            add(&c.override_refusals, &[action, scope, name], 1.0);
        }
    }

    pub fn approval(&self, result: &str) {
        if let Some(c) = &self.c {
            add(&c.approvals, &[result], 1.0);
        }
    }

    /// Replaces the batch gauges with these rows: (tenant, tier, pending,
    /// in flight, completed, failed) per batch, and predicted misses as
    /// (batch, tenant, tier, missed).
    pub fn set_batches(
        &self,
        items: &[(&str, &str, [u64; 4])],
        predicted: &[(&str, &str, &str, bool)],
    ) {
        let Some(c) = &self.c else { return };
        c.batch_items.reset();
        c.batch_predicted_miss.reset();
        for (tenant, tier, n) in items {
            for (state, v) in ["pending", "in_flight", "completed", "failed"]
                .into_iter()
                .zip(n)
            {
                if let Some(g) = get(&c.batch_items, &[tenant, tier, state]) {
                    g.add(*v as f64);
                }
            }
        }
        for (batch, tenant, tier, missed) in predicted {
            if let Some(g) = get(&c.batch_predicted_miss, &[batch, tenant, tier]) {
                g.set(if *missed { 1.0 } else { 0.0 });
            }
        }
    }

    pub fn batch_deadline_misses(&self, tenant: &str, tier: &str, n: u64) {
        if let Some(c) = &self.c {
            add(&c.batch_deadline_misses, &[tenant, tier], n as f64);
        }
    }

    /// Drops every queue and replica series, before refilling them from a
    /// snapshot.
    pub fn reset_gauges(&self) {
        let Some(c) = &self.c else { return };
        for g in c.replica_gauges().into_iter().chain([
            &c.queue_depth,
            &c.queue_oldest,
            &c.upstream_breaker,
            &c.budget_limit,
            &c.budget_spent,
        ]) {
            g.reset();
        }
        let cat = self
            .primed
            .lock()
            .ok()
            .and_then(|p| p.as_ref().map(|(_, cat)| cat.clone()));
        if let Some(cat) = cat {
            self.zero_gauges(&cat);
        }
    }

    /// A money budget as the snapshot saw it. Refilled with the other
    /// gauges.
    pub fn set_budget(&self, scope: &str, name: &str, period: &str, limit: f64, spent: f64) {
        let Some(c) = &self.c else { return };
        let v = [scope, name, period];
        if let Some(g) = get(&c.budget_limit, &v) {
            g.set(limit);
        }
        if let Some(g) = get(&c.budget_spent, &v) {
            g.set(spent);
        }
    }

    /// An HTTP upstream's breaker as the snapshot saw it, `open` while it
    /// refuses requests. Refilled with the other gauges.
    pub fn set_upstream_breaker(&self, pool: &str, upstream: &str, open: bool) {
        let Some(c) = &self.c else { return };
        if let Some(g) = get(&c.upstream_breaker, &[pool, upstream]) {
            g.set(if open { 1.0 } else { 0.0 });
        }
    }
}

/// Registers `c`. With a fresh registry and distinct names this cannot
/// fail; if it did, the metric would only go unexported.
fn register<C: Collector + Clone + 'static>(r: &Registry, c: &C) {
    if let Err(e) = r.register(Box::new(c.clone())) {
        tracing::warn!(error = %e, "could not register a metric");
    }
}

fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<CounterVec> {
    let c = CounterVec::new(Opts::new(name, help), labels)?;
    register(r, &c);
    Ok(c)
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<GaugeVec> {
    let g = GaugeVec::new(Opts::new(name, help), labels)?;
    register(r, &g);
    Ok(g)
}

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
) -> prometheus::Result<HistogramVec> {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    let h = HistogramVec::new(opts, RTPM)?;
    register(r, &h);
    Ok(h)
}

/// The child for `values`, or `None` (nothing recorded) if the arity is
/// wrong.
fn get<T: MetricVecBuilder>(vec: &MetricVec<T>, values: &[&str]) -> Option<T::M> {
    vec.get_metric_with_label_values(values).ok()
}

/// Observes a duration; a negative one counts as 0, a non-finite one is
/// ignored.
fn observe(h: &HistogramVec, l: &Labels, seconds: f64) {
    if !seconds.is_finite() {
        return;
    }
    if let Some(h) = get(h, &l.values()) {
        h.observe(seconds.max(0.0));
    }
}

/// Adds `v` to a counter; zero, negative and non-finite amounts are
/// ignored (a counter only goes up, and a zero would create a series).
fn add(c: &CounterVec, values: &[&str], v: f64) {
    if !(v.is_finite() && v > 0.0) {
        return;
    }
    if let Some(c) = get(c, values) {
        c.inc_by(v);
    }
}

/// Adds `v` to a gauge and returns the new value.
fn add_gauge(g: &GaugeVec, values: &[&str], v: f64) -> f64 {
    match get(g, values) {
        Some(g) => {
            g.add(v);
            g.get()
        }
        None => 0.0,
    }
}

/// Creates series (at zero) until `left` runs out.
struct Budget {
    left: usize,
    made: usize,
}

impl Budget {
    fn touch<T: MetricVecBuilder>(&mut self, vec: &MetricVec<T>, values: &[&str]) {
        if self.left > 0 && get(vec, values).is_some() {
            self.left -= 1;
            self.made += 1;
        }
    }
}

/// `n` in decimal, written into `buf` without allocating.
fn decimal(mut n: u16, buf: &mut [u8; 5]) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[i..]).unwrap_or("0")
}

#[cfg(test)]
mod tests;
