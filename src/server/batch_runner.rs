//! The batch runner: one task that moves batches through their lifecycle
//! and feeds their items to the gateway's request path.
//!
//! **Bounded.** At most `[batch] max_in_flight` items are handed to the
//! scheduler at once, shared evenly between the running batches; the rest
//! stay in the store and are read a page at a time. The gateway's memory
//! for a batch is what the scheduler holds, not the file.
//!
//! **Scheduled, not pushed.** An item is an ordinary request of its
//! batch's tenant with the header `x-kiln-batch` and the tag `batch`; its
//! deadline is what is left of the batch's window. The policy decides its
//! tier, quotas and fair share hold, and the scheduler orders it
//! earliest-deadline-first, backfills it into idle capacity and preempts
//! it for interactive work. An item the gateway refuses for now (429 or
//! 503: quota, saturation, a deadline it cannot meet yet) waits as long as
//! the refusal asks and tries again, until the window ends.
//!
//! **Crash-safe.** An item's result is written once ([`crate::batch::store`]);
//! after a restart every batch resumes from its items without a result, so
//! items that were in flight at the crash run again.

use super::openai::Endpoint;
use super::App;
use crate::batch::store::{ItemResult, Store, StoreError};
use crate::batch::{BatchRow, BatchStatus, ItemLine};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};
use tokio::task::AbortHandle;

/// What the gateway keeps for batches: the store, and a bell that wakes
/// the runner when a batch is created or cancelled.
pub struct Batches {
    pub store: Store,
    pub wake: Arc<Notify>,
    /// Items in flight per batch, for listings (the runner's count).
    pub in_flight: std::sync::Mutex<HashMap<String, u64>>,
}

impl Batches {
    pub fn new(store: Store) -> Batches {
        Batches {
            store,
            wake: Arc::new(Notify::new()),
            in_flight: std::sync::Mutex::new(HashMap::new()),
        }
    }

    pub fn in_flight_of(&self, batch: &str) -> u64 {
        self.in_flight
            .lock()
            .ok()
            .and_then(|m| m.get(batch).copied())
            .unwrap_or(0)
    }
}

pub use crate::batch::now_s;

/// A finished item, reported to the runner.
struct Done {
    batch: String,
    line: u64,
    /// Wrote a new result (false: it already had one, or the store failed).
    wrote: bool,
}

/// One running batch, as the runner tracks it.
struct Live {
    in_flight: HashMap<u64, AbortHandle>,
    /// The next input line to look at (lines before it are done or in
    /// flight).
    cursor: u64,
    /// No pending lines are left past the cursor.
    exhausted: bool,
    /// When recent items finished, for the observed rate.
    finished: VecDeque<Instant>,
    last_forecast: Option<Instant>,
}

impl Live {
    fn new() -> Live {
        Live {
            in_flight: HashMap::new(),
            cursor: 0,
            exhausted: false,
            finished: VecDeque::new(),
            last_forecast: None,
        }
    }

    fn abort_all(&mut self) {
        for (_, h) in self.in_flight.drain() {
            h.abort();
        }
    }
}

/// Starts the runner on the current runtime.
pub fn spawn(app: Arc<App>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(app))
}

async fn run(app: Arc<App>) {
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
    let mut live: HashMap<String, Live> = HashMap::new();
    let wake = app.batches.wake.clone();
    // Item tasks live in this set: when the runner stops (the gateway
    // stops), they stop with it.
    let mut tasks = tokio::task::JoinSet::new();
    // The fleet's batch slots, refreshed every few seconds.
    let mut slots: (Option<Instant>, usize) = (None, 0);
    loop {
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            d = done_rx.recv() => {
                if let Some(d) = d {
                    finished(&mut live, d);
                }
                while let Ok(d) = done_rx.try_recv() {
                    finished(&mut live, d);
                }
            }
            _ = wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        if let Err(e) = step(&app, &mut live, &done_tx, &mut tasks, &mut slots).await {
            tracing::warn!(error = %e, "batch runner: the store failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if let Ok(mut m) = app.batches.in_flight.lock() {
            m.clear();
            for (id, l) in &live {
                m.insert(id.clone(), l.in_flight.len() as u64);
            }
        }
    }
}

fn finished(live: &mut HashMap<String, Live>, d: Done) {
    if let Some(l) = live.get_mut(&d.batch) {
        l.in_flight.remove(&d.line);
        if d.wrote {
            let now = Instant::now();
            l.finished.push_back(now);
            while l
                .finished
                .front()
                .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60))
                || l.finished.len() > 10_000
            {
                l.finished.pop_front();
            }
        }
    }
}

