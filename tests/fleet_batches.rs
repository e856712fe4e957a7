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
use kiln::batch::{BatchRow, BatchStatus, FileRow};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use support::TempDir;

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
  when batch => tier batch
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
        Replica::start_with(dir, name, url, &format!("lease = \"{LEASE}\"\n"))
    }

    /// A replica whose `[batch]` section is `batch`.
    fn start_with(dir: &Path, name: &str, url: &str, batch: &str) -> Replica {
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, format!("[batch]\n{batch}")).unwrap();
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

    /// SIGTERM (a graceful stop, as Kubernetes sends), and reap it.
    fn terminate(mut self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "cannot send SIGTERM to {}", self.name);
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{} did not stop within 20 s of SIGTERM:\n{}",
            self.name,
            self.log_tail()
        );
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
    support::batches::jsonl("req", "tiny", n, MAX_TOKENS)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn upload(c: &reqwest::Client, base: &str, content: &str) -> Value {
    let r = support::batches::post_file(c, base, KEY, content).await;
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
    let dir = TempDir::new("fleet-batches");
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
    FileRow::example(id, lines)
}

fn batch_row(id: &str, file: &str, total: u64) -> BatchRow {
    let mut b = BatchRow::example(id, file, total);
    b.status = BatchStatus::Validating;
    b
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

/// Per-item fencing on the store: a replica whose lease on a batch passed
/// to another cannot write a result under its old token, even where the
/// item has no result yet; the new holder can; a holder that released its
/// leases (a graceful stop) is fenced off too; a renewal by the same
/// holder keeps its token.
#[test]
fn a_replica_that_lost_its_lease_writes_no_result() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    let a = Store::connect(&pg.url()).unwrap();
    let b = Store::connect(&pg.url()).unwrap();
    let mut up = a.upload("file-f");
    for i in 0..4 {
        assert_eq!(up.line(i, i + 1, &format!("c{i}"), "{}").unwrap(), None);
    }
    assert_eq!(up.commit(&file("file-f", 4)).unwrap(), None);
    drop(up);
    assert!(a.insert_batch(&batch_row("batch_f", "file-f", 4)).unwrap());
    let result = |line: u64| ItemResult {
        line,
        ok: true,
        text: format!("{{\"custom_id\":\"c{line}\"}}"),
        gpu_seconds: 0.0,
        missed: false,
    };
    let token = |held: Option<Vec<(String, i64)>>| {
        held.unwrap()
            .into_iter()
            .find(|(id, _)| id == "batch_f")
            .map(|(_, t)| t)
    };
    let ta = token(a.claim_all("ra", 0.4).unwrap()).expect("a takes the free lease");
    assert_eq!(
        token(b.claim_all("rb", 0.4).unwrap()),
        None,
        "a live lease keeps b out"
    );
    // Renewed by a: the same token, and a writes under it.
    assert_eq!(token(a.claim_all("ra", 0.4).unwrap()), Some(ta));
    assert_eq!(
        a.put_result_as("batch_f", &result(0), 1, 1, Some(("ra", ta)))
            .unwrap(),
        Some(true)
    );
    // a stops renewing (stalled); its lease runs out and b takes it.
    std::thread::sleep(Duration::from_millis(600));
    let tb = token(b.claim_all("rb", 5.0).unwrap()).expect("b takes the expired lease");
    assert_ne!(ta, tb, "a lease that changed hands has a new token");
    // a comes back with item 1's result: fenced off, nothing written.
    assert_eq!(
        a.put_result_as("batch_f", &result(1), 1, 1, Some(("ra", ta)))
            .unwrap(),
        None
    );
    let row = a.batch("batch_f").unwrap().unwrap();
    assert_eq!(row.counts.completed, 1, "{row:?}");
    assert_eq!(a.pending("batch_f", "file-f", 0, 10).unwrap().len(), 3);
    // b writes it.
    assert_eq!(
        b.put_result_as("batch_f", &result(1), 1, 1, Some(("rb", tb)))
            .unwrap(),
        Some(true)
    );
    // a cannot take the lease back while b holds it, nor write.
    assert_eq!(token(a.claim_all("ra", 0.4).unwrap()), None);
    // b stops gracefully: its leases go at once, and its late writes too.
    assert_eq!(b.release_all("rb").unwrap(), 1);
    assert_eq!(
        b.put_result_as("batch_f", &result(2), 1, 1, Some(("rb", tb)))
            .unwrap(),
        None
    );
    // a takes the released lease without waiting for it to run out.
    let ta2 = token(a.claim_all("ra", 5.0).unwrap()).expect("a takes the released lease");
    assert!(ta2 > tb);
    assert_eq!(
        a.put_result_as("batch_f", &result(2), 1, 1, Some(("ra", ta2)))
            .unwrap(),
        Some(true)
    );
    let row = a.batch("batch_f").unwrap().unwrap();
    assert_eq!(row.counts.completed, 3, "{row:?}");
    // Results written together (the runner's writer): one already there
    // and one twice in the group count once each; b's stale token writes
    // none of them.
    let finished = |line: u64| kiln::batch::store::Finished {
        result: result(line),
        input_tokens: 2,
        output_tokens: 1,
    };
    let group = [finished(2), finished(3), finished(3)];
    assert_eq!(
        b.put_finished_as("batch_f", &group, Some(("rb", tb)))
            .unwrap(),
        None
    );
    assert_eq!(
        a.put_finished_as("batch_f", &group, Some(("ra", ta2)))
            .unwrap(),
        Some(vec![false, true, false])
    );
    let row = a.batch("batch_f").unwrap().unwrap();
    assert_eq!(row.counts.completed, 4, "{row:?}");
    assert!(a.pending("batch_f", "file-f", 0, 10).unwrap().is_empty());
}

