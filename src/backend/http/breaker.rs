//! The circuit breaker: a pure state machine fed explicit instants.

use super::MAX_DURATION;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The state of an upstream's circuit breaker, as `/admin` and `/readyz`
/// show it: `{"state":"closed"}`, `{"state":"open","retry_in_ms":1234}`,
/// `{"state":"half_open"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum BreakerState {
    /// Requests flow.
    Closed,
    /// Requests are refused until `until` (serialized as the milliseconds
    /// left from the moment of serialization).
    Open {
        #[serde(rename = "retry_in_ms", serialize_with = "serialize_until")]
        until: Instant,
    },
    /// One trial request may go through; its outcome closes or reopens.
    HalfOpen,
}

pub(super) fn serialize_until<S: serde::Serializer>(
    until: &Instant,
    s: S,
) -> Result<S::Ok, S::Error> {
    let left = until.saturating_duration_since(Instant::now()).as_millis();
    s.serialize_u64(u64::try_from(left).unwrap_or(u64::MAX))
}

/// The circuit breaker as a pure state machine: every method that depends
/// on time takes `now`, so tests drive it without sleeping.
///
/// Closed → (`threshold` consecutive failures) → Open for `open_for` →
/// HalfOpen, which lets exactly one trial call through → its success
/// closes, its failure opens again.
///
/// Health checks count in every phase: a failed check while open keeps
/// it open for another `open_for` from now (so a dead upstream whose
/// checks keep failing never looks ready), and while half-open it opens
/// again. A passed check closes the breaker only when no request failed
/// since the last success: a replica whose `/health` answers while its
/// requests fail (bad JSON, 429) must prove itself with the trial. An
/// upstream's own `Retry-After` opens it at once for that long (bounded by
/// the caller), and nothing but that period's end lets requests through.
///
/// The trial is taken either by [`Breaker::try_acquire`] (a reservation,
/// used by the next call admitted) or directly by [`Breaker::admit`] at
/// send time, so no matter how often or by whom availability is asked,
/// there is never more than one trial in flight. A reservation no call
/// uses within `open_for`, or a trial that reports nothing within
/// `trial_lease`, expires; a trial call cancelled before its answer is
/// [released](Breaker::release_trial).
#[derive(Debug, Clone)]
pub struct Breaker {
    threshold: u32,
    open_for: Duration,
    trial_lease: Duration,
    failures: u32,
    /// A request (not a health check) failed since the last success.
    request_failed: bool,
    phase: Phase,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Phase {
    Closed,
    /// `asked`: the upstream asked for this period (`Retry-After`); a
    /// passing health check does not shorten it.
    Open {
        until: Instant,
        asked: bool,
    },
    HalfOpen {
        trial: Trial,
    },
}

/// One outcome the breaker is told about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// A request was answered.
    Success,
    /// A request failed.
    Failure,
    /// The upstream refused a request and asked to wait this long
    /// (`Retry-After`, already bounded).
    RetryAfter(Duration),
    /// A health check passed.
    HealthOk,
    /// A health check failed.
    HealthFailed,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Trial {
    /// The next caller may take the trial.
    Free,
    /// `available()` said yes; the next admitted call is the trial.
    Reserved { since: Instant },
    /// The trial call is in flight.
    InFlight { since: Instant },
}

/// What [`Breaker::admit`] decided for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Circuit open, or the half-open trial is taken: do not send.
    Refused,
    /// Circuit closed: send.
    Admitted,
    /// Half-open: send, as the single trial.
    Trial,
}

impl Breaker {
    /// A closed breaker. A `threshold` of 0 is taken as 1.
    pub fn new(threshold: u32, open_for: Duration, trial_lease: Duration) -> Breaker {
        Breaker {
            threshold: threshold.max(1),
            open_for,
            trial_lease,
            failures: 0,
            request_failed: false,
            phase: Phase::Closed,
        }
    }

    /// `now + d`, saturating at the longest configurable duration.
    fn after(now: Instant, d: Duration) -> Instant {
        now.checked_add(d)
            .or_else(|| now.checked_add(MAX_DURATION))
            .unwrap_or(now)
    }

    /// Whether the trial (if half-open) is free at `now`, its holder
    /// having expired or never taken it.
    fn trial_free(&self, trial: Trial, now: Instant) -> bool {
        match trial {
            Trial::Free => true,
            Trial::Reserved { since } => now.saturating_duration_since(since) >= self.open_for,
            Trial::InFlight { since } => now.saturating_duration_since(since) >= self.trial_lease,
        }
    }

    /// Whether a request would be admitted at `now`, without taking
    /// anything: for dashboards and readiness.
    pub fn ready(&self, now: Instant) -> bool {
        match self.phase {
            Phase::Closed => true,
            Phase::Open { until, .. } => now >= until,
            Phase::HalfOpen { trial } => self.trial_free(trial, now),
        }
    }

    /// Whether a request may be sent at `now`: always when closed; when the
    /// open period is over and the trial is free, the caller reserves it
    /// (the next admitted call is the trial); otherwise no.
    pub fn try_acquire(&mut self, now: Instant) -> bool {
        if matches!(self.phase, Phase::Closed) {
            return true;
        }
        if !self.ready(now) {
            return false;
        }
        self.phase = Phase::HalfOpen {
            trial: Trial::Reserved { since: now },
        };
        true
    }

