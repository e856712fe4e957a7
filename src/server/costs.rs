//! The live cost ledger (`GET /admin/costs`): GPU-seconds and cost per
//! tenant, tier, pool, model and batch since the gateway started, recorded
//! at the same point, from the same figures, as `kiln_gpu_seconds_total`
//! and `kiln_cost_usd_total`, and summed the way `kiln simulate` sums them
//! (GPU-seconds × the tenant's `cost` per GPU-hour), so cost governance
//! reads one number everywhere.
//!
//! Bounded: the route keys come from the policy (tier, tenant, pool,
//! model: names it declares), and at most [`MAX_BATCHES`] batches are
//! kept, the least recently charged dropped first.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// Batches the ledger remembers.
pub const MAX_BATCHES: usize = 10_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spend {
    pub requests: u64,
    pub gpu_seconds: f64,
    pub cost: f64,
}

impl Spend {
    fn add(&mut self, gpu_seconds: f64, cost: f64) {
        self.requests += 1;
        self.gpu_seconds += gpu_seconds;
        self.cost += cost;
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// (tier, tenant, pool, model) → spend. hashbrown's map, so a charge
    /// looks its route up by the borrowed names ([`RouteRef`]) and copies
    /// them only for a route's first charge.
    routes: hashbrown::HashMap<[String; 4], Spend>,
    /// batch id → (last charge's sequence number, spend).
    batches: HashMap<String, (u64, Spend)>,
    seq: u64,
}

/// A route's names, borrowed: hashes as `[String; 4]` does (both hash as
/// a slice of four `str`), so the map finds a route without copying them.
#[derive(Hash)]
struct RouteRef<'a>([&'a str; 4]);

impl hashbrown::Equivalent<[String; 4]> for RouteRef<'_> {
    fn equivalent(&self, key: &[String; 4]) -> bool {
        self.0.iter().zip(key).all(|(a, b)| *a == b.as_str())
    }
}

/// Shared by the request path (charges) and the admin API (reads).
#[derive(Debug, Default)]
pub struct Ledger {
    inner: Mutex<Inner>,
}

/// One row of a breakdown.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub name: String,
    #[serde(flatten)]
    pub spend: Spend,
}

/// What `GET /admin/costs` answers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Costs {
    pub total: Spend,
    pub tenants: Vec<Row>,
    pub tiers: Vec<Row>,
    pub pools: Vec<Row>,
    pub models: Vec<Row>,
    pub batches: Vec<Row>,
}

impl Ledger {
    /// One request's GPU time and what it cost; negative or non-finite
    /// amounts count as 0.
    pub fn charge(&self, route: [&str; 4], batch: Option<&str>, gpu_seconds: f64, cost: f64) {
        let clean = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
        let (gpu_seconds, cost) = (clean(gpu_seconds), clean(cost));
        let Ok(mut g) = self.inner.lock() else { return };
        match g.routes.get_mut(&RouteRef(route)) {
            Some(s) => s.add(gpu_seconds, cost),
            None => g
                .routes
                .entry(route.map(str::to_string))
                .or_default()
                .add(gpu_seconds, cost),
        }
        if let Some(b) = batch {
            g.seq += 1;
            let seq = g.seq;
            if !g.batches.contains_key(b) && g.batches.len() >= MAX_BATCHES {
                if let Some(oldest) = g
                    .batches
                    .iter()
                    .min_by_key(|(_, (s, _))| *s)
                    .map(|(k, _)| k.clone())
                {
                    g.batches.remove(&oldest);
                }
            }
            let e = g.batches.entry(b.to_string()).or_default();
            e.0 = seq;
            e.1.add(gpu_seconds, cost);
        }
    }

