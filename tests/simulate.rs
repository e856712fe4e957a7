//! `kiln simulate` on real recorded traffic (a slice of the Azure 2023
//! trace from ../shared/traces): reports in every format, baselines in the
//! same run, every request accounted for, byte-identical reruns.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::path::{Path, PathBuf};
use std::process::Command;

fn kiln(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("run kiln");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn traces() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/azure2023")
}

/// Imports 400 conversation and 200 code requests once per test process.
fn traffic() -> (String, String) {
    // Tests run in parallel: import once, under a lock.
    static ONCE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONCE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("kiln-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conv = dir.join("conv.jsonl");
    let code = dir.join("code.jsonl");
    if !conv.exists() {
        let src = traces().join("AzureLLMInferenceTrace_conv.csv");
        let (c, _, e) = kiln(&[
            "traffic",
            "import",
            "azure",
            src.to_str().unwrap(),
            "--tenant",
            "support-bot",
            "--model",
            "llama-70b",
            "--limit",
            "400",
            "-o",
            conv.to_str().unwrap(),
        ]);
        assert_eq!(c, 0, "{e}");
        let src = traces().join("AzureLLMInferenceTrace_code.csv");
        let (c, _, e) = kiln(&[
            "traffic",
            "import",
            "azure",
            src.to_str().unwrap(),
            "--tenant",
            "enrichment",
            "--model",
            "llama-70b",
            "--limit",
            "200",
            "-o",
            code.to_str().unwrap(),
        ]);
        assert_eq!(c, 0, "{e}");
    }
    (conv.display().to_string(), code.display().to_string())
}

#[test]
fn simulate_reports_are_deterministic_and_complete() {
    let (conv, code) = traffic();
    let args = [
        "simulate",
        "--policy",
        "policies/enterprise",
        "--traffic",
        &conv,
        &code,
        "--compare",
        "--format",
        "json",
    ];
    let (c1, a, e) = kiln(&args);
    assert_eq!(c1, 0, "{e}");
    let (_, b, _) = kiln(&args);
    assert_eq!(a, b, "two runs differ");
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    let reports = v["reports"].as_array().unwrap();
    let names: Vec<&str> = reports
        .iter()
        .map(|r| r["scheduler"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "kiln",
            "fifo",
            "priority",
            "static",
            "kiln/round-robin",
            "kiln/least-loaded",
            "kiln/random"
        ]
    );
    let routings: Vec<&str> = reports
        .iter()
        .map(|r| r["routing"].as_str().unwrap())
        .collect();
    assert_eq!(
        routings,
        [
            "kiln",
            "kiln",
            "kiln",
            "kiln",
            "round-robin",
            "least-loaded",
            "random"
        ]
    );
    for r in reports {
        assert_eq!(r["requests"], 600);
        let mut total = 0;
        for t in r["tiers"].as_array().unwrap() {
            let (n, f, x) = (
                t["requests"].as_u64().unwrap(),
                t["finished"].as_u64().unwrap(),
                t["rejected"].as_u64().unwrap(),
            );
            assert_eq!(n, f + x, "every request finishes or is refused: {t}");
            total += n;
        }
        assert_eq!(total, 600);
    }
}

#[test]
fn simulate_markdown_and_human_snapshots() {
    let (conv, code) = traffic();
    let (c, md, e) = kiln(&[
        "simulate",
        "--policy",
        "policies/enterprise",
        "--traffic",
        &conv,
        &code,
        "--scheduler",
        "kiln",
        "fifo",
        "--format",
        "markdown",
    ]);
    assert_eq!(c, 0, "{e}");
    insta::assert_snapshot!("simulate_markdown", md);
    let (c, human, _) = kiln(&[
        "simulate",
        "--policy",
        "policies/enterprise",
        "--traffic",
        &conv,
        &code,
    ]);
    assert_eq!(c, 0);
    insta::assert_snapshot!("simulate_human", human);
}

#[test]
fn malformed_traffic_is_an_error_naming_the_line() {
    let dir = std::env::temp_dir().join(format!("kiln-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"at_ms\": 0, \"model\": \"llama-70b\", \"prompt_tokens\": 5, \"output_tokens\": 1}\nnot json\n").unwrap();
    let (c, _, e) = kiln(&[
        "simulate",
        "--policy",
        "policies/enterprise",
        "--traffic",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(c, 1);
    assert!(e.contains("bad.jsonl") && e.contains('2'), "{e}");
    let (c, _, e) = kiln(&[
        "simulate",
        "--policy",
        "policies/enterprise",
        "--traffic",
        bad.to_str().unwrap(),
        "--skip-malformed",
    ]);
    assert_eq!(c, 0, "{e}");
    assert!(e.contains("skipped 1 malformed"), "{e}");
}

/// Every tier's TTFT and window attainment in a simulate JSON report at
/// least `th`.
fn passes(report: &serde_json::Value, th: f64) -> bool {
    report["tiers"].as_array().unwrap().iter().all(|t| {
        ["ttft_attainment", "window_attainment"]
            .iter()
            .all(|k| t[*k].as_f64().is_none_or(|a| a >= th - 1e-9))
    })
}

#[test]
fn capacity_finds_a_scale_that_passes_when_a_little_more_fails() {
    let (conv, code) = traffic();
    let base = [
        "simulate",
        "--policy",
        "policies/enterprise",
        "--traffic",
        &conv,
        &code,
    ];
    // A lenient TTFT threshold, so the slice has a capacity to find.
    let mut args = base.to_vec();
    args.extend([
        "--scheduler",
        "kiln",
        "fifo",
        "--capacity",
        "--capacity-ttft",
        "0.3",
        "--format",
        "json",
    ]);
    let (c, out, e) = kiln(&args);
    assert_eq!(c, 0, "{e}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["capacity"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for row in rows {
        let name = row["scheduler"].as_str().unwrap();
        let scale = row["scale"].as_f64();
        let bound = row["bound"].as_str().unwrap();
        assert!(row["replays"].as_u64().unwrap() <= 16, "{row}");
        let at = |x: f64| {
            let x = x.to_string();
            let mut a = base.to_vec();
            a.extend(["--scheduler", name, "--scale", &x, "--format", "json"]);
            let (c, out, e) = kiln(&a);
            assert_eq!(c, 0, "{e}");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            v["reports"][0].clone()
        };
        match (bound, scale) {
            ("bracketed", Some(scale)) => {
                assert!(passes(&at(scale), 0.3), "{name} at {scale}: {row}");
                let bad = row["fails_at"].as_f64().unwrap();
                assert!(bad > scale, "{row}");
                assert!(!passes(&at(bad), 0.3), "{name} at {bad}");
                assert_eq!(row["binding"], "interactive", "{row}");
                // On a 600-request slice attainment is not monotone in the
                // scale; where the search saw that (`wobbles`) or spent its
                // budget, only its two end points are claims.
                if row["wobbles"] == false && row["replays"].as_u64().unwrap() < 16 {
                    assert!(bad <= scale * 1.021, "{row}");
                    assert!(!passes(&at(scale * 1.05), 0.3), "{name} at 1.05×{scale}");
                }
            }
            ("at-highest", Some(scale)) => assert_eq!(scale, 64.0),
            ("below-lowest", None) => {
                let low = row["fails_at"].as_f64().unwrap();
                assert!(!passes(&at(low), 0.3));
            }
            other => panic!("{name}: {other:?}: {row}"),
        }
    }
    // The same search twice gives the same answer; the tables name every run.
    assert_eq!(kiln(&args).1, out);
    let mut md = base.to_vec();
    md.extend(["--capacity", "--format", "markdown"]);
    let (c, table, e) = kiln(&md);
    assert_eq!(c, 0, "{e}");
    assert!(table.starts_with("| scheduler | capacity at SLO | replays | binding tier |"));
    assert!(table.contains("| kiln |"), "{table}");
}

/// Batch items (records with `x-kiln-batch` and `deadline_ms`, built from
/// the committed diff example's slice of the Azure trace): each batch is
/// reported with its items, completions, misses and last finish against
/// its deadline, in every format.
#[test]
fn batch_items_are_reported_per_batch() {
    let args = |fmt: &'static str| {
        [
            "simulate",
            "--policy",
            "tests/fixtures/batch/old.kiln",
            "--traffic",
            "tests/fixtures/batch/traffic.jsonl",
            "--format",
            fmt,
        ]
    };
    let (c, out, e) = kiln(&args("json"));
    assert_eq!(c, 0, "{e}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let batches = v["reports"][0]["batches"].as_array().unwrap();
    let ids: Vec<&str> = batches.iter().map(|b| b["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["batch_a", "batch_b"]);
    for b in batches {
        let n = |k: &str| b[k].as_u64().unwrap();
        assert!(n("completed") + n("rejected") <= n("items"));
        assert!(n("deadline_misses") <= n("items"));
    }
    assert_eq!(batches[0]["items"], 17);
    assert_eq!(batches[0]["deadline_s"], 45.0);
    assert_eq!(batches[1]["deadline_s"], 75.0);
    assert!(batches[1]["deadline_misses"].as_u64().unwrap() > 0);
    // The tier's misses are its batches' (every batch-tier request is an
    // item here).
    let tier = v["reports"][0]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "batch")
        .unwrap();
    let sum: u64 = batches
        .iter()
        .map(|b| b["deadline_misses"].as_u64().unwrap())
        .sum();
    assert_eq!(tier["deadline_misses"].as_u64().unwrap(), sum);
    let (c, human, _) = kiln(&args("human"));
    assert_eq!(c, 0);
    insta::assert_snapshot!("simulate_batches_human", human);
    let (c, md, _) = kiln(&args("markdown"));
    assert_eq!(c, 0);
    assert!(md.contains(
        "| batch | items | completed | rejected | deadline misses | finished s | deadline s |"
    ));
    assert!(md.contains("| batch_b | 46 |"), "{md}");
}
