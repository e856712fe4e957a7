//! The metrics' families, priming at zero and rendering.

#[test]
fn priming_a_huge_policy_stays_within_its_budget() {
    let m = Metrics::new();
    let tier = |i: usize| CatalogTier {
        name: format!("t{i}"),
        tenants: (0..2_000).map(|n| format!("tenant-{n}")).collect(),
        routes: vec![("p".into(), "m.v".into()), ("q".into(), "m.v".into())],
        fallback_steps: 3,
        ttft_slo: true,
        exact_cache: false,
        semantic_cache: false,
    };
    let cat = Catalog {
        tiers: (0..20).map(tier).collect(),
        replicas: vec![("p".into(), "m.v".into())],
    };
    let made = m.prime("v1", &cat);
    assert!(made > 0 && made <= PRIME_BUDGET, "{made}");
    // Per-route series were skipped, per-tier ones kept.
    let text = m.render();
    assert!(!text.contains("kiln_ttft_seconds_bucket"));
    assert!(text.contains("kiln_preemptions_total{tenant=\"tenant-0\",tier=\"t0\"} 0"));
    // The same version and catalog again creates nothing new.
    assert_eq!(m.prime("v1", &cat), 0);
}

#[test]
fn primed_gauges_come_back_at_zero_after_a_reset() {
    let m = Metrics::new();
    let cat = Catalog {
        tiers: vec![CatalogTier {
            name: "chat".into(),
            tenants: vec!["acme".into(), "none".into()],
            routes: vec![("h100".into(), "llama.fp16".into())],
            fallback_steps: 1,
            ttft_slo: false,
            exact_cache: false,
            semantic_cache: false,
        }],
        replicas: vec![("h100".into(), "llama.fp16".into())],
    };
    m.prime("v1", &cat);
    m.reset_gauges();
    m.set_queue("chat", "acme", 4, 1.5);
    let text = m.render();
    assert!(
        text.contains("kiln_queue_depth{tenant=\"acme\",tier=\"chat\"} 4"),
        "{text}"
    );
    assert!(text.contains("kiln_queue_depth{tenant=\"none\",tier=\"chat\"} 0"));
    assert!(
        text.contains("kiln_replica_busy_ratio{model=\"llama\",pool=\"h100\",variant=\"fp16\"} 0")
    );
    assert!(text.contains("kiln_ttft_seconds_count{model=\"llama\",pool=\"h100\",tenant=\"acme\",tier=\"chat\",variant=\"fp16\"} 0"));
    // No TTFT SLO: no overload series; no tenant: no quota series.
    assert!(!text.contains("reason=\"overload\""));
    assert!(!text.contains("reason=\"quota\",status=\"429\",tenant=\"none\""));
}
use super::*;

const L: Labels<'static> = Labels {
    tier: "interactive",
    tenant: "support-bot",
    pool: "h100",
    model: "llama-70b",
};

/// One of every event, with values that render exactly.
fn populated() -> Metrics {
    let m = Metrics::new();
    let batch = Labels {
        tier: "batch",
        tenant: "none",
        ..L
    };
    m.request_done(&L, Outcome::Ok);
    m.request_done(&L, Outcome::Ok);
    m.request_done(&L, Outcome::Cancelled);
    m.request_done(&batch, Outcome::Timeout);
    m.request_done(&batch, Outcome::UpstreamError);
    m.request_done(
        &Labels {
            pool: "none",
            model: "none",
            ..batch
        },
        Outcome::Rejected,
    );
    m.rejected("batch", "none", "quota", 429);
    m.queue_wait(&L, 0.0005);
    m.queue_wait(&L, 0.125);
    m.queue_wait(&batch, 45.0);
    m.ttft(&L, 0.25);
    m.ttft(&L, 0.375);
    m.e2e(&L, 2.0);
    m.e2e(&batch, 400.0);
    m.tokens(&L, 1000, 250);
    m.tokens(&batch, 4096, 0);
    m.gpu_seconds(&L, 1.5, 0.00125);
    m.preempted("batch", "none");
    m.fallback("interactive", "support-bot", 1);
    m.deadline_miss("batch", "none");
    m.policy_swap(true);
    m.policy_swap(false);
    m.policy_swap(true);
    m.set_policy_version("3f2a9c1");
    m.set_queue("interactive", "support-bot", 3, 0.5);
    m.set_queue("batch", "none", 120, 42.25);
    m.set_replica(
        "h100",
        "llama-70b",
        ReplicaLoad {
            running: 12,
            slots: 64,
            kv_used: 300_000,
            kv_capacity: 1_000_000,
            busy_fraction: 0.75,
        },
    );
    m.set_replica(
        "h100",
        "llama-70b",
        ReplicaLoad {
            running: 4,
            slots: 64,
            kv_used: 100_000,
            kv_capacity: 1_000_000,
            busy_fraction: 0.25,
        },
    );
    m.set_replica(
        "l4",
        "llama-8b",
        ReplicaLoad {
            running: 0,
            slots: 32,
            kv_used: 0,
            kv_capacity: 200_000,
            busy_fraction: 0.0,
        },
    );
    m
}

