//! `kiln serve` and `kiln hash-key`

use super::*;
use crate::server::config::LogFormat;
use crate::server::{self, config::ServerConfig, Policy, ServeOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy (file or directory).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Server config (keys, backends per pool, log). Without one, every pool
    /// runs on the embedded simulator and the policy's API keys apply.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on (overrides the config's `listen`).
    #[arg(long)]
    pub listen: Option<String>,
    /// Simulated GPUs run this many times faster than real time
    /// (overrides the config's `sim.speed`).
    #[arg(long)]
    pub sim_speed: Option<f64>,
    /// Write the decision log here (overrides the config's `[log] path`).
    #[arg(long)]
    pub log: Option<PathBuf>,
    /// Run every pool the config does not bind on this backend: `sim` (the
    /// default) or `cuda` (this machine's GPUs; needs `--features cuda`).
    #[arg(long, value_enum, default_value_t = PoolKind::Sim)]
    pub backend: PoolKind,
    /// The batch store: files, batches and results (overrides the config's
    /// `[batch] store`; default `.kiln/batches.db`).
    #[arg(long)]
    pub batch_store: Option<PathBuf>,
    /// How the gateway's own log lines on stderr are written: `text` (the
    /// default; coloured only when stderr is a terminal and NO_COLOR is
    /// unset) or `json`, one object a line (overrides `[log] format`).
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormatArg>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormatArg {
    Text,
    Json,
}

/// Colour in text logs: only on a terminal, and never with `NO_COLOR` set
/// (<https://no-color.org>: any non-empty value).
fn log_colour() -> bool {
    use std::io::IsTerminal;
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stderr().is_terminal()
}

/// Installs the log subscriber: `RUST_LOG` (default `kiln=info`), on
/// stderr, as text or JSON lines. Request-scoped lines carry the
/// `request` span's fields (request id, trace id).
fn init_logging(format: LogFormat) {
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("kiln=info"))
    };
    let _ = match format {
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init(),
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_ansi(log_colour())
            .try_init(),
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolKind {
    Sim,
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct HashKeyArgs {
    /// The API key or admin token to hash (reads stdin when absent).
    pub key: Option<String>,
}

pub fn hash_key(a: HashKeyArgs) -> i32 {
    let key = match a.key {
        Some(k) => k,
        None => {
            let mut s = String::new();
            if std::io::stdin().read_line(&mut s).is_err() {
                return usage_error("cannot read the key from stdin");
            }
            s.trim_end_matches(['\r', '\n']).to_string()
        }
    };
    println!("{}", server::config::hash_secret(&key));
    EXIT_OK
}

pub fn run(a: Args) -> i32 {
    let mut config = match &a.config {
        Some(p) => match ServerConfig::load(p) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{:?}", miette::Report::new(e));
                return EXIT_USAGE;
            }
        },
        None => ServerConfig::default_embedded(),
    };
    let log_format = match a.log_format {
        Some(LogFormatArg::Json) => LogFormat::Json,
        Some(LogFormatArg::Text) => LogFormat::Text,
        None => config.log_format.unwrap_or(LogFormat::Text),
    };
    init_logging(log_format);
    let json = log_format == LogFormat::Json;
    // The banner: for people on a terminal, one log line each in JSON.
    let say = move |line: String| {
        if json {
            tracing::info!("{}", line.trim_start());
        } else {
            eprintln!("{line}");
        }
    };
    let (c, g) = match compile_one(&a.policy) {
        Ok(x) => x,
        Err(code) => return code,
    };
    if let Some(s) = a.sim_speed {
        if !(s.is_finite() && s > 0.0) {
            return usage_error("--sim-speed must be a positive number");
        }
        config.sim.speed = s;
    }
    if let Some(p) = a.log {
        let mut l = config
            .log
            .take()
            .unwrap_or_else(|| server::config::LogSection::at(p.clone()));
        l.path = p;
        config.log = Some(l);
    }
    if let Some(p) = a.batch_store {
        config.batch.store = Some(p);
    }
    // Batches outlive the process: on disk by default, beside where the
    // gateway runs, as `.git` is.
    if config.batch.store.is_none() {
        config.batch.store = Some(PathBuf::from(".kiln/batches.db"));
    }
    // One gateway per embedded store: a second `kiln serve` in the same
    // directory would otherwise share `.kiln/batches.db` silently, each
    // running (and double-running) the other's batches.
    let _store_held = match config.batch.store.as_deref() {
        Some(p) if !crate::batch::store::is_url(&p.to_string_lossy()) => match hold_store(p) {
            Ok(f) => f,
            Err(e) => return startup_error(json, e),
        },
        _ => None,
    };
    let listen = a
        .listen
        .clone()
        .or_else(|| config.listen.clone())
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    if a.backend == PoolKind::Cuda {
        for p in &g.pools {
            config
                .pools
                .entry(p.name.clone())
                .or_insert(server::config::PoolBackend::Cuda { scale: None });
        }
    }
    let policy = Policy::new(g, c.sources);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return usage_error(&format!("cannot start the async runtime: {e}")),
    };
    rt.block_on(async move {
        let version = policy.version.clone();
        let models: Vec<String> = policy.graph.models.iter().map(|m| m.name.clone()).collect();
        let mut running = match server::start(ServeOptions {
            policy,
            config,
            listen,
            clock: None,
        })
        .await
        {
            Ok(r) => r,
            Err(e) => return startup_error(json, e),
        };
        let addr = running.addr;
        say(format!(
            "kiln gateway listening on http://{addr} (policy {version})"
        ));
        say(format!("  models: {}", models.join(", ")));
        say(format!(
            "  OpenAI base URL: http://{addr}/v1   explain: /admin/explain/ID   metrics: /metrics"
        ));
        if let Some(p) = running.app.batches.store.location() {
            say(format!("  batches: /v1/files, /v1/batches; stored in {p}"));
        }
        if !running.app.admin_open && !running.app.config.has_admin_tokens() {
            say("  admin endpoints are closed: no [admin] tokens and not on loopback".into());
        }
        shutdown_signal().await;
        say("shutting down: finishing in-flight requests".into());
        running.trigger_shutdown();
        running.wait().await;
        EXIT_OK
    })
}

