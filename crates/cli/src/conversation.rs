//! Conversations with a system text and tools: the flags `generate`, `snapshot save`, `bench` and
//! `demo` share (`--system`, `--system-file`, `--tools`), OpenAI-style message files
//! (`--messages`), the shared prefix cut out of a rendered conversation, and the answer parsed
//! into tool calls.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use serde_json::Value as Json;
use tokenizer::tools::{self, ToolCall};
use tokenizer::{Message, PromptSplit, Tokenizer, Tool, ToolChoice, ToolFormat};

/// `--system TEXT` | `--system-file FILE`, and `--tools FILE`: what the shared prefix is made of.
#[derive(Args, Clone, Debug, Default)]
pub struct SystemArgs {
    /// The system text: the start of the shared prefix, before the tools' declarations.
    #[arg(long, conflicts_with = "system_file")]
    pub system: Option<String>,
    /// The system text, from a file.
    #[arg(long)]
    pub system_file: Option<PathBuf>,
    /// A tool catalog: a JSON list of `{"type": "function", "function": {"name", "description",
    /// "parameters": JSON Schema}}`, rendered through the chat template's `tools` (the family's
    /// default tool syntax where the template has none: docs/tool-calling.md).
    #[arg(long)]
    pub tools: Option<PathBuf>,
}

impl SystemArgs {
    pub fn given(&self) -> bool {
        self.system.is_some() || self.system_file.is_some() || self.tools.is_some()
    }

    pub fn system(&self) -> Result<Option<String>> {
        match (&self.system, &self.system_file) {
            (Some(text), _) => Ok(Some(text.clone())),
            (None, Some(file)) => crate::text::read_text_file("--system-file", file).map(Some),
            (None, None) => Ok(None),
        }
    }

    pub fn catalog(&self) -> Result<Vec<Tool>> {
        match &self.tools {
            Some(file) => read_catalog(file),
            None => Ok(Vec::new()),
        }
    }
}

pub fn read_catalog(file: &Path) -> Result<Vec<Tool>> {
    let text = crate::text::read_text_file("--tools", file)?;
    tools::parse_catalog(&text).with_context(|| format!("--tools {}", file.display()))
}

/// Reads an OpenAI-style message list: `role`, `content` (text, `null`, or a list of `{"type":
/// "text", "text"}` parts), an assistant's `tool_calls` (`{"function": {"name", "arguments"}}`,
/// the arguments an object or a JSON string) and a tool result's `name` (or its `tool_call_id`,
/// looked up among the calls before it).
pub fn read_messages(file: &Path) -> Result<Vec<Message>> {
    let text = crate::text::read_text_file("--messages", file)?;
    parse_messages(&text).with_context(|| format!("--messages {}", file.display()))
}

pub fn parse_messages(text: &str) -> Result<Vec<Message>> {
    let list: Vec<Json> = serde_json::from_str(text).context("not a JSON list of messages")?;
    let mut ids: Vec<(String, String)> = Vec::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m["role"].as_str().with_context(|| format!("message {i}: no role"))?;
        let content = match &m["content"] {
            Json::Null => String::new(),
            Json::String(s) => s.clone(),
            Json::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
            other => bail!("message {i}: content {other} is no text"),
        };
        let mut message = Message::new(role, content);
        if let Some(calls) = m["tool_calls"].as_array() {
            for c in calls {
                let f = if c["function"].is_object() { &c["function"] } else { c };
                let name = f["name"]
                    .as_str()
                    .with_context(|| format!("message {i}: a tool call without a name"))?;
                let arguments = match &f["arguments"] {
                    Json::Null => serde_json::Map::new(),
                    Json::Object(m) => m.clone(),
                    Json::String(s) => match serde_json::from_str(s) {
                        Ok(Json::Object(m)) => m,
                        _ => bail!("message {i}: arguments of {name} are no JSON object"),
                    },
                    other => bail!("message {i}: arguments of {name} are {other}, no object"),
                };
                if let Some(id) = c["id"].as_str() {
                    ids.push((id.to_string(), name.to_string()));
                }
                message.tool_calls.push(ToolCall {
                    name: name.to_string(),
                    arguments,
                });
            }
        }
        if role == "tool" {
            let by_id = m["tool_call_id"]
                .as_str()
                .and_then(|id| ids.iter().find(|(i, _)| i == id).map(|(_, n)| n.clone()));
            let name = m["name"]
                .as_str()
                .map(String::from)
                .or(by_id)
                .with_context(|| format!("message {i}: a tool result needs `name` or a known `tool_call_id`"))?;
            message.name = Some(name);
        }
        out.push(message);
    }
    if out.is_empty() {
        bail!("no messages");
    }
    Ok(out)
}

/// A conversation: the system text (a message of its own), the tools, the rest.
pub struct Conversation {
    pub system: Option<String>,
    pub tools: Vec<Tool>,
    pub messages: Vec<Message>,
}

