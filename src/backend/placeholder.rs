//! What the simulated backend answers in place of a model: placeholder
//! text that honours `stop`, JSON of the shape `response_format` asks for,
//! and a tool call when `tool_choice` demands one. Simulation, not
//! generation: the values are placeholders, their shape is the request's.
//! Pure functions of the request body.

use serde_json::{json, Map, Value};

/// How the simulator answers one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Placeholder {
    /// The placeholder words, cut before the first `stop` sequence.
    Text { stop: Vec<String> },
    /// A JSON text (`response_format` json_object or json_schema).
    Json(String),
    /// One call of a tool (`tool_choice` required or a named function).
    ToolCall { name: String, arguments: String },
}

/// Why a request's tool or format fields cannot be answered even in
/// simulation: the parameter and what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub param: &'static str,
    pub message: String,
}

/// The answer `body` asks for (`chat`: the chat endpoint; tools and
/// response formats are chat's only).
pub fn plan(chat: bool, body: &Value) -> Result<Placeholder, Refusal> {
    if chat {
        if let Some(call) = tool_call(body)? {
            return Ok(call);
        }
        if let Some(j) = json_format(body)? {
            return Ok(Placeholder::Json(j));
        }
    }
    Ok(Placeholder::Text { stop: stops(body) })
}

/// One simulated answer as its tokens arrive: the text each token adds
/// (placeholder words up to a stop sequence, or the JSON answer a few
/// characters a token), what is left at the end, and why it finished.
#[derive(Debug, Clone)]
pub struct Render {
    plan: Placeholder,
    text: String,
    sent: usize,
    stopped: bool,
}

/// Characters of a JSON answer written per simulated token.
const JSON_CHARS_PER_TOKEN: usize = 4;

