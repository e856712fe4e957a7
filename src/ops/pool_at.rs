//! Why a pool was idle or full at a moment, from the gateway's decision
//! log (`kiln explain --log LOG --pool P --at T`): what was running on it
//! and waiting for it then, what arrived for it just before, and what the
//! fleet refused meanwhile and why.
//!
//! A record names its pool in its route (`llama-70b.fp16 on h100`); its
//! start is its arrival plus its queue wait and its end its arrival plus
//! its end-to-end latency, all as the gateway recorded them.

use super::baseline::{mix as list, tenant_of};
use crate::traffic::Record;
use serde::Serialize;
use std::collections::BTreeMap;

/// What the log says of one pool at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolAt {
    pub pool: String,
    /// Milliseconds from the log's first arrival.
    pub at_ms: f64,
    pub window_ms: f64,
    /// Requests running on the pool at that moment, per tenant.
    pub running: BTreeMap<String, u64>,
    /// Requests that had arrived for the pool and not yet started, per
    /// tenant.
    pub queued: BTreeMap<String, u64>,
    /// Requests routed to the pool that arrived in the window before it.
    pub arrived_for_pool: u64,
    /// Requests anywhere in the fleet refused in the window, by reason.
    pub refused_in_window: BTreeMap<String, u64>,
    /// When the pool last had work before the moment, ms from the first
    /// arrival (a request's end), if ever.
    pub last_busy_ms: Option<f64>,
    /// The verdict, in words.
    pub verdict: String,
}

/// The pool a record's route names (`… on POOL`).
pub fn pool_of(r: &Record) -> Option<&str> {
    r.decision
        .as_ref()
        .and_then(|d| d.route.as_deref())
        .and_then(|route| route.rsplit_once(" on "))
        .map(|(_, pool)| pool.trim())
}

fn refused(r: &Record) -> Option<&str> {
    let d = r.decision.as_ref()?;
    if d.status.is_some_and(|s| (200..300).contains(&s)) {
        return None;
    }
    d.reason.as_deref()
}

/// The pool at `at_ms` (from the first arrival, the clock of `records`
/// after [`crate::traffic::rebase_wall_clock`]), looking `window_ms` back
/// for arrivals and refusals.
pub fn explain(records: &[Record], pool: &str, at_ms: f64, window_ms: f64) -> PoolAt {
    let mut running = BTreeMap::new();
    let mut queued = BTreeMap::new();
    let mut arrived_for_pool = 0;
    let mut refused_in_window = BTreeMap::new();
    let mut last_busy_ms: Option<f64> = None;
    let from = at_ms - window_ms;
    for r in records {
        let in_window = r.at_ms > from && r.at_ms <= at_ms;
        if in_window {
            if let Some(reason) = refused(r) {
                *refused_in_window.entry(reason.to_string()).or_insert(0u64) += 1;
            }
        }
        if pool_of(r) != Some(pool) || r.at_ms > at_ms {
            continue;
        }
        arrived_for_pool += u64::from(in_window);
        let start = r.at_ms + r.queue_ms.unwrap_or(0.0).max(0.0);
        let end = r.e2e_ms.map(|e| r.at_ms + e.max(0.0));
        // Waiting then (even if it was refused later, at its queue's end);
        // running then; or done by then. A record without an end never
        // ran to an answer (refused or left).
        if start > at_ms {
            *queued.entry(tenant_of(r)).or_insert(0u64) += 1;
        } else if let Some(e) = end {
            if e > at_ms {
                *running.entry(tenant_of(r)).or_insert(0u64) += 1;
            } else {
                last_busy_ms = Some(last_busy_ms.map_or(e, |l: f64| l.max(e)));
            }
        }
    }
    let verdict = if running.is_empty() && queued.is_empty() {
        let mut why = format!("`{pool}` was idle: nothing ran on it or waited for it");
        if arrived_for_pool == 0 {
            why.push_str(&format!(
                "; no request routed to it arrived in the {:.0} s before",
                window_ms / 1000.0
            ));
        }
        match last_busy_ms {
            Some(l) => why.push_str(&format!(
                "; its last request ended {:.1} s earlier",
                (at_ms - l) / 1000.0
            )),
            None => why.push_str("; no request had run on it yet"),
        }
        if !refused_in_window.is_empty() {
            why.push_str(&format!(
                "; meanwhile the fleet refused {} (requests refused before routing name no pool: check whether the policy's routes or admission sent work elsewhere)",
                list(&refused_in_window)
            ));
        }
        why
    } else {
        let mut parts = Vec::new();
        if !running.is_empty() {
            parts.push(format!(
                "{} running ({})",
                running.values().sum::<u64>(),
                list(&running)
            ));
        }
        if !queued.is_empty() {
            parts.push(format!(
                "{} waiting for it ({})",
                queued.values().sum::<u64>(),
                list(&queued)
            ));
        }
        let mut why = format!("`{pool}` was busy: {}", parts.join(", "));
        if !refused_in_window.is_empty() {
            why.push_str(&format!(
                "; the fleet refused {} in the {:.0} s before",
                list(&refused_in_window),
                window_ms / 1000.0
            ));
        }
        why
    };
    PoolAt {
        pool: pool.to_string(),
        at_ms,
        window_ms,
        running,
        queued,
        arrived_for_pool,
        refused_in_window,
        last_busy_ms,
        verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::Decision;

    fn rec(at: f64, tenant: &str, pool: &str, queue: f64, e2e: Option<f64>) -> Record {
        Record {
            at_ms: at,
            model: "m".into(),
            decision: Some(Decision {
                tenant: Some(tenant.into()),
                route: Some(format!("m.fp16 on {pool}")),
                status: Some(if e2e.is_some() { 200 } else { 429 }),
                reason: e2e.is_none().then(|| "overload".to_string()),
                ..Decision::default()
            }),
            queue_ms: Some(queue),
            e2e_ms: e2e,
            ..Record::default()
        }
    }

    #[test]
    fn running_queued_and_idle_are_told_apart() {
        let log = vec![
            rec(0.0, "a", "h100", 0.0, Some(1_000.0)),
            rec(500.0, "b", "h100", 2_000.0, Some(3_000.0)),
            rec(600.0, "c", "l4", 0.0, Some(100.0)),
            rec(700.0, "d", "h100", 0.0, None),
        ];
        let p = explain(&log, "h100", 800.0, 60_000.0);
        assert_eq!(p.running, BTreeMap::from([("a".to_string(), 1)]));
        assert_eq!(p.queued, BTreeMap::from([("b".to_string(), 1)]));
        assert_eq!(p.refused_in_window.get("overload"), Some(&1));
        assert!(
            p.verdict
                .starts_with("`h100` was busy: 1 running (a 1), 1 waiting for it (b 1)"),
            "{}",
            p.verdict
        );
        // At 4 s both have ended: idle, last busy at 3.5 s.
        let p = explain(&log, "h100", 4_000.0, 60_000.0);
        assert!(p.running.is_empty() && p.queued.is_empty());
        assert_eq!(p.last_busy_ms, Some(3_500.0));
        assert!(
            p.verdict.contains("its last request ended 0.5 s earlier"),
            "{}",
            p.verdict
        );
        // A pool nothing was routed to.
        let p = explain(&log, "a100", 800.0, 60_000.0);
        assert!(
            p.verdict.contains("no request routed to it arrived"),
            "{}",
            p.verdict
        );
        assert!(
            p.verdict.contains("no request had run on it yet"),
            "{}",
            p.verdict
        );
    }
}
