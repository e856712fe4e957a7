//! Waiting work, ordered three ways: tiers by priority plus aging; tenants
//! within a tier by weighted service received (the Virtual Token Counter of
//! Sheng et al., OSDI'24: the backlogged tenant that has been served least,
//! per unit of weight, goes next); requests within a tenant by arrival, or
//! earliest deadline first in tiers with a completion window (and, in any
//! tier, deadline work in the last tenth of its own window goes earliest
//! deadline first ahead of fair share). Baseline modes
//! replace the first two with plain FIFO or strict priority.
//!
//! Aging raises a *tier* against other tiers (by the age of its oldest
//! waiting request); it never reorders tenants inside a tier, where only
//! the fair-share counter decides.
//!
//! Every structure is indexed so that the cost of an event does not grow
//! with the backlog: each tenant's requests sit in ordered maps (one for
//! work any replica may take, one per replica or pool it is pinned to),
//! backlogged tenants in a set ordered by their counters, deadlines and
//! expiries in ordered sets, and every request in an index by id. A pick
//! costs O(tiers + tenants skipped + log n), never a scan of the queue.

use super::{Config, Micros, Mode, ReqId};
use crate::graph::{DecisionGraph, PoolId, TenantId, TierId};
use rustc_hash::FxHashMap as HashMap;
use std::collections::{BTreeMap, BTreeSet};

/// A request waiting to start (or to resume, after a preemption).
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    pub id: ReqId,
    pub tier: TierId,
    pub tenant: Option<TenantId>,
    pub arrival: Micros,
    /// Completion deadline (arrival + its own window, a batch item's, or
    /// else its tier's), if any.
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
    /// The wait admission estimated for it (to learn how far off
    /// estimates run), if it estimated one, and whether it was first in
    /// fair order then (the two kinds are learnt apart).
    pub est_start: Option<(Micros, bool)>,
    pub preemptions: u32,
    pub backfill: bool,
    /// Its reservation used tokens borrowed from the cohort: lenders may
    /// reclaim the capacity by preempting it (when its tier is preemptible).
    pub borrowed: bool,
    /// Why it is waiting, for "why did my request wait".
    pub waiting_for: Option<super::Reason>,
    /// GPU time used before a preemption (it counts toward cost).
    pub gpu_seconds: f64,
    /// The part of `gpu_seconds` that served nothing: an upstream's
    /// preempted attempts, and recomputing KV lost to a preemption.
    pub wasted_gpu_seconds: f64,
    /// Tokens whose KV it had computed when it was last taken off a
    /// replica: recomputing them when it resumes is wasted GPU time.
    pub redo_tokens: u32,
    /// Which of its quotas a fleet claimed (and charges its GPU-seconds
    /// to): the others' GPU-seconds are reported from here.
    pub claims: super::quota::Claims,
    /// It has run on a replica at least once (so its prompt was served).
    pub started: bool,
    /// A policy swap removed its tier while it ran: it finishes under a
    /// stand-in tier and is never preempted.
    pub orphan: bool,
    /// Its batch marked its items preemptible (`kiln_preemptible`): it is
    /// preemptible whatever its tier says.
    pub preemptible_item: bool,
    /// Admitted late on an idle replica though it could not meet its TTFT
    /// SLO (see `sched::admit`): never shed for being late.
    pub best_effort: bool,
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
/// replica may take it (when routing gives no hold of its own).
pub const AFFINITY_HOLD: Micros = 50_000;

impl Waiting {
    /// Whether its running work may be preempted: its tier says so, or its
    /// batch marked its items so.
    pub fn preemptible(&self, graph: &DecisionGraph) -> bool {
        self.preemptible_item
            || graph
                .tiers
                .get(self.tier as usize)
                .is_some_and(|t| t.preemptible)
    }

    pub fn tokens(&self) -> u64 {
        u64::from(self.prompt_tokens)
            + u64::from(self.output_tokens - self.generated.min(self.output_tokens))
    }

    /// When its window is nearly spent (the last tenth of its own span,
    /// arrival to deadline): from then on it is urgent.
    fn urgent_from(&self) -> Option<Micros> {
        self.deadline
            .map(|d| d.saturating_sub(d.saturating_sub(self.arrival) / 10))
    }

    /// Whether replica `slot` may take it now.
    fn fits(&self, slot: &Slot, now: Micros) -> bool {
        self.pool.is_none_or(|p| p == slot.pool)
            && self
                .affinity
                .is_none_or(|r| r == slot.replica || now >= self.pin_until)
    }
}

/// Where a request sits in its tenant's queue, lowest first: requests put
/// back (after a preemption: the latest first), then by deadline in
/// completion-window tiers or by arrival order elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Order {
    band: u8,
    key: u64,
    /// Ties keep the order they were queued in.
    seq: u64,
    id: ReqId,
}

/// Which of a tenant's maps holds a request: work any replica (of its
/// pool) may take, or work pinned to one replica for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Home {
    Free,
    Pool(PoolId),
    Replica(usize),
}

/// An f64 with a total order, for ordered sets of counters.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ordered(f64);

impl Eq for Ordered {}

impl PartialOrd for Ordered {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ordered {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Default)]
struct TenantQueue {
    maps: HashMap<Home, BTreeMap<Order, Waiting>>,
    len: usize,
    tokens: u64,
    /// Fair-share cost of what waits (weighted tokens, before dividing by
    /// the tenant's weight), for position estimates.
    cost: f64,
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

    /// A key that orders tenants as their counters do at any later time:
    /// decay multiplies every counter by the same factor, so the order of
    /// `ln(served) + at / window` never changes as time passes.
    fn rank(&self, decay: Option<Micros>) -> Ordered {
        match decay {
            Some(w) if self.served > 0.0 => Ordered(self.served.ln() + self.at as f64 / w as f64),
            Some(_) => Ordered(f64::NEG_INFINITY),
            None => Ordered(self.served),
        }
    }

    /// Its first request replica `slot` may take now.
    fn head_for(&self, slot: &Slot, now: Micros) -> Option<(&Order, &Waiting)> {
        [
            Home::Free,
            Home::Pool(slot.pool),
            Home::Replica(slot.replica),
        ]
        .iter()
        .filter_map(|h| self.maps.get(h))
        .filter_map(|m| m.iter().find(|(_, w)| w.fits(slot, now)))
        .min_by_key(|(o, _)| **o)
    }
}