impl Render {
    pub fn new(plan: Placeholder) -> Render {
        Render {
            plan,
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// The text to send for one more simulated token whose placeholder
    /// word is `word` (empty when nothing can be sent yet).
    pub fn token(&mut self, word: &str) -> String {
        match &self.plan {
            Placeholder::Text { stop } => {
                if self.stopped {
                    return String::new();
                }
                self.text.push_str(word);
                if let Some(i) = stop_at(&self.text, stop) {
                    self.stopped = true;
                    let out = self
                        .text
                        .get(self.sent..i.max(self.sent))
                        .unwrap_or("")
                        .to_string();
                    self.text.truncate(i.max(self.sent));
                    self.sent = self.text.len();
                    return out;
                }
                // Hold back what may be the start of a stop sequence.
                let hold = stop
                    .iter()
                    .map(|s| {
                        (1..s.len().min(self.text.len() + 1))
                            .rev()
                            .find(|&k| s.get(..k).is_some_and(|p| self.text.ends_with(p)))
                            .unwrap_or(0)
                    })
                    .max()
                    .unwrap_or(0);
                let safe = self.text.len() - hold;
                let out = self.text.get(self.sent..safe).unwrap_or("").to_string();
                if !out.is_empty() {
                    self.sent = safe;
                }
                out
            }
            Placeholder::Json(j) => {
                let end = (self.sent + JSON_CHARS_PER_TOKEN).min(j.len());
                let end = (end..=j.len())
                    .find(|&e| j.is_char_boundary(e))
                    .unwrap_or(j.len());
                let out = j.get(self.sent..end).unwrap_or("").to_string();
                self.sent = end;
                out
            }
            Placeholder::ToolCall { .. } => String::new(),
        }
    }

    /// The text left to send when the simulated tokens end.
    pub fn end(&mut self) -> String {
        let all = match &self.plan {
            Placeholder::Text { .. } => self.text.as_str(),
            Placeholder::Json(j) => j.as_str(),
            Placeholder::ToolCall { .. } => "",
        };
        let out = all.get(self.sent..).unwrap_or("").to_string();
        self.sent = all.len();
        out
    }

    /// `finish_reason`: `stop` at a stop sequence or after a JSON answer,
    /// `tool_calls` for a tool call, else `length` (the simulator writes
    /// until `max_tokens`).
    pub fn finish_reason(&self) -> &'static str {
        match &self.plan {
            Placeholder::Text { .. } if self.stopped => "stop",
            Placeholder::Text { .. } => "length",
            Placeholder::Json(_) => "stop",
            Placeholder::ToolCall { .. } => "tool_calls",
        }
    }

    /// The answer's `tool_calls` (OpenAI's shape, with `index` for a
    /// stream's delta), if it calls a tool.
    pub fn tool_calls(&self, id: &str, delta: bool) -> Option<Value> {
        let Placeholder::ToolCall { name, arguments } = &self.plan else {
            return None;
        };
        let mut call = json!({
            "id": format!("call_{id}"),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        if delta {
            if let Some(o) = call.as_object_mut() {
                o.insert("index".into(), json!(0));
            }
        }
        Some(json!([call]))
    }
}

/// `stop`: a string or a list of strings (empty ones ignored).
pub fn stops(body: &Value) -> Vec<String> {
    match body.get("stop") {
        Some(Value::String(s)) if !s.is_empty() => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    }
}

/// Where the first stop sequence begins in `text`, if any.
pub fn stop_at(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

fn tool_call(body: &Value) -> Result<Option<Placeholder>, Refusal> {
    let tools: Vec<&Value> = body
        .get("tools")
        .and_then(Value::as_array)
        .map(|t| t.iter().collect())
        .unwrap_or_default();
    let choice = body.get("tool_choice").filter(|v| !v.is_null());
    let named = choice
        .and_then(|c| c.get("function"))
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str);
    let demanded = match choice {
        Some(Value::String(s)) if s == "required" => true,
        Some(Value::String(s)) if s == "auto" || s == "none" => false,
        Some(Value::String(s)) => {
            return Err(Refusal {
                param: "tool_choice",
                message: format!(
                    "`tool_choice` \"{}\" is not one of \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": …}}}}",
                    s.chars().take(40).collect::<String>()
                ),
            })
        }
        Some(_) if named.is_some() => true,
        Some(_) => {
            return Err(Refusal {
                param: "tool_choice",
                message: "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}".into(),
            })
        }
        None => false,
    };
    if !demanded {
        return Ok(None);
    }
    let function = |t: &&Value| t.get("function").cloned().unwrap_or(Value::Null);
    let pick = match named {
        Some(n) => tools
            .iter()
            .map(function)
            .find(|f| f.get("name").and_then(Value::as_str) == Some(n)),
        None => tools.first().map(function),
    };
    let Some(f) = pick else {
        return Err(Refusal {
            param: "tool_choice",
            message: match named {
                Some(n) => format!(
                    "`tool_choice` names function `{}`, which `tools` does not list",
                    n.chars().take(64).collect::<String>()
                ),
                None => "`tool_choice` \"required\" needs at least one tool in `tools`".into(),
            },
        });
    };
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("tool")
        .to_string();
    let schema = f.get("parameters").cloned().unwrap_or(json!({}));
    let args = example(&schema, &schema, 0);
    // Arguments are always a JSON object.
    let args = if args.is_object() { args } else { json!({}) };
    Ok(Some(Placeholder::ToolCall {
        name,
        arguments: args.to_string(),
    }))
}

fn json_format(body: &Value) -> Result<Option<String>, Refusal> {
    let Some(rf) = body.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match rf.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(
            json!({"simulated": true, "text": "simulated output from kiln's roofline GPU model"})
                .to_string(),
        )),
        Some("json_schema") => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .cloned()
                .unwrap_or(json!({"type": "object"}));
            Ok(Some(example(&schema, &schema, 0).to_string()))
        }
        Some(other) => Err(Refusal {
            param: "response_format",
            message: format!(
                "`response_format` type \"{}\" is not one of \"text\", \"json_object\", \"json_schema\"",
                other.chars().take(40).collect::<String>()
            ),
        }),
    }
}

/// Deepest nesting followed through a schema; past it a value is `null`
/// (a recursive schema's placeholder ends there).
const MAX_DEPTH: usize = 12;

/// A placeholder value valid against `schema` for the common shapes:
/// types, `required` and all listed properties, `enum`, `const`,
/// `anyOf`/`oneOf`/`allOf` (the first), local `$ref`s (`#/$defs/…`,
/// `#/definitions/…`), lengths and bounds. Patterns are not followed.
pub fn example(schema: &Value, root: &Value, depth: usize) -> Value {
    let mut budget = MAX_VALUES;
    gen(schema, root, depth, &mut budget)
}

/// Values one placeholder may hold at most: a schema of nested arrays must
/// not grow an answer without bound (past it, `null`).
const MAX_VALUES: usize = 4096;