/// One pass over the batches with work left.
async fn step(
    app: &Arc<App>,
    live: &mut HashMap<String, Live>,
    done: &mpsc::UnboundedSender<Done>,
    tasks: &mut tokio::task::JoinSet<()>,
    slots: &mut (Option<Instant>, usize),
) -> Result<(), StoreError> {
    let store = app.batches.store.clone();
    let active = store.run(|s| s.active()).await?;
    // Batches no longer active (finished elsewhere, or gone) drop out.
    live.retain(|id, l| {
        let keep = active.iter().any(|b| &b.id == id);
        if !keep {
            l.abort_all();
        }
        keep
    });
    let running = active
        .iter()
        .filter(|b| b.status == BatchStatus::InProgress || b.status == BatchStatus::Validating)
        .count()
        .max(1);
    // Enough items to keep every batch slot of the fleet full with as
    // many again waiting (so a finished item's slot refills at once),
    // never more than `[batch] max_in_flight`: what the gateway holds for
    // batches is bounded by the scheduler's capacity, not by the files.
    if slots.0.is_none_or(|t| t.elapsed() > Duration::from_secs(2)) {
        if let Some(s) = app.exec.snapshot().await {
            slots.1 = s
                .replicas
                .iter()
                .filter(|r| r.up && !r.draining)
                .map(|r| r.slots as usize)
                .sum::<usize>();
        }
        slots.0 = Some(Instant::now());
    }
    let slots = slots.1;
    let cap = app.config.batch.max_in_flight.min((2 * slots).max(64));
    let share = (cap / running).max(1);
    let now = now_s();
    let mut gauges: Vec<(String, String, [u64; 4])> = Vec::new();
    let mut predicted: Vec<(String, String, String, bool)> = Vec::new();
    for b in &active {
        let l = live.entry(b.id.clone()).or_insert_with(Live::new);
        match b.status {
            BatchStatus::Validating => {
                let id = b.id.clone();
                store
                    .run(move |s| {
                        s.transition(
                            &id,
                            &[BatchStatus::Validating],
                            BatchStatus::InProgress,
                            now,
                        )
                    })
                    .await?;
            }
            BatchStatus::InProgress if now >= b.expires_at => {
                l.abort_all();
                close(app, b, Closing::Expired).await?;
            }
            BatchStatus::InProgress => {
                // Every result of a running batch is counted (only a
                // cancel writes uncounted ones, and ends the batch).
                let had = b.counts.completed + b.counts.failed;
                if had >= b.counts.total {
                    let id = b.id.clone();
                    store
                        .run(move |s| {
                            s.transition(
                                &id,
                                &[BatchStatus::InProgress],
                                BatchStatus::Finalizing,
                                now,
                            )?;
                            s.finalize(&id, BatchStatus::Completed, now)
                        })
                        .await?;
                    continue;
                }
                top_up(app, b, l, share, done, tasks).await?;
                forecast(app, b, l, had).await?;
            }
            BatchStatus::Cancelling => {
                l.abort_all();
                close(app, b, Closing::Cancelled).await?;
            }
            BatchStatus::Finalizing => {
                let id = b.id.clone();
                store
                    .run(move |s| s.finalize(&id, BatchStatus::Completed, now))
                    .await?;
            }
            _ => {}
        }
        let tenant = b.owner.clone().unwrap_or_else(|| "none".into());
        let tier = b.tier.clone().unwrap_or_else(|| "none".into());
        let flying = l.in_flight.len() as u64;
        let done_n = b.counts.completed + b.counts.failed;
        let pending = b.counts.total.saturating_sub(done_n + flying);
        gauges.push((
            tenant.clone(),
            tier.clone(),
            [pending, flying, b.counts.completed, b.counts.failed],
        ));
        predicted.push((b.id.clone(), tenant, tier, b.predicted_miss()));
    }
    let g: Vec<(&str, &str, [u64; 4])> = gauges
        .iter()
        .map(|(a, b, n)| (a.as_str(), b.as_str(), *n))
        .collect();
    let p: Vec<(&str, &str, &str, bool)> = predicted
        .iter()
        .map(|(a, b, c, m)| (a.as_str(), b.as_str(), c.as_str(), *m))
        .collect();
    app.metrics.set_batches(&g, &p);
    Ok(())
}