/// Every store call is bounded: through a proxy that stalls (connections
/// open, nothing forwarded) or cuts (connections closed, new ones refused),
/// a call fails within the store's timeout with an error that says the
/// store is unavailable (what `kiln serve` answers 503); when the proxy
/// passes again, the next call succeeds on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_calls_are_bounded_when_postgres_stalls_or_is_cut() {
    use support::postgres::{Mode, PgProxy};
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    let proxy = PgProxy::start(pg.port).await;
    let url = proxy.url();
    let remote = kiln::batch::store::Remote {
        timeout: Duration::from_millis(800),
        tls: None,
    };
    let store = tokio::task::spawn_blocking(move || Store::connect_with(&url, &remote).unwrap())
        .await
        .unwrap();
    assert!(store.run(|s| s.batch("none")).await.unwrap().is_none());
    for mode in [Mode::Stall, Mode::Cut, Mode::Stall] {
        proxy.set(mode);
        // Several calls, on the lease and the data connections.
        for _ in 0..3 {
            let t = Instant::now();
            let r = store.run(|s| s.batch("none")).await;
            let e = r.expect_err("a call through a dead proxy fails");
            assert!(e.is_unavailable(), "{mode:?}: {e}");
            assert!(
                t.elapsed() < Duration::from_millis(2_000),
                "{mode:?}: took {:?}",
                t.elapsed()
            );
            let t = Instant::now();
            let e = store
                .run(|s| s.claim_all("r", 1.0))
                .await
                .expect_err("fails");
            assert!(e.is_unavailable(), "{mode:?}: {e}");
            assert!(
                t.elapsed() < Duration::from_millis(2_000),
                "{mode:?}: took {:?}",
                t.elapsed()
            );
        }
        proxy.set(Mode::Pass);
        // Back: the next calls succeed (each connection made again).
        for _ in 0..6 {
            let t = Instant::now();
            assert!(store.run(|s| s.batch("none")).await.unwrap().is_none());
            assert!(t.elapsed() < Duration::from_millis(2_000));
        }
        assert_eq!(
            store.run(|s| s.claim_all("r", 1.0)).await.unwrap(),
            Some(vec![])
        );
    }
}

