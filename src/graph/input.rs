//! What a decision reads: the request (attributes the gateway extracted) and
//! the live signals (pool load, tier waits, quota state, clock). Both have a
//! JSON form for `kiln explain` and `kiln test`; signals are resolved against
//! a graph once into dense vectors so evaluation does no name lookups.

use super::{DecisionGraph, PoolId, TenantId, TierId};
use crate::units::{self, Ty};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One inference request, as classified. Header names are matched without
/// regard to case.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    pub model: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub max_tokens: u64,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A number, or a string with a unit (`"85%"`, `"2s"`, `"09:30"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Quant {
    Num(f64),
    Text(String),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolInput {
    #[serde(default)]
    pub utilization: Option<Quant>,
    #[serde(default)]
    pub queue_depth: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierInput {
    #[serde(default)]
    pub wait_p95: Option<Quant>,
    #[serde(default)]
    pub ttft_p95: Option<Quant>,
    #[serde(default)]
    pub e2e_p95: Option<Quant>,
    #[serde(default)]
    pub slo_attainment: Option<Quant>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantInput {
    /// Share of the tightest quota left, `"40%"`.
    #[serde(default)]
    pub quota_remaining: Option<Quant>,
    #[serde(default)]
    pub in_flight: Option<u64>,
    #[serde(default)]
    pub deadline_misses: Option<u64>,
}

/// Live signals as JSON or TOML: everything optional; absent pools are idle,
/// absent tenants have their whole quota.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalsInput {
    #[serde(default)]
    pub pools: BTreeMap<String, PoolInput>,
    #[serde(default)]
    pub tiers: BTreeMap<String, TierInput>,
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantInput>,
    #[serde(default)]
    pub estimated_wait: Option<Quant>,
    /// `"HH:MM"`
    #[serde(default)]
    pub time: Option<String>,
    #[serde(default)]
    pub weekday: Option<String>,
    #[serde(default)]
    pub error_rate: Option<Quant>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolSignal {
    pub utilization: f64,
    pub queue_depth: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierMetrics {
    pub wait_p95: f64,
    pub ttft_p95: f64,
    pub e2e_p95: f64,
    pub slo_attainment: f64,
}

impl Default for TierMetrics {
    fn default() -> Self {
        TierMetrics {
            wait_p95: 0.0,
            ttft_p95: 0.0,
            e2e_p95: 0.0,
            slo_attainment: 100.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantSignal {
    pub quota_remaining: f64,
    pub in_flight: u64,
    pub deadline_misses: f64,
}

impl Default for TenantSignal {
    fn default() -> Self {
        TenantSignal {
            quota_remaining: 100.0,
            in_flight: 0,
            deadline_misses: 0.0,
        }
    }
}

/// Signals resolved against one graph: vectors indexed by its ids.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Signals {
    pub pools: Vec<PoolSignal>,
    pub tiers: Vec<TierMetrics>,
    pub tenants: Vec<TenantSignal>,
    /// ms
    pub estimated_wait: f64,
    /// minutes after midnight
    pub time_of_day: u16,
    /// 0 = Monday
    pub weekday: u8,
    pub error_rate: f64,
    /// Names for traces (pool, tier, tenant, model), copied from the graph.
    names: Option<std::sync::Arc<NameTable>>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct NameTable {
    tenants: Vec<String>,
    tiers: Vec<String>,
    models: Vec<String>,
    pools: Vec<String>,
}

/// A signal value that does not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct SignalError(pub String);

fn quant(q: &Quant, ty: Ty, what: &str) -> Result<f64, SignalError> {
    match q {
        Quant::Num(n) => Ok(*n),
        Quant::Text(s) => match units::parse_literal(s) {
            Some(Ok(t)) if t.ty == ty => Ok(t.value),
            _ => Err(SignalError(format!(
                "{what}: `{s}` is not {}",
                ty.describe()
            ))),
        },
    }
}

impl Signals {
    /// Idle fleet, Monday 12:00.
    pub fn idle(g: &DecisionGraph) -> Signals {
        Signals {
            pools: vec![PoolSignal::default(); g.pools.len()],
            tiers: vec![TierMetrics::default(); g.tiers.len()],
            tenants: vec![TenantSignal::default(); g.tenants.len()],
            estimated_wait: 0.0,
            time_of_day: 12 * 60,
            weekday: 0,
            error_rate: 0.0,
            names: Some(std::sync::Arc::new(NameTable {
                tenants: g.tenants.iter().map(|t| t.name.clone()).collect(),
                tiers: g.tiers.iter().map(|t| t.name.clone()).collect(),
                models: g.models.iter().map(|t| t.name.clone()).collect(),
                pools: g.pools.iter().map(|t| t.name.clone()).collect(),
            })),
        }
    }

    /// Resolves the JSON form against a graph. Unknown names are errors, so a
    /// test that sets signals for a misspelt pool fails loudly.
    pub fn resolve(g: &DecisionGraph, input: &SignalsInput) -> Result<Signals, SignalError> {
        let mut s = Signals::idle(g);
        for (name, p) in &input.pools {
            let id = g
                .pool_id(name)
                .ok_or_else(|| SignalError(format!("signals name unknown pool `{name}`")))?;
            let slot = &mut s.pools[id as usize];
            if let Some(u) = &p.utilization {
                slot.utilization = quant(u, Ty::Percent, "pool utilization")?;
            }
            if let Some(q) = p.queue_depth {
                slot.queue_depth = q as f64;
            }
        }
        for (name, t) in &input.tiers {
            let id = g
                .tier_id(name)
                .ok_or_else(|| SignalError(format!("signals name unknown tier `{name}`")))?;
            let slot = &mut s.tiers[id as usize];
            if let Some(v) = &t.wait_p95 {
                slot.wait_p95 = quant(v, Ty::Duration, "tier wait_p95")?;
            }
            if let Some(v) = &t.ttft_p95 {
                slot.ttft_p95 = quant(v, Ty::Duration, "tier ttft_p95")?;
            }
            if let Some(v) = &t.e2e_p95 {
                slot.e2e_p95 = quant(v, Ty::Duration, "tier e2e_p95")?;
            }
            if let Some(v) = &t.slo_attainment {
                slot.slo_attainment = quant(v, Ty::Percent, "tier slo_attainment")?;
            }
        }
        for (name, t) in &input.tenants {
            let id = g
                .tenant_id(name)
                .ok_or_else(|| SignalError(format!("signals name unknown tenant `{name}`")))?;
            let slot = &mut s.tenants[id as usize];
            if let Some(v) = &t.quota_remaining {
                slot.quota_remaining = quant(v, Ty::Percent, "tenant quota_remaining")?;
            }
            if let Some(v) = t.in_flight {
                slot.in_flight = v;
            }
            if let Some(v) = t.deadline_misses {
                slot.deadline_misses = v as f64;
            }
        }
        if let Some(w) = &input.estimated_wait {
            s.estimated_wait = quant(w, Ty::Duration, "estimated_wait")?;
        }
        if let Some(e) = &input.error_rate {
            s.error_rate = quant(e, Ty::Percent, "error_rate")?;
        }
        if let Some(t) = &input.time {
            s.time_of_day = quant(&Quant::Text(t.clone()), Ty::TimeOfDay, "time")? as u16;
        }
        if let Some(d) = &input.weekday {
            s.weekday = units::weekday(d).ok_or_else(|| {
                SignalError(format!("weekday: `{d}` is not a weekday (mon … sun)"))
            })?;
        }
        Ok(s)
    }

    pub fn pool_utilization(&self, p: PoolId) -> f64 {
        self.pools.get(p as usize).map_or(0.0, |x| x.utilization)
    }
    pub fn pool_queue_depth(&self, p: PoolId) -> f64 {
        self.pools.get(p as usize).map_or(0.0, |x| x.queue_depth)
    }
    pub fn tier_wait_p95(&self, t: TierId) -> f64 {
        self.tiers.get(t as usize).map_or(0.0, |x| x.wait_p95)
    }
    pub fn metric_tier(&self, t: TierId, f: impl Fn(&TierMetrics) -> f64) -> f64 {
        self.tiers.get(t as usize).map_or(0.0, f)
    }
    pub fn quota_remaining(&self, t: Option<TenantId>) -> f64 {
        t.and_then(|t| self.tenants.get(t as usize))
            .map_or(100.0, |x| x.quota_remaining)
    }
    pub fn in_flight(&self, t: TenantId) -> u64 {
        self.tenants.get(t as usize).map_or(0, |x| x.in_flight)
    }
    pub fn deadline_misses(&self, t: TenantId) -> f64 {
        self.tenants
            .get(t as usize)
            .map_or(0.0, |x| x.deadline_misses)
    }
    /// Saturated pools divert to the fallback chain.
    pub fn saturated(&self, p: PoolId) -> bool {
        self.pool_utilization(p) >= 100.0
    }

    pub(crate) fn name_of(&self, ty: Ty, id: u32) -> String {
        let table = self.names.as_deref();
        let list = table.map(|t| match ty {
            Ty::Tenant => &t.tenants,
            Ty::Tier => &t.tiers,
            Ty::Model => &t.models,
            _ => &t.pools,
        });
        list.and_then(|l| l.get(id as usize))
            .cloned()
            .unwrap_or_else(|| format!("#{id}"))
    }
}
