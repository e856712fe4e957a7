//! `kiln diff OLD NEW`, the semantic half: what changed between two compiled
//! policies, in the policy's own terms, and which requests are now decided
//! differently.
//!
//! Everything is compared by name, never by id: ids are dense indices in
//! definition order, so reordering definitions shifts them without changing
//! anything. A change only in layout, comments or definition order gives an
//! empty diff. Rule order *is* compared: rules are first-match-wins.
//!
//! # What is compared
//!
//! * Definitions, field by field: pools, models and their variants, tiers,
//!   tenants, cohorts, the rollout block and the approval rules. Values are
//!   shown with units (`2M/min`, `500ms`, `80GB`, `30%`).
//! * Rule blocks, as ordered lists of rule texts (the canonical formatter's
//!   output): `classify`, each route keyed by (tier, model) and shown as
//!   `route [TIER] MODEL`, each admit block keyed by tier (`admit TIER`), and
//!   each fallback chain keyed by tier (`fallback TIER`). A rule is `added`,
//!   `removed`, `changed` (replaced in place) or `moved` (the same text in a
//!   different relative order); a block's default is compared on its own
//!   (field `default`). Rule changes carry the position in `old`/`new` as
//!   `#N TEXT` (1-based, the default not counted).
//! * Decisions: witness requests built from the request tests of every rule
//!   condition of both graphs, plus one request per (tenant, model) pair, are
//!   decided under both graphs with idle signals (Monday 12:00) and every
//!   field of the decision that differs (tier, tenant, route, admission,
//!   fallback_step) is reported. At most [`MAX_CHANGED_REQUESTS`] requests
//!   are reported.
//!
//! # Change kinds and escalations
//!
//! Approval rules key on [`ChangeKind`]; a change is an *escalation*
//! (`escalation: true`) when it gives some traffic more capacity or more
//! precedence than before. Every escalation has one of the kinds
//! `priority_increase`, `quota_increase` or `preemption_change`, and
//! `priority_increase` and `quota_increase` are only ever used for
//! escalations (a priority lowered is a `tier_change`, a quota lowered a
//! `tenant_change`). The rules:
//!
//! * `priority_increase`, escalation: a tier's `priority` raised; its `aging`
//!   made faster (no `aging` counts as one level a minute); `may_starve` or
//!   `backfill_only` removed; a tenant granted a tier whose priority is
//!   higher than the best tier it was granted before.
//! * `quota_increase`, escalation: a tenant's quota component (`tokens`,
//!   `requests`, `concurrent`, `gpu_seconds`) raised or removed (removed
//!   means unlimited); `weight` or `borrow` raised; `retry_budget` or
//!   `session_steps` raised or removed (unlimited); a tier's `reserve`
//!   share of a pool added or raised (lowered or removed: `tier_change`);
//!   a tier's or a model's quota component raised or removed, as a
//!   tenant's (lowered or added: `tier_change`, `route_change`).
//! * `preemption_change`: any change to a tier's `preempts` or
//!   `preemptible`; an escalation when the tier gains a preemption target or
//!   stops being `preemptible`, not when it only loses targets or becomes
//!   preemptible.
//! * Decided escalations: the witness requests (see *Decisions* above)
//!   are decided under both graphs, and a request that now lands in
//!   another tier of higher priority is a `priority_increase`, in another
//!   tier that may preempt a tier the old one could not (or that is no
//!   longer `preemptible`) a `preemption_change`, and with another tenant
//!   whose quota is larger a `quota_increase`, each an escalation under
//!   the subject `decisions`, whichever block made the decisions differ (a
//!   classify rule such as `when tenant == evals => tier interactive`, a
//!   route, an admit block's fallback, a tenant's tiers). Each distinct
//!   old → new pair is reported once, with the first request showing it.
//!   Requests of a tenant the old policy lacks are left out (a new tenant
//!   is a `tenant_change`, below).
//! * Everything else is not an escalation: `tier_change` (tiers added or
//!   removed, other tier fields, classify and admit rules), `tenant_change`
//!   (tenants and cohorts added or removed, limits tightened, other tenant
//!   fields), `route_change` (models, variants, substitutions declared
//!   with `served_by`, route blocks and fallback chains), `pool_change` (pools), `rollout_change`, `approval_change`.
//!   A new tenant is a `tenant_change`: it has no previous grant to exceed.
//! * `exception_change`: any change to an exception; its grants added or
//!   raised, or its days extended, are escalations as well (see
//!   `semantic/exception.rs`).

use crate::ast::CmpOp;
use crate::compile::units::{show, Ty};
use crate::graph::{
    AdmitOutcome, ApprovalRule, ChangeKind, Cond, DecisionGraph, DecisionView, Model, Owner, Pool,
    Quota, Request, RuleSet, Sig, Signals, Tenant, Test, TestOp, Tier, Variant,
};
use serde::Serialize;
use similar::{capture_diff_slices, Algorithm, DiffOp};
use std::collections::{BTreeMap, BTreeSet};

mod exception;

/// At most this many requests decided differently are reported.
pub const MAX_CHANGED_REQUESTS: usize = 200;
/// At most this many witness requests are decided.
const MAX_WITNESSES: usize = 5000;
/// At most this many conjunctions are taken from one condition.
const MAX_CONJUNCTIONS: usize = 16;
/// Witnesses leave token counts at these unless a rule tests them.
const DEFAULT_PROMPT_TOKENS: u64 = 1000;
const DEFAULT_MAX_TOKENS: u64 = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeOp {
    Added,
    Removed,
    Changed,
    Moved,
}

impl ChangeOp {
    pub fn name(self) -> &'static str {
        match self {
            ChangeOp::Added => "added",
            ChangeOp::Removed => "removed",
            ChangeOp::Changed => "changed",
            ChangeOp::Moved => "moved",
        }
    }

    fn sigil(self) -> &'static str {
        match self {
            ChangeOp::Added => "+",
            ChangeOp::Removed => "-",
            ChangeOp::Changed => "~",
            ChangeOp::Moved => "↕",
        }
    }
}

/// One difference in the policy text's meaning.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub kind: ChangeOp,
    /// What changed: `tier interactive`, `tenant analytics`,
    /// `variant llama-70b.int4`, `classify`, `route [interactive] llama-70b`,
    /// `admit batch`, `fallback interactive`, `rollout`, `approval`.
    pub subject: String,
    /// The field, when one field of the subject changed: `priority`,
    /// `quota.tokens`; `rule`, `step` or `default` in rule blocks.
    pub field: Option<String>,
    pub old: Option<String>,
    pub new: Option<String>,
    pub change_kind: ChangeKind,
    pub escalation: bool,
}

/// One field of one witness request's decision that differs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct DecisionChange {
    /// `tenant=analytics model=llama-70b header x-kiln-tier=eval`
    pub request: String,
    /// tier, tenant, route, admission or fallback_step.
    pub field: String,
    pub old: String,
    pub new: String,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct SemanticDiff {
    pub changes: Vec<Change>,
    pub decisions: Vec<DecisionChange>,
}

impl SemanticDiff {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty() && self.decisions.is_empty()
    }

    pub fn escalations(&self) -> usize {
        self.changes.iter().filter(|c| c.escalation).count()
    }

    /// Requests (distinct) with at least one decision change.
    pub fn changed_requests(&self) -> usize {
        self.decisions
            .iter()
            .map(|d| d.request.as_str())
            .collect::<BTreeSet<_>>()
            .len()
    }
}

/// Compares two compiled policies by meaning.
pub fn semantic(old: &DecisionGraph, new: &DecisionGraph) -> SemanticDiff {
    let mut out = Out::default();
    pools(old, new, &mut out);
    models(old, new, &mut out);
    substitutions(old, new, &mut out);
    tiers(old, new, &mut out);
    tenants(old, new, &mut out);
    cohorts(old, new, &mut out);
    classify(old, new, &mut out);
    routes(old, new, &mut out);
    admits(old, new, &mut out);
    fallbacks(old, new, &mut out);
    rollout(old, new, &mut out);
    approvals(old, new, &mut out);
    exception::exceptions(old, new, &mut out);
    // The policy's owner approves what has no owner of its own where a
    // rule says `require owner`: changing it is an approval change.
    owners(
        &mut out,
        "policy",
        &old.owner,
        &new.owner,
        ChangeKind::ApprovalChange,
    );
    let (decisions, escalations) = decisions(old, new);
    out.changes.extend(escalations);
    SemanticDiff {
        changes: out.changes,
        decisions,
    }
}

// ---------------------------------------------------------------------------
// Collecting changes

#[derive(Default)]
struct Out {
    changes: Vec<Change>,
}

impl Out {
    /// One change, with its (old, new) values.
    fn push(
        &mut self,
        kind: ChangeOp,
        subject: &str,
        field: Option<&str>,
        (old, new): (Option<String>, Option<String>),
        change_kind: ChangeKind,
        escalation: bool,
    ) {
        self.changes.push(Change {
            kind,
            subject: subject.to_string(),
            field: field.map(str::to_string),
            old,
            new,
            change_kind,
            escalation,
        });
    }

    /// A field whose rendered value differs; never an escalation.
    fn field(&mut self, subject: &str, field: &str, old: String, new: String, kind: ChangeKind) {
        if old != new {
            self.push(
                ChangeOp::Changed,
                subject,
                Some(field),
                (Some(old), Some(new)),
                kind,
                false,
            );
        }
    }

    /// A field with an escalation direction: `up` says whether the change
    /// escalates; escalations take `up_kind`, the rest `kind`.
    fn directed(
        &mut self,
        subject: &str,
        field: &str,
        (old, new): (String, String),
        up: bool,
        up_kind: ChangeKind,
        kind: ChangeKind,
    ) {
        if old != new {
            let k = if up { up_kind } else { kind };
            self.push(
                ChangeOp::Changed,
                subject,
                Some(field),
                (Some(old), Some(new)),
                k,
                up,
            );
        }
    }

    fn added(&mut self, subject: &str, summary: String, kind: ChangeKind) {
        self.push(
            ChangeOp::Added,
            subject,
            None,
            (None, Some(summary)),
            kind,
            false,
        );
    }

