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

/// `kiln simulate --format json` splits GPU time and cost by model variant
/// and by batch as well as by tier and tenant, and the splits agree: what
/// ran on some variant's replica is all the GPU time there is, and a
/// batch's cost is its items' GPU-seconds at their tenant's rate.
#[test]
fn simulate_costs_by_model_and_batch_add_up() {
    let dir = std::env::temp_dir().join(format!("kiln-costs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string("tests/fixtures/batch/new.kiln").unwrap();
    let priced = text.replace("  tiers [batch]\n}", "  tiers [batch]\n  cost 3/h\n}");
    assert_ne!(priced, text, "the fixture's analytics tenant changed shape");
    let policy = dir.join("priced.kiln");
    std::fs::write(&policy, priced).unwrap();
    let (code, out) = kiln(&[
        "simulate",
        "--policy",
        policy.to_str().unwrap(),
        "--traffic",
        "tests/fixtures/batch/traffic.jsonl",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let r = &v["reports"][0];
    let sum = |rows: &serde_json::Value, field: &str| -> f64 {
        rows.as_array()
            .unwrap_or_else(|| panic!("no rows in {r}"))
            .iter()
            .map(|x| x[field].as_f64().unwrap())
            .sum()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-3 * a.abs().max(1.0);
    let tenants_gpu = sum(&r["tenants"], "gpu_seconds");
    assert!(tenants_gpu > 0.0);
    assert!(close(sum(&r["models"], "gpu_seconds"), tenants_gpu), "{r}");
    assert!(close(sum(&r["models"], "cost"), sum(&r["tenants"], "cost")));
    let analytics = r["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "analytics")
        .unwrap();
    // Every analytics request is a batch item: the batches' GPU time and
    // cost are that tenant's.
    let batch_gpu = sum(&r["batches"], "gpu_seconds");
    assert!(
        close(batch_gpu, analytics["gpu_seconds"].as_f64().unwrap()),
        "{r}"
    );
    let batch_cost = sum(&r["batches"], "cost");
    assert!(
        batch_cost > 0.0 && close(batch_cost, batch_gpu * 3.0 / 3600.0),
        "{r}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
