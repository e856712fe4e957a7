//! Sanity figures of the cost model against hand-computed rooflines.

use super::*;
use crate::graph::{DecisionGraph, Precision};
use std::path::PathBuf;

fn policy(dir: &str) -> DecisionGraph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies")
        .join(dir);
    let compiled = crate::compile::compile(crate::compile::load(&[path]).unwrap());
    compiled.graph.unwrap()
}

fn enterprise() -> DecisionGraph {
    policy("enterprise")
}

fn ids(g: &DecisionGraph, model: &str, variant: &str, pool: &str) -> (u16, u16, u16) {
    let m = g.model_id(model).unwrap();
    let v = g.models[m as usize]
        .variants
        .iter()
        .position(|v| v.name == variant)
        .unwrap() as u16;
    (m, v, g.pool_id(pool).unwrap())
}

fn replica(g: &DecisionGraph, cost: &CostModel, m: &str, v: &str, p: &str) -> ReplicaModel {
    let (m, v, p) = ids(g, m, v, p);
    cost.replica(m, v, p).unwrap().clone()
}

fn ms(s: f64) -> f64 {
    s * 1e3
}

#[test]
fn llama70b_fp16_decode_batch1_on_2xh100_is_about_26ms() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let r = replica(&g, &cost, "llama-70b", "fp16", "h100");
    assert_eq!(r.tp, 2);
    assert_eq!(r.gpu.name, "H100-SXM");
    assert_eq!(r.weight_bytes, 140e9);
    // 140 GB / (2 × 3.35 TB/s × 0.8) = 26.12 ms of weight streaming.
    let c = r.step_cost(0, 0, 1, 0);
    assert!((ms(c.memory) - 26.119).abs() < 0.01, "{c:?}");
    assert!(c.memory > c.compute);
    let t = ms(r.decode_step_time(1, 1000));
    assert!((26.0..29.0).contains(&t), "{t} ms");
    // 1000 tokens of context add 1000 × 320 KB / 5.36 TB/s = 0.06 ms.
    let extra = t - ms(r.decode_step_time(1, 0));
    assert!((extra - 0.0597).abs() < 0.001, "{extra}");
}

#[test]
fn llama70b_fp16_prefill_1k_is_order_100ms() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let r = replica(&g, &cost, "llama-70b", "fp16", "h100");
    // 2 × 70e9 × 1000 / (2 × 989.4 TFLOP/s × 0.5) = 141.5 ms, compute-bound.
    let c = r.step_cost(1000, 0, 0, 0);
    assert!(c.compute > c.memory);
    let linear = 2.0 * 70e9 * 1000.0 / (2.0 * 989.4e12 * 0.5);
    assert!(c.compute >= linear && c.compute < linear * 1.05, "{c:?}");
    let t = ms(r.prefill_time(1000));
    assert!((100.0..200.0).contains(&t), "{t} ms");
    // Below the ridge point the weight read bounds a prefill.
    assert!(r.prefill_time(1) >= c.memory);
}

#[test]
fn int4_decodes_faster_than_fp16() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fp16 = replica(&g, &cost, "llama-70b", "fp16", "h100");
    let int8 = replica(&g, &cost, "llama-70b", "int8", "h100");
    let int4 = replica(&g, &cost, "llama-70b", "int4", "h100");
    assert_eq!(int4.weight_bytes, 35e9);
    assert_eq!(int8.weight_bytes, 70e9);
    for b in [1, 8, 32] {
        let ctx = u64::from(b) * 1024;
        // Same GPU count per token served: int4 on one GPU streams 35 GB,
        // fp16 streams 70 GB per GPU on two.
        assert!(int4.decode_step_time(b, ctx) < fp16.decode_step_time(b, ctx));
        assert!(int4.decode_step_time(b, ctx) < int8.decode_step_time(b, ctx));
    }
    // 35 GB / (3.35 TB/s × 0.8) = 13.06 ms.
    let c = int4.step_cost(0, 0, 1, 0);
    assert!((ms(c.memory) - 13.06).abs() < 0.01, "{c:?}");
}

