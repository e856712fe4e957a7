//! One replica of one model variant on one pool's GPUs: the roofline.
//!
//! # The model
//!
//! A transformer forward pass over `n` tokens costs `2 × params × n` FLOPs
//! in its matrix multiplies (one multiply-add per weight per token) and must
//! stream every weight from memory once per step, plus the KV cache of every
//! sequence it attends over. A step takes as long as the slower of the two
//! (the roofline), plus a fixed per-step overhead (scheduling, kernel
//! launches) and a cost per decoding sequence (the output head and
//! sampling, 0 unless calibrated). Tensor parallelism over `tp` GPUs divides both the
//! bytes and the FLOPs by `tp`; its all-reduce cost is folded into the
//! efficiency factors.
//!
//! ```text
//! bytes/param   = fp32 4, bf16/fp16 2, fp8/int8 1, int4 0.5
//! weight_bytes  = params × bytes/param
//! kv_bytes      = kv_per_token × kv_scale     (KV at 16-bit; fp8 → ×0.5, fp32 → ×2)
//! BW            = tp × hbm_bandwidth × mbu     (effective bytes/s of the replica)
//! F             = tp × flops(precision) × mfu  (effective FLOP/s of the replica)
//! pairs(p, C)   = p × (p + 1) / 2 + C          (attention query×key pairs)
//!
//! t_memory      = (weight_bytes + C × kv_bytes) / BW
//! t_compute     = (2 × params × (p + b) + attn_flops_per_pair × pairs) / F
//! step_time     = (max(t_memory, t_compute) + overhead + b × seq_overhead) × time_factor
//!               = 0 when p = 0 and b = 0 (no step)
//! ```
//!
//! with `p` prefill tokens, `b` decode sequences and `C` context tokens whose
//! KV the step reads. So:
//!
//! - decode step (`p = 0`): `max(weight_bytes/tp/(bw×mbu) + C×kv_bytes/tp/(bw×mbu),
//!   2×params×b/(tp×flops×mfu)) + overhead` (plus the small attention FLOPs);
//! - prefill of `n` tokens (`b = 0, C = 0`): `2×params×n/(tp×flops×mfu)` plus
//!   the attention term plus overhead, once `n` is past the ridge point
//!   (about 300 tokens on an H100); below it, the weight read bounds it;
//! - a mixed step (vLLM v1 chunked prefill: one prefill chunk rides along
//!   with the running decodes) is the same formula with both `p` and `b`.
//!
//! `flops(precision)` is the tensor-core rate the kernels really use:
//! bf16/fp16 → `dense_bf16_flops`; fp8 → `fp8_flops` (W8A8); int8 →
//! `int8_ops` (W8A8, SmoothQuant style); int4 → `dense_bf16_flops`
//! (weight-only W4A16: AWQ/GPTQ/Marlin dequantise to 16-bit for the math);
//! fp32 → `dense_bf16_flops / 2` (TF32 tensor cores run at half the BF16
//! rate on A100, H100, L40S and L4).
//!
//! **KV precision.** The policy's `kv_per_token` is at 16-bit. The KV cache is
//! assumed 16-bit for every precision (weight-only int4/int8 keep 16-bit
//! activations) except fp8, whose KV cache is fp8 (1 byte, ×0.5), and fp32,
//! whose cache follows the model dtype (4 bytes, ×2) as vLLM's
//! `kv_cache_dtype=auto` does. A calibration file may set the bytes directly.
//!
//! **Attention FLOPs.** `attn_flops_per_pair = 4 × layers × d_model` (QKᵀ and
//! A·V, a multiply-add each). The graph does not know layers or `d_model`, so
//! the default derives them from the KV size: `kv_per_token = 4 × layers ×
//! kv_dim` bytes and `d_model = q_per_kv × kv_dim`, giving
//! `attn_flops_per_pair = q_per_kv × kv_per_token` with `q_per_kv = 8`
//! (grouped-query attention as in Llama-3-70B, 64 query / 8 KV heads). A
//! prefill chunk is assumed to start a prompt (`p(p+1)/2` causal pairs);
//! [`ReplicaModel::prefill_chunk_time`] handles later chunks. Decode attention
//! is one pair per context token and is memory-bound in practice.
//!
//! **KV capacity.** `(tp × gpu_memory × (1 − activation_reserve) −
//! weight_bytes) / kv_bytes` tokens, the same budgeting as vLLM's
//! `gpu_memory_utilization = 0.9`. Weights that leave no room are an error.
//!
//! Not modelled: KV-cache writes (`(p + b) × kv_bytes`, tiny next to the
//! weight read), quantisation scales (~3% for int4 group-128), MoE routing
//! (a MoE model's `params` should be its *active* parameters for time, which
//! undercounts its weight memory), PCIe/NVLink transfers, and (unless calibrated) sampling.

