//! The gateway's governance: proposals, signed approvals, staged rollouts
//! with automatic rollback, incident overrides and the audit log, wired to
//! the admin API, the request path and a driver task.
//!
//! The pure parts live in [`crate::governance`]; this module holds the
//! state, answers the admin API and acts: it swaps policies through
//! [`super::admin::activate`] (so a refused activation leaves the last good
//! policy serving), starts and ends canaries in the executor, compares
//! shadow decisions on the request path, and writes every event to the
//! audit log.
//!
//! Endpoints (all need an admin token; with approvers configured, a named
//! one):
//!
//! | | |
//! | --- | --- |
//! | `POST /admin/proposals` | propose a policy (body as `POST /admin/policy`) |
//! | `GET /admin/proposals`, `GET /admin/proposals/{id}` | list, show |
//! | `PUT /admin/proposals/{id}` | replace its text (voids its approvals) |
//! | `DELETE /admin/proposals/{id}` | withdraw it |
//! | `POST /admin/proposals/{id}/approvals` | a signed approval |
//! | `GET /admin/status` | active version, rollout, open proposals, overrides |
//! | `POST /admin/rollback` | abort the rollout, or return to the previous version |
//! | `POST /admin/overrides`, `DELETE /admin/overrides/{scope}/{name}` | pause or throttle a tier or tenant, lift it |
//! | `GET /admin/audit` | the audit log's head and recent entries |

use super::admin::{self, identify};
use super::openai::ApiError;
use super::{App, Policy};
use crate::governance::activation::{Activation, ActivationError};
use crate::governance::approval::{self, Approver, Changes, Subject};
use crate::governance::audit::{AuditError, AuditLog};
use crate::governance::keys::SignedApproval;
use crate::governance::live::{Sample, Window};
use crate::governance::overrides::{Action as OverrideAction, Overrides, Refused, Scope};
use crate::governance::proposal::{Kind, Proposal, State as PState};
use crate::governance::rollout::{Plan, Rollout, Stage, Step};
use crate::governance::shadow::Shadow;
use crate::governance::state::{self as stored, Previous, Snapshot, StateError, StoredProposal};
use crate::governance::view::{
    AuditHead, ConditionView, DryRunView, ImpactLine, OverrideView, ProposalView, RollbackView,
    RolloutView, ShadowCounts, StatusView, TransitionLine,
};
use crate::graph::trace::Tracer;
use crate::graph::{DecisionGraph, Signals};
use crate::sched::canary::{map_signals, Canary};
use crate::sched::swap::Remap;
use arc_swap::ArcSwapOption;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often the driver advances rollouts and expires overrides.
pub const TICK: Duration = Duration::from_millis(100);
/// Previous versions kept for `kiln rollback`.
const HISTORY: usize = 16;
/// Finished proposals kept for `GET /admin/proposals`.
const KEEP_CLOSED: usize = 200;

/// The rollout in progress.
struct Active {
    proposal: String,
    policy: Arc<Policy>,
    machine: Rollout,
    conditions: Vec<ConditionView>,
    /// What shadowing found, once it ended.
    shadow: Option<ShadowCounts>,
    canary_from: u64,
}

#[derive(Default)]
struct GovState {
    proposals: Vec<Proposal>,
    next: u64,
    rollout: Option<Active>,
    /// Versions that were active before, most recent last.
    history: Vec<Previous>,
    /// Signatures of accepted approvals: never accepted twice.
    used: HashSet<String>,
    last_rollback: Option<RollbackView>,
}

impl GovState {
    fn proposal_mut(&mut self, id: &str) -> Option<&mut Proposal> {
        self.proposals.iter_mut().find(|p| p.id == id)
    }

    /// The proposal `id` if it may still change (`what` says how, for the
    /// refusal): 404 when unknown, 409 when closed.
    fn open_proposal(&mut self, id: &str, what: &str) -> Result<&mut Proposal, Box<Response>> {
        let Some(p) = self.proposal_mut(id) else {
            return Err(Box::new(api(
                404,
                format!("no proposal `{id}`"),
                "not_found",
            )));
        };
        if !p.state.open() {
            return Err(Box::new(api(
                409,
                format!("{id} is {}, {what}", p.state.name()),
                "not_pending",
            )));
        }
        Ok(p)
    }
}

pub struct Gov {
    /// Approvals required (`POST /admin/policy` refused).
    pub enabled: bool,
    approvers: Vec<Approver>,
    audit: Mutex<AuditLog>,
    state: Mutex<GovState>,
    /// One governance step at a time (driver ticks and admin actions).
    step: tokio::sync::Mutex<()>,
    shadow: ArcSwapOption<Shadow>,
    live: Mutex<Window>,
    overrides: Mutex<Overrides>,
    any_override: AtomicBool,
    /// Rollback conditions are armed: finished requests are recorded.
    recording: AtomicBool,
    canary_requests: AtomicU64,
    clock: Instant,
    speed: f64,
    min_samples: u64,
    approval_ttl_s: u64,
    watch_ms: f64,
    default_canary_ms: f64,
    dry_run_records: usize,
    /// The state file (`[governance] state`), if any.
    state_path: Option<PathBuf>,
    /// The bytes last written there (unchanged state is not rewritten).
    written: Mutex<Option<Vec<u8>>>,
    /// The active version the state file recorded, until the driver starts.
    restored_active: Mutex<Option<Previous>>,
}

/// Why the governance state could not be set up at startup.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum GovError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Audit(#[from] AuditError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    State(#[from] StateError),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn api(status: u16, msg: impl Into<String>, code: &str) -> Response {
    ApiError::new(status, msg).code(code).into_response()
}

