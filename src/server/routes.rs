//! The OpenAI endpoints: `POST /v1/chat/completions`, `POST /v1/completions`
//! (plain and streaming) and `GET /v1/models`.
//!
//! One request's life: read the body (413 above the limit), parse (400),
//! authenticate (401), count prompt tokens, submit to the executor, wait
//! for the decision and the start (or a refusal: 404/413/429/503 with
//! Retry-After), then either produce simulated tokens as the executor
//! reports them or call the HTTP upstream. A guard cancels the request in
//! the scheduler if the client goes away at any point, so its capacity is
//! freed at once. At the end one decision-log line and the metrics.

use super::executor::{Command, Progress};
use super::explain::{self, Shared};
use super::generation::{
    budget_error, serve_scheduled, serve_upstream, Attempt, HttpFail, RESEND_UNSENT,
};
use super::metrics::{Labels, Outcome as MetricOutcome};
use super::openai::{ApiError, Endpoint, GenerationRequest};
use super::App;
use crate::backend::Backend;
use crate::governance::overrides::Scope;
use crate::graph::{DecisionGraph, Request, ResponseModel, Signals, TenantId, TierId};
use crate::sched::{Arrival, Reason, ReqId, SEC};
use crate::traffic::{Decision as LogDecision, Record};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(super::surface::list_models))
        .route("/v1/models/{id}", get(super::surface::get_model))
        .with_state(app)
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generate(app, Endpoint::Chat, headers, body).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generate(app, Endpoint::Completions, headers, body).await
}

/// Cancels the request in the scheduler unless disarmed: dropped with the
/// handler or the response stream when the client disconnects.
pub(super) struct CancelGuard {
    id: ReqId,
    app: Arc<App>,
    pub(super) armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.app.exec.send(Command::Cancel(self.id));
        }
    }
}

/// Headers never copied into the policy's view or the decision log.
fn private_header(name: &str) -> bool {
    matches!(
        name,
        "authorization"
            | "proxy-authorization"
            | "cookie"
            | "x-api-key"
            | "api-key"
            | "host"
            | "content-length"
            | "content-type"
            | "accept"
            | "accept-encoding"
            | "connection"
    ) || name.starts_with("x-stainless")
}

/// Header bytes (names plus values) one record of a request keeps at most,
/// in the decision log and in explain. A client controls its headers:
/// without a bound, a few large `x-kiln-*` headers a request (up to the
/// header caps, about 60 KB) would let any keyed tenant rotate the log's
/// history out. The headers the policy reads come first, so a replay still
/// decides the request as the gateway did unless they alone pass the bound.
pub(super) const MAX_RECORDED_HEADER_BYTES: usize = 4 * 1024;

/// The headers a record of this request keeps (the decision log and
/// explain): those the deciding policies read (`header("…")` in their
/// classify, route and admit rules) and `x-kiln-*`, never a credential,
/// at most [`MAX_RECORDED_HEADER_BYTES`] of them.
/// Everything else (tokens, cookies, provider keys under any name) stays
/// out: recorded by allow-list, not by a list of secrets.
pub(super) fn recorded_headers(
    headers: &BTreeMap<String, String>,
    graphs: &[&DecisionGraph],
) -> BTreeMap<String, String> {
    kept_headers(headers, graphs, true)
}

/// What a refused request's record keeps: only the headers the policy
/// reads (so a replay refuses it the same way) and the batch runner's own,
/// none of the client's free-form `x-kiln-*` headers: a refusal costs the
/// log a line, not the client's choice of bytes.
fn refused_headers(
    headers: &BTreeMap<String, String>,
    graphs: &[&DecisionGraph],
) -> BTreeMap<String, String> {
    kept_headers(headers, graphs, false)
}

fn kept_headers(
    headers: &BTreeMap<String, String>,
    graphs: &[&DecisionGraph],
    kiln: bool,
) -> BTreeMap<String, String> {
    if headers.is_empty() {
        return BTreeMap::new();
    }
    let read: Vec<String> = graphs.iter().flat_map(|g| g.headers_read()).collect();
    let mut kept = BTreeMap::new();
    let mut left = MAX_RECORDED_HEADER_BYTES;
    // The policy's headers (and the runner's batch id) first, then the
    // client's `x-kiln-*`; a header that does not fit in what is left is
    // skipped whole (never cut: a cut value would replay as another one).
    for policy_pass in [true, false] {
        for (k, v) in headers {
            let name = k.to_ascii_lowercase();
            if super::decision_log::secret_header(&name) {
                continue;
            }
            let wanted = if policy_pass {
                read.contains(&name) || name == BATCH_HEADER
            } else {
                kiln && name.starts_with("x-kiln-") && !read.contains(&name) && name != BATCH_HEADER
            };
            let size = k.len() + v.len();
            if wanted && size <= left {
                left -= size;
                kept.insert(k.clone(), v.clone());
            }
        }
    }
    kept
}

/// Bytes of `x-kiln-tags` tags one record keeps at most (the tags a
/// client sends are its own choice of bytes, like its headers).
const MAX_RECORDED_TAG_BYTES: usize = 1024;

/// The request as records keep it: only [`recorded_headers`], and its tags
/// up to [`MAX_RECORDED_TAG_BYTES`].
fn recorded_request(req: &Request, graphs: &[&DecisionGraph]) -> Request {
    let mut left = MAX_RECORDED_TAG_BYTES;
    let tags = req
        .tags
        .iter()
        .take_while(|t| {
            let fits = t.len() <= left;
            left = left.saturating_sub(t.len());
            fits
        })
        .cloned()
        .collect();
    Request {
        headers: recorded_headers(&req.headers, graphs),
        tags,
        api_key: req.api_key.clone(),
        tenant: req.tenant.clone(),
        model: req.model.clone(),
        session: req.session.clone(),
        prompt_tokens: req.prompt_tokens,
        max_tokens: req.max_tokens,
    }
}

