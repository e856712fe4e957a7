//! Batches survive `kill -9`: the real `kiln serve` binary on a store in a
//! temporary directory runs a batch of a few thousand small requests and is
//! SIGKILLed several times while the batch is in progress (at points a
//! seeded RNG picks), restarted on the same store each time. At the end
//! every input `custom_id` is in the output or error file exactly once, the
//! counts add up, and no restart ever showed fewer finished items than the
//! last look before the kill, or `completed` with files missing lines.
//! A cancel acknowledged just before a kill completes after the restart.
//! A batch's promise (on time or flagged, its place in the run order, its
//! group's pace) is read back after a kill, and kept.
//! (And, ignored until fixed: concurrent uploads must not stall the binary.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use support::TempDir;

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 8 }
}
tier interactive { priority 100 slo { ttft 2s } preempts [batch] }
tier batch { priority 10 slo { window 24h } preemptible }
tenant alpha { owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] }
classify {
  when batch => tier batch
  default => tier interactive
}
route [interactive, batch] tiny { default => fp16 }
"#;

const KEY: &str = "k-alpha";
const ITEMS: usize = 3000;
const MAX_TOKENS: u64 = 256;
const KILLS: usize = 5;
const SPEED: &str = "20";
const SEED: u64 = 0x6b696c6e;

/// One `kiln serve` process; killed (SIGKILL) and reaped when dropped, so
/// a failing assertion never leaves it running.
struct Gateway {
    child: Child,
    base: String,
    /// The last lines of its stderr, for failure messages.
    log: Arc<Mutex<VecDeque<String>>>,
}

impl Gateway {
    fn start(dir: &Path) -> Gateway {
        Gateway::start_at(dir, SPEED.parse().unwrap())
    }

