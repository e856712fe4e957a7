//! The batch path: uploading and validating a 50,000-line file, creating
//! the batch, and draining it on the simulated GPUs while interactive
//! traffic continues, with the gateway's memory throughout.
//!
//! ```text
//! cargo build --release && cargo bench --bench batch
//! ```
//!
//! Runs `target/release/kiln` (or `KILN_BIN`) as a child process on
//! 127.0.0.1 (port 0), `--sim-speed` `BATCH_BENCH_SPEED` (default 20), a
//! fresh batch store in a temporary directory, under each policy:
//! `bench` (one H100 serving one 8B model to an interactive and a batch
//! tier) and the shipped `policies/enterprise` (tenant `support-bot`
//! interactive, tenant `enrichment` batch, both on `llama-70b`; keys
//! through a generated kiln.toml).
//!
//! Sizes are the Azure 2023 conversation trace's (../shared/traces):
//! interactive requests take its context and generated token counts
//! (prompts capped at 2,048 tokens), batch items its generated counts with
//! prompts capped at 256 tokens (a summarisation job's shape; the cap
//! keeps the file near 20 MB).
//!
//! Phases, per policy:
//! 1. Memory at idle (VmRSS of the gateway).
//! 2. Upload the 50,000-line file (streamed from a generator, so the
//!    bench holds none of it) and create the batch: wall times.
//! 3. Interactive alone: open-loop Poisson arrivals (seeded) at
//!    `BATCH_BENCH_RATE` requests per simulated second for
//!    `BATCH_BENCH_SECS` wall seconds (default 20), streamed; TTFT is
//!    measured client-side to the first content chunk, in simulated time.
//! 4. The same arrivals again while the batch drains: TTFT again, and the
//!    gateway's peak VmRSS (sampled every 100 ms).
//! 5. The batch's finish against its window (bounded wait), its counts.
//!
//! `BATCH_BENCH_INGEST=http` runs only the ingest over HTTP: the same
//! 50,000 lines posted to `POST /v1/files` of the release binary from
//! memory, then `POST /v1/batches`, timed, `BATCH_BENCH_ROUNDS` (5)
//! times on a fresh gateway and store; with `KILN_BASE_BIN` set to
//! another build, alternating with it in the same run (the ratio of the
//! medians is printed).
//!
//! `BATCH_BENCH_INGEST=1` runs only the store's ingest instead: 50,000
//! trace-sized lines (prompts capped at `BATCH_BENCH_INGEST_CAP` tokens,
//! default 150: about 64 MB) validated and written as `POST /v1/files`
//! does (`batch_lines::line`, then `Store::upload`, 2,000 lines a
//! transaction), and, in the same run, the same lines through the old
//! layout (the `lines` table WITHOUT ROWID, the same statements): wall
//! time and the database's size after each.
//!
//! Load is stated against capacity: the pool's utilization
//! (`pool(P).utilization`, work done over roofline capacity) read from
//! `/admin/signals` at the end of phase 3 is what interactive traffic
//! alone offers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code may panic

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BENCH_POLICY: &str = include_str!("batch.kiln");

struct Target {
    name: &'static str,
    policy: PathBuf,
    config: Option<PathBuf>,
    model: &'static str,
    chat_key: &'static str,
    bulk_key: &'static str,
    pool: &'static str,
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn env_f(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rss_kb(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// (context, generated) tokens of the Azure conversation trace.
fn sizes() -> Vec<(u64, u64)> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv");
    let text = std::fs::read_to_string(&p).expect("the Azure conv trace (../shared/traces)");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split(',');
            let _ = f.next()?;
            let c = f.next()?.trim().parse().ok()?;
            let g = f.next()?.trim().parse().ok()?;
            Some((c, g))
        })
        .collect()
}

