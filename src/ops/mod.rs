//! Operating a fleet from its policy and its recorded traffic: the workload
//! inventory (`kiln report`), capacity plans (`kiln plan`), and the alerting
//! rules and dashboards generated from the declared SLOs (`kiln alerts`,
//! `kiln dashboard`). Reads traffic, replays it and renders; never serves.

pub mod alerts;
pub mod baseline;
pub mod dashboard;
pub mod feasibility;
pub mod plan;
pub mod pool_at;
pub mod report;
