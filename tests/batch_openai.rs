//! OpenAI batch semantics: the batch object's `model` and `usage`,
//! `output_expires_after` honoured (the output file expires and is gone),
//! lines the backend cannot serve refused at upload by line number,
//! endpoints no backend serves refused by name, and the running cost
//! growing with progress. A gateway on 127.0.0.1:0 on the simulated
//! backend; every loop is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
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
classify {
  when batch => tier batch
  default => tier interactive
}
route [interactive, batch] tiny { default => fp16 }
"#;

async fn gateway(speed: f64) -> Running {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = speed;
    serve_on_loopback(policy("b.kiln", POLICY), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

fn line(i: usize, url: &str, body: Value) -> String {
    json!({"custom_id": format!("req-{i}"), "method": "POST", "url": url, "body": body}).to_string()
}

fn chat(i: usize, max_tokens: u64) -> String {
    line(
        i,
        "/v1/chat/completions",
        json!({"model": "tiny", "messages": [{"role": "user", "content": format!("summarise item {i}")}], "max_tokens": max_tokens}),
    )
}

async fn upload(c: &reqwest::Client, base: &str, content: &str) -> reqwest::Response {
    support::batches::post_file(c, base, "k-alpha", content).await
}

async fn file_of(c: &reqwest::Client, base: &str, lines: &[String]) -> String {
    let r = upload(c, base, &(lines.join("\n") + "\n")).await;
    assert_eq!(r.status(), 200);
    let f: Value = r.json().await.unwrap();
    f["id"].as_str().unwrap().to_string()
}

async fn create(c: &reqwest::Client, base: &str, body: Value) -> reqwest::Response {
    c.post(format!("{base}/v1/batches"))
        .bearer_auth("k-alpha")
        .json(&body)
        .send()
        .await
        .unwrap()
}

async fn get(c: &reqwest::Client, url: &str) -> reqwest::Response {
    c.get(url).bearer_auth("k-alpha").send().await.unwrap()
}

async fn wait_done(c: &reqwest::Client, base: &str, id: &str) -> Value {
    for _ in 0..600 {
        let b: Value = get(c, &format!("{base}/v1/batches/{id}"))
            .await
            .json()
            .await
            .unwrap();
        if ["completed", "failed", "expired", "cancelled"].contains(&b["status"].as_str().unwrap())
        {
            return b;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("batch {id} did not finish in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_and_model_are_the_sums_of_the_results() {
    let gw = gateway(50.0).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let lines: Vec<String> = (0..40).map(|i| chat(i, 6)).collect();
    let fid = file_of(&c, &base, &lines).await;
    let r = create(&c, &base, json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["model"], "tiny", "{b}");
    let done = wait_done(&c, &base, b["id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["model"], "tiny", "{done}");
    let out = done["output_file_id"].as_str().unwrap();
    let text = get(&c, &format!("{base}/v1/files/{out}/content"))
        .await
        .text()
        .await
        .unwrap();
    let (mut input, mut output) = (0u64, 0u64);
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        input += v["response"]["body"]["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap();
        output += v["response"]["body"]["usage"]["completion_tokens"]
            .as_u64()
            .unwrap();
    }
    assert!(input > 0 && output > 0);
    let u = &done["usage"];
    assert_eq!(u["input_tokens"], input, "{done}");
    assert_eq!(u["output_tokens"], output, "{done}");
    assert_eq!(u["total_tokens"], input + output, "{done}");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_output_file_expires_as_asked() {
    // At speed 1000 an hour (OpenAI's shortest) lasts 3.6 wall seconds.
    let gw = gateway(1000.0).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let fid = file_of(&c, &base, &(0..5).map(|i| chat(i, 4)).collect::<Vec<_>>()).await;
    for bad in [
        json!({"anchor": "completed_at", "seconds": 3600}),
        json!({"anchor": "created_at", "seconds": 60}),
    ] {
        let r = create(&c, &base, json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h", "output_expires_after": bad})).await;
        assert_eq!(r.status(), 400);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["param"], "output_expires_after", "{e}");
    }
    let r = create(&c, &base, json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h", "output_expires_after": {"anchor": "created_at", "seconds": 3600}})).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let done = wait_done(&c, &base, b["id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "completed", "{done}");
    let out = done["output_file_id"].as_str().unwrap().to_string();
    let f: Value = get(&c, &format!("{base}/v1/files/{out}"))
        .await
        .json()
        .await
        .unwrap();
    let expires = f["expires_at"].as_i64().unwrap_or_else(|| panic!("{f}"));
    assert!(expires > f["created_at"].as_i64().unwrap(), "{f}");
    assert_eq!(
        get(&c, &format!("{base}/v1/files/{out}/content"))
            .await
            .status(),
        200
    );
    let t = Instant::now();
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        if now > expires {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        get(&c, &format!("{base}/v1/files/{out}")).await.status(),
        404
    );
    assert_eq!(
        get(&c, &format!("{base}/v1/files/{out}/content"))
            .await
            .status(),
        404
    );
    // The input file does not expire.
    assert_eq!(
        get(&c, &format!("{base}/v1/files/{fid}")).await.status(),
        200
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_the_backend_cannot_serve_are_refused_at_upload_by_line() {
    let gw = gateway(50.0).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let n2 = line(
        1,
        "/v1/chat/completions",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}),
    );
    let huge = line(
        1,
        "/v1/chat/completions",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1_000_000_000_000_000u64}),
    );
    let tools = line(
        1,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}),
    );
    let emb = line(1, "/v1/embeddings", json!({"model": "tiny", "input": "x"}));
    for (bad, field, url_ok) in [
        (n2, "body.n", true),
        (huge, "body.max_tokens", true),
        (tools, "body.tools", false),
        (emb, "url", false),
    ] {
        let first = if url_ok {
            chat(0, 4)
        } else {
            line(
                0,
                if field == "url" {
                    "/v1/chat/completions"
                } else {
                    "/v1/completions"
                },
                if field == "url" {
                    json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
                } else {
                    json!({"model": "tiny", "prompt": "x"})
                },
            )
        };
        let content = format!("{first}\n{bad}\n");
        let r = upload(&c, &base, &content).await;
        assert_eq!(r.status(), 400, "{bad}");
        let e: Value = r.json().await.unwrap();
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with(&format!("line 2: `{field}`")), "{msg}");
        if field == "url" {
            assert!(msg.contains("embeddings"), "{msg}");
        }
    }
    // An endpoint no backend serves is refused by name at creation.
    let fid = file_of(&c, &base, &[chat(0, 4)]).await;
    let r = create(
        &c,
        &base,
        json!({"input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h"}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "unsupported_endpoint", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("embeddings"),
        "{e}"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_grows_with_progress() {
    let gw = gateway(5.0).await;
    let base = format!("http://{}", gw.addr);
    let c = client();
    let fid = file_of(
        &c,
        &base,
        &(0..200).map(|i| chat(i, 16)).collect::<Vec<_>>(),
    )
    .await;
    let r = create(&c, &base, json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})).await;
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap();
    // While it runs: cost and usage are those of the items done so far.
    let mut seen = Vec::new();
    for _ in 0..400 {
        let v: Value = get(&c, &format!("{base}/v1/batches/{id}"))
            .await
            .json()
            .await
            .unwrap();
        let done = v["request_counts"]["completed"].as_u64().unwrap();
        if ["completed", "failed", "expired", "cancelled"].contains(&v["status"].as_str().unwrap())
        {
            break;
        }
        if done > 0 {
            seen.push((
                done,
                v["kiln"]["cost"].as_f64().unwrap(),
                v["usage"]["output_tokens"].as_u64().unwrap(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mid: Vec<_> = seen.iter().filter(|(d, ..)| *d < 200).collect();
    assert!(mid.len() >= 2, "{seen:?}");
    assert!(
        mid.iter().all(|(_, cost, out)| *cost > 0.0 && *out > 0),
        "{seen:?}"
    );
    assert!(
        mid.windows(2).all(|w| w[1].1 >= w[0].1 && w[1].2 >= w[0].2),
        "{seen:?}"
    );
    let done = wait_done(&c, &base, id).await;
    let last = mid.last().unwrap();
    assert!(done["kiln"]["cost"].as_f64().unwrap() >= last.1);
    gw.stop().await;
}
