//! What a request's quotas look like to its client: the `x-ratelimit-*`
//! headers (the binding requests and tokens quota: its limit a minute, what
//! is left, when it is full again) and, for a quota refusal, which quota
//! refused (`tenant acme: tokens 50000/min`). Read from the scheduler's
//! own buckets at admission, in the policy's units (a replica enforcing
//! 1/N of a fleet's quota reports the fleet's figures); pure.

use super::quota::Scope;
use super::{Micros, Reason, SEC};

/// One token bucket as a client sees it: its limit (per minute for tokens
/// and requests, per day for GPU-seconds), what is left of it now, and how
/// long until it is full again (OpenAI's `x-ratelimit-reset-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub limit: f64,
    pub remaining: f64,
    pub reset: Micros,
}

impl Window {
    /// A GPU-seconds budget of `limit` a day, `used` of it on day
    /// `used_day` (days since the epoch; another day used nothing yet), as
    /// a client sees it at `now` in the policy's units (`scale`: the share
    /// enforced here): full again at the next midnight UTC.
    pub fn per_day(limit: f64, used_day: u64, used: f64, now: Micros, scale: f64) -> Window {
        let day = now / (86_400 * SEC);
        let used = if used_day == day { used } else { 0.0 };
        let sc = if scale > 0.0 { scale } else { 1.0 };
        Window {
            limit: limit / sc,
            remaining: (limit - used).max(0.0) / sc,
            reset: (day + 1) * 86_400 * SEC - now,
        }
    }

    /// The share left, 0 (or below, in debt) to 1.
    fn fraction(&self) -> f64 {
        if self.limit > 0.0 {
            self.remaining / self.limit
        } else {
            0.0
        }
    }
}

/// What a quota limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tokens,
    Requests,
    Concurrent,
    GpuSeconds,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Tokens => "tokens",
            Kind::Requests => "requests",
            Kind::Concurrent => "concurrent",
            Kind::GpuSeconds => "gpu-seconds",
        }
    }
}

/// One quota (a tenant's, a tier's or a model's), now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuotaView {
    pub scope: Scope,
    pub tokens: Option<Window>,
    pub requests: Option<Window>,
    /// The limit and the requests in flight under it.
    pub concurrent: Option<(u64, u64)>,
    /// GPU-seconds a day: the limit, what today has left, the time to
    /// the next day.
    pub gpu: Option<Window>,
}

/// The quota that refused a request, and what of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub scope: Scope,
    pub kind: Kind,
    /// The limit (a minute's tokens or requests, requests in flight, a
    /// day's GPU-seconds).
    pub limit: f64,
    /// Until the bucket is full again (the next day for GPU-seconds; a
    /// second for a concurrency limit: when a request in flight ends).
    pub reset: Micros,
}

/// A request's rate limits as its answer reports them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RateLimits {
    /// The binding (least left) requests-a-minute quota.
    pub requests: Option<(Scope, Window)>,
    /// The binding tokens-a-minute quota.
    pub tokens: Option<(Scope, Window)>,
    /// Which quota refused it, for a quota refusal.
    pub hit: Option<Hit>,
}

impl RateLimits {
    /// The limits of the quotas that apply to a request (tenant first,
    /// then tier, then model), and, when `refused` is a quota reason,
    /// which of them refused.
    pub fn of(views: &[QuotaView], refused: Option<Reason>) -> RateLimits {
        let binding = |pick: fn(&QuotaView) -> Option<Window>| {
            views
                .iter()
                .filter_map(|v| pick(v).map(|w| (v.scope, w)))
                .fold(None, |best: Option<(Scope, Window)>, (s, w)| match best {
                    Some((_, b)) if b.fraction() <= w.fraction() => best,
                    _ => Some((s, w)),
                })
        };
        RateLimits {
            requests: binding(|v| v.requests),
            tokens: binding(|v| v.tokens),
            hit: refused.and_then(|r| hit(views, r)),
        }
    }
}