impl Conversation {
    /// `system` goes first unless the messages open with their own (both is an error).
    pub fn new(system: Option<String>, tools: Vec<Tool>, messages: Vec<Message>) -> Result<Self> {
        let own = messages
            .first()
            .filter(|m| m.role == "system")
            .map(|m| m.content.clone());
        let (system, messages) = match (system, own) {
            (Some(_), Some(_)) => bail!("--system and a system message in --messages: give one"),
            (Some(s), None) => (Some(s.clone()), [vec![Message::system(s)], messages].concat()),
            (None, own) => (own, messages),
        };
        Ok(Conversation {
            system,
            tools,
            messages,
        })
    }

    pub fn ids(&self, tok: &Tokenizer) -> Result<Vec<i32>> {
        Ok(tok.encode_chat_with_tools(&self.messages, &self.tools)?)
    }

    pub fn split(&self, tok: &Tokenizer) -> Result<PromptSplit> {
        tok.split_chat(&self.messages, &self.tools)
            .context("cutting the conversation after its system turn")
    }

    pub fn digest(&self, tok: &Tokenizer) -> Result<String> {
        Ok(tok.prefix_digest(self.system.as_deref(), &self.tools)?)
    }
}

/// The shared prefix of every conversation with this system text and these tools, and its
/// digest: what `snapshot save`, `demo` and `bench` prefill.
pub fn prefix(tok: &Tokenizer, system: Option<String>, tools: Vec<Tool>) -> Result<(Vec<i32>, String)> {
    let conversation = Conversation::new(system, tools, vec![Message::user("-")])?;
    Ok((conversation.split(tok)?.prefix, conversation.digest(tok)?))
}

/// A decoded answer: text and calls, each call validated against the catalog.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Answer {
    /// The text outside calls.
    pub text: String,
    /// Calls that parse and validate: `{"name", "arguments"}`.
    pub tool_calls: Vec<Json>,
    /// Calls that do not parse or validate, why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub invalid_tool_calls: Vec<String>,
    /// Where the output breaks `--tool-choice` (no grammar enforces it yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice_error: Option<String>,
    #[serde(skip)]
    pub calls: Vec<ToolCall>,
}

/// The answer `ids` parsed in `format` (control tokens rendered, so FunctionGemma's special
/// tokens are seen), checked against `tools` and `choice`.
pub fn parse_answer(tok: &Tokenizer, format: ToolFormat, ids: &[i32], tools: &[Tool], choice: &ToolChoice) -> Answer {
    let decoded = tok.decode_with(ids, true);
    // The stop tokens and turn markers are not part of the answer's text.
    let parsed = format.parse(&strip_markers(tok, &decoded));
    let mut answer = Answer {
        text: parsed.text,
        ..Answer::default()
    };
    for call in parsed.calls {
        match call.and_then(|c| tools::validate(&c, tools).map(|()| c)) {
            Ok(c) => {
                answer.tool_calls.push(c.to_json());
                answer.calls.push(c);
            }
            Err(e) => answer.invalid_tool_calls.push(e.to_string()),
        }
    }
    let attempted = !answer.calls.is_empty() || !answer.invalid_tool_calls.is_empty();
    answer.tool_choice_error = match choice {
        ToolChoice::None if attempted => Some("the tool choice is `none` but the output calls a tool".into()),
        _ => choice.check(&answer.calls).err(),
    };
    answer
}

/// `text` without the vocabulary's control tokens that are not part of a call format (BOS, EOS,
/// turn markers).
fn strip_markers(tok: &Tokenizer, text: &str) -> String {
    let mut out = text.to_string();
    for id in tok.stop_tokens().into_iter().chain(tok.bos()) {
        if let Some(t) = tok.token_text(id) {
            out = out.replace(t, "");
        }
    }
    out
}

/// The model's stop tokens, plus `<start_function_response>` where the vocabulary has it as one
/// token (FunctionGemma's): the model would go on to invent the result (Google lists it as a stop
/// sequence). Not `<end_function_call>`: parallel calls follow one another.
pub fn stops(tok: &Tokenizer, format: Option<ToolFormat>) -> Vec<i32> {
    let mut stops = tok.stop_tokens();
    if format == Some(ToolFormat::FunctionGemma) {
        stops.extend(tok.token_id("<start_function_response>"));
    }
    stops
}

/// The tool format of `tok`, or an error naming the model.
pub fn format_of(tok: &Tokenizer, model: &str) -> Result<ToolFormat> {
    tok.tool_format()
        .with_context(|| format!("{model}'s chat template and vocabulary say no tool-call format"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_messages_with_calls_and_results_parse() {
        let m = parse_messages(
            r#"[{"role": "user", "content": "Lights off"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "set_lights", "arguments": "{\"on\": false}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"ok\": true}"}]"#,
        )
        .unwrap();
        assert_eq!(m[1].tool_calls[0].name, "set_lights");
        assert_eq!(m[1].tool_calls[0].arguments["on"], Json::Bool(false));
        assert_eq!(m[2].name.as_deref(), Some("set_lights"));
        assert!(parse_messages(r#"[{"role": "tool", "content": "x"}]"#).is_err());
    }

    #[test]
    fn a_system_text_and_a_system_message_conflict() {
        let messages = vec![Message::system("a"), Message::user("b")];
        assert!(Conversation::new(Some("c".into()), vec![], messages.clone()).is_err());
        let c = Conversation::new(None, vec![], messages).unwrap();
        assert_eq!(c.system.as_deref(), Some("a"));
    }
}
