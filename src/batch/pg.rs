//! The batch store on a shared PostgreSQL database: the same tables,
//! guarantees and calls as the embedded SQLite store ([`super::store`]),
//! for a fleet of gateways that must all answer every file and batch.
//!
//! **Written once, fleet-wide.** A result row's key is (batch, input
//! line), inserted with `ON CONFLICT DO NOTHING` in the transaction that
//! counts it: an item that ran twice (in flight on a replica that died,
//! run again by the next one) keeps its first result and is counted once.
//!
//! **One runner per batch.** A replica runs a batch's items only while it
//! holds the batch's lease (`lease_holder`, `lease_until`, on the
//! database's clock so replicas' clocks do not matter). It renews the lease
//! at every pass of its runner; a replica that dies stops renewing, and
//! once the lease has expired another replica claims it and runs the
//! items that have no result yet.
//!
//! Calls block (the `postgres` client): async callers run them on a
//! blocking thread ([`super::store::Store::run`]), as they do for SQLite.

use super::store::{Extras, ItemResult, StoreError};
use super::{BatchRow, BatchStatus, FileRow, ItemLine, RequestCounts};
use postgres::{Client, NoTls, Row};
use std::sync::{Arc, Mutex, MutexGuard};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS files (
    seq BIGSERIAL,
    id TEXT PRIMARY KEY,
    owner TEXT,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    lines BIGINT NOT NULL,
    endpoint TEXT,
    batch_id TEXT,
    ok BOOLEAN
);
CREATE INDEX IF NOT EXISTS files_seq ON files (seq);
CREATE TABLE IF NOT EXISTS lines (
    file_id TEXT NOT NULL,
    line BIGINT NOT NULL,
    custom_id TEXT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (file_id, line)
);
CREATE UNIQUE INDEX IF NOT EXISTS lines_custom_id ON lines (file_id, custom_id);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT,
    seq BIGSERIAL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    window_s DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    in_progress_at BIGINT,
    finalizing_at BIGINT,
    completed_at BIGINT,
    failed_at BIGINT,
    expired_at BIGINT,
    cancelling_at BIGINT,
    cancelled_at BIGINT,
    total BIGINT NOT NULL,
    completed BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    tier TEXT,
    predicted_finish DOUBLE PRECISION,
    gpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
    deadline_misses BIGINT NOT NULL DEFAULT 0,
    lease_holder TEXT,
    lease_until DOUBLE PRECISION,
    model TEXT,
    input_tokens BIGINT NOT NULL DEFAULT 0,
    output_tokens BIGINT NOT NULL DEFAULT 0,
    output_expires_s DOUBLE PRECISION,
    promised BOOLEAN,
    promised_finish DOUBLE PRECISION,
    plan_rank BIGINT,
    pace_ratio DOUBLE PRECISION
);
ALTER TABLE batches ADD COLUMN IF NOT EXISTS model TEXT;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS input_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS output_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS output_expires_s DOUBLE PRECISION;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS promised BOOLEAN;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS promised_finish DOUBLE PRECISION;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS plan_rank BIGINT;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS pace_ratio DOUBLE PRECISION;
CREATE INDEX IF NOT EXISTS batches_seq ON batches (seq);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line BIGINT NOT NULL,
    ok BOOLEAN NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
";

/// Statuses the runner still has work for.
const ACTIVE: &str = "('validating','in_progress','finalizing','cancelling')";

const BATCH_COLS: &str = "id, owner, input_file_id, endpoint, completion_window, window_s, status, created_at, expires_at,
    in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
    total, completed, failed, metadata, errors, output_file_id, error_file_id, tier, predicted_finish, gpu_seconds, deadline_misses,
    promised, promised_finish, plan_rank, pace_ratio";

/// Connections for data: item results, pages of lines, listings.
const DATA_CONNECTIONS: usize = 4;

/// The PostgreSQL store: a few connections for data, and one of its own
/// for leases, so that renewing a lease never waits behind result writes;
/// each made again when it breaks.
#[derive(Clone)]
pub struct Pg {
    url: Arc<str>,
    /// `[0]` leases; the rest data (made on first use).
    conns: Arc<[Slot]>,
    next: Arc<std::sync::atomic::AtomicUsize>,
}

