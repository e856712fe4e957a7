//! Prefix blocks on live traffic: the gateway hashes each prompt's tokens
//! into prefix blocks, so a `prefix_affinity` tier sends a conversation's
//! turns to the replica that holds its prefix (and different prefixes to
//! different replicas), the decision log records the blocks, and
//! `kiln simulate` on that log routes every request to the same replica.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::backend::cost::CostModel;
use kiln::replay;
use kiln::sched::{Config, Scheduler};
use kiln::server::config::{LogSection, ServerConfig};
use kiln::traffic::Record;
use serde_json::{json, Value};
use std::time::Duration;
use support::{client, policy, serve_on_loopback};

/// Two replicas of one small model; the tier routes by prefix.
const TWO_REPLICAS: &str = r#"
pool p { gpus 2 kind "H100-80GB" memory 80GB }
model m {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 10GB pools [p] max_batch 4 }
}
tier t { priority 1 slo { ttft 10s } prefix_affinity }
tenant x { owner "o@x" tiers [t] api_keys ["k-x"] }
classify { default => tier t }
route t m { default => fp16 }
"#;

/// About `n` tokens of text that no other `salt` shares.
fn text(n: usize, salt: &str) -> String {
    (0..n).map(|i| format!(" {salt}{}", i % 97)).collect()
}

/// One conversation's system prompt (four prefix blocks and more) and a
/// user turn of its own.
fn turn(conversation: &str, turn: usize) -> Value {
    json!({
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": text(1200, conversation)},
            {"role": "user", "content": text(300, &format!("{conversation}turn{turn}x"))},
        ],
    })
}

/// The replica the request started on, from its explain entry.
async fn replica_of(c: &reqwest::Client, base: &str, id: &str) -> usize {
    let e: Value = c
        .get(format!("{base}/admin/explain/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let events = e["scheduler"]["events"].as_array().unwrap();
    events
        .iter()
        .find_map(|ev| {
            ev["event"]
                .as_str()?
                .strip_prefix("started on replica ")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no start in {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_land_together_and_the_log_replays_them() {
    let p = policy("two.kiln", TWO_REPLICAS);
    let g = p.graph.clone();
    let dir = std::env::temp_dir().join(format!("kiln-prefix-gateway-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let mut cfg = ServerConfig::default_embedded();
    cfg.log = Some(LogSection::at(log.clone()));
    let srv = serve_on_loopback(p, cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client(Duration::from_secs(60));

    // Turns of three conversations, in an order no rotation over two
    // replicas follows (b's second turn comes right after its first).
    let order = [
        ("a", 1),
        ("b", 1),
        ("b", 2),
        ("a", 2),
        ("a", 3),
        ("c", 1),
        ("b", 3),
        ("c", 2),
        ("a", 4),
    ];
    let mut seen: Vec<(&str, usize, String)> = Vec::new();
    for (conv, n) in order {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-x")
            .json(&turn(conv, n))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["x-kiln-route"]
            .to_str()
            .unwrap()
            .starts_with("m.fp16"));
        let id = r.headers()["x-kiln-request-id"]
            .to_str()
            .unwrap()
            .to_string();
        r.bytes().await.unwrap();
        let rep = replica_of(&c, &base, &id).await;
        seen.push((conv, rep, id));
    }
    let replicas_of =
        |conv: &str| -> Vec<usize> { seen.iter().filter(|s| s.0 == conv).map(|s| s.1).collect() };
    for conv in ["a", "b", "c"] {
        let r = replicas_of(conv);
        assert!(
            r.iter().all(|&x| x == r[0]),
            "conversation {conv} moved between replicas: {seen:?}"
        );
    }
    // Different prefixes spread: the first two conversations, which
    // arrive at an idle gateway, go to different replicas.
    assert_ne!(replicas_of("a")[0], replicas_of("b")[0], "{seen:?}");

    // The decision log carries the blocks: a conversation's turns share
    // their leading blocks (the system prompt's), and no others.
    srv.app.log.flush().await;
    let records: Vec<Record> = kiln::traffic::read(&log).unwrap();
    assert_eq!(records.len(), order.len());
    for (rec, (conv, _, id)) in records.iter().zip(&seen) {
        assert_eq!(rec.id.as_deref(), Some(id.as_str()));
        assert!(rec.prefix_blocks.len() >= 2, "{rec:?}");
        for (other, (oconv, _, _)) in records.iter().zip(&seen) {
            let same = rec.prefix_blocks[..2] == other.prefix_blocks[..2];
            assert_eq!(same, conv == oconv, "{conv} and {oconv}");
        }
    }
    srv.stop().await;
    let _ = std::fs::remove_dir_all(&dir);

    // `kiln simulate` on the log: every request on the replica the gateway
    // chose.
    let replicas = |records: &[Record]| {
        let cost = CostModel::from_graph(&g, None).unwrap();
        let mut sched = Scheduler::new(g.clone(), replay::plan(&g, &cost), Config::default());
        let out = replay::run(&mut sched, replay::arrivals(records), |_, _| {});
        out.iter().map(|o| o.replica.unwrap()).collect::<Vec<_>>()
    };
    let gateway: Vec<usize> = seen.iter().map(|s| s.1).collect();
    assert_eq!(replicas(&records), gateway);
    // And it is the blocks that carry it: without them, the replay sends
    // turns of one conversation to different replicas.
    let bare: Vec<Record> = records
        .iter()
        .cloned()
        .map(|mut r| {
            r.prefix_blocks.clear();
            r
        })
        .collect();
    assert_ne!(replicas(&bare), gateway);
}
