//! How long a batch of like items would take to drain, from the
//! scheduler's own view: the Batches API says at submission (and while a
//! batch runs) whether it will make its completion window.
//!
//! The estimate: decide one representative item as the policy would now
//! (tier, route); its first item starts when the work ordered ahead of it
//! has drained (the same queue-ahead estimate admission uses); the rest
//! take each its roofline work on the routed replicas (prefill, then one
//! decode step per output token at a full batch), on the share of those
//! replicas the tiers ranked above it leave (by their admitted token rate
//! lately, never below a twentieth). Pure: it reads the scheduler's state
//! and changes nothing.

use super::{Estimating, Scheduler, SEC};
use crate::graph::{Request, TierId};

/// A drain estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    /// The tier the items classify into.
    pub tier: TierId,
    /// Scheduler seconds from now until the last item would finish.
    pub secs: f64,
    /// Tokens per second left for the items (after higher tiers).
    pub tokens_per_s: f64,
    /// Of `secs`: until the first item starts (the work queued ahead).
    pub start_secs: f64,
    /// Of `secs`: each item's share of the drain (`secs = start_secs +
    /// items × item_secs`), so work not yet queued can be added up.
    pub item_secs: f64,
    /// One item alone on a replica, start to last token: what bounds a
    /// batch that runs few items at once (`kiln_max_in_flight`).
    pub item_latency_secs: f64,
}

impl Scheduler {
    /// How long `items` requests like `req` (prompt and `max_tokens` each)
    /// would take to drain from now; `None` when the policy routes them
    /// nowhere (refused, or no replica serves the route).
    pub fn forecast(&self, req: &Request, items: u64) -> Option<Forecast> {
        let d = self.graph.decide(req, &self.signals);
        let t = d.target?;
        let key = (t.model, t.variant);
        let reps: Vec<usize> = self
            .by_variant
            .get(&key)?
            .iter()
            .copied()
            .filter(|&r| self.replicas.get(r).is_some_and(|x| x.up && !x.draining))
            // Routed to a pool: only that pool's replicas serve it.
            .filter(|&r| t.pool.is_none_or(|p| self.pool_of(r) == Some(p)))
            .collect();
        if reps.is_empty() {
            return None;
        }
        let capacity: f64 = reps
            .iter()
            .filter_map(|&r| self.replicas.get(r))
            .map(|x| x.throughput_tokens_per_s())
            .sum();
        let mine = self.rank_of(d.tier);
        let above: f64 = self
            .incoming
            .iter()
            .filter(|((k, tier, _), _)| *k == key && self.rank_of(*tier) > mine)
            .map(|(_, (_, tokens))| tokens.rate(self.now))
            .sum();
        let free = (capacity - above).max(capacity / 20.0);
        let output = d
            .max_tokens
            .min(req.max_tokens.max(1))
            .clamp(1, u64::from(u32::MAX)) as u32;
        let q = Estimating {
            key,
            tier: d.tier,
            tenant: d.tenant,
            prompt: req.prompt_tokens,
            output,
            window: None,
            own: None,
            prefix: &[],
            reference: 0,
        };
        let start = self.estimate_for(&q, &reps).raw_start as f64 / SEC as f64;
        // Each item's work at the replicas' saturated (roofline) throughput,
        // in replica-seconds, spread over the replicas' share left free.
        let prompt = req.prompt_tokens.min(u64::from(u32::MAX)) as u32;
        let work: f64 = reps
            .iter()
            .filter_map(|&r| self.replicas.get(r))
            .map(|x| x.saturated_work(prompt, output))
            .sum::<f64>()
            / reps.len() as f64;
        let free_share = if capacity > 0.0 { free / capacity } else { 0.0 };
        let item_secs = if free_share > 0.0 && work.is_finite() {
            work / (reps.len() as f64 * free_share)
        } else {
            f64::INFINITY
        };
        let secs = start + items as f64 * item_secs;
        let item_latency_secs = reps
            .iter()
            .filter_map(|&r| self.replicas.get(r))
            .map(|x| x.idle_latency_secs(prompt, output))
            .fold(f64::INFINITY, f64::min);
        (secs.is_finite() && item_secs.is_finite()).then_some(Forecast {
            tier: d.tier,
            secs,
            tokens_per_s: free,
            start_secs: start,
            item_secs,
            item_latency_secs: if item_latency_secs.is_finite() {
                item_latency_secs
            } else {
                0.0
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::testkit::{arrival, graph, sched, BASE};
    use crate::sched::Event;

    #[test]
    fn more_items_take_longer_and_work_above_slows_them() {
        let g = graph(BASE);
        let mut s = sched(&g);
        let mut r = arrival(1, "bulk", "m", 500, 200).request;
        r.max_tokens = 200;
        let one = s.forecast(&r, 100).unwrap();
        let many = s.forecast(&r, 10_000).unwrap();
        assert_eq!(g.tiers[one.tier as usize].name, "lo");
        assert!(many.secs > one.secs * 10.0, "{one:?} {many:?}");
        // The higher tier takes the replica: the same items take longer.
        for i in 0..50u64 {
            let a = arrival(100 + i, "chat", "m", 200, 50);
            s.handle(i * 10_000, Event::Arrive(a));
        }
        let loaded = s.forecast(&r, 10_000).unwrap();
        assert!(loaded.secs > many.secs, "{many:?} {loaded:?}");
        assert!(loaded.tokens_per_s < many.tokens_per_s);
    }

    #[test]
    fn nothing_to_route_to_is_none() {
        let g = graph(BASE);
        let s = sched(&g);
        let r = arrival(1, "bulk", "no-such-model", 5, 5).request;
        assert!(s.forecast(&r, 10).is_none());
    }
}
