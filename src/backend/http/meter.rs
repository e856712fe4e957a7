//! What an upstream request costs: the GPU time it is charged.
//!
//! kiln does not see an upstream's steps, only when each request takes a
//! slot and when it ends. The rule: while requests hold slots on a
//! replica, its GPUs' wall time is split evenly among them. A request
//! alone on a replica is charged the replica's GPUs × the wall time it
//! held its slot; two at once are charged half each for the time they
//! overlap. Summed over requests, the charge is the replica's GPUs × the
//! time it had any request (never a GPU-second twice, never idle time),
//! which is what the simulated backend charges too (each step's time to
//! the sequences in its batch). The count is this gateway's: replicas of
//! a fleet sharing an upstream each split among their own requests.
//!
//! [`Meter`] integrates `gpus / holding` over time (processor sharing);
//! a [`Hold`] reads its charge as the integral's growth since it began.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// One upstream replica's GPU-time ledger. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Meter {
    gpus: u32,
    ledger: Mutex<Ledger>,
}

#[derive(Debug)]
struct Ledger {
    /// Requests holding a slot now.
    holding: u32,
    /// Since when `per_request` is up to date.
    last: Instant,
    /// GPU-seconds each request holding a slot has been charged since the
    /// meter began: ∫ gpus / holding dt over the time `holding` > 0.
    per_request: f64,
}

impl Ledger {
    fn advance(&mut self, gpus: u32, now: Instant) {
        if self.holding > 0 {
            let dt = now.saturating_duration_since(self.last).as_secs_f64();
            self.per_request += dt * f64::from(gpus) / f64::from(self.holding);
        }
        if now > self.last {
            self.last = now;
        }
    }
}

impl Meter {
    /// A meter for a replica of `gpus` GPUs.
    pub fn new(gpus: u32) -> Arc<Meter> {
        Arc::new(Meter {
            gpus,
            ledger: Mutex::new(Ledger {
                holding: 0,
                last: Instant::now(),
                per_request: 0.0,
            }),
        })
    }

    /// The replica's GPUs.
    pub fn gpus(&self) -> u32 {
        self.gpus
    }

    /// Requests holding a slot now.
    pub fn holding(&self) -> u32 {
        self.lock().holding
    }

    /// A request takes a slot now; its charge runs until the [`Hold`] is
    /// dropped.
    pub fn hold(self: &Arc<Self>) -> Hold {
        self.hold_at(Instant::now())
    }

    fn hold_at(self: &Arc<Self>, now: Instant) -> Hold {
        let mut l = self.lock();
        l.advance(self.gpus, now);
        l.holding = l.holding.saturating_add(1);
        Hold {
            meter: Arc::clone(self),
            from: l.per_request,
            ended: None,
            since: now,
            first_token: None,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // A poisoned ledger is still a ledger: the panic that poisoned it
        // interrupted no update half-way (each is one assignment).
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Told how long a request waited for its first token on the replica.
pub type FirstTokenSink = Arc<dyn Fn(std::time::Duration) + Send + Sync>;

/// One request's slot on a metered replica; releases it when dropped.
pub struct Hold {
    meter: Arc<Meter>,
    /// The meter's per-request integral when the slot was taken.
    from: f64,
    /// Its charge, once released.
    ended: Option<f64>,
    /// When the slot was taken.
    since: Instant,
    /// Where its time to first token goes, once (the adaptive limit).
    first_token: Option<FirstTokenSink>,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("from", &self.from)
            .field("ended", &self.ended)
            .field("since", &self.since)
            .finish_non_exhaustive()
    }
}

impl Hold {
    /// Sends its time to first token to `sink` ([`Hold::first_token`]).
    pub fn on_first_token(mut self, sink: FirstTokenSink) -> Hold {
        self.first_token = Some(sink);
        self
    }

    /// The request's first token arrived: its wait since it took the
    /// slot goes to the sink (the first call only).
    pub fn first_token(&mut self) {
        if let Some(sink) = self.first_token.take() {
            sink(self.since.elapsed());
        }
    }

    /// GPU-seconds charged so far (the final charge once released).
    pub fn gpu_seconds(&self) -> f64 {
        self.gpu_seconds_at(Instant::now())
    }

    fn gpu_seconds_at(&self, now: Instant) -> f64 {
        if let Some(c) = self.ended {
            return c;
        }
        let mut l = self.meter.lock();
        l.advance(self.meter.gpus, now);
        (l.per_request - self.from).max(0.0)
    }

    /// Releases the slot now and returns the final charge (dropping does
    /// the same).
    pub fn release(&mut self) -> f64 {
        self.release_at(Instant::now())
    }

    fn release_at(&mut self, now: Instant) -> f64 {
        if let Some(c) = self.ended {
            return c;
        }
        let mut l = self.meter.lock();
        l.advance(self.meter.gpus, now);
        let charge = (l.per_request - self.from).max(0.0);
        l.holding = l.holding.saturating_sub(1);
        self.ended = Some(charge);
        charge
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn alone_a_request_pays_the_replicas_gpus_for_its_whole_time() {
        let m = Meter::new(4);
        let t0 = Instant::now();
        let mut h = m.hold_at(t0);
        let c = h.release_at(t0 + Duration::from_secs(3));
        assert!(close(c, 12.0), "{c}");
        assert_eq!(m.holding(), 0);
        // Released: the charge stays.
        assert!(close(h.gpu_seconds_at(t0 + Duration::from_secs(9)), 12.0));
    }

    #[test]
    fn overlapping_requests_split_the_time_they_share() {
        // 2 GPUs. a: 0–4 s, b: 2–6 s. Overlap 2–4 s is split.
        let m = Meter::new(2);
        let t0 = Instant::now();
        let s = |x: u64| t0 + Duration::from_secs(x);
        let mut a = m.hold_at(s(0));
        let mut b = m.hold_at(s(2));
        assert!(close(a.gpu_seconds_at(s(3)), 2.0 * 2.0 + 1.0));
        let ca = a.release_at(s(4));
        let cb = b.release_at(s(6));
        assert!(close(ca, 2.0 * 2.0 + 2.0), "{ca}");
        assert!(close(cb, 2.0 + 2.0 * 2.0), "{cb}");
        // Never a GPU-second twice: the replica was busy 6 s on 2 GPUs.
        assert!(close(ca + cb, 12.0));
        // Idle time is nobody's.
        let mut c = m.hold_at(s(10));
        assert!(close(c.release_at(s(11)), 2.0));
    }

    #[test]
    fn a_dropped_hold_frees_its_slot() {
        let m = Meter::new(1);
        {
            let _h = m.hold();
            assert_eq!(m.holding(), 1);
        }
        assert_eq!(m.holding(), 0);
    }
}