    fn removed(&mut self, subject: &str, summary: String, kind: ChangeKind) {
        self.push(
            ChangeOp::Removed,
            subject,
            None,
            (Some(summary), None),
            kind,
            false,
        );
    }
}

/// Matches two definition lists by name: calls `both` for names in both,
/// `added`/`removed` for the rest, all in name order.
fn by_name<'a, T>(
    old: &'a [T],
    new: &'a [T],
    name: impl Fn(&T) -> &str,
    mut f: impl FnMut(&str, Option<&'a T>, Option<&'a T>),
) {
    let mut m: BTreeMap<&str, (Option<&T>, Option<&T>)> = BTreeMap::new();
    for x in old {
        m.entry(name(x)).or_default().0 = Some(x);
    }
    for x in new {
        m.entry(name(x)).or_default().1 = Some(x);
    }
    for (n, (o, nw)) in m {
        f(n, o, nw);
    }
}

// ---------------------------------------------------------------------------
// Rendering values

/// A number without trailing zeros.
fn num(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    let r = v.round();
    if (v - r).abs() <= 1e-9 * v.abs().max(1.0) && r.abs() < 1e15 {
        format!("{}", r as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// A count the way policies write it: `2M`, `500k`, `70B`, `1200`.
fn compact(v: f64) -> String {
    let r = v.round();
    if v.is_finite() && (v - r).abs() <= 1e-6 * v.abs().max(1.0) && r != 0.0 && r.abs() < 1e15 {
        let n = r as i64;
        for (div, suffix) in [(1_000_000_000, "B"), (1_000_000, "M"), (1_000, "k")] {
            if n % div == 0 {
                return format!("{}{suffix}", n / div);
            }
        }
        return n.to_string();
    }
    num(v)
}

/// A per-second rate shown per minute (`2M/min`).
fn per_min(v: f64) -> String {
    let s = show(Ty::Rate, v);
    match s.strip_suffix("/min") {
        Some(_) => format!("{}/min", compact(v * 60.0)),
        None => s,
    }
}

/// A per-second rate shown per day (`200k/day`), as GPU-second quotas are
/// written.
fn per_day(v: f64) -> String {
    format!("{}/day", compact(v * 86_400.0))
}

fn dur(v: f64) -> String {
    show(Ty::Duration, v)
}

fn size(v: f64) -> String {
    if v > 0.0 && v < 1e6 {
        format!("{}KB", num(v / 1e3))
    } else {
        show(Ty::Size, v)
    }
}

fn pct(v: f64) -> String {
    show(Ty::Percent, v)
}

fn opt<T: Copy>(v: Option<T>, f: impl Fn(T) -> String, none: &str) -> String {
    v.map_or_else(|| none.to_string(), f)
}

fn flag(b: bool) -> String {
    if b { "yes" } else { "no" }.to_string()
}

/// A tier's exact cache as `kiln diff` shows it.
fn exact_cache(c: Option<crate::graph::ExactSpec>) -> String {
    match c {
        None => "none".to_string(),
        Some(c) => format!(
            "{} entries, ttl {}{}",
            c.max_entries,
            dur(c.ttl_us as f64 / 1000.0),
            if c.shared { ", shared" } else { "" }
        ),
    }
}

/// A tier's semantic cache as `kiln diff` shows it.
fn semantic_cache(c: Option<crate::graph::SemanticSpec>) -> String {
    match c {
        None => "none".to_string(),
        Some(c) => format!(
            "similarity {}, {} entries, ttl {}{}",
            c.min_similarity,
            c.max_entries,
            dur(c.ttl_us as f64 / 1000.0),
            if c.shared { ", shared" } else { "" }
        ),
    }
}

fn list<S: AsRef<str>>(xs: &[S]) -> String {
    let v: Vec<&str> = xs.iter().map(AsRef::as_ref).collect();
    format!("[{}]", v.join(", "))
}

fn sorted_list<S: AsRef<str>>(xs: &[S]) -> String {
    let mut v: Vec<&str> = xs.iter().map(AsRef::as_ref).collect();
    v.sort_unstable();
    v.dedup();
    format!("[{}]", v.join(", "))
}

/// Names of definitions by id ("?" for an id the graph lacks).
fn names_of<T, I: Copy + Into<u64>>(
    items: &[T],
    ids: &[I],
    name: impl Fn(&T) -> &str,
) -> Vec<String> {
    ids.iter()
        .map(|&i| {
            usize::try_from(i.into())
                .ok()
                .and_then(|i| items.get(i))
                .map_or_else(|| "?".into(), |x| name(x).to_string())
        })
        .collect()
}

fn tier_names(g: &DecisionGraph, ids: &[u16]) -> Vec<String> {
    names_of(&g.tiers, ids, |t| &t.name)
}

fn tenant_names(g: &DecisionGraph, ids: &[u32]) -> Vec<String> {
    names_of(&g.tenants, ids, |t| &t.name)
}

fn pool_names(g: &DecisionGraph, ids: &[u16]) -> Vec<String> {
    names_of(&g.pools, ids, |p| &p.name)
}

fn model_names(g: &DecisionGraph, ids: &[u16]) -> Vec<String> {
    names_of(&g.models, ids, |m| &m.name)
}

fn opt_sorted_list(names: Option<Vec<String>>, none: &str) -> String {
    names.map_or_else(|| none.to_string(), |v| sorted_list(&v))
}

// ---------------------------------------------------------------------------
// Definitions

fn pool_summary(p: &Pool) -> String {
    format!("{} × {} ({} each)", p.gpus, p.kind, size(p.gpu_memory))
}

fn pools(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let k = ChangeKind::PoolChange;
    by_name(
        &old.pools,
        &new.pools,
        |p| &p.name,
        |name, a, b| {
            let subject = format!("pool {name}");
            match (a, b) {
                (None, Some(b)) => out.added(&subject, pool_summary(b), k),
                (Some(a), None) => out.removed(&subject, pool_summary(a), k),
                (Some(a), Some(b)) => {
                    out.field(&subject, "gpus", a.gpus.to_string(), b.gpus.to_string(), k);
                    out.field(&subject, "kind", a.kind.clone(), b.kind.clone(), k);
                    out.field(
                        &subject,
                        "memory",
                        size(a.gpu_memory),
                        size(b.gpu_memory),
                        k,
                    );
                    let keys: BTreeSet<&String> = a.labels.keys().chain(b.labels.keys()).collect();
                    for key in keys {
                        let show = |v: Option<&String>| {
                            v.map_or_else(|| "none".into(), |s| format!("\"{s}\""))
                        };
                        out.field(
                            &subject,
                            &format!("labels.{key}"),
                            show(a.labels.get(key)),
                            show(b.labels.get(key)),
                            k,
                        );
                    }
                    let at = |g: &DecisionGraph, p: &Pool| {
                        p.allow_tiers.as_ref().map(|v| tier_names(g, v))
                    };
                    out.field(
                        &subject,
                        "allow_tiers",
                        opt_sorted_list(at(old, a), "any"),
                        opt_sorted_list(at(new, b), "any"),
                        k,
                    );
                    out.field(
                        &subject,
                        "deny_tiers",
                        sorted_list(&tier_names(old, &a.deny_tiers)),
                        sorted_list(&tier_names(new, &b.deny_tiers)),
                        k,
                    );
                    let an = |g: &DecisionGraph, p: &Pool| {
                        p.allow_tenants.as_ref().map(|v| tenant_names(g, v))
                    };
                    out.field(
                        &subject,
                        "allow_tenants",
                        opt_sorted_list(an(old, a), "any"),
                        opt_sorted_list(an(new, b), "any"),
                        k,
                    );
                    out.field(
                        &subject,
                        "deny_tenants",
                        sorted_list(&tenant_names(old, &a.deny_tenants)),
                        sorted_list(&tenant_names(new, &b.deny_tenants)),
                        k,
                    );
                    owners(out, &subject, &a.owner, &b.owner, k);
                }
                (None, None) => {}
            }
        },
    );
}

/// `owner` and `escalation` of one subject.
fn owners(out: &mut Out, subject: &str, a: &Owner, b: &Owner, k: ChangeKind) {
    let q = |v: &Option<String>| {
        v.as_ref()
            .map_or_else(|| "none".into(), |s| format!("\"{s}\""))
    };
    out.field(subject, "owner", q(&a.owner), q(&b.owner), k);
    out.field(subject, "escalation", q(&a.escalation), q(&b.escalation), k);
}

fn model_summary(m: &Model) -> String {
    let v: Vec<&str> = m.variants.iter().map(|v| v.name.as_str()).collect();
    format!("variants {}", sorted_list(&v))
}

fn variant_summary(g: &DecisionGraph, v: &Variant) -> String {
    format!(
        "{}, {}, {} GPU{} per replica, pools {}",
        v.precision.name(),
        size(v.memory),
        v.gpus_per_replica,
        if v.gpus_per_replica == 1 { "" } else { "s" },
        list(&pool_names(g, &v.pools))
    )
}

fn models(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let k = ChangeKind::RouteChange;
    by_name(
        &old.models,
        &new.models,
        |m| &m.name,
        |name, a, b| {
            let subject = format!("model {name}");
            match (a, b) {
                (None, Some(b)) => out.added(&subject, model_summary(b), k),
                (Some(a), None) => out.removed(&subject, model_summary(a), k),
                (Some(a), Some(b)) => {
                    out.field(
                        &subject,
                        "params",
                        opt(a.params, compact, "none"),
                        opt(b.params, compact, "none"),
                        k,
                    );
                    out.field(
                        &subject,
                        "kv_per_token",
                        opt(a.kv_per_token, size, "none"),
                        opt(b.kv_per_token, size, "none"),
                        k,
                    );
                    quota_limits(out, &subject, &a.quota, &b.quota, k);
                    out.field(
                        &subject,
                        "value",
                        opt(a.value_per_request, num, "none"),
                        opt(b.value_per_request, num, "none"),
                        k,
                    );
                    by_name(
                        &a.variants,
                        &b.variants,
                        |v| &v.name,
                        |vn, va, vb| {
                            let subject = format!("variant {name}.{vn}");
                            match (va, vb) {
                                (None, Some(vb)) => {
                                    out.added(&subject, variant_summary(new, vb), k)
                                }
                                (Some(va), None) => {
                                    out.removed(&subject, variant_summary(old, va), k)
                                }
                                (Some(va), Some(vb)) => variant(old, new, &subject, va, vb, out),
                                (None, None) => {}
                            }
                        },
                    );
                }
                (None, None) => {}
            }
        },
    );
}

/// `served_by` declarations, by (model asked for, substitute): which model
/// may serve a request is where it runs, so every change is a route change.
fn substitutions(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let k = ChangeKind::RouteChange;
    let keyed = |g: &DecisionGraph| -> BTreeMap<(String, String), (String, String)> {
        g.substitutions
            .iter()
            .filter_map(|s| {
                let a = g.models.get(s.model as usize)?.name.clone();
                let b = g.models.get(s.by as usize)?.name.clone();
                Some((
                    (a, b),
                    (
                        sorted_list(&tier_names(g, &s.tiers)),
                        s.response_model.name().to_string(),
                    ),
                ))
            })
            .collect()
    };
    let (a, b) = (keyed(old), keyed(new));
    let mut keys: Vec<&(String, String)> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let subject = format!("model {} served_by {}", key.0, key.1);
        let summary =
            |(tiers, rm): &(String, String)| format!("tiers {tiers}, response_model {rm}");
        match (a.get(key), b.get(key)) {
            (None, Some(n)) => out.added(&subject, summary(n), k),
            (Some(o), None) => out.removed(&subject, summary(o), k),
            (Some(o), Some(n)) => {
                out.field(&subject, "tiers", o.0.clone(), n.0.clone(), k);
                out.field(&subject, "response_model", o.1.clone(), n.1.clone(), k);
            }
            (None, None) => {}
        }
    }
}

fn variant(
    old: &DecisionGraph,
    new: &DecisionGraph,
    subject: &str,
    a: &Variant,
    b: &Variant,
    out: &mut Out,
) {
    let k = ChangeKind::RouteChange;
    out.field(
        subject,
        "precision",
        a.precision.name().into(),
        b.precision.name().into(),
        k,
    );
    out.field(subject, "memory", size(a.memory), size(b.memory), k);
    out.field(
        subject,
        "gpus_per_replica",
        a.gpus_per_replica.to_string(),
        b.gpus_per_replica.to_string(),
        k,
    );
    // Order matters: placement prefers the first pool on a tie.
    out.field(
        subject,
        "pools",
        list(&pool_names(old, &a.pools)),
        list(&pool_names(new, &b.pools)),
        k,
    );
    let q = |v: &Option<String>| {
        v.as_ref()
            .map_or_else(|| "none".into(), |s| format!("\"{s}\""))
    };
    out.field(subject, "quality", q(&a.quality), q(&b.quality), k);
    out.field(
        subject,
        "max_batch",
        a.max_batch.to_string(),
        b.max_batch.to_string(),
        k,
    );
    let budget =
        |t: Option<u32>| t.map_or_else(|| "the GPU's default".to_string(), |t| t.to_string());
    out.field(
        subject,
        "max_batch_tokens",
        budget(a.max_batch_tokens),
        budget(b.max_batch_tokens),
        k,
    );
}

/// How long a waiting request of this tier takes to gain one priority
/// level, ms (infinite when it may starve).
fn aging_interval(t: &Tier) -> f64 {
    if t.may_starve {
        f64::INFINITY
    } else {
        t.aging.unwrap_or(60_000.0)
    }
}

fn tiers(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let tc = ChangeKind::TierChange;
    let pi = ChangeKind::PriorityIncrease;
    let pc = ChangeKind::PreemptionChange;
    by_name(
        &old.tiers,
        &new.tiers,
        |t| &t.name,
        |name, a, b| {
            let subject = format!("tier {name}");
            match (a, b) {
                (None, Some(b)) => out.added(&subject, format!("priority {}", b.priority), tc),
                (Some(a), None) => out.removed(&subject, format!("priority {}", a.priority), tc),
                (Some(a), Some(b)) => {
                    out.directed(
                        &subject,
                        "priority",
                        (a.priority.to_string(), b.priority.to_string()),
                        b.priority > a.priority,
                        pi,
                        tc,
                    );
                    owners(out, &subject, &a.owner, &b.owner, tc);
                    out.field(
                        &subject,
                        "slo.ttft",
                        opt(a.slo.ttft, dur, "none"),
                        opt(b.slo.ttft, dur, "none"),
                        tc,
                    );
                    out.field(
                        &subject,
                        "slo.p95",
                        opt(a.slo.e2e_p95, dur, "none"),
                        opt(b.slo.e2e_p95, dur, "none"),
                        tc,
                    );
                    out.field(
                        &subject,
                        "slo.window",
                        opt(a.slo.window, dur, "none"),
                        opt(b.slo.window, dur, "none"),
                        tc,
                    );
                    out.field(
                        &subject,
                        "batch.max_wait",
                        opt(a.batch_max_wait, dur, "none"),
                        opt(b.batch_max_wait, dur, "none"),
                        tc,
                    );
                    out.directed(
                        &subject,
                        "preemptible",
                        (flag(a.preemptible), flag(b.preemptible)),
                        a.preemptible && !b.preemptible,
                        pc,
                        pc,
                    );
                    let pa: BTreeSet<String> = tier_names(old, &a.preempts).into_iter().collect();
                    let pb: BTreeSet<String> = tier_names(new, &b.preempts).into_iter().collect();
                    let gained = pb.difference(&pa).next().is_some();
                    let pa: Vec<String> = pa.into_iter().collect();
                    let pb: Vec<String> = pb.into_iter().collect();
                    out.directed(&subject, "preempts", (list(&pa), list(&pb)), gained, pc, pc);
                    out.directed(
                        &subject,
                        "backfill_only",
                        (flag(a.backfill_only), flag(b.backfill_only)),
                        a.backfill_only && !b.backfill_only,
                        pi,
                        tc,
                    );
                    out.directed(
                        &subject,
                        "aging",
                        (
                            opt(a.aging, dur, "default (1m)"),
                            opt(b.aging, dur, "default (1m)"),
                        ),
                        !b.may_starve && aging_interval(b) < aging_interval(a) && !a.may_starve,
                        pi,
                        tc,
                    );
                    out.directed(
                        &subject,
                        "may_starve",
                        (flag(a.may_starve), flag(b.may_starve)),
                        a.may_starve && !b.may_starve,
                        pi,
                        tc,
                    );
                    out.field(
                        &subject,
                        "models",
                        opt_sorted_list(a.models.as_ref().map(|m| model_names(old, m)), "all"),
                        opt_sorted_list(b.models.as_ref().map(|m| model_names(new, m)), "all"),
                        tc,
                    );
                    out.field(
                        &subject,
                        "prefix_affinity",
                        flag(a.prefix_affinity),
                        flag(b.prefix_affinity),
                        tc,
                    );
                    // Answers starting to cross tenants is an escalation.
                    let shares = |c: Option<crate::graph::ExactSpec>| c.is_some_and(|e| e.shared);
                    out.directed(
                        &subject,
                        "cache.exact",
                        (exact_cache(a.cache.exact), exact_cache(b.cache.exact)),
                        shares(b.cache.exact) && !shares(a.cache.exact),
                        tc,
                        tc,
                    );
                    out.field(
                        &subject,
                        "cache.semantic",
                        semantic_cache(a.cache.semantic),
                        semantic_cache(b.cache.semantic),
                        tc,
                    );
                    out.field(
                        &subject,
                        "on_preempt",
                        a.on_preempt.name().to_string(),
                        b.on_preempt.name().to_string(),
                        tc,
                    );
                    reserves(old, new, a, b, &subject, out);
                    quota_limits(out, &subject, &a.quota, &b.quota, tc);
                    out.field(
                        &subject,
                        "fair_share.window",
                        opt(a.fair_share_window, dur, "default (10m)"),
                        opt(b.fair_share_window, dur, "default (10m)"),
                        tc,
                    );
                    // The Batches API windows accepted, in order of length
                    // (the order written means nothing).
                    let windows = |t: &Tier| {
                        let mut w = t.completion_windows.clone();
                        w.sort_by(f64::total_cmp);
                        list(&w.into_iter().map(dur).collect::<Vec<_>>())
                    };
                    out.field(&subject, "completion_windows", windows(a), windows(b), tc);
                    budget(out, &subject, (a.budget, b.budget), tc);
                }
                (None, None) => {}
            }
        },
    );
}

/// A tier's reserved shares, by pool name: a share added or raised gives
/// the tier capacity others had (`quota_increase`, an escalation), one
/// lowered or removed is a `tier_change`.
/// Reserved shares by pool name (what a diff compares across versions,
/// whose pool ids may differ).
pub(super) fn reserve_by_pool(
    g: &DecisionGraph,
    reserve: &[crate::graph::Reserve],
) -> BTreeMap<String, f64> {
    reserve
        .iter()
        .filter_map(|r| {
            g.pools
                .get(r.pool as usize)
                .map(|p| (p.name.clone(), r.share))
        })
        .collect()
}

fn reserves(
    old: &DecisionGraph,
    new: &DecisionGraph,
    a: &Tier,
    b: &Tier,
    subject: &str,
    out: &mut Out,
) {
    let (sa, sb) = (
        reserve_by_pool(old, &a.reserve),
        reserve_by_pool(new, &b.reserve),
    );
    let pools: BTreeSet<&String> = sa.keys().chain(sb.keys()).collect();
    for pool in pools {
        let (x, y) = (sa.get(pool).copied(), sb.get(pool).copied());
        out.directed(
            subject,
            &format!("reserve.{pool}"),
            (opt(x, pct, "none"), opt(y, pct, "none")),
            y.unwrap_or(0.0) > x.unwrap_or(0.0),
            ChangeKind::QuotaIncrease,
            ChangeKind::TierChange,
        );
    }
}

/// A tier's or a model's quota, component by component: raised or removed
/// (unlimited) is a `quota_increase` escalation, as for a tenant; lowered
/// or added is `kind` (the block's own change kind).
fn quota_limits(out: &mut Out, subject: &str, a: &Quota, b: &Quota, kind: ChangeKind) {
    type Part<'a> = (&'a str, Option<f64>, Option<f64>, fn(f64) -> String);
    let parts: [Part; 4] = [
        ("quota.tokens", a.tokens, b.tokens, per_min),
        ("quota.requests", a.requests, b.requests, per_min),
        (
            "quota.concurrent",
            a.concurrent.map(|c| c as f64),
            b.concurrent.map(|c| c as f64),
            num,
        ),
        ("quota.gpu_seconds", a.gpu_seconds, b.gpu_seconds, per_day),
    ];
    for (field, x, y, render) in parts {
        let up = match (x, y) {
            (Some(x), Some(y)) => y > x,
            (Some(_), None) => true,
            _ => false,
        };
        out.directed(
            subject,
            field,
            (opt(x, render, "unlimited"), opt(y, render, "unlimited")),
            up,
            ChangeKind::QuotaIncrease,
            kind,
        );
    }
}

/// A limit where `None` means unlimited: raised or removed escalates.
fn limit(
    out: &mut Out,
    subject: &str,
    field: &str,
    a: Option<f64>,
    b: Option<f64>,
    render: impl Fn(f64) -> String,
) {
    let up = match (a, b) {
        (Some(x), Some(y)) => y > x,
        (Some(_), None) => true,
        _ => false,
    };
    out.directed(
        subject,
        field,
        (opt(a, &render, "unlimited"), opt(b, &render, "unlimited")),
        up,
        ChangeKind::QuotaIncrease,
        ChangeKind::TenantChange,
    );
}

/// A money budget: raised (compared per day, a month counted as 365/12
/// days) or removed lets more be spent, a `quota_increase`.
fn budget(
    out: &mut Out,
    subject: &str,
    (a, b): (Option<crate::graph::Budget>, Option<crate::graph::Budget>),
    kind: ChangeKind,
) {
    use crate::graph::{Budget, BudgetPeriod};
    let per_day = |b: &Budget| match b.period {
        BudgetPeriod::Day => b.amount,
        BudgetPeriod::Month => b.amount * 12.0 / 365.0,
    };
    let up = match (&a, &b) {
        (Some(x), Some(y)) => per_day(y) > per_day(x),
        (Some(_), None) => true,
        _ => false,
    };
    let show = |b: &Option<Budget>| {
        b.map_or_else(
            || "none".to_string(),
            |b| format!("{}/{}", num(b.amount), b.period.name()),
        )
    };
    out.directed(
        subject,
        "budget",
        (show(&a), show(&b)),
        up,
        ChangeKind::QuotaIncrease,
        kind,
    );
}

fn best_priority(g: &DecisionGraph, ids: &[u16]) -> Option<i64> {
    ids.iter()
        .filter_map(|&i| g.tiers.get(i as usize))
        .map(|t| t.priority)
        .max()
}

fn tenant_summary(g: &DecisionGraph, t: &Tenant) -> String {
    format!("tiers {}", list(&tier_names(g, &t.tiers)))
}

fn tenants(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let tc = ChangeKind::TenantChange;
    let qi = ChangeKind::QuotaIncrease;
    by_name(
        &old.tenants,
        &new.tenants,
        |t| &t.name,
        |name, a, b| {
            let subject = format!("tenant {name}");
            match (a, b) {
                (None, Some(b)) => out.added(&subject, tenant_summary(new, b), tc),
                (Some(a), None) => out.removed(&subject, tenant_summary(old, a), tc),
                (Some(a), Some(b)) => {
                    let q = |v: &Option<String>| {
                        v.as_ref()
                            .map_or_else(|| "none".into(), |s| format!("\"{s}\""))
                    };
                    out.field(&subject, "owner", q(&a.owner), q(&b.owner), tc);
                    out.field(
                        &subject,
                        "escalation",
                        q(&a.escalation),
                        q(&b.escalation),
                        tc,
                    );
                    // Order matters: the first tier is where the tenant lands.
                    let ta = tier_names(old, &a.tiers);
                    let tb = tier_names(new, &b.tiers);
                    let best = best_priority(old, &a.tiers);
                    let raised = b.tiers.iter().zip(&tb).any(|(&id, n)| {
                        !ta.contains(n)
                            && new
                                .tiers
                                .get(id as usize)
                                .is_some_and(|t| best.is_none_or(|p| t.priority > p))
                    });
                    out.directed(
                        &subject,
                        "tiers",
                        (list(&ta), list(&tb)),
                        raised,
                        ChangeKind::PriorityIncrease,
                        tc,
                    );
                    let cohort = |g: &DecisionGraph, t: &Tenant| {
                        t.cohort
                            .and_then(|c| g.cohorts.get(c as usize))
                            .map_or_else(|| "none".into(), |c| c.name.clone())
                    };
                    out.field(&subject, "cohort", cohort(old, a), cohort(new, b), tc);
                    limit(
                        out,
                        &subject,
                        "quota.tokens",
                        a.quota.tokens,
                        b.quota.tokens,
                        per_min,
                    );
                    limit(
                        out,
                        &subject,
                        "quota.requests",
                        a.quota.requests,
                        b.quota.requests,
                        per_min,
                    );
                    limit(
                        out,
                        &subject,
                        "quota.concurrent",
                        a.quota.concurrent.map(|c| c as f64),
                        b.quota.concurrent.map(|c| c as f64),
                        num,
                    );
                    limit(
                        out,
                        &subject,
                        "quota.gpu_seconds",
                        a.quota.gpu_seconds,
                        b.quota.gpu_seconds,
                        per_day,
                    );
                    out.directed(
                        &subject,
                        "weight",
                        (num(a.weight), num(b.weight)),
                        b.weight > a.weight,
                        qi,
                        tc,
                    );
                    out.directed(
                        &subject,
                        "borrow",
                        (pct(a.borrow), pct(b.borrow)),
                        b.borrow > a.borrow,
                        qi,
                        tc,
                    );
                    out.field(&subject, "lend", pct(a.lend), pct(b.lend), tc);
                    limit(
                        out,
                        &subject,
                        "retry_budget",
                        a.retry_budget,
                        b.retry_budget,
                        pct,
                    );
                    limit(
                        out,
                        &subject,
                        "session_steps",
                        a.session_steps.map(|s| s as f64),
                        b.session_steps.map(|s| s as f64),
                        num,
                    );
                    let cost = |c: f64| format!("{}/h", num(c));
                    out.field(
                        &subject,
                        "cost",
                        opt(a.cost_per_gpu_hour, cost, "none"),
                        opt(b.cost_per_gpu_hour, cost, "none"),
                        tc,
                    );
                    budget(out, &subject, (a.budget, b.budget), tc);
                    out.field(
                        &subject,
                        "api_keys",
                        sorted_list(&a.api_keys),
                        sorted_list(&b.api_keys),
                        tc,
                    );
                }
                (None, None) => {}
            }
        },
    );
}

fn cohorts(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let tc = ChangeKind::TenantChange;
    let q = |v: &Option<String>| {
        v.as_ref()
            .map_or_else(|| "none".into(), |s| format!("\"{s}\""))
    };
    by_name(
        &old.cohorts,
        &new.cohorts,
        |c| &c.name,
        |name, a, b| {
            let subject = format!("cohort {name}");
            match (a, b) {
                (None, Some(b)) => out.added(&subject, format!("owner {}", q(&b.owner)), tc),
                (Some(a), None) => out.removed(&subject, format!("owner {}", q(&a.owner)), tc),
                (Some(a), Some(b)) => {
                    out.field(&subject, "owner", q(&a.owner), q(&b.owner), tc);
                    out.field(
                        &subject,
                        "escalation",
                        q(&a.escalation),
                        q(&b.escalation),
                        tc,
                    );
                }
                (None, None) => {}
            }
        },
    );
}

// ---------------------------------------------------------------------------
// Rule blocks

fn rule_text(g: &DecisionGraph, id: u32) -> String {
    g.rules
        .get(id as usize)
        .map_or_else(|| format!("rule {id}"), |r| r.text.clone())
}

/// Blocks of one kind, by tier name.
type Blocks = BTreeMap<String, Block>;

/// A rule block as texts: the ordered rules, and the default.
struct Block {
    rules: Vec<String>,
    default: Option<String>,
}

fn block<O>(g: &DecisionGraph, rs: &RuleSet<O>) -> Block {
    Block {
        rules: rs
            .rules
            .iter()
            .map(|(id, _, _)| rule_text(g, *id))
            .collect(),
        default: Some(rule_text(g, rs.default.0)),
    }
}

fn block_summary(b: &Block) -> String {
    let mut v: Vec<&str> = b.rules.iter().map(String::as_str).collect();
    if let Some(d) = &b.default {
        v.push(d);
    }
    v.join("; ")
}

fn at(i: usize, text: &str) -> String {
    format!("#{} {text}", i + 1)
}

/// Compares two ordered rule lists: moved (same text, another relative
/// order), changed (replaced in place), removed, added.
fn rule_list(
    out: &mut Out,
    subject: &str,
    field: &str,
    old: &[String],
    new: &[String],
    kind: ChangeKind,
) {
    let ops = capture_diff_slices(Algorithm::Myers, old, new);
    let mut deleted: Vec<usize> = Vec::new();
    let mut inserted: Vec<usize> = Vec::new();
    // Replace ops pair old and new rules positionally.
    let mut replaced: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
    for op in &ops {
        match *op {
            DiffOp::Equal { .. } => {}
            DiffOp::Delete {
                old_index, old_len, ..
            } => deleted.extend(old_index..old_index + old_len),
            DiffOp::Insert {
                new_index, new_len, ..
            } => inserted.extend(new_index..new_index + new_len),
            DiffOp::Replace {
                old_index,
                old_len,
                new_index,
                new_len,
            } => replaced.push((
                (old_index..old_index + old_len).collect(),
                (new_index..new_index + new_len).collect(),
            )),
        }
    }
    let all_old: Vec<usize> = deleted
        .iter()
        .copied()
        .chain(replaced.iter().flat_map(|r| r.0.iter().copied()))
        .collect();
    let all_new: Vec<usize> = inserted
        .iter()
        .copied()
        .chain(replaced.iter().flat_map(|r| r.1.iter().copied()))
        .collect();
    // Moves: an unmatched old rule whose text appears among the unmatched
    // new ones, paired in order.
    let mut free_new: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut sorted_new = all_new.clone();
    sorted_new.sort_unstable();
    for &j in &sorted_new {
        if let Some(t) = new.get(j) {
            free_new.entry(t.as_str()).or_default().push(j);
        }
    }
    let mut sorted_old = all_old.clone();
    sorted_old.sort_unstable();
    let mut moved_old: BTreeSet<usize> = BTreeSet::new();
    let mut moved_new: BTreeSet<usize> = BTreeSet::new();
    let mut moves: Vec<(usize, usize)> = Vec::new();
    for &i in &sorted_old {
        let Some(t) = old.get(i) else { continue };
        if let Some(js) = free_new.get_mut(t.as_str()) {
            if !js.is_empty() {
                let j = js.remove(0);
                moved_old.insert(i);
                moved_new.insert(j);
                moves.push((i, j));
            }
        }
    }
    // Everything else: changed in place (within a replace), removed, added.
    let mut events: Vec<(usize, usize, Change)> = Vec::new();
    let mk = |op: ChangeOp, o: Option<String>, n: Option<String>| Change {
        kind: op,
        subject: subject.to_string(),
        field: Some(field.to_string()),
        old: o,
        new: n,
        change_kind: kind,
        escalation: false,
    };
    for (i, j) in moves {
        let t = old.get(i).map_or("", String::as_str);
        events.push((i, j, mk(ChangeOp::Moved, Some(at(i, t)), Some(at(j, t)))));
    }
    let mut lone_old: Vec<usize> = deleted
        .iter()
        .copied()
        .filter(|i| !moved_old.contains(i))
        .collect();
    let mut lone_new: Vec<usize> = inserted
        .iter()
        .copied()
        .filter(|j| !moved_new.contains(j))
        .collect();
    for (os, ns) in &replaced {
        let os: Vec<usize> = os
            .iter()
            .copied()
            .filter(|i| !moved_old.contains(i))
            .collect();
        let ns: Vec<usize> = ns
            .iter()
            .copied()
            .filter(|j| !moved_new.contains(j))
            .collect();
        let n = os.len().min(ns.len());
        for (&i, &j) in os.iter().zip(&ns) {
            let a = old.get(i).map_or("", String::as_str);
            let b = new.get(j).map_or("", String::as_str);
            events.push((i, j, mk(ChangeOp::Changed, Some(at(i, a)), Some(at(j, b)))));
        }
        lone_old.extend(os.iter().skip(n));
        lone_new.extend(ns.iter().skip(n));
    }
    for i in lone_old {
        let t = old.get(i).map_or("", String::as_str);
        // Removed rules sort where they stood in the old list.
        events.push((i, usize::MAX, mk(ChangeOp::Removed, Some(at(i, t)), None)));
    }
    for j in lone_new {
        let t = new.get(j).map_or("", String::as_str);
        events.push((usize::MAX, j, mk(ChangeOp::Added, None, Some(at(j, t)))));
    }
    // Order: by position in the new list, removed rules by their old one.
    events.sort_by_key(|(i, j, c)| (if *j == usize::MAX { *i } else { *j }, c.kind, *i));
    out.changes.extend(events.into_iter().map(|(_, _, c)| c));
}

fn compare_blocks(
    out: &mut Out,
    subject: &str,
    field: &str,
    a: Option<&Block>,
    b: Option<&Block>,
    kind: ChangeKind,
) {
    match (a, b) {
        (None, Some(b)) => out.added(subject, block_summary(b), kind),
        (Some(a), None) => out.removed(subject, block_summary(a), kind),
        (Some(a), Some(b)) => {
            rule_list(out, subject, field, &a.rules, &b.rules, kind);
            match (&a.default, &b.default) {
                (Some(x), Some(y)) => out.field(subject, "default", x.clone(), y.clone(), kind),
                (x, y) => {
                    if x != y {
                        out.push(
                            ChangeOp::Changed,
                            subject,
                            Some("default"),
                            (x.clone(), y.clone()),
                            kind,
                            false,
                        );
                    }
                }
            }
        }
        (None, None) => {}
    }
}

fn classify(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let a = block(old, &old.classify);
    let b = block(new, &new.classify);
    compare_blocks(
        out,
        "classify",
        "rule",
        Some(&a),
        Some(&b),
        ChangeKind::TierChange,
    );
}

fn route_blocks(g: &DecisionGraph) -> BTreeMap<(String, String), Block> {
    let mut m = BTreeMap::new();
    for (ti, t) in g.tiers.iter().enumerate() {
        for (mi, model) in g.models.iter().enumerate() {
            if let Some(rs) = g.route_set(ti as u16, mi as u16) {
                m.insert((t.name.clone(), model.name.clone()), block(g, rs));
            }
        }
    }
    m
}

/// Compares per-tier blocks and reports tiers whose changes are identical
/// together (`route [interactive, agentic] llama-70b`), tiers in priority
/// order (highest first), then by name.
/// `blocks` are the old and the new policy's blocks.
fn per_tier(
    out: &mut Out,
    old: &DecisionGraph,
    new: &DecisionGraph,
    (a, b): (&BTreeMap<String, Block>, &BTreeMap<String, Block>),
    subject: impl Fn(&[String]) -> String,
    field: &str,
    kind: ChangeKind,
) {
    let rank = |t: &str| {
        let p = new
            .tier_id(t)
            .and_then(|i| new.tiers.get(i as usize))
            .or_else(|| old.tier_id(t).and_then(|i| old.tiers.get(i as usize)))
            .map_or(0, |t| t.priority);
        (std::cmp::Reverse(p), t.to_string())
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort_by_key(|k| rank(k));
    keys.dedup();
    let mut groups: Vec<(Vec<String>, Vec<Change>)> = Vec::new();
    for key in keys {
        let mut tmp = Out::default();
        compare_blocks(&mut tmp, "", field, a.get(key), b.get(key), kind);
        if tmp.changes.is_empty() {
            continue;
        }
        match groups.iter_mut().find(|(_, cs)| *cs == tmp.changes) {
            Some((tiers, _)) => tiers.push(key.clone()),
            None => groups.push((vec![key.clone()], tmp.changes)),
        }
    }
    for (tiers, changes) in groups {
        let s = subject(&tiers);
        out.changes.extend(changes.into_iter().map(|mut c| {
            c.subject = s.clone();
            c
        }));
    }
}

fn routes(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let mut by_model: BTreeMap<String, (Blocks, Blocks)> = BTreeMap::new();
    for ((tier, model), blk) in route_blocks(old) {
        by_model.entry(model).or_default().0.insert(tier, blk);
    }
    for ((tier, model), blk) in route_blocks(new) {
        by_model.entry(model).or_default().1.insert(tier, blk);
    }
    for (model, (a, b)) in &by_model {
        per_tier(
            out,
            old,
            new,
            (a, b),
            |tiers| format!("route {} {model}", list(tiers)),
            "rule",
            ChangeKind::RouteChange,
        );
    }
}

fn tier_set(tiers: &[String]) -> String {
    match tiers {
        [one] => one.clone(),
        _ => list(tiers),
    }
}

fn admit_blocks(g: &DecisionGraph) -> BTreeMap<String, Block> {
    g.tiers
        .iter()
        .zip(&g.admits)
        .filter_map(|(t, rs)| {
            rs.as_ref()
                .map(|rs: &RuleSet<AdmitOutcome>| (t.name.clone(), block(g, rs)))
        })
        .collect()
}

fn admits(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    per_tier(
        out,
        old,
        new,
        (&admit_blocks(old), &admit_blocks(new)),
        |tiers| format!("admit {}", tier_set(tiers)),
        "rule",
        ChangeKind::TierChange,
    );
}

fn fallback_blocks(g: &DecisionGraph) -> BTreeMap<String, Block> {
    g.tiers
        .iter()
        .zip(&g.fallbacks)
        .filter_map(|(t, c)| {
            c.as_ref().map(|c| {
                (
                    t.name.clone(),
                    Block {
                        rules: c.steps.iter().map(|(id, _)| rule_text(g, *id)).collect(),
                        default: None,
                    },
                )
            })
        })
        .collect()
}

fn fallbacks(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    per_tier(
        out,
        old,
        new,
        (&fallback_blocks(old), &fallback_blocks(new)),
        |tiers| format!("fallback {}", tier_set(tiers)),
        "step",
        ChangeKind::RouteChange,
    );
}

// ---------------------------------------------------------------------------
// Rollout and approvals

fn rollbacks(r: &crate::graph::Rollout) -> Vec<String> {
    let mut v: Vec<String> = r
        .rollbacks
        .iter()
        .map(|b| match b.hold {
            Some(h) => format!("{} for {}", b.text, dur(h)),
            None => b.text.clone(),
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

fn rollout(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let k = ChangeKind::RolloutChange;
    let s = "rollout";
    match (&old.rollout, &new.rollout) {
        (None, None) => {}
        (None, Some(_)) => out.added(s, "rollout block".into(), k),
        (Some(_), None) => out.removed(s, "rollout block".into(), k),
        (Some(a), Some(b)) => {
            out.field(
                s,
                "shadow",
                opt(a.shadow, dur, "none"),
                opt(b.shadow, dur, "none"),
                k,
            );
            out.field(
                s,
                "canary.share",
                opt(a.canary_share, pct, "none"),
                opt(b.canary_share, pct, "none"),
                k,
            );
            out.field(
                s,
                "canary.tenants",
                sorted_list(&tenant_names(old, &a.canary_tenants)),
                sorted_list(&tenant_names(new, &b.canary_tenants)),
                k,
            );
            out.field(
                s,
                "canary.duration",
                opt(a.canary_duration, dur, "none"),
                opt(b.canary_duration, dur, "none"),
                k,
            );
            stages(old, new, a, b, out);
            let ra = rollbacks(a);
            let rb = rollbacks(b);
            for r in ra.iter().filter(|r| !rb.contains(r)) {
                out.push(
                    ChangeOp::Removed,
                    s,
                    Some("rollback"),
                    (Some(r.clone()), None),
                    k,
                    false,
                );
            }
            for r in rb.iter().filter(|r| !ra.contains(r)) {
                out.push(
                    ChangeOp::Added,
                    s,
                    Some("rollback"),
                    (None, Some(r.clone())),
                    k,
                    false,
                );
            }
        }
    }
}

/// A stage in one line: `tiers [batch] models [llama-8b] share 5% for 1h
/// gate when … for 10m`.
fn stage_text(g: &DecisionGraph, st: &crate::graph::RolloutStage) -> String {
    let mut v = Vec::new();
    let mut names = |what: &str, xs: Vec<String>| {
        if !xs.is_empty() {
            v.push(format!("{what} {}", sorted_list(&xs)));
        }
    };
    names("tenants", tenant_names(g, &st.tenants));
    names("tiers", tier_names(g, &st.tiers));
    names("models", model_names(g, &st.models));
    if let Some(x) = st.share {
        v.push(format!("share {}", pct(x)));
    }
    if let Some(d) = st.duration {
        v.push(format!("for {}", dur(d)));
    }
    for gt in &st.gates {
        v.push(gate_text(gt));
    }
    v.join(" ")
}

fn gate_text(b: &crate::graph::Rollback) -> String {
    match b.hold {
        Some(h) => format!("gate when {} for {}", b.text, dur(h)),
        None => format!("gate when {}", b.text),
    }
}

/// Stages by name: added, removed, each field changed, and their order.
fn stages(
    old: &DecisionGraph,
    new: &DecisionGraph,
    a: &crate::graph::Rollout,
    b: &crate::graph::Rollout,
    out: &mut Out,
) {
    let k = ChangeKind::RolloutChange;
    let s = "rollout";
    for sa in &a.stages {
        let subject = format!("stage {}", sa.name);
        match b.stages.iter().find(|x| x.name == sa.name) {
            None => out.push(
                ChangeOp::Removed,
                s,
                Some(&subject),
                (Some(stage_text(old, sa)), None),
                k,
                false,
            ),
            Some(sb) => {
                let f = |x: &str| format!("stage.{}.{x}", sa.name);
                out.field(
                    s,
                    &f("share"),
                    opt(sa.share, pct, "all"),
                    opt(sb.share, pct, "all"),
                    k,
                );
                for (what, xa, xb) in [
                    (
                        "tenants",
                        tenant_names(old, &sa.tenants),
                        tenant_names(new, &sb.tenants),
                    ),
                    (
                        "tiers",
                        tier_names(old, &sa.tiers),
                        tier_names(new, &sb.tiers),
                    ),
                    (
                        "models",
                        model_names(old, &sa.models),
                        model_names(new, &sb.models),
                    ),
                ] {
                    out.field(s, &f(what), sorted_list(&xa), sorted_list(&xb), k);
                }
                out.field(
                    s,
                    &f("duration"),
                    opt(sa.duration, dur, "default"),
                    opt(sb.duration, dur, "default"),
                    k,
                );
                let ga: Vec<String> = sa.gates.iter().map(gate_text).collect();
                let gb: Vec<String> = sb.gates.iter().map(gate_text).collect();
                for g in ga.iter().filter(|g| !gb.contains(g)) {
                    out.push(
                        ChangeOp::Removed,
                        s,
                        Some(&subject),
                        (Some(g.clone()), None),
                        k,
                        false,
                    );
                }
                for g in gb.iter().filter(|g| !ga.contains(g)) {
                    out.push(
                        ChangeOp::Added,
                        s,
                        Some(&subject),
                        (None, Some(g.clone())),
                        k,
                        false,
                    );
                }
            }
        }
    }
    for sb in b
        .stages
        .iter()
        .filter(|x| !a.stages.iter().any(|y| y.name == x.name))
    {
        out.push(
            ChangeOp::Added,
            s,
            Some(&format!("stage {}", sb.name)),
            (None, Some(stage_text(new, sb))),
            k,
            false,
        );
    }
    let order = |r: &crate::graph::Rollout| {
        let v: Vec<&str> = r.stages.iter().map(|x| x.name.as_str()).collect();
        format!("[{}]", v.join(", "))
    };
    out.field(s, "stages", order(a), order(b), k);
}

fn approval_text(a: &ApprovalRule) -> String {
    let mut kinds: Vec<&str> = a.kinds.iter().map(|k| k.name()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    if a.owner {
        return format!("require owner for {}", list(&kinds));
    }
    format!(
        "require {} from \"{}\" for {}",
        a.count,
        a.group,
        list(&kinds)
    )
}

fn approvals(old: &DecisionGraph, new: &DecisionGraph, out: &mut Out) {
    let k = ChangeKind::ApprovalChange;
    let a: BTreeSet<String> = old.approvals.iter().map(approval_text).collect();
    let b: BTreeSet<String> = new.approvals.iter().map(approval_text).collect();
    for r in a.difference(&b) {
        out.push(
            ChangeOp::Removed,
            "approval",
            Some("require"),
            (Some(r.clone()), None),
            k,
            false,
        );
    }
    for r in b.difference(&a) {
        out.push(
            ChangeOp::Added,
            "approval",
            Some("require"),
            (None, Some(r.clone())),
            k,
            false,
        );
    }
}

// ---------------------------------------------------------------------------
// Witness requests and decisions

/// What a conjunction of request tests asks of a request.
#[derive(Debug, Clone)]
struct Partial {
    tenants: Option<Vec<String>>,
    models: Option<Vec<String>>,
    api_key: Option<String>,
    session: Option<String>,
    has_session: Option<bool>,
    /// Whether it came through the Batches API (the `batch` signal).
    batch: Option<bool>,
    headers: BTreeMap<String, String>,
    tags: BTreeSet<String>,
    no_tags: BTreeSet<String>,
    prompt: Bounds,
    max: Bounds,
}

impl Default for Partial {
    fn default() -> Self {
        Partial {
            tenants: None,
            models: None,
            api_key: None,
            session: None,
            has_session: None,
            batch: None,
            headers: BTreeMap::new(),
            tags: BTreeSet::new(),
            no_tags: BTreeSet::new(),
            prompt: Bounds::new(DEFAULT_PROMPT_TOKENS),
            max: Bounds::new(DEFAULT_MAX_TOKENS),
        }
    }
}

/// Integer bounds on a token count, inclusive, and values to avoid.
#[derive(Debug, Clone)]
struct Bounds {
    lo: f64,
    hi: f64,
    avoid: Vec<f64>,
    default: u64,
}

impl Bounds {
    fn new(default: u64) -> Bounds {
        Bounds {
            lo: 0.0,
            hi: f64::INFINITY,
            avoid: Vec::new(),
            default,
        }
    }

    fn apply(&mut self, op: CmpOp, k: f64, negate: bool) {
        let op = if negate {
            match op {
                CmpOp::Eq => CmpOp::Ne,
                CmpOp::Ne => CmpOp::Eq,
                CmpOp::Lt => CmpOp::Ge,
                CmpOp::Ge => CmpOp::Lt,
                CmpOp::Le => CmpOp::Gt,
                CmpOp::Gt => CmpOp::Le,
            }
        } else {
            op
        };
        match op {
            CmpOp::Gt => self.lo = self.lo.max(k.floor() + 1.0),
            CmpOp::Ge => self.lo = self.lo.max(k.ceil()),
            CmpOp::Lt => self.hi = self.hi.min(k.ceil() - 1.0),
            CmpOp::Le => self.hi = self.hi.min(k.floor()),
            CmpOp::Eq => {
                self.lo = self.lo.max(k);
                self.hi = self.hi.min(k);
            }
            CmpOp::Ne => self.avoid.push(k),
        }
    }

    fn range(&mut self, lo: f64, hi: f64, negate: bool) {
        if negate {
            self.lo = self.lo.max(hi.ceil());
        } else {
            self.lo = self.lo.max(lo.ceil());
            self.hi = self.hi.min(hi.ceil() - 1.0);
        }
    }

    fn pick(&self) -> u64 {
        let d = self.default as f64;
        let mut v = if d >= self.lo && d <= self.hi {
            d
        } else if self.lo > d {
            self.lo
        } else {
            self.hi
        };
        for _ in 0..=self.avoid.len() {
            if self.avoid.contains(&v) {
                v += 1.0;
            }
        }
        // `as` saturates: negative or huge bounds give 0 or u64::MAX.
        v.max(0.0) as u64
    }
}

/// Disjunctive normal form of a condition over (test, negated) literals,
/// at most [`MAX_CONJUNCTIONS`] conjunctions.
fn dnf(c: &Cond, neg: bool) -> Vec<Vec<(&Test, bool)>> {
    match c {
        Cond::True => {
            if neg {
                Vec::new()
            } else {
                vec![Vec::new()]
            }
        }
        Cond::Test(t) => vec![vec![(&**t, neg)]],
        Cond::Not(inner) => dnf(inner, !neg),
        Cond::And(cs) | Cond::Or(cs) => {
            let conj = matches!(c, Cond::And(_)) != neg;
            if conj {
                let mut acc: Vec<Vec<(&Test, bool)>> = vec![Vec::new()];
                for part in cs {
                    let p = dnf(part, neg);
                    let mut next = Vec::new();
                    // The last extension of each conjunction reuses it, so
                    // a long `and` chain is linear, not quadratic.
                    'outer: for mut a in acc {
                        for (i, b) in p.iter().enumerate() {
                            if next.len() >= MAX_CONJUNCTIONS {
                                break 'outer;
                            }
                            if i + 1 == p.len() {
                                a.extend(b.iter().copied());
                                next.push(a);
                                break;
                            }
                            let mut x = a.clone();
                            x.extend(b.iter().copied());
                            next.push(x);
                        }
                    }
                    acc = next;
                }
                acc
            } else {
                let mut acc = Vec::new();
                for part in cs {
                    for x in dnf(part, neg) {
                        if acc.len() >= MAX_CONJUNCTIONS {
                            return acc;
                        }
                        acc.push(x);
                    }
                }
                acc
            }
        }
    }
}

fn narrow(cur: &mut Option<Vec<String>>, names: Vec<String>) {
    *cur = Some(match cur.take() {
        None => names,
        Some(prev) => prev.into_iter().filter(|n| names.contains(n)).collect(),
    });
}

fn partial(g: &DecisionGraph, lits: &[(&Test, bool)]) -> Partial {
    let mut p = Partial::default();
    for (t, neg) in lits {
        let negated = t.negate != *neg;
        match (&t.sig, &t.op) {
            (Sig::Tenant, TestOp::IdIn(ids)) if !negated => {
                narrow(&mut p.tenants, tenant_names(g, ids));
            }
            (Sig::Model, TestOp::IdIn(ids)) if !negated => {
                let ids: Vec<u16> = ids.iter().filter_map(|&i| u16::try_from(i).ok()).collect();
                narrow(&mut p.models, model_names(g, &ids));
            }
            (Sig::ApiKey, TestOp::StrIn(v)) if !negated => p.api_key = v.first().cloned(),
            (Sig::Session, TestOp::StrIn(v)) if !negated => p.session = v.first().cloned(),
            (Sig::HasSession, TestOp::Truthy) => p.has_session = Some(!negated),
            (Sig::Batch, TestOp::Truthy) => p.batch = Some(!negated),
            (Sig::Header(h), TestOp::StrIn(v)) if !negated => {
                if let Some(x) = v.first() {
                    p.headers.insert(h.clone(), x.clone());
                }
            }
            (Sig::Tag(tag), TestOp::Truthy) => {
                if negated {
                    p.no_tags.insert(tag.clone());
                } else {
                    p.tags.insert(tag.clone());
                }
            }
            (Sig::PromptTokens, TestOp::Num(op, k)) => p.prompt.apply(*op, *k, negated),
            (Sig::MaxTokens, TestOp::Num(op, k)) => p.max.apply(*op, *k, negated),
            (Sig::PromptTokens, TestOp::Range(lo, hi)) => p.prompt.range(*lo, *hi, negated),
            (Sig::MaxTokens, TestOp::Range(lo, hi)) => p.max.range(*lo, *hi, negated),
            _ => {}
        }
    }
    p
}

/// The request a partial describes, for one tenant and model.
fn request(p: &Partial, tenant: Option<&str>, model: &str) -> Request {
    let session = match (&p.session, p.has_session) {
        (Some(s), _) => Some(s.clone()),
        (None, Some(true)) => Some("s-1".to_string()),
        _ => None,
    };
    let mut headers = p.headers.clone();
    match p.batch {
        Some(true) => {
            headers
                .entry(crate::graph::BATCH_HEADER.to_string())
                .or_insert_with(|| "batch-1".to_string());
        }
        Some(false) => {
            headers.remove(crate::graph::BATCH_HEADER);
        }
        None => {}
    }
    Request {
        tenant: tenant.map(str::to_string),
        api_key: p.api_key.clone(),
        model: model.to_string(),
        headers,
        tags: p
            .tags
            .iter()
            .filter(|t| !p.no_tags.contains(*t))
            .cloned()
            .collect(),
        session,
        prompt_tokens: p.prompt.pick(),
        max_tokens: p.max.pick(),
    }
}

/// A witness request in one line:
/// `tenant=analytics model=llama-70b header x-kiln-tier=eval`. Token counts
/// are shown when they differ from the defaults witnesses start from.
pub fn describe_request(r: &Request) -> String {
    let mut parts = Vec::new();
    if let Some(t) = &r.tenant {
        parts.push(format!("tenant={t}"));
    }
    if let Some(k) = &r.api_key {
        parts.push(format!("api_key={k}"));
    }
    parts.push(format!("model={}", r.model));
    for (k, v) in &r.headers {
        parts.push(format!("header {k}={v}"));
    }
    for t in &r.tags {
        parts.push(format!("tag {t}"));
    }
    if let Some(s) = &r.session {
        parts.push(format!("session={s}"));
    }
    if r.prompt_tokens != DEFAULT_PROMPT_TOKENS {
        parts.push(format!("prompt_tokens={}", r.prompt_tokens));
    }
    if r.max_tokens != DEFAULT_MAX_TOKENS {
        parts.push(format!("max_tokens={}", r.max_tokens));
    }
    parts.join(" ")
}

/// Every condition of a graph's classify, route and admit rules, with the
/// model a route block is for.
fn conditions(g: &DecisionGraph) -> Vec<(&Cond, Option<String>)> {
    let mut v: Vec<(&Cond, Option<String>)> =
        g.classify.rules.iter().map(|(_, c, _)| (c, None)).collect();
    let nm = g.models.len().max(1);
    for (i, rs) in g.routes.iter().enumerate() {
        if let Some(rs) = rs {
            let model = g.models.get(i % nm).map(|m| m.name.clone());
            v.extend(rs.rules.iter().map(|(_, c, _)| (c, model.clone())));
        }
    }
    for rs in g.admits.iter().flatten() {
        v.extend(rs.rules.iter().map(|(_, c, _)| (c, None)));
    }
    v
}

/// The witness requests for a pair of graphs, deduplicated and sorted by
/// their description: one per (tenant or none, model) pair with no headers;
/// one per conjunction of each classify, route and admit rule condition of
/// either graph (its own tenants, else none; its own models, else the route
/// block's model, else every model); then the tenant-free conjunctions once
/// per tenant; at most 5000 in all.
pub fn witnesses(old: &DecisionGraph, new: &DecisionGraph) -> Vec<Request> {
    let tenants: BTreeSet<String> = old
        .tenants
        .iter()
        .chain(&new.tenants)
        .map(|t| t.name.clone())
        .collect();
    let models: BTreeSet<String> = old
        .models
        .iter()
        .chain(&new.models)
        .map(|m| m.name.clone())
        .collect();
    let mut partials: Vec<Partial> = Vec::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for g in [old, new] {
        for (c, model) in conditions(g) {
            for lits in dnf(c, false) {
                let mut p = partial(g, &lits);
                if p.models.is_none() {
                    p.models = model.clone().map(|m| vec![m]);
                }
                // Route blocks are shared by tiers: the same conditions recur.
                if seen.insert(format!("{p:?}")) {
                    partials.push(p);
                }
            }
        }
    }
    let all_models: Vec<String> = models.iter().cloned().collect();
    let mut found: BTreeMap<String, Request> = BTreeMap::new();
    // Each stage stops once the bound is reached.
    let mut add = |r: Request| -> bool {
        if found.len() >= MAX_WITNESSES {
            return false;
        }
        found.insert(describe_request(&r), r);
        true
    };
    let plain = Partial::default();
    'pairs: for t in std::iter::once(None).chain(tenants.iter().map(|t| Some(t.as_str()))) {
        for m in &models {
            if !add(request(&plain, t, m)) {
                break 'pairs;
            }
        }
    }
    'own: for p in &partials {
        let ms = p.models.as_ref().unwrap_or(&all_models);
        let ts: Vec<Option<&str>> = match &p.tenants {
            Some(ts) => ts.iter().map(|t| Some(t.as_str())).collect(),
            None => vec![None],
        };
        for t in &ts {
            for m in ms {
                if !add(request(p, *t, m)) {
                    break 'own;
                }
            }
        }
    }
    'each: for p in partials
        .iter()
        .filter(|p| p.tenants.is_none() && p.api_key.is_none())
    {
        let ms = p.models.as_ref().unwrap_or(&all_models);
        for t in &tenants {
            for m in ms {
                if !add(request(p, Some(t), m)) {
                    break 'each;
                }
            }
        }
    }
    found.into_values().collect()
}

fn admission(v: &DecisionView) -> String {
    match v.admission.as_str() {
        "queue" => match v.max_wait_ms {
            Some(w) => format!("queue {}", dur(w)),
            None => "queue".into(),
        },
        "hold" => match v.max_wait_ms {
            Some(w) => format!("hold max_wait {}", dur(w)),
            None => "hold".into(),
        },
        "delay" => match &v.delay_until {
            Some(u) => format!("delay until {u}"),
            None => "delay".into(),
        },
        "degrade" => format!("degrade (max_tokens {})", v.max_tokens),
        "reject" => match v.status {
            Some(s) => format!("reject {s}"),
            None => "reject".into(),
        },
        other => other.to_string(),
    }
}

/// The compared fields of a decision, in pipeline order.
pub fn decision_fields(v: &DecisionView) -> [(&'static str, String); 5] {
    let none = || "none".to_string();
    [
        ("tier", v.tier.clone()),
        ("tenant", v.tenant.clone().unwrap_or_else(none)),
        ("route", v.route.clone().unwrap_or_else(none)),
        ("admission", admission(v)),
        (
            "fallback_step",
            v.fallback_step.map_or_else(none, |s| s.to_string()),
        ),
    ]
}

/// Every witness decided under both graphs: the fields that differ (at
/// most [`MAX_CHANGED_REQUESTS`] requests), and the escalations those
/// decisions show (see [`decided_escalations`]).
fn decisions(old: &DecisionGraph, new: &DecisionGraph) -> (Vec<DecisionChange>, Vec<Change>) {
    let so = Signals::idle(old);
    let sn = Signals::idle(new);
    let mut out = Vec::new();
    let mut esc = Escalations::default();
    let mut changed = 0;
    for r in witnesses(old, new) {
        let a = old.view(&old.decide(&r, &so));
        let b = new.view(&new.decide(&r, &sn));
        let desc = describe_request(&r);
        decided_escalations(old, new, &a, &b, &desc, &mut esc);
        if changed >= MAX_CHANGED_REQUESTS {
            continue;
        }
        let before = out.len();
        for ((field, x), (_, y)) in decision_fields(&a).into_iter().zip(decision_fields(&b)) {
            if x != y {
                out.push(DecisionChange {
                    request: desc.clone(),
                    field: field.to_string(),
                    old: x,
                    new: y,
                });
            }
        }
        if out.len() > before {
            changed += 1;
        }
    }
    (out, esc.changes)
}

/// At most this many escalations found by deciding witnesses are reported
/// (each distinct old → new pair once, with the first request showing it).
const MAX_DECIDED_ESCALATIONS: usize = 50;

#[derive(Default)]
struct Escalations {
    seen: BTreeSet<(String, String, String)>,
    changes: Vec<Change>,
}

impl Escalations {
    fn push(&mut self, request: &str, what: &str, (old, new): (String, String), kind: ChangeKind) {
        if self.changes.len() >= MAX_DECIDED_ESCALATIONS
            || !self
                .seen
                .insert((what.to_string(), old.clone(), new.clone()))
        {
            return;
        }
        self.changes.push(Change {
            kind: ChangeOp::Changed,
            subject: "decisions".to_string(),
            field: Some(format!("{what} of {request}")),
            old: Some(old),
            new: Some(new),
            change_kind: kind,
            escalation: true,
        });
    }
}

/// What one request's decisions under the old and the new graph escalate,
/// whichever block made them differ (a classify rule, a route, a fallback's
/// demotion, a tier or tenant definition): the request now reaches a tier
/// of higher priority (`priority_increase`), a tenant with a larger quota
/// (`quota_increase`), or a tier that may preempt a tier its old one could
/// not, or that is no longer preemptible (`preemption_change`). The same
/// tier or tenant under both graphs is left to the field comparison, which
/// already reports its own changes, and so is a request that lands with a
/// tenant the old graph does not define.
fn decided_escalations(
    old: &DecisionGraph,
    new: &DecisionGraph,
    a: &DecisionView,
    b: &DecisionView,
    request: &str,
    out: &mut Escalations,
) {
    fn tier<'g>(g: &'g DecisionGraph, name: &str) -> Option<&'g Tier> {
        g.tiers.iter().find(|t| t.name == name)
    }
    fn tenant<'g>(g: &'g DecisionGraph, name: &Option<String>) -> Option<&'g Tenant> {
        let name = name.as_deref()?;
        g.tenants.iter().find(|t| t.name == name)
    }
    // A tenant the old graph lacks has no previous grant to exceed: its
    // definition is a `tenant_change`, as the field comparison says.
    if tenant(new, &b.tenant).is_some() && tenant(old, &b.tenant).is_none() {
        return;
    }
    if a.tier != b.tier {
        if let (Some(x), Some(y)) = (tier(old, &a.tier), tier(new, &b.tier)) {
            if y.priority > x.priority {
                out.push(
                    request,
                    "tier",
                    (
                        format!("{} (priority {})", x.name, x.priority),
                        format!("{} (priority {})", y.name, y.priority),
                    ),
                    ChangeKind::PriorityIncrease,
                );
            }
            let before: BTreeSet<String> = tier_names(old, &x.preempts).into_iter().collect();
            let gained: Vec<String> = tier_names(new, &y.preempts)
                .into_iter()
                .filter(|n| !before.contains(n))
                .collect();
            if !gained.is_empty() || (x.preemptible && !y.preemptible) {
                let show = |t: &Tier, g: &DecisionGraph| {
                    format!(
                        "{} (preempts {}{})",
                        t.name,
                        sorted_list(&tier_names(g, &t.preempts)),
                        if t.preemptible { ", preemptible" } else { "" }
                    )
                };
                out.push(
                    request,
                    "tier",
                    (show(x, old), show(y, new)),
                    ChangeKind::PreemptionChange,
                );
            }
        }
    }
    if a.tenant != b.tenant {
        if let (Some(x), Some(y)) = (tenant(old, &a.tenant), tenant(new, &b.tenant)) {
            if quota_larger(x, y) {
                out.push(
                    request,
                    "tenant",
                    (x.name.clone(), y.name.clone()),
                    ChangeKind::QuotaIncrease,
                );
            }
        }
    }
}

