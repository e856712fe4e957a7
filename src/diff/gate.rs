//! CI gates for `kiln diff --fail-if`: conditions on the change that fail
//! the run (exit 1), and the report says which tripped.
//!
//! A gate is `SCOPE METRIC LIMIT`:
//! - SCOPE: `tier:NAME`, `tenant:NAME`, or `all` (every tier); for
//!   `deadline_misses`, `batch:ID` or `batches` (every batch in the traffic);
//! - METRIC: `ttft_p50|ttft_p95|ttft_p99|e2e_p50|e2e_p95|e2e_p99` (trip when
//!   the new value exceeds the old by more than LIMIT), `slo_attainment` and
//!   `goodput` (trip when the new value falls by more than LIMIT),
//!   `rejected`, `preemptions`, `cost`, `gpu_seconds` (trip when they rise by
//!   more than LIMIT), `deadline_misses` (a batch's items finished after its
//!   window; trip when they rise by more than LIMIT), or `changed_decisions`
//!   (trip when more requests than LIMIT are decided differently; scope
//!   `all`);
//! - LIMIT: `+10%` (relative) or `+0`, `+250` (absolute, in the metric's
//!   unit: ms, requests, points of attainment ×100…).
//!
//! A `cost` gate also trips while less than [`MIN_PRICED_SHARE`] of a
//! group's GPU time is priced (a pool's `price` or a tenant's `cost`):
//! unpriced time counts 0, so `0 → 0` would pass a change that grows it.
//!
//! Examples: `tier:interactive ttft_p95 +10%`, `tenant:analytics rejected +0`,
//! `batches deadline_misses +0`.

use super::traffic::{group_metrics, DecisionDiff, Impact};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq)]
pub struct Gate {
    pub text: String,
    scope: Scope,
    metric: String,
    limit: Limit,
}

