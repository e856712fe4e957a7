//! Quotas as token buckets (tokens/min, requests/min), a concurrency limit
//! and a GPU-seconds budget, reserved at admission rather than charged after
//! the fact. A tenant short of tokens may borrow from idle cohort members,
//! up to its `borrow` share of its own quota and each lender's `lend` share.

use super::bucket::Bucket;
use super::ratelimit::Window;
use super::{Micros, Reason, SEC};
use crate::graph::{DecisionGraph, TenantId};

/// Which quota: a tenant's ([`Quotas`]), a tier's or a model's
/// ([`super::scoped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    Tenant(TenantId),
    Tier(crate::graph::TierId),
    Model(crate::graph::ModelId),
}

/// What this scheduler took of a quota's buckets by itself (requests not
/// claimed across a fleet: while its shared store is unreachable, or a
/// rule moved them to a quota that was not claimed), in the policy's
/// units; a replica reports it to the fleet, which charges it there.
/// Tokens may be negative: refunds of what finished requests did not use.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spent {
    pub requests: f64,
    pub tokens: f64,
    /// GPU-seconds used (counted only for a quota that limits them).
    pub gpu_seconds: f64,
}

impl Spent {
    pub fn is_zero(&self) -> bool {
        self.requests == 0.0 && self.tokens == 0.0 && self.gpu_seconds == 0.0
    }
}

/// Which of a request's quotas a fleet claimed for it: those it charges
/// (GPU-seconds included, when the request ends); the others are this
/// scheduler's, and what it charges them is reported ([`Spent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Claims {
    pub tenant: bool,
    pub scoped: super::scoped::Claimed,
}

/// A quota's buckets as a fleet holds them: the share of each bucket's
/// capacity left (`None`: no such bucket, or not known). Shares, not
/// levels: a replica enforcing 1/N of a quota holds 1/N of what the fleet
/// has left, and `quota.remaining` reads the same percentage either way.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Level {
    pub requests: Option<f64>,
    pub tokens: Option<f64>,
}

/// What a fleet's claim covered for one request besides the tenant it
/// names ([`super::Arrival::fleet`]), and the fleet's level of that
/// tenant's buckets after it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FleetClaim {
    /// The tier and model whose quotas were claimed, by name (the policy
    /// may have been swapped since): if the scheduler decides another, that
    /// one is charged here.
    pub tier: Option<String>,
    pub model: Option<String>,
    /// The claimed tenant's buckets after the claim, as the fleet has them.
    pub tenant_level: Option<Level>,
}

/// The scale a replica enforces alone: 1/N of N (at least one replica).
pub fn share_of(replicas: u32) -> f64 {
    1.0 / f64::from(replicas.max(1))
}

#[derive(Debug, Clone, Default)]
struct TenantState {
    tokens: Option<Bucket>,
    requests: Option<Bucket>,
    concurrent: Option<u64>,
    in_flight: u64,
    borrow: f64,
    lend: f64,
    cohort: Option<u16>,
    /// Tokens currently borrowed from (positive) or lent to (negative) the cohort.
    borrowed: f64,
    /// GPU-seconds a day, and what today has used.
    gpu_per_day: Option<f64>,
    gpu_used: f64,
    gpu_day: u64,
    /// Share of requests that may be retries, and the last minute's
    /// (time, was a retry) for it.
    retry_budget: Option<f64>,
    recent: std::collections::VecDeque<(Micros, bool)>,
    /// Taken here since the last [`Quotas::take_spent`].
    spent: Spent,
}

#[derive(Debug, Clone, Default)]
pub struct Quotas {
    tenants: Vec<TenantState>,
    /// The share of each limit enforced here ([`super::Config::quota_scale`]).
    scale: f64,
}

impl Quotas {
    pub fn new(g: &DecisionGraph) -> Quotas {
        Quotas::scaled(g, 1.0)
    }

