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
        // Every arrival asks; only a new day is looked at.
        if self.base.exceptions.is_empty() || self.exceptions_date == Some(date) {
            return;
        }
        self.exceptions_date = Some(date);
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

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Action, Config, Event, Micros, Reason, ReqId, Scheduler, SEC};
    use crate::units::calendar::date_days;

    /// `fin` may have one request in flight, three over the quarter-end
    /// close (Berlin days); tier `lo` runs at priority 200 on New Year's Eve.
    const CLOSE: &str = r#"
policy { timezone "Europe/Berlin" }
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier hi { priority 100 slo { ttft 10s } }
tier lo { priority 10 slo { window 24h } }
tenant fin { owner "o" tiers [lo] quota { concurrent 1 } }
classify { default => tier lo }
route [hi, lo] m { default => fp16 }
exception close {
  tenant fin
  dates 2026-12-28..2027-01-02
  quota { concurrent 3 }
  reason "quarter-end close"
}
exception eve {
  tier lo
  dates 2026-12-31..2026-12-31
  priority 200
  reason "year-end batch"
}
"#;

    /// Three requests of `fin` at once: how many were refused for
    /// concurrency.
    fn refused(s: &mut Scheduler, first: ReqId, at: Micros) -> usize {
        let mut n = 0;
        for id in first..first + 3 {
            // Still running when the next arrives; cancelled after.
            let acts = arrive(s, at, arrival(id, "fin", "m", 10, 2000));
            n += acts
                .iter()
                .filter(|a| {
                    matches!(a, Action::Reject { id: x, reason: Reason::Concurrency, .. } if *x == id)
                })
                .count();
        }
        for id in first..first + 3 {
            s.handle(at, Event::Cancel { id });
        }
        n
    }

    #[test]
    fn a_grant_acts_inside_its_days_in_the_policys_zone_and_not_outside() {
        let g = graph(CLOSE);
        let cfg = Config {
            // 2026-12-27 22:30 UTC: 23:30 on the 27th in Berlin.
            start_unix_ms: Some(1_798_410_600_000),
            ..Config::default()
        };
        let mut s = Scheduler::new(g.clone(), plan(&g, 1_000_000), cfg);
        let hour = 3600 * SEC;
        let lo = g.tier_id("lo").unwrap() as usize;
        let (first, last) = (
            date_days(2026, 12, 28).unwrap(),
            date_days(2027, 1, 2).unwrap(),
        );
        // Every hour for nine days (requests finish well within the hour).
        for h in 0..(9 * 24) {
            let n = refused(&mut s, 10 * h, h * hour);
            let date = s.signals().date;
            let inside = (first..=last).contains(&date);
            assert_eq!(n, if inside { 0 } else { 2 }, "hour {h}, {date}");
            assert_eq!(s.exceptions_in_force().contains(&"close"), inside);
            let eve = date == date_days(2026, 12, 31).unwrap();
            assert_eq!(s.graph().tiers[lo].priority, if eve { 200 } else { 10 });
        }
        // The boundaries are Berlin's midnights, not UTC's: 23:30 UTC on
        // the 27th is the 28th in Berlin (hour 1), and 23:30 UTC on
        // 2027-01-02 is already the 3rd (hour 6 * 24 + 1).
        assert!(s.exceptions_in_force().is_empty());
    }

    #[test]
    fn no_exception_keeps_the_compiled_graph() {
        let g = graph(BASE);
        let s = sched(&g);
        assert!(std::sync::Arc::ptr_eq(s.graph(), &g));
        assert!(s.exceptions_in_force().is_empty());
    }

    #[test]
    fn a_swap_applies_the_new_versions_exceptions_at_once() {
        let old = graph(BASE);
        let g = graph(CLOSE);
        let cfg = Config {
            // 2026-12-31 12:00 UTC.
            start_unix_ms: Some(1_798_718_400_000),
            ..Config::default()
        };
        let mut s = Scheduler::new(old.clone(), plan(&old, 1_000_000), cfg);
        s.swap(SEC, g.clone(), plan(&g, 1_000_000));
        assert_eq!(s.exceptions_in_force(), vec!["close", "eve"]);
        let lo = g.tier_id("lo").unwrap() as usize;
        assert_eq!(s.graph().tiers[lo].priority, 200);
    }
}
