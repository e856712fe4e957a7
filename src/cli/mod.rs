//! clap commands, one file a command.

mod alerts;
mod calibrate;
mod check;
mod dashboard;
mod diff;
pub(crate) mod explain;
mod fmt;
mod gpus;
mod lint;
mod plan;
mod report;
mod serve;
mod simulate;
mod test;
mod traffic;
// Governance: propose, approve, roll out, incident controls, audit.
mod admin_client;
mod approve;
mod audit;
mod batches;
mod keygen;
mod keys;
mod overrides;
mod propose;
mod rollback;
mod status;

use crate::compile::{self, Compiled};
use crate::diag::{self, Diagnostics};
use crate::source::SourceMap;
use clap::{Parser, Subcommand, ValueEnum};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// Exit codes, stable for CI.
pub const EXIT_OK: i32 = 0;
pub const EXIT_FINDINGS: i32 = 1;
pub const EXIT_USAGE: i32 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "kiln",
    version,
    about = "Policy-as-code control plane for GPU capacity in private LLM inference",
    long_about = "kiln compiles GPU scheduling policies written in the kiln language, checks and lints them, formats them, runs their tests and explains decisions; replays recorded traffic through its scheduler on simulated GPUs; and shows what a policy change would do to real traffic before it ships.\n\nExit codes: 0 clean, 1 findings that fail (errors, failing tests, lint findings under --deny warnings, unformatted files under fmt --check), 2 usage or I/O error."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Compile and validate policies; report every error at once.
    Check(check::Args),
    /// Check, then apply judgement rules (shadowed rules, oversubscribed quotas, …).
    Lint(lint::Args),
    /// Rewrite policy files in place in the canonical layout, comments kept
    /// (--check changes nothing and shows the diff).
    Fmt(fmt::Args),
    /// Run the policy tests (*.test.toml beside the policies) and report rule coverage.
    Test(test::Args),
    /// Decide one request and show why, condition by condition.
    Explain(explain::Args),
    /// What a policy change does: semantic diff, and with --traffic, changed
    /// decisions and the simulated impact per tier and tenant.
    Diff(diff::Args),
    /// Replay recorded traffic through the scheduler on simulated GPUs.
    Simulate(simulate::Args),
    /// The workload inventory of recorded traffic: per tenant, model and
    /// (with --policy) tier, token percentiles, demand by hour and weekday,
    /// burstiness and token share; markdown, JSON or a self-contained HTML page.
    Report(report::Args),
    /// The fewest GPUs per pool at which every tier meets its SLOs on
    /// recorded traffic, with headroom, found by replaying it.
    Plan(plan::Args),
    /// Import and combine recorded traffic (Azure, Mooncake, ServeGen traces).
    Traffic(traffic::Args),
    /// Run the gateway: an OpenAI-compatible server that decides, queues and
    /// dispatches every request under the policy, on simulated GPUs or
    /// HTTP upstreams.
    Serve(serve::Args),
    /// Print the SHA-256 of an API key or admin token, as kiln.toml stores it.
    HashKey(serve::HashKeyArgs),
    /// API keys in kiln.toml: list, add (printed once, stored hashed),
    /// revoke, rotate; a running gateway reloads them without a restart.
    Keys(keys::Args),
    /// List the GPUs the CUDA driver sees (name, compute capability, SMs,
    /// memory); with --policy and --pool, check the pool fits them.
    Gpus(gpus::Args),
    /// Measure step times (on a GPU, or the simulator itself), fit the
    /// simulator's roofline to them and write a calibration TOML.
    Calibrate(calibrate::Args),
    /// Make an approver's ed25519 key pair (NAME.key, NAME.pub).
    Keygen(keygen::Args),
    /// Upload a policy to a gateway as a proposal: its semantic diff, dry
    /// run on recent traffic and the approvals it needs.
    Propose(propose::Args),
    /// Sign a proposal's hash with your key: an approval.
    Approve(approve::Args),
    /// A gateway's active version, rollout, open proposals, overrides and
    /// batches.
    Status(status::Args),
    /// A gateway's batches: list, show, cancel.
    Batches(batches::Args),
    /// Abort the rollout in progress, or return to the previous version.
    Rollback(rollback::Args),
    /// Pause a tier or tenant for a while (503 `paused`).
    Pause(overrides::PauseArgs),
    /// Admit only a share of a tier's or tenant's requests for a while.
    Throttle(overrides::ThrottleArgs),
    /// Lift a pause or throttle early.
    Resume(overrides::ResumeArgs),
    /// Verify an audit log's hash chain.
    Audit(audit::Args),
    /// Prometheus alerting rules from the policy's SLOs (multi-window burn
    /// rates, deadline misses, saturation, breakers, rollbacks).
    Alerts(alerts::Args),
    /// A Grafana dashboard for the policy's tiers, tenants and fleet.
    Dashboard(dashboard::Args),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Format {
    #[default]
    Human,
    Json,
}

pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    EXIT_OK
                }
                _ => EXIT_USAGE,
            };
        }
    };
    match cli.command {
        Command::Check(a) => check::run(a),
        Command::Lint(a) => lint::run(a),
        Command::Fmt(a) => fmt::run(a),
        Command::Test(a) => test::run(a),
        Command::Explain(a) => explain::run(a),
        Command::Diff(a) => diff::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Report(a) => report::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Traffic(a) => traffic::run(a),
        Command::Serve(a) => serve::run(a),
        Command::HashKey(a) => serve::hash_key(a),
        Command::Keys(a) => keys::run(a),
        Command::Gpus(a) => gpus::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Keygen(a) => keygen::run(a),
        Command::Propose(a) => propose::run(a),
        Command::Approve(a) => approve::run(a),
        Command::Status(a) => status::run(a),
        Command::Batches(a) => batches::run(a),
        Command::Rollback(a) => rollback::run(a),
        Command::Pause(a) => overrides::pause(a),
        Command::Throttle(a) => overrides::throttle(a),
        Command::Resume(a) => overrides::resume(a),
        Command::Audit(a) => audit::run(a),
        Command::Alerts(a) => alerts::run(a),
        Command::Dashboard(a) => dashboard::run(a),
    }
}

/// One policy: its files, and the test files beside it.
#[derive(Debug, Clone)]
pub struct PolicySet {
    pub name: String,
    pub files: Vec<PathBuf>,
    pub tests: Vec<PathBuf>,
}

fn sorted_entries(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    v.sort();
    Ok(v)
}

fn is_kiln(p: &Path) -> bool {
    p.extension().is_some_and(|x| x == "kiln")
}

fn is_test(p: &Path) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".test.toml"))
}

/// Finds policies: `.kiln` files named together form one policy; a directory
/// holding `.kiln` files is one policy; a directory without any is searched
/// for such directories (so `kiln check policies` checks every policy).
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PolicySet>, String> {
    let mut sets = Vec::new();
    let mut loose = Vec::new();
    for p in paths {
        if p.is_dir() {
            discover_dir(p, &mut sets, 0)
                .map_err(|e| format!("cannot read {}: {e}", p.display()))?;
        } else if p.exists() {
            loose.push(p.clone());
        } else {
            return Err(format!("{}: no such file or directory", p.display()));
        }
    }
    if !loose.is_empty() {
        let mut tests = Vec::new();
        for f in &loose {
            if let (Some(dir), Some(stem)) = (f.parent(), f.file_stem().and_then(|s| s.to_str())) {
                let t = dir.join(format!("{stem}.test.toml"));
                if t.exists() {
                    tests.push(t);
                }
            }
        }
        sets.insert(
            0,
            PolicySet {
                name: loose
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" + "),
                files: loose,
                tests,
            },
        );
    }
    if sets.is_empty() {
        return Err("no .kiln files found".into());
    }
    Ok(sets)
}

fn discover_dir(dir: &Path, sets: &mut Vec<PolicySet>, depth: usize) -> std::io::Result<()> {
    if depth > 8 {
        return Ok(());
    }
    let entries = sorted_entries(dir)?;
    let files: Vec<PathBuf> = entries
        .iter()
        .filter(|p| p.is_file() && is_kiln(p))
        .cloned()
        .collect();
    if !files.is_empty() {
        sets.push(PolicySet {
            name: dir.display().to_string(),
            files,
            tests: entries
                .iter()
                .filter(|p| p.is_file() && is_test(p))
                .cloned()
                .collect(),
        });
        return Ok(());
    }
    for sub in entries.iter().filter(|p| p.is_dir()) {
        discover_dir(sub, sets, depth + 1)?;
    }
    Ok(())
}

/// Discovers and compiles every policy under `paths`. On unusable
/// arguments or unreadable files, reports and returns the exit code.
pub fn compile_all(paths: &[PathBuf]) -> Result<Vec<(PolicySet, Compiled)>, i32> {
    let sets = discover(paths).map_err(|e| usage_error(&e))?;
    sets.into_iter()
        .map(|set| match compile_set(&set) {
            Ok(c) => Ok((set, c)),
            Err(d) => {
                print_human(&d, &SourceMap::new());
                Err(EXIT_USAGE)
            }
        })
        .collect()
}

