//! What TLS adds to an upstream request: kiln's own upstream client
//! (`backend::http::Upstream::complete`, pooled keep-alive connections)
//! against the same in-process OpenAI mock served twice on 127.0.0.1, over
//! plain http and over TLS (rustls; a certificate made for the run by
//! rcgen, trusted through `ca_file`).
//!
//! ```text
//! cargo bench --bench tls_upstream
//! ```
//!
//! After a warm-up (which also opens the pooled connections, so handshakes
//! are not in the figures), requests alternate http / https / http again
//! (an A/A baseline: its difference from the first is the noise floor), one
//! at a time, `TLS_BENCH_N` each (default 5,000). Latency is from the call
//! to the parsed answer. The server and the client share one
//! multi-threaded runtime of two workers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use axum::routing::post;
use axum::{Json, Router};
use kiln::backend::http::{Upstream, UpstreamConfig};
use rcgen::{CertificateParams, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn router() -> Router {
    Router::new().route(
        "/v1/chat/completions",
        post(|Json(_): Json<Value>| async move {
            Json(json!({
                "id": "c", "object": "chat.completion", "model": "tiny",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}
            }))
        }),
    )
}

async fn plain() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(l, router()).await;
    });
    url
}

async fn tls(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    use tower::ServiceExt;
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let ca = dir.join("bench-cert.pem");
    std::fs::write(&ca, cert.pem()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://127.0.0.1:{}", l.local_addr().unwrap().port());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| router().oneshot(req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (url, ca)
}

fn upstream(url: &str, ca: Option<std::path::PathBuf>) -> Upstream {
    let mut cfg = UpstreamConfig::new(url);
    cfg.health_path = String::new();
    cfg.concurrency = 4;
    cfg.ca_file = ca;
    Upstream::new("bench".into(), cfg).unwrap()
}

fn body() -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "Say the numbers from one to sixteen."}], "max_tokens": 16})
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    let n: usize = std::env::var("TLS_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = std::env::temp_dir().join(format!("kiln-tls-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let http_url = plain().await;
        let (https_url, ca) = tls(&dir).await;
        let targets = [
            ("http", upstream(&http_url, None)),
            ("https", upstream(&https_url, Some(ca))),
            ("http (A/A)", upstream(&http_url, None)),
        ];
        for (_, u) in &targets {
            for _ in 0..500 {
                u.complete("/v1/chat/completions", body()).await.unwrap();
            }
        }
        let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(n); targets.len()];
        for _ in 0..n {
            for (i, (_, u)) in targets.iter().enumerate() {
                let t = Instant::now();
                let v = u.complete("/v1/chat/completions", body()).await.unwrap();
                times[i].push(t.elapsed());
                assert!(v["choices"].is_array());
            }
        }
        println!("pooled keep-alive upstream request, {n} each, alternating (µs):");
        println!("{:<12} {:>8} {:>8} {:>8}", "target", "p50", "p90", "p99");
        let mut p50 = Vec::new();
        for ((name, _), t) in targets.iter().zip(times.iter_mut()) {
            t.sort();
            println!(
                "{name:<12} {:>8.1} {:>8.1} {:>8.1}",
                pct(t, 0.5),
                pct(t, 0.9),
                pct(t, 0.99)
            );
            p50.push(pct(t, 0.5));
        }
        println!(
            "TLS adds {:+.1} µs at p50 (A/A noise {:+.1} µs)",
            p50[1] - p50[0],
            p50[2] - p50[0]
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}
