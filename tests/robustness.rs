//! Nothing a user can type makes kiln panic: random bytes, soups of the
//! language's own tokens, and mutated shipped policies all go through
//! parse, compile, lint, format and (when they compile) a decision.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::compile::{compile_str, lint};
use kiln::graph::{Request, Signals};
use kiln::lang::{format::format_file, parse};
use kiln::source::FileId;
use proptest::prelude::*;
use std::path::Path;

fn exercise(text: &str) {
    let c = compile_str("fuzz.kiln", text);
    let _ = lint(&c);
    for d in &c.diagnostics.items {
        let _ = kiln::diag::render(d, &c.sources, false);
        let _ = kiln::diag::to_json(d, &c.sources);
    }
    if let Ok(f) = parse(FileId(0), text) {
        let _ = format_file(&f, text);
    }
    if let Some(g) = &c.graph {
        let s = Signals::idle(g);
        for t in g.tenants.iter().map(|t| Some(t.name.clone())).chain([None]) {
            for m in g
                .models
                .iter()
                .map(|m| m.name.clone())
                .chain(["nope".to_string()])
            {
                let r = Request {
                    tenant: t.clone(),
                    model: m,
                    prompt_tokens: 100,
                    max_tokens: 100,
                    ..Default::default()
                };
                let (d, _) = g.explain(&r, &s);
                let _ = g.view(&d);
            }
        }
    }
}

fn shipped() -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("policies")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "kiln") {
                out.push(std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    out.sort();
    out
}

const TOKENS: &[&str] = &[
    "pool",
    "model",
    "tier",
    "tenant",
    "cohort",
    "classify",
    "route",
    "admit",
    "fallback",
    "rollout",
    "approval",
    "variant",
    "when",
    "default",
    "=>",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ",",
    ".",
    "..",
    "==",
    "!=",
    "<",
    ">=",
    "and",
    "or",
    "not",
    "in",
    "on",
    "queue",
    "reject",
    "delay",
    "until",
    "degrade",
    "max_tokens",
    "accept",
    "demote",
    "retry_after",
    "require",
    "from",
    "for",
    "rollback",
    "a",
    "b",
    "h100",
    "m",
    "fp16",
    "int4",
    "x-y",
    "tenant",
    "header(\"x\")",
    "pool(a).utilization",
    "tier(b).wait_p95",
    "quota.remaining",
    "estimated_wait",
    "time",
    "weekday",
    "mon..fri",
    "09:00..18:00",
    "99:99",
    "500ms",
    "2s",
    "85%",
    "80GB",
    "2M/min",
    "36k/day",
    "0",
    "999999999999999999999",
    "1.5",
    "\"s\"",
    "\"",
    "#c\n",
    "\n",
    "gpus",
    "memory",
    "kind",
    "priority",
    "slo",
    "ttft",
    "preempts",
    "preemptible",
    "tiers",
    "quota",
    "=",
    "5Ms",
    "3s/min",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        exercise(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn token_soup_never_panics(idx in proptest::collection::vec(0usize..TOKENS.len(), 0..120)) {
        let text: Vec<&str> = idx.iter().map(|i| TOKENS[*i]).collect();
        exercise(&text.join(" "));
    }

    #[test]
    fn mutated_policies_never_panic(pick in 0usize..64, at in 0usize..100_000, len in 0usize..40, tok in 0usize..TOKENS.len()) {
        let policies = shipped();
        let text = &policies[pick % policies.len()];
        let mut at = at % (text.len() + 1);
        while !text.is_char_boundary(at) { at -= 1; }
        let mut end = (at + len).min(text.len());
        while !text.is_char_boundary(end) { end -= 1; }
        let mutated = format!("{}{}{}", &text[..at], TOKENS[tok], &text[end..]);
        exercise(&mutated);
    }
}

#[test]
fn pathological_inputs() {
    exercise(&"(".repeat(5000));
    exercise(&format!(
        "classify {{ when {} => tier a }}",
        "not ".repeat(3000)
    ));
    exercise(&"tier a { priority 1 }\n".repeat(2000));
    exercise("tier a { priority 99999999999999999999999999999 }");
    exercise("\u{feff}tier a { priority 1 }");
    exercise("tier \u{1F600} { }");
}

#[test]
fn deeply_nested_conditions() {
    for depth in [10, 30, 100, 1000, 10_000] {
        let cond = format!("{}tenant == a{}", "(".repeat(depth), ")".repeat(depth));
        let text = format!(
            "pool p {{ gpus 1 kind \"x\" memory 80GB }}\nmodel m {{ variant fp16 {{ memory 1GB pools [p] }} }}\ntier t {{ priority 1 }}\ntenant a {{ tiers [t] }}\nclassify {{\n  when {cond} => tier t\n  default => tier t\n}}\nroute t m {{ default => fp16 }}\n"
        );
        exercise(&text);
    }
}

/// A policy whose one classify rule is an `and` chain of `n` distinct
/// terms (a 20k-term chain once took 8 s to compile: each term copied the
/// conjunction so far; `cargo bench --bench check` measures 2k against
/// 20k terms).
fn and_chain(n: usize) -> String {
    let terms: Vec<String> = (0..n)
        .map(|i| format!("header(\"x-{i}\") == \"v\""))
        .collect();
    format!(
        r#"pool gpu {{ gpus 4 kind "H100-80GB" memory 80GB }}
model m {{ variant fp16 {{ memory 40GB pools [gpu] }} }}
tier chat {{ priority 100 slo {{ ttft 500ms }} }}
tenant app {{ owner "a@example.com" tiers [chat] }}
classify {{
  when {} => tier chat
  default => tier chat
}}
route chat m {{ default => fp16 }}
"#,
        terms.join(" and ")
    )
}

#[test]
fn a_long_and_chain_compiles_lints_and_formats() {
    let text = and_chain(20_000);
    let c = compile_str("chain.kiln", &text);
    assert!(!c.has_errors(), "{:?}", c.diagnostics.items.first());
    let _ = lint(&c);
    let f = parse(FileId(0), &text).expect("parses");
    let out = format_file(&f, &text);
    assert!(out.contains("header(\"x-19999\") == \"v\""));
}
