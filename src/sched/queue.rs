//! Waiting work, ordered three ways: tiers by priority plus aging; tenants
//! within a tier by weighted service received (the Virtual Token Counter of
//! Sheng et al., OSDI'24: the backlogged tenant that has been served least,
//! per unit of weight, goes next); requests within a tenant by arrival, or
//! earliest deadline first in tiers with a completion window. Baseline modes
//! replace the first two with plain FIFO or strict priority.

use super::{Config, Micros, Mode, ReqId};
use crate::graph::{DecisionGraph, PoolId, TenantId, TierId};
use rustc_hash::FxHashMap as HashMap;
use std::collections::{BTreeSet, VecDeque};

/// A request waiting to start (or to resume, after a preemption).
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    pub id: ReqId,
    pub tier: TierId,
    pub tenant: Option<TenantId>,
    pub arrival: Micros,
    /// Completion deadline (arrival + the tier's window), if any.
    pub deadline: Option<Micros>,
    /// Give up waiting at this time (a `queue` outcome's max wait).
    pub expires: Option<Micros>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Tokens already generated before a preemption.
    pub generated: u32,
    pub model: u16,
    pub variant: u16,
    pub pool: Option<PoolId>,
    pub prefix_blocks: Vec<u64>,
    /// The replica routing chose ([`super::route`]), preferred until
    /// `pin_until`.
    pub affinity: Option<usize>,
    /// Until then only `affinity` may take it; [`Micros::MAX`] pins it
    /// strictly (an external router's choice: no other replica steals it).
    pub pin_until: Micros,
    pub preemptions: u32,
    pub backfill: bool,
    /// Its reservation used tokens borrowed from the cohort: lenders may
    /// reclaim the capacity by preempting it (when its tier is preemptible).
    pub borrowed: bool,
    /// Why it is waiting, for "why did my request wait".
    pub waiting_for: Option<super::Reason>,
    /// GPU time used before a preemption (it counts toward cost).
    pub gpu_seconds: f64,
    /// It has run on a replica at least once (so its prompt was served).
    pub started: bool,
    /// A policy swap removed its tier while it ran: it finishes under a
    /// stand-in tier and is never preempted.
    pub orphan: bool,
}

/// What waits in one (tier, tenant), for snapshots.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStat {
    pub tier: TierId,
    pub tenant: Option<TenantId>,
    /// Requests queued.
    pub depth: usize,
    /// Requests held for a delay window or a batching hold.
    pub parked: usize,
    /// Arrival of the oldest one queued.
    pub oldest: Option<Micros>,
    /// Weighted service received (the VTC counter), decayed to now.
    pub served: f64,
}

/// The replica asking for work.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    pub replica: usize,
    pub model: u16,
    pub variant: u16,
    pub pool: PoolId,
    pub only_tier: Option<TierId>,
    pub allow_backfill: bool,
}

/// How long a request waits for the replica holding its prefix before any
/// replica may take it.
pub const AFFINITY_HOLD: Micros = 50_000;

impl Waiting {
    pub fn tokens(&self) -> u64 {
        u64::from(self.prompt_tokens)
            + u64::from(self.output_tokens - self.generated.min(self.output_tokens))
    }
}

#[derive(Debug, Default)]
struct TenantQueue {
    q: VecDeque<Waiting>,
    /// Weighted service received (VTC counter), as of `at`.
    served: f64,
    at: Micros,
}

impl TenantQueue {
    /// The counter at `now`: service older than the decay window counts
    /// less and less, so fairness is over recent time, not all time.
    fn served_at(&self, now: Micros, decay: Option<Micros>) -> f64 {
        match decay {
            Some(w) if now > self.at && self.served > 0.0 => {
                self.served * (-((now - self.at) as f64) / w as f64).exp()
            }
            _ => self.served,
        }
    }
}

#[derive(Debug, Default)]
struct TierQueue {
    /// Index 0 is "no tenant"; tenant `t` is at `t + 1`.
    tenants: Vec<TenantQueue>,
    len: usize,
    tokens: u64,
}

