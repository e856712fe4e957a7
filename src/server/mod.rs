//! The gateway: `kiln serve`. An OpenAI-compatible HTTP front (axum) that
//! classifies, admits, queues and dispatches each request through the same
//! pure scheduler core the simulator runs, onto simulated or HTTP backends,
//! and records, measures and explains every decision.

pub mod decision_log;
pub mod metrics;
pub mod upstream;
