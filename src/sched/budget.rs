//! Money budgets (`budget 500/day`, `budget 12k/month` on a tenant or a
//! tier): what their GPU time has cost so far in the current calendar day
//! or month of the policy's time zone, at the prices
//! [`DecisionGraph::gpu_hour_price`] gives, and the share left.
//!
//! A budget is a signal (`budget.remaining`, `tenant(X).budget_remaining`,
//! `tier(T).budget_remaining`) and a metric with alerts, not a wall: the
//! policy's rules say what running short means (a cheaper pool, a
//! quantized variant, batch held, a refusal). Unpriced GPU time costs 0.
//! Like a quota that no fleet claimed, a replica counts what it charged
//! itself against its share (1/N) of each budget.

use crate::graph::{Budget, BudgetPeriod, DecisionGraph, PoolId, TenantId, TierId};
use crate::units::calendar::{month_index, Civil};

#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Account {
    budget: Option<Budget>,
    /// The day (days since 1970) or month ([`month_index`]) `spent` is of.
    period: i32,
    spent: f64,
    /// What the fleet's other replicas spent in a period, as last read
    /// (`None` outside a fleet, or before its first reading).
    others: Option<(i32, f64)>,
}

impl Account {
    fn of(budget: Option<Budget>) -> Account {
        Account {
            budget,
            ..Account::default()
        }
    }

    fn period_of(b: &Budget, c: &Civil) -> i32 {
        match b.period {
            BudgetPeriod::Day => c.date,
            BudgetPeriod::Month => month_index(c.date),
        }
    }

    /// Spent in the period `c` is in (0 once a new one began).
    fn spent_at(&self, c: &Civil) -> f64 {
        match &self.budget {
            Some(b) if Account::period_of(b, c) == self.period => self.spent,
            _ => 0.0,
        }
    }

    fn charge(&mut self, amount: f64, c: &Civil) {
        let Some(b) = &self.budget else { return };
        let p = Account::period_of(b, c);
        if p != self.period {
            self.period = p;
            self.spent = 0.0;
        }
        self.spent += amount;
    }

    /// Percent left, 0–100 (100 without a budget): of the whole budget
    /// against the fleet's spending where the fleet's is known for this
    /// period, else of this replica's share against its own.
    fn remaining(&self, c: &Civil, scale: f64) -> f64 {
        match &self.budget {
            Some(b) => {
                if let Some((p, others)) = self.others {
                    if p == Account::period_of(b, c) && b.amount > 0.0 {
                        let spent = self.spent_at(c) + others;
                        return (100.0 * (1.0 - spent / b.amount)).clamp(0.0, 100.0);
                    }
                }
                let limit = b.amount * scale;
                if limit > 0.0 {
                    (100.0 * (1.0 - self.spent_at(c) / limit)).clamp(0.0, 100.0)
                } else {
                    0.0
                }
            }
            None => 100.0,
        }
    }
}

/// One budget as the metrics show it.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetView {
    /// `tenant` or `tier`.
    pub scope: &'static str,
    pub name: String,
    pub period: &'static str,
    /// This scheduler's share of the budget, and what it spent of it in
    /// the current period.
    pub limit: f64,
    pub spent: f64,
    /// The period `spent` is of: days since 1970, or a month index.
    pub period_key: i32,
}

/// What a fleet keeps of one budget's period: this replica's total (more
/// than it holds after a restart) and the other replicas' spending.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetSync {
    pub scope: String,
    pub name: String,
    pub period_key: i32,
    pub own: f64,
    pub others: f64,
}

#[derive(Debug, Clone, Default)]
pub struct Budgets {
    tenants: Vec<Account>,
    tiers: Vec<Account>,
    scale: f64,
    /// Some tenant or tier has a budget (else charging is skipped).
    active: bool,
}

fn positive_scale(scale: f64) -> f64 {
    if scale.is_finite() && scale > 0.0 {
        scale.min(1.0)
    } else {
        1.0
    }
}

impl Budgets {
    pub fn new(g: &DecisionGraph, scale: f64) -> Budgets {
        Budgets {
            tenants: g.tenants.iter().map(|t| Account::of(t.budget)).collect(),
            tiers: g.tiers.iter().map(|t| Account::of(t.budget)).collect(),
            scale: positive_scale(scale),
            active: g.tenants.iter().any(|t| t.budget.is_some())
                || g.tiers.iter().any(|t| t.budget.is_some()),
        }
    }

