//! Promises that account for the queue: batches submitted together whose
//! windows are jointly feasible only one after the other all meet them
//! (and with the old even split they do not), and on generated mixes the
//! `predicted_miss` flag at submission is right at least 95% of the time.
//! A gateway on 127.0.0.1:0 on the simulated backend (`[sim] speed`);
//! every loop is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::batch_config::{BatchOrder, OnPredictedMiss};
use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::{policy, serve_on_loopback};

/// Simulator speed: a window of `w` seconds lasts `w / SPEED` wall seconds.
const SPEED: f64 = 10.0;

fn policy_text() -> String {
    // Windows of 60 s to 1200 s (6 s to 120 s of wall time at SPEED).
    let windows: Vec<String> = (6..=120).map(|i| format!("{}s", i * 10)).collect();
    format!(
        r#"
pool gpu {{ gpus 1 kind "H100-80GB" memory 80GB }}
model tiny {{
  params 1B
  kv_per_token 32KB
  variant fp16 {{ memory 4GB pools [gpu] max_batch 8 }}
}}
tier interactive {{ priority 100 slo {{ ttft 2s }} preempts [batch] }}
tier batch {{ priority 10 slo {{ window 24h }} preemptible completion_windows [{}] }}
tenant alpha {{ owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] }}
classify {{
  when batch => tier batch
  default => tier interactive
}}
route [interactive, batch] tiny {{ default => fp16 }}
"#,
        windows.join(", ")
    )
}

