//! How a request ended, written once: explain, the decision log, metrics,
//! costs, the rollback conditions' live samples, and the `x-kiln-*`
//! response headers. [`record`] is the one entry: every end of a request
//! ([`End`]) is written there, whoever ended it (the pipeline, a gate, the
//! stream, a cache hit, a client that left); [`note`] adds the steps of
//! its life to explain on the way.

use super::headers::{recorded_headers, recorded_request, refused_headers};
use super::{served_substitution, Ctx, Decided, Started, BATCH_HEADER};
use crate::graph::{DecisionGraph, TenantId};
use crate::sched::Reason;
use crate::server::cache::{hex, Semantic, HEADER};
use crate::server::explain;
use crate::server::metrics::{Labels, Outcome as MetricOutcome};
use crate::server::openai::ApiError;
use crate::traffic::{Decision as LogDecision, Record};
use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;

/// How a request ended, as [`record`] writes it.
pub(in crate::server) enum End<'a> {
    /// Refused by a gate or the scheduler, with its reason code.
    Refused {
        d: Option<&'a Decided>,
        reason: &'a str,
        err: &'a ApiError,
    },
    /// Refused by an operator's override on its decided tier.
    Overridden {
        d: &'a Decided,
        r: &'a crate::governance::overrides::Refused,
        err: &'a ApiError,
    },
    /// The client went away before it started (while queued, or while the
    /// fleet's store was consulted).
    Left { d: Option<&'a Decided> },
    /// It started on a replica and ended there: served, cancelled by the
    /// client mid-answer (charged for what it used), failed, preempted.
    /// `status` is the one the client got; `None` when no answer went out.
    Ran {
        s: &'a Started,
        output_tokens: u64,
        ttft_s: Option<f64>,
        outcome: MetricOutcome,
        gpu_seconds: f64,
        /// The part of `gpu_seconds` that served no answer.
        wasted_gpu_seconds: f64,
        status: Option<u16>,
    },
    /// Answered from its tier's cache (`similarity` for a semantic hit).
    CacheHit {
        d: &'a Decided,
        shown: &'a str,
        similarity: Option<f32>,
        completion: u64,
    },
}

/// The one place a request's end is written.
pub(in crate::server) fn record(ctx: &Ctx, end: End<'_>) {
    // A retry is counted at its end, so once, whoever ended it.
    if let Some(retry) = ctx.req.retry() {
        let d = match &end {
            End::Refused { d, .. } | End::Left { d } => *d,
            End::Overridden { d, .. } | End::CacheHit { d, .. } => Some(*d),
            End::Ran { s, .. } => Some(&s.d),
        };
        let (tier, tenant) = decided_names(d);
        ctx.app.metrics.retry(&tier, &tenant, retry.as_str());
    }
    if let Some(x) = &ctx.app.otel {
        x.emit(span_of(ctx, &end));
    }
    match end {
        End::Refused { d, reason, err } => refused(ctx, d, reason, err),
        End::Overridden { d, r, err } => overridden(ctx, d, r, err),
        End::Left { d } => left(ctx, d),
        End::Ran {
            s,
            output_tokens,
            ttft_s,
            outcome,
            gpu_seconds,
            wasted_gpu_seconds,
            status,
        } => ran(
            ctx,
            s,
            output_tokens,
            ttft_s,
            outcome,
            (gpu_seconds, wasted_gpu_seconds),
            status,
        ),
        End::CacheHit {
            d,
            shown,
            similarity,
            completion,
        } => cache_hit(ctx, d, shown, similarity, completion),
    }
}

