//! Live metrics for rollback conditions: a rolling window of finished
//! requests (served or refused), summarised into every signal a rollout's
//! `rollback when …` conditions read. During a canary only the requests the
//! canary version decided count, so a condition judges the new version and
//! not the traffic the old one still decides.
//!
//! * Latencies (`tier(T).ttft_p50/p95/p99`, `e2e_…`, `wait_…`): nearest-rank
//!   percentiles of the tier's requests in the window; `tier(T).oldest_wait`
//!   is the longest queue wait among them.
//! * Rates (`tier(T).error_rate`, `tier(T).fallback_rate`,
//!   `tier(T).slo_attainment`, `error_rate`): shares of the requests in the
//!   window; an error is a 5xx (no capacity, queue timeout, upstream
//!   failure, a policy's own 503); attainment counts refusals as misses.
//! * Counts (`tier(T).deadline_misses`, `tenant(X).deadline_misses`) over
//!   the window; `tier(T).requests` and `tenant(X).requests` are the sample
//!   counts themselves.
//! * Occupancy (`tier(T).queued`, `pool(P).queued`, `pool(P).running`,
//!   `tenant(X).in_flight`): the mean over the window, by Little's law: the
//!   queue waits (or service times, or whole lives) of the requests in the
//!   window, summed, over the time the window covers.
//! * `pool(P).utilization` and `pool(P).kv_occupancy` measure the pool's
//!   hardware, which the canary shares with the active version: they cannot
//!   be split by who decided a request, so they are the scheduler's
//!   whole-pool figures, and [`crate::compile`]'s `rollback-on-shared-pool`
//!   lint warns on a canary's condition that reads them.
//! * Guard: a tier, pool or tenant with fewer than `min_samples` requests
//!   in the window reads as healthy (latencies, rates and counts 0,
//!   attainment 100%), and so does the global error rate, and the pools'
//!   hardware figures while the whole window has fewer; so one slow or
//!   failed request among three cannot roll a version back.
//!   [`crate::compile`]'s `rollback-on-few-samples` lint warns on a
//!   condition that holds on those healthy readings.
//!
//! Pure: time is passed in (ms on the gateway's clock, latencies in the
//! policy's time, i.e. scaled by the simulator's speed).

use crate::graph::signal::TierField;
use crate::graph::{DecisionGraph, Signals};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at_ms: f64,
    pub tier: String,
    pub tenant: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Answered with a 5xx.
    pub error: bool,
    pub met_slo: bool,
    pub deadline_miss: bool,
    /// Decided by a canary version.
    pub canary: bool,
    /// The pool it ran on (none when refused or answered from a cache).
    pub pool: Option<String>,
    /// Its queue wait, arrival to start (none when it never started).
    pub wait_ms: Option<f64>,
    /// Its decision took a fallback step.
    pub fallback: bool,
}

/// One tier's figures over the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TierLive {
    pub requests: u64,
    pub ttft_p95_ms: Option<f64>,
    pub e2e_p95_ms: Option<f64>,
    /// %
    pub slo_attainment: Option<f64>,
}

/// The window's figures, for status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Live {
    pub window_s: f64,
    pub requests: u64,
    pub errors: u64,
    /// %
    pub error_rate: f64,
    pub tiers: BTreeMap<String, TierLive>,
}

#[derive(Debug, Clone)]
pub struct Window {
    span_ms: f64,
    cap: usize,
    samples: VecDeque<Sample>,
}

/// The 95th percentile (nearest rank) of unsorted values.
pub fn p95(v: &mut [f64]) -> Option<f64> {
    quantile(v, 0.95)
}

/// The `q` quantile (nearest rank) of unsorted values.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() as f64) * q).ceil() as usize;
    v.get(rank.clamp(1, v.len()) - 1).copied()
}

/// Nearest-rank p50, p95 and p99 of what `f` reads from `ss` (0 with none).
fn percentiles(ss: &[&Sample], f: impl Fn(&Sample) -> Option<f64>) -> [f64; 3] {
    let mut v: Vec<f64> = ss.iter().filter_map(|s| f(s)).collect();
    [0.5, 0.95, 0.99].map(|q| quantile(&mut v, q).unwrap_or(0.0))
}

/// A share of `ss`, in %.
fn share(ss: &[&Sample], f: impl Fn(&Sample) -> bool) -> f64 {
    if ss.is_empty() {
        return 0.0;
    }
    100.0 * ss.iter().filter(|s| f(s)).count() as f64 / ss.len() as f64
}

