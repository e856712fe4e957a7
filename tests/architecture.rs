//! Dependencies between kiln's top-level modules point one way: down the
//! layers of `ARCHITECTURE.md`. This test reads `src/` and refuses any
//! `crate::` path from a module to one in its own or a higher layer, so a
//! cycle, the graph reaching back into the compiler or the parser, or the
//! server calling into the CLI fails CI instead of creeping in. Test code
//! (`#[cfg(test)]` modules) may reach anywhere.
//!
//! Inside the gateway (`src/server/`) it also refuses cycles between the
//! files of one module (a folder's files and subfolders, each one node;
//! what a module's `mod.rs` defines is the module's own and may be used by
//! all of them), and any file over [`MAX_SERVER_FILE_LINES`] lines: a
//! request's path through the gateway stays one you can follow down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layer of each top-level module, lowest first; a module may depend only
/// on modules in lower layers. Keep in step with ARCHITECTURE.md.
const LAYERS: &[&[&str]] = &[
    // Values and text: units and quantities, source files, wall time;
    // outbound TLS settings (rustls client configurations); plain-text
    // tables and SVG charts (they depend on no other module).
    &["units", "source", "clock", "tls", "table", "chart"],
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

/// The longest a file of `src/server/` may be.
const MAX_SERVER_FILE_LINES: usize = 1500;

/// Product files of `src/` (test-only modules left out), with their
/// module paths (`server/request/mod.rs` is `["server", "request"]`) and
/// product code.
fn product_files() -> Vec<(PathBuf, Vec<String>, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
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
    let mut out = Vec::new();
    for f in files {
        if test_files.contains(&f) {
            continue;
        }
        let rel = f.strip_prefix(&src).unwrap().with_extension("");
        let mut path: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().to_string())
            .collect();
        if path.last().is_some_and(|l| l == "mod") {
            path.pop();
        }
        let code = product_code(&std::fs::read_to_string(&f).unwrap());
        out.push((f, path, code));
    }
    out
}

/// Leading identifiers of a path (`a::b::c` of `a::b::c::{d, e}`), and
/// what follows them.
fn chain(s: &str) -> (Vec<String>, &str) {
    let mut out = Vec::new();
    let mut rest = s;
    loop {
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            break;
        }
        rest = &rest[name.len()..];
        out.push(name);
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => break,
        }
    }
    (out, rest)
}

/// The paths `tail` names under `base`: one path, or each item of a
/// `{…}` group (nested groups included).
fn paths_under(base: &[String], tail: &str, out: &mut BTreeSet<Vec<String>>) {
    let (c, rest) = chain(tail);
    let base = [base.to_vec(), c].concat();
    let Some(group) = rest.strip_prefix('{') else {
        if !base.is_empty() {
            out.insert(base);
        }
        return;
    };
    let mut depth = 0;
    let mut item = String::new();
    for ch in group.chars() {
        match ch {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                item_paths(&base, &item, out);
                item.clear();
                continue;
            }
            _ => {}
        }
        item.push(ch);
    }
    item_paths(&base, &item, out);
}

fn item_paths(base: &[String], item: &str, out: &mut BTreeSet<Vec<String>>) {
    let item = item.trim();
    if item.is_empty() || item == "self" || item.starts_with("self ") || item == "*" {
        return;
    }
    paths_under(base, item, out);
}

/// Absolute module paths (from the crate root) named by `crate::`,
/// `super::` and `self::` paths in the code of module `me`, including
/// each item of a `{…}` group.
fn module_refs(code: &str, me: &[String]) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let starts = ["crate::", "super::", "self::"]
            .iter()
            .any(|p| rest.starts_with(p));
        let before = code[..i].chars().last();
        // Only the head of a path: not `x::super::`, not `my_crate::`.
        if !starts || before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let mut base: Vec<String>;
        let mut tail = rest;
        if let Some(t) = tail.strip_prefix("crate::") {
            base = Vec::new();
            tail = t;
        } else if let Some(t) = tail.strip_prefix("self::") {
            base = me.to_vec();
            tail = t;
        } else {
            base = me.to_vec();
            while let Some(t) = tail.strip_prefix("super::") {
                base.pop();
                tail = t;
            }
        }
        paths_under(&base, tail, &mut out);
        i += rest.len() - tail.len();
    }
    out
}

