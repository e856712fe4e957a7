//! `kiln explain`

use super::*;
use crate::graph::{Request, Signals, SignalsInput};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required_unless_present = "log")]
    pub policy: Vec<PathBuf>,
    /// The request as JSON (see README: "Requests and signals").
    #[arg(long, required_unless_present = "log", conflicts_with = "log")]
    pub request: Option<PathBuf>,
    /// A pool at a moment instead of a request: the gateway's decision
    /// log(s), read with `--pool` and `--at`.
    #[arg(long, requires_all = ["pool", "at"], num_args = 1..)]
    pub log: Vec<PathBuf>,
    /// The pool whose moment `--log` explains.
    #[arg(long, requires = "log")]
    pub pool: Option<String>,
    /// The moment: RFC 3339 (`2026-12-04T10:33:40Z`), or `+DURATION` after
    /// the log's first arrival (`+95s`).
    #[arg(long, requires = "log", allow_hyphen_values = true)]
    pub at: Option<String>,
    /// How far back arrivals and refusals are counted (a kiln duration).
    #[arg(long, default_value = "60s", requires = "log")]
    pub window: String,
    /// Live signals as JSON; absent means an idle fleet at Monday 12:00.
    #[arg(long)]
    pub signals: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

fn read_json<T: serde::de::DeserializeOwned>(p: &Path) -> Result<T, String> {
    let text =
        std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))
}

pub fn run(a: Args) -> i32 {
    if !a.log.is_empty() {
        return pool_at(&a);
    }
    let Some(request) = &a.request else {
        return usage_error(
            "give --request FILE (a request), or --log LOG --pool P --at T (a pool at a moment)",
        );
    };
    let (c, g) = match compile_one(&a.policy) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let g = &g;
    let req: Request = match read_json(request) {
        Ok(r) => r,
        Err(e) => return usage_error(&e),
    };
    let sig_in: SignalsInput = match &a.signals {
        Some(p) => match read_json(p) {
            Ok(s) => s,
            Err(e) => return usage_error(&e),
        },
        None => SignalsInput::default(),
    };
    let signals = match Signals::resolve(g, &sig_in) {
        Ok(s) => s,
        Err(e) => return usage_error(&e.0),
    };
    let (d, trace) = g.explain(&req, &signals);
    let view = g.view(&d);
    match a.format {
        Format::Human => print!(
            "{}",
            crate::graph::trace::render(g, &c.sources, &req, &view, &trace)
        ),
        Format::Json => {
            let v = serde_json::json!({ "request": req, "decision": view, "trace": trace });
            match serde_json::to_string_pretty(&v) {
                Ok(s) => println!("{s}"),
                Err(e) => return usage_error(&e.to_string()),
            }
        }
    }
    EXIT_OK
}

/// `kiln explain --log LOG --pool P --at T`: why a pool was idle or busy
/// then ([`crate::ops::pool_at`]).
fn pool_at(a: &Args) -> i32 {
    let (Some(pool), Some(at)) = (&a.pool, &a.at) else {
        return usage_error("--log needs --pool P and --at T");
    };
    let Some(window_ms) = crate::governance::parse_duration_ms(&a.window).filter(|w| *w > 0.0)
    else {
        return usage_error(&format!(
            "--window `{}` is not a positive duration (60s, 5m)",
            a.window
        ));
    };
    let (records, start) = match load_traffic_clocked(&a.log, false) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let at_ms = if let Some(rel) = at.strip_prefix('+') {
        match crate::governance::parse_duration_ms(rel) {
            Some(ms) => ms,
            None => return usage_error(&format!("--at `{at}`: `+` takes a duration (+95s, +2m)")),
        }
    } else {
        let t = match crate::ops::report::parse_rfc3339(at) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{:?}", miette::Report::new(e));
                return EXIT_USAGE;
            }
        };
        let Some(start) = start else {
            return usage_error(&format!(
                "--at `{at}` is a wall-clock time, but this traffic has none (it is not a decision log): give `+DURATION` after its first arrival"
            ));
        };
        t as f64 - start
    };
    if !records
        .iter()
        .any(|r| crate::ops::pool_at::pool_of(r) == Some(pool.as_str()))
    {
        eprintln!("note: no record in the log names pool `{pool}` in its route");
    }
    let p = crate::ops::pool_at::explain(&records, pool, at_ms, window_ms);
    match a.format {
        Format::Human => {
            let when = start.map_or_else(
                || format!("+{:.1} s", at_ms / 1000.0),
                |s| crate::ops::report::format_rfc3339((s + at_ms).round() as i64),
            );
            println!(
                "{when} ({:.1} s after the log's first arrival): {}",
                at_ms / 1000.0,
                p.verdict
            );
        }
        Format::Json => match serde_json::to_string_pretty(&p) {
            Ok(s) => println!("{s}"),
            Err(e) => return usage_error(&e.to_string()),
        },
    }
    EXIT_OK
}
