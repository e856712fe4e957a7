//! Day two with keys: `x-ratelimit-*` headers for the binding quota, quota
//! refusals that name the quota, keys reloaded from `kiln.toml` without a
//! restart (SIGHUP, the file changing, `POST /admin/keys/reload`), key
//! expiry, and `kiln keys` editing the file. Gateways on 127.0.0.1:0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::ServerConfig;
use serde_json::{json, Value};
use std::time::Duration;
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
        assert_eq!(header(&r, "x-ratelimit-limit-requests").as_deref(), Some("2"));
        assert_eq!(header(&r, "x-ratelimit-limit-tokens").as_deref(), Some("50000"));
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
    assert_eq!(header(&r, "x-ratelimit-remaining-requests").as_deref(), Some("0"));
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
