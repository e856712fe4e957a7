//! `kiln dashboard`

use super::alerts::{policy_name, selector, write_out};
use super::*;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Write the dashboard JSON here instead of standard output.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Label matchers every query is scoped to, as PromQL writes them:
    /// `job="kiln",namespace="prod"`; each `=` matcher is a dashboard
    /// variable (its value the default).
    #[arg(long)]
    pub selector: Option<String>,
}

pub fn run(a: Args) -> i32 {
    let (_, g) = match compile_one(&a.policy) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let selector = match selector(a.selector.as_deref()) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let d = crate::ops::dashboard::scoped(&g, &policy_name(&a.policy), &selector);
    match serde_json::to_string_pretty(&d) {
        Ok(s) => write_out(a.output.as_deref(), &(s + "\n")),
        Err(e) => usage_error(&e.to_string()),
    }
}
