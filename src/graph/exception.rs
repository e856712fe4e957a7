//! Exceptions: time-boxed grants (`exception NAME { … }`) of a higher
//! priority, weight, quota or reserved share to one tier or tenant, on the
//! days of a date range in the policy's time zone. The compiled graph keeps
//! its declared values; [`DecisionGraph::on_date`] is the graph in force on
//! a day, which the scheduler swaps in when the date changes. An exception
//! so needs no revert: outside its days it grants nothing.

use super::*;
use crate::units::calendar::show_date;

/// What an exception applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject {
    Tier(TierId),
    Tenant(TenantId),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Exception {
    pub name: String,
    pub subject: Subject,
    /// First and last day it applies (days since 1970-01-01), both
    /// included, as `date in a..b` reads them.
    pub from: i32,
    pub until: i32,
    /// A tier's priority in the window (tier exceptions only).
    pub priority: Option<i64>,
    /// A tenant's fair-share weight in the window (tenant exceptions only).
    pub weight: Option<f64>,
    /// Quota limits raised in the window; unset fields keep the declared.
    pub quota: Quota,
    /// A tier's reserved shares in the window (tier exceptions only): each
    /// replaces the tier's share of that pool.
    pub reserve: Vec<Reserve>,
    pub reason: String,
    pub owner: Owner,
    pub span: Span,
}

impl Exception {
    /// Whether it applies on `date` (days since 1970-01-01, in the policy's zone).
    pub fn covers(&self, date: i32) -> bool {
        (self.from..=self.until).contains(&date)
    }

    /// `2026-12-28..2027-01-02`.
    pub fn window(&self) -> String {
        format!("{}..{}", show_date(self.from), show_date(self.until))
    }

    /// Days it lasts, both ends included.
    pub fn days(&self) -> i32 {
        self.until - self.from + 1
    }

    /// What it grants, for explain and `kiln status`: `priority 60, weight 4, quota tokens 4M/min`.
    pub fn grants(&self, g: &DecisionGraph) -> String {
        let mut out = Vec::new();
        if let Some(p) = self.priority {
            out.push(format!("priority {p}"));
        }
        if let Some(w) = self.weight {
            out.push(format!("weight {w}"));
        }
        let rate = |per_s: f64| {
            // Per second in the graph: round off what the division left.
            let m = per_s * 60.0;
            let m = if (m - m.round()).abs() < 1e-6 * m.abs().max(1.0) {
                m.round()
            } else {
                m
            };
            let (v, suffix) = if m >= 1e6 && (m / 1e6).fract() == 0.0 {
                (m / 1e6, "M")
            } else if m >= 1e3 && (m / 1e3).fract() == 0.0 {
                (m / 1e3, "k")
            } else {
                (m, "")
            };
            format!(
                "{}{suffix}/min",
                crate::units::show(crate::units::Ty::Count, v)
            )
        };
        let q = &self.quota;
        let mut qs = Vec::new();
        if let Some(t) = q.tokens {
            qs.push(format!("tokens {}", rate(t)));
        }
        if let Some(r) = q.requests {
            qs.push(format!("requests {}", rate(r)));
        }
        if let Some(c) = q.concurrent {
            qs.push(format!("concurrent {c}"));
        }
        if let Some(s) = q.gpu_seconds {
            qs.push(format!("gpu_seconds {}", rate(s)));
        }
        if !qs.is_empty() {
            out.push(format!("quota {}", qs.join(" ")));
        }
        for r in &self.reserve {
            let pool = g
                .pools
                .get(r.pool as usize)
                .map_or("?", |p| p.name.as_str());
            out.push(format!("reserve {pool} {}%", r.share));
        }
        out.join(", ")
    }

    /// `tier batch` or `tenant finance`.
    pub fn subject_name(&self, g: &DecisionGraph) -> String {
        match self.subject {
            Subject::Tier(t) => format!(
                "tier {}",
                g.tiers.get(t as usize).map_or("?", |t| t.name.as_str())
            ),
            Subject::Tenant(t) => format!(
                "tenant {}",
                g.tenants.get(t as usize).map_or("?", |t| t.name.as_str())
            ),
        }
    }

    /// One line for a trace: what applies, to whom, until when.
    pub fn note(&self, g: &DecisionGraph) -> String {
        format!(
            "exception `{}` applies to {} ({}, ends after {}): {}",
            self.name,
            self.subject_name(g),
            self.reason,
            show_date(self.until),
            self.grants(g)
        )
    }
}

