//! The governance a gateway keeps: proposals, the rollout in progress,
//! version history, overrides, the live window and the audit log, with
//! the state file that carries them across restarts. What acts on it is
//! in [`super::runner`] (the rollout runner) and [`super::actions`] (the
//! admin operations).

use super::approval::Approver;
use super::audit::{AuditError, AuditLog};
use super::gateway::Gateway;
use super::live::{Sample, Window};
use super::lock;
use super::overrides::{Action as OverrideAction, Overrides, Refused, Scope};
use super::proposal::{Proposal, State as PState};
use super::rollout::{Rollout, Stage};
use super::shadow::Shadow;
use super::state::{self as stored, Previous, Snapshot, StateError, StoredProposal};
use super::view::{
    AuditHead, ConditionView, OverrideView, RollbackView, RolloutView, ShadowCounts, StatusView,
};
use super::Policy;
use arc_swap::ArcSwapOption;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Previous versions kept for `kiln rollback`.
pub(super) const HISTORY: usize = 16;
/// Finished proposals kept for `GET /admin/proposals`.
pub(super) const KEEP_CLOSED: usize = 200;

/// What governance is configured with (the server reads it from
/// `kiln.toml`).
pub struct GovConfig {
    /// Approvals required (`POST /admin/policy` refused).
    pub enabled: bool,
    pub approvers: Vec<Approver>,
    /// The audit log's file; in memory when none.
    pub audit: Option<PathBuf>,
    /// The state file, if any.
    pub state: Option<PathBuf>,
    /// The simulator's speed: the gateway's clock runs this much faster.
    pub speed: f64,
    pub window_ms: f64,
    pub min_samples: u64,
    pub approval_ttl_s: u64,
    pub watch_ms: f64,
    pub default_canary_ms: f64,
    pub dry_run_records: usize,
    /// The longest pause or throttle an operator may set
    /// (`[governance] max_override`).
    pub max_override_ms: f64,
    /// Approver groups whose members may withdraw anyone's proposal
    /// (`[governance] withdraw_groups`); others withdraw only their own.
    pub withdraw_groups: Vec<String>,
    /// The fleet's shared store (`[state] redis`): proposals, approvals,
    /// used signatures, rollback history and the audit chain live there,
    /// written one governance step at a time under a lease (see
    /// [`super::shared`]); `audit` and `state` files are then not used.
    pub shared: Option<Arc<crate::shared::Store>>,
}

/// The rollout in progress.
pub(super) struct Active {
    pub(super) proposal: String,
    pub(super) policy: Arc<Policy>,
    pub(super) machine: Rollout,
    pub(super) conditions: Vec<ConditionView>,
    /// The canary stage's gates, as of the last tick.
    pub(super) gates: Vec<ConditionView>,
    /// What shadowing found, once it ended.
    pub(super) shadow: Option<ShadowCounts>,
    pub(super) canary_from: u64,
}

#[derive(Default)]
pub(super) struct GovState {
    pub(super) proposals: Vec<Proposal>,
    pub(super) next: u64,
    pub(super) rollout: Option<Active>,
    /// Versions that were active before, most recent last.
    pub(super) history: Vec<Previous>,
    /// Signatures of accepted approvals: never accepted twice.
    pub(super) used: HashSet<String>,
    pub(super) last_rollback: Option<RollbackView>,
}

impl GovState {
    pub(super) fn proposal_mut(&mut self, id: &str) -> Option<&mut Proposal> {
        self.proposals.iter_mut().find(|p| p.id == id)
    }

    /// Keeps `prev` as the version `kiln rollback` returns to.
    pub(super) fn push_history(&mut self, prev: Previous) {
        self.history.push(prev);
        if self.history.len() > HISTORY {
            self.history.remove(0);
        }
    }
}

