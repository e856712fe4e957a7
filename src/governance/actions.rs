//! The operations behind the admin API: propose, revise, withdraw,
//! approve, roll back, and add or lift an override. Each returns a typed
//! result or an [`ActionError`] that knows its HTTP status; the server
//! only authenticates, parses and answers.

use super::activation::{ActivationError, Policy};
use super::approval::{self, Changes, Refusal, Subject};
use super::audit::AuditError;
use super::gateway::Gateway;
use super::gov::{Gov, GovState};
use super::keys::SignedApproval;
use super::lock;
use super::overrides::{Action as OverrideAction, NewOverride, Scope};
use super::proposal::{Kind, Proposal, State as PState};
use super::rollout::{Plan, Stage};
use super::runner::set_canary;
use super::state::{self as stored, Previous};
use super::view::{
    DryRunView, ImpactLine, OverrideView, ProposalView, RollbackView, TransitionLine,
};
use crate::diff::semantic::SemanticDiff;
use crate::graph::DecisionGraph;
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Why an admin operation changed nothing.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ActionError {
    #[error("no proposal `{0}`")]
    #[diagnostic(code(kiln::governance::not_found))]
    NoProposal(String),
    /// The proposal is closed; `what` says what may no longer happen.
    #[error("{id} is {state}, {what}")]
    #[diagnostic(code(kiln::governance::not_pending))]
    NotOpen {
        id: String,
        state: &'static str,
        what: &'static str,
    },
    #[error("only its proposer ({proposer}) may revise {id}")]
    #[diagnostic(code(kiln::governance::forbidden))]
    NotProposer { id: String, proposer: String },
    #[error("only its proposer ({proposer}){groups} may withdraw {id}")]
    #[diagnostic(
        code(kiln::governance::forbidden),
        help("ask the proposer to withdraw it; who else may is `[governance] withdraw_groups` in kiln.toml (approver groups)")
    )]
    NotWithdrawer {
        id: String,
        proposer: String,
        /// ", or a member of g1, g2" when groups may; empty otherwise.
        groups: String,
    },
    #[error("this is the active policy ({0})")]
    #[diagnostic(code(kiln::governance::unchanged))]
    Unchanged(String),
    /// Nothing changes unless it is audited first.
    #[error("the audit log cannot be written ({0}); nothing was changed")]
    #[diagnostic(code(kiln::governance::audit_unavailable))]
    AuditUnavailable(AuditError),
    /// The proposed policy does not compile or fit this gateway.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Invalid(#[from] ActivationError),
    /// The refusal's own code and help are in its `Diagnostic` (not
    /// forwarded: `Refusal::code` names the HTTP error code).
    #[error(transparent)]
    #[diagnostic(code(kiln::governance::approval_refused))]
    Approval(Refusal),
    #[error("no previous version to return to ({0} is the first this gateway ran)")]
    #[diagnostic(code(kiln::governance::no_previous))]
    NoPrevious(String),
    #[error("{0}; the active policy is unchanged")]
    #[diagnostic(code(kiln::governance::rollback_failed))]
    RollbackFailed(String),
    #[error("the active policy has no {scope} `{name}`")]
    #[diagnostic(code(kiln::governance::not_found))]
    UnknownTarget { scope: &'static str, name: String },
    #[error("no override on {scope} {name}")]
    #[diagnostic(code(kiln::governance::not_found))]
    NoOverride { scope: String, name: String },
    /// An override asked for longer than `[governance] max_override`.
    #[error("an override for `{asked}` is longer than this gateway allows ({max})")]
    #[diagnostic(
        code(kiln::governance::override_too_long),
        help("overrides are incident controls: ask for at most [governance] max_override (renew it when it ends), or change the policy through `kiln propose` for anything lasting")
    )]
    OverrideTooLong { asked: String, max: String },
    /// The system's random number generator failed (a proposal's nonce).
    #[error("cannot draw a random nonce for the proposal ({0}); nothing was changed")]
    #[diagnostic(code(kiln::governance::unavailable), help("try again"))]
    Random(super::keys::KeyError),
    /// The fleet's shared governance record could not be used: nothing
    /// was changed (or, for a step that could not be committed, nothing
    /// was recorded).
    #[error(transparent)]
    #[diagnostic(transparent)]
    Shared(#[from] super::shared::StepError),
    /// A request field out of range; `param` names it.
    #[error("{message}")]
    #[diagnostic(code(kiln::governance::bad_request))]
    BadRequest {
        message: String,
        param: Option<&'static str>,
    },
}

