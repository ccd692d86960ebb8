//! Lark grammars (llguidance's dialect) for tool calls: one per call format, from the tools'
//! JSON Schemas and the tool choice.
//!
//! - FunctionGemma: `<start_function_call>call:NAME{key:value,…}<end_function_call>`, written
//!   here rule by rule from each schema: strings between `<escape>`s (enums as alternatives),
//!   numbers and booleans as llguidance's `%json` sub-grammars (so `minimum`/`maximum` hold),
//!   nested objects and arrays in the same notation; keys in the schema's sorted order (the
//!   order the declarations show them), required ones mandatory, optional ones skippable.
//! - Hermes: `<tool_call>` and a JSON value from `%json` with a schema of
//!   `{"name": const, "arguments": parameters}` per tool (one object, or SmolLM2's list of them).
//!
//! The choice picks the start: `required` → a call, `auto` → a call, or text that does not open
//! like a call, `NAME` → a call of that tool. `none` has no grammar (the tools are not rendered
//! either). One call per answer: after it only a stop token may follow, so an answer is never
//! cut inside a second call (every string and the call itself are bounded; a `max_new` above the
//! longest call always leaves a complete one).

use std::fmt::Write as _;

use serde_json::{json, Map, Value as Json};
use tokenizer::tools::{Tool, ToolChoice, FG_CALL_END, FG_CALL_START, FG_ESCAPE, HERMES_CALL_END, HERMES_CALL_START};

/// Longest string value the grammar lets a model write where the schema sets no `maxLength`:
/// a bound keeps a weak model from filling `max_new` with one argument and never closing the
/// call (Gemma 3 270M wrote a string of 80 digits, one id each, until 96 ids cut it). Longer
/// than a spoken request's argument; a call of three strings stays under 256 ids.
pub const DEFAULT_MAX_STRING: u64 = 64;

/// How a model writes its calls (what its prompt shows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallStyle {
    /// FunctionGemma's notation; `special_markers` where the vocabulary has its six function
    /// tokens as control tokens (FunctionGemma), plain text where not (Gemma 3 270M).
    FunctionGemma { special_markers: bool },
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (Qwen 2.5, the ChatML default).
    HermesObject,
    /// `<tool_call>[{"name": …, "arguments": {…}}, …]</tool_call>` (SmolLM2's own format).
    HermesList,
}

/// A Lark string literal of `text`.
fn lit(text: &str) -> String {
    // A JSON string is a valid Lark string literal for the characters tool names, enums and
    // markers hold (escapes `\"`, `\\`, `\n`, `\uXXXX`).
    serde_json::to_string(text).unwrap_or_default()
}

/// `%json` of `schema` with the separators the templates write (`tojson`: `", "`, `": "`) and
/// no free whitespace: a model cannot wander off into indentation.
fn json_sub(schema: &Json) -> String {
    let mut schema = schema.clone();
    if let Json::Object(m) = &mut schema {
        m.insert(
            "x-guidance".into(),
            json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false, "lenient": true}),
        );
    }
    format!("%json {schema}")
}

struct Builder {
    rules: String,
    next: usize,
    special: bool,
}

impl Builder {
    fn fresh(&mut self, stem: &str) -> String {
        self.next += 1;
        format!("{stem}{}", self.next)
    }

    fn rule(&mut self, name: &str, body: &str) {
        let _ = writeln!(self.rules, "{name}: {body}");
    }

    fn marker(&self, text: &str) -> String {
        if self.special {
            text.to_string()
        } else {
            lit(text)
        }
    }