use super::error::SimError;
use super::gpu::GpuSpec;
use crate::graph::{ModelId, PoolId, Precision};

/// Efficiency factors and fixed costs: the knobs a calibration tunes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Efficiency {
    /// Memory-bandwidth utilisation, 0–1: the share of datasheet bandwidth
    /// real kernels reach (decode GEMV and paged attention ~0.8).
    pub mbu: f64,
    /// Model-FLOP utilisation, 0–1: the share of dense tensor-core peak real
    /// GEMMs reach on a prefill-sized batch (~0.5).
    pub mfu: f64,
    /// Fixed cost of every step, seconds: scheduling, launches.
    pub step_overhead: f64,
    /// Cost of each sequence that decodes a token in a step, seconds: the
    /// output head over the vocabulary and sampling, paid per sequence and
    /// not shared by batching. Negligible beside a GPU's weight read (0 by
    /// default); on a CPU engine (llama.cpp) a decode token measured about
    /// 1.8x a prompt token, and a fit from its log sets it.
    pub seq_overhead: f64,
    /// Share of GPU memory kept for activations and the CUDA context, 0–1.
    pub activation_reserve: f64,
    /// Query heads per KV head, for the default attention-FLOP estimate.
    pub attention_q_per_kv: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Efficiency {
            mbu: 0.8,
            mfu: 0.5,
            step_overhead: 0.001,
            seq_overhead: 0.0,
            activation_reserve: 0.10,
            attention_q_per_kv: 8.0,
        }
    }
}

/// Bytes one parameter takes at a precision.
pub fn bytes_per_param(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 4.0,
        Precision::Bf16 | Precision::Fp16 => 2.0,
        Precision::Fp8 | Precision::Int8 => 1.0,
        Precision::Int4 => 0.5,
    }
}

/// KV-cache bytes per token relative to the 16-bit `kv_per_token`.
pub fn kv_scale(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 2.0,
        Precision::Fp8 => 0.5,
        _ => 1.0,
    }
}

/// Tensor-core rate (per GPU, FLOP/s) the kernels of a precision run at.
pub fn compute_rate(gpu: &GpuSpec, p: Precision) -> f64 {
    match p {
        Precision::Fp32 => gpu.dense_bf16_flops / 2.0,
        Precision::Bf16 | Precision::Fp16 | Precision::Int4 => gpu.dense_bf16_flops,
        Precision::Fp8 => gpu.fp8_flops,
        Precision::Int8 => gpu.int8_ops,
    }
}

/// Everything [`ReplicaModel::new`] needs, spelled out, so a replica can be
/// built without a policy (tests, what-if tools).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaInputs {
    pub model: ModelId,
    pub variant: u16,
    pub pool: PoolId,
    /// Names, for errors and reports.
    pub model_name: String,
    pub variant_name: String,
    pub pool_name: String,
    pub gpu: GpuSpec,
    /// Memory of one GPU, bytes (the pool's `memory`).
    pub gpu_memory: f64,
    pub precision: Precision,
    /// Tensor-parallel degree: the variant's `gpus_per_replica` (≥ 1).
    pub tp: u32,
    pub params: f64,
    /// KV bytes per token of this replica (already scaled for precision).
    pub kv_bytes_per_token: f64,
    /// FLOPs per attention query×key pair.
    pub attention_flops_per_pair: f64,
    pub efficiency: Efficiency,
    /// Multiplies every step time (per-variant calibration), default 1.
    pub time_factor: f64,
    pub max_batch: u32,
    pub max_batch_tokens: u32,
}

/// Time of one step, split into its roofline parts (seconds).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepBreakdown {
    pub memory: f64,
    pub compute: f64,
    pub overhead: f64,
    /// `(max(memory, compute) + overhead) × time_factor`.
    pub total: f64,
}

