//! Calibration: fitting the simulator's roofline to measured step times.
//!
//! Everything here is pure, GPU-free f64 arithmetic, so it builds and is
//! tested without the `cuda` feature. `kiln calibrate` measures steps over a
//! [`grid`] of batch sizes and context lengths (on a GPU with
//! `--backend cuda`, or on the roofline model itself with `--backend sim`),
//! [`fit`]s the three figures the roofline has per replica, and reports the
//! simulator's error on held-back grid points ([`holdout_error`]).
//!
//! **The model fitted** is the simulator's own ([`super::replica`]):
//!
//! ```text
//! t = max(bytes / B, flops / F) + o
//! bytes = weight_bytes + C × kv_bytes_per_token
//! flops = 2 × params × (p + b) + attention_flops_per_pair × (p(p+1)/2 + C)
//! ```
//!
//! with `B` the effective memory bandwidth, `F` the effective FLOP/s and `o`
//! the fixed cost of a step. Those map onto the calibration TOML's
//! per-variant `mbu = B / (tp × hbm_bandwidth)`, `mfu = F / (tp ×
//! flops(precision))` and `step_overhead_ms = o`: nothing new in the file
//! format.
//!
//! **How the fit works.** For given `(B, F)` a step is memory-bound exactly
//! when its arithmetic intensity `flops / bytes` is below `F / B`, so the
//! split of the points into memory- and compute-bound is a threshold on
//! intensity. With the split fixed, the model is linear in `(1/B, 1/F, o)`.
//! [`fit`] tries every threshold (n + 1 at most), solves each by weighted
//! least squares on relative error, keeps the best by the true `max()`
//! objective, then re-splits by the fitted `F / B` until stable.
//!
//! **The CUDA workload's shape** ([`TransformerShape`]) is derived from the
//! model's parameter count and KV bytes per token, since a policy gives no
//! layer count or width; see [`TransformerShape::for_model`] for the rule.

use super::{compute_rate, Efficiency, GpuSpec, ReplicaInputs, ReplicaModel};
use crate::graph::Precision;
use miette::Diagnostic;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use std::fmt::Write as _;

/// The median absolute error on held-back points a calibration must reach.
pub const TARGET_MEDIAN_ERROR: f64 = 0.10;

/// Bytes of one element of the CUDA workload's tensors (bf16).
pub const WORKLOAD_ELEMENT_BYTES: f64 = 2.0;

/// Tokens in one KV-cache block of the CUDA backend's arena.
pub const KV_BLOCK_TOKENS: u32 = 16;

/// Why a calibration could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Diagnostic)]
pub enum CalibrateError {
    #[error("{points} usable measurements; the fit needs at least 3")]
    #[diagnostic(
        code(kiln::calibrate::too_few_points),
        help("measure more grid points: at least one memory-bound (small decode batch) and one compute-bound (large prefill) step")
    )]
    TooFewPoints { points: usize },

    #[error(
        "measurement {index} ({label}) took {seconds} s, which is not a positive, finite time"
    )]
    #[diagnostic(
        code(kiln::calibrate::bad_measurement),
        help("drop the measurement, or measure again: step times must be finite and positive")
    )]
    BadMeasurement {
        index: usize,
        label: String,
        seconds: f64,
    },

    #[error("the measurements do not pin down the roofline: {reason}")]
    #[diagnostic(
        code(kiln::calibrate::not_identifiable),
        help("the grid needs both memory-bound steps (decodes at small batch) and compute-bound steps (prefills of thousands of tokens)")
    )]
    NotIdentifiable { reason: String },

    #[error("model `{model}`: {reason}")]
    #[diagnostic(
        code(kiln::calibrate::bad_model),
        help("give the model `params` (e.g. `params 8B`) and `kv_per_token` (e.g. `kv_per_token 128KB`) in the policy or the calibration")
    )]
    BadModel { model: String, reason: String },

    #[error(
        "{what} does not fit: it needs {need_gb:.1} GB but {usable_gb:.1} GB are usable on the GPU"
    )]
    #[diagnostic(
        code(kiln::calibrate::does_not_fit),
        help("run a fraction of the model's layers (`--scale 0.5`), or pick a smaller variant; usable memory is the GPU's free memory less the activation reserve")
    )]
    DoesNotFit {
        what: String,
        need_gb: f64,
        usable_gb: f64,
    },
}

// ---- steps and measurements ------------------------------------------------

/// One continuous-batching step: `prefill_tokens` new prompt tokens (a
/// chunk starting its prompt) and `decode_seqs` decodes over
/// `context_tokens` cached tokens in total, the arguments of
/// [`ReplicaModel::step_time`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StepPoint {
    pub prefill_tokens: u32,
    pub decode_seqs: u32,
    pub context_tokens: u64,
}

impl StepPoint {
    pub fn prefill(tokens: u32) -> StepPoint {
        StepPoint {
            prefill_tokens: tokens,
            decode_seqs: 0,
            context_tokens: 0,
        }
    }

    /// `batch` decodes with `context` cached tokens each.
    pub fn decode(batch: u32, context: u64) -> StepPoint {
        StepPoint {
            prefill_tokens: 0,
            decode_seqs: batch,
            context_tokens: u64::from(batch) * context,
        }
    }

    /// Tokens the step feeds through the weights.
    pub fn tokens(&self) -> u32 {
        self.prefill_tokens.saturating_add(self.decode_seqs)
    }
}

/// A measured step time, seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Measurement {
    pub point: StepPoint,
    pub seconds: f64,
}

/// What a step moves and computes: the roofline's per-replica inputs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepShape {
    pub weight_bytes: f64,
    pub params: f64,
    pub kv_bytes_per_token: f64,
    pub attention_flops_per_pair: f64,
}

impl StepShape {
    /// The shape the simulator uses for a replica.
    pub fn of(r: &ReplicaModel) -> StepShape {
        StepShape {
            weight_bytes: r.weight_bytes,
            params: r.params,
            kv_bytes_per_token: r.kv_bytes_per_token,
            attention_flops_per_pair: r.attention_flops_per_pair,
        }
    }

    /// Bytes a step reads: all weights and the KV of its context.
    pub fn bytes(&self, s: &StepPoint) -> f64 {
        self.weight_bytes + s.context_tokens as f64 * self.kv_bytes_per_token
    }

    /// FLOPs of a step: the weight GEMMs and the attention pairs.
    pub fn flops(&self, s: &StepPoint) -> f64 {
        let p = f64::from(s.prefill_tokens);
        let b = f64::from(s.decode_seqs);
        let pairs = p * (p + 1.0) / 2.0 + s.context_tokens as f64;
        2.0 * self.params * (p + b) + self.attention_flops_per_pair * pairs
    }
}

// ---- the grid ----------------------------------------------------------------

/// What bounds the grid: the variant's step budgets and the KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridLimits {
    /// Most tokens in one step (`max_batch_tokens`).
    pub max_step_tokens: u32,
    /// Most sequences in one step (`max_batch`).
    pub max_batch: u32,
    /// KV-cache capacity, tokens.
    pub kv_tokens: u64,
}