/// Hands more of a batch's items to the request path, up to its share.
async fn top_up(
    app: &Arc<App>,
    b: &BatchRow,
    l: &mut Live,
    share: usize,
    done: &mpsc::UnboundedSender<Done>,
    tasks: &mut tokio::task::JoinSet<()>,
) -> Result<(), StoreError> {
    if l.exhausted {
        if !l.in_flight.is_empty() {
            return Ok(());
        }
        // Everything past the cursor was handed out and has ended; an item
        // still without a result (its store write failed) is picked up
        // again from the start.
        l.cursor = 0;
        l.exhausted = false;
    }
    let room = share.saturating_sub(l.in_flight.len());
    // Refill in pages, not one item at a time.
    if room == 0 || (room < share / 4 && !l.in_flight.is_empty()) {
        return Ok(());
    }
    let (id, file, from) = (b.id.clone(), b.input_file_id.clone(), l.cursor);
    let want = room.max(1);
    let items = app
        .batches
        .store
        .run(move |s| s.pending(&id, &file, from, want + 64))
        .await?;
    let mut taken = 0;
    for it in items {
        if taken >= want {
            break;
        }
        l.cursor = it.line + 1;
        if l.in_flight.contains_key(&it.line) {
            continue;
        }
        let line = it.line;
        let h = tasks.spawn(item(app.clone(), b.clone(), it, done.clone()));
        l.in_flight.insert(line, h);
        taken += 1;
    }
    if taken < want {
        l.exhausted = true;
    }
    Ok(())
}

/// The endpoint of a stored batch.
fn endpoint_of(b: &BatchRow) -> Endpoint {
    super::batch_lines::endpoint(&b.endpoint).unwrap_or(Endpoint::Chat)
}

/// Runs one item to its result and stores it.
async fn item(app: Arc<App>, b: BatchRow, it: ItemLine, done: mpsc::UnboundedSender<Done>) {
    let r = serve(&app, &b, &it).await;
    let missed = r.missed;
    let store = app.batches.store.clone();
    let id = b.id.clone();
    let wrote = match store.run(move |s| s.put_result(&id, &r)).await {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(batch = %b.id, line = it.line, error = %e, "cannot store a batch result; the item will run again");
            false
        }
    };
    if wrote && missed {
        app.metrics.batch_deadline_misses(
            b.owner.as_deref().unwrap_or("none"),
            b.tier.as_deref().unwrap_or("none"),
            1,
        );
    }
    let _ = done.send(Done {
        batch: b.id,
        line: it.line,
        wrote,
    });
}

/// One result line's `id`.
fn request_line_id(b: &BatchRow, line: u64) -> String {
    format!("batch_req_{}_{line}", crate::batch::short_id(&b.id))
}

