//! Cross-model substitution: `model A { served_by B { tiers [..] } }` lets
//! model B serve requests for model A in those tiers. This module lowers and
//! checks the declaration, and checks every rule that names another model
//! than the request's (route targets, fallback steps, `degrade variant
//! MODEL.VARIANT`) against the declarations.

use super::Compiler;
use crate::diag::{suggest, Code, Diagnostic};
use crate::graph::*;
use crate::lang::ast::{
    self, CmpOp, DeclKind, Expr, ExprKind, Ident, Item, Operand, OutcomeItem, Property, StepKind,
    Value, ValueKind,
};
use crate::source::{FileId, Span};

pub(crate) const SERVED_BY_FIELDS: &[&str] = &["tiers", "response_model"];

/// The help line that says how to declare a missing substitution.
pub(crate) fn declare_help(model: &str, by: &str, tiers: &[String]) -> String {
    format!(
        "declare it on the model asked for: `model {model} {{ served_by {by} {{ tiers [{}] }} }}`",
        tiers.join(", ")
    )
}

impl Compiler<'_> {
    /// Lowers the `served_by` properties gathered while lowering models;
    /// runs once every model, tier and pool is lowered.
    pub(crate) fn lower_substitutions(&mut self) {
        let pending = std::mem::take(&mut self.served_by);
        for (model, p) in &pending {
            self.served_by_decl(*model, p);
        }
    }

    fn served_by_decl(&mut self, model: ModelId, p: &Property) {
        let Some(a) = self.g.models.get(model as usize).map(|m| m.name.clone()) else {
            return;
        };
        let by_ident = match p.args.values() {
            [Value {
                kind: ValueKind::Path(path),
                ..
            }] if path.len() == 1 => Some(path[0].clone()),
            _ => None,
        };
        let (Some(by_ident), Some(body)) = (by_ident, &p.body) else {
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    "a substitution is `served_by MODEL { tiers [..] }`",
                )
                .at(p.span, "malformed substitution")
                .help(format!(
                    "write `served_by llama-8b {{ tiers [batch] }}` inside `model {a}`: llama-8b may then serve requests for {a} in tier batch"
                )),
            );
            return;
        };
        let Some(by) = self
            .resolve(DeclKind::Model, &by_ident)
            .map(|x| x as ModelId)
        else {
            return;
        };
        if by == model {
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    format!("model `{a}` cannot be served by itself"),
                )
                .at(by_ident.span, "the model being declared")
                .help(format!(
                    "`served_by` names another model that may serve requests for `{a}`; requests for `{a}` may always run on its own variants"
                )),
            );
            return;
        }
        if let Some(first) = self
            .g
            .substitutions
            .iter()
            .find(|s| s.model == model && s.by == by)
            .map(|s| s.span)
        {
            self.err(
                Diagnostic::error(
                    Code::DuplicateDefinition,
                    format!("model `{a}` declares `served_by {}` twice", by_ident.name),
                )
                .at(by_ident.span, "declared again here")
                .also(first, "first declared here")
                .help("list every tier in one `served_by` block"),
            );
            return;
        }
        let b = by_ident.name.clone();
        let what = format!("`served_by {b}` of model `{a}`");
        let f = self.fields(body, SERVED_BY_FIELDS, &what, &[]);
        let Some(tp) = f.get("tiers") else {
            self.err(
                Diagnostic::error(Code::MissingField, format!("{what} needs `tiers`"))
                    .at(by_ident.span, "for which tiers?")
                    .help(format!(
                        "add `tiers [batch]`: the tiers whose requests for `{a}` `{b}` may serve"
                    )),
            );
            return;
        };
        let mut ok = true;
        let mut tiers = Vec::new();
        for v in list_values(tp) {
            let ValueKind::Path(path) = &v.kind else {
                self.err(
                    Diagnostic::error(Code::UnitMismatch, "`tiers` lists tier names")
                        .at(v.span, "expected a tier name")
                        .help("write `tiers [name, …]`"),
                );
                ok = false;
                continue;
            };
            let [ti] = path.as_slice() else {
                ok = false;
                continue;
            };
            let Some(t) = self.resolve(DeclKind::Tier, ti).map(|x| x as TierId) else {
                ok = false;
                continue;
            };
            ok &= self.substitute_usable(model, by, t, ti.span);
            if !tiers.contains(&t) {
                tiers.push(t);
            }
        }
        if tiers.is_empty() && ok {
            self.err(
                Diagnostic::error(Code::InvalidValue, format!("{what} names no tier"))
                    .at(tp.span, "empty")
                    .help("name the tiers whose requests the substitute may serve"),
            );
            return;
        }
        let response_model = match f.get("response_model") {
            None => ResponseModel::Served,
            Some(rp) => match rp.args.values() {
                [Value {
                    kind: ValueKind::Path(path),
                    span,
                }] if path.len() == 1 && rp.body.is_none() => {
                    match ResponseModel::parse(&path[0].name) {
                        Some(r) => r,
                        None => {
                            let help = suggest(&path[0].name, ResponseModel::NAMES)
                                .unwrap_or_else(|| {
                                    "write `response_model served` (the body's `model` is the model that ran, the default) or `response_model requested`".to_string()
                                });
                            self.err(
                                Diagnostic::error(
                                    Code::InvalidValue,
                                    format!(
                                        "`response_model` is served or requested, not `{}`",
                                        path[0].name
                                    ),
                                )
                                .at(*span, "not served or requested")
                                .help(help),
                            );
                            ok = false;
                            ResponseModel::Served
                        }
                    }
                }
                _ => {
                    self.err(
                        Diagnostic::error(Code::InvalidValue, "`response_model` takes one value")
                            .at(rp.span, "expected served or requested")
                            .help("write `response_model served` or `response_model requested`"),
                    );
                    ok = false;
                    ResponseModel::Served
                }
            },
        };
        if ok {
            self.g.substitutions.push(Substitution {
                model,
                by,
                tiers,
                response_model,
                span: by_ident.span,
            });
        }
    }

    /// A tier named by a substitution must be able to use both models, and
    /// some variant of the substitute must run on a pool the tier may use.
    fn substitute_usable(&mut self, model: ModelId, by: ModelId, t: TierId, span: Span) -> bool {
        let tn = self.g.tiers[t as usize].name.clone();
        let a = self.g.models[model as usize].name.clone();
        let b = self.g.models[by as usize].name.clone();
        for (m, role) in [(by, "substitute"), (model, "model asked for")] {
            if !self.g.tier_allows_model(t, m) {
                let mn = self.g.models[m as usize].name.clone();
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!("tier `{tn}` may not use model `{mn}`, the {role}"),
                    )
                    .at(span, format!("`{mn}` is not in this tier's `models`"))
                    .help(format!(
                        "add `{mn}` to `models [...]` of tier `{tn}`, or remove `{tn}` from `served_by {b}` of model `{a}`"
                    )),
                );
                return false;
            }
        }
        let routable = self.g.models[by as usize].variants.iter().any(|v| {
            v.pools
                .iter()
                .any(|&p| self.g.pools[p as usize].admits(t, None))
        });
        if !routable {
            self.err(
                Diagnostic::error(
                    Code::IsolationViolation,
                    format!("model `{b}` has no variant that tier `{tn}` may run"),
                )
                .at(span, format!("every pool of `{b}`'s variants fences `{tn}` out"))
                .help(format!(
                    "give `{b}` a variant on a pool that admits `{tn}`, or remove `{tn}` from the substitution"
                )),
            );
            return false;
        }
        true
    }

    /// A route block for model `model` that routes to `by`: every tier of
    /// the block must have the substitution declared.
    pub(crate) fn check_route_substitution(
        &mut self,
        model: ModelId,
        by: ModelId,
        tiers: &[TierId],
        at: &Ident,
    ) -> bool {
        let missing: Vec<String> = tiers
            .iter()
            .filter(|&&t| self.g.substitution(model, by, t).is_none())
            .map(|&t| self.g.tiers[t as usize].name.clone())
            .collect();
        if missing.is_empty() {
            return true;
        }
        let a = self.g.models[model as usize].name.clone();
        let b = self.g.models[by as usize].name.clone();
        self.err(
            Diagnostic::error(
                Code::UndeclaredSubstitution,
                format!(
                    "this route block is for model `{a}` but routes to model `{b}`, which may not serve `{a}` in {} `{}`",
                    if missing.len() == 1 { "tier" } else { "tiers" },
                    missing.join("`, `")
                ),
            )
            .at(at.span, "another model")
            .help(format!(
                "{}, or name a variant of `{a}`",
                declare_help(&a, &b, &missing)
            )),
        );
        false
    }

    /// Models whose requests can reach tier `t`'s route, admit and fallback
    /// blocks: those it has a route for.
    fn tier_models(&self, t: TierId) -> Vec<ModelId> {
        let mut ms: Vec<ModelId> = (0..self.g.models.len() as ModelId)
            .filter(|&m| self.route_spans.contains_key(&(t, m)))
            .collect();
        ms.sort_unstable();
        ms
    }

    fn silent_ids(&self, kind: DeclKind, names: &[Ident]) -> Vec<u32> {
        let table = match kind {
            DeclKind::Tier => &self.tiers,
            DeclKind::Model => &self.models,
            _ => return Vec::new(),
        };
        names
            .iter()
            .filter_map(|n| table.ids.get(&n.name).copied())
            .collect()
    }

    /// After every rule is lowered: fallback steps and `degrade variant
    /// MODEL.VARIANT` that name another model than the request's.
    pub(crate) fn check_rule_substitutions(&mut self, files: &[(FileId, ast::File)]) {
        for (_, f) in files {
            for item in &f.items {
                match item {
                    Item::Fallback(fb) => self.check_fallback_steps(fb),
                    Item::Admit(a) => self.check_degrades(a),
                    _ => {}
                }
            }
        }
    }

    /// A fallback step routes one model; it is taken for requests of that
    /// model and of models declaring it `served_by` for the tier. A step
    /// that no request of some tier of the chain could take is an error.
    fn check_fallback_steps(&mut self, fb: &ast::Fallback) {
        let tiers = self.silent_ids(DeclKind::Tier, &fb.tiers.names);
        for s in &fb.steps {
            let StepKind::Route { path, .. } = &s.kind else {
                continue;
            };
            let [mi, _] = path.as_slice() else { continue };
            let Some(&b) = self.models.ids.get(&mi.name) else {
                continue;
            };
            let b = b as ModelId;
            for &t in &tiers {
                let t = t as TierId;
                let ms = self.tier_models(t);
                if ms.is_empty()
                    || ms
                        .iter()
                        .any(|&m| m == b || self.g.substitution(m, b, t).is_some())
                {
                    continue;
                }
                let tn = self.g.tiers[t as usize].name.clone();
                let bn = mi.name.clone();
                let names: Vec<String> = ms
                    .iter()
                    .map(|&m| self.g.models[m as usize].name.clone())
                    .collect();
                self.err(
                    Diagnostic::error(
                        Code::UndeclaredSubstitution,
                        format!(
                            "this fallback step routes model `{bn}`, but tier `{tn}` routes no request for `{bn}`, and none of the models it routes (`{}`) declares `served_by {bn}`",
                            names.join("`, `")
                        ),
                    )
                    .at(mi.span, format!("never taken for tier `{tn}`"))
                    .help(format!(
                        "{}{}, or route a variant of `{}`",
                        declare_help(&names[0], &bn, std::slice::from_ref(&tn)),
                        if self.g.tier_allows_model(t, b) {
                            String::new()
                        } else {
                            format!(" and add `{bn}` to tier `{tn}`'s `models [...]`")
                        },
                        names[0]
                    )),
                );
                break;
            }
        }
    }

    /// `degrade variant MODEL.VARIANT` moves a request to that model's
    /// variant: every model whose requests can reach the rule (the tiers'
    /// models, narrowed by `model == X` / `model in [..]` at the top of its
    /// condition) must be that model or declare it `served_by`.
    fn check_degrades(&mut self, a: &ast::Admit) {
        let tiers = self.silent_ids(DeclKind::Tier, &a.tiers.names);
        for r in &a.rules.rules {
            let [OutcomeItem::Degrade {
                variant: Some(path),
                ..
            }] = r.outcome.items.as_slice()
            else {
                continue;
            };
            let [mi, _] = path.as_slice() else { continue };
            let Some(&b) = self.models.ids.get(&mi.name) else {
                continue;
            };
            let b = b as ModelId;
            let pins = r.cond.as_ref().map(pinned_models).unwrap_or_default();
            let mut missing: Vec<(ModelId, TierId)> = Vec::new();
            for &t in &tiers {
                let t = t as TierId;
                for m in self.tier_models(t) {
                    let name = &self.g.models[m as usize].name;
                    if pins.iter().any(|set| !set.contains(name)) {
                        continue;
                    }
                    if m != b && self.g.substitution(m, b, t).is_none() {
                        missing.push((m, t));
                    }
                }
            }
            let Some(&(m0, _)) = missing.first() else {
                continue;
            };
            let an = self.g.models[m0 as usize].name.clone();
            let bn = mi.name.clone();
            let shown: Vec<String> = missing
                .iter()
                .map(|&(m, t)| {
                    format!(
                        "`{}` in tier `{}`",
                        self.g.models[m as usize].name, self.g.tiers[t as usize].name
                    )
                })
                .collect();
            let tiers_for_a: Vec<String> = missing
                .iter()
                .filter(|(m, _)| *m == m0)
                .map(|&(_, t)| self.g.tiers[t as usize].name.clone())
                .collect();
            self.err(
                Diagnostic::error(
                    Code::UndeclaredSubstitution,
                    format!(
                        "`degrade variant {}` moves requests to model `{bn}`, which may not serve requests for {}",
                        path.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join("."),
                        shown.join(", ")
                    ),
                )
                .at(mi.span, "another model")
                .help(format!(
                    "{}; or limit the rule with `model == {bn}`, or name a bare variant (`degrade variant {}`) to stay on the request's model",
                    declare_help(&an, &bn, &tiers_for_a),
                    path[1].name
                )),
            );
        }
    }
}

