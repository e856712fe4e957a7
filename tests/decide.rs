//! Decisions: the tenant-indexed fast path agrees with the rule-by-rule
//! walk that `explain` shows, on generated policies and random requests, and
//! a decision is a pure function of its inputs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::compile::compile_str;
use kiln::graph::{DecisionGraph, Request, Signals, SignalsInput};
use proptest::prelude::*;
use std::collections::BTreeMap;

const TENANTS: usize = 40;

/// Many tenant-pinned rules interleaved with rules that read only headers,
/// tags and signals, so the index has both kinds to merge.
fn policy() -> String {
    let mut s = String::from(
        "pool p { gpus 8 kind \"H100\" memory 80GB }\npool q { gpus 8 kind \"L40S\" memory 48GB }\n\
         model m {\n  variant fp16 { memory 40GB pools [p] }\n  variant int4 { memory 20GB pools [p, q] }\n}\n\
         tier t0 { priority 90 slo { ttft 1s } }\ntier t1 { priority 50 slo { ttft 5s } preemptible }\n\
         tier t2 { priority 10 slo { window 6h } preemptible }\n",
    );
    for k in 0..TENANTS {
        s.push_str(&format!(
            "tenant team-{k} {{ owner \"o\" tiers [t0, t1, t2] }}\n"
        ));
    }
    s.push_str("classify {\n");
    for k in 0..TENANTS {
        s.push_str(&format!(
            "  when tenant == team-{k} and header(\"x-tier\") == \"hi\" => tier t0\n"
        ));
        if k % 5 == 0 {
            s.push_str(&format!("  when tag(\"bulk-{k}\") => tier t2\n"));
        }
        if k % 7 == 0 {
            s.push_str(&format!(
                "  when tenant in [team-{k}, team-{}] and prompt_tokens > 4k => tier t2\n",
                (k + 1) % TENANTS
            ));
        }
    }
    s.push_str("  when tier(t0).oldest_wait > 2s => tier t2\n  default => tier t1\n}\n");
    s.push_str("route [t0, t1, t2] m {\n");
    for k in 0..TENANTS / 2 {
        s.push_str(&format!(
            "  when tenant == team-{k} and pool(p).utilization > 80% => int4 on q\n"
        ));
    }
    s.push_str("  default => fp16\n}\n");
    s
}

fn graph() -> &'static DecisionGraph {
    static G: std::sync::OnceLock<DecisionGraph> = std::sync::OnceLock::new();
    G.get_or_init(|| {
        let c = compile_str("gen.kiln", &policy());
        let msgs: Vec<_> = c
            .diagnostics
            .items
            .iter()
            .map(|d| d.message.clone())
            .collect();
        c.graph
            .unwrap_or_else(|| panic!("generated policy does not compile: {msgs:?}"))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn indexed_decisions_match_the_rule_walk(
        tenant in proptest::option::of(0usize..TENANTS + 3),
        hi in any::<bool>(),
        tag in proptest::option::of(0usize..TENANTS),
        prompt in 0u64..10_000,
        wait_ms in 0u64..5_000,
        util in 0u64..101,
    ) {
        let g: &DecisionGraph = graph();
        let mut headers = BTreeMap::new();
        if hi {
            headers.insert("X-Tier".to_string(), "hi".to_string());
        }
        let r = Request {
            tenant: tenant.map(|k| format!("team-{k}")),
            model: "m".into(),
            headers,
            tags: tag.map(|k| vec![format!("bulk-{k}")]).unwrap_or_default(),
            prompt_tokens: prompt,
            max_tokens: 100,
            ..Default::default()
        };
        let input: SignalsInput = serde_json::from_value(serde_json::json!({
            "tiers": { "t0": { "oldest_wait": format!("{wait_ms}ms") } },
            "pools": { "p": { "utilization": format!("{util}%") } }
        })).unwrap();
        let s = Signals::resolve(g, &input).unwrap();
        let fast = g.decide(&r, &s);
        let (walked, _) = g.explain(&r, &s);
        prop_assert_eq!(fast, walked);
        prop_assert_eq!(fast, g.decide(&r, &s));
    }
}

#[test]
fn the_generated_policy_is_indexed() {
    let g = graph();
    assert!(g.classify.by_tenant.is_some());
}
