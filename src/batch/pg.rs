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

use super::store::{Counted, Extras, Finished, ItemResult, StoreError};
use super::{BatchRow, BatchStatus, FileRow, ItemLine, RequestCounts};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::{Client, Row};

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
CREATE TABLE IF NOT EXISTS uploads (
    file_id TEXT PRIMARY KEY,
    seen_at BIGINT NOT NULL
);
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
ALTER TABLE batches ADD COLUMN IF NOT EXISTS lease_epoch BIGINT NOT NULL DEFAULT 0;
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

/// A lease taken or renewed by `$1` for `$2` seconds; its epoch (the
/// fencing token) moves on when the holder changes (the right-hand sides
/// read the row as it was).
const TAKE: &str = "lease_epoch = CASE WHEN lease_holder IS DISTINCT FROM $1 THEN lease_epoch + 1 ELSE lease_epoch END,
    lease_holder = $1,
    lease_until = EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION + $2";

const BATCH_COLS: &str = "id, owner, input_file_id, endpoint, completion_window, window_s, status, created_at, expires_at,
    in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
    total, completed, failed, metadata, errors, output_file_id, error_file_id, tier, predicted_finish, gpu_seconds, deadline_misses,
    promised, promised_finish, plan_rank, pace_ratio";

/// Connections for data: item results, pages of lines, listings.
const DATA_CONNECTIONS: usize = 4;

/// How long one store call (connecting included) may take where `[batch]
/// store_timeout` does not say.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The PostgreSQL store: a few connections for data, and one of its own
/// for leases, so that renewing a lease never waits behind result writes;
/// each made again when it breaks.
///
/// **Every call is bounded.** The connections are `tokio-postgres`
/// clients driven by a runtime of the store's own (one thread); a call
/// blocks its (blocking) thread on that runtime. It waits at most the
/// store's timeout for its connection, and then has the timeout again for
/// connecting, the statements and the commit: a call that waited its turn
/// behind others still has the time to do its work. (With one budget for
/// both, callers queued after an outage got their connection with almost
/// nothing left, each dropped it mid-connect, and the store never came
/// back while callers kept arriving.) A call that runs out of time holding
/// its connection closes it (a stalled server holds no thread, and a late
/// reply is never read as the next call's) and fails with
/// [`StoreError::Unavailable`]; the next call connects again. The tables
/// are made on the first connection, and again on the next connection
/// after a statement found one missing (a database that came back empty,
/// answered [`StoreError::Unavailable`] once).
#[derive(Clone)]
pub struct Pg {
    url: Arc<str>,
    config: Arc<tokio_postgres::Config>,
    /// TLS to the server (`sslmode=require`): rustls, the server's
    /// certificate checked against the roots or `[batch] ca_file`.
    tls: Option<super::pg_tls::MakeRustls>,
    timeout: Duration,
    rt: Arc<Rt>,
    /// `[0]` leases; the rest data (made on first use).
    conns: Arc<[Slot]>,
    next: Arc<std::sync::atomic::AtomicUsize>,
    /// The tables are to be made on the next connection: at first, and
    /// after a statement found a table missing.
    make_tables: Arc<std::sync::atomic::AtomicBool>,
    /// `[batch] max_store_bytes` (0: none): past it, uploads are refused
    /// as on a full disk.
    limit: Arc<std::sync::atomic::AtomicU64>,
}

/// The store's runtime: one worker thread that drives the connections'
/// sockets. Shut down without waiting (the last clone of the store may be
/// dropped on an async thread, where blocking is not allowed).
struct Rt(Option<tokio::runtime::Runtime>);

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// A live connection: the client, and the task that drives its socket
/// (stopped with it, which closes the socket).
struct Live {
    client: Client,
    task: tokio::task::AbortHandle,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A connection's place: a fair (first come, first served) lock, so a
/// request's read is not starved by the runner's many result writes.
struct Slot(tokio::sync::Mutex<Option<Live>>);

impl Slot {
    fn busy(&self) -> bool {
        self.0.try_lock().is_err()
    }
}

/// Holds a slot; dropped while still holding it, it drops the connection.
struct Discard<'a>(Option<tokio::sync::MutexGuard<'a, Option<Live>>>);

