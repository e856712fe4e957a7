//! Attacks on governance, each mounted against `kiln serve` (in-process on
//! 127.0.0.1:0) over HTTP or on its files, each asserting the refusal (its
//! status and error code) and that the active policy did not change.
//!
//! Covered in `tests/governance.rs` and not repeated here: unauthenticated
//! and wrong-token admin calls, the direct swap with approvals on
//! (`approval_required`), self-approval under the same name, an approval of
//! another hash, a wrong key, an unknown approver, an approval moved from
//! another proposal, expired and too-long approvals, a second approval by
//! the same approver, a replayed signature, revision voiding approvals, a
//! proposal that lowers the approval rules, and an audit log edited,
//! reordered or with lines deleted (`approvals_are_bound_to_hash_proposal_and_approver`);
//! an edited state file (`an_edited_state_file_does_not_smuggle_a_proposal_in`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use ed25519_dalek::SigningKey;
use kiln::governance::audit;
use kiln::governance::keys::{public_hex, sign, SignedApproval, Target};
use kiln::server::config::{hash_secret, ServerConfig};
use kiln::server::{start, Running, ServeOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SPEED: f64 = 10.0;

const APPROVALS: &str = r#"
approval {
  require 2 from "platform-leads" for [priority_increase, quota_increase, preemption_change]
  require 1 from "platform" for any
}
"#;

fn pol(extra: &str, low_priority: u32) -> String {
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
tenant gamma {{ owner "c@x" tiers [low] api_keys ["k-gamma"] }}
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
    pol("", 10)
}

/// An ordinary change (one approval from "platform").
fn v2() -> String {
    pol("", 10) + "\n# v2\n"
}

fn key(n: u8) -> SigningKey {
    SigningKey::from_bytes(&[n; 32])
}

const ALICE: u8 = 1;
const BOB: u8 = 2;
const CAROL: u8 = 3;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-attack-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Tokens: tok-alice-laptop (alice's, named otherwise than her approver
/// entry), tok-bob, tok-ops, and an unnamed `token_sha256` tok-legacy;
/// approvers alice (platform), bob (platform, platform-leads), carol
/// (platform-leads).
fn config_text(d: &Path) -> String {
    let mut t = format!(
        "[admin]\ntoken_sha256 = [\"{}\"]\n",
        hash_secret("tok-legacy")
    );
    t.push_str(&format!(
        "[[admin.tokens]]\nname = \"alice-laptop\"\nperson = \"alice\"\nsha256 = \"{}\"\n",
        hash_secret("tok-alice-laptop")
    ));
    for n in ["bob", "ops"] {
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
        "[governance]\nwatch = \"40s\"\napproval_ttl = \"2h\"\n[audit]\npath = \"{}\"\n[sim]\nspeed = {SPEED}\n",
        d.join("audit.jsonl").display(),
    ));
    t
}

fn config(d: &Path) -> ServerConfig {
    ServerConfig::parse("test.toml", &config_text(d)).unwrap()
}

async fn try_serve(text: &str, cfg: ServerConfig) -> Result<Running, String> {
    start(ServeOptions {
        policy: support::policy("policy.kiln", text),
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: None,
    })
    .await
    .map_err(|e| format!("{:?}", miette::Report::new(e)))
}

async fn serve(text: &str, cfg: ServerConfig) -> Running {
    support::serve_on_loopback(support::policy("policy.kiln", text), cfg).await
}

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(30))
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