impl ActionError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> u16 {
        match self {
            ActionError::NoProposal(_)
            | ActionError::UnknownTarget { .. }
            | ActionError::NoOverride { .. } => 404,
            ActionError::NotOpen { .. }
            | ActionError::Unchanged(_)
            | ActionError::NoPrevious(_) => 409,
            ActionError::NotProposer { .. }
            | ActionError::NotWithdrawer { .. }
            | ActionError::OverrideTooLong { .. } => 403,
            ActionError::AuditUnavailable(_) | ActionError::Random(_) | ActionError::Shared(_) => {
                503
            }
            ActionError::Invalid(e) => e.status(),
            ActionError::Approval(r) => r.status(),
            ActionError::RollbackFailed(_) => 422,
            ActionError::BadRequest { .. } => 400,
        }
    }

    /// The error `code` of the answer, if it has one.
    pub fn code(&self) -> Option<&'static str> {
        Some(match self {
            ActionError::NoProposal(_)
            | ActionError::UnknownTarget { .. }
            | ActionError::NoOverride { .. } => "not_found",
            ActionError::NotOpen { .. } => "not_pending",
            ActionError::NotProposer { .. } | ActionError::NotWithdrawer { .. } => "forbidden",
            ActionError::Unchanged(_) => "unchanged",
            ActionError::AuditUnavailable(_) => "audit_unavailable",
            ActionError::OverrideTooLong { .. } => "override_too_long",
            ActionError::Random(_) => "unavailable",
            ActionError::Shared(e) => e.error_code(),
            ActionError::Approval(r) => r.code(),
            ActionError::NoPrevious(_) => "no_previous",
            ActionError::RollbackFailed(_) => "rollback_failed",
            ActionError::Invalid(_) | ActionError::BadRequest { .. } => return None,
        })
    }

    /// The request field at fault, if one is.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            ActionError::BadRequest { param, .. } => *param,
            _ => None,
        }
    }

    fn bad(message: String, param: &'static str) -> ActionError {
        ActionError::BadRequest {
            message,
            param: Some(param),
        }
    }
}

fn audited(r: Result<(), AuditError>) -> Result<(), ActionError> {
    r.map_err(ActionError::AuditUnavailable)
}

/// What `POST /admin/rollback` did.
pub enum RollbackOutcome {
    /// The rollout `id` in shadow or canary was aborted.
    Aborted {
        id: String,
        stage: Stage,
        view: RollbackView,
    },
    /// The previous version is active again.
    RolledBack(RollbackView),
    /// The policy in force wants approvals: a rollback proposal.
    Proposed(Box<ProposalView>),
}

/// The body of `POST /admin/overrides`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverrideRequest {
    pub scope: String,
    pub name: String,
    /// pause or throttle
    pub action: String,
    #[serde(default)]
    pub percent: Option<f64>,
    /// A kiln duration: `30m`, `1h`.
    #[serde(rename = "for")]
    pub duration: String,
    #[serde(default)]
    pub reason: Option<String>,
}

/// An override in force, and the one on the same target it replaced.
pub struct OverrideAdded {
    pub view: Option<OverrideView>,
    pub replaced: Option<u64>,
}

/// What a proposal reports: the semantic diff, what changed for the
/// approval rules, the approvals needed, the dry run and the rollout plan.
struct Assessment {
    semantic: SemanticDiff,
    changes: Changes,
    needs: Vec<approval::Need>,
    dry: Option<DryRunView>,
    plan: Plan,
}

