//! The live signals a policy may read about pools, tiers and tenants: one
//! list, from which the compiler resolves field names, the scheduler knows
//! what to measure, and README's signal table is generated (a test keeps
//! them equal), so a name and what it measures cannot drift apart.
//!
//! Windowed signals are measured by the scheduler over a sliding window the
//! policy sets with `signal_window` on the tier, pool or tenant (default
//! [`DEFAULT_WINDOW_MS`]); instant ones are read at the moment of the
//! decision. The gateway and the replay run the same scheduler, so both
//! read the same values.

use crate::units::Ty;

/// The sliding window of windowed signals when a policy sets none: 5m.
pub const DEFAULT_WINDOW_MS: f64 = 300_000.0;

/// A field of `pool(P).…`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolField {
    Utilization,
    KvOccupancy,
    Queued,
    Running,
}

/// A field of `tier(T).…`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierField {
    TtftP50,
    TtftP95,
    TtftP99,
    E2eP50,
    E2eP95,
    E2eP99,
    WaitP50,
    WaitP95,
    WaitP99,
    OldestWait,
    Queued,
    Requests,
    SloAttainment,
    ErrorRate,
    FallbackRate,
    DeadlineMisses,
    BudgetRemaining,
}

/// A field of `tenant(X).…`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TenantField {
    DeadlineMisses,
    InFlight,
    Requests,
    BudgetRemaining,
}

/// How a signal is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Over the entity's `signal_window`.
    Windowed,
    /// At the moment of the decision.
    Instant,
}

/// One row of the signal list.
#[derive(Debug, Clone, Copy)]
pub struct Doc {
    /// As written, with `P`, `T` or `X` for the name.
    pub spelling: &'static str,
    pub field: &'static str,
    pub ty: Ty,
    pub kind: Kind,
    /// What it measures, exactly.
    pub measures: &'static str,
}

const fn doc(
    spelling: &'static str,
    field: &'static str,
    ty: Ty,
    kind: Kind,
    measures: &'static str,
) -> Doc {
    Doc {
        spelling,
        field,
        ty,
        kind,
        measures,
    }
}

use Kind::{Instant, Windowed};

impl PoolField {
    pub const ALL: [PoolField; 4] = [
        PoolField::Utilization,
        PoolField::KvOccupancy,
        PoolField::Queued,
        PoolField::Running,
    ];

    pub fn doc(self) -> Doc {
        match self {
            PoolField::Utilization => doc("pool(P).utilization", "utilization", Ty::Percent, Windowed,
                "work done over capacity: prefill and decode tokens the pool's replicas processed in the window, each counted as the time it takes at the replica's saturated throughput (the roofline's), over the window times the replicas in service; 100% is a pool working flat out (an HTTP upstream's steps are not seen: each request it finishes counts its prompt and output)"),
            PoolField::KvOccupancy => doc("pool(P).kv_occupancy", "kv_occupancy", Ty::Percent, Instant,
                "KV-cache blocks held now by running sequences (a shared prefix counted once; cached prefixes no sequence uses are evictable and not counted) over the pool's KV capacity; for engine-aware HTTP upstreams (`engine` in kiln.toml), the KV-cache usage their engines report, averaged over those that publish one"),
            PoolField::Queued => doc("pool(P).queued", "queued", Ty::Count, Instant,
                "requests waiting now for a replica of this pool: routed to it and not started (a route naming no pool counts in every pool hosting its variant), plus those waiting in engine-aware HTTP upstreams' own queues"),
            PoolField::Running => doc("pool(P).running", "running", Ty::Count, Instant,
                "sequences running now on the pool's replicas (on an engine-aware HTTP upstream, what its engine reports it runs, other clients' requests included)"),
        }
    }
}

impl TierField {
    pub const ALL: [TierField; 17] = [
        TierField::TtftP50,
        TierField::TtftP95,
        TierField::TtftP99,
        TierField::E2eP50,
        TierField::E2eP95,
        TierField::E2eP99,
        TierField::WaitP50,
        TierField::WaitP95,
        TierField::WaitP99,
        TierField::OldestWait,
        TierField::Queued,
        TierField::Requests,
        TierField::SloAttainment,
        TierField::ErrorRate,
        TierField::FallbackRate,
        TierField::DeadlineMisses,
        TierField::BudgetRemaining,
    ];

