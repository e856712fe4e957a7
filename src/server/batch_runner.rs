//! The batch runner: one task that moves batches through their lifecycle
//! and feeds their items to the gateway's request path.
//!
//! **Bounded.** At most `[batch] max_in_flight` items are handed to the
//! scheduler at once, split evenly between tenants' groups and within a
//! group in plan order (`super::batch_plan`: the batch that runs first
//! takes what it needs; `[batch] order = "even"` splits evenly); the rest
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
//!
//! **Failures stay the batch's.** An item the upstream answers with a 5xx
//! (or that times out) is tried at most `[batch] max_attempts` times, each
//! try after an exponential backoff with jitter, then goes to the error
//! file; a 4xx goes there at once. Its 5xx answers do not count against
//! the upstream's circuit breaker (`CallClass::Batch`), so a few poison
//! items cannot open the breaker online traffic needs; while a model's
//! upstreams are out of service (breaker open) no item of it is sent, and
//! a batch whose items keep failing pauses before sending more. Past the
//! failure budget (`[batch] max_failed_share`) the batch stops as `failed`.
//!
//! **A full store pauses, it does not spin.** A result that cannot be
//! written is kept and written again with backoff; meanwhile no item is
//! sent (a model call whose result cannot be stored is wasted GPU time).

use super::batch_plan::{endpoint_of, plan_rows, Placed, Plans, Recent, PACE_WINDOW};
use super::batch_writer::Writer;
use super::request::Outcome as Ended;
use super::App;
use crate::batch::store::{Finished, ItemResult, Store, StoreError};
use crate::batch::{BatchRow, BatchStatus, ItemLine};
use axum::response::IntoResponse;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Whether each model has a replica in service (up, its breaker
    /// letting requests through), from the runner's last snapshot. A model
    /// not listed is taken as in service.
    pub serving: std::sync::Mutex<HashMap<String, bool>>,
    /// Results waiting to be written because the store refused them: while
    /// any does, no item is sent.
    pub store_waiting: AtomicUsize,
    /// The planner's estimates and the runner's observed paces.
    pub plans: Plans,
    /// This replica's name on batch leases (a shared store).
    pub holder: String,
    /// The batches whose lease this replica holds (a shared store), each
    /// with its fencing token: an item's result is written only under the
    /// token it was sent with.
    pub held: std::sync::Mutex<HashMap<String, i64>>,
    /// The last renewal of the leases succeeded less than half a lease
    /// ago: while it is not so, no new item is sent (items in flight end
    /// and write under their token, or are fenced off).
    pub leases_fresh: std::sync::atomic::AtomicBool,
}

