//! What a batch says about itself in its metadata (`kiln_priority`,
//! `kiln_preemptible`, `kiln_max_in_flight`), on a gateway on 127.0.0.1:0
//! with the simulated backend: refused in words outside its tier's bounds,
//! shown on the batch object, and honoured: a tenant's batch with the
//! higher priority runs first whatever the order it came in, and a batch
//! capped at two items in flight never has more on the GPUs while an
//! uncapped one, in the same run, fills them. Every loop is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::batches::{create, get, jsonl, terminal, until, upload};
use support::{metric_sum, policy, scrape, serve_on_loopback};

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 8 }
}
tier interactive { priority 100 slo { ttft 2s } preempts [batch] }
tier batch { priority 40 slo { window 24h } preemptible }
tier eval { priority 30 slo { window 24h } }
tenant alpha { owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] }
tenant beta { owner "b@x" tiers [eval] api_keys ["k-beta"] }
classify {
  when tenant == beta => tier eval
  when batch => tier batch
  default => tier interactive
}
route [interactive, batch, eval] tiny { default => fp16 }
"#;

/// A gateway whose batch runner hands at most `max_in_flight` items to the
/// request path at once.
async fn gateway(max_in_flight: usize) -> Running {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = 20.0;
    cfg.batch.max_in_flight = max_in_flight;
    serve_on_loopback(policy("job.kiln", POLICY), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_outside_the_tiers_bounds_are_refused_in_words() {
    let srv = gateway(16).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let file = upload(&c, &base, "k-alpha", &jsonl("a", "tiny", 2, 4)).await;
    for (metadata, says) in [
        (json!({"kiln_priority": "50"}), "0 to 40"),
        (json!({"kiln_priority": "soon"}), "whole number"),
        (json!({"kiln_preemptible": "false"}), "never protect them"),
        (json!({"kiln_max_in_flight": "0"}), "1 to 10000"),
        (json!({"kiln_prioritty": "5"}), "not a kiln setting"),
    ] {
        let r = create(&c, &base, "k-alpha", &file, "24h", metadata.clone()).await;
        assert_eq!(r.status(), 400, "{metadata}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "metadata", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{metadata}: {msg}");
    }
    // Within bounds: accepted and shown on the batch object.
    let r = create(
        &c,
        &base,
        "k-alpha",
        &file,
        "24h",
        json!({"job": "nightly", "kiln_priority": "10", "kiln_max_in_flight": "3"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["kiln"]["job"]["priority"], 10, "{b}");
    assert_eq!(b["kiln"]["job"]["max_in_flight"], 3, "{b}");
    assert_eq!(b["kiln"]["job"]["preemptible"], Value::Null, "{b}");
    // A tier that is not preemptible: its batches may opt in, and
    // "false" there changes nothing, so it is accepted.
    let file = upload(&c, &base, "k-beta", &jsonl("e", "tiny", 2, 4)).await;
    for v in ["true", "false"] {
        let r = create(
            &c,
            &base,
            "k-beta",
            &file,
            "24h",
            json!({"kiln_preemptible": v}),
        )
        .await;
        assert_eq!(r.status(), 200, "{v}");
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["kiln"]["tier"], "eval");
        assert_eq!(b["kiln"]["job"]["preemptible"], v == "true");
    }
    srv.stop().await;
}

/// Two batches of one tenant, the older one with `older` metadata: what
/// each had completed when the first of them was seen complete, and the
/// newer one's rank at submission.
async fn race(c: &reqwest::Client, base: &str, older: Value) -> ([u64; 2], Value) {
    let a = upload(c, base, "k-alpha", &jsonl("older", "tiny", 24, 200)).await;
    let b = upload(c, base, "k-alpha", &jsonl("newer", "tiny", 24, 200)).await;
    let r = create(c, base, "k-alpha", &a, "24h", older).await;
    assert_eq!(r.status(), 200);
    let a: Value = r.json().await.unwrap();
    let r = create(c, base, "k-alpha", &b, "24h", json!({})).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let ids = [
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
    ];
    let seen = until(c, base, "k-alpha", &ids, Duration::from_secs(60), |v| {
        v.iter().any(|b| b["status"] == "completed")
    })
    .await;
    let done = |b: &Value| b["request_counts"]["completed"].as_u64().unwrap();
    let counts = [done(&seen[0]), done(&seen[1])];
    let end = until(c, base, "k-alpha", &ids, Duration::from_secs(60), |v| {
        v.iter().all(terminal)
    })
    .await;
    assert!(end.iter().all(|b| b["status"] == "completed"), "{end:?}");
    (counts, b["kiln"]["promise"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_higher_priority_batch_runs_first_whatever_came_first() {
    // Four items in flight at a time: the group's backlog is what the
    // order decides.
    let srv = gateway(4).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    // Alike, the older batch runs first (its window ends first).
    let ([older, newer], promise) = race(&c, &base, json!({})).await;
    assert_eq!(older, 24, "{older} {newer}");
    assert!(newer <= 12, "the newer one waited: {older} {newer}");
    assert_eq!(promise["rank"], 1, "{promise}");
    // The older one steps back below its tier's priority (40): the newer
    // one is promised the first place and takes it.
    let ([older, newer], promise) = race(&c, &base, json!({"kiln_priority": "5"})).await;
    assert_eq!(promise["rank"], 0, "{promise}");
    assert_eq!(newer, 24, "{older} {newer}");
    assert!(older <= 12, "the stepped-back one waited: {older} {newer}");
    srv.stop().await;
}

/// The most sequences running at once on the pool while `id` runs.
async fn most_running(c: &reqwest::Client, base: &str, id: &str) -> (f64, Value) {
    let end = Instant::now() + Duration::from_secs(60);
    let mut most = 0.0f64;
    loop {
        let m = scrape(c, base).await;
        most = most.max(metric_sum(&m, "kiln_replica_slots_used", &[]));
        let b = get(c, base, "k-alpha", id).await;
        if terminal(&b) || Instant::now() >= end {
            return (most, b);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_batch_never_has_more_items_running_than_its_cap() {
    let srv = gateway(16).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    // Items long enough (tens of ms each at speed 20) that polling every
    // 10 ms sees the uncapped batch fill the slots on a loaded machine: at
    // 60 tokens the whole batch ran between two polls on CI.
    let file = upload(&c, &base, "k-alpha", &jsonl("c", "tiny", 30, 400)).await;
    let r = create(
        &c,
        &base,
        "k-alpha",
        &file,
        "24h",
        json!({"kiln_max_in_flight": "2"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let capped: Value = r.json().await.unwrap();
    let (most, b) = most_running(&c, &base, capped["id"].as_str().unwrap()).await;
    assert_eq!(b["status"], "completed", "{b}");
    assert!((1.0..=2.0).contains(&most), "{most} running at once");
    // The same batch uncapped fills the replica's eight slots.
    let r = create(&c, &base, "k-alpha", &file, "24h", json!({})).await;
    let open: Value = r.json().await.unwrap();
    let (most, b) = most_running(&c, &base, open["id"].as_str().unwrap()).await;
    assert_eq!(b["status"], "completed", "{b}");
    assert!(most > 2.0, "{most} running at once without a cap");
    srv.stop().await;
}

/// Seconds from creation to the predicted finish `POST /v1/batches`
/// answered with.
async fn promised_secs(r: reqwest::Response) -> i64 {
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let finish = b["kiln"]["predicted_finish_at"]
        .as_i64()
        .expect("a prediction");
    finish - b["created_at"].as_i64().unwrap()
}

/// Seconds from creation to the predicted finish of a fresh batch of 200
/// items of 200 tokens, alone on a gateway at real speed.
async fn predicted_secs(metadata: Value) -> i64 {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = 1.0;
    cfg.batch.max_in_flight = 64;
    let srv = serve_on_loopback(policy("job.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let file = upload(&c, &base, "k-alpha", &jsonl("p", "tiny", 200, 200)).await;
    let r = create(&c, &base, "k-alpha", &file, "24h", metadata).await;
    let secs = promised_secs(r).await;
    srv.stop().await;
    secs
}

/// A batch allowed one item at a time finishes no sooner than its items'
/// latencies one after another: its promise says so, rather than the
/// pace of a batch that fills the replica's eight slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_batch_is_promised_the_pace_its_cap_allows() {
    let open = predicted_secs(json!({})).await;
    let one = predicted_secs(json!({"kiln_max_in_flight": "1"})).await;
    assert!(open >= 1, "{open}");
    eprintln!("predicted: capped at 1 {one} s, uncapped {open} s");
    assert!(one >= 3 * open, "capped at 1: {one} s, uncapped: {open} s");
}

/// Two tenants' batches in one tier, weights 1 and 1, unless an exception
/// covering today grants alpha weight 3.
fn shared_tier_policy(grant: bool) -> String {
    let mut text = String::from(
        r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 8 }
}
tier batch { priority 40 slo { window 24h } }
tenant alpha { owner "a@x" tiers [batch] api_keys ["k-alpha"] }
tenant beta { owner "b@x" tiers [batch] api_keys ["k-beta"] }
classify { default => tier batch }
route batch tiny { default => fp16 }
"#,
    );
    if grant {
        use kiln::units::calendar::{civil_at, show_date};
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let today = civil_at(now_ms, None).date;
        text.push_str(&format!(
            "exception push {{\n  tenant alpha\n  dates {}..{}\n  weight 3\n  reason \"launch\"\n}}\n",
            show_date(today - 1),
            show_date(today + 1)
        ));
    }
    text
}

/// Seconds from creation to alpha's predicted finish, with beta's batch
/// already accepted in the same tier.
async fn alphas_prediction(grant: bool) -> i64 {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = 1.0;
    let srv = serve_on_loopback(policy("share.kiln", &shared_tier_policy(grant)), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let fb = upload(&c, &base, "k-beta", &jsonl("b", "tiny", 200, 200)).await;
    assert_eq!(
        create(&c, &base, "k-beta", &fb, "24h", json!({}))
            .await
            .status(),
        200
    );
    let fa = upload(&c, &base, "k-alpha", &jsonl("a", "tiny", 200, 200)).await;
    let r = create(&c, &base, "k-alpha", &fa, "24h", json!({})).await;
    let secs = promised_secs(r).await;
    srv.stop().await;
    secs
}

/// The promise reads today's weights: an exception that triples alpha's
/// weight (a 3:1 share of the tier against 1:1) shortens its predicted
/// finish to about two thirds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_granted_by_exception_speeds_the_promise() {
    let declared = alphas_prediction(false).await;
    let granted = alphas_prediction(true).await;
    eprintln!("alpha predicted: {declared} s at weight 1, {granted} s at weight 3");
    assert!(declared >= 3, "{declared}");
    assert!(
        (granted as f64) <= 0.8 * declared as f64,
        "granted {granted} s against declared {declared} s"
    );
}
