//! The decision log: one line of recorded traffic ([`crate::traffic`],
//! format v1) for every decision the gateway takes, so that yesterday's log
//! is today's `kiln simulate --traffic` / `kiln diff --traffic` input.
//!
//! [`DecisionLog::write`] never blocks the request path: the record goes
//! into a bounded channel with `try_send`, and a line that does not fit is
//! counted as dropped ([`DecisionLog::dropped`]), never waited for. A
//! dedicated thread serialises the records into a buffered file, flushing
//! every [`FLUSH_LINES`] lines or [`FLUSH_EVERY`] after the oldest unflushed
//! one, whichever comes first, and whenever [`DecisionLog::flush`] asks,
//! and rotates the file by size: `path` → `path.1` → `path.2` … up to
//! `keep`, the oldest deleted. I/O errors are logged (`tracing::warn!`) and
//! counted, never fatal: the writer drops what it could not write and
//! reopens the file for the next line.
//!
//! The writer never writes an API key: `api_key` is blanked and secret
//! headers (`authorization`, `x-api-key`, …) removed whatever the caller
//! passes. So that a replay still attributes the request to its tenant, a
//! record whose tenant came from its key gets the decided tenant.

use crate::traffic::{self, Record};
use miette::Diagnostic;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::oneshot;

/// Lines the channel holds while the writer catches up. A record travels
/// boxed, so the channel itself stays small (a pointer a slot).
pub const CHANNEL_CAPACITY: usize = 16 * 1024;

/// Buffered lines reach the file (the operating system's page cache,
/// which survives the process) at most this long after they were written.
/// With [`FLUSH_LINES`] this bounds what a `kill -9` loses: the lines of the
/// last few milliseconds, never more than `FLUSH_LINES - 1` buffered lines
/// (plus any still in the channel, normally none). A flush is one `write`
/// system call, so even at thousands of requests a second this costs
/// little; it does not wait for the disk (only [`DecisionLog::flush`]
/// does), so a power loss may still lose more.
pub const FLUSH_EVERY: Duration = Duration::from_millis(10);

/// Buffered lines are flushed once this many wait, even within
/// [`FLUSH_EVERY`]: a burst (a batch's items ending together) is not held
/// in memory as a whole.
pub const FLUSH_LINES: u64 = 16;

/// Request headers that carry credentials: never written, whatever the
/// caller passes. The gateway records headers by allow-list already (what
/// the policy reads and `x-kiln-*`); this is the last line of defence.
const SECRET_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "set-cookie",
    "x-auth-token",
    "x-goog-api-key",
    "openai-api-key",
    "x-amz-security-token",
];

/// Whether a header name carries credentials: listed in
/// [`SECRET_HEADERS`], or named like one (`…-token`, `…-secret`,
/// `…-password`, `…-api-key`, `…credential…`).
pub fn secret_header(name: &str) -> bool {
    let n = lowercase(name);
    SECRET_HEADERS.contains(&n.as_ref())
        || ["-token", "-secret", "-password", "-api-key", "-apikey"]
            .iter()
            .any(|w| n.ends_with(w))
        || n.contains("credential")
}

/// A header name in lowercase, copied only when it is not already (names
/// that come over HTTP are): every record asks this of every header.
pub fn lowercase(name: &str) -> std::borrow::Cow<'_, str> {
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        name.to_ascii_lowercase().into()
    } else {
        name.into()
    }
}

/// Where and how much to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    /// The current file; appended to if it exists. Its directory must.
    pub path: PathBuf,
    /// Rotate when the current file would grow past this many bytes (a
    /// single longer line still goes into a fresh file). 0: never rotate.
    pub max_bytes: u64,
    /// Rotated files kept (`path.1` newest … `path.keep` oldest); 0 keeps
    /// none, so rotating starts the current file afresh.
    pub keep: usize,
}

