//! Every fenced block in README.md and docs/*.md runs as written, so a
//! newcomer who copies and pastes one gets what the text says.
//!
//! A marker on the line just before a block says how it is checked:
//!
//! - `<!-- not-run: REASON -->`: not run (a Kubernetes cluster, a GPU, a
//!   production log…); the reason is required.
//! - `<!-- fragment: REASON -->` (kiln blocks): a part of a policy; it
//!   must parse, not compile.
//! - `<!-- expect-error: REASON -->` (kiln blocks): wrong on purpose; it
//!   must fail to compile.
//! - `<!-- gateway: ARGS -->` (sh and python blocks): a gateway started
//!   as `kiln serve ARGS` answers on the address the block uses.
//! - `<!-- traces: REASON -->` (sh blocks): reads the public traces from
//!   `traces/` (docs/traffic.md says how to fetch them); run where the
//!   repository's copy, `../shared/traces`, exists, linked as `traces/`.
//!
//! Without a marker: `kiln` blocks compile without errors; `sh` blocks
//! run with bash (`-e`, `-o pipefail`), `kiln` and `cargo run --` being
//! the debug build, in a scratch copy of the repository (one per file,
//! blocks in order, so a block may use what an earlier one wrote);
//! `localhost:8080` is a free loopback port, and `kiln serve` without
//! `--listen` listens there; `curl` fails on an HTTP error. A block that rewrites a file the repository
//! ships (a generated report, the alert rules) must reproduce it byte
//! for byte. `toml` blocks holding `[[case]]`s run as `kiln test` against
//! README's policy; other `toml` and `json` blocks must parse. `python`
//! blocks run where the `openai` package is installed (`KILN_DOC_PYTHON`,
//! CI's `target/pyvenv`, or `python3`).
//! `text` and `promql` blocks are shown, not run. A block without a
//! language is an error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one block may run.
const BLOCK_LIMIT: Duration = Duration::from_secs(120);

/// Directories a block may read or write, copied into the scratch copy.
const COPIED: &[&str] = &["policies", "examples", "deploy", "docs", "tests/fixtures"];

#[derive(Debug, Clone, PartialEq)]
enum Marker {
    None,
    NotRun(String),
    Fragment(String),
    ExpectError(String),
    Gateway(String),
    Traces(String),
}

#[derive(Debug, Clone)]
struct Block {
    file: String,
    line: usize,
    lang: String,
    text: String,
    marker: Marker,
}

impl Block {
    fn at(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn marker(line: &str) -> Option<Marker> {
    let inner = line
        .trim()
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim();
    let (key, value) = inner.split_once(':')?;
    let value = value.trim().to_string();
    let m = match key.trim() {
        "not-run" => Marker::NotRun(value),
        "fragment" => Marker::Fragment(value),
        "expect-error" => Marker::ExpectError(value),
        "gateway" => Marker::Gateway(value),
        "traces" => Marker::Traces(value),
        _ => return None,
    };
    Some(m)
}

/// The fenced blocks of one markdown file.
fn blocks(file: &str, text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].strip_prefix("```") else {
            i += 1;
            continue;
        };
        let prev = (0..i)
            .rev()
            .map(|j| lines[j])
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        let start = i;
        let mut body = String::new();
        i += 1;
        while i < lines.len() && !lines[i].starts_with("```") {
            body.push_str(lines[i]);
            body.push('\n');
            i += 1;
        }
        assert!(
            i < lines.len(),
            "{file}:{}: the block never ends",
            start + 1
        );
        out.push(Block {
            file: file.to_string(),
            line: start + 1,
            lang: info.split_whitespace().next().unwrap_or("").to_string(),
            text: body,
            marker: marker(prev).unwrap_or(Marker::None),
        });
        i += 1;
    }
    out
}

fn documents() -> Vec<(String, String)> {
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(root().join(&f)).unwrap();
            (f, text)
        })
        .collect()
}

