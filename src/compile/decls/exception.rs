//! `exception NAME { tenant T | tier T, dates A..B, grants…, reason "…" }`:
//! a time-boxed grant. Checked here against what it grants to: an exception
//! only raises what its subject declares (a higher priority or weight, a
//! larger limit, a larger reserved share), so it can never take anything
//! away, and a grant that names a limit the subject does not have (which
//! would add a limit) is refused.

use super::*;
use crate::graph::exception::{Exception, Subject};

pub(super) const EXCEPTION_FIELDS: &[&str] = &[
    "tenant",
    "tier",
    "dates",
    "priority",
    "weight",
    "quota",
    "reserve",
    "reason",
    "owner",
    "escalation",
    "description",
];

/// Longer than this is a lint (`exception-too-long`): an exception is a
/// short grant; what lasts a quarter belongs in the tier or tenant itself.
pub const MAX_EXCEPTION_DAYS: i32 = 31;

impl Compiler<'_> {
    pub(super) fn exception(&mut self, d: &ast::Decl) {
        let what = format!("exception `{}`", d.name.name);
        let f = self.fields(&d.body, EXCEPTION_FIELDS, &what, &[]);
        let owner = self.owner(&f, &what);
        let _ = self.prop_string(f.get("description"));
        let subject = self.exception_subject(&f, d, &what);
        let dates = match self.require(&f, "dates", &d.name, "2026-12-28..2027-01-02") {
            Some(p) => self.exception_dates(p, &what),
            None => None,
        };
        let reason = match self.require(&f, "reason", &d.name, "\"why, and who asked\"") {
            Some(p) => match self.prop_string(Some(p)) {
                Some(s) if s.trim().is_empty() => {
                    self.err(
                        Diagnostic::error(Code::InvalidValue, format!("the reason of {what} is empty"))
                            .at(p.span, "empty")
                            .help("say why the grant is needed and who asked: it is shown in explain, `kiln status` and the proposal"),
                    );
                    None
                }
                s => s,
            },
            None => None,
        };

        let tier_only = |c: &mut Self, key: &str, subject: Option<Subject>, help: &str| {
            if let (Some(p), Some(Subject::Tenant(_))) = (f.get(key), subject) {
                c.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!("{what} grants `{key}` to a tenant"),
                    )
                    .at(p.key.span, format!("`{key}` is a tier's"))
                    .help(help.to_string()),
                );
                return None;
            }
            f.get(key)
        };
        let priority_p = tier_only(
            self,
            "priority",
            subject,
            "a tenant's requests take their tier's priority: grant the tenant a `weight` (its share within the tier), or write the exception for the tier",
        );
        let reserve_p = tier_only(
            self,
            "reserve",
            subject,
            "reserved shares are a tier's: write the exception for the tier",
        );
        if let (Some(p), Some(Subject::Tier(_))) = (f.get("weight"), subject) {
            self.err(
                Diagnostic::error(Code::InvalidValue, format!("{what} grants `weight` to a tier"))
                    .at(p.key.span, "`weight` is a tenant's")
                    .help("a weight is a tenant's share within its tier: write the exception for a tenant, or grant the tier `priority`"),
            );
        }

        let priority = self
            .prop_bounded(
                priority_p,
                Ty::Count,
                "`priority`",
                limits::MAX_PRIORITY,
                "`priority` is from 0 to 1000000",
            )
            .ok()
            .flatten()
            .map(|x| x as i64);
        let weight = match (f.get("weight"), subject) {
            (Some(p), Some(Subject::Tenant(_))) => {
                self.prop_quantity(Some(p), Ty::Count, "`weight`")
            }
            _ => None,
        };
        let quota = self.scoped_quota(f.get("quota"), &what);
        let reserve = self.tier_reserve(reserve_p, &what);

        if priority.is_none()
            && weight.is_none()
            && !quota.is_limited()
            && reserve.is_empty()
            && !f
                .map
                .keys()
                .any(|k| matches!(*k, "priority" | "weight" | "quota" | "reserve"))
        {
            self.err(
                Diagnostic::error(Code::MissingField, format!("{what} grants nothing"))
                    .at(d.name.span, "no grant")
                    .help("grant at least one of `priority N` (a tier), `weight N` (a tenant), `quota { … }` or `reserve { POOL SHARE }` (a tier)"),
            );
        }

        let (Some(subject), Some((from, until)), Some(reason)) = (subject, dates, reason) else {
            return;
        };
        let e = Exception {
            name: d.name.name.clone(),
            subject,
            from,
            until,
            priority,
            weight,
            quota,
            reserve,
            reason,
            owner,
            span: d.name.span,
        };
        if self.exception_grants_more(&e, &f, &what) {
            self.g.exceptions.push(e);
        }
    }

    /// `tenant NAME` or `tier NAME`: exactly one.
    fn exception_subject(&mut self, f: &Fields, d: &ast::Decl, what: &str) -> Option<Subject> {
        let name_of = |c: &mut Self, p: &Property, kind: DeclKind| -> Option<u32> {
            match c.one(p, "NAME").map(|v| &v.kind) {
                Some(ValueKind::Path(path)) if path.len() == 1 => {
                    let id = path[0].clone();
                    c.resolve(kind, &id)
                }
                Some(_) => {
                    c.err(
                        Diagnostic::error(
                            Code::UnitMismatch,
                            format!("`{}` names one {}", p.key.name, kind.keyword()),
                        )
                        .at(p.span, format!("expected a {} name", kind.keyword()))
                        .help(format!("write `{} NAME`", kind.keyword())),
                    );
                    None
                }
                None => None,
            }
        };
        match (f.get("tenant"), f.get("tier")) {
            (Some(a), Some(b)) => {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!("{what} names both a tenant and a tier"),
                    )
                    .at(b.span, "second subject")
                    .also(a.span, "first subject")
                    .help("an exception grants to one tier or one tenant; write one exception for each"),
                );
                None
            }
            (Some(p), None) => {
                name_of(self, p, DeclKind::Tenant).map(|t| Subject::Tenant(t as TenantId))
            }
            (None, Some(p)) => name_of(self, p, DeclKind::Tier).map(|t| Subject::Tier(t as TierId)),
            (None, None) => {
                self.err(
                    Diagnostic::error(
                        Code::MissingField,
                        format!("{what} needs `tenant` or `tier`"),
                    )
                    .at(d.name.span, "grants to no one")
                    .help("add `tenant NAME` or `tier NAME`: whom the exception grants to"),
                );
                None
            }
        }
    }

    /// `dates A..B`: two real days, `A` not after `B`, both included.
    fn exception_dates(&mut self, p: &Property, what: &str) -> Option<(i32, i32)> {
        let v = self.one(p, "2026-12-28..2027-01-02")?;
        let ValueKind::Range(a, b) = &v.kind else {
            self.err(
                Diagnostic::error(Code::InvalidValue, format!("the dates of {what} are a range"))
                    .at(v.span, "expected `FIRST..LAST`")
                    .help("write `dates 2026-12-28..2027-01-02` (both days included, in the policy's time zone); one day is `dates 2026-11-27..2026-11-27`"),
            );
            return None;
        };
        let day = |c: &mut Self, x: &Value| -> Option<i32> {
            if !matches!(x.kind, ValueKind::Date(_)) {
                c.err(
                    Diagnostic::error(Code::UnitMismatch, "an exception's dates are dates")
                        .at(x.span, "expected a date")
                        .help("write days as `YYYY-MM-DD`: `dates 2026-12-28..2027-01-02`"),
                );
                return None;
            }
            match units::literal(x) {
                Some(Ok(t)) => Some(t.value as i32),
                _ => {
                    if let Some(d) = units::bad_time(x) {
                        c.err(d);
                    }
                    None
                }
            }
        };
        let from = day(self, a);
        let until = day(self, b);
        let (from, until) = (from?, until?);
        if until < from {
            self.err(
                Diagnostic::error(Code::InvalidValue, format!("{what} ends before it starts"))
                    .at(v.span, "last day before the first")
                    .help(format!(
                        "write the first day first: `dates {}..{}`",
                        format::value(b),
                        format::value(a)
                    )),
            );
            return None;
        }
        Some((from, until))
    }

    /// Each grant must raise what the subject declares. Reports every one
    /// that does not; false if any.
    fn exception_grants_more(&mut self, e: &Exception, f: &Fields, what: &str) -> bool {
        let ok = std::cell::Cell::new(true);
        const NOT_MORE: &str = "not more than declared";
        let refuse = |c: &mut Self, key: &str, label: &str, msg: String, help: String| {
            let span = f.get(key).map_or(e.span, |p| p.span);
            c.err(
                Diagnostic::error(Code::InvalidValue, msg)
                    .at(span, label)
                    .help(help),
            );
            ok.set(false);
        };
        let (declared, subject) = match e.subject {
            Subject::Tier(t) => match self.g.tiers.get(t as usize) {
                Some(x) => (x.quota, format!("tier `{}`", x.name)),
                None => return false,
            },
            Subject::Tenant(t) => match self.g.tenants.get(t as usize) {
                Some(x) => (x.quota, format!("tenant `{}`", x.name)),
                None => return false,
            },
        };
        if let (Some(p), Subject::Tier(t)) = (e.priority, e.subject) {
            let base = self.g.tiers.get(t as usize).map_or(0, |x| x.priority);
            if p <= base {
                refuse(
                    self,
                    "priority",
                    NOT_MORE,
                    format!("{what} grants priority {p}, but {subject} already has {base}"),
                    format!(
                        "an exception only raises: grant more than {base}, or leave `priority` out"
                    ),
                );
            }
        }
        if let (Some(w), Subject::Tenant(t)) = (e.weight, e.subject) {
            let base = self.g.tenants.get(t as usize).map_or(1.0, |x| x.weight);
            if w <= base {
                refuse(
                    self,
                    "weight",
                    NOT_MORE,
                    format!("{what} grants weight {w}, but {subject} already has {base}"),
                    format!(
                        "an exception only raises: grant more than {base}, or leave `weight` out"
                    ),
                );
            }
        }
        let q = &e.quota;
        let dims: [(&str, Option<f64>, Option<f64>, Ty); 4] = [
            ("tokens", q.tokens, declared.tokens, Ty::Rate),
            ("requests", q.requests, declared.requests, Ty::Rate),
            (
                "concurrent",
                q.concurrent.map(|x| x as f64),
                declared.concurrent.map(|x| x as f64),
                Ty::Count,
            ),
            ("gpu_seconds", q.gpu_seconds, declared.gpu_seconds, Ty::Rate),
        ];
        for (key, grant, base, ty) in dims {
            let Some(grant) = grant else { continue };
            match base {
                None => refuse(
                    self,
                    "quota",
                    "would add a limit",format!("{what} grants a `{key}` quota {subject} does not have"),
                    format!("{subject} has no `{key}` limit, so it has all it could be granted; an exception raises a declared limit, it does not add one"),
                ),
                Some(b) if grant <= b => refuse(
                    self,
                    "quota",
                    NOT_MORE,format!(
                        "{what} grants `{key}` {}, but {subject} already has {}",
                        units::show(ty, grant),
                        units::show(ty, b)
                    ),
                    format!("an exception only raises: grant more than {}", units::show(ty, b)),
                ),
                Some(_) => {}
            }
        }
        if let Subject::Tier(t) = e.subject {
            for r in &e.reserve {
                let pool_name = self
                    .g
                    .pools
                    .get(r.pool as usize)
                    .map_or_else(String::new, |p| p.name.clone());
                let own = self
                    .g
                    .tiers
                    .get(t as usize)
                    .and_then(|x| x.reserve.iter().find(|x| x.pool == r.pool))
                    .map_or(0.0, |x| x.share);
                if r.share <= own {
                    refuse(
                        self,
                        "reserve",
                        NOT_MORE,format!("{what} reserves {}% of pool `{pool_name}`, but {subject} already reserves {own}%", r.share),
                        format!("an exception only raises: reserve more than {own}%"),
                    );
                    continue;
                }
                // The others' shares of the pool, as declared, plus the
                // grant: together at most the whole pool.
                let others: f64 = self
                    .g
                    .tiers
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != t as usize)
                    .flat_map(|(_, x)| x.reserve.iter())
                    .filter(|x| x.pool == r.pool)
                    .map(|x| x.share)
                    .sum();
                if others + r.share > 100.0 {
                    self.err(
                        Diagnostic::error(
                            Code::ReserveOversubscribed,
                            format!("{what} would reserve pool `{pool_name}` past 100%"),
                        )
                        .at(
                            r.span,
                            format!("{}% on top of the others' {others}%", r.share),
                        )
                        .help(format!("grant at most {}%", 100.0 - others)),
                    );
                    ok.set(false);
                }
            }
        }
        ok.get()
    }
}