#[derive(Debug, Default)]
pub struct Queues {
    /// Per routed (model, variant): per tier.
    by_variant: HashMap<(u16, u16), Vec<TierQueue>>,
    tiers: usize,
    tenants: usize,
    len: usize,
    non_backfill: HashMap<(u16, u16), usize>,
    tier_tokens: Vec<u64>,
    expiries: BTreeSet<(Micros, ReqId)>,
    parked: HashMap<ReqId, Waiting>,
    aging: Vec<Option<Micros>>,
    windowed: Vec<bool>,
    /// Completion window per tier, for deadline urgency.
    window_len: Vec<Option<Micros>>,
    decay: Option<Micros>,
    now: Micros,
}

impl Queues {
    pub fn new(g: &DecisionGraph, cfg: &Config) -> Queues {
        Queues {
            tiers: g.tiers.len(),
            tenants: g.tenants.len(),
            tier_tokens: vec![0; g.tiers.len()],
            aging: g
                .tiers
                .iter()
                .map(|t| {
                    if t.may_starve {
                        None
                    } else {
                        Some(
                            t.aging
                                .map_or(cfg.default_aging, |ms| (ms * 1000.0) as Micros)
                                .max(1),
                        )
                    }
                })
                .collect(),
            windowed: g.tiers.iter().map(|t| t.slo.window.is_some()).collect(),
            window_len: g
                .tiers
                .iter()
                .map(|t| t.slo.window.map(|ms| (ms * 1000.0) as Micros))
                .collect(),
            decay: cfg.fairness_window,
            ..Queues::default()
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn tiers_for(&mut self, key: (u16, u16)) -> &mut Vec<TierQueue> {
        let (nt, nn) = (self.tiers, self.tenants);
        self.by_variant.entry(key).or_insert_with(|| {
            (0..nt)
                .map(|_| TierQueue {
                    tenants: (0..=nn).map(|_| TenantQueue::default()).collect(),
                    len: 0,
                    tokens: 0,
                })
                .collect()
        })
    }

    /// Adds a new request at the back of its tenant's queue (or in deadline
    /// order for windowed tiers).
    /// Sets the clock used for fairness decay.
    pub fn set_now(&mut self, now: Micros) {
        self.now = now;
    }

    pub fn push(&mut self, w: Waiting, cfg: &Config) {
        let _ = cfg;
        let windowed = self.windowed.get(w.tier as usize).copied().unwrap_or(false);
        self.insert(w, false, windowed);
    }

    /// Puts a request back where it was: at the head of its tenant's queue.
    pub fn push_front(&mut self, w: Waiting) {
        self.insert(w, true, false);
    }

    fn insert(&mut self, w: Waiting, front: bool, by_deadline: bool) {
        let key = (w.model, w.variant);
        let (tier, slot) = (w.tier as usize, w.tenant.map_or(0, |t| t as usize + 1));
        let tokens = w.tokens();
        if let Some(e) = w.expires {
            self.expiries.insert((e, w.id));
        }
        if !w.backfill {
            *self.non_backfill.entry(key).or_default() += 1;
        }
        self.len += 1;
        if let Some(t) = self.tier_tokens.get_mut(tier) {
            *t += tokens;
        }
        let (now, decay) = (self.now, self.decay);
        let tiers = self.tiers_for(key);
        let Some(tq) = tiers.get_mut(tier) else {
            return;
        };
        // VTC lift: a tenant that becomes backlogged starts no lower than
        // the least-served backlogged tenant, so idling banks no credit.
        // (Not when a request is put back: that tenant never left.)
        if !front && tq.tenants.get(slot).is_some_and(|t| t.q.is_empty()) {
            let floor = tq
                .tenants
                .iter()
                .filter(|t| !t.q.is_empty())
                .map(|t| t.served_at(now, decay))
                .fold(f64::INFINITY, f64::min);
            if let Some(t) = tq.tenants.get_mut(slot) {
                let mine = t.served_at(now, decay);
                t.served = if floor.is_finite() {
                    mine.max(floor)
                } else {
                    mine
                };
                t.at = now;
            }
        }
        tq.len += 1;
        tq.tokens += tokens;
        let Some(t) = tq.tenants.get_mut(slot) else {
            return;
        };
        if front {
            t.q.push_front(w);
        } else if by_deadline {
            // Deadlines mostly arrive in order: check the back first.
            let d = w.deadline.unwrap_or(Micros::MAX);
            if t.q
                .back()
                .is_none_or(|x| x.deadline.unwrap_or(Micros::MAX) <= d)
            {
                t.q.push_back(w);
            } else {
                let pos =
                    t.q.partition_point(|x| x.deadline.unwrap_or(Micros::MAX) <= d);
                t.q.insert(pos, w);
            }
        } else {
            t.q.push_back(w);
        }
    }

    fn remove_at(
        &mut self,
        key: (u16, u16),
        tier: usize,
        slot: usize,
        pos: usize,
    ) -> Option<Waiting> {
        let tq = self.by_variant.get_mut(&key)?.get_mut(tier)?;
        let w = tq.tenants.get_mut(slot)?.q.remove(pos)?;
        tq.len -= 1;
        tq.tokens -= w.tokens();
        self.len -= 1;
        if let Some(t) = self.tier_tokens.get_mut(tier) {
            *t -= w.tokens();
        }
        if !w.backfill {
            if let Some(n) = self.non_backfill.get_mut(&key) {
                *n -= 1;
            }
        }
        if let Some(e) = w.expires {
            self.expiries.remove(&(e, w.id));
        }
        Some(w)
    }

    /// Holds a request outside the queues (a delay window, a batching hold).
    pub fn park(&mut self, w: Waiting) {
        self.parked.insert(w.id, w);
    }

    pub fn unpark(&mut self, id: ReqId) -> Option<Waiting> {
        self.parked.remove(&id)
    }

    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    pub fn any_non_backfill_for(&self, model: u16, variant: u16, _pool: PoolId) -> bool {
        self.non_backfill
            .get(&(model, variant))
            .is_some_and(|n| *n > 0)
    }

    /// Tokens queued in tiers of at least `tier`'s priority.
    pub fn tokens_at_or_above(&self, g: &DecisionGraph, tier: TierId) -> u64 {
        let Some(p) = g.tiers.get(tier as usize).map(|t| t.priority) else {
            return 0;
        };
        g.tiers
            .iter()
            .enumerate()
            .filter(|(_, t)| t.priority >= p)
            .map(|(i, _)| self.tier_tokens.get(i).copied().unwrap_or(0))
            .sum()
    }

    /// The VTC fairness measure now: within each tier (and routed variant),
    /// the largest difference in weighted service between tenants that
    /// both have work waiting.
    pub fn backlog_gap(&self) -> f64 {
        let mut gap: f64 = 0.0;
        for tiers in self.by_variant.values() {
            for tq in tiers.iter().filter(|tq| tq.len > 1) {
                let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
                let mut n = 0;
                for t in tq.tenants.iter().filter(|t| !t.q.is_empty()) {
                    let s = t.served_at(self.now, self.decay);
                    lo = lo.min(s);
                    hi = hi.max(s);
                    n += 1;
                }
                if n > 1 {
                    gap = gap.max(hi - lo);
                }
            }
        }
        gap
    }

    /// Tokens queued in tiers of strictly higher priority than `tier`.
    pub fn tokens_above(&self, g: &DecisionGraph, tier: TierId) -> u64 {
        let Some(p) = g.tiers.get(tier as usize).map(|t| t.priority) else {
            return 0;
        };
        g.tiers
            .iter()
            .enumerate()
            .filter(|(_, t)| t.priority > p)
            .map(|(i, _)| self.tier_tokens.get(i).copied().unwrap_or(0))
            .sum()
    }

    /// Does another tenant have work queued in this tier?
    pub fn others_queued(&self, tier: TierId, tenant: Option<TenantId>) -> bool {
        let slot = tenant.map_or(0, |t| t as usize + 1);
        self.by_variant.values().any(|tiers| {
            tiers.get(tier as usize).is_some_and(|tq| {
                tq.tenants
                    .iter()
                    .enumerate()
                    .any(|(i, t)| i != slot && !t.q.is_empty())
            })
        })
    }

    /// How long the oldest queued request of a tier has waited.
    pub fn oldest_wait(&self, tier: TierId, now: Micros) -> Micros {
        let mut oldest = now;
        for tiers in self.by_variant.values() {
            if let Some(tq) = tiers.get(tier as usize) {
                for t in &tq.tenants {
                    if let Some(w) = t.q.front() {
                        oldest = oldest.min(w.arrival);
                    }
                }
            }
        }
        now - oldest
    }

    pub fn next_expiry(&self) -> Option<Micros> {
        self.expiries.iter().next().map(|(t, _)| *t)
    }

    /// Removes every request whose max wait has passed.
    pub fn take_expired(&mut self, now: Micros) -> Vec<Waiting> {
        let mut out = Vec::new();
        while let Some(&(t, id)) = self.expiries.iter().next() {
            if t > now {
                break;
            }
            self.expiries.remove(&(t, id));
            if let Some(loc) = self.locate(id) {
                if let Some(mut w) = self.remove_at(loc.0, loc.1, loc.2, loc.3) {
                    w.expires = None;
                    out.push(w);
                }
            }
        }
        out
    }

    fn locate(&self, id: ReqId) -> Option<((u16, u16), usize, usize, usize)> {
        for (key, tiers) in &self.by_variant {
            for (ti, tq) in tiers.iter().enumerate() {
                if tq.len == 0 {
                    continue;
                }
                for (si, t) in tq.tenants.iter().enumerate() {
                    if let Some(pos) = t.q.iter().position(|w| w.id == id) {
                        return Some((*key, ti, si, pos));
                    }
                }
            }
        }
        None
    }

    /// Charges a dispatched request's service to its tenant (weighted
    /// prompt and output tokens, divided by the tenant's fair-share weight).
    pub fn charge(&mut self, g: &DecisionGraph, cfg: &Config, w: &Waiting) {
        let weight = w
            .tenant
            .and_then(|t| g.tenants.get(t as usize))
            .map_or(1.0, |t| t.weight.max(1e-9));
        let remaining_out = w.output_tokens.saturating_sub(w.generated);
        let cost = (cfg.vtc_input_weight * f64::from(w.prompt_tokens)
            + cfg.vtc_output_weight * f64::from(remaining_out))
            / weight;
        let slot = w.tenant.map_or(0, |t| t as usize + 1);
        if let Some(t) = self
            .by_variant
            .get_mut(&(w.model, w.variant))
            .and_then(|tiers| tiers.get_mut(w.tier as usize))
            .and_then(|tq| tq.tenants.get_mut(slot))
        {
            t.served = t.served_at(self.now, self.decay) + cost;
            t.at = self.now;
        }
    }

    /// Weighted service a tenant has received in a tier (for the fairness
    /// metric), summed over variants.
    pub fn served(&self, tier: TierId, tenant: Option<TenantId>) -> f64 {
        let slot = tenant.map_or(0, |t| t as usize + 1);
        self.by_variant
            .values()
            .filter_map(|tiers| tiers.get(tier as usize))
            .filter_map(|tq| tq.tenants.get(slot))
            .map(|t| t.served_at(self.now, self.decay))
            .sum()
    }

    /// Takes a queued request out wherever it waits (a cancellation).
    pub fn remove(&mut self, id: ReqId) -> Option<Waiting> {
        let (key, tier, slot, pos) = self.locate(id)?;
        self.remove_at(key, tier, slot, pos)
    }

    /// Gives back fair-share service charged for output tokens that were
    /// never produced (a request cancelled, or finished short of the
    /// output it was charged for at dispatch).
    pub fn refund(&mut self, g: &DecisionGraph, cfg: &Config, w: &Waiting, unused_output: u32) {
        if unused_output == 0 {
            return;
        }
        let weight = w
            .tenant
            .and_then(|t| g.tenants.get(t as usize))
            .map_or(1.0, |t| t.weight.max(1e-9));
        let cost = cfg.vtc_output_weight * f64::from(unused_output) / weight;
        let slot = w.tenant.map_or(0, |t| t as usize + 1);
        let (now, decay) = (self.now, self.decay);
        if let Some(t) = self
            .by_variant
            .get_mut(&(w.model, w.variant))
            .and_then(|tiers| tiers.get_mut(w.tier as usize))
            .and_then(|tq| tq.tenants.get_mut(slot))
        {
            t.served = (t.served_at(now, decay) - cost).max(0.0);
            t.at = now;
        }
    }

    /// Per (tier, tenant): requests queued and parked, the earliest
    /// arrival queued, and weighted service (summed over routed variants).
    /// Only pairs with something waiting or some service are listed, in
    /// tier order and then tenant order (no tenant first).
    pub fn stats(&self) -> Vec<QueueStat> {
        use std::collections::BTreeMap;
        fn row(
            rows: &mut BTreeMap<(usize, usize), QueueStat>,
            ti: usize,
            si: usize,
        ) -> &mut QueueStat {
            rows.entry((ti, si)).or_insert_with(|| QueueStat {
                tier: ti as TierId,
                tenant: si.checked_sub(1).map(|t| t as TenantId),
                depth: 0,
                parked: 0,
                oldest: None,
                served: 0.0,
            })
        }
        let mut rows: BTreeMap<(usize, usize), QueueStat> = BTreeMap::new();
        for tiers in self.by_variant.values() {
            for (ti, tq) in tiers.iter().enumerate() {
                for (si, t) in tq.tenants.iter().enumerate() {
                    let served = t.served_at(self.now, self.decay);
                    if t.q.is_empty() && served <= 0.0 {
                        continue;
                    }
                    let r = row(&mut rows, ti, si);
                    r.depth += t.q.len();
                    r.served += served;
                    if let Some(a) = t.q.iter().map(|w| w.arrival).min() {
                        r.oldest = Some(r.oldest.map_or(a, |o| o.min(a)));
                    }
                }
            }
        }
        for w in self.parked.values() {
            row(
                &mut rows,
                w.tier as usize,
                w.tenant.map_or(0, |t| t as usize + 1),
            )
            .parked += 1;
        }
        rows.into_values().collect()
    }

    /// Rebuilds the queues for another graph (a policy swap). Each queued
    /// and parked request is remapped by `map`; those it cannot map, or
    /// that `servable` (asked after mapping) says no replica can run, are
    /// taken out and returned, sorted by id. Fair-share counters move with
    /// their (variant, tier, tenant); order within a tenant is kept.
    pub fn remap(
        &mut self,
        g: &DecisionGraph,
        cfg: &Config,
        map: &super::swap::Remap,
        servable: impl Fn(&Waiting) -> bool,
    ) -> Vec<Waiting> {
        let mut next = Queues::new(g, cfg);
        next.now = self.now;
        let old = std::mem::take(self);
        let mut dropped = Vec::new();
        let mut keys: Vec<(u16, u16)> = old.by_variant.keys().copied().collect();
        keys.sort_unstable();
        let mut old_by_variant = old.by_variant;
        for key in keys {
            let Some(tiers) = old_by_variant.remove(&key) else {
                continue;
            };
            let new_key = map.variant(key.0, key.1);
            for (ti, tq) in tiers.into_iter().enumerate() {
                let new_tier = map.tier(ti as TierId);
                for (si, t) in tq.tenants.into_iter().enumerate() {
                    let new_slot = match si.checked_sub(1) {
                        None => Some(0),
                        Some(tn) => map.tenant(tn as TenantId).map(|x| x as usize + 1),
                    };
                    // Back to front, each put at the head: order is kept
                    // and no fair-share lift applies.
                    for mut w in t.q.into_iter().rev() {
                        if map.waiting(&mut w, g, false) && servable(&w) {
                            next.push_front(w);
                        } else {
                            dropped.push(w);
                        }
                    }
                    if let (Some(k), Some(nt), Some(ns)) = (new_key, new_tier, new_slot) {
                        if let Some(c) = next
                            .tiers_for(k)
                            .get_mut(nt as usize)
                            .and_then(|tq| tq.tenants.get_mut(ns))
                        {
                            c.served = t.served;
                            c.at = t.at;
                        }
                    }
                }
            }
        }
        for (_, mut w) in old.parked {
            if map.waiting(&mut w, g, false) && servable(&w) {
                next.park(w);
            } else {
                dropped.push(w);
            }
        }
        *self = next;
        dropped.sort_by_key(|w| w.id);
        dropped
    }

    /// Takes the next request for a replica of (model, variant) in `pool`.
    pub fn pick(
        &mut self,
        g: &DecisionGraph,
        cfg: &Config,
        now: Micros,
        slot: Slot,
    ) -> Option<Waiting> {
        let key = (slot.model, slot.variant);
        let tiers = self.by_variant.get(&key)?;
        let fits = |w: &Waiting| {
            w.pool.is_none_or(|p| p == slot.pool)
                && (slot.allow_backfill || !w.backfill)
                && slot.only_tier.is_none_or(|t| t == w.tier)
                && w.affinity
                    .is_none_or(|r| r == slot.replica || now >= w.pin_until)
        };
        // (tier, slot, pos) of the chosen request
        let mut best: Option<(PickKey, usize, usize, usize)> = None;
        for (ti, tq) in tiers.iter().enumerate() {
            if tq.len == 0 {
                continue;
            }
            for (si, t) in tq.tenants.iter().enumerate() {
                let Some(pos) = t.q.iter().position(fits) else {
                    continue;
                };
                let w = &t.q[pos];
                let prio = g.tiers.get(ti).map_or(i64::MIN, |t| t.priority);
                let age = now.saturating_sub(w.arrival);
                // Lower key wins.
                let key = match cfg.mode {
                    Mode::Fifo | Mode::Static => (0, 0, 0.0, w.arrival, w.id),
                    Mode::Priority => (-prio, 0, 0.0, w.arrival, w.id),
                    Mode::Kiln => {
                        let boost =
                            self.aging.get(ti).copied().flatten().map_or(0, |a| age / a) as i64;
                        // Deadline work whose window is nearly spent (the
                        // last tenth) goes earliest deadline first, ahead of
                        // fair share; the rest of the tier shares by VTC.
                        let urgent = match (w.deadline, self.window_len.get(ti).copied().flatten())
                        {
                            (Some(d), Some(len)) => d.saturating_sub(now) <= len / 10,
                            _ => false,
                        };
                        (
                            -(prio + boost),
                            ti as u64 * 2 + u64::from(!urgent),
                            if urgent {
                                w.deadline.unwrap_or(w.arrival) as f64
                            } else {
                                t.served_at(now, self.decay)
                            },
                            w.deadline.unwrap_or(w.arrival),
                            w.id,
                        )
                    }
                };
                if best.as_ref().is_none_or(|(k, ..)| lt(&key, k)) {
                    best = Some((key, ti, si, pos));
                }
            }
        }
        let (_, ti, si, pos) = best?;
        self.remove_at(key, ti, si, pos)
    }
}

/// Lower is served first: (negated effective priority, tier and urgency,
/// weighted service or, when urgent, the deadline, deadline or arrival, id).
type PickKey = (i64, u64, f64, Micros, Micros);

fn lt(a: &PickKey, b: &PickKey) -> bool {
    (a.0, a.1)
        .cmp(&(b.0, b.1))
        .then(a.2.total_cmp(&b.2))
        .then((a.3, a.4).cmp(&(b.3, b.4)))
        .is_lt()
}

#[cfg(test)]
mod tests {
    use super::super::swap::Remap;
    use super::super::testkit::{graph, waiting, BASE};
    use super::*;

    fn queues(g: &DecisionGraph) -> Queues {
        Queues::new(g, &Config::default())
    }

    #[test]
    fn remove_takes_a_request_out_wherever_it_waits() {
        let g = graph(BASE);
        let mut q = queues(&g);
        let cfg = Config::default();
        for id in 0..3 {
            let mut w = waiting(id, 1, Some(1));
            w.expires = Some(100);
            q.push(w, &cfg);
        }
        assert_eq!(q.remove(1).map(|w| w.id), Some(1));
        assert_eq!(q.remove(1), None);
        assert_eq!(q.len(), 2);
        assert_eq!(q.tokens_at_or_above(&g, 1), 30);
        let expired: Vec<_> = q.take_expired(100).into_iter().map(|w| w.id).collect();
        assert_eq!(expired, vec![0, 2]);
    }

    #[test]
    fn refund_gives_back_service_never_received() {
        let g = graph(BASE);
        let cfg = Config {
            fairness_window: None,
            ..Config::default()
        };
        let mut q = Queues::new(&g, &cfg);
        let w = waiting(0, 1, Some(1));
        q.push(w.clone(), &cfg);
        let w = q
            .pick(
                &g,
                &cfg,
                0,
                Slot {
                    replica: 0,
                    model: 0,
                    variant: 0,
                    pool: 0,
                    only_tier: None,
                    allow_backfill: true,
                },
            )
            .unwrap();
        q.charge(&g, &cfg, &w);
        // 10 prompt x 1 + 5 output x 2.
        assert_eq!(q.served(1, Some(1)), 20.0);
        q.refund(&g, &cfg, &w, 3);
        assert_eq!(q.served(1, Some(1)), 14.0);
        q.refund(&g, &cfg, &w, 1000);
        assert_eq!(q.served(1, Some(1)), 0.0, "never below zero");
    }

    #[test]
    fn stats_list_each_tier_and_tenant_in_order() {
        let g = graph(BASE);
        let cfg = Config::default();
        let mut q = queues(&g);
        q.push(waiting(5, 1, Some(1)), &cfg);
        q.push(waiting(3, 1, Some(1)), &cfg);
        q.push(waiting(4, 0, None), &cfg);
        q.park(waiting(6, 0, Some(0)));
        let st = q.stats();
        let keys: Vec<_> = st
            .iter()
            .map(|s| (s.tier, s.tenant, s.depth, s.parked))
            .collect();
        assert_eq!(
            keys,
            vec![(0, None, 1, 0), (0, Some(0), 0, 1), (1, Some(1), 2, 0)]
        );
        assert_eq!(st[2].oldest, Some(3));
    }

    #[test]
    fn remap_keeps_order_and_fair_share_by_name() {
        let g = graph(BASE);
        let cfg = Config {
            fairness_window: None,
            ..Config::default()
        };
        let mut q = Queues::new(&g, &cfg);
        // Service for bulk in lo on m.fp16, then three queued in order.
        let mut first = waiting(0, 1, Some(1));
        first.output_tokens = 50;
        q.push(waiting(0, 1, Some(1)), &cfg);
        q.charge(&g, &cfg, &first);
        for id in [9, 2, 7] {
            q.push(waiting(id, 1, Some(1)), &cfg);
        }
        q.park(waiting(8, 0, Some(0)));
        assert_eq!(q.served(1, Some(1)), 110.0);
        // Swap to a version with tiers and tenants in another order.
        let g2 = graph(&BASE.replace(
            "tier hi { priority 100 slo { ttft 10s } preempts [lo] }\ntier lo { priority 10 slo { window 1h } preemptible }",
            "tier lo { priority 10 slo { window 1h } preemptible }\ntier hi { priority 100 slo { ttft 10s } preempts [lo] }",
        ));
        let map = Remap::new(&g, &g2);
        assert_eq!(map.tiers, vec![Some(1), Some(0)]);
        let dropped = q.remap(&g2, &cfg, &map, |w| w.id != 2);
        assert_eq!(dropped.iter().map(|w| w.id).collect::<Vec<_>>(), vec![2]);
        assert_eq!(q.len(), 3);
        assert_eq!(q.parked(), 1);
        assert_eq!(q.served(0, Some(1)), 110.0, "bulk's counter, lo now tier 0");
        assert_eq!(q.served(1, Some(1)), 0.0);
        let slot = Slot {
            replica: 0,
            model: 0,
            variant: 0,
            pool: 0,
            only_tier: None,
            allow_backfill: true,
        };
        let order: Vec<_> =
            std::iter::from_fn(|| q.pick(&g2, &cfg, 0, slot).map(|w| w.id)).collect();
        assert_eq!(order, vec![0, 9, 7]);
        assert_eq!(q.unpark(8).map(|w| w.tier), Some(1));
    }
}
