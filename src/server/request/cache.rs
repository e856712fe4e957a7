//! A request and its tier's response cache ([`crate::server::cache`] has
//! the content hash and the semantic probe): answering a hit, counting a
//! miss, storing a complete answer.

use super::recorder::{base_record, record_live, round3, tenant_name, with_headers};
use super::{Ctx, Decided};
use crate::sched::cache::{self, Key};
use crate::server::cache::{hex, Semantic, HEADER};
use crate::server::executor::Command;
use crate::server::explain;
use crate::server::metrics::{Labels, Outcome as MetricOutcome};
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