/// Serves an item through the gateway, retrying what it refuses for now.
async fn serve(app: &Arc<App>, b: &BatchRow, it: &ItemLine) -> ItemResult {
    let body = serde_json::from_str::<Value>(&it.text)
        .ok()
        .and_then(|mut v| v.get_mut("body").map(Value::take))
        .unwrap_or(Value::Null);
    let speed = app.speed;
    let mut upstream_failures = 0u32;
    loop {
        let left_s = b.expires_at as f64 - crate::clock::unix_ms() / 1000.0;
        if left_s <= 0.0 {
            return expired_line(b, it);
        }
        let window = (left_s * speed * 1e6) as crate::sched::Micros;
        let resp = crate::server::routes::serve_batch_item(
            app.clone(),
            endpoint_of(b),
            b.owner.clone(),
            &b.id,
            body.clone(),
            window,
        )
        .await;
        let status = resp.status().as_u16();
        let (rid, gpu, retry_after) = {
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            (
                header("x-kiln-request-id"),
                header("x-kiln-gpu-seconds")
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .unwrap_or(0.0),
                header("retry-after").and_then(|v| v.parse::<f64>().ok()),
            )
        };
        let bytes = axum::body::to_bytes(resp.into_body(), 64 * 1024 * 1024)
            .await
            .unwrap_or_default();
        let body_v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        // Refused for now: wait as asked (in wall time) and try again.
        let transient = matches!(status, 429 | 503)
            || (matches!(status, 500 | 502 | 504) && {
                upstream_failures += 1;
                upstream_failures <= 3
            });
        if transient {
            let wait = retry_after.unwrap_or(1.0).clamp(0.05, 30.0) / speed.max(1.0);
            let left = b.expires_at as f64 - crate::clock::unix_ms() / 1000.0;
            if left <= wait {
                tokio::time::sleep(Duration::from_secs_f64(left.max(0.0))).await;
                return expired_line(b, it);
            }
            tokio::time::sleep(Duration::from_secs_f64(wait.max(0.01))).await;
            continue;
        }
        let ok = (200..300).contains(&status);
        let missed = crate::clock::unix_ms() / 1000.0 > b.expires_at as f64;
        let text = json!({
            "id": request_line_id(b, it.line),
            "custom_id": it.custom_id,
            "response": {
                "status_code": status,
                "request_id": rid,
                "body": body_v,
            },
            "error": null,
        })
        .to_string();
        return ItemResult {
            line: it.line,
            ok,
            text,
            gpu_seconds: gpu,
            missed,
        };
    }
}