/// Batch items the replica at `base` served (`kiln_requests_total` with
/// outcome `ok`, tier `batch`): an item run twice counts twice.
async fn served_items(c: &reqwest::Client, base: &str) -> u64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("kiln_requests_total{")
                && l.contains("outcome=\"ok\"")
                && l.contains("tier=\"batch\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits for batch `id` to complete (polled through `base`), progress never
/// going back; then every `custom_id` of `items` is in its output exactly
/// once and none failed.
async fn completes_once(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    items: usize,
    log: &dyn Fn() -> String,
) {
    let until = Instant::now() + Duration::from_secs(300);
    let mut last = 0;
    let b = loop {
        let r = get(c, base, &format!("/v1/batches/{id}")).await;
        if r.status() == 200 {
            let b: Value = r.json().await.unwrap();
            assert!(done_of(&b) >= last, "progress went back: {b}");
            last = done_of(&b);
            if b["status"] == "completed" {
                break b;
            }
            assert!(
                ["in_progress", "finalizing", "validating"]
                    .contains(&b["status"].as_str().unwrap()),
                "{b}\n{}",
                log()
            );
            assert!(Instant::now() < until, "not done in time: {b}\n{}", log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(done_of(&b), items as u64, "{b}");
    assert_eq!(count(&b, "failed"), 0, "{b}");
    let file = b["output_file_id"].as_str().unwrap();
    let resp = get(c, base, &format!("/v1/files/{file}/content")).await;
    assert_eq!(resp.status(), 200);
    let all = ids(&resp.text().await.unwrap());
    assert_eq!(all.len(), items, "{b}");
    for i in 0..items {
        assert_eq!(all.get(&format!("req-{i}")), Some(&1), "req-{i}: {b}");
    }
}

async fn create(c: &reqwest::Client, base: &str, fid: &str) -> String {
    let r = c
        .post(format!("{base}/v1/batches"))
        .bearer_auth(KEY)
        .json(&json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    b["id"].as_str().unwrap().to_string()
}

/// A request the replica must answer 503 with Retry-After, quickly, while
/// the store is unavailable.
async fn answers_503(c: &reqwest::Client, req: reqwest::RequestBuilder, what: &str) {
    let _ = c;
    let t = Instant::now();
    let r = req.send().await.unwrap();
    let took = t.elapsed();
    let status = r.status();
    let retry = r.headers().get("retry-after").cloned();
    let body = r.text().await.unwrap_or_default();
    assert_eq!(status, 503, "{what}: {body}");
    assert!(retry.is_some(), "{what}: no Retry-After");
    assert!(body.contains("store_unavailable"), "{what}: {body}");
    // store_timeout is 3 s (the wait for a connection included).
    assert!(took < Duration::from_secs(7), "{what} took {took:?}");
}

/// PostgreSQL stalling (connections open, nothing forwarded) and then cut
/// (connections closed, new ones refused) under a running batch, through a
/// loopback proxy: meanwhile `kiln serve` answers file and batch requests
/// 503 with Retry-After within its store timeout instead of hanging; when
/// the database is back the runner resumes by itself, and the batch
/// completes with every `custom_id` once and every item served once (the
/// replica's own count of batch requests served equals the items).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_outage_is_answered_503_and_the_batch_resumes_with_every_item_once() {
    use support::postgres::{Mode, PgProxy};
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    const N: usize = 2_000;
    let proxy = PgProxy::start(pg.port).await;
    let dir = TempDir::new("fleet-batches");
    std::fs::write(dir.0.join("fleet.kiln"), POLICY).unwrap();
    let r = Replica::start_with(
        &dir.0,
        "a",
        &proxy.url(),
        "lease = \"2s\"\nstore_timeout = \"3s\"\n",
    );
    let c = client();
    let f = upload(&c, &r.base, &jsonl(N)).await;
    let fid = f["id"].as_str().unwrap().to_string();
    let id = create(&c, &r.base, &fid).await;
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let resp = get(&c, &r.base, &format!("/v1/batches/{id}")).await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 200, "{text}\n{}", r.log_tail());
        let b: Value = serde_json::from_str(&text).unwrap();
        if done_of(&b) >= 100 {
            assert_eq!(b["status"], "in_progress", "ended before the outage: {b}");
            break;
        }
        assert!(Instant::now() < until, "no progress: {b}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outage = Instant::now();
    for mode in [Mode::Stall, Mode::Cut] {
        proxy.set(mode);
        let began = Instant::now();
        // Longer than the lease: the runner must not lose what it ran.
        while began.elapsed() < Duration::from_secs(3) {
            answers_503(
                &c,
                c.get(format!("{}/v1/batches/{id}", r.base))
                    .bearer_auth(KEY),
                &format!("{mode:?}: GET batch"),
            )
            .await;
            answers_503(
                &c,
                c.get(format!("{}/v1/files/{fid}", r.base)).bearer_auth(KEY),
                &format!("{mode:?}: GET file"),
            )
            .await;
            answers_503(
                &c,
                c.get(format!("{}/v1/batches", r.base)).bearer_auth(KEY),
                &format!("{mode:?}: list batches"),
            )
            .await;
        }
    }
    proxy.set(Mode::Pass);
    eprintln!("outage of {:.1}s over", outage.elapsed().as_secs_f64());
    completes_once(&c, &r.base, &id, N, &|| r.log_tail()).await;
    assert_eq!(
        served_items(&c, &r.base).await,
        N as u64,
        "an item ran twice (or not at all)\n{}",
        r.log_tail()
    );
}

/// A replica stopped gracefully (SIGTERM) gives its batch leases up: the
/// other replica takes the batch over at its next renewal, well before the
/// lease (30 s here) would have run out, and the batch completes with
/// every `custom_id` once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_stopped_gracefully_hands_its_batch_on_at_once() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    const N: usize = 3_000;
    let dir = TempDir::new("fleet-batches");
    std::fs::write(dir.0.join("fleet.kiln"), POLICY).unwrap();
    let url = pg.url();
    let mut fleet: Vec<Replica> = ["a", "b"]
        .iter()
        .map(|n| Replica::start_with(&dir.0, n, &url, "lease = \"30s\"\n"))
        .collect();
    let c = client();
    let f = upload(&c, &fleet[0].base, &jsonl(N)).await;
    let fid = f["id"].as_str().unwrap().to_string();
    let id = create(&c, &fleet[0].base, &fid).await;
    let run = runner(&c, &fleet, &id).await;
    let b = batch(&c, &fleet[run].base, &id).await;
    assert_eq!(b["status"], "in_progress", "{b}");
    let stopped = fleet.remove(run);
    let name = stopped.name.clone();
    let t = Instant::now();
    stopped.terminate();
    let next = runner(&c, &fleet, &id).await;
    let took = t.elapsed();
    eprintln!(
        "{name} stopped with SIGTERM; {} took the batch over in {:.2}s (lease 30 s)",
        fleet[next].name,
        took.as_secs_f64()
    );
    assert!(took < Duration::from_secs(10), "takeover took {took:?}");
    let other = &fleet[next];
    completes_once(&c, &other.base, &id, N, &|| other.log_tail()).await;
}

/// TLS to PostgreSQL: a server that takes TLS connections only, with a
/// certificate from a CA made in the test. With `sslmode=require` and that
/// CA as `[batch] ca_file`, the store connects and works; with the
/// platform's roots instead, the certificate is refused and the error says
/// so; a plain connection (`sslmode=disable`) is refused by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_reaches_postgres_over_tls_with_a_custom_ca() {
    kiln::tls::install_default_provider();
    let pki = support::tls::Pki::new("pg");
    let server = pki.server();
    let Some(pg) = support::postgres::Postgres::start_tls(&server.cert, &server.key) else {
        return;
    };
    let ca = kiln::tls::ClientTls {
        ca_file: Some(pki.ca_file()),
        client_cert: None,
        client_key: None,
    }
    .client_config(&[])
    .unwrap();
    let remote = |tls: Option<rustls::ClientConfig>| kiln::batch::store::Remote {
        timeout: Duration::from_secs(5),
        tls: tls.map(Arc::new),
    };
    let url = pg.url();
    let (r_ca, r_none) = (remote(Some(ca)), remote(None));
    let (ok, roots, plain) = tokio::task::spawn_blocking(move || {
        (
            Store::connect_with(&format!("{url}?sslmode=require"), &r_ca),
            Store::connect_with(&format!("{url}?sslmode=require"), &r_none),
            Store::connect_with(&format!("{url}?sslmode=disable"), &r_none),
        )
    })
    .await
    .unwrap();
    let store = ok.unwrap_or_else(|e| panic!("TLS with the test CA: {e}"));
    assert!(store.run(|s| s.batch("none")).await.unwrap().is_none());
    let e = roots
        .err()
        .expect("the platform's roots do not trust the test CA");
    let msg = e.to_string();
    assert!(msg.contains("certificate"), "{msg}");
    let e = plain.err().expect("the server takes TLS connections only");
    assert!(
        e.to_string().contains("no pg_hba.conf entry") || e.to_string().contains("SSL off"),
        "{e}"
    );
    // `[batch]` in kiln.toml builds the same client from its files.
    let cfg: kiln::server::config::ServerConfig = toml::from_str(&format!(
        "[batch]\nstore = \"{}?sslmode=require\"\nca_file = \"{}\"\n",
        pg.url(),
        pki.ca_file().display()
    ))
    .unwrap();
    let remote = cfg.batch.remote().unwrap();
    assert!(remote.tls.is_some());
    let url = pg.url();
    let s = tokio::task::spawn_blocking(move || {
        Store::connect_with(&format!("{url}?sslmode=require"), &remote)
    })
    .await
    .unwrap()
    .unwrap();
    assert!(s.run(|s| s.batch("none")).await.unwrap().is_none());
    // A missing CA file is a diagnostic at startup, naming the file.
    let cfg: kiln::server::config::ServerConfig =
        toml::from_str("[batch]\nca_file = \"/nonexistent/ca.pem\"\n").unwrap();
    let e = cfg
        .batch
        .remote()
        .err()
        .expect("a missing CA file is refused");
    assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
}

/// A database that came back empty (its tables gone, as after a restore
/// or a new server at the same address): the next call says the store is
/// unavailable, and the call after it makes the tables again and works,
/// on the same store without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_came_back_empty_gets_its_tables_again() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    let url = pg.url();
    let store = tokio::task::spawn_blocking(move || Store::connect(&url).unwrap())
        .await
        .unwrap();
    let s = store.clone();
    tokio::task::spawn_blocking(move || {
        let mut up = s.upload("file-e");
        assert_eq!(up.line(0, 1, "c0", "{}").unwrap(), None);
        assert_eq!(up.commit(&file("file-e", 1)).unwrap(), None);
    })
    .await
    .unwrap();
    assert!(store.run(|s| s.file("file-e")).await.unwrap().is_some());
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let driver = tokio::spawn(conn);
    client
        .batch_execute("DROP TABLE files, lines, batches, results")
        .await
        .unwrap();
    let e = store
        .run(|s| s.file("file-e"))
        .await
        .expect_err("the tables are gone");
    assert!(e.is_unavailable(), "{e}");
    // The next call makes the tables again: an empty store, working.
    assert_eq!(store.run(|s| s.file("file-e")).await.unwrap(), None);
    assert!(store.run(|s| s.active()).await.unwrap().is_empty());
    driver.abort();
}

/// An upload whose replica died mid-way (its lines written a page at a
/// time, no file row yet) is swept once no page came for the staleness,
/// while an upload still going on another replica is kept and completes.
#[test]
fn an_interrupted_uploads_lines_are_swept_and_a_live_upload_is_kept() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    let a = Store::connect(&pg.url()).unwrap();
    let b = Store::connect(&pg.url()).unwrap();
    // 2,100 lines: the first 2,000 are written as one page at once.
    let fill = |up: &mut kiln::batch::store::Upload<'_>, from: u64, n: u64| {
        for i in from..from + n {
            assert_eq!(
                up.line(i, i + 1, &format!("c{i}"), "{\"x\":1}").unwrap(),
                None
            );
        }
    };
    let mut dead = a.upload("file-dead");
    fill(&mut dead, 0, 2_100);
    // The replica dies: nothing drops the upload.
    std::mem::forget(dead);
    assert_eq!(b.lines("file-dead", 0, 5).unwrap().len(), 5);
    std::thread::sleep(Duration::from_millis(2_100));
    let mut live = b.upload("file-live");
    fill(&mut live, 0, 2_100);
    // Stale after 1 s: the dead upload's last page is 2 s old, the live
    // one's new.
    let swept = a.sweep_uploads(1).unwrap();
    assert_eq!(swept, 2_000, "the dead upload's written page");
    assert!(b.lines("file-dead", 0, 5).unwrap().is_empty());
    fill(&mut live, 2_100, 1_900);
    assert_eq!(live.commit(&file("file-live", 4_000)).unwrap(), None);
    drop(live);
    // A committed file is never swept, however old.
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(a.sweep_uploads(0).unwrap(), 0);
    let all = a.lines("file-live", 0, 10_000).unwrap();
    assert_eq!(all.len(), 4_000);
}

