//! `kiln simulate`

use super::*;
use crate::replay::{self, capacity, report};
use crate::sched::route::Routing;
use crate::sched::{Config, Mode};
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
    /// Routing(s): how requests are sent to replicas. Several compare (each
    /// with every scheduler asked for); reports are named `scheduler/routing`
    /// unless the routing is kiln's.
    #[arg(long, value_enum, num_args = 1.., default_values_t = [Routing::Kiln])]
    pub routing: Vec<Routing>,
    /// Run kiln and every baseline: the schedulers fifo, priority and static
    /// (with kiln's routing), and kiln's scheduler with the routings
    /// round-robin, least-loaded and random.
    #[arg(long)]
    pub compare: bool,
    /// Seed for anything random (the `random` routing; recorded in the report).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Scale the arrival rate: arrival times are divided by this (2 = the
    /// same requests in half the time).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Find each scheduler's capacity at SLO instead: the largest arrival
    /// rate scale at which every TTFT tier and every completion-window tier
    /// meets its threshold (bracketed in 1/64..64, bisected to about 2%).
    #[arg(long)]
    pub capacity: bool,
    /// With --capacity: share of a TTFT tier's requests (refused = miss)
    /// that must meet the TTFT SLO.
    #[arg(long, default_value_t = 0.99)]
    pub capacity_ttft: f64,
    /// With --capacity: share of a completion-window tier's requests that
    /// must finish inside the window.
    #[arg(long, default_value_t = 0.99)]
    pub capacity_window: f64,
    /// Roofline calibration (TOML) overriding GPU and efficiency figures.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Skip malformed traffic lines (counted) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
    /// The wall-clock moment the replay starts at, RFC 3339
    /// (`2026-12-29T08:00:00Z`): what `time`, `weekday`, `date`, `day` and
    /// exceptions read, in the policy's zone. Default: Monday 2024-01-01
    /// 12:00 in virtual time.
    #[arg(long)]
    pub start: Option<String>,
    #[arg(long, value_enum, default_value_t = SimFormat::Human)]
    pub format: SimFormat,
}

/// The report name of a scheduler and routing.
fn run_name(mode: Mode, routing: Routing) -> String {
    let m = format!("{mode:?}").to_lowercase();
    if routing == Routing::Kiln {
        m
    } else {
        format!("{m}/{}", routing.name())
    }
}

/// One replay of the traffic, arrival times divided by `scale`.
#[allow(clippy::too_many_arguments)]
fn replay_one(
    g: &Arc<crate::graph::DecisionGraph>,
    cost: &crate::backend::cost::CostModel,
    records: &[crate::traffic::Record],
    mode: Mode,
    routing: Routing,
    seed: u64,
    start_unix_ms: Option<i64>,
    scale: f64,
    show: bool,
) -> report::Report {
    let cfg = Config {
        mode,
        routing,
        seed,
        start_unix_ms,
        ..Config::default()
    };
    let name = run_name(mode, routing);
    let bar = Progress::new(&name, show, true);
    replay::replay_at(g, cost, records, cfg, &name, scale, |done, total| {
        bar.set(done, total)
    })
}

/// One row of `--capacity`.
#[derive(Debug, Clone, serde::Serialize)]
struct CapacityRow {
    scheduler: String,
    routing: &'static str,
    #[serde(flatten)]
    found: capacity::Found,
}

pub fn run(a: Args) -> i32 {
    if !(a.scale.is_finite() && a.scale > 0.0) {
        return usage_error("--scale must be a positive number");
    }
    for t in [a.capacity_ttft, a.capacity_window] {
        if !(0.0..=1.0).contains(&t) {
            return usage_error("--capacity-ttft and --capacity-window are shares, 0 to 1");
        }
    }
    let start = match a.start.as_deref().map(crate::ops::report::parse_rfc3339) {
        None => None,
        Some(Ok(ms)) => Some(ms),
        Some(Err(_)) => {
            return usage_error("--start is an RFC 3339 moment, like `2026-12-29T08:00:00Z`")
        }
    };
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
    let runs: Vec<(Mode, Routing)> = if a.compare {
        let mut v: Vec<(Mode, Routing)> = [Mode::Kiln, Mode::Fifo, Mode::Priority, Mode::Static]
            .into_iter()
            .map(|m| (m, Routing::Kiln))
            .collect();
        v.extend(
            [Routing::RoundRobin, Routing::LeastLoaded, Routing::Random].map(|r| (Mode::Kiln, r)),
        );
        v
    } else {
        let mut v = Vec::new();
        for &m in &a.scheduler {
            for &r in &a.routing {
                if !v.contains(&(m, r)) {
                    v.push((m, r));
                }
            }
        }
        v
    };
    let show = std::io::IsTerminal::is_terminal(&std::io::stderr());
    if a.capacity {
        return run_capacity(&a, &g, &cost, &records, &runs, start, show);
    }
    let reports: Vec<report::Report> = runs
        .iter()
        .map(|&(m, r)| replay_one(&g, &cost, &records, m, r, a.seed, start, a.scale, show))
        .collect();
    let out = match a.format {
        SimFormat::Human => report::human(&reports),
        SimFormat::Markdown => report::markdown(&reports),
        SimFormat::Json => match serde_json::to_string_pretty(&serde_json::json!({
            "seed": a.seed,
            "scale": a.scale,
            "reports": reports,
        })) {
            Ok(s) => s + "\n",
            Err(e) => return usage_error(&e.to_string()),
        },
    };
    print!("{out}");
    EXIT_OK
}