/// The cost model of one replica of a model variant on a pool's GPUs.
/// Immutable; every method is pure f64 arithmetic.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplicaModel {
    pub model: ModelId,
    pub variant: u16,
    pub pool: PoolId,
    pub model_name: String,
    pub variant_name: String,
    pub pool_name: String,
    pub gpu: GpuSpec,
    pub precision: Precision,
    pub tp: u32,
    pub params: f64,
    pub bytes_per_param: f64,
    pub weight_bytes: f64,
    pub kv_bytes_per_token: f64,
    pub attention_flops_per_pair: f64,
    /// Memory of the replica's `tp` GPUs, bytes.
    pub memory_bytes: f64,
    /// KV-cache tokens that fit; 0 when the weights do not.
    pub kv_capacity: u64,
    pub efficiency: Efficiency,
    pub time_factor: f64,
    pub max_batch: u32,
    pub max_batch_tokens: u32,
    /// `tp × hbm_bandwidth × mbu`, bytes/s.
    pub effective_bandwidth: f64,
    /// `tp × flops(precision) × mfu`, FLOP/s.
    pub effective_flops: f64,
}

impl ReplicaModel {
    /// Builds the replica. Never fails: weights that do not fit give
    /// `kv_capacity == 0` and `weights_fit() == false`.
    pub fn new(i: ReplicaInputs) -> ReplicaModel {
        let tp = i.tp.max(1);
        let bytes_per_param = bytes_per_param(i.precision);
        let weight_bytes = i.params * bytes_per_param;
        let memory_bytes = f64::from(tp) * i.gpu_memory;
        let usable = memory_bytes * (1.0 - i.efficiency.activation_reserve);
        let kv_capacity = if weight_bytes < usable && i.kv_bytes_per_token > 0.0 {
            // Float-to-int `as` saturates; the value is finite and ≥ 0 here.
            ((usable - weight_bytes) / i.kv_bytes_per_token).floor() as u64
        } else {
            0
        };
        let effective_bandwidth = f64::from(tp) * i.gpu.hbm_bandwidth * i.efficiency.mbu;
        let effective_flops = f64::from(tp) * compute_rate(&i.gpu, i.precision) * i.efficiency.mfu;
        ReplicaModel {
            model: i.model,
            variant: i.variant,
            pool: i.pool,
            model_name: i.model_name,
            variant_name: i.variant_name,
            pool_name: i.pool_name,
            gpu: i.gpu,
            precision: i.precision,
            tp,
            params: i.params,
            bytes_per_param,
            weight_bytes,
            kv_bytes_per_token: i.kv_bytes_per_token,
            attention_flops_per_pair: i.attention_flops_per_pair,
            memory_bytes,
            kv_capacity,
            efficiency: i.efficiency,
            time_factor: i.time_factor,
            max_batch: i.max_batch,
            max_batch_tokens: i.max_batch_tokens,
            effective_bandwidth,
            effective_flops,
        }
    }

    /// Memory left for weights and KV: `memory_bytes × (1 − activation_reserve)`.
    pub fn usable_memory(&self) -> f64 {
        self.memory_bytes * (1.0 - self.efficiency.activation_reserve)
    }

    /// Do the weights fit the replica's GPUs, after the activation reserve?
    pub fn weights_fit(&self) -> bool {
        self.weight_bytes < self.usable_memory()
    }

    /// KV-cache capacity in tokens:
    /// `(tp × gpu_memory × (1 − reserve) − weight_bytes) / kv_bytes_per_token`.
    /// An error when the weights leave no room.
    pub fn kv_capacity_tokens(&self) -> Result<u64, SimError> {
        if self.weights_fit() {
            Ok(self.kv_capacity)
        } else {
            Err(SimError::WeightsDoNotFit {
                model: self.model_name.clone(),
                variant: self.variant_name.clone(),
                pool: self.pool_name.clone(),
                tp: self.tp,
                weights_gb: self.weight_bytes / 1e9,
                usable_gb: self.usable_memory() / 1e9,
            })
        }
    }

    /// Tokens of context (prompt + generated, over all sequences) the
    /// replica can hold at once: the KV capacity, 0 when weights don't fit.
    pub fn max_concurrent_tokens(&self) -> u64 {
        self.kv_capacity
    }