/// The request's OpenTelemetry span at its end ([`crate::server::otel`]):
/// its trace and kiln's span id from the `traceparent` the gateway stamped
/// it with, the client's span as parent where it sent one.
fn span_of(ctx: &Ctx, end: &End<'_>) -> crate::server::otel::RequestSpan {
    use crate::backend::http::trace::TraceParent;
    let own = ctx
        .req
        .headers
        .get("traceparent")
        .and_then(|v| TraceParent::parse(v))
        .unwrap_or_else(|| TraceParent::child_of(None));
    let parent_id = ctx
        .req
        .headers
        .get(crate::backend::http::trace::CLIENT_PARENT)
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .filter(|p| *p != 0);
    let now_ns = crate::clock::unix_ms() * 1e6;
    let start_ns = (ctx.received_ms * 1e6).max(0.0) as u128;
    let d = match end {
        End::Refused { d, .. } | End::Left { d } => *d,
        End::Overridden { d, .. } | End::CacheHit { d, .. } => Some(*d),
        End::Ran { s, .. } => Some(&s.d),
    };
    let (tier, tenant) = decided_names(d);
    let mut span = crate::server::otel::RequestSpan {
        trace_id: own.trace_id,
        span_id: own.parent_id,
        parent_id,
        sampled: own.flags & 1 == 1,
        start_unix_ns: start_ns,
        end_unix_ns: (now_ns.max(0.0) as u128).max(start_ns),
        operation: match ctx.endpoint {
            crate::server::openai::Endpoint::Chat => "chat",
            crate::server::openai::Endpoint::Completions => "text_completion",
        },
        request_model: ctx.client_model.clone(),
        response_model: None,
        request_id: ctx.rid.clone(),
        input_tokens: ctx.req.prompt_tokens,
        output_tokens: None,
        max_tokens: Some(ctx.req.max_tokens),
        status: None,
        tier,
        tenant,
        route: None,
        outcome: String::new(),
        reason: None,
        ttft_s: None,
        gpu_seconds: None,
        policy_version: d.map(|d| d.version.to_string()),
    };
    match end {
        End::Refused { reason, err, .. } => {
            span.outcome = "refused".into();
            span.reason = Some(reason.to_string());
            span.status = Some(err.status);
        }
        End::Overridden { err, .. } => {
            span.outcome = "refused".into();
            span.reason = Some("override".into());
            span.status = Some(err.status);
        }
        End::Left { .. } => span.outcome = "left".into(),
        End::Ran {
            s,
            output_tokens,
            ttft_s,
            outcome,
            gpu_seconds,
            status,
            ..
        } => {
            span.outcome = outcome.as_str().to_string();
            span.route = Some(s.route.to_string());
            span.response_model = s.route.split(" on ").next().map(str::to_string);
            span.output_tokens = Some(*output_tokens);
            span.ttft_s = *ttft_s;
            span.gpu_seconds = Some(*gpu_seconds);
            span.status = *status;
            if !matches!(outcome, MetricOutcome::Ok) {
                span.reason = Some(outcome.as_str().to_string());
            }
        }
        End::CacheHit { completion, .. } => {
            span.outcome = "cache_hit".into();
            span.output_tokens = Some(*completion);
            span.status = Some(200);
        }
    }
    span
}

/// A request past authentication and its arrival gates: its explain
/// entry (batch items' in a store of their own).
pub(in crate::server) fn arrived(
    app: &crate::server::App,
    batch: bool,
    rid: &str,
    endpoint: crate::server::openai::Endpoint,
    received_ms: f64,
    req: &crate::graph::Request,
    graph: &DecisionGraph,
) -> explain::Shared {
    let store = if batch {
        &app.explain_batch
    } else {
        &app.explain
    };
    store.insert(explain::Entry {
        id: rid.to_string(),
        endpoint: endpoint.path(),
        received_unix_ms: received_ms,
        request: recorded_request(req, &[graph]),
        version: None,
        graph: None,
        signals: None,
        events: Vec::new(),
        outcome: None,
        replica: None,
        clock: explain::ClockTimes::default(),
    })
}

/// The policy decided it (at `at` on the scheduler's clock): explain keeps
/// the deciding version, graph and signals, and the headers they read.
pub(in crate::server) fn decided(ctx: &Ctx, d: &Decided, at: crate::sched::Micros) {
    explain::clock(&ctx.explain, |c| c.arrived_us = Some(at));
    let recorded = recorded_headers(&ctx.req.headers, &[&d.graph, &d.policy_graph]);
    if let Ok(mut e) = ctx.explain.lock() {
        e.version = Some(d.version.clone());
        e.graph = Some(d.policy_graph.clone());
        e.signals = Some(d.policy_signals.clone());
        e.request.headers = recorded;
    }
}

