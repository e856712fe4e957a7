//! `kiln check` on a large policy: compile (parse, resolve, type and unit
//! check, validate, lower) plus lint, on a generated 10,000-rule policy.
//! Target: < 200 ms. Also a 2k- and a 20k-term `and` chain, which must
//! scale linearly.
//!
//! cargo bench --bench check
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

#[path = "common/mod.rs"]
mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::time::Duration;

const RULES: usize = 10_000;

fn check(c: &mut Criterion) {
    let gen = common::policy(RULES);
    let compiled = kiln::compile::compile_str("gen.kiln", &gen.text);
    assert!(!compiled.has_errors(), "generated policy does not compile");
    let findings = kiln::compile::lint(&compiled);
    eprintln!(
        "generated policy: {} rules ({} classify, {} route, {} admit), {} tenants, {} lines, {} bytes; lint findings: {}",
        gen.total_rules(),
        gen.classify_rules,
        gen.route_rules,
        gen.admit_rules,
        gen.tenants,
        gen.text.lines().count(),
        gen.text.len(),
        findings.len()
    );
    for d in findings.items.iter().take(5) {
        eprintln!("  lint: {:?}", d.code);
    }

    let mut grp = c.benchmark_group("check/gen-10k");
    grp.sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(15));
    grp.bench_function("compile_str+lint", |b| {
        b.iter(|| {
            let c = kiln::compile::compile_str("gen.kiln", black_box(&gen.text));
            let l = kiln::compile::lint(&c);
            (c.has_errors(), l.len())
        })
    });
    grp.bench_function("compile_str", |b| {
        b.iter(|| kiln::compile::compile_str("gen.kiln", black_box(&gen.text)).has_errors())
    });
    grp.bench_function("lint", |b| {
        b.iter(|| kiln::compile::lint(black_box(&compiled)).len())
    });
    grp.finish();
}

/// A policy whose one classify rule is an `and` chain of `n` terms.
fn and_chain(n: usize) -> String {
    let terms: Vec<String> = (0..n)
        .map(|i| format!("header(\"x-{i}\") == \"v\""))
        .collect();
    format!(
        "pool gpu {{ gpus 4 kind \"H100-80GB\" memory 80GB }}\nmodel m {{ variant fp16 {{ memory 40GB pools [gpu] }} }}\ntier chat {{ priority 100 slo {{ ttft 500ms }} }}\ntenant app {{ owner \"a@example.com\" tiers [chat] }}\nclassify {{\n  when {} => tier chat\n  default => tier chat\n}}\nroute chat m {{ default => fp16 }}\n",
        terms.join(" and ")
    )
}

/// A long `and` chain once compiled in quadratic time (20k terms: 8 s);
/// ten times the terms should now take about ten times as long.
fn and_chain_scaling(c: &mut Criterion) {
    let mut grp = c.benchmark_group("check/and-chain");
    grp.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for n in [2_000usize, 20_000] {
        let text = and_chain(n);
        assert!(!kiln::compile::compile_str("chain.kiln", &text).has_errors());
        grp.bench_function(format!("compile_str+lint/{n}"), |b| {
            b.iter(|| {
                let c = kiln::compile::compile_str("chain.kiln", black_box(&text));
                kiln::compile::lint(&c).len()
            })
        });
    }
    grp.finish();
}

criterion_group!(benches, check, and_chain_scaling);
criterion_main!(benches);
