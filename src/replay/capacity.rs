//! Capacity at SLO: the largest factor by which the recorded traffic's
//! arrival rate can be scaled (arrival times divided by it; above 1 is
//! more load) while every tier still meets its SLO often enough. Pure: the
//! search takes a predicate (the caller replays at a scale and judges the
//! report), so it is tested on fake monotone predicates.
//!
//! Search: start at 1, double (or halve) until the verdict changes or the
//! bracket bound ([`Search::lo`], [`Search::hi`]) is reached, then bisect
//! (geometrically) until the passing and failing scales are within
//! [`Search::precision`] of each other or [`Search::max_replays`] is spent.
//! Deterministic: the same predicate gives the same scales.

use super::report::Report;
use crate::sched::Micros;
use serde::Serialize;

/// What "meets its SLO" means for capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Share of a TTFT tier's requests (refused = miss) within the TTFT SLO.
    pub ttft: f64,
    /// Share of a completion-window tier's requests finished in the window.
    pub window: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            ttft: 0.99,
            window: 0.99,
        }
    }
}

/// A report judged against the thresholds.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub pass: bool,
    /// The tier with the least margin (the first failing one, by margin,
    /// when it fails); `None` when no tier has a TTFT SLO or a window.
    pub binding: Option<String>,
}

/// Whether every tier with a TTFT SLO, and every completion-window tier,
/// meets its threshold in `r`.
pub fn judge(r: &Report, th: Thresholds) -> Verdict {
    let worst = least_margin(r, th, |_| true);
    Verdict {
        pass: worst.as_ref().is_none_or(|(m, _)| *m >= -1e-9),
        binding: worst.map(|(_, n)| n),
    }
}

/// The tier with the least margin over its thresholds (negative: it
/// fails) among those `keep` names, and that margin; `None` when none of
/// them has a TTFT SLO or a window.
pub fn least_margin(
    r: &Report,
    th: Thresholds,
    keep: impl Fn(&str) -> bool,
) -> Option<(f64, String)> {
    let mut worst: Option<(f64, &str)> = None;
    for t in r.tiers.iter().filter(|t| keep(&t.name)) {
        let margins = [
            t.ttft_attainment.map(|a| a - th.ttft),
            t.window_attainment.map(|a| a - th.window),
        ];
        for m in margins.into_iter().flatten() {
            if worst.is_none_or(|(w, _)| m < w) {
                worst = Some((m, t.name.as_str()));
            }
        }
    }
    worst.map(|(m, n)| (m, n.to_string()))
}

/// Search bounds and budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Search {
    pub lo: f64,
    pub hi: f64,
    /// Stop when the failing scale is within this ratio of the passing one.
    pub precision: f64,
    pub max_replays: u32,
}

impl Default for Search {
    fn default() -> Self {
        Search {
            lo: 1.0 / 64.0,
            hi: 64.0,
            precision: 0.02,
            max_replays: 16,
        }
    }
}

/// Where the search ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// Bisected between a passing and a failing scale.
    Bracketed,
    /// It passes even at the highest scale tried: capacity is at least that.
    AtHighest,
    /// It fails even at the lowest scale: no capacity at SLO found.
    BelowLowest,
    /// The replay budget ran out before a failing scale was found above
    /// (or a passing one below).
    Budget,
}

/// The result of a capacity search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Found {
    /// The largest scale found to pass; `None` when none did (see `bound`).
    pub scale: Option<f64>,
    /// The smallest scale found to fail, if any.
    pub fails_at: Option<f64>,
    pub replays: u32,
    pub bound: Bound,
    /// The binding tier: the one failing at `fails_at` (or at the lowest
    /// scale); at the highest scale, the one with the least margin.
    pub binding: Option<String>,
    /// A scale above a failing one passed: the verdict is not monotone in
    /// the scale (a small trace, or a scheduler that sheds load), and the
    /// scale found is the boundary above the highest such pass found.
    pub wobbles: bool,
}

/// After bisecting, the search checks that this much above the scale
/// found fails too.
pub const CHECK_ABOVE: f64 = 0.05;

