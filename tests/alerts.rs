//! `kiln alerts` and `kiln dashboard`: the committed rules and dashboard
//! stay in step with the commands, promtool accepts and unit-tests the
//! rules, and every metric they use is one the gateway exports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

use kiln::ops::{alerts, dashboard};
use kiln::server::metrics::{Labels, Metrics, Outcome, ReplicaLoad};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const ALERTS: &str = "deploy/prometheus/kiln-alerts.yml";
const ALERTS_TEST: &str = "deploy/prometheus/kiln-alerts.test.yml";
const DASHBOARD: &str = "deploy/grafana/kiln-dashboard.json";

fn kiln(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kiln {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn graph(policy: &str) -> kiln::graph::DecisionGraph {
    kiln::cli::compile_one(&[PathBuf::from(policy)]).unwrap().1
}

fn options(policy: &str) -> alerts::Options {
    alerts::Options {
        objective: 0.99,
        policy: policy.into(),
        selector: Vec::new(),
        runbook_base: None,
    }
}

fn policies() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("policies")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.display().to_string())
        .collect();
    v.sort();
    assert!(v.len() >= 3, "{v:?}");
    v
}

/// A YAML double-quoted scalar for the promtool test files written here:
/// JSON's string escapes are YAML's too.
fn yaml_quote(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

fn promtool() -> bool {
    let ok = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        println!("SKIPPED: promtool not installed (apt-get install prometheus)");
    }
    ok
}

fn promtool_ok(args: &[&str], dir: &Path) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-alerts-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn committed_rules_are_the_commands_output() {
    let committed = std::fs::read_to_string(ALERTS).unwrap();
    let generated = kiln(&["alerts", "--policy", "policies/enterprise"]);
    assert!(
        committed == generated,
        "{ALERTS} is stale: run `kiln alerts --policy policies/enterprise -o {ALERTS}`"
    );
}

#[test]
fn committed_dashboard_is_the_commands_output() {
    let committed = std::fs::read_to_string(DASHBOARD).unwrap();
    let generated = kiln(&["dashboard", "--policy", "policies/enterprise"]);
    assert!(
        committed == generated,
        "{DASHBOARD} is stale: run `kiln dashboard --policy policies/enterprise -o {DASHBOARD}`"
    );
}

/// The committed file, read back by the YAML library, is the rules the
/// policy gives: nothing lost or changed in writing (hostile strings in
/// `src/ops/alerts.rs`'s proptest). The file was checked equal, as parsed
/// values, to the one the hand-written emitter wrote before serde_norway.
#[test]
fn committed_rules_read_back_as_the_policys_rules() {
    let text = std::fs::read_to_string(ALERTS).unwrap();
    let back: alerts::RulesFile = serde_norway::from_str(&text).unwrap();
    let p = "policies/enterprise";
    assert_eq!(back, alerts::rules(&graph(p), &options(p)));
    assert!(back.groups.iter().any(|g| g.name == "kiln-fleet"));
}

#[test]
fn promtool_checks_and_unit_tests_the_committed_rules() {
    if !promtool() {
        return;
    }
    let dir = Path::new("deploy/prometheus");
    promtool_ok(&["check", "rules", "kiln-alerts.yml"], dir);
    promtool_ok(&["test", "rules", "kiln-alerts.test.yml"], dir);
    assert!(Path::new(ALERTS_TEST).exists());
}

