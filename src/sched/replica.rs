//! One model replica running continuous batching: every step decodes one
//! token for each running sequence and spends what is left of the step's
//! token budget on prompt prefill (chunked, as vLLM's v1 scheduler does).
//! KV memory for a sequence's prompt and output is reserved when it starts,
//! so a replica never holds more than its capacity.

use super::plan::ReplicaSpec;
use super::queue::Waiting;
use super::{Action, Micros, ReqId, SEC};
use std::collections::VecDeque;

/// Prompt blocks (512 tokens) a replica remembers for prefix affinity.
const PREFIX_CACHE_BLOCKS: usize = 8192;
pub const BLOCK_TOKENS: u32 = 512;

#[derive(Debug, Clone)]
pub struct Seq {
    pub w: Waiting,
    /// Prompt (plus, after a preemption, regenerated) tokens still to prefill.
    pub prefill_left: u32,
    pub generated: u32,
    pub started: Micros,
    pub first_token_sent: bool,
    pub kv: u64,
    /// GPU-seconds used so far.
    pub gpu_seconds: f64,
    /// Tokens prefilled in the step in flight.
    step_prefill: u32,
    step_decode: bool,
}

impl Seq {
    /// A sequence resumes after preemption by recomputing the KV cache of
    /// its prompt and of what it had generated (the recompute cost).
    pub fn from_waiting(w: Waiting, cached_prefix: u32) -> Seq {
        let recompute = w.prompt_tokens.saturating_add(w.generated);
        let kv = u64::from(w.prompt_tokens) + u64::from(w.output_tokens);
        Seq {
            prefill_left: recompute.saturating_sub(cached_prefix).max(1),
            generated: w.generated,
            started: 0,
            first_token_sent: w.generated > 0,
            kv,
            gpu_seconds: w.gpu_seconds,
            step_prefill: 0,
            step_decode: false,
            w,
        }
    }
}

#[derive(Debug)]
pub struct Replica {
    pub spec: ReplicaSpec,
    pub running: Vec<Seq>,
    pub busy: bool,
    /// In service (a replica that went down takes no work until it is up).
    pub up: bool,
    /// A policy swap left it out of the plan: it takes no new work and
    /// finishes what runs. It keeps its index, as replicas are named by it.
    pub draining: bool,
    kv_used: u64,
    /// Prompt blocks held, oldest first, and the same set for lookups.
    prefix: VecDeque<u64>,
    prefix_set: rustc_hash::FxHashSet<u64>,
    /// Seconds the replica has spent running steps (for utilization).
    pub busy_seconds: f64,
    /// Duration of the step in flight (or the last one), seconds.
    pub last_step: f64,
    /// The step in flight as (prefill tokens, decoding sequences, context
    /// tokens): what a real GPU backend runs for it.
    pub step_shape: (u32, u32, u64),
    /// When the step in flight ends: a completion reported earlier belongs
    /// to a step lost when the replica went down, and is ignored.
    pub step_until: Micros,
    rate: f64,
    /// Prompt tokens prefilled, and output tokens produced, by finished
    /// steps (for throughput against the roofline in reports).
    pub prefilled_tokens: u64,
    pub decoded_tokens: u64,
}

/// A cost model's step time made usable: a broken one (NaN, infinite,
/// negative) reads as one second, a tiny one as at least a nanosecond.
fn sane_secs(secs: f64) -> f64 {
    if secs.is_finite() {
        secs.max(1e-9)
    } else {
        1.0
    }
}

/// Token throughput for wait estimates: a mix of prefill (fast) and decode
/// at a moderate batch (slow), weighted 4:1 as prompts usually are longer
/// than outputs. Always finite and positive.
fn throughput(spec: &ReplicaSpec) -> f64 {
    let b = spec.max_batch.clamp(1, 64);
    let decode = f64::from(b) / sane_secs(spec.cost.step_time(0, b, u64::from(b) * 1024));
    let chunk = spec.max_batch_tokens.max(1);
    let prefill = f64::from(chunk) / sane_secs(spec.cost.step_time(chunk, 0, 0));
    let rate = 1.0 / (0.8 / prefill + 0.2 / decode);
    if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        1.0
    }
}

impl Replica {
    pub fn new(spec: ReplicaSpec) -> Replica {
        let rate = throughput(&spec);
        Replica {
            spec,
            running: Vec::new(),
            busy: false,
            up: true,
            draining: false,
            kv_used: 0,
            prefix: VecDeque::new(),
            prefix_set: Default::default(),
            busy_seconds: 0.0,
            last_step: 0.0,
            step_shape: (0, 0, 0),
            step_until: 0,
            rate,
            prefilled_tokens: 0,
            decoded_tokens: 0,
        }
    }

    /// Takes a new spec (a policy swap) keeping what runs, its step in
    /// flight and its prefix cache. If the new limits are below what runs,
    /// nothing is evicted: the replica admits nothing until it is under.
    pub fn respec(&mut self, spec: ReplicaSpec) {
        self.rate = throughput(&spec);
        self.spec = spec;
    }

