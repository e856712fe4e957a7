//! `kiln calibrate`: measure step times over a grid of batch sizes and
//! context lengths, fit the simulator's roofline to them, report the
//! simulator's error on held-back steps, and write a calibration TOML; or,
//! with `--from-log`, fit it to the times a gateway's decision logs
//! recorded for its HTTP upstreams.

use super::*;
use crate::backend::cost::calibrate::{self, CalibrateError, Calibrated, GridLimits};
use crate::backend::cost::ReplicaModel;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CalBackend {
    /// Measure the roofline model itself (no GPU; fitting must recover it).
    Sim,
    /// Measure a transformer-shaped workload on a GPU (`--features cuda`).
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where the steps run.
    #[arg(long, value_enum, required_unless_present = "from_log")]
    pub backend: Option<CalBackend>,
    /// Fit every (pool, model, variant) served in these decision logs
    /// (`kiln serve`'s JSONL) instead of measuring steps: the times the
    /// gateway recorded for its HTTP upstreams. Malformed lines are skipped
    /// and counted.
    #[arg(long = "from-log", value_name = "LOG", num_args = 1.., conflicts_with_all = ["backend", "model", "variant", "pool"])]
    pub from_log: Vec<PathBuf>,
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// The model to calibrate.
    #[arg(long, required_unless_present = "from_log")]
    pub model: Option<String>,
    /// Its variant.
    #[arg(long, required_unless_present = "from_log")]
    pub variant: Option<String>,
    /// The pool (default: the variant's first pool).
    #[arg(long)]
    pub pool: Option<String>,
    /// Write the fitted calibration here (for `kiln simulate --calibration`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A calibration applied to the policy first (model sizes; with
    /// --backend sim, the simulated device's figures: the truth to recover;
    /// with --from-log, the figures the fit starts from and the file it
    /// extends: its other tables are written back as they are).
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// --backend sim: relative noise (standard deviation) on each step time.
    #[arg(long, default_value_t = 0.0)]
    pub noise: f64,
    /// --backend sim: seed of the noise.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// --backend cuda: the device ordinal (see `kiln gpus`).
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// --backend cuda: run this fraction of the model's layers (default:
    /// all that fit the GPU).
    #[arg(long)]
    pub scale: Option<f64>,
    /// --backend cuda: timed runs per step; the median is kept.
    #[arg(long, default_value_t = 5)]
    pub repeats: u32,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

pub fn run(a: Args) -> i32 {
    if !(a.noise.is_finite() && (0.0..0.5).contains(&a.noise)) {
        return usage_error("--noise must be a number in [0, 0.5)");
    }
    let g = match compile_one(&a.policy) {
        Ok((_, g)) => g,
        Err(code) => return code,
    };
    let cost = match cost_model(&g, a.calibration.as_ref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if !a.from_log.is_empty() {
        return run_from_log(&a, &g, &cost);
    }
    let (Some(backend), Some(model_name), Some(variant_name)) =
        (a.backend, a.model.clone(), a.variant.clone())
    else {
        return usage_error("give --backend, --model and --variant, or --from-log LOG…");
    };
    let Some(m) = g.model_id(&model_name) else {
        let known: Vec<&str> = g.models.iter().map(|m| m.name.as_str()).collect();
        return usage_error(&format!(
            "the policy has no model `{}`; its models: {}",
            model_name,
            known.join(", ")
        ));
    };
    let model = &g.models[usize::from(m)];
    let Some(v) = model.variants.iter().position(|v| v.name == variant_name) else {
        let known: Vec<&str> = model.variants.iter().map(|v| v.name.as_str()).collect();
        return usage_error(&format!(
            "model `{}` has no variant `{}`; its variants: {}",
            model_name,
            variant_name,
            known.join(", ")
        ));
    };
    let variant = &model.variants[v];
    let pool_names = |ids: &[crate::graph::PoolId]| -> String {
        ids.iter()
            .filter_map(|p| g.pools.get(usize::from(*p)).map(|p| p.name.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let p = match &a.pool {
        Some(name) => match g.pool_id(name) {
            Some(p) => p,
            None => {
                let all: Vec<crate::graph::PoolId> = (0..g.pools.len())
                    .map(|i| i as crate::graph::PoolId)
                    .collect();
                return usage_error(&format!(
                    "the policy has no pool `{name}`; its pools: {}",
                    pool_names(&all)
                ));
            }
        },
        None => match variant.pools.first() {
            Some(&p) => p,
            None => return usage_error("the variant runs on no pool"),
        },
    };
    let Some(replica) = cost.replica(m, v as u16, p) else {
        return usage_error(&format!(
            "{}.{} does not run on pool `{}`; its pools: {}",
            model_name,
            variant_name,
            g.pools
                .get(usize::from(p))
                .map(|p| p.name.as_str())
                .unwrap_or("?"),
            pool_names(&variant.pools)
        ));
    };
    let result = match backend {
        CalBackend::Sim => Ok(run_sim(&a, replica)),
        CalBackend::Cuda => run_cuda(&a, replica),
    };
    let cal = match result {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_FINDINGS;
        }
        Err(code) => return code,
    };
    report(&a, &cal)
}

/// `--backend sim`: the roofline "measures" itself.
fn run_sim(a: &Args, r: &ReplicaModel) -> Result<Calibrated, CalibrateError> {
    let points = calibrate::grid(&GridLimits::of(r));
    let ms = calibrate::measure_sim(r, &points, a.noise, a.seed);
    let text = format!(
        "the roofline model itself: {:.1}B params on {} GPU(s), {:.1} GB of weights, {:.0} KB of KV per token",
        r.params / 1e9,
        r.tp,
        r.weight_bytes / 1e9,
        r.kv_bytes_per_token / 1e3
    );
    let mut notes = Vec::new();
    if a.noise > 0.0 {
        notes.push(format!(
            "simulated measurements carry {:.1}% noise (seed {})",
            a.noise * 100.0,
            a.seed
        ));
    }
    calibrate::calibrate("sim", None, text, r, &ms, notes)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(a: &Args, r: &ReplicaModel) -> Result<Result<Calibrated, CalibrateError>, i32> {
    let _ = (a, r);
    Err(usage_error(super::gpus::NO_FEATURE))
}

/// `--backend cuda`: the transformer-shaped workload on a GPU.
#[cfg(feature = "cuda")]
fn run_cuda(a: &Args, r: &ReplicaModel) -> Result<Result<Calibrated, CalibrateError>, i32> {
    use crate::backend::cost::calibrate::TransformerShape;
    use crate::backend::cost::{kv_scale, GpuSpec};
    use crate::backend::cuda::device::describe;
    use crate::backend::cuda::{CudaReplica, CudaReplicaConfig};
    let fail = |e: crate::backend::cuda::CudaError| {
        eprintln!("{:?}", miette::Report::new(e));
        EXIT_USAGE
    };
    crate::backend::cuda::ensure_driver().map_err(fail)?;
    crate::backend::cuda::ensure_cublas().map_err(fail)?;
    let kv16 = r.kv_bytes_per_token / kv_scale(r.precision);
    let shape = match TransformerShape::for_model(&r.model_name, r.params, kv16, r.tp) {
        Ok(s) => s,
        Err(e) => return Ok(Err(e)),
    };
    let cfg = CudaReplicaConfig::for_variant(r, a.device, a.scale);
    eprintln!("allocating {} on GPU {} …", shape.describe(), cfg.device);
    let mut rep = CudaReplica::new(&cfg, &shape).map_err(fail)?;
    let plan = *rep.plan();
    let limits = GridLimits {
        max_step_tokens: rep.max_step_tokens(),
        max_batch: if r.max_batch == 0 { 256 } else { r.max_batch },
        kv_tokens: rep.kv_capacity_tokens(),
    };
    let points = calibrate::grid(&limits);
    let show = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let ms = rep
        .measure(&points, a.repeats, |done, total| {
            if show {
                eprint!("\rmeasuring steps: {done}/{total}");
                if done == total {
                    eprintln!();
                }
            }
        })
        .map_err(fail)?;
    let device = rep.device().clone();
    drop(rep);
    let workload = plan.shape.workload_model(r);
    let text = format!(
        "{}; {:.1} GB of weights, KV arena of {} tokens ({:.1} GB)",
        plan.shape.describe(),
        plan.weight_bytes as f64 / 1e9,
        plan.kv_tokens,
        plan.kv_bytes as f64 / 1e9
    );
    let mut notes = Vec::new();
    notes.extend(plan.note());
    if !matches!(
        r.precision,
        crate::graph::Precision::Bf16 | crate::graph::Precision::Fp16
    ) {
        notes.push(format!(
            "the workload runs bf16 GEMMs: mfu measured at the bf16 rate is applied to {}'s peak by the simulator",
            r.precision.name()
        ));
    }
    if r.tp > 1 {
        notes.push(format!(
            "measured one GPU's 1/{} tensor-parallel shard; communication between GPUs is not measured",
            r.tp
        ));
    }
    if let Some(spec) = GpuSpec::builtin(&device.name) {
        if spec.name != r.gpu.name {
            notes.push(format!(
                "measured on a {} but pool `{}` is {}: the factors are relative to the {} datasheet",
                spec.name, r.pool_name, r.gpu.name, r.gpu.name
            ));
        }
    }
    Ok(calibrate::calibrate(
        "cuda",
        Some(describe(&device)),
        text,
        &workload,
        &ms,
        notes,
    ))
}

/// Prints the report, writes the file; exit 1 when the held-back error
/// misses the target.
fn report(a: &Args, cal: &Calibrated) -> i32 {
    match a.format {
        Format::Human => print!("{}", calibrate::render(&cal.report)),
        Format::Json => {
            let v = serde_json::json!({
                "report": cal.report,
                "calibration": cal.toml,
            });
            match serde_json::to_string_pretty(&v) {
                Ok(s) => println!("{s}"),
                Err(e) => return usage_error(&e.to_string()),
            }
        }
    }
    match &a.out {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &cal.toml) {
                return usage_error(&format!("cannot write {}: {e}", path.display()));
            }
            eprintln!(
                "wrote {0}; use it with `kiln simulate --calibration {0}`",
                path.display()
            );
        }
        None if a.format == Format::Human => {
            print!("\ncalibration (write it with --out FILE):\n{}", cal.toml);
        }
        None => {}
    }
    if cal.report.meets_target() {
        EXIT_OK
    } else {
        eprintln!(
            "warning: the held-back median error {:.1}% is above the {:.0}% target",
            cal.report.held_back.median * 100.0,
            calibrate::TARGET_MEDIAN_ERROR * 100.0
        );
        EXIT_FINDINGS
    }
}

/// The held-back median error (TTFT and end-to-end on the replica) a fit
/// from logs should reach; exit 1 when a group misses it.
pub const LOG_TARGET_MEDIAN_ERROR: f64 = 0.15;

/// `--from-log`: fit every (pool, model, variant) in the logs.
fn run_from_log(
    a: &Args,
    g: &crate::graph::DecisionGraph,
    cost: &crate::backend::cost::CostModel,
) -> i32 {
    use crate::backend::cost::{from_log, Calibration};
    let base = match &a.calibration {
        Some(p) => match Calibration::load(p) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("{:?}", miette::Report::new(e));
                return EXIT_FINDINGS;
            }
        },
        None => None,
    };
    let mut traces = Vec::new();
    let mut malformed = 0;
    for p in &a.from_log {
        let opts = crate::traffic::ReadOptions {
            skip_malformed: true,
        };
        match crate::traffic::read_with(p, opts) {
            Ok(l) => {
                malformed += l.skipped.len();
                traces.push(l.records);
            }
            Err(e) => {
                eprintln!("{:?}", miette::Report::new(e));
                return EXIT_USAGE;
            }
        }
    }
    let mut records = crate::traffic::merge(traces);
    crate::traffic::rebase_wall_clock(&mut records);
    let fit = match from_log::calibrate_from_log(g, cost, base.as_ref(), &records, malformed) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_FINDINGS;
        }
    };
    let files: Vec<String> = a.from_log.iter().map(|p| p.display().to_string()).collect();
    let mut toml = format!(
        "# kiln calibration fitted by `kiln calibrate --from-log` to {} ({} lines, {} skipped).\n",
        files.join(", "),
        fit.report.lines,
        fit.report.skipped.total()
    );
    for gf in &fit.report.groups {
        toml.push_str(&format!(
            "# {}.{} on {}: {} lines; held-back median error TTFT {:.1}% (before {:.1}%), end-to-end {:.1}% (before {:.1}%).\n",
            gf.model,
            gf.variant,
            gf.pool,
            gf.lines,
            gf.after.ttft.median * 100.0,
            gf.before.ttft.median * 100.0,
            gf.after.e2e.median * 100.0,
            gf.before.e2e.median * 100.0
        ));
    }
    toml.push('\n');
    toml.push_str(&fit.calibration.to_toml());
    match a.format {
        Format::Human => print!("{}", from_log::render(&fit.report)),
        Format::Json => {
            let v = serde_json::json!({ "report": fit.report, "calibration": toml });
            match serde_json::to_string_pretty(&v) {
                Ok(s) => println!("{s}"),
                Err(e) => return usage_error(&e.to_string()),
            }
        }
    }
    match &a.out {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &toml) {
                return usage_error(&format!("cannot write {}: {e}", path.display()));
            }
            eprintln!(
                "wrote {0}; use it with `kiln simulate --calibration {0}`",
                path.display()
            );
        }
        None if a.format == Format::Human => {
            print!("\ncalibration (write it with --out FILE):\n{toml}");
        }
        None => {}
    }
    let missed: Vec<String> = fit
        .report
        .groups
        .iter()
        .filter(|gf| {
            gf.after.ttft.median > LOG_TARGET_MEDIAN_ERROR
                || gf.after.e2e.median > LOG_TARGET_MEDIAN_ERROR
        })
        .map(|gf| format!("{}.{} on {}", gf.model, gf.variant, gf.pool))
        .collect();
    if missed.is_empty() {
        EXIT_OK
    } else {
        eprintln!(
            "warning: held-back median error above {:.0}% for {}",
            LOG_TARGET_MEDIAN_ERROR * 100.0,
            missed.join(", ")
        );
        EXIT_FINDINGS
    }
}
