//! Holding: a tier's work kept out of dispatch while a condition is true.
//!
//! `admit batch { when tier(interactive).slo_attainment < 90% => hold }`
//! queues the arriving request (it is not refused) and holds its tier: no
//! request of the tier, new or already queued, is dispatched while the
//! rule still decides `hold`. The rule is re-decided on every event, and
//! at least every [`REVIEW`], with the live signals, for a request of the
//! tier (the last one the rule held: its tenant, model and headers), and
//! the hold ends as soon as it decides otherwise. A held request waits at
//! most its bound (`hold max_wait D`, else its completion window, else
//! [`DEFAULT_BOUND`]) and is then refused with reason `held`; one that
//! starts after a hold says `waited_for: held`.
//!
//! Holding differs from `queue D` (which only sets a request's expiry)
//! and from `reject` (which sheds): the held work keeps its place and
//! costs nothing until the protected tier recovers.

use super::{Micros, Mode, Scheduler, SEC};
use crate::graph::{Admission, Request, TierId};

/// How often a hold is re-decided when nothing else happens.
pub const REVIEW: Micros = SEC;

/// How long a held request waits when neither the rule nor its tier
/// bounds it.
pub const DEFAULT_BOUND: Micros = 30 * 60 * SEC;

impl Scheduler {
    /// The rule decided `hold` for a request of `tier`: hold the tier
    /// (re-decided later with `probe`).
    pub(super) fn start_hold(&mut self, tier: TierId, probe: &Request) {
        if self.cfg.mode != Mode::Kiln {
            return;
        }
        if let Some(h) = self.holds.get_mut(tier as usize) {
            *h = Some(probe.clone());
            self.queues.set_held(tier, true);
        }
    }

    /// How long a request held under `max_wait` (ms, from the rule) may
    /// wait: the rule's bound, else its completion window, else the default.
    pub(super) fn hold_bound(&self, max_wait: Option<f64>, window: Option<Micros>) -> Micros {
        match max_wait {
            Some(ms) if ms.is_finite() && ms > 0.0 => (ms * 1000.0) as Micros,
            _ => window.unwrap_or(DEFAULT_BOUND),
        }
    }

    /// Re-decides every hold with the live signals; releases those whose
    /// rule no longer decides `hold` for its tier.
    pub(super) fn review_holds(&mut self) {
        if self.holds.iter().all(Option::is_none) {
            return;
        }
        self.refresh_signals();
        let graph = self.graph.clone();
        for t in 0..self.holds.len() {
            let Some(probe) = self.holds[t].as_ref() else {
                continue;
            };
            let d = graph.decide(probe, &self.signals);
            let still = d.tier as usize == t && matches!(d.admission, Admission::Hold { .. });
            if !still {
                self.holds[t] = None;
                self.queues.set_held(t as TierId, false);
            }
        }
    }

    /// When a hold must next be re-decided, if any is active.
    pub(super) fn hold_wake(&self) -> Option<Micros> {
        self.holds
            .iter()
            .any(Option::is_some)
            .then(|| self.now.saturating_add(REVIEW))
    }

    /// Whether `tier` is held now.
    pub fn is_held(&self, tier: TierId) -> bool {
        self.holds.get(tier as usize).is_some_and(Option::is_some)
    }
}
