//! Lowering rule blocks: conditions are resolved and type/unit checked into
//! [`Cond`] trees; outcomes are checked against what their block may decide.

use super::decls::ty_article;
use super::units::{self, Ty};
use super::{BlockFacts, Compiler};
use crate::diag::{suggest, Code, Diagnostic};
use crate::graph::limits;
use crate::graph::signal::{self, PoolField, TenantField, TierField};
use crate::graph::*;
use crate::lang::ast::{
    self, CallArg, CmpOp, DeclKind, Expr, ExprKind, Ident, Item, Operand, OutcomeItem, Reference,
    RejectSpec, RuleBlock, StepKind, Value, ValueKind,
};
use crate::lang::format;
use crate::source::{FileId, Span};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    Classify,
    Route,
    Admit,
    Rollout,
}

const ALL_SIGNALS: &[&str] = &[
    "tenant",
    "api_key",
    "model",
    "tier",
    "session",
    "has_session",
    "batch",
    "prompt_tokens",
    "max_tokens",
    "estimated_wait",
    "time",
    "weekday",
    "date",
    "day",
    "error_rate",
    "header",
    "tag",
    "pool",
    "quota",
    "budget",
];

enum Const {
    Id(u32),
    Str(String),
    Num(f64),
    Bool(bool),
}