/// It started on a replica.
pub(in crate::server) fn started(
    ctx: &Ctx,
    replica: usize,
    route: &str,
    waited_for: Option<Reason>,
    at: crate::sched::Micros,
) {
    explain::clock(&ctx.explain, |c| c.started_us = Some(at));
    note(
        ctx,
        format!("started on replica {replica} ({route})"),
        waited_for.map(Reason::name),
    );
    if let Ok(mut e) = ctx.explain.lock() {
        e.replica = Some(route.to_string());
    }
}

/// Its last step ended, on the scheduler's clock.
pub(in crate::server) fn finished_at(ctx: &Ctx, at: crate::sched::Micros) {
    explain::clock(&ctx.explain, |c| c.finished_us = Some(at));
}

/// It was preempted while it ran (its answer not begun, or a stream cut
/// short): `kiln_preemptions_total`, once per preemption.
pub(in crate::server) fn preempted(ctx: &Ctx, d: &Decided) {
    let (tier, tenant) = decided_names(Some(d));
    ctx.app.metrics.preempted(&tier, &tenant);
}

/// A step of the request's life, for explain.
pub(in crate::server) fn note(ctx: &Ctx, event: impl Into<String>, reason: Option<&str>) {
    explain::note(&ctx.explain, ctx.ms(), event, reason);
}

fn left(ctx: &Ctx, d: Option<&Decided>) {
    let reason = "client_disconnected";
    explain::note(
        &ctx.explain,
        ctx.ms(),
        "the client went away while the request waited: cancelled",
        Some(reason),
    );
    if let Ok(mut e) = ctx.explain.lock() {
        e.outcome = Some("cancelled while queued".into());
    }
    // An upstream's attempts before it went back to the queue.
    charge_spent(ctx, d, "abandoned");
    // Counted like every other end (`kiln_requests_total{outcome="cancelled"}`):
    // no pool served it, and no tokens were produced.
    let (tier, tenant) = decided_names(d);
    // Only a model the policy knows becomes a label value.
    let model = match d {
        Some(d) if d.graph.model_id(&ctx.req.model).is_some() => ctx.req.model.as_str(),
        _ => "none",
    };
    let labels = Labels {
        tier: &tier,
        tenant: &tenant,
        pool: "none",
        model,
    };
    ctx.app
        .metrics
        .request_done(&labels, MetricOutcome::Cancelled);
    if ctx.app.log.is_enabled() {
        let mut rec = base_record(ctx, d);
        let dec = rec.decision.get_or_insert_with(LogDecision::default);
        dec.admission = Some("cancel".into());
        // No answer went out: no status.
        dec.status = None;
        dec.reason = Some(reason.into());
        rec.e2e_ms = Some(round3(ctx.ms()));
        ctx.app.log.write(rec);
    }
}

/// GPU time a request that ended without running to its end had used
/// before (an upstream's attempts, a run cut short by a preemption):
/// charged where it ran, and all of it wasted (`reason`).
fn charge_spent(ctx: &Ctx, d: Option<&Decided>, reason: &str) {
    let gpu = ctx.spent_gpu_seconds;
    let (Some(d), Some(route), true) = (d, ctx.spent_on.as_deref(), gpu > 0.0) else {
        return;
    };
    let tenant = tenant_name(&d.graph, d.tenant);
    charge_gpu(ctx, d, &labels_at(d, route, &tenant), gpu, (gpu, reason));
}

/// The labels of a request decided as `d` that ran on `route`
/// (`model.variant on pool`).
fn labels_at<'a>(d: &'a Decided, route: &'a str, tenant: &'a str) -> Labels<'a> {
    let tier = d
        .graph
        .tiers
        .get(d.tier as usize)
        .map_or("?", |t| t.name.as_str());
    let (pool, model) = route
        .split_once(" on ")
        .map_or((route, ""), |(m, p)| (p, m));
    Labels {
        tier,
        tenant,
        pool,
        model,
    }
}

/// GPU time a request used where `l` says, and the part of it wasted
/// (`wasted`, for `reason`): the metrics, its cost at the tenant's or the
/// pool's price, and `/admin/costs`.
fn charge_gpu(ctx: &Ctx, d: &Decided, l: &Labels<'_>, gpu: f64, (wasted, reason): (f64, &str)) {
    let g = &d.graph;
    let cost = gpu / 3600.0 * g.gpu_hour_price(d.tenant, g.pool_id(l.pool)).unwrap_or(0.0);
    ctx.app.metrics.gpu_seconds(l, gpu, cost);
    ctx.app.metrics.gpu_wasted(l, reason, wasted.min(gpu));
    ctx.app.costs.charge(
        [l.tier, l.tenant, l.pool, l.model],
        ctx.req.headers.get(BATCH_HEADER).map(String::as_str),
        gpu,
        cost,
    );
}

