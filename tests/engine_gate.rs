//! Engine-aware upstreams: a mock vLLM on loopback publishes its load on
//! `/metrics`; kiln scrapes it and sends only while the engine is below
//! saturation, keeping the rest in its own queue; a failing scrape falls
//! back to the static `concurrency`, and `/admin/queues` says which.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{client, policy, serve_on_loopback};

/// What the mock engine says it holds, and what it received.
#[derive(Default)]
struct Engine {
    waiting: AtomicU32,
    /// KV usage in percent.
    kv: AtomicU32,
    metrics_fail: AtomicBool,
    received: AtomicU32,
    running: AtomicU32,
    /// Requests another client runs there (added to what it publishes).
    foreign: AtomicU32,
    /// The most of kiln's requests it ran at once.
    peak: AtomicU32,
}

async fn metrics(State(e): State<Arc<Engine>>) -> axum::response::Response {
    if e.metrics_fail.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response();
    }
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"tiny\"}} {}\n\
         vllm:num_requests_waiting{{model_name=\"tiny\"}} {}\n\
         vllm:kv_cache_usage_perc{{model_name=\"tiny\"}} {}\n",
        e.running.load(Ordering::SeqCst) + e.foreign.load(Ordering::SeqCst),
        e.waiting.load(Ordering::SeqCst),
        f64::from(e.kv.load(Ordering::SeqCst)) / 100.0
    )
    .into_response()
}

