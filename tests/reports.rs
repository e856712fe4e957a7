//! Snapshots of every report a user reads: explain (human and JSON), the
//! policy test report, check's JSON and lint's SARIF.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::process::Command;

fn kiln(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("run kiln");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

#[test]
fn explain_human() {
    let (code, out) = kiln(&[
        "explain",
        "--policy",
        "policies/enterprise",
        "--request",
        "examples/requests/eval-business-hours.json",
        "--signals",
        "examples/requests/tuesday-busy.json",
    ]);
    assert_eq!(code, 0);
    insta::assert_snapshot!("explain_human", out);
}

#[test]
fn explain_json() {
    let (code, out) = kiln(&[
        "explain",
        "--format",
        "json",
        "--policy",
        "policies/enterprise",
        "--request",
        "examples/requests/support-chat.json",
        "--signals",
        "examples/requests/tuesday-busy.json",
    ]);
    assert_eq!(code, 0);
    insta::assert_snapshot!("explain_json", out);
}

#[test]
fn test_report_human() {
    let (code, out) = kiln(&["test", "policies/enterprise"]);
    assert_eq!(code, 0);
    insta::assert_snapshot!("test_report_human", out);
}

#[test]
fn check_json_and_lint_sarif() {
    let (code, out) = kiln(&["check", "--format", "json", "tests/fmt/messy.kiln"]);
    assert_eq!(code, 0, "messy.kiln is valid, only untidy");
    insta::assert_snapshot!("check_json_clean", out);
    let (code, out) = kiln(&[
        "lint",
        "--format",
        "sarif",
        "tests/fixtures/lint-findings.kiln",
    ]);
    assert_eq!(code, 0, "warnings fail only under --deny warnings");
    insta::assert_snapshot!("lint_sarif", out);
    let (code, out) = kiln(&[
        "lint",
        "--format",
        "json",
        "tests/fixtures/lint-findings.kiln",
    ]);
    assert_eq!(code, 0);
    insta::assert_snapshot!("lint_json", out);
}
