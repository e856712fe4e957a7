//! Engine-aware upstreams: what the model server itself says it holds.
//!
//! An upstream with `engine = "vllm" | "sglang" | "llama.cpp" | "tgi"` has
//! its Prometheus `/metrics` scraped every `scrape_interval` (each scrape
//! bounded by `scrape_timeout`): requests running, requests waiting in
//! the engine's own queue, and KV-cache usage where the engine publishes
//! it. They gate dispatch ([`Upstream::slot_gate`]): kiln keeps its queue
//! (fairness and priority still decide the order) and sends a replica
//! more only while its engine is below saturation (waiting ≤
//! `max_engine_waiting` and KV usage < `max_kv_cache`, the thresholds of
//! the Gateway API Inference Extension's saturation detector). Inside the
//! static `concurrency` ceiling an adaptive limit moves with the time to
//! first token kiln observes on the replica (AIMD against `target_ttft`,
//! where one is set), and below the engine's slots: an open gate lets kiln
//! fill what the engine runs at once (its slots as llama.cpp declares them
//! in `/props`, else the most it was seen running while requests waited
//! in it; plus `max_engine_waiting`), or, before it was
//! ever seen full, half as much again as kiln had there at the last scrape
//! (at least one more). (Filling up to the ceiling at once overshot the
//! engine between two scrapes, and the extra requests waited in the
//! engine's own FIFO, where priority no longer orders them.) The gate is
//! a number of kiln's own requests on the replica, which kiln counts as
//! they start and end; a scrape says how many of the engine's requests
//! are not kiln's (other clients, other gateways) and whether the engine
//! is full below its slots (KV memory), and those are taken off. So a
//! scrape that caught a request of kiln's waiting in the engine for a
//! moment holds nothing back for the scrape interval: the next request
//! goes as soon as one of kiln's own ends. A scrape that fails, or is
//! older than three intervals, falls back to the static ceiling, and
//! `/admin/queues` says so. `engine = "openai"` (the default) scrapes
//! nothing: `concurrency` alone bounds it.

use super::Upstream;
use crate::units::duration;
use std::time::{Duration, Instant};

/// Which model server an upstream is, for what its `/metrics` publish.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub enum Engine {
    /// Any OpenAI-compatible server: nothing is scraped.
    #[default]
    #[serde(rename = "openai")]
    OpenAi,
    #[serde(rename = "vllm")]
    Vllm,
    #[serde(rename = "sglang")]
    Sglang,
    #[serde(rename = "llama.cpp")]
    LlamaCpp,
    #[serde(rename = "tgi")]
    Tgi,
}

/// The series an engine publishes: running, waiting, KV-cache usage
/// (each a list of names, newest first; a 0–1 ratio for KV).
struct Series {
    running: &'static [&'static str],
    waiting: &'static [&'static str],
    kv: &'static [&'static str],
    /// How to turn the metrics on, for the error when they are missing.
    enable: &'static str,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::OpenAi => "openai",
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::LlamaCpp => "llama.cpp",
            Engine::Tgi => "tgi",
        }
    }

    fn series(self) -> Option<Series> {
        match self {
            Engine::OpenAi => None,
            Engine::Vllm => Some(Series {
                running: &["vllm:num_requests_running"],
                waiting: &["vllm:num_requests_waiting"],
                kv: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
                enable: "vLLM serves /metrics by default",
            }),
            Engine::Sglang => Some(Series {
                running: &["sglang:num_running_reqs"],
                waiting: &["sglang:num_queue_reqs"],
                kv: &["sglang:token_usage"],
                enable: "start SGLang with --enable-metrics",
            }),
            Engine::LlamaCpp => Some(Series {
                running: &["llamacpp:requests_processing"],
                waiting: &["llamacpp:requests_deferred"],
                kv: &["llamacpp:kv_cache_usage_ratio"],
                enable: "start llama-server with --metrics",
            }),
            Engine::Tgi => Some(Series {
                running: &["tgi_batch_current_size"],
                waiting: &["tgi_queue_size"],
                kv: &[],
                enable: "TGI serves /metrics by default",
            }),
        }
    }

    /// Where the engine says how many requests it runs at once, and the
    /// JSON field: llama.cpp's `llama-server` answers `GET /props` with
    /// `total_slots` (its `--parallel`). The others publish no such figure
    /// (vLLM's `max_num_seqs` is not in its metrics), so their slots are
    /// learnt from scrapes that show requests waiting.
    fn declares_slots(self) -> Option<(&'static str, &'static str)> {
        match self {
            Engine::LlamaCpp => Some(("/props", "total_slots")),
            _ => None,
        }
    }

    /// Whether its metrics are scraped.
    pub fn scraped(self) -> bool {
        self.series().is_some()
    }
}

