//! placeholder until the semantic diff lands (helper owns this file)
use crate::graph::DecisionGraph;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct SemanticDiff {
    pub changes: Vec<String>,
    pub decisions: Vec<String>,
}

impl SemanticDiff {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty() && self.decisions.is_empty()
    }
    pub fn escalations(&self) -> usize {
        0
    }
}

pub fn semantic(_old: &DecisionGraph, _new: &DecisionGraph) -> SemanticDiff {
    SemanticDiff::default()
}

pub fn render_human(_d: &SemanticDiff) -> String {
    String::new()
}

pub fn render_markdown(_d: &SemanticDiff) -> String {
    String::new()
}