#[test]
fn kv_capacity_is_positive_and_limited_by_memory() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fp16 = replica(&g, &cost, "llama-70b", "fp16", "h100");
    // (2 × 80 GB × 0.9 − 140 GB) / 320 KB = 12,500 tokens.
    let cap = fp16.kv_capacity_tokens().unwrap();
    assert!((12_499..=12_500).contains(&cap), "{cap}");
    assert_eq!(fp16.max_concurrent_tokens(), cap);
    assert!(fp16.weights_fit());
    // Never more than memory allows.
    let used = fp16.weight_bytes + cap as f64 * fp16.kv_bytes_per_token;
    assert!(used <= fp16.usable_memory());
    // int4 on one H100: (72 − 35) GB / 320 KB = 115,625 tokens.
    let int4 = replica(&g, &cost, "llama-70b", "int4", "h100");
    let cap4 = int4.kv_capacity_tokens().unwrap();
    assert!((115_624..=115_625).contains(&cap4), "{cap4}");
    // On an L40S: (43.2 − 35) GB / 320 KB = 25,625 tokens.
    let l40s = replica(&g, &cost, "llama-70b", "int4", "shared");
    let capl = l40s.kv_capacity_tokens().unwrap();
    assert!((25_624..=25_625).contains(&capl), "{capl}");
    // The sustainable batch is bound by the KV cache at long contexts.
    assert_eq!(fp16.sustainable_batch(4096), 3);
    assert_eq!(fp16.sustainable_batch(16), fp16.max_batch);
}

#[test]
fn bigger_batch_higher_throughput_longer_step() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    for r in cost.replicas() {
        let mut prev_step = 0.0;
        let mut prev_tput = 0.0;
        for b in [1u32, 2, 4, 8, 16, 32, 64, 128, 256] {
            let step = r.decode_step_time(b, u64::from(b) * 512);
            let tput = r.throughput_estimate(b, 512);
            assert!(step > prev_step, "{}: step at {b}", r.model_name);
            assert!(tput > prev_tput, "{}: throughput at {b}", r.model_name);
            prev_step = step;
            prev_tput = tput;
        }
    }
    let r = replica(&g, &cost, "llama-8b", "fp16", "h100");
    // 16 GB / 2.68 TB/s + 1 ms ≈ 7 ms: ~140 tokens/s alone, thousands at 64.
    assert!((130.0..150.0).contains(&r.throughput_estimate(1, 512)));
    assert!(r.throughput_estimate(64, 512) > 5000.0);
    assert!(r.peak_throughput(512) >= r.throughput_estimate(64, 512));
}

#[test]
fn h200_decodes_faster_than_h100() {
    let g = enterprise();
    let mut g200 = g.clone();
    let h100 = g.pool_id("h100").unwrap() as usize;
    g200.pools[h100].kind = "H200-141GB".into();
    g200.pools[h100].gpu_memory = 141e9;
    let a = CostModel::from_graph(&g, None).unwrap();
    let b = CostModel::from_graph(&g200, None).unwrap();
    for (m, v) in [
        ("llama-70b", "fp16"),
        ("llama-70b", "int4"),
        ("llama-8b", "fp16"),
    ] {
        let r100 = replica(&g, &a, m, v, "h100");
        let r200 = replica(&g200, &b, m, v, "h100");
        assert_eq!(r200.gpu.name, "H200-SXM");
        for bs in [1, 16, 64] {
            let ctx = u64::from(bs) * 2048;
            assert!(r200.decode_step_time(bs, ctx) < r100.decode_step_time(bs, ctx));
        }
        // Same tensor cores: a long prefill takes the same time.
        assert_eq!(r200.prefill_time(4096), r100.prefill_time(4096));
        assert!(r200.max_concurrent_tokens() > r100.max_concurrent_tokens());
    }
    // 140 GB / (2 × 4.8 TB/s × 0.8) = 18.2 ms.
    let r = replica(&g200, &b, "llama-70b", "fp16", "h100");
    assert!((ms(r.step_cost(0, 0, 1, 0).memory) - 18.229).abs() < 0.01);
}