fn raise<T: PartialOrd + Copy>(base: &mut Option<T>, grant: Option<T>) {
    if let (Some(b), Some(x)) = (base.as_mut(), grant) {
        if x > *b {
            *b = x;
        }
    }
}

impl DecisionGraph {
    /// The exceptions that apply on `date`, in declaration order.
    pub fn exceptions_on(&self, date: i32) -> impl Iterator<Item = &Exception> {
        self.exceptions.iter().filter(move |e| e.covers(date))
    }

    /// Which exceptions apply on `date`, as a bit set over `exceptions`
    /// (what the scheduler compares to know whether to swap).
    pub fn active_set(&self, date: i32) -> Vec<bool> {
        self.exceptions.iter().map(|e| e.covers(date)).collect()
    }

    /// The day `unix_ms` falls on in the policy's zone, and the graph in
    /// force then: `graph` itself (shared) when no exception covers it.
    pub fn in_force_at(graph: &Arc<DecisionGraph>, unix_ms: i64) -> (i32, Arc<DecisionGraph>) {
        let date = crate::units::calendar::civil_at(unix_ms, graph.timezone.as_ref()).date;
        if graph.exceptions.iter().any(|e| e.covers(date)) {
            (date, Arc::new(graph.on_date(date)))
        } else {
            (date, graph.clone())
        }
    }

    /// The graph in force on `date`: this one with every exception that
    /// covers the day applied (the largest grant where two overlap). Ids,
    /// rules and everything else are unchanged, so the scheduler moves to
    /// it the way it resizes on a swap. Call on the compiled graph.
    pub fn on_date(&self, date: i32) -> DecisionGraph {
        let mut g = self.clone();
        for e in self.exceptions_on(date) {
            match e.subject {
                Subject::Tier(t) => {
                    let Some(tier) = g.tiers.get_mut(t as usize) else {
                        continue;
                    };
                    if let Some(p) = e.priority {
                        tier.priority = tier.priority.max(p);
                    }
                    grant_quota(&mut tier.quota, &e.quota);
                    for r in &e.reserve {
                        match tier.reserve.iter_mut().find(|x| x.pool == r.pool) {
                            Some(x) => x.share = x.share.max(r.share),
                            None => tier.reserve.push(*r),
                        }
                    }
                }
                Subject::Tenant(t) => {
                    let Some(tn) = g.tenants.get_mut(t as usize) else {
                        continue;
                    };
                    if let Some(w) = e.weight {
                        tn.weight = tn.weight.max(w);
                    }
                    grant_quota(&mut tn.quota, &e.quota);
                }
            }
        }
        g
    }
}

impl DecisionGraph {
    /// A tenant's concurrency limit on `date`: `declared`, or more where
    /// an exception grants it.
    pub(super) fn granted_concurrent(
        &self,
        tenant: Option<TenantId>,
        date: i32,
        declared: u64,
    ) -> u64 {
        let Some(t) = tenant else { return declared };
        self.exceptions_on(date)
            .filter(|e| e.subject == Subject::Tenant(t))
            .filter_map(|e| e.quota.concurrent)
            .fold(declared, u64::max)
    }

    /// The trace's `exception` stage: each exception that applies to the
    /// request's tier or tenant on `date`, what it grants and until when.
    pub(super) fn trace_exceptions<T: super::trace::Tracer>(
        &self,
        tier: TierId,
        tenant: Option<TenantId>,
        date: i32,
        t: &mut T,
    ) {
        let mut first = true;
        for e in self.exceptions_on(date) {
            let mine = match e.subject {
                Subject::Tier(x) => x == tier,
                Subject::Tenant(x) => Some(x) == tenant,
            };
            if !mine {
                continue;
            }
            if std::mem::take(&mut first) {
                t.stage("exception", format!("exceptions on {}", show_date(date)));
            }
            t.note(e.note(self));
        }
    }
}

/// Raises each limit the grant names; a grant never adds a limit where
/// none was declared (the compiler refuses one).
fn grant_quota(base: &mut Quota, grant: &Quota) {
    raise(&mut base.tokens, grant.tokens);
    raise(&mut base.requests, grant.requests);
    raise(&mut base.concurrent, grant.concurrent);
    raise(&mut base.gpu_seconds, grant.gpu_seconds);
}

