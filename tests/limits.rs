//! Every number in a policy has a range (`kiln::graph::limits`): a value
//! outside it is an `out-of-range` error from `kiln check`, with its span
//! and a help line naming the limit, and nothing a policy that compiles
//! says makes the deployment planner allocate in proportion to a number
//! written in it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::CostModel;
use kiln::backend::deploy::{self, PoolBackends};
use kiln::compile::{compile_str, lint};
use kiln::diag::Code;
use kiln::graph::limits;
use kiln::sched::plan::{Costing, Plan, StepCost};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A policy using every numeric field; `{N}` are filled in by [`fill`].
const TEMPLATE: &str = r#"pool gpu { gpus {0} kind "H100-80GB" memory {1}GB }
pool spare { gpus {2} kind "H100-80GB" memory 80GB }

model m {
  params {3}B
  kv_per_token {4}KB
  variant fp16 { memory {5}GB gpus_per_replica {6} max_batch {7} max_batch_tokens {8} pools [gpu, spare] }
}

tier chat {
  priority {9}
  slo { ttft {10}ms p95 {11}s }
  batch { max_wait {12}ms }
  aging {13}s
  preempts [bulk]
}

tier bulk {
  priority {14}
  slo { window {15}h }
  preemptible
}

cohort team { owner "team@example.com" }

tenant app {
  owner "app-team@example.com"
  tiers [chat, bulk]
  cohort team
  quota { tokens {16}/min requests {17}/min concurrent {18} gpu_seconds {19}/day }
  weight {20}
  borrow {21}%
  lend {22}%
  retry_budget {23}%
  session_steps {24}
  cost {25}/h
}

classify {
  when tenant == app and prompt_tokens > {26} => tier bulk
  when tenant == app => tier chat
  default => tier bulk
}

route [chat, bulk] m {
  default => fp16
}

admit chat {
  when estimated_wait > {27}ms => queue max_wait {28}s
  when prompt_tokens > {29} => degrade max_tokens {30}
  when max_tokens > {31} => reject 429 "too long" retry_after {32}s
  default => accept
}

rollout {
  shadow {33}m
  canary { share {34}% duration {35}h }
}

approval {
  require {36} from "leads" for [priority_increase]
}
"#;

const FIELDS: usize = 37;

/// Values that compile: small, real-fleet numbers.
const SANE: [&str; FIELDS] = [
    "8", "80", "4", "70", "320", "40", "2", "128", "8192", "100", "500", "4", "10", "30", "10",
    "6", "2", "600", "64", "400", "2", "20", "10", "5", "30", "2.5", "16000", "2", "30", "8000",
    "256", "4096", "5", "10", "5", "2", "1",
];

fn fill(values: &[String]) -> String {
    let mut s = TEMPLATE.to_string();
    for (i, v) in values.iter().enumerate() {
        s = s.replace(&format!("{{{i}}}"), v);
    }
    s
}

fn sane() -> Vec<String> {
    SANE.iter().map(|s| s.to_string()).collect()
}

/// Compiles and, when it compiles, plans the policy's deployment; returns
/// the number of replicas planned.
fn plan(text: &str) -> Option<usize> {
    let c = compile_str("hostile.kiln", text);
    let _ = lint(&c);
    let g = c.graph.as_ref()?;
    let (plan, _) = deploy::plan(g, &PoolBackends::new(), None).ok()?;
    if let Ok(cost) = CostModel::from_graph(g, None) {
        let sim = deploy::simulated(g, &cost);
        assert!(sim.replicas.len() <= limits::MAX_REPLICAS);
    }
    Some(plan.replicas.len())
}

#[test]
fn the_template_compiles_clean_and_plans() {
    let text = fill(&sane());
    let c = compile_str("sane.kiln", &text);
    assert!(!c.has_errors(), "{:?}", c.diagnostics);
    let n = plan(&text).expect("plans");
    // The route's target is unpinned: it runs on the variant's first pool.
    assert_eq!(n, 4, "8 GPUs, 2 a replica");
}

#[test]
fn a_huge_number_in_any_field_is_an_out_of_range_error() {
    for i in 0..FIELDS {
        let mut v = sane();
        v[i] = "99999999999999999999999999".to_string();
        let text = fill(&v);
        let c = compile_str("hostile.kiln", &text);
        let d = c
            .diagnostics
            .items
            .iter()
            .find(|d| d.code == Code::OutOfRange)
            .unwrap_or_else(|| {
                panic!(
                    "field {{{i}}}: no out-of-range error: {:?}",
                    c.diagnostics
                        .items
                        .iter()
                        .map(|d| (d.code, &d.message))
                        .collect::<Vec<_>>()
                )
            });
        assert!(c.has_errors(), "field {{{i}}}");
        assert!(d.span.is_some(), "field {{{i}}}: no span");
        assert!(
            d.help.as_deref().is_some_and(|h| h.contains("at most")
                || h.contains("from 0 to")
                || h.contains("from 0% to")),
            "field {{{i}}}: help {:?}",
            d.help
        );
    }
}

