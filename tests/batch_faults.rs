//! Batches that meet faults: poison items an upstream always fails, a
//! store that runs out of room during an upload and during a run, and a
//! file with too many lines. A gateway on 127.0.0.1:0 in front of a mock
//! OpenAI upstream on loopback (in this file); every loop is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{policy, serve_on_loopback};

// ---------------------------------------------------------------------------
// The mock upstream: answers each request after `delay`; a request whose
// prompt is a poison item's id answers 500 at once, every time. It counts
// calls per prompt.

struct Mock {
    addr: SocketAddr,
    delay: Duration,
    /// Bytes of filler in every answer (to fill a store).
    answer_bytes: usize,
    calls: Mutex<HashMap<String, u32>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Items `req-{i}` with `i % 50 == 7` are poison: 2 %, by custom_id.
fn poison(prompt: &str) -> bool {
    prompt
        .strip_prefix("req-")
        .and_then(|n| n.parse::<u64>().ok())
        .is_some_and(|n| n % 50 == 7)
}

impl Mock {
    async fn start(delay: Duration, answer_bytes: usize) -> Arc<Mock> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let m = Arc::new(Mock {
            addr: l.local_addr().unwrap(),
            delay,
            answer_bytes,
            calls: Mutex::new(HashMap::new()),
            task: Mutex::new(None),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/health", get(|| async { "ok" }))
            .with_state(m.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        *m.task.lock().unwrap() = Some(task);
        m
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn calls(&self) -> HashMap<String, u32> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().unwrap().take() {
            t.abort();
        }
    }
}

async fn chat(State(m): State<Arc<Mock>>, Json(req): Json<Value>) -> Response {
    let prompt = req["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    *m.calls.lock().unwrap().entry(prompt.clone()).or_insert(0) += 1;
    if poison(&prompt) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(
                json!({"error": {"message": "this request always fails", "type": "server_error"}}),
            ),
        )
            .into_response();
    }
    tokio::time::sleep(m.delay).await;
    let text = format!("answer to {prompt} {}", "x".repeat(m.answer_bytes));
    Json(json!({
        "id": "x", "object": "chat.completion", "created": 0, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    }))
    .into_response()
}

// ---------------------------------------------------------------------------
// The gateway.

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 16 }
}
tier interactive { priority 100 slo { ttft 5s } preempts [batch] }
tier batch { priority 10 slo { window 24h } preemptible }
tenant alpha { owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] }
classify {
  when batch => tier batch
  default => tier interactive
}
route [interactive, batch] tiny { default => fp16 }
"#;

/// A sensitive breaker (2 failures in a row open it for 2 s), so that
/// anything the batch's failures feed into it shows.
fn config(url: &str, batch: &str) -> ServerConfig {
    let text = format!(
        "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{url}\"\n\
         concurrency = 16\ntimeout = \"10s\"\nhealth_interval = \"200ms\"\nfailure_threshold = 2\nopen_for = \"2s\"\n\n\
         [batch]\n{batch}\n"
    );
    ServerConfig::parse("kiln.toml", &text).unwrap()
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

/// A JSONL batch file of `n` chat requests `req-{from}`…, each prompt its
/// own custom_id.
fn jsonl(from: usize, n: usize) -> String {
    let mut s = String::new();
    for i in from..from + n {
        let line = json!({
            "custom_id": format!("req-{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": format!("req-{i}")}], "max_tokens": 8}
        });
        s.push_str(&line.to_string());
        s.push('\n');
    }
    s
}

async fn upload(c: &reqwest::Client, base: &str, content: &str) -> reqwest::Response {
    support::batches::post_file(c, base, "k-alpha", content).await
}

