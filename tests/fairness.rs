//! Fair share in what tenants are *served*, and admission that keeps its
//! word, on the roofline model of one H100 running Llama-8B, with request
//! sizes from the recorded Azure 2023 conversation slice in examples/diff
//! (CC BY 4.0, see its LICENSE) and seeded Poisson arrivals per tenant at
//! rates set against the pool's measured capacity. The figures at full
//! length are in BENCHMARKS.md (`cargo bench --bench fairness`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::CostModel;
use kiln::graph::DecisionGraph;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Mode, Reason, Scheduler, MS, SEC};
use kiln::traffic::{self, synth, Record};
use proptest::prelude::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

fn policy(tenants: &[(&str, f64)], aging: &str) -> Arc<DecisionGraph> {
    let mut text = format!(
        r#"pool h100 {{ gpus 1 kind "H100-80GB" memory 80GB }}
model llama-8b {{
  params 8B
  kv_per_token 128KB
  variant fp16 {{ memory 18GB pools [h100] }}
}}
tier chat {{ priority 10 slo {{ ttft 2s }} {aging} }}
classify {{ default => tier chat }}
route chat llama-8b {{ default => fp16 }}
"#
    );
    for (name, w) in tenants {
        text.push_str(&format!(
            "tenant {name} {{ owner \"o\" tiers [chat] weight {w} }}\n"
        ));
    }
    let c = kiln::compile::compile_str("fair.kiln", &text);
    Arc::new(c.graph.expect("policy compiles"))
}

fn sizes() -> &'static [Record] {
    static S: std::sync::OnceLock<Vec<Record>> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/diff/traffic.jsonl");
        traffic::read(path).expect("slice")
    })
}

fn run(g: &Arc<DecisionGraph>, mode: Mode, records: &[Record]) -> Vec<Outcome> {
    let cost = CostModel::from_graph(g, None).expect("cost model");
    let cfg = Config {
        mode,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), cfg);
    replay::run(&mut s, replay::arrivals(records), |_, _| {})
}

/// Requests per second a policy's pool finishes when it never runs dry:
/// a burst of `secs` of arrivals at a million a second, served first come
/// first served, over the time the last one finished.
fn burst_capacity(g: &Arc<DecisionGraph>, model: &str, secs: f64) -> f64 {
    let load = [synth::Load {
        tenant: "t".into(),
        rate_per_s: 1e6,
    }];
    let burst = synth::poisson(sizes(), model, &load, secs, 1);
    let o = run(g, Mode::Fifo, &burst);
    let end = o.iter().filter_map(|o| o.finished).max().unwrap() as f64 / SEC as f64;
    burst.len() as f64 / end
}

/// Requests per second one replica finishes when it never runs dry.
fn capacity() -> f64 {
    static C: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *C.get_or_init(|| burst_capacity(&policy(&[("t", 1.0)], ""), "llama-8b", 0.001))
}

/// Tokens (prompt + output) of each tenant's requests that started inside
/// the window, whenever they arrived.
fn served(records: &[Record], o: &[Outcome], from_ms: f64, to_ms: f64) -> HashMap<String, f64> {
    let mut m = HashMap::new();
    for (r, o) in records.iter().zip(o) {
        let Some(t) = o.started.map(|t| t as f64 / MS as f64) else {
            continue;
        };
        if t >= from_ms && t < to_ms {
            *m.entry(r.tenant.clone().unwrap_or_default()).or_insert(0.0) +=
                (r.prompt_tokens + r.output_tokens) as f64;
        }
    }
    m
}

fn loads(names: &[&str], rate: f64) -> Vec<synth::Load> {
    names
        .iter()
        .map(|t| synth::Load {
            tenant: t.to_string(),
            rate_per_s: rate,
        })
        .collect()
}

const SECS: f64 = 120.0;