/// The key from `Authorization: Bearer` (or `x-api-key`).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get("authorization").and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        let key = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
            .unwrap_or(v);
        return Some(key.trim()).filter(|k| !k.is_empty());
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
}

/// The tenant a caller is: by a hashed key from the config, or a key the
/// policy declares. `Ok(None)` is an anonymous caller, where allowed.
pub(super) fn authenticate(
    app: &App,
    g: &DecisionGraph,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    match bearer(headers) {
        Some(key) => {
            if let Some(t) = app.config.tenant_for_key(key) {
                return Ok(Some(t.to_string()));
            }
            if app.config.policy_keys {
                if let Some(t) = g.tenant_for_key(key) {
                    return Ok(g.tenants.get(t as usize).map(|t| t.name.clone()));
                }
            }
            Err(ApiError::new(401, "the API key is not valid").code("invalid_api_key"))
        }
        None if app.config.allow_anonymous => Ok(None),
        None => Err(ApiError::new(
            401,
            "missing API key: send `Authorization: Bearer YOUR-KEY`",
        )
        .code("missing_api_key")),
    }
}

pub(super) struct Decided {
    pub(super) tier: TierId,
    pub(super) tenant: Option<TenantId>,
    pub(super) fallback_step: Option<u8>,
    /// The version that decided (a canary's, when it did).
    pub(super) version: Arc<str>,
    /// The active graph: `tier` and `tenant` are its ids.
    pub(super) graph: Arc<DecisionGraph>,
    /// The graph and signals that decided (a canary's, when it did).
    pub(super) policy_graph: Arc<DecisionGraph>,
    pub(super) policy_signals: Arc<Signals>,
    pub(super) canary: bool,
    /// Missed its tier's exact cache: a complete answer is stored under
    /// this key ([`super::cache`]).
    pub(super) cache: Option<crate::sched::cache::Key>,
}

pub(super) struct Ctx {
    pub(super) app: Arc<App>,
    pub(super) endpoint: Endpoint,
    pub(super) id: ReqId,
    pub(super) rid: String,
    pub(super) req: Request,
    pub(super) body: Value,
    pub(super) client_model: String,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) received: Instant,
    pub(super) received_ms: f64,
    pub(super) explain: Shared,
    /// Times it went back to the queue after an upstream did not serve it
    /// (`x-kiln-upstream-requeued`).
    pub(super) requeued: u32,
    /// The prompt's prefix block ids ([`super::prefix`]).
    pub(super) prefix_blocks: Vec<u64>,
    /// A batch item's own deadline, from its arrival.
    pub(super) window: Option<crate::sched::Micros>,
    /// Its claim on the tenant's quota across the fleet (`[state]`).
    pub(super) claim: Option<Arc<super::fleet::Claim>>,
    /// Its content hash when it is cacheable and a tier has an exact cache.
    pub(super) cache_content: Option<crate::sched::cache::Key>,
    /// Its question's embedding, when a tier has a semantic cache.
    pub(super) semantic_probe: super::cache::Semantic,
}

impl Ctx {
    pub(super) fn ms(&self) -> f64 {
        self.received.elapsed().as_secs_f64() * 1000.0
    }

    /// A batch item's own completion window, in policy milliseconds.
    pub(super) fn window_ms(&self) -> Option<f64> {
        self.window.map(|w| w as f64 / 1000.0)
    }
}

async fn generate(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    match generate_inner(app.clone(), endpoint, headers, body).await {
        Ok(r) => r,
        // Refused before it was recorded (its key, its body): explained too.
        Err(e) => super::surface::explain_refusal(&app, endpoint.path(), None, e).into_response(),
    }
}

