//! Which approvals a change needs, and whether an approval counts.
//!
//! The requirement comes from the approval rules of the policy **in
//! force**, never from the proposal: a proposal that rewrites or removes the
//! approval block is judged by the rules it would replace.
//!
//! * A rule applies when it lists `any`, or a change kind the semantic diff
//!   (active → proposed) found. Every applicable rule must be met on its
//!   own: `count` distinct approvers of its group. One approver in two
//!   groups counts for both.
//! * No approval block in force: one approval from any configured approver
//!   (kiln's default).
//! * Escalations (a priority, quota or preemption right raised, as the
//!   semantic diff marks them) and approval-rule changes that no rule names
//!   explicitly need two distinct approvers from any group (kiln's floor),
//!   on top of the `any` rules. So an escalation never passes with the
//!   ordinary approvals alone.
//! * A rollback (`kiln rollback`) is the change kind `rollback`; rules that
//!   list it, or `any`, apply.
//!
//! An approval counts when its signature verifies under the named
//! approver's configured key, for this proposal id and this exact hash,
//! within its validity window (not expired, not issued in the future, not
//! valid for longer than the server allows), from an approver who is not
//! the proposer and has not approved this proposal already, and the
//! signature was never presented before.

use super::keys::{self, SignedApproval};
use crate::diff::semantic::SemanticDiff;
use crate::graph::{ApprovalRule, ChangeKind, DecisionGraph, Owner};
use ed25519_dalek::VerifyingKey;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashSet};

/// Clock difference tolerated between an approver and the server.
pub const CLOCK_SKEW_S: u64 = 300;

/// Any configured approver, whatever their groups.
pub const ANY_GROUP: &str = "*";

/// A configured approver.
#[derive(Debug, Clone, PartialEq)]
pub struct Approver {
    pub name: String,
    /// The person the key belongs to (`person` in `[[approvers]]`, by
    /// default the name): never counted as an approver of their own
    /// proposal, whatever token they proposed with.
    pub person: String,
    pub groups: Vec<String>,
    pub key: VerifyingKey,
}

impl Approver {
    pub fn in_group(&self, group: &str) -> bool {
        group == ANY_GROUP || self.groups.iter().any(|g| g == group)
    }
}

/// The change kinds of a proposal, and those of them that escalate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub kinds: BTreeSet<ChangeKind>,
    pub escalations: BTreeSet<ChangeKind>,
}

impl Changes {
    pub fn of(diff: &SemanticDiff) -> Changes {
        let mut c = Changes::default();
        for ch in &diff.changes {
            c.kinds.insert(ch.change_kind);
            if ch.escalation {
                c.escalations.insert(ch.change_kind);
            }
        }
        c
    }

    pub fn rollback() -> Changes {
        Changes {
            kinds: BTreeSet::from([ChangeKind::Rollback]),
            escalations: BTreeSet::new(),
        }
    }

    pub fn names(set: &BTreeSet<ChangeKind>) -> Vec<String> {
        set.iter().map(|k| k.name().to_string()).collect()
    }
}

/// One requirement: `count` distinct approvers from `group`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Need {
    pub count: u32,
    /// The approvers' group; `*` is any configured approver.
    pub group: String,
    /// The change kinds of this proposal the requirement covers.
    pub kinds: Vec<String>,
    /// The rule as the policy in force writes it, or kiln's default.
    pub rule: String,
    /// `policy` (a rule of the policy in force) or `default` (kiln's).
    pub source: String,
}

fn rule_text(r: &ApprovalRule) -> String {
    let kinds: Vec<&str> = r.kinds.iter().map(|k| k.name()).collect();
    if r.owner {
        return format!("require owner for [{}]", kinds.join(", "));
    }
    format!(
        "require {} from \"{}\" for [{}]",
        r.count,
        r.group,
        kinds.join(", ")
    )
}

