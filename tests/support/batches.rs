//! The Batches API from a client's side: upload a JSONL file, create a
//! batch, read it back, wait for it to end (bounded).

use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// `n` chat lines for model `model`, custom ids `{tag}-{i}`.
pub fn jsonl(tag: &str, model: &str, n: usize, max_tokens: u64) -> String {
    let mut s = String::new();
    for i in 0..n {
        let line = json!({
            "custom_id": format!("{tag}-{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": format!("summarise item {i} of {tag}")}], "max_tokens": max_tokens}
        });
        s.push_str(&line.to_string());
        s.push('\n');
    }
    s
}

/// `POST /v1/files`: `content` as a multipart `batch` file with `key`.
pub async fn post_file(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    content: &str,
) -> reqwest::Response {
    let b = "kilnboundary7e3f";
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{content}\r\n--{b}--\r\n"
    );
    c.post(format!("{base}/v1/files"))
        .bearer_auth(key)
        .header("content-type", format!("multipart/form-data; boundary={b}"))
        .body(body)
        .send()
        .await
        .unwrap()
}

/// Uploads `content` as a `batch` file with `key`; its id.
pub async fn upload(c: &reqwest::Client, base: &str, key: &str, content: &str) -> String {
    let r = post_file(c, base, key, content).await;
    assert_eq!(r.status(), 200);
    let f: Value = r.json().await.unwrap();
    f["id"].as_str().unwrap().to_string()
}

/// `POST /v1/batches` for `file` with `window` and `metadata`.
pub async fn create(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    file: &str,
    window: &str,
    metadata: Value,
) -> reqwest::Response {
    c.post(format!("{base}/v1/batches"))
        .bearer_auth(key)
        .json(
            &json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
            "completion_window": window, "metadata": metadata}),
        )
        .send()
        .await
        .unwrap()
}

/// `GET /v1/batches/{id}`.
pub async fn get(c: &reqwest::Client, base: &str, key: &str, id: &str) -> Value {
    c.get(format!("{base}/v1/batches/{id}"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Whether a batch object is in a final state.
pub fn terminal(b: &Value) -> bool {
    ["completed", "failed", "expired", "cancelled"].contains(&b["status"].as_str().unwrap_or(""))
}

/// Polls every 50 ms, for at most `limit`, until `f` holds of the batch
/// objects of `ids`; their last reading.
pub async fn until(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    ids: &[String],
    limit: Duration,
    f: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let end = Instant::now() + limit;
    loop {
        let mut all = Vec::new();
        for id in ids {
            all.push(get(c, base, key, id).await);
        }
        if f(&all) || Instant::now() >= end {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
