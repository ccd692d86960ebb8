//! Tool calling without constraints: a tool catalog in the de-facto (OpenAI / Hugging Face
//! `apply_chat_template(tools=…)`) format, the call formats of the model families we run, a
//! parser per format, and a validator for the subset of JSON Schema tool catalogs use.
//!
//! Design:
//! - **Tools go in through the template's `tools` variable** (see [`crate::ChatTemplate`]); a
//!   template that has no tool syntax gets its family's default ([`ToolFormat`]): FunctionGemma's
//!   declarations and calls for the Gemma 3 family, Hermes' `<tool_call>` JSON for ChatML models.
//! - **Calls come out as [`ToolCall`]s**, `{"name", "arguments"}`, each validated against its
//!   tool's schema ([`validate`]). A constrained decoder (a grammar built from the same
//!   [`Tool`]s and [`ToolFormat`]) can reuse the types: what it forces is what [`ToolFormat::parse`]
//!   reads.
//! - **A small validator, not the `jsonschema` crate**: tool schemas use `type`, `properties`,
//!   `required`, `enum`, `items`, `minimum`/`maximum`; the crate would pull a regex engine and an
//!   HTTP client feature set into an app's native library for that.

use std::fmt::Write as _;
use std::str::FromStr;

use serde_json::{Map, Value as Json};

/// What is wrong with a catalog, a message list or a call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    #[error("tool catalog: {0}")]
    Catalog(String),
    #[error("messages: {0}")]
    Messages(String),
    /// The output holds a call that does not parse.
    #[error("tool call does not parse: {0}")]
    Parse(String),
    #[error("tool call names `{0}`, which is not in the catalog")]
    UnknownTool(String),
    /// The call parses but its arguments break the tool's schema.
    #[error("tool call `{name}`: {reason}")]
    Invalid { name: String, reason: String },
}

/// One tool of a catalog.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// A JSON Schema object (`{"type": "object", "properties": {…}, "required": […]}`).
    pub parameters: Json,
}

