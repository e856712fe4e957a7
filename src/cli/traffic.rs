//! `kiln traffic`: import public traces into the kiln traffic format,
//! merge traces, summarise them.

use super::*;
use crate::traffic::{
    self, import::Mapping, servegen, stats, Loaded, ReadOptions, Record, TrafficError,
};
use clap::Subcommand;
use std::collections::BTreeMap;
use std::io::Write;

#[derive(clap::Args, Debug)]
#[command(
    long_about = "Import, merge and summarise recorded traffic: JSONL, one request a line (docs/traffic.md: \"Recorded traffic\").\n\nExit codes: 0 ok, 1 malformed input (unless --skip-malformed), 2 usage or I/O error."
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Sub,
}

#[derive(Subcommand, Debug)]
pub enum Sub {
    /// Turn a public trace into kiln traffic.
    Import(Box<ImportArgs>),
    /// Merge traces by arrival time (ties keep the order of the inputs).
    Merge(MergeArgs),
    /// Count, span, rate and token percentiles per tenant.
    Stats(StatsArgs),
}

#[derive(clap::Args, Debug)]
pub struct ImportArgs {
    #[command(subcommand)]
    pub source: Source,
}

#[derive(Subcommand, Debug)]
pub enum Source {
    /// Azure LLM inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens).
    Azure {
        /// The CSV (e.g. AzureLLMInferenceTrace_conv.csv).
        input: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// Mooncake trace JSONL (timestamp, input_length, output_length, hash_ids).
    Mooncake {
        /// The JSONL (e.g. conversation_trace.jsonl).
        input: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// ServeGen per-client statistics (a directory of chunk-<id>-trace.csv):
    /// generates arrivals per client, sizes sampled from --sizes-from.
    Servegen {
        /// Directory of chunk-<id>-trace.csv files (e.g. language-m-small).
        dir: PathBuf,
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        sg: ServegenArgs,
    },
}

/// Options every importer takes.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// Output file; `-` or nothing: standard output.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Model every request asks for.
    #[arg(long)]
    pub model: String,
    /// Tenant of every request.
    #[arg(long)]
    pub tenant: Option<String>,
    /// API key of every request.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Header on every request, `name=value` (repeatable).
    #[arg(long = "header", value_name = "K=V", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Tag on every request (repeatable).
    #[arg(long = "tag", value_name = "T")]
    pub tags: Vec<String>,
    /// max_tokens of every request (default: the tokens actually generated).
    #[arg(long)]
    pub max_tokens: Option<u64>,
    /// Multiply arrival times by F (0.5 = twice the rate).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    pub time_scale: f64,
    /// Keep the first N requests.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Skip malformed lines (and say how many) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
}

#[derive(clap::Args, Debug)]
pub struct ServegenArgs {
    /// kiln traffic to sample request sizes from (e.g. an Azure import).
    #[arg(long, value_name = "FILE.jsonl")]
    pub sizes_from: PathBuf,
    /// Seed of the arrival and size draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Start of the window, seconds from the start of the 14 days.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub start: f64,
    /// Length of the window, seconds.
    #[arg(long, value_name = "S", default_value_t = 3600.0)]
    pub duration: f64,
    /// Only the N clients with the lowest ids.
    #[arg(long, value_name = "N", conflicts_with = "client")]
    pub clients: Option<usize>,
    /// Only these client ids (repeatable, or comma-separated).
    #[arg(long, value_name = "ID", value_delimiter = ',')]
    pub client: Vec<u64>,
    /// Tenant of client N is PREFIX + N.
    #[arg(long, value_name = "PREFIX", default_value = "client-")]
    pub tenant_prefix: String,
}

#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// kiln traffic files.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output file; `-` or nothing: standard output.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Multiply arrival times by F (0.5 = twice the rate).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    pub time_scale: f64,
    /// Skip malformed lines (and say how many) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
}

#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// kiln traffic files (summarised together).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
    /// Skip malformed lines (and say how many) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("expected NAME=VALUE, found `{s}`")),
    }
}

pub fn run(a: Args) -> i32 {
    match a.command {
        Sub::Import(i) => import(i.source),
        Sub::Merge(m) => merge(m),
        Sub::Stats(s) => stats_cmd(s),
    }
}

/// Reports a traffic error and returns its exit code.
fn fail(e: &TrafficError) -> i32 {
    if e.is_malformed() {
        let theme = if color() {
            miette::GraphicalTheme::unicode()
        } else {
            miette::GraphicalTheme::unicode_nocolor()
        };
        let mut s = String::new();
        match miette::GraphicalReportHandler::new_themed(theme).render_report(&mut s, e) {
            Ok(()) => eprint!("{s}"),
            Err(_) => eprintln!("error: {e}"),
        }
        EXIT_FINDINGS
    } else {
        usage_error(&e.to_string())
    }
}

fn report_skipped(name: &Path, skipped: &[usize]) {
    if skipped.is_empty() {
        return;
    }
    let shown: Vec<String> = skipped.iter().take(10).map(|n| n.to_string()).collect();
    let more = if skipped.len() > 10 { ", …" } else { "" };
    eprintln!(
        "warning: {}: skipped {} malformed line{} (line {}{more})",
        name.display(),
        skipped.len(),
        if skipped.len() == 1 { "" } else { "s" },
        shown.join(", ")
    );
}

