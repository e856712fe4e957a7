//! API keys as a managed object over a fleet: a key added through one
//! replica's admin API authenticates on every replica, a key revoked
//! through one (a managed key or one of `kiln.toml`) is refused by every
//! replica, names are the fleet's once, and a Redis that restarts empty
//! does not bring a revoked key back (the replicas give it back what they
//! last read). A single gateway's admin API edits its `kiln.toml`.
//! Three replicas on a real `redis-server` (skipped, with a message, where
//! it is not installed); gateways on 127.0.0.1:0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::{hash_secret, OnUnavailable, ServerConfig, StateSection};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::redis::Redis;
use support::TempDir;
use support::{client, policy, serve_on_loopback};

const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 16 }
}
tier main { priority 10 slo { ttft 5s } }
tenant alpha { owner "a@x" tiers [main] }
tenant beta { owner "b@x" tiers [main] }
classify { default => tier main }
route main tiny { default => fp16 }
"#;

/// kiln.toml with one key (`file-key` for alpha) and no policy keys.
fn config_file(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.0.join("kiln.toml");
    std::fs::write(
        &path,
        format!(
            "policy_keys = false\n[sim]\nspeed = 20.0\n[[keys]]\nname = \"file-key\"\ntenant = \"alpha\"\nsha256 = \"{}\"\n",
            hash_secret("sk-file")
        ),
    )
    .unwrap();
    path
}

fn replica_config(path: &std::path::Path, url: &str, ns: &str, i: usize) -> ServerConfig {
    let mut cfg = ServerConfig::load(path).unwrap();
    cfg.state = Some(StateSection {
        redis: url.to_string(),
        namespace: ns.to_string(),
        replica: Some(format!("replica-{i}")),
        on_unavailable: OnUnavailable::Local,
        replicas: 1,
        lease: Duration::from_millis(900),
        ca_file: None,
        client_cert: None,
        client_key: None,
    });
    cfg
}

