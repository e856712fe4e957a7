//! A replica's memory of the fleet's quotas, for the times it cannot ask:
//! the level of each quota's buckets the fleet last reported (so that,
//! while Redis is unreachable, the replica goes on from its share of what
//! the fleet had left rather than from a full bucket, and so that a Redis
//! that comes back empty is refilled from it rather than from nothing),
//! and what the replica spent by itself that the fleet has not been told
//! yet (reported when Redis answers again, so that the fleet's buckets
//! resume from what was actually spent).
//!
//! Levels are shares of a bucket's capacity, and a bucket holds
//! `bucket_s` seconds of its rate (a minute, less under `[sim] speed`), so
//! a level refills by 1/`bucket_s` a second whatever the rate.

use super::{Level, QuotaKey};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

/// What one replica spent of a quota by itself (tokens may be negative:
/// refunds).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spend {
    pub requests: f64,
    pub tokens: f64,
    pub gpu_seconds: f64,
}

impl Spend {
    pub fn is_zero(&self) -> bool {
        self.requests == 0.0 && self.tokens == 0.0 && self.gpu_seconds == 0.0
    }
}

/// Spending on its way to the fleet: sent until Redis answers, under one
/// id, so that a report whose answer was lost (the script ran, the call
/// timed out) is not charged again when it is resent.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Report {
    /// "" when there is nothing to charge.
    pub id: String,
    pub spend: BTreeMap<QuotaKey, Spend>,
}

/// See the module's documentation.
#[derive(Debug, Default)]
pub struct Budget {
    known: Mutex<HashMap<QuotaKey, (Level, Instant)>>,
    unsent: Mutex<BTreeMap<QuotaKey, Spend>>,
    /// The report sent and not yet answered, if any.
    pending: Mutex<Option<Report>>,
    /// Reports made so far (for their ids).
    reports: std::sync::atomic::AtomicU64,
    /// What makes this replica's report ids its own: a replica restarted
    /// under the same name starts new ids.
    boot: String,
}

/// A share refilled for `secs` seconds of a bucket holding `len` seconds
/// of its rate, at most full.
fn refilled(share: f64, secs: f64, len: f64) -> f64 {
    (share + secs.max(0.0) / super::bucket_len(len)).min(1.0)
}

impl Budget {
    pub fn new() -> Budget {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Budget {
            boot: format!("{}.{nanos}", std::process::id()),
            ..Budget::default()
        }
    }

    /// The fleet said `key`'s buckets are at `level` now.
    pub fn note(&self, key: &QuotaKey, level: Level) {
        self.note_at(key, level, Instant::now());
    }

    fn note_at(&self, key: &QuotaKey, level: Level, at: Instant) {
        if let Ok(mut k) = self.known.lock() {
            let e = k.entry(key.clone()).or_insert((Level::default(), at));
            // Each bucket as last reported; one the answer did not name
            // keeps its older level.
            e.0 = Level {
                requests: level.requests.or(e.0.requests),
                tokens: level.tokens.or(e.0.tokens),
            };
            e.1 = at;
        }
    }

    /// Where the fleet's buckets of `key` would be now had nobody spent
    /// since it last said (`None` for a bucket it never reported): where
    /// to start a bucket Redis lost.
    pub fn seed(&self, key: &QuotaKey, bucket_s: f64) -> Level {
        self.seed_at(key, bucket_s, Instant::now())
    }

    fn seed_at(&self, key: &QuotaKey, bucket_s: f64, now: Instant) -> Level {
        let Ok(k) = self.known.lock() else {
            return Level::default();
        };
        let Some((level, at)) = k.get(key) else {
            return Level::default();
        };
        let secs = now.saturating_duration_since(*at).as_secs_f64();
        Level {
            requests: level.requests.map(|f| refilled(f, secs, bucket_s)),
            tokens: level.tokens.map(|f| refilled(f, secs, bucket_s)),
        }
    }