/// Compiles the one policy `--policy` names into its graph (with the
/// compiled sources, for diagnostics). On failure, reports and returns the
/// exit code.
pub fn compile_one(paths: &[PathBuf]) -> Result<(Compiled, crate::graph::DecisionGraph), i32> {
    let mut compiled = compile_all(paths)?;
    if compiled.len() != 1 {
        return Err(usage_error(
            "--policy must name one policy (a file, files, or one directory)",
        ));
    }
    let Some((_, mut c)) = compiled.pop() else {
        return Err(EXIT_USAGE);
    };
    match c.graph.take() {
        Some(g) => Ok((c, g)),
        None => {
            print_human(&c.diagnostics, &c.sources);
            Err(EXIT_FINDINGS)
        }
    }
}

/// Reads and merges recorded traffic files (sorted by arrival). Malformed
/// lines fail with file and line unless `skip_malformed`, when they are
/// counted on stderr.
pub fn load_traffic(
    paths: &[PathBuf],
    skip_malformed: bool,
) -> Result<Vec<crate::traffic::Record>, i32> {
    load_traffic_clocked(paths, skip_malformed).map(|(records, _)| records)
}

/// [`load_traffic`], and the Unix milliseconds of the first arrival when
/// the traffic was a decision log stamped in wall-clock time (its `at_ms`
/// then count from that arrival).
pub fn load_traffic_clocked(
    paths: &[PathBuf],
    skip_malformed: bool,
) -> Result<(Vec<crate::traffic::Record>, Option<f64>), i32> {
    let mut traces = Vec::new();
    for t in paths {
        let opts = crate::traffic::ReadOptions { skip_malformed };
        match crate::traffic::read_with(t, opts) {
            Ok(l) => {
                if !l.skipped.is_empty() {
                    eprintln!(
                        "{}: skipped {} malformed lines",
                        t.display(),
                        l.skipped.len()
                    );
                }
                traces.push(l.records);
            }
            Err(e) => {
                eprintln!("{:?}", miette::Report::new(e));
                return Err(EXIT_FINDINGS);
            }
        }
    }
    let mut all = crate::traffic::merge(traces);
    // A gateway decision log is stamped in wall-clock time.
    let start = crate::traffic::rebase_wall_clock(&mut all);
    Ok((all, start))
}

/// The simulator's cost model for a policy, with an optional calibration.
pub fn cost_model(
    g: &crate::graph::DecisionGraph,
    calibration: Option<&PathBuf>,
) -> Result<crate::backend::cost::CostModel, i32> {
    let cal = match calibration {
        Some(p) => match crate::backend::cost::Calibration::load(p) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("{:?}", miette::Report::new(e));
                return Err(EXIT_FINDINGS);
            }
        },
        None => None,
    };
    let cost = crate::backend::cost::CostModel::from_graph(g, cal.as_ref()).map_err(|e| {
        eprintln!("{:?}", miette::Report::new(e));
        EXIT_FINDINGS
    })?;
    for w in &cost.warnings {
        eprintln!("warning: {w}");
    }
    Ok(cost)
}

/// Loads and compiles one policy set.
pub fn compile_set(set: &PolicySet) -> Result<Compiled, Diagnostics> {
    let sources = compile::load(&set.files)?;
    Ok(compile::compile(sources))
}

pub fn color() -> bool {
    std::env::var_os("NO_COLOR").is_none() && std::io::stderr().is_terminal()
}

/// Prints diagnostics for humans on stderr.
pub fn print_human(diags: &Diagnostics, sources: &SourceMap) {
    let color = color();
    for d in &diags.items {
        eprint!("{}", diag::render(d, sources, color));
    }
}

pub fn print_json(diags: &Diagnostics, sources: &SourceMap) {
    let v: Vec<_> = diags
        .items
        .iter()
        .map(|d| diag::to_json(d, sources))
        .collect();
    match serde_json::to_string_pretty(&v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: {e}"),
    }
}

pub fn summary(errors: usize, warnings: usize) -> String {
    let plural = |n: usize, w: &str| {
        if n == 1 {
            format!("1 {w}")
        } else {
            format!("{n} {w}s")
        }
    };
    format!(
        "{}, {}",
        plural(errors, "error"),
        plural(warnings, "warning")
    )
}

pub fn usage_error(msg: &str) -> i32 {
    eprintln!("error: {msg}");
    EXIT_USAGE
}
