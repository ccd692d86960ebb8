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

    /// Renders `messages` followed by the opener of the model's turn, as one string.
    ///
    /// The string cannot tell the template's markers from look-alikes inside a message:
    /// tokenize conversations with [`crate::Tokenizer::encode_chat`], which can.
    pub fn apply(&self, messages: &[Message]) -> Result<String> {
        Ok(self
            .render(messages)?
            .iter()
            .map(|piece| match piece {
                ChatPiece::Marker(m) => *m,
                ChatPiece::Text(t) => t.as_str(),
            })
            .collect())
    }

    /// [`ChatTemplate::apply`] as pieces: the template's own turn markers apart from text
    /// (message contents joined with the template's role names and newlines), so that only the
    /// markers become control tokens.
    pub fn render(&self, messages: &[Message]) -> Result<Vec<ChatPiece>> {
        let mut out = Pieces::default();
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
                    out.marker("<start_of_turn>");
                    out.text(role);
                    out.text("\n");
                    if i == 0 {
                        out.text(&prefix);
                    }
                    out.text(m.content.trim());
                    out.marker("<end_of_turn>");
                    out.text("\n");
                }
                out.marker("<start_of_turn>");
                out.text("model\n");
            }
            ChatTemplate::ChatMl { default_system } => {
                if let (Some(sys), false) = (default_system, messages.first().is_some_and(|m| m.role == "system")) {
                    out.marker("<|im_start|>");
                    out.text(&format!("system\n{sys}"));
                    out.marker("<|im_end|>");
                    out.text("\n");
                }
                for m in messages {
                    out.marker("<|im_start|>");
                    out.text(&format!("{}\n{}", m.role, m.content));
                    out.marker("<|im_end|>");
                    out.text("\n");
                }
                out.marker("<|im_start|>");
                out.text("assistant\n");
            }
            ChatTemplate::None => return Err(Error::Unsupported("the model has no known chat template".into())),
        }
        Ok(out.0)
    }
}

/// A piece of a rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatPiece {
    /// A turn marker the template writes (`<start_of_turn>`, `<|im_end|>`, ...): a control token.
    Marker(&'static str),
    /// Everything else, message contents included: plain text, whatever it contains.
    Text(String),
}

/// Rendered pieces, adjacent text joined (so text tokenizes as one run, as in the whole string).
#[derive(Default)]
struct Pieces(Vec<ChatPiece>);

impl Pieces {
    fn marker(&mut self, marker: &'static str) {
        self.0.push(ChatPiece::Marker(marker));
    }

    fn text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some(ChatPiece::Text(t)) => t.push_str(text),
            _ => self.0.push(ChatPiece::Text(text.to_string())),
        }
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
