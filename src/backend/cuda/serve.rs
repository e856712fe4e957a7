//! Pools on this machine's GPUs (`[pools.X] backend = "cuda"`, cargo
//! feature `cuda`). The scheduler plans and batches exactly as for the
//! simulator; each step it starts on such a replica runs on the device as a
//! transformer-shaped workload ([`crate::backend::cuda`]), and the step ends
//! when the GPU says so, so batch-size effects and KV memory are real.
//!
//! At startup each planned replica on a CUDA pool gets its own
//! `CudaReplica` (weights and KV arena allocated on its device); a pool
//! declaring more GPUs or memory than the devices have is refused. A policy
//! swap reuses the replicas it has and cannot add new ones (that would
//! allocate GPU memory while serving): restart to grow a CUDA pool.

use crate::backend::deploy::{DeployError, PoolBackend, PoolBackends};
use crate::backend::Backend;
use crate::graph::DecisionGraph;
use crate::sched::plan::Plan;

/// Pools the config runs on CUDA, in the policy's order.
pub fn cuda_pools(g: &DecisionGraph, pools: &PoolBackends) -> Vec<crate::graph::PoolId> {
    g.pools
        .iter()
        .enumerate()
        .filter(|(_, p)| matches!(pools.get(&p.name), Some(PoolBackend::Cuda { .. })))
        .map(|(i, _)| i as crate::graph::PoolId)
        .collect()
}

fn key(g: &DecisionGraph, pool: u16, model: u16, variant: u16) -> (String, String) {
    let pool = g
        .pools
        .get(pool as usize)
        .map(|p| p.name.clone())
        .unwrap_or_default();
    (pool, g.variant_name(model, variant))
}

#[cfg(feature = "cuda")]
mod real {
    use super::*;
    use crate::backend::cost::CostModel;
    use crate::backend::cuda::device;
    use crate::backend::cuda::{self, CudaReplica};
    use std::sync::{Arc, Mutex};

    /// One replica on one device.
    pub struct CudaSlot {
        pub name: String,
        /// (pool, `model.variant`): what a swap may reuse it for.
        pub key: (String, String),
        pub replica: Mutex<CudaReplica>,
    }

    /// Allocates a [`CudaReplica`] for every planned replica on a CUDA pool,
    /// appends them to the backend table and points the plan at them.
    pub fn attach(
        g: &DecisionGraph,
        pools_cfg: &PoolBackends,
        cost: &CostModel,
        plan: &mut Plan,
        backends: &mut Vec<Backend>,
    ) -> Result<(), DeployError> {
        let pools = cuda_pools(g, pools_cfg);
        if pools.is_empty() {
            return Ok(());
        }
        let devices = cuda::devices().map_err(|e| DeployError::Startup(e.to_string()))?;
        let decl: Vec<&crate::graph::Pool> = pools
            .iter()
            .filter_map(|&p| g.pools.get(p as usize))
            .collect();
        let ranges = device::assign_pools(&decl, &devices)
            .map_err(|e| DeployError::Startup(e.to_string()))?;
        for (k, &pool) in pools.iter().enumerate() {
            let Some(range) = ranges.get(k).cloned() else {
                continue;
            };
            let scale = match g
                .pools
                .get(pool as usize)
                .and_then(|p| pools_cfg.get(&p.name))
            {
                Some(PoolBackend::Cuda { scale }) => *scale,
                _ => None,
            };
            let mut next = range.start;
            for spec in plan.replicas.iter_mut().filter(|s| s.pool == pool) {
                // A gang of N GPUs is measured as one shard on its first GPU.
                let dev = next;
                next += spec.gpus.max(1) as usize;
                if dev >= range.end {
                    return Err(DeployError::Startup(format!(
                        "pool `{}` has more replicas than devices",
                        key(g, pool, spec.model, spec.variant).0
                    )));
                }
                let Some(model) = cost.replica(spec.model, spec.variant, pool) else {
                    return Err(DeployError::Sim(format!(
                        "no cost model for {}",
                        key(g, pool, spec.model, spec.variant).1
                    )));
                };
                let rep = CudaReplica::for_variant(model, dev, scale)
                    .map_err(|e| DeployError::Startup(e.to_string()))?;
                spec.kv_capacity = spec.kv_capacity.min(rep.kv_capacity_tokens());
                let k = key(g, pool, spec.model, spec.variant);
                spec.tag = backends.len() as u32;
                backends.push(Backend::Cuda(Arc::new(CudaSlot {
                    name: format!("{}/{}@gpu{dev}", k.0, k.1),
                    key: k,
                    replica: Mutex::new(rep),
                })));
            }
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
pub use real::{attach, CudaSlot};

/// Without the feature a CUDA pool cannot start.
#[cfg(not(feature = "cuda"))]
pub fn attach(
    g: &DecisionGraph,
    pools_cfg: &PoolBackends,
    _cost: &crate::backend::cost::CostModel,
    _plan: &mut Plan,
    _backends: &mut Vec<Backend>,
) -> Result<(), DeployError> {
    match cuda_pools(g, pools_cfg).first() {
        None => Ok(()),
        Some(&p) => Err(DeployError::Startup(format!(
            "pool `{}` uses backend \"cuda\", but this kiln was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`, or use the sim or http backend",
            g.pools.get(p as usize).map(|p| p.name.as_str()).unwrap_or("?")
        ))),
    }
}

/// Points a new plan's CUDA-pool replicas at the CUDA replicas allocated
/// at startup, by pool and variant; a plan needing more is refused.
pub fn retag(
    g: &DecisionGraph,
    pools_cfg: &PoolBackends,
    plan: &mut Plan,
    backends: &[Backend],
) -> Result<(), DeployError> {
    let pools = cuda_pools(g, pools_cfg);
    if pools.is_empty() {
        return Ok(());
    }
    let mut used = vec![false; backends.len()];
    for spec in plan.replicas.iter_mut().filter(|s| pools.contains(&s.pool)) {
        let want = key(g, spec.pool, spec.model, spec.variant);
        let found = backends
            .iter()
            .enumerate()
            .find(|(i, b)| !used[*i] && matches!(b, Backend::Cuda(s) if cuda_key(s) == &want));
        let Some((i, _)) = found else {
            return Err(DeployError::Mismatch(format!(
                "{} on CUDA pool `{}` has no GPU replica allocated at startup; restart the gateway to change a CUDA pool's variants",
                want.1, want.0
            )));
        };
        used[i] = true;
        spec.tag = i as u32;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda_key(s: &CudaSlot) -> &(String, String) {
    &s.key
}

#[cfg(not(feature = "cuda"))]
fn cuda_key(s: &std::convert::Infallible) -> &(String, String) {
    match *s {}
}
