//! The `dead-rule` lint: rules `check` accepts that can never act, because
//! a condition can never be true (`pool(p).utilization > 100%`, `x > 5 and
//! x < 3`) or reads a signal that is constant where it is read (the
//! attainment of a tier with no SLO is always 100%, the deadline misses of
//! a tier with no completion window always 0, the signals of a pool no
//! variant runs on always 0). A rule whose condition is always true is
//! reported too: the rules after it in its block never act.

use crate::diag::{Code, Diagnostic, Diagnostics};
use crate::graph::signal::{TenantField, TierField};
use crate::graph::{Cond, DecisionGraph, RuleId, RuleSet, Sig, Test, TestOp};
use crate::units::{CmpOp, Ty};
use std::collections::HashSet;

/// What is known about a signal before any request: its range, or its one
/// value (with why).
#[derive(Debug, Clone)]
struct Known {
    lo: f64,
    hi: f64,
    why: Option<String>,
}

fn known(g: &DecisionGraph, sig: &Sig) -> Option<Known> {
    let range = |lo: f64, hi: f64| Some(Known { lo, hi, why: None });
    let fixed = |v: f64, why: String| {
        Some(Known {
            lo: v,
            hi: v,
            why: Some(why),
        })
    };
    let tier_name = |t: u16| g.tiers.get(t as usize).map_or("?", |x| x.name.as_str());
    match sig {
        Sig::Pool(p, _) => {
            let p16 = *p;
            let hosted = g
                .models
                .iter()
                .any(|m| m.variants.iter().any(|v| v.pools.contains(&p16)));
            if !hosted {
                let name = g.pools.get(*p as usize).map_or("?", |x| x.name.as_str());
                return fixed(
                    0.0,
                    format!("pool `{name}` hosts no variant, so its signals are always 0"),
                );
            }
            bounds(sig.ty())
        }
        Sig::TierLive(t, f) => {
            let tier = g.tiers.get(*t as usize)?;
            match f {
                TierField::SloAttainment if tier.slo.is_empty() => fixed(
                    100.0,
                    format!("tier `{}` has no SLO, so its attainment is always 100%", tier_name(*t)),
                ),
                TierField::DeadlineMisses if tier.slo.window.is_none() => fixed(
                    0.0,
                    format!(
                        "tier `{}` has no completion window (`slo {{ window … }}`), so it never misses a deadline",
                        tier_name(*t)
                    ),
                ),
                TierField::BudgetRemaining if tier.budget.is_none() => fixed(
                    100.0,
                    format!(
                        "tier `{}` has no `budget`, so its `budget_remaining` is always 100%",
                        tier_name(*t)
                    ),
                ),
                TierField::FallbackRate
                    if g.fallbacks.get(*t as usize).is_none_or(|f| f.is_none()) =>
                {
                    fixed(
                        0.0,
                        format!("tier `{}` has no fallback chain, so its fallback rate is always 0%", tier_name(*t)),
                    )
                }
                _ => bounds(sig.ty()),
            }
        }
        Sig::TenantLive(x, TenantField::DeadlineMisses) => {
            let tenant = g.tenants.get(*x as usize)?;
            let windowed = tenant.tiers.iter().any(|t| {
                g.tiers
                    .get(*t as usize)
                    .is_some_and(|t| t.slo.window.is_some())
            });
            if windowed {
                bounds(sig.ty())
            } else {
                fixed(
                    0.0,
                    format!(
                        "no tier of tenant `{}` has a completion window, so it never misses a deadline",
                        tenant.name
                    ),
                )
            }
        }
        Sig::QuotaRemaining => {
            if g.tenants.iter().any(|t| t.quota.is_limited()) {
                range(0.0, 100.0)
            } else {
                fixed(
                    100.0,
                    "no tenant has a quota, so `quota.remaining` is always 100%".to_string(),
                )
            }
        }
        Sig::BudgetRemaining => {
            if g.tenants.iter().any(|t| t.budget.is_some())
                || g.tiers.iter().any(|t| t.budget.is_some())
            {
                range(0.0, 100.0)
            } else {
                fixed(
                    100.0,
                    "no tenant or tier has a `budget`, so `budget.remaining` is always 100%"
                        .to_string(),
                )
            }
        }
        Sig::TenantLive(x, TenantField::BudgetRemaining) => {
            let tenant = g.tenants.get(*x as usize)?;
            if tenant.budget.is_some() {
                range(0.0, 100.0)
            } else {
                fixed(
                    100.0,
                    format!(
                        "tenant `{}` has no `budget`, so its `budget_remaining` is always 100%",
                        tenant.name
                    ),
                )
            }
        }
        Sig::TimeOfDay => range(0.0, 1439.0),
        Sig::Day => range(1.0, 31.0),
        _ => bounds(sig.ty()),
    }
}