    pub fn kv_used(&self) -> u64 {
        self.kv_used
    }

    pub fn kv_free(&self) -> u64 {
        self.spec.kv_capacity.saturating_sub(self.kv_used)
    }

    pub fn free_seq_slots(&self) -> u32 {
        self.spec
            .max_batch
            .saturating_sub(self.running.len() as u32)
    }

    pub fn throughput_tokens_per_s(&self) -> f64 {
        self.rate
    }

    /// Estimated time until the first running sequence finishes and frees
    /// its slot and memory (for an external replica, from the cost model
    /// and each sequence's remaining budget: its progress is unknown here).
    pub fn time_to_free(&self) -> Micros {
        let context: u64 = self
            .running
            .iter()
            .map(|s| u64::from(s.w.prompt_tokens) + u64::from(s.generated))
            .sum();
        let step = sane_secs(
            self.spec
                .cost
                .step_time(0, self.running.len() as u32, context),
        )
        .max(1e-6);
        let steps = self
            .running
            .iter()
            .map(|s| {
                let prefill_steps = s.prefill_left.div_ceil(self.spec.max_batch_tokens.max(1));
                prefill_steps.saturating_add(s.w.output_tokens.saturating_sub(s.generated))
            })
            .min()
            .unwrap_or(0);
        // A float-to-integer cast saturates: no overflow however large.
        (f64::from(steps) * step * SEC as f64) as Micros
    }

    /// Sequences past their prefill (each decodes a token per step).
    pub fn decoding(&self) -> u32 {
        self.running.iter().filter(|s| s.prefill_left == 0).count() as u32
    }

    /// Prompt tokens admitted here and not yet prefilled.
    pub fn pending_prefill(&self) -> u64 {
        self.running.iter().map(|s| u64::from(s.prefill_left)).sum()
    }

    /// Estimated time from starting here to the first token of a prompt of
    /// `tokens`: the prefill already admitted goes first (chunked prefill
    /// serves running sequences in order), in steps that also decode every
    /// sequence past its prefill, so each step has the token budget less
    /// the decodes for prefill. Finite whatever the cost model says.
    pub fn first_token_time(&self, tokens: u64) -> Micros {
        let (mut pending, mut decodes, mut context) = (0u64, 0u32, 0u64);
        for s in &self.running {
            if s.prefill_left > 0 {
                pending += u64::from(s.prefill_left);
            } else {
                decodes += 1;
                context += u64::from(s.w.prompt_tokens) + u64::from(s.generated);
            }
        }
        let budget = u64::from(self.spec.max_batch_tokens.saturating_sub(decodes).max(1));
        let work = pending.saturating_add(tokens.max(1));
        let steps = work.div_ceil(budget);
        let chunk = work.min(budget) as u32;
        let step = sane_secs(self.spec.cost.step_time(chunk, decodes, context));
        (steps as f64 * step * SEC as f64) as Micros
    }

    /// Leading prompt blocks this replica has seen, in tokens.
    pub fn cached_prefix_tokens(&self, blocks: &[u64]) -> u32 {
        let n = blocks
            .iter()
            .take_while(|b| self.prefix_set.contains(b))
            .count() as u32;
        n * BLOCK_TOKENS
    }

