//! The rollout runner: every tick it expires overrides, advances the
//! rollout in progress (shadow → canary → enforce → watch, or rollback
//! when a declared condition holds long enough) and starts the next
//! approved proposal. It acts on the gateway only through [`Gateway`], so
//! a refused activation leaves the last good policy serving and every
//! event lands in the audit log.

use super::activation::{Activation, ActivationError, Policy};
use super::gateway::Gateway;
use super::gov::{previous_of, Active, Gov, KEEP_CLOSED};
use super::lock;
use super::proposal::{Kind, State as PState};
use super::rollout::{Plan, Rollout, Stage, StagePlan, Step};
use super::shadow::Shadow;
use super::view::{ConditionView, RollbackView, ShadowCounts};
use crate::graph::trace::Tracer;
use crate::graph::Signals;
use crate::sched::canary::{map_signals, Canary, Scope};
use crate::sched::swap::Remap;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How often the runner advances rollouts and expires overrides.
pub const TICK: Duration = Duration::from_millis(100);

/// Records observed values of a condition's tests.
struct Observed(Vec<String>);

impl Tracer for Observed {
    fn enabled(&self) -> bool {
        true
    }
    fn test(&mut self, text: &str, observed: String, _result: bool) {
        self.0.push(format!("{text} (now {observed})"));
    }
}

/// The rollout's proposal and version, if one is in progress.
type Current = (String, Arc<Policy>);

impl Gov {
    /// `POST /admin/policy` with approvals off: the swap, audited, and the
    /// version it replaced kept for `kiln rollback`.
    pub async fn activate_direct(
        &self,
        gw: &impl Gateway,
        files: BTreeMap<String, String>,
        who: &str,
    ) -> Result<Activation, ActivationError> {
        self.in_step(gw, self.activate_direct_here(gw, files, who))
            .await
    }

    async fn activate_direct_here(
        &self,
        gw: &impl Gateway,
        files: BTreeMap<String, String>,
        who: &str,
    ) -> Result<Activation, ActivationError> {
        let _one = self.step.lock().await;
        let before = gw.active();
        let r = gw.activate(files).await;
        match &r {
            Ok(a) if a.changed => {
                self.remember_previous(&before);
                self.mark_stale(gw);
                self.audit_anyway(
                    "activation",
                    who,
                    json!({"version": a.version, "previous": before.version.as_ref(), "direct": true}),
                );
            }
            Ok(_) => {}
            Err(e) => self.audit_anyway(
                "activation_refused",
                who,
                json!({"status": e.status(), "error": e.to_string(), "direct": true}),
            ),
        }
        self.persist(gw);
        r
    }

    /// The runner's tick: expire overrides, advance the rollout, start
    /// the next approved proposal. With a shared store only the replica
    /// holding the runner's lease advances rollouts (their shadow and
    /// canary live in its executor, their stages on its clock), each tick
    /// one fleet-wide step; the others only expire their own overrides.
    pub async fn advance(&self, gw: &impl Gateway) {
        let Some(store) = self.shared.clone() else {
            self.advance_here(gw, true).await;
            return;
        };
        let lead = self.may_lead(&store).await;
        if !lead {
            self.stop_running_here(gw).await;
            // What other replicas did (overrides above all: an incident
            // control set on one replica holds on every one within a tick).
            self.refresh().await;
            if !self.any_override.load(Ordering::Relaxed) {
                return;
            }
        }
        let r: Result<(), super::shared::StepError> = self
            .in_step(gw, async {
                if lead {
                    self.reconcile(gw).await;
                }
                self.advance_here(gw, lead).await;
                Ok(())
            })
            .await;
        if let Err(e) = r {
            // Every tick retries; a lasting cause shows on admin actions
            // and in `kiln_shared_state_up`.
            tracing::debug!(error = %e, "governance tick skipped");
        }
    }

    /// A step's own tick, inside an admin action's step: the rollout
    /// parts only where this replica runs rollouts.
    pub(super) async fn advance_inner(&self, gw: &impl Gateway) {
        let lead = match self.shared.clone() {
            None => true,
            Some(store) => self.may_lead(&store).await,
        };
        if lead && self.shared.is_some() {
            self.reconcile(gw).await;
        }
        self.advance_here(gw, lead).await;
    }