/// Each admin operation is one governance step (with a shared store: one
/// fleet-wide step under its lease, see [`super::shared`]).
impl Gov {
    /// A proposal for `files` by `who`; the rollout runner starts it once approved.
    pub async fn propose(
        &self,
        gw: &impl Gateway,
        who: &str,
        files: BTreeMap<String, String>,
    ) -> Result<ProposalView, ActionError> {
        self.in_step(gw, self.propose_here(gw, who, files)).await
    }

    /// Replaces the text of proposal `id` (its proposer only); earlier
    /// approvals are void.
    pub async fn revise(
        &self,
        gw: &impl Gateway,
        who: &str,
        id: &str,
        files: BTreeMap<String, String>,
    ) -> Result<ProposalView, ActionError> {
        self.in_step(gw, self.revise_here(gw, who, id, files)).await
    }

    /// Withdraws the open proposal `id`.
    pub async fn withdraw(
        &self,
        gw: &impl Gateway,
        who: &str,
        id: &str,
    ) -> Result<ProposalView, ActionError> {
        self.in_step(gw, async { self.withdraw_here(gw, who, id) })
            .await
    }

    /// A signed approval of proposal `id`, submitted by `who`.
    pub async fn approve(
        &self,
        gw: &impl Gateway,
        who: &str,
        id: &str,
        a: &SignedApproval,
    ) -> Result<ProposalView, ActionError> {
        self.in_step(gw, self.approve_here(gw, who, id, a)).await
    }

    /// `kiln rollback` by `who`: abort a rollout in shadow or canary, or
    /// return to the previous version (directly, or through a rollback
    /// proposal when the policy in force wants approvals for it).
    pub async fn rollback(
        &self,
        gw: &impl Gateway,
        who: &str,
        reason: Option<String>,
    ) -> Result<RollbackOutcome, ActionError> {
        self.in_step(gw, self.rollback_here(gw, who, reason)).await
    }

    /// Pauses or throttles a tier or tenant of the active policy for a
    /// while, on `who`'s word. Overrides are this replica's (the audit
    /// chain records them for the fleet).
    pub async fn add_override(
        &self,
        gw: &impl Gateway,
        who: &str,
        req: OverrideRequest,
    ) -> Result<OverrideAdded, ActionError> {
        self.in_step(gw, async { self.add_override_here(gw, who, req) })
            .await
    }

    /// Lifts every override on `scope` `name`; their ids.
    pub async fn lift_override(
        &self,
        gw: &impl Gateway,
        who: &str,
        scope: &str,
        name: &str,
    ) -> Result<Vec<u64>, ActionError> {
        self.in_step(gw, async { self.lift_override_here(who, scope, name) })
            .await
    }

    async fn propose_here(
        &self,
        gw: &impl Gateway,
        who: &str,
        files: BTreeMap<String, String>,
    ) -> Result<ProposalView, ActionError> {
        let policy = gw.compile(&files)?;
        let active = gw.active();
        if policy.version == active.version {
            return Err(ActionError::Unchanged(active.version.to_string()));
        }
        let hash = super::policy_hash(&policy.sources);
        let policy = Arc::new(policy);
        let a = self.assess(gw, &active, policy.clone()).await;
        let now_s = crate::clock::unix_s();
        let nonce = super::keys::random_id().map_err(ActionError::Random)?;
        let view = {
            let mut st = lock(&self.state);
            let id = format!("p-{}", st.next);
            audited(self.audit(
                "proposal",
                who,
                json!({"id": id, "nonce": nonce, "gateway": self.gateway(), "hash": hash, "version": policy.version.as_ref(), "base": active.version.as_ref(),
                       "kinds": Changes::names(&a.changes.kinds), "escalations": Changes::names(&a.changes.escalations),
                       "needs": a.needs}),
            ))?;
            let p = Proposal {
                id,
                nonce,
                kind: Kind::Change,
                state: if a.needs.is_empty() {
                    PState::Approved
                } else {
                    PState::Pending
                },
                files,
                hash,
                version: policy.version.to_string(),
                base: active.version.to_string(),
                proposer: who.to_string(),
                created_unix_ms: crate::clock::unix_ms() as u64,
                revision: 1,
                changes: a.changes,
                semantic: a.semantic,
                needs: a.needs,
                approvals: Vec::new(),
                dry_run: a.dry,
                rollout: Some(a.plan),
                note: None,
            };
            st.next += 1;
            let v = self.view_of(&p, now_s, true);
            st.proposals.push(p);
            v
        };
        self.advance_inner(gw).await;
        Ok(self.proposal_view(&view.id).unwrap_or(view))
    }