    /// The roofline parts of a step: `prefill_tokens` new prompt tokens
    /// (`prior_context` of them already cached before this chunk, summed
    /// over prefilling sequences), `decode_seqs` sequences generating one
    /// token each over `context_tokens` cached tokens in total.
    pub fn step_cost(
        &self,
        prefill_tokens: u32,
        prior_context: u64,
        decode_seqs: u32,
        context_tokens: u64,
    ) -> StepBreakdown {
        if prefill_tokens == 0 && decode_seqs == 0 {
            return StepBreakdown {
                memory: 0.0,
                compute: 0.0,
                overhead: 0.0,
                total: 0.0,
            };
        }
        let p = f64::from(prefill_tokens);
        let b = f64::from(decode_seqs);
        let prior = prior_context as f64;
        let ctx = context_tokens as f64;
        let kv_read = (ctx + prior) * self.kv_bytes_per_token;
        let memory = (self.weight_bytes + kv_read) / self.effective_bandwidth;
        // Causal pairs of the chunk among itself, the chunk against its
        // prior context, and one query per decoded token over its context.
        let pairs = p * (p + 1.0) / 2.0 + p * prior + ctx;
        let flops = 2.0 * self.params * (p + b) + self.attention_flops_per_pair * pairs;
        let compute = flops / self.effective_flops;
        let overhead = self.efficiency.step_overhead + self.efficiency.seq_overhead * b;
        let total = (memory.max(compute) + overhead) * self.time_factor;
        StepBreakdown {
            memory,
            compute,
            overhead,
            total,
        }
    }

    /// Seconds for one continuous-batching step that processes
    /// `prefill_tokens` prompt tokens (a chunk starting its prompt) and
    /// `decode_seqs` decodes whose cached context totals `context_tokens`.
    /// Pass a later chunk's prior context in `context_tokens` to charge its
    /// KV read (or use [`ReplicaModel::prefill_chunk_time`]). 0 for an empty
    /// step; monotone non-decreasing in every argument.
    pub fn step_time(&self, prefill_tokens: u32, decode_seqs: u32, context_tokens: u64) -> f64 {
        self.step_cost(prefill_tokens, 0, decode_seqs, context_tokens)
            .total
    }

    /// Seconds to prefill `tokens` prompt tokens from an empty cache in one
    /// pass: `2 × params × n / (tp × flops × mfu)` + attention + overhead,
    /// bounded below by the weight read.
    pub fn prefill_time(&self, tokens: u32) -> f64 {
        self.step_time(tokens, 0, 0)
    }

    /// Seconds for a prefill chunk of `chunk` tokens whose sequence already
    /// has `prior_context` tokens cached (chunked prefill of a long prompt).
    pub fn prefill_chunk_time(&self, chunk: u32, prior_context: u64) -> f64 {
        self.step_cost(chunk, prior_context, 0, 0).total
    }

    /// Seconds for a decode-only step of `batch` sequences over
    /// `context_tokens` cached tokens in total.
    pub fn decode_step_time(&self, batch: u32, context_tokens: u64) -> f64 {
        self.step_time(0, batch, context_tokens)
    }

    /// Time to first token for a `prompt`-token prompt prefilled alone in
    /// chunks of `max_batch_tokens` (the whole prompt in one pass when the
    /// limit is 0).
    pub fn ttft_estimate(&self, prompt: u32) -> f64 {
        let chunk = if self.max_batch_tokens == 0 {
            prompt.max(1)
        } else {
            self.max_batch_tokens
        };
        let mut done: u32 = 0;
        let mut t = 0.0;
        while done < prompt {
            let n = chunk.min(prompt - done);
            t += self.prefill_chunk_time(n, u64::from(done));
            done += n;
        }
        t
    }

    /// Decode throughput, tokens/s, of `batch` sequences with `mean_context`
    /// cached tokens each: `batch / decode_step_time(batch, batch × mean_context)`.
    /// Not clamped; see [`ReplicaModel::sustainable_batch`].
    pub fn throughput_estimate(&self, batch: u32, mean_context: u32) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let ctx = u64::from(batch) * u64::from(mean_context);
        f64::from(batch) / self.decode_step_time(batch, ctx)
    }

    /// The largest decode batch the replica sustains at `mean_context`
    /// tokens per sequence: `min(max_batch, kv_capacity / mean_context)`
    /// (`max_batch == 0` means no batch limit).
    pub fn sustainable_batch(&self, mean_context: u32) -> u32 {
        let by_kv = self.kv_capacity / u64::from(mean_context.max(1));
        let by_kv = u32::try_from(by_kv).unwrap_or(u32::MAX);
        if self.max_batch == 0 {
            by_kv
        } else {
            by_kv.min(self.max_batch)
        }
    }

    /// Decode tokens/s at the sustainable batch: the replica's service rate
    /// for admission's wait estimates.
    pub fn peak_throughput(&self, mean_context: u32) -> f64 {
        self.throughput_estimate(self.sustainable_batch(mean_context), mean_context)
    }
}
