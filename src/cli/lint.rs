//! `kiln lint`

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LintFormat {
    Human,
    Json,
    Sarif,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Deny {
    Warnings,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Policy files or directories.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = LintFormat::Human)]
    pub format: LintFormat,
    /// `--deny warnings` makes lint findings fail (exit 1).
    #[arg(long, value_enum)]
    pub deny: Option<Deny>,
}

pub fn run(a: Args) -> i32 {
    let compiled = match compile_all(&a.paths) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut failed = false;
    let mut json = Vec::new();
    let mut sarif_runs = Vec::new();
    for (set, c) in &compiled {
        let mut all = c.diagnostics.clone();
        all.extend(crate::compile::lint(c));
        all.extend(crate::compile::build_features(
            c,
            crate::compile::SEMANTIC_CACHE_BUILT,
        ));
        if let Some(g) = &c.graph {
            all.extend(crate::ops::feasibility::lint(g));
        }
        all.sort();
        let errors = all.errors().count();
        let warnings = all.warnings().count();
        failed |= errors > 0 || (a.deny.is_some() && warnings > 0);
        match a.format {
            LintFormat::Human => {
                print_human(&all, &c.sources);
                // Which bounds apply where the policy sets none: notes,
                // never findings.
                for n in crate::compile::lint_notes(c) {
                    println!("note: {n}");
                }
                if errors + warnings == 0 {
                    println!("ok: {} is lint-clean", set.name);
                } else {
                    eprintln!("{}: {}", set.name, summary(errors, warnings));
                }
            }
            LintFormat::Json => json.extend(all.items.iter().map(|d| diag::to_json(d, &c.sources))),
            LintFormat::Sarif => {
                let log = diag::to_sarif(&all.items, &c.sources);
                if let Some(runs) = log.get("runs").and_then(|r| r.as_array()) {
                    sarif_runs.extend(runs.iter().cloned());
                }
            }
        }
    }
    let out = match a.format {
        LintFormat::Human => None,
        LintFormat::Json => Some(serde_json::to_string_pretty(&json)),
        LintFormat::Sarif => {
            let mut log = diag::to_sarif(&[], &SourceMap::new());
            log["runs"] = serde_json::Value::Array(sarif_runs);
            Some(serde_json::to_string_pretty(&log))
        }
    };
    if let Some(out) = out {
        match out {
            Ok(s) => println!("{s}"),
            Err(e) => return usage_error(&e.to_string()),
        }
    }
    if failed {
        EXIT_FINDINGS
    } else {
        EXIT_OK
    }
}
