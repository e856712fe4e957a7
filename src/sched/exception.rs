//! Exceptions in the scheduler: when the date in the policy's zone moves
//! in or out of an exception's days, the scheduler moves to the graph in
//! force that day ([`DecisionGraph::on_date`]) the way a swap resizes:
//! quotas keep their levels, queues their order, and only the granted
//! priorities, weights, limits and reserved shares change. Time comes from
//! the scheduler's own clock, so a replay sees the same days as the
//! gateway would.

use super::swap::Remap;
use super::Scheduler;
use crate::graph::DecisionGraph;
use std::sync::Arc;

impl Scheduler {
    /// Applies the exceptions of `date` if they differ from those applied.
    pub(super) fn follow_exceptions(&mut self, date: i32) {
        if self.base.exceptions.is_empty() {
            return;
        }
        let active = self.base.active_set(date);
        if active == self.exceptions_active {
            return;
        }
        let next: Arc<DecisionGraph> = if active.iter().any(|&a| a) {
            Arc::new(self.base.on_date(date))
        } else {
            self.base.clone()
        };
        self.exceptions_active = active;
        // Same names and ids: the map is the identity.
        let map = Remap::new(&self.graph, &next);
        self.quotas = self.quotas.remap(&next, &map.tenants, self.now);
        self.scoped = self.scoped.remap(&next, &map, self.now);
        self.reserves = Scheduler::reserves_of(&next);
        let dropped = self.queues.remap(&next, &self.cfg, &map, |_| true);
        self.graph = next;
        for w in dropped {
            self.timers.remove(w.id);
            self.unpin(&w);
            self.refuse_changed(w.id, super::swap::served_tokens(&w));
        }
    }

    /// Applies the exceptions of the day the clock reads now.
    pub(super) fn follow_exceptions_now(&mut self) {
        if self.base.exceptions.is_empty() {
            return;
        }
        let c = self.civil_now();
        self.follow_exceptions(c.date);
    }

    /// The names of the exceptions in force now, in declaration order.
    pub fn exceptions_in_force(&self) -> Vec<&str> {
        self.base
            .exceptions
            .iter()
            .zip(&self.exceptions_active)
            .filter(|(_, &a)| a)
            .map(|(e, _)| e.name.as_str())
            .collect()
    }
}
