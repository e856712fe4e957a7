//! Several gateway replicas sharing state through a real `redis-server`
//! (started here on a free loopback port; skipped, with a message, where
//! it is not installed): a tenant's quota holds over the fleet whatever the
//! spread of its requests, an activation on one replica reaches every
//! replica within a second, a hundred activations under load fail nothing
//! and log every request with the one version that decided it, and when
//! Redis goes away the operator's `on_unavailable` applies (local limits,
//! or refusals) and sharing resumes when it returns. A claim that takes
//! the fleet's last request is served; a claim or a spending report whose
//! answer is lost (held back past the call's timeout by a relay in front
//! of Redis) is charged once; the governance audit chain Redis keeps is
//! bounded and still verifies.
//! `tests/fleet_kill.rs` kills a replica with `kill -9` mid-load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::{OnUnavailable, ServerConfig, StateSection};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::redis::{DelayProxy, Redis};
use support::{client, policy, scrape, serve_on_loopback};

pub const POLICY: &str = r#"
pool gpu { gpus 8 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 64 }
}
tier interactive { priority 100 slo { ttft 5s } }
tenant capped { owner "a@x" tiers [interactive] quota { requests 600/min } api_keys ["k-capped"] }
tenant held { owner "b@x" tiers [interactive] quota { concurrent 4 } api_keys ["k-held"] }
tenant free { owner "c@x" tiers [interactive] api_keys ["k-free"] }
classify { default => tier interactive }
route [interactive] tiny { default => fp16 }
"#;

fn namespace() -> String {
    support::redis::namespace("t")
}

fn config(
    url: &str,
    ns: &str,
    on: OnUnavailable,
    speed: f64,
    log: Option<std::path::PathBuf>,
) -> ServerConfig {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = speed;
    cfg.state = Some(StateSection {
        redis: url.to_string(),
        namespace: ns.to_string(),
        replica: None,
        on_unavailable: on,
        replicas: 3,
        lease: Duration::from_secs(2),
        ca_file: None,
        client_cert: None,
        client_key: None,
    });
    if let Some(p) = log {
        cfg.log = Some(kiln::server::config::LogSection {
            path: p,
            max_bytes: 64 << 20,
            keep: 2,
        });
    }
    cfg
}

struct Fleet {
    gateways: Vec<kiln::server::Running>,
    bases: Vec<String>,
}

async fn fleet(url: &str, on: OnUnavailable, speed: f64) -> Fleet {
    fleet_with(url, &namespace(), on, speed, None).await
}

async fn fleet_with(
    url: &str,
    ns: &str,
    on: OnUnavailable,
    speed: f64,
    log_dir: Option<&std::path::Path>,
) -> Fleet {
    let mut gateways = Vec::new();
    for i in 0..3 {
        let mut cfg = config(
            url,
            ns,
            on,
            speed,
            log_dir.map(|d| d.join(format!("r{i}.jsonl"))),
        );
        if let Some(st) = cfg.state.as_mut() {
            st.replica = Some(format!("replica-{i}"));
        }
        gateways.push(serve_on_loopback(policy("fleet.kiln", POLICY), cfg).await);
    }
    let bases = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    Fleet { gateways, bases }
}

impl Fleet {
    async fn stop(self) {
        for g in self.gateways {
            g.stop().await;
        }
    }
}

async fn chat(c: &reqwest::Client, base: &str, key: &str) -> (u16, Option<String>, Option<String>) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await;
    match r {
        Ok(r) => {
            let h = |n: &str| {
                r.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .map(String::from)
            };
            let (v, id) = (h("x-kiln-policy-version"), h("x-kiln-request-id"));
            let s = r.status().as_u16();
            let _ = r.bytes().await;
            (s, v, id)
        }
        Err(_) => (0, None, None),
    }
}

/// A chat completion's status, and its error's code and message if any.
async fn answer(c: &reqwest::Client, base: &str, key: &str) -> (u16, String, String) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await;
    let Ok(r) = r else {
        return (0, String::new(), String::new());
    };
    let s = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let text = |k: &str| v["error"][k].as_str().unwrap_or("").to_string();
    (s, text("code"), text("message"))
}

