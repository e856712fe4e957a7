//! What a decision reads: the request (attributes the gateway extracted) and
//! the live signals (pool load, tier waits, quota state, clock). Both have a
//! JSON form for `kiln explain` and `kiln test`; signals are resolved against
//! a graph once into dense vectors so evaluation does no name lookups.

use super::signal::{PoolField, TenantField, TierField};
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

/// The header that marks a batch item (a request the Batches API
/// submitted); its value is the batch id. The `batch` signal reads it.
pub const BATCH_HEADER: &str = "x-kiln-batch";

/// The try of a batch item, set by the batch runner on each send after the
/// first (`2` for the first retry). It starts with [`BATCH_HEADER`], so a
/// client cannot send it: the gateway drops such headers from requests.
pub const BATCH_TRY_HEADER: &str = "x-kiln-batch-try";

/// Set (`true`) by the batch runner on the items of a batch whose
/// metadata says `kiln_preemptible: "true"`: the scheduler may preempt
/// them even where their tier is not preemptible. A client cannot send it
/// (it starts with [`BATCH_HEADER`]); the decision log keeps it, so a
/// replay preempts them too.
pub const BATCH_PREEMPTIBLE_HEADER: &str = "x-kiln-batch-preemptible";

/// The header a client marks its own retry with.
pub const RETRY_HEADER: &str = "x-kiln-retry";

/// The retry counter the OpenAI SDKs send (`0` on a first try).
pub const SDK_RETRY_HEADER: &str = "x-stainless-retry-count";

/// What a retry is, one rule for admission's retry budget, the
/// `kiln_retries_total` counter and `kiln report`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The client says so: [`RETRY_HEADER`] with any value but `0`/`false`,
    /// or a non-zero [`SDK_RETRY_HEADER`]. Draws on the tenant's
    /// `retry_budget`.
    Client,
    /// The batch runner sent an item again after a refusal or a failure
    /// ([`BATCH_TRY_HEADER`] above 1). Bounded by `[batch] max_attempts`
    /// and the batch's window, not by the tenant's retry budget.
    BatchItem,
}

impl Retry {
    pub fn as_str(self) -> &'static str {
        match self {
            Retry::Client => "client",
            Retry::BatchItem => "batch_item",
        }
    }

    /// Whether headers (names in any case) mark a retry, and which. One
    /// pass, no allocation: admission asks this of every request.
    pub fn of(headers: &BTreeMap<String, String>) -> Option<Retry> {
        let mut batch_item = false;
        for (k, v) in headers {
            let v = v.trim();
            let client = if k.eq_ignore_ascii_case(RETRY_HEADER) {
                v != "0" && !v.eq_ignore_ascii_case("false")
            } else if k.eq_ignore_ascii_case(SDK_RETRY_HEADER) {
                !v.is_empty() && v != "0"
            } else {
                if k.eq_ignore_ascii_case(BATCH_TRY_HEADER) {
                    batch_item |= v.parse::<u32>().is_ok_and(|n| n > 1);
                }
                false
            };
            if client {
                return Some(Retry::Client);
            }
        }
        batch_item.then_some(Retry::BatchItem)
    }
}

impl Request {
    /// Its batch marked its items preemptible ([`BATCH_PREEMPTIBLE_HEADER`]).
    pub fn preemptible_item(&self) -> bool {
        self.headers
            .get(BATCH_PREEMPTIBLE_HEADER)
            .is_some_and(|v| v == "true")
    }

    /// Whether this request is a retry, and which kind ([`Retry::of`]).
    pub fn retry(&self) -> Option<Retry> {
        Retry::of(&self.headers)
    }

    /// The batch this request is an item of (its non-empty
    /// [`BATCH_HEADER`]), if it came through the Batches API.
    pub fn batch(&self) -> Option<&str> {
        self.header(BATCH_HEADER).filter(|b| !b.is_empty())
    }

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

/// A pool's signals in a signal file (`kiln explain --signals`, tests).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolInput {
    #[serde(default)]
    pub utilization: Option<Quant>,
    #[serde(default)]
    pub kv_occupancy: Option<Quant>,
    #[serde(default)]
    pub queued: Option<u64>,
    #[serde(default)]
    pub running: Option<u64>,
    /// Renamed: refused with a message saying what to write.
    #[serde(default, skip_serializing)]
    pub queue_depth: Option<serde_json::Value>,
}

