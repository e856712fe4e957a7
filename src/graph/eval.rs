//! One decision: classify → quota → route → admit → fallback. Pure: the same
//! graph, request and signals give the same decision. No allocation unless a
//! trace is recorded.

use super::cond::Ctx;
use super::input::{Request, Signals};
use super::trace::{NoTrace, Trace, Tracer};
use super::*;

/// Where a request runs: a variant of a model, on a pool (or any allowed pool
/// when `None`, left to the scheduler's placement).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Target {
    pub model: ModelId,
    pub variant: u16,
    pub pool: Option<PoolId>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission<'g> {
    Accept,
    /// Wait in the tier's queue at most this long (ms).
    Queue {
        max_wait: f64,
    },
    /// Hold until this time of day (minutes after midnight).
    Delay {
        until: u16,
    },
    /// Queued, with the tier held out of dispatch while the rule's
    /// condition is true; waits at most `max_wait` ms when given.
    Hold {
        max_wait: Option<f64>,
    },
    /// Accepted on a cheaper variant or a smaller max_tokens.
    Degrade,
    Reject(&'g Reject),
}

impl Admission<'_> {
    pub fn kind(&self) -> &'static str {
        match self {
            Admission::Accept => "accept",
            Admission::Queue { .. } => "queue",
            Admission::Delay { .. } => "delay",
            Admission::Hold { .. } => "hold",
            Admission::Degrade => "degrade",
            Admission::Reject(_) => "reject",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision<'g> {
    pub tenant: Option<TenantId>,
    pub tier: TierId,
    pub model: Option<ModelId>,
    pub target: Option<Target>,
    pub admission: Admission<'g>,
    /// 0-based index of the fallback step taken, if any.
    pub fallback_step: Option<u8>,
    /// The tier whose chain `fallback_step` indexes (after a demote it is the
    /// tier demoted to).
    pub fallback_chain: Option<TierId>,
    /// The request's max_tokens after any degrade.
    pub max_tokens: u64,
    pub classify_rule: RuleId,
    pub route_rule: Option<RuleId>,
    pub admit_rule: Option<RuleId>,
    pub step_rule: Option<RuleId>,
    /// The demote step taken on the way, if any.
    pub demote_rule: Option<RuleId>,
}

impl Decision<'_> {
    /// The model the request asked for, when the decision serves it with
    /// another model (a declared substitution); the target names the model
    /// that serves it.
    pub fn substituted_for(&self) -> Option<ModelId> {
        match (self.model, self.target) {
            (Some(m), Some(t)) if t.model != m => Some(m),
            _ => None,
        }
    }

    /// The rules that decided, in pipeline order (for coverage and explain).
    pub fn fired_rules(&self) -> impl Iterator<Item = RuleId> {
        [
            Some(self.classify_rule),
            self.route_rule,
            self.admit_rule,
            self.demote_rule,
            self.step_rule,
        ]
        .into_iter()
        .flatten()
    }
}

