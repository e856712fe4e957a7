//! One request's life in the gateway, in one place: its types and states,
//! the pipeline that runs it, the admission checks the gateway makes
//! itself, and the recorder that writes how it ended.
//!
//! ```text
//! arrived ──► decided ──► admitted ──► started ──► served
//!    │           │           │            │
//!    └───────────┴───────────┴────────────┴──► refused | cache hit
//!                                              | cancelled | failed
//! ```
//!
//! - [`pipeline`]: runs an arrived request (from an HTTP handler or the
//!   batch runner) through the gateway's gates, the scheduler and a
//!   backend.
//! - [`gates`]: the gateway's own admission checks, in order, each with
//!   its reason code and message (the scheduler's are `sched::admit`).
//! - [`stream`]: the one path from a backend's output to the client.
//! - [`cache`]: answering a cache hit, storing a complete answer.
//! - [`refusal`]: the answer to a refusal, in the policy's words.
//! - [`recorder`]: explain, decision log, metrics, costs and response
//!   headers of every end.
//! - [`headers`]: what a record keeps of the client's headers.

pub(in crate::server) mod cache;
pub(in crate::server) mod gates;
pub(in crate::server) mod headers;
pub(in crate::server) mod pipeline;
pub(in crate::server) mod ratelimit;
pub(in crate::server) mod recorder;
pub(in crate::server) mod refusal;
pub(in crate::server) mod stream;

use crate::graph::{DecisionGraph, Request, ResponseModel, Signals, TenantId, TierId};
use crate::sched::{Reason, ReqId};
use crate::server::executor::Command;
use crate::server::explain::Shared;
use crate::server::openai::{ApiError, Endpoint};
use crate::server::App;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// The header a batch item carries (its batch id); classify rules read it
/// as the `batch` signal or `header("x-kiln-batch")`.
pub use crate::graph::BATCH_HEADER;

/// Cancels the request in the scheduler unless disarmed: dropped with the
/// handler or the response stream when the client disconnects.
pub(in crate::server) struct CancelGuard {
    id: ReqId,
    app: Arc<App>,
    pub(in crate::server) armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.app.exec.send(Command::Cancel(self.id));
        }
    }
}

pub(in crate::server) struct Decided {
    pub(in crate::server) tier: TierId,
    pub(in crate::server) tenant: Option<TenantId>,
    pub(in crate::server) fallback_step: Option<u8>,
    /// The version that decided (a canary's, when it did).
    pub(in crate::server) version: Arc<str>,
    /// The active graph: `tier` and `tenant` are its ids.
    pub(in crate::server) graph: Arc<DecisionGraph>,
    /// The graph and signals that decided (a canary's, when it did).
    pub(in crate::server) policy_graph: Arc<DecisionGraph>,
    pub(in crate::server) policy_signals: Arc<Signals>,
    pub(in crate::server) canary: bool,
    /// Missed its tier's exact cache: a complete answer is stored under
    /// this key ([`super::cache`]).
    pub(in crate::server) cache: Option<crate::sched::cache::Key>,
    /// Its rate limits after admission (`x-ratelimit-*`), where the quota
    /// gate saw it.
    pub(in crate::server) limits: Option<crate::sched::ratelimit::RateLimits>,
}

pub(in crate::server) struct Ctx {
    pub(in crate::server) app: Arc<App>,
    pub(in crate::server) endpoint: Endpoint,
    pub(in crate::server) id: ReqId,
    pub(in crate::server) rid: String,
    pub(in crate::server) req: Request,
    pub(in crate::server) body: Value,
    pub(in crate::server) client_model: String,
    pub(in crate::server) stream: bool,
    pub(in crate::server) include_usage: bool,
    pub(in crate::server) received: Instant,
    pub(in crate::server) received_ms: f64,
    pub(in crate::server) explain: Shared,
    /// Times it went back to the queue after an upstream did not serve it
    /// (`x-kiln-upstream-requeued`).
    pub(in crate::server) requeued: u32,
    /// GPU time its earlier upstream attempts held a slot for (preempted,
    /// failed, never received): charged, and served nothing.
    pub(in crate::server) spent_gpu_seconds: f64,
    /// Where it ran last (`model.variant on pool`), for the labels of
    /// that time when it is refused afterwards.
    pub(in crate::server) spent_on: Option<std::sync::Arc<str>>,
    /// The prompt's prefix block ids ([`crate::server::prefix`]).
    pub(in crate::server) prefix_blocks: Vec<u64>,
    /// A batch item's own deadline, from its arrival.
    pub(in crate::server) window: Option<crate::sched::Micros>,
    /// Its claim on the tenant's quota across the fleet (`[state]`).
    pub(in crate::server) claim: Option<Arc<crate::server::fleet::Claim>>,
    /// Its content hash when it is cacheable and a tier has an exact cache.
    pub(in crate::server) cache_content: Option<crate::sched::cache::Key>,
    /// Its question's embedding, when a tier has a semantic cache.
    pub(in crate::server) semantic_probe: crate::server::cache::Semantic,
}

