//! The gateway predicts nothing the replay does not: one recorded trace,
//! run through `kiln serve` on the simulated backend with a virtual clock
//! (over HTTP, with the OpenAI request body and API keys), and through the
//! replay `kiln simulate` runs, gives the same decision for every request
//! (tier, tenant, route, refusal) and the same start and finish times to
//! the microsecond, so the same order.
//!
//! The trace is the committed Azure 2023 slice (`examples/diff/traffic.jsonl`,
//! CC-BY-4.0, see `examples/diff/README.md`) under the policy it was
//! recorded for.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::backend::cost::CostModel;
use kiln::driver::VirtualClock;
use kiln::replay;
use kiln::sched::{Config, Scheduler};
use kiln::server::config::{hash_secret, KeyConfig, LogSection, ServerConfig};
use kiln::server::{start, ServeOptions};
use kiln::traffic::Record;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{client, policy};

fn key_of(tenant: &str) -> String {
    format!("test-key-{tenant}")
}

/// What one request came to, in names both sides share.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    tier: Option<String>,
    tenant: Option<String>,
    route: Option<String>,
    refused: Option<(String, u16)>,
    started_us: Option<u64>,
    finished_us: Option<u64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_through_the_gateway_on_a_virtual_clock_matches_the_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/diff/old/enterprise.kiln")).unwrap();
    let mut records: Vec<Record> =
        kiln::traffic::read(root.join("examples/diff/traffic.jsonl")).unwrap();
    // The gateway is sent each prompt as that many zero tokens, and hashes
    // them into prefix blocks (every prompt shares its leading blocks with
    // every longer one): the replay is given the same blocks.
    for r in &mut records {
        r.prefix_blocks = kiln::server::prefix::chain(&vec![0u32; r.prompt_tokens as usize]);
    }
    assert!(records.iter().any(|r| r.prefix_blocks.len() > 1));
    assert!(
        records.len() >= 300,
        "the slice must hold a few hundred requests"
    );

    // The replay, as `kiln simulate` runs it.
    let p = policy("enterprise.kiln", &text);
    let g = p.graph.clone();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let plan = replay::plan(&g, &cost);
    let routes: Vec<String> = plan
        .replicas
        .iter()
        .map(|r| {
            format!(
                "{} on {}",
                g.variant_name(r.model, r.variant),
                g.pools[r.pool as usize].name
            )
        })
        .collect();
    let mut sched = Scheduler::new(g.clone(), plan, Config::default());
    let outcomes = replay::run(&mut sched, replay::arrivals(&records), |_, _| {});
    let want: Vec<Seen> = outcomes
        .iter()
        .map(|o| Seen {
            tier: o.tier.map(|t| g.tiers[t as usize].name.clone()),
            tenant: o.tenant.map(|t| g.tenants[t as usize].name.clone()),
            route: o.replica.map(|r| routes[r].clone()),
            refused: o.rejected.map(|(r, s)| (r.name().to_string(), s)),
            started_us: o.started,
            finished_us: o.finished,
        })
        .collect();
    let served = want.iter().filter(|s| s.finished_us.is_some()).count();
    let queued = outcomes
        .iter()
        .filter(|o| o.started.is_some_and(|s| s > o.arrival))
        .count();
    assert!(served > 100, "the slice must serve requests ({served})");
    let refused = want.iter().filter(|s| s.refused.is_some()).count();
    assert!(
        queued > 10,
        "and some must queue, or order is not tested ({queued})"
    );
    eprintln!(
        "{} requests: {served} served, {queued} queued, {refused} refused",
        want.len()
    );

    // The gateway on a virtual clock, over HTTP.
    let dir = std::env::temp_dir().join(format!("kiln-replay-gateway-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let mut cfg = ServerConfig::default_embedded();
    let tenants: std::collections::BTreeSet<&str> =
        records.iter().filter_map(|r| r.tenant.as_deref()).collect();
    for t in &tenants {
        cfg.keys.push(KeyConfig {
            sha256: hash_secret(&key_of(t)),
            tenant: t.to_string(),
            name: None,
        });
    }
    cfg.log = Some(LogSection::at(log.clone()));
    let clock = VirtualClock::new();
    let running = start(ServeOptions {
        policy: p,
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: Some(clock.clone()),
    })
    .await
    .unwrap();
    let base = format!("http://{}", running.addr);
    let http = Arc::new(client(Duration::from_secs(60)));
    let mut tasks = Vec::new();
    let arrivals = replay::arrivals(&records);
    for (i, ((at, _), r)) in arrivals.iter().zip(&records).enumerate() {
        clock.advance_to(*at);
        let mut req = http
            .post(format!("{base}/v1/completions"))
            .header("x-kiln-replay-index", i.to_string())
            .json(&json!({
                "model": r.model,
                "prompt": vec![0u32; r.prompt_tokens as usize],
                "max_tokens": r.max_tokens,
            }));
        if let Some(t) = &r.tenant {
            req = req.bearer_auth(key_of(t));
        }
        for (k, v) in &r.headers {
            req = req.header(k, v);
        }
        tasks.push(tokio::spawn(
            async move { req.send().await.map(|r| r.status()) },
        ));
        // The arrival is fed before the clock moves on.
        wait_for_arrivals(&http, &base, i as u64 + 1).await;
    }
    // Run out the clock: every timer fires, in order, at its own time.
    clock.advance_to(u64::MAX / 4);
    for t in tasks {
        let status = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("every request ends")
            .unwrap()
            .expect("the gateway answers");
        assert!(status.as_u16() < 500 || status.as_u16() == 503, "{status}");
    }
    running.app.log.flush().await;

    // What the gateway did, from its decision log and explain.
    let mut got: BTreeMap<usize, Seen> = BTreeMap::new();
    for line in std::fs::read_to_string(&log).unwrap().lines() {
        let rec: Record = serde_json::from_str(line).unwrap();
        let i: usize = rec.headers["x-kiln-replay-index"].parse().unwrap();
        assert_eq!(
            rec.prefix_blocks, records[i].prefix_blocks,
            "the log records the blocks the gateway hashed"
        );
        let d = rec.decision.unwrap_or_default();
        let id = rec.id.unwrap();
        let ex: Value = http
            .get(format!("{base}/admin/explain/{id}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let c = &ex["scheduler"]["clock"];
        let refused = (d.admission.as_deref() == Some("reject"))
            .then(|| (d.reason.clone().unwrap_or_default(), d.status.unwrap_or(0)));
        let prev = got.insert(
            i,
            Seen {
                tier: d.tier.clone(),
                tenant: d.tenant.clone(),
                route: d.route.clone(),
                refused,
                started_us: c["started_us"].as_u64(),
                finished_us: c["finished_us"].as_u64(),
            },
        );
        assert!(prev.is_none(), "request {i} logged twice");
    }
    running.stop().await;
    let _ = std::fs::remove_dir_all(&dir);

    assert_eq!(got.len(), want.len(), "every request is logged once");
    let mut differ = Vec::new();
    for (i, w) in want.iter().enumerate() {
        let mut w = w.clone();
        // A refused request has no route in the log.
        if w.refused.is_some() {
            w.route = None;
        }
        if got.get(&i) != Some(&w) {
            differ.push(format!("#{i}: replay {w:?}\n   gateway {:?}", got.get(&i)));
        }
    }
    assert!(
        differ.is_empty(),
        "{} of {} requests differ:\n{}",
        differ.len(),
        want.len(),
        differ
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Polls `/admin/queues` until the scheduler has been given `n` arrivals
/// (bounded: a few seconds of wall time).
async fn wait_for_arrivals(http: &reqwest::Client, base: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v: Value = http
            .get(format!("{base}/admin/queues"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["arrivals"].as_u64().unwrap_or(0) >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "arrival {n} never reached the scheduler"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