    /// The breakdowns, each sorted by name.
    pub fn costs(&self) -> Costs {
        let Ok(g) = self.inner.lock() else {
            return Costs {
                total: Spend::default(),
                tenants: vec![],
                tiers: vec![],
                pools: vec![],
                models: vec![],
                batches: vec![],
            };
        };
        let by = |i: usize| -> Vec<Row> {
            let mut m: BTreeMap<&str, Spend> = BTreeMap::new();
            for (k, s) in &g.routes {
                let e = m.entry(k[i].as_str()).or_default();
                e.requests += s.requests;
                e.gpu_seconds += s.gpu_seconds;
                e.cost += s.cost;
            }
            m.into_iter()
                .map(|(name, spend)| Row {
                    name: name.to_string(),
                    spend,
                })
                .collect()
        };
        let mut total = Spend::default();
        for s in g.routes.values() {
            total.requests += s.requests;
            total.gpu_seconds += s.gpu_seconds;
            total.cost += s.cost;
        }
        let mut batches: Vec<Row> = g
            .batches
            .iter()
            .map(|(k, (_, spend))| Row {
                name: k.clone(),
                spend: *spend,
            })
            .collect();
        batches.sort_by(|a, b| a.name.cmp(&b.name));
        Costs {
            total,
            tiers: by(0),
            tenants: by(1),
            pools: by(2),
            models: by(3),
            batches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakdowns_add_up_to_the_total() {
        let l = Ledger::default();
        l.charge(["chat", "acme", "h100", "llama.fp16"], None, 2.0, 0.004);
        l.charge(["chat", "beta", "h100", "llama.fp16"], None, 1.0, 0.001);
        l.charge(
            ["batch", "acme", "a100", "llama.int4"],
            Some("batch_1"),
            4.0,
            0.008,
        );
        l.charge(
            ["batch", "acme", "a100", "llama.int4"],
            Some("batch_1"),
            f64::NAN,
            -1.0,
        );
        let c = l.costs();
        assert_eq!(c.total.requests, 4);
        assert!((c.total.gpu_seconds - 7.0).abs() < 1e-9);
        for rows in [&c.tenants, &c.tiers, &c.pools, &c.models] {
            let g: f64 = rows.iter().map(|r| r.spend.gpu_seconds).sum();
            let cost: f64 = rows.iter().map(|r| r.spend.cost).sum();
            assert!((g - c.total.gpu_seconds).abs() < 1e-9);
            assert!((cost - c.total.cost).abs() < 1e-12);
        }
        assert_eq!(c.tenants[0].name, "acme");
        assert!((c.tenants[0].spend.gpu_seconds - 6.0).abs() < 1e-9);
        assert_eq!(c.batches.len(), 1);
        assert_eq!(c.batches[0].spend.requests, 2);
    }

    /// A route charged again (names in fresh strings) is found by its
    /// borrowed names: one entry, whatever the names (empty, shared
    /// prefixes, a name that is another's two joined).
    #[test]
    fn a_route_is_found_by_its_borrowed_names() {
        let l = Ledger::default();
        let routes = [
            ["a", "b", "c", "d"],
            ["ab", "", "c", "d"],
            ["a", "bc", "", "d"],
            ["", "", "", ""],
            ["a", "b", "c", "de"],
        ];
        for round in 0..3 {
            for r in routes {
                let owned = r.map(str::to_string);
                l.charge(owned.each_ref().map(String::as_str), None, 1.0, 0.0);
            }
            let g = l.inner.lock().unwrap();
            assert_eq!(g.routes.len(), routes.len(), "round {round}");
            assert!(g.routes.values().all(|s| s.requests == round + 1));
        }
    }

    #[test]
    fn batches_are_bounded_dropping_the_least_recently_charged() {
        let l = Ledger::default();
        for i in 0..MAX_BATCHES + 1 {
            l.charge(["b", "t", "p", "m"], Some(&format!("batch_{i}")), 1.0, 0.0);
            if i == 2 {
                // batch_0 charged again: it is now recent, batch_1 the oldest.
                l.charge(["b", "t", "p", "m"], Some("batch_0"), 1.0, 0.0);
            }
        }
        let c = l.costs();
        assert_eq!(c.batches.len(), MAX_BATCHES);
        let names: std::collections::HashSet<&str> =
            c.batches.iter().map(|r| r.name.as_str()).collect();
        assert!(names.contains("batch_0"));
        assert!(!names.contains("batch_1"));
        assert!(names.contains(format!("batch_{MAX_BATCHES}").as_str()));
    }
}
