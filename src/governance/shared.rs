//! Governance kept in the fleet's shared store (`[state] redis`), so that
//! every replica sees the same proposals, approvals, used signatures,
//! rollback history and audit chain, and a replica that restarts loses
//! nothing.
//!
//! The store holds, under the fleet's namespace, the state snapshot at
//! `gov:state` (the state file's JSON, closed proposals included), the
//! audit chain's lines at `gov:audit` (the file's line format, the same
//! hash chain; the newest [`AUDIT_KEPT`] at most, the older ones stood for
//! by a checkpoint at `gov:audit:checkpoint`) with its head at
//! `gov:audit:head`, and the rollout in
//! progress as the replica running it last published it (`gov:rollout`,
//! short-lived).
//!
//! Every governance step (an admin action, a runner tick) is one
//! fleet-wide step: take the lease `gov` (waiting at most [`STEP_WAIT`]),
//! read what other replicas wrote since this one last looked (their audit
//! lines are verified link by link before they are taken), act, then
//! write the new state and the new audit lines in one script that refuses
//! unless this replica still holds the lease and the chain still ends
//! where it read it. A step that cannot be had or recorded changes
//! nothing and is refused (503): the chain is never forked locally.
//!
//! Rollouts run on one replica at a time, the holder of the lease
//! `gov-runner` (renewed every tick): a rollout's shadow and canary live
//! in that replica's executor and its stages run on that replica's clock.
//! Its live-metrics window (what rollback conditions read) and its
//! shadow counts are therefore that replica's traffic only. Overrides
//! (incident pauses and throttles) are the fleet's: every replica reads
//! the chain each tick and enforces an override another replica recorded
//! for what is left of it (its start is the entry's time), so all end it
//! together; only the runner records the expiry, once. A throttle's share
//! is each replica's own: a 10% throttle admits 10% on every replica. When the runner stops, another takes the lease
//! once it expires and settles the rollout it left, as a restart does
//! (`rollout_interrupted`).

use super::audit::{AuditLog, GENESIS};
use super::gateway::Gateway;
use super::gov::{Gov, GovState, HISTORY};
use super::lock;
use super::proposal::State as PState;
use super::rollout::Stage;
use super::runner::set_canary;
use super::state::Snapshot;
use super::view::RolloutView;
use crate::shared::{ChainCommit, Committed, Store};
use serde_json::json;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The lease a governance step holds: one writer over the fleet.
pub const STEP_LEASE: &str = "gov";
/// The lease of the replica that runs rollouts.
pub const RUNNER_LEASE: &str = "gov-runner";
/// Where the records live, under the fleet's namespace.
const PREFIX: &str = "gov";
/// How long a step waits for another replica's step to end before it is
/// refused: steps take milliseconds, so this only runs out when a replica
/// died holding the lease (it expires after `[state] lease`).
pub const STEP_WAIT: Duration = Duration::from_secs(2);
/// Between two tries for the lease.
const RETRY: Duration = Duration::from_millis(10);
/// The most audit lines the shared store keeps: over it, the oldest are
/// trimmed (to three quarters of it) and a checkpoint stands for them (how
/// many, the last one's hash, and what they told: the fleet's identity,
/// the highest proposal id, accepted signatures), so the chain kept still
/// verifies link by link from it and Redis's memory stays bounded. The
/// lines cut are kept nowhere else: a copy taken before (the head it ends
/// on is the checkpoint's) still verifies against it.
pub const AUDIT_KEPT: u64 = 10_000;

/// Why a fleet-wide governance step did not happen, or was not recorded.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StepError {
    #[error("another replica's governance step did not end within {0} s; nothing was changed")]
    #[diagnostic(
        code(kiln::governance::busy),
        help("retry after the Retry-After seconds; a replica that stopped inside a step frees the lease when `[state] lease` runs out")
    )]
    Busy(u64),
    #[error("governance is kept in the shared state store (Redis), which did not answer ({0}); nothing was changed: governance steps are refused rather than recorded apart from the fleet (requests are still served)")]
    #[diagnostic(
        code(kiln::governance::shared_unavailable),
        help("check that Redis is running and reachable from this replica, then retry")
    )]
    Unavailable(String),
    #[error("the shared governance record cannot be extended: {0}; nothing was changed")]
    #[diagnostic(
        code(kiln::governance::shared_broken),
        help("compare the chain with a head kept elsewhere (`kiln audit verify --head`); restore Redis from a copy, or give the fleet a new `[state] namespace` to start a new record")
    )]
    Broken(String),
    #[error("this governance step could not be recorded in the shared store ({0}); its audit entries were not written and its state changes are undone (an activation it made stays in force)")]
    #[diagnostic(
        code(kiln::governance::not_recorded),
        help("retry; `GET /admin/status` shows what the fleet recorded")
    )]
    NotRecorded(String),
}