impl Tool {
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`, what templates
    /// read from `tools`.
    pub fn to_json(&self) -> Json {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }
}

/// Reads a catalog: a JSON list of `{"type": "function", "function": {…}}` (also the bare
/// `{"name", "description", "parameters"}` objects some catalogs hold).
pub fn parse_catalog(text: &str) -> Result<Vec<Tool>, ToolError> {
    let list: Json = serde_json::from_str(text).map_err(|e| ToolError::Catalog(e.to_string()))?;
    let Json::Array(items) = list else {
        return Err(ToolError::Catalog("not a JSON list of tools".into()));
    };
    let mut tools = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let f = match item.get("function") {
            Some(f) if item.get("type").and_then(Json::as_str).unwrap_or("function") == "function" => f,
            Some(_) => return Err(ToolError::Catalog(format!("tool {i}: type is not \"function\""))),
            None => item,
        };
        let name = f
            .get("name")
            .and_then(Json::as_str)
            .filter(|n| is_name(n))
            .ok_or_else(|| ToolError::Catalog(format!("tool {i}: no name of letters, digits, `_`, `-`, `.`")))?;
        if tools.iter().any(|t: &Tool| t.name == name) {
            return Err(ToolError::Catalog(format!("tool {i}: `{name}` is declared twice")));
        }
        let parameters = f
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
        if parameters.get("type").and_then(Json::as_str) != Some("object") {
            return Err(ToolError::Catalog(format!(
                "tool `{name}`: parameters are not a JSON Schema object"
            )));
        }
        tools.push(Tool {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_string(),
            parameters,
        });
    }
    Ok(tools)
}

fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// A function call: what a model asked for, or what a conversation's assistant message holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Json>,
}

impl ToolCall {
    /// `{"name": …, "arguments": {…}}`.
    pub fn to_json(&self) -> Json {
        serde_json::json!({"name": self.name, "arguments": self.arguments})
    }
}

/// How a model family writes tool calls (and, for the default templates, declarations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<start_function_call>call:NAME{arg:<escape>text<escape>,n:3}<end_function_call>`:
    /// FunctionGemma's format, the Gemma 3 family's default. Special tokens where the vocabulary
    /// has them (FunctionGemma), the same text where it does not (Gemma 3 270M).
    FunctionGemma,
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`: Hermes / Qwen 2.5, the ChatML
    /// family's default.
    Hermes,
}

pub const FG_CALL_START: &str = "<start_function_call>";
pub const FG_CALL_END: &str = "<end_function_call>";
pub const FG_ESCAPE: &str = "<escape>";
pub const HERMES_CALL_START: &str = "<tool_call>";
pub const HERMES_CALL_END: &str = "</tool_call>";

/// The parts of a model's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// Everything outside the calls, trimmed.
    pub text: String,
    /// Each call block in order: the call, or why it does not parse.
    pub calls: Vec<Result<ToolCall, ToolError>>,
}

impl ToolFormat {
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::FunctionGemma => "functiongemma",
            ToolFormat::Hermes => "hermes",
        }
    }

    /// The text that opens and closes one call.
    pub fn delimiters(self) -> (&'static str, &'static str) {
        match self {
            ToolFormat::FunctionGemma => (FG_CALL_START, FG_CALL_END),
            ToolFormat::Hermes => (HERMES_CALL_START, HERMES_CALL_END),
        }
    }

    /// Splits a decoded answer (control tokens rendered: `Tokenizer::decode_with(ids, true)`)
    /// into text and calls. A call whose closing delimiter is missing at the end of the output
    /// still counts when its body is complete (a stop token may have cut it). A Hermes answer
    /// that is nothing but `{"name", "arguments"}` objects (one, or a list) is taken as calls too
    /// (SmolLM2 often drops the tags).
    pub fn parse(self, output: &str) -> ParsedOutput {
        let (open, close) = self.delimiters();
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut rest = output;
        while let Some(at) = rest.find(open) {
            text.push_str(&rest[..at]);
            let body_start = &rest[at + open.len()..];
            let (body, after) = match body_start.find(close) {
                Some(end) => (&body_start[..end], &body_start[end + close.len()..]),
                None => (body_start, ""),
            };
            match self {
                ToolFormat::FunctionGemma => calls.push(parse_functiongemma_call(body)),
                ToolFormat::Hermes => calls.extend(parse_hermes_body(body)),
            }
            rest = after;
        }
        text.push_str(rest);
        let text = text.trim().to_string();
        if calls.is_empty() && self == ToolFormat::Hermes && (text.starts_with('{') || text.starts_with('[')) {
            let bare = parse_hermes_body(&text);
            if !bare.is_empty() && bare.iter().all(Result::is_ok) {
                return ParsedOutput {
                    text: String::new(),
                    calls: bare,
                };
            }
        }
        ParsedOutput { text, calls }
    }
}

/// A `<tool_call>`'s body: one call object (Hermes, Qwen) or a list of them (SmolLM2's format;
/// `[]` is no call).
fn parse_hermes_body(body: &str) -> Vec<Result<ToolCall, ToolError>> {
    // The first complete JSON value: trailing text after it (another tag, prose) is not the call.
    let mut stream = serde_json::Deserializer::from_str(body.trim()).into_iter::<Json>();
    match stream.next() {
        Some(Ok(Json::Array(items))) => items.iter().map(hermes_call).collect(),
        Some(Ok(v)) => vec![hermes_call(&v)],
        Some(Err(e)) => vec![Err(ToolError::Parse(e.to_string()))],
        None => vec![Err(ToolError::Parse("empty <tool_call>".into()))],
    }
}

fn hermes_call(value: &Json) -> Result<ToolCall, ToolError> {
    let name = value
        .get("name")
        .and_then(Json::as_str)
        .ok_or_else(|| ToolError::Parse("no \"name\" string".into()))?;
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None | Some(Json::Null) => Map::new(),
        Some(Json::Object(m)) => m.clone(),
        // OpenAI's wire format: the arguments as a JSON string.
        Some(Json::String(s)) => match serde_json::from_str(s) {
            Ok(Json::Object(m)) => m,
            _ => {
                return Err(ToolError::Parse(
                    "\"arguments\" is a string holding no JSON object".into(),
                ))
            }
        },
        Some(_) => return Err(ToolError::Parse("\"arguments\" is not an object".into())),
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

fn parse_functiongemma_call(body: &str) -> Result<ToolCall, ToolError> {
    let body = body.trim_start();
    let body = body
        .strip_prefix("call:")
        .ok_or_else(|| ToolError::Parse("a function call does not start with `call:`".into()))?;
    let brace = body
        .find('{')
        .ok_or_else(|| ToolError::Parse("no `{` after the function name".into()))?;
    let name = body[..brace].trim();
    if !is_name(name) {
        return Err(ToolError::Parse(format!("`{name}` is not a function name")));
    }
    let mut p = FgParser {
        s: &body[brace..],
        at: 0,
    };
    let arguments = match p.value()? {
        Json::Object(m) => m,
        _ => unreachable!("a value starting with `{{` is an object"),
    };
    let trailing = p.s[p.at..].trim();
    if !trailing.is_empty() {
        return Err(ToolError::Parse(format!("text after the arguments: `{trailing}`")));
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// FunctionGemma's value syntax: `<escape>text<escape>`, `{key:value,…}` (bare keys), `[…]`,
/// numbers, `true`, `false`, `null`.
struct FgParser<'a> {
    s: &'a str,
    at: usize,
}

impl FgParser<'_> {
    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    fn skip_ws(&mut self) {
        let trimmed = self.rest().trim_start();
        self.at = self.s.len() - trimmed.len();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(token) {
            self.at += token.len();
            true
        } else {
            false
        }
    }

    fn err(&self, what: &str) -> ToolError {
        let near: String = self.rest().chars().take(24).collect();
        ToolError::Parse(format!("{what} at `{near}`"))
    }

    fn value(&mut self) -> Result<Json, ToolError> {
        self.skip_ws();
        if self.eat(FG_ESCAPE) {
            let end = self
                .rest()
                .find(FG_ESCAPE)
                .ok_or_else(|| self.err("an unclosed <escape> string"))?;
            let text = self.rest()[..end].to_string();
            self.at += end + FG_ESCAPE.len();
            return Ok(Json::String(text));
        }
        if self.eat("{") {
            let mut map = Map::new();
            if self.eat("}") {
                return Ok(Json::Object(map));
            }
            loop {
                self.skip_ws();
                let colon = self.rest().find(':').ok_or_else(|| self.err("a key without `:`"))?;
                let key = self.rest()[..colon].trim().to_string();
                if !is_name(&key) {
                    return Err(self.err("a key that is not a name"));
                }
                self.at += colon + 1;
                let value = self.value()?;
                map.insert(key, value);
                if self.eat(",") {
                    continue;
                }
                if self.eat("}") {
                    return Ok(Json::Object(map));
                }
                return Err(self.err("expected `,` or `}`"));
            }
        }
        if self.eat("[") {
            let mut items = Vec::new();
            if self.eat("]") {
                return Ok(Json::Array(items));
            }
            loop {
                items.push(self.value()?);
                if self.eat(",") {
                    continue;
                }
                if self.eat("]") {
                    return Ok(Json::Array(items));
                }
                return Err(self.err("expected `,` or `]`"));
            }
        }
        // A bare scalar: up to the next delimiter.
        let end = self.rest().find([',', '}', ']', '<']).unwrap_or(self.rest().len());
        let word = self.rest()[..end].trim();
        let value = match word {
            "true" => Json::Bool(true),
            "false" => Json::Bool(false),
            "null" => Json::Null,
            _ => match serde_json::from_str::<serde_json::Number>(word) {
                Ok(n) => Json::Number(n),
                Err(_) => return Err(self.err("a value that is no <escape> string, number, boolean or null")),
            },
        };
        self.at += end;
        Ok(value)
    }
}

/// `value` in FunctionGemma's notation: strings between `<escape>`s, object keys bare and in the
/// value's order.
pub fn functiongemma_value(value: &Json) -> String {
    let mut out = String::new();
    write_fg(&mut out, value, false);
    out
}

/// A parameters schema as FunctionGemma's declarations write it: keys sorted, `type` values in
/// capitals (`STRING`, `OBJECT`), as Google's examples show.
pub fn functiongemma_schema(schema: &Json) -> String {
    let mut out = String::new();
    write_fg(&mut out, schema, true);
    out
}

fn write_fg(out: &mut String, value: &Json, schema: bool) {
    match value {
        Json::String(s) => {
            out.push_str(FG_ESCAPE);
            out.push_str(s);
            out.push_str(FG_ESCAPE);
        }
        Json::Object(map) => {
            out.push('{');
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if schema {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(k);
                out.push(':');
                match (schema, k.as_str(), v) {
                    (true, "type", Json::String(t)) => write_fg(out, &Json::String(t.to_uppercase()), false),
                    // Property names are data, not schema keywords: only their values are schemas.
                    _ => write_fg(out, v, schema),
                }
            }
            out.push('}');
        }
        Json::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_fg(out, v, schema);
            }
            out.push(']');
        }
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

/// JSON as Python's `json.dumps` writes it by default (`", "` and `": "`), which Hugging Face's
/// `tojson` filter is; key order as held.
pub fn python_json(value: &Json) -> String {
    let mut out = String::new();
    write_py(&mut out, value);
    out
}

fn write_py(out: &mut String, value: &Json) {
    match value {
        Json::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_py(out, v);
            }
            out.push('}');
        }
        Json::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(out, v);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Checks `call` against its tool in `tools`: the name, then the arguments against the schema.
pub fn validate(call: &ToolCall, tools: &[Tool]) -> Result<(), ToolError> {
    let tool = tools
        .iter()
        .find(|t| t.name == call.name)
        .ok_or_else(|| ToolError::UnknownTool(call.name.clone()))?;
    check(&tool.parameters, &Json::Object(call.arguments.clone()), "arguments").map_err(|reason| ToolError::Invalid {
        name: call.name.clone(),
        reason,
    })
}

/// The subset of JSON Schema tool catalogs use: `type` (one or a list), `enum`, `const`,
/// `properties`, `required`, `additionalProperties: false`, `items`, `minimum`, `maximum`,
/// `minLength`, `maxLength`, `minItems`, `maxItems`. Other keywords (`format`, `pattern`,
/// `description`, …) are not checked.
fn check(schema: &Json, value: &Json, path: &str) -> Result<(), String> {
    let Json::Object(schema) = schema else {
        return Ok(());
    };
    if let Some(types) = schema.get("type") {
        let fits = |t: &Json| match t.as_str() {
            Some("string") => value.is_string(),
            Some("integer") => value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0),
            Some("number") => value.is_number(),
            Some("boolean") => value.is_boolean(),
            Some("object") => value.is_object(),
            Some("array") => value.is_array(),
            Some("null") => value.is_null(),
            _ => true,
        };
        let ok = match types {
            Json::Array(list) => list.iter().any(fits),
            t => fits(t),
        };
        if !ok {
            return Err(format!("{path} is {}, the schema wants {types}", kind(value)));
        }
    }
    if let Some(Json::Array(allowed)) = schema.get("enum") {
        if !allowed.contains(value) {
            return Err(format!(
                "{path} is {value}, not one of {}",
                Json::Array(allowed.clone())
            ));
        }
    }
    if let Some(c) = schema.get("const") {
        if c != value {
            return Err(format!("{path} is {value}, the schema wants {c}"));
        }
    }
    let bound = |key: &str| schema.get(key).and_then(Json::as_f64);
    if let Some(x) = value.as_f64() {
        if let Some(min) = bound("minimum").filter(|&m| x < m) {
            return Err(format!("{path} is {value}, below the minimum {min}"));
        }
        if let Some(max) = bound("maximum").filter(|&m| x > m) {
            return Err(format!("{path} is {value}, above the maximum {max}"));
        }
    }
    if let Some(s) = value.as_str() {
        let n = s.chars().count() as f64;
        if bound("minLength").is_some_and(|m| n < m) || bound("maxLength").is_some_and(|m| n > m) {
            return Err(format!("{path}'s length {n} is out of the schema's bounds"));
        }
    }
    if let Some(items) = value.as_array() {
        let n = items.len() as f64;
        if bound("minItems").is_some_and(|m| n < m) || bound("maxItems").is_some_and(|m| n > m) {
            return Err(format!("{path} holds {n} items, out of the schema's bounds"));
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                check(item_schema, item, &format!("{path}[{i}]"))?;
            }
        }
    }
    if let Some(map) = value.as_object() {
        let properties = schema.get("properties").and_then(Json::as_object);
        if let Some(Json::Array(required)) = schema.get("required") {
            for key in required.iter().filter_map(Json::as_str) {
                if !map.contains_key(key) {
                    return Err(format!("{path} lacks the required `{key}`"));
                }
            }
        }
        for (key, v) in map {
            match properties.and_then(|p| p.get(key)) {
                Some(s) => check(s, v, &format!("{path}.{key}"))?,
                None if schema.get("additionalProperties") == Some(&Json::Bool(false)) => {
                    return Err(format!("{path} has `{key}`, which the schema does not declare"))
                }
                None => {}
            }
        }
    }
    Ok(())
}

fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// OpenAI's `tool_choice`, without a grammar to enforce it (see `docs/tool-calling.md`): `none`
/// renders no tools and refuses calls in the output; `required` and a name are checked on the
/// output; `auto` takes what comes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Function(String),
}

impl FromStr for ToolChoice {
    type Err = ToolError;

    fn from_str(s: &str) -> Result<Self, ToolError> {
        Ok(match s {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            name if is_name(name) => ToolChoice::Function(name.to_string()),
            other => return Err(ToolError::Catalog(format!("tool choice `{other}` is no tool name"))),
        })
    }
}

impl ToolChoice {
    /// Whether `calls` (the parsed, valid ones) satisfy the choice; the reason when not.
    pub fn check(&self, calls: &[ToolCall]) -> Result<(), String> {
        match self {
            ToolChoice::Auto => Ok(()),
            ToolChoice::None if calls.is_empty() => Ok(()),
            ToolChoice::None => Err("the tool choice is `none` but the output calls a tool".into()),
            ToolChoice::Required if calls.is_empty() => {
                Err("the tool choice is `required` but the output holds no valid call".into())
            }
            ToolChoice::Required => Ok(()),
            ToolChoice::Function(name) if calls.iter().any(|c| &c.name == name) => Ok(()),
            ToolChoice::Function(name) => Err(format!("the tool choice is `{name}` but the output does not call it")),
        }
    }
}

/// The tools' JSON as templates get it, and as digests hash it.
pub fn tools_json(tools: &[Tool]) -> Json {
    Json::Array(tools.iter().map(Tool::to_json).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn catalog() -> Vec<Tool> {
        parse_catalog(
            r#"[{"type":"function","function":{"name":"set_lights","description":"Lights.",
            "parameters":{"type":"object","properties":{"room":{"type":"string","enum":["kitchen","office"]},
            "on":{"type":"boolean"},"level":{"type":"integer","minimum":0,"maximum":100},
            "tags":{"type":"array","items":{"type":"string"}}},"required":["room","on"]}}}]"#,
        )
        .unwrap()
    }

    fn call(name: &str, args: Json) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.as_object().unwrap().clone(),
        }
    }

    #[test]
    fn functiongemma_calls_parse_with_nested_values_and_escapes() {
        let out = "Sure.<start_function_call>call:set_lights{room:<escape>kitchen, {left}<escape>,on:true,\
                   level:40,ratio:-0.5,tags:[<escape>a<escape>,<escape>b<escape>],more:{x:null,y:[]}}<end_function_call>";
        let parsed = ToolFormat::FunctionGemma.parse(out);
        assert_eq!(parsed.text, "Sure.");
        assert_eq!(
            parsed.calls,
            vec![Ok(call(
                "set_lights",
                json!({"room": "kitchen, {left}", "on": true, "level": 40, "ratio": -0.5,
                       "tags": ["a", "b"], "more": {"x": null, "y": []}})
            ))]
        );
    }

    #[test]
    fn functiongemma_round_trips_through_its_writer() {
        let args = json!({"b": "x:<y>,}", "a": [1, 2.5, {"c": false}], "e": {}});
        let text = format!("{FG_CALL_START}call:f{}{FG_CALL_END}", functiongemma_value(&args));
        assert_eq!(ToolFormat::FunctionGemma.parse(&text).calls, vec![Ok(call("f", args))]);
    }

    #[test]
    fn broken_calls_are_errors_not_text() {
        for bad in [
            "<start_function_call>call:f{a:<escape>open}",
            "<start_function_call>f{a:1}<end_function_call>",
            "<start_function_call>call:f{a:bare words}<end_function_call>",
            "<start_function_call>call:f{a:1} extra<end_function_call>",
        ] {
            let parsed = ToolFormat::FunctionGemma.parse(bad);
            assert!(
                matches!(parsed.calls[..], [Err(ToolError::Parse(_))]),
                "{bad}: {parsed:?}"
            );
        }
        let parsed = ToolFormat::Hermes.parse("<tool_call>{\"name\": \"f\", </tool_call>");
        assert!(matches!(parsed.calls[..], [Err(ToolError::Parse(_))]), "{parsed:?}");
    }

    #[test]
    fn hermes_calls_parse_tagged_unclosed_or_bare() {
        let tagged = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}";
        let listed = "<tool_call>[\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n]</tool_call>";
        let bare = " {\"name\": \"f\", \"arguments\": {\"a\": 1}} ";
        for out in [tagged, unclosed, bare, listed] {
            let parsed = ToolFormat::Hermes.parse(out);
            assert_eq!(parsed.calls, vec![Ok(call("f", json!({"a": 1})))], "{out}");
            assert_eq!(parsed.text, "");
        }
        assert!(ToolFormat::Hermes.parse("Hello there").calls.is_empty());
        assert!(ToolFormat::Hermes.parse("<tool_call>[]</tool_call>").calls.is_empty());
    }

    #[test]
    fn validation_checks_types_required_enum_and_bounds() {
        let tools = catalog();
        let ok = call(
            "set_lights",
            json!({"room": "kitchen", "on": true, "level": 3, "tags": ["x"]}),
        );
        assert_eq!(validate(&ok, &tools), Ok(()));
        let cases = [
            (json!({"room": "kitchen"}), "lacks the required `on`"),
            (json!({"room": "garage", "on": true}), "not one of"),
            (json!({"room": "kitchen", "on": "yes"}), "is a string"),
            (
                json!({"room": "kitchen", "on": true, "level": 101}),
                "above the maximum",
            ),
            (json!({"room": "kitchen", "on": true, "level": 1.5}), "is a number"),
            (json!({"room": "kitchen", "on": true, "tags": [1]}), "arguments.tags[0]"),
        ];
        for (args, want) in cases {
            match validate(&call("set_lights", args.clone()), &tools) {
                Err(ToolError::Invalid { reason, .. }) => assert!(reason.contains(want), "{args}: {reason}"),
                other => panic!("{args}: {other:?}"),
            }
        }
        assert_eq!(
            validate(&call("fly", json!({})), &tools),
            Err(ToolError::UnknownTool("fly".into()))
        );
    }

    #[test]
    fn declarations_are_written_as_functiongemma_writes_them() {
        let schema = json!({"type": "object", "required": ["location"],
            "properties": {"location": {"type": "string", "description": "City, e.g. \"Tokyo\""}}});
        assert_eq!(
            functiongemma_schema(&schema),
            "{properties:{location:{description:<escape>City, e.g. \"Tokyo\"<escape>,type:<escape>STRING<escape>}},\
             required:[<escape>location<escape>],type:<escape>OBJECT<escape>}"
        );
    }

    #[test]
    fn tool_choice_is_checked_on_the_calls() {
        let c = call("set_lights", json!({}));
        assert!(ToolChoice::Required.check(&[]).is_err());
        assert!(ToolChoice::None.check(std::slice::from_ref(&c)).is_err());
        assert!("set_lights"
            .parse::<ToolChoice>()
            .unwrap()
            .check(std::slice::from_ref(&c))
            .is_ok());
        assert!("other".parse::<ToolChoice>().unwrap().check(&[c]).is_err());
        assert!("a b".parse::<ToolChoice>().is_err());
    }
}
