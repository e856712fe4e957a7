//! Useful and wasted GPU time on the simulated pools: a request preempted
//! for a protected tier and served later wastes the recompute of its KV
//! (`kiln_gpu_seconds_wasted_total{reason="recompute"}`, a part of its
//! GPU time); one whose tier says `on_preempt reject` is told 503
//! `preempted` and wastes all it used (`reason="preempted"`); the
//! protected request wastes nothing. The counters are a part of
//! `kiln_gpu_seconds_total`, and `/admin/costs` agrees with it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::{metric_sum, policy, scrape, serve_on_loopback};

/// One replica that runs one sequence at a time: a protected request
/// must preempt whatever runs.
const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 1 }
}
tier high { priority 100 slo { ttft 300ms } preempts [batch, batch_strict] }
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

fn body(prompt_words: usize, max_tokens: u64) -> Value {
    let text = vec!["word"; prompt_words].join(" ");
    json!({"model": "tiny", "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens})
}

async fn send(c: &reqwest::Client, base: &str, key: &str, b: &Value) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(b)
        .send()
        .await
        .unwrap()
}

/// Waits (bounded) until `tier` has a request running.
async fn running(c: &reqwest::Client, base: &str, tier: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let m = scrape(c, base).await;
        let busy = metric_sum(&m, "kiln_replica_slots_used", &[]);
        let queued = metric_sum(&m, "kiln_queue_depth", &[&format!("tier=\"{tier}\"")]);
        if busy >= 1.0 && queued == 0.0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no {tier} request started");
}

/// The long request's status, body and Retry-After, and the scrape after.
async fn preempted_by_a_protected_request(
    key: &str,
    tier: &str,
) -> (u16, Value, Option<String>, String) {
    let cfg = ServerConfig::parse("kiln.toml", "[sim]\nspeed = 1.0\n").unwrap();
    let srv = serve_on_loopback(policy("waste.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(60));
    // A long prompt and a long answer: seconds of work on the one slot.
    let long = {
        let (c, base, key) = (c.clone(), base.clone(), key.to_string());
        tokio::spawn(async move { send(&c, &base, &key, &body(2000, 400)).await })
    };
    running(&c, &base, tier).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hi = send(&c, &base, "k-alpha", &body(10, 5)).await;
    assert_eq!(hi.status(), 200);
    let r = long.await.unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let m = scrape(&c, &base).await;
    let costs: Value = c
        .get(format!("{base}/admin/costs"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let total = metric_sum(&m, "kiln_gpu_seconds_total", &[]);
    let charged = costs["costs"]["total"]["gpu_seconds"].as_f64().unwrap();
    assert!((total - charged).abs() < 1e-9, "{total} vs {charged}");
    // The protected request wasted nothing; nothing wasted more than all.
    let wasted = metric_sum(&m, "kiln_gpu_seconds_wasted_total", &[]);
    assert_eq!(
        metric_sum(&m, "kiln_gpu_seconds_wasted_total", &["tier=\"high\""]),
        0.0,
        "{m}"
    );
    assert!(wasted <= total + 1e-9, "{wasted} > {total}");
    srv.stop().await;
    (status, v, retry, m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_request_served_later_wastes_its_recompute() {
    let (status, _, _, m) = preempted_by_a_protected_request("k-beta", "batch").await;
    assert_eq!(status, 200);
    let gpu = metric_sum(&m, "kiln_gpu_seconds_total", &["tier=\"batch\""]);
    let recompute = metric_sum(
        &m,
        "kiln_gpu_seconds_wasted_total",
        &["tier=\"batch\"", "reason=\"recompute\""],
    );
    assert!(
        recompute > 0.0 && recompute < gpu,
        "recompute {recompute} of {gpu}: {m}"
    );
    assert_eq!(
        metric_sum(&m, "kiln_gpu_seconds_wasted_total", &["tier=\"batch\""]),
        recompute,
        "{m}"
    );
    // The preemption is counted (work preempted while it ran was not).
    assert_eq!(
        metric_sum(&m, "kiln_preemptions_total", &["tier=\"batch\""]),
        1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_preempted_and_refused_wastes_all_it_used() {
    let (status, v, retry, m) = preempted_by_a_protected_request("k-gamma", "batch_strict").await;
    // The answer its tier promises (it once said "the scheduler stopped").
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "preempted", "{v}");
    assert!(
        retry
            .and_then(|r| r.parse::<u64>().ok())
            .is_some_and(|r| r >= 1),
        "a Retry-After"
    );
    let gpu = metric_sum(&m, "kiln_gpu_seconds_total", &["tier=\"batch_strict\""]);
    let wasted = metric_sum(
        &m,
        "kiln_gpu_seconds_wasted_total",
        &["tier=\"batch_strict\"", "reason=\"preempted\""],
    );
    assert!(
        wasted > 0.0 && (wasted - gpu).abs() < 1e-9,
        "{wasted} of {gpu}: {m}"
    );
    assert_eq!(
        metric_sum(&m, "kiln_preemptions_total", &["tier=\"batch_strict\""]),
        1.0,
        "{m}"
    );
}