/// The governance state a state file holds, checked: proposals whose text
/// does not hash to their recorded hash, and approvals that no longer
/// verify under the configured approvers, are dropped (logged and audited).
fn restore(
    path: &std::path::Path,
    snap: &Snapshot,
    approvers: &[Approver],
    audit: &mut AuditLog,
) -> Result<(GovState, Option<Previous>), AuditError> {
    let (proposals, dropped) = snap.verify(approvers);
    let at = crate::clock::unix_ms() as u64;
    for d in &dropped {
        let (kind, details) = match d {
            stored::Dropped::Proposal { id, stored, actual } => {
                tracing::warn!(proposal = %id, state = %path.display(), "the stored proposal's text does not match its hash: dropped");
                (
                    "proposal_dropped",
                    json!({"id": id, "reason": "hash_mismatch", "stored_hash": stored, "hash": actual}),
                )
            }
            stored::Dropped::Unreadable { id, why } => {
                tracing::warn!(proposal = %id, state = %path.display(), "the stored proposal cannot be read ({why}): dropped");
                (
                    "proposal_dropped",
                    json!({"id": id, "reason": "unreadable", "error": why}),
                )
            }
            stored::Dropped::Approval { id, approver } => {
                tracing::warn!(proposal = %id, approver = %approver, "a stored approval no longer verifies under the configured approvers: dropped");
                (
                    "approval_dropped",
                    json!({"id": id, "approver": approver, "reason": "signature_no_longer_verifies"}),
                )
            }
        };
        audit.append(at, kind, "kiln", details)?;
    }
    // Ids are never reused, even those of dropped proposals.
    let highest = snap
        .proposals
        .iter()
        .filter_map(|p| p.id().strip_prefix("p-")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    let mut used: HashSet<String> = snap.used.iter().cloned().collect();
    for p in &proposals {
        used.extend(p.approvals.iter().map(|a| a.signature.clone()));
    }
    let mut history = snap.history.clone();
    if history.len() > HISTORY {
        history.drain(..history.len() - HISTORY);
    }
    let st = GovState {
        proposals,
        next: snap.next.max(highest.saturating_add(1)),
        rollout: None,
        history,
        used,
        last_rollback: snap.last_rollback.clone(),
    };
    tracing::info!(
        state = %path.display(),
        proposals = st.proposals.len(),
        history = st.history.len(),
        "governance state restored"
    );
    Ok((st, snap.active.clone()))
}

/// Writes the governance state file (when one is configured and the state
/// changed since the last write). A write error is logged: the gateway
/// keeps governing from memory.
fn persist(app: &App) {
    let Some(path) = &app.gov.state_path else {
        return;
    };
    // Held across snapshot and write: writes land in the order of states.
    let mut written = lock(&app.gov.written);
    let active = app.policy.load_full();
    let snap = {
        let st = lock(&app.gov.state);
        let mut used: Vec<String> = st.used.iter().cloned().collect();
        used.sort();
        Snapshot {
            format: stored::FORMAT,
            next: st.next,
            proposals: st
                .proposals
                .iter()
                .filter(|p| stored::kept(p))
                .map(StoredProposal::of)
                .collect(),
            history: st.history.clone(),
            active: Some(previous_of(&active)),
            used,
            last_rollback: st.last_rollback.clone(),
        }
    };
    let bytes = snap.to_bytes();
    if written.as_deref() == Some(&bytes[..]) {
        return;
    }
    match stored::write_atomic(path, &bytes) {
        Ok(()) => *written = Some(bytes),
        Err(e) => tracing::error!(error = %e, "cannot write the governance state file"),
    }
}

fn previous_of(p: &Policy) -> Previous {
    Previous {
        version: p.version.to_string(),
        files: files_of(p),
    }
}

/// Once, before the driver's first step: the version active before the
/// restart (when `--policy` differs from it) becomes the one `kiln
/// rollback` returns to, and the active version is not its own previous.
fn settle_restored(app: &App) {
    let Some(before) = lock(&app.gov.restored_active).take() else {
        return;
    };
    let active = app.policy.load().version.to_string();
    {
        let mut st = lock(&app.gov.state);
        if before.version != active && st.history.last() != Some(&before) {
            tracing::info!(previous = %before.version, active = %active, "the gateway restarted on another version: the one it ran before is kept for rollback");
            st.history.push(before);
            if st.history.len() > HISTORY {
                st.history.remove(0);
            }
        }
        while st.history.last().is_some_and(|p| p.version == active) {
            st.history.pop();
        }
    }
    persist(app);
}

impl Gov {
    pub fn new(cfg: &super::config::ServerConfig, speed: f64) -> Result<Gov, GovError> {
        let approvers: Vec<Approver> = cfg
            .approvers
            .iter()
            .filter_map(|a| {
                crate::governance::keys::parse_public(&a.public_key)
                    .ok()
                    .map(|key| Approver {
                        name: a.name.clone(),
                        groups: a.groups.clone(),
                        key,
                    })
            })
            .collect();
        let mut audit = match &cfg.audit {
            Some(a) => AuditLog::open(&a.path)?,
            None => AuditLog::memory(),
        };
        let g = &cfg.governance;
        let state_path = g
            .state
            .clone()
            .or_else(|| cfg.audit.as_ref().map(|a| stored::default_path(&a.path)));
        let (state, restored_active) = match &state_path {
            Some(path) => match Snapshot::load(path)? {
                Some(snap) => restore(path, &snap, &approvers, &mut audit)?,
                None => (GovState::default(), None),
            },
            None => (GovState::default(), None),
        };
        Ok(Gov {
            enabled: cfg.governance_enabled(),
            approvers,
            audit: Mutex::new(audit),
            state: Mutex::new(GovState {
                next: state.next.max(1),
                ..state
            }),
            step: tokio::sync::Mutex::new(()),
            shadow: ArcSwapOption::empty(),
            live: Mutex::new(Window::new(g.window_ms(), 100_000)),
            overrides: Mutex::new(Overrides::default()),
            any_override: AtomicBool::new(false),
            recording: AtomicBool::new(false),
            canary_requests: AtomicU64::new(0),
            clock: Instant::now(),
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
            min_samples: g.min_samples,
            approval_ttl_s: g.approval_ttl_s(),
            watch_ms: g.watch_ms(),
            default_canary_ms: g.default_canary_ms(),
            dry_run_records: g.dry_run_records,
            state_path,
            written: Mutex::new(None),
            restored_active: Mutex::new(restored_active),
        })
    }

    /// The gateway's clock in ms: wall time since start, times the
    /// simulator's speed (rollout stages, holds, windows and overrides run
    /// on it, like the policy's own durations).
    pub fn now_ms(&self) -> f64 {
        self.clock.elapsed().as_secs_f64() * 1000.0 * self.speed
    }

    /// Appends to the audit log; an error is logged and returned.
    fn audit(&self, kind: &str, actor: &str, details: Value) -> Result<(), AuditError> {
        let r = lock(&self.audit).append(crate::clock::unix_ms() as u64, kind, actor, details);
        match r {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::error!(error = %e, kind, "cannot write the audit log");
                Err(e)
            }
        }
    }

    /// Audits an event the gateway performs whatever happens (automatic
    /// rollbacks, expiries): a write error is only logged.
    fn audit_anyway(&self, kind: &str, actor: &str, details: Value) {
        let _ = self.audit(kind, actor, details);
    }

    pub fn audit_head(&self) -> AuditHead {
        let a = lock(&self.audit);
        AuditHead {
            path: a.path().map(|p| p.display().to_string()),
            entries: a.entries(),
            head: a.head().to_string(),
        }
    }

    // --- request path ------------------------------------------------

    /// An override refusing this tier or tenant, if any (the request is
    /// counted against it).
    pub fn check_override(&self, scope: Scope, name: Option<&str>) -> Option<Refused> {
        if !self.any_override.load(Ordering::Relaxed) {
            return None;
        }
        let now = self.now_ms();
        lock(&self.overrides).check(now, scope, name)
    }

    pub fn override_views(&self) -> Vec<OverrideView> {
        let now = self.now_ms();
        lock(&self.overrides)
            .active(now)
            .into_iter()
            .map(|o| OverrideView {
                id: o.id,
                scope: o.scope.name().into(),
                name: o.name.clone(),
                action: o.action.name().into(),
                percent: match o.action {
                    OverrideAction::Throttle { percent } => Some(percent),
                    OverrideAction::Pause => None,
                },
                remaining_s: ((o.until_ms - now) / 1000.0).max(0.0),
                by: o.by.clone(),
                reason: o.reason.clone(),
                refused: o.refused,
            })
            .collect()
    }

    pub fn shadow(&self) -> Option<Arc<Shadow>> {
        self.shadow.load_full()
    }

    /// A request the canary decided.
    pub fn count_canary(&self) {
        self.canary_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// One finished request, for rollback conditions.
    pub fn record(&self, s: Sample) {
        if !self.recording.load(Ordering::Relaxed) {
            return;
        }
        let mut w = lock(&self.live);
        w.prune(s.at_ms);
        w.push(s);
    }

    /// Latencies in the policy's time (ms), from wall seconds.
    pub fn policy_ms(&self, wall_s: f64) -> f64 {
        wall_s * 1000.0 * self.speed
    }
}

// --- activation ------------------------------------------------------

fn remember_previous(app: &App, before: Arc<Policy>) {
    let prev = previous_of(&before);
    let mut st = lock(&app.gov.state);
    st.history.push(prev);
    if st.history.len() > HISTORY {
        st.history.remove(0);
    }
}

/// `POST /admin/policy` with approvals off: the swap, audited, and the
/// version it replaced kept for `kiln rollback`.
pub async fn activate_direct(
    app: &Arc<App>,
    files: BTreeMap<String, String>,
    who: &str,
) -> Result<Activation, ActivationError> {
    let _one = app.gov.step.lock().await;
    let before = app.policy.load_full();
    let r = admin::activate(app, files).await;
    match &r {
        Ok(a) if a.changed => {
            remember_previous(app, before.clone());
            mark_stale(app);
            app.gov.audit_anyway(
                "activation",
                who,
                json!({"version": a.version, "previous": before.version.as_ref(), "direct": true}),
            );
        }
        Ok(_) => {}
        Err(e) => app.gov.audit_anyway(
            "activation_refused",
            who,
            json!({"status": e.status(), "error": e.to_string(), "direct": true}),
        ),
    }
    persist(app);
    r
}

/// Open proposals whose base is no longer the active version are stale.
fn mark_stale(app: &App) {
    let active = app.policy.load().version.to_string();
    let mut st = lock(&app.gov.state);
    for p in st.proposals.iter_mut().filter(|p| p.state.open()) {
        if p.base != active {
            p.state = PState::Stale;
            p.note = Some(format!(
                "the active policy changed to {active} after this was proposed: propose again"
            ));
        }
    }
}

async fn set_canary(app: &App, c: Option<(Canary, Arc<str>)>) {
    if !app.exec.set_canary(c).await {
        tracing::warn!("the executor is not running; the canary could not be changed");
    }
}

fn end_shadow(app: &App) -> Option<ShadowCounts> {
    app.gov.shadow.swap(None).map(|s| s.counts())
}

// --- the driver ------------------------------------------------------

/// Starts the driver: every [`TICK`], expire overrides, advance the
/// rollout, and start the next approved proposal.
pub fn spawn_driver(app: Arc<App>) -> tokio::task::JoinHandle<()> {
    settle_restored(&app);
    tokio::spawn(async move {
        let mut t = tokio::time::interval(TICK);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            t.tick().await;
            advance(&app).await;
        }
    })
}

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