/// Why the decision log could not be opened.
#[derive(Debug, Error, Diagnostic)]
pub enum LogError {
    #[error("decision log directory `{}` does not exist", dir.display())]
    #[diagnostic(
        code(kiln::log::missing_dir),
        help("create it (mkdir -p {}) or point the log's `path` at an existing directory", dir.display())
    )]
    MissingDir { dir: PathBuf },

    #[error("decision log path `{}` is a directory", path.display())]
    #[diagnostic(
        code(kiln::log::is_dir),
        help("set the log's `path` to a file inside it, e.g. {}", path.join("decisions.jsonl").display())
    )]
    IsDir { path: PathBuf },

    #[error("cannot open decision log `{}`: {source}", path.display())]
    #[diagnostic(
        code(kiln::log::open),
        help(
            "check that the gateway may create and append to this file, or change the log's `path`"
        )
    )]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot start the decision log writer: {source}")]
    #[diagnostic(
        code(kiln::log::spawn),
        help("the system refused a new thread; check the process's thread and memory limits")
    )]
    Spawn {
        #[source]
        source: io::Error,
    },
}

enum Msg {
    Record(Box<Record>),
    /// Write everything received so far to disk, then answer.
    Flush(oneshot::Sender<()>),
}

#[derive(Debug, Default)]
struct Counters {
    dropped: AtomicU64,
    write_errors: AtomicU64,
    written: AtomicU64,
}

/// The handle the gateway writes decisions to. Clones share one writer,
/// which ends (after writing what it has) when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    tx: Option<SyncSender<Msg>>,
    counters: Arc<Counters>,
}

impl DecisionLog {
    /// Opens (appending) or creates the log and starts its writer thread.
    pub fn open(cfg: LogConfig) -> Result<DecisionLog, LogError> {
        Self::start(cfg, CHANNEL_CAPACITY, None)
    }

    /// A log that writes nothing: [`DecisionLog::write`] is a no-op and
    /// [`DecisionLog::flush`] returns at once.
    pub fn disabled() -> DecisionLog {
        DecisionLog {
            tx: None,
            counters: Arc::default(),
        }
    }

    /// Whether lines are written anywhere.
    pub fn is_enabled(&self) -> bool {
        self.tx.is_some()
    }

    fn start(
        cfg: LogConfig,
        capacity: usize,
        gate: Option<Receiver<()>>,
    ) -> Result<DecisionLog, LogError> {
        let file = open_file(&cfg.path)?;
        let (tx, rx) = mpsc::sync_channel(capacity.max(1));
        let counters = Arc::new(Counters::default());
        let mut writer = Writer::new(cfg, file, Arc::clone(&counters));
        std::thread::Builder::new()
            .name("kiln-decision-log".into())
            .spawn(move || {
                if let Some(gate) = gate {
                    let _ = gate.recv();
                }
                writer.run(rx);
            })
            .map_err(|source| LogError::Spawn { source })?;
        Ok(DecisionLog {
            tx: Some(tx),
            counters,
        })
    }

    /// Queues one decision for writing; never blocks. When the writer is
    /// behind and the channel full, the line is dropped and counted.
    pub fn write(&self, rec: Record) {
        let Some(tx) = &self.tx else { return };
        match tx.try_send(Msg::Record(Box::new(rec))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Resolves when every line written before the call is in the file (or
    /// was dropped), flushed to the operating system.
    pub async fn flush(&self) {
        let Some(tx) = &self.tx else { return };
        let (ack, done) = oneshot::channel();
        match tx.try_send(Msg::Flush(ack)) {
            Ok(()) => {}
            Err(TrySendError::Disconnected(_)) => return,
            Err(TrySendError::Full(msg)) => {
                // Rare (the writer is far behind): wait for room on a
                // helper thread so as not to block the runtime.
                let tx = tx.clone();
                let spawned = std::thread::Builder::new()
                    .name("kiln-decision-log-flush".into())
                    .spawn(move || {
                        let _ = tx.send(msg);
                    });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "decision log: cannot wait for a flush");
                    return;
                }
            }
        }
        // An error means the writer is gone: nothing more will be written.
        let _ = done.await;
    }

    /// Lines lost: the channel was full, or writing them failed.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Failed file operations (write, flush, rotate, reopen).
    pub fn write_errors(&self) -> u64 {
        self.counters.write_errors.load(Ordering::Relaxed)
    }

    /// Lines flushed to the file so far.
    pub fn written(&self) -> u64 {
        self.counters.written.load(Ordering::Relaxed)
    }
}

/// Checks the directory, opens `path` for appending and makes sure a line
/// torn by an earlier crash is ended, so that the next record starts a line
/// of its own.
fn open_file(path: &Path) -> Result<File, LogError> {
    if path.is_dir() {
        return Err(LogError::IsDir {
            path: path.to_path_buf(),
        });
    }
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.is_dir() {
            return Err(LogError::MissingDir {
                dir: dir.to_path_buf(),
            });
        }
    }
    let open = |path: &Path| -> io::Result<File> {
        let mut opts = OpenOptions::new();
        opts.read(true).append(true).create(true);
        // Requests are private: owner only (rotation renames the file, so
        // rotated files keep this mode).
        #[cfg(unix)]
        {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            opts.mode(0o600);
            let mut f = opts.open(path)?;
            f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            end_torn_line(&mut f)?;
            Ok(f)
        }
        #[cfg(not(unix))]
        {
            let mut f = opts.open(path)?;
            end_torn_line(&mut f)?;
            Ok(f)
        }
    };
    open(path).map_err(|source| LogError::Open {
        path: path.to_path_buf(),
        source,
    })
}

