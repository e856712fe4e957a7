//! `kiln fmt`: golden output, idempotence, comments kept, and the compiled
//! graph unchanged by formatting, on shipped policies and on thousands of
//! mutated variants of them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::compile::compile_str;
use kiln::lang::{comments, format::format_file, parse};
use kiln::source::FileId;
use proptest::prelude::*;
use std::path::Path;

fn fmt(text: &str) -> Option<String> {
    let file = parse(FileId(0), text).ok()?;
    Some(format_file(&file, text))
}

fn shipped() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("policies")];
    while let Some(dir) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "kiln") {
                out.push((
                    p.display().to_string(),
                    std::fs::read_to_string(&p).unwrap(),
                ));
            }
        }
    }
    assert!(!out.is_empty());
    out
}

fn comment_texts(text: &str) -> Vec<String> {
    comments::scan(text).into_iter().map(|c| c.text).collect()
}

/// The properties every formatting must keep.
fn assert_fmt_sound(text: &str) {
    let Some(once) = fmt(text) else { return };
    let twice = fmt(&once).expect("formatted text must parse");
    assert_eq!(once, twice, "format is not idempotent for:\n{text}");
    assert_eq!(
        comment_texts(text),
        comment_texts(&once),
        "comments changed"
    );
    let before = compile_str("a.kiln", text);
    let after = compile_str("a.kiln", &once);
    assert_eq!(before.has_errors(), after.has_errors());
    if let (Some(a), Some(b)) = (&before.graph, &after.graph) {
        assert!(
            a.normalized() == b.normalized(),
            "formatting changed the compiled graph"
        );
    }
}

#[test]
fn golden_messy_policy() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fmt/messy.kiln"))
            .unwrap();
    let out = fmt(&text).expect("parses");
    insta::assert_snapshot!("fmt_messy", out);
    assert_fmt_sound(&text);
}

#[test]
fn golden_rollout_and_approval() {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fmt/rollout.kiln"),
    )
    .unwrap();
    let out = fmt(&text).expect("parses");
    insta::assert_snapshot!("fmt_rollout", out);
    assert_eq!(fmt(&out).as_deref(), Some(out.as_str()));
    assert_eq!(comment_texts(&text), comment_texts(&out));
}

#[test]
fn rollout_stages_format_one_field_or_gate_a_line_and_keep_comments() {
    let text = "rollout {shadow 1h\n  stage pilot {tenants [a,b] duration 30m}   # first\n  stage  batch5 { tiers [batch] models [m] share 5% duration 1h\n gate when tier(batch).slo_attainment > 95%   for 10m # enough\n }\n  rollback when error_rate > 2%}\n";
    let out = fmt(text).expect("parses");
    assert_eq!(
        out,
        "rollout {\n  shadow 1h\n  stage pilot {\n    tenants [a, b]\n    duration 30m\n  } # first\n  stage batch5 {\n    tiers [batch]\n    models [m]\n    share 5%\n    duration 1h\n    gate when tier(batch).slo_attainment > 95% for 10m # enough\n  }\n  rollback when error_rate > 2%\n}\n"
    );
    assert_eq!(fmt(&out).as_deref(), Some(out.as_str()));
    assert_eq!(comment_texts(text), comment_texts(&out));
}

#[test]
fn golden_substitution_declaration() {
    let text = "model big {\n  variant fp16 { memory 40GB pools [p] }\n    served_by   small {tiers [a,b]\n response_model   requested }   # kept\n  served_by tiny { tiers [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w] response_model served }\n}\n";
    let out = fmt(text).expect("parses");
    insta::assert_snapshot!("fmt_substitution", out);
    assert_eq!(fmt(&out).as_deref(), Some(out.as_str()));
    assert_eq!(comment_texts(text), comment_texts(&out));
}

#[test]
fn policy_block_and_dates_format_soundly() {
    let text = "policy {timezone   \"Europe/Berlin\"}  # the close is Berlin's\nclassify {\n  when day in 28..2 and date   <  2027-01-01 => tier close\n  when date in 2026-12-24..2026-12-26=>tier lo\n  default => tier lo\n}\n";
    let out = fmt(text).expect("parses");
    assert_eq!(
        out,
        "policy {\n  timezone \"Europe/Berlin\"\n} # the close is Berlin's\n\nclassify {\n  when day in 28..2 and date < 2027-01-01 => tier close\n  when date in 2026-12-24..2026-12-26 => tier lo\n  default => tier lo\n}\n"
    );
    assert_fmt_sound(text);
}

#[test]
fn owners_and_require_owner_format_soundly() {
    let text = "policy {owner \"platform\"   escalation \"cto\"}\napproval {\n   require   owner for [tenant_change,quota_increase]  # the tenant's team\n  require 2 from \"leads\" for any\n}\n";
    let out = fmt(text).expect("parses");
    assert_eq!(
        out,
        "policy {\n  owner \"platform\"\n  escalation \"cto\"\n}\n\napproval {\n  require owner for [tenant_change, quota_increase] # the tenant's team\n  require 2 from \"leads\" for any\n}\n"
    );
    assert_fmt_sound(text);
}

#[test]
fn golden_cache_block() {
    let text = "tier t { priority 1 cache {exact{entries 10k,ttl 10m,shared}   # per tier\n semantic { similarity 0.92 entries 5000 ttl 1h } } }\ntier u { priority 2 exact_cache }\n";
    let out = fmt(text).expect("parses");
    insta::assert_snapshot!("fmt_cache", out);
    assert_eq!(fmt(&out).as_deref(), Some(out.as_str()));
    assert_eq!(comment_texts(text), comment_texts(&out));
}

#[test]
fn shipped_policies_are_formatted_and_sound() {
    for (name, text) in shipped() {
        assert_eq!(
            fmt(&text).as_deref(),
            Some(text.as_str()),
            "{name} is not formatted"
        );
        assert_fmt_sound(&text);
    }
}

#[test]
fn empty_and_comment_only_files() {
    assert_eq!(fmt("").as_deref(), Some(""));
    assert_eq!(
        fmt("# only a comment").as_deref(),
        Some("# only a comment\n")
    );
}

/// Small edits that keep most of a policy parseable: delete a line,
/// duplicate one, swap two, or strip indentation and blank lines.
fn mutate(text: &str, op: u8, a: usize, b: usize) -> String {
    let mut lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return text.to_string();
    }
    let i = a % lines.len();
    let j = b % lines.len();
    match op % 5 {
        0 => {
            lines.remove(i);
        }
        1 => lines.insert(i, lines[j]),
        2 => lines.swap(i, j),
        3 => {
            return lines
                .iter()
                .map(|l| l.trim())
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("\n")
        }
        _ => return lines.join(" \n\n  "),
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn format_is_idempotent_and_preserves_meaning(pick in 0usize..64, op in 0u8..5, a in 0usize..400, b in 0usize..400) {
        let policies = shipped();
        let (_, text) = &policies[pick % policies.len()];
        let mutated = mutate(text, op, a, b);
        assert_fmt_sound(&mutated);
    }
}

/// The fuzzers' findings: `kiln fmt` was not idempotent on bodies holding
/// bare words separated by commas (the first pass dropped the comma that
/// kept `varian, t fp16 { … }` two properties).
#[test]
fn fuzz_findings_format_idempotently() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/findings");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "kiln") {
            assert_fmt_sound(&std::fs::read_to_string(&p).unwrap());
            n += 1;
        }
    }
    assert!(n >= 2, "the findings are kept under fuzz/findings");
}