fn expired_line(b: &BatchRow, it: &ItemLine) -> ItemResult {
    ItemResult {
        line: it.line,
        ok: false,
        text: unrun_line(b, it.line, &it.custom_id, Closing::Expired),
        gpu_seconds: 0.0,
        missed: true,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closing {
    Expired,
    Cancelled,
}

fn unrun_line(b: &BatchRow, line: u64, custom_id: &str, why: Closing) -> String {
    let (code, message) = match why {
        Closing::Expired => (
            "batch_expired",
            "This request could not be executed before the completion window expired.",
        ),
        Closing::Cancelled => (
            "batch_cancelled",
            "The batch was cancelled before this request ran.",
        ),
    };
    json!({
        "id": request_line_id(b, line),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": code, "message": message},
    })
    .to_string()
}

/// Ends an expired or cancelled batch: every item without a result gets
/// an error line saying why, then the files and the status, together.
async fn close(app: &Arc<App>, b: &BatchRow, why: Closing) -> Result<(), StoreError> {
    let b = b.clone();
    let missed = app
        .batches
        .store
        .run(move |s| {
            let mut from = 0;
            let mut missed = 0u64;
            loop {
                let page = s.pending(&b.id, &b.input_file_id, from, 1000)?;
                let Some(last) = page.last() else { break };
                from = last.line + 1;
                let rs: Vec<ItemResult> = page
                    .iter()
                    .map(|it| ItemResult {
                        line: it.line,
                        ok: false,
                        text: unrun_line(&b, it.line, &it.custom_id, why),
                        gpu_seconds: 0.0,
                        missed: why == Closing::Expired,
                    })
                    .collect();
                missed += s.put_results(&b.id, &rs, why == Closing::Expired)?;
            }
            let now = now_s();
            if why == Closing::Expired {
                s.transition(
                    &b.id,
                    &[BatchStatus::InProgress],
                    BatchStatus::Finalizing,
                    now,
                )?;
                s.finalize(&b.id, BatchStatus::Expired, now)?;
            } else {
                s.finalize(&b.id, BatchStatus::Cancelled, now)?;
            }
            Ok((missed, b))
        })
        .await?;
    let (n, b) = missed;
    if why == Closing::Expired && n > 0 {
        app.metrics.batch_deadline_misses(
            b.owner.as_deref().unwrap_or("none"),
            b.tier.as_deref().unwrap_or("none"),
            n,
        );
    }
    Ok(())
}

/// Refreshes a running batch's predicted finish: from its own recent pace
/// once it has one, else from the scheduler's drain estimate.
async fn forecast(app: &Arc<App>, b: &BatchRow, l: &mut Live, had: u64) -> Result<(), StoreError> {
    if l.last_forecast
        .is_some_and(|t| t.elapsed() < Duration::from_secs(2))
    {
        return Ok(());
    }
    l.last_forecast = Some(Instant::now());
    let left = b.counts.total.saturating_sub(had);
    let now = crate::clock::unix_ms() / 1000.0;
    let observed = match (l.finished.front(), l.finished.back()) {
        (Some(a), Some(z)) if l.finished.len() >= 20 => {
            let span = z.duration_since(*a).as_secs_f64();
            (span >= 2.0).then(|| (l.finished.len() - 1) as f64 / span)
        }
        _ => None,
    };
    let (finish, tier) = match observed {
        Some(rate) if rate > 0.0 => (Some(now + left as f64 / rate), None),
        _ => match estimate(app, b, left).await {
            Some((secs, tier)) => (Some(now + secs), Some(tier)),
            None => (None, None),
        },
    };
    let id = b.id.clone();
    app.batches
        .store
        .run(move |s| s.set_prediction(&id, finish, tier.as_deref()))
        .await
}

/// Lines of a file sampled for an estimate: evenly spread, at most 64.
pub fn sample_lines(s: &Store, file: &str, lines: u64) -> Result<Vec<String>, StoreError> {
    let n = lines.clamp(1, 64);
    let step = (lines / n).max(1);
    let mut out = Vec::new();
    for i in 0..n {
        if let Some((_, t)) = s.lines(file, i * step, 1)?.into_iter().next() {
            out.push(t);
        }
    }
    Ok(out)
}

/// The scheduler's estimate for the `items` a batch has left, from a
/// sample of its lines: wall seconds until they would be done, and their
/// tier.
pub async fn estimate(app: &Arc<App>, b: &BatchRow, items: u64) -> Option<(f64, String)> {
    let (file, total) = (b.input_file_id.clone(), b.counts.total);
    let sample = app
        .batches
        .store
        .run(move |s| sample_lines(s, &file, total))
        .await
        .ok()?;
    estimate_for_lines(app, &sample, b.owner.as_deref(), endpoint_of(b), items).await
}

/// The scheduler's drain estimate for `items` requests like these input
/// lines (their mean prompt and `max_tokens`), from `tenant`: wall seconds,
/// and the tier they classify into.
pub async fn estimate_for_lines(
    app: &Arc<App>,
    lines: &[String],
    tenant: Option<&str>,
    endpoint: Endpoint,
    items: u64,
) -> Option<(f64, String)> {
    let mut first: Option<super::openai::GenerationRequest> = None;
    let (mut prompt, mut max, mut n) = (0u64, 0u64, 0u64);
    for line in lines {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let Some(body) = v.get("body") else { continue };
        let Ok(greq) = super::openai::GenerationRequest::from_value(endpoint, body) else {
            continue;
        };
        prompt += app.tokenizer.prompt(&greq, 0).count;
        max += greq
            .requested_max_tokens()
            .unwrap_or(app.config.limits.default_max_tokens);
        n += 1;
        first.get_or_insert(greq);
    }
    let greq = first?;
    let req = crate::graph::Request {
        tenant: tenant.map(str::to_string),
        model: greq.model.clone(),
        headers: std::collections::BTreeMap::from([(
            crate::graph::BATCH_HEADER.to_string(),
            "estimate".to_string(),
        )]),
        tags: vec!["batch".into()],
        prompt_tokens: prompt / n.max(1),
        max_tokens: (max / n.max(1)).max(1),
        ..Default::default()
    };
    let (graph, f) = app.exec.forecast(req, items).await?;
    let f = f?;
    let tier = graph.tiers.get(f.tier as usize)?.name.clone();
    let speed = app.speed;
    Some((f.secs / speed, tier))
}