/// The files of module `module` (a folder under `src/`) as nodes (a file
/// or a subfolder), and which names which, with a file that does.
fn sibling_edges(module: &[&str]) -> BTreeMap<String, BTreeMap<String, String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let dir = module.iter().fold(src.clone(), |d, m| d.join(m));
    let mut nodes = BTreeSet::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if p.is_dir() || (p.extension().is_some_and(|x| x == "rs") && name != "mod") {
            nodes.insert(name);
        }
    }
    let depth = module.len();
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (f, path, code) in product_files() {
        if path.len() <= depth || path[..depth] != *module {
            continue; // outside the module, or its mod.rs
        }
        let from = &path[depth];
        for r in module_refs(&code, &path) {
            if r.len() <= depth || r[..depth] != *module {
                continue;
            }
            let to = &r[depth];
            if to != from && nodes.contains(to) {
                let file = f.strip_prefix(&src).unwrap().display().to_string();
                out.entry(from.clone())
                    .or_default()
                    .entry(to.clone())
                    .or_insert(file);
            }
        }
    }
    out
}

/// Every cycle's nodes (one strongly connected component of more than one
/// node each), by Tarjan's algorithm.
fn cycles(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        out: Vec<Vec<String>>,
    }
    fn visit(t: &mut T, v: &str) {
        let i = t.index.len();
        t.index.insert(v.to_string(), i);
        t.low.insert(v.to_string(), i);
        t.stack.push(v.to_string());
        t.on.insert(v.to_string());
        let next: Vec<String> = t
            .edges
            .get(v)
            .map_or_else(Vec::new, |m| m.keys().cloned().collect());
        for w in next {
            if !t.index.contains_key(&w) {
                visit(t, &w);
                let lw = t.low[&w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(&w) {
                let iw = t.index[&w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(&w);
                let done = w == v;
                scc.push(w);
                if done {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: Vec<String> = edges.keys().cloned().collect();
    for v in nodes {
        if !t.index.contains_key(&v) {
            visit(&mut t, &v);
        }
    }
    t.out
}

/// The modules of `src/server/` (itself and every folder under it).
fn server_modules() -> Vec<Vec<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = vec![vec!["server".to_string()]];
    let mut i = 0;
    while i < out.len() {
        let dir = out[i].iter().fold(src.clone(), |d, m| d.join(m));
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                let mut m = out[i].clone();
                m.push(p.file_name().unwrap().to_string_lossy().to_string());
                out.push(m);
            }
        }
        i += 1;
    }
    out
}

#[test]
fn no_cycles_between_the_files_of_a_server_module() {
    let mut found = Vec::new();
    for m in server_modules() {
        let m: Vec<&str> = m.iter().map(String::as_str).collect();
        let e = sibling_edges(&m);
        for c in cycles(&e) {
            let through: Vec<String> = c
                .iter()
                .flat_map(|a| {
                    e[a].iter()
                        .filter(|(b, _)| c.contains(b))
                        .map(move |(b, f)| format!("{a} → {b} ({f})"))
                })
                .collect();
            found.push(format!("{}: {}", m.join("/"), through.join(", ")));
        }
    }
    assert!(
        found.is_empty(),
        "cycles between files of one module:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn no_server_file_is_over_the_bound() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src.join("server"), &mut files);
    let mut long = Vec::new();
    for f in files {
        let n = std::fs::read_to_string(&f).unwrap().lines().count();
        if n > MAX_SERVER_FILE_LINES {
            long.push(format!(
                "{} ({n} lines)",
                f.strip_prefix(&src).unwrap().display()
            ));
        }
    }
    assert!(
        long.is_empty(),
        "files of src/server/ over {MAX_SERVER_FILE_LINES} lines (split them by what they do): {long:?}"
    );
}

#[test]
fn the_reader_sees_the_known_file_edges() {
    let me: Vec<String> = ["server", "request", "pipeline"].map(String::from).into();
    let refs = module_refs(
        "use super::recorder::x;\nuse super::super::fleet::Gate;\nuse crate::server::{App, cache::y};\nlet z = self::inner::f();",
        &me,
    );
    let want: BTreeSet<Vec<String>> = [
        vec!["server", "request", "recorder", "x"],
        vec!["server", "fleet", "Gate"],
        vec!["server", "App"],
        vec!["server", "cache", "y"],
        vec!["server", "request", "pipeline", "inner", "f"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect();
    assert_eq!(refs, want);
    let server = sibling_edges(&["server"]);
    assert!(server["routes"].contains_key("request"));
    assert!(server["request"].contains_key("executor"));
    let request = sibling_edges(&["server", "request"]);
    assert!(request["pipeline"].contains_key("recorder"));
    let e: BTreeMap<String, BTreeMap<String, String>> =
        [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
            .into_iter()
            .fold(BTreeMap::new(), |mut m, (a, b)| {
                m.entry(a.to_string())
                    .or_insert_with(BTreeMap::new)
                    .insert(b.to_string(), String::new());
                m
            });
    assert_eq!(
        cycles(&e),
        vec![vec!["a", "b", "c"]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()]
    );
}
