//! The OpenAI wire format: what kiln reads from a request body, the error
//! object every failure answers with, and the prompt token count admission
//! uses (a real BPE tokenizer, cl100k_base, not a character heuristic).

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
        if !raw.is_object() {
            return Err(ApiError::bad_request(
                "the body must be a JSON object".into(),
                None,
            ));
        }
        // Deserialized from the parsed value by reference: no second parse,
        // no copy of the body.
        let req = GenerationRequest::deserialize(&raw)
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
        if req.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(
                "kiln serves n = 1 only; send separate requests".into(),
                Some("n"),
            ));
        }
        if req.max_tokens == Some(0) || req.max_completion_tokens == Some(0) {
            return Err(ApiError::bad_request(
                "`max_tokens` must be at least 1".into(),
                Some("max_tokens"),
            ));
        }
        Ok((req, raw))
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
}

impl Tokenizer {
    pub fn new() -> Result<Tokenizer, String> {
        Ok(Tokenizer {
            bpe: bpe_openai::cl100k_base(),
        })
    }

    pub fn count(&self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        self.bpe.count(text) as u64
    }

    pub fn prompt_tokens(&self, req: &GenerationRequest) -> u64 {
        if let Some(msgs) = &req.messages {
            let mut n = 3u64;
            for m in msgs {
                n += 3 + self.count(&m.role);
                if let Some(name) = &m.name {
                    n += 1 + self.count(name);
                }
                match &m.content {
                    Some(Content::Text(t)) => n += self.count(t),
                    Some(Content::Parts(parts)) => {
                        for p in parts {
                            match &p.text {
                                Some(t) => n += self.count(t),
                                // Images and audio: a flat estimate of what
                                // a vision model spends on a tile.
                                None if p.kind != "text" => n += 85,
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
            Some(Prompt::Text(t)) => self.count(t),
            Some(Prompt::Texts(ts)) => ts.iter().map(|t| self.count(t)).sum(),
            Some(Prompt::Tokens(t)) => t.len() as u64,
            Some(Prompt::TokenLists(ts)) => ts.iter().map(|t| t.len() as u64).sum(),
            None => 0,
        }
    }
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param",
/// "code"}}`, with the HTTP status and, for 429 and 503, Retry-After.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub code: Option<String>,
    pub param: Option<&'static str>,
    pub retry_after_s: Option<u64>,
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

    pub fn retry_after(mut self, secs: Option<u64>) -> ApiError {
        self.retry_after_s = secs;
        self
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert("retry-after", v);
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
