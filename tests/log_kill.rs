//! Issue 27: `kill -9` loses at most the decision log's last few
//! milliseconds. A real `kiln serve` process (the built binary, on
//! loopback) answers a burst of requests; a moment after the last answer
//! it is SIGKILLed, and every answered request has its line in the log.
//! Before the fix the writer flushed every 200 ms, and a kill in that
//! window lost the burst's buffered lines (90 and more of a batch).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use support::TempDir;

const POLICY: &str = r#"
pool gpu { gpus 8 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 64 }
}
tier high { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
classify { default => tier high }
route [high] tiny { default => fp16 }
"#;

/// SIGKILLed and reaped when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(dir: &TempDir) -> (Proc, String) {
    std::fs::write(dir.0.join("p.kiln"), POLICY).unwrap();
    let log = dir.0.join("d.jsonl");
    std::fs::write(
        dir.0.join("kiln.toml"),
        format!(
            "[log]\npath = \"{}\"\n[sim]\nspeed = 100.0\n",
            log.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("serve")
        .arg("--policy")
        .arg(dir.0.join("p.kiln"))
        .arg("--config")
        .arg(dir.0.join("kiln.toml"))
        .args(["--listen", "127.0.0.1:0"])
        .current_dir(&dir.0)
        .env("RUST_LOG", "kiln=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start kiln serve");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix("kiln gateway listening on http://") {
                if let (Some(tx), Some(addr)) = (tx.take(), rest.split(' ').next()) {
                    let _ = tx.send(addr.to_string());
                }
            }
        }
    });
    let proc = Proc(child);
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("kiln serve did not report its address");
    (proc, format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_loses_no_line_of_requests_answered_before_it() {
    let dir = TempDir::new("log-kill");
    let (mut proc, base) = start(&dir);
    let c = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    const N: usize = 120;
    // A burst, like a batch's items ending together.
    let answered: Vec<u16> = futures_util::future::join_all((0..N).map(|_| {
        let (c, base) = (c.clone(), base.clone());
        async move {
            let r = c
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("k-alpha")
                .json(&json!({"model": "tiny", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap();
            let s = r.status().as_u16();
            let _ = r.bytes().await.unwrap();
            s
        }
    }))
    .await;
    assert!(answered.iter().all(|s| *s == 200), "{answered:?}");
    // Five times the documented flush interval (10 ms), far below the old
    // one (200 ms).
    tokio::time::sleep(Duration::from_millis(50)).await;
    proc.0.kill().unwrap();
    proc.0.wait().unwrap();
    let text = std::fs::read_to_string(dir.0.join("d.jsonl")).unwrap_or_default();
    let lines = text.lines().filter(|l| !l.trim().is_empty()).count();
    assert_eq!(lines, N, "lines in the log after kill -9");
}
