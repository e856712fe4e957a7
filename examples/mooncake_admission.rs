//! Admission on long contexts: the Mooncake conversation trace
//! (`../shared/traces/mooncake`, ~12k-token prompts sharing long prefixes)
//! replayed through kiln and fifo on `examples/mooncake/mooncake.kiln` at a
//! fleet size given in GPUs, the same arrivals for both. Prints, for each,
//! the requests whose first token came within the 2 s TTFT SLO (refusals
//! count as misses), the refusals and how busy the GPUs were; then kiln's
//! refusals by reason, each with how many of those requests fifo served
//! in time. `BENCHMARKS.md` ("Holding, infeasible prompts, an impossible
//! tier") records its figures.
//!
//! ```sh
//! cargo run --example mooncake_admission -- 128   # about 4 minutes in a debug build
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // an example may panic

use kiln::backend::cost::CostModel;
use kiln::replay::{self, Outcome};
use kiln::sched::{Config, Mode, Scheduler};
use kiln::traffic::import::{mooncake, Mapping};
use std::collections::BTreeMap;
use std::sync::Arc;

const TRACE: &str = "../shared/traces/mooncake/conversation_trace.jsonl";
const SLO_US: u64 = 2_000_000;

fn met(o: &Outcome) -> bool {
    o.first_token.is_some_and(|f| f - o.arrival <= SLO_US)
}

fn main() {
    let gpus: u32 = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("the fleet size in GPUs, e.g. 128"))
        .unwrap_or(128);
    let text = std::fs::read_to_string("examples/mooncake/mooncake.kiln")
        .expect("run from the repository root")
        .replace("gpus 16", &format!("gpus {gpus}"));
    let c = kiln::compile::compile_str("mooncake.kiln", &text);
    let g = Arc::new(c.graph.expect("the example policy compiles"));
    let mut map = Mapping::new("llama-70b");
    map.tenant = Some("support-bot".into());
    let recs = mooncake(TRACE, &map).expect("the Mooncake trace").records;
    let cost = CostModel::from_graph(&g, None).expect("the cost model");
    let mut runs = Vec::new();
    for mode in [Mode::Kiln, Mode::Fifo] {
        let cfg = Config {
            mode,
            ..Config::default()
        };
        let mut s = Scheduler::new(g.clone(), replay::plan(&g, &cost), cfg);
        let o = replay::run(&mut s, replay::arrivals(&recs), |_, _| {});
        let n = o.iter().filter(|o| met(o)).count();
        let gpu_s: f64 = o.iter().map(|o| o.gpu_seconds).sum();
        let end = o
            .iter()
            .filter_map(|o| o.finished.or(o.first_token))
            .max()
            .unwrap_or(1) as f64
            / 1e6;
        println!(
            "{mode:?}: {n}/{} met the SLO ({:.1}%), {} refused, GPUs {:.1}% busy ({gpus} GPUs, {end:.0} s)",
            o.len(),
            100.0 * n as f64 / o.len() as f64,
            o.iter().filter(|o| o.rejected.is_some()).count(),
            100.0 * gpu_s / (f64::from(gpus) * end),
        );
        runs.push(o);
    }
    let mut by_reason: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (k, f) in runs[0].iter().zip(&runs[1]) {
        if let Some((reason, _)) = k.rejected {
            let e = by_reason.entry(format!("{reason:?}")).or_default();
            e.0 += 1;
            e.1 += usize::from(met(f));
        }
    }
    for (reason, (n, fifo_met)) in by_reason {
        println!("kiln refused {n} as {reason}; fifo served {fifo_met} of them in time");
    }
}