fn bounds(ty: Ty) -> Option<Known> {
    match ty {
        Ty::Percent => Some(Known {
            lo: 0.0,
            hi: 100.0,
            why: None,
        }),
        Ty::Count | Ty::Duration => Some(Known {
            lo: 0.0,
            hi: f64::INFINITY,
            why: None,
        }),
        _ => None,
    }
}

/// A closed-or-open interval of values a conjunction still allows.
#[derive(Debug, Clone, Copy)]
struct Interval {
    lo: f64,
    lo_open: bool,
    hi: f64,
    hi_open: bool,
}

impl Interval {
    fn empty(&self) -> bool {
        self.lo > self.hi || (self.lo == self.hi && (self.lo_open || self.hi_open))
    }
    fn narrow(&mut self, op: CmpOp, k: f64) -> bool {
        match op {
            CmpOp::Lt => self.upper(k, true),
            CmpOp::Le => self.upper(k, false),
            CmpOp::Gt => self.lower(k, true),
            CmpOp::Ge => self.lower(k, false),
            CmpOp::Eq => {
                self.upper(k, false);
                self.lower(k, false);
            }
            CmpOp::Ne => return false,
        }
        true
    }
    fn upper(&mut self, k: f64, open: bool) {
        if k < self.hi || (k == self.hi && open) {
            self.hi = k;
            self.hi_open = open;
        }
    }
    fn lower(&mut self, k: f64, open: bool) {
        if k > self.lo || (k == self.lo && open) {
            self.lo = k;
            self.lo_open = open;
        }
    }
}

/// Whether a test is always true (`Some(true)`), never (`Some(false)`), or
/// depends on the request and the moment, with why when a constant decides.
fn test_truth(g: &DecisionGraph, t: &Test) -> (Option<bool>, Option<String>) {
    let Some(k) = known(g, &t.sig) else {
        return (None, None);
    };
    let full = Interval {
        lo: k.lo,
        lo_open: false,
        hi: k.hi,
        hi_open: false,
    };
    let allows = |lo: f64, lo_open: bool, hi: f64, hi_open: bool| {
        let mut i = full;
        i.lower(lo, lo_open);
        i.upper(hi, hi_open);
        !i.empty()
    };
    // (can be true, can be false)
    let (can_true, can_false) = match &t.op {
        TestOp::Num(op, c) => {
            let c = *c;
            match op {
                CmpOp::Lt => (
                    allows(f64::NEG_INFINITY, false, c, true),
                    allows(c, false, f64::INFINITY, false),
                ),
                CmpOp::Le => (
                    allows(f64::NEG_INFINITY, false, c, false),
                    allows(c, true, f64::INFINITY, false),
                ),
                CmpOp::Gt => (
                    allows(c, true, f64::INFINITY, false),
                    allows(f64::NEG_INFINITY, false, c, false),
                ),
                CmpOp::Ge => (
                    allows(c, false, f64::INFINITY, false),
                    allows(f64::NEG_INFINITY, false, c, true),
                ),
                CmpOp::Eq => (allows(c, false, c, false), !(k.lo == c && k.hi == c)),
                CmpOp::Ne => (!(k.lo == c && k.hi == c), allows(c, false, c, false)),
            }
        }
        TestOp::Range(lo, hi) if lo <= hi && t.sig != Sig::TimeOfDay && t.sig != Sig::Day => {
            let inside = allows(*lo, false, *hi, true);
            let all_inside = k.lo >= *lo && k.hi < *hi;
            (inside, !all_inside)
        }
        _ => return (None, None),
    };
    let (can_true, can_false) = if t.negate {
        (can_false, can_true)
    } else {
        (can_true, can_false)
    };
    let truth = match (can_true, can_false) {
        (true, true) => None,
        (false, _) => Some(false),
        (true, false) => Some(true),
    };
    (
        truth,
        truth
            .and(k.why.clone())
            .or_else(|| truth.map(|_| range_why(&t.sig))),
    )
}

