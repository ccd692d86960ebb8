//! Chat templates: Gemma's turns and ChatML (SmolLM2), rendered as their Jinja templates do with
//! `add_generation_prompt = true`, without the BOS (the tokenizer adds it when the model wants it).

use std::collections::HashMap;

use crate::{Error, Result};

/// One message of a conversation. Roles: `system`, `user`, `assistant` (Gemma calls it `model`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
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

/// The chat format of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// Gemma 3: `<start_of_turn>user\n{content}<end_of_turn>\n` ... `<start_of_turn>model\n`; a
    /// system message is prepended to the first user turn followed by a blank line; contents are
    /// trimmed; `assistant` is written `model`.
    Gemma,
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` ... `<|im_start|>assistant\n`;
    /// `default_system` is inserted first when the conversation has no system message (SmolLM2's
    /// template does this).
    ChatMl { default_system: Option<String> },
    /// No known template.
    None,
}

impl ChatTemplate {
    /// From the file's `tokenizer.chat_template`, else from the vocabulary's turn tokens.
    pub(crate) fn detect(template: Option<&str>, vocab: &HashMap<String, i32>) -> Self {
        if let Some(t) = template {
            if t.contains("<|im_start|>") {
                return ChatTemplate::ChatMl {
                    default_system: chatml_default_system(t),
                };
            }
            if t.contains("<start_of_turn>") {
                return ChatTemplate::Gemma;
            }
        }
        if vocab.contains_key("<start_of_turn>") && vocab.contains_key("<end_of_turn>") {
            ChatTemplate::Gemma
        } else if vocab.contains_key("<|im_start|>") && vocab.contains_key("<|im_end|>") {
            ChatTemplate::ChatMl { default_system: None }
        } else {
            ChatTemplate::None
        }
    }

    /// The token closing a turn.
    pub fn end_of_turn(&self) -> Option<&'static str> {
        match self {
            ChatTemplate::Gemma => Some("<end_of_turn>"),
            ChatTemplate::ChatMl { .. } => Some("<|im_end|>"),
            ChatTemplate::None => None,
        }
    }

    /// Renders `messages` followed by the opener of the model's turn.
    pub fn apply(&self, messages: &[Message]) -> Result<String> {
        let mut out = String::new();
        match self {
            ChatTemplate::Gemma => {
                let (prefix, rest) = match messages.first() {
                    Some(m) if m.role == "system" => (format!("{}\n\n", m.content.trim()), &messages[1..]),
                    _ => (String::new(), messages),
                };
                for (i, m) in rest.iter().enumerate() {
                    let role = match m.role.as_str() {
                        "assistant" | "model" => "model",
                        "user" => "user",
                        other => return Err(Error::Invalid(format!("Gemma has no `{other}` role here"))),
                    };
                    let expect_user = i % 2 == 0;
                    if (role == "user") != expect_user {
                        return Err(Error::Invalid("Gemma turns must alternate user/model".into()));
                    }
                    out.push_str("<start_of_turn>");
                    out.push_str(role);
                    out.push('\n');
                    if i == 0 {
                        out.push_str(&prefix);
                    }
                    out.push_str(m.content.trim());
                    out.push_str("<end_of_turn>\n");
                }
                out.push_str("<start_of_turn>model\n");
            }
            ChatTemplate::ChatMl { default_system } => {
                if let (Some(sys), false) = (default_system, messages.first().is_some_and(|m| m.role == "system")) {
                    out.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
                }
                for m in messages {
                    out.push_str(&format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content));
                }
                out.push_str("<|im_start|>assistant\n");
            }
            ChatTemplate::None => return Err(Error::Unsupported("the model has no known chat template".into())),
        }
        Ok(out)
    }
}

/// The system prompt a ChatML template inserts when the conversation has none: the literal
/// `'<|im_start|>system\n...<|im_end|>` inside `{% if loop.first and messages[0]['role'] != 'system' %}`.
fn chatml_default_system(template: &str) -> Option<String> {
    let cond = template
        .find("!= 'system'")
        .or_else(|| template.find("!= \"system\""))?;
    let rest = &template[cond..];
    let open = "<|im_start|>system\n";
    let start = rest.find(open)? + open.len();
    let end = rest[start..].find("<|im_end|>")? + start;
    Some(rest[start..end].to_string())
}
