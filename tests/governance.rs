//! Governance end to end against `kiln serve` (started in-process on
//! 127.0.0.1:0): proposals, signed approvals and every attack on them,
//! shadow → canary → enforce with traffic flowing, automatic rollback when
//! a declared condition trips, manual rollback under approval rules,
//! incident overrides that expire, and an audit log that catches tampering.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use ed25519_dalek::SigningKey;
use kiln::governance::audit;
use kiln::governance::keys::{public_hex, Target};
use kiln::governance::view::{render_proposal, render_status, ProposalView, StatusView};
use kiln::server::config::{hash_secret, ServerConfig};
use kiln::server::{start, Policy, Running, ServeOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Simulated time runs 10× faster: rollout stages of 40 s last 4 s.
const SPEED: f64 = 10.0;

const APPROVALS: &str = r#"
approval {
  require 2 from "platform-leads" for [priority_increase, quota_increase, preemption_change]
  require 1 from "platform" for any
}
"#;

/// Two tiers; alpha is high, beta and gamma low (beta may be raised).
fn pol(extra: &str, classify_beta_high: bool, low_priority: u32) -> String {
    let beta = if classify_beta_high {
        "  when tenant == beta => tier high\n"
    } else {
        ""
    };
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
tenant beta {{ owner "b@x" tiers [low, high] api_keys ["k-beta"] }}
tenant gamma {{ owner "c@x" tiers [low] api_keys ["k-gamma"] }}
classify {{
  when tenant == alpha => tier high
{beta}  default => tier low
}}
route [high, low] tiny {{ default => fp16 }}
{extra}
"#
    )
}

fn v1() -> String {
    pol(APPROVALS, false, 10)
}

fn policy(text: &str) -> Policy {
    support::policy("policy.kiln", text)
}

fn key(n: u8) -> SigningKey {
    SigningKey::from_bytes(&[n; 32])
}

const ALICE: u8 = 1;
const BOB: u8 = 2;
const CAROL: u8 = 3;
const MALLORY: u8 = 9;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-gov-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Tokens tok-NAME for alice, bob, carol and ops; approvers alice
/// (platform), bob (platform, platform-leads), carol (platform-leads).
fn config(d: &Path) -> ServerConfig {
    let mut t = String::new();
    for n in ["alice", "bob", "carol", "ops"] {
        t.push_str(&format!(
            "[[admin.tokens]]\nname = \"{n}\"\nsha256 = \"{}\"\n",
            hash_secret(&format!("tok-{n}"))
        ));
    }
    for (n, k, groups) in [
        ("alice", ALICE, "[\"platform\"]"),
        ("bob", BOB, "[\"platform\", \"platform-leads\"]"),
        ("carol", CAROL, "[\"platform-leads\"]"),
    ] {
        t.push_str(&format!(
            "[[approvers]]\nname = \"{n}\"\ngroups = {groups}\npublic_key = \"{}\"\n",
            public_hex(&key(k).verifying_key())
        ));
    }
    t.push_str(&format!(
        "[governance]\nwatch = \"40s\"\nwindow = \"60s\"\nmin_samples = 3\napproval_ttl = \"2h\"\n\
         withdraw_groups = [\"platform-leads\"]\n\
         [audit]\npath = \"{}\"\n[log]\npath = \"{}\"\n[sim]\nspeed = {SPEED}\n",
        d.join("audit.jsonl").display(),
        d.join("decisions.jsonl").display()
    ));
    ServerConfig::parse("test.toml", &t).unwrap()
}

async fn serve(text: &str, cfg: ServerConfig) -> Running {
    support::serve_on_loopback(policy(text), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(30))
}

async fn chat(c: &reqwest::Client, base: &str, key: &str) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        .send()
        .await
        .unwrap()
}