impl DecisionGraph {
    /// Decides one request. The hot path: no trace, no allocation.
    pub fn decide<'g>(&'g self, req: &Request, signals: &Signals) -> Decision<'g> {
        self.decide_with(req, signals, &mut NoTrace)
    }

    /// Decides and records why, condition by condition.
    pub fn explain<'g>(&'g self, req: &Request, signals: &Signals) -> (Decision<'g>, Trace) {
        let mut t = Trace::default();
        let d = self.decide_with(req, signals, &mut t);
        (d, t)
    }

    pub fn decide_with<'g, T: Tracer>(
        &'g self,
        req: &Request,
        signals: &Signals,
        t: &mut T,
    ) -> Decision<'g> {
        let mut tenant = match &req.tenant {
            Some(name) => self.tenant_id(name),
            None => None,
        };
        if tenant.is_none() {
            if let Some(k) = &req.api_key {
                tenant = self.tenant_for_key(k);
            }
        }
        let model = self.model_id(&req.model);
        let mut cx = Ctx {
            req,
            tenant,
            model,
            tier: None,
            signals,
        };

        // classify
        if t.enabled() {
            t.stage("classify", "classify".into());
            if req.tenant.is_some() && tenant.is_none() {
                t.note(format!(
                    "tenant `{}` is not defined by this policy",
                    req.tenant.as_deref().unwrap_or("")
                ));
            }
        }
        let (classify_rule, out) = first_match(&self.classify, &cx, t);
        if let Some(tn) = out.tenant {
            tenant = Some(tn);
            cx.tenant = Some(tn);
        }
        let mut tier = out.tier;
        if let Some(tn) = tenant.and_then(|i| self.tenants.get(i as usize)) {
            if !tn.tiers.is_empty() && !tn.tiers.contains(&tier) {
                let granted = tn.tiers[0];
                if t.enabled() {
                    t.note(format!(
                        "tier `{}` is not granted to tenant `{}`; it runs in its first granted tier `{}`",
                        self.tiers[tier as usize].name, tn.name, self.tiers[granted as usize].name
                    ));
                }
                tier = granted;
            }
        }
        cx.tier = Some(tier);
        if t.enabled() {
            self.trace_exceptions(tier, tenant, signals.date, t);
        }

        let mut d = Decision {
            tenant,
            tier,
            model,
            target: None,
            admission: Admission::Accept,
            fallback_step: None,
            fallback_chain: None,
            max_tokens: req.max_tokens,
            classify_rule,
            route_rule: None,
            admit_rule: None,
            step_rule: None,
            demote_rule: None,
        };

        // quota: the gateway reserves against token buckets; the graph refuses
        // outright when the live signals say the tenant has nothing left.
        if let Some(tn) = tenant.and_then(|i| self.tenants.get(i as usize)) {
            if t.enabled() {
                t.stage("quota", format!("tenant {}", tn.name));
            }
            if tn.quota.is_limited() && signals.quota_remaining(tenant) <= 0.0 {
                if t.enabled() {
                    t.note("quota exhausted (0% remaining)".into());
                }
                d.admission = Admission::Reject(&self.builtin.quota);
                return d;
            }
            // An exception's concurrency grant counts here too, so a trace
            // decided on the compiled graph says what the scheduler did.
            let concurrent = tn
                .quota
                .concurrent
                .map(|c| self.granted_concurrent(tenant, signals.date, c));
            if let (Some(limit), Some(id)) = (concurrent, tenant) {
                if signals.in_flight(id) >= limit {
                    if t.enabled() {
                        t.note(format!(
                            "{} requests in flight, limit {limit}",
                            signals.in_flight(id)
                        ));
                    }
                    d.admission = Admission::Reject(&self.builtin.concurrency);
                    return d;
                }
            }
            if t.enabled() {
                t.note(format!(
                    "within quota ({}% remaining)",
                    signals.quota_remaining(tenant)
                ));
            }
        }

        let Some(model) = model else {
            if t.enabled() {
                t.stage("route", "route".into());
                t.note(format!(
                    "model `{}` is not defined by this policy",
                    req.model
                ));
            }
            d.admission = Admission::Reject(&self.builtin.unknown_model);
            return d;
        };

        // A demote moves the request to another tier's route/admit/fallback;
        // validation proves demotes are acyclic, the bound is belt and braces.
        for _ in 0..=self.tiers.len() {
            match self.route_and_admit(&mut d, &mut cx, model, t) {
                Flow::Done => return d,
                Flow::Demote(to) => {
                    d.tier = to;
                    cx.tier = Some(to);
                }
            }
        }
        d
    }

    fn route_and_admit<'g, T: Tracer>(
        &'g self,
        d: &mut Decision<'g>,
        cx: &mut Ctx,
        model: ModelId,
        t: &mut T,
    ) -> Flow {
        let need_fallback = match self.route(d, cx, model, t) {
            Some(need) => need || self.admit(d, cx, t),
            None => return Flow::Done,
        };
        if need_fallback {
            self.fall_back(d, cx, model, t)
        } else {
            Flow::Done
        }
    }

    /// The tier's route for the model: sets the target, or refuses.
    /// `Some(true)` when the route (or its pool) sends the request down the
    /// fallback chain, `None` when the decision is already made.
    fn route<'g, T: Tracer>(
        &'g self,
        d: &mut Decision<'g>,
        cx: &mut Ctx,
        model: ModelId,
        t: &mut T,
    ) -> Option<bool> {
        let tier = d.tier;
        if !self.tier_allows_model(tier, model) {
            if t.enabled() {
                t.stage("route", format!("route {}", self.tiers[tier as usize].name));
                t.note("the tier may not use this model".into());
            }
            d.admission = Admission::Reject(&self.builtin.model_not_allowed);
            return None;
        }
        let Some(rs) = self.route_set(tier, model) else {
            // Validation guarantees a route for every usable (tier, model).
            d.admission = Admission::Reject(&self.builtin.model_not_allowed);
            return None;
        };
        if t.enabled() {
            t.stage(
                "route",
                format!(
                    "route {} {}",
                    self.tiers[tier as usize].name, self.models[model as usize].name
                ),
            );
        }
        let (rid, out) = first_match(rs, cx, t);
        d.route_rule = Some(rid);
        match out {
            RouteOutcome::Target(target) => {
                let target = self.place(*target, tier, d.tenant, cx.signals);
                if target.model != model && t.enabled() {
                    t.note(self.substitution_note(model, target.model, tier));
                }
                d.target = Some(target);
                let Some(p) = target.pool else {
                    return Some(false);
                };
                // A pool named by the route may still fence this tenant out.
                if !self.pools[p as usize].admits(tier, d.tenant) {
                    if t.enabled() {
                        t.note(format!(
                            "pool `{}` is fenced against this tenant",
                            self.pools[p as usize].name
                        ));
                    }
                    if self.fallbacks[tier as usize].is_none() {
                        d.admission = Admission::Reject(&self.builtin.pool_fenced);
                        return None;
                    }
                    return Some(true);
                }
                if cx.signals.saturated(p) && self.fallbacks[tier as usize].is_some() {
                    if t.enabled() {
                        t.note(format!(
                            "pool `{}` is saturated ({}% utilized, {}% of KV blocks held)",
                            self.pools[p as usize].name,
                            cx.signals.pool(p, super::signal::PoolField::Utilization),
                            cx.signals.pool(p, super::signal::PoolField::KvOccupancy)
                        ));
                    }
                    return Some(true);
                }
                Some(false)
            }
            RouteOutcome::Fallback => Some(true),
            RouteOutcome::Reject(r) => {
                d.admission = Admission::Reject(r);
                None
            }
        }
    }

    /// The tier's admission rules; true when they send the request down
    /// the fallback chain.
    fn admit<'g, T: Tracer>(&'g self, d: &mut Decision<'g>, cx: &mut Ctx, t: &mut T) -> bool {
        let tier = d.tier;
        let Some(rs) = &self.admits[tier as usize] else {
            d.admission = Admission::Accept;
            return false;
        };
        if t.enabled() {
            t.stage("admit", format!("admit {}", self.tiers[tier as usize].name));
        }
        let (rid, out) = first_match(rs, cx, t);
        d.admit_rule = Some(rid);
        match out {
            AdmitOutcome::Accept => d.admission = Admission::Accept,
            AdmitOutcome::Queue { max_wait } => {
                d.admission = Admission::Queue {
                    max_wait: *max_wait,
                }
            }
            AdmitOutcome::Delay { until } => d.admission = Admission::Delay { until: *until },
            AdmitOutcome::Hold { max_wait } => {
                d.admission = Admission::Hold {
                    max_wait: *max_wait,
                }
            }
            AdmitOutcome::Degrade {
                variant,
                max_tokens,
            } => self.degrade(d, cx, *variant, *max_tokens, t),
            AdmitOutcome::Reject(r) => d.admission = Admission::Reject(r),
            AdmitOutcome::Fallback => return true,
        }
        false
    }

    /// A degrade: another variant of the same model and/or fewer output
    /// tokens. One that changes nothing is an accept, and says so.
    fn degrade<T: Tracer>(
        &self,
        d: &mut Decision<'_>,
        cx: &mut Ctx,
        variant: Option<u16>,
        max_tokens: Option<u64>,
        t: &mut T,
    ) {
        let before = d.target;
        if let (Some(v), Some(tg)) = (variant, d.target) {
            let name = self.degrade_names.get(v as usize);
            // A bare variant is the current model's; `MODEL.VARIANT` names
            // the model: the one asked for, or a declared substitute.
            let named = self.degrade_models.get(v as usize).copied().flatten();
            let model = match named {
                None => Some(tg.model),
                Some(m) if m == tg.model || Some(m) == d.model => Some(m),
                Some(m) => d
                    .model
                    .filter(|&asked| self.substitution(asked, m, d.tier).is_some())
                    .map(|_| m),
            };
            let found = model.and_then(|mi| {
                self.models
                    .get(mi as usize)
                    .and_then(|m| m.variants.iter().position(|x| Some(&x.name) == name))
                    .map(|vi| (mi, vi))
            });
            match found {
                Some((mi, vi)) => {
                    let to = Target {
                        model: mi,
                        variant: vi as u16,
                        pool: None,
                    };
                    let placed = self.place(to, d.tier, d.tenant, cx.signals);
                    if t.enabled() {
                        if let (Some(asked), true) = (d.model, mi != tg.model) {
                            if mi != asked {
                                t.note(self.substitution_note(asked, mi, d.tier));
                            }
                        }
                    }
                    d.target = Some(placed);
                }
                None => {
                    if t.enabled() {
                        let shown = match named {
                            Some(m) => self.models[m as usize].name.clone(),
                            None => self.models[tg.model as usize].name.clone(),
                        };
                        t.note(match (named, model) {
                            (Some(_), None) => format!(
                                "`{shown}` may not serve this request (no `served_by` declares it for this tier); variant kept"
                            ),
                            _ => format!(
                                "model `{shown}` has no variant `{}`; variant kept",
                                name.map(String::as_str).unwrap_or("?")
                            ),
                        });
                    }
                }
            }
        }
        let mut changed = false;
        if let (Some(_), Some(before), Some(after)) = (variant, before, d.target) {
            changed |= before.variant != after.variant || before.model != after.model;
        }
        if let Some(m) = max_tokens {
            changed |= m < d.max_tokens;
            d.max_tokens = d.max_tokens.min(m);
        }
        d.admission = if changed {
            Admission::Degrade
        } else {
            Admission::Accept
        };
    }

    /// Walks the tier's fallback chain: the first step that can be taken
    /// decides (or demotes to another tier).
    fn fall_back<'g, T: Tracer>(
        &'g self,
        d: &mut Decision<'g>,
        cx: &mut Ctx,
        model: ModelId,
        t: &mut T,
    ) -> Flow {
        let tier = d.tier;
        let Some(chain) = &self.fallbacks[tier as usize] else {
            // Saturation without a chain: the scheduler queues it.
            d.admission = Admission::Accept;
            return Flow::Done;
        };
        if t.enabled() {
            t.stage(
                "fallback",
                format!("fallback {}", self.tiers[tier as usize].name),
            );
        }
        for (i, (rid, step)) in chain.steps.iter().enumerate() {
            let taken = match step {
                Step::Route(target) => self.fallback_route(d, cx, model, target, i, t),
                Step::Queue { max_wait } => {
                    d.admission = Admission::Queue {
                        max_wait: *max_wait,
                    };
                    if t.enabled() {
                        t.note(format!("step {}: queue", i + 1));
                    }
                    true
                }
                Step::Reject(r) => {
                    d.admission = Admission::Reject(r);
                    if t.enabled() {
                        t.note(format!("step {}: reject {}", i + 1, r.status));
                    }
                    true
                }
                Step::Demote(to) => {
                    d.demote_rule = Some(*rid);
                    if t.enabled() {
                        t.note(format!(
                            "step {}: demote to tier `{}`",
                            i + 1,
                            self.tiers[*to as usize].name
                        ));
                    }
                    return Flow::Demote(*to);
                }
            };
            if taken {
                d.fallback_step = Some(i as u8);
                d.fallback_chain = Some(tier);
                d.step_rule = Some(*rid);
                return Flow::Done;
            }
        }
        Flow::Done
    }

    /// A fallback step routing elsewhere: taken when it routes this model
    /// to a pool with room that admits the tenant.
    fn fallback_route<T: Tracer>(
        &self,
        d: &mut Decision<'_>,
        cx: &mut Ctx,
        model: ModelId,
        target: &Target,
        i: usize,
        t: &mut T,
    ) -> bool {
        // A step is for requests of the model it names, and for requests
        // of models that declare it their substitute in this tier.
        let substitute = target.model != model;
        if substitute && self.substitution(model, target.model, d.tier).is_none() {
            if t.enabled() {
                t.note(format!(
                    "step {}: not for `{}` requests: it routes model `{}`, which `{}` does not declare `served_by` for tier `{}`",
                    i + 1,
                    self.models[model as usize].name,
                    self.models[target.model as usize].name,
                    self.models[model as usize].name,
                    self.tiers[d.tier as usize].name
                ));
            }
            return false;
        }
        let placed = self.place(*target, d.tier, d.tenant, cx.signals);
        let ok = match placed.pool {
            Some(p) => !cx.signals.saturated(p) && self.pools[p as usize].admits(d.tier, d.tenant),
            None => false,
        };
        if t.enabled() {
            t.note(format!(
                "step {}: route {} {}",
                i + 1,
                self.variant_name(target.model, target.variant),
                if ok {
                    "has capacity: taken"
                } else {
                    "is saturated or fenced off: skipped"
                }
            ));
        }
        if ok {
            if substitute && t.enabled() {
                t.note(self.substitution_note(model, target.model, d.tier));
            }
            d.target = Some(placed);
            d.admission = Admission::Accept;
        }
        ok
    }

    /// What explain says when `by` serves a request for `model`.
    fn substitution_note(&self, model: ModelId, by: ModelId, tier: TierId) -> String {
        let (a, b) = (
            &self.models[model as usize].name,
            &self.models[by as usize].name,
        );
        match self.substitution(model, by, tier) {
            Some(s) => format!(
                "substituted: `{b}` serves this request for `{a}` (declared by `model {a} {{ served_by {b} }}` for tier `{}`; the response reports the {} model)",
                self.tiers[tier as usize].name,
                s.response_model.name()
            ),
            None => format!("substituted: `{b}` serves this request for `{a}`"),
        }
    }

    /// Chooses a pool for a target that names none: the first allowed pool,
    /// fenced-off and saturated pools last.
    fn place(&self, target: Target, tier: TierId, tenant: Option<TenantId>, s: &Signals) -> Target {
        if target.pool.is_some() {
            return target;
        }
        let Some(v) = self
            .models
            .get(target.model as usize)
            .and_then(|m| m.variants.get(target.variant as usize))
        else {
            return target;
        };
        let mut best: Option<(PoolId, (bool, bool))> = None;
        for &p in &v.pools {
            let fenced = !self.pools[p as usize].admits(tier, tenant);
            let key = (fenced, s.saturated(p));
            if best.is_none_or(|(_, k)| key < k) {
                best = Some((p, key));
            }
        }
        Target {
            pool: best.map(|(p, _)| p),
            ..target
        }
    }
}