proptest! {
    // A fixed seed: these are statistical bounds over short runs, so CI
    // draws the same generated cases every time (the saved regressions run
    // first; `cargo bench --bench fair_mixes` covers more mixes, longer).
    #![proptest_config(ProptestConfig {
        cases: 6,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b696c6e),
        ..ProptestConfig::default()
    })]

    /// Three tenants, each offering the whole pool's capacity (so each is
    /// backlogged whatever its weight): each is served in proportion to its
    /// weight, within 15% over a two-minute run.
    #[test]
    fn backlogged_tenants_are_served_in_proportion_to_their_weights(
        w in prop::collection::vec(1u32..=4, 3),
        seed in 0u64..1000,
    ) {
        let names = ["a", "b", "c"];
        let ws: Vec<(&str, f64)> = names.iter().copied().zip(w.iter().map(|&x| f64::from(x))).collect();
        let g = policy(&ws, "");
        let recs = synth::poisson(sizes(), "llama-8b", &loads(&names, capacity()), SECS, seed);
        let o = run(&g, Mode::Kiln, &recs);
        let s = served(&recs, &o, SECS * 250.0, SECS * 750.0);
        let total: f64 = s.values().sum();
        let wsum: f64 = ws.iter().map(|(_, w)| w).sum();
        for (t, w) in &ws {
            let got = s.get(*t).copied().unwrap_or(0.0) / total;
            let share = w / wsum;
            prop_assert!((got / share - 1.0).abs() <= 0.15, "{t}: served {got:.3}, share {share:.3} ({ws:?})");
        }
    }

    /// Admission under a TTFT SLO keeps its word: whatever the overload,
    /// nearly every request admitted gets its first token within the SLO.
    #[test]
    fn admitted_requests_meet_their_ttft_slo(load in 1.2f64..3.0, seed in 0u64..1000) {
        let names = ["a", "b", "c", "d"];
        let g = policy(&names.iter().map(|t| (*t, 1.0)).collect::<Vec<_>>(), "");
        let recs = synth::poisson(sizes(), "llama-8b", &loads(&names, load * capacity() / 4.0), SECS, seed);
        let o = run(&g, Mode::Kiln, &recs);
        let admitted: Vec<&Outcome> = o.iter().filter(|o| o.rejected.is_none()).collect();
        let met = admitted
            .iter()
            .filter(|o| o.first_token.is_some_and(|f| f - o.arrival <= 2 * SEC))
            .count();
        let share = met as f64 / admitted.len().max(1) as f64;
        // (0.93 before admission estimated from the start tag: a request's
        // own size no longer counts against its place, so long prompts are
        // no longer refused first, and at up to 3x overload over two
        // minutes 92.6-93.0% of admitted ones meet it; over ten minutes at
        // 1.5x, BENCHMARKS.md: 99%.)
        prop_assert!(share >= 0.92, "{met} of {} admitted met the SLO at {load:.2}x", admitted.len());
        // Overloaded, it refuses early, with a reason: it does not admit all.
        prop_assert!(admitted.len() < o.len());
        for x in o.iter().filter_map(|o| o.rejected) {
            prop_assert!(matches!(x, (Reason::Overload | Reason::Fairness, 429)), "{x:?}");
        }
    }
}

/// Beside four tenants flooding at twice capacity, a tenant asking a fifth
/// of its share is served (almost) everything it asks, in time, and is
/// never refused for fairness while the floods are.
#[test]
fn a_tenant_below_its_share_gets_what_it_asks() {
    let ws = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 4.0), ("e", 1.0)];
    let g = policy(&ws, "");
    let cap = capacity();
    let mut l = loads(&["a", "b", "c", "d"], cap / 2.0);
    l.push(synth::Load {
        tenant: "e".into(),
        rate_per_s: 0.2 * cap / 9.0,
    });
    let recs = synth::poisson(sizes(), "llama-8b", &l, SECS, 3);
    let o = run(&g, Mode::Kiln, &recs);
    let of = |t: &str| {
        recs.iter()
            .zip(&o)
            .filter(|(r, _)| r.tenant.as_deref() == Some(t))
            .map(|(_, o)| o)
            .collect::<Vec<_>>()
    };
    let e = of("e");
    let refused = e.iter().filter(|o| o.rejected.is_some()).count();
    assert!(e.len() >= 20, "{}", e.len());
    // (BENCHMARKS.md: 97% of what it asks over ten minutes; a two-minute
    // run has few of its requests, so the bound here is looser.)
    assert!(refused * 8 <= e.len(), "{refused} of {} refused", e.len());
    let late = e
        .iter()
        .filter(|o| o.first_token.is_some_and(|f| f - o.arrival > 2 * SEC))
        .count();
    assert!(late * 20 <= e.len(), "{late} late");
    // The floods are shed, with a reason and a Retry-After.
    let a = of("a");
    assert!(a.iter().any(|o| o.rejected.is_some()));
}

