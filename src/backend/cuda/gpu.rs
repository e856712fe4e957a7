//! The CUDA backend (cargo feature `cuda`): real GPUs running a
//! transformer-shaped workload per scheduled batch.
//!
//! cudarc loads the driver (`libcuda.so`) and cuBLAS at run time, so
//! building needs no CUDA toolkit. cudarc panics at the first call into a
//! library it cannot load, so every entry point here checks that the
//! library is present first ([`ensure_driver`], [`ensure_cublas`]) and
//! turns its absence into [`CudaError::NoDriver`] or
//! [`CudaError::NoCublas`]; as a last resort, a panic inside cudarc is
//! caught and returned as [`CudaError::Panicked`]. No path panics on a
//! machine without a GPU.
//!
//! - [`devices`]: the inventory `kiln gpus` prints (and the gateway checks
//!   pools against with [`crate::backend::cuda::device::check_pool`]).
//! - [`CudaReplica`]: one replica's weights, KV arena and step runner; see
//!   its docs for the workload.

#[path = "replica.rs"]
mod replica;

pub use replica::{CudaReplica, CudaReplicaConfig};

use super::device::{DeviceInfo, KvFull};
use crate::backend::cost::calibrate::CalibrateError;
use cudarc::driver::{sys, CudaContext, DriverError};
use miette::Diagnostic;

/// Why the CUDA backend cannot do what was asked.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum CudaError {
    #[error("no CUDA driver found; use the sim or http backend")]
    #[diagnostic(
        code(kiln::cuda::no_driver),
        help("the NVIDIA driver library (libcuda.so) cannot be loaded on this machine: install the driver, or give the pool backend = \"sim\" or \"http\" in kiln.toml")
    )]
    NoDriver,

    #[error("cuBLAS not found; the CUDA backend runs its GEMMs with it")]
    #[diagnostic(
        code(kiln::cuda::no_cublas),
        help("install cuBLAS for CUDA 12 (libcublas.so.12: the CUDA toolkit, the distribution's libcublas12 package, or the nvidia-cublas-cu12 wheel) and put its directory on LD_LIBRARY_PATH")
    )]
    NoCublas,

    #[error("the CUDA driver sees no GPU")]
    #[diagnostic(
        code(kiln::cuda::no_devices),
        help("check `nvidia-smi`; CUDA_VISIBLE_DEVICES may hide the GPUs from this process")
    )]
    NoDevices,

    #[error("GPU {ordinal} does not exist: the CUDA driver sees {count}")]
    #[diagnostic(
        code(kiln::cuda::no_such_device),
        help("pick a device that `kiln gpus` lists")
    )]
    NoSuchDevice { ordinal: usize, count: usize },

    #[error("CUDA driver call {call} failed: {code}")]
    #[diagnostic(
        code(kiln::cuda::driver),
        help("`nvidia-smi` shows whether the GPU is healthy and free; a driver older than CUDA 12.6 may lack calls kiln uses")
    )]
    Driver { call: &'static str, code: String },

    #[error("out of GPU memory allocating {what} ({gb:.2} GB)")]
    #[diagnostic(
        code(kiln::cuda::out_of_memory),
        help("another process may hold GPU memory (`nvidia-smi`); run a fraction of the layers with --scale, or a smaller variant")
    )]
    OutOfMemory { what: String, gb: f64 },

    #[error("cuBLAS call {call} failed: {code}")]
    #[diagnostic(
        code(kiln::cuda::cublas),
        help("cuBLAS may be older than the driver's CUDA version; a CUBLAS_STATUS_NOT_SUPPORTED needs a GPU with bf16 tensor cores (compute capability 8.0 or later)")
    )]
    Cublas { call: &'static str, code: String },

    #[error("a step of {what} exceeds what the replica was sized for ({max})")]
    #[diagnostic(
        code(kiln::cuda::step_too_large),
        help("the replica's buffers are sized for the variant's max_batch_tokens; the scheduler never plans larger steps")
    )]
    StepTooLarge { what: String, max: u64 },

    #[error("a step reads {context} cached tokens, but the KV arena holds {capacity}")]
    #[diagnostic(
        code(kiln::cuda::context_too_large),
        help("the scheduler's KV capacity for this replica must not exceed CudaReplica::kv_capacity_tokens()")
    )]
    ContextTooLarge { context: u64, capacity: u64 },

    #[error("the CUDA library panicked: {0}")]
    #[diagnostic(
        code(kiln::cuda::panicked),
        help("a driver or cuBLAS older than CUDA 12.6 may lack a function cudarc loads; update the driver")
    )]
    Panicked(String),

    #[error(transparent)]
    #[diagnostic(transparent)]
    Plan(#[from] CalibrateError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    KvFull(#[from] KvFull),
}

