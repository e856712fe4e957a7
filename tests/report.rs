//! `kiln report` through the real binary: markdown and JSON snapshots on a
//! slice of the Azure 2023 traces (with and without the Azure-hour policy),
//! the self-contained HTML page, malformed lines and bad arguments; and a
//! gateway's own decision log, whose recorded service and saturation
//! episodes must say what its clients got.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

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
    // Both hours of the trace are charted: a bar per hour of day in the
    // requests-by-hour chart (its color), zero-height bars included.
    assert_eq!(page.matches("fill=\"#1F77B4\"").count(), 24);
    assert!(page.contains("Requests by hour of day (UTC)"));
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

// ---------------------------------------------------------------------------
// A gateway's own decision log: the baseline of today.

const FLOOD_POLICY: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model big {
  params 13B
  kv_per_token 160KB
  variant fp16 { memory 26GB pools [gpu] max_batch 8 }
}
tier chat { priority 100 slo { ttft 400ms } }
tenant polite { owner "p@x" tiers [chat] api_keys ["k-polite"] }
tenant flood { owner "f@x" tiers [chat] api_keys ["k-flood"] }
classify { default => tier chat }
route [chat] big { default => fp16 }
"#;

/// Calm, then a tenant floods a one-GPU pool, then calm again: `kiln
/// report` on the gateway's log counts each status as its clients got it,
/// and finds the flood as a saturation episode with the flooder in it and
/// refused for capacity, and none while it was calm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_decision_log_shows_its_service_and_when_it_was_saturated() {
    use kiln::server::config::ServerConfig;
    use std::collections::BTreeMap;
    use std::time::{Duration, Instant};
    let dir = temp("baseline");
    let log = dir.join("d.jsonl");
    let cfg = ServerConfig::parse(
        "kiln.toml",
        &format!("[log]\npath = \"{}\"\n[sim]\nspeed = 1.0\n", log.display()),
    )
    .unwrap();
    let srv = support::serve_on_loopback(support::policy("f.kiln", FLOOD_POLICY), cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(60));
    let send = |key: &'static str, words: usize| {
        let c = c.clone();
        let base = base.clone();
        tokio::spawn(async move {
            let body = serde_json::json!({"model": "big", "max_tokens": 16,
                "messages": [{"role": "user", "content": "w ".repeat(words)}]});
            match c
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
            {
                Ok(r) => {
                    let s = r.status().as_u16();
                    let _ = r.bytes().await;
                    s
                }
                Err(_) => 0,
            }
        })
    };
    // Phases of 3 s: polite alone (4 a second), the flood beside it (60
    // long prompts a second), polite alone again.
    let t0 = Instant::now();
    let mut sent: Vec<(&str, f64, tokio::task::JoinHandle<u16>)> = Vec::new();
    for tick in 0..90u32 {
        let at = Duration::from_millis(100 * u64::from(tick));
        tokio::time::sleep_until(tokio::time::Instant::from_std(t0 + at)).await;
        let s = at.as_secs_f64();
        if tick % 2 == 0 {
            sent.push(("polite", s, send("k-polite", 200)));
        }
        if (30..60).contains(&tick) {
            for _ in 0..6 {
                sent.push(("flood", s, send("k-flood", 3000)));
            }
        }
    }
    let mut got: BTreeMap<String, u64> = BTreeMap::new();
    for (_, _, h) in sent {
        *got.entry(h.await.unwrap().to_string()).or_default() += 1;
    }
    srv.app.log.flush().await;
    srv.stop().await;

    let o = kiln(&[
        log.to_str().unwrap(),
        "--episode-window",
        "1s",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&o)).unwrap();
    let rec = &v["recorded"];
    assert_eq!(v["start_from_log"], true, "{v}");
    // What the log says the clients got is what they got.
    let logged: BTreeMap<String, u64> =
        serde_json::from_value(rec["fleet"]["statuses"].clone()).unwrap();
    assert_eq!(logged, got, "{rec}");
    assert!(
        got.keys().any(|s| s != "200"),
        "the flood was never refused: {got:?}"
    );
    // The flood is an episode (or several) inside its 3 s, with the
    // flooder present and refused for capacity; the calm phases are not.
    let episodes = rec["episodes"].as_array().unwrap();
    assert!(!episodes.is_empty(), "{rec}");
    for e in episodes {
        let start = e["start_s"].as_f64().unwrap();
        let end = start + e["duration_s"].as_f64().unwrap();
        // A second of slack each side: arrivals are stamped at the gateway.
        assert!(start >= 2.0 && end <= 8.0, "episode {start}..{end} s: {e}");
        let flood = e["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tenant"] == "flood");
        assert!(flood.is_some(), "{e}");
    }
    let refused: u64 = episodes
        .iter()
        .map(|e| e["refused_for_capacity"].as_u64().unwrap())
        .sum();
    assert!(refused > 0, "{rec}");
    // The markdown names the section and the flooder's episode.
    let md = ok(&kiln(&[log.to_str().unwrap(), "--episode-window", "1s"]));
    assert!(md.contains("## Recorded service"), "{md}");
    assert!(md.contains("### Saturation episodes"), "{md}");
    assert!(md.contains("the decision log's first arrival"), "{md}");

    // `kiln explain --pool P --at T` on the same log: in the flood the pool
    // runs the flooder's work; long after the last request it is idle.
    let explain = |at: &str| -> serde_json::Value {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args([
                "explain",
                "--log",
                log.to_str().unwrap(),
                "--pool",
                "gpu",
                "--at",
                at,
            ])
            .args(["--format", "json"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        serde_json::from_str(&ok(&o)).unwrap()
    };
    let mid = explain("+4500ms");
    assert!(mid["running"]["flood"].as_u64().unwrap_or(0) > 0, "{mid}");
    assert!(
        mid["verdict"].as_str().unwrap().contains("was busy"),
        "{mid}"
    );
    let late = explain("+10m");
    assert!(late["running"].as_object().unwrap().is_empty(), "{late}");
    assert!(
        late["verdict"].as_str().unwrap().contains("was idle"),
        "{late}"
    );
    assert!(late["last_busy_ms"].as_f64().unwrap() > 6_000.0, "{late}");
    let _ = std::fs::remove_dir_all(&dir);
}
