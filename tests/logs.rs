//! Issue 31, logs for machines: `kiln serve --log-format json` writes one
//! JSON object a line, request-scoped lines name the request and its W3C
//! trace; text logs carry no colour codes into a pipe; `traceparent` is
//! continued to HTTP upstreams (or started).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use axum::http::HeaderMap;
use kiln::backend::http::trace::TraceParent;
use kiln::server::config::{LogFormat, ServerConfig};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::TempDir;

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] }
}
tier chat { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [chat] api_keys ["k-alpha"] }
classify { default => tier chat }
route chat tiny { default => fp16 }
"#;

const CLIENT_TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// `kiln serve` with stderr into a file (not a terminal); returns the
/// child and the address it listens on.
fn serve(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    std::fs::write(dir.join("p.kiln"), POLICY).unwrap();
    let err = std::fs::File::create(dir.join("stderr")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(["serve", "--policy"])
        .arg(dir.join("p.kiln"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--sim-speed",
            "50",
            "--batch-store",
        ])
        .arg(dir.join("b.db"))
        .args(extra)
        .env_remove("NO_COLOR")
        .env("RUST_LOG", "kiln=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::from(err));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
        if let Some(i) = text.find("listening on http://") {
            let rest = &text[i + "listening on http://".len()..];
            let addr: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                .collect();
            return (child, addr);
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            panic!("kiln serve did not start: {text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A chat request and a refused one (no key), one with the client's trace.
async fn traffic(addr: &str) {
    let c = support::client(Duration::from_secs(30));
    let r = c
        .post(format!("http://{addr}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .header("traceparent", CLIENT_TRACE)
        .json(&json!({"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(format!("http://{addr}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

fn stop(mut child: Child, dir: &Path) -> String {
    let _ = child.kill();
    let _ = child.wait();
    std::fs::read_to_string(dir.join("stderr")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_a_line_with_request_and_trace() {
    let dir = TempDir::new("json");
    let (child, addr) = serve(&dir.0, &["--log-format", "json"], &[]);
    traffic(&addr).await;
    let text = stop(child, &dir.0);
    assert!(!text.contains('\u{1b}'), "ESC in JSON logs: {text}");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.iter().any(|v| v["fields"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("listening on"))));
    // Every line logged inside a request names it and its trace.
    let scoped: Vec<&Value> = lines
        .iter()
        .filter(|v| v["span"]["name"] == "request")
        .collect();
    assert!(scoped.len() >= 2, "{text}");
    for v in &scoped {
        let id = v["span"]["request_id"]
            .as_str()
            .or(v["fields"]["request_id"].as_str())
            .unwrap_or("");
        assert!(!id.is_empty(), "no request id: {v}");
        assert_eq!(
            v["span"]["trace_id"].as_str().map(str::len),
            Some(32),
            "{v}"
        );
    }
    // The client's trace is the request's.
    assert!(
        scoped.iter().any(
            |v| v["span"]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
                && v["span"]["path"] == "/v1/chat/completions"
        ),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_into_a_pipe_have_no_colour_codes() {
    let dir = TempDir::new("text");
    // A file is not a terminal: no colour, even without NO_COLOR.
    let (child, addr) = serve(&dir.0, &[], &[]);
    traffic(&addr).await;
    let text = stop(child, &dir.0);
    assert!(text.contains("listening on"), "{text}");
    assert!(text.contains("request_id"), "{text}");
    assert!(!text.contains('\u{1b}'), "ESC in piped logs: {text}");
}

#[test]
fn log_format_in_kiln_toml() {
    let cfg = ServerConfig::parse("kiln.toml", "[log]\nformat = \"json\"\n").unwrap();
    assert_eq!(cfg.log_format, Some(LogFormat::Json));
    // Without a path there is no decision log.
    assert!(cfg.log.is_none());
    let cfg = ServerConfig::parse(
        "kiln.toml",
        "[log]\npath = \"d.jsonl\"\nformat = \"text\"\n",
    )
    .unwrap();
    assert_eq!(cfg.log_format, Some(LogFormat::Text));
    assert_eq!(cfg.log.unwrap().path, PathBuf::from("d.jsonl"));
    assert!(ServerConfig::parse("kiln.toml", "[log]\nformat = \"xml\"\n").is_err());
    assert_eq!(
        ServerConfig::parse("kiln.toml", "").unwrap().log_format,
        None
    );
}

/// An upstream that answers every chat and keeps each `traceparent` it got.
async fn recording_upstream() -> (String, Arc<Mutex<Vec<Option<String>>>>) {
    use axum::routing::{get, post};
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let keep = seen.clone();
    let app = axum::Router::new()
        .route(
            "/v1/chat/completions",
            post(move |headers: HeaderMap| {
                let keep = keep.clone();
                async move {
                    keep.lock().unwrap().push(
                        headers
                            .get("traceparent")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string),
                    );
                    axum::Json(json!({
                        "id": "c1", "object": "chat.completion", "created": 0, "model": "tiny",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
                    }))
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceparent_is_continued_to_http_upstreams() {
    let (url, seen) = recording_upstream().await;
    let text = format!(
        "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{url}\"\nconcurrency = 4\nhealth_interval = \"10s\"\n"
    );
    let srv = support::serve_on_loopback(
        support::policy("p.kiln", POLICY),
        ServerConfig::parse("kiln.toml", &text).unwrap(),
    )
    .await;
    let c = support::client(Duration::from_secs(30));
    let body = json!({"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hello"}]});
    for trace in [Some(CLIENT_TRACE), None, Some("not-a-trace")] {
        let mut r = c
            .post(format!("http://{}/v1/chat/completions", srv.addr))
            .bearer_auth("k-alpha")
            .json(&body);
        if let Some(t) = trace {
            r = r.header("traceparent", t);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let got: Vec<Option<String>> = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 3, "{got:?}");
    let parsed: Vec<TraceParent> = got
        .iter()
        .map(|t| {
            TraceParent::parse(t.as_deref().unwrap_or("")).unwrap_or_else(|| panic!("{got:?}"))
        })
        .collect();
    let client = TraceParent::parse(CLIENT_TRACE).unwrap();
    // The client's trace continues, with kiln's hop as the parent.
    assert_eq!(parsed[0].trace_id, client.trace_id);
    assert_eq!(parsed[0].flags, client.flags);
    assert_ne!(parsed[0].parent_id, client.parent_id);
    // Without one (or with an invalid one) a new trace starts.
    assert_ne!(parsed[1].trace_id, client.trace_id);
    assert_ne!(parsed[2].trace_id, parsed[1].trace_id);
    srv.stop().await;
}
