//! Whole-graph checks: every request reaches a terminal decision, fallback
//! chains terminate without cycles, preemption has no cycle, every tier can
//! route every model it may use, and every variant fits its pools.

use super::Compiler;
use crate::compile::units::{show, Ty};
use crate::diag::{Code, Diagnostic};
use crate::graph::*;
use crate::lang::ast::StepKind;

pub(crate) fn run(c: &mut Compiler) {
    // Nothing graph-level is meaningful while names failed to resolve.
    if c.g.tiers.is_empty() {
        return;
    }
    routes_cover_models(c);
    fallbacks_exist(c);
    chains_terminate(c);
    demotes_acyclic(c);
    preempts_acyclic(c);
    variants_fit(c);
    reserves_fit(c);
}

/// Pools a tier's requests can run in: the pools of every target its
/// route rules and fallback steps name (a target's own pool, else every
/// pool of its variant) that admit the tier. Sorted, each once.
pub(crate) fn tier_pools(g: &DecisionGraph, t: TierId) -> Vec<PoolId> {
    let mut out: Vec<PoolId> = Vec::new();
    let mut add = |target: &Target| {
        let pools: Vec<PoolId> = match target.pool {
            Some(p) => vec![p],
            None => g
                .models
                .get(target.model as usize)
                .and_then(|m| m.variants.get(target.variant as usize))
                .map(|v| v.pools.clone())
                .unwrap_or_default(),
        };
        out.extend(pools);
    };
    for m in 0..g.models.len() as ModelId {
        if let Some(rs) = g.route_set(t, m) {
            for o in rs.rules.iter().map(|r| &r.2).chain([&rs.default.1]) {
                if let RouteOutcome::Target(target) = o {
                    add(target);
                }
            }
        }
    }
    if let Some(ch) = g.fallbacks.get(t as usize).and_then(|c| c.as_ref()) {
        for (_, s) in &ch.steps {
            if let Step::Route(target) = s {
                add(target);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out.retain(|&p| g.pools.get(p as usize).is_some_and(|x| x.admits(t, None)));
    out
}

/// A tier reserves only pools it can run in, and the reserves of one pool
/// add up to at most 100%.
fn reserves_fit(c: &mut Compiler) {
    let mut errs = Vec::new();
    for (t, tier) in c.g.tiers.iter().enumerate() {
        if tier.reserve.is_empty() {
            continue;
        }
        let reach = tier_pools(&c.g, t as TierId);
        for r in &tier.reserve {
            if reach.contains(&r.pool) {
                continue;
            }
            let pool = &c.g.pools[r.pool as usize];
            let why = if pool.admits(t as TierId, None) {
                "no route or fallback of the tier runs there"
            } else {
                "the pool is fenced against the tier"
            };
            errs.push(
                Diagnostic::error(
                    Code::ReserveUnreachable,
                    format!(
                        "tier `{}` reserves a share of pool `{}`, where it cannot run",
                        tier.name, pool.name
                    ),
                )
                .at(r.span, why)
                .also(pool.span, "pool declared here")
                .help(format!(
                    "route the tier to a variant in `{}`, or reserve a pool it runs in",
                    pool.name
                )),
            );
        }
    }
    for (p, pool) in c.g.pools.iter().enumerate() {
        let mut total = 0.0;
        let mut parts: Vec<(&str, f64, crate::source::Span)> = Vec::new();
        for tier in &c.g.tiers {
            for r in tier.reserve.iter().filter(|r| r.pool as usize == p) {
                total += r.share;
                parts.push((&tier.name, r.share, r.span));
            }
        }
        if total <= 100.0 + 1e-9 {
            continue;
        }
        let shown: Vec<String> = parts
            .iter()
            .map(|(t, s, _)| format!("{t} {}", show(Ty::Percent, *s)))
            .collect();
        let mut d = Diagnostic::error(
            Code::ReserveOversubscribed,
            format!(
                "the tiers reserve {} of pool `{}` ({})",
                show(Ty::Percent, total),
                pool.name,
                shown.join(", ")
            ),
        );
        if let Some((_, _, last)) = parts.last() {
            d = d.at(*last, "the reserves pass 100% here");
        }
        for (_, _, span) in parts.iter().rev().skip(1) {
            d = d.also(*span, "also reserved here");
        }
        errs.push(d.help(format!(
            "the shares reserved in one pool add up to at most 100%: lower them, or grow `{}` into two pools",
            pool.name
        )));
    }
    for d in errs {
        c.err(d);
    }
}

fn routes_cover_models(c: &mut Compiler) {
    let nm = c.g.models.len() as ModelId;
    for t in 0..c.g.tiers.len() as TierId {
        for m in 0..nm {
            if !c.g.tier_allows_model(t, m) || c.route_spans.contains_key(&(t, m)) {
                continue;
            }
            let tier = &c.g.tiers[t as usize];
            let model = &c.g.models[m as usize];
            let first_variant = model
                .variants
                .first()
                .map(|v| v.name.as_str())
                .unwrap_or("fp16");
            let d = Diagnostic::error(
                Code::NoRoute,
                format!("tier `{}` has no route for model `{}`", tier.name, model.name),
            )
            .at(tier.span, format!("requests for `{}` in this tier go nowhere", model.name))
            .help(format!(
                "add `route {} {} {{ default => {first_variant} }}`, or limit the tier with `models [...]`",
                tier.name, model.name
            ));
            c.err(d);
        }
    }
}

fn fallbacks_exist(c: &mut Compiler) {
    let uses = std::mem::take(&mut c.fallback_uses);
    let mut seen = std::collections::HashSet::new();
    for (t, span) in &uses {
        if c.fallback_spans.contains_key(t) || !seen.insert((*t, *span)) {
            continue;
        }
        let name = c.g.tiers[*t as usize].name.clone();
        c.err(
            Diagnostic::error(
                Code::NoTerminal,
                format!("requests of tier `{name}` can reach `fallback`, but the tier has no fallback chain"),
            )
            .at(*span, "nowhere to fall back to")
            .help(format!(
                "add `fallback {name} [queue 30s, reject 503 \"no capacity\" retry_after 10s]`"
            )),
        );
    }
    c.fallback_uses = uses;
}

/// A chain ends in `queue`, `reject` or `demote`. `queue D` waits up to D
/// for capacity and hands the request to the next step when it times out,
/// so steps may follow it; nothing may follow `reject` or `demote`.
fn chains_terminate(c: &mut Compiler) {
    let asts = c.facts.fallback_asts.clone();
    for (_, f) in &asts {
        let mut ended = false;
        for s in &f.steps {
            if ended {
                c.err(
                    Diagnostic::error(
                        Code::FallbackNotTerminal,
                        "this step follows a reject or demote and never runs",
                    )
                    .at(s.span, "unreachable step")
                    .help("reject and demote end a chain; move this step before them or delete it"),
                );
                break;
            }
            ended = matches!(s.kind, StepKind::Reject(_) | StepKind::Demote(_));
        }
        if let Some(last) = f.steps.last() {
            if !matches!(
                last.kind,
                StepKind::Queue(_) | StepKind::Reject(_) | StepKind::Demote(_)
            ) {
                c.err(
                    Diagnostic::error(Code::FallbackNotTerminal, "the fallback chain can run out of steps")
                        .at(last.span, "if this is saturated too, the request has nowhere to go")
                        .help("end the chain with `queue 30s`, `reject 503 \"…\" retry_after 10s` or `demote <tier>`"),
                );
            }
        }
    }
}

fn demotes_acyclic(c: &mut Compiler) {
    let n = c.g.tiers.len();
    let edges: Vec<Vec<TierId>> = (0..n)
        .map(|t| {
            c.g.fallbacks[t]
                .as_ref()
                .map(|ch| {
                    ch.steps
                        .iter()
                        .filter_map(|(_, s)| match s {
                            Step::Demote(to) => Some(*to),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect();
    if let Some(cycle) = find_cycle(&edges) {
        let names: Vec<String> = cycle
            .iter()
            .map(|t| c.g.tiers[*t as usize].name.clone())
            .collect();
        let from = cycle[0];
        let to = cycle.get(1).copied().unwrap_or(from);
        let span = c
            .facts
            .fallback_asts
            .iter()
            .filter(|(tiers, _)| tiers.contains(&from))
            .flat_map(|(_, f)| f.steps.iter())
            .find(|s| matches!(&s.kind, StepKind::Demote(i) if c.g.tiers.get(to as usize).is_some_and(|t| t.name == i.name)))
            .map(|s| s.span)
            .unwrap_or(c.g.tiers[from as usize].span);
        c.err(
            Diagnostic::error(Code::FallbackCycle, format!("fallback chains demote in a cycle: {}", names.join(" → ")))
                .at(span, "this demote closes the cycle")
                .help("a demoted request must end somewhere: end one of these chains with queue or reject instead"),
        );
    }
}

fn preempts_acyclic(c: &mut Compiler) {
    let edges: Vec<Vec<TierId>> = c.g.tiers.iter().map(|t| t.preempts.clone()).collect();
    if let Some(cycle) = find_cycle(&edges) {
        let names: Vec<String> = cycle
            .iter()
            .map(|t| c.g.tiers[*t as usize].name.clone())
            .collect();
        let from = names[0].clone();
        let to = names.get(1).cloned().unwrap_or_else(|| from.clone());
        let span = c
            .facts
            .preempt_spans
            .get(&(from.clone(), to.clone()))
            .copied()
            .unwrap_or(c.g.tiers[cycle[0] as usize].span);
        c.err(
            Diagnostic::error(Code::PreemptCycle, format!("tiers preempt each other in a cycle: {}", names.join(" → ")))
                .at(span, format!("`{from}` preempts `{to}` here"))
                .help("preemption must flow one way, from higher to lower priority; remove one of these preempts"),
        );
    }
}

/// A cycle as a closed path (first node repeated at the end), if any.
fn find_cycle(edges: &[Vec<TierId>]) -> Option<Vec<TierId>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Active,
        Done,
    }
    let n = edges.len();
    let mut mark = vec![Mark::New; n];
    let mut stack: Vec<TierId> = Vec::new();
    // Iterative DFS: a policy of thousands of tiers must not overflow the stack.
    for root in 0..n {
        if mark[root] != Mark::New {
            continue;
        }
        let mut work: Vec<(TierId, usize)> = vec![(root as TierId, 0)];
        mark[root] = Mark::Active;
        stack.push(root as TierId);
        while let Some((node, i)) = work.last().copied() {
            let next = edges.get(node as usize).and_then(|e| e.get(i)).copied();
            match next {
                Some(to) => {
                    if let Some(top) = work.last_mut() {
                        top.1 += 1;
                    }
                    match mark.get(to as usize) {
                        Some(Mark::Active) => {
                            let pos = stack.iter().position(|x| *x == to).unwrap_or(0);
                            let mut cycle: Vec<TierId> = stack[pos..].to_vec();
                            cycle.push(to);
                            return Some(cycle);
                        }
                        Some(Mark::New) => {
                            mark[to as usize] = Mark::Active;
                            stack.push(to);
                            work.push((to, 0));
                        }
                        _ => {}
                    }
                }
                None => {
                    mark[node as usize] = Mark::Done;
                    stack.pop();
                    work.pop();
                }
            }
        }
    }
    None
}

fn variants_fit(c: &mut Compiler) {
    let mut errs = Vec::new();
    for m in &c.g.models {
        for v in &m.variants {
            for &p in &v.pools {
                let pool = &c.g.pools[p as usize];
                if pool.gpus == 0 || pool.gpu_memory <= 0.0 {
                    continue; // already reported on the pool
                }
                if v.gpus_per_replica > pool.gpus {
                    errs.push(
                        Diagnostic::error(
                            Code::VariantDoesNotFit,
                            format!(
                                "variant `{}.{}` needs {} GPUs per replica but pool `{}` has {}",
                                m.name, v.name, v.gpus_per_replica, pool.name, pool.gpus
                            ),
                        )
                        .at(v.span, "cannot be placed")
                        .also(pool.span, "pool declared here")
                        .help(format!(
                            "gang placement needs all {} GPUs in one pool: remove `{}` from the variant's pools or grow the pool",
                            v.gpus_per_replica, pool.name
                        )),
                    );
                    continue;
                }
                let have = pool.gpu_memory * f64::from(v.gpus_per_replica);
                if v.memory > have {
                    errs.push(
                        Diagnostic::error(
                            Code::VariantDoesNotFit,
                            format!(
                                "variant `{}.{}` needs {} but {} GPU(s) of pool `{}` hold {}",
                                m.name,
                                v.name,
                                show(Ty::Size, v.memory),
                                v.gpus_per_replica,
                                pool.name,
                                show(Ty::Size, have)
                            ),
                        )
                        .at(v.span, "does not fit")
                        .also(pool.span, "pool declared here")
                        .help(format!(
                            "raise `gpus_per_replica` to {} or more, route a smaller variant, or remove `{}` from its pools",
                            (v.memory / pool.gpu_memory).ceil(),
                            pool.name
                        )),
                    );
                }
            }
        }
    }
    for e in errs {
        c.err(e);
    }
}
