//! Requests parked until a time (a delay window opening, a batching hold
//! ending), indexed both ways so that setting, cancelling and firing cost
//! O(log n) however many wait: a policy that holds a night's background
//! work until its window must not pay for it at every event.

use super::{Micros, ReqId};
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeSet;

#[derive(Debug, Default)]
pub(super) struct Timers {
    by_time: BTreeSet<(Micros, ReqId)>,
    at: HashMap<ReqId, Micros>,
}

impl Timers {
    /// Sets `id`'s timer (replacing any it had).
    pub fn push(&mut self, at: Micros, id: ReqId) {
        if let Some(old) = self.at.insert(id, at) {
            self.by_time.remove(&(old, id));
        }
        self.by_time.insert((at, id));
    }

    /// Clears `id`'s timer, if it has one.
    pub fn remove(&mut self, id: ReqId) {
        if let Some(at) = self.at.remove(&id) {
            self.by_time.remove(&(at, id));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_time.is_empty()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_time.len()
    }

    /// The earliest timer.
    pub fn next(&self) -> Option<Micros> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Takes every timer due at `now`, in id order (the order they fire).
    pub fn take_due(&mut self, now: Micros) -> Vec<ReqId> {
        let mut due = Vec::new();
        while let Some(&(t, id)) = self.by_time.first() {
            if t > now {
                break;
            }
            self.by_time.pop_first();
            self.at.remove(&id);
            due.push(id);
        }
        due.sort_unstable();
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_fire_once_in_id_order_and_can_be_cancelled() {
        let mut t = Timers::default();
        t.push(30, 1);
        t.push(10, 5);
        t.push(10, 2);
        t.push(20, 9);
        t.push(25, 9); // replaces 20
        t.remove(1);
        assert_eq!(t.len(), 3);
        assert_eq!(t.next(), Some(10));
        assert_eq!(t.take_due(24), vec![2, 5]);
        assert_eq!(t.take_due(24), Vec::<ReqId>::new());
        assert_eq!(t.take_due(100), vec![9]);
        assert!(t.is_empty());
    }
}
