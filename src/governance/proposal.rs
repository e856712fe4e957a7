//! A proposal: a policy text waiting for approvals, rolling out, or done.
//! Immutable text per revision: replacing the text (a new revision) gives
//! it a new hash and voids every approval it had.

use super::approval::{self, Accepted, Changes, Need, NeedStatus};
use super::view::{ApprovalLine, ChangeLine, DryRunView, ProposalView};
use crate::diff::semantic::SemanticDiff;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Waiting for approvals.
    Pending,
    /// Approved; starts rolling out when no other rollout runs.
    Approved,
    /// In shadow, canary or watch.
    Rolling,
    /// Active (its watch, if any, is over).
    Enforced,
    /// A rollback condition tripped, or an operator rolled it back.
    RolledBack,
    /// Activation failed; the last good policy kept serving.
    Refused,
    /// The active policy changed since it was proposed: propose again.
    Stale,
    Withdrawn,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Approved => "approved",
            State::Rolling => "rolling",
            State::Enforced => "enforced",
            State::RolledBack => "rolled_back",
            State::Refused => "refused",
            State::Stale => "stale",
            State::Withdrawn => "withdrawn",
        }
    }

    /// Still open: approvals may be added, it may start.
    pub fn open(self) -> bool {
        matches!(self, State::Pending | State::Approved)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A new policy text, rolled out as its rollout block says.
    Change,
    /// Back to the previous version, at once.
    Rollback,
}

#[derive(Debug, Clone)]
pub struct Proposal {
    pub id: String,
    /// Random, drawn when proposed: approvals sign it with the id.
    pub nonce: String,
    pub kind: Kind,
    pub state: State,
    pub files: BTreeMap<String, String>,
    /// Full SHA-256 (hex) of the files, what approvals sign.
    pub hash: String,
    /// `sha256:` and 12 hex digits, the gateway's version name.
    pub version: String,
    /// The active version when proposed (or last revised).
    pub base: String,
    pub proposer: String,
    pub created_unix_ms: u64,
    pub revision: u32,
    pub changes: Changes,
    pub semantic: SemanticDiff,
    pub needs: Vec<Need>,
    pub approvals: Vec<Accepted>,
    pub dry_run: Option<DryRunView>,
    pub rollout: Option<super::rollout::Plan>,
    pub note: Option<String>,
}

impl Proposal {
    /// What approvals of this proposal sign, on the gateway `gateway`.
    pub fn target<'a>(&'a self, gateway: &'a str) -> super::keys::Target<'a> {
        super::keys::Target {
            gateway,
            proposal: &self.id,
            nonce: &self.nonce,
        }
    }

    pub fn status(&self, now_s: u64) -> Vec<NeedStatus> {
        approval::evaluate(&self.needs, &self.approvals, now_s)
    }

    pub fn approved(&self, now_s: u64) -> bool {
        approval::satisfied(&self.status(now_s))
    }

    pub fn view(&self, now_s: u64, full: bool) -> ProposalView {
        let changes: Vec<ChangeLine> = self
            .semantic
            .changes
            .iter()
            .map(|c| ChangeLine {
                op: c.kind.name().to_string(),
                subject: c.subject.clone(),
                field: c.field.clone(),
                old: c.old.clone(),
                new: c.new.clone(),
                kind: c.change_kind.name().to_string(),
                escalation: c.escalation,
            })
            .collect();
        ProposalView {
            id: self.id.clone(),
            gateway: String::new(),
            nonce: self.nonce.clone(),
            kind: match self.kind {
                Kind::Change => "change".into(),
                Kind::Rollback => "rollback".into(),
            },
            state: self.state.name().into(),
            hash: self.hash.clone(),
            version: self.version.clone(),
            base: self.base.clone(),
            proposer: self.proposer.clone(),
            created_unix_ms: self.created_unix_ms,
            revision: self.revision,
            change_kinds: Changes::names(&self.changes.kinds),
            escalations: Changes::names(&self.changes.escalations),
            changes_total: changes.len(),
            changes: if full { changes } else { Vec::new() },
            decisions_changed: self.semantic.changed_requests(),
            needs: self.status(now_s),
            approvals: self
                .approvals
                .iter()
                .map(|a| ApprovalLine {
                    approver: a.approver.clone(),
                    groups: a.groups.clone(),
                    expires: a.expires,
                    valid: a.expires > now_s,
                })
                .collect(),
            dry_run: if full { self.dry_run.clone() } else { None },
            rollout: self.rollout.clone(),
            note: self.note.clone(),
        }
    }
}