enum Flow {
    Done,
    Demote(TierId),
}

fn first_match<'a, O, T: Tracer>(rs: &'a RuleSet<O>, cx: &Ctx, t: &mut T) -> (RuleId, &'a O) {
    // Explain shows every rule tried, so tracing walks the list in full.
    let Some(ix) = rs.by_tenant.as_ref().filter(|_| !t.enabled()) else {
        return first_match_linear(rs, cx, t);
    };
    let pinned: &[u32] = cx
        .tenant
        .and_then(|id| ix.pinned.get(id as usize))
        .map_or(&[], Vec::as_slice);
    let (mut a, mut b) = (0, 0);
    loop {
        let pos = match (pinned.get(a), ix.unpinned.get(b)) {
            (Some(&x), Some(&y)) if x < y => {
                a += 1;
                x
            }
            (_, Some(&y)) => {
                b += 1;
                y
            }
            (Some(&x), None) => {
                a += 1;
                x
            }
            (None, None) => break,
        };
        if let Some((id, cond, out)) = rs.rules.get(pos as usize) {
            if cond.eval(cx, t) {
                return (*id, out);
            }
        }
    }
    (rs.default.0, &rs.default.1)
}

/// First match by walking every rule in order: the reference the tenant
/// index must agree with, and what traces use.
fn first_match_linear<'a, O, T: Tracer>(
    rs: &'a RuleSet<O>,
    cx: &Ctx,
    t: &mut T,
) -> (RuleId, &'a O) {
    for (id, cond, out) in &rs.rules {
        let m = cond.eval(cx, t);
        if t.enabled() {
            t.rule(*id, m);
        }
        if m {
            return (*id, out);
        }
    }
    if t.enabled() {
        t.rule(rs.default.0, true);
    }
    (rs.default.0, &rs.default.1)
}
#[cfg(test)]
mod tests {
    use crate::compile::compile_str;
    use crate::graph::{DecisionGraph, Request, Signals, SignalsInput};

