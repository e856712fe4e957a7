//! Every quota holds over a fleet of three replicas sharing a real
//! `redis-server` (started here on a free loopback port; skipped, with a
//! message, where it is not installed): a tier's and a model's quota admit
//! what one gateway would, `quota.remaining` reads the fleet's value, and
//! over any minute containing a Redis `kill -9` and restart (empty, or from
//! its append-only file) the fleet admits at most 1.1× the allowance.
//!
//! Policy time runs at `[sim] speed` 10 (a minute of quota is 6 s here), so
//! the minute-long windows these promises are about take seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

mod support;

use kiln::server::config::{OnUnavailable, ServerConfig, StateSection};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::redis::Redis;
use support::{client, policy, serve_on_loopback};

/// Tier `metered` (tenant `a`) has a quota of its own; model `small`
/// (served to tenant `b`'s tier `bulk`) has one; tenant `c` has one, and
/// its tier refuses it once less than half of it is left.
const POLICY: &str = r#"
pool gpu { gpus 8 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 64 }
}
model small {
  params 1B
  kv_per_token 32KB
  quota { requests 60/min }
  variant fp16 { memory 4GB pools [gpu] max_batch 64 }
}
tier metered { priority 100 slo { ttft 5s } quota { requests 60/min } }
tier bulk { priority 50 slo { ttft 5s } }
tier saver { priority 40 slo { ttft 5s } }
tenant a { owner "a@x" tiers [metered] api_keys ["k-a"] }
tenant b { owner "b@x" tiers [bulk] api_keys ["k-b"] }
tenant c { owner "c@x" tiers [saver] quota { requests 60/min } api_keys ["k-c"] }
classify {
  when tenant == a => tier metered
  when tenant == b => tier bulk
  default => tier saver
}
route [metered, saver, bulk] tiny { default => fp16 }
route [metered, saver, bulk] small { default => fp16 }
admit saver {
  when quota.remaining < 50% => reject 429 "half of the quota is spent"
  default => accept
}
"#;

const SPEED: f64 = 10.0;
/// A minute of policy time, in wall time.
const MINUTE: Duration = Duration::from_millis(6000);

fn config(url: &str, ns: &str, i: usize, speed: f64, on: OnUnavailable) -> ServerConfig {
    let mut cfg = ServerConfig::default_embedded();
    cfg.sim.speed = speed;
    cfg.state = Some(StateSection {
        redis: url.to_string(),
        namespace: ns.to_string(),
        replica: Some(format!("replica-{i}")),
        on_unavailable: on,
        // Deliberately wrong: the fleet's size comes from the registry.
        replicas: 1,
        lease: Duration::from_millis(900),
        ca_file: None,
        client_cert: None,
        client_key: None,
    });
    cfg
}

struct Fleet {
    gateways: Vec<kiln::server::Running>,
    bases: Vec<String>,
}

async fn fleet(url: &str, speed: f64) -> Fleet {
    fleet_of(url, speed, OnUnavailable::Local, 3).await
}

async fn fleet_of(url: &str, speed: f64, on: OnUnavailable, n: usize) -> Fleet {
    fleet_with(url, POLICY, speed, on, n).await
}

async fn fleet_with(url: &str, text: &str, speed: f64, on: OnUnavailable, n: usize) -> Fleet {
    let ns = support::redis::namespace("q");
    let mut gateways = Vec::new();
    for i in 0..n {
        gateways
            .push(serve_on_loopback(policy("q.kiln", text), config(url, &ns, i, speed, on)).await);
    }
    let bases = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    Fleet { gateways, bases }
}

impl Fleet {
    async fn stop(self) {
        for g in self.gateways {
            g.stop().await;
        }
    }

    /// Lets every replica's heartbeat (a third of the lease) count the
    /// three in the registry.
    async fn registered(&self) {
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
}

async fn chat(c: &reqwest::Client, base: &str, key: &str, model: &str) -> (u16, String) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await;
    match r {
        Ok(r) => {
            let s = r.status().as_u16();
            let body = r.text().await.unwrap_or_default();
            (s, body)
        }
        Err(e) => (0, e.to_string()),
    }
}