async fn generate_inner(
    app: Arc<App>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let received = Instant::now();
    let received_ms = crate::clock::unix_ms();
    // Who is asking comes first: an unauthenticated caller learns nothing
    // about the body it sent.
    let policy = app.policy.load_full();
    let tenant = authenticate(&app, &policy.graph, &headers)?;
    let limits = &app.config.limits;
    let limit = limits.max_body_bytes;
    let timeout = limits.body_timeout();
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Err(super::limits::body_error(&e, limit, timeout)),
        Err(_) => return Err(super::limits::body_timeout_error(timeout)),
    };
    let (greq, raw) = GenerationRequest::parse(endpoint, &bytes)?;
    let big = bytes.len() > limits.blocking_tokenize_bytes;
    drop(bytes);
    let mut hdrs = BTreeMap::new();
    for (k, v) in headers.iter() {
        let name = k.as_str();
        // Only the batch runner says a request is a batch item.
        if private_header(name) || name.starts_with(BATCH_HEADER) {
            continue;
        }
        if let Ok(v) = v.to_str() {
            hdrs.insert(name.to_string(), v.to_string());
        }
    }
    let tags = headers
        .get("x-kiln-tags")
        .and_then(|v| v.to_str().ok())
        .map(|s| {
            s.split(',')
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let session = headers
        .get("x-kiln-session")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let arrived = Arrived {
        received,
        received_ms,
        tenant,
        headers: hdrs,
        tags,
        session,
        window: None,
    };
    decide_and_serve(app, endpoint, greq, raw, big, arrived).await
}

/// The header a batch item carries (its batch id); classify rules read it
/// as the `batch` signal or `header("x-kiln-batch")`.
pub use crate::graph::BATCH_HEADER;

/// Who sent a request and what came with it, past authentication.
struct Arrived {
    received: Instant,
    received_ms: f64,
    tenant: Option<String>,
    headers: BTreeMap<String, String>,
    tags: Vec<String>,
    session: Option<String>,
    /// A batch item's deadline: what is left of its batch's window.
    window: Option<crate::sched::Micros>,
}

/// One batch item, decided and served like any request of its tenant: the
/// same classify, admission, routing, queues, log and explain. The answer
/// is never a stream; the runner stores its status and body.
pub async fn serve_batch_item(
    app: Arc<App>,
    endpoint: Endpoint,
    tenant: Option<String>,
    batch: &str,
    body: Value,
    window: crate::sched::Micros,
) -> Response {
    let received = Instant::now();
    let received_ms = crate::clock::unix_ms();
    let greq = match GenerationRequest::from_value(endpoint, &body) {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    let arrived = Arrived {
        received,
        received_ms,
        tenant,
        headers: BTreeMap::from([(BATCH_HEADER.to_string(), batch.to_string())]),
        tags: vec!["batch".to_string()],
        session: None,
        window: Some(window),
    };
    let big = false;
    match decide_and_serve(app, endpoint, greq, body, big, arrived).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn decide_and_serve(
    app: Arc<App>,
    endpoint: Endpoint,
    greq: GenerationRequest,
    raw: Value,
    big: bool,
    arrived: Arrived,
) -> Result<Response, ApiError> {
    let Arrived {
        received,
        received_ms,
        tenant,
        headers: hdrs,
        tags,
        session,
        window,
    } = arrived;
    let policy = app.policy.load_full();
    // Counting a large prompt takes milliseconds: on a blocking thread, so
    // that a few large prompts do not stall every other request (and the
    // health checks) on the async workers.
    // The same pass hashes the prompt's leading tokens into prefix blocks
    // (for the prefix cache and prefix-affinity routing, and the log).
    let blocks = super::prefix::MAX_PREFIX_BLOCKS;
    let (greq, prompt) = if big {
        let tok = app.tokenizer;
        tokio::task::spawn_blocking(move || {
            let n = tok.prompt(&greq, blocks);
            (greq, n)
        })
        .await
        .map_err(|e| ApiError::new(500, format!("counting prompt tokens failed: {e}")))?
    } else {
        let n = app.tokenizer.prompt(&greq, blocks);
        (greq, n)
    };
    let prompt_tokens = prompt.count;
    let max_tokens = greq
        .requested_max_tokens()
        .unwrap_or(app.config.limits.default_max_tokens);
    let req = Request {
        tenant,
        api_key: None,
        model: greq.model.clone(),
        headers: hdrs,
        tags,
        session,
        prompt_tokens,
        max_tokens,
    };
    // Incident controls: a paused or throttled tenant is refused here.
    if let Some(r) = app.gov.check_override(Scope::Tenant, req.tenant.as_deref()) {
        app.metrics.override_refusal(
            r.action.name(),
            "tenant",
            req.tenant.as_deref().unwrap_or("none"),
        );
        return Err(override_error(&app, &r));
    }
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let rid = format!("{:x}-{id}", app.boot_ms);
    let store = if window.is_some() {
        &app.explain_batch
    } else {
        &app.explain
    };
    let explain = store.insert(explain::Entry {
        id: rid.clone(),
        endpoint: endpoint.path(),
        received_unix_ms: received_ms,
        request: recorded_request(&req, &[&policy.graph]),
        version: None,
        graph: None,
        signals: None,
        events: Vec::new(),
        outcome: None,
        replica: None,
        clock: explain::ClockTimes::default(),
    });
    let cache_content = super::cache::content(&policy.graph, &raw);
    let semantic_probe =
        super::cache::probe(&app, &policy.graph, &raw, endpoint, cache_content.is_some()).await;
    let ctx = Ctx {
        cache_content,
        semantic_probe,
        app: app.clone(),
        endpoint,
        id,
        rid,
        req,
        body: raw,
        client_model: greq.model.clone(),
        stream: greq.streaming(),
        include_usage: greq.include_usage(),
        received,
        received_ms,
        explain,
        requeued: 0,
        prefix_blocks: prompt.prefix_blocks,
        window,
        claim: None,
    };
    // Every refusal from here on names the request, its explain entry and
    // the version that decided it.
    let (rid, entry) = (ctx.rid.clone(), ctx.explain.clone());
    admit_and_run(app, ctx, max_tokens, prompt_tokens)
        .await
        .map_err(|e| {
            let ms = received.elapsed().as_secs_f64() * 1000.0;
            super::surface::explain_recorded(e, &rid, &entry, ms, &policy.version)
        })
}

/// The fleet's claim (where there is a fleet), then [`run`].
async fn admit_and_run(
    app: Arc<App>,
    mut ctx: Ctx,
    max_tokens: u64,
    prompt_tokens: u64,
) -> Result<Response, ApiError> {
    // Where no backend passes fields through, a field none can honour is
    // refused before the request waits in a queue.
    if !app.backends.iter().any(|b| matches!(b, Backend::Http(_))) {
        let name = app
            .backends
            .first()
            .map_or_else(|| "sim".to_string(), Backend::name);
        if let Some(err) = super::surface::unsupported_field(ctx.endpoint, &ctx.body, &name) {
            finish_refused(&ctx, None, "unsupported_parameter", &err);
            return Err(err);
        }
    }
    if let Some(fleet) = app.fleet.clone() {
        // A client that leaves while the fleet's store is consulted is
        // recorded as cancelled, like one that leaves while queued.
        let mut left = LeftWhileQueued {
            ctx: &ctx,
            decided: None,
            armed: true,
        };
        fleet.wait_for_version().await;
        let need = prompt_tokens as f64 + max_tokens as f64;
        let gate = fleet
            .claim(
                &app.policy.load().graph,
                &ctx.req,
                &ctx.rid,
                need,
                prompt_tokens as f64,
            )
            .await;
        left.armed = false;
        drop(left);
        match gate {
            super::fleet::Gate::Claimed(c) => ctx.claim = Some(c),
            super::fleet::Gate::Free => {}
            super::fleet::Gate::Refused { limit, retry_ms } => {
                let reason = if limit == "concurrency" {
                    Reason::Concurrency
                } else {
                    Reason::Quota
                };
                let tenant = ctx.req.tenant.as_deref().unwrap_or("none");
                let msg = match reason {
                    Reason::Concurrency => format!(
                        "tenant {tenant} has as many requests in flight as its quota allows (counted over every replica)"
                    ),
                    _ => format!(
                        "tenant {tenant} is over its {limit} quota (counted over every replica)"
                    ),
                };
                let secs = ((retry_ms as f64 / 1000.0 / app.speed).ceil() as u64).max(1);
                let err = ApiError::new(429, msg)
                    .code(reason.name())
                    .retry_after(Some(secs));
                finish_rejected(&ctx, None, reason, &err);
                return Err(err);
            }
            super::fleet::Gate::Unavailable => match fleet.on_unavailable {
                super::config::OnUnavailable::Local => app.metrics.shared_unclaimed("local"),
                super::config::OnUnavailable::Refuse => {
                    app.metrics.shared_unclaimed("refused");
                    let err = ApiError::new(
                        503,
                        "the gateway's shared state (Redis) is unreachable and this fleet refuses requests until it answers (`[state] on_unavailable = \"refuse\"`)",
                    )
                    .code(Reason::SharedState.name())
                    .retry_after(Some(1));
                    finish_rejected(&ctx, None, Reason::SharedState, &err);
                    return Err(err);
                }
            },
        }
    }
    run(ctx, max_tokens).await
}

/// Submits (and, after a policy swap that removed its tier, re-submits)
/// until the request starts or is refused, then serves it on the backend
/// it started on.
///
/// On an HTTP upstream the request may go back to the queue: when no
/// upstream received it, and (`limits.upstream_retries` times) when one
/// failed before any byte reached the client while another is ready.
/// From its first start on an upstream, everything (calls, retries, the
/// waits in the queue between them) ends within `limits.upstream_budget`.
async fn run(mut ctx: Ctx, max_tokens: u64) -> Result<Response, ApiError> {
    let app = ctx.app.clone();
    let limits = &app.config.limits;
    let mut redecided = 0u32;
    let mut resent = 0u32;
    let mut retried = 0u32;
    // Set at the first start on an upstream; the error to answer if the
    // budget runs out while the request waits for another replica.
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut last_error: Option<ApiError> = None;
    // A request preempted off an upstream is still the scheduler's (queued
    // again, or refused per its tier's `on_preempt`): it is not submitted
    // again, its progress is followed on the same channel.
    let mut preempted: Option<(mpsc::UnboundedReceiver<Progress>, CancelGuard, Decided)> = None;
    loop {
        let (rx, guard, decided) = match preempted.take() {
            Some((rx, guard, d)) => (rx, guard, Some(d)),
            None => {
                let (rx, guard) = submit(&ctx, max_tokens)?;
                (rx, guard, None)
            }
        };
        let may_redecide = redecided < limits.max_redecide;
        let waited = match deadline {
            None => wait_for_start(&ctx, rx, guard, may_redecide, decided).await?,
            Some(at) => {
                let wait = wait_for_start(&ctx, rx, guard, may_redecide, decided);
                match tokio::time::timeout_at(at, wait).await {
                    Ok(waited) => waited?,
                    // Dropping the wait cancels the request in the scheduler.
                    Err(_) => {
                        let err = last_error
                            .take()
                            .unwrap_or_else(|| budget_error(&ctx.rid, limits.upstream_budget));
                        explain::note(
                            &ctx.explain,
                            ctx.ms(),
                            "the upstream budget ran out while it waited for another replica",
                            Some(Reason::Timeout.name()),
                        );
                        finish_rejected(&ctx, None, Reason::Timeout, &err);
                        return Err(err);
                    }
                }
            }
        };
        let (started, backend, rx, guard) = match waited {
            Waited::CacheHit {
                d,
                key,
                payload,
                similarity,
            } => {
                return Ok(super::cache::serve_hit(&ctx, d, &key, payload, similarity));
            }
            Waited::Started {
                started,
                backend,
                rx,
                guard,
            } => (started, backend, rx, guard),
            Waited::PolicyChanged => {
                redecided += 1;
                explain::note(
                    &ctx.explain,
                    ctx.ms(),
                    "re-decided under the new policy version",
                    Some(Reason::PolicyChanged.name()),
                );
                continue;
            }
        };
        // The replica may serve a declared substitute: the upstream is asked
        // for the model it serves, and the body reports what the policy says.
        let sub = served_substitution(&ctx, &started);
        let served_model = started
            .route
            .split_once('.')
            .map_or(ctx.req.model.as_str(), |(m, _)| m)
            .to_string();
        if let Some(o) = ctx.body.as_object_mut() {
            if o.get("model").and_then(Value::as_str) != Some(served_model.as_str()) {
                o.insert("model".into(), Value::String(served_model.clone()));
            }
        }
        if let Some(x) = &sub {
            explain::note(
                &ctx.explain,
                ctx.ms(),
                format!(
                    "substituted: `{}` serves this request for `{}` (served_by); the response's `model` is `{}`",
                    x.served,
                    x.asked,
                    match x.response_model {
                        ResponseModel::Served => &x.served,
                        ResponseModel::Requested => &x.asked,
                    }
                ),
                None,
            );
        }
        ctx.client_model = match &sub {
            Some(s) if s.response_model == ResponseModel::Served => s.served.clone(),
            _ => ctx.req.model.clone(),
        };
        match backend {
            Backend::Sim | Backend::Cuda(_) => {
                let name = backend.name();
                // Decided and routed here: a field this backend cannot
                // honour is refused (an HTTP upstream would get it as sent).
                if let Some(err) = super::surface::unsupported_field(ctx.endpoint, &ctx.body, &name)
                {
                    finish_refused(&ctx, Some(&started.d), "unsupported_parameter", &err);
                    return Err(err);
                }
                return Ok(serve_scheduled(ctx, guard, rx, started, &name).await);
            }
            Backend::Http(u) => {
                let at = *deadline
                    .get_or_insert_with(|| tokio::time::Instant::now() + limits.upstream_budget);
                ctx.requeued = resent + retried;
                let attempt = Attempt {
                    may_resend: resent < RESEND_UNSENT,
                    may_retry: retried < limits.upstream_retries,
                    deadline: at,
                    budget: limits.upstream_budget,
                };
                let (back, err, what) = match serve_upstream(ctx, guard, rx, started, u, attempt)
                    .await
                {
                    Ok(r) => return Ok(r),
                    Err(HttpFail::Fatal(e)) => return Err(e),
                    Err(HttpFail::Preempted(p)) => {
                        let p = *p;
                        ctx = p.ctx;
                        explain::note(
                            &ctx.explain,
                            ctx.ms(),
                            format!(
                                "preempted by request {} on the upstream: its call there was cancelled; the scheduler holds it again",
                                p.by
                            ),
                            Some(Reason::Preempted.name()),
                        );
                        preempted = Some((p.rx, p.guard, p.started.d));
                        continue;
                    }
                    Err(HttpFail::Unsent(back, err)) => {
                        resent += 1;
                        (back, err, "the upstream never received it; queued again")
                    }
                    Err(HttpFail::Failed(back, err)) => {
                        retried += 1;
                        (
                            back,
                            err,
                            "the upstream failed before answering; queued again for another replica",
                        )
                    }
                };
                ctx = *back;
                app.exec.send(Command::CheckHealth);
                // Back off (exponentially, with jitter) before queueing it
                // again, within its budget.
                let pause = crate::backend::http::retry_backoff(resent + retried, ctx.id);
                tokio::time::sleep_until((tokio::time::Instant::now() + pause).min(at)).await;
                explain::note(
                    &ctx.explain,
                    ctx.ms(),
                    format!("{what} ({} {})", err.status, err.message),
                    Some(Reason::Saturation.name()),
                );
                last_error = Some(err);
            }
        }
    }
}

/// Hands the request to the scheduler; its progress comes back on the
/// channel, and the guard cancels it there if the handler goes away.
fn submit(
    ctx: &Ctx,
    max_tokens: u64,
) -> Result<(mpsc::UnboundedReceiver<Progress>, CancelGuard), ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let arrival = Arrival {
        window: ctx.window,
        id: ctx.id,
        request: ctx.req.clone(),
        output_tokens: max_tokens.min(u64::from(u32::MAX)) as u32,
        prefix_blocks: ctx.prefix_blocks.clone(),
        quota_claimed: ctx.claim.as_ref().is_some_and(|c| !c.is_done()),
        cache: ctx.cache_content,
        semantic: ctx.semantic_probe.probe(),
    };
    let mut guard = CancelGuard {
        id: ctx.id,
        app: ctx.app.clone(),
        armed: true,
    };
    if !ctx.app.exec.send(Command::Submit {
        arrival,
        events: tx,
        claim: ctx.claim.clone(),
    }) {
        guard.armed = false;
        return Err(ApiError::new(503, "the gateway is shutting down").retry_after(Some(1)));
    }
    Ok((rx, guard))
}

/// How waiting in the scheduler ended, short of a refusal.
enum Waited {
    Started {
        started: Started,
        backend: Backend,
        rx: mpsc::UnboundedReceiver<Progress>,
        guard: CancelGuard,
    },
    /// A policy swap removed what it was decided for: decide it again
    /// (when `may_redecide`; otherwise that is a refusal like any other).
    PolicyChanged,
    /// Answered from its tier's exact or semantic cache.
    CacheHit {
        d: Decided,
        key: crate::sched::cache::Key,
        payload: Option<Arc<str>>,
        similarity: Option<f32>,
    },
}

/// Logs and explains a request whose client went away while it waited in
/// the scheduler: the handler (and this guard with it) is dropped
/// mid-wait. Disarmed once waiting ends any other way.
struct LeftWhileQueued<'a> {
    ctx: &'a Ctx,
    decided: Option<Decided>,
    armed: bool,
}

impl Drop for LeftWhileQueued<'_> {
    fn drop(&mut self) {
        if self.armed {
            finish_left(self.ctx, self.decided.as_ref());
        }
    }
}

