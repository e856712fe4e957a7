//! The table of measured signals in docs/language.md is the compiler's
//! own list (`kiln::graph::signal`), so a signal's name and what the docs
//! say it measures cannot drift apart. `KILN_UPDATE_README=1 cargo test --test
//! readme_signals` rewrites the table.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::path::Path;

const BEGIN: &str = "<!-- signals:begin -->\n";
const END: &str = "<!-- signals:end -->";

#[test]
fn readme_signal_table_is_generated_from_the_compiler() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/language.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text
        .find(BEGIN)
        .expect("docs/language.md has the signals:begin marker")
        + BEGIN.len();
    let end = text[start..].find(END).expect("and the end marker") + start;
    let want = kiln::graph::signal::markdown_table();
    if text[start..end] == want {
        return;
    }
    if std::env::var_os("KILN_UPDATE_README").is_some() {
        let updated = format!("{}{}{}", &text[..start], want, &text[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    panic!(
        "docs/language.md's signal table differs from the compiler's list; run `KILN_UPDATE_README=1 cargo test --test readme_signals`\n--- docs/language.md\n{}\n--- compiler\n{}",
        &text[start..end],
        want
    );
}

#[test]
fn every_listed_signal_compiles_where_readme_says() {
    for d in kiln::graph::signal::all_docs() {
        let sig = d
            .spelling
            .replace("pool(P)", "pool(p)")
            .replace("tier(T)", "tier(t)")
            .replace("tenant(X)", "tenant(x)");
        let k = match d.ty {
            kiln::units::Ty::Percent => "50%",
            kiln::units::Ty::Duration => "1s",
            kiln::units::Ty::Count => "1",
            kiln::units::Ty::TimeOfDay => "09:00",
            kiln::units::Ty::Weekday => "mon",
            kiln::units::Ty::Date => "2026-12-28",
            kiln::units::Ty::DayOfMonth => "28",
            other => panic!("no literal for {other:?}"),
        };
        let op = if matches!(d.ty, kiln::units::Ty::Weekday) {
            "=="
        } else {
            ">="
        };
        let scopes: &[(&str, bool)] = &[
            ("classify", d.field != "estimated_wait"),
            ("route", d.field != "estimated_wait"),
            ("admit", true),
        ];
        for &(scope, ok) in scopes {
            let rule = format!("  when {sig} {op} {k} => ");
            let (classify, route, admit) = match scope {
                "classify" => (format!("{rule}tier t\n"), String::new(), String::new()),
                "route" => (String::new(), format!("{rule}fp16 on p\n"), String::new()),
                _ => (
                    String::new(),
                    String::new(),
                    format!("{rule}reject 503 \"x\"\n"),
                ),
            };
            let text = format!(
                r#"
pool p {{ gpus 1 kind "H100-80GB" memory 80GB }}
model m {{ params 8B kv_per_token 128KB variant fp16 {{ memory 18GB pools [p] }} }}
tier t {{ priority 1 slo {{ ttft 1s window 1h }} }}
tenant x {{ owner "o" tiers [t] quota {{ tokens 1M/min }} }}
classify {{
{classify}  default => tier t
}}
route t m {{
{route}  default => fp16 on p
}}
admit t {{
{admit}  default => accept
}}
"#
            );
            let c = kiln::compile::compile_str("t.kiln", &text);
            let errors: Vec<String> = c
                .diagnostics
                .items
                .iter()
                .map(|d| d.message.clone())
                .collect();
            assert_eq!(
                c.graph.is_some(),
                ok,
                "`{}` in {scope}: {errors:?}",
                d.spelling
            );
        }
    }
}
