//! Files and Batches across a fleet on a shared PostgreSQL (`[batch] store
//! = "postgres://..."`): three real `kiln serve` processes and a real
//! PostgreSQL server that the test starts (its own cluster in a temporary
//! directory, on loopback). A file uploaded and a batch created through one
//! replica is read through another; the replica running the batch (the one
//! holding its lease) is killed with `kill -9` twice while the batch runs,
//! and restarted; at the end every `custom_id` of the input is in the output
//! or error file exactly once, and progress never went backwards.
//!
//! Beside it, the store's lease and written-once rules on their own:
//! exactly one of several replicas claiming a batch at once gets it, a live
//! lease keeps others out, an expired one is taken over, and a result
//! written by two replicas is stored and counted once.
//!
//! Skipped, with a message, where PostgreSQL is not installed (`.ci/run`
//! installs Debian's `postgresql`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::batch::store::{ItemResult, Store};
use kiln::batch::{BatchRow, BatchStatus, FileRow, RequestCounts};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
pool gpu { gpus 8 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 64 }
}
tier interactive { priority 100 slo { ttft 2s } preempts [batch] }
tier batch { priority 10 slo { window 24h } preemptible }
tenant alpha { owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] }
classify {
  when header("x-kiln-batch") != "" => tier batch
  default => tier interactive
}
route [interactive, batch] tiny { default => fp16 }
"#;