impl Compiler<'_> {
    pub(crate) fn lower_rules(&mut self, files: &[(FileId, ast::File)]) {
        let nt = self.g.tiers.len();
        let nm = self.g.models.len();
        self.g.routes = vec![None; nt * nm];
        self.g.admits = vec![None; nt];
        self.g.fallbacks = vec![None; nt];
        for (_, f) in files {
            for item in &f.items {
                match item {
                    Item::Classify(c)
                        if Some(Span {
                            end: c.span.start + 8,
                            ..c.span
                        }) == self.classify_span =>
                    {
                        self.classify(c)
                    }
                    Item::Route(r) => self.route(r),
                    Item::Admit(a) => self.admit(a),
                    Item::Fallback(fb) => self.fallback(fb),
                    _ => {}
                }
            }
        }
        self.check_rule_substitutions(files);
    }

    fn add_rule(&mut self, block: &str, index: usize, r: &ast::Rule) -> RuleId {
        self.g.rules.push(RuleInfo {
            block: block.to_string(),
            index,
            text: format::rule(r),
            span: r.head,
        });
        (self.g.rules.len() - 1) as RuleId
    }

    /// First-match-wins rules with an explicit default.
    fn rule_set<O>(
        &mut self,
        block: &str,
        head: Span,
        rb: &RuleBlock,
        scope: Scope,
        mut lower: impl FnMut(&mut Self, &ast::Outcome) -> Option<O>,
    ) -> Option<RuleSet<O>> {
        let mut rules = Vec::new();
        let mut default = None;
        let mut ok = true;
        let mut facts = BlockFacts {
            name: block.to_string(),
            rules: Vec::new(),
        };
        for (i, r) in rb.rules.iter().enumerate() {
            if default.is_some() {
                let what = if r.cond.is_some() {
                    "a rule"
                } else {
                    "a second default"
                };
                self.err(
                    Diagnostic::error(Code::RuleAfterDefault, format!("{what} after the default can never match"))
                        .at(r.head, "unreachable")
                        .help("rules are tried in order and the default always matches; move this rule above the default or delete it"),
                );
                ok = false;
                continue;
            }
            let id = self.add_rule(block, i + 1, r);
            let out = lower(self, &r.outcome);
            match &r.cond {
                Some(e) => {
                    let c = self.condition(e, scope);
                    facts.rules.push((r.head, dnf(e)));
                    self.rule_facts(e, &r.outcome);
                    match out {
                        Some(o) => rules.push((id, c, o)),
                        None => ok = false,
                    }
                }
                None => {
                    if out.is_none() {
                        ok = false;
                    }
                    default = Some((id, out));
                }
            }
        }
        self.facts.blocks.push(facts);
        let default = match default {
            Some((id, Some(o))) => Some((id, o)),
            Some((_, None)) => None,
            None => {
                self.err(
                    Diagnostic::error(
                        Code::MissingDefault,
                        format!("`{block}` has no default rule"),
                    )
                    .at(head, "no `default => …`")
                    .help("end the block with `default => …` so every request gets a decision"),
                );
                None
            }
        };
        if !ok {
            return None;
        }
        default.map(|default| RuleSet {
            rules,
            default,
            by_tenant: None,
        })
    }

    fn classify(&mut self, c: &ast::Classify) {
        let head = Span {
            end: c.span.start + 8,
            ..c.span
        };
        let set = self.rule_set("classify", head, &c.rules, Scope::Classify, |this, o| {
            this.classify_outcome(o)
        });
        // pins for the tier-not-granted lint
        for r in &c.rules.rules {
            if let (Some(e), Some(tier)) = (
                &r.cond,
                r.outcome.items.iter().find_map(|i| match i {
                    OutcomeItem::Tier(t) => Some(t),
                    _ => None,
                }),
            ) {
                let tenant_out = r.outcome.items.iter().find_map(|i| match i {
                    OutcomeItem::Tenant(t) => Some(t.name.clone()),
                    _ => None,
                });
                for tn in tenant_out.into_iter().chain(pinned_tenants(e)) {
                    self.facts
                        .classify_pins
                        .push((tn, tier.name.clone(), tier.span));
                }
            }
        }
        if let Some(set) = set {
            self.g.classify = set;
        }
    }

    fn classify_outcome(&mut self, o: &ast::Outcome) -> Option<ClassifyOutcome> {
        let mut tier = None;
        let mut tenant = None;
        let mut ok = true;
        for item in &o.items {
            match item {
                OutcomeItem::Tier(t) => {
                    if tier.is_some() {
                        self.err(dup_outcome(item.span(), "tier"));
                        ok = false;
                    }
                    tier = self.resolve(DeclKind::Tier, t).map(|x| x as TierId);
                    ok &= tier.is_some();
                }
                OutcomeItem::Tenant(t) => {
                    tenant = self.resolve(DeclKind::Tenant, t);
                    ok &= tenant.is_some();
                }
                other => {
                    self.err(
                        Diagnostic::error(Code::InvalidOutcome, "classify decides a tier and, optionally, a tenant")
                            .at(other.span(), "not a classify outcome")
                            .help("write `=> tier NAME` (and `tenant NAME`); admission and routing belong in admit and route blocks"),
                    );
                    ok = false;
                }
            }
        }
        if tier.is_none() && ok {
            self.err(
                Diagnostic::error(Code::InvalidOutcome, "this classify rule decides no tier")
                    .at(o.span, "no `tier …`")
                    .help("every classify outcome must name a tier: `=> tier batch`"),
            );
            ok = false;
        }
        if ok {
            tier.map(|tier| ClassifyOutcome { tier, tenant })
        } else {
            None
        }
    }

    fn tier_set(&mut self, n: &ast::NameSet) -> Vec<TierId> {
        let mut out = Vec::new();
        for i in &n.names {
            if let Some(t) = self.resolve(DeclKind::Tier, i) {
                out.push(t as TierId);
            }
        }
        out
    }

    fn route(&mut self, r: &ast::Route) {
        let tiers = self.tier_set(&r.tiers);
        let Some(model) = self
            .resolve(DeclKind::Model, &r.model)
            .map(|m| m as ModelId)
        else {
            return;
        };
        let block = format!("route {} {}", format::name_set(&r.tiers), r.model.name);
        let head = Span {
            end: r.model.span.end,
            ..r.span
        };
        let set = self.rule_set(&block, head, &r.rules, Scope::Route, |this, o| {
            this.route_outcome(o, model, &tiers)
        });
        let nm = self.g.models.len();
        for &t in &tiers {
            if let Some(first) = self.route_spans.get(&(t, model)).copied() {
                let tname = self.g.tiers[t as usize].name.clone();
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("tier `{tname}` has two routes for model `{}`", r.model.name),
                    )
                    .at(head, "second route")
                    .also(first, "first route")
                    .help("merge the rules into one route block"),
                );
                continue;
            }
            self.route_spans.insert((t, model), head);
            if let Some(s) = &set {
                self.g.routes[t as usize * nm + model as usize] = Some(s.clone());
            }
        }
    }

    fn route_outcome(
        &mut self,
        o: &ast::Outcome,
        model: ModelId,
        tiers: &[TierId],
    ) -> Option<RouteOutcome> {
        let [item] = o.items.as_slice() else {
            self.err(
                Diagnostic::error(Code::InvalidOutcome, "a route rule decides one thing")
                    .at(o.span, "more than one outcome")
                    .help("write `=> VARIANT [on POOL]`, `=> fallback` or `=> reject …`"),
            );
            return None;
        };
        match item {
            OutcomeItem::Target { path, pool, span } => {
                let target = self.target(path, pool.as_ref(), Some((model, tiers)), *span)?;
                for &t in tiers {
                    self.check_isolation(target, t, *span);
                }
                Some(RouteOutcome::Target(target))
            }
            OutcomeItem::Fallback(_) => {
                for &t in tiers {
                    self.fallback_uses.push((t, item.span()));
                }
                Some(RouteOutcome::Fallback)
            }
            OutcomeItem::Reject(r) => Some(RouteOutcome::Reject(self.reject(r)?)),
            other => {
                self.err(
                    Diagnostic::error(Code::InvalidOutcome, "a route rule picks a variant and pool")
                        .at(other.span(), "not a route outcome")
                        .help("write `=> VARIANT [on POOL]`, `=> fallback` or `=> reject …`; admission outcomes belong in an admit block"),
                );
                None
            }
        }
    }

    /// `variant`, `model.variant`, optionally `on pool`.
    fn target(
        &mut self,
        path: &[Ident],
        pool: Option<&Ident>,
        model: Option<(ModelId, &[TierId])>,
        span: Span,
    ) -> Option<Target> {
        let (m, vname) = match (path, model) {
            ([v], Some((m, _))) => (m, v),
            ([mi, v], _) => {
                let m = self.resolve(DeclKind::Model, mi)? as ModelId;
                if let Some((expected, tiers)) = model {
                    // Another model serves the route's requests only where
                    // the model asked for declares it (`served_by`).
                    if expected != m && !self.check_route_substitution(expected, m, tiers, mi) {
                        return None;
                    }
                }
                (m, v)
            }
            ([v], None) => {
                self.err(
                    Diagnostic::error(
                        Code::InvalidOutcome,
                        format!("`{}` does not say which model", v.name),
                    )
                    .at(v.span, "variant without model")
                    .help(format!("write `MODEL.{}`", v.name)),
                );
                return None;
            }
            _ => {
                self.err(
                    Diagnostic::error(Code::InvalidOutcome, "a route target is `model.variant`")
                        .at(span, "malformed target")
                        .help("write `llama-70b.int4 on shared`"),
                );
                return None;
            }
        };
        let variant = self.variant(m, vname)?;
        let p = match pool {
            Some(pi) => {
                let p = self.resolve(DeclKind::Pool, pi)? as PoolId;
                let v = &self.g.models[m as usize].variants[variant as usize];
                if !v.pools.contains(&p) {
                    let allowed: Vec<String> = v
                        .pools
                        .iter()
                        .map(|x| self.g.pools[*x as usize].name.clone())
                        .collect();
                    let vn = self.g.variant_name(m, variant);
                    self.err(
                        Diagnostic::error(
                            Code::InvalidValue,
                            format!("variant `{vn}` may not run on pool `{}`", pi.name),
                        )
                        .at(pi.span, "not one of the variant's pools")
                        .help(format!(
                            "add `{}` to the variant's `pools`, or route to one of: {}",
                            pi.name,
                            allowed.join(", ")
                        )),
                    );
                    return None;
                }
                Some(p)
            }
            None => None,
        };
        self.facts.used_variants.insert((
            self.g.models[m as usize].name.clone(),
            self.g.models[m as usize].variants[variant as usize]
                .name
                .clone(),
        ));
        Some(Target {
            model: m,
            variant,
            pool: p,
        })
    }

    fn variant(&mut self, m: ModelId, v: &Ident) -> Option<u16> {
        let model = &self.g.models[m as usize];
        if let Some(i) = model.variants.iter().position(|x| x.name == v.name) {
            return Some(i as u16);
        }
        let names: Vec<&str> = model.variants.iter().map(|x| x.name.as_str()).collect();
        let help = suggest(&v.name, names.iter().copied())
            .unwrap_or_else(|| format!("`{}` has variants: {}", model.name, names.join(", ")));
        let mname = model.name.clone();
        self.err(
            Diagnostic::error(
                Code::UnknownName,
                format!("model `{mname}` has no variant `{}`", v.name),
            )
            .at(v.span, "unknown variant")
            .help(help),
        );
        None
    }

    fn check_isolation(&mut self, t: Target, tier: TierId, span: Span) {
        let pools: Vec<PoolId> = match t.pool {
            Some(p) => vec![p],
            None => self.g.models[t.model as usize].variants[t.variant as usize]
                .pools
                .clone(),
        };
        if pools
            .iter()
            .any(|p| self.g.pools[*p as usize].admits(tier, None))
        {
            return;
        }
        let tn = self.g.tiers[tier as usize].name.clone();
        let names: Vec<String> = pools
            .iter()
            .map(|p| self.g.pools[*p as usize].name.clone())
            .collect();
        self.err(
            Diagnostic::error(
                Code::IsolationViolation,
                format!("tier `{tn}` is fenced out of pool `{}`", names.join("`, `")),
            )
            .at(span, format!("tier `{tn}` may not run here"))
            .help("route this tier to a pool whose allow_tiers/deny_tiers admit it, or change the pool's isolation"),
        );
    }

    fn reject(&mut self, r: &RejectSpec) -> Option<Arc<Reject>> {
        if !(400..=599).contains(&r.status) {
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    format!("`{}` is not an HTTP error status", r.status),
                )
                .at(r.status_span, "expected 4xx or 5xx")
                .help("use 429 for quota or admission, 503 for no capacity, 403 for not allowed"),
            );
            return None;
        }
        let retry_after = match &r.retry_after {
            Some(v) => Some(self.quantity(v, Ty::Duration, "`retry_after`")?),
            None => None,
        };
        Some(Arc::new(Reject {
            status: r.status,
            message: r
                .message
                .clone()
                .unwrap_or_else(|| "rejected by policy".into()),
            retry_after,
            reason: "policy",
        }))
    }

    fn admit(&mut self, a: &ast::Admit) {
        let tiers = self.tier_set(&a.tiers);
        let block = format!("admit {}", format::name_set(&a.tiers));
        let head = Span {
            end: a.tiers.span.end,
            ..a.span
        };
        let set = self.rule_set(&block, head, &a.rules, Scope::Admit, |this, o| {
            this.admit_outcome(o, &tiers)
        });
        for &t in &tiers {
            if let Some(first) = self.admit_spans.get(&t).copied() {
                let tn = self.g.tiers[t as usize].name.clone();
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("tier `{tn}` has two admit blocks"),
                    )
                    .at(head, "second admit block")
                    .also(first, "first admit block")
                    .help("merge the rules into one ordered block"),
                );
                continue;
            }
            self.admit_spans.insert(t, head);
            if let Some(s) = &set {
                self.g.admits[t as usize] = Some(s.clone());
            }
        }
    }

    fn admit_outcome(&mut self, o: &ast::Outcome, tiers: &[TierId]) -> Option<AdmitOutcome> {
        let [item] = o.items.as_slice() else {
            self.err(
                Diagnostic::error(Code::InvalidOutcome, "an admit rule decides one thing")
                    .at(o.span, "more than one outcome")
                    .help("write one of: accept, queue 30s, hold, delay until 20:00, degrade …, reject …, fallback"),
            );
            return None;
        };
        Some(match item {
            OutcomeItem::Accept(_) => AdmitOutcome::Accept,
            OutcomeItem::Fallback(s) => {
                for &t in tiers {
                    self.fallback_uses.push((t, *s));
                }
                AdmitOutcome::Fallback
            }
            OutcomeItem::Queue { max_wait, .. } => AdmitOutcome::Queue {
                max_wait: self.quantity(max_wait, Ty::Duration, "the queue's max wait")?,
            },
            OutcomeItem::Delay { until, .. } => AdmitOutcome::Delay {
                until: self.quantity(until, Ty::TimeOfDay, "`delay until`")? as u16,
            },
            OutcomeItem::Hold { max_wait, .. } => AdmitOutcome::Hold {
                max_wait: match max_wait {
                    Some(w) => Some(self.quantity(w, Ty::Duration, "the hold's max wait")?),
                    None => None,
                },
            },
            OutcomeItem::Degrade {
                variant,
                max_tokens,
                span,
            } => {
                let v = match variant {
                    Some(path) => Some(self.degrade_variant(path, tiers, *span)?),
                    None => None,
                };
                let m = match max_tokens {
                    Some(mv) => {
                        let n = self.quantity(mv, Ty::Count, "`max_tokens`")?;
                        if n > f64::from(limits::MAX_TOKENS) {
                            self.out_of_range(
                                mv.span,
                                "`max_tokens`",
                                &format!("`max_tokens` is at most {}", limits::MAX_TOKENS),
                            );
                            return None;
                        }
                        Some(n as u64)
                    }
                    None => None,
                };
                AdmitOutcome::Degrade {
                    variant: v,
                    max_tokens: m,
                }
            }
            OutcomeItem::Reject(r) => AdmitOutcome::Reject(self.reject(r)?),
            other => {
                self.err(
                    Diagnostic::error(Code::InvalidOutcome, "not an admission outcome")
                        .at(other.span(), "admit cannot decide this")
                        .help("write one of: accept, queue 30s, hold max_wait 30m, delay until 20:00, degrade variant int4, degrade max_tokens 256, reject 429 \"…\", fallback"),
                );
                return None;
            }
        })
    }

    /// The variant name a degrade moves to; it must exist in a model the
    /// tiers may use.
    fn degrade_variant(&mut self, path: &[Ident], tiers: &[TierId], _span: Span) -> Option<u16> {
        let vname = path.last()?;
        if path.len() == 2 {
            let m = self.resolve(DeclKind::Model, &path[0])? as ModelId;
            let _ = self.variant(m, vname)?;
            self.facts
                .used_variants
                .insert((self.g.models[m as usize].name.clone(), vname.name.clone()));
            return Some(self.intern_variant(&vname.name, Some(m)));
        }
        let mut found = false;
        for (mi, m) in self.g.models.iter().enumerate() {
            let usable = tiers.is_empty()
                || tiers
                    .iter()
                    .any(|t| self.g.tier_allows_model(*t, mi as ModelId));
            if usable && m.variants.iter().any(|v| v.name == vname.name) {
                found = true;
                self.facts
                    .used_variants
                    .insert((m.name.clone(), vname.name.clone()));
            }
        }
        if !found {
            let all: Vec<&str> = self
                .g
                .models
                .iter()
                .flat_map(|m| m.variants.iter().map(|v| v.name.as_str()))
                .collect();
            let help = suggest(&vname.name, all.iter().copied())
                .unwrap_or_else(|| "name a variant defined by a model these tiers use".to_string());
            self.err(
                Diagnostic::error(
                    Code::UnknownName,
                    format!("no model these tiers use has a variant `{}`", vname.name),
                )
                .at(vname.span, "unknown variant")
                .help(help),
            );
            return None;
        }
        Some(self.intern_variant(&vname.name, None))
    }

    /// A degrade's variant: a bare name (the request's model) or one
    /// model's variant.
    fn intern_variant(&mut self, name: &str, model: Option<ModelId>) -> u16 {
        if let Some(i) = self
            .g
            .degrade_names
            .iter()
            .zip(&self.g.degrade_models)
            .position(|(n, m)| n == name && *m == model)
        {
            return i as u16;
        }
        self.g.degrade_names.push(name.to_string());
        self.g.degrade_models.push(model);
        (self.g.degrade_names.len() - 1) as u16
    }

    fn fallback(&mut self, f: &ast::Fallback) {
        let tiers = self.tier_set(&f.tiers);
        let block = format!("fallback {}", format::name_set(&f.tiers));
        let head = Span {
            end: f.tiers.span.end,
            ..f.span
        };
        let mut steps = Vec::new();
        let mut ok = true;
        for (i, s) in f.steps.iter().enumerate() {
            self.g.rules.push(RuleInfo {
                block: block.clone(),
                index: i + 1,
                text: format::step(s),
                span: s.span,
            });
            let id = (self.g.rules.len() - 1) as RuleId;
            let step = match &s.kind {
                StepKind::Route { path, pool } => {
                    if path.len() != 2 {
                        self.err(
                            Diagnostic::error(
                                Code::InvalidOutcome,
                                "a fallback route names the model and the variant",
                            )
                            .at(s.span, "which model?")
                            .help("write `route MODEL.VARIANT on POOL`"),
                        );
                        None
                    } else {
                        let t = self.target(path, pool.as_ref(), None, s.span);
                        if let Some(t) = t {
                            for &tier in &tiers {
                                self.check_isolation(t, tier, s.span);
                            }
                        }
                        t.map(Step::Route)
                    }
                }
                StepKind::Queue(v) => self
                    .quantity(v, Ty::Duration, "the queue's max wait")
                    .map(|max_wait| Step::Queue { max_wait }),
                StepKind::Demote(t) => self
                    .resolve(DeclKind::Tier, t)
                    .map(|x| Step::Demote(x as TierId)),
                StepKind::Reject(r) => self.reject(r).map(Step::Reject),
            };
            match step {
                Some(st) => steps.push((id, st)),
                None => ok = false,
            }
        }
        if f.steps.is_empty() {
            self.err(
                Diagnostic::error(Code::FallbackNotTerminal, "the fallback chain is empty")
                    .at(head, "no steps")
                    .help("list steps ending in a terminal one: `[route m.int4 on shared, queue 30s, reject 503 \"…\"]`"),
            );
            ok = false;
        }
        for &t in &tiers {
            if let Some(first) = self.fallback_spans.get(&t).copied() {
                let tn = self.g.tiers[t as usize].name.clone();
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("tier `{tn}` has two fallback chains"),
                    )
                    .at(head, "second chain")
                    .also(first, "first chain")
                    .help("a tier has one ordered chain; merge them"),
                );
                continue;
            }
            self.fallback_spans.insert(t, head);
            if ok {
                self.g.fallbacks[t as usize] = Some(FallbackChain {
                    steps: steps.clone(),
                });
            }
        }
        self.facts.fallback_asts.push((tiers, f.clone()));
    }

    // ------------------------------------------------------------ conditions

    pub(crate) fn condition(&mut self, e: &Expr, scope: Scope) -> Cond {
        match &e.kind {
            ExprKind::Or(parts) => {
                Cond::Or(parts.iter().map(|p| self.condition(p, scope)).collect())
            }
            ExprKind::And(parts) => {
                if parts.is_empty() {
                    Cond::True
                } else {
                    Cond::And(parts.iter().map(|p| self.condition(p, scope)).collect())
                }
            }
            ExprKind::Not(inner) => Cond::Not(Box::new(self.condition(inner, scope))),
            ExprKind::Paren(inner) => self.condition(inner, scope),
            ExprKind::Truth(o) => self.truth(o, e, scope),
            ExprKind::Cmp { lhs, op, rhs } => self.comparison(lhs, *op, rhs, e, scope),
            ExprKind::In { lhs, set } => self.membership(lhs, set, e, scope),
        }
    }

    fn truth(&mut self, o: &Operand, e: &Expr, scope: Scope) -> Cond {
        let sig = match o {
            Operand::Ref(r) => match self.signal(r, scope) {
                Ok(Some(s)) => s,
                Ok(None) => {
                    self.unknown_signal(&r.base);
                    return Cond::True;
                }
                Err(()) => return Cond::True,
            },
            Operand::Lit(v) => {
                if let ValueKind::Bool(b) = v.kind {
                    return if b {
                        Cond::True
                    } else {
                        Cond::Not(Box::new(Cond::True))
                    };
                }
                self.err(
                    Diagnostic::error(
                        Code::UnitMismatch,
                        format!("`{}` is not a condition", format::value(v)),
                    )
                    .at(v.span, "a value on its own")
                    .help("compare it with a signal, like `estimated_wait > 2s`"),
                );
                return Cond::True;
            }
        };
        let ty = sig.ty();
        if ty != Ty::Bool {
            self.err(
                Diagnostic::error(
                    Code::UnitMismatch,
                    format!(
                        "`{}` is {}, not a condition",
                        format::operand(o),
                        ty_article(ty)
                    ),
                )
                .at(o.span(), format!("{} on its own", ty_article(ty)))
                .help(format!(
                    "compare it: `{} > …` or `{} == …`",
                    format::operand(o),
                    format::operand(o)
                )),
            );
            return Cond::True;
        }
        test(sig, TestOp::Truthy, false, e)
    }

    fn comparison(
        &mut self,
        lhs: &Operand,
        op: CmpOp,
        rhs: &Operand,
        e: &Expr,
        scope: Scope,
    ) -> Cond {
        let l = self.operand_signal(lhs, scope);
        let r = self.operand_signal(rhs, scope);
        // `batch` is a signal and a common tier or tenant name: compared
        // with a signal that is not a boolean (`tier == batch`), it is the
        // name.
        let (l, r) = match (l, r) {
            (Ok(Some(Sig::Batch)), Ok(Some(s))) if s.ty() != Ty::Bool => (Ok(None), Ok(Some(s))),
            (Ok(Some(s)), Ok(Some(Sig::Batch))) if s.ty() != Ty::Bool => (Ok(Some(s)), Ok(None)),
            other => other,
        };
        let (sig, sig_op, constant, op) = match (l, r) {
            (Err(()), _) | (_, Err(())) => return Cond::True,
            (Ok(Some(s)), Ok(None)) => (s, lhs, rhs, op),
            (Ok(None), Ok(Some(s))) => (s, rhs, lhs, flip(op)),
            (Ok(Some(_)), Ok(Some(_))) => {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "a condition compares a signal with a constant")
                        .at(e.span, "two signals")
                        .help("compare each signal with a fixed value; signal-to-signal comparisons are not supported"),
                );
                return Cond::True;
            }
            (Ok(None), Ok(None)) => {
                // Neither side is a signal: most likely a misspelt one.
                if let Operand::Ref(r) = lhs {
                    self.unknown_signal(&r.base);
                } else if let Operand::Ref(r) = rhs {
                    self.unknown_signal(&r.base);
                } else {
                    self.err(
                        Diagnostic::error(Code::InvalidValue, "this compares two constants")
                            .at(e.span, "always the same result")
                            .help("compare a signal such as `prompt_tokens` with a value"),
                    );
                }
                return Cond::True;
            }
        };
        let ty = sig.ty();
        let Some(k) = self.constant(ty, sig_op, constant) else {
            return Cond::True;
        };
        match k {
            Const::Num(x) => test(sig, TestOp::Num(op, x), false, e),
            other => {
                let negate = match op {
                    CmpOp::Eq => false,
                    CmpOp::Ne => true,
                    _ => {
                        self.err(
                            Diagnostic::error(
                                Code::InvalidValue,
                                format!(
                                    "{} can only be compared with `==` or `!=`",
                                    ty_article(ty)
                                ),
                            )
                            .at(e.span, format!("`{}` has no order", op.symbol()))
                            .help("use `==`, `!=` or `in [..]`"),
                        );
                        return Cond::True;
                    }
                };
                let top = match other {
                    Const::Id(i) => TestOp::IdIn(vec![i]),
                    Const::Str(s) => TestOp::StrIn(vec![s]),
                    Const::Bool(b) => {
                        return test(sig, TestOp::Truthy, negate == b, e);
                    }
                    Const::Num(_) => TestOp::Truthy,
                };
                test(sig, top, negate, e)
            }
        }
    }

    fn membership(&mut self, lhs: &Operand, set: &Value, e: &Expr, scope: Scope) -> Cond {
        let sig = match self.operand_signal(lhs, scope) {
            Ok(Some(s)) => s,
            Ok(None) => {
                if let Operand::Ref(r) = lhs {
                    self.unknown_signal(&r.base);
                }
                return Cond::True;
            }
            Err(()) => return Cond::True,
        };
        let ty = sig.ty();
        match &set.kind {
            ValueKind::List(items) => {
                let mut ids = Vec::new();
                let mut strs = Vec::new();
                for it in items {
                    match self.constant(ty, lhs, &bare_ref(it.clone())) {
                        Some(Const::Id(i)) => ids.push(i),
                        Some(Const::Str(s)) => strs.push(s),
                        Some(Const::Num(_)) | Some(Const::Bool(_)) => {
                            self.err(
                                Diagnostic::error(
                                    Code::InvalidValue,
                                    "`in [..]` lists names or strings",
                                )
                                .at(it.span, "a number in a list")
                                .help("for numbers use a range: `prompt_tokens in 1k..8k`"),
                            );
                            return Cond::True;
                        }
                        None => return Cond::True,
                    }
                }
                if !strs.is_empty() {
                    test(sig, TestOp::StrIn(strs), false, e)
                } else {
                    test(sig, TestOp::IdIn(ids), false, e)
                }
            }
            ValueKind::Range(a, b) => {
                if ty == Ty::Weekday {
                    let (Some(Const::Id(x)), Some(Const::Id(y))) = (
                        self.constant(ty, lhs, &bare_ref((**a).clone())),
                        self.constant(ty, lhs, &bare_ref((**b).clone())),
                    ) else {
                        return Cond::True;
                    };
                    let mut ids = vec![x];
                    let mut d = x;
                    while d != y {
                        d = (d + 1) % 7;
                        ids.push(d);
                    }
                    return test(sig, TestOp::IdIn(ids), false, e);
                }
                if !ty.is_numeric() {
                    self.err(
                        Diagnostic::error(
                            Code::UnitMismatch,
                            format!("{} has no range", ty_article(ty)),
                        )
                        .at(set.span, "a range")
                        .help("use `in [a, b]` to list values"),
                    );
                    return Cond::True;
                }
                // `18:00..24:00`: until midnight (ranges exclude their end).
                let end_of_day = ty == Ty::TimeOfDay
                    && matches!(&b.kind, ValueKind::TimeOfDay(c) if c.is_end_of_day());
                let (Some(Const::Num(x)), Some(Const::Num(y))) = (
                    self.constant(ty, lhs, &Operand::Lit((**a).clone())),
                    if end_of_day {
                        Some(Const::Num(24.0 * 60.0))
                    } else {
                        self.constant(ty, lhs, &Operand::Lit((**b).clone()))
                    },
                ) else {
                    return Cond::True;
                };
                // Days are whole: a date or day range includes its end
                // (`day in 28..2` is the 28th through the 2nd, wrapping
                // the month's end).
                if ty == Ty::DayOfMonth {
                    return test(sig, TestOp::Range(x, y + 1.0), false, e);
                }
                if ty == Ty::Date {
                    if x > y {
                        self.err(
                            Diagnostic::error(Code::InvalidValue, "the date range ends before it starts")
                                .at(set.span, "empty range")
                                .help("write the earlier date first (both ends are included: `date in 2026-12-28..2027-01-02`); for a range every month, use `day in 28..2`"),
                        );
                        return Cond::True;
                    }
                    return test(sig, TestOp::Range(x, y + 1.0), false, e);
                }
                if ty == Ty::TimeOfDay && x == y {
                    self.err(
                        Diagnostic::error(Code::InvalidValue, "this time range is empty")
                            .at(set.span, "from a time to itself")
                            .help("a range includes its start and excludes its end, so this one never holds; give two different times (a range may wrap midnight: `22:00..06:00`)"),
                    );
                    return Cond::True;
                }
                if x > y && ty != Ty::TimeOfDay {
                    self.err(
                        Diagnostic::error(Code::InvalidValue, "the range's start is above its end")
                            .at(set.span, "empty range")
                            .help("write the smaller bound first"),
                    );
                    return Cond::True;
                }
                test(sig, TestOp::Range(x, y), false, e)
            }
            _ => {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "`in` takes a list or a range")
                        .at(set.span, "not a list or range")
                        .help("write `tenant in [a, b]` or `time in 09:00..18:00`"),
                );
                Cond::True
            }
        }
    }

    fn operand_signal(&mut self, o: &Operand, scope: Scope) -> Result<Option<Sig>, ()> {
        match o {
            Operand::Ref(r) => self.signal(r, scope),
            Operand::Lit(_) => Ok(None),
        }
    }

    fn unknown_signal(&mut self, base: &Ident) {
        let help = suggest(&base.name, ALL_SIGNALS.iter().copied()).unwrap_or_else(|| "signals are: tenant, api_key, model, tier, session, has_session, batch, prompt_tokens, max_tokens, header(\"…\"), tag(\"…\"), pool(P).…, tier(T).…, tenant(X).…, quota.remaining, budget.remaining, estimated_wait, error_rate, time, weekday, date, day (README lists every field)".to_string());
        self.err(
            Diagnostic::error(Code::UnknownName, format!("unknown signal `{}`", base.name))
                .at(base.span, "not a signal")
                .help(help),
        );
    }

    /// A field a pool, tier or tenant does not have: an old spelling says
    /// what to write now; anything else gets "did you mean".
    fn bad_live_field(
        &mut self,
        r: &Reference,
        base: &str,
        known: &[&str],
    ) -> Result<Option<Sig>, ()> {
        let Some(field) = r.fields.first() else {
            return Err(());
        };
        if let Some(msg) = signal::renamed(base, &field.name) {
            self.err(
                Diagnostic::error(
                    Code::UnknownField,
                    format!("`{base}(…).{}` was renamed", field.name),
                )
                .at(field.span, "renamed")
                .help(msg),
            );
            return Err(());
        }
        bad_field(self, field, known)
    }

    /// Resolves a reference to a signal. `Ok(None)`: a bare name (a constant
    /// such as a tenant name); the other side decides what it names.
    fn signal(&mut self, r: &Reference, scope: Scope) -> Result<Option<Sig>, ()> {
        let base = r.base.name.as_str();
        let fields: Vec<&str> = r.fields.iter().map(|f| f.name.as_str()).collect();
        let bad_shape = |this: &mut Self, example: &str| {
            this.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    format!(
                        "`{}` is not a signal",
                        format::operand(&Operand::Ref(r.clone()))
                    ),
                )
                .at(r.span, "malformed signal")
                .help(format!("write `{example}`")),
            );
            Err(())
        };
        let sig = match (base, &r.arg, fields.as_slice()) {
            ("tenant", None, []) => Sig::Tenant,
            ("api_key", None, []) => Sig::ApiKey,
            ("model", None, []) => Sig::Model,
            ("tier", None, []) => Sig::Tier,
            ("session", None, []) => Sig::Session,
            ("has_session", None, []) => Sig::HasSession,
            ("batch", None, []) => Sig::Batch,
            ("prompt_tokens", None, []) => Sig::PromptTokens,
            ("max_tokens", None, []) => Sig::MaxTokens,
            ("estimated_wait", None, []) => Sig::EstimatedWait,
            ("time", None, []) => Sig::TimeOfDay,
            ("weekday", None, []) => Sig::Weekday,
            ("date", None, []) => Sig::Date,
            ("day", None, []) => Sig::Day,
            ("error_rate", None, []) => Sig::ErrorRate,
            ("quota", None, ["remaining"]) => Sig::QuotaRemaining,
            ("quota", _, _) => return bad_shape(self, "quota.remaining"),
            ("budget", None, ["remaining"]) => Sig::BudgetRemaining,
            ("budget", _, _) => return bad_shape(self, "budget.remaining"),
            ("header", Some(CallArg::Str(h, _)), []) => Sig::Header(h.to_ascii_lowercase()),
            ("header", _, _) => return bad_shape(self, "header(\"x-kiln-tier\")"),
            ("tag", Some(CallArg::Str(t, _)), []) => Sig::Tag(t.clone()),
            ("tag", _, _) => return bad_shape(self, "tag(\"nightly\")"),
            ("pool", Some(CallArg::Name(p)), [field]) => {
                let Some(id) = self.resolve(DeclKind::Pool, p) else {
                    return Err(());
                };
                match PoolField::ALL.iter().find(|f| f.doc().field == *field) {
                    Some(f) => Sig::Pool(id as PoolId, *f),
                    None => {
                        return self.bad_live_field(
                            r,
                            "pool",
                            &PoolField::ALL.map(|f| f.doc().field),
                        )
                    }
                }
            }
            ("pool", _, _) => return bad_shape(self, "pool(NAME).utilization"),
            ("tier", Some(CallArg::Name(t)), [field]) => {
                let Some(id) = self.resolve(DeclKind::Tier, t) else {
                    return Err(());
                };
                match TierField::ALL.iter().find(|f| f.doc().field == *field) {
                    Some(f) => Sig::TierLive(id as TierId, *f),
                    None => {
                        return self.bad_live_field(
                            r,
                            "tier",
                            &TierField::ALL.map(|f| f.doc().field),
                        )
                    }
                }
            }
            ("tier", _, _) => return bad_shape(self, "tier(NAME).slo_attainment"),
            ("tenant", Some(CallArg::Name(t)), [field]) => {
                let Some(id) = self.resolve(DeclKind::Tenant, t) else {
                    return Err(());
                };
                match TenantField::ALL.iter().find(|f| f.doc().field == *field) {
                    Some(f) => Sig::TenantLive(id, *f),
                    None => {
                        return self.bad_live_field(
                            r,
                            "tenant",
                            &TenantField::ALL.map(|f| f.doc().field),
                        )
                    }
                }
            }
            ("tenant", _, _) => return bad_shape(self, "tenant(NAME).deadline_misses"),
            (_, None, []) => return Ok(None),
            _ => {
                self.unknown_signal(&r.base);
                return Err(());
            }
        };
        let request_attr = matches!(
            sig,
            Sig::Tenant
                | Sig::ApiKey
                | Sig::Model
                | Sig::Tier
                | Sig::Session
                | Sig::HasSession
                | Sig::Batch
                | Sig::PromptTokens
                | Sig::MaxTokens
                | Sig::Header(_)
                | Sig::Tag(_)
                | Sig::QuotaRemaining
                | Sig::BudgetRemaining
                | Sig::EstimatedWait
        );
        if let (Some(msg), [field]) = (
            signal::redefined(base, fields.first().copied().unwrap_or("")),
            r.fields.as_slice(),
        ) {
            self.facts.redefined.push((field.span, msg));
        }
        if sig == Sig::EstimatedWait && scope != Scope::Admit {
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    "`estimated_wait` is only known in admit",
                )
                .at(r.span, "not known here")
                .help("it is this request's predicted wait on the route chosen for it, so it exists once route has chosen; test it in an `admit` block, or read `tier(T).wait_p95` or `pool(P).queued` here"),
            );
            return Err(());
        }
        if scope == Scope::Rollout && request_attr {
            self.err(
                Diagnostic::error(Code::InvalidValue, format!("`{base}` is a request attribute; rollback conditions read live metrics"))
                    .at(r.span, "not a live metric")
                    .help("use a measured signal such as tier(T).ttft_p95, tier(T).slo_attainment, tier(T).error_rate, error_rate, pool(P).utilization or tenant(X).deadline_misses (README lists them all)"),
            );
            return Err(());
        }
        if scope == Scope::Classify && sig == Sig::Tier {
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    "classify decides the tier, so it cannot read it",
                )
                .at(r.span, "not known yet")
                .help("read request attributes such as tenant, header(\"…\") or model here"),
            );
            return Err(());
        }
        Ok(Some(sig))
    }

    /// The constant on the other side of a test, typed by the signal.
    fn constant(&mut self, ty: Ty, sig_op: &Operand, o: &Operand) -> Option<Const> {
        let sig_text = format::operand(sig_op);
        let bare = match o {
            Operand::Lit(v) => units::missing_unit(ty, v),
            Operand::Ref(_) => None,
        };
        let mismatch = |this: &mut Self, found: String, span: Span| {
            this.err(
                Diagnostic::error(
                    Code::UnitMismatch,
                    format!(
                        "cannot compare `{sig_text}` ({}) with {found}",
                        ty_article(ty)
                    ),
                )
                .at(span, format!("this is {found}"))
                .also(sig_op.span(), ty_article(ty))
                .help(
                    bare.clone()
                        .unwrap_or_else(|| format!("compare it with {}", ty.describe())),
                ),
            );
            None
        };
        match ty {
            Ty::Tenant | Ty::Tier | Ty::Model | Ty::Pool => {
                let kind = match ty {
                    Ty::Tenant => DeclKind::Tenant,
                    Ty::Tier => DeclKind::Tier,
                    Ty::Model => DeclKind::Model,
                    _ => DeclKind::Pool,
                };
                match o {
                    Operand::Ref(r) if r.arg.is_none() && r.fields.is_empty() => {
                        self.resolve(kind, &r.base).map(Const::Id)
                    }
                    Operand::Lit(Value {
                        kind: ValueKind::Path(p),
                        ..
                    }) if p.len() == 1 => self.resolve(kind, &p[0]).map(Const::Id),
                    Operand::Lit(Value {
                        kind: ValueKind::Str(s),
                        span,
                    }) => {
                        self.err(
                            Diagnostic::error(
                                Code::UnitMismatch,
                                format!("{} names are written bare, not quoted", kind.keyword()),
                            )
                            .at(*span, "a string")
                            .help(format!("write `{sig_text} == {s}`")),
                        );
                        None
                    }
                    other => mismatch(self, describe_operand(other), other.span()),
                }
            }
            Ty::Weekday => {
                let (name, span) = match o {
                    Operand::Ref(r) if r.arg.is_none() && r.fields.is_empty() => {
                        (r.base.name.clone(), r.span)
                    }
                    Operand::Lit(Value {
                        kind: ValueKind::Path(p),
                        span,
                    }) if p.len() == 1 => (p[0].name.clone(), *span),
                    other => return mismatch(self, describe_operand(other), other.span()),
                };
                match units::weekday(&name) {
                    Some(d) => Some(Const::Id(u32::from(d))),
                    None => {
                        self.err(
                            Diagnostic::error(
                                Code::InvalidValue,
                                format!("`{name}` is not a weekday"),
                            )
                            .at(span, "not a weekday")
                            .help("weekdays are mon, tue, wed, thu, fri, sat, sun"),
                        );
                        None
                    }
                }
            }
            Ty::Str => match o {
                Operand::Lit(Value {
                    kind: ValueKind::Str(s),
                    ..
                }) => Some(Const::Str(s.clone())),
                Operand::Ref(r) if r.arg.is_none() && r.fields.is_empty() => {
                    self.err(
                        Diagnostic::error(
                            Code::UnitMismatch,
                            format!("`{sig_text}` is a string; quote the value"),
                        )
                        .at(r.span, "a bare name")
                        .help(format!("write `{sig_text} == \"{}\"`", r.base.name)),
                    );
                    None
                }
                other => mismatch(self, describe_operand(other), other.span()),
            },
            Ty::Bool => match o {
                Operand::Lit(Value {
                    kind: ValueKind::Bool(b),
                    ..
                }) => Some(Const::Bool(*b)),
                other => mismatch(self, describe_operand(other), other.span()),
            },
            _ => match o {
                Operand::Lit(v) => match units::literal(v) {
                    // Every percentage signal is a share of a whole
                    // (utilization, occupancy, attainment, rates, quota
                    // left), so above 100% it is a typo, never a threshold.
                    Some(Ok(t))
                        if t.ty == ty && ty == Ty::Percent && t.value > limits::MAX_PERCENT =>
                    {
                        self.err(
                            Diagnostic::error(
                                Code::OutOfRange,
                                format!("`{sig_text}` is a share, from 0% to 100%: it never reaches `{}`", format::value(v)),
                            )
                            .at(v.span, "above 100%")
                            .also(sig_op.span(), "a share of a whole")
                            .help("compare it with a percentage from 0% to 100% (like `90%`)"),
                        );
                        None
                    }
                    // A day of the month is written as a plain number.
                    Some(Ok(t)) if ty == Ty::DayOfMonth && t.ty == Ty::Count => {
                        if t.value.fract() == 0.0 && (1.0..=31.0).contains(&t.value) {
                            Some(Const::Num(t.value))
                        } else {
                            self.err(
                                Diagnostic::error(
                                    Code::OutOfRange,
                                    format!("`{}` is not a day of the month", format::value(v)),
                                )
                                .at(v.span, "days of the month run from 1 to 31")
                                .help("write a whole day from 1 to 31 (`day in 28..2` wraps the month's end; a month without a 31st never reads 31)"),
                            );
                            None
                        }
                    }
                    Some(Ok(t)) if t.ty == ty => self
                        .in_type_range(v, t.value, ty, "the compared value")
                        .map(Const::Num),
                    Some(Ok(t)) => mismatch(
                        self,
                        format!("{} `{}`", ty_article(t.ty), format::value(v)),
                        v.span,
                    ),
                    Some(Err(e)) => {
                        self.err(units::bad_time(v).unwrap_or_else(|| {
                            Diagnostic::error(Code::InvalidValue, e.0)
                                .at(v.span, "not a valid quantity")
                                .help(format!("write {}", ty.describe()))
                        }));
                        None
                    }
                    None => mismatch(self, describe_operand(o), v.span),
                },
                other => mismatch(self, describe_operand(other), other.span()),
            },
        }
    }
}

