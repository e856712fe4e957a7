//! Which database holds the Files and Batches: the embedded SQLite file
//! (one gateway, the default) or a shared PostgreSQL (a fleet: any replica
//! answers any file or batch). [`Store`] has the same calls on both; each
//! forwards to [`super::store::Sqlite`] or [`super::pg::Pg`].

use super::pg::{Pg, Written};
use super::store::{Extras, Finished, ItemResult, Sqlite, SqliteUpload, StoreError};
use super::{BatchRow, BatchStatus, FileRow, ItemLine};
use std::path::Path;

/// How a PostgreSQL store is reached: each call's time limit, and the
/// TLS client (`[batch] ca_file`, `client_cert`, `client_key`; `None`:
/// none set).
#[derive(Clone)]
pub struct Remote {
    pub timeout: std::time::Duration,
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl Default for Remote {
    fn default() -> Self {
        Remote {
            timeout: super::pg::DEFAULT_TIMEOUT,
            tls: None,
        }
    }
}

/// The batch store. Cheap to clone; every call blocks, so async callers
/// run it on a blocking thread ([`Store::run`]).
#[derive(Clone)]
pub enum Store {
    Sqlite(Sqlite),
    Postgres(Pg),
}

/// Whether `spec` (`[batch] store`) names a PostgreSQL database rather
/// than a file.
pub fn is_url(spec: &str) -> bool {
    spec.starts_with("postgres://") || spec.starts_with("postgresql://")
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            Store::Sqlite($s) => $e,
            Store::Postgres($s) => $e,
        }
    };
}