fn gen(schema: &Value, root: &Value, depth: usize, budget: &mut usize) -> Value {
    if depth > MAX_DEPTH || *budget == 0 {
        return Value::Null;
    }
    *budget -= 1;
    let Some(s) = schema.as_object() else {
        // `true` or a non-schema: anything goes.
        return json!("simulated");
    };
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        return match resolve(root, r) {
            Some(target) => gen(target, root, depth + 1, budget),
            None => Value::Null,
        };
    }
    if let Some(c) = s.get("const") {
        return c.clone();
    }
    if let Some(e) = s
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return e.clone();
    }
    for k in ["anyOf", "oneOf"] {
        if let Some(first) = s.get(k).and_then(Value::as_array).and_then(|a| {
            // Prefer a branch that is not `null`.
            a.iter()
                .find(|b| b.get("type").and_then(Value::as_str) != Some("null"))
                .or_else(|| a.first())
        }) {
            return gen(first, root, depth + 1, budget);
        }
    }
    if let Some(all) = s.get("allOf").and_then(Value::as_array) {
        let mut merged = Map::new();
        for part in all {
            match gen(part, root, depth + 1, budget) {
                Value::Object(o) => merged.extend(o),
                other if all.len() == 1 => return other,
                _ => {}
            }
        }
        return Value::Object(merged);
    }
    let ty = match s.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .or_else(|| ts.iter().filter_map(Value::as_str).next())
            .unwrap_or("object"),
        _ if s.contains_key("properties") => "object",
        _ if s.contains_key("items") => "array",
        _ => "string",
    };
    match ty {
        "object" => {
            let mut out = Map::new();
            if let Some(props) = s.get("properties").and_then(Value::as_object) {
                for (k, v) in props {
                    out.insert(k.clone(), gen(v, root, depth + 1, budget));
                }
            }
            // Required names without a schema of their own.
            for k in s
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                out.entry(k.to_string()).or_insert(json!("simulated"));
            }
            Value::Object(out)
        }
        "array" => {
            let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(1);
            let max = s
                .get("maxItems")
                .and_then(Value::as_u64)
                .unwrap_or(u64::MAX);
            let n = min.max(1).min(max).min(8);
            // Tuples (`prefixItems`) give one schema per place.
            if let Some(prefix) = s.get("prefixItems").and_then(Value::as_array) {
                return Value::Array(
                    prefix
                        .iter()
                        .map(|p| gen(p, root, depth + 1, budget))
                        .collect(),
                );
            }
            let item = s.get("items").cloned().unwrap_or(json!({}));
            Value::Array(
                (0..n)
                    .map(|_| gen(&item, root, depth + 1, budget))
                    .collect(),
            )
        }
        "integer" => json!(number(s, true) as i64),
        "number" => json!(number(s, false)),
        "boolean" => json!(true),
        "null" => Value::Null,
        _ => json!(string(s)),
    }
}

fn number(s: &Map<String, Value>, integer: bool) -> f64 {
    let get = |k: &str| s.get(k).and_then(Value::as_f64);
    let step = if integer { 1.0 } else { 0.5 };
    let mut v = 0.0f64;
    if let Some(m) = get("minimum") {
        v = v.max(m);
    }
    if let Some(m) = get("exclusiveMinimum") {
        if v <= m {
            v = m + step;
        }
    }
    if let Some(m) = get("maximum") {
        v = v.min(m);
    }
    if let Some(m) = get("exclusiveMaximum") {
        if v >= m {
            v = m - step;
        }
    }
    if integer {
        v = v.ceil();
    }
    v
}

fn string(s: &Map<String, Value>) -> String {
    let base = match s.get("format").and_then(Value::as_str) {
        Some("date-time") => "2026-01-01T00:00:00Z",
        Some("date") => "2026-01-01",
        Some("time") => "00:00:00",
        Some("email") => "user@example.com",
        Some("uri") | Some("url") => "https://example.com/",
        Some("uuid") => "00000000-0000-4000-8000-000000000000",
        _ => "simulated",
    };
    let min = s.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
    let max = s
        .get("maxLength")
        .and_then(Value::as_u64)
        .map_or(usize::MAX, |m| m as usize);
    let mut out = base.to_string();
    while out.chars().count() < min.min(1024) {
        out.push('x');
    }
    if out.chars().count() > max {
        out = out.chars().take(max).collect();
    }
    out
}