async fn chat(c: &reqwest::Client, base: &str, key: &str) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// Waits (bounded) until `key` answers `status` on every base; how long
/// that took.
async fn until_everywhere(
    c: &reqwest::Client,
    bases: &[String],
    key: &str,
    status: u16,
) -> Duration {
    let start = Instant::now();
    loop {
        let mut all = true;
        for b in bases {
            if chat(c, b, key).await.0 != status {
                all = false;
            }
        }
        if all {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{key} did not answer {status} on every replica within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn admin(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = c.request(method, url);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_added_or_revoked_through_one_replica_holds_on_every_replica() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let dir = TempDir::new("fleet");
    let path = config_file(&dir);
    let ns = support::redis::namespace("keys");
    let mut gateways = Vec::new();
    for i in 0..3 {
        gateways.push(
            serve_on_loopback(
                policy("k.kiln", POLICY),
                replica_config(&path, &redis.url(), &ns, i),
            )
            .await,
        );
    }
    let bases: Vec<String> = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    let c = client(Duration::from_secs(20));

    // Added through replica 0: shown once, authenticates on all three.
    let (s, v) = admin(
        &c,
        reqwest::Method::POST,
        format!("{}/admin/keys", bases[0]),
        Some(json!({"name": "ci-bot", "tenant": "beta", "description": "the CI's key", "expires_in": "30d"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["added"]["source"], "fleet");
    let key = v["added"]["key"].as_str().unwrap().to_string();
    assert!(key.starts_with("sk-kiln-"));
    let took = until_everywhere(&c, &bases, &key, 200).await;
    assert!(
        took < Duration::from_secs(2),
        "the key took {took:?} to reach every replica"
    );
    // Listed by every replica as the fleet's, without the key.
    let (_, list) = admin(
        &c,
        reqwest::Method::GET,
        format!("{}/admin/keys", bases[2]),
        None,
    )
    .await;
    let rows = list["keys"].as_array().unwrap();
    let row = rows.iter().find(|r| r["name"] == "ci-bot").unwrap();
    assert_eq!(row["source"], "fleet");
    assert_eq!(row["tenant"], "beta");
    assert!(!list.to_string().contains(&key));

    // The change is in the fleet's audit chain, read from another
    // replica, and governance steps go on after it.
    let (s, v) = admin(&c, reqwest::Method::POST, format!("{}/admin/overrides", bases[1]),
        Some(json!({"scope": "tenant", "name": "beta", "action": "pause", "for": "1s", "reason": "audit check"}))).await;
    assert!(s < 300, "{v}");
    let (_, audit) = admin(
        &c,
        reqwest::Method::GET,
        format!("{}/admin/audit", bases[2]),
        None,
    )
    .await;
    let kinds: Vec<&str> = audit["recent"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert!(kinds.contains(&"key-added"), "{kinds:?}");
    tokio::time::sleep(Duration::from_millis(1200)).await;

    // A name is the fleet's once: through another replica, and against
    // kiln.toml's names.
    for (name, base) in [("ci-bot", &bases[1]), ("file-key", &bases[2])] {
        let (s, v) = admin(
            &c,
            reqwest::Method::POST,
            format!("{base}/admin/keys"),
            Some(json!({"name": name, "tenant": "alpha"})),
        )
        .await;
        assert_eq!(s, 409, "{name}: {v}");
    }

    // Revoked through replica 2: refused by all three, saying so.
    let (s, v) = admin(
        &c,
        reqwest::Method::DELETE,
        format!("{}/admin/keys/ci-bot", bases[2]),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let took = until_everywhere(&c, &bases, &key, 401).await;
    assert!(
        took < Duration::from_secs(2),
        "the revocation took {took:?}"
    );
    let (_, body) = chat(&c, &bases[0], &key).await;
    assert_eq!(body["error"]["code"], "revoked_api_key", "{body}");
    let (_, audit) = admin(
        &c,
        reqwest::Method::GET,
        format!("{}/admin/audit", bases[0]),
        None,
    )
    .await;
    let revoked = audit["recent"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "key-revoked")
        .cloned();
    let revoked = revoked.expect("the revocation is in the fleet's audit chain");
    assert_eq!(revoked["details"]["name"], "ci-bot", "{revoked}");

    // A key of kiln.toml revoked through replica 1: every replica refuses
    // it, although the file still holds it.
    assert_eq!(chat(&c, &bases[0], "sk-file").await.0, 200);
    let (s, v) = admin(
        &c,
        reqwest::Method::DELETE,
        format!("{}/admin/keys/file-key", bases[1]),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    until_everywhere(&c, &bases, "sk-file", 401).await;
    let (s, _) = admin(
        &c,
        reqwest::Method::DELETE,
        format!("{}/admin/keys/file-key", bases[0]),
        None,
    )
    .await;
    assert_eq!(s, 409, "revoking twice");
    let (s, _) = admin(
        &c,
        reqwest::Method::DELETE,
        format!("{}/admin/keys/nobody", bases[0]),
        None,
    )
    .await;
    assert_eq!(s, 404);

    // A second managed key, then Redis restarts empty on its port: the
    // replicas give it back what they read, so the revoked keys stay
    // revoked and the managed key keeps working, on a replica started
    // after the restart too (it reads only Redis).
    let (s, v) = admin(
        &c,
        reqwest::Method::POST,
        format!("{}/admin/keys", bases[1]),
        Some(json!({"name": "etl", "tenant": "alpha"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let etl = v["added"]["key"].as_str().unwrap().to_string();
    until_everywhere(&c, &bases, &etl, 200).await;
    let port = redis.port;
    drop(redis);
    redis = Redis::start_on(port).expect("redis restarts on its port");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = serve_on_loopback(
        policy("k.kiln", POLICY),
        replica_config(&path, &redis.url(), &ns, 3),
    )
    .await;
    let mut all = bases.clone();
    all.push(format!("http://{}", late.addr));
    until_everywhere(&c, &all, &etl, 200).await;
    until_everywhere(&c, &all, &key, 401).await;
    until_everywhere(&c, &all, "sk-file", 401).await;

    late.stop().await;
    for g in gateways {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_gateways_admin_api_keeps_keys_in_its_file_and_refuses_hostile_bodies() {
    let dir = TempDir::new("single");
    let path = config_file(&dir);
    let srv = serve_on_loopback(policy("k.kiln", POLICY), ServerConfig::load(&path).unwrap()).await;
    let base = format!("http://{}", srv.addr);
    let c = client(Duration::from_secs(20));

    let (s, v) = admin(
        &c,
        reqwest::Method::POST,
        format!("{base}/admin/keys"),
        Some(json!({"name": "laptop", "tenant": "alpha", "expires": "2099-01-01"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["added"]["source"], "file");
    let key = v["added"]["key"].as_str().unwrap().to_string();
    // It holds at once (the file was reloaded), and the file has its hash
    // only.
    assert_eq!(chat(&c, &base, &key).await.0, 200);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(&hash_secret(&key)) && !text.contains(&key));
    assert!(text.contains("expires = \"2099-01-01\""));

    let (s, _) = admin(
        &c,
        reqwest::Method::DELETE,
        format!("{base}/admin/keys/laptop"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let (s, body) = chat(&c, &base, &key).await;
    assert_eq!(s, 401, "{body}");
    assert!(!std::fs::read_to_string(&path)
        .unwrap()
        .contains(&hash_secret(&key)));

    // `kiln keys --server` does the same through the admin API.
    let kiln = |args: Vec<String>| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .env_remove("KILN_ADMIN_TOKEN")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let b = base.clone();
    let (code, cli_key, err) = tokio::task::spawn_blocking(move || {
        kiln(
            [
                "keys", "add", "--server", &b, "--name", "cli", "--tenant", "beta",
            ]
            .map(String::from)
            .to_vec(),
        )
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(cli_key.starts_with("sk-kiln-"), "{cli_key}");
    assert_eq!(chat(&c, &base, &cli_key).await.0, 200);
    let b = base.clone();
    let (code, listed, _) = tokio::task::spawn_blocking(move || {
        kiln(["keys", "list", "--server", &b].map(String::from).to_vec())
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0));
    assert!(
        listed.contains("cli") && listed.contains("beta") && !listed.contains(&cli_key),
        "{listed}"
    );
    let b = base.clone();
    let (code, _, err) = tokio::task::spawn_blocking(move || {
        kiln(
            ["keys", "revoke", "--server", &b, "cli"]
                .map(String::from)
                .to_vec(),
        )
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(chat(&c, &base, &cli_key).await.0, 401);

    // Hostile or wrong bodies change nothing and say why.
    let before = std::fs::read_to_string(&path).unwrap();
    for (body, want) in [
        (json!({"name": "x y", "tenant": "alpha"}), 400),
        (json!({"name": "a".repeat(65), "tenant": "alpha"}), 400),
        (json!({"name": "ok", "tenant": "nobody"}), 400),
        (
            json!({"name": "ok", "tenant": "alpha", "expires": "soon"}),
            400,
        ),
        (
            json!({"name": "ok", "tenant": "alpha", "sha256": "00"}),
            400,
        ),
        (
            json!({"name": "ok", "tenant": "alpha", "description": "d".repeat(600)}),
            400,
        ),
        (json!({"name": "file-key", "tenant": "alpha"}), 409),
        (json!([1, 2]), 400),
    ] {
        let (s, v) = admin(
            &c,
            reqwest::Method::POST,
            format!("{base}/admin/keys"),
            Some(body.clone()),
        )
        .await;
        assert_eq!(s, want, "{body}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("help:"),
            "{v}"
        );
    }
    let (s, _) = admin(
        &c,
        reqwest::Method::DELETE,
        format!("{base}/admin/keys/..%2F..%2Fetc"),
        None,
    )
    .await;
    assert!(s == 400 || s == 404, "{s}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
    srv.stop().await;

    // Without a config file and outside a fleet there is nowhere to keep
    // a key: refused, not lost.
    let bare = serve_on_loopback(policy("k.kiln", POLICY), ServerConfig::default_embedded()).await;
    let (s, v) = admin(
        &c,
        reqwest::Method::POST,
        format!("http://{}/admin/keys", bare.addr),
        Some(json!({"name": "x", "tenant": "alpha"})),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["error"]["code"], "no_key_store");
    bare.stop().await;
}
