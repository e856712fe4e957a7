//! The driver: the one interpreter of the scheduler's actions, shared by
//! the replay (`kiln simulate`, `kiln diff`) and the gateway's executor.
//!
//! The scheduler core ([`crate::sched`]) is a pure state machine: events
//! in, actions out. Something has to turn its `Step` and `WakeAt` actions
//! into later `StepDone` and `Tick` events, in a well-defined order, and
//! hand every other action to whoever cares (the replay's outcome table,
//! the gateway's request handlers). That is this module, and it exists
//! once, so a replay predicts what the gateway does: the only differences
//! between the two are the [`Clock`] (virtual time jumping from event to
//! event, or the wall clock) and the [`Sink`] (where the actions go).
//!
//! **Order.** A timer due at `t` fires once the clock has passed `t`, after
//! every arrival at `t`; timers due at the same time fire in the order
//! they were set. The replay feeds arrivals and timers in exactly this
//! order, and the gateway on a virtual clock does too, which is what
//! `tests/replay_gateway.rs` checks.

pub mod clock;

pub use clock::{Clock, VirtualClock, WallClock};

use crate::graph::DecisionGraph;
use crate::sched::plan::Plan;
use crate::sched::{Action, Event, Micros, Scheduler};
use std::borrow::BorrowMut;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};
use std::sync::Arc;

/// Where the scheduler's actions go.
pub trait Sink {
    /// Every action, in the order the scheduler emitted it, at scheduler
    /// time `now`; `sched` is the state after the event that caused it.
    fn act(&mut self, now: Micros, action: &Action, sched: &Scheduler);

    /// The scheduler started a step on `replica` that the cost model says
    /// ends at `until`. Return true to run the step yourself (on a GPU) and
    /// report its end with [`Driver::step_ran`]; by default the driver ends
    /// it at `until`.
    fn run_step(&mut self, _replica: usize, _until: Micros, _sched: &Scheduler) -> bool {
        false
    }

    /// A step on `replica` just ended; its sequences that keep running
    /// have produced more tokens (finished ones had their `Finished`).
    fn stepped(&mut self, _replica: usize, _sched: &Scheduler) {}
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    StepDone(usize),
    Tick,
}

/// The scheduler with its timers. It owns the scheduler (the gateway) or
/// borrows it (a replay, whose caller reads the scheduler afterwards).
pub struct Driver<S: BorrowMut<Scheduler> = Scheduler> {
    sched: S,
    /// Due time, then the order the timer was set in.
    timers: BinaryHeap<Reverse<(Micros, u64, Timer)>>,
    /// Wake-ups already set, so a repeated `WakeAt` sets one timer.
    ticks: BTreeSet<Micros>,
    seq: u64,
    buf: Vec<Action>,
    events: u64,
}

impl<S: BorrowMut<Scheduler>> Driver<S> {
    pub fn new(sched: S) -> Driver<S> {
        Driver {
            sched,
            timers: BinaryHeap::new(),
            ticks: BTreeSet::new(),
            seq: 0,
            buf: Vec::new(),
            events: 0,
        }
    }

    pub fn sched(&self) -> &Scheduler {
        self.sched.borrow()
    }

    /// For settings that are not events (a canary's start and end).
    pub fn sched_mut(&mut self) -> &mut Scheduler {
        self.sched.borrow_mut()
    }

    /// Events fed so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// When the next timer is due.
    pub fn next_timer(&self) -> Option<Micros> {
        self.timers.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Feeds one event at `now` and routes the actions it caused.
    pub fn feed(&mut self, now: Micros, event: Event, sink: &mut impl Sink) {
        let stepped = match event {
            Event::StepDone { replica } => Some(replica),
            _ => None,
        };
        self.events += 1;
        self.buf.clear();
        self.buf
            .extend_from_slice(self.sched.borrow_mut().handle(now, event));
        self.dispatch(now, sink);
        if let Some(r) = stepped {
            sink.stepped(r, self.sched.borrow());
        }
    }

    /// Swaps in a new policy version between two events (see
    /// [`Scheduler::swap`]); returns the actions it caused, after routing
    /// them, so the caller can re-decide requests the swap refused.
    pub fn swap(
        &mut self,
        now: Micros,
        graph: Arc<DecisionGraph>,
        plan: Plan,
        sink: &mut impl Sink,
    ) -> Vec<Action> {
        self.buf.clear();
        self.buf
            .extend_from_slice(self.sched.borrow_mut().swap(now, graph, plan));
        let actions = self.buf.clone();
        self.dispatch(now, sink);
        actions
    }

    fn dispatch(&mut self, now: Micros, sink: &mut impl Sink) {
        let actions = std::mem::take(&mut self.buf);
        for a in &actions {
            match *a {
                Action::Step { replica, until }
                    if !sink.run_step(replica, until, self.sched.borrow()) =>
                {
                    self.set(until, Timer::StepDone(replica));
                }
                Action::WakeAt(t) if self.ticks.insert(t) => self.set(t, Timer::Tick),
                _ => {}
            }
            sink.act(now, a, self.sched.borrow());
        }
        self.buf = actions;
        self.buf.clear();
    }

    fn set(&mut self, at: Micros, timer: Timer) {
        self.timers.push(Reverse((at, self.seq, timer)));
        self.seq += 1;
    }

    /// Fires the earliest timer at its own time; false when none is set.
    pub fn fire_next(&mut self, sink: &mut impl Sink) -> bool {
        let Some(Reverse((t, _, timer))) = self.timers.pop() else {
            return false;
        };
        let event = match timer {
            Timer::StepDone(replica) => Event::StepDone { replica },
            Timer::Tick => {
                self.ticks.remove(&t);
                Event::Tick
            }
        };
        self.feed(t, event, sink);
        true
    }

    /// Fires, each at its own time, every timer the clock has passed
    /// (due before `now`), including ones those set.
    pub fn fire_due(&mut self, now: Micros, sink: &mut impl Sink) {
        while self.next_timer().is_some_and(|t| t < now) {
            self.fire_next(sink);
        }
    }

    /// A step the sink ran itself ([`Sink::run_step`]) ended at `now`,
    /// planned to end at `until`. A device faster than the cost model waits
    /// out the plan (the scheduler ignores early completions); a failed
    /// step takes the replica out of service.
    pub fn step_ran(
        &mut self,
        now: Micros,
        replica: usize,
        until: Micros,
        ok: bool,
        sink: &mut impl Sink,
    ) {
        if !ok {
            self.feed(now, Event::ReplicaDown { replica }, sink);
        } else if now < until {
            self.set(until, Timer::StepDone(replica));
        } else {
            self.feed(now, Event::StepDone { replica }, sink);
        }
    }
}
