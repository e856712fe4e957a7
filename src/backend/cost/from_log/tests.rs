//! The fit recovers a known cost model from logs the replay itself wrote:
//! the scheduler runs synthetic traffic on replicas whose roofline has
//! known factors, its outcomes become decision-log lines, and
//! `calibrate_from_log` must find those factors again from a cost model
//! that starts elsewhere.

use super::*;
use crate::traffic::Decision;
use rand::{RngExt as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

const POLICY: &str = r#"
pool gpu {
  gpus 2
  kind "H100-SXM"
  memory 80GB
}

model m8 {
  params 8B
  kv_per_token 128KB
  variant bf16 {
    precision bf16
    memory 16GB
    pools [gpu]
    max_batch 16
    max_batch_tokens 2048
  }
}

tier chat {
  priority 100
  slo { p95 10m }
}

tenant t {
  owner "t@example.com"
  tiers [chat]
  quota { requests 1000000/min concurrent 100000 }
  api_keys ["k"]
}

classify {
  default => tier chat
}

route [chat] m8 {
  default => bf16 on gpu
}

admit [chat] {
  default => accept
}
"#;

/// What the "engine" really does.
const TRUTH: &str = "[model.m8.variant.bf16]\nmbu = 0.55\nmfu = 0.3\nstep_overhead_ms = 4.0\n";

fn graph() -> DecisionGraph {
    let c = crate::compile::compile_str("fit.kiln", POLICY);
    match c.graph {
        Some(g) => g,
        None => panic!("test policy does not compile: {:?}", c.diagnostics),
    }
}

/// Poisson arrivals at `rate` a second, prompts of 100–2000 tokens,
/// answers of 8–200.
fn traffic(rate: f64, n: usize, seed: u64) -> Vec<Record> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let u: f64 = rng.random_range(1e-9..1.0);
            t += -u.ln() / rate * 1e3;
            let out = rng.random_range(8..200);
            Record {
                at_ms: (t * 1000.0).round() / 1000.0,
                tenant: Some("t".into()),
                model: "m8".into(),
                prompt_tokens: rng.random_range(100..2000),
                max_tokens: out,
                output_tokens: out,
                ..Record::default()
            }
        })
        .collect()
}

/// Replays `records` on the truth and writes what a gateway would log.
fn logged(g: &DecisionGraph, records: &[Record]) -> Vec<Record> {
    logged_naming(g, records, true)
}

/// [`logged`], with or without the replica each line ran on (a log
/// written before the field existed has none).
fn logged_naming(g: &DecisionGraph, records: &[Record], replicas: bool) -> Vec<Record> {
    logged_on(TRUTH, g, records, replicas)
}

/// [`logged_naming`] on another truth.
fn logged_on(truth: &str, g: &DecisionGraph, records: &[Record], replicas: bool) -> Vec<Record> {
    let truth = Calibration::from_toml_str(truth).unwrap();
    let cost = CostModel::from_graph(g, Some(&truth)).unwrap();
    let plan = crate::replay::plan(g, &cost);
    let mut sched =
        crate::sched::Scheduler::new(Arc::new(g.clone()), plan, crate::sched::Config::default());
    let outcomes = crate::replay::run(&mut sched, crate::replay::arrivals(records), |_, _| {});
    outcomes
        .iter()
        .filter_map(|o| {
            let r = records.get(o.id as usize)?;
            let ms = |t: u64| (t as f64 - o.arrival as f64) / 1e3;
            let (s, f, e) = (o.started?, o.first_token?, o.finished?);
            Some(Record {
                queue_ms: Some(ms(s)),
                ttft_ms: Some(ms(f)),
                e2e_ms: Some(ms(e)),
                decision: Some(Decision {
                    tier: Some("chat".into()),
                    route: Some("m8.bf16 on gpu".into()),
                    admission: Some("accept".into()),
                    status: Some(200),
                    replica: o
                        .replica
                        .filter(|_| replicas)
                        .and_then(|x| u32::try_from(x).ok()),
                    ..Decision::default()
                }),
                ..r.clone()
            })
        })
        .collect()
}

fn fitted(rate: f64) -> (DecisionGraph, FromLog) {
    let g = graph();
    let log = logged(&g, &traffic(rate, 600, 7));
    assert!(log.len() > 500, "{} lines", log.len());
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fit = calibrate_from_log(&g, &cost, None, &log, 0).unwrap();
    (g, fit)
}

