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
/// where the question's compared part begins and that part's vector,
/// `None` when it cannot (a skipped lookup, never a failure).
pub trait EmbedText: Send + Sync {
    fn embed_question(&self, text: &str) -> Option<(usize, Vec<f32>)>;
}

#[cfg(feature = "semantic-cache")]
impl EmbedText for crate::embed::Embedder {
    fn embed_question(&self, text: &str) -> Option<(usize, Vec<f32>)> {
        crate::embed::Embedder::embed_question(self, text).ok()
    }
}

/// Loads `[cache] embedding_model` at start; `None` without one. The
/// model's own error (with its help) is kept.
pub(super) fn load_embedder(
    c: &super::config::CacheSection,
) -> Result<Option<Arc<dyn EmbedText>>, super::ServeError> {
    let Some(dir) = &c.embedding_model else {
        return Ok(None);
    };
    #[cfg(feature = "semantic-cache")]
    {
        match crate::embed::Embedder::load(dir) {
            Ok(e) => Ok(Some(Arc::new(e))),
            Err(e) => Err(super::ServeError::EmbeddingModel(Box::new(e))),
        }
    }
    #[cfg(not(feature = "semantic-cache"))]
    {
        Err(super::ServeError::Embedder(format!(
            "{}: this kiln was built without `--features semantic-cache`",
            dir.display()
        )))
    }
}

/// Why a request's semantic lookup was skipped (`x-kiln-cache-skipped`,
/// `kiln_cache_skipped_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Skip {
    /// Every embedding slot stayed taken for the whole budget.
    Busy,
    /// The embedding started but did not finish within the budget.
    Budget,
    /// The model could not embed the text.
    Error,
    /// Some tier's exact cache held the request's content, so it was not
    /// embedded (an exact hit must not wait for an embedding), but the
    /// decided tier and tenant had no exact answer.
    Exact,
}

impl Skip {
    pub(super) const ALL: [Skip; 4] = [Skip::Busy, Skip::Budget, Skip::Error, Skip::Exact];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Skip::Busy => "busy",
            Skip::Budget => "budget",
            Skip::Error => "error",
            Skip::Exact => "exact",
        }
    }
}

/// What became of a request's semantic lookup before the scheduler.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) enum Semantic {
    /// Not asked: no tier has a semantic cache, no model, the request is
    /// not cacheable or has no question.
    #[default]
    None,
    /// Embedded: compared by the decided tier's semantic cache.
    Probe(crate::sched::semantic::Probe),
    /// Not embedded, and why.
    Skipped(Skip),
}

impl Semantic {
    pub(super) fn probe(&self) -> Option<crate::sched::semantic::Probe> {
        match self {
            Semantic::Probe(p) => Some(p.clone()),
            _ => None,
        }
    }
}

/// Embeddings computed at once: one per core (the work is CPU-bound; more
/// at once would only make each slower). A request waits for a slot
/// within its budget rather than skip at once.
fn slots() -> &'static Arc<tokio::sync::Semaphore> {
    static SLOTS: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Arc::new(tokio::sync::Semaphore::new(cores.clamp(1, 8)))
    })
}

/// The question a semantic cache compares (the last user message's text,
/// or a completion's prompt) and the hash of everything else
/// ([`crate::sched::semantic::question`]).
pub(super) fn question(
    body: &Value,
    endpoint: Endpoint,
) -> Option<crate::sched::semantic::Question> {
    crate::sched::semantic::question(body, endpoint == Endpoint::Chat)
}