fn finish_left(ctx: &Ctx, d: Option<&Decided>) {
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
    // Counted like every other end (`kiln_requests_total{outcome="cancelled"}`):
    // no pool served it, and no tokens or GPU time were used.
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

/// Follows the request through the scheduler until it starts on a replica
/// (or is refused, or must be decided again).
async fn wait_for_start(
    ctx: &Ctx,
    rx: mpsc::UnboundedReceiver<Progress>,
    guard: CancelGuard,
    may_redecide: bool,
    decided: Option<Decided>,
) -> Result<Waited, ApiError> {
    let mut left = LeftWhileQueued {
        ctx,
        decided,
        armed: true,
    };
    let r = wait_inner(ctx, rx, guard, may_redecide, &mut left.decided).await;
    left.armed = false;
    r
}

async fn wait_inner(
    ctx: &Ctx,
    mut rx: mpsc::UnboundedReceiver<Progress>,
    mut guard: CancelGuard,
    may_redecide: bool,
    decided: &mut Option<Decided>,
) -> Result<Waited, ApiError> {
    let mut preempted = 0u32;
    loop {
        let Some(p) = rx.recv().await else {
            guard.armed = false;
            return Err(ApiError::new(503, "the scheduler stopped").retry_after(Some(1)));
        };
        match p {
            Progress::Decided {
                tier,
                tenant,
                fallback_step,
                version,
                graph,
                signals,
                canary,
                at,
            } => {
                explain::clock(&ctx.explain, |c| c.arrived_us = Some(at));
                let (dversion, pgraph, psignals) = match &canary {
                    Some(c) => (c.version.clone(), c.graph.clone(), c.signals.clone()),
                    None => (version, graph.clone(), signals),
                };
                let d = Decided {
                    tier,
                    tenant,
                    fallback_step,
                    version: dversion,
                    graph,
                    policy_graph: pgraph,
                    policy_signals: psignals,
                    canary: canary.is_some(),
                    cache: None,
                };
                // An override refusal returns here; the guard cancels the
                // request in the scheduler.
                note_decided(ctx, &d)?;
                *decided = Some(d);
            }
            Progress::Rejected {
                reason: Reason::PolicyChanged,
                ..
            } if may_redecide => {
                guard.armed = false;
                return Ok(Waited::PolicyChanged);
            }
            Progress::Rejected {
                reason,
                status,
                retry_after,
            } => {
                guard.armed = false;
                let err = refusal(ctx, decided.as_ref(), reason, status, retry_after);
                finish_rejected(ctx, decided.as_ref(), reason, &err);
                return Err(err);
            }
            Progress::Preempted { by } => {
                preempted += 1;
                explain::note(
                    &ctx.explain,
                    ctx.ms(),
                    format!("preempted by request {by}; queued again at the head"),
                    Some(Reason::Preempted.name()),
                );
            }
            Progress::Started {
                replica,
                route,
                backend,
                waited_for,
                at,
            } => {
                explain::clock(&ctx.explain, |c| c.started_us = Some(at));
                let Some(d) = decided.take() else {
                    guard.armed = false;
                    return Err(ApiError::new(500, "started before a decision"));
                };
                explain::note(
                    &ctx.explain,
                    ctx.ms(),
                    format!("started on replica {replica} ({route})"),
                    waited_for.map(Reason::name),
                );
                if let Ok(mut e) = ctx.explain.lock() {
                    e.replica = Some(route.clone());
                }
                let started = Started {
                    d,
                    route,
                    waited_for,
                    queue_s: ctx.received.elapsed().as_secs_f64(),
                    preempted,
                };
                return Ok(Waited::Started {
                    started,
                    backend,
                    rx,
                    guard,
                });
            }
            Progress::CacheMiss { key } => {
                if let Some(d) = decided.as_mut() {
                    d.cache = Some(key);
                    super::cache::missed(ctx, d);
                }
            }
            Progress::CacheHit {
                key,
                payload,
                similarity,
            } => {
                guard.armed = false;
                let Some(d) = decided.take() else {
                    return Err(ApiError::new(500, "answered before a decision"));
                };
                return Ok(Waited::CacheHit {
                    d,
                    key,
                    payload,
                    similarity,
                });
            }
            Progress::Tokens { .. } | Progress::FirstToken | Progress::Finished { .. } => {}
        }
    }
}

/// What a decision means before the request starts: explain records the
/// version that decided, a canary or shadow version counts it, and an
/// operator's override on its tier refuses it.
fn note_decided(ctx: &Ctx, d: &Decided) -> Result<(), ApiError> {
    let app = &ctx.app;
    let recorded = recorded_headers(&ctx.req.headers, &[&d.graph, &d.policy_graph]);
    if let Ok(mut e) = ctx.explain.lock() {
        e.version = Some(d.version.clone());
        e.graph = Some(d.policy_graph.clone());
        e.signals = Some(d.policy_signals.clone());
        e.request.headers = recorded;
    }
    let tname = d
        .graph
        .tiers
        .get(d.tier as usize)
        .map(|t| t.name.as_str())
        .unwrap_or("?");
    if d.canary {
        app.gov.count_canary();
        app.metrics.canary_request(&d.version);
        explain::note(
            &ctx.explain,
            ctx.ms(),
            format!("decided by the canary version {}", d.version),
            None,
        );
    } else if let Some(sh) = app.gov.shadow() {
        // Without a canary the deciding version and signals are the
        // active ones.
        let differ = crate::governance::shadow::shadow_compare(
            &sh,
            &d.version,
            &ctx.req,
            &d.graph,
            &d.policy_signals,
        );
        if let Some(fields) = differ {
            app.metrics.shadow(&sh.version, &fields);
        }
    }
    // Incident controls: a paused or throttled tier.
    if let Some(r) = app.gov.check_override(Scope::Tier, Some(tname)) {
        app.metrics.override_refusal(r.action.name(), "tier", tname);
        explain::note(
            &ctx.explain,
            ctx.ms(),
            format!("refused with {}: {}", r.status, r.message),
            Some(r.code),
        );
        if let Ok(mut e) = ctx.explain.lock() {
            e.outcome = Some(format!("refused by an override {}", r.status));
        }
        return Err(override_error(app, &r));
    }
    explain::note(
        &ctx.explain,
        ctx.ms(),
        format!("decided: tier {tname}"),
        None,
    );
    if let Some(step) = d.fallback_step {
        let tn = tenant_name(&d.graph, d.tenant);
        app.metrics.fallback(tname, &tn, step.saturating_add(1));
    }
    Ok(())
}

pub(super) struct Started {
    pub(super) d: Decided,
    pub(super) route: String,
    pub(super) waited_for: Option<Reason>,
    pub(super) queue_s: f64,
    pub(super) preempted: u32,
}

pub(super) fn tenant_name(g: &DecisionGraph, t: Option<TenantId>) -> String {
    t.and_then(|t| g.tenants.get(t as usize))
        .map(|t| t.name.clone())
        .unwrap_or_else(|| "none".into())
}

/// The answer to a request an operator's override refuses.
fn override_error(app: &App, r: &crate::governance::overrides::Refused) -> ApiError {
    let secs = ((r.retry_after_ms / 1000.0 / app.speed).ceil() as u64).max(1);
    ApiError::new(r.status, r.message.clone())
        .code(r.code)
        .retry_after(Some(secs))
}

/// One finished request for the rollback conditions' live metrics.
pub(super) fn record_live(
    ctx: &Ctx,
    d: Option<&Decided>,
    ttft_s: Option<f64>,
    e2e_s: f64,
    error: bool,
    served: bool,
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
    });
}

