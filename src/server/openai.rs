//! The OpenAI wire format: what kiln reads from a request body, the error
//! object every failure answers with, and the prompt token count admission
//! uses (a real BPE tokenizer, cl100k_base, not a character heuristic).

use super::prefix::{self, PrefixTokens};
use crate::sched::replica::BLOCK_TOKENS;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

/// The two generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    pub fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }
}

/// What kiln needs from a request body; everything else is passed through
/// to HTTP upstreams untouched.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerationRequest {
    pub model: String,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    pub prompt: Option<Prompt>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub n: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl GenerationRequest {
    /// Parses and checks the body for `endpoint`; a malformed body is a
    /// 400 that names the problem.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<(GenerationRequest, Value), ApiError> {
        let raw: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}"), None))?;
        let req = GenerationRequest::from_value(endpoint, &raw)?;
        Ok((req, raw))
    }

    /// Checks a parsed body as [`Self::parse`] does (batch lines are parsed
    /// once, as whole lines).
    pub fn from_value(endpoint: Endpoint, raw: &Value) -> Result<GenerationRequest, ApiError> {
        if !raw.is_object() {
            return Err(ApiError::bad_request(
                "the body must be a JSON object".into(),
                None,
            ));
        }
        // Deserialized from the parsed value by reference: no second parse,
        // no copy of the body.
        let req = GenerationRequest::deserialize(raw)
            .map_err(|e| ApiError::bad_request(format!("invalid request: {e}"), None))?;
        if req.model.trim().is_empty() {
            return Err(ApiError::bad_request(
                "`model` must name a model (GET /v1/models lists them)".into(),
                Some("model"),
            ));
        }
        match endpoint {
            Endpoint::Chat => match &req.messages {
                Some(m) if !m.is_empty() => {}
                _ => {
                    return Err(ApiError::bad_request(
                        "`messages` must be a non-empty array".into(),
                        Some("messages"),
                    ))
                }
            },
            Endpoint::Completions => {
                if req.prompt.is_none() {
                    return Err(ApiError::bad_request(
                        "`prompt` is required".into(),
                        Some("prompt"),
                    ));
                }
            }
        }
        // `n` above 1 is the backend's to honour or refuse
        // (`surface::unsupported_field`); 0 is no request.
        if req.n == Some(0) {
            return Err(ApiError::bad_request(
                "`n` must be at least 1".into(),
                Some("n"),
            ));
        }
        if req.max_tokens == Some(0) || req.max_completion_tokens == Some(0) {
            return Err(ApiError::bad_request(
                "`max_tokens` must be at least 1".into(),
                Some("max_tokens"),
            ));
        }
        Ok(req)
    }

    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    pub fn requested_max_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// Counts prompt tokens with cl100k_base (GitHub's linear-time BPE, exact
/// to tiktoken's counts and several times faster, which matters because
/// every request is counted on the request path). Chat follows OpenAI's
/// accounting: each message costs its content and name plus 3 tokens of
/// framing, and the reply is primed with 3 more.
#[derive(Clone, Copy)]
pub struct Tokenizer {
    bpe: &'static bpe_openai::Tokenizer,
    whole: &'static WholeTokens,
}

/// Every token of the vocabulary by its bytes. A pre-tokenized piece that
/// is itself one token encodes to that token (tiktoken's own fast path;
/// `every_token_encodes_to_itself` checks it for the whole vocabulary), so
/// most words of a prompt need no encoder, which allocates twice a piece.
type WholeTokens = rustc_hash::FxHashMap<&'static [u8], u32>;

