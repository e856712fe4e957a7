//! Quotas of a tier and of a model (`tier T { quota { … } }`, `model M {
//! quota { … } }`), beside each tenant's ([`super::quota`]): tokens and
//! requests a minute (token buckets holding a minute of their rate), a
//! concurrency limit and GPU-seconds a day, shared by every request of the
//! tier or of the model. A request must fit every quota that applies to it
//! (its tenant's, its tier's, its model's); these two are reserved at
//! admission after the tenant's, all or nothing, in O(1), and a refusal
//! says which (`tier-quota`, `model-quota`) with a Retry-After. No
//! borrowing: cohorts lend between tenants only.

use super::bucket::Bucket;
use super::quota::{Level, Spent};
use super::ratelimit::Window;
use super::swap::Remap;
use super::{Micros, Reason, SEC};
use crate::graph::{DecisionGraph, ModelId, Quota, TierId};

/// One quota's state.
#[derive(Debug, Clone, Default)]
struct Limit {
    tokens: Option<Bucket>,
    requests: Option<Bucket>,
    concurrent: Option<u64>,
    in_flight: u64,
    gpu_per_day: Option<f64>,
    gpu_used: f64,
    gpu_day: u64,
    /// Taken here since the last [`ScopedQuotas::take_spent`].
    spent: Spent,
}

impl Limit {
    /// `scale` of the quota `q` (one of N replicas: 1/N; a concurrency
    /// limit keeps at least one).
    fn new(q: &Quota, scale: f64) -> Limit {
        Limit {
            tokens: q.tokens.map(|r| Bucket::per_minute(r * scale)),
            requests: q.requests.map(|r| Bucket::per_minute(r * scale)),
            concurrent: q
                .concurrent
                .map(|c| ((c as f64 * scale).ceil() as u64).max(1)),
            gpu_per_day: q.gpu_seconds.map(|per_s| per_s * 86_400.0 * scale),
            ..Limit::default()
        }
    }

    fn mirror(&mut self, level: &Level, now: Micros) {
        if let (Some(b), Some(f)) = (self.requests.as_mut(), level.requests) {
            b.set_fraction(f, now);
        }
        if let (Some(b), Some(f)) = (self.tokens.as_mut(), level.tokens) {
            b.set_fraction(f, now);
        }
    }

    /// This state at another scale, each bucket at the share it had.
    fn rescaled(&self, q: &Quota, scale: f64, now: Micros) -> Limit {
        let mut n = Limit::new(q, scale);
        let keep = |old: Option<Bucket>, new: &mut Option<Bucket>| {
            if let (Some(o), Some(b)) = (old, new.as_mut()) {
                b.set_fraction(o.fraction(now), now);
            }
        };
        keep(self.tokens, &mut n.tokens);
        keep(self.requests, &mut n.requests);
        n.in_flight = self.in_flight;
        n.gpu_used = self.gpu_used;
        n.gpu_day = self.gpu_day;
        n.spent = self.spent;
        n
    }

    /// Whether `tokens` and one request fit now; if not, when they might.
    fn check(&mut self, tokens: f64, now: Micros) -> Result<(), Micros> {
        if self.concurrent.is_some_and(|c| self.in_flight >= c) {
            return Err(SEC);
        }
        if let Some(limit) = self.gpu_per_day {
            let day = now / (86_400 * SEC);
            if self.gpu_day == day && self.gpu_used >= limit {
                return Err((day + 1) * 86_400 * SEC - now);
            }
        }
        if let Some(b) = self.requests.as_mut() {
            b.refill(now);
            if b.level < 1.0 {
                return Err(b.wait_for(1.0).max(1));
            }
        }
        if let Some(b) = self.tokens.as_mut() {
            b.refill(now);
            if b.level < tokens {
                return Err(b.wait_for(tokens).max(1));
            }
        }
        Ok(())
    }

    fn take(&mut self, tokens: f64) {
        if let Some(b) = self.requests.as_mut() {
            b.level -= 1.0;
            self.spent.requests += 1.0;
        }
        if let Some(b) = self.tokens.as_mut() {
            b.level -= tokens;
            self.spent.tokens += tokens;
        }
        self.in_flight += 1;
    }

    fn release(&mut self, reserved: f64, used: f64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(b) = self.tokens.as_mut() {
            let refund = (reserved - used).max(0.0);
            b.level = (b.level + refund).min(b.capacity);
            self.spent.tokens -= refund;
        }
    }