fn bad_field(c: &mut Compiler, f: &Ident, options: &[&str]) -> Result<Option<Sig>, ()> {
    let help = suggest(&f.name, options.iter().copied())
        .unwrap_or_else(|| format!("fields are: {}", options.join(", ")));
    c.err(
        Diagnostic::error(
            Code::UnknownName,
            format!("unknown signal field `{}`", f.name),
        )
        .at(f.span, "no such field")
        .help(help),
    );
    Err(())
}

fn describe_operand(o: &Operand) -> String {
    match o {
        Operand::Lit(v) => match units::literal(v) {
            Some(Ok(t)) => format!("{} `{}`", ty_article(t.ty), format::value(v)),
            _ => match &v.kind {
                ValueKind::Str(_) => format!("a string `{}`", format::value(v)),
                ValueKind::Bool(_) => format!("a boolean `{}`", format::value(v)),
                ValueKind::List(_) => "a list".into(),
                _ => format!("`{}`", format::value(v)),
            },
        },
        Operand::Ref(r) => format!("the name `{}`", format::operand(&Operand::Ref(r.clone()))),
    }
}

fn flip(op: CmpOp) -> CmpOp {
    match op {
        CmpOp::Lt => CmpOp::Gt,
        CmpOp::Le => CmpOp::Ge,
        CmpOp::Gt => CmpOp::Lt,
        CmpOp::Ge => CmpOp::Le,
        o => o,
    }
}