#[test]
fn unknown_gpu_kind_is_an_error() {
    let mut g = enterprise();
    let shared = g.pool_id("shared").unwrap() as usize;
    g.pools[shared].kind = "TPU-v5e".into();
    let err = CostModel::from_graph(&g, None).unwrap_err();
    match &err {
        SimError::UnknownGpuKind { pool, kind, known } => {
            assert_eq!(pool, "shared");
            assert_eq!(kind, "TPU-v5e");
            assert!(known.contains("L40S") && known.contains("H200"), "{known}");
        }
        other => panic!("{other:?}"),
    }
    // A calibration can describe it.
    let cal = Calibration::from_toml_str(
        "[gpu.TPU-v5e]\nhbm_bandwidth = 819e9\ndense_bf16_flops = 197e12\nmemory = 16e9\n",
    )
    .unwrap();
    let mut g = g.clone();
    g.pools[shared].gpu_memory = 48e9;
    let cost = CostModel::from_graph(&g, Some(&cal)).unwrap();
    assert_eq!(cost.gpu(shared as u16).unwrap().hbm_bandwidth, 819e9);
}

#[test]
fn missing_sizes_are_estimated_with_a_warning() {
    let mut g = enterprise();
    let m = g.model_id("llama-8b").unwrap() as usize;
    g.models[m].params = None;
    g.models[m].kv_per_token = None;
    let cost = CostModel::from_graph(&g, None).unwrap();
    assert_eq!(cost.warnings.len(), 2, "{:?}", cost.warnings);
    assert!(cost.warnings[0].contains("llama-8b") && cost.warnings[0].contains("params"));
    // fp16 18GB → about 7.6B parameters; the KV estimate follows from it.
    let (_, v, p) = ids(&g, "llama-8b", "fp16", "h100");
    let r = cost.replica(m as u16, v, p).unwrap();
    assert!((7.0e9..8.5e9).contains(&r.params), "{}", r.params);
    assert!(
        (100e3..140e3).contains(&r.kv_bytes_per_token),
        "{}",
        r.kv_bytes_per_token
    );
    // The calibration may supply what the policy lacks; then nothing is guessed.
    let cal = Calibration::from_toml_str("[model.llama-8b]\nparams = 8e9\nkv_per_token = 131072\n")
        .unwrap();
    assert!(CostModel::from_graph(&g, Some(&cal))
        .unwrap()
        .warnings
        .is_empty());
    // A model with no variant memory to go by is still an error naming it.
    let mut g = enterprise();
    g.models[m].params = None;
    for v in &mut g.models[m].variants {
        v.memory = 0.0;
    }
    let err = CostModel::from_graph(&g, None).unwrap_err();
    assert!(matches!(&err, SimError::MissingParams { model } if model == "llama-8b"));
    let help = miette::Diagnostic::help(&err).unwrap().to_string();
    assert!(
        help.contains("params 70B") && help.contains("llama-8b"),
        "{help}"
    );
}

