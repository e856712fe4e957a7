//! The measured signals policies read ([`crate::graph::signal`]): sliding
//! windows over what the scheduler itself did, fed by the actions it emits,
//! so the gateway and the replay (one scheduler, two clocks) read the same
//! values at the same decision.
//!
//! A window is a ring of [`SLOTS`] sub-windows; a figure is the sum of the
//! live ones, kept as a running total (a record adds to the current slot
//! and the total; an expiring slot is taken off the total), so recording
//! is O(1) and reading a percentile is one pass over a fixed histogram.
//! Percentiles come from log-spaced bins about 9% wide, reported at the
//! bin's geometric middle.

use super::{Action, Micros, ReqId, MS, SEC};
use crate::graph::signal::TierField;
use crate::graph::{DecisionGraph, PoolId, Signals, TenantId, TierId};
use rustc_hash::FxHashMap as HashMap;

/// Sub-windows per window: the window slides in steps of 1/16 of itself.
pub const SLOTS: usize = 16;
/// Percentiles are re-read at most this often (scheduler time, 100 ms).
pub const PERCENTILE_EVERY: Micros = 100 * MS;
/// Histogram bins: 8 per doubling from 0.1 ms, so up to about 3 days.
const BINS: usize = 256;
const PER_DOUBLING: f64 = 8.0;
const FLOOR_MS: f64 = 0.1;

/// A log-binned histogram of durations (ms). Its bins are allocated on
/// the first sample, so a tier nothing reaches costs no memory however many
/// tiers a policy declares.
#[derive(Debug, Clone, Default, PartialEq)]
struct Hist {
    counts: Option<Box<[u32; BINS]>>,
    n: u64,
}

fn bin(ms: f64) -> usize {
    if !ms.is_finite() || ms <= FLOOR_MS {
        return 0;
    }
    let b = (PER_DOUBLING * (ms / FLOOR_MS).log2()).floor() as usize + 1;
    b.min(BINS - 1)
}

/// The middle of bin `b`, ms.
fn mid(b: usize) -> f64 {
    if b == 0 {
        return 0.0;
    }
    FLOOR_MS * ((b as f64 - 0.5) / PER_DOUBLING).exp2()
}

/// Every bin's middle, computed once per [`Live`].
fn mids() -> Box<[f64; BINS]> {
    let mut m = Box::new([0.0; BINS]);
    for (b, x) in m.iter_mut().enumerate() {
        *x = mid(b);
    }
    m
}

impl Hist {
    fn add(&mut self, ms: f64) {
        let b = bin(ms);
        let counts = self.counts.get_or_insert_with(|| Box::new([0; BINS]));
        counts[b] = counts[b].saturating_add(1);
        self.n += 1;
    }
    fn merge(&mut self, o: &Hist, sign: i64) {
        let Some(theirs) = &o.counts else {
            return;
        };
        let mine = self.counts.get_or_insert_with(|| Box::new([0; BINS]));
        for (a, b) in mine.iter_mut().zip(theirs.iter()) {
            *a = if sign > 0 {
                a.saturating_add(*b)
            } else {
                a.saturating_sub(*b)
            };
        }
        self.n = if sign > 0 {
            self.n.saturating_add(o.n)
        } else {
            self.n.saturating_sub(o.n)
        };
    }
    /// The values at quantiles `qs` (ascending), nearest rank; 0 when empty.
    fn quantiles<const N: usize>(&self, qs: [f64; N], mids: &[f64; BINS]) -> [f64; N] {
        let mut out = [0.0; N];
        let Some(counts) = &self.counts else {
            return out;
        };
        if self.n == 0 {
            return out;
        }
        let ranks = qs.map(|q| ((q * self.n as f64).ceil() as u64).clamp(1, self.n));
        let (mut seen, mut i) = (0u64, 0usize);
        for (b, c) in counts.iter().enumerate() {
            seen += u64::from(*c);
            while i < N && seen >= ranks[i] {
                out[i] = mids[b];
                i += 1;
            }
            if i == N {
                break;
            }
        }
        out
    }
}

/// What one tier did in a (sub-)window.
#[derive(Debug, Clone, Default, PartialEq)]
struct TierAgg {
    ttft: Hist,
    e2e: Hist,
    wait: Hist,
    ended: u64,
    met: u64,
    errors: u64,
    decided: u64,
    fallbacks: u64,
    deadline_misses: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    ended: u64,
    errors: u64,
    deadline_misses: u64,
    /// Pools: seconds of work at saturated throughput.
    work: f64,
}

