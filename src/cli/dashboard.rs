//! `kiln dashboard`

use super::alerts::{policy_name, write_out};
use super::*;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Write the dashboard JSON here instead of standard output.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
}

pub fn run(a: Args) -> i32 {
    let (_, g) = match compile_one(&a.policy) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let d = crate::ops::dashboard::dashboard(&g, &policy_name(&a.policy));
    match serde_json::to_string_pretty(&d) {
        Ok(s) => write_out(a.output.as_deref(), &(s + "\n")),
        Err(e) => usage_error(&e.to_string()),
    }
}