/// A flooder at ten times its share beside three polite tenants is shed
/// for fairness (it is above its share), the polite ones are served.
#[test]
fn a_flooder_is_shed_for_fairness() {
    let ws = [("p1", 1.0), ("p2", 1.0), ("p3", 1.0), ("flood", 1.0)];
    let g = policy(&ws, "");
    let cap = capacity();
    let mut l = loads(&["p1", "p2", "p3"], 0.2 * cap);
    l.extend(loads(&["flood"], 10.0 * cap / 4.0));
    let recs = synth::poisson(sizes(), "llama-8b", &l, SECS, 5);
    let o = run(&g, Mode::Kiln, &recs);
    let (mut fair, mut shed, mut polite, mut polite_refused) = (0, 0, 0, 0);
    for (r, o) in recs.iter().zip(&o) {
        if r.tenant.as_deref() == Some("flood") {
            shed += usize::from(o.rejected.is_some());
            fair += usize::from(matches!(o.rejected, Some((Reason::Fairness, 429))));
        } else {
            polite += 1;
            polite_refused += usize::from(o.rejected.is_some());
        }
    }
    assert!(fair * 2 >= shed, "{fair} of {shed} shed for fairness");
    assert!(
        polite_refused * 20 <= polite,
        "{polite_refused} of {polite}"
    );
}

/// Aging raises a tier against other tiers, never one tenant over another
/// inside a tier: however long the over-served tenant's request has waited
/// (aging here is 1 ms a priority level), the least-served tenant goes
/// first, so fair share holds exactly as it does without aging.
#[test]
fn aging_never_reorders_tenants_within_a_tier() {
    let ws = [("a", 1.0), ("b", 1.0)];
    let cap = capacity();
    let recs = {
        let mut l = loads(&["a"], 2.0 * cap);
        l.extend(loads(&["b"], 0.25 * cap));
        synth::poisson(sizes(), "llama-8b", &l, 60.0, 9)
    };
    let aged = run(&policy(&ws, "aging 1ms"), Mode::Kiln, &recs);
    let starve = run(&policy(&ws, "may_starve"), Mode::Kiln, &recs);
    let key = |o: &[Outcome]| {
        o.iter()
            .map(|o| (o.started, o.rejected.map(|r| r.0)))
            .collect::<Vec<_>>()
    };
    assert!(
        key(&aged) == key(&starve),
        "aging changed the order inside the tier"
    );
    // And b, below its share, is never refused for fairness.
    assert!(recs
        .iter()
        .zip(&aged)
        .filter(|(r, _)| r.tenant.as_deref() == Some("b"))
        .all(|(_, o)| !matches!(o.rejected, Some((Reason::Fairness, _)))));
}

/// A pool shape for generated mixes: Llama-8B on one small L4 (its own
/// capacity, slower prefill than the H100 above).
fn l4_policy(tenants: &[(String, u32)]) -> Arc<DecisionGraph> {
    let tenants: Vec<(&str, f64)> = tenants
        .iter()
        .map(|(t, w)| (t.as_str(), f64::from(*w)))
        .collect();
    one_tier_policy(
        r#"pool p { gpus 1 kind "L4" memory 24GB }
model llama-8b { params 8B kv_per_token 128KB variant fp16 { memory 17GB pools [p] } }
tier chat { priority 10 slo { ttft 3s } }
route chat llama-8b { default => fp16 }
"#,
        &tenants,
    )
}

/// A pool shape's policy: its pool, model, tier `chat` and route, every
/// request classified to `chat`, and the tenants with their weights.
fn one_tier_policy(shape: &str, tenants: &[(&str, f64)]) -> Arc<DecisionGraph> {
    let mut text = format!("{shape}classify {{ default => tier chat }}\n");
    for (name, w) in tenants {
        text.push_str(&format!(
            "tenant {name} {{ owner \"o\" tiers [chat] weight {w} }}\n"
        ));
    }
    let c = kiln::compile::compile_str("shape.kiln", &text);
    Arc::new(c.graph.expect("policy compiles"))
}

