//! Fair admission on *generated* tenant mixes, not hand-picked ones: for
//! each pool shape (a Llama-70B TP2 pair, Llama-8B on one small L4, a
//! 16-GPU Llama-8B fleet) and each seed, random weights (1 to 8) and random
//! demands (each tenant 0.5x to 3x the pool's capacity) on one tier with a
//! TTFT SLO, so admission control is active. Request sizes come from the
//! Azure 2023 conversation trace (../shared/traces, CC BY 4.0).
//!
//! What each tenant is served (tokens of the requests that finished, and
//! their count) is compared with the weighted max-min fair allocation of
//! the pool's capacity (water-filling: a tenant asking less than its
//! weighted share gets what it asks, the rest is split by weight), for
//! kiln, fifo and priority in the same run. Capacity is throughput at
//! saturation (a burst served first come first served).
//!
//! `cargo bench --bench fair_mixes` (`-- quick` for fewer seeds).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code may panic

use kiln::backend::cost::CostModel;
use kiln::graph::DecisionGraph;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Mode, Reason, Scheduler, MS, SEC};
use kiln::traffic::{self, import::Mapping, synth, Record};
use rand::{RngExt, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

struct Shape {
    name: &'static str,
    pool: &'static str,
    model: &'static str,
    slo: &'static str,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "70B TP2 pair (4 H100)",
        pool: r#"pool p { gpus 4 kind "H100-80GB" memory 80GB }"#,
        model: "model m { params 70B kv_per_token 320KB variant fp16 { memory 140GB gpus_per_replica 2 pools [p] } }",
        slo: "2s",
    },
    Shape {
        name: "8B on one L4",
        pool: r#"pool p { gpus 1 kind "L4" memory 24GB }"#,
        model: "model m { params 8B kv_per_token 128KB variant fp16 { memory 17GB pools [p] } }",
        slo: "3s",
    },
    Shape {
        name: "8B fleet (16 H100)",
        pool: r#"pool p { gpus 16 kind "H100-80GB" memory 80GB }"#,
        model: "model m { params 8B kv_per_token 128KB variant fp16 { memory 18GB pools [p] } }",
        slo: "1s",
    },
];

fn policy(shape: &Shape, tenants: &[(String, u32)]) -> Arc<DecisionGraph> {
    let mut text = format!(
        "{}\n{}\ntier chat {{ priority 10 slo {{ ttft {} }} }}\nclassify {{ default => tier chat }}\nroute chat m {{ default => fp16 }}\n",
        shape.pool, shape.model, shape.slo
    );
    for (name, w) in tenants {
        text.push_str(&format!(
            "tenant {name} {{ owner \"o\" tiers [chat] weight {w} }}\n"
        ));
    }
    let c = kiln::compile::compile_str("mix.kiln", &text);
    match c.graph {
        Some(g) => Arc::new(g),
        None => panic!("policy does not compile: {:?}\n{text}", c.diagnostics),
    }
}

fn sizes() -> Vec<Record> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/azure2023");
    traffic::import::azure(
        dir.join("AzureLLMInferenceTrace_conv.csv"),
        &Mapping::new("m"),
    )
    .expect("conv trace")
    .records
}

fn run(g: &Arc<DecisionGraph>, mode: Mode, records: &[Record]) -> Vec<Outcome> {
    let cost = CostModel::from_graph(g, None).expect("cost model");
    // KILN_SIZE_QUANTILE=off (or a quantile) to compare admission's
    // size-neutral reference with pricing each prompt as it is.
    let quantile = match std::env::var("KILN_SIZE_QUANTILE").ok().as_deref() {
        Some("off") => None,
        Some(q) => q.parse().ok(),
        None => Config::default().admission_size_quantile,
    };
    let cfg = Config {
        mode,
        admission_size_quantile: quantile,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), cfg);
    replay::run(&mut s, replay::arrivals(records), |_, _| {})
}

/// (requests/s, tokens/s) the pool finishes when it never runs dry.
fn capacity(shape: &Shape, sizes: &[Record]) -> (f64, f64) {
    let g = policy(shape, &[("t".into(), 1)]);
    let burst = synth::poisson(
        sizes,
        "m",
        &[synth::Load {
            tenant: "t".into(),
            rate_per_s: 1e6,
        }],
        0.004,
        1,
    );
    let o = run(&g, Mode::Fifo, &burst);
    let end = o.iter().filter_map(|o| o.finished).max().unwrap_or(1) as f64 / SEC as f64;
    let tokens: f64 = burst
        .iter()
        .map(|r| (r.prompt_tokens + r.output_tokens) as f64)
        .sum();
    (burst.len() as f64 / end, tokens / end)
}