    async fn revise_here(
        &self,
        gw: &impl Gateway,
        who: &str,
        id: &str,
        files: BTreeMap<String, String>,
    ) -> Result<ProposalView, ActionError> {
        self.check_revisable(who, id)?;
        let policy = gw.compile(&files)?;
        let active = gw.active();
        let hash = super::policy_hash(&policy.sources);
        let policy = Arc::new(policy);
        let a = self.assess(gw, &active, policy.clone()).await;
        {
            let mut st = lock(&self.state);
            let p = open_proposal(&mut st, id, "it can no longer be revised")?;
            audited(self.audit(
                "proposal_revised",
                who,
                json!({"id": id, "previous_hash": p.hash, "hash": hash, "version": policy.version.as_ref(),
                       "voided_approvals": p.approvals.iter().map(|a| a.approver.clone()).collect::<Vec<_>>(),
                       "needs": a.needs}),
            ))?;
            p.files = files;
            p.hash = hash;
            p.version = policy.version.to_string();
            p.base = active.version.to_string();
            p.revision += 1;
            p.changes = a.changes;
            p.semantic = a.semantic;
            p.state = if a.needs.is_empty() {
                PState::Approved
            } else {
                PState::Pending
            };
            p.needs = a.needs;
            p.approvals.clear();
            p.dry_run = a.dry;
            p.rollout = Some(a.plan);
            p.note = Some("revised: earlier approvals are void".into());
        }
        self.advance_inner(gw).await;
        self.proposal_view(id)
            .ok_or_else(|| ActionError::NoProposal(id.to_string()))
    }

    /// Before compiling a revision: the proposal exists, is `who`'s, and
    /// may still change.
    fn check_revisable(&self, who: &str, id: &str) -> Result<(), ActionError> {
        let st = lock(&self.state);
        match st.proposals.iter().find(|p| p.id == id) {
            None => Err(ActionError::NoProposal(id.to_string())),
            Some(p) if p.proposer != who => Err(ActionError::NotProposer {
                id: id.to_string(),
                proposer: p.proposer.clone(),
            }),
            Some(p) if !p.state.open() || p.kind != Kind::Change => Err(ActionError::NotOpen {
                id: id.to_string(),
                state: p.state.name(),
                what: "it can no longer be revised",
            }),
            Some(_) => Ok(()),
        }
    }

    fn withdraw_here(
        &self,
        gw: &impl Gateway,
        who: &str,
        id: &str,
    ) -> Result<ProposalView, ActionError> {
        let mut st = lock(&self.state);
        let p = open_proposal(&mut st, id, "not open")?;
        if !self.may_withdraw(who, &p.proposer) {
            return Err(ActionError::NotWithdrawer {
                id: id.to_string(),
                proposer: p.proposer.clone(),
                groups: if self.withdraw_groups.is_empty() {
                    String::new()
                } else {
                    format!(", or a member of {},", self.withdraw_groups.join(", "))
                },
            });
        }
        audited(self.audit("proposal_withdrawn", who, json!({"id": id, "hash": p.hash})))?;
        p.state = PState::Withdrawn;
        p.note = Some(format!("withdrawn by {who}"));
        let view = self.view_of(p, crate::clock::unix_s(), false);
        drop(st);
        self.persist(gw);
        Ok(view)
    }