impl CudaError {
    fn driver(call: &'static str) -> impl Fn(DriverError) -> CudaError {
        move |e| match e.0 {
            sys::CUresult::CUDA_ERROR_NO_DEVICE => CudaError::NoDevices,
            code => CudaError::Driver {
                call,
                code: format!("{code:?}"),
            },
        }
    }
}

/// Is the CUDA driver library loadable?
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names and
    // drops what it opened; no function of it is called.
    unsafe { sys::is_culib_present() }
}

/// Is cuBLAS loadable?
pub fn cublas_present() -> bool {
    // SAFETY: as for `driver_present`.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// [`CudaError::NoDriver`] unless the driver library loads.
pub fn ensure_driver() -> Result<(), CudaError> {
    if driver_present() {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

/// [`CudaError::NoCublas`] unless cuBLAS loads.
pub fn ensure_cublas() -> Result<(), CudaError> {
    if cublas_present() {
        Ok(())
    } else {
        Err(CudaError::NoCublas)
    }
}

/// Runs `f`, turning a panic inside cudarc into [`CudaError::Panicked`].
pub(crate) fn guarded<T>(f: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CudaError::Panicked(msg))
        }
    }
}

/// How many GPUs the driver sees (after checking it is present).
pub fn device_count() -> Result<usize, CudaError> {
    guarded(|| {
        ensure_driver()?;
        cudarc::driver::result::init().map_err(CudaError::driver("cuInit"))?;
        let n = cudarc::driver::result::device::get_count()
            .map_err(CudaError::driver("cuDeviceGetCount"))?;
        Ok(usize::try_from(n).unwrap_or(0))
    })
}

/// One device's figures, from a context on it.
pub(crate) fn info_of(ctx: &CudaContext, ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let name = ctx.name().map_err(CudaError::driver("cuDeviceGetName"))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(CudaError::driver("cuDeviceGetAttribute"))?;
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(CudaError::driver("cuDeviceGetAttribute"))?;
    let (free, total) = ctx
        .mem_get_info()
        .map_err(CudaError::driver("cuMemGetInfo"))?;
    Ok(DeviceInfo {
        ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
        name,
        compute_capability: (
            u32::try_from(major).unwrap_or(0),
            u32::try_from(minor).unwrap_or(0),
        ),
        sms: u32::try_from(sms).unwrap_or(0),
        total_memory: total as u64,
        free_memory: free as u64,
    })
}

/// Every GPU the driver sees, with its name, compute capability, SMs and
/// total and free memory. [`CudaError::NoDriver`] (not a panic) on a
/// machine without the driver; [`CudaError::NoDevices`] when it sees none.
pub fn devices() -> Result<Vec<DeviceInfo>, CudaError> {
    let count = device_count()?;
    if count == 0 {
        return Err(CudaError::NoDevices);
    }
    guarded(|| {
        (0..count)
            .map(|i| {
                let ctx =
                    CudaContext::new(i).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
                info_of(&ctx, i)
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without the driver (CI), every entry point returns the
    /// error instead of panicking; on a GPU machine they succeed.
    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        if driver_present() {
            return;
        }
        assert!(matches!(ensure_driver(), Err(CudaError::NoDriver)));
        assert!(matches!(device_count(), Err(CudaError::NoDriver)));
        assert!(matches!(devices(), Err(CudaError::NoDriver)));
        let e = devices().unwrap_err();
        assert_eq!(
            e.to_string(),
            "no CUDA driver found; use the sim or http backend"
        );
        let shape =
            crate::backend::cost::calibrate::TransformerShape::for_model("m", 1e9, 65_536.0, 1)
                .unwrap();
        let r = CudaReplica::new(&CudaReplicaConfig::default(), &shape);
        assert!(matches!(r, Err(CudaError::NoDriver)), "{r:?}");
    }

    #[test]
    fn panics_become_errors() {
        let r: Result<(), CudaError> = guarded(|| panic!("Missing symbol cuFoo"));
        assert!(matches!(r, Err(CudaError::Panicked(m)) if m.contains("cuFoo")));
    }
}