    /// The budgets of a new graph: a tenant or tier that stays keeps what
    /// it spent this period (a changed amount applies to it).
    pub fn remap(
        &self,
        g: &DecisionGraph,
        tenant_map: &[Option<TenantId>],
        tier_map: &[Option<TierId>],
    ) -> Budgets {
        let mut next = Budgets::new(g, self.scale);
        let carry = |to: &mut Vec<Account>, from: &[Account], map: Vec<Option<usize>>| {
            for (old, new) in map.into_iter().enumerate() {
                if let (Some(new), Some(a)) = (new, from.get(old)) {
                    if let Some(slot) = to.get_mut(new) {
                        slot.period = a.period;
                        slot.spent = a.spent;
                        slot.others = a.others;
                    }
                }
            }
        };
        let tenants = tenant_map.iter().map(|t| t.map(|t| t as usize)).collect();
        carry(&mut next.tenants, &self.tenants, tenants);
        let tiers = tier_map.iter().map(|t| t.map(usize::from)).collect();
        carry(&mut next.tiers, &self.tiers, tiers);
        next
    }

    /// The same spending against another share of each budget.
    pub fn rescaled(&self, scale: f64) -> Budgets {
        Budgets {
            scale: positive_scale(scale),
            ..self.clone()
        }
    }

    /// `gpu_seconds` of `tenant`'s work in `tier` ran on `pool`.
    pub fn charge(
        &mut self,
        g: &DecisionGraph,
        (tenant, tier, pool): (Option<TenantId>, TierId, PoolId),
        gpu_seconds: f64,
        c: &Civil,
    ) {
        if !(self.active && gpu_seconds.is_finite() && gpu_seconds > 0.0) {
            return;
        }
        let Some(price) = g.gpu_hour_price(tenant, Some(pool)) else {
            return;
        };
        let amount = gpu_seconds / 3600.0 * price;
        if let Some(a) = tenant.and_then(|t| self.tenants.get_mut(t as usize)) {
            a.charge(amount, c);
        }
        if let Some(a) = self.tiers.get_mut(usize::from(tier)) {
            a.charge(amount, c);
        }
    }

    pub fn tenant_remaining(&self, t: TenantId, c: &Civil) -> f64 {
        self.tenants
            .get(t as usize)
            .map_or(100.0, |a| a.remaining(c, self.scale))
    }

    pub fn tier_remaining(&self, t: TierId, c: &Civil) -> f64 {
        self.tiers
            .get(usize::from(t))
            .map_or(100.0, |a| a.remaining(c, self.scale))
    }

