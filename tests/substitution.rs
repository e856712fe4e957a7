//! Cross-model substitution (`model A { served_by B { tiers [..] } }`) acts
//! at decide time, in the replay and in the gateway: a request for A is
//! decided onto B, dispatched to B's replicas and marked as substituted in
//! headers, the OpenAI body, explain and the decision log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::backend::cost::CostModel;
use kiln::compile::compile_str;
use kiln::graph::{DecisionGraph, Request, Signals, SignalsInput};
use kiln::replay;
use kiln::sched::{Arrival, Config, Scheduler};
use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// `large` may be served by `small-m` in both tiers (the body reports the
/// model that ran); `mid` by `small-m` in `batch` only, and its body
/// reports the model asked for.
const POLICY: &str = r#"
pool big { gpus 2 kind "H100-80GB" memory 80GB }
pool small { gpus 2 kind "L40S-48GB" memory 48GB }
model large {
  params 13B
  kv_per_token 160KB
  variant fp16 { memory 70GB pools [big] }
  served_by small-m { tiers [chat, batch] }
}
model mid {
  params 7B
  kv_per_token 128KB
  variant fp16 { memory 30GB pools [big] }
  served_by small-m { tiers [batch] response_model requested }
}
model small-m {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 18GB pools [small] }
}
tier chat { priority 100 slo { ttft 5s } }
tier batch { priority 10 slo { window 6h } preemptible }
tenant app { owner "o" tiers [chat] api_keys ["k-app"] }
tenant bulk { owner "o" tiers [batch] api_keys ["k-bulk"] }
classify {
  when tenant == app => tier chat
  default => tier batch
}
route chat large {
  when pool(big).utilization < 90% => fp16 on big
  default => fallback
}
route chat mid {
  when pool(big).utilization < 90% => fp16 on big
  default => fallback
}
route batch large { default => small-m.fp16 on small }
route batch mid { default => small-m.fp16 }
route [chat, batch] small-m { default => fp16 }
fallback chat [route small-m.fp16 on small, queue 5s]
"#;

fn graph(text: &str) -> DecisionGraph {
    let c = compile_str("subst.kiln", text);
    let msgs: Vec<_> = c
        .diagnostics
        .items
        .iter()
        .map(|d| d.message.clone())
        .collect();
    c.graph
        .unwrap_or_else(|| panic!("does not compile: {msgs:?}"))
}

fn req(tenant: &str, model: &str) -> Request {
    Request {
        tenant: Some(tenant.into()),
        model: model.into(),
        prompt_tokens: 200,
        max_tokens: 20,
        ..Default::default()
    }
}

fn busy_big(g: &DecisionGraph) -> Signals {
    let input: SignalsInput =
        serde_json::from_str(r#"{ "pools": { "big": { "utilization": "95%" } } }"#).unwrap();
    Signals::resolve(g, &input).unwrap()
}

#[test]
fn a_cross_model_fallback_step_is_taken_and_the_decision_names_the_substitute() {
    let g = graph(POLICY);
    let s = busy_big(&g);
    let d = g.decide(&req("app", "large"), &s);
    let v = g.view(&d);
    assert_eq!(v.route.as_deref(), Some("small-m.fp16 on small"));
    assert_eq!(v.fallback_step, Some(1));
    assert_eq!(v.substituted_for.as_deref(), Some("large"));
    assert_eq!(d.target.map(|t| t.model), g.model_id("small-m"));
    assert_eq!(d.model, g.model_id("large"));
    let (_, t) = g.explain(&req("app", "large"), &s);
    let sources = compile_str("subst.kiln", POLICY).sources;
    let text = kiln::graph::trace::render(&g, &sources, &req("app", "large"), &v, &t);
    assert!(
        text.contains("route small-m.fp16 on small (substituted for large)"),
        "{text}"
    );
    assert!(text.contains("substituted: `small-m` serves this request for `large`"));
    // Without the big pool busy the request is served by the model it
    // asked for, and nothing says otherwise.
    let v = g.view(&g.decide(&req("app", "large"), &Signals::idle(&g)));
    assert_eq!(v.route.as_deref(), Some("large.fp16 on big"));
    assert_eq!(v.substituted_for, None);
}

#[test]
fn a_step_is_not_taken_for_a_model_that_does_not_declare_its_substitute_in_the_tier() {
    // `mid` declares `small-m` for batch only: its chat requests skip the
    // step (it is for small-m requests) and queue.
    let g = graph(POLICY);
    let (d, t) = g.explain(&req("app", "mid"), &busy_big(&g));
    let v = g.view(&d);
    assert_eq!(v.admission, "queue");
    assert_eq!(v.fallback_step, Some(2));
    assert_eq!(v.substituted_for, None);
    let notes: Vec<&String> = t.stages.iter().flat_map(|s| &s.notes).collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("not for `mid` requests") && n.contains("tier `chat`")),
        "{notes:?}"
    );
}

