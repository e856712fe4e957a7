//! The roofline cost model of a simulated GPU replica.
//!
//! The simulator needs to know how long a continuous-batching step takes on
//! a replica of a model variant on a pool's GPUs. It answers with a roofline
//! (see [`replica`] for the formulas): a step is bound by the slower of
//! streaming weights and KV cache from memory and doing the matrix-multiply
//! FLOPs, plus a fixed overhead. Figures come from public GPU datasheets
//! ([`gpu`]) and can be fitted to measurements with a calibration file
//! ([`calibration`], example in `examples/calibration.toml`).
//!
//! Everything here is pure, deterministic f64 arithmetic; the only I/O is
//! [`Calibration::load`].
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use kiln::backend::cost::CostModel;
//! # let graph: kiln::graph::DecisionGraph = unimplemented!();
//! let cost = CostModel::from_graph(&graph, None)?;
//! if let Some(r) = cost.replica(0, 0, 0) {
//!     let secs = r.step_time(512, 16, 16 * 1024);
//!     let kv_tokens = r.max_concurrent_tokens();
//!     # let _ = (secs, kv_tokens);
//! }
//! # Ok(()) }
//! ```

pub mod calibrate;
pub mod calibration;
pub mod error;
pub mod from_log;
pub mod gpu;
pub mod replica;

pub use calibration::{
    Calibration, EfficiencyOverride, GpuOverride, ModelOverride, VariantOverride,
};
pub use error::{CalibrationError, SimError};
pub use gpu::GpuSpec;
pub use replica::{
    bytes_per_param, compute_rate, kv_scale, Efficiency, ReplicaInputs, ReplicaModel, StepBreakdown,
};

use crate::graph::{DecisionGraph, ModelId, PoolId};

/// The cost model of every (model, variant, pool) pair a policy allows:
/// one [`ReplicaModel`] per variant and each pool in its `pools`.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Index of each model's first variant in the flat variant list.
    offsets: Vec<usize>,
    pools: usize,
    /// `(offsets[model] + variant) * pools + pool`.
    slots: Vec<Option<ReplicaModel>>,
    /// The resolved GPU of each pool some variant may run on.
    gpus: Vec<Option<GpuSpec>>,
    /// What had to be estimated because the policy did not say (model
    /// sizes); callers should show these.
    pub warnings: Vec<String>,
}

/// Parameters from the largest variant's memory at its precision, taking
/// 85% of the memory as weights (the rest KV cache and activations).
fn estimate_params(model: &crate::graph::Model) -> Option<f64> {
    model
        .variants
        .iter()
        .map(|v| 0.85 * v.memory / bytes_per_param(v.precision))
        .filter(|p| p.is_finite() && *p > 0.0)
        .fold(None, |best: Option<f64>, p| {
            Some(best.map_or(p, |b| b.max(p)))
        })
}

/// KV bytes per token at 16 bits, from the parameter count, fitted to
/// grouped-query-attention models (Llama 3 8B: 128 KiB, 70B: 320 KiB):
/// 128 KiB × (params / 8B)^0.4.
fn estimate_kv_per_token(params: f64) -> f64 {
    131_072.0 * (params / 8e9).max(1e-3).powf(0.4)
}

impl CostModel {
    /// Builds a [`ReplicaModel`] for every variant on every pool it may run
    /// on. Fails on a pool kind no table knows, a model without `params` or
    /// `kv_per_token` (unless the calibration supplies them), weights that do
    /// not fit a pool's GPUs, or a calibration naming a model or variant the
    /// policy lacks.
    pub fn from_graph(
        graph: &DecisionGraph,
        calibration: Option<&Calibration>,
    ) -> Result<CostModel, SimError> {
        CostModel::from_graph_sizing(graph, calibration, |_| false)
    }