/// A tier's signals in a signal file: any field of [`TierField`], by the
/// name policies use (`"ttft_p95": "800ms"`).
pub type TierInput = BTreeMap<String, Quant>;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantInput {
    /// Share of the tightest quota left, `"40%"`.
    #[serde(default)]
    pub quota_remaining: Option<Quant>,
    /// Share of the tenant's money budget left, `"30%"`.
    #[serde(default)]
    pub budget_remaining: Option<Quant>,
    #[serde(default)]
    pub in_flight: Option<u64>,
    #[serde(default)]
    pub deadline_misses: Option<u64>,
    #[serde(default)]
    pub requests: Option<u64>,
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
    /// `"YYYY-MM-DD"`: also the day of the month and, unless `weekday`
    /// is given, the weekday.
    #[serde(default)]
    pub date: Option<String>,
    #[serde(default)]
    pub error_rate: Option<Quant>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolSignal {
    /// %, work done over capacity in the window.
    pub utilization: f64,
    /// %, KV blocks held now.
    pub kv_occupancy: f64,
    pub queued: f64,
    pub running: f64,
}

impl PoolSignal {
    pub fn get(&self, f: PoolField) -> f64 {
        match f {
            PoolField::Utilization => self.utilization,
            PoolField::KvOccupancy => self.kv_occupancy,
            PoolField::Queued => self.queued,
            PoolField::Running => self.running,
        }
    }
}

/// One tier's measured signals, indexed by [`TierField`] (durations in ms,
/// rates in %).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierMetrics {
    v: [f64; TierField::ALL.len()],
}

impl Default for TierMetrics {
    /// A tier with nothing in its window: no latency, no misses, its SLO met.
    fn default() -> Self {
        let mut m = TierMetrics {
            v: [0.0; TierField::ALL.len()],
        };
        m.set(TierField::SloAttainment, 100.0);
        m.set(TierField::BudgetRemaining, 100.0);
        m
    }
}

