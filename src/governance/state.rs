//! The governance state that outlives a restart: open, approved and stale
//! proposals (text, hash, approvals with their signatures), the proposal id
//! counter and the versions `kiln rollback` returns to.
//!
//! Kept as one JSON file (`[governance] state`, by default beside the audit
//! log), rewritten atomically after every governance step that changes it.
//! Loading never trusts the file: each proposal's hash is recomputed from
//! its text and every approval's signature is checked again under the
//! approvers configured now (see [`Snapshot::verify`]).

use super::approval::{Accepted, Approver, Changes, Need};
use super::keys::{self, SignedApproval};
use super::proposal::{Kind, Proposal, State};
use super::view::{DryRunView, RollbackView};
use crate::diff::semantic::{Change, ChangeOp, DecisionChange, SemanticDiff};
use crate::graph::ChangeKind;
use crate::source::SourceMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file format's version.
pub const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StateError {
    #[error("cannot read the governance state file {path}: {message}")]
    #[diagnostic(
        code(kiln::governance::state_io),
        help("check the path and its permissions; `[governance] state` in kiln.toml names it")
    )]
    Io { path: String, message: String },
    #[error("the governance state file {path} is corrupt ({message}); move it aside (e.g. `mv {path} {path}.corrupt`) and start again: open proposals and the rollback history start empty, the audit log keeps their record")]
    #[diagnostic(
        code(kiln::governance::state_corrupt),
        help("move the file aside (e.g. `mv {path} {path}.corrupt`) and restart the gateway; keep it to inspect")
    )]
    Corrupt { path: String, message: String },
    #[error("cannot write the governance state file {path}: {message}")]
    #[diagnostic(code(kiln::governance::state_write))]
    Write { path: String, message: String },
}

/// A version that was active before, as `kiln rollback` needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Previous {
    pub version: String,
    pub files: BTreeMap<String, String>,
}

/// One change of a proposal's semantic diff.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredChange {
    op: String,
    subject: String,
    field: Option<String>,
    old: Option<String>,
    new: Option<String>,
    change_kind: String,
    escalation: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredDecision {
    request: String,
    field: String,
    old: String,
    new: String,
}

/// A proposal as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredProposal {
    id: String,
    /// The random nonce approvals sign (empty in files written before it
    /// existed: such a proposal's approvals no longer verify).
    #[serde(default)]
    nonce: String,
    kind: Kind,
    state: State,
    files: BTreeMap<String, String>,
    hash: String,
    version: String,
    base: String,
    proposer: String,
    created_unix_ms: u64,
    revision: u32,
    change_kinds: Vec<String>,
    escalations: Vec<String>,
    changes: Vec<StoredChange>,
    decisions: Vec<StoredDecision>,
    needs: Vec<Need>,
    approvals: Vec<Accepted>,
    dry_run: Option<DryRunView>,
    rollout: Option<super::rollout::Plan>,
    note: Option<String>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    pub format: u32,
    /// The next proposal id's number.
    pub next: u64,
    pub proposals: Vec<StoredProposal>,
    /// Versions active before, most recent last.
    pub history: Vec<Previous>,
    /// The version active when this was written.
    pub active: Option<Previous>,
    /// Signatures of accepted approvals, never accepted twice.
    pub used: Vec<String>,
    pub last_rollback: Option<RollbackView>,
}

/// What loading dropped, for the log and the audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// The proposal's text does not hash to its recorded hash.
    Proposal {
        id: String,
        stored: String,
        actual: String,
    },
    /// An approval whose signature no longer verifies (its approver was
    /// removed, or their key changed).
    Approval { id: String, approver: String },
    /// A proposal whose stored fields cannot be rebuilt.
    Unreadable { id: String, why: String },
}

/// The full SHA-256 of a set of policy files, as [`super::policy_hash`]
/// computes it for the policy compiled from them.
pub fn files_hash(files: &BTreeMap<String, String>) -> String {
    let mut s = SourceMap::new();
    for (name, text) in files {
        s.add(name.clone(), text.clone());
    }
    super::policy_hash(&s)
}

/// The state file for an audit log at `audit`: `<audit>.state.json`.
pub fn default_path(audit: &Path) -> PathBuf {
    let mut s = audit.as_os_str().to_owned();
    s.push(".state.json");
    PathBuf::from(s)
}

fn op_of(name: &str) -> Option<ChangeOp> {
    [
        ChangeOp::Added,
        ChangeOp::Removed,
        ChangeOp::Changed,
        ChangeOp::Moved,
    ]
    .into_iter()
    .find(|o| o.name() == name)
}

