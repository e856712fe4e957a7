//! Every diagnostic code, shown as the user sees it: one small policy per
//! code, its rendered output kept as an insta snapshot. A meta test fails
//! when a code is added without a case here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::compile::{compile_str, lint};
use kiln::diag::{render, Code, Diagnostics};
use std::collections::BTreeSet;

const BASE: &str = r#"pool gpu { gpus 4 kind "H100-80GB" memory 80GB }

model m {
  variant fp16 { memory 40GB pools [gpu] }
}

tier chat {
  priority 100
  slo { ttft 500ms }
}

tier bulk {
  priority 10
  slo { window 6h }
  preemptible
}

tenant app {
  owner "app-team@example.com"
  tiers [chat, bulk]
}

classify {
  when tenant == app => tier chat
  default => tier bulk
}

route [chat, bulk] m {
  default => fp16
}
"#;

fn with(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "base has no `{from}`");
    BASE.replacen(from, to, 1)
}

fn plus(extra: &str) -> String {
    format!("{BASE}\n{extra}\n")
}

/// A second, smaller model both tiers route: the substitute in the
/// cross-model cases.
const SMALL: &str = "model s {\n  variant fp16 { memory 10GB pools [gpu] }\n}\n\nroute [chat, bulk] s {\n  default => fp16\n}";

/// The base plus model `s`, with `model m` declaring `decl` and the route
/// block for `m` deciding `route`.
fn substituting(decl: &str, route: &str) -> String {
    with(
        "  variant fp16 { memory 40GB pools [gpu] }\n}",
        &format!("  variant fp16 {{ memory 40GB pools [gpu] }}\n{decl}}}"),
    )
    .replacen(
        "route [chat, bulk] m {\n  default => fp16\n}",
        &format!("route [chat, bulk] m {{\n  default => {route}\n}}"),
        1,
    ) + "\n"
        + SMALL
        + "\n"
}

