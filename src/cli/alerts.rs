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
    let policy = policy_name(&a.policy);
    let text = alerts::render(&g, &Options { objective, policy });
    write_out(a.output.as_deref(), &text)
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