/// Whether tenant `b` may use more than tenant `a` in some respect: a quota
/// component larger or unlimited where `a`'s is limited, or a larger
/// weight, borrow share, retry budget or session step budget.
fn quota_larger(a: &Tenant, b: &Tenant) -> bool {
    fn more(x: Option<f64>, y: Option<f64>) -> bool {
        match (x, y) {
            (Some(x), Some(y)) => y > x,
            (Some(_), None) => true,
            _ => false,
        }
    }
    let (qa, qb) = (&a.quota, &b.quota);
    more(qa.tokens, qb.tokens)
        || more(qa.requests, qb.requests)
        || more(
            qa.concurrent.map(|x| x as f64),
            qb.concurrent.map(|x| x as f64),
        )
        || more(qa.gpu_seconds, qb.gpu_seconds)
        || more(a.retry_budget, b.retry_budget)
        || more(
            a.session_steps.map(|x| x as f64),
            b.session_steps.map(|x| x as f64),
        )
        || b.weight > a.weight
        || b.borrow > a.borrow
}

// ---------------------------------------------------------------------------
// Rendering

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn headline(d: &SemanticDiff) -> String {
    let mut s = plural(d.changes.len(), "change", "changes");
    let e = d.escalations();
    if e > 0 {
        s.push_str(&format!(" ({})", plural(e, "escalation", "escalations")));
    }
    let r = d.changed_requests();
    s.push_str(&format!(
        ", {} decided differently",
        plural(r, "request", "requests")
    ));
    if r >= MAX_CHANGED_REQUESTS {
        s.push_str(&format!(" (the first {MAX_CHANGED_REQUESTS} shown)"));
    }
    s
}