fn end_torn_line(f: &mut File) -> io::Result<()> {
    {
        let len = f.metadata()?.len();
        if len > 0 {
            let mut last = [0u8; 1];
            f.seek(SeekFrom::Start(len - 1))?;
            f.read_exact(&mut last)?;
            if last[0] != b'\n' {
                f.write_all(b"\n")?;
            }
        }
        Ok(())
    }
}

/// `path.N`.
fn rotated(path: &Path, n: usize) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

/// The writer thread's state.
struct Writer {
    cfg: LogConfig,
    out: Option<BufWriter<File>>,
    /// Bytes in the current file, written or buffered.
    size: u64,
    /// Lines buffered since the last flush (lost if the flush fails).
    unflushed: u64,
    /// When the oldest unflushed line must reach the file.
    deadline: Option<Instant>,
    line: Vec<u8>,
    counters: Arc<Counters>,
    /// In an error streak: warn once, not once a line.
    failing: bool,
}

impl Writer {
    fn new(cfg: LogConfig, file: File, counters: Arc<Counters>) -> Writer {
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Writer {
            cfg,
            out: Some(BufWriter::with_capacity(64 * 1024, file)),
            size,
            unflushed: 0,
            deadline: None,
            line: Vec::with_capacity(1024),
            counters,
            failing: false,
        }
    }

    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            let msg = match self.deadline {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            match msg {
                Ok(Msg::Record(rec)) => {
                    self.record(*rec);
                    if self.unflushed >= FLUSH_LINES
                        || self.deadline.is_some_and(|d| Instant::now() >= d)
                    {
                        self.flush();
                    }
                }
                Ok(Msg::Flush(ack)) => {
                    self.flush();
                    self.sync();
                    let _ = ack.send(());
                }
                Err(RecvTimeoutError::Timeout) => self.flush(),
                Err(RecvTimeoutError::Disconnected) => {
                    self.flush();
                    return;
                }
            }
        }
    }

    fn record(&mut self, mut rec: Record) {
        scrub(&mut rec);
        self.line.clear();
        if let Err(e) = traffic::write_record(&mut self.line, &rec) {
            // Only a non-finite time gets here: a caller bug, not I/O.
            tracing::warn!(error = %e, id = rec.id.as_deref(), "decision log: record not written");
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let n = self.line.len() as u64;
        if self.cfg.max_bytes > 0 && self.size > 0 && self.size + n > self.cfg.max_bytes {
            self.rotate();
        }
        if self.out.is_none() {
            self.reopen();
        }
        let Some(out) = self.out.as_mut() else {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match out.write_all(&self.line) {
            Ok(()) => {
                self.size += n;
                self.unflushed += 1;
                if self.deadline.is_none() {
                    self.deadline = Some(Instant::now() + FLUSH_EVERY);
                }
            }
            Err(e) => {
                // BufWriter wrote out its buffer and part of this line at
                // most: drop the writer (and what it holds) and start
                // afresh on the next line.
                self.failed("write", &e);
                self.discard();
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Flushes the buffer to the file.
    fn flush(&mut self) {
        self.deadline = None;
        let Some(out) = self.out.as_mut() else { return };
        match out.flush() {
            Ok(()) => {
                self.counters
                    .written
                    .fetch_add(self.unflushed, Ordering::Relaxed);
                self.unflushed = 0;
                if self.failing {
                    self.failing = false;
                    tracing::info!(path = %self.cfg.path.display(), "decision log: writing again");
                }
            }
            Err(e) => {
                self.failed("flush", &e);
                self.discard();
            }
        }
    }

    /// Asks the operating system to put the file on disk (an explicit
    /// [`DecisionLog::flush`] only: the periodic flush does not wait for the
    /// disk).
    fn sync(&mut self) {
        if let Some(out) = self.out.as_ref() {
            if let Err(e) = out.get_ref().sync_data() {
                self.failed("sync", &e);
            }
        }
    }

    /// Forgets the open file and the lines still buffered for it (counted
    /// as dropped); the next record reopens the file.
    fn discard(&mut self) {
        if let Some(out) = self.out.take() {
            // `into_parts` hands back the file without flushing again.
            let (_file, _unwritten) = out.into_parts();
        }
        self.counters
            .dropped
            .fetch_add(self.unflushed, Ordering::Relaxed);
        self.unflushed = 0;
        self.deadline = None;
    }

    fn reopen(&mut self) {
        match open_file(&self.cfg.path) {
            Ok(f) => {
                self.size = f.metadata().map(|m| m.len()).unwrap_or(0);
                self.out = Some(BufWriter::with_capacity(64 * 1024, f));
            }
            Err(e) => {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                if !self.failing {
                    self.failing = true;
                    tracing::warn!(error = %e, "decision log: cannot reopen; dropping lines");
                }
            }
        }
    }

    /// `path` → `path.1` → … → `path.keep`; the oldest is deleted.
    fn rotate(&mut self) {
        self.flush();
        // Close the current file before renaming it.
        self.out = None;
        let path = self.cfg.path.clone();
        let keep = self.cfg.keep;
        let result = (|| -> io::Result<()> {
            // The oldest kept, and any left by an earlier, larger `keep`.
            let mut n = keep.max(1);
            loop {
                let p = rotated(&path, n);
                match std::fs::remove_file(&p) {
                    Ok(()) => n += 1,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        if n > keep {
                            break;
                        }
                        n += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
            if keep == 0 {
                return std::fs::remove_file(&path);
            }
            for i in (1..keep).rev() {
                match std::fs::rename(rotated(&path, i), rotated(&path, i + 1)) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            std::fs::rename(&path, rotated(&path, 1))
        })();
        self.reopen();
        if let Err(e) = result {
            self.failed("rotate", &e);
            // Keep appending to the old file, the budget started over,
            // rather than retrying on every line.
            self.size = 0;
        }
    }

    fn failed(&mut self, what: &str, e: &io::Error) {
        self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
        if !self.failing {
            self.failing = true;
            tracing::warn!(
                path = %self.cfg.path.display(),
                error = %e,
                "decision log: {what} failed; lines may be lost"
            );
        }
    }
}

/// Removes credentials from a record before it is written.
fn scrub(rec: &mut Record) {
    if rec.api_key.take().is_some() && rec.tenant.is_none() {
        // The key chose the tenant; a replay has no key, so it gets the
        // tenant by name instead.
        rec.tenant = rec.decision.as_ref().and_then(|d| d.tenant.clone());
    }
    if !rec.headers.is_empty() {
        rec.headers.retain(|k, _| !secret_header(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::Decision;
    use std::sync::atomic::AtomicUsize;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "kiln-decision-log-{name}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn log(&self) -> PathBuf {
            self.0.join("decisions.jsonl")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn cfg(path: PathBuf, max_bytes: u64, keep: usize) -> LogConfig {
        LogConfig {
            path,
            max_bytes,
            keep,
        }
    }

    fn rec(i: u32) -> Record {
        Record {
            at_ms: f64::from(i) * 10.5,
            id: Some(format!("req-{i}")),
            tenant: Some("support-bot".into()),
            model: "llama-70b".into(),
            prompt_tokens: 100 + u64::from(i),
            max_tokens: 256,
            output_tokens: 200,
            policy_version: Some("3f2a9c1".into()),
            decision: Some(Decision {
                tier: Some("interactive".into()),
                tenant: Some("support-bot".into()),
                route: Some("llama-70b.fp16 on h100".into()),
                substituted_for: None,
                admission: Some("queue".into()),
                status: Some(200),
                fallback_step: None,
                reason: None,
                waited_for: Some("saturation".into()),
                cache: None,
                replica: Some(0),
            }),
            queue_ms: Some(12.25),
            ttft_ms: Some(180.5),
            e2e_ms: Some(2400.0),
            ..Record::default()
        }
    }

    fn lines(path: &Path) -> usize {
        std::fs::read_to_string(path)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn lines_round_trip_as_replay_input() {
        let dir = TempDir::new("roundtrip");
        let log = DecisionLog::open(cfg(dir.log(), 0, 3)).unwrap();
        let mut want: Vec<Record> = (0..5).map(rec).collect();
        let mut rejected = rec(5);
        rejected.decision = Some(Decision {
            tier: Some("batch".into()),
            admission: Some("reject".into()),
            status: Some(429),
            reason: Some("quota".into()),
            ..Decision::default()
        });
        rejected.ttft_ms = None;
        rejected.e2e_ms = None;
        want.push(rejected);
        for r in &want {
            log.write(r.clone());
        }
        log.flush().await;
        assert_eq!(traffic::read(dir.log()).unwrap(), want);
        assert_eq!(log.written(), 6);
        drop(log);

        // Reopening appends.
        let log = DecisionLog::open(cfg(dir.log(), 0, 3)).unwrap();
        log.write(rec(6));
        log.flush().await;
        want.push(rec(6));
        assert_eq!(traffic::read(dir.log()).unwrap(), want);
        assert_eq!(log.dropped(), 0);
        assert_eq!(log.write_errors(), 0);
    }

    #[tokio::test]
    async fn rotates_at_the_size_limit_and_keeps_only_keep_files() {
        let dir = TempDir::new("rotate");
        let line = {
            let mut v = Vec::new();
            traffic::write_record(&mut v, &rec(10)).unwrap();
            v.len() as u64
        };
        // Three lines a file: the lines of rec(10..40) differ by 2 bytes at
        // most, so four never fit.
        let max = 3 * line + line / 2;
        let log = DecisionLog::open(cfg(dir.log(), max, 2)).unwrap();
        for i in 10..30 {
            log.write(rec(i));
        }
        log.flush().await;
        let path = dir.log();
        let (cur, r1, r2) = (path.clone(), rotated(&path, 1), rotated(&path, 2));
        assert!(!rotated(&path, 3).exists(), "only `keep` rotated files");
        for p in [&cur, &r1, &r2] {
            let len = std::fs::metadata(p).unwrap().len();
            assert!(len <= max, "{} is {len} bytes", p.display());
        }
        // 20 lines: files of 3, the current one has the last 2; the two
        // rotated ones the 6 before; the oldest 12 are gone.
        assert_eq!((lines(&r2), lines(&r1), lines(&cur)), (3, 3, 2));
        let ids: Vec<String> = [&r2, &r1, &cur]
            .into_iter()
            .flat_map(|p| traffic::read(p).unwrap())
            .map(|r| r.id.unwrap())
            .collect();
        let want: Vec<String> = (22..30).map(|i| format!("req-{i}")).collect();
        assert_eq!(ids, want);

        // A larger `keep` left behind by an earlier run is cleaned up too.
        drop(log);
        std::fs::write(rotated(&path, 3), "{}\n").unwrap();
        let log = DecisionLog::open(cfg(dir.log(), max, 2)).unwrap();
        for i in 30..32 {
            log.write(rec(i));
        }
        log.flush().await;
        assert!(!rotated(&path, 3).exists());
        assert_eq!(lines(&path), 1);
        assert_eq!(log.dropped(), 0);
    }

    #[tokio::test]
    async fn keep_zero_starts_the_file_afresh() {
        let dir = TempDir::new("keep0");
        let log = DecisionLog::open(cfg(dir.log(), 1, 0)).unwrap();
        for i in 0..3 {
            log.write(rec(i));
        }
        log.flush().await;
        // Every line is longer than the limit: each goes alone into a
        // fresh file.
        let got = traffic::read(dir.log()).unwrap();
        assert_eq!(got, vec![rec(2)]);
        assert!(!rotated(&dir.log(), 1).exists());
    }

    #[tokio::test]
    async fn flush_makes_lines_visible_and_the_timer_does_too() {
        let dir = TempDir::new("flush");
        let log = DecisionLog::open(cfg(dir.log(), 0, 1)).unwrap();
        log.write(rec(1));
        log.flush().await;
        assert_eq!(lines(&dir.log()), 1);

        // Without a flush the line shows up within the flush interval.
        log.write(rec(2));
        let start = Instant::now();
        while lines(&dir.log()) < 2 {
            assert!(start.elapsed() < Duration::from_secs(5), "never flushed");
            std::thread::sleep(Duration::from_millis(20));
        }
        // And when the last handle goes, what is buffered is written.
        log.write(rec(3));
        let clone = log.clone();
        drop(log);
        clone.write(rec(4));
        drop(clone);
        let start = Instant::now();
        while lines(&dir.log()) < 4 {
            assert!(start.elapsed() < Duration::from_secs(5), "lost on close");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[tokio::test]
    async fn api_keys_and_secret_headers_are_never_written() {
        let dir = TempDir::new("secret");
        let log = DecisionLog::open(cfg(dir.log(), 0, 1)).unwrap();
        let mut r = rec(1);
        r.tenant = None;
        r.api_key = Some("sk-live-SECRET-123".into());
        for (k, v) in [
            ("Authorization", "Bearer sk-live-SECRET-123"),
            ("x-api-key", "sk-live-SECRET-123"),
            ("Cookie", "session=sk-live-SECRET-123"),
            ("x-kiln-tier", "interactive"),
        ] {
            r.headers.insert(k.into(), v.into());
        }
        log.write(r);
        // A key with an explicit tenant keeps that tenant.
        let mut r = rec(2);
        r.tenant = Some("explicit".into());
        r.api_key = Some("sk-live-SECRET-456".into());
        log.write(r);
        log.flush().await;
        let text = std::fs::read_to_string(dir.log()).unwrap();
        assert!(!text.contains("SECRET"), "{text}");
        assert!(!text.contains("api_key"));
        let got = traffic::read(dir.log()).unwrap();
        assert_eq!(got[0].api_key, None);
        // The key picked the tenant; the replay gets it by name.
        assert_eq!(got[0].tenant.as_deref(), Some("support-bot"));
        assert_eq!(got[0].headers.keys().collect::<Vec<_>>(), ["x-kiln-tier"]);
        assert_eq!(got[1].tenant.as_deref(), Some("explicit"));
        assert_eq!(got[1].api_key, None);
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn the_log_and_its_rotated_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("mode");
        // An existing world-readable file is made private on open.
        std::fs::write(dir.log(), "").unwrap();
        std::fs::set_permissions(dir.log(), std::fs::Permissions::from_mode(0o644)).unwrap();
        let log = DecisionLog::open(cfg(dir.log(), 300, 3)).unwrap();
        for i in 0..10 {
            log.write(rec(i));
        }
        log.flush().await;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.log()), 0o600);
        assert!(rotated(&dir.log(), 1).exists(), "the test must rotate");
        for n in 1..=3 {
            let p = rotated(&dir.log(), n);
            if p.exists() {
                assert_eq!(mode(&p), 0o600, "{}", p.display());
            }
        }
    }

    #[test]
    fn provider_credentials_are_secret_headers() {
        for h in [
            "x-auth-token",
            "X-Goog-Api-Key",
            "openai-api-key",
            "x-amz-security-token",
            "x-my-secret",
            "authorization",
        ] {
            assert!(secret_header(h), "{h}");
        }
        for h in ["x-kiln-tier", "x-tier", "x-max-tokens"] {
            assert!(!secret_header(h), "{h}");
        }
    }

    #[tokio::test]
    async fn a_full_channel_drops_and_counts_never_blocks() {
        let dir = TempDir::new("dropped");
        let (open, gate) = mpsc::channel();
        let log = DecisionLog::start(cfg(dir.log(), 0, 1), 2, Some(gate)).unwrap();
        let start = Instant::now();
        for i in 0..5 {
            log.write(rec(i));
        }
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(log.dropped(), 3);

        // A flush while full waits for room without blocking the caller's
        // runtime, and completes once the writer runs.
        let flusher = {
            let log = log.clone();
            tokio::spawn(async move { log.flush().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!flusher.is_finished());
        open.send(()).unwrap();
        flusher.await.unwrap();
        let got = traffic::read(dir.log()).unwrap();
        assert_eq!(got, vec![rec(0), rec(1)]);
        assert_eq!(log.dropped(), 3);
    }

    #[tokio::test]
    async fn a_record_that_cannot_be_written_is_dropped_not_a_panic() {
        let dir = TempDir::new("nonfinite");
        let log = DecisionLog::open(cfg(dir.log(), 0, 1)).unwrap();
        let mut r = rec(1);
        r.ttft_ms = Some(f64::NAN);
        log.write(r);
        log.write(rec(2));
        log.flush().await;
        assert_eq!(log.dropped(), 1);
        assert_eq!(traffic::read(dir.log()).unwrap(), vec![rec(2)]);
    }

    #[tokio::test]
    async fn a_torn_last_line_is_ended_before_appending() {
        let dir = TempDir::new("torn");
        std::fs::write(dir.log(), "{\"v\":1,\"at_ms\":1,\"mod").unwrap();
        let log = DecisionLog::open(cfg(dir.log(), 0, 1)).unwrap();
        log.write(rec(1));
        log.flush().await;
        let loaded = traffic::read_with(
            dir.log(),
            traffic::ReadOptions {
                skip_malformed: true,
            },
        )
        .unwrap();
        assert_eq!(loaded.records, vec![rec(1)]);
        assert_eq!(loaded.skipped, vec![1]);
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn write_errors_are_counted_not_fatal() {
        let full = Path::new("/dev/full");
        if !full.exists() {
            return;
        }
        let log = DecisionLog::open(cfg(full.to_path_buf(), 0, 1)).unwrap();
        log.write(rec(1));
        log.flush().await;
        log.write(rec(2));
        log.flush().await;
        assert_eq!(log.dropped(), 2);
        assert!(log.write_errors() >= 2, "{}", log.write_errors());
        assert_eq!(log.written(), 0);
    }

    #[tokio::test]
    async fn disabled_writes_nothing() {
        let log = DecisionLog::disabled();
        assert!(!log.is_enabled());
        log.write(rec(1));
        log.flush().await;
        assert_eq!((log.dropped(), log.written()), (0, 0));
    }

    #[test]
    fn a_missing_directory_is_a_helpful_error() {
        let dir = TempDir::new("missing");
        let missing = dir.0.join("nope").join("decisions.jsonl");
        let e = DecisionLog::open(cfg(missing, 0, 1)).unwrap_err();
        assert!(matches!(e, LogError::MissingDir { .. }));
        assert!(e.to_string().contains("does not exist"), "{e}");
        let help = e.help().unwrap().to_string();
        assert!(help.contains("mkdir -p"), "{help}");
        assert!(!dir.0.join("nope").exists(), "no directory is created");

        let e = DecisionLog::open(cfg(dir.0.clone(), 0, 1)).unwrap_err();
        assert!(matches!(e, LogError::IsDir { .. }), "{e}");
        assert!(e.help().unwrap().to_string().contains("decisions.jsonl"));
    }
}
