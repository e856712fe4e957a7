//! Day two with keys: `x-ratelimit-*` headers for the binding quota, quota
//! refusals that name the quota, keys reloaded from `kiln.toml` without a
//! restart (SIGHUP, the file changing, `POST /admin/keys/reload`), key
//! expiry, and `kiln keys` editing the file. Gateways on 127.0.0.1:0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::time::Duration;
use support::TempDir;
use support::{policy, serve_on_loopback};

const QUOTAS: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 4 }
}
tier main { priority 10 slo { p95 600s } quota { tokens 1M/min } }
tenant beta {
  owner "b@x"
  tiers [main]
  quota { requests 2/min tokens 50k/min }
  api_keys ["k-beta"]
}
tenant gamma {
  owner "g@x"
  tiers [main]
  quota { tokens 100/min }
  api_keys ["k-gamma"]
}
classify { default => tier main }
route main tiny { default => fp16 }
"#;

fn client() -> reqwest::Client {
    support::client(Duration::from_secs(60))
}

fn chat(max_tokens: u64) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens})
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_carry_the_binding_quota_and_a_refusal_names_it() {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = 50.0;
    let srv = serve_on_loopback(policy("q.kiln", QUOTAS), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let send = |key: &'static str, max: u64| {
        let c = c.clone();
        let url = format!("{base}/v1/chat/completions");
        async move {
            c.post(url)
                .bearer_auth(key)
                .json(&chat(max))
                .send()
                .await
                .unwrap()
        }
    };
    // Two requests a minute: the requests quota binds, the tokens quota
    // with the least left is the tenant's 50k (the tier's 1M has more).
    let mut left = Vec::new();
    for _ in 0..2 {
        let r = send("k-beta", 8).await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            header(&r, "x-ratelimit-limit-requests").as_deref(),
            Some("2")
        );
        assert_eq!(
            header(&r, "x-ratelimit-limit-tokens").as_deref(),
            Some("50000")
        );
        assert_eq!(
            header(&r, "x-kiln-ratelimit-requests-quota").as_deref(),
            Some("tenant beta")
        );
        assert_eq!(
            header(&r, "x-kiln-ratelimit-tokens-quota").as_deref(),
            Some("tenant beta")
        );
        let tokens: u64 = header(&r, "x-ratelimit-remaining-tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert!(tokens < 50_000, "{tokens}");
        let reset = header(&r, "x-ratelimit-reset-requests").unwrap();
        assert!(reset.ends_with('s'), "{reset}");
        left.push(header(&r, "x-ratelimit-remaining-requests").unwrap());
        r.bytes().await.unwrap();
    }
    assert_eq!(left, ["1", "0"]);
    // The third is refused by the tenant's requests quota, by name.
    let r = send("k-beta", 8).await;
    assert_eq!(r.status(), 429);
    assert_eq!(
        header(&r, "x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );
    assert!(header(&r, "retry-after").is_some());
    let id = header(&r, "x-kiln-request-id").unwrap();
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("refused by tenant beta's quota: requests 2/min, resets in "),
        "{msg}"
    );
    assert_eq!(v["error"]["code"], "quota");
    // explain tells the same.
    let e = c
        .get(format!("{base}/admin/explain/{id}?format=text"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(e.contains("tenant beta's quota: requests 2/min"), "{e}");
    // A request larger than what its tokens quota holds: the tokens quota.
    let r = send("k-gamma", 500).await;
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("refused by tenant gamma's quota: tokens 100/min, resets in"),
        "{msg}"
    );
    srv.stop().await;
}

fn key_entry(name: &str, tenant: &str, key: &str, extra: &str) -> String {
    format!(
        "[[keys]]\nname = \"{name}\"\ntenant = \"{tenant}\"\nsha256 = \"{}\"\n{extra}\n",
        kiln::server::config::hash_secret(key)
    )
}

/// The same pools and tenants without tenant quotas (the reload tests
/// send more than two requests a minute).
fn unlimited() -> kiln::server::Policy {
    let text = QUOTAS
        .replace("quota { requests 2/min tokens 50k/min }", "")
        .replace("quota { tokens 100/min }", "");
    policy("open.kiln", &text)
}

/// Without the policy's own keys, so only kiln.toml's authenticate.
const HEAD: &str = "policy_keys = false\n[sim]\nspeed = 1.0\n";

async fn status_of(c: &reqwest::Client, base: &str, key: &str) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&chat(4))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reload_without_a_restart_and_a_request_in_flight_keeps_its_key() {
    let dir = TempDir::new("reload");
    let path = dir.0.join("kiln.toml");
    std::fs::write(
        &path,
        format!("{HEAD}{}", key_entry("old", "beta", "sk-old", "")),
    )
    .unwrap();
    let cfg = ServerConfig::load(&path).unwrap();
    let srv = serve_on_loopback(unlimited(), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    assert_eq!(status_of(&c, &base, "sk-old").await.0, 200);
    assert_eq!(status_of(&c, &base, "sk-new").await.0, 401);

    // A long stream admitted with the old key.
    let mut stream = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("sk-old")
        .json(&json!({"model": "tiny", "stream": true, "max_tokens": 400,
                      "messages": [{"role": "user", "content": "a long answer"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());

    // The old key revoked, a new one added, reloaded by the admin endpoint.
    std::fs::write(
        &path,
        format!(
            "{HEAD}{}{}",
            key_entry("new", "beta", "sk-new", "description = \"the new one\""),
            key_entry("gone", "gamma", "sk-gone", "expires = \"2020-01-01\"")
        ),
    )
    .unwrap();
    let r: Value = c
        .post(format!("{base}/admin/keys/reload"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["reloaded"]["keys"], 2, "{r}");
    assert_eq!(r["reloaded"]["removed"], json!(["old (beta)"]), "{r}");
    assert_eq!(
        r["reloaded"]["added"],
        json!(["new (beta)", "gone (gamma)"]),
        "{r}"
    );
    assert_eq!(status_of(&c, &base, "sk-new").await.0, 200);
    let (s, v) = status_of(&c, &base, "sk-old").await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    // An expired key: refused, and told so.
    let (s, v) = status_of(&c, &base, "sk-gone").await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (401, Some("expired_api_key"))
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`gone` expired at 2020-01-01"),
        "{v}"
    );
    // The stream admitted with the old key runs to its end.
    let mut rest = Vec::from(first.as_ref());
    while let Some(b) = tokio::time::timeout(Duration::from_secs(30), stream.chunk())
        .await
        .unwrap()
        .unwrap()
    {
        rest.extend_from_slice(&b);
    }
    let text = String::from_utf8_lossy(&rest);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");

    // The list names keys, never their hashes whole.
    let l: Value = c
        .get(format!("{base}/admin/keys"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let keys = l["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0]["name"], "new");
    assert_eq!(keys[0]["description"], "the new one");
    assert_eq!(keys[0]["sha256_prefix"].as_str().unwrap().len(), 12);
    assert_eq!(keys[1]["expired"], true);

    // A bad file is refused with its diagnostic; the keys in use stay.
    std::fs::write(
        &path,
        format!("{HEAD}[[keys]]\nname = \"x\"\ntenant = \"beta\"\nsha256 = \"hunter2\"\n"),
    )
    .unwrap();
    let r = c
        .post(format!("{base}/admin/keys/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("not a SHA-256 hash") && msg.contains("kiln hash-key"),
        "{msg}"
    );
    assert_eq!(status_of(&c, &base, "sk-new").await.0, 200);
    // Both reloads are counted (the file watch may have reloaded too).
    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let count = |result: &str| -> f64 {
        let series = format!("kiln_keys_reloads_total{{result=\"{result}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(count("ok") >= 1.0 && count("error") >= 1.0, "{m}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kiln_keys_edits_the_file_and_the_watch_reloads_it() {
    let dir = TempDir::new("watch");
    let path = dir.0.join("kiln.toml");
    std::fs::write(
        &path,
        format!(
            "# who may call\n{HEAD}{}",
            key_entry("ops", "beta", "sk-ops", "")
        ),
    )
    .unwrap();
    let cfg = ServerConfig::load(&path).unwrap();
    let srv = serve_on_loopback(unlimited(), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client();
    let kiln = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("keys")
            .args(args)
            .arg("--config")
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kiln keys {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    // Added: printed once, stored hashed, the file's comment kept.
    let key = kiln(&[
        "add",
        "--tenant",
        "gamma",
        "--name",
        "ci",
        "--expires-in",
        "30d",
    ]);
    assert!(key.starts_with("sk-kiln-") && key.len() == 8 + 64, "{key}");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# who may call\n"), "{text}");
    assert!(!text.contains(&key));
    assert!(text.contains(&kiln::server::config::hash_secret(&key)));
    // No temporary file is left beside it.
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 1);
    // The watch picks it up (within a second or two).
    let mut ok = false;
    for _ in 0..50 {
        if status_of(&c, &base, &key).await.0 == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the added key never worked");
    // Rotated with no overlap: the old key stops, the new one works.
    let rotated = kiln(&["rotate", "ops", "--overlap", "0s"]);
    assert_ne!(rotated, "sk-ops");
    let mut ok = false;
    for _ in 0..50 {
        if status_of(&c, &base, "sk-ops").await.0 == 401
            && status_of(&c, &base, &rotated).await.0 == 200
        {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the rotation never took effect");
    // Revoked.
    kiln(&["revoke", "ci"]);
    let mut ok = false;
    for _ in 0..50 {
        if status_of(&c, &base, &key).await.0 == 401 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the revoked key still works");
    let listed = kiln(&["list", "--format", "json"]);
    let v: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["name"], "ops");
    srv.stop().await;
}

#[cfg(unix)]
#[test]
fn sighup_reloads_the_keys_of_a_running_gateway() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let dir = TempDir::new("hup");
    let path = dir.0.join("kiln.toml");
    let audit = dir.0.join("audit.log");
    std::fs::write(dir.0.join("q.kiln"), QUOTAS).unwrap();
    std::fs::write(
        &path,
        format!(
            "{HEAD}[audit]\npath = \"{}\"\n{}",
            audit.display(),
            key_entry("ops", "beta", "sk-ops", "")
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("serve")
        .arg("--policy")
        .arg(dir.0.join("q.kiln"))
        .arg("--config")
        .arg(&path)
        .args(["--listen", "127.0.0.1:0"])
        .arg("--batch-store")
        .arg(dir.0.join("b.db"))
        .current_dir(&dir.0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("kiln gateway listening on") {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    let started = rx.recv_timeout(Duration::from_secs(30)).is_ok();
    // Let the watch task install its handler.
    std::thread::sleep(Duration::from_millis(500));
    let hup = Command::new("kill")
        .arg("-HUP")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    let mut audited = false;
    for _ in 0..50 {
        let log = std::fs::read_to_string(&audit).unwrap_or_default();
        if log.contains("keys-reloaded") && log.contains("sighup") {
            audited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "kiln serve did not start");
    assert!(hup.success());
    assert!(alive, "SIGHUP stopped the gateway");
    assert!(
        audited,
        "no keys-reloaded event from sighup in the audit log"
    );
}