/// Largest prefill the grid measures (and the CUDA workload sizes for).
pub const MAX_GRID_PREFILL: u32 = 8192;

impl GridLimits {
    /// The limits of a simulated replica: its batch budgets (0 meaning
    /// none) and KV capacity, prefill capped at [`MAX_GRID_PREFILL`].
    pub fn of(r: &ReplicaModel) -> GridLimits {
        let nonzero = |v: u32, d: u32| if v == 0 { d } else { v };
        GridLimits {
            max_step_tokens: nonzero(r.max_batch_tokens, MAX_GRID_PREFILL).min(MAX_GRID_PREFILL),
            max_batch: nonzero(r.max_batch, 256),
            kv_tokens: r.kv_capacity,
        }
    }
}

/// The calibration grid: prefills of 128 to 8192 tokens; decodes of 1, 4,
/// 16, 64 and 256 sequences at 512, 2048 and 8192 cached tokens each; two
/// mixed steps (a prefill chunk riding with decodes). Points beyond the
/// limits are left out. Ordered prefills, decodes, mixed, so that
/// [`split_holdout`] holds back some of each.
pub fn grid(l: &GridLimits) -> Vec<StepPoint> {
    let fits = |s: &StepPoint| {
        s.tokens() <= l.max_step_tokens
            && s.decode_seqs <= l.max_batch
            && s.context_tokens <= l.kv_tokens
            && s.tokens() > 0
    };
    let mut out = Vec::new();
    for p in [128, 256, 512, 1024, 2048, 4096, 8192] {
        out.push(StepPoint::prefill(p));
    }
    for b in [1, 4, 16, 64, 256] {
        for ctx in [512, 2048, 8192] {
            out.push(StepPoint::decode(b, ctx));
        }
    }
    out.push(StepPoint {
        prefill_tokens: 256,
        decode_seqs: 16,
        context_tokens: 16 * 1024,
    });
    out.push(StepPoint {
        prefill_tokens: 1024,
        decode_seqs: 64,
        context_tokens: 64 * 1024,
    });
    out.retain(fits);
    out
}

/// Splits measurements into the points fitted and the points held back:
/// every third (index 2, 5, 8, …) is held back.
pub fn split_holdout(ms: &[Measurement]) -> (Vec<Measurement>, Vec<Measurement>) {
    let mut fit = Vec::new();
    let mut held = Vec::new();
    for (i, m) in ms.iter().enumerate() {
        if i % 3 == 2 {
            held.push(*m);
        } else {
            fit.push(*m);
        }
    }
    (fit, held)
}

/// "Measures" the roofline model itself: each point's
/// [`ReplicaModel::step_time`], times `1 + noise × N(0, 1)` (seeded, so
/// reproducible; kept above 1% of the exact time).
pub fn measure_sim(
    r: &ReplicaModel,
    points: &[StepPoint],
    noise: f64,
    seed: u64,
) -> Vec<Measurement> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0.0, 1.0).ok();
    let noise = if noise.is_finite() {
        noise.max(0.0)
    } else {
        0.0
    };
    points
        .iter()
        .map(|s| {
            let exact = r.step_time(s.prefill_tokens, s.decode_seqs, s.context_tokens);
            let z: f64 = match &normal {
                Some(n) if noise > 0.0 => n.sample(&mut rng),
                _ => 0.0,
            };
            Measurement {
                point: *s,
                seconds: exact * (1.0 + noise * z).max(0.01),
            }
        })
        .collect()
}

// ---- the fit -----------------------------------------------------------------

/// The fitted roofline of one replica (or workload).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Fit {
    /// Effective memory bandwidth `B`, bytes/s.
    pub bandwidth: f64,
    /// Effective compute `F`, FLOP/s.
    pub flops: f64,
    /// Fixed cost of a step `o`, seconds.
    pub overhead: f64,
    /// Fitted points the fit calls memory-bound and compute-bound.
    pub memory_bound: usize,
    pub compute_bound: usize,
    /// Root-mean-square relative error on the fitted points.
    pub rms_error: f64,
}

impl Fit {
    /// The fitted model's time for a step of `shape`.
    pub fn predict(&self, shape: &StepShape, s: &StepPoint) -> f64 {
        (shape.bytes(s) / self.bandwidth).max(shape.flops(s) / self.flops) + self.overhead
    }

    /// The simulator's efficiency factors for this fit on `tp` GPUs of
    /// `gpu` running `precision` math: `mbu = B / (tp × hbm_bandwidth)`,
    /// `mfu = F / (tp × flops(precision))`, `step_overhead = o`, the rest
    /// from `base`. A factor above 1 (faster than the datasheet) cannot be
    /// written to a calibration file: it is clamped to 1 and a note says
    /// so. Values are rounded to what [`calibration_toml`] writes.
    pub fn efficiency(
        &self,
        gpu: &GpuSpec,
        precision: Precision,
        tp: u32,
        base: Efficiency,
    ) -> (Efficiency, Vec<String>) {
        let tp = f64::from(tp.max(1));
        let mut notes = Vec::new();
        let mut factor = |what: &str, got: f64, peak: f64, unit: &str| {
            let v = got / peak;
            if v > 1.0 {
                notes.push(format!(
                    "measured {what} {:.3} {unit} is above the datasheet's {:.3}: {} clamped to 1 (check the pool's GPU kind)",
                    got / 1e12,
                    peak / 1e12,
                    if what == "bandwidth" { "mbu" } else { "mfu" }
                ));
                1.0
            } else {
                round6(v).max(1e-6)
            }
        };
        let mbu = factor("bandwidth", self.bandwidth, tp * gpu.hbm_bandwidth, "TB/s");
        let mfu = factor(
            "compute",
            self.flops,
            tp * compute_rate(gpu, precision),
            "PFLOP/s",
        );
        let overhead_ms = round6(self.overhead.max(0.0) * 1e3);
        (
            Efficiency {
                mbu,
                mfu,
                step_overhead: overhead_ms / 1e3,
                ..base
            },
            notes,
        )
    }
}

fn round6(v: f64) -> f64 {
    (v * 1e6).round() / 1e6
}

/// Per point: bytes, FLOPs and the measured time.
#[derive(Clone, Copy)]
struct Obs {
    bytes: f64,
    flops: f64,
    t: f64,
}

/// `(1/B, 1/F, o)`.
type Theta = [f64; 3];

fn objective(obs: &[Obs], th: &Theta) -> f64 {
    obs.iter()
        .map(|o| {
            let pred = (o.bytes * th[0]).max(o.flops * th[1]) + th[2];
            let r = pred / o.t - 1.0;
            r * r
        })
        .sum()
}

