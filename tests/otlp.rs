//! Issue 31, OpenTelemetry over OTLP (`[otlp]`, the `otlp` feature): one
//! span per request reaches a collector (a loopback one here, OTLP/HTTP
//! JSON and protobuf), in the request's W3C trace: kiln's span is the
//! parent its upstream call names, a client's `traceparent` is its parent,
//! and its attributes follow the GenAI semantic conventions plus kiln's
//! decision. A refused request has its span too. Without the feature,
//! `[otlp]` stops the start with a diagnostic that says to build it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;

#[cfg(not(feature = "otlp"))]
#[tokio::test]
async fn without_the_feature_otlp_stops_the_start_and_says_why() {
    let cfg = ServerConfig::parse(
        "kiln.toml",
        "[otlp]\nendpoint = \"http://127.0.0.1:4318\"\n",
    )
    .unwrap();
    let e = kiln::server::start(kiln::server::ServeOptions {
        policy: support::policy("p.kiln", "pool gpu { gpus 1 kind \"H100-80GB\" memory 80GB }\nmodel tiny { params 1B kv_per_token 32KB variant fp16 { memory 4GB pools [gpu] } }\ntier chat { priority 1 }\ntenant a { owner \"o\" tiers [chat] }\nclassify { default => tier chat }\nroute chat tiny { default => fp16 }\n"),
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: None,
    })
    .await
    .err()
    .expect("refused");
    let help = miette::Diagnostic::help(&e)
        .map(|h| h.to_string())
        .unwrap_or_default();
    assert!(help.contains("--features otlp"), "{e}: {help}");
}

#[test]
fn a_bad_otlp_section_is_refused_with_help() {
    for (text, says) in [
        (
            "[otlp]\nendpoint = \"collector:4318\"\n",
            "not an http(s) URL",
        ),
        (
            "[otlp]\nendpoint = \"http://c:4318\"\nprotocol = \"grpc\"\n",
            "not one kiln speaks",
        ),
        (
            "[otlp]\nendpoint = \"http://c:4318\"\nmax_queue = 0\n",
            "max_queue",
        ),
        ("[otlp]\nendpoint = \"http://c:4318\"\nport = 1\n", "port"),
    ] {
        let e = ServerConfig::parse("kiln.toml", text).expect_err(text);
        assert!(format!("{e:?}").contains(says), "{text}: {e:?}");
    }
}

