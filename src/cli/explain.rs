//! `kiln explain`

use super::*;
use crate::graph::{Request, Signals, SignalsInput};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// The request as JSON (see README: "Requests and signals").
    #[arg(long)]
    pub request: PathBuf,
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
    let (c, g) = match compile_one(&a.policy) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let g = &g;
    let req: Request = match read_json(&a.request) {
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
