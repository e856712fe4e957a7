//! What the admin API answers about governance (JSON), and how the CLI
//! shows it to people. The same types serialise on the server and parse in
//! `kiln propose`, `kiln status` and friends.

use super::approval::NeedStatus;
use super::live::Live;
use super::rollout::{Plan, StagePlan};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One semantic change, as `kiln diff` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChangeLine {
    /// added, removed, changed, moved
    pub op: String,
    pub subject: String,
    #[serde(default)]
    pub field: Option<String>,
    #[serde(default)]
    pub old: Option<String>,
    #[serde(default)]
    pub new: Option<String>,
    /// The change kind approval rules key on.
    pub kind: String,
    pub escalation: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransitionLine {
    pub kind: String,
    pub old: String,
    pub new: String,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImpactLine {
    /// `tier:NAME`
    pub scope: String,
    pub metric: String,
    pub old: f64,
    pub new: f64,
    pub delta: f64,
}

/// The dry run against the gateway's recent decision log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DryRunView {
    /// Recorded requests replayed.
    pub records: u64,
    /// Decided differently by the proposal.
    pub changed: u64,
    pub by_kind: BTreeMap<String, u64>,
    pub transitions: Vec<TransitionLine>,
    /// Simulated impact per tier (both policies replayed on the traffic).
    pub impact: Vec<ImpactLine>,
    /// Why there is no dry run, or what limited it.
    #[serde(default)]
    pub note: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalLine {
    pub approver: String,
    pub groups: Vec<String>,
    /// Unix seconds.
    pub expires: u64,
    /// Not expired now.
    pub valid: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProposalView {
    pub id: String,
    /// The gateway's identity, which approvals sign.
    #[serde(default)]
    pub gateway: String,
    /// The random nonce the gateway drew for this proposal, which
    /// approvals sign (so they never fit another proposal with this id).
    #[serde(default)]
    pub nonce: String,
    /// change or rollback
    pub kind: String,
    /// pending, approved, rolling, enforced, rolled_back, refused, stale, withdrawn
    pub state: String,
    pub hash: String,
    pub version: String,
    pub base: String,
    pub proposer: String,
    pub created_unix_ms: u64,
    pub revision: u32,
    pub change_kinds: Vec<String>,
    pub escalations: Vec<String>,
    pub changes_total: usize,
    /// The semantic diff against the active policy (full views only).
    #[serde(default)]
    pub changes: Vec<ChangeLine>,
    /// Witness requests the semantic diff found decided differently.
    pub decisions_changed: usize,
    /// The approvals required (from the policy in force) and how far each
    /// is met.
    pub needs: Vec<NeedStatus>,
    pub approvals: Vec<ApprovalLine>,
    #[serde(default)]
    pub dry_run: Option<DryRunView>,
    #[serde(default)]
    pub rollout: Option<Plan>,
    #[serde(default)]
    pub note: Option<String>,
}

impl ProposalView {
    /// Approvals still missing, over all requirements.
    pub fn missing(&self) -> u32 {
        self.needs.iter().map(|n| n.missing).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ShadowSample {
    pub request: String,
    /// tier, tenant, route or admission
    pub field: String,
    pub active: String,
    pub proposed: String,
}

/// What shadowing found so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ShadowCounts {
    pub decided: u64,
    pub differ: u64,
    /// Differences per decision field.
    pub by_field: BTreeMap<String, u64>,
    /// The most recent differences.
    pub samples: Vec<ShadowSample>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConditionView {
    pub text: String,
    #[serde(default)]
    pub hold_s: Option<f64>,
    /// Holds now.
    pub holds: bool,
    /// For how long it has held, s.
    #[serde(default)]
    pub held_s: Option<f64>,
    /// The values it read, as `signal = value`.
    pub observed: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutView {
    pub proposal: String,
    pub version: String,
    /// shadow, canary, watch
    pub stage: String,
    pub elapsed_s: f64,
    #[serde(default)]
    pub remaining_s: Option<f64>,
    /// The canary stage in progress.
    #[serde(default)]
    pub canary: Option<StagePlan>,
    /// Its place among the plan's stages, from 1.
    #[serde(default)]
    pub stage_number: Option<usize>,
    /// How many canary stages the plan has.
    #[serde(default)]
    pub stages: usize,
    /// The stage's gates, as of the last tick.
    #[serde(default)]
    pub gates: Vec<ConditionView>,
    /// Requests the canary stage decided so far.
    pub canary_requests: u64,
    pub shadow: ShadowCounts,
    pub conditions: Vec<ConditionView>,
    #[serde(default)]
    pub live: Option<Live>,
    /// Tiers with fewer requests than this in the window read as healthy.
    #[serde(default)]
    pub min_samples: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverrideView {
    pub id: u64,
    /// tier or tenant
    pub scope: String,
    pub name: String,
    /// pause or throttle
    pub action: String,
    #[serde(default)]
    pub percent: Option<f64>,
    pub remaining_s: f64,
    pub by: String,
    #[serde(default)]
    pub reason: Option<String>,
    pub refused: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollbackView {
    pub at_unix_ms: u64,
    pub from: String,
    pub to: String,
    /// automatic or manual
    pub trigger: String,
    #[serde(default)]
    pub condition: Option<String>,
    #[serde(default)]
    pub observed: Vec<String>,
    pub by: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditHead {
    #[serde(default)]
    pub path: Option<String>,
    pub entries: u64,
    pub head: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusView {
    pub active: String,
    /// The version a rollback returns to.
    #[serde(default)]
    pub previous: Option<String>,
    /// Approvals required for changes (`[[approvers]]` configured).
    pub governance: bool,
    pub approvers: Vec<String>,
    pub audit: AuditHead,
    #[serde(default)]
    pub rollout: Option<RolloutView>,
    /// Open proposals (pending or approved).
    pub proposals: Vec<ProposalView>,
    pub overrides: Vec<OverrideView>,
    #[serde(default)]
    pub last_rollback: Option<RollbackView>,
    /// The active policy's exceptions, as the gateway's clock reads them.
    #[serde(default)]
    pub exceptions: Vec<ExceptionView>,
}

/// One exception of the active policy in `kiln status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExceptionView {
    pub name: String,
    /// `tenant analytics`, `tier batch`
    pub subject: String,
    /// First and last day, both included: `2026-12-28..2027-01-06`.
    pub dates: String,
    pub grants: String,
    pub reason: String,
    /// `active`, `upcoming` or `expired` on the policy's date today.
    pub state: String,
    /// Whole days left, today included (active only).
    #[serde(default)]
    pub days_left: Option<i32>,
}

impl ExceptionView {
    /// The view of each of `g`'s exceptions on `today` (days since
    /// 1970-01-01 in the policy's zone).
    pub fn all(g: &crate::graph::DecisionGraph, today: i32) -> Vec<ExceptionView> {
        g.exceptions
            .iter()
            .map(|e| {
                let state = if e.covers(today) {
                    "active"
                } else if today < e.from {
                    "upcoming"
                } else {
                    "expired"
                };
                ExceptionView {
                    name: e.name.clone(),
                    subject: e.subject_name(g),
                    dates: e.window(),
                    grants: e.grants(g),
                    reason: e.reason.clone(),
                    state: state.into(),
                    days_left: e.covers(today).then(|| e.until - today + 1),
                }
            })
            .collect()
    }
}

/// Seconds for people: `42s`, `12m34s`, `30m`, `1h47m`, `2h`.
pub fn secs(s: f64) -> String {
    let s = if s.is_finite() {
        s.max(0.0).round() as u64
    } else {
        0
    };
    let (h, m, sec) = (s / 3600, (s % 3600) / 60, s % 60);
    match (h, m, sec) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, 0) => format!("{m}m"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, 0, _) => format!("{h}h"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

fn short(h: &str) -> &str {
    h.get(..16).unwrap_or(h)
}

fn plural(n: u64, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

fn need_line(out: &mut String, n: &NeedStatus) {
    let group = if n.need.group == super::approval::ANY_GROUP {
        "any approver".to_string()
    } else {
        format!("\"{}\"", n.need.group)
    };
    let have = if n.have.is_empty() {
        String::new()
    } else {
        format!(": {}", n.have.join(", "))
    };
    let mark = if n.missing == 0 { "ok" } else { "missing" };
    let _ = writeln!(
        out,
        "  [{mark}] {} of {} from {group} for {}{have}{}",
        n.have.len().min(n.need.count as usize),
        n.need.count,
        n.need.kinds.join(", "),
        if n.need.source == "default" {
            " (kiln's default)"
        } else {
            ""
        },
    );
}

/// `kiln propose` for people.
pub fn render_proposal(p: &ProposalView) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "proposal {} ({}) by {}: {} [{}]",
        p.id, p.kind, p.proposer, p.version, p.state
    );
    let _ = writeln!(out, "  hash {}", p.hash);
    let _ = writeln!(out, "  against the active {}", p.base);
    if p.revision > 1 {
        let _ = writeln!(
            out,
            "  revision {} (earlier approvals are void)",
            p.revision
        );
    }
    let _ = writeln!(out);
    let esc = p.changes.iter().filter(|c| c.escalation).count() as u64;
    let _ = writeln!(
        out,
        "semantic diff: {}{}",
        plural(p.changes_total as u64, "change", "changes"),
        if esc > 0 {
            format!(", {}", plural(esc, "escalation", "escalations"))
        } else {
            String::new()
        }
    );
    for c in &p.changes {
        let sigil = match c.op.as_str() {
            "added" => "+",
            "removed" => "-",
            "moved" => "↕",
            _ => "~",
        };
        let what = match &c.field {
            Some(f) => format!("{} {f}", c.subject),
            None => c.subject.clone(),
        };
        let vals = match (&c.old, &c.new) {
            (Some(a), Some(b)) => format!(": {a} → {b}"),
            (None, Some(b)) => format!(": {b}"),
            (Some(a), None) => format!(": {a}"),
            (None, None) => String::new(),
        };
        let kind = if c.escalation {
            format!("{}, escalation", c.kind)
        } else {
            c.kind.clone()
        };
        let _ = writeln!(out, "  {sigil} {what}{vals}  [{kind}]");
    }
    if p.decisions_changed > 0 {
        let _ = writeln!(
            out,
            "  {} decided differently (witness requests)",
            plural(p.decisions_changed as u64, "request", "requests")
        );
    }
    let _ = writeln!(out);
    match &p.dry_run {
        Some(d) if d.records > 0 => {
            let _ = writeln!(
                out,
                "dry run on {} from the decision log: {} decided differently",
                plural(d.records, "recorded request", "recorded requests"),
                d.changed
            );
            if !d.by_kind.is_empty() {
                let kinds: Vec<String> =
                    d.by_kind.iter().map(|(k, n)| format!("{k} {n}")).collect();
                let _ = writeln!(out, "  by field: {}", kinds.join(" · "));
            }
            for t in d.transitions.iter().take(5) {
                let _ = writeln!(out, "  {} {} → {}: {}", t.kind, t.old, t.new, t.count);
            }
            for i in &d.impact {
                let _ = writeln!(
                    out,
                    "  {} {}: {} → {} ({:+})",
                    i.scope, i.metric, i.old, i.new, i.delta
                );
            }
            if let Some(n) = &d.note {
                let _ = writeln!(out, "  ({n})");
            }
        }
        Some(d) => {
            let _ = writeln!(
                out,
                "dry run: {}",
                d.note.as_deref().unwrap_or("no recorded traffic")
            );
        }
        None => {}
    }
    if let Some(r) = &p.rollout {
        let mut stages = Vec::new();
        if let Some(s) = r.shadow_ms {
            stages.push(format!("shadow {}", secs(s / 1000.0)));
        }
        for c in &r.stages {
            let gates = if c.gates.is_empty() {
                String::new()
            } else {
                format!(
                    " until {}",
                    c.gates
                        .iter()
                        .map(|g| g.text.as_str())
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            };
            stages.push(format!(
                "{} ({}) for {}{gates}",
                stage_label(c),
                c.scope_text(),
                secs(c.duration_ms / 1000.0)
            ));
        }
        stages.push("enforce".into());
        if r.watch_ms > 0.0 {
            stages.push(format!("watch {}", secs(r.watch_ms / 1000.0)));
        }
        let _ = writeln!(out, "rollout: {}", stages.join(" → "));
        for c in &r.rollbacks {
            let _ = writeln!(
                out,
                "  rollback when {}{}",
                c.text,
                c.hold_ms
                    .map(|h| format!(" for {}", secs(h / 1000.0)))
                    .unwrap_or_default()
            );
        }
    }
    let _ = writeln!(out);
    if p.needs.is_empty() {
        let _ = writeln!(out, "approvals: none required");
    } else {
        let _ = writeln!(out, "approvals (rules of the policy in force):");
        for n in &p.needs {
            need_line(&mut out, n);
        }
    }
    if let Some(n) = &p.note {
        let _ = writeln!(out, "note: {n}");
    }
    if p.state == "pending" {
        let _ = writeln!(
            out,
            "next: each approver runs `kiln approve --server URL {} --key KEYFILE`",
            p.id
        );
    }
    out
}

/// `stage pilot`, or `canary` for the one-stage `canary { … }`.
fn stage_label(c: &StagePlan) -> String {
    if c.name == "canary" {
        "canary".into()
    } else {
        format!("stage {}", c.name)
    }
}

/// `kiln status` for people.
pub fn render_status(s: &StatusView) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "active    {}", s.active);
    if let Some(p) = &s.previous {
        let _ = writeln!(out, "previous  {p} (kiln rollback returns to it)");
    }
    let _ = writeln!(
        out,
        "approvals {}",
        if s.governance {
            format!(
                "required ({}: {})",
                plural(s.approvers.len() as u64, "approver", "approvers"),
                s.approvers.join(", ")
            )
        } else {
            "not required (no approvers configured; POST /admin/policy swaps directly)".into()
        }
    );
    let _ = writeln!(
        out,
        "audit     {} ({}), head {}",
        s.audit.path.as_deref().unwrap_or("in memory only"),
        plural(s.audit.entries, "entry", "entries"),
        short(&s.audit.head)
    );
    let _ = writeln!(out);
    match &s.rollout {
        Some(r) => {
            let left = r
                .remaining_s
                .map(|x| format!(", {} left", secs(x)))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "rollout   {} {}: {} for {}{left}",
                r.proposal,
                r.version,
                r.stage,
                secs(r.elapsed_s)
            );
            if let Some(c) = &r.canary {
                let n = r
                    .stage_number
                    .map(|n| format!(" {n}/{}", r.stages.max(n)))
                    .unwrap_or_default();
                let waiting: Vec<&str> = r
                    .gates
                    .iter()
                    .filter(|g| !g.holds || g.held_s.unwrap_or(0.0) < g.hold_s.unwrap_or(0.0))
                    .map(|g| g.text.as_str())
                    .collect();
                let wait = if r.remaining_s.is_some_and(|x| x <= 0.0) && !waiting.is_empty() {
                    format!(", waiting for gate {}", waiting.join(" and "))
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "  canary stage{n} \"{}\" ({}) {} of {}{wait}; {} decided by it",
                    c.name,
                    c.scope_text(),
                    secs(r.elapsed_s),
                    secs(c.duration_ms / 1000.0),
                    r.canary_requests
                );
                for g in &r.gates {
                    let state = match (g.holds, g.held_s) {
                        (true, Some(h)) => format!("holds for {}", secs(h)),
                        (true, None) => "holds".into(),
                        _ => "not yet".into(),
                    };
                    let _ = writeln!(
                        out,
                        "  gate when {}{}: {state}{}",
                        g.text,
                        g.hold_s
                            .map(|h| format!(" for {}", secs(h)))
                            .unwrap_or_default(),
                        if g.observed.is_empty() {
                            String::new()
                        } else {
                            format!(" [{}]", g.observed.join(", "))
                        }
                    );
                }
            }
            if r.shadow.decided > 0 || r.stage == "shadow" {
                let fields: Vec<String> = r
                    .shadow
                    .by_field
                    .iter()
                    .map(|(k, n)| format!("{k} {n}"))
                    .collect();
                let _ = writeln!(
                    out,
                    "  shadow: {} decided, {} differ{}",
                    r.shadow.decided,
                    r.shadow.differ,
                    if fields.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", fields.join(", "))
                    }
                );
            }
            if let Some(l) = &r.live {
                let scope = if r.stage == "canary" {
                    "canary traffic"
                } else {
                    "all traffic"
                };
                let _ = writeln!(
                    out,
                    "  live ({scope}, last {}): {}, {:.1}% errors",
                    secs(l.window_s),
                    plural(l.requests, "request", "requests"),
                    l.error_rate
                );
                for (t, x) in &l.tiers {
                    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}ms"));
                    let _ = writeln!(
                        out,
                        "    {t}: {} requests, p95 TTFT {}, p95 e2e {}, SLO {:.1}%{}",
                        x.requests,
                        ms(x.ttft_p95_ms),
                        ms(x.e2e_p95_ms),
                        x.slo_attainment.unwrap_or(100.0),
                        if x.requests < r.min_samples {
                            format!(" (under {} samples: read as healthy)", r.min_samples)
                        } else {
                            String::new()
                        }
                    );
                }
            }
            for c in &r.conditions {
                let state = match (c.holds, c.held_s) {
                    (true, Some(h)) => format!("HOLDS for {}", secs(h)),
                    (true, None) => "HOLDS".into(),
                    _ => "ok".into(),
                };
                let _ = writeln!(
                    out,
                    "  rollback when {}{}: {state}{}",
                    c.text,
                    c.hold_s
                        .map(|h| format!(" for {}", secs(h)))
                        .unwrap_or_default(),
                    if c.observed.is_empty() {
                        String::new()
                    } else {
                        format!(" [{}]", c.observed.join(", "))
                    }
                );
            }
        }
        None => {
            let _ = writeln!(out, "rollout   none in progress");
        }
    }
    if let Some(r) = &s.last_rollback {
        let _ = writeln!(
            out,
            "last rollback: {} → {} ({}, by {}){}",
            r.from,
            r.to,
            r.trigger,
            r.by,
            r.condition
                .as_deref()
                .map(|c| format!(": {c}"))
                .unwrap_or_default()
        );
    }
    let _ = writeln!(out);
    if s.proposals.is_empty() {
        let _ = writeln!(out, "proposals none open");
    } else {
        let _ = writeln!(out, "proposals");
        for p in &s.proposals {
            let _ = writeln!(
                out,
                "  {} {} by {} [{}]{}",
                p.id,
                p.version,
                p.proposer,
                p.state,
                if p.escalations.is_empty() {
                    String::new()
                } else {
                    format!(", escalates {}", p.escalations.join(", "))
                }
            );
            for n in p.needs.iter().filter(|n| n.missing > 0) {
                let group = if n.need.group == super::approval::ANY_GROUP {
                    "any approver".to_string()
                } else {
                    format!("\"{}\"", n.need.group)
                };
                let _ = writeln!(out, "    missing {} from {group}", n.missing);
            }
        }
    }
    if !s.exceptions.is_empty() {
        let _ = writeln!(out, "\nexceptions");
        for e in &s.exceptions {
            let when = match (e.state.as_str(), e.days_left) {
                ("active", Some(d)) => format!("active, {d} day(s) left"),
                ("expired", _) => "expired: remove it from the policy".to_string(),
                (st, _) => st.to_string(),
            };
            let _ = writeln!(
                out,
                "  {} ({}, {}): {}; {when} (\"{}\")",
                e.name, e.subject, e.dates, e.grants, e.reason
            );
        }
    }
    let _ = writeln!(out);
    if s.overrides.is_empty() {
        let _ = writeln!(out, "overrides none");
    } else {
        let _ = writeln!(out, "overrides");
        for o in &s.overrides {
            let what = match o.percent {
                Some(p) => format!("throttle {} {} to {p}%", o.scope, o.name),
                None => format!("{} {} {}", o.action, o.scope, o.name),
            };
            let _ = writeln!(
                out,
                "  #{} {what}: {} left, by {}{}, {} refused",
                o.id,
                secs(o.remaining_s),
                o.by,
                o.reason
                    .as_deref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default(),
                o.refused
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::calendar::date_days;

    #[test]
    fn status_says_which_exceptions_are_active_upcoming_or_expired() {
        let text = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier lo { priority 10 slo { window 1h } }
tenant fin { owner "o" tiers [lo] weight 1 }
classify { default => tier lo }
route lo m { default => fp16 }
exception close {
  tenant fin
  dates 2026-12-28..2027-01-02
  weight 3
  reason "quarter-end close"
}
"#;
        let g = crate::compile::compile_str("t", text).graph.unwrap();
        let state = |y, m, d| {
            let v = ExceptionView::all(&g, date_days(y, m, d).unwrap());
            (v[0].state.clone(), v[0].days_left)
        };
        assert_eq!(state(2026, 12, 27), ("upcoming".into(), None));
        assert_eq!(state(2026, 12, 28), ("active".into(), Some(6)));
        assert_eq!(state(2027, 1, 2), ("active".into(), Some(1)));
        assert_eq!(state(2027, 1, 3), ("expired".into(), None));
        let v = ExceptionView::all(&g, date_days(2027, 1, 1).unwrap());
        let s = StatusView {
            active: "sha256:x".into(),
            previous: None,
            governance: false,
            approvers: Vec::new(),
            audit: AuditHead {
                path: None,
                entries: 0,
                head: String::new(),
            },
            rollout: None,
            proposals: Vec::new(),
            overrides: Vec::new(),
            last_rollback: None,
            exceptions: v,
        };
        let out = render_status(&s);
        assert!(
            out.contains("  close (tenant fin, 2026-12-28..2027-01-02): weight 3; active, 2 day(s) left (\"quarter-end close\")"),
            "{out}"
        );
    }
}
