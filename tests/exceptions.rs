//! Exceptions (`exception NAME { … }`): what the semantic diff calls them,
//! which approvals they need, how `kiln fmt` prints them, and that a
//! replay of traffic sees a grant on the days of its window (in the
//! policy's time zone) and not outside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::diff::semantic::{render_human, semantic, SemanticDiff};
use kiln::governance::approval::{needs, owner_needs, Changes};
use kiln::graph::{ChangeKind, DecisionGraph};
use kiln::lang::{format::format_file, parse};
use kiln::source::FileId;
use proptest::prelude::*;

const BASE: &str = r#"policy { timezone "America/New_York" owner "platform" }

pool gpu { gpus 4 kind "H100-80GB" memory 80GB }

model m {
  variant fp16 { memory 40GB pools [gpu] }
}

tier chat {
  priority 100
  slo { ttft 500ms }
}

tier batch {
  priority 10
  slo { window 6h }
  owner "batch-platform"
}

tenant finance {
  owner "finance-platform"
  tiers [batch]
  weight 1
  quota { tokens 1M/min concurrent 2 }
}

classify {
  default => tier batch
}

route [chat, batch] m {
  default => fp16
}

approval {
  require 1 from "sre" for [exception_change]
  require owner for [exception_change]
  require 2 from "leads" for [priority_increase, quota_increase]
}
"#;

const CLOSE: &str = r#"
exception quarter_end_close {
  tenant finance
  dates 2026-12-28..2027-01-02
  weight 4
  quota { tokens 4M/min concurrent 8 }
  reason "quarter-end close runs the ledger reconciliation"
  owner "finance-platform"
}
"#;

fn graph(text: &str) -> DecisionGraph {
    let c = kiln::compile::compile_str("policy.kiln", text);
    assert!(!c.has_errors(), "{:?}\n{text}", c.diagnostics);
    c.graph.expect("graph")
}

fn with_close() -> String {
    format!("{BASE}{CLOSE}")
}

fn kinds(d: &SemanticDiff) -> Vec<(String, Option<String>, &'static str, bool)> {
    d.changes
        .iter()
        .map(|c| {
            (
                c.subject.clone(),
                c.field.clone(),
                c.change_kind.name(),
                c.escalation,
            )
        })
        .collect()
}

#[test]
fn an_added_exception_is_an_exception_change_and_its_grants_escalations() {
    let (a, b) = (graph(BASE), graph(&with_close()));
    let d = semantic(&a, &b);
    let s = "exception quarter_end_close for tenant finance".to_string();
    let k = kinds(&d);
    assert!(
        k.contains(&(s.clone(), None, "exception_change", false)),
        "{k:?}"
    );
    for f in ["weight", "quota.tokens", "quota.concurrent"] {
        assert!(
            k.contains(&(s.clone(), Some(f.into()), "quota_increase", true)),
            "{f}: {k:?}"
        );
    }
    assert!(!k.iter().any(|c| c.1.as_deref() == Some("quota.requests")));
    let human = render_human(&d);
    assert!(
        human.contains("2026-12-28..2027-01-02: weight 4, quota tokens 4M/min concurrent 8"),
        "{human}"
    );

    // The approvals: sre for the exception, the tenant's owner (as the
    // policy in force names it), and two leads for the grants.
    let ch = Changes::of(&d);
    assert!(ch.kinds.contains(&ChangeKind::ExceptionChange));
    let n = needs(&a.approvals, &ch);
    assert!(
        n.iter()
            .any(|x| x.group == "sre" && x.kinds == ["exception_change"]),
        "{n:?}"
    );
    assert!(
        n.iter().any(|x| x.group == "leads" && x.count == 2),
        "{n:?}"
    );
    let o = owner_needs(&a, &d);
    assert_eq!(o.len(), 1, "{o:?}");
    assert_eq!(o[0].group, "finance-platform");
    assert!(o[0].rule.contains("owns tenant finance"), "{}", o[0].rule);

    // Removing it needs sre but is no escalation.
    let d = semantic(&b, &a);
    assert_eq!(
        kinds(&d),
        vec![(s, None, "exception_change", false)],
        "{:?}",
        kinds(&d)
    );
}

#[test]
fn a_tier_exception_asks_its_tiers_owner_and_counts_as_a_priority_increase() {
    let tier = r#"
exception year_end {
  tier batch
  dates 2026-12-31..2026-12-31
  priority 60
  reason "year-end close"
}
"#;
    let (a, b) = (graph(BASE), graph(&format!("{BASE}{tier}")));
    let d = semantic(&a, &b);
    assert!(kinds(&d).contains(&(
        "exception year_end for tier batch".into(),
        Some("priority".into()),
        "priority_increase",
        true
    )));
    let o = owner_needs(&a, &d);
    assert_eq!(o[0].group, "batch-platform", "{o:?}");
}

