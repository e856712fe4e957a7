//! A decision in names rather than ids: what `kiln explain`, `kiln test` and
//! the gateway's decision log show and compare.

use super::eval::{Admission, Decision, Target};
use super::DecisionGraph;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionView {
    pub tenant: Option<String>,
    pub tier: String,
    /// `model.variant on pool`, or `model.variant` when placement is left to
    /// the scheduler.
    pub route: Option<String>,
    /// The model the request asked for, when `route` names another model
    /// that serves it (a declared `served_by` substitution).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub substituted_for: Option<String>,
    /// accept, queue, delay, degrade or reject.
    pub admission: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay_until: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// 1-based step of the fallback chain that decided, if any.
    pub fallback_step: Option<u32>,
    /// The tier whose chain that step belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_chain: Option<String>,
    pub max_tokens: u64,
    /// The rules that decided, as `block #n`.
    pub rules: Vec<FiredRule>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FiredRule {
    pub block: String,
    pub index: usize,
    pub text: String,
}

impl DecisionGraph {
    pub fn target_name(&self, t: &Target) -> String {
        let base = self.variant_name(t.model, t.variant);
        match t.pool.and_then(|p| self.pools.get(p as usize)) {
            Some(p) => format!("{base} on {}", p.name),
            None => base,
        }
    }

    pub fn view(&self, d: &Decision) -> DecisionView {
        let mut v = DecisionView {
            tenant: d
                .tenant
                .and_then(|t| self.tenants.get(t as usize))
                .map(|t| t.name.clone()),
            tier: self
                .tiers
                .get(d.tier as usize)
                .map(|t| t.name.clone())
                .unwrap_or_default(),
            route: d.target.as_ref().map(|t| self.target_name(t)),
            substituted_for: d
                .substituted_for()
                .and_then(|m| self.models.get(m as usize))
                .map(|m| m.name.clone()),
            admission: d.admission.kind().to_string(),
            max_wait_ms: None,
            delay_until: None,
            status: None,
            message: None,
            retry_after_ms: None,
            reason: None,
            fallback_step: d.fallback_step.map(|s| u32::from(s) + 1),
            fallback_chain: d
                .fallback_chain
                .and_then(|t| self.tiers.get(t as usize))
                .map(|t| t.name.clone()),
            max_tokens: d.max_tokens,
            rules: d
                .fired_rules()
                .filter_map(|r| self.rules.get(r as usize))
                .map(|r| FiredRule {
                    block: r.block.clone(),
                    index: r.index,
                    text: r.text.clone(),
                })
                .collect(),
        };
        match d.admission {
            Admission::Queue { max_wait } => v.max_wait_ms = Some(max_wait),
            Admission::Hold { max_wait } => v.max_wait_ms = max_wait,
            Admission::Delay { until } => {
                v.delay_until = Some(format!("{:02}:{:02}", until / 60, until % 60))
            }
            Admission::Reject(r) => {
                v.status = Some(r.status);
                v.message = Some(r.message.clone());
                v.retry_after_ms = r.retry_after;
                v.reason = Some(r.reason.to_string());
            }
            _ => {}
        }
        v
    }
}
