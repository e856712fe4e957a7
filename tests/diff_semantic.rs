//! The semantic half of `kiln diff`: changes compared by name, escalations,
//! rule blocks as ordered lists, and witness requests whose decisions
//! differ, checked against deciding them directly under each policy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::diff::semantic::{
    decision_fields, describe_request, render_human, render_markdown, semantic, witnesses, Change,
    ChangeOp, SemanticDiff,
};
use kiln::graph::{ChangeKind, DecisionGraph, Signals};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn policy_dir(name: &str) -> DecisionGraph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies")
        .join(name);
    let c = kiln::compile::compile(kiln::compile::load(&[path]).expect("load"));
    assert!(!c.has_errors(), "{:?}", c.diagnostics);
    c.graph.expect("graph")
}

fn policy_text(text: &str) -> DecisionGraph {
    let c = kiln::compile::compile_str("policy.kiln", text);
    assert!(!c.has_errors(), "{:?}\n{text}", c.diagnostics);
    c.graph.expect("graph")
}

fn enterprise_text() -> String {
    std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/enterprise/enterprise.kiln"),
    )
    .expect("read enterprise policy")
}

/// Replaces the one occurrence of `from`.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "`{from}` must occur once");
    text.replacen(from, to, 1)
}

/// Top-level items of a policy file, comments and blank lines dropped.
fn items(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut depth = 0i32;
    for line in text.lines() {
        let code = line.split('#').next().unwrap_or("");
        if depth == 0 && code.trim().is_empty() {
            continue;
        }
        cur.push_str(line);
        cur.push('\n');
        for ch in code.chars() {
            match ch {
                '{' | '[' => depth += 1,
                '}' | ']' => depth -= 1,
                _ => {}
            }
        }
        if depth == 0 {
            out.push(std::mem::take(&mut cur));
        }
    }
    assert!(cur.trim().is_empty(), "unbalanced policy text");
    out
}

fn is_definition(item: &str) -> bool {
    ["pool ", "model ", "tier ", "tenant ", "cohort "]
        .iter()
        .any(|k| item.starts_with(k))
}

/// Checks every reported decision change against deciding the witness
/// directly under each graph, and that no witness that decides differently
/// went unreported (below the cap).
fn check_decisions(old: &DecisionGraph, new: &DecisionGraph, d: &SemanticDiff) {
    let so = Signals::idle(old);
    let sn = Signals::idle(new);
    let by_desc: BTreeMap<String, _> = witnesses(old, new)
        .into_iter()
        .map(|r| (describe_request(&r), r))
        .collect();
    for x in &d.decisions {
        let r = by_desc
            .get(&x.request)
            .unwrap_or_else(|| panic!("no witness `{}`", x.request));
        let a = decision_fields(&old.view(&old.decide(r, &so)));
        let b = decision_fields(&new.view(&new.decide(r, &sn)));
        let get = |fs: &[(&str, String)]| {
            fs.iter()
                .find(|(f, _)| *f == x.field)
                .map(|(_, v)| v.clone())
                .expect("field")
        };
        assert_eq!(get(&a), x.old, "{x:?}");
        assert_eq!(get(&b), x.new, "{x:?}");
        assert_ne!(x.old, x.new);
    }
    if d.changed_requests() < kiln::diff::semantic::MAX_CHANGED_REQUESTS {
        for (desc, r) in &by_desc {
            let a = decision_fields(&old.view(&old.decide(r, &so)));
            let b = decision_fields(&new.view(&new.decide(r, &sn)));
            for ((f, x), (_, y)) in a.iter().zip(b.iter()) {
                if x != y {
                    assert!(
                        d.decisions
                            .iter()
                            .any(|c| &c.request == desc && c.field == *f),
                        "{desc}: {f} {x} → {y} not reported"
                    );
                }
            }
        }
    }
    let mut sorted = d.decisions.clone();
    sorted.sort_by(|a, b| a.request.cmp(&b.request));
    assert_eq!(
        sorted
            .iter()
            .map(|x| x.request.as_str())
            .collect::<Vec<_>>(),
        d.decisions
            .iter()
            .map(|x| x.request.as_str())
            .collect::<Vec<_>>(),
        "decisions are sorted by request"
    );
}

/// A change as (op, subject, field, old, new, kind).
type Row<'a> = (
    ChangeOp,
    &'a str,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    ChangeKind,
);

fn rows(d: &SemanticDiff) -> Vec<Row<'_>> {
    d.changes
        .iter()
        .map(|c| {
            (
                c.kind,
                c.subject.as_str(),
                c.field.as_deref(),
                c.old.as_deref(),
                c.new.as_deref(),
                c.change_kind,
            )
        })
        .collect()
}

fn only(d: &SemanticDiff) -> &Change {
    assert_eq!(d.changes.len(), 1, "{}", render_human(d));
    &d.changes[0]
}

#[test]
fn identical_policies_have_an_empty_diff() {
    for name in ["enterprise", "batch-platform", "split"] {
        let a = policy_dir(name);
        let b = policy_dir(name);
        let d = semantic(&a, &b);
        assert!(d.is_empty(), "{name}: {}", render_human(&d));
        assert_eq!(d.escalations(), 0);
        assert_eq!(render_human(&d), "no semantic changes\n");
    }
}

