//! README's "A policy" block is a complete policy, not an excerpt that
//! fails `kiln check`: it compiles, is lint-clean and is formatted as
//! `kiln fmt` writes it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::path::Path;

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap()
}

/// The first ```kiln block after `heading`.
fn kiln_block<'a>(text: &'a str, heading: &str) -> &'a str {
    let at = text.find(heading).expect("README has the heading");
    let open = "```kiln\n";
    let start = text[at..].find(open).expect("a kiln block follows it") + at + open.len();
    let end = text[start..].find("```\n").expect("the block ends") + start;
    &text[start..end]
}

#[test]
fn readme_policy_is_complete_lint_clean_and_formatted() {
    let text = readme();
    let policy = kiln_block(&text, "\n## A policy\n");
    let c = kiln::compile::compile_str("README.md", policy);
    let mut all = c.diagnostics.clone();
    if !c.has_errors() {
        all.extend(kiln::compile::lint(&c));
    }
    assert!(
        all.is_empty(),
        "README's policy has findings: {:?}",
        all.items.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
    let file = c
        .files
        .first()
        .map(|(_, f)| f)
        .expect("README's policy parses");
    let formatted = kiln::lang::format::format_file(file, policy);
    assert_eq!(
        formatted, policy,
        "README's policy is not as `kiln fmt` writes it"
    );
    let g = c.graph.unwrap();
    assert!(g.tenants.len() >= 3 && g.tiers.len() >= 5);
}
