//! What README promises a newcomer in the first minutes: the enterprise
//! policy with `examples/enterprise-tenants.toml` answers each of its five
//! tenants' keys as that tenant, in the tier the policy gives it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::server::config::ServerConfig;
use std::path::Path;
use std::time::Duration;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_enterprise_tenant_has_a_try_out_key() {
    let text = std::fs::read_to_string(root().join("policies/enterprise/enterprise.kiln")).unwrap();
    let p = support::policy("enterprise.kiln", &text);
    let cfg_path = root().join("examples/enterprise-tenants.toml");
    let mut cfg = ServerConfig::parse(
        "enterprise-tenants.toml",
        &std::fs::read_to_string(cfg_path).unwrap(),
    )
    .unwrap();
    cfg.sim.speed = 50.0;
    let srv = support::serve_on_loopback(p, cfg).await;
    let c = support::client(Duration::from_secs(30));
    let url = format!("http://{}/v1/chat/completions", srv.addr);
    // (key, extra header, tenant, tier): what README's loop prints.
    let cases = [
        ("key-support-prod", None, "support-bot", "interactive"),
        (
            "key-copilot",
            Some(("x-kiln-session", "s1")),
            "copilot",
            "agentic",
        ),
        ("key-enrichment", None, "enrichment", "batch"),
        (
            "key-analytics",
            Some(("x-kiln-tier", "eval")),
            "analytics",
            "evaluation",
        ),
        ("key-research", None, "research", "experimentation"),
    ];
    for (key, extra, tenant, tier) in cases {
        let mut req = c.post(&url).bearer_auth(key).json(&serde_json::json!({
            "model": "llama-8b",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
        }));
        if let Some((k, v)) = extra {
            req = req.header(k, v);
        }
        let r = req.send().await.unwrap();
        let h = |n: &str| {
            r.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        assert_eq!(
            (h("x-kiln-tenant"), h("x-kiln-tier")),
            (tenant.to_string(), tier.to_string()),
            "{key}: status {}",
            r.status()
        );
        assert!(r.status().is_success(), "{key}: {}", r.status());
    }
    // A key that is not in the file is still refused.
    let r = c
        .post(&url)
        .bearer_auth("key-nobody")
        .json(&serde_json::json!({"model": "llama-8b", "messages": [], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    srv.stop().await;
}

#[tokio::test]
async fn a_policy_key_that_kiln_toml_gives_another_tenant_stops_the_start() {
    let text = std::fs::read_to_string(root().join("policies/enterprise/enterprise.kiln")).unwrap();
    let p = support::policy("enterprise.kiln", &text);
    // key-support-prod is support-bot's in the policy; here it says copilot.
    let cfg = ServerConfig::parse(
        "clash.toml",
        &format!(
            "[[keys]]\nsha256 = \"{}\"\ntenant = \"copilot\"\nname = \"ops\"\n",
            kiln::server::config::hash_secret("key-support-prod")
        ),
    )
    .unwrap();
    let r = kiln::server::start(kiln::server::ServeOptions {
        policy: p,
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: None,
    })
    .await;
    match r {
        Err(e @ kiln::server::ServeError::KeyClash(_)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("`support-bot`") && msg.contains("`copilot`"),
                "{msg}"
            );
            assert!(!msg.contains("key-support-prod"), "{msg}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a clashing key must stop the start"),
    }
}