trait Agg: Default {
    fn merge(&mut self, o: &Self, sign: i64);
}

fn signed(a: u64, b: u64, sign: i64) -> u64 {
    if sign > 0 {
        a.saturating_add(b)
    } else {
        a.saturating_sub(b)
    }
}

impl Agg for TierAgg {
    fn merge(&mut self, o: &Self, sign: i64) {
        self.ttft.merge(&o.ttft, sign);
        self.e2e.merge(&o.e2e, sign);
        self.wait.merge(&o.wait, sign);
        self.ended = signed(self.ended, o.ended, sign);
        self.met = signed(self.met, o.met, sign);
        self.errors = signed(self.errors, o.errors, sign);
        self.decided = signed(self.decided, o.decided, sign);
        self.fallbacks = signed(self.fallbacks, o.fallbacks, sign);
        self.deadline_misses = signed(self.deadline_misses, o.deadline_misses, sign);
    }
}

impl Agg for Counts {
    fn merge(&mut self, o: &Self, sign: i64) {
        self.ended = signed(self.ended, o.ended, sign);
        self.errors = signed(self.errors, o.errors, sign);
        self.deadline_misses = signed(self.deadline_misses, o.deadline_misses, sign);
        self.work = if sign > 0 {
            self.work + o.work
        } else {
            (self.work - o.work).max(0.0)
        };
    }
}

/// A sliding window: [`SLOTS`] sub-windows and their running total.
#[derive(Debug, Clone)]
struct Window<A> {
    slot_len: Micros,
    /// Index of the current sub-window (time / slot_len).
    head: u64,
    slots: Vec<A>,
    total: A,
    /// The total changed since it was last read.
    dirty: bool,
}

impl<A: Agg> Window<A> {
    fn new(span_ms: f64) -> Window<A> {
        let span = (span_ms * MS as f64).clamp(SEC as f64, 1e15) as Micros;
        Window {
            slot_len: (span / SLOTS as u64).max(1),
            head: 0,
            slots: (0..SLOTS).map(|_| A::default()).collect(),
            total: A::default(),
            dirty: true,
        }
    }

    fn span(&self) -> Micros {
        self.slot_len * SLOTS as u64
    }

    /// Expires the sub-windows that slid out by `now`.
    fn advance(&mut self, now: Micros) {
        let idx = now / self.slot_len;
        if idx <= self.head {
            return;
        }
        if idx - self.head >= SLOTS as u64 {
            for s in &mut self.slots {
                *s = A::default();
            }
            self.total = A::default();
        } else {
            while self.head < idx {
                self.head += 1;
                let s = (self.head % SLOTS as u64) as usize;
                let old = std::mem::take(&mut self.slots[s]);
                self.total.merge(&old, -1);
            }
        }
        self.head = idx;
        self.dirty = true;
    }

    fn record(&mut self, now: Micros, f: impl Fn(&mut A)) {
        self.advance(now);
        let s = (self.head % SLOTS as u64) as usize;
        f(&mut self.slots[s]);
        f(&mut self.total);
        self.dirty = true;
    }
}

/// A request between its decision and its end.
#[derive(Debug, Clone, Copy)]
struct Open {
    arrived: Micros,
    tier: TierId,
    tenant: Option<TenantId>,
    started: bool,
    first_token: Option<Micros>,
    /// When it must be finished (its own window or its tier's), if ever.
    deadline: Option<Micros>,
}

/// Moves each old window to its new id (a window whose length the new
/// policy changed starts empty).
fn carry<A>(old: &mut Vec<Window<A>>, new: &mut [Window<A>], id: impl Fn(usize) -> Option<usize>) {
    for (i, w) in std::mem::take(old).into_iter().enumerate() {
        if let Some(slot) = id(i).and_then(|n| new.get_mut(n)) {
            if slot.slot_len == w.slot_len {
                *slot = w;
            }
        }
    }
}

/// Every window the policy's signals read, and the requests in flight.
#[derive(Debug, Clone)]
pub struct Live {
    open: HashMap<ReqId, Open>,
    tiers: Vec<Window<TierAgg>>,
    tenants: Vec<Window<Counts>>,
    pools: Vec<Window<Counts>>,
    all: Window<Counts>,
    /// When tier figures were last computed.
    computed_at: Micros,
    mids: Box<[f64; BINS]>,
}