fn l4_capacity() -> f64 {
    static C: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *C.get_or_init(|| burst_capacity(&l4_policy(&[("t".into(), 1)]), "llama-8b", 0.0005))
}

proptest! {
    // A fixed seed: these are statistical bounds over short runs, so CI
    // draws the same generated cases every time (the saved regressions run
    // first; `cargo bench --bench fair_mixes` covers more mixes, longer).
    #![proptest_config(ProptestConfig {
        cases: 6,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b696c6e),
        ..ProptestConfig::default()
    })]

    /// Generated mixes, not hand-picked ones: random weights (1 to 8) and
    /// random demands (each tenant 1.5x to 3x the pool's capacity, so all
    /// are backlogged whatever the weights) under a TTFT SLO, where
    /// admission control decides who is refused. Each tenant is served (in
    /// tokens of requests that started in the middle of the run) its
    /// weighted share, within 15% over six minutes (BENCHMARKS.md has
    /// the ten-minute figures over three pool shapes: within 10%).
    #[test]
    fn generated_mixes_are_served_by_weight_under_admission_control(
        mix in prop::collection::vec((1u32..=8, 1.5f64..3.0), 2..=4),
        seed in 0u64..1000,
    ) {
        let tenants: Vec<(String, u32)> =
            mix.iter().enumerate().map(|(i, (w, _))| (format!("t{i}"), *w)).collect();
        let g = l4_policy(&tenants);
        let cap = l4_capacity();
        let loads: Vec<synth::Load> = tenants
            .iter()
            .zip(&mix)
            .map(|((t, _), (_, d))| synth::Load { tenant: t.clone(), rate_per_s: d * cap })
            .collect();
        let secs = 360.0;
        let recs = synth::poisson(sizes(), "llama-8b", &loads, secs, seed);
        let o = run(&g, Mode::Kiln, &recs);
        let s = served(&recs, &o, secs * 300.0, secs * 900.0);
        let total: f64 = s.values().sum();
        let wsum: f64 = tenants.iter().map(|(_, w)| f64::from(*w)).sum();
        for (t, w) in &tenants {
            let got = s.get(t).copied().unwrap_or(0.0) / total;
            let share = f64::from(*w) / wsum;
            prop_assert!((got / share - 1.0).abs() <= 0.15, "{t}: served {got:.3}, share {share:.3} ({mix:?})");
        }
        // Refusals say why, and none is `infeasible` on these prompts.
        for x in o.iter().filter_map(|o| o.rejected) {
            prop_assert!(matches!(x, (Reason::Overload | Reason::Fairness, 429)), "{x:?}");
        }
    }
}

/// `fair_share { window }` acts: a tenant that idled keeps a credit of a
/// sixtieth of the window (at its weight's part of the recent throughput)
/// when it comes back, so after a minute of idling its burst beside a
/// backlogged tenant is served sooner under a 1-day window than under a
/// 5-second one (which forgets its idling at once, as plain VTC does).
#[test]
fn the_fair_share_window_changes_who_goes_first_after_idling() {
    let cap = capacity();
    let run_with = |window: &str| {
        let g = policy(
            &[("a", 1.0), ("b", 1.0)],
            &format!("fair_share {{ window {window} }}"),
        );
        let mut recs = synth::poisson(sizes(), "llama-8b", &loads(&["a"], 2.0 * cap), 90.0, 4);
        // b's burst after 60 s of idling: a tenth of a second's arrivals.
        let burst = synth::poisson(sizes(), "llama-8b", &loads(&["b"], 40.0 * cap), 0.25, 5);
        recs.extend(burst.into_iter().map(|mut r| {
            r.at_ms += 60_000.0;
            r
        }));
        recs.sort_by(|x, y| x.at_ms.total_cmp(&y.at_ms));
        let o = run(&g, Mode::Kiln, &recs);
        let b: Vec<&Outcome> = recs
            .iter()
            .zip(&o)
            .filter(|(r, _)| r.tenant.as_deref() == Some("b"))
            .map(|(_, o)| o)
            .collect();
        let served = b.iter().filter(|o| o.first_token.is_some()).count();
        let ttft: u64 = b
            .iter()
            .filter_map(|o| Some(o.first_token? - o.arrival))
            .sum::<u64>()
            / served.max(1) as u64;
        (b.len(), served, ttft)
    };
    let (n, short_served, short_ttft) = run_with("5s");
    let (_, long_served, long_ttft) = run_with("1d");
    eprintln!("b's burst of {n}: window 5s served {short_served}, mean TTFT {short_ttft} µs; window 1d served {long_served}, mean TTFT {long_ttft} µs");
    assert!(n >= 10, "{n}");
    assert!(
        long_served > short_served || (long_served == short_served && long_ttft * 10 < short_ttft * 9),
        "the window changed nothing: 5s {short_served} served, {short_ttft} µs; 1d {long_served} served, {long_ttft} µs"
    );
}