    const POLICY: &str = r#"
pool big { gpus 8 kind "H100" memory 80GB }
pool small { gpus 4 kind "L40S" memory 48GB deny_tenants [guest] }
model m {
  variant fp16 { memory 60GB pools [big] }
  variant int4 { memory 20GB pools [big, small] }
}
model tiny { variant fp16 { memory 10GB pools [small] } }
tier hi { priority 100 slo { ttft 500ms } preempts [lo] models [m] }
tier lo { priority 10 slo { window 1h } preemptible }
tier bulk { priority 5 slo { window 6h } preemptible }
tenant app { owner "o" tiers [hi, lo] quota { tokens 1M/min concurrent 2 } api_keys ["k-app"] }
tenant guest { owner "o" tiers [lo] }
classify {
  when header("x-tier") == "hi" => tier hi
  when tenant == app => tier hi
  default => tier lo
}
route hi m {
  when pool(big).utilization < 90% => fp16 on big
  default => fallback
}
route [lo, bulk] m { default => int4 }
route [lo, bulk] tiny { default => fp16 }
admit hi {
  when prompt_tokens > 10k => reject 413 "too long"
  when quota.remaining < 10% => degrade variant int4 max_tokens 64
  default => accept
}
admit lo {
  when time in 08:00..20:00 and weekday in mon..fri => delay until 20:00
  default => accept
}
fallback hi [route m.int4 on small, demote lo]
"#;