/// About `tokens` tokens of text.
fn words(tokens: u64, seed: u64) -> String {
    const W: &[&str] = &[
        "order", "delivery", "refund", "account", "summary", "product", "review", "price",
        "customer", "support", "invoice", "shipping",
    ];
    let mut s = String::with_capacity(tokens as usize * 6);
    for i in 0..tokens {
        s.push_str(W[((i + seed) % W.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

fn kiln_bin() -> PathBuf {
    std::env::var("KILN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/kiln"))
}

fn start(t: &Target, store: &Path, speed: f64) -> (Proc, String) {
    start_bin(&kiln_bin(), t, store, speed)
}

fn start_bin(bin: &Path, t: &Target, store: &Path, speed: f64) -> (Proc, String) {
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --release` first",
        bin.display()
    );
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .arg("--policy")
        .arg(&t.policy)
        .args(["--listen", "127.0.0.1:0", "--sim-speed", &speed.to_string()])
        .arg("--batch-store")
        .arg(store);
    if let Some(c) = &t.config {
        cmd.arg("--config").arg(c);
    }
    cmd.env("RUST_LOG", "kiln=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start kiln");
    let err = child.stderr.take().unwrap();
    let addr = Arc::new(Mutex::new(None));
    let a2 = addr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kiln gateway listening on http://") {
                *a2.lock().unwrap() = rest.split_whitespace().next().map(str::to_string);
            }
        }
    });
    let p = Proc(child);
    for _ in 0..300 {
        if let Some(a) = addr.lock().unwrap().clone() {
            return (p, format!("http://{a}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("kiln did not start");
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Open-loop streaming chat requests; TTFTs in simulated ms.
async fn interactive(
    c: &reqwest::Client,
    base: &str,
    t: &Target,
    rate_sim: f64,
    secs: f64,
    speed: f64,
    sizes: &[(u64, u64)],
) -> (Vec<f64>, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut at = 0.0;
    let mut handles = Vec::new();
    let t0 = tokio::time::Instant::now();
    let rate_wall = rate_sim * speed;
    let mut i = 0u64;
    while at < secs {
        let u: f64 = rng.random::<f64>().max(1e-12);
        at += -u.ln() / rate_wall;
        let (ctx, gen) = sizes[rng.random_range(0..sizes.len())];
        let body = json!({"model": t.model, "stream": true, "max_tokens": gen.clamp(1, 1024),
            "messages": [{"role": "user", "content": words(ctx.min(2048), i)}]});
        i += 1;
        let (c, url, key) = (c.clone(), format!("{base}/v1/chat/completions"), t.chat_key);
        let when = t0 + Duration::from_secs_f64(at);
        handles.push(tokio::spawn(async move {
            tokio::time::sleep_until(when).await;
            let sent = Instant::now();
            let mut r = c.post(url).bearer_auth(key).json(&body).send().await.ok()?;
            if !r.status().is_success() {
                let code = r.status().as_u16();
                let why = r.text().await.unwrap_or_default();
                return Some(Err(format!(
                    "{code} {}",
                    why.chars().take(160).collect::<String>()
                )));
            }
            let mut first = None;
            while let Ok(Some(chunk)) = r.chunk().await {
                if first.is_none() && chunk.windows(9).any(|w| w == b"\"content\"") {
                    first = Some(sent.elapsed());
                }
            }
            first.map(|f| Ok(f.as_secs_f64() * 1000.0))
        }));
    }
    let mut ttft = Vec::new();
    let mut failed = 0;
    let mut why: std::collections::BTreeMap<String, usize> = Default::default();
    for h in handles {
        match h.await {
            Ok(Some(Ok(ms))) => ttft.push(ms * speed),
            Ok(Some(Err(e))) => {
                failed += 1;
                *why.entry(e).or_default() += 1;
            }
            _ => failed += 1,
        }
    }
    for (e, n) in why {
        println!("  interactive refusals: {n} x {e}");
    }
    (ttft, failed)
}

fn batch_lines(
    sizes: Vec<(u64, u64)>,
    n: usize,
    model: &'static str,
) -> impl Iterator<Item = bytes::Bytes> {
    (0..n).map(move |i| {
        let (ctx, gen) = sizes[(i * 7919) % sizes.len()];
        let line = json!({"custom_id": format!("item-{i}"), "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": gen.clamp(1, 512),
                     "messages": [{"role": "user", "content": words(ctx.min(256), i as u64)}]}});
        let mut s = line.to_string();
        s.push('\n');
        bytes::Bytes::from(s)
    })
}

async fn run(t: &Target, sizes: &[(u64, u64)]) {
    let speed = env_f("BATCH_BENCH_SPEED", 20.0);
    let rate = env_f("BATCH_BENCH_RATE", 4.0);
    let secs = env_f("BATCH_BENCH_SECS", 20.0);
    let n = env_f("BATCH_BENCH_ITEMS", 50_000.0) as usize;
    let dir = std::env::temp_dir().join(format!(
        "kiln-batch-bench-{}-{}",
        std::process::id(),
        t.name
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (proc, base) = start(t, &dir.join("b.db"), speed);
    let pid = proc.0.id();
    let c = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_kb = rss_kb(pid, "VmRSS:");

    // Upload, streamed from a generator.
    let b = "kilnbenchboundary";
    let head = format!("--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"items.jsonl\"\r\n\r\n");
    let tail = format!("\r\n--{b}--\r\n");
    let parts = std::iter::once(bytes::Bytes::from(head))
        .chain(batch_lines(sizes.to_vec(), n, t.model))
        .chain(std::iter::once(bytes::Bytes::from(tail)));
    let total_bytes: usize = batch_lines(sizes.to_vec(), n, t.model)
        .map(|x| x.len())
        .sum();
    let stream = futures_util::stream::iter(parts.map(Ok::<_, std::io::Error>));
    let t_up = Instant::now();
    let r = c
        .post(format!("{base}/v1/files"))
        .bearer_auth(t.bulk_key)
        .header("content-type", format!("multipart/form-data; boundary={b}"))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let f: Value = r.json().await.unwrap();
    let upload_s = t_up.elapsed().as_secs_f64();
    assert!(status.is_success(), "upload: {f}");
    let after_upload_kb = rss_kb(pid, "VmRSS:");

    // Interactive alone.
    let (mut alone, failed_alone) = interactive(&c, &base, t, rate, secs, speed, sizes).await;
    let sig: Value = c
        .get(format!("{base}/admin/signals"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap_or(Value::Null);
    let util = sig["pools"][t.pool]["utilization"].as_f64();
    let sched_alone = sig["tiers"]["interactive"]["ttft_p99"].clone();
    let after_alone_kb = rss_kb(pid, "VmRSS:");

    // Create the batch, then the same interactive arrivals while it drains.
    let t_create = Instant::now();
    let r = c
        .post(format!("{base}/v1/batches"))
        .bearer_auth(t.bulk_key)
        .json(&json!({"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await
        .unwrap();
    let create_ms = t_create.elapsed().as_secs_f64() * 1000.0;
    let created: Value = r.json().await.unwrap();
    let id = created["id"]
        .as_str()
        .unwrap_or_else(|| panic!("create: {created}"))
        .to_string();
    let peak = Arc::new(Mutex::new(0u64));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let kb = rss_kb(pid, "VmRSS:");
                let mut p = peak.lock().unwrap();
                *p = (*p).max(kb);
                drop(p);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let t_batch = Instant::now();
    let (mut with, failed_with) = interactive(&c, &base, t, rate, secs, speed, sizes).await;
    let sig2: Value = c
        .get(format!("{base}/admin/signals"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap_or(Value::Null);
    let sched_with = sig2["tiers"]["interactive"]["ttft_p99"].clone();
    let mid: Value = c
        .get(format!("{base}/v1/batches/{id}"))
        .bearer_auth(t.bulk_key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // The batch's finish (bounded: ten minutes of wall time).
    let mut fin = mid.clone();
    for _ in 0..6000 {
        fin = c
            .get(format!("{base}/v1/batches/{id}"))
            .bearer_auth(t.bulk_key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if ["completed", "failed", "expired", "cancelled"]
            .contains(&fin["status"].as_str().unwrap_or(""))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drain_wall = t_batch.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = sampler.join();
    let peak_kb = *peak.lock().unwrap();
    let (a99, w99) = (pct(&mut alone, 0.99), pct(&mut with, 0.99));
    let (a50, w50) = (pct(&mut alone, 0.5), pct(&mut with, 0.5));
    println!("\n== batch bench: policy {} (sim speed {speed}, interactive {rate}/s simulated, {secs} s wall per phase)", t.name);
    println!(
        "upload+validate {n} lines ({:.1} MB): {upload_s:.2} s",
        total_bytes as f64 / 1e6
    );
    println!("create batch: {create_ms:.1} ms  (predicted finish in {} s of wall time, predicted miss {})",
        created["kiln"]["predicted_finish_at"].as_i64().map_or("?".into(), |p| (p - created["created_at"].as_i64().unwrap_or(p)).to_string()),
        created["kiln"]["predicted_miss"]);
    println!(
        "interactive load alone: pool `{}` utilization {}",
        t.pool,
        util.map_or("?".into(), |u| format!("{u:.1}%"))
    );
    println!("interactive TTFT (simulated ms)   alone: p50 {a50:.0} p99 {a99:.0} ({} ok, {failed_alone} failed)", alone.len());
    println!("                        with the batch: p50 {w50:.0} p99 {w99:.0} ({} ok, {failed_with} failed)", with.len());
    println!("TTFT p99 ratio with/alone: {:.3}", w99 / a99);
    println!("scheduler-measured interactive ttft_p99 (simulated, last 5 min of each phase): alone {sched_alone} with the batch {sched_with}");
    let counts = &fin["request_counts"];
    let done_at = fin["completed_at"].as_i64();
    println!("batch: status {} completed {} failed {} in {drain_wall:.1} s wall ({:.0} s simulated; window 24h = {} s simulated); progress at the end of phase 4: {:.1}%",
        fin["status"], counts["completed"], counts["failed"], drain_wall * speed, 86_400,
        mid["kiln"]["progress"].as_f64().unwrap_or(0.0) * 100.0);
    let _ = done_at;
    println!("gateway memory: idle {:.1} MB, after upload {:.1} MB, after interactive alone {:.1} MB, peak while draining {:.1} MB ({:.2}x idle, {:.2}x after interactive alone)",
        idle_kb as f64 / 1024.0, after_upload_kb as f64 / 1024.0, after_alone_kb as f64 / 1024.0, peak_kb as f64 / 1024.0,
        peak_kb as f64 / idle_kb.max(1) as f64, peak_kb as f64 / after_alone_kb.max(1) as f64);
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The old layout of the `lines` table, for the ingest comparison.
const OLD_LINES: &str = "CREATE TABLE lines (file_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, text TEXT NOT NULL, PRIMARY KEY (file_id, line)) WITHOUT ROWID;
CREATE UNIQUE INDEX lines_custom_id ON lines (file_id, custom_id);";

fn db_size(p: &Path) -> u64 {
    let wal = p.with_extension("db-wal");
    [p.to_path_buf(), wal]
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum()
}

fn ingest(sizes: &[(u64, u64)]) {
    use kiln::server::batch_lines;
    let n = env_f("BATCH_BENCH_ITEMS", 50_000.0) as usize;
    let cap = env_f("BATCH_BENCH_INGEST_CAP", 150.0) as u64;
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let (ctx, gen) = sizes[(i * 7919) % sizes.len()];
            json!({"custom_id": format!("item-{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "llama-8b", "max_tokens": gen.clamp(1, 512),
                         "messages": [{"role": "user", "content": words(ctx.min(cap), i as u64)}]}})
            .to_string()
        })
        .collect();
    let mb = lines.iter().map(|l| l.len() + 1).sum::<usize>() as f64 / 1e6;
    let known = |m: &str| m == "llama-8b";
    let dir = std::env::temp_dir().join(format!("kiln-batch-ingest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // New: the store as the gateway writes an upload.
    let new_path = dir.join("new.db");
    let store = kiln::batch::store::Store::open(&new_path).unwrap();
    let t = Instant::now();
    {
        let mut up = store.upload("file-bench");
        for (i, l) in lines.iter().enumerate() {
            let v = batch_lines::line(l, i as u64 + 1, &known).unwrap();
            assert!(up
                .line(i as u64, i as u64 + 1, &v.custom_id, l)
                .unwrap()
                .is_none());
        }
        let row = kiln::batch::FileRow {
            id: "file-bench".into(),
            owner: None,
            purpose: "batch".into(),
            filename: "b.jsonl".into(),
            bytes: (mb * 1e6) as u64,
            created_at: 0,
            lines: n as u64,
            endpoint: Some("/v1/chat/completions".into()),
            batch_id: None,
            ok: None,
        };
        assert!(up.commit(&row).unwrap().is_none());
    }
    let new_s = t.elapsed().as_secs_f64();
    store.reclaim();
    let new_mb = db_size(&new_path) as f64 / 1e6;
    drop(store);
    // Old: the WITHOUT ROWID layout, the statements the old upload ran.
    let old_path = dir.join("old.db");
    let c = rusqlite::Connection::open(&old_path).unwrap();
    c.pragma_update(None, "journal_mode", "WAL").unwrap();
    c.pragma_update(None, "synchronous", "NORMAL").unwrap();
    c.execute_batch(OLD_LINES).unwrap();
    let mut c = c;
    let t = Instant::now();
    for (k, chunk) in lines.chunks(2000).enumerate() {
        let mut parsed = Vec::with_capacity(chunk.len());
        for (j, l) in chunk.iter().enumerate() {
            let i = k * 2000 + j;
            parsed.push((
                i,
                batch_lines::line(l, i as u64 + 1, &known)
                    .unwrap()
                    .custom_id,
            ));
        }
        let tx = c.transaction().unwrap();
        {
            let mut st = tx
                .prepare_cached("INSERT OR IGNORE INTO lines (file_id, line, custom_id, text) VALUES (?1, ?2, ?3, ?4)")
                .unwrap();
            for ((i, id), l) in parsed.iter().zip(chunk) {
                st.execute(rusqlite::params!["file-bench", *i as i64, id, l])
                    .unwrap();
            }
        }
        tx.commit().unwrap();
    }
    let old_s = t.elapsed().as_secs_f64();
    let _ = c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
    let old_mb = db_size(&old_path) as f64 / 1e6;
    drop(c);
    println!(
        "ingest {n} lines ({mb:.1} MB), validate + store: rowid layout {new_s:.2} s ({:.0} MB/s), store {new_mb:.1} MB; old WITHOUT ROWID layout {old_s:.2} s, store {old_mb:.1} MB; {:.2}x faster, {:.2}x smaller",
        mb / new_s,
        old_s / new_s,
        old_mb / new_mb
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// 50,000 trace-sized lines (as [`ingest`] makes them) uploaded through
/// `POST /v1/files` of a release `kiln serve` and batched with `POST
/// /v1/batches`: wall time of each and of both, per round on a fresh
/// gateway and store. With `KILN_BASE_BIN` (another build, e.g. of the
/// commit before), the same rounds alternate between the two binaries in
/// this run and the ratio of their medians is printed.
fn ingest_http(sizes: &[(u64, u64)], policy: &Path) {
    let n = env_f("BATCH_BENCH_ITEMS", 50_000.0) as usize;
    let cap = env_f("BATCH_BENCH_INGEST_CAP", 150.0) as u64;
    let rounds = env_f("BATCH_BENCH_ROUNDS", 5.0) as usize;
    let b = "kilnbenchboundary";
    let mut body = format!("--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"items.jsonl\"\r\n\r\n");
    let head = body.len();
    for i in 0..n {
        let (ctx, gen) = sizes[(i * 7919) % sizes.len()];
        body.push_str(&json!({"custom_id": format!("item-{i}"), "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "llama-8b", "max_tokens": gen.clamp(1, 512),
                     "messages": [{"role": "user", "content": words(ctx.min(cap), i as u64)}]}})
        .to_string());
        body.push('\n');
    }
    let mb = (body.len() - head) as f64 / 1e6;
    body.push_str(&format!("\r\n--{b}--\r\n"));
    let body = bytes::Bytes::from(body);
    let t = Target {
        name: "bench",
        policy: policy.to_path_buf(),
        config: None,
        model: "llama-8b",
        chat_key: "k-chat",
        bulk_key: "k-bulk",
        pool: "gpu",
    };
    let mut bins = vec![("now", kiln_bin())];
    if let Ok(base) = std::env::var("KILN_BASE_BIN") {
        bins.push(("base", PathBuf::from(base)));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // (upload, create, total) seconds per binary.
    let mut got: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); bins.len()];
    for round in 0..rounds {
        for k in 0..bins.len() {
            // Alternate which binary goes first.
            let k = (k + round) % bins.len();
            let (name, bin) = &bins[k];
            let dir = std::env::temp_dir()
                .join(format!("kiln-ingest-http-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let (proc, base) = start_bin(bin, &t, &dir.join("b.db"), 20.0);
            let times = rt.block_on(async {
                let c = reqwest::Client::builder()
                    .no_proxy()
                    .timeout(Duration::from_secs(120))
                    .build()
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
                let t0 = Instant::now();
                let r = c
                    .post(format!("{base}/v1/files"))
                    .bearer_auth(t.bulk_key)
                    .header("content-type", format!("multipart/form-data; boundary={b}"))
                    .body(body.clone())
                    .send()
                    .await
                    .unwrap();
                assert!(r.status().is_success(), "upload: {}", r.text().await.unwrap_or_default());
                let f: Value = r.json().await.unwrap();
                let up = t0.elapsed().as_secs_f64();
                let t1 = Instant::now();
                let r = c
                    .post(format!("{base}/v1/batches"))
                    .bearer_auth(t.bulk_key)
                    .json(&json!({"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
                    .send()
                    .await
                    .unwrap();
                assert!(r.status().is_success(), "create: {}", r.text().await.unwrap_or_default());
                let created: Value = r.json().await.unwrap();
                assert_eq!(created["request_counts"]["total"], n as u64, "{created}");
                (up, t1.elapsed().as_secs_f64(), t0.elapsed().as_secs_f64())
            });
            println!(
                "round {round} {name}: upload {:.3} s, create {:.1} ms, total {:.3} s",
                times.0,
                times.1 * 1000.0,
                times.2
            );
            got[k].push(times);
            drop(proc);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut totals = Vec::new();
    for ((name, bin), runs) in bins.iter().zip(&got) {
        let mut up: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let mut cr: Vec<f64> = runs.iter().map(|r| r.1).collect();
        let mut tot: Vec<f64> = runs.iter().map(|r| r.2).collect();
        let under = tot.iter().filter(|t| **t < 2.0).count();
        let m = median(&mut tot);
        println!(
            "ingest over HTTP, {n} lines ({mb:.1} MB), {name} ({}): median upload {:.3} s, create {:.1} ms, upload + create {m:.3} s (min {:.3}, max {:.3}); under 2 s in {under}/{}",
            bin.display(),
            median(&mut up),
            median(&mut cr) * 1000.0,
            tot[0],
            tot[tot.len() - 1],
            tot.len()
        );
        totals.push(m);
    }
    if totals.len() == 2 {
        println!(
            "base/now (median upload + create): {:.2}x",
            totals[1] / totals[0]
        );
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at the end: {}", load.trim());
}

fn main() {
    let sizes = sizes();
    if std::env::var("BATCH_BENCH_INGEST").is_ok_and(|v| v == "1") {
        ingest(&sizes);
        return;
    }
    let dir = std::env::temp_dir().join(format!("kiln-batch-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bench_policy = dir.join("bench.kiln");
    std::fs::write(&bench_policy, BENCH_POLICY).unwrap();
    if std::env::var("BATCH_BENCH_INGEST").is_ok_and(|v| v == "http") {
        ingest_http(&sizes, &bench_policy);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let cfg = dir.join("kiln.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[keys]]\ntenant = \"support-bot\"\nsha256 = \"{}\"\n\n[[keys]]\ntenant = \"enrichment\"\nsha256 = \"{}\"\n",
            kiln::server::config::hash_secret("k-chat"),
            kiln::server::config::hash_secret("k-bulk")
        ),
    )
    .unwrap();
    let targets = [
        Target {
            name: "bench",
            policy: bench_policy,
            config: None,
            model: "llama-8b",
            chat_key: "k-chat",
            bulk_key: "k-bulk",
            pool: "gpu",
        },
        Target {
            name: "enterprise",
            policy: Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/enterprise"),
            config: Some(cfg),
            model: "llama-70b",
            chat_key: "k-chat",
            bulk_key: "k-bulk",
            pool: "h100",
        },
    ];
    let only = std::env::var("BATCH_BENCH_POLICY").ok();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for t in &targets {
        if only.as_deref().is_some_and(|o| o != t.name) {
            continue;
        }
        rt.block_on(run(t, &sizes));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