    fn charge_gpu(&mut self, gpu_seconds: f64, now: Micros, claimed: bool) {
        if self.gpu_per_day.is_none() {
            return;
        }
        let day = now / (86_400 * SEC);
        if self.gpu_day != day {
            self.gpu_day = day;
            self.gpu_used = 0.0;
        }
        self.gpu_used += gpu_seconds;
        if !claimed {
            self.spent.gpu_seconds += gpu_seconds;
        }
    }

    /// This state under a new quota: levels kept (clamped), in flight and
    /// today's GPU-seconds carried.
    fn resized(&self, q: &Quota, scale: f64, now: Micros) -> Limit {
        let mut n = Limit::new(q, scale);
        let keep = |old: Option<Bucket>, new: &mut Option<Bucket>| {
            if let (Some(o), Some(b)) = (old, new.as_mut()) {
                b.resized_from(o, now);
            }
        };
        keep(self.tokens, &mut n.tokens);
        keep(self.requests, &mut n.requests);
        n.in_flight = self.in_flight;
        n.gpu_used = self.gpu_used;
        n.gpu_day = self.gpu_day;
        n.spent = self.spent;
        n
    }

    fn view(
        &self,
        scope: super::quota::Scope,
        now: Micros,
        scale: f64,
    ) -> Option<super::ratelimit::QuotaView> {
        let gpu = self
            .gpu_per_day
            .map(|limit| Window::per_day(limit, self.gpu_day, self.gpu_used, now, scale));
        let v = super::ratelimit::QuotaView {
            scope,
            tokens: self.tokens.map(|b| b.window(now, scale)),
            requests: self.requests.map(|b| b.window(now, scale)),
            concurrent: self.concurrent.map(|c| (c, self.in_flight)),
            gpu,
        };
        let any =
            v.tokens.is_some() || v.requests.is_some() || v.concurrent.is_some() || v.gpu.is_some();
        any.then_some(v)
    }

    fn remaining_percent(&self, now: Micros) -> f64 {
        super::bucket::remaining_percent(self.tokens.as_ref(), self.requests.as_ref(), now)
    }
}

/// Tier and model quotas.
#[derive(Debug, Clone, Default)]
pub struct ScopedQuotas {
    tiers: Vec<Limit>,
    models: Vec<Limit>,
    /// The share of each limit enforced here (see
    /// [`super::Config::quota_scale`]).
    scale: f64,
}

/// Which of a request's tier and model quotas the scheduler leaves alone:
/// a fleet claimed them for it already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Claimed {
    pub tier: bool,
    pub model: bool,
}

/// What a held request reserved of its tier's and model's quotas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scoped {
    /// `None` once a policy swap removed it (nothing to give back to).
    pub tier: Option<TierId>,
    pub model: Option<ModelId>,
    pub tokens: f64,
}

impl ScopedQuotas {
    pub fn new(g: &DecisionGraph) -> ScopedQuotas {
        ScopedQuotas::scaled(g, 1.0)
    }

    /// At `scale` of the policy's limits (one of N replicas: 1/N).
    pub fn scaled(g: &DecisionGraph, scale: f64) -> ScopedQuotas {
        let scale = if scale.is_finite() && scale > 0.0 {
            scale.min(1.0)
        } else {
            1.0
        };
        ScopedQuotas {
            tiers: g
                .tiers
                .iter()
                .map(|t| Limit::new(&t.quota, scale))
                .collect(),
            models: g
                .models
                .iter()
                .map(|m| Limit::new(&m.quota, scale))
                .collect(),
            scale,
        }
    }

    /// These quotas at another `scale`, each bucket at the share it had.
    pub fn rescaled(&self, g: &DecisionGraph, scale: f64, now: Micros) -> ScopedQuotas {
        let mut next = ScopedQuotas::scaled(g, scale);
        for ((n, old), t) in next.tiers.iter_mut().zip(&self.tiers).zip(&g.tiers) {
            *n = old.rescaled(&t.quota, next.scale, now);
        }
        for ((n, old), m) in next.models.iter_mut().zip(&self.models).zip(&g.models) {
            *n = old.rescaled(&m.quota, next.scale, now);
        }
        next
    }

    /// Sets a tier's (`tier: true`) or a model's quota's buckets to the
    /// fleet's `level`.
    pub fn mirror(&mut self, tier: bool, id: u16, level: &Level, now: Micros) {
        let list = if tier {
            &mut self.tiers
        } else {
            &mut self.models
        };
        if let Some(l) = list.get_mut(id as usize) {
            l.mirror(level, now);
        }
    }