    fn graph() -> DecisionGraph {
        let c = compile_str("t.kiln", POLICY);
        let msgs: Vec<_> = c
            .diagnostics
            .items
            .iter()
            .map(|d| d.message.clone())
            .collect();
        c.graph
            .unwrap_or_else(|| panic!("does not compile: {msgs:?}"))
    }

    fn req(tenant: Option<&str>, model: &str) -> Request {
        Request {
            tenant: tenant.map(Into::into),
            model: model.into(),
            prompt_tokens: 100,
            max_tokens: 500,
            ..Default::default()
        }
    }

    fn signals(g: &DecisionGraph, json: &str) -> Signals {
        let input: SignalsInput = serde_json::from_str(json).unwrap();
        Signals::resolve(g, &input).unwrap()
    }

    #[test]
    fn routes_first_choice_when_idle() {
        let g = graph();
        let s = Signals::idle(&g);
        let v = g.view(&g.decide(&req(Some("app"), "m"), &s));
        assert_eq!(v.tier, "hi");
        assert_eq!(v.route.as_deref(), Some("m.fp16 on big"));
        assert_eq!(v.admission, "accept");
        assert_eq!(v.fallback_step, None);
    }

    #[test]
    fn api_key_identifies_the_tenant() {
        let g = graph();
        let mut r = req(None, "m");
        r.api_key = Some("k-app".into());
        let v = g.view(&g.decide(&r, &Signals::idle(&g)));
        assert_eq!(v.tenant.as_deref(), Some("app"));
        assert_eq!(v.tier, "hi");
    }