#[test]
fn layout_comments_and_definition_order_are_not_changes() {
    let text = enterprise_text();
    let all = items(&text);
    let (mut defs, rules): (Vec<String>, Vec<String>) =
        all.into_iter().partition(|i| is_definition(i));
    defs.reverse();
    // Keyed rule blocks (routes, admits, fallbacks) may go in any order;
    // classify is one block.
    let mut rules = rules;
    rules.reverse();
    let mut shuffled = String::from("# reordered, re-indented, recommented\n\n");
    for item in defs.iter().chain(&rules) {
        shuffled.push_str("// moved\n");
        shuffled.push_str(&item.replace("\n  ", "\n      "));
        shuffled.push('\n');
    }
    // The same values written differently, and a route block split in two.
    let shuffled = edit(&shuffled, "tokens 4M/min", "tokens 4000k/min");
    let shuffled = edit(&shuffled, "memory 140GB", "memory 140000MB");
    let shuffled = edit(
        &shuffled,
        "route [interactive, agentic] llama-8b {\n      default => fp16 on h100\n}",
        "route agentic llama-8b { default => fp16 on h100 }\nroute interactive llama-8b { default => fp16 on h100 }",
    );
    let a = policy_dir("enterprise");
    let b = policy_text(&shuffled);
    assert_ne!(
        a.normalized(),
        b.normalized(),
        "the reordering should shift ids"
    );
    assert_ne!(
        a.tiers.iter().map(|t| &t.name).collect::<Vec<_>>(),
        b.tiers.iter().map(|t| &t.name).collect::<Vec<_>>()
    );
    let d = semantic(&a, &b);
    assert!(d.is_empty(), "{}", render_human(&d));
    let d = semantic(&b, &a);
    assert!(d.is_empty(), "{}", render_human(&d));
}

#[test]
fn files_merged_in_another_order_are_not_a_change() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/split");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read split")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "kiln"))
        .collect();
    files.sort();
    files.reverse();
    let text: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).expect("read"))
        .collect::<Vec<_>>()
        .join("\n");
    let d = semantic(&policy_dir("split"), &policy_text(&text));
    assert!(d.is_empty(), "{}", render_human(&d));
}

#[test]
fn a_raised_quota_is_one_escalation() {
    let old = enterprise_text();
    let new = edit(
        &old,
        "quota { tokens 2M/min concurrent 64 }",
        "quota { tokens 4M/min concurrent 64 }",
    );
    let d = semantic(&policy_text(&old), &policy_text(&new));
    let c = only(&d);
    assert_eq!(c.kind, ChangeOp::Changed);
    assert_eq!(c.subject, "tenant copilot");
    assert_eq!(c.field.as_deref(), Some("quota.tokens"));
    assert_eq!(c.old.as_deref(), Some("2M/min"));
    assert_eq!(c.new.as_deref(), Some("4M/min"));
    assert_eq!(c.change_kind, ChangeKind::QuotaIncrease);
    assert!(c.escalation);
    assert_eq!(d.escalations(), 1);
    // Quotas do not change decisions on an idle fleet.
    assert!(d.decisions.is_empty(), "{:?}", d.decisions);

    // Lowered: a tenant change, not an escalation.
    let d = semantic(&policy_text(&new), &policy_text(&old));
    let c = only(&d);
    assert_eq!(c.change_kind, ChangeKind::TenantChange);
    assert!(!c.escalation);
}

#[test]
fn a_raised_or_removed_money_budget_is_an_escalation() {
    let old = enterprise_text();
    // 2k a month is about 66 a day: 100 a day is more.
    for (to, escalation) in [
        ("budget 100/day", true),
        ("budget 50/day", false),
        ("budget 2.5k/month", true),
        ("", true),
    ] {
        let new = edit(&old, "budget 2k/month", to);
        let d = semantic(&policy_text(&old), &policy_text(&new));
        let c = only(&d);
        assert_eq!(c.subject, "tenant research");
        assert_eq!(c.field.as_deref(), Some("budget"));
        assert_eq!(c.old.as_deref(), Some("2000/month"));
        assert_eq!(c.escalation, escalation, "{to}");
        let kind = if escalation {
            ChangeKind::QuotaIncrease
        } else {
            ChangeKind::TenantChange
        };
        assert_eq!(c.change_kind, kind, "{to}");
    }
}

#[test]
fn a_removed_quota_is_unlimited_and_an_escalation() {
    let old = enterprise_text();
    // (Research's: analytics' limits are raised by an exception, which
    // may only raise a limit the tenant has.)
    let new = edit(
        &old,
        "quota { tokens 500k/min concurrent 16 gpu_seconds 100k/day }",
        "quota { tokens 500k/min gpu_seconds 100k/day }",
    );
    let d = semantic(&policy_text(&old), &policy_text(&new));
    let c = only(&d);
    assert_eq!(c.subject, "tenant research");
    assert_eq!(c.field.as_deref(), Some("quota.concurrent"));
    assert_eq!(
        (c.old.as_deref(), c.new.as_deref()),
        (Some("16"), Some("unlimited"))
    );
    assert!(c.escalation);
    assert_eq!(c.change_kind, ChangeKind::QuotaIncrease);
}

