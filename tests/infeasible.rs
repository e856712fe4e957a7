//! Infeasible is its own reason, and an impossible tier slows nothing:
//! prefill is priced as the engine chunks it (a prompt just over one chunk
//! is one full step plus a small one, not two full ones), a request that
//! would meet its SLO on an idle replica is admitted there, one that could
//! not is refused as `infeasible` (never `fairness` or `overload`), and a
//! tier whose TTFT SLO no request can meet does not cap the pool's steps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::CostModel;
use kiln::graph::DecisionGraph;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Reason, Scheduler, SEC};
use kiln::traffic::Record;
use std::sync::Arc;

const BASE: &str = r#"pool p { gpus 2 kind "H100-80GB" memory 80GB }
model m { params 70B kv_per_token 320KB variant fp16 { memory 140GB gpus_per_replica 2 pools [p] } }
tier chat { priority 10 slo { ttft 2s } }
tier bulk { priority 5 slo { window 1h } }
tenant a { owner "o" tiers [chat] }
tenant b { owner "o" tiers [bulk] }
tenant c { owner "o" tiers [fast] }
classify { when tenant == a => tier chat when tenant == c => tier fast default => tier bulk }
route [chat, bulk, fast] m { default => fp16 }
"#;

fn graph(fast: &str) -> Arc<DecisionGraph> {
    let text = format!("{BASE}tier fast {{ priority 20 slo {{ ttft {fast} }} }}\n");
    let c = kiln::compile::compile_str("p.kiln", &text);
    Arc::new(c.graph.unwrap_or_else(|| panic!("{:?}", c.diagnostics)))
}

fn record(at_ms: f64, tenant: &str, prompt: u64, output: u64) -> Record {
    serde_json::from_value(serde_json::json!({
        "at_ms": at_ms, "tenant": tenant, "model": "m",
        "prompt_tokens": prompt, "output_tokens": output, "max_tokens": output
    }))
    .unwrap()
}

fn run(g: &Arc<DecisionGraph>, recs: &[Record]) -> Vec<Outcome> {
    let cost = CostModel::from_graph(g, None).unwrap();
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), Config::default());
    replay::run(&mut s, replay::arrivals(recs), |_, _| {})
}

#[test]
fn a_prompt_that_meets_the_slo_on_an_idle_replica_is_admitted_and_one_that_cannot_is_infeasible() {
    let g = graph("100ms");
    // One at a time, far apart: the replica is idle for each. Chat (2 s):
    // just under, at and over one 8,192-token chunk.
    let mut recs: Vec<Record> = [1_000u64, 8_192, 8_193, 9_000]
        .iter()
        .enumerate()
        .map(|(i, &p)| record(i as f64 * 120_000.0, "a", p, 8))
        .collect();
    // The fast tier (100 ms): a short prompt, and one whose prefill alone
    // takes longer than that on an idle replica.
    recs.push(record(600_000.0, "c", 200, 8));
    recs.push(record(720_000.0, "c", 3_000, 8));
    let o = run(&g, &recs);
    for (r, o) in recs.iter().zip(&o).take(5) {
        assert!(
            o.rejected.is_none(),
            "{} tokens refused on an idle replica: {:?}",
            r.prompt_tokens,
            o.rejected
        );
        let ttft = o.first_token.unwrap() - o.arrival;
        let slo = if r.tenant.as_deref() == Some("a") {
            2 * SEC
        } else {
            100_000
        };
        assert!(
            ttft <= slo,
            "{} tokens admitted but took {ttft} µs",
            r.prompt_tokens
        );
    }
    assert_eq!(o[5].rejected, Some((Reason::Infeasible, 413)));
}

#[test]
fn an_impossible_tier_never_slows_the_pool() {
    // Bulk work alone, and beside a tier whose 1 ms TTFT no request meets
    // (each of its requests is refused as infeasible).
    let mut recs: Vec<Record> = (0..200)
        .map(|i| record(i as f64 * 5.0, "b", 2_000, 200))
        .collect();
    let bulk_end = |g: &Arc<DecisionGraph>, recs: &[Record]| {
        let o = run(g, recs);
        let end = recs
            .iter()
            .zip(&o)
            .filter(|(r, _)| r.tenant.as_deref() == Some("b"))
            .filter_map(|(_, o)| o.finished)
            .max()
            .unwrap();
        (end, o)
    };
    let (alone, _) = bulk_end(&graph("2s"), &recs);
    recs.extend((0..50).map(|i| record(i as f64 * 100.0, "c", 500, 20)));
    recs.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let (beside, o) = bulk_end(&graph("1ms"), &recs);
    assert!(
        (beside as f64) <= alone as f64 * 1.02,
        "bulk finished at {beside} µs beside the impossible tier, {alone} µs without it"
    );
    for (r, o) in recs.iter().zip(&o) {
        if r.tenant.as_deref() == Some("c") {
            assert_eq!(o.rejected, Some((Reason::Infeasible, 413)));
        }
    }
}