pub struct Gov {
    /// Approvals required (`POST /admin/policy` refused).
    pub enabled: bool,
    pub(super) approvers: Vec<Approver>,
    pub(super) audit: Mutex<AuditLog>,
    pub(super) state: Mutex<GovState>,
    /// One governance step at a time (driver ticks and admin actions).
    pub(super) step: tokio::sync::Mutex<()>,
    pub(super) shadow: ArcSwapOption<Shadow>,
    pub(super) live: Mutex<Window>,
    pub(super) overrides: Mutex<Overrides>,
    pub(super) any_override: AtomicBool,
    /// Rollback conditions are armed: finished requests are recorded.
    pub(super) recording: AtomicBool,
    pub(super) canary_requests: AtomicU64,
    clock: Instant,
    speed: f64,
    pub(super) min_samples: u64,
    pub(super) approval_ttl_s: u64,
    pub(super) watch_ms: f64,
    pub(super) default_canary_ms: f64,
    pub(super) dry_run_records: usize,
    pub(super) max_override_ms: f64,
    pub(super) withdraw_groups: Vec<String>,
    /// The gateway's identity (random, kept in the audit log's first
    /// `gateway` entry): approvals sign it. With a shared store it is the
    /// fleet's, empty until this replica has read (or written) it.
    pub(super) gateway: Mutex<String>,
    /// The fleet's shared store, when governance lives there.
    pub(super) shared: Option<Arc<crate::shared::Store>>,
    /// What this replica last read from or wrote to the shared store.
    pub(super) synced: Mutex<super::shared::Synced>,
    /// This replica's shared steps one at a time: the fleet's lease is
    /// held per replica, so two tasks of one replica would both hold it.
    pub(super) fleet_step: tokio::sync::Mutex<()>,
    /// Whether this replica ran rollouts at its last check (it holds the
    /// runner's lease).
    pub(super) leading: AtomicBool,
    /// The rollout in progress as the replica running it last published
    /// it (for this replica's views and `kiln rollback` when it runs
    /// elsewhere).
    pub(super) shared_rollout: Mutex<Option<RolloutView>>,
    /// The state file, if any.
    state_path: Option<PathBuf>,
    /// The bytes last written there (unchanged state is not rewritten).
    written: Mutex<Option<Vec<u8>>>,
    /// The active version the state file recorded, until the runner starts.
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
    #[error(transparent)]
    #[diagnostic(transparent)]
    Key(#[from] super::keys::KeyError),
}

/// The governance state a state file holds, checked: proposals whose text
/// does not hash to their recorded hash, and approvals that no longer
/// verify under the configured approvers, are dropped (logged and audited).
fn restore(
    path: &std::path::Path,
    snap: &Snapshot,
    approvers: &[Approver],
    gateway: &str,
    audit: &mut AuditLog,
) -> Result<(GovState, Option<Previous>), GovError> {
    let (mut proposals, dropped) = snap.verify(approvers, gateway);
    // A proposal stored before nonces existed gets one now (its approvals,
    // signed without one, were dropped above).
    for p in proposals.iter_mut().filter(|p| p.nonce.is_empty()) {
        p.nonce = super::keys::random_id()?;
    }
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

/// The version and files of `p`, as history keeps them.
pub(super) fn previous_of(p: &Policy) -> Previous {
    Previous {
        version: p.version.to_string(),
        files: p.files(),
    }
}

impl Gov {
    pub fn new(cfg: GovConfig) -> Result<Gov, GovError> {
        if cfg.shared.is_some() {
            return Ok(Gov::shared(cfg));
        }
        let mut audit = match &cfg.audit {
            Some(path) => AuditLog::open(path)?,
            None => AuditLog::memory(),
        };
        let state_path = cfg
            .state
            .clone()
            .or_else(|| cfg.audit.as_deref().map(stored::default_path));
        let facts = audit.take_facts();
        let gateway = match facts.gateway.clone() {
            Some(g) => g,
            // A log kept in memory only: an identity for this run.
            None if audit.path().is_none() => super::keys::random_id()?,
            None => {
                let g = super::keys::random_id()?;
                audit.append(
                    crate::clock::unix_ms() as u64,
                    "gateway",
                    "kiln",
                    json!({"gateway": g, "note": "this gateway's identity: approvals sign it"}),
                )?;
                g
            }
        };
        let (mut state, restored_active) = match &state_path {
            Some(path) => match Snapshot::load(path)? {
                Some(snap) => restore(path, &snap, &cfg.approvers, &gateway, &mut audit)?,
                None => (GovState::default(), None),
            },
            None => (GovState::default(), None),
        };
        // What the audit log recorded outlives any state file: ids are
        // never handed out twice and accepted signatures never count again,
        // even after the state file was moved aside.
        state.next = state
            .next
            .max(facts.highest_proposal.saturating_add(1))
            .max(1);
        state.used.extend(facts.signatures);
        Ok(Gov::assemble(
            cfg,
            audit,
            state,
            gateway,
            state_path,
            restored_active,
        ))
    }

    /// Governance kept in the fleet's shared store: nothing is read here
    /// (the first step reads the store; `Gov::new` cannot wait on it).
    fn shared(cfg: GovConfig) -> Gov {
        if cfg.audit.is_some() || cfg.state.is_some() {
            tracing::warn!("[state] redis is set: the governance state and the audit chain are kept in the shared store, not in the [audit] / [governance] state files");
        }
        Gov::assemble(
            cfg,
            AuditLog::shared(),
            GovState::default(),
            String::new(),
            None,
            None,
        )
    }

    fn assemble(
        cfg: GovConfig,
        audit: AuditLog,
        state: GovState,
        gateway: String,
        state_path: Option<PathBuf>,
        restored_active: Option<Previous>,
    ) -> Gov {
        Gov {
            enabled: cfg.enabled,
            approvers: cfg.approvers,
            audit: Mutex::new(audit),
            state: Mutex::new(state),
            step: tokio::sync::Mutex::new(()),
            shadow: ArcSwapOption::empty(),
            live: Mutex::new(Window::new(cfg.window_ms, 100_000)),
            overrides: Mutex::new(Overrides::default()),
            any_override: AtomicBool::new(false),
            recording: AtomicBool::new(false),
            canary_requests: AtomicU64::new(0),
            clock: Instant::now(),
            speed: if cfg.speed.is_finite() && cfg.speed > 0.0 {
                cfg.speed
            } else {
                1.0
            },
            min_samples: cfg.min_samples,
            approval_ttl_s: cfg.approval_ttl_s,
            watch_ms: cfg.watch_ms,
            default_canary_ms: cfg.default_canary_ms,
            dry_run_records: cfg.dry_run_records,
            max_override_ms: cfg.max_override_ms,
            withdraw_groups: cfg.withdraw_groups,
            gateway: Mutex::new(gateway),
            shared: cfg.shared,
            synced: Mutex::new(super::shared::Synced::default()),
            fleet_step: tokio::sync::Mutex::new(()),
            leading: AtomicBool::new(false),
            shared_rollout: Mutex::new(None),
            state_path,
            written: Mutex::new(None),
            restored_active: Mutex::new(restored_active),
        }
    }

    /// The identity approvals sign (the fleet's, with a shared store).
    pub fn gateway(&self) -> String {
        lock(&self.gateway).clone()
    }

    /// The state as the state file (or the shared store, with `all`:
    /// closed proposals too, so every replica lists the same) holds it.
    pub(super) fn snapshot(&self, gw: &impl Gateway, all: bool) -> Snapshot {
        let active = gw.active();
        let st = lock(&self.state);
        let mut used: Vec<String> = st.used.iter().cloned().collect();
        used.sort();
        Snapshot {
            format: stored::FORMAT,
            next: st.next,
            proposals: st
                .proposals
                .iter()
                .filter(|p| all || stored::kept(p))
                .map(StoredProposal::of)
                .collect(),
            history: st.history.clone(),
            active: Some(previous_of(&active)),
            used,
            last_rollback: st.last_rollback.clone(),
        }
    }

    /// The gateway's clock in ms: wall time since start, times the
    /// simulator's speed (rollout stages, holds, windows and overrides run
    /// on it, like the policy's own durations).
    /// Policy time per wall time (the simulator's speed).
    pub fn speed(&self) -> f64 {
        self.speed
    }

    pub fn now_ms(&self) -> f64 {
        self.clock.elapsed().as_secs_f64() * 1000.0 * self.speed
    }

    /// Writes the governance state file (when one is configured and the
    /// state changed since the last write). A write error is logged: the
    /// gateway keeps governing from memory.
    pub(super) fn persist(&self, gw: &impl Gateway) {
        let Some(path) = &self.state_path else {
            return;
        };
        // Held across snapshot and write: writes land in the order of states.
        let mut written = lock(&self.written);
        let bytes = self.snapshot(gw, false).to_bytes();
        if written.as_deref() == Some(&bytes[..]) {
            return;
        }
        match stored::write_atomic(path, &bytes) {
            Ok(()) => *written = Some(bytes),
            Err(e) => tracing::error!(error = %e, "cannot write the governance state file"),
        }
    }

    /// Once, before the runner's first step: the version active before the
    /// restart (when `--policy` differs from it) becomes the one `kiln
    /// rollback` returns to, and the active version is not its own
    /// previous.
    pub fn settle_restored(&self, gw: &impl Gateway) {
        // With a shared store, the replica that runs rollouts settles what
        // a stopped one left rolling (see `Gov::reconcile`).
        if self.shared.is_some() {
            return;
        }
        let version = gw.active().version.to_string();
        self.settle_interrupted(&version);
        let Some(before) = lock(&self.restored_active).take() else {
            self.persist(gw);
            return;
        };
        {
            let mut st = lock(&self.state);
            if before.version != version && st.history.last() != Some(&before) {
                tracing::info!(previous = %before.version, active = %version, "the gateway restarted on another version: the one it ran before is kept for rollback");
                st.push_history(before);
            }
            while st.history.last().is_some_and(|p| p.version == version) {
                st.history.pop();
            }
        }
        self.persist(gw);
    }

    /// A proposal the state file recorded as rolling out: the gateway
    /// stopped (a crash, `kill -9`) during its rollout. What becomes of it
    /// is audited (`rollout_interrupted`): still the active version, it
    /// stays enforced (its watch is not resumed); otherwise it starts again
    /// from its first stage if it still may (its base is active and its
    /// approvals hold), or goes stale or pending.
    fn settle_interrupted(&self, active: &str) {
        self.settle_interrupted_except(active, None)
    }

    /// [`Gov::settle_interrupted`] for every rolling proposal but
    /// `running` (the rollout this replica runs).
    pub(super) fn settle_interrupted_except(&self, active: &str, running: Option<&str>) {
        let now_s = crate::clock::unix_s();
        let mut events = Vec::new();
        {
            let mut st = lock(&self.state);
            for p in st
                .proposals
                .iter_mut()
                .filter(|p| p.state == PState::Rolling && Some(p.id.as_str()) != running)
            {
                let (state, outcome, note) = if p.version == active {
                    (
                        PState::Enforced,
                        "enforced",
                        "the gateway restarted during this rollout, on this version: it stays active (its watch is not resumed)",
                    )
                } else if p.base != active {
                    (
                        PState::Stale,
                        "stale",
                        "the gateway restarted during this rollout on another version: propose again",
                    )
                } else if p.approved(now_s) {
                    (
                        PState::Approved,
                        "restarted",
                        "the gateway restarted during this rollout: it starts again from its first stage",
                    )
                } else {
                    (
                        PState::Pending,
                        "pending",
                        "the gateway restarted during this rollout and its approvals expired: approve again",
                    )
                };
                tracing::warn!(proposal = %p.id, outcome, "{note}");
                p.state = state;
                p.note = Some(note.into());
                events.push(json!({"id": p.id, "version": p.version, "base": p.base,
                                   "active": active, "outcome": outcome, "note": note}));
            }
        }
        for e in events {
            self.audit_anyway("rollout_interrupted", "kiln", e);
        }
    }

    /// A proposal's view, with this gateway's identity (which approvals
    /// sign).
    pub(super) fn view_of(
        &self,
        p: &Proposal,
        now_s: u64,
        full: bool,
    ) -> super::view::ProposalView {
        let mut v = p.view(now_s, full);
        v.gateway = self.gateway();
        v
    }

    /// Appends to the audit log; an error is logged and returned.
    pub(super) fn audit(&self, kind: &str, actor: &str, details: Value) -> Result<(), AuditError> {
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
    pub(super) fn audit_anyway(&self, kind: &str, actor: &str, details: Value) {
        let _ = self.audit(kind, actor, details);
    }

    /// Appends an event the gateway's operators caused outside governance
    /// (keys reloaded, added, revoked): who, and what changed (never a
    /// secret). In a fleet it is one governance step, so the line joins
    /// the fleet's chain (a line appended outside a step would be undone
    /// by the next one).
    pub async fn audit_event(
        &self,
        gw: &impl super::gateway::Gateway,
        kind: &str,
        actor: &str,
        details: Value,
    ) -> Result<(), super::shared::StepError> {
        self.in_step(gw, async {
            self.audit(kind, actor, details)
                .map_err(|e| super::shared::StepError::Unavailable(e.to_string()))
        })
        .await
    }

    pub fn audit_head(&self) -> AuditHead {
        let a = lock(&self.audit);
        AuditHead {
            path: a.path().map(|p| p.display().to_string()),
            entries: a.entries(),
            head: a.head().to_string(),
        }
    }

    /// The audit log's head and its most recent `n` entries, as `GET
    /// /admin/audit` answers.
    pub fn audit_recent(&self, n: usize) -> Value {
        let a = lock(&self.audit);
        let recent: Vec<&super::audit::Entry> = a.recent().collect();
        let tail = recent.len().saturating_sub(n);
        json!({
            "path": a.path().map(|p| p.display().to_string()),
            "entries": a.entries(),
            "head": a.head(),
            "recent": &recent[tail..],
        })
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

    // --- reading -----------------------------------------------------

    /// `GET /admin/status` with `active` in force.
    pub fn status_view(&self, active: &Policy) -> StatusView {
        let now = self.now_ms();
        let now_s = crate::clock::unix_s();
        let shadow_now = self.shadow().map(|s| s.counts());
        let st = lock(&self.state);
        let local = st.rollout.as_ref().filter(|a| !a.machine.done()).map(|a| {
            let canary = a.machine.stage_plan().cloned();
            RolloutView {
                proposal: a.proposal.clone(),
                version: a.policy.version.to_string(),
                stage: a.machine.stage.name().into(),
                elapsed_s: (now - a.machine.since) / 1000.0,
                remaining_s: a.machine.until.map(|u| ((u - now) / 1000.0).max(0.0)),
                stage_number: canary.as_ref().map(|_| a.machine.index + 1),
                stages: a.machine.plan.stages.len(),
                gates: a.gates.clone(),
                canary,
                canary_requests: self
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
                    .reads()
                    .then(|| lock(&self.live).summary(now, a.machine.stage == Stage::Canary)),
                min_samples: self.min_samples,
            }
        });
        // Run by another replica: as it last published it.
        let rollout = local.or_else(|| {
            self.shared
                .as_ref()
                .and_then(|_| lock(&self.shared_rollout).clone())
        });
        StatusView {
            active: active.version.to_string(),
            previous: st.history.last().map(|p| p.version.clone()),
            governance: self.enabled,
            approvers: self.approvers.iter().map(|a| a.name.clone()).collect(),
            audit: self.audit_head(),
            rollout,
            proposals: st
                .proposals
                .iter()
                .filter(|p| p.state.open())
                .map(|p| self.view_of(p, now_s, false))
                .collect(),
            overrides: self.override_views(),
            last_rollback: st.last_rollback.clone(),
            exceptions: super::view::ExceptionView::all(&active.graph, {
                let ms = crate::clock::unix_ms() as i64;
                crate::units::calendar::civil_at(ms, active.graph.timezone.as_ref()).date
            }),
        }
    }

    /// A governance step in flight (an activation, say) is seen whole or
    /// not at all: never the new version with the old history.
    pub async fn consistent_status(&self, gw: &impl Gateway) -> StatusView {
        self.refresh().await;
        let _consistent = self.step.lock().await;
        self.status_view(&gw.active())
    }

    /// Every proposal kept, briefly.
    pub fn proposal_views(&self) -> Vec<super::view::ProposalView> {
        let now_s = crate::clock::unix_s();
        let st = lock(&self.state);
        st.proposals
            .iter()
            .map(|p| self.view_of(p, now_s, false))
            .collect()
    }

    /// The proposal `id` in full, if kept.
    pub fn proposal_view(&self, id: &str) -> Option<super::view::ProposalView> {
        let st = lock(&self.state);
        st.proposals
            .iter()
            .find(|p| p.id == id)
            .map(|p| self.view_of(p, crate::clock::unix_s(), true))
    }
}