#[test]
fn a_lowered_priority_is_not_an_escalation_and_a_raised_one_is() {
    let old = enterprise_text();
    let lowered = edit(&old, "priority 100", "priority 95");
    let d = semantic(&policy_text(&old), &policy_text(&lowered));
    let c = only(&d);
    assert_eq!(c.subject, "tier interactive");
    assert_eq!(c.field.as_deref(), Some("priority"));
    assert_eq!(
        (c.old.as_deref(), c.new.as_deref()),
        (Some("100"), Some("95"))
    );
    assert_eq!(c.change_kind, ChangeKind::TierChange);
    assert!(!c.escalation);
    assert_eq!(d.escalations(), 0);

    let raised = edit(&old, "priority 40", "priority 60");
    let d = semantic(&policy_text(&old), &policy_text(&raised));
    let c = only(&d);
    assert_eq!(c.subject, "tier batch");
    assert_eq!(c.change_kind, ChangeKind::PriorityIncrease);
    assert!(c.escalation);
}

#[test]
fn preemption_escalates_only_when_it_widens() {
    let old = enterprise_text();
    let gains = edit(
        &old,
        "preempts [batch, background]\n}",
        "preempts [batch, background, evaluation]\n}",
    );
    let d = semantic(&policy_text(&old), &policy_text(&gains));
    let c = only(&d);
    assert_eq!(c.subject, "tier agentic");
    assert_eq!(c.field.as_deref(), Some("preempts"));
    assert_eq!(c.change_kind, ChangeKind::PreemptionChange);
    assert!(c.escalation);
    // Losing the target again: a preemption change, not an escalation.
    let d = semantic(&policy_text(&gains), &policy_text(&old));
    let c = only(&d);
    assert_eq!(c.change_kind, ChangeKind::PreemptionChange);
    assert!(!c.escalation);

    // No longer preemptible: escalation; preemptible again: not.
    let sheltered = edit(
        &old,
        "slo { window 12h }\n  batch { max_wait 2s }\n  preemptible\n",
        "slo { window 12h }\n  batch { max_wait 2s }\n",
    );
    let d = semantic(&policy_text(&old), &policy_text(&sheltered));
    let c = only(&d);
    assert_eq!(c.subject, "tier evaluation");
    assert_eq!(c.field.as_deref(), Some("preemptible"));
    assert!(c.escalation);
    let d = semantic(&policy_text(&sheltered), &policy_text(&old));
    assert!(!only(&d).escalation);
}

#[test]
fn a_tier_granted_above_the_tenants_best_is_an_escalation() {
    let old = enterprise_text();
    let new = edit(
        &old,
        "tiers [evaluation, batch]",
        "tiers [evaluation, batch, interactive]",
    );
    let d = semantic(&policy_text(&old), &policy_text(&new));
    let c = only(&d);
    assert_eq!(c.subject, "tenant analytics");
    assert_eq!(c.field.as_deref(), Some("tiers"));
    assert_eq!(c.old.as_deref(), Some("[evaluation, batch]"));
    assert_eq!(c.new.as_deref(), Some("[evaluation, batch, interactive]"));
    assert_eq!(c.change_kind, ChangeKind::PriorityIncrease);
    assert!(c.escalation);
    // Classify never sends analytics to interactive: no decision changes.
    assert!(d.decisions.is_empty(), "{:?}", d.decisions);

    // A lower tier granted: a tenant change only.
    let new = edit(
        &old,
        "tiers [batch, background]",
        "tiers [batch, background, experimentation]",
    );
    let d = semantic(&policy_text(&old), &policy_text(&new));
    let c = only(&d);
    assert_eq!(c.subject, "tenant enrichment");
    assert_eq!(c.change_kind, ChangeKind::TenantChange);
    assert!(!c.escalation);
}

#[test]
fn a_classify_rule_moved_up_sends_analytics_eval_traffic_to_batch() {
    let old = enterprise_text();
    let rule = "  when tenant == analytics => tier batch\n";
    let new = edit(&old, rule, "");
    let new = edit(&new, "classify {\n", &format!("classify {{\n{rule}"));
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    let c = only(&d);
    assert_eq!(c.kind, ChangeOp::Moved);
    assert_eq!(c.subject, "classify");
    assert_eq!(c.field.as_deref(), Some("rule"));
    assert_eq!(
        c.old.as_deref(),
        Some("#9 when tenant == analytics => tier batch")
    );
    assert_eq!(
        c.new.as_deref(),
        Some("#1 when tenant == analytics => tier batch")
    );
    assert_eq!(c.change_kind, ChangeKind::TierChange);
    assert!(!c.escalation);

    let eval = "tenant=analytics model=llama-70b header x-kiln-tier=eval";
    let tier: Vec<_> = d
        .decisions
        .iter()
        .filter(|x| x.request == eval && x.field == "tier")
        .collect();
    assert_eq!(tier.len(), 1, "{}", render_human(&d));
    assert_eq!(
        (tier[0].old.as_str(), tier[0].new.as_str()),
        ("evaluation", "batch")
    );
    let route = d
        .decisions
        .iter()
        .find(|x| x.request == eval && x.field == "route")
        .expect("route change");
    assert_eq!(route.old, "llama-70b.int4 on h100");
    assert_eq!(route.new, "llama-70b.int4 on shared");
    // research's eval traffic still matches the first rule's tenant list
    // only after analytics' rule: unchanged.
    assert!(d
        .decisions
        .iter()
        .all(|x| x.request.starts_with("tenant=analytics")));
    check_decisions(&a, &b, &d);
    let text = render_human(&d);
    assert!(
        text.contains("↕ rule #9 → #1: when tenant == analytics => tier batch"),
        "{text}"
    );
    assert!(text.contains("tier: evaluation → batch"), "{text}");
}