/// The approvals a change needs under the rules of the policy in force.
pub fn needs(rules: &[ApprovalRule], changes: &Changes) -> Vec<Need> {
    let mut out = Vec::new();
    let all: Vec<String> = if changes.kinds.is_empty() {
        vec![ChangeKind::Any.name().to_string()]
    } else {
        Changes::names(&changes.kinds)
    };
    if rules.is_empty() {
        out.push(Need {
            count: 1,
            group: ANY_GROUP.into(),
            kinds: all.clone(),
            rule: "require 1 from any approver (kiln's default: the policy in force has no approval block)".into(),
            source: "default".into(),
        });
    }
    for r in rules.iter().filter(|r| !r.owner) {
        let covered: Vec<String> = if r.kinds.contains(&ChangeKind::Any) {
            all.clone()
        } else {
            changes
                .kinds
                .iter()
                .filter(|k| r.kinds.contains(k))
                .map(|k| k.name().to_string())
                .collect()
        };
        if covered.is_empty() {
            continue;
        }
        out.push(Need {
            count: r.count,
            group: r.group.clone(),
            kinds: covered,
            rule: rule_text(r),
            source: "policy".into(),
        });
    }
    let mut sensitive = changes.escalations.clone();
    if changes.kinds.contains(&ChangeKind::ApprovalChange) {
        sensitive.insert(ChangeKind::ApprovalChange);
    }
    let unnamed: BTreeSet<ChangeKind> = sensitive
        .into_iter()
        .filter(|k| !rules.iter().any(|r| !r.owner && r.kinds.contains(k)))
        .collect();
    if !unnamed.is_empty() {
        out.push(Need {
            count: 2,
            group: ANY_GROUP.into(),
            kinds: Changes::names(&unnamed),
            rule: "require 2 from any approvers (kiln's floor for escalations and approval changes no rule names)".into(),
            source: "default".into(),
        });
    }
    out
}

/// Where an owner's approval is asked for (`Need::source`).
pub const OWNER_SOURCE: &str = "owner";

/// The tiers, tenants and pools one change of the semantic diff touches,
/// as `(kind, name)`; empty for what no owner holds (classify, models,
/// the rollout and approval blocks), which the policy's owner answers for.
fn touched(subject: &str) -> Vec<(&'static str, String)> {
    let names = |rest: &str| -> Vec<String> {
        let rest = rest.trim();
        let inner = rest
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .unwrap_or(rest);
        inner
            .split(',')
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect()
    };
    let Some((head, rest)) = subject.split_once(' ') else {
        return Vec::new();
    };
    match head {
        "tier" | "admit" | "fallback" => names(rest).into_iter().map(|n| ("tier", n)).collect(),
        "tenant" => vec![("tenant", rest.trim().to_string())],
        "cohort" => vec![("cohort", rest.trim().to_string())],
        "pool" => vec![("pool", rest.trim().to_string())],
        // `exception NAME for tier T`: its tier's or tenant's owner.
        "exception" => match rest.split_once(" for ") {
            Some((_, whom)) => touched(whom),
            None => Vec::new(),
        },
        // `route [a, b] model`
        "route" => match rest.rsplit_once(' ') {
            Some((tiers, _model)) => names(tiers).into_iter().map(|n| ("tier", n)).collect(),
            None => Vec::new(),
        },
        _ => Vec::new(),
    }
}

/// Who owns `(kind, name)` in `g`: its own owner, else (a tenant) its
/// cohort's, else the policy's; `None` when nobody is named.
pub fn owner_of(g: &DecisionGraph, kind: &str, name: &str) -> Option<String> {
    let o = match kind {
        "tier" => g.tier_id(name).map(|t| g.tier_owner(t)),
        "pool" => g.pool_id(name).map(|p| g.pool_owner(p)),
        "tenant" => g.tenant_id(name).map(|t| g.tenant_owner(t)),
        "cohort" => g
            .cohorts
            .iter()
            .find(|c| c.name == name)
            .filter(|c| c.owner.is_some())
            .map(|c| Owner {
                owner: c.owner.clone(),
                escalation: c.escalation.clone(),
            }),
        _ => None,
    };
    o.unwrap_or_else(|| g.owner.clone()).owner
}

