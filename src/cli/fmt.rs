//! `kiln fmt`

use super::*;
use crate::lang;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Files or directories (searched recursively for .kiln files).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Change nothing; list files that are not formatted (exit 1 if any).
    #[arg(long)]
    pub check: bool,
}

fn collect(p: &Path, out: &mut Vec<PathBuf>, depth: usize) -> std::io::Result<()> {
    if p.is_dir() {
        if depth > 8 {
            return Ok(());
        }
        for e in sorted_entries(p)? {
            if e.is_dir() || is_kiln(&e) {
                collect(&e, out, depth + 1)?;
            }
        }
    } else {
        out.push(p.to_path_buf());
    }
    Ok(())
}

/// Formats policy text; `None` with the diagnostic when it does not parse.
pub fn format_text(name: &str, text: &str) -> Result<String, (SourceMap, Diagnostics)> {
    let mut sources = SourceMap::new();
    let id = sources.add(name, text.to_string());
    match lang::parse(id, text) {
        Ok(file) => Ok(lang::format::format_file(&file, text)),
        Err(d) => {
            let mut ds = Diagnostics::new();
            ds.push(*d);
            Err((sources, ds))
        }
    }
}

pub fn run(a: Args) -> i32 {
    let mut files = Vec::new();
    for p in &a.paths {
        if !p.exists() {
            return usage_error(&format!("{}: no such file or directory", p.display()));
        }
        if let Err(e) = collect(p, &mut files, 0) {
            return usage_error(&format!("cannot read {}: {e}", p.display()));
        }
    }
    let mut findings = false;
    for f in &files {
        let text = match std::fs::read_to_string(f) {
            Ok(t) => t,
            Err(e) => return usage_error(&format!("cannot read {}: {e}", f.display())),
        };
        let name = f.display().to_string();
        match format_text(&name, &text) {
            Ok(out) => {
                if out == text {
                    continue;
                }
                if a.check {
                    findings = true;
                    println!("{name}: not formatted");
                    let diff = similar::TextDiff::from_lines(&text, &out);
                    print!(
                        "{}",
                        diff.unified_diff()
                            .context_radius(2)
                            .header(&name, &format!("{name} (formatted)"))
                    );
                } else if let Err(e) = std::fs::write(f, out) {
                    return usage_error(&format!("cannot write {}: {e}", f.display()));
                } else {
                    println!("formatted {name}");
                }
            }
            Err((sources, d)) => {
                findings = true;
                print_human(&d, &sources);
            }
        }
    }
    if findings {
        EXIT_FINDINGS
    } else {
        EXIT_OK
    }
}
