//! `kiln test`: policy tests in TOML files beside the policies. Each case is
//! a request (and optional signals) with the decision it must get; the
//! runner reports per-case differences and which rules no case exercised.
//!
//! ```toml
//! [[case]]
//! name = "support chat is interactive"
//! request = { tenant = "support-bot", model = "llama-70b", prompt_tokens = 800, max_tokens = 256 }
//! signals = { pools = { h100 = { utilization = "97%" } } }
//! expect = { tier = "interactive", route = "llama-70b.int4 on shared", admission = "accept", fallback_step = 1 }
//! ```

use crate::graph::{DecisionGraph, Request, Signals, SignalsInput};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TestFile {
    #[serde(default, rename = "case")]
    pub cases: Vec<Case>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    pub name: String,
    pub request: Request,
    #[serde(default)]
    pub signals: SignalsInput,
    pub expect: Expect,
}

/// Only the fields given are checked.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub tier: Option<String>,
    pub tenant: Option<String>,
    /// `model.variant on pool` or `model.variant`.
    pub route: Option<String>,
    /// The model the request asked for when `route` serves it with a
    /// declared substitute; `(none)` expects no substitution.
    pub substituted_for: Option<String>,
    pub admission: Option<String>,
    pub status: Option<u16>,
    /// 1-based fallback step; 0 expects that no fallback step was taken.
    pub fallback_step: Option<u32>,
    /// The tier whose chain supplied the step (differs after a demote).
    pub fallback_chain: Option<String>,
    pub max_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mismatch {
    pub field: String,
    pub expected: String,
    pub actual: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseResult {
    pub name: String,
    pub passed: bool,
    pub mismatches: Vec<Mismatch>,
    /// A problem with the case itself (unknown pool in signals, …).
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub cases: Vec<CaseResult>,
    pub rules_total: usize,
    /// Rules no case made fire, as `block #n: text`.
    pub uncovered: Vec<String>,
}

impl Report {
    pub fn failed(&self) -> usize {
        self.cases.iter().filter(|c| !c.passed).count()
    }
    pub fn passed(&self) -> usize {
        self.cases.len() - self.failed()
    }
    pub fn coverage_percent(&self) -> f64 {
        if self.rules_total == 0 {
            return 100.0;
        }
        100.0 * (self.rules_total - self.uncovered.len()) as f64 / self.rules_total as f64
    }
}

pub fn parse_file(text: &str) -> Result<TestFile, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}

/// Runs cases against a graph.
pub fn run(g: &DecisionGraph, cases: &[Case]) -> Report {
    let mut fired: BTreeSet<u32> = BTreeSet::new();
    let mut results = Vec::new();
    for c in cases {
        let signals = match Signals::resolve(g, &c.signals) {
            Ok(s) => s,
            Err(e) => {
                results.push(CaseResult {
                    name: c.name.clone(),
                    passed: false,
                    mismatches: Vec::new(),
                    error: Some(e.0),
                });
                continue;
            }
        };
        let d = g.decide(&c.request, &signals);
        for r in d.fired_rules() {
            fired.insert(r);
        }
        let v = g.view(&d);
        let mut m = Vec::new();
        let mut check = |field: &str, expected: Option<String>, actual: String| {
            if let Some(e) = expected {
                if e != actual {
                    m.push(Mismatch {
                        field: field.into(),
                        expected: e,
                        actual,
                    });
                }
            }
        };
        let e = &c.expect;
        check("tier", e.tier.clone(), v.tier.clone());
        check(
            "tenant",
            e.tenant.clone(),
            v.tenant.clone().unwrap_or_else(|| "(none)".into()),
        );
        // A route given without a pool matches whatever pool was placed.
        let actual_route = v.route.clone().unwrap_or_else(|| "(none)".into());
        let route_matches = |exp: &str| {
            exp == actual_route
                || (!exp.contains(" on ") && actual_route.split(" on ").next() == Some(exp))
        };
        if let Some(r) = &e.route {
            if !route_matches(r) {
                check("route", Some(r.clone()), actual_route.clone());
            }
        }
        check(
            "substituted_for",
            e.substituted_for.clone(),
            v.substituted_for.clone().unwrap_or_else(|| "(none)".into()),
        );
        check("admission", e.admission.clone(), v.admission.clone());
        check(
            "status",
            e.status.map(|s| s.to_string()),
            v.status
                .map(|s| s.to_string())
                .unwrap_or_else(|| "(none)".into()),
        );
        check(
            "fallback_step",
            e.fallback_step.map(|s| s.to_string()),
            v.fallback_step.unwrap_or(0).to_string(),
        );
        check(
            "fallback_chain",
            e.fallback_chain.clone(),
            v.fallback_chain.clone().unwrap_or_else(|| "(none)".into()),
        );
        check(
            "max_tokens",
            e.max_tokens.map(|s| s.to_string()),
            v.max_tokens.to_string(),
        );
        results.push(CaseResult {
            name: c.name.clone(),
            passed: m.is_empty(),
            mismatches: m,
            error: None,
        });
    }
    let uncovered = g
        .rules
        .iter()
        .enumerate()
        .filter(|(i, _)| !fired.contains(&(*i as u32)))
        .map(|(_, r)| format!("{} #{}: {}", r.block, r.index, r.text))
        .collect();
    Report {
        cases: results,
        rules_total: g.rules.len(),
        uncovered,
    }
}