/// A refusal, by the scheduler (`reason` is its [`Reason`]'s name) or a
/// gate (its code, such as `unsupported_parameter`).
fn refused(ctx: &Ctx, d: Option<&Decided>, reason: &str, err: &ApiError) {
    refused_logged(ctx, d, reason, err);
    let waste = if reason == Reason::Preempted.name() {
        "preempted"
    } else {
        "failed"
    };
    charge_spent(ctx, d, waste);
    record_live(
        ctx,
        d,
        None,
        ctx.received.elapsed().as_secs_f64(),
        err.status >= 500,
        false,
        Ran::default(),
    );
}

/// [`refused`] but for the rollback conditions' live sample: explain, the
/// refusal's metric and its decision-log line.
fn refused_logged(ctx: &Ctx, d: Option<&Decided>, reason: &str, err: &ApiError) {
    let app = &ctx.app;
    let (tier, mut tenant) = decided_names(d);
    // Refused before the policy decided (the fleet's quota): the tenant
    // the request named.
    if let (None, Some(t)) = (d, ctx.req.tenant.as_ref()) {
        tenant = t.clone();
    }
    app.metrics.rejected(&tier, &tenant, reason, err.status);
    explain::note(
        &ctx.explain,
        ctx.ms(),
        format!("refused with {}: {}", err.status, err.message),
        Some(reason),
    );
    // A refusal keeps none of the client's free-form headers.
    let policy = ctx.app.policy.load();
    let graphs: Vec<&DecisionGraph> = match d {
        Some(d) => vec![&d.graph, &d.policy_graph],
        None => vec![&policy.graph],
    };
    let headers = refused_headers(&ctx.req.headers, &graphs);
    if let Ok(mut e) = ctx.explain.lock() {
        e.outcome = Some(format!("rejected {}", err.status));
        e.request.headers = headers.clone();
    }
    let mut rec = base_record(ctx, d);
    rec.headers = headers;
    // The model and session names are the client's bytes too; no model or
    // session a policy serves is this long.
    truncate_chars(&mut rec.model, MAX_REFUSED_NAME_BYTES);
    if let Some(sn) = rec.session.as_mut() {
        truncate_chars(sn, MAX_REFUSED_NAME_BYTES);
    }
    if let Some(dec) = rec.decision.as_mut() {
        dec.admission = Some("reject".into());
        dec.status = Some(err.status);
        dec.reason = Some(reason.to_string());
    }
    rec.e2e_ms = Some(round3(ctx.ms()));
    app.log.write(rec);
}

/// Bytes of a refused request's model and session names a record keeps.
const MAX_REFUSED_NAME_BYTES: usize = 256;

