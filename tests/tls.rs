//! Outbound TLS: `https://` upstreams and `rediss://` Redis, against
//! servers on loopback whose certificates the test makes (rcgen): a
//! custom CA, a CA kiln does not trust (a clear error, at once, not a
//! hang), a server that requires a client certificate (mutual TLS), and
//! the gateway in front of an HTTPS upstream configured in kiln.toml.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use kiln::backend::http::{Upstream, UpstreamConfig, UpstreamError};
use kiln::server::config::ServerConfig;
use kiln::shared::{Store, StoreConfig};
use kiln::tls::ClientTls;
use serde_json::{json, Value};
use std::future::Future;
use std::time::{Duration, Instant};
use support::redis::Redis;
use support::tls::{serve_https, HttpsServer, Issued, Pki};
use support::{client, policy, serve_on_loopback};

/// Every test is bounded: a hang fails it.
async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("test did not finish in time")
}

fn engine() -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/chat/completions",
            post(|Json(body): Json<Value>| async move {
                if body["stream"] == json!(true) {
                    let events = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":null}]}\n\n\
                                  data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n\
                                  data: [DONE]\n\n";
                    return axum::response::Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(axum::body::Body::from(events))
                        .unwrap();
                }
                axum::response::IntoResponse::into_response(Json(json!({
                    "id": "c1",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "over tls"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                })))
            }),
        )
}

async fn https_engine(server: &Issued, client_ca: Option<&std::path::Path>) -> HttpsServer {
    serve_https(engine(), Pki::server_config(server, client_ca)).await
}

fn upstream(url: &str, tls: ClientTls) -> Result<Upstream, UpstreamError> {
    let mut cfg = UpstreamConfig::new(url);
    cfg.health_path = String::new();
    cfg.timeout = Duration::from_secs(5);
    cfg.connect_timeout = Duration::from_secs(2);
    cfg.ca_file = tls.ca_file;
    cfg.client_cert = tls.client_cert;
    cfg.client_key = tls.client_key;
    Upstream::new("tls-test".into(), cfg)
}

fn chat() -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
}

#[tokio::test]
async fn an_https_upstream_signed_by_the_configured_ca_answers() {
    bounded(async {
        let pki = Pki::new("ok");
        let server = https_engine(&pki.server(), None).await;
        let ca = ClientTls {
            ca_file: Some(pki.ca_file()),
            ..ClientTls::default()
        };
        for url in [server.url(), server.url_by_name()] {
            let up = upstream(&url, ca.clone()).unwrap();
            let v = up.complete("/v1/chat/completions", chat()).await.unwrap();
            assert_eq!(v["choices"][0]["message"]["content"], "over tls", "{url}");
            // A second call reuses the pooled connection.
            up.complete("/v1/chat/completions", chat()).await.unwrap();
            let chunks: Vec<_> = up
                .stream("/v1/chat/completions", chat())
                .await
                .unwrap()
                .collect()
                .await;
            assert_eq!(chunks.len(), 2, "{chunks:?}");
            assert!(chunks.iter().all(Result::is_ok), "{chunks:?}");
        }
    })
    .await
}

#[tokio::test]
async fn a_certificate_from_an_untrusted_ca_fails_at_once_with_a_tls_error() {
    bounded(async {
        let pki = Pki::new("real");
        let other = Pki::new("other");
        let server = https_engine(&pki.server(), None).await;
        // Another CA, and the platform's roots: neither signed it.
        for tls in [
            ClientTls {
                ca_file: Some(other.ca_file()),
                ..ClientTls::default()
            },
            ClientTls::default(),
        ] {
            let up = upstream(&server.url(), tls.clone()).unwrap();
            let started = Instant::now();
            let e = up
                .complete("/v1/chat/completions", chat())
                .await
                .unwrap_err();
            let took = started.elapsed();
            let text = e.to_string();
            eprintln!("untrusted ({tls:?}): {text} after {took:?}");
            assert!(matches!(e, UpstreamError::Tls { .. }), "{e:?}");
            assert!(
                text.contains("UnknownIssuer") && text.contains("ca_file"),
                "{text}"
            );
            assert!(e.is_unsent(), "a refused handshake sent nothing");
            assert_eq!(e.http_status(), 502);
            assert!(took < Duration::from_secs(2), "{took:?}");
            let help = miette::Diagnostic::help(&e).unwrap().to_string();
            assert!(help.contains("ca_file"), "{help}");
        }
    })
    .await
}