#[test]
fn extending_an_exception_escalates_and_shortening_does_not() {
    let a = graph(&with_close());
    let longer = graph(&with_close().replace("2027-01-02", "2027-01-05"));
    let shorter = graph(&with_close().replace("2027-01-02", "2026-12-31"));
    let dates = |d: &SemanticDiff| {
        d.changes
            .iter()
            .find(|c| c.field.as_deref() == Some("dates"))
            .map(|c| (c.change_kind.name(), c.escalation))
    };
    assert_eq!(
        dates(&semantic(&a, &longer)),
        Some(("quota_increase", true))
    );
    assert_eq!(
        dates(&semantic(&a, &shorter)),
        Some(("exception_change", false))
    );
}

#[test]
fn fmt_prints_an_exception_back_and_keeps_its_meaning() {
    let messy = "exception   quarter_end_close{tenant finance dates 2026-12-28..2027-01-02\n weight 4 quota{tokens 4M/min concurrent 8}\nreason \"quarter-end close runs the ledger reconciliation\" owner \"finance-platform\"}";
    let text = format!("{BASE}\n{messy}\n");
    let file = parse(FileId(0), &text).unwrap();
    let once = format_file(&file, &text);
    let again = format_file(&parse(FileId(0), &once).unwrap(), &once);
    assert_eq!(once, again);
    assert!(
        once.contains(
            "exception quarter_end_close {\n  tenant finance\n  dates 2026-12-28..2027-01-02\n"
        ),
        "{once}"
    );
    assert_eq!(graph(&once).normalized(), graph(&with_close()).normalized());
}

/// Days since 1970-01-01 → a UTC timestamp at `minute` of that day.
fn unix_ms(day: i64, minute: i64) -> i64 {
    (day * 1440 + minute) * 60_000
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The grant is in force exactly on the window's days in New York:
    /// a request timestamped at any minute of the fortnight around it sees
    /// the graph of that local day.
    #[test]
    fn a_replayed_timestamp_sees_the_grant_only_inside_the_window(
        day in 0i64..16,
        minute in 0i64..1440,
    ) {
        let g = graph(&with_close());
        let first = kiln::units::calendar::date_days(2026, 12, 28).unwrap();
        let last = kiln::units::calendar::date_days(2027, 1, 2).unwrap();
        let at = unix_ms(i64::from(first) - 5 + day, minute);
        let local = kiln::units::calendar::civil_at(at, g.timezone.as_ref()).date;
        let fin = g.tenant_id("finance").unwrap() as usize;
        let w = g.on_date(local).tenants[fin].weight;
        let inside = (first..=last).contains(&local);
        prop_assert_eq!(w, if inside { 4.0 } else { 1.0 });
        // New York is 5 hours behind UTC in winter: 03:00 UTC on the 28th
        // is still the 27th there.
        let utc_date = (at / 86_400_000) as i32;
        if minute < 5 * 60 {
            prop_assert_eq!(local, utc_date - 1);
        } else {
            prop_assert_eq!(local, utc_date);
        }
    }
}

/// `kiln simulate --start`: the same recorded burst of 40 requests,
/// replayed from 23:30 in Berlin on the 27th and from 00:30 on the 28th
/// (an hour apart in UTC). The exception raises the tenant's concurrency
/// from 2 to 40 on the 28th: refused for concurrency before midnight in
/// Berlin, admitted after.
#[test]
fn a_replay_inside_the_window_sees_the_grant_and_one_outside_does_not() {
    let policy = r#"policy { timezone "Europe/Berlin" }
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { params 8B kv_per_token 128KB variant fp16 { memory 18GB pools [p] } }
tier lo { priority 10 slo { window 24h } }
tenant fin { owner "fin" tiers [lo] quota { concurrent 2 } }
classify { default => tier lo }
route lo m { default => fp16 }
exception close {
  tenant fin
  dates 2026-12-28..2027-01-02
  quota { concurrent 40 }
  reason "quarter-end close"
}
"#;
    let dir = std::env::temp_dir().join(format!("kiln-exceptions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("p.kiln");
    std::fs::write(&p, policy).unwrap();
    let t = dir.join("t.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|i| {
            format!(
                r#"{{"at_ms": {}, "tenant": "fin", "model": "m", "prompt_tokens": 500, "max_tokens": 800, "output_tokens": 800}}"#,
                i * 10
            )
        })
        .collect();
    std::fs::write(&t, lines.join("\n") + "\n").unwrap();
    let refused = |start: &str| -> u64 {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["simulate", "--policy"])
            .arg(&p)
            .arg("--traffic")
            .arg(&t)
            .args(["--start", start, "--format", "json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["reports"][0]["tenants"][0]["rejects_by_reason"]["concurrency"]
            .as_u64()
            .unwrap_or(0)
    };
    assert_eq!(
        refused("2026-12-27T22:30:00Z"),
        38,
        "23:30 on the 27th in Berlin"
    );
    assert_eq!(
        refused("2026-12-27T23:30:00Z"),
        0,
        "00:30 on the 28th in Berlin"
    );
    assert_eq!(
        refused("2027-01-02T22:30:00Z"),
        0,
        "23:30 on the 2nd, the last day"
    );
    assert_eq!(refused("2027-01-02T23:30:00Z"), 38, "00:30 on the 3rd");
    let _ = std::fs::remove_dir_all(&dir);
}
