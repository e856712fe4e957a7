//! The gateway's HTTP surface as OpenAI clients and curl users meet it:
//! refusals with a code, a request id and an explain entry; the models a
//! key may use; unknown paths and methods in JSON; request fields the
//! simulator cannot honour refused by name, and passed through unchanged
//! to an HTTP upstream. `kiln::server::start` on 127.0.0.1:0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use kiln::server::Running;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{policy, serve_on_loopback};

/// Two models: tier `low` rejects `big`, so tenant beta (tier `low`) may
/// use `tiny` alone.
const TWO: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 4 }
}
model big {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 4 }
}
tier high { priority 100 slo { p95 600s } }
tier low { priority 10 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
tenant beta { owner "b@x" tiers [low] api_keys ["k-beta"] }
tenant gamma {
  owner "c@x"
  tiers [low]
  quota { requests 1/min }
  api_keys ["k-gamma"]
}
classify {
  when tenant == alpha => tier high
  default => tier low
}
route [high, low] tiny { default => fp16 }
route [high] big { default => fp16 }
route [low] big { default => reject 403 "big is for tier high" }
"#;

/// One model, for an HTTP upstream.
const UP: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 4 }
}
tier high { priority 100 slo { p95 600s } }
tenant alpha { owner "a@x" tiers [high] api_keys ["k-alpha"] }
classify { default => tier high }
route [high] tiny { default => fp16 }
"#;

/// The same without keys.
const OPEN: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 4 }
}
model big {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 4 }
}
tier low { priority 10 slo { p95 600s } }
classify { default => tier low }
route [low] tiny { default => fp16 }
route [low] big { default => fp16 }
"#;