/// What an engine said it holds, at one scrape.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct EngineLoad {
    pub running: f64,
    pub waiting: f64,
    /// KV-cache usage, 0–1, where the engine publishes it.
    pub kv_cache: Option<f64>,
}

/// Reads an engine's load from its Prometheus text. Series of one name
/// (per model, per data-parallel rank) are summed for requests; the
/// largest KV usage is taken.
pub fn parse_metrics(engine: Engine, text: &str) -> Result<EngineLoad, String> {
    let Some(series) = engine.series() else {
        return Err(format!("engine `{}` publishes no load", engine.name()));
    };
    let mut running: Option<f64> = None;
    let mut waiting: Option<f64> = None;
    let mut kv: Option<(usize, f64)> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = sample(line) else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        if series.running.contains(&name) {
            *running.get_or_insert(0.0) += value;
        } else if series.waiting.contains(&name) {
            *waiting.get_or_insert(0.0) += value;
        } else if let Some(rank) = series.kv.iter().position(|k| *k == name) {
            let v = if value > 1.0 { value / 100.0 } else { value }.clamp(0.0, 1.0);
            kv = match kv {
                Some((r, _)) if rank < r => Some((rank, v)),
                Some((r, old)) if rank == r => Some((r, old.max(v))),
                None => Some((rank, v)),
                keep => keep,
            };
        }
    }
    let missing = |names: &[&str]| {
        format!(
            "its /metrics has no `{}` ({}; is `engine = \"{}\"` right?)",
            names.join("` or `"),
            series.enable,
            engine.name()
        )
    };
    Ok(EngineLoad {
        running: running.ok_or_else(|| missing(series.running))?,
        waiting: waiting.ok_or_else(|| missing(series.waiting))?,
        kv_cache: kv.map(|(_, v)| v),
    })
}

/// One sample line: its metric name and value (`name{labels} value [ts]`).
fn sample(line: &str) -> Option<(&str, f64)> {
    let (name, rest) = match line.find(['{', ' ', '\t']) {
        Some(i) if line.as_bytes().get(i) == Some(&b'{') => {
            // Skip the labels: up to the `}` outside a quoted value.
            let mut quoted = false;
            let mut escaped = false;
            let mut end = None;
            for (j, c) in line[i..].char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if quoted => escaped = true,
                    '"' => quoted = !quoted,
                    '}' if !quoted => {
                        end = Some(i + j);
                        break;
                    }
                    _ => {}
                }
            }
            (&line[..i], &line[end? + 1..])
        }
        Some(i) => (&line[..i], &line[i..]),
        None => return None,
    };
    let value = rest.split_whitespace().next()?;
    let v = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().ok()?,
    };
    Some((name, v))
}

/// The adaptive limit inside the static ceiling: additive increase (one
/// slot per limit's worth of first tokens within target), multiplicative
/// decrease (×0.8, at most once per target's time) when a first token
/// comes later than `target`.
#[derive(Debug, Clone)]
pub(super) struct Aimd {
    limit: f64,
    ceiling: u32,
    target: Option<Duration>,
    last_decrease: Option<Instant>,
}

impl Aimd {
    pub(super) fn new(ceiling: u32, target: Option<Duration>) -> Aimd {
        Aimd {
            limit: f64::from(ceiling.max(1)),
            ceiling: ceiling.max(1),
            target,
            last_decrease: None,
        }
    }

    pub(super) fn limit(&self) -> u32 {
        (self.limit.floor() as u32).clamp(1, self.ceiling)
    }

    pub(super) fn observe(&mut self, ttft: Duration, now: Instant) {
        let Some(target) = self.target else {
            return;
        };
        if ttft > target {
            let recent = self
                .last_decrease
                .is_some_and(|t| now.saturating_duration_since(t) < target);
            if !recent {
                self.limit = (self.limit * 0.8).max(1.0);
                self.last_decrease = Some(now);
            }
        } else {
            self.limit = (self.limit + 1.0 / self.limit.max(1.0)).min(f64::from(self.ceiling));
        }
    }
}