/// Weighted least squares for a fixed split (`mem[i]`: point i is
/// memory-bound) on relative error; `None` when a class is empty or the
/// solution is not physical (a rate ≤ 0).
fn solve_split(obs: &[Obs], mem: &[bool]) -> Option<Theta> {
    let rows: Vec<[f64; 3]> = obs
        .iter()
        .zip(mem)
        .map(|(o, &m)| {
            if m {
                [o.bytes / o.t, 0.0, 1.0 / o.t]
            } else {
                [0.0, o.flops / o.t, 1.0 / o.t]
            }
        })
        .collect();
    // Columns differ by ~30 orders of magnitude: scale each to unit RMS.
    let mut scale = [0.0f64; 3];
    for r in &rows {
        for j in 0..3 {
            scale[j] += r[j] * r[j];
        }
    }
    for s in &mut scale {
        *s = (*s / rows.len().max(1) as f64).sqrt();
    }
    if scale[0] <= 0.0 || scale[1] <= 0.0 || !scale.iter().all(|s| s.is_finite()) {
        return None;
    }
    let solve = |cols: &[usize]| -> Option<Theta> {
        let k = cols.len();
        let mut a = [[0.0f64; 4]; 3];
        for r in &rows {
            let v: Vec<f64> = cols.iter().map(|&j| r[j] / scale[j]).collect();
            for i in 0..k {
                for j in 0..k {
                    a[i][j] += v[i] * v[j];
                }
                a[i][3] += v[i];
            }
        }
        let x = gauss(&mut a, k)?;
        let mut th = [0.0; 3];
        for (i, &j) in cols.iter().enumerate() {
            th[j] = x[i] / scale[j];
        }
        Some(th)
    };
    let mut th = solve(&[0, 1, 2])?;
    if th[2] < 0.0 {
        th = solve(&[0, 1])?;
    }
    (th[0] > 0.0 && th[1] > 0.0 && th.iter().all(|v| v.is_finite())).then_some(th)
}

/// Solves the `k`×`k` system in `a` (augmented in column 3) by Gaussian
/// elimination with partial pivoting; `None` when singular.
fn gauss(a: &mut [[f64; 4]; 3], k: usize) -> Option<[f64; 3]> {
    for c in 0..k {
        let p = (c..k).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        if a[p][c].abs() < 1e-12 {
            return None;
        }
        a.swap(c, p);
        let pivot = a[c];
        for (r, row) in a.iter_mut().enumerate().take(k) {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(pivot.iter()).take(k).skip(c) {
                    *x -= f * p;
                }
                row[3] -= f * pivot[3];
            }
        }
    }
    let mut x = [0.0; 3];
    for i in 0..k {
        x[i] = a[i][3] / a[i][i];
    }
    Some(x)
}

/// Fits `(B, F, o)` to measured steps of a replica of `shape`, minimising
/// the squared relative error of `max(bytes/B, flops/F) + o`. Needs at least
/// three measurements, positive and finite, spanning memory- and
/// compute-bound steps.
pub fn fit(shape: &StepShape, measurements: &[Measurement]) -> Result<Fit, CalibrateError> {
    for (i, m) in measurements.iter().enumerate() {
        if !(m.seconds.is_finite() && m.seconds > 0.0) {
            return Err(CalibrateError::BadMeasurement {
                index: i,
                label: label(&m.point),
                seconds: m.seconds,
            });
        }
    }
    if measurements.len() < 3 {
        return Err(CalibrateError::TooFewPoints {
            points: measurements.len(),
        });
    }
    let mut obs: Vec<Obs> = measurements
        .iter()
        .map(|m| Obs {
            bytes: shape.bytes(&m.point),
            flops: shape.flops(&m.point),
            t: m.seconds,
        })
        .collect();
    if obs
        .iter()
        .any(|o| !(o.bytes > 0.0 && o.flops > 0.0 && o.bytes.is_finite() && o.flops.is_finite()))
    {
        return Err(CalibrateError::NotIdentifiable {
            reason: "a step moves no bytes or does no FLOPs (params or weights of 0?)".into(),
        });
    }
    // Ascending arithmetic intensity: a split is a prefix.
    obs.sort_by(|a, b| (a.flops / a.bytes).total_cmp(&(b.flops / b.bytes)));
    let n = obs.len();
    let mut best: Option<(f64, Theta)> = None;
    let consider = |th: Theta, best: &mut Option<(f64, Theta)>| {
        let f = objective(&obs, &th);
        if f.is_finite() && best.as_ref().is_none_or(|(b, _)| f < *b) {
            *best = Some((f, th));
        }
    };
    for k in 1..n {
        let mem: Vec<bool> = (0..n).map(|i| i < k).collect();
        if let Some(th) = solve_split(&obs, &mem) {
            consider(th, &mut best);
        }
    }
    let Some((_, mut th)) = best else {
        return Err(CalibrateError::NotIdentifiable {
            reason: "no split of the steps into memory- and compute-bound gives positive rates"
                .into(),
        });
    };
    // Re-split by the fitted ridge point until the split is stable.
    for _ in 0..32 {
        let mem: Vec<bool> = obs
            .iter()
            .map(|o| o.bytes * th[0] >= o.flops * th[1])
            .collect();
        let Some(next) = solve_split(&obs, &mem) else {
            break;
        };
        if objective(&obs, &next) + 1e-15 < objective(&obs, &th) {
            th = next;
        } else {
            break;
        }
    }
    let memory_bound = obs
        .iter()
        .filter(|o| o.bytes * th[0] >= o.flops * th[1])
        .count();
    Ok(Fit {
        bandwidth: 1.0 / th[0],
        flops: 1.0 / th[1],
        overhead: th[2].max(0.0),
        memory_bound,
        compute_bound: n - memory_bound,
        rms_error: (objective(&obs, &th) / n as f64).sqrt(),
    })
}

// ---- errors --------------------------------------------------------------------

/// Absolute relative errors of a model over some steps.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ErrorStats {
    pub points: usize,
    pub median: f64,
    pub mean: f64,
    pub max: f64,
}

/// The simulator's signed relative error at one measured step:
/// `(simulated − measured) / measured`.
pub fn relative_error(model: &ReplicaModel, m: &Measurement) -> f64 {
    let s = &m.point;
    let sim = model.step_time(s.prefill_tokens, s.decode_seqs, s.context_tokens);
    sim / m.seconds - 1.0
}

/// How far the simulator running `model` is from the held-back
/// measurements: median, mean and max absolute relative error (all 0 for
/// no points).
pub fn holdout_error(model: &ReplicaModel, held: &[Measurement]) -> ErrorStats {
    let mut e: Vec<f64> = held
        .iter()
        .map(|m| relative_error(model, m).abs())
        .filter(|e| e.is_finite())
        .collect();
    e.sort_by(f64::total_cmp);
    let n = e.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => e[n / 2],
        _ => (e[n / 2 - 1] + e[n / 2]) / 2.0,
    };
    ErrorStats {
        points: n,
        median,
        mean: if n == 0 {
            0.0
        } else {
            e.iter().sum::<f64>() / n as f64
        },
        max: e.last().copied().unwrap_or(0.0),
    }
}

