//! Money budgets (#32 item 5): `budget 20/day` on a tenant or a tier is
//! spent by its GPU time at the pool's `price` (or the tenant's `cost`),
//! `budget.remaining` reads what is left, and a rule acts on it. On a
//! replay of Azure 2023 conversation sizes (../shared/traces, CC BY 4.0):
//! the account equals the GPU time of the requests it paid for; once a
//! rule refuses on it, nothing more of that tenant is admitted that day;
//! a new day starts a new budget; the tenant without a budget never
//! notices. The gateway exports the same accounts as `kiln_budget_*`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::backend::cost::CostModel;
use kiln::graph::DecisionGraph;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Scheduler};
use kiln::server::config::ServerConfig;
use kiln::traffic::{self, import::Mapping, synth, Record};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use support::{metric_sum, scrape, serve_on_loopback};

/// One GPU at 3600 an hour: a GPU-second costs exactly 1.
fn policy_text(rule: &str, budgets: &str) -> String {
    format!(
        r#"pool gpu {{ gpus 1 kind "H100-80GB" memory 80GB price 3600/h }}
model m {{ params 8B kv_per_token 128KB variant fp16 {{ memory 18GB pools [gpu] }} }}
tier chat {{ priority 10 slo {{ ttft 5s }} {tier_budget} }}
tenant spender {{ owner "o" tiers [chat] {tenant_budget} api_keys ["k-spender"] }}
tenant other {{ owner "o" tiers [chat] api_keys ["k-other"] }}
classify {{ default => tier chat }}
route chat m {{ default => fp16 }}
admit chat {{
  {rule}
  default => accept
}}
"#,
        tier_budget = if budgets == "tier" {
            "budget 30/day"
        } else {
            ""
        },
        tenant_budget = if budgets == "tenant" {
            "budget 20/day"
        } else {
            ""
        },
    )
}

fn graph(rule: &str, budgets: &str) -> Arc<DecisionGraph> {
    let c = kiln::compile::compile_str("budgets.kiln", &policy_text(rule, budgets));
    Arc::new(c.graph.unwrap_or_else(|| panic!("{:?}", c.diagnostics)))
}

const REFUSE: &str = r#"when budget.remaining <= 0% => reject 429 "budget spent""#;

fn traffic(seconds: f64) -> Vec<Record> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/azure2023");
    let sizes = traffic::import::azure(
        dir.join("AzureLLMInferenceTrace_conv.csv"),
        &Mapping::new("m"),
    )
    .unwrap()
    .records;
    synth::poisson(
        &sizes,
        "m",
        &[
            synth::Load {
                tenant: "spender".into(),
                rate_per_s: 3.0,
            },
            synth::Load {
                tenant: "other".into(),
                rate_per_s: 1.0,
            },
        ],
        seconds,
        11,
    )
}

/// Replays `recs` from `start_minute` (minute of the day at time 0).
fn run(g: &Arc<DecisionGraph>, recs: &[Record], start_minute: u32) -> (Vec<Outcome>, Scheduler) {
    let cost = CostModel::from_graph(g, None).unwrap();
    let cfg = Config {
        start_minute_of_day: start_minute,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), cfg);
    let o = replay::run(&mut s, replay::arrivals(recs), |_, _| {});
    (o, s)
}

fn of<'a>(recs: &'a [Record], o: &'a [Outcome], tenant: &str) -> Vec<(&'a Record, &'a Outcome)> {
    recs.iter()
        .zip(o)
        .filter(|(r, _)| r.tenant.as_deref() == Some(tenant))
        .collect()
}

fn refused_429(o: &Outcome) -> bool {
    o.rejected.is_some_and(|(_, status)| status == 429)
}

#[test]
fn a_budget_is_spent_by_gpu_time_and_a_rule_stops_the_tenant_for_the_day() {
    let recs = traffic(120.0);
    // Without a rule on it, the spender would spend several budgets.
    let (free, _) = run(&graph("", "tenant"), &recs, 12 * 60);
    let would: f64 = of(&recs, &free, "spender")
        .iter()
        .map(|(_, o)| o.gpu_seconds)
        .sum();
    assert!(would > 60.0, "the spender would use {would} GPU-seconds");

    let (o, s) = run(&graph(REFUSE, "tenant"), &recs, 12 * 60);
    let spender = of(&recs, &o, "spender");
    let paid: f64 = spender.iter().map(|(_, o)| o.gpu_seconds).sum();
    // The account is the GPU time of the spender's requests, at 1 a
    // GPU-second: every charge reached it, and nothing else did.
    let view = s.budgets();
    assert_eq!(view.len(), 1, "{view:?}");
    assert_eq!(
        (view[0].scope, view[0].name.as_str()),
        ("tenant", "spender")
    );
    assert_eq!(view[0].period, "day");
    assert!(
        (view[0].spent - paid).abs() < 1e-6,
        "account {} against requests {paid}",
        view[0].spent
    );
    // Refused only once spent: the budget was reached (what was in flight
    // then may run over it a little), and far less was spent than without.
    assert!(
        paid >= 20.0 && paid < 0.7 * would,
        "paid {paid}, would {would}"
    );
    let first = spender
        .iter()
        .position(|(_, o)| refused_429(o))
        .expect("the spender was refused");
    assert!(first > 0, "refused before spending anything");
    eprintln!(
        "spender: {} requests, paid {paid:.1} of a 20 budget (would {would:.1}), refused from #{first}",
        spender.len()
    );
    // Spending only grows within a day: after the first refusal, nothing
    // of the spender is admitted.
    let admitted_after = spender[first..]
        .iter()
        .filter(|(_, o)| o.rejected.is_none())
        .count();
    assert_eq!(admitted_after, 0, "admitted after the budget ran out");
    // The tenant without a budget never notices.
    let other = of(&recs, &o, "other");
    assert!(!other.is_empty());
    assert!(other.iter().all(|(_, o)| o.rejected.is_none()));
}

