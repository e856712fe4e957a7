//! Exceptions in the semantic diff. Every change to one is an
//! `exception_change`; a grant added or raised, or a window that starts
//! earlier or ends later, is also an escalation of the kind the grant is
//! (`priority_increase` for a tier's priority, `quota_increase` for a
//! weight, a limit or a reserved share), so an approval rule on those
//! kinds covers grants made by exception as it covers the policy's own.
//! The subject names whom it grants to (`exception close for tenant
//! finance`), so `require owner` asks that tier's or tenant's owner.

use super::*;
use crate::graph::Exception;

fn subject(g: &DecisionGraph, e: &Exception) -> String {
    format!("exception {} for {}", e.name, e.subject_name(g))
}

fn summary(g: &DecisionGraph, e: &Exception) -> String {
    format!("{}: {} (\"{}\")", e.window(), e.grants(g), e.reason)
}

/// The escalation kind of an exception's grants: a priority raised is a
/// `priority_increase`, anything else more capacity.
fn grant_kind(e: &Exception) -> ChangeKind {
    if e.priority.is_some() {
        ChangeKind::PriorityIncrease
    } else {
        ChangeKind::QuotaIncrease
    }
}

pub(super) fn exceptions(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let ek = ChangeKind::ExceptionChange;
    by_name(
        &old.exceptions,
        &new.exceptions,
        |e| &e.name,
        |_, a, b| match (a, b) {
            (None, Some(b)) => {
                let s = subject(new, b);
                out.added(&s, summary(new, b), ek);
                grants(out, &s, None, b, old, new);
            }
            (Some(a), None) => out.removed(&subject(old, a), summary(old, a), ek),
            (Some(a), Some(b)) => {
                let s = subject(new, b);
                let (sa, sb) = (a.subject_name(old), b.subject_name(new));
                // Granted to someone else: all of it is new to them.
                if sa != sb {
                    out.field(&s, "for", sa, sb, ek);
                    grants(out, &s, None, b, old, new);
                } else {
                    grants(out, &s, Some(a), b, old, new);
                }
                let longer = b.from < a.from || b.until > a.until;
                out.directed(
                    &s,
                    "dates",
                    (a.window(), b.window()),
                    longer,
                    grant_kind(b),
                    ek,
                );
                out.field(&s, "reason", a.reason.clone(), b.reason.clone(), ek);
                owners(out, &s, &a.owner, &b.owner, ek);
            }
            (None, None) => {}
        },
    );
}

/// Each grant of `b` against what `a` granted (`None`: nothing): more is an
/// escalation of its kind, less or gone an `exception_change`.
fn grants(
    out: &mut Out,
    s: &str,
    a: Option<&Exception>,
    b: &Exception,
    old: &DecisionGraph,
    new: &DecisionGraph,
) {
    let ek = ChangeKind::ExceptionChange;
    let qi = ChangeKind::QuotaIncrease;
    let mut one =
        |field: &str, x: Option<f64>, y: Option<f64>, render: &dyn Fn(f64) -> String, k| {
            let up = match (x, y) {
                (None, Some(_)) => true,
                (Some(x), Some(y)) => y > x,
                _ => false,
            };
            out.directed(
                s,
                field,
                (opt(x, render, "none"), opt(y, render, "none")),
                up,
                k,
                ek,
            );
        };
    let pa = a.and_then(|e| e.priority).map(|p| p as f64);
    one(
        "priority",
        pa,
        b.priority.map(|p| p as f64),
        &num,
        ChangeKind::PriorityIncrease,
    );
    one("weight", a.and_then(|e| e.weight), b.weight, &num, qi);
    let q0 = a.map(|e| e.quota).unwrap_or_default();
    let q1 = b.quota;
    one("quota.tokens", q0.tokens, q1.tokens, &per_min, qi);
    one("quota.requests", q0.requests, q1.requests, &per_min, qi);
    one(
        "quota.concurrent",
        q0.concurrent.map(|c| c as f64),
        q1.concurrent.map(|c| c as f64),
        &num,
        qi,
    );
    one(
        "quota.gpu_seconds",
        q0.gpu_seconds,
        q1.gpu_seconds,
        &per_day,
        qi,
    );
    let shares = |g: &DecisionGraph, e: Option<&Exception>| -> BTreeMap<String, f64> {
        e.map(|e| super::reserve_by_pool(g, &e.reserve))
            .unwrap_or_default()
    };
    let (ra, rb) = (shares(old, a), shares(new, Some(b)));
    let pools: BTreeSet<&String> = ra.keys().chain(rb.keys()).collect();
    for pool in pools {
        one(
            &format!("reserve.{pool}"),
            ra.get(pool).copied(),
            rb.get(pool).copied(),
            &pct,
            qi,
        );
    }
}