#[tokio::test]
async fn mutual_tls_presents_the_client_certificate() {
    bounded(async {
        let pki = Pki::new("mtls");
        let server = https_engine(&pki.server(), Some(&pki.ca_file())).await;
        let without = upstream(
            &server.url(),
            ClientTls {
                ca_file: Some(pki.ca_file()),
                ..ClientTls::default()
            },
        )
        .unwrap();
        let e = without
            .complete("/v1/chat/completions", chat())
            .await
            .unwrap_err();
        eprintln!("without a client certificate: {e}");
        assert!(matches!(e, UpstreamError::Tls { .. }), "{e:?}");
        assert!(e.to_string().contains("client_cert"), "{e}");

        // A certificate from another CA is refused too.
        let other = Pki::new("mtls-other");
        let stranger = other.client();
        let e = upstream(
            &server.url(),
            ClientTls {
                ca_file: Some(pki.ca_file()),
                client_cert: Some(stranger.cert.clone()),
                client_key: Some(stranger.key.clone()),
            },
        )
        .unwrap()
        .complete("/v1/chat/completions", chat())
        .await
        .unwrap_err();
        eprintln!("a client certificate from another CA: {e}");
        assert!(matches!(e, UpstreamError::Tls { .. }), "{e:?}");

        let me = pki.client();
        let with = upstream(
            &server.url(),
            ClientTls {
                ca_file: Some(pki.ca_file()),
                client_cert: Some(me.cert.clone()),
                client_key: Some(me.key.clone()),
            },
        )
        .unwrap();
        let v = with.complete("/v1/chat/completions", chat()).await.unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "over tls");

        // A key that is not the certificate's is refused at startup.
        let e = upstream(
            &server.url(),
            ClientTls {
                ca_file: Some(pki.ca_file()),
                client_cert: Some(me.cert.clone()),
                client_key: Some(stranger.key.clone()),
            },
        )
        .unwrap_err();
        eprintln!("a key that is not the certificate's: {e}");
        assert!(matches!(e, UpstreamError::Config { .. }), "{e:?}");
    })
    .await
}

const POLICY: &str = r#"
pool gpu { gpus 2 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 16 }
}
tier high { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
classify { default => tier high }
admit high { default => queue max_wait 2s }
route [high] tiny { default => fp16 }
"#;

#[tokio::test]
async fn the_gateway_serves_through_an_https_upstream_with_mutual_tls() {
    bounded(async {
        let pki = Pki::new("gateway");
        let server = https_engine(&pki.server(), Some(&pki.ca_file())).await;
        let me = pki.client();
        let text = format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\n\
             url = \"{}\"\nconcurrency = 4\nhealth_interval = \"200ms\"\n\
             ca_file = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"{}\"\n",
            server.url_by_name(),
            pki.ca_file().display(),
            me.cert.display(),
            me.key.display()
        );
        let cfg = ServerConfig::parse("kiln.toml", &text).unwrap();
        let gw = serve_on_loopback(policy("tls.kiln", POLICY), cfg).await;
        let c = client(Duration::from_secs(10));
        let base = format!("http://{}", gw.addr);
        for stream in [false, true] {
            let mut body = chat();
            body["stream"] = json!(stream);
            let r = c
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("k-alpha")
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "stream {stream}");
            let text = r.text().await.unwrap();
            assert!(
                text.contains("over tls") || text.contains("\"hi\""),
                "{text}"
            );
        }
        gw.stop().await;

        // A misspelt setting is refused, with the right one suggested.
        let e = ServerConfig::parse(
            "kiln.toml",
            &text.replace("client_cert =", "client_crt ="),
        )
        .unwrap_err();
        let help = miette::Diagnostic::help(&e).unwrap().to_string();
        assert!(help.contains("client_cert"), "{help}");
    })
    .await
}

// ---------------------------------------------------------------------------
// rediss://

fn store(url: String, tls: ClientTls) -> Result<Store, kiln::shared::StoreError> {
    Store::open(&StoreConfig {
        url,
        namespace: "tls-test".into(),
        replica: "r1".into(),
        lease: Duration::from_secs(5),
        tls,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_redis_with_a_custom_ca_and_a_client_certificate() {
    let pki = Pki::new("redis");
    let Some(redis) = Redis::start_tls(&pki.server(), &pki.ca_file(), true) else {
        return;
    };
    bounded(async {
        let me = pki.client();
        let good = ClientTls {
            ca_file: Some(pki.ca_file()),
            client_cert: Some(me.cert.clone()),
            client_key: Some(me.key.clone()),
        };
        let s = store(redis.tls_url(), good.clone()).unwrap();
        // The first call connects (TLS handshake, client certificate).
        let mut ok = false;
        for _ in 0..20 {
            if s.ping().await.is_ok() {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ok, "PING over TLS never succeeded: {:?}", s.ping().await);
        assert!(s.is_up());

        // Another CA: a clear error naming the certificate, in bounded time.
        let other = Pki::new("redis-other");
        let wrong = store(
            redis.tls_url(),
            ClientTls {
                ca_file: Some(other.ca_file()),
                ..good.clone()
            },
        )
        .unwrap();
        let started = Instant::now();
        let e = wrong.ping().await.unwrap_err();
        eprintln!("redis, untrusted CA: {e} after {:?}", started.elapsed());
        assert!(started.elapsed() < Duration::from_secs(2));
        let text = e.to_string();
        assert!(
            text.contains("certificate") || text.contains("UnknownIssuer"),
            "{text}"
        );
        assert!(!wrong.is_up());

        // No client certificate where Redis requires one.
        let anonymous = store(
            redis.tls_url(),
            ClientTls {
                ca_file: Some(pki.ca_file()),
                ..ClientTls::default()
            },
        )
        .unwrap();
        let e = anonymous.ping().await.unwrap_err();
        eprintln!("redis, no client certificate: {e}");

        // TLS settings with a plain URL, and half an identity, are refused.
        let plain = redis.tls_url().replacen("rediss://", "redis://", 1);
        assert!(matches!(
            store(plain, good.clone()),
            Err(kiln::shared::StoreError::Tls { .. })
        ));
        let half = ClientTls {
            client_key: None,
            ..good
        };
        let e = store(redis.tls_url(), half).err().unwrap();
        assert!(e.to_string().contains("client_key"), "{e}");
    })
    .await
}