/// `[batch] max_store_bytes` holds on PostgreSQL too: past it an upload is
/// refused as on a full disk (507 at the API), and the refused upload's
/// lines are not kept.
#[test]
fn max_store_bytes_refuses_uploads_on_postgres() {
    let Some(pg) = support::postgres::Postgres::start() else {
        return;
    };
    let s = Store::connect(&pg.url()).unwrap();
    s.limit_bytes(2 * 1024 * 1024).unwrap();
    // A small file fits.
    let mut up = s.upload("file-small");
    for i in 0..100 {
        assert_eq!(up.line(i, i + 1, &format!("c{i}"), "{}").unwrap(), None);
    }
    assert_eq!(up.commit(&file("file-small", 100)).unwrap(), None);
    drop(up);
    // 1 KB lines, 8,000 of them: pages go in until the tables pass 2 MiB.
    let text = format!("{{\"pad\":\"{}\"}}", "x".repeat(1_000));
    let mut up = s.upload("file-big");
    let mut err = None;
    for i in 0..8_000 {
        if let Err(e) = up.line(i, i + 1, &format!("c{i}"), &text) {
            err = Some(e);
            break;
        }
    }
    let err = match err {
        Some(e) => e,
        None => up.commit(&file("file-big", 8_000)).unwrap_err(),
    };
    assert!(err.is_full(), "{err}");
    assert!(err.to_string().contains("max_store_bytes"), "{err}");
    drop(up);
    assert!(s.lines("file-big", 0, 5).unwrap().is_empty());
    assert!(s.file("file-big").unwrap().is_none());
    assert_eq!(s.lines("file-small", 0, 1_000).unwrap().len(), 100);
}