fn list_values(p: &Property) -> Vec<&Value> {
    match p.args.values() {
        [v] => match &v.kind {
            ValueKind::List(items) => items.iter().collect(),
            _ => vec![v],
        },
        vs => vs.iter().collect(),
    }
}

/// The model sets a condition pins at its top level (`model == X`,
/// `model in [X, Y]`, joined by `and`): a request reaches the rule only if
/// its model is in every set.
fn pinned_models(e: &Expr) -> Vec<Vec<String>> {
    let is_model = |o: &Operand| matches!(o, Operand::Ref(r) if r.base.name == "model" && r.arg.is_none() && r.fields.is_empty());
    match &e.kind {
        ExprKind::And(parts) => parts.iter().flat_map(pinned_models).collect(),
        ExprKind::Paren(inner) => pinned_models(inner),
        ExprKind::Cmp {
            lhs,
            op: CmpOp::Eq,
            rhs,
        } => match (lhs, rhs) {
            (l, Operand::Ref(r)) if is_model(l) => vec![vec![r.base.name.clone()]],
            (Operand::Ref(r), l) if is_model(l) => vec![vec![r.base.name.clone()]],
            _ => Vec::new(),
        },
        ExprKind::In {
            lhs,
            set:
                Value {
                    kind: ValueKind::List(items),
                    ..
                },
        } if is_model(lhs) => vec![items
            .iter()
            .filter_map(|v| match &v.kind {
                ValueKind::Path(p) if p.len() == 1 => Some(p[0].name.clone()),
                _ => None,
            })
            .collect()],
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use crate::compile::compile_str;
    use crate::diag::Code;

    /// Three models; `{decl_a}` and `{decl_b}` go inside models `a` and `b`,
    /// `{rules}` after the base routes.
    fn policy(decl_a: &str, decl_b: &str, rules: &str) -> String {
        format!(
            r#"
pool p {{ gpus 8 kind "H100" memory 80GB }}
model a {{
  variant fp16 {{ memory 40GB pools [p] }}
  {decl_a}
}}
model b {{
  variant fp16 {{ memory 20GB pools [p] }}
  variant int4 {{ memory 10GB pools [p] }}
  {decl_b}
}}
model c {{ variant fp16 {{ memory 10GB pools [p] }} }}
tier t {{ priority 10 slo {{ ttft 1s }} }}
tier u {{ priority 5 slo {{ ttft 1s }} }}
classify {{ default => tier t }}
route [t, u] c {{ default => fp16 }}
{rules}
"#
        )
    }

    fn codes(text: &str) -> Vec<(Code, String)> {
        compile_str("s.kiln", text)
            .diagnostics
            .errors()
            .map(|d| (d.code, d.message.clone()))
            .collect()
    }

    const ROUTES: &str = "route [t, u] a { default => fp16 }\nroute [t, u] b { default => fp16 }";

    #[test]
    fn a_declared_route_substitution_compiles_and_is_directional() {
        let ok = policy(
            "served_by b { tiers [t, u] }",
            "",
            "route [t, u] a { default => b.int4 }\nroute [t, u] b { default => fp16 }",
        );
        assert_eq!(codes(&ok), []);
        // a may be served by b; b is not served by a.
        let back = policy(
            "served_by b { tiers [t, u] }",
            "",
            "route [t, u] a { default => fp16 }\nroute [t, u] b { default => a.fp16 }",
        );
        let e = codes(&back);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].0, Code::UndeclaredSubstitution);
        assert!(e[0].1.contains("for model `b` but routes to model `a`"));
    }

    #[test]
    fn substitution_is_not_transitive() {
        let rules = "route [t, u] a { default => c.fp16 }\nroute [t, u] b { default => fp16 }";
        let chained = policy(
            "served_by b { tiers [t, u] }",
            "served_by c { tiers [t, u] }",
            rules,
        );
        let e = codes(&chained);
        assert!(
            e.iter()
                .any(|(c, m)| *c == Code::UndeclaredSubstitution
                    && m.contains("routes to model `c`")),
            "{e:?}"
        );
        let direct = policy(
            "served_by b { tiers [t, u] }\n  served_by c { tiers [t, u] }",
            "served_by c { tiers [t, u] }",
            rules,
        );
        assert_eq!(codes(&direct), []);
    }

    #[test]
    fn a_route_substitution_needs_every_tier_of_the_block() {
        let text = policy(
            "served_by b { tiers [t] }",
            "",
            "route [t, u] a { default => b.fp16 }\nroute [t, u] b { default => fp16 }",
        );
        let e = codes(&text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].1.contains("in tier `u`"), "{e:?}");
    }

    #[test]
    fn a_degrade_to_another_model_is_checked_for_the_models_that_reach_it() {
        // Tier t routes a, b and c: unnarrowed, c's requests (and a's) may
        // not move to b.
        let admit = |cond: &str| {
            format!("{ROUTES}\nadmit t {{\n  when {cond} => degrade variant b.int4\n  default => accept\n}}")
        };
        let e = codes(&policy(
            "served_by b { tiers [t] }",
            "",
            &admit("prompt_tokens > 1k"),
        ));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].0, Code::UndeclaredSubstitution);
        assert!(e[0].1.contains("`c` in tier `t`"), "{e:?}");
        assert!(!e[0].1.contains("`a` in tier"), "{e:?}");
        // Narrowed to the models that may move: clean.
        for cond in [
            "model == a and prompt_tokens > 1k",
            "model in [a, b]",
            "(model == b)",
        ] {
            assert_eq!(
                codes(&policy("served_by b { tiers [t] }", "", &admit(cond))),
                [],
                "{cond}"
            );
        }
        // Without the declaration, a's requests are named.
        let e = codes(&policy("", "", &admit("model == a")));
        assert!(e[0].1.contains("`a` in tier `t`"), "{e:?}");
    }

    #[test]
    fn a_fallback_step_must_be_for_some_model_of_each_tier() {
        let chain = |tiers: &str| {
            format!(
                "route [t, u] a {{ default => fallback }}\nroute {tiers} b {{ default => fp16 }}\nfallback [t, u] [route b.int4 on p, queue 1s]"
            )
        };
        // t may not use b: the step is for no request of t.
        let base = policy("", "", &chain("u")).replace(
            "tier t { priority 10 slo { ttft 1s } }",
            "tier t { priority 10 slo { ttft 1s } models [a, c] }",
        );
        let e = codes(&base);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].1.contains("tier `t` routes no request for `b`"),
            "{e:?}"
        );
        // Declared for t (t may use b and routes it): the step is for a's requests too.
        let declared = policy("served_by b { tiers [t, u] }", "", &chain("[t, u]"));
        assert_eq!(codes(&declared), []);
    }

    #[test]
    fn a_substitution_checks_its_own_shape() {
        for (decl, code, what) in [
            ("served_by a { tiers [t] }", Code::InvalidValue, "by itself"),
            (
                "served_by bb { tiers [t] }",
                Code::UnknownName,
                "unknown model",
            ),
            ("served_by b { }", Code::MissingField, "needs `tiers`"),
            (
                "served_by b { tiers [] }",
                Code::InvalidValue,
                "names no tier",
            ),
            (
                "served_by b { tiers [tt] }",
                Code::UnknownName,
                "unknown tier",
            ),
            (
                "served_by b { tiers [t] mark \"x\" }",
                Code::UnknownField,
                "no field `mark`",
            ),
            (
                "served_by b { tiers [t] response_model both }",
                Code::InvalidValue,
                "served or requested",
            ),
            ("served_by b", Code::InvalidValue, "a substitution is"),
            (
                "served_by b { tiers [t] }\n  served_by b { tiers [u] }",
                Code::DuplicateDefinition,
                "twice",
            ),
        ] {
            let e = codes(&policy(decl, "", ROUTES));
            assert!(
                e.iter().any(|(c, m)| *c == code && m.contains(what)),
                "{decl}: {e:?}"
            );
        }
    }
}