fn range_why(sig: &Sig) -> String {
    match sig.ty() {
        Ty::Percent => "a percentage is from 0% to 100%".to_string(),
        Ty::Count => "a count is never negative".to_string(),
        Ty::Duration => "a duration is never negative".to_string(),
        _ => "of the values it can take".to_string(),
    }
}

/// The truth of a condition as far as it is known, with the test that
/// decides it and why.
fn truth(g: &DecisionGraph, c: &Cond) -> (Option<bool>, Option<(String, String)>) {
    match c {
        Cond::True => (Some(true), None),
        Cond::Test(t) => {
            let (v, why) = test_truth(g, t);
            (v, v.map(|_| (t.text.clone(), why.unwrap_or_default())))
        }
        Cond::Not(c) => {
            let (v, w) = truth(g, c);
            (v.map(|b| !b), w)
        }
        Cond::And(cs) => {
            let mut all_true = true;
            let mut last = None;
            for c in cs {
                match truth(g, c) {
                    (Some(false), w) => return (Some(false), w),
                    (Some(true), w) => last = w.or(last),
                    (None, _) => all_true = false,
                }
            }
            if let Some(w) = contradiction(cs) {
                return (Some(false), Some(w));
            }
            (all_true.then_some(true), last.filter(|_| all_true))
        }
        Cond::Or(cs) => {
            let mut all_false = true;
            let mut last = None;
            for c in cs {
                match truth(g, c) {
                    (Some(true), w) => return (Some(true), w),
                    (Some(false), w) => last = w.or(last),
                    (None, _) => all_false = false,
                }
            }
            (all_false.then_some(false), last.filter(|_| all_false))
        }
    }
}

/// Two comparisons of one signal in a conjunction that no value satisfies.
fn contradiction(cs: &[Cond]) -> Option<(String, String)> {
    let tests: Vec<&Test> = cs
        .iter()
        .filter_map(|c| match c {
            Cond::Test(t) if !t.negate && matches!(t.op, TestOp::Num(..)) => Some(t.as_ref()),
            _ => None,
        })
        .collect();
    for (i, a) in tests.iter().enumerate() {
        let mut iv = Interval {
            lo: f64::NEG_INFINITY,
            lo_open: false,
            hi: f64::INFINITY,
            hi_open: false,
        };
        let mut texts = Vec::new();
        for b in tests[i..].iter().filter(|b| b.sig == a.sig) {
            if let TestOp::Num(op, k) = b.op {
                if iv.narrow(op, k) {
                    texts.push(b.text.as_str());
                }
            }
            if iv.empty() {
                return Some((texts.join(" and "), "no value satisfies both".to_string()));
            }
        }
    }
    None
}

/// Reports the dead rules of every rule block.
pub(crate) fn dead_rules(g: &DecisionGraph, out: &mut Diagnostics) {
    let mut seen: HashSet<RuleId> = HashSet::new();
    block(g, &g.classify, &mut seen, out);
    for rs in g.routes.iter().flatten() {
        block(g, rs, &mut seen, out);
    }
    for rs in g.admits.iter().flatten() {
        block(g, rs, &mut seen, out);
    }
}