#[test]
fn recovers_the_factors_the_replay_ran_with() {
    let (g, fit) = fitted(14.0);
    let f = &fit.report.groups[0];
    assert_eq!((f.model.as_str(), f.variant.as_str()), ("m8", "bf16"));
    assert_eq!(f.replicas, 2);
    // 600 clean lines: the free fit is the best on the held-back ones.
    assert_eq!(f.prior_weight, Some(0.0), "{}", render(&fit.report));
    let within = |got: f64, want: f64, tol: f64| (got / want - 1.0).abs() <= tol;
    assert!(
        within(f.mbu, 0.55, 0.10),
        "mbu {} (want 0.55)\n{}",
        f.mbu,
        render(&fit.report)
    );
    assert!(
        within(f.mfu, 0.30, 0.15),
        "mfu {} (want 0.30)\n{}",
        f.mfu,
        render(&fit.report)
    );
    // The truth has no per-sequence cost; a fit may move part of the step
    // overhead into it (at one batch size the two are one figure), so the
    // overhead a step of the log's mean batch pays is what must match.
    let overhead = f.step_overhead_ms + f.seq_overhead_ms.unwrap_or(0.0) * f.mean_batch;
    assert!(
        within(overhead, 4.0, 0.25),
        "overhead {} ms at batch {:.1} (want 4)\n{}",
        overhead,
        f.mean_batch,
        render(&fit.report)
    );
    // The built-in factors are far off; the fitted ones are close.
    assert!(f.before.ttft.median > 0.2, "{:?}", f.before);
    assert!(f.after.ttft.median < 0.10, "{:?}", f.after);
    assert!(f.after.itl.median < 0.10, "{:?}", f.after);
    assert!(f.after.e2e.median < 0.10, "{:?}", f.after);
    // The file loads, and a cost model built from it runs at the fit.
    let text = fit.calibration.to_toml();
    let cal = Calibration::from_toml_str(&text).unwrap();
    let cost = CostModel::from_graph(&g, Some(&cal)).unwrap();
    let r = Rates::of(cost.replica(0, 0, 0).unwrap());
    assert!(
        within(r.bandwidth, f.rates.bandwidth, 1e-3),
        "{r:?} {:?}",
        f.rates
    );
}

#[test]
fn a_fit_worse_than_the_figures_before_on_held_back_lines_is_not_written() {
    // The engine runs exactly at the figures the cost model already has,
    // but the lines the fit sees (two of every three, in start order) were
    // slowed threefold on the replica, as a noisy neighbour would: the free
    // fit is three times too slow, the held-back lines say so, and the
    // figures before are kept.
    let g = graph();
    let truth = Calibration::from_toml_str(TRUTH).unwrap();
    let mut log = logged(&g, &traffic(2.0, 45, 5));
    let start = |r: &Record| r.at_ms + r.queue_ms.unwrap_or(0.0);
    log.sort_by(|a, b| start(a).total_cmp(&start(b)));
    for (i, r) in log.iter_mut().enumerate() {
        if i % 3 != 2 {
            let q = r.queue_ms.unwrap_or(0.0);
            r.ttft_ms = r.ttft_ms.map(|t| q + 3.0 * (t - q));
            r.e2e_ms = r.e2e_ms.map(|e| q + 3.0 * (e - q));
        }
    }
    let cost = CostModel::from_graph(&g, Some(&truth)).unwrap();
    let fit = calibrate_from_log(&g, &cost, Some(&truth), &log, 0).unwrap();
    let f = &fit.report.groups[0];
    assert_eq!(f.prior_weight, None, "{}", render(&fit.report));
    assert!(f.after.ttft.median <= f.before.ttft.median + 1e-9, "{f:?}");
    let within = |got: f64, want: f64| (got / want - 1.0).abs() <= 1e-3;
    assert!(within(f.mbu, 0.55) && within(f.mfu, 0.3), "{f:?}");
    assert!(within(f.step_overhead_ms, 4.0), "{f:?}");
    assert!(render(&fit.report).contains("kept: the figures before"));
    // Unslowed, the same lines are fitted freely.
    let clean = logged(&g, &traffic(2.0, 45, 5));
    let fit = calibrate_from_log(&g, &cost, Some(&truth), &clean, 0).unwrap();
    assert_ne!(fit.report.groups[0].prior_weight, None);
}

