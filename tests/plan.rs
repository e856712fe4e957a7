//! `kiln plan` on a slice of the real Azure 2023 trace: the plan is checked
//! by simulating it again, independently of the search, at the planned size
//! (every tier meets its SLOs) and with one replica fewer in each pool that
//! has more than one (some tier misses).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

use kiln::backend::cost::CostModel;
use kiln::graph::DecisionGraph;
use kiln::ops::plan::{self, CapacityPlan, Options, Planner};
use kiln::replay::{self, capacity};
use kiln::sched::Config;
use kiln::traffic::{self, Record};
use std::path::Path;
use std::sync::{Arc, OnceLock};

const POLICY: &str = include_str!("../examples/azure-two-pools/two-pools.kiln");

fn graph() -> DecisionGraph {
    let c = kiln::compile::compile_str("two-pools.kiln", POLICY);
    c.graph.expect("policy compiles")
}

fn records() -> Vec<Record> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/traces/azure-plan");
    traffic::merge(["conv.jsonl", "code.jsonl"].map(|f| traffic::read(dir.join(f)).expect("slice")))
}

/// The plan of the slice, made once for every test here (a search is a
/// few replays).
fn the_plan() -> &'static CapacityPlan {
    static PLAN: OnceLock<CapacityPlan> = OnceLock::new();
    PLAN.get_or_init(|| {
        let g = graph();
        let cost = CostModel::from_graph(&g, None).unwrap();
        Planner::new(g, &cost, &records(), Options::default())
            .unwrap()
            .plan(|_, _, _| {})
            .unwrap()
    })
}

/// Replays the policy with the pools at `gpus` (by pool order), at the
/// plan's headroom, the way `kiln simulate --scale 1.2` does, and judges it.
fn judge_at(
    g: &DecisionGraph,
    cost: &CostModel,
    records: &[Record],
    gpus: &[u32],
) -> capacity::Verdict {
    let mut g = g.clone();
    for (p, &n) in g.pools.iter_mut().zip(gpus) {
        p.gpus = n;
    }
    let g = Arc::new(g);
    let r = replay::replay_at(&g, cost, records, Config::default(), "kiln", 1.2, |_, _| {});
    capacity::judge(&r, capacity::Thresholds::default())
}

#[test]
fn the_plan_meets_its_slos_and_one_replica_fewer_does_not() {
    let g = graph();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let records = records();
    let p = the_plan();
    assert!(!p.budget_exhausted, "{p:#?}");
    assert!(p.replays <= 40);
    let gpus: Vec<u32> = p.pools.iter().map(|x| x.gpus).collect();
    // Whole gangs: the variants need 2 GPUs a replica.
    assert!(gpus.iter().all(|n| n % 2 == 0 && *n >= 2), "{gpus:?}");
    let at_plan = judge_at(&g, &cost, &records, &gpus);
    assert!(at_plan.pass, "planned {gpus:?}: {at_plan:?}");
    let mut shrunk_any = false;
    for (i, pool) in p.pools.iter().enumerate() {
        if pool.replicas <= 1 {
            continue;
        }
        shrunk_any = true;
        let mut fewer = gpus.clone();
        fewer[i] -= pool.gpus_per_round;
        let v = judge_at(&g, &cost, &records, &fewer);
        assert!(
            !v.pass,
            "{} one replica fewer ({fewer:?}) passes",
            pool.pool
        );
        // The plan says so too.
        assert_eq!(pool.one_smaller.as_ref().map(|c| c.pass), Some(false));
        assert_eq!(pool.binding_tier, v.binding);
    }
    for pool in p.pools.iter().filter(|x| x.replicas == 1) {
        // At one replica the binding tier is one that ran there: the
        // batch pool serves only the batch tier.
        if pool.pool == "a100" {
            assert_eq!(pool.binding_tier.as_deref(), Some("batch"));
        }
    }
    assert!(
        shrunk_any,
        "the slice should need more than one replica somewhere: {gpus:?}"
    );
}

#[test]
fn reports_snapshot() {
    let p = the_plan();
    insta::assert_snapshot!("plan_markdown", plan::render(p, true));
    insta::assert_json_snapshot!("plan_json", p);
    let svg = plan::svg(p).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // A dot per evaluated point and tier, and one legend dot per tier.
    let tiers: std::collections::BTreeSet<&String> =
        p.points.iter().flat_map(|x| x.attainment.keys()).collect();
    assert_eq!(
        svg.matches("<circle").count(),
        p.points.iter().map(|x| x.attainment.len()).sum::<usize>() + tiers.len()
    );
    for t in tiers {
        assert!(svg.contains(&format!("\n{t}\n</text>")), "legend lacks {t}");
    }
    assert!(svg.contains(&format!("planned: {} GPUs", p.total_gpus)));
    assert!(svg.contains("ttft 99%") && svg.contains("total GPUs"));
    assert!(!svg.contains("NaN") && !svg.contains("inf"));
}

#[test]
fn gpu_kind_what_if_and_its_errors() {
    let mut g = graph();
    plan::apply_gpu_kinds(&mut g, &[("a100".into(), "H200-SXM".into())]).unwrap();
    let a100 = g.pools.iter().find(|p| p.name == "a100").unwrap();
    assert_eq!((a100.kind.as_str(), a100.gpu_memory), ("H200-SXM", 141e9));
    let e = plan::apply_gpu_kinds(&mut g, &[("nope".into(), "H100".into())]).unwrap_err();
    assert!(e.to_string().contains("`nope`"), "{e}");
    let e = plan::apply_gpu_kinds(&mut g, &[("h100".into(), "Z80".into())]).unwrap_err();
    assert!(e.to_string().contains("Z80"), "{e}");
}

#[test]
fn a_plan_that_cannot_pass_names_the_failing_tier() {
    // A TTFT no prefill of these prompts can meet, whatever the GPUs.
    let text = POLICY.replace("ttft 1s", "ttft 1ms");
    let g = kiln::compile::compile_str("two-pools.kiln", &text)
        .graph
        .expect("policy compiles");
    let cost = CostModel::from_graph(&g, None).unwrap();
    let few: Vec<Record> = records().into_iter().take(20).collect();
    let opts = Options {
        max_gpus_per_pool: 64,
        ..Options::default()
    };
    let e = Planner::new(g, &cost, &few, opts)
        .unwrap()
        .plan(|_, _, _| {})
        .unwrap_err();
    match e {
        plan::PlanError::Infeasible { tier, gpus } => {
            assert_eq!(tier, "interactive");
            assert_eq!(gpus, 2 * 64, "both pools at the upper bound");
        }
        e => panic!("{e:?}"),
    }
}