    #[test]
    fn headers_read_lists_the_header_names_conditions_use() {
        assert_eq!(graph().headers_read(), ["x-tier"]);
        let text = POLICY.replace(
            "when time in 08:00..20:00",
            "when header(\"X-Batch\") == \"y\" or not header(\"x-tier\") == \"a\" and time in 08:00..20:00",
        );
        let g = compile_str("t.kiln", &text).graph.unwrap();
        assert_eq!(g.headers_read(), ["x-batch", "x-tier"]);
        // Worked out once per graph: a clone equals it, and a clone that is
        // changed afterwards works it out again.
        let mut h = g.clone();
        assert_eq!(g, h);
        h.classify.rules.clear();
        h.routes.clear();
        h.admits.clear();
        assert!(h.headers_read().is_empty());
        assert_eq!(g.headers_read(), ["x-batch", "x-tier"]);
    }

    #[test]
    fn whether_a_policy_reads_estimated_wait() {
        assert!(!graph().reads_estimated_wait());
        for (from, to) in [
            ("when prompt_tokens > 10k", "when estimated_wait > 2s"),
            (
                "when quota.remaining < 10%",
                "when not (estimated_wait < 1s or prompt_tokens < 5)",
            ),
        ] {
            let text = POLICY.replace(from, to);
            assert_ne!(text, POLICY);
            let g = compile_str("t.kiln", &text).graph.unwrap();
            assert!(g.reads_estimated_wait(), "{to}");
            let mut h = g.clone();
            h.admits.clear();
            assert!(!h.reads_estimated_wait());
        }
    }

    #[test]
    fn a_header_cannot_raise_a_tenant_beyond_its_grant() {
        let g = graph();
        let mut r = req(Some("guest"), "m");
        r.headers.insert("X-Tier".into(), "hi".into());
        let (d, t) = g.explain(&r, &Signals::idle(&g));
        let v = g.view(&d);
        assert_eq!(v.tier, "lo");
        assert!(t.stages[0].notes.iter().any(|n| n.contains("not granted")));
    }