#[test]
fn a_route_target_of_another_model_serves_the_tier_it_is_declared_for() {
    let g = graph(POLICY);
    let v = g.view(&g.decide(&req("bulk", "mid"), &Signals::idle(&g)));
    assert_eq!(v.tier, "batch");
    assert_eq!(v.route.as_deref(), Some("small-m.fp16 on small"));
    assert_eq!(v.substituted_for.as_deref(), Some("mid"));
}

#[test]
fn without_the_declaration_the_same_policy_is_refused() {
    for (from, to) in [
        // the route target
        (
            "  served_by small-m { tiers [batch] response_model requested }\n",
            "",
        ),
        // the fallback step, for chat's `large` requests
        (
            "  served_by small-m { tiers [chat, batch] }\n",
            "  served_by small-m { tiers [batch] }\n",
        ),
    ] {
        let text = POLICY.replacen(from, to, 1);
        let c = compile_str("subst.kiln", &text);
        if from.contains("chat, batch") {
            // a step for small-m requests is legal: chat routes small-m; the
            // large requests of chat simply are not served by it.
            let g = c.graph.expect("a step for the model it names compiles");
            let v = g.view(&g.decide(&req("app", "large"), &busy_big(&g)));
            assert_eq!(v.admission, "queue");
            assert_eq!(v.substituted_for, None);
            continue;
        }
        assert!(c.graph.is_none());
        let e = c
            .diagnostics
            .items
            .iter()
            .find(|d| d.code == kiln::diag::Code::UndeclaredSubstitution)
            .expect("an undeclared-substitution error");
        assert!(e
            .help
            .as_deref()
            .unwrap_or("")
            .contains("`model mid { served_by small-m { tiers [batch] } }`"));
    }
}

#[test]
fn the_replay_dispatches_substituted_requests_to_the_substitutes_replicas() {
    let g = Arc::new(graph(POLICY));
    let cost = CostModel::from_graph(&g, None).expect("cost model");
    let mut s = Scheduler::new(g.clone(), replay::plan(&g, &cost), Config::default());
    let arrivals: Vec<_> = (0..20u64)
        .map(|id| {
            let (tenant, model) = match id % 3 {
                0 => ("bulk", "large"),
                1 => ("bulk", "mid"),
                _ => ("app", "large"),
            };
            let a = Arrival {
                quota_claimed: false,
                fleet: None,
                cache: None,
                semantic: None,
                window: None,
                id,
                request: req(tenant, model),
                output_tokens: 20,
                prefix_blocks: Vec::new(),
            };
            (id * 1000, a)
        })
        .collect();
    let outcomes = replay::run(&mut s, arrivals, |_, _| {});
    let small = g.model_id("small-m").unwrap();
    let large = g.model_id("large").unwrap();
    for (i, o) in outcomes.iter().enumerate() {
        assert!(o.finished.is_some(), "request {i} finished: {o:?}");
        let r = o.replica.expect("started on a replica");
        let served = s.replicas()[r].spec.model;
        let want = if i % 3 == 2 { large } else { small };
        assert_eq!(served, want, "request {i} ran on the wrong model");
    }
}

#[test]
fn kiln_simulate_serves_batch_requests_for_large_on_the_substitute() {
    let dir = std::env::temp_dir().join(format!("kiln-subst-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pol = dir.join("subst.kiln");
    // Nothing routes `large` to its own variant, so it gets no replica: a
    // batch request for it finishes only if the substitute serves it.
    let text = POLICY
        .replacen(
            "served_by small-m { tiers [chat, batch] }",
            "served_by small-m { tiers [batch] }",
            1,
        )
        .replacen(
            "tier chat { priority 100 slo { ttft 5s } }",
            "tier chat { priority 100 slo { ttft 5s } models [mid, small-m] }",
            1,
        )
        .replacen(
            "route chat large {\n  when pool(big).utilization < 90% => fp16 on big\n  default => fallback\n}\n",
            "",
            1,
        );
    assert!(!text.contains("route chat large"));
    std::fs::write(&pol, text).unwrap();
    let traffic = dir.join("t.jsonl");
    let lines: String = (0..10)
        .map(|i| {
            format!(
                "{{\"v\":1,\"at_ms\":{},\"tenant\":\"bulk\",\"model\":\"large\",\"prompt_tokens\":100,\"max_tokens\":10,\"output_tokens\":10}}\n",
                i * 100
            )
        })
        .collect();
    std::fs::write(&traffic, lines).unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "simulate",
            "--policy",
            pol.to_str().unwrap(),
            "--traffic",
            traffic.to_str().unwrap(),
            "--format",
            "json",
        ])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let batch = v["reports"][0]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "batch")
        .cloned()
        .unwrap();
    assert_eq!(batch["requests"], 10, "{batch}");
    assert_eq!(batch["finished"], 10, "{batch}");
    assert_eq!(batch["rejected"], 0, "{batch}");
}