#[cfg(feature = "otlp")]
mod exported {
    use super::support;
    use axum::http::HeaderMap;
    use kiln::backend::http::trace::TraceParent;
    use kiln::server::config::ServerConfig;
    use serde_json::{json, Value};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] }
}
tier chat { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [chat] api_keys ["k-alpha"] quota { requests 2/min } }
classify { default => tier chat }
route chat tiny { default => fp16 }
"#;

    const CLIENT_TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    type Seen = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

    /// An upstream that answers every chat and keeps each `traceparent`,
    /// and a collector that keeps every export's content type and body.
    async fn loopback() -> (String, Arc<Mutex<Vec<String>>>, String, Seen) {
        use axum::routing::post;
        let parents: Arc<Mutex<Vec<String>>> = Arc::default();
        let keep = parents.clone();
        let upstream = axum::Router::new().route(
            "/v1/chat/completions",
            post(move |headers: HeaderMap| {
                let keep = keep.clone();
                async move {
                    keep.lock().unwrap().push(
                        headers
                            .get("traceparent")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_string(),
                    );
                    axum::Json(json!({
                        "id": "c1", "object": "chat.completion", "created": 0, "model": "tiny",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
                    }))
                }
            }),
        );
        let seen: Seen = Arc::default();
        let store = seen.clone();
        let collector = axum::Router::new().route(
            "/v1/traces",
            post(move |headers: HeaderMap, body: axum::body::Bytes| {
                let store = store.clone();
                async move {
                    let ct = headers
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    store.lock().unwrap().push((ct, body.to_vec()));
                    "{}"
                }
            }),
        );
        let mut urls = Vec::new();
        for app in [upstream, collector] {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            urls.push(format!("http://{}", l.local_addr().unwrap()));
            tokio::spawn(async move {
                let _ = axum::serve(l, app).await;
            });
        }
        (urls[0].clone(), parents, urls[1].clone(), seen)
    }

    fn attr(span: &Value, key: &str) -> Option<Value> {
        span["attributes"]
            .as_array()?
            .iter()
            .find(|a| a["key"] == key)
            .map(|a| {
                let v = &a["value"];
                ["stringValue", "intValue", "doubleValue", "boolValue"]
                    .iter()
                    .find_map(|k| v.get(*k).cloned())
                    .unwrap_or(Value::Null)
            })
    }

    fn int(v: Option<Value>) -> i64 {
        match v {
            Some(Value::Number(n)) => n.as_i64().unwrap(),
            Some(Value::String(s)) => s.parse().unwrap(),
            v => panic!("not an integer: {v:?}"),
        }
    }

    async fn run(protocol: &str) -> (Vec<Value>, Vec<TraceParent>, Vec<String>) {
        let (up, parents, collector, seen) = loopback().await;
        let text = format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{up}\"\nconcurrency = 4\nhealth_interval = \"10s\"\n\
             [otlp]\nendpoint = \"{collector}\"\nprotocol = \"{protocol}\"\nservice_name = \"kiln-test\"\nevery = \"100ms\"\n[otlp.headers]\nx-api-key = \"secret\"\n"
        );
        let srv = support::serve_on_loopback(
            support::policy("p.kiln", POLICY),
            ServerConfig::parse("kiln.toml", &text).unwrap(),
        )
        .await;
        let c = support::client(Duration::from_secs(30));
        let body = json!({"model": "tiny", "max_tokens": 2,
                          "messages": [{"role": "user", "content": "hello"}]});
        let mut statuses = Vec::new();
        for trace in [Some(CLIENT_TRACE), None, None] {
            let mut r = c
                .post(format!("http://{}/v1/chat/completions", srv.addr))
                .bearer_auth("k-alpha")
                .json(&body);
            if let Some(t) = trace {
                r = r.header("traceparent", t);
            }
            statuses.push(r.send().await.unwrap().status().as_u16());
        }
        // Two a minute: the third is refused by the quota.
        assert_eq!(statuses, vec![200, 200, 429]);
        // Stopping flushes what is batched.
        srv.stop().await;
        let parents: Vec<TraceParent> = parents
            .lock()
            .unwrap()
            .iter()
            .map(|t| TraceParent::parse(t).unwrap())
            .collect();
        let exports = seen.lock().unwrap().clone();
        assert!(!exports.is_empty(), "nothing reached the collector");
        let mut spans = Vec::new();
        let mut types = Vec::new();
        for (ct, body) in exports {
            types.push(ct.clone());
            let v: Value = if ct.contains("json") {
                serde_json::from_slice(&body).unwrap()
            } else {
                // Protobuf, not decoded here (that would put OpenTelemetry's
                // generated types into every test build): its strings and
                // the raw ids it must carry are checked, and the JSON run
                // checks the rest.
                let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
                assert!(has(b"gen_ai.request.model") && has(b"chat tiny") && has(b"kiln-test"));
                spans.push(Value::String(hex_of(&body)));
                continue;
            };
            for rs in v["resourceSpans"].as_array().unwrap() {
                let service = rs["resource"]["attributes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|a| a["key"] == "service.name")
                    .map(|a| a["value"]["stringValue"].clone());
                assert_eq!(service, Some(json!("kiln-test")));
                for ss in rs["scopeSpans"].as_array().unwrap() {
                    spans.extend(ss["spans"].as_array().unwrap().iter().cloned());
                }
            }
        }
        (spans, parents, types)
    }

    fn check(spans: &[Value], parents: &[TraceParent]) {
        assert_eq!(spans.len(), 3, "{spans:#?}");
        assert_eq!(parents.len(), 2, "the refused one never went upstream");
        let client = TraceParent::parse(CLIENT_TRACE).unwrap();
        let hex = |v: &Value| v.as_str().unwrap_or("").to_ascii_lowercase();
        for (i, p) in parents.iter().enumerate() {
            // kiln's span is the parent the upstream saw.
            let s = spans
                .iter()
                .find(|s| hex(&s["spanId"]) == format!("{:016x}", p.parent_id))
                .unwrap_or_else(|| panic!("no span for upstream call {i}: {spans:#?}"));
            assert_eq!(hex(&s["traceId"]), format!("{:032x}", p.trace_id));
            assert_eq!(s["kind"], json!(2), "SERVER");
            assert_eq!(s["name"], "chat tiny");
            assert_eq!(attr(s, "gen_ai.operation.name"), Some(json!("chat")));
            assert_eq!(attr(s, "gen_ai.request.model"), Some(json!("tiny")));
            assert!(int(attr(s, "gen_ai.usage.input_tokens")) > 0);
            assert_eq!(int(attr(s, "gen_ai.usage.output_tokens")), 1);
            assert_eq!(int(attr(s, "gen_ai.request.max_tokens")), 2);
            assert_eq!(attr(s, "kiln.tier"), Some(json!("chat")));
            assert_eq!(attr(s, "kiln.tenant"), Some(json!("alpha")));
            assert_eq!(attr(s, "kiln.outcome"), Some(json!("ok")));
            assert_eq!(int(attr(s, "http.response.status_code")), 200);
            if i == 0 {
                // The client's trace, its span as kiln's parent.
                assert_eq!(p.trace_id, client.trace_id);
                assert_eq!(
                    hex(&s["parentSpanId"]),
                    format!("{:016x}", client.parent_id)
                );
            } else {
                assert_ne!(p.trace_id, client.trace_id);
                assert_eq!(hex(&s["parentSpanId"]), "", "a root span");
            }
        }
        let refused = spans
            .iter()
            .find(|s| attr(s, "kiln.outcome") == Some(json!("refused")))
            .expect("the refused request's span");
        assert_eq!(attr(refused, "kiln.reason"), Some(json!("quota")));
        assert_eq!(int(attr(refused, "http.response.status_code")), 429);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn request_spans_reach_the_collector_as_json_in_the_requests_trace() {
        let (spans, parents, types) = run("http/json").await;
        assert!(
            types.iter().all(|t| t.contains("application/json")),
            "{types:?}"
        );
        check(&spans, &parents);
    }

    fn hex_of(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn request_spans_reach_the_collector_as_protobuf() {
        let (bodies, parents, types) = run("http/protobuf").await;
        assert!(types.iter().all(|t| t.contains("protobuf")), "{types:?}");
        let all: String = bodies.iter().filter_map(|b| b.as_str()).collect();
        for p in &parents {
            // Each span's trace id and kiln's span id, as raw bytes.
            assert!(all.contains(&format!("{:032x}", p.trace_id)), "trace id");
            assert!(all.contains(&format!("{:016x}", p.parent_id)), "span id");
        }
    }
}