    /// What was taken here since the last call: (is a tier, id, spent).
    pub fn take_spent(&mut self) -> Vec<(bool, u16, Spent)> {
        let mut out = Vec::new();
        for (tier, list) in [(true, &mut self.tiers), (false, &mut self.models)] {
            for (i, l) in list.iter_mut().enumerate() {
                if !l.spent.is_zero() {
                    out.push((tier, i as u16, std::mem::take(&mut l.spent)));
                }
            }
        }
        out
    }

    /// Whether `tokens` and one request fit `tier`'s and `model`'s quotas
    /// now (nothing is taken); if not, which quota and when to retry.
    pub fn check(
        &mut self,
        tier: TierId,
        model: ModelId,
        tokens: f64,
        now: Micros,
    ) -> Result<(), (Reason, Micros)> {
        self.check_unclaimed(tier, model, tokens, now, Claimed::default())
    }

    /// [`Self::check`] of the quotas not `claimed` already.
    pub fn check_unclaimed(
        &mut self,
        tier: TierId,
        model: ModelId,
        tokens: f64,
        now: Micros,
        claimed: Claimed,
    ) -> Result<(), (Reason, Micros)> {
        if let (Some(l), false) = (self.tiers.get_mut(tier as usize), claimed.tier) {
            l.check(tokens, now).map_err(|w| (Reason::TierQuota, w))?;
        }
        if let (Some(l), false) = (self.models.get_mut(model as usize), claimed.model) {
            l.check(tokens, now).map_err(|w| (Reason::ModelQuota, w))?;
        }
        Ok(())
    }

    /// Reserves `tokens` and one request of `tier`'s and `model`'s quotas,
    /// both or neither; on refusal, which quota and when to retry.
    pub fn reserve(
        &mut self,
        tier: TierId,
        model: ModelId,
        tokens: f64,
        now: Micros,
    ) -> Result<Scoped, (Reason, Micros)> {
        self.reserve_unclaimed(tier, model, tokens, now, Claimed::default())
    }

    /// [`Self::reserve`] of the quotas not `claimed` already (those are
    /// neither checked nor taken, nor given back at the end).
    pub fn reserve_unclaimed(
        &mut self,
        tier: TierId,
        model: ModelId,
        tokens: f64,
        now: Micros,
        claimed: Claimed,
    ) -> Result<Scoped, (Reason, Micros)> {
        self.check_unclaimed(tier, model, tokens, now, claimed)?;
        let tier = (!claimed.tier).then_some(tier);
        let model = (!claimed.model).then_some(model);
        if let Some(l) = tier.and_then(|t| self.tiers.get_mut(t as usize)) {
            l.take(tokens);
        }
        if let Some(l) = model.and_then(|m| self.models.get_mut(m as usize)) {
            l.take(tokens);
        }
        Ok(Scoped {
            tier,
            model,
            tokens,
        })
    }

    /// The request ended, having used `used` tokens of what it reserved.
    pub fn release(&mut self, s: Scoped, used: f64) {
        if let Some(l) = s.tier.and_then(|t| self.tiers.get_mut(t as usize)) {
            l.release(s.tokens, used);
        }
        if let Some(l) = s.model.and_then(|m| self.models.get_mut(m as usize)) {
            l.release(s.tokens, used);
        }
    }

    /// Charges GPU-seconds to `tier`'s and `model`'s daily budgets;
    /// counted as spent here (for a fleet to charge) where a fleet did not
    /// claim the request's quota.
    pub fn charge_gpu(
        &mut self,
        tier: TierId,
        model: ModelId,
        gpu_seconds: f64,
        now: Micros,
        claimed: Claimed,
    ) {
        if let Some(l) = self.tiers.get_mut(tier as usize) {
            l.charge_gpu(gpu_seconds, now, claimed.tier);
        }
        if let Some(l) = self.models.get_mut(model as usize) {
            l.charge_gpu(gpu_seconds, now, claimed.model);
        }
    }

    /// Requests in flight under a tier's and a model's quota.
    pub fn in_flight(&self, tier: TierId, model: ModelId) -> (u64, u64) {
        (
            self.tiers.get(tier as usize).map_or(0, |l| l.in_flight),
            self.models.get(model as usize).map_or(0, |l| l.in_flight),
        )
    }