/// The report's `busy` is a true load figure: a light trickle (about a
/// tenth of what the replica can do) keeps a step running most of the
/// time, yet uses little of the replica's capacity; a backlog uses most of
/// it. (`busy` once counted any step as busy and read 92% at 30% load.)
#[test]
fn busy_is_the_share_of_capacity_used_not_of_time_stepping() {
    let g = policy(&[("a", 1.0)], "");
    let cost = CostModel::from_graph(&g, None).expect("cost model");
    let cap = capacity();
    let report = |rate: f64| {
        let recs = synth::poisson(
            sizes(),
            "llama-8b",
            &[synth::Load {
                tenant: "a".into(),
                rate_per_s: rate,
            }],
            120.0,
            7,
        );
        replay::replay_at(&g, &cost, &recs, Config::default(), "kiln", 1.0, |_, _| {})
    };
    let light = report(0.1 * cap);
    let stepping = light.stepping.unwrap_or(0.0);
    assert!(
        light.busy < 0.3,
        "busy {} at a tenth of capacity",
        light.busy
    );
    assert!(
        stepping > light.busy,
        "stepping {stepping}, busy {}",
        light.busy
    );
    let heavy = report(3.0 * cap);
    assert!(heavy.busy > 0.6, "busy {} in a backlog", heavy.busy);
    assert!(heavy.busy > 3.0 * light.busy);
}

/// A Llama-70B TP2 pair (two replicas on four H100s, 2 s TTFT): KV memory,
/// not compute, binds it, so the tier's queue-drain estimates run 3-15x
/// short and the misestimate factor learnt from backlogged tenants is
/// large.
fn pair_policy(tenants: &[(&str, f64)]) -> Arc<DecisionGraph> {
    one_tier_policy(
        r#"pool p { gpus 4 kind "H100-80GB" memory 80GB }
model llama-70b { params 70B kv_per_token 320KB variant fp16 { memory 140GB gpus_per_replica 2 pools [p] } }
tier chat { priority 10 slo { ttft 2s } }
route chat llama-70b { default => fp16 }
"#,
        tenants,
    )
}

/// Requests per second the 70B pair finishes when it never runs dry.
fn pair_capacity() -> f64 {
    static C: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *C.get_or_init(|| burst_capacity(&pair_policy(&[("t", 1.0)]), "llama-70b", 0.0005))
}

/// A tenant asking a few percent of the pool is first in fair order
/// whenever it sends: nothing queued goes ahead of it, so its wait is the
/// next slot to free, corrected by how far such estimates ran off, not by
/// the factor learnt from backlogged tenants' queue-drain estimates (11-20x
/// here). That factor refused about a fifth of its requests (`overload`)
/// beside three tenants at 0.6-2.6x the pool (`cargo bench --bench
/// fair_mixes`, 70B pair, mix 1).
#[test]
fn a_light_tenant_first_in_fair_order_is_not_refused_for_the_tiers_misestimate() {
    let ws = [("a", 4.0), ("b", 8.0), ("c", 1.0), ("light", 2.0)];
    let g = pair_policy(&ws);
    let cap = pair_capacity();
    let secs = 480.0;
    let mut asked = 0usize;
    let mut refused = 0usize;
    let mut in_time = 0usize;
    for seed in [1, 2] {
        let mut l = Vec::new();
        for (t, d) in [("a", 2.58), ("b", 1.74), ("c", 0.6), ("light", 0.04)] {
            l.push(synth::Load {
                tenant: t.into(),
                rate_per_s: d * cap,
            });
        }
        let recs = synth::poisson(sizes(), "llama-70b", &l, secs, seed);
        let o = run(&g, Mode::Kiln, &recs);
        for (r, o) in recs.iter().zip(&o) {
            // After the first minute, once the factor has been learnt.
            if r.tenant.as_deref() != Some("light") || r.at_ms < 60_000.0 {
                continue;
            }
            asked += 1;
            refused += usize::from(o.rejected.is_some());
            in_time += usize::from(
                o.rejected.is_none() && o.first_token.is_some_and(|f| f - o.arrival <= 2 * SEC),
            );
        }
    }
    eprintln!("light tenant: {asked} asked, {refused} refused, {in_time} in time");
    assert!(asked >= 40, "{asked}");
    assert!(refused * 20 <= asked, "{refused} of {asked} refused");
    assert!(in_time * 10 >= asked * 9, "{in_time} of {asked} in time");
}

