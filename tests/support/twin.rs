//! One recorded trace run twice, through the replay (`kiln simulate`'s
//! path) and through `kiln serve` over HTTP on a virtual clock, each
//! summarised per request in names both sides share, so a test can require
//! them to be equal.

use kiln::backend::cost::CostModel;
use kiln::driver::VirtualClock;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Scheduler};
use kiln::server::config::{hash_secret, KeyConfig, LogSection, ServerConfig};
use kiln::server::{start, Policy, ServeOptions};
use kiln::traffic::Record;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn key_of(tenant: &str) -> String {
    format!("test-key-{tenant}")
}

/// What one request came to.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub tier: Option<String>,
    pub tenant: Option<String>,
    pub route: Option<String>,
    /// (reason, status) when refused.
    pub refused: Option<(String, u16)>,
    pub started_us: Option<u64>,
    pub finished_us: Option<u64>,
}

/// The prefix blocks the gateway hashes for a prompt of `n` zero tokens
/// (what [`gateway_seen`] sends).
pub fn blocks_sent(n: u64) -> Vec<u64> {
    kiln::server::prefix::chain(&vec![0u32; n as usize])
}

/// The replay: every request's outcome, summarised, and the outcomes. Each
/// request carries the prefix blocks the gateway computes for it.
pub fn replay_seen(p: &Policy, records: &[Record]) -> (Vec<Seen>, Vec<Outcome>) {
    let records: Vec<Record> = records
        .iter()
        .map(|r| Record {
            prefix_blocks: blocks_sent(r.prompt_tokens),
            ..r.clone()
        })
        .collect();
    let records = records.as_slice();
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
    let outcomes = replay::run(&mut sched, replay::arrivals(records), |_, _| {});
    let seen = outcomes
        .iter()
        .map(|o| Seen {
            tier: o.tier.map(|t| g.tiers[t as usize].name.clone()),
            tenant: o.tenant.map(|t| g.tenants[t as usize].name.clone()),
            // A refused request has no route in the gateway's log.
            route: o
                .replica
                .filter(|_| o.rejected.is_none())
                .map(|r| routes[r].clone()),
            refused: o.rejected.map(|(r, s)| (r.name().to_string(), s)),
            started_us: o.started,
            finished_us: o.finished,
        })
        .collect();
    (seen, outcomes)
}

/// The gateway on a virtual clock, over HTTP with per-tenant API keys:
/// every request's decision from its decision log and explain record, in
/// trace order.
pub async fn gateway_seen(p: Policy, records: &[Record]) -> Vec<Seen> {
    let dir = std::env::temp_dir().join(format!(
        "kiln-twin-{}-{}",
        std::process::id(),
        records.len()
    ));
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
            description: None,
            expires: None,
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
    let http = Arc::new(super::client(Duration::from_secs(60)));
    let mut tasks = Vec::new();
    let arrivals = replay::arrivals(records);
    for (i, ((at, _), r)) in arrivals.iter().zip(records).enumerate() {
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
        // Records are matched to arrivals by the id the gateway answered
        // with: a refused request's record keeps none of the client's
        // `x-kiln-*` headers (the index header above).
        tasks.push(tokio::spawn(async move {
            req.send().await.map(|r| {
                let rid = r
                    .headers()
                    .get("x-kiln-request-id")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                (r.status(), rid, i)
            })
        }));
        // The arrival is fed before the clock moves on.
        wait_for_arrivals(&http, &base, i as u64 + 1).await;
    }
    // Run out the clock: every timer fires, in order, at its own time.
    clock.advance_to(u64::MAX / 4);
    let mut index_of: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        let (status, rid, i) = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("every request ends")
            .unwrap()
            .expect("the gateway answers");
        assert!(status.as_u16() < 500 || status.as_u16() == 503, "{status}");
        index_of.insert(rid.expect("every answer names its request"), i);
    }
    running.app.log.flush().await;

    let mut got: BTreeMap<usize, Seen> = BTreeMap::new();
    for line in std::fs::read_to_string(&log).unwrap().lines() {
        let rec: Record = serde_json::from_str(line).unwrap();
        let i: usize = match rec.headers.get("x-kiln-replay-index") {
            Some(v) => v.parse().unwrap(),
            None => index_of[rec.id.as_deref().unwrap()],
        };
        assert_eq!(
            rec.prefix_blocks,
            blocks_sent(records[i].prompt_tokens),
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
    assert_eq!(got.len(), records.len(), "every request is logged once");
    got.into_values().collect()
}

/// Fails with the first few requests where the two runs differ.
pub fn assert_same(want: &[Seen], got: &[Seen]) {
    let mut differ = Vec::new();
    for (i, w) in want.iter().enumerate() {
        if got.get(i) != Some(w) {
            differ.push(format!("#{i}: replay {w:?}\n   gateway {:?}", got.get(i)));
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