impl StepError {
    /// The error `code` of the answer.
    pub fn error_code(&self) -> &'static str {
        match self {
            StepError::Busy(_) => "governance_busy",
            StepError::Unavailable(_) => "governance_unavailable",
            StepError::Broken(_) => "governance_record_broken",
            StepError::NotRecorded(_) => "governance_not_recorded",
        }
    }

    /// Seconds after which a retry may pass.
    pub fn retry_after_s(&self) -> u64 {
        1
    }
}

/// What this replica last read from or wrote to the shared store.
#[derive(Debug, Default)]
pub struct Synced {
    /// The state bytes it last read or wrote.
    state: Option<Vec<u8>>,
    /// The next read rebuilds the state whatever the bytes (a step was
    /// undone, so local state may differ from what the store holds).
    dirty: bool,
    /// The chain's length and head as last read or written.
    len: u64,
    head: Option<String>,
    /// Whether this replica published a rollout (so it deletes it when
    /// the rollout ends).
    published: bool,
}

impl Gov {
    /// Runs `f` as one governance step: with a shared store, under the
    /// fleet's lease, on the state other replicas left, and recorded
    /// there before the lease is given back.
    pub(super) async fn in_step<T, E: From<StepError>>(
        &self,
        gw: &impl Gateway,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let Some(store) = self.shared.clone() else {
            return f.await;
        };
        let _one = self.fleet_step.lock().await;
        take_lease(&store).await?;
        let r = self.step_held(gw, &store, f).await;
        if let Err(e) = store.unlease(STEP_LEASE).await {
            // It expires by itself after `[state] lease`.
            tracing::warn!(error = %e, "cannot give the governance lease back");
        }
        r
    }

    async fn step_held<T, E: From<StepError>>(
        &self,
        gw: &impl Gateway,
        store: &Store,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        self.sync(store).await?;
        self.ensure_identity();
        // The lease outlives a slow step (a dry run over a large decision
        // log): renewed while the step runs.
        let renew = async {
            let every = Duration::from_millis((store.lease_ms() / 3).max(50));
            loop {
                tokio::time::sleep(every).await;
                if !matches!(store.lease(STEP_LEASE, store.lease_ms()).await, Ok(true)) {
                    return;
                }
            }
        };
        tokio::pin!(f);
        tokio::pin!(renew);
        let r = tokio::select! {
            r = &mut f => Some(r),
            () = &mut renew => None,
        };
        let r = match r {
            Some(r) => r,
            // Lost the lease mid-step: finish, but the commit below is
            // refused and the step undone.
            None => f.await,
        };
        let lead = self.leading.load(Ordering::Relaxed);
        match (self.commit(gw, store, lead).await, r) {
            (Ok(()), r) => r,
            (Err(e), Ok(_)) => Err(e.into()),
            (Err(e), Err(refused)) => {
                tracing::error!(error = %e, "a refused governance step's audit entries could not be recorded");
                Err(refused)
            }
        }
    }

    /// Brings this replica's view of governance up to date with the
    /// shared store before answering a read (without the lease: it only
    /// reads). Where the store does not answer, the last view stands.
    pub async fn refresh(&self) {
        let Some(store) = self.shared.clone() else {
            return;
        };
        let _one = self.fleet_step.lock().await;
        if let Err(e) = self.sync(&store).await {
            tracing::debug!(error = %e, "governance read from this replica's last view");
        }
    }