    /// A gateway at simulator speed `speed`.
    fn start_at(dir: &Path, speed: f64) -> Gateway {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .arg("--policy")
            .arg(dir.join("crash.kiln"))
            .args(["--listen", "127.0.0.1:0", "--sim-speed"])
            .arg(speed.to_string())
            .arg("--batch-store")
            .arg(dir.join("b.db"))
            .current_dir(dir)
            .env("RUST_LOG", "kiln=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start kiln serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = mpsc::channel();
        {
            let log = log.clone();
            // Reads stderr to its end (the pipe never fills); the first
            // listening line gives the address.
            std::thread::spawn(move || {
                let mut tx = Some(tx);
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(rest) = line.strip_prefix("kiln gateway listening on http://") {
                        if let (Some(tx), Some(addr)) = (tx.take(), rest.split(' ').next()) {
                            let _ = tx.send(addr.to_string());
                        }
                    }
                    let mut l = log.lock().unwrap();
                    l.push_back(line);
                    if l.len() > 40 {
                        l.pop_front();
                    }
                }
            });
        }
        let mut g = Gateway {
            child,
            base: String::new(),
            log,
        };
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => g.base = format!("http://{addr}"),
            Err(_) => panic!(
                "kiln serve did not report its address in 30s:\n{}",
                g.log_tail()
            ),
        }
        g
    }

    fn log_tail(&self) -> String {
        let l = self.log.lock().unwrap();
        l.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// SIGKILL (what `Child::kill` sends on unix), and reap it.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn jsonl(n: usize, max_tokens: u64) -> String {
    support::batches::jsonl("req", "tiny", n, max_tokens)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn upload(c: &reqwest::Client, base: &str, content: &str) -> Value {
    let r = support::batches::post_file(c, base, KEY, content).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn batch(c: &reqwest::Client, base: &str, id: &str) -> Value {
    let r = c
        .get(format!("{base}/v1/batches/{id}"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn content(c: &reqwest::Client, base: &str, file: &str) -> String {
    let r = c
        .get(format!("{base}/v1/files/{file}/content"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "file {file}");
    r.text().await.unwrap()
}

/// `custom_id` → how many lines carry it.
fn ids(text: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(l).unwrap();
        *m.entry(v["custom_id"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    m
}

fn count(b: &Value, k: &str) -> u64 {
    b["request_counts"][k].as_u64().unwrap()
}

fn done_of(b: &Value) -> u64 {
    count(b, "completed") + count(b, "failed")
}

/// A `completed` batch's files hold every line its counts report, each
/// `custom_id` once.
async fn check_completed(c: &reqwest::Client, base: &str, b: &Value) -> HashMap<String, usize> {
    assert_eq!(done_of(b), count(b, "total"), "counts do not add up: {b}");
    let mut all: HashMap<String, usize> = HashMap::new();
    for (k, n) in [
        ("output_file_id", count(b, "completed")),
        ("error_file_id", count(b, "failed")),
    ] {
        let text = match b[k].as_str() {
            Some(f) => content(c, base, f).await,
            None => String::new(),
        };
        let seen = ids(&text);
        assert!(
            seen.values().all(|&n| n == 1),
            "{k} repeats a custom_id: {b}"
        );
        assert_eq!(
            seen.len() as u64,
            n,
            "{k} holds {} lines, the batch reports {n}: {b}",
            seen.len()
        );
        for (id, n) in seen {
            *all.entry(id).or_insert(0) += n;
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_survive_sigkill_with_every_result_once() {
    let started = Instant::now();
    let dir = TempDir::new("batch-crash");
    std::fs::write(dir.0.join("crash.kiln"), POLICY).unwrap();
    // KILN_CRASH_SEED=N tries other kill points.
    let seed = std::env::var("KILN_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let c = client();

    let mut gw = Gateway::start(&dir.0);
    let f = upload(&c, &gw.base, &jsonl(ITEMS, MAX_TOKENS)).await;
    let r = c
        .post(format!("{}/v1/batches", gw.base))
        .bearer_auth(KEY)
        .json(&json!({"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap().to_string();
    assert_eq!(count(&b, "total"), ITEMS as u64);

    // Kill points: progress fractions, sorted, spread over the run, each
    // with a little jitter after it is reached; the last one near the end,
    // where the batch finalizes.
    let mut targets: Vec<f64> = (1..KILLS).map(|_| rng.random_range(0.03..0.85)).collect();
    targets.sort_by(f64::total_cmp);
    targets.push(rng.random_range(0.95..0.999));
    let mut kills = 0;
    let mut last_seen = 0u64;
    for (i, t) in targets.iter().enumerate() {
        let want = (t * ITEMS as f64) as u64;
        // Bounded: about 8 s per kill point, at most.
        let mut b = batch(&c, &gw.base, &id).await;
        for _ in 0..400 {
            if done_of(&b) >= want || b["status"] != "in_progress" && b["status"] != "validating" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            b = batch(&c, &gw.base, &id).await;
        }
        if b["status"] == "completed" {
            // Ran ahead of the remaining kill points: nothing left to kill.
            break;
        }
        assert!(
            ["in_progress", "validating"].contains(&b["status"].as_str().unwrap()),
            "before kill {i}: {b}\n{}",
            gw.log_tail()
        );
        let jitter = rng.random_range(0..150u64);
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        // What the store has committed before this look is durable: a
        // restart must report at least as much.
        last_seen = last_seen.max(done_of(&b));
        gw.kill();
        kills += 1;
        gw = Gateway::start(&dir.0);
        let b = batch(&c, &gw.base, &id).await;
        eprintln!(
            "kill {kills} at {:.1}s: {last_seen} items finished before, {} after the restart ({})",
            started.elapsed().as_secs_f64(),
            done_of(&b),
            b["status"]
        );
        assert!(
            done_of(&b) >= last_seen,
            "restart {kills} reports {} items finished, {last_seen} were before the kill: {b}",
            done_of(&b)
        );
        assert!(done_of(&b) <= count(&b, "total"), "{b}");
        if b["status"] == "completed" {
            check_completed(&c, &gw.base, &b).await;
        }
        last_seen = done_of(&b);
    }
    assert!(kills >= 3, "the batch finished before most kills ({kills})");

    // Bounded: the rest of the batch must finish within 40 s.
    let mut b = batch(&c, &gw.base, &id).await;
    for _ in 0..400 {
        if b["status"] == "completed" {
            break;
        }
        assert!(
            ["in_progress", "validating", "finalizing"].contains(&b["status"].as_str().unwrap()),
            "{b}\n{}",
            gw.log_tail()
        );
        assert!(done_of(&b) >= last_seen, "{b}");
        last_seen = done_of(&b);
        tokio::time::sleep(Duration::from_millis(100)).await;
        b = batch(&c, &gw.base, &id).await;
    }
    assert_eq!(b["status"], "completed", "{b}\n{}", gw.log_tail());
    let all = check_completed(&c, &gw.base, &b).await;
    assert_eq!(all.len(), ITEMS, "{b}");
    for i in 0..ITEMS {
        assert_eq!(all.get(&format!("req-{i}")), Some(&1), "req-{i}: {b}");
    }
    // A restart after completion changes nothing.
    gw.kill();
    let gw = Gateway::start(&dir.0);
    let again = batch(&c, &gw.base, &id).await;
    assert_eq!(again["status"], "completed");
    assert_eq!(again["request_counts"], b["request_counts"]);
    check_completed(&c, &gw.base, &again).await;
    drop(gw);
    eprintln!(
        "seed {seed}: {kills} kills, {} items, {:.1}s",
        ITEMS,
        started.elapsed().as_secs_f64()
    );
}

/// A cancel the gateway acknowledged survives a SIGKILL right after it:
/// the restarted gateway finishes cancelling, and every item is in exactly
/// one of the files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_survives_sigkill() {
    const N: usize = 400;
    let dir = TempDir::new("batch-crash");
    std::fs::write(dir.0.join("crash.kiln"), POLICY).unwrap();
    let c = client();
    let gw = Gateway::start(&dir.0);
    let f = upload(&c, &gw.base, &jsonl(N, 2000)).await;
    let r = c
        .post(format!("{}/v1/batches", gw.base))
        .bearer_auth(KEY)
        .json(&json!({"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = c
        .post(format!("{}/v1/batches/{id}/cancel", gw.base))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.kill();
    let gw = Gateway::start(&dir.0);
    let mut b = batch(&c, &gw.base, &id).await;
    assert!(
        ["cancelling", "cancelled"].contains(&b["status"].as_str().unwrap()),
        "{b}"
    );
    for _ in 0..200 {
        if b["status"] == "cancelled" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        b = batch(&c, &gw.base, &id).await;
    }
    assert_eq!(b["status"], "cancelled", "{b}\n{}", gw.log_tail());
    let mut all: HashMap<String, usize> = HashMap::new();
    let mut lines = HashMap::new();
    for k in ["output_file_id", "error_file_id"] {
        let text = match b[k].as_str() {
            Some(f) => content(&c, &gw.base, f).await,
            None => String::new(),
        };
        lines.insert(
            k,
            text.lines().filter(|l| !l.trim().is_empty()).count() as u64,
        );
        for (id, n) in ids(&text) {
            *all.entry(id).or_insert(0) += n;
        }
    }
    assert_eq!(all.len(), N, "{b}");
    assert!(all.values().all(|&n| n == 1), "{b}");
    assert_eq!(lines["output_file_id"], count(&b, "completed"), "{b}");
    assert!(lines["error_file_id"] >= count(&b, "failed"), "{b}");
    assert!(
        lines["error_file_id"] > 0,
        "nothing was left to cancel: {b}"
    );
}

/// Many more concurrent uploads (of more than 256 lines each) than the
/// gateway has async worker threads must all be stored, and the gateway
/// must keep answering meanwhile.
///
/// (This once deadlocked the whole gateway: lines went to the upload's
/// worker through a blocking send on an async worker thread while the
/// worker waited for a writer another upload held for its whole body.
/// Uploads now await their sends and write in short transactions.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_uploads_do_not_stall_the_gateway() {
    let dir = TempDir::new("batch-crash");
    std::fs::write(dir.0.join("crash.kiln"), POLICY).unwrap();
    let gw = Gateway::start(&dir.0);
    // kiln serve's runtime has one worker per core.
    let n = std::thread::available_parallelism().map_or(2, |n| n.get()) * 4;
    let c = client();
    let b = "kilnboundary5c1d";
    let mut tasks = Vec::new();
    for k in 0..n {
        let text = jsonl(2000, 8).replace("req-", &format!("u{k}-"));
        let body = format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"u.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{text}\r\n--{b}--\r\n"
        );
        let req = c
            .post(format!("{}/v1/files", gw.base))
            .bearer_auth(KEY)
            .header("content-type", format!("multipart/form-data; boundary={b}"))
            .body(body);
        tasks.push(tokio::spawn(async move {
            req.send().await.map(|r| r.status().as_u16())
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().map_err(|e| e.to_string()));
    }
    let health = c
        .get(format!("{}/healthz", gw.base))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string());
    assert!(
        statuses.iter().all(|s| s == &Ok(200)),
        "{n} concurrent uploads: {statuses:?}; /healthz then: {health:?}"
    );
    assert_eq!(health, Ok(200));
}

/// The crash policy with completion windows of 60 s to 1200 s (6 s to
/// 120 s of wall time at `PROMISE_SPEED`).
fn promise_policy() -> String {
    let windows: Vec<String> = (6..=120).map(|i| format!("{}s", i * 10)).collect();
    POLICY.replace(
        "slo { window 24h } preemptible }",
        &format!(
            "slo {{ window 24h }} preemptible completion_windows [{}] }}",
            windows.join(", ")
        ),
    )
}

const PROMISE_SPEED: f64 = 10.0;

fn jsonl_tagged(tag: &str, n: usize, max_tokens: u64) -> String {
    jsonl(n, max_tokens).replace("\"req-", &format!("\"{tag}-"))
}

async fn create(c: &reqwest::Client, base: &str, file: &Value, window_s: u64) -> Value {
    let r = c
        .post(format!("{base}/v1/batches"))
        .bearer_auth(KEY)
        .json(&json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": format!("{window_s}s")}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A batch's promise survives `kill -9`: two batches of one tenant, the
/// first promised on time (a loose window), the second flagged at
/// submission (heavy items in the shortest window). The gateway is
/// SIGKILLed while the first runs, once its observed pace is stored, and
/// restarted on the same store: before the runner has observed anything
/// again, each batch shows what it was promised at submission (on time or
/// flagged, and the finish then predicted), the same place in the run
/// order, the at-risk flag it had, and the pace its group was planned at.
/// The batch promised on time then finishes inside its window, and every
/// item of both is in their files exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promise_survives_sigkill_and_is_kept() {
    const A: usize = 20_000;
    const B: usize = 2000;
    let dir = TempDir::new("batch-crash");
    std::fs::write(dir.0.join("crash.kiln"), promise_policy()).unwrap();
    let c = client();
    let gw = Gateway::start_at(&dir.0, PROMISE_SPEED);
    let fa = upload(&c, &gw.base, &jsonl_tagged("a", A, 8)).await;
    let fb = upload(&c, &gw.base, &jsonl_tagged("b", B, 512)).await;
    // A: 1200 s (120 s of wall time) for a few seconds of work.
    let a = create(&c, &gw.base, &fa, 1200).await;
    // B: 2,000 items of 512 tokens in 60 s cannot be met: flagged.
    let b = create(&c, &gw.base, &fb, 60).await;
    assert_eq!(a["kiln"]["promise"]["on_time"], true, "{a}");
    assert_eq!(a["kiln"]["predicted_miss"], false, "{a}");
    assert_eq!(b["kiln"]["promise"]["on_time"], false, "{b}");
    assert_eq!(b["kiln"]["predicted_miss"], true, "{b}");
    assert_eq!(a["kiln"]["promise"]["rank"], 0, "{a}");
    let (ida, idb) = (
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
    );
    // Run until A's group pace is measured and stored, then kill.
    let mut before = batch(&c, &gw.base, &ida).await;
    for _ in 0..600 {
        if before["kiln"]["promise"]["pace_ratio"].is_number() && done_of(&before) > 0 {
            break;
        }
        // Validating until the runner's next pass takes it up.
        assert!(
            ["validating", "in_progress"].contains(&before["status"].as_str().unwrap_or("")),
            "{before}\n{}",
            gw.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        before = batch(&c, &gw.base, &ida).await;
    }
    let before_b = batch(&c, &gw.base, &idb).await;
    assert!(
        before["kiln"]["promise"]["pace_ratio"].is_number(),
        "no pace stored: {before}"
    );
    assert_eq!(
        before["status"], "in_progress",
        "A ended before the kill: {before}"
    );
    gw.kill();
    let gw = Gateway::start_at(&dir.0, PROMISE_SPEED);
    let after = batch(&c, &gw.base, &ida).await;
    let after_b = batch(&c, &gw.base, &idb).await;
    eprintln!(
        "before the kill: A {} done, promise {}, predicted finish {}; B promise {}\nafter the restart: A {} done, promise {}, predicted finish {}; B promise {}",
        done_of(&before),
        before["kiln"]["promise"],
        before["kiln"]["predicted_finish_at"],
        before_b["kiln"]["promise"],
        done_of(&after),
        after["kiln"]["promise"],
        after["kiln"]["predicted_finish_at"],
        after_b["kiln"]["promise"],
    );
    assert!(done_of(&after) >= done_of(&before), "{before}\n{after}");
    for (x, y) in [(&a, &after), (&b, &after_b)] {
        // What submission promised, read back from the store.
        assert_eq!(
            y["kiln"]["promise"]["on_time"], x["kiln"]["promise"]["on_time"],
            "{y}"
        );
        assert_eq!(
            y["kiln"]["promise"]["finish_at"], x["kiln"]["promise"]["finish_at"],
            "{y}"
        );
        assert_eq!(
            y["kiln"]["promise"]["rank"], x["kiln"]["promise"]["rank"],
            "{y}"
        );
    }
    // The plan's pace and the at-risk flag, as the runner last stored them
    // (the restarted runner has not observed a pace of its own yet, or
    // has and stored it: either way there is one).
    assert!(
        after["kiln"]["promise"]["pace_ratio"].is_number(),
        "{after}"
    );
    assert!(after["kiln"]["predicted_finish_at"].is_number(), "{after}");
    assert_eq!(after["kiln"]["predicted_miss"], false, "{after}");
    if after_b["status"] == "in_progress" {
        assert_eq!(after_b["kiln"]["predicted_miss"], true, "{after_b}");
    }
    // A finishes inside its window; B ends (it may expire, as flagged).
    let mut ends = Vec::new();
    for id in [&ida, &idb] {
        let mut x = batch(&c, &gw.base, id).await;
        for _ in 0..1200 {
            if ["completed", "expired", "failed", "cancelled"]
                .contains(&x["status"].as_str().unwrap())
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            x = batch(&c, &gw.base, id).await;
        }
        ends.push(x);
    }
    let (ea, eb) = (&ends[0], &ends[1]);
    assert_eq!(ea["status"], "completed", "{ea}\n{}", gw.log_tail());
    assert!(
        ea["completed_at"].as_i64().unwrap() <= ea["expires_at"].as_i64().unwrap(),
        "A, promised on time, missed its window: {ea}"
    );
    assert_eq!(count(ea, "failed"), 0, "{ea}");
    let all = check_completed(&c, &gw.base, ea).await;
    assert_eq!(all.len(), A, "{ea}");
    assert!(
        ["completed", "expired"].contains(&eb["status"].as_str().unwrap()),
        "{eb}"
    );
    let mut seen: HashMap<String, usize> = HashMap::new();
    for k in ["output_file_id", "error_file_id"] {
        if let Some(f) = eb[k].as_str() {
            for (id, n) in ids(&content(&c, &gw.base, f).await) {
                *seen.entry(id).or_insert(0) += n;
            }
        }
    }
    assert_eq!(seen.len(), B, "{eb}");
    assert!(seen.values().all(|&n| n == 1), "a B item twice: {eb}");
}

/// Two gateways on one embedded store would each run the other's batches:
/// a second `kiln serve` on a store a live gateway holds is refused at
/// start (exit 2, naming the store and the holder's process id), and the
/// lock dies with its holder, so after a SIGKILL (no clean-up at all) the
/// next gateway starts on the same store.
#[test]
fn a_second_gateway_on_a_held_store_is_refused_and_a_killed_ones_store_is_free() {
    use std::io::Read;
    let dir = TempDir::new("batch-crash");
    std::fs::write(dir.0.join("crash.kiln"), POLICY).unwrap();
    let first = Gateway::start(&dir.0);
    let holder = first.child.id();
    let mut second = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("serve")
        .arg("--policy")
        .arg(dir.0.join("crash.kiln"))
        .args(["--listen", "127.0.0.1:0"])
        .arg("--batch-store")
        .arg(dir.0.join("b.db"))
        .current_dir(&dir.0)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = second.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let Some(status) = status else {
        let _ = second.kill();
        let _ = second.wait();
        panic!("a second gateway started on a store another one holds");
    };
    let mut err = String::new();
    second
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    // The report wraps its lines: read it as one line of words.
    let text = err
        .replace('│', " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(text.contains("kiln::serve::store_in_use"), "{err}");
    assert!(text.contains("in use by another kiln gateway"), "{err}");
    assert!(text.contains(&format!("(process {holder})")), "{err}");
    assert!(text.contains("b.db"), "{err}");
    // The first one still serves.
    let models = reqwest_get(&format!("{}/v1/models", first.base));
    assert!(models.is_some(), "the first gateway stopped serving");
    first.kill();
    let third = Gateway::start(&dir.0);
    assert!(reqwest_get(&format!("{}/v1/models", third.base)).is_some());
}

/// GET `url` with the test's key; the body when it answers 200.
fn reqwest_get(url: &str) -> Option<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::new()
            .get(url)
            .bearer_auth(KEY)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .ok()?;
        if r.status().is_success() {
            r.text().await.ok()
        } else {
            None
        }
    })
}
