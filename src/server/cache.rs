//! The gateway's side of a tier's exact-response cache
//! ([`crate::sched::cache`] holds its policy and its store, inside the
//! scheduler): the request's content hash and the semantic probe;
//! answering a hit and storing a complete answer are the request's
//! ([`super::request::cache`]).
//!
//! A hit is decided by the scheduler after the policy classified, routed
//! and admitted the request and charged it one request of its tenant's
//! requests quota (no tokens, no GPU-seconds: it uses none). So an
//! unauthenticated, paused or over-quota caller never gets a cached answer.
//! The answer is the stored body with a new `id` and `created`, as JSON or
//! (a streaming request) as server-sent events; `x-kiln-cache: hit`.
//!
//! Only complete answers are stored: `finish_reason` `stop` or `length`,
//! never a cancelled, failed or preempted one, and only while the policy
//! version that decided the request is still the active one.

use super::openai::Endpoint;
use crate::graph::DecisionGraph;
use crate::sched::cache::{self, Key};
use serde_json::Value;
use std::sync::Arc;

/// The request's content hash when it is cacheable and some tier of the
/// active policy has a response cache (otherwise nothing is hashed).
pub(super) fn content(g: &DecisionGraph, body: &Value) -> Option<Key> {
    if !g.tiers.iter().any(|t| !t.cache.is_empty()) {
        return None;
    }
    cache::content_key(body)
}

/// What the gateway needs of an embedding model: a blocking call giving
/// where the question's compared part begins and that part's vector,
/// `None` when it cannot (a skipped lookup, never a failure).
pub trait EmbedText: Send + Sync {
    fn embed_question(&self, text: &str) -> Option<(usize, Vec<f32>)>;
}

#[cfg(feature = "semantic-cache")]
impl EmbedText for crate::embed::Embedder {
    fn embed_question(&self, text: &str) -> Option<(usize, Vec<f32>)> {
        crate::embed::Embedder::embed_question(self, text).ok()
    }
}

/// Loads `[cache] embedding_model` at start; `None` without one. The
/// model's own error (with its help) is kept.
pub(super) fn load_embedder(
    c: &super::config::CacheSection,
) -> Result<Option<Arc<dyn EmbedText>>, super::ServeError> {
    let Some(dir) = &c.embedding_model else {
        return Ok(None);
    };
    #[cfg(feature = "semantic-cache")]
    {
        match crate::embed::Embedder::load(dir) {
            Ok(e) => Ok(Some(Arc::new(e))),
            Err(e) => Err(super::ServeError::EmbeddingModel(Box::new(e))),
        }
    }
    #[cfg(not(feature = "semantic-cache"))]
    {
        Err(super::ServeError::Embedder(format!(
            "{}: this kiln was built without `--features semantic-cache`",
            dir.display()
        )))
    }
}

/// Why a request's semantic lookup was skipped (`x-kiln-cache-skipped`,
/// `kiln_cache_skipped_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Skip {
    /// Every embedding slot stayed taken for the whole budget.
    Busy,
    /// The embedding started but did not finish within the budget.
    Budget,
    /// The model could not embed the text.
    Error,
    /// Some tier's exact cache held the request's content, so it was not
    /// embedded (an exact hit must not wait for an embedding), but the
    /// decided tier and tenant had no exact answer.
    Exact,
}

impl Skip {
    pub(super) const ALL: [Skip; 4] = [Skip::Busy, Skip::Budget, Skip::Error, Skip::Exact];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Skip::Busy => "busy",
            Skip::Budget => "budget",
            Skip::Error => "error",
            Skip::Exact => "exact",
        }
    }
}

/// What became of a request's semantic lookup before the scheduler.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) enum Semantic {
    /// Not asked: no tier has a semantic cache, no model, the request is
    /// not cacheable or has no question.
    #[default]
    None,
    /// Embedded: compared by the decided tier's semantic cache.
    Probe(crate::sched::semantic::Probe),
    /// Not embedded, and why.
    Skipped(Skip),
}

impl Semantic {
    pub(super) fn probe(&self) -> Option<crate::sched::semantic::Probe> {
        match self {
            Semantic::Probe(p) => Some(p.clone()),
            _ => None,
        }
    }
}

/// Embeddings computed at once: one per core (the work is CPU-bound; more
/// at once would only make each slower). A request waits for a slot
/// within its budget rather than skip at once.
fn slots() -> &'static Arc<tokio::sync::Semaphore> {
    static SLOTS: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Arc::new(tokio::sync::Semaphore::new(cores.clamp(1, 8)))
    })
}

/// The question a semantic cache compares (the last user message's text,
/// or a completion's prompt) and the hash of everything else
/// ([`crate::sched::semantic::question`]).
pub(super) fn question(
    body: &Value,
    endpoint: Endpoint,
) -> Option<crate::sched::semantic::Question> {
    crate::sched::semantic::question(body, endpoint == Endpoint::Chat)
}