#[derive(Debug, Default)]
struct TierQueue {
    /// Index 0 is "no tenant"; tenant `t` is at `t + 1`.
    tenants: Vec<TenantQueue>,
    /// Tenants with work waiting, least served first.
    backlog: BTreeSet<(Ordered, usize)>,
    /// Every waiting request by arrival (aging, oldest wait).
    arrivals: BTreeSet<(Micros, ReqId)>,
    /// Requests in the last tenth of their completion window (urgent),
    /// earliest deadline first. Those not yet urgent wait in
    /// [`Queues::urgency`] and move here when they become so.
    deadlines: BTreeSet<(Micros, ReqId)>,
    len: usize,
    tokens: u64,
}

/// Where a queued request is, for removal by id.
#[derive(Debug, Clone, Copy)]
struct Loc {
    key: (u16, u16),
    tier: usize,
    slot: usize,
    home: Home,
    order: Order,
}

/// What every idle tenant's credit on one queue is made of
/// ([`Queues::credit_basis`]).
#[derive(Debug, Clone, Copy)]
struct CreditBasis {
    /// The tier's recent cost rate times the credit span.
    cost: f64,
    /// The weight of its backlogged tenants.
    backlog_weight: f64,
}

/// A returning tenant's credit, as a share of its tier's fair-share window
/// ([`Queues::credit`]).
pub const CREDIT_PER_WINDOW: f64 = 1.0 / 60.0;

/// What is ordered ahead of a new request, for its wait estimate.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ahead {
    /// Tokens (prompt plus output still to make) that will start first.
    pub tokens: f64,
    /// Whether its tenant is above its fair share of the tier: other
    /// backlogged tenants have received less weighted service.
    pub above_share: bool,
}

#[derive(Debug, Default)]
pub struct Queues {
    /// Per routed (model, variant): per tier.
    by_variant: HashMap<(u16, u16), Vec<TierQueue>>,
    index: HashMap<ReqId, Loc>,
    tiers: usize,
    tenants: usize,
    len: usize,
    non_backfill: HashMap<(u16, u16), usize>,
    tier_tokens: Vec<u64>,
    /// Requests queued per tier, and per (model, variant, pool routed to),
    /// for the `tier(T).queued` and `pool(P).queued` signals.
    tier_len: Vec<usize>,
    route_len: HashMap<((u16, u16), Option<PoolId>), usize>,
    expiries: BTreeSet<(Micros, ReqId)>,
    /// Soft pins to a replica, by when they lapse.
    pins: BTreeSet<(Micros, ReqId)>,
    parked: HashMap<ReqId, Waiting>,
    aging: Vec<Option<Micros>>,
    /// Tiers the policy holds out of dispatch ([`super::hold`]).
    held: Vec<bool>,
    /// Fair-share weight by tenant slot (0: no tenant).
    weights: Vec<f64>,
    /// Tokens per second each (model, variant) has lately started
    /// ([`Queues::set_rate`]), to turn a credit in seconds into service.
    rates: HashMap<(u16, u16), f64>,
    priority: Vec<i64>,
    /// Backfill-only tiers (they take only capacity nothing else wants).
    backfill: Vec<bool>,
    windowed: Vec<bool>,
    /// Deadline work not yet urgent, by when it becomes so (each request's
    /// own window: see [`Waiting::urgent_from`]); [`Queues::set_now`]
    /// moves it into its tier's `deadlines`.
    urgency: BTreeSet<(Micros, ReqId)>,
    decay: Option<Micros>,
    /// Per tier: its own fair-share window (`fair_share { window }`), or
    /// `decay`. Tenants are only ever compared within a tier, so each
    /// tier's counters may decay at their own rate.
    decays: Vec<Option<Micros>>,
    vtc: (f64, f64),
    /// Put-back and push counters for [`Order`].
    fronts: u64,
    backs: u64,
    now: Micros,
    /// Service charged (net of refunds) per ((model, variant), tier,
    /// tenant slot) since [`Queues::take_service`] last took it: what a
    /// replica of a fleet adds to the fleet's counters. `None` alone.
    shared: Option<HashMap<ShareKey, f64>>,
}

/// (model, variant), tier, tenant slot.
type ShareKey = ((u16, u16), usize, usize);

/// Tenants with requests waiting, and how many.
pub type Backlog = Vec<(Option<TenantId>, usize)>;

/// A queue: its (model, variant) and tier.
pub type QueueKey = ((u16, u16), TierId);

/// One queue's fair-share counter, by (model, variant), tier and tenant
/// (`None`: requests without one), as a fleet shares it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceCount {
    pub key: (u16, u16),
    pub tier: TierId,
    pub tenant: Option<TenantId>,
    pub service: f64,
}

