//! `kiln report` through the real binary: markdown and JSON snapshots on a
//! slice of the Azure 2023 traces (with and without the Azure-hour policy),
//! the self-contained HTML page, malformed lines and bad arguments.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

use std::path::PathBuf;
use std::process::{Command, Output};

const CONV: &str = "tests/fixtures/traces/azure-slice/conv.jsonl";
const CODE: &str = "tests/fixtures/traces/azure-slice/code.jsonl";
const POLICY: &str = "examples/azure-hour/azure.kiln";

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("report")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("run kiln")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-report-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn markdown_and_json_without_policy() {
    let md = ok(&kiln(&[CONV, CODE]));
    insta::assert_snapshot!("slice_markdown", md);
    let json = ok(&kiln(&[CONV, CODE, "--format", "json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["requests"], 3000);
    assert_eq!(v["start_assumed"], true);
    assert!(v.get("policy").is_none());
    insta::assert_snapshot!("slice_json", json);
}

#[test]
fn markdown_and_json_with_policy() {
    let args = [
        CONV,
        CODE,
        "--policy",
        POLICY,
        "--start",
        "2023-11-16T18:15:46Z",
    ];
    let md = ok(&kiln(&args));
    assert!(md.contains("## SLO attainment per tier"));
    insta::assert_snapshot!("slice_policy_markdown", md);
    let mut a = args.to_vec();
    a.extend(["--format", "json"]);
    let json = ok(&kiln(&a));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    // The policy classifies chat as interactive, everything else as batch.
    let placement = v["policy"]["placement"].as_array().unwrap();
    let pairs: Vec<(&str, &str, u64)> = placement
        .iter()
        .map(|p| {
            (
                p["tier"].as_str().unwrap(),
                p["tenant"].as_str().unwrap(),
                p["requests"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        pairs,
        [("batch", "code", 1500), ("interactive", "chat", 1500)]
    );
    assert_eq!(v["start_assumed"], false);
    insta::assert_snapshot!("slice_policy_json", json);
}

#[test]
fn html_is_self_contained_and_escapes_hostile_names() {
    let d = temp("html");
    let traffic = d.join("t.jsonl");
    std::fs::write(
        &traffic,
        concat!(
            r#"{"at_ms":0,"tenant":"<script>alert(1)</script>","model":"m\"><img src=x>","prompt_tokens":300,"output_tokens":20}"#,
            "\n",
            r#"{"at_ms":500,"tenant":"ok","model":"m","prompt_tokens":3000,"output_tokens":200}"#,
            "\n",
            r#"{"at_ms":4000000,"tenant":"ok","model":"m","prompt_tokens":30,"output_tokens":2}"#,
            "\n",
        ),
    )
    .unwrap();
    let out = d.join("r.html");
    let t = traffic.to_str().unwrap();
    ok(&kiln(&[t, "--format", "html", "-o", out.to_str().unwrap()]));
    let page = std::fs::read_to_string(&out).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(page.contains("<svg"));
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(!page.contains("<script"));
    assert!(!page.contains("<img"));
    for attr in ["src=", "href="] {
        for scheme in ["\"http://", "\"https://", "'http", "//"] {
            let bad = format!("{attr}{scheme}");
            assert!(!page.contains(&bad), "external resource: {bad}");
        }
    }
    // Both hours of the trace are charted: one bar per hour of day.
    assert_eq!(page.matches("<title>00: ").count(), 2);
    // The same page with the policy: tier tables appear.
    ok(&kiln(&[
        CONV,
        "--policy",
        POLICY,
        "--format",
        "html",
        "-o",
        out.to_str().unwrap(),
    ]));
    let page = std::fs::read_to_string(&out).unwrap();
    assert!(page.contains("SLO attainment per tier"));
    assert!(page.contains("interactive"));
}

#[test]
fn malformed_lines_fail_unless_skipped() {
    let d = temp("malformed");
    let t = d.join("t.jsonl");
    std::fs::write(
        &t,
        "{\"at_ms\":0,\"tenant\":\"a\",\"model\":\"m\"}\nnot json\n{\"at_ms\":10,\"tenant\":\"a\",\"model\":\"m\"}\n",
    )
    .unwrap();
    let t = t.to_str().unwrap();
    let o = kiln(&[t]);
    assert_eq!(o.status.code(), Some(1));
    let o = kiln(&[t, "--skip-malformed", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&ok(&o)).unwrap();
    assert_eq!(v["requests"], 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("skipped 1 malformed"));
}

#[test]
fn bad_arguments_are_usage_errors() {
    let o = kiln(&[CONV, "--start", "yesterday"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("RFC 3339"));
    assert_eq!(kiln(&["no-such-file.jsonl"]).status.code(), Some(1));
}