/// Cuts `s` to at most `max` bytes, on a character boundary.
fn truncate_chars(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

pub(in crate::server) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(in crate::server) fn base_record(ctx: &Ctx, d: Option<&Decided>) -> Record {
    let req = match d {
        Some(d) => recorded_request(&ctx.req, &[&d.graph, &d.policy_graph]),
        None => recorded_request(&ctx.req, &[&ctx.app.policy.load().graph]),
    };
    let mut r = Record::new(ctx.received_ms.round(), req, 0);
    r.id = Some(ctx.rid.clone());
    r.api_key = None;
    r.prefix_blocks = ctx.prefix_blocks.clone();
    // A batch item's deadline, on the log's clock (wall milliseconds, as
    // `at_ms`), so a replay of the log holds it to the same window.
    if let Some(w) = ctx.window_ms() {
        r.deadline_ms = Some((ctx.received_ms + w / ctx.app.speed).round());
    }
    if let Some(d) = d {
        r.policy_version = Some(d.version.to_string());
        r.decision = Some(LogDecision {
            tier: d.graph.tiers.get(d.tier as usize).map(|t| t.name.clone()),
            tenant: d
                .tenant
                .and_then(|t| d.graph.tenants.get(t as usize))
                .map(|t| t.name.clone()),
            route: None,
            admission: Some("accept".into()),
            status: Some(200),
            fallback_step: d.fallback_step.map(|s| u32::from(s) + 1),
            ..LogDecision::default()
        });
    }
    r
}

/// What one served request adds to the log, metrics and explain store.
/// `status` is the one the client got; `None` when no answer went out (a
/// client that left before its whole answer was ready).
fn ran(
    ctx: &Ctx,
    s: &Started,
    output_tokens: u64,
    ttft_s: Option<f64>,
    outcome: MetricOutcome,
    (gpu_seconds, wasted_gpu_seconds): (f64, f64),
    status: Option<u16>,
) {
    let app = &ctx.app;
    let g = &s.d.graph;
    let tenant = tenant_name(g, s.d.tenant);
    let labels = labels_at(&s.d, &s.route, &tenant);
    let tier = labels.tier;
    let e2e = ctx.received.elapsed().as_secs_f64();
    app.metrics.request_done(&labels, outcome);
    app.metrics.queue_wait(&labels, s.queue_s);
    if let Some(t) = ttft_s {
        app.metrics.ttft(&labels, t);
    }
    app.metrics.e2e(&labels, e2e);
    app.metrics
        .tokens(&labels, ctx.req.prompt_tokens, output_tokens);
    let waste = crate::server::metrics::waste_reason(outcome).unwrap_or("recompute");
    charge_gpu(ctx, &s.d, &labels, gpu_seconds, (wasted_gpu_seconds, waste));
    // Preemptions seen while it waited to start again, and a stream an
    // upstream's preemption cut short (the others are counted as they
    // happen: [`preempted`]).
    let cut_short = u32::from(outcome == MetricOutcome::Preempted);
    for _ in 0..s.preempted + cut_short {
        app.metrics.preempted(tier, &tenant);
    }
    let window = ctx
        .window_ms()
        .or(g.tiers.get(s.d.tier as usize).and_then(|t| t.slo.window));
    if let Some(w) = window {
        if e2e * 1000.0 * app.speed > w {
            app.metrics.deadline_miss(tier, &tenant);
        }
    }
    let label = match outcome {
        MetricOutcome::Ok => "served",
        MetricOutcome::Cancelled => "cancelled by the client",
        MetricOutcome::UpstreamError => "upstream error",
        MetricOutcome::Timeout => "upstream timeout",
        MetricOutcome::Rejected => "rejected",
        MetricOutcome::Preempted => "preempted mid-stream",
    };
    explain::note(
        &ctx.explain,
        ctx.ms(),
        format!("{label}: {output_tokens} tokens"),
        None,
    );
    if let Ok(mut e) = ctx.explain.lock() {
        e.outcome = Some(label.into());
    }
    // The record is built only when someone will read it.
    if app.log.is_enabled() {
        let mut rec = base_record(ctx, Some(&s.d));
        rec.output_tokens = output_tokens;
        rec.cache_key = ctx.cache_content.as_ref().map(crate::server::cache::hex);
        let sub = served_substitution(ctx, s);
        if let Some(dec) = rec.decision.as_mut() {
            dec.route = Some(s.route.to_string());
            dec.replica = u32::try_from(s.replica).ok();
            dec.substituted_for = sub.map(|x| x.asked);
            dec.admission = Some(
                if s.waited_for.is_some() {
                    "queue"
                } else {
                    "accept"
                }
                .into(),
            );
            dec.waited_for = s.waited_for.map(|r| r.name().to_string());
            dec.cache = s.d.cache.map(|_| "miss".to_string());
            // The status the client got (an upstream's 502 is not a 200),
            // and why an admitted request did not end as served.
            dec.status = status;
            dec.reason = match outcome {
                MetricOutcome::Ok | MetricOutcome::Rejected => None,
                MetricOutcome::Cancelled => Some("client_disconnected".into()),
                MetricOutcome::UpstreamError => Some("upstream_error".into()),
                MetricOutcome::Timeout => Some("upstream_timeout".into()),
                MetricOutcome::Preempted => Some(Reason::Preempted.name().into()),
            };
        }
        rec.ttft_ms = ttft_s.map(|t| round3(t * 1000.0));
        rec.e2e_ms = Some(round3(e2e * 1000.0));
        rec.queue_ms = Some(round3(s.queue_s * 1000.0));
        app.log.write(rec);
    }
    if outcome != MetricOutcome::Cancelled {
        let error = matches!(
            outcome,
            MetricOutcome::UpstreamError | MetricOutcome::Timeout
        );
        let ran = Ran {
            pool: Some(labels.pool),
            queue_s: Some(s.queue_s),
        };
        record_live(ctx, Some(&s.d), ttft_s, e2e, error, true, ran);
    }
}

/// Where a finished request ran and how long it queued, for the rollback
/// conditions' live metrics (nothing for a refusal).
#[derive(Default, Clone, Copy)]
pub(in crate::server) struct Ran<'a> {
    pub(in crate::server) pool: Option<&'a str>,
    pub(in crate::server) queue_s: Option<f64>,
}

