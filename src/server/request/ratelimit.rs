//! A request's rate limits in its answer: the `x-ratelimit-*` headers
//! OpenAI's API sends (and SDKs and agents read) for the binding requests
//! and tokens quota, and a quota refusal's message naming the quota that
//! refused (`tenant acme's quota: tokens 50k/min, resets in 12 s`). The
//! figures are the scheduler's, at admission ([`crate::sched::ratelimit`]).

use crate::graph::DecisionGraph;
use crate::sched::quota::Scope;
use crate::sched::ratelimit::{Hit, Kind, RateLimits};
use crate::sched::Micros;

/// The quota's owner, as the policy names it: `tenant acme`, `tier
/// batch`, `model llama-8b`.
pub(in crate::server) fn scope_name(g: &DecisionGraph, s: Scope) -> String {
    let name = match s {
        Scope::Tenant(t) => g.tenants.get(t as usize).map(|t| t.name.as_str()),
        Scope::Tier(t) => g.tiers.get(t as usize).map(|t| t.name.as_str()),
        Scope::Model(m) => g.models.get(m as usize).map(|m| m.name.as_str()),
    };
    let kind = match s {
        Scope::Tenant(_) => "tenant",
        Scope::Tier(_) => "tier",
        Scope::Model(_) => "model",
    };
    format!("{kind} {}", name.unwrap_or("?"))
}

/// A duration as OpenAI writes `x-ratelimit-reset-*`: `250ms`, `12s`,
/// `1m30s`, `2h0m5s` (wall time: scheduler time over `speed`).
pub(in crate::server) fn duration(micros: Micros, speed: f64) -> String {
    let speed = if speed > 0.0 { speed } else { 1.0 };
    let ms = (micros as f64 / 1000.0 / speed).ceil() as u64;
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = ms.div_ceil(1000);
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

/// A whole number of a count (never negative), as the headers carry it.
fn count(x: f64) -> String {
    format!("{}", x.max(0.0).floor() as u64)
}

/// A limit as a policy writes one: `50k`, `1.5M`, `600`.
fn compact(x: f64) -> String {
    let x = x.max(0.0);
    let (v, unit) = if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "k")
    } else {
        (x, "")
    };
    let r = (v * 10.0).round() / 10.0;
    if r.fract() == 0.0 {
        format!("{}{unit}", r as u64)
    } else {
        format!("{r:.1}{unit}")
    }
}

/// The `x-ratelimit-*` headers of the binding quotas (and which quota
/// each is, `x-kiln-ratelimit-{requests,tokens}-quota`); none for a
/// request no requests or tokens quota applies to.
pub(in crate::server) fn headers(
    g: &DecisionGraph,
    l: &RateLimits,
    speed: f64,
) -> Vec<(&'static str, String)> {
    let mut h = Vec::new();
    if let Some((scope, w)) = l.requests {
        h.push(("x-ratelimit-limit-requests", count(w.limit)));
        h.push(("x-ratelimit-remaining-requests", count(w.remaining)));
        h.push(("x-ratelimit-reset-requests", duration(w.reset, speed)));
        h.push(("x-kiln-ratelimit-requests-quota", scope_name(g, scope)));
    }
    if let Some((scope, w)) = l.tokens {
        h.push(("x-ratelimit-limit-tokens", count(w.limit)));
        h.push(("x-ratelimit-remaining-tokens", count(w.remaining)));
        h.push(("x-ratelimit-reset-tokens", duration(w.reset, speed)));
        h.push(("x-kiln-ratelimit-tokens-quota", scope_name(g, scope)));
    }
    h
}

/// The quota that refused, in words: `tenant acme's quota: tokens 50k/min,
/// resets in 12 s`.
pub(in crate::server) fn describe(g: &DecisionGraph, hit: &Hit, speed: f64) -> String {
    let what = match hit.kind {
        Kind::Tokens | Kind::Requests => {
            format!("{} {}/min", hit.kind.name(), compact(hit.limit))
        }
        Kind::GpuSeconds => format!("gpu-seconds {}/day", compact(hit.limit)),
        Kind::Concurrent => format!("concurrent {}", count(hit.limit)),
    };
    let when = match hit.kind {
        Kind::Concurrent => "frees as a request in flight ends".to_string(),
        _ => format!("resets in {}", spaced(duration(hit.reset.max(1), speed))),
    };
    format!("{}'s quota: {what}, {when}", scope_name(g, hit.scope))
}

/// `12s` as `12 s` in prose (`1m30s` stays as it is).
fn spaced(d: String) -> String {
    match d.strip_suffix("ms") {
        Some(n) if n.bytes().all(|b| b.is_ascii_digit()) => format!("{n} ms"),
        _ => match d.strip_suffix('s') {
            Some(n) if n.bytes().all(|b| b.is_ascii_digit()) => format!("{n} s"),
            _ => d,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::SEC as S;

    #[test]
    fn durations_read_as_openai_writes_them() {
        assert_eq!(duration(250_000, 1.0), "250ms");
        assert_eq!(duration(12 * S, 1.0), "12s");
        assert_eq!(duration(90 * S, 1.0), "1m30s");
        assert_eq!(duration(3600 * S + 5 * S, 1.0), "1h0m5s");
        // Simulated time at 10x is a tenth of the wall time.
        assert_eq!(duration(120 * S, 10.0), "12s");
        assert_eq!(duration(0, 1.0), "0ms");
    }

    #[test]
    fn limits_read_as_a_policy_writes_them() {
        assert_eq!(compact(50_000.0), "50k");
        assert_eq!(compact(1_500_000.0), "1.5M");
        assert_eq!(compact(600.0), "600");
        assert_eq!(spaced("12s".into()), "12 s");
        assert_eq!(spaced("1m30s".into()), "1m30s");
    }
}
