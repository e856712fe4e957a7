//! The gateway's CUDA steps: the KV-cache changes a replica's sequences
//! need before its next step (kept while it is busy on a blocking thread),
//! and running a step the scheduler started on the replica's GPU. The
//! executor (`server/executor.rs`) only says which sequence started or
//! ended where and when a step starts; how a step runs on a device is the
//! backend's.

use super::serve::CudaSlot;
use crate::sched::ReqId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// A KV-cache change for a CUDA replica, applied before its next step.
enum KvOp {
    Reserve(ReqId, u64),
    Release(ReqId),
}

/// The KV changes waiting for each CUDA replica's next step, and which
/// replica holds each sequence.
#[derive(Default)]
pub struct Steps {
    /// Pending KV changes per replica index.
    ops: HashMap<usize, Vec<KvOp>>,
    /// Which CUDA replica holds each sequence.
    seq: HashMap<ReqId, usize>,
}

impl Steps {
    /// A sequence of `tokens` (prompt plus output) started on `replica`:
    /// its KV blocks are reserved before the replica's next step.
    pub fn started(&mut self, id: ReqId, replica: usize, tokens: u64) {
        self.seq.insert(id, replica);
        self.ops
            .entry(replica)
            .or_default()
            .push(KvOp::Reserve(id, tokens));
    }

    /// Frees a sequence's KV blocks on its replica (at its next step); a
    /// sequence on no CUDA replica is ignored.
    pub fn release(&mut self, id: ReqId) {
        if let Some(r) = self.seq.remove(&id) {
            self.ops.entry(r).or_default().push(KvOp::Release(id));
        }
    }

    /// Runs one step of `shape` (prefill tokens, decoding sequences,
    /// context tokens) on replica `replica`'s GPU, on a blocking thread,
    /// after its pending KV changes; `done` gets the step's device time or
    /// why it failed.
    pub fn run(
        &mut self,
        replica: usize,
        slot: Arc<CudaSlot>,
        shape: (u32, u32, u64),
        done: impl FnOnce(Result<Duration, String>) + Send + 'static,
    ) {
        let (prefill, decodes, context) = shape;
        let ops = self.ops.remove(&replica).unwrap_or_default();
        tokio::task::spawn_blocking(move || {
            let result = match slot.replica.lock() {
                Ok(mut gpu) => {
                    for op in ops {
                        match op {
                            KvOp::Reserve(id, tokens) => {
                                if let Err(e) = gpu.reserve(id, tokens) {
                                    tracing::warn!("KV arena: {e}");
                                }
                            }
                            KvOp::Release(id) => {
                                gpu.release(id);
                            }
                        }
                    }
                    gpu.run_step(prefill, decodes, context)
                        .map_err(|e| e.to_string())
                }
                Err(_) => Err("the replica's lock was poisoned by an earlier failure".into()),
            };
            done(result);
        });
    }
}