fn mapping(c: &Common) -> Mapping {
    Mapping {
        tenant: c.tenant.clone(),
        api_key: c.api_key.clone(),
        model: c.model.clone(),
        headers: c.headers.iter().cloned().collect::<BTreeMap<_, _>>(),
        tags: c.tags.clone(),
        max_tokens: c.max_tokens,
        time_scale: c.time_scale,
        limit: c.limit,
        skip_malformed: c.skip_malformed,
    }
}

fn import(src: Source) -> i32 {
    let (input, common, result) = match &src {
        Source::Azure { input, common } => (
            input,
            common,
            traffic::import::azure(input, &mapping(common)),
        ),
        Source::Mooncake { input, common } => (
            input,
            common,
            traffic::import::mooncake(input, &mapping(common)),
        ),
        Source::Servegen { dir, common, sg } => {
            if common.tenant.is_some() {
                return usage_error(
                    "servegen names a tenant per client: use --tenant-prefix, not --tenant",
                );
            }
            let sizes = match traffic::read_with(
                &sg.sizes_from,
                ReadOptions {
                    skip_malformed: common.skip_malformed,
                },
            ) {
                Ok(l) => {
                    report_skipped(&sg.sizes_from, &l.skipped);
                    l.records
                }
                Err(e) => return fail(&e),
            };
            let opts = servegen::Options {
                seed: sg.seed,
                start_s: sg.start,
                duration_s: sg.duration,
                clients: match (sg.clients, sg.client.is_empty()) {
                    (Some(n), _) => servegen::Clients::First(n),
                    (None, false) => servegen::Clients::Ids(sg.client.clone()),
                    (None, true) => servegen::Clients::All,
                },
                tenant_prefix: sg.tenant_prefix.clone(),
            };
            (
                dir,
                common,
                servegen::import(dir, &mapping(common), &opts, &sizes),
            )
        }
    };
    match result {
        Ok(Loaded { records, skipped }) => {
            report_skipped(input, &skipped);
            let code = output(common.output.as_deref(), &records);
            if code == EXIT_OK {
                summarise_written("imported", input, common.output.as_deref(), &records);
            }
            code
        }
        Err(e) => fail(&e),
    }
}

/// Says on stderr what was written (stdout may be the JSONL itself), so an
/// import that succeeds is never silent: `imported 19366 requests (1
/// tenant, 3599.2 s) from … to …`.
fn summarise_written(verb: &str, from: &Path, to: Option<&Path>, records: &[Record]) {
    let tenants: std::collections::BTreeSet<&str> = records
        .iter()
        .map(|r| r.tenant.as_deref().or(r.api_key.as_deref()).unwrap_or("-"))
        .collect();
    let span_s = match (records.first(), records.last()) {
        (Some(a), Some(b)) => (b.at_ms - a.at_ms) / 1000.0,
        _ => 0.0,
    };
    let to = match to {
        Some(p) if p != Path::new("-") => p.display().to_string(),
        _ => "standard output".to_string(),
    };
    eprintln!(
        "{verb} {} request{} ({} tenant{}, {span_s:.1} s) from {} to {to}",
        records.len(),
        if records.len() == 1 { "" } else { "s" },
        tenants.len(),
        if tenants.len() == 1 { "" } else { "s" },
        from.display(),
    );
}

fn read_all(inputs: &[PathBuf], skip_malformed: bool) -> Result<Vec<Vec<Record>>, i32> {
    inputs
        .iter()
        .map(
            |p| match traffic::read_with(p, ReadOptions { skip_malformed }) {
                Ok(l) => {
                    report_skipped(p, &l.skipped);
                    Ok(l.records)
                }
                Err(e) => Err(fail(&e)),
            },
        )
        .collect()
}

fn merge(m: MergeArgs) -> i32 {
    if !(m.time_scale.is_finite() && m.time_scale > 0.0) {
        return usage_error("--time-scale must be a positive number");
    }
    let traces = match read_all(&m.inputs, m.skip_malformed) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let mut merged = traffic::merge(traces);
    if m.time_scale != 1.0 {
        traffic::scale_time(&mut merged, m.time_scale);
    }
    output(m.output.as_deref(), &merged)
}

fn stats_cmd(s: StatsArgs) -> i32 {
    let traces = match read_all(&s.inputs, s.skip_malformed) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let rows = stats::stats(&traffic::merge(traces));
    match s.format {
        Format::Human => print!("{}", stats::render(&rows)),
        Format::Json => match serde_json::to_string_pretty(&rows) {
            Ok(j) => println!("{j}"),
            Err(e) => return usage_error(&e.to_string()),
        },
    }
    EXIT_OK
}

/// Writes records to `path` (`-` or `None`: standard output).
fn output(path: Option<&Path>, records: &[Record]) -> i32 {
    let res = match path {
        None => write_to(std::io::stdout().lock(), records),
        Some(p) if p == Path::new("-") => write_to(std::io::stdout().lock(), records),
        Some(p) => match std::fs::File::create(p) {
            Ok(f) => write_to(f, records),
            Err(e) => return usage_error(&format!("cannot write {}: {e}", p.display())),
        },
    };
    match res {
        Ok(()) => EXIT_OK,
        Err(e) => usage_error(&format!(
            "cannot write {}: {e}",
            path.map_or("standard output".into(), |p| p.display().to_string())
        )),
    }
}

fn write_to(w: impl Write, records: &[Record]) -> std::io::Result<()> {
    traffic::write(std::io::BufWriter::with_capacity(1 << 16, w), records)
}
