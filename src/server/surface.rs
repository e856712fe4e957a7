//! The gateway's HTTP surface as OpenAI clients meet it: every refusal in
//! OpenAI's error shape with a code and a request id (and an explain entry
//! where kiln decided something), unknown paths and methods in JSON, the
//! models a caller may use, and the request fields a backend that
//! generates its own tokens cannot honour.

use super::auth::authenticate;
use super::explain::{self, ClockTimes, Entry};
use super::openai::{ApiError, Endpoint};
use super::App;
use crate::graph::{AdmitOutcome, DecisionGraph, Request, RouteOutcome, TierId};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A new request id, unique per start (the form generation requests get).
pub fn new_request_id(app: &App) -> String {
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    format!("{:x}-{id}", app.boot_ms)
}

/// A refusal of a generation or models request before the request was
/// recorded (authentication, a body that does not parse, an operator's
/// override on the tenant): it gets an id and an explain entry saying why,
/// in a store of its own so that a flood of refused requests cannot evict
/// the explains of admitted ones. An error already recorded is returned
/// as it is.
pub fn explain_refusal(
    app: &App,
    endpoint: &'static str,
    tenant: Option<&str>,
    err: ApiError,
) -> ApiError {
    if err.recorded.is_some() {
        return err;
    }
    let rid = new_request_id(app);
    let entry = app.explain_early.insert(Entry {
        id: rid.clone(),
        endpoint,
        received_unix_ms: crate::clock::unix_ms(),
        request: Request {
            tenant: tenant.map(str::to_string),
            ..Request::default()
        },
        version: None,
        graph: None,
        signals: None,
        events: Vec::new(),
        outcome: Some(format!("rejected {}", err.status)),
        replica: None,
        clock: ClockTimes::default(),
    });
    explain::note(
        &entry,
        0.0,
        format!("refused with {}: {}", err.status, err.message),
        Some(err.code_or_default()),
    );
    err.for_request(&rid, true)
}

/// A refusal of a recorded request: its id, its explain entry (noted here
/// if the path that refused did not note it) and the version that decided
/// it, else `consulted` (the version whose rules refused it before a
/// decision, such as the fleet's quota).
pub fn explain_recorded(
    err: ApiError,
    rid: &str,
    entry: &explain::Shared,
    at_ms: f64,
    consulted: &str,
) -> ApiError {
    let mut version = None;
    if let Ok(mut e) = entry.lock() {
        if e.outcome.is_none() {
            e.events.push(explain::SchedEvent {
                at_ms: (at_ms * 1000.0).round() / 1000.0,
                event: format!("refused with {}: {}", err.status, err.message),
                reason: Some(err.code_or_default().to_string()),
            });
            e.outcome = Some(format!("rejected {}", err.status));
        }
        version = e.version.as_deref().map(str::to_string);
    }
    let version = version.unwrap_or_else(|| consulted.to_string());
    err.for_request(rid, true).policy_version(Some(&version))
}

// ---- models ----------------------------------------------------------------

/// Whether callers must present a key: the config lists hashed keys, or
/// the policy declares keys and the config accepts them.
pub fn keys_required(app: &App, g: &DecisionGraph) -> bool {
    let auth = app.auth.load();
    !auth.keys.is_empty() || (auth.policy_keys && g.tenants.iter().any(|t| !t.api_keys.is_empty()))
}

