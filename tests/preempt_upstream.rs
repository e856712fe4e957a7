//! Preemption reaches HTTP upstreams: a preemptible batch request running
//! on a slow mock upstream (one slot) is cancelled there when a protected
//! tier's request arrives and there is no room, the protected request is
//! served in its slot, and the batch request then either runs again and
//! completes (`on_preempt requeue`, the default) or is told 503
//! `preempted` with Retry-After (`on_preempt reject`). A stream that had
//! already sent text ends with a `preempted` error event. Explain and the
//! decision log say `preempted`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln::server::config::{LogSection, ServerConfig};
use kiln::server::Running;
use kiln::traffic::Record;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{policy, serve_on_loopback};

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] }
}
tier high { priority 100 slo { ttft 2s } preempts [batch, batch_strict] }
tier batch { priority 10 slo { window 1h } preemptible }
tier batch_strict { priority 10 slo { window 1h } preemptible on_preempt reject }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
tenant beta { owner "b@x" tiers [batch] api_keys ["k-beta"] }
tenant gamma { owner "c@x" tiers [batch_strict] api_keys ["k-gamma"] }
classify {
  when tenant == alpha => tier high
  when tenant == gamma => tier batch_strict
  default => tier batch
}
route [high, batch, batch_strict] tiny { default => fp16 }
"#;

/// The mock upstream: a prompt containing "slow" takes `SLOW` to answer
/// (streams: a text chunk every 50 ms over that time); anything else
/// answers at once. It counts calls, finished answers and calls dropped
/// before the end (the client, kiln, went away).
#[derive(Default)]
struct Seen {
    calls: AtomicUsize,
    finished: AtomicUsize,
    abandoned: AtomicUsize,
    prompts: Mutex<Vec<String>>,
}

const SLOW: Duration = Duration::from_millis(2500);

struct Abandon(Arc<Seen>, bool);
impl Drop for Abandon {
    fn drop(&mut self) {
        if self.1 {
            self.0.finished.fetch_add(1, Ordering::SeqCst);
        } else {
            self.0.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn chunk(text: &str) -> Bytes {
    let v = json!({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "up",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
    Bytes::from(format!("data: {v}\n\n"))
}

async fn chat(State(seen): State<Arc<Seen>>, Json(body): Json<Value>) -> Response {
    seen.calls.fetch_add(1, Ordering::SeqCst);
    let prompt = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    seen.prompts.lock().unwrap().push(prompt.clone());
    let slow = prompt.contains("slow");
    let mut guard = Abandon(seen.clone(), false);
    if body["stream"].as_bool() == Some(true) {
        if prompt.contains("late") {
            // Nothing at all before this (the answer cannot have begun).
            tokio::time::sleep(SLOW).await;
        }
        let pieces = if slow {
            SLOW.as_millis() as u64 / 50
        } else {
            2
        };
        let s = futures_util::stream::unfold((0u64, guard), move |(i, mut g)| async move {
            if i > pieces {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let b = if i < pieces {
                chunk("tok ")
            } else {
                g.1 = true;
                Bytes::from("data: [DONE]\n\n")
            };
            Some((Ok::<Bytes, std::convert::Infallible>(b), (i + 1, g)))
        });
        let mut r = Body::from_stream(s).into_response();
        r.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        return r;
    }
    if slow {
        // Dropped mid-sleep when kiln cancels the call.
        tokio::time::sleep(SLOW).await;
    }
    guard.1 = true;
    Json(json!({
        "id": "x", "object": "chat.completion", "created": 0, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("answer to {prompt}")}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    }))
    .into_response()
}

async fn mock() -> (String, Arc<Seen>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { "ok" }))
        .with_state(seen.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let h = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (format!("http://{addr}"), seen, h)
}

/// One upstream with ONE slot, and a decision log.
async fn gateway(url: &str, log: &std::path::Path) -> Running {
    let mut cfg = ServerConfig::parse(
        "kiln.toml",
        &format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{url}\"\nconcurrency = 1\nhealth_interval = \"100ms\"\n"
        ),
    )
    .unwrap();
    cfg.log = Some(LogSection::at(log.to_path_buf()));
    serve_on_loopback(policy("preempt.kiln", POLICY), cfg).await
}

fn body(text: &str, max_tokens: u64, stream: bool) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "stream": stream})
}

fn send(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    body: Value,
) -> tokio::task::JoinHandle<reqwest::Response> {
    let req = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body);
    tokio::spawn(async move { req.send().await.unwrap() })
}

/// Waits (bounded) until `f` holds.
async fn until(what: &str, f: impl Fn() -> bool) {
    until_within(what, Duration::from_secs(2), f).await;
}

/// Polls `f` every 10 ms until it holds, failing after `limit`.
async fn until_within(what: &str, limit: Duration, f: impl Fn() -> bool) {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(f(), "timed out after {limit:?} waiting for {what}");
}