    /// Every declared budget, tenants' then tiers'.
    pub fn view(&self, g: &DecisionGraph, c: &Civil) -> Vec<BudgetView> {
        let names = |scope: &'static str, accounts: &[Account], name: &dyn Fn(usize) -> String| {
            accounts
                .iter()
                .enumerate()
                .filter_map(|(i, a)| {
                    a.budget.map(|b| BudgetView {
                        scope,
                        name: name(i),
                        period: b.period.name(),
                        limit: b.amount * self.scale,
                        spent: a.spent_at(c),
                        period_key: Account::period_of(&b, c),
                    })
                })
                .collect::<Vec<_>>()
        };
        let mut v = names("tenant", &self.tenants, &|i| {
            g.tenants
                .get(i)
                .map_or_else(String::new, |t| t.name.clone())
        });
        v.extend(names("tier", &self.tiers, &|i| {
            g.tiers.get(i).map_or_else(String::new, |t| t.name.clone())
        }));
        v
    }

    pub fn any(&self) -> bool {
        self.active
    }

    /// What the fleet keeps of each budget's period `c` is in: a replica
    /// holding less than the fleet's record of it (restarted) goes on from
    /// that, and the others' spending counts in `remaining`. A reading of
    /// another period is ignored.
    pub fn sync(&mut self, g: &DecisionGraph, s: &[BudgetSync], c: &Civil) {
        for x in s {
            let account = match x.scope.as_str() {
                "tenant" => g
                    .tenant_id(&x.name)
                    .and_then(|t| self.tenants.get_mut(t as usize)),
                "tier" => g
                    .tier_id(&x.name)
                    .and_then(|t| self.tiers.get_mut(usize::from(t))),
                _ => None,
            };
            let Some(a) = account else { continue };
            let Some(b) = a.budget else { continue };
            let p = Account::period_of(&b, c);
            if p != x.period_key {
                continue;
            }
            if a.period != p {
                a.period = p;
                a.spent = 0.0;
            }
            if x.own.is_finite() && x.own > a.spent {
                a.spent = x.own;
            }
            if x.others.is_finite() {
                a.others = Some((p, x.others.max(0.0)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::calendar::{civil_after, parse_date};

    fn graph(extra: &str) -> DecisionGraph {
        let text = format!(
            r#"pool gpu {{ gpus 1 kind "H100-80GB" memory 80GB price 3600/h }}
pool free {{ gpus 1 kind "L4" memory 24GB }}
model m {{ params 8B kv_per_token 128KB variant fp16 {{ memory 18GB pools [gpu, free] }} }}
tier chat {{ priority 10 budget 100/month }}
tenant a {{ owner "o" tiers [chat] budget 10/day }}
tenant b {{ owner "o" tiers [chat] {extra} }}
classify {{ default => tier chat }}
route chat m {{ default => fp16 }}
"#
        );
        let c = crate::compile::compile_str("b.kiln", &text);
        c.graph.unwrap_or_else(|| panic!("{:?}", c.diagnostics))
    }

    fn at(date: &str, minute: u32) -> Civil {
        civil_after(parse_date(date).unwrap(), minute, 0, 0)
    }

    #[test]
    fn a_day_and_a_month_begin_again_at_their_calendar_ends() {
        let g = graph("");
        let mut b = Budgets::new(&g, 1.0);
        let d1 = at("2026-12-31", 23 * 60);
        b.charge(&g, (Some(0), 0, 0), 4.0, &d1);
        assert_eq!(b.tenant_remaining(0, &d1), 60.0);
        assert_eq!(b.tier_remaining(0, &d1), 96.0);
        // The next day and month: whole again.
        let jan = at("2027-01-01", 1);
        assert_eq!(b.tenant_remaining(0, &jan), 100.0);
        assert_eq!(b.tier_remaining(0, &jan), 100.0);
        // Read back in December, December's spending stands.
        let dec = at("2026-12-01", 0);
        assert_eq!(b.tier_remaining(0, &dec), 96.0);
        b.charge(&g, (Some(0), 0, 0), 200.0, &jan);
        assert_eq!(b.tenant_remaining(0, &jan), 0.0, "clamped at 0");
        assert_eq!(b.tier_remaining(0, &jan), 0.0);
    }

    #[test]
    fn unpriced_pools_and_tenants_without_budget_spend_nothing_of_their_own() {
        let g = graph("");
        let mut b = Budgets::new(&g, 1.0);
        let c = at("2026-12-04", 600);
        b.charge(&g, (Some(0), 0, 1), 100.0, &c); // pool `free`: no price
        assert_eq!(b.tenant_remaining(0, &c), 100.0);
        b.charge(&g, (Some(1), 0, 0), 50.0, &c); // b has no budget; the tier has
        assert_eq!(b.tenant_remaining(1, &c), 100.0);
        assert_eq!(b.tier_remaining(0, &c), 50.0);
        for x in [f64::NAN, -1.0, f64::INFINITY] {
            b.charge(&g, (Some(0), 0, 0), x, &c);
        }
        assert_eq!(b.tenant_remaining(0, &c), 100.0);
        assert_eq!(b.view(&g, &c).len(), 2);
    }

    #[test]
    fn a_fleets_record_counts_the_others_and_restores_a_restarted_replica() {
        let g = graph("");
        let mut b = Budgets::new(&g, 1.0 / 3.0);
        let c = at("2026-12-04", 600);
        b.charge(&g, (Some(0), 0, 0), 1.0, &c);
        // Alone: a third of 10 a day, 1 spent.
        assert!((b.tenant_remaining(0, &c) - 70.0).abs() < 1e-9);
        let sync = |own: f64, others: f64, key: i32| BudgetSync {
            scope: "tenant".into(),
            name: "a".into(),
            period_key: key,
            own,
            others,
        };
        // The fleet's record: it had spent 3 before a restart, others 4.
        b.sync(&g, &[sync(3.0, 4.0, c.date)], &c);
        assert!((b.tenant_remaining(0, &c) - 30.0).abs() < 1e-9);
        assert_eq!(b.view(&g, &c)[0].spent, 3.0);
        // Another day's reading changes nothing; a new day starts whole.
        b.sync(&g, &[sync(9.0, 9.0, c.date - 1)], &c);
        assert!((b.tenant_remaining(0, &c) - 30.0).abs() < 1e-9);
        assert_eq!(b.tenant_remaining(0, &at("2026-12-05", 0)), 100.0);
    }

    #[test]
    fn a_swap_keeps_what_was_spent_and_a_replica_holds_its_share() {
        let g = graph("");
        let mut b = Budgets::new(&g, 1.0);
        let c = at("2026-12-04", 600);
        b.charge(&g, (Some(0), 0, 0), 5.0, &c);
        // b gains a budget; a and the tier keep their spending.
        let g2 = graph("budget 1k/month");
        let b2 = b.remap(&g2, &[Some(0), Some(1)], &[Some(0)]);
        assert_eq!(b2.tenant_remaining(0, &c), 50.0);
        assert_eq!(b2.tenant_remaining(1, &c), 100.0);
        assert_eq!(b2.tier_remaining(0, &c), 95.0);
        // One of two replicas: half the budget, the same spending.
        let half = b2.rescaled(0.5);
        assert_eq!(half.tenant_remaining(0, &c), 0.0);
        assert_eq!(half.view(&g2, &c)[0].limit, 5.0);
    }
}
