//! `kiln plan`

use super::*;
use crate::ops::plan::{self, Options, PlanError, Planner};
use crate::replay::capacity::Thresholds;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanFormat {
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
    /// Spare capacity the plan must keep: it must pass at the arrival rate
    /// times 1 + this (0% to 1000%).
    #[arg(long, default_value = "20%")]
    pub headroom: String,
    /// Growth what-if: arrival times are divided by this as well (2 = twice
    /// the traffic), above 0 and at most 1000.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// What-if: plan POOL on another GPU kind (`h100=H200-SXM`); repeatable.
    #[arg(long, value_name = "POOL=KIND")]
    pub gpu_kind: Vec<String>,
    /// Share of a TTFT tier's requests (refused = miss) that must meet the TTFT SLO.
    #[arg(long, default_value_t = 0.99)]
    pub ttft: f64,
    /// Share of a completion-window tier's requests that must finish inside the window.
    #[arg(long, default_value_t = 0.99)]
    pub window: f64,
    /// At most this many replays (1 to 1000).
    #[arg(long, default_value_t = 40)]
    pub max_replays: u32,
    /// The search's upper bound: at most this many GPUs in one pool.
    #[arg(long, default_value_t = 4096)]
    pub max_gpus_per_pool: u32,
    /// Seed for anything random (recorded in the report).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Roofline calibration (TOML) overriding GPU and efficiency figures.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Skip malformed traffic lines (counted) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
    #[arg(long, value_enum, default_value_t = PlanFormat::Human)]
    pub format: PlanFormat,
    /// Also write the plot (SLO attainment per tier against total GPUs,
    /// one dot per replay) as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// `20%` (or `20`) → 0.2.
fn headroom(s: &str) -> Option<f64> {
    let t = s.trim();
    let n = t.strip_suffix('%').unwrap_or(t).trim();
    n.parse::<f64>().ok().map(|x| x / 100.0)
}

fn fail(e: PlanError) -> i32 {
    eprintln!("{:?}", miette::Report::new(e));
    EXIT_FINDINGS
}

pub fn run(a: Args) -> i32 {
    let Some(h) = headroom(&a.headroom) else {
        return usage_error("--headroom must be a percentage, like 20%");
    };
    if !(1..=1000).contains(&a.max_replays) {
        return usage_error("--max-replays must be 1 to 1000");
    }
    if !(1..=crate::graph::limits::MAX_POOL_GPUS).contains(&a.max_gpus_per_pool) {
        return usage_error("--max-gpus-per-pool must be 1 to 4096");
    }
    let mut kinds = Vec::new();
    for k in &a.gpu_kind {
        match plan::parse_gpu_kind(k) {
            Ok(x) => kinds.push(x),
            Err(e) => return fail(e),
        }
    }
    let opts = Options {
        headroom: h,
        time_scale: a.time_scale,
        thresholds: Thresholds {
            ttft: a.ttft,
            window: a.window,
        },
        gpu_kinds: kinds,
        max_replays: a.max_replays,
        max_gpus_per_pool: a.max_gpus_per_pool,
        seed: a.seed,
    };
    if let Err(e) = opts.validate() {
        return fail(e);
    }
    let mut g = match compile_one(&a.policy) {
        Ok((_, g)) => g,
        Err(code) => return code,
    };
    if let Err(e) = plan::apply_gpu_kinds(&mut g, &opts.gpu_kinds) {
        return fail(e);
    }
    let cost = match cost_model(&g, a.calibration.as_ref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let records = match load_traffic(&a.traffic, a.skip_malformed) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let planner = match Planner::new(g, &cost, &records, opts) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let bar = super::simulate::Progress::new(
        "replay",
        super::simulate::Progress::stderr_is_terminal(),
        false,
    );
    let result = planner.plan(|n, done, total| {
        bar.rename(&format!("replay {n}"));
        bar.set(done, total)
    });
    let p = match result {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    if let Some(path) = &a.plot {
        let svg = match plan::svg(&p) {
            Ok(s) => s,
            Err(e) => return usage_error(&e.to_string()),
        };
        if let Err(e) = std::fs::write(path, svg) {
            return usage_error(&format!("cannot write {}: {e}", path.display()));
        }
    }
    let out = match a.format {
        PlanFormat::Human => plan::render(&p, false),
        PlanFormat::Markdown => plan::render(&p, true),
        PlanFormat::Json => match serde_json::to_string_pretty(&p) {
            Ok(s) => s + "\n",
            Err(e) => return usage_error(&e.to_string()),
        },
    };
    print!("{out}");
    EXIT_OK
}

#[cfg(test)]
mod tests {
    #[test]
    fn headroom_is_a_percentage() {
        assert_eq!(super::headroom("20%"), Some(0.2));
        assert_eq!(super::headroom("50"), Some(0.5));
        assert_eq!(super::headroom("x%"), None);
    }
}
