//! The GPU-free parts of the CUDA backend, built and tested without the
//! `cuda` feature: what a device is ([`DeviceInfo`]), whether a policy's
//! pool fits the devices found ([`check_pool`], [`assign_pools`]), and the
//! KV-cache block accounting of a replica ([`KvBlocks`]).

use crate::graph::Pool;
use miette::Diagnostic;
use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

/// One GPU as the CUDA driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// The driver's device ordinal.
    pub ordinal: u32,
    pub name: String,
    /// Compute capability, `(major, minor)`: 9.0 for Hopper.
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Memory, bytes.
    pub total_memory: u64,
    pub free_memory: u64,
}

/// A datasheet's "80 GB" is sometimes a little more than the device
/// reports (A10: 24 GB sold, 23.8 GB reported): a pool may declare up to
/// this much more memory than its devices report.
pub const MEMORY_TOLERANCE: f64 = 0.02;

/// A policy's pool asks for more than the devices have.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Diagnostic)]
pub enum PoolCheckError {
    #[error("pool `{pool}` declares {declared} GPUs, but the CUDA driver sees {available} for it")]
    #[diagnostic(
        code(kiln::cuda::too_few_gpus),
        help("lower `gpus` in pool `{pool}`, or run the gateway on a machine with more GPUs (`kiln gpus` lists what the driver sees)")
    )]
    TooFewGpus {
        pool: String,
        declared: u32,
        available: usize,
    },

    #[error(
        "pool `{pool}` declares {declared_gb:.1} GB per GPU, but GPU {ordinal} ({device}) has {total_gb:.1} GB"
    )]
    #[diagnostic(
        code(kiln::cuda::not_enough_memory),
        help("set `memory` in pool `{pool}` to at most the device's memory, or give the pool a larger GPU")
    )]
    NotEnoughMemory {
        pool: String,
        declared_gb: f64,
        ordinal: u32,
        device: String,
        total_gb: f64,
    },
}

/// Checks a pool against the devices it would run on: no more GPUs than
/// `devices`, and no GPU with less memory than the pool's `memory` declares
/// (beyond [`MEMORY_TOLERANCE`]). The gateway calls it at startup for each
/// pool whose backend is `cuda`, with the devices [`assign_pools`] gave it.
pub fn check_pool(pool: &Pool, devices: &[DeviceInfo]) -> Result<(), PoolCheckError> {
    let wanted = pool.gpus as usize;
    if wanted > devices.len() {
        return Err(PoolCheckError::TooFewGpus {
            pool: pool.name.clone(),
            declared: pool.gpus,
            available: devices.len(),
        });
    }
    if pool.gpu_memory > 0.0 {
        for d in devices.iter().take(wanted) {
            let total = d.total_memory as f64;
            if pool.gpu_memory > total * (1.0 + MEMORY_TOLERANCE) {
                return Err(PoolCheckError::NotEnoughMemory {
                    pool: pool.name.clone(),
                    declared_gb: pool.gpu_memory / 1e9,
                    ordinal: d.ordinal,
                    device: d.name.clone(),
                    total_gb: total / 1e9,
                });
            }
        }
    }
    Ok(())
}

/// Gives each pool, in order, the next `gpus` devices, and checks each
/// against its share with [`check_pool`]. Returns the index range of
/// `devices` each pool gets.
pub fn assign_pools(
    pools: &[&Pool],
    devices: &[DeviceInfo],
) -> Result<Vec<Range<usize>>, PoolCheckError> {
    let mut next = 0usize;
    let mut out = Vec::with_capacity(pools.len());
    for pool in pools {
        let rest = devices.get(next..).unwrap_or(&[]);
        check_pool(pool, rest)?;
        let end = next + pool.gpus as usize;
        out.push(next..end);
        next = end;
    }
    Ok(out)
}

/// `GPU 0  NVIDIA H200  compute 9.0  132 SMs  139.8 GiB total, 139.2 GiB free`.
pub fn describe(d: &DeviceInfo) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    format!(
        "GPU {}  {}  compute {}.{}  {} SMs  {:.1} GiB total, {:.1} GiB free",
        d.ordinal,
        d.name,
        d.compute_capability.0,
        d.compute_capability.1,
        d.sms,
        d.total_memory as f64 / GIB,
        d.free_memory as f64 / GIB
    )
}

/// The KV arena of a replica is full.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Diagnostic)]
#[error("KV cache full: sequence {seq} needs {needed} more blocks, {free} of {total} are free")]
#[diagnostic(
    code(kiln::cuda::kv_full),
    help("free (preempt or finish) other sequences first; the scheduler's KV capacity should not exceed the arena's")
)]
pub struct KvFull {
    pub seq: u64,
    pub needed: u32,
    pub free: u32,
    pub total: u32,
}

/// Paged KV-cache accounting: an arena of `blocks` blocks of `block_tokens`
/// tokens, handed to sequences by id. Pure bookkeeping; the CUDA replica
/// owns the memory the block indices address.
#[derive(Debug, Clone)]
pub struct KvBlocks {
    block_tokens: u32,
    total: u32,
    free: Vec<u32>,
    seqs: HashMap<u64, Vec<u32>>,
}

impl KvBlocks {
    pub fn new(blocks: u32, block_tokens: u32) -> KvBlocks {
        KvBlocks {
            block_tokens: block_tokens.max(1),
            total: blocks,
            // Popped from the end: block 0 is handed out first.
            free: (0..blocks).rev().collect(),
            seqs: HashMap::default(),
        }
    }

    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    pub fn total_blocks(&self) -> u32 {
        self.total
    }