    pub fn doc(self) -> Doc {
        use TierField as F;
        match self {
            F::TtftP50 => doc("tier(T).ttft_p50", "ttft_p50", Ty::Duration, Windowed, "median time to first token of the tier's requests whose first token came in the window (0 with none)"),
            F::TtftP95 => doc("tier(T).ttft_p95", "ttft_p95", Ty::Duration, Windowed, "95th percentile of the same"),
            F::TtftP99 => doc("tier(T).ttft_p99", "ttft_p99", Ty::Duration, Windowed, "99th percentile of the same"),
            F::E2eP50 => doc("tier(T).e2e_p50", "e2e_p50", Ty::Duration, Windowed, "median arrival-to-last-token time of the tier's requests that finished in the window (0 with none)"),
            F::E2eP95 => doc("tier(T).e2e_p95", "e2e_p95", Ty::Duration, Windowed, "95th percentile of the same"),
            F::E2eP99 => doc("tier(T).e2e_p99", "e2e_p99", Ty::Duration, Windowed, "99th percentile of the same"),
            F::WaitP50 => doc("tier(T).wait_p50", "wait_p50", Ty::Duration, Windowed, "median queue wait (arrival to first start on a replica) of the tier's requests that started in the window (0 with none)"),
            F::WaitP95 => doc("tier(T).wait_p95", "wait_p95", Ty::Duration, Windowed, "95th percentile of the same"),
            F::WaitP99 => doc("tier(T).wait_p99", "wait_p99", Ty::Duration, Windowed, "99th percentile of the same"),
            F::OldestWait => doc("tier(T).oldest_wait", "oldest_wait", Ty::Duration, Instant, "how long the tier's oldest request queued now has waited (0 when none waits)"),
            F::Queued => doc("tier(T).queued", "queued", Ty::Count, Instant, "the tier's requests waiting now in queues"),
            F::Requests => doc("tier(T).requests", "requests", Ty::Count, Windowed, "the tier's requests that ended (finished or refused) in the window: how many samples the rates rest on"),
            F::SloAttainment => doc("tier(T).slo_attainment", "slo_attainment", Ty::Percent, Windowed, "of the tier's requests that ended in the window, the share that met its SLO (TTFT, end-to-end target and completion window); refusals count as misses; 100% with none"),
            F::ErrorRate => doc("tier(T).error_rate", "error_rate", Ty::Percent, Windowed, "of the tier's requests that ended in the window, the share answered with a 5xx (no capacity, queue timeout, a policy's 503)"),
            F::FallbackRate => doc("tier(T).fallback_rate", "fallback_rate", Ty::Percent, Windowed, "of the tier's requests decided in the window, the share that took a fallback step"),
            F::DeadlineMisses => doc("tier(T).deadline_misses", "deadline_misses", Ty::Count, Windowed, "the tier's requests that finished after their completion window (a batch item's own, else the tier's), or were refused because they could not meet it, in the window"),
            F::BudgetRemaining => doc("tier(T).budget_remaining", "budget_remaining", Ty::Percent, Instant, "the share left of the tier's money `budget` for the current day or month of the policy's calendar, its GPU time priced by the pool's `price` or the tenant's `cost` (100% without a budget)"),
        }
    }
}

impl TenantField {
    pub const ALL: [TenantField; 4] = [
        TenantField::DeadlineMisses,
        TenantField::InFlight,
        TenantField::Requests,
        TenantField::BudgetRemaining,
    ];

    pub fn doc(self) -> Doc {
        match self {
            TenantField::DeadlineMisses => doc("tenant(X).deadline_misses", "deadline_misses", Ty::Count, Windowed, "the tenant's requests that finished after their completion window (a batch item's own, else their tier's), or were refused because they could not meet it, in the tenant's window"),
            TenantField::InFlight => doc("tenant(X).in_flight", "in_flight", Ty::Count, Instant, "the tenant's requests admitted and not yet finished (queued, delayed or running)"),
            TenantField::Requests => doc("tenant(X).requests", "requests", Ty::Count, Windowed, "the tenant's requests that ended in the window"),
            TenantField::BudgetRemaining => doc("tenant(X).budget_remaining", "budget_remaining", Ty::Percent, Instant, "the share left of the tenant's money `budget` for the current day or month of the policy's calendar (100% without a budget)"),
        }
    }
}

