//! Deciding one request (classify → quota → route → admit → fallback)
//! against a generated 200-rule policy and against the enterprise example.
//! Target: ≤ 0.5 µs median per decision.
//!
//! cargo bench --bench decide
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

#[path = "common/mod.rs"]
mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kiln::graph::{DecisionGraph, Request, Signals};
use std::hint::black_box;
use std::time::Duration;

fn bench_requests(c: &mut Criterion, group: &str, g: &DecisionGraph, reqs: &[(String, Request)]) {
    let signals = Signals::idle(g);
    let mut grp = c.benchmark_group(group);
    grp.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (label, req) in reqs {
        let d = g.decide(req, &signals);
        eprintln!(
            "{group} / {label}: tier `{}`, admission {}, classify rule #{}",
            g.tiers[d.tier as usize].name,
            d.admission.kind(),
            d.classify_rule
        );
        grp.bench_with_input(BenchmarkId::from_parameter(label), req, |b, req| {
            b.iter(|| g.decide(black_box(req), black_box(&signals)).tier)
        });
    }
    grp.finish();
}

fn generated(c: &mut Criterion) {
    let gen = common::policy(200);
    eprintln!(
        "generated policy: {} rules ({} classify, {} route, {} admit), {} tenants, {} bytes",
        gen.total_rules(),
        gen.classify_rules,
        gen.route_rules,
        gen.admit_rules,
        gen.tenants,
        gen.text.len()
    );
    let g = common::compile(&gen);
    let reqs = common::requests(&gen);
    bench_requests(c, "decide/gen-200", &g, &reqs);
}

fn enterprise(c: &mut Criterion) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/policies/enterprise/enterprise.kiln"
    );
    let text = std::fs::read_to_string(path).expect("read enterprise.kiln");
    let compiled = kiln::compile::compile_str("enterprise.kiln", &text);
    assert!(!compiled.has_errors(), "enterprise.kiln does not compile");
    let g = compiled.graph.expect("a graph");
    let req = |tenant: &str, model: &str, header: Option<&str>, tag: Option<&str>| {
        let mut r = common::request(None, model, header, tag);
        r.tenant = Some(tenant.to_string());
        r
    };
    let mut chat = req("support-bot", "llama-70b", None, None);
    chat.session = Some("s-1".to_string());
    let reqs = vec![
        ("support-bot session, llama-70b".to_string(), chat),
        (
            "analytics eval, llama-70b".to_string(),
            req("analytics", "llama-70b", Some("eval"), None),
        ),
        (
            "enrichment nightly, llama-70b".to_string(),
            req("enrichment", "llama-70b", None, Some("nightly")),
        ),
        (
            "analytics batch (rule 9), llama-8b".to_string(),
            req("analytics", "llama-8b", None, None),
        ),
    ];
    bench_requests(c, "decide/enterprise", &g, &reqs);
}

criterion_group!(benches, generated, enterprise);
criterion_main!(benches);