#[test]
fn promtool_accepts_the_rules_of_every_shipped_policy() {
    if !promtool() {
        return;
    }
    let dir = scratch("policies");
    for p in policies() {
        let text = alerts::render(&graph(&p), &options(&p)).unwrap();
        let f = dir.join(format!("{}.yml", p.replace('/', "_")));
        std::fs::write(&f, text).unwrap();
        promtool_ok(&["check", "rules", f.to_str().unwrap()], &dir);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Tier names and the policy path are hostile input: quotes, backslashes,
/// line breaks, template braces. The file must stay valid, and the tier
/// label must come through intact (an alert fires with it).
#[test]
fn hostile_tier_names_stay_quoted() {
    if !promtool() {
        return;
    }
    let mut g = graph("policies/enterprise");
    let hostile = "we\"ird\\ {{ $labels.x }}\nname: x";
    g.tiers[0].name = hostile.into();
    let text = alerts::render(&g, &options("pol\ncies/{{ .Bad }}")).unwrap();
    let dir = scratch("hostile");
    std::fs::write(dir.join("rules.yml"), &text).unwrap();
    promtool_ok(&["check", "rules", "rules.yml"], &dir);
    // The queue wait alert of that tier fires on a series with its name.
    let series = format!(
        "kiln_queue_oldest_wait_seconds{{tier=\"{}\",tenant=\"t\"}}",
        alerts::promql_escape(hostile)
    );
    let test = format!(
        "rule_files: [rules.yml]\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n      - series: {}\n        values: '9x20'\n    promql_expr_test:\n      - expr: ALERTS{{alertname=\"KilnTierQueueWaitAboveSLO\",alertstate=\"firing\"}}\n        eval_time: 10m\n        exp_samples:\n          - labels: {}\n            value: 1\n",
        yaml_quote(&series),
        yaml_quote(&format!(
            "ALERTS{{alertname=\"KilnTierQueueWaitAboveSLO\",alertstate=\"firing\",severity=\"ticket\",tier=\"{}\"}}",
            alerts::promql_escape(hostile)
        )),
    );
    std::fs::write(dir.join("rules.test.yml"), test).unwrap();
    promtool_ok(&["test", "rules", "rules.test.yml"], &dir);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A per-pool alert names the owner of the pool that fired (its own, else
/// the policy's), and a tier alert the tier's: promtool evaluates the
/// label templates on firing series.
#[test]
fn alerts_carry_the_owner_of_what_fired() {
    if !promtool() {
        return;
    }
    let p = "policies/batch-platform";
    let text = alerts::render(&graph(p), &options(p)).unwrap();
    let dir = scratch("owners");
    std::fs::write(dir.join("rules.yml"), &text).unwrap();
    let busy = |pool: &str| {
        yaml_quote(&format!(
            "kiln_replica_busy_ratio{{pool=\"{pool}\",model=\"m\",variant=\"v\"}}"
        ))
    };
    let firing = |pool: &str, labels: &str| {
        yaml_quote(&format!(
            "ALERTS{{alertname=\"KilnReplicasBusy\",alertstate=\"firing\",{labels}model=\"m\",pool=\"{pool}\",severity=\"ticket\",variant=\"v\"}}"
        ))
    };
    let test = format!(
        "rule_files: [rules.yml]\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n      - series: {}\n        values: '0.95x30'\n      - series: {}\n        values: '0.95x30'\n      - series: {}\n        values: '0.95x30'\n    promql_expr_test:\n      - expr: ALERTS{{alertname=\"KilnReplicasBusy\",alertstate=\"firing\"}}\n        eval_time: 20m\n        exp_samples:\n          - labels: {}\n            value: 1\n          - labels: {}\n            value: 1\n          - labels: {}\n            value: 1\n",
        busy("spot"),
        busy("h200"),
        busy("a100"),
        // spot: its own owner and escalation.
        firing("spot", "escalation=\"gpu-fleet-oncall@acme.example\",owner=\"gpu-fleet@acme.example\","),
        // h200: its own owner; no escalation contact of its own, so the
        // policy's.
        firing("h200", "escalation=\"batch-platform-lead@acme.example\",owner=\"gpu-fleet@acme.example\","),
        // a100 names no owner: the policy's.
        firing("a100", "escalation=\"batch-platform-lead@acme.example\",owner=\"batch-platform@acme.example\","),
    );
    std::fs::write(dir.join("rules.test.yml"), test).unwrap();
    promtool_ok(&["test", "rules", "rules.test.yml"], &dir);
    // A tier alert: the tier's owner (online has one of its own).
    let rules: alerts::RulesFile = serde_norway::from_str(&text).unwrap();
    assert!(
        rules.groups.iter().flat_map(|g| &g.rules).any(|r| {
            r.labels.get("tier").map(String::as_str) == Some("online")
                && r.labels.get("owner").map(String::as_str) == Some("merchant-tools@acme.example")
        }),
        "{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// Every metric the gateway exports, from `# TYPE` lines after one of
/// every event (collectors without series are not rendered).
fn exported() -> BTreeSet<String> {
    let m = Metrics::new();
    let l = Labels {
        tier: "a",
        tenant: "t",
        pool: "p",
        model: "m",
    };
    m.request_done(&l, Outcome::Ok);
    m.rejected("a", "t", "quota", 429);
    m.queue_wait(&l, 0.1);
    m.ttft(&l, 0.1);
    m.e2e(&l, 1.0);
    m.tokens(&l, 10, 10);
    m.gpu_seconds(&l, 1.0, 1.0);
    m.gpu_wasted(&l, "recompute", 0.5);
    m.preempted("a", "t");
    m.fallback("a", "t", 1);
    m.retry("a", "t", "client");
    m.deadline_miss("a", "t");
    m.policy_swap(true);
    m.shared_state(true, 1);
    m.shared_unclaimed("local");
    m.set_policy_version("v1");
    m.set_queue("a", "t", 1, 1.0);
    m.set_replica(
        "p",
        "m",
        ReplicaLoad {
            running: 1,
            slots: 2,
            kv_used: 1,
            kv_capacity: 2,
            busy_fraction: 0.5,
        },
    );
    m.shadow("v2", &["tier"]);
    m.canary_request("v2");
    m.rollback("slo");
    m.override_refusal("pause", "tier", "a");
    m.approval("ok");
    m.set_batches(&[("t", "a", [1, 1, 1, 1])], &[("b", "t", "a", true)]);
    m.batch_deadline_misses("t", "a", 1);
    m.set_upstream_breaker("p", "u", true);
    m.set_budget("tenant", "a", "day", 10.0, 2.0);
    m.rollout_stage("v2", "pilot");
    m.render()
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn every_metric_used_is_exported_by_the_gateway() {
    let exported = exported();
    let mut used = BTreeSet::new();
    for p in policies() {
        let g = graph(&p);
        let rules = alerts::rules(&g, &options(&p));
        let mut exprs = Vec::new();
        for group in &rules.groups {
            for r in &group.rules {
                exprs.push(r.expr.clone());
            }
        }
        exprs.extend(dashboard::exprs(&dashboard::dashboard(&g, &p)));
        assert!(exprs.len() > 10);
        for e in &exprs {
            used.extend(dashboard::metric_names(e));
        }
    }
    let missing: Vec<_> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "not exported by the gateway: {missing:?}"
    );
    // The scan found what the rules are built on.
    for m in [
        "kiln_ttft_seconds",
        "kiln_requests_total",
        "kiln_upstream_breaker_open",
        "kiln_rollbacks_total",
        "kiln_policy_info",
        "kiln_tokens_total",
    ] {
        assert!(used.contains(m), "{m} not used");
    }
}

#[test]
fn ttft_buckets_agree_with_the_gateway() {
    let m = Metrics::new();
    m.ttft(
        &Labels {
            tier: "a",
            tenant: "t",
            pool: "p",
            model: "m",
        },
        0.1,
    );
    let les: Vec<String> = m
        .render()
        .lines()
        .filter(|l| l.starts_with("kiln_ttft_seconds_bucket"))
        .filter_map(|l| l.split("le=\"").nth(1))
        .filter_map(|l| l.split('"').next())
        .filter(|le| *le != "+Inf")
        .map(str::to_string)
        .collect();
    let ours: Vec<String> = alerts::TTFT_BUCKETS
        .iter()
        .map(|b| format!("{b}"))
        .collect();
    assert_eq!(les, ours);
}

#[test]
fn objective_changes_the_thresholds() {
    let g = graph("policies/enterprise");
    let a = alerts::render(&g, &options("policies/enterprise")).unwrap();
    let b = alerts::render(
        &g,
        &alerts::Options {
            objective: 0.999,
            policy: "policies/enterprise".into(),
            selector: Vec::new(),
            runbook_base: None,
        },
    )
    .unwrap();
    assert!(a.contains("> 0.144 and"));
    assert!(b.contains("> 0.0144 and"));
    let bad = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "alerts",
            "--policy",
            "policies/enterprise",
            "--objective",
            "100%",
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn snapshot_rules_batch_platform() {
    let p = "policies/batch-platform";
    insta::assert_snapshot!(alerts::render(&graph(p), &options(p)).unwrap());
}

#[test]
fn snapshot_dashboard_enterprise() {
    let p = "policies/enterprise";
    insta::assert_json_snapshot!(dashboard::dashboard(&graph(p), p));
}

/// `--selector` scopes every expression (and keeps its labels through
/// aggregations), `--runbook-base` makes runbook links absolute; promtool
/// accepts the result.
#[test]
fn selector_and_runbook_base() {
    let text = kiln(&[
        "alerts",
        "--policy",
        "policies/enterprise",
        "--selector",
        r#"job="kiln",namespace="prod""#,
        "--runbook-base",
        "https://git.example.com/kiln/blob/main/",
    ]);
    let rules: alerts::RulesFile = serde_norway::from_str(&text).unwrap();
    let mut exprs = 0;
    for r in rules.groups.iter().flat_map(|g| &g.rules) {
        let e = r.expr.as_str();
        exprs += 1;
        // Every series selected in the scope.
        for (i, _) in e.match_indices("kiln_").chain(e.match_indices("kiln:")) {
            let rest = &e[i..];
            let brace = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'));
            let after = brace.map(|b| &rest[b..]).unwrap_or("");
            assert!(
                after.starts_with(r#"{job="kiln",namespace="prod""#),
                "unscoped series in {e}"
            );
        }
        for (i, _) in e.match_indices(" by (") {
            let close = e[i..].find(')').unwrap();
            assert!(e[i..i + close].contains("job, namespace"), "{e}");
        }
        if let Some(u) = r.annotations.get("runbook_url") {
            assert!(
                u.starts_with("https://git.example.com/kiln/blob/main/docs/playbooks.md#"),
                "{u}"
            );
        }
    }
    assert!(exprs > 10, "{text}");
    if promtool() {
        let dir = scratch("selector");
        std::fs::write(dir.join("scoped.yml"), &text).unwrap();
        promtool_ok(&["check", "rules", "scoped.yml"], &dir);
        std::fs::remove_dir_all(dir).unwrap();
    }
    // The dashboard: a variable per `=` matcher, every query scoped to it.
    let d: serde_json::Value = serde_json::from_str(&kiln(&[
        "dashboard",
        "--policy",
        "policies/enterprise",
        "--selector",
        r#"job="kiln",namespace="prod""#,
    ]))
    .unwrap();
    let vars = d["templating"]["list"].as_array().unwrap();
    let names: Vec<&str> = vars.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, ["datasource", "job", "namespace", "tier", "tenant"]);
    assert_eq!(vars[1]["current"]["value"], "kiln");
    for e in dashboard::exprs(&d) {
        if e.contains("kiln_") {
            assert!(e.contains(r#"job="$job",namespace="$namespace""#), "{e}");
        }
    }
}

/// Panels of series a fresh gateway does not have yet (refusals, rollouts,
/// HTTP upstreams) read 0, not "No data": promtool evaluates each panel's
/// query over no series at all.
#[test]
fn dashboard_panels_read_zero_on_a_fresh_gateway() {
    let d = dashboard::dashboard(&graph("policies/enterprise"), "policies/enterprise");
    let panel_exprs: Vec<String> = dashboard::exprs(&d)
        .into_iter()
        .filter(|e| !e.starts_with("label_values") && !e.starts_with("histogram_quantile"))
        .collect();
    assert!(panel_exprs.len() >= 10, "{panel_exprs:?}");
    for e in &panel_exprs {
        assert!(e.ends_with(" or on() vector(0)"), "{e}");
    }
    if !promtool() {
        return;
    }
    let dir = scratch("fresh");
    // A test with no input series: each query, with Grafana's interval and
    // variables filled in, must give 0.
    let mut tests = String::from("rule_files: []\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series: []\n    promql_expr_test:\n");
    for e in &panel_exprs {
        let q = e
            .replace("$__rate_interval", "5m")
            .replace("=~\"$tier\"", "=~\".*\"")
            .replace("=~\"$tenant\"", "=~\".*\"");
        tests.push_str(&format!(
            "      - expr: {}\n        eval_time: 10m\n        exp_samples:\n          - labels: \"{{}}\"\n            value: 0\n",
            yaml_quote(&q)
        ));
    }
    std::fs::write(dir.join("fresh.test.yml"), tests).unwrap();
    promtool_ok(&["test", "rules", "fresh.test.yml"], &dir);
    std::fs::remove_dir_all(dir).unwrap();
}

/// batch-platform's `throughput { tokens 500k/min }` on batch-standard:
/// served 6,000 tokens a second while its queue holds work fires after
/// 15 minutes; served as little with an empty queue (it asked for no
/// more) never does. Its backfill tier's `deadline soft` makes a miss a
/// ticket, not a page.
#[test]
fn promtool_fires_the_throughput_alert_only_while_work_waits() {
    if !promtool() {
        return;
    }
    let dir = scratch("throughput");
    let p = "policies/batch-platform";
    std::fs::write(
        dir.join("rules.yml"),
        alerts::render(&graph(p), &options(p)).unwrap(),
    )
    .unwrap();
    let tokens = |tier: &str| {
        format!("kiln_tokens_total{{tier=\"{tier}\",tenant=\"t\",pool=\"p\",model=\"m\",variant=\"fp16\",kind=\"completion\"}}")
    };
    let depth = |tier: &str| format!("kiln_queue_depth{{tier=\"{tier}\",tenant=\"t\"}}");
    let misses = |tier: &str| format!("kiln_deadline_misses_total{{tier=\"{tier}\",tenant=\"t\"}}");
    let test = format!(
        r#"rule_files:
  - rules.yml
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: '{waiting_tokens}'
        values: '0+360000x40'
      - series: '{waiting_depth}'
        values: '5x40'
    alert_rule_test:
      - eval_time: 10m
        alertname: KilnTierThroughputBelowSLO
        exp_alerts: []
      - eval_time: 35m
        alertname: KilnTierThroughputBelowSLO
        exp_alerts:
          - exp_labels:
              severity: ticket
              tier: batch-standard
              owner: batch-platform@acme.example
              escalation: batch-platform-lead@acme.example
            exp_annotations:
              description: "Policy policies/batch-platform: tier batch-standard has a throughput SLO of 500000 tokens a minute; for 15 minutes it was served 6k tokens a second with requests waiting in its queues."
              runbook_url: "docs/playbooks.md#a-tier-is-missing-its-slo"
              summary: "Tier batch-standard is served fewer tokens a second than its SLO while work waits"
  - interval: 1m
    input_series:
      - series: '{waiting_tokens}'
        values: '0+360000x40'
      - series: '{waiting_depth}'
        values: '0x40'
      - series: '{backfill_misses}'
        values: '0 1 2 3 4 5 6 7 8 9'
    alert_rule_test:
      - eval_time: 35m
        alertname: KilnTierThroughputBelowSLO
        exp_alerts: []
      - eval_time: 5m
        alertname: KilnTierDeadlineMisses
        exp_alerts:
          - exp_labels:
              severity: ticket
              tier: backfill
              owner: batch-platform@acme.example
              escalation: batch-platform-lead@acme.example
            exp_annotations:
              description: "Policy policies/batch-platform: requests or batch items of tier backfill (completion window SLO 72h) finished after their deadline, or expired unrun, in the last 30 minutes."
              runbook_url: "docs/playbooks.md#a-tier-is-missing-its-slo"
              summary: "Tier backfill is missing deadlines"
"#,
        waiting_tokens = tokens("batch-standard"),
        waiting_depth = depth("batch-standard"),
        backfill_misses = misses("backfill"),
    );
    std::fs::write(dir.join("test.yml"), test).unwrap();
    promtool_ok(&["test", "rules", "test.yml"], &dir);
    std::fs::remove_dir_all(dir).unwrap();
}
