//! Governance across a fleet of replicas sharing a real `redis-server`
//! (started here on a free loopback port; skipped, with a message, where
//! it is not installed): a proposal made on one replica is seen and
//! approved on another, and its signature never counts twice anywhere;
//! concurrent admin actions on every replica leave one audit chain that
//! verifies; a replica started later sees the proposals, the rollback
//! history and the fleet's identity; a rollout advances on one replica
//! only; and with Redis gone governance is refused (503) while requests
//! are still served.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use support::redis::Redis;

use ed25519_dalek::SigningKey;
use kiln::governance::audit;
use kiln::governance::keys::{public_hex, Target};
use kiln::server::config::{hash_secret, OnUnavailable, ServerConfig, StateSection};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Simulated time runs 10× faster: a rollout's 10 s stages last 1 s.
const SPEED: f64 = 10.0;

/// The shared audit chain's lines, as the store holds them.
async fn audit_lines(redis: &Redis, ns: &str) -> Vec<String> {
    redis.list(&format!("{ns}:gov:audit")).await
}

fn namespace() -> String {
    support::redis::namespace("g")
}

/// Two platform leads approve any change.
const APPROVALS: &str = r#"
approval {
  require 2 from "platform-leads" for any
}
"#;

/// Tiers high and low; `low` at `low_priority`, and `extra` appended.
fn pol(low_priority: u32, extra: &str) -> String {
    format!(
        r#"
pool gpu {{ gpus 2 kind "H100-80GB" memory 80GB }}
model tiny {{
  params 1B
  kv_per_token 32KB
  variant fp16 {{ memory 4GB pools [gpu] }}
}}
tier high {{ priority 100 slo {{ p95 600s }} }}
tier low {{ priority {low_priority} slo {{ p95 600s }} }}
tenant alpha {{ owner "a@x" tiers [high] api_keys ["k-alpha"] }}
tenant beta {{ owner "b@x" tiers [low] api_keys ["k-beta"] }}
classify {{
  when tenant == alpha => tier high
  default => tier low
}}
route [high, low] tiny {{ default => fp16 }}
{APPROVALS}
{extra}
"#
    )
}

fn v1() -> String {
    pol(10, "")
}

fn key(n: u8) -> SigningKey {
    SigningKey::from_bytes(&[n; 32])
}

const BOB: u8 = 2;
const CAROL: u8 = 3;

/// Tokens tok-NAME for alice, bob, carol and ops; approvers bob and
/// carol (platform-leads); replica `replica` of the fleet `ns`.
fn config(url: &str, ns: &str, replica: &str) -> ServerConfig {
    let mut t = String::new();
    for n in ["alice", "bob", "carol", "ops"] {
        t.push_str(&format!(
            "[[admin.tokens]]\nname = \"{n}\"\nsha256 = \"{}\"\n",
            hash_secret(&format!("tok-{n}"))
        ));
    }
    for (n, k) in [("bob", BOB), ("carol", CAROL)] {
        t.push_str(&format!(
            "[[approvers]]\nname = \"{n}\"\ngroups = [\"platform-leads\"]\npublic_key = \"{}\"\n",
            public_hex(&key(k).verifying_key())
        ));
    }
    t.push_str(&format!(
        "[governance]\nwatch = \"10s\"\nwindow = \"60s\"\nmin_samples = 3\napproval_ttl = \"2h\"\n\
         [sim]\nspeed = {SPEED}\n"
    ));
    let mut cfg = ServerConfig::parse("test.toml", &t).unwrap();
    cfg.state = Some(StateSection {
        redis: url.to_string(),
        namespace: ns.to_string(),
        replica: Some(replica.to_string()),
        on_unavailable: OnUnavailable::Local,
        replicas: 3,
        lease: Duration::from_secs(2),
        ca_file: None,
        client_cert: None,
        client_key: None,
    });
    cfg
}

async fn replica(url: &str, ns: &str, name: &str) -> kiln::server::Running {
    support::serve_on_loopback(support::policy("policy.kiln", &v1()), config(url, ns, name)).await
}

/// Three replicas of one fleet, and their base URLs.
async fn fleet(url: &str, ns: &str) -> (Vec<kiln::server::Running>, Vec<String>) {
    let mut gws = Vec::new();
    for n in ["a", "b", "c"] {
        gws.push(replica(url, ns, n).await);
    }
    let bases = gws.iter().map(|g| format!("http://{}", g.addr)).collect();
    (gws, bases)
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(20))
}

