//! Dependencies between kiln's top-level modules point one way: down the
//! layers of `ARCHITECTURE.md`. This test reads `src/` and refuses any
//! `crate::` path from a module to one in its own or a higher layer, so a
//! cycle, the graph reaching back into the compiler or the parser, or the
//! server calling into the CLI fails CI instead of creeping in. Test code
//! (`#[cfg(test)]` modules) may reach anywhere.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layer of each top-level module, lowest first; a module may depend only
/// on modules in lower layers. Keep in step with ARCHITECTURE.md.
const LAYERS: &[&[&str]] = &[
    // Values and text: units and quantities, source files, wall time;
    // outbound TLS settings (rustls client configurations).
    &["units", "source", "clock", "tls"],
    // Diagnostics; the language (text → AST).
    &["diag"],
    &["lang"],
    // The decision graph: what a compiled policy is, and deciding with it;
    // the semantic cache's engine (it depends on no other module, and the
    // scheduler keeps the tiers' semantic caches).
    &["graph", "embed"],
    // What reads or produces graphs: the compiler, the scheduler core,
    // recorded traffic, policy tests.
    &[
        "compile",
        "sched",
        "traffic",
        "policy_test",
        "batch",
        "shared",
    ],
    // The driver (the one interpreter of scheduler actions); backends.
    &["driver", "backend"],
    // The replay.
    &["replay"],
    // Semantic and traffic diffs.
    &["diff"],
    // Governance: proposals, approvals, rollouts, audit; operating (ops).
    &["governance", "ops"],
    // The gateway.
    &["server"],
    // The command line.
    &["cli"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Names of modules declared `#[cfg(test)] mod name;` in `text`: their
/// files are test code.
fn test_only_modules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cfg_test = false;
    for line in text.lines() {
        let l = line.trim();
        if l == "#[cfg(test)]" {
            cfg_test = true;
            continue;
        }
        if cfg_test {
            if let Some(name) = l.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                out.push(name.trim().to_string());
            }
        }
        if !l.starts_with("#[") {
            cfg_test = false;
        }
    }
    out
}

/// The text without comments and without inline `#[cfg(test)] mod … { … }`
/// blocks.
fn product_code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let l = line.trim();
        if l == "#[cfg(test)]" {
            if let Some(next) = lines.peek() {
                let n = next.trim();
                if n.starts_with("mod ") && n.ends_with('{') {
                    // Skip to the matching closing brace.
                    let mut depth = 0i32;
                    for body in lines.by_ref() {
                        depth += body.matches('{').count() as i32;
                        depth -= body.matches('}').count() as i32;
                        if depth <= 0 {
                            break;
                        }
                    }
                    continue;
                }
            }
        }
        let code = match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// Top-level modules named by `crate::` paths, including inside
/// `crate::{a, b::c}` groups.
fn crate_refs(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `kiln_crate::`, not ours
        }
        if let Some(group) = rest.strip_prefix('{') {
            // The first name of each top-level item of the group.
            let mut depth = 0;
            let mut item_start = true;
            let mut name = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && (c.is_alphanumeric() || c == '_') => name.push(c),
                    _ if item_start && !name.is_empty() => {
                        if name != "self" {
                            out.insert(std::mem::take(&mut name));
                        }
                        name.clear();
                        item_start = false;
                    }
                    _ => {}
                }
            }
            if item_start && !name.is_empty() && name != "self" {
                out.insert(name);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// Module → (module it names → files that name it), from product code.
fn edges() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // Files of `#[cfg(test)] mod x;` declarations, by their path.
    let mut test_files = BTreeSet::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let dir = match f.file_name().and_then(|n| n.to_str()) {
            Some("mod.rs") | Some("lib.rs") | Some("main.rs") => f.parent().unwrap().to_path_buf(),
            _ => f.with_extension(""),
        };
        for m in test_only_modules(&text) {
            test_files.insert(dir.join(format!("{m}.rs")));
            test_files.insert(dir.join(&m).join("mod.rs"));
        }
    }
    let mut out: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for f in &files {
        if test_files.contains(f) {
            continue;
        }
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let code = product_code(&std::fs::read_to_string(f).unwrap());
        for r in crate_refs(&code) {
            // `crate::ast` is the re-export of `lang::ast`.
            let r = if r == "ast" { "lang".to_string() } else { r };
            if r != top {
                out.entry(top.clone())
                    .or_default()
                    .entry(r)
                    .or_default()
                    .insert(rel.display().to_string());
            }
        }
    }
    out
}

#[test]
fn every_module_has_a_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let mut missing = Vec::new();
    for line in lib.lines() {
        if let Some(m) = line
            .trim()
            .strip_prefix("pub mod ")
            .and_then(|r| r.strip_suffix(';'))
        {
            if layer_of(m).is_none() {
                missing.push(m.to_string());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "modules without a layer in tests/architecture.rs and ARCHITECTURE.md: {missing:?}"
    );
}

#[test]
fn dependencies_point_down_the_layers() {
    let mut wrong = Vec::new();
    for (from, to) in edges() {
        let Some(lf) = layer_of(&from) else { continue };
        for (m, files) in to {
            match layer_of(&m) {
                Some(lt) if lt < lf => {}
                Some(_) => wrong.push(format!(
                    "{from} → {m} (from {})",
                    files.into_iter().collect::<Vec<_>>().join(", ")
                )),
                None => {} // not a top-level module (a re-export, a macro)
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "dependencies against the layers:\n  {}",
        wrong.join("\n  ")
    );
}

#[test]
fn the_reader_sees_the_known_edges() {
    // The check above is only as good as its reading of the code: make
    // sure it finds edges that exist.
    let e = edges();
    assert!(e["compile"].contains_key("graph"));
    assert!(e["server"].contains_key("driver"));
    assert!(e["replay"].contains_key("driver"));
    assert!(e["cli"].contains_key("server"));
    assert!(!e["graph"].contains_key("compile"));
    assert!(!e["graph"].contains_key("lang"));
    assert!(!e["server"].contains_key("cli"));
    assert_eq!(
        crate_refs("use crate::{graph::X, sched::{a, b}};\nlet x = crate::units::Ty;"),
        ["graph", "sched", "units"].map(String::from).into()
    );
}
