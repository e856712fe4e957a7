//! The gateway's side of a tier's exact-response cache
//! ([`crate::sched::cache`] holds its policy and its store, inside the
//! scheduler): the request's content hash, answering a hit, storing a
//! complete answer.
//!
//! A hit is decided by the scheduler after the policy classified, routed
//! and admitted the request and charged it one request of its tenant's
//! requests quota (no tokens, no GPU-seconds: it uses none). So an
//! unauthenticated, paused or over-quota caller never gets a cached answer.
//! The answer is the stored body with a new `id` and `created`, as JSON or
//! (a streaming request) as server-sent events; `x-kiln-cache: hit`.
//!
//! Only complete answers are stored: `finish_reason` `stop` or `length`,
//! never a cancelled, failed or preempted one, and only while the policy
//! version that decided the request is still the active one.

use super::executor::Command;
use super::explain;
use super::metrics::{Labels, Outcome as MetricOutcome};
use super::openai::Endpoint;
use super::routes::{base_record, record_live, round3, tenant_name, with_headers, Ctx, Decided};
use crate::graph::DecisionGraph;
use crate::sched::cache::{self, Key};
use axum::body::{Body, Bytes};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;

/// The request's content hash when it is cacheable and some tier of the
/// active policy has a response cache (otherwise nothing is hashed).
pub(super) fn content(g: &DecisionGraph, body: &Value) -> Option<Key> {
    if !g.tiers.iter().any(|t| !t.cache.is_empty()) {
        return None;
    }
    cache::content_key(body)
}

/// What the gateway needs of an embedding model: a blocking call giving
/// the text's vector, `None` when it cannot (a miss, never a failure).
pub trait EmbedText: Send + Sync {
    fn embed_text(&self, text: &str) -> Option<Vec<f32>>;
}

#[cfg(feature = "semantic-cache")]
impl EmbedText for crate::embed::Embedder {
    fn embed_text(&self, text: &str) -> Option<Vec<f32>> {
        self.embed(text).ok()
    }
}

/// Loads `[cache] embedding_model` at start; `None` without one.
pub(super) fn load_embedder(
    c: &super::config::CacheSection,
) -> Result<Option<Arc<dyn EmbedText>>, String> {
    let Some(dir) = &c.embedding_model else {
        return Ok(None);
    };
    #[cfg(feature = "semantic-cache")]
    {
        match crate::embed::Embedder::load(dir) {
            Ok(e) => Ok(Some(Arc::new(e))),
            Err(e) => Err(format!("{}: {e}", dir.display())),
        }
    }
    #[cfg(not(feature = "semantic-cache"))]
    {
        Err(format!(
            "{}: this kiln was built without `--features semantic-cache`",
            dir.display()
        ))
    }
}

/// Embeddings computed at once; more requests go on without the semantic
/// cache rather than queue CPU work behind a burst.
static EMBEDDING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
const MAX_EMBEDDING: usize = 4;

/// The question a semantic cache compares (the last user message's text,
/// or a completion's prompt) and the hash of everything else, so only
/// requests alike in all but the question are compared. `None` when the
/// request has no such text.
pub(super) fn question(body: &Value, endpoint: Endpoint) -> Option<(Key, String)> {
    let mut rest = body.clone();
    let text = match endpoint {
        Endpoint::Completions => {
            let p = rest.get_mut("prompt")?;
            let t = p.as_str()?.to_string();
            *p = Value::Null;
            t
        }
        Endpoint::Chat => {
            let msgs = rest.get_mut("messages")?.as_array_mut()?;
            let last = msgs.last_mut()?;
            if last.get("role").and_then(Value::as_str) != Some("user") {
                return None;
            }
            let content = last.get_mut("content")?;
            let t = match &*content {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => return None,
            };
            *content = Value::Null;
            t
        }
    };
    if text.trim().is_empty() {
        return None;
    }
    let context = cache::content_key(&rest)?;
    Some((context, text))
}