    /// A rule for one FunctionGemma value of `schema`; returns its name.
    fn value(&mut self, schema: &Json) -> String {
        let name = self.fresh("v");
        let mut alts: Vec<String> = Vec::new();
        if let Some(values) = schema.get("enum").and_then(Json::as_array) {
            alts.extend(values.iter().map(|v| self.constant(v)));
        } else if let Some(v) = schema.get("const") {
            alts.push(self.constant(v));
        } else {
            let types: Vec<&str> = match schema.get("type") {
                Some(Json::String(t)) => vec![t.as_str()],
                Some(Json::Array(ts)) => ts.iter().filter_map(Json::as_str).collect(),
                _ => vec!["string", "number", "boolean", "object", "array", "null"],
            };
            for ty in types {
                let alt = match ty {
                    "string" => self.string(schema),
                    "integer" | "number" | "boolean" | "null" => {
                        let mut sub = Map::new();
                        sub.insert("type".into(), json!(ty));
                        for key in [
                            "minimum",
                            "maximum",
                            "exclusiveMinimum",
                            "exclusiveMaximum",
                            "multipleOf",
                        ] {
                            if let Some(v) = schema.get(key) {
                                sub.insert(key.into(), v.clone());
                            }
                        }
                        json_sub(&Json::Object(sub))
                    }
                    "object" => format!("\"{{\" {} \"}}\"", self.args(schema).unwrap_or_default()),
                    "array" => {
                        let item = self.value(schema.get("items").unwrap_or(&json!({})));
                        let min = schema.get("minItems").and_then(Json::as_u64).unwrap_or(0);
                        if min > 0 {
                            format!("\"[\" {item} (\",\" {item})* \"]\"")
                        } else {
                            format!("\"[\" ({item} (\",\" {item})*)? \"]\"")
                        }
                    }
                    _ => continue,
                };
                alts.push(alt);
            }
        }
        if alts.is_empty() {
            // A schema no value satisfies (an empty enum): nothing may be written.
            alts.push("<[^*]>".into());
        }
        let body = alts.join(" | ");
        self.rule(&name, &body);
        name
    }

    /// A constant in FunctionGemma's notation (an enum member).
    fn constant(&self, v: &Json) -> String {
        match v {
            Json::String(s) => format!("{} {} {}", self.marker(FG_ESCAPE), lit(s), self.marker(FG_ESCAPE)),
            other => lit(&tokenizer::tools::functiongemma_value(other)),
        }
    }

    fn string(&mut self, schema: &Json) -> String {
        let min = schema.get("minLength").and_then(Json::as_u64).unwrap_or(0);
        let max = schema
            .get("maxLength")
            .and_then(Json::as_u64)
            .unwrap_or(DEFAULT_MAX_STRING)
            .max(min);
        let term = self.fresh("STR").to_uppercase();
        // No `<` inside: an `<escape>` (text or token) ends the string, as the parser reads it.
        let _ = writeln!(self.rules, "{term}: /[^<]{{{min},{max}}}/");
        format!("{} {term} {}", self.marker(FG_ESCAPE), self.marker(FG_ESCAPE))
    }

    /// The `key:value,…` inside an object's braces; `None` when the schema has no properties.
    /// Keys in sorted order; `F_i` = the keys from `i` on, none written before (no comma),
    /// `R_i` = at least one key from `i` on, each after a comma. Both never match nothing, so
    /// an all-optional tail is `R_i?`.
    fn args(&mut self, schema: &Json) -> Option<String> {
        let props: Vec<(String, Json)> = schema
            .get("properties")
            .and_then(Json::as_object)
            .map(|m| {
                let mut v: Vec<(String, Json)> = m.iter().map(|(k, s)| (k.clone(), s.clone())).collect();
                v.sort_by(|a, b| a.0.cmp(&b.0));
                v
            })
            .unwrap_or_default();
        if props.is_empty() {
            return None;
        }
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Json::as_array)
            .map(|r| r.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        let n = props.len();
        let req: Vec<bool> = props.iter().map(|(k, _)| required.contains(&k.as_str())).collect();
        let optional_from = |i: usize| req[i..].iter().all(|r| !r);
        let kv: Vec<String> = props
            .iter()
            .map(|(k, s)| {
                let v = self.value(s);
                format!("{} {v}", lit(&format!("{k}:")))
            })
            .collect();
        let stem = self.fresh("o");
        let r = |i: usize| format!("{stem}_r{i}");
        let f = |i: usize| format!("{stem}_f{i}");
        let tail = |i: usize| -> String {
            if i == n {
                String::new()
            } else if optional_from(i) {
                format!("{}?", r(i))
            } else {
                r(i)
            }
        };
        for i in (0..n).rev() {
            let mut r_alts = vec![format!("\",\" {} {}", kv[i], tail(i + 1))];
            let mut f_alts = vec![format!("{} {}", kv[i], tail(i + 1))];
            if !req[i] && i + 1 < n {
                r_alts.push(r(i + 1));
                f_alts.push(f(i + 1));
            }
            self.rule(&r(i), &r_alts.join(" | "));
            self.rule(&f(i), &f_alts.join(" | "));
        }
        Some(if optional_from(0) { format!("{}?", f(0)) } else { f(0) })
    }
}

