//! The durable store: files, their lines, batches and item results in one
//! embedded SQLite database (WAL journal).
//!
//! Why SQLite: one file an operator can copy, inspect with `sqlite3` and
//! back up; transactions make each state change atomic, and WAL lets the
//! download of a large output file read while the runner writes.
//!
//! **Written once.** A result row's key is (batch, input line), and it is
//! inserted with `INSERT OR IGNORE` in the same transaction that counts it
//! in its batch: an item that ran twice (it was in flight at a crash and
//! ran again) keeps its first result and is counted once, so no
//! `custom_id` can appear twice in an output file. Upload refuses a file
//! whose `custom_id`s repeat (a unique index), so one line is one id.
//!
//! **Ordered.** WAL commits are durable in order: a batch's `completed`
//! status is committed after its last result, so a crash (even a power
//! loss, under `synchronous = NORMAL`) can lose the status change but never
//! keep it without the results it reports.
//!
//! **Bounded.** Nothing here reads a whole file: lines and results are
//! read in pages by line number.

use super::{BatchRow, BatchStatus, FileRow, ItemLine, RequestCounts};
use rusqlite::{params, Connection, OptionalExtension};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// A store failure. The message says which operation; the help line what
/// an operator can do.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StoreError {
    #[error("cannot open the batch store at {path}: {message}")]
    #[diagnostic(
        code(kiln::batch::store_open),
        help("set `[batch] store` in kiln.toml to a writable path (the directory is created), or to the URL of a reachable PostgreSQL (postgres://user:password@host:5432/db)")
    )]
    Open { path: String, message: String },
    #[error("batch store: {0}")]
    #[diagnostic(
        code(kiln::batch::store),
        help("the database may be damaged: check the disk and `sqlite3 FILE 'pragma integrity_check'`")
    )]
    Sql(rusqlite::Error),
    #[error("batch store is full: {0}")]
    #[diagnostic(
        code(kiln::batch::store_full),
        help("free disk space, raise `[batch] max_store_bytes`, or delete old files (`DELETE /v1/files/ID`); writes resume by themselves")
    )]
    Full(rusqlite::Error),
    #[error("batch store is at its cap: its tables hold {used} bytes of `[batch] max_store_bytes` {limit}")]
    #[diagnostic(
        code(kiln::batch::store_full),
        help("delete old files (`DELETE /v1/files/ID`) or raise `[batch] max_store_bytes`; uploads are taken again once the tables are under it (PostgreSQL gives deleted rows' space back at its next vacuum)")
    )]
    Limit { used: u64, limit: u64 },
    #[error("batch store (PostgreSQL): {0}")]
    #[diagnostic(
        code(kiln::batch::store_pg),
        help("check that the PostgreSQL in `[batch] store` is up and reachable; the batch runner retries with backoff")
    )]
    Pg(#[from] tokio_postgres::Error),
    #[error("batch store (PostgreSQL at {url}) is unavailable: {message}")]
    #[diagnostic(
        code(kiln::batch::store_unavailable),
        help("check that the PostgreSQL in `[batch] store` is up and reachable from this replica; meanwhile file and batch requests are answered 503 with Retry-After, and the batch runner sends nothing, keeps the results it has, and resumes by itself when the database answers (`[batch] store_timeout` bounds each call)")
    )]
    Unavailable { url: String, message: String },
    #[error("batch store (PostgreSQL): TLS: {0}")]
    #[diagnostic(
        code(kiln::batch::store_tls),
        help("`[batch] ca_file`, `client_cert` and `client_key` are PEM files read at startup: the CA that signed the PostgreSQL server's certificate, and a client certificate and its key where the server asks for one (both or neither)")
    )]
    Tls(crate::tls::TlsError),
    #[error("batch store: a lock was poisoned")]
    #[diagnostic(code(kiln::batch::store_lock), help("restart the gateway"))]
    Poisoned,
}

impl From<rusqlite::Error> for StoreError {
    /// A full disk (or `max_page_count` reached) is its own error: callers
    /// answer it with 507 and pause, instead of retrying at once.
    fn from(e: rusqlite::Error) -> Self {
        if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
            StoreError::Full(e)
        } else {
            StoreError::Sql(e)
        }
    }
}

impl StoreError {
    /// The store is out of room (disk full or `[batch] max_store_bytes`).
    pub fn is_full(&self) -> bool {
        match self {
            StoreError::Full(_) | StoreError::Limit { .. } => true,
            StoreError::Pg(e) => e.code() == Some(&tokio_postgres::error::SqlState::DISK_FULL),
            _ => false,
        }
    }

    /// The store cannot be reached for now (PostgreSQL down, stalled,
    /// restarting, out of connections, its tables gone): a caller answers
    /// 503 with Retry-After and tries again later, rather than 500.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Unavailable { .. } => true,
            StoreError::Pg(e) => pg_transient(e),
            _ => false,
        }
    }

    /// The PostgreSQL connection this came from is not to be used again
    /// (closed, broken, or the database lost its tables: the next
    /// connection makes them).
    pub fn drops_connection(&self) -> bool {
        match self {
            StoreError::Unavailable { .. } => true,
            StoreError::Pg(e) => pg_transient(e),
            _ => false,
        }
    }

    /// A statement found a table missing (PostgreSQL 42P01: a database that
    /// came back empty); the store makes its tables on its next connection.
    pub fn missing_table(&self) -> bool {
        match self {
            StoreError::Pg(e) => e.code().is_some_and(|c| c.code() == "42P01"),
            _ => false,
        }
    }
}

/// A PostgreSQL error that says the server or the connection is at fault,
/// not the statement: no answer from the server at all (I/O, closed), or
/// its codes for a lost connection (class 08), a server shutting down or
/// starting (57P01-57P03), too many connections (53300), and a missing
/// table (42P01: a database that came back empty).
fn pg_transient(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        // No answer from the server: the socket failed or timed out.
        None => std::error::Error::source(e)
            .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some()),
        Some(c) => {
            let c = c.code();
            c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03" | "53300" | "42P01")
        }
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    lines INTEGER NOT NULL,
    endpoint TEXT,
    -- output and error files are the results of a batch, read from `results`
    batch_id TEXT,
    ok INTEGER
);
-- `lines` and `results` are rowid tables: their rows hold whole requests
-- and answers (a kilobyte and more), which a WITHOUT ROWID table stores
-- inside its B-tree pages at a few rows a page: 3.6x the bytes written
-- (a 66 MB file took 236 MB) and 5x the time (`migrate_layout`).
CREATE TABLE IF NOT EXISTS lines (
    file_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (file_id, line)
);
CREATE UNIQUE INDEX IF NOT EXISTS lines_custom_id ON lines (file_id, custom_id);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT,
    seq INTEGER NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    window_s REAL NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    tier TEXT,
    predicted_finish REAL,
    gpu_seconds REAL NOT NULL DEFAULT 0,
    deadline_misses INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_seq ON batches (seq);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