/// Whether each rollback condition of the rollout's version holds on the
/// live metrics (canary traffic only during canary).
async fn evaluate(app: &App, policy: &Policy, stage: Stage, now: f64) -> Vec<(bool, Vec<String>)> {
    let Some(r) = &policy.graph.rollout else {
        return Vec::new();
    };
    let g = &policy.graph;
    let mut base = Signals::idle(g);
    if let Some((active, signals)) = app.exec.signals().await {
        let map = Remap::new(g, &active);
        map_signals(&map, &signals, &mut base);
    }
    let s = {
        let mut w = lock(&app.gov.live);
        w.prune(now);
        w.signals(g, base, now, stage == Stage::Canary, app.gov.min_samples)
    };
    r.rollbacks
        .iter()
        .map(|b| {
            let mut o = Observed(Vec::new());
            let holds = b.cond.eval_signals(&s, &mut o);
            (holds, o.0)
        })
        .collect()
}

/// One governance step: expire overrides, advance the rollout, start the
/// next approved proposal.
pub async fn advance(app: &Arc<App>) {
    let _one = app.gov.step.lock().await;
    let gov = &app.gov;
    let now = gov.now_ms();
    let expired = lock(&gov.overrides).expire(now);
    if lock(&gov.overrides).is_empty() {
        gov.any_override.store(false, Ordering::Relaxed);
    }
    for o in expired {
        gov.audit_anyway(
            "override_expired",
            "kiln",
            json!({"id": o.id, "scope": o.scope.name(), "name": o.name, "action": o.action.name(), "refused": o.refused}),
        );
    }
    // The rollout in progress.
    let current = {
        let st = lock(&gov.state);
        st.rollout
            .as_ref()
            .map(|a| (a.policy.clone(), a.machine.stage, a.machine.armed()))
    };
    if let Some((policy, stage, armed)) = current {
        let results = if armed {
            evaluate(app, &policy, stage, now).await
        } else {
            Vec::new()
        };
        let holds: Vec<bool> = results.iter().map(|(h, _)| *h).collect();
        let step = {
            let mut st = lock(&gov.state);
            match st.rollout.as_mut() {
                Some(a) => {
                    let step = a.machine.tick(now, &holds);
                    a.conditions = a
                        .machine
                        .plan
                        .rollbacks
                        .iter()
                        .enumerate()
                        .map(|(i, c)| ConditionView {
                            text: c.text.clone(),
                            hold_s: c.hold_ms.map(|h| h / 1000.0),
                            holds: holds.get(i).copied().unwrap_or(false),
                            held_s: a
                                .machine
                                .holding
                                .get(i)
                                .copied()
                                .flatten()
                                .map(|s| (now - s) / 1000.0),
                            observed: results.get(i).map(|r| r.1.clone()).unwrap_or_default(),
                        })
                        .collect();
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
            perform(app, step, now, observed).await;
        }
    }
    // Finished rollouts make room for the next.
    {
        let mut st = lock(&gov.state);
        if st.rollout.as_ref().is_some_and(|a| a.machine.done()) {
            st.rollout = None;
        }
        gov.recording.store(
            st.rollout.as_ref().is_some_and(|a| a.machine.armed()),
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
    start_next(app, now).await;
    persist(app);
}

/// Performs one step of the rollout in progress.
async fn perform(app: &Arc<App>, step: Step, now: f64, observed: Vec<String>) {
    let gov = &app.gov;
    let Some((id, policy)) = lock(&gov.state)
        .rollout
        .as_ref()
        .map(|a| (a.proposal.clone(), a.policy.clone()))
    else {
        return;
    };
    match step {
        Step::Shadow => {
            // Explain finds the sources of versions it remembers.
            app.remember(policy.clone());
            let active = app.policy.load_full();
            gov.shadow
                .store(Some(Arc::new(Shadow::new(&policy, &active))));
            gov.audit_anyway(
                "rollout",
                "kiln",
                json!({"id": id, "version": policy.version.as_ref(), "stage": "shadow"}),
            );
        }
        Step::Canary => {
            let shadow = end_shadow(app);
            app.remember(policy.clone());
            let active = app.policy.load_full();
            let plan = policy
                .graph
                .rollout
                .as_ref()
                .map(|r| (r.canary_tenants.clone(), r.canary_share.unwrap_or(0.0)))
                .unwrap_or_default();
            let canary = Canary::new(policy.graph.clone(), &active.graph, plan.0, plan.1);
            let tenants = canary.tenant_names();
            set_canary(app, Some((canary, policy.version.clone()))).await;
            lock(&gov.live).clear();
            gov.recording.store(true, Ordering::Relaxed);
            {
                let mut st = lock(&gov.state);
                if let Some(a) = st.rollout.as_mut() {
                    if shadow.is_some() {
                        a.shadow = shadow.clone();
                    }
                    a.canary_from = gov.canary_requests.load(Ordering::Relaxed);
                }
            }
            gov.audit_anyway(
                "rollout",
                "kiln",
                json!({"id": id, "version": policy.version.as_ref(), "stage": "canary",
                       "share": plan.1, "tenants": tenants, "shadow": shadow}),
            );
        }
        Step::Enforce => {
            let shadow = end_shadow(app);
            let files = files_of(&policy);
            let before = app.policy.load_full();
            let r = admin::activate(app, files).await;
            set_canary(app, None).await;
            lock(&gov.live).clear();
            gov.recording.store(true, Ordering::Relaxed);
            match r {
                Ok(a) => {
                    if a.changed {
                        remember_previous(app, before.clone());
                    }
                    {
                        let mut st = lock(&gov.state);
                        if let Some(a) = st.rollout.as_mut() {
                            if shadow.is_some() {
                                a.shadow = shadow.clone();
                            }
                        }
                        if let Some(p) = st.proposal_mut(&id) {
                            p.state = PState::Rolling;
                        }
                    }
                    mark_stale(app);
                    gov.audit_anyway(
                        "activation",
                        "kiln",
                        json!({"id": id, "version": policy.version.as_ref(), "previous": before.version.as_ref(), "shadow": shadow}),
                    );
                    // A rollout without a watch is complete at once.
                    let finish = {
                        let st = lock(&gov.state);
                        st.rollout
                            .as_ref()
                            .is_some_and(|a| a.machine.plan.watch_ms <= 0.0)
                    };
                    if finish {
                        finish_rollout(app, &id, now);
                    }
                }
                Err(e) => {
                    {
                        let mut st = lock(&gov.state);
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
                    gov.audit_anyway(
                        "activation_refused",
                        "kiln",
                        json!({"id": id, "version": policy.version.as_ref(), "status": e.status(), "error": e.to_string()}),
                    );
                }
            }
        }
        Step::Finish => finish_rollout(app, &id, now),
        Step::Rollback {
            text,
            stage,
            held_ms,
            ..
        } => {
            let from = policy.version.to_string();
            let (to, ok) = match stage {
                Stage::Watch => match rollback_to_previous(app).await {
                    Ok(v) => (v, true),
                    Err(e) => (e, false),
                },
                _ => {
                    end_shadow(app);
                    set_canary(app, None).await;
                    (app.policy.load().version.to_string(), true)
                }
            };
            app.metrics.rollback("automatic");
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
                let mut st = lock(&gov.state);
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
            gov.audit_anyway(
                if ok { "rollback" } else { "rollback_failed" },
                "kiln",
                json!({"id": id, "trigger": "automatic", "stage": stage.name(), "condition": text,
                       "held_s": held_ms / 1000.0, "observed": observed, "from": from, "to": to}),
            );
        }
    }
}

fn finish_rollout(app: &App, id: &str, now: f64) {
    let mut st = lock(&app.gov.state);
    if let Some(a) = st.rollout.as_mut() {
        a.machine.end(now);
    }
    if let Some(p) = st.proposal_mut(id) {
        p.state = PState::Enforced;
    }
    drop(st);
    app.gov
        .audit_anyway("rollout", "kiln", json!({"id": id, "stage": "finished"}));
}

fn files_of(p: &Policy) -> BTreeMap<String, String> {
    p.sources
        .files()
        .map(|(_, f)| (f.name.clone(), f.text.to_string()))
        .collect()
}

/// Activates the version before the active one; its version, or why not.
async fn rollback_to_previous(app: &Arc<App>) -> Result<String, String> {
    let Some(prev) = lock(&app.gov.state).history.last().cloned() else {
        return Err("no previous version to return to".into());
    };
    match admin::activate(app, prev.files.clone()).await {
        Ok(_) => {
            let mut st = lock(&app.gov.state);
            st.history.pop();
            drop(st);
            mark_stale(app);
            Ok(prev.version.clone())
        }
        Err(e) => Err(format!(
            "the previous version {} could not be activated: {e}",
            prev.version,
        )),
    }
}

/// Starts the oldest approved proposal when no rollout runs (a rollback
/// proposal also ends a watch).
async fn start_next(app: &Arc<App>, now: f64) {
    let gov = &app.gov;
    let now_s = crate::clock::unix_s();
    let active = app.policy.load_full();
    let pick = {
        let mut st = lock(&gov.state);
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
    };
    let Some((id, kind, files)) = pick else {
        return;
    };
    match kind {
        Kind::Rollback => {
            let from = active.version.to_string();
            let r = rollback_to_previous(app).await;
            let by = {
                let mut st = lock(&gov.state);
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
                if let Some(p) = st.proposal_mut(&id) {
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
                    app.metrics.rollback("manual");
                    gov.audit_anyway(
                        "rollback",
                        &by,
                        json!({"id": id, "trigger": "manual", "from": from, "to": to, "approved": true}),
                    );
                }
                Err(e) => gov.audit_anyway(
                    "rollback_failed",
                    &by,
                    json!({"id": id, "trigger": "manual", "from": from, "error": e}),
                ),
            }
        }
        Kind::Change => {
            let compiled = admin::compile_upload(app, &files);
            let policy = match compiled {
                Ok((p, _, _)) => Arc::new(p),
                Err(e) => {
                    {
                        let mut st = lock(&gov.state);
                        if let Some(p) = st.proposal_mut(&id) {
                            p.state = PState::Refused;
                            p.note =
                                Some(format!("no longer fits this gateway ({}): {e}", e.status(),));
                        }
                    }
                    gov.audit_anyway(
                        "activation_refused",
                        "kiln",
                        json!({"id": id, "status": e.status(), "error": e.to_string()}),
                    );
                    return;
                }
            };
            let plan = Plan::of(&policy.graph, gov.default_canary_ms, gov.watch_ms);
            let (machine, step) = Rollout::start(plan.clone(), now);
            {
                let mut st = lock(&gov.state);
                if let Some(p) = st.proposal_mut(&id) {
                    p.state = PState::Rolling;
                }
                st.rollout = Some(Active {
                    proposal: id.clone(),
                    policy: policy.clone(),
                    machine,
                    conditions: Vec::new(),
                    shadow: None,
                    canary_from: gov.canary_requests.load(Ordering::Relaxed),
                });
            }
            gov.audit_anyway(
                "rollout",
                "kiln",
                json!({"id": id, "version": policy.version.as_ref(), "stage": "started", "plan": plan}),
            );
            perform(app, step, now, Vec::new()).await;
        }
    }
}

// --- the admin API -----------------------------------------------------

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/admin/proposals", post(propose).get(list))
        .route(
            "/admin/proposals/{id}",
            get(show).put(revise).delete(withdraw),
        )
        .route("/admin/proposals/{id}/approvals", post(approve))
        .route("/admin/status", get(status))
        .route("/admin/rollback", post(rollback))
        .route("/admin/overrides", post(add_override).get(list_overrides))
        .route("/admin/overrides/{scope}/{name}", delete(lift_override))
        .route("/admin/audit", get(audit))
        .with_state(app)
}

/// The caller, for actions that change governance state: with approvals
/// on, only a named admin token (never open loopback access).
fn actor(app: &App, headers: &HeaderMap) -> Result<String, ApiError> {
    let who = identify(app, headers)?;
    if app.gov.enabled && who == "loopback" {
        return Err(ApiError::new(
            401,
            "governance actions need `Authorization: Bearer ADMIN-TOKEN`: the proposer must be known",
        )
        .code("unauthorized"));
    }
    Ok(who)
}

fn audit_failed(e: &AuditError) -> Response {
    api(
        503,
        format!("the audit log cannot be written ({e}); nothing was changed"),
        "audit_unavailable",
    )
}

/// Everything a proposal reports, computed off the request path.
async fn assess(
    app: &Arc<App>,
    policy: Arc<Policy>,
) -> (
    crate::diff::semantic::SemanticDiff,
    Changes,
    Option<DryRunView>,
) {
    let active = app.policy.load_full();
    let (old, new) = (active.graph.clone(), policy.graph.clone());
    let semantic = tokio::task::spawn_blocking(move || crate::diff::semantic::semantic(&old, &new))
        .await
        .unwrap_or_default();
    let changes = Changes::of(&semantic);
    let dry = dry_run(app, active.clone(), policy).await;
    (semantic, changes, Some(dry))
}

/// Replays the gateway's recent decision log under both versions.
async fn dry_run(app: &Arc<App>, old: Arc<Policy>, new: Arc<Policy>) -> DryRunView {
    let Some(l) = &app.config.log else {
        return DryRunView {
            note: Some(
                "no decision log is configured ([log] or --log): no recorded traffic to replay"
                    .into(),
            ),
            ..DryRunView::default()
        };
    };
    app.log.flush().await;
    let path = l.path.clone();
    let limit = app.gov.dry_run_records.max(1);
    let cal = app.calibration.clone();
    let r = tokio::task::spawn_blocking(move || {
        let opts = crate::traffic::ReadOptions {
            skip_malformed: true,
        };
        let loaded = match crate::traffic::read_with(&path, opts) {
            Ok(l) => l,
            Err(e) => {
                return DryRunView {
                    note: Some(format!("cannot read the decision log: {e}")),
                    ..DryRunView::default()
                }
            }
        };
        let mut recs = loaded.records;
        let total = recs.len();
        if recs.len() > limit {
            recs = recs.split_off(recs.len() - limit);
        }
        crate::traffic::rebase_wall_clock(&mut recs);
        let mut view = DryRunView {
            records: recs.len() as u64,
            note: (total > limit)
                .then(|| format!("the most recent {limit} of {total} recorded requests")),
            ..DryRunView::default()
        };
        if recs.is_empty() {
            view.note = Some("the decision log holds no requests yet".into());
            return view;
        }
        let costs = (
            crate::backend::cost::CostModel::from_graph(&old.graph, cal.as_ref()),
            crate::backend::cost::CostModel::from_graph(&new.graph, cal.as_ref()),
        );
        let (co, cn) = match costs {
            (Ok(a), Ok(b)) => (a, b),
            _ => {
                let cfg = crate::sched::Config::default();
                let d = crate::diff::traffic::decisions(
                    &old.graph,
                    &new.graph,
                    &recs,
                    cfg.start_minute_of_day,
                    cfg.start_weekday,
                );
                fill_decisions(&mut view, &d);
                view.note = Some("the simulator cannot size these pools: decisions only".into());
                return view;
            }
        };
        if let Some(dr) = crate::diff::dry_run(&old.graph, &new.graph, (&co, &cn), &recs, |_, _| {})
        {
            fill_decisions(&mut view, &dr.decisions);
            for t in &dr.impact.tiers {
                for m in t.metrics.iter().filter(|m| {
                    matches!(
                        m.metric.as_str(),
                        "ttft_p95_ms" | "slo_attainment" | "rejected"
                    ) && m.delta != 0.0
                }) {
                    view.impact.push(ImpactLine {
                        scope: format!("tier:{}", t.name),
                        metric: m.metric.clone(),
                        old: m.old,
                        new: m.new,
                        delta: m.delta,
                    });
                }
            }
        }
        view
    })
    .await;
    r.unwrap_or_else(|e| DryRunView {
        note: Some(format!("the dry run failed: {e}")),
        ..DryRunView::default()
    })
}

fn fill_decisions(view: &mut DryRunView, d: &crate::diff::traffic::DecisionDiff) {
    view.changed = d.changed;
    view.by_kind = d.by_kind.clone();
    view.transitions = d
        .transitions
        .iter()
        .take(10)
        .map(|t| TransitionLine {
            kind: t.kind.clone(),
            old: t.old.clone(),
            new: t.new.clone(),
            count: t.count,
        })
        .collect();
}

fn needs_for(app: &App, active: &DecisionGraph, changes: &Changes) -> Vec<approval::Need> {
    if app.gov.enabled {
        approval::needs(&active.approvals, changes)
    } else {
        Vec::new()
    }
}

async fn propose(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let files = match admin::read_upload(&headers, body).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    let (policy, _, _) = match admin::compile_upload(&app, &files) {
        Ok(x) => x,
        Err(e) => return admin::activation_refused(&e),
    };
    let active = app.policy.load_full();
    if policy.version == active.version {
        return api(
            409,
            format!("this is the active policy ({})", active.version),
            "unchanged",
        );
    }
    let hash = crate::governance::policy_hash(&policy.sources);
    let policy = Arc::new(policy);
    let (semantic, changes, dry) = assess(&app, policy.clone()).await;
    let needs = needs_for(&app, &active.graph, &changes);
    let plan = Plan::of(&policy.graph, app.gov.default_canary_ms, app.gov.watch_ms);
    let now_s = crate::clock::unix_s();
    let view = {
        let mut st = lock(&app.gov.state);
        let id = format!("p-{}", st.next);
        let p = Proposal {
            id: id.clone(),
            kind: Kind::Change,
            state: if needs.is_empty() {
                PState::Approved
            } else {
                PState::Pending
            },
            files,
            hash: hash.clone(),
            version: policy.version.to_string(),
            base: active.version.to_string(),
            proposer: who.clone(),
            created_unix_ms: crate::clock::unix_ms() as u64,
            revision: 1,
            changes: changes.clone(),
            semantic,
            needs: needs.clone(),
            approvals: Vec::new(),
            dry_run: dry,
            rollout: Some(plan),
            note: None,
        };
        if let Err(e) = app.gov.audit(
            "proposal",
            &who,
            json!({"id": id, "hash": hash, "version": policy.version.as_ref(), "base": active.version.as_ref(),
                   "kinds": Changes::names(&changes.kinds), "escalations": Changes::names(&changes.escalations),
                   "needs": needs}),
        ) {
            return audit_failed(&e);
        }
        st.next += 1;
        let v = p.view(now_s, true);
        st.proposals.push(p);
        v
    };
    advance(&app).await;
    let view = current_view(&app, &view.id).unwrap_or(view);
    (StatusCode::CREATED, axum::Json(view)).into_response()
}

fn current_view(app: &App, id: &str) -> Option<ProposalView> {
    let st = lock(&app.gov.state);
    st.proposals
        .iter()
        .find(|p| p.id == id)
        .map(|p| p.view(crate::clock::unix_s(), true))
}

async fn list(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    let now_s = crate::clock::unix_s();
    let st = lock(&app.gov.state);
    let v: Vec<ProposalView> = st.proposals.iter().map(|p| p.view(now_s, false)).collect();
    axum::Json(v).into_response()
}

async fn show(State(app): State<Arc<App>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    match current_view(&app, &id) {
        Some(v) => axum::Json(v).into_response(),
        None => api(404, format!("no proposal `{id}`"), "not_found"),
    }
}

async fn revise(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let files = match admin::read_upload(&headers, body).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    {
        let st = lock(&app.gov.state);
        match st.proposals.iter().find(|p| p.id == id) {
            None => return api(404, format!("no proposal `{id}`"), "not_found"),
            Some(p) if p.proposer != who => {
                return api(
                    403,
                    format!("only its proposer ({}) may revise {id}", p.proposer),
                    "forbidden",
                )
            }
            Some(p) if !p.state.open() || p.kind != Kind::Change => {
                return api(
                    409,
                    format!("{id} is {}, it can no longer be revised", p.state.name()),
                    "not_pending",
                )
            }
            Some(_) => {}
        }
    }
    let (policy, _, _) = match admin::compile_upload(&app, &files) {
        Ok(x) => x,
        Err(e) => return admin::activation_refused(&e),
    };
    let active = app.policy.load_full();
    let hash = crate::governance::policy_hash(&policy.sources);
    let policy = Arc::new(policy);
    let (semantic, changes, dry) = assess(&app, policy.clone()).await;
    let needs = needs_for(&app, &active.graph, &changes);
    let plan = Plan::of(&policy.graph, app.gov.default_canary_ms, app.gov.watch_ms);
    {
        let mut st = lock(&app.gov.state);
        let p = match st.open_proposal(&id, "it can no longer be revised") {
            Ok(p) => p,
            Err(r) => return *r,
        };
        if let Err(e) = app.gov.audit(
            "proposal_revised",
            &who,
            json!({"id": id, "previous_hash": p.hash, "hash": hash, "version": policy.version.as_ref(),
                   "voided_approvals": p.approvals.iter().map(|a| a.approver.clone()).collect::<Vec<_>>(),
                   "needs": needs}),
        ) {
            return audit_failed(&e);
        }
        p.files = files;
        p.hash = hash;
        p.version = policy.version.to_string();
        p.base = active.version.to_string();
        p.revision += 1;
        p.changes = changes;
        p.semantic = semantic;
        p.state = if needs.is_empty() {
            PState::Approved
        } else {
            PState::Pending
        };
        p.needs = needs;
        p.approvals.clear();
        p.dry_run = dry;
        p.rollout = Some(plan);
        p.note = Some("revised: earlier approvals are void".into());
    }
    advance(&app).await;
    match current_view(&app, &id) {
        Some(v) => axum::Json(v).into_response(),
        None => api(404, format!("no proposal `{id}`"), "not_found"),
    }
}

async fn withdraw(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let mut st = lock(&app.gov.state);
    let p = match st.open_proposal(&id, "not open") {
        Ok(p) => p,
        Err(r) => return *r,
    };
    if let Err(e) = app.gov.audit(
        "proposal_withdrawn",
        &who,
        json!({"id": id, "hash": p.hash}),
    ) {
        return audit_failed(&e);
    }
    p.state = PState::Withdrawn;
    p.note = Some(format!("withdrawn by {who}"));
    let view = p.view(crate::clock::unix_s(), false);
    drop(st);
    persist(&app);
    axum::Json(view).into_response()
}

async fn approve(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let a: SignedApproval = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return ApiError::bad_request(
                format!(
                "expected a signed approval {{approver, hash, issued, expires, signature}}: {e}"
            ),
                None,
            )
            .into_response()
        }
    };
    let now_s = crate::clock::unix_s();
    let result = {
        let mut st = lock(&app.gov.state);
        let GovState {
            proposals, used, ..
        } = &mut *st;
        let Some(p) = proposals.iter_mut().find(|p| p.id == id) else {
            return api(404, format!("no proposal `{id}`"), "not_found");
        };
        let checked = if p.state.open() {
            approval::check(
                &app.gov.approvers,
                used,
                &Subject {
                    proposal: &p.id,
                    hash: &p.hash,
                    proposer: &p.proposer,
                    approvals: &p.approvals,
                    now_s,
                    max_valid_s: app.gov.approval_ttl_s,
                },
                &a,
            )
        } else {
            Err(approval::Refusal::NotPending {
                proposal: p.id.clone(),
                state: p.state.name().into(),
            })
        };
        match checked {
            Ok(acc) => {
                if let Err(e) = app.gov.audit(
                    "approval",
                    &acc.approver,
                    json!({"id": p.id, "hash": p.hash, "approver": acc.approver, "groups": acc.groups,
                           "issued": acc.issued, "expires": acc.expires, "signature": acc.signature,
                           "submitted_by": who}),
                ) {
                    return audit_failed(&e);
                }
                used.insert(acc.signature.clone());
                p.approvals.push(acc);
                if p.approved(now_s) {
                    p.state = PState::Approved;
                }
                Ok(())
            }
            Err(r) => {
                app.gov.audit_anyway(
                    "approval_refused",
                    &who,
                    json!({"id": p.id, "approver": a.approver, "hash": a.hash, "code": r.code(), "reason": r.to_string()}),
                );
                Err(r)
            }
        }
    };
    match result {
        Ok(()) => {
            app.metrics.approval("accepted");
            advance(&app).await;
            match current_view(&app, &id) {
                Some(v) => axum::Json(v).into_response(),
                None => api(404, format!("no proposal `{id}`"), "not_found"),
            }
        }
        Err(r) => {
            app.metrics.approval(r.code());
            let help = miette::Diagnostic::help(&r).map(|h| h.to_string());
            let status = StatusCode::from_u16(r.status()).unwrap_or(StatusCode::FORBIDDEN);
            (
                status,
                axum::Json(json!({
                    "error": {"message": r.to_string(), "type": "approval_refused", "code": r.code(), "param": null},
                    "help": help,
                })),
            )
                .into_response()
        }
    }
}

pub fn status_view(app: &App) -> StatusView {
    let gov = &app.gov;
    let now = gov.now_ms();
    let now_s = crate::clock::unix_s();
    let shadow_now = gov.shadow().map(|s| s.counts());
    let st = lock(&gov.state);
    let rollout = st.rollout.as_ref().filter(|a| !a.machine.done()).map(|a| {
        let canary = a
            .machine
            .plan
            .canary
            .clone()
            .filter(|_| a.machine.stage == Stage::Canary);
        RolloutView {
            proposal: a.proposal.clone(),
            version: a.policy.version.to_string(),
            stage: a.machine.stage.name().into(),
            elapsed_s: (now - a.machine.since) / 1000.0,
            remaining_s: a.machine.until.map(|u| ((u - now) / 1000.0).max(0.0)),
            canary,
            canary_requests: gov
                .canary_requests
                .load(Ordering::Relaxed)
                .saturating_sub(a.canary_from),
            shadow: shadow_now
                .clone()
                .or_else(|| a.shadow.clone())
                .unwrap_or_default(),
            conditions: a.conditions.clone(),
            live: a
                .machine
                .armed()
                .then(|| lock(&gov.live).summary(now, a.machine.stage == Stage::Canary)),
            min_samples: gov.min_samples,
        }
    });
    StatusView {
        active: app.policy.load().version.to_string(),
        previous: st.history.last().map(|p| p.version.clone()),
        governance: gov.enabled,
        approvers: gov.approvers.iter().map(|a| a.name.clone()).collect(),
        audit: gov.audit_head(),
        rollout,
        proposals: st
            .proposals
            .iter()
            .filter(|p| p.state.open())
            .map(|p| p.view(now_s, false))
            .collect(),
        overrides: gov.override_views(),
        last_rollback: st.last_rollback.clone(),
    }
}

async fn status(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    // A governance step in flight (an activation, say) is seen whole or
    // not at all: never the new version with the old history.
    let _consistent = app.gov.step.lock().await;
    axum::Json(status_view(&app)).into_response()
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RollbackRequest {
    #[serde(default)]
    reason: Option<String>,
}

async fn rollback(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req: RollbackRequest = if body.is_empty() {
        RollbackRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return ApiError::bad_request(format!("expected {{\"reason\": \"…\"}}: {e}"), None)
                    .into_response()
            }
        }
    };
    let step_guard = app.gov.step.lock().await;
    let now = app.gov.now_ms();
    // A rollout in shadow or canary: abort it; the active version never
    // changed, so this needs no approval.
    let aborting = {
        let st = lock(&app.gov.state);
        st.rollout
            .as_ref()
            .filter(|a| matches!(a.machine.stage, Stage::Shadow | Stage::Canary))
            .map(|a| {
                (
                    a.proposal.clone(),
                    a.policy.version.to_string(),
                    a.machine.stage,
                )
            })
    };
    if let Some((id, version, stage)) = aborting {
        if let Err(e) = app.gov.audit(
            "rollback",
            &who,
            json!({"id": id, "trigger": "manual", "stage": stage.name(), "from": version,
                   "to": app.policy.load().version.as_ref(), "reason": req.reason}),
        ) {
            return audit_failed(&e);
        }
        end_shadow(&app);
        set_canary(&app, None).await;
        let view = RollbackView {
            at_unix_ms: crate::clock::unix_ms() as u64,
            from: version.clone(),
            to: app.policy.load().version.to_string(),
            trigger: "manual".into(),
            condition: None,
            observed: Vec::new(),
            by: who.clone(),
        };
        {
            let mut st = lock(&app.gov.state);
            if let Some(a) = st.rollout.as_mut() {
                a.machine.end(now);
            }
            st.rollout = None;
            if let Some(p) = st.proposal_mut(&id) {
                p.state = PState::RolledBack;
                p.note = Some(format!("rollout aborted in {} by {who}", stage.name()));
            }
            st.last_rollback = Some(view.clone());
        }
        persist(&app);
        app.metrics.rollback("manual");
        return axum::Json(
            json!({"rolled_back": true, "aborted": id, "stage": stage.name(), "rollback": view}),
        )
        .into_response();
    }
    let active = app.policy.load_full();
    let Some(prev) = lock(&app.gov.state).history.last().cloned() else {
        return api(
            409,
            format!(
                "no previous version to return to ({} is the first this gateway ran)",
                active.version
            ),
            "no_previous",
        );
    };
    let needs = needs_for(&app, &active.graph, &Changes::rollback());
    if needs.is_empty() {
        let r = rollback_to_previous(&app).await;
        return match r {
            Ok(to) => {
                let view = RollbackView {
                    at_unix_ms: crate::clock::unix_ms() as u64,
                    from: active.version.to_string(),
                    to: to.clone(),
                    trigger: "manual".into(),
                    condition: None,
                    observed: Vec::new(),
                    by: who.clone(),
                };
                {
                    let mut st = lock(&app.gov.state);
                    if let Some(a) = st.rollout.take() {
                        if let Some(p) = st.proposals.iter_mut().find(|p| p.id == a.proposal) {
                            p.state = PState::RolledBack;
                            p.note = Some(format!("rolled back by {who}"));
                        }
                    }
                    st.last_rollback = Some(view.clone());
                }
                persist(&app);
                app.metrics.rollback("manual");
                app.gov.audit_anyway(
                    "rollback",
                    &who,
                    json!({"trigger": "manual", "from": active.version.as_ref(), "to": to, "reason": req.reason, "approved": false}),
                );
                axum::Json(json!({"rolled_back": true, "rollback": view})).into_response()
            }
            Err(e) => {
                app.gov.audit_anyway(
                    "rollback_failed",
                    &who,
                    json!({"trigger": "manual", "from": active.version.as_ref(), "error": e}),
                );
                api(
                    422,
                    format!("{e}; the active policy is unchanged"),
                    "rollback_failed",
                )
            }
        };
    }
    // The rules of the policy in force want approvals: a rollback proposal.
    let files = prev.files.clone();
    let hash = stored::files_hash(&files);
    let view = {
        let mut st = lock(&app.gov.state);
        let id = format!("p-{}", st.next);
        if let Err(e) = app.gov.audit(
            "proposal",
            &who,
            json!({"id": id, "kind": "rollback", "hash": hash, "version": prev.version,
                   "base": active.version.as_ref(), "kinds": ["rollback"], "needs": needs, "reason": req.reason}),
        ) {
            return audit_failed(&e);
        }
        st.next += 1;
        let p = Proposal {
            id,
            kind: Kind::Rollback,
            state: PState::Pending,
            files,
            hash,
            version: prev.version.clone(),
            base: active.version.to_string(),
            proposer: who,
            created_unix_ms: crate::clock::unix_ms() as u64,
            revision: 1,
            changes: Changes::rollback(),
            semantic: crate::diff::semantic::SemanticDiff::default(),
            needs,
            approvals: Vec::new(),
            dry_run: None,
            rollout: None,
            note: req.reason.map(|r| format!("reason: {r}")),
        };
        let v = p.view(crate::clock::unix_s(), true);
        st.proposals.push(p);
        v
    };
    persist(&app);
    drop(step_guard);
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({"rolled_back": false, "proposal": view})),
    )
        .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OverrideRequest {
    scope: String,
    name: String,
    /// pause or throttle
    action: String,
    #[serde(default)]
    percent: Option<f64>,
    /// A kiln duration: `30m`, `1h`.
    #[serde(rename = "for")]
    duration: String,
    #[serde(default)]
    reason: Option<String>,
}