impl Drop for Discard<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.0.as_mut() {
            **g = None;
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

/// The connection error's words with its cause (refused, unknown host,
/// authentication, certificate).
fn cause(e: &tokio_postgres::Error) -> String {
    let mut out = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// A result write's outcome under a lease ([`Pg::put_result_as`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// A new result, counted.
    New,
    /// The item had a result already (kept; this one is not counted).
    Had,
    /// The writer no longer holds the batch's lease under the token it
    /// ran the item with: nothing was written.
    Fenced,
}

impl Pg {
    /// Connects to `url` (`postgres://user:password@host:port/db`) and
    /// makes the tables where they are missing; every call after is
    /// bounded by `timeout`. `tls`: the TLS client for a URL with
    /// `sslmode=require` (or `prefer`, the default, where the server
    /// offers TLS).
    pub fn open(
        url: &str,
        timeout: Duration,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<Pg, StoreError> {
        let open = |message: String| StoreError::Open {
            path: redact(url),
            message,
        };
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| open(cause(&e)))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(timeout);
        }
        if config.get_application_name().is_none() {
            config.application_name("kiln");
        }
        let tls = super::pg_tls::for_config(&config, tls).map_err(open)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kiln-pg")
            .enable_all()
            .build()
            .map_err(|e| open(e.to_string()))?;
        let conns: Vec<Slot> = (0..=DATA_CONNECTIONS)
            .map(|_| Slot(tokio::sync::Mutex::new(None)))
            .collect();
        let pg = Pg {
            url: Arc::from(url),
            config: Arc::new(config),
            tls,
            timeout,
            rt: Arc::new(Rt(Some(rt))),
            conns: conns.into(),
            next: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            make_tables: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            limit: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        // The first connection, made now: a store that cannot be reached
        // at start says why before the gateway serves.
        pg.with(&pg.conns[0], async |_| Ok(()))
            .map_err(|e| match e {
                StoreError::Unavailable { message, .. } => open(message),
                e => e,
            })?;
        Ok(pg)
    }

    /// A new connection, driven by the store's runtime, with its tables.
    async fn connect(&self) -> Result<Live, StoreError> {
        let unavailable = |e: tokio_postgres::Error| StoreError::Unavailable {
            url: redact(&self.url),
            message: cause(&e),
        };
        let mut live = match &self.tls {
            Some(tls) => {
                let (client, conn) = self
                    .config
                    .connect(tls.clone())
                    .await
                    .map_err(unavailable)?;
                let task = tokio::spawn(conn).abort_handle();
                Live { client, task }
            }
            None => {
                let (client, conn) = self
                    .config
                    .connect(tokio_postgres::NoTls)
                    .await
                    .map_err(unavailable)?;
                let task = tokio::spawn(conn).abort_handle();
                Live { client, task }
            }
        };
        // Once, not on every connection: a reconnect is then only the
        // handshake (the DDL under an advisory lock made each reconnect
        // after an outage slow, and reconnects queue behind each other).
        if self.make_tables.load(Ordering::SeqCst) {
            // Replicas starting together: one makes the tables, the others
            // wait.
            let tx = live.client.transaction().await.map_err(unavailable)?;
            tx.execute("SELECT pg_advisory_xact_lock(7315002)", &[])
                .await
                .map_err(unavailable)?;
            tx.batch_execute(SCHEMA).await.map_err(unavailable)?;
            tx.commit().await.map_err(unavailable)?;
            self.make_tables.store(false, Ordering::SeqCst);
        }
        Ok(live)
    }