    /// As [`CostModel::from_graph`], except that a pool for which
    /// `optional` holds is sized only if it can be: when its GPU kind is
    /// unknown or a variant does not fit it, it simply has no replica
    /// models (a pool served by an HTTP upstream needs none to run).
    pub fn from_graph_sizing(
        graph: &DecisionGraph,
        calibration: Option<&Calibration>,
        optional: impl Fn(PoolId) -> bool,
    ) -> Result<CostModel, SimError> {
        let default = Calibration::default();
        let cal = calibration.unwrap_or(&default);
        check_names(graph, cal)?;

        let pools = graph.pools.len();
        let mut offsets = Vec::with_capacity(graph.models.len());
        let mut n = 0;
        for m in &graph.models {
            offsets.push(n);
            n += m.variants.len();
        }
        let mut slots: Vec<Option<ReplicaModel>> = vec![None; n * pools];
        let mut gpus: Vec<Option<GpuSpec>> = vec![None; pools];
        let mut warnings = Vec::new();

        for (mi, model) in graph.models.iter().enumerate() {
            let mo = cal.model(&model.name);
            // Policies written for routing alone may not say how big a
            // model is; estimate rather than refuse, and say so.
            let params = match mo.and_then(|o| o.params).or(model.params) {
                Some(p) => p,
                None => match estimate_params(model) {
                    Some(p) => {
                        warnings.push(format!(
                            "model `{}` has no `params`: estimated {:.1}B from its variants' memory; add `params …B` for accurate timing",
                            model.name,
                            p / 1e9
                        ));
                        p
                    }
                    None => {
                        return Err(SimError::MissingParams {
                            model: model.name.clone(),
                        })
                    }
                },
            };
            let kv16 = match mo.and_then(|o| o.kv_per_token).or(model.kv_per_token) {
                Some(k) => k,
                None => {
                    let k = estimate_kv_per_token(params);
                    warnings.push(format!(
                        "model `{}` has no `kv_per_token`: estimated {:.0}KB from its size; add `kv_per_token …KB` for accurate memory",
                        model.name,
                        k / 1e3
                    ));
                    k
                }
            };
            for (vi, variant) in model.variants.iter().enumerate() {
                let eff = cal.variant_efficiency(&model.name, &variant.name);
                let vo = cal.variant(&model.name, &variant.name);
                let attention = mo
                    .and_then(|o| o.attention_flops_per_pair)
                    .unwrap_or(eff.attention_q_per_kv * kv16);
                let kv_bytes = vo
                    .and_then(|o| o.kv_bytes_per_token)
                    .unwrap_or(kv16 * kv_scale(variant.precision));
                for &pi in &variant.pools {
                    let Some(pool) = graph.pools.get(usize::from(pi)) else {
                        continue;
                    };
                    let spec = match &gpus[usize::from(pi)] {
                        Some(s) => s.clone(),
                        None => match cal.gpu_spec(&pool.name, &pool.kind) {
                            Ok(s) => {
                                gpus[usize::from(pi)] = Some(s.clone());
                                s
                            }
                            Err(_) if optional(pi) => continue,
                            Err(e) => return Err(e),
                        },
                    };
                    let gpu_memory = if pool.gpu_memory > 0.0 {
                        pool.gpu_memory
                    } else {
                        spec.memory
                    };
                    let r = ReplicaModel::new(ReplicaInputs {
                        model: mi as ModelId,
                        variant: vi as u16,
                        pool: pi,
                        model_name: model.name.clone(),
                        variant_name: variant.name.clone(),
                        pool_name: pool.name.clone(),
                        gpu: spec,
                        gpu_memory,
                        precision: variant.precision,
                        tp: variant.gpus_per_replica,
                        params,
                        kv_bytes_per_token: kv_bytes,
                        attention_flops_per_pair: attention,
                        efficiency: eff,
                        time_factor: vo.and_then(|o| o.time_factor).unwrap_or(1.0),
                        max_batch: variant.max_batch,
                        max_batch_tokens: variant.batch_tokens_on(pool),
                    });
                    match r.kv_capacity_tokens() {
                        Ok(_) => {}
                        Err(_) if optional(pi) => continue,
                        Err(e) => return Err(e),
                    }
                    slots[(offsets[mi] + vi) * pools + usize::from(pi)] = Some(r);
                }
            }
        }
        Ok(CostModel {
            offsets,
            pools,
            slots,
            gpus,
            warnings,
        })
    }

    /// The replica model of `model`'s `variant` on `pool`; `None` when the
    /// variant may not run there (or an id is out of range).
    pub fn replica(&self, model: ModelId, variant: u16, pool: PoolId) -> Option<&ReplicaModel> {
        let start = *self.offsets.get(usize::from(model))?;
        let end = self
            .offsets
            .get(usize::from(model) + 1)
            .copied()
            .unwrap_or(self.slots.len() / self.pools.max(1));
        let v = start + usize::from(variant);
        if v >= end || usize::from(pool) >= self.pools {
            return None;
        }
        self.slots.get(v * self.pools + usize::from(pool))?.as_ref()
    }

    /// Every replica model, by model, variant, then pool.
    pub fn replicas(&self) -> impl Iterator<Item = &ReplicaModel> {
        self.slots.iter().flatten()
    }

    /// The GPU a pool resolved to; `None` for a pool no variant runs on.
    pub fn gpu(&self, pool: PoolId) -> Option<&GpuSpec> {
        self.gpus.get(usize::from(pool))?.as_ref()
    }
}

/// A calibration that names a model or variant the policy lacks is an
/// error: it is most likely a typo that would silently calibrate nothing.
fn check_names(graph: &DecisionGraph, cal: &Calibration) -> Result<(), SimError> {
    for (name, mo) in &cal.models {
        let Some(model) = graph.models.iter().find(|m| &m.name == name) else {
            let known: Vec<&str> = graph.models.iter().map(|m| m.name.as_str()).collect();
            return Err(cal.error_at(
                &format!("model.{name}"),
                format!("the policy has no model `{name}`"),
                Some(format!("models in the policy: {}", known.join(", "))),
            ));
        };
        for vname in mo.variants.keys() {
            if !model.variants.iter().any(|v| &v.name == vname) {
                let known: Vec<&str> = model.variants.iter().map(|v| v.name.as_str()).collect();
                return Err(cal.error_at(
                    &format!("model.{name}.variant.{vname}"),
                    format!("model `{name}` has no variant `{vname}`"),
                    Some(format!("variants of `{name}`: {}", known.join(", "))),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// The scheduler sizes steps through its own trait; the roofline model is
/// one implementation of it.
impl crate::sched::plan::StepCost for ReplicaModel {
    fn step_time(&self, prefill_tokens: u32, decode_seqs: u32, context_tokens: u64) -> f64 {
        ReplicaModel::step_time(self, prefill_tokens, decode_seqs, context_tokens)
    }
}
