//! Cost per event against the backlog: the scheduler holding 1k, 100k and
//! 1M queued requests (a completion-window tier, so admission lets them
//! queue; four tenants so fair share has work to do), then timed over the
//! same number of events (a step finishing, a new arrival) for each
//! scheduler. Replay throughput must not depend on how much waits.
//!
//! `cargo bench --bench scale`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::backend::cost::CostModel;
use kiln::graph::Request;
use kiln::sched::{Action, Arrival, Config, Event, Mode, Scheduler, MS};
use std::sync::Arc;
use std::time::Instant;

const POLICY: &str = r#"
pool h100 { gpus 2 kind "H100-80GB" memory 80GB }
model llama-8b {
  params 8B
  kv_per_token 128KB
  variant fp16 { memory 18GB pools [h100] max_batch 64 }
}
tier batch { priority 1 slo { window 1000h } }
tenant t0 { owner "o" tiers [batch] weight 1 }
tenant t1 { owner "o" tiers [batch] weight 2 }
tenant t2 { owner "o" tiers [batch] weight 3 }
tenant t3 { owner "o" tiers [batch] weight 4 }
classify { default => tier batch }
route batch llama-8b { default => fp16 }
"#;

fn arrival(id: u64) -> Arrival {
    Arrival {
        quota_claimed: false,
        fleet: None,
        cache: None,
        semantic: None,
        window: None,
        id,
        request: Request {
            tenant: Some(format!("t{}", id % 4)),
            model: "llama-8b".into(),
            prompt_tokens: 200 + (id * 7919) % 1800,
            max_tokens: 50 + (id * 104_729) % 300,
            ..Default::default()
        },
        output_tokens: (50 + (id * 104_729) % 300) as u32,
        prefix_blocks: Vec::new(),
    }
}

/// Events per second over `events` events, with `queued` requests waiting.
fn measure(mode: Mode, queued: u64, events: u64) -> (f64, usize) {
    let c = kiln::compile::compile_str("scale.kiln", POLICY);
    let g = Arc::new(c.graph.expect("policy compiles"));
    let cost = CostModel::from_graph(&g, None).expect("cost model");
    let cfg = Config {
        mode,
        ..Config::default()
    };
    let mut s = Scheduler::new(g.clone(), kiln::replay::plan(&g, &cost), cfg);
    let mut steps: Vec<(u64, usize)> = Vec::new();
    let note = |acts: &[Action], steps: &mut Vec<(u64, usize)>| {
        for a in acts {
            if let Action::Step { replica, until } = a {
                steps.push((*until, *replica));
            }
        }
    };
    for id in 0..queued {
        let acts = s.handle(0, Event::Arrive(arrival(id))).to_vec();
        note(&acts, &mut steps);
    }
    let depth = s.waiting();
    let mut next_id = queued;
    let mut now = 0;
    let t0 = Instant::now();
    for i in 0..events {
        let acts = if i % 2 == 0 {
            // The earliest step ends.
            steps.sort_unstable_by(|a, b| b.cmp(a));
            match steps.pop() {
                Some((until, replica)) => {
                    now = now.max(until);
                    s.handle(now, Event::StepDone { replica }).to_vec()
                }
                None => Vec::new(),
            }
        } else {
            now += MS;
            next_id += 1;
            s.handle(now, Event::Arrive(arrival(next_id))).to_vec()
        };
        note(&acts, &mut steps);
    }
    let secs = t0.elapsed().as_secs_f64();
    (events as f64 / secs, depth)
}

fn main() {
    let events = 200_000;
    println!("| scheduler | queued | events/s | vs 1k queued |");
    println!("|---|---|---|---|");
    for mode in [Mode::Kiln, Mode::Fifo, Mode::Priority] {
        let mut base = 0.0;
        for queued in [1_000u64, 100_000, 1_000_000] {
            let (rate, depth) = measure(mode, queued, events);
            if queued == 1_000 {
                base = rate;
            }
            println!(
                "| {} | {depth} | {:.0} | {:.2}x |",
                format!("{mode:?}").to_lowercase(),
                rate,
                rate / base
            );
        }
    }
}