async fn serve(text: &str, cfg: ServerConfig) -> Running {
    let mut cfg = cfg;
    cfg.sim.speed = 50.0;
    serve_on_loopback(policy("p.kiln", text), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
}

/// A refusal as the surface promises it: OpenAI's error object with a
/// code, a request id and (when `explained`) an explain entry that exists.
async fn refusal(
    c: &reqwest::Client,
    base: &str,
    r: reqwest::Response,
    status: u16,
    code: &str,
    explained: bool,
) -> (Value, reqwest::header::HeaderMap) {
    assert_eq!(r.status(), status);
    let h = r.headers().clone();
    assert!(h.contains_key("x-kiln-request-id"), "no request id: {h:?}");
    assert!(
        h["content-type"].to_str().unwrap().contains("json"),
        "{h:?}"
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(v["error"].as_object().unwrap().contains_key("param"), "{v}");
    if explained {
        let id = h["x-kiln-request-id"].to_str().unwrap();
        let path = h["x-kiln-explain"].to_str().unwrap();
        assert_eq!(path, format!("/admin/explain/{id}"));
        let e = c.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(e.status(), 200, "{path}");
        let e: Value = e.json().await.unwrap();
        let events = e["scheduler"]["events"].as_array().unwrap();
        assert!(
            events
                .iter()
                .any(|ev| ev["event"].as_str().unwrap().starts_with("refused with")),
            "{e}"
        );
    }
    (v, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_has_a_code_an_id_and_an_explain_entry() {
    let mut cfg = ServerConfig::default_embedded();
    cfg.limits.max_body_bytes = 2048;
    let srv = serve(TWO, cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let url = format!("{base}/v1/chat/completions");
    // 400: not JSON
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .body("{nope")
        .send()
        .await
        .unwrap();
    refusal(&c, &base, r, 400, "invalid_request_error", true).await;
    // 401: a bad key, and none
    let r = c
        .post(&url)
        .bearer_auth("wrong")
        .json(&chat("tiny"))
        .send()
        .await
        .unwrap();
    refusal(&c, &base, r, 401, "invalid_api_key", true).await;
    let r = c.post(&url).json(&chat("tiny")).send().await.unwrap();
    refusal(&c, &base, r, 401, "missing_api_key", true).await;
    // 413: over the body limit
    let big =
        json!({"model": "tiny", "messages": [{"role": "user", "content": "w ".repeat(2000)}]});
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .json(&big)
        .send()
        .await
        .unwrap();
    let (v, _) = refusal(&c, &base, r, 413, "request_too_large", true).await;
    assert!(v["error"]["code"].is_string());
    // 404: the model asked for and the ones this tenant may use.
    let r = c
        .post(&url)
        .bearer_auth("k-beta")
        .json(&chat("gpt-9"))
        .send()
        .await
        .unwrap();
    let (v, h) = refusal(&c, &base, r, 404, "model_not_found", true).await;
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("`gpt-9`"), "{msg}");
    assert!(msg.contains("available to tenant beta: tiny "), "{msg}");
    assert!(h["x-kiln-policy-version"]
        .to_str()
        .unwrap()
        .starts_with("sha256:"));
    // A model routed for another tier only: forbidden, and said so.
    let r = c
        .post(&url)
        .bearer_auth("k-beta")
        .json(&chat("big"))
        .send()
        .await
        .unwrap();
    let (v, h) = refusal(&c, &base, r, 403, "policy", true).await;
    assert_eq!(v["error"]["message"], "big is for tier high");
    assert!(h.contains_key("x-kiln-policy-version"));
    // 429: gamma may send one request a minute.
    let r = c
        .post(&url)
        .bearer_auth("k-gamma")
        .json(&chat("tiny"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(&url)
        .bearer_auth("k-gamma")
        .json(&chat("tiny"))
        .send()
        .await
        .unwrap();
    assert!(r.headers().contains_key("retry-after"));
    let (_, h) = refusal(&c, &base, r, 429, "quota", true).await;
    assert!(h.contains_key("x-kiln-policy-version"));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_authenticated_and_filtered_by_tenant() {
    let srv = serve(TWO, ServerConfig::default_embedded()).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let ids = |v: &Value| -> Vec<String> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    // No key, a bad key: 401, explained.
    let r = c.get(format!("{base}/v1/models")).send().await.unwrap();
    refusal(&c, &base, r, 401, "missing_api_key", true).await;
    let r = c
        .get(format!("{base}/v1/models"))
        .bearer_auth("nope")
        .send()
        .await
        .unwrap();
    refusal(&c, &base, r, 401, "invalid_api_key", true).await;
    let get =
        |key: &'static str, path: &str| c.get(format!("{base}{path}")).bearer_auth(key).send();
    let v: Value = get("k-alpha", "/v1/models")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(ids(&v), ["tiny", "big"]);
    let v: Value = get("k-beta", "/v1/models")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ids(&v), ["tiny"]);
    // One model: served, or 404 model_not_found when unknown or forbidden.
    let r = get("k-beta", "/v1/models/tiny").await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["id"].as_str(), v["object"].as_str()),
        (Some("tiny"), Some("model"))
    );
    for m in ["big", "gpt-9"] {
        let r = get("k-beta", &format!("/v1/models/{m}")).await.unwrap();
        let (v, _) = refusal(&c, &base, r, 404, "model_not_found", true).await;
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("available: tiny"));
    }
    assert_eq!(
        get("k-alpha", "/v1/models/big").await.unwrap().status(),
        200
    );
    srv.stop().await;

    // A policy without keys: everything, to anyone.
    let mut cfg = ServerConfig::default_embedded();
    cfg.allow_anonymous = true;
    let srv = serve(OPEN, cfg).await;
    let base = format!("http://{}", srv.addr);
    let v: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ids(&v), ["tiny", "big"]);
    let r = c.get(format!("{base}/v1/models/big")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_and_methods_answer_in_json() {
    let srv = serve(TWO, ServerConfig::default_embedded()).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let cases: &[(reqwest::Method, &str, u16, &str)] = &[
        (
            reqwest::Method::POST,
            "/v1/embeddings",
            404,
            "unsupported_endpoint",
        ),
        (
            reqwest::Method::POST,
            "/v1/images/generations",
            404,
            "unsupported_endpoint",
        ),
        (
            reqwest::Method::POST,
            "/v1/audio/speech",
            404,
            "unsupported_endpoint",
        ),
        (
            reqwest::Method::POST,
            "/v1/moderations",
            404,
            "unsupported_endpoint",
        ),
        (reqwest::Method::GET, "/", 404, "unknown_url"),
        (reqwest::Method::GET, "/v1/foo", 404, "unknown_url"),
        (
            reqwest::Method::POST,
            "/v1/chat/completions/",
            404,
            "unknown_url",
        ),
        (reqwest::Method::GET, "/admin/nope", 404, "unknown_url"),
        (
            reqwest::Method::GET,
            "/v1/chat/completions",
            405,
            "method_not_allowed",
        ),
        (
            reqwest::Method::DELETE,
            "/v1/models",
            405,
            "method_not_allowed",
        ),
        (
            reqwest::Method::OPTIONS,
            "/v1/chat/completions",
            405,
            "method_not_allowed",
        ),
        (
            reqwest::Method::PUT,
            "/admin/policy",
            405,
            "method_not_allowed",
        ),
    ];
    for (m, path, status, code) in cases {
        let r = c
            .request(m.clone(), format!("{base}{path}"))
            .bearer_auth("k-alpha")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), *status, "{m} {path}");
        let h = r.headers().clone();
        assert!(h.contains_key("x-kiln-request-id"), "{m} {path}: {h:?}");
        let text = r.text().await.unwrap();
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{m} {path}: {text:?}"));
        assert_eq!(v["error"]["code"], *code, "{m} {path}: {v}");
    }
    // A trailing slash says which path was meant.
    let v: Value = c
        .post(format!("{base}/v1/chat/completions/"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("did you mean /v1/chat/completions"));
    // HEAD has no body, but the status and the id.
    let r = c.head(format!("{base}/v1/foo")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.headers().contains_key("x-kiln-request-id"));
    // An extractor's plain-text rejection is rewritten as JSON too: a bad
    // JSON body to an admin endpoint that takes one.
    let r = c
        .post(format!("{base}/admin/overrides"))
        .header("content-type", "application/json")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error());
    let text = r.text().await.unwrap();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text:?}"));
    assert!(v["error"]["code"].is_string(), "{v}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_the_simulator_cannot_honour_are_refused_by_name() {
    let srv = serve(TWO, ServerConfig::default_embedded()).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let url = format!("{base}/v1/chat/completions");
    let with = |extra: Value| {
        let mut b = chat("tiny");
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    // (`tools`, `response_format` and `stop` are answered with
    // placeholders: see `the_simulator_answers_tools_formats_and_stops`.)
    for (extra, param) in [
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"logprobs": true, "top_logprobs": 2}), "logprobs"),
        (json!({"n": 2}), "n"),
        (json!({"logit_bias": {"1": 5}}), "logit_bias"),
    ] {
        let r = c
            .post(&url)
            .bearer_auth("k-alpha")
            .json(&with(extra.clone()))
            .send()
            .await
            .unwrap();
        let (v, _) = refusal(&c, &base, r, 400, "unsupported_parameter", true).await;
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("sim") && msg.contains("HTTP upstream"),
            "{msg}"
        );
    }
    // An image part.
    let img = json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"},
        {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}
    ]}]});
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .json(&img)
        .send()
        .await
        .unwrap();
    let (v, _) = refusal(&c, &base, r, 400, "unsupported_parameter", true).await;
    assert_eq!(v["error"]["param"], "messages");
    // Fields the simulator can honour (or that change nothing it does).
    let fine = with(json!({
        "temperature": 0.3, "top_p": 0.9, "seed": 1, "user": "u",
        "stream_options": null, "max_completion_tokens": 3, "n": 1
    }));
    let r = c
        .post(&url)
        .bearer_auth("k-alpha")
        .json(&fine)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    srv.stop().await;
}