/// The tiers a tenant's requests can be classified to: those classify can
/// name that the tenant is granted, and its first granted tier (where it
/// lands when classify names one it is not granted). An anonymous caller,
/// or a tenant the policy does not know or grants nothing, can land in any
/// tier classify names.
fn reachable_tiers(g: &DecisionGraph, tenant: Option<&str>) -> Vec<TierId> {
    let mut named: Vec<TierId> = g.classify.rules.iter().map(|(_, _, o)| o.tier).collect();
    named.push(g.classify.default.1.tier);
    named.sort_unstable();
    named.dedup();
    let granted = tenant
        .and_then(|t| g.tenant_id(t))
        .and_then(|t| g.tenants.get(t as usize))
        .map(|t| t.tiers.clone())
        .unwrap_or_default();
    if granted.is_empty() {
        return named;
    }
    let mut out: Vec<TierId> = named
        .iter()
        .copied()
        .filter(|t| granted.contains(t))
        .collect();
    if named.iter().any(|t| !granted.contains(t)) {
        if let Some(first) = granted.first() {
            out.push(*first);
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Whether some outcome of a rule set is not a reject.
fn may_pass<O>(rules: &crate::graph::RuleSet<O>, passes: impl Fn(&O) -> bool) -> bool {
    rules.rules.iter().any(|(_, _, o)| passes(o)) || passes(&rules.default.1)
}

/// The models a tenant's requests can reach, in the policy's order: a
/// model is listed when some tier the tenant's requests can be classified
/// to ([`reachable_tiers`]) routes it with a rule that is not a reject and
/// admits with a rule that is not a reject. Conditions are not evaluated
/// (they depend on the request and live signals), so a model listed may
/// still be refused by a rule, a quota or load; a model not listed is
/// never served to this tenant.
pub fn usable_models(g: &DecisionGraph, tenant: Option<&str>) -> Vec<String> {
    let tiers: Vec<TierId> = reachable_tiers(g, tenant)
        .into_iter()
        .filter(|t| {
            g.admits
                .get(*t as usize)
                .and_then(|a| a.as_ref())
                .is_none_or(|a| may_pass(a, |o| !matches!(o, AdmitOutcome::Reject(_))))
        })
        .collect();
    g.models
        .iter()
        .enumerate()
        .filter(|(m, _)| {
            tiers.iter().any(|t| {
                g.route_set(*t, *m as crate::graph::ModelId)
                    .is_some_and(|r| may_pass(r, |o| !matches!(o, RouteOutcome::Reject(_))))
            })
        })
        .map(|(_, m)| m.name.clone())
        .collect()
}

/// The models the caller may list: all of them when the policy has no
/// keys; otherwise the caller authenticates as for generation.
fn visible_models(app: &App, headers: &HeaderMap) -> Result<Vec<String>, ApiError> {
    let p = app.policy.load();
    let g = &p.graph;
    if !keys_required(app, g) {
        return Ok(g.models.iter().map(|m| m.name.clone()).collect());
    }
    let tenant =
        authenticate(app, g, headers).map_err(|e| explain_refusal(app, "/v1/models", None, e))?;
    Ok(usable_models(g, tenant.as_deref()))
}

fn model_object(app: &App, id: &str) -> Value {
    let created = (app.boot_ms / 1000) as i64;
    json!({"id": id, "object": "model", "created": created, "owned_by": "kiln"})
}

/// `GET /v1/models`.
pub async fn list_models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    match visible_models(&app, &headers) {
        Ok(ms) => {
            let data: Vec<Value> = ms.iter().map(|m| model_object(&app, m)).collect();
            axum::Json(json!({"object": "list", "data": data})).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models/{id}` (the SDK's `client.models.retrieve`).
pub async fn get_model(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let ms = match visible_models(&app, &headers) {
        Ok(ms) => ms,
        Err(e) => return e.into_response(),
    };
    if ms.contains(&id) {
        return axum::Json(model_object(&app, &id)).into_response();
    }
    let err = ApiError::new(
        404,
        format!(
            "the model `{}` does not exist or you may not use it; available: {}",
            clip(&id),
            list_or_none(&ms)
        ),
    )
    .code("model_not_found");
    let mut err = err;
    err.param = Some("model");
    explain_refusal(&app, "/v1/models/{id}", None, err).into_response()
}

/// A name a client sent, cut short for an error message.
fn clip(s: &str) -> String {
    if s.chars().count() > 100 {
        let mut t: String = s.chars().take(100).collect();
        t.push('…');
        t
    } else {
        s.to_string()
    }
}

pub fn list_or_none(ms: &[String]) -> String {
    if ms.is_empty() {
        "none".to_string()
    } else {
        ms.join(", ")
    }
}

// ---- request fields --------------------------------------------------------

/// The backends that accept the fields refused on the others.
const PASS_THROUGH: &str =
    "HTTP upstream backends (`backend = \"http\"`) pass it through unchanged";

/// A field a backend that generates its own tokens (the simulator, a CUDA
/// replica) cannot honour: kiln refuses rather than ignore it. `None` when
/// every field present can be honoured (or means its default). `backend`
/// names the backend in the message.
pub fn unsupported_field(endpoint: Endpoint, body: &Value, backend: &str) -> Option<ApiError> {
    let o = body.as_object()?;
    let set = |k: &str| o.get(k).filter(|v| !v.is_null());
    let refuse = |param: &'static str, what: &str| {
        let mut e = ApiError::new(
            400,
            format!(
                "`{param}` {what}: the {backend} backend cannot honour it and kiln does not ignore it; {PASS_THROUGH}"
            ),
        )
        .code("unsupported_parameter");
        e.param = Some(param);
        Some(e)
    };
    let nonempty = |v: &Value| match v {
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => !m.is_empty(),
        Value::String(s) => !s.is_empty(),
        Value::Bool(b) => *b,
        _ => true,
    };
    // The simulator answers tools, response formats and stop sequences
    // with placeholders of their shape (`backend::placeholder`); what
    // even it cannot answer is refused with the reason.
    let sim = backend == "sim";
    if sim {
        if let Err(r) = crate::backend::placeholder::plan(endpoint == Endpoint::Chat, body) {
            let mut e = ApiError::new(400, r.message).code("invalid_value");
            e.param = Some(r.param);
            return Some(e);
        }
    }
    let sim_chat = sim && endpoint == Endpoint::Chat;
    for k in ["tools", "functions"] {
        if k == "tools" && sim_chat {
            continue;
        }
        if set(k).is_some_and(nonempty) {
            return refuse(
                if k == "tools" { "tools" } else { "functions" },
                "(tool calling)",
            );
        }
    }
    if !sim_chat && set("tool_choice").is_some_and(|v| v.as_str() != Some("none")) {
        return refuse("tool_choice", "(tool calling)");
    }
    if set("function_call").is_some_and(|v| v.as_str() != Some("none")) {
        return refuse("function_call", "(function calling)");
    }
    if !sim_chat
        && set("response_format")
            .is_some_and(|v| v.get("type").and_then(Value::as_str) != Some("text"))
    {
        return refuse("response_format", "(structured output)");
    }
    // Chat's `logprobs` is a flag; completions' a count.
    if set("logprobs")
        .is_some_and(|v| v.as_bool() == Some(true) || v.as_u64().is_some_and(|n| n > 0))
    {
        return refuse("logprobs", "(token log probabilities)");
    }
    if set("top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        return refuse("top_logprobs", "(token log probabilities)");
    }
    if set("n").is_some_and(|v| v.as_u64() != Some(1)) {
        return refuse("n", "above 1 (several choices); send separate requests");
    }
    if set("best_of").is_some_and(|v| v.as_u64() != Some(1)) {
        return refuse("best_of", "above 1 (several candidates)");
    }
    if set("logit_bias").is_some_and(nonempty) {
        return refuse("logit_bias", "(token biases)");
    }
    if !sim && set("stop").is_some_and(nonempty) {
        return refuse(
            "stop",
            "(stop sequences: its text is generated, not decoded)",
        );
    }
    if set("suffix").is_some_and(nonempty) {
        return refuse("suffix", "(insertion)");
    }
    if set("echo").is_some_and(nonempty) {
        return refuse("echo", "(echoing the prompt)");
    }
    if set("audio").is_some() {
        return refuse("audio", "(audio output)");
    }
    if set("prediction").is_some() {
        return refuse("prediction", "(predicted outputs)");
    }
    if set("modalities")
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|x| x.as_str() != Some("text")))
    {
        return refuse("modalities", "other than text");
    }
    if endpoint == Endpoint::Chat {
        let msgs = o.get("messages").and_then(Value::as_array);
        for (i, m) in msgs.into_iter().flatten().enumerate() {
            let parts = m.get("content").and_then(Value::as_array);
            for (j, p) in parts.into_iter().flatten().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                if kind != "text" {
                    let kind = clip(kind);
                    return refuse(
                        "messages",
                        &format!(
                            "has a `{kind}` content part (messages[{i}].content[{j}]; text only)"
                        ),
                    );
                }
            }
            // An agent's loop sends its calls back: the simulator reads
            // them as it reads any earlier turn.
            if (!sim_chat && m.get("tool_calls").is_some_and(nonempty))
                || m.get("function_call").is_some_and(nonempty)
            {
                return refuse("messages", &format!("has tool calls (messages[{i}])"));
            }
        }
    }
    None
}

// ---- unknown paths and methods ---------------------------------------------

/// OpenAI endpoints kiln does not serve (by their first path segment
/// after `/v1/`). `files` and `batches` are served.
const UNSERVED: &[&str] = &[
    "embeddings",
    "images",
    "audio",
    "moderations",
    "fine_tuning",
    "fine-tunes",
    "assistants",
    "threads",
    "vector_stores",
    "responses",
    "realtime",
    "uploads",
    "edits",
    "engines",
    "evals",
    "containers",
    "conversations",
    "organization",
];

/// Paths kiln serves, for "did you mean" on a trailing slash.
const SERVED: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
    "/metrics",
    "/healthz",
    "/readyz",
];

