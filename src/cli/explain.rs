//! `kiln explain`

use super::*;
use crate::graph::{trace::Trace, DecisionGraph, DecisionView, Request, Signals, SignalsInput};

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
        Format::Human => print!("{}", render(g, &c.sources, &req, &view, &trace)),
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

/// The human explanation.
pub fn render(
    g: &DecisionGraph,
    sources: &SourceMap,
    req: &Request,
    v: &DecisionView,
    t: &Trace,
) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "request: tenant={} model={} prompt_tokens={} max_tokens={}",
        req.tenant
            .as_deref()
            .or(req.api_key.as_deref())
            .unwrap_or("(none)"),
        req.model,
        req.prompt_tokens,
        req.max_tokens
    ));
    for (k, val) in &req.headers {
        s.push_str(&format!(" {k}={val}"));
    }
    s.push('\n');
    for st in &t.stages {
        s.push_str(&format!("\n{}  [{}]\n", st.stage, st.block));
        for r in &st.rules {
            let info = g.rules.get(r.rule as usize);
            let (text, at) = match info {
                Some(i) => (i.text.clone(), sources.describe(i.span)),
                None => ("?".into(), String::new()),
            };
            let mark = if r.matched { "✓" } else { "✗" };
            s.push_str(&format!(
                "  {mark} #{} {text}   ({at})\n",
                info.map(|i| i.index).unwrap_or(0)
            ));
            for tt in &r.tests {
                s.push_str(&format!(
                    "      {} {:<40} saw {}\n",
                    if tt.result { "true " } else { "false" },
                    tt.condition,
                    tt.observed
                ));
            }
        }
        for n in &st.notes {
            s.push_str(&format!("  · {n}\n"));
        }
    }
    s.push_str("\ndecision: ");
    let mut parts = vec![];
    if let Some(tn) = &v.tenant {
        parts.push(format!("tenant {tn}"));
    }
    parts.push(format!("tier {}", v.tier));
    if let Some(r) = &v.route {
        parts.push(format!("route {r}"));
    }
    let mut adm = v.admission.clone();
    if let Some(w) = v.max_wait_ms {
        adm.push_str(&format!(
            " (max wait {})",
            crate::compile::units::show(crate::compile::units::Ty::Duration, w)
        ));
    }
    if let Some(u) = &v.delay_until {
        adm.push_str(&format!(" until {u}"));
    }
    if let Some(st) = v.status {
        adm.push_str(&format!(" {st} \"{}\"", v.message.as_deref().unwrap_or("")));
        if let Some(ra) = v.retry_after_ms {
            adm.push_str(&format!(
                " retry after {}",
                crate::compile::units::show(crate::compile::units::Ty::Duration, ra)
            ));
        }
    }
    parts.push(adm);
    if let Some(fs) = v.fallback_step {
        parts.push(format!("fallback step {fs}"));
    }
    s.push_str(&parts.join(" · "));
    s.push('\n');
    s
}
