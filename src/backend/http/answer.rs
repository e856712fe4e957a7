//! An upstream's whole (non-streaming) answer, read only as deep as kiln
//! needs it.
//!
//! The gateway reads two things in an answer (its `usage` and its `model`,
//! which it rewrites) and forwards the rest as it came. Parsing every
//! choice into a `serde_json::Value` and printing it again was a tenth of
//! the gateway's own work per request (`benches/gateway.rs`); here only the
//! top-level keys are parsed, each value stays the upstream's exact text.

use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;

/// A JSON answer. An object (every OpenAI-shaped answer) keeps its
/// top-level members as raw text, in the order `serde_json::Value` prints
/// them (sorted), so the bytes a client gets are what printing the parsed
/// answer gave before; anything else stays as it came.
#[derive(Debug)]
pub enum Answer {
    Object(BTreeMap<String, Box<RawValue>>),
    Other(Box<RawValue>),
}

impl Answer {
    /// Parses an answer; `Err` when it is not JSON.
    pub fn parse(bytes: &[u8]) -> Result<Answer, serde_json::Error> {
        // One pass: an object's members are read as raw text at once.
        if bytes.trim_ascii_start().starts_with(b"{") {
            Ok(Answer::Object(serde_json::from_slice(bytes)?))
        } else {
            Ok(Answer::Other(serde_json::from_slice(bytes)?))
        }
    }

    /// `usage.completion_tokens`, 0 where it is missing or not a count.
    pub fn completion_tokens(&self) -> u64 {
        match self {
            // `usage` is small: read as a value, exactly as before.
            Answer::Object(m) => m
                .get("usage")
                .and_then(|u| serde_json::from_str::<Value>(u.get()).ok())
                .and_then(|u| u["completion_tokens"].as_u64())
                .unwrap_or(0),
            Answer::Other(_) => 0,
        }
    }

    /// Sets the top-level `model` (an object's; other answers have none).
    pub fn set_model(&mut self, model: &str) {
        if let Answer::Object(m) = self {
            if let Ok(v) = serde_json::value::to_raw_value(model) {
                m.insert("model".to_string(), v);
            }
        }
    }

    /// The answer as JSON text.
    pub fn to_vec(&self) -> Vec<u8> {
        let printed = match self {
            Answer::Object(m) => serde_json::to_vec(m),
            Answer::Other(r) => Ok(r.get().as_bytes().to_vec()),
        };
        // Raw values are valid JSON and keys are strings: printing cannot
        // fail, but an empty object is what a failure would leave.
        printed.unwrap_or_else(|_| b"{}".to_vec())
    }

    /// The answer parsed in full, for the few readers that walk it (the
    /// exact cache, an SSE event).
    pub fn to_value(&self) -> Value {
        serde_json::from_slice(&self.to_vec()).unwrap_or(Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn reads_usage_and_rewrites_the_model() {
        let text = br#"{"id":"c1","model":"served","choices":[{"index":0,"message":{"role":"assistant","content":"hi \u00e9"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
        let mut a = Answer::parse(text).unwrap();
        assert_eq!(a.completion_tokens(), 7);
        a.set_model("asked");
        let v: Value = serde_json::from_slice(&a.to_vec()).unwrap();
        assert_eq!(v["model"], "asked");
        assert_eq!(v["choices"][0]["message"]["content"], "hi é");
        assert_eq!(v["usage"]["total_tokens"], 12);
    }

    #[test]
    fn answers_that_are_not_objects_pass_as_they_came() {
        for text in [&b"[1, 2]"[..], b"\"x\"", b"null", b"3.5"] {
            let mut a = Answer::parse(text).unwrap();
            a.set_model("m");
            assert_eq!(a.completion_tokens(), 0);
            assert_eq!(a.to_value(), serde_json::from_slice::<Value>(text).unwrap());
        }
        assert!(Answer::parse(b"{\"a\":").is_err());
        assert!(Answer::parse(b"not json").is_err());
    }

    #[test]
    fn a_missing_or_odd_usage_counts_zero() {
        for text in [
            &br#"{"choices":[]}"#[..],
            br#"{"usage":null}"#,
            br#"{"usage":{"completion_tokens":"7"}}"#,
            br#"{"usage":{"completion_tokens":-1}}"#,
            br#"{"usage":[1]}"#,
            br#"{"usage":{"completion_tokens":7.0}}"#,
        ] {
            assert_eq!(Answer::parse(text).unwrap().completion_tokens(), 0);
        }
    }

    fn json_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            (-1e12f64..1e12).prop_map(|f| json!(f)),
            ".{0,12}".prop_map(Value::String),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        json_leaf().prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(".{0,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever an upstream answers, the client gets the JSON that
        /// parsing it into a `Value`, setting `model` and printing it gave;
        /// for a compact answer (what engines send), the same bytes.
        #[test]
        fn the_answer_the_parsed_value_gave(v in json_value(), model in ".{0,8}", pretty: bool) {
            let text = if pretty {
                serde_json::to_vec_pretty(&v).unwrap()
            } else {
                serde_json::to_vec(&v).unwrap()
            };
            let mut a = Answer::parse(&text).unwrap();
            a.set_model(&model);
            let mut expect = v.clone();
            if let Some(o) = expect.as_object_mut() {
                o.insert("model".into(), json!(model));
            }
            prop_assert_eq!(a.to_value(), expect.clone());
            if !pretty {
                prop_assert_eq!(a.to_vec(), serde_json::to_vec(&expect).unwrap());
            }
            let tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            prop_assert_eq!(a.completion_tokens(), tokens);
        }
    }
}