/// The semantic cache's probe for a cacheable request, when a tier has a
/// semantic cache and an embedding model is loaded: the question embedded
/// off the async runtime, under `[cache] embedding_budget` (at most 10 s).
/// Any failure is `None`.
pub(super) async fn probe(
    app: &super::App,
    g: &DecisionGraph,
    body: &Value,
    endpoint: Endpoint,
    cacheable: bool,
) -> Option<crate::sched::semantic::Probe> {
    use std::sync::atomic::Ordering;
    let embedder = app.embedder.clone()?;
    if !cacheable || !g.tiers.iter().any(|t| t.cache.semantic.is_some()) {
        return None;
    }
    let (context, text) = question(body, endpoint)?;
    if EMBEDDING.fetch_add(1, Ordering::AcqRel) >= MAX_EMBEDDING {
        EMBEDDING.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    let job = tokio::task::spawn_blocking(move || {
        let v = embedder.embed_text(&text);
        EMBEDDING.fetch_sub(1, Ordering::AcqRel);
        v
    });
    let budget = app
        .config
        .cache
        .embedding_budget
        .min(std::time::Duration::from_secs(10));
    let vector = tokio::time::timeout(budget, job).await.ok()?.ok()??;
    Some(crate::sched::semantic::Probe {
        context,
        vector: vector.into(),
    })
}

/// The headers every cache answer and cacheable miss carries.
pub(super) const HEADER: &str = "x-kiln-cache";

/// Answers a hit from its stored body.
pub(super) fn serve_hit(
    ctx: &Ctx,
    d: Decided,
    key: &Key,
    payload: Option<Arc<str>>,
    similarity: Option<f32>,
) -> Response {
    let kind = if similarity.is_some() {
        "semantic"
    } else {
        "exact"
    };
    let app = &ctx.app;
    let g = &d.graph;
    let tier = g
        .tiers
        .get(d.tier as usize)
        .map_or("?", |t| t.name.as_str());
    let tenant = tenant_name(g, d.tenant);
    let shown = cache::show_key(key);
    let Some(mut body) = payload.and_then(|p| serde_json::from_str::<Value>(&p).ok()) else {
        // A replay's entries have no body; the gateway's always do.
        let err = super::openai::ApiError::new(500, "the cached answer could not be read");
        return err.into_response();
    };
    let id = match ctx.endpoint {
        Endpoint::Chat => format!("chatcmpl-{}", ctx.rid),
        Endpoint::Completions => format!("cmpl-{}", ctx.rid),
    };
    let created = (crate::clock::unix_ms() / 1000.0) as i64;
    if let Some(o) = body.as_object_mut() {
        o.insert("id".into(), json!(id));
        o.insert("created".into(), json!(created));
        o.insert("model".into(), json!(ctx.client_model));
    }
    let completion = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    let e2e = ctx.received.elapsed().as_secs_f64();
    // Measured like any served request, on the route `cache`.
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
        let mut rec = base_record(ctx, Some(&d));
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
    record_live(ctx, Some(&d), Some(e2e), e2e, false, true);
    let headers = vec![
        ("x-kiln-request-id", ctx.rid.clone()),
        ("x-kiln-policy-version", d.version.to_string()),
        ("x-kiln-tier", tier.to_string()),
        ("x-kiln-tenant", tenant.clone()),
        ("x-kiln-route", "cache".to_string()),
        ("x-kiln-queue-ms", "0.000".to_string()),
        ("x-kiln-explain", format!("/admin/explain/{}", ctx.rid)),
        (HEADER, "hit".to_string()),
        ("x-kiln-cache-kind", kind.to_string()),
        ("x-kiln-cache-key", shown),
    ];
    let mut headers = headers;
    if let Some(sim) = similarity {
        headers.push(("x-kiln-cache-similarity", format!("{sim:.4}")));
    }
    if ctx.stream {
        let events = sse_events(ctx, &body);
        let mut resp = Response::new(Body::from(events));
        let hs = resp.headers_mut();
        hs.insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        hs.insert("cache-control", HeaderValue::from_static("no-cache"));
        return with_headers(resp, headers);
    }
    with_headers(axum::Json(body).into_response(), headers)
}

/// A cached answer as a stream: the role and the whole text in one chunk,
/// the finish, the usage when asked for, `[DONE]`.
fn sse_events(ctx: &Ctx, body: &Value) -> Bytes {
    let choice = &body["choices"][0];
    let finish = choice["finish_reason"].clone();
    let base = |choices: Value| {
        json!({
            "id": body["id"], "object": ctx.endpoint.object(true), "created": body["created"],
            "model": body["model"], "system_fingerprint": body["system_fingerprint"],
            "choices": choices,
        })
    };
    let mut chunks = Vec::new();
    match ctx.endpoint {
        Endpoint::Chat => {
            let m = &choice["message"];
            let mut delta = serde_json::Map::new();
            delta.insert("role".into(), json!("assistant"));
            delta.insert("content".into(), m["content"].clone());
            chunks.push(base(
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]),
            ));
            chunks.push(base(
                json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}]),
            ));
        }
        Endpoint::Completions => {
            chunks.push(base(json!([{"index": 0, "text": choice["text"], "logprobs": null, "finish_reason": null}])));
            chunks.push(base(
                json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": finish}]),
            ));
        }
    }
    if ctx.include_usage {
        let mut u = base(json!([]));
        if let Some(o) = u.as_object_mut() {
            o.insert("usage".into(), body["usage"].clone());
        }
        chunks.push(u);
    }
    let mut out = String::new();
    for c in chunks {
        out.push_str("data: ");
        out.push_str(&c.to_string());
        out.push_str("\n\n");
    }
    out.push_str("data: [DONE]\n\n");
    Bytes::from(out)
}