async fn create(c: &reqwest::Client, base: &str, file: &str) -> Value {
    let r = c
        .post(format!("{base}/v1/batches"))
        .bearer_auth("k-alpha")
        .json(&json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn batch(c: &reqwest::Client, base: &str, id: &str) -> Value {
    c.get(format!("{base}/v1/batches/{id}"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn content(c: &reqwest::Client, base: &str, file: &str) -> String {
    c.get(format!("{base}/v1/files/{file}/content"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn terminal(b: &Value) -> bool {
    ["completed", "failed", "expired", "cancelled"].contains(&b["status"].as_str().unwrap_or(""))
}

/// Whether the gateway's scheduler sees every upstream in service (its
/// breaker closed, or half-open with the trial free).
async fn upstreams_available(c: &reqwest::Client, base: &str) -> bool {
    let q: Value = c
        .get(format!("{base}/admin/queues"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    q["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["available"] == true && r["up"] == true)
}

async fn stop(gw: Running) {
    gw.stop().await;
}

// ---------------------------------------------------------------------------

/// 2 % of a batch's items are answered 500 every time. The batch still
/// ends, quickly: each poison item is tried `max_attempts` times (with
/// backoff) and lands in the error file, every other item once in the
/// output file. The batch's failures never open the upstream's breaker,
/// and interactive requests sent alongside are all served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_items_end_in_the_error_file_and_leave_the_breaker_closed() {
    const N: usize = 1000;
    let mock = Mock::start(Duration::from_millis(40), 0).await;
    let gw = serve_on_loopback(
        policy("faults.kiln", POLICY),
        config(
            &mock.url(),
            "max_attempts = 3\nretry_base = \"100ms\"\nretry_max = \"1s\"",
        ),
    )
    .await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let r = upload(&c, &base, &jsonl(0, N)).await;
    assert_eq!(r.status(), 200);
    let f: Value = r.json().await.unwrap();
    let b = create(&c, &base, f["id"].as_str().unwrap()).await;
    let id = b["id"].as_str().unwrap().to_string();

    // Interactive traffic alongside, and the breaker watched.
    let started = Instant::now();
    let inter = {
        let (c, base) = (c.clone(), base.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..40 {
                let r = c
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth("k-alpha")
                    .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": format!("online-{i}")}], "max_tokens": 8}))
                    .send()
                    .await
                    .unwrap();
                statuses.push(r.status().as_u16());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            statuses
        })
    };
    let mut breaker_closed = true;
    let mut done = Value::Null;
    for _ in 0..1200 {
        breaker_closed &= upstreams_available(&c, &base).await;
        let b = batch(&c, &base, &id).await;
        if terminal(&b) {
            done = b;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    assert!(terminal(&done), "the batch did not end within 60 s");
    let statuses = inter.await.unwrap();
    breaker_closed &= upstreams_available(&c, &base).await;

    let poisoned = (0..N).filter(|i| i % 50 == 7).count();
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["failed"], poisoned, "{done}");
    assert_eq!(done["request_counts"]["completed"], N - poisoned, "{done}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        breaker_closed,
        "the upstream's breaker opened during the batch"
    );
    assert!(
        statuses.iter().all(|&s| s == 200),
        "interactive requests refused: {statuses:?}"
    );
    // The poison items are in the error file with their last answer, and
    // were tried exactly `max_attempts` times; every other item once.
    let err = content(&c, &base, done["error_file_id"].as_str().unwrap()).await;
    let lines: Vec<Value> = err
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), poisoned);
    for l in &lines {
        assert!(poison(l["custom_id"].as_str().unwrap()), "{l}");
        assert_eq!(l["response"]["status_code"], 502, "{l}");
        assert_eq!(l["error"]["code"], "retries_exhausted", "{l}");
    }
    let calls = mock.calls();
    for i in 0..N {
        let k = format!("req-{i}");
        let want = if poison(&k) { 3 } else { 1 };
        assert_eq!(calls.get(&k).copied(), Some(want), "{k}");
    }
    // Each try after an item's first is counted once as a retry: two for
    // each poison item, and one for each refused try (the runner sends a
    // refused item again; the interactive requests were all served, so
    // every refusal is an item's).
    let m = support::scrape(&c, &base).await;
    let refused = support::metric_sum(&m, "kiln_rejects_total", &[]);
    let retried = support::metric_sum(&m, "kiln_retries_total", &["reason=\"batch_item\""]);
    assert_eq!(retried, (2 * poisoned) as f64 + refused, "{m}");
    assert_eq!(
        support::metric_sum(&m, "kiln_retries_total", &["reason=\"client\""]),
        0.0,
        "{m}"
    );
    eprintln!(
        "{N} items, {poisoned} poison: terminal in {took:?}; interactive {} × 200; breaker closed throughout; {retried} item retries counted",
        statuses.len()
    );
    stop(gw).await;
}

/// A batch whose items all fail stops at its failure budget, as `failed`
/// with a clear code, instead of trying every item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_its_failure_budget_fails_early() {
    const N: usize = 400;
    let mock = Mock::start(Duration::from_millis(5), 0).await;
    let gw = serve_on_loopback(
        policy("faults.kiln", POLICY),
        config(
            &mock.url(),
            "max_attempts = 1\nretry_base = \"50ms\"\nretry_max = \"200ms\"\nmax_failed_share = 0.2\nmin_outcomes_for_budget = 20",
        ),
    )
    .await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    // Every line is poison: ids 7, 57, 107, …
    let mut text = String::new();
    for i in 0..N {
        let line = json!({
            "custom_id": format!("c{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": format!("req-{}", 7 + 50 * i)}], "max_tokens": 8}
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    let f: Value = upload(&c, &base, &text).await.json().await.unwrap();
    let b = create(&c, &base, f["id"].as_str().unwrap()).await;
    let id = b["id"].as_str().unwrap().to_string();
    let mut done = Value::Null;
    for _ in 0..600 {
        let b = batch(&c, &base, &id).await;
        if terminal(&b) {
            done = b;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(
        done["errors"]["data"][0]["code"], "too_many_failures",
        "{done}"
    );
    assert!(done["failed_at"].is_i64(), "{done}");
    // Every item is accounted for, and most were never sent.
    assert_eq!(done["request_counts"]["failed"], N, "{done}");
    let sent: u32 = mock.calls().values().sum();
    assert!(sent < (N / 2) as u32, "{sent} of {N} items were sent");
    let err = content(&c, &base, done["error_file_id"].as_str().unwrap()).await;
    let codes: Vec<String> = err
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["error"]["code"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(codes.len(), N);
    assert!(codes.iter().any(|c| c == "batch_failed"));
    stop(gw).await;
}

fn db_bytes(path: &std::path::Path) -> u64 {
    let wal = path.with_extension("db-wal");
    [path.to_path_buf(), wal]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

fn temp_store(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kiln-batch-faults-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("batches.db");
    (dir, path)
}

/// An upload the store has no room for is a 507 with a clear code, and
/// gives its space back; a file with too many lines names the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_refuses_an_upload_with_507_and_keeps_no_space() {
    let mock = Mock::start(Duration::from_millis(1), 0).await;
    let (dir, path) = temp_store("upload");
    let mut cfg = config(
        &mock.url(),
        "max_store_bytes = 2097152\nmax_requests = 5000",
    );
    cfg.batch.store = Some(path.clone());
    let gw = serve_on_loopback(policy("faults.kiln", POLICY), cfg).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let before = db_bytes(&path);
    // About 4 MB of lines against a 2 MiB store.
    let mut big = String::new();
    for i in 0..4000 {
        let line = json!({
            "custom_id": format!("big-{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "y".repeat(1000)}], "max_tokens": 8}
        });
        big.push_str(&line.to_string());
        big.push('\n');
    }
    let r = upload(&c, &base, &big).await;
    assert_eq!(r.status(), 507);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "insufficient_storage", "{e}");
    let after = db_bytes(&path);
    eprintln!("store before {before} B, after a refused 4 MB upload {after} B");
    assert!(
        after < before + 256 * 1024,
        "the refused upload kept {} bytes",
        after.saturating_sub(before)
    );
    // The store still takes what fits.
    let r = upload(&c, &base, &jsonl(0, 50)).await;
    assert_eq!(r.status(), 200);
    // Too many lines: the limit is named.
    let r = upload(&c, &base, &jsonl(0, 5001)).await;
    assert_eq!(r.status(), 413);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "too_many_lines", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 5,000 lines"),
        "{e}"
    );
    stop(gw).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The store fills while a batch runs: the runner pauses (no item is sent
/// twice, none is lost), and resumes by itself once space is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_fills_during_a_run_pauses_it_without_rerunning_items() {
    const N: usize = 200;
    // Each result holds a 24 KB answer: 200 of them (about 5 MB) do not
    // fit beside the filler file (4,500 lines of 1 KB) in an 8 MiB store,
    // and do without it. One try per item, so every item is sent once.
    let mock = Mock::start(Duration::from_millis(5), 24 * 1024).await;
    let (dir, path) = temp_store("run");
    let mut cfg = config(&mock.url(), "max_store_bytes = 8388608\nmax_attempts = 1");
    cfg.batch.store = Some(path.clone());
    let gw = serve_on_loopback(policy("faults.kiln", POLICY), cfg).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let mut filler = String::new();
    for i in 0..4500 {
        let line = json!({
            "custom_id": format!("fill-{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "z".repeat(1000)}], "max_tokens": 8}
        });
        filler.push_str(&line.to_string());
        filler.push('\n');
    }
    let r = upload(&c, &base, &filler).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    eprintln!("store with the filler: {} B", db_bytes(&path));
    let filler_id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let f: Value = upload(&c, &base, &jsonl(0, N)).await.json().await.unwrap();
    let b = create(&c, &base, f["id"].as_str().unwrap()).await;
    let id = b["id"].as_str().unwrap().to_string();
    // Wait until it is stuck: no progress for a second.
    let mut last = (u64::MAX, Instant::now());
    let mut stuck = false;
    for _ in 0..300 {
        let b = batch(&c, &base, &id).await;
        assert!(!terminal(&b), "the store never filled: {b}");
        let n = b["request_counts"]["completed"].as_u64().unwrap();
        if n != last.0 {
            last = (n, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(2) {
            stuck = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(stuck, "the batch never stalled");
    let paused_at = last.0;
    assert!(
        paused_at < N as u64 / 2 + 50,
        "it stalled late: {paused_at}"
    );
    // Paused: over two more seconds, no item is sent again.
    let calls_then: u32 = mock.calls().values().sum();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls_later: u32 = mock.calls().values().sum();
    assert_eq!(
        calls_then, calls_later,
        "items were sent while the store was full"
    );
    assert!(calls_later <= N as u32);
    // Free the space: the batch resumes and completes.
    let r = c
        .delete(format!("{base}/v1/files/{filler_id}"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut done = Value::Null;
    for _ in 0..600 {
        let b = batch(&c, &base, &id).await;
        if terminal(&b) {
            done = b;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let poisoned = (0..N).filter(|i| i % 50 == 7).count();
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["completed"], N - poisoned, "{done}");
    assert_eq!(done["request_counts"]["failed"], poisoned, "{done}");
    // Every item was sent exactly once: nothing ran again because the
    // store was full.
    let calls = mock.calls();
    for i in 0..N {
        let k = format!("req-{i}");
        assert_eq!(calls.get(&k).copied(), Some(1), "{k}");
    }
    eprintln!("paused at {paused_at} of {N} results; {calls_later} calls by then and none while full; every item called once");
    stop(gw).await;
    let _ = std::fs::remove_dir_all(&dir);
}
