//! Every outcome in the rules table of docs/language.md acts at decide time, in the
//! replay and in the gateway alike: one request per outcome (chosen by a
//! header), each decided as its rule says, and the gateway on a virtual
//! clock matching the replay request for request (decision, start and
//! finish to the microsecond).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::traffic::Record;
use std::collections::BTreeMap;
use support::policy;
use support::twin::{assert_same, gateway_seen, replay_seen};

const POLICY: &str = r#"
pool gpu { gpus 1 kind "A100-80GB" memory 80GB }
pool other { gpus 1 kind "A100-80GB" memory 80GB }
model llama-70b {
  params 70B
  kv_per_token 320KB
  variant int4 { memory 42GB pools [gpu, other] }
  variant int8 { memory 75GB pools [other] }
}
tier plain { priority 10 }
tier lower { priority 5 }
tier r-reject { priority 1 }
tier r-fallback { priority 1 }
tier a-queue { priority 1 }
tier a-delay { priority 1 }
tier a-degrade { priority 1 }
tier a-reject { priority 1 }
tier a-fallback { priority 1 }
tier f-demote { priority 1 }
tier f-reject { priority 1 }
tenant prober { owner "p@x" tiers [plain, lower, r-reject, r-fallback, a-queue, a-delay, a-degrade, a-reject, a-fallback, f-demote, f-reject] }
tenant other-team { owner "o@x" tiers [plain] }
classify {
  when header("x-case") == "tenant" => tier plain tenant other-team
  when header("x-case") == "r-reject" => tier r-reject
  when header("x-case") == "r-fallback" => tier r-fallback
  when header("x-case") == "a-queue" => tier a-queue
  when header("x-case") == "a-delay" => tier a-delay
  when header("x-case") == "a-degrade" => tier a-degrade
  when header("x-case") == "a-reject" => tier a-reject
  when header("x-case") == "a-fallback" => tier a-fallback
  when header("x-case") == "f-demote" => tier f-demote
  when header("x-case") == "f-reject" => tier f-reject
  default => tier plain
}
route [plain, lower, a-queue, a-delay, a-degrade, a-reject, a-fallback, f-demote, f-reject] llama-70b {
  default => int4 on gpu
}
route r-reject llama-70b { default => reject 503 "no route for this tier" }
route r-fallback llama-70b { default => fallback }
fallback r-fallback [ route llama-70b.int8 on other, reject 503 "chain end" ]
admit a-queue { default => queue 30s }
admit a-delay { default => delay until 12:01 }
admit a-degrade { default => degrade variant int8 max_tokens 2 }
admit a-reject { default => reject 429 "not today" retry_after 10s }
admit a-fallback { default => fallback }
fallback a-fallback [ route llama-70b.int8 on other, reject 503 "chain end" ]
admit [f-demote, f-reject] { default => fallback }
fallback f-demote [ demote lower ]
fallback f-reject [ reject 503 "chain end" ]
"#;

/// (case header, tier, tenant, route, refused status) it must come to.
type Case = (
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
    Option<u16>,
);

fn cases() -> Vec<Case> {
    vec![
        (
            "plain",
            "plain",
            "prober",
            Some("llama-70b.int4 on gpu"),
            None,
        ),
        (
            "tenant",
            "plain",
            "other-team",
            Some("llama-70b.int4 on gpu"),
            None,
        ),
        ("r-reject", "r-reject", "prober", None, Some(503)),
        (
            "r-fallback",
            "r-fallback",
            "prober",
            Some("llama-70b.int8 on other"),
            None,
        ),
        (
            "a-queue",
            "a-queue",
            "prober",
            Some("llama-70b.int4 on gpu"),
            None,
        ),
        (
            "a-delay",
            "a-delay",
            "prober",
            Some("llama-70b.int4 on gpu"),
            None,
        ),
        (
            "a-degrade",
            "a-degrade",
            "prober",
            Some("llama-70b.int8 on other"),
            None,
        ),
        ("a-reject", "a-reject", "prober", None, Some(429)),
        (
            "a-fallback",
            "a-fallback",
            "prober",
            Some("llama-70b.int8 on other"),
            None,
        ),
        (
            "f-demote",
            "lower",
            "prober",
            Some("llama-70b.int4 on gpu"),
            None,
        ),
        ("f-reject", "f-reject", "prober", None, Some(503)),
    ]
}

fn records() -> Vec<Record> {
    cases()
        .iter()
        .enumerate()
        .map(|(i, (case, ..))| Record {
            at_ms: 1000.0 * i as f64,
            tenant: Some("prober".into()),
            model: "llama-70b".into(),
            headers: BTreeMap::from([("x-case".into(), case.to_string())]),
            prompt_tokens: 64,
            max_tokens: 16,
            output_tokens: 16,
            ..Record::default()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_acts_at_decide_time_in_replay_and_gateway() {
    let p = policy("outcomes.kiln", POLICY);
    let recs = records();
    let (want, outcomes) = replay_seen(&p, &recs);
    let decode = |o: &kiln::replay::Outcome| o.finished.unwrap() - o.first_token.unwrap();
    let plain_decode = decode(&outcomes[0]);
    for (((case, tier, tenant, route, status), s), o) in cases().iter().zip(&want).zip(&outcomes) {
        assert_eq!(s.tier.as_deref(), Some(*tier), "{case}: {s:?}");
        assert_eq!(s.tenant.as_deref(), Some(*tenant), "{case}: {s:?}");
        assert_eq!(s.route.as_deref(), *route, "{case}: {s:?}");
        assert_eq!(s.refused.as_ref().map(|r| r.1), *status, "{case}: {s:?}");
        if status.is_none() {
            assert!(s.finished_us.is_some(), "{case} is served: {s:?}");
        }
        match *case {
            // The replay's clock starts on a Monday at 12:00.
            "a-delay" => assert!(
                s.started_us.unwrap() >= 60_000_000,
                "delay until 12:01 holds it a minute: {s:?}"
            ),
            // 16 tokens asked for, 2 produced: one decode step, not 15.
            "a-degrade" => assert!(
                decode(o) * 4 < plain_decode,
                "degrade max_tokens 2 caps its output: {o:?}"
            ),
            _ => {}
        }
    }
    let got = gateway_seen(p, &recs).await;
    assert_same(&want, &got);
}