async fn chat(State(e): State<Arc<Engine>>, Json(_): Json<Value>) -> Json<Value> {
    e.received.fetch_add(1, Ordering::SeqCst);
    let now = e.running.fetch_add(1, Ordering::SeqCst) + 1;
    e.peak.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    e.running.fetch_sub(1, Ordering::SeqCst);
    Json(json!({
        "id": "c", "object": "chat.completion", "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    }))
}

async fn engine(e: Arc<Engine>) -> (String, tokio::task::JoinHandle<()>) {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .with_state(e);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (url, task)
}

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 16 }
}
tier high { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
classify { default => tier high }
admit high { default => queue max_wait 20s }
route [high] tiny { default => fp16 }
"#;

fn config(url: &str) -> ServerConfig {
    ServerConfig::parse(
        "kiln.toml",
        &format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\n\
             url = \"{url}\"\nconcurrency = 4\nengine = \"vllm\"\nscrape_interval = \"100ms\"\n\
             scrape_timeout = \"100ms\"\nmax_engine_waiting = 2\nmax_kv_cache = 0.9\n"
        ),
    )
    .unwrap()
}

/// The engine gate `/admin/queues` shows for the one replica.
async fn gate(c: &reqwest::Client, base: &str) -> Value {
    let v: Value = c
        .get(format!("{base}/admin/queues"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["replicas"][0]["engine"].clone()
}

/// The `gpu` pool's signals in `/admin/signals`.
async fn signals(c: &reqwest::Client, base: &str) -> Value {
    let v: Value = c
        .get(format!("{base}/admin/signals"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["pools"]["gpu"].clone()
}

async fn wait_for_state(c: &reqwest::Client, base: &str, state: &str) -> Value {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let g = gate(c, base).await;
        if g["state"] == state {
            return g;
        }
        assert!(Instant::now() < until, "never {state}: {g}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn send(c: reqwest::Client, base: String) -> u16 {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_engine_gets_nothing_new_and_kiln_keeps_the_queue() {
    let e = Arc::new(Engine::default());
    e.waiting.store(5, Ordering::SeqCst);
    let (url, task) = engine(e.clone()).await;
    let gw = serve_on_loopback(policy("engine.kiln", POLICY), config(&url)).await;
    let base = format!("http://{}", gw.addr);
    let c = client(Duration::from_secs(30));

    let g = wait_for_state(&c, &base, "saturated").await;
    eprintln!("saturated: {g}");
    assert_eq!(g["engine"], "vllm");
    assert_eq!(g["cap"], 0, "{g}");
    assert_eq!(g["load"]["waiting"], 5.0, "{g}");
    assert!(
        g["reason"].as_str().unwrap().contains("max_engine_waiting"),
        "{g}"
    );

    let calls: Vec<_> = (0..3)
        .map(|_| tokio::spawn(send(c.clone(), base.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        e.received.load(Ordering::SeqCst),
        0,
        "sent to a saturated engine"
    );
    let q: Value = c
        .get(format!("{base}/admin/queues"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let depth: u64 = q["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["depth"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(depth, 3, "kiln holds them: {q}");
    // The policy's pool signals read the engine: its queue counts as
    // queued (with kiln's own, as of the last arrival).
    let sig = signals(&c, &base).await;
    eprintln!("signals while saturated: {sig}");
    assert!(sig["queued"].as_u64().unwrap() >= 5 + 2, "{sig}");
    assert_eq!(sig["running"], 0, "{sig}");

    // Its queue drains: kiln sends again, up to its limit.
    e.waiting.store(0, Ordering::SeqCst);
    let started = Instant::now();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    eprintln!("served {:?} after the engine drained", started.elapsed());
    assert_eq!(e.received.load(Ordering::SeqCst), 3);
    // Open again, it fills what the engine runs, not the ceiling at once:
    // never seen full with anything running (its waiting requests were
    // not ours), half as much again as it ran at the last scrape, at
    // least one more (below 4: one more).
    let g = wait_for_state(&c, &base, "ok").await;
    let ran = g["load"]["running"].as_f64().unwrap() as u64;
    assert_eq!(g["cap"].as_u64(), Some((ran + 1).min(4)), "{g}");

    // KV cache past max_kv_cache saturates it too.
    e.kv.store(95, Ordering::SeqCst);
    let g = wait_for_state(&c, &base, "saturated").await;
    assert!(g["reason"].as_str().unwrap().contains("KV cache"), "{g}");
    e.kv.store(50, Ordering::SeqCst);
    wait_for_state(&c, &base, "ok").await;
    // An arrival refreshes the signals: the engine's KV usage is the
    // pool's occupancy.
    assert_eq!(send(c.clone(), base.clone()).await, 200);
    let sig = signals(&c, &base).await;
    assert_eq!(sig["kv_occupancy"].as_f64(), Some(50.0), "{sig}");
    gw.stop().await;
    task.abort();
}

/// What another client runs and queues in the engine is taken off what
/// kiln may hold there: the gate counts kiln's own requests (as they start
/// and end) against the engine's slots less the others'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_requests_in_the_engine_take_room_from_kiln() {
    let e = Arc::new(Engine::default());
    // Another client runs 3 and queues 3: the engine is seen full at 3.
    e.foreign.store(3, Ordering::SeqCst);
    e.waiting.store(3, Ordering::SeqCst);
    let (url, task) = engine(e.clone()).await;
    let gw = serve_on_loopback(policy("engine.kiln", POLICY), config(&url)).await;
    let base = format!("http://{}", gw.addr);
    let c = client(Duration::from_secs(30));
    let g = wait_for_state(&c, &base, "saturated").await;
    assert_eq!(g["cap"], 0, "the others hold every slot and queue: {g}");

    // Its queue drains; it still runs 2 of the 3 slots. Kiln may hold the
    // slots and the waiting it allows (3 + max_engine_waiting 2) less the
    // others' 2: 3, below the ceiling of 4.
    e.foreign.store(2, Ordering::SeqCst);
    e.waiting.store(0, Ordering::SeqCst);
    let until = Instant::now() + Duration::from_secs(5);
    let g = loop {
        let g = gate(&c, &base).await;
        if g["state"] == "ok" && g["load"]["running"] == 2.0 {
            break g;
        }
        assert!(Instant::now() < until, "never open: {g}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(g["cap"], 3, "{g}");
    let calls: Vec<_> = (0..6)
        .map(|_| tokio::spawn(send(c.clone(), base.clone())))
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    assert_eq!(e.received.load(Ordering::SeqCst), 6);
    let peak = e.peak.load(Ordering::SeqCst);
    assert!(
        (1..=3).contains(&peak),
        "kiln ran {peak} at once beside the other client's 2"
    );
    gw.stop().await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_scrape_falls_back_to_the_static_concurrency_and_says_so() {
    let e = Arc::new(Engine::default());
    e.metrics_fail.store(true, Ordering::SeqCst);
    let (url, task) = engine(e.clone()).await;
    let gw = serve_on_loopback(policy("engine.kiln", POLICY), config(&url)).await;
    let base = format!("http://{}", gw.addr);
    let c = client(Duration::from_secs(30));
    let until = Instant::now() + Duration::from_secs(5);
    let g = loop {
        let g = gate(&c, &base).await;
        if g["reason"]
            .as_str()
            .is_some_and(|r| r.contains("scrape failed"))
        {
            break g;
        }
        assert!(Instant::now() < until, "no failed scrape shown: {g}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("fallback: {g}");
    assert_eq!(g["state"], "fallback");
    assert_eq!(g["cap"], 4);
    assert!(g["reason"].as_str().unwrap().contains("HTTP 500"), "{g}");
    // Served meanwhile, on the static ceiling.
    let calls: Vec<_> = (0..4)
        .map(|_| tokio::spawn(send(c.clone(), base.clone())))
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    // Scrapes that work again put the gate back.
    e.metrics_fail.store(false, Ordering::SeqCst);
    wait_for_state(&c, &base, "ok").await;
    gw.stop().await;
    task.abort();
}