impl TierMetrics {
    pub fn get(&self, f: TierField) -> f64 {
        self.v[f as usize]
    }
    pub fn set(&mut self, f: TierField, x: f64) {
        self.v[f as usize] = x;
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantSignal {
    pub quota_remaining: f64,
    /// %, of the tenant's money budget this period.
    pub budget_remaining: f64,
    pub in_flight: u64,
    pub deadline_misses: f64,
    pub requests: f64,
}

impl Default for TenantSignal {
    fn default() -> Self {
        TenantSignal {
            quota_remaining: 100.0,
            budget_remaining: 100.0,
            in_flight: 0,
            deadline_misses: 0.0,
            requests: 0.0,
        }
    }
}

impl TenantSignal {
    pub fn get(&self, f: TenantField) -> f64 {
        match f {
            TenantField::DeadlineMisses => self.deadline_misses,
            TenantField::InFlight => self.in_flight as f64,
            TenantField::Requests => self.requests,
            TenantField::BudgetRemaining => self.budget_remaining,
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
    /// Days since 1970-01-01, in the policy's zone.
    pub date: i32,
    /// Day of the month, 1–31.
    pub day: u8,
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

/// The date [`Signals::idle`] reads: Monday 2024-01-01.
pub const IDLE_DATE: i32 = 19_723;

impl Signals {
    /// Idle fleet, Monday 2024-01-01 12:00.
    pub fn idle(g: &DecisionGraph) -> Signals {
        Signals {
            pools: vec![PoolSignal::default(); g.pools.len()],
            tiers: vec![TierMetrics::default(); g.tiers.len()],
            tenants: vec![TenantSignal::default(); g.tenants.len()],
            estimated_wait: 0.0,
            time_of_day: 12 * 60,
            weekday: 0,
            date: IDLE_DATE,
            day: 1,
            error_rate: 0.0,
            names: Some(std::sync::Arc::new(NameTable {
                tenants: g.tenants.iter().map(|t| t.name.clone()).collect(),
                tiers: g.tiers.iter().map(|t| t.name.clone()).collect(),
                models: g.models.iter().map(|t| t.name.clone()).collect(),
                pools: g.pools.iter().map(|t| t.name.clone()).collect(),
            })),
        }
    }

    /// The JSON form of these signals, by name (the inverse of
    /// [`Signals::resolve`]: `GET /admin/signals` answers with it, and
    /// `kiln explain --signals` reads it back). Durations in ms, shares in
    /// %, counts as numbers. `estimated_wait` is per request and left out.
    pub fn to_input(&self, g: &DecisionGraph) -> SignalsInput {
        let mut out = SignalsInput::default();
        for (p, x) in g.pools.iter().zip(&self.pools) {
            out.pools.insert(
                p.name.clone(),
                PoolInput {
                    utilization: Some(Quant::Num(round3(x.utilization))),
                    kv_occupancy: Some(Quant::Num(round3(x.kv_occupancy))),
                    queued: Some(x.queued.max(0.0) as u64),
                    running: Some(x.running.max(0.0) as u64),
                    queue_depth: None,
                },
            );
        }
        for (t, m) in g.tiers.iter().zip(&self.tiers) {
            let fields = TierField::ALL
                .iter()
                .map(|f| (f.doc().field.to_string(), Quant::Num(round3(m.get(*f)))))
                .collect();
            out.tiers.insert(t.name.clone(), fields);
        }
        for (t, x) in g.tenants.iter().zip(&self.tenants) {
            out.tenants.insert(
                t.name.clone(),
                TenantInput {
                    quota_remaining: Some(Quant::Num(round3(x.quota_remaining))),
                    budget_remaining: Some(Quant::Num(round3(x.budget_remaining))),
                    in_flight: Some(x.in_flight),
                    deadline_misses: Some(x.deadline_misses.max(0.0) as u64),
                    requests: Some(x.requests.max(0.0) as u64),
                },
            );
        }
        out.error_rate = Some(Quant::Num(round3(self.error_rate)));
        out.time = Some(format!(
            "{:02}:{:02}",
            self.time_of_day / 60 % 24,
            self.time_of_day % 60
        ));
        out.weekday = units::WEEKDAYS
            .get(self.weekday as usize)
            .map(|d| d.to_string());
        out.date = Some(units::calendar::show_date(self.date));
        out
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
            if p.queue_depth.is_some() {
                return Err(SignalError(format!(
                    "pool `{name}`: `queue_depth` was renamed: it counted running sequences, so write `running` for that, or `queued` for requests waiting"
                )));
            }
            if let Some(u) = &p.utilization {
                slot.utilization = quant(u, Ty::Percent, "pool utilization")?;
            }
            if let Some(u) = &p.kv_occupancy {
                slot.kv_occupancy = quant(u, Ty::Percent, "pool kv_occupancy")?;
            }
            if let Some(q) = p.queued {
                slot.queued = q as f64;
            }
            if let Some(q) = p.running {
                slot.running = q as f64;
            }
        }
        for (name, t) in &input.tiers {
            let id = g
                .tier_id(name)
                .ok_or_else(|| SignalError(format!("signals name unknown tier `{name}`")))?;
            let slot = &mut s.tiers[id as usize];
            for (field, v) in t {
                let Some(f) = TierField::ALL.iter().find(|f| f.doc().field == field) else {
                    let known: Vec<&str> = TierField::ALL.iter().map(|f| f.doc().field).collect();
                    return Err(SignalError(format!(
                        "tier `{name}`: unknown signal `{field}` (tier signals are {})",
                        known.join(", ")
                    )));
                };
                let d = f.doc();
                let x = match (d.ty, v) {
                    (Ty::Count, Quant::Num(n)) => *n,
                    (Ty::Count, Quant::Text(_)) => {
                        return Err(SignalError(format!(
                            "tier `{name}` {field}: write a number"
                        )))
                    }
                    (ty, v) => quant(v, ty, &format!("tier `{name}` {field}"))?,
                };
                slot.set(*f, x);
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
            if let Some(v) = &t.budget_remaining {
                slot.budget_remaining = quant(v, Ty::Percent, "tenant budget_remaining")?;
            }
            if let Some(v) = t.in_flight {
                slot.in_flight = v;
            }
            if let Some(v) = t.deadline_misses {
                slot.deadline_misses = v as f64;
            }
            if let Some(v) = t.requests {
                slot.requests = v as f64;
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
        if let Some(d) = &input.date {
            let days = units::calendar::parse_date(d)
                .ok_or_else(|| SignalError(format!("date: `{d}` is not a date (YYYY-MM-DD)")))?;
            s.date = days;
            s.day = units::calendar::day_of_month(days);
            // 1970-01-01 was a Thursday (3 when Monday is 0).
            s.weekday = (days + 3).rem_euclid(7) as u8;
        }
        if let Some(d) = &input.weekday {
            s.weekday = units::weekday(d).ok_or_else(|| {
                SignalError(format!("weekday: `{d}` is not a weekday (mon … sun)"))
            })?;
        }
        Ok(s)
    }

    pub fn pool(&self, p: PoolId, f: PoolField) -> f64 {
        self.pools.get(p as usize).map_or(0.0, |x| x.get(f))
    }
    pub fn tier(&self, t: TierId, f: TierField) -> f64 {
        self.tiers
            .get(t as usize)
            .map_or_else(|| TierMetrics::default().get(f), |x| x.get(f))
    }
    pub fn tenant(&self, t: TenantId, f: TenantField) -> f64 {
        self.tenants
            .get(t as usize)
            .map_or_else(|| TenantSignal::default().get(f), |x| x.get(f))
    }
    pub fn quota_remaining(&self, t: Option<TenantId>) -> f64 {
        t.and_then(|t| self.tenants.get(t as usize))
            .map_or(100.0, |x| x.quota_remaining)
    }
    /// The tighter of `t`'s and `tier`'s money budgets, % left.
    pub fn budget_remaining(&self, t: Option<TenantId>, tier: Option<TierId>) -> f64 {
        let tenant = t
            .and_then(|t| self.tenants.get(t as usize))
            .map_or(100.0, |x| x.budget_remaining);
        let tier = tier.map_or(100.0, |t| self.tier(t, TierField::BudgetRemaining));
        tenant.min(tier)
    }
    pub fn in_flight(&self, t: TenantId) -> u64 {
        self.tenants.get(t as usize).map_or(0, |x| x.in_flight)
    }
    /// Saturated pools divert to the fallback chain: working flat out over
    /// the window, or every KV block held.
    pub fn saturated(&self, p: PoolId) -> bool {
        self.pool(p, PoolField::Utilization) >= 100.0
            || self.pool(p, PoolField::KvOccupancy) >= 100.0
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

fn round3(x: f64) -> f64 {
    if x.is_finite() {
        (x * 1000.0).round() / 1000.0
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile_str;

    #[test]
    fn the_json_form_reads_back_as_the_same_signals() {
        let c = compile_str(
            "t.kiln",
            r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { params 8B kv_per_token 128KB variant fp16 { memory 18GB pools [p] } }
tier t { priority 1 slo { ttft 1s } }
tenant x { owner "o" tiers [t] }
classify { default => tier t }
route t m { default => fp16 }
"#,
        );
        let g = c.graph.expect("compiles");
        let mut s = Signals::idle(&g);
        s.pools[0].utilization = 42.5;
        s.pools[0].queued = 7.0;
        s.tiers[0].set(TierField::TtftP95, 812.0);
        s.tiers[0].set(TierField::SloAttainment, 93.25);
        s.tenants[0].deadline_misses = 3.0;
        s.error_rate = 1.5;
        s.time_of_day = 9 * 60 + 5;
        s.weekday = 2;
        let json = serde_json::to_string(&s.to_input(&g)).expect("serializes");
        let back: SignalsInput = serde_json::from_str(&json).expect("parses");
        let r = Signals::resolve(&g, &back).expect("resolves");
        assert_eq!(r.pools, s.pools);
        assert_eq!(r.tiers, s.tiers);
        assert_eq!(r.tenants, s.tenants);
        assert_eq!((r.error_rate, r.time_of_day, r.weekday), (1.5, 545, 2));
    }
}
