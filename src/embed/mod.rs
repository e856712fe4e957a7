//! The semantic cache's engine: prompt embeddings and a cache of answers
//! by embedding.
//!
//! - [`SemanticCache`] (always built, pure): values by embedding, per scope
//!   (tenant, model and variant: a cache never answers across scopes),
//!   answered when the nearest live entry's cosine similarity reaches the
//!   policy's `similarity`, bounded in entries over all scopes, with a time
//!   to live and least-recently-used eviction. Time is injected.
//! - `Embedder` (feature `semantic-cache`): all-MiniLM-L6-v2, a
//!   384-dimensional BERT sentence encoder, run on the CPU with candle from
//!   a local model directory (`KILN_EMBED_MODEL`); no download at run
//!   time.
//!
//! # How the gateway uses it
//!
//! For a request whose tier allows the semantic cache:
//!
//! 1. Embed the prompt on a blocking thread (`tokio::task::spawn_blocking`,
//!    or a small bounded pool so a burst cannot queue unbounded CPU work),
//!    under a time budget (`tokio::time::timeout`); an error, or a budget
//!    overrun, is a miss, never a failed request. Embedding costs about as
//!    much as its tokens (at most `Embedder::max_tokens`; figures in
//!    BENCHMARKS.md).
//! 2. `lookup(scope, &v, now_us)` on the tier's cache, under a mutex (it is
//!    a scan over the scope, sub-millisecond at policy sizes): a hit
//!    answers from the cache; count hits and misses for metrics.
//! 3. On a miss, serve the request and `insert(scope, v, answer, now_us)`
//!    once the answer is complete.

mod cache;
#[cfg(feature = "semantic-cache")]
mod model;

pub use cache::{CacheError, CacheStats, SemanticCache};
#[cfg(feature = "semantic-cache")]
pub use model::{EmbedError, Embedder, MODEL_ENV};
