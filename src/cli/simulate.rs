//! `kiln simulate`

use super::*;
use crate::replay::{self, report};
use crate::sched::{Config, Mode, Scheduler};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SimFormat {
    Human,
    Markdown,
    Json,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Recorded traffic (kiln JSONL; see `kiln traffic import`), merged by arrival time.
    #[arg(long, required = true, num_args = 1..)]
    pub traffic: Vec<PathBuf>,
    /// Scheduler(s) to run; several compare on the same traffic in one report.
    #[arg(long, value_enum, num_args = 1.., default_values_t = [Mode::Kiln])]
    pub scheduler: Vec<Mode>,
    /// Run kiln and every baseline (fifo, priority, static).
    #[arg(long)]
    pub compare: bool,
    /// Seed for anything random (the core is deterministic; recorded in the report).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Roofline calibration (TOML) overriding GPU and efficiency figures.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Skip malformed traffic lines (counted) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
    #[arg(long, value_enum, default_value_t = SimFormat::Human)]
    pub format: SimFormat,
}

pub fn run(a: Args) -> i32 {
    let g = match compile_one(&a.policy) {
        Ok((_, g)) => Arc::new(g),
        Err(code) => return code,
    };
    let cost = match cost_model(&g, a.calibration.as_ref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let records = match load_traffic(&a.traffic, a.skip_malformed) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let modes: Vec<Mode> = if a.compare {
        vec![Mode::Kiln, Mode::Fifo, Mode::Priority, Mode::Static]
    } else {
        a.scheduler.clone()
    };
    let gpus: u32 = g.pools.iter().map(|p| p.gpus).sum();
    let mut reports = Vec::new();
    for mode in modes {
        let mut plan = replay::plan(&g, &cost);
        if mode == Mode::Static {
            plan.partition_by_tier(&g);
        }
        let cfg = Config {
            mode,
            ..Config::default()
        };
        let mut sched = Scheduler::new(g.clone(), plan, cfg);
        let show = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let name = format!("{mode:?}").to_lowercase();
        let (outcomes, gap) =
            replay::run_measured(&mut sched, replay::arrivals(&records), |done, total| {
                if show {
                    eprint!("\r{}", progress_bar(&name, done, total));
                    if done == total {
                        eprintln!();
                    }
                }
            });
        let busy: f64 = sched
            .replicas()
            .iter()
            .map(|r| r.busy_seconds * f64::from(r.spec.gpus))
            .sum();
        reports.push(report::build(&g, &name, &outcomes, busy, gpus, gap));
    }
    let out = match a.format {
        SimFormat::Human => report::human(&reports),
        SimFormat::Markdown => report::markdown(&reports),
        SimFormat::Json => match serde_json::to_string_pretty(&serde_json::json!({
            "seed": a.seed,
            "reports": reports,
        })) {
            Ok(s) => s + "\n",
            Err(e) => return usage_error(&e.to_string()),
        },
    };
    print!("{out}");
    EXIT_OK
}

/// `kiln   [##########..........]  50%  14092/28185 requests`
pub(crate) fn progress_bar(name: &str, done: usize, total: usize) -> String {
    const WIDTH: usize = 30;
    let filled = (done * WIDTH).checked_div(total).unwrap_or(WIDTH);
    let pct = (done * 100).checked_div(total).unwrap_or(100);
    format!(
        "{name:<8} [{}{}] {pct:>3}%  {done}/{total} requests",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_bar_fills() {
        assert_eq!(
            super::progress_bar("kiln", 5, 10),
            "kiln     [###############...............]  50%  5/10 requests"
        );
        assert!(super::progress_bar("kiln", 0, 0).contains("100%"));
    }
}
