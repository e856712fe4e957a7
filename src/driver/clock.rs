//! The driver's clocks: the wall clock (optionally sped up, for the
//! simulated backend) and a virtual clock that moves only when told to,
//! for running the gateway against a recorded trace deterministically.

use crate::sched::Micros;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Scheduler time in microseconds since the clock started.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Micros;

    /// Resolves once the clock has passed `t` (when [`now`](Clock::now)
    /// is greater than `t`): the moment a timer due at `t` fires.
    fn passed(&self, t: Micros) -> impl Future<Output = ()> + Send;
}

/// Real time, `speed` times faster (the simulator's `--sim-speed`).
#[derive(Debug, Clone)]
pub struct WallClock {
    start: Instant,
    speed: f64,
}

impl WallClock {
    /// A clock starting now; a speed that is not a positive number is 1.
    pub fn new(speed: f64) -> WallClock {
        WallClock {
            start: Instant::now(),
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
        }
    }

    fn instant_of(&self, t: Micros) -> Instant {
        let secs = t as f64 / 1e6 / self.speed;
        // Far enough away never to fire; clamps absurd timers.
        let secs = if secs.is_finite() { secs.min(1e9) } else { 1e9 };
        self.start + Duration::from_secs_f64(secs.max(0.0))
    }
}

impl Clock for WallClock {
    fn now(&self) -> Micros {
        (self.start.elapsed().as_secs_f64() * self.speed * 1e6) as Micros
    }

    fn passed(&self, t: Micros) -> impl Future<Output = ()> + Send {
        tokio::time::sleep_until(self.instant_of(t.saturating_add(1)))
    }
}

/// Time that moves only when [`VirtualClock::advance_to`] says so. Clones
/// share one clock.
#[derive(Debug, Clone)]
pub struct VirtualClock {
    now: Arc<watch::Sender<Micros>>,
}

impl Default for VirtualClock {
    fn default() -> Self {
        VirtualClock {
            now: Arc::new(watch::Sender::new(0)),
        }
    }
}

impl VirtualClock {
    pub fn new() -> VirtualClock {
        VirtualClock::default()
    }

    /// Moves the clock forward to `t` (never back).
    pub fn advance_to(&self, t: Micros) {
        self.now.send_if_modified(|now| {
            if t > *now {
                *now = t;
                true
            } else {
                false
            }
        });
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Micros {
        *self.now.borrow()
    }

    fn passed(&self, t: Micros) -> impl Future<Output = ()> + Send {
        let mut rx = self.now.subscribe();
        async move {
            // An error means the clock is gone: nothing will ever pass.
            if rx.wait_for(|now| *now > t).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}
