//! What operators see and do: `/metrics`, `/healthz`, `/readyz`,
//! `/admin/explain/{id}`, `/admin/queues`, and `POST /admin/policy`, the
//! atomic hot swap (an adapter to [`super::activation`]: compile, validate,
//! swap in the executor between two events, then publish; on any failure
//! the diagnostics and the old policy stays).

use super::openai::ApiError;
use super::App;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/admin/explain/{id}", get(explain))
        .route("/admin/queues", get(queues))
        .route("/admin/replicas", get(replicas))
        .route("/admin/costs", get(costs))
        .route("/admin/signals", get(signals))
        .route("/admin/policy", post(swap_policy).get(show_policy))
        .route("/admin/keys", get(list_keys).post(add_key))
        .route("/admin/keys/{name}", axum::routing::delete(revoke_key))
        .route("/admin/keys/reload", post(reload_keys))
        .with_state(app)
}

/// Admin calls carry `Authorization: Bearer TOKEN` whose SHA-256 the
/// config lists; with no tokens configured they are open on loopback only.
pub fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    identify(app, headers).map(|_| ())
}

/// Who an admin call comes from: the token's name (`admin` for tokens in
/// `token_sha256`), or `loopback` when admin is open without tokens.
pub fn identify(app: &App, headers: &HeaderMap) -> Result<String, ApiError> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().strip_prefix("Bearer ").map(str::trim));
    match token {
        Some(t) => match app.auth.load().admin_identity(t) {
            Some(name) => Ok(name),
            None => Err(ApiError::new(403, "this admin token is not valid").code("forbidden")),
        },
        // Open on loopback while no tokens are configured (a reload that
        // adds tokens closes it).
        None if app.admin_open && !app.auth.load().has_admin_tokens() => Ok("loopback".into()),
        None => Err(ApiError::new(
            401,
            "admin endpoints need `Authorization: Bearer ADMIN-TOKEN` (see [admin] in kiln.toml)",
        )
        .code("unauthorized")),
    }
}

/// `GET /admin/keys`: the API keys in use (labels, tenants, hash prefixes,
/// expiry; never a key or its whole hash).
async fn list_keys(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    axum::Json(json!({ "keys": super::keys::list(&app) })).into_response()
}

/// A key operation's refusal, as the admin API answers it.
fn key_refusal(e: &super::keys::KeyOpError) -> Response {
    let (status, code) = e.status();
    let mut r = ApiError::new(status, format!("{e} (help: {})", e.help())).code(code);
    if status == 503 {
        r = r.retry_after(Some(1));
    }
    r.into_response()
}

/// `POST /admin/keys` `{"name", "tenant", "description"?, "expires"?,
/// "expires_in"?}`: makes a key and answers it once (201). Kept in the
/// fleet's store in a fleet, else in the gateway's `kiln.toml`.
async fn add_key(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let who = match identify(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req: super::keys::AddKey = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return key_refusal(&super::keys::KeyOpError::Invalid(format!(
                "the body is not a key to add: {e}"
            )))
        }
    };
    match super::keys::add(&app, &who, req).await {
        Ok(a) => (StatusCode::CREATED, axum::Json(json!({ "added": a }))).into_response(),
        Err(e) => key_refusal(&e),
    }
}

