//! One CUDA replica: a transformer-shaped workload on one GPU.
//!
//! **What runs.** The model variant's shape comes from
//! [`TransformerShape::for_model`] (layers and widths estimated from its
//! parameter count and KV bytes per token; a tensor-parallel variant runs
//! its per-GPU shard). Every layer's weights and a paged KV-cache arena are
//! allocated for real, in bf16, and filled with small random values (so
//! tensor cores draw realistic power). A step of `n = p + b` tokens runs,
//! per layer, through cuBLAS (`cublasGemmEx`, bf16 in, fp32 accumulate):
//!
//! 1. the QKV projection, `(q + 2 kv) × d` at `n` tokens;
//! 2. for a prefill chunk of `p` tokens, causal attention over the chunk:
//!    `Kᵀ·Q` and `V·S` with `p` keys and `q_per_kv × (p+1)/2` query columns
//!    (exactly the `p(p+1)/2` pairs the simulator charges);
//! 3. for decodes over `C` cached tokens, an attention pass reading the K
//!    and V of `C` tokens from the arena (`Kᵀ·Q`, `V·S`, `q_per_kv`
//!    query columns: the decode's bytes and FLOPs);
//! 4. the output projection `d × q`, and the MLP: gate and up `2 ffn × d`,
//!    down `d × ffn`.
//!
//! So every step reads all weights once and `C × kv_bytes_per_token` of
//! KV, and does `2 × params × n` plus the attention FLOPs: the roofline's
//! own accounting ([`crate::backend::cost::calibrate::StepShape`]). Outputs are
//! placeholders (never read back). Steps are timed with CUDA events.
//!
//! **Memory.** Weights, activation buffers for the largest step, and an
//! arena taking the rest of the usable memory (free memory less the
//! activation reserve). A variant whose weights do not fit runs a fraction
//! of its layers ([`MemoryPlan`] says so). The arena is handed to sequences
//! in blocks of [`KV_BLOCK_TOKENS`] by [`CudaReplica::reserve`] and freed by
//! [`CudaReplica::release`] (finish, cancel, preemption), so memory limits
//! are real. Decode attention reads the arena's first `C` tokens: where a
//! sequence's blocks lie does not change the bytes moved.

use super::{ensure_cublas, ensure_driver, guarded, info_of, CudaError};
use crate::backend::cost::calibrate::{
    Measurement, MemoryPlan, StepPoint, TransformerShape, KV_BLOCK_TOKENS, MAX_GRID_PREFILL,
    WORKLOAD_ELEMENT_BYTES,
};
use crate::backend::cost::{kv_scale, ReplicaModel};
use crate::backend::cuda::device::{DeviceInfo, KvBlocks};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

/// How to build a [`CudaReplica`].
#[derive(Debug, Clone, PartialEq)]
pub struct CudaReplicaConfig {
    /// Device ordinal.
    pub device: usize,
    /// Run this fraction of the model's layers; `None`: all that fit.
    pub scale: Option<f64>,
    /// Most tokens in one step (the variant's `max_batch_tokens`).
    pub max_step_tokens: u32,
    /// Largest prefill chunk (sizes the prefill attention scratch).
    pub max_prefill_tokens: u32,
    /// The KV arena must hold at least this many tokens.
    pub min_kv_tokens: u64,
    /// Share of the GPU's memory kept off the workload, 0–1.
    pub activation_reserve: f64,
}

impl Default for CudaReplicaConfig {
    fn default() -> Self {
        CudaReplicaConfig {
            device: 0,
            scale: None,
            max_step_tokens: MAX_GRID_PREFILL,
            max_prefill_tokens: MAX_GRID_PREFILL,
            min_kv_tokens: 65_536,
            activation_reserve: 0.10,
        }
    }
}

