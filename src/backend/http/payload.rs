//! The body kiln sends an upstream: the client's JSON object with `model`,
//! `stream` and `stream_options` set, written straight from the borrowed
//! object. The request path used to copy the client's whole body per
//! attempt and edit the copy twice; the bytes are the same (keys in the
//! object's order, which is sorted).

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value};

/// What becomes of a client's own `stream_options` on a streamed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOptions {
    /// Kept, with `include_usage` set; `stream` is written only when
    /// streaming or when the body had it (a direct caller of the backend).
    Merge,
    /// Replaced by `{"include_usage": true}` alone, and `stream` always
    /// written (the gateway: the usage is what kiln reads, and a client's
    /// other options would change the stream's shape under it).
    UsageOnly,
}

/// What is written for one of the keys kiln sets.
enum Key<T> {
    /// The client's value, if it sent one.
    Keep,
    Set(T),
    Remove,
}

struct Written<'a> {
    map: &'a Map<String, Value>,
    model: Key<&'a str>,
    stream: Key<bool>,
    stream_options: Key<Value>,
}

/// The keys kiln sets, in the object's (sorted) order.
const SET: [&str; 3] = ["model", "stream", "stream_options"];

impl Written<'_> {
    /// Writes key `i` of [`SET`] as kiln sets it, the client's value when
    /// kept (`client`), nothing when removed.
    fn entry<M: SerializeMap>(
        &self,
        m: &mut M,
        i: usize,
        client: Option<&Value>,
    ) -> Result<(), M::Error> {
        fn one<M: SerializeMap, T: Serialize>(
            m: &mut M,
            k: &str,
            key: &Key<T>,
            client: Option<&Value>,
        ) -> Result<(), M::Error> {
            match (key, client) {
                (Key::Set(v), _) => m.serialize_entry(k, v),
                (Key::Keep, Some(v)) => m.serialize_entry(k, v),
                _ => Ok(()),
            }
        }
        match i {
            0 => one(m, SET[0], &self.model, client),
            1 => one(m, SET[1], &self.stream, client),
            _ => one(m, SET[2], &self.stream_options, client),
        }
    }
}

impl Serialize for Written<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        let mut next = 0;
        for (k, v) in self.map {
            while next < SET.len() && SET[next] < k.as_str() {
                self.entry(&mut m, next, None)?;
                next += 1;
            }
            if next < SET.len() && SET[next] == k.as_str() {
                self.entry(&mut m, next, Some(v))?;
                next += 1;
                continue;
            }
            m.serialize_entry(k, v)?;
        }
        while next < SET.len() {
            self.entry(&mut m, next, None)?;
            next += 1;
        }
        m.end()
    }
}

/// The upstream's body: `body` (a JSON object) with `model` replaced by
/// `model` when given, `stream` set, and `stream_options` carrying
/// `include_usage` when streaming and removed otherwise (vLLM and OpenAI
/// refuse stream options without streaming).
pub fn write(
    body: &Value,
    model: Option<&str>,
    stream: bool,
    options: StreamOptions,
) -> Result<Vec<u8>, String> {
    let Value::Object(map) = body else {
        return Err("the body is not a JSON object".into());
    };
    let stream_options = if !stream {
        Key::Remove
    } else {
        let mut o = match (options, map.get("stream_options")) {
            (StreamOptions::Merge, Some(Value::Object(o))) => o.clone(),
            _ => Map::new(),
        };
        o.insert("include_usage".into(), Value::Bool(true));
        Key::Set(Value::Object(o))
    };
    let written = Written {
        map,
        model: model.map_or(Key::Keep, Key::Set),
        stream: if stream || options == StreamOptions::UsageOnly || map.contains_key("stream") {
            Key::Set(stream)
        } else {
            Key::Keep
        },
        stream_options,
    };
    serde_json::to_vec(&written).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The two edits the request path made before, on a copy: the
    /// gateway's (`UsageOnly`) then the backend's (both).
    fn before(
        body: &Value,
        model: Option<&str>,
        stream: bool,
        options: StreamOptions,
    ) -> Option<Vec<u8>> {
        let mut b = body.clone();
        if options == StreamOptions::UsageOnly {
            let obj = b.as_object_mut()?;
            if let Some(m) = model {
                obj.insert("model".into(), json!(m));
            }
            obj.insert("stream".into(), json!(stream));
            if stream {
                obj.insert("stream_options".into(), json!({"include_usage": true}));
            } else {
                obj.remove("stream_options");
            }
        }
        let Value::Object(mut map) = b else {
            return None;
        };
        if let Some(m) = model {
            map.insert("model".into(), Value::String(m.to_string()));
        }
        if stream {
            map.insert("stream".into(), Value::Bool(true));
            match map.get_mut("stream_options") {
                Some(Value::Object(options)) => {
                    options.insert("include_usage".into(), Value::Bool(true));
                }
                _ => {
                    let mut options = Map::new();
                    options.insert("include_usage".into(), Value::Bool(true));
                    map.insert("stream_options".into(), Value::Object(options));
                }
            }
        } else {
            if map.contains_key("stream") {
                map.insert("stream".into(), Value::Bool(false));
            }
            map.remove("stream_options");
        }
        serde_json::to_vec(&map).ok()
    }

    fn value() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|n| json!(n)),
            "[a-z \"\\\\é]{0,6}".prop_map(Value::String),
            (any::<bool>(), any::<u8>())
                .prop_map(|(u, n)| json!({"include_usage": u, "continuous_usage_stats": n})),
            Just(json!({})),
            Just(json!([1, {"b": null}])),
        ]
    }

    proptest! {
        /// Any object, any mix of the keys kiln sets (absent, of any type),
        /// either mode: the same bytes as the two edits on a copy.
        #[test]
        fn the_bytes_the_two_edits_gave(
            entries in proptest::collection::vec(
                (prop_oneof![
                    Just("model"), Just("stream"), Just("stream_options"), Just("stream_optionz"),
                    Just("messages"), Just("max_tokens"), Just("a"), Just("mod"), Just("zz"), Just("")
                ], value()),
                0..9,
            ),
            model in proptest::option::of("[a-z0-9-]{1,8}"),
            stream in any::<bool>(),
            usage_only in any::<bool>(),
        ) {
            let body = Value::Object(entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
            let options = if usage_only { StreamOptions::UsageOnly } else { StreamOptions::Merge };
            let got = write(&body, model.as_deref(), stream, options).ok();
            prop_assert_eq!(got, before(&body, model.as_deref(), stream, options));
        }
    }

    #[test]
    fn only_an_object_is_sent() {
        assert!(write(&json!([1]), None, false, StreamOptions::Merge).is_err());
        let b = json!({"model": "m", "stream_options": {"x": 1}, "stream": true});
        let got = write(&b, Some("served"), false, StreamOptions::UsageOnly).unwrap();
        assert_eq!(got, br#"{"model":"served","stream":false}"#);
        let got = write(&b, None, true, StreamOptions::Merge).unwrap();
        assert_eq!(
            got,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true,"x":1}}"#
        );
    }
}