/// `DELETE /admin/keys/{name}`: revokes a key (in a fleet, through every
/// replica; a key of `kiln.toml` too).
async fn revoke_key(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    let who = match identify(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    match super::keys::revoke(&app, &who, &name).await {
        Ok(r) => axum::Json(json!({ "revoked": r })).into_response(),
        Err(e) => key_refusal(&e),
    }
}

/// `POST /admin/keys/reload`: reloads keys and admin tokens from the
/// config file (as SIGHUP does); a bad file is refused (422) and the keys
/// in use stay.
async fn reload_keys(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let who = match identify(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    match super::keys::reload(&app, &who).await {
        Ok(r) => axum::Json(json!({ "reloaded": r })).into_response(),
        Err(e) => {
            let help = miette::Diagnostic::help(&e)
                .map(|h| format!(" (help: {h})"))
                .unwrap_or_default();
            ApiError::new(
                422,
                format!("keys not reloaded, the keys in use stay: {e}{help}"),
            )
            .code("invalid_config")
            .into_response()
        }
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    if let Some(s) = app.exec.snapshot().await {
        let policy = app.policy.load();
        let cat = super::metrics::Catalog::of(
            &policy.graph,
            s.replicas
                .iter()
                .map(|r| (r.pool.as_str(), r.model.as_str(), r.variant.as_str())),
        );
        app.metrics.prime(&policy.version, &cat);
        app.metrics.reset_gauges();
        for q in &s.queues {
            app.metrics.set_queue(
                &q.tier,
                q.tenant.as_deref().unwrap_or("none"),
                q.depth,
                q.oldest_wait as f64 / 1e6 / app.speed,
            );
        }
        for r in &s.replicas {
            app.metrics.set_replica(
                &r.pool,
                &format!("{}.{}", r.model, r.variant),
                super::metrics::ReplicaLoad {
                    running: r.running,
                    slots: r.slots as usize,
                    kv_used: r.kv_used_tokens,
                    kv_capacity: r.kv_capacity_tokens,
                    busy_fraction: r.busy_fraction,
                },
            );
        }
        for b in &s.budgets {
            app.metrics
                .set_budget(b.scope, &b.name, b.period, b.limit, b.spent);
        }
        for (tier, n) in &s.semantic_entries {
            app.metrics.cache_entries(tier, "semantic", *n);
        }
        for r in &s.replicas {
            if let Some(name) = r.backend.strip_prefix("http:") {
                app.metrics
                    .set_upstream_breaker(&r.pool, name, !r.available);
            }
        }
    }
    let mut resp = app.metrics.render().into_response();
    if let Ok(v) = HeaderValue::from_str(super::metrics::Metrics::content_type()) {
        resp.headers_mut().insert("content-type", v);
    }
    resp
}

async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn readyz(State(app): State<Arc<App>>) -> Response {
    match app.exec.snapshot().await {
        Some(s) => {
            // A replica that refuses every request while its fleet's
            // shared state is unreachable (`on_unavailable = "refuse"`) is
            // not ready either.
            let refusing = app.fleet.as_ref().is_some_and(|f| f.refusing());
            let ready = !refusing
                && s.replicas
                    .iter()
                    .any(|r| r.up && r.available && !r.draining);
            let body = json!({
                "ready": ready,
                "shared_state": app.fleet.as_ref().map(|f| if f.store.is_up() { "up" } else if refusing { "unreachable: refusing requests" } else { "unreachable: serving with local limits" }),
                "version": s.version,
                "replicas": s.replicas.iter().map(|r| json!({
                    "index": r.index, "pool": r.pool, "model": r.model, "variant": r.variant,
                    "backend": r.backend, "up": r.up, "available": r.available,
                })).collect::<Vec<_>>(),
            });
            let code = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (code, axum::Json(body)).into_response()
        }
        None => ApiError::new(503, "the scheduler is not running").into_response(),
    }
}

#[derive(Deserialize)]
struct ExplainQuery {
    #[serde(default)]
    format: Option<String>,
}

async fn explain(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<ExplainQuery>,
) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let Some(e) = app
        .explain
        .get(&id)
        .or_else(|| app.explain_batch.get(&id))
        .or_else(|| app.explain_early.get(&id))
    else {
        return ApiError::new(
            404,
            format!("no recent request `{id}` (the gateway keeps the last 10,000)"),
        )
        .code("request_not_found")
        .into_response();
    };
    let (decision, trace) = match (&e.graph, &e.signals) {
        (Some(g), Some(s)) => {
            let (d, t) = g.explain(&e.request, s);
            (Some(g.view(&d)), Some(t))
        }
        _ => (None, None),
    };
    if q.format.as_deref() == Some("text") {
        let mut out = format!(
            "request {} ({}) decided by policy {}\n",
            e.id,
            e.endpoint,
            e.version.as_deref().unwrap_or("(not yet decided)")
        );
        if let (Some(g), Some(v), Some(t)) = (&e.graph, &decision, &trace) {
            let sources = app.policy_sources(e.version.as_deref()).unwrap_or_default();
            out.push_str(&crate::graph::trace::render(g, &sources, &e.request, v, t));
        }
        out.push_str("\nscheduler:\n");
        for ev in &e.events {
            match &ev.reason {
                Some(r) => out.push_str(&format!("  +{:>9.3} ms  {} [{r}]\n", ev.at_ms, ev.event)),
                None => out.push_str(&format!("  +{:>9.3} ms  {}\n", ev.at_ms, ev.event)),
            }
        }
        if let Some(o) = &e.outcome {
            out.push_str(&format!("outcome: {o}\n"));
        }
        return out.into_response();
    }
    axum::Json(json!({
        "id": e.id,
        "endpoint": e.endpoint,
        "received_unix_ms": e.received_unix_ms,
        "policy_version": e.version.as_deref(),
        "request": e.request,
        "decision": decision,
        "trace": trace,
        "scheduler": {
            "events": e.events,
            "replica": e.replica,
            "outcome": e.outcome,
            "clock": e.clock,
        },
    }))
    .into_response()
}

async fn queues(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    match app.exec.snapshot().await {
        Some(s) => {
            let mut v = serde_json::to_value(&s).unwrap_or_else(|_| json!({}));
            if let Some(o) = v.as_object_mut() {
                // Incident controls in force: paused or throttled tiers and
                // tenants, with the time they have left.
                o.insert("overrides".into(), json!(app.gov.override_views()));
            }
            axum::Json(v).into_response()
        }
        None => ApiError::new(503, "the scheduler is not running").into_response(),
    }
}

/// The fleet this gateway shares state with: each live replica, the
/// policy version and epoch it runs, and whether this one reaches Redis.
/// GPU-seconds and cost since start: the same figures as
/// `kiln_gpu_seconds_total` and `kiln_cost_usd_total`, by tenant, tier,
/// pool, model and batch.
async fn costs(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let uptime_s = ((crate::clock::unix_ms() - app.boot_ms as f64) / 1000.0).max(0.0);
    axum::Json(json!({
        "version": app.policy.load().version.as_ref(),
        "since_ms": app.boot_ms,
        "uptime_s": uptime_s,
        "rate": "GPU-seconds × the tenant's `cost` per GPU-hour (0 where it states none)",
        "costs": app.costs.costs(),
    }))
    .into_response()
}

async fn replicas(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let version = app.policy.load().version.to_string();
    let Some(fleet) = app.fleet.as_ref() else {
        return axum::Json(json!({
            "shared": false,
            "version": version,
            "replicas": [],
        }))
        .into_response();
    };
    let (list, reachable) = match fleet.store.replicas().await {
        Ok(l) => (l, true),
        Err(_) => (Vec::new(), false),
    };
    let fleet_epoch = fleet.store.policy_epoch().await.ok();
    axum::Json(json!({
        "shared": true,
        "replica": fleet.store.replica(),
        "reachable": reachable,
        "on_unavailable": match fleet.on_unavailable {
            super::config::OnUnavailable::Local => "local",
            super::config::OnUnavailable::Refuse => "refuse",
        },
        "version": version,
        "epoch": fleet.applied_epoch(),
        "fleet_epoch": fleet_epoch,
        "replicas": list,
    }))
    .into_response()
}

/// The measured signals the policy reads, as of the last arrival, in the
/// form `kiln explain --signals` takes.
async fn signals(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    match app.exec.signals().await {
        Some((g, s)) => axum::Json(s.to_input(&g)).into_response(),
        None => ApiError::new(503, "the scheduler is not running").into_response(),
    }
}

async fn show_policy(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let p = app.policy.load();
    axum::Json(json!({"version": p.version.as_ref(), "files": p.files()})).into_response()
}

/// `{"files": {"name.kiln": "text", ...}}`, or one file as the raw body.
#[derive(Deserialize)]
struct PolicyUpload {
    files: BTreeMap<String, String>,
}

/// The files of a policy upload: `{"files": {...}}` as JSON, or one file
/// as the raw body.
pub async fn read_upload(
    headers: &HeaderMap,
    body: Body,
) -> Result<BTreeMap<String, String>, Response> {
    let bytes = match axum::body::to_bytes(body, 8 * 1024 * 1024).await {
        Ok(b) => b,
        Err(_) => {
            return Err(ApiError::new(413, "a policy upload is limited to 8 MiB").into_response())
        }
    };
    let json_body = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    let files: BTreeMap<String, String> = if json_body {
        match serde_json::from_slice::<PolicyUpload>(&bytes) {
            Ok(u) if !u.files.is_empty() => u.files,
            Ok(_) => return Err(ApiError::new(400, "`files` is empty").into_response()),
            Err(e) => {
                return Err(ApiError::bad_request(
                    format!("expected {{\"files\": {{\"name.kiln\": \"…\"}}}}: {e}"),
                    Some("files"),
                )
                .into_response())
            }
        }
    } else {
        match std::str::from_utf8(&bytes) {
            Ok(t) => BTreeMap::from([("policy.kiln".to_string(), t.to_string())]),
            Err(_) => {
                return Err(ApiError::new(400, "the policy is not UTF-8 text").into_response())
            }
        }
    };
    Ok(files)
}

async fn swap_policy(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let who = match identify(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    if app.gov.enabled {
        // With approvers configured, a direct swap would bypass approvals.
        return (
            StatusCode::FORBIDDEN,
            axum::Json(json!({
                "error": {
                    "message": "policy changes need approvals on this gateway: propose it (`kiln propose` or POST /admin/proposals) and have it approved (`kiln approve`)",
                    "type": "approval_required",
                    "code": "approval_required",
                }
            })),
        )
            .into_response();
    }
    let files = match read_upload(&headers, body).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    match app.gov.activate_direct(app.as_ref(), files, &who).await {
        Ok(a) => (StatusCode::OK, axum::Json(a)).into_response(),
        Err(e) => super::activation::activation_refused(&e),
    }
}