    async fn advance_here(&self, gw: &impl Gateway, lead: bool) {
        let _one = self.step.lock().await;
        let now = self.now_ms();
        self.expire_overrides(now, lead);
        if lead {
            self.tick_rollout(gw, now).await;
        }
        self.tidy();
        if lead {
            self.start_next(gw, now).await;
        }
        self.persist(gw);
    }

    /// Ends overrides whose time is up. In a fleet every replica ends its
    /// copy at the same time; only the runner records it, once.
    fn expire_overrides(&self, now: f64, lead: bool) {
        let expired = lock(&self.overrides).expire(now);
        if lock(&self.overrides).is_empty() {
            self.any_override.store(false, Ordering::Relaxed);
        }
        if !lead {
            return;
        }
        for o in expired {
            self.audit_anyway(
                "override_expired",
                "kiln",
                json!({"id": o.id, "scope": o.scope.name(), "name": o.name, "action": o.action.name(), "refused": o.refused}),
            );
        }
    }

    /// Advances the rollout in progress by the clock and its conditions.
    async fn tick_rollout(&self, gw: &impl Gateway, now: f64) {
        let current = {
            let st = lock(&self.state);
            st.rollout.as_ref().map(|a| {
                let gate_of = a.machine.stage_plan().map(|s| s.name.clone());
                (
                    a.policy.clone(),
                    a.machine.stage,
                    a.machine.reads(),
                    gate_of,
                )
            })
        };
        let Some((policy, stage, reads, stage_name)) = current else {
            return;
        };
        let (results, gate_results) = if reads {
            self.evaluate(gw, &policy, stage, stage_name.as_deref(), now)
                .await
        } else {
            (Vec::new(), Vec::new())
        };
        let holds: Vec<bool> = results.iter().map(|(h, _)| *h).collect();
        let gates: Vec<bool> = gate_results.iter().map(|(h, _)| *h).collect();
        let step = {
            let mut st = lock(&self.state);
            match st.rollout.as_mut() {
                Some(a) => {
                    let step = a.machine.tick(now, &holds, &gates);
                    a.conditions = condition_views(a, &holds, &results, now);
                    a.gates = gate_views(a, &gates, &gate_results, now);
                    step
                }
                None => None,
            }
        };
        if let Some(step) = step {
            let observed = match &step {
                Step::Rollback { index, .. } => {
                    results.get(*index).map(|r| r.1.clone()).unwrap_or_default()
                }
                _ => Vec::new(),
            };
            self.perform(gw, step, now, observed).await;
        }
    }