fn whole_tokens(bpe: &'static bpe_openai::Tokenizer) -> &'static WholeTokens {
    static WHOLE: std::sync::OnceLock<WholeTokens> = std::sync::OnceLock::new();
    WHOLE.get_or_init(|| {
        let n = bpe.bpe.num_tokens();
        let mut m = WholeTokens::with_capacity_and_hasher(n, Default::default());
        for id in 0..n as u32 {
            m.insert(bpe.bpe.token_bytes(id), id);
        }
        m
    })
}

impl Tokenizer {
    /// Built once at start (the vocabulary's lookup table, ~100k tokens),
    /// so no request pays for it.
    pub fn new() -> Result<Tokenizer, String> {
        let bpe = bpe_openai::cl100k_base();
        Ok(Tokenizer {
            bpe,
            whole: whole_tokens(bpe),
        })
    }

    pub fn count(&self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        let mut n = 0;
        self.pieces(text, |piece| n += self.count_piece(piece.as_bytes()));
        n
    }

    /// Calls `f` with each pre-tokenized piece of `text`: ASCII text by
    /// [`super::pretokenize`] (cl100k_base's pattern by hand), other text
    /// by the tokenizer's own regex.
    fn pieces(&self, text: &str, f: impl FnMut(&str)) {
        let norm = self.bpe.normalize(text);
        let norm = norm.as_str();
        if norm.is_ascii() {
            super::pretokenize::ascii_pieces(norm, f);
        } else {
            self.bpe.split(norm).for_each(f);
        }
    }

    /// One pre-tokenized piece's token count, as the encoder gives it.
    fn count_piece(&self, bytes: &[u8]) -> u64 {
        if self.whole.contains_key(bytes) {
            1
        } else {
            self.bpe.bpe.count(bytes) as u64
        }
    }

    pub fn prompt_tokens(&self, req: &GenerationRequest) -> u64 {
        self.prompt(req, 0).count
    }

    /// Counts the prompt and, in the same pass, hashes its leading tokens
    /// (at most `max_blocks` blocks) into prefix blocks
    /// ([`super::prefix`]). Chat messages are tokenized in order, each as
    /// a message mark, its role (and name), a content mark and its text,
    /// so a shared system prompt or conversation gives shared leading
    /// blocks; a prompt given as tokens is used as it is. Nothing after an
    /// image or other non-text part is hashed (its tokens are not known).
    pub fn prompt(&self, req: &GenerationRequest, max_blocks: usize) -> PromptTokens {
        let cap = max_blocks
            .min(prefix::MAX_PREFIX_BLOCKS)
            .saturating_mul(BLOCK_TOKENS as usize);
        let mut keep = PrefixTokens::new(cap);
        let count = self.count_prompt(req, &mut keep);
        PromptTokens {
            count,
            prefix_blocks: keep.blocks(),
        }
    }

    fn count_prompt(&self, req: &GenerationRequest, keep: &mut PrefixTokens) -> u64 {
        if let Some(msgs) = &req.messages {
            let mut n = 3u64;
            for m in msgs {
                keep.push(&[prefix::MESSAGE_MARK]);
                n += 3 + self.count_into(&m.role, keep);
                if let Some(name) = &m.name {
                    n += 1 + self.count_into(name, keep);
                }
                keep.push(&[prefix::CONTENT_MARK]);
                match &m.content {
                    Some(Content::Text(t)) => n += self.count_into(t, keep),
                    Some(Content::Parts(parts)) => {
                        for p in parts {
                            match &p.text {
                                Some(t) => n += self.count_into(t, keep),
                                // Images and audio: a flat estimate of what
                                // a vision model spends on a tile.
                                None if p.kind != "text" => {
                                    keep.close();
                                    n += 85
                                }
                                None => {}
                            }
                        }
                    }
                    None => {}
                }
            }
            return n;
        }
        match &req.prompt {
            Some(Prompt::Text(t)) => self.count_into(t, keep),
            Some(Prompt::Texts(ts)) => ts.iter().map(|t| self.count_into(t, keep)).sum(),
            Some(Prompt::Tokens(t)) => {
                keep.push(t);
                t.len() as u64
            }
            Some(Prompt::TokenLists(ts)) => ts
                .iter()
                .map(|t| {
                    keep.push(t);
                    t.len() as u64
                })
                .sum(),
            None => 0,
        }
    }

    /// Counts `text`, keeping its leading tokens in `keep` while it wants
    /// them: one pass over the pre-tokenized pieces, each encoded (while
    /// tokens are kept) or only counted (after), so hashing costs no
    /// second tokenization. A piece longer than [`MAX_PIECE_BYTES`] (a
    /// run of one character, never real text) is counted and ends what is
    /// kept, so no allocation grows with a hostile prompt.
    fn count_into(&self, text: &str, keep: &mut PrefixTokens) -> u64 {
        if text.is_empty() {
            return 0;
        }
        if !keep.wants() {
            return self.count(text);
        }
        let mut n = 0u64;
        self.pieces(text, |piece| {
            let bytes = piece.as_bytes();
            if let Some(&t) = self.whole.get(bytes) {
                n += 1;
                if keep.wants() {
                    keep.push(&[t]);
                }
            } else if keep.wants() && bytes.len() <= MAX_PIECE_BYTES {
                let t = self.bpe.bpe.encode_via_backtracking(bytes);
                n += t.len() as u64;
                keep.push(&t);
            } else {
                if bytes.len() > MAX_PIECE_BYTES {
                    keep.close();
                }
                // Not a whole token (looked up above): the encoder counts it.
                n += self.bpe.bpe.count(bytes) as u64;
            }
        });
        n
    }
}

/// The longest pre-tokenized piece whose tokens are kept for prefix
/// hashing.
const MAX_PIECE_BYTES: usize = 4096;

/// A prompt's token count and its prefix blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptTokens {
    pub count: u64,
    pub prefix_blocks: Vec<u64>,
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param",
/// "code"}}`, with the HTTP status and, for 429 and 503, Retry-After.
/// `code` is never `null`: without a specific one the status gives it
/// ([`default_code`]). A refusal of a request kiln recorded also carries
/// `x-kiln-request-id`, `x-kiln-explain` and, where a policy was
/// consulted, `x-kiln-policy-version`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub code: Option<String>,
    pub param: Option<&'static str>,
    pub retry_after_s: Option<u64>,
    /// The request it answers, where kiln recorded one (boxed: most
    /// errors are built and dropped on paths that never set it).
    pub recorded: Option<Box<Recorded>>,
    /// More response headers (a quota refusal's `x-ratelimit-*`; boxed
    /// like `recorded`, to keep the error small).
    pub headers: Option<Box<Vec<(&'static str, String)>>>,
}

/// The request a refusal answers, as its headers name it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Recorded {
    /// `x-kiln-request-id`.
    pub id: String,
    /// Whether `/admin/explain/{id}` holds an entry for it
    /// (`x-kiln-explain`).
    pub explained: bool,
    /// The policy version consulted (`x-kiln-policy-version`).
    pub policy_version: Option<String>,
}