#[test]
fn evaluation_on_int4_during_business_hours() {
    // The change from the issue: move evaluation traffic onto int4 during
    // business hours.
    let new = enterprise_text();
    let old = edit(
        &new,
        "  when weekday in mon..fri and time in 09:00..18:00 => int4\n",
        "",
    );
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    let c = only(&d);
    assert_eq!(c.kind, ChangeOp::Added);
    assert_eq!(c.subject, "route [evaluation] llama-70b");
    assert_eq!(
        c.new.as_deref(),
        Some("#1 when weekday in mon..fri and time in 09:00..18:00 => int4")
    );
    assert_eq!(c.change_kind, ChangeKind::RouteChange);
    let got: Vec<(&str, &str, &str, &str)> = d
        .decisions
        .iter()
        .map(|x| {
            (
                x.request.as_str(),
                x.field.as_str(),
                x.old.as_str(),
                x.new.as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "tenant=analytics model=llama-70b header x-kiln-tier=eval",
                "route",
                "llama-70b.int8 on h100",
                "llama-70b.int4 on h100"
            ),
            (
                "tenant=research model=llama-70b header x-kiln-tier=eval",
                "route",
                "llama-70b.int8 on h100",
                "llama-70b.int4 on h100"
            ),
        ]
    );
    check_decisions(&a, &b, &d);
}

#[test]
fn rule_blocks_report_added_removed_changed_and_default() {
    // Blocks are reported in tier priority order, highest first.
    let old = enterprise_text();
    let new = edit(
        &old,
        "  when prompt_tokens > 16k => reject 413 \"experiments are limited to 16k-token prompts\"\n",
        "  when prompt_tokens > 32k => reject 413 \"experiments are limited to 32k-token prompts\"\n",
    );
    let new = edit(
        &new,
        "  when time in 08:00..20:00 => delay until 20:00\n  default => accept",
        "  when time in 08:00..20:00 => delay until 20:00\n  default => queue 1h",
    );
    let new = edit(&new, "  queue 5s,\n]", "  queue 10s,\n]");
    let new = edit(&new, "  when estimated_wait > 5s => fallback\n", "");
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    let got = rows(&d);
    assert_eq!(
        got,
        [
            (
                ChangeOp::Removed,
                "admit agentic",
                Some("rule"),
                Some("#1 when estimated_wait > 5s => fallback"),
                None,
                ChangeKind::TierChange
            ),
            (
                ChangeOp::Changed,
                "admit experimentation",
                Some("rule"),
                Some("#1 when prompt_tokens > 16k => reject 413 \"experiments are limited to 16k-token prompts\""),
                Some("#1 when prompt_tokens > 32k => reject 413 \"experiments are limited to 32k-token prompts\""),
                ChangeKind::TierChange
            ),
            (
                ChangeOp::Changed,
                "admit background",
                Some("default"),
                Some("default => accept"),
                Some("default => queue 1h"),
                ChangeKind::TierChange
            ),
            // One chain for two tiers: reported once, for both.
            (
                ChangeOp::Changed,
                "fallback [interactive, agentic]",
                Some("step"),
                Some("#3 queue 5s"),
                Some("#3 queue 10s"),
                ChangeKind::RouteChange
            ),
        ],
        "{}",
        render_human(&d)
    );
    // A research prompt of 16001..32000 tokens was refused and is now
    // accepted; the witness comes from the rule's own condition.
    let big = d
        .decisions
        .iter()
        .find(|x| x.request == "tenant=research model=llama-8b prompt_tokens=16001")
        .expect("witness from prompt_tokens > 16k");
    assert_eq!(
        (big.field.as_str(), big.old.as_str(), big.new.as_str()),
        ("admission", "reject 413", "accept")
    );
    check_decisions(&a, &b, &d);
}

#[test]
fn definitions_added_removed_and_changed_by_name() {
    let old = enterprise_text();
    let new = edit(&old, "  gpus 8\n", "  gpus 12\n");
    let new = edit(
        &new,
        "variant int8 { memory 75GB gpus_per_replica 1 pools [h100] }",
        "variant int8 { memory 80GB gpus_per_replica 1 pools [h100] }",
    );
    let new = edit(
        &new,
        "cohort research {\n  owner \"ml-research@corp.example\"\n}\n",
        "cohort research {\n  owner \"ml-research@corp.example\"\n}\n\ncohort finance {\n  owner \"finance@corp.example\"\n}\n\ntenant ledger {\n  owner \"finance@corp.example\"\n  tiers [batch]\n  cohort finance\n  quota { tokens 300k/min }\n}\n",
    );
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    let got = rows(&d);
    assert_eq!(
        got,
        [
            (
                ChangeOp::Changed,
                "pool shared",
                Some("gpus"),
                Some("8"),
                Some("12"),
                ChangeKind::PoolChange
            ),
            (
                ChangeOp::Changed,
                "variant llama-70b.int8",
                Some("memory"),
                Some("75GB"),
                Some("80GB"),
                ChangeKind::RouteChange
            ),
            (
                ChangeOp::Added,
                "tenant ledger",
                None,
                None,
                Some("tiers [batch]"),
                ChangeKind::TenantChange
            ),
            (
                ChangeOp::Added,
                "cohort finance",
                None,
                None,
                Some("owner \"finance@corp.example\""),
                ChangeKind::TenantChange
            ),
        ],
        "{}",
        render_human(&d)
    );
    // The new tenant's requests fall to the default rule: background.
    assert!(d
        .decisions
        .iter()
        .any(|x| x.request == "tenant=ledger model=llama-70b"
            && x.field == "tenant"
            && x.old == "none"
            && x.new == "ledger"));
    check_decisions(&a, &b, &d);
}