/// (snapshot name, policy text, the code it must produce)
fn cases() -> Vec<(&'static str, String, Code)> {
    vec![
        ("syntax", with("when tenant == app", "when tenant = app"), Code::Syntax),
        ("syntax_missing_brace", with("  slo { ttft 500ms }\n}", "  slo { ttft 500ms }\n"), Code::Syntax),
        ("syntax_keyword_typo", with("  default => tier bulk", "  defualt => tier bulk"), Code::Syntax),
        ("syntax_unclosed", with("route [chat, bulk] m {\n  default => fp16\n}", "route [chat, bulk] m {\n  default => fp16\n"), Code::Syntax),
        ("duplicate_definition", plus("tier chat { priority 5 slo { ttft 1s } }"), Code::DuplicateDefinition),
        ("unknown_name", with("tiers [chat, bulk]", "tiers [chat, bulkk]"), Code::UnknownName),
        ("unknown_signal", with("when tenant == app", "when tennant == app"), Code::UnknownName),
        ("unknown_field", with("priority 100", "prority 100"), Code::UnknownField),
        ("missing_field", with("gpus 4 kind", "kind"), Code::MissingField),
        ("unit_mismatch_field", with("ttft 500ms", "ttft 85%"), Code::UnitMismatch),
        (
            "unit_mismatch_compare",
            with("when tenant == app => tier chat", "when tier(chat).oldest_wait > 85% => tier chat"),
            Code::UnitMismatch,
        ),
        ("invalid_value", with("memory 80GB }", "memory 80GB }\npool small { gpus 0 kind \"L4\" memory 24GB }"), Code::InvalidValue),
        ("invalid_value_deadline", with("  slo { window 6h }", "  slo { window 6h deadline sofft }"), Code::InvalidValue),
        ("missing_field_throughput", with("  slo { window 6h }", "  slo { window 6h throughput { } }"), Code::MissingField),
        ("invalid_value_throughput_zero", with("  slo { window 6h }", "  slo { window 6h throughput { tokens 0/s } }"), Code::InvalidValue),
        ("invalid_value_budget_per_hour", with("  tiers [chat, bulk]\n}", "  tiers [chat, bulk]\n  budget 40/h\n}"), Code::InvalidValue),
        ("invalid_value_rate_per_month", with("  tiers [chat, bulk]\n}", "  tiers [chat, bulk]\n  quota { tokens 2M/month }\n}"), Code::InvalidValue),
        ("invalid_value_on_preempt", with("  preemptible\n}", "  preemptible\n  on_preempt rejekt\n}"), Code::InvalidValue),
        ("invalid_value_on_preempt_not_preemptible", with("  slo { ttft 500ms }\n}", "  slo { ttft 500ms }\n  on_preempt reject\n}"), Code::InvalidValue),
        ("out_of_range", with("gpus 4 kind", "gpus 99999999999999999999999999 kind"), Code::OutOfRange),
        ("invalid_outcome", with("when tenant == app => tier chat", "when tenant == app => accept"), Code::InvalidOutcome),
        ("missing_default", with("  default => tier bulk\n", ""), Code::MissingDefault),
        ("rule_after_default", with("  default => tier bulk\n", "  default => tier bulk\n  when tenant == app => tier bulk\n"), Code::RuleAfterDefault),
        ("missing_piece", with("classify {\n  when tenant == app => tier chat\n  default => tier bulk\n}\n", ""), Code::MissingPiece),
        ("no_route", with("route [chat, bulk] m", "route [chat] m"), Code::NoRoute),
        (
            "no_terminal",
            plus("admit chat {\n  when estimated_wait > 2s => fallback\n  default => accept\n}"),
            Code::NoTerminal,
        ),
        (
            "fallback_cycle",
            plus("admit [chat, bulk] {\n  when estimated_wait > 2s => fallback\n  default => accept\n}\nfallback chat [demote bulk]\nfallback bulk [demote chat]"),
            Code::FallbackCycle,
        ),
        (
            "fallback_not_terminal",
            plus("admit chat {\n  when estimated_wait > 2s => fallback\n  default => accept\n}\nfallback chat [route m.fp16 on gpu]"),
            Code::FallbackNotTerminal,
        ),
        (
            "preempt_cycle",
            with("  preemptible\n}", "  preemptible\n  preempts [chat]\n}").replacen("slo { ttft 500ms }", "slo { ttft 500ms }\n  preemptible\n  preempts [bulk]", 1),
            Code::PreemptCycle,
        ),
        ("variant_does_not_fit", with("memory 40GB pools [gpu]", "memory 140GB pools [gpu]"), Code::VariantDoesNotFit),
        (
            "isolation_violation",
            with("memory 80GB }", "memory 80GB deny_tiers [bulk] }"),
            Code::IsolationViolation,
        ),
        (
            "undeclared_substitution_route",
            substituting("", "s.fp16 on gpu"),
            Code::UndeclaredSubstitution,
        ),
        (
            "undeclared_substitution_route_tier",
            substituting("  served_by s { tiers [bulk] }\n", "s.fp16 on gpu"),
            Code::UndeclaredSubstitution,
        ),
        (
            "undeclared_substitution_fallback",
            with("  priority 100\n", "  priority 100\n  models [m]\n")
                + "\nmodel s {\n  variant fp16 { memory 10GB pools [gpu] }\n}\n\nroute bulk s {\n  default => fp16\n}\n\nadmit chat {\n  when estimated_wait > 2s => fallback\n  default => accept\n}\n\nfallback chat [route s.fp16 on gpu, queue 5s]\n",
            Code::UndeclaredSubstitution,
        ),
        (
            "undeclared_substitution_degrade",
            substituting("", "fp16")
                + "\nadmit chat {\n  when estimated_wait > 2s => degrade variant s.fp16\n  default => accept\n}\n",
            Code::UndeclaredSubstitution,
        ),
        ("served_by_itself", substituting("  served_by m { tiers [bulk] }\n", "fp16"), Code::InvalidValue),
        ("served_by_unknown_model", substituting("  served_by ss { tiers [bulk] }\n", "fp16"), Code::UnknownName),
        ("served_by_without_tiers", substituting("  served_by s { response_model served }\n", "fp16"), Code::MissingField),
        ("served_by_malformed", substituting("  served_by s\n", "fp16"), Code::InvalidValue),
        (
            "served_by_twice",
            substituting("  served_by s { tiers [bulk] }\n  served_by s { tiers [chat] }\n", "fp16"),
            Code::DuplicateDefinition,
        ),
        (
            "served_by_response_model",
            substituting("  served_by s { tiers [bulk] response_model requsted }\n", "fp16"),
            Code::InvalidValue,
        ),
        (
            "served_by_tier_cannot_use",
            substituting("  served_by s { tiers [chat] }\n", "fp16")
                .replacen("  priority 100\n", "  priority 100\n  models [m]\n", 1)
                .replacen("route [chat, bulk] s", "route bulk s", 1),
            Code::InvalidValue,
        ),
        (
            "served_by_not_routable",
            substituting("  served_by s { tiers [bulk] }\n", "fp16")
                .replacen("memory 80GB }", "memory 80GB }\npool small { gpus 2 kind \"L4\" memory 24GB allow_tiers [chat] }", 1)
                .replacen("variant fp16 { memory 10GB pools [gpu] }", "variant fp16 { memory 10GB pools [small] }", 1)
                ,
            Code::IsolationViolation,
        ),
        (
            "shadowed_rule",
            with("  when tenant == app => tier chat\n", "  when tenant == app => tier chat\n  when tenant == app and has_session => tier bulk\n"),
            Code::ShadowedRule,
        ),
        (
            "quota_oversubscribed",
            with("  tiers [chat, bulk]\n", "  tiers [chat, bulk]\n  quota { gpu_seconds 400k/day }\n"),
            Code::QuotaOversubscribed,
        ),
        ("tier_without_slo", with("  priority 10\n  slo { window 6h }\n", "  priority 10\n"), Code::TierWithoutSlo),
        ("tenant_without_owner", with("  owner \"app-team@example.com\"\n", ""), Code::TenantWithoutOwner),
        (
            "preempts_higher_priority",
            with("  preemptible\n}", "  preemptible\n  preempts [chat]\n}").replacen("slo { ttft 500ms }", "slo { ttft 500ms }\n  preemptible", 1),
            Code::PreemptsHigherPriority,
        ),
        ("unused_definition", plus("pool spare { gpus 2 kind \"L4\" memory 24GB }"), Code::UnusedDefinition),
        (
            "tier_not_granted",
            with("tiers [chat, bulk]", "tiers [bulk]").replacen("default => tier bulk", "default => tier bulk\n", 1),
            Code::TierNotGranted,
        ),
        (
            "dead_rule",
            with("  when tenant == app => tier chat\n", "  when tenant == app => tier chat\n  when tier(chat).deadline_misses > 0 => tier bulk\n"),
            Code::DeadRule,
        ),
        (
            "signal_redefined",
            with("  when tenant == app => tier chat\n", "  when tenant == app => tier chat\n  when tier(chat).wait_p95 > 2s => tier bulk\n"),
            Code::SignalRedefined,
        ),
        (
            "renamed_signal",
            with("  when tenant == app => tier chat\n", "  when tenant == app => tier chat\n  when pool(gpu).queue_depth > 4 => tier bulk\n"),
            Code::UnknownField,
        ),
        (
            "estimated_wait_outside_admit",
            with("  when tenant == app => tier chat\n", "  when tenant == app => tier chat\n  when estimated_wait > 2s => tier bulk\n"),
            Code::InvalidValue,
        ),
        (
            "signal_window_out_of_range",
            with("  preemptible\n}", "  preemptible\n  signal_window 2d\n}"),
            Code::OutOfRange,
        ),
        (
            "signal_window_too_short",
            with("  preemptible\n}", "  preemptible\n  signal_window 100ms\n}"),
            Code::InvalidValue,
        ),
        (
                        "reserve_oversubscribed",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  reserve { gpu 60% }\n")
                .replacen("  slo { window 6h }\n", "  slo { window 6h }\n  reserve { gpu 50% }\n", 1),
            Code::ReserveOversubscribed,
        ),
        (
            "reserve_unreachable",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  reserve { spare 25% }\n")
                .replacen("memory 80GB }", "memory 80GB }\npool spare { gpus 2 kind \"L4\" memory 24GB }", 1),
            Code::ReserveUnreachable,
        ),
        (
            "reserve_twice",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  reserve { gpu 10% gpu 20% }\n"),
            Code::DuplicateDefinition,
        ),
        (
            "reserve_nothing",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  reserve { gpu 0% }\n"),
            Code::InvalidValue,
        ),
        (
            "reserve_share_not_a_percentage",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  reserve { gpu 2 }\n"),
            Code::UnitMismatch,
        ),
        (
            "fair_share_window_out_of_range",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  fair_share { window 10ms }\n"),
            Code::OutOfRange,
        ),
        (
            "reserve_on_dedicated_pool",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  reserve { own 50% }\n")
                .replacen("  slo { window 6h }\n", "  slo { window 6h }\n  models [m]\n", 1)
                .replacen(
                    "memory 80GB }",
                    "memory 80GB }\npool own { gpus 2 kind \"H100-80GB\" memory 80GB }\nmodel big { variant fp16 { memory 40GB pools [own] } }\nroute chat big { default => fp16 }",
                    1,
                ),
            Code::ReserveOnDedicatedPool,
        ),
        (
            "infeasible_slo",
            with("  slo { ttft 500ms }\n", "  slo { ttft 1ms }\n"),
            Code::InfeasibleSlo,
        ),
        (
            "unknown_lint",
            plus("# kiln:allow(unused-defintion)\npool spare { gpus 2 kind \"L4\" memory 24GB }"),
            Code::UnknownLint,
        ),
        (
            "duplicate_api_key",
            with("  tiers [chat, bulk]\n}", "  tiers [chat, bulk]\n  api_keys [\"key-app\"]\n}")
                + "\ntenant other {\n  owner \"o@example.com\"\n  tiers [bulk]\n  api_keys [\"key-other\", \"key-app\"]\n}\n",
            Code::DuplicateDefinition,
        ),
        (
            "duplicate_api_key_same_tenant",
            with("  tiers [chat, bulk]\n}", "  tiers [chat, bulk]\n  api_keys [\"key-app\", \"key-app\"]\n}"),
            Code::DuplicateDefinition,
        ),
        ("time_hour_out_of_range", with("when tenant == app", "when time in 09:00..25:00"), Code::OutOfRange),
        ("time_minute_out_of_range", with("when tenant == app", "when time >= 09:75"), Code::OutOfRange),
        ("time_end_of_day_not_range_end", with("when tenant == app", "when time == 24:00"), Code::OutOfRange),
        ("time_range_empty", with("when tenant == app", "when time in 09:00..09:00"), Code::InvalidValue),
        ("syntax_unpadded_time", with("when tenant == app", "when time in 9:00..18:00"), Code::Syntax),
        ("syntax_unpadded_minutes", with("when tenant == app", "when time >= 09:5"), Code::Syntax),
        ("percent_share_above_100", with("when tenant == app", "when pool(gpu).utilization < 900%"), Code::OutOfRange),
        ("duration_without_unit", with("ttft 500ms", "ttft 500"), Code::UnitMismatch),
        (
            "time_range_wraps_business_hours",
            plus("admit bulk {\n  when time in 20:00..08:00 => delay until 20:00\n  default => accept\n}"),
            Code::TimeRangeWraps,
        ),
        ("time_range_wraps", with("when tenant == app", "when time in 22:00..06:30"), Code::TimeRangeWraps),
        ("absent_header_matches", with("when tenant == app", "when header(\"x-kiln-batch\") != \"\""), Code::AbsentHeaderMatches),
        (
            "shadowed_rule_numeric",
            plus("admit chat {\n  when estimated_wait > 2s => queue max_wait 10s\n  when estimated_wait > 5s => reject 429\n  default => accept\n}"),
            Code::ShadowedRule,
        ),
        (
            "shadowed_rule_numeric_units",
            plus("admit chat {\n  when estimated_wait >= 1500ms and has_session => queue max_wait 10s\n  when has_session and 2s < estimated_wait => reject 429\n  default => accept\n}"),
            Code::ShadowedRule,
        ),
        (
            "unreachable_limit",
            with("  tiers [chat, bulk]\n", "  tiers [chat, bulk]\n  quota { concurrent 100000 }\n"),
            Code::UnreachableLimit,
        ),
        (
            "feature_not_built",
            with("  slo { ttft 500ms }\n", "  slo { ttft 500ms }\n  cache { semantic { similarity 0.92 } }\n"),
            Code::FeatureNotBuilt,
        ),
        (
            "rollback_on_few_samples",
            plus("rollout {\n  canary { share 5% }\n  rollback when tier(chat).ttft_p95 < 100ms\n}"),
            Code::RollbackOnFewSamples,
        ),
        (
            "rollback_on_few_samples_requests",
            plus("rollout {\n  canary { share 5% }\n  rollback when tier(chat).requests > 3 and tier(chat).slo_attainment <= 100%\n}"),
            Code::RollbackOnFewSamples,
        ),
        (
            "rollback_on_shared_pool",
            plus("rollout {\n  canary { share 5% }\n  rollback when tier(chat).ttft_p95 > 2s or pool(gpu).kv_occupancy > 95%\n}"),
            Code::RollbackOnSharedPool,
        ),
        ("date_not_a_day", with("when tenant == app", "when date >= 2027-02-29"), Code::OutOfRange),
        ("date_range_backwards", with("when tenant == app", "when date in 2027-01-02..2026-12-28"), Code::InvalidValue),
        ("day_of_month_out_of_range", with("when tenant == app", "when day in 28..32"), Code::OutOfRange),
        ("date_compared_with_a_time", with("when tenant == app", "when date >= 09:00"), Code::UnitMismatch),
        ("unknown_timezone", plus("policy { timezone \"Europe/Berln\" }"), Code::InvalidValue),
        ("timezone_not_quoted", plus("policy { timezone 5 }"), Code::UnitMismatch),
        ("policy_block_unknown_field", plus("policy { timezon \"UTC\" }"), Code::UnknownField),
        ("duplicate_policy_block", plus("policy { timezone \"UTC\" }\npolicy { timezone \"Europe/Berlin\" }"), Code::DuplicateDefinition),
        ("owner_empty", with("  priority 100\n", "  priority 100\n  owner \"\"\n"), Code::InvalidValue),
        ("owner_not_quoted", with("memory 80GB }", "memory 80GB owner gpu-infra }"), Code::UnitMismatch),
        ("escalation_without_owner", with("  priority 10\n", "  priority 10\n  escalation \"oncall\"\n"), Code::MissingField),
        ("owner_unresolved", plus("approval {\n  require owner for [tenant_change, quota_increase]\n}"), Code::OwnerUnresolved),
        ("syntax_require_owner_with_count", plus("approval {\n  require 1 owner for [tenant_change]\n}"), Code::Syntax),
        ("pool_price_without_rate", with("memory 80GB }", "memory 80GB price 3.2 }"), Code::UnitMismatch),
        ("syntax_rate_period_spelt_out", with("  tiers [chat, bulk]\n", "  tiers [chat, bulk]\n  quota { tokens 2M/minute }\n"), Code::Syntax),
        ("syntax_cost_with_currency", with("  tiers [chat, bulk]\n", "  tiers [chat, bulk]\n  cost $3.20/hour\n"), Code::Syntax),
        (
            "exception_too_long",
            plus("exception autumn {\n  tier bulk\n  dates 2026-11-01..2026-12-31\n  priority 50\n  reason \"launch season\"\n}"),
            Code::ExceptionTooLong,
        ),
        (
            "exception_ends_before_it_starts",
            plus("exception close {\n  tier bulk\n  dates 2027-01-02..2026-12-28\n  priority 50\n  reason \"quarter-end close\"\n}"),
            Code::InvalidValue,
        ),
        (
            "exception_not_a_date",
            plus("exception close {\n  tier bulk\n  dates 2027-02-27..2027-02-29\n  priority 50\n  reason \"quarter-end close\"\n}"),
            Code::OutOfRange,
        ),
        (
            "exception_lowers_priority",
            plus("exception close {\n  tier chat\n  dates 2026-12-28..2027-01-02\n  priority 50\n  reason \"quarter-end close\"\n}"),
            Code::InvalidValue,
        ),
        (
            "exception_quota_not_declared",
            plus("exception launch {\n  tenant app\n  dates 2026-11-23..2026-11-29\n  quota { tokens 4M/min }\n  reason \"launch week\"\n}"),
            Code::InvalidValue,
        ),
        (
            "exception_priority_to_a_tenant",
            plus("exception launch {\n  tenant app\n  dates 2026-11-23..2026-11-29\n  priority 200\n  reason \"launch week\"\n}"),
            Code::InvalidValue,
        ),
        (
            "exception_without_subject",
            plus("exception launch {\n  dates 2026-11-23..2026-11-29\n  priority 200\n  reason \"launch week\"\n}"),
            Code::MissingField,
        ),
        (
            "exception_grants_nothing",
            plus("exception launch {\n  tier bulk\n  dates 2026-11-23..2026-11-29\n  reason \"launch week\"\n}"),
            Code::MissingField,
        ),
        (
            "duration_without_unit_seconds",
            plus("admit chat {\n  when estimated_wait > 2 => queue max_wait 2\n  default => accept\n}"),
            Code::UnitMismatch,
        ),
    ]
}

