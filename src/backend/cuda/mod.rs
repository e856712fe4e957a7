//! Replicas on this machine's GPUs.
//!
//! - [`device`]: the GPU-free parts (device inventory and pool checks, KV
//!   block accounting), built without the feature.
//! - With the `cuda` feature: the device code (the driver and cuBLAS loaded
//!   at run time; see the re-exported `CudaReplica` and `devices`).
//! - [`serve`]: attaching planned replicas to GPUs for the gateway, and
//!   reusing them across a policy swap.
//! - `step` (with the feature): the gateway's steps on those replicas (KV
//!   changes between steps, a step on a blocking thread).

pub mod device;
// The CUDA FFI is the one place kiln needs unsafe code; each block says
// why it is sound.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod gpu;
pub mod serve;
#[cfg(feature = "cuda")]
pub mod step;

#[cfg(feature = "cuda")]
pub use gpu::*;