    /// A tier's quota as a client sees it; `None` without one.
    pub fn view_tier(&self, tier: TierId, now: Micros) -> Option<super::ratelimit::QuotaView> {
        self.tiers
            .get(tier as usize)?
            .view(super::quota::Scope::Tier(tier), now, self.scale)
    }

    /// A model's quota as a client sees it; `None` without one.
    pub fn view_model(&self, model: ModelId, now: Micros) -> Option<super::ratelimit::QuotaView> {
        self.models
            .get(model as usize)?
            .view(super::quota::Scope::Model(model), now, self.scale)
    }

    /// The tightest token or request bucket of a tier's and a model's
    /// quotas, percent left (100 when unlimited).
    pub fn remaining_percent(&self, tier: TierId, model: ModelId, now: Micros) -> f64 {
        let t = self
            .tiers
            .get(tier as usize)
            .map_or(100.0, |l| l.remaining_percent(now));
        let m = self
            .models
            .get(model as usize)
            .map_or(100.0, |l| l.remaining_percent(now));
        t.min(m)
    }

    /// The quotas of another graph (a policy swap), by tier and model name:
    /// one in both keeps its levels (clamped to the new capacity), requests
    /// in flight and today's GPU-seconds; a new one starts full.
    pub fn remap(&self, g: &DecisionGraph, map: &Remap, now: Micros) -> ScopedQuotas {
        let mut next = ScopedQuotas::scaled(g, self.scale);
        for (i, old) in self.tiers.iter().enumerate() {
            let Some(t) = map.tier(i as TierId) else {
                continue;
            };
            if let (Some(slot), Some(tier)) =
                (next.tiers.get_mut(t as usize), g.tiers.get(t as usize))
            {
                *slot = old.resized(&tier.quota, next.scale, now);
            }
        }
        for (i, old) in self.models.iter().enumerate() {
            let Some(m) = map_model(map, i as ModelId) else {
                continue;
            };
            if let (Some(slot), Some(model)) =
                (next.models.get_mut(m as usize), g.models.get(m as usize))
            {
                *slot = old.resized(&model.quota, next.scale, now);
            }
        }
        next
    }
}

/// The new id of an old model (by name: whichever of its variants remain).
pub fn map_model(map: &Remap, model: ModelId) -> Option<ModelId> {
    map.variants
        .get(model as usize)?
        .iter()
        .flatten()
        .next()
        .map(|&(m, _)| m)
}

#[cfg(test)]
mod tests {
    use super::super::testkit::graph;
    use super::*;

    const TEXT: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { quota { gpu_seconds 10/day } variant fp16 { memory 10GB pools [p] } }
model n { variant fp16 { memory 10GB pools [p] } }
tier t { priority 1 slo { ttft 10s } quota { tokens 6k/min concurrent 2 } }
tenant x { owner "o" tiers [t] }
classify { default => tier t }
route t m { default => fp16 }
route t n { default => fp16 }
"#;

    #[test]
    fn a_request_fits_every_quota_or_takes_from_none() {
        let g = graph(TEXT);
        let mut q = ScopedQuotas::new(&g);
        // Tier: 6000 tokens a minute, two at once.
        let a = q.reserve(0, 1, 4000.0, 0).expect("fits");
        assert_eq!(q.in_flight(0, 1), (1, 1));
        assert_eq!(
            q.reserve(0, 1, 4000.0, 0).map(|_| ()),
            Err((Reason::TierQuota, 20 * SEC))
        );
        // Refused: nothing was taken from the model's quota.
        assert_eq!(q.in_flight(0, 1), (1, 1));
        let b = q.reserve(0, 1, 1000.0, 0).expect("fits");
        assert_eq!(
            q.reserve(0, 1, 10.0, 0).map(|_| ()),
            Err((Reason::TierQuota, SEC)),
            "concurrency"
        );
        q.release(a, 1000.0);
        q.release(b, 1000.0);
        assert_eq!(q.in_flight(0, 1), (0, 0));
        // 6000 - 2000 used: a third of the bucket is spent.
        assert!((q.remaining_percent(0, 1, 0) - 100.0 * 4000.0 / 6000.0).abs() < 1e-9);
    }

