//! Backends: where a replica's work runs.
//!
//! - [`cost`]: the roofline cost model of a simulated GPU replica (the
//!   embedded default), with its calibration: [`cost::calibrate`] fits it
//!   to measured step times, [`cost::calibration`] reads the fitted file.
//! - [`http`]: an OpenAI-compatible upstream replica (vLLM, SGLang, TGI,
//!   llama.cpp) with its circuit breaker and SSE parsing.
//! - [`cuda`]: replicas on this machine's GPUs (device code behind the
//!   `cuda` feature; inventory and KV accounting build without it).
//! - [`deploy`]: the one deployment planner: which replicas a policy gets
//!   on which backend, for the gateway and the replay alike.

pub mod cost;
pub mod cuda;
pub mod deploy;
pub mod http;
pub mod placeholder;

use std::sync::Arc;

/// A CUDA replica (feature `cuda`); without the feature the type has no
/// values, so no replica can be on a GPU.
#[cfg(feature = "cuda")]
pub type CudaHandle = Arc<cuda::serve::CudaSlot>;
#[cfg(not(feature = "cuda"))]
pub type CudaHandle = std::convert::Infallible;

/// Where a replica's work runs.
///
/// A closed enum rather than a trait object: the driver treats the three
/// differently (who produces the tokens, who ends a step), and every
/// `match` over it is checked by the compiler when a backend is added.
#[derive(Clone)]
pub enum Backend {
    /// The roofline simulator: the driver produces tokens at step ends.
    Sim,
    /// An OpenAI-compatible upstream: the request handler sends the
    /// request and reports completion.
    Http(Arc<http::Upstream>),
    /// A replica on this machine's GPU: each step runs there and produces
    /// tokens as it ends, as for the simulator.
    Cuda(CudaHandle),
}

impl Backend {
    pub fn name(&self) -> String {
        match self {
            Backend::Sim => "sim".into(),
            Backend::Http(u) => format!("http:{}", u.name()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => format!("cuda:{}", c.name),
            #[cfg(not(feature = "cuda"))]
            Backend::Cuda(never) => match *never {},
        }
    }

    /// Whether it can take requests now (an HTTP upstream's breaker; the
    /// simulator and GPUs always can).
    pub fn ready(&self) -> bool {
        match self {
            Backend::Http(u) => u.ready(),
            _ => true,
        }
    }

    pub fn upstream(&self) -> Option<&Arc<http::Upstream>> {
        match self {
            Backend::Http(u) => Some(u),
            _ => None,
        }
    }
}