async fn explain(c: &reqwest::Client, base: &str, id: &str) -> Value {
    c.get(format!("{base}/admin/explain/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn says_preempted(e: &Value) -> bool {
    e["scheduler"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .any(|ev| ev["reason"] == "preempted")
}

fn temp_log(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("decisions.jsonl")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_batch_request_is_cancelled_upstream_and_served_later() {
    let (url, seen, mock) = mock().await;
    let log = temp_log("preempt-requeue");
    let srv = gateway(&url, &log).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(30));

    // The batch request takes the only slot, and a long time there.
    let batch = send(&c, &base, "k-beta", body("slow batch job", 50_000, false));
    until("the batch call upstream", || {
        seen.calls.load(Ordering::SeqCst) == 1
    })
    .await;
    // The protected request cannot wait for it: the batch call is
    // cancelled upstream, and the protected one is served at once.
    let t = Instant::now();
    let hi = send(&c, &base, "k-alpha", body("urgent", 10, false))
        .await
        .unwrap();
    assert_eq!(hi.status(), 200);
    assert!(t.elapsed() < SLOW, "it waited for the batch call");
    // The mock counts the disconnect when its handler is dropped, which
    // may come a moment after the protected answer under load: wait for
    // it (bounded, 5 s) rather than read it at once.
    until_within(
        "the mock saw the disconnect",
        Duration::from_secs(5),
        || seen.abandoned.load(Ordering::SeqCst) == 1,
    )
    .await;
    assert_eq!(seen.abandoned.load(Ordering::SeqCst), 1, "one disconnect");
    let v: Value = hi.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "answer to urgent");

    // The batch client kept waiting and gets its answer from a second
    // call, made once the slot was free again.
    let b = batch.await.unwrap();
    assert_eq!(b.status(), 200);
    assert_eq!(b.headers()["x-kiln-waited-for"], "preempted");
    let id = b.headers()["x-kiln-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let v: Value = b.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "answer to slow batch job"
    );
    assert_eq!(
        *seen.prompts.lock().unwrap(),
        vec!["slow batch job", "urgent", "slow batch job"]
    );
    assert_eq!(seen.calls.load(Ordering::SeqCst), 3);
    assert_eq!(seen.finished.load(Ordering::SeqCst), 2);
    let e = explain(&c, &base, &id).await;
    assert!(says_preempted(&e), "{e}");

    srv.app.log.flush().await;
    let records: Vec<Record> = kiln::traffic::read(&log).unwrap();
    let rec = records
        .iter()
        .find(|r| r.id.as_deref() == Some(id.as_str()))
        .unwrap();
    let d = rec.decision.clone().unwrap();
    assert_eq!(d.tier.as_deref(), Some("batch"));
    assert_eq!(d.status, Some(200));
    assert_eq!(d.waited_for.as_deref(), Some("preempted"));

    // The cancelled call held the upstream's only slot and served nothing:
    // charged (a part of the request's GPU time), and wasted.
    let m = support::scrape(&c, &base).await;
    let batch_gpu = support::metric_sum(&m, "kiln_gpu_seconds_total", &["tier=\"batch\""]);
    let wasted = support::metric_sum(
        &m,
        "kiln_gpu_seconds_wasted_total",
        &["tier=\"batch\"", "reason=\"recompute\""],
    );
    assert!(
        wasted > 0.0 && wasted < batch_gpu,
        "{wasted} of {batch_gpu}: {m}"
    );
    let high_wasted = support::metric_sum(&m, "kiln_gpu_seconds_wasted_total", &["tier=\"high\""]);
    assert_eq!(high_wasted, 0.0, "{m}");
    let preemptions = support::metric_sum(&m, "kiln_preemptions_total", &["tier=\"batch\""]);
    assert_eq!(preemptions, 1.0, "{m}");
    srv.stop().await;
    mock.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_that_rejects_on_preemption_tells_its_client_503() {
    let (url, seen, mock) = mock().await;
    let log = temp_log("preempt-reject");
    let srv = gateway(&url, &log).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(30));

    let batch = send(&c, &base, "k-gamma", body("slow strict job", 50_000, false));
    until("the batch call upstream", || {
        seen.calls.load(Ordering::SeqCst) == 1
    })
    .await;
    let hi = send(&c, &base, "k-alpha", body("urgent", 10, false))
        .await
        .unwrap();
    assert_eq!(hi.status(), 200);
    let b = batch.await.unwrap();
    assert_eq!(b.status(), 503);
    let retry: u64 = b.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let v: Value = b.json().await.unwrap();
    assert_eq!(v["error"]["code"], "preempted", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("on_preempt reject"));
    until_within("the upstream call dropped", Duration::from_secs(5), || {
        seen.abandoned.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(seen.calls.load(Ordering::SeqCst), 2, "not sent again");

    srv.app.log.flush().await;
    let records: Vec<Record> = kiln::traffic::read(&log).unwrap();
    let rec = records
        .iter()
        .find(|r| r.decision.as_ref().and_then(|d| d.tier.as_deref()) == Some("batch_strict"))
        .unwrap();
    let d = rec.decision.clone().unwrap();
    assert_eq!(d.status, Some(503));
    assert_eq!(d.reason.as_deref(), Some("preempted"));
    let e = explain(&c, &base, rec.id.as_deref().unwrap()).await;
    assert!(says_preempted(&e), "{e}");
    // Its call held the slot until the preemption, for nothing.
    let m = support::scrape(&c, &base).await;
    let gpu = support::metric_sum(&m, "kiln_gpu_seconds_total", &["tier=\"batch_strict\""]);
    let wasted = support::metric_sum(
        &m,
        "kiln_gpu_seconds_wasted_total",
        &["tier=\"batch_strict\"", "reason=\"preempted\""],
    );
    assert!(
        wasted > 0.0 && (wasted - gpu).abs() < 1e-9,
        "{wasted} of {gpu}: {m}"
    );
    srv.stop().await;
    mock.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_already_sent_text_ends_with_a_preempted_event() {
    let (url, seen, mock) = mock().await;
    let log = temp_log("preempt-stream");
    let srv = gateway(&url, &log).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(30));

    let mut r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-beta")
        .json(&body("slow streamed job", 50_000, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-kiln-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("tok"));
    let hi = send(&c, &base, "k-alpha", body("urgent", 10, false))
        .await
        .unwrap();
    assert_eq!(hi.status(), 200);
    let mut rest = String::new();
    while let Some(b) = r.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&b));
    }
    assert!(rest.contains("\"code\":\"preempted\""), "{rest}");
    assert!(!rest.contains("[DONE]"), "{rest}");
    until("the upstream stream dropped", || {
        seen.abandoned.load(Ordering::SeqCst) == 1
    })
    .await;
    // Ended, not queued again behind the client's back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(seen.calls.load(Ordering::SeqCst), 2);
    assert!(says_preempted(&explain(&c, &base, &id).await));
    srv.app.log.flush().await;
    let records: Vec<Record> = kiln::traffic::read(&log).unwrap();
    let rec = records
        .iter()
        .find(|r| r.id.as_deref() == Some(id.as_str()))
        .unwrap();
    assert_eq!(
        rec.decision.as_ref().and_then(|d| d.reason.as_deref()),
        Some("preempted")
    );
    srv.stop().await;
    mock.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_preempted_before_its_answer_began_is_served_later() {
    let (url, seen, mock) = mock().await;
    let log = temp_log("preempt-stream-late");
    let srv = gateway(&url, &log).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(30));

    let batch = send(&c, &base, "k-beta", body("late start", 50_000, true));
    until("the batch call upstream", || {
        seen.calls.load(Ordering::SeqCst) == 1
    })
    .await;
    let hi = send(&c, &base, "k-alpha", body("urgent", 10, false))
        .await
        .unwrap();
    assert_eq!(hi.status(), 200);
    until("the first call dropped", || {
        seen.abandoned.load(Ordering::SeqCst) == 1
    })
    .await;
    // The stream had not begun: the client gets the whole second call.
    let b = batch.await.unwrap();
    assert_eq!(b.status(), 200);
    assert_eq!(b.headers()["x-kiln-waited-for"], "preempted");
    let text = b.text().await.unwrap();
    assert!(text.contains("tok "), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("preempted"), "{text}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 3);
    srv.stop().await;
    mock.abort();
}

/// An HTTP upstream's steps are not the scheduler's, yet its requests
/// reach the measured signals: the first token the gateway sees is the
/// tier's TTFT, its finish the tier's end-to-end time, and its tokens the
/// pool's work. `GET /admin/signals` shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_requests_reach_the_tiers_signals() {
    let (url, _seen, h) = mock().await;
    let dir = std::env::temp_dir().join(format!("kiln-upstream-signals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let g = gateway(&url, &dir.join("log.jsonl")).await;
    let base = format!("http://{}", g.addr);
    let c = support::client(Duration::from_secs(30));
    for i in 0..4 {
        // Streams: a text chunk every 50 ms, so the first token comes
        // 50 ms or more after the request reaches the upstream.
        let r = send(&c, &base, "k-alpha", body(&format!("hello {i}"), 8, true))
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
    }
    // Signals are refreshed as of the last arrival: one more arrives.
    let r = send(&c, &base, "k-alpha", body("last", 8, false))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let s: Value = c
        .get(format!("{base}/admin/signals"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let high = &s["tiers"]["high"];
    assert!(high["requests"].as_f64().unwrap() >= 4.0, "{s}");
    assert!(high["ttft_p50"].as_f64().unwrap() >= 40.0, "{s}");
    assert!(
        high["e2e_p50"].as_f64().unwrap() >= high["ttft_p50"].as_f64().unwrap(),
        "{s}"
    );
    assert_eq!(high["slo_attainment"].as_f64(), Some(100.0), "{s}");
    assert!(
        s["pools"]["gpu"]["utilization"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    // What it answers, `kiln explain --signals` reads back.
    let back: kiln::graph::SignalsInput = serde_json::from_value(s.clone()).unwrap();
    let graph = policy("preempt.kiln", POLICY).graph;
    kiln::graph::Signals::resolve(&graph, &back).unwrap();
    g.stop().await;
    h.abort();
    let _ = std::fs::remove_dir_all(&dir);
}