/// A backlogged low-weight tenant is first in fair order whenever its own
/// queue runs empty. Priced at its own size then, its short prompts passed
/// where its long ones failed, and it was served short requests: its
/// service in requests drifted from its service in tokens (+16% on this
/// mix, `cargo bench --bench fair_mixes`, 70B pair, mix 9). A tenant using
/// about its share is priced size-neutrally even when it is first, so what
/// it is served is as long, per request, as what it asks.
#[test]
fn a_backlogged_low_weight_tenant_is_not_served_only_its_short_requests() {
    let ws = [("a", 1.0), ("b", 8.0), ("c", 7.0), ("d", 8.0)];
    let g = pair_policy(&ws);
    let cap = pair_capacity();
    let secs = 900.0;
    let (mut asked, mut asked_n, mut served, mut served_n) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for seed in [1, 2, 3] {
        let l: Vec<synth::Load> = [("a", 2.65), ("b", 1.82), ("c", 2.76), ("d", 1.35)]
            .iter()
            .map(|(t, d)| synth::Load {
                tenant: t.to_string(),
                rate_per_s: d * cap,
            })
            .collect();
        let recs = synth::poisson(sizes(), "llama-70b", &l, secs, seed);
        let o = run(&g, Mode::Kiln, &recs);
        for (r, o) in recs.iter().zip(&o) {
            if r.tenant.as_deref() != Some("a") || r.at_ms < 60_000.0 {
                continue;
            }
            let tokens = (r.prompt_tokens + r.output_tokens) as f64;
            asked += tokens;
            asked_n += 1.0;
            if o.rejected.is_none() && o.finished.is_some() {
                served += tokens;
                served_n += 1.0;
            }
        }
    }
    let (asked_mean, served_mean) = (asked / asked_n, served / served_n.max(1.0));
    eprintln!("weight-1 tenant: asked {asked_mean:.0} tokens a request, served {served_mean:.0} ({served_n} requests)");
    assert!(served_n >= 100.0, "{served_n}");
    assert!(
        (served_mean / asked_mean - 1.0).abs() <= 0.08,
        "asked {asked_mean:.0} tokens a request, served {served_mean:.0}"
    );
}

/// A pool with room is not contended, whatever each tenant sends: two
/// tenants asking 42% of an L4 between them (weights 8:5, the weight-5
/// one sending more than its weight's part of what is admitted) are both
/// served as fifo serves them. Read against the admitted total alone, the
/// heavier one counted as above its share, was priced at the tier's large
/// prompts, and its estimates were kept from the learnt factor (3-5x
/// pessimistic there): it was refused 6% of its requests, all of which fifo
/// served in time (`cargo bench --bench fair_mixes`, L4, mix 2).
#[test]
fn a_pool_with_room_does_not_refuse_the_tenant_sending_more() {
    let g = l4_policy(&[("a".into(), 8), ("b".into(), 5)]);
    let cap = l4_capacity();
    let secs = 1200.0;
    let loads = [
        synth::Load {
            tenant: "a".into(),
            rate_per_s: 0.16 * cap,
        },
        synth::Load {
            tenant: "b".into(),
            rate_per_s: 0.26 * cap,
        },
    ];
    let recs = synth::poisson(sizes(), "llama-8b", &loads, secs, 2);
    let in_time = |mode| {
        let o = run(&g, mode, &recs);
        let (mut asked, mut refused, mut met) = (0usize, 0usize, 0usize);
        for (r, o) in recs.iter().zip(&o) {
            // Once the pool's load has been read (a load window).
            if r.tenant.as_deref() != Some("b") || r.at_ms < 60_000.0 {
                continue;
            }
            asked += 1;
            refused += usize::from(o.rejected.is_some());
            met += usize::from(
                o.rejected.is_none() && o.first_token.is_some_and(|f| f - o.arrival <= 3 * SEC),
            );
        }
        (asked, refused, met)
    };
    let (asked, refused, kiln) = in_time(Mode::Kiln);
    let (_, _, fifo) = in_time(Mode::Fifo);
    eprintln!("b: {asked} asked, kiln refused {refused}, in time kiln {kiln} fifo {fifo}");
    assert!(asked >= 300, "{asked}");
    assert!(refused * 100 <= asked, "{refused} of {asked} refused");
    assert!(kiln * 100 >= fifo * 99, "kiln {kiln} in time, fifo {fifo}");
}