/// Sends `key`'s requests round-robin over the replicas at `per_s` (wall)
/// for `run`, calling `at` with the elapsed time before each send; returns
/// the wall-clock offsets of the admitted ones.
async fn offer(
    f: &Fleet,
    key: &'static str,
    model: &'static str,
    per_s: f64,
    run: Duration,
) -> Vec<Duration> {
    let c = client(Duration::from_secs(10));
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_s));
    let mut handles = Vec::new();
    let mut n = 0usize;
    while start.elapsed() < run {
        tick.tick().await;
        let sent = start.elapsed();
        let (c, b, admitted) = (c.clone(), f.bases[n % 3].clone(), admitted.clone());
        n += 1;
        handles.push(tokio::spawn(async move {
            if chat(&c, &b, key, model).await.0 == 200 {
                admitted.lock().unwrap().push(sent);
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let mut v = admitted.lock().unwrap().clone();
    v.sort();
    v
}

/// The most admitted in any `window` (sliding) of `times`.
fn busiest(times: &[Duration], window: Duration) -> usize {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= window {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

/// What one gateway's bucket admits over `window` from full: its minute of
/// burst and what refills meanwhile (`per_min` a minute of policy time).
fn allowance(per_min: f64, window: Duration) -> f64 {
    per_min + per_min * window.as_secs_f64() / MINUTE.as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tier_and_model_quotas_hold_over_the_fleet() {
    let Some(redis) = Redis::start() else { return };
    let f = fleet(&redis.url(), SPEED).await;
    f.registered().await;
    // Three times the rate (60/min of policy time: 10/s here) each, over
    // a minute of policy time, spread over the three replicas.
    let run = MINUTE;
    let (tier, model) = tokio::join!(
        offer(&f, "k-a", "tiny", 30.0, run),
        offer(&f, "k-b", "small", 30.0, run),
    );
    f.stop().await;
    let due = allowance(60.0, run);
    eprintln!(
        "tier quota: {} admitted, model quota: {} admitted, {due:.0} due each (one gateway's bucket)",
        tier.len(),
        model.len()
    );
    for (what, n) in [("tier", tier.len()), ("model", model.len())] {
        assert!(
            (n as f64) <= 1.1 * due,
            "{what} quota 60/min: {n} admitted over the fleet, more than 1.1 x {due:.0}"
        );
        assert!(
            (n as f64) >= 0.8 * due,
            "{what} quota 60/min: only {n} admitted over the fleet of {due:.0} due"
        );
    }
}

/// An exception that covers today grants tier `metered` 600 requests a
/// minute over its declared 60: the fleet admits what the grant allows
/// (each replica's claim on the shared bucket reads today's limits, as
/// its scheduler does), and no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exceptions_quota_grant_holds_over_the_fleet() {
    use kiln::units::calendar::{civil_at, show_date};
    let Some(redis) = Redis::start() else { return };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let today = civil_at(now_ms, None).date;
    let text = format!(
        "{POLICY}\nexception launch {{\n  tier metered\n  dates {}..{}\n  quota {{ requests 600/min }}\n  reason \"launch week\"\n}}\n",
        show_date(today - 1),
        show_date(today + 1)
    );
    let f = fleet_with(&redis.url(), &text, SPEED, OnUnavailable::Local, 3).await;
    f.registered().await;
    let admitted = offer(&f, "k-a", "tiny", 30.0, MINUTE).await;
    f.stop().await;
    let (declared, granted) = (allowance(60.0, MINUTE), allowance(600.0, MINUTE));
    eprintln!(
        "tier quota granted 600/min: {} admitted ({declared:.0} due at the declared 60/min)",
        admitted.len()
    );
    assert!(
        admitted.len() as f64 > 1.1 * declared,
        "the grant did not hold over the fleet: {} admitted",
        admitted.len()
    );
    assert!(admitted.len() as f64 <= 1.1 * granted);
}

/// A money budget over a fleet: tenant `a` spends only through replica 0
/// until its rule refuses it there; then the other replicas, which served
/// it nothing, refuse it too (each reads the fleet's spending against the
/// whole budget, not its own against its third).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_money_budget_is_the_fleets() {
    const BUDGETED: &str = r#"
pool gpu { gpus 8 kind "H100-80GB" memory 80GB price 3600000/h }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 64 }
}
tier t { priority 10 slo { ttft 5s } }
tenant a { owner "a@x" tiers [t] budget 2k/day api_keys ["k-a"] }
classify { default => tier t }
route t tiny { default => fp16 }
admit t {
  when budget.remaining <= 0% => reject 429 "budget spent"
  default => accept
}
"#;
    let Some(redis) = Redis::start() else { return };
    let f = fleet_with(&redis.url(), BUDGETED, SPEED, OnUnavailable::Local, 3).await;
    f.registered().await;
    let c = client(Duration::from_secs(10));
    let send = |base: String| {
        let c = c.clone();
        async move {
            c.post(format!("{base}/v1/chat/completions"))
                .bearer_auth("k-a")
                .json(&json!({"model": "tiny", "max_tokens": 64,
                    "messages": [{"role": "user", "content": "word ".repeat(200)}]}))
                .send()
                .await
                .map_or(0, |r| r.status().as_u16())
        }
    };
    let mut served = 0;
    let mut refused = false;
    for _ in 0..400 {
        match send(f.bases[0].clone()).await {
            200 => served += 1,
            429 => {
                refused = true;
                break;
            }
            s => panic!("status {s}"),
        }
    }
    assert!(
        refused,
        "the budget never ran out on replica 0 ({served} served)"
    );
    assert!(served >= 3, "{served}");
    // The others learn the fleet's spending within a heartbeat or two
    // (a third of the lease each): waited for, bounded, on a busy machine.
    let until = Instant::now() + Duration::from_secs(10);
    while send(f.bases[1].clone()).await != 429 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut elsewhere = Vec::new();
    for i in [1, 2, 1, 2] {
        elsewhere.push(send(f.bases[i].clone()).await);
    }
    f.stop().await;
    eprintln!("served {served} on replica 0, then on the others: {elsewhere:?}");
    assert!(elsewhere.iter().all(|s| *s == 429), "{elsewhere:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quota_remaining_reads_the_fleets_value() {
    let Some(redis) = Redis::start() else { return };
    // Policy time as wall time: the bucket barely refills meanwhile.
    let f = fleet(&redis.url(), 1.0).await;
    let c = client(Duration::from_secs(10));
    let (mut ok, mut fired, mut other) = (0, 0, Vec::new());
    for i in 0..45 {
        let (s, body) = chat(&c, &f.bases[i % 3], "k-c", "tiny").await;
        match s {
            200 => ok += 1,
            _ if body.contains("half of the quota is spent") => fired += 1,
            _ => other.push((s, body)),
        }
    }
    f.stop().await;
    eprintln!(
        "quota.remaining < 50%: {ok} admitted, the rule fired {fired} times, {} other refusals",
        other.len()
    );
    // Each replica alone would have seen a third of the fleet's spending
    // (never under 50% before 30 admitted fleet-wide), so never fired.
    assert!(
        (29..=32).contains(&ok),
        "{ok} admitted before the rule fired on the fleet's remaining quota; other: {other:?}"
    );
    assert!(
        fired >= 10,
        "the admit rule fired {fired} times; other: {other:?}"
    );
}

/// Three replicas, 3x the rate of a tier's 60/min spread over them, Redis
/// killed after a while and restarted (`persistent`: from its append-only
/// file; else empty); over every minute of policy time the fleet admits
/// at most 1.1x what one gateway would.
async fn outage(persistent: bool) {
    let port = support::redis::free_port();
    let dir = std::env::temp_dir().join(support::redis::namespace("kiln-aof-"));
    std::fs::create_dir_all(&dir).unwrap();
    let start = |dir: &std::path::Path| {
        if persistent {
            Redis::start_persistent(port, dir)
        } else {
            Redis::start_on(port)
        }
    };
    let Some(redis) = start(&dir) else { return };
    let f = fleet(&redis.url(), SPEED).await;
    f.registered().await;
    let run = MINUTE * 3 / 2;
    let load = offer(&f, "k-a", "tiny", 30.0, run);
    let chaos = async {
        // Down from 0.4 to 0.9 of a minute into the load, then back.
        tokio::time::sleep(MINUTE * 2 / 5).await;
        redis.stop();
        tokio::time::sleep(MINUTE / 2).await;
        start(&dir).unwrap()
    };
    let (admitted, back) = tokio::join!(load, chaos);
    // The outage happened: requests were decided locally meanwhile.
    let c = client(Duration::from_secs(5));
    let mut local = 0.0;
    for b in &f.bases {
        let m = c
            .get(format!("{b}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        local += m
            .lines()
            .filter(|l| l.starts_with("kiln_shared_state_unclaimed_total{action=\"local\"}"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    f.stop().await;
    back.stop();
    let _ = std::fs::remove_dir_all(&dir);
    let worst = busiest(&admitted, MINUTE);
    let due = allowance(60.0, MINUTE);
    let total_due = allowance(60.0, run);
    eprintln!(
        "Redis killed and restarted {}: {} admitted in a minute and a half ({total_due:.0} due), at most {worst} in any minute ({due:.0} due); {local} requests decided while it was down",
        if persistent { "from its AOF" } else { "empty" },
        admitted.len()
    );
    assert!(
        local >= 50.0,
        "only {local} requests were decided while Redis was down"
    );
    assert!(
        worst as f64 <= 1.1 * due,
        "{worst} admitted in one minute around the outage, more than 1.1 x {due:.0}"
    );
    assert!(
        admitted.len() as f64 <= 1.1 * total_due,
        "{} admitted in a minute and a half around the outage, more than 1.1 x {total_due:.0}",
        admitted.len()
    );
    assert!(
        admitted.len() as f64 >= 0.7 * total_due,
        "only {} admitted of {total_due:.0} due",
        admitted.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_keeps_the_promise_when_redis_comes_back_empty() {
    outage(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_keeps_the_promise_when_redis_comes_back_from_its_aof() {
    outage(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_refuses_while_redis_is_down_is_not_ready() {
    let port = support::redis::free_port();
    let Some(redis) = Redis::start_on(port) else {
        return;
    };
    let f = fleet_of(&redis.url(), 1.0, OnUnavailable::Refuse, 1).await;
    let c = client(Duration::from_secs(5));
    let ready = |c: reqwest::Client, b: String| async move {
        c.get(format!("{b}/readyz"))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    let until_status = |want: u16| {
        let (c, b) = (c.clone(), f.bases[0].clone());
        async move {
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                let s = ready(c.clone(), b.clone()).await;
                if s == want || Instant::now() > until {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(until_status(200).await, 200);
    redis.stop();
    assert_eq!(
        until_status(503).await,
        503,
        "/readyz with Redis down under `refuse`"
    );
    let back = Redis::start_on(port).unwrap();
    assert_eq!(
        until_status(200).await,
        200,
        "/readyz once Redis answers again"
    );
    f.stop().await;
    back.stop();
}

/// A fleet that grows from two replicas to four and shrinks back to two
/// under load, with Redis killed (and restarted empty) once at four and
/// once at two: each outage's local budgets follow the registry's count
/// (at four, a quarter each: no over-admission; at two, a half each: no
/// under-admission), and no minute admits more than 1.1x what is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn budgets_follow_replicas_joining_and_leaving() {
    let port = support::redis::free_port();
    let Some(redis) = Redis::start_on(port) else {
        return;
    };
    let url = redis.url();
    let ns = support::redis::namespace("scale");
    let start = |i: usize| {
        let (url, ns) = (url.clone(), ns.clone());
        async move {
            serve_on_loopback(
                policy("q.kiln", POLICY),
                config(&url, &ns, i, SPEED, OnUnavailable::Local),
            )
            .await
        }
    };
    let mut gateways = vec![start(0).await, start(1).await];
    let bases: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(
        gateways
            .iter()
            .map(|g| format!("http://{}", g.addr))
            .collect(),
    ));
    tokio::time::sleep(Duration::from_millis(700)).await;
    // The load: three times the tier's rate, round-robin over whichever
    // replicas are in the list now, until told to stop.
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t0 = Instant::now();
    let load = {
        let (bases, admitted, stop) = (bases.clone(), admitted.clone(), stop.clone());
        tokio::spawn(async move {
            let c = client(Duration::from_secs(10));
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / 30.0));
            let mut handles = Vec::new();
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && t0.elapsed() < Duration::from_secs(30)
            {
                tick.tick().await;
                let b = {
                    let l = bases.lock().unwrap();
                    l[n % l.len()].clone()
                };
                n += 1;
                let (c, admitted) = (c.clone(), admitted.clone());
                let sent = t0.elapsed();
                handles.push(tokio::spawn(async move {
                    if chat(&c, &b, "k-a", "tiny").await.0 == 200 {
                        admitted.lock().unwrap().push(sent);
                    }
                }));
            }
            for h in handles {
                let _ = h.await;
            }
        })
    };
    let count_between = |from: Duration, to: Duration| {
        admitted
            .lock()
            .unwrap()
            .iter()
            .filter(|t| **t >= from && **t < to)
            .count()
    };
    // 2 -> 4: two join; the registry counts them within a heartbeat.
    tokio::time::sleep(MINUTE / 3).await;
    gateways.push(start(2).await);
    gateways.push(start(3).await);
    *bases.lock().unwrap() = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    // An outage at four: each serves a quarter.
    redis.stop();
    let down4 = t0.elapsed();
    tokio::time::sleep(MINUTE / 2).await;
    let redis = Redis::start_on(port).unwrap();
    let up4 = t0.elapsed();
    // 4 -> 2: two leave (their leases lapse within a lease).
    tokio::time::sleep(MINUTE / 3).await;
    *bases.lock().unwrap() = gateways[..2]
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for g in gateways.drain(2..) {
        g.stop().await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // An outage at two: each serves a half.
    redis.stop();
    let down2 = t0.elapsed();
    tokio::time::sleep(MINUTE / 2).await;
    let back = Redis::start_on(port).unwrap();
    let up2 = t0.elapsed();
    tokio::time::sleep(MINUTE / 3).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    for g in gateways {
        g.stop().await;
    }
    back.stop();
    let times = {
        let mut v = admitted.lock().unwrap().clone();
        v.sort();
        v
    };
    let worst = busiest(&times, MINUTE);
    let due = allowance(60.0, MINUTE);
    // While down, the fleet had (about) nothing left: what refills is due.
    let due_down =
        |from: Duration, to: Duration| 60.0 * (to - from).as_secs_f64() / MINUTE.as_secs_f64();
    let (at4, at2) = (count_between(down4, up4), count_between(down2, up2));
    eprintln!(
        "2 -> 4 -> 2 replicas: {} admitted, at most {worst} in any minute ({due:.0} due); Redis down at four: {at4} admitted ({:.0} due), at two: {at2} ({:.0} due)",
        times.len(),
        due_down(down4, up4),
        due_down(down2, up2)
    );
    assert!(
        worst as f64 <= 1.1 * due,
        "{worst} admitted in one minute, more than 1.1 x {due:.0}"
    );
    assert!(
        at4 as f64 <= 1.25 * due_down(down4, up4) + 3.0,
        "{at4} admitted while Redis was down at four replicas, {:.0} due",
        due_down(down4, up4)
    );
    assert!(
        at2 as f64 >= 0.6 * due_down(down2, up2),
        "only {at2} admitted while Redis was down at two replicas, {:.0} due: the budget did not follow the leave",
        due_down(down2, up2)
    );
}

/// An OpenAI-style upstream that takes `UPSTREAM_MS` per answer, counting
/// answers per tenant (named in the prompt) and the most calls at once.
#[derive(Default)]
struct Upstream {
    now: std::sync::atomic::AtomicU64,
    max: std::sync::atomic::AtomicU64,
    served: Mutex<std::collections::BTreeMap<String, u64>>,
}

const UPSTREAM_MS: u64 = 60;

async fn upstream_chat(
    axum::extract::State(u): axum::extract::State<Arc<Upstream>>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    use std::sync::atomic::Ordering::SeqCst;
    let n = u.now.fetch_add(1, SeqCst) + 1;
    u.max.fetch_max(n, SeqCst);
    tokio::time::sleep(Duration::from_millis(UPSTREAM_MS)).await;
    u.now.fetch_sub(1, SeqCst);
    let prompt = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    *u.served.lock().unwrap().entry(prompt).or_default() += 1;
    axum::Json(json!({
        "id": "x", "object": "chat.completion", "created": 0, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    }))
    .into_response()
}

const WEIGHTED: &str = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] }
}
tier interactive { priority 100 slo { ttft 60s } }
tenant light { owner "a@x" tiers [interactive] weight 1 api_keys ["k-light"] }
tenant heavy { owner "b@x" tiers [interactive] weight 3 api_keys ["k-heavy"] }
classify { default => tier interactive }
route [interactive] tiny { default => fp16 }
"#;

/// Weights 1:3 on one 6-slot upstream behind three replicas, both tenants
/// backlogged, light entering through `light_on` replicas and heavy
/// through `heavy_on`: what share of what the upstream served went to
/// light, and the most it ran at once.
async fn light_share(redis: &Redis, light_on: &[usize], heavy_on: &[usize]) -> (f64, u64) {
    let u = Arc::new(Upstream::default());
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(upstream_chat))
        .route("/health", axum::routing::get(|| async { "ok" }))
        .with_state(u.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_url = format!("http://{}", l.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    let ns = support::redis::namespace("w");
    let mut gateways = Vec::new();
    for i in 0..3 {
        let text = format!(
            "[pools.gpu]\nbackend = \"http\"\n[[pools.gpu.upstreams]]\nmodel = \"tiny\"\nvariant = \"fp16\"\nurl = \"{up_url}\"\nconcurrency = 6\nhealth_interval = \"1s\"\n"
        );
        let mut cfg = ServerConfig::parse("kiln.toml", &text).unwrap();
        cfg.policy_keys = true;
        cfg.state = Some(StateSection {
            redis: redis.url(),
            namespace: ns.clone(),
            replica: Some(format!("replica-{i}")),
            on_unavailable: OnUnavailable::Local,
            replicas: 3,
            lease: Duration::from_secs(2),
            ca_file: None,
            client_cert: None,
            client_key: None,
        });
        gateways.push(serve_on_loopback(policy("w.kiln", WEIGHTED), cfg).await);
    }
    let bases: Vec<String> = gateways
        .iter()
        .map(|g| format!("http://{}", g.addr))
        .collect();
    let c = client(Duration::from_secs(60));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    // Twelve workers each, spread over their replicas.
    for w in 0..24 {
        let (key, tenant, base) = if w < 12 {
            (
                "k-light",
                "light",
                bases[light_on[w % light_on.len()]].clone(),
            )
        } else {
            (
                "k-heavy",
                "heavy",
                bases[heavy_on[w % heavy_on.len()]].clone(),
            )
        };
        let (c, stop) = (c.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth(key)
                    .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": tenant}], "max_tokens": 1}))
                    .send()
                    .await
                    .map(|r| r.status());
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = u.served.lock().unwrap().clone();
    u.max.store(
        u.now.load(std::sync::atomic::Ordering::SeqCst),
        std::sync::atomic::Ordering::SeqCst,
    );
    // Two whole turns of the extra slot (see the test's comment).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let after = u.served.lock().unwrap().clone();
    let max = u.max.load(std::sync::atomic::Ordering::SeqCst);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    for g in gateways {
        g.stop().await;
    }
    server.abort();
    let got = |t: &str| after.get(t).copied().unwrap_or(0) - before.get(t).copied().unwrap_or(0);
    let (light, heavy) = (got("light"), got("heavy"));
    let share = light as f64 / (light + heavy).max(1) as f64;
    eprintln!("weights 1:3, 6 slots, 8 s, light through {light_on:?}, heavy through {heavy_on:?}: light {light}, heavy {heavy} served (light's share {share:.3}), at most {max} at once");
    (share, max)
}

/// Light's share, 1.5 slots of 6, is no whole number of slots: the replica
/// it enters through holds a second slot by turns, and light gets a
/// quarter of what the upstream serves.
///
/// Exact over whole turns: with light through one replica and heavy
/// through two, the extra slot goes round in four epochs of a second
/// (light's replica twice, each of heavy's once), so the share is measured
/// over eight. Over five, as it was, light's replica held the extra in two
/// of them or three, by where the window fell: 0.239-0.242 on an idle
/// machine, and 0.230 (out of bounds) once on a loaded CI; over eight,
/// 0.249-0.252 idle and beside two busy loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weighted_shares_of_an_upstream_are_exact_across_replicas() {
    let Some(redis) = Redis::start() else { return };
    for (light_on, heavy_on) in [(&[0usize][..], &[1usize, 2][..]), (&[0], &[0, 1, 2])] {
        let (share, max) = light_share(&redis, light_on, heavy_on).await;
        assert!(max <= 6, "{max} at once on an upstream of 6");
        assert!(
            (share - 0.25).abs() <= 0.02,
            "light through {light_on:?}, heavy through {heavy_on:?}: light's share is {share:.3}, not 0.25 +/- 0.02"
        );
    }
}
