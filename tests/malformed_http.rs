//! A malformed-HTTP corpus against `kiln serve` on 127.0.0.1: bad JSON,
//! every field of the chat and completions bodies with a wrong type, huge
//! and deeply nested bodies, bad headers and methods, HTTP/1.0, partial
//! bodies, bad content-length, non-UTF-8. Every case that reaches the
//! gateway gets a 4xx with an OpenAI error body; what hyper refuses before
//! there is a request (a broken request line or framing) gets its bare 4xx
//! or a close; none gets a 5xx. Afterwards the gateway still answers
//! `/healthz` at once and its memory has not run away.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::{policy, serve_on_loopback};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 8 }
}
tier std { priority 10 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [std] api_keys ["k-alpha"] }
classify { default => tier std }
route [std] tiny { default => fp16 }
"#;

fn rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

fn assert_openai_error(what: &str, status: u16, body: &[u8]) {
    let v: Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "{what}: {status} without a JSON body ({e}): {:?}",
            String::from_utf8_lossy(body)
        )
    });
    let e = &v["error"];
    assert!(
        e["message"].is_string()
            && e["type"].is_string()
            && e.get("param").is_some()
            && e.get("code").is_some(),
        "{what}: not an OpenAI error body: {v}"
    );
}

/// Bodies that must be refused on both endpoints (bad JSON, wrong shapes).
fn bad_json() -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = [
        "",
        " ",
        "{",
        "}",
        "nope",
        "[]",
        "[1,2]",
        "1",
        "null",
        "true",
        "\"a string\"",
        "{\"model\":}",
        "{\"model\":\"tiny\",}",
        "{\"model\":\"tiny\"} trailing",
        "{\"model\":\"tiny\" \"messages\":[]}",
        "{'model':'tiny'}",
        "{\"model\":NaN}",
        "{\"model\":\"\\ud800\"}",
        "{\"model\":\"\\x41\"}",
        "{\"model\":\"tiny\",\"max_tokens\":1e999}",
    ]
    .iter()
    .map(|s| (format!("json {s:?}"), s.as_bytes().to_vec()))
    .collect();
    v.push((
        "json bom".into(),
        b"\xef\xbb\xbf{\"model\":\"tiny\"}".to_vec(),
    ));
    v.push(("json non-utf8".into(), b"{\"model\":\"ti\xffny\"}".to_vec()));
    v.push(("json nul".into(), b"{\"model\":\"tiny\"}\0".to_vec()));
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    v.push(("json deeply nested array".into(), deep.into_bytes()));
    let deep = format!(
        "{{\"model\":\"tiny\",\"messages\":{}{}}}",
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    v.push(("json deeply nested object".into(), deep.into_bytes()));
    v
}