fn series(text: &str, prefix: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn renders_expected_series_after_events() {
    let text = populated().render();
    for want in [
        "kiln_requests_total{model=\"llama-70b\",outcome=\"ok\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\"} 2",
        "kiln_requests_total{model=\"none\",outcome=\"rejected\",pool=\"none\",tenant=\"none\",tier=\"batch\",variant=\"none\"} 1",
        "kiln_rejects_total{reason=\"quota\",status=\"429\",tenant=\"none\",tier=\"batch\"} 1",
        "kiln_queue_wait_seconds_bucket{model=\"llama-70b\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\",le=\"0.001\"} 1",
        "kiln_queue_wait_seconds_count{model=\"llama-70b\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\"} 2",
        "kiln_ttft_seconds_sum{model=\"llama-70b\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\"} 0.625",
        "kiln_e2e_seconds_bucket{model=\"llama-70b\",pool=\"h100\",tenant=\"none\",tier=\"batch\",variant=\"none\",le=\"600\"} 1",
        "kiln_tokens_total{kind=\"completion\",model=\"llama-70b\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\"} 250",
        "kiln_gpu_seconds_total{model=\"llama-70b\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\"} 1.5",
        "kiln_cost_usd_total{model=\"llama-70b\",pool=\"h100\",tenant=\"support-bot\",tier=\"interactive\",variant=\"none\"} 0.00125",
        "kiln_preemptions_total{tenant=\"none\",tier=\"batch\"} 1",
        "kiln_fallbacks_total{step=\"1\",tenant=\"support-bot\",tier=\"interactive\"} 1",
        "kiln_deadline_misses_total{tenant=\"none\",tier=\"batch\"} 1",
        "kiln_policy_swaps_total{result=\"ok\"} 2",
        "kiln_policy_swaps_total{result=\"error\"} 1",
        "kiln_policy_info{version=\"3f2a9c1\"} 1",
        "kiln_queue_depth{tenant=\"none\",tier=\"batch\"} 120",
        "kiln_queue_oldest_wait_seconds{tenant=\"none\",tier=\"batch\"} 42.25",
        "kiln_replicas{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 2",
        "kiln_replica_slots_used{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 16",
        "kiln_replica_slots{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 128",
        "kiln_kv_cache_used_tokens{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 400000",
        "kiln_kv_cache_capacity_tokens{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 2000000",
        "kiln_kv_cache_usage_ratio{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 0.2",
        "kiln_replica_busy_ratio{model=\"llama-70b\",pool=\"h100\",variant=\"none\"} 0.5",
        "# HELP kiln_ttft_seconds Time from arrival at the gateway to the first output token.",
        "# TYPE kiln_e2e_seconds histogram",
        "# TYPE kiln_requests_total counter",
    ] {
        assert!(text.lines().any(|l| l == want), "missing {want}\n{text}");
    }
    // A zero count creates no series.
    assert!(!text.contains("kind=\"completion\",model=\"llama-70b\",pool=\"h100\",tenant=\"none\""));
    // Every metric has HELP and TYPE.
    let helps = series(&text, "# HELP").len();
    assert_eq!(helps, series(&text, "# TYPE").len());
    assert_eq!(helps, 23);
}

#[test]
fn fresh_metrics_export_policy_swaps_at_zero() {
    let text = Metrics::new().render();
    assert!(
        text.contains("kiln_policy_swaps_total{result=\"ok\"} 0\n"),
        "{text}"
    );
    assert!(text.contains("kiln_policy_swaps_total{result=\"error\"} 0\n"));
    assert_eq!(
        Metrics::content_type(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
}

#[test]
fn label_values_are_escaped() {
    let m = Metrics::new();
    m.preempted("t\"q", "a\\b\nc");
    m.set_policy_version("v \"1\"\n");
    let text = m.render();
    assert!(
        text.contains("kiln_preemptions_total{tenant=\"a\\\\b\\nc\",tier=\"t\\\"q\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("kiln_policy_info{version=\"v \\\"1\\\"\\n\"} 1\n"));
    // Every sample stays on one line.
    assert!(text
        .lines()
        .all(|l| l.starts_with("kiln_") || l.starts_with('#')));
}

#[test]
fn reset_gauges_removes_vanished_series() {
    let m = populated();
    m.reset_gauges();
    m.set_queue("interactive", "support-bot", 1, 0.125);
    m.set_replica(
        "l4",
        "llama-8b",
        ReplicaLoad {
            running: 2,
            slots: 32,
            kv_used: 50_000,
            kv_capacity: 200_000,
            busy_fraction: 0.5,
        },
    );
    let text = m.render();
    assert!(!text.contains("tenant=\"none\"}"), "{text}");
    assert!(!text.contains("model=\"llama-70b\",pool=\"h100\",variant=\"none\"}"));
    assert!(text.contains("kiln_queue_depth{tenant=\"support-bot\",tier=\"interactive\"} 1\n"));
    assert!(text.contains(
        "kiln_queue_oldest_wait_seconds{tenant=\"support-bot\",tier=\"interactive\"} 0.125\n"
    ));
    assert!(text.contains("kiln_replicas{model=\"llama-8b\",pool=\"l4\",variant=\"none\"} 1\n"));
    assert!(text.contains(
        "kiln_kv_cache_usage_ratio{model=\"llama-8b\",pool=\"l4\",variant=\"none\"} 0.25\n"
    ));
    // Counters and histograms are not gauges: they stay.
    assert!(text.contains("kiln_deadline_misses_total{tenant=\"none\",tier=\"batch\"} 1\n"));
    // Nothing left at all: the family disappears.
    m.reset_gauges();
    assert!(!m.render().contains("kiln_queue_depth"));
}

#[test]
fn policy_version_replaces_the_old_series() {
    let m = Metrics::new();
    m.set_policy_version("a");
    m.set_policy_version("b");
    assert_eq!(
        series(&m.render(), "kiln_policy_info"),
        ["kiln_policy_info{version=\"b\"} 1"]
    );
}

#[test]
fn bad_amounts_are_ignored_not_panics() {
    let m = Metrics::new();
    m.gpu_seconds(&L, -1.0, f64::NAN);
    m.gpu_seconds(&L, f64::INFINITY, 0.0);
    m.ttft(&L, f64::NAN);
    m.queue_wait(&L, -0.5);
    m.set_queue("t", "x", 0, f64::NAN);
    m.set_replica(
        "p",
        "m",
        ReplicaLoad {
            running: 0,
            slots: 0,
            kv_used: 5,
            kv_capacity: 0,
            busy_fraction: f64::NAN,
        },
    );
    let text = m.render();
    assert!(!text.contains("kiln_gpu_seconds_total"));
    assert!(!text.contains("kiln_cost_usd_total"));
    assert!(!text.contains("kiln_ttft_seconds"));
    assert!(
        text.contains("le=\"0.001\"} 1\n"),
        "negative wait counts as 0"
    );
    assert!(text.contains("kiln_kv_cache_usage_ratio{model=\"m\",pool=\"p\",variant=\"none\"} 0\n"));
    assert!(text.contains("kiln_replica_busy_ratio{model=\"m\",pool=\"p\",variant=\"none\"} 0\n"));
}

#[test]
fn decimal_formats_without_allocating() {
    let mut buf = [0u8; 5];
    assert_eq!(decimal(0, &mut buf), "0");
    assert_eq!(decimal(7, &mut buf), "7");
    assert_eq!(decimal(429, &mut buf), "429");
    assert_eq!(decimal(u16::MAX, &mut buf), "65535");
}

#[test]
fn snapshot_of_a_populated_sample() {
    insta::assert_snapshot!(populated().render());
}

/// `promtool check metrics` finds no problem in a populated sample.
/// Skipped (with a note) where promtool is not installed; Debian's
/// `prometheus` package has it.
#[test]
fn promtool_finds_no_problems() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("promtool not found; skipping the lint");
        return;
    };
    let text = populated().render();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool: {said}");
    assert!(said.trim().is_empty(), "promtool: {said}");
}

#[test]
fn upstream_breaker_gauge_follows_the_snapshot() {
    let m = Metrics::new();
    m.set_upstream_breaker("h100", "vllm-a", true);
    m.set_upstream_breaker("h100", "vllm-b", false);
    let text = m.render();
    assert!(text.contains("# TYPE kiln_upstream_breaker_open gauge"));
    assert!(text.contains("kiln_upstream_breaker_open{pool=\"h100\",upstream=\"vllm-a\"} 1"));
    assert!(text.contains("kiln_upstream_breaker_open{pool=\"h100\",upstream=\"vllm-b\"} 0"));
    // A replica that vanished from the snapshot stops being exported.
    m.reset_gauges();
    m.set_upstream_breaker("h100", "vllm-b", false);
    let text = m.render();
    assert!(!text.contains("vllm-a"));
}