    /// Takes (or renews) the runner's lease; whether this replica runs
    /// rollouts now.
    pub(super) async fn may_lead(&self, store: &Store) -> bool {
        let lead = matches!(store.lease(RUNNER_LEASE, store.lease_ms()).await, Ok(true));
        if self.leading.swap(lead, Ordering::Relaxed) != lead {
            tracing::info!(replica = %store.replica(), runs_rollouts = lead, "governance runner lease changed hands");
        }
        lead
    }

    /// This replica lost the runner's lease: the rollout it ran (if any)
    /// ends here; the replica that holds the lease now settles it.
    pub(super) async fn stop_running_here(&self, gw: &impl Gateway) {
        if lock(&self.state).rollout.is_none() {
            return;
        }
        let _one = self.fleet_step.lock().await;
        tracing::warn!("another replica runs rollouts now: the rollout run here ends here");
        self.end_local_rollout(gw).await;
    }

    async fn end_local_rollout(&self, gw: &impl Gateway) {
        let had = lock(&self.state).rollout.take().is_some();
        if had {
            self.end_shadow();
            set_canary(gw, None).await;
            self.recording.store(false, Ordering::Relaxed);
            lock(&self.live).clear();
        }
    }

    /// On the runner, after reading the store: a rollout another replica
    /// ended (aborted, rolled back) ends here too, and one a stopped
    /// runner left rolling is settled as a restart settles it.
    pub(super) async fn reconcile(&self, gw: &impl Gateway) {
        let (ended, running, foreign) = {
            let st = lock(&self.state);
            let running = st.rollout.as_ref().map(|a| a.proposal.clone());
            let ended = running.as_ref().is_some_and(|id| {
                !st.proposals
                    .iter()
                    .any(|p| &p.id == id && p.state == PState::Rolling)
            });
            let foreign = st
                .proposals
                .iter()
                .any(|p| p.state == PState::Rolling && Some(&p.id) != running.as_ref());
            (ended, running, foreign)
        };
        if ended {
            self.end_local_rollout(gw).await;
        }
        if foreign {
            let active = gw.active().version.to_string();
            let keep = running.filter(|_| !ended);
            self.settle_interrupted_except(&active, keep.as_deref());
        }
    }

    /// The rollout another replica runs, as it last published it: its
    /// proposal, version and stage.
    pub(super) fn shared_rollout_stage(&self) -> Option<(String, String, Stage)> {
        self.shared.as_ref()?;
        let r = lock(&self.shared_rollout).clone()?;
        let stage = [Stage::Shadow, Stage::Canary, Stage::Watch]
            .into_iter()
            .find(|s| s.name() == r.stage)?;
        Some((r.proposal, r.version, stage))
    }

