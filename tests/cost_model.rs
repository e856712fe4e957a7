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