    /// Finished rollouts make room for the next; old closed proposals go.
    fn tidy(&self) {
        let mut st = lock(&self.state);
        if st.rollout.as_ref().is_some_and(|a| a.machine.done()) {
            st.rollout = None;
        }
        self.recording.store(
            st.rollout.as_ref().is_some_and(|a| a.machine.reads()),
            Ordering::Relaxed,
        );
        let closed = st
            .proposals
            .iter()
            .filter(|p| !p.state.open() && p.state != PState::Rolling)
            .count();
        if closed > KEEP_CLOSED {
            let mut drop = closed - KEEP_CLOSED;
            st.proposals.retain(|p| {
                if drop > 0 && !p.state.open() && p.state != PState::Rolling {
                    drop -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Whether each rollback condition of the rollout's version, and each
    /// gate of canary stage `stage_name`, holds on the live metrics
    /// (canary traffic only during canary), with what its tests observed.
    /// A gate short of `min_samples` does not hold.
    async fn evaluate(
        &self,
        gw: &impl Gateway,
        policy: &Policy,
        stage: Stage,
        stage_name: Option<&str>,
        now: f64,
    ) -> (Vec<(bool, Vec<String>)>, Vec<(bool, Vec<String>)>) {
        let Some(r) = &policy.graph.rollout else {
            return (Vec::new(), Vec::new());
        };
        let g = &policy.graph;
        let mut base = Signals::idle(g);
        if let Some((active, signals)) = gw.signals().await {
            let map = Remap::new(g, &active);
            map_signals(&map, &signals, &mut base);
        }
        let canary = stage == Stage::Canary;
        let (s, short) = {
            let mut w = lock(&self.live);
            w.prune(now);
            let gates = stage_name
                .and_then(|n| r.stages.iter().find(|s| s.name == n))
                .map(|s| s.gates.as_slice())
                .unwrap_or_default();
            let short: Vec<Option<String>> = gates
                .iter()
                .map(|b| w.short_of(g, &b.cond, now, canary, self.min_samples))
                .collect();
            (w.signals(g, base, now, canary, self.min_samples), short)
        };
        let eval = |b: &crate::graph::Rollback| {
            let mut o = Observed(Vec::new());
            let holds = b.cond.eval_signals(&s, &mut o);
            (holds, o.0)
        };
        let rollbacks = r.rollbacks.iter().map(eval).collect();
        let gates = stage_name
            .and_then(|n| r.stages.iter().find(|s| s.name == n))
            .map(|st| {
                st.gates
                    .iter()
                    .zip(short)
                    .map(|(b, short)| {
                        let (holds, mut seen) = eval(b);
                        match short {
                            Some(why) => {
                                seen.push(why);
                                (false, seen)
                            }
                            None => (holds, seen),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        (rollbacks, gates)
    }

    fn current(&self) -> Option<Current> {
        lock(&self.state)
            .rollout
            .as_ref()
            .map(|a| (a.proposal.clone(), a.policy.clone()))
    }

    /// Performs one step of the rollout in progress.
    async fn perform(&self, gw: &impl Gateway, step: Step, now: f64, observed: Vec<String>) {
        let Some(current) = self.current() else {
            return;
        };
        match step {
            Step::Shadow => self.begin_shadow(gw, current),
            Step::Canary { index } => self.begin_canary(gw, current, index).await,
            Step::Enforce => self.enforce(gw, current, now).await,
            Step::Finish => self.finish_rollout(&current.0, now),
            Step::Rollback {
                text,
                stage,
                held_ms,
                ..
            } => {
                let trip = Trip {
                    text,
                    stage,
                    held_ms,
                    observed,
                };
                self.roll_back_automatically(gw, current, trip).await
            }
        }
    }

    fn begin_shadow(&self, gw: &impl Gateway, (id, policy): Current) {
        // Explain finds the sources of versions it remembers.
        gw.remember(policy.clone());
        let active = gw.active();
        self.shadow
            .store(Some(Arc::new(Shadow::new(&policy, &active))));
        self.audit_anyway(
            "rollout",
            "kiln",
            json!({"id": id, "version": policy.version.as_ref(), "stage": "shadow"}),
        );
    }

    /// Canary stage `index` begins: the version decides its traffic (in
    /// place of the previous stage's), its metrics start afresh.
    async fn begin_canary(&self, gw: &impl Gateway, (id, policy): Current, index: usize) {
        let shadow = self.end_shadow();
        gw.remember(policy.clone());
        let active = gw.active();
        let (plan, of) = {
            let st = lock(&self.state);
            let m = st.rollout.as_ref().map(|a| &a.machine);
            (
                m.and_then(|m| m.plan.stages.get(index)).cloned(),
                m.map_or(0, |m| m.plan.stages.len()),
            )
        };
        let Some(plan) = plan else {
            return;
        };
        let scope = scope_of(&policy.graph, &plan);
        let canary = Canary::staged(policy.graph.clone(), &active.graph, scope);
        set_canary(gw, Some((canary, policy.version.clone()))).await;
        gw.count_stage(policy.version.as_ref(), &plan.name);
        lock(&self.live).clear();
        self.recording.store(true, Ordering::Relaxed);
        {
            let mut st = lock(&self.state);
            if let Some(a) = st.rollout.as_mut() {
                if shadow.is_some() {
                    a.shadow = shadow.clone();
                }
                a.canary_from = self.canary_requests.load(Ordering::Relaxed);
                a.gates = Vec::new();
            }
        }
        let gates: Vec<&str> = plan.gates.iter().map(|g| g.text.as_str()).collect();
        self.audit_anyway(
            "rollout",
            "kiln",
            json!({"id": id, "version": policy.version.as_ref(), "stage": "canary",
                   "name": plan.name, "index": index + 1, "of": of,
                   "share": plan.share, "tenants": plan.pinned, "scope": {
                       "tenants": plan.tenants, "tiers": plan.tiers, "models": plan.models},
                   "duration_s": plan.duration_ms / 1000.0, "gates": gates,
                   "shadow": shadow}),
        );
    }

    /// Activates the rollout's version for everyone.
    async fn enforce(&self, gw: &impl Gateway, (id, policy): Current, now: f64) {
        let shadow = self.end_shadow();
        let before = gw.active();
        let r = gw.activate(policy.files()).await;
        set_canary(gw, None).await;
        lock(&self.live).clear();
        self.recording.store(true, Ordering::Relaxed);
        match r {
            Ok(a) => {
                if a.changed {
                    self.remember_previous(&before);
                }
                {
                    let mut st = lock(&self.state);
                    if let Some(a) = st.rollout.as_mut() {
                        if shadow.is_some() {
                            a.shadow = shadow.clone();
                        }
                    }
                    if let Some(p) = st.proposal_mut(&id) {
                        p.state = PState::Rolling;
                    }
                }
                self.mark_stale(gw);
                self.audit_anyway(
                    "activation",
                    "kiln",
                    json!({"id": id, "version": policy.version.as_ref(), "previous": before.version.as_ref(), "shadow": shadow}),
                );
                // A rollout without a watch is complete at once.
                let finish = {
                    let st = lock(&self.state);
                    st.rollout
                        .as_ref()
                        .is_some_and(|a| a.machine.plan.watch_ms <= 0.0)
                };
                if finish {
                    self.finish_rollout(&id, now);
                }
            }
            Err(e) => {
                {
                    let mut st = lock(&self.state);
                    if let Some(a) = st.rollout.as_mut() {
                        a.machine.end(now);
                    }
                    if let Some(p) = st.proposal_mut(&id) {
                        p.state = PState::Refused;
                        p.note = Some(format!(
                            "activation refused ({}): {e}; the last good policy keeps serving",
                            e.status(),
                        ));
                    }
                }
                self.audit_anyway(
                    "activation_refused",
                    "kiln",
                    json!({"id": id, "version": policy.version.as_ref(), "status": e.status(), "error": e.to_string()}),
                );
            }
        }
    }

    /// A rollback condition held: back to the version before (in watch),
    /// or end the shadow or canary (the active version never changed).
    async fn roll_back_automatically(&self, gw: &impl Gateway, (id, policy): Current, trip: Trip) {
        let Trip {
            text,
            stage,
            held_ms,
            observed,
        } = trip;
        let from = policy.version.to_string();
        let (to, ok) = match stage {
            Stage::Watch => match self.rollback_to_previous(gw).await {
                Ok(v) => (v, true),
                Err(e) => (e, false),
            },
            _ => {
                self.end_shadow();
                set_canary(gw, None).await;
                (gw.active().version.to_string(), true)
            }
        };
        gw.count_rollback("automatic");
        let view = RollbackView {
            at_unix_ms: crate::clock::unix_ms() as u64,
            from: from.clone(),
            to: to.clone(),
            trigger: "automatic".into(),
            condition: Some(text.clone()),
            observed: observed.clone(),
            by: "kiln".into(),
        };
        {
            let mut st = lock(&self.state);
            if let Some(p) = st.proposal_mut(&id) {
                p.state = PState::RolledBack;
                p.note = Some(format!(
                    "rolled back automatically in {}: {text}",
                    stage.name()
                ));
            }
            st.last_rollback = Some(view);
        }
        tracing::warn!(proposal = %id, condition = %text, stage = stage.name(), "rollback condition tripped: rolling back");
        self.audit_anyway(
            if ok { "rollback" } else { "rollback_failed" },
            "kiln",
            json!({"id": id, "trigger": "automatic", "stage": stage.name(), "condition": text,
                   "held_s": held_ms / 1000.0, "observed": observed, "from": from, "to": to}),
        );
    }

    fn finish_rollout(&self, id: &str, now: f64) {
        let mut st = lock(&self.state);
        if let Some(a) = st.rollout.as_mut() {
            a.machine.end(now);
        }
        if let Some(p) = st.proposal_mut(id) {
            p.state = PState::Enforced;
        }
        drop(st);
        self.audit_anyway("rollout", "kiln", json!({"id": id, "stage": "finished"}));
    }

    /// Activates the version before the active one; its version, or why
    /// not.
    pub(super) async fn rollback_to_previous(&self, gw: &impl Gateway) -> Result<String, String> {
        let Some(prev) = lock(&self.state).history.last().cloned() else {
            return Err("no previous version to return to".into());
        };
        match gw.activate(prev.files.clone()).await {
            Ok(_) => {
                lock(&self.state).history.pop();
                self.mark_stale(gw);
                Ok(prev.version.clone())
            }
            Err(e) => Err(format!(
                "the previous version {} could not be activated: {e}",
                prev.version,
            )),
        }
    }

    /// Starts the oldest approved proposal when no rollout runs (a
    /// rollback proposal also ends a watch).
    async fn start_next(&self, gw: &impl Gateway, now: f64) {
        let active = gw.active();
        let Some((id, kind, files)) = self.pick_next(&active) else {
            return;
        };
        match kind {
            Kind::Rollback => self.roll_back_approved(gw, &id, &active).await,
            Kind::Change => self.start_rollout(gw, id, &files, now).await,
        }
    }

    /// The next proposal to act on, settling the others' states on the way
    /// (stale when the active version moved, pending when approvals
    /// expired).
    fn pick_next(&self, active: &Policy) -> Option<(String, Kind, BTreeMap<String, String>)> {
        let now_s = crate::clock::unix_s();
        let mut st = lock(&self.state);
        let watching = st.rollout.as_ref().map(|a| a.machine.stage);
        let prev = st.history.last().map(|p| p.version.clone());
        let mut pick = None;
        for p in st.proposals.iter_mut() {
            if !p.state.open() {
                continue;
            }
            if p.base != active.version.as_ref() {
                p.state = PState::Stale;
                p.note = Some(format!(
                    "the active policy changed to {} after this was proposed: propose again",
                    active.version
                ));
                continue;
            }
            if !p.approved(now_s) {
                // Approvals may have expired meanwhile.
                p.state = PState::Pending;
                continue;
            }
            p.state = PState::Approved;
            let can = match p.kind {
                Kind::Change => watching.is_none(),
                Kind::Rollback => matches!(watching, None | Some(Stage::Watch)),
            };
            if can && pick.is_none() {
                if p.kind == Kind::Rollback && prev.as_deref() != Some(p.version.as_str()) {
                    p.state = PState::Stale;
                    p.note =
                        Some("the previous version changed: ask for the rollback again".into());
                    continue;
                }
                pick = Some((p.id.clone(), p.kind, p.files.clone()));
            }
        }
        pick
    }

    /// An approved rollback proposal: back to the previous version.
    async fn roll_back_approved(&self, gw: &impl Gateway, id: &str, active: &Policy) {
        let from = active.version.to_string();
        let r = self.rollback_to_previous(gw).await;
        let by = {
            let mut st = lock(&self.state);
            // A watch in progress ends: its version is rolled back.
            let watched = st.rollout.take().map(|a| a.proposal);
            for p in st.proposals.iter_mut() {
                if Some(&p.id) == watched.as_ref() && r.is_ok() {
                    p.state = PState::RolledBack;
                    p.note = Some(format!("rolled back by rollback proposal {id}"));
                }
            }
            let by = st
                .proposals
                .iter()
                .find(|p| p.id == id)
                .map(|p| p.proposer.clone())
                .unwrap_or_default();
            if let Some(p) = st.proposal_mut(id) {
                match &r {
                    Ok(_) => p.state = PState::Enforced,
                    Err(e) => {
                        p.state = PState::Refused;
                        p.note = Some(e.clone());
                    }
                }
            }
            if let Ok(to) = &r {
                st.last_rollback = Some(RollbackView {
                    at_unix_ms: crate::clock::unix_ms() as u64,
                    from: from.clone(),
                    to: to.clone(),
                    trigger: "manual".into(),
                    condition: None,
                    observed: Vec::new(),
                    by: by.clone(),
                });
            }
            by
        };
        match r {
            Ok(to) => {
                gw.count_rollback("manual");
                self.audit_anyway(
                    "rollback",
                    &by,
                    json!({"id": id, "trigger": "manual", "from": from, "to": to, "approved": true}),
                );
            }
            Err(e) => self.audit_anyway(
                "rollback_failed",
                &by,
                json!({"id": id, "trigger": "manual", "from": from, "error": e}),
            ),
        }
    }

    /// An approved change: compiled again for this gateway (its pools may
    /// have changed since), then its rollout's first step.
    async fn start_rollout(
        &self,
        gw: &impl Gateway,
        id: String,
        files: &BTreeMap<String, String>,
        now: f64,
    ) {
        let policy = match gw.compile(files) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                {
                    let mut st = lock(&self.state);
                    if let Some(p) = st.proposal_mut(&id) {
                        p.state = PState::Refused;
                        p.note = Some(format!("no longer fits this gateway ({}): {e}", e.status()));
                    }
                }
                self.audit_anyway(
                    "activation_refused",
                    "kiln",
                    json!({"id": id, "status": e.status(), "error": e.to_string()}),
                );
                return;
            }
        };
        let plan = Plan::of(&policy.graph, self.default_canary_ms, self.watch_ms);
        let (machine, step) = Rollout::start(plan.clone(), now);
        {
            let mut st = lock(&self.state);
            if let Some(p) = st.proposal_mut(&id) {
                p.state = PState::Rolling;
            }
            st.rollout = Some(Active {
                proposal: id.clone(),
                policy: policy.clone(),
                machine,
                conditions: Vec::new(),
                gates: Vec::new(),
                shadow: None,
                canary_from: self.canary_requests.load(Ordering::Relaxed),
            });
        }
        self.audit_anyway(
            "rollout",
            "kiln",
            json!({"id": id, "version": policy.version.as_ref(), "stage": "started", "plan": plan}),
        );
        self.perform(gw, step, now, Vec::new()).await;
    }

    // --- shared with the admin operations --------------------------------

    /// Keeps `before` as the version `kiln rollback` returns to.
    pub(super) fn remember_previous(&self, before: &Policy) {
        lock(&self.state).push_history(previous_of(before));
    }

    /// Open proposals whose base is no longer the active version are stale.
    pub(super) fn mark_stale(&self, gw: &impl Gateway) {
        let active = gw.active().version.to_string();
        let mut st = lock(&self.state);
        for p in st.proposals.iter_mut().filter(|p| p.state.open()) {
            if p.base != active {
                p.state = PState::Stale;
                p.note = Some(format!(
                    "the active policy changed to {active} after this was proposed: propose again"
                ));
            }
        }
    }

    pub(super) fn end_shadow(&self) -> Option<ShadowCounts> {
        self.shadow.swap(None).map(|s| s.counts())
    }
}

/// A rollback condition that tripped.
struct Trip {
    text: String,
    stage: Stage,
    held_ms: f64,
    observed: Vec<String>,
}

/// The status of each rollback condition after a tick.
fn condition_views(
    a: &Active,
    holds: &[bool],
    results: &[(bool, Vec<String>)],
    now: f64,
) -> Vec<ConditionView> {
    views(
        &a.machine.plan.rollbacks,
        &a.machine.holding,
        holds,
        results,
        now,
    )
}

/// The gates of the canary stage after a tick, as conditions.
fn gate_views(
    a: &Active,
    holds: &[bool],
    results: &[(bool, Vec<String>)],
    now: f64,
) -> Vec<ConditionView> {
    match a.machine.stage_plan() {
        Some(s) => views(&s.gates, &a.machine.gate_holding, holds, results, now),
        None => Vec::new(),
    }
}

/// Conditions as status shows them: each with whether it holds, since
/// when (`holding`, ms), and what it read.
fn views(
    conditions: &[super::rollout::Condition],
    holding: &[Option<f64>],
    holds: &[bool],
    results: &[(bool, Vec<String>)],
    now: f64,
) -> Vec<ConditionView> {
    conditions
        .iter()
        .enumerate()
        .map(|(i, c)| ConditionView {
            text: c.text.clone(),
            hold_s: c.hold_ms.map(|h| h / 1000.0),
            holds: holds.get(i).copied().unwrap_or(false),
            held_s: holding
                .get(i)
                .copied()
                .flatten()
                .map(|s| (now - s) / 1000.0),
            observed: results.get(i).map(|r| r.1.clone()).unwrap_or_default(),
        })
        .collect()
}

/// A stage's scope in the canary graph's ids.
pub(super) fn scope_of(g: &crate::graph::DecisionGraph, s: &StagePlan) -> Scope {
    Scope {
        pinned: s.pinned.iter().filter_map(|n| g.tenant_id(n)).collect(),
        tenants: s.tenants.iter().filter_map(|n| g.tenant_id(n)).collect(),
        tiers: s.tiers.iter().filter_map(|n| g.tier_id(n)).collect(),
        models: s.models.iter().filter_map(|n| g.model_id(n)).collect(),
        share: s.share,
    }
}

pub(super) async fn set_canary(gw: &impl Gateway, c: Option<(Canary, Arc<str>)>) {
    if !gw.set_canary(c).await {
        tracing::warn!("the executor is not running; the canary could not be changed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governance::gov::GovConfig;
    use crate::source::SourceMap;

    const POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] }
}
tier low { priority 1 slo { p95 600s } }
classify { default => tier low }
route [low] tiny { default => fp16 }
"#;

    /// A gateway whose scheduler is gone: every activation is refused.
    struct Down {
        active: Arc<Policy>,
    }

    impl Gateway for Down {
        fn active(&self) -> Arc<Policy> {
            self.active.clone()
        }
        fn compile(&self, _: &BTreeMap<String, String>) -> Result<Policy, ActivationError> {
            Err(ActivationError::NoGraph)
        }
        async fn activate(
            &self,
            _: BTreeMap<String, String>,
        ) -> Result<Activation, ActivationError> {
            Err(ActivationError::SchedulerDown)
        }
        async fn set_canary(&self, _: Option<(Canary, Arc<str>)>) -> bool {
            false
        }
        async fn signals(&self) -> Option<(Arc<crate::graph::DecisionGraph>, Signals)> {
            None
        }
        fn remember(&self, _: Arc<Policy>) {}
        async fn decision_log(&self) -> Option<std::path::PathBuf> {
            None
        }
        fn calibration(&self) -> Option<crate::backend::cost::Calibration> {
            None
        }
        fn count_rollback(&self, _: &str) {}
        fn count_approval(&self, _: &str) {}
        fn count_stage(&self, _: &str, _: &str) {}
    }

    fn gov() -> Gov {
        Gov::new(GovConfig {
            enabled: false,
            approvers: Vec::new(),
            audit: None,
            state: None,
            speed: 1.0,
            window_ms: 60_000.0,
            min_samples: 1,
            approval_ttl_s: 3600,
            watch_ms: 0.0,
            default_canary_ms: 0.0,
            dry_run_records: 10,
            max_override_ms: 86_400_000.0,
            withdraw_groups: Vec::new(),
            shared: None,
        })
        .unwrap()
    }

    fn active() -> Arc<Policy> {
        let mut s = SourceMap::new();
        s.add("p.kiln", POLICY);
        let c = crate::compile::compile(s);
        let crate::compile::Compiled { sources, graph, .. } = c;
        Arc::new(Policy::new(graph.unwrap(), sources))
    }

    #[tokio::test]
    async fn a_refused_direct_activation_is_audited_with_its_status() {
        let (g, gw) = (gov(), Down { active: active() });
        let r = g.activate_direct(&gw, BTreeMap::new(), "alice").await;
        assert!(matches!(r, Err(ActivationError::SchedulerDown)));
        let log = g.audit_recent(10);
        assert_eq!(log["entries"], 1);
        assert_eq!(log["recent"][0]["kind"], "activation_refused");
        assert_eq!(log["recent"][0]["details"]["status"], 503);
        assert_eq!(
            log["recent"][0]["details"]["error"],
            "the scheduler is not running"
        );
    }

    #[tokio::test]
    async fn a_proposal_that_does_not_compile_changes_nothing() {
        let (g, gw) = (gov(), Down { active: active() });
        let e = g.propose(&gw, "alice", BTreeMap::new()).await.unwrap_err();
        assert_eq!(e.status(), 422);
        assert!(g.proposal_views().is_empty());
        assert_eq!(g.audit_head().entries, 0);
        // Nor is there anything to roll back to.
        let e = g.rollback(&gw, "alice", None).await.err().unwrap();
        assert_eq!((e.status(), e.code()), (409, Some("no_previous")));
    }
}