    /// A proposal is its proposer's to withdraw, or a member's of one of
    /// `[governance] withdraw_groups` (as `[[approvers]]` list people's
    /// groups): an admin token alone does not let one person drop
    /// another's change.
    fn may_withdraw(&self, who: &str, proposer: &str) -> bool {
        who == proposer
            || self.approvers.iter().any(|a| {
                a.person == who && self.withdraw_groups.iter().any(|g| a.groups.contains(g))
            })
    }

    async fn approve_here(
        &self,
        gw: &impl Gateway,
        who: &str,
        id: &str,
        a: &SignedApproval,
    ) -> Result<ProposalView, ActionError> {
        let now_s = crate::clock::unix_s();
        let checked = {
            let mut st = lock(&self.state);
            let gateway = self.gateway();
            let GovState {
                proposals, used, ..
            } = &mut *st;
            let Some(p) = proposals.iter_mut().find(|p| p.id == id) else {
                return Err(ActionError::NoProposal(id.to_string()));
            };
            let checked = if p.state.open() {
                approval::check(
                    &self.approvers,
                    used,
                    &Subject {
                        target: p.target(&gateway),
                        hash: &p.hash,
                        proposer: &p.proposer,
                        approvals: &p.approvals,
                        now_s,
                        max_valid_s: self.approval_ttl_s,
                    },
                    a,
                )
            } else {
                Err(Refusal::NotPending {
                    proposal: p.id.clone(),
                    state: p.state.name().into(),
                })
            };
            match checked {
                Ok(acc) => {
                    audited(self.audit(
                        "approval",
                        &acc.approver,
                        json!({"id": p.id, "hash": p.hash, "approver": acc.approver, "groups": acc.groups,
                               "issued": acc.issued, "expires": acc.expires, "signature": acc.signature,
                               "submitted_by": who}),
                    ))?;
                    used.insert(acc.signature.clone());
                    p.approvals.push(acc);
                    if p.approved(now_s) {
                        p.state = PState::Approved;
                    }
                    Ok(())
                }
                Err(r) => {
                    self.audit_anyway(
                        "approval_refused",
                        who,
                        json!({"id": p.id, "approver": a.approver, "hash": a.hash, "code": r.code(), "reason": r.to_string()}),
                    );
                    Err(r)
                }
            }
        };
        match checked {
            Ok(()) => {
                gw.count_approval("accepted");
                self.advance_inner(gw).await;
                self.proposal_view(id)
                    .ok_or_else(|| ActionError::NoProposal(id.to_string()))
            }
            Err(r) => {
                gw.count_approval(r.code());
                Err(ActionError::Approval(r))
            }
        }
    }

    async fn rollback_here(
        &self,
        gw: &impl Gateway,
        who: &str,
        reason: Option<String>,
    ) -> Result<RollbackOutcome, ActionError> {
        let _one = self.step.lock().await;
        let now = self.now_ms();
        if let Some(aborting) = self.abortable() {
            return self.abort_rollout(gw, who, reason, aborting, now).await;
        }
        let active = gw.active();
        let Some(prev) = lock(&self.state).history.last().cloned() else {
            return Err(ActionError::NoPrevious(active.version.to_string()));
        };
        // A rollback touches the whole policy: its owner, where a rule
        // says `require owner for [rollback]`.
        let whole = crate::diff::semantic::SemanticDiff {
            changes: vec![crate::diff::semantic::Change {
                kind: crate::diff::semantic::ChangeOp::Changed,
                subject: "policy".into(),
                field: None,
                old: None,
                new: None,
                change_kind: crate::graph::ChangeKind::Rollback,
                escalation: false,
            }],
            decisions: Vec::new(),
        };
        let needs = self.needs_for(&active.graph, &whole, &Changes::rollback());
        if needs.is_empty() {
            self.roll_back_directly(gw, who, reason, &active).await
        } else {
            self.propose_rollback(gw, who, reason, &active, prev, needs)
        }
    }