/// `r` with other efficiency factors and no time factor: the simulator's
/// replica under a calibration that sets them.
pub fn with_efficiency(r: &ReplicaModel, efficiency: Efficiency) -> ReplicaModel {
    ReplicaModel::new(ReplicaInputs {
        model: r.model,
        variant: r.variant,
        pool: r.pool,
        model_name: r.model_name.clone(),
        variant_name: r.variant_name.clone(),
        pool_name: r.pool_name.clone(),
        gpu: r.gpu.clone(),
        gpu_memory: r.memory_bytes / f64::from(r.tp.max(1)),
        precision: r.precision,
        tp: r.tp,
        params: r.params,
        kv_bytes_per_token: r.kv_bytes_per_token,
        attention_flops_per_pair: r.attention_flops_per_pair,
        efficiency,
        time_factor: 1.0,
        max_batch: r.max_batch,
        max_batch_tokens: r.max_batch_tokens,
    })
}

// ---- the CUDA workload's shape ---------------------------------------------------

/// The transformer the CUDA backend runs for a model variant, per GPU of
/// the replica (its tensor-parallel shard). All widths are multiples of 8
/// elements (16-byte aligned bf16 rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TransformerShape {
    /// Layers run (fewer than `model_layers` when scaled down).
    pub layers: u32,
    /// Layers of the model as estimated.
    pub model_layers: u32,
    /// Hidden size (not sharded).
    pub d_model: u32,
    /// Query width on this GPU: `kv_dim × q_per_kv`.
    pub q_dim: u32,
    /// K (and V) width on this GPU.
    pub kv_dim: u32,
    /// MLP intermediate width on this GPU (gate, up and down projections).
    pub ffn: u32,
    /// Query heads per KV head: columns of the attention GEMMs (even).
    pub q_per_kv: u32,
    /// Tensor-parallel degree the shard is of.
    pub tp: u32,
}

/// Per-layer parameters of a Llama-shaped layer in units of `d_model²`
/// (grouped-query attention with 8 query heads per KV head: q, o = d², k,
/// v = d²/8 each; SwiGLU MLP at 3.5 × d: 10.5 d²).
const LAYER_PARAMS_PER_D2: f64 = 12.75;

fn round_to(v: f64, m: u32) -> u32 {
    let m = f64::from(m);
    let r = (v / m).round().max(1.0) * m;
    if r >= f64::from(u32::MAX) {
        u32::MAX / 2
    } else {
        r as u32
    }
}

impl TransformerShape {
    /// The documented rule: a Llama-shaped model of `params` parameters and
    /// `kv16` KV bytes per token at 16-bit, sharded over `tp` GPUs.
    ///
    /// - layers `L = round((params / (12.75 × 128²))^(1/3))`: width grows
    ///   with depth as `d ≈ 128 × L` (Llama 3: 8B has 32 layers of 4096,
    ///   70B 80 of 8192, 405B 126 of 16384; this gives 34, 69 and 124);
    /// - `d_model = sqrt(params / (12.75 × L))`, rounded to 128;
    /// - `kv_dim = kv16 / (4 × L)` (K and V, 2 bytes each), rounded to 64;
    /// - `q_per_kv = d_model / kv_dim`, rounded to an even number ≥ 2, and
    ///   the query width `kv_dim × q_per_kv`;
    /// - the MLP width takes the parameters left: `ffn = (params / L −
    ///   d × (q + 2 kv) − q × d) / (3 d)`, rounded to 64 (embeddings are
    ///   folded in here);
    /// - per GPU: K/V, query and MLP widths divided by `tp` (rounded up to
    ///   8); `d_model` is not sharded.
    pub fn for_model(
        model: &str,
        params: f64,
        kv16: f64,
        tp: u32,
    ) -> Result<TransformerShape, CalibrateError> {
        let bad = |reason: String| CalibrateError::BadModel {
            model: model.to_string(),
            reason,
        };
        if !(1e6..=1e14).contains(&params) {
            return Err(bad(format!(
                "{params} parameters is not a model size the workload can shape (1M to 100T)"
            )));
        }
        if !(kv16.is_finite() && kv16 > 0.0) {
            return Err(bad(format!("{kv16} KV bytes per token is not positive")));
        }
        let tp = tp.max(1);
        let layers = (params / (LAYER_PARAMS_PER_D2 * 128.0 * 128.0))
            .cbrt()
            .round()
            .max(1.0);
        let d = round_to((params / (LAYER_PARAMS_PER_D2 * layers)).sqrt(), 128);
        let kv_full = round_to(kv16 / (4.0 * layers), 64);
        let ratio = f64::from(d) / f64::from(kv_full);
        let q_per_kv = ((ratio / 2.0).round() * 2.0).clamp(2.0, 256.0) as u32;
        let q_full = f64::from(kv_full) * f64::from(q_per_kv);
        let df = f64::from(d);
        let per_layer = params / layers;
        let attn = df * (q_full + 2.0 * f64::from(kv_full)) + q_full * df;
        let ffn_full = round_to(((per_layer - attn) / (3.0 * df)).max(64.0), 64);
        let shard = |v: u32| -> u32 {
            let s = v.div_ceil(tp);
            s.div_ceil(8).max(1) * 8
        };
        let kv_dim = shard(kv_full);
        Ok(TransformerShape {
            layers: layers as u32,
            model_layers: layers as u32,
            d_model: d,
            q_dim: kv_dim * q_per_kv,
            kv_dim,
            ffn: shard(ffn_full),
            q_per_kv,
            tp,
        })
    }

    /// The same shape with `layers` layers run (at least 1, at most the
    /// model's).
    pub fn with_layers(&self, layers: u32) -> TransformerShape {
        TransformerShape {
            layers: layers.clamp(1, self.model_layers.max(1)),
            ..*self
        }
    }

    /// Parameters of one layer on this GPU:
    /// `d × (q + 2 kv) + q × d + 3 × d × ffn`.
    pub fn layer_params(&self) -> f64 {
        let d = f64::from(self.d_model);
        let q = f64::from(self.q_dim);
        let kv = f64::from(self.kv_dim);
        let ffn = f64::from(self.ffn);
        d * (q + 2.0 * kv) + q * d + 3.0 * d * ffn
    }

    /// Parameters run on this GPU.
    pub fn params(&self) -> f64 {
        f64::from(self.layers) * self.layer_params()
    }

    pub fn weight_bytes(&self) -> f64 {
        self.params() * WORKLOAD_ELEMENT_BYTES
    }

