//! Fairness and admission under overload, measured in what each tenant is
//! *served*. One tier (TTFT SLO 2 s) on one simulated H100 running
//! Llama-8B; request sizes drawn from the Azure 2023 conversation trace
//! (../shared/traces), Poisson arrivals per tenant at rates set against the
//! pool's measured capacity (throughput at saturation). Prints markdown
//! tables for BENCHMARKS.md: kiln beside fifo and an RPM-limit baseline
//! (each tenant limited to its fair share of requests per minute, then
//! first come first served: a rate limiter in front of vLLM).
//!
//! `cargo bench --bench fairness` (add `-- quick` for a shorter run).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::CostModel;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Mode, Scheduler, MS, SEC};
use kiln::traffic::{self, import::Mapping, synth, Record};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

const SLO_MS: f64 = 2000.0;

fn policy(tenants: &[(&str, f64)]) -> Arc<kiln::graph::DecisionGraph> {
    let mut text = String::from(
        r#"pool h100 { gpus 1 kind "H100-80GB" memory 80GB }
model llama-8b {
  params 8B
  kv_per_token 128KB
  variant fp16 { memory 18GB pools [h100] }
}
tier chat { priority 10 slo { ttft 2s } }
classify { default => tier chat }
route chat llama-8b { default => fp16 }
"#,
    );
    for (name, w) in tenants {
        text.push_str(&format!(
            "tenant {name} {{ owner \"o\" tiers [chat] weight {w} }}\n"
        ));
    }
    let c = kiln::compile::compile_str("fair.kiln", &text);
    Arc::new(c.graph.expect("policy compiles"))
}

fn sizes() -> Vec<Record> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/azure2023");
    let map = Mapping::new("llama-8b");
    traffic::import::azure(dir.join("AzureLLMInferenceTrace_conv.csv"), &map)
        .expect("conv trace")
        .records
}

fn run(g: &Arc<kiln::graph::DecisionGraph>, mode: Mode, records: &[Record]) -> Vec<Outcome> {
    let cost = CostModel::from_graph(g, None).expect("cost model");
    let cfg = Config {
        mode,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), replay::plan(g, &cost), cfg);
    replay::run(&mut s, replay::arrivals(records), |_, _| {})
}

/// Requests per second the pool finishes when it never runs dry: a burst
/// of requests all queued at time 0, served first come first served.
fn capacity(sizes: &[Record]) -> f64 {
    let g = policy(&[("t", 1.0)]);
    let burst: Vec<Record> = synth::poisson(
        sizes,
        "llama-8b",
        &[synth::Load {
            tenant: "t".into(),
            rate_per_s: 1e6,
        }],
        0.003,
        1,
    );
    let n = burst.len();
    let o = run(&g, Mode::Fifo, &burst);
    let end = o.iter().filter_map(|o| o.finished).max().unwrap_or(1) as f64 / SEC as f64;
    n as f64 / end
}

/// The RPM-limit baseline: each tenant's requests beyond `rpm` in any
/// minute (a token bucket of one minute's worth) are refused up front.
fn rpm_limited(records: &[Record], rpm: &HashMap<String, f64>) -> (Vec<Record>, Vec<usize>) {
    let mut bucket: HashMap<String, (f64, f64)> = HashMap::new();
    let mut out = Vec::new();
    let mut kept = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let t = r.tenant.clone().unwrap_or_default();
        let cap = rpm.get(&t).copied().unwrap_or(f64::INFINITY);
        let (level, at) = bucket.entry(t).or_insert((cap, 0.0));
        *level = (*level + (r.at_ms - *at) / 60_000.0 * cap).min(cap);
        *at = r.at_ms;
        if *level >= 1.0 {
            *level -= 1.0;
            out.push(r.clone());
            kept.push(i);
        }
    }
    (out, kept)
}

struct TenantStat {
    asked: f64,
    served: f64,
    ttft_p95_ms: f64,
    admitted: usize,
    admitted_met: usize,
    requests: usize,
}