/// One finished request for the rollback conditions' live metrics.
pub(in crate::server) fn record_live(
    ctx: &Ctx,
    d: Option<&Decided>,
    ttft_s: Option<f64>,
    e2e_s: f64,
    error: bool,
    served: bool,
    ran: Ran<'_>,
) {
    let app = &ctx.app;
    let gov = &app.gov;
    let (tier, tenant, canary) = match d {
        Some(d) => (
            d.graph.tiers.get(d.tier as usize),
            d.tenant
                .and_then(|t| d.graph.tenants.get(t as usize))
                .map(|t| t.name.clone()),
            d.canary,
        ),
        None => (None, None, false),
    };
    let ttft_ms = ttft_s.map(|t| gov.policy_ms(t));
    let e2e_ms = gov.policy_ms(e2e_s);
    // A batch item's deadline is its own (what was left of its batch's
    // window), not its tier's.
    let window = ctx.window_ms().or(tier.and_then(|t| t.slo.window));
    let met = served
        && !error
        && tier.is_none_or(|t| {
            t.slo.ttft.is_none_or(|s| ttft_ms.unwrap_or(e2e_ms) <= s)
                && t.slo.e2e_p95.is_none_or(|s| e2e_ms <= s)
        })
        && window.is_none_or(|s| e2e_ms <= s);
    let miss = window.is_some_and(|w| served && e2e_ms > w);
    gov.record(crate::governance::live::Sample {
        at_ms: gov.now_ms(),
        tier: tier.map_or_else(|| "none".to_string(), |t| t.name.clone()),
        tenant,
        ttft_ms: if served { ttft_ms } else { None },
        e2e_ms: served.then_some(e2e_ms),
        error,
        met_slo: met,
        deadline_miss: miss,
        canary,
        pool: ran.pool.map(str::to_string),
        wait_ms: ran.queue_s.map(|q| gov.policy_ms(q)),
        fallback: d.is_some_and(|d| d.fallback_step.is_some()),
    });
}

pub(in crate::server) fn tenant_name(g: &DecisionGraph, t: Option<TenantId>) -> String {
    t.and_then(|t| g.tenants.get(t as usize))
        .map(|t| t.name.clone())
        .unwrap_or_else(|| "none".into())
}

/// The tier and tenant a decision named (`none` where it named none).
pub(in crate::server) fn decided_names(d: Option<&Decided>) -> (String, String) {
    match d {
        Some(d) => (
            d.graph
                .tiers
                .get(d.tier as usize)
                .map(|t| t.name.clone())
                .unwrap_or_else(|| "none".into()),
            tenant_name(&d.graph, d.tenant),
        ),
        None => ("none".into(), "none".into()),
    }
}