/// A realistic change set on the enterprise policy.
fn enterprise_change() -> (DecisionGraph, DecisionGraph) {
    let old = enterprise_text();
    // Copilot doubles its token quota.
    let new = edit(
        &old,
        "quota { tokens 2M/min concurrent 64 }",
        "quota { tokens 4M/min concurrent 64 }",
    );
    // Evaluation gives way a little more to batch, and batch ages faster
    // (30s a level, not the default minute).
    let new = edit(&new, "priority 50", "priority 45");
    let new = edit(
        &new,
        "slo { window 6h }\n  batch { max_wait 5s }\n  preemptible\n",
        "slo { window 6h }\n  batch { max_wait 5s }\n  preemptible\n  aging 30s\n",
    );
    // Analytics' plain traffic is classified before the eval header rule.
    let rule = "  when tenant == analytics => tier batch\n";
    let new = edit(&new, rule, "");
    let new = edit(&new, "classify {\n", &format!("classify {{\n{rule}"));
    // Research gets the interactive tier for demos.
    let new = edit(
        &new,
        "tiers [experimentation, evaluation]",
        "tiers [experimentation, evaluation, interactive]",
    );
    // Experiments may send longer prompts; the shared pool grows.
    let new = edit(
        &new,
        "  when prompt_tokens > 16k => reject 413 \"experiments are limited to 16k-token prompts\"\n",
        "  when prompt_tokens > 32k => reject 413 \"experiments are limited to 32k-token prompts\"\n",
    );
    let new = edit(&new, "  gpus 8\n", "  gpus 12\n");
    (policy_text(&old), policy_text(&new))
}

#[test]
fn enterprise_change_set_renders() {
    let (a, b) = enterprise_change();
    let d = semantic(&a, &b);
    assert_eq!(d.escalations(), 3, "{}", render_human(&d));
    check_decisions(&a, &b, &d);
    let human = render_human(&d);
    let md = render_markdown(&d);
    insta::assert_snapshot!("enterprise_human", human);
    insta::assert_snapshot!("enterprise_markdown", md);
    // Deterministic, including JSON.
    let again = semantic(&a, &b);
    assert_eq!(d, again);
    assert_eq!(human, render_human(&again));
    assert_eq!(
        serde_json::to_string(&d).expect("json"),
        serde_json::to_string(&again).expect("json")
    );
    let v = serde_json::to_value(&d).expect("json");
    assert_eq!(v["changes"][0]["kind"], "changed");
    assert!(v["changes"]
        .as_array()
        .expect("array")
        .iter()
        .any(|c| c["change_kind"] == "quota_increase" && c["escalation"] == true));
}

#[test]
fn every_shipped_policy_against_every_other_agrees_with_decide() {
    let names = ["enterprise", "batch-platform", "split"];
    for x in names {
        for y in names {
            let (a, b) = (policy_dir(x), policy_dir(y));
            let d = semantic(&a, &b);
            assert_eq!(d.is_empty(), x == y, "{x} → {y}");
            check_decisions(&a, &b, &d);
            assert!(d.changed_requests() <= kiln::diff::semantic::MAX_CHANGED_REQUESTS);
        }
    }
}

#[test]
fn route_changes_are_keyed_by_tier_and_model() {
    let old = enterprise_text();
    // The shared block changes for both tiers: reported once, for both.
    let both = edit(
        &old,
        "when pool(h100).kv_occupancy < 90% => fp16 on h100",
        "when pool(h100).kv_occupancy < 85% => fp16 on h100",
    );
    let d = semantic(&policy_text(&old), &policy_text(&both));
    let c = only(&d);
    assert_eq!(c.kind, ChangeOp::Changed);
    assert_eq!(c.subject, "route [interactive, agentic] llama-70b");
    assert_eq!(c.change_kind, ChangeKind::RouteChange);

    // Split, with agentic's copy changed: only agentic's route changed.
    let split = edit(
        &old,
        "route [interactive, agentic] llama-70b {\n  when pool(h100).kv_occupancy < 90% => fp16 on h100\n  default => fallback\n}",
        "route interactive llama-70b {\n  when pool(h100).kv_occupancy < 90% => fp16 on h100\n  default => fallback\n}\n\nroute agentic llama-70b {\n  when pool(h100).kv_occupancy < 90% => int8 on h100\n  default => fallback\n}",
    );
    let (a, b) = (policy_text(&old), policy_text(&split));
    let d = semantic(&a, &b);
    let c = only(&d);
    assert_eq!(c.subject, "route [agentic] llama-70b");
    assert_eq!(
        c.new.as_deref(),
        Some("#1 when pool(h100).kv_occupancy < 90% => int8 on h100")
    );
    // Support-bot sessions are agentic: their route changed.
    assert!(d.decisions.iter().any(|x| x.request
        == "tenant=support-bot model=llama-70b session=s-1"
        && x.field == "route"
        && x.old == "llama-70b.fp16 on h100"
        && x.new == "llama-70b.int8 on h100"));
    check_decisions(&a, &b, &d);
}

