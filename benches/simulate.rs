//! Simulating the whole Azure 2023 hour (conv + code, 28,185 requests) on
//! 8 simulated H100s: target < 1 s wall. Reads the trace from
//! ../shared/traces at run time. Also prints, once, the quality comparison
//! of kiln against the fifo baseline at several loads.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::backend::cost::CostModel;
use kiln::replay::{self, report};
use kiln::sched::{Config, Mode, Scheduler};
use kiln::traffic::{self, import::Mapping};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn load(scale: f64) -> Vec<traffic::Record> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/azure2023");
    let mut conv = Mapping::new("llama-70b");
    conv.tenant = Some("chat".into());
    conv.time_scale = scale;
    let mut code = Mapping::new("llama-70b");
    code.tenant = Some("code".into());
    code.time_scale = scale;
    let a = traffic::import::azure(dir.join("AzureLLMInferenceTrace_conv.csv"), &conv)
        .expect("conv trace");
    let b = traffic::import::azure(dir.join("AzureLLMInferenceTrace_code.csv"), &code)
        .expect("code trace");
    traffic::merge([a.records, b.records])
}

fn graph() -> Arc<kiln::graph::DecisionGraph> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/azure-hour/azure.kiln");
    let c = kiln::compile::compile(kiln::compile::load(&[path]).expect("policy"));
    Arc::new(c.graph.expect("policy compiles"))
}

fn simulate(
    g: &Arc<kiln::graph::DecisionGraph>,
    cost: &CostModel,
    records: &[traffic::Record],
    mode: Mode,
) -> report::Report {
    let cfg = Config {
        mode,
        ..Config::default()
    };
    let mut plan = replay::plan(g, cost);
    if mode == Mode::Static {
        plan.partition_by_tier(g);
    }
    let mut s = Scheduler::new(g.clone(), plan, cfg);
    let (outcomes, gap) = replay::run_measured(&mut s, replay::arrivals(records), |_, _| {});
    let fleet = replay::fleet(&s, &outcomes, gap);
    report::build(g, &format!("{mode:?}"), "kiln", &outcomes, &fleet)
}

fn bench(c: &mut Criterion) {
    let g = graph();
    let cost = CostModel::from_graph(&g, None).expect("cost model");
    let records = load(1.0);
    assert_eq!(records.len(), 28_185);
    let mut grp = c.benchmark_group("simulate");
    grp.sample_size(10)
        .measurement_time(Duration::from_secs(10));
    grp.bench_function("azure-hour/8xH100/kiln", |b| {
        b.iter(|| simulate(&g, &cost, &records, Mode::Kiln))
    });
    grp.bench_function("azure-hour/8xH100/fifo", |b| {
        b.iter(|| simulate(&g, &cost, &records, Mode::Fifo))
    });
    // `kiln diff --traffic`: every request decided twice, and both policies
    // replayed (in parallel). Target: under twice one simulation.
    let changed = {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/azure-hour/azure.kiln");
        let text = std::fs::read_to_string(path).expect("policy");
        let text = text.replace("slo { ttft 1s }", "slo { ttft 800ms }");
        Arc::new(
            kiln::compile::compile_str("new.kiln", &text)
                .graph
                .expect("changed policy compiles"),
        )
    };
    let cost2 = CostModel::from_graph(&changed, None).expect("cost model");
    grp.bench_function("azure-hour/8xH100/diff", |b| {
        b.iter(|| {
            kiln::diff::dry_run(&g, &changed, (&cost, &cost2), &records, |_, _| {})
                .expect("dry run")
        })
    });
    grp.finish();

    // Quality at several loads (time scale stretches arrivals; 5 is about
    // 90% of this fleet's busy time).
    println!("\nscale | scheduler | busy | interactive SLO | batch SLO | goodput/s | vs fifo");
    for scale in [1.0, 2.0, 3.0, 5.0] {
        let records = load(scale);
        let k = simulate(&g, &cost, &records, Mode::Kiln);
        let f = simulate(&g, &cost, &records, Mode::Fifo);
        let goodput = |r: &report::Report| r.tiers.iter().map(|t| t.goodput_rps).sum::<f64>();
        for r in [&k, &f] {
            let slo = |name: &str| {
                r.tiers
                    .iter()
                    .find(|t| t.name == name)
                    .map_or(0.0, |t| t.slo_attainment * 100.0)
            };
            println!(
                "{scale} | {} | {:.1}% | {:.1}% | {:.1}% | {:.2} | {:.2}x",
                r.scheduler,
                r.busy * 100.0,
                slo("interactive"),
                slo("batch"),
                goodput(r),
                goodput(r) / goodput(&f).max(1e-9)
            );
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