async fn gateway(order: BatchOrder, on_miss: OnPredictedMiss) -> Running {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = SPEED;
    cfg.batch.order = order;
    cfg.batch.on_predicted_miss = on_miss;
    serve_on_loopback(policy("p.kiln", &policy_text()), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

fn jsonl(tag: &str, n: usize, max_tokens: u64) -> String {
    support::batches::jsonl(tag, "tiny", n, max_tokens)
}

async fn upload(c: &reqwest::Client, base: &str, content: &str) -> String {
    support::batches::upload(c, base, "k-alpha", content).await
}

async fn create(c: &reqwest::Client, base: &str, file: &str, window_s: u64) -> reqwest::Response {
    c.post(format!("{base}/v1/batches"))
        .bearer_auth("k-alpha")
        .json(&json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": format!("{window_s}s")}))
        .send()
        .await
        .unwrap()
}

async fn get(c: &reqwest::Client, base: &str, id: &str) -> Value {
    c.get(format!("{base}/v1/batches/{id}"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn terminal(b: &Value) -> bool {
    ["completed", "failed", "expired", "cancelled"].contains(&b["status"].as_str().unwrap())
}

/// Polls until every batch is final (bounded): the final objects.
async fn wait_all(c: &reqwest::Client, base: &str, ids: &[String]) -> Vec<Value> {
    wait_all_timed(c, base, ids).await.0
}

/// As [`wait_all`], with the wall seconds (from the call, to the 100 ms
/// poll) at which each batch was first seen final.
async fn wait_all_timed(c: &reqwest::Client, base: &str, ids: &[String]) -> (Vec<Value>, Vec<f64>) {
    let t = Instant::now();
    let mut final_at: Vec<Option<f64>> = vec![None; ids.len()];
    for _ in 0..1200 {
        let mut all = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let b = get(c, base, id).await;
            if terminal(&b) && final_at[i].is_none() {
                final_at[i] = Some(t.elapsed().as_secs_f64());
            }
            all.push(b);
        }
        if all.iter().all(terminal) {
            return (
                all,
                final_at.into_iter().map(|x| x.unwrap_or(0.0)).collect(),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("batches did not finish in time");
}

/// Met its window: every item completed before it expired.
fn met(b: &Value) -> bool {
    b["status"] == "completed"
        && b["request_counts"]["failed"] == 0
        && b["completed_at"].as_i64().unwrap() <= b["expires_at"].as_i64().unwrap()
}

/// Items that take about `secs` wall seconds alone on this gateway, and
/// that time (a calibration run of 300 items, which also shows the
/// planner the group's pace).
async fn unit(c: &reqwest::Client, base: &str, secs: f64) -> (usize, f64) {
    let d = calibrate(c, base, 300).await;
    let mut n = ((300.0 * secs / d).ceil() as usize).max(300);
    // A short run is dominated by its start: measure at the size itself
    // and correct once.
    let dn = calibrate(c, base, n).await;
    n = ((n as f64 * secs / dn).ceil() as usize).clamp(300, 20_000);
    let d = calibrate(c, base, n).await;
    (n, d)
}

/// Wall seconds one batch of `n` items takes alone on this gateway.
async fn calibrate(c: &reqwest::Client, base: &str, n: usize) -> f64 {
    let f = upload(c, base, &jsonl("cal", n, 8)).await;
    let t = Instant::now();
    let r = create(c, base, &f, 1200).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let done = wait_all(c, base, &[b["id"].as_str().unwrap().to_string()]).await;
    assert!(met(&done[0]), "{}", done[0]);
    t.elapsed().as_secs_f64()
}

/// Three batches of `n` items submitted together, windows 2, 3.5 and 5
/// times one batch's time alone (in submission order: the latest
/// deadline first): met one after the other (at 1, 2 and 3 times, a
/// margin for a loaded machine), while side by side all three finish
/// at about 3 times, past the first window.
/// Returns (met, flagged at submission, one batch alone, wall seconds to
/// the last, wall seconds to the one with the tightest window).
async fn three_in_sequence(order: BatchOrder) -> (usize, usize, f64, f64, f64) {
    let gw = gateway(order, OnPredictedMiss::Accept).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let (n, alone) = unit(&c, &base, 5.0).await;
    let mut files = Vec::new();
    for i in 0..3 {
        files.push(upload(&c, &base, &jsonl(&format!("b{i}"), n, 8)).await);
    }
    let t = Instant::now();
    let mut ids = Vec::new();
    let mut flagged = 0;
    for (f, mult) in files.iter().zip([5.0, 3.5, 2.0]) {
        let w = ((alone * mult * SPEED / 10.0).ceil() as u64 * 10).clamp(60, 1200);
        let r = create(&c, &base, f, w).await;
        assert_eq!(r.status(), 200);
        let b: Value = r.json().await.unwrap();
        if b["kiln"]["predicted_miss"] == true {
            flagged += 1;
        }
        ids.push(b["id"].as_str().unwrap().to_string());
    }
    let (done, final_at) = wait_all_timed(&c, &base, &ids).await;
    let took = t.elapsed().as_secs_f64();
    // Created last, with the tightest window.
    let tightest = final_at[2];
    let ok = done.iter().filter(|b| met(b)).count();
    eprintln!(
        "{order:?}: one batch alone {alone:.2} s; three together: {ok}/3 met their windows, {flagged} flagged at submission, tightest done after {tightest:.2} s, last after {took:.2} s; {:?}",
        done.iter()
            .map(|b| (b["status"].clone(), b["request_counts"]["completed"].clone()))
            .collect::<Vec<_>>()
    );
    gw.stop().await;
    (ok, flagged, alone, took, tightest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_feasible_only_in_sequence_all_meet_their_windows() {
    let (ok, flagged, alone, _, tightest) = three_in_sequence(BatchOrder::Deadline).await;
    assert_eq!(ok, 3, "in deadline order every window is met");
    assert_eq!(flagged, 0, "and none was flagged at submission");
    // The old even split, same mix, same machine, for comparison: the
    // three share the capacity, so the tightest finishes with the others,
    // about three times later than alone, where deadline order runs it
    // first. (Whether that also misses its window depends on how the
    // machine's load moved between the calibration and the run: CI saw
    // the even split meet all three once, the calibration run having been
    // slowed by other work; the order is what the planner decides.)
    let (even_ok, _, even_alone, _, even_tightest) = three_in_sequence(BatchOrder::Even).await;
    eprintln!("even split: {even_ok}/3 met");
    assert!(
        even_tightest / even_alone > 1.5 * (tightest / alone).max(1.0),
        "an even split finishes the tightest batch with the others ({even_tightest:.2} s, alone {even_alone:.2} s), deadline order first ({tightest:.2} s, alone {alone:.2} s)"
    );
}

/// A number from the environment, or `default`.
fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A tiny deterministic generator (splitmix64), so a failing mix repeats.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// Timing-bound: on a loaded 2-core machine the simulator falls behind
/// its speed and the flag errs on the optimistic side (BENCHMARKS.md:
/// 72.7–90.9% right there); run it alone: `cargo test --test
/// batch_promises -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "timing-bound: run alone on an idle machine (BENCHMARKS.md)"]
async fn the_flag_at_submission_is_right_on_generated_mixes() {
    let gw = gateway(BatchOrder::Deadline, OnPredictedMiss::Accept).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let (unit, alone) = unit(&c, &base, 4.0).await;
    // Seven mixes by default (about a minute); BENCHMARKS.md's figure
    // sets more (`KILN_FLAG_MIXES=30`) and another seed (`KILN_FLAG_SEED`).
    let mixes: usize = env_or("KILN_FLAG_MIXES", 7);
    let mut rng = Rng(env_or("KILN_FLAG_SEED", 0x6b69_6c6e));
    let (mut right, mut total) = (0usize, 0usize);
    let (mut optimistic, mut pessimistic) = (0usize, 0usize);
    let mut rows = Vec::new();
    for mix in 0..mixes {
        // 2 to 4 batches of 0.5x to 2x the unit, windows 0.5x to 4x the
        // unit's time alone, submitted together.
        let k = 2 + (rng.next() % 3) as usize;
        let mut files = Vec::new();
        for i in 0..k {
            let n = (unit as f64 * rng.uniform(0.5, 2.0)) as usize;
            let w = (alone * rng.uniform(0.5, 4.0) * SPEED / 10.0).ceil() as u64 * 10;
            files.push((
                upload(&c, &base, &jsonl(&format!("m{mix}b{i}"), n, 8)).await,
                n,
                w.clamp(60, 1200),
            ));
        }
        let mut made = Vec::new();
        for (f, n, w) in &files {
            let r = create(&c, &base, f, *w).await;
            assert_eq!(r.status(), 200);
            let b: Value = r.json().await.unwrap();
            made.push((
                b["id"].as_str().unwrap().to_string(),
                b["kiln"]["predicted_miss"] == true,
                *n,
                *w,
                b["created_at"].as_i64().unwrap_or(0),
                b["kiln"]["predicted_finish_at"].as_i64().unwrap_or(0),
                b["kiln"]["promise"]["pace_ratio"].as_f64().unwrap_or(0.0),
            ));
        }
        let ids: Vec<String> = made.iter().map(|m| m.0.clone()).collect();
        let done = wait_all(&c, &base, &ids).await;
        for ((_, flag, n, w, created, predicted, pace), b) in made.iter().zip(&done) {
            let missed = !met(b);
            total += 1;
            if *flag == missed {
                right += 1;
            } else if missed {
                optimistic += 1;
            } else {
                pessimistic += 1;
            }
            let end = b["completed_at"]
                .as_i64()
                .or(b["expired_at"].as_i64())
                .unwrap_or(0);
            rows.push(format!(
                "mix {mix}: {n} items, window {w}s: flagged {flag}, missed {missed}; predicted finish +{}s, ended +{}s, pace ratio {pace}",
                predicted - created,
                end - created
            ));
        }
    }
    let share = right as f64 / total as f64;
    eprintln!(
        "one batch of {unit} alone: {alone:.2} s\n{}\nflag right {right}/{total} ({:.1}%); wrong: {optimistic} missed unflagged, {pessimistic} flagged and met",
        rows.join("\n"),
        share * 100.0
    );
    assert!(
        share >= 0.95,
        "the flag was right {right}/{total} times:\n{}",
        rows.join("\n")
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_that_cannot_be_met_can_be_refused_with_the_predicted_finish() {
    let gw = gateway(BatchOrder::Deadline, OnPredictedMiss::Refuse).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let (n, alone) = unit(&c, &base, 3.0).await;
    // Two batches of five times the calibration, each in a window of
    // seven: either alone fits, both do not. The first is accepted; the
    // second, planned behind it, is refused (a plan blind to the queue
    // would accept it: it fits alone). Seven leaves the plan 40% to err
    // slow on the first and 30% fast on the pair; with eight (60% and
    // 20%) a loaded CI saw the pair predicted ~15% fast and accepted.
    let w = ((alone * 7.0 * SPEED / 10.0).ceil() as u64 * 10).clamp(60, 1200);
    let a = upload(&c, &base, &jsonl("a", 5 * n, 8)).await;
    let r = create(&c, &base, &a, w).await;
    assert_eq!(r.status(), 200);
    let first: Value = r.json().await.unwrap();
    assert_eq!(first["kiln"]["predicted_miss"], false, "{first}");
    let b = upload(&c, &base, &jsonl("b", 5 * n, 8)).await;
    let r = create(&c, &base, &b, w).await;
    assert_eq!(r.status(), 400, "{first}");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "completion_window_unmeetable", "{e}");
    assert_eq!(e["error"]["param"], "completion_window", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("predicted to finish at"),
        "{e}"
    );
    gw.stop().await;
}
