//! Chat templates: the model's own `tokenizer.chat_template` (Jinja) rendered with `minijinja`,
//! configured as Hugging Face's `apply_chat_template` configures Jinja2 (`trim_blocks`,
//! `lstrip_blocks`, `raise_exception`, Python string methods through `minijinja-contrib`'s
//! pycompat).
//!
//! Design:
//! - **The file's template is the format.** A GGUF without `tokenizer.chat_template` whose
//!   vocabulary has Gemma's or ChatML's turn tokens gets that format's published template
//!   (`templates/*.jinja`); any other vocabulary has none, and chat requests are refused.
//! - **Message text is plain text.** Only control tokens the template itself writes become
//!   control tokens. Before rendering, every control-token look-alike in a role or content (and
//!   the escape character itself) is swapped for an opaque placeholder (`U+10FFFD`, digits,
//!   `U+10FFFD`: no whitespace, no case, so `trim`/`upper` leave it whole); after rendering the
//!   template's output is cut at control tokens and the placeholders are put back inside the
//!   text pieces, where they are tokenized without `parse_special`.
//! - **No BOS in the rendered text** when the tokenizer adds one (`tokenizer.ggml.add_bos_token`):
//!   a rendering that opens with the BOS token has it dropped, so it is never doubled. Without
//!   `add_bos_token` it stays (SmolLM2's BOS is `<|im_start|>`, which opens its first turn).

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, Value};

use crate::tools::{self, Tool, ToolCall, ToolFormat};
use crate::{Error, Fragment, Result, TokenType, Tokenizer};

/// Gemma 3's template (`google/gemma-3-*` `tokenizer_config.json`).
pub const GEMMA3_TEMPLATE: &str = include_str!("../templates/gemma3.jinja");
/// SmolLM2-Instruct's template: ChatML with a default system prompt.
pub const SMOLLM2_TEMPLATE: &str = include_str!("../templates/smollm2.jinja");
/// Plain ChatML.
pub const CHATML_TEMPLATE: &str = include_str!("../templates/chatml.jinja");
/// The Gemma 3 family's tool syntax where a file's template has none: FunctionGemma's.
pub const GEMMA3_TOOLS_TEMPLATE: &str = include_str!("../templates/gemma3-tools.jinja");
/// The ChatML family's tool syntax where a file's template has none: Qwen 2.5's (Hermes).
pub const CHATML_TOOLS_TEMPLATE: &str = include_str!("../templates/chatml-tools.jinja");
/// SmolLM2-Instruct's own tool format (its model card's): a JSON list of calls in `<tool_call>`.
pub const SMOLLM2_TOOLS_TEMPLATE: &str = include_str!("../templates/smollm2-tools.jinja");

/// Stands where the first non-system message's text starts, to find where a prefix ends; a
/// noncharacter no template writes and no message holds after escaping.
pub(crate) const SPLIT_MARK: char = '\u{10FFFE}';

/// Turn closers llama.cpp knows (its `special_eot_id` search), in its order.
const END_OF_TURN_TOKENS: [&str; 4] = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>"];

/// Opens and closes a placeholder; never written by a template or meant by a user.
const ESCAPE: char = '\u{10FFFD}';