    /// Admission of a call about to be sent at `now`. In half-open, the
    /// call takes a reserved trial, or a free one; with the trial in
    /// flight it is refused.
    pub fn admit(&mut self, now: Instant) -> Admission {
        let take = match self.phase {
            Phase::Closed => return Admission::Admitted,
            Phase::Open { until, .. } => now >= until,
            Phase::HalfOpen {
                trial: Trial::Reserved { .. },
            } => true,
            Phase::HalfOpen { trial } => self.trial_free(trial, now),
        };
        if !take {
            return Admission::Refused;
        }
        self.phase = Phase::HalfOpen {
            trial: Trial::InFlight { since: now },
        };
        Admission::Trial
    }

    /// The upstream answered a request: close. Returns whether the
    /// breaker was not closed before.
    pub fn on_success(&mut self) -> bool {
        self.failures = 0;
        self.request_failed = false;
        let was_closed = matches!(self.phase, Phase::Closed);
        self.phase = Phase::Closed;
        !was_closed
    }

    /// A health check passed at `now`: closes, unless a request failed
    /// since the last success (the trial decides then) or the upstream
    /// asked for an open period that is not over. Returns whether this
    /// closed the breaker.
    pub fn on_health_ok(&mut self, now: Instant) -> bool {
        if self.request_failed {
            return false;
        }
        if let Phase::Open { until, asked: true } = self.phase {
            if now < until {
                return false;
            }
        }
        self.on_success()
    }

    /// A request failed at `now`. Returns whether this opened the
    /// breaker. A failure while already open (a request sent before it
    /// opened) does not extend the open period.
    pub fn on_failure(&mut self, now: Instant) -> bool {
        self.failures = self.failures.saturating_add(1);
        self.request_failed = true;
        match self.phase {
            Phase::Closed if self.failures < self.threshold => false,
            Phase::Closed | Phase::HalfOpen { .. } => {
                self.phase = Phase::Open {
                    until: Self::after(now, self.open_for),
                    asked: false,
                };
                true
            }
            Phase::Open { .. } => false,
        }
    }

    /// A health check failed at `now`: counted in every phase. Closed, it
    /// counts toward the threshold; half-open, it opens again; open (its
    /// period over or not), it keeps the breaker open for `open_for` from
    /// now. Returns whether this opened the breaker (from closed, half-open
    /// or an open period that was over).
    pub fn on_health_failed(&mut self, now: Instant) -> bool {
        self.failures = self.failures.saturating_add(1);
        let next = Self::after(now, self.open_for);
        match self.phase {
            Phase::Closed if self.failures < self.threshold => false,
            Phase::Closed | Phase::HalfOpen { .. } => {
                self.phase = Phase::Open {
                    until: next,
                    asked: false,
                };
                true
            }
            Phase::Open { until, asked } => {
                self.phase = Phase::Open {
                    until: until.max(next),
                    asked,
                };
                now >= until
            }
        }
    }

    /// The upstream refused a request at `now` and asked to wait `wait`
    /// (its `Retry-After`): open at once until then (never shortening an
    /// open period). Returns whether this opened the breaker.
    pub fn on_retry_after(&mut self, now: Instant, wait: Duration) -> bool {
        self.failures = self.failures.saturating_add(1);
        self.request_failed = true;
        let until = Self::after(now, wait);
        match self.phase {
            Phase::Open { until: old, .. } if old > now => {
                self.phase = Phase::Open {
                    until: old.max(until),
                    asked: true,
                };
                false
            }
            _ => {
                self.phase = Phase::Open { until, asked: true };
                true
            }
        }
    }

    /// The trial call ended without an outcome (cancelled before an
    /// answer): the next caller may take the trial.
    pub fn release_trial(&mut self) {
        if let Phase::HalfOpen {
            trial: Trial::InFlight { .. },
        } = self.phase
        {
            self.phase = Phase::HalfOpen { trial: Trial::Free };
        }
    }

    /// The state at `now` (an open period that is over shows as half-open).
    pub fn state(&self, now: Instant) -> BreakerState {
        match self.phase {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { until, .. } if now < until => BreakerState::Open { until },
            Phase::Open { .. } | Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Consecutive failures so far (reset by a success).
    pub fn consecutive_failures(&self) -> u32 {
        self.failures
    }
}

/// A poisoned lock only means another thread panicked while holding it;
/// the breaker's state is still consistent (every update is one assignment).
pub(super) fn lock(breaker: &Mutex<Breaker>) -> MutexGuard<'_, Breaker> {
    breaker.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records an outcome in the shared breaker, logging state changes.
pub(super) fn record(breaker: &Mutex<Breaker>, name: &str, outcome: Outcome) {
    let now = Instant::now();
    let mut b = lock(breaker);
    let (opened, closed) = match outcome {
        Outcome::Success => (false, b.on_success()),
        Outcome::HealthOk => (false, b.on_health_ok(now)),
        Outcome::Failure => (b.on_failure(now), false),
        Outcome::HealthFailed => (b.on_health_failed(now), false),
        Outcome::RetryAfter(wait) => (b.on_retry_after(now, wait), false),
    };
    let failures = b.consecutive_failures();
    drop(b);
    if opened {
        tracing::warn!(
            upstream = name,
            failures,
            ?outcome,
            "circuit breaker opened"
        );
    } else if closed {
        tracing::info!(upstream = name, "circuit breaker closed");
    }
}