/// When a sample's request arrived.
fn arrived(s: &Sample) -> f64 {
    s.at_ms - s.e2e_ms.or(s.wait_ms).unwrap_or(0.0)
}

impl Window {
    /// Keeps `span_ms` of history, at most `cap` samples.
    pub fn new(span_ms: f64, cap: usize) -> Window {
        Window {
            span_ms: span_ms.max(1.0),
            cap: cap.max(1),
            samples: VecDeque::new(),
        }
    }

    pub fn push(&mut self, s: Sample) {
        if self.samples.len() >= self.cap {
            self.samples.pop_front();
        }
        self.samples.push_back(s);
    }

    pub fn prune(&mut self, now: f64) {
        while self
            .samples
            .front()
            .is_some_and(|s| s.at_ms < now - self.span_ms)
        {
            self.samples.pop_front();
        }
    }

    pub fn clear(&mut self) {
        self.samples.clear();
    }

    fn recent(&self, now: f64, canary_only: bool) -> impl Iterator<Item = &Sample> {
        let from = now - self.span_ms;
        self.samples
            .iter()
            .filter(move |s| s.at_ms >= from && (!canary_only || s.canary))
    }

    /// What a stage's gate reads that fewer than `min_samples` requests
    /// back, as `tier(batch) has 3 of 20 samples`; `None` when every tier,
    /// tenant and pool it reads (and the whole window, for the global
    /// error rate) has enough. Under `min_samples` live signals read as
    /// healthy, which lets a rollback wait but must not let a gate pass:
    /// a gate short of samples does not hold.
    pub fn short_of(
        &self,
        g: &DecisionGraph,
        cond: &crate::graph::Cond,
        now: f64,
        canary_only: bool,
        min_samples: u64,
    ) -> Option<String> {
        use crate::graph::Sig;
        let ss: Vec<&Sample> = self.recent(now, canary_only).collect();
        let mut short = Vec::new();
        let mut check = |what: String, n: usize| {
            if (n as u64) < min_samples {
                short.push(format!("{what} has {n} of {min_samples} samples"));
            }
        };
        for (i, t) in g.tiers.iter().enumerate() {
            if cond.any_test(&|x| matches!(x.sig, Sig::TierLive(id, _) if usize::from(id) == i)) {
                check(
                    format!("tier({})", t.name),
                    ss.iter().filter(|s| s.tier == t.name).count(),
                );
            }
        }
        for (i, t) in g.tenants.iter().enumerate() {
            if cond.any_test(&|x| matches!(x.sig, Sig::TenantLive(id, _) if id as usize == i)) {
                let n = ss
                    .iter()
                    .filter(|s| s.tenant.as_deref() == Some(t.name.as_str()))
                    .count();
                check(format!("tenant({})", t.name), n);
            }
        }
        for (i, p) in g.pools.iter().enumerate() {
            if cond.any_test(&|x| matches!(x.sig, Sig::Pool(id, _) if id as usize == i)) {
                let n = ss
                    .iter()
                    .filter(|s| s.pool.as_deref() == Some(p.name.as_str()))
                    .count();
                check(format!("pool({})", p.name), n);
            }
        }
        if cond.any_test(&|x| x.sig == Sig::ErrorRate) {
            check("the window".into(), ss.len());
        }
        (!short.is_empty()).then(|| short.join(", "))
    }

    /// The figures over the window ending at `now` (only canary-decided
    /// requests with `canary_only`).
    pub fn summary(&self, now: f64, canary_only: bool) -> Live {
        let mut by_tier: BTreeMap<&str, Vec<&Sample>> = BTreeMap::new();
        let (mut n, mut err) = (0u64, 0u64);
        for s in self.recent(now, canary_only) {
            n += 1;
            err += u64::from(s.error);
            by_tier.entry(s.tier.as_str()).or_default().push(s);
        }
        let tiers = by_tier
            .into_iter()
            .map(|(t, ss)| {
                let mut ttft: Vec<f64> = ss.iter().filter_map(|s| s.ttft_ms).collect();
                let mut e2e: Vec<f64> = ss.iter().filter_map(|s| s.e2e_ms).collect();
                let met = ss.iter().filter(|s| s.met_slo).count();
                (
                    t.to_string(),
                    TierLive {
                        requests: ss.len() as u64,
                        ttft_p95_ms: p95(&mut ttft),
                        e2e_p95_ms: p95(&mut e2e),
                        slo_attainment: Some(100.0 * met as f64 / ss.len().max(1) as f64),
                    },
                )
            })
            .collect();
        Live {
            window_s: self.span_ms / 1000.0,
            requests: n,
            errors: err,
            error_rate: if n == 0 {
                0.0
            } else {
                100.0 * err as f64 / n as f64
            },
            tiers,
        }
    }