/// One message of a conversation. Roles: `system`, `user`, `assistant` (Gemma's template writes
/// `model` for `assistant`), `tool` (a call's result; `name` says whose).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant message's calls.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message's function name.
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            name: None,
        }
    }

    /// An assistant turn that calls tools (with any text before the calls).
    pub fn assistant_calls(content: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        Message {
            tool_calls: calls,
            ..Self::new("assistant", content)
        }
    }

    /// A call's result, fed back to the model.
    pub fn tool(name: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            name: Some(name.into()),
            ..Self::new("tool", content)
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Where a tokenizer's chat template came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    /// The file's `tokenizer.chat_template`.
    File,
    /// The file has none; this published template matches its vocabulary's turn tokens.
    Builtin(&'static str),
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source_text: Arc<str>,
    source: TemplateSource,
    bos_token: String,
    eos_token: String,
    /// Renders conversations with tools where this template has no tool syntax: the family's
    /// default ([`GEMMA3_TOOLS_TEMPLATE`], [`CHATML_TOOLS_TEMPLATE`]).
    tool_template: Option<Arc<ChatTemplate>>,
    /// How calls are written in conversations with tools.
    tool_format: Option<ToolFormat>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `template`; `bos_token` and `eos_token` are the texts the template may write.
    pub fn new(template: &str, source: TemplateSource, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(template_error)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        // Hugging Face's `tojson` is Python's `json.dumps` (`", "`, `": "`, no HTML escaping),
        // which Qwen-style templates write the tools with; minijinja's own differs.
        env.add_filter("tojson", |v: Value, _options: minijinja::value::Kwargs| {
            to_json(&v).map(|j| Value::from_safe_string(tools::python_json(&j)))
        });
        env.add_filter("functiongemma_schema", |v: Value| {
            to_json(&v).map(|j| tools::functiongemma_schema(&j))
        });
        env.add_filter("functiongemma_value", |v: Value| {
            to_json(&v).map(|j| tools::functiongemma_value(&j))
        });
        // A result's text: a JSON object as FunctionGemma writes objects, anything else as one
        // escaped value.
        env.add_filter("functiongemma_response", |content: String| {
            match serde_json::from_str::<serde_json::Value>(&content) {
                Ok(j @ serde_json::Value::Object(_)) => tools::functiongemma_value(&j),
                _ => tools::functiongemma_value(&serde_json::json!({ "value": content })),
            }
        });
        env.add_template_owned(NAME, template.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            source_text: template.into(),
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            tool_template: None,
            tool_format: None,
        })
    }

    /// Whether the template itself reads `tools` (Qwen 2.5's does; Gemma 3's and SmolLM2's do not).
    pub fn has_tool_syntax(&self) -> bool {
        self.source_text.contains("tools")
    }

    /// How calls are written when tools are given; `None` when neither the template nor the
    /// vocabulary's family says.
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.tool_format
    }

    /// The template that renders conversations with tools: this one when it has tool syntax,
    /// else its family's default.
    pub fn tool_template(&self) -> Option<&ChatTemplate> {
        match &self.tool_template {
            Some(t) => Some(t),
            None if self.has_tool_syntax() => Some(self),
            None => None,
        }
    }

    /// The file's template, else the published one its vocabulary's turn tokens call for.
    pub(crate) fn detect(template: Option<&str>, tok: &Tokenizer) -> Result<Option<Self>> {
        let (text, source) = match template {
            Some(t) => (t, TemplateSource::File),
            None if tok.has_tokens(&["<start_of_turn>", "<end_of_turn>"]) => {
                (GEMMA3_TEMPLATE, TemplateSource::Builtin("gemma3"))
            }
            None if tok.has_tokens(&["<|im_start|>", "<|im_end|>"]) => {
                (CHATML_TEMPLATE, TemplateSource::Builtin("chatml"))
            }
            None => return Ok(None),
        };
        let text_of = |id: Option<i32>| id.and_then(|id| tok.token_text(id)).unwrap_or("").to_string();
        let (bos, eos) = (text_of(tok.bos()), text_of(tok.eos()));
        let mut chat = Self::new(text, source, &bos, &eos)?;
        // The family's tool syntax: FunctionGemma's for Gemma's turn tokens, Hermes' for ChatML's.
        let family = if tok.has_tokens(&["<start_of_turn>", "<end_of_turn>"]) {
            Some((ToolFormat::FunctionGemma, GEMMA3_TOOLS_TEMPLATE, "gemma3-tools"))
        } else if tok.has_tokens(&["<|im_start|>", "<|im_end|>"]) && text.contains("named SmolLM") {
            // SmolLM2-Instruct was tuned on its own prompt and list-of-calls format, not Qwen's.
            Some((ToolFormat::Hermes, SMOLLM2_TOOLS_TEMPLATE, "smollm2-tools"))
        } else if tok.has_tokens(&["<|im_start|>", "<|im_end|>"]) {
            Some((ToolFormat::Hermes, CHATML_TOOLS_TEMPLATE, "chatml-tools"))
        } else {
            None
        };
        chat.tool_format = if chat.has_tool_syntax() {
            if text.contains("start_function_call") {
                Some(ToolFormat::FunctionGemma)
            } else if text.contains("<tool_call>") {
                Some(ToolFormat::Hermes)
            } else {
                family.map(|f| f.0)
            }
        } else if let Some((format, default, name)) = family {
            chat.tool_template = Some(Arc::new(Self::new(default, TemplateSource::Builtin(name), &bos, &eos)?));
            Some(format)
        } else {
            None
        };
        Ok(Some(chat))
    }

    pub fn source(&self) -> TemplateSource {
        self.source
    }

    /// The Jinja text.
    pub fn text(&self) -> &str {
        &self.source_text
    }

    /// The template's output for `messages`, as Hugging Face's `apply_chat_template(...,
    /// tokenize=False)` gives it (a leading `{{ bos_token }}` included).
    ///
    /// The string cannot tell the template's markers from look-alikes inside a message:
    /// tokenize conversations with [`crate::Tokenizer::encode_chat`], which can.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Self::render`] with a tool catalog, given to the template as `tools` (as Hugging Face's
    /// `apply_chat_template(tools=…)` does). Call on [`Self::tool_template`].
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| message_value(m, &mut |s| s.to_string()))
            .collect();
        let tools: Vec<serde_json::Value> = tools.iter().map(Tool::to_json).collect();
        self.render_values(messages, tools, add_generation_prompt)
    }

    fn render_values(
        &self,
        messages: Vec<Value>,
        tools: Vec<serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        // `none` without tools: templates test `{% if tools %}` (Hugging Face passes `None`).
        let tools = if tools.is_empty() {
            Value::from(())
        } else {
            Value::from(minijinja::value::Serde(&tools))
        };
        let context = BTreeMap::from([
            ("messages", Value::from(messages)),
            ("tools", tools),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ]);
        self.env
            .get_template(NAME)
            .and_then(|t| t.render(Value::from(context)))
            .map_err(template_error)
    }

    /// The end-of-turn token's text: the first of llama.cpp's known turn closers that this
    /// template writes.
    pub fn end_of_turn(&self) -> Option<&'static str> {
        END_OF_TURN_TOKENS.into_iter().find(|t| self.source_text.contains(t))
    }
}