    /// KV bytes per token on this GPU: K and V of every layer run.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers) * f64::from(self.kv_dim) * WORKLOAD_ELEMENT_BYTES
    }

    /// FLOPs per attention query×key pair: `4 × layers × kv_dim × q_per_kv`
    /// (QKᵀ and A·V, a multiply-add each, over the query width).
    pub fn attention_flops_per_pair(&self) -> f64 {
        4.0 * f64::from(self.layers) * f64::from(self.kv_dim) * f64::from(self.q_per_kv)
    }

    /// Query columns of a prefill chunk's attention GEMMs: with `p` keys,
    /// `q_per_kv × (p + 1) / 2` columns give the `p(p+1)/2` causal pairs
    /// exactly (`q_per_kv` is even).
    pub fn prefill_columns(&self, p: u32) -> u64 {
        u64::from(self.q_per_kv) * (u64::from(p) + 1) / 2
    }

    pub fn step_shape(&self) -> StepShape {
        StepShape {
            weight_bytes: self.weight_bytes(),
            params: self.params(),
            kv_bytes_per_token: self.kv_bytes_per_token(),
            attention_flops_per_pair: self.attention_flops_per_pair(),
        }
    }

    /// The simulator's model of this workload: `variant`'s names, GPU and
    /// efficiency, with this shape's sizes at bf16 on one GPU.
    pub fn workload_model(&self, variant: &ReplicaModel) -> ReplicaModel {
        ReplicaModel::new(ReplicaInputs {
            model: variant.model,
            variant: variant.variant,
            pool: variant.pool,
            model_name: variant.model_name.clone(),
            variant_name: variant.variant_name.clone(),
            pool_name: variant.pool_name.clone(),
            gpu: variant.gpu.clone(),
            gpu_memory: variant.memory_bytes / f64::from(variant.tp.max(1)),
            precision: Precision::Bf16,
            tp: 1,
            params: self.params(),
            kv_bytes_per_token: self.kv_bytes_per_token(),
            attention_flops_per_pair: self.attention_flops_per_pair(),
            efficiency: variant.efficiency,
            time_factor: 1.0,
            max_batch: variant.max_batch,
            max_batch_tokens: variant.max_batch_tokens,
        })
    }

    /// `34 layers × d 4352 (q 3840, kv 960, ffn 14848, 4 queries per KV), bf16`.
    pub fn describe(&self) -> String {
        let layers = if self.layers == self.model_layers {
            format!("{} layers", self.layers)
        } else {
            format!("{} of {} layers", self.layers, self.model_layers)
        };
        let tp = if self.tp > 1 {
            format!(", 1/{} tensor-parallel shard", self.tp)
        } else {
            String::new()
        };
        format!(
            "{layers} × d {} (q {}, kv {}, ffn {}, {} queries per KV){tp}, bf16",
            self.d_model, self.q_dim, self.kv_dim, self.ffn, self.q_per_kv
        )
    }
}

/// Element counts of the CUDA workload's activation buffers for steps of at
/// most `max_tokens` tokens and prefill chunks of at most `max_prefill`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Buffers {
    /// Two hidden-state buffers, each `max(d, q) × max_tokens`.
    pub hidden: u64,
    /// QKV projection output, `(q + 2 kv) × max_tokens`.
    pub qkv: u64,
    /// Gate and up projection output, `2 ffn × max_tokens`.
    pub mlp: u64,
    /// Query operand and attention output, `kv × columns` each.
    pub attn_io: u64,
    /// Prefill attention scores `p × columns(p)` at the largest prefill
    /// (decode scores, `context × q_per_kv`, are charged per KV token).
    pub prefill_scores: u64,
}

impl Buffers {
    pub fn new(s: &TransformerShape, max_tokens: u32, max_prefill: u32) -> Buffers {
        let n = u64::from(max_tokens.max(1));
        let cols = s.prefill_columns(max_prefill).max(u64::from(s.q_per_kv));
        Buffers {
            hidden: u64::from(s.d_model.max(s.q_dim)) * n,
            qkv: u64::from(s.q_dim + 2 * s.kv_dim) * n,
            mlp: 2 * u64::from(s.ffn) * n,
            attn_io: u64::from(s.kv_dim) * cols,
            prefill_scores: u64::from(max_prefill) * cols,
        }
    }

    /// Bytes of all of them (two hidden, two attention I/O buffers).
    pub fn bytes(&self) -> u64 {
        (2 * self.hidden + self.qkv + self.mlp + 2 * self.attn_io + self.prefill_scores)
            * WORKLOAD_ELEMENT_BYTES as u64
    }
}

/// How a workload uses one GPU's memory.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MemoryPlan {
    /// The shape run (layers scaled down when the model does not fit).
    pub shape: TransformerShape,
    /// `layers / model_layers`.
    pub scale: f64,
    pub weight_bytes: u64,
    pub buffers: Buffers,
    /// KV-cache arena: tokens (a whole number of blocks) and bytes,
    /// decode-score scratch included.
    pub kv_tokens: u64,
    pub kv_bytes: u64,
    /// Memory the plan may use.
    pub usable_bytes: u64,
}

/// Most KV tokens an arena holds (cuBLAS dimensions are 32-bit).
const MAX_KV_TOKENS: u64 = 1 << 30;

impl MemoryPlan {
    /// Bytes per KV-arena token: K and V of every layer, plus the decode
    /// attention's score column per query group.
    fn per_kv_token(s: &TransformerShape) -> u64 {
        s.kv_bytes_per_token() as u64 + u64::from(s.q_per_kv) * WORKLOAD_ELEMENT_BYTES as u64
    }

    /// Plans `full` on a GPU with `usable_bytes` for the workload: weights,
    /// activation buffers for steps of `max_tokens` (prefill chunks of
    /// `max_prefill`) and a KV arena of at least `min_kv_tokens`, the rest
    /// of the memory going to the arena. `scale` runs that fraction of the
    /// layers; `None` runs all that fit (all when the model fits).
    pub fn new(
        full: &TransformerShape,
        usable_bytes: u64,
        max_tokens: u32,
        max_prefill: u32,
        min_kv_tokens: u64,
        scale: Option<f64>,
    ) -> Result<MemoryPlan, CalibrateError> {
        let buffers = Buffers::new(full, max_tokens, max_prefill.min(max_tokens));
        let fixed = buffers.bytes();
        let per_layer_weights = (full.layer_params() * WORKLOAD_ELEMENT_BYTES) as u64;
        let one = full.with_layers(1);
        let per_layer_kv = one.kv_bytes_per_token() as u64;
        let score_per_token = u64::from(full.q_per_kv) * WORKLOAD_ELEMENT_BYTES as u64;
        let need = |layers: u64| {
            layers * (per_layer_weights + min_kv_tokens * per_layer_kv)
                + fixed
                + min_kv_tokens * score_per_token
        };
        let layers = match scale {
            Some(s) => {
                if !(s.is_finite() && s > 0.0 && s <= 1.0) {
                    return Err(CalibrateError::DoesNotFit {
                        what: format!("a scale of {s} (must be in (0, 1])"),
                        need_gb: 0.0,
                        usable_gb: usable_bytes as f64 / 1e9,
                    });
                }
                let l = (f64::from(full.model_layers) * s).round().max(1.0) as u64;
                if need(l) > usable_bytes {
                    return Err(CalibrateError::DoesNotFit {
                        what: format!(
                            "{l} of {} layers with a {min_kv_tokens}-token KV cache",
                            full.model_layers
                        ),
                        need_gb: need(l) as f64 / 1e9,
                        usable_gb: usable_bytes as f64 / 1e9,
                    });
                }
                l
            }
            None => {
                let room = usable_bytes
                    .saturating_sub(fixed)
                    .saturating_sub(min_kv_tokens * score_per_token);
                let per = per_layer_weights + min_kv_tokens * per_layer_kv;
                let l = (room / per.max(1)).min(u64::from(full.model_layers));
                if l == 0 {
                    return Err(CalibrateError::DoesNotFit {
                        what: format!("even one layer with a {min_kv_tokens}-token KV cache"),
                        need_gb: need(1) as f64 / 1e9,
                        usable_gb: usable_bytes as f64 / 1e9,
                    });
                }
                l
            }
        };
        let shape = full.with_layers(layers as u32);
        let weight_bytes = layers * per_layer_weights;
        let per_token = MemoryPlan::per_kv_token(&shape);
        let left = usable_bytes.saturating_sub(weight_bytes + fixed);
        let block = u64::from(KV_BLOCK_TOKENS);
        let kv_tokens = ((left / per_token.max(1)).min(MAX_KV_TOKENS) / block) * block;
        Ok(MemoryPlan {
            shape,
            scale: f64::from(shape.layers) / f64::from(shape.model_layers.max(1)),
            weight_bytes,
            buffers,
            kv_tokens,
            kv_bytes: kv_tokens * per_token,
            usable_bytes,
        })
    }