/// Finds the largest passing scale of a predicate that passes below some
/// scale and fails above it.
pub fn search(p: Search, mut judge_at: impl FnMut(f64) -> Verdict) -> Found {
    let lo_bound = p.lo.min(p.hi);
    let hi_bound = p.hi.max(p.lo);
    let budget = p.max_replays.max(1);
    let mut replays = 0u32;
    let mut run = |x: f64, replays: &mut u32| {
        *replays += 1;
        judge_at(x)
    };
    let start = 1.0f64.clamp(lo_bound, hi_bound);
    let first = run(start, &mut replays);
    let (mut good, mut bad);
    let mut binding;
    if first.pass {
        good = start;
        binding = first.binding;
        let mut x = start;
        loop {
            if x >= hi_bound {
                return Found {
                    scale: Some(good),
                    fails_at: None,
                    replays,
                    bound: Bound::AtHighest,
                    binding,
                    wobbles: false,
                };
            }
            if replays >= budget {
                return Found {
                    scale: Some(good),
                    fails_at: None,
                    replays,
                    bound: Bound::Budget,
                    binding,
                    wobbles: false,
                };
            }
            x = (x * 2.0).min(hi_bound);
            let v = run(x, &mut replays);
            if v.pass {
                good = x;
                binding = v.binding;
            } else {
                bad = x;
                binding = v.binding;
                break;
            }
        }
    } else {
        bad = start;
        binding = first.binding;
        let mut x = start;
        loop {
            if x <= lo_bound {
                return Found {
                    scale: None,
                    fails_at: Some(bad),
                    replays,
                    bound: Bound::BelowLowest,
                    binding,
                    wobbles: false,
                };
            }
            if replays >= budget {
                return Found {
                    scale: None,
                    fails_at: Some(bad),
                    replays,
                    bound: Bound::Budget,
                    binding,
                    wobbles: false,
                };
            }
            x = (x / 2.0).max(lo_bound);
            let v = run(x, &mut replays);
            if v.pass {
                good = x;
                break;
            }
            bad = x;
            binding = v.binding;
        }
    }
    let mut wobbles = false;
    loop {
        while bad / good > 1.0 + p.precision && replays < budget {
            let mid = (good * bad).sqrt();
            let v = run(mid, &mut replays);
            if v.pass {
                good = mid;
            } else {
                bad = mid;
                binding = v.binding;
            }
        }
        // A little above must fail too: where it passes, the predicate is
        // not monotone there, and the search goes on above it.
        let probe = good * (1.0 + CHECK_ABOVE);
        if replays >= budget || probe > hi_bound {
            break;
        }
        let v = run(probe, &mut replays);
        if !v.pass {
            break;
        }
        wobbles = true;
        good = probe;
        binding = v.binding;
        loop {
            if good >= hi_bound || replays >= budget {
                return Found {
                    scale: Some(good),
                    fails_at: None,
                    replays,
                    bound: if good >= hi_bound {
                        Bound::AtHighest
                    } else {
                        Bound::Budget
                    },
                    binding,
                    wobbles,
                };
            }
            let x = (good * 2.0).min(hi_bound);
            let v = run(x, &mut replays);
            binding = v.binding;
            if v.pass {
                good = x;
            } else {
                bad = x;
                break;
            }
        }
    }
    Found {
        scale: Some(good),
        fails_at: Some(bad),
        replays,
        bound: Bound::Bracketed,
        binding,
        wobbles,
    }
}