/// The connection. Closing one blocks (the client runs its own runtime),
/// which a runtime's thread must not do: the last clone of the store may be
/// dropped on one, so the connection is closed on a thread of its own.
struct Slot(Mutex<Option<Client>>);

impl Drop for Slot {
    fn drop(&mut self) {
        let c = self.0.get_mut().ok().and_then(Option::take);
        if let Some(c) = c {
            let _ = std::thread::Builder::new()
                .name("kiln-pg-close".into())
                .spawn(move || drop(c));
        }
    }
}

/// The URL with its password hidden, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let cred = &url[s + 3..at];
            match cred.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &cred[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

fn connect(url: &str) -> Result<Client, StoreError> {
    let open = |message: String| StoreError::Open {
        path: redact(url),
        message,
    };
    let mut c = Client::connect(url, NoTls).map_err(|e| {
        // The cause (refused, unknown host, authentication) is the source.
        let why = std::error::Error::source(&e).map(|s| format!(": {s}"));
        open(format!("{e}{}", why.unwrap_or_default()))
    })?;
    // Replicas starting together: one makes the tables, the others wait.
    let mut tx = c.transaction().map_err(|e| open(e.to_string()))?;
    tx.execute("SELECT pg_advisory_xact_lock(7315002)", &[])
        .map_err(|e| open(e.to_string()))?;
    tx.batch_execute(SCHEMA).map_err(|e| open(e.to_string()))?;
    tx.commit().map_err(|e| open(e.to_string()))?;
    Ok(c)
}

/// A connection, made (again) where there is none or it broke.
struct Conn<'a>(MutexGuard<'a, Option<Client>>);

impl Conn<'_> {
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        self.0.as_mut().ok_or(StoreError::Poisoned)
    }
}

impl Pg {
    /// Connects to `url` (`postgres://user:password@host:port/db`) and
    /// makes the tables where they are missing.
    pub fn open(url: &str) -> Result<Pg, StoreError> {
        let c = connect(url)?;
        let conns: Vec<Slot> = std::iter::once(Slot(Mutex::new(Some(c))))
            .chain((0..DATA_CONNECTIONS).map(|_| Slot(Mutex::new(None))))
            .collect();
        Ok(Pg {
            url: Arc::from(url),
            conns: conns.into(),
            next: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        })
    }