    /// Quotas at `scale` of the policy's limits (one of N replicas
    /// enforcing its share). A concurrency limit keeps at least one.
    pub fn scaled(g: &DecisionGraph, scale: f64) -> Quotas {
        let scale = if scale.is_finite() && scale > 0.0 {
            scale.min(1.0)
        } else {
            1.0
        };
        Quotas {
            scale,
            tenants: g
                .tenants
                .iter()
                .map(|t| TenantState {
                    tokens: t.quota.tokens.map(|r| Bucket::per_minute(r * scale)),
                    requests: t.quota.requests.map(|r| Bucket::per_minute(r * scale)),
                    concurrent: t
                        .quota
                        .concurrent
                        .map(|c| ((c as f64 * scale).ceil() as u64).max(1)),
                    in_flight: 0,
                    borrow: t.borrow / 100.0,
                    lend: t.lend / 100.0,
                    cohort: t.cohort,
                    borrowed: 0.0,
                    gpu_per_day: t.quota.gpu_seconds.map(|per_s| per_s * 86_400.0 * scale),
                    gpu_used: 0.0,
                    gpu_day: 0,
                    retry_budget: t.retry_budget.map(|p| p / 100.0),
                    recent: Default::default(),
                    spent: Spent::default(),
                })
                .collect(),
        }
    }

    /// The quotas of another graph (a policy swap): a quota that changes is
    /// resized, not reset. A tenant in both keeps its bucket levels
    /// (clamped to the new capacity), requests in flight, GPU-seconds used
    /// today, borrowed tokens and retry history; a new tenant starts full;
    /// a removed one is dropped. `tenant_map` maps old tenant ids to new.
    pub fn remap(&self, g: &DecisionGraph, tenant_map: &[Option<TenantId>], now: Micros) -> Quotas {
        let mut next = Quotas::scaled(g, self.scale);
        let resize = |old: Option<Bucket>, new: &mut Option<Bucket>| {
            if let (Some(o), Some(n)) = (old, new.as_mut()) {
                n.resized_from(o, now);
            }
        };
        for (i, old) in self.tenants.iter().enumerate() {
            let Some(Some(t)) = tenant_map.get(i) else {
                continue;
            };
            let Some(s) = next.tenants.get_mut(*t as usize) else {
                continue;
            };
            resize(old.tokens, &mut s.tokens);
            resize(old.requests, &mut s.requests);
            s.in_flight = old.in_flight;
            s.borrowed = old.borrowed;
            s.gpu_used = old.gpu_used;
            s.gpu_day = old.gpu_day;
            s.recent = old.recent.clone();
            s.spent = old.spent;
        }
        next
    }

    /// The share of each limit enforced here.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// These quotas at another `scale` (the fleet grew or shrank): each
    /// bucket keeps the share of its capacity it had, so a replica's part
    /// of what the fleet has left follows the fleet's size.
    pub fn rescaled(&self, g: &DecisionGraph, scale: f64, now: Micros) -> Quotas {
        let mut next = Quotas::scaled(g, scale);
        let keep = |old: Option<Bucket>, new: &mut Option<Bucket>| {
            if let (Some(o), Some(n)) = (old, new.as_mut()) {
                n.set_fraction(o.fraction(now), now);
            }
        };
        for (s, old) in next.tenants.iter_mut().zip(&self.tenants) {
            keep(old.tokens, &mut s.tokens);
            keep(old.requests, &mut s.requests);
            s.in_flight = old.in_flight;
            s.borrowed = old.borrowed;
            s.gpu_used = old.gpu_used;
            s.gpu_day = old.gpu_day;
            s.recent = old.recent.clone();
            s.spent = old.spent;
        }
        next
    }

    /// Sets tenant `t`'s buckets to the fleet's `level`.
    pub fn mirror(&mut self, t: TenantId, level: &Level, now: Micros) {
        let Some(s) = self.tenants.get_mut(t as usize) else {
            return;
        };
        if let (Some(b), Some(f)) = (s.requests.as_mut(), level.requests) {
            b.set_fraction(f, now);
        }
        if let (Some(b), Some(f)) = (s.tokens.as_mut(), level.tokens) {
            b.set_fraction(f, now);
        }
    }