impl Ctx {
    pub(in crate::server) fn ms(&self) -> f64 {
        self.received.elapsed().as_secs_f64() * 1000.0
    }

    /// A batch item's own completion window, in policy milliseconds.
    pub(in crate::server) fn window_ms(&self) -> Option<f64> {
        self.window.map(|w| w as f64 / 1000.0)
    }
}

/// Who sent a request and what came with it, past authentication.
pub(in crate::server) struct Arrived {
    pub(in crate::server) received: Instant,
    pub(in crate::server) received_ms: f64,
    pub(in crate::server) tenant: Option<String>,
    pub(in crate::server) headers: BTreeMap<String, String>,
    pub(in crate::server) tags: Vec<String>,
    pub(in crate::server) session: Option<String>,
    /// A batch item's deadline: what is left of its batch's window.
    pub(in crate::server) window: Option<crate::sched::Micros>,
}

pub(in crate::server) struct Started {
    pub(in crate::server) d: Decided,
    pub(in crate::server) route: std::sync::Arc<str>,
    /// Its index in the scheduler's plan (for the decision log).
    pub(in crate::server) replica: usize,
    pub(in crate::server) waited_for: Option<Reason>,
    pub(in crate::server) queue_s: f64,
    pub(in crate::server) preempted: u32,
}

/// A request served by another model than the one it asked for.
pub(in crate::server) struct Served {
    pub(in crate::server) asked: String,
    pub(in crate::server) served: String,
    pub(in crate::server) response_model: ResponseModel,
}

/// When the replica a request started on serves another model than the
/// one it asked for (a declared `served_by` substitution), which, and how
/// the response reports it (the deciding version's declaration; the
/// served model when none is found, which is what ran).
pub(in crate::server) fn served_substitution(ctx: &Ctx, s: &Started) -> Option<Served> {
    let served = s.route.split_once('.').map(|(m, _)| m)?;
    let asked = ctx.req.model.as_str();
    if served == asked {
        return None;
    }
    let tier =
        s.d.graph
            .tiers
            .get(s.d.tier as usize)
            .map(|t| t.name.as_str());
    let declared = [&s.d.policy_graph, &s.d.graph].into_iter().find_map(|g| {
        let t = g.tier_id(tier?)?;
        g.substitution(g.model_id(asked)?, g.model_id(served)?, t)
            .map(|x| x.response_model)
    });
    Some(Served {
        asked: asked.to_string(),
        served: served.to_string(),
        response_model: declared.unwrap_or_default(),
    })
}

/// How a request's run through the pipeline ended
/// ([`pipeline::run_request`]). Every end is recorded (explain, log,
/// metrics, costs) by the time it is returned, except a stream's: the
/// stream inside `Served` records its own end as it finishes, or as the
/// client drops it.
pub(in crate::server) enum Outcome {
    /// Started on a replica and answered there: a whole body or a stream.
    /// Its status is the answer's (an upstream's error before a byte of a
    /// whole answer was sent is `Failed`, not this).
    Served {
        rid: String,
        response: Response,
        /// What the whole answer cost on a scheduled replica (0 for a
        /// stream, whose cost is known at its end, and for an upstream).
        gpu_seconds: f64,
    },
    /// Answered from its tier's exact or semantic cache.
    CacheHit { rid: String, response: Response },
    /// Refused: by a gate, the policy or the scheduler (`Retry-After` in
    /// the error where a retry may pass).
    Refused(ApiError),
    /// Admitted but not served: an upstream's failure, its budget, the
    /// scheduler stopping.
    Failed(ApiError),
}

impl Outcome {
    /// An error the pipeline answers with, as a refusal or a failure: 5xx
    /// other than 503 (a refusal to retry later) is a failure.
    fn of_error(err: ApiError) -> Outcome {
        match err.status {
            503 => Outcome::Refused(err),
            500..=599 => Outcome::Failed(err),
            _ => Outcome::Refused(err),
        }
    }

    /// The request id kiln recorded it under, where it did.
    pub(in crate::server) fn rid(&self) -> Option<&str> {
        match self {
            Outcome::Served { rid, .. } | Outcome::CacheHit { rid, .. } => Some(rid),
            Outcome::Refused(e) | Outcome::Failed(e) => e.recorded.as_ref().map(|r| r.id.as_str()),
        }
    }
}

impl IntoResponse for Outcome {
    fn into_response(self) -> Response {
        match self {
            Outcome::Served { response, .. } | Outcome::CacheHit { response, .. } => response,
            Outcome::Refused(e) | Outcome::Failed(e) => e.into_response(),
        }
    }
}

/// What a whole answer cost on a scheduled replica, carried with its
/// response from [`stream`] to the pipeline's [`Outcome::Served`] (the
/// `x-kiln-gpu-seconds` header is the client's copy of the same number).
#[derive(Debug, Clone, Copy)]
pub(in crate::server) struct GpuSeconds(pub(in crate::server) f64);
