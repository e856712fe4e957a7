//! `kiln check` on a large policy: compile (parse, resolve, type and unit
//! check, validate, lower) plus lint, on a generated 10,000-rule policy.
//! Target: < 200 ms.
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

criterion_group!(benches, check);
criterion_main!(benches);