    /// The rollout in shadow or canary, if any: aborting it needs no
    /// approval, since the active version never changed.
    fn abortable(&self) -> Option<(String, String, Stage)> {
        let st = lock(&self.state);
        if st.rollout.is_none() {
            // Run by another replica: it sees the proposal rolled back at
            // its next tick and ends its shadow or canary.
            return self
                .shared_rollout_stage()
                .filter(|(_, _, stage)| matches!(stage, Stage::Shadow | Stage::Canary));
        }
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
    }

    async fn abort_rollout(
        &self,
        gw: &impl Gateway,
        who: &str,
        reason: Option<String>,
        (id, version, stage): (String, String, Stage),
        now: f64,
    ) -> Result<RollbackOutcome, ActionError> {
        audited(self.audit(
            "rollback",
            who,
            json!({"id": id, "trigger": "manual", "stage": stage.name(), "from": version,
                   "to": gw.active().version.as_ref(), "reason": reason}),
        ))?;
        self.end_shadow();
        set_canary(gw, None).await;
        let view = manual_rollback(version, gw.active().version.to_string(), who);
        {
            let mut st = lock(&self.state);
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
        self.persist(gw);
        gw.count_rollback("manual");
        Ok(RollbackOutcome::Aborted { id, stage, view })
    }

    /// No approvals needed: the previous version, now.
    async fn roll_back_directly(
        &self,
        gw: &impl Gateway,
        who: &str,
        reason: Option<String>,
        active: &Policy,
    ) -> Result<RollbackOutcome, ActionError> {
        let to = match self.rollback_to_previous(gw).await {
            Ok(to) => to,
            Err(e) => {
                self.audit_anyway(
                    "rollback_failed",
                    who,
                    json!({"trigger": "manual", "from": active.version.as_ref(), "error": e}),
                );
                return Err(ActionError::RollbackFailed(e));
            }
        };
        let view = manual_rollback(active.version.to_string(), to.clone(), who);
        let elsewhere = self.shared_rollout_stage().map(|(id, _, _)| id);
        {
            let mut st = lock(&self.state);
            // A watch run by another replica ends too: it sees its
            // proposal rolled back at its next tick.
            if let Some(id) = st.rollout.take().map(|a| a.proposal).or(elsewhere) {
                if let Some(p) = st.proposals.iter_mut().find(|p| p.id == id) {
                    p.state = PState::RolledBack;
                    p.note = Some(format!("rolled back by {who}"));
                }
            }
            st.last_rollback = Some(view.clone());
        }
        self.persist(gw);
        gw.count_rollback("manual");
        self.audit_anyway(
            "rollback",
            who,
            json!({"trigger": "manual", "from": active.version.as_ref(), "to": to, "reason": reason, "approved": false}),
        );
        Ok(RollbackOutcome::RolledBack(view))
    }

    /// The rules of the policy in force want approvals: a rollback
    /// proposal, which the rollout runner carries out once approved.
    fn propose_rollback(
        &self,
        gw: &impl Gateway,
        who: &str,
        reason: Option<String>,
        active: &Policy,
        prev: Previous,
        needs: Vec<approval::Need>,
    ) -> Result<RollbackOutcome, ActionError> {
        let files = prev.files;
        let hash = stored::files_hash(&files);
        let nonce = super::keys::random_id().map_err(ActionError::Random)?;
        let view = {
            let mut st = lock(&self.state);
            let id = format!("p-{}", st.next);
            audited(self.audit(
                "proposal",
                who,
                json!({"id": id, "nonce": nonce, "gateway": self.gateway(), "kind": "rollback", "hash": hash, "version": prev.version,
                       "base": active.version.as_ref(), "kinds": ["rollback"], "needs": needs, "reason": reason}),
            ))?;
            st.next += 1;
            let p = Proposal {
                id,
                nonce,
                kind: Kind::Rollback,
                state: PState::Pending,
                files,
                hash,
                version: prev.version,
                base: active.version.to_string(),
                proposer: who.to_string(),
                created_unix_ms: crate::clock::unix_ms() as u64,
                revision: 1,
                changes: Changes::rollback(),
                semantic: SemanticDiff::default(),
                needs,
                approvals: Vec::new(),
                dry_run: None,
                rollout: None,
                note: reason.map(|r| format!("reason: {r}")),
            };
            let v = self.view_of(&p, crate::clock::unix_s(), true);
            st.proposals.push(p);
            v
        };
        self.persist(gw);
        Ok(RollbackOutcome::Proposed(Box::new(view)))
    }

    fn add_override_here(
        &self,
        gw: &impl Gateway,
        who: &str,
        req: OverrideRequest,
    ) -> Result<OverrideAdded, ActionError> {
        let Some(scope) = Scope::parse(&req.scope) else {
            return Err(ActionError::bad(
                format!("scope `{}` is neither tier nor tenant", req.scope),
                "scope",
            ));
        };
        let g = gw.active();
        let known = match scope {
            Scope::Tier => g.graph.tier_id(&req.name).is_some(),
            Scope::Tenant => g.graph.tenant_id(&req.name).is_some(),
        };
        if !known {
            return Err(ActionError::UnknownTarget {
                scope: scope.name(),
                name: req.name,
            });
        }
        let action = match (req.action.as_str(), req.percent) {
            ("pause", None) => OverrideAction::Pause,
            ("throttle", Some(p)) if p.is_finite() && (0.0..=100.0).contains(&p) => {
                OverrideAction::Throttle { percent: p }
            }
            ("throttle", _) => {
                return Err(ActionError::bad(
                    "a throttle needs `percent`, 0 to 100".into(),
                    "percent",
                ))
            }
            _ => {
                return Err(ActionError::bad(
                    format!("action `{}` is neither pause nor throttle", req.action),
                    "action",
                ))
            }
        };
        let Some(for_ms) = super::parse_duration_ms(&req.duration).filter(|d| *d > 0.0) else {
            return Err(ActionError::bad(
                format!(
                    "`for` = `{}` is not a positive duration (30m, 1h)",
                    req.duration
                ),
                "for",
            ));
        };
        if for_ms > self.max_override_ms {
            return Err(ActionError::OverrideTooLong {
                asked: req.duration,
                max: super::view::secs(self.max_override_ms / 1000.0),
            });
        }
        let now = self.now_ms();
        audited(self.audit(
            "override",
            who,
            json!({"scope": scope.name(), "name": req.name, "action": action.name(), "percent": req.percent,
                   "for": req.duration, "reason": req.reason}),
        ))?;
        let (o, replaced) = lock(&self.overrides).add(
            now,
            NewOverride {
                scope,
                name: &req.name,
                action,
                for_ms,
                by: who,
                reason: req.reason,
            },
        );
        self.any_override.store(true, Ordering::Relaxed);
        tracing::warn!(scope = scope.name(), name = %o.name, action = action.name(), by = %who, "override in force");
        Ok(OverrideAdded {
            view: self.override_views().into_iter().find(|v| v.id == o.id),
            replaced: replaced.map(|r| r.id),
        })
    }

    fn lift_override_here(
        &self,
        who: &str,
        scope: &str,
        name: &str,
    ) -> Result<Vec<u64>, ActionError> {
        let Some(sc) = Scope::parse(scope) else {
            return Err(ActionError::bad(
                format!("scope `{scope}` is neither tier nor tenant"),
                "scope",
            ));
        };
        let gone = lock(&self.overrides).lift(sc, name);
        if gone.is_empty() {
            return Err(ActionError::NoOverride {
                scope: scope.to_string(),
                name: name.to_string(),
            });
        }
        for o in &gone {
            self.audit_anyway(
                "override_lifted",
                who,
                json!({"id": o.id, "scope": scope, "name": name, "action": o.action.name(), "refused": o.refused}),
            );
        }
        Ok(gone.iter().map(|o| o.id).collect())
    }

    fn needs_for(
        &self,
        active: &DecisionGraph,
        semantic: &crate::diff::semantic::SemanticDiff,
        changes: &Changes,
    ) -> Vec<approval::Need> {
        if self.enabled {
            let mut n = approval::needs(&active.approvals, changes);
            n.extend(approval::owner_needs(active, semantic));
            n
        } else {
            Vec::new()
        }
    }

    /// Everything a proposal reports, computed off the request path.
    async fn assess(
        &self,
        gw: &impl Gateway,
        active: &Arc<Policy>,
        policy: Arc<Policy>,
    ) -> Assessment {
        let (old, new) = (active.graph.clone(), policy.graph.clone());
        let semantic =
            tokio::task::spawn_blocking(move || crate::diff::semantic::semantic(&old, &new))
                .await
                .unwrap_or_default();
        let changes = Changes::of(&semantic);
        let dry = self.dry_run(gw, active.clone(), policy.clone()).await;
        Assessment {
            needs: self.needs_for(&active.graph, &semantic, &changes),
            plan: Plan::of(&policy.graph, self.default_canary_ms, self.watch_ms),
            semantic,
            changes,
            dry: Some(dry),
        }
    }

    /// Replays the gateway's recent decision log under both versions.
    async fn dry_run(&self, gw: &impl Gateway, old: Arc<Policy>, new: Arc<Policy>) -> DryRunView {
        let Some(path) = gw.decision_log().await else {
            return DryRunView {
                note: Some(
                    "no decision log is configured ([log] or --log): no recorded traffic to replay"
                        .into(),
                ),
                ..DryRunView::default()
            };
        };
        let limit = self.dry_run_records.max(1);
        let cal = gw.calibration();
        let r = tokio::task::spawn_blocking(move || {
            replay_log(&path, limit, cal.as_ref(), &old.graph, &new.graph)
        })
        .await;
        r.unwrap_or_else(|e| DryRunView {
            note: Some(format!("the dry run failed: {e}")),
            ..DryRunView::default()
        })
    }
}

/// The proposal `id` if it may still change (`what` says how, for the
/// refusal).
fn open_proposal<'a>(
    st: &'a mut GovState,
    id: &str,
    what: &'static str,
) -> Result<&'a mut Proposal, ActionError> {
    let Some(p) = st.proposal_mut(id) else {
        return Err(ActionError::NoProposal(id.to_string()));
    };
    if !p.state.open() {
        return Err(ActionError::NotOpen {
            id: id.to_string(),
            state: p.state.name(),
            what,
        });
    }
    Ok(p)
}