/// Weighted max-min fair shares of 1.0 for demands (as shares of capacity).
fn water_fill(weights: &[f64], demands: &[f64]) -> Vec<f64> {
    let n = weights.len();
    let mut alloc = vec![0.0; n];
    let mut open: Vec<usize> = (0..n).collect();
    let mut left = 1.0;
    while !open.is_empty() && left > 1e-12 {
        let w: f64 = open.iter().map(|&i| weights[i]).sum();
        let sated: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| demands[i] - alloc[i] <= left * weights[i] / w)
            .collect();
        if sated.is_empty() {
            for &i in &open {
                alloc[i] += left * weights[i] / w;
            }
            break;
        }
        for &i in &sated {
            left -= demands[i] - alloc[i];
            alloc[i] = demands[i];
        }
        open.retain(|i| !sated.contains(i));
    }
    alloc
}

/// One generated mix: tenant names, weights, demands (x capacity).
struct Mix {
    tenants: Vec<(String, u32)>,
    demand: Vec<f64>,
}

fn mix(seed: u64) -> Mix {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = rng.random_range(2..=5usize);
    let tenants: Vec<(String, u32)> = (0..n)
        .map(|i| (format!("t{i}"), rng.random_range(1..=8u32)))
        .collect();
    let tenants: Vec<(String, u32)> = tenants;
    let wsum: f64 = tenants.iter().map(|(_, w)| f64::from(*w)).sum();
    // Most tenants offer 0.5x to 3x the pool's capacity (backlogged); about
    // one in four asks only 10% to 80% of its weighted share.
    let demand = tenants
        .iter()
        .map(|(_, w)| {
            if rng.random_range(0.0..1.0) < 0.25 {
                rng.random_range(0.1..0.8) * f64::from(*w) / wsum
            } else {
                rng.random_range(0.5..3.0)
            }
        })
        .collect();
    Mix { tenants, demand }
}

/// Per tenant: (tokens, requests).
type PerTenant = BTreeMap<String, (f64, f64)>;