fn template_error(e: minijinja::Error) -> Error {
    Error::Template(e.to_string())
}

fn to_json(v: &Value) -> std::result::Result<serde_json::Value, minijinja::Error> {
    serde_json::to_value(v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// Every string of `value` (keys too) through `f`.
fn map_strings(value: &serde_json::Value, f: &mut dyn FnMut(&str) -> String) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        J::String(s) => J::String(f(s)),
        J::Array(items) => J::Array(items.iter().map(|v| map_strings(v, f)).collect()),
        J::Object(map) => J::Object(map.iter().map(|(k, v)| (f(k), map_strings(v, f))).collect()),
        other => other.clone(),
    }
}

/// A message as templates read it: `role`, `content`, and `tool_calls` (`[{"type": "function",
/// "function": {"name", "arguments": {…}}}]`) / `name` where present; every text through `f`.
fn message_value(m: &Message, f: &mut dyn FnMut(&str) -> String) -> Value {
    let mut map = BTreeMap::from([
        ("role", Value::from(f(&m.role))),
        ("content", Value::from(f(&m.content))),
    ]);
    if !m.tool_calls.is_empty() {
        let calls: Vec<serde_json::Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                serde_json::json!({"type": "function", "function": {
                    "name": f(&c.name),
                    "arguments": map_strings(&serde_json::Value::Object(c.arguments.clone()), f),
                }})
            })
            .collect();
        map.insert("tool_calls", Value::from(minijinja::value::Serde(&calls)));
    }
    if let Some(name) = &m.name {
        map.insert("name", Value::from(f(name)));
    }
    Value::from(map)
}

/// A piece of a rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatPiece {
    /// A control token the template writes (`<start_of_turn>`, `<|im_end|>`, ...), by id.
    Marker(i32),
    /// Everything else, message contents included: plain text, whatever it contains.
    Text(String),
}

impl Tokenizer {
    fn has_tokens(&self, texts: &[&str]) -> bool {
        texts.iter().all(|t| self.token_id(t).is_some())
    }

    fn chat(&self) -> Result<&ChatTemplate> {
        match (&self.chat, &self.chat_error) {
            (Some(chat), _) => Ok(chat),
            (None, Some(e)) => Err(Error::Template(format!("the file's template does not compile: {e}"))),
            (None, None) => Err(Error::Unsupported("the model has no chat template".into())),
        }
    }

    /// The rendered conversation as pieces: the control tokens the template writes apart from
    /// text, so that only those become control tokens. A leading BOS is dropped (see the module
    /// notes).
    pub fn chat_pieces(&self, messages: &[Message], add_generation_prompt: bool) -> Result<Vec<ChatPiece>> {
        self.chat_pieces_with_tools(messages, &[], add_generation_prompt)
    }