/// `#3 when …` → (`#3`, `when …`).
fn split_pos(s: &str) -> (&str, &str) {
    s.split_once(' ').unwrap_or((s, ""))
}

fn is_rule(c: &Change) -> bool {
    matches!(c.field.as_deref(), Some("rule") | Some("step"))
}

/// One change as a line of text, without the subject; `v` wraps values
/// (rule texts, old and new values) for the output format.
fn change_line(c: &Change, v: &dyn Fn(&str) -> String) -> String {
    let field = c.field.as_deref().unwrap_or("");
    let old = c.old.as_deref().unwrap_or("");
    let new = c.new.as_deref().unwrap_or("");
    if is_rule(c) {
        let (po, to) = split_pos(old);
        let (pn, tn) = split_pos(new);
        return match c.kind {
            ChangeOp::Added => format!("{field} {pn}: {}", v(tn)),
            ChangeOp::Removed => format!("{field} {po}: {}", v(to)),
            ChangeOp::Moved => format!("{field} {po} → {pn}: {}", v(to)),
            ChangeOp::Changed if po == pn => format!("{field} {po}: {} → {}", v(to), v(tn)),
            ChangeOp::Changed => format!("{field} {po} → {pn}: {} → {}", v(to), v(tn)),
        };
    }
    match (c.kind, c.field.is_some()) {
        (ChangeOp::Added, false) => format!("added: {}", v(new)),
        (ChangeOp::Removed, false) => format!("removed: {}", v(old)),
        (ChangeOp::Added, true) => format!("{field}: {}", v(new)),
        (ChangeOp::Removed, true) => format!("{field}: {}", v(old)),
        _ => format!("{field}: {} → {}", v(old), v(new)),
    }
}

