//! Backends that run batches: `sim` (the roofline cost model, the embedded
//! default), `cuda` (real GPUs, cargo feature `cuda`), later `http`.
//!
//! [`calibrate`] fits the simulator to measured step times and [`device`]
//! holds the GPU-free parts of the CUDA backend (device inventory and pool
//! checks, KV block accounting); both build without the feature.

pub mod calibrate;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod sim;