    /// The first step on an empty store names the fleet's identity (which
    /// approvals sign) in the chain's first `gateway` entry.
    fn ensure_identity(&self) {
        if !lock(&self.gateway).is_empty() {
            return;
        }
        let g = match super::keys::random_id() {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "cannot draw the fleet's governance identity");
                return;
            }
        };
        self.audit_anyway(
            "gateway",
            "kiln",
            json!({"gateway": g, "note": "this fleet's identity: approvals sign it"}),
        );
        *lock(&self.gateway) = g;
    }

    /// Reads what the store holds since this replica last looked: new
    /// audit lines (each verified against the chain so far), the state
    /// when it changed, the published rollout.
    async fn sync(&self, store: &Store) -> Result<(), StepError> {
        // Only a step stages lines, and it commits or undoes them before
        // the next one: never reached, but never trusted.
        let staged = lock(&self.audit).has_staged();
        if staged {
            self.undo();
        }
        let start = lock(&self.audit).entries();
        let read = store
            .chain_read(PREFIX, start)
            .await
            .map_err(|e| StepError::Unavailable(e.to_string()))?;
        if read.len < start {
            return Err(StepError::Broken(format!(
                "the shared audit chain holds {} entries, fewer than the {start} this replica has seen: the store lost data (a Redis restarted without persistence?) or was edited",
                read.len
            )));
        }
        let gateway = {
            let mut a = lock(&self.audit);
            // The lines this replica has not read were trimmed: it goes on
            // from the checkpoint, and what follows must chain to it.
            if let Some(cp) = read.checkpoint.as_ref().filter(|cp| start < cp.entries) {
                let facts = serde_json::from_slice(&cp.extra)
                    .map_err(|e| StepError::Broken(format!("the audit chain's checkpoint: {e}")))?;
                a.resume_at(cp.entries, &cp.head, facts);
            }
            for l in &read.lines {
                a.absorb(l).map_err(|e| StepError::Broken(format!("{e}")))?;
            }
            // Incident controls another replica set are enforced here too.
            for l in &read.lines {
                self.follow_override(l);
            }
            let head = read.head.as_deref().unwrap_or(GENESIS);
            if a.entries() != read.len || a.head() != head {
                return Err(StepError::Broken(format!(
                    "the chain's recorded head ({} entries, {head}) is not where its lines lead ({} entries, {})",
                    read.len,
                    a.entries(),
                    a.head()
                )));
            }
            a.facts().gateway.clone()
        };
        if let Some(g) = gateway {
            let mut mine = lock(&self.gateway);
            if *mine != g {
                *mine = g;
            }
        }
        let adopt = {
            let mut s = lock(&self.synced);
            s.len = read.len;
            s.head = read.head.clone();
            let adopt = s.dirty || s.state != read.state;
            s.dirty = false;
            s.state = read.state.clone();
            adopt
        };
        if adopt {
            self.adopt(read.state.as_deref())?;
        }
        *lock(&self.shared_rollout) = read
            .side
            .as_deref()
            .and_then(|b| serde_json::from_slice::<RolloutView>(b).ok());
        Ok(())
    }

    /// An override another replica set or lifted (an audit entry read
    /// from the shared chain) takes effect here for what is left of it: its
    /// start is the entry's time, so every replica ends it together.
    fn follow_override(&self, line: &str) {
        use super::overrides::{Action, NewOverride, Scope};
        let Ok(e) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        let d = &e["details"];
        let (Some(scope), Some(name)) = (
            d["scope"].as_str().and_then(Scope::parse),
            d["name"].as_str(),
        ) else {
            return;
        };
        match e["kind"].as_str() {
            Some("override") => {
                let action = match (d["action"].as_str(), d["percent"].as_f64()) {
                    (Some("pause"), _) => Action::Pause,
                    (Some("throttle"), Some(p)) if (0.0..=100.0).contains(&p) => {
                        Action::Throttle { percent: p }
                    }
                    _ => return,
                };
                let Some(for_ms) = d["for"].as_str().and_then(super::parse_duration_ms) else {
                    return;
                };
                let at = e["at"].as_u64().unwrap_or(0) as f64;
                let passed = (crate::clock::unix_ms() - at).max(0.0) * self.speed();
                let left = for_ms.min(self.max_override_ms) - passed;
                if left <= 0.0 {
                    return;
                }
                let who = e["actor"].as_str().unwrap_or("kiln");
                let reason = d["reason"].as_str().map(String::from);
                lock(&self.overrides).add(
                    self.now_ms(),
                    NewOverride {
                        scope,
                        name,
                        action,
                        for_ms: left,
                        by: who,
                        reason,
                    },
                );
                self.any_override.store(true, Ordering::Relaxed);
                tracing::warn!(scope = scope.name(), name = %name, action = action.name(), by = %who, "override in force (set on another replica)");
            }
            Some("override_lifted") => {
                lock(&self.overrides).lift(scope, name);
            }
            _ => {}
        }
    }

    /// Takes the store's state as this replica's (the rollout this replica
    /// runs, if any, stays: the runner reconciles it).
    fn adopt(&self, bytes: Option<&[u8]>) -> Result<(), StepError> {
        let snap = match bytes {
            None => None,
            Some(b) => {
                let text = String::from_utf8_lossy(b);
                let path = std::path::Path::new("the shared governance state");
                Some(Snapshot::parse(path, &text).map_err(|e| StepError::Broken(e.to_string()))?)
            }
        };
        let gateway = self.gateway();
        let (highest, signatures) = {
            let a = lock(&self.audit);
            let f = a.facts();
            (f.highest_proposal, f.signatures.clone())
        };
        let mut fresh = match snap {
            None => GovState::default(),
            Some(snap) => {
                let (proposals, dropped) = snap.verify(&self.approvers, &gateway);
                for d in dropped {
                    tracing::warn!(dropped = ?d, "a proposal or approval in the shared state does not verify here: not taken");
                }
                let mut history = snap.history.clone();
                if history.len() > HISTORY {
                    history.drain(..history.len() - HISTORY);
                }
                let mut used: HashSet<String> = snap.used.iter().cloned().collect();
                for p in &proposals {
                    used.extend(p.approvals.iter().map(|a| a.signature.clone()));
                }
                GovState {
                    proposals,
                    next: snap.next,
                    rollout: None,
                    history,
                    used,
                    last_rollback: snap.last_rollback.clone(),
                }
            }
        };
        // What the chain recorded outlives the state: ids are never handed
        // out twice and accepted signatures never count again.
        fresh.next = fresh.next.max(highest.saturating_add(1)).max(1);
        fresh.used.extend(signatures);
        let mut st = lock(&self.state);
        fresh.rollout = st.rollout.take();
        *st = fresh;
        Ok(())
    }

    /// Forgets what a step did locally: the next read takes the store's
    /// chain and state again from the start.
    fn undo(&self) {
        *lock(&self.audit) = AuditLog::shared();
        let mut s = lock(&self.synced);
        s.dirty = true;
        s.state = None;
        s.len = 0;
        s.head = None;
    }

    /// Writes the step's audit lines and the new state (and, on the
    /// runner, the rollout in progress) in one script; undone locally if
    /// the store refuses it.
    async fn commit(&self, gw: &impl Gateway, store: &Store, lead: bool) -> Result<(), StepError> {
        let (lines, new_head, facts) = {
            let mut a = lock(&self.audit);
            let facts = serde_json::to_vec(a.facts()).unwrap_or_default();
            (a.take_staged(), a.head().to_string(), facts)
        };
        let bytes = self.snapshot(gw, true).to_bytes();
        let (expected_len, expected_head, changed, published) = {
            let s = lock(&self.synced);
            (
                s.len,
                s.head.clone(),
                s.state.as_deref() != Some(&bytes[..]),
                s.published,
            )
        };
        let side = if lead {
            let running = lock(&self.state)
                .rollout
                .as_ref()
                .is_some_and(|a| !a.machine.done());
            if running {
                let view = self.status_view(&gw.active()).rollout;
                Some(view.and_then(|v| serde_json::to_vec(&v).ok()))
            } else if published {
                Some(None)
            } else {
                None
            }
        } else {
            None
        };
        if lines.is_empty() && !changed && side.is_none() {
            return Ok(());
        }
        let n = lines.len() as u64;
        let commit = ChainCommit {
            expected_len,
            expected_head,
            lines,
            new_head: new_head.clone(),
            state: changed.then(|| bytes.clone()),
            side: side.clone(),
            // Vanishes when the runner stops publishing it.
            side_ms: store.lease_ms(),
            keep: AUDIT_KEPT,
            // What the trimmed lines told (every line's, a superset).
            checkpoint_extra: facts,
        };
        let why = match store.chain_commit(PREFIX, STEP_LEASE, &commit).await {
            Ok(Committed::Written) => {
                let mut s = lock(&self.synced);
                if n > 0 {
                    s.len += n;
                    s.head = Some(new_head);
                }
                s.state = Some(bytes);
                if let Some(side) = side {
                    s.published = side.is_some();
                }
                return Ok(());
            }
            Ok(Committed::NotHeld) => "this replica no longer held the governance lease".into(),
            Ok(Committed::Moved) => "the shared chain moved since this step read it".into(),
            Err(e) => e.to_string(),
        };
        tracing::error!(error = %why, "a governance step could not be recorded: undone here");
        self.undo();
        Err(StepError::NotRecorded(why))
    }
}

/// The governance lease, waiting at most [`STEP_WAIT`] for another
/// replica's step to end.
async fn take_lease(store: &Store) -> Result<(), StepError> {
    let until = tokio::time::Instant::now() + STEP_WAIT;
    loop {
        match store.lease(STEP_LEASE, store.lease_ms()).await {
            Ok(true) => return Ok(()),
            Ok(false) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(RETRY).await;
            }
            Ok(false) => return Err(StepError::Busy(STEP_WAIT.as_secs())),
            Err(e) => return Err(StepError::Unavailable(e.to_string())),
        }
    }
}