    /// Runs `f` on `slot`'s connection (made first where there is none or
    /// it broke): the wait for the connection (first come, first served)
    /// within the store's timeout, then connecting and `f` within it again.
    fn with<T>(
        &self,
        slot: &Slot,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let Some(rt) = self.rt.0.as_ref() else {
            return Err(StoreError::Poisoned);
        };
        let timeout = self.timeout;
        let late = || StoreError::Unavailable {
            url: redact(&self.url),
            message: format!(
                "no answer within {} ms (`[batch] store_timeout`)",
                timeout.as_millis()
            ),
        };
        rt.handle().block_on(async {
            let Ok(guard) = tokio::time::timeout(timeout, slot.0.lock()).await else {
                return Err(late());
            };
            // Dropped before it is disarmed (the call ran out of time while
            // holding the connection, which may be mid-reply): the
            // connection is not used again.
            let mut held = Discard(Some(guard));
            let work = async {
                let Some(g) = held.0.as_mut() else {
                    return Err(StoreError::Poisoned);
                };
                if g.as_ref().is_none_or(|l| l.client.is_closed()) {
                    **g = None;
                    **g = Some(self.connect().await?);
                }
                match g.as_mut() {
                    Some(l) => f(&mut l.client).await,
                    None => Err(StoreError::Poisoned),
                }
            };
            let out = match tokio::time::timeout(timeout, work).await {
                Ok(out) => out,
                Err(_) => return Err(late()),
            };
            if let Err(e) = &out {
                if e.missing_table() {
                    self.make_tables.store(true, Ordering::SeqCst);
                }
            }
            if !out.as_ref().err().is_some_and(StoreError::drops_connection) {
                held.0 = None;
            }
            out
        })
    }

    /// On a data connection: the first free one (the first data
    /// connection is never taken by [`Pg::bulk`], so an API call finds it
    /// free unless other API calls hold it), else the next in turn.
    fn data<T>(
        &self,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.with(self.pick(1), f)
    }

    /// On a data connection other than the first: the runner's result
    /// writes. A queue of them on every connection made a client's `GET
    /// /v1/batches/ID` wait past `store_timeout` (a 503 while PostgreSQL
    /// was healthy).
    fn bulk<T>(
        &self,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let from = if self.conns.len() > 2 { 2 } else { 1 };
        self.with(self.pick(from), f)
    }

