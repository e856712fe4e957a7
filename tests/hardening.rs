//! Issue 12, hardening: one tenant key cannot exhaust memory (header caps,
//! a byte-bounded explain store), secrets stay out of the decision log and
//! explain, slow and idle connections cannot hold the gateway, and what
//! the log says matches what the client got. All on 127.0.0.1, every loop
//! bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::TempDir;
use support::{policy, serve_on_loopback};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One GPU, one sequence at a time; `header("x-team")` picks the tier.
const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 1 }
}
tier high { priority 100 slo { p95 600s } }
tier low { priority 10 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high, low] api_keys ["k-alpha"] }
classify {
  when header("x-team") == "gold" => tier high
  default => tier low
}
route [high, low] tiny { default => fp16 }
"#;

async fn serve(cfg: ServerConfig) -> Running {
    serve_on_loopback(policy("h.kiln", POLICY), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(30))
}

fn chat(max_tokens: u64) -> Value {
    json!({"model": "tiny", "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "hello"}]})
}

fn assert_openai_error(v: &Value) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

fn with_log(dir: &TempDir) -> ServerConfig {
    let text = format!(
        "[log]\npath = \"{}\"\n[sim]\nspeed = 50.0\n",
        dir.0.join("d.jsonl").display()
    );
    ServerConfig::parse("kiln.toml", &text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_get_431_with_an_openai_body() {
    let srv = serve(base_cfg()).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let send = |hs: Vec<(String, String)>| {
        let mut r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-alpha")
            .json(&chat(2));
        for (k, v) in hs {
            r = r.header(k, v);
        }
        r.send()
    };
    // Too many, one too long, too many bytes in all.
    let cases: Vec<Vec<(String, String)>> = vec![
        (0..70).map(|i| (format!("x-h{i}"), "v".into())).collect(),
        vec![("x-big".into(), "v".repeat(17 * 1024))],
        (0..5)
            .map(|i| (format!("x-h{i}"), "v".repeat(15 * 1024)))
            .collect(),
    ];
    for hs in cases {
        let r = send(hs).await.unwrap();
        assert_eq!(r.status(), 431);
        assert_openai_error(&r.json().await.unwrap());
    }
    // Within the limits, served.
    let r = send(vec![("x-team".into(), "gold".into())]).await.unwrap();
    assert_eq!(r.status(), 200);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_explain_store_is_bounded_in_bytes() {
    let mut cfg = base_cfg();
    cfg.sim.speed = 50.0;
    cfg.limits.explain_max_bytes = 64 * 1024;
    let srv = serve(cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    // 60 requests with about 4 KB of recorded (x-kiln-*) headers each (a
    // record keeps at most 4 KiB of them): ~240 KB that the store may not
    // keep.
    for i in 0..60 {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-alpha")
            .header("x-kiln-note-a", format!("{i}-{}", "p".repeat(1300)))
            .header("x-kiln-note-b", format!("{i}-{}", "q".repeat(1300)))
            .header("x-kiln-note-c", format!("{i}-{}", "r".repeat(1300)))
            .json(&chat(1))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let (n, bytes) = srv.app.explain.usage();
    assert!(bytes <= 64 * 1024, "{bytes} bytes in {n} entries");
    assert!((1..60).contains(&n), "{n} entries");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_headers_are_neither_logged_nor_explained() {
    let dir = TempDir::new("secrets");
    let srv = serve(with_log(&dir)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .header("x-auth-token", "SECRET-auth")
        .header("x-goog-api-key", "SECRET-goog")
        .header("openai-api-key", "SECRET-openai")
        .header("x-amz-security-token", "SECRET-amz")
        .header("x-unrelated", "not-read-by-the-policy")
        .header("x-team", "gold")
        .header("x-kiln-session", "s-1")
        .json(&chat(2))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kiln-tier"], "high");
    let explain = r.headers()["x-kiln-explain"].to_str().unwrap().to_string();
    let _ = r.bytes().await.unwrap();
    let ex = c
        .get(format!("{base}{explain}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!ex.contains("SECRET"), "{ex}");
    assert!(!ex.contains("x-unrelated"), "{ex}");
    assert!(ex.contains("x-team"), "{ex}");
    srv.app.log.flush().await;
    let path = dir.0.join("d.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("SECRET"), "{text}");
    assert!(!text.contains("x-unrelated"), "{text}");
    let line: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(line["headers"]["x-team"], "gold", "{line}");
    assert_eq!(line["headers"]["x-kiln-session"], "s-1", "{line}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_queued_is_logged() {
    let dir = TempDir::new("left");
    let mut cfg = with_log(&dir);
    cfg.sim.speed = 1.0;
    let srv = serve(cfg).await;
    let base = format!("http://{}", srv.addr);
    // The only slot, busy for a long while.
    let c = client();
    let busy = {
        let (c, base) = (c.clone(), base.clone());
        tokio::spawn(async move {
            c.post(format!("{base}/v1/chat/completions"))
                .bearer_auth("k-alpha")
                .json(
                    &json!({"model": "tiny", "max_tokens": 100000, "stream": true,
                              "messages": [{"role": "user", "content": "hello"}]}),
                )
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Queued behind it; the client gives up.
    let quick = support::client(Duration::from_millis(400));
    let r = quick
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&chat(2))
        .send()
        .await;
    assert!(r.is_err(), "expected the client to time out while queued");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut found = None;
    while Instant::now() < deadline && found.is_none() {
        srv.app.log.flush().await;
        let text = std::fs::read_to_string(dir.0.join("d.jsonl")).unwrap_or_default();
        found = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["decision"]["admission"] == "cancel");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = found.expect("a cancel line in the decision log");
    assert_eq!(v["decision"]["reason"], "client_disconnected", "{v}");
    busy.abort();
    // The stream's response goes with its handle.
    drop(busy);
    srv.stop().await;
}

mod mock {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use axum::Router;

    /// An upstream whose generations fail with 500.
    pub async fn failing() -> (String, tokio::task::JoinHandle<()>) {
        let app = Router::new()
            .route(
                "/v1/chat/completions",
                post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response() }),
            )
            .route("/health", get(|| async { "ok" }));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let h = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        (format!("http://{addr}"), h)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_errors_are_logged_with_the_status_the_client_got() {
    let dir = TempDir::new("upstream");
    let (url, mock) = mock::failing().await;
    let text = format!(
        "[log]\npath = \"{}\"\n[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{url}\"\nconcurrency = 4\nhealth_interval = \"10s\"\nfailure_threshold = 100\n",
        dir.0.join("d.jsonl").display()
    );
    let srv = serve(ServerConfig::parse("kiln.toml", &text).unwrap()).await;
    let base = format!("http://{}", srv.addr);
    let r = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&chat(2))
        .send()
        .await
        .unwrap();
    let got = r.status().as_u16();
    assert!(got >= 500, "{got}");
    assert_openai_error(&r.json().await.unwrap());
    srv.app.log.flush().await;
    let text = std::fs::read_to_string(dir.0.join("d.jsonl")).unwrap();
    let v: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(v["decision"]["status"], got, "{v}");
    assert_eq!(v["decision"]["reason"], "upstream_error", "{v}");
    srv.stop().await;
    mock.abort();
}

/// The embedded default's settings (the policy's keys accepted).
fn base_cfg() -> ServerConfig {
    ServerConfig::parse("kiln.toml", "").unwrap()
}

fn conn_cfg(max_connections: usize, header_timeout: &str) -> ServerConfig {
    let mut cfg = base_cfg();
    cfg.limits.max_connections = max_connections;
    cfg.limits.header_read_timeout = kiln::units::duration::parse(header_timeout).unwrap();
    cfg.limits.body_read_timeout = std::time::Duration::from_millis(500);
    cfg
}

/// `GET /healthz` on a fresh connection: the status line, and how long.
async fn healthz(addr: std::net::SocketAddr) -> (String, Duration) {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).to_string();
    (text.lines().next().unwrap_or("").to_string(), t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_beyond_the_limit_do_not_stop_health_checks() {
    let srv = serve_on_loopback(policy("h.kiln", POLICY), conn_cfg(16, "30s")).await;
    let mut idle = Vec::new();
    for _ in 0..64 {
        if let Ok(s) = TcpStream::connect(srv.addr).await {
            idle.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..3 {
        let (status, took) = healthz(srv.addr).await;
        assert!(status.contains("200"), "{status:?}");
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
    drop(idle);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_connection_is_closed_after_the_header_timeout() {
    let srv = serve_on_loopback(policy("h.kiln", POLICY), conn_cfg(64, "500ms")).await;
    let t = Instant::now();
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(r.is_ok(), "still open after 5 s");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // And a silent connection too.
    let t = Instant::now();
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(r.is_ok() && t.elapsed() < Duration::from_secs(3));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_gets_408() {
    let srv = serve_on_loopback(policy("h.kiln", POLICY), conn_cfg(64, "10s")).await;
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-alpha\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let t = Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(3));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_busy_is_a_clear_503() {
    let mut cfg = conn_cfg(2, "30s");
    cfg.sim.speed = 1.0;
    let srv = serve_on_loopback(policy("h.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    // Two long streams hold both connections.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let c = client();
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-alpha")
            .json(
                &json!({"model": "tiny", "max_tokens": 100000, "stream": true,
                          "messages": [{"role": "user", "content": "hello"}]}),
            )
            .send();
        streams.push(tokio::spawn(r));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, took) = healthz(srv.addr).await;
    assert!(status.contains("503"), "{status:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    for s in streams {
        s.abort();
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_prompts_do_not_stall_health_checks() {
    let mut cfg = base_cfg();
    cfg.sim.speed = 50.0;
    cfg.limits.max_body_bytes = 16 * 1024 * 1024;
    let srv = serve_on_loopback(policy("h.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    // Words the tokenizer must work through: ~3 MB each.
    let prompt = "lorem ipsum dolor sit amet consectetur ".repeat(80_000);
    let mut big = Vec::new();
    let t = Instant::now();
    for _ in 0..4 {
        let (c, base) = (client(), base.clone());
        let body = json!({"model": "tiny", "max_tokens": 1,
                          "messages": [{"role": "user", "content": prompt.clone()}]});
        big.push(tokio::spawn(async move {
            let r = c
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("k-alpha")
                .json(&body)
                .send()
                .await
                .unwrap();
            let _ = r.bytes().await;
            Instant::now()
        }));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, took) = healthz(srv.addr).await;
    let mut last = t;
    for b in big {
        last = last.max(b.await.unwrap());
    }
    let total = last.duration_since(t);
    assert!(status.contains("200"), "{status:?}");
    // While the prompts are counted, health checks answer at once.
    assert!(
        took < Duration::from_millis(200) || took * 4 < total,
        "healthz {took:?} while the prompts took {total:?}"
    );
    srv.stop().await;
}

/// A client's retries, as the OpenAI SDKs mark them (`x-stainless-retry-
/// count`, `0` on a first try): each is counted once in
/// `kiln_retries_total{reason="client"}` whether served or refused, draws
/// on the tenant's retry budget, and its marker is in the decision log
/// (so `kiln report` and a replay see it), while the SDKs' other
/// `x-stainless-*` headers stay out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_retries_are_counted_once_budgeted_and_logged() {
    let dir = TempDir::new("retries");
    let text = POLICY.replace(
        r#"api_keys ["k-alpha"] }"#,
        r#"api_keys ["k-alpha"] retry_budget 10% }"#,
    );
    let srv = serve_on_loopback(policy("r.kiln", &text), with_log(&dir)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let send = |count: &'static str| {
        c.post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-alpha")
            .header("x-stainless-retry-count", count)
            .header("x-stainless-os", "Linux")
            .json(&chat(2))
            .send()
    };
    for _ in 0..10 {
        assert_eq!(send("0").await.unwrap().status(), 200);
    }
    // One retry is always allowed; the rest only up to 10% of the last
    // minute's requests (11 by then).
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = send("1").await.unwrap();
        statuses.push(r.status().as_u16());
        let _ = r.bytes().await;
    }
    assert_eq!(statuses, [200, 429, 429, 429, 429]);
    let m = support::scrape(&c, &base).await;
    let retries = |reason: &str| {
        support::metric_sum(&m, "kiln_retries_total", &[&format!("reason=\"{reason}\"")])
    };
    assert_eq!(retries("client"), 5.0, "{m}");
    for other in ["batch_item", "upstream_failed", "upstream_unsent"] {
        assert_eq!(retries(other), 0.0, "{other}: {m}");
    }
    srv.app.log.flush().await;
    let text = std::fs::read_to_string(dir.0.join("d.jsonl")).unwrap();
    assert!(!text.contains("x-stainless-os"), "{text}");
    let counts: Vec<String> = text
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["headers"]["x-stainless-retry-count"]
                .as_str()
                .unwrap_or("absent")
                .to_string()
        })
        .collect();
    assert_eq!(counts.len(), 15, "{text}");
    assert_eq!(counts.iter().filter(|c| *c == "1").count(), 5, "{counts:?}");
    assert_eq!(
        counts.iter().filter(|c| *c == "0").count(),
        10,
        "{counts:?}"
    );
    srv.stop().await;
}
