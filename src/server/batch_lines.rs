//! One line of a batch input file, checked the way the gateway checks a
//! request: `{"custom_id", "method": "POST", "url", "body"}` with a body
//! the endpoint accepts and a model the policy knows. A bad line is named
//! by its number and field, so the user can fix it in the file.

use super::openai::{Endpoint, GenerationRequest};
use serde_json::Value;

/// `custom_id`s longer than this are refused (they are copied into every
/// result line and index).
pub const MAX_CUSTOM_ID: usize = 512;

/// Why a line was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    /// 1-based, as editors count.
    pub line: u64,
    /// The JSON field at fault (`body.model`), or `line` for the whole.
    pub field: &'static str,
    pub message: String,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: `{}`: {}", self.line, self.field, self.message)
    }
}

/// A valid line: its id and endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Valid {
    pub custom_id: String,
    pub endpoint: Endpoint,
}

/// The endpoint a batch line or batch may name.
pub fn endpoint(url: &str) -> Option<Endpoint> {
    match url {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    }
}

/// Checks one line (`n` counts from 1). `known_model` says whether the
/// policy serves a model name.
pub fn line(text: &str, n: u64, known_model: &dyn Fn(&str) -> bool) -> Result<Valid, LineError> {
    let err = |field: &'static str, message: String| LineError {
        line: n,
        field,
        message,
    };
    let v: Value =
        serde_json::from_str(text).map_err(|e| err("line", format!("not valid JSON: {e}")))?;
    let Some(o) = v.as_object() else {
        return Err(err("line", "must be a JSON object".into()));
    };
    let custom_id = match o.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CUSTOM_ID => s.clone(),
        Some(Value::String(s)) if s.is_empty() => {
            return Err(err("custom_id", "must not be empty".into()))
        }
        Some(Value::String(_)) => {
            return Err(err(
                "custom_id",
                format!("is longer than {MAX_CUSTOM_ID} bytes"),
            ))
        }
        Some(_) => return Err(err("custom_id", "must be a string".into())),
        None => return Err(err("custom_id", "is missing".into())),
    };
    match o.get("method") {
        Some(Value::String(m)) if m == "POST" => {}
        Some(m) => return Err(err("method", format!("must be \"POST\", not {m}"))),
        None => return Err(err("method", "is missing (\"POST\")".into())),
    }
    let endpoint = match o.get("url") {
        Some(Value::String(u)) => endpoint(u).ok_or_else(|| {
            err(
                "url",
                format!(
                    "`{u}` is not a batch endpoint: use /v1/chat/completions or /v1/completions"
                ),
            )
        })?,
        Some(_) => return Err(err("url", "must be a string".into())),
        None => return Err(err("url", "is missing".into())),
    };
    let Some(body) = o.get("body") else {
        return Err(err("body", "is missing".into()));
    };
    let req = GenerationRequest::from_value(endpoint, body).map_err(|e| {
        let field = match e.param {
            Some("model") => "body.model",
            Some("messages") => "body.messages",
            Some("prompt") => "body.prompt",
            Some("n") => "body.n",
            Some("max_tokens") => "body.max_tokens",
            _ => "body",
        };
        err(field, e.message)
    })?;
    if req.streaming() {
        return Err(err(
            "body.stream",
            "batch items cannot stream: drop `stream` (results go to the output file)".into(),
        ));
    }
    if !known_model(&req.model) {
        return Err(err(
            "body.model",
            format!(
                "the policy serves no model `{}` (GET /v1/models lists them)",
                req.model
            ),
        ));
    }
    Ok(Valid {
        custom_id,
        endpoint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(m: &str) -> bool {
        m == "llama-3-8b"
    }

    fn check(text: &str) -> Result<Valid, LineError> {
        line(text, 7, &known)
    }

    #[test]
    fn a_good_line_passes() {
        let v = check(r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"llama-3-8b","messages":[{"role":"user","content":"hi"}]}}"#).unwrap();
        assert_eq!(v.custom_id, "a");
        assert_eq!(v.endpoint, Endpoint::Chat);
        let v = check(r#"{"custom_id":"b","method":"POST","url":"/v1/completions","body":{"model":"llama-3-8b","prompt":"hi","max_tokens":3}}"#).unwrap();
        assert_eq!(v.endpoint, Endpoint::Completions);
    }

    #[test]
    fn each_fault_names_its_field() {
        let cases = [
            ("{", "line"),
            ("[1]", "line"),
            (
                r#"{"method":"POST","url":"/v1/completions","body":{}}"#,
                "custom_id",
            ),
            (
                r#"{"custom_id":3,"method":"POST","url":"/v1/completions","body":{}}"#,
                "custom_id",
            ),
            (
                r#"{"custom_id":"","method":"POST","url":"/v1/completions","body":{}}"#,
                "custom_id",
            ),
            (
                r#"{"custom_id":"a","method":"GET","url":"/v1/completions","body":{}}"#,
                "method",
            ),
            (
                r#"{"custom_id":"a","url":"/v1/completions","body":{}}"#,
                "method",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/embeddings","body":{}}"#,
                "url",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions"}"#,
                "body",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"llama-3-8b"}}"#,
                "body.prompt",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"llama-3-8b","messages":[]}}"#,
                "body.messages",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"gpt-9","prompt":"x"}}"#,
                "body.model",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"llama-3-8b","prompt":"x","stream":true}}"#,
                "body.stream",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"llama-3-8b","prompt":"x","max_tokens":0}}"#,
                "body.max_tokens",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":"text"}"#,
                "body",
            ),
        ];
        for (text, field) in cases {
            let e = check(text).unwrap_err();
            assert_eq!(e.field, field, "{text}: {e}");
            assert_eq!(e.line, 7);
        }
        let long = format!(
            r#"{{"custom_id":"{}","method":"POST","url":"/v1/completions","body":{{}}}}"#,
            "x".repeat(MAX_CUSTOM_ID + 1)
        );
        assert_eq!(check(&long).unwrap_err().field, "custom_id");
    }

    proptest::proptest! {
        /// Whatever a line holds, checking it answers (no panic), and an
        /// error always names a line and a field.
        #[test]
        fn never_panics(s in ".{0,200}") {
            if let Err(e) = line(&s, 1, &known) {
                proptest::prop_assert_eq!(e.line, 1);
                proptest::prop_assert!(!e.field.is_empty());
            }
        }
    }
}