/// The fallback for paths no route serves.
pub async fn not_found(uri: Uri) -> ApiError {
    let path = uri.path();
    let shown = clip(path);
    if let Some(rest) = path.strip_prefix("/v1/") {
        let first = rest.split('/').next().unwrap_or("");
        if UNSERVED.contains(&first) {
            return ApiError::new(
                404,
                format!(
                    "kiln does not serve {shown}: it serves /v1/chat/completions, /v1/completions, /v1/models, /v1/files and /v1/batches"
                ),
            )
            .code("unsupported_endpoint");
        }
    }
    let trimmed = path.trim_end_matches('/');
    let hint = if trimmed != path && SERVED.contains(&trimmed) {
        format!(" (did you mean {trimmed}, without the trailing slash?)")
    } else {
        String::new()
    };
    ApiError::new(404, format!("no such endpoint: {shown}{hint}")).code("unknown_url")
}

/// The fallback for a served path asked with a method it does not take.
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        405,
        format!("{} does not accept {method}", clip(uri.path())),
    )
    .code("method_not_allowed")
}

/// The largest error body the surface middleware reads to rewrite it.
const MAX_REWRITTEN: usize = 64 * 1024;

/// The middleware in front of every route (with [`super::limits::guard`]
/// inside it): an error that does not carry a request id gets one, and an
/// error whose body is not JSON (an extractor's plain-text rejection, an
/// empty body) is answered in OpenAI's shape instead, its headers (Allow,
/// Retry-After) kept.
///
/// Every request runs in a `request` span (its id once known, the W3C
/// trace id, method and path), so every line it logs names them; a request
/// without a valid `traceparent` is given one here, which its upstream
/// calls continue.
pub async fn stamp(
    State(app): State<Arc<App>>,
    mut req: axum::extract::Request,
    next: Next,
) -> Response {
    use crate::backend::http::trace::{TraceParent, CLIENT_PARENT, TRACEPARENT};
    use tracing::Instrument;
    let incoming = req
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    // kiln's own span: the client's trace continued under a new span id
    // (or a new trace). Its upstream calls name it as their parent and
    // the request's OpenTelemetry span is it; the client's span is kept
    // apart as that span's parent.
    let trace = TraceParent::child_of(None);
    let trace = match incoming {
        Some(t) => TraceParent {
            trace_id: t.trace_id,
            flags: t.flags,
            ..trace
        },
        None => trace,
    };
    req.headers_mut().remove(CLIENT_PARENT);
    if let Ok(v) = HeaderValue::from_str(&trace.to_string()) {
        req.headers_mut().insert(TRACEPARENT, v);
    }
    if let Some(t) = incoming {
        if let Ok(v) = HeaderValue::from_str(&format!("{:016x}", t.parent_id)) {
            req.headers_mut().insert(CLIENT_PARENT, v);
        }
    }
    let span = tracing::info_span!(
        "request",
        request_id = tracing::field::Empty,
        trace_id = %trace.trace_id_hex(),
        method = %req.method(),
        path = %req.uri().path(),
    );
    let started = std::time::Instant::now();
    let resp = stamp_inner(app, req, next).instrument(span.clone()).await;
    let id = resp
        .headers()
        .get("x-kiln-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    span.in_scope(|| {
        tracing::debug!(
            request_id = id,
            status = resp.status().as_u16(),
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "answered"
        )
    });
    resp
}