    /// Says what was scaled, if anything.
    pub fn note(&self) -> Option<String> {
        (self.shape.layers < self.shape.model_layers).then(|| {
            format!(
                "scaled down: ran {} of the model's {} layers (×{:.2}, {:.1} GB of weights) to fit the GPU; \
                 the fitted rates are the GPU's, the step overhead is of the smaller model",
                self.shape.layers,
                self.shape.model_layers,
                self.scale,
                self.weight_bytes as f64 / 1e9
            )
        })
    }
}

// ---- the report and the file ---------------------------------------------------------

/// One row of the report: a measured step and the fitted simulator's time.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Row {
    pub point: StepPoint,
    pub measured: f64,
    pub simulated: f64,
    /// `(simulated − measured) / measured`.
    pub error: f64,
    pub held_back: bool,
}

/// Everything `kiln calibrate` prints.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// `sim` or `cuda`.
    pub backend: String,
    pub model: String,
    pub variant: String,
    pub pool: String,
    /// The GPU the efficiency factors are relative to (the pool's kind).
    pub gpu: GpuSpec,
    /// The device measured (`--backend cuda`).
    pub device: Option<String>,
    /// What ran.
    pub workload: String,
    pub rows: Vec<Row>,
    pub fit: Fit,
    /// The factors written (clamped and rounded).
    pub efficiency: Efficiency,
    /// Peak bandwidth and FLOP/s the factors multiply (`tp ×` the GPU's).
    pub peak_bandwidth: f64,
    pub peak_flops: f64,
    /// The precision whose tensor-core rate `mfu` is relative to.
    pub math_precision: String,
    /// The calibrated simulator on the held-back steps.
    pub held_back: ErrorStats,
    /// The simulator's built-in factors on the same steps, for comparison.
    pub defaults: ErrorStats,
    pub notes: Vec<String>,
}

impl Report {
    pub fn meets_target(&self) -> bool {
        self.held_back.median <= TARGET_MEDIAN_ERROR
    }
}

/// A finished calibration: the report and the TOML to write.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibrated {
    pub report: Report,
    pub toml: String,
}

/// Fits measurements of `workload` (the simulator's model of what ran:
/// the replica itself for `--backend sim`, [`TransformerShape::workload_model`]
/// for `--backend cuda`) and builds the report and calibration file for
/// `variant` (whose names the file uses).
pub fn calibrate(
    backend: &str,
    device: Option<String>,
    workload_text: String,
    workload: &ReplicaModel,
    measurements: &[Measurement],
    mut notes: Vec<String>,
) -> Result<Calibrated, CalibrateError> {
    let (train, held) = split_holdout(measurements);
    let shape = StepShape::of(workload);
    let f = fit(&shape, &train)?;
    let (efficiency, clamp_notes) = f.efficiency(
        &workload.gpu,
        workload.precision,
        workload.tp,
        workload.efficiency,
    );
    notes.extend(clamp_notes);
    let fitted = with_efficiency(workload, efficiency);
    let defaults = with_efficiency(workload, Efficiency::default());
    let held_set: Vec<bool> = (0..measurements.len()).map(|i| i % 3 == 2).collect();
    let rows = measurements
        .iter()
        .zip(&held_set)
        .map(|(m, &h)| {
            let s = &m.point;
            let simulated = fitted.step_time(s.prefill_tokens, s.decode_seqs, s.context_tokens);
            Row {
                point: *s,
                measured: m.seconds,
                simulated,
                error: simulated / m.seconds - 1.0,
                held_back: h,
            }
        })
        .collect();
    let tp = f64::from(workload.tp.max(1));
    let report = Report {
        backend: backend.to_string(),
        model: workload.model_name.clone(),
        variant: workload.variant_name.clone(),
        pool: workload.pool_name.clone(),
        gpu: workload.gpu.clone(),
        device,
        workload: workload_text,
        rows,
        fit: f,
        efficiency,
        peak_bandwidth: tp * workload.gpu.hbm_bandwidth,
        peak_flops: tp * compute_rate(&workload.gpu, workload.precision),
        math_precision: workload.precision.name().to_string(),
        held_back: holdout_error(&fitted, &held),
        defaults: holdout_error(&defaults, &held),
        notes,
    };
    let toml = calibration_toml(&report);
    Ok(Calibrated { report, toml })
}

/// A TOML key, quoted unless bare-safe.
fn toml_key(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        s.to_string()
    } else {
        let mut q = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => q.push_str("\\\""),
                '\\' => q.push_str("\\\\"),
                c if c.is_control() => {
                    let _ = write!(q, "\\u{:04X}", c as u32);
                }
                c => q.push(c),
            }
        }
        q.push('"');
        q
    }
}