#[test]
fn a_new_day_starts_a_new_budget() {
    // 23:58 at time 0: the day turns 120 s in.
    let recs = traffic(180.0);
    let g = graph(REFUSE, "tenant");
    let cost = CostModel::from_graph(&g, None).unwrap();
    let cfg = Config {
        start_minute_of_day: 23 * 60 + 58,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), replay::plan(&g, &cost), cfg);
    let o = replay::run(&mut s, replay::arrivals(&recs), |_, _| {});
    let turn = 120.0 * 1000.0;
    let spender = of(&recs, &o, "spender");
    let before: Vec<_> = spender.iter().filter(|(r, _)| r.at_ms < turn).collect();
    let after: Vec<_> = spender.iter().filter(|(r, _)| r.at_ms >= turn).collect();
    assert!(before.iter().any(|(_, o)| refused_429(o)), "never ran out");
    // The first requests of the new day are admitted again.
    let admitted = after
        .iter()
        .take(5)
        .filter(|(_, o)| o.rejected.is_none())
        .count();
    assert!(
        admitted >= 4,
        "{admitted} of the new day's first 5 admitted"
    );
}

#[test]
fn a_tier_budget_is_shared_by_its_tenants() {
    let recs = traffic(120.0);
    let (o, s) = run(&graph(REFUSE, "tier"), &recs, 12 * 60);
    let paid: f64 = o.iter().map(|o| o.gpu_seconds).sum();
    let view = s.budgets();
    assert_eq!(view.len(), 1, "{view:?}");
    assert_eq!((view[0].scope, view[0].name.as_str()), ("tier", "chat"));
    assert!(
        (view[0].spent - paid).abs() < 1e-6,
        "{} vs {paid}",
        view[0].spent
    );
    assert!(paid >= 30.0, "{paid}");
    // Once the tier's budget is spent, both tenants are refused.
    for t in ["spender", "other"] {
        assert!(
            of(&recs, &o, t).iter().any(|(_, o)| refused_429(o)),
            "{t} never refused"
        );
    }
}

#[test]
fn unpriced_gpu_time_spends_nothing() {
    let text = policy_text(REFUSE, "tenant").replace(" price 3600/h", "");
    let c = kiln::compile::compile_str("budgets.kiln", &text);
    let g = Arc::new(c.graph.unwrap());
    let recs = traffic(60.0);
    let (o, s) = run(&g, &recs, 12 * 60);
    assert!(o.iter().all(|o| o.rejected.is_none()));
    assert_eq!(s.budgets()[0].spent, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_exports_what_each_budget_spent() {
    let cfg = ServerConfig::parse("kiln.toml", "[sim]\nspeed = 20.0\n").unwrap();
    let p = support::policy("budgets.kiln", &policy_text("", "tenant"));
    let srv = serve_on_loopback(p, cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = support::client(Duration::from_secs(60));
    let before = scrape(&c, &base).await;
    let sel = ["scope=\"tenant\"", "name=\"spender\"", "period=\"day\""];
    assert_eq!(
        metric_sum(&before, "kiln_budget_limit", &sel),
        20.0,
        "{before}"
    );
    assert_eq!(metric_sum(&before, "kiln_budget_spent", &sel), 0.0);
    for _ in 0..3 {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-spender")
            .json(&json!({"model": "m", "max_tokens": 64,
                "messages": [{"role": "user", "content": "word ".repeat(300)}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let m = scrape(&c, &base).await;
    let spent = metric_sum(&m, "kiln_budget_spent", &sel);
    // At 3600 an hour, the same as the cost the gateway recorded.
    let cost = metric_sum(&m, "kiln_cost_usd_total", &["tenant=\"spender\""]);
    assert!(spent > 0.0, "{m}");
    assert!(
        (spent - cost).abs() <= 1e-6 * cost.max(1.0),
        "spent {spent}, cost {cost}"
    );
    srv.stop().await;
}