    /// The template that renders `messages` with `tools`: the file's, or its family's tool
    /// template where the file's has no tool syntax and the conversation uses tools.
    pub fn chat_template_for(&self, messages: &[Message], tools: &[Tool]) -> Result<&ChatTemplate> {
        let template = self.chat()?;
        let uses_tools = !tools.is_empty() || messages.iter().any(|m| m.role == "tool" || !m.tool_calls.is_empty());
        if !uses_tools {
            return Ok(template);
        }
        template.tool_template().ok_or_else(|| {
            Error::Unsupported("the model's chat template has no tool syntax and its family no default".into())
        })
    }

    /// [`Self::chat_pieces`] with a tool catalog (see [`ChatTemplate::render_with_tools`]). Tool
    /// names, descriptions, schemas and call arguments are plain text as message contents are.
    pub fn chat_pieces_with_tools(
        &self,
        messages: &[Message],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<Vec<ChatPiece>> {
        let template = self.chat_template_for(messages, tools)?;
        let mut originals = Vec::new();
        let mut escape = |s: &str| self.escape(s, &mut originals);
        let escaped: Vec<Value> = messages.iter().map(|m| message_value(m, &mut escape)).collect();
        let tools: Vec<serde_json::Value> = tools.iter().map(|t| map_strings(&t.to_json(), &mut escape)).collect();
        let rendered = template.render_values(escaped, tools, add_generation_prompt)?;
        let mut pieces = Vec::new();
        for frag in self.partition(&rendered, true) {
            match frag {
                Fragment::Token(id) if self.is_control_like(id) => pieces.push(ChatPiece::Marker(id)),
                Fragment::Token(id) => push_text(&mut pieces, self.token_text(id).unwrap_or_default()),
                Fragment::Text(t) => push_text(&mut pieces, &unescape(t, &originals)?),
            }
        }
        // Only a BOS the tokenizer adds again is dropped: SmolLM2's BOS *is* `<|im_start|>`, which
        // its template writes to open the first turn, and it adds no BOS of its own.
        if let (Some(ChatPiece::Marker(first)), Some(bos)) = (pieces.first(), self.bos()) {
            if *first == bos && self.add_bos_default() {
                pieces.remove(0);
            }
        }
        Ok(pieces)
    }

    /// Control and unknown tokens: the ones `parse_special` decides about.
    fn is_control_like(&self, id: i32) -> bool {
        matches!(self.token_type(id), Some(TokenType::Control | TokenType::Unknown))
    }

    /// `text` with each control-like token and each [`ESCAPE`] replaced by a placeholder that
    /// indexes `originals`.
    fn escape(&self, text: &str, originals: &mut Vec<String>) -> String {
        let mut out = String::with_capacity(text.len());
        let mut placeholder = |original: &str, out: &mut String| {
            out.push(ESCAPE);
            out.push_str(&originals.len().to_string());
            out.push(ESCAPE);
            originals.push(original.to_string());
        };
        for frag in self.partition(text, true) {
            match frag {
                Fragment::Token(id) if self.is_control_like(id) => {
                    placeholder(self.token_text(id).unwrap_or_default(), &mut out)
                }
                Fragment::Token(id) => out.push_str(self.token_text(id).unwrap_or_default()),
                Fragment::Text(t) => {
                    for (i, part) in t.split(ESCAPE).enumerate() {
                        if i > 0 {
                            placeholder(&ESCAPE.to_string(), &mut out);
                        }
                        out.push_str(part);
                    }
                }
            }
        }
        out
    }
}

/// Adjacent text joined, so that text tokenizes as one run, as in the whole string.
fn push_text(pieces: &mut Vec<ChatPiece>, text: &str) {
    if text.is_empty() {
        return;
    }
    match pieces.last_mut() {
        Some(ChatPiece::Text(t)) => t.push_str(text),
        _ => pieces.push(ChatPiece::Text(text.to_string())),
    }
}

fn unescape(text: &str, originals: &[String]) -> Result<String> {
    let cut = || Error::Template("the template cut a message's text apart (a placeholder is incomplete)".into());
    let mut out = String::with_capacity(text.len());
    let mut parts = text.split(ESCAPE);
    out.push_str(parts.next().unwrap_or_default());
    while let Some(index) = parts.next() {
        let original = index
            .parse::<usize>()
            .ok()
            .and_then(|i| originals.get(i))
            .ok_or_else(cut)?;
        out.push_str(original);
        out.push_str(parts.next().ok_or_else(cut)?);
    }
    Ok(out)
}