impl Batches {
    pub fn new(store: Store) -> Batches {
        Batches {
            store,
            wake: Arc::new(Notify::new()),
            in_flight: std::sync::Mutex::new(HashMap::new()),
            serving: std::sync::Mutex::new(HashMap::new()),
            store_waiting: AtomicUsize::new(0),
            plans: Plans::default(),
            holder: crate::batch::new_id("runner-"),
            held: std::sync::Mutex::new(HashMap::new()),
            leases_fresh: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Whether `model`'s items may be sent now.
    pub fn model_serving(&self, model: Option<&str>) -> bool {
        let Some(m) = model else { return true };
        self.serving
            .lock()
            .ok()
            .and_then(|s| s.get(m).copied())
            .unwrap_or(true)
    }

    /// Whether the store takes writes (no result is waiting for it).
    pub fn store_writable(&self) -> bool {
        self.store_waiting.load(Ordering::SeqCst) == 0
    }

    /// The fencing token of this replica's lease on `batch` (`None`: one
    /// gateway's own store, or no lease held).
    pub fn token(&self, batch: &str) -> Option<i64> {
        if !self.store.shared() {
            return None;
        }
        self.held.lock().ok().and_then(|h| h.get(batch).copied())
    }

    /// Gives up this replica's batch leases (a gateway that stops), so
    /// that another replica takes its batches at its next renewal instead
    /// of after the lease runs out. Bounded by the store's own timeout.
    pub async fn release_leases(&self) {
        if !self.store.shared() {
            return;
        }
        let holder = self.holder.clone();
        match self.store.run(move |s| s.release_all(&holder)).await {
            Ok(n) => {
                if n > 0 {
                    tracing::info!(batches = n, "batch runner: leases released on shutdown");
                }
            }
            Err(e) => tracing::warn!(error = %e,
                "batch runner: cannot release batch leases on shutdown; other replicas take them when they run out"),
        }
        if let Ok(mut h) = self.held.lock() {
            h.clear();
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

/// Where items end: their results go to the writer, then word of them to
/// the runner.
#[derive(Clone)]
struct Ends {
    done: mpsc::UnboundedSender<Done>,
    writer: Writer,
}

/// A finished item, reported to the runner.
struct Done {
    batch: String,
    line: u64,
    /// Wrote a new result (false: it already had one).
    wrote: bool,
    /// The result is a failure (error file).
    failed: bool,
}

/// One running batch, as the runner tracks it.
struct Live {
    in_flight: HashMap<u64, AbortHandle>,
    /// The next input line to look at (lines before it are done or in
    /// flight).
    cursor: u64,
    /// No pending lines are left past the cursor.
    exhausted: bool,
    /// Items finished lately, for the observed rate: per tenth of a
    /// second (when its first item finished, how many), so that a batch
    /// finishing thousands a second keeps all of [`PACE_WINDOW`] in a
    /// bounded list (timestamps each, capped, covered 3 s of it).
    finished: VecDeque<(Instant, usize)>,
    last_forecast: Option<Instant>,
    /// The model its items call (from its first item).
    model: Option<String>,
    /// Failed outcomes in a row: a batch whose items keep failing pauses.
    fail_streak: u32,
    /// No new item is sent before this.
    paused_until: Option<Instant>,
}

impl Live {
    fn new() -> Live {
        Live {
            in_flight: HashMap::new(),
            cursor: 0,
            exhausted: false,
            finished: VecDeque::new(),
            last_forecast: None,
            model: None,
            fail_streak: 0,
            paused_until: None,
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
    let ends = Ends {
        done: done_tx,
        writer: Writer::start(app.batches.store.clone(), app.batches.holder.clone()),
    };
    let mut live: HashMap<String, Live> = HashMap::new();
    let wake = app.batches.wake.clone();
    // Item tasks live in this set: when the runner stops (the gateway
    // stops), they stop with it.
    let mut tasks = tokio::task::JoinSet::new();
    // The fleet's batch slots, refreshed every few seconds.
    let mut slots: (Option<Instant>, usize) = (None, 0);
    // Consecutive failed passes (the store failing): the runner backs off.
    let mut failing = 0u32;
    let _leases = app
        .batches
        .store
        .shared()
        .then(|| AbortOnDrop(tokio::spawn(keep_leases(app.clone())).abort_handle()));
    loop {
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            d = done_rx.recv() => {
                if let Some(d) = d {
                    finished(&app, &mut live, d);
                }
                while let Ok(d) = done_rx.try_recv() {
                    finished(&app, &mut live, d);
                }
            }
            _ = wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        match step(&app, &mut live, &ends, &mut tasks, &mut slots).await {
            Ok(()) => failing = 0,
            Err(e) => {
                failing = failing.saturating_add(1);
                let wait = backoff(
                    Duration::from_millis(250),
                    Duration::from_secs(10),
                    failing,
                    jitter("runner", u64::from(failing), 0),
                );
                tracing::warn!(error = %e, retry_in = ?wait, "batch runner: the store failed; retrying");
                tokio::time::sleep(wait).await;
            }
        }
        if let Ok(mut m) = app.batches.in_flight.lock() {
            m.clear();
            for (id, l) in &live {
                m.insert(id.clone(), l.in_flight.len() as u64);
            }
        }
    }
}

fn finished(app: &App, live: &mut HashMap<String, Live>, d: Done) {
    if let Some(l) = live.get_mut(&d.batch) {
        l.in_flight.remove(&d.line);
        if d.failed {
            l.fail_streak = l.fail_streak.saturating_add(1);
            // Items failing one after another: wait before sending more,
            // longer each time (a failing batch backs off, it does not
            // hammer its upstream).
            if l.fail_streak >= FAIL_STREAK_PAUSE {
                let c = &app.config.batch;
                let wait = backoff(
                    c.retry_base,
                    c.retry_max,
                    l.fail_streak - FAIL_STREAK_PAUSE + 1,
                    jitter(&d.batch, d.line, l.fail_streak),
                );
                l.paused_until = Some(Instant::now() + wait);
            }
        } else {
            l.fail_streak = 0;
        }
        if d.wrote {
            let now = Instant::now();
            match l.finished.back_mut() {
                Some((t, n)) if now.duration_since(*t) < PACE_BUCKET => *n += 1,
                _ => l.finished.push_back((now, 1)),
            }
            while l
                .finished
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > PACE_WINDOW)
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
    ends: &Ends,
    tasks: &mut tokio::task::JoinSet<()>,
    slots: &mut (Option<Instant>, usize),
) -> Result<(), StoreError> {
    let store = app.batches.store.clone();
    // Output and error files past `output_expires_after` go.
    let expired = store
        .run(|s| s.expired_outputs(crate::clock::unix_ms() / 1000.0))
        .await?;
    for fid in expired {
        store.run(move |s| s.delete_file(&fid)).await?;
    }
    let active = store.run(|s| s.active()).await?;
    // On a shared store (a fleet), this replica runs only the batches whose
    // lease it holds: it takes free or expired ones and renews its own
    // several times a lease, so a replica that dies hands its batches on
    // once their leases run out.
    let active = claimed(app, active).await?;
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
    // Refreshed often: the health gate below reads it.
    if slots
        .0
        .is_none_or(|t| t.elapsed() > Duration::from_millis(250))
    {
        if let Some(s) = app.exec.snapshot().await {
            slots.1 = s
                .replicas
                .iter()
                .filter(|r| r.up && !r.draining)
                .map(|r| r.slots as usize)
                .sum::<usize>();
            let mut serving: HashMap<String, bool> = HashMap::new();
            for r in &s.replicas {
                *serving.entry(r.model.clone()).or_insert(false) |=
                    r.up && r.available && !r.draining;
            }
            if let Ok(mut m) = app.batches.serving.lock() {
                *m = serving;
            }
        }
        slots.0 = Some(Instant::now());
    }
    let slots = slots.1;
    let cap = app.config.batch.max_in_flight.min((2 * slots).max(64));
    app.batches
        .plans
        .retain(&|id| active.iter().any(|b| b.id == id));
    if let Ok(mut m) = app.batches.plans.pace.lock() {
        m.clear();
        for (id, l) in live.iter() {
            if let Some(p) = recent(l) {
                m.insert(id.clone(), p);
            }
        }
    }
    let planned = plan_rows(app, &active, None).await;
    let shares = split(&app.config.batch, cap, running, &active, &planned);
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
            BatchStatus::InProgress if over_budget(&app.config.batch, b) => {
                l.abort_all();
                tracing::warn!(batch = %b.id, failed = b.counts.failed, completed = b.counts.completed,
                    "batch failed: too many of its items failed (`[batch] max_failed_share`)");
                close(app, b, Closing::Failed).await?;
            }
            BatchStatus::InProgress => {
                // Every result of a running batch is counted.
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
                let share = shares.get(&b.id).copied().unwrap_or(1);
                top_up(app, b, l, share, ends, tasks).await?;
                forecast(app, b, l, planned.get(&b.id)).await?;
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

/// The batches of `active` this replica may run: all of them on its own
/// store; on a shared one, those whose lease it holds ([`keep_leases`]).
async fn claimed(app: &Arc<App>, active: Vec<BatchRow>) -> Result<Vec<BatchRow>, StoreError> {
    if !app.batches.store.shared() {
        return Ok(active);
    }
    let held = app
        .batches
        .held
        .lock()
        .map(|h| h.clone())
        .unwrap_or_default();
    Ok(active
        .into_iter()
        .filter(|b| held.contains_key(&b.id))
        .collect())
}

/// On a shared store: takes free or expired batch leases and renews this
/// replica's own, four times per lease, on a connection of its own (so a
/// renewal never waits behind result writes). While renewals keep failing
/// for half a lease, no new item is sent (another replica may take the
/// batches once the lease runs out); items in flight finish and write
/// under their fencing token, so what ran here while the lease was still
/// ours is kept and what a new holder runs is not written twice.
/// How long an upload to a shared store may go without writing a page
/// before its lines are taken for an interrupted upload's (its replica
/// died): far beyond any gap between two pages of a live upload.
const UPLOAD_STALE: Duration = Duration::from_secs(600);
/// How often a replica looks for them.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

async fn keep_leases(app: Arc<App>) {
    let lease = app.config.batch.lease;
    let every = (lease / 4).max(Duration::from_millis(50));
    let mut last_ok = Instant::now();
    let mut swept: Option<Instant> = None;
    loop {
        if swept.is_none_or(|t| t.elapsed() >= SWEEP_EVERY) {
            swept = Some(Instant::now());
            let stale = UPLOAD_STALE.as_secs();
            match app.batches.store.run(move |s| s.sweep_uploads(stale)).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    lines = n,
                    "batch store: removed the lines of interrupted uploads"
                ),
                Err(e) => {
                    tracing::debug!(error = %e, "batch store: interrupted uploads not swept; next try in a minute")
                }
            }
        }
        let holder = app.batches.holder.clone();
        let ttl = lease.as_secs_f64();
        match app
            .batches
            .store
            .run(move |s| s.claim_all(&holder, ttl))
            .await
        {
            Ok(ids) => {
                last_ok = Instant::now();
                let was_fresh = app.batches.leases_fresh.swap(true, Ordering::SeqCst);
                let taken = ids.is_some_and(|ids| {
                    let ids: HashMap<String, i64> = ids.into_iter().collect();
                    let mut new = false;
                    if let Ok(mut h) = app.batches.held.lock() {
                        new = ids.iter().any(|(i, t)| h.get(i) != Some(t));
                        *h = ids;
                    }
                    new
                });
                if taken || !was_fresh {
                    app.batches.wake.notify_one();
                }
            }
            Err(e) => {
                if last_ok.elapsed() > lease / 2 {
                    app.batches.leases_fresh.store(false, Ordering::SeqCst);
                }
                tracing::warn!(error = %e, "batch runner: cannot renew batch leases");
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// Aborts a task when dropped (the runner's lease keeper stops with it).
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Hands more of a batch's items to the request path, up to its share.
async fn top_up(
    app: &Arc<App>,
    b: &BatchRow,
    l: &mut Live,
    share: usize,
    ends: &Ends,
    tasks: &mut tokio::task::JoinSet<()>,
) -> Result<(), StoreError> {
    // Nothing is sent while a result waits for the store, while the
    // batch's model has no replica in service, or while the batch pauses
    // after a run of failures.
    if !app.batches.store_writable()
        || (app.batches.store.shared() && !app.batches.leases_fresh.load(Ordering::SeqCst))
        || !app.batches.model_serving(l.model.as_deref())
        || l.paused_until.is_some_and(|t| Instant::now() < t)
    {
        return Ok(());
    }
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
        if l.model.is_none() {
            l.model = model_of(&it.text);
        }
        let line = it.line;
        let token = app.batches.token(&b.id);
        let h = tasks.spawn(item(app.clone(), b.clone(), it, token, ends.clone()));
        l.in_flight.insert(line, h);
        taken += 1;
    }
    if taken < want {
        l.exhausted = true;
    }
    Ok(())
}

/// The model a stored input line calls.
fn model_of(text: &str) -> Option<String> {
    let v: Value = serde_json::from_str(text).ok()?;
    Some(v.get("body")?.get("model")?.as_str()?.to_string())
}

/// Failed outcomes in a row after which a batch pauses its sending.
const FAIL_STREAK_PAUSE: u32 = 5;

/// Whether a running batch is past its failure budget. A batch whose
/// every item has an outcome is not: it is done, and completes with its
/// failures in the error file (the budget stops a batch early).
fn over_budget(c: &super::config::BatchSection, b: &BatchRow) -> bool {
    let done = b.counts.completed + b.counts.failed;
    c.max_failed_share < 1.0
        && done < b.counts.total
        && done >= c.min_outcomes_for_budget.max(1)
        && b.counts.failed as f64 > c.max_failed_share * done as f64
}

/// A deterministic fraction in [0, 1) from a key: the jitter of one
/// item's try, the same on every run (tests and replays repeat).
fn jitter(key: &str, line: u64, attempt: u32) -> f64 {
    // FNV-1a over the key, then splitmix64 over it with the line and try.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = h ^ line.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(attempt) << 32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The wait before try `n` (1: the first retry): `base` doubled each
/// time, at most `max`, then scaled into [1/2, 1] by `jitter` ("equal
/// jitter": never shorter than half, and items that failed together
/// spread out).
fn backoff(base: Duration, max: Duration, n: u32, jitter: f64) -> Duration {
    let doubled = 2f64.powi(n.saturating_sub(1).min(30) as i32);
    let full = (base.as_secs_f64() * doubled).min(max.as_secs_f64());
    Duration::from_secs_f64(full * (0.5 + 0.5 * jitter.clamp(0.0, 1.0)))
}

/// Counts a result waiting for the store while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs one item to its result and stores it. A result the store refuses
/// is kept and written again with backoff, never run again: the model
/// call is not repeated for a store fault. On a shared store the result
/// is written under `token`, the batch lease's fencing token when the
/// item was sent: a replica that lost the lease meanwhile writes nothing.
async fn item(app: Arc<App>, b: BatchRow, it: ItemLine, token: Option<i64>, ends: Ends) {
    let r = serve(&app, &b, &it).await;
    let missed = r.missed;
    let failed = !r.ok;
    let mut waiting: Option<Waiting<'_>> = None;
    let mut tries = 0u32;
    // Its tokens count in its batch's usage with the result, together.
    let tokens = usage_of(&r.text).unwrap_or((0, 0));
    let finished = Finished {
        result: r,
        input_tokens: tokens.0,
        output_tokens: tokens.1,
    };
    let wrote = loop {
        match ends.writer.put(&b.id, token, finished.clone()).await {
            Ok(Some(w)) => break w,
            Ok(None) => {
                tracing::info!(batch = %b.id, line = it.line,
                    "batch item's result not written: this replica's lease on the batch passed to another (fenced)");
                break false;
            }
            Err(e) => {
                tries = tries.saturating_add(1);
                if waiting.is_none() {
                    app.batches.store_waiting.fetch_add(1, Ordering::SeqCst);
                    waiting = Some(Waiting(&app.batches.store_waiting));
                }
                let wait = backoff(
                    Duration::from_millis(50),
                    Duration::from_secs(5),
                    tries,
                    jitter(&b.id, it.line, tries),
                );
                if tries == 1 || tries.is_power_of_two() {
                    tracing::warn!(batch = %b.id, line = it.line, error = %e, retry_in = ?wait,
                        "cannot store a batch result; sending is paused until it is written");
                }
                tokio::time::sleep(wait).await;
            }
        }
    };
    drop(waiting);
    if wrote && missed {
        app.metrics.batch_deadline_misses(
            b.owner.as_deref().unwrap_or("none"),
            b.tier.as_deref().unwrap_or("none"),
            1,
        );
    }
    let _ = ends.done.send(Done {
        batch: b.id,
        line: it.line,
        wrote,
        failed,
    });
}

/// The tokens a result line's response body reports (`usage`).
fn usage_of(text: &str) -> Option<(u64, u64)> {
    let v: Value = serde_json::from_str(text).ok()?;
    let u = v.get("response")?.get("body")?.get("usage")?;
    let input = u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
    let output = u
        .get("completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Some((input, output))
}

/// One result line's `id`.
fn request_line_id(b: &BatchRow, line: u64) -> String {
    format!("batch_req_{}_{line}", crate::batch::short_id(&b.id))
}

/// Serves an item through the gateway. What the gateway refuses for now
/// (429, 503: quota, saturation, an upstream out of service) waits as
/// asked and comes back, until the window ends; what an upstream fails
/// (5xx, timeout) is tried at most `[batch] max_attempts` times; a 4xx is
/// final at once. Every wait is a backoff with jitter, and nothing is sent
/// while the item's model has no replica in service or the store is full.
async fn serve(app: &Arc<App>, b: &BatchRow, it: &ItemLine) -> ItemResult {
    let body = serde_json::from_str::<Value>(&it.text)
        .ok()
        .and_then(|mut v| v.get_mut("body").map(Value::take))
        .unwrap_or(Value::Null);
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string);
    let cfg = &app.config.batch;
    let speed = app.speed;
    let mut failures = 0u32;
    let mut refusals = 0u32;
    loop {
        // Wait (bounded by the window) for the model to be in service and
        // the store to take writes.
        while !(app.batches.model_serving(model.as_deref()) && app.batches.store_writable()) {
            if left_s(b) <= 0.0 {
                return expired_line(b, it);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let left = left_s(b);
        if left <= 0.0 {
            return expired_line(b, it);
        }
        let window = (left * speed * 1e6) as crate::sched::Micros;
        let outcome = crate::server::request::pipeline::serve_batch_item(
            app.clone(),
            endpoint_of(b),
            b.owner.clone(),
            crate::server::request::pipeline::BatchItem {
                batch: &b.id,
                attempt: refusals.saturating_add(failures).saturating_add(1),
                preemptible: b.job().opts_into_preemption(),
            },
            body.clone(),
            window,
        )
        .await;
        // Read from the pipeline's outcome, not parsed back out of headers.
        let rid = outcome.rid().map(str::to_string);
        let (gpu, retry_after) = match &outcome {
            Ended::Served { gpu_seconds, .. } => (*gpu_seconds, None),
            Ended::CacheHit { .. } => (0.0, None),
            Ended::Refused(e) | Ended::Failed(e) => (0.0, e.retry_after_s.map(|s| s as f64)),
        };
        let resp = outcome.into_response();
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 64 * 1024 * 1024)
            .await
            .unwrap_or_default();
        let body_v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let wait = match Outcome::of(status) {
            Outcome::Done => None,
            Outcome::Refused => {
                refusals = refusals.saturating_add(1);
                let asked = Duration::from_secs_f64(
                    retry_after.unwrap_or(1.0).min(3600.0) / speed.max(1.0),
                );
                // The gateway's own refusals run on its clock (the
                // simulator's speed applies), an upstream's failures below
                // on the wall's.
                let own = backoff(
                    cfg.retry_base,
                    cfg.retry_max,
                    refusals,
                    jitter(&b.id, it.line, refusals),
                )
                .min(Duration::from_secs(30))
                .div_f64(speed.max(1.0));
                Some(asked.max(own))
            }
            Outcome::Failed => {
                failures = failures.saturating_add(1);
                (failures < cfg.max_attempts).then(|| {
                    backoff(
                        cfg.retry_base,
                        cfg.retry_max,
                        failures,
                        jitter(&b.id, it.line, failures),
                    )
                })
            }
        };
        if let Some(wait) = wait {
            let left = left_s(b);
            if left <= wait.as_secs_f64() {
                tokio::time::sleep(Duration::from_secs_f64(left.max(0.0))).await;
                return expired_line(b, it);
            }
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
            continue;
        }
        let ok = (200..300).contains(&status);
        let missed = crate::clock::unix_ms() / 1000.0 > b.expires_at as f64;
        // An item that failed every try says so (the response is the last).
        let error = (Outcome::of(status) == Outcome::Failed).then(|| {
            json!({
                "code": "retries_exhausted",
                "message": format!(
                    "the upstream failed this request on each of {failures} tries (`[batch] max_attempts`); the response is the last one"
                ),
            })
        });
        let text = json!({
            "id": request_line_id(b, it.line),
            "custom_id": it.custom_id,
            "response": {
                "status_code": status,
                "request_id": rid,
                "body": body_v,
            },
            "error": error,
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

/// Wall seconds left in a batch's window.
fn left_s(b: &BatchRow) -> f64 {
    b.expires_at as f64 - crate::clock::unix_ms() / 1000.0
}

/// What a gateway answer means for a batch item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// An answer to keep: 2xx, or a 4xx (the request's own fault: trying
    /// again gives the same).
    Done,
    /// The gateway refused it for now (429, 503): not a try.
    Refused,
    /// An upstream failed it (5xx, timeout): one try.
    Failed,
}

impl Outcome {
    fn of(status: u16) -> Outcome {
        match status {
            429 | 503 => Outcome::Refused,
            500..=599 => Outcome::Failed,
            _ => Outcome::Done,
        }
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
    /// Past its failure budget.
    Failed,
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
        Closing::Failed => (
            "batch_failed",
            "The batch was stopped before this request ran: too many of its requests failed (`[batch] max_failed_share`).",
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

/// Ends an expired, cancelled or failed batch: every item without a
/// result gets an error line saying why and counts as failed (so
/// `completed + failed = total`, as OpenAI reports), then the files and
/// the status, together.
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
            match why {
                Closing::Expired | Closing::Failed => {
                    s.transition(
                        &b.id,
                        &[BatchStatus::InProgress],
                        BatchStatus::Finalizing,
                        now,
                    )?;
                }
                Closing::Cancelled => {}
            }
            match why {
                Closing::Expired => {
                    s.finalize(&b.id, BatchStatus::Expired, now)?;
                }
                Closing::Cancelled => {
                    s.finalize(&b.id, BatchStatus::Cancelled, now)?;
                }
                Closing::Failed => {
                    let errors = json!({"object": "list", "data": [{
                        "code": "too_many_failures",
                        "message": format!(
                            "{} of its {} finished requests failed, more than `[batch] max_failed_share` allows; the batch was stopped and its unrun requests are in the error file",
                            b.counts.failed, b.counts.completed + b.counts.failed
                        ),
                        "param": null,
                        "line": null,
                    }]});
                    s.set_errors(&b.id, &errors)?;
                    s.finalize(&b.id, BatchStatus::Failed, now)?;
                }
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

/// How finely the runner counts finished items in time.
const PACE_BUCKET: Duration = Duration::from_millis(100);

/// The items a batch finished in the last [`PACE_WINDOW`], if any.
fn recent(l: &Live) -> Option<Recent> {
    let from = Instant::now().checked_sub(PACE_WINDOW);
    let skip = from.map_or(0, |f| l.finished.partition_point(|(t, _)| *t < f));
    let (since, _) = *l.finished.get(skip)?;
    Some(Recent {
        items: l.finished.iter().skip(skip).map(|(_, n)| n).sum(),
        since,
    })
}

/// How many items each running batch may have in flight: `cap` split
/// evenly between the groups (a tenant's batches in one tier: between
/// tenants, the scheduler's fair share decides), and within a group in
/// plan order, each batch taking what it still needs of what the ones
/// ahead left (`[batch] order = "deadline"`); or `cap` split evenly
/// between batches (`order = "even"`).
fn split(
    c: &super::config::BatchSection,
    cap: usize,
    running: usize,
    active: &[BatchRow],
    planned: &HashMap<String, Placed>,
) -> HashMap<String, usize> {
    let run: Vec<&BatchRow> = active
        .iter()
        .filter(|b| matches!(b.status, BatchStatus::InProgress | BatchStatus::Validating))
        .collect();
    // A batch's own `kiln_max_in_flight` bounds what it takes.
    let most = |b: &BatchRow| b.job().max_in_flight.map_or(usize::MAX, |n| n as usize);
    if c.order == super::batch_config::BatchOrder::Even {
        let share = (cap / running.max(1)).max(1);
        return run
            .iter()
            .map(|b| (b.id.clone(), share.min(most(b))))
            .collect();
    }
    let mut groups: HashMap<(Option<&str>, Option<&str>), Vec<&BatchRow>> = HashMap::new();
    for b in &run {
        groups
            .entry((b.tier.as_deref(), b.owner.as_deref()))
            .or_default()
            .push(b);
    }
    let per = (cap / groups.len().max(1)).max(1);
    let mut out = HashMap::new();
    for members in groups.values() {
        let left: Vec<u64> = members
            .iter()
            .map(|b| {
                let left = b
                    .counts
                    .total
                    .saturating_sub(b.counts.completed + b.counts.failed);
                // What it does not take goes to the batches after it.
                left.min(u64::try_from(most(b)).unwrap_or(u64::MAX))
            })
            .collect();
        // Unplanned batches (no estimate yet) go after the planned ones,
        // earliest deadline first.
        let mut rank: Vec<(usize, bool, i64, usize)> = members
            .iter()
            .enumerate()
            .map(|(i, b)| match planned.get(&b.id) {
                Some(p) => (i, false, p.plan.rank as i64, 0),
                None => (i, true, b.expires_at, i),
            })
            .collect();
        rank.sort_by_key(|(_, unplanned, r, i)| (*unplanned, *r, *i));
        let mut ranks = vec![0; members.len()];
        for (pos, (i, ..)) in rank.iter().enumerate() {
            ranks[*i] = pos;
        }
        for (b, n) in members
            .iter()
            .zip(crate::batch::plan::shares(per, &left, &ranks, false))
        {
            out.insert(b.id.clone(), n);
        }
    }
    out
}

/// Stores a running batch's predicted finish and its place in the last
/// plan (rank, pace ratio), at most every 2 s: what a restart plans on
/// from.
async fn forecast(
    app: &Arc<App>,
    b: &BatchRow,
    l: &mut Live,
    planned: Option<&Placed>,
) -> Result<(), StoreError> {
    if l.last_forecast
        .is_some_and(|t| t.elapsed() < Duration::from_secs(2))
    {
        return Ok(());
    }
    l.last_forecast = Some(Instant::now());
    let finish = planned.map(|p| p.plan.finish);
    let rank = planned.map(|p| p.plan.rank as u64);
    let ratio = planned.and_then(|p| p.pace_ratio);
    let id = b.id.clone();
    app.batches
        .store
        .run(move |s| s.set_prediction(&id, finish, rank, ratio))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_jitter_keeps_at_least_half() {
        let (base, max) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(backoff(base, max, 1, 1.0), Duration::from_secs(1));
        assert_eq!(backoff(base, max, 3, 1.0), Duration::from_secs(4));
        assert_eq!(backoff(base, max, 40, 1.0), max);
        assert_eq!(backoff(base, max, 3, 0.0), Duration::from_secs(2));
        // Out-of-range jitter is clamped, never a longer or negative wait.
        assert_eq!(backoff(base, max, 1, 7.0), base);
        assert_eq!(backoff(base, max, 1, -1.0), base / 2);
    }

    #[test]
    fn jitter_is_deterministic_in_range_and_spreads_items() {
        assert_eq!(jitter("batch_a", 7, 2), jitter("batch_a", 7, 2));
        let xs: Vec<f64> = (0..1000).map(|l| jitter("batch_a", l, 1)).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((0.4..0.6).contains(&mean), "{mean}");
        assert_ne!(jitter("batch_a", 7, 1), jitter("batch_a", 7, 2));
        assert_ne!(jitter("batch_a", 7, 1), jitter("batch_b", 7, 1));
    }

    #[test]
    fn answers_are_final_refused_for_now_or_failed() {
        assert_eq!(Outcome::of(200), Outcome::Done);
        assert_eq!(Outcome::of(400), Outcome::Done);
        assert_eq!(Outcome::of(404), Outcome::Done);
        assert_eq!(Outcome::of(429), Outcome::Refused);
        assert_eq!(Outcome::of(503), Outcome::Refused);
        assert_eq!(Outcome::of(500), Outcome::Failed);
        assert_eq!(Outcome::of(502), Outcome::Failed);
        assert_eq!(Outcome::of(504), Outcome::Failed);
    }

    #[test]
    fn the_failure_budget_waits_for_enough_outcomes() {
        let mut c = crate::server::config::BatchSection {
            max_failed_share: 0.5,
            min_outcomes_for_budget: 100,
            ..Default::default()
        };
        let row = |total, completed, failed| BatchRow {
            counts: crate::batch::RequestCounts {
                total,
                completed,
                failed,
            },
            ..test_row()
        };
        // Too few outcomes yet, however bad.
        assert!(!over_budget(&c, &row(1000, 0, 99)));
        assert!(over_budget(&c, &row(1000, 49, 51)));
        assert!(!over_budget(&c, &row(1000, 50, 50)));
        // A batch with every outcome is done, not stopped: it completes.
        c.min_outcomes_for_budget = 5;
        assert!(!over_budget(&c, &row(10, 4, 6)));
        assert!(over_budget(&c, &row(10, 2, 4)));
        c.max_failed_share = 1.0;
        assert!(!over_budget(&c, &row(1000, 0, 1000)));
    }

    fn test_row() -> BatchRow {
        let mut b = BatchRow::example("batch_t", "file-t", 0);
        (b.owner, b.created_at, b.expires_at) = (None, 0, 86_400);
        b
    }
}
