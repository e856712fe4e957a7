//! Batch work backfills: a large batch backlog on the same GPUs leaves
//! interactive latency where it is without the batch, and still drains.
//!
//! Replayed on the scheduler (virtual time, deterministic), with request
//! sizes from the Azure 2023 conversation trace (../shared/traces), under
//! a one-GPU policy and the shipped enterprise policy, at two interactive
//! load levels each. The property: interactive TTFT p99 with the backlog
//! is within 10% of the same arrivals alone, no interactive request is
//! refused that was not refused alone, and every batch item finishes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

use kiln::backend::cost::CostModel;
use kiln::graph::{DecisionGraph, Request};
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Scheduler};
use kiln::traffic::Record;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::sync::Arc;

const ONE_GPU: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model llama-8b {
  params 8B
  kv_per_token 128KB
  variant fp16 { memory 18GB pools [gpu] max_batch 64 }
}
tier interactive { priority 100 slo { ttft 500ms p95 4s } preempts [batch] }
tier batch { priority 10 slo { window 24h } preemptible }
tenant chat { owner "chat@x" tiers [interactive] }
tenant bulk { owner "bulk@x" tiers [batch] }
classify {
  when tenant == chat => tier interactive
  default => tier batch
}
route [interactive, batch] llama-8b { default => fp16 }
"#;

fn graph(name: &str, text: &str) -> Arc<DecisionGraph> {
    let c = kiln::compile::compile_str(name, text);
    Arc::new(c.graph.expect("policy compiles"))
}

/// (context, generated) tokens of the Azure conversation trace.
fn sizes() -> Vec<(u64, u64)> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv");
    let text = std::fs::read_to_string(p).expect("the Azure conv trace");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split(',').skip(1);
            Some((
                f.next()?.trim().parse().ok()?,
                f.next()?.trim().parse().ok()?,
            ))
        })
        .collect()
}

fn record(at_ms: f64, tenant: &str, model: &str, prompt: u64, out: u64, batch: bool) -> Record {
    let mut r = Record::new(
        at_ms,
        Request {
            tenant: Some(tenant.into()),
            model: model.into(),
            prompt_tokens: prompt,
            max_tokens: out,
            ..Request::default()
        },
        out,
    );
    if batch {
        r.headers.insert("x-kiln-batch".into(), "b1".into());
    }
    r
}

fn interactive(
    sizes: &[(u64, u64)],
    tenant: &str,
    model: &str,
    rate: f64,
    secs: f64,
) -> Vec<Record> {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (mut t, mut out) = (0.0, Vec::new());
    loop {
        t += -rng.random::<f64>().max(1e-12).ln() / rate;
        if t >= secs {
            return out;
        }
        let (c, g) = sizes[rng.random_range(0..sizes.len())];
        out.push(record(
            t * 1000.0,
            tenant,
            model,
            c.min(2048),
            g.clamp(1, 1024),
            false,
        ));
    }
}

fn backlog(sizes: &[(u64, u64)], tenant: &str, model: &str, n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| {
            let (c, g) = sizes[(i * 7919) % sizes.len()];
            record(
                i as f64 * 0.01,
                tenant,
                model,
                c.min(256),
                g.clamp(1, 512),
                true,
            )
        })
        .collect()
}

fn run(g: &Arc<DecisionGraph>, records: &mut [Record]) -> Vec<Outcome> {
    records.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let cost = CostModel::from_graph(g, None).expect("cost model");
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), Config::default());
    replay::run(&mut s, replay::arrivals(records), |_, _| {})
}

fn p99_ttft(o: &[Outcome], batch: bool) -> f64 {
    let mut v: Vec<f64> = o
        .iter()
        .filter(|x| x.batch.is_some() == batch)
        .filter_map(|x| Some((x.first_token? - x.arrival) as f64 / 1000.0))
        .collect();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * 0.99).round() as usize]
}

fn check(name: &str, g: &Arc<DecisionGraph>, chat: &str, bulk: &str, model: &str, rate: f64) {
    let sizes = sizes();
    let online = interactive(&sizes, chat, model, rate, 120.0);
    let alone = run(g, &mut online.clone());
    let mut both = online.clone();
    both.extend(backlog(&sizes, bulk, model, 3000));
    let with = run(g, &mut both);
    let (a, w) = (p99_ttft(&alone, false), p99_ttft(&with, false));
    let refused = |o: &[Outcome]| {
        o.iter()
            .filter(|x| x.batch.is_none() && x.rejected.is_some())
            .count()
    };
    let batch_done = with
        .iter()
        .filter(|x| x.batch.is_some() && x.finished.is_some())
        .count();
    eprintln!(
        "{name} at {rate}/s: interactive TTFT p99 alone {a:.0} ms, with 3000 batch items {w:.0} ms ({:.3}x); refused {} vs {}; batch finished {batch_done}",
        w / a,
        refused(&alone),
        refused(&with)
    );
    assert!(
        w <= a * 1.10,
        "{name} at {rate}/s: TTFT p99 {w:.1} ms with the batch vs {a:.1} alone"
    );
    assert!(
        refused(&with) <= refused(&alone),
        "{name}: the batch got interactive work refused"
    );
    assert_eq!(batch_done, 3000, "{name}: every batch item finishes");
}

#[test]
fn interactive_latency_holds_under_a_batch_backlog_on_one_gpu() {
    let g = graph("one.kiln", ONE_GPU);
    for rate in [2.0, 4.0] {
        check("one-gpu", &g, "chat", "bulk", "llama-8b", rate);
    }
}

/// The shipped policy routes batch to int4 on the shared L40S pool and
/// interactive to the H100s: there the check is that nothing of the batch
/// (its admission, its fallbacks, its signals) leaks into interactive work.
#[test]
fn interactive_latency_holds_under_a_batch_backlog_on_the_enterprise_policy() {
    let text = std::fs::read_to_string("policies/enterprise/enterprise.kiln").unwrap();
    let g = graph("enterprise.kiln", &text);
    for rate in [4.0, 8.0] {
        check(
            "enterprise",
            &g,
            "support-bot",
            "enrichment",
            "llama-70b",
            rate,
        );
    }
}