    /// The first free connection from `from` on, else the next in turn.
    fn pick(&self, from: usize) -> &Slot {
        let range = &self.conns[from.min(self.conns.len() - 1)..];
        let i = range
            .iter()
            .position(|s| !s.busy())
            .unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed) % range.len());
        &range[i]
    }

    /// On the lease connection.
    fn lease<T>(
        &self,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.with(&self.conns[0], f)
    }

    pub fn url(&self) -> String {
        redact(&self.url)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    // ---- files ---------------------------------------------------------

    pub fn file(&self, id: &str) -> Result<Option<FileRow>, StoreError> {
        self.data(async |c| {
        let r = c.query_opt(
            "SELECT id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok FROM files WHERE id = $1",
            &[&id],
        ).await?;
        r.as_ref().map(file_row).transpose()
        })
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
        self.data(async |c| {
        let rows = c.query(
            "SELECT id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok FROM files
             WHERE (NOT $1 OR owner IS NOT DISTINCT FROM $2) AND ($3::TEXT IS NULL OR purpose = $3)
               AND ($4::TEXT IS NULL OR seq < (SELECT seq FROM files WHERE id = $4))
             ORDER BY seq DESC LIMIT $5",
            &[&filter, &who, &purpose, &after, &(limit as i64)],
        ).await?;
        rows.iter().map(file_row).collect()
        })
    }

    pub fn delete_file(&self, id: &str) -> Result<bool, StoreError> {
        self.data(async |c| {
            let tx = c.transaction().await?;
            let busy: i64 = tx
                .query_one(
                    &format!(
                    "SELECT COUNT(*) FROM batches WHERE input_file_id = $1 AND status IN {ACTIVE}"
                ),
                    &[&id],
                )
                .await?
                .try_get(0)?;
            if busy > 0 {
                return Ok(false);
            }
            tx.execute("DELETE FROM lines WHERE file_id = $1", &[&id])
                .await?;
            tx.execute("DELETE FROM files WHERE id = $1", &[&id])
                .await?;
            tx.execute(
                "UPDATE batches SET output_file_id = NULL WHERE output_file_id = $1",
                &[&id],
            )
            .await?;
            tx.execute(
                "UPDATE batches SET error_file_id = NULL WHERE error_file_id = $1",
                &[&id],
            )
            .await?;
            tx.commit().await?;
            Ok(true)
        })
    }

    pub fn lines(
        &self,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        self.data(async |c| {
            let rows = c.query(
            "SELECT line, text FROM lines WHERE file_id = $1 AND line >= $2 ORDER BY line LIMIT $3",
            &[&file, &(from as i64), &(limit as i64)],
        ).await?;
            rows.iter()
                .map(|r| Ok((r.try_get::<_, i64>(0)? as u64, r.try_get(1)?)))
                .collect()
        })
    }

    pub fn results(
        &self,
        batch: &str,
        ok: bool,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        self.data(async |c| {
        let rows = c.query(
            "SELECT line, text FROM results WHERE batch_id = $1 AND ok = $2 AND line >= $3 ORDER BY line LIMIT $4",
            &[&batch, &ok, &(from as i64), &(limit as i64)],
        ).await?;
        rows.iter()
            .map(|r| Ok((r.try_get::<_, i64>(0)? as u64, r.try_get(1)?)))
            .collect()
        })
    }

    // ---- batches -------------------------------------------------------

    pub fn insert_batch(&self, b: &BatchRow) -> Result<bool, StoreError> {
        self.data(async |c| {
        let tx = c.transaction().await?;
        // The file row is locked: a concurrent delete waits, then finds
        // the batch (or the batch finds no file).
        let exists = tx
            .query_opt(
                "SELECT 1 FROM files WHERE id = $1 FOR SHARE",
                &[&b.input_file_id],
            )
            .await?
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
        ).await?;
        tx.commit().await?;
        Ok(true)
        })
    }

    pub fn batch(&self, id: &str) -> Result<Option<BatchRow>, StoreError> {
        self.data(async |c| {
            let r = c
                .query_opt(
                    &format!("SELECT {BATCH_COLS} FROM batches WHERE id = $1"),
                    &[&id],
                )
                .await?;
            r.as_ref().map(batch_row).transpose()
        })
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
        self.data(async |c| {
            let rows = c
                .query(
                    &format!(
                        "SELECT {BATCH_COLS} FROM batches
                 WHERE (NOT $1 OR owner IS NOT DISTINCT FROM $2)
                   AND ($3::TEXT IS NULL OR seq < (SELECT seq FROM batches WHERE id = $3))
                 ORDER BY seq DESC LIMIT $4"
                    ),
                    &[&filter, &who, &after, &(limit as i64)],
                )
                .await?;
            rows.iter().map(batch_row).collect()
        })
    }

    pub fn active(&self) -> Result<Vec<BatchRow>, StoreError> {
        self.data(async |c| {
            let rows = c
                .query(
                    &format!(
                        "SELECT {BATCH_COLS} FROM batches WHERE status IN {ACTIVE} ORDER BY seq"
                    ),
                    &[],
                )
                .await?;
            rows.iter().map(batch_row).collect()
        })
    }

    /// Takes or renews the lease on batch `id` for `holder`, for `ttl_s`
    /// seconds on the database's clock: true when `holder` holds it now
    /// (it was free, expired, or already `holder`'s).
    pub fn claim(&self, id: &str, holder: &str, ttl_s: f64) -> Result<bool, StoreError> {
        self.lease(async |c| {
            let n = c
                .execute(
                    &format!(
                        "UPDATE batches SET {TAKE} WHERE id = $3 AND (lease_holder IS NULL OR lease_holder = $1
                             OR lease_until < EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION)"
                    ),
                    &[&holder, &ttl_s, &id],
                )
                .await?;
            Ok(n == 1)
        })
    }

    /// Takes every active batch whose lease is free or expired and renews
    /// `holder`'s own, in one statement: the batches `holder` holds now,
    /// each with its fencing token (the lease's epoch: it changes whenever
    /// the lease passes to another holder, and a result is written only
    /// under the token its item ran with, [`Pg::put_result_as`]).
    pub fn claim_all(&self, holder: &str, ttl_s: f64) -> Result<Vec<(String, i64)>, StoreError> {
        self.lease(async |c| {
            let rows = c
                .query(
                    &format!(
                        "UPDATE batches SET {TAKE}
                         WHERE status IN {ACTIVE} AND (lease_holder IS NULL OR lease_holder = $1
                             OR lease_until < EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION)
                         RETURNING id, lease_epoch"
                    ),
                    &[&holder, &ttl_s],
                )
                .await?;
            rows.iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                .collect()
        })
    }

    /// Gives up `holder`'s lease on batch `id`.
    pub fn release(&self, id: &str, holder: &str) -> Result<(), StoreError> {
        self.lease(async |c| {
            c.execute(
                "UPDATE batches SET lease_holder = NULL, lease_until = NULL WHERE id = $1 AND lease_holder = $2",
                &[&id, &holder],
            )
            .await?;
            Ok(())
        })
    }

    /// Gives up every lease `holder` has (a gateway that stops): the
    /// number of batches let go, which other replicas take at their next
    /// renewal instead of after the lease runs out. A result `holder`
    /// writes after this is fenced off.
    pub fn release_all(&self, holder: &str) -> Result<u64, StoreError> {
        self.lease(async |c| {
            Ok(c.execute(
                "UPDATE batches SET lease_holder = NULL, lease_until = NULL WHERE lease_holder = $1",
                &[&holder],
            )
            .await?)
        })
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
        self.data(async |c| {
        let n = c.execute(
            &format!(
                "UPDATE batches SET status = $1, {col} = COALESCE({col}, $2) WHERE id = $3 AND status IN ({})",
                list.join(",")
            ),
            &[&to.name(), &at, &id],
        ).await?;
        Ok(n == 1)
        })
    }

    pub fn set_errors(&self, id: &str, errors: &serde_json::Value) -> Result<(), StoreError> {
        self.data(async |c| {
            c.execute(
                "UPDATE batches SET errors = $1 WHERE id = $2",
                &[&errors.to_string(), &id],
            )
            .await?;
            Ok(())
        })
    }

    pub fn fail(&self, id: &str, errors: &serde_json::Value, at: i64) -> Result<(), StoreError> {
        self.data(async |c| {
            c.execute(
                "UPDATE batches SET status = 'failed', failed_at = $1, errors = $2 WHERE id = $3",
                &[&at, &errors.to_string(), &id],
            )
            .await?;
            Ok(())
        })
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
        self.data(async |c| {
            c.execute(
                "UPDATE batches SET predicted_finish = $1, plan_rank = COALESCE($2, plan_rank),
                     pace_ratio = COALESCE($3, pace_ratio) WHERE id = $4",
                &[&finish, &rank.map(|r| r as i64), &pace_ratio, &id],
            )
            .await?;
            Ok(())
        })
    }

    /// Sets a batch's model and output expiry (at creation).
    pub fn set_extras(
        &self,
        id: &str,
        model: Option<&str>,
        output_expires_s: Option<f64>,
    ) -> Result<(), StoreError> {
        self.data(async |c| {
            c.execute(
            "UPDATE batches SET model = COALESCE($1, model), output_expires_s = $2 WHERE id = $3",
            &[&model, &output_expires_s, &id],
        ).await?;
            Ok(())
        })
    }

    /// A batch's [`Extras`] (`None`: no such batch).
    pub fn extras(&self, id: &str) -> Result<Option<Extras>, StoreError> {
        self.data(async |c| {
        let row = c.query_opt(
            "SELECT model, input_tokens, output_tokens, output_expires_s FROM batches WHERE id = $1",
            &[&id],
        ).await?;
        Ok(row.map(|r| Extras {
            model: r.get(0),
            input_tokens: r.get::<_, i64>(1).max(0) as u64,
            output_tokens: r.get::<_, i64>(2).max(0) as u64,
            output_expires_s: r.get(3),
        }))
        })
    }

    /// Output and error files past their batch's `output_expires_after`
    /// at `now` (unix seconds).
    pub fn expired_outputs(&self, now: f64) -> Result<Vec<String>, StoreError> {
        self.data(async |c| {
        let rows = c.query(
            "SELECT f.id FROM files f JOIN batches b ON f.batch_id = b.id
             WHERE b.output_expires_s IS NOT NULL AND f.created_at::DOUBLE PRECISION + b.output_expires_s <= $1",
            &[&now],
        ).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
        })
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
        self.put_result_as(batch, r, input_tokens, output_tokens, None)
            .map(|w| w == Written::New)
    }

    /// Writes an item's result (once: a second result of the same item is
    /// kept out) and counts it with its tokens, in one transaction; under
    /// `lease`, as [`Pg::put_finished_as`].
    pub fn put_result_as(
        &self,
        batch: &str,
        r: &ItemResult,
        input_tokens: u64,
        output_tokens: u64,
        lease: Option<(&str, i64)>,
    ) -> Result<Written, StoreError> {
        let one = Finished {
            result: r.clone(),
            input_tokens,
            output_tokens,
        };
        Ok(match self.put_finished_as(batch, &[one], lease)? {
            None => Written::Fenced,
            Some(new) if new.first() == Some(&true) => Written::New,
            Some(_) => Written::Had,
        })
    }

    /// Writes finished items' results (each once: an item that had a
    /// result keeps it) and counts them with their tokens, in one
    /// transaction and three statements however many there are; for each,
    /// whether it was new. Under `lease` (`holder`, fencing token): only
    /// while the batch's lease is still `holder`'s with that token; the
    /// batch's row is locked for the check, so a replica taking the lease
    /// over waits for this write or this write finds the lease gone
    /// (`None`, nothing written). Whether the lease has run out does not
    /// matter: until another replica takes it, nobody else runs the
    /// batch's items.
    pub fn put_finished_as(
        &self,
        batch: &str,
        items: &[Finished],
        lease: Option<(&str, i64)>,
    ) -> Result<Option<Vec<bool>>, StoreError> {
        let lines: Vec<i64> = items.iter().map(|f| f.result.line as i64).collect();
        let oks: Vec<bool> = items.iter().map(|f| f.result.ok).collect();
        let texts: Vec<&str> = items.iter().map(|f| f.result.text.as_str()).collect();
        self.bulk(async |c| {
            let tx = c.transaction().await?;
            if let Some((holder, epoch)) = lease {
                let held = tx
                    .query_opt(
                        "SELECT 1 FROM batches WHERE id = $1 AND lease_holder = $2 AND lease_epoch = $3 FOR UPDATE",
                        &[&batch, &holder, &epoch],
                    )
                    .await?
                    .is_some();
                if !held {
                    return Ok(None);
                }
            }
            let rows = tx
                .query(
                    "INSERT INTO results (batch_id, line, ok, text)
                     SELECT $1, * FROM UNNEST($2::BIGINT[], $3::BOOLEAN[], $4::TEXT[])
                     ON CONFLICT DO NOTHING RETURNING line",
                    &[&batch, &lines, &oks, &texts],
                )
                .await?;
            let written: std::collections::HashSet<i64> =
                rows.iter().map(|r| r.get::<_, i64>(0)).collect();
            // A line twice in one write: its first result is the new one.
            let mut seen = std::collections::HashSet::new();
            let new: Vec<bool> = lines
                .iter()
                .map(|l| written.contains(l) && seen.insert(*l))
                .collect();
            let sum = Counted::of(items, &new);
            if sum.any {
                tx.execute(
                    "UPDATE batches SET completed = completed + $1, failed = failed + $2,
                         gpu_seconds = gpu_seconds + $3, deadline_misses = deadline_misses + $4,
                         input_tokens = input_tokens + $5, output_tokens = output_tokens + $6 WHERE id = $7",
                    &[
                        &sum.completed,
                        &sum.failed,
                        &sum.gpu_seconds,
                        &sum.missed,
                        &sum.input_tokens,
                        &sum.output_tokens,
                        &batch,
                    ],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(Some(new))
        })
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
        self.bulk(async |c| {
        let tx = c.transaction().await?;
        let ins = tx.prepare(
            "INSERT INTO results (batch_id, line, ok, text) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        ).await?;
        let mut new = 0u64;
        for r in rs {
            new += tx.execute(&ins, &[&batch, &(r.line as i64), &r.ok, &r.text]).await?;
        }
        if new > 0 {
            tx.execute(
                "UPDATE batches SET failed = failed + $1, deadline_misses = deadline_misses + $2 WHERE id = $3",
                &[&(new as i64), &(if missed { new as i64 } else { 0 }), &batch],
            ).await?;
        }
        tx.commit().await?;
        Ok(new)
        })
    }

    pub fn pending(
        &self,
        batch: &str,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<ItemLine>, StoreError> {
        self.data(async |c| {
            let rows = c
                .query(
                    "SELECT l.line, l.custom_id, l.text FROM lines l
             WHERE l.file_id = $1 AND l.line >= $2
               AND NOT EXISTS (SELECT 1 FROM results r WHERE r.batch_id = $3 AND r.line = l.line)
             ORDER BY l.line LIMIT $4",
                    &[&file, &(from as i64), &batch, &(limit as i64)],
                )
                .await?;
            rows.iter()
                .map(|r| {
                    Ok(ItemLine {
                        line: r.try_get::<_, i64>(0)? as u64,
                        custom_id: r.try_get(1)?,
                        text: r.try_get(2)?,
                    })
                })
                .collect()
        })
    }

    pub fn finalize(&self, id: &str, to: BatchStatus, at: i64) -> Result<bool, StoreError> {
        self.data(async |c| {
        let tx = c.transaction().await?;
        // The batch row is locked: two replicas finalizing at once take
        // turns, and the second finds it done.
        let Some(row) = tx.query_opt(
            "SELECT owner, status, endpoint FROM batches WHERE id = $1 FOR UPDATE",
            &[&id],
        ).await?
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
            ).await?;
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
            ).await?;
            ids[i] = Some(fid);
        }
        let col = to.stamp_column();
        tx.execute(
            &format!(
                "UPDATE batches SET status = $1, {col} = $2, output_file_id = $3, error_file_id = $4, predicted_finish = NULL,
                     lease_holder = NULL, lease_until = NULL WHERE id = $5"
            ),
            &[&to.name(), &at, &ids[0], &ids[1], &id],
        ).await?;
        tx.commit().await?;
        Ok(true)
        })
    }

    // ---- uploads -------------------------------------------------------

    /// Writes lines of upload `file` in one transaction. A repeated
    /// `custom_id` stops it: `(line number, custom_id)` of the repeat.
    /// Caps what kiln's tables may hold (`[batch] max_store_bytes`; 0:
    /// no cap): past it, uploads are refused as on a full disk. Results of
    /// accepted batches are still written (refusing them would lose work
    /// already done), so the cap bounds what new uploads add.
    pub fn limit_bytes(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::SeqCst);
    }

    /// What kiln's tables take (rows, indexes, TOAST), bytes.
    pub fn table_bytes(&self) -> Result<u64, StoreError> {
        self.data(async |c| {
            let r = c
                .query_one(
                    "SELECT (pg_total_relation_size('files') + pg_total_relation_size('lines') \
                     + pg_total_relation_size('batches') + pg_total_relation_size('results'))::BIGINT",
                    &[],
                )
                .await?;
            Ok(r.try_get::<_, i64>(0)?.max(0) as u64)
        })
    }

    /// Deletes the lines of uploads that stopped (their replica died, or
    /// its client went away without the upload being dropped) and were
    /// not seen for `stale_s` seconds: an upload marks itself in `uploads`
    /// with every page it writes, and its file row takes the mark away. An
    /// upload still going (on any replica) is kept. The lines removed.
    pub fn sweep_uploads(&self, stale_s: u64) -> Result<u64, StoreError> {
        let cutoff = now_s() - stale_s.min(i64::MAX as u64) as i64;
        self.data(async |c| {
            let tx = c.transaction().await?;
            let n = tx
                .execute(
                    "DELETE FROM lines l USING uploads u WHERE l.file_id = u.file_id AND u.seen_at < $1 \
                     AND NOT EXISTS (SELECT 1 FROM files f WHERE f.id = u.file_id)",
                    &[&cutoff],
                )
                .await?;
            tx.execute("DELETE FROM uploads WHERE seen_at < $1", &[&cutoff])
                .await?;
            tx.commit().await?;
            Ok(n)
        })
    }

    pub(super) fn write_lines(
        &self,
        file: &str,
        lines: &[(u64, u64, String, String)],
    ) -> Result<Option<(u64, String)>, StoreError> {
        let limit = self.limit.load(Ordering::SeqCst);
        if limit > 0 {
            let used = self.table_bytes()?;
            if used >= limit {
                return Err(StoreError::Limit { used, limit });
            }
        }
        self.data(async |c| {
        let tx = c.transaction().await?;
        // Marked first, in the same transaction: a replica that dies after
        // this page leaves lines the sweep can find.
        tx.execute(
            "INSERT INTO uploads (file_id, seen_at) VALUES ($1, $2) \
             ON CONFLICT (file_id) DO UPDATE SET seen_at = EXCLUDED.seen_at",
            &[&file, &now_s()],
        )
        .await?;
        let st = tx.prepare(
            "INSERT INTO lines (file_id, line, custom_id, text) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        ).await?;
        for (index, number, id, text) in lines {
            if tx.execute(&st, &[&file, &(*index as i64), id, text]).await? == 0 {
                tx.commit().await?;
                return Ok(Some((*number, id.clone())));
            }
        }
        tx.commit().await?;
        Ok(None)
        })
    }

    pub(super) fn first_use(&self, file: &str, custom_id: &str) -> Result<Option<u64>, StoreError> {
        self.data(async |c| {
            let r = c
                .query_opt(
                    "SELECT line FROM lines WHERE file_id = $1 AND custom_id = $2",
                    &[&file, &custom_id],
                )
                .await?;
            Ok(match r {
                Some(r) => Some(r.try_get::<_, i64>(0)? as u64),
                None => None,
            })
        })
    }

    pub(super) fn insert_file(&self, f: &FileRow) -> Result<(), StoreError> {
        self.data(async |c| {
        let tx = c.transaction().await?;
        tx.execute(
            "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, lines, endpoint) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[&f.id, &f.owner, &f.purpose, &f.filename, &(f.bytes as i64), &f.created_at, &(f.lines as i64), &f.endpoint],
        ).await?;
        tx.execute("DELETE FROM uploads WHERE file_id = $1", &[&f.id]).await?;
        tx.commit().await?;
        Ok(())
        })
    }

    pub(super) fn drop_lines(&self, file: &str) -> Result<(), StoreError> {
        self.data(async |c| {
            let tx = c.transaction().await?;
            tx.execute("DELETE FROM lines WHERE file_id = $1", &[&file])
                .await?;
            tx.execute("DELETE FROM uploads WHERE file_id = $1", &[&file])
                .await?;
            tx.commit().await?;
            Ok(())
        })
    }
}

/// Unix seconds, for the upload marks (one replica's clock against
/// another's: the staleness the sweep waits for is minutes, far beyond
/// their skew).
fn now_s() -> i64 {
    (crate::clock::unix_ms() / 1000.0) as i64
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
