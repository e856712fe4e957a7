//! `kiln test`

use super::*;
use crate::policy_test::{self, Case};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Policy files or directories; tests are the *.test.toml files beside them.
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
    let mut reports = Vec::new();
    for (set, c) in &compiled {
        let Some(g) = &c.graph else {
            print_human(&c.diagnostics, &c.sources);
            eprintln!("{}: does not compile; no test ran", set.name);
            failed = true;
            continue;
        };
        let mut cases: Vec<Case> = Vec::new();
        for t in &set.tests {
            let text = match std::fs::read_to_string(t) {
                Ok(x) => x,
                Err(e) => return usage_error(&format!("cannot read {}: {e}", t.display())),
            };
            match policy_test::parse_file(&text) {
                Ok(f) => cases.extend(f.cases),
                Err(e) => {
                    eprintln!("error: {}: {e}", t.display());
                    return EXIT_USAGE;
                }
            }
        }
        if cases.is_empty() {
            eprintln!(
                "{}: no test cases (add a *.test.toml beside the policy)",
                set.name
            );
            failed = true;
        }
        let report = policy_test::run(g, &cases);
        failed |= report.failed() > 0;
        match a.format {
            Format::Human => print_report(&set.name, &report),
            Format::Json => {
                reports.push(serde_json::json!({ "policy": set.name, "report": report }))
            }
        }
    }
    if a.format == Format::Json {
        match serde_json::to_string_pretty(&reports) {
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

pub fn render_report(name: &str, r: &policy_test::Report) -> String {
    let mut s = String::new();
    s.push_str(&format!("{name}\n"));
    for c in &r.cases {
        if c.passed {
            s.push_str(&format!("  pass  {}\n", c.name));
            continue;
        }
        s.push_str(&format!("  FAIL  {}\n", c.name));
        if let Some(e) = &c.error {
            s.push_str(&format!("        error: {e}\n"));
        }
        for m in &c.mismatches {
            s.push_str(&format!(
                "        {}: expected {}, got {}\n",
                m.field, m.expected, m.actual
            ));
        }
    }
    s.push_str(&format!(
        "  {} passed, {} failed; rule coverage {:.0}% ({} of {} rules fired)\n",
        r.passed(),
        r.failed(),
        r.coverage_percent(),
        r.rules_total - r.uncovered.len(),
        r.rules_total
    ));
    if !r.uncovered.is_empty() {
        s.push_str("  rules no test exercised:\n");
        for u in &r.uncovered {
            s.push_str(&format!("    {u}\n"));
        }
    }
    s
}

fn print_report(name: &str, r: &policy_test::Report) {
    print!("{}", render_report(name, r));
}