    #[test]
    fn saturation_takes_the_fallback_chain() {
        let g = graph();
        let s = signals(&g, r#"{ "pools": { "big": { "utilization": "95%" } } }"#);
        let v = g.view(&g.decide(&req(Some("app"), "m"), &s));
        assert_eq!(v.route.as_deref(), Some("m.int4 on small"));
        assert_eq!(v.fallback_step, Some(1));
    }

    #[test]
    fn demote_moves_to_the_lower_tier_and_its_rules() {
        let g = graph();
        let s = signals(
            &g,
            r#"{ "pools": { "big": { "utilization": "95%" }, "small": { "utilization": "100%" } }, "time": "10:00", "weekday": "wed" }"#,
        );
        let v = g.view(&g.decide(&req(Some("app"), "m"), &s));
        assert_eq!(v.tier, "lo");
        assert_eq!(v.admission, "delay");
        assert_eq!(v.delay_until.as_deref(), Some("20:00"));
    }

    #[test]
    fn degrade_changes_variant_and_caps_tokens() {
        let g = graph();
        let s = signals(
            &g,
            r#"{ "tenants": { "app": { "quota_remaining": "5%" } } }"#,
        );
        let v = g.view(&g.decide(&req(Some("app"), "m"), &s));
        assert_eq!(v.admission, "degrade");
        assert_eq!(v.route.as_deref(), Some("m.int4 on big"));
        assert_eq!(v.max_tokens, 64);
    }

    #[test]
    fn quota_and_concurrency_reject_with_429() {
        let g = graph();
        let s = signals(
            &g,
            r#"{ "tenants": { "app": { "quota_remaining": "0%" } } }"#,
        );
        let v = g.view(&g.decide(&req(Some("app"), "m"), &s));
        assert_eq!((v.admission.as_str(), v.status), ("reject", Some(429)));
        assert_eq!(v.reason.as_deref(), Some("quota"));
        let s = signals(&g, r#"{ "tenants": { "app": { "in_flight": 2 } } }"#);
        let v = g.view(&g.decide(&req(Some("app"), "m"), &s));
        assert_eq!(v.reason.as_deref(), Some("concurrency"));
    }

    #[test]
    fn policy_rejects_and_unknown_models() {
        let g = graph();
        let mut r = req(Some("app"), "m");
        r.prompt_tokens = 20_000;
        let v = g.view(&g.decide(&r, &Signals::idle(&g)));
        assert_eq!(v.status, Some(413));
        assert_eq!(v.message.as_deref(), Some("too long"));
        let v = g.view(&g.decide(&req(Some("app"), "gpt-9"), &Signals::idle(&g)));
        assert_eq!(v.status, Some(404));
        // tier hi may only use model m
        let v = g.view(&g.decide(&req(Some("app"), "tiny"), &Signals::idle(&g)));
        assert_eq!(v.status, Some(403));
    }

    #[test]
    fn placement_skips_fenced_pools() {
        let g = graph();
        let s = signals(&g, r#"{ "time": "21:00" }"#);
        // int4 may run on big or small; guest is fenced out of small, big is first anyway
        let v = g.view(&g.decide(&req(Some("guest"), "m"), &s));
        assert_eq!(v.route.as_deref(), Some("m.int4 on big"));
        let s = signals(
            &g,
            r#"{ "time": "21:00", "pools": { "big": { "utilization": "100%" } } }"#,
        );
        // big saturated: an unfenced saturated pool still beats a fenced one
        let v = g.view(&g.decide(&req(Some("guest"), "m"), &s));
        assert_eq!(v.route.as_deref(), Some("m.int4 on big"));
    }

    #[test]
    fn a_route_into_a_pool_fenced_against_the_tenant_is_refused() {
        let c = compile_str(
            "t.kiln",
            r#"
pool dedicated { gpus 8 kind "H100" memory 80GB allow_tenants [alpha] }
model m { variant fp16 { memory 20GB pools [dedicated] } }
tier online { priority 50 slo { ttft 1s } }
tenant alpha { owner "a" tiers [online] }
tenant beta { owner "b" tiers [online] }
classify { default => tier online }
route online m { default => fp16 on dedicated }
"#,
        );
        let g = c.graph.expect("compiles");
        let s = Signals::idle(&g);
        let ok = g.view(&g.decide(&req(Some("alpha"), "m"), &s));
        assert_eq!(ok.admission, "accept");
        let fenced = g.view(&g.decide(&req(Some("beta"), "m"), &s));
        assert_eq!(
            (fenced.admission.as_str(), fenced.status),
            ("reject", Some(403))
        );
        assert_eq!(fenced.reason.as_deref(), Some("pool-fenced"));
    }

    /// `batch`: the request came through the Batches API (a non-empty
    /// `x-kiln-batch` header); next to a tier named `batch` it still reads
    /// as the tier where a name is expected.
    #[test]
    fn the_batch_signal_reads_the_batch_header() {
        let c = compile_str(
            "t.kiln",
            r#"
pool p { gpus 1 kind "x" memory 80GB }
model m { variant fp16 { memory 1GB pools [p] } }
tier batch { priority 1 slo { window 24h } completion_windows [1h, 24h] }
tier online { priority 2 slo { ttft 1s } }
classify {
  when batch => tier batch
  default => tier online
}
route [batch, online] m { default => fp16 }
admit [batch, online] {
  when tier == batch and not batch => reject 400 "batch tier is for batches"
  default => accept
}
"#,
        );
        let g = c.graph.expect("compiles");
        assert_eq!(g.headers_read(), ["x-kiln-batch"]);
        let idle = Signals::idle(&g);
        let mut r = req(None, "m");
        assert_eq!(g.view(&g.decide(&r, &idle)).tier, "online");
        r.headers.insert("x-kiln-batch".into(), String::new());
        assert_eq!(
            g.view(&g.decide(&r, &idle)).tier,
            "online",
            "empty: not a batch"
        );
        r.headers.remove("x-kiln-batch");
        r.headers.insert("X-Kiln-Batch".into(), "batch_abc".into());
        let d = g.decide(&r, &idle);
        assert_eq!(g.view(&d).tier, "batch");
        assert!(matches!(d.admission, crate::graph::Admission::Accept));
    }

    #[test]
    fn conditions_negate_group_and_compare_units() {
        let c = compile_str(
            "t.kiln",
            r#"
pool p { gpus 1 kind "x" memory 80GB }
model m { variant fp16 { memory 1GB pools [p] } }
tier a { priority 3 slo { ttft 1s } }
tier b { priority 2 slo { ttft 1s } }
tier c { priority 1 slo { ttft 1s } }
classify {
  when not has_session and (prompt_tokens >= 2k or tag("big")) => tier a
  when 1500ms < tier(a).oldest_wait => tier b
  default => tier c
}
route [a, b, c] m { default => fp16 }
"#,
        );
        let g = c.graph.expect("compiles");
        let idle = Signals::idle(&g);
        let mut r = req(None, "m");
        r.prompt_tokens = 2000;
        assert_eq!(g.view(&g.decide(&r, &idle)).tier, "a");
        r.session = Some("s".into());
        assert_eq!(g.view(&g.decide(&r, &idle)).tier, "c");
        let waiting = signals(&g, r#"{ "tiers": { "a": { "oldest_wait": "2s" } } }"#);
        assert_eq!(g.view(&g.decide(&r, &waiting)).tier, "b");
        r.session = None;
        r.prompt_tokens = 10;
        r.tags = vec!["big".into()];
        assert_eq!(g.view(&g.decide(&r, &idle)).tier, "a");
    }

    #[test]
    fn a_degrade_to_a_declared_substitute_moves_the_request_to_its_model() {
        let text = POLICY
            .replace(
                "  variant int4 { memory 20GB pools [big, small] }\n}",
                "  variant int4 { memory 20GB pools [big, small] }\n  served_by tiny { tiers [hi] }\n}",
            )
            .replace("tier hi { priority 100 slo { ttft 500ms } preempts [lo] models [m] }", "tier hi { priority 100 slo { ttft 500ms } preempts [lo] models [m, tiny] }")
            .replace("route [lo, bulk] tiny", "route [hi, lo, bulk] tiny")
            .replace(
                "when quota.remaining < 10% => degrade variant int4 max_tokens 64",
                "when quota.remaining < 10% and model == m => degrade variant tiny.fp16\n  when quota.remaining < 20% and model == m => degrade variant m.int4",
            );
        let c = compile_str("t.kiln", &text);
        let g = c.graph.unwrap_or_else(|| panic!("{:?}", c.diagnostics));
        let low = signals(
            &g,
            r#"{ "tenants": { "app": { "quota_remaining": "5%" } } }"#,
        );
        let (d, t) = g.explain(&req(Some("app"), "m"), &low);
        let v = g.view(&d);
        assert_eq!(v.admission, "degrade");
        assert_eq!(v.route.as_deref(), Some("tiny.fp16 on small"));
        assert_eq!(v.substituted_for.as_deref(), Some("m"));
        assert_eq!(d.target.map(|t| t.model), g.model_id("tiny"));
        assert!(t
            .stages
            .iter()
            .flat_map(|s| &s.notes)
            .any(|n| n.contains("substituted: `tiny` serves this request for `m`")));
        // `MODEL.VARIANT` naming the request's own model is that variant.
        let some = signals(
            &g,
            r#"{ "tenants": { "app": { "quota_remaining": "15%" } } }"#,
        );
        let v = g.view(&g.decide(&req(Some("app"), "m"), &some));
        assert_eq!(v.route.as_deref(), Some("m.int4 on big"));
        assert_eq!(v.substituted_for, None);
    }

    #[test]
    fn decisions_are_deterministic() {
        let g = graph();
        let s = Signals::idle(&g);
        let r = req(Some("app"), "m");
        assert_eq!(g.decide(&r, &s), g.decide(&r, &s));
    }
}