    pub fn free_blocks(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.total) * u64::from(self.block_tokens)
    }

    pub fn free_tokens(&self) -> u64 {
        u64::from(self.free_blocks()) * u64::from(self.block_tokens)
    }

    /// Sequences holding blocks.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The blocks `seq` holds, in order.
    pub fn blocks_of(&self, seq: u64) -> &[u32] {
        self.seqs.get(&seq).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Grows `seq` to hold `tokens` tokens (allocating only the blocks it
    /// lacks; never shrinks). All or nothing: on [`KvFull`] nothing changes.
    pub fn reserve(&mut self, seq: u64, tokens: u64) -> Result<&[u32], KvFull> {
        let want = tokens.div_ceil(u64::from(self.block_tokens));
        let have = self.seqs.get(&seq).map_or(0, |b| b.len() as u64);
        let needed = want.saturating_sub(have);
        if needed > self.free.len() as u64 {
            return Err(KvFull {
                seq,
                needed: u32::try_from(needed).unwrap_or(u32::MAX),
                free: self.free_blocks(),
                total: self.total,
            });
        }
        let at = self.free.len() - needed as usize;
        let got = self.free.split_off(at);
        let blocks = self.seqs.entry(seq).or_default();
        blocks.extend(got.into_iter().rev());
        Ok(blocks.as_slice())
    }

    /// Frees every block of `seq` (finished, cancelled or preempted);
    /// returns how many. Freeing an unknown sequence frees nothing.
    pub fn release(&mut self, seq: u64) -> u32 {
        match self.seqs.remove(&seq) {
            Some(b) => {
                let n = b.len() as u32;
                self.free.extend(b.into_iter().rev());
                n
            }
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(gpus: u32, memory_gb: f64) -> Pool {
        Pool {
            name: "h200".into(),
            gpus,
            kind: "H200".into(),
            gpu_memory: memory_gb * 1e9,
            labels: Default::default(),
            allow_tiers: None,
            deny_tiers: Vec::new(),
            allow_tenants: None,
            deny_tenants: Vec::new(),
            signal_window: crate::graph::signal::DEFAULT_WINDOW_MS,
            price_per_gpu_hour: None,
            owner: Default::default(),
            span: Default::default(),
        }
    }

    fn h200(ordinal: u32) -> DeviceInfo {
        DeviceInfo {
            ordinal,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sms: 132,
            total_memory: 150_754_820_096,
            free_memory: 150_000_000_000,
        }
    }

    #[test]
    fn pool_within_devices_passes() {
        assert_eq!(check_pool(&pool(1, 141.0), &[h200(0)]), Ok(()));
        assert_eq!(check_pool(&pool(2, 0.0), &[h200(0), h200(1)]), Ok(()));
    }

    #[test]
    fn too_many_gpus_is_a_diagnostic() {
        let e = check_pool(&pool(8, 141.0), &[h200(0)]).unwrap_err();
        assert_eq!(
            e,
            PoolCheckError::TooFewGpus {
                pool: "h200".into(),
                declared: 8,
                available: 1
            }
        );
        assert!(e.to_string().contains("declares 8 GPUs"), "{e}");
        assert!(check_pool(&pool(1, 80.0), &[]).is_err());
    }

    #[test]
    fn too_much_memory_is_a_diagnostic() {
        let e = check_pool(&pool(1, 192.0), &[h200(0)]).unwrap_err();
        assert!(matches!(
            e,
            PoolCheckError::NotEnoughMemory { ordinal: 0, .. }
        ));
        assert!(e.to_string().contains("192.0 GB"), "{e}");
        // Within the tolerance: an A10 sold as 24 GB reports 23.8.
        let mut a10 = h200(0);
        a10.total_memory = 23_835_000_000;
        assert_eq!(check_pool(&pool(1, 24.0), &[a10]), Ok(()));
    }

    #[test]
    fn pools_get_consecutive_devices() {
        let devs = [h200(0), h200(1), h200(2)];
        let (a, b) = (pool(2, 141.0), pool(1, 141.0));
        assert_eq!(assign_pools(&[&a, &b], &devs), Ok(vec![0..2, 2..3]));
        let c = pool(2, 141.0);
        assert!(matches!(
            assign_pools(&[&a, &c], &devs),
            Err(PoolCheckError::TooFewGpus { available: 1, .. })
        ));
    }

    #[test]
    fn kv_blocks_reserve_and_release() {
        let mut kv = KvBlocks::new(10, 16);
        assert_eq!(kv.capacity_tokens(), 160);
        assert_eq!(kv.reserve(1, 33).unwrap(), &[0, 1, 2]);
        // Growing allocates only what is missing; never shrinks.
        assert_eq!(kv.reserve(1, 48).unwrap().len(), 3);
        assert_eq!(kv.reserve(1, 49).unwrap(), &[0, 1, 2, 3]);
        assert_eq!(kv.reserve(1, 1).unwrap().len(), 4);
        assert_eq!(kv.reserve(2, 96).unwrap().len(), 6);
        assert_eq!(kv.free_blocks(), 0);
        // Full: all or nothing.
        let e = kv.reserve(3, 1).unwrap_err();
        assert_eq!((e.needed, e.free, e.total), (1, 0, 10));
        assert!(kv.blocks_of(3).is_empty());
        // Preempting sequence 1 frees its blocks for another.
        assert_eq!(kv.release(1), 4);
        assert_eq!(kv.release(1), 0);
        assert_eq!(kv.reserve(3, 64).unwrap().len(), 4);
        assert_eq!(kv.sequences(), 2);
        assert_eq!(kv.free_tokens(), 0);
        assert!(describe(&h200(0)).starts_with("GPU 0  NVIDIA H200  compute 9.0  132 SMs"));
    }
}
