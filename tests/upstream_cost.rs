//! GPU time on HTTP upstreams: a request is charged its replica's GPUs ×
//! the wall time it held a slot, split evenly with the requests holding
//! slots at the same time (docs/gateway.md, "Cost"), in its `x-kiln-gpu-seconds`,
//! `/admin/costs` and the metrics, all the same figures.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use axum::routing::{get, post};
use axum::{Json, Router};
use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::{client, policy, serve_on_loopback};

/// How long the mock engine takes over each request.
const WORK: Duration = Duration::from_millis(400);
/// The variant's GPUs per replica.
const GPUS: f64 = 2.0;

const POLICY: &str = r#"
pool gpu { gpus 4 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB gpus_per_replica 2 pools [gpu] max_batch 16 }
}
tier high { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] cost 3.6/h }
classify { default => tier high }
admit high { default => queue max_wait 5s }
route [high] tiny { default => fp16 }
"#;

async fn engine() -> (String, tokio::task::JoinHandle<()>) {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/chat/completions",
            post(|Json(body): Json<Value>| async move {
                tokio::time::sleep(WORK).await;
                if body["stream"] == json!(true) {
                    let events = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
                    return axum::response::Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(axum::body::Body::from(events))
                        .unwrap();
                }
                axum::response::IntoResponse::into_response(Json(json!({
                    "id": "c", "object": "chat.completion", "model": "tiny",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
                })))
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (url, task)
}

fn config(url: &str) -> ServerConfig {
    ServerConfig::parse(
        "kiln.toml",
        &format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\n\
             url = \"{url}\"\nconcurrency = 8\n"
        ),
    )
    .unwrap()
}

async fn chat(c: &reqwest::Client, base: &str, stream: bool) -> reqwest::Response {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r
}

async fn costs(c: &reqwest::Client, base: &str) -> Value {
    let v: Value = c
        .get(format!("{base}/admin/costs"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["costs"].clone()
}

async fn metric_sum(c: &reqwest::Client, base: &str, metric: &str) -> f64 {
    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    m.lines()
        .filter(|l| l.strip_prefix(metric).is_some_and(|r| r.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_request_is_charged_its_replicas_gpus_for_the_time_it_held_a_slot() {
    let (url, engine) = engine().await;
    let gw = serve_on_loopback(policy("cost.kiln", POLICY), config(&url)).await;
    let base = format!("http://{}", gw.addr);
    let c = client(Duration::from_secs(20));

    // Alone: GPUs × the time it held its slot.
    let r = chat(&c, &base, false).await;
    let header: f64 = r.headers()["x-kiln-gpu-seconds"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let _ = r.bytes().await;
    let work = WORK.as_secs_f64();
    eprintln!("one request of {work}s on a {GPUS}-GPU replica: charged {header} GPU-seconds");
    assert!(
        header >= GPUS * work && header < GPUS * (work + 0.5),
        "{header}"
    );
    let one = costs(&c, &base).await;
    assert_eq!(one["total"]["requests"], 1, "{one}");
    let total = one["total"]["gpu_seconds"].as_f64().unwrap();
    assert!((total - header).abs() < 1e-5, "{total} vs {header}");
    // `cost 3.6/h` is $0.001 a GPU-second.
    assert!(
        close(one["total"]["cost"].as_f64().unwrap(), total * 0.001),
        "{one}"
    );

    // Eight at once, and a stream: they split the replica's time, so
    // together they are charged its GPUs × the time any of them ran, not
    // eight times that.
    let started = Instant::now();
    let mut calls = Vec::new();
    for i in 0..8 {
        let (c, base) = (c.clone(), base.clone());
        calls.push(tokio::spawn(async move {
            let r = chat(&c, &base, i == 0).await;
            let _ = r.bytes().await;
        }));
    }
    for call in calls {
        call.await.unwrap();
    }
    let span = started.elapsed().as_secs_f64();
    let all = costs(&c, &base).await;
    assert_eq!(all["total"]["requests"], 9, "{all}");
    let eight = all["total"]["gpu_seconds"].as_f64().unwrap() - total;
    eprintln!(
        "eight overlapping requests of {work}s over {span:.3}s: charged {eight:.3} GPU-seconds together (alone each would be {:.3})",
        GPUS * work
    );
    assert!(eight >= GPUS * work * 0.95, "{eight}");
    assert!(eight <= GPUS * span + 1e-3, "{eight} > {GPUS} × {span}");
    assert!(eight < 8.0 * GPUS * work / 2.0, "{eight}");

    // The metrics hold the same figures.
    let gpu_metric = metric_sum(&c, &base, "kiln_gpu_seconds_total").await;
    let cost_metric = metric_sum(&c, &base, "kiln_cost_usd_total").await;
    let total_all = all["total"]["gpu_seconds"].as_f64().unwrap();
    assert!(close(gpu_metric, total_all), "{gpu_metric} vs {total_all}");
    assert!(
        close(cost_metric, all["total"]["cost"].as_f64().unwrap()),
        "{cost_metric}"
    );
    let pools = all["pools"].as_array().unwrap();
    assert_eq!(pools.len(), 1, "{all}");
    gw.stop().await;
    engine.abort();
}
