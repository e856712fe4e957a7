//! The simulated backend's roofline cost model on a shipped policy: a table
//! of step times kept as a snapshot, so any change to the model's figures
//! shows up in review, and a property test of monotonicity.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::{CostModel, ReplicaModel};
use kiln::graph::DecisionGraph;
use proptest::prelude::*;
use std::fmt::Write;
use std::path::PathBuf;

fn enterprise() -> DecisionGraph {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/enterprise/enterprise.kiln");
    kiln::compile::compile(kiln::compile::load(&[path]).unwrap())
        .graph
        .unwrap()
}

fn ms(s: f64) -> String {
    format!("{:.3}", s * 1e3)
}

#[test]
fn enterprise_step_times() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let mut out = String::new();
    writeln!(
        out,
        "times in ms; decode bN/C = N sequences over C cached tokens in total; \
         mixed = 512 prefill + 16 decodes over 16k; tput = decode tokens/s at batch 32 × 1k context"
    )
    .unwrap();
    writeln!(
        out,
        "{:<22} {:<10} {:>2} {:>7} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "replica",
        "gpu",
        "tp",
        "wt GB",
        "kv tok",
        "pre 512",
        "pre 2k",
        "ttft 16k",
        "dec b1/1k",
        "b32/32k",
        "b256/256k",
        "mixed",
        "tput"
    )
    .unwrap();
    for r in cost.replicas() {
        let name = format!("{}.{}@{}", r.model_name, r.variant_name, r.pool_name);
        writeln!(
            out,
            "{:<22} {:<10} {:>2} {:>7.1} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8.0}",
            name,
            r.gpu.name,
            r.tp,
            r.weight_bytes / 1e9,
            r.max_concurrent_tokens(),
            ms(r.prefill_time(512)),
            ms(r.prefill_time(2048)),
            ms(r.ttft_estimate(16_384)),
            ms(r.decode_step_time(1, 1024)),
            ms(r.decode_step_time(32, 32 * 1024)),
            ms(r.decode_step_time(256, 256 * 1024)),
            ms(r.step_time(512, 16, 16 * 1024)),
            r.throughput_estimate(32, 1024),
        )
        .unwrap();
    }
    insta::assert_snapshot!(out);
}

fn replicas() -> Vec<ReplicaModel> {
    let g = enterprise();
    CostModel::from_graph(&g, None)
        .unwrap()
        .replicas()
        .cloned()
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn step_time_is_monotone(
        which in 0usize..64,
        p in 0u32..20_000,
        b in 0u32..1_024,
        c in 0u64..2_000_000,
        dp in 0u32..5_000,
        db in 0u32..256,
        dc in 0u64..500_000,
    ) {
        let rs = replicas();
        let r = &rs[which % rs.len()];
        let t = r.step_time(p, b, c);
        prop_assert!(t.is_finite() && t >= 0.0);
        prop_assert!(r.step_time(p + dp, b, c) >= t, "prefill");
        prop_assert!(r.step_time(p, b + db, c) >= t, "decode seqs");
        prop_assert!(r.step_time(p, b, c + dc) >= t, "context");
        prop_assert!(r.step_time(p + dp, b + db, c + dc) >= t, "all");
    }
}

/// One replica of `params`B / `kv_kb` KB per token at `variant` precision
/// over `tp` H100s, vLLM's default limits (256 sequences, 8,192 batched
/// tokens), one tier with nothing in the way.
fn one_replica(params: u32, kv_kb: u32, variant: &str, memory_gb: u32, tp: u32) -> DecisionGraph {
    let text = format!(
        r#"
pool p {{ gpus {tp} kind "H100-80GB" memory 80GB }}
model m {{
  params {params}B
  kv_per_token {kv_kb}KB
  variant {variant} {{ memory {memory_gb}GB gpus_per_replica {tp} pools [p] max_batch 256 max_batch_tokens 8192 }}
}}
tier t {{ priority 1 slo {{ window 24h }} }}
tenant x {{ owner "o" tiers [t] }}
classify {{ default => tier t }}
route t m {{ default => {variant} }}
"#
    );
    let c = kiln::compile::compile_str("sat.kiln", &text);
    let msgs: Vec<_> = c
        .diagnostics
        .items
        .iter()
        .map(|d| d.message.clone())
        .collect();
    c.graph.unwrap_or_else(|| panic!("{msgs:?}"))
}

/// What a saturation replay of one replica measured.
#[derive(Debug)]
struct Saturation {
    kv_tokens: u64,
    prefill_tok_s: f64,
    output_tok_s: f64,
    mean_concurrent: f64,
    max_concurrent: usize,
    preemptions: u32,
}