/// Comment text on one line.
fn comment(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The calibration file: the variant's `mbu`, `mfu` and
/// `step_overhead_ms`, with what they came from in comments. `kiln
/// simulate --calibration` reads it as is.
pub fn calibration_toml(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# kiln calibration fitted by `kiln calibrate --backend {}` to {} measured steps.",
        r.backend,
        r.rows.len()
    );
    let _ = writeln!(
        s,
        "# {}.{} on pool {}; factors relative to {} ({:.3} TB/s, {:.1} TFLOP/s {}).",
        comment(&r.model),
        comment(&r.variant),
        comment(&r.pool),
        comment(&r.gpu.name),
        r.peak_bandwidth / 1e12,
        r.peak_flops / 1e12,
        r.math_precision
    );
    if let Some(d) = &r.device {
        let _ = writeln!(s, "# Measured on {}.", comment(d));
    }
    let _ = writeln!(s, "# Workload: {}.", comment(&r.workload));
    let _ = writeln!(
        s,
        "# Fit: effective bandwidth {:.3} TB/s, compute {:.1} TFLOP/s, step overhead {:.3} ms.",
        r.fit.bandwidth / 1e12,
        r.fit.flops / 1e12,
        r.fit.overhead * 1e3
    );
    let _ = writeln!(
        s,
        "# Held-back error: median {:.1}%, max {:.1}% over {} steps.",
        r.held_back.median * 100.0,
        r.held_back.max * 100.0,
        r.held_back.points
    );
    for n in &r.notes {
        let _ = writeln!(s, "# Note: {}", comment(n));
    }
    let _ = writeln!(
        s,
        "\n[model.{}.variant.{}]",
        toml_key(&r.model),
        toml_key(&r.variant)
    );
    let _ = writeln!(s, "mbu = {}", r.efficiency.mbu);
    let _ = writeln!(s, "mfu = {}", r.efficiency.mfu);
    let _ = writeln!(
        s,
        "step_overhead_ms = {}",
        round6(r.efficiency.step_overhead * 1e3)
    );
    s
}

/// `prefill 512`, `decode 16 × 2048`, `mixed 256 + 16 × 1024`.
pub fn label(s: &StepPoint) -> String {
    let per = |b: u32| s.context_tokens / u64::from(b.max(1));
    match (s.prefill_tokens, s.decode_seqs) {
        (p, 0) => format!("prefill {p}"),
        (0, b) => format!("decode {b} × {}", per(b)),
        (p, b) => format!("mixed {p} + {b} × {}", per(b)),
    }
}

/// 0 for errors that would print as ±0.0% (no `-0.0%` in reports).
fn tidy(e: f64) -> f64 {
    if e.abs() < 5e-4 {
        0.0
    } else {
        e
    }
}

fn ms(s: f64) -> String {
    format!("{:.3}", s * 1e3)
}