async fn call(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = c.request(method, url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
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

async fn propose(c: &reqwest::Client, base: &str, token: &str, text: &str) -> (u16, Value) {
    call(
        c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals"),
        Some(token),
        Some(json!({"files": {"policy.kiln": text}})),
    )
    .await
}

/// The gateway's identity and proposal `id`'s nonce: what approvals sign
/// besides the hash.
async fn target_of(c: &reqwest::Client, base: &str, id: &str) -> (String, String) {
    let (s, v) = call(
        c,
        reqwest::Method::GET,
        format!("{base}/admin/proposals/{id}"),
        Some("tok-ops"),
        None,
    )
    .await;
    // No such proposal: sign for nothing in particular (the gateway answers
    // 404 anyway).
    let field = |k: &str| {
        v[k].as_str()
            .filter(|_| s == 200)
            .unwrap_or_default()
            .to_string()
    };
    (field("gateway"), field("nonce"))
}

/// Signs as `kiln approve` does, for proposal `id` of the gateway at `base`
/// (its identity and the proposal's nonce fetched), or, with `as_id`, for
/// another id under the same nonce.
#[allow(clippy::too_many_arguments)]
async fn sign_for(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    as_id: Option<&str>,
    k: &SigningKey,
    hash: &str,
    name: &str,
    issued: u64,
    expires: u64,
) -> kiln::governance::keys::SignedApproval {
    let (gateway, nonce) = target_of(c, base, id).await;
    let t = Target {
        gateway: &gateway,
        proposal: as_id.unwrap_or(id),
        nonce: &nonce,
    };
    kiln::governance::keys::sign(k, &t, hash, name, issued, expires)
}

/// An approval by approver `name` (key `k`) of `hash` for `id`, valid
/// from `issued` for `valid` seconds, presented with `ops`'s token.
#[allow(clippy::too_many_arguments)]
async fn approve_with(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    name: &str,
    k: u8,
    hash: &str,
    issued: u64,
    valid: u64,
) -> (u16, Value) {
    let a = sign_for(
        c,
        base,
        id,
        None,
        &key(k),
        hash,
        name,
        issued,
        issued + valid,
    )
    .await;
    call(
        c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals/{id}/approvals"),
        Some("tok-ops"),
        Some(serde_json::to_value(a).unwrap()),
    )
    .await
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

async fn approve(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    name: &str,
    k: u8,
    hash: &str,
) -> (u16, Value) {
    approve_with(c, base, id, name, k, hash, now_s(), 600).await
}

async fn status(c: &reqwest::Client, base: &str) -> Value {
    let (s, v) = call(
        c,
        reqwest::Method::GET,
        format!("{base}/admin/status"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v
}

/// Polls `/admin/status` until `pred` holds (at most `secs`).
async fn wait_for(
    c: &reqwest::Client,
    base: &str,
    secs: u64,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let s = status(c, base).await;
        if pred(&s) {
            return s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}: {s:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends alpha's requests in a loop until stopped; counts failures.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

fn load(base: &str, key: &'static str) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let (s, o, f, base) = (stop.clone(), ok.clone(), failed.clone(), base.to_string());
    let task = tokio::spawn(async move {
        let c = client();
        // Bounded: at most 2,000 requests, whatever happens.
        for _ in 0..2000 {
            if s.load(Ordering::Relaxed) {
                break;
            }
            let r = chat(&c, &base, key).await;
            if r.status() == 200 {
                o.fetch_add(1, Ordering::Relaxed);
            } else {
                f.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    Load {
        stop,
        ok,
        failed,
        task,
    }
}

impl Load {
    async fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

fn audit_lines(d: &Path) -> Vec<String> {
    std::fs::read_to_string(d.join("audit.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn audit_kinds(d: &Path) -> Vec<String> {
    audit_lines(d)
        .iter()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["kind"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_are_bound_to_hash_proposal_and_approver() {
    let d = dir("approvals");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let load = load(&base, "k-alpha");
    let v1_version = status(&c, &base).await["active"]
        .as_str()
        .unwrap()
        .to_string();

    // Unauthenticated and wrong-token admin calls.
    let (s, _) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals"),
        None,
        Some(json!({"files": {"a.kiln": v1()}})),
    )
    .await;
    assert_eq!(s, 401);
    let (s, _) = propose(&c, &base, "tok-nobody", &v1()).await;
    assert_eq!(s, 403);
    let (s, _) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/admin/status"),
        None,
        None,
    )
    .await;
    assert_eq!(s, 401);
    // A direct swap would bypass approvals: refused, pointing at propose.
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/policy"),
        Some("tok-alice"),
        Some(json!({"files": {"p.kiln": pol("", true, 10)}})),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    assert_eq!(v["error"]["code"], "approval_required");
    assert!(v["error"]["message"].as_str().unwrap().contains("propose"));

    // A bad policy is refused with its diagnostics.
    let (s, v) = propose(&c, &base, "tok-alice", "tier x { priority }").await;
    assert_eq!(s, 422, "{v}");
    assert!(!v["diagnostics"].as_array().unwrap().is_empty());
    assert!(!v["rendered"].as_str().unwrap().is_empty());

    // An escalation: low's priority raised. It needs two platform leads
    // and one platform approver, from the rules in force.
    let esc = pol(APPROVALS, false, 50);
    let (s, p) = propose(&c, &base, "tok-alice", &esc).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let hash = p["hash"].as_str().unwrap().to_string();
    assert_eq!(hash.len(), 64);
    assert_eq!(p["state"], "pending");
    assert_eq!(p["proposer"], "alice");
    assert_eq!(p["base"], v1_version);
    assert_eq!(p["escalations"], json!(["priority_increase"]));
    let needs = p["needs"].as_array().unwrap();
    assert!(
        needs
            .iter()
            .any(|n| n["group"] == "platform-leads" && n["count"] == 2),
        "{p:#}"
    );
    assert!(needs
        .iter()
        .any(|n| n["group"] == "platform" && n["count"] == 1));
    assert!(p["changes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["escalation"] == true));
    // The dry run replayed the decision log (alpha's traffic so far).
    assert!(
        p["dry_run"]["records"].as_u64().unwrap() > 0,
        "{:#}",
        p["dry_run"]
    );

    // Self-approval.
    let (s, v) = approve(&c, &base, &id, "alice", ALICE, &hash).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("self_approval")),
        "{v}"
    );
    // An approval of a different hash.
    let (s, v) = approve(&c, &base, &id, "bob", BOB, &"0".repeat(64)).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("wrong_hash")),
        "{v}"
    );
    // Signed with the wrong key; by an unknown approver.
    let (s, v) = approve(&c, &base, &id, "bob", MALLORY, &hash).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("bad_signature")),
        "{v}"
    );
    let (s, v) = approve(&c, &base, &id, "mallory", MALLORY, &hash).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("unknown_approver")),
        "{v}"
    );
    // Signed for another proposal, presented here.
    let moved = sign_for(
        &c,
        &base,
        &id,
        Some("p-999"),
        &key(BOB),
        &hash,
        "bob",
        now_s(),
        now_s() + 600,
    )
    .await;
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals/{id}/approvals"),
        Some("tok-ops"),
        Some(serde_json::to_value(moved).unwrap()),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("bad_signature")),
        "{v}"
    );
    // Expired; valid for longer than the server allows.
    let (s, v) = approve_with(&c, &base, &id, "bob", BOB, &hash, now_s() - 7200, 3600).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("expired")),
        "{v}"
    );
    let (s, v) = approve_with(&c, &base, &id, "bob", BOB, &hash, now_s(), 86_400 * 30).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("too_long")),
        "{v}"
    );

    // The ordinary approval alone does not pass an escalation.
    let (s, v) = approve(&c, &base, &id, "bob", BOB, &hash).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "pending");
    // Replayed, and a second approval by the same approver.
    let first = sign_for(
        &c,
        &base,
        &id,
        None,
        &key(BOB),
        &hash,
        "bob",
        now_s() - 1,
        now_s() + 599,
    )
    .await;
    let body = serde_json::to_value(&first).unwrap();
    let url = format!("{base}/admin/proposals/{id}/approvals");
    let (s, _) = call(
        &c,
        reqwest::Method::POST,
        url.clone(),
        Some("tok-ops"),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 409, "a second approval by bob");
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        url.clone(),
        Some("tok-ops"),
        Some(body),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    let accepted = &audit_lines(&d)
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"] == "approval")
        .unwrap()["details"]["signature"];
    let replay =
        json!({"approver": "bob", "hash": hash, "issued": 0, "expires": 0, "signature": accepted});
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        url.clone(),
        Some("tok-ops"),
        Some(replay),
    )
    .await;
    assert_eq!(
        s, 403,
        "a replayed signature with other fields does not verify: {v}"
    );
    let st = status(&c, &base).await;
    let open = &st["proposals"][0];
    assert_eq!(open["id"], id);
    assert!(open["needs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["group"] == "platform-leads" && n["missing"] == 1));

    // Editing the proposal voids its approvals: the old hash is refused.
    let (s, v) = call(
        &c,
        reqwest::Method::PUT,
        format!("{base}/admin/proposals/{id}"),
        Some("tok-bob"),
        Some(json!({"files": {"policy.kiln": esc.replace("priority 50", "priority 60")}})),
    )
    .await;
    assert_eq!(s, 403, "only the proposer revises: {v}");
    let (s, v) = call(
        &c,
        reqwest::Method::PUT,
        format!("{base}/admin/proposals/{id}"),
        Some("tok-alice"),
        Some(json!({"files": {"policy.kiln": esc.replace("priority 50", "priority 60")}})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["revision"], 2);
    assert_eq!(v["approvals"], json!([]));
    let hash2 = v["hash"].as_str().unwrap().to_string();
    assert_ne!(hash, hash2);
    let (s, v) = approve(&c, &base, &id, "carol", CAROL, &hash).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("wrong_hash")),
        "{v}"
    );

    // A proposal that removes the approval block and raises a priority is
    // judged by the rules in force (and the floor for approval changes).
    let (s, lower) = propose(&c, &base, "tok-alice", &pol("", false, 70)).await;
    assert_eq!(s, 201, "{lower}");
    let ln = lower["needs"].as_array().unwrap();
    assert!(
        ln.iter()
            .any(|n| n["group"] == "platform-leads" && n["count"] == 2),
        "{lower:#}"
    );
    assert!(lower["change_kinds"]
        .as_array()
        .unwrap()
        .contains(&json!("approval_change")));
    let lid = lower["id"].as_str().unwrap().to_string();
    // Withdrawing is the proposer's right, or a withdraw group's: ops (an
    // admin token, not an approver) may not; carol (platform-leads, the
    // configured group) may.
    let (s, v) = call(
        &c,
        reqwest::Method::DELETE,
        format!("{base}/admin/proposals/{lid}"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(s, 403, "ops withdrew alice's proposal: {v}");
    assert!(
        v.to_string()
            .contains("only its proposer (alice), or a member of platform-leads, may withdraw"),
        "{v}"
    );
    let (s, v) = call(
        &c,
        reqwest::Method::DELETE,
        format!("{base}/admin/proposals/{lid}"),
        Some("tok-carol"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");

    // Enough approvals (bob counts for both groups, carol is a lead): the
    // change has no rollout block, so it is enforced at once.
    let (s, v) = approve(&c, &base, &id, "bob", BOB, &hash2).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = approve(&c, &base, &id, "carol", CAROL, &hash2).await;
    assert_eq!(s, 200, "{v}");
    let st = wait_for(&c, &base, 10, "activation", |s| {
        s["active"] != json!(v1_version)
    })
    .await;
    assert_eq!(st["previous"], json!(v1_version));
    let r = chat(&c, &base, "k-gamma").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-kiln-policy-version"].to_str().unwrap(),
        st["active"].as_str().unwrap()
    );
    let (ok, failed) = load.finish().await;
    assert!(ok > 0);
    assert_eq!(failed, 0, "requests failed while proposals came and went");
    srv.stop().await;

    // The audit log: intact, then every kind of tampering is caught.
    let kinds = audit_kinds(&d);
    for k in [
        "proposal",
        "approval_refused",
        "approval",
        "proposal_revised",
        "proposal_withdrawn",
        "rollout",
        "activation",
    ] {
        assert!(kinds.iter().any(|x| x == k), "no {k} in {kinds:?}");
    }
    let path = d.join("audit.jsonl");
    let ok = audit::verify_file(&path).unwrap();
    assert_eq!(ok.entries as usize, kinds.len());
    let lines = audit_lines(&d);
    let bad = |name: &str, lines: Vec<String>| {
        let p = d.join(name);
        std::fs::write(&p, lines.join("\n") + "\n").unwrap();
        match audit::verify_file(&p) {
            Err(audit::AuditError::Broken { line, .. }) => line,
            other => panic!("{name}: tampering not caught: {other:?}"),
        }
    };
    let mut edited = lines.clone();
    let mut e: Value = serde_json::from_str(&edited[2]).unwrap();
    e["actor"] = json!("mallory");
    edited[2] = e.to_string();
    assert_eq!(bad("edited.jsonl", edited), 3);
    let mut deleted = lines.clone();
    deleted.remove(3);
    assert_eq!(bad("deleted.jsonl", deleted), 4);
    let mut reordered = lines.clone();
    reordered.swap(1, 2);
    assert_eq!(bad("reordered.jsonl", reordered), 2);
    // The CLI: exit 0 with the head, 1 naming the line.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["audit", "verify"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), ok.head);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["audit", "verify"])
        .arg(d.join("edited.jsonl"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("edited.jsonl:3"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// The proposal: beta moves to the high tier, after 40 s of shadow and
/// 40 s of canary on beta alone.
fn staged() -> String {
    pol(
        &format!(
            "{APPROVALS}\nrollout {{\n  shadow 40s\n  canary {{ tenants [beta] duration 40s }}\n  rollback when error_rate > 50%\n}}\n"
        ),
        true,
        10,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_canary_enforce_while_traffic_flows() {
    let d = dir("staged");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let load_a = load(&base, "k-alpha");
    let load_g = load(&base, "k-gamma");
    let v1_version = status(&c, &base).await["active"]
        .as_str()
        .unwrap()
        .to_string();
    for _ in 0..3 {
        assert_eq!(chat(&c, &base, "k-beta").await.status(), 200);
    }
    let (s, p) = propose(&c, &base, "tok-alice", &staged()).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    // The dry run saw beta's recorded requests change tier.
    assert!(
        p["dry_run"]["changed"].as_u64().unwrap() >= 3,
        "{:#}",
        p["dry_run"]
    );
    assert!(p["dry_run"]["by_kind"]["tier"].as_u64().unwrap() >= 3);
    // `canary { tenants [beta] }` is one stage taking beta's every request.
    assert_eq!(p["rollout"]["stages"][0]["name"], "canary");
    assert_eq!(p["rollout"]["stages"][0]["pinned"], json!(["beta"]));
    // beta's traffic moves from low (10) to high (100): a priority
    // increase, so two platform leads approve.
    let (s, v) = approve(&c, &base, &id, "carol", CAROL, p["hash"].as_str().unwrap()).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = approve(&c, &base, &id, "bob", BOB, p["hash"].as_str().unwrap()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "rolling");

    // Shadow: the proposal decides beta's requests too, enforcing nothing.
    let st = status(&c, &base).await;
    assert_eq!(st["rollout"]["stage"], "shadow", "{st:#}");
    for _ in 0..4 {
        let r = chat(&c, &base, "k-beta").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kiln-tier"], "low");
        assert!(r.headers().get("x-kiln-canary").is_none());
    }
    let st = status(&c, &base).await;
    let sh = &st["rollout"]["shadow"];
    assert!(sh["differ"].as_u64().unwrap() >= 4, "{st:#}");
    assert!(sh["by_field"]["tier"].as_u64().unwrap() >= 4);
    assert!(sh["decided"].as_u64().unwrap() >= sh["differ"].as_u64().unwrap());
    let metrics = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kiln_shadow_differences_total"),
        "shadow metrics missing"
    );

    // Canary: beta is decided by the new version; alpha and gamma are not.
    wait_for(&c, &base, 10, "canary", |s| {
        s["rollout"]["stage"] == "canary"
    })
    .await;
    let r = chat(&c, &base, "k-beta").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kiln-tier"], "high");
    assert_eq!(r.headers()["x-kiln-canary"], "true");
    let canary_version = r.headers()["x-kiln-policy-version"]
        .to_str()
        .unwrap()
        .to_string();
    assert_ne!(canary_version, v1_version);
    let r = chat(&c, &base, "k-gamma").await;
    assert!(r.headers().get("x-kiln-canary").is_none());
    assert_eq!(
        r.headers()["x-kiln-policy-version"].to_str().unwrap(),
        v1_version
    );
    let st = status(&c, &base).await;
    assert!(
        st["rollout"]["canary_requests"].as_u64().unwrap() >= 1,
        "{st:#}"
    );
    assert_eq!(st["rollout"]["conditions"][0]["text"], "error_rate > 50%");
    // Explain shows the canary's decision.
    let rid = r.headers()["x-kiln-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let (s, _) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/admin/explain/{rid}"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(s, 200);

    // Enforce, then the watch ends and the rollout is complete.
    let st = wait_for(&c, &base, 20, "enforce", |s| {
        s["active"] == json!(canary_version)
    })
    .await;
    assert_eq!(st["previous"], json!(v1_version));
    let r = chat(&c, &base, "k-beta").await;
    assert_eq!(r.headers()["x-kiln-tier"], "high");
    assert!(r.headers().get("x-kiln-canary").is_none());
    wait_for(&c, &base, 20, "the watch to end", |s| {
        s["rollout"].is_null()
    })
    .await;
    let (_, pv) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/admin/proposals/{id}"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(pv["state"], "enforced", "{pv:#}");
    for l in [load_a, load_g] {
        let (ok, failed) = l.finish().await;
        assert!(ok > 10);
        assert_eq!(failed, 0, "requests failed during the rollout");
    }
    srv.stop().await;
    let kinds = audit_kinds(&d);
    let stages: Vec<String> = audit_lines(&d)
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["kind"] == "rollout")
        .map(|e| e["details"]["stage"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        stages,
        ["started", "shadow", "canary", "finished"],
        "{kinds:?}"
    );
    assert!(kinds.contains(&"activation".to_string()));
    audit::verify_file(&d.join("audit.jsonl")).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// Two canary stages: beta alone for 60 s, then the low tier (as the new
/// version classifies) for 20 s and until its gate holds on enough of the
/// stage's own requests.
fn two_stages() -> String {
    pol(
        &format!(
            "{APPROVALS}\nrollout {{\n  stage pilot {{ tenants [beta] duration 60s }}\n  stage low {{ tiers [low] duration 20s\n    gate when tier(low).error_rate < 5% }}\n}}\n"
        ),
        true,
        10,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stages_advance_on_time_and_gates_and_status_names_the_stage() {
    let d = dir("two-stages");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let v1_version = status(&c, &base).await["active"].clone();
    let (s, p) = propose(&c, &base, "tok-alice", &two_stages()).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let names: Vec<&str> = p["rollout"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["pilot", "low"]);
    let hash = p["hash"].as_str().unwrap().to_string();
    let (s, v) = approve(&c, &base, &id, "carol", CAROL, &hash).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = approve(&c, &base, &id, "bob", BOB, &hash).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "rolling");

    // Stage 1, pilot: beta's requests are the new version's, gamma's not.
    let st = wait_for(&c, &base, 5, "stage 1", |s| {
        s["rollout"]["stage_number"] == 1
    })
    .await;
    assert_eq!(st["rollout"]["canary"]["name"], "pilot", "{st:#}");
    assert_eq!(st["rollout"]["stages"], 2);
    let r = chat(&c, &base, "k-beta").await;
    assert_eq!(r.headers()["x-kiln-canary"], "true");
    assert_eq!(r.headers()["x-kiln-tier"], "high");
    let r = chat(&c, &base, "k-gamma").await;
    assert!(r.headers().get("x-kiln-canary").is_none());
    let view: StatusView = serde_json::from_value(st).unwrap();
    let text = render_status(&view);
    assert!(
        text.contains("canary stage 1/2 \"pilot\" (tenants beta)"),
        "{text}"
    );

    // Stage 2, low: its time passes with no low-tier traffic, so its gate
    // is short of samples and the stage waits.
    let st = wait_for(&c, &base, 15, "stage 2 past its time", |s| {
        s["rollout"]["stage_number"] == 2 && s["rollout"]["remaining_s"] == 0.0
    })
    .await;
    assert_eq!(st["rollout"]["canary"]["tiers"], json!(["low"]), "{st:#}");
    let gate = &st["rollout"]["gates"][0];
    assert_eq!(gate["text"], "tier(low).error_rate < 5%");
    assert_eq!(gate["holds"], false, "{st:#}");
    assert!(
        gate["observed"].to_string().contains("of 3 samples"),
        "{st:#}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = status(&c, &base).await;
    assert_eq!(st["rollout"]["stage_number"], 2, "still waiting: {st:#}");
    assert_eq!(st["active"], v1_version);
    let view: StatusView = serde_json::from_value(st).unwrap();
    let text = render_status(&view);
    assert!(
        text.contains("canary stage 2/2 \"low\" (tiers low)")
            && text.contains("waiting for gate tier(low).error_rate < 5%"),
        "{text}"
    );
    // beta is high under the new version: outside the stage's tier.
    let r = chat(&c, &base, "k-beta").await;
    assert!(r.headers().get("x-kiln-canary").is_none());
    // gamma is low: the stage's. Enough healthy samples pass the gate.
    for _ in 0..4 {
        let r = chat(&c, &base, "k-gamma").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kiln-canary"], "true");
    }
    let st = wait_for(&c, &base, 10, "enforce", |s| s["active"] != v1_version).await;
    assert_eq!(st["previous"], v1_version);
    wait_for(&c, &base, 10, "the rollout to finish", |s| {
        s["rollout"].is_null()
    })
    .await;
    let metrics = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kiln_rollout_stages_total{") && metrics.contains("stage=\"low\""),
        "stage metric missing"
    );
    srv.stop().await;
    let stages: Vec<(String, String)> = audit_lines(&d)
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["kind"] == "rollout")
        .map(|e| {
            let d = &e["details"];
            (
                d["stage"].as_str().unwrap().to_string(),
                d["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let want = [
        ("started", ""),
        ("canary", "pilot"),
        ("canary", "low"),
        ("finished", ""),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(stages, want);
    audit::verify_file(&d.join("audit.jsonl")).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tripped_condition_rolls_the_canary_back_by_itself() {
    let d = dir("canary-rollback");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let load_a = load(&base, "k-alpha");
    let v1_version = status(&c, &base).await["active"]
        .as_str()
        .unwrap()
        .to_string();
    // The new version refuses the low tier: gamma, its canary tenant,
    // starts failing with 503.
    let broken = pol(
        &format!(
            "{APPROVALS}\nadmit low {{\n  default => reject 503 \"broken\" retry_after 1s\n}}\nrollout {{\n  canary {{ tenants [gamma] duration 10m }}\n  rollback when error_rate > 2%\n}}\n"
        ),
        false,
        10,
    );
    let (s, p) = propose(&c, &base, "tok-alice", &broken).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let (s, v) = approve(&c, &base, &id, "bob", BOB, p["hash"].as_str().unwrap()).await;
    assert_eq!(s, 200, "{v}");
    wait_for(&c, &base, 5, "canary", |s| {
        s["rollout"]["stage"] == "canary"
    })
    .await;
    let mut failed = 0;
    for _ in 0..4 {
        let r = chat(&c, &base, "k-gamma").await;
        if r.status() == 503 {
            failed += 1;
        }
    }
    assert!(failed >= 3, "the canary should refuse gamma");
    let st = wait_for(&c, &base, 10, "the automatic rollback", |s| {
        !s["last_rollback"].is_null()
    })
    .await;
    let rb = &st["last_rollback"];
    assert_eq!(rb["trigger"], "automatic");
    assert_eq!(rb["condition"], "error_rate > 2%");
    assert!(
        rb["observed"][0].as_str().unwrap().contains("error_rate"),
        "{rb:#}"
    );
    assert_eq!(st["active"], json!(v1_version));
    assert!(st["rollout"].is_null());
    // Gamma is served by the last good policy again.
    let r = chat(&c, &base, "k-gamma").await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-kiln-canary").is_none());
    let (_, pv) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/admin/proposals/{id}"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(pv["state"], "rolled_back");
    assert!(pv["note"].as_str().unwrap().contains("error_rate > 2%"));
    let (ok, failed) = load_a.finish().await;
    assert!(ok > 0);
    assert_eq!(failed, 0);
    srv.stop().await;
    let rollback = audit_lines(&d)
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"] == "rollback")
        .expect("the rollback is audited");
    assert_eq!(rollback["actor"], "kiln");
    assert_eq!(rollback["details"]["condition"], "error_rate > 2%");
    assert_eq!(rollback["details"]["stage"], "canary");
    audit::verify_file(&d.join("audit.jsonl")).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// Issue #32: `rollback when tier(low).error_rate > 20%` read the
/// scheduler's window over all traffic, unguarded, and rolled a canary back
/// after its first 3 requests. It reads the canary's own requests, healthy
/// under `min_samples`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_condition_reads_only_the_canarys_own_requests_past_min_samples() {
    let d = dir("canary-min-samples");
    let mut cfg = config(&d);
    cfg.governance.min_samples = 20;
    // Both versions refuse beta's low-tier requests; the new one refuses
    // gamma's too, and gamma is its canary.
    let v1 = pol(
        &format!(
            "{APPROVALS}\nadmit low {{\n  when tenant == beta => reject 503 \"down\" retry_after 1s\n  default => accept\n}}\n"
        ),
        false,
        10,
    );
    let srv = serve(&v1, cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let broken = pol(
        &format!(
            "{APPROVALS}\nadmit low {{\n  default => reject 503 \"broken\" retry_after 1s\n}}\nrollout {{\n  canary {{ tenants [gamma] duration 10m }}\n  rollback when tier(low).error_rate > 20%\n}}\n"
        ),
        false,
        10,
    );
    let (s, p) = propose(&c, &base, "tok-alice", &broken).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let (s, v) = approve(&c, &base, &id, "bob", BOB, p["hash"].as_str().unwrap()).await;
    assert_eq!(s, 200, "{v}");
    wait_for(&c, &base, 5, "canary", |s| {
        s["rollout"]["stage"] == "canary"
    })
    .await;
    let healthy = |s: &Value, what: &str| {
        assert_eq!(s["rollout"]["stage"], "canary", "{what}: {s:#}");
        assert!(s["last_rollback"].is_null(), "{what}: {s:#}");
        assert_eq!(
            s["rollout"]["conditions"][0]["holds"], false,
            "{what}: {s:#}"
        );
    };
    // Failing requests the active version decided never count.
    for _ in 0..30 {
        assert_eq!(chat(&c, &base, "k-beta").await.status(), 503);
    }
    // Fewer failing canary requests than min_samples read as healthy,
    // however many there are below it.
    for n in 1..=19 {
        assert_eq!(chat(&c, &base, "k-gamma").await.status(), 503);
        if matches!(n, 1 | 3 | 19) {
            // A few of the governance's 100 ms ticks.
            tokio::time::sleep(Duration::from_millis(350)).await;
            healthy(&status(&c, &base).await, &format!("{n} canary requests"));
        }
    }
    // The 20th failing canary request trips it.
    assert_eq!(chat(&c, &base, "k-gamma").await.status(), 503);
    let st = wait_for(&c, &base, 10, "the automatic rollback", |s| {
        !s["last_rollback"].is_null()
    })
    .await;
    assert_eq!(
        st["last_rollback"]["condition"],
        "tier(low).error_rate > 20%"
    );
    assert_eq!(st["last_rollback"]["trigger"], "automatic");
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_after_activation_automatic_and_under_approval_rules() {
    let d = dir("rollbacks");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let v1_version = status(&c, &base).await["active"]
        .as_str()
        .unwrap()
        .to_string();
    // Nothing to return to yet.
    let (s, _) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/rollback"),
        Some("tok-ops"),
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 409);
    // No shadow, no canary: enforced at once, then watched for 40 s.
    let broken = pol(
        &format!(
            "{APPROVALS}\nadmit low {{\n  default => reject 503 \"broken\" retry_after 1s\n}}\nrollout {{\n  rollback when error_rate > 2%\n}}\n"
        ),
        false,
        10,
    );
    let (s, p) = propose(&c, &base, "tok-alice", &broken).await;
    assert_eq!(s, 201, "{p}");
    let (s, _) = approve(
        &c,
        &base,
        p["id"].as_str().unwrap(),
        "bob",
        BOB,
        p["hash"].as_str().unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    let st = wait_for(&c, &base, 5, "activation", |s| {
        s["rollout"]["stage"] == "watch"
    })
    .await;
    assert_ne!(st["active"], json!(v1_version));
    for _ in 0..4 {
        assert_eq!(chat(&c, &base, "k-gamma").await.status(), 503);
    }
    let st = wait_for(&c, &base, 10, "the rollback after activation", |s| {
        s["active"] == json!(v1_version)
    })
    .await;
    assert_eq!(st["last_rollback"]["trigger"], "automatic");
    assert_eq!(chat(&c, &base, "k-gamma").await.status(), 200);

    // A good change (the low tier's priority lowered, no escalation),
    // then a manual rollback: the rules in force (`any`) want one platform
    // approval for it.
    let good = pol(APPROVALS, false, 5);
    let (s, p) = propose(&c, &base, "tok-alice", &good).await;
    assert_eq!(s, 201, "{p}");
    approve(
        &c,
        &base,
        p["id"].as_str().unwrap(),
        "bob",
        BOB,
        p["hash"].as_str().unwrap(),
    )
    .await;
    let st = wait_for(&c, &base, 5, "the good change", |s| {
        s["active"] != json!(v1_version)
    })
    .await;
    let v2 = st["active"].clone();
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/rollback"),
        Some("tok-carol"),
        Some(json!({"reason": "test"})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    let rp = &v["proposal"];
    assert_eq!(rp["kind"], "rollback");
    assert_eq!(rp["version"], json!(v1_version));
    assert_eq!(rp["change_kinds"], json!(["rollback"]));
    let rid = rp["id"].as_str().unwrap().to_string();
    // carol asked for it; carol is no platform approver: alice approves.
    let (s, v) = approve(
        &c,
        &base,
        &rid,
        "alice",
        ALICE,
        rp["hash"].as_str().unwrap(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let st = wait_for(&c, &base, 5, "the manual rollback", |s| {
        s["active"] == json!(v1_version)
    })
    .await;
    assert_eq!(st["last_rollback"]["trigger"], "manual");
    assert_eq!(st["last_rollback"]["from"], v2);
    assert_eq!(st["last_rollback"]["by"], "carol");
    srv.stop().await;
    let kinds = audit_kinds(&d);
    assert_eq!(
        kinds.iter().filter(|k| *k == "rollback").count(),
        2,
        "{kinds:?}"
    );
    audit::verify_file(&d.join("audit.jsonl")).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_throttle_expire_by_themselves_and_show_everywhere() {
    let d = dir("overrides");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let url = format!("{base}/admin/overrides");
    // Unknown tier; no token.
    let (s, _) = call(
        &c,
        reqwest::Method::POST,
        url.clone(),
        Some("tok-ops"),
        Some(json!({"scope": "tier", "name": "nope", "action": "pause", "for": "1m"})),
    )
    .await;
    assert_eq!(s, 404);
    let (s, _) = call(
        &c,
        reqwest::Method::POST,
        url.clone(),
        None,
        Some(json!({"scope": "tier", "name": "low", "action": "pause", "for": "1m"})),
    )
    .await;
    assert_eq!(s, 401);
    // Pause the low tier for 60 s of gateway time (6 s here).
    let (s, v) = call(&c, reqwest::Method::POST, url.clone(), Some("tok-ops"), Some(json!({"scope": "tier", "name": "low", "action": "pause", "for": "60s", "reason": "incident 7"}))).await;
    assert_eq!(s, 201, "{v}");
    let r = chat(&c, &base, "k-gamma").await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "paused");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("incident 7"));
    assert_eq!(chat(&c, &base, "k-alpha").await.status(), 200);
    let (_, q) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/admin/queues"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(q["overrides"][0]["name"], "low");
    assert_eq!(q["overrides"][0]["action"], "pause");
    assert!(q["replicas"].is_array());
    let st = status(&c, &base).await;
    assert_eq!(st["overrides"][0]["by"], "ops");
    assert!(st["overrides"][0]["refused"].as_u64().unwrap() >= 1);
    // Throttle a tenant to 50%: every other request is admitted.
    let (s, v) = call(&c, reqwest::Method::POST, url.clone(), Some("tok-ops"), Some(json!({"scope": "tenant", "name": "alpha", "action": "throttle", "percent": 50.0, "for": "1h"}))).await;
    assert_eq!(s, 201, "{v}");
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(chat(&c, &base, "k-alpha").await.status().as_u16());
    }
    assert_eq!(codes, [200, 429, 200, 429]);
    let (s, _) = call(
        &c,
        reqwest::Method::DELETE,
        format!("{base}/admin/overrides/tenant/alpha"),
        Some("tok-ops"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(chat(&c, &base, "k-alpha").await.status(), 200);
    // The pause ends by itself.
    wait_for(&c, &base, 20, "the pause to expire", |s| {
        s["overrides"].as_array().unwrap().is_empty()
    })
    .await;
    assert_eq!(chat(&c, &base, "k-gamma").await.status(), 200);
    // The driver removes it and audits that it expired.
    let t0 = Instant::now();
    while !audit_kinds(&d).iter().any(|k| k == "override_expired") {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the expiry was not audited"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    srv.stop().await;
    let kinds = audit_kinds(&d);
    for k in ["override", "override_lifted", "override_expired"] {
        assert!(kinds.iter().any(|x| x == k), "no {k} in {kinds:?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_approvers_the_direct_swap_stays_and_is_audited() {
    let d = dir("open");
    let text = format!(
        "[audit]\npath = \"{}\"\n[sim]\nspeed = {SPEED}\n",
        d.join("audit.jsonl").display()
    );
    let srv = serve(&v1(), ServerConfig::parse("t", &text).unwrap()).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    // No admin tokens: admin is open on loopback.
    let (_, st) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/admin/status"),
        None,
        None,
    )
    .await;
    assert_eq!(st["governance"], false);
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/policy"),
        None,
        Some(json!({"files": {"p.kiln": pol("", true, 10)}})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // A failed activation leaves the last good policy serving.
    let (s, _) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/policy"),
        None,
        Some(json!({"files": {"p.kiln": "tier {"}})),
    )
    .await;
    assert_eq!(s, 422);
    assert_eq!(
        chat(&c, &base, "k-beta").await.headers()["x-kiln-tier"],
        "high"
    );
    // Rollback needs no approval here.
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/rollback"),
        None,
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        chat(&c, &base, "k-beta").await.headers()["x-kiln-tier"],
        "low"
    );
    srv.stop().await;
    let kinds = audit_kinds(&d);
    // The first entry records the gateway's identity (approvals sign it).
    assert_eq!(
        kinds,
        ["gateway", "activation", "activation_refused", "rollback"]
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_proposes_approves_and_reports() {
    let d = dir("cli");
    let kiln = env!("CARGO_BIN_EXE_kiln");
    // keygen: a 0600 secret and the public key printed.
    let out = std::process::Command::new(kiln)
        .args(["keygen", "--out"])
        .arg(d.join("dave"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dave_pub = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(dave_pub.len(), 64);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join("dave.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let mut cfg = config(&d);
    let extra = ServerConfig::parse(
        "t",
        &format!(
            "[[admin.tokens]]\nname = \"x\"\nsha256 = \"{}\"\n[[approvers]]\nname = \"dave\"\ngroups = [\"platform\"]\npublic_key = \"{dave_pub}\"\n",
            hash_secret("tok-x")
        ),
    )
    .unwrap();
    cfg.approvers.extend(extra.approvers);
    let srv = serve(&v1(), cfg).await;
    let base = format!("http://{}", srv.addr);
    // The low tier's priority lowered: no escalation, one platform approval.
    std::fs::write(d.join("policy.kiln"), pol(APPROVALS, false, 5)).unwrap();
    let run = |args: Vec<String>, token: &str| {
        let token = token.to_string();
        let base = base.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
                    .args(&args)
                    .env("KILN_SERVER", &base)
                    .env("KILN_ADMIN_TOKEN", &token)
                    .env("NO_COLOR", "1")
                    .output()
                    .unwrap()
            })
            .await
            .unwrap()
        }
    };
    let p = d.join("policy.kiln").display().to_string();
    let out = run(vec!["propose".into(), p.clone()], "tok-alice").await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("proposal p-1 (change) by alice"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[missing] 0 of 1 from \"platform\""),
        "{stdout}"
    );
    assert!(stdout.contains("kiln approve --server URL p-1"), "{stdout}");
    let out = run(vec!["status".into()], "tok-ops").await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(stdout.contains("p-1"), "{stdout}");
    assert!(stdout.contains("missing 1 from \"platform\""), "{stdout}");
    // A bad policy: exit 1, its diagnostics shown.
    std::fs::write(d.join("bad.kiln"), "tier x { priority }").unwrap();
    let out = run(
        vec!["propose".into(), d.join("bad.kiln").display().to_string()],
        "tok-alice",
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not compile"));
    // dave approves with his key file: the change is enforced.
    let key = d.join("dave.key").display().to_string();
    let out = run(
        vec!["approve".into(), "p-1".into(), "--key".into(), key.clone()],
        "tok-ops",
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = client();
    wait_for(&c, &base, 5, "activation", |s| !s["previous"].is_null()).await;
    // Approving again is refused: exit 1.
    let out = run(
        vec!["approve".into(), "p-1".into(), "--key".into(), key],
        "tok-ops",
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    // pause / resume
    let out = run(
        vec![
            "pause".into(),
            "tier".into(),
            "low".into(),
            "--for".into(),
            "30m".into(),
        ],
        "tok-ops",
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(vec!["status".into()], "tok-ops").await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(stdout.contains("pause tier low"), "{stdout}");
    let out = run(
        vec![
            "throttle".into(),
            "tenant".into(),
            "gamma".into(),
            "--to".into(),
            "10%".into(),
            "--for".into(),
            "1h".into(),
        ],
        "tok-ops",
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(
        vec!["resume".into(), "tier".into(), "low".into()],
        "tok-ops",
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    // rollback: the rules in force want one platform approval.
    let out = run(vec!["rollback".into()], "tok-ops").await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0));
    assert!(
        stdout.contains("require approval for a rollback"),
        "{stdout}"
    );
    // Unreachable server: exit 2.
    let out = tokio::task::spawn_blocking(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["status", "--server", "http://127.0.0.1:1"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}

// --- human formats ---------------------------------------------------

fn sample_proposal() -> ProposalView {
    serde_json::from_value(json!({
        "id": "p-3", "kind": "change", "state": "pending",
        "hash": "3f5c0e9d2b1a4c6e8f7d9b0a1c2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e",
        "version": "sha256:3f5c0e9d2b1a", "base": "sha256:0a1b2c3d4e5f",
        "proposer": "alice", "created_unix_ms": 1767225600000u64, "revision": 1,
        "change_kinds": ["priority_increase", "tier_change"], "escalations": ["priority_increase"],
        "changes_total": 2,
        "changes": [
            {"op": "changed", "subject": "tier batch", "field": "priority", "old": "40", "new": "60", "kind": "priority_increase", "escalation": true},
            {"op": "changed", "subject": "classify", "field": "rule", "old": "#3 when tenant == evals => tier background", "new": "#3 when tenant == evals => tier batch", "kind": "tier_change", "escalation": false}
        ],
        "decisions_changed": 4,
        "needs": [
            {"count": 2, "group": "platform-leads", "kinds": ["priority_increase"], "rule": "require 2 from \"platform-leads\" for [priority_increase, quota_increase, preemption_change]", "source": "policy", "have": ["bob"], "missing": 1},
            {"count": 1, "group": "platform", "kinds": ["priority_increase", "tier_change"], "rule": "require 1 from \"platform\" for [any]", "source": "policy", "have": ["bob"], "missing": 0}
        ],
        "approvals": [{"approver": "bob", "groups": ["platform", "platform-leads"], "expires": 1767229200u64, "valid": true}],
        "dry_run": {"records": 1834, "changed": 211, "by_kind": {"tier": 211, "admission": 12},
            "transitions": [{"kind": "tier", "old": "background", "new": "batch", "count": 211}],
            "impact": [{"scope": "tier:batch", "metric": "ttft_p95_ms", "old": 812.5, "new": 1204.0, "delta": 391.5}]},
        "rollout": {"shadow_ms": 3600000.0, "canary": {"share": 5.0, "tenants": ["query-rewrite"], "duration_ms": 7200000.0},
            "watch_ms": 1800000.0,
            "rollbacks": [{"text": "tier(interactive).ttft_p95 > 2500ms", "hold_ms": 300000.0}, {"text": "error_rate > 2%", "hold_ms": null}]}
    }))
    .unwrap()
}

#[test]
fn propose_report_for_people() {
    insta::assert_snapshot!(render_proposal(&sample_proposal()));
}

#[test]
fn status_for_people() {
    let mut open = sample_proposal();
    open.changes.clear();
    open.dry_run = None;
    let s: StatusView = serde_json::from_value(json!({
        "active": "sha256:0a1b2c3d4e5f", "previous": "sha256:99aa88bb77cc",
        "governance": true, "approvers": ["alice", "bob", "carol"],
        "audit": {"path": "/var/lib/kiln/audit.jsonl", "entries": 42, "head": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        "rollout": {"proposal": "p-2", "version": "sha256:5e6f7a8b9c0d", "stage": "canary", "elapsed_s": 754.0, "remaining_s": 6446.0,
            "canary": {"name": "batch-8b", "share": 10.0, "tiers": ["batch"], "models": ["llama-8b"], "duration_ms": 7200000.0,
                "gates": [{"text": "tier(batch).slo_attainment > 95%", "hold_ms": 1800000.0}]},
            "stage_number": 2, "stages": 3,
            "gates": [{"text": "tier(batch).slo_attainment > 95%", "hold_s": 1800.0, "holds": false, "held_s": null,
                "observed": ["tier(batch).slo_attainment > 95% (now 100%)", "tier(batch) has 12 of 20 samples"]}],
            "canary_requests": 1289,
            "shadow": {"decided": 51234, "differ": 2101, "by_field": {"route": 1800, "tier": 301}, "samples": []},
            "conditions": [
                {"text": "tier(interactive).ttft_p95 > 2500ms", "hold_s": 300.0, "holds": true, "held_s": 42.0, "observed": ["tier(interactive).ttft_p95 > 2500ms (now 2.8s)"]},
                {"text": "error_rate > 2%", "hold_s": null, "holds": false, "held_s": null, "observed": ["error_rate > 2% (now 0.4%)"]}
            ],
            "live": {"window_s": 60.0, "requests": 1289, "errors": 5, "error_rate": 0.388,
                "tiers": {"interactive": {"requests": 1200, "ttft_p95_ms": 2810.0, "e2e_p95_ms": 3900.0, "slo_attainment": 91.25},
                          "batch": {"requests": 12, "ttft_p95_ms": null, "e2e_p95_ms": 61000.0, "slo_attainment": 100.0}}},
            "min_samples": 20},
        "proposals": [open],
        "overrides": [{"id": 1, "scope": "tier", "name": "background", "action": "pause", "percent": null, "remaining_s": 1080.0, "by": "carol", "reason": "incident 42", "refused": 17},
                      {"id": 2, "scope": "tenant", "name": "analytics", "action": "throttle", "percent": 10.0, "remaining_s": 3599.0, "by": "carol", "reason": null, "refused": 230}],
        "last_rollback": {"at_unix_ms": 1767225600000u64, "from": "sha256:77dd66ee55ff", "to": "sha256:0a1b2c3d4e5f", "trigger": "automatic", "condition": "error_rate > 2%", "observed": [], "by": "kiln"}
    }))
    .unwrap();
    insta::assert_snapshot!(render_status(&s));
}

// --- governance state across restarts --------------------------------

fn state_file(d: &Path) -> PathBuf {
    d.join("audit.jsonl.state.json")
}

fn find_proposal<'a>(st: &'a Value, id: &str) -> Option<&'a Value> {
    st["proposals"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["id"] == id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_proposals_and_their_approvals_survive_a_restart() {
    let d = dir("persist");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let v1_version = status(&c, &base).await["active"].clone();
    // An escalation: bob (platform, platform-leads) and carol needed.
    let (s, p) = propose(&c, &base, "tok-alice", &pol(APPROVALS, false, 50)).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let hash = p["hash"].as_str().unwrap().to_string();
    let (s, v) = approve(&c, &base, &id, "bob", BOB, &hash).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "pending");
    srv.stop().await;
    assert!(state_file(&d).exists());

    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let st = status(&c, &base).await;
    let p = find_proposal(&st, &id).unwrap_or_else(|| panic!("{st:#}"));
    assert_eq!(p["state"], "pending");
    assert_eq!(p["hash"], json!(hash));
    assert_eq!(p["approvals"][0]["approver"], "bob");
    assert!(p["needs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["group"] == "platform-leads" && n["have"] == json!(["bob"])));
    let view: StatusView = serde_json::from_value(st.clone()).unwrap();
    assert!(render_status(&view).contains(&id));
    // The same signature again is still refused.
    let (s, _) = approve(&c, &base, &id, "bob", BOB, &hash).await;
    assert_ne!(s, 200);
    // The second approval activates it.
    let (s, v) = approve(&c, &base, &id, "carol", CAROL, &hash).await;
    assert_eq!(s, 200, "{v}");
    let st = wait_for(&c, &base, 10, "activation after restart", |s| {
        s["active"] != v1_version
    })
    .await;
    assert_eq!(st["previous"], v1_version);
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_state_file_does_not_smuggle_a_proposal_in() {
    let d = dir("tampered-state");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let v1_version = status(&c, &base).await["active"].clone();
    let (s, p) = propose(&c, &base, "tok-alice", &pol(APPROVALS, false, 50)).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let hash = p["hash"].as_str().unwrap().to_string();
    let (s, _) = approve(&c, &base, &id, "bob", BOB, &hash).await;
    assert_eq!(s, 200);
    srv.stop().await;
    // Someone swaps the text under the recorded hash and approvals.
    let mut state: Value =
        serde_json::from_str(&std::fs::read_to_string(state_file(&d)).unwrap()).unwrap();
    state["proposals"][0]["files"]["policy.kiln"] = json!(pol(APPROVALS, false, 99));
    std::fs::write(state_file(&d), state.to_string()).unwrap();

    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let st = status(&c, &base).await;
    assert!(find_proposal(&st, &id).is_none(), "{st:#}");
    let (s, _) = approve(&c, &base, &id, "carol", CAROL, &hash).await;
    assert_eq!(s, 404);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(status(&c, &base).await["active"], v1_version);
    srv.stop().await;
    assert!(audit_kinds(&d).iter().any(|k| k == "proposal_dropped"));
    assert!(audit::verify_file(&d.join("audit.jsonl")).is_ok());

    // A file that is not state at all stops the gateway from starting.
    std::fs::write(state_file(&d), "{ not json").unwrap();
    let err = start(ServeOptions {
        policy: policy(&v1()),
        config: config(&d),
        listen: "127.0.0.1:0".into(),
        clock: None,
    })
    .await
    .err()
    .expect("a corrupt state file is a startup error");
    assert!(err.to_string().contains("move it aside"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollback_history_survives_a_restart() {
    let d = dir("persist-history");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let v1_version = status(&c, &base).await["active"].clone();
    // No escalation: bob's one platform approval enforces it.
    let good = pol(APPROVALS, false, 5);
    let (s, p) = propose(&c, &base, "tok-alice", &good).await;
    assert_eq!(s, 201, "{p}");
    let (s, _) = approve(
        &c,
        &base,
        p["id"].as_str().unwrap(),
        "bob",
        BOB,
        p["hash"].as_str().unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    let st = wait_for(&c, &base, 10, "activation", |s| s["active"] != v1_version).await;
    let good_version = st["active"].clone();
    srv.stop().await;

    // Restarted on the version it ran: v1 is still the one to return to.
    let srv = serve(&good, config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let st = status(&c, &base).await;
    assert_eq!(st["active"], good_version);
    assert_eq!(st["previous"], v1_version, "{st:#}");
    let (s, r) = call(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/rollback"),
        Some("tok-ops"),
        Some(json!({"reason": "after restart"})),
    )
    .await;
    assert_eq!(s, 202, "{r}");
    // The id counter survived too: no id is reused.
    assert_eq!(r["proposal"]["id"], "p-2");
    let (s, _) = approve(
        &c,
        &base,
        r["proposal"]["id"].as_str().unwrap(),
        "bob",
        BOB,
        r["proposal"]["hash"].as_str().unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    wait_for(&c, &base, 10, "the rollback", |s| s["active"] == v1_version).await;
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}