/// A local reference: `#`, `#/$defs/Name`, `#/definitions/Name` and other
/// JSON pointers into the root schema.
fn resolve<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    root.pointer(pointer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_sequences_cut_the_text() {
        let stops = stops(&json!({"stop": ["GPU", ""]}));
        assert_eq!(stops, vec!["GPU".to_string()]);
        assert_eq!(
            stop_at(" simulated output from kiln's roofline GPU", &stops),
            Some(39)
        );
        assert_eq!(stops_of_string(), vec!["\n".to_string()]);
    }

    fn stops_of_string() -> Vec<String> {
        stops(&json!({"stop": "\n"}))
    }

    #[test]
    fn schemas_get_values_of_their_shape() {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 12},
                "age": {"type": "integer", "minimum": 18},
                "score": {"type": "number", "exclusiveMaximum": 0},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                "kind": {"enum": ["a", "b"]},
                "maybe": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
                "friend": {"$ref": "#/$defs/Friend"}
            },
            "required": ["name", "age", "extra"],
            "$defs": {"Friend": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}
        });
        let v = example(&schema, &schema, 0);
        assert_eq!(v["name"].as_str().map(str::len), Some(12));
        assert_eq!(v["age"], 18);
        assert!(v["score"].as_f64().is_some_and(|x| x < 0.0));
        assert_eq!(v["tags"].as_array().map(Vec::len), Some(2));
        assert_eq!(v["kind"], "a");
        assert_eq!(v["maybe"], true);
        assert_eq!(v["friend"]["id"], 0);
        assert!(v.get("extra").is_some());
    }

    #[test]
    fn rendering_holds_back_a_possible_stop_and_ends_at_it() {
        let mut r = Render::new(Placeholder::Text {
            stop: vec![" roofline GPU".into()],
        });
        let words = [
            " simulated",
            " output",
            " from",
            " kiln's",
            " roofline",
            " GPU",
            " model",
        ];
        let sent: String = words.iter().map(|w| r.token(w)).collect::<String>() + &r.end();
        assert_eq!(sent, " simulated output from kiln's");
        assert_eq!(r.finish_reason(), "stop");
        let mut r = Render::new(Placeholder::Json("{\"a\":1}".into()));
        let sent: String = r.token("x") + &r.token("y") + &r.end();
        assert_eq!(sent, "{\"a\":1}");
        assert_eq!(r.finish_reason(), "stop");
    }

    #[test]
    fn recursive_schemas_end() {
        let schema = json!({"$ref": "#"});
        assert_eq!(example(&schema, &schema, 0), Value::Null);
        // Nested arrays of 8 items, 12 deep, would be 8^12 values.
        let mut deep = json!({"type": "string"});
        for _ in 0..12 {
            deep = json!({"type": "array", "items": deep, "minItems": 8});
        }
        let text = example(&deep, &deep, 0).to_string();
        assert!(text.len() < 200_000, "{}", text.len());
    }

    #[test]
    fn a_demanded_tool_is_called_with_arguments_of_its_schema() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "other"}}
        ]);
        let req = |choice: Value| json!({"tools": tools, "tool_choice": choice});
        let Ok(Placeholder::ToolCall { name, arguments }) = plan(true, &req(json!("required")))
        else {
            panic!("no tool call");
        };
        assert_eq!(name, "get_weather");
        let args: Value = serde_json::from_str(&arguments).unwrap_or(Value::Null);
        assert_eq!(args["city"], "simulated");
        let named = req(json!({"type": "function", "function": {"name": "other"}}));
        assert!(
            matches!(plan(true, &named), Ok(Placeholder::ToolCall { name, arguments })
            if name == "other" && arguments == "{}")
        );
        // `auto`: the simulator answers in text, as a model may.
        assert!(matches!(
            plan(true, &req(json!("auto"))),
            Ok(Placeholder::Text { .. })
        ));
        let missing = req(json!({"type": "function", "function": {"name": "nope"}}));
        assert!(plan(true, &missing).is_err());
        assert!(plan(true, &json!({"tool_choice": "required"})).is_err());
    }

    #[test]
    fn response_formats() {
        let Ok(Placeholder::Json(j)) =
            plan(true, &json!({"response_format": {"type": "json_object"}}))
        else {
            panic!("no JSON");
        };
        assert!(serde_json::from_str::<Value>(&j).is_ok_and(|v| v.is_object()));
        assert!(plan(true, &json!({"response_format": {"type": "grammar"}})).is_err());
        assert!(matches!(
            plan(false, &json!({"response_format": {"type": "json_object"}})),
            Ok(Placeholder::Text { .. })
        ));
    }
}