fn test(sig: Sig, op: TestOp, negate: bool, e: &Expr) -> Cond {
    Cond::Test(Box::new(Test {
        sig,
        op,
        negate,
        text: format::expr(e),
    }))
}

fn dup_outcome(span: Span, what: &str) -> Diagnostic {
    Diagnostic::error(
        Code::InvalidOutcome,
        format!("the outcome names `{what}` twice"),
    )
    .at(span, "again here")
    .help(format!("name one {what}"))
}

/// Tenants a condition pins with `tenant == X` at its top level.
fn pinned_tenants(e: &Expr) -> Vec<String> {
    match &e.kind {
        ExprKind::And(parts) => parts.iter().flat_map(pinned_tenants).collect(),
        ExprKind::Paren(inner) => pinned_tenants(inner),
        ExprKind::Cmp {
            lhs: Operand::Ref(l),
            op: CmpOp::Eq,
            rhs: Operand::Ref(r),
        } if l.base.name == "tenant" && l.arg.is_none() && l.fields.is_empty() => {
            vec![r.base.name.clone()]
        }
        ExprKind::In {
            lhs: Operand::Ref(l),
            set:
                Value {
                    kind: ValueKind::List(items),
                    ..
                },
        } if l.base.name == "tenant" && l.arg.is_none() && l.fields.is_empty() => items
            .iter()
            .filter_map(|v| match &v.kind {
                ValueKind::Path(p) if p.len() == 1 => Some(p[0].name.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A condition as a disjunction of conjunctions of atom texts, for the
/// shadowed-rule lint. `None` when negations or size make it impractical.
impl Compiler<'_> {
    /// Facts for the numeric lints: each numeric comparison atom of a
    /// rule's condition (by its text, as `dnf` writes it), and each time
    /// range that wraps midnight with the rule's `delay until`.
    fn rule_facts(&mut self, e: &Expr, outcome: &ast::Outcome) {
        match &e.kind {
            ExprKind::Or(parts) | ExprKind::And(parts) => {
                for p in parts {
                    self.rule_facts(p, outcome);
                }
            }
            ExprKind::Paren(inner) => self.rule_facts(inner, outcome),
            ExprKind::Cmp { lhs, op, rhs } => {
                let (sig, op, v) = match (lhs, rhs) {
                    (Operand::Ref(r), Operand::Lit(v)) => (r, *op, v),
                    (Operand::Lit(v), Operand::Ref(r)) => (r, flip(*op), v),
                    _ => return,
                };
                let Some(Ok(t)) = units::literal(v) else {
                    return;
                };
                let k = t.value;
                let signal = format::operand(&Operand::Ref(sig.clone()));
                let (lo, lo_open, hi, hi_open) = match op {
                    CmpOp::Gt => (k, true, f64::INFINITY, false),
                    CmpOp::Ge => (k, false, f64::INFINITY, false),
                    CmpOp::Lt => (f64::NEG_INFINITY, false, k, true),
                    CmpOp::Le => (f64::NEG_INFINITY, false, k, false),
                    CmpOp::Eq => (k, false, k, false),
                    CmpOp::Ne => return,
                };
                self.facts.num_atoms.insert(
                    format::expr(e),
                    super::NumAtom {
                        signal,
                        lo,
                        lo_open,
                        hi,
                        hi_open,
                    },
                );
            }
            ExprKind::In { lhs, set } => {
                let ValueKind::Range(a, b) = &set.kind else {
                    return;
                };
                let (ValueKind::TimeOfDay(x), ValueKind::TimeOfDay(y)) = (&a.kind, &b.kind) else {
                    return;
                };
                let Operand::Ref(r) = lhs else { return };
                if r.base.name != "time" || !r.fields.is_empty() {
                    return;
                }
                let (Some(from), Some(to)) = (x.minutes(), y.minutes()) else {
                    return;
                };
                if from <= to {
                    return;
                }
                let delay_until = outcome.items.iter().find_map(|i| match i {
                    OutcomeItem::Delay { until, span } => match &until.kind {
                        ValueKind::TimeOfDay(c) => c.minutes().map(|m| (u32::from(m), *span)),
                        _ => None,
                    },
                    _ => None,
                });
                self.facts.wrapping_times.push(super::WrappingTime {
                    span: set.span,
                    from: u32::from(from),
                    to: u32::from(to),
                    delay_until,
                });
            }
            _ => {}
        }
    }
}

pub(crate) fn dnf(e: &Expr) -> Option<Vec<Vec<String>>> {
    match &e.kind {
        ExprKind::Or(parts) => {
            let mut out = Vec::new();
            for p in parts {
                out.extend(dnf(p)?);
            }
            (out.len() <= 64).then_some(out)
        }
        ExprKind::And(parts) => {
            let mut acc: Vec<Vec<String>> = vec![Vec::new()];
            for p in parts {
                let d = dnf(p)?;
                if acc.len().saturating_mul(d.len()) > 64 {
                    return None;
                }
                // Each conjunction so far grows in place with the last of
                // the new ones, so a long `and` chain (one conjunction) is
                // linear, not a copy of everything so far per term.
                let mut next = Vec::with_capacity(acc.len() * d.len());
                for mut a in acc {
                    if let Some((last, rest)) = d.split_last() {
                        for b in rest {
                            let mut c = a.clone();
                            c.extend(b.iter().cloned());
                            next.push(c);
                        }
                        a.extend(last.iter().cloned());
                        next.push(a);
                    }
                }
                acc = next;
            }
            for c in &mut acc {
                c.sort();
                c.dedup();
            }
            Some(acc)
        }
        ExprKind::Paren(inner) => dnf(inner),
        _ => Some(vec![vec![format::expr(e)]]),
    }
}

/// List items parse as values; a bare name in a list is a reference.
fn bare_ref(v: Value) -> Operand {
    match v {
        Value {
            kind: ValueKind::Path(p),
            span,
        } if p.len() == 1 => Operand::Ref(Reference {
            base: p[0].clone(),
            arg: None,
            fields: Vec::new(),
            span,
        }),
        v => Operand::Lit(v),
    }
}
