//! `kiln alerts`

use super::*;
use crate::ops::alerts::{self, Options};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Share of each tier's requests that must meet its SLO.
    #[arg(long, default_value = "99%")]
    pub objective: String,
    /// Write the rules here instead of standard output.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Label matchers every expression is scoped to, as PromQL writes
    /// them: `job="kiln",namespace="prod"` (aggregations keep the labels).
    #[arg(long)]
    pub selector: Option<String>,
    /// Where `docs/playbooks.md` is served: runbook links become
    /// `URL/docs/playbooks.md#…` (relative without it).
    #[arg(long)]
    pub runbook_base: Option<String>,
}

/// `--selector`'s matchers (none without it); exits on a bad one.
pub(crate) fn selector(s: Option<&str>) -> Result<Vec<alerts::Matcher>, i32> {
    match s {
        None => Ok(Vec::new()),
        Some(s) => alerts::parse_selector(s).map_err(|e| {
            eprintln!("{:?}", miette::Report::new(e));
            EXIT_USAGE
        }),
    }
}

pub fn run(a: Args) -> i32 {
    let objective = match alerts::parse_objective(&a.objective) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_USAGE;
        }
    };
    let (_, g) = match compile_one(&a.policy) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let selector = match selector(a.selector.as_deref()) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let policy = policy_name(&a.policy);
    let text = alerts::render(
        &g,
        &Options {
            objective,
            policy,
            selector,
            runbook_base: a.runbook_base.clone(),
        },
    );
    match text {
        Ok(text) => write_out(a.output.as_deref(), &text),
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            EXIT_USAGE
        }
    }
}

/// The policy paths as given, for titles and annotations.
pub(crate) fn policy_name(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn write_out(path: Option<&Path>, text: &str) -> i32 {
    match path {
        Some(p) => match std::fs::write(p, text) {
            Ok(()) => EXIT_OK,
            Err(e) => usage_error(&format!("cannot write {}: {e}", p.display())),
        },
        None => {
            print!("{text}");
            EXIT_OK
        }
    }
}
