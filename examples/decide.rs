//! Compile a shipped policy and decide a few requests from the library,
//! the way the gateway will: compile once, then decide per request.
//!
//! `cargo run --example decide`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::compile;
use kiln::graph::{Request, Signals, SignalsInput};
use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/enterprise");
    let sources = match compile::load(&[dir]) {
        Ok(s) => s,
        Err(d) => {
            eprintln!(
                "cannot load the policy: {:?}",
                d.items.first().map(|d| &d.message)
            );
            std::process::exit(2);
        }
    };
    let compiled = compile::compile(sources);
    let Some(graph) = compiled.graph.as_ref() else {
        for d in &compiled.diagnostics.items {
            eprint!("{}", kiln::diag::render(d, &compiled.sources, false));
        }
        std::process::exit(1);
    };
    let busy: SignalsInput = serde_json::from_value(serde_json::json!({
        "time": "10:30", "weekday": "tue",
        "pools": { "h100": { "utilization": "95%" } }
    }))
    .unwrap_or_default();
    for (label, signals) in [("idle", SignalsInput::default()), ("busy", busy)] {
        let signals = match Signals::resolve(graph, &signals) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("bad signals: {e}");
                std::process::exit(2);
            }
        };
        for tenant in ["support-bot", "analytics", "enrichment", "research"] {
            let req = Request {
                tenant: Some(tenant.into()),
                model: "llama-70b".into(),
                prompt_tokens: 1000,
                max_tokens: 256,
                ..Default::default()
            };
            let v = graph.view(&graph.decide(&req, &signals));
            println!(
                "{label:>4}  {tenant:<12} tier {:<16} {:<28} {}",
                v.tier,
                v.route.unwrap_or_default(),
                v.admission
            );
        }
    }
}