/// Per tenant: (tokens finished, requests finished) of requests that
/// started inside `window` (seconds), and per reason the refusals.
fn served(
    recs: &[Record],
    o: &[Outcome],
    window: (f64, f64),
) -> (PerTenant, BTreeMap<&'static str, usize>) {
    let mut m: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut why = BTreeMap::new();
    let mut per: BTreeMap<(String, &'static str), usize> = BTreeMap::new();
    for (r, o) in recs.iter().zip(o) {
        if let Some((reason, _)) = o.rejected {
            *why.entry(reason.name()).or_default() += 1;
            *per.entry((r.tenant.clone().unwrap_or_default(), reason.name()))
                .or_default() += 1;
        }
        let Some(st) = o.started.map(|t| t as f64 / SEC as f64) else {
            continue;
        };
        if st < window.0 || st >= window.1 || o.finished.is_none() {
            continue;
        }
        let e = m.entry(r.tenant.clone().unwrap_or_default()).or_default();
        e.0 += (r.prompt_tokens + r.output_tokens) as f64;
        e.1 += 1.0;
    }
    if std::env::var_os("KILN_DEBUG").is_some() {
        eprintln!("  refused by tenant: {per:?}");
    }
    (m, why)
}

/// Per tenant, tokens asked by requests that arrived in `window`, and of
/// those the tokens of the ones served within the TTFT SLO (`slo_s`): what
/// a tenant got of what it asked, counted over the same requests (served
/// minutes late, as first come first served does, is not getting it).
fn asked_in(
    recs: &[Record],
    o: &[Outcome],
    window: (f64, f64),
    slo_s: f64,
) -> BTreeMap<String, (f64, f64)> {
    let mut m: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (r, o) in recs.iter().zip(o) {
        let at = r.at_ms / 1000.0;
        if at >= window.0 && at < window.1 {
            let e = m.entry(r.tenant.clone().unwrap_or_default()).or_default();
            let tokens = (r.prompt_tokens + r.output_tokens) as f64;
            e.0 += tokens;
            let in_time = o
                .first_token
                .is_some_and(|t| (t.saturating_sub(o.arrival) as f64) <= slo_s * SEC as f64);
            if o.finished.is_some() && o.rejected.is_none() && in_time {
                e.1 += tokens;
            }
        }
    }
    m
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let seeds: u64 = if quick { 4 } else { 12 };
    let sizes = sizes();
    println!("| shape | seed | weights | demand (x cap) | scheduler | worst tokens off | worst requests off | refused (reasons) |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut worst: BTreeMap<(&str, &str), (f64, f64)> = BTreeMap::new();
    let mut below: BTreeMap<(&str, &str), f64> = BTreeMap::new();
    for shape in SHAPES {
        let (cap_rps, cap_tps) = capacity(shape, &sizes);
        // 25k arrivals a run or more (see `enough`), 120 s to 3 h.
        let only: Option<u64> = std::env::var("KILN_SEED").ok().and_then(|s| s.parse().ok());
        for seed in 0..seeds {
            if only.is_some_and(|o| o != seed) {
                continue;
            }
            let mx = mix(seed);
            let total: f64 = mx.demand.iter().sum::<f64>() * cap_rps;
            // Long enough that the least backlogged tenant is served about
            // 400 requests in the window: a weight-1 tenant among 24 had
            // 53-82, and the mean size of so few requests drawn from the
            // conversation trace is itself ±9% (1 sigma), which read as
            // ±10-18% in requests from one run to the next. At most three
            // hours, or 200,000 arrivals.
            let weights: Vec<f64> = mx.tenants.iter().map(|(_, w)| f64::from(*w)).collect();
            let least = water_fill(&weights, &mx.demand)
                .iter()
                .zip(&mx.demand)
                .filter(|(f, d)| **d >= 1.25 * **f)
                .map(|(f, _)| *f)
                .fold(f64::MAX, f64::min);
            let enough = if least < f64::MAX && least > 0.0 {
                400.0 / (least * cap_rps * 0.6)
            } else {
                0.0
            };
            let duration = (25_000.0 / total)
                .max(enough.min(200_000.0 / total))
                .clamp(120.0, 10_800.0);
            let window = (duration * 0.3, duration * 0.9);
            let g = policy(shape, &mx.tenants);
            let loads: Vec<synth::Load> = mx
                .tenants
                .iter()
                .zip(&mx.demand)
                .map(|((t, _), d)| synth::Load {
                    tenant: t.clone(),
                    rate_per_s: d * cap_rps,
                })
                .collect();
            let recs = synth::poisson(&sizes, "m", &loads, duration, seed + 100);
            let fair_of = |served_cap: f64| {
                let d: Vec<f64> = mx.demand.iter().map(|d| d / served_cap.max(1e-9)).collect();
                water_fill(&weights, &d)
                    .into_iter()
                    .map(|x| x * served_cap)
                    .collect::<Vec<f64>>()
            };
            for mode in [Mode::Kiln, Mode::Fifo, Mode::Priority] {
                let o = run(&g, mode, &recs);
                let (s, why) = served(&recs, &o, window);
                let slo_s: f64 = shape.slo.trim_end_matches('s').parse().unwrap_or(1.0);
                let asked = asked_in(&recs, &o, window, slo_s);
                let tot_t: f64 = s.values().map(|x| x.0).sum();
                let tot_r: f64 = s.values().map(|x| x.1).sum();
                // The fair allocation of the capacity actually served (the
                // burst's capacity is only an estimate), at least 1x.
                let fair = fair_of((tot_t / (cap_tps * (window.1 - window.0))).max(1.0));
                let fsum: f64 = fair.iter().sum();
                let (mut wt, mut wr) = (0.0f64, 0.0f64);
                let mut detail = String::new();
                let wsum: f64 = weights.iter().sum();
                for (i, (t, _)) in mx.tenants.iter().enumerate() {
                    let (tk, rq) = s.get(t).copied().unwrap_or_default();
                    // Below-share tenants (asking at most 80% of their
                    // weight's part): what they get of what they ask.
                    if mx.demand[i] <= 0.8 * weights[i] / wsum {
                        let (asked, got) = asked.get(t).copied().unwrap_or((0.0, 0.0));
                        let e = below
                            .entry((shape.name, mode_name(mode)))
                            .or_insert(f64::MAX);
                        *e = e.min(got / asked.max(1.0));
                        if std::env::var_os("KILN_DEBUG").is_some() {
                            eprintln!(
                                "{} {seed} {}: below-share {t} got {:.1}% of what it asked",
                                shape.name,
                                mode_name(mode),
                                100.0 * got / asked.max(1.0)
                            );
                            if mode == Mode::Kiln {
                                below_detail(&recs, &o, t, window, slo_s);
                            }
                        }
                    }
                    // Only clearly backlogged tenants are held to their
                    // weighted share (a tenant asking about its share has
                    // no fluid allocation a Poisson arrival can keep to).
                    if mx.demand[i] < 1.25 * fair[i] {
                        continue;
                    }
                    let (a_tok, a_n) = recs
                        .iter()
                        .filter(|r| r.tenant.as_deref() == Some(t.as_str()))
                        .filter(|r| r.at_ms / 1000.0 >= window.0 && r.at_ms / 1000.0 < window.1)
                        .fold((0.0, 0.0), |(a, n), r| {
                            (a + (r.prompt_tokens + r.output_tokens) as f64, n + 1.0)
                        });
                    detail.push_str(&format!(
                        " {t}: {:.2}/{:.2} ({:.0} tok/req, {rq} req; asked {:.0} tok/req)",
                        tk / (cap_tps * (window.1 - window.0)),
                        fair[i],
                        tk / rq.max(1.0),
                        a_tok / f64::max(a_n, 1.0)
                    ));
                    let share = fair[i] / fsum;
                    let off_t = tk / tot_t.max(1.0) / share - 1.0;
                    let off_r = rq / tot_r.max(1.0) / share - 1.0;
                    if off_t.abs() > wt.abs() {
                        wt = off_t;
                    }
                    if off_r.abs() > wr.abs() {
                        wr = off_r;
                    }
                }
                let name = format!("{mode:?}").to_lowercase();
                let e = worst.entry((shape.name, mode_name(mode))).or_default();
                e.0 = e.0.max(wt.abs());
                e.1 = e.1.max(wr.abs());
                let ws: Vec<String> = mx.tenants.iter().map(|(_, w)| w.to_string()).collect();
                let ds: Vec<String> = mx.demand.iter().map(|d| format!("{d:.2}")).collect();
                let refused: usize = why.values().sum();
                if std::env::var_os("KILN_DEBUG").is_some() {
                    eprintln!("{} {seed} {name}: served/fair (x cap){detail}", shape.name);
                }
                println!(
                    "| {} | {seed} | {} | {} | {name} | {:+.1}% | {:+.1}% | {refused} {why:?} |",
                    shape.name,
                    ws.join(":"),
                    ds.join(" "),
                    wt * 100.0,
                    wr * 100.0
                );
            }
        }
    }
    println!("\n### Worst deviation from the weighted fair allocation, over {seeds} generated mixes per shape\n");
    println!("| shape | scheduler | tokens | requests |");
    println!("|---|---|---|---|");
    for ((shape, mode), (t, r)) in worst {
        println!(
            "| {shape} | {mode} | ±{:.1}% | ±{:.1}% |",
            t * 100.0,
            r * 100.0
        );
    }
    println!("\n### Tenants asking at most 80% of their weighted share: the least any got of what it asked (tokens of requests that arrived, served within the TTFT SLO)\n");
    println!("| shape | scheduler | least served / asked |");
    println!("|---|---|---|");
    for ((shape, mode), x) in below {
        println!("| {shape} | {mode} | {:.1}% |", x * 100.0);
    }
    let _ = (MS, Reason::Overload);
}

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Kiln => "kiln",
        Mode::Fifo => "fifo",
        Mode::Priority => "priority",
        Mode::Static => "static",
    }
}

