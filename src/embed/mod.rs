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
//! - [`guard`] (pure): a question's signature (negations, numbers, dates,
//!   names, words of direction); two questions are compared only when
//!   their signatures are equal.
//!
//! # How the gateway uses it
//!
//! `crate::sched::semantic` and `crate::server` (`server/cache.rs`): the
//! request is split into its question and the rest (hashed exactly, images
//! included); `Embedder::embed_question` embeds the question's last part
//! (at most `QUESTION_TOKENS` tokens; the text before it is hashed
//! exactly), on a blocking thread, one per core, under a time budget; a
//! request that misses the budget is served fresh and says so
//! (`x-kiln-cache: skipped`). The scheduler looks the vector up in the
//! decided tier's cache, in a scope of the context hash (with the guard's
//! signature), tier, tenant and variant, and stores the answer of a miss.

mod cache;
pub mod guard;
#[cfg(feature = "semantic-cache")]
mod model;

pub use cache::{CacheError, CacheStats, SemanticCache};
#[cfg(feature = "semantic-cache")]
pub use model::{EmbedError, Embedder, MODEL_ENV, QUESTION_TOKENS};