/// Sends the tenant `capped` (600/min) well over its quota, spread over the
/// replicas by `weights`, and counts admissions in a measured window after
/// the bucket's minute of burst is spent.
async fn admitted_per_minute(f: &Fleet, weights: [u32; 3], speed: f64) -> (f64, f64) {
    let c = client(Duration::from_secs(10));
    let pick = |n: u64| {
        let total: u32 = weights.iter().sum();
        let mut x = (n.wrapping_mul(2654435761) % u64::from(total)) as u32;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        0
    };
    // Spend the burst (a minute of quota): until refusals come.
    let mut n = 0u64;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let batch: Vec<_> = (0..32)
            .map(|_| {
                n += 1;
                let (c, b) = (c.clone(), f.bases[pick(n)].clone());
                tokio::spawn(async move { chat(&c, &b, "k-capped").await.0 })
            })
            .collect();
        let mut refused = 0;
        for h in batch {
            if h.await.unwrap() == 429 {
                refused += 1;
            }
        }
        if refused > 16 || Instant::now() > until {
            break;
        }
    }
    // Offer twice the quota's rate for the window, paced.
    let rate = 600.0 / 60.0 * speed;
    let window = Duration::from_secs(4);
    let every = Duration::from_secs_f64(1.0 / (2.0 * rate));
    let ok = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tick = tokio::time::interval(every);
    let mut handles = Vec::new();
    let mut sent = 0u64;
    while start.elapsed() < window {
        tick.tick().await;
        n += 1;
        sent += 1;
        let (c, b, ok) = (c.clone(), f.bases[pick(n)].clone(), ok.clone());
        handles.push(tokio::spawn(async move {
            let answer = answer(&c, &b, "k-capped").await;
            if answer.0 == 200 {
                ok.fetch_add(1, Ordering::Relaxed);
            }
            answer
        }));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut statuses = std::collections::BTreeMap::new();
    for h in handles {
        *statuses.entry(h.await.unwrap()).or_insert(0u64) += 1;
    }
    // What a reader of a failure needs: the answers (status, error code
    // and message), and each replica's calls to Redis that failed and
    // claims taken back (granted in Redis, answer lost, decided by the
    // replica instead).
    let counts: Vec<(u64, u64)> = f
        .gateways
        .iter()
        .map(|g| {
            let fl = g.app.fleet.as_ref().unwrap();
            (fl.store.failures(), fl.claims_taken_back())
        })
        .collect();
    eprintln!("answers {statuses:?}; per replica (failed calls, claims taken back) {counts:?}");

    // Admissions, and requests actually sent (a loaded runner paces the
    // client late), per minute of policy time.
    let per_min = |x: f64| x / (elapsed * speed / 60.0);
    (
        per_min(ok.load(Ordering::Relaxed) as f64),
        per_min(sent as f64),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quota_holds_over_the_fleet_whatever_the_spread() {
    let Some(redis) = Redis::start() else { return };
    let speed = 5.0;
    for weights in [[1, 1, 1], [1, 0, 0], [7, 2, 1]] {
        let f = fleet(&redis.url(), OnUnavailable::Local, speed).await;
        let (per_min, sent) = admitted_per_minute(&f, weights, speed).await;
        f.stop().await;
        eprintln!("spread {weights:?}: {per_min:.1} admitted per minute of 600 ({sent:.0} sent)");
        // Never more than the quota (5% for timing), and, offered twice
        // it, at least 90% of it (of what the client managed to send, on a
        // runner that paces it late). 599.8, 602.8 and 600.6 a minute with
        // other builds loading the 2-core runner (load 10); before a
        // granted claim was served whatever 0% it left, 455-582.
        assert!(
            per_min <= 1.05 * 600.0,
            "spread {weights:?}: {per_min:.0} admitted per minute, over 5% above 600"
        );
        let due = 600.0f64.min(sent);
        assert!(
            per_min >= 0.9 * due,
            "spread {weights:?}: {per_min:.0} admitted per minute of {due:.0} due ({sent:.0} sent)"
        );
    }
}

fn version_of(text: &str) -> String {
    policy("fleet.kiln", text).version.to_string()
}

async fn activate(c: &reqwest::Client, base: &str, text: &str) -> Value {
    let r = c
        .post(format!("{base}/admin/policy"))
        .json(&json!({"files": {"fleet.kiln": text}}))
        .send()
        .await
        .unwrap();
    let s = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(s.is_success(), "activation refused: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_activation_reaches_every_replica_within_a_second() {
    let Some(redis) = Redis::start() else { return };
    let f = fleet(&redis.url(), OnUnavailable::Local, 1.0).await;
    let c = client(Duration::from_secs(10));
    let v2 = POLICY.replace("ttft 5s", "ttft 4s");
    let want = version_of(&v2);
    for round in 0..5 {
        let text = if round % 2 == 0 {
            v2.clone()
        } else {
            POLICY.to_string()
        };
        let want = version_of(&text);
        let on = round % 3;
        let t0 = Instant::now();
        activate(&c, &f.bases[on], &text).await;
        loop {
            let all = f
                .gateways
                .iter()
                .all(|g| g.app.policy.load().version.as_ref() == want);
            if all {
                eprintln!(
                    "round {round}: on every replica {} ms after activating on replica {on}",
                    t0.elapsed().as_millis()
                );
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(1),
                "round {round}: not every replica runs {want} a second after activating it on replica {on}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // `GET /admin/replicas` (what `kiln status` shows): every replica and
    // its version.
    activate(&c, &f.bases[0], &v2).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let r: Value = c
        .get(format!("{}/admin/replicas", f.bases[1]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let list = r["replicas"].as_array().unwrap();
    assert_eq!(list.len(), 3, "{r}");
    assert!(list.iter().all(|x| x["version"] == want.as_str()), "{r}");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_activations_under_load_fail_nothing_and_split_no_request() {
    let Some(redis) = Redis::start() else { return };
    let dir =
        std::env::temp_dir().join(format!("kiln-fleet-{}-{}", std::process::id(), namespace()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = fleet_with(
        &redis.url(),
        &namespace(),
        OnUnavailable::Local,
        20.0,
        Some(&dir),
    )
    .await;
    let texts = [POLICY.to_string(), POLICY.replace("ttft 5s", "ttft 4s")];
    let versions: Vec<String> = texts.iter().map(|t| version_of(t)).collect();
    let c = client(Duration::from_secs(30));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for w in 0..6 {
        let (c, bases, stop) = (c.clone(), f.bases.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut i = w;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = chat(&c, &bases[i % 3], "k-free").await;
                out.push((i % 3, r));
            }
            out
        }));
    }
    for k in 0..100 {
        activate(&c, &f.bases[k % 3], &texts[(k + 1) % 2]).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut results = Vec::new();
    for h in load {
        results.extend(h.await.unwrap());
    }
    f.stop().await;
    assert!(results.len() > 200, "too little load: {}", results.len());
    let failed: Vec<_> = results.iter().filter(|(_, r)| r.0 != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        results.len(),
        &failed[..failed.len().min(5)]
    );
    // Each request: one version in its answer, the same one in its
    // replica's decision log, and only ever one record.
    let mut logged = std::collections::HashMap::new();
    for i in 0..3 {
        let text = std::fs::read_to_string(dir.join(format!("r{i}.jsonl"))).unwrap_or_default();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            if let (Some(id), Some(ver)) = (v["id"].as_str(), v["policy_version"].as_str()) {
                let prev = logged.insert((i, id.to_string()), ver.to_string());
                assert!(prev.is_none(), "request {id} logged twice");
            }
        }
    }
    for (rep, (_, ver, id)) in &results {
        let (ver, id) = (ver.as_ref().unwrap(), id.as_ref().unwrap());
        assert!(versions.contains(ver), "unknown version {ver}");
        assert_eq!(
            logged.get(&(*rep, id.clone())),
            Some(ver),
            "request {id}: answered with {ver}, logged otherwise"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_redis_is_down_the_declared_behaviour_applies_and_sharing_resumes() {
    let Some(redis) = Redis::start() else { return };
    let port = redis.port;
    let url = redis.url();
    let local = fleet(&url, OnUnavailable::Local, 1.0).await;
    let refuse = fleet(&url, OnUnavailable::Refuse, 1.0).await;
    let c = client(Duration::from_secs(10));
    assert_eq!(chat(&c, &local.bases[0], "k-free").await.0, 200);
    redis.stop();
    // `local`: served, each replica holding its third of the quota: of a
    // minute's 600 requests, about 200 pass on one replica.
    let t0 = Instant::now();
    let mut ok = 0;
    for _ in 0..300 {
        if chat(&c, &local.bases[0], "k-capped").await.0 == 200 {
            ok += 1;
        }
    }
    // The burst, plus what the third refills meanwhile (200/min).
    let expect = 200.0 + 200.0 / 60.0 * t0.elapsed().as_secs_f64();
    assert!(
        (f64::from(ok) - expect).abs() <= 0.05 * expect + 2.0,
        "{ok} of 300 passed on one replica while Redis was down, expected about {expect:.0}"
    );
    // `refuse`: 503 with the reason.
    let r = c
        .post(format!("{}/v1/chat/completions", refuse.bases[0]))
        .bearer_auth("k-capped")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "shared-state-unavailable", "{body}");
    // Said in the metrics.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let m = scrape(&c, &local.bases[0]).await;
    assert!(m.contains("kiln_shared_state_up 0"), "{m}");
    assert!(
        m.contains("kiln_shared_state_unclaimed_total{action=\"local\"}"),
        "{m}"
    );
    // Redis returns (same port): sharing resumes, refusals stop.
    let back = Redis::start_on(port).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if chat(&c, &refuse.bases[0], "k-capped").await.0 == 200 {
            break;
        }
        assert!(
            Instant::now() < until,
            "refusals did not stop after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let m = scrape(&c, &local.bases[0]).await;
    assert!(m.contains("kiln_shared_state_up 1"), "{m}");
    local.stop().await;
    refuse.stop().await;
    back.stop();
}

/// An OpenAI-style upstream that takes `UPSTREAM_MS` per answer, counting
/// answers per tenant (named in the prompt) and the most calls it had at
/// once.
#[derive(Default)]
struct Upstream {
    now: AtomicU64,
    max: AtomicU64,
    served: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

const UPSTREAM_MS: u64 = 60;

async fn upstream_chat(
    axum::extract::State(u): axum::extract::State<Arc<Upstream>>,
    axum::Json(body): axum::Json<Value>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let n = u.now.fetch_add(1, Ordering::SeqCst) + 1;
    u.max.fetch_max(n, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(UPSTREAM_MS)).await;
    u.now.fetch_sub(1, Ordering::SeqCst);
    let prompt = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    *u.served.lock().unwrap().entry(prompt.clone()).or_default() += 1;
    if body["stream"].as_bool() == Some(true) {
        let chunk = json!({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "up",
            "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]});
        let text = format!("data: {chunk}\n\ndata: [DONE]\n\n");
        let mut r = text.into_response();
        r.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        return r;
    }
    axum::Json(json!({
        "id": "x", "object": "chat.completion", "created": 0, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    }))
    .into_response()
}

async fn upstream() -> (String, Arc<Upstream>, tokio::task::JoinHandle<()>) {
    let u = Arc::new(Upstream::default());
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(upstream_chat))
        .route("/health", axum::routing::get(|| async { "ok" }))
        .with_state(u.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let h = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (format!("http://{addr}"), u, h)
}

const FAIR_POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] }
}
tier interactive { priority 100 slo { ttft 60s } }
tenant one { owner "a@x" tiers [interactive] api_keys ["k-one"] }
tenant spread { owner "b@x" tiers [interactive] api_keys ["k-spread"] }
classify { default => tier interactive }
route [interactive] tiny { default => fp16 }
"#;

const SLOTS: u64 = 6;

/// Three replicas in front of one upstream that runs `SLOTS` requests at a
/// time. Tenant `one` sends everything through replica 0; `spread` sends
/// the same offered load over all three. Both stay backlogged. Returns
/// what the upstream served each, and the most it ever ran at once.
async fn served_through_one_upstream(shared: Option<&str>) -> (u64, u64, u64) {
    let (url, up, h) = upstream().await;
    let ns = namespace();
    let mut gateways = Vec::new();
    for i in 0..3 {
        let text = format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{url}\"\nconcurrency = {SLOTS}\nhealth_interval = \"1s\"\n"
        );
        let mut cfg = ServerConfig::parse("kiln.toml", &text).unwrap();
        cfg.policy_keys = true;
        if let Some(redis) = shared {
            cfg.state = Some(StateSection {
                redis: redis.to_string(),
                namespace: ns.clone(),
                replica: Some(format!("replica-{i}")),
                on_unavailable: OnUnavailable::Local,
                replicas: 3,
                lease: Duration::from_secs(2),
                ca_file: None,
                client_cert: None,
                client_key: None,
            });
        }
        gateways.push(serve_on_loopback(policy("fair.kiln", FAIR_POLICY), cfg).await);
    }
    let bases: Vec<String> = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    let c = client(Duration::from_secs(60));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    // 12 workers each: `one` on replica 0; `spread` 4 on each replica.
    for w in 0..24 {
        let (key, base) = if w < 12 {
            ("k-one", bases[0].clone())
        } else {
            ("k-spread", bases[w % 3].clone())
        };
        let tenant = if w < 12 { "one" } else { "spread" };
        let (c, stop) = (c.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = c
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth(key)
                    .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": tenant}], "max_tokens": 1}))
                    .send()
                    .await
                    .map(|r| r.status());
            }
        }));
    }
    // Warm up (counters and slots settle), then measure.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = up.served.lock().unwrap().clone();
    up.max
        .store(up.now.load(Ordering::SeqCst), Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after = up.served.lock().unwrap().clone();
    let max = up.max.load(Ordering::SeqCst);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    for g in gateways {
        g.stop().await;
    }
    h.abort();
    let got = |t: &str| after.get(t).copied().unwrap_or(0) - before.get(t).copied().unwrap_or(0);
    (got("one"), got("spread"), max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spreading_over_replicas_gains_a_tenant_nothing() {
    let Some(redis) = Redis::start() else { return };
    let (alone_one, alone_spread, alone_max) = served_through_one_upstream(None).await;
    let (one, spread, max) = served_through_one_upstream(Some(&redis.url())).await;
    eprintln!(
        "one upstream of {SLOTS} slots, 6 s: without shared state one {alone_one} / spread {alone_spread} served, at most {alone_max} at once; shared: one {one} / spread {spread}, at most {max} at once"
    );
    assert!(
        max <= SLOTS,
        "the fleet sent {max} requests at once to an upstream of {SLOTS}"
    );
    assert!(one > 0 && spread > 0);
    let (hi, lo) = (one.max(spread) as f64, one.min(spread) as f64);
    assert!(
        (hi - lo) / hi <= 0.10,
        "served: one {one}, spread {spread}: not within 10% of each other"
    );
}

/// The split of a shared upstream's slots, as a property: replicas that
/// start work only below the grant in force, asking in a random order with
/// random demand, random backlogs and random completions, never run more
/// than the upstream's capacity together; and a replica that stays alone
/// in wanting slots ends up with all of them once the others drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_slots_never_sum_past_the_capacity() {
    use kiln::shared::{Store, StoreConfig};
    use rand::{RngExt, SeedableRng};
    let Some(redis) = Redis::start() else { return };
    const CAP: u64 = 8;
    let ns = namespace();
    let stores: Vec<Store> = (0..4)
        .map(|i| {
            Store::open(&StoreConfig {
                url: redis.url(),
                namespace: ns.clone(),
                replica: format!("r{i}"),
                lease: Duration::from_secs(5),
                tls: Default::default(),
            })
            .unwrap()
        })
        .collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
    let mut caps = [0u64; 4];
    let mut busy = [0u64; 4];
    let tenants = ["a", "b", "c"];
    for step in 0..2_000 {
        let r = rng.random_range(0..4usize);
        // Work finishes; new work starts only under the grant in force.
        busy[r] -= rng.random_range(0..=busy[r]);
        let queued = rng.random_range(0..12u64);
        let start = queued.min(caps[r].saturating_sub(busy[r]));
        busy[r] += start;
        let total: u64 = busy.iter().sum();
        assert!(
            total <= CAP,
            "step {step}: {busy:?} run at once, capacity {CAP}"
        );
        let mut backlog: Vec<(String, f64)> = Vec::new();
        for t in tenants {
            if rng.random_bool(0.5) {
                backlog.push((t.to_string(), rng.random_range(1..4) as f64));
            }
        }
        let want = busy[r] + queued - start;
        caps[r] = stores[r]
            .slots("up", want, busy[r], CAP, &backlog, caps[r])
            .await
            .unwrap();
    }
    // Everyone drains; r0 alone keeps wanting: it gets the whole upstream.
    for _ in 0..3 {
        for r in 1..4 {
            busy[r] = 0;
            caps[r] = stores[r]
                .slots("up", 0, 0, CAP, &[], caps[r])
                .await
                .unwrap();
        }
        busy[0] = busy[0].min(caps[0]);
        caps[0] = stores[0]
            .slots("up", CAP, busy[0], CAP, &[("a".into(), 1.0)], caps[0])
            .await
            .unwrap();
    }
    assert_eq!(
        caps[0], CAP,
        "alone in wanting slots, r0 holds {} of {CAP}",
        caps[0]
    );
}

/// The requests bucket of tenant `capped` in namespace `ns`: its level and
/// when (Redis's clock, ms) it was last written.
async fn bucket(url: &str, ns: &str) -> (f64, f64) {
    let h = support::redis::hash(url, &format!("{ns}:quota:capped")).await;
    let rl: f64 = h.get("rl").expect("a requests bucket").parse().unwrap();
    let ra: f64 = h.get("ra").expect("its time").parse().unwrap();
    (rl, ra)
}

/// GPU-seconds charged today to tenant `capped` in namespace `ns`.
async fn gpu_used(url: &str, ns: &str) -> f64 {
    let h = support::redis::hash(url, &format!("{ns}:quota:capped")).await;
    h.get("gu").map_or(0.0, |v| v.parse::<f64>().unwrap())
}

/// A claim whose answer comes back after the call's timeout (the script
/// ran in Redis; a loaded host, a slow network) leaves its request to the
/// replica, which decides it alone and reports what it spent: the fleet
/// charges such a request once, not once for the claim and again for the
/// report. Rounds of 1 to 15 claims lost at once; the charge is read from
/// Redis's bucket, refill accounted by Redis's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_answer_is_lost_is_charged_once() {
    let Some(redis) = Redis::start() else { return };
    let proxy = DelayProxy::start(redis.port).await;
    let ns = namespace();
    let mut cfg = config(&proxy.url(), &ns, OnUnavailable::Local, 1.0, None);
    if let Some(st) = cfg.state.as_mut() {
        st.replicas = 1;
    }
    // 60 a minute: a bucket of 60 refilled by one a second; GPU-seconds
    // far above what the rounds use.
    let text = POLICY.replace("requests 600/min", "requests 60/min gpu_seconds 50000/day");
    let g = serve_on_loopback(policy("fleet.kiln", &text), cfg).await;
    let base = format!("http://{}", g.addr);
    let fl = g.app.fleet.clone().unwrap();
    let c = client(Duration::from_secs(10));
    // Claimed through the fleet, a bucket well under full (so that the
    // refill read from Redis's clock is never cut by the bucket's top).
    for _ in 0..25 {
        assert_eq!(chat(&c, &base, "k-capped").await.0, 200, "claimed");
    }
    let url = redis.url();
    let gpu = || gpu_used(&url, &ns);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in [1usize, 6, 15] {
        let (rl0, ra0) = bucket(&redis.url(), &ns).await;
        let taken0 = fl.claims_taken_back();
        let gpu0 = gpu().await;
        // Answers held back past the call's timeout (300 ms): every claim
        // runs in Redis, and the replica decides each request alone.
        proxy.set_delay(Duration::from_millis(700));
        let sent: Vec<_> = (0..n)
            .map(|_| {
                let (c, b) = (c.clone(), base.clone());
                tokio::spawn(async move { chat(&c, &b, "k-capped").await.0 })
            })
            .collect();
        for h in sent {
            assert_eq!(h.await.unwrap(), 200, "admitted here from the local share");
        }
        tokio::time::sleep(Duration::from_millis(800)).await;
        proxy.set_delay(Duration::ZERO);
        // Redis answers again: the spending is reported and the lost
        // claims are taken back.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if fl.store.is_up() && !fl.budget.has_unsent() {
                break;
            }
            assert!(
                Instant::now() < until,
                "round {n}: the spending was never reported"
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (rl1, ra1) = bucket(&redis.url(), &ns).await;
        let charged = rl0 + (ra1 - ra0) / 1000.0 - rl1;
        eprintln!(
            "round {n}: charged {charged:.2}, claims taken back {}",
            fl.claims_taken_back() - taken0
        );
        assert!(
            (charged - n as f64).abs() < 0.5,
            "round {n}: {n} requests charged {charged:.2} to the fleet"
        );
        assert_eq!(fl.claims_taken_back() - taken0, n as u64, "round {n}");
        // Their GPU-seconds, used while the replica decided alone, are
        // charged to the fleet's daily budget too.
        let used = gpu().await - gpu0;
        assert!(used > 0.0, "round {n}: no GPU-seconds reported");
    }
    g.stop().await;
}

/// A spending report whose answer is lost (the script ran, the call timed
/// out) is sent again whole under its id, and charged once, GPU-seconds
/// included; each new report is charged. Reports of several sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spending_report_whose_answer_is_lost_is_charged_once() {
    use kiln::shared::{Level, QuotaKey, QuotaKind, QuotaSync, Store, StoreConfig};
    let Some(redis) = Redis::start() else { return };
    let proxy = DelayProxy::start(redis.port).await;
    let ns = namespace();
    let store = Store::open(&StoreConfig {
        url: proxy.url(),
        namespace: ns.clone(),
        replica: "r".into(),
        lease: Duration::from_secs(2),
        tls: Default::default(),
    })
    .unwrap();
    // A bucket so large and slow that refill is negligible: 100,000
    // requests, 0.01 a second; and a GPU-seconds limit.
    let item = |requests: f64, gpu: f64| QuotaSync {
        key: QuotaKey::new(QuotaKind::Tenant, "a"),
        requests_per_s: 0.01,
        tokens_per_s: 0.0,
        spent_requests: requests,
        spent_tokens: 0.0,
        spent_gpu_seconds: gpu,
        seed: Level::default(),
        bucket_s: 1e7,
    };
    let level = |l: Vec<Level>| l[0].requests.unwrap() * 100_000.0;
    let before = level(store.sync_quotas("", &[item(0.0, 0.0)]).await.unwrap());
    let mut gpu_total = 0.0;
    for (i, (requests, gpu)) in [(1.0, 0.5), (5.0, 2.25), (17.0, 0.0), (3.0, 40.0)]
        .into_iter()
        .enumerate()
    {
        let id = format!("boot.{i}");
        let start = level(store.sync_quotas("", &[item(0.0, 0.0)]).await.unwrap());
        proxy.set_delay(Duration::from_millis(700));
        assert!(
            store
                .sync_quotas(&id, &[item(requests, gpu)])
                .await
                .is_err(),
            "the answer comes after the timeout"
        );
        tokio::time::sleep(Duration::from_millis(800)).await;
        proxy.set_delay(Duration::ZERO);
        // Resent until answered, and once more.
        for _ in 0..2 {
            store
                .sync_quotas(&id, &[item(requests, gpu)])
                .await
                .unwrap();
        }
        gpu_total += gpu;
        let end = level(store.sync_quotas("", &[item(0.0, 0.0)]).await.unwrap());
        assert!(
            (start - end - requests).abs() < 0.05,
            "report {i}: {requests} requests charged {}",
            start - end
        );
        let h = support::redis::hash(&redis.url(), &format!("{ns}:quota:a")).await;
        let gu: f64 = h.get("gu").map_or(0.0, |v| v.parse().unwrap());
        assert!(
            (gu - gpu_total).abs() < 1e-9,
            "report {i}: GPU-seconds {gu} charged, {gpu_total} spent"
        );
    }
    let after = level(store.sync_quotas("", &[item(0.0, 0.0)]).await.unwrap());
    assert!((before - after - 26.0).abs() < 0.1, "{before} -> {after}");
}

/// The governance audit chain Redis holds is bounded: over its bound the
/// oldest lines are cut and a checkpoint stands for them (how many, the
/// last one's hash, what they told). Commits of generated sizes; after
/// each, Redis holds at most the bound, and a reader that had seen any
/// number of entries (none, some cut since, all) reads on to the same
/// head, each kept line verified against the one before it (the first
/// against the checkpoint, whose head is the last cut line's hash). A kept
/// line edited in Redis is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_audit_chain_is_trimmed_and_still_verifies() {
    use kiln::governance::audit::{AuditLog, Facts};
    use kiln::shared::{ChainCommit, Committed, Store, StoreConfig};
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    let store = Store::open(&StoreConfig {
        url: redis.url(),
        namespace: ns.clone(),
        replica: "r".into(),
        lease: Duration::from_secs(30),
        tls: Default::default(),
    })
    .unwrap();
    assert!(store.lease("gov", 30_000).await.unwrap());
    let keep = 8u64;
    // The writer's log learns from what it appends, as a replica's does.
    let mut log = AuditLog::shared();
    let mut all: Vec<String> = Vec::new();
    let mut head: Option<String> = None;
    for (i, n) in [1usize, 3, 5, 2, 4, 1, 6, 3, 2, 4, 9]
        .into_iter()
        .enumerate()
    {
        let mut lines = Vec::new();
        for _ in 0..n {
            let (kind, details) = if all.is_empty() && lines.is_empty() {
                ("gateway", json!({"gateway": "g-1"}))
            } else {
                (
                    "proposal",
                    json!({"id": format!("p-{}", all.len() + lines.len())}),
                )
            };
            lines.push(
                log.append(1_000 + i as u64, kind, "t", details)
                    .unwrap()
                    .line(),
            );
        }
        let commit = ChainCommit {
            expected_len: all.len() as u64,
            expected_head: head.clone(),
            lines: lines.clone(),
            new_head: log.head().to_string(),
            keep,
            checkpoint_extra: serde_json::to_vec(log.facts()).unwrap(),
            ..Default::default()
        };
        assert_eq!(
            store.chain_commit("gov", "gov", &commit).await.unwrap(),
            Committed::Written,
            "commit {i}"
        );
        all.extend(lines);
        head = Some(log.head().to_string());
        let len = all.len() as u64;
        let held = redis.list(&format!("{ns}:gov:audit")).await;
        assert!(
            held.len() as u64 <= keep,
            "commit {i}: {} lines held",
            held.len()
        );
        for start in 0..=len {
            let r = store.chain_read("gov", start).await.unwrap();
            assert_eq!(r.len, len, "the length counts the lines cut");
            let mut reader = AuditLog::memory();
            for l in &all[..start as usize] {
                reader.absorb(l).unwrap();
            }
            if let Some(cp) = r.checkpoint.as_ref().filter(|cp| start < cp.entries) {
                let cut: Value = serde_json::from_str(&all[cp.entries as usize - 1]).unwrap();
                assert_eq!(cut["hash"].as_str(), Some(cp.head.as_str()));
                let facts: Facts = serde_json::from_slice(&cp.extra).unwrap();
                reader.resume_at(cp.entries, &cp.head, facts);
            }
            for l in &r.lines {
                reader.absorb(l).unwrap();
            }
            assert_eq!(reader.entries(), len, "commit {i}, read from {start}");
            assert_eq!(reader.head(), log.head(), "commit {i}, read from {start}");
            assert_eq!(reader.facts().gateway.as_deref(), Some("g-1"));
            assert_eq!(
                reader.facts().highest_proposal,
                log.facts().highest_proposal
            );
        }
    }
    assert!(
        all.len() as u64 > 4 * keep,
        "the chain was cut several times"
    );
    // A kept line edited in Redis does not verify.
    let key = format!("{ns}:gov:audit");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let first: String = redis::cmd("LINDEX")
        .arg(&key)
        .arg(1)
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("LSET")
        .arg(&key)
        .arg(1)
        .arg(first.replace("\"t\"", "\"mallory\""))
        .query_async(&mut c)
        .await
        .unwrap();
    let r = store.chain_read("gov", 0).await.unwrap();
    let cp = r.checkpoint.unwrap();
    let mut reader = AuditLog::memory();
    reader.resume_at(cp.entries, &cp.head, Facts::default());
    let verified: Result<(), _> = r.lines.iter().try_for_each(|l| reader.absorb(l));
    assert!(verified.is_err(), "an edited line must not verify");
}

/// The request whose claim takes the fleet's last request of a quota is
/// served: the policy reads the fleet's level as the request found it
/// (as one gateway reads `quota.remaining` before reserving), not the 0%
/// its own claim left, which the policy's built-in "quota exhausted"
/// refused (a loaded fleet lost up to a quarter of its allowance so: its
/// bucket is drained to exactly nothing whenever a claim lands on a whole
/// refill). Rounds with exactly one request left in Redis's bucket (no
/// refill: its time is set ahead), on each of the three replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_claim_that_takes_the_last_request_is_served() {
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    // 6 a minute: a refill takes 10 s, longer than a round.
    let text = POLICY.replace("requests 600/min", "requests 6/min");
    let mut gateways = Vec::new();
    for i in 0..3 {
        let mut cfg = config(&redis.url(), &ns, OnUnavailable::Local, 1.0, None);
        if let Some(st) = cfg.state.as_mut() {
            st.replica = Some(format!("replica-{i}"));
        }
        gateways.push(serve_on_loopback(policy("fleet.kiln", &text), cfg).await);
    }
    let bases: Vec<String> = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    let f = Fleet { gateways, bases };
    let c = client(Duration::from_secs(10));
    let key = format!("{ns}:quota:capped");
    let conn = redis::Client::open(redis.url()).unwrap();
    let mut conn = conn.get_multiplexed_async_connection().await.unwrap();
    assert_eq!(
        chat(&c, &f.bases[0], "k-capped").await.0,
        200,
        "a first claim"
    );
    for round in 0..6 {
        let base = &f.bases[round % 3];
        let ahead = support::redis::now_ms(&redis.url()).await + 60_000.0;
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg("rl")
            .arg("1")
            .arg("ra")
            .arg(ahead as u64)
            .query_async(&mut conn)
            .await
            .unwrap();
        let last = answer(&c, base, "k-capped").await;
        assert_eq!(
            last.0, 200,
            "round {round}: the last request refused: {last:?}"
        );
        let next = answer(&c, base, "k-capped").await;
        assert_eq!(next.0, 429, "round {round}: {next:?}");
        assert!(
            next.2.contains("counted over every replica"),
            "round {round}: refused by the fleet's bucket, not here: {next:?}"
        );
    }
    f.stop().await;
}