fn diagnose(text: &str) -> (kiln::source::SourceMap, Diagnostics) {
    let c = compile_str("policy.kiln", text);
    let mut all = c.diagnostics.clone();
    if !c.has_errors() {
        all.extend(lint(&c));
        // The cost model's lints, as `kiln lint` runs them.
        if let Some(g) = &c.graph {
            all.extend(kiln::ops::feasibility::lint(g));
        }
        // What `kiln check` and `kiln lint` report on a default build.
        all.extend(kiln::compile::build_features(&c, false));
    }
    all.sort();
    (c.sources.clone(), all)
}

#[test]
fn owners_everywhere_leave_require_owner_clean() {
    let text = with("memory 80GB }", "memory 80GB owner \"gpu-infra\" }").replacen(
        "  priority 100\n",
        "  priority 100\n  owner \"chat-team\"\n  escalation \"chat-oncall\"\n",
        1,
    )
        + "\npolicy { owner \"platform\" }\napproval {\n  require owner for [tenant_change]\n}\n";
    let (_, d) = diagnose(&text);
    assert!(
        d.is_empty(),
        "{:?}",
        d.items.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
    let c = compile_str("policy.kiln", &text);
    let g = c.graph.as_ref().expect("compiles");
    let chat = g.tier_id("chat").expect("chat");
    let bulk = g.tier_id("bulk").expect("bulk");
    assert_eq!(g.tier_owner(chat).owner.as_deref(), Some("chat-team"));
    assert_eq!(
        g.tier_owner(chat).escalation.as_deref(),
        Some("chat-oncall")
    );
    // A tier without an owner falls back to the policy's.
    assert_eq!(g.tier_owner(bulk).owner.as_deref(), Some("platform"));
    assert_eq!(g.pool_owner(0).owner.as_deref(), Some("gpu-infra"));
    assert!(g.approvals[0].owner);
    // Without the policy's owner, bulk has none: the lint names it.
    let text = text.replace("policy { owner \"platform\" }", "");
    let (_, d) = diagnose(&text);
    let msgs: Vec<&String> = d.items.iter().map(|d| &d.message).collect();
    assert_eq!(d.items.len(), 1, "{msgs:?}");
    assert!(msgs[0].contains("the policy, tier `bulk`"), "{msgs:?}");
    assert!(!msgs[0].contains("`chat`"), "{msgs:?}");
}

#[test]
fn base_policy_is_clean() {
    let (_, d) = diagnose(BASE);
    assert!(
        d.is_empty(),
        "{:?}",
        d.items.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
}

#[test]
fn every_code_renders_as_snapshotted() {
    for (name, text, code) in cases() {
        let (sources, diags) = diagnose(&text);
        assert!(
            diags.items.iter().any(|d| d.code == code),
            "case {name}: expected {code}, got {:?}",
            diags
                .items
                .iter()
                .map(|d| (d.code, &d.message))
                .collect::<Vec<_>>()
        );
        let rendered: String = diags
            .items
            .iter()
            .map(|d| render(d, &sources, false))
            .collect();
        insta::assert_snapshot!(name, rendered);
    }
}

#[test]
fn io_error_renders() {
    let err = kiln::compile::load(&["does/not/exist.kiln".into()]).expect_err("missing file");
    assert_eq!(err.items[0].code, Code::Io);
    let rendered = render(&err.items[0], &kiln::source::SourceMap::new(), false);
    // The OS message differs between systems; the code and the path do not.
    assert!(rendered.contains("kiln::io"));
    assert!(rendered.contains("does/not/exist.kiln"));
    insta::assert_snapshot!(
        "io",
        rendered
            .lines()
            .filter(|l| !l.contains("No such file"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn every_code_has_a_case() {
    let mut covered: BTreeSet<Code> = cases().into_iter().map(|c| c.2).collect();
    covered.insert(Code::Io);
    let missing: Vec<_> = Code::ALL.iter().filter(|c| !covered.contains(c)).collect();
    assert!(
        missing.is_empty(),
        "codes without a snapshot case: {missing:?}"
    );
}

#[test]
fn check_reports_all_errors_at_once() {
    let text = with("tiers [chat, bulk]", "tiers [chatt, bulk]")
        .replacen("priority 100", "prority 100", 1)
        .replacen("ttft 500ms", "ttft 85%", 1);
    let (_, d) = diagnose(&text);
    let codes: BTreeSet<Code> = d.errors().map(|d| d.code).collect();
    assert!(codes.contains(&Code::UnknownName));
    assert!(codes.contains(&Code::UnknownField));
    assert!(codes.contains(&Code::UnitMismatch));
}

#[test]
fn lint_findings_can_be_silenced() {
    let text = with(
        "tenant app {",
        "# kiln:allow(tenant-without-owner)\ntenant app {",
    )
    .replacen("  owner \"app-team@example.com\"\n", "", 1);
    let (_, d) = diagnose(&text);
    assert!(
        d.is_empty(),
        "{:?}",
        d.items.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
}

#[test]
fn did_you_mean_suggests_close_names() {
    let (_, d) = diagnose(&with("tiers [chat, bulk]", "tiers [chat, blk]"));
    let e = d.errors().next().expect("an error");
    assert_eq!(e.help.as_deref(), Some("did you mean `bulk`?"));
}

#[test]
fn tier_not_granted_sees_tenant_lists() {
    let text = with("tiers [chat, bulk]", "tiers [bulk]").replacen(
        "when tenant == app => tier chat",
        "when tenant in [app] and has_session => tier chat",
        1,
    );
    let (_, d) = diagnose(&text);
    assert!(
        d.items.iter().any(|x| x.code == Code::TierNotGranted),
        "{:?}",
        d.items.iter().map(|x| &x.message).collect::<Vec<_>>()
    );
}

#[test]
fn completion_windows_are_checked_with_spans_and_help() {
    let tier = "  slo { window 6h }\n  preemptible\n";
    let ok = with(tier, &format!("{tier}  completion_windows [1h, 24h]\n"));
    let (_, d) = diagnose(&ok);
    assert!(
        d.is_empty(),
        "{:?}",
        d.items.iter().map(|x| &x.message).collect::<Vec<_>>()
    );
    let g = compile_str("p.kiln", &ok).graph.unwrap();
    assert_eq!(
        g.tiers[1].completion_windows,
        vec![3_600_000.0, 86_400_000.0]
    );
    assert_eq!(
        g.tiers[0].completion_windows,
        vec![86_400_000.0],
        "24h when absent"
    );
    let cases = [
        ("[30s]", Code::OutOfRange, "30s"),
        ("[1h, 8d]", Code::OutOfRange, "8d"),
        ("[1h, 60m]", Code::InvalidValue, "60m"),
        ("[]", Code::InvalidValue, "completion_windows []"),
        ("[5]", Code::UnitMismatch, "5"),
    ];
    for (list, code, at) in cases {
        let text = with(tier, &format!("{tier}  completion_windows {list}\n"));
        let (_, d) = diagnose(&text);
        let e = d
            .errors()
            .next()
            .unwrap_or_else(|| panic!("{list}: no error"));
        assert_eq!(e.code, code, "{list}: {}", e.message);
        let span = e.span.expect("a span");
        assert_eq!(&text[span.start as usize..span.end as usize], at, "{list}");
        assert!(e.help.is_some(), "{list}");
        assert_eq!(d.errors().count(), 1, "{list}");
    }
}

/// Every duration a policy gives, written as a bare number, is refused
/// with the number and its likeliest unit in the help (ms from 50, else s).
#[test]
fn every_duration_without_a_unit_suggests_one() {
    let admit = |outcome: &str| {
        plus(&format!(
            "admit chat {{\n  when estimated_wait > 2s => {outcome}\n  default => accept\n}}"
        ))
    };
    let cases: Vec<(String, &str)> = vec![
        (with("ttft 500ms", "ttft 500"), "`500ms`"),
        (
            with("slo { ttft 500ms }", "slo { ttft 500ms p95 30 }"),
            "`30s`",
        ),
        (
            with("slo { window 6h }", "slo { window 21600 }"),
            "`21600ms`",
        ),
        (
            with("  preemptible\n}", "  preemptible\n  signal_window 60\n}"),
            "`60ms`",
        ),
        (
            with(
                "  preemptible\n}",
                "  preemptible\n  completion_windows [24]\n}",
            ),
            "`24s`",
        ),
        (
            with(
                "  slo { ttft 500ms }\n",
                "  slo { ttft 500ms }\n  fair_share { window 10 }\n",
            ),
            "`10s`",
        ),
        (admit("queue max_wait 2"), "`2s`"),
        (admit("reject 429 \"busy\" retry_after 30"), "`30s`"),
        (
            with("when tenant == app", "when tier(chat).oldest_wait > 200"),
            "`200ms`",
        ),
    ];
    for (text, want) in cases {
        let (_, d) = diagnose(&text);
        let e = d
            .errors()
            .next()
            .unwrap_or_else(|| panic!("no error for {want}"));
        assert_eq!(e.code, Code::UnitMismatch, "{want}: {}", e.message);
        let help = e.help.as_deref().unwrap_or("");
        assert!(help.contains(want), "{want}: {help}");
        assert_eq!(d.errors().count(), 1, "{want}");
    }
}

/// Percentages of signals that are shares stop at 100%; properties that
/// are shares too (`reserve`, `borrow`, …) were already capped there.
#[test]
fn percent_signals_are_shares() {
    for sig in [
        "pool(gpu).utilization",
        "pool(gpu).kv_occupancy",
        "tier(chat).slo_attainment",
        "tier(chat).error_rate",
        "tier(chat).fallback_rate",
        "error_rate",
    ] {
        let (_, d) = diagnose(&with("when tenant == app", &format!("when {sig} > 101%")));
        assert!(
            d.errors()
                .any(|e| e.code == Code::OutOfRange && e.message.contains("share")),
            "{sig}: {:?}",
            d.items.iter().map(|x| &x.message).collect::<Vec<_>>()
        );
        let (_, d) = diagnose(&with("when tenant == app", &format!("when {sig} >= 100%")));
        assert_eq!(d.errors().count(), 0, "{sig} >= 100%");
    }
    // A share given as a property: above 100% is refused as one, with a span.
    let text = with(
        "  slo { ttft 500ms }\n",
        "  slo { ttft 500ms }\n  reserve { gpu 150% }\n",
    );
    let (_, d) = diagnose(&text);
    let e = d.errors().next().expect("an error");
    assert_eq!(e.code, Code::OutOfRange);
    assert!(e.message.contains("above 100%"), "{}", e.message);
    let span = e.span.expect("a span");
    assert_eq!(&text[span.start as usize..span.end as usize], "150%");
}

fn tier_at(text: &str, time: &str) -> String {
    use kiln::graph::{Request, Signals, SignalsInput};
    let g = compile_str("p.kiln", text).graph.expect("compiles");
    let req: Request = serde_json::from_str(r#"{"tenant": "app", "model": "m"}"#).unwrap();
    let sig = Signals::resolve(
        &g,
        &SignalsInput {
            time: Some(time.into()),
            ..Default::default()
        },
    )
    .unwrap();
    // `kiln explain` decides through `explain`: the same path, traced.
    let (d, _trace) = g.explain(&req, &sig);
    g.view(&d).tier
}

fn tier_on(text: &str, date: &str) -> String {
    use kiln::graph::{Request, Signals, SignalsInput};
    let g = compile_str("p.kiln", text).graph.expect("compiles");
    let req: Request = serde_json::from_str(r#"{"tenant": "app", "model": "m"}"#).unwrap();
    let sig = Signals::resolve(
        &g,
        &SignalsInput {
            date: Some(date.into()),
            ..Default::default()
        },
    )
    .unwrap();
    let (d, _trace) = g.explain(&req, &sig);
    g.view(&d).tier
}

/// Date and day-of-month ranges include both ends; a day range wraps the
/// month's end; every day of two years is decided as the calendar says.
#[test]
fn date_and_day_ranges_at_their_edges() {
    let close = with("when tenant == app", "when day in 28..2");
    let holidays = with("when tenant == app", "when date in 2026-12-24..2027-01-01");
    let from = with("when tenant == app", "when date >= 2027-02-28");
    let mut d = kiln::units::calendar::date_days(2026, 1, 1).unwrap();
    let end = kiln::units::calendar::date_days(2028, 1, 1).unwrap();
    while d < end {
        let text = kiln::units::calendar::show_date(d);
        let day: u8 = text[8..].parse().unwrap();
        let want = |b: bool| if b { "chat" } else { "bulk" };
        assert_eq!(
            tier_on(&close, &text),
            want(day >= 28 || day <= 2),
            "day in 28..2 on {text}"
        );
        assert_eq!(
            tier_on(&holidays, &text),
            want(("2026-12-24".."2027-01-02").contains(&text.as_str())),
            "holidays on {text}"
        );
        assert_eq!(
            tier_on(&from, &text),
            want(text.as_str() >= "2027-02-28"),
            "from on {text}"
        );
        d += 1;
    }
    // A signal file's `date` is checked like the policy's, and sets the weekday.
    let g = compile_str("p.kiln", &close).graph.unwrap();
    for bad in ["2027-02-29", "2026-13-01", "26-01-01", "2026-1-01"] {
        let r = kiln::graph::Signals::resolve(
            &g,
            &kiln::graph::SignalsInput {
                date: Some(bad.into()),
                ..Default::default()
            },
        );
        assert!(r.is_err(), "date {bad} accepted");
    }
    let s = kiln::graph::Signals::resolve(
        &g,
        &kiln::graph::SignalsInput {
            date: Some("2026-12-28".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((s.day, s.weekday), (28, 0));
}

/// A time range holds from its start (included) to its end (excluded);
/// a start after the end wraps midnight; `24:00` ends a range at midnight.
#[test]
fn time_ranges_at_their_edges() {
    let night = with("when tenant == app", "when time in 22:00..06:00");
    for (t, tier) in [
        ("21:59", "bulk"),
        ("22:00", "chat"),
        ("23:59", "chat"),
        ("00:00", "chat"),
        ("05:59", "chat"),
        ("06:00", "bulk"),
        ("12:00", "bulk"),
    ] {
        assert_eq!(tier_at(&night, t), tier, "22:00..06:00 at {t}");
    }
    let evening = with("when tenant == app", "when time in 18:00..24:00");
    for (t, tier) in [
        ("17:59", "bulk"),
        ("18:00", "chat"),
        ("23:59", "chat"),
        ("00:00", "bulk"),
    ] {
        assert_eq!(tier_at(&evening, t), tier, "18:00..24:00 at {t}");
    }
    let day = with("when tenant == app", "when time in 09:00..18:00");
    for (t, tier) in [
        ("08:59", "bulk"),
        ("09:00", "chat"),
        ("17:59", "chat"),
        ("18:00", "bulk"),
        ("23:30", "bulk"),
    ] {
        assert_eq!(tier_at(&day, t), tier, "09:00..18:00 at {t}");
    }
    // A signal file's `time` is checked as strictly as the policy's.
    let g = compile_str("p.kiln", &day).graph.unwrap();
    for bad in ["25:00", "24:00", "09:60", "9:00"] {
        let r = kiln::graph::Signals::resolve(
            &g,
            &kiln::graph::SignalsInput {
                time: Some(bad.into()),
                ..Default::default()
            },
        );
        assert!(r.is_err(), "time {bad} accepted");
    }
}

/// Issue 27: `kiln lint` tells the author which queue bound applies to a
/// tier that sets none (the gateway's `[limits] default_queue_bound`), as
/// a note: never a finding, so the base policy stays lint-clean.
#[test]
fn lint_notes_name_the_queue_bound_that_applies() {
    let c = compile_str("policy.kiln", BASE);
    let notes = kiln::compile::lint_notes(&c);
    insta::assert_snapshot!("lint_notes_queue_bound", notes.join("\n"));
    // A tier whose admission always queues with a bound gets none.
    let c = compile_str(
        "policy.kiln",
        &plus("admit chat {\n  default => queue max_wait 2s\n}\n"),
    );
    assert!(!c.has_errors());
    let notes = kiln::compile::lint_notes(&c);
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].starts_with("tier `bulk`"), "{notes:?}");
    // The note names the gateway's own default.
    assert_eq!(
        kiln::units::duration::parse(kiln::compile::DEFAULT_QUEUE_BOUND_TEXT),
        Ok(kiln::server::config::DEFAULT_QUEUE_BOUND)
    );
}

#[test]
fn unreachable_limit_names_the_gateways_defaults() {
    let limits = kiln::server::config::Limits::default();
    let batch = kiln::server::config::BatchSection::default();
    assert_eq!(
        kiln::compile::DEFAULT_GATEWAY_IN_FLIGHT,
        (limits.max_connections + batch.max_in_flight) as u64
    );
}

#[test]
fn rollback_on_few_samples_names_the_gateways_default() {
    assert_eq!(
        kiln::compile::DEFAULT_MIN_SAMPLES,
        kiln::server::config::GovernanceSection::default().min_samples
    );
}

#[test]
fn rollback_conditions_on_bad_values_are_not_flagged() {
    // Every signal compared against a bad value: quiet below min_samples.
    for cond in [
        "tier(chat).ttft_p95 > 2s",
        "tier(chat).error_rate > 20%",
        "tier(chat).fallback_rate > 20%",
        "tier(chat).slo_attainment < 90%",
        "tier(chat).requests >= 20 and tier(chat).wait_p99 > 1s",
        "pool(gpu).queued > 10",
        "pool(gpu).utilization > 97%",
        "error_rate > 2%",
        "tenant(app).deadline_misses > 0",
    ] {
        let (_, d) = diagnose(&plus(&format!(
            "rollout {{\n  canary {{ share 5% }}\n  rollback when {cond}\n}}"
        )));
        assert!(
            !d.items.iter().any(|d| d.code == Code::RollbackOnFewSamples),
            "{cond}: {:?}",
            d.items
        );
    }
    // A clock alone trips whenever it says, requests or none.
    let (_, d) = diagnose(&plus(
        "rollout {\n  canary { share 5% }\n  rollback when weekday in sat..sun\n}",
    ));
    assert!(
        d.items
            .iter()
            .any(|d| d.code == Code::RollbackOnFewSamples && d.message.contains("on sat at 00:00")),
        "{:?}",
        d.items
    );
}

#[test]
fn rollback_on_shared_pool_flags_the_pools_hardware_only_during_a_canary() {
    let flagged = |rollout: &str| {
        let (_, d) = diagnose(&plus(rollout));
        d.items
            .iter()
            .filter(|d| d.code == Code::RollbackOnSharedPool)
            .map(|d| d.message.clone())
            .collect::<Vec<_>>()
    };
    let hardware = [
        ("pool(gpu).utilization > 97%", "`pool(gpu).utilization`"),
        ("pool(gpu).kv_occupancy > 95%", "`pool(gpu).kv_occupancy`"),
        (
            "tier(chat).ttft_p95 > 2s or pool(gpu).utilization > 97%",
            "`pool(gpu).utilization`",
        ),
        (
            "error_rate > 2% and pool(gpu).kv_occupancy >= 90%",
            "`pool(gpu).kv_occupancy`",
        ),
    ];
    for canary in ["canary { share 5% }", "canary { tenants [app] }"] {
        for (cond, names) in hardware {
            let m = flagged(&format!(
                "rollout {{\n  {canary}\n  rollback when {cond}\n}}"
            ));
            assert_eq!(m.len(), 1, "{canary} {cond}: {m:?}");
            assert!(m[0].contains(names), "{cond}: {}", m[0]);
            // Silenced where it is meant.
            let m = flagged(&format!(
                "rollout {{\n  {canary}\n  # kiln:allow(rollback-on-shared-pool)\n  rollback when {cond}\n}}"
            ));
            assert!(m.is_empty(), "{cond} with allow: {m:?}");
        }
        // Signals measured on the canary's own requests: quiet.
        for cond in [
            "pool(gpu).queued > 10",
            "pool(gpu).running > 10",
            "tier(chat).error_rate > 20%",
            "tier(chat).fallback_rate > 20%",
            "tenant(app).deadline_misses > 0",
        ] {
            let m = flagged(&format!(
                "rollout {{\n  {canary}\n  rollback when {cond}\n}}"
            ));
            assert!(m.is_empty(), "{cond}: {m:?}");
        }
    }
    // No canary: the version is judged once it decides all traffic, where
    // the pool's load is its own.
    for (cond, _) in hardware {
        let m = flagged(&format!("rollout {{\n  rollback when {cond}\n}}"));
        assert!(m.is_empty(), "{cond} without a canary: {m:?}");
    }
}

#[test]
fn numeric_shadowing_needs_the_stronger_rule_second() {
    // The stricter threshold first is the right order: nothing is shadowed.
    let (_, d) = diagnose(&plus("admit chat {\n  when estimated_wait > 5s => reject 429\n  when estimated_wait > 2s => queue max_wait 10s\n  default => accept\n}"));
    assert!(
        !d.items.iter().any(|d| d.code == Code::ShadowedRule),
        "{:?}",
        d.items
    );
    // Ranges that only overlap do not shadow either.
    let (_, d) = diagnose(&plus("admit chat {\n  when estimated_wait > 2s and estimated_wait < 5s => reject 429\n  when estimated_wait > 3s => queue max_wait 10s\n  default => accept\n}"));
    assert!(
        !d.items.iter().any(|d| d.code == Code::ShadowedRule),
        "{:?}",
        d.items
    );
    // A daytime range is not a wrapping one, and a build with the
    // semantic cache accepts one.
    let (_, d) = diagnose(&with("when tenant == app", "when time in 08:00..20:00"));
    assert!(
        !d.items.iter().any(|d| d.code == Code::TimeRangeWraps),
        "{:?}",
        d.items
    );
    let c = compile_str(
        "policy.kiln",
        &with(
            "  slo { ttft 500ms }\n",
            "  slo { ttft 500ms }\n  cache { semantic { similarity 0.92 } }\n",
        ),
    );
    assert!(kiln::compile::build_features(&c, true).is_empty());
}

#[test]
fn rollout_stages_are_checked_with_a_span_and_a_help() {
    let errors = |rollout: &str| {
        let (_, d) = diagnose(&plus(rollout));
        d.items
            .iter()
            .map(|d| {
                (
                    d.code,
                    d.message.clone(),
                    d.span.is_some(),
                    d.help.is_some(),
                )
            })
            .collect::<Vec<_>>()
    };
    // A good one: quiet.
    let ok = errors(
        "rollout {\n  stage pilot {\n    tenants [app]\n    duration 30m\n  }\n  stage bulk5 {\n    tiers [bulk]\n    models [m]\n    share 5%\n    gate when tier(bulk).error_rate < 1% for 10m\n  }\n}",
    );
    assert!(ok.is_empty(), "{ok:?}");
    for (rollout, code, says) in [
        (
            "rollout {\n  stage a { share 5% }\n  stage a { share 50% }\n}",
            Code::DuplicateDefinition,
            "two stages named `a`",
        ),
        (
            "rollout {\n  stage a { duration 1h }\n}",
            Code::MissingField,
            "stage `a` names no traffic",
        ),
        (
            "rollout {\n  stage a { tiers [nope] }\n}",
            Code::UnknownName,
            "nope",
        ),
        (
            "rollout {\n  stage a { models [nope] }\n}",
            Code::UnknownName,
            "nope",
        ),
        (
            "rollout {\n  stage a { sahre 5% }\n}",
            Code::UnknownField,
            "sahre",
        ),
        (
            "rollout {\n  canary { share 5% }\n  stage a { share 50% }\n}",
            Code::DuplicateDefinition,
            "both a canary and stages",
        ),
    ] {
        let e = errors(rollout);
        assert!(
            e.iter()
                .any(|(c, m, span, help)| *c == code && m.contains(says) && *span && *help),
            "{rollout}: {e:?}"
        );
    }
    // A gate on the pool's hardware is flagged like a rollback condition.
    let e = errors(
        "rollout {\n  stage a {\n    share 5%\n    gate when pool(gpu).utilization < 90%\n  }\n}",
    );
    assert!(
        e.iter()
            .any(|(c, m, _, _)| *c == Code::RollbackOnSharedPool && m.contains("stage gate")),
        "{e:?}"
    );
}
