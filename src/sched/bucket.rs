//! The token bucket every quota uses (a tenant's, a tier's, a model's):
//! a minute of its rate, refilled continuously, a level that may go into
//! debt, and how it looks to a client (`x-ratelimit-*`). One type, so the
//! tenant and the scoped quotas cannot drift apart in how they refill,
//! resize or report.

use super::ratelimit::Window;
use super::{Micros, SEC};

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Bucket {
    /// Tokens (or requests) per microsecond.
    pub rate: f64,
    pub capacity: f64,
    pub level: f64,
    pub at: Micros,
}

impl Bucket {
    /// A bucket that holds one minute of its rate (`rate` per second).
    pub fn per_minute(rate_per_s: f64) -> Bucket {
        let capacity = rate_per_s * 60.0;
        Bucket {
            rate: rate_per_s / SEC as f64,
            capacity,
            level: capacity,
            at: 0,
        }
    }

    pub fn refill(&mut self, now: Micros) {
        if now > self.at {
            self.level = (self.level + self.rate * (now - self.at) as f64).min(self.capacity);
            self.at = now;
        }
    }

    /// Time until `need` is available.
    pub fn wait_for(&self, need: f64) -> Micros {
        if self.level >= need || self.rate <= 0.0 {
            return 0;
        }
        ((need - self.level) / self.rate) as Micros
    }

    /// The share of its capacity left at `now` (below 0: in debt).
    pub fn fraction(&self, now: Micros) -> f64 {
        let mut b = *self;
        b.refill(now);
        if b.capacity > 0.0 {
            b.level / b.capacity
        } else {
            0.0
        }
    }

    /// This bucket as a client sees it, in the policy's units (`scale`:
    /// the share of the limit enforced here).
    pub fn window(&self, now: Micros, scale: f64) -> Window {
        let mut b = *self;
        b.refill(now);
        let s = if scale > 0.0 { scale } else { 1.0 };
        let reset = if b.rate > 0.0 && b.level < b.capacity {
            ((b.capacity - b.level) / b.rate).ceil() as Micros
        } else {
            0
        };
        Window {
            limit: b.capacity / s,
            remaining: b.level.max(0.0) / s,
            reset,
        }
    }

    /// Sets the level to `fraction` of the capacity (the fleet's level);
    /// at most full, at least a full bucket in debt.
    pub fn set_fraction(&mut self, fraction: f64, now: Micros) {
        if fraction.is_finite() {
            self.level = fraction.clamp(-1.0, 1.0) * self.capacity;
            self.at = self.at.max(now);
        }
    }

    /// Takes over `old`'s level at `now` (a quota that changed is resized,
    /// not reset), clamped to this bucket's capacity.
    pub fn resized_from(&mut self, old: Bucket, now: Micros) {
        let mut o = old;
        o.refill(now);
        self.level = o.level.min(self.capacity);
        self.at = now;
    }
}

/// The share left of the tightest of two buckets, 0–100 (100 when
/// neither limits).
pub(super) fn remaining_percent(a: Option<&Bucket>, b: Option<&Bucket>, now: Micros) -> f64 {
    let pct = |b: &Bucket| 100.0 * b.fraction(now);
    let a = a.map_or(100.0, pct);
    let b = b.map_or(100.0, pct);
    a.min(b).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_reports_and_resizes_by_its_level() {
        let mut b = Bucket::per_minute(10.0);
        assert_eq!(b.capacity, 600.0);
        b.level = 300.0;
        assert!(b.wait_for(310.0).abs_diff(SEC) <= 1);
        let w = b.window(0, 0.5);
        assert_eq!((w.limit, w.remaining), (1200.0, 600.0));
        assert_eq!(w.reset, 30 * SEC);
        assert!((b.fraction(30 * SEC) - 1.0).abs() < 1e-12);
        let mut small = Bucket::per_minute(1.0);
        small.resized_from(b, 0);
        assert_eq!(small.level, 60.0);
        assert_eq!(remaining_percent(Some(&b), None, 0), 50.0);
        assert_eq!(remaining_percent(None, None, 0), 100.0);
    }
}