    /// What was taken here since the last call, by tenant (only those
    /// that took or refunded something).
    pub fn take_spent(&mut self) -> Vec<(TenantId, Spent)> {
        let mut out = Vec::new();
        for (i, s) in self.tenants.iter_mut().enumerate() {
            if !s.spent.is_zero() {
                out.push((i as TenantId, std::mem::take(&mut s.spent)));
            }
        }
        out
    }

    /// Counts a request in flight without enforcing anything (baselines).
    pub fn track(&mut self, t: TenantId) {
        if let Some(s) = self.tenants.get_mut(t as usize) {
            s.in_flight += 1;
        }
    }

    /// Reserves `tokens` and one request for tenant `t`, borrowing from the
    /// cohort when its own bucket is short. On refusal: the reason and how
    /// long until a retry could succeed.
    pub fn reserve(
        &mut self,
        _g: &DecisionGraph,
        t: TenantId,
        tokens: f64,
        now: Micros,
    ) -> Result<bool, (Reason, Micros)> {
        let ti = t as usize;
        let Some(s) = self.tenants.get_mut(ti) else {
            return Ok(false);
        };
        if let Some(limit) = s.concurrent {
            if s.in_flight >= limit {
                return Err((Reason::Concurrency, SEC));
            }
        }
        if let Some(limit) = s.gpu_per_day {
            let day = now / (86_400 * SEC);
            if s.gpu_day == day && s.gpu_used >= limit {
                return Err((Reason::Quota, (day + 1) * 86_400 * SEC - now));
            }
        }
        if let Some(b) = s.requests.as_mut() {
            b.refill(now);
            if b.level < 1.0 {
                return Err((Reason::Quota, b.wait_for(1.0).max(1)));
            }
        }
        let mut from_cohort = 0.0;
        if let Some(b) = s.tokens.as_mut() {
            b.refill(now);
            if b.level < tokens {
                let short = tokens - b.level;
                let may_borrow = b.capacity * s.borrow - s.borrowed.max(0.0);
                if short > may_borrow || s.cohort.is_none() {
                    return Err((Reason::Quota, b.wait_for(tokens).max(1)));
                }
                from_cohort = short;
            }
        }
        if from_cohort > 0.0 && !self.borrow_from_cohort(ti, from_cohort, now) {
            let wait = self.tenants[ti]
                .tokens
                .as_ref()
                .map_or(SEC, |b| b.wait_for(tokens).max(1));
            return Err((Reason::Quota, wait));
        }
        let s = &mut self.tenants[ti];
        if let Some(b) = s.requests.as_mut() {
            b.level -= 1.0;
            s.spent.requests += 1.0;
        }
        if let Some(b) = s.tokens.as_mut() {
            b.level -= tokens - from_cohort;
            s.spent.tokens += tokens - from_cohort;
        }
        s.borrowed += from_cohort;
        s.in_flight += 1;
        Ok(from_cohort > 0.0)
    }

    /// Takes `amount` tokens from cohort members' idle buckets, each within
    /// its `lend` share. All or nothing.
    fn borrow_from_cohort(&mut self, borrower: usize, amount: f64, now: Micros) -> bool {
        let cohort = self.tenants[borrower].cohort;
        let mut offers: Vec<(usize, f64)> = Vec::new();
        let mut total = 0.0;
        for (i, s) in self.tenants.iter_mut().enumerate() {
            if i == borrower || s.cohort != cohort || s.lend <= 0.0 {
                continue;
            }
            if let Some(b) = s.tokens.as_mut() {
                b.refill(now);
                let lendable = (b.capacity * s.lend + s.borrowed.min(0.0))
                    .min(b.level)
                    .max(0.0);
                if lendable > 0.0 {
                    offers.push((i, lendable));
                    total += lendable;
                }
            }
        }
        if total < amount {
            return false;
        }
        let mut left = amount;
        for (i, lendable) in offers {
            let take = lendable.min(left);
            if let Some(b) = self.tenants[i].tokens.as_mut() {
                b.level -= take;
            }
            self.tenants[i].borrowed -= take;
            left -= take;
            if left <= 0.0 {
                break;
            }
        }
        true
    }