/// The semantic cache's probe for a cacheable request, when a tier has a
/// semantic cache and an embedding model is loaded: skipped when some
/// tier's exact cache holds the request (the exact lookup comes first and
/// must not wait); otherwise the question embedded off the async runtime
/// (waiting for one of [`slots`]), all within `[cache] embedding_budget`
/// (at most 10 s). A request that does not make it is
/// [`Semantic::Skipped`], and says so.
pub(super) async fn probe(
    app: &super::App,
    g: &DecisionGraph,
    body: &Value,
    endpoint: Endpoint,
    cacheable: bool,
) -> Semantic {
    let Some(embedder) = app.embedder.clone() else {
        return Semantic::None;
    };
    if !cacheable || !g.tiers.iter().any(|t| t.cache.semantic.is_some()) {
        return Semantic::None;
    }
    let Some(q) = question(body, endpoint) else {
        return Semantic::None;
    };
    if g.tiers.iter().any(|t| t.cache.exact.is_some()) {
        if let Some(content) = cache::content_key(body) {
            if app.exec.exact_holds(content).await {
                return Semantic::Skipped(Skip::Exact);
            }
        }
    }
    let budget = app
        .config
        .cache
        .embedding_budget
        .min(std::time::Duration::from_secs(10));
    let deadline = tokio::time::Instant::now() + budget;
    let permit = match tokio::time::timeout_at(deadline, slots().clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        Ok(Err(_)) => return Semantic::Skipped(Skip::Error),
        Err(_) => return Semantic::Skipped(Skip::Busy),
    };
    let job = tokio::task::spawn_blocking(move || {
        // The slot is held until the work ends, even past the budget.
        let _permit = permit;
        let (start, vector) = embedder.embed_question(&q.text)?;
        let context = crate::sched::semantic::context(&q.rest, &q.text, start);
        Some((context, vector))
    });
    match tokio::time::timeout_at(deadline, job).await {
        Err(_) => Semantic::Skipped(Skip::Budget),
        Ok(Ok(Some((context, vector)))) => Semantic::Probe(crate::sched::semantic::Probe {
            context,
            vector: vector.into(),
        }),
        Ok(_) => Semantic::Skipped(Skip::Error),
    }
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

/// A cacheable miss's headers: `x-kiln-cache: miss`, or `skipped` with
/// `x-kiln-cache-skipped: REASON` when its tier has a semantic cache whose
/// lookup was skipped ([`Skip`]).
pub(super) fn miss_headers(ctx: &Ctx, d: &Decided) -> Vec<(&'static str, String)> {
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
        let q = |b: &Value| question(b, Endpoint::Chat).unwrap();
        let a = q(&chat("s", "How do I reset it?", 8));
        assert_eq!(a.text, "How do I reset it?");
        // Another question, same context.
        assert_eq!(a.rest, q(&chat("s", "Reset how?", 8)).rest);
        // Another system prompt or length limit: another context.
        assert_ne!(a.rest, q(&chat("t", "How do I reset it?", 8)).rest);
        assert_ne!(a.rest, q(&chat("s", "How do I reset it?", 9)).rest);
        // Text parts are joined; a last message that is not the user's, an
        // empty question or a sampled request have none.
        let parts = json!({"temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        assert_eq!(q(&parts).text, "a\nb");
        let assistant =
            json!({"temperature": 0, "messages": [{"role": "assistant", "content": "x"}]});
        assert!(question(&assistant, Endpoint::Chat).is_none());
        assert!(question(&chat("s", "  ", 8), Endpoint::Chat).is_none());
        let sampled = json!({"temperature": 0.7, "messages": [{"role": "user", "content": "x"}]});
        assert!(question(&sampled, Endpoint::Chat).is_none());
        let completion = json!({"temperature": 0, "prompt": "Once upon"});
        assert_eq!(
            question(&completion, Endpoint::Completions).map(|x| x.text),
            Some("Once upon".into())
        );
    }

    #[test]
    fn images_and_other_parts_are_part_of_the_context() {
        let with = |image: Option<&str>| {
            let mut parts = vec![json!({"type": "text", "text": "What is in this picture?"})];
            if let Some(url) = image {
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            json!({"temperature": 0, "messages": [{"role": "user", "content": parts}]})
        };
        let a = question(&with(Some("data:image/png;base64,AAAA")), Endpoint::Chat).unwrap();
        let b = question(&with(Some("data:image/png;base64,BBBB")), Endpoint::Chat).unwrap();
        let none = question(&with(None), Endpoint::Chat).unwrap();
        assert_eq!(a.text, b.text);
        assert_ne!(a.rest, b.rest, "another image");
        assert_ne!(a.rest, none.rest, "no image");
        let again = question(&with(Some("data:image/png;base64,AAAA")), Endpoint::Chat).unwrap();
        assert_eq!(a.rest, again.rest);
    }

    #[test]
    fn the_head_of_a_long_question_and_its_guarded_details_are_exact() {
        use crate::sched::semantic::context;
        let rest = [7u8; 32];
        let doc = "Clause 1. The supplier delivers.\n\n";
        let a = format!("{doc}What is the notice period?");
        let b = format!("{doc}Who pays for shipping?");
        let start = |t: &str| t.rfind("\n\n").map_or(0, |i| i + 2);
        // Same head (the document), compared parts differ: one context.
        assert_eq!(context(&rest, &a, start(&a)), context(&rest, &b, start(&b)));
        // Another head: another context.
        let c = format!(
            "Clause 2. The buyer pays.\n\n{}",
            "What is the notice period?"
        );
        assert_ne!(context(&rest, &a, start(&a)), context(&rest, &c, start(&c)));
        // A guarded detail: another context.
        assert_ne!(
            context(&rest, "Send my March invoice", 0),
            context(&rest, "Send my August invoice", 0)
        );
        assert_ne!(
            context(&rest, "How do I reset my password?", 0),
            context(&rest, "How do I not reset my password?", 0)
        );
    }
}