    /// Longest cached prefix, for choosing among replicas.
    pub fn prefix_match(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.prefix.contains(b))
            .count()
    }

    pub fn admit(&mut self, mut s: Seq, now: Micros) {
        self.kv_used += s.kv;
        s.started = now;
        s.w.started = true;
        self.running.push(s);
    }

    pub fn evict(&mut self, i: usize) -> Seq {
        let s = self.running.swap_remove(i);
        self.kv_used -= s.kv;
        s
    }

    /// Where request `id` runs on this replica, if it does.
    pub fn position(&self, id: ReqId) -> Option<usize> {
        self.running.iter().position(|s| s.w.id == id)
    }

    /// Remembers a finished prompt's blocks for prefix affinity.
    pub fn remember_prefix(&mut self, blocks: &[u64]) {
        for b in blocks {
            if self.prefix_set.insert(*b) {
                if self.prefix.len() >= PREFIX_CACHE_BLOCKS {
                    if let Some(old) = self.prefix.pop_front() {
                        self.prefix_set.remove(&old);
                    }
                }
                self.prefix.push_back(*b);
            }
        }
    }

    /// Plans and starts the next step; returns when it ends.
    pub fn start_step(&mut self, now: Micros) -> Option<Micros> {
        if self.running.is_empty() || self.busy {
            return None;
        }
        let mut budget = self.spec.max_batch_tokens;
        let mut decodes = 0u32;
        let mut context = 0u64;
        for s in &mut self.running {
            s.step_prefill = 0;
            s.step_decode = false;
            if s.prefill_left == 0 && budget > 0 {
                s.step_decode = true;
                decodes += 1;
                budget -= 1;
                context += u64::from(s.w.prompt_tokens) + u64::from(s.generated);
            }
        }
        let mut prefill = 0u32;
        for s in &mut self.running {
            if s.prefill_left > 0 && budget > 0 {
                let chunk = s.prefill_left.min(budget);
                s.step_prefill = chunk;
                budget -= chunk;
                prefill += chunk;
            }
        }
        if prefill == 0 && decodes == 0 {
            return None;
        }
        let secs = self.spec.cost.step_time(prefill, decodes, context);
        // A cost model must give a finite, positive time; a broken one
        // (NaN, infinite) is treated as one second rather than stalling.
        let secs = if secs.is_finite() {
            secs.max(1e-6)
        } else {
            1.0
        };
        self.busy = true;
        self.busy_seconds += secs;
        self.last_step = secs;
        self.step_until = now.saturating_add(((secs * SEC as f64).ceil() as Micros).max(1));
        self.step_shape = (prefill, decodes, context);
        Some(self.step_until)
    }

    /// Applies the finished step: prefill progress, one token per decoding
    /// sequence, first tokens and completions. Returns finished sequences.
    pub fn finish_step(&mut self, _now: Micros, out: &mut Vec<Action>) -> Vec<(ReqId, Seq)> {
        self.busy = false;
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            let mut produced = false;
            if s.step_prefill > 0 {
                self.prefilled_tokens += u64::from(s.step_prefill);
                s.prefill_left -= s.step_prefill.min(s.prefill_left);
                // The step that completes the prefill samples a token.
                produced = s.prefill_left == 0;
            } else if s.step_decode {
                produced = true;
            }
            s.step_prefill = 0;
            s.step_decode = false;
            if produced {
                self.decoded_tokens += 1;
                s.generated += 1;
                if !s.first_token_sent {
                    s.first_token_sent = true;
                    out.push(Action::FirstToken { id: s.w.id });
                }
            }
            if s.generated >= s.w.output_tokens {
                let s = self.running.swap_remove(i);
                self.kv_used -= s.kv;
                self.remember_prefix(&s.w.prefix_blocks);
                out.push(Action::Finished {
                    id: s.w.id,
                    gpu_seconds: s.gpu_seconds,
                });
                done.push((s.w.id, s));
            } else {
                i += 1;
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::StepCost;
    use super::super::testkit::{waiting, Linear};
    use super::*;
    use std::sync::Arc;

    #[derive(Debug)]
    struct Broken(f64);

    impl StepCost for Broken {
        fn step_time(&self, _: u32, _: u32, _: u64) -> f64 {
            self.0
        }
    }

    fn spec(cost: Arc<dyn StepCost>, max_batch: u32, external: bool) -> ReplicaSpec {
        ReplicaSpec {
            pool: 0,
            model: 0,
            variant: 0,
            gpus: 1,
            kv_capacity: u64::MAX,
            max_batch,
            max_batch_tokens: 0,
            cost,
            only_tier: None,
            external,
            tag: 0,
        }
    }

    #[test]
    fn estimates_are_finite_whatever_the_cost_model_says() {
        for secs in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -1.0, 1e300] {
            for max_batch in [0, 1, u32::MAX] {
                let mut r = Replica::new(spec(Arc::new(Broken(secs)), max_batch, true));
                let rate = r.throughput_tokens_per_s();
                assert!(rate.is_finite() && rate > 0.0, "{secs} {max_batch}: {rate}");
                let mut w = waiting(0, 0, None);
                w.prompt_tokens = u32::MAX;
                w.output_tokens = u32::MAX;
                r.admit(Seq::from_waiting(w, 0), 0);
                let _ = r.time_to_free();
            }
        }
    }

    #[test]
    fn respec_keeps_what_runs_and_admits_nothing_over_the_new_limits() {
        let mut r = Replica::new(spec(Arc::new(Linear), 4, false));
        for id in 0..3 {
            r.admit(Seq::from_waiting(waiting(id, 0, None), 0), 0);
        }
        assert!(r.running.iter().all(|s| s.w.started));
        let mut small = spec(Arc::new(Linear), 2, false);
        small.kv_capacity = 20;
        r.respec(small);
        assert_eq!(r.running.len(), 3);
        assert_eq!(r.free_seq_slots(), 0);
        assert_eq!(r.kv_free(), 0);
    }

    #[test]
    fn finished_prompts_are_remembered_for_affinity() {
        let mut r = Replica::new(spec(Arc::new(Linear), 4, false));
        r.remember_prefix(&[1, 2, 3]);
        assert_eq!(r.prefix_match(&[1, 2, 9]), 2);
        assert_eq!(r.cached_prefix_tokens(&[1, 2, 3]), 3 * BLOCK_TOKENS);
        assert_eq!(r.position(5), None);
    }
}