fn secs_ceil(app: &App, micros: crate::sched::Micros) -> u64 {
    ((micros as f64 / SEC as f64 / app.speed).ceil() as u64).max(1)
}

/// The error a refusal answers with, in the policy's words where it has
/// them.
fn refusal(
    ctx: &Ctx,
    d: Option<&Decided>,
    reason: Reason,
    status: u16,
    retry_after: Option<crate::sched::Micros>,
) -> ApiError {
    let app = &ctx.app;
    let (tier, tenant) = decided_names(d);
    let mut route: Option<(String, Option<String>)> = None;
    let (policy_msg, policy_reason) = d.map_or((None, None), |d| {
        let g = &d.policy_graph;
        let dec = g.decide(&ctx.req, &d.policy_signals);
        route = dec.target.map(|t| {
            let pool = t
                .pool
                .and_then(|p| g.pools.get(p as usize))
                .map(|p| p.name.clone());
            (g.variant_name(t.model, t.variant), pool)
        });
        let v = g.view(&dec);
        (v.message, v.reason)
    });
    // No capacity refusal is a 429 when the route's upstreams are all down:
    // that is an outage, and its wait estimate is unbounded (it was
    // answered `429 overload` with Retry-After 2^62 µs).
    let capacity = matches!(
        reason,
        Reason::Overload
            | Reason::Fairness
            | Reason::Deadline
            | Reason::Saturation
            | Reason::Gang
            | Reason::Timeout
    ) && matches!(status, 429 | 503);
    if let (true, Some((variant, pool))) = (capacity, &route) {
        if let Some(secs) = outage_retry(app, variant, pool.as_deref()) {
            return ApiError::new(
                503,
                format!(
                    "every upstream serving `{variant}` is down (its circuit breakers are open); the first may take requests again in about {secs} s"
                ),
            )
            .code("upstream_unavailable")
            .retry_after(Some(secs));
        }
    }
    let not_allowed = policy_reason.as_deref() == Some("model-not-allowed");
    let msg = match reason {
        // Not found (or not for this tier): which model was asked for, and
        // which this tenant may use.
        Reason::Policy if status == 404 || not_allowed => {
            let tenant = ctx.req.tenant.as_deref().unwrap_or("none");
            let g = d.map_or_else(|| app.policy.load().graph.clone(), |d| d.graph.clone());
            let usable = super::surface::usable_models(&g, ctx.req.tenant.as_deref());
            format!(
                "{}: the model `{}` does not exist or tier `{tier}` may not use it; models available to tenant {tenant}: {} (GET /v1/models lists them)",
                policy_msg.unwrap_or_else(|| "not found".into()),
                ctx.client_model.chars().take(100).collect::<String>(),
                super::surface::list_or_none(&usable),
            )
        }
        Reason::Policy => policy_msg.unwrap_or_else(|| "the policy refused this request".into()),
        Reason::Quota => format!("tenant {tenant} is over its token or request quota"),
        Reason::TierQuota => format!(
            "tier {tier} is over its quota (tokens, requests, concurrent requests or GPU-seconds its requests share)"
        ),
        Reason::ModelQuota => format!(
            "model `{}` is over its quota (tokens, requests, concurrent requests or GPU-seconds its requests share)",
            ctx.client_model
        ),
        Reason::Concurrency => format!("tenant {tenant} has as many requests in flight as its quota allows"),
        Reason::Overload => format!("the estimated wait exceeds tier {tier}'s time-to-first-token SLO; retry later"),
        Reason::Deadline => format!("tier {tier}'s completion window cannot be met at the current backlog"),
        Reason::Infeasible => format!(
            "the prompt's prefill alone takes longer than tier {tier}'s time-to-first-token SLO, even on an idle replica: shorten the prompt or use a tier with a longer SLO"
        ),
        Reason::Held => format!("tier {tier}'s work is held by the policy and its queue bound passed; retry later"),
        Reason::Saturation if status == 413 => {
            "the prompt plus max_tokens is larger than any replica of the routed model can hold".into()
        }
        Reason::Saturation | Reason::Gang => "no replica can serve this route now".into(),
        Reason::Timeout => format!(
            "waited longer than its queue bound (tier {tier}'s `queue max_wait`, or `[limits] default_queue_bound` where the policy sets none)"
        ),
        Reason::RetryBudget => format!("tenant {tenant} has spent its retry budget"),
        Reason::SessionBudget => "this agent session has used all the steps its tenant allows".into(),
        Reason::PolicyChanged => "the policy changed while this request waited; retry".into(),
        Reason::Preempted => format!(
            "preempted to make room for a higher tier; tier {tier} declares `on_preempt reject`: retry later"
        ),
        other => format!("refused: {}", other.name()),
    };
    let retry = match (status, retry_after) {
        // A wait estimate is a guess: never one past the hour.
        (429 | 503, Some(r)) if capacity => Some(secs_ceil(app, r).min(MAX_CAPACITY_RETRY_S)),
        (429 | 503, Some(r)) => Some(secs_ceil(app, r)),
        (429 | 503, None) => Some(1),
        _ => None,
    };
    // The policy's own reason where it gives one (`model-not-allowed`,
    // `pool-fenced`), as a code.
    let code = match (status, reason, policy_reason) {
        (404, _, _) => "model_not_found".to_string(),
        (_, Reason::Policy, Some(r)) => r.replace('-', "_"),
        _ => reason.name().to_string(),
    };
    ApiError::new(status, msg).code(code).retry_after(retry)
}

