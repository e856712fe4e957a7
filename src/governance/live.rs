//! Live metrics for rollback conditions: a rolling window of finished
//! requests (served or refused), summarised per tier into the signals a
//! rollout's `rollback when …` conditions read: `tier(T).ttft_p95`,
//! `tier(T).e2e_p95`, `tier(T).slo_attainment`, `error_rate` and
//! `tenant(X).deadline_misses`.
//!
//! * `error_rate`: requests answered with a 5xx status (no capacity, queue
//!   timeout, upstream failure, a policy's own 503) over all requests, %.
//! * `slo_attainment`: requests of the tier that met its SLO (TTFT,
//!   end-to-end p95 target and completion window, like the simulator's
//!   reports) over the tier's requests; refusals count as misses.
//! * A tier with fewer than `min_samples` requests in the window reads as
//!   healthy (TTFT 0, attainment 100%), and so does the error rate, so that
//!   one slow request among three cannot roll a version back.
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
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() as f64) * 0.95).ceil() as usize;
    v.get(rank.clamp(1, v.len()) - 1).copied()
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
    /// pools and the rest come from the scheduler) from the window.
    pub fn signals(
        &self,
        g: &DecisionGraph,
        mut base: Signals,
        now: f64,
        canary_only: bool,
        min_samples: u64,
    ) -> Signals {
        let live = self.summary(now, canary_only);
        for (i, t) in g.tiers.iter().enumerate() {
            let Some(slot) = base.tiers.get_mut(i) else {
                continue;
            };
            slot.set(TierField::TtftP95, 0.0);
            slot.set(TierField::E2eP95, 0.0);
            slot.set(TierField::SloAttainment, 100.0);
            if let Some(l) = live
                .tiers
                .get(&t.name)
                .filter(|l| l.requests >= min_samples)
            {
                slot.set(TierField::TtftP95, l.ttft_p95_ms.unwrap_or(0.0));
                slot.set(TierField::E2eP95, l.e2e_p95_ms.unwrap_or(0.0));
                slot.set(TierField::SloAttainment, l.slo_attainment.unwrap_or(100.0));
            }
        }
        base.error_rate = if live.requests >= min_samples {
            live.error_rate
        } else {
            0.0
        };
        let mut misses: BTreeMap<&str, f64> = BTreeMap::new();
        for s in self.recent(now, canary_only).filter(|s| s.deadline_miss) {
            if let Some(t) = &s.tenant {
                *misses.entry(t.as_str()).or_default() += 1.0;
            }
        }
        for (i, t) in g.tenants.iter().enumerate() {
            if let Some(slot) = base.tenants.get_mut(i) {
                slot.deadline_misses = misses.get(t.name.as_str()).copied().unwrap_or(0.0);
            }
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
}