#[test]
fn limits_are_inclusive_and_the_next_value_is_refused() {
    let cases: &[(usize, &str, &str)] = &[
        (0, "4096", "4097"),
        (6, "4096", "4097"),
        (7, "65536", "65537"),
        (8, "16777216", "16777217"),
        (9, "1000000", "1000001"),
        (30, "16777216", "16777217"),
        (36, "100", "101"),
    ];
    for &(i, ok, bad) in cases {
        let mut v = sane();
        v[i] = ok.to_string();
        if i == 6 {
            // A replica of 4096 GPUs needs a pool that large.
            v[0] = "4096".to_string();
        }
        let c = compile_str("edge.kiln", &fill(&v));
        assert!(
            !c.diagnostics
                .items
                .iter()
                .any(|d| d.code == Code::OutOfRange),
            "field {{{i}}} = {ok}: {:?}",
            c.diagnostics.items
        );
        v[i] = bad.to_string();
        let c = compile_str("edge.kiln", &fill(&v));
        assert!(
            c.diagnostics
                .items
                .iter()
                .any(|d| d.code == Code::OutOfRange),
            "field {{{i}}} = {bad}: {:?}",
            c.diagnostics.items
        );
    }
}

#[test]
fn gpus_over_all_pools_are_bounded() {
    let pool = |i: usize| format!("pool p{i} {{ gpus 4096 kind \"H100-80GB\" memory 80GB }}\n");
    let body = r#"
model m { variant fp16 { memory 40GB pools [p0] } }
tier chat { priority 100 slo { ttft 500ms } }
tenant app { owner "a@example.com" tiers [chat] }
classify { default => tier chat }
route chat m { default => fp16 }
"#;
    let at_limit: String = (0..16).map(pool).collect::<String>() + body;
    let c = compile_str("fleet.kiln", &at_limit);
    assert!(
        !c.diagnostics
            .items
            .iter()
            .any(|d| d.code == Code::OutOfRange),
        "{:?}",
        c.diagnostics.items
    );
    let over: String = (0..17).map(pool).collect::<String>() + body;
    let c = compile_str("fleet.kiln", &over);
    let d = c
        .diagnostics
        .items
        .iter()
        .find(|d| d.code == Code::OutOfRange)
        .expect("the 17th pool is out of range");
    assert!(d.help.as_deref().is_some_and(|h| h.contains("65536")));
}

#[test]
fn hostile_policies_compile_and_plan_quickly() {
    let started = Instant::now();
    // At every limit at once: the largest plan a policy can ask for.
    let pools: String = (0..16)
        .map(|i| format!("pool p{i} {{ gpus 4096 kind \"H100-80GB\" memory 80GB }}\n"))
        .collect();
    let list: Vec<String> = (0..16).map(|i| format!("p{i}")).collect();
    let text = format!(
        "{pools}
model m {{ variant fp16 {{ memory 40GB max_batch 65536 max_batch_tokens 16777216 pools [{}] }} }}
tier chat {{ priority 1000000 slo {{ ttft 500ms }} }}
tenant app {{ owner \"a@example.com\" tiers [chat] }}
classify {{ default => tier chat }}
route chat m {{
{}  default => fp16
}}
",
        list.join(", "),
        list.iter()
            .map(|p| format!("  when pool({p}).utilization < 50% => fp16 on {p}\n"))
            .collect::<String>()
    );
    let n = plan(&text).expect("plans");
    assert_eq!(n, limits::MAX_REPLICAS);
    // The finding: a pool of 10^26 GPUs is refused, never planned.
    let mut v = sane();
    v[0] = "99999999999999999999999999".to_string();
    assert_eq!(plan(&fill(&v)), None);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn the_planner_bounds_a_graph_built_without_the_compiler() {
    let c = compile_str("sane.kiln", &fill(&sane()));
    let mut g = c.graph.expect("graph");
    for p in &mut g.pools {
        p.gpus = u32::MAX;
    }
    let (plan, _) = deploy::plan(&g, &PoolBackends::new(), None).expect("plan");
    // 2 GPUs a replica on the first pool, capped at the pool limit.
    assert_eq!(plan.replicas.len(), limits::MAX_POOL_GPUS as usize / 2);
    // A replica of zero GPUs always "fits": it must never be placed (it
    // would be placed without end), whatever the cost model says.
    for v in &mut g.models[0].variants {
        v.gpus_per_replica = 0;
    }
    #[derive(Debug)]
    struct Flat;
    impl StepCost for Flat {
        fn step_time(&self, _: u32, _: u32, _: u64) -> f64 {
            0.01
        }
    }
    let plan = Plan::from_graph(&g, |_, _, _| {
        Some(Costing {
            cost: Arc::new(Flat),
            kv_capacity: 1 << 20,
        })
    });
    assert!(plan.replicas.is_empty(), "{}", plan.replicas.len());
}

/// A number as a policy might spell it: mostly small, sometimes enormous.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[1-9][0-9]{0,2}",
        1 => "[1-9][0-9]{3,9}",
        1 => "[1-9][0-9]{10,40}",
        1 => "[0-9]{1,6}\\.[0-9]{1,3}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_numbers_in_every_field_never_panic_or_overplan(
        picks in proptest::collection::vec(proptest::option::weighted(0.3, number()), FIELDS)
    ) {
        let values: Vec<String> = picks
            .into_iter()
            .zip(SANE)
            .map(|(p, s)| p.unwrap_or_else(|| s.to_string()))
            .collect();
        if let Some(n) = plan(&fill(&values)) {
            prop_assert!(n <= limits::MAX_REPLICAS);
            prop_assert!(n <= 2 * limits::MAX_POOL_GPUS as usize);
        }
    }
}
