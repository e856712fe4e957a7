//! The ranges every number in a policy must fall in. A real fleet never
//! comes near them; they exist so that nothing a policy says can make kiln
//! allocate (or loop) in proportion to a number written in it. `kiln check`
//! reports a value outside them as `out-of-range`, and the deployment
//! planner never places more than [`MAX_REPLICAS`] replicas whatever graph
//! it is handed.

/// GPUs in one pool.
pub const MAX_POOL_GPUS: u32 = 4096;
/// GPUs over all pools of a policy: every replica takes at least one GPU,
/// so this also bounds the replicas a deployment plans.
pub const MAX_TOTAL_GPUS: u32 = 65_536;
/// Replicas one deployment plan holds, over all pools.
pub const MAX_REPLICAS: usize = MAX_TOTAL_GPUS as usize;
/// Sequences in one batch (`max_batch`).
pub const MAX_BATCH: u32 = 65_536;
/// Tokens in one batch (`max_batch_tokens`) and tokens of one request
/// (`degrade max_tokens`): 16Mi.
pub const MAX_TOKENS: u32 = 1 << 24;
/// A tier's `priority`, from 0.
pub const MAX_PRIORITY: f64 = 1_000_000.0;
/// Approvers one approval rule may require.
pub const MAX_APPROVERS: u32 = 100;
/// Any count (params, concurrency, weights, steps, values compared in
/// conditions): 10^15, below 2^53 so every whole count is exact.
pub const MAX_COUNT: f64 = 1e15;
/// Any duration, in milliseconds: 366 days.
pub const MAX_DURATION_MS: f64 = 366.0 * 86_400_000.0;
/// Any size, in bytes: 1 PB.
pub const MAX_SIZE_BYTES: f64 = 1e15;
/// Any rate, per second: 10^12 (about 8.6e16 a day).
pub const MAX_RATE_PER_S: f64 = 1e12;
/// Percentages: 0% to 100%.
pub const MAX_PERCENT: f64 = 100.0;

/// The sliding window of measured signals (`signal_window`), ms: 1s to 1d.
pub const MIN_SIGNAL_WINDOW_MS: f64 = 1_000.0;
pub const MAX_SIGNAL_WINDOW_MS: f64 = 86_400_000.0;

/// A tier's fair-share window (`fair_share { window … }`), in
/// milliseconds: from 1 second (shorter forgets service within a few
/// steps, and its decay factor underflows) to 30 days.
pub const MIN_FAIR_SHARE_WINDOW_MS: f64 = 1_000.0;
/// A Batches API `completion_window` a tier accepts (`completion_windows
/// [1h, 24h]`), in milliseconds: from 1 minute to 7 days; 24h when a tier
/// names none.
pub const MIN_COMPLETION_WINDOW_MS: f64 = 60_000.0;
pub const MAX_COMPLETION_WINDOW_MS: f64 = 7.0 * 86_400_000.0;
pub const DEFAULT_COMPLETION_WINDOW_MS: f64 = 86_400_000.0;
pub const MAX_FAIR_SHARE_WINDOW_MS: f64 = 30.0 * 86_400_000.0;

/// A tier's response cache (`cache { exact { … } semantic { … } }`):
/// entries from 1 to 1,000,000, a time to live from 1 second to 7 days.
pub const MAX_CACHE_ENTRIES: f64 = 1_000_000.0;
pub const MIN_CACHE_TTL_MS: f64 = 1_000.0;
pub const MAX_CACHE_TTL_MS: f64 = 7.0 * 86_400_000.0;