/// The human report: the table of steps (prefill tokens, decode batch,
/// context, measured and simulated times, error, fitted or held back), the
/// fit, and the held-back error against the target.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kiln calibrate: {}.{} on pool {} ({}), backend {}",
        r.model, r.variant, r.pool, r.gpu.name, r.backend
    );
    if let Some(d) = &r.device {
        let _ = writeln!(s, "device: {d}");
    }
    let _ = writeln!(s, "workload: {}", r.workload);
    let held = r.rows.iter().filter(|x| x.held_back).count();
    let _ = writeln!(
        s,
        "{} steps measured: {} fitted, {} held back\n",
        r.rows.len(),
        r.rows.len() - held,
        held
    );
    use crate::table::{Left, Right};
    let mut t = crate::table::new(&[
        ("prefill", Right),
        ("batch", Right),
        ("context", Right),
        ("measured ms", Right),
        ("simulated ms", Right),
        ("error", Right),
        ("set", Left),
    ]);
    for x in &r.rows {
        t.add_row(vec![
            x.point.prefill_tokens.to_string(),
            x.point.decode_seqs.to_string(),
            x.point.context_tokens.to_string(),
            ms(x.measured),
            ms(x.simulated),
            format!("{:.1}%", tidy(x.error) * 100.0),
            if x.held_back { "held back" } else { "fitted" }.to_string(),
        ]);
    }
    s.push_str(&crate::table::render(&t, ""));
    let _ = writeln!(
        s,
        "\nfit: effective bandwidth {:.3} TB/s, compute {:.1} TFLOP/s, step overhead {:.3} ms \
         ({} memory-bound, {} compute-bound steps; rms error {:.1}%)",
        r.fit.bandwidth / 1e12,
        r.fit.flops / 1e12,
        r.fit.overhead * 1e3,
        r.fit.memory_bound,
        r.fit.compute_bound,
        r.fit.rms_error * 100.0
    );
    let _ = writeln!(
        s,
        "calibration: mbu {:.4} of {:.3} TB/s, mfu {:.4} of {:.1} TFLOP/s ({}), step_overhead_ms {:.4}",
        r.efficiency.mbu,
        r.peak_bandwidth / 1e12,
        r.efficiency.mfu,
        r.peak_flops / 1e12,
        r.math_precision,
        r.efficiency.step_overhead * 1e3
    );
    let stats = |e: &ErrorStats| {
        format!(
            "median {:.1}%, mean {:.1}%, max {:.1}% over {} steps",
            e.median * 100.0,
            e.mean * 100.0,
            e.max * 100.0,
            e.points
        )
    };
    let _ = writeln!(
        s,
        "held-back error: {} (target: median ≤ {:.0}%): {}",
        stats(&r.held_back),
        TARGET_MEDIAN_ERROR * 100.0,
        if r.meets_target() { "met" } else { "NOT met" }
    );
    let _ = writeln!(
        s,
        "built-in factors on the same steps: {}",
        stats(&r.defaults)
    );
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> StepShape {
        StepShape {
            weight_bytes: 16e9,
            params: 8e9,
            kv_bytes_per_token: 131_072.0,
            attention_flops_per_pair: 1.05e6,
        }
    }

    fn synth(b: f64, f: f64, o: f64, noise: &[f64]) -> Vec<Measurement> {
        let s = shape();
        let g = grid(&GridLimits {
            max_step_tokens: 8192,
            max_batch: 256,
            kv_tokens: 1 << 22,
        });
        g.iter()
            .enumerate()
            .map(|(i, p)| {
                let t = (s.bytes(p) / b).max(s.flops(p) / f) + o;
                let e = noise.get(i % noise.len().max(1)).copied().unwrap_or(0.0);
                Measurement {
                    point: *p,
                    seconds: t * (1.0 + e),
                }
            })
            .collect()
    }

    #[test]
    fn recovers_exact_parameters() {
        let ms = synth(3.1e12, 610e12, 0.0007, &[0.0]);
        let f = fit(&shape(), &ms).unwrap();
        assert!((f.bandwidth / 3.1e12 - 1.0).abs() < 1e-6, "{f:?}");
        assert!((f.flops / 610e12 - 1.0).abs() < 1e-6, "{f:?}");
        assert!((f.overhead - 0.0007).abs() < 1e-9, "{f:?}");
        assert!(f.memory_bound > 0 && f.compute_bound > 0);
    }

    #[test]
    fn zero_overhead_stays_zero() {
        let ms = synth(2e12, 300e12, 0.0, &[0.0]);
        let f = fit(&shape(), &ms).unwrap();
        assert!(f.overhead.abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn gauss_solves() {
        let mut a = [
            [2.0, 1.0, 0.0, 3.0],
            [1.0, 3.0, 1.0, 5.0],
            [0.0, 1.0, 4.0, 5.0],
        ];
        let x = gauss(&mut a, 3).unwrap();
        for (got, want) in x.iter().zip([1.0, 1.0, 1.0]) {
            assert!((got - want).abs() < 1e-12);
        }
        let mut s = [[1.0, 2.0, 0.0, 1.0], [2.0, 4.0, 0.0, 2.0], [0.0; 4]];
        assert!(gauss(&mut s, 2).is_none());
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(
            fit(&shape(), &synth(2e12, 3e14, 0.001, &[0.0])[..2]),
            Err(CalibrateError::TooFewPoints { points: 2 })
        ));
        let mut ms = synth(2e12, 3e14, 0.001, &[0.0]);
        ms[3].seconds = f64::NAN;
        assert!(matches!(
            fit(&shape(), &ms),
            Err(CalibrateError::BadMeasurement { index: 3, .. })
        ));
    }

    #[test]
    fn median_of_even_and_odd() {
        let r = ReplicaModel::new(ReplicaInputs {
            model: 0,
            variant: 0,
            pool: 0,
            model_name: "m".into(),
            variant_name: "v".into(),
            pool_name: "p".into(),
            gpu: GpuSpec::builtin("h100").unwrap(),
            gpu_memory: 80e9,
            precision: Precision::Bf16,
            tp: 1,
            params: 8e9,
            kv_bytes_per_token: 131_072.0,
            attention_flops_per_pair: 1e6,
            efficiency: Efficiency::default(),
            time_factor: 1.0,
            max_batch: 256,
            max_batch_tokens: 8192,
        });
        let at = |p: u32, k: f64| Measurement {
            point: StepPoint::prefill(p),
            seconds: r.prefill_time(p) / k,
        };
        let e = holdout_error(&r, &[at(512, 1.0), at(1024, 1.1), at(2048, 1.3)]);
        assert!(
            (e.median - 0.1).abs() < 1e-9 && (e.max - 0.3).abs() < 1e-9,
            "{e:?}"
        );
        let e = holdout_error(&r, &[at(512, 1.0), at(1024, 1.1)]);
        assert!((e.median - 0.05).abs() < 1e-9, "{e:?}");
        assert_eq!(holdout_error(&r, &[]).points, 0);
    }

    #[test]
    fn llama_shapes() {
        let s8 = TransformerShape::for_model("m", 8e9, 131_072.0, 1).unwrap();
        assert_eq!(
            (s8.layers, s8.d_model, s8.kv_dim, s8.q_per_kv),
            (34, 4352, 960, 4)
        );
        assert!((s8.params() / 8e9 - 1.0).abs() < 0.02, "{s8:?}");
        assert!((s8.kv_bytes_per_token() / 131_072.0 - 1.0).abs() < 0.02);
        let s70 = TransformerShape::for_model("m", 70e9, 327_680.0, 1).unwrap();
        assert_eq!((s70.layers, s70.d_model, s70.q_per_kv), (69, 8960, 8));
        assert!((s70.params() / 70e9 - 1.0).abs() < 0.02, "{s70:?}");
        let tp2 = TransformerShape::for_model("m", 70e9, 327_680.0, 2).unwrap();
        assert!((tp2.params() / 35e9 - 1.0).abs() < 0.03, "{tp2:?}");
        for s in [s8, s70, tp2] {
            assert!(s.q_per_kv % 2 == 0);
            assert!(s.kv_dim % 8 == 0 && s.q_dim % 8 == 0 && s.ffn % 8 == 0);
            // Causal pairs are exact.
            let p = 1001u32;
            let flops = 4.0 * f64::from(s.kv_dim) * f64::from(p) * s.prefill_columns(p) as f64;
            let want = s.attention_flops_per_pair() / f64::from(s.layers)
                * f64::from(p)
                * f64::from(p + 1)
                / 2.0;
            assert!((flops / want - 1.0).abs() < 1e-12);
        }
        assert!(TransformerShape::for_model("m", f64::NAN, 1.0, 1).is_err());
        assert!(TransformerShape::for_model("m", 8e9, 0.0, 1).is_err());
    }

    #[test]
    fn memory_plan_scales_down_when_needed() {
        let s = TransformerShape::for_model("m", 70e9, 327_680.0, 1).unwrap();
        // 140 GB of weights on a 127 GB budget: scaled down, and says so.
        let p = MemoryPlan::new(&s, 127_000_000_000, 8192, 8192, 65_536, None).unwrap();
        assert!(p.shape.layers < s.layers && p.shape.layers > 40, "{p:?}");
        assert!(p.note().is_some());
        assert!(p.kv_tokens >= 65_536 && p.kv_tokens.is_multiple_of(u64::from(KV_BLOCK_TOKENS)));
        let total = p.weight_bytes + p.buffers.bytes() + p.kv_bytes;
        assert!(total <= p.usable_bytes, "{total} > {}", p.usable_bytes);
        // An 8B model fits whole, the rest of memory going to KV.
        let s8 = TransformerShape::for_model("m", 8e9, 131_072.0, 1).unwrap();
        let p8 = MemoryPlan::new(&s8, 127_000_000_000, 8192, 8192, 65_536, None).unwrap();
        assert_eq!(p8.shape.layers, s8.layers);
        assert!(p8.note().is_none());
        assert!(p8.kv_tokens > 500_000, "{p8:?}");
        // An explicit scale, and one that cannot fit.
        let half = MemoryPlan::new(&s, 127_000_000_000, 8192, 8192, 65_536, Some(0.5)).unwrap();
        assert_eq!(half.shape.layers, 35);
        assert!(MemoryPlan::new(&s, 127_000_000_000, 8192, 8192, 65_536, Some(1.0)).is_err());
        assert!(MemoryPlan::new(&s, 1_000_000, 8192, 8192, 65_536, None).is_err());
        assert!(MemoryPlan::new(&s, 127_000_000_000, 8192, 8192, 1, Some(f64::NAN)).is_err());
    }

    #[test]
    fn grid_respects_limits() {
        let all = grid(&GridLimits {
            max_step_tokens: 8192,
            max_batch: 256,
            kv_tokens: 1 << 22,
        });
        assert_eq!(all.len(), 24);
        let small = grid(&GridLimits {
            max_step_tokens: 2048,
            max_batch: 16,
            kv_tokens: 40_000,
        });
        assert!(small
            .iter()
            .all(|p| p.tokens() <= 2048 && p.decode_seqs <= 16 && p.context_tokens <= 40_000));
        assert!(small.iter().any(|p| p.decode_seqs == 0));
        assert!(small.iter().any(|p| p.prefill_tokens == 0));
    }

    #[test]
    fn toml_keys_quote_when_needed() {
        assert_eq!(toml_key("llama-8b"), "llama-8b");
        assert_eq!(toml_key("a.b"), "\"a.b\"");
        assert_eq!(toml_key("q\"x"), "\"q\\\"x\"");
    }

    #[test]
    fn labels() {
        assert_eq!(label(&StepPoint::prefill(512)), "prefill 512");
        assert_eq!(label(&StepPoint::decode(16, 2048)), "decode 16 × 2048");
    }
}