/// Arrival times divided by `scale` (above 1: the same requests, faster).
pub fn scale_times(at: Micros, scale: f64) -> Micros {
    if scale.is_finite() && scale > 0.0 {
        (at as f64 / scale).round() as Micros
    } else {
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn threshold(cap: f64) -> impl FnMut(f64) -> Verdict {
        move |x| Verdict {
            pass: x <= cap,
            binding: Some("t".into()),
        }
    }

    #[test]
    fn bisects_a_monotone_predicate_to_the_precision_within_the_budget() {
        for cap in [0.03, 0.3, 1.0, 1.5, 3.7, 20.0, 63.0] {
            let mut calls = Vec::new();
            let f = search(Search::default(), |x| {
                calls.push(x);
                threshold(cap)(x)
            });
            assert_eq!(f.bound, Bound::Bracketed, "{cap}");
            let scale = f.scale.unwrap();
            assert!(scale <= cap, "{cap}: {f:?}");
            let bad = f.fails_at.unwrap();
            assert!(bad > cap && bad / scale <= 1.02 + 1e-9, "{cap}: {f:?}");
            assert!(f.replays <= 16, "{cap}: {f:?}");
            assert_eq!(f.replays as usize, calls.len());
            assert_eq!(calls[0], 1.0);
            // Deterministic.
            assert_eq!(search(Search::default(), threshold(cap)), f);
        }
    }

    #[test]
    fn a_pass_just_above_the_boundary_moves_the_search_up() {
        // Fails in (1.1, 1.14), passes again up to 1.16: the bisection
        // converges on 1.1, the check above lands on a pass.
        let f = search(Search::default(), |x| Verdict {
            pass: x <= 1.1 || (1.14..=1.16).contains(&x),
            binding: None,
        });
        assert!(f.wobbles, "{f:?}");
        let scale = f.scale.unwrap();
        assert!((1.14..=1.16).contains(&scale), "{f:?}");
        assert!(f.fails_at.is_some_and(|b| b > 1.16));
        assert!(f.replays <= 16, "{f:?}");
        // A monotone one does not wobble.
        let f = search(Search::default(), threshold(1.5));
        assert!(!f.wobbles);
    }

    #[test]
    fn a_predicate_failing_even_at_the_lowest_scale() {
        let f = search(Search::default(), |_| Verdict {
            pass: false,
            binding: Some("chat".into()),
        });
        assert_eq!(f.bound, Bound::BelowLowest);
        assert_eq!(f.scale, None);
        assert_eq!(f.fails_at, Some(1.0 / 64.0));
        assert_eq!(f.binding.as_deref(), Some("chat"));
        assert_eq!(f.replays, 7, "1, 1/2, …, 1/64");
    }

    #[test]
    fn a_predicate_passing_at_the_highest_scale() {
        let f = search(Search::default(), threshold(f64::INFINITY));
        assert_eq!(f.bound, Bound::AtHighest);
        assert_eq!(f.scale, Some(64.0));
        assert_eq!(f.fails_at, None);
        assert_eq!(f.replays, 7, "1, 2, …, 64");
    }

    #[test]
    fn the_budget_bounds_the_replays() {
        let p = Search {
            max_replays: 4,
            ..Search::default()
        };
        let f = search(p, threshold(1.3));
        assert!(f.replays <= 4, "{f:?}");
        assert!(f.scale.is_some_and(|x| x <= 1.3));
        let f = search(p, threshold(1000.0));
        assert_eq!((f.bound, f.replays), (Bound::Budget, 4));
    }

    #[test]
    fn judge_takes_the_tier_with_the_least_margin() {
        use super::super::report::Group;
        let group = |name: &str, ttft: Option<f64>, window: Option<f64>| Group {
            name: name.into(),
            requests: 100,
            finished: 100,
            rejected: 0,
            rejects_by_reason: Default::default(),
            waits_by_reason: Default::default(),
            ttft_ms: None,
            e2e_ms: None,
            slo_attainment: 1.0,
            slo_attainment_admitted: 1.0,
            ttft_attainment: ttft,
            window_attainment: window,
            goodput_rps: 0.0,
            preemptions: 0,
            fallbacks: 0,
            deadline_misses: 0,
            gpu_seconds: 0.0,
            cost: 0.0,
            priced_gpu_seconds: 0.0,
            cache_hits: None,
            wasted_gpu_seconds: None,
            value: None,
        };
        let mut r = Report {
            scheduler: "kiln".into(),
            routing: "kiln".into(),
            requests: 0,
            duration_s: 0.0,
            gpus: 1,
            busy: 0.0,
            stepping: None,
            prefill_tok_s: 0.0,
            decode_tok_s: 0.0,
            prefill_capacity_tok_s: 0.0,
            decode_capacity_tok_s: 0.0,
            prefill_load: 0.0,
            decode_load: 0.0,
            max_service_gap: 0.0,
            models: vec![],
            tiers: Vec::new(),
            tenants: Vec::new(),
            batches: Vec::new(),
        };
        r.tiers = vec![group("a", Some(0.995), None), group("b", None, Some(0.999))];
        let th = Thresholds::default();
        assert_eq!(
            judge(&r, th),
            Verdict {
                pass: true,
                binding: Some("a".into())
            }
        );
        r.tiers[1].window_attainment = Some(0.98);
        assert_eq!(
            judge(&r, th),
            Verdict {
                pass: false,
                binding: Some("b".into())
            }
        );
        r.tiers.clear();
        assert!(judge(&r, th).pass);
        assert_eq!(scale_times(1000, 2.0), 500);
        assert_eq!(scale_times(1000, 0.0), 1000);
    }
}