fn kind_of(name: &str) -> Option<ChangeKind> {
    ChangeKind::ALL.into_iter().find(|k| k.name() == name)
}

fn kinds_of(names: &[String]) -> Result<std::collections::BTreeSet<ChangeKind>, String> {
    names
        .iter()
        .map(|n| kind_of(n).ok_or_else(|| format!("unknown change kind `{n}`")))
        .collect()
}

impl StoredProposal {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn of(p: &Proposal) -> StoredProposal {
        StoredProposal {
            id: p.id.clone(),
            nonce: p.nonce.clone(),
            kind: p.kind,
            state: p.state,
            files: p.files.clone(),
            hash: p.hash.clone(),
            version: p.version.clone(),
            base: p.base.clone(),
            proposer: p.proposer.clone(),
            created_unix_ms: p.created_unix_ms,
            revision: p.revision,
            change_kinds: Changes::names(&p.changes.kinds),
            escalations: Changes::names(&p.changes.escalations),
            changes: p
                .semantic
                .changes
                .iter()
                .map(|c| StoredChange {
                    op: c.kind.name().into(),
                    subject: c.subject.clone(),
                    field: c.field.clone(),
                    old: c.old.clone(),
                    new: c.new.clone(),
                    change_kind: c.change_kind.name().into(),
                    escalation: c.escalation,
                })
                .collect(),
            decisions: p
                .semantic
                .decisions
                .iter()
                .map(|d| StoredDecision {
                    request: d.request.clone(),
                    field: d.field.clone(),
                    old: d.old.clone(),
                    new: d.new.clone(),
                })
                .collect(),
            needs: p.needs.clone(),
            approvals: p.approvals.clone(),
            dry_run: p.dry_run.clone(),
            rollout: p.rollout.clone(),
            note: p.note.clone(),
        }
    }