#[test]
fn rollout_and_approval_changes() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/split");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).expect("read");
    let teams = format!(
        "{}\n{}",
        read("team-assistants.kiln"),
        read("team-search.kiln")
    );
    let old = format!("{}\n{teams}", read("platform.kiln"));
    let new = edit(&old, "shadow 1h", "shadow 2h");
    let new = edit(&new, "  rollback when error_rate > 2%\n", "");
    let new = edit(
        &new,
        "require 2 from \"platform-leads\"",
        "require 3 from \"platform-leads\"",
    );
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    assert!(d.decisions.is_empty(), "{:?}", d.decisions);
    let human = render_human(&d);
    assert_eq!(
        human,
        "4 changes, 0 requests decided differently

rollout
  ~ shadow: 1h → 2h  [rollout_change]
  - rollback: error_rate > 2%  [rollout_change]

approval
  - require: require 2 from \"platform-leads\" for [preemption_change, priority_increase, quota_increase]  [approval_change]
  + require: require 3 from \"platform-leads\" for [preemption_change, priority_increase, quota_increase]  [approval_change]
"
    );
}

/// The escalations the diff found by deciding witnesses (subject
/// `decisions`), as (field, old, new, kind).
fn decided(d: &SemanticDiff) -> Vec<(&str, &str, &str, ChangeKind)> {
    d.changes
        .iter()
        .filter(|c| c.subject == "decisions")
        .map(|c| {
            assert!(c.escalation, "{c:?}");
            (
                c.field.as_deref().unwrap_or(""),
                c.old.as_deref().unwrap_or(""),
                c.new.as_deref().unwrap_or(""),
                c.change_kind,
            )
        })
        .collect()
}

#[test]
fn a_classify_rule_raising_a_tenants_tier_is_a_priority_escalation() {
    // analytics' plain traffic moves from batch (40) to evaluation (50), a
    // tier it is granted: no tier or tenant definition changed.
    let old = enterprise_text();
    let new = edit(
        &old,
        "  when tenant == analytics => tier batch\n",
        "  when tenant == analytics => tier evaluation\n",
    );
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    let rule = d
        .changes
        .iter()
        .find(|c| c.subject == "classify")
        .expect("the classify rule change");
    assert_eq!(rule.change_kind, ChangeKind::TierChange);
    let esc = decided(&d);
    assert_eq!(
        esc,
        vec![(
            "tier of tenant=analytics model=llama-70b",
            "batch (priority 40)",
            "evaluation (priority 50)",
            ChangeKind::PriorityIncrease
        )],
        "{}",
        render_human(&d)
    );
    let changes = kiln::governance::approval::Changes::of(&d);
    assert!(changes.escalations.contains(&ChangeKind::PriorityIncrease));
    check_decisions(&a, &b, &d);
    insta::assert_snapshot!("classify_priority_escalation", render_human(&d));

    // The reverse sends traffic down: no escalation.
    let d = semantic(&b, &a);
    assert!(decided(&d).is_empty(), "{}", render_human(&d));
    assert_eq!(d.escalations(), 0);
}

#[test]
fn a_classify_rule_granting_preemption_is_a_preemption_escalation() {
    // copilot's session traffic moves from agentic (90, preempts batch and
    // background) to interactive (100, also preempts experimentation).
    let old = enterprise_text();
    let new = edit(
        &old,
        "when tenant == copilot and has_session => tier agentic",
        "when tenant == copilot and has_session => tier interactive",
    );
    let d = semantic(&policy_text(&old), &policy_text(&new));
    let kinds: BTreeMap<ChangeKind, usize> =
        decided(&d).into_iter().fold(BTreeMap::new(), |mut m, e| {
            *m.entry(e.3).or_default() += 1;
            m
        });
    assert_eq!(
        kinds,
        BTreeMap::from([
            (ChangeKind::PriorityIncrease, 1),
            (ChangeKind::PreemptionChange, 1)
        ]),
        "{}",
        render_human(&d)
    );
    let text = render_human(&d);
    assert!(
        text.contains("agentic (preempts [background, batch]) → interactive (preempts [background, batch, experimentation])"),
        "{text}"
    );
}

#[test]
fn a_classify_rule_moving_traffic_to_a_larger_quota_is_a_quota_escalation() {
    let base = r#"pool gpu { gpus 4 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 40GB pools [gpu] } }
tier chat { priority 100 slo { ttft 500ms } }
tenant small { owner "a@example.com" tiers [chat] quota { tokens 1M/min } }
tenant big { owner "b@example.com" tiers [chat] quota { tokens 5M/min } }
classify {
  when header("x-team") == "a" => tenant small tier chat
  default => tier chat
}
route chat m { default => fp16 }
"#;
    let new = edit(base, "=> tenant small tier chat", "=> tenant big tier chat");
    let d = semantic(&policy_text(base), &policy_text(&new));
    let esc = decided(&d);
    assert!(
        esc.iter()
            .any(|e| e.1 == "small" && e.2 == "big" && e.3 == ChangeKind::QuotaIncrease),
        "{}",
        render_human(&d)
    );
    // Towards the smaller quota: no escalation.
    let d = semantic(&policy_text(&new), &policy_text(base));
    assert!(decided(&d).is_empty(), "{}", render_human(&d));
}