async fn add_override(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req: OverrideRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(
                format!("expected {{scope, name, action, for, percent?, reason?}}: {e}"),
                None,
            )
            .into_response()
        }
    };
    let Some(scope) = Scope::parse(&req.scope) else {
        return ApiError::bad_request(
            format!("scope `{}` is neither tier nor tenant", req.scope),
            Some("scope"),
        )
        .into_response();
    };
    let g = app.policy.load_full();
    let known = match scope {
        Scope::Tier => g.graph.tier_id(&req.name).is_some(),
        Scope::Tenant => g.graph.tenant_id(&req.name).is_some(),
    };
    if !known {
        return api(
            404,
            format!("the active policy has no {} `{}`", scope.name(), req.name),
            "not_found",
        );
    }
    let action = match (req.action.as_str(), req.percent) {
        ("pause", None) => OverrideAction::Pause,
        ("throttle", Some(p)) if p.is_finite() && (0.0..=100.0).contains(&p) => {
            OverrideAction::Throttle { percent: p }
        }
        ("throttle", _) => {
            return ApiError::bad_request(
                "a throttle needs `percent`, 0 to 100".into(),
                Some("percent"),
            )
            .into_response()
        }
        _ => {
            return ApiError::bad_request(
                format!("action `{}` is neither pause nor throttle", req.action),
                Some("action"),
            )
            .into_response()
        }
    };
    let Some(for_ms) = crate::governance::parse_duration_ms(&req.duration).filter(|d| *d > 0.0)
    else {
        return ApiError::bad_request(
            format!(
                "`for` = `{}` is not a positive duration (30m, 1h)",
                req.duration
            ),
            Some("for"),
        )
        .into_response();
    };
    let now = app.gov.now_ms();
    if let Err(e) = app.gov.audit(
        "override",
        &who,
        json!({"scope": scope.name(), "name": req.name, "action": action.name(), "percent": req.percent,
               "for": req.duration, "reason": req.reason}),
    ) {
        return audit_failed(&e);
    }
    let (o, replaced) = lock(&app.gov.overrides).add(
        now,
        crate::governance::overrides::NewOverride {
            scope,
            name: &req.name,
            action,
            for_ms,
            by: &who,
            reason: req.reason,
        },
    );
    app.gov.any_override.store(true, Ordering::Relaxed);
    tracing::warn!(scope = scope.name(), name = %o.name, action = action.name(), by = %who, "override in force");
    let view = app.gov.override_views().into_iter().find(|v| v.id == o.id);
    (
        StatusCode::CREATED,
        axum::Json(json!({"override": view, "replaced": replaced.map(|r| r.id)})),
    )
        .into_response()
}

async fn list_overrides(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    axum::Json(app.gov.override_views()).into_response()
}

async fn lift_override(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((scope, name)): Path<(String, String)>,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let Some(sc) = Scope::parse(&scope) else {
        return ApiError::bad_request(
            format!("scope `{scope}` is neither tier nor tenant"),
            Some("scope"),
        )
        .into_response();
    };
    let gone = lock(&app.gov.overrides).lift(sc, &name);
    if gone.is_empty() {
        return api(404, format!("no override on {scope} {name}"), "not_found");
    }
    for o in &gone {
        app.gov.audit_anyway(
            "override_lifted",
            &who,
            json!({"id": o.id, "scope": scope, "name": name, "action": o.action.name(), "refused": o.refused}),
        );
    }
    axum::Json(json!({"lifted": gone.iter().map(|o| o.id).collect::<Vec<_>>()})).into_response()
}

async fn audit(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    let a = lock(&app.gov.audit);
    let recent: Vec<&crate::governance::audit::Entry> = a.recent().collect();
    let tail = recent.len().saturating_sub(100);
    axum::Json(json!({
        "path": a.path().map(|p| p.display().to_string()),
        "entries": a.entries(),
        "head": a.head(),
        "recent": &recent[tail..],
    }))
    .into_response()
}