/// The code an error without a more specific one answers with: what its
/// status means, in OpenAI's vocabulary where it has a word for it.
pub fn default_code(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "invalid_api_key",
        403 => "permission_denied",
        404 => "not_found",
        405 => "method_not_allowed",
        408 => "request_timeout",
        409 => "conflict",
        411 => "length_required",
        413 => "request_too_large",
        415 => "unsupported_media_type",
        422 => "unprocessable_entity",
        429 => "rate_limit_exceeded",
        431 => "request_header_fields_too_large",
        501 => "not_implemented",
        502 => "upstream_error",
        503 => "service_unavailable",
        504 => "timeout",
        _ if status >= 500 => "internal_error",
        _ => "invalid_request_error",
    }
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        let kind = match status {
            400 | 404 | 405 | 408 | 411 | 413 | 415 | 422 | 431 => "invalid_request_error",
            401 | 403 => "authentication_error",
            429 => "rate_limit_exceeded",
            503 => "service_unavailable",
            504 => "timeout",
            _ => "api_error",
        };
        ApiError {
            status,
            message: message.into(),
            kind,
            code: None,
            param: None,
            retry_after_s: None,
            recorded: None,
            headers: None,
        }
    }

    pub fn bad_request(message: String, param: Option<&'static str>) -> ApiError {
        ApiError {
            param,
            ..ApiError::new(400, message)
        }
    }

    pub fn code(mut self, code: impl Into<String>) -> ApiError {
        self.code = Some(code.into());
        self
    }

    /// Adds response headers (sent with the error).
    pub fn with_headers(mut self, headers: Vec<(&'static str, String)>) -> ApiError {
        if !headers.is_empty() {
            self.headers
                .get_or_insert_with(Default::default)
                .extend(headers);
        }
        self
    }

    pub fn retry_after(mut self, secs: Option<u64>) -> ApiError {
        self.retry_after_s = secs;
        self
    }

    /// Names the request this error answers (and, when `explained`, the
    /// explain entry that records it); an id already set is kept.
    pub fn for_request(mut self, id: &str, explained: bool) -> ApiError {
        if self.recorded.is_none() {
            self.recorded = Some(Box::new(Recorded {
                id: id.to_string(),
                explained,
                policy_version: None,
            }));
        }
        self
    }

    /// The version consulted, on an error [`ApiError::for_request`] named.
    pub fn policy_version(mut self, v: Option<&str>) -> ApiError {
        if let Some(r) = self.recorded.as_mut() {
            if r.policy_version.is_none() {
                r.policy_version = v.map(str::to_string);
            }
        }
        self
    }

    pub fn code_or_default(&self) -> &str {
        self.code
            .as_deref()
            .unwrap_or_else(|| default_code(self.status))
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code_or_default(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.body())).into_response();
        let h = resp.headers_mut();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                h.insert("retry-after", v);
            }
        }
        for (k, v) in self.headers.iter().flat_map(|h| h.iter()) {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(*k, v);
            }
        }
        if let Some(r) = &self.recorded {
            if let Ok(v) = HeaderValue::from_str(&r.id) {
                h.insert("x-kiln-request-id", v);
            }
            if r.explained {
                if let Ok(v) = HeaderValue::from_str(&format!("/admin/explain/{}", r.id)) {
                    h.insert("x-kiln-explain", v);
                }
            }
            if let Some(pv) = r.policy_version.as_deref() {
                if let Ok(v) = HeaderValue::from_str(pv) {
                    h.insert("x-kiln-policy-version", v);
                }
            }
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_needs_messages_and_model() {
        let e = GenerationRequest::parse(Endpoint::Chat, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!((e.status, e.param), (400, Some("messages")));
        let e = GenerationRequest::parse(Endpoint::Chat, br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.status, 400);
        let e = GenerationRequest::parse(Endpoint::Chat, b"{nope").unwrap_err();
        assert!(e.message.contains("not valid JSON"));
        let e = GenerationRequest::parse(Endpoint::Chat, b"[1]").unwrap_err();
        assert!(e.message.contains("JSON object"));
    }

    #[test]
    fn tokens_are_counted_with_bpe() {
        let t = Tokenizer::new().unwrap();
        assert_eq!(t.count("hello world"), 2);
        let (r, _) = GenerationRequest::parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hello world"}]}"#,
        )
        .unwrap();
        // 3 priming + 3 framing + "user" (1) + "hello world" (2)
        assert_eq!(t.prompt_tokens(&r), 9);
        let (r, _) = GenerationRequest::parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":[1,2,3,4]}"#,
        )
        .unwrap();
        assert_eq!(t.prompt_tokens(&r), 4);
    }

    fn chat(system: &str, user: &str) -> GenerationRequest {
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
        });
        GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
            .unwrap()
            .0
    }

    fn words(n: usize, salt: &str) -> String {
        (0..n)
            .map(|i| format!("{salt}{} ", i * 7919 % 1000))
            .collect()
    }

    #[test]
    fn prefix_blocks_come_from_the_same_pass_that_counts() {
        let t = Tokenizer::new().unwrap();
        let r = chat(&words(3000, "w"), &words(500, "q"));
        let p = t.prompt(&r, usize::MAX);
        // Counting with and without keeping tokens agrees, and with
        // tiktoken's tokenization: the kept tokens are the encoding.
        assert_eq!(p.count, t.prompt_tokens(&r));
        let mut keep = PrefixTokens::new(usize::MAX);
        let n = t.count_into(&words(3000, "w"), &mut keep);
        assert_eq!(keep.tokens(), t.bpe.encode(words(3000, "w").as_str()));
        assert_eq!(n, t.count(&words(3000, "w")));
        assert!(p.prefix_blocks.len() >= 5, "{}", p.prefix_blocks.len());
        assert!(p.prefix_blocks.len() as u64 <= p.count / u64::from(BLOCK_TOKENS));
        // Capped by the caller.
        assert_eq!(t.prompt(&r, 2).prefix_blocks, p.prefix_blocks[..2]);
        assert!(t.prompt(&r, 0).prefix_blocks.is_empty());
    }

    /// The fast path's premise, for the whole vocabulary: a piece that is
    /// one token's bytes encodes to that token alone.
    #[test]
    fn every_token_encodes_to_itself() {
        let t = Tokenizer::new().unwrap();
        let bpe = &t.bpe.bpe;
        let mut wrong = Vec::new();
        for id in 0..bpe.num_tokens() as u32 {
            let got = bpe.encode_via_backtracking(bpe.token_bytes(id));
            if got != [id] {
                wrong.push((id, got));
            }
        }
        assert!(
            wrong.is_empty(),
            "{} tokens: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
        assert_eq!(t.whole.len(), bpe.num_tokens());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// Counting and keeping tokens with the fast path give the
        /// encoder's own count and tokens, on any text (words, numbers,
        /// runs, punctuation, whitespace, other scripts).
        #[test]
        fn counts_and_tokens_are_the_encoders(
            text in "([a-zA-Z]{1,12}|[0-9]{1,6}|[ \\t\\n]{1,3}|[.,!?'\"()-]{1,3}|[\\u{400}-\\u{4ff}\\u{4e00}-\\u{4e40}\\u{1f600}-\\u{1f610}]{1,4}|x{20,60}){0,40}"
        ) {
            let t = Tokenizer::new().unwrap();
            let want = t.bpe.encode(text.as_str());
            proptest::prop_assert_eq!(t.count(&text), t.bpe.count(text.as_str()) as u64);
            proptest::prop_assert_eq!(t.count(&text), want.len() as u64);
            let mut keep = PrefixTokens::new(usize::MAX);
            let n = t.count_into(&text, &mut keep);
            proptest::prop_assert_eq!(n, want.len() as u64);
            proptest::prop_assert_eq!(keep.tokens(), want);
        }
    }

    #[test]
    fn a_shared_system_prompt_gives_shared_leading_blocks() {
        let t = Tokenizer::new().unwrap();
        let sys = words(2000, "s");
        let a = t.prompt(&chat(&sys, &words(1500, "a")), usize::MAX);
        let b = t.prompt(&chat(&sys, &words(1500, "b")), usize::MAX);
        let c = t.prompt(&chat(&words(2000, "z"), &words(1500, "a")), usize::MAX);
        let shared = a
            .prefix_blocks
            .iter()
            .zip(&b.prefix_blocks)
            .take_while(|(x, y)| x == y)
            .count();
        // The system prompt's whole blocks are shared, the user turns not.
        assert!(shared >= 2, "{shared}");
        assert!(shared < a.prefix_blocks.len());
        assert_ne!(a.prefix_blocks[0], c.prefix_blocks[0]);
        // The role is part of the prefix: the same text as a user message
        // is another prompt.
        let body = json!({"model": "m", "messages": [{"role": "user", "content": sys}]});
        let (u, _) = GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
        assert_ne!(
            t.prompt(&u, usize::MAX).prefix_blocks[0],
            a.prefix_blocks[0]
        );
    }

    #[test]
    fn token_prompts_are_hashed_as_given_and_images_end_the_prefix() {
        let t = Tokenizer::new().unwrap();
        let toks: Vec<u32> = (0..1500).collect();
        let body = json!({"model": "m", "prompt": toks});
        let (r, _) =
            GenerationRequest::parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        assert_eq!(t.prompt(&r, usize::MAX).prefix_blocks, prefix::chain(&toks));
        let body = json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url"},
            {"type": "text", "text": words(2000, "x")},
        ]}]});
        let (r, _) = GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
        let p = t.prompt(&r, usize::MAX);
        assert!(p.prefix_blocks.is_empty());
        assert_eq!(p.count, t.prompt_tokens(&r));
    }

    #[test]
    fn a_hostile_prompt_keeps_a_bounded_prefix() {
        let t = Tokenizer::new().unwrap();
        // One 1 MiB piece: counted, not kept.
        let body = json!({"model": "m", "prompt": "a".repeat(1 << 20)});
        let (r, _) =
            GenerationRequest::parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        let p = t.prompt(&r, usize::MAX);
        assert!(p.prefix_blocks.is_empty());
        assert_eq!(p.count, t.prompt_tokens(&r));
        // Many tokens: at most MAX_PREFIX_BLOCKS blocks.
        let toks = vec![5u32; (prefix::MAX_PREFIX_BLOCKS + 3) * BLOCK_TOKENS as usize];
        let body = json!({"model": "m", "prompt": toks});
        let (r, _) =
            GenerationRequest::parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        let p = t.prompt(&r, usize::MAX);
        assert_eq!(p.prefix_blocks.len(), prefix::MAX_PREFIX_BLOCKS);
        assert_eq!(p.count, toks.len() as u64);
    }

    #[test]
    fn a_code_is_never_null_and_a_recorded_refusal_names_itself() {
        for status in [
            400, 401, 403, 404, 405, 408, 413, 429, 431, 500, 502, 503, 504, 418,
        ] {
            let b = ApiError::new(status, "x").body();
            assert!(b["error"]["code"].is_string(), "{status}: {b}");
        }
        assert_eq!(
            ApiError::new(413, "x").body()["error"]["code"],
            "request_too_large"
        );
        // A specific code wins over the status's.
        assert_eq!(
            ApiError::new(404, "x").code("model_not_found").body()["error"]["code"],
            "model_not_found"
        );
        let r = ApiError::new(429, "slow down")
            .for_request("abc-7", true)
            .policy_version(Some("sha256:1"))
            // A second id does not replace the first.
            .for_request("other", false)
            .into_response();
        let h = r.headers();
        assert_eq!(h["x-kiln-request-id"], "abc-7");
        assert_eq!(h["x-kiln-explain"], "/admin/explain/abc-7");
        assert_eq!(h["x-kiln-policy-version"], "sha256:1");
        let r = ApiError::new(401, "no")
            .for_request("abc-8", false)
            .into_response();
        assert!(!r.headers().contains_key("x-kiln-explain"));
        assert!(!r.headers().contains_key("x-kiln-policy-version"));
    }

    #[test]
    fn error_shape_is_openai() {
        let e = ApiError::new(429, "slow down")
            .retry_after(Some(3))
            .code("quota");
        let b = e.body();
        assert_eq!(b["error"]["type"], "rate_limit_exceeded");
        assert_eq!(b["error"]["code"], "quota");
        let r = e.into_response();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "3");
    }
}