    /// What a fleet claimed is neither checked nor taken here; the rest
    /// is, and counted as spent for the fleet.
    #[test]
    fn a_quota_the_fleet_claimed_is_left_alone() {
        let g = graph(TEXT);
        let mut q = ScopedQuotas::scaled(&g, 0.5);
        // Tier t: 6000 tokens a minute, two at once; half here: 3000, one.
        let claimed = Claimed {
            tier: true,
            model: false,
        };
        let a = q
            .reserve_unclaimed(0, 1, 4000.0, 0, claimed)
            .expect("the tier's quota was claimed by the fleet");
        assert_eq!(a.tier, None);
        assert_eq!(q.in_flight(0, 1), (0, 1));
        assert_eq!(
            q.reserve(0, 1, 4000.0, 0).map(|_| ()),
            Err((Reason::TierQuota, 20 * SEC))
        );
        assert!(q.take_spent().is_empty(), "model n has no buckets");
        let b = q.reserve(0, 1, 1000.0, 0).expect("fits half the tier");
        assert_eq!(
            q.take_spent(),
            vec![(
                true,
                0,
                Spent {
                    requests: 0.0,
                    tokens: 1000.0,
                    gpu_seconds: 0.0,
                }
            )]
        );
        q.release(a, 10.0);
        q.release(b, 1000.0);
        assert_eq!(q.in_flight(0, 1), (0, 0));
    }

    #[test]
    fn a_model_spent_for_the_day_refuses_until_the_next() {
        let g = graph(TEXT);
        let mut q = ScopedQuotas::new(&g);
        let s = q.reserve(0, 0, 10.0, 0).expect("fits");
        q.take_spent();
        // Claimed by a fleet: charged here, not reported (the fleet
        // charges it when the request ends).
        let claimed = Claimed {
            tier: true,
            model: true,
        };
        q.charge_gpu(0, 0, 4.0, SEC, claimed);
        assert!(q.take_spent().is_empty());
        // Not claimed (Redis was unreachable): reported, for the model
        // that limits GPU-seconds only.
        q.charge_gpu(0, 0, 6.0, SEC, Claimed::default());
        let spent = q.take_spent();
        assert_eq!(spent.len(), 1, "{spent:?}");
        assert_eq!(spent[0].2.gpu_seconds, 6.0);
        q.release(s, 10.0);
        let now = 3600 * SEC;
        let err = q.reserve(0, 0, 10.0, now).map(|_| ());
        assert_eq!(err, Err((Reason::ModelQuota, 86_400 * SEC - now)));
        // Another model is not limited; the next day this one is not either.
        assert!(q.reserve(0, 1, 10.0, now).is_ok());
        assert!(q.reserve(0, 0, 10.0, 86_400 * SEC).is_ok());
    }
}

#[cfg(test)]
mod sched_tests {
    use super::super::testkit::*;
    use super::super::{Action, Reason};

    /// A refusal by a tier's quota takes nothing from the tenant's: the
    /// tenant's request bucket still has what it had.
    #[test]
    fn a_tier_refusal_takes_nothing_from_the_tenant() {
        let text = BASE.replace(
            "tier lo { priority 10 slo { window 1h } preemptible }",
            "tier lo { priority 10 slo { window 1h } preemptible quota { concurrent 1 } }",
        );
        let text = text.replace(
            "tenant bulk { owner \"o\" tiers [lo] }",
            "tenant bulk { owner \"o\" tiers [lo] quota { requests 2/min } }",
        );
        let g = graph(&text);
        let mut s = sched(&g);
        let rejected = |acts: &[Action]| {
            acts.iter().find_map(|a| match a {
                Action::Reject {
                    reason,
                    status,
                    retry_after,
                    ..
                } => Some((*reason, *status, retry_after.is_some())),
                _ => None,
            })
        };
        assert_eq!(
            rejected(&arrive(&mut s, 0, arrival(0, "bulk", "m", 10, 5))),
            None
        );
        let before = s.quotas.remaining_percent(1, 0);
        let acts = arrive(&mut s, 0, arrival(1, "bulk", "m", 10, 5));
        assert_eq!(rejected(&acts), Some((Reason::TierQuota, 429, true)));
        assert_eq!(s.quotas.remaining_percent(1, 0), before);
        assert_eq!(s.quotas.in_flight(1), 1);
        assert_eq!(s.scoped.in_flight(1, 0), (1, 1));
        // The first finishes: the tier's slot is free again.
        for _ in 0..20 {
            if !s.replicas[0].busy {
                break;
            }
            let until = s.replicas[0].step_until;
            s.handle(until, super::super::Event::StepDone { replica: 0 });
        }
        assert_eq!(s.scoped.in_flight(1, 0), (0, 0));
        let now = s.now();
        assert_eq!(
            rejected(&arrive(&mut s, now, arrival(2, "bulk", "m", 10, 5))),
            None
        );
    }
}