/// Where a below-share tenant's misses come from: refused (by reason) or
/// late, and for the late ones the wait to start and start to first token.
fn below_detail(recs: &[Record], o: &[Outcome], t: &str, window: (f64, f64), slo_s: f64) {
    let (mut n, mut late) = (0, 0);
    let mut why: BTreeMap<&str, usize> = BTreeMap::new();
    let mut waits = Vec::new();
    let mut prefills = Vec::new();
    let mut waited: BTreeMap<&str, usize> = BTreeMap::new();
    for (r, o) in recs.iter().zip(o) {
        let at = r.at_ms / 1000.0;
        if r.tenant.as_deref() != Some(t) || at < window.0 || at >= window.1 {
            continue;
        }
        n += 1;
        if let Some((reason, _)) = o.rejected {
            *why.entry(reason.name()).or_default() += 1;
            continue;
        }
        let (Some(st), Some(ft)) = (o.started, o.first_token) else {
            continue;
        };
        if (ft.saturating_sub(o.arrival) as f64) > slo_s * SEC as f64 {
            late += 1;
            waits.push((st - o.arrival) as f64 / SEC as f64);
            prefills.push(((ft - st) as f64 / SEC as f64, r.prompt_tokens));
            if let Some(w) = o.waited_for {
                *waited.entry(w.name()).or_default() += 1;
            }
        }
    }
    waits.sort_by(f64::total_cmp);
    eprintln!(
        "    {t}: {n} arrived, refused {why:?}, late {late} (waited for {waited:?}); waits {:?}; start->first token (s, prompt) {:?}",
        waits.iter().step_by((waits.len() / 8).max(1)).map(|w| (w * 100.0).round() / 100.0).collect::<Vec<_>>(),
        prefills.iter().take(12).map(|(a, p)| ((a * 100.0).round() / 100.0, *p)).collect::<Vec<_>>()
    );
}