    /// The request ended: release its slot and refund what it did not use.
    pub fn release(&mut self, t: TenantId, reserved: f64, used: f64) {
        if let Some(s) = self.tenants.get_mut(t as usize) {
            s.in_flight = s.in_flight.saturating_sub(1);
            let refund = (reserved - used).max(0.0);
            if let Some(b) = s.tokens.as_mut() {
                b.level = (b.level + refund).min(b.capacity);
                s.spent.tokens -= refund;
            }
            if reserved > 0.0 && s.borrowed > 0.0 {
                // Borrowed tokens are repaid as the request completes.
                s.borrowed = (s.borrowed - reserved).max(0.0);
            }
        }
    }

    /// Charges GPU-seconds to a tenant's daily budget; counted as spent
    /// here (for a fleet to charge) unless a fleet `claimed` the request.
    pub fn charge_gpu(&mut self, t: TenantId, gpu_seconds: f64, now: Micros, claimed: bool) {
        if let Some(s) = self.tenants.get_mut(t as usize) {
            let day = now / (86_400 * SEC);
            if s.gpu_day != day {
                s.gpu_day = day;
                s.gpu_used = 0.0;
            }
            s.gpu_used += gpu_seconds;
            if !claimed && s.gpu_per_day.is_some() {
                s.spent.gpu_seconds += gpu_seconds;
            }
        }
    }

    /// Counts a request against the retry budget; false when it is a retry
    /// and the tenant's retries in the last minute already reach its share.
    pub fn note_request(
        &mut self,
        _g: &DecisionGraph,
        t: TenantId,
        retry: bool,
        now: Micros,
    ) -> bool {
        let Some(s) = self.tenants.get_mut(t as usize) else {
            return true;
        };
        let Some(budget) = s.retry_budget else {
            return true;
        };
        while s.recent.front().is_some_and(|(at, _)| *at + 60 * SEC < now) {
            s.recent.pop_front();
        }
        let total = s.recent.len() as f64 + 1.0;
        let retries = s.recent.iter().filter(|(_, r)| *r).count() as f64;
        if retry && retries + 1.0 > (budget * total).max(1.0) {
            return false;
        }
        s.recent.push_back((now, retry));
        true
    }

    pub fn in_flight(&self, t: TenantId) -> u64 {
        self.tenants.get(t as usize).map_or(0, |s| s.in_flight)
    }

    pub fn cohort(&self, t: TenantId) -> Option<u16> {
        self.tenants.get(t as usize).and_then(|s| s.cohort)
    }

    /// Tenant `t`'s quota as its client sees it; `None` without one.
    pub fn view(&self, t: TenantId, now: Micros) -> Option<super::ratelimit::QuotaView> {
        let s = self.tenants.get(t as usize)?;
        let scale = self.scale;
        let gpu = s
            .gpu_per_day
            .map(|limit| Window::per_day(limit, s.gpu_day, s.gpu_used, now, scale));
        let v = super::ratelimit::QuotaView {
            scope: Scope::Tenant(t),
            tokens: s.tokens.map(|b| b.window(now, scale)),
            requests: s.requests.map(|b| b.window(now, scale)),
            concurrent: s.concurrent.map(|c| (c, s.in_flight)),
            gpu,
        };
        let any =
            v.tokens.is_some() || v.requests.is_some() || v.concurrent.is_some() || v.gpu.is_some();
        any.then_some(v)
    }

    /// Share of the tightest bucket left, 0–100 (100 when unlimited).
    pub fn remaining_percent(&self, t: TenantId, now: Micros) -> f64 {
        let Some(s) = self.tenants.get(t as usize) else {
            return 100.0;
        };
        super::bucket::remaining_percent(s.tokens.as_ref(), s.requests.as_ref(), now)
    }
}

#[cfg(test)]
mod tests {
    use super::super::swap::Remap;
    use super::super::testkit::{graph, BASE};
    use super::*;