fn run_capacity(
    a: &Args,
    g: &Arc<crate::graph::DecisionGraph>,
    cost: &crate::backend::cost::CostModel,
    records: &[crate::traffic::Record],
    runs: &[(Mode, Routing)],
    start: Option<i64>,
    show: bool,
) -> i32 {
    let th = capacity::Thresholds {
        ttft: a.capacity_ttft,
        window: a.capacity_window,
    };
    let mut rows = Vec::new();
    for &(m, r) in runs {
        let name = run_name(m, r);
        let found = capacity::search(capacity::Search::default(), |x| {
            if show {
                eprintln!("{name}: replaying at {x:.3}x");
            }
            let rep = replay_one(g, cost, records, m, r, a.seed, start, x, false);
            capacity::judge(&rep, th)
        });
        rows.push(CapacityRow {
            scheduler: name,
            routing: r.name(),
            found,
        });
    }
    let out = match a.format {
        SimFormat::Human => capacity_table(&rows, false),
        SimFormat::Markdown => capacity_table(&rows, true),
        SimFormat::Json => match serde_json::to_string_pretty(&serde_json::json!({
            "seed": a.seed,
            "thresholds": { "ttft": th.ttft, "window": th.window },
            "capacity": rows,
        })) {
            Ok(s) => s + "\n",
            Err(e) => return usage_error(&e.to_string()),
        },
    };
    print!("{out}");
    EXIT_OK
}

/// The capacity table: scheduler, capacity ×, replays, binding tier.
fn capacity_table(rows: &[CapacityRow], markdown: bool) -> String {
    use std::fmt::Write as _;
    let cap = |f: &capacity::Found| match (f.bound, f.scale, f.fails_at) {
        (capacity::Bound::AtHighest, Some(x), _) => format!("≥ {x:.2}×"),
        (_, Some(x), _) => format!("{x:.2}×"),
        (_, None, Some(x)) => format!("< {x:.4}×"),
        (_, None, None) => "-".into(),
    };
    if !markdown {
        let mut t = crate::table::new(&[
            ("scheduler", crate::table::Left),
            ("capacity at SLO", crate::table::Right),
            ("replays", crate::table::Right),
            ("binding tier", crate::table::Left),
        ]);
        for r in rows {
            t.add_row(vec![
                r.scheduler.clone(),
                cap(&r.found),
                r.found.replays.to_string(),
                r.found.binding.as_deref().unwrap_or("-").to_string(),
            ]);
        }
        return crate::table::render(&t, "");
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| scheduler | capacity at SLO | replays | binding tier |"
    );
    let _ = writeln!(s, "|---|---:|---:|---|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            r.scheduler,
            cap(&r.found),
            r.found.replays,
            r.found.binding.as_deref().unwrap_or("-")
        );
    }
    s
}

/// A replay's progress on stderr, drawn by indicatif:
/// `kiln     [###############...............]  50%  5/10 requests`.
/// Hidden unless stderr is a terminal, so pipes, logs and tests see no
/// escape codes.
pub(crate) struct Progress {
    bar: indicatif::ProgressBar,
    /// Leave the finished bar on screen (else it is cleared).
    keep: bool,
}

impl Progress {
    /// A bar named `name`, drawn where `show` (stderr is a terminal).
    pub(crate) fn new(name: &str, show: bool, keep: bool) -> Self {
        let target = if show {
            indicatif::ProgressDrawTarget::stderr()
        } else {
            indicatif::ProgressDrawTarget::hidden()
        };
        let bar = indicatif::ProgressBar::with_draw_target(None, target);
        let style = indicatif::ProgressStyle::with_template(
            "{prefix:8} [{bar:30}] {percent:>3}%  {pos}/{len} requests",
        )
        .map(|s| s.progress_chars("#."))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(name.to_string());
        Progress { bar, keep }
    }

    /// Stderr is a terminal: bars are drawn.
    pub(crate) fn stderr_is_terminal() -> bool {
        std::io::IsTerminal::is_terminal(&std::io::stderr())
    }

    /// `done` of `total` requests replayed; the bar ends at `total`.
    pub(crate) fn set(&self, done: usize, total: usize) {
        self.bar.set_length(total as u64);
        self.bar.set_position(done as u64);
        if done >= total {
            if self.keep {
                self.bar.finish();
            } else {
                self.bar.finish_and_clear();
            }
        }
    }

    /// A new replay on the same bar.
    pub(crate) fn rename(&self, name: &str) {
        if self.bar.is_finished() {
            self.bar.reset();
        }
        self.bar.set_prefix(name.to_string());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_is_hidden_off_a_terminal_and_counts() {
        let p = super::Progress::new("kiln", false, true);
        assert!(p.bar.is_hidden());
        p.set(5, 10);
        assert_eq!((p.bar.position(), p.bar.length()), (5, Some(10)));
        assert!(!p.bar.is_finished());
        p.set(10, 10);
        assert!(p.bar.is_finished());
        p.rename("again");
        assert!(!p.bar.is_finished());
        // No requests: done at once, no division by zero.
        super::Progress::new("empty", false, false).set(0, 0);
    }
}