/// An upstream that keeps every body it receives.
async fn recording_upstream() -> (String, Arc<Mutex<Vec<Value>>>, tokio::task::JoinHandle<()>) {
    use axum::extract::State;
    use axum::routing::{get, post};
    use axum::{Json, Router};
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    async fn chat(
        State(seen): State<Arc<Mutex<Vec<Value>>>>,
        Json(body): Json<Value>,
    ) -> Json<Value> {
        seen.lock().unwrap().push(body);
        Json(json!({
            "id": "x", "object": "chat.completion", "created": 0, "model": "up",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        }))
    }
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { "ok" }))
        .with_state(seen.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let h = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (format!("http://{addr}"), seen, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_upstream_gets_those_fields_unchanged() {
    let (url, seen, mock) = recording_upstream().await;
    let cfg = ServerConfig::parse(
        "kiln.toml",
        &format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{url}\"\nconcurrency = 4\nhealth_interval = \"100ms\"\n"
        ),
    )
    .unwrap();
    let mut cfg = cfg;
    cfg.sim.speed = 1.0;
    let srv = serve_on_loopback(policy("p.kiln", UP), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let extra = json!({
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
        "logprobs": true,
        "top_logprobs": 2,
        "n": 2,
        "logit_bias": {"1": 5},
        "stop": ["\n"],
    });
    let mut b = chat("tiny");
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    for (k, v) in extra.as_object().unwrap() {
        assert_eq!(&got[0][k], v, "{k}");
    }
    srv.stop().await;
    mock.abort();
}

/// The chat body with `extra` fields.
fn chat_with(extra: Value) -> Value {
    let mut b = chat("tiny");
    b["max_tokens"] = json!(12);
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

/// A streamed answer's chunks (without `[DONE]`).
async fn chunks(r: reqwest::Response) -> Vec<Value> {
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_answers_tools_formats_and_stops() {
    let srv = serve(TWO, ServerConfig::default_embedded()).await;
    let url = format!("http://{}/v1/chat/completions", srv.addr);
    let c = client();
    let post = |b: Value| c.post(&url).bearer_auth("k-alpha").json(&b).send();
    let weather = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "noop"}}]);
    let schema = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true,
        "schema": {"type": "object", "properties": {
            "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "tags"], "additionalProperties": false}}});
    for stream in [false, true] {
        // `stop`: the placeholder text ends before it, finish_reason stop.
        let r = post(chat_with(json!({"stop": [" kiln's"], "stream": stream})))
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (text, finish) = if stream {
            let cs = chunks(r).await;
            let text: String = cs
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
                .collect();
            let finish = cs
                .iter()
                .find_map(|c| c["choices"][0]["finish_reason"].as_str())
                .map(str::to_string);
            (text, finish)
        } else {
            let v: Value = r.json().await.unwrap();
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string),
            )
        };
        assert_eq!(text, " simulated output from", "stream {stream}");
        assert_eq!(finish.as_deref(), Some("stop"));

        // `response_format` json_schema: JSON of the schema's shape.
        let r = post(chat_with(
            json!({"response_format": schema, "stream": stream}),
        ))
        .await
        .unwrap();
        assert_eq!(r.status(), 200);
        let content = if stream {
            chunks(r)
                .await
                .iter()
                .filter_map(|c| {
                    c["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(str::to_string)
                })
                .collect::<String>()
        } else {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let j: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert!(j["name"].is_string() && j["tags"].is_array(), "{j}");
        assert_eq!(j.as_object().unwrap().len(), 2, "{j}");

        // `tool_choice` required or named: one call, arguments of the schema.
        for (choice, name) in [
            (json!("required"), "get_weather"),
            (
                json!({"type": "function", "function": {"name": "noop"}}),
                "noop",
            ),
        ] {
            let r = post(chat_with(
                json!({"tools": weather, "tool_choice": choice, "stream": stream}),
            ))
            .await
            .unwrap();
            assert_eq!(r.status(), 200);
            let (call, finish) = if stream {
                let cs = chunks(r).await;
                let call = cs
                    .iter()
                    .find_map(|c| {
                        c["choices"][0]["delta"]["tool_calls"][0]
                            .as_object()
                            .cloned()
                    })
                    .unwrap();
                assert_eq!(call["index"], 0);
                let finish = cs
                    .iter()
                    .find_map(|c| c["choices"][0]["finish_reason"].as_str())
                    .map(str::to_string);
                (Value::Object(call), finish)
            } else {
                let v: Value = r.json().await.unwrap();
                assert!(v["choices"][0]["message"]["content"].is_null(), "{v}");
                (
                    v["choices"][0]["message"]["tool_calls"][0].clone(),
                    v["choices"][0]["finish_reason"]
                        .as_str()
                        .map(str::to_string),
                )
            };
            assert_eq!(finish.as_deref(), Some("tool_calls"));
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().is_some_and(|i| i.starts_with("call_")));
            assert_eq!(call["function"]["name"], name);
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            if name == "get_weather" {
                assert!(
                    args["city"].is_string() && args["days"].as_i64() >= Some(1),
                    "{args}"
                );
            } else {
                assert_eq!(args, json!({}));
            }
        }
    }
    // An agent sends the call and its result back: answered.
    let mut turn = chat_with(json!({"tools": weather, "tool_choice": "auto"}));
    turn["messages"] = json!([
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\",\"days\":1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    ]);
    let r = post(turn).await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    // `auto` may answer in text, as a model may; a named tool that is not
    // listed is the client's mistake.
    let r = post(chat_with(json!({"tools": weather, "tool_choice": "auto"})))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = post(chat_with(json!({"tools": weather,
        "tool_choice": {"type": "function", "function": {"name": "missing"}}})))
    .await
    .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "tool_choice", "{v}");
    srv.stop().await;
}