impl Queues {
    pub fn new(g: &DecisionGraph, cfg: &Config) -> Queues {
        Queues {
            tiers: g.tiers.len(),
            tenants: g.tenants.len(),
            tier_tokens: vec![0; g.tiers.len()],
            tier_len: vec![0; g.tiers.len()],
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
            priority: g.tiers.iter().map(|t| t.priority).collect(),
            backfill: g.tiers.iter().map(|t| t.backfill_only).collect(),
            windowed: g.tiers.iter().map(|t| t.slo.window.is_some()).collect(),
            decay: cfg.fairness_window,
            decays: g
                .tiers
                .iter()
                .map(|t| {
                    t.fair_share_window
                        .map(|ms| ((ms * 1000.0) as Micros).max(1))
                        .or(cfg.fairness_window)
                })
                .collect(),
            vtc: (cfg.vtc_input_weight, cfg.vtc_output_weight),
            weights: std::iter::once(1.0)
                .chain(g.tenants.iter().map(|t| t.weight.max(1e-9)))
                .collect(),
            ..Queues::default()
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Requests of tier `t` queued now.
    pub fn tier_len(&self, t: TierId) -> usize {
        self.tier_len.get(t as usize).copied().unwrap_or(0)
    }

    /// Requests queued now per (model, variant) and the pool their route
    /// named (`None`: any pool hosting the variant).
    pub fn route_lens(&self) -> impl Iterator<Item = (&((u16, u16), Option<PoolId>), &usize)> {
        self.route_len.iter()
    }

    /// The fair-share decay window of tier `tier`, µs (`None`: no decay).
    pub fn decay(&self, tier: TierId) -> Option<Micros> {
        self.decay_of(tier as usize)
    }

    /// (model, variant) and tier of every queue with work waiting.
    pub fn active(&self) -> Vec<QueueKey> {
        let mut out: Vec<QueueKey> = self
            .by_variant
            .iter()
            .flat_map(|(k, tiers)| {
                tiers
                    .iter()
                    .enumerate()
                    .filter(|(_, tq)| tq.len > 0)
                    .map(move |(ti, _)| (*k, ti as TierId))
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// The fair-share decay window of tier `tier` (see `decays`).
    fn decay_of(&self, tier: usize) -> Option<Micros> {
        self.decays.get(tier).copied().unwrap_or(self.decay)
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
                    ..TierQueue::default()
                })
                .collect()
        })
    }

    /// Sets the clock used for fairness decay and pin holds; soft pins
    /// whose hold has lapsed are released to any replica.
    pub fn set_now(&mut self, now: Micros) {
        self.now = now;
        while let Some(&(t, id)) = self.pins.first() {
            if t > now {
                break;
            }
            self.pins.pop_first();
            let order = self.index.get(&id).map(|l| l.order);
            if let (Some(order), Some(w)) = (order, self.take(id)) {
                self.insert_ordered(w, order, false);
            }
        }
        // Deadline work whose window is nearly spent becomes urgent.
        while let Some(&(t, id)) = self.urgency.first() {
            if t > now {
                break;
            }
            self.urgency.pop_first();
            let Some(loc) = self.index.get(&id).copied() else {
                continue;
            };
            let Some(tq) = self
                .by_variant
                .get_mut(&loc.key)
                .and_then(|t| t.get_mut(loc.tier))
            else {
                continue;
            };
            let deadline = tq
                .tenants
                .get(loc.slot)
                .and_then(|t| t.maps.get(&loc.home))
                .and_then(|m| m.get(&loc.order))
                .and_then(|w| w.deadline);
            if let Some(d) = deadline {
                tq.deadlines.insert((d, id));
            }
        }
    }

    /// Fair-share cost of a request's remaining work, before its weight.
    fn cost_of(&self, w: &Waiting) -> f64 {
        self.vtc.0 * f64::from(w.prompt_tokens)
            + self.vtc.1 * f64::from(w.output_tokens.saturating_sub(w.generated))
    }

    /// Adds a new request at the back of its tenant's queue (or in deadline
    /// order for windowed tiers).
    pub fn push(&mut self, w: Waiting, cfg: &Config) {
        let _ = cfg;
        self.insert_at(w, false);
    }

    /// Puts a request back where it was: at the head of its tenant's queue.
    pub fn push_front(&mut self, w: Waiting) {
        self.insert_at(w, true);
    }

    /// `front` puts it back at the head; otherwise it joins as new.
    fn insert_at(&mut self, w: Waiting, front: bool) {
        let order = if front {
            self.fronts += 1;
            Order {
                band: 0,
                key: u64::MAX - self.fronts,
                seq: 0,
                id: w.id,
            }
        } else {
            let windowed = self.windowed.get(w.tier as usize).copied().unwrap_or(false);
            self.backs += 1;
            let key = if windowed {
                w.deadline.unwrap_or(Micros::MAX)
            } else {
                self.backs
            };
            Order {
                band: 1,
                key,
                seq: self.backs,
                id: w.id,
            }
        };
        self.insert_ordered(w, order, !front);
    }

    fn insert_ordered(&mut self, w: Waiting, order: Order, lift: bool) {
        let key = (w.model, w.variant);
        let (tier, slot) = (w.tier as usize, w.tenant.map_or(0, |t| t as usize + 1));
        let tokens = w.tokens();
        let cost = self.cost_of(&w);
        let home = match (w.affinity, w.pool) {
            (Some(r), _) if self.now < w.pin_until => Home::Replica(r),
            (_, Some(p)) => Home::Pool(p),
            _ => Home::Free,
        };
        if tier >= self.tiers || slot > self.tenants {
            return; // not of this graph; never happens after a remap
        }
        if let Some(e) = w.expires {
            self.expiries.insert((e, w.id));
        }
        let urgent = w.urgent_from().is_some_and(|u| u <= self.now);
        if let (Some(u), false) = (w.urgent_from(), urgent) {
            self.urgency.insert((u, w.id));
        }
        if let (Home::Replica(_), true) = (home, w.pin_until < Micros::MAX) {
            self.pins.insert((w.pin_until, w.id));
        }
        if !w.backfill {
            *self.non_backfill.entry(key).or_default() += 1;
        }
        self.len += 1;
        if let Some(t) = self.tier_tokens.get_mut(tier) {
            *t += tokens;
        }
        if let Some(t) = self.tier_len.get_mut(tier) {
            *t += 1;
        }
        *self.route_len.entry((key, w.pool)).or_default() += 1;
        self.index.insert(
            w.id,
            Loc {
                key,
                tier,
                slot,
                home,
                order,
            },
        );
        let (now, decay) = (self.now, self.decay_of(tier));
        let Some(was_idle) = self
            .tiers_for(key)
            .get(tier)
            .map(|tq| tq.tenants.get(slot).is_some_and(|t| t.len == 0))
        else {
            return;
        };
        let credit = if was_idle {
            self.credit(self.credit_basis(key, tier), slot)
        } else {
            0.0
        };
        let tiers = self.by_variant.get_mut(&key);
        let Some(tq) = tiers.and_then(|t| t.get_mut(tier)) else {
            return;
        };
        if was_idle {
            // VTC lift: a tenant that becomes backlogged starts no lower than
            // the least-served backlogged tenant less its bounded credit
            // ([`Queues::credit`]), so idling banks little.
            // (Not when a request is put back: that tenant never left.)
            let floor = tq
                .backlog
                .first()
                .and_then(|&(_, s)| tq.tenants.get(s))
                .map(|t| t.served_at(now, decay));
            if let Some(t) = tq.tenants.get_mut(slot) {
                if lift {
                    let mine = t.served_at(now, decay);
                    t.served = floor.map_or(mine, |f| mine.max(f - credit));
                    t.at = now;
                }
                tq.backlog.insert((t.rank(decay), slot));
            }
        }
        tq.len += 1;
        tq.tokens += tokens;
        tq.arrivals.insert((w.arrival, w.id));
        if let (Some(d), true) = (w.deadline, urgent) {
            tq.deadlines.insert((d, w.id));
        }
        if let Some(t) = tq.tenants.get_mut(slot) {
            t.len += 1;
            t.tokens += tokens;
            t.cost += cost;
            t.maps.entry(home).or_default().insert(order, w);
        }
    }

    /// Takes request `id` out of the queues, wherever it waits.
    fn take(&mut self, id: ReqId) -> Option<Waiting> {
        let loc = self.index.remove(&id)?;
        let decay = self.decay_of(loc.tier);
        let tq = self.by_variant.get_mut(&loc.key)?.get_mut(loc.tier)?;
        let t = tq.tenants.get_mut(loc.slot)?;
        let map = t.maps.get_mut(&loc.home)?;
        let w = map.remove(&loc.order)?;
        if map.is_empty() {
            t.maps.remove(&loc.home);
        }
        let tokens = w.tokens();
        let cost = self.vtc.0 * f64::from(w.prompt_tokens)
            + self.vtc.1 * f64::from(w.output_tokens.saturating_sub(w.generated));
        let rank = t.rank(decay);
        t.len -= 1;
        t.tokens -= tokens;
        t.cost = if t.len == 0 { 0.0 } else { t.cost - cost };
        if t.len == 0 {
            tq.backlog.remove(&(rank, loc.slot));
        }
        tq.len -= 1;
        tq.tokens -= tokens;
        tq.arrivals.remove(&(w.arrival, w.id));
        if let Some(d) = w.deadline {
            tq.deadlines.remove(&(d, w.id));
        }
        self.len -= 1;
        if let Some(t) = self.tier_tokens.get_mut(loc.tier) {
            *t -= tokens;
        }
        if let Some(t) = self.tier_len.get_mut(loc.tier) {
            *t = t.saturating_sub(1);
        }
        if let Some(n) = self.route_len.get_mut(&(loc.key, w.pool)) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.route_len.remove(&(loc.key, w.pool));
            }
        }
        if !w.backfill {
            if let Some(n) = self.non_backfill.get_mut(&loc.key) {
                *n -= 1;
            }
        }
        if let Some(e) = w.expires {
            self.expiries.remove(&(e, w.id));
        }
        if let Some(u) = w.urgent_from() {
            self.urgency.remove(&(u, w.id));
        }
        self.pins.remove(&(w.pin_until, w.id));
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
            for (ti, tq) in tiers
                .iter()
                .enumerate()
                .filter(|(_, tq)| tq.backlog.len() > 1)
            {
                let value = |e: Option<&(Ordered, usize)>| {
                    e.and_then(|&(_, s)| tq.tenants.get(s))
                        .map_or(0.0, |t| t.served_at(self.now, self.decay_of(ti)))
                };
                gap = gap.max(value(tq.backlog.last()) - value(tq.backlog.first()));
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
                tq.backlog.len() > 1 || tq.backlog.first().is_some_and(|&(_, s)| s != slot)
            })
        })
    }

    /// How long the oldest queued request of a tier has waited.
    pub fn oldest_wait(&self, tier: TierId, now: Micros) -> Micros {
        let oldest = self
            .by_variant
            .values()
            .filter_map(|tiers| tiers.get(tier as usize))
            .filter_map(|tq| tq.arrivals.first().map(|(a, _)| *a))
            .min()
            .unwrap_or(now);
        now.saturating_sub(oldest)
    }

    pub fn next_expiry(&self) -> Option<Micros> {
        let expiry = self.expiries.first().map(|(t, _)| *t);
        let pin = self.pins.first().map(|(t, _)| *t);
        match (expiry, pin) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Removes every request whose max wait has passed.
    pub fn take_expired(&mut self, now: Micros) -> Vec<Waiting> {
        let mut out = Vec::new();
        while let Some(&(t, id)) = self.expiries.first() {
            if t > now {
                break;
            }
            self.expiries.pop_first();
            if let Some(mut w) = self.take(id) {
                w.expires = None;
                out.push(w);
            }
        }
        out
    }

    fn weight(g: &DecisionGraph, tenant: Option<TenantId>) -> f64 {
        tenant
            .and_then(|t| g.tenants.get(t as usize))
            .map_or(1.0, |t| t.weight.max(1e-9))
    }

    /// Moves a tenant's counter to `served` (as of now), keeping the
    /// backlog set in order.
    fn set_served(&mut self, w: &Waiting, f: impl FnOnce(f64) -> f64) {
        let slot = w.tenant.map_or(0, |t| t as usize + 1);
        let delta = self.set_served_at((w.model, w.variant), w.tier as usize, slot, f);
        if let (Some(m), Some(d)) = (self.shared.as_mut(), delta) {
            *m.entry(((w.model, w.variant), w.tier as usize, slot))
                .or_default() += d;
        }
    }

    /// [`Queues::set_served`] by key; the change it made.
    fn set_served_at(
        &mut self,
        key: (u16, u16),
        tier: usize,
        slot: usize,
        f: impl FnOnce(f64) -> f64,
    ) -> Option<f64> {
        let (now, decay) = (self.now, self.decay_of(tier));
        let tq = self.by_variant.get_mut(&key)?.get_mut(tier)?;
        let t = tq.tenants.get_mut(slot)?;
        let backlogged = tq.backlog.remove(&(t.rank(decay), slot));
        let before = t.served_at(now, decay);
        t.served = f(before);
        if !t.served.is_finite() || t.served < 0.0 {
            t.served = 0.0;
        }
        t.at = now;
        if backlogged {
            tq.backlog.insert((t.rank(decay), slot));
        }
        Some(t.served - before)
    }

    /// Starts counting the service charged here for a fleet's counters.
    pub fn share_service(&mut self) {
        self.shared.get_or_insert_with(HashMap::default);
    }

    /// The service charged since the last call, per queue and tenant.
    pub fn take_service(&mut self) -> Vec<ServiceCount> {
        let Some(m) = self.shared.as_mut() else {
            return Vec::new();
        };
        let mut out: Vec<ServiceCount> = m
            .drain()
            .filter(|(_, d)| *d != 0.0)
            .map(|((key, tier, slot), service)| ServiceCount {
                key,
                tier: tier as TierId,
                tenant: slot.checked_sub(1).map(|t| t as TenantId),
                service,
            })
            .collect();
        // Deterministic order (the map's is not).
        out.sort_by_key(|c| (c.key, c.tier, c.tenant));
        out
    }

    /// Sets a counter to the fleet's value, plus what was charged here
    /// since that value was taken (not yet in it).
    pub fn set_service(&mut self, c: &ServiceCount) {
        let (tier, slot) = (c.tier as usize, c.tenant.map_or(0, |t| t as usize + 1));
        if tier >= self.tiers || slot > self.tenants || !c.service.is_finite() {
            return;
        }
        let pending = self
            .shared
            .as_ref()
            .and_then(|m| m.get(&(c.key, tier, slot)))
            .copied()
            .unwrap_or(0.0);
        self.tiers_for(c.key);
        let total = c.service.max(0.0) + pending;
        self.set_served_at(c.key, tier, slot, |_| total);
    }

    /// Tenants with work queued for (model, variant) and how much (any
    /// tier): what a fleet splits a shared upstream's slots by.
    pub fn backlog_of(&self, key: (u16, u16)) -> Backlog {
        // Only the backlogged tenants of each tier: the exchange runs every
        // 25 ms on the executor, and most tenants of a big policy are idle.
        let mut per: std::collections::BTreeMap<usize, usize> = Default::default();
        for tq in self.by_variant.get(&key).into_iter().flatten() {
            for &(_, slot) in &tq.backlog {
                if let Some(t) = tq.tenants.get(slot) {
                    *per.entry(slot).or_default() += t.len;
                }
            }
        }
        per.into_iter()
            .map(|(slot, n)| (slot.checked_sub(1).map(|t| t as TenantId), n))
            .collect()
    }

    /// Charges a dispatched request's service to its tenant (weighted
    /// prompt and output tokens, divided by the tenant's fair-share weight).
    pub fn charge(&mut self, g: &DecisionGraph, cfg: &Config, w: &Waiting) {
        let weight = Self::weight(g, w.tenant);
        let remaining_out = w.output_tokens.saturating_sub(w.generated);
        let cost = (cfg.vtc_input_weight * f64::from(w.prompt_tokens)
            + cfg.vtc_output_weight * f64::from(remaining_out))
            / weight;
        self.set_served(w, |s| s + cost);
    }

    /// Weighted service a tenant has received in a tier (for the fairness
    /// metric), summed over variants.
    pub fn served(&self, tier: TierId, tenant: Option<TenantId>) -> f64 {
        let slot = tenant.map_or(0, |t| t as usize + 1);
        self.by_variant
            .values()
            .filter_map(|tiers| tiers.get(tier as usize))
            .filter_map(|tq| tq.tenants.get(slot))
            .map(|t| t.served_at(self.now, self.decay_of(tier as usize)))
            .sum()
    }

    /// Takes a queued request out wherever it waits (a cancellation).
    pub fn remove(&mut self, id: ReqId) -> Option<Waiting> {
        self.take(id)
    }

    /// Gives back fair-share service charged for output tokens that were
    /// never produced (a request cancelled, or finished short of the
    /// output it was charged for at dispatch).
    pub fn refund(&mut self, g: &DecisionGraph, cfg: &Config, w: &Waiting, unused_output: u32) {
        if unused_output == 0 {
            return;
        }
        let cost = cfg.vtc_output_weight * f64::from(unused_output) / Self::weight(g, w.tenant);
        self.set_served(w, |s| (s - cost).max(0.0));
    }

    /// What would be served before a new request of `tier` and `tenant` on
    /// (model, variant), costing `cost` in fair-share terms, if it were
    /// queued now: queued work of tiers ranked ahead, all of its own
    /// tenant's queue, and of each other backlogged tenant of its tier the
    /// service it gets before this tenant's counter reaches the request
    /// (VTC serves the least-served tenant first, so tenant B goes ahead
    /// until its counter passes ours: `(ours - B's) x B's weight`, at most
    /// what B has queued plus what `incoming` says B will send meanwhile,
    /// as (fair-share cost, tokens), by tenant slot: 0 for no tenant,
    /// `t + 1` for tenant `t`). Under a baseline mode, the order is arrival
    /// (within the tiers the mode ranks ahead).
    #[allow(clippy::too_many_arguments)]
    pub fn ahead(
        &self,
        g: &DecisionGraph,
        cfg: &Config,
        key: (u16, u16),
        tier: TierId,
        tenant: Option<TenantId>,
        cost: f64,
        own: Option<(f64, f64)>,
        incoming: &dyn Fn(usize) -> (f64, f64),
    ) -> Ahead {
        let Some(tiers) = self.by_variant.get(&key) else {
            return Ahead::default();
        };
        let ti = tier as usize;
        let mine = self.tier_rank(cfg, tiers, ti);
        let mut out = Ahead::default();
        for (i, tq) in tiers.iter().enumerate() {
            // A held tier's work starts after this request, whatever its rank.
            if i == ti || tq.len == 0 || self.is_held(i as TierId) {
                continue;
            }
            if self.served_before(cfg, tiers, i, ti, mine) {
                out.tokens += tq.tokens as f64;
            }
        }
        let Some(tq) = tiers.get(ti) else {
            return out;
        };
        if cfg.mode != Mode::Kiln {
            out.tokens += tq.tokens as f64;
            return out;
        }
        let slot = tenant.map_or(0, |t| t as usize + 1);
        let (now, decay) = (self.now, self.decay_of(ti));
        let Some(me) = tq.tenants.get(slot) else {
            return out;
        };
        let floor = tq
            .backlog
            .first()
            .and_then(|&(_, s)| tq.tenants.get(s))
            .map(|t| t.served_at(now, decay));
        // Computed once: each idle tenant's credit is a division of it.
        let basis = self.credit_basis(key, ti);
        let mut counter = me.served_at(now, decay);
        if me.len == 0 {
            let credit = self.credit(basis, slot);
            counter = floor.map_or(counter, |f| counter.max(f - credit));
        }
        let mine = cost / Self::weight(g, tenant);
        // Above its share: another backlogged tenant has received less by
        // more than this one request would add.
        out.above_share = floor.is_some_and(|f| counter > f + mine + 1e-9);
        // Its own tenant's work queued before it: all of it for a new
        // request, what precedes it for one already queued.
        let (own_cost, own_tokens) = own.unwrap_or((me.cost, me.tokens as f64));
        // Its start tag: the tenant's counter once the work before it is
        // served. Others go first until their counters pass it. (Not its
        // finish tag: that counted a request's own size against its place,
        // so a low-weight tenant's long prompts were refused and its long
        // ones alone were not, and what it was served in requests drifted
        // from what it was served in tokens.)
        let reach = counter + own_cost.max(0.0) / Self::weight(g, tenant);
        out.tokens += own_tokens.max(0.0);
        for (s, b) in tq.tenants.iter().enumerate() {
            if s == slot {
                continue;
            }
            let w = Self::weight(g, s.checked_sub(1).map(|t| t as TenantId));
            let mut theirs = b.served_at(now, decay);
            if b.len == 0 {
                // Idle now: it is lifted to the floor (less its credit)
                // when it comes back.
                let credit = self.credit(basis, s);
                theirs = floor.map_or(theirs, |f| theirs.max(f - credit));
            }
            let gap = (reach - theirs).max(0.0) * w;
            if gap <= 0.0 {
                continue;
            }
            // What it has queued goes first, then what it will send while
            // this request waits, up to the service fair share allows it.
            let queued = gap.min(b.cost);
            if b.cost > 0.0 {
                out.tokens += queued / b.cost * b.tokens as f64;
            }
            let (fc, ft) = incoming(s);
            let later = (gap - queued).min(fc).max(0.0);
            if fc > 0.0 {
                out.tokens += later / fc * ft;
            }
        }
        out
    }

    /// The queued requests fair share would serve last in `tier` on (model,
    /// variant), at most `n`, last first: of each backlogged tenant its
    /// newest request, ordered by the tenant's *start tag* for it (its
    /// counter once the rest of its queue is served, in weighted service). What admission sheds first when
    /// the tier cannot serve everything in time: the first belongs to the
    /// tenant furthest above its weighted share, and shedding the newest
    /// keeps the choice blind to request size. Each comes with its tenant,
    /// and the fair-share cost and tokens of its tenant's work before it.
    /// Requests put back after a preemption are never chosen (they were
    /// started once).
    pub fn fair_tails(
        &self,
        g: &DecisionGraph,
        key: (u16, u16),
        tier: TierId,
        n: usize,
    ) -> Vec<(Option<TenantId>, ReqId, f64, f64)> {
        let ti = tier as usize;
        let Some(tq) = self.by_variant.get(&key).and_then(|t| t.get(ti)) else {
            return Vec::new();
        };
        let (now, decay) = (self.now, self.decay_of(ti));
        let mut all: Vec<(f64, Option<TenantId>, ReqId, f64, f64)> = Vec::new();
        for &(_, slot) in &tq.backlog {
            let Some(t) = tq.tenants.get(slot) else {
                continue;
            };
            let Some((order, w)) = t
                .maps
                .values()
                .filter_map(|m| m.iter().next_back())
                .max_by_key(|(o, _)| **o)
            else {
                continue;
            };
            if order.band == 0 || w.started {
                continue;
            }
            let tenant = slot.checked_sub(1).map(|x| x as TenantId);
            let before_cost = (t.cost - self.cost_of(w)).max(0.0);
            let before_tokens = t.tokens.saturating_sub(w.tokens()) as f64;
            let tag = t.served_at(now, decay) + before_cost / Self::weight(g, tenant);
            all.push((tag, tenant, w.id, before_cost, before_tokens));
        }
        // Highest start tag first (ties by request id: deterministic).
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.2.cmp(&a.2)));
        all.into_iter()
            .take(n)
            .map(|(_, t, id, c, k)| (t, id, c, k))
            .collect()
    }

    /// A queued request, by id (for its size and arrival).
    pub fn get(&self, id: ReqId) -> Option<&Waiting> {
        let loc = self.index.get(&id)?;
        self.by_variant
            .get(&loc.key)?
            .get(loc.tier)?
            .tenants
            .get(loc.slot)?
            .maps
            .get(&loc.home)?
            .get(&loc.order)
    }

    /// Per (tier, tenant): requests queued and parked, the earliest
    /// arrival queued, and weighted service (summed over routed variants).
    /// Only pairs with something waiting or some service are listed, in
    /// tier order and then tenant order (no tenant first). (A snapshot for
    /// operators: it reads every queued request.)
    pub fn stats(&self) -> Vec<QueueStat> {
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
                    let served = t.served_at(self.now, self.decay_of(ti));
                    if t.len == 0 && served <= 0.0 {
                        continue;
                    }
                    let r = row(&mut rows, ti, si);
                    r.depth += t.len;
                    r.served += served;
                    let oldest = t
                        .maps
                        .values()
                        .flat_map(|m| m.values())
                        .map(|w| w.arrival)
                        .min();
                    if let Some(a) = oldest {
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
        next.fronts = self.fronts;
        next.backs = self.backs;
        // Sharing goes on; service charged since the last sync under the
        // old ids (a tenth of a second's) is not carried over.
        next.shared = self.shared.as_ref().map(|_| HashMap::default());
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
                    // Counters first, so re-filed work finds them.
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
                    let mut items: Vec<(Order, Waiting)> =
                        t.maps.into_values().flat_map(|m| m.into_iter()).collect();
                    items.sort_by_key(|(o, _)| *o);
                    // In order, each keeping its place: no fair-share lift.
                    for (order, mut w) in items {
                        if map.waiting(&mut w, g, false) && servable(&w) {
                            next.insert_ordered(w, order, false);
                        } else {
                            dropped.push(w);
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
        let _ = g;
        let id = self.choose(cfg, now, &slot)?;
        self.take(id)
    }

    /// Whether tier `ti` may give work to `slot` at all.
    fn tier_open(&self, ti: usize, slot: &Slot) -> bool {
        slot.only_tier.is_none_or(|t| t as usize == ti) && !self.is_held(ti as TierId)
    }

    /// The credit a tenant coming back to tier `ti` on `key` keeps from
    /// its idle time, in its counter's units: a tenant that used less than
    /// its share may be served ahead of the others for up to
    /// [`CREDIT_PER_WINDOW`] of the tier's fair-share window (10 s of the
    /// default 10 min) at its weight's part of the recent throughput. Plain
    /// VTC lifts it to the least-served backlogged counter and so forgets
    /// everything: a tenant asking just under its share was then refused
    /// in every burst, and the window changed nothing. Bounded, so idling
    /// banks no more than that.
    fn credit_basis(&self, key: (u16, u16), ti: usize) -> CreditBasis {
        let none = CreditBasis {
            cost: 0.0,
            backlog_weight: 0.0,
        };
        let Some(window) = self.decay_of(ti) else {
            return none;
        };
        let rate = self.rates.get(&key).copied().unwrap_or(0.0);
        let Some(tq) = self.by_variant.get(&key).and_then(|t| t.get(ti)) else {
            return none;
        };
        // Counter units per second per unit of weight are the tier's cost
        // rate (tokens at the input weight) over the weights sharing it.
        let secs = window as f64 / 1e6 * CREDIT_PER_WINDOW;
        CreditBasis {
            cost: rate * self.vtc.0 * secs,
            backlog_weight: tq
                .backlog
                .iter()
                .map(|&(_, s)| self.weights.get(s).copied().unwrap_or(1.0))
                .sum(),
        }
    }

    /// The credit of idle tenant `slot` (not in the backlog) under `basis`.
    fn credit(&self, basis: CreditBasis, slot: usize) -> f64 {
        let w = basis.backlog_weight + self.weights.get(slot).copied().unwrap_or(1.0);
        let credit = basis.cost / w.max(1e-9);
        if credit.is_finite() {
            credit.max(0.0)
        } else {
            0.0
        }
    }

    /// Tokens per second (model, variant) has lately started: what a
    /// returning tenant's credit is measured against.
    pub fn set_rate(&mut self, key: (u16, u16), tokens_per_s: f64) {
        if tokens_per_s.is_finite() && tokens_per_s >= 0.0 {
            self.rates.insert(key, tokens_per_s);
        }
    }

    /// Holds tier `t` out of dispatch, or lets it go again.
    pub fn set_held(&mut self, t: TierId, held: bool) {
        let t = t as usize;
        if self.held.len() <= t {
            self.held.resize(t + 1, false);
        }
        self.held[t] = held;
    }

    pub fn is_held(&self, t: TierId) -> bool {
        self.held.get(t as usize).copied().unwrap_or(false)
    }

    fn choose(&self, cfg: &Config, now: Micros, slot: &Slot) -> Option<ReqId> {
        let tiers = self.by_variant.get(&(slot.model, slot.variant))?;
        let open = |ti: usize, tq: &TierQueue| {
            tq.len > 0
                && self.tier_open(ti, slot)
                && (slot.allow_backfill || !self.backfill.get(ti).copied().unwrap_or(false))
        };
        match cfg.mode {
            Mode::Kiln => {
                // Tiers by effective priority (priority plus aging of the
                // oldest waiting request); the first with work for this
                // replica serves it.
                let mut order: Vec<(i64, usize)> = tiers
                    .iter()
                    .enumerate()
                    .filter(|(ti, tq)| open(*ti, tq))
                    .map(|(ti, tq)| {
                        let prio = self.priority.get(ti).copied().unwrap_or(i64::MIN);
                        let boost = self.aging.get(ti).copied().flatten().map_or(0, |a| {
                            tq.arrivals
                                .first()
                                .map_or(0, |(at, _)| now.saturating_sub(*at) / a)
                        });
                        (-(prio.saturating_add(boost as i64)), ti)
                    })
                    .collect();
                order.sort_unstable();
                order.into_iter().find_map(|(_, ti)| {
                    let tq = tiers.get(ti)?;
                    self.choose_in_tier(tq, now, slot)
                })
            }
            Mode::Fifo | Mode::Static | Mode::Priority => {
                // The earliest arrival among each tenant's first request
                // this replica may take (strict priority first).
                let mut best: Option<((i64, Micros, ReqId), ReqId)> = None;
                for (ti, tq) in tiers.iter().enumerate() {
                    if !open(ti, tq) {
                        continue;
                    }
                    let prio = match cfg.mode {
                        Mode::Priority => -self.priority.get(ti).copied().unwrap_or(i64::MIN),
                        _ => 0,
                    };
                    for &(_, s) in &tq.backlog {
                        let Some((_, w)) = tq.tenants.get(s).and_then(|t| t.head_for(slot, now))
                        else {
                            continue;
                        };
                        let k = (prio, w.arrival, w.id);
                        if best.is_none_or(|(b, _)| k < b) {
                            best = Some((k, w.id));
                        }
                    }
                }
                best.map(|(_, id)| id)
            }
        }
    }

    /// Within one tier: deadline work whose window is nearly spent (the
    /// last tenth of its own window) earliest deadline first, ahead of fair
    /// share; then the least-served backlogged tenant with work for this
    /// replica.
    fn choose_in_tier(&self, tq: &TierQueue, now: Micros, slot: &Slot) -> Option<ReqId> {
        for &(_, id) in &tq.deadlines {
            let fits = self
                .index
                .get(&id)
                .and_then(|l| tq.tenants.get(l.slot)?.maps.get(&l.home)?.get(&l.order))
                .is_some_and(|w| w.fits(slot, now));
            if fits {
                return Some(id);
            }
        }
        tq.backlog.iter().find_map(|&(_, s)| {
            tq.tenants
                .get(s)
                .and_then(|t| t.head_for(slot, now))
                .map(|(_, w)| w.id)
        })
    }

    /// Whether `tier` has a request replica `slot` may take now (its
    /// backlogged tenants' heads only: O(tenants)), as
    /// [`Self::pick_in_tier`] would find it.
    pub fn tier_waits_for(&self, tier: TierId, slot: &Slot, now: Micros) -> bool {
        let ti = tier as usize;
        if self.backfill.get(ti).copied().unwrap_or(false) && !slot.allow_backfill {
            return false;
        }
        self.by_variant
            .get(&(slot.model, slot.variant))
            .and_then(|tiers| tiers.get(ti))
            .is_some_and(|tq| {
                tq.len > 0
                    && self.tier_open(ti, slot)
                    && tq.backlog.iter().any(|&(_, s)| {
                        tq.tenants
                            .get(s)
                            .is_some_and(|t| t.head_for(slot, now).is_some())
                    })
            })
    }

    /// Takes the next request of `tier` alone for replica `slot`, in the
    /// order the tier itself keeps (deadlines, then fair share): a tier
    /// reclaiming its reserved share goes ahead of the others there.
    pub fn pick_in_tier(&mut self, tier: TierId, now: Micros, slot: Slot) -> Option<Waiting> {
        let ti = tier as usize;
        let backfill = self.backfill.get(ti).copied().unwrap_or(false);
        if !self.tier_open(ti, &slot) || (backfill && !slot.allow_backfill) {
            return None;
        }
        let tq = self.by_variant.get(&(slot.model, slot.variant))?.get(ti)?;
        if tq.len == 0 {
            return None;
        }
        let id = self.choose_in_tier(tq, now, &slot)?;
        self.take(id)
    }

    /// A tier's rank among the tiers of one (model, variant): its priority,
    /// plus under kiln one level per `aging` its oldest request has waited.
    fn tier_rank(&self, cfg: &Config, tiers: &[TierQueue], i: usize) -> i64 {
        let prio = self.priority.get(i).copied().unwrap_or(i64::MIN);
        let boost = match (cfg.mode, self.aging.get(i).copied().flatten()) {
            (Mode::Kiln, Some(a)) => tiers
                .get(i)
                .and_then(|tq| tq.arrivals.first())
                .map_or(0, |(at, _)| self.now.saturating_sub(*at) / a),
            _ => 0,
        };
        prio.saturating_add(boost as i64)
    }

    /// Whether tier `i`'s queue is served before tier `ti`'s (of rank
    /// `mine`) under the scheduler's mode.
    fn served_before(
        &self,
        cfg: &Config,
        tiers: &[TierQueue],
        i: usize,
        ti: usize,
        mine: i64,
    ) -> bool {
        match cfg.mode {
            Mode::Fifo | Mode::Static => true,
            Mode::Priority => self.priority.get(i) >= self.priority.get(ti),
            Mode::Kiln => {
                let r = self.tier_rank(cfg, tiers, i);
                r > mine || (r == mine && i < ti)
            }
        }
    }

    /// Tokens queued for (model, variant) in tiers other than `tier` that
    /// the queues serve before it (as [`Self::ahead`] counts them).
    pub fn other_tiers_ahead(&self, cfg: &Config, key: (u16, u16), tier: TierId) -> f64 {
        let Some(tiers) = self.by_variant.get(&key) else {
            return 0.0;
        };
        let ti = tier as usize;
        let mine = self.tier_rank(cfg, tiers, ti);
        tiers
            .iter()
            .enumerate()
            .filter(|(i, tq)| *i != ti && tq.len > 0)
            .filter(|(i, _)| self.served_before(cfg, tiers, *i, ti, mine))
            .map(|(_, tq)| tq.tokens as f64)
            .sum()
    }
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
    fn shared_service_is_counted_once_and_set_to_the_fleets() {
        let g = graph(BASE);
        let cfg = Config::default();
        let mut q = Queues::new(&g, &cfg);
        q.share_service();
        let a = waiting(1, 0, Some(0));
        q.push(a.clone(), &cfg);
        q.charge(&g, &cfg, &a);
        let taken = q.take_service();
        assert_eq!(taken.len(), 1);
        let served = taken[0].service;
        assert!(served > 0.0);
        assert!(q.take_service().is_empty(), "taken once");
        // The fleet says the tenant got ten times that elsewhere too; what
        // is charged here after the fleet's value was read is kept on top.
        q.charge(&g, &cfg, &a);
        q.set_service(&ServiceCount {
            service: 10.0 * served,
            ..taken[0].clone()
        });
        assert!((q.served(0, Some(0)) - 11.0 * served).abs() < 1e-6);
        assert_eq!(q.take_service().len(), 1, "the later charge still goes out");
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

#[cfg(test)]
mod fair_share_window_tests {
    use super::super::testkit::{graph, waiting};
    use super::*;

    const TEXT: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier a { priority 10 slo { ttft 10s } fair_share { window 2s } }
tier b { priority 10 slo { ttft 10s } }
tenant x { owner "o" tiers [a, b] }
tenant y { owner "o" tiers [a, b] }
classify { default => tier a }
route [a, b] m { default => fp16 }
"#;

    fn slot() -> Slot {
        Slot {
            replica: 0,
            model: 0,
            variant: 0,
            pool: 0,
            only_tier: None,
            allow_backfill: true,
        }
    }

    #[test]
    fn each_tier_decays_service_over_its_own_window() {
        let g = graph(TEXT);
        let cfg = Config::default();
        let mut q = Queues::new(&g, &cfg);
        q.set_now(0);
        for tier in [0, 1] {
            let w = waiting(tier as u64, tier, Some(0));
            q.push(w.clone(), &cfg);
            q.charge(&g, &cfg, &w);
        }
        let at0 = q.served(0, Some(0));
        assert!(at0 > 0.0 && (q.served(1, Some(0)) - at0).abs() < 1e-9);
        q.set_now(4 * super::super::SEC);
        let a = q.served(0, Some(0)) / at0;
        let b = q.served(1, Some(0)) / at0;
        assert!((a - (-2.0f64).exp()).abs() < 1e-9, "{a}");
        assert!((b - (-4.0f64 / 600.0).exp()).abs() < 1e-9, "{b}");
    }

    /// Deadline work is urgent in the last tenth of its own window (a batch
    /// item's, here in a tier with no window at all): then it goes earliest
    /// deadline first, ahead of fair share. Work becomes urgent as the clock
    /// passes, by an ordered set, never a scan.
    #[test]
    fn deadline_work_is_urgent_in_the_last_tenth_of_its_own_window() {
        let g = graph(TEXT);
        let cfg = Config::default();
        let sec = super::super::SEC;
        let mut q = Queues::new(&g, &cfg);
        q.set_now(0);
        let mut y = waiting(1, 1, Some(1));
        y.arrival = 0;
        q.push(y, &cfg);
        // x has been served far more: fair share alone would pick y.
        let mut big = waiting(100, 1, Some(0));
        big.prompt_tokens = 10_000;
        q.charge(&g, &cfg, &big);
        let (mut short, mut long) = (waiting(2, 1, Some(0)), waiting(3, 1, Some(0)));
        short.arrival = 0;
        short.deadline = Some(100 * sec);
        long.arrival = 0;
        long.deadline = Some(1000 * sec);
        q.push(long, &cfg);
        q.push(short, &cfg);
        assert_eq!(q.urgency.len(), 2);
        let at = |q: &mut Queues, t: u64| {
            q.set_now(t * sec);
            q.choose(&cfg, t * sec, &slot())
        };
        assert_eq!(at(&mut q, 50), Some(1), "nothing urgent: fair share");
        assert_eq!(at(&mut q, 91), Some(2), "the last tenth of its 100 s");
        assert!(q.remove(2).is_some());
        // The long one's last tenth starts at 900 s (a tenth of its own
        // 1000 s), not 10 s before its deadline.
        assert_eq!(at(&mut q, 850), Some(1));
        assert_eq!(at(&mut q, 901), Some(3));
        assert!(q.urgency.is_empty());
        assert!(q.remove(3).is_some());
        assert_eq!(at(&mut q, 902), Some(1));
    }

    /// Within a tier with its own window the least-served tenant, by its
    /// counter decayed to now, goes first, whenever the pick happens: the
    /// ordering key stays consistent with the decayed counters.
    #[test]
    fn the_order_within_a_tier_follows_decayed_service() {
        let g = graph(TEXT);
        let cfg = Config::default();
        for (y_cost, first) in [(200u32, 1u32), (300, 0)] {
            let mut q = Queues::new(&g, &cfg);
            q.set_now(0);
            for (id, tenant) in [(1, 0), (2, 1)] {
                q.push(waiting(id, 0, Some(tenant)), &cfg);
            }
            // x is served 1000 at 0, y `y_cost` at 3s.
            let mut big = waiting(100, 0, Some(0));
            big.prompt_tokens = 1000;
            big.output_tokens = 0;
            q.charge(&g, &cfg, &big);
            q.set_now(3 * super::super::SEC);
            let mut small = waiting(101, 0, Some(1));
            small.prompt_tokens = y_cost;
            small.output_tokens = 0;
            q.charge(&g, &cfg, &small);
            // x at 3s: 1000 e^-1.5 = 223.
            for later in [3u64, 10, 60] {
                q.set_now(later * super::super::SEC);
                let id = q.choose(&cfg, later * super::super::SEC, &slot());
                let tenant = id.and_then(|id| q.index.get(&id)).map(|l| l.slot - 1);
                assert_eq!(tenant, Some(first as usize), "y cost {y_cost} at {later}s");
                let (sx, sy) = (q.served(0, Some(0)), q.served(0, Some(1)));
                assert_eq!(sx > sy, first == 1, "{sx} {sy}");
            }
        }
    }
}
