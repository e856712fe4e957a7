//! A request and its tier's response cache ([`crate::server::cache`] has
//! the content hash and the semantic probe): answering a hit, counting a
//! miss, storing a complete answer.

use super::recorder::{hit_headers, record, tenant_name, with_headers, End};
use super::{Ctx, Decided};
use crate::sched::cache::{self, Key};
use crate::server::cache::Semantic;
use crate::server::executor::Command;
use crate::server::openai::Endpoint;
use axum::body::{Body, Bytes};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;

/// Answers a hit from its stored body.
pub(in crate::server) fn serve_hit(
    ctx: &Ctx,
    d: Decided,
    key: &Key,
    payload: Option<Arc<str>>,
    similarity: Option<f32>,
) -> Response {
    let shown = cache::show_key(key);
    let Some(mut body) = payload.and_then(|p| serde_json::from_str::<Value>(&p).ok()) else {
        // A replay's entries have no body; the gateway's always do.
        let err = crate::server::openai::ApiError::new(500, "the cached answer could not be read");
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
    record(
        ctx,
        End::CacheHit {
            d: &d,
            shown: &shown,
            similarity,
            completion,
        },
    );
    let headers = hit_headers(ctx, &d, &shown, similarity);
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

/// A cacheable request its tier's cache did not hold: counted as it
/// misses (whatever becomes of it after).
pub(in crate::server) fn missed(ctx: &Ctx, d: &Decided) {
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
    if caches.is_some_and(|c| c.semantic.is_some()) {
        match &ctx.semantic_probe {
            Semantic::Probe(_) => ctx
                .app
                .metrics
                .cache_lookup(tier, &tenant, "semantic", false),
            Semantic::Skipped(why) => ctx.app.metrics.cache_skipped(why.as_str()),
            Semantic::None => {}
        }
    }
}

/// After a cacheable request missed: stores `body` when it is a complete
/// answer (`finish_reason` stop or length) of at
/// most the byte bound. Called once, as the answer is served whole.
pub(in crate::server) fn store(ctx: &Ctx, d: &Decided, body: &Value) {
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
        content: ctx.cache_content,
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
