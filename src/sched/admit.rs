//! Admission: an arrival, once the policy has decided it, passes an ordered
//! list of small gates ([`GATES`]). Each gate either lets it through
//! (possibly noting what it found, like the replicas that can serve it) or
//! refuses it with a [`Reason`], a status and a Retry-After. The first
//! refusal wins, so the order is part of the semantics: cheap checks of
//! the request itself first, then capacity, then the tenant's budgets
//! (reserved only once everything before has passed), then the wait
//! estimate against the tier's SLO.
//!
//! This is the shape of the Gateway API Inference Extension's filters and
//! vLLM's request-queue policies: adding a rule of admission is adding a
//! gate, and every refusal names the gate that made it.

use super::queue::Waiting;
use super::{Arrival, Micros, Mode, Reason, ReqId, Scheduler, SEC};
use crate::graph::{Admission, DecisionGraph, Request, Target, TenantId, TierId};

/// A refusal: why, with which HTTP status, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Refusal {
    pub reason: Reason,
    pub status: u16,
    pub retry_after: Option<Micros>,
}

impl Refusal {
    fn new(reason: Reason, status: u16, retry_after: Option<Micros>) -> Refusal {
        Refusal {
            reason,
            status,
            retry_after,
        }
    }
}

/// An arrival on its way through the gates: what the policy decided and
/// what the gates so far have found.
pub(super) struct Admitting<'g> {
    pub id: ReqId,
    pub req: Request,
    pub graph: &'g DecisionGraph,
    pub tier: TierId,
    pub tenant: Option<TenantId>,
    pub admission: Admission<'g>,
    /// The decided route (a baseline ignores the policy's refusals).
    pub target: Option<Target>,
    /// `max_tokens` after any degrade.
    pub max_tokens: u64,
    /// The output length the request will be charged and scheduled for.
    pub output: u32,
    /// Replicas of the routed variant (on the routed pool, if any).
    pub candidates: Vec<usize>,
    /// KV tokens the sequence needs (prompt plus output).
    pub kv_need: u64,
    /// Quota tokens reserved, and whether they were borrowed from a cohort.
    pub reserved: f64,
    /// What was reserved of the tier's and model's quotas.
    pub scoped: Option<super::scoped::Scoped>,
    pub borrowed: bool,
    /// Comparison baselines skip admission control.
    pub baseline: bool,
    /// When admission estimated it would start (uncorrected), and whether
    /// it was first in fair order then (its estimate's kind).
    pub est_start: Option<(Micros, bool)>,
    /// Whether its replicas were contended when admission estimated it
    /// (none: not estimated).
    pub contended: Option<bool>,
    /// Its completion window from arrival: its own ([`Arrival::window`],
    /// a batch item's) or else its tier's, µs.
    pub window: Option<Micros>,
    /// Arrival plus `window`: when it must be finished.
    pub deadline: Option<Micros>,
    /// Its tenant's quotas were claimed across the fleet
    /// ([`Arrival::quota_claimed`]).
    pub quota_claimed: bool,
    /// What else the fleet claimed ([`Arrival::fleet`]).
    pub fleet: Option<&'g super::quota::FleetClaim>,
    /// Which of its quotas the fleet's claim covers, as the quota gate
    /// found (the tier and model it decided may differ from the claim's).
    pub claims: super::quota::Claims,
    /// Its prompt's prefix blocks ([`Arrival::prefix_blocks`]).
    pub prefix_blocks: &'g [u64],
    /// It could not meet its TTFT SLO even alone, but a replica of its
    /// route was idle: it is served late rather than refused
    /// ([`feasible`]).
    pub best_effort: bool,
}

/// A tier whose TTFT SLO a prompt of this many tokens meets on an idle
/// replica is a possible one: there a longer prompt that cannot meet it is
/// its own size's fault, and may be served late on an idle replica
/// ([`feasible`]). Below it (a 1 ms SLO) every request is refused.
const POSSIBLE_PROMPT_TOKENS: u64 = 1024;

/// At most this many queued requests are shed for one arrival (each is
/// shed once, so over a run shedding costs O(1) per arrival).
const SHED_PER_ARRIVAL: usize = 16;

/// Queued work is shed when its estimated first token would come later
/// than this part of the tier's TTFT SLO. (0.95 kept two more points of
/// admitted attainment under 3x overload, but shed the bursts of tenants
/// asking under their share: on generated mixes the least any of them got
/// of what it asked fell from 90% to 62%.)
const SHED_MARGIN: f64 = 1.0;