impl Store {
    /// The SQLite database at `path` (created).
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Sqlite::open(path).map(Store::Sqlite)
    }

    /// `spec` is a `postgres://` URL (a shared database) or a path (an
    /// SQLite file). Blocks: call it on a blocking thread.
    pub fn connect(spec: &str) -> Result<Store, StoreError> {
        Store::connect_with(spec, &Remote::default())
    }

    /// [`Store::connect`] with a PostgreSQL's call timeout and TLS.
    pub fn connect_with(spec: &str, remote: &Remote) -> Result<Store, StoreError> {
        if is_url(spec) {
            Pg::open(spec, remote.timeout, remote.tls.clone()).map(Store::Postgres)
        } else {
            Store::open(Path::new(spec))
        }
    }

    /// A private SQLite database, removed with the last clone.
    pub fn temporary() -> Result<Store, StoreError> {
        Sqlite::temporary().map(Store::Sqlite)
    }

    /// Where the store is, for messages: the SQLite file, or the
    /// PostgreSQL URL with its password hidden.
    pub fn location(&self) -> Option<String> {
        match self {
            Store::Sqlite(s) => s.path.as_ref().map(|p| p.display().to_string()),
            Store::Postgres(p) => Some(p.url()),
        }
    }

    /// Whether replicas share this store (batch leases matter).
    pub fn shared(&self) -> bool {
        matches!(self, Store::Postgres(_))
    }

    /// Runs `f` on a blocking thread (every store call blocks).
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let s = self.clone();
        match tokio::task::spawn_blocking(move || f(&s)).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Poisoned),
        }
    }

    /// Caps the store's size: an SQLite file's pages; what kiln's
    /// PostgreSQL tables hold before uploads are refused.
    pub fn limit_bytes(&self, bytes: u64) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(s) => s.limit_bytes(bytes),
            Store::Postgres(p) => {
                p.limit_bytes(bytes);
                Ok(())
            }
        }
    }

    /// Deletes what interrupted uploads left: SQLite does it when it
    /// opens (one gateway, no upload can be running then); on PostgreSQL
    /// the uploads no replica has written to for `stale_s`. Lines removed.
    pub fn sweep_uploads(&self, stale_s: u64) -> Result<u64, StoreError> {
        match self {
            Store::Sqlite(_) => Ok(0),
            Store::Postgres(p) => p.sweep_uploads(stale_s),
        }
    }

    pub fn reclaim(&self) {
        if let Store::Sqlite(s) = self {
            s.reclaim();
        }
    }

    /// Bytes an SQLite store takes on disk (0 for PostgreSQL).
    pub fn disk_bytes(&self) -> u64 {
        match self {
            Store::Sqlite(s) => s.disk_bytes(),
            Store::Postgres(_) => 0,
        }
    }

    pub fn upload(&self, file: &str) -> Upload<'_> {
        match self {
            Store::Sqlite(s) => Upload::Sqlite(s.upload(file)),
            Store::Postgres(p) => Upload::Postgres(PgUpload {
                pg: p,
                file: file.to_string(),
                pending: Vec::new(),
                pending_bytes: 0,
                done: false,
            }),
        }
    }

    pub fn file(&self, id: &str) -> Result<Option<FileRow>, StoreError> {
        each!(self, s => s.file(id))
    }

    pub fn files(
        &self,
        owner: Option<Option<&str>>,
        purpose: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<FileRow>, StoreError> {
        each!(self, s => s.files(owner, purpose, after, limit))
    }

    pub fn delete_file(&self, id: &str) -> Result<bool, StoreError> {
        each!(self, s => s.delete_file(id))
    }

    pub fn lines(
        &self,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        each!(self, s => s.lines(file, from, limit))
    }

    pub fn results(
        &self,
        batch: &str,
        ok: bool,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        each!(self, s => s.results(batch, ok, from, limit))
    }

    pub fn insert_batch(&self, b: &BatchRow) -> Result<bool, StoreError> {
        each!(self, s => s.insert_batch(b))
    }

    pub fn batch(&self, id: &str) -> Result<Option<BatchRow>, StoreError> {
        each!(self, s => s.batch(id))
    }

    pub fn batches(
        &self,
        owner: Option<Option<&str>>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<BatchRow>, StoreError> {
        each!(self, s => s.batches(owner, after, limit))
    }

    pub fn active(&self) -> Result<Vec<BatchRow>, StoreError> {
        each!(self, s => s.active())
    }

    /// Takes or renews `holder`'s lease on batch `id` for `ttl_s`
    /// seconds: true when `holder` may run its items now. One gateway
    /// (SQLite) always may.
    pub fn claim(&self, id: &str, holder: &str, ttl_s: f64) -> Result<bool, StoreError> {
        match self {
            Store::Sqlite(_) => Ok(true),
            Store::Postgres(p) => p.claim(id, holder, ttl_s),
        }
    }

    /// Takes every active batch whose lease is free or expired and renews
    /// `holder`'s own: the ids `holder` holds now (on one gateway's own
    /// store, `None`: it runs every batch).
    pub fn claim_all(
        &self,
        holder: &str,
        ttl_s: f64,
    ) -> Result<Option<Vec<(String, i64)>>, StoreError> {
        match self {
            Store::Sqlite(_) => Ok(None),
            Store::Postgres(p) => p.claim_all(holder, ttl_s).map(Some),
        }
    }

    /// Gives up `holder`'s lease on batch `id`.
    pub fn release(&self, id: &str, holder: &str) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(_) => Ok(()),
            Store::Postgres(p) => p.release(id, holder),
        }
    }

    /// Gives up every lease `holder` has (a gateway that stops): how many.
    pub fn release_all(&self, holder: &str) -> Result<u64, StoreError> {
        match self {
            Store::Sqlite(_) => Ok(0),
            Store::Postgres(p) => p.release_all(holder),
        }
    }

    pub fn transition(
        &self,
        id: &str,
        from: &[BatchStatus],
        to: BatchStatus,
        at: i64,
    ) -> Result<bool, StoreError> {
        each!(self, s => s.transition(id, from, to, at))
    }

    pub fn set_errors(&self, id: &str, errors: &serde_json::Value) -> Result<(), StoreError> {
        each!(self, s => s.set_errors(id, errors))
    }

    pub fn fail(&self, id: &str, errors: &serde_json::Value, at: i64) -> Result<(), StoreError> {
        each!(self, s => s.fail(id, errors, at))
    }

    /// A running batch's predicted finish, its rank in its group's run
    /// order and its group's pace ratio (`None` keeps the stored one).
    pub fn set_prediction(
        &self,
        id: &str,
        finish: Option<f64>,
        rank: Option<u64>,
        pace_ratio: Option<f64>,
    ) -> Result<(), StoreError> {
        each!(self, s => s.set_prediction(id, finish, rank, pace_ratio))
    }

    pub fn put_result(&self, batch: &str, r: &ItemResult) -> Result<bool, StoreError> {
        each!(self, s => s.put_result(batch, r))
    }

    /// Sets a batch's model and output expiry (at creation).
    pub fn set_extras(
        &self,
        id: &str,
        model: Option<&str>,
        output_expires_s: Option<f64>,
    ) -> Result<(), StoreError> {
        each!(self, s => s.set_extras(id, model, output_expires_s))
    }

    /// A batch's [`Extras`] (`None`: no such batch).
    pub fn extras(&self, id: &str) -> Result<Option<Extras>, StoreError> {
        each!(self, s => s.extras(id))
    }

    /// Output and error files past their batch's `output_expires_after`.
    pub fn expired_outputs(&self, now: f64) -> Result<Vec<String>, StoreError> {
        each!(self, s => s.expired_outputs(now))
    }

    /// [`Store::put_result`], adding the item's tokens to its batch's usage.
    pub fn put_result_usage(
        &self,
        batch: &str,
        r: &ItemResult,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Result<bool, StoreError> {
        each!(self, s => s.put_result_usage(batch, r, input_tokens, output_tokens))
    }

    /// [`Store::put_result_usage`] under a batch lease (`holder`, fencing
    /// token; `None`, and always on one gateway's own store: unfenced):
    /// `None` when the lease has passed to another holder and nothing was
    /// written, else whether the result is new.
    pub fn put_result_as(
        &self,
        batch: &str,
        r: &ItemResult,
        input_tokens: u64,
        output_tokens: u64,
        lease: Option<(&str, i64)>,
    ) -> Result<Option<bool>, StoreError> {
        match self {
            Store::Sqlite(s) => s
                .put_result_usage(batch, r, input_tokens, output_tokens)
                .map(Some),
            Store::Postgres(p) => p
                .put_result_as(batch, r, input_tokens, output_tokens, lease)
                .map(|w| match w {
                    Written::New => Some(true),
                    Written::Had => Some(false),
                    Written::Fenced => None,
                }),
        }
    }

    /// Finished items' results with their tokens, in one transaction,
    /// under a batch lease as [`Store::put_result_as`]: `None` when the
    /// lease has passed to another holder and nothing was written, else
    /// for each item whether its result is new.
    pub fn put_finished_as(
        &self,
        batch: &str,
        items: &[Finished],
        lease: Option<(&str, i64)>,
    ) -> Result<Option<Vec<bool>>, StoreError> {
        match self {
            Store::Sqlite(s) => s.put_finished(batch, items).map(Some),
            Store::Postgres(p) => p.put_finished_as(batch, items, lease),
        }
    }

    pub fn put_results(
        &self,
        batch: &str,
        rs: &[ItemResult],
        missed: bool,
    ) -> Result<u64, StoreError> {
        each!(self, s => s.put_results(batch, rs, missed))
    }

    pub fn pending(
        &self,
        batch: &str,
        file: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<ItemLine>, StoreError> {
        each!(self, s => s.pending(batch, file, from, limit))
    }

    pub fn finalize(&self, id: &str, to: BatchStatus, at: i64) -> Result<bool, StoreError> {
        each!(self, s => s.finalize(id, to, at))
    }
}

/// An upload in progress, on either store.
pub enum Upload<'a> {
    Sqlite(SqliteUpload<'a>),
    Postgres(PgUpload<'a>),
}

impl Upload<'_> {
    /// Adds request `index` (line `number` of the file). `Ok(Some((n,
    /// id)))`: line `n` repeats an earlier `custom_id`.
    pub fn line(
        &mut self,
        index: u64,
        number: u64,
        custom_id: &str,
        text: &str,
    ) -> Result<Option<(u64, String)>, StoreError> {
        match self {
            Upload::Sqlite(u) => u.line(index, number, custom_id, text),
            Upload::Postgres(u) => u.line(index, number, custom_id, text),
        }
    }

    /// The request index that first used `custom_id`.
    pub fn first_use(&self, custom_id: &str) -> Result<Option<u64>, StoreError> {
        match self {
            Upload::Sqlite(u) => u.first_use(custom_id),
            Upload::Postgres(u) => u.pg.first_use(&u.file, custom_id),
        }
    }

    /// Writes what is buffered and the file's row.
    pub fn commit(&mut self, f: &FileRow) -> Result<Option<(u64, String)>, StoreError> {
        match self {
            Upload::Sqlite(u) => u.commit(f),
            Upload::Postgres(u) => u.commit(f),
        }
    }
}

/// An upload to PostgreSQL: as SQLite's, lines written a page per short
/// transaction under a file id no file row names yet; the row last.
pub struct PgUpload<'a> {
    pg: &'a Pg,
    file: String,
    pending: Vec<(u64, u64, String, String)>,
    pending_bytes: usize,
    done: bool,
}

const UPLOAD_PAGE_LINES: usize = 2000;
const UPLOAD_PAGE_BYTES: usize = 8 * 1024 * 1024;

impl PgUpload<'_> {
    fn line(
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

    fn flush(&mut self) -> Result<Option<(u64, String)>, StoreError> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let dup = self.pg.write_lines(&self.file, &self.pending)?;
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(dup)
    }

    fn commit(&mut self, f: &FileRow) -> Result<Option<(u64, String)>, StoreError> {
        if let Some(dup) = self.flush()? {
            return Ok(Some(dup));
        }
        self.pg.insert_file(f)?;
        self.done = true;
        Ok(None)
    }
}

impl Drop for PgUpload<'_> {
    /// An upload not committed leaves nothing (best effort: lines of an
    /// upload no file row names are never read).
    fn drop(&mut self) {
        if !self.done {
            let _ = self.pg.drop_lines(&self.file);
        }
    }
}