/// Every field of a chat body with values of the wrong type.
fn chat_cases() -> Vec<(String, Value)> {
    let base = json!({"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]});
    let mut out = Vec::new();
    let wrong: &[(&str, &[Value])] = &[
        (
            "model",
            &[
                json!(1),
                json!(null),
                json!([]),
                json!({}),
                json!(true),
                json!(""),
                json!("   "),
            ],
        ),
        (
            "messages",
            &[
                json!("hi"),
                json!(1),
                json!({}),
                json!(null),
                json!([]),
                json!([1]),
                json!(["hi"]),
                json!([null]),
                json!([{"role": 1, "content": "x"}]),
                json!([{"content": "x"}]),
                json!([{"role": "user", "content": 5}]),
                json!([{"role": "user", "content": {"a": 1}}]),
                json!([{"role": "user", "content": [1]}]),
                json!([{"role": "user", "content": [{"type": 1}]}]),
                json!([{"role": "user", "content": [{"text": "no type"}]}]),
                json!([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
                json!([{"role": "user", "content": "x", "name": 5}]),
            ],
        ),
        (
            "max_tokens",
            &[
                json!("2"),
                json!(-1),
                json!(1.5),
                json!(0),
                json!({}),
                json!([]),
                json!(true),
                json!(1e30),
            ],
        ),
        (
            "max_completion_tokens",
            &[json!("2"), json!(-1), json!(0), json!([1])],
        ),
        ("stream", &[json!("yes"), json!(1), json!({}), json!([])]),
        (
            "stream_options",
            &[
                json!("x"),
                json!(1),
                json!({"include_usage": "yes"}),
                json!([1]),
            ],
        ),
        ("user", &[json!(1), json!({}), json!([])]),
        (
            "n",
            &[json!(2), json!("1"), json!(-1), json!(1.5), json!(0)],
        ),
    ];
    for (field, values) in wrong {
        for v in *values {
            let mut b = base.clone();
            b[*field] = v.clone();
            out.push((format!("chat {field} = {v}"), b));
        }
    }
    let mut b = base.clone();
    b.as_object_mut().unwrap().remove("messages");
    out.push(("chat without messages".into(), b));
    let mut b = base.clone();
    b.as_object_mut().unwrap().remove("model");
    out.push(("chat without model".into(), b));
    out.push((
        "chat unknown model".into(),
        json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    ));
    out
}

/// Every field of a completions body with values of the wrong type.
fn completion_cases() -> Vec<(String, Value)> {
    let base = json!({"model": "tiny", "max_tokens": 2, "prompt": "hi"});
    let mut out = Vec::new();
    let wrong: &[(&str, &[Value])] = &[
        ("model", &[json!(1), json!(null), json!([]), json!("")]),
        (
            "prompt",
            &[
                json!(1),
                json!({}),
                json!(true),
                json!(null),
                json!([1.5]),
                json!([true]),
                json!([["a"]]),
                json!([[-1]]),
                json!([{}]),
            ],
        ),
        ("max_tokens", &[json!("2"), json!(-1), json!(0), json!(2.5)]),
        ("stream", &[json!("no"), json!(0)]),
        ("n", &[json!(3), json!("x")]),
    ];
    for (field, values) in wrong {
        for v in *values {
            let mut b = base.clone();
            b[*field] = v.clone();
            out.push((format!("completions {field} = {v}"), b));
        }
    }
    let mut b = base.clone();
    b.as_object_mut().unwrap().remove("prompt");
    out.push(("completions without prompt".into(), b));
    out
}

/// Sends raw bytes on a fresh connection; the status (if a response came)
/// and the body. Bounded: five seconds at most.
async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> (Option<u16>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
        if complete(&buf) {
            break;
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok());
    let body = match find(&buf, b"\r\n\r\n") {
        Some(i) => buf[i + 4..].to_vec(),
        None => Vec::new(),
    };
    (status, body)
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// A whole response with a content-length has arrived.
fn complete(buf: &[u8]) -> bool {
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    head.lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|n| buf.len() >= end + 4 + n)
}

fn post(path: &str, extra: &str, body: &[u8]) -> Vec<u8> {
    let mut b = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer k-alpha\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    b.extend_from_slice(body);
    b
}

/// Cases only raw TCP can send: (name, bytes, whether the gateway itself
/// answers, so the body must be an OpenAI error).
fn raw_cases() -> Vec<(String, Vec<u8>, bool)> {
    let chat = "/v1/chat/completions";
    let ok = br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#;
    let mut v: Vec<(String, Vec<u8>, bool)> = vec![
        ("garbage request line".into(), b"HELLO\r\n\r\n".to_vec(), false),
        ("binary garbage".into(), vec![0xff, 0x00, 0x13, 0x37, b'\r', b'\n', b'\r', b'\n'], false),
        ("request line without version".into(), b"GET /healthz\r\n\r\n".to_vec(), false),
        ("HTTP/2.0 on an h1 connection".into(), b"POST /v1/chat/completions HTTP/2.0\r\nhost: x\r\n\r\n".to_vec(), false),
        ("header without a colon".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n".to_vec(), false),
        ("header name with a space".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nbad name: v\r\n\r\n".to_vec(), false),
        ("content-length not a number".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n{}".to_vec(), false),
        ("negative content-length".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n{}".to_vec(), false),
        ("two content-lengths".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 9\r\n\r\n{}".to_vec(), false),
        ("content-length and chunked".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n{}".to_vec(), false),
        ("bad chunk size".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-alpha\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".to_vec(), false),
        ("huge header block".into(), format!("GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(300_000)).into_bytes(), false),
        ("thousands of headers".into(), format!("GET /healthz HTTP/1.1\r\nhost: x\r\n{}\r\n", "x-h: v\r\n".repeat(2_000)).into_bytes(), false),
        // The gateway's own answers.
        ("HTTP/1.0 bad body".into(), b"POST /v1/chat/completions HTTP/1.0\r\nauthorization: Bearer k-alpha\r\ncontent-length: 5\r\n\r\n{nope".to_vec(), true),
        ("HTTP/1.0 without auth".into(), b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: 2\r\n\r\n{}".to_vec(), true),
        ("HTTP/1.0 GET on a POST route".into(), b"GET /v1/completions HTTP/1.0\r\n\r\n".to_vec(), true),
        ("unknown method".into(), b"BREW /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), true),
        ("non-UTF-8 authorization".into(), post(chat, "", ok).replace_auth(b"Bearer k-\xff\xfe"), true),
        ("non-UTF-8 header value".into(), post(chat, "x-kiln-tags: NON-UTF8\r\n", b"{nope").replace_bytes(b"NON-UTF8", b"\xff\xfe"), true),
        ("non-UTF-8 path".into(), b"GET /v1/\xff\xfe HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), false),
        ("percent-garbage path".into(), b"GET /v1/%ff%fe%00 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), true),
        ("chunked body with bad JSON".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-alpha\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{nope\r\n0\r\n\r\n".to_vec(), true),
        ("partial body (never completed)".into(), {
            let mut b = post(chat, "", ok);
            let n = b.len() - 20;
            b.truncate(n);
            b
        }, true),
        ("content-length above the limit".into(), b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-alpha\r\nconnection: close\r\ncontent-length: 999999999\r\n\r\n{".to_vec(), true),
        ("wrong api key".into(), post(chat, "", ok).replace_auth(b"Bearer nope"), true),
        ("empty bearer".into(), post(chat, "", ok).replace_auth(b"Bearer "), true),
        ("70 headers".into(), post(chat, &"x-pad: v\r\n".repeat(70), ok), true),
        ("one 20 KB header".into(), post(chat, &format!("x-pad: {}\r\n", "v".repeat(20_000)), ok), true),
    ];
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/healthz",
    ] {
        for m in ["PUT", "DELETE", "PATCH"] {
            v.push((
                format!("{m} {path}"),
                format!("{m} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n").into_bytes(),
                true,
            ));
        }
    }
    for path in [
        "/",
        "/v1",
        "/v1/chat",
        "/v1/embeddings",
        "/admin/nope",
        "/../../etc/passwd",
    ] {
        v.push((
            format!("GET {path}"),
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").into_bytes(),
            true,
        ));
    }
    v
}

trait Replace {
    fn replace_bytes(self, from: &[u8], with: &[u8]) -> Vec<u8>;
    fn replace_auth(self, with: &[u8]) -> Vec<u8>;
}

impl Replace for Vec<u8> {
    fn replace_bytes(self, from: &[u8], with: &[u8]) -> Vec<u8> {
        match find(&self, from) {
            Some(i) => [&self[..i], with, &self[i + from.len()..]].concat(),
            None => self,
        }
    }

    fn replace_auth(self, with: &[u8]) -> Vec<u8> {
        self.replace_bytes(b"Bearer k-alpha", with)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_malformed_corpus_gets_4xx_and_the_gateway_stays_up() {
    let mut cfg = ServerConfig::parse("kiln.toml", "").unwrap();
    cfg.sim.speed = 50.0;
    cfg.limits.body_read_timeout = std::time::Duration::from_secs(1);
    let srv = serve_on_loopback(policy("m.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(20));
    let rss_before = rss_kb();
    let mut cases = 0usize;

    // Bodies through a real client, on both endpoints.
    let mut bodies: Vec<(String, &str, Vec<u8>)> = Vec::new();
    for (name, b) in bad_json() {
        bodies.push((format!("chat {name}"), "/v1/chat/completions", b.clone()));
        bodies.push((format!("completions {name}"), "/v1/completions", b));
    }
    for (name, b) in chat_cases() {
        bodies.push((
            name,
            "/v1/chat/completions",
            serde_json::to_vec(&b).unwrap(),
        ));
    }
    for (name, b) in completion_cases() {
        bodies.push((name, "/v1/completions", serde_json::to_vec(&b).unwrap()));
    }
    let huge = format!(
        "{{\"model\":\"tiny\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
        "x".repeat(5 * 1024 * 1024)
    );
    bodies.push((
        "chat body above the limit".into(),
        "/v1/chat/completions",
        huge.into_bytes(),
    ));
    for (name, path, body) in bodies {
        let r = c
            .post(format!("{base}{path}"))
            .bearer_auth("k-alpha")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let status = r.status().as_u16();
        let body = r.bytes().await.unwrap();
        assert!(
            (400..500).contains(&status),
            "{name}: {status} {:?}",
            String::from_utf8_lossy(&body)
        );
        assert_openai_error(&name, status, &body);
        cases += 1;
    }

    // What only raw TCP can send.
    for (name, bytes, ours) in raw_cases() {
        let (status, body) = raw(srv.addr, &bytes).await;
        match status {
            Some(s) => {
                assert!(
                    (400..500).contains(&s),
                    "{name}: {s} {:?}",
                    String::from_utf8_lossy(&body)
                );
                if ours {
                    assert_openai_error(&name, s, &body);
                }
            }
            // hyper may close a connection it cannot parse without a word;
            // the gateway's own cases always answer.
            None => assert!(!ours, "{name}: no answer"),
        }
        cases += 1;
    }
    assert!(cases >= 100, "only {cases} cases");

    // Still responsive, on a fresh connection.
    let t = Instant::now();
    let r = c.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let ok = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    if let (Some(a), Some(b)) = (rss_before, rss_kb()) {
        assert!(
            b.saturating_sub(a) < 256 * 1024,
            "memory grew {} KB over the corpus",
            b - a
        );
    }
    srv.stop().await;
}