";

pub use super::backend::{is_url, Remote, Store, Upload};

/// The embedded SQLite store, one gateway's ([`Store`] picks it or
/// PostgreSQL). Cheap to clone; every call blocks on SQLite, so async
/// callers run it on a blocking thread ([`Store::run`]).
#[derive(Clone)]
pub struct Sqlite {
    /// Writes (one writer at a time, as SQLite allows).
    write: Arc<Mutex<Connection>>,
    /// Reads, beside the writer (WAL: readers see the last commit).
    read: Arc<Mutex<Connection>>,
    pub path: Option<PathBuf>,
    temp: Option<Arc<TempFile>>,
    /// Checkpoints the WAL off the writer's path (`None`: SQLite's own
    /// automatic checkpoints, in whichever commit passes 1,000 pages).
    checkpoints: Option<Arc<Checkpointer>>,
}

/// Copies the WAL into the database on a thread of its own, with its own
/// connection: every 2 s while there were writes and no upload is in
/// progress, and as soon as an upload commits. An upload's pages then
/// cost one write (to the WAL) on its path instead of two (WAL, then the
/// checkpoint inside some later commit, with its fsyncs): a 64 MB upload
/// no longer waits for 64 MB more to be copied into the database. What is
/// committed is as durable either way (the WAL is the database until it
/// is checkpointed; a restart recovers it).
struct Checkpointer {
    wake: Mutex<std::sync::mpsc::Sender<()>>,
    /// Uploads writing now: checkpoints wait until none is.
    uploads: std::sync::atomic::AtomicUsize,
}

impl Checkpointer {
    /// Starts the thread on its own connection to `path`; `None` when it
    /// cannot (the writer then checkpoints as SQLite does by default).
    fn start(path: &Path) -> Option<Arc<Checkpointer>> {
        let conn = Connection::open(path).ok()?;
        configure(&conn).ok()?;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let me = Arc::new(Checkpointer {
            wake: Mutex::new(tx),
            uploads: std::sync::atomic::AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&me);
        std::thread::Builder::new()
            .name("kiln-checkpoint".into())
            .spawn(move || loop {
                use std::sync::mpsc::RecvTimeoutError;
                match rx.recv_timeout(std::time::Duration::from_secs(2)) {
                    Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                    // The store is gone.
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                let Some(me) = weak.upgrade() else { break };
                if me.uploads.load(std::sync::atomic::Ordering::Acquire) > 0 {
                    continue;
                }
                drop(me);
                // Passive: never waits for (nor blocks) readers or the
                // writer; what it cannot copy now it copies next time.
                let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
            })
            .ok()?;
        Some(me)
    }

    fn wake(&self) {
        if let Ok(tx) = self.wake.lock() {
            let _ = tx.send(());
        }
    }
}

/// Removes a temporary database (and its WAL files) when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        for ext in ["", "-wal", "-shm"] {
            let mut p = self.0.clone().into_os_string();
            p.push(ext);
            let _ = std::fs::remove_file(p);
        }
    }
}

fn lock(m: &Mutex<Connection>) -> Result<MutexGuard<'_, Connection>, StoreError> {
    m.lock().map_err(|_| StoreError::Poisoned)
}

/// Moves a database made with the old layout (`lines` and `results`
/// WITHOUT ROWID) to rowid tables, in one transaction, once: same names,
/// columns and keys, so every query reads both the same. `SCHEMA` then
/// makes the indexes again.
fn migrate_layout(c: &Connection) -> Result<(), rusqlite::Error> {
    for (table, cols) in [
        ("lines", "file_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, text TEXT NOT NULL, PRIMARY KEY (file_id, line)"),
        ("results", "batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, text TEXT NOT NULL, PRIMARY KEY (batch_id, line)"),
    ] {
        let sql: Option<String> = c
            .query_row(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?1",
                [table],
                |r| r.get(0),
            )
            .optional()?;
        if !sql.is_some_and(|s| s.to_ascii_uppercase().contains("WITHOUT ROWID")) {
            continue;
        }
        tracing::info!(table, "batch store: moving to the rowid layout (once)");
        c.execute_batch(&format!(
            "BEGIN IMMEDIATE;
             ALTER TABLE {table} RENAME TO {table}_old;
             CREATE TABLE {table} ({cols});
             INSERT INTO {table} SELECT * FROM {table}_old;
             DROP TABLE {table}_old;
             COMMIT;"
        ))?;
    }
    Ok(())
}