/// Reports why the gateway cannot start (one JSON log line with its code
/// and help, or miette's report on a terminal) and gives the exit code.
fn startup_error<E: miette::Diagnostic + Send + Sync + 'static>(json: bool, e: E) -> i32 {
    if json {
        tracing::error!(code = ?e.code().map(|c| c.to_string()), help = ?e.help().map(|h| h.to_string()), "{e}");
    } else {
        eprintln!("{:?}", miette::Report::new(e));
    }
    EXIT_USAGE
}

/// Why `kiln serve` could not take its batch store for itself.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StoreLockError {
    #[error("the batch store {path} is in use by another kiln gateway{holder}")]
    #[diagnostic(
        code(kiln::serve::store_in_use),
        help("give each gateway on this machine its own store (`--batch-store PATH` or `[batch] store` in kiln.toml); to share batches between gateways, point every one at one PostgreSQL: `[batch] store = \"postgres://...\"`")
    )]
    InUse { path: String, holder: String },
    #[error("cannot lock the batch store {path}: {message}")]
    #[diagnostic(
        code(kiln::serve::store_lock),
        help("the directory of the batch store must exist or be creatable, and be writable by this user")
    )]
    Io { path: String, message: String },
}

/// Takes `<store>.lock` for this process, with the operating system's
/// file lock: it is released when the process ends however it ends
/// (`kill -9` included), so a crashed gateway never leaves a stale lock.
/// The holder's process id is written in it for the next one's message.
/// `None` where the file system has no locks (the store is then not
/// guarded, as before).
fn hold_store(store: &Path) -> Result<Option<std::fs::File>, StoreLockError> {
    use std::io::{Read, Seek, Write};
    let mut name = store.as_os_str().to_owned();
    name.push(".lock");
    let lock = PathBuf::from(name);
    let io = |e: std::io::Error| StoreLockError::Io {
        path: store.display().to_string(),
        message: e.to_string(),
    };
    if let Some(dir) = lock.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock)
        .map_err(io)?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            let pid = pid.trim();
            let holder =
                if !pid.is_empty() && pid.len() <= 20 && pid.bytes().all(|b| b.is_ascii_digit()) {
                    format!(" (process {pid})")
                } else {
                    String::new()
                };
            return Err(StoreLockError::InUse {
                path: store.display().to_string(),
                holder,
            });
        }
        Err(std::fs::TryLockError::Error(e)) if e.kind() == std::io::ErrorKind::Unsupported => {
            tracing::warn!(path = %lock.display(), "the file system has no file locks: a second gateway on this batch store would not be refused");
            return Ok(None);
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    // Best effort: the lock, not this text, is what guards the store.
    let _ = f.set_len(0);
    let _ = f.rewind();
    let _ = write!(f, "{}", std::process::id());
    let _ = f.flush();
    Ok(Some(f))
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