async fn call(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = c.request(method, url).bearer_auth(token);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn get(c: &reqwest::Client, url: String) -> Value {
    let (s, v) = call(c, reqwest::Method::GET, url, "tok-ops", None).await;
    assert_eq!(s, 200, "{v}");
    v
}

async fn propose(c: &reqwest::Client, base: &str, token: &str, text: &str) -> (u16, Value) {
    call(
        c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals"),
        token,
        Some(json!({"files": {"policy.kiln": text}})),
    )
    .await
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `name`'s signed approval of proposal `id`, for the identity and nonce
/// the replica at `base` shows.
async fn sign(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    name: &str,
    k: u8,
) -> kiln::governance::keys::SignedApproval {
    let p = get(c, format!("{base}/admin/proposals/{id}")).await;
    let (gateway, nonce, hash) = (
        p["gateway"].as_str().unwrap().to_string(),
        p["nonce"].as_str().unwrap().to_string(),
        p["hash"].as_str().unwrap().to_string(),
    );
    assert!(!gateway.is_empty(), "{p}");
    let t = Target {
        gateway: &gateway,
        proposal: id,
        nonce: &nonce,
    };
    let issued = now_s();
    kiln::governance::keys::sign(&key(k), &t, &hash, name, issued, issued + 600)
}

async fn submit(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    a: &kiln::governance::keys::SignedApproval,
) -> (u16, Value) {
    call(
        c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals/{id}/approvals"),
        "tok-ops",
        Some(serde_json::to_value(a).unwrap()),
    )
    .await
}

/// The chain's entries, after checking that it verifies.
fn entries(lines: &[String]) -> Vec<Value> {
    audit::verify_lines("the shared chain", lines.join("\n").as_bytes())
        .unwrap_or_else(|e| panic!("the shared audit chain does not verify: {e}"));
    lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn count(es: &[Value], kind: &str, pred: impl Fn(&Value) -> bool) -> usize {
    es.iter().filter(|e| e["kind"] == kind && pred(e)).count()
}

/// Polls `url` (an admin GET) until `pred` holds, at most `secs`.
async fn wait_for(
    c: &reqwest::Client,
    url: String,
    secs: u64,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let v = get(c, url.clone()).await;
        if pred(&v) {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn proposal<'a>(list: &'a Value, id: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|p| p["id"] == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proposal_is_approved_across_replicas_and_a_signature_counts_once() {
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    let (gws, b) = fleet(&redis.url(), &ns).await;
    let c = client();

    let (s, p) = propose(&c, &b[0], "tok-alice", &pol(20, "")).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    assert_eq!(p["state"], "pending");

    // B sees it, under the same fleet identity A showed.
    let on_b = get(&c, format!("{}/admin/proposals/{id}", b[1])).await;
    assert_eq!(on_b["hash"], p["hash"]);
    assert_eq!(on_b["gateway"], p["gateway"]);
    assert_eq!(on_b["nonce"], p["nonce"]);

    // Bob approves on B: recorded once, one of the two needed.
    let bob = sign(&c, &b[1], &id, "bob", BOB).await;
    let (s, v) = submit(&c, &b[1], &id, &bob).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "pending", "{v}");
    assert_eq!(v["approvals"].as_array().map(Vec::len), Some(1), "{v}");

    // The same signed approval replayed on C is refused: C knows the
    // signature was used.
    let (s, v) = submit(&c, &b[2], &id, &bob).await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["error"]["code"], "replayed", "{v}");
    let on_c = get(&c, format!("{}/admin/proposals/{id}", b[2])).await;
    assert_eq!(
        on_c["approvals"].as_array().map(Vec::len),
        Some(1),
        "{on_c}"
    );

    // Carol approves on C: approved, then rolled out by the fleet's
    // runner and enforced everywhere.
    let carol = sign(&c, &b[2], &id, "carol", CAROL).await;
    let (s, v) = submit(&c, &b[2], &id, &carol).await;
    assert_eq!(s, 200, "{v}");
    let want = support::policy("policy.kiln", &pol(20, ""))
        .version
        .to_string();
    wait_for(
        &c,
        format!("{}/admin/proposals", b[0]),
        15,
        "enforced",
        |l| proposal(l, &id).is_some_and(|p| p["state"] == "enforced"),
    )
    .await;
    let t0 = Instant::now();
    while !gws
        .iter()
        .all(|g| g.app.policy.load().version.as_ref() == want)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "not active everywhere"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let es = entries(&audit_lines(&redis, &ns).await);
    let of = |e: &Value| e["details"]["id"] == id.as_str();
    assert_eq!(count(&es, "proposal", of), 1);
    assert_eq!(count(&es, "approval", of), 2);
    assert_eq!(count(&es, "approval", |e| of(e) && e["actor"] == "bob"), 1);
    assert_eq!(count(&es, "approval_refused", of), 1);
    assert_eq!(count(&es, "gateway", |_| true), 1);
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_actions_on_every_replica_leave_one_chain() {
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    let (gws, b) = fleet(&redis.url(), &ns).await;
    let c = client();
    // Three proposals on each replica at once, each withdrawn by its
    // proposer on another replica.
    let mut tasks = Vec::new();
    for i in 0..9u32 {
        let (c, b) = (c.clone(), b.clone());
        tasks.push(tokio::spawn(async move {
            let on = (i % 3) as usize;
            let (s, p) = propose(&c, &b[on], "tok-alice", &pol(11 + i, "")).await;
            if s != 201 {
                // Only a lease that could not be had within its wait.
                assert_eq!(s, 503, "{p}");
                assert_eq!(p["error"]["code"], "governance_busy", "{p}");
                return (false, false);
            }
            let id = p["id"].as_str().unwrap().to_string();
            let (s, v) = call(
                &c,
                reqwest::Method::DELETE,
                format!("{}/admin/proposals/{id}", b[(on + 1) % 3]),
                "tok-alice",
                None,
            )
            .await;
            assert!(s == 200 || s == 503, "{v}");
            (true, s == 200)
        }));
    }
    let (mut proposed, mut withdrawn) = (0, 0);
    for t in tasks {
        let (p, w) = t.await.unwrap();
        proposed += usize::from(p);
        withdrawn += usize::from(w);
    }
    assert!(proposed >= 3, "only {proposed} of 9 proposals recorded");

    let es = entries(&audit_lines(&redis, &ns).await);
    assert_eq!(count(&es, "proposal", |_| true), proposed);
    assert_eq!(count(&es, "proposal_withdrawn", |_| true), withdrawn);
    assert_eq!(count(&es, "gateway", |_| true), 1);
    // Ids were handed out once each, fleet-wide.
    let mut ids: Vec<&str> = es
        .iter()
        .filter(|e| e["kind"] == "proposal")
        .filter_map(|e| e["details"]["id"].as_str())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), proposed);
    // Every replica answers with the same head, the chain's.
    let head = es.last().unwrap()["hash"].clone();
    for base in &b {
        let a = get(&c, format!("{base}/admin/audit")).await;
        assert_eq!(a["head"], head, "{a}");
        assert_eq!(a["entries"].as_u64(), Some(es.len() as u64));
    }
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_started_later_sees_everything_and_governance_needs_redis() {
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    let c = client();
    let a = replica(&redis.url(), &ns, "a").await;
    let base_a = format!("http://{}", a.addr);
    let v1_version = support::policy("policy.kiln", &v1()).version.to_string();

    // One change enforced (v1 becomes the rollback target), one proposal
    // left open with one approval.
    let (s, p) = propose(&c, &base_a, "tok-alice", &pol(20, "")).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let gateway = p["gateway"].as_str().unwrap().to_string();
    for (n, k) in [("bob", BOB), ("carol", CAROL)] {
        let s_a = sign(&c, &base_a, &id, n, k).await;
        let (s, v) = submit(&c, &base_a, &id, &s_a).await;
        assert_eq!(s, 200, "{v}");
    }
    wait_for(&c, format!("{base_a}/admin/status"), 15, "enforced", |s| {
        s["previous"] == v1_version.as_str() && s["rollout"].is_null()
    })
    .await;
    let (s, open) = propose(&c, &base_a, "tok-alice", &pol(30, "")).await;
    assert_eq!(s, 201, "{open}");
    let open_id = open["id"].as_str().unwrap().to_string();
    let bob = sign(&c, &base_a, &open_id, "bob", BOB).await;
    assert_eq!(submit(&c, &base_a, &open_id, &bob).await.0, 200);
    let head = get(&c, format!("{base_a}/admin/audit")).await["head"].clone();
    a.stop().await;

    // A new replica on the same namespace: same proposals, history and
    // identity; the used signature still counts once.
    let d = replica(&redis.url(), &ns, "d").await;
    let base_d = format!("http://{}", d.addr);
    let st = get(&c, format!("{base_d}/admin/status")).await;
    assert_eq!(st["previous"], v1_version.as_str(), "{st:#}");
    assert_eq!(st["audit"]["head"], head, "{st:#}");
    let l = get(&c, format!("{base_d}/admin/proposals")).await;
    assert_eq!(proposal(&l, &id).unwrap()["state"], "enforced", "{l:#}");
    let o = proposal(&l, &open_id).unwrap();
    assert_eq!(o["state"], "pending", "{l:#}");
    assert_eq!(o["gateway"], gateway.as_str());
    let full = get(&c, format!("{base_d}/admin/proposals/{open_id}")).await;
    assert_eq!(
        full["approvals"].as_array().map(Vec::len),
        Some(1),
        "{full}"
    );
    let (s, v) = submit(&c, &base_d, &open_id, &bob).await;
    assert_eq!(
        (s, v["error"]["code"].clone()),
        (409, json!("replayed")),
        "{v}"
    );
    // Ids continue where the fleet left them.
    let (s, next) = propose(&c, &base_d, "tok-alice", &pol(40, "")).await;
    assert_eq!(s, 201, "{next}");
    assert_ne!(next["id"], open_id.as_str());
    assert_ne!(next["id"], id.as_str());

    // Redis gone: governance is refused, requests are still served.
    redis.stop();
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{base_d}/admin/proposals"),
        "tok-alice",
        Some(json!({"files": {"policy.kiln": pol(50, "")}})),
    )
    .await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "governance_unavailable", "{v}");
    let r = c
        .post(format!("{base_d}/admin/proposals/{open_id}/approvals"))
        .bearer_auth("tok-ops")
        .json(&serde_json::to_value(sign(&c, &base_d, &open_id, "carol", CAROL).await).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().get("retry-after").is_some());
    let r = c
        .post(format!("{base_d}/v1/chat/completions"))
        .bearer_auth("k-alpha")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollout_advances_on_one_replica_only() {
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    let (gws, b) = fleet(&redis.url(), &ns).await;
    let c = client();
    let staged = pol(
        20,
        "rollout {\n  shadow 10s\n  canary { tenants [beta] duration 10s }\n  rollback when error_rate > 50%\n}\n",
    );
    let (s, p) = propose(&c, &b[1], "tok-alice", &staged).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    for (on, n, k) in [(1, "bob", BOB), (2, "carol", CAROL)] {
        let a = sign(&c, &b[on], &id, n, k).await;
        let (s, v) = submit(&c, &b[on], &id, &a).await;
        assert_eq!(s, 200, "{v}");
    }
    // Every replica shows the rollout while it runs, wherever it runs.
    for base in &b {
        wait_for(&c, format!("{base}/admin/status"), 10, "the rollout", |s| {
            s["rollout"]["proposal"] == id.as_str()
        })
        .await;
    }
    wait_for(
        &c,
        format!("{}/admin/proposals", b[0]),
        20,
        "enforced",
        |l| proposal(l, &id).is_some_and(|p| p["state"] == "enforced"),
    )
    .await;
    // Ticks go on for a while: nothing is done twice.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let es = entries(&audit_lines(&redis, &ns).await);
    let stage = |s: &'static str| {
        count(&es, "rollout", |e| {
            e["details"]["id"] == id.as_str() && e["details"]["stage"] == s
        })
    };
    for s in ["started", "shadow", "canary", "finished"] {
        assert_eq!(stage(s), 1, "stage {s} recorded {} times", stage(s));
    }
    assert_eq!(
        count(&es, "activation", |e| e["details"]["id"] == id.as_str()),
        1
    );
    for g in gws {
        g.stop().await;
    }
}

async fn chat_status(c: &reqwest::Client, base: &str, key: &str) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// An incident control is the fleet's: a tier paused through one replica
/// is refused on every replica within a tick, ends on all of them when it
/// is lifted through another, and each is recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_override_set_on_one_replica_holds_on_every_replica() {
    let Some(redis) = Redis::start() else { return };
    let ns = namespace();
    let (gws, bases) = fleet(&redis.url(), &ns).await;
    let c = client();
    for b in &bases {
        assert_eq!(chat_status(&c, b, "k-beta").await.0, 200);
    }
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{}/admin/overrides", bases[0]),
        "tok-ops",
        Some(json!({"scope": "tier", "name": "low", "action": "pause", "for": "10m", "reason": "incident 9"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let until = std::time::Instant::now() + Duration::from_secs(3);
    for b in &bases {
        loop {
            let (s, e) = chat_status(&c, b, "k-beta").await;
            if s == 503 {
                assert_eq!(e["error"]["code"], "paused", "{e}");
                break;
            }
            assert!(
                std::time::Instant::now() < until,
                "{b} still serves the paused tier"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            chat_status(&c, b, "k-alpha").await.0,
            200,
            "another tier is not paused"
        );
    }
    let (s, v) = call(
        &c,
        reqwest::Method::DELETE,
        format!("{}/admin/overrides/tier/low", bases[2]),
        "tok-ops",
        None,
    )
    .await;
    assert!(s == 200 || s == 204, "{s} {v}");
    let until = std::time::Instant::now() + Duration::from_secs(3);
    for b in &bases {
        while chat_status(&c, b, "k-beta").await.0 != 200 {
            assert!(
                std::time::Instant::now() < until,
                "{b} still refuses after the lift"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let lines = audit_lines(&redis, &ns).await;
    let kinds: Vec<String> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["kind"].as_str().map(String::from))
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "override").count(),
        1,
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "override_lifted").count(),
        1,
        "{kinds:?}"
    );
    for g in gws {
        g.stop().await;
    }
}