/// The owners' approvals a change needs under the `require owner` rules of
/// the policy **in force** (`active`): for each change of a kind a rule
/// names, the owner of each tier, tenant or pool it touches, as the policy
/// in force names them (a proposal cannot name its own approver by
/// rewriting an owner); what is new, or has no owner, falls back to the
/// policy's owner. One requirement per distinct owner, met by one approver
/// of that name or in that group. With no owner anywhere the requirement
/// is one approval from any approver, and says so.
pub fn owner_needs(active: &DecisionGraph, diff: &SemanticDiff) -> Vec<Need> {
    let mut by_owner: std::collections::BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)> =
        Default::default();
    for r in active.approvals.iter().filter(|r| r.owner) {
        for ch in &diff.changes {
            if !(r.kinds.contains(&ChangeKind::Any) || r.kinds.contains(&ch.change_kind)) {
                continue;
            }
            let mut what = touched(&ch.subject);
            if what.is_empty() {
                what.push(("policy", String::new()));
            }
            for (kind, name) in what {
                let owner = if kind == "policy" {
                    active.owner.owner.clone()
                } else {
                    owner_of(active, kind, &name)
                };
                let who = owner.unwrap_or_else(|| ANY_GROUP.to_string());
                let e = by_owner.entry(who).or_default();
                e.0.insert(ch.change_kind.name().to_string());
                e.1.insert(if kind == "policy" {
                    ch.subject.clone()
                } else {
                    format!("{kind} {name}")
                });
            }
        }
    }
    by_owner
        .into_iter()
        .map(|(owner, (kinds, subjects))| {
            let subjects: Vec<String> = subjects.into_iter().collect();
            let kinds: Vec<String> = kinds.into_iter().collect();
            let rule = if owner == ANY_GROUP {
                format!(
                    "require owner for [{}]: {} has no owner in the policy in force, nor does the policy (`policy {{ owner \"…\" }}`), so any approver",
                    kinds.join(", "),
                    subjects.join(", ")
                )
            } else {
                format!(
                    "require owner for [{}]: \"{owner}\" owns {}",
                    kinds.join(", "),
                    subjects.join(", ")
                )
            };
            Need {
                count: 1,
                group: owner,
                kinds,
                rule,
                source: OWNER_SOURCE.into(),
            }
        })
        .collect()
}

/// An approval the server accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    pub approver: String,
    pub groups: Vec<String>,
    pub issued: u64,
    pub expires: u64,
    pub signature: String,
}

/// How far one requirement is met.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeedStatus {
    #[serde(flatten)]
    pub need: Need,
    /// Approvers counted (valid now).
    pub have: Vec<String>,
    pub missing: u32,
}

/// Each requirement against the approvals still valid at `now_s`.
pub fn evaluate(needs: &[Need], approvals: &[Accepted], now_s: u64) -> Vec<NeedStatus> {
    needs
        .iter()
        .map(|n| {
            let have: Vec<String> = approvals
                .iter()
                .filter(|a| a.expires > now_s)
                .filter(|a| {
                    n.group == ANY_GROUP
                        || a.groups.contains(&n.group)
                        || (n.source == OWNER_SOURCE && a.approver == n.group)
                })
                .map(|a| a.approver.clone())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let missing = n.count.saturating_sub(have.len() as u32);
            NeedStatus {
                need: n.clone(),
                have,
                missing,
            }
        })
        .collect()
}

pub fn satisfied(s: &[NeedStatus]) -> bool {
    s.iter().all(|n| n.missing == 0)
}