/// Per tier: SLO targets in ms (ttft, e2e). The completion window is the
/// request's own deadline ([`Action::Decided`]), not read here.
fn targets(g: &DecisionGraph, t: TierId) -> (Option<f64>, Option<f64>) {
    g.tiers
        .get(t as usize)
        .map_or((None, None), |t| (t.slo.ttft, t.slo.e2e_p95))
}

impl Live {
    pub fn new(g: &DecisionGraph) -> Live {
        Live {
            open: HashMap::default(),
            tiers: g
                .tiers
                .iter()
                .map(|t| Window::new(t.signal_window))
                .collect(),
            tenants: g
                .tenants
                .iter()
                .map(|t| Window::new(t.signal_window))
                .collect(),
            pools: g
                .pools
                .iter()
                .map(|p| Window::new(p.signal_window))
                .collect(),
            all: Window::new(crate::graph::signal::DEFAULT_WINDOW_MS),
            computed_at: 0,
            mids: mids(),
        }
    }

    /// After a policy swap: windows follow the new graph's names (by
    /// `map`: old id → new id). Requests in flight keep their samples.
    pub fn remap(
        &mut self,
        g: &DecisionGraph,
        tier: impl Fn(TierId) -> Option<TierId>,
        tenant: impl Fn(TenantId) -> Option<TenantId>,
        pool: impl Fn(PoolId) -> Option<PoolId>,
    ) {
        let mut next = Live::new(g);
        carry(&mut self.tiers, &mut next.tiers, |i| {
            tier(i as TierId).map(usize::from)
        });
        carry(&mut self.tenants, &mut next.tenants, |i| {
            tenant(i as TenantId).map(|n| n as usize)
        });
        carry(&mut self.pools, &mut next.pools, |i| {
            pool(i as PoolId).map(usize::from)
        });
        next.all = self.all.clone();
        next.open = std::mem::take(&mut self.open)
            .into_iter()
            .filter_map(|(id, mut o)| {
                o.tier = tier(o.tier)?;
                o.tenant = o.tenant.and_then(&tenant);
                Some((id, o))
            })
            .collect();
        *self = next;
    }

    /// Work a pool's replica did: seconds at its saturated throughput.
    pub fn work(&mut self, now: Micros, pool: PoolId, secs: f64) {
        if let Some(w) = self.pools.get_mut(pool as usize) {
            if secs.is_finite() && secs > 0.0 {
                w.record(now, |c| c.work += secs);
            }
        }
    }

    /// Takes in what the scheduler just did.
    pub fn observe(&mut self, g: &DecisionGraph, now: Micros, actions: &[Action]) {
        for a in actions {
            match *a {
                Action::Decided {
                    id,
                    tier,
                    tenant,
                    fallback_step,
                    deadline,
                } => {
                    self.open.insert(
                        id,
                        Open {
                            arrived: now,
                            tier,
                            tenant,
                            started: false,
                            first_token: None,
                            deadline,
                        },
                    );
                    if let Some(w) = self.tiers.get_mut(tier as usize) {
                        w.record(now, |t| {
                            t.decided += 1;
                            t.fallbacks += u64::from(fallback_step.is_some());
                        });
                    }
                }
                Action::Started { id, .. } => {
                    let Some(o) = self.open.get_mut(&id) else {
                        continue;
                    };
                    if o.started {
                        continue; // a preempted request starting again
                    }
                    o.started = true;
                    let wait = (now - o.arrived) as f64 / MS as f64;
                    if let Some(w) = self.tiers.get_mut(o.tier as usize) {
                        w.record(now, |t| t.wait.add(wait));
                    }
                }
                Action::FirstToken { id } => self.first_token(now, id),
                Action::Finished { id, .. } => {
                    let Some(o) = self.open.remove(&id) else {
                        continue;
                    };
                    let e2e = (now - o.arrived) as f64 / MS as f64;
                    let ttft = o
                        .first_token
                        .map_or(e2e, |f| (f - o.arrived) as f64 / MS as f64);
                    let (t_slo, e_slo) = targets(g, o.tier);
                    let late = o.deadline.is_some_and(|d| now > d);
                    let met =
                        t_slo.is_none_or(|s| ttft <= s) && e_slo.is_none_or(|s| e2e <= s) && !late;
                    self.end(now, &o, met, false, late, Some(e2e));
                }
                Action::Reject {
                    id, status, reason, ..
                } => {
                    let Some(o) = self.open.remove(&id) else {
                        continue;
                    };
                    let late = o.deadline.is_some() && matches!(reason, super::Reason::Deadline);
                    self.end(now, &o, false, status >= 500, late, None);
                }
                Action::Cancelled { id } => {
                    self.open.remove(&id);
                }
                // Answered at once from the tier's cache: served, on time.
                Action::CacheHit { id, .. } => {
                    if let Some(o) = self.open.remove(&id) {
                        self.end(now, &o, true, false, false, Some(0.0));
                    }
                }
                _ => {}
            }
        }
    }