#[test]
fn an_escalating_classify_rule_needs_the_escalation_approvals() {
    // The split policy requires two platform leads for a priority increase.
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/split");
    let dir = std::env::temp_dir().join(format!("kiln-escalation-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for e in std::fs::read_dir(&src).expect("read split") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "kiln") {
            let text = std::fs::read_to_string(&p).expect("read");
            let text = if p.file_name().is_some_and(|n| n == "platform.kiln") {
                edit(
                    &text,
                    "  when tenant == query-rewrite and header(\"x-search-mode\") == \"offline\" => tier batch\n",
                    "  when tenant == query-rewrite and header(\"x-search-mode\") == \"offline\" => tier interactive\n",
                )
            } else {
                text
            };
            std::fs::write(dir.join(p.file_name().expect("name")), text).expect("write");
        }
    }
    let old = policy_dir("split");
    let c = kiln::compile::compile(kiln::compile::load(std::slice::from_ref(&dir)).expect("load"));
    assert!(!c.has_errors(), "{:?}", c.diagnostics);
    let new = c.graph.expect("graph");
    let _ = std::fs::remove_dir_all(&dir);
    let d = semantic(&old, &new);
    let changes = kiln::governance::approval::Changes::of(&d);
    assert!(
        changes.escalations.contains(&ChangeKind::PriorityIncrease),
        "{}",
        render_human(&d)
    );
    let needs = kiln::governance::approval::needs(&old.approvals, &changes);
    assert!(
        needs
            .iter()
            .any(|n| n.count == 2 && n.group == "platform-leads"),
        "{needs:?}"
    );
}

const SUBSTITUTION: &str = r#"
pool big { gpus 2 kind "H100-80GB" memory 80GB }
pool small { gpus 2 kind "L40S-48GB" memory 48GB }
model large {
  variant fp16 { memory 70GB pools [big] }
}
model small-m {
  variant fp16 { memory 18GB pools [small] }
}
tier chat { priority 100 slo { ttft 5s } }
tier batch { priority 10 slo { window 6h } preemptible }
tenant app { owner "o" tiers [chat] }
classify {
  when tenant == app => tier chat
  default => tier batch
}
route [chat, batch] large {
  when pool(big).utilization < 90% => fp16 on big
  default => fallback
}
route [chat, batch] small-m { default => fp16 }
fallback [chat, batch] [route small-m.fp16 on small, queue 5s]
"#;

#[test]
fn a_declared_substitution_is_a_route_change_added_changed_and_removed() {
    let old = SUBSTITUTION.to_string();
    let new = edit(
        &old,
        "  variant fp16 { memory 70GB pools [big] }\n}",
        "  variant fp16 { memory 70GB pools [big] }\n  served_by small-m { tiers [chat] }\n}",
    );
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    assert_eq!(
        rows(&d),
        [(
            ChangeOp::Added,
            "model large served_by small-m",
            None,
            None,
            Some("tiers [chat], response_model served"),
            ChangeKind::RouteChange
        )],
        "{}",
        render_human(&d)
    );
    let wider = edit(
        &new,
        "served_by small-m { tiers [chat] }",
        "served_by small-m { tiers [chat, batch] response_model requested }",
    );
    let d = semantic(&b, &policy_text(&wider));
    let got = rows(&d);
    assert_eq!(
        got,
        [
            (
                ChangeOp::Changed,
                "model large served_by small-m",
                Some("tiers"),
                Some("[chat]"),
                Some("[batch, chat]"),
                ChangeKind::RouteChange
            ),
            (
                ChangeOp::Changed,
                "model large served_by small-m",
                Some("response_model"),
                Some("served"),
                Some("requested"),
                ChangeKind::RouteChange
            ),
        ],
        "{}",
        render_human(&d)
    );
    let d = semantic(&b, &a);
    let c = only(&d);
    assert_eq!(
        (c.kind, c.subject.as_str(), c.change_kind),
        (
            ChangeOp::Removed,
            "model large served_by small-m",
            ChangeKind::RouteChange
        )
    );
}

#[test]
fn a_reserve_added_or_raised_is_a_quota_increase_and_lowered_a_tier_change() {
    let old = enterprise_text();
    let base = "  slo { window 6h }\n  batch { max_wait 5s }\n";
    let reserved = edit(&old, base, &format!("{base}  reserve {{ shared 10% }}\n"));
    let d = semantic(&policy_text(&old), &policy_text(&reserved));
    let c = only(&d);
    assert_eq!(c.subject, "tier batch");
    assert_eq!(c.field.as_deref(), Some("reserve.shared"));
    assert_eq!(
        (c.old.as_deref(), c.new.as_deref()),
        (Some("none"), Some("10%"))
    );
    assert_eq!(c.change_kind, ChangeKind::QuotaIncrease);
    assert!(c.escalation);
    let raised = edit(
        &reserved,
        "reserve { shared 10% }",
        "reserve { shared 30% }",
    );
    let d = semantic(&policy_text(&reserved), &policy_text(&raised));
    assert_eq!(only(&d).change_kind, ChangeKind::QuotaIncrease);
    // Lowered or removed: gives capacity back, not an escalation.
    for (a, b) in [(&raised, &reserved), (&reserved, &old)] {
        let d = semantic(&policy_text(a), &policy_text(b));
        let c = only(&d);
        assert_eq!(c.change_kind, ChangeKind::TierChange);
        assert!(!c.escalation);
    }
    // A fair-share window is a tier change.
    let windowed = edit(&old, base, &format!("{base}  fair_share {{ window 5m }}\n"));
    let d = semantic(&policy_text(&old), &policy_text(&windowed));
    let c = only(&d);
    assert_eq!(c.field.as_deref(), Some("fair_share.window"));
    assert_eq!(c.change_kind, ChangeKind::TierChange);
}