async fn stamp_inner(app: Arc<App>, req: axum::extract::Request, next: Next) -> Response {
    let resp = super::limits::guard(&app, req, next).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    let mut resp = if json {
        resp
    } else {
        let (mut parts, body) = resp.into_parts();
        let text = axum::body::to_bytes(body, MAX_REWRITTEN)
            .await
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
            .unwrap_or_default();
        let message = if text.is_empty() {
            status.canonical_reason().unwrap_or("error").to_string()
        } else {
            text
        };
        let err = ApiError::new(status.as_u16(), message);
        let body = serde_json::to_vec(&err.body()).unwrap_or_default();
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Response::from_parts(parts, Body::from(body))
    };
    if !resp.headers().contains_key("x-kiln-request-id") {
        if let Ok(v) = HeaderValue::from_str(&new_request_id(&app)) {
            resp.headers_mut().insert("x-kiln-request-id", v);
        }
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: Value) -> Option<&'static str> {
        unsupported_field(Endpoint::Chat, &body, "cuda:0").map(|e| {
            assert_eq!(e.status, 400);
            assert_eq!(e.code.as_deref(), Some("unsupported_parameter"));
            assert!(e.message.contains("HTTP upstream"), "{}", e.message);
            e.param.unwrap_or("")
        })
    }

    #[test]
    fn fields_the_simulator_cannot_honour_are_named() {
        let m = json!([{"role": "user", "content": "hi"}]);
        let ok = |extra: Value| {
            let mut b = json!({"model": "m", "messages": m});
            if let (Some(o), Some(x)) = (b.as_object_mut(), extra.as_object()) {
                o.extend(x.clone());
            }
            b
        };
        for fine in [
            json!({"temperature": 0.2, "top_p": 0.9, "seed": 7, "user": "u"}),
            json!({"stream_options": {"include_usage": true}, "max_completion_tokens": 5}),
            json!({"n": 1, "logprobs": false, "tools": [], "tool_choice": "none"}),
            json!({"response_format": {"type": "text"}, "stop": null, "logit_bias": {}}),
        ] {
            assert_eq!(refused(ok(fine.clone())), None, "{fine}");
        }
        for (bad, param) in [
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"logprobs": true}), "logprobs"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
            (json!({"n": 2}), "n"),
            (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
            (json!({"stop": ["\n"]}), "stop"),
            (json!({"audio": {"voice": "alloy"}}), "audio"),
        ] {
            assert_eq!(refused(ok(bad.clone())), Some(param), "{bad}");
        }
        let img = json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "data:"}},
        ]}]});
        assert_eq!(refused(img), Some("messages"));
        // The simulator answers tools, formats and stops with placeholders.
        for fine in [
            json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
            json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}),
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
            json!({"response_format": {"type": "json_object"}, "stop": ["\n"]}),
        ] {
            assert!(
                unsupported_field(Endpoint::Chat, &ok(fine.clone()), "sim").is_none(),
                "{fine}"
            );
        }
        let e = unsupported_field(
            Endpoint::Chat,
            &ok(
                json!({"tools": [], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
            "sim",
        );
        assert_eq!(
            e.map(|e| (e.status, e.param)),
            Some((400, Some("tool_choice")))
        );
        // Completions' `logprobs` is a count.
        let c = json!({"model": "m", "prompt": "x", "logprobs": 2});
        assert!(unsupported_field(Endpoint::Completions, &c, "sim").is_some());
        let c = json!({"model": "m", "prompt": "x", "logprobs": 0, "echo": false});
        assert!(unsupported_field(Endpoint::Completions, &c, "sim").is_none());
    }

    #[tokio::test]
    async fn unknown_paths_say_what_kiln_serves() {
        let e = not_found(Uri::from_static("/v1/embeddings")).await;
        assert_eq!(e.code.as_deref(), Some("unsupported_endpoint"));
        let e = not_found(Uri::from_static("/v1/images/generations")).await;
        assert_eq!(e.code.as_deref(), Some("unsupported_endpoint"));
        let e = not_found(Uri::from_static("/v1/foo")).await;
        assert_eq!(e.code.as_deref(), Some("unknown_url"));
        let e = not_found(Uri::from_static("/v1/chat/completions/")).await;
        assert!(e.message.contains("trailing slash"), "{}", e.message);
    }
}