impl CudaReplicaConfig {
    /// The config for a simulated replica of the variant: its step budget
    /// (capped at [`MAX_GRID_PREFILL`]) and activation reserve.
    pub fn for_variant(r: &ReplicaModel, device: usize, scale: Option<f64>) -> Self {
        let tokens = if r.max_batch_tokens == 0 {
            MAX_GRID_PREFILL
        } else {
            r.max_batch_tokens.min(MAX_GRID_PREFILL)
        };
        CudaReplicaConfig {
            device,
            scale,
            max_step_tokens: tokens,
            max_prefill_tokens: tokens,
            activation_reserve: r.efficiency.activation_reserve,
            ..CudaReplicaConfig::default()
        }
    }
}

/// Memory kept free beyond the plan: cuBLAS workspaces, the context.
const HEADROOM: u64 = 1 << 30;

/// Raw device addresses of the replica's buffers (the slices they point
/// into live in the same struct).
struct Ptrs {
    weights: Vec<u64>,
    kv: Vec<u64>,
    hidden: [u64; 2],
    qkv: u64,
    mlp: u64,
    q_in: u64,
    attn_out: u64,
    scores: u64,
}

/// One replica of a model variant on one GPU. Blocking: run it on a
/// thread of its own (the gateway: `spawn_blocking`), one call at a time.
pub struct CudaReplica {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    info: DeviceInfo,
    plan: MemoryPlan,
    max_step_tokens: u32,
    max_prefill: u32,
    /// Element counts of the layer's weights (kept for bounds).
    layer_elems: u64,
    /// Every allocation, kept alive for `ptrs`.
    _slices: Vec<CudaSlice<u16>>,
    ptrs: Ptrs,
    start: CudaEvent,
    end: CudaEvent,
    blocks: KvBlocks,
}

impl std::fmt::Debug for CudaReplica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaReplica")
            .field("device", &self.info)
            .field("plan", &self.plan)
            .field("kv_free_tokens", &self.blocks.free_tokens())
            .finish_non_exhaustive()
    }
}

/// Small random bf16 values (|v| in 2⁻⁷…1): exponent 120–126, random
/// sign and mantissa, from a xorshift stream.
fn random_bf16(n: usize, mut seed: u64) -> Vec<u16> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let sign = ((seed >> 63) as u16) << 15;
            let exp = (120 + (seed >> 32) % 7) as u16;
            let mant = (seed & 0x7f) as u16;
            sign | (exp << 7) | mant
        })
        .collect()
}

fn elems(v: u64, what: &str) -> Result<usize, CudaError> {
    usize::try_from(v).map_err(|_| CudaError::StepTooLarge {
        what: what.to_string(),
        max: usize::MAX as u64,
    })
}

fn dim(v: u64) -> Result<c_int, CudaError> {
    c_int::try_from(v).map_err(|_| CudaError::StepTooLarge {
        what: format!("a GEMM dimension of {v}"),
        max: c_int::MAX as u64,
    })
}

impl CudaReplica {
    /// Allocates and fills the weights, buffers and KV arena of `full`
    /// (scaled down per `cfg.scale` or to fit) on `cfg.device`.
    /// [`CudaError::NoDriver`] on a machine without the driver.
    pub fn new(cfg: &CudaReplicaConfig, full: &TransformerShape) -> Result<CudaReplica, CudaError> {
        ensure_driver()?;
        ensure_cublas()?;
        guarded(|| CudaReplica::build(cfg, full))
    }

    /// The replica of a variant as the simulator sizes it (`r`: its
    /// [`ReplicaModel`] on the pool): the shape from its parameters and KV
    /// bytes per token ([`TransformerShape::for_model`]), buffers for its
    /// `max_batch_tokens`, on `device`, scaled as [`CudaReplicaConfig::scale`].
    pub fn for_variant(
        r: &ReplicaModel,
        device: usize,
        scale: Option<f64>,
    ) -> Result<CudaReplica, CudaError> {
        let kv16 = r.kv_bytes_per_token / kv_scale(r.precision);
        let shape = TransformerShape::for_model(&r.model_name, r.params, kv16, r.tp)?;
        CudaReplica::new(&CudaReplicaConfig::for_variant(r, device, scale), &shape)
    }