/// The signals that read neither a pool, a tier nor a tenant by name.
pub const OTHERS: &[Doc] = &[
    doc("error_rate", "error_rate", Ty::Percent, Windowed, "of all requests that ended in the last 5m, the share answered with a 5xx"),
    doc("estimated_wait", "estimated_wait", Ty::Duration, Instant, "this request's predicted time to first token on the route chosen for it (admit only: it depends on the route)"),
    doc("quota.remaining", "remaining", Ty::Percent, Instant, "the share left of the request's tenant's tightest quota (100% without one)"),
    doc("budget.remaining", "remaining", Ty::Percent, Instant, "the share left of the tighter of the request's tenant's and tier's money budgets (the tier's once classify chose it; 100% without either)"),
    doc("time", "time", Ty::TimeOfDay, Instant, "the time of day in the policy's time zone (`policy { timezone \"Europe/Berlin\" }`, UTC without one) (`09:00..18:00`, may wrap midnight)"),
    doc("weekday", "weekday", Ty::Weekday, Instant, "the weekday in the policy's time zone (`mon..fri`)"),
    doc("date", "date", Ty::Date, Instant, "the date in the policy's time zone (`date >= 2026-12-24`, `date in 2026-12-28..2027-01-02`: both ends included)"),
    doc("day", "day", Ty::DayOfMonth, Instant, "the day of the month in the policy's time zone, 1 to 31 (`day in 28..2`: both ends included, may wrap the month's end)"),
];

/// Old spellings a policy may still hold, and what to write instead.
pub fn renamed(base: &str, field: &str) -> Option<&'static str> {
    match (base, field) {
        ("pool", "queue_depth") => Some(
            "`pool(P).queue_depth` counted the sequences *running* on the pool, not the ones queued; write `pool(P).running` for that, or `pool(P).queued` for requests waiting for it",
        ),
        _ => None,
    }
}

/// Spellings whose meaning changed (kiln:allow(signal-redefined) once
/// reviewed), and what changed.
pub fn redefined(base: &str, field: &str) -> Option<&'static str> {
    match (base, field) {
        ("pool", "utilization") => Some(
            "`pool(P).utilization` used to read KV-cache occupancy; it now reads work done over capacity in the pool's window. For the old meaning write `pool(P).kv_occupancy`",
        ),
        ("tier", "wait_p95") => Some(
            "`tier(T).wait_p95` used to read the oldest queued request's wait; it now reads the 95th percentile of queue waits in the tier's window. For the old meaning write `tier(T).oldest_wait`",
        ),
        _ => None,
    }
}

/// Every signal, in README order: request attributes are listed there by
/// hand; these are the measured ones.
pub fn all_docs() -> Vec<Doc> {
    let mut v: Vec<Doc> = PoolField::ALL.iter().map(|f| f.doc()).collect();
    v.extend(TierField::ALL.iter().map(|f| f.doc()));
    v.extend(TenantField::ALL.iter().map(|f| f.doc()));
    v.extend(OTHERS.iter().copied());
    v
}

/// README's table of measured signals, as the compiler knows them.
pub fn markdown_table() -> String {
    let mut out = String::from(
        "| signal | type | measured | what it measures |\n| --- | --- | --- | --- |\n",
    );
    for d in all_docs() {
        let kind = match d.kind {
            Windowed => "over the window",
            Instant => "now",
        };
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            d.spelling,
            d.ty.short(),
            kind,
            d.measures
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_has_a_distinct_spelling() {
        let docs = all_docs();
        let mut seen = std::collections::HashSet::new();
        for d in &docs {
            assert!(seen.insert(d.spelling), "{} twice", d.spelling);
            assert!(d.spelling.ends_with(d.field), "{}", d.spelling);
        }
    }

    #[test]
    fn old_spellings_say_what_to_write() {
        assert!(renamed("pool", "queue_depth").is_some_and(|m| m.contains("pool(P).running")));
        assert!(redefined("pool", "utilization").is_some_and(|m| m.contains("kv_occupancy")));
        assert!(redefined("tier", "wait_p95").is_some_and(|m| m.contains("oldest_wait")));
        assert!(renamed("pool", "running").is_none());
    }
}
