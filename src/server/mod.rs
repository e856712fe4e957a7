//! The gateway: `kiln serve`. An OpenAI-compatible HTTP front (axum) that
//! classifies, admits, queues and dispatches each request through the same
//! pure scheduler core the simulator runs, onto simulated or HTTP backends,
//! and records, measures and explains every decision.
//!
//! Request path: [`routes`] parses and authenticates, counts prompt tokens,
//! and submits to the [`executor`] task, which owns the scheduler; progress
//! comes back per request over a channel. [`admin`] serves explain, queues,
//! metrics, health and the atomic policy swap.

pub mod admin;
pub mod config;
pub mod cuda;
pub mod decision_log;
pub mod executor;
pub mod explain;
pub mod governance;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod upstream;

use crate::backend::sim::{Calibration, CostModel};
use crate::graph::DecisionGraph;
use crate::sched::plan::{Plan, ReplicaSpec, StepCost};
use crate::sched::{Config as SchedConfig, Scheduler};
use crate::source::SourceMap;
use arc_swap::ArcSwap;
use config::{PoolBackend, ServerConfig};
use executor::{Backend, ExecHandle, Executor};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// One compiled policy version.
pub struct Policy {
    pub graph: Arc<DecisionGraph>,
    /// `sha256:` and the first 12 hex digits of the sources' hash.
    pub version: Arc<str>,
    pub sources: SourceMap,
}

impl Policy {
    pub fn new(graph: DecisionGraph, sources: SourceMap) -> Policy {
        Policy {
            version: version_of(&sources).into(),
            graph: Arc::new(graph),
            sources,
        }
    }
}

/// The version names the exact text: file names and contents, in order.
pub fn version_of(sources: &SourceMap) -> String {
    let d = crate::governance::policy_hash(sources);
    format!("sha256:{}", d.get(..12).unwrap_or(&d))
}

/// Shared state of a running gateway.
pub struct App {
    pub exec: ExecHandle,
    pub policy: ArcSwap<Policy>,
    pub config: ServerConfig,
    pub tokenizer: openai::Tokenizer,
    pub metrics: metrics::Metrics,
    pub log: decision_log::DecisionLog,
    pub explain: explain::ExplainStore,
    pub next_id: AtomicU64,
    pub backends: Arc<Vec<Backend>>,
    pub calibration: Option<Calibration>,
    /// Admin endpoints without a token (no tokens configured, loopback).
    pub admin_open: bool,
    pub swap_lock: tokio::sync::Mutex<()>,
    pub speed: f64,
    /// Epoch milliseconds at start (request ids are unique per start).
    pub boot_ms: u64,
    /// Recently active versions, for explaining requests they decided.
    pub versions: std::sync::Mutex<std::collections::VecDeque<Arc<Policy>>>,
    /// Proposals, approvals, rollouts, overrides and the audit log.
    pub gov: governance::Gov,
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

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ServeError {
    #[error("the server config does not fit the policy: {0}")]
    #[diagnostic(
        code(kiln::serve::config),
        help("pool, model and variant names in kiln.toml must be the policy's; `kiln check` lists them")
    )]
    Mismatch(String),
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
    /// The audit log or the governance state could not be loaded; its own
    /// diagnostic (with its help line) says what to do.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Governance(governance::GovError),
}

/// The backend table: index 0 is the simulator, then one entry per
/// configured upstream, in config order (`ReplicaSpec::tag` indexes it).
pub fn backends(cfg: &ServerConfig) -> Result<Vec<Backend>, ServeError> {
    let mut out = vec![Backend::Sim];
    for (pool, b) in &cfg.pools {
        if let PoolBackend::Http { upstreams } = b {
            for (i, u) in upstreams.iter().enumerate() {
                let name = format!("{pool}/{}.{}#{i}", u.model, u.variant);
                let up = upstream::Upstream::new(name, u.upstream.clone())
                    .map_err(|e| ServeError::Startup(e.to_string()))?;
                out.push(Backend::Http(Arc::new(up)));
            }
        }
    }
    Ok(out)
}