    /// A data connection: a free one, else the next in turn.
    fn lock(&self) -> Result<Conn<'_>, StoreError> {
        let data = &self.conns[1..];
        for s in data {
            if let Ok(g) = s.0.try_lock() {
                return self.ready(g);
            }
        }
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % data.len();
        let g = data[i].0.lock().map_err(|_| StoreError::Poisoned)?;
        self.ready(g)
    }

    /// The lease connection.
    fn lock_lease(&self) -> Result<Conn<'_>, StoreError> {
        let g = self.conns[0].0.lock().map_err(|_| StoreError::Poisoned)?;
        self.ready(g)
    }

    fn ready<'a>(&self, mut g: MutexGuard<'a, Option<Client>>) -> Result<Conn<'a>, StoreError> {
        if g.as_ref().is_none_or(|c| c.is_closed()) {
            *g = None;
            *g = Some(connect(&self.url)?);
        }
        Ok(Conn(g))
    }

    pub fn url(&self) -> String {
        redact(&self.url)
    }

    // ---- files ---------------------------------------------------------

    pub fn file(&self, id: &str) -> Result<Option<FileRow>, StoreError> {
        let mut g = self.lock()?;
        let r = g.client()?.query_opt(
            "SELECT id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok FROM files WHERE id = $1",
            &[&id],
        )?;
        r.as_ref().map(file_row).transpose()
    }

    pub fn files(
        &self,
        owner: Option<Option<&str>>,
        purpose: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<FileRow>, StoreError> {
        let (filter, who) = match owner {
            Some(o) => (true, o),
            None => (false, None),
        };
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            "SELECT id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok FROM files
             WHERE (NOT $1 OR owner IS NOT DISTINCT FROM $2) AND ($3::TEXT IS NULL OR purpose = $3)
               AND ($4::TEXT IS NULL OR seq < (SELECT seq FROM files WHERE id = $4))
             ORDER BY seq DESC LIMIT $5",
            &[&filter, &who, &purpose, &after, &(limit as i64)],
        )?;
        rows.iter().map(file_row).collect()
    }

    pub fn delete_file(&self, id: &str) -> Result<bool, StoreError> {
        let mut g = self.lock()?;
        let mut tx = g.client()?.transaction()?;
        let busy: i64 = tx
            .query_one(
                &format!(
                    "SELECT COUNT(*) FROM batches WHERE input_file_id = $1 AND status IN {ACTIVE}"
                ),
                &[&id],
            )?
            .try_get(0)?;
        if busy > 0 {
            return Ok(false);
        }
        tx.execute("DELETE FROM lines WHERE file_id = $1", &[&id])?;
        tx.execute("DELETE FROM files WHERE id = $1", &[&id])?;
        tx.execute(
            "UPDATE batches SET output_file_id = NULL WHERE output_file_id = $1",
            &[&id],
        )?;
        tx.execute(
            "UPDATE batches SET error_file_id = NULL WHERE error_file_id = $1",
            &[&id],
        )?;
        tx.commit()?;
        Ok(true)
    }

    pub fn lines(
        &self,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            "SELECT line, text FROM lines WHERE file_id = $1 AND line >= $2 ORDER BY line LIMIT $3",
            &[&file, &(from as i64), &(limit as i64)],
        )?;
        rows.iter()
            .map(|r| Ok((r.try_get::<_, i64>(0)? as u64, r.try_get(1)?)))
            .collect()
    }

    pub fn results(
        &self,
        batch: &str,
        ok: bool,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            "SELECT line, text FROM results WHERE batch_id = $1 AND ok = $2 AND line >= $3 ORDER BY line LIMIT $4",
            &[&batch, &ok, &(from as i64), &(limit as i64)],
        )?;
        rows.iter()
            .map(|r| Ok((r.try_get::<_, i64>(0)? as u64, r.try_get(1)?)))
            .collect()
    }

    // ---- batches -------------------------------------------------------

    pub fn insert_batch(&self, b: &BatchRow) -> Result<bool, StoreError> {
        let mut g = self.lock()?;
        let mut tx = g.client()?.transaction()?;
        // The file row is locked: a concurrent delete waits, then finds
        // the batch (or the batch finds no file).
        let exists = tx
            .query_opt(
                "SELECT 1 FROM files WHERE id = $1 FOR SHARE",
                &[&b.input_file_id],
            )?
            .is_some();
        if !exists {
            return Ok(false);
        }
        tx.execute(
            "INSERT INTO batches (id, owner, input_file_id, endpoint, completion_window, window_s, status,
                created_at, expires_at, total, metadata, tier, predicted_finish,
                promised, promised_finish, plan_rank, pace_ratio)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
            &[
                &b.id,
                &b.owner,
                &b.input_file_id,
                &b.endpoint,
                &b.completion_window,
                &b.window_s,
                &b.status.name(),
                &b.created_at,
                &b.expires_at,
                &(b.counts.total as i64),
                &b.metadata.as_ref().map(|m| m.to_string()),
                &b.tier,
                &b.predicted_finish,
                &b.promise.on_time,
                &b.promise.finish,
                &b.promise.rank.map(|r| r as i64),
                &b.promise.pace_ratio,
            ],
        )?;
        tx.commit()?;
        Ok(true)
    }

    pub fn batch(&self, id: &str) -> Result<Option<BatchRow>, StoreError> {
        let mut g = self.lock()?;
        let r = g.client()?.query_opt(
            &format!("SELECT {BATCH_COLS} FROM batches WHERE id = $1"),
            &[&id],
        )?;
        r.as_ref().map(batch_row).transpose()
    }

    pub fn batches(
        &self,
        owner: Option<Option<&str>>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<BatchRow>, StoreError> {
        let (filter, who) = match owner {
            Some(o) => (true, o),
            None => (false, None),
        };
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            &format!(
                "SELECT {BATCH_COLS} FROM batches
                 WHERE (NOT $1 OR owner IS NOT DISTINCT FROM $2)
                   AND ($3::TEXT IS NULL OR seq < (SELECT seq FROM batches WHERE id = $3))
                 ORDER BY seq DESC LIMIT $4"
            ),
            &[&filter, &who, &after, &(limit as i64)],
        )?;
        rows.iter().map(batch_row).collect()
    }

    pub fn active(&self) -> Result<Vec<BatchRow>, StoreError> {
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            &format!("SELECT {BATCH_COLS} FROM batches WHERE status IN {ACTIVE} ORDER BY seq"),
            &[],
        )?;
        rows.iter().map(batch_row).collect()
    }

    /// Takes or renews the lease on batch `id` for `holder`, for `ttl_s`
    /// seconds on the database's clock: true when `holder` holds it now
    /// (it was free, expired, or already `holder`'s).
    pub fn claim(&self, id: &str, holder: &str, ttl_s: f64) -> Result<bool, StoreError> {
        let mut g = self.lock_lease()?;
        let n = g.client()?.execute(
            "UPDATE batches SET lease_holder = $1,
                 lease_until = EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION + $2
             WHERE id = $3 AND (lease_holder IS NULL OR lease_holder = $1
                 OR lease_until < EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION)",
            &[&holder, &ttl_s, &id],
        )?;
        Ok(n == 1)
    }

    /// Takes every active batch whose lease is free or expired and renews
    /// `holder`'s own, in one statement: the ids `holder` holds now.
    pub fn claim_all(&self, holder: &str, ttl_s: f64) -> Result<Vec<String>, StoreError> {
        let mut g = self.lock_lease()?;
        let rows = g.client()?.query(
            &format!(
                "UPDATE batches SET lease_holder = $1,
                     lease_until = EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION + $2
                 WHERE status IN {ACTIVE} AND (lease_holder IS NULL OR lease_holder = $1
                     OR lease_until < EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION)
                 RETURNING id"
            ),
            &[&holder, &ttl_s],
        )?;
        rows.iter().map(|r| Ok(r.try_get(0)?)).collect()
    }

    /// Gives up `holder`'s lease on batch `id` (a gateway that stops).
    pub fn release(&self, id: &str, holder: &str) -> Result<(), StoreError> {
        let mut g = self.lock_lease()?;
        g.client()?.execute(
            "UPDATE batches SET lease_holder = NULL, lease_until = NULL WHERE id = $1 AND lease_holder = $2",
            &[&id, &holder],
        )?;
        Ok(())
    }

    pub fn transition(
        &self,
        id: &str,
        from: &[BatchStatus],
        to: BatchStatus,
        at: i64,
    ) -> Result<bool, StoreError> {
        let list: Vec<String> = from.iter().map(|s| format!("'{}'", s.name())).collect();
        let col = to.stamp_column();
        let mut g = self.lock()?;
        let n = g.client()?.execute(
            &format!(
                "UPDATE batches SET status = $1, {col} = COALESCE({col}, $2) WHERE id = $3 AND status IN ({})",
                list.join(",")
            ),
            &[&to.name(), &at, &id],
        )?;
        Ok(n == 1)
    }

    pub fn set_errors(&self, id: &str, errors: &serde_json::Value) -> Result<(), StoreError> {
        let mut g = self.lock()?;
        g.client()?.execute(
            "UPDATE batches SET errors = $1 WHERE id = $2",
            &[&errors.to_string(), &id],
        )?;
        Ok(())
    }

    pub fn fail(&self, id: &str, errors: &serde_json::Value, at: i64) -> Result<(), StoreError> {
        let mut g = self.lock()?;
        g.client()?.execute(
            "UPDATE batches SET status = 'failed', failed_at = $1, errors = $2 WHERE id = $3",
            &[&at, &errors.to_string(), &id],
        )?;
        Ok(())
    }

    /// As SQLite's: the predicted finish, and the plan's rank and pace
    /// ratio (`None` keeps the stored one).
    pub fn set_prediction(
        &self,
        id: &str,
        finish: Option<f64>,
        rank: Option<u64>,
        pace_ratio: Option<f64>,
    ) -> Result<(), StoreError> {
        let mut g = self.lock()?;
        g.client()?.execute(
            "UPDATE batches SET predicted_finish = $1, plan_rank = COALESCE($2, plan_rank),
                 pace_ratio = COALESCE($3, pace_ratio) WHERE id = $4",
            &[&finish, &rank.map(|r| r as i64), &pace_ratio, &id],
        )?;
        Ok(())
    }

    /// Sets a batch's model and output expiry (at creation).
    pub fn set_extras(
        &self,
        id: &str,
        model: Option<&str>,
        output_expires_s: Option<f64>,
    ) -> Result<(), StoreError> {
        let mut g = self.lock()?;
        g.client()?.execute(
            "UPDATE batches SET model = COALESCE($1, model), output_expires_s = $2 WHERE id = $3",
            &[&model, &output_expires_s, &id],
        )?;
        Ok(())
    }

    /// A batch's [`Extras`] (`None`: no such batch).
    pub fn extras(&self, id: &str) -> Result<Option<Extras>, StoreError> {
        let mut g = self.lock()?;
        let row = g.client()?.query_opt(
            "SELECT model, input_tokens, output_tokens, output_expires_s FROM batches WHERE id = $1",
            &[&id],
        )?;
        Ok(row.map(|r| Extras {
            model: r.get(0),
            input_tokens: r.get::<_, i64>(1).max(0) as u64,
            output_tokens: r.get::<_, i64>(2).max(0) as u64,
            output_expires_s: r.get(3),
        }))
    }

    /// Output and error files past their batch's `output_expires_after`
    /// at `now` (unix seconds).
    pub fn expired_outputs(&self, now: f64) -> Result<Vec<String>, StoreError> {
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            "SELECT f.id FROM files f JOIN batches b ON f.batch_id = b.id
             WHERE b.output_expires_s IS NOT NULL AND f.created_at::DOUBLE PRECISION + b.output_expires_s <= $1",
            &[&now],
        )?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    /// [`Pg::put_result`], adding the item's tokens to its batch's usage
    /// in the same transaction.
    pub fn put_result_usage(
        &self,
        batch: &str,
        r: &ItemResult,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Result<bool, StoreError> {
        let mut g = self.lock()?;
        let mut tx = g.client()?.transaction()?;
        let n = tx.execute(
            "INSERT INTO results (batch_id, line, ok, text) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            &[&batch, &(r.line as i64), &r.ok, &r.text],
        )?;
        if n == 1 {
            tx.execute(
                "UPDATE batches SET completed = completed + $1, failed = failed + $2,
                     gpu_seconds = gpu_seconds + $3, deadline_misses = deadline_misses + $4,
                     input_tokens = input_tokens + $5, output_tokens = output_tokens + $6 WHERE id = $7",
                &[
                    &i64::from(r.ok),
                    &i64::from(!r.ok),
                    &r.gpu_seconds,
                    &i64::from(r.missed),
                    &(input_tokens as i64),
                    &(output_tokens as i64),
                    &batch,
                ],
            )?;
        }
        tx.commit()?;
        Ok(n == 1)
    }

    pub fn put_result(&self, batch: &str, r: &ItemResult) -> Result<bool, StoreError> {
        self.put_result_usage(batch, r, 0, 0)
    }

    pub fn put_results(
        &self,
        batch: &str,
        rs: &[ItemResult],
        missed: bool,
    ) -> Result<u64, StoreError> {
        let mut g = self.lock()?;
        let mut tx = g.client()?.transaction()?;
        let ins = tx.prepare(
            "INSERT INTO results (batch_id, line, ok, text) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        )?;
        let mut new = 0u64;
        for r in rs {
            new += tx.execute(&ins, &[&batch, &(r.line as i64), &r.ok, &r.text])?;
        }
        if new > 0 {
            tx.execute(
                "UPDATE batches SET failed = failed + $1, deadline_misses = deadline_misses + $2 WHERE id = $3",
                &[&(new as i64), &(if missed { new as i64 } else { 0 }), &batch],
            )?;
        }
        tx.commit()?;
        Ok(new)
    }

    pub fn pending(
        &self,
        batch: &str,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<ItemLine>, StoreError> {
        let mut g = self.lock()?;
        let rows = g.client()?.query(
            "SELECT l.line, l.custom_id, l.text FROM lines l
             WHERE l.file_id = $1 AND l.line >= $2
               AND NOT EXISTS (SELECT 1 FROM results r WHERE r.batch_id = $3 AND r.line = l.line)
             ORDER BY l.line LIMIT $4",
            &[&file, &(from as i64), &batch, &(limit as i64)],
        )?;
        rows.iter()
            .map(|r| {
                Ok(ItemLine {
                    line: r.try_get::<_, i64>(0)? as u64,
                    custom_id: r.try_get(1)?,
                    text: r.try_get(2)?,
                })
            })
            .collect()
    }

    pub fn finalize(&self, id: &str, to: BatchStatus, at: i64) -> Result<bool, StoreError> {
        let mut g = self.lock()?;
        let mut tx = g.client()?.transaction()?;
        // The batch row is locked: two replicas finalizing at once take
        // turns, and the second finds it done.
        let Some(row) = tx.query_opt(
            "SELECT owner, status, endpoint FROM batches WHERE id = $1 FOR UPDATE",
            &[&id],
        )?
        else {
            return Ok(false);
        };
        let owner: Option<String> = row.try_get(0)?;
        let status: String = row.try_get(1)?;
        let endpoint: String = row.try_get(2)?;
        if status != BatchStatus::Finalizing.name() && status != BatchStatus::Cancelling.name() {
            return Ok(false);
        }
        let mut ids = [None, None];
        for (i, ok) in [true, false].into_iter().enumerate() {
            let r = tx.query_one(
                "SELECT COUNT(*), COALESCE(SUM(OCTET_LENGTH(text) + 1), 0)::BIGINT FROM results WHERE batch_id = $1 AND ok = $2",
                &[&id, &ok],
            )?;
            let (lines, bytes): (i64, i64) = (r.try_get(0)?, r.try_get(1)?);
            if lines == 0 {
                continue;
            }
            let fid = format!(
                "file-{}-{}",
                if ok { "out" } else { "err" },
                super::short_id(id)
            );
            let name = format!("{id}_{}.jsonl", if ok { "output" } else { "error" });
            tx.execute(
                "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
                 ON CONFLICT (id) DO UPDATE SET owner = EXCLUDED.owner, purpose = EXCLUDED.purpose,
                     filename = EXCLUDED.filename, bytes = EXCLUDED.bytes, created_at = EXCLUDED.created_at,
                     lines = EXCLUDED.lines, endpoint = EXCLUDED.endpoint, batch_id = EXCLUDED.batch_id, ok = EXCLUDED.ok",
                &[
                    &fid,
                    &owner,
                    &(if ok { "batch_output" } else { "batch_error" }),
                    &name,
                    &bytes,
                    &at,
                    &lines,
                    &endpoint,
                    &id,
                    &ok,
                ],
            )?;
            ids[i] = Some(fid);
        }
        let col = to.stamp_column();
        tx.execute(
            &format!(
                "UPDATE batches SET status = $1, {col} = $2, output_file_id = $3, error_file_id = $4, predicted_finish = NULL,
                     lease_holder = NULL, lease_until = NULL WHERE id = $5"
            ),
            &[&to.name(), &at, &ids[0], &ids[1], &id],
        )?;
        tx.commit()?;
        Ok(true)
    }

    // ---- uploads -------------------------------------------------------

    /// Writes lines of upload `file` in one transaction. A repeated
    /// `custom_id` stops it: `(line number, custom_id)` of the repeat.
    pub(super) fn write_lines(
        &self,
        file: &str,
        lines: &[(u64, u64, String, String)],
    ) -> Result<Option<(u64, String)>, StoreError> {
        let mut g = self.lock()?;
        let mut tx = g.client()?.transaction()?;
        let st = tx.prepare(
            "INSERT INTO lines (file_id, line, custom_id, text) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        )?;
        for (index, number, id, text) in lines {
            if tx.execute(&st, &[&file, &(*index as i64), id, text])? == 0 {
                tx.commit()?;
                return Ok(Some((*number, id.clone())));
            }
        }
        tx.commit()?;
        Ok(None)
    }

    pub(super) fn first_use(&self, file: &str, custom_id: &str) -> Result<Option<u64>, StoreError> {
        let mut g = self.lock()?;
        let r = g.client()?.query_opt(
            "SELECT line FROM lines WHERE file_id = $1 AND custom_id = $2",
            &[&file, &custom_id],
        )?;
        Ok(match r {
            Some(r) => Some(r.try_get::<_, i64>(0)? as u64),
            None => None,
        })
    }

    pub(super) fn insert_file(&self, f: &FileRow) -> Result<(), StoreError> {
        let mut g = self.lock()?;
        g.client()?.execute(
            "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, lines, endpoint) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[&f.id, &f.owner, &f.purpose, &f.filename, &(f.bytes as i64), &f.created_at, &(f.lines as i64), &f.endpoint],
        )?;
        Ok(())
    }

    pub(super) fn drop_lines(&self, file: &str) -> Result<(), StoreError> {
        let mut g = self.lock()?;
        g.client()?
            .execute("DELETE FROM lines WHERE file_id = $1", &[&file])?;
        Ok(())
    }
}

fn file_row(r: &Row) -> Result<FileRow, StoreError> {
    Ok(FileRow {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        purpose: r.try_get(2)?,
        filename: r.try_get(3)?,
        bytes: r.try_get::<_, i64>(4)? as u64,
        created_at: r.try_get(5)?,
        lines: r.try_get::<_, i64>(6)? as u64,
        endpoint: r.try_get(7)?,
        batch_id: r.try_get(8)?,
        ok: r.try_get(9)?,
    })
}

fn batch_row(r: &Row) -> Result<BatchRow, StoreError> {
    let json = |s: Option<String>| s.and_then(|s| serde_json::from_str(&s).ok());
    let status: String = r.try_get(6)?;
    Ok(BatchRow {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        input_file_id: r.try_get(2)?,
        endpoint: r.try_get(3)?,
        completion_window: r.try_get(4)?,
        window_s: r.try_get(5)?,
        status: BatchStatus::parse(&status).unwrap_or(BatchStatus::Failed),
        created_at: r.try_get(7)?,
        expires_at: r.try_get(8)?,
        in_progress_at: r.try_get(9)?,
        finalizing_at: r.try_get(10)?,
        completed_at: r.try_get(11)?,
        failed_at: r.try_get(12)?,
        expired_at: r.try_get(13)?,
        cancelling_at: r.try_get(14)?,
        cancelled_at: r.try_get(15)?,
        counts: RequestCounts {
            total: r.try_get::<_, i64>(16)? as u64,
            completed: r.try_get::<_, i64>(17)? as u64,
            failed: r.try_get::<_, i64>(18)? as u64,
        },
        metadata: json(r.try_get(19)?),
        errors: json(r.try_get(20)?),
        output_file_id: r.try_get(21)?,
        error_file_id: r.try_get(22)?,
        tier: r.try_get(23)?,
        predicted_finish: r.try_get(24)?,
        gpu_seconds: r.try_get(25)?,
        deadline_misses: r.try_get::<_, i64>(26)? as u64,
        promise: super::Promise {
            on_time: r.try_get(27)?,
            finish: r.try_get(28)?,
            rank: r.try_get::<_, Option<i64>>(29)?.map(|r| r.max(0) as u64),
            pace_ratio: r.try_get(30)?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn a_url_is_shown_without_its_password() {
        assert_eq!(
            redact("postgres://kiln:s3cr@t@db:5432/kiln"),
            "postgres://kiln:***@db:5432/kiln"
        );
        assert_eq!(redact("postgres://kiln@db/kiln"), "postgres://kiln@db/kiln");
        assert_eq!(redact("postgres://db/kiln"), "postgres://db/kiln");
    }
}