fn manual_rollback(from: String, to: String, by: &str) -> RollbackView {
    RollbackView {
        at_unix_ms: crate::clock::unix_ms() as u64,
        from,
        to,
        trigger: "manual".into(),
        condition: None,
        observed: Vec::new(),
        by: by.to_string(),
    }
}

/// The most recent `limit` requests of the decision log at `path`, decided
/// (and, where the simulator can size the pools, served) under `old` and
/// `new`.
fn replay_log(
    path: &std::path::Path,
    limit: usize,
    cal: Option<&crate::backend::cost::Calibration>,
    old: &Arc<DecisionGraph>,
    new: &Arc<DecisionGraph>,
) -> DryRunView {
    let opts = crate::traffic::ReadOptions {
        skip_malformed: true,
    };
    let loaded = match crate::traffic::read_with(path, opts) {
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
        crate::backend::cost::CostModel::from_graph(old, cal),
        crate::backend::cost::CostModel::from_graph(new, cal),
    );
    let (co, cn) = match costs {
        (Ok(a), Ok(b)) => (a, b),
        _ => {
            let cfg = crate::sched::Config::default();
            let d = crate::diff::traffic::decisions(
                old,
                new,
                &recs,
                cfg.start_minute_of_day,
                cfg.start_weekday,
            );
            fill_decisions(&mut view, &d);
            view.note = Some("the simulator cannot size these pools: decisions only".into());
            return view;
        }
    };
    if let Some(dr) = crate::diff::dry_run(old, new, (&co, &cn), &recs, |_, _| {}) {
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