fn kind_note(c: &Change) -> String {
    if c.escalation {
        format!("{}, escalation", c.change_kind.name())
    } else {
        c.change_kind.name().to_string()
    }
}

/// Changes grouped by subject, in order; decisions grouped by request.
pub fn render_human(d: &SemanticDiff) -> String {
    if d.is_empty() {
        return "no semantic changes\n".to_string();
    }
    let mut s = headline(d);
    s.push('\n');
    let mut subject: Option<&str> = None;
    for c in &d.changes {
        if subject != Some(c.subject.as_str()) {
            s.push('\n');
            s.push_str(&c.subject);
            s.push('\n');
            subject = Some(&c.subject);
        }
        s.push_str(&format!(
            "  {} {}  [{}]\n",
            c.kind.sigil(),
            change_line(c, &|x: &str| x.to_string()),
            kind_note(c)
        ));
    }
    if !d.decisions.is_empty() {
        s.push_str("\nrequests decided differently (idle fleet, Monday 12:00)\n");
        let mut req: Option<&str> = None;
        for x in &d.decisions {
            if req != Some(x.request.as_str()) {
                s.push_str(&format!("  {}\n", x.request));
                req = Some(&x.request);
            }
            s.push_str(&format!("    {}: {} → {}\n", x.field, x.old, x.new));
        }
    }
    s
}

