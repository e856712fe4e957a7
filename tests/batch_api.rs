//! The Files and Batches API end to end: a gateway on 127.0.0.1:0 with a
//! batch store, real HTTP (multipart uploads), the simulated backend.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;
use support::{policy, serve_on_loopback};

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 8 }
}
tier interactive { priority 100 slo { ttft 2s } preempts [batch] }
tier batch { priority 10 slo { window 24h } preemptible }
tenant alpha { owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] cost 4/h }
tenant beta { owner "b@x" tiers [interactive, batch] api_keys ["k-beta"] }
classify {
  when batch => tier batch
  default => tier interactive
}
route [interactive, batch] tiny { default => fp16 }
"#;

async fn gateway(speed: f64, store: Option<std::path::PathBuf>) -> Running {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = speed;
    cfg.batch.store = store;
    serve_on_loopback(policy("b.kiln", POLICY), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

/// A JSONL batch file of `n` chat requests, ids `req-0`…
fn jsonl(n: usize, max_tokens: u64) -> String {
    support::batches::jsonl("req", "tiny", n, max_tokens)
}

/// POST /v1/files as multipart.
async fn upload(c: &reqwest::Client, base: &str, key: &str, content: &str) -> reqwest::Response {
    support::batches::post_file(c, base, key, content).await
}

async fn create(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    file: &str,
    window: &str,
) -> reqwest::Response {
    c.post(format!("{base}/v1/batches"))
        .bearer_auth(key)
        .json(&json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": window, "metadata": {"job": "nightly"}}))
        .send()
        .await
        .unwrap()
}

async fn get(c: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    c.get(url).bearer_auth(key).send().await.unwrap()
}

/// Polls until the batch is in a final state (bounded).
async fn wait_done(c: &reqwest::Client, base: &str, key: &str, id: &str) -> Value {
    for _ in 0..600 {
        let b: Value = get(c, &format!("{base}/v1/batches/{id}"), key)
            .await
            .json()
            .await
            .unwrap();
        if ["completed", "failed", "expired", "cancelled"].contains(&b["status"].as_str().unwrap())
        {
            return b;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("batch {id} did not finish in time");
}

/// `custom_id` → count over the lines of a JSONL body.
fn ids(text: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(l).unwrap();
        *m.entry(v["custom_id"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_to_completion_with_every_result_once() {
    let gw = gateway(20.0, None).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let r = upload(&c, &base, "k-alpha", &jsonl(200, 8)).await;
    assert_eq!(r.status(), 200);
    let f: Value = r.json().await.unwrap();
    assert_eq!(f["object"], "file");
    assert_eq!(f["purpose"], "batch");
    let fid = f["id"].as_str().unwrap();
    let r = create(&c, &base, "k-alpha", fid, "24h").await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["status"], "validating");
    assert_eq!(b["request_counts"]["total"], 200);
    assert_eq!(b["metadata"]["job"], "nightly");
    assert_eq!(b["kiln"]["tier"], "batch");
    assert_eq!(b["kiln"]["predicted_miss"], false, "{b}");
    let id = b["id"].as_str().unwrap();
    let done = wait_done(&c, &base, "k-alpha", id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["completed"], 200);
    assert_eq!(done["request_counts"]["failed"], 0);
    assert!(done["completed_at"].as_i64().unwrap() >= done["created_at"].as_i64().unwrap());
    assert!(
        done["kiln"]["gpu_seconds"].as_f64().unwrap() > 0.0,
        "{done}"
    );
    assert!(done["kiln"]["cost"].as_f64().unwrap() > 0.0, "{done}");
    let out = done["output_file_id"].as_str().unwrap();
    assert!(done["error_file_id"].is_null());
    let text = get(&c, &format!("{base}/v1/files/{out}/content"), "k-alpha")
        .await
        .text()
        .await
        .unwrap();
    let seen = ids(&text);
    assert_eq!(seen.len(), 200);
    assert!(seen.values().all(|&n| n == 1));
    let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["response"]["status_code"], 200);
    assert_eq!(first["response"]["body"]["object"], "chat.completion");
    assert!(first["response"]["request_id"].is_string());
    assert!(first["error"].is_null());
    // Each item was decided like a request, and explains why.
    let rid = first["response"]["request_id"].as_str().unwrap();
    let ex: Value = c
        .get(format!("{base}/admin/explain/{rid}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ex["request"]["headers"]["x-kiln-batch"], id, "{ex}");
    // The other tenant sees none of it: 404, as for an id that never was.
    for url in [
        format!("{base}/v1/batches/{id}"),
        format!("{base}/v1/files/{fid}"),
        format!("{base}/v1/files/{out}/content"),
    ] {
        assert_eq!(get(&c, &url, "k-beta").await.status(), 404, "{url}");
    }
    let list: Value = get(&c, &format!("{base}/v1/batches"), "k-beta")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"].as_array().unwrap().len(), 0);
    let r = c
        .post(format!("{base}/v1/batches/{id}/cancel"))
        .bearer_auth("k-beta")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // The admin view sees every batch.
    let all: Value = c
        .get(format!("{base}/admin/batches"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(all["data"][0]["id"], id);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_line_is_named_and_nothing_is_stored() {
    let gw = gateway(1.0, None).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let mut text = jsonl(5, 8);
    text.push_str(r#"{"custom_id":"x","method":"POST","url":"/v1/chat/completions","body":{"model":"nope","messages":[{"role":"user","content":"a"}]}}"#);
    text.push('\n');
    let r = upload(&c, &base, "k-alpha", &text).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("line 6: `body.model`"), "{msg}");
    assert_eq!(e["error"]["param"], "body.model");
    // A repeated custom_id names both requests.
    let dup = format!("{}{}", jsonl(3, 8), jsonl(1, 8));
    let e: Value = upload(&c, &base, "k-alpha", &dup)
        .await
        .json()
        .await
        .unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("line 4") && msg.contains("req-0") && msg.contains("request 1"),
        "{msg}"
    );
    // Not JSON at all.
    let e: Value = upload(&c, &base, "k-alpha", "{\"custom_id\": \n")
        .await
        .json()
        .await
        .unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("line 1: `line`"),
        "{e}"
    );
    let files: Value = get(&c, &format!("{base}/v1/files"), "k-alpha")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(files["data"].as_array().unwrap().len(), 0, "{files}");
    // Windows the tier does not accept are refused with the accepted ones.
    let f: Value = upload(&c, &base, "k-alpha", &jsonl(2, 8))
        .await
        .json()
        .await
        .unwrap();
    let r = create(&c, &base, "k-alpha", f["id"].as_str().unwrap(), "7d").await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "completion_window", "{e}");
    // And another tenant's file cannot be batched.
    let r = create(&c, &base, "k-beta", f["id"].as_str().unwrap(), "24h").await;
    assert_eq!(r.status(), 400);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_stops_the_batch_and_accounts_for_every_item() {
    // Real speed and long outputs: the batch is still running when cancelled.
    let gw = gateway(1.0, None).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let f: Value = upload(&c, &base, "k-alpha", &jsonl(300, 2000))
        .await
        .json()
        .await
        .unwrap();
    let b: Value = create(&c, &base, "k-alpha", f["id"].as_str().unwrap(), "24h")
        .await
        .json()
        .await
        .unwrap();
    let id = b["id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let r = c
        .post(format!("{base}/v1/batches/{id}/cancel"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(
        ["cancelling", "cancelled"].contains(&v["status"].as_str().unwrap()),
        "{v}"
    );
    let done = wait_done(&c, &base, "k-alpha", id).await;
    assert_eq!(done["status"], "cancelled", "{done}");
    assert!(done["cancelled_at"].is_i64());
    // Every item is in exactly one of the files.
    let mut all = HashMap::new();
    for k in ["output_file_id", "error_file_id"] {
        if let Some(fid) = done[k].as_str() {
            let text = get(&c, &format!("{base}/v1/files/{fid}/content"), "k-alpha")
                .await
                .text()
                .await
                .unwrap();
            for (id, n) in ids(&text) {
                *all.entry(id).or_insert(0) += n;
            }
        }
    }
    assert_eq!(all.len(), 300);
    assert!(all.values().all(|&n| n == 1));
    // Cancelling again is refused: the batch is over.
    let r = c
        .post(format!("{base}/v1/batches/{id}/cancel"))
        .bearer_auth("k-alpha")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_page_and_survive_a_restart_on_the_same_store() {
    let dir = std::env::temp_dir().join(format!("kiln-batch-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("b.db");
    let c = client();
    let ids_made;
    {
        let gw = gateway(1.0, Some(path.clone())).await;
        let base = format!("http://{}", gw.addr);
        let f: Value = upload(&c, &base, "k-alpha", &jsonl(50, 4000))
            .await
            .json()
            .await
            .unwrap();
        let mut made = Vec::new();
        for _ in 0..3 {
            let b: Value = create(&c, &base, "k-alpha", f["id"].as_str().unwrap(), "24h")
                .await
                .json()
                .await
                .unwrap();
            made.push(b["id"].as_str().unwrap().to_string());
        }
        // Newest first, two per page, `after` the last one seen.
        let p1: Value = get(&c, &format!("{base}/v1/batches?limit=2"), "k-alpha")
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(p1["data"].as_array().unwrap().len(), 2);
        assert_eq!(p1["has_more"], true);
        assert_eq!(p1["data"][0]["id"], made[2].as_str());
        let after = p1["last_id"].as_str().unwrap();
        let p2: Value = get(
            &c,
            &format!("{base}/v1/batches?limit=2&after={after}"),
            "k-alpha",
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(p2["data"].as_array().unwrap().len(), 1);
        assert_eq!(p2["has_more"], false);
        assert_eq!(p2["data"][0]["id"], made[0].as_str());
        ids_made = made;
        gw.stop().await;
    }
    // A new gateway on the same store has them, and resumes them.
    let gw = gateway(200.0, Some(path.clone())).await;
    let base = format!("http://{}", gw.addr);
    for id in &ids_made {
        let done = wait_done(&c, &base, "k-alpha", id).await;
        assert_eq!(done["status"], "completed", "{done}");
        assert_eq!(done["request_counts"]["completed"], 50);
    }
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_holds_up_no_batch() {
    use tokio::io::AsyncWriteExt;
    let gw = gateway(20.0, None).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let f: Value = upload(&c, &base, "k-alpha", &jsonl(200, 8))
        .await
        .json()
        .await
        .unwrap();
    // An upload that sends half a file, then nothing.
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let b = "stallboundary";
    let part = format!("--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n\r\n{}", jsonl(3000, 8));
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-beta\r\ncontent-type: multipart/form-data; boundary={b}\r\ncontent-length: {}\r\n\r\n",
        part.len() * 2
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(part.as_bytes()).await.unwrap();
    // Meanwhile batches are created and run to the end.
    let t = std::time::Instant::now();
    let r = create(&c, &base, "k-alpha", f["id"].as_str().unwrap(), "24h").await;
    assert_eq!(r.status(), 200);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "create waited {:?}",
        t.elapsed()
    );
    let b: Value = r.json().await.unwrap();
    let done = wait_done(&c, &base, "k-alpha", b["id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "completed");
    drop(sock);
    // The abandoned upload left no file behind.
    let files: Value = get(&c, &format!("{base}/v1/files"), "k-beta")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(files["data"].as_array().unwrap().len(), 0);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_file_and_batching_it_at_once_never_both_succeed() {
    let gw = gateway(1.0, None).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    for _ in 0..20 {
        let f: Value = upload(&c, &base, "k-alpha", &jsonl(3, 8))
            .await
            .json()
            .await
            .unwrap();
        let fid = f["id"].as_str().unwrap().to_string();
        let del = c
            .delete(format!("{base}/v1/files/{fid}"))
            .bearer_auth("k-alpha")
            .send();
        let (d, b) = tokio::join!(del, create(&c, &base, "k-alpha", &fid, "24h"));
        let (d, b) = (d.unwrap().status().as_u16(), b.status().as_u16());
        assert!(
            !(d == 200 && b == 200),
            "the file was deleted and batched: {d} {b}"
        );
        assert!(d == 200 || b == 200, "neither happened: {d} {b}");
    }
    gw.stop().await;
}