fn block<O>(g: &DecisionGraph, rs: &RuleSet<O>, seen: &mut HashSet<RuleId>, out: &mut Diagnostics) {
    for (j, (id, cond, _)) in rs.rules.iter().enumerate() {
        // A block shared by several tiers or models is lowered once each.
        if !seen.insert(*id) {
            continue;
        }
        let Some(info) = g.rules.get(*id as usize) else {
            continue;
        };
        match truth(g, cond) {
            (Some(false), why) => {
                let (text, why) = why.unwrap_or_default();
                out.push(
                    Diagnostic::error(
                        Code::DeadRule,
                        format!("rule {} of `{}` can never match", info.index, info.block),
                    )
                    .at(info.span, format!("`{text}` is never true"))
                    .help(format!("{why}; fix the condition or delete the rule")),
                );
            }
            (Some(true), why) if j + 1 < rs.rules.len() && !matches!(cond, Cond::True) => {
                let (text, why) = why.unwrap_or_default();
                out.push(
                    Diagnostic::error(
                        Code::DeadRule,
                        format!(
                            "rule {} of `{}` always matches, so the rules after it never act",
                            info.index, info.block
                        ),
                    )
                    .at(info.span, format!("`{text}` is always true"))
                    .help(format!(
                        "{why}; fix the condition, or make this the default"
                    )),
                );
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile_str;

    const BASE: &str = r#"
pool p { gpus 8 kind "H100-80GB" memory 80GB }
pool idle { gpus 8 kind "H100-80GB" memory 80GB }
model m { params 8B kv_per_token 128KB variant fp16 { memory 18GB pools [p] } }
tier hi { priority 10 slo { ttft 1s } }
tier lo { priority 1 }
tenant a { owner "a@x" tiers [hi, lo] }
classify { default => tier hi }
route [hi, lo] m { default => fp16 on p }
"#;

    fn dead(rules: &str) -> Vec<String> {
        let src = format!("{BASE}\nadmit lo {{\n{rules}\n  default => accept\n}}\n");
        let c = compile_str("t.kiln", &src);
        let g = c.graph.as_ref().expect("compiles");
        let mut out = Diagnostics::new();
        dead_rules(g, &mut out);
        out.items
            .iter()
            .map(|d| format!("{} | {}", d.message, d.help.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn finds_conditions_that_cannot_hold() {
        let f = dead("  when tier(lo).slo_attainment < 90% => reject 503 \"x\"");
        assert!(
            f[0].contains("never match") && f[0].contains("no SLO"),
            "{f:?}"
        );
        let f = dead("  when pool(p).utilization > 100% => reject 503 \"x\"");
        assert!(f[0].contains("0% to 100%"), "{f:?}");
        let f = dead("  when prompt_tokens > 5k and prompt_tokens < 3k => reject 503 \"x\"");
        assert!(f[0].contains("no value"), "{f:?}");
        let f = dead("  when pool(idle).queued > 0 => reject 503 \"x\"");
        assert!(f[0].contains("hosts no variant"), "{f:?}");
        let f = dead("  when tier(hi).deadline_misses > 0 => reject 503 \"x\"");
        assert!(f[0].contains("completion window"), "{f:?}");
        let f = dead("  when tier(lo).slo_attainment <= 100% => reject 503 \"x\"\n  when max_tokens > 10 => accept");
        assert!(f[0].contains("always matches"), "{f:?}");
    }

    #[test]
    fn live_conditions_are_not_dead() {
        assert!(dead("  when tier(hi).slo_attainment < 90% => reject 503 \"x\"").is_empty());
        assert!(dead(
            "  when pool(p).utilization > 90% or tier(hi).ttft_p95 > 2s => reject 503 \"x\""
        )
        .is_empty());
        assert!(
            dead("  when prompt_tokens > 3k and prompt_tokens < 5k => reject 503 \"x\"").is_empty()
        );
        assert!(dead("  when not (tier(lo).queued > 5) => accept").is_empty());
    }
}