fn cell(s: &str) -> String {
    if s.is_empty() {
        return String::new();
    }
    let s = s.replace('|', "\\|");
    if s.contains('`') {
        format!("`` {s} ``")
    } else {
        format!("`{s}`")
    }
}

/// A pull-request comment: a headline, a table of changes, a table of
/// requests decided differently.
pub fn render_markdown(d: &SemanticDiff) -> String {
    if d.is_empty() {
        return "No semantic changes.\n".to_string();
    }
    let mut s = format!("**{}**\n", headline(d));
    if !d.changes.is_empty() {
        s.push_str("\n| | subject | change | kind |\n| --- | --- | --- | --- |\n");
        for c in &d.changes {
            let kind = if c.escalation {
                format!("**{}** (escalation)", c.change_kind.name())
            } else {
                c.change_kind.name().to_string()
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                c.kind.name(),
                cell(&c.subject),
                change_line(c, &|x: &str| cell(x)),
                kind
            ));
        }
    }
    if !d.decisions.is_empty() {
        s.push_str("\n#### Requests decided differently (idle fleet, Monday 12:00)\n\n");
        s.push_str("| request | field | old | new |\n| --- | --- | --- | --- |\n");
        for x in &d.decisions {
            s.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                cell(&x.request),
                x.field,
                cell(&x.old),
                cell(&x.new)
            ));
        }
    }
    s
}