/// Columns added to `batches` after its first layout, each added once
/// to an older database (`ALTER TABLE … ADD COLUMN`, which keeps rows).
const EXTRA_COLUMNS: [(&str, &str); 8] = [
    ("model", "TEXT"),
    ("input_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("output_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("output_expires_s", "REAL"),
    // The promise (`super::Promise`): made at submission, and the
    // batch's place in the plan as the runner last saw it.
    ("promised", "INTEGER"),
    ("promised_finish", "REAL"),
    ("plan_rank", "INTEGER"),
    ("pace_ratio", "REAL"),
];

fn add_columns(c: &Connection) -> Result<(), rusqlite::Error> {
    let have: Vec<String> = {
        let mut st = c.prepare("SELECT name FROM pragma_table_info('batches')")?;
        let rows = st.query_map([], |r| r.get::<_, String>(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for (name, ty) in EXTRA_COLUMNS {
        if !have.iter().any(|h| h == name) {
            c.execute_batch(&format!("ALTER TABLE batches ADD COLUMN {name} {ty}"))?;
        }
    }
    Ok(())
}

/// What a batch has beyond [`BatchRow`]: OpenAI's `model` and `usage`,
/// and how long its output and error files are kept.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Extras {
    pub model: Option<String>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Wall seconds after their creation the output and error files
    /// expire (`output_expires_after`); `None`: kept until deleted.
    pub output_expires_s: Option<f64>,
}

fn configure(c: &Connection) -> Result<(), rusqlite::Error> {
    c.busy_timeout(std::time::Duration::from_secs(10))?;
    c.pragma_update(None, "journal_mode", "WAL")?;
    c.pragma_update(None, "synchronous", "NORMAL")?;
    c.pragma_update(None, "foreign_keys", "ON")?;
    Ok(())
}

impl Sqlite {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> Result<Sqlite, StoreError> {
        let err = |message: String| StoreError::Open {
            path: path.display().to_string(),
            message,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        let write = Connection::open(path).map_err(|e| err(e.to_string()))?;
        // Freed pages go back to the file system (`reclaim`) instead of
        // staying in the file: a refused upload must not keep its size.
        // Only a new database takes this (SQLite sets it before the first
        // table); an older one keeps its pages for reuse.
        write
            .pragma_update(None, "auto_vacuum", "INCREMENTAL")
            .map_err(|e| err(e.to_string()))?;
        configure(&write).map_err(|e| err(e.to_string()))?;
        migrate_layout(&write).map_err(|e| err(e.to_string()))?;
        write
            .execute_batch(SCHEMA)
            .map_err(|e| err(e.to_string()))?;
        add_columns(&write).map_err(|e| err(e.to_string()))?;
        Sqlite::sweep_orphans(&write).map_err(|e| err(e.to_string()))?;
        let read = Connection::open(path).map_err(|e| err(e.to_string()))?;
        configure(&read).map_err(|e| err(e.to_string()))?;
        let checkpoints = Checkpointer::start(path);
        if checkpoints.is_some() {
            // The checkpointer copies the WAL; the writer only appends to
            // it. A WAL an upload grew is cut back to 64 MB when reused.
            write
                .pragma_update(None, "wal_autocheckpoint", 0)
                .map_err(|e| err(e.to_string()))?;
            write
                .pragma_update(None, "journal_size_limit", 64 * 1024 * 1024)
                .map_err(|e| err(e.to_string()))?;
        }
        Ok(Sqlite {
            write: Arc::new(Mutex::new(write)),
            read: Arc::new(Mutex::new(read)),
            path: Some(path.to_path_buf()),
            temp: None,
            checkpoints,
        })
    }

    /// A private database in a temporary file, removed when the last
    /// clone of the store is dropped: gateways started in-process without
    /// a `[batch] store` (tests) get their own, never a shared default.
    pub fn temporary() -> Result<Sqlite, StoreError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "kiln-batches-{}-{}-{}.db",
            std::process::id(),
            crate::clock::unix_ms() as u64,
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let mut s = Sqlite::open(&path)?;
        s.temp = Some(Arc::new(TempFile(path)));
        Ok(s)
    }

    /// Caps the database at about `bytes` (SQLite's `max_page_count`):
    /// past it, writes fail as on a full disk ([`StoreError::Full`]).
    pub fn limit_bytes(&self, bytes: u64) -> Result<(), StoreError> {
        for conn in [&self.write, &self.read] {
            let c = lock(conn)?;
            let page: i64 = c.query_row("PRAGMA page_size", [], |r| r.get(0))?;
            let pages = (bytes / page.max(512) as u64).max(1);
            let _: i64 = c.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |r| {
                r.get(0)
            })?;
        }
        Ok(())
    }

    /// Gives freed pages back to the file system: the free list (on a
    /// database made with incremental auto-vacuum) and the WAL. Best
    /// effort: called after space was freed, and a failure here only
    /// means the space is reused later instead of returned now.
    pub fn reclaim(&self) {
        if let Ok(c) = lock(&self.write) {
            let _ = c.execute_batch("PRAGMA incremental_vacuum;");
            let _ = c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
        }
    }

    /// Bytes the database file and its WAL take on disk now.
    pub fn disk_bytes(&self) -> u64 {
        let Some(p) = &self.path else { return 0 };
        let mut wal = p.clone().into_os_string();
        wal.push("-wal");
        [p.clone(), PathBuf::from(wal)]
            .iter()
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.len())
            .sum()
    }

    // ---- files ---------------------------------------------------------

    /// Begins an upload. Its lines are written in short transactions as
    /// they arrive (an upload never holds the writer while its body is on
    /// the network) under a file id no file row names yet, so nothing sees
    /// them; [`Upload::commit`] adds the row, and a dropped upload deletes
    /// them. Lines a crash left behind are removed at the next open.
    pub fn upload(&self, file: &str) -> SqliteUpload<'_> {
        if let Some(c) = &self.checkpoints {
            c.uploads.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
        SqliteUpload {
            store: self,
            file: file.to_string(),
            pending: Vec::new(),
            pending_bytes: 0,
            done: false,
            writer: None,
        }
    }

    /// Deletes lines no file row names: uploads a crash interrupted.
    fn sweep_orphans(c: &Connection) -> Result<(), rusqlite::Error> {
        c.execute(
            "DELETE FROM lines WHERE file_id NOT IN (SELECT id FROM files)",
            [],
        )?;
        Ok(())
    }

    pub fn file(&self, id: &str) -> Result<Option<FileRow>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok FROM files WHERE id = ?1",
        )?;
        Ok(st.query_row([id], file_row).optional()?)
    }

    /// Files, newest first, of `owner` (all with `None` for an admin), a
    /// page after the file `after`.
    pub fn files(
        &self,
        owner: Option<Option<&str>>,
        purpose: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<FileRow>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok FROM files
             WHERE (?1 = 0 OR owner IS ?2) AND (?3 IS NULL OR purpose = ?3)
               AND (?4 IS NULL OR rowid < (SELECT rowid FROM files WHERE id = ?4))
             ORDER BY rowid DESC LIMIT ?5",
        )?;
        let (filter, who) = match owner {
            Some(o) => (1, o),
            None => (0, None),
        };
        let rows = st.query_map(params![filter, who, purpose, after, limit as i64], file_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Deletes an input file and its lines. A batch that still reads it
    /// keeps it: false then.
    pub fn delete_file(&self, id: &str) -> Result<bool, StoreError> {
        let mut c = lock(&self.write)?;
        let tx = c.transaction()?;
        let busy: i64 = tx.query_row(
            "SELECT COUNT(*) FROM batches WHERE input_file_id = ?1 AND status IN ('validating','in_progress','finalizing','cancelling')",
            [id],
            |r| r.get(0),
        )?;
        if busy > 0 {
            return Ok(false);
        }
        tx.execute("DELETE FROM lines WHERE file_id = ?1", [id])?;
        tx.execute("DELETE FROM files WHERE id = ?1", [id])?;
        // An output or error file names its batch: the batch forgets it.
        tx.execute(
            "UPDATE batches SET output_file_id = NULL WHERE output_file_id = ?1",
            [id],
        )?;
        tx.execute(
            "UPDATE batches SET error_file_id = NULL WHERE error_file_id = ?1",
            [id],
        )?;
        tx.commit()?;
        drop(c);
        self.reclaim();
        Ok(true)
    }

    /// Up to `limit` lines of an input file from line `from`, in order, as
    /// (line number, stored text).
    pub fn lines(
        &self,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT line, text FROM lines WHERE file_id = ?1 AND line >= ?2 ORDER BY line LIMIT ?3",
        )?;
        let rows = st.query_map(params![file, from as i64, limit as i64], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get::<_, String>(1)?))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Up to `limit` result lines of a batch from line `from`: the output
    /// (`ok`) or error lines, as (line number, text).
    pub fn results(
        &self,
        batch: &str,
        ok: bool,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT line, text FROM results WHERE batch_id = ?1 AND ok = ?2 AND line >= ?3 ORDER BY line LIMIT ?4",
        )?;
        let rows = st.query_map(params![batch, ok, from as i64, limit as i64], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get::<_, String>(1)?))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- batches -------------------------------------------------------

    /// Stores a new batch, in one transaction with the check that its
    /// input file still exists (a concurrent delete loses or wins whole):
    /// false when the file is gone.
    pub fn insert_batch(&self, b: &BatchRow) -> Result<bool, StoreError> {
        let mut c = lock(&self.write)?;
        let tx = c.transaction()?;
        let exists: i64 = tx.query_row(
            "SELECT COUNT(*) FROM files WHERE id = ?1",
            [&b.input_file_id],
            |r| r.get(0),
        )?;
        if exists == 0 {
            return Ok(false);
        }
        tx.execute(
            "INSERT INTO batches (id, owner, seq, input_file_id, endpoint, completion_window, window_s, status,
                created_at, expires_at, total, metadata, tier, predicted_finish,
                promised, promised_finish, plan_rank, pace_ratio)
             VALUES (?1, ?2, (SELECT COALESCE(MAX(seq), 0) + 1 FROM batches), ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13,
                ?14, ?15, ?16, ?17)",
            params![
                b.id,
                b.owner,
                b.input_file_id,
                b.endpoint,
                b.completion_window,
                b.window_s,
                b.status.name(),
                b.created_at,
                b.expires_at,
                b.counts.total as i64,
                b.metadata.as_ref().map(|m| m.to_string()),
                b.tier,
                b.predicted_finish,
                b.promise.on_time,
                b.promise.finish,
                b.promise.rank.map(|r| r as i64),
                b.promise.pace_ratio,
            ],
        )?;
        tx.commit()?;
        Ok(true)
    }

    pub fn batch(&self, id: &str) -> Result<Option<BatchRow>, StoreError> {
        let c = lock(&self.read)?;
        let mut st =
            c.prepare_cached(&format!("SELECT {BATCH_COLS} FROM batches WHERE id = ?1"))?;
        Ok(st.query_row([id], batch_row).optional()?)
    }

    /// Batches, newest first, of `owner` (all with `None`), a page after
    /// the batch `after`.
    pub fn batches(
        &self,
        owner: Option<Option<&str>>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<BatchRow>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(&format!(
            "SELECT {BATCH_COLS} FROM batches
             WHERE (?1 = 0 OR owner IS ?2)
               AND (?3 IS NULL OR seq < (SELECT seq FROM batches WHERE id = ?3))
             ORDER BY seq DESC LIMIT ?4"
        ))?;
        let (filter, who) = match owner {
            Some(o) => (1, o),
            None => (0, None),
        };
        let rows = st.query_map(params![filter, who, after, limit as i64], batch_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Batches the runner still has work for, oldest first.
    pub fn active(&self) -> Result<Vec<BatchRow>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(&format!(
            "SELECT {BATCH_COLS} FROM batches WHERE status IN ('validating','in_progress','finalizing','cancelling') ORDER BY seq"
        ))?;
        let rows = st.query_map([], batch_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Moves a batch to `to` (from one of `from`), stamping its time; false
    /// when it was not in one of `from`.
    pub fn transition(
        &self,
        id: &str,
        from: &[BatchStatus],
        to: BatchStatus,
        at: i64,
    ) -> Result<bool, StoreError> {
        let c = lock(&self.write)?;
        let list: Vec<String> = from.iter().map(|s| format!("'{}'", s.name())).collect();
        let col = to.stamp_column();
        let n = c.execute(
            &format!(
                "UPDATE batches SET status = ?1, {col} = COALESCE({col}, ?2) WHERE id = ?3 AND status IN ({})",
                list.join(",")
            ),
            params![to.name(), at, id],
        )?;
        Ok(n == 1)
    }

    /// Sets a batch's model and output expiry (at creation).
    pub fn set_extras(
        &self,
        id: &str,
        model: Option<&str>,
        output_expires_s: Option<f64>,
    ) -> Result<(), StoreError> {
        let c = lock(&self.write)?;
        c.execute(
            "UPDATE batches SET model = COALESCE(?1, model), output_expires_s = ?2 WHERE id = ?3",
            params![model, output_expires_s, id],
        )?;
        Ok(())
    }

    /// A batch's [`Extras`] (`None`: no such batch).
    pub fn extras(&self, id: &str) -> Result<Option<Extras>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT model, input_tokens, output_tokens, output_expires_s FROM batches WHERE id = ?1",
        )?;
        Ok(st
            .query_row([id], |r| {
                Ok(Extras {
                    model: r.get(0)?,
                    input_tokens: r.get::<_, i64>(1)?.max(0) as u64,
                    output_tokens: r.get::<_, i64>(2)?.max(0) as u64,
                    output_expires_s: r.get(3)?,
                })
            })
            .optional()?)
    }

    /// Output and error files past their batch's `output_expires_after`
    /// at `now` (unix seconds).
    pub fn expired_outputs(&self, now: f64) -> Result<Vec<String>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT f.id FROM files f JOIN batches b ON f.batch_id = b.id
             WHERE b.output_expires_s IS NOT NULL AND f.created_at + b.output_expires_s <= ?1",
        )?;
        let rows = st.query_map([now], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Sets a batch's errors object (OpenAI's `errors`), status unchanged.
    pub fn set_errors(&self, id: &str, errors: &serde_json::Value) -> Result<(), StoreError> {
        let c = lock(&self.write)?;
        c.execute(
            "UPDATE batches SET errors = ?1 WHERE id = ?2",
            params![errors.to_string(), id],
        )?;
        Ok(())
    }

    /// A failed batch: its errors object (OpenAI's `errors`).
    pub fn fail(&self, id: &str, errors: &serde_json::Value, at: i64) -> Result<(), StoreError> {
        let c = lock(&self.write)?;
        c.execute(
            "UPDATE batches SET status = 'failed', failed_at = ?1, errors = ?2 WHERE id = ?3",
            params![at, errors.to_string(), id],
        )?;
        Ok(())
    }

    /// A running batch's predicted finish and its place in the plan (its
    /// rank in its group and the group's pace ratio; `None` keeps the
    /// stored one).
    pub fn set_prediction(
        &self,
        id: &str,
        finish: Option<f64>,
        rank: Option<u64>,
        pace_ratio: Option<f64>,
    ) -> Result<(), StoreError> {
        let c = lock(&self.write)?;
        c.prepare_cached(
            "UPDATE batches SET predicted_finish = ?1, plan_rank = COALESCE(?2, plan_rank),
                 pace_ratio = COALESCE(?3, pace_ratio) WHERE id = ?4",
        )?
        .execute(params![finish, rank.map(|r| r as i64), pace_ratio, id])?;
        Ok(())
    }

    /// Writes one item's result, once: true when this call wrote it (and
    /// counted it), false when the item already had one.
    pub fn put_result(&self, batch: &str, r: &ItemResult) -> Result<bool, StoreError> {
        self.put_result_usage(batch, r, 0, 0)
    }

    /// [`Store::put_result`], adding the item's tokens to its batch's
    /// usage in the same transaction (so a batch's usage is complete when
    /// its counts are).
    pub fn put_result_usage(
        &self,
        batch: &str,
        r: &ItemResult,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Result<bool, StoreError> {
        let one = Finished {
            result: r.clone(),
            input_tokens,
            output_tokens,
        };
        Ok(self.put_finished(batch, &[one])?.first() == Some(&true))
    }

    /// Writes finished items' results with their tokens, in one
    /// transaction (one commit for many items); for each, whether it was
    /// new (an item that had a result keeps it, and is not counted again).
    pub fn put_finished(&self, batch: &str, items: &[Finished]) -> Result<Vec<bool>, StoreError> {
        let mut c = lock(&self.write)?;
        let tx = c.transaction()?;
        let mut new = Vec::with_capacity(items.len());
        {
            let mut ins = tx.prepare_cached(
                "INSERT OR IGNORE INTO results (batch_id, line, ok, text) VALUES (?1, ?2, ?3, ?4)",
            )?;
            for f in items {
                let r = &f.result;
                new.push(ins.execute(params![batch, r.line as i64, r.ok, r.text])? == 1);
            }
        }
        let sum = Counted::of(items, &new);
        if sum.any {
            tx.execute(
                "UPDATE batches SET completed = completed + ?1, failed = failed + ?2,
                     gpu_seconds = gpu_seconds + ?3, deadline_misses = deadline_misses + ?4,
                     input_tokens = input_tokens + ?5, output_tokens = output_tokens + ?6 WHERE id = ?7",
                params![
                    sum.completed,
                    sum.failed,
                    sum.gpu_seconds,
                    sum.missed,
                    sum.input_tokens,
                    sum.output_tokens,
                    batch
                ],
            )?;
        }
        tx.commit()?;
        Ok(new)
    }

    /// Writes many results in one transaction (items a batch's end left
    /// unrun); returns how many were new. Every one counts as failed (as
    /// OpenAI counts a cancelled batch's unrun requests); `missed` also
    /// counts them as deadline misses (expired).
    pub fn put_results(
        &self,
        batch: &str,
        rs: &[ItemResult],
        missed: bool,
    ) -> Result<u64, StoreError> {
        let mut c = lock(&self.write)?;
        let tx = c.transaction()?;
        let mut new = 0u64;
        {
            let mut ins = tx.prepare_cached(
                "INSERT OR IGNORE INTO results (batch_id, line, ok, text) VALUES (?1, ?2, ?3, ?4)",
            )?;
            for r in rs {
                new += ins.execute(params![batch, r.line as i64, r.ok, r.text])? as u64;
            }
        }
        if new > 0 {
            tx.execute(
                "UPDATE batches SET failed = failed + ?1, deadline_misses = deadline_misses + ?2 WHERE id = ?3",
                params![new as i64, if missed { new as i64 } else { 0 }, batch],
            )?;
        }
        tx.commit()?;
        Ok(new)
    }

    /// Input lines of a batch that have no result yet, from line `from`.
    pub fn pending(
        &self,
        batch: &str,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<ItemLine>, StoreError> {
        let c = lock(&self.read)?;
        let mut st = c.prepare_cached(
            "SELECT l.line, l.custom_id, l.text FROM lines l
             WHERE l.file_id = ?1 AND l.line >= ?2
               AND NOT EXISTS (SELECT 1 FROM results r WHERE r.batch_id = ?3 AND r.line = l.line)
             ORDER BY l.line LIMIT ?4",
        )?;
        let rows = st.query_map(params![file, from as i64, batch, limit as i64], |r| {
            Ok(ItemLine {
                line: r.get::<_, i64>(0)? as u64,
                custom_id: r.get(1)?,
                text: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Creates the output and error files of a batch from its results and
    /// moves it from `finalizing` to `to`, in one transaction: the status
    /// says `completed` only once its files are committed.
    pub fn finalize(&self, id: &str, to: BatchStatus, at: i64) -> Result<bool, StoreError> {
        let mut c = lock(&self.write)?;
        let tx = c.transaction()?;
        let Some((owner, status, endpoint)) = tx
            .query_row(
                "SELECT owner, status, endpoint FROM batches WHERE id = ?1",
                [id],
                |r| {
                    Ok((
                        r.get::<_, Option<String>>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                },
            )
            .optional()?
        else {
            return Ok(false);
        };
        if status != BatchStatus::Finalizing.name() && status != BatchStatus::Cancelling.name() {
            return Ok(false);
        }
        let mut ids = [None, None];
        for (i, ok) in [true, false].into_iter().enumerate() {
            let (lines, bytes): (i64, i64) = tx.query_row(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(CAST(text AS BLOB)) + 1), 0) FROM results WHERE batch_id = ?1 AND ok = ?2",
                params![id, ok],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
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
                "INSERT OR REPLACE INTO files (id, owner, purpose, filename, bytes, created_at, lines, endpoint, batch_id, ok)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                params![
                    fid,
                    owner,
                    if ok { "batch_output" } else { "batch_error" },
                    name,
                    bytes,
                    at,
                    lines,
                    endpoint,
                    id,
                    ok
                ],
            )?;
            ids[i] = Some(fid);
        }
        let col = to.stamp_column();
        tx.execute(
            &format!(
                "UPDATE batches SET status = ?1, {col} = ?2, output_file_id = ?3, error_file_id = ?4, predicted_finish = NULL WHERE id = ?5"
            ),
            params![to.name(), at, ids[0], ids[1], id],
        )?;
        tx.commit()?;
        Ok(true)
    }
}

/// One item's result line, ready to store.
#[derive(Debug, Clone)]
pub struct ItemResult {
    pub line: u64,
    /// Output file (true) or error file.
    pub ok: bool,
    /// The JSON line (no newline).
    pub text: String,
    pub gpu_seconds: f64,
    /// Finished after its batch's window.
    pub missed: bool,
}

/// A finished item as the runner writes it: its result and the tokens it
/// used (counted in its batch's usage with the result, together).
#[derive(Debug, Clone)]
pub struct Finished {
    pub result: ItemResult,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// What the new results of a write add to their batch's counts.
#[derive(Debug, Default)]
pub(super) struct Counted {
    pub any: bool,
    pub completed: i64,
    pub failed: i64,
    pub gpu_seconds: f64,
    pub missed: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
}

impl Counted {
    /// The sums over `items` whose flag in `new` is set.
    pub fn of(items: &[Finished], new: &[bool]) -> Counted {
        let mut c = Counted::default();
        for (f, _) in items.iter().zip(new).filter(|(_, n)| **n) {
            let r = &f.result;
            c.any = true;
            c.completed += i64::from(r.ok);
            c.failed += i64::from(!r.ok);
            c.gpu_seconds += r.gpu_seconds;
            c.missed += i64::from(r.missed);
            c.input_tokens = c.input_tokens.saturating_add(f.input_tokens as i64);
            c.output_tokens = c.output_tokens.saturating_add(f.output_tokens as i64);
        }
        c
    }
}

/// A line of an upload: (index, line number in the file, custom_id, text).
type UploadLine = (u64, u64, String, String);

/// What writing an upload's pages found: the first repeated `custom_id`
/// (line number, id), or nothing.
type PageOutcome = Result<Option<(u64, String)>, StoreError>;

/// An upload in progress: lines buffered, then written a page at a time
/// by a thread of the upload's own, so the next page is validated while
/// the last one is written (on two cores, JSON checks and SQLite's writes
/// overlap instead of taking turns).
pub struct SqliteUpload<'a> {
    store: &'a Sqlite,
    file: String,
    /// Lines not yet handed to the writer.
    pending: Vec<UploadLine>,
    pending_bytes: usize,
    done: bool,
    /// The page writer (`None`: pages are written in the caller's thread,
    /// where a thread could not be started, or once the writer ended).
    writer: Option<PageWriter>,
}

struct PageWriter {
    pages: std::sync::mpsc::SyncSender<Vec<UploadLine>>,
    /// Its one answer, when it ends: the first repeat or error it met (it
    /// stops there), or nothing once every page is written.
    outcome: std::sync::mpsc::Receiver<PageOutcome>,
    handle: std::thread::JoinHandle<()>,
}

impl PageWriter {
    fn start(store: &Sqlite, file: &str) -> Option<PageWriter> {
        // One page waiting while one is written: memory stays bounded.
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<UploadLine>>(1);
        let (otx, orx) = std::sync::mpsc::channel::<PageOutcome>();
        let (store, file) = (store.clone(), file.to_string());
        let handle = std::thread::Builder::new()
            .name("kiln-upload".into())
            .spawn(move || {
                for page in rx {
                    match write_page(&store, &file, &page) {
                        Ok(None) => {}
                        other => {
                            let _ = otx.send(other);
                            return;
                        }
                    }
                }
                let _ = otx.send(Ok(None));
            })
            .ok()?;
        Some(PageWriter {
            pages: tx,
            outcome: orx,
            handle,
        })
    }

    /// Closes it and waits for its answer.
    fn finish(self) -> PageOutcome {
        drop(self.pages);
        let out = self.outcome.recv().unwrap_or(Err(StoreError::Poisoned));
        let _ = self.handle.join();
        out
    }
}

/// Lines (or bytes of them) an upload buffers before it writes a page.
const UPLOAD_PAGE_LINES: usize = 2000;
const UPLOAD_PAGE_BYTES: usize = 8 * 1024 * 1024;

/// Writes one page of `file`'s lines in one short transaction. A repeated
/// `custom_id` stops it (the lines before it are kept, for
/// [`SqliteUpload::first_use`]): `(line number, custom_id)` of the repeat.
fn write_page(store: &Sqlite, file: &str, page: &[UploadLine]) -> PageOutcome {
    let mut c = lock(&store.write)?;
    let tx = c.transaction()?;
    {
        let mut st = tx.prepare_cached(
            "INSERT OR IGNORE INTO lines (file_id, line, custom_id, text) VALUES (?1, ?2, ?3, ?4)",
        )?;
        for (index, number, id, text) in page {
            if st.execute(params![file, *index as i64, id, text])? == 0 {
                let dup = (*number, id.clone());
                drop(st);
                tx.commit()?;
                return Ok(Some(dup));
            }
        }
    }
    tx.commit()?;
    Ok(None)
}

impl SqliteUpload<'_> {
    /// Adds request `index` (line `number` of the file). `Ok(Some((n,
    /// id)))`: line `n` repeats an earlier `custom_id` (found when its page
    /// is written, so possibly a few pages later, or at
    /// [`SqliteUpload::commit`]: the caller stops at the first). A store
    /// error (a full disk) comes back the same way.
    pub fn line(
        &mut self,
        index: u64,
        number: u64,
        custom_id: &str,
        text: &str,
    ) -> Result<Option<(u64, String)>, StoreError> {
        self.pending_bytes += text.len() + custom_id.len();
        self.pending
            .push((index, number, custom_id.to_string(), text.to_string()));
        if self.pending.len() >= UPLOAD_PAGE_LINES || self.pending_bytes >= UPLOAD_PAGE_BYTES {
            return self.flush();
        }
        Ok(None)
    }

    /// Hands the buffered lines to the writer (or writes them here). What
    /// the writer met so far comes back.
    fn flush(&mut self) -> Result<Option<(u64, String)>, StoreError> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let page = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        if self.writer.is_none() && !self.done {
            self.writer = PageWriter::start(self.store, &self.file);
        }
        let Some(w) = &self.writer else {
            return write_page(self.store, &self.file, &page);
        };
        // The writer stopped early (a repeat, an error): that is the answer.
        if let Ok(out) = w.outcome.try_recv() {
            self.writer.take().map(PageWriter::finish);
            return out;
        }
        if w.pages.send(page).is_err() {
            return self.writer.take().map_or(Ok(None), PageWriter::finish);
        }
        Ok(None)
    }

    /// The request index that first used `custom_id`.
    pub fn first_use(&self, custom_id: &str) -> Result<Option<u64>, StoreError> {
        let c = lock(&self.store.read)?;
        let mut q =
            c.prepare_cached("SELECT line FROM lines WHERE file_id = ?1 AND custom_id = ?2")?;
        let n: Option<i64> = q
            .query_row(params![self.file, custom_id], |r| r.get(0))
            .optional()?;
        Ok(n.map(|n| n as u64))
    }

    /// Writes what is buffered (and waits for every page) and the file's
    /// row: the file exists from here on. `Ok(Some(..))`: a repeated
    /// `custom_id`.
    pub fn commit(&mut self, f: &FileRow) -> Result<Option<(u64, String)>, StoreError> {
        if let Some(dup) = self.flush()? {
            return Ok(Some(dup));
        }
        if let Some(dup) = self.writer.take().map_or(Ok(None), PageWriter::finish)? {
            return Ok(Some(dup));
        }
        let c = lock(&self.store.write)?;
        c.execute(
            "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, lines, endpoint) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![f.id, f.owner, f.purpose, f.filename, f.bytes as i64, f.created_at, f.lines as i64, f.endpoint],
        )?;
        self.done = true;
        Ok(None)
    }
}

impl Drop for SqliteUpload<'_> {
    /// An upload not committed leaves nothing.
    fn drop(&mut self) {
        // Its pages are all written (or dropped) before anything is
        // deleted.
        if let Some(w) = self.writer.take() {
            let _ = w.finish();
        }
        if !self.done {
            // One statement, one transaction; then the space goes back
            // (a refused 200 MB upload must not leave the store 200 MB
            // larger). A failure here is swept at the next open.
            let deleted = match lock(&self.store.write) {
                Ok(c) => c
                    .execute("DELETE FROM lines WHERE file_id = ?1", [&self.file])
                    .is_ok(),
                Err(_) => false,
            };
            if deleted {
                self.store.reclaim();
            }
        }
        // Checkpoints go on, at once (after the reclaim above: one running
        // beside it would keep the WAL at its size).
        if let Some(c) = &self.store.checkpoints {
            c.uploads.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            c.wake();
        }
    }
}

fn file_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<FileRow> {
    Ok(FileRow {
        id: r.get(0)?,
        owner: r.get(1)?,
        purpose: r.get(2)?,
        filename: r.get(3)?,
        bytes: r.get::<_, i64>(4)? as u64,
        created_at: r.get(5)?,
        lines: r.get::<_, i64>(6)? as u64,
        endpoint: r.get(7)?,
        batch_id: r.get(8)?,
        ok: r.get(9)?,
    })
}

const BATCH_COLS: &str = "id, owner, input_file_id, endpoint, completion_window, window_s, status, created_at, expires_at,
    in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
    total, completed, failed, metadata, errors, output_file_id, error_file_id, tier, predicted_finish, gpu_seconds, deadline_misses,
    promised, promised_finish, plan_rank, pace_ratio";

fn batch_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<BatchRow> {
    let json = |s: Option<String>| s.and_then(|s| serde_json::from_str(&s).ok());
    let status: String = r.get(6)?;
    Ok(BatchRow {
        id: r.get(0)?,
        owner: r.get(1)?,
        input_file_id: r.get(2)?,
        endpoint: r.get(3)?,
        completion_window: r.get(4)?,
        window_s: r.get(5)?,
        status: BatchStatus::parse(&status).unwrap_or(BatchStatus::Failed),
        created_at: r.get(7)?,
        expires_at: r.get(8)?,
        in_progress_at: r.get(9)?,
        finalizing_at: r.get(10)?,
        completed_at: r.get(11)?,
        failed_at: r.get(12)?,
        expired_at: r.get(13)?,
        cancelling_at: r.get(14)?,
        cancelled_at: r.get(15)?,
        counts: RequestCounts {
            total: r.get::<_, i64>(16)? as u64,
            completed: r.get::<_, i64>(17)? as u64,
            failed: r.get::<_, i64>(18)? as u64,
        },
        metadata: json(r.get(19)?),
        errors: json(r.get(20)?),
        output_file_id: r.get(21)?,
        error_file_id: r.get(22)?,
        tier: r.get(23)?,
        predicted_finish: r.get(24)?,
        gpu_seconds: r.get(25)?,
        deadline_misses: r.get::<_, i64>(26)? as u64,
        promise: super::Promise {
            on_time: r.get(27)?,
            finish: r.get(28)?,
            rank: r.get::<_, Option<i64>>(29)?.map(|r| r.max(0) as u64),
            pace_ratio: r.get(30)?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{BatchRow, BatchStatus, FileRow};

    fn file(id: &str, lines: u64) -> FileRow {
        FileRow::example(id, lines)
    }

    fn batch(id: &str, file: &str, total: u64) -> BatchRow {
        BatchRow::example(id, file, total)
    }

    fn result(line: u64, ok: bool, text: &str) -> ItemResult {
        ItemResult {
            line,
            ok,
            text: text.into(),
            gpu_seconds: 0.5,
            missed: false,
        }
    }

    fn stored(s: &Store, id: &str, n: u64) {
        let mut up = s.upload(id);
        for i in 0..n {
            assert_eq!(
                up.line(i, i + 1, &format!("c{i}"), &format!("line {i}"))
                    .unwrap(),
                None
            );
        }
        assert_eq!(up.commit(&file(id, n)).unwrap(), None);
    }

    #[test]
    fn a_result_is_written_and_counted_once() {
        let s = Store::temporary().unwrap();
        stored(&s, "file-a", 3);
        assert!(s.insert_batch(&batch("batch_a", "file-a", 3)).unwrap());
        assert!(s.put_result("batch_a", &result(0, true, "first")).unwrap());
        // The same item again (it ran twice across a crash): kept once.
        assert!(!s
            .put_result("batch_a", &result(0, false, "second"))
            .unwrap());
        assert!(s.put_result("batch_a", &result(2, false, "err")).unwrap());
        let b = s.batch("batch_a").unwrap().unwrap();
        assert_eq!((b.counts.completed, b.counts.failed), (1, 1));
        assert_eq!(
            s.results("batch_a", true, 0, 10).unwrap(),
            vec![(0, "first".to_string())]
        );
        let left: Vec<u64> = s
            .pending("batch_a", "file-a", 0, 10)
            .unwrap()
            .iter()
            .map(|i| i.line)
            .collect();
        assert_eq!(left, vec![1]);
        // Finalizing makes the files and the status in one step.
        assert!(s
            .transition(
                "batch_a",
                &[BatchStatus::InProgress],
                BatchStatus::Finalizing,
                5
            )
            .unwrap());
        assert!(s.finalize("batch_a", BatchStatus::Completed, 6).unwrap());
        let b = s.batch("batch_a").unwrap().unwrap();
        assert_eq!(b.status, BatchStatus::Completed);
        let out = s
            .file(b.output_file_id.as_deref().unwrap())
            .unwrap()
            .unwrap();
        assert_eq!((out.lines, out.bytes), (1, 6));
        assert!(b.error_file_id.is_some());
    }

    #[test]
    fn an_upload_is_all_or_nothing_and_repeats_are_named() {
        let s = Store::temporary().unwrap();
        {
            let mut up = s.upload("file-x");
            for i in 0..2500u64 {
                assert_eq!(up.line(i, i + 1, &format!("c{i}"), "x").unwrap(), None);
            }
            // Dropped without a commit: the written pages go too.
        }
        assert!(s.lines("file-x", 0, 10).unwrap().is_empty());
        let mut up = s.upload("file-y");
        up.line(0, 1, "same", "a").unwrap();
        up.line(1, 3, "same", "b").unwrap();
        assert_eq!(
            up.commit(&file("file-y", 2)).unwrap(),
            Some((3, "same".into()))
        );
        assert_eq!(up.first_use("same").unwrap(), Some(0));
    }

    #[test]
    fn a_deleted_file_cannot_be_batched_and_a_running_batch_keeps_its_file() {
        let s = Store::temporary().unwrap();
        stored(&s, "file-a", 1);
        assert!(s.insert_batch(&batch("batch_a", "file-a", 1)).unwrap());
        assert!(
            !s.delete_file("file-a").unwrap(),
            "in use by a running batch"
        );
        stored(&s, "file-b", 1);
        assert!(s.delete_file("file-b").unwrap());
        assert!(!s.insert_batch(&batch("batch_b", "file-b", 1)).unwrap());
    }

    #[test]
    fn a_full_store_says_so_and_a_refused_upload_gives_its_space_back() {
        let s = Store::temporary().unwrap();
        let empty = s.disk_bytes();
        s.limit_bytes(1024 * 1024).unwrap();
        let err = {
            let mut up = s.upload("file-big");
            let mut err = None;
            for i in 0..5000u64 {
                if let Err(e) = up.line(i, i + 1, &format!("c{i}"), &"x".repeat(1000)) {
                    err = Some(e);
                    break;
                }
            }
            // Pages are written behind the lines: the error may come with
            // the last ones, at the commit.
            if err.is_none() {
                err = up.commit(&file("file-big", 5000)).err();
            }
            err
            // Dropped: its rows go, and their pages with them.
        };
        let err = err.expect("a 5 MB upload fills a 1 MiB store");
        assert!(err.is_full(), "{err}");
        assert!(
            s.disk_bytes() < empty + 64 * 1024,
            "{} bytes kept after the refused upload (empty: {empty})",
            s.disk_bytes()
        );
        // What fits still goes in.
        stored(&s, "file-small", 10);
        assert_eq!(s.lines("file-small", 0, 100).unwrap().len(), 10);
    }

    #[test]
    fn a_store_of_the_old_layout_is_moved_and_keeps_its_rows() {
        let dir = std::env::temp_dir().join(format!("kiln-store-layout-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("old.db");
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE lines (file_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, text TEXT NOT NULL, PRIMARY KEY (file_id, line)) WITHOUT ROWID;
                 CREATE UNIQUE INDEX lines_custom_id ON lines (file_id, custom_id);
                 CREATE TABLE results (batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, text TEXT NOT NULL, PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
                 CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, lines INTEGER NOT NULL, endpoint TEXT, batch_id TEXT, ok INTEGER);
                 INSERT INTO files VALUES ('file-a', 't', 'batch', 'f.jsonl', 10, 1, 2, '/v1/chat/completions', NULL, NULL);
                 INSERT INTO lines VALUES ('file-a', 0, 'c0', 'line 0'), ('file-a', 1, 'c1', 'line 1');
                 INSERT INTO results VALUES ('batch_a', 0, 1, 'first');",
            )
            .unwrap();
        }
        let s = Sqlite::open(&path).unwrap();
        assert_eq!(
            s.lines("file-a", 0, 10).unwrap(),
            vec![(0, "line 0".to_string()), (1, "line 1".to_string())]
        );
        assert_eq!(
            s.results("batch_a", true, 0, 10).unwrap(),
            vec![(0, "first".to_string())]
        );
        let c = lock(&s.write).unwrap();
        let sql: String = c
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'lines'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(!sql.to_ascii_uppercase().contains("WITHOUT ROWID"), "{sql}");
        // The keys hold as before: a repeated custom_id or line is refused.
        assert!(c
            .execute("INSERT INTO lines VALUES ('file-a', 2, 'c0', 'x')", [])
            .is_err());
        assert_eq!(
            c.execute(
                "INSERT OR IGNORE INTO results VALUES ('batch_a', 0, 0, 'again')",
                []
            )
            .unwrap(),
            0
        );
        drop(c);
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn reopening_sweeps_an_interrupted_upload() {
        let dir = std::env::temp_dir().join(format!("kiln-store-test-{}", std::process::id()));
        let path = dir.join("b.db");
        {
            let s = Store::open(&path).unwrap();
            let mut up = s.upload("file-z");
            for i in 0..2000u64 {
                up.line(i, i + 1, &format!("c{i}"), "x").unwrap();
            }
            // A crash: the upload is never committed nor dropped.
            std::mem::forget(up);
        }
        let s = Store::open(&path).unwrap();
        assert!(s.lines("file-z", 0, 10).unwrap().is_empty());
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_promise_is_stored_and_read_back_after_reopening() {
        let dir = std::env::temp_dir().join(format!(
            "kiln-store-promise-{}-{}",
            std::process::id(),
            crate::clock::unix_ms() as u64
        ));
        let path = dir.join("b.db");
        let promise = crate::batch::Promise {
            on_time: Some(false),
            finish: Some(1234.5),
            rank: Some(1),
            pace_ratio: None,
        };
        {
            let s = Store::open(&path).unwrap();
            stored(&s, "file-a", 2);
            let mut b = batch("batch_a", "file-a", 2);
            b.promise = promise;
            assert!(s.insert_batch(&b).unwrap());
            assert_eq!(s.batch("batch_a").unwrap().unwrap().promise, promise);
            // The runner's plan: finish, rank and the group's pace.
            s.set_prediction("batch_a", Some(1300.0), Some(2), Some(3.5))
                .unwrap();
            // None keeps what is stored.
            s.set_prediction("batch_a", Some(1310.0), None, None)
                .unwrap();
        }
        let s = Store::open(&path).unwrap();
        let b = s.batch("batch_a").unwrap().unwrap();
        assert_eq!(b.predicted_finish, Some(1310.0));
        assert_eq!(
            b.promise,
            crate::batch::Promise {
                rank: Some(2),
                pace_ratio: Some(3.5),
                ..promise
            }
        );
        assert_eq!(s.active().unwrap()[0].promise, b.promise);
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
