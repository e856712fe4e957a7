//! The gateway end to end: `kiln::server::start` on 127.0.0.1:0, real HTTP
//! from reqwest, the simulated backend and an in-test mock upstream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::server::config::{hash_secret, ServerConfig};
use kiln::server::{start, Policy, Running, ServeOptions};
use serde_json::{json, Value};
use std::time::Duration;
use support::{policy, serve_on_loopback};

/// One GPU, one small model whose replica runs ONE sequence at a time, so
/// queueing and cancellation are visible; `alpha` is high tier, `beta` low.
const SMALL: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 1 }
}
tier high { priority 100 slo { p95 600s } }
tier low { priority 10 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
tenant beta {
  owner "b@x"
  tiers [low]
  quota { requests 2/min }
  api_keys ["k-beta"]
}
classify {
  when tenant == alpha => tier high
  default => tier low
}
route [high, low] tiny { default => fp16 }
"#;

fn enterprise() -> Policy {
    let text = std::fs::read_to_string("policies/enterprise/enterprise.kiln").unwrap();
    policy("enterprise.kiln", &text)
}

async fn serve(p: Policy, mut cfg: ServerConfig, speed: f64) -> Running {
    cfg.sim.speed = speed;
    serve_on_loopback(p, cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

/// POST /v1/chat/completions with a key.
async fn send_chat(c: &reqwest::Client, base: &str, key: &str, body: &Value) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn chat_body(model: &str, text: &str, max_tokens: u64) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_is_decided_served_and_explained() {
    let srv = serve(enterprise(), ServerConfig::default_embedded(), 50.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let r = send_chat(
        &c,
        &base,
        "key-support-prod",
        &chat_body("llama-70b", "Where is my parcel?", 12),
    )
    .await;
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    assert_eq!(h["x-kiln-tier"], "interactive");
    assert_eq!(h["x-kiln-tenant"], "support-bot");
    assert!(h["x-kiln-route"]
        .to_str()
        .unwrap()
        .starts_with("llama-70b."));
    assert!(h["x-kiln-policy-version"]
        .to_str()
        .unwrap()
        .starts_with("sha256:"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "llama-70b");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    // "Where is my parcel?" is 5 cl100k tokens; + role 1 + framing 6.
    assert_eq!(v["usage"]["prompt_tokens"], 12);
    let id = h["x-kiln-request-id"].to_str().unwrap();
    let e: Value = c
        .get(format!("{base}/admin/explain/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(e["decision"]["tier"], "interactive");
    assert!(!e["trace"]["stages"].as_array().unwrap().is_empty());
    let events = e["scheduler"]["events"].as_array().unwrap();
    assert!(events.iter().any(|ev| ev["event"]
        .as_str()
        .unwrap()
        .starts_with("started on replica")));
    let text = c
        .get(format!("{base}/admin/explain/{id}?format=text"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("decision: tenant support-bot · tier interactive"),
        "{text}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_tokens_usage_and_done() {
    let srv = serve(enterprise(), ServerConfig::default_embedded(), 50.0).await;
    let base = format!("http://{}", srv.addr);
    let mut body = chat_body("llama-70b", "hi", 5);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = send_chat(&client(), &base, "key-support-prod", &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let content: usize = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert_eq!(content, 5);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_openai_shape_and_status() {
    let mut cfg = ServerConfig::default_embedded();
    cfg.limits.max_body_bytes = 2048;
    let srv = serve(policy("small.kiln", SMALL), cfg, 50.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let url = format!("{base}/v1/chat/completions");
    // 400: malformed JSON
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // 400: no messages
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .json(&json!({"model": "tiny"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // 401: bad key, and no key
    let r = c
        .post(&url)
        .bearer_auth("wrong")
        .json(&chat_body("tiny", "x", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(&url)
        .json(&chat_body("tiny", "x", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // 404: unknown model
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .json(&chat_body("gpt-9", "x", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    // 413: body over the limit
    let big = "word ".repeat(1000);
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .json(&chat_body("tiny", &big, 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    // 429 with Retry-After: beta may send 2 requests a minute
    for _ in 0..2 {
        let r = c
            .post(&url)
            .bearer_auth("k-beta")
            .json(&chat_body("tiny", "x", 1))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let r = c
        .post(&url)
        .bearer_auth("k-beta")
        .json(&chat_body("tiny", "x", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "quota");
    // models: the policy has keys, so listing them takes one
    let r = c.get(format!("{base}/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = c
        .get(format!("{base}/v1/models"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_raise_its_own_tier() {
    let srv = serve(enterprise(), ServerConfig::default_embedded(), 50.0).await;
    let base = format!("http://{}", srv.addr);
    // support-bot asks for the evaluation tier; the policy grants that
    // header only to analytics and research.
    let r = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-support-prod")
        .header("x-kiln-tier", "eval")
        .json(&chat_body("llama-70b", "hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-kiln-tier"], "interactive");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_keys_are_hashed_and_name_tenants() {
    let mut cfg = ServerConfig::default_embedded();
    cfg.keys.push(kiln::server::config::KeyConfig {
        sha256: hash_secret("analytics-secret"),
        tenant: "analytics".into(),
        name: None,
        description: None,
        expires: None,
    });
    let srv = serve(enterprise(), cfg, 50.0).await;
    let base = format!("http://{}", srv.addr);
    let r = client()
        .post(format!("{base}/v1/completions"))
        .bearer_auth("analytics-secret")
        .header("x-kiln-tier", "eval")
        .json(&json!({"model": "llama-70b", "prompt": "score this", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kiln-tier"], "evaluation");
    assert_eq!(r.headers()["x-kiln-tenant"], "analytics");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_client_frees_its_slot_at_once() {
    // Real speed: a 2,000-token answer would hold the only slot for a while.
    let srv = serve(
        policy("small.kiln", SMALL),
        ServerConfig::default_embedded(),
        1.0,
    )
    .await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let mut body = chat_body("tiny", "write a long story", 2000);
    body["stream"] = json!(true);
    let r = send_chat(&c, &base, "k-alpha", &body).await;
    assert_eq!(r.status(), 200);
    let q: Value = c
        .get(format!("{base}/admin/queues"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(q["replicas"][0]["running"], 1);
    drop(r); // the client goes away mid-stream
    let mut freed = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let q: Value = c
            .get(format!("{base}/admin/queues"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if q["replicas"][0]["running"] == 0 {
            freed = true;
            break;
        }
    }
    assert!(
        freed,
        "the slot was not freed after the client disconnected"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_policy_is_refused_and_the_old_one_stays() {
    let srv = serve(
        policy("small.kiln", SMALL),
        ServerConfig::default_embedded(),
        50.0,
    )
    .await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let before = srv.app.policy.load().version.clone();
    let broken = SMALL.replace("tiers [high]", "tiers [hihg]");
    let r = c
        .post(format!("{base}/admin/policy"))
        .body(broken)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let v: Value = r.json().await.unwrap();
    assert!(v["rendered"].as_str().unwrap().contains("hihg"), "{v}");
    assert_eq!(srv.app.policy.load().version, before);
    let r = send_chat(&c, &base, "k-alpha", &chat_body("tiny", "x", 1)).await;
    assert_eq!(
        r.headers()["x-kiln-policy-version"].to_str().unwrap(),
        before.as_ref()
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_swap_under_load_fails_nothing_and_logs_one_version_per_line() {
    let dir = std::env::temp_dir().join(format!("kiln-gw-swap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let mut cfg = ServerConfig::default_embedded();
    cfg.log = Some(kiln::server::config::LogSection::at(log.clone()));
    // A roomier fleet than SMALL so load does not queue for long.
    let base_policy = SMALL
        .replace("max_batch 1", "max_batch 64")
        .replace("requests 2/min", "requests 100k/min");
    let srv = serve(policy("p.kiln", &base_policy), cfg, 200.0).await;
    let base = format!("http://{}", srv.addr);
    let mut versions = vec![srv.app.policy.load().version.to_string()];
    let load = {
        let base = base.clone();
        tokio::spawn(async move {
            let c = client();
            let mut handles = Vec::new();
            for w in 0..8 {
                let c = c.clone();
                let base = base.clone();
                handles.push(tokio::spawn(async move {
                    let mut statuses = Vec::new();
                    for i in 0..25 {
                        let key = if (w + i) % 2 == 0 {
                            "k-alpha"
                        } else {
                            "k-beta"
                        };
                        let r = c
                            .post(format!("{base}/v1/chat/completions"))
                            .bearer_auth(key)
                            .json(&chat_body("tiny", "hello there", 4))
                            .send()
                            .await;
                        statuses.push(r.map(|r| r.status().as_u16()).unwrap_or(0));
                    }
                    statuses
                }));
            }
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.await.unwrap());
            }
            all
        })
    };
    let c = client();
    for i in 0..10 {
        // Alternate between two shapes: one drops the `low` tier entirely,
        // so queued low requests must be re-decided, not lost.
        let text = if i % 2 == 0 {
            base_policy.replace("priority 100", &format!("priority {}", 100 + i))
        } else {
            base_policy
                .replace("tier low { priority 10 slo { p95 600s } }", "")
                .replace("tiers [low]", "tiers [high]")
                .replace("default => tier low", "default => tier high")
                .replace("route [high, low]", "route [high]")
                .replace("priority 100", &format!("priority {}", 100 + i))
        };
        let r = c
            .post(format!("{base}/admin/policy"))
            .body(text)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        let v: Value = r.json().await.unwrap();
        versions.push(v["version"].as_str().unwrap().to_string());
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let statuses = load.await.unwrap();
    assert_eq!(statuses.len(), 200);
    assert!(
        statuses.iter().all(|&s| s == 200),
        "failed requests: {statuses:?}"
    );
    srv.stop().await;
    let recs = kiln::traffic::read(&log).unwrap();
    assert_eq!(recs.len(), 200);
    for r in &recs {
        let v = r
            .policy_version
            .as_deref()
            .expect("every line names its version");
        assert!(versions.iter().any(|x| x == v), "unknown version {v}");
        assert!(r.api_key.is_none());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_readiness() {
    let srv = serve(enterprise(), ServerConfig::default_embedded(), 50.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    send_chat(
        &c,
        &base,
        "key-support-prod",
        &chat_body("llama-70b", "hi", 3),
    )
    .await;
    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("kiln_requests_total{"), "{m}");
    assert!(m.contains("tier=\"interactive\""));
    assert!(m.contains("kiln_ttft_seconds_bucket"));
    assert_eq!(
        c.get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    srv.stop().await;
}

// ---------------------------------------------------------------------------
// The http backend, against a mock OpenAI upstream started in the test.

mod mock {
    use axum::body::{Body, Bytes};
    use axum::extract::State;
    use axum::routing::{get, post};
    use axum::{Json, Router};
    use serde_json::{json, Value};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[derive(Default)]
    pub struct Seen {
        pub requests: AtomicUsize,
        pub models: Mutex<Vec<String>>,
        /// Streams whose body was dropped before the end (client went away).
        pub abandoned: AtomicUsize,
    }

    struct Abandon(Arc<Seen>, bool);
    impl Drop for Abandon {
        fn drop(&mut self) {
            if !self.1 {
                self.0.abandoned.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    async fn chat(
        State(seen): State<Arc<Seen>>,
        Json(body): Json<Value>,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        seen.requests.fetch_add(1, Ordering::SeqCst);
        seen.models
            .lock()
            .unwrap()
            .push(body["model"].as_str().unwrap_or("").to_string());
        let n = body["max_tokens"].as_u64().unwrap_or(4);
        if body["stream"].as_bool() == Some(true) {
            let slow = n > 100;
            let guard = Abandon(seen.clone(), false);
            let s = futures_util::stream::unfold((0u64, guard), move |(i, mut g)| async move {
                if i > n + 1 {
                    return None;
                }
                if slow {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let data = if i < n {
                    json!({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "up",
                        "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": null}]})
                    .to_string()
                } else if i == n {
                    json!({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "up",
                        "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}})
                    .to_string()
                } else {
                    g.1 = true;
                    "[DONE]".to_string()
                };
                Some((
                    Ok::<Bytes, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))),
                    (i + 1, g),
                ))
            });
            let mut r = Body::from_stream(s).into_response();
            r.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            return r;
        }
        Json(json!({
            "id": "x", "object": "chat.completion", "created": 0, "model": "up",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from upstream"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        }))
        .into_response()
    }

    pub async fn start() -> (String, Arc<Seen>, tokio::task::JoinHandle<()>) {
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
}

fn http_config(urls: &[&str]) -> ServerConfig {
    let ups: String = urls
        .iter()
        .map(|u| {
            format!(
                "[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{u}\"\nserved_model = \"upstream-tiny\"\nconcurrency = 4\nhealth_interval = \"100ms\"\nfailure_threshold = 1\nconnect_timeout = \"300ms\"\n"
            )
        })
        .collect();
    ServerConfig::parse(
        "kiln.toml",
        &format!("[pools.gpu]\nbackend = \"http\"\n{ups}"),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_backend_forwards_rewrites_and_streams() {
    let (url, seen, mock) = mock::start().await;
    let srv = serve(policy("small.kiln", SMALL), http_config(&[&url]), 1.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let r = send_chat(&c, &base, "k-alpha", &chat_body("tiny", "hello", 4)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["x-kiln-backend"]
        .to_str()
        .unwrap()
        .starts_with("http:"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "hello from upstream");
    assert_eq!(v["model"], "tiny", "the client sees its own model name");
    assert_eq!(seen.models.lock().unwrap()[0], "upstream-tiny");
    // Streaming, without include_usage: the usage chunk kiln asked the
    // upstream for is not passed on.
    let mut body = chat_body("tiny", "hello", 3);
    body["stream"] = json!(true);
    let text = send_chat(&c, &base, "k-alpha", &body)
        .await
        .text()
        .await
        .unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.len(), 4, "{text}");
    assert_eq!(data[3], "[DONE]");
    assert!(!text.contains("usage"));
    srv.stop().await;
    mock.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_upstream_is_routed_around() {
    let (url, seen, mock) = mock::start().await;
    // Nothing listens on the first address: its requests never get sent,
    // so they are queued again and served by the live replica.
    let dead = "http://127.0.0.1:9";
    let srv = serve(policy("small.kiln", SMALL), http_config(&[dead, &url]), 1.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    for _ in 0..8 {
        let r = send_chat(&c, &base, "k-alpha", &chat_body("tiny", "hello", 4)).await;
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    assert_eq!(seen.requests.load(std::sync::atomic::Ordering::SeqCst), 8);
    srv.stop().await;
    mock.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_reaches_the_upstream() {
    let (url, seen, mock) = mock::start().await;
    let srv = serve(policy("small.kiln", SMALL), http_config(&[&url]), 1.0).await;
    let base = format!("http://{}", srv.addr);
    let mut body = chat_body("tiny", "a long answer please", 500);
    body["stream"] = json!(true);
    let mut r = send_chat(&client(), &base, "k-alpha", &body).await;
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap();
    assert!(first.is_some());
    drop(r);
    let mut seen_cancel = false;
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if seen.abandoned.load(std::sync::atomic::Ordering::SeqCst) == 1 {
            seen_cancel = true;
            break;
        }
    }
    assert!(
        seen_cancel,
        "the upstream kept generating for a client that left"
    );
    srv.stop().await;
    mock.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cuda_pool_without_a_gpu_is_a_clear_startup_error() {
    let cfg = ServerConfig::parse("kiln.toml", "[pools.gpu]\nbackend = \"cuda\"\n").unwrap();
    let err = match start(ServeOptions {
        policy: policy("small.kiln", SMALL),
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: None,
    })
    .await
    {
        Ok(_) => {
            // A machine with a GPU and the feature: nothing to check here.
            if cfg!(feature = "cuda") {
                return;
            }
            panic!("a CUDA pool started without the cuda feature");
        }
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("no CUDA driver found") || err.contains("built without the `cuda` feature"),
        "{err}"
    );
}

#[test]
fn the_example_config_parses_and_fits_the_enterprise_policy() {
    let cfg = ServerConfig::load(std::path::Path::new("examples/kiln.toml")).unwrap();
    let p = enterprise();
    let (plan, _) = kiln::server::build_plan(&p.graph, &cfg, None).unwrap();
    assert!(
        plan.replicas.iter().any(|r| r.external),
        "the shared pool is served over http"
    );
}

#[test]
fn an_http_pool_needs_no_gpu_kind_the_cost_model_knows() {
    let text = SMALL.replace("kind \"H100-80GB\"", "kind \"llama.cpp CPU\"");
    let p = policy("cpu.kiln", &text);
    // On the simulator the unknown kind is an error …
    assert!(kiln::server::build_plan(&p.graph, &ServerConfig::default_embedded(), None).is_err());
    // … served over HTTP it needs no sizing.
    let (plan, _) =
        kiln::server::build_plan(&p.graph, &http_config(&["http://127.0.0.1:9"]), None).unwrap();
    assert_eq!(plan.replicas.len(), 1);
    assert!(plan.replicas[0].external);
}

/// A tier's quota and a model's quota refuse like a tenant's: 429 with a
/// Retry-After, and the error code says which quota it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_and_model_quotas_refuse_with_429_and_say_which() {
    let text = SMALL
        .replace(
            "tier low { priority 10 slo { p95 600s } }",
            "tier low { priority 10 slo { p95 600s } quota { requests 1/min } }",
        )
        .replace(
            "  kv_per_token 32KB\n",
            "  kv_per_token 32KB\n  quota { requests 3/min }\n",
        );
    let srv = serve(
        policy("scoped.kiln", &text),
        ServerConfig::default_embedded(),
        50.0,
    )
    .await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let send = |key: &'static str| {
        let (c, base) = (c.clone(), base.clone());
        async move { send_chat(&c, &base, key, &chat_body("tiny", "x", 1)).await }
    };
    // beta (tier low): one request a minute for the whole tier, though
    // beta's own quota allows two.
    assert_eq!(send("k-beta").await.status(), 200);
    let r = send("k-beta").await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "tier-quota", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("tier low"),
        "{v}"
    );
    // alpha (tier high, no tier quota): the model allows three a minute,
    // one of which beta used.
    for _ in 0..2 {
        assert_eq!(send("k-alpha").await.status(), 200);
    }
    let r = send("k-alpha").await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model-quota", "{v}");
    srv.stop().await;
}

// ---------------------------------------------------------------------------
// Metrics exist at zero before anything happens, for every tier, tenant and
// pool of the policy, and for a swapped-in policy's new names too.

/// The metric names the **Metrics** paragraph of docs/gateway.md lists.
fn readme_metrics() -> Vec<String> {
    let readme = std::fs::read_to_string("docs/gateway.md").unwrap();
    let start = readme
        .find("**Metrics**")
        .expect("docs/gateway.md lists the metrics");
    let para = &readme[start..];
    let para = &para[..para.find("\n\n").unwrap_or(para.len())];
    let mut names: Vec<String> = para
        .split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|s| s.split('{').next())
        .filter(|s| s.starts_with("kiln_"))
        .map(str::to_string)
        .collect();
    names.dedup();
    names
}

/// Label values of `label` on `metric`'s series in a scrape.
fn label_values(scrape: &str, metric: &str, label: &str) -> std::collections::BTreeSet<String> {
    let key = format!("{label}=\"");
    scrape
        .lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|r| r.starts_with('{') || r.starts_with("_bucket{"))
        })
        .filter_map(|l| {
            let at = l.find(&key)? + key.len();
            Some(l[at..].split('"').next()?.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_listed_metric_is_exported_at_zero_from_the_start_and_after_a_swap() {
    let p = enterprise();
    let g = p.graph.clone();
    let srv = serve(p, ServerConfig::default_embedded(), 50.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let scrape = |c: reqwest::Client, base: String| async move {
        c.get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let m = scrape(c.clone(), base.clone()).await;
    let listed = readme_metrics();
    assert!(listed.len() >= 15, "{listed:?}");
    let tiers: std::collections::BTreeSet<String> =
        g.tiers.iter().map(|t| t.name.clone()).collect();
    let with_fallback: std::collections::BTreeSet<String> = g
        .tiers
        .iter()
        .zip(&g.fallbacks)
        .filter(|(_, f)| f.as_ref().is_some_and(|f| !f.steps.is_empty()))
        .map(|(t, _)| t.name.clone())
        .collect();
    let pools: std::collections::BTreeSet<String> =
        g.pools.iter().map(|p| p.name.clone()).collect();
    for name in &listed {
        // Only HTTP upstreams have a breaker; this gateway runs the
        // embedded simulator.
        if name == "kiln_upstream_breaker_open" {
            continue;
        }
        // One series per declared money budget, and this policy declares
        // none (tests/budgets.rs scrapes them).
        if name.starts_with("kiln_budget_") {
            continue;
        }
        let family = m.contains(&format!("# TYPE {name} "));
        assert!(
            family,
            "{name} is listed in docs/gateway.md but not exported before any request"
        );
        match name.as_str() {
            "kiln_policy_info" | "kiln_policy_swaps_total" | "kiln_keys_reloads_total" => {}
            n if n.starts_with("kiln_replica") || n.starts_with("kiln_kv_cache") => {
                assert_eq!(label_values(&m, n, "pool"), pools, "{n}");
            }
            "kiln_fallbacks_total" => {
                assert_eq!(label_values(&m, name, "tier"), with_fallback, "{name}");
            }
            // Only tiers with an exact cache have cache series.
            n if n.starts_with("kiln_cache") => {
                let cached: std::collections::BTreeSet<String> = g
                    .tiers
                    .iter()
                    .filter(|t| t.cache.exact.is_some())
                    .map(|t| t.name.clone())
                    .collect();
                assert!(!cached.is_empty(), "the test policy should cache a tier");
                assert_eq!(label_values(&m, n, "tier"), cached, "{n}");
            }
            n => assert_eq!(
                label_values(&m, n, "tier"),
                tiers,
                "{n}: one series per tier"
            ),
        }
    }
    // Every tenant has its zero series, on every route of its tiers.
    let tenants = label_values(&m, "kiln_requests_total", "tenant");
    for t in &g.tenants {
        assert!(tenants.contains(&t.name), "tenant {} not primed", t.name);
    }
    // The variant is a label of its own, not folded into `model`.
    assert!(m.contains("kiln_requests_total{model=\"llama-70b\",outcome=\"ok\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"fp16\"} 0"), "{m}");
    for metric in [
        "kiln_requests_total",
        "kiln_replica_slots",
        "kiln_ttft_seconds",
    ] {
        let models = label_values(&m, metric, "model");
        assert!(
            models.iter().all(|x| !x.contains('.')),
            "{metric}: {models:?}"
        );
        assert!(
            label_values(&m, metric, "variant").contains("fp16"),
            "{metric}"
        );
    }
    assert!(m.contains("kiln_queue_depth{tenant=\"support-bot\",tier=\"interactive\"} 0"));

    // A swapped-in policy's new tier is primed on the next scrape; the old
    // series stay (a counter that vanished would break rate()).
    let text = std::fs::read_to_string("policies/enterprise/enterprise.kiln").unwrap();
    let renamed = text.replace("interactive", "chat");
    assert_ne!(renamed, text);
    let r = c
        .post(format!("{base}/admin/policy"))
        .body(renamed)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let m = scrape(c.clone(), base.clone()).await;
    let after = label_values(&m, "kiln_ttft_seconds", "tier");
    assert!(
        after.contains("chat") && after.contains("interactive"),
        "{after:?}"
    );
    assert!(
        m.contains("kiln_queue_depth{tenant=\"support-bot\",tier=\"chat\"} 0"),
        "{m}"
    );
    srv.stop().await;
}

/// Sum of every series of `metric` in a scrape.
fn metric_sum(scrape: &str, metric: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.strip_prefix(metric).is_some_and(|r| r.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_costs_reads_the_same_numbers_as_the_metrics() {
    let srv = serve(enterprise(), ServerConfig::default_embedded(), 50.0).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    for key in ["key-support-prod", "key-enrichment", "key-enrichment"] {
        let r = send_chat(&c, &base, key, &chat_body("llama-70b", "hello there", 8)).await;
        assert_eq!(r.status(), 200, "{key}");
        let _ = r.bytes().await;
    }
    let v: Value = c
        .get(format!("{base}/admin/costs"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let costs = &v["costs"];
    assert_eq!(costs["total"]["requests"], 3, "{v}");
    let total_gpu = costs["total"]["gpu_seconds"].as_f64().unwrap();
    assert!(total_gpu > 0.0, "{v}");
    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
    assert!(close(metric_sum(&m, "kiln_gpu_seconds_total"), total_gpu));
    let total_cost = costs["total"]["cost"].as_f64().unwrap();
    assert!(close(metric_sum(&m, "kiln_cost_usd_total"), total_cost));
    // enrichment states `cost 2.1/h`, which overrides its pool's price.
    let tenant = |name: &str| {
        costs["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no row for {name}: {v}"))
    };
    let e = tenant("enrichment");
    assert_eq!(e["requests"], 2);
    let eg = e["gpu_seconds"].as_f64().unwrap();
    assert!(
        eg > 0.0 && close(e["cost"].as_f64().unwrap(), eg * 2.1 / 3600.0),
        "{e}"
    );
    // support-bot states none: its GPU time costs its pool's `price`
    // (h100 3.2/h, shared 1.1/h).
    let sb = tenant("support-bot");
    let (sg, sc) = (
        sb["gpu_seconds"].as_f64().unwrap(),
        sb["cost"].as_f64().unwrap(),
    );
    assert!(
        sg > 0.0 && [3.2, 1.1].iter().any(|p| close(sc, sg * p / 3600.0)),
        "{sb}"
    );
    assert!(close(total_cost, e["cost"].as_f64().unwrap() + sc));
    for by in ["tiers", "pools", "models"] {
        let sum: f64 = costs[by]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["gpu_seconds"].as_f64().unwrap())
            .sum();
        assert!(close(sum, total_gpu), "{by}: {v}");
    }
    srv.stop().await;
}
