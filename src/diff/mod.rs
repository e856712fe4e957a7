//! `kiln diff`: what a policy change does. The semantic diff compares the
//! two compiled graphs; with recorded traffic, every request is decided by
//! both, and both policies are replayed through the simulator on the same
//! traffic, side by side, so a reviewer sees per tier and tenant what the
//! change would do before it ships. Gates turn the report into a CI check.

pub mod gate;
pub mod plot;
pub mod semantic;
pub mod traffic;

use crate::sim::report::Report;
use serde::Serialize;

/// Everything `kiln diff` reports (the JSON schema; see README).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiffReport {
    pub semantic: semantic::SemanticDiff,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions: Option<traffic::DecisionDiff>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub impact: Option<traffic::Impact>,
    pub gates: Vec<gate::GateResult>,
}

impl DiffReport {
    pub fn tripped(&self) -> bool {
        self.gates.iter().any(|g| g.tripped)
    }
}

/// The reports of both replays, for gates that read them.
pub fn reports(r: &DiffReport) -> Option<(&Report, &Report)> {
    r.impact.as_ref().map(|i| (&i.old, &i.new))
}