/// A step cost for upstream replicas the roofline model cannot size: used
/// only for wait estimates, since the upstream owns its batches.
#[derive(Debug)]
struct FlatCost;

impl StepCost for FlatCost {
    fn step_time(&self, prefill_tokens: u32, decode_seqs: u32, _context: u64) -> f64 {
        0.005 + f64::from(prefill_tokens) * 0.0002 + f64::from(decode_seqs.min(1)) * 0.02
    }
}

/// The deployment for a policy under this config: simulated replicas for
/// pools on the simulator, one external replica per configured upstream.
pub fn build_plan(
    g: &DecisionGraph,
    cfg: &ServerConfig,
    calibration: Option<&Calibration>,
) -> Result<(Plan, Vec<String>), ServeError> {
    for name in cfg.pools.keys() {
        if g.pool_id(name).is_none() {
            return Err(ServeError::Mismatch(format!(
                "kiln.toml configures pool `{name}`, which the policy does not declare"
            )));
        }
    }
    let http_pool = |p: crate::graph::PoolId| {
        g.pools
            .get(p as usize)
            .and_then(|pool| cfg.pools.get(&pool.name))
            .is_some_and(|b| matches!(b, PoolBackend::Http { .. }))
    };
    // Pools served over HTTP need no GPU kind kiln knows (a llama.cpp CPU
    // server, say): where the cost model cannot size them, their replicas
    // estimate waits with FlatCost.
    let cost = CostModel::from_graph_sizing(g, calibration, http_pool)
        .map_err(|e| ServeError::Sim(e.to_string()))?;
    let mut plan = Plan::from_graph(g, |m, v, p| {
        if http_pool(p) {
            return None;
        }
        let r = cost.replica(m, v, p)?;
        let kv = r.kv_capacity_tokens().ok()?;
        Some(crate::sched::plan::Costing {
            cost: Arc::new(r.clone()),
            kv_capacity: kv,
        })
    });
    // Variants left unplaced only because their pool is served over HTTP
    // are not a problem.
    plan.unplaced.retain(|(_, _, p, _)| !http_pool(*p));
    let mut tag = 1u32;
    for (pool_name, b) in &cfg.pools {
        let PoolBackend::Http { upstreams } = b else {
            continue;
        };
        let Some(pool) = g.pool_id(pool_name) else {
            continue;
        };
        for u in upstreams {
            let this = tag;
            tag += 1;
            let Some(m) = g.model_id(&u.model) else {
                return Err(ServeError::Mismatch(format!(
                    "pool `{pool_name}`: the policy has no model `{}`",
                    u.model
                )));
            };
            let model = &g.models[m as usize];
            let Some(v) = model.variants.iter().position(|v| v.name == u.variant) else {
                return Err(ServeError::Mismatch(format!(
                    "pool `{pool_name}`: model `{}` has no variant `{}`",
                    u.model, u.variant
                )));
            };
            let var = &model.variants[v];
            let step: Arc<dyn StepCost> = match cost.replica(m, v as u16, pool) {
                Some(r) => Arc::new(r.clone()),
                None => Arc::new(FlatCost),
            };
            plan.replicas.push(ReplicaSpec {
                pool,
                model: m,
                variant: v as u16,
                gpus: var.gpus_per_replica,
                // The upstream manages its own KV memory.
                kv_capacity: u64::MAX / 8,
                max_batch: u.upstream.concurrency.max(1),
                max_batch_tokens: var.max_batch_tokens,
                cost: step,
                only_tier: None,
                external: true,
                tag: this,
            });
        }
    }
    let notes = plan
        .unplaced
        .iter()
        .map(|(m, v, p, why)| {
            format!(
                "{} on {}: {why}",
                g.variant_name(*m, *v),
                g.pools
                    .get(*p as usize)
                    .map(|p| p.name.as_str())
                    .unwrap_or("?")
            )
        })
        .chain(cost.warnings.iter().cloned())
        .collect();
    Ok((plan, notes))
}

