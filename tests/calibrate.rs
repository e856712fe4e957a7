//! Calibration without a GPU: the fit recovers known roofline parameters
//! from synthetic measurements (exact and noisy), `kiln calibrate --backend
//! sim` runs the whole command path and writes a file `kiln simulate`
//! accepts, and the CUDA commands fail with a clear error (never a panic)
//! on a machine without a driver, or without the `cuda` feature.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::calibrate::{
    self, fit, grid, holdout_error, measure_sim, split_holdout, with_efficiency, GridLimits,
    StepShape,
};
use kiln::backend::cost::{
    Calibration, CostModel, Efficiency, GpuSpec, ReplicaInputs, ReplicaModel,
};
use kiln::graph::Precision;
use std::path::{Path, PathBuf};
use std::process::Command;

fn kiln(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("run kiln");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// An 8B bf16 replica on an H100 whose true factors are not the defaults.
fn truth(tp: u32) -> ReplicaModel {
    ReplicaModel::new(ReplicaInputs {
        model: 0,
        variant: 0,
        pool: 0,
        model_name: "m".into(),
        variant_name: "v".into(),
        pool_name: "p".into(),
        gpu: GpuSpec::builtin("H100-80GB").unwrap(),
        gpu_memory: 80e9,
        precision: Precision::Bf16,
        tp,
        params: 8e9,
        kv_bytes_per_token: 131_072.0,
        attention_flops_per_pair: 1_048_576.0,
        efficiency: Efficiency {
            mbu: 0.72,
            mfu: 0.61,
            step_overhead: 0.0004,
            ..Efficiency::default()
        },
        time_factor: 1.0,
        max_batch: 256,
        max_batch_tokens: 8192,
    })
}

#[test]
fn fit_recovers_known_parameters() {
    for tp in [1, 2] {
        let r = truth(tp);
        let points = grid(&GridLimits::of(&r));
        assert!(points.len() >= 20, "{}", points.len());
        let ms = measure_sim(&r, &points, 0.0, 0);
        let (train, held) = split_holdout(&ms);
        let f = fit(&StepShape::of(&r), &train).unwrap();
        assert!(
            (f.bandwidth / r.effective_bandwidth - 1.0).abs() < 1e-6,
            "{f:?}"
        );
        assert!((f.flops / r.effective_flops - 1.0).abs() < 1e-6, "{f:?}");
        assert!((f.overhead - 0.0004).abs() < 1e-9, "{f:?}");
        let (eff, notes) = f.efficiency(&r.gpu, r.precision, r.tp, Efficiency::default());
        assert!(notes.is_empty(), "{notes:?}");
        assert!(
            (eff.mbu - 0.72).abs() < 1e-5 && (eff.mfu - 0.61).abs() < 1e-5,
            "{eff:?}"
        );
        let e = holdout_error(&with_efficiency(&r, eff), &held);
        assert!(e.points >= 6 && e.max < 1e-4, "{e:?}");
    }
}

#[test]
fn noisy_measurements_stay_within_target() {
    let r = truth(1);
    let points = grid(&GridLimits::of(&r));
    for seed in 0..8 {
        let ms = measure_sim(&r, &points, 0.05, seed);
        let cal = calibrate::calibrate("sim", None, "test".into(), &r, &ms, Vec::new()).unwrap();
        let rep = &cal.report;
        assert!(rep.meets_target(), "seed {seed}: {:?}", rep.held_back);
        assert!(
            rep.held_back.median < 0.08,
            "seed {seed}: {:?}",
            rep.held_back
        );
        // 5% noise moves the fitted factors by a few percent at most; the
        // 0.4 ms overhead is within noise of the smallest step (~5 ms).
        let e = rep.efficiency;
        eprintln!("seed {seed}: {e:?} {:?}", rep.held_back);
        assert!((e.mbu / 0.72 - 1.0).abs() < 0.06, "seed {seed}: {e:?}");
        assert!((e.mfu / 0.61 - 1.0).abs() < 0.10, "seed {seed}: {e:?}");
        assert!(e.step_overhead < 0.0015, "seed {seed}: {e:?}");
    }
}

#[test]
fn wrong_factors_show_in_the_held_back_error() {
    // The built-in factors (mbu 0.8, mfu 0.5, 1 ms) are off for this
    // replica; the report shows them worse than the fitted ones.
    let r = truth(1);
    let ms = measure_sim(&r, &grid(&GridLimits::of(&r)), 0.0, 0);
    let cal = calibrate::calibrate("sim", None, "test".into(), &r, &ms, Vec::new()).unwrap();
    assert!(
        cal.report.defaults.median > 0.05,
        "{:?}",
        cal.report.defaults
    );
    assert!(cal.report.held_back.median < 1e-4);
    // And the file it writes is a calibration the simulator accepts.
    let c = Calibration::from_toml_str(&cal.toml).unwrap();
    let eff = c.variant_efficiency("m", "v");
    assert!((eff.mbu - 0.72).abs() < 1e-5 && (eff.step_overhead - 0.0004).abs() < 1e-9);
}

fn diff_old() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/diff/old/enterprise.kiln")
}