    /// The first token of `id` (reported by the scheduler for its own
    /// steps, by the environment for an external upstream's).
    pub fn first_token(&mut self, now: Micros, id: ReqId) {
        let Some(o) = self.open.get_mut(&id) else {
            return;
        };
        if o.first_token.is_some() {
            return;
        }
        o.first_token = Some(now);
        let ttft = (now - o.arrived) as f64 / MS as f64;
        if let Some(w) = self.tiers.get_mut(o.tier as usize) {
            w.record(now, |t| t.ttft.add(ttft));
        }
    }

    fn end(&mut self, now: Micros, o: &Open, met: bool, error: bool, late: bool, e2e: Option<f64>) {
        if let Some(w) = self.tiers.get_mut(o.tier as usize) {
            w.record(now, |t| {
                t.ended += 1;
                t.met += u64::from(met);
                t.errors += u64::from(error);
                t.deadline_misses += u64::from(late);
                if let Some(e) = e2e {
                    t.e2e.add(e);
                }
            });
        }
        let counts = |c: &mut Counts| {
            c.ended += 1;
            c.errors += u64::from(error);
            c.deadline_misses += u64::from(late);
        };
        if let Some(w) = o.tenant.and_then(|t| self.tenants.get_mut(t as usize)) {
            w.record(now, counts);
        }
        self.all.record(now, counts);
    }