/// README's "A policy" block: what its policy tests run against.
fn readme_policy() -> String {
    let text = std::fs::read_to_string(root().join("README.md")).unwrap();
    let at = text
        .find("\n## A policy\n")
        .expect("README has `## A policy`");
    let b = blocks("README.md", &text[at..]);
    b.into_iter()
        .find(|b| b.lang == "kiln")
        .expect("a kiln block follows it")
        .text
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let ty = e.file_type().unwrap();
        let dest = to.join(e.file_name());
        if ty.is_dir() {
            copy_dir(&e.path(), &dest);
        } else if ty.is_file() {
            std::fs::copy(e.path(), &dest).unwrap();
        }
    }
}

/// Every file under `dir`, relative to it.
fn files_under(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir.join(rel)) else {
        return;
    };
    for e in rd {
        let e = e.unwrap();
        let r = rel.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            files_under(dir, &r, out);
        } else {
            out.push(r);
        }
    }
}

struct Scratch {
    dir: PathBuf,
    bin: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "kiln-doc-blocks-{}-{}",
            std::process::id(),
            name.replace('/', "-")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for d in COPIED {
            copy_dir(&root().join(d), &dir.join(d));
        }
        let traces = root().join("../shared/traces");
        if traces.is_dir() {
            std::os::unix::fs::symlink(&traces, dir.join("traces")).unwrap();
        }
        let bin = dir.join(".bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kiln"), bin.join("kiln")).unwrap();
        Scratch { dir, bin }
    }

    /// Shipped files the blocks rewrote differently.
    fn changed_shipped_files(&self) -> Vec<String> {
        let mut changed = Vec::new();
        for d in COPIED {
            let mut files = Vec::new();
            files_under(&self.dir, Path::new(d), &mut files);
            for f in files {
                let shipped = root().join(&f);
                let Ok(want) = std::fs::read(&shipped) else {
                    continue;
                };
                if std::fs::read(self.dir.join(&f)).unwrap() != want {
                    changed.push(f.display().to_string());
                }
            }
        }
        changed
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A process group the test ends, whatever the block left running.
struct Group(u32);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg("--")
            .arg(format!("-{}", self.0))
            .stderr(Stdio::null())
            .status();
    }
}

struct Ran {
    ok: bool,
    output: String,
}

/// Runs `program args` in `dir` with a time limit; output goes to files
/// so a server the script leaves in the background cannot hold a pipe.
fn run_limited(s: &Scratch, port: u16, program: &str, args: &[&str], tag: &str) -> Ran {
    let out = s.dir.join(format!(".out-{tag}"));
    let path = format!(
        "{}:{}",
        s.bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new(program)
        .args(args)
        .current_dir(&s.dir)
        .env("PATH", path)
        .env("KILN_SERVER", format!("http://127.0.0.1:{port}"))
        .env_remove("KILN_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&out).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let _group = Group(child.id());
    let start = Instant::now();
    let ok = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.success();
        }
        if start.elapsed() > BLOCK_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    Ran { ok, output }
}

/// The shell a block runs in: `kiln` is the debug build, `cargo run --`
/// is `kiln`, `kiln serve` listens on `port`, and `curl` fails on an HTTP
/// error (a block that shows a 404 page is broken).
fn prelude(port: u16) -> String {
    format!(
        r#"set -eo pipefail
kiln() {{
  if [ "$1" = serve ] && ! printf '%s\n' "$@" | grep -q -- '^--listen'; then
    command kiln "$@" --listen 127.0.0.1:{port}
  else
    command kiln "$@"
  fi
}}
curl() {{
  case " $* " in
    *" -f"* | *" -sf"* | *" --fail"*) command curl "$@" ;;
    *) command curl --fail-with-body "$@" ;;
  esac
}}
cargo() {{
  if [ "$1" = run ] && [ "$2" = -- ]; then shift 2; kiln "$@"; else echo "doc_blocks: only 'cargo run --' runs here" >&2; return 1; fi
}}
"#
    )
}

fn rewrite_address(text: &str, port: u16) -> String {
    let here = format!("127.0.0.1:{port}");
    text.replace("localhost:8080", &here)
        .replace("127.0.0.1:8080", &here)
}