/// The longest Retry-After an outage answers with: a breaker reopens (for
/// its trial) within its `open_for`, but an upstream's own Retry-After may
/// hold it open longer; clients should look again within a minute.
const MAX_OUTAGE_RETRY_S: u64 = 60;

/// The longest Retry-After of a capacity refusal (`overload`, `fairness`,
/// …), whose estimate may be unbounded.
const MAX_CAPACITY_RETRY_S: u64 = 3600;

/// When the route (`model.variant`, on `pool` if it names one) is served
/// by HTTP upstreams and every one is down (breaker open, or its half-open
/// trial taken): the seconds until the first may take a request again,
/// from 1 to [`MAX_OUTAGE_RETRY_S`]. `None` when one is ready, or when no
/// upstream serves the route (a simulated or GPU replica does).
fn outage_retry(app: &App, variant: &str, pool: Option<&str>) -> Option<u64> {
    use crate::backend::http::BreakerState;
    let now = std::time::Instant::now();
    let mut earliest: Option<std::time::Duration> = None;
    for b in app.backends.iter() {
        let Backend::Http(u) = b else { continue };
        // Named `pool/model.variant#i` by the deployment.
        let Some((p, rest)) = u.name().split_once('/') else {
            continue;
        };
        let Some((mv, _)) = rest.rsplit_once('#') else {
            continue;
        };
        if mv != variant || pool.is_some_and(|want| want != p) {
            continue;
        }
        if u.ready() {
            return None;
        }
        let wait = match u.state() {
            BreakerState::Open { until } => until.saturating_duration_since(now),
            _ => std::time::Duration::ZERO,
        };
        earliest = Some(earliest.map_or(wait, |e| e.min(wait)));
    }
    earliest.map(|w| (w.as_secs_f64().ceil() as u64).clamp(1, MAX_OUTAGE_RETRY_S))
}

