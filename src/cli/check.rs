//! `kiln check`

use super::*;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Policy files or directories.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

pub fn run(a: Args) -> i32 {
    let compiled = match compile_all(&a.paths) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut failed = false;
    let mut all_json = Vec::new();
    for (set, c) in &compiled {
        // What the policy asks of this binary (a semantic cache on a build
        // without it) is an error here, not first at `kiln serve`.
        let mut diagnostics = c.diagnostics.clone();
        diagnostics.extend(crate::compile::build_features(
            c,
            crate::compile::SEMANTIC_CACHE_BUILT,
        ));
        diagnostics.sort();
        let errors = diagnostics.errors().count();
        match a.format {
            Format::Human => {
                print_human(&diagnostics, &c.sources);
                if errors == 0 {
                    let g = c.graph.as_ref();
                    println!(
                        "ok: {} ({} files, {} tiers, {} tenants, {} rules)",
                        set.name,
                        set.files.len(),
                        g.map_or(0, |g| g.tiers.len()),
                        g.map_or(0, |g| g.tenants.len()),
                        g.map_or(0, |g| g.rules.len())
                    );
                } else {
                    eprintln!("{}: {}", set.name, summary(errors, 0));
                }
            }
            Format::Json => {
                all_json.extend(
                    diagnostics
                        .items
                        .iter()
                        .map(|d| diag::to_json(d, &c.sources)),
                );
            }
        }
        failed |= errors > 0;
    }
    if a.format == Format::Json {
        match serde_json::to_string_pretty(&all_json) {
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