pub(in crate::server) fn kiln_headers(
    ctx: &Ctx,
    s: &Started,
    backend: &str,
) -> Vec<(&'static str, String)> {
    let g = &s.d.graph;
    let sub = served_substitution(ctx, s);
    let route = match &sub {
        Some(x) => format!("{} (substituted for {})", s.route, x.asked),
        None => s.route.to_string(),
    };
    let mut h = vec![
        ("x-kiln-request-id", ctx.rid.clone()),
        ("x-kiln-policy-version", s.d.version.to_string()),
        (
            "x-kiln-tier",
            g.tiers
                .get(s.d.tier as usize)
                .map(|t| t.name.clone())
                .unwrap_or_default(),
        ),
        ("x-kiln-tenant", tenant_name(g, s.d.tenant)),
        ("x-kiln-route", route),
        ("x-kiln-backend", backend.to_string()),
        ("x-kiln-queue-ms", format!("{:.3}", s.queue_s * 1000.0)),
        ("x-kiln-explain", format!("/admin/explain/{}", ctx.rid)),
    ];
    h.extend(miss_headers(ctx, &s.d));
    if let Some(l) = &s.d.limits {
        h.extend(super::ratelimit::headers(g, l, ctx.app.speed));
    }
    if let Some(w) = s.waited_for {
        h.push(("x-kiln-waited-for", w.name().to_string()));
    }
    if ctx.requeued > 0 {
        h.push(("x-kiln-upstream-requeued", ctx.requeued.to_string()));
    }
    if s.d.canary {
        h.push(("x-kiln-canary", "true".to_string()));
    }
    if let Some(f) = s.d.fallback_step {
        h.push(("x-kiln-fallback-step", (u32::from(f) + 1).to_string()));
    }
    if let Some(x) = sub {
        h.push((
            "x-kiln-model-substituted",
            format!("{} -> {}", x.asked, x.served),
        ));
    }
    // In a fleet: which replica answered (its explain and log hold it).
    if let Some(f) = &ctx.app.fleet {
        h.push(("x-kiln-replica", f.store.replica().to_string()));
    }
    h
}

pub(in crate::server) fn with_headers(
    mut resp: Response,
    h: Vec<(&'static str, String)>,
) -> Response {
    let headers = resp.headers_mut();
    headers.reserve(h.len());
    for (k, v) in h {
        // Takes the string's bytes as they are (no copy); the same check
        // as `from_str`.
        if let Ok(v) = HeaderValue::try_from(v) {
            headers.insert(header_name(k), v);
        }
    }
    resp
}

/// The name of a header kiln sets: those every answer carries are checked
/// once, at compile time (checking each name on every answer was a
/// twentieth of the gateway's own work per request).
fn header_name(k: &'static str) -> HeaderName {
    static EVERY: [HeaderName; 9] = [
        HeaderName::from_static("x-kiln-request-id"),
        HeaderName::from_static("x-kiln-policy-version"),
        HeaderName::from_static("x-kiln-tier"),
        HeaderName::from_static("x-kiln-tenant"),
        HeaderName::from_static("x-kiln-route"),
        HeaderName::from_static("x-kiln-backend"),
        HeaderName::from_static("x-kiln-queue-ms"),
        HeaderName::from_static("x-kiln-explain"),
        HeaderName::from_static("x-kiln-gpu-seconds"),
    ];
    EVERY
        .iter()
        .find(|n| n.as_str() == k)
        .cloned()
        .unwrap_or_else(|| HeaderName::from_static(k))
}

/// A cacheable miss's headers: `x-kiln-cache: miss`, or `skipped` with
/// `x-kiln-cache-skipped: REASON` when its tier has a semantic cache whose
/// lookup was skipped ([`Skip`]).
pub(in crate::server) fn miss_headers(ctx: &Ctx, d: &Decided) -> Vec<(&'static str, String)> {
    if d.cache.is_none() {
        return Vec::new();
    }
    let semantic = d
        .graph
        .tiers
        .get(d.tier as usize)
        .is_some_and(|t| t.cache.semantic.is_some());
    match &ctx.semantic_probe {
        Semantic::Skipped(why) if semantic => vec![
            (HEADER, "skipped".to_string()),
            ("x-kiln-cache-skipped", why.as_str().to_string()),
        ],
        _ => vec![(HEADER, "miss".to_string())],
    }
}

/// Logs and explains a request whose client went away while it waited in
/// the scheduler: the handler (and this guard with it) is dropped
/// mid-wait. Disarmed once waiting ends any other way.
pub(in crate::server) struct LeftWhileQueued<'a> {
    pub(in crate::server) ctx: &'a Ctx,
    pub(in crate::server) decided: Option<Decided>,
    pub(in crate::server) armed: bool,
}

impl Drop for LeftWhileQueued<'_> {
    fn drop(&mut self) {
        if self.armed {
            record(
                self.ctx,
                End::Left {
                    d: self.decided.as_ref(),
                },
            );
        }
    }
}