/// Which quota a refusal for `reason` came from: its scope by the reason,
/// the kind by the gate's order (concurrency, GPU-seconds, requests,
/// tokens: the first that has run out).
fn hit(views: &[QuotaView], reason: Reason) -> Option<Hit> {
    let want = |s: &Scope| match reason {
        Reason::Quota | Reason::Concurrency => matches!(s, Scope::Tenant(_)),
        Reason::TierQuota => matches!(s, Scope::Tier(_)),
        Reason::ModelQuota => matches!(s, Scope::Model(_)),
        _ => false,
    };
    let v = views.iter().find(|v| want(&v.scope))?;
    if let Some((limit, in_flight)) = v.concurrent {
        if in_flight >= limit || reason == Reason::Concurrency {
            return Some(Hit {
                scope: v.scope,
                kind: Kind::Concurrent,
                limit: limit as f64,
                reset: SEC,
            });
        }
    }
    let window = |kind: Kind, w: Window| Hit {
        scope: v.scope,
        kind,
        limit: w.limit,
        reset: w.reset,
    };
    if let Some(g) = v.gpu.filter(|g| g.remaining <= 0.0) {
        return Some(window(Kind::GpuSeconds, g));
    }
    if let Some(r) = v.requests.filter(|r| r.remaining < 1.0) {
        return Some(window(Kind::Requests, r));
    }
    // Short of tokens for this request (the bucket may hold fewer than it
    // needs without being empty).
    v.tokens
        .map(|t| window(Kind::Tokens, t))
        .or_else(|| v.requests.map(|r| window(Kind::Requests, r)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(limit: f64, remaining: f64) -> Window {
        Window {
            limit,
            remaining,
            reset: 7 * SEC,
        }
    }

    fn view(scope: Scope) -> QuotaView {
        QuotaView {
            scope,
            tokens: None,
            requests: None,
            concurrent: None,
            gpu: None,
        }
    }

    #[test]
    fn the_binding_quota_is_the_one_with_least_left() {
        let tenant = QuotaView {
            tokens: Some(w(1000.0, 900.0)),
            requests: Some(w(10.0, 2.0)),
            ..view(Scope::Tenant(0))
        };
        let tier = QuotaView {
            tokens: Some(w(100.0, 10.0)),
            requests: Some(w(100.0, 50.0)),
            ..view(Scope::Tier(1))
        };
        let r = RateLimits::of(&[tenant, tier], None);
        assert_eq!(r.requests, Some((Scope::Tenant(0), w(10.0, 2.0))));
        assert_eq!(r.tokens, Some((Scope::Tier(1), w(100.0, 10.0))));
        assert_eq!(r.hit, None);
    }

    #[test]
    fn a_refusal_names_the_scope_and_what_ran_out() {
        let tenant = QuotaView {
            tokens: Some(w(1000.0, 900.0)),
            requests: Some(w(10.0, 0.5)),
            ..view(Scope::Tenant(0))
        };
        let tier = QuotaView {
            tokens: Some(w(100.0, 10.0)),
            ..view(Scope::Tier(1))
        };
        let h = RateLimits::of(&[tenant, tier], Some(Reason::Quota)).hit;
        assert_eq!(
            h.map(|h| (h.scope, h.kind, h.limit)),
            Some((Scope::Tenant(0), Kind::Requests, 10.0))
        );
        let h = RateLimits::of(&[tenant, tier], Some(Reason::TierQuota)).hit;
        assert_eq!(
            h.map(|h| (h.scope, h.kind, h.limit)),
            Some((Scope::Tier(1), Kind::Tokens, 100.0))
        );
        // A reason no quota gave, or a scope with no quota: no hit.
        assert_eq!(
            RateLimits::of(&[tenant], Some(Reason::ModelQuota)).hit,
            None
        );
        assert_eq!(RateLimits::of(&[tenant], Some(Reason::Overload)).hit, None);
    }

    #[test]
    fn concurrency_and_gpu_seconds_come_before_buckets() {
        let full = QuotaView {
            tokens: Some(w(1000.0, 0.0)),
            concurrent: Some((2, 2)),
            ..view(Scope::Model(3))
        };
        let h = RateLimits::of(&[full], Some(Reason::ModelQuota)).hit;
        assert_eq!(h.map(|h| h.kind), Some(Kind::Concurrent));
        let spent = QuotaView {
            gpu: Some(w(3600.0, 0.0)),
            tokens: Some(w(1000.0, 0.0)),
            ..view(Scope::Model(3))
        };
        let h = RateLimits::of(&[spent], Some(Reason::ModelQuota)).hit;
        assert_eq!(h.map(|h| h.kind), Some(Kind::GpuSeconds));
    }
}