/// The tools a choice leaves callable; an unknown `NAME` is an error naming it.
fn callable<'t>(tools: &'t [Tool], choice: &ToolChoice) -> Result<Vec<&'t Tool>, String> {
    match choice {
        ToolChoice::Function(name) => tools
            .iter()
            .find(|t| &t.name == name)
            .map(|t| vec![t])
            .ok_or_else(|| format!("the tool choice `{name}` is not in the catalog")),
        _ if tools.is_empty() => Err("no tools to call".into()),
        _ => Ok(tools.iter().collect()),
    }
}

/// The Lark grammar of `style` for `tools` under `choice`; `Ok(None)` for `none` (no grammar).
pub fn lark(style: CallStyle, tools: &[Tool], choice: &ToolChoice) -> Result<Option<String>, String> {
    if *choice == ToolChoice::None {
        return Ok(None);
    }
    let tools = callable(tools, choice)?;
    let mut b = Builder {
        rules: String::new(),
        next: 0,
        special: matches!(style, CallStyle::FunctionGemma { special_markers: true }),
    };
    let calls = match style {
        CallStyle::FunctionGemma { .. } => {
            let mut alts = Vec::new();
            for tool in &tools {
                let args = b.args(&tool.parameters).unwrap_or_default();
                alts.push(format!("{} \"{{\" {args} \"}}\"", lit(&format!("call:{}", tool.name))));
            }
            b.rule("fn", &alts.join(" | "));
            let call = format!("{} fn {}", b.marker(FG_CALL_START), b.marker(FG_CALL_END));
            b.rule("call", &call);
            "call"
        }
        CallStyle::HermesObject | CallStyle::HermesList => {
            let one: Vec<Json> = tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "object",
                        "properties": {"name": {"const": t.name}, "arguments": bounded(&t.parameters)},
                        "required": ["name", "arguments"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let object = if one.len() == 1 {
                one[0].clone()
            } else {
                json!({"anyOf": one})
            };
            let body = if style == CallStyle::HermesList {
                let item = json_sub(&object);
                b.rule("item", &item);
                format!("{} \"[\" item \"]\" {}", lit(HERMES_CALL_START), lit(HERMES_CALL_END))
            } else {
                format!(
                    "{} {} {}",
                    lit(&format!("{HERMES_CALL_START}\n")),
                    json_sub(&object),
                    lit(&format!("\n{HERMES_CALL_END}"))
                )
            };
            b.rule("call", &body);
            "call"
        }
    };
    let start = match choice {
        ToolChoice::Auto => format!("start: calls | TEXT\nTEXT: /[^<{}](?s:.)*/\n", "\\s"),
        _ => "start: calls\n".to_string(),
    };
    Ok(Some(format!("{start}calls: {calls}\n{}", b.rules)))
}

/// `schema` with [`DEFAULT_MAX_STRING`] on every string that sets no `maxLength`, and
/// `additionalProperties: false` on every object with `properties` that does not say: a tool
/// takes the arguments it declares (weak models otherwise copy schema keys, `"type": "string"`,
/// into the arguments), as the FunctionGemma grammar has it.
fn bounded(schema: &Json) -> Json {
    match schema {
        Json::Object(m) => {
            let mut out: Map<String, Json> = m.iter().map(|(k, v)| (k.clone(), bounded(v))).collect();
            let is_string = match m.get("type") {
                Some(Json::String(t)) => t == "string",
                Some(Json::Array(ts)) => ts.iter().any(|t| t == "string"),
                _ => false,
            };
            if is_string && !m.contains_key("maxLength") && !m.contains_key("enum") {
                out.insert("maxLength".into(), json!(DEFAULT_MAX_STRING));
            }
            if m.get("properties").is_some_and(Json::is_object) && !m.contains_key("additionalProperties") {
                out.insert("additionalProperties".into(), json!(false));
            }
            Json::Object(out)
        }
        Json::Array(a) => Json::Array(a.iter().map(bounded).collect()),
        other => other.clone(),
    }
}