async fn get(c: &reqwest::Client, base: &str, path: &str) -> Value {
    let (s, v) = call(
        c,
        reqwest::Method::GET,
        format!("{base}{path}"),
        "tok-ops",
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v
}

async fn status(c: &reqwest::Client, base: &str) -> Value {
    get(c, base, "/admin/status").await
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A signed approval of proposal `id` as `kiln approve` makes it.
async fn signed(c: &reqwest::Client, base: &str, id: &str, name: &str, k: u8) -> SignedApproval {
    let p = get(c, base, &format!("/admin/proposals/{id}")).await;
    let t = Target {
        gateway: p["gateway"].as_str().unwrap(),
        proposal: id,
        nonce: p["nonce"].as_str().unwrap(),
    };
    let hash = p["hash"].as_str().unwrap();
    sign(&key(k), &t, hash, name, now_s(), now_s() + 600)
}

async fn present(c: &reqwest::Client, base: &str, id: &str, a: &Value) -> (u16, Value) {
    call(
        c,
        reqwest::Method::POST,
        format!("{base}/admin/proposals/{id}/approvals"),
        "tok-ops",
        Some(a.clone()),
    )
    .await
}

fn code(v: &Value) -> Option<&str> {
    v["error"]["code"].as_str()
}

fn audit_entries(d: &Path) -> Vec<Value> {
    std::fs::read_to_string(d.join("audit.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn kiln_audit_verify(path: &Path) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["audit", "verify"])
        .arg(path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Finding 1: the proposer is a person, not a token name. A proposal made
/// with the unnamed `token_sha256` token (identity `admin`) is refused
/// outright; one made with a token named otherwise than its holder's
/// approver entry is still the holder's, and they cannot approve it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proposer_never_approves_whatever_token_they_used() {
    let d = dir("self");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let active = status(&c, &base).await["active"].clone();

    let (s, v) = propose(&c, &base, "tok-legacy", &v2()).await;
    assert_eq!((s, code(&v)), (403, Some("unnamed_token")), "{v}");

    let (s, p) = propose(&c, &base, "tok-alice-laptop", &v2()).await;
    assert_eq!(s, 201, "{p}");
    assert_eq!(p["proposer"], "alice");
    let id = p["id"].as_str().unwrap().to_string();
    let a = signed(&c, &base, &id, "alice", ALICE).await;
    let (s, v) = present(&c, &base, &id, &serde_json::to_value(&a).unwrap()).await;
    assert_eq!((s, code(&v)), (403, Some("self_approval")), "{v}");

    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = status(&c, &base).await;
    assert_eq!(st["active"], active, "the active policy changed");
    assert_eq!(st["proposals"][0]["state"], "pending");
    assert_eq!(st["proposals"][0]["approvals"], json!([]));
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 1: two approver entries with one public key (one person
/// counting twice) stop the gateway from starting, with a help line.
#[test]
fn one_key_for_two_approvers_is_refused_at_startup() {
    let d = dir("dupkey");
    let bob = public_hex(&key(BOB).verifying_key());
    let text = config_text(&d).replace(
        &public_hex(&key(CAROL).verifying_key()),
        &bob.to_uppercase(),
    );
    let e = ServerConfig::parse("kiln.toml", &text).unwrap_err();
    assert!(e.to_string().contains("same public key"), "{e}");
    let help = miette::Diagnostic::help(&e).unwrap().to_string();
    assert!(help.contains("their own key"), "{help}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 2: the state file moved aside (as its diagnostic advises), old
/// signatures from the audit log approve nothing: ids continue from the
/// audit log and every proposal signs under a fresh nonce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_signatures_approve_nothing_after_the_state_file_is_lost() {
    let d = dir("replay");
    let esc = pol("", 50); // an escalation: two leads and one platform approver
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let active = status(&c, &base).await["active"].clone();
    let (s, p) = propose(&c, &base, "tok-alice-laptop", &esc).await;
    assert_eq!(s, 201, "{p}");
    let old_id = p["id"].as_str().unwrap().to_string();
    let a = signed(&c, &base, &old_id, "bob", BOB).await;
    let (s, v) = present(&c, &base, &old_id, &serde_json::to_value(&a).unwrap()).await;
    assert_eq!(s, 200, "{v}");
    srv.stop().await;

    let state = d.join("audit.jsonl.state.json");
    std::fs::rename(&state, d.join("state.corrupt")).unwrap();
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let (s, p) = propose(&c, &base, "tok-alice-laptop", &esc).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    assert_ne!(id, old_id, "a proposal id was handed out twice");
    let replays: Vec<Value> = audit_entries(&d)
        .into_iter()
        .filter(|e| e["kind"] == "approval")
        .map(|e| {
            let x = &e["details"];
            json!({"approver": x["approver"], "hash": x["hash"], "issued": x["issued"],
                   "expires": x["expires"], "signature": x["signature"]})
        })
        .collect();
    assert_eq!(replays.len(), 1);
    for r in &replays {
        let (s, v) = present(&c, &base, &id, r).await;
        assert_eq!((s, code(&v)), (403, Some("bad_signature")), "{v}");
        let (s, v) = present(&c, &base, &old_id, r).await;
        assert_eq!((s, code(&v)), (404, Some("not_found")), "{v}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = status(&c, &base).await;
    assert_eq!(st["active"], active, "the active policy changed");
    assert_eq!(st["proposals"][0]["approvals"], json!([]));
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 3: a torn last line (an append cut short by a crash) is
/// truncated on start, and the audit log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_last_audit_line_is_truncated_and_audited() {
    let d = dir("torn");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let active = status(&c, &base).await["active"].clone();
    let (s, p) = propose(&c, &base, "tok-alice-laptop", &v2()).await;
    assert_eq!(s, 201, "{p}");
    srv.stop().await;
    let path = d.join("audit.jsonl");
    let before = audit_entries(&d).len();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"actor\":\"kiln\",\"at\":17").unwrap();
    drop(f);

    let srv = try_serve(&v1(), config(&d)).await.unwrap();
    let base = format!("http://{}", srv.addr);
    let st = status(&c, &base).await;
    assert_eq!(st["active"], active);
    assert_eq!(st["proposals"][0]["id"], p["id"], "the proposal survived");
    srv.stop().await;
    let entries = audit_entries(&d);
    assert_eq!(entries.len(), before + 1);
    let last = entries.last().unwrap();
    assert_eq!(last["kind"], "audit_recovered");
    assert_eq!(last["details"]["reason"], "torn_last_line");
    let (code, err) = kiln_audit_verify(&path);
    assert_eq!(code, 0, "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Rewrites the audit log at `path` with `edit` applied to entry `at` (0
/// based) and every hash after it recomputed: a chain that verifies alone.
fn rewrite(path: &Path, at: usize, edit: impl Fn(&mut Value)) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut prev = audit::GENESIS.to_string();
    let mut out = String::new();
    for (i, l) in text.lines().enumerate() {
        let mut v: Value = serde_json::from_str(l).unwrap();
        if i == at {
            edit(&mut v);
        }
        v["prev_hash"] = json!(prev);
        let h = audit::entry_hash(&v);
        v["hash"] = json!(h);
        prev = h;
        out.push_str(&audit::canonical(&v));
        out.push('\n');
    }
    std::fs::write(path, out).unwrap();
}

/// Finding 3: an audit log rewritten with recomputed hashes (or cut short)
/// passes a bare chain check, but not the head recorded beside it: the
/// gateway refuses to start on it and `kiln audit verify` fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewritten_audit_log_is_caught_by_its_recorded_head() {
    let d = dir("rewrite");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let (s, p) = propose(&c, &base, "tok-alice-laptop", &v2()).await;
    assert_eq!(s, 201, "{p}");
    srv.stop().await;
    let path = d.join("audit.jsonl");
    let good = std::fs::read_to_string(&path).unwrap();
    assert_eq!(kiln_audit_verify(&path).0, 0);

    let at = audit_entries(&d)
        .iter()
        .position(|e| e["kind"] == "proposal")
        .unwrap();
    rewrite(&path, at, |v| v["actor"] = json!("mallory"));
    assert!(
        audit::verify_file(&path).is_ok(),
        "the chain alone verifies"
    );
    let (code, err) = kiln_audit_verify(&path);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("head"), "{err}");
    let e = try_serve(&v1(), config(&d)).await.err().unwrap();
    assert!(e.contains("head"), "{e}");

    // Cut short: the last entry removed.
    let mut lines: Vec<&str> = good.lines().collect();
    lines.pop();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    assert_eq!(kiln_audit_verify(&path).0, 1);
    assert!(try_serve(&v1(), config(&d)).await.is_err());
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 3: a proposal approved and mid-rollout when the gateway dies
/// (the state file as the last step left it, as after `kill -9`) is not
/// forgotten: the restart audits what became of it and starts it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_cut_by_a_crash_is_audited_and_started_again() {
    let d = dir("crash");
    let staged = pol(
        "rollout {\n  shadow 40s\n  rollback when error_rate > 50%\n}\n",
        10,
    ) + "# staged\n";
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let active = status(&c, &base).await["active"].clone();
    let (s, p) = propose(&c, &base, "tok-alice-laptop", &staged).await;
    assert_eq!(s, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_string();
    let a = signed(&c, &base, &id, "bob", BOB).await;
    let (s, v) = present(&c, &base, &id, &serde_json::to_value(&a).unwrap()).await;
    assert_eq!(s, 200, "{v}");
    let t0 = Instant::now();
    while status(&c, &base).await["rollout"]["stage"] != "shadow" {
        assert!(t0.elapsed() < Duration::from_secs(10), "no shadow");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The state file is as the last step wrote it; nothing more is saved
    // on the way down.
    let state = std::fs::read(d.join("audit.jsonl.state.json")).unwrap();
    srv.stop().await;
    std::fs::write(d.join("audit.jsonl.state.json"), state).unwrap();

    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let t0 = Instant::now();
    let st = loop {
        let st = status(&c, &base).await;
        if st["rollout"]["proposal"] == json!(id) {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not resumed: {st:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(st["rollout"]["stage"], "shadow");
    assert_eq!(st["active"], active, "nothing was enforced on the way");
    srv.stop().await;
    let e = audit_entries(&d)
        .into_iter()
        .find(|e| e["kind"] == "rollout_interrupted")
        .expect("no rollout_interrupted entry");
    assert_eq!(e["details"]["id"], json!(id));
    assert_eq!(e["details"]["outcome"], "restarted");
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 3: an override longer than `[governance] max_override` (24h by
/// default) is refused; a 0% throttle admits nothing, not even the first
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_are_bounded_and_a_zero_throttle_admits_nothing() {
    let d = dir("overrides");
    let srv = serve(&v1(), config(&d)).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let active = status(&c, &base).await["active"].clone();
    let url = format!("{base}/admin/overrides");
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        url.clone(),
        "tok-ops",
        Some(json!({"scope": "tier", "name": "low", "action": "pause", "for": "87600h"})),
    )
    .await;
    assert_eq!((s, code(&v)), (403, Some("override_too_long")), "{v}");
    let st = status(&c, &base).await;
    assert_eq!(st["overrides"], json!([]));
    assert_eq!(st["active"], active);

    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        url,
        "tok-ops",
        Some(json!({"scope": "tier", "name": "low", "action": "throttle", "percent": 0, "for": "1h"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    for _ in 0..3 {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-gamma")
            .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 429, "a 0% throttle admitted a request");
    }
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&d);
}