    fn build(cfg: &CudaReplicaConfig, full: &TransformerShape) -> Result<CudaReplica, CudaError> {
        let count = super::device_count()?;
        if count == 0 {
            return Err(CudaError::NoDevices);
        }
        if cfg.device >= count {
            return Err(CudaError::NoSuchDevice {
                ordinal: cfg.device,
                count,
            });
        }
        let ctx =
            CudaContext::new(cfg.device).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: the replica uses one stream for every allocation, copy
        // and kernel, so cross-stream event tracking is not needed; it must
        // be off before the slices are allocated.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Cublas {
            call: "cublasCreate",
            code: format!("{:?}", e.0),
        })?;
        let info = info_of(&ctx, cfg.device)?;
        let reserve = if cfg.activation_reserve.is_finite() {
            cfg.activation_reserve.clamp(0.0, 0.95)
        } else {
            0.10
        };
        let budget = (info.total_memory as f64 * (1.0 - reserve)) as u64;
        let usable = budget.min(info.free_memory).saturating_sub(HEADROOM);
        let max_step_tokens = cfg.max_step_tokens.max(1);
        let max_prefill = cfg.max_prefill_tokens.clamp(1, max_step_tokens);
        let plan = MemoryPlan::new(
            full,
            usable,
            max_step_tokens,
            max_prefill,
            cfg.min_kv_tokens,
            cfg.scale,
        )?;
        let s = plan.shape;
        let (d, q, kv, ffn) = (
            u64::from(s.d_model),
            u64::from(s.q_dim),
            u64::from(s.kv_dim),
            u64::from(s.ffn),
        );
        let layer_elems = d * (q + 2 * kv) + q * d + 3 * d * ffn;
        let b = plan.buffers;
        let scores = b
            .prefill_scores
            .max(plan.kv_tokens * u64::from(s.q_per_kv))
            .max(1);
        let host = random_bf16(1 << 20, 0x9E37_79B9_7F4A_7C15);
        let mut slices = Vec::new();
        let mut alloc = |n: u64, what: &str| -> Result<u64, CudaError> {
            let len = elems(n.max(1), what)?;
            let slice = stream.alloc_zeros::<u16>(len).map_err(|e| match e.0 {
                sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => CudaError::OutOfMemory {
                    what: what.to_string(),
                    gb: len as f64 * WORKLOAD_ELEMENT_BYTES / 1e9,
                },
                code => CudaError::Driver {
                    call: "cuMemAlloc",
                    code: format!("{code:?}"),
                },
            })?;
            let ptr = {
                let (ptr, _sync) = slice.device_ptr(&stream);
                ptr
            };
            fill(&stream, ptr, len, &host)?;
            slices.push(slice);
            Ok(ptr)
        };
        let mut weights = Vec::with_capacity(s.layers as usize);
        let mut kv_ptrs = Vec::with_capacity(s.layers as usize);
        for l in 0..s.layers {
            weights.push(alloc(layer_elems, &format!("layer {l} weights"))?);
            kv_ptrs.push(alloc(
                2 * plan.kv_tokens * kv,
                &format!("layer {l} KV cache"),
            )?);
        }
        let ptrs = Ptrs {
            weights,
            kv: kv_ptrs,
            hidden: [
                alloc(b.hidden, "hidden states")?,
                alloc(b.hidden, "hidden states")?,
            ],
            qkv: alloc(b.qkv, "QKV activations")?,
            mlp: alloc(b.mlp, "MLP activations")?,
            q_in: alloc(b.attn_io, "attention queries")?,
            attn_out: alloc(b.attn_io, "attention output")?,
            scores: alloc(scores, "attention scores")?,
        };
        stream
            .synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx
            .new_event(timing)
            .map_err(CudaError::driver("cuEventCreate"))?;
        let end = ctx
            .new_event(timing)
            .map_err(CudaError::driver("cuEventCreate"))?;
        let blocks = KvBlocks::new(
            u32::try_from(plan.kv_tokens / u64::from(KV_BLOCK_TOKENS)).unwrap_or(u32::MAX),
            KV_BLOCK_TOKENS,
        );
        Ok(CudaReplica {
            ctx,
            stream,
            blas,
            info,
            plan,
            max_step_tokens,
            max_prefill,
            layer_elems,
            _slices: slices,
            ptrs,
            start,
            end,
            blocks,
        })
    }

    /// The device the replica runs on (memory as it was before allocating).
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// How memory was planned, and whether the model was scaled down.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// The shape that runs.
    pub fn shape(&self) -> TransformerShape {
        self.plan.shape
    }

    /// Tokens the KV arena holds: the `kv_capacity` the scheduler's
    /// `ReplicaSpec` for this replica should carry.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.blocks.capacity_tokens()
    }

    pub fn kv_free_tokens(&self) -> u64 {
        self.blocks.free_tokens()
    }

    /// Most tokens one step may carry.
    pub fn max_step_tokens(&self) -> u32 {
        self.max_step_tokens
    }

    /// Reserves KV blocks so sequence `seq` can hold `tokens` tokens
    /// (growing what it holds; never shrinking). Returns the blocks it now
    /// holds. [`CudaError::KvFull`] when the arena cannot, changing nothing.
    pub fn reserve(&mut self, seq: u64, tokens: u64) -> Result<usize, CudaError> {
        Ok(self.blocks.reserve(seq, tokens)?.len())
    }

    /// Frees sequence `seq`'s KV blocks (finished, cancelled, preempted);
    /// returns how many. Unknown sequences free nothing.
    pub fn release(&mut self, seq: u64) -> u32 {
        self.blocks.release(seq)
    }

    /// Runs one step on the GPU and returns its time, measured with CUDA
    /// events: `prefill_tokens` new prompt tokens, `decode_seqs` decodes
    /// over `context_tokens` cached tokens in total. Blocks until the GPU
    /// finishes. An empty step takes no time.
    pub fn run_step(
        &mut self,
        prefill_tokens: u32,
        decode_seqs: u32,
        context_tokens: u64,
    ) -> Result<Duration, CudaError> {
        let n = u64::from(prefill_tokens) + u64::from(decode_seqs);
        if n == 0 {
            return Ok(Duration::ZERO);
        }
        if n > u64::from(self.max_step_tokens) {
            return Err(CudaError::StepTooLarge {
                what: format!("{n} tokens"),
                max: u64::from(self.max_step_tokens),
            });
        }
        if prefill_tokens > self.max_prefill {
            return Err(CudaError::StepTooLarge {
                what: format!("a {prefill_tokens}-token prefill chunk"),
                max: u64::from(self.max_prefill),
            });
        }
        if context_tokens > self.plan.kv_tokens {
            return Err(CudaError::ContextTooLarge {
                context: context_tokens,
                capacity: self.plan.kv_tokens,
            });
        }
        guarded(|| self.step(prefill_tokens, n, context_tokens))
    }

    fn step(&mut self, p: u32, n: u64, ctx_tokens: u64) -> Result<Duration, CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let s = self.plan.shape;
        let (d, q, kv, ffn, g) = (
            u64::from(s.d_model),
            u64::from(s.q_dim),
            u64::from(s.kv_dim),
            u64::from(s.ffn),
            u64::from(s.q_per_kv),
        );
        let el = WORKLOAD_ELEMENT_BYTES as u64;
        let qkv_w = q + 2 * kv;
        let p = u64::from(p);
        let cols = s.prefill_columns(p as u32);
        let cap = self.plan.kv_tokens;
        debug_assert!(d * qkv_w + q * d + 3 * d * ffn == self.layer_elems);
        self.start
            .record(&self.stream)
            .map_err(CudaError::driver("cuEventRecord"))?;
        let ptr = &self.ptrs;
        for l in 0..s.layers as usize {
            let (Some(&w), Some(&cache)) = (ptr.weights.get(l), ptr.kv.get(l)) else {
                break;
            };
            let [h0, h1] = ptr.hidden;
            // Offsets (elements) of the layer's four matrices.
            let w_o = w + d * qkv_w * el;
            let w_gu = w_o + d * q * el;
            let w_down = w_gu + 2 * ffn * d * el;
            // 1. QKV projection: [q+2kv × d] · [d × n].
            self.gemm(
                false,
                [qkv_w, n, d],
                Mat::at(w, qkv_w),
                Mat::at(h0, d),
                Mat::at(ptr.qkv, qkv_w),
            )?;
            // 2. Causal attention over a prefill chunk: p keys, `cols`
            //    query columns (K and V from the QKV output).
            if p > 0 {
                let k_new = ptr.qkv + q * el;
                let v_new = ptr.qkv + (q + kv) * el;
                self.gemm(
                    true,
                    [p, cols, kv],
                    Mat::at(k_new, qkv_w),
                    Mat::at(ptr.q_in, kv),
                    Mat::at(ptr.scores, p),
                )?;
                self.gemm(
                    false,
                    [kv, cols, p],
                    Mat::at(v_new, qkv_w),
                    Mat::at(ptr.scores, p),
                    Mat::at(ptr.attn_out, kv),
                )?;
            }
            // 3. Decode attention: the K and V of `ctx_tokens` cached
            //    tokens read from the arena, `g` query columns.
            if ctx_tokens > 0 {
                let k_cache = cache;
                let v_cache = cache + cap * kv * el;
                let c = ctx_tokens;
                self.gemm(
                    true,
                    [c, g, kv],
                    Mat::at(k_cache, kv),
                    Mat::at(ptr.q_in, kv),
                    Mat::at(ptr.scores, c),
                )?;
                self.gemm(
                    false,
                    [kv, g, c],
                    Mat::at(v_cache, kv),
                    Mat::at(ptr.scores, c),
                    Mat::at(ptr.attn_out, kv),
                )?;
            }
            // 4. Output projection [d × q] · [q × n], then the MLP.
            self.gemm(
                false,
                [d, n, q],
                Mat::at(w_o, d),
                Mat::at(h1, q),
                Mat::at(h0, d),
            )?;
            self.gemm(
                false,
                [2 * ffn, n, d],
                Mat::at(w_gu, 2 * ffn),
                Mat::at(h0, d),
                Mat::at(ptr.mlp, 2 * ffn),
            )?;
            self.gemm(
                false,
                [d, n, ffn],
                Mat::at(w_down, d),
                Mat::at(ptr.mlp, 2 * ffn),
                Mat::at(h0, d),
            )?;
        }
        self.end
            .record(&self.stream)
            .map_err(CudaError::driver("cuEventRecord"))?;
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(CudaError::driver("cuEventElapsedTime"))?;
        self.ctx
            .check_err()
            .map_err(CudaError::driver("a deferred CUDA call"))?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }

    /// `C = op(A) · B` in bf16 with fp32 accumulation, column-major: `A`
    /// is `m × k` (stored `k × m` when `ta`), `B` is `k × n`, `C` is
    /// `m × n`, each at a device address with its leading dimension. Every caller's extents lie inside the buffers the memory
    /// plan sized (see the module docs and `step`).
    fn gemm(&self, ta: bool, [m, n, k]: [u64; 3], a: Mat, b: Mat, c: Mat) -> Result<(), CudaError> {
        let (Mat { ptr: a, ld: lda }, Mat { ptr: b, ld: ldb }, Mat { ptr: c, ld: ldc }) = (a, b, c);
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let op_a = if ta {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        };
        // SAFETY: `a`, `b` and `c` are device addresses inside allocations
        // this replica owns, and `step` keeps every operand's extent
        // (`lda × (cols − 1) + rows` elements) inside its buffer: weights
        // by the layer layout, activations by `Buffers` (sized for
        // `max_step_tokens` and `max_prefill`, checked in `run_step`), the
        // arena by `context_tokens ≤ kv_tokens`. alpha and beta outlive the
        // call (host pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op_a,
                cublasOperation_t::CUBLAS_OP_N,
                dim(m)?,
                dim(n)?,
                dim(k)?,
                (&alpha as *const f32).cast::<c_void>(),
                a as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dim(lda)?,
                b as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dim(ldb)?,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                cudaDataType::CUDA_R_16BF,
                dim(ldc)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Cublas {
            call: "cublasGemmEx",
            code: format!("{:?}", e.0),
        })
    }

    /// Measures each point: one untimed run (cuBLAS picks its kernels),
    /// then the median of `repeats` timed runs. `progress(done, total)`
    /// after each point.
    pub fn measure(
        &mut self,
        points: &[StepPoint],
        repeats: u32,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Vec<Measurement>, CudaError> {
        let repeats = repeats.max(1);
        let mut out = Vec::with_capacity(points.len());
        for (i, pt) in points.iter().enumerate() {
            self.run_step(pt.prefill_tokens, pt.decode_seqs, pt.context_tokens)?;
            let mut times = Vec::with_capacity(repeats as usize);
            for _ in 0..repeats {
                let t = self.run_step(pt.prefill_tokens, pt.decode_seqs, pt.context_tokens)?;
                times.push(t.as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let median = times.get(times.len() / 2).copied().unwrap_or(0.0);
            out.push(Measurement {
                point: *pt,
                seconds: median,
            });
            progress(i + 1, points.len());
        }
        Ok(out)
    }
}

/// Fills `len` elements at `ptr` with `host`'s pattern: one upload, then
/// device-to-device copies doubling the filled part.
fn fill(stream: &CudaStream, ptr: u64, len: usize, host: &[u16]) -> Result<(), CudaError> {
    let first = len.min(host.len());
    let el = WORKLOAD_ELEMENT_BYTES as usize;
    let Some(src) = host.get(..first) else {
        return Ok(());
    };
    // SAFETY: `ptr` addresses an allocation of `len ≥ first` elements; the
    // host slice lives until the stream is synchronised after all fills
    // (the caller's `host` outlives them).
    unsafe { cudarc::driver::result::memcpy_htod_async(ptr, src, stream.cu_stream()) }
        .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
    let mut done = first;
    while done < len {
        let n = done.min(len - done);
        // SAFETY: source `[0, n)` and destination `[done, done + n)` lie
        // inside the allocation of `len` elements and do not overlap.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                ptr + (done * el) as u64,
                ptr,
                n * el,
                stream.cu_stream(),
            )
        }
        .map_err(CudaError::driver("cuMemcpyDtoDAsync"))?;
        done += n;
    }
    Ok(())
}

/// A matrix operand of a GEMM: its device address and leading dimension.
#[derive(Debug, Clone, Copy)]
struct Mat {
    ptr: u64,
    ld: u64,
}

impl Mat {
    fn at(ptr: u64, ld: u64) -> Mat {
        Mat { ptr, ld }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_are_small_finite_bf16() {
        for v in random_bf16(10_000, 7) {
            let exp = (v >> 7) & 0xff;
            assert!((120..=126).contains(&exp), "{v:#06x}");
        }
    }

    /// Compile-time: the gateway moves replicas to blocking threads.
    #[test]
    fn replica_is_send() {
        fn send<T: Send>() {}
        send::<CudaReplica>();
    }
}