/// `n` requests of `input` prompt and `output` generated tokens all at
/// time 0 (vLLM's `benchmark_serving --request-rate inf`), FIFO with
/// continuous batching and paged KV, on the roofline cost model.
fn saturate(g: DecisionGraph, n: u64, input: u64, output: u32) -> Saturation {
    use kiln::graph::Request;
    use kiln::sched::{Arrival, Config, Mode, Scheduler};
    let cost = CostModel::from_graph(&g, None).unwrap();
    let kv_tokens = cost
        .replicas()
        .next()
        .unwrap()
        .kv_capacity_tokens()
        .unwrap();
    let plan = kiln::backend::deploy::simulated(&g, &cost);
    assert_eq!(plan.replicas.len(), 1);
    let g = std::sync::Arc::new(g);
    let cfg = Config {
        mode: Mode::Fifo,
        ..Config::default()
    };
    let mut s = Scheduler::new(g, plan, cfg);
    let arrivals = (0..n)
        .map(|id| {
            let request = Request {
                tenant: Some("x".into()),
                model: "m".into(),
                prompt_tokens: input,
                max_tokens: u64::from(output),
                ..Default::default()
            };
            let a = Arrival {
                quota_claimed: false,
                fleet: None,
                cache: None,
                semantic: None,
                window: None,
                id,
                request,
                output_tokens: output,
                prefix_blocks: Vec::new(),
            };
            (0, a)
        })
        .collect();
    let o = kiln::replay::run(&mut s, arrivals, |_, _| {});
    assert!(o.iter().all(|x| x.finished.is_some()), "all finish");
    let end = o.iter().filter_map(|x| x.finished).max().unwrap() as f64 / 1e6;
    let busy: f64 = o
        .iter()
        .map(|x| (x.finished.unwrap() - x.started.unwrap()) as f64 / 1e6)
        .sum();
    let mut edges: Vec<(u64, i32)> = o
        .iter()
        .flat_map(|x| [(x.started.unwrap(), 1), (x.finished.unwrap(), -1)])
        .collect();
    edges.sort_by_key(|&(t, d)| (t, d));
    let (mut now, mut max) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        max = max.max(now);
    }
    Saturation {
        kv_tokens,
        prefill_tok_s: (n * input) as f64 / end,
        output_tok_s: (n * u64::from(output)) as f64 / end,
        mean_concurrent: busy / end,
        max_concurrent: max as usize,
        preemptions: o.iter().map(|x| x.preemptions).sum(),
    }
}

/// The cost model against published vLLM figures (BENCHMARKS.md, "Paged
/// KV: the cost model against published figures"): a saturation replay of
/// one replica per GPU/model pair, with ShareGPT's mean lengths (230 in,
/// 203 out). Prints the table; asserts only what must hold whatever the
/// figures. `cargo test --release --test cost_model saturation -- --nocapture`
#[test]
fn saturation_throughput_against_published_figures() {
    // (pair, graph, requests): 320 as Lambda's runs, 1,000 as vLLM PR 18566's.
    let pairs = [
        (
            "Llama-3.1-8B fp16, 1×H100",
            one_replica(8, 128, "fp16", 16, 1),
            1000,
        ),
        (
            "Llama-3.1-8B fp8, 1×H100",
            one_replica(8, 128, "fp8", 8, 1),
            320,
        ),
        (
            "Llama-3.1-70B fp8, 1×H100",
            one_replica(70, 320, "fp8", 70, 1),
            320,
        ),
        (
            "Llama-3.1-70B fp16, 2×H100 TP2",
            one_replica(70, 320, "fp16", 140, 2),
            320,
        ),
        (
            "Llama-3.1-70B fp8, 2×H100 TP2",
            one_replica(70, 320, "fp8", 70, 2),
            320,
        ),
        (
            "Llama-3.1-70B fp8, 4×H100 TP4",
            one_replica(70, 320, "fp8", 70, 4),
            320,
        ),
    ];
    println!(
        "| pair | requests | KV tokens | prefill tok/s | output tok/s | mean seqs | max seqs | preemptions |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, g, n) in pairs {
        let r = saturate(g, n, 230, 203);
        println!(
            "| {name} | {n} | {} | {:.0} | {:.0} | {:.1} | {} | {} |",
            r.kv_tokens,
            r.prefill_tok_s,
            r.output_tok_s,
            r.mean_concurrent,
            r.max_concurrent,
            r.preemptions
        );
        assert!(r.output_tok_s.is_finite() && r.output_tok_s > 0.0);
        assert!(r.max_concurrent <= 256);
        // Paged KV: as many run at once as the blocks of what has been
        // computed allow, not prompt plus whole output reserved.
        let reserved = (r.kv_tokens / (230 + 203)).min(256) as usize;
        assert!(r.max_concurrent >= reserved, "{name}: {r:?}");
    }
}

/// A variant that sets no `max_batch_tokens` gets the step vLLM's server
/// picks on the pool's GPU: 8,192 tokens on GPUs of 70 GiB or more other
/// than A100s, 2,048 elsewhere; one that sets it keeps it on every GPU.
#[test]
fn step_token_budget_defaults_to_the_engines_choice_for_the_gpu() {
    for (kind, memory, set, want) in [
        ("H100-80GB", "80GB", None, 8192),
        ("H200-141GB", "141GB", None, 8192),
        ("A100-80GB", "80GB", None, 2048),
        ("L4", "24GB", None, 2048),
        ("L40S-48GB", "48GB", None, 2048),
        ("L4", "24GB", Some(8192), 8192),
        ("H100-80GB", "80GB", Some(1024), 1024),
    ] {
        let budget = set.map_or(String::new(), |t| format!("max_batch_tokens {t}"));
        let text = format!(
            r#"
pool p {{ gpus 1 kind "{kind}" memory {memory} }}
model m {{ params 8B kv_per_token 128KB variant fp16 {{ memory 18GB pools [p] {budget} }} }}
tier t {{ priority 1 slo {{ window 24h }} }}
tenant x {{ owner "o" tiers [t] }}
classify {{ default => tier t }}
route t m {{ default => fp16 }}
"#
        );
        let c = kiln::compile::compile_str("budget.kiln", &text);
        let g = c
            .graph
            .unwrap_or_else(|| panic!("{kind}: {:?}", c.diagnostics.items));
        let cost = CostModel::from_graph(&g, None).unwrap();
        let r = cost.replicas().next().unwrap();
        assert_eq!(r.max_batch_tokens, want, "{kind} {memory} {set:?}");
        let plan = kiln::backend::deploy::simulated(&g, &cost);
        assert!(!plan.replicas.is_empty(), "{kind}");
        for spec in &plan.replicas {
            assert_eq!(
                spec.max_batch_tokens, want,
                "{kind} {memory} {set:?}: the scheduler's replica"
            );
        }
    }
}