/// How many tenants' newest requests are checked, last in fair order first.
const TAILS_CHECKED: usize = 4;

type Gate = fn(&mut Scheduler, &mut Admitting<'_>) -> Result<(), Refusal>;

/// The gates, in order (see the module docs).
pub(super) const GATES: &[(&str, Gate)] = &[
    ("session budget", session_budget),
    ("policy admission", policy_admission),
    ("route", route),
    ("replicas", replicas),
    ("fits in KV memory", fits_kv),
    ("retry budget", retry_budget),
    ("quota", quota),
    ("feasible within SLO", feasible),
    ("wait within SLO", wait_within_slo),
];

/// Agentic sessions may take at most the tenant's `session_steps`.
fn session_budget(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    let (Some(session), Some(tn)) = (a.req.session.clone(), a.tenant) else {
        return Ok(());
    };
    let budget = a.graph.tenants[tn as usize].session_steps;
    let entry = s.sessions.entry(session).or_insert((a.tier, 0));
    entry.1 += 1;
    if budget.is_some_and(|b| entry.1 > b) {
        return Err(Refusal::new(Reason::SessionBudget, 429, None));
    }
    Ok(())
}

/// The policy's own `admit` refusals (a baseline has none: only "no such
/// model" stops it).
fn policy_admission(_: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    match a.admission {
        Admission::Reject(_) if a.baseline && a.target.is_some() => Ok(()),
        Admission::Reject(r) => {
            let reason = match r.reason {
                "quota" => Reason::Quota,
                "concurrency" => Reason::Concurrency,
                _ => Reason::Policy,
            };
            Err(Refusal::new(
                reason,
                r.status,
                r.retry_after.map(|ms| (ms * 1000.0) as Micros),
            ))
        }
        _ => Ok(()),
    }
}

/// A model the tier may not use, or that does not exist: 404.
fn route(_: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    if a.target.is_none() {
        return Err(Refusal::new(Reason::Policy, 404, None));
    }
    a.req.max_tokens = a.max_tokens;
    Ok(())
}

/// Some replica must serve the routed variant; none means the gang could
/// not be placed (multi-GPU variants) or the pool has no room for it.
fn replicas(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    let Some(target) = a.target else {
        return Err(Refusal::new(Reason::Policy, 404, None));
    };
    a.candidates = s
        .by_variant
        .get(&(target.model, target.variant))
        .map(|v| {
            v.iter()
                .copied()
                .filter(|&r| target.pool.is_none_or(|p| s.replicas[r].spec.pool == p))
                .collect()
        })
        .unwrap_or_default();
    if a.candidates.is_empty() {
        let gpus = a.graph.models[target.model as usize].variants[target.variant as usize]
            .gpus_per_replica;
        let reason = if gpus > 1 {
            Reason::Gang
        } else {
            Reason::Saturation
        };
        return Err(Refusal::new(reason, 503, Some(10 * SEC)));
    }
    Ok(())
}

/// A request larger than any replica's KV memory (its pool of whole
/// blocks) could never start: 413.
fn fits_kv(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    a.kv_need = a.req.prompt_tokens.saturating_add(u64::from(a.output));
    let kv_max = a
        .candidates
        .iter()
        .map(|&r| s.replicas[r].pool_tokens())
        .max()
        .unwrap_or(0);
    if a.kv_need > kv_max {
        return Err(Refusal::new(Reason::Saturation, 413, None));
    }
    Ok(())
}

/// A client's retries (`x-kiln-retry`, or the OpenAI SDKs' non-zero
/// `x-stainless-retry-count`: [`crate::graph::Retry`]) draw on the
/// tenant's retry budget.
fn retry_budget(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    let Some(t) = a.tenant else { return Ok(()) };
    let retry = a.req.retry() == Some(crate::graph::Retry::Client);
    if s.cfg.mode == Mode::Kiln && !s.quotas.note_request(a.graph, t, retry, s.now) {
        return Err(Refusal::new(Reason::RetryBudget, 429, Some(10 * SEC)));
    }
    Ok(())
}

/// Quota is reserved at admission, not charged after the fact: the
/// request must fit its tier's and model's quotas and its tenant's, and
/// takes from all of them or none (the tier's and model's are checked
/// first, then the tenant's is reserved, then theirs).
fn quota(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    let r = reserve_quotas(s, a);
    let refused = r.as_ref().err().map(|e| e.reason);
    s.note_limits(a.id, a.tenant, a.tier, a.target.map(|t| t.model), refused);
    r
}

/// The `quota` gate's work: reserve what the request needs of every quota
/// that applies, or refuse.
fn reserve_quotas(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    let need = f64::from(a.output) + a.req.prompt_tokens as f64;
    let scoped = a.target.filter(|_| s.cfg.mode == Mode::Kiln);
    // Claimed across the fleet for the tier and model it was decided
    // there: not charged here again. Another tier or model (a decision
    // that read different signals) is charged here.
    let claimed = match (a.fleet, scoped) {
        (Some(f), Some(target)) => super::scoped::Claimed {
            tier: f.tier.as_deref().is_some_and(|n| {
                a.graph
                    .tiers
                    .get(a.tier as usize)
                    .is_some_and(|t| t.name == n)
            }),
            model: f.model.as_deref().is_some_and(|n| {
                a.graph
                    .models
                    .get(target.model as usize)
                    .is_some_and(|m| m.name == n)
            }),
        },
        _ => super::scoped::Claimed::default(),
    };
    a.claims.scoped = claimed;
    if let Some(target) = scoped {
        if let Err((reason, retry)) =
            s.scoped
                .check_unclaimed(a.tier, target.model, need, s.now, claimed)
        {
            return Err(Refusal::new(reason, 429, Some(retry)));
        }
    }
    tenant_quota(s, a)?;
    let Some(target) = scoped else {
        return Ok(());
    };
    match s
        .scoped
        .reserve_unclaimed(a.tier, target.model, need, s.now, claimed)
    {
        Ok(q) => {
            a.scoped = Some(q);
            Ok(())
        }
        Err((reason, retry)) => {
            if let Some(t) = a.tenant {
                s.quotas.release(t, a.reserved, 0.0);
            }
            Err(Refusal::new(reason, 429, Some(retry)))
        }
    }
}

/// The tenant's quota.
fn tenant_quota(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    let need = f64::from(a.output) + a.req.prompt_tokens as f64;
    // Claimed across the fleet for the tenant it names: counted in flight
    // here, charged there (once).
    let named = a.req.tenant.as_deref().and_then(|n| a.graph.tenant_id(n));
    match a.tenant {
        Some(t) if a.quota_claimed && named == Some(t) => {
            s.quotas.track(t);
            a.claims.tenant = true;
            Ok(())
        }
        Some(t) if s.cfg.mode == Mode::Kiln => match s.quotas.reserve(a.graph, t, need, s.now) {
            Ok(borrowed) => {
                a.borrowed = borrowed;
                a.reserved = need;
                Ok(())
            }
            Err((reason, retry)) => Err(Refusal::new(reason, 429, Some(retry))),
        },
        Some(t) => {
            s.quotas.track(t);
            Ok(())
        }
        None => Ok(()),
    }
}

/// Gives back the quotas the `quota` gate reserved for a request that is
/// refused after it.
fn release_reserved(s: &mut Scheduler, a: &mut Admitting<'_>) {
    if let Some(t) = a.tenant {
        s.quotas.release(t, a.reserved, 0.0);
    }
    a.reserved = 0.0;
    if let Some(q) = a.scoped.take() {
        s.scoped.release(q, 0.0);
    }
}

/// A request that could not meet its tier's TTFT SLO even alone on the
/// fastest idle replica of its route is refused as `infeasible`: its own
/// prefill is the cause, not the load or another tenant, and it is never
/// counted as a fairness or overload refusal.
fn feasible(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    if s.cfg.mode != Mode::Kiln || a.graph.tiers[a.tier as usize].slo.ttft.is_none() {
        return Ok(());
    }
    let Some(limit) = s.wait_limit(a.tier, a.window) else {
        return Ok(());
    };
    // What a replica holds of its prefix in its cache it does not prefill
    // (long shared conversation prefixes are the common case).
    let idle = a
        .candidates
        .iter()
        .filter_map(|&r| s.replicas.get(r))
        .map(|r| {
            let cached = u64::from(r.cached_prefix_tokens(a.prefix_blocks));
            r.idle_first_token_time(a.req.prompt_tokens.saturating_sub(cached))
        })
        .min()
        .unwrap_or(0);
    if idle <= limit {
        return Ok(());
    }
    // Served late rather than refused when a replica of its route runs
    // nothing and the tier's SLO is a possible one: a conversation's long
    // first turn fills the prefix cache its next turns hit in time (on the
    // Mooncake trace refusing it refused the whole conversation). Its
    // prefill ranks below its tier's other work and it is never shed, so
    // it takes only capacity nothing else wants.
    let (mut idle_replica, mut possible) = (false, false);
    for x in a.candidates.iter().filter_map(|&r| s.replicas.get(r)) {
        if !x.up || x.draining || x.slot_cap == Some(0) {
            continue;
        }
        idle_replica |= x.running.is_empty();
        possible |= x.idle_first_token_time(POSSIBLE_PROMPT_TOKENS) <= limit;
    }
    if idle_replica && possible {
        a.best_effort = true;
        return Ok(());
    }
    release_reserved(s, a);
    Err(Refusal::new(Reason::Infeasible, 413, None))
}

/// An early, honest refusal instead of a timeout: the request's own wait,
/// from its place in the order fair share will serve it (its start tag:
/// the tiers ranked ahead, its tenant's queue, and what each other tenant
/// may take before its counter passes this one's), against the tier's TTFT
/// SLO (or the request's completion window: its own, else its tier's).
/// Work of tenants above their share that this request goes ahead of is
/// not its concern here: once it is queued, [`Scheduler::shed_over_share`]
/// sheds what can no longer be served in time, from the fair tail. Gives
/// back the quota the previous gate reserved when it refuses.
fn wait_within_slo(s: &mut Scheduler, a: &mut Admitting<'_>) -> Result<(), Refusal> {
    if s.cfg.mode != Mode::Kiln {
        return Ok(());
    }
    // Held work waits by the policy's choice, within its hold's bound;
    // best-effort work was admitted knowing it will be late.
    if matches!(a.admission, Admission::Hold { .. }) || a.best_effort {
        return Ok(());
    }
    // A soft deadline is not a reason to refuse: work that will finish
    // after its window runs late and counts a miss.
    let slo = &a.graph.tiers[a.tier as usize].slo;
    if slo.ttft.is_none() && slo.deadline == crate::graph::Deadline::Soft {
        return Ok(());
    }
    let Some(limit) = s.wait_limit(a.tier, a.window) else {
        return Ok(());
    };
    let Some(target) = a.target else {
        return Ok(());
    };
    let key = (target.model, target.variant);
    let reference = s.note_prompt_size(
        key,
        a.tier,
        a.req.prompt_tokens,
        a.prefix_blocks,
        &a.candidates,
    );
    let q = super::Estimating {
        key,
        tier: a.tier,
        tenant: a.tenant,
        prompt: a.req.prompt_tokens,
        output: a.output,
        window: a.window,
        own: None,
        prefix: a.prefix_blocks,
        reference,
    };
    // What its tenant asks, refused or not (who may preempt for fair
    // share, [`Scheduler::fair_preempts`]).
    s.asked_since.get_or_insert(s.now);
    s.asked.entry((key, a.tier, a.tenant)).or_default().add(
        s.now,
        s.cfg.vtc_input_weight * a.req.prompt_tokens as f64
            + s.cfg.vtc_output_weight * f64::from(a.output),
    );
    let e = s.estimate_for(&q, &a.candidates);
    a.est_start = Some((e.raw_start, e.first_in_order));
    a.contended = Some(e.contended);
    let est = if e.by_window { e.finish } else { e.first_token };
    let above_share = e.above_share;
    if est <= limit {
        return Ok(());
    }
    release_reserved(s, a);
    // Work whose limit is its completion window (its own or its tier's)
    // is refused because it would miss it; in a tier with a TTFT SLO and
    // no window, a request's own window does not set the limit, so its
    // refusal is the tier's usual one: `fairness` when its tenant is above
    // its weighted share (it is itself the fair tail), `overload` when
    // even served in fair order it could not start in time.
    let slo = &a.graph.tiers[a.tier as usize].slo;
    let by_window = slo.window.is_some() || slo.ttft.is_none();
    let reason = if a.deadline.is_some() && by_window {
        Reason::Deadline
    } else if above_share {
        Reason::Fairness
    } else {
        Reason::Overload
    };
    Err(Refusal::new(
        reason,
        429,
        Some(est.saturating_sub(limit).max(SEC)),
    ))
}

impl Scheduler {
    /// An arrival: the policy decides it, the gates admit or refuse it,
    /// and an admitted request is queued (or parked until its time).
    pub(super) fn arrive(&mut self, mut arrival: Arrival) {
        // The fleet's level of the tenant's buckets as its claim left them:
        // `quota.remaining` reads the fleet's value.
        if let (true, Some(level)) = (
            arrival.quota_claimed,
            arrival.fleet.as_ref().and_then(|f| f.tenant_level),
        ) {
            if let Some(t) = arrival
                .request
                .tenant
                .as_deref()
                .and_then(|n| self.graph.tenant_id(n))
            {
                self.quotas.mirror(t, &level, self.now);
            }
        }
        self.refresh_signals();
        let graph = self.graph.clone();
        // Moved out, not cloned (its headers and tags are allocations);
        // nothing below reads `arrival.request`.
        let req = std::mem::take(&mut arrival.request);
        // Agentic sessions keep the tier of their first step.
        let session_tier = req
            .session
            .as_ref()
            .and_then(|s| self.sessions.get(s))
            .map(|(t, _)| *t);
        // Only a policy (or its canary) that reads `estimated_wait` needs
        // it worked out: a decision and a wait estimate per arrival.
        let reads_wait = graph.reads_estimated_wait()
            || self
                .canary
                .as_ref()
                .is_some_and(|c| c.graph().reads_estimated_wait());
        let estimate = if reads_wait {
            self.estimate_wait(&req, arrival.window)
        } else {
            0
        };
        self.signals.estimated_wait = estimate as f64 / 1000.0;
        let baseline = self.cfg.mode != Mode::Kiln;
        let canary_graph = match &self.canary {
            Some(c) if !baseline && c.selects(arrival.id, &req) => Some(c.graph().clone()),
            _ => None,
        };
        let canary_d = match (&canary_graph, self.canary.as_mut()) {
            (Some(cg), Some(c)) => c.decide(cg, &req, &self.signals),
            _ => None,
        };
        self.last_canary = canary_d.is_some();
        let d = match canary_d {
            Some(d) => d,
            None => graph.decide(&req, if baseline { &self.idle } else { &self.signals }),
        };
        let tier = session_tier.unwrap_or(d.tier);
        if let (Admission::Hold { .. }, false) = (d.admission, baseline) {
            self.start_hold(tier, &req);
        }
        let window = self.request_window(tier, arrival.window);
        let deadline = window.map(|w| self.now.saturating_add(w));
        self.out.push(super::Action::Decided {
            id: arrival.id,
            tier,
            tenant: d.tenant,
            fallback_step: d.fallback_step,
            deadline,
        });
        let output = arrival
            .output_tokens
            .min(d.max_tokens.clamp(1, u64::from(u32::MAX)) as u32)
            .max(1);
        let mut a = Admitting {
            id: arrival.id,
            req,
            graph: &graph,
            tier,
            tenant: d.tenant,
            admission: d.admission,
            target: d.target,
            max_tokens: d.max_tokens,
            output,
            candidates: Vec::new(),
            kv_need: 0,
            reserved: 0.0,
            scoped: None,
            borrowed: false,
            baseline,
            est_start: None,
            contended: None,
            window,
            deadline,
            quota_claimed: arrival.quota_claimed,
            fleet: arrival.fleet.as_deref(),
            claims: Default::default(),
            prefix_blocks: &arrival.prefix_blocks,
            best_effort: false,
        };
        for (name, gate) in GATES {
            if let Err(r) = gate(self, &mut a) {
                self.out.push(super::Action::Reject {
                    id: a.id,
                    reason: r.reason,
                    status: r.status,
                    retry_after: r.retry_after,
                });
                return;
            }
            // Decided, allowed by the policy and routed: an answer in the
            // tier's exact cache needs no replica, memory or token quota.
            if *name == "route" && self.cache_lookup(&a, arrival.cache, arrival.semantic.as_ref()) {
                return;
            }
        }
        // Only tiers with a TTFT SLO shed (and only they pay for the copy).
        let ttft = a
            .graph
            .tiers
            .get(a.tier as usize)
            .is_some_and(|t| t.slo.ttft.is_some());
        let shed = (self.cfg.mode == Mode::Kiln && ttft)
            .then(|| {
                a.target
                    .map(|t| ((t.model, t.variant), a.candidates.clone()))
            })
            .flatten();
        let (id, tier, contended) = (a.id, a.tier, a.contended);
        self.enqueue(a);
        // Replicas with room take what is queued as slots free: no tenant
        // is over a share of a pool nobody else is waiting for.
        if let Some((key, candidates)) =
            shed.filter(|(_, c)| contended.unwrap_or_else(|| self.contended(c)))
        {
            self.shed_over_share(key, tier, id, &candidates);
        }
    }

    /// Keeps admission's word after a request went ahead of others in fair
    /// order: while the queued request fair share would serve last (the
    /// newest of the tenant furthest above its weighted share,
    /// [`super::queue::Queues::fair_tails`]) can no longer get its first
    /// token within the tier's TTFT SLO, it is shed (`fairness`, 429). So
    /// under overload what is shed comes from the tenants served above
    /// their share, and a tenant within its share is not refused while such
    /// work could be shed instead. Bounded per arrival; never the request
    /// just admitted (`protect`).
    fn shed_over_share(
        &mut self,
        key: (u16, u16),
        tier: TierId,
        protect: ReqId,
        candidates: &[usize],
    ) {
        if self
            .graph
            .tiers
            .get(tier as usize)
            .and_then(|t| t.slo.ttft)
            .is_none()
        {
            return;
        }
        let Some(limit) = self.wait_limit(tier, None) else {
            return;
        };
        let mut shed = 0;
        'scan: while shed < SHED_PER_ARRIVAL {
            let tails = self
                .queues
                .fair_tails(&self.graph, key, tier, TAILS_CHECKED);
            for (tenant, id, before_cost, before_tokens) in tails {
                if id == protect {
                    // It was just promised its place: nothing after it in
                    // fair order is shed for it, nothing before it is late
                    // because of it.
                    return;
                }
                if self.shed_if_late(
                    key,
                    tier,
                    tenant,
                    id,
                    (before_cost, before_tokens),
                    candidates,
                    limit,
                ) {
                    shed += 1;
                    continue 'scan;
                }
            }
            return;
        }
    }

    /// Sheds queued request `id` (`fairness`, 429) if it can no longer get
    /// its first token within the tier's TTFT `limit`; whether it did.
    #[allow(clippy::too_many_arguments)]
    fn shed_if_late(
        &mut self,
        key: (u16, u16),
        tier: TierId,
        tenant: Option<TenantId>,
        id: ReqId,
        before: (f64, f64),
        candidates: &[usize],
        limit: Micros,
    ) -> bool {
        let (before_cost, before_tokens) = before;
        {
            let Some(w) = self.queues.get(id) else {
                return false;
            };
            // Admitted knowing it would be late, it waits for no one; one
            // put back after a preemption already had its first token.
            if w.best_effort || w.started {
                return false;
            }
            let q = super::Estimating {
                key,
                tier,
                tenant,
                prompt: u64::from(w.prompt_tokens),
                output: w.output_tokens.saturating_sub(w.generated),
                window: None,
                own: Some((before_cost, before_tokens)),
                prefix: &w.prefix_blocks,
                reference: self.size_reference(key, tier),
            };
            let waited = self.now.saturating_sub(w.arrival);
            // Only reached on contended replicas, and nothing since (at
            // this instant) changes their load.
            let e = self.estimate_given(&q, candidates, true);
            let est = if e.by_window { e.finish } else { e.first_token };
            if est.saturating_add(waited) as f64 <= SHED_MARGIN * limit as f64 {
                return false;
            }
            let Some(w) = self.queues.remove(id) else {
                return false;
            };
            self.unpin(&w);
            // It was counted as admitted work; it no longer is.
            let cost = self.cfg.vtc_input_weight * f64::from(w.prompt_tokens)
                + self.cfg.vtc_output_weight * f64::from(w.output_tokens);
            if let Some((c, t)) = self.incoming.get_mut(&(key, tier, w.tenant)) {
                c.add(self.now, -cost);
                t.add(self.now, -(w.tokens() as f64));
            }
            if let Some(c) = self.admitted.get_mut(&(key, tier, w.tenant)) {
                c.add(self.now, -cost);
            }
            let retry = est.saturating_add(waited).saturating_sub(limit);
            self.reject(id, Reason::Fairness, 429, Some(retry.max(SEC)));
        }
        true
    }

    /// Holds an admitted request: parked until its `delay` time or while a
    /// batch forms, else queued, noting why it will wait if it does.
    fn enqueue(&mut self, a: Admitting<'_>) {
        let prefix_blocks = a.prefix_blocks.to_vec();
        let graph = a.graph;
        let Some(target) = a.target else { return };
        let tier = &graph.tiers[a.tier as usize];
        self.held.insert(
            a.id,
            super::Held {
                tenant: a.tenant,
                reserved_tokens: a.reserved,
                scoped: a.scoped,
            },
        );
        let max_wait = match a.admission {
            Admission::Queue { max_wait } if !a.baseline => {
                Some(self.now.saturating_add((max_wait * 1000.0) as Micros))
            }
            Admission::Hold { max_wait } if !a.baseline => {
                Some(self.now.saturating_add(self.hold_bound(max_wait, a.window)))
            }
            // No bound from the policy: the configured default, or its
            // completion window if that ends later.
            _ if !a.baseline => self.cfg.default_max_wait.map(|w| {
                let bound = self.now.saturating_add(w);
                a.deadline.map_or(bound, |d| d.max(bound))
            }),
            _ => None,
        };
        let prompt = a.req.prompt_tokens.min(u64::from(u32::MAX)) as u32;
        let (affinity, pin_until) =
            self.route(a.tier, &a.candidates, &prefix_blocks, prompt, a.kv_need);
        let mut w = Waiting {
            id: a.id,
            tier: a.tier,
            tenant: a.tenant,
            arrival: self.now,
            deadline: a.deadline,
            expires: max_wait,
            // kv_need <= a replica's KV capacity bounds this; clamp anyway.
            prompt_tokens: a.req.prompt_tokens.min(u64::from(u32::MAX)) as u32,
            output_tokens: a.output,
            generated: 0,
            model: target.model,
            variant: target.variant,
            pool: target.pool,
            affinity,
            pin_until,
            est_start: a.est_start,
            prefix_blocks,
            preemptions: 0,
            backfill: tier.backfill_only,
            borrowed: a.borrowed,
            waiting_for: None,
            gpu_seconds: 0.0,
            wasted_gpu_seconds: 0.0,
            redo_tokens: 0,
            claims: a.claims,
            started: false,
            orphan: false,
            preemptible_item: a.req.preemptible_item(),
            best_effort: a.best_effort,
        };
        let cost = self.cfg.vtc_input_weight * f64::from(w.prompt_tokens)
            + self.cfg.vtc_output_weight * f64::from(w.output_tokens);
        let rate = self.drain_rate((w.model, w.variant));
        self.queues.set_rate((w.model, w.variant), rate);
        let (c, t) = self
            .incoming
            .entry(((w.model, w.variant), w.tier, w.tenant))
            .or_default();
        c.add(self.now, cost);
        t.add(self.now, w.tokens() as f64);
        self.admitted
            .entry(((w.model, w.variant), w.tier, w.tenant))
            .or_default()
            .add(self.now, cost);
        if let (Admission::Delay { until }, false) = (a.admission, a.baseline) {
            w.waiting_for = Some(Reason::Delay);
            let at = self.time_at_minute(u32::from(until));
            self.timers.push(at, a.id);
            self.pin(&w);
            self.queues.park(w);
            return;
        }
        if let Some(hold) = tier.batch_max_wait {
            // Batch-eligible work may wait briefly for a batch to form; it
            // never does when a replica could start it with others already.
            if hold > 0.0 && self.cfg.mode == Mode::Kiln && self.all_idle(&a.candidates) {
                let at = self.now.saturating_add((hold * 1000.0) as Micros);
                self.timers.push(at, a.id);
                w.waiting_for = Some(Reason::Batching);
                self.pin(&w);
                self.queues.park(w);
                return;
            }
        }
        // Why it will wait, if it does: its tier held by the policy, no room
        // on any replica of its route, or (backfill) capacity reserved for
        // others.
        if self.queues.is_held(a.tier) {
            w.waiting_for = Some(Reason::Held);
        } else if w.backfill {
            w.waiting_for = Some(Reason::Backfill);
        } else if a.candidates.iter().all(|&r| {
            self.replicas[r].free_seq_slots() == 0
                || self.replicas[r].kv_free() < a.req.prompt_tokens
        }) {
            w.waiting_for = Some(Reason::Saturation);
        } else if self.queues.tokens_above(graph, a.tier) > 0 {
            w.waiting_for = Some(Reason::Priority);
        } else if self.queues.others_queued(a.tier, a.tenant) {
            w.waiting_for = Some(Reason::Fairness);
        }
        self.pin(&w);
        self.queues.push(w, &self.cfg);
    }
}