#[test]
fn a_tier_or_model_quota_raised_or_removed_is_a_quota_increase() {
    let old = enterprise_text();
    let base = "  slo { window 6h }\n  batch { max_wait 5s }\n";
    let limited = edit(
        &old,
        base,
        &format!("{base}  quota {{ tokens 1M/min concurrent 10 }}\n"),
    );
    // Added: a limit where there was none, not an escalation.
    let d = semantic(&policy_text(&old), &policy_text(&limited));
    assert!(d.changes.iter().all(|c| !c.escalation), "{:?}", d.changes);
    assert!(d
        .changes
        .iter()
        .all(|c| c.subject == "tier batch" && c.change_kind == ChangeKind::TierChange));
    let raised = edit(
        &limited,
        "tokens 1M/min concurrent 10",
        "tokens 2M/min concurrent 10",
    );
    let d = semantic(&policy_text(&limited), &policy_text(&raised));
    let c = only(&d);
    assert_eq!(c.field.as_deref(), Some("quota.tokens"));
    assert_eq!(c.change_kind, ChangeKind::QuotaIncrease);
    assert!(c.escalation);
    let d = semantic(&policy_text(&limited), &policy_text(&old));
    assert!(d
        .changes
        .iter()
        .all(|c| c.escalation && c.change_kind == ChangeKind::QuotaIncrease));
    // A model's GPU-seconds a day.
    let m = edit(
        &old,
        "model llama-70b {\n",
        "model llama-70b {\n  quota { gpu_seconds 10k/day }\n",
    );
    let m2 = edit(&m, "gpu_seconds 10k/day", "gpu_seconds 20k/day");
    let d = semantic(&policy_text(&m), &policy_text(&m2));
    let c = only(&d);
    assert_eq!(c.subject, "model llama-70b");
    assert_eq!(c.field.as_deref(), Some("quota.gpu_seconds"));
    assert_eq!(c.change_kind, ChangeKind::QuotaIncrease);
    let d = semantic(&policy_text(&m2), &policy_text(&m));
    assert_eq!(only(&d).change_kind, ChangeKind::RouteChange);
}

#[test]
fn completion_windows_changed_is_a_tier_change_and_their_order_is_not() {
    let old = enterprise_text();
    let base = "  completion_windows [1h, 24h]\n";
    let reordered = edit(&old, base, "  completion_windows [24h, 1h]\n");
    let d = semantic(&policy_text(&old), &policy_text(&reordered));
    assert!(d.changes.is_empty(), "{:?}", d.changes);
    let longer = edit(&old, base, "  completion_windows [1h, 24h, 7d]\n");
    let d = semantic(&policy_text(&old), &policy_text(&longer));
    let c = only(&d);
    assert_eq!(c.subject, "tier batch");
    assert_eq!(c.field.as_deref(), Some("completion_windows"));
    assert_eq!(c.old.as_deref(), Some("[1h, 24h]"));
    assert_eq!(c.new.as_deref(), Some("[1h, 24h, 168h]"));
    assert_eq!(c.change_kind, ChangeKind::TierChange);
    assert!(!c.escalation);
}

/// A rule reading `batch` gets a witness request that is a batch item (an
/// `x-kiln-batch` header), decided differently under the two policies.
#[test]
fn a_rule_on_the_batch_signal_has_a_batch_item_for_a_witness() {
    let old = enterprise_text();
    let rule = "  when tenant == analytics => tier batch\n";
    let new = edit(
        &old,
        rule,
        "  when tenant == analytics and batch => tier batch\n  when tenant == analytics => tier evaluation\n",
    );
    let (og, ng) = (policy_text(&old), policy_text(&new));
    let d = semantic(&og, &ng);
    assert!(
        d.decisions
            .iter()
            .any(|x| x.request.contains("tenant=analytics") && !x.request.contains("x-kiln-batch")),
        "{:?}",
        d.decisions
    );
    check_decisions(&og, &ng, &d);
    let items: Vec<_> = witnesses(&og, &ng)
        .into_iter()
        .filter(|r| r.batch().is_some())
        .collect();
    assert!(!items.is_empty(), "a witness that is a batch item");
    for r in &items {
        assert_eq!(
            og.view(&og.decide(r, &Signals::idle(&og))).tier,
            ng.view(&ng.decide(r, &Signals::idle(&ng))).tier
        );
    }
}

#[test]
fn stage_changes_read_by_stage_name() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/split");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).expect("read");
    let teams = format!(
        "{}\n{}",
        read("team-assistants.kiln"),
        read("team-search.kiln")
    );
    let old = format!("{}\n{teams}", read("platform.kiln"));
    let new = edit(&old, "    share 50%\n", "    share 25%\n");
    let new = edit(
        &new,
        "    gate when tier(interactive).ttft_p95 < 2s for 1h\n",
        "",
    );
    let new = edit(
        &new,
        "  stage pilot {\n    tenants [query-rewrite, assistant-evals]\n    duration 2h\n  }\n",
        "",
    );
    let (a, b) = (policy_text(&old), policy_text(&new));
    let d = semantic(&a, &b);
    let human = render_human(&d);
    for line in [
        "  - stage pilot: tenants [assistant-evals, query-rewrite] for 2h  [rollout_change]",
        "  ~ stage.half.share: 50% → 25%  [rollout_change]",
        "  - stage half: gate when tier(interactive).ttft_p95 < 2s for 1h  [rollout_change]",
        "  ~ stages: [pilot, batch-8b, half] → [batch-8b, half]  [rollout_change]",
    ] {
        assert!(human.contains(line), "missing {line:?} in:\n{human}");
    }
    assert!(d
        .changes
        .iter()
        .filter(|c| c.subject == "rollout")
        .all(|c| c.change_kind == ChangeKind::RolloutChange));
}