/// Starts `kiln serve ARGS` on `port` and waits until it answers.
fn start_gateway(s: &Scratch, port: u16, args: &str, tag: &str) -> (Group, std::process::Child) {
    let mut argv: Vec<String> = vec!["serve".into()];
    argv.extend(args.split_whitespace().map(str::to_string));
    argv.push("--listen".into());
    argv.push(format!("127.0.0.1:{port}"));
    let log = s.dir.join(format!(".gateway-{tag}"));
    let child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(&argv)
        .current_dir(&s.dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let group = Group(child.id());
    let start = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "kiln serve {args} did not listen: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (group, child)
}

/// A Python with the `openai` package: `KILN_DOC_PYTHON`, CI's venv
/// (`target/pyvenv`), or `python3`; none if it lacks the package.
fn python_with_openai() -> Option<String> {
    let mut candidates = Vec::new();
    if let Ok(p) = std::env::var("KILN_DOC_PYTHON") {
        candidates.push(p);
    }
    candidates.push(
        root()
            .join("target/pyvenv/bin/python")
            .display()
            .to_string(),
    );
    candidates.push("python3".into());
    candidates.into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import openai"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// What went wrong with one block, if anything.
fn check_block(b: &Block, s: &Scratch, n: usize, python: Option<&str>) -> Option<String> {
    match (&b.marker, b.lang.as_str()) {
        (
            Marker::NotRun(r) | Marker::Fragment(r) | Marker::ExpectError(r) | Marker::Traces(r),
            _,
        ) if r.is_empty() => Some("a marker needs a reason".into()),
        (Marker::Traces(_), "sh") if !s.dir.join("traces").exists() => {
            eprintln!(
                "{}: skipped: no public traces (../shared/traces) here",
                b.at()
            );
            None
        }
        (Marker::NotRun(_), _) => None,
        (Marker::Fragment(_), "kiln") => {
            kiln::lang::parser::parse(kiln::source::FileId(0), &b.text)
                .err()
                .map(|d| format!("the fragment does not parse: {}", d.message))
        }
        (Marker::ExpectError(_), "kiln") => {
            let c = kiln::compile::compile_str("doc.kiln", &b.text);
            (!c.has_errors()).then(|| "expected an error, but it compiles".into())
        }
        (Marker::Fragment(_) | Marker::ExpectError(_), _) => {
            Some("fragment and expect-error are for kiln blocks".into())
        }
        (Marker::None, "kiln") => {
            let c = kiln::compile::compile_str("doc.kiln", &b.text);
            c.has_errors().then(|| {
                format!(
                    "does not compile: {:?}",
                    c.diagnostics
                        .items
                        .iter()
                        .map(|d| &d.message)
                        .collect::<Vec<_>>()
                )
            })
        }
        (Marker::None, "json") => serde_json::from_str::<serde_json::Value>(&b.text)
            .err()
            .map(|e| format!("not JSON: {e}")),
        (Marker::None, "toml") if b.text.contains("[[case]]") => {
            let dir = s.dir.join(format!(".policy-test-{n}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("readme.kiln"), readme_policy()).unwrap();
            std::fs::write(dir.join("readme.test.toml"), &b.text).unwrap();
            let d = dir.display().to_string();
            let r = run_limited(s, free_port(), "kiln", &["test", &d], &n.to_string());
            (!r.ok).then(|| format!("kiln test against README's policy fails:\n{}", r.output))
        }
        (Marker::None, "toml") => toml::from_str::<toml::Table>(&b.text)
            .err()
            .map(|e| format!("not TOML: {e}")),
        (Marker::None | Marker::Gateway(_) | Marker::Traces(_), "sh" | "python") => {
            if b.lang == "python" && python.is_none() {
                eprintln!(
                    "{}: skipped: the openai Python package is not installed",
                    b.at()
                );
                return None;
            }
            let port = free_port();
            let _gateway = match &b.marker {
                Marker::Gateway(args) => Some(start_gateway(s, port, args, &n.to_string())),
                _ => None,
            };
            let body = rewrite_address(&b.text, port);
            let (program, script) = if b.lang == "sh" {
                ("bash", format!("{}{body}", prelude(port)))
            } else {
                (python.unwrap_or("python3"), body)
            };
            let file = s.dir.join(format!(".block-{n}"));
            std::fs::write(&file, script).unwrap();
            let f = file.display().to_string();
            let r = run_limited(s, port, program, &[&f], &n.to_string());
            (!r.ok).then(|| format!("fails:\n{}", r.output))
        }
        (Marker::Gateway(_), _) => Some("gateway is for sh and python blocks".into()),
        (Marker::Traces(_), _) => Some("traces is for sh blocks".into()),
        (Marker::None, "text" | "promql") => None,
        (Marker::None, "") => Some("a block needs a language (```sh, ```kiln, ```text…)".into()),
        (Marker::None, other) => Some(format!(
            "no way to check a ```{other} block: mark it <!-- not-run: REASON -->"
        )),
    }
}

#[test]
fn every_block_in_readme_and_docs_runs_as_written() {
    let python = python_with_openai();
    let mut failures = Vec::new();
    let (mut run, mut not_run) = (0, 0);
    let started = Instant::now();
    for (file, text) in documents() {
        let bs = blocks(&file, &text);
        if bs.is_empty() {
            continue;
        }
        let scratch = Scratch::new(&file);
        for (n, b) in bs.iter().enumerate() {
            if matches!(b.marker, Marker::NotRun(_)) {
                not_run += 1;
            } else {
                run += 1;
            }
            let t = Instant::now();
            let failed = check_block(b, &scratch, n, python.as_deref());
            if t.elapsed() > Duration::from_secs(2) {
                eprintln!("{}: {:.1?}", b.at(), t.elapsed());
            }
            if let Some(why) = failed {
                failures.push(format!("{} (```{}): {why}", b.at(), b.lang));
            }
        }
        for f in scratch.changed_shipped_files() {
            failures.push(format!(
                "{file}: a block rewrote {f}, and it differs from the shipped one (stale?)"
            ));
        }
    }
    eprintln!(
        "{run} blocks checked, {not_run} marked not-run, in {:?}",
        started.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} blocks fail:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn markers_are_read_and_a_broken_block_fails() {
    let doc = "intro\n\n<!-- not-run: needs a GPU -->\n```sh\nnvidia-smi\n```\n\n<!-- fragment: a tier alone -->\n```kiln\ntier t { priority 1 }\n```\n\n```kiln\npool p {\n```\n";
    let bs = blocks("x.md", doc);
    assert_eq!(bs.len(), 3);
    assert_eq!(bs[0].marker, Marker::NotRun("needs a GPU".into()));
    assert_eq!(bs[1].marker, Marker::Fragment("a tier alone".into()));
    assert_eq!(bs[2].marker, Marker::None);
    let s = Scratch::new("self-test");
    assert!(check_block(&bs[0], &s, 0, None).is_none());
    assert!(check_block(&bs[1], &s, 1, None).is_none());
    assert!(check_block(&bs[2], &s, 2, None).is_some());
    let failing = Block {
        file: "x.md".into(),
        line: 1,
        lang: "sh".into(),
        text: "kiln check no-such-policy\n".into(),
        marker: Marker::None,
    };
    assert!(check_block(&failing, &s, 3, None).is_some());
    let empty = Block {
        marker: Marker::NotRun(String::new()),
        ..failing.clone()
    };
    assert!(check_block(&empty, &s, 4, None).is_some());
    let no_language = Block {
        lang: String::new(),
        text: "kiln check policies\n".into(),
        ..failing.clone()
    };
    assert!(check_block(&no_language, &s, 5, None).is_some());
    let not_wrong = Block {
        lang: "kiln".into(),
        text: readme_policy(),
        marker: Marker::ExpectError("wrong on purpose".into()),
        ..failing
    };
    assert!(check_block(&not_wrong, &s, 6, None).is_some());
}
