//! What governance needs from the gateway it governs. The server
//! implements it; governance never names the server, its HTTP types or
//! its metrics, so the rollout runner and the admin operations run against any
//! implementation (a test double included).

use super::activation::{Activation, ActivationError, Policy};
use crate::backend::cost::Calibration;
use crate::graph::{DecisionGraph, Signals};
use crate::sched::canary::Canary;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

pub trait Gateway: Send + Sync {
    /// The policy in force.
    fn active(&self) -> Arc<Policy>;

    /// Compiles, validates and plans `files` for this gateway; nothing
    /// changes.
    fn compile(&self, files: &BTreeMap<String, String>) -> Result<Policy, ActivationError>;

    /// Compiles and swaps in `files`; on failure the active policy stays.
    fn activate(
        &self,
        files: BTreeMap<String, String>,
    ) -> impl Future<Output = Result<Activation, ActivationError>> + Send;

    /// Starts (`Some`) or ends (`None`) a canary in the scheduler; false
    /// when the scheduler is not running.
    fn set_canary(&self, canary: Option<(Canary, Arc<str>)>) -> impl Future<Output = bool> + Send;

    /// The scheduler's live signals and the graph they belong to.
    fn signals(&self) -> impl Future<Output = Option<(Arc<DecisionGraph>, Signals)>> + Send;

    /// Keeps a version explainable (explain finds its sources).
    fn remember(&self, policy: Arc<Policy>);

    /// The decision log's file, flushed so that a reader sees every
    /// request so far; `None` when no log is configured.
    fn decision_log(&self) -> impl Future<Output = Option<PathBuf>> + Send;

    /// The cost calibration the gateway's simulated pools run on.
    fn calibration(&self) -> Option<Calibration>;

    /// Counts a rollback (`automatic` or `manual`).
    fn count_rollback(&self, trigger: &str);

    /// Counts an approval (`accepted`, or why it was refused).
    fn count_approval(&self, result: &str);

    /// Counts a canary stage a rollout began.
    fn count_stage(&self, version: &str, stage: &str);
}
