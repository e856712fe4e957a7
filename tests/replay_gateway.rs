//! The gateway predicts nothing the replay does not: one recorded trace,
//! run through `kiln serve` on the simulated backend with a virtual clock
//! (over HTTP, with the OpenAI request body and API keys), and through the
//! replay `kiln simulate` runs, gives the same decision for every request
//! (tier, tenant, route, refusal) and the same start and finish times to
//! the microsecond, so the same order.
//!
//! The trace is the committed Azure 2023 slice (`examples/diff/traffic.jsonl`,
//! CC-BY-4.0, see `examples/diff/README.md`) under the policy it was
//! recorded for.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use std::path::Path;
use support::policy;
use support::twin::{assert_same, gateway_seen, replay_seen};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_through_the_gateway_on_a_virtual_clock_matches_the_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/diff/old/enterprise.kiln")).unwrap();
    let records: Vec<kiln::traffic::Record> =
        kiln::traffic::read(root.join("examples/diff/traffic.jsonl")).unwrap();
    assert!(
        records.len() >= 300,
        "the slice must hold a few hundred requests"
    );
    assert!(
        records.iter().any(|r| r.prompt_tokens >= 1024),
        "some prompts span several prefix blocks"
    );
    let p = policy("enterprise.kiln", &text);
    let (want, outcomes) = replay_seen(&p, &records);
    let served = want.iter().filter(|s| s.finished_us.is_some()).count();
    let queued = outcomes
        .iter()
        .filter(|o| o.started.is_some_and(|s| s > o.arrival))
        .count();
    assert!(served > 100, "the slice must serve requests ({served})");
    let refused = want.iter().filter(|s| s.refused.is_some()).count();
    assert!(
        queued > 10,
        "and some must queue, or order is not tested ({queued})"
    );
    eprintln!(
        "{} requests: {served} served, {queued} queued, {refused} refused",
        want.len()
    );
    let got = gateway_seen(p, &records).await;
    assert_same(&want, &got);
}