/// The latest scrape and the adaptive limit of one upstream.
#[derive(Debug)]
pub(super) struct EngineState {
    pub(super) last: Option<(EngineLoad, Instant)>,
    /// The most requests the engine was seen running while others waited
    /// in it: its slots (`None` until it was seen full).
    pub(super) slots: Option<f64>,
    /// Requests the engine held at the last scrape that were not this
    /// gateway's (other clients, other replicas of a fleet).
    pub(super) others: f64,
    /// Whether the engine's declared slots are still to be read
    /// ([`Engine::declares_slots`]): until it answers once.
    pub(super) ask_slots: bool,
    /// Why the last scrape failed, if it did.
    pub(super) error: Option<String>,
    pub(super) aimd: Aimd,
}

impl EngineState {
    pub(super) fn new(ceiling: u32, target: Option<Duration>) -> EngineState {
        EngineState {
            last: None,
            slots: None,
            others: 0.0,
            ask_slots: true,
            error: None,
            aimd: Aimd::new(ceiling, target),
        }
    }
}

/// The engine's slots as far as scrapes have shown them: a scrape with
/// requests waiting shows the engine full, running all it can.
pub(super) fn learn_slots(slots: Option<f64>, load: &EngineLoad) -> Option<f64> {
    if load.waiting > 0.0 && load.running >= 1.0 {
        Some(slots.map_or(load.running, |s| s.max(load.running)))
    } else {
        slots
    }
}

/// The slots an engine declares in its JSON answer (`field`, a whole
/// number from 1 to 4,096), if it does.
pub(super) fn declared_slots(body: &[u8], field: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let n = v.get(field)?.as_f64()?;
    (n.fract() == 0.0 && (1.0..=4096.0).contains(&n)).then_some(n)
}

/// Requests the engine held that were not this gateway's: what it ran
/// and queued beyond the `mine` kiln held there while the scrape was in
/// flight (the larger count of its start and end, so a request of
/// kiln's still in transit is never read as someone else's).
pub(super) fn others(load: &EngineLoad, mine: u32) -> f64 {
    let n = load.running + load.waiting - f64::from(mine);
    if n.is_finite() {
        n.max(0.0)
    } else {
        0.0
    }
}

/// How many of kiln's own requests the engine may hold with the gate
/// open. Once its slots are known: its slots (only as many as it runs,
/// while more than `max_waiting` wait in it: full below its slots, e.g.
/// of KV memory) and the waiting it allows, less what other clients hold
/// there. Before: half as much again as kiln had there at the last
/// scrape, at least one more (a ramp that reaches a large engine's slots
/// in a few scrapes and overshoots a small one by at most half).
pub(super) fn fill_below_slots(
    load: &EngineLoad,
    slots: Option<f64>,
    max_waiting: u32,
    others: f64,
) -> u32 {
    let n = match slots {
        Some(s) => {
            let runs = if load.waiting > f64::from(max_waiting) {
                s.min(load.running)
            } else {
                s
            };
            runs + f64::from(max_waiting) - others
        }
        None => {
            let mine = (load.running - others).max(0.0);
            mine + (mine / 2.0).floor().max(1.0)
        }
    };
    if n.is_finite() {
        (n.floor().max(0.0) as u32).max(u32::from(slots.is_none()))
    } else {
        1
    }
}

/// Feeds a time to first token to the adaptive limit.
pub(super) fn observe_ttft(state: &std::sync::Mutex<EngineState>, ttft: Duration) {
    lock(state).aimd.observe(ttft, Instant::now());
}

