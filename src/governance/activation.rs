//! What the gateway activates (a compiled [`Policy`]) and what activating
//! answers: an [`Activation`], or an [`ActivationError`] saying why the
//! last good policy keeps serving. Typed, so governance reads outcomes
//! instead of picking fields out of an HTTP body.

use crate::backend::deploy::DeployError;
use crate::graph::DecisionGraph;
use crate::source::SourceMap;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One compiled policy version.
pub struct Policy {
    pub graph: Arc<DecisionGraph>,
    /// `sha256:` and the first 12 hex digits of the sources' hash.
    pub version: Arc<str>,
    pub sources: SourceMap,
}

impl Policy {
    pub fn new(graph: DecisionGraph, sources: SourceMap) -> Policy {
        Policy {
            version: super::policy_version(&sources).into(),
            graph: Arc::new(graph),
            sources,
        }
    }

    /// Its files, name → text, as an upload carries them.
    pub fn files(&self) -> BTreeMap<String, String> {
        self.sources
            .files()
            .map(|(_, f)| (f.name.clone(), f.text.to_string()))
            .collect()
    }
}

/// A policy activated (or found already active: `changed` false).
#[derive(Debug, Clone, PartialEq)]
pub struct Activation {
    pub version: String,
    pub previous: String,
    pub changed: bool,
    /// Queued requests decided again under the new version.
    pub redecided: usize,
    /// Deployment notes (replicas that did not fit, say).
    pub notes: Vec<String>,
}

/// The answer of `POST /admin/policy`: an unchanged policy reports only
/// its version, previous and `changed`, as it always has.
impl Serialize for Activation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("version", &self.version)?;
        m.serialize_entry("previous", &self.previous)?;
        m.serialize_entry("changed", &self.changed)?;
        if self.changed {
            m.serialize_entry("redecided", &self.redecided)?;
            m.serialize_entry("notes", &self.notes)?;
        }
        m.end()
    }
}

/// Why a policy was not activated (or not even compiled); the active
/// policy is unchanged.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ActivationError {
    /// The compiler's errors, as JSON diagnostics and rendered text.
    #[error("the policy does not compile; the active policy is unchanged")]
    #[diagnostic(code(kiln::activate::invalid_policy))]
    Invalid {
        diagnostics: Vec<crate::diag::JsonDiagnostic>,
        rendered: String,
    },
    #[error("the policy produced no decision graph")]
    #[diagnostic(code(kiln::activate::no_graph))]
    NoGraph,
    /// The policy does not fit this gateway's pools and backends.
    #[error("{0}; the active policy is unchanged")]
    #[diagnostic(code(kiln::activate::deploy))]
    Deploy(DeployError),
    /// A key the new policy gives one tenant that kiln.toml maps to another.
    #[error("{0}; the active policy is unchanged")]
    #[diagnostic(
        code(kiln::activate::key_clash),
        help("a key authenticates one tenant: fix the policy's api_keys or kiln.toml's [[keys]] entry")
    )]
    KeyClash(String),
    #[error("the scheduler is not running")]
    #[diagnostic(code(kiln::activate::scheduler_down))]
    SchedulerDown,
    /// With a shared store: the fleet's governance step could not be had
    /// (or recorded).
    #[error(transparent)]
    #[diagnostic(transparent)]
    Shared(#[from] super::shared::StepError),
}

impl ActivationError {
    /// The HTTP status `POST /admin/policy` answers with.
    pub fn status(&self) -> u16 {
        match self {
            ActivationError::SchedulerDown | ActivationError::Shared(_) => 503,
            _ => 422,
        }
    }

    /// The error `type` of the answer.
    pub fn kind(&self) -> &'static str {
        match self {
            ActivationError::SchedulerDown | ActivationError::Shared(_) => "service_unavailable",
            _ => "invalid_policy",
        }
    }

    /// The JSON answer: `{"error": {"message", "type"}}`, and the
    /// diagnostics for a policy that does not compile.
    pub fn body(&self) -> Value {
        let error = json!({"message": self.to_string(), "type": self.kind()});
        match self {
            ActivationError::Invalid {
                diagnostics,
                rendered,
            } => json!({"error": error, "diagnostics": diagnostics, "rendered": rendered}),
            _ => json!({"error": error}),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unchanged_activation_reports_no_redecisions() {
        let mut a = Activation {
            version: "sha256:b".into(),
            previous: "sha256:a".into(),
            changed: true,
            redecided: 2,
            notes: vec!["n".into()],
        };
        assert_eq!(
            serde_json::to_string(&a).ok().as_deref(),
            Some(
                r#"{"version":"sha256:b","previous":"sha256:a","changed":true,"redecided":2,"notes":["n"]}"#
            )
        );
        a.changed = false;
        assert_eq!(
            serde_json::to_string(&a).ok().as_deref(),
            Some(r#"{"version":"sha256:b","previous":"sha256:a","changed":false}"#)
        );
    }

    #[test]
    fn refusals_keep_their_status_and_type() {
        let e = ActivationError::SchedulerDown;
        assert_eq!(e.status(), 503);
        assert_eq!(
            e.body(),
            json!({"error": {"message": "the scheduler is not running", "type": "service_unavailable"}})
        );
        assert_eq!(ActivationError::NoGraph.status(), 422);
    }
}