/// 64 hex digits: the content hash as the decision log records it.
pub(super) fn hex(k: &Key) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}

/// A cacheable request its tier's cache did not hold: counted as it
/// misses (whatever becomes of it after).
pub(super) fn missed(ctx: &Ctx, d: &Decided) {
    let tier = d
        .graph
        .tiers
        .get(d.tier as usize)
        .map_or("?", |t| t.name.as_str());
    let tenant = tenant_name(&d.graph, d.tenant);
    let caches = d.graph.tiers.get(d.tier as usize).map(|t| t.cache);
    if caches.is_some_and(|c| c.exact.is_some()) {
        ctx.app.metrics.cache_lookup(tier, &tenant, "exact", false);
    }
    if caches.is_some_and(|c| c.semantic.is_some()) && ctx.semantic_probe.is_some() {
        ctx.app
            .metrics
            .cache_lookup(tier, &tenant, "semantic", false);
    }
}

/// After a cacheable request missed: stores `body` when it is a complete
/// answer (`finish_reason` stop or length) of at
/// most the byte bound. Called once, as the answer is served whole.
pub(super) fn store(ctx: &Ctx, d: &Decided, body: &Value) {
    let Some(key) = d.cache else { return };
    let app = &ctx.app;
    let g = d.graph.clone();
    let tier = g
        .tiers
        .get(d.tier as usize)
        .map_or("?", |t| t.name.as_str())
        .to_string();
    let kinds = g
        .tiers
        .get(d.tier as usize)
        .map(|t| t.cache)
        .unwrap_or_default();
    let finish = body["choices"][0]["finish_reason"].as_str();
    if !matches!(finish, Some("stop" | "length")) {
        return;
    }
    let mut kept = body.clone();
    if let Some(o) = kept.as_object_mut() {
        o.remove("id");
        o.remove("created");
    }
    let payload: Arc<str> = Arc::from(kept.to_string());
    if payload.len() as u64 > cache::Bounds::default().max_entry_bytes {
        return;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sent = app.exec.send(Command::CacheStore {
        graph: g,
        tier: d.tier,
        key,
        payload,
        done: tx,
    });
    if sent {
        let app = app.clone();
        tokio::spawn(async move {
            if let Ok((exact, semantic)) = rx.await {
                if kinds.exact.is_some() {
                    app.metrics.cache_entries(&tier, "exact", exact);
                }
                if kinds.semantic.is_some() {
                    app.metrics.cache_entries(&tier, "semantic", semantic);
                }
            }
        });
    }
}

/// A cacheable miss's headers: `x-kiln-cache: miss`.
pub(super) fn miss_header(d: &Decided) -> Option<(&'static str, String)> {
    d.cache.map(|_| (HEADER, "miss".to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(system: &str, user: &str, max_tokens: u64) -> Value {
        json!({
            "model": "m", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        })
    }

    #[test]
    fn the_question_is_compared_and_everything_else_must_match() {
        let (ctx, q) = question(&chat("s", "How do I reset it?", 8), Endpoint::Chat).unwrap();
        assert_eq!(q, "How do I reset it?");
        // Another question, same context.
        let (ctx2, _) = question(&chat("s", "Reset how?", 8), Endpoint::Chat).unwrap();
        assert_eq!(ctx, ctx2);
        // Another system prompt or length limit: another context.
        assert_ne!(
            ctx,
            question(&chat("t", "How do I reset it?", 8), Endpoint::Chat)
                .unwrap()
                .0
        );
        assert_ne!(
            ctx,
            question(&chat("s", "How do I reset it?", 9), Endpoint::Chat)
                .unwrap()
                .0
        );
        // Text parts are joined; a last message that is not the user's, an
        // empty question or a sampled request have none.
        let parts = json!({"temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        assert_eq!(
            question(&parts, Endpoint::Chat).map(|x| x.1),
            Some("a\nb".into())
        );
        let assistant =
            json!({"temperature": 0, "messages": [{"role": "assistant", "content": "x"}]});
        assert!(question(&assistant, Endpoint::Chat).is_none());
        assert!(question(&chat("s", "  ", 8), Endpoint::Chat).is_none());
        let sampled = json!({"temperature": 0.7, "messages": [{"role": "user", "content": "x"}]});
        assert!(question(&sampled, Endpoint::Chat).is_none());
        let completion = json!({"temperature": 0, "prompt": "Once upon"});
        assert_eq!(
            question(&completion, Endpoint::Completions).map(|x| x.1),
            Some("Once upon".into())
        );
    }
}