#[cfg(test)]
mod tests {
    use crate::units::calendar::date_days;

    const POLICY: &str = r#"
policy { timezone "Europe/Berlin" }
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier hi { priority 100 slo { ttft 1s } }
tier lo { priority 10 slo { window 1h } quota { tokens 1M/min } }
tenant fin { owner "fin" tiers [lo] weight 1 quota { tokens 100k/min concurrent 2 } }
classify { default => tier lo }
route [hi, lo] m { default => fp16 }
exception close {
  tenant fin
  dates 2026-12-28..2027-01-02
  weight 4
  quota { tokens 400k/min concurrent 8 }
  reason "quarter-end close"
}
exception close_tier {
  tier lo
  dates 2026-12-31..2026-12-31
  priority 50
  reason "year-end"
}
"#;

    fn day(y: i16, m: i8, d: i8) -> i32 {
        date_days(y, m, d).unwrap()
    }

    #[test]
    fn grants_apply_only_on_their_days_both_ends_included() {
        let g = crate::compile::compile_str("t", POLICY).graph.unwrap();
        let fin = g.tenant_id("fin").unwrap() as usize;
        let lo = g.tier_id("lo").unwrap() as usize;
        for (d, on) in [
            (day(2026, 12, 27), false),
            (day(2026, 12, 28), true),
            (day(2027, 1, 2), true),
            (day(2027, 1, 3), false),
        ] {
            let e = g.on_date(d);
            assert_eq!(e.tenants[fin].weight, if on { 4.0 } else { 1.0 });
            assert_eq!(
                e.tenants[fin].quota.concurrent,
                Some(if on { 8 } else { 2 })
            );
            let tokens = e.tenants[fin].quota.tokens.unwrap() * 60.0;
            assert!((tokens - if on { 400_000.0 } else { 100_000.0 }).abs() < 1e-6);
            assert_eq!(e.tiers[lo].priority, 10);
        }
        assert_eq!(g.on_date(day(2026, 12, 31)).tiers[lo].priority, 50);
        // The compiled graph keeps its declared values.
        assert_eq!(g.tenants[fin].weight, 1.0);
        assert_eq!(g.active_set(day(2026, 12, 31)), vec![true, true]);
    }

    #[test]
    fn explain_says_which_exception_applied_and_until_when() {
        let g = crate::compile::compile_str("t", POLICY).graph.unwrap();
        let req = crate::graph::Request {
            tenant: Some("fin".into()),
            model: "m".into(),
            ..Default::default()
        };
        let mut s = crate::graph::Signals::idle(&g);
        s.date = day(2026, 12, 29);
        let (_, t) = g.explain(&req, &s);
        let st = t.stages.iter().find(|s| s.stage == "exception").unwrap();
        assert_eq!(st.block, "exceptions on 2026-12-29");
        assert_eq!(st.notes.len(), 1, "{:?}", st.notes);
        assert!(st.notes[0].starts_with("exception `close` applies to tenant fin"));
        // The day after: no exception stage.
        s.date = day(2027, 1, 3);
        let (_, t) = g.explain(&req, &s);
        assert!(!t.stages.iter().any(|s| s.stage == "exception"));
        // On the 31st the tier's exception shows too.
        s.date = day(2026, 12, 31);
        let (_, t) = g.explain(&req, &s);
        let st = t.stages.iter().find(|s| s.stage == "exception").unwrap();
        assert_eq!(st.notes.len(), 2, "{:?}", st.notes);
    }

    #[test]
    fn concurrency_granted_counts_in_the_graphs_own_check() {
        let g = crate::compile::compile_str("t", POLICY).graph.unwrap();
        let fin = g.tenant_id("fin");
        assert_eq!(g.granted_concurrent(fin, day(2026, 12, 27), 2), 2);
        assert_eq!(g.granted_concurrent(fin, day(2026, 12, 28), 2), 8);
    }

    #[test]
    fn note_says_what_to_whom_and_until_when() {
        let g = crate::compile::compile_str("t", POLICY).graph.unwrap();
        let e = &g.exceptions[0];
        assert_eq!(
            e.note(&g),
            "exception `close` applies to tenant fin (quarter-end close, ends after 2027-01-02): weight 4, quota tokens 400k/min concurrent 8"
        );
    }
}