    /// Fills the live metrics of `base` (signals already in `g`'s ids:
    /// pools' hardware figures and the clock come from the scheduler) from
    /// the window: every signal a rollback condition reads about traffic,
    /// over canary-decided requests only with `canary_only`, healthy where
    /// fewer than `min_samples` requests back it (the module's comment says
    /// how each is measured).
    pub fn signals(
        &self,
        g: &DecisionGraph,
        mut base: Signals,
        now: f64,
        canary_only: bool,
        min_samples: u64,
    ) -> Signals {
        let ss: Vec<&Sample> = self.recent(now, canary_only).collect();
        let enough = |n: usize| n as u64 >= min_samples;
        // The time the window covers: its span, or less when its first
        // request arrived later (the window is cleared when a canary
        // begins), for the means by Little's law.
        let first = ss.iter().map(|s| arrived(s)).fold(now, f64::min);
        let covered = (now - first).clamp(1.0, self.span_ms);
        let mean = |ss: &[&Sample], f: &dyn Fn(&Sample) -> f64| -> f64 {
            ss.iter().map(|s| f(s).max(0.0)).sum::<f64>() / covered
        };
        for (i, t) in g.tiers.iter().enumerate() {
            let Some(slot) = base.tiers.get_mut(i) else {
                continue;
            };
            let mine: Vec<&Sample> = ss.iter().copied().filter(|s| s.tier == t.name).collect();
            *slot = crate::graph::TierMetrics::default();
            slot.set(TierField::Requests, mine.len() as f64);
            if !enough(mine.len()) {
                continue;
            }
            let fields = [
                (
                    [TierField::TtftP50, TierField::TtftP95, TierField::TtftP99],
                    percentiles(&mine, |s| s.ttft_ms),
                ),
                (
                    [TierField::E2eP50, TierField::E2eP95, TierField::E2eP99],
                    percentiles(&mine, |s| s.e2e_ms),
                ),
                (
                    [TierField::WaitP50, TierField::WaitP95, TierField::WaitP99],
                    percentiles(&mine, |s| s.wait_ms),
                ),
            ];
            for (names, values) in fields {
                for (f, v) in names.into_iter().zip(values) {
                    slot.set(f, v);
                }
            }
            let oldest = mine.iter().filter_map(|s| s.wait_ms).fold(0.0, f64::max);
            slot.set(TierField::OldestWait, oldest);
            slot.set(
                TierField::Queued,
                mean(&mine, &|s| s.wait_ms.unwrap_or(0.0)),
            );
            slot.set(TierField::SloAttainment, share(&mine, |s| s.met_slo));
            slot.set(TierField::ErrorRate, share(&mine, |s| s.error));
            slot.set(TierField::FallbackRate, share(&mine, |s| s.fallback));
            slot.set(
                TierField::DeadlineMisses,
                mine.iter().filter(|s| s.deadline_miss).count() as f64,
            );
        }
        for (i, p) in g.pools.iter().enumerate() {
            let Some(slot) = base.pools.get_mut(i) else {
                continue;
            };
            let mine: Vec<&Sample> = ss
                .iter()
                .copied()
                .filter(|s| s.pool.as_deref() == Some(p.name.as_str()))
                .collect();
            if !enough(ss.len()) {
                slot.utilization = 0.0;
                slot.kv_occupancy = 0.0;
            }
            (slot.queued, slot.running) = if enough(mine.len()) {
                (
                    mean(&mine, &|s| s.wait_ms.unwrap_or(0.0)),
                    mean(&mine, &|s| {
                        s.e2e_ms.unwrap_or(0.0) - s.wait_ms.unwrap_or(0.0)
                    }),
                )
            } else {
                (0.0, 0.0)
            };
        }
        base.error_rate = if enough(ss.len()) {
            share(&ss, |s| s.error)
        } else {
            0.0
        };
        for (i, t) in g.tenants.iter().enumerate() {
            let Some(slot) = base.tenants.get_mut(i) else {
                continue;
            };
            let mine: Vec<&Sample> = ss
                .iter()
                .copied()
                .filter(|s| s.tenant.as_deref() == Some(t.name.as_str()))
                .collect();
            slot.requests = mine.len() as f64;
            (slot.deadline_misses, slot.in_flight) = if enough(mine.len()) {
                (
                    mine.iter().filter(|s| s.deadline_miss).count() as f64,
                    mean(&mine, &|s| s.at_ms - arrived(s)).round() as u64,
                )
            } else {
                (0.0, 0)
            };
        }
        base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: f64, tier: &str, ttft: f64, error: bool, canary: bool) -> Sample {
        Sample {
            at_ms: at,
            tier: tier.into(),
            tenant: Some("x".into()),
            ttft_ms: (!error).then_some(ttft),
            e2e_ms: (!error).then_some(ttft * 2.0),
            error,
            met_slo: !error && ttft < 500.0,
            deadline_miss: error,
            canary,
            pool: (!error).then(|| "p".to_string()),
            wait_ms: (!error).then_some(ttft / 2.0),
            fallback: error,
        }
    }