    #[test]
    fn a_quota_that_changes_is_resized_not_reset() {
        let base = BASE.replace("concurrent 4 }", "concurrent 4 } retry_budget 50%");
        let g = graph(&base);
        let mut q = Quotas::new(&g);
        // chat (tenant 0): tokens 60k/min, concurrent 4.
        assert_eq!(q.reserve(&g, 0, 50_000.0, 0), Ok(false));
        q.charge_gpu(0, 7.0, 0, false);
        assert!(q.note_request(&g, 0, false, 0));
        // New version: chat's bucket shrinks to 30k/min, tenants reorder,
        // bulk is gone and newbie appears.
        let text = base
            .replace("tokens 60k/min concurrent 4", "tokens 30k/min concurrent 1")
            .replace(
                "tenant bulk { owner \"o\" tiers [lo] }",
                "tenant newbie { owner \"o\" tiers [lo] quota { tokens 1k/min } }",
            );
        let g2 = graph(&text);
        let map = Remap::new(&g, &g2);
        assert_eq!(map.tenants, vec![Some(0), None]);
        let q2 = q.remap(&g2, &map.tenants, 0);
        // 10k left of 60k, clamped to nothing more than 30k: still 10k.
        assert!((q2.remaining_percent(0, 0) - 100.0 * 10_000.0 / 30_000.0).abs() < 1e-6);
        assert_eq!(q2.in_flight(0), 1);
        assert_eq!(q2.tenants[0].gpu_used, 7.0);
        assert_eq!(q2.tenants[0].recent.len(), 1);
        // The new concurrency limit applies to the carried count.
        let mut q2 = q2;
        assert_eq!(q2.reserve(&g2, 0, 1.0, 0), Err((Reason::Concurrency, SEC)));
        // A new tenant starts full.
        assert_eq!(q2.remaining_percent(1, 0), 100.0);
        // A level above a smaller capacity is clamped to it.
        let mut fresh = Quotas::new(&g);
        if let Some(b) = fresh.tenants[0].tokens.as_mut() {
            b.level = 60_000.0;
        }
        let q3 = fresh.remap(&g2, &map.tenants, 0);
        assert_eq!(q3.remaining_percent(0, 0), 100.0);
        assert_eq!(q3.tenants[0].tokens.map(|b| b.level), Some(30_000.0));
    }

    /// A replica of a fleet holds its share of what the fleet has left:
    /// mirrored levels, spending counted for the fleet, and a new fleet
    /// size keeping each bucket's share.
    #[test]
    fn a_replica_holds_its_share_of_the_fleets_level() {
        let g = graph(BASE);
        // chat (tenant 0): tokens 60k/min; one of two replicas.
        let mut q = Quotas::scaled(&g, 0.5);
        q.mirror(
            0,
            &Level {
                requests: None,
                tokens: Some(0.25),
            },
            0,
        );
        assert!((q.remaining_percent(0, 0) - 25.0).abs() < 1e-9);
        // A quarter of 30k is left here: 7.5k.
        assert!(q.reserve(&g, 0, 8_000.0, 0).is_err());
        assert_eq!(q.reserve(&g, 0, 5_000.0, 0), Ok(false));
        q.release(0, 5_000.0, 4_000.0);
        assert_eq!(
            q.take_spent(),
            vec![(
                0,
                Spent {
                    requests: 0.0,
                    tokens: 4_000.0,
                    gpu_seconds: 0.0,
                }
            )]
        );
        assert!(q.take_spent().is_empty(), "taken once");
        // The fleet grows to four: the same share of a smaller bucket.
        let before = q.remaining_percent(0, 0);
        let q4 = q.rescaled(&g, 0.25, 0);
        assert!((q4.remaining_percent(0, 0) - before).abs() < 1e-9);
        assert!((q4.scale() - 0.25).abs() < 1e-12);
        // A level in debt (spending reported after an outage) refuses.
        let mut q = q4;
        q.mirror(
            0,
            &Level {
                requests: None,
                tokens: Some(-0.5),
            },
            0,
        );
        assert_eq!(q.remaining_percent(0, 0), 0.0);
        assert!(q.reserve(&g, 0, 1.0, 0).is_err());
    }
}