pub struct ServeOptions {
    pub policy: Policy,
    pub config: ServerConfig,
    pub listen: String,
}

/// A gateway bound to its address and running on the current runtime.
pub struct Running {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    executor: tokio::task::JoinHandle<()>,
    governance: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops accepting, lets in-flight requests end, flushes the log.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = self.server.await;
        self.governance.abort();
        self.app.log.flush().await;
        self.executor.abort();
    }

    /// Runs until the server ends (ctrl-c or SIGTERM, handled by the caller).
    pub async fn wait(self) {
        let _ = self.server.await;
        self.governance.abort();
        self.app.log.flush().await;
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
    } = opts;
    let calibration = match &config.sim.calibration {
        Some(p) => Some(Calibration::load(p).map_err(|e| ServeError::Sim(e.to_string()))?),
        None => None,
    };
    let (plan, notes) = build_plan(&policy.graph, &config, calibration.as_ref())?;
    for n in &notes {
        tracing::warn!("{n}");
    }
    if plan.replicas.is_empty() {
        return Err(ServeError::Sim(
            "no replica fits any pool: nothing could serve a request".into(),
        ));
    }
    let mut backends = backends(&config)?;
    let mut plan = plan;
    if !cuda::cuda_pools(&policy.graph, &config).is_empty() {
        let cost = CostModel::from_graph(&policy.graph, calibration.as_ref())
            .map_err(|e| ServeError::Sim(e.to_string()))?;
        cuda::attach(&policy.graph, &config, &cost, &mut plan, &mut backends)?;
    }
    let backends = Arc::new(backends);
    let mut sched_cfg = SchedConfig::default();
    let (minute, weekday) = wall_clock_minute();
    sched_cfg.start_minute_of_day = minute;
    sched_cfg.start_weekday = weekday;
    let sched = Scheduler::new(policy.graph.clone(), plan, sched_cfg);
    let speed = config.sim.speed;
    let exec = Executor::new(
        sched,
        policy.graph.clone(),
        policy.version.clone(),
        backends.clone(),
        speed,
    );
    let (exec_handle, exec_task) = exec.spawn();
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
    let gov = governance::Gov::new(&config, speed).map_err(ServeError::Governance)?;
    let metrics = metrics::Metrics::new();
    metrics.set_policy_version(&policy.version);
    for b in backends.iter() {
        if let Backend::Http(u) = b {
            u.spawn_health_checks();
        }
    }
    let policy = Arc::new(policy);
    let app = Arc::new(App {
        exec: exec_handle,
        policy: ArcSwap::new(policy.clone()),
        versions: std::sync::Mutex::new(std::collections::VecDeque::from([policy])),
        config,
        tokenizer,
        metrics,
        log,
        explain: explain::ExplainStore::new(10_000),
        next_id: AtomicU64::new(1),
        backends,
        calibration,
        admin_open,
        swap_lock: tokio::sync::Mutex::new(()),
        speed,
        boot_ms: unix_ms() as u64,
        gov,
    });
    let router = routes::router(app.clone())
        .merge(admin::router(app.clone()))
        .merge(governance::router(app.clone()));
    let driver = governance::spawn_driver(app.clone());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
            let _ = rx.await;
        });
        if let Err(e) = serve.await {
            tracing::error!("server error: {e}");
        }
    });
    Ok(Running {
        addr,
        app,
        shutdown: Some(tx),
        server,
        executor: exec_task,
        governance: driver,
    })
}

pub fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// UTC minute of day and weekday (0 = Monday) now, for time-of-day rules.
fn wall_clock_minute() -> (u32, u8) {
    let secs = (unix_ms() / 1000.0) as u64;
    let minute = ((secs / 60) % 1440) as u32;
    // 1970-01-01 was a Thursday (3 when Monday is 0).
    let weekday = ((secs / 86_400 + 3) % 7) as u8;
    (minute, weekday)
}