/// The tier and tenant a decision named (`none` where it named none).
fn decided_names(d: Option<&Decided>) -> (String, String) {
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

fn finish_rejected(ctx: &Ctx, d: Option<&Decided>, reason: Reason, err: &ApiError) {
    finish_refused(ctx, d, reason.name(), err);
}

/// [`finish_rejected`] for a refusal with a reason the scheduler does not
/// name (`unsupported_parameter`).
fn finish_refused(ctx: &Ctx, d: Option<&Decided>, reason: &str, err: &ApiError) {
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
    record_live(
        ctx,
        d,
        None,
        ctx.received.elapsed().as_secs_f64(),
        err.status >= 500,
        false,
    );
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

pub(super) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(super) fn base_record(ctx: &Ctx, d: Option<&Decided>) -> Record {
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
pub(super) fn finish_served(
    ctx: &Ctx,
    s: &Started,
    output_tokens: u64,
    ttft_s: Option<f64>,
    outcome: MetricOutcome,
    gpu_seconds: f64,
    status: Option<u16>,
) {
    let app = &ctx.app;
    let g = &s.d.graph;
    let tier = g
        .tiers
        .get(s.d.tier as usize)
        .map(|t| t.name.as_str())
        .unwrap_or("?");
    let tenant = tenant_name(g, s.d.tenant);
    let (pool, model) = s
        .route
        .split_once(" on ")
        .map_or((s.route.as_str(), ""), |(m, p)| (p, m));
    let labels = Labels {
        tier,
        tenant: &tenant,
        pool,
        model,
    };
    let e2e = ctx.received.elapsed().as_secs_f64();
    app.metrics.request_done(&labels, outcome);
    app.metrics.queue_wait(&labels, s.queue_s);
    if let Some(t) = ttft_s {
        app.metrics.ttft(&labels, t);
    }
    app.metrics.e2e(&labels, e2e);
    app.metrics
        .tokens(&labels, ctx.req.prompt_tokens, output_tokens);
    let cost_per_h =
        s.d.tenant
            .and_then(|t| g.tenants.get(t as usize))
            .and_then(|t| t.cost_per_gpu_hour)
            .unwrap_or(0.0);
    let cost = gpu_seconds / 3600.0 * cost_per_h;
    app.metrics.gpu_seconds(&labels, gpu_seconds, cost);
    app.costs.charge(
        [tier, &tenant, pool, model],
        ctx.req.headers.get(BATCH_HEADER).map(String::as_str),
        gpu_seconds,
        cost,
    );
    for _ in 0..s.preempted {
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
        rec.cache_key = ctx.cache_content.as_ref().map(super::cache::hex);
        let sub = served_substitution(ctx, s);
        if let Some(dec) = rec.decision.as_mut() {
            dec.route = Some(s.route.clone());
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
        record_live(ctx, Some(&s.d), ttft_s, e2e, error, true);
    }
}

/// A request served by another model than the one it asked for.
pub(super) struct Served {
    pub(super) asked: String,
    pub(super) served: String,
    pub(super) response_model: ResponseModel,
}

/// When the replica a request started on serves another model than the
/// one it asked for (a declared `served_by` substitution), which, and how
/// the response reports it (the deciding version's declaration; the
/// served model when none is found, which is what ran).
pub(super) fn served_substitution(ctx: &Ctx, s: &Started) -> Option<Served> {
    let served = s.route.split_once('.').map(|(m, _)| m)?;
    let asked = ctx.req.model.as_str();
    if served == asked {
        return None;
    }
    let tier =
        s.d.graph
            .tiers
            .get(s.d.tier as usize)
            .map(|t| t.name.as_str());
    let declared = [&s.d.policy_graph, &s.d.graph].into_iter().find_map(|g| {
        let t = g.tier_id(tier?)?;
        g.substitution(g.model_id(asked)?, g.model_id(served)?, t)
            .map(|x| x.response_model)
    });
    Some(Served {
        asked: asked.to_string(),
        served: served.to_string(),
        response_model: declared.unwrap_or_default(),
    })
}

pub(super) fn kiln_headers(ctx: &Ctx, s: &Started, backend: &str) -> Vec<(&'static str, String)> {
    let g = &s.d.graph;
    let sub = served_substitution(ctx, s);
    let route = match &sub {
        Some(x) => format!("{} (substituted for {})", s.route, x.asked),
        None => s.route.clone(),
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
    h.extend(super::cache::miss_headers(ctx, &s.d));
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

pub(super) fn with_headers(mut resp: Response, h: Vec<(&'static str, String)>) -> Response {
    for (k, v) in h {
        if let Ok(v) = HeaderValue::from_str(&v) {
            resp.headers_mut().insert(k, v);
        }
    }
    resp
}