    /// The proposal, or why its fields cannot be rebuilt.
    pub fn proposal(&self) -> Result<Proposal, String> {
        let changes = self
            .changes
            .iter()
            .map(|c| {
                Ok(Change {
                    kind: op_of(&c.op).ok_or_else(|| format!("unknown change `{}`", c.op))?,
                    subject: c.subject.clone(),
                    field: c.field.clone(),
                    old: c.old.clone(),
                    new: c.new.clone(),
                    change_kind: kind_of(&c.change_kind)
                        .ok_or_else(|| format!("unknown change kind `{}`", c.change_kind))?,
                    escalation: c.escalation,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let decisions = self
            .decisions
            .iter()
            .map(|d| DecisionChange {
                request: d.request.clone(),
                field: d.field.clone(),
                old: d.old.clone(),
                new: d.new.clone(),
            })
            .collect();
        Ok(Proposal {
            id: self.id.clone(),
            nonce: self.nonce.clone(),
            kind: self.kind,
            state: self.state,
            files: self.files.clone(),
            hash: self.hash.clone(),
            version: self.version.clone(),
            base: self.base.clone(),
            proposer: self.proposer.clone(),
            created_unix_ms: self.created_unix_ms,
            revision: self.revision,
            changes: Changes {
                kinds: kinds_of(&self.change_kinds)?,
                escalations: kinds_of(&self.escalations)?,
            },
            semantic: SemanticDiff { changes, decisions },
            needs: self.needs.clone(),
            approvals: self.approvals.clone(),
            dry_run: self.dry_run.clone(),
            rollout: self.rollout.clone(),
            note: self.note.clone(),
        })
    }
}

/// Proposals worth keeping across a restart: open or stale ones, and the
/// one rolling out (a restart records what became of it).
pub fn kept(p: &Proposal) -> bool {
    p.state.open() || matches!(p.state, State::Stale | State::Rolling)
}

impl Snapshot {
    /// The stored proposals that still hold, with their approvals checked
    /// again under `approvers` (groups as configured now) for the gateway
    /// `gateway`, and what was dropped.
    pub fn verify(&self, approvers: &[Approver], gateway: &str) -> (Vec<Proposal>, Vec<Dropped>) {
        let mut out = Vec::new();
        let mut dropped = Vec::new();
        for s in &self.proposals {
            let actual = files_hash(&s.files);
            if actual != s.hash {
                dropped.push(Dropped::Proposal {
                    id: s.id.clone(),
                    stored: s.hash.clone(),
                    actual,
                });
                continue;
            }
            let mut p = match s.proposal() {
                Ok(p) => p,
                Err(why) => {
                    dropped.push(Dropped::Unreadable {
                        id: s.id.clone(),
                        why,
                    });
                    continue;
                }
            };
            let (id, hash, nonce) = (p.id.clone(), p.hash.clone(), p.nonce.clone());
            let target = keys::Target {
                gateway,
                proposal: &id,
                nonce: &nonce,
            };
            p.approvals.retain_mut(|a| {
                let signed = SignedApproval {
                    approver: a.approver.clone(),
                    hash: hash.clone(),
                    issued: a.issued,
                    expires: a.expires,
                    signature: a.signature.clone(),
                };
                match approvers.iter().find(|r| r.name == a.approver) {
                    Some(r) if keys::verify(&r.key, &target, &signed) => {
                        a.groups = r.groups.clone();
                        true
                    }
                    _ => {
                        dropped.push(Dropped::Approval {
                            id: id.clone(),
                            approver: a.approver.clone(),
                        });
                        false
                    }
                }
            });
            out.push(p);
        }
        (out, dropped)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Snapshot, StateError> {
        let corrupt = |message: String| StateError::Corrupt {
            path: path.display().to_string(),
            message,
        };
        let s: Snapshot = serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))?;
        if s.format != FORMAT {
            return Err(corrupt(format!(
                "format {} is not {FORMAT}, the one this kiln writes",
                s.format
            )));
        }
        Ok(s)
    }

    /// The snapshot at `path`; `None` when there is no file yet.
    pub fn load(path: &Path) -> Result<Option<Snapshot>, StateError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Snapshot::parse(path, &text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StateError::Io {
                path: path.display().to_string(),
                message: e.to_string(),
            }),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        // Plain data (strings, numbers, maps with string keys): this
        // cannot fail; an empty file would read as corrupt, never as
        // empty state.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }
}

/// Writes `bytes` to `path` atomically: `PATH.tmp`, fsync, rename (and the
/// directory fsynced where the platform allows).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let fail = |e: std::io::Error| StateError::Write {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp).map_err(fail)?;
        f.write_all(bytes).map_err(fail)?;
        f.sync_all().map_err(fail)?;
    }
    std::fs::rename(&tmp, path).map_err(fail)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governance::approval::Approver;
    use ed25519_dalek::SigningKey;

    const GW: &str = "gw";

    fn approver(name: &str, seed: u8) -> (Approver, SigningKey) {
        let k = SigningKey::from_bytes(&[seed; 32]);
        (
            Approver {
                name: name.into(),
                person: name.into(),
                groups: vec!["platform".into()],
                key: k.verifying_key(),
            },
            k,
        )
    }

    fn proposal(approvals: &[(&str, &SigningKey)]) -> Proposal {
        let files = BTreeMap::from([("p.kiln".to_string(), "pool p {}".to_string())]);
        let hash = files_hash(&files);
        Proposal {
            id: "p-3".into(),
            nonce: "n3".into(),
            kind: Kind::Change,
            state: State::Pending,
            files,
            hash: hash.clone(),
            version: format!("sha256:{}", &hash[..12]),
            base: "sha256:000000000000".into(),
            proposer: "ops".into(),
            created_unix_ms: 1_700_000_000_000,
            revision: 2,
            changes: Changes {
                kinds: [ChangeKind::PriorityIncrease, ChangeKind::TierChange].into(),
                escalations: [ChangeKind::PriorityIncrease].into(),
            },
            semantic: SemanticDiff {
                changes: vec![Change {
                    kind: ChangeOp::Changed,
                    subject: "tier low".into(),
                    field: Some("priority".into()),
                    old: Some("10".into()),
                    new: Some("50".into()),
                    change_kind: ChangeKind::PriorityIncrease,
                    escalation: true,
                }],
                decisions: vec![DecisionChange {
                    request: "tenant=beta".into(),
                    field: "tier".into(),
                    old: "low".into(),
                    new: "high".into(),
                }],
            },
            needs: vec![Need {
                count: 1,
                group: "platform".into(),
                kinds: vec!["any".into()],
                rule: "require 1 from \"platform\" for [any]".into(),
                source: "policy".into(),
            }],
            approvals: approvals
                .iter()
                .map(|(name, k)| {
                    let t = keys::Target {
                        gateway: GW,
                        proposal: "p-3",
                        nonce: "n3",
                    };
                    let s = keys::sign(k, &t, &hash, name, 100, 4_000_000_000);
                    Accepted {
                        approver: s.approver,
                        groups: vec!["platform".into()],
                        issued: s.issued,
                        expires: s.expires,
                        signature: s.signature,
                    }
                })
                .collect(),
            dry_run: None,
            rollout: None,
            note: Some("revised".into()),
        }
    }

    fn snapshot(p: &Proposal) -> Snapshot {
        Snapshot {
            format: FORMAT,
            next: 4,
            proposals: vec![StoredProposal::of(p)],
            history: vec![Previous {
                version: "sha256:000000000000".into(),
                files: BTreeMap::from([("a.kiln".into(), "pool a {}".into())]),
            }],
            active: None,
            used: p.approvals.iter().map(|a| a.signature.clone()).collect(),
            last_rollback: None,
        }
    }

    #[test]
    fn a_snapshot_round_trips_through_json() {
        let (alice, ka) = approver("alice", 1);
        let p = proposal(&[("alice", &ka)]);
        let s = snapshot(&p);
        let path = Path::new("state.json");
        let back = Snapshot::parse(path, &String::from_utf8(s.to_bytes()).unwrap()).unwrap();
        assert_eq!(back, s);
        let (ps, dropped) = back.verify(&[alice], GW);
        assert!(dropped.is_empty(), "{dropped:?}");
        assert_eq!(ps.len(), 1);
        let q = &ps[0];
        assert_eq!(q.approvals, p.approvals);
        assert_eq!(q.changes, p.changes);
        assert_eq!(q.semantic, p.semantic);
        assert_eq!(q.view(200, true), p.view(200, true));
        assert!(q.approved(200));
    }

    #[test]
    fn edited_text_drops_the_proposal() {
        let (alice, ka) = approver("alice", 1);
        let mut s = snapshot(&proposal(&[("alice", &ka)]));
        s.proposals[0]
            .files
            .insert("p.kiln".into(), "pool q {}".into());
        let (ps, dropped) = s.verify(&[alice], GW);
        assert!(ps.is_empty());
        assert!(matches!(&dropped[..], [Dropped::Proposal { id, .. }] if id == "p-3"));
    }

    #[test]
    fn approvals_of_removed_or_rekeyed_approvers_are_dropped() {
        let (alice, ka) = approver("alice", 1);
        let (bob, kb) = approver("bob", 2);
        let s = snapshot(&proposal(&[("alice", &ka), ("bob", &kb)]));
        // bob removed; alice's key replaced.
        let (alice2, _) = approver("alice", 7);
        let (ps, dropped) = s.verify(&[alice2], GW);
        assert_eq!(ps.len(), 1);
        assert!(ps[0].approvals.is_empty());
        assert_eq!(dropped.len(), 2);
        let (ps, dropped) = s.verify(&[alice, bob.clone()], GW);
        assert!(dropped.is_empty());
        assert_eq!(ps[0].approvals.len(), 2);
        let (ps, _) = s.verify(&[bob], GW);
        assert_eq!(ps[0].approvals.len(), 1);
        assert_eq!(ps[0].approvals[0].approver, "bob");
    }

    #[test]
    fn corrupt_files_are_errors_not_panics() {
        let path = Path::new("/x/state.json");
        for text in [
            "",
            "{",
            "[]",
            "{\"format\": 1}",
            "{\"format\": 99, \"next\": 1, \"proposals\": [], \"history\": [], \"active\": null, \"used\": [], \"last_rollback\": null}",
        ] {
            let e = Snapshot::parse(path, text).unwrap_err();
            assert!(matches!(e, StateError::Corrupt { .. }), "{text}: {e}");
            let help = miette::Diagnostic::help(&e).unwrap().to_string();
            assert!(help.contains("move the file aside"), "{help}");
        }
        let mut s = snapshot(&proposal(&[]));
        s.proposals[0].change_kinds = vec!["made_up".into()];
        let (ps, dropped) = s.verify(&[], GW);
        assert!(ps.is_empty());
        assert!(matches!(&dropped[..], [Dropped::Unreadable { .. }]));
    }

    #[test]
    fn writes_are_atomic_and_the_default_sits_beside_the_audit_log() {
        assert_eq!(
            default_path(Path::new("/var/lib/kiln/audit.jsonl")),
            Path::new("/var/lib/kiln/audit.jsonl.state.json")
        );
        let d = std::env::temp_dir().join(format!("kiln-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("s.json");
        assert!(Snapshot::load(&path).unwrap().is_none());
        let s = snapshot(&proposal(&[]));
        write_atomic(&path, &s.to_bytes()).unwrap();
        assert!(!d.join("s.json.tmp").exists());
        assert_eq!(Snapshot::load(&path).unwrap(), Some(s));
        let _ = std::fs::remove_dir_all(&d);
    }
}
