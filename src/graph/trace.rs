//! Decision traces for `kiln explain` and `/admin/explain`: which rules were
//! tried, each condition with the value it saw. The evaluator is generic over
//! [`Tracer`]; the hot path uses [`NoTrace`], which compiles to nothing.

use serde::Serialize;

pub trait Tracer {
    fn enabled(&self) -> bool;
    fn stage(&mut self, _stage: &str, _block: String) {}
    fn rule(&mut self, _rule: u32, _matched: bool) {}
    fn test(&mut self, _text: &str, _observed: String, _result: bool) {}
    fn note(&mut self, _note: String) {}
}

/// Tracing off.
pub struct NoTrace;

impl Tracer for NoTrace {
    #[inline(always)]
    fn enabled(&self) -> bool {
        false
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TestTrace {
    pub condition: String,
    pub observed: String,
    pub result: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleTrace {
    pub rule: u32,
    pub matched: bool,
    pub tests: Vec<TestTrace>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageTrace {
    pub stage: String,
    pub block: String,
    pub rules: Vec<RuleTrace>,
    pub notes: Vec<String>,
}

/// Records everything.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct Trace {
    pub stages: Vec<StageTrace>,
    #[serde(skip)]
    pending: Vec<TestTrace>,
}

impl Tracer for Trace {
    fn enabled(&self) -> bool {
        true
    }
    fn stage(&mut self, stage: &str, block: String) {
        self.stages.push(StageTrace {
            stage: stage.to_string(),
            block,
            rules: Vec::new(),
            notes: Vec::new(),
        });
    }
    fn rule(&mut self, rule: u32, matched: bool) {
        let tests = std::mem::take(&mut self.pending);
        if let Some(s) = self.stages.last_mut() {
            s.rules.push(RuleTrace {
                rule,
                matched,
                tests,
            });
        }
    }
    fn test(&mut self, text: &str, observed: String, result: bool) {
        self.pending.push(TestTrace {
            condition: text.to_string(),
            observed,
            result,
        });
    }
    fn note(&mut self, note: String) {
        if let Some(s) = self.stages.last_mut() {
            s.notes.push(note);
        }
    }
}