/// A request an operator's override on its decided tier refused: recorded
/// like any refusal once decided (explain, a decision-log line, the
/// refusal's metric; it used to reach none but explain), and explain says
/// an override refused it. Not a live sample: an operator's pause is not
/// the policy failing, and must not trip a rollback condition.
fn overridden(ctx: &Ctx, d: &Decided, r: &crate::governance::overrides::Refused, err: &ApiError) {
    refused_logged(ctx, Some(d), r.code, err);
    if let Ok(mut e) = ctx.explain.lock() {
        e.outcome = Some(format!("refused by an override {}", r.status));
    }
}

/// A cache hit, measured like any served request on the route `cache`.
fn cache_hit(ctx: &Ctx, d: &Decided, shown: &str, similarity: Option<f32>, completion: u64) {
    let app = &ctx.app;
    let kind = if similarity.is_some() {
        "semantic"
    } else {
        "exact"
    };
    let g = &d.graph;
    let tier = g
        .tiers
        .get(d.tier as usize)
        .map_or("?", |t| t.name.as_str());
    let tenant = tenant_name(g, d.tenant);
    let e2e = ctx.received.elapsed().as_secs_f64();
    let labels = Labels {
        tier,
        tenant: &tenant,
        pool: "cache",
        model: &ctx.client_model,
    };
    app.metrics.cache_lookup(tier, &tenant, kind, true);
    app.metrics.request_done(&labels, MetricOutcome::Ok);
    app.metrics.e2e(&labels, e2e);
    app.metrics.ttft(&labels, e2e);
    explain::note(
        &ctx.explain,
        ctx.ms(),
        match similarity {
            Some(sim) => format!(
                "served from the semantic cache of tier {tier} (a cached question {sim:.3} similar, answer key {shown}): no queue, no replica, no GPU time; {completion} tokens"
            ),
            None => format!(
                "served from the exact cache of tier {tier} (key {shown}): no queue, no replica, no GPU time; {completion} tokens"
            ),
        },
        None,
    );
    if let Ok(mut e) = ctx.explain.lock() {
        e.outcome = Some("served from the cache".into());
        e.replica = Some("cache".into());
    }
    if app.log.is_enabled() {
        let mut rec = base_record(ctx, Some(d));
        rec.output_tokens = completion;
        rec.cache_key = ctx.cache_content.as_ref().map(hex);
        if let Some(dec) = rec.decision.as_mut() {
            dec.route = Some("cache".into());
            dec.cache = Some(
                if similarity.is_some() {
                    "semantic_hit"
                } else {
                    "hit"
                }
                .into(),
            );
        }
        rec.ttft_ms = Some(round3(e2e * 1000.0));
        rec.e2e_ms = Some(round3(e2e * 1000.0));
        rec.queue_ms = Some(0.0);
        app.log.write(rec);
    }
    let hit = Ran {
        pool: None,
        queue_s: Some(0.0),
    };
    record_live(ctx, Some(d), Some(e2e), e2e, false, true, hit);
}

/// A cache hit's response headers.
pub(in crate::server) fn hit_headers(
    ctx: &Ctx,
    d: &Decided,
    shown: &str,
    similarity: Option<f32>,
) -> Vec<(&'static str, String)> {
    let kind = if similarity.is_some() {
        "semantic"
    } else {
        "exact"
    };
    let g = &d.graph;
    let tier = g
        .tiers
        .get(d.tier as usize)
        .map_or("?", |t| t.name.as_str());
    let mut headers = vec![
        ("x-kiln-request-id", ctx.rid.clone()),
        ("x-kiln-policy-version", d.version.to_string()),
        ("x-kiln-tier", tier.to_string()),
        ("x-kiln-tenant", tenant_name(g, d.tenant)),
        ("x-kiln-route", "cache".to_string()),
        ("x-kiln-queue-ms", "0.000".to_string()),
        ("x-kiln-explain", format!("/admin/explain/{}", ctx.rid)),
        (HEADER, "hit".to_string()),
        ("x-kiln-cache-kind", kind.to_string()),
        ("x-kiln-cache-key", shown.to_string()),
    ];
    if let Some(sim) = similarity {
        headers.push(("x-kiln-cache-similarity", format!("{sim:.4}")));
    }
    // A hit counts against the requests quota like any answer, and says
    // what is left of it the same way.
    if let Some(l) = &d.limits {
        headers.extend(super::ratelimit::headers(g, l, ctx.app.speed));
    }
    headers
}