#[test]
fn calibrate_sim_report() {
    let (code, out, err) = kiln(&[
        "calibrate",
        "--backend",
        "sim",
        "--policy",
        "policies/enterprise",
        "--model",
        "llama-8b",
        "--variant",
        "fp16",
        "--noise",
        "0.03",
        "--seed",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    insta::assert_snapshot!("calibrate_sim_report", out);
}

#[test]
fn calibrate_sim_recovers_a_calibration_and_simulate_accepts_it() {
    let truth = tmp("truth.toml");
    std::fs::write(
        &truth,
        "[model.llama-70b.variant.fp16]\nmbu = 0.7\nmfu = 0.62\nstep_overhead_ms = 2.5\n",
    )
    .unwrap();
    let out = tmp("fitted.toml");
    let (code, stdout, err) = kiln(&[
        "calibrate",
        "--backend",
        "sim",
        "--policy",
        "examples/diff/old",
        "--model",
        "llama-70b",
        "--variant",
        "fp16",
        "--pool",
        "h100",
        "--calibration",
        truth.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("target: median ≤ 10%): met"), "{stdout}");
    assert!(err.contains("wrote"), "{err}");
    let c = Calibration::load(&out).unwrap();
    let g = kiln::compile::compile(kiln::compile::load(&[diff_old()]).unwrap())
        .graph
        .unwrap();
    let cost = CostModel::from_graph(&g, Some(&c)).unwrap();
    let m = g.model_id("llama-70b").unwrap();
    let r = cost.replica(m, 0, g.pool_id("h100").unwrap()).unwrap();
    assert!((r.efficiency.mbu - 0.7).abs() < 1e-5, "{:?}", r.efficiency);
    assert!((r.efficiency.mfu - 0.62).abs() < 1e-5, "{:?}", r.efficiency);
    assert!((r.efficiency.step_overhead - 0.0025).abs() < 1e-8);
    let (code, _, err) = kiln(&[
        "simulate",
        "--policy",
        "examples/diff/old",
        "--traffic",
        "examples/diff/traffic.jsonl",
        "--calibration",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn calibrate_names_what_is_unknown() {
    let (code, _, err) = kiln(&[
        "calibrate",
        "--backend",
        "sim",
        "--policy",
        "policies/enterprise",
        "--model",
        "llama-9b",
        "--variant",
        "fp16",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("no model `llama-9b`") && err.contains("llama-8b"),
        "{err}"
    );
    let (code, _, err) = kiln(&[
        "calibrate",
        "--backend",
        "sim",
        "--policy",
        "policies/enterprise",
        "--model",
        "llama-70b",
        "--variant",
        "fp16",
        "--pool",
        "shared",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("does not run on pool `shared`"), "{err}");
}

/// Without the driver (this machine, CI) `kiln gpus` and `kiln calibrate
/// --backend cuda` exit 2 with the clear error; without the feature they
/// say so. On a GPU machine `kiln gpus` lists the devices.
#[test]
fn cuda_commands_fail_cleanly_without_a_gpu() {
    let (code, out, err) = kiln(&["gpus"]);
    assert!(!err.contains("panicked"), "{err}");
    let (ccode, _, cerr) = kiln(&[
        "calibrate",
        "--backend",
        "cuda",
        "--policy",
        "policies/enterprise",
        "--model",
        "llama-8b",
        "--variant",
        "fp16",
    ]);
    assert!(!cerr.contains("panicked"), "{cerr}");
    if cfg!(feature = "cuda") {
        if code == 0 {
            assert!(out.starts_with("GPU 0"), "{out}");
            return;
        }
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("no CUDA driver found; use the sim or http backend")
                || err.contains("the CUDA driver sees no GPU"),
            "{err}"
        );
        if err.contains("no CUDA driver found") {
            assert_eq!(ccode, 2, "{cerr}");
            assert!(cerr.contains("no CUDA driver found"), "{cerr}");
        }
    } else {
        assert_eq!(code, 2);
        assert!(err.contains("built without `--features cuda`"), "{err}");
        assert_eq!(ccode, 2);
        assert!(cerr.contains("built without `--features cuda`"), "{cerr}");
    }
}

/// A decision log of examples/llama's upstream written from a known cost
/// model: one request at a time (no queueing), so each line's TTFT is a
/// prefill and its inter-token time a batch-1 decode. Plus lines a real
/// log holds that the fit must skip: a malformed one and a refused one.
fn llama_log(truth: &ReplicaModel) -> String {
    let mut s = String::new();
    let mut at = 1_764_720_000_000.0; // wall clock, as the gateway stamps it
    for i in 0..60u32 {
        let prompt = 20 + (i * 37) % 400;
        let out = 4 + (i * 13) % 60;
        let ttft = truth.prefill_time(prompt) * 1e3;
        let ctx = u64::from(prompt + out / 2);
        let e2e = ttft + f64::from(out - 1) * truth.decode_step_time(1, ctx) * 1e3;
        s.push_str(&format!(
            "{{\"v\":1,\"at_ms\":{at:.3},\"tenant\":\"chat-app\",\"model\":\"smollm2\",\"prompt_tokens\":{prompt},\"max_tokens\":{out},\"output_tokens\":{out},\"decision\":{{\"tier\":\"interactive\",\"route\":\"smollm2.q4 on cpu\",\"admission\":\"accept\",\"status\":200}},\"queue_ms\":0.2,\"ttft_ms\":{:.3},\"e2e_ms\":{:.3}}}\n",
            ttft + 0.2,
            e2e + 0.2
        ));
        at += e2e + 500.0;
    }
    s.push_str("{\"v\":1,\"at_ms\":\n");
    s.push_str(&format!("{{\"v\":1,\"at_ms\":{at:.3},\"tenant\":\"chat-app\",\"model\":\"smollm2\",\"prompt_tokens\":10,\"decision\":{{\"admission\":\"reject\",\"status\":429,\"reason\":\"quota\"}}}}\n"));
    s
}

#[test]
fn calibrate_from_log_fits_an_upstream_and_simulate_accepts_the_file() {
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama");
    let g = kiln::compile::compile(kiln::compile::load(&[policy]).unwrap())
        .graph
        .unwrap();
    let base = Calibration::load(Path::new("examples/llama/calibration.toml")).unwrap();
    // The "engine": twice the example's overhead, a third of its bandwidth.
    let truth_cal = Calibration::from_toml_str(
        "[gpu.CPU]\nhbm_bandwidth = 10e9\ndense_bf16_flops = 100e9\nmemory = 2e9\n\
         [model.smollm2.variant.q4]\nmbu = 0.27\nmfu = 0.4\nstep_overhead_ms = 14.0\n",
    )
    .unwrap();
    let cost = CostModel::from_graph(&g, Some(&truth_cal)).unwrap();
    let truth = cost.replica(0, 0, 0).unwrap().clone();
    let log = tmp("llama-decisions.jsonl");
    std::fs::write(&log, llama_log(&truth)).unwrap();
    let out = tmp("llama-fitted.toml");
    let (code, stdout, err) = kiln(&[
        "calibrate",
        "--from-log",
        log.to_str().unwrap(),
        "--policy",
        "examples/llama",
        "--calibration",
        "examples/llama/calibration.toml",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stdout}\n{err}");
    assert!(stdout.contains("1 malformed, 1 not served"), "{stdout}");
    assert!(stdout.contains("smollm2.q4 on pool cpu"), "{stdout}");
    // The fitted file keeps the base's GPU table and predicts the truth.
    let fitted = Calibration::load(&out).unwrap();
    assert_eq!(fitted.gpus, base.gpus);
    let cost = CostModel::from_graph(&g, Some(&fitted)).unwrap();
    let r = cost.replica(0, 0, 0).unwrap();
    for (what, got, want) in [
        ("prefill 300", r.prefill_time(300), truth.prefill_time(300)),
        ("prefill 40", r.prefill_time(40), truth.prefill_time(40)),
        (
            "decode",
            r.decode_step_time(1, 200),
            truth.decode_step_time(1, 200),
        ),
    ] {
        assert!(
            (got / want - 1.0).abs() < 0.05,
            "{what}: {got} vs {want}\n{stdout}"
        );
    }
    let (code, _, err) = kiln(&[
        "simulate",
        "--policy",
        "examples/llama",
        "--traffic",
        log.to_str().unwrap(),
        "--skip-malformed",
        "--calibration",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");

    // --from-log takes the place of --backend, --model and --variant.
    let (code, _, err) = kiln(&[
        "calibrate",
        "--from-log",
        log.to_str().unwrap(),
        "--policy",
        "examples/llama",
        "--backend",
        "sim",
    ]);
    assert_eq!(code, 2, "{err}");
}