#[derive(Debug, Clone, PartialEq)]
enum Scope {
    Tier(String),
    Tenant(String),
    All,
    Batch(String),
    Batches,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Limit {
    Percent(f64),
    Absolute(f64),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateResult {
    pub gate: String,
    pub tripped: bool,
    /// What was measured, in words.
    pub detail: String,
}

const RISE: &[&str] = &[
    "ttft_p50",
    "ttft_p95",
    "ttft_p99",
    "e2e_p50",
    "e2e_p95",
    "e2e_p99",
    "rejected",
    "preemptions",
    "cost",
    "gpu_seconds",
    "deadline_misses",
];
const FALL: &[&str] = &["slo_attainment", "goodput"];

/// Parses a gate; the error says what is wrong and what is accepted.
pub fn parse(text: &str) -> Result<Gate, String> {
    let parts: Vec<&str> = text.split_whitespace().collect();
    let [scope, metric, limit] = parts.as_slice() else {
        return Err(format!(
            "gate `{text}`: write `SCOPE METRIC LIMIT`, e.g. `tier:interactive ttft_p95 +10%`"
        ));
    };
    let scope = match scope.split_once(':') {
        Some(("tier", n)) if !n.is_empty() => Scope::Tier(n.to_string()),
        Some(("tenant", n)) if !n.is_empty() => Scope::Tenant(n.to_string()),
        Some(("batch", n)) if !n.is_empty() => Scope::Batch(n.to_string()),
        None if *scope == "all" => Scope::All,
        None if *scope == "batches" => Scope::Batches,
        _ => {
            return Err(format!(
                "gate `{text}`: scope is `tier:NAME`, `tenant:NAME`, `all`, `batch:ID` or `batches`"
            ))
        }
    };
    let metric = metric.to_string();
    let per_batch = matches!(scope, Scope::Batch(_) | Scope::Batches);
    if per_batch != (metric == "deadline_misses") {
        return Err(format!(
            "gate `{text}`: `deadline_misses` is measured per batch, and batches only measure it: write `batch:ID deadline_misses +0` or `batches deadline_misses +0`"
        ));
    }
    if !RISE.contains(&metric.as_str())
        && !FALL.contains(&metric.as_str())
        && metric != "changed_decisions"
    {
        return Err(format!(
            "gate `{text}`: unknown metric `{metric}`; use one of {}, {} or changed_decisions",
            RISE.join(", "),
            FALL.join(", ")
        ));
    }
    let l = limit.trim_start_matches('+');
    let limit = match l.strip_suffix('%') {
        Some(p) => Limit::Percent(
            p.parse()
                .map_err(|_| format!("gate `{text}`: `{limit}` is not a number"))?,
        ),
        None => Limit::Absolute(
            l.parse()
                .map_err(|_| format!("gate `{text}`: `{limit}` is not a number"))?,
        ),
    };
    // The limit is how much worse the metric may get, whichever way worse
    // is for it: a negative one would trip on no change at all (a gate
    // that always fails), an infinite one never.
    let (Limit::Percent(v) | Limit::Absolute(v)) = limit;
    if !(v.is_finite() && v >= 0.0) {
        let how = if FALL.contains(&metric.as_str()) {
            "fall"
        } else {
            "rise"
        };
        return Err(format!(
            "gate `{text}`: the limit is how much `{metric}` may worsen, a finite number from 0: for `{metric}` worse is to {how}, so write e.g. `+1` (or `+5%`), which trips when it {how}s by more"
        ));
    }
    Ok(Gate {
        text: text.to_string(),
        scope,
        metric,
        limit,
    })
}

fn exceeds(old: f64, new: f64, limit: Limit, rising_is_bad: bool) -> bool {
    let worse = if rising_is_bad { new - old } else { old - new };
    match limit {
        Limit::Absolute(a) => worse > a,
        Limit::Percent(p) => {
            if old == 0.0 {
                worse > 0.0
            } else {
                worse / old.abs() * 100.0 > p
            }
        }
    }
}

/// Evaluates a gate against the decision diff and the impact report.
pub fn evaluate(g: &Gate, decisions: Option<&DecisionDiff>, impact: Option<&Impact>) -> GateResult {
    let result = |tripped: bool, detail: String| GateResult {
        gate: g.text.clone(),
        tripped,
        detail,
    };
    if g.metric == "changed_decisions" {
        let Some(d) = decisions else {
            return result(false, "no traffic given: nothing to measure".into());
        };
        let tripped = exceeds(0.0, d.changed as f64, g.limit, true);
        return result(
            tripped,
            format!(
                "{} of {} requests decided differently",
                d.changed, d.requests
            ),
        );
    }
    let Some(i) = impact else {
        return result(false, "no traffic given: nothing to measure".into());
    };
    if let Scope::Batch(_) | Scope::Batches = &g.scope {
        let mut details = Vec::new();
        let mut tripped = false;
        for b in &i.batches {
            if matches!(&g.scope, Scope::Batch(id) if id != &b.name) {
                continue;
            }
            let Some(x) = b.metrics.iter().find(|x| x.metric == "deadline_misses") else {
                continue;
            };
            let t = exceeds(x.old, x.new, g.limit, true);
            tripped |= t;
            details.push(format!(
                "batch {}: deadline_misses {} → {}{}",
                b.name,
                x.old,
                x.new,
                if t { " (tripped)" } else { "" }
            ));
        }
        if details.is_empty() {
            details.push("no batch items in the traffic".into());
        }
        return result(tripped, details.join("; "));
    }
    let groups: Vec<(
        String,
        Option<&crate::replay::report::Group>,
        Option<&crate::replay::report::Group>,
    )> = match &g.scope {
        Scope::Tier(n) => vec![(
            format!("tier {n}"),
            i.old.tiers.iter().find(|x| &x.name == n),
            i.new.tiers.iter().find(|x| &x.name == n),
        )],
        Scope::Tenant(n) => vec![(
            format!("tenant {n}"),
            i.old.tenants.iter().find(|x| &x.name == n),
            i.new.tenants.iter().find(|x| &x.name == n),
        )],
        Scope::Batch(_) | Scope::Batches => Vec::new(),
        Scope::All => {
            let mut names: Vec<String> = i
                .old
                .tiers
                .iter()
                .chain(i.new.tiers.iter())
                .map(|x| x.name.clone())
                .collect();
            names.sort();
            names.dedup();
            names
                .into_iter()
                .map(|n| {
                    (
                        format!("tier {n}"),
                        i.old.tiers.iter().find(|x| x.name == n),
                        i.new.tiers.iter().find(|x| x.name == n),
                    )
                })
                .collect()
        }
    };
    let key = match g.metric.as_str() {
        "goodput" => "goodput_rps".to_string(),
        m if m.starts_with("ttft_") || m.starts_with("e2e_") => format!("{m}_ms"),
        m => m.to_string(),
    };
    let rising_is_bad = RISE.contains(&g.metric.as_str());
    let mut details = Vec::new();
    let mut tripped = false;
    for (label, o, n) in groups {
        if o.is_none() && n.is_none() {
            details.push(format!("{label}: no requests"));
            continue;
        }
        let m = group_metrics(o, n);
        let Some(x) = m.iter().find(|x| x.metric == key) else {
            continue;
        };
        // Attainment is compared in points (×100) so `+2` means two points.
        let (old, new) = if key == "slo_attainment" {
            (x.old * 100.0, x.new * 100.0)
        } else {
            (x.old, x.new)
        };
        let t = exceeds(old, new, g.limit, rising_is_bad);
        tripped |= t;
        details.push(format!(
            "{label}: {} {old} → {new}{}",
            g.metric,
            if t { " (tripped)" } else { "" }
        ));
        // Cost only compares what is priced: GPU time without a price
        // counts 0, so `0 → 0` says nothing while GPU time grows.
        if key == "cost" {
            for (side, grp) in [("old", o), ("new", n)] {
                let Some(share) = grp.and_then(priced_share) else {
                    continue;
                };
                if share < MIN_PRICED_SHARE {
                    tripped = true;
                    details.push(format!(
                        "{label}: only {:.1}% of the {side} policy's GPU time is priced, under {:.0}% (tripped): declare `price` on its pools or `cost` on its tenants",
                        share * 100.0,
                        MIN_PRICED_SHARE * 100.0
                    ));
                }
            }
        }
    }
    result(tripped, details.join("; "))
}

/// The least share of a group's GPU time that must be priced (a pool's
/// `price` or a tenant's `cost`) for a `cost` gate to pass.
pub const MIN_PRICED_SHARE: f64 = 0.95;

/// The share of a group's GPU time that had a price; `None` without GPU
/// time.
fn priced_share(g: &crate::replay::report::Group) -> Option<f64> {
    (g.gpu_seconds > 0.0).then(|| (g.priced_gpu_seconds / g.gpu_seconds).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_how_much_worse_and_never_negative_or_infinite() {
        assert!(parse("tier:interactive slo_attainment +1").is_ok());
        assert!(parse("tier:interactive ttft_p95 +10%").is_ok());
        assert!(parse("all rejected 0").is_ok());
        for bad in [
            "tier:interactive slo_attainment -1%",
            "tier:interactive ttft_p95 -10%",
            "all rejected -0.5",
            "all rejected inf",
            "all rejected NaN%",
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains("may worsen"), "{bad}: {e}");
        }
        let e = parse("tier:interactive slo_attainment -1%").unwrap_err();
        assert!(e.contains("worse is to fall"), "{e}");
        // Before, `-1%` on a metric that did not move tripped.
        let g = parse("tier:interactive slo_attainment +1").unwrap();
        assert!(!exceeds(20.0, 20.0, g.limit, false));
    }
}