/// The semantic cache's probe for a cacheable request, when a tier has a
/// semantic cache and an embedding model is loaded: skipped when some
/// tier's exact cache holds the request (the exact lookup comes first and
/// must not wait); otherwise the question embedded off the async runtime
/// (waiting for one of [`slots`]), all within `[cache] embedding_budget`
/// (at most 10 s). A request that does not make it is
/// [`Semantic::Skipped`], and says so.
pub(super) async fn probe(
    app: &super::App,
    g: &DecisionGraph,
    body: &Value,
    endpoint: Endpoint,
    cacheable: bool,
) -> Semantic {
    let Some(embedder) = app.embedder.clone() else {
        return Semantic::None;
    };
    if !cacheable || !g.tiers.iter().any(|t| t.cache.semantic.is_some()) {
        return Semantic::None;
    }
    let Some(q) = question(body, endpoint) else {
        return Semantic::None;
    };
    if g.tiers.iter().any(|t| t.cache.exact.is_some()) {
        if let Some(content) = cache::content_key(body) {
            if app.exec.exact_holds(content).await {
                return Semantic::Skipped(Skip::Exact);
            }
        }
    }
    let budget = app
        .config
        .cache
        .embedding_budget
        .min(std::time::Duration::from_secs(10));
    let deadline = tokio::time::Instant::now() + budget;
    let permit = match tokio::time::timeout_at(deadline, slots().clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        Ok(Err(_)) => return Semantic::Skipped(Skip::Error),
        Err(_) => return Semantic::Skipped(Skip::Busy),
    };
    let job = tokio::task::spawn_blocking(move || {
        // The slot is held until the work ends, even past the budget.
        let _permit = permit;
        let (start, vector) = embedder.embed_question(&q.text)?;
        let context = crate::sched::semantic::context(&q.rest, &q.text, start);
        Some((context, vector))
    });
    match tokio::time::timeout_at(deadline, job).await {
        Err(_) => Semantic::Skipped(Skip::Budget),
        Ok(Ok(Some((context, vector)))) => Semantic::Probe(crate::sched::semantic::Probe {
            context,
            vector: vector.into(),
        }),
        Ok(_) => Semantic::Skipped(Skip::Error),
    }
}

/// The headers every cache answer and cacheable miss carries.
pub(super) const HEADER: &str = "x-kiln-cache";

/// 64 hex digits: the content hash as the decision log records it.
pub(super) fn hex(k: &Key) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(system: &str, user: &str, max_tokens: u64) -> Value {
        json!({
            "model": "m", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        })
    }

    #[test]
    fn the_question_is_compared_and_everything_else_must_match() {
        let q = |b: &Value| question(b, Endpoint::Chat).unwrap();
        let a = q(&chat("s", "How do I reset it?", 8));
        assert_eq!(a.text, "How do I reset it?");
        // Another question, same context.
        assert_eq!(a.rest, q(&chat("s", "Reset how?", 8)).rest);
        // Another system prompt or length limit: another context.
        assert_ne!(a.rest, q(&chat("t", "How do I reset it?", 8)).rest);
        assert_ne!(a.rest, q(&chat("s", "How do I reset it?", 9)).rest);
        // Text parts are joined; a last message that is not the user's, an
        // empty question or a sampled request have none.
        let parts = json!({"temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        assert_eq!(q(&parts).text, "a\nb");
        let assistant =
            json!({"temperature": 0, "messages": [{"role": "assistant", "content": "x"}]});
        assert!(question(&assistant, Endpoint::Chat).is_none());
        assert!(question(&chat("s", "  ", 8), Endpoint::Chat).is_none());
        let sampled = json!({"temperature": 0.7, "messages": [{"role": "user", "content": "x"}]});
        assert!(question(&sampled, Endpoint::Chat).is_none());
        let completion = json!({"temperature": 0, "prompt": "Once upon"});
        assert_eq!(
            question(&completion, Endpoint::Completions).map(|x| x.text),
            Some("Once upon".into())
        );
    }

    #[test]
    fn images_and_other_parts_are_part_of_the_context() {
        let with = |image: Option<&str>| {
            let mut parts = vec![json!({"type": "text", "text": "What is in this picture?"})];
            if let Some(url) = image {
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            json!({"temperature": 0, "messages": [{"role": "user", "content": parts}]})
        };
        let a = question(&with(Some("data:image/png;base64,AAAA")), Endpoint::Chat).unwrap();
        let b = question(&with(Some("data:image/png;base64,BBBB")), Endpoint::Chat).unwrap();
        let none = question(&with(None), Endpoint::Chat).unwrap();
        assert_eq!(a.text, b.text);
        assert_ne!(a.rest, b.rest, "another image");
        assert_ne!(a.rest, none.rest, "no image");
        let again = question(&with(Some("data:image/png;base64,AAAA")), Endpoint::Chat).unwrap();
        assert_eq!(a.rest, again.rest);
    }

    #[test]
    fn the_head_of_a_long_question_and_its_guarded_details_are_exact() {
        use crate::sched::semantic::context;
        let rest = [7u8; 32];
        let doc = "Clause 1. The supplier delivers.\n\n";
        let a = format!("{doc}What is the notice period?");
        let b = format!("{doc}Who pays for shipping?");
        let start = |t: &str| t.rfind("\n\n").map_or(0, |i| i + 2);
        // Same head (the document), compared parts differ: one context.
        assert_eq!(context(&rest, &a, start(&a)), context(&rest, &b, start(&b)));
        // Another head: another context.
        let c = format!(
            "Clause 2. The buyer pays.\n\n{}",
            "What is the notice period?"
        );
        assert_ne!(context(&rest, &a, start(&a)), context(&rest, &c, start(&c)));
        // A guarded detail: another context.
        assert_ne!(
            context(&rest, "Send my March invoice", 0),
            context(&rest, "Send my August invoice", 0)
        );
        assert_ne!(
            context(&rest, "How do I reset my password?", 0),
            context(&rest, "How do I not reset my password?", 0)
        );
    }
}