async fn send(c: &reqwest::Client, base: &str, key: &str, model: &str) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_serves_a_request_for_a_with_b_and_says_so() {
    let dir = std::env::temp_dir().join(format!("kiln-subst-gw-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = 100.0;
    cfg.log = Some(kiln::server::config::LogSection::at(log.clone()));
    let srv = support::serve_on_loopback(support::policy("subst.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(60));

    // batch `large`: routed to small-m; the body reports the model that ran.
    let r = send(&c, &base, "k-bulk", "large").await;
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    assert_eq!(
        h["x-kiln-route"],
        "small-m.fp16 on small (substituted for large)"
    );
    assert_eq!(h["x-kiln-model-substituted"], "large -> small-m");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "small-m");
    let id = h["x-kiln-request-id"].to_str().unwrap().to_string();
    let text = c
        .get(format!("{base}/admin/explain/{id}?format=text"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("(substituted for large)"), "{text}");
    let j: Value = c
        .get(format!("{base}/admin/explain/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        j.to_string().contains("\"substituted_for\":\"large\""),
        "{j}"
    );

    // batch `mid`: served by small-m, but its declaration keeps the
    // requested name in the body; the headers still say.
    let r = send(&c, &base, "k-bulk", "mid").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kiln-model-substituted"], "mid -> small-m");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "mid");

    // chat `large` on an idle fleet: its own model, no marking.
    let r = send(&c, &base, "k-app", "large").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kiln-route"], "large.fp16 on big");
    assert!(r.headers().get("x-kiln-model-substituted").is_none());
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "large");

    srv.stop().await;
    let recs = kiln::traffic::read(&log).unwrap();
    assert_eq!(recs.len(), 3);
    let subs: Vec<(String, Option<String>, Option<String>)> = recs
        .iter()
        .map(|r| {
            let d = r.decision.clone().unwrap_or_default();
            (r.model.clone(), d.route, d.substituted_for)
        })
        .collect();
    assert!(subs.contains(&(
        "large".into(),
        Some("small-m.fp16 on small".into()),
        Some("large".into())
    )));
    assert!(subs.contains(&("large".into(), Some("large.fp16 on big".into()), None)));
    assert!(subs
        .iter()
        .any(|(m, _, s)| m == "mid" && s.as_deref() == Some("mid")));
}

/// An OpenAI upstream that records the `model` each request names.
async fn recording_upstream() -> (
    String,
    Arc<std::sync::Mutex<Vec<String>>>,
    tokio::task::JoinHandle<()>,
) {
    use axum::extract::State;
    use axum::routing::{get, post};
    use axum::{Json, Router};
    type Seen = Arc<std::sync::Mutex<Vec<String>>>;
    async fn chat(State(seen): State<Seen>, Json(body): Json<Value>) -> Json<Value> {
        seen.lock()
            .unwrap()
            .push(body["model"].as_str().unwrap_or("").to_string());
        Json(json!({
            "id": "x", "object": "chat.completion", "created": 0, "model": "whatever-the-upstream-says",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        }))
    }
    let seen: Seen = Arc::default();
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
async fn an_http_upstream_of_the_substitute_is_asked_for_the_substitute() {
    let (url, seen, mock) = recording_upstream().await;
    let cfg = ServerConfig::parse(
        "kiln.toml",
        &format!(
            "[pools.small]\nbackend = \"http\"\n[[pools.small.upstreams]]\nmodel = \"small-m\"\nvariant = \"fp16\"\nurl = \"{url}\"\nconcurrency = 4\nhealth_interval = \"100ms\"\n"
        ),
    )
    .unwrap();
    let srv = support::serve_on_loopback(support::policy("subst.kiln", POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(60));
    let r = send(&c, &base, "k-bulk", "large").await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["x-kiln-backend"]
        .to_str()
        .unwrap()
        .starts_with("http:"));
    assert_eq!(r.headers()["x-kiln-model-substituted"], "large -> small-m");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "small-m");
    let r = send(&c, &base, "k-bulk", "mid").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "mid", "response_model requested");
    assert_eq!(*seen.lock().unwrap(), ["small-m", "small-m"]);
    srv.stop().await;
    mock.abort();
}