/// A replay of the 70B pair with fair share's own preemption on or off.
fn run_preempting(g: &Arc<DecisionGraph>, on: bool, records: &[Record]) -> Vec<Outcome> {
    let cost = CostModel::from_graph(g, None).expect("cost model");
    let cfg = Config {
        fair_preemption: on,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), cfg);
    replay::run(&mut s, replay::arrivals(records), |_, _| {})
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 8,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b696c6e),
        ..ProptestConfig::default()
    })]
    /// A light tenant (asking 20-80% of its weighted share) beside one or
    /// two backlogged tenants (1.5-3x the 70B pair each), random weights:
    /// a pool the backlogged tenants keep full, where its requests arrive
    /// to find every slot and KV block taken. It may take a slot from a
    /// tenant above its share (fair share's own preemption), so it is
    /// served in time most of what it asks, and never less than without
    /// that (within two requests: one preemption moves every later start).
    #[test]
    fn a_light_tenant_beside_backlogged_ones_gets_what_it_asks_in_time(
        light_w in 1u32..=8,
        heavy in prop::collection::vec((1u32..=8, 1.5f64..3.0), 1..=2),
        part in 0.2f64..0.8,
        seed in 0u64..1000,
    ) {
        let names = ["light", "h0", "h1"];
        let mut ws: Vec<(&str, f64)> = vec![("light", f64::from(light_w))];
        for (i, (w, _)) in heavy.iter().enumerate() {
            ws.push((names[i + 1], f64::from(*w)));
        }
        let wsum: f64 = ws.iter().map(|(_, w)| w).sum();
        let g = pair_policy(&ws);
        let cap = pair_capacity();
        let light_rate = part * f64::from(light_w) / wsum * cap;
        // Long enough for about 60 of its requests after the first minute.
        let secs = (60.0 + 60.0 / light_rate).clamp(300.0, 1_200.0);
        let mut l = vec![synth::Load { tenant: "light".into(), rate_per_s: light_rate }];
        for (i, (_, d)) in heavy.iter().enumerate() {
            l.push(synth::Load { tenant: names[i + 1].into(), rate_per_s: d * cap });
        }
        let recs = synth::poisson(sizes(), "llama-70b", &l, secs, seed);
        let in_time = |o: &[Outcome]| {
            let (mut asked, mut ok) = (0usize, 0usize);
            for (r, o) in recs.iter().zip(o) {
                if r.tenant.as_deref() != Some("light") || r.at_ms < 60_000.0 {
                    continue;
                }
                asked += 1;
                ok += usize::from(
                    o.rejected.is_none() && o.first_token.is_some_and(|f| f - o.arrival <= 2 * SEC),
                );
            }
            (asked, ok)
        };
        let (asked, with) = in_time(&run_preempting(&g, true, &recs));
        let (_, without) = in_time(&run_preempting(&g, false, &recs));
        eprintln!("light w{light_w} part {part:.2} heavy {heavy:?}: {asked} asked, {with} in time with, {without} without");
        // Not the 95% of issue 26 yet: a weight-1 light tenant beside one
        // or two backlogged ones gets 83-92% of its requests in time here.
        prop_assert!(with * 100 >= asked * 80, "{with} of {asked} in time (without: {without})");
        prop_assert!(with + 2 >= without, "{with} in time with, {without} without, of {asked}");
    }
}