#[test]
fn weights_that_do_not_fit_are_an_error() {
    let mut g = enterprise();
    let (m, v, _) = ids(&g, "llama-70b", "fp16", "h100");
    g.models[m as usize].variants[v as usize].gpus_per_replica = 1;
    let err = CostModel::from_graph(&g, None).unwrap_err();
    match err {
        SimError::WeightsDoNotFit {
            model,
            variant,
            pool,
            weights_gb,
            usable_gb,
            ..
        } => {
            assert_eq!(
                (model.as_str(), variant.as_str(), pool.as_str()),
                ("llama-70b", "fp16", "h100")
            );
            assert_eq!(weights_gb, 140.0);
            assert!((usable_gb - 72.0).abs() < 1e-9);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn precision_rules() {
    assert_eq!(bytes_per_param(Precision::Fp32), 4.0);
    assert_eq!(bytes_per_param(Precision::Bf16), 2.0);
    assert_eq!(bytes_per_param(Precision::Fp16), 2.0);
    assert_eq!(bytes_per_param(Precision::Fp8), 1.0);
    assert_eq!(bytes_per_param(Precision::Int8), 1.0);
    assert_eq!(bytes_per_param(Precision::Int4), 0.5);
    assert_eq!(kv_scale(Precision::Fp8), 0.5);
    assert_eq!(kv_scale(Precision::Int4), 1.0);
    assert_eq!(kv_scale(Precision::Int8), 1.0);
    let g = policy("batch-platform");
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fp8 = replica(&g, &cost, "llama-405b", "fp8", "h200");
    assert_eq!(fp8.kv_bytes_per_token, 252e3);
    assert_eq!(fp8.weight_bytes, 405e9);
    assert_eq!(fp8.tp, 8);
    let a100 = cost.gpu(g.pool_id("a100").unwrap()).unwrap();
    assert_eq!(a100.fp8_flops, a100.dense_bf16_flops);
}

#[test]
fn every_shipped_policy_builds() {
    for dir in ["enterprise", "batch-platform", "split"] {
        let g = policy(dir);
        let cost = CostModel::from_graph(&g, None).unwrap();
        let n: usize = g
            .models
            .iter()
            .flat_map(|m| &m.variants)
            .map(|v| v.pools.len())
            .sum();
        assert_eq!(cost.replicas().count(), n, "{dir}");
        for r in cost.replicas() {
            assert!(r.max_concurrent_tokens() > 0, "{dir} {}", r.model_name);
            assert_eq!(cost.replica(r.model, r.variant, r.pool), Some(r));
        }
    }
}

#[test]
fn lookup_out_of_range_is_none() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let (m, v, _) = ids(&g, "llama-70b", "fp16", "h100");
    let shared = g.pool_id("shared").unwrap();
    assert!(
        cost.replica(m, v, shared).is_none(),
        "fp16 may not run on shared"
    );
    assert!(cost.replica(m, 99, 0).is_none());
    assert!(cost.replica(99, 0, 0).is_none());
    assert!(cost.replica(m, v, 99).is_none());
}

#[test]
fn empty_step_is_free_and_chunked_prefill_adds_up() {
    let g = enterprise();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let r = replica(&g, &cost, "llama-70b", "int4", "h100");
    assert_eq!(r.step_time(0, 0, 0), 0.0);
    assert_eq!(r.step_time(0, 0, 10_000), 0.0);
    // 20k tokens in 8k chunks: three steps, later chunks attend further.
    let chunked = r.ttft_estimate(20_000);
    let sum = r.prefill_chunk_time(8192, 0)
        + r.prefill_chunk_time(8192, 8192)
        + r.prefill_chunk_time(20_000 - 16_384, 16_384);
    assert!((chunked - sum).abs() < 1e-12);
    assert!(chunked > r.prefill_time(20_000) - 1e-9);
    // A mixed step costs more than either part alone, less than both.
    let mixed = r.step_time(512, 32, 32 * 1024);
    let prefill = r.step_time(512, 0, 0);
    let decode = r.step_time(0, 32, 32 * 1024);
    assert!(mixed >= prefill && mixed >= decode && mixed < prefill + decode);
}

#[test]
fn calibration_changes_times() {
    let g = enterprise();
    let base = CostModel::from_graph(&g, None).unwrap();
    let cal = Calibration::from_toml_str(
        "[efficiency]\nmbu = 0.4\n\n[model.llama-70b.variant.fp16]\ntime_factor = 2.0\n",
    )
    .unwrap();
    let cost = CostModel::from_graph(&g, Some(&cal)).unwrap();
    let a = replica(&g, &base, "llama-8b", "fp16", "h100");
    let b = replica(&g, &cost, "llama-8b", "fp16", "h100");
    // Half the bandwidth: the memory-bound part doubles.
    let (ca, cb) = (a.step_cost(0, 0, 1, 0), b.step_cost(0, 0, 1, 0));
    assert!((cb.memory / ca.memory - 2.0).abs() < 1e-12);
    let a = replica(&g, &base, "llama-70b", "fp16", "h100");
    let b = replica(&g, &cost, "llama-70b", "fp16", "h100");
    assert!(b.decode_step_time(1, 0) > 2.0 * a.decode_step_time(1, 0));

    let typo = Calibration::from_toml_str("\n[model.llama-7b]\nparams = 7e9\n").unwrap();
    match CostModel::from_graph(&g, Some(&typo)).unwrap_err() {
        SimError::Calibration(e) => {
            assert_eq!(e.line, 2, "{e:?}");
            assert!(e.help.as_deref().unwrap_or("").contains("llama-70b"));
        }
        other => panic!("{other:?}"),
    }
    let typo = Calibration::from_toml_str("[model.llama-70b.variant.fp17]\nmbu = 0.5\n").unwrap();
    assert!(matches!(
        CostModel::from_graph(&g, Some(&typo)),
        Err(SimError::Calibration(_))
    ));
}

#[test]
fn example_calibration_parses_and_applies() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/calibration.toml");
    let cal = Calibration::load(&path).unwrap();
    let g = enterprise();
    assert!(CostModel::from_graph(&g, Some(&cal)).is_ok());
}