    /// Writes the windowed figures into `s`. Counts and rates are exact at
    /// every call; percentiles are re-read from their histograms at most
    /// every [`PERCENTILE_EVERY`] of scheduler time, or an eighth of the
    /// shortest tier sub-window when that is shorter (deterministic: the
    /// clock is the scheduler's).
    pub fn fill(&mut self, now: Micros, s: &mut Signals, pool_capacity: &[f64]) {
        let min_slot = self.tiers.iter().map(|w| w.slot_len).min().unwrap_or(SEC);
        let every = (min_slot / 8).min(PERCENTILE_EVERY);
        let recompute = now >= self.computed_at.saturating_add(every) || now < self.computed_at;
        let mids = &*self.mids;
        for (i, w) in self.tiers.iter_mut().enumerate() {
            w.advance(now);
            let Some(m) = s.tiers.get_mut(i) else {
                continue;
            };
            let t = &w.total;
            let pct = |x: u64, of: u64| {
                if of == 0 {
                    None
                } else {
                    Some(100.0 * x as f64 / of as f64)
                }
            };
            m.set(TierField::Requests, t.ended as f64);
            m.set(
                TierField::SloAttainment,
                pct(t.met, t.ended).unwrap_or(100.0),
            );
            m.set(TierField::ErrorRate, pct(t.errors, t.ended).unwrap_or(0.0));
            m.set(
                TierField::FallbackRate,
                pct(t.fallbacks, t.decided).unwrap_or(0.0),
            );
            m.set(TierField::DeadlineMisses, t.deadline_misses as f64);
            if !(w.dirty && recompute) {
                continue;
            }
            w.dirty = false;
            let [a, b, c] = t.ttft.quantiles([0.5, 0.95, 0.99], mids);
            m.set(TierField::TtftP50, a);
            m.set(TierField::TtftP95, b);
            m.set(TierField::TtftP99, c);
            let [a, b, c] = t.e2e.quantiles([0.5, 0.95, 0.99], mids);
            m.set(TierField::E2eP50, a);
            m.set(TierField::E2eP95, b);
            m.set(TierField::E2eP99, c);
            let [a, b, c] = t.wait.quantiles([0.5, 0.95, 0.99], mids);
            m.set(TierField::WaitP50, a);
            m.set(TierField::WaitP95, b);
            m.set(TierField::WaitP99, c);
        }
        if recompute {
            self.computed_at = now;
        }
        for (i, w) in self.tenants.iter_mut().enumerate() {
            w.advance(now);
            if let Some(slot) = s.tenants.get_mut(i) {
                slot.deadline_misses = w.total.deadline_misses as f64;
                slot.requests = w.total.ended as f64;
            }
        }
        for (i, w) in self.pools.iter_mut().enumerate() {
            w.advance(now);
            if let Some(slot) = s.pools.get_mut(i) {
                // The window is not full until a window has passed.
                let covered = w.span().min(now.max(1)) as f64 / SEC as f64;
                let cap = pool_capacity.get(i).copied().unwrap_or(0.0) * covered;
                slot.utilization = if cap > 0.0 {
                    (100.0 * w.total.work / cap).min(100.0)
                } else {
                    0.0
                };
            }
        }
        self.all.advance(now);
        s.error_rate = if self.all.total.ended == 0 {
            0.0
        } else {
            100.0 * self.all.total.errors as f64 / self.all.total.ended as f64
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_bin_of_the_truth() {
        let mut h = Hist::default();
        for v in 1..=1000 {
            h.add(f64::from(v));
        }
        let m = mids();
        let [p50, p95, p99] = h.quantiles([0.5, 0.95, 0.99], &m);
        for (got, want) in [(p50, 500.0), (p95, 950.0), (p99, 990.0)] {
            assert!((got / want - 1.0).abs() < 0.1, "{got} vs {want}");
        }
        assert_eq!(Hist::default().quantiles([0.5], &m), [0.0]);
    }

    /// A request's own deadline (a batch item's) counts, in a tier with no
    /// completion window: late is a miss for its tier and its tenant, and
    /// so is a refusal for the deadline; on time is not.
    #[test]
    fn a_request_with_its_own_deadline_counts_its_misses() {
        let g = crate::sched::testkit::graph(crate::sched::testkit::BASE);
        assert!(g.tiers[0].slo.window.is_none());
        let mut live = Live::new(&g);
        let decided = |id, deadline| Action::Decided {
            id,
            tier: 0,
            tenant: Some(0),
            fallback_step: None,
            deadline,
        };
        let done = |id| Action::Finished {
            id,
            gpu_seconds: 0.0,
            wasted_gpu_seconds: 0.0,
        };
        let refused = |id, reason| Action::Reject {
            id,
            reason,
            status: 429,
            retry_after: None,
        };
        let on_time = [decided(0, Some(2 * SEC)), decided(1, Some(SEC))];
        live.observe(&g, 0, &on_time);
        live.observe(&g, 0, &[decided(2, None), decided(3, Some(SEC))]);
        live.observe(&g, SEC, &[done(1)]);
        live.observe(&g, 3 * SEC / 2, &[done(0), done(2)]);
        assert_eq!(live.tiers[0].total.deadline_misses, 0);
        live.observe(&g, 3 * SEC, &[decided(4, Some(4 * SEC))]);
        live.observe(&g, 3 * SEC, &[refused(3, super::super::Reason::Overload)]);
        live.observe(&g, 3 * SEC, &[refused(4, super::super::Reason::Deadline)]);
        assert_eq!(
            live.tiers[0].total.deadline_misses, 1,
            "refused for its deadline"
        );
        live.observe(&g, 3 * SEC, &[decided(5, Some(4 * SEC))]);
        live.observe(&g, 5 * SEC, &[done(5)]);
        assert_eq!(live.tiers[0].total.deadline_misses, 2, "finished late");
        assert_eq!(live.tenants[0].total.deadline_misses, 2);
    }

    #[test]
    fn a_window_forgets_what_slid_out() {
        let mut w: Window<Counts> = Window::new(16_000.0); // 1s slots
        w.record(0, |c| c.ended += 1);
        w.record(5 * SEC, |c| c.ended += 1);
        assert_eq!(w.total.ended, 2);
        w.advance(16 * SEC);
        assert_eq!(w.total.ended, 1, "the first sample slid out");
        w.advance(21 * SEC + 1);
        assert_eq!(w.total.ended, 0);
        w.record(100 * SEC, |c| c.ended += 3);
        assert_eq!(w.total.ended, 3);
        w.advance(10_000 * SEC);
        assert_eq!(w.total, Counts::default());
    }
}