/// Why an approval was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, miette::Diagnostic)]
pub enum Refusal {
    #[error("`{0}` is not a configured approver")]
    #[diagnostic(
        code(kiln::approval::unknown_approver),
        help("approvers and their public keys are listed under [[approvers]] in the server's kiln.toml")
    )]
    UnknownApprover(String),
    #[error("the signature does not verify for approver `{approver}` and proposal {proposal}")]
    #[diagnostic(
        code(kiln::approval::bad_signature),
        help("sign with the key whose public half the server lists for this approver, for this proposal id; an approval signed for another proposal cannot be moved")
    )]
    BadSignature { approver: String, proposal: String },
    #[error("this signature was already presented")]
    #[diagnostic(
        code(kiln::approval::replayed),
        help("an approval is used once; sign a new one with `kiln approve`")
    )]
    Replayed,
    #[error("the approval is for policy {approved}, but proposal {proposal} is {current}")]
    #[diagnostic(
        code(kiln::approval::wrong_hash),
        help("the proposal changed after it was reviewed (editing voids approvals): review the current text and approve its hash")
    )]
    WrongHash {
        proposal: String,
        approved: String,
        current: String,
    },
    #[error("`{0}` proposed this change and cannot approve it")]
    #[diagnostic(
        code(kiln::approval::self_approval),
        help("approvals must come from someone other than the proposer: the person behind the proposing admin token (`person` in [[admin.tokens]]) never counts as an approver, whichever key they sign with")
    )]
    SelfApproval(String),
    #[error("the approval expired at {expires} (Unix seconds; now {now})")]
    #[diagnostic(
        code(kiln::approval::expired),
        help("approvals are valid for a limited time; sign a new one with `kiln approve`")
    )]
    Expired { expires: u64, now: u64 },
    #[error("the approval is issued at {issued}, in the future (now {now})")]
    #[diagnostic(
        code(kiln::approval::not_yet_valid),
        help("check the approver's clock")
    )]
    NotYetValid { issued: u64, now: u64 },
    #[error("the approval is valid for {valid_s} s; this server accepts at most {max_s} s")]
    #[diagnostic(
        code(kiln::approval::too_long),
        help("sign with a shorter validity (`kiln approve --valid-for`)")
    )]
    TooLong { valid_s: u64, max_s: u64 },
    #[error("`{0}` already approved this proposal")]
    #[diagnostic(
        code(kiln::approval::duplicate),
        help("approvals must come from distinct approvers")
    )]
    Duplicate(String),
    #[error("proposal {proposal} is {state}, not waiting for approvals")]
    #[diagnostic(
        code(kiln::approval::not_pending),
        help("`kiln status` lists proposals that wait for approvals")
    )]
    NotPending { proposal: String, state: String },
}

impl Refusal {
    /// The HTTP status the refusal answers with.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::UnknownApprover(_)
            | Refusal::BadSignature { .. }
            | Refusal::SelfApproval(_)
            | Refusal::Expired { .. } => 403,
            Refusal::Replayed
            | Refusal::WrongHash { .. }
            | Refusal::Duplicate(_)
            | Refusal::NotPending { .. } => 409,
            Refusal::NotYetValid { .. } | Refusal::TooLong { .. } => 400,
        }
    }

    /// A short machine code (the error's `code`).
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::UnknownApprover(_) => "unknown_approver",
            Refusal::BadSignature { .. } => "bad_signature",
            Refusal::Replayed => "replayed",
            Refusal::WrongHash { .. } => "wrong_hash",
            Refusal::SelfApproval(_) => "self_approval",
            Refusal::Expired { .. } => "expired",
            Refusal::NotYetValid { .. } => "not_yet_valid",
            Refusal::TooLong { .. } => "too_long",
            Refusal::Duplicate(_) => "duplicate",
            Refusal::NotPending { .. } => "not_pending",
        }
    }
}

/// What an approval is checked against.
pub struct Subject<'a> {
    /// The gateway, the proposal id and its nonce: what the signature binds.
    pub target: keys::Target<'a>,
    pub hash: &'a str,
    /// The person who proposed (an admin token's person).
    pub proposer: &'a str,
    pub approvals: &'a [Accepted],
    pub now_s: u64,
    pub max_valid_s: u64,
}