#[test]
fn a_minority_of_slowed_lines_does_not_slow_the_fit() {
    // A noisy neighbour slows three lines in ten, 2.5 to 4 times on the
    // replica (noise only ever slows a step). The fit must still find the
    // engine the other seven in ten ran on: the typical line, not a model
    // slow enough to meet the slowed ones halfway (the squared error did
    // that: 1.3-1.6x too slow on the clean lines).
    let g = graph();
    let mut log = logged(&g, &traffic(14.0, 600, 7));
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (i, r) in log.iter_mut().enumerate() {
        if i % 10 < 3 {
            let k = rng.random_range(2.5..4.0);
            let q = r.queue_ms.unwrap_or(0.0);
            r.ttft_ms = r.ttft_ms.map(|t| q + k * (t - q));
            r.e2e_ms = r.e2e_ms.map(|e| q + k * (e - q));
        }
    }
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fit = calibrate_from_log(&g, &cost, None, &log, 0).unwrap();
    let f = &fit.report.groups[0];
    // Against the truth on clean lines: the fitted rates replay them.
    let truth = Calibration::from_toml_str(TRUTH).unwrap();
    let t = Rates::of(
        CostModel::from_graph(&g, Some(&truth))
            .unwrap()
            .replica(0, 0, 0)
            .unwrap(),
    );
    let shape = Shape::of(cost.replica(0, 0, 0).unwrap());
    let clean = logged(&g, &traffic(14.0, 600, 7));
    let replicas = f.replicas;
    let mut lines: Vec<Line> = clean
        .iter()
        .filter_map(|r| line_of(r, &mut Skipped::default()))
        .collect();
    lines.sort_by(|a, b| a.start.total_cmp(&b.start));
    let obs = observations(&lines, replicas);
    let slow = |r: &Rates| {
        let mut x: Vec<f64> = obs
            .iter()
            .map(|o| r.ttft(&shape, o) / t.ttft(&shape, o))
            .collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let s = slow(&f.rates);
    assert!(
        (0.85..=1.15).contains(&s),
        "the fit's TTFT is {s:.2}x the engine's on a typical line\n{}",
        render(&fit.report)
    );
}

#[test]
fn the_report_shows_the_error_before_and_after() {
    let (_, fit) = fitted(14.0);
    insta::assert_snapshot!(render(&fit.report));
}

#[test]
fn a_faster_device_than_its_figures_gets_a_time_factor() {
    let g = graph();
    let log = logged(&g, &traffic(14.0, 300, 3));
    // Halve every logged time: the device is faster than an H100 at 100%.
    let fast: Vec<Record> = log
        .into_iter()
        .map(|mut r| {
            r.at_ms /= 4.0;
            r.queue_ms = r.queue_ms.map(|v| v / 4.0);
            r.ttft_ms = r.ttft_ms.map(|v| v / 4.0);
            r.e2e_ms = r.e2e_ms.map(|v| v / 4.0);
            r
        })
        .collect();
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fit = calibrate_from_log(&g, &cost, None, &fast, 0).unwrap();
    let f = &fit.report.groups[0];
    assert!(f.time_factor < 1.0, "{f:?}");
    assert!(f.mbu <= 1.0 && f.mfu <= 1.0);
    let cal = Calibration::from_toml_str(&fit.calibration.to_toml()).unwrap();
    let cost = CostModel::from_graph(&g, Some(&cal)).unwrap();
    let r = Rates::of(cost.replica(0, 0, 0).unwrap());
    assert!(
        (r.bandwidth / f.rates.bandwidth - 1.0).abs() < 1e-3,
        "{r:?} {:?}",
        f.rates
    );
}

#[test]
fn hostile_lines_are_skipped_and_counted() {
    let g = graph();
    let mut log = logged(&g, &traffic(8.0, 60, 11));
    let good = log.len();
    let base = log[0].clone();
    let with = |f: &dyn Fn(&mut Record)| {
        let mut r = base.clone();
        f(&mut r);
        r
    };
    log.push(with(&|r| r.ttft_ms = Some(-5.0)));
    log.push(with(&|r| r.e2e_ms = Some(1.0)));
    log.push(with(&|r| r.queue_ms = Some(1e12)));
    log.push(with(&|r| r.e2e_ms = None));
    log.push(with(&|r| r.output_tokens = 0));
    log.push(with(&|r| {
        if let Some(d) = r.decision.as_mut() {
            d.route = Some("nope".into());
        }
    }));
    log.push(with(&|r| {
        if let Some(d) = r.decision.as_mut() {
            d.route = Some("m8.fp4 on gpu".into());
        }
    }));
    log.push(with(&|r| r.decision = None));
    log.push(with(&|r| {
        if let Some(d) = r.decision.as_mut() {
            d.status = Some(429);
            d.reason = Some("quota".into());
        }
    }));
    log.push(with(&|r| {
        if let Some(d) = r.decision.as_mut() {
            d.cache = Some("hit".into());
        }
    }));
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fit = calibrate_from_log(&g, &cost, None, &log, 4).unwrap();
    let k = &fit.report.skipped;
    assert_eq!(
        (
            k.malformed,
            k.bad_timing,
            k.no_timing,
            k.unknown_route,
            k.not_served
        ),
        (4, 3, 2, 3, 2),
        "{k:?}"
    );
    assert_eq!(fit.report.groups[0].lines, good);

    // Nothing usable: an error that says what a log needs.
    let err = calibrate_from_log(&g, &cost, None, &log[good..], 0).unwrap_err();
    assert_eq!(
        err,
        FromLogError::TooFewLines {
            lines: 0,
            malformed: 0
        }
    );
}

/// A served line of `prompt` and `output` tokens on `replica`, seconds.
fn line(start: f64, first: f64, end: f64, replica: Option<u32>) -> Line {
    Line {
        queue: 0.0,
        start,
        first,
        end,
        prompt: 100.0,
        output: 11.0,
        replica,
    }
}

#[test]
fn a_line_that_names_its_replica_is_batched_with_its_replica_only() {
    // Two replicas: b runs alone on replica 1 while a runs on replica 0;
    // c starts on replica 0 beside a.
    let named = [
        line(0.0, 1.0, 10.0, Some(0)),
        line(2.0, 3.0, 6.0, Some(1)),
        line(4.0, 5.0, 8.0, Some(0)),
    ];
    let obs = observations(&named, 2);
    let b0: Vec<f64> = obs.iter().map(|o| o.b0).collect();
    assert_eq!(b0, [0.0, 0.0, 1.0]);
    // c decodes beside a all the way: a batch of two.
    assert!((obs[2].bbar - 2.0).abs() < 1e-9, "{:?}", obs[2]);
    // b decodes alone.
    assert!((obs[1].bbar - 1.0).abs() < 1e-9, "{:?}", obs[1]);
    // Without the names, the pool's count is spread over both replicas:
    // b reads half a sequence beside it, c one (a and b, halved).
    let plain: Vec<Line> = named
        .iter()
        .map(|l| Line {
            replica: None,
            ..*l
        })
        .collect();
    let b0: Vec<f64> = observations(&plain, 2).iter().map(|o| o.b0).collect();
    assert_eq!(b0, [0.0, 0.5, 1.0]);
    // One line without a name: the whole group is averaged.
    let mut mixed = named;
    mixed[0].replica = None;
    let b0: Vec<f64> = observations(&mixed, 2).iter().map(|o| o.b0).collect();
    assert_eq!(b0, [0.0, 0.5, 1.0]);
}

/// Lines that name their replica are read with the batch they ran in:
/// inter-token and end-to-end times fit closer the busier the replicas
/// (on the pool's average a replica running four read as two running two
/// each), and first tokens no worse than by a point and a half (at light
/// load a prompt meets half a step in flight on average either way).
#[test]
fn a_log_that_names_replicas_fits_decode_closer() {
    let g = graph();
    let cost = CostModel::from_graph(&g, None).unwrap();
    for (rate, seed) in [(2.0, 3), (6.0, 5), (14.0, 7)] {
        let records = traffic(rate, 400, seed);
        let fit = |replicas: bool| {
            let log = logged_naming(&g, &records, replicas);
            calibrate_from_log(&g, &cost, None, &log, 0).unwrap()
        };
        let (plain, named) = (fit(false), fit(true));
        let (p, n) = (&plain.report.groups[0].after, &named.report.groups[0].after);
        let why = || {
            format!(
                "rate {rate}: named {n:?}\nplain {p:?}\n{}",
                render(&named.report)
            )
        };
        assert!(n.itl.median <= p.itl.median + 0.002, "{}", why());
        assert!(n.e2e.median <= p.e2e.median + 0.002, "{}", why());
        assert!(n.ttft.median <= p.ttft.median + 0.015, "{}", why());
        if rate >= 14.0 {
            assert!(n.e2e.median < 0.6 * p.e2e.median, "{}", why());
            assert!(n.itl.median < 0.6 * p.itl.median, "{}", why());
        }
    }
}

#[test]
fn a_prompt_still_prefilling_when_a_decode_begins_counts_by_its_share() {
    // One replica. a decodes from 1 s to 10 s; b's prompt prefilled from
    // 0.5 s to 2.5 s (three quarters of it inside a's decode), c's from
    // 9 s to 11 s (half inside). Counting only prompts that started inside
    // a's decode saw c whole and missed b.
    let lines = [
        line(0.0, 1.0, 10.0, Some(0)),
        line(0.5, 2.5, 5.0, Some(0)),
        line(9.0, 11.0, 12.0, Some(0)),
    ];
    let obs = observations(&lines, 1);
    let a = obs[0];
    assert!((a.m - 1.25).abs() < 1e-9, "{a:?}");
    assert!((a.pbar - 100.0).abs() < 1e-9, "{a:?}");
    // Nothing of its own prefill is inside its own decode.
    let c = obs[2];
    assert!(c.m.abs() < 1e-9, "{c:?}");
}

/// A CPU-like engine: each decoding sequence costs its own 5 ms a step
/// (the output head and sampling), beside a roofline that batching would
/// otherwise make nearly free.
const TRUTH_PER_SEQ: &str =
    "[model.m8.variant.bf16]\nmbu = 0.55\nmfu = 0.3\nstep_overhead_ms = 1.0\nseq_overhead_ms = 5.0\n";

#[test]
fn a_cost_per_decoding_sequence_is_found() {
    // Two loads in one log (the second an hour later), so that the batch
    // varies: a light one (0.5 req/s) and a busy one (3 req/s, about 80%
    // of what two replicas serve at 5 ms a sequence).
    let g = graph();
    let mut log = logged_on(TRUTH_PER_SEQ, &g, &traffic(0.5, 200, 5), true);
    let busy: Vec<Record> = logged_on(TRUTH_PER_SEQ, &g, &traffic(3.0, 400, 7), true)
        .into_iter()
        .map(|mut r| {
            r.at_ms += 3_600_000.0;
            r
        })
        .collect();
    log.extend(busy);
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fit = calibrate_from_log(&g, &cost, None, &log, 0).unwrap();
    let f = &fit.report.groups[0];
    let report = render(&fit.report);
    let per_seq = f.seq_overhead_ms.unwrap_or(0.0);
    assert!(
        (per_seq / 5.0 - 1.0).abs() <= 0.3,
        "per-sequence cost {per_seq} ms (want 5)\n{report}"
    );
    // The figures before miss by 75% or more; the fit by well under a
    // tenth (it finds 4.2 ms and moves the rest into the bandwidth).
    assert!(f.before.itl.median > 0.5, "{report}");
    assert!(f.after.itl.median < 0.08, "{report}");
    assert!(f.after.e2e.median < 0.08, "{report}");
    // Written, and read back.
    let cal = Calibration::from_toml_str(&fit.calibration.to_toml()).unwrap();
    let v = cal.variant("m8", "bf16").and_then(|v| v.seq_overhead_ms);
    assert_eq!(v, f.seq_overhead_ms);
    assert!(report.contains("seq_overhead_ms"), "{report}");
}

#[test]
fn a_bandwidth_the_lines_never_bind_is_written_at_the_sheet() {
    // Every step compute-bound: any bandwidth above some value fits the
    // lines alike. The file carries the sheet's (mbu 1) or the least that
    // fits, not a drift to the fit's bound with a time factor of 1e-4.
    let g = graph();
    let truth = "[model.m8.variant.bf16]\nmbu = 1.0\nmfu = 0.02\nstep_overhead_ms = 1.0\n";
    let log = logged_on(truth, &g, &traffic(0.5, 200, 3), true);
    let cost = CostModel::from_graph(&g, None).unwrap();
    let fit = calibrate_from_log(&g, &cost, None, &log, 0).unwrap();
    let f = &fit.report.groups[0];
    assert!(f.time_factor > 0.5, "{}", render(&fit.report));
    assert!(f.mbu <= 1.0 && f.mfu <= 1.0);
    assert!(f.after.e2e.median < 0.10, "{}", render(&fit.report));
}