fn lock(m: &std::sync::Mutex<EngineState>) -> std::sync::MutexGuard<'_, EngineState> {
    // Every update is a whole assignment: a poisoned state is still whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the engine gate decided for a replica, for `/admin/queues`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineStatus {
    pub engine: &'static str,
    /// `ok` (below saturation: sending up to `cap`), `saturated` (requests
    /// wait in the engine or its KV memory is full: kiln holds at most
    /// `cap` of its own there, 0 for KV), `fallback` (no fresh scrape: the
    /// static `concurrency`).
    pub state: &'static str,
    /// The slots kiln may fill now.
    pub cap: u32,
    /// The adaptive limit and the static ceiling it moves under.
    pub limit: u32,
    pub ceiling: u32,
    /// The engine's slots, as it declared them or as scrapes showed them
    /// (not known until it was seen full).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<EngineLoad>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scraped_ms_ago: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Upstream {
    /// The engine this upstream runs.
    pub fn engine(&self) -> Engine {
        self.cfg.engine
    }

    /// The slots kiln may fill on this replica now, and why: the adaptive
    /// limit below the engine's slots (less what other clients hold
    /// there), what the engine runs while requests wait in it, none while
    /// its KV memory is full or it queues before its slots are known, the
    /// static `concurrency` without a fresh scrape. `None` for an upstream whose engine is not scraped
    /// (its `concurrency` alone bounds it).
    pub fn slot_gate(&self) -> Option<EngineStatus> {
        if !self.cfg.engine.scraped() {
            return None;
        }
        let ceiling = self.cfg.concurrency.max(1);
        let stale_after = self.cfg.scrape_interval.saturating_mul(3);
        let st = lock(&self.engine_state);
        let limit = st.aimd.limit();
        let now = Instant::now();
        let base = EngineStatus {
            engine: self.cfg.engine.name(),
            state: "fallback",
            cap: ceiling,
            limit,
            ceiling,
            slots: st.slots,
            load: st.last.map(|(l, _)| l),
            scraped_ms_ago: st
                .last
                .map(|(_, at)| now.saturating_duration_since(at).as_millis() as u64),
            reason: None,
        };
        let fresh = match (&st.error, st.last) {
            (Some(e), _) => Err(format!(
                "the last scrape failed ({e}): the static concurrency bounds it"
            )),
            (None, None) => Err("not scraped yet: the static concurrency bounds it".into()),
            (None, Some((load, at))) if now.saturating_duration_since(at) > stale_after => {
                let _ = load;
                Err(format!(
                    "no scrape for {}: the static concurrency bounds it",
                    duration::format(now.saturating_duration_since(at))
                ))
            }
            (None, Some((load, _))) => Ok(load),
        };
        let load = match fresh {
            Ok(load) => load,
            Err(reason) => {
                return Some(EngineStatus {
                    reason: Some(reason),
                    ..base
                })
            }
        };
        let over_queue = load.waiting > f64::from(self.cfg.max_engine_waiting);
        let over_kv = load.kv_cache.is_some_and(|kv| kv >= self.cfg.max_kv_cache);
        let queued = || {
            format!(
                "{} requests wait in the engine (more than max_engine_waiting = {})",
                load.waiting, self.cfg.max_engine_waiting
            )
        };
        // KV memory full, or requests waiting in an engine whose slots are
        // not known yet: nothing new until a scrape says otherwise.
        if over_kv || (over_queue && st.slots.is_none()) {
            let why = if over_kv {
                format!(
                    "KV cache {:.0}% used (max_kv_cache = {:.0}%)",
                    load.kv_cache.unwrap_or(0.0) * 100.0,
                    self.cfg.max_kv_cache * 100.0
                )
            } else {
                queued()
            };
            return Some(EngineStatus {
                state: "saturated",
                cap: 0,
                reason: Some(format!("{why}: nothing new is sent")),
                ..base
            });
        }
        let room = fill_below_slots(&load, st.slots, self.cfg.max_engine_waiting, st.others);
        let cap = limit.min(room);
        if over_queue {
            // Its slots are known: what waits there is kiln's own overshoot
            // (kiln holds more than `cap` and sends again as its own
            // requests end, not a scrape later) or the engine is full below
            // its slots (`cap` follows what it runs).
            return Some(EngineStatus {
                state: "saturated",
                cap,
                reason: Some(format!(
                    "{}: kiln keeps at most {cap} of its own requests there",
                    queued()
                )),
                ..base
            });
        }
        Some(EngineStatus {
            state: "ok",
            cap,
            ..base
        })
    }

    /// One scrape now: `GET {url}{metrics_path}` within `scrape_timeout`;
    /// what it read (or why it failed) is kept for [`Upstream::slot_gate`].
    pub async fn scrape(&self) -> Result<EngineLoad, String> {
        let engine = self.cfg.engine;
        let held_before = self.meter.holding();
        let request = self.get(&self.cfg.metrics_path).map_err(|e| e.to_string());
        let fetch = async {
            let resp = self
                .client
                .send(request?)
                .await
                .map_err(|e| super::error::error_chain(&e))?;
            let status = resp.status().as_u16();
            let (bytes, _) = super::read_body(resp, super::MAX_ERROR_BODY * 16)
                .await
                .map_err(|e| super::error::error_chain(&e))?;
            if !(200..300).contains(&status) {
                return Err(format!("{} answered HTTP {status}", self.cfg.metrics_path));
            }
            parse_metrics(engine, &String::from_utf8_lossy(&bytes))
        };
        let outcome = match tokio::time::timeout(self.cfg.scrape_timeout, fetch).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "no answer within scrape_timeout ({})",
                duration::format(self.cfg.scrape_timeout)
            )),
        };
        let mine = held_before.max(self.meter.holding());
        let ask = outcome.is_ok() && lock(&self.engine_state).ask_slots;
        let declared = match self.cfg.engine.declares_slots() {
            Some((path, field)) if ask => self.ask_slots(path, field).await,
            _ => None,
        };
        let mut st = lock(&self.engine_state);
        if let Some(answer) = declared {
            st.ask_slots = false;
            if let Some(n) = answer {
                st.slots = Some(st.slots.map_or(n, |s| s.max(n)));
            }
        }
        match &outcome {
            Ok(load) => {
                st.others = others(load, mine);
                if st.error.take().is_some() {
                    tracing::info!(upstream = &*self.name, "engine metrics scraped again");
                }
                st.last = Some((*load, Instant::now()));
                st.slots = learn_slots(st.slots, load);
            }
            Err(e) => {
                if st.error.is_none() {
                    tracing::warn!(upstream = &*self.name, error = %e, "engine metrics scrape failed: the static concurrency bounds it");
                }
                st.error = Some(e.clone());
            }
        }
        outcome
    }

    /// Asks the engine how many requests it runs at once (`GET path`,
    /// within `scrape_timeout`): `None` when it could not be asked (ask
    /// again at the next scrape), `Some(None)` when it answered without
    /// the figure (do not ask again).
    async fn ask_slots(&self, path: &str, field: &str) -> Option<Option<f64>> {
        let request = self.get(path).ok();
        let fetch = async {
            let resp = self.client.send(request?).await.ok()?;
            let ok = resp.status().is_success();
            // `/props` carries the chat template: a few KB, rarely more.
            let (bytes, cut) = super::read_body(resp, 4 << 20).await.ok()?;
            Some(
                (ok && !cut)
                    .then(|| declared_slots(&bytes, field))
                    .flatten(),
            )
        };
        let answer = tokio::time::timeout(self.cfg.scrape_timeout, fetch)
            .await
            .ok()
            .flatten();
        if let Some(Some(n)) = answer {
            tracing::info!(
                upstream = &*self.name,
                slots = n,
                "engine declares its slots"
            );
        }
        answer
    }

    /// A first token came `ttft` after the request took its slot here:
    /// feeds the adaptive limit (requests' [`super::Hold`]s do this).
    pub fn observe_ttft(&self, ttft: Duration) {
        if self.cfg.engine.scraped() {
            observe_ttft(&self.engine_state, ttft);
        }
    }

    /// Spawns the periodic scrape (the first at once) for an engine that
    /// is scraped; stops with the last `Arc` of the upstream. `None`
    /// otherwise, or without a Tokio runtime.
    pub fn spawn_scrapes(self: &std::sync::Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        if !self.cfg.engine.scraped() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let weak = std::sync::Arc::downgrade(self);
        let period = self.cfg.scrape_interval;
        Some(runtime.spawn(async move {
            let mut ticker = tokio::time::interval(period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(upstream) = weak.upgrade() else {
                    break;
                };
                let _ = upstream.scrape().await;
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:kv_cache_usage_perc{model_name="m {odd} \"label\""} 0.25
vllm:prompt_tokens_total{model_name="m"} 1e6
"#;

    #[test]
    fn reads_each_engines_series() {
        let l = parse_metrics(Engine::Vllm, VLLM).unwrap();
        assert_eq!((l.running, l.waiting, l.kv_cache), (5.0, 4.0, Some(0.25)));
        let sg = "sglang:num_running_reqs{model_name=\"m\"} 7\nsglang:num_queue_reqs{model_name=\"m\"} 1\nsglang:token_usage{model_name=\"m\"} 0.9\n";
        let l = parse_metrics(Engine::Sglang, sg).unwrap();
        assert_eq!((l.running, l.waiting, l.kv_cache), (7.0, 1.0, Some(0.9)));
        let ll = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 0\n";
        let l = parse_metrics(Engine::LlamaCpp, ll).unwrap();
        assert_eq!((l.running, l.waiting, l.kv_cache), (2.0, 0.0, None));
        let tgi = "tgi_batch_current_size 4 1700000000\ntgi_queue_size 9\n";
        let l = parse_metrics(Engine::Tgi, tgi).unwrap();
        assert_eq!((l.running, l.waiting), (4.0, 9.0));
    }

    #[test]
    fn a_missing_series_says_how_to_turn_it_on() {
        let e = parse_metrics(Engine::Sglang, "up 1\n").unwrap_err();
        assert!(
            e.contains("sglang:num_running_reqs") && e.contains("--enable-metrics"),
            "{e}"
        );
        assert!(parse_metrics(Engine::OpenAi, VLLM).is_err());
    }

    /// The open gate fills below the engine's slots: half as much again as
    /// kiln had there (at least one more) until it is seen full, then its
    /// slots (plus the waiting allowed), learnt from scrapes that show
    /// requests waiting; a scrape with nothing waiting teaches nothing.
    #[test]
    fn the_gate_fills_what_the_engine_runs_not_the_ceiling() {
        let load = |running: f64, waiting: f64| EngineLoad {
            running,
            waiting,
            kv_cache: None,
        };
        assert_eq!(fill_below_slots(&load(0.0, 0.0), None, 0, 0.0), 1);
        assert_eq!(fill_below_slots(&load(3.0, 0.0), None, 0, 0.0), 4);
        // A large engine is reached in a few scrapes, not one a scrape.
        assert_eq!(fill_below_slots(&load(100.0, 0.0), None, 0, 0.0), 150);
        let mut slots = None;
        for l in [load(2.0, 0.0), load(3.0, 0.0)] {
            slots = learn_slots(slots, &l);
        }
        assert_eq!(slots, None, "never seen full");
        slots = learn_slots(slots, &load(4.0, 2.0));
        assert_eq!(slots, Some(4.0));
        // Fewer running later (requests ending) does not shrink it.
        slots = learn_slots(slots, &load(2.0, 1.0));
        assert_eq!(slots, Some(4.0));
        assert_eq!(fill_below_slots(&load(1.0, 0.0), slots, 0, 0.0), 4);
        assert_eq!(fill_below_slots(&load(1.0, 0.0), slots, 2, 0.0), 6);
        // Garbage from a scrape never opens more than one.
        assert_eq!(fill_below_slots(&load(f64::NAN, 0.0), None, 0, 0.0), 1);
    }

    /// A request of kiln's caught waiting in the engine (it was sent as
    /// one of kiln's ended, before the engine freed that slot) does not
    /// close the gate until the next scrape: kiln keeps filling the
    /// engine's slots as its own requests end. An engine full below its
    /// slots (KV memory) is filled only to what it runs, and what other
    /// clients hold there is taken off kiln's part.
    #[test]
    fn the_gate_counts_kilns_own_requests_and_takes_off_the_others() {
        let load = |running: f64, waiting: f64| EngineLoad {
            running,
            waiting,
            kv_cache: None,
        };
        let slots = Some(4.0);
        // Kiln held 5: 4 running, its fifth waiting a moment.
        let l = load(4.0, 1.0);
        assert_eq!(others(&l, 5), 0.0);
        assert_eq!(fill_below_slots(&l, slots, 0, others(&l, 5)), 4);
        // Full below its slots: 2 run, 3 wait, all kiln's.
        let l = load(2.0, 3.0);
        assert_eq!(fill_below_slots(&l, slots, 0, others(&l, 5)), 2);
        // Another client runs 3 of the 4 slots: kiln may hold 1.
        let l = load(4.0, 0.0);
        assert_eq!(others(&l, 1), 3.0);
        assert_eq!(fill_below_slots(&l, slots, 0, others(&l, 1)), 1);
        // And none while it holds them all and queues more.
        let l = load(4.0, 2.0);
        assert_eq!(fill_below_slots(&l, slots, 0, others(&l, 0)), 0);
        // A request of kiln's not yet arrived there is not someone else's.
        assert_eq!(others(&load(1.0, 0.0), 2), 0.0);
        assert_eq!(others(&load(f64::NAN, 0.0), 0), 0.0);
        // While ramping, the others' requests are not kiln's to grow from.
        assert_eq!(fill_below_slots(&load(6.0, 0.0), None, 0, 4.0), 3);
    }

    /// llama-server's `/props` says its slots; anything else says nothing.
    #[test]
    fn declared_slots_are_read_from_the_engines_answer() {
        let props = br#"{"default_generation_settings":{"n_ctx":4096},"total_slots":4,"chat_template":"{{x}}"}"#;
        assert_eq!(declared_slots(props, "total_slots"), Some(4.0));
        for bad in [
            &br#"{"total_slots":0}"#[..],
            br#"{"total_slots":2.5}"#,
            br#"{"total_slots":"4"}"#,
            br#"{"total_slots":1e9}"#,
            br#"{}"#,
            b"<html>not found</html>",
        ] {
            assert_eq!(declared_slots(bad, "total_slots"), None);
        }
        assert_eq!(
            Engine::LlamaCpp.declares_slots().map(|d| d.0),
            Some("/props")
        );
        assert_eq!(Engine::Vllm.declares_slots(), None);
    }

    /// A scrape's numbers, hostile ones included.
    fn any_count() -> impl proptest::strategy::Strategy<Value = f64> {
        use proptest::prelude::*;
        prop_oneof![
            8 => (0u32..300).prop_map(f64::from),
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(-3.0),
            1 => Just(1e300),
        ]
    }

    proptest::proptest! {
        /// Whatever a scrape says: once the engine's slots are known, kiln's
        /// part and the other clients' never add up to more than its slots
        /// and the waiting allowed, kiln keeps what the engine runs while
        /// it is full below its slots, more others never give kiln more,
        /// and before the slots are known the ramp always sends at least
        /// one and at most half again of what kiln holds, one more.
        #[test]
        fn the_gate_never_overfills_the_engine(
            running in any_count(),
            waiting in any_count(),
            slots in proptest::option::of(1u32..512),
            max_waiting in 0u32..8,
            mine in 0u32..600,
            more in 0u32..50,
        ) {
            use proptest::prop_assert;
            let l = EngineLoad { running, waiting, kv_cache: None };
            let o = others(&l, mine);
            prop_assert!(o.is_finite() && o >= 0.0, "others {o}");
            let slots = slots.map(f64::from);
            let cap = fill_below_slots(&l, slots, max_waiting, o);
            let fewer = fill_below_slots(&l, slots, max_waiting, o + f64::from(more));
            prop_assert!(fewer <= cap, "more others gave more: {fewer} > {cap}");
            match slots {
                Some(s) => {
                    let room = s + f64::from(max_waiting);
                    prop_assert!(f64::from(cap) + o.min(room) <= room, "cap {cap} + others {o} > {room}");
                    if running.is_finite() && waiting.is_finite() && running >= 0.0 && waiting >= 0.0 {
                        let floor = (s.min(running) + f64::from(max_waiting) - o).floor().max(0.0);
                        prop_assert!(f64::from(cap) >= floor.min(f64::from(u32::MAX)), "cap {cap} below {floor}");
                    }
                }
                None => {
                    prop_assert!(cap >= 1, "the ramp stalled");
                    let held = (running - o).max(0.0);
                    if held.is_finite() && held < 1e9 {
                        prop_assert!(f64::from(cap) <= held + (held / 2.0).floor().max(1.0), "ramp {cap} from {held}");
                        prop_assert!(f64::from(cap) > held, "ramp {cap} does not grow from {held}");
                    }
                }
            }
        }
    }

    #[test]
    fn aimd_backs_off_on_late_first_tokens_and_creeps_back() {
        let mut a = Aimd::new(10, Some(Duration::from_millis(100)));
        let t0 = Instant::now();
        a.observe(Duration::from_millis(300), t0);
        assert_eq!(a.limit(), 8);
        // A burst of late tokens decreases once per target's time.
        a.observe(Duration::from_millis(300), t0 + Duration::from_millis(10));
        assert_eq!(a.limit(), 8);
        a.observe(Duration::from_millis(300), t0 + Duration::from_millis(200));
        assert_eq!(a.limit(), 6);
        for i in 0..100 {
            a.observe(
                Duration::from_millis(50),
                t0 + Duration::from_millis(300 + i),
            );
        }
        assert_eq!(a.limit(), 10, "capped by the ceiling");
        // No target: fixed at the ceiling.
        let mut b = Aimd::new(4, None);
        b.observe(Duration::from_secs(9), t0);
        assert_eq!(b.limit(), 4);
    }
}