/// Per tenant: tokens asked (prompt + output of requests that arrived in
/// the measured window) and served (of requests that started in it), TTFT
/// p95 of finished ones that arrived in it, and SLO attainment among them.
fn stats(
    records: &[Record],
    outcomes: &[Outcome],
    window: (f64, f64),
    refused_before: &[bool],
) -> HashMap<String, TenantStat> {
    let mut m: HashMap<String, (TenantStat, Vec<f64>)> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        if r.at_ms < window.0 || r.at_ms >= window.1 {
            continue;
        }
        let t = r.tenant.clone().unwrap_or_default();
        let e = m.entry(t).or_insert_with(|| {
            (
                TenantStat {
                    asked: 0.0,
                    served: 0.0,
                    ttft_p95_ms: 0.0,
                    admitted: 0,
                    admitted_met: 0,
                    requests: 0,
                },
                Vec::new(),
            )
        });
        let tokens = (r.prompt_tokens + r.output_tokens) as f64;
        e.0.asked += tokens;
        e.0.requests += 1;
        if refused_before.get(i).copied().unwrap_or(false) {
            continue;
        }
        let Some(o) = outcomes.get(i) else { continue };
        if o.rejected.is_none() {
            e.0.admitted += 1;
        }
        if let (Some(ft), Some(_)) = (o.first_token, o.finished) {
            let ttft = (ft - o.arrival) as f64 / MS as f64;
            e.1.push(ttft);
            if ttft <= SLO_MS {
                e.0.admitted_met += 1;
            }
        }
    }
    // Served: what started inside the window, whenever it arrived.
    for (i, r) in records.iter().enumerate() {
        let Some(o) = outcomes.get(i) else { continue };
        let inside = o.started.is_some_and(|t| {
            (t as f64 / MS as f64) >= window.0 && (t as f64 / MS as f64) < window.1
        });
        if inside && o.finished.is_some() && !refused_before.get(i).copied().unwrap_or(false) {
            if let Some(e) = r.tenant.as_ref().and_then(|t| m.get_mut(t)) {
                e.0.served += (r.prompt_tokens + r.output_tokens) as f64;
            }
        }
    }
    m.into_iter()
        .map(|(k, (mut s, mut v))| {
            v.sort_by(f64::total_cmp);
            s.ttft_p95_ms = v
                .get(((v.len() as f64 * 0.95).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(0.0);
            (k, s)
        })
        .collect()
}

/// Runs `records` under kiln, fifo and the RPM-limit baseline; returns
/// per scheduler its tenant stats.
fn three_ways(
    g: &Arc<kiln::graph::DecisionGraph>,
    records: &[Record],
    rpm: &HashMap<String, f64>,
    window: (f64, f64),
) -> Vec<(&'static str, HashMap<String, TenantStat>)> {
    let none = vec![false; records.len()];
    let k = run(g, Mode::Kiln, records);
    if std::env::var_os("KILN_DEBUG").is_some() {
        debug_admitted(&k);
        let mut by: std::collections::BTreeMap<(String, String), usize> = Default::default();
        for (r, o) in records.iter().zip(&k) {
            if let Some((why, _)) = o.rejected {
                *by.entry((r.tenant.clone().unwrap_or_default(), why.name().to_string()))
                    .or_default() += 1;
            }
        }
        eprintln!("refused: {by:?}");
    }
    let f = run(g, Mode::Fifo, records);
    // The RPM baseline: refused up front, the rest first come first served.
    let (kept, idx) = rpm_limited(records, rpm);
    let mut refused = vec![true; records.len()];
    let mut o_full = vec![Outcome::default(); records.len()];
    for (o, &i) in run(g, Mode::Fifo, &kept).into_iter().zip(&idx) {
        refused[i] = false;
        o_full[i] = o;
    }
    vec![
        ("kiln", stats(records, &k, window, &none)),
        ("fifo", stats(records, &f, window, &none)),
        ("rpm-limit", stats(records, &o_full, window, &refused)),
    ]
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let duration = if quick { 120.0 } else { 600.0 };
    let window = (duration * 1000.0 * 0.25, duration * 1000.0 * 0.75);
    let sizes = sizes();
    let cap = capacity(&sizes);
    println!("capacity (fifo, saturated): {cap:.2} req/s; {duration} s per run, measured over the middle half\n");

    // 1. Weights 1:1:2:4, all backlogged at 2x capacity: each tenant
    //    offers twice its fair share; then equal demand (0.5x each), where
    //    the weight-4 tenant asks exactly its share and the others more.
    let ws = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 4.0)];
    let g = policy(&ws);
    let total_w: f64 = ws.iter().map(|(_, w)| w).sum();
    let rpm: HashMap<String, f64> = ws
        .iter()
        .map(|(t, w)| (t.to_string(), cap * 60.0 * w / total_w))
        .collect();
    let twice: Vec<synth::Load> = ws
        .iter()
        .map(|(t, w)| synth::Load {
            tenant: t.to_string(),
            rate_per_s: 2.0 * cap * w / total_w,
        })
        .collect();
    let loads: Vec<synth::Load> = ws
        .iter()
        .map(|(t, _)| synth::Load {
            tenant: t.to_string(),
            rate_per_s: 2.0 * cap / ws.len() as f64,
        })
        .collect();
    for (title, l) in [
        (
            "each tenant offered twice its fair share (2x capacity in all)",
            &twice,
        ),
        ("each tenant offered 0.5x capacity (2x in all)", &loads),
    ] {
        let recs = synth::poisson(&sizes, "llama-8b", l, duration, 11);
        println!("### Weights 1:1:2:4, {title}\n");
        println!("| scheduler | tenant | weight | fair share | served share | off by |");
        println!("|---|---|---|---|---|---|");
        for (name, st) in three_ways(&g, &recs, &rpm, window) {
            let total: f64 = ws
                .iter()
                .map(|(t, _)| st.get(*t).map_or(0.0, |s| s.served))
                .sum();
            for (t, w) in ws {
                let served = st.get(t).map_or(0.0, |s| s.served) / total.max(1.0);
                let share = w / total_w;
                println!(
                    "| {name} | {t} | {w} | {:.1}% | {:.1}% | {:+.1}% |",
                    share * 100.0,
                    served * 100.0,
                    (served / share - 1.0) * 100.0
                );
            }
        }
        println!();
    }

    // 2. A fifth tenant asking 20% of its share.
    let ws5 = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 4.0), ("e", 1.0)];
    let g5 = policy(&ws5);
    let total5: f64 = ws5.iter().map(|(_, w)| w).sum();
    let mut loads5 = loads.clone();
    loads5.push(synth::Load {
        tenant: "e".into(),
        rate_per_s: 0.2 * cap / total5,
    });
    let recs5 = synth::poisson(&sizes, "llama-8b", &loads5, duration, 11);
    let rpm5: HashMap<String, f64> = ws5
        .iter()
        .map(|(t, w)| (t.to_string(), cap * 60.0 * w / total5))
        .collect();
    println!("\n### A fifth tenant asking 20% of its fair share, beside the four above\n");
    println!(
        "| scheduler | e: tokens served / asked | e: TTFT p95 | e: admitted that met the SLO |"
    );
    println!("|---|---|---|---|");
    for (name, st) in three_ways(&g5, &recs5, &rpm5, window) {
        let e = &st["e"];
        println!(
            "| {name} | {:.1}% | {:.0} ms | {:.1}% |",
            100.0 * e.served / e.asked.max(1.0),
            e.ttft_p95_ms,
            100.0 * e.admitted_met as f64 / e.admitted.max(1) as f64
        );
    }

    // 3. A flooder at 10x its share beside three polite tenants.
    let wf = [("p1", 1.0), ("p2", 1.0), ("p3", 1.0), ("flood", 1.0)];
    let gf = policy(&wf);
    let polite: Vec<synth::Load> = ["p1", "p2", "p3"]
        .iter()
        .map(|t| synth::Load {
            tenant: t.to_string(),
            rate_per_s: 0.2 * cap,
        })
        .collect();
    let mut flooded = polite.clone();
    flooded.push(synth::Load {
        tenant: "flood".into(),
        rate_per_s: 10.0 * cap / 4.0,
    });
    let calm = synth::poisson(&sizes, "llama-8b", &polite, duration, 5);
    let storm = synth::poisson(&sizes, "llama-8b", &flooded, duration, 5);
    let rpmf: HashMap<String, f64> = wf
        .iter()
        .map(|(t, _)| (t.to_string(), cap * 60.0 / 4.0))
        .collect();
    println!("\n### A flooder at 10x its share: the polite tenants' TTFT p95\n");
    println!("| scheduler | polite TTFT p95, flooder absent | with the flooder | ratio | polite served / asked | flooder served / asked |");
    println!("|---|---|---|---|---|---|");
    if std::env::var_os("KILN_DEBUG").is_some() {
        let o = run(&gf, Mode::Kiln, &storm);
        let polite: Vec<Outcome> = storm
            .iter()
            .zip(&o)
            .filter(|(r, _)| r.tenant.as_deref() != Some("flood"))
            .map(|(_, o)| o.clone())
            .collect();
        eprint!("polite under the flood: ");
        debug_admitted(&polite);
    }
    let a = three_ways(&gf, &calm, &rpmf, window);
    let b = three_ways(&gf, &storm, &rpmf, window);
    for ((name, sa), (_, sb)) in a.iter().zip(b.iter()) {
        let p95 = |st: &HashMap<String, TenantStat>| {
            ["p1", "p2", "p3"]
                .iter()
                .map(|t| st.get(*t).map_or(0.0, |s| s.ttft_p95_ms))
                .fold(0.0, f64::max)
        };
        let ratio = |st: &HashMap<String, TenantStat>, ts: &[&str]| {
            let (s, a) = ts.iter().fold((0.0, 0.0), |(s, a), t| {
                st.get(*t).map_or((s, a), |x| (s + x.served, a + x.asked))
            });
            100.0 * s / a.max(1.0)
        };
        println!(
            "| {name} | {:.0} ms | {:.0} ms | {:.2}x | {:.1}% | {:.1}% |",
            p95(sa),
            p95(sb),
            p95(sb) / p95(sa).max(1.0),
            ratio(sb, &["p1", "p2", "p3"]),
            ratio(sb, &["flood"])
        );
    }

    // 4. Admission at 1.5x capacity: do admitted requests meet the SLO?
    println!("\n### Admission at 1.5x capacity (four equal tenants): TTFT SLO 2 s\n");
    println!("| scheduler | admitted | admitted that met the SLO | all requests that met it |");
    println!("|---|---|---|---|");
    let we = [("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)];
    let ge = policy(&we);
    let le: Vec<synth::Load> = we
        .iter()
        .map(|(t, _)| synth::Load {
            tenant: t.to_string(),
            rate_per_s: 1.5 * cap / 4.0,
        })
        .collect();
    let re = synth::poisson(&sizes, "llama-8b", &le, duration, 3);
    let rpme: HashMap<String, f64> = we
        .iter()
        .map(|(t, _)| (t.to_string(), cap * 60.0 / 4.0))
        .collect();
    for (name, st) in three_ways(&ge, &re, &rpme, window) {
        let (adm, met, all) = st.values().fold((0, 0, 0), |(a, m, n), s| {
            (a + s.admitted, m + s.admitted_met, n + s.requests)
        });
        println!(
            "| {name} | {:.1}% | {:.1}% | {:.1}% |",
            100.0 * adm as f64 / all.max(1) as f64,
            100.0 * met as f64 / adm.max(1) as f64,
            100.0 * met as f64 / all.max(1) as f64
        );
    }
}

#[allow(dead_code)]
pub fn debug_admitted(outcomes: &[Outcome]) {
    let mut q = Vec::new();
    let mut p = Vec::new();
    for o in outcomes.iter().filter(|o| o.rejected.is_none()) {
        if let (Some(s), Some(f)) = (o.started, o.first_token) {
            q.push((s - o.arrival) as f64 / 1000.0);
            p.push((f - s) as f64 / 1000.0);
        }
    }
    q.sort_by(f64::total_cmp);
    p.sort_by(f64::total_cmp);
    let at = |v: &Vec<f64>, x: f64| v.get((v.len() as f64 * x) as usize).copied().unwrap_or(0.0);
    eprintln!(
        "queue wait p50 {:.0} p90 {:.0} p99 {:.0} | start->first token p50 {:.0} p90 {:.0} p99 {:.0}",
        at(&q, 0.5), at(&q, 0.9), at(&q, 0.99), at(&p, 0.5), at(&p, 0.9), at(&p, 0.99)
    );
}