    /// Adds what this replica spent of `key` by itself.
    pub fn spent(&self, key: QuotaKey, spend: Spend) {
        if spend.is_zero() {
            return;
        }
        if let Ok(mut u) = self.unsent.lock() {
            let e = u.entry(key).or_default();
            e.requests += spend.requests;
            e.tokens += spend.tokens;
            e.gpu_seconds += spend.gpu_seconds;
        }
    }

    /// The report to send now: the one sent before if its answer never
    /// came (the same id and spending: Redis charges it once), else what
    /// was spent since under a new id (an empty id when nothing was).
    /// Spending added meanwhile waits for the next report.
    pub fn report(&self) -> Report {
        let Ok(mut p) = self.pending.lock() else {
            return Report::default();
        };
        if let Some(r) = p.as_ref() {
            return r.clone();
        }
        let spend = self
            .unsent
            .lock()
            .map(|mut u| std::mem::take(&mut *u))
            .unwrap_or_default();
        if spend.is_empty() {
            return Report::default();
        }
        let n = self
            .reports
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let r = Report {
            id: format!("{}.{n}", self.boot),
            spend,
        };
        *p = Some(r.clone());
        r
    }

    /// Redis answered report `id`: it is charged.
    pub fn reported(&self, id: &str) {
        if let Ok(mut p) = self.pending.lock() {
            if p.as_ref().is_some_and(|r| r.id == id) {
                *p = None;
            }
        }
    }

    /// Whether spending waits to be reported.
    pub fn has_unsent(&self) -> bool {
        self.unsent.lock().map(|u| !u.is_empty()).unwrap_or(false)
            || self.pending.lock().map(|p| p.is_some()).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::super::QuotaKind;
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_seed_is_the_last_level_refilled_since() {
        let b = Budget::new();
        let k = QuotaKey::new(QuotaKind::Tier, "t");
        assert_eq!(
            b.seed(&k, 60.0),
            Level::default(),
            "never reported: no seed"
        );
        let t0 = Instant::now();
        b.note_at(
            &k,
            Level {
                requests: Some(0.25),
                tokens: None,
            },
            t0,
        );
        let s = b.seed_at(&k, 60.0, t0 + Duration::from_secs(15));
        assert!((s.requests.unwrap_or(0.0) - 0.5).abs() < 1e-9, "{s:?}");
        assert_eq!(s.tokens, None);
        let s = b.seed_at(&k, 60.0, t0 + Duration::from_secs(600));
        assert_eq!(s.requests, Some(1.0), "never past full");
    }

    #[test]
    fn a_report_is_resent_whole_until_answered_and_spending_meanwhile_waits() {
        let b = Budget::new();
        let k = QuotaKey::new(QuotaKind::Tenant, "a");
        assert_eq!(
            b.report(),
            Report::default(),
            "nothing spent: nothing to charge"
        );
        let spend = |requests: f64, tokens: f64, gpu_seconds: f64| Spend {
            requests,
            tokens,
            gpu_seconds,
        };
        b.spent(k.clone(), spend(2.0, 10.0, 0.5));
        b.spent(k.clone(), spend(1.0, -4.0, 0.25));
        let r = b.report();
        assert!(!r.id.is_empty());
        assert_eq!(r.spend.get(&k), Some(&spend(3.0, 6.0, 0.75)));
        // Spent meanwhile: not in the report being resent.
        b.spent(k.clone(), spend(5.0, 0.0, 0.0));
        assert_eq!(b.report(), r, "unanswered: the same report again");
        assert!(b.has_unsent());
        b.reported("another");
        assert_eq!(b.report(), r, "only its own answer clears it");
        b.reported(&r.id);
        let r2 = b.report();
        assert_ne!(r2.id, r.id);
        assert_eq!(r2.spend.get(&k), Some(&spend(5.0, 0.0, 0.0)));
        b.reported(&r2.id);
        assert!(!b.has_unsent());
        assert_eq!(b.report(), Report::default());
    }
}