/// Checks one approval; on success, what to record.
pub fn check(
    approvers: &[Approver],
    used: &HashSet<String>,
    s: &Subject,
    a: &SignedApproval,
) -> Result<Accepted, Refusal> {
    let Some(who) = approvers.iter().find(|x| x.name == a.approver) else {
        return Err(Refusal::UnknownApprover(a.approver.clone()));
    };
    let proposal = s.target.proposal;
    if !keys::verify(&who.key, &s.target, a) {
        return Err(Refusal::BadSignature {
            approver: a.approver.clone(),
            proposal: proposal.to_string(),
        });
    }
    let sig = a.signature.trim().to_ascii_lowercase();
    if used.contains(&sig) {
        return Err(Refusal::Replayed);
    }
    if a.hash != s.hash {
        return Err(Refusal::WrongHash {
            proposal: proposal.to_string(),
            approved: a.hash.clone(),
            current: s.hash.to_string(),
        });
    }
    // People, not names: the approver's person against the proposer's,
    // whichever token proposed and whichever approver entry signs.
    if who.person == s.proposer || a.approver == s.proposer {
        return Err(Refusal::SelfApproval(who.person.clone()));
    }
    if a.expires <= s.now_s {
        return Err(Refusal::Expired {
            expires: a.expires,
            now: s.now_s,
        });
    }
    if a.issued > s.now_s + CLOCK_SKEW_S {
        return Err(Refusal::NotYetValid {
            issued: a.issued,
            now: s.now_s,
        });
    }
    let valid = a.expires.saturating_sub(a.issued);
    if valid > s.max_valid_s {
        return Err(Refusal::TooLong {
            valid_s: valid,
            max_s: s.max_valid_s,
        });
    }
    if s.approvals.iter().any(|x| x.approver == a.approver) {
        return Err(Refusal::Duplicate(a.approver.clone()));
    }
    Ok(Accepted {
        approver: a.approver.clone(),
        groups: who.groups.clone(),
        issued: a.issued,
        expires: a.expires,
        signature: sig,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    fn rule(count: u32, group: &str, kinds: &[ChangeKind]) -> ApprovalRule {
        ApprovalRule {
            count,
            group: group.into(),
            owner: false,
            kinds: kinds.to_vec(),
        }
    }

    fn changes(kinds: &[ChangeKind], esc: &[ChangeKind]) -> Changes {
        Changes {
            kinds: kinds.iter().copied().collect(),
            escalations: esc.iter().copied().collect(),
        }
    }

    /// platform.kiln's block.
    fn platform() -> Vec<ApprovalRule> {
        use ChangeKind::*;
        vec![
            rule(
                2,
                "platform-leads",
                &[PriorityIncrease, QuotaIncrease, PreemptionChange],
            ),
            rule(1, "platform", &[Any]),
        ]
    }

    fn key(n: u8) -> SigningKey {
        SigningKey::from_bytes(&[n; 32])
    }

    fn approvers() -> Vec<Approver> {
        vec![
            Approver {
                name: "alice".into(),
                person: "alice".into(),
                groups: vec!["platform".into()],
                key: key(1).verifying_key(),
            },
            Approver {
                name: "bob".into(),
                person: "bob".into(),
                groups: vec!["platform".into(), "platform-leads".into()],
                key: key(2).verifying_key(),
            },
            Approver {
                name: "carol".into(),
                person: "carol".into(),
                groups: vec!["platform-leads".into()],
                key: key(3).verifying_key(),
            },
        ]
    }

    fn accepted(name: &str, groups: &[&str], expires: u64) -> Accepted {
        Accepted {
            approver: name.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            issued: 0,
            expires,
            signature: name.into(),
        }
    }

    const OWNED: &str = r#"
policy { owner "platform" escalation "cto" }
pool gpu { gpus 4 kind "H100-80GB" memory 80GB owner "gpu-infra" }
model m { variant fp16 { memory 40GB pools [gpu] } }
tier chat { priority 100 slo { ttft 500ms } owner "chat-team" }
tier bulk { priority 10 slo { window 6h } }
cohort research { owner "research-leads" }
tenant app { owner "app-team" tiers [chat, bulk] quota { tokens 1M/min } }
tenant lab { tiers [bulk] cohort research }
classify { when tenant == app => tier chat default => tier bulk }
route [chat, bulk] m { default => fp16 }
approval {
  require owner for [tenant_change, quota_increase, tier_change, route_change]
  require 1 from "platform" for any
}
"#;

    fn graph(text: &str) -> DecisionGraph {
        let c = crate::compile::compile_str("t.kiln", text);
        assert!(!c.has_errors(), "{:?}", c.diagnostics);
        c.graph.expect("compiles")
    }

    /// The owners' needs of the change from OWNED to `edit(OWNED)`.
    fn owner_needs_of(edit: impl Fn(&str) -> String) -> Vec<Need> {
        let old = graph(OWNED);
        let new = graph(&edit(OWNED));
        owner_needs(&old, &crate::diff::semantic::semantic(&old, &new))
    }

    #[test]
    fn require_owner_asks_the_owner_of_what_the_change_touches() {
        // A quota raise on tenant app: app-team approves.
        let n = owner_needs_of(|t| t.replace("tokens 1M/min", "tokens 2M/min"));
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!((n[0].group.as_str(), n[0].count), ("app-team", 1));
        assert_eq!(n[0].source, OWNER_SOURCE);
        assert!(n[0].rule.contains("owns tenant app"), "{}", n[0].rule);
        // lab has no owner of its own: its cohort's.
        let n = owner_needs_of(|t| {
            t.replace(
                "tenant lab { tiers [bulk]",
                "tenant lab { tiers [bulk] weight 2",
            )
        });
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!(n[0].group, "research-leads");
        // bulk has none: the policy's owner. chat's is chat-team: two needs.
        // (A priority raise is a priority_increase, which it does not name.)
        let n = owner_needs_of(|t| {
            t.replace("window 6h", "window 8h")
                .replace("priority 100 slo", "priority 90 slo")
                .replace("priority 10 slo", "priority 20 slo")
        });
        let owners: Vec<&str> = n.iter().map(|x| x.group.as_str()).collect();
        assert_eq!(owners, vec!["chat-team", "platform"], "{n:?}");
        // A route block of two tiers: both tiers' owners.
        let n = owner_needs_of(|t| {
            t.replace(
                "route [chat, bulk] m { default => fp16 }",
                "route [chat, bulk] m { when tenant == lab => fp16 on gpu default => fp16 }",
            )
        });
        let owners: Vec<&str> = n.iter().map(|x| x.group.as_str()).collect();
        assert_eq!(owners, vec!["chat-team", "platform"], "{n:?}");
        // A pool change is a pool_change, which the rule does not name.
        let n = owner_needs_of(|t| t.replace("gpus 4", "gpus 8"));
        assert!(n.is_empty(), "{n:?}");
    }

    #[test]
    fn the_owner_in_force_approves_not_the_one_the_proposal_names() {
        // The proposal makes its author's friend the owner of app and raises
        // its quota: app-team (the owner in force) must still approve.
        let n = owner_needs_of(|t| {
            t.replace("owner \"app-team\"", "owner \"mallory\"")
                .replace("tokens 1M/min", "tokens 9M/min")
        });
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!(n[0].group, "app-team");
        // A new tenant has no owner in force: the policy's owner approves.
        let n =
            owner_needs_of(|t| format!("{t}\ntenant new {{ owner \"mallory\" tiers [bulk] }}\n"));
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!(n[0].group, "platform");
        // With no owner anywhere, any approver, and the rule says why.
        let bare = OWNED.replace("policy { owner \"platform\" escalation \"cto\" }", "");
        let old = graph(&bare);
        let new = graph(&bare.replace("window 6h", "window 8h"));
        let n = owner_needs(&old, &crate::diff::semantic::semantic(&old, &new));
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!(n[0].group, ANY_GROUP);
        assert!(
            n[0].rule.contains("tier bulk has no owner"),
            "{}",
            n[0].rule
        );
    }

    #[test]
    fn an_owner_need_is_met_by_the_named_approver_or_a_member_of_the_group() {
        let n = owner_needs_of(|t| t.replace("tokens 1M/min", "tokens 2M/min"));
        // Someone else's approval does not count.
        let s = evaluate(&n, &[accepted("alice", &["platform"], 100)], 10);
        assert!(!satisfied(&s));
        // A member of the group app-team does.
        let s = evaluate(&n, &[accepted("dan", &["app-team"], 100)], 10);
        assert!(satisfied(&s), "{s:?}");
        // So does an approver of that name.
        let s = evaluate(&n, &[accepted("app-team", &[], 100)], 10);
        assert!(satisfied(&s), "{s:?}");
        // A group rule's need is not met by an approver named like the group.
        let g = needs(&platform(), &changes(&[ChangeKind::RouteChange], &[]));
        let s = evaluate(&g, &[accepted("platform", &[], 100)], 10);
        assert!(!satisfied(&s));
    }

    #[test]
    fn ordinary_changes_need_the_any_rule_escalations_the_strict_one() {
        use ChangeKind::*;
        let n = needs(&platform(), &changes(&[RouteChange], &[]));
        assert_eq!(n.len(), 1);
        assert_eq!((n[0].count, n[0].group.as_str()), (1, "platform"));
        let n = needs(
            &platform(),
            &changes(&[PriorityIncrease, RouteChange], &[PriorityIncrease]),
        );
        assert_eq!(n.len(), 2);
        assert_eq!((n[0].count, n[0].group.as_str()), (2, "platform-leads"));
        assert_eq!(n[0].kinds, vec!["priority_increase".to_string()]);
        assert!(n.iter().all(|x| x.source == "policy"));
        // The ordinary approval alone does not meet it.
        let s = evaluate(&n, &[accepted("alice", &["platform"], 100)], 10);
        assert!(!satisfied(&s));
        assert_eq!(s[0].missing, 2);
        let s = evaluate(
            &n,
            &[
                accepted("alice", &["platform"], 100),
                accepted("bob", &["platform", "platform-leads"], 100),
                accepted("carol", &["platform-leads"], 100),
            ],
            10,
        );
        assert!(satisfied(&s), "{s:?}");
    }

    #[test]
    fn without_an_approval_block_one_approver_and_the_floor_for_escalations() {
        use ChangeKind::*;
        let n = needs(&[], &changes(&[TierChange], &[]));
        assert_eq!(n.len(), 1);
        assert_eq!(
            (n[0].count, n[0].group.as_str(), n[0].source.as_str()),
            (1, "*", "default")
        );
        let n = needs(&[], &changes(&[QuotaIncrease], &[QuotaIncrease]));
        assert_eq!(n.len(), 2);
        assert_eq!((n[1].count, n[1].group.as_str()), (2, "*"));
    }

    #[test]
    fn an_escalation_no_rule_names_needs_two_approvers() {
        use ChangeKind::*;
        let rules = vec![rule(1, "platform", &[Any])];
        let n = needs(&rules, &changes(&[PriorityIncrease], &[PriorityIncrease]));
        assert_eq!(n.len(), 2);
        let s = evaluate(&n, &[accepted("alice", &["platform"], 100)], 10);
        assert!(!satisfied(&s));
        assert_eq!(s[1].missing, 1);
        // A preemption change that only removes targets is no escalation.
        let n = needs(&rules, &changes(&[PreemptionChange], &[]));
        assert_eq!(n.len(), 1);
    }

    #[test]
    fn lowering_the_approval_rules_is_judged_by_the_rules_in_force() {
        use ChangeKind::*;
        // The proposal removes its approval block: the active rules and the
        // floor for approval changes still apply.
        let n = needs(&platform(), &changes(&[ApprovalChange], &[]));
        assert_eq!(n.len(), 2);
        assert!(n.iter().any(|x| x.group == "platform"));
        assert!(n.iter().any(|x| x.group == "*" && x.count == 2));
    }

    #[test]
    fn rollback_follows_rules_that_list_it_or_any() {
        use ChangeKind::*;
        let only_esc = vec![rule(2, "leads", &[PriorityIncrease])];
        assert!(needs(&only_esc, &Changes::rollback()).is_empty());
        let n = needs(&platform(), &Changes::rollback());
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].kinds, vec!["rollback".to_string()]);
        let n = needs(&[rule(1, "oncall", &[Rollback])], &Changes::rollback());
        assert_eq!(n[0].group, "oncall");
    }

    #[test]
    fn expired_approvals_stop_counting() {
        let n = needs(&[], &changes(&[ChangeKind::TierChange], &[]));
        let a = [accepted("alice", &["platform"], 50)];
        assert!(satisfied(&evaluate(&n, &a, 49)));
        assert!(!satisfied(&evaluate(&n, &a, 50)));
    }

    fn subject<'a>(approvals: &'a [Accepted], hash: &'a str) -> Subject<'a> {
        Subject {
            target: T1,
            hash,
            proposer: "alice",
            approvals,
            now_s: 1000,
            max_valid_s: 3600,
        }
    }

    const T1: keys::Target<'static> = keys::Target {
        gateway: "g",
        proposal: "p-1",
        nonce: "n1",
    };

    fn sign(k: &SigningKey, p: &str, h: &str, who: &str, i: u64, e: u64) -> SignedApproval {
        crate::governance::keys::sign(k, &keys::Target { proposal: p, ..T1 }, h, who, i, e)
    }

    #[test]
    fn each_attack_is_refused_with_its_reason() {
        let h = "a".repeat(64);
        let used = HashSet::new();
        let ok = sign(&key(2), "p-1", &h, "bob", 990, 2000);
        let got = check(&approvers(), &used, &subject(&[], &h), &ok).unwrap();
        assert_eq!(got.approver, "bob");
        let refuse = |a: &SignedApproval, approvals: &[Accepted], used: &HashSet<String>| {
            check(&approvers(), used, &subject(approvals, &h), a).unwrap_err()
        };
        // Unknown approver; a key that is not the approver's.
        let r = refuse(&sign(&key(9), "p-1", &h, "mallory", 990, 2000), &[], &used);
        assert_eq!(r.status(), 403);
        assert!(matches!(r, Refusal::UnknownApprover(_)));
        let r = refuse(&sign(&key(9), "p-1", &h, "bob", 990, 2000), &[], &used);
        assert!(matches!(r, Refusal::BadSignature { .. }));
        // Signed for another proposal.
        let r = refuse(&sign(&key(2), "p-2", &h, "bob", 990, 2000), &[], &used);
        assert!(matches!(r, Refusal::BadSignature { .. }));
        // Another hash.
        let r = refuse(
            &sign(&key(2), "p-1", &"b".repeat(64), "bob", 990, 2000),
            &[],
            &used,
        );
        assert!(matches!(r, Refusal::WrongHash { .. }));
        assert_eq!(r.status(), 409);
        // Self-approval.
        let r = refuse(&sign(&key(1), "p-1", &h, "alice", 990, 2000), &[], &used);
        assert!(matches!(r, Refusal::SelfApproval(_)));
        // The same person under another approver name (the proposer is a
        // person, whatever the token or approver entry is called).
        let mut people = approvers();
        people[1].person = "alice".into();
        let r = check(&people, &used, &subject(&[], &h), &ok).unwrap_err();
        assert_eq!(r, Refusal::SelfApproval("alice".into()));
        // Expired, from the future, valid too long.
        let r = refuse(&sign(&key(2), "p-1", &h, "bob", 100, 1000), &[], &used);
        assert!(matches!(r, Refusal::Expired { .. }));
        let r = refuse(&sign(&key(2), "p-1", &h, "bob", 1400, 2000), &[], &used);
        assert!(matches!(r, Refusal::NotYetValid { .. }));
        let r = refuse(&sign(&key(2), "p-1", &h, "bob", 990, 9000), &[], &used);
        assert!(matches!(r, Refusal::TooLong { .. }));
        // Replay of a signature already presented; a second approval by the
        // same approver.
        let used: HashSet<String> = [got.signature.clone()].into();
        let r = refuse(&ok, &[], &used);
        assert!(matches!(r, Refusal::Replayed));
        let again = sign(&key(2), "p-1", &h, "bob", 991, 2000);
        let r = refuse(&again, std::slice::from_ref(&got), &HashSet::new());
        assert!(matches!(r, Refusal::Duplicate(_)));
    }
}
