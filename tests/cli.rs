//! The `kiln` binary as CI uses it: exit codes, output formats, and the
//! commands over the shipped policies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("run kiln")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn broken_copy(name: &str, from: &str, to: &str) -> PathBuf {
    let dir = temp_dir(name);
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/enterprise/enterprise.kiln"),
    )
    .unwrap();
    assert!(text.contains(from), "policy lacks `{from}`");
    let p = dir.join("enterprise.kiln");
    std::fs::write(&p, text.replacen(from, to, 1)).unwrap();
    p
}

#[test]
fn shipped_policies_pass_every_ci_command() {
    for args in [
        vec!["check", "policies"],
        vec!["lint", "--deny", "warnings", "policies"],
        vec!["fmt", "--check", "policies"],
        vec!["test", "policies"],
    ] {
        let o = kiln(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "kiln {args:?}\n{}{}",
            stdout(&o),
            stderr(&o)
        );
    }
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(kiln(&["check"]).status.code(), Some(2));
    assert_eq!(kiln(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(kiln(&["check", "no/such/dir"]).status.code(), Some(2));
    assert_eq!(kiln(&["--help"]).status.code(), Some(0));
}

#[test]
fn a_broken_policy_points_at_its_line() {
    // Line numbers are found, not hard-coded, so editing the policy does not break this.
    let p = broken_copy(
        "unknown-tier",
        "tiers [evaluation, batch]",
        "tiers [evaluaton, batch]",
    );
    let text = std::fs::read_to_string(&p).unwrap();
    let line = text.lines().position(|l| l.contains("evaluaton")).unwrap() + 1;
    let o = kiln(&["check", "--format", "json", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let d = &v[0];
    assert_eq!(d["code"], "kiln::unknown-name");
    assert_eq!(d["line"], line);
    assert_eq!(d["help"], "did you mean `evaluation`?");
    let human = kiln(&["check", p.to_str().unwrap()]);
    assert!(
        stderr(&human).contains(&format!("enterprise.kiln:{line}:")),
        "{}",
        stderr(&human)
    );
}

#[test]
fn validator_catches_semantic_breakage() {
    let cases = [
        (
            "no-default",
            "  default => tier background\n",
            "",
            "kiln::missing-default",
        ),
        (
            "cycle",
            "tier batch {\n",
            "tier batch {\n  preempts [interactive]\n",
            "kiln::preempt-cycle",
        ),
        (
            "fit",
            "variant int8 { memory 75GB",
            "variant int8 { memory 95GB",
            "kiln::variant-does-not-fit",
        ),
        (
            "units",
            "when estimated_wait > 2s => fallback",
            "when estimated_wait > 2% => fallback",
            "kiln::unit-mismatch",
        ),
    ];
    for (name, from, to, code) in cases {
        let p = broken_copy(name, from, to);
        let o = kiln(&["check", "--format", "json", p.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{name}");
        assert!(stdout(&o).contains(code), "{name}: {}", stdout(&o));
    }
}

#[test]
fn lint_sarif_is_valid_2_1_0() {
    let p = broken_copy("sarif", "  owner \"analytics@corp.example\"\n", "");
    let o = kiln(&["lint", "--format", "sarif", p.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "warnings alone do not fail without --deny"
    );
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["version"], "2.1.0");
    let run = &v["runs"][0];
    assert_eq!(run["tool"]["driver"]["name"], "kiln");
    let r = &run["results"][0];
    assert_eq!(r["ruleId"], "kiln::lint::tenant-without-owner");
    assert_eq!(r["level"], "warning");
    assert!(
        r["locations"][0]["physicalLocation"]["region"]["startLine"]
            .as_u64()
            .unwrap()
            > 1
    );
    let denied = kiln(&["lint", "--deny", "warnings", p.to_str().unwrap()]);
    assert_eq!(denied.status.code(), Some(1));
}

#[test]
fn fmt_check_reports_and_fmt_fixes() {
    let dir = temp_dir("fmt");
    let p = dir.join("p.kiln");
    std::fs::write(&p, "tier a { priority 1   slo { ttft 1s } }\n# note\n").unwrap();
    let o = kiln(&["fmt", "--check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("not formatted"));
    assert_eq!(kiln(&["fmt", p.to_str().unwrap()]).status.code(), Some(0));
    assert_eq!(
        kiln(&["fmt", "--check", p.to_str().unwrap()]).status.code(),
        Some(0)
    );
    assert_eq!(
        std::fs::read_to_string(&p).unwrap(),
        "tier a {\n  priority 1\n  slo { ttft 1s }\n}\n# note\n"
    );
}

#[test]
fn failing_policy_test_shows_a_diff_and_exits_1() {
    let dir = temp_dir("test");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/enterprise/enterprise.kiln"),
        dir.join("enterprise.kiln"),
    )
    .unwrap();
    std::fs::write(
        dir.join("wrong.test.toml"),
        r#"
[[case]]
name = "support chat is batch (wrong on purpose)"
request = { tenant = "support-bot", model = "llama-70b", prompt_tokens = 10, max_tokens = 10 }
expect = { tier = "batch" }
"#,
    )
    .unwrap();
    let o = kiln(&["test", dir.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(out.contains("FAIL  support chat is batch"), "{out}");
    assert!(
        out.contains("tier: expected batch, got interactive"),
        "{out}"
    );
    assert!(out.contains("rules no test exercised"), "{out}");
}

#[test]
fn explain_shows_each_condition() {
    let o = kiln(&[
        "explain",
        "--policy",
        "policies/enterprise",
        "--request",
        "examples/requests/support-chat.json",
        "--signals",
        "examples/requests/tuesday-busy.json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("pool(h100).kv_occupancy < 90%"), "{out}");
    assert!(out.contains("saw 93%"), "{out}");
    assert!(
        out.contains("decision: tenant support-bot · tier interactive"),
        "{out}"
    );
    let j = kiln(&[
        "explain",
        "--format",
        "json",
        "--policy",
        "policies/enterprise",
        "--request",
        "examples/requests/support-chat.json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&j)).unwrap();
    assert_eq!(v["decision"]["tier"], "interactive");
    assert!(v["trace"]["stages"].as_array().unwrap().len() >= 3);
}

#[test]
fn explain_rejects_bad_request_json() {
    let dir = temp_dir("explain");
    let r = dir.join("r.json");
    std::fs::write(&r, "{ \"model\": 12 }").unwrap();
    let o = kiln(&[
        "explain",
        "--policy",
        "policies/enterprise",
        "--request",
        r.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("r.json"));
}
