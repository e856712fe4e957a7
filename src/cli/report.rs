//! `kiln report`

use super::*;
use crate::ops::report::{self, Options, Replayed};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    Markdown,
    Json,
    Html,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Recorded traffic (kiln JSONL, or a gateway decision log), merged by arrival time.
    #[arg(required = true, num_args = 1..)]
    pub traffic: Vec<PathBuf>,
    /// Replay the traffic under this policy (as `kiln simulate` does) for
    /// each request's tier and the SLO attainment per tier and tenant.
    #[arg(long)]
    pub policy: Vec<PathBuf>,
    /// Wall-clock time of at_ms 0 (RFC 3339), for hour-of-day and weekday
    /// buckets; default: an assumed Monday 00:00 UTC (1970-01-05T00:00:00Z).
    #[arg(long)]
    pub start: Option<String>,
    /// Roofline calibration (TOML) for the replay.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// The window saturation episodes are found in, on a decision log
    /// (a kiln duration: 60s, 5m, 500ms).
    #[arg(long, default_value = "60s")]
    pub episode_window: String,
    /// Skip malformed traffic lines (counted) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
    /// Default: markdown.
    #[arg(long, value_enum, default_value_t = ReportFormat::Markdown)]
    pub format: ReportFormat,
    /// Write here instead of standard output.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
}

pub fn run(a: Args) -> i32 {
    let start_ms = match a.start.as_deref().map(report::parse_rfc3339).transpose() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_USAGE;
        }
    };
    let episode_window_s = match crate::governance::parse_duration_ms(&a.episode_window) {
        Some(ms) if ms >= 1.0 => ms / 1000.0,
        _ => {
            return usage_error(&format!(
                "--episode-window `{}` is not a duration of at least 1ms (60s, 5m)",
                a.episode_window
            ))
        }
    };
    let graph = if a.policy.is_empty() {
        None
    } else {
        match compile_one(&a.policy) {
            Ok((_, g)) => Some(Arc::new(g)),
            Err(code) => return code,
        }
    };
    let cost = match &graph {
        Some(g) => match cost_model(g, a.calibration.as_ref()) {
            Ok(c) => Some(c),
            Err(code) => return code,
        },
        None => None,
    };
    let (records, log_start) = match load_traffic_clocked(&a.traffic, a.skip_malformed) {
        Ok(r) => r,
        Err(code) => return code,
    };
    // A decision log knows when it started: its times are then real ones
    // unless --start says otherwise.
    let start_from_log = start_ms.is_none() && log_start.is_some();
    let start_ms = start_ms.or(log_start.map(|ms| ms.round() as i64));
    let replayed = match (&graph, &cost) {
        (Some(g), Some(c)) => Some(report::replay(g, c, &records)),
        _ => None,
    };
    let inv = report::build(
        &records,
        Options {
            start_ms,
            start_from_log,
            episode_window_s,
        },
        match (&graph, &replayed) {
            (Some(g), Some((outcomes, rep))) => Some(Replayed {
                graph: g,
                outcomes,
                report: rep,
            }),
            _ => None,
        },
    );
    let out = match a.format {
        ReportFormat::Markdown => report::markdown(&inv),
        ReportFormat::Html => match report::html(&inv) {
            Ok(s) => s,
            Err(e) => return usage_error(&e.to_string()),
        },
        ReportFormat::Json => match serde_json::to_string_pretty(&inv) {
            Ok(s) => s + "\n",
            Err(e) => return usage_error(&e.to_string()),
        },
    };
    match &a.output {
        Some(p) if p.as_os_str() != "-" => match std::fs::write(p, out) {
            Ok(()) => EXIT_OK,
            Err(e) => usage_error(&format!("cannot write {}: {e}", p.display())),
        },
        _ => {
            print!("{out}");
            EXIT_OK
        }
    }
}