    const POLICY: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier hi { priority 100 slo { ttft 500ms } }
tier lo { priority 10 }
tenant x { owner "o" tiers [hi] }
classify { default => tier hi }
route [hi, lo] m { default => fp16 }
rollout {
  rollback when tier(hi).ttft_p95 > 2s for 1m
  rollback when error_rate > 2%
  rollback when tier(hi).slo_attainment < 90%
}
"#;

    #[test]
    fn p95_is_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(p95(&mut v), Some(95.0));
        assert_eq!(p95(&mut [3.0]), Some(3.0));
        assert_eq!(p95(&mut []), None);
    }

    #[test]
    fn signals_come_from_the_window_and_trip_the_policys_conditions() {
        let g = crate::compile::compile_str("t.kiln", POLICY).graph.unwrap();
        let mut w = Window::new(60_000.0, 1000);
        for i in 0..20 {
            w.push(sample(f64::from(i), "hi", 3000.0, i % 5 == 0, i % 2 == 0));
        }
        let s = w.signals(&g, Signals::idle(&g), 100.0, false, 10);
        let hi = g.tier_id("hi").unwrap() as usize;
        assert_eq!(s.tiers[hi].get(TierField::TtftP95), 3000.0);
        assert_eq!(s.error_rate, 20.0);
        assert_eq!(s.tiers[hi].get(TierField::SloAttainment), 0.0);
        assert_eq!(s.tenants[0].deadline_misses, 4.0);
        let conds = &g.rollout.as_ref().unwrap().rollbacks;
        for c in conds {
            assert!(
                c.cond.eval_signals(&s, &mut crate::graph::trace::NoTrace),
                "{}",
                c.text
            );
        }
        // Too few samples: healthy.
        let s = w.signals(&g, Signals::idle(&g), 100.0, false, 50);
        assert_eq!(
            (s.tiers[hi].get(TierField::TtftP95), s.error_rate),
            (0.0, 0.0)
        );
        assert!(conds
            .iter()
            .all(|c| !c.cond.eval_signals(&s, &mut crate::graph::trace::NoTrace)));
        // Canary only: half of them.
        assert_eq!(w.summary(100.0, true).requests, 10);
        // The window slides.
        w.prune(60_010.0);
        assert_eq!(w.summary(60_010.0, false).requests, 10);
        assert_eq!(w.summary(60_015.0, false).requests, 5);
    }

    /// A request that went wrong in every way a rollback condition reads.
    fn bad(at: f64, canary: bool) -> Sample {
        Sample {
            at_ms: at,
            tier: "hi".into(),
            tenant: Some("x".into()),
            ttft_ms: Some(3000.0),
            e2e_ms: Some(6000.0),
            error: true,
            met_slo: false,
            deadline_miss: true,
            canary,
            pool: Some("p".into()),
            wait_ms: Some(1500.0),
            fallback: true,
        }
    }

    /// Every traffic signal a rollback condition can read, each with a
    /// threshold that bad requests cross.
    const CONDITIONS: &[&str] = &[
        "tier(hi).ttft_p50 > 2s",
        "tier(hi).ttft_p95 > 2s",
        "tier(hi).ttft_p99 > 2s",
        "tier(hi).e2e_p50 > 5s",
        "tier(hi).e2e_p95 > 5s",
        "tier(hi).e2e_p99 > 5s",
        "tier(hi).wait_p50 > 1s",
        "tier(hi).wait_p95 > 1s",
        "tier(hi).wait_p99 > 1s",
        "tier(hi).oldest_wait > 1s",
        "tier(hi).queued > 2",
        "tier(hi).slo_attainment < 90%",
        "tier(hi).error_rate > 20%",
        "tier(hi).fallback_rate > 20%",
        "tier(hi).deadline_misses > 2",
        "error_rate > 2%",
        "pool(p).queued > 2",
        "pool(p).running > 2",
        "pool(p).utilization > 90%",
        "pool(p).kv_occupancy > 90%",
        "tenant(x).deadline_misses > 2",
        "tenant(x).in_flight > 2",
    ];

    fn holds(cond: &str, w: &Window, now: f64, canary_only: bool, min_samples: u64) -> bool {
        let text = POLICY.replace(
            "  rollback when error_rate > 2%\n",
            &format!("  rollback when {cond}\n"),
        );
        let g = crate::compile::compile_str("t.kiln", &text).graph.unwrap();
        let mut base = Signals::idle(&g);
        // The scheduler's figures, over all traffic: the pool is flat out.
        base.pools[0].utilization = 99.0;
        base.pools[0].kv_occupancy = 99.0;
        base.pools[0].queued = 500.0;
        base.pools[0].running = 500.0;
        let s = w.signals(&g, base, now, canary_only, min_samples);
        let c = &g.rollout.as_ref().unwrap().rollbacks[1];
        assert_eq!(c.text, cond);
        c.cond.eval_signals(&s, &mut crate::graph::trace::NoTrace)
    }

    #[test]
    fn every_rollback_signal_is_the_canarys_own_and_guarded_by_min_samples() {
        let now = 100_000.0;
        for n in [1usize, 3, 19] {
            // Fewer canary requests than min_samples, all bad, among many
            // bad requests the active version decided: healthy.
            let mut w = Window::new(60_000.0, 10_000);
            for i in 0..200 {
                w.push(bad(now - 10.0 * i as f64, false));
            }
            for i in 0..n {
                w.push(bad(now - 7.0 * i as f64, true));
            }
            for cond in CONDITIONS {
                assert!(
                    !holds(cond, &w, now, true, 20),
                    "{cond} tripped on {n} canary requests"
                );
                // Without the canary filter the same window trips it.
                assert!(holds(cond, &w, now, false, 20), "{cond} over all traffic");
            }
        }
        // Enough canary requests: each condition trips on them.
        let mut w = Window::new(60_000.0, 10_000);
        for i in 0..25 {
            w.push(bad(now - 10.0 * i as f64, true));
        }
        for cond in CONDITIONS {
            assert!(
                holds(cond, &w, now, true, 20),
                "{cond} on 25 bad canary requests"
            );
        }
        // Good canary requests among bad active ones: nothing trips but the
        // pool's hardware figures, which are the whole pool's.
        let mut w = Window::new(60_000.0, 10_000);
        for i in 0..200 {
            w.push(bad(now - 10.0 * i as f64, false));
            w.push(sample(now - 10.0 * i as f64, "hi", 10.0, false, true));
        }
        for cond in CONDITIONS {
            let hardware = cond.contains("utilization") || cond.contains("kv_occupancy");
            assert_eq!(
                holds(cond, &w, now, true, 20),
                hardware,
                "{cond} on good canary requests"
            );
        }
    }

    #[test]
    fn requests_are_counted_and_occupancy_is_a_mean_over_the_window() {
        let g = crate::compile::compile_str("t.kiln", POLICY).graph.unwrap();
        let hi = g.tier_id("hi").unwrap() as usize;
        let now = 10_000.0;
        for n in 1..40u32 {
            let mut w = Window::new(60_000.0, 10_000);
            // Each waited 1s and ran 1s, arriving one after another over 10s.
            for i in 0..n {
                let mut s = bad(now - 8000.0 * f64::from(i) / f64::from(n), true);
                s.e2e_ms = Some(2000.0);
                s.wait_ms = Some(1000.0);
                w.push(s);
            }
            let s = w.signals(&g, Signals::idle(&g), now, true, 5);
            assert_eq!(s.tiers[hi].get(TierField::Requests), f64::from(n));
            assert_eq!(s.tenants[0].requests, f64::from(n));
            if n < 5 {
                assert_eq!(s.pools[0].queued, 0.0);
                continue;
            }
            // Summed waits over the time covered (the first arrival, 2s
            // before the oldest end, to now).
            let covered = 8000.0 * f64::from(n - 1) / f64::from(n) + 2000.0;
            let q = f64::from(n) * 1000.0 / covered;
            assert!(
                (s.pools[0].queued - q).abs() < 1e-9,
                "{n}: {}",
                s.pools[0].queued
            );
            assert!((s.pools[0].running - q).abs() < 1e-9);
            assert!((s.tiers[hi].get(TierField::Queued) - q).abs() < 1e-9);
            assert_eq!(s.tenants[0].in_flight, (2.0 * q).round() as u64);
        }
    }
}