const KEY: &str = "k-alpha";
/// The issue's target: 10,000 items. KILN_FLEET_BATCH_ITEMS=N runs another
/// size.
const ITEMS: usize = 10_000;
const MAX_TOKENS: u64 = 8;
const SPEED: &str = "200";
const LEASE: &str = "3s";

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let p =
            std::env::temp_dir().join(format!("kiln-fleet-batches-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One `kiln serve` replica on the shared store; SIGKILLed and reaped when
/// dropped.
struct Replica {
    child: Child,
    name: String,
    base: String,
    log: Arc<Mutex<VecDeque<String>>>,
}

impl Replica {
    fn start(dir: &Path, name: &str, url: &str) -> Replica {
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, format!("[batch]\nlease = \"{LEASE}\"\n")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .arg("--policy")
            .arg(dir.join("fleet.kiln"))
            .arg("--config")
            .arg(&cfg)
            .args(["--listen", "127.0.0.1:0", "--sim-speed", SPEED])
            .args(["--batch-store", url])
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
        let mut r = Replica {
            child,
            name: name.to_string(),
            base: String::new(),
            log,
        };
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => r.base = format!("http://{addr}"),
            Err(_) => panic!(
                "replica {name} did not report its address:\n{}",
                r.log_tail()
            ),
        }
        r
    }

    fn log_tail(&self) -> String {
        let l = self.log.lock().unwrap();
        l.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// SIGKILL (what `Child::kill` sends on unix), and reap it.
    fn kill_9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn jsonl(n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        let line = json!({
            "custom_id": format!("req-{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": format!("item {i}")}], "max_tokens": MAX_TOKENS}
        });
        s.push_str(&line.to_string());
        s.push('\n');
    }
    s
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn upload(c: &reqwest::Client, base: &str, content: &str) -> Value {
    let b = "kilnboundary5c1d";
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{content}\r\n--{b}--\r\n"
    );
    let r = c
        .post(format!("{base}/v1/files"))
        .bearer_auth(KEY)
        .header("content-type", format!("multipart/form-data; boundary={b}"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn get(c: &reqwest::Client, base: &str, path: &str) -> reqwest::Response {
    c.get(format!("{base}{path}"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
}

async fn batch(c: &reqwest::Client, base: &str, id: &str) -> Value {
    let r = get(c, base, &format!("/v1/batches/{id}")).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Items replica `base` has in flight for batch `id` (its own runner's
/// count, from the batch listing): more than zero only on the replica
/// holding the batch's lease.
async fn in_flight(c: &reqwest::Client, base: &str, id: &str) -> u64 {
    let r = get(c, base, "/v1/batches?limit=100").await;
    if r.status() != 200 {
        return 0;
    }
    let v: Value = r.json().await.unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["id"] == id)
        .and_then(|b| b["kiln"]["in_flight"].as_u64())
        .unwrap_or(0)
}

fn count(b: &Value, k: &str) -> u64 {
    b["request_counts"][k].as_u64().unwrap()
}

fn done_of(b: &Value) -> u64 {
    count(b, "completed") + count(b, "failed")
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

/// The replica (index into `fleet`) whose runner has batch `id`'s items in
/// flight, waiting up to 20 s for one.
async fn runner(c: &reqwest::Client, fleet: &[Replica], id: &str) -> usize {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let mut running = Vec::new();
        for (i, r) in fleet.iter().enumerate() {
            if in_flight(c, &r.base, id).await > 0 {
                running.push(i);
            }
        }
        assert!(
            running.len() <= 1,
            "two replicas run batch {id} at once: {:?}",
            running.iter().map(|&i| &fleet[i].name).collect::<Vec<_>>()
        );
        if let Some(&i) = running.first() {
            return i;
        }
        assert!(Instant::now() < until, "no replica runs batch {id}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_survives_two_kills_of_its_runner_with_every_item_once() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    let items: usize = std::env::var("KILN_FLEET_BATCH_ITEMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(ITEMS);
    let started = Instant::now();
    let dir = TempDir::new();
    std::fs::write(dir.0.join("fleet.kiln"), POLICY).unwrap();
    let url = pg.url();
    let names = ["a", "b", "c"];
    let mut fleet: Vec<Replica> = names
        .iter()
        .map(|n| Replica::start(&dir.0, n, &url))
        .collect();
    let c = client();

    // Uploaded and created through a; the file is read through b and c.
    let f = upload(&c, &fleet[0].base, &jsonl(items)).await;
    let fid = f["id"].as_str().unwrap().to_string();
    for r in &fleet[1..] {
        let got = get(&c, &r.base, &format!("/v1/files/{fid}")).await;
        assert_eq!(got.status(), 200, "file {fid} through {}", r.name);
    }
    let input = get(&c, &fleet[2].base, &format!("/v1/files/{fid}/content")).await;
    assert_eq!(input.status(), 200);
    assert_eq!(ids(&input.text().await.unwrap()).len(), items);
    let r = c
        .post(format!("{}/v1/batches", fleet[0].base))
        .bearer_auth(KEY)
        .json(&json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap().to_string();
    eprintln!(
        "{items} items uploaded and batched in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    // Two kills of whichever replica runs the batch, at about a quarter
    // and at about 60% done; each is restarted (as its pod would be).
    let mut last_seen = 0u64;
    let mut kills = 0;
    for target in [0.25, 0.6] {
        let want = (target * items as f64) as u64;
        // Polled through a replica that is not the runner.
        let run = runner(&c, &fleet, &id).await;
        let poll = (run + 1) % fleet.len();
        let until = Instant::now() + Duration::from_secs(300);
        let mut b = batch(&c, &fleet[poll].base, &id).await;
        while done_of(&b) < want && b["status"] == "in_progress" {
            assert!(Instant::now() < until, "stuck at {b}");
            assert!(done_of(&b) >= last_seen, "progress went back: {b}");
            last_seen = done_of(&b);
            tokio::time::sleep(Duration::from_millis(20)).await;
            b = batch(&c, &fleet[poll].base, &id).await;
        }
        assert_eq!(
            b["status"],
            "in_progress",
            "the batch ended before kill {}: {b}",
            kills + 1
        );
        // The runner may have changed hands meanwhile only if it died.
        let run = runner(&c, &fleet, &id).await;
        last_seen = last_seen.max(done_of(&b));
        let name = fleet[run].name.clone();
        fleet.remove(run).kill_9();
        kills += 1;
        let killed_at = Instant::now();
        // Another replica takes the batch over once the lease runs out.
        let next = runner(&c, &fleet, &id).await;
        eprintln!(
            "kill {kills} of {name} at {:.1}s with {last_seen} of {items} done; {} took over in {:.1}s",
            started.elapsed().as_secs_f64(),
            fleet[next].name,
            killed_at.elapsed().as_secs_f64()
        );
        fleet.push(Replica::start(&dir.0, &name, &url));
    }

    // The rest finishes; polled through each replica in turn.
    let until = Instant::now() + Duration::from_secs(600);
    let mut turn = 0;
    let b = loop {
        let r = &fleet[turn % fleet.len()];
        turn += 1;
        let b = batch(&c, &r.base, &id).await;
        assert!(done_of(&b) >= last_seen, "progress went back: {b}");
        last_seen = done_of(&b);
        if b["status"] == "completed" {
            break b;
        }
        assert!(
            ["in_progress", "finalizing"].contains(&b["status"].as_str().unwrap()),
            "{b}\n{}",
            r.log_tail()
        );
        assert!(Instant::now() < until, "not done in time: {b}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(done_of(&b), items as u64, "{b}");
    // Every custom_id exactly once over the output and error files, read
    // through every replica.
    for r in &fleet {
        let mut all: HashMap<String, usize> = HashMap::new();
        for k in ["output_file_id", "error_file_id"] {
            let Some(file) = b[k].as_str() else { continue };
            let resp = get(&c, &r.base, &format!("/v1/files/{file}/content")).await;
            assert_eq!(resp.status(), 200, "{k} through {}", r.name);
            for (cid, n) in ids(&resp.text().await.unwrap()) {
                *all.entry(cid).or_insert(0) += n;
            }
        }
        assert_eq!(all.len(), items, "through {}: {b}", r.name);
        for i in 0..items {
            assert_eq!(all.get(&format!("req-{i}")), Some(&1), "req-{i}: {b}");
        }
    }
    assert_eq!(count(&b, "failed"), 0, "{b}");
    eprintln!(
        "{items} items, {kills} kills of the runner, every custom_id once, in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

fn file(id: &str, lines: u64) -> FileRow {
    FileRow {
        id: id.into(),
        owner: Some("alpha".into()),
        purpose: "batch".into(),
        filename: "in.jsonl".into(),
        bytes: 10,
        created_at: 1,
        lines,
        endpoint: Some("/v1/chat/completions".into()),
        batch_id: None,
        ok: None,
    }
}

fn batch_row(id: &str, file: &str, total: u64) -> BatchRow {
    BatchRow {
        id: id.into(),
        owner: Some("alpha".into()),
        input_file_id: file.into(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "24h".into(),
        window_s: 86_400.0,
        status: BatchStatus::Validating,
        created_at: 1,
        expires_at: 86_401,
        in_progress_at: None,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        counts: RequestCounts {
            total,
            completed: 0,
            failed: 0,
        },
        metadata: None,
        errors: None,
        output_file_id: None,
        error_file_id: None,
        tier: None,
        predicted_finish: None,
        gpu_seconds: 0.0,
        deadline_misses: 0,
        promise: Default::default(),
    }
}

/// Leases and written-once on the store itself, several replicas (store
/// connections) racing: for each of several rounds, N replicas claim one
/// batch at the same instant and exactly one wins; the others stay out
/// while it renews; once it stops renewing, the lease expires and exactly
/// one other takes it; and every replica writing every result leaves each
/// stored and counted once.
#[test]
fn leases_admit_one_runner_and_results_are_written_once() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    const N: usize = 4;
    const LINES: u64 = 50;
    let stores: Vec<Store> = (0..N).map(|_| Store::connect(&pg.url()).unwrap()).collect();
    let s0 = &stores[0];
    // Lines in; then the file row.
    let mut up = s0.upload("file-1");
    for i in 0..LINES {
        assert_eq!(up.line(i, i + 1, &format!("c{i}"), "{}").unwrap(), None);
    }
    assert_eq!(up.commit(&file("file-1", LINES)).unwrap(), None);
    drop(up);
    // Every replica sees it.
    for s in &stores {
        assert_eq!(s.file("file-1").unwrap().unwrap().lines, LINES);
    }
    for round in 0..5 {
        let id = format!("batch_{round}");
        // The promise goes in with the batch and the plan's place after
        // it; every replica (and a restarted one) reads them back.
        let mut row = batch_row(&id, "file-1", LINES);
        row.promise = kiln::batch::Promise {
            on_time: Some(round % 2 == 0),
            finish: Some(100.0 + round as f64),
            rank: Some(round as u64),
            pace_ratio: None,
        };
        assert!(s0.insert_batch(&row).unwrap());
        stores[N - 1]
            .set_prediction(&id, Some(200.0), None, Some(2.5))
            .unwrap();
        for s in &stores {
            let got = s.batch(&id).unwrap().unwrap();
            assert_eq!(got.predicted_finish, Some(200.0));
            assert_eq!(
                got.promise,
                kiln::batch::Promise {
                    pace_ratio: Some(2.5),
                    ..row.promise
                }
            );
        }
        // All claim at once (threads released together).
        let gate = Arc::new(std::sync::Barrier::new(N));
        let wins: Vec<bool> = std::thread::scope(|sc| {
            let hs: Vec<_> = stores
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let gate = gate.clone();
                    let id = id.clone();
                    sc.spawn(move || {
                        gate.wait();
                        s.claim(&id, &format!("r{i}"), 0.5).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            wins.iter().filter(|w| **w).count(),
            1,
            "round {round}: {wins:?}"
        );
        let holder = wins.iter().position(|w| *w).unwrap();
        // Renewed for a while: nobody else gets it.
        for _ in 0..4 {
            assert!(stores[holder]
                .claim(&id, &format!("r{holder}"), 0.5)
                .unwrap());
            for (i, s) in stores.iter().enumerate().filter(|(i, _)| *i != holder) {
                assert!(!s.claim(&id, &format!("r{i}"), 0.5).unwrap());
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        // The holder stops (dies): after the lease, one other takes over.
        std::thread::sleep(Duration::from_millis(600));
        let next = (holder + 1 + round % (N - 1)) % N;
        assert!(stores[next].claim(&id, &format!("r{next}"), 0.5).unwrap());
        assert!(!stores[holder]
            .claim(&id, &format!("r{holder}"), 0.5)
            .unwrap());
        // Every replica writes every result (items run again after a
        // death): each is stored and counted once.
        std::thread::scope(|sc| {
            for s in &stores {
                let id = id.clone();
                sc.spawn(move || {
                    for line in 0..LINES {
                        let r = ItemResult {
                            line,
                            ok: line % 7 != 0,
                            text: format!("{{\"custom_id\":\"c{line}\"}}"),
                            gpu_seconds: 0.0,
                            missed: false,
                        };
                        s.put_result(&id, &r).unwrap();
                    }
                });
            }
        });
        let b = s0.batch(&id).unwrap().unwrap();
        assert_eq!(b.counts.completed + b.counts.failed, LINES, "{b:?}");
        assert!(s0.pending(&id, "file-1", 0, 100).unwrap().is_empty());
        assert!(s0
            .transition(&id, &[BatchStatus::Validating], BatchStatus::Finalizing, 2)
            .unwrap());
        assert!(s0.finalize(&id, BatchStatus::Completed, 3).unwrap());
        // A second finalize (another replica) finds it done.
        assert!(!stores[1].finalize(&id, BatchStatus::Completed, 4).unwrap());
        let b = stores[2].batch(&id).unwrap().unwrap();
        assert_eq!(b.status, BatchStatus::Completed);
        let out = stores[3].results(&id, true, 0, 1000).unwrap();
        let err = stores[3].results(&id, false, 0, 1000).unwrap();
        assert_eq!(out.len() as u64 + err.len() as u64, LINES);
        assert_eq!(out.len() as u64, b.counts.completed);
    }
}
