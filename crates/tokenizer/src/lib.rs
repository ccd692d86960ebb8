//! Tokenizers read from GGUF metadata that give the ids llama.cpp gives.
//!
//! - `tokenizer.ggml.model = "llama"`: llama.cpp's SentencePiece-style tokenizer (Gemma): spaces
//!   become `▁`, the highest-scoring adjacent pair that is a token is merged until none is left,
//!   pieces that are not tokens fall back to `<0xXX>` byte tokens.
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE with ranked merges (SmolLM2), after the
//!   pre-tokenizer split that `tokenizer.ggml.pre` names (`gpt2`; `smollm`/`starcoder`-style
//!   with every digit on its own; `llama-bpe` (Llama 3); `qwen2` (Qwen 2.5 and 3)).
//!
//! Both first cut special tokens out of the text (llama.cpp's `tokenizer_st_partition`): control,
//! user-defined and unknown tokens, longest first; with `parse_special` off only user-defined ones.
//! The algorithms are transcriptions of llama.cpp's `llama-vocab.cpp` and `unicode.cpp`.

mod bpe;
mod chat;
mod spm;
pub mod tools;
pub mod unicode;
mod vocab;

use std::collections::HashMap;

use gguf::GgufFile;
use vocab::Vocab;

pub use chat::{
    ChatPiece, ChatTemplate, Message, TemplateSource, CHATML_TEMPLATE, CHATML_TOOLS_TEMPLATE, GEMMA3_TEMPLATE,
    GEMMA3_TOOLS_TEMPLATE, SMOLLM2_TEMPLATE, SMOLLM2_TOOLS_TEMPLATE,
};
pub use tools::{Tool, ToolCall, ToolChoice, ToolError, ToolFormat};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("tokenizer: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Invalid(String),
    /// The chat template failed to compile or render (`raise_exception` included).
    #[error("chat template: {0}")]
    Template(String),
    /// A conversation's ids do not start with its prefix's ids (the template or the tokenizer
    /// joins the prefix's last text with what follows), so the prefix cannot be fed apart.
    #[error("chat template: the prefix does not split cleanly: {0}")]
    PromptSplit(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    pub fn from_id(id: i64) -> Self {
        match id {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }
}

/// Which algorithm the vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// SentencePiece-style, scores (`"llama"`).
    Spm,
    /// Byte-level BPE, merges (`"gpt2"`).
    Bpe(PreSplit),
}

/// The BPE pre-tokenizer split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreSplit {
    /// GPT-2's regex.
    Gpt2,
    /// Every `\p{N}` alone, then GPT-2's regex (`smollm`, `starcoder`, `refact`, ...).
    DigitsThenGpt2,
    /// Llama 3's regex (`llama-bpe`, `llama3`): contractions in either case, letters after at
    /// most one other character, numbers in runs of up to three, `\r`/`\n` kept with what
    /// precedes them; a word that is itself a token is not merged (llama.cpp's `ignore_merges`).
    Llama3,
    /// Qwen2's regex (`qwen2`: Qwen 2.5, Qwen 3): Llama 3's with every number alone.
    Qwen2,
}

impl PreSplit {
    /// The `tokenizer.ggml.pre` names llama.cpp gives this split, each checked against it
    /// (`tests/data/llama_cpp_goldens.json`, `llama_cpp_pre_goldens.json`).
    fn of_name(pre: &str) -> Option<PreSplit> {
        Some(match pre {
            "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
            | "jina-v2-code" | "roberta-bpe" => PreSplit::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
                PreSplit::DigitsThenGpt2
            }
            "llama3" | "llama-v3" | "llama-bpe" => PreSplit::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreSplit::Qwen2,
            _ => return None,
        })
    }
}

/// A tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    kind: Kind,
    tokens: Vocab,
    scores: Vec<f32>,
    types: Vec<TokenType>,
    /// Control, user-defined and unknown tokens, longest text first (ties: lower id first).
    specials: Vec<i32>,
    bpe_ranks: HashMap<(String, String), u32>,
    bos: Option<i32>,
    eos: Option<i32>,
    add_bos: bool,
    add_space_prefix: bool,
    chat: Option<ChatTemplate>,
    /// Why the file's chat template could not be compiled: plain tokenizing still works, chat
    /// requests report this.
    chat_error: Option<String>,
}

impl Tokenizer {
    /// Reads the vocabulary of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.get_str("tokenizer.ggml.model")?;
        let texts = file.get_str_array("tokenizer.ggml.tokens")?;
        let n = texts.len();
        if n == 0 || n > i32::MAX as usize {
            return Err(Error::Invalid(format!("{n} tokens")));
        }
        let tokens = Vocab::new(texts).ok_or_else(|| Error::Invalid("token texts beyond 4 GiB".into()))?;
        let scores = match file.get("tokenizer.ggml.scores") {
            Some(_) => file.get_f32_array("tokenizer.ggml.scores")?,
            None => vec![0.0; n],
        };
        let types: Vec<TokenType> = match file.get("tokenizer.ggml.token_type") {
            Some(_) => file
                .get_i64_array("tokenizer.ggml.token_type")?
                .into_iter()
                .map(TokenType::from_id)
                .collect(),
            None => vec![TokenType::Normal; n],
        };
        if scores.len() != n || types.len() != n {
            return Err(Error::Invalid(format!(
                "{n} tokens but {} scores and {} token types",
                scores.len(),
                types.len()
            )));
        }
        let id = |key: &str| -> Result<Option<i32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => match v.as_i64() {
                    Some(i) if (0..n as i64).contains(&i) => Ok(Some(i as i32)),
                    // llama.cpp writes -1 (as u32 0xFFFFFFFF) for "none".
                    Some(-1) | Some(0xFFFF_FFFF) => Ok(None),
                    _ => Err(Error::Invalid(format!("{key} = {v:?} is not a token id"))),
                },
            }
        };
        let flag = |key: &str, default: bool| file.get(key).and_then(|v| v.as_bool()).unwrap_or(default);

        let (kind, bpe_ranks, bos_default, eos_default) = match model {
            "llama" => (Kind::Spm, HashMap::new(), Some(1), Some(2)),
            "gpt2" => {
                let pre = file
                    .get("tokenizer.ggml.pre")
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                let split = PreSplit::of_name(pre).ok_or_else(|| {
                    Error::Unsupported(format!(
                        "BPE pre-tokenizer `{pre}` (supported: gpt2-style, smollm/starcoder-style, \
                         llama-bpe, qwen2)"
                    ))
                })?;
                let merges = file.get_str_array("tokenizer.ggml.merges")?;
                let mut ranks = HashMap::with_capacity(merges.len());
                for (rank, m) in merges.iter().enumerate() {
                    // llama.cpp splits at the first space after position 0.
                    let Some(pos) = m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                        return Err(Error::Invalid(format!("merge {rank} `{m}` has no space")));
                    };
                    ranks
                        .entry((m[..pos].to_string(), m[pos + 1..].to_string()))
                        .or_insert(rank as u32);
                }
                (Kind::Bpe(split), ranks, Some(11), Some(11))
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "tokenizer model `{other}` (supported: llama, gpt2)"
                )))
            }
        };
        let bos = if file.get("tokenizer.ggml.bos_token_id").is_some() {
            id("tokenizer.ggml.bos_token_id")?
        } else {
            bos_default.filter(|&b| (b as usize) < n)
        };
        let eos = if file.get("tokenizer.ggml.eos_token_id").is_some() {
            id("tokenizer.ggml.eos_token_id")?
        } else {
            eos_default.filter(|&e| (e as usize) < n)
        };
        let add_bos = flag("tokenizer.ggml.add_bos_token", kind == Kind::Spm);
        let add_space_prefix = flag("tokenizer.ggml.add_space_prefix", kind == Kind::Spm);

        let mut specials: Vec<i32> = (0..n as i32)
            .filter(|&i| {
                matches!(
                    types[i as usize],
                    TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                )
            })
            .collect();
        let len = |id: i32| tokens.get(id as usize).map_or(0, str::len);
        specials.sort_by(|&a, &b| len(b).cmp(&len(a)).then(a.cmp(&b)));

        let mut tokenizer = Tokenizer {
            kind,
            tokens,
            scores,
            types,
            specials,
            bpe_ranks,
            bos,
            eos,
            add_bos,
            add_space_prefix,
            chat: None,
            chat_error: None,
        };
        let template = file.get("tokenizer.chat_template").and_then(|v| v.as_str());
        match ChatTemplate::detect(template, &tokenizer) {
            Ok(chat) => tokenizer.chat = chat,
            Err(e) => tokenizer.chat_error = Some(e.to_string()),
        }
        Ok(tokenizer)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos(&self) -> Option<i32> {
        self.bos
    }

    pub fn eos(&self) -> Option<i32> {
        self.eos
    }

    /// Whether the model wants a BOS before a prompt (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    /// The end-of-turn token of the chat template (`<end_of_turn>`, `<|im_end|>`), if any.
    pub fn eot(&self) -> Option<i32> {
        self.chat
            .as_ref()
            .and_then(ChatTemplate::end_of_turn)
            .and_then(|t| self.token_id(t))
    }

    /// Tokens that end generation: EOS and the end-of-turn token.
    pub fn stop_tokens(&self) -> Vec<i32> {
        let mut stops: Vec<i32> = self.eos.into_iter().chain(self.eot()).collect();
        stops.dedup();
        stops
    }

    pub fn token_id(&self, text: &str) -> Option<i32> {
        self.tokens.id(text)
    }

    pub fn token_text(&self, id: i32) -> Option<&str> {
        self.tokens.get(usize::try_from(id).ok()?)
    }

    pub fn token_type(&self, id: i32) -> Option<TokenType> {
        self.types.get(usize::try_from(id).ok()?).copied()
    }

    /// The chat template: the file's, else the published one its turn tokens call for.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// Tokenizes `text`, special tokens (`<start_of_turn>`, `<|im_start|>`, ...) parsed as single
    /// tokens; BOS first when `add_bos`. llama.cpp's `llama_tokenize(text, add_bos, true)`: for
    /// text the caller controls; end users' words go through [`Tokenizer::encode_chat`] or
    /// [`Tokenizer::encode_with`] without `parse_special`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Vec<i32> {
        self.encode_with(text, add_bos, true)
    }

    /// [`Tokenizer::encode`] with control tokens in `text` treated as plain text unless
    /// `parse_special` (user-defined tokens are always cut out, as llama.cpp does).
    pub fn encode_with(&self, text: &str, add_bos: bool, parse_special: bool) -> Vec<i32> {
        let mut out = Vec::new();
        if add_bos {
            if let Some(b) = self.bos {
                out.push(b);
            }
        }
        let mut is_prev_special = true;
        self.encode_into(text, parse_special, &mut out, &mut is_prev_special);
        out
    }

    /// Appends the ids of `text`; `is_prev_special` carries SentencePiece's space prefix rule
    /// across calls (a prefix after a special token, never inside a text run).
    fn encode_into(&self, text: &str, parse_special: bool, out: &mut Vec<i32>, is_prev_special: &mut bool) {
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    *is_prev_special = true;
                }
                Fragment::Text(t) => {
                    match self.kind {
                        Kind::Spm => {
                            let mut s = String::with_capacity(t.len() + 3);
                            if self.add_space_prefix && *is_prev_special {
                                s.push(' ');
                            }
                            s.push_str(t);
                            let escaped = s.replace(' ', "\u{2581}");
                            spm::tokenize(self, &escaped, out);
                        }
                        Kind::Bpe(split) => bpe::tokenize(self, split, t, out),
                    }
                    *is_prev_special = false;
                }
            }
        }
    }

    /// The bytes a token stands for. Control tokens give nothing unless `special`.
    pub fn token_bytes(&self, id: i32, special: bool) -> Vec<u8> {
        let (Some(text), Some(ty)) = (self.token_text(id), self.token_type(id)) else {
            return Vec::new();
        };
        match ty {
            TokenType::Control if !special => Vec::new(),
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => text.as_bytes().to_vec(),
            TokenType::Normal => match self.kind {
                Kind::Spm => text.replace('\u{2581}', " ").into_bytes(),
                Kind::Bpe(_) => bpe::decode_text(text),
            },
            TokenType::Byte => match self.kind {
                Kind::Spm => spm::byte_value(text).map(|b| vec![b]).unwrap_or_default(),
                Kind::Bpe(_) => bpe::decode_text(text),
            },
            TokenType::Unused | TokenType::Undefined => Vec::new(),
        }
    }

    /// The text of `ids`, control tokens skipped; invalid UTF-8 is replaced.
    pub fn decode(&self, ids: &[i32]) -> String {
        self.decode_with(ids, false)
    }

    /// [`Tokenizer::decode`], rendering control tokens when `special`.
    pub fn decode_with(&self, ids: &[i32], special: bool) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id, special)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The prompt text of a conversation, ending with the model's turn opener, without the BOS.
    pub fn apply_chat(&self, messages: &[Message]) -> Result<String> {
        self.apply_chat_with(messages, true)
    }

    /// [`Tokenizer::apply_chat`], the model's turn opener only when `add_generation_prompt`.
    pub fn apply_chat_with(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        Ok(self
            .chat_pieces(messages, add_generation_prompt)?
            .iter()
            .map(|piece| match piece {
                ChatPiece::Marker(id) => self.token_text(*id).unwrap_or_default(),
                ChatPiece::Text(t) => t.as_str(),
            })
            .collect())
    }

    /// A conversation's ids, with a BOS if the model wants one: the ids of
    /// [`Tokenizer::apply_chat`]'s text, except that only the control tokens the template writes
    /// are control tokens. Message contents are plain text (llama.cpp's `parse_special = false`),
    /// so a message holding `<end_of_turn>` cannot close its turn and forge the model's.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<i32>> {
        self.encode_chat_with_tools(messages, &[])
    }

    /// [`Tokenizer::encode_chat`] with a tool catalog (the template's `tools`; the family's tool
    /// template where the file's has no tool syntax).
    pub fn encode_chat_with_tools(&self, messages: &[Message], tools: &[Tool]) -> Result<Vec<i32>> {
        Ok(self.encode_pieces(&self.chat_pieces_with_tools(messages, tools, true)?))
    }

    fn encode_pieces(&self, pieces: &[ChatPiece]) -> Vec<i32> {
        let mut out = Vec::new();
        if self.add_bos {
            out.extend(self.bos);
        }
        let mut is_prev_special = true;
        for piece in pieces {
            match piece {
                ChatPiece::Marker(id) => {
                    out.push(*id);
                    is_prev_special = true;
                }
                ChatPiece::Text(t) => self.encode_into(t, false, &mut out, &mut is_prev_special),
            }
        }
        out
    }

    /// A conversation cut where its shared prefix ends: the system turn with the tool
    /// declarations, up to the turn that holds the first non-system message. The prefix is
    /// prefilled once (and snapshotted); each request feeds only `request`, the ids the whole
    /// conversation adds after it, so no system turn is written twice and no BOS lands
    /// mid-sequence. Where the template writes the system text inside the first user turn
    /// (Gemma 3's), the cut is where the user's words start.
    ///
    /// Checked at token level: the conversation's ids must start with the prefix's, else
    /// [`Error::PromptSplit`]. The prefix depends only on the system messages, the tools and the
    /// template, never on the request.
    pub fn split_chat(&self, messages: &[Message], tools: &[Tool]) -> Result<PromptSplit> {
        let first = messages
            .iter()
            .position(|m| m.role != "system" && m.role != "developer")
            .ok_or_else(|| Error::PromptSplit("the conversation has no message after its system text".into()))?;
        let full = self.encode_chat_with_tools(messages, tools)?;
        let mut marked = messages.to_vec();
        marked[first].content.insert(0, chat::SPLIT_MARK);
        let pieces = self.chat_pieces_with_tools(&marked, tools, true)?;
        let at = pieces
            .iter()
            .position(|p| matches!(p, ChatPiece::Text(t) if t.contains(chat::SPLIT_MARK)))
            .ok_or_else(|| Error::PromptSplit("the template does not write the first message's text".into()))?;
        let mut prefix = pieces[..at].to_vec();
        let before = match &pieces[at] {
            ChatPiece::Text(t) => &t[..t.find(chat::SPLIT_MARK).unwrap_or_default()],
            ChatPiece::Marker(_) => "",
        };
        // Back to the turn opener (`<|im_start|>` + `user\n`) unless the text since it holds more
        // than a role line: then the system text is in this turn (Gemma 3) and the cut stays.
        let opener = prefix.iter().rposition(|p| matches!(p, ChatPiece::Marker(_)));
        let since: String = prefix[opener.map_or(0, |o| o + 1)..]
            .iter()
            .filter_map(|p| match p {
                ChatPiece::Text(t) => Some(t.as_str()),
                ChatPiece::Marker(_) => None,
            })
            .chain([before])
            .collect();
        match opener {
            Some(o) if since.trim().lines().count() <= 1 => prefix.truncate(o),
            _ if !before.is_empty() => prefix.push(ChatPiece::Text(before.to_string())),
            _ => {}
        }
        let prefix = self.encode_pieces(&prefix);
        if !full.starts_with(&prefix) {
            let common = full.iter().zip(&prefix).take_while(|(a, b)| a == b).count();
            return Err(Error::PromptSplit(format!(
                "the conversation's ids differ from its prefix's at id {common} of {} (the text at the cut tokenizes differently when followed by the request)",
                prefix.len()
            )));
        }
        if full.len() == prefix.len() {
            return Err(Error::PromptSplit("the request adds no ids after the prefix".into()));
        }
        let request = full[prefix.len()..].to_vec();
        Ok(PromptSplit { prefix, request })
    }

    /// A digest of what decides a conversation prefix: the system text, the tools and the
    /// template that renders them (sha256, hex). A snapshot of a prefix records it, so that a
    /// request with other tools or another system text is refused rather than answered from the
    /// wrong catalog.
    pub fn prefix_digest(&self, system: Option<&str>, tools: &[Tool]) -> Result<String> {
        use sha2::{Digest, Sha256};
        let messages: Vec<Message> = system.map(Message::system).into_iter().collect();
        let template = self.chat_template_for(&messages, tools)?;
        let canonical = serde_json::json!({
            "system": system,
            "tools": tools::tools_json(tools),
            "template": template.text(),
        });
        let hash = Sha256::digest(canonical.to_string().as_bytes());
        Ok(hash.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// How this model writes tool calls (see [`ChatTemplate::tool_format`]).
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.chat.as_ref().and_then(ChatTemplate::tool_format)
    }

    /// llama.cpp's `tokenizer_st_partition`: special tokens, longest first, cut out of the text.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = if text.is_empty() {
            Vec::new()
        } else {
            vec![Fragment::Text(text)]
        };
        for &id in &self.specials {
            let ty = self.types[id as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = self.tokens.get(id as usize).unwrap_or_default();
            if needle.is_empty()
                || !frags
                    .iter()
                    .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(mut t) => {
                        while let Some(at) = t.find(needle) {
                            if at > 0 {
                                next.push(Fragment::Text(&t[..at]));
                            }
                            next.push(Fragment::Token(id));
                            t = &t[at + needle.len()..];
                        }
                        if !t.is_empty() {
                            next.push(Fragment::Text(t));
                        }
                    }
                    token => next.push(token),
                }
            }
            frags = next;
        }
        frags
    }
}

/// A conversation's ids cut at its shared prefix ([`Tokenizer::split_chat`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptSplit {
    /// The system turn with the tool declarations (BOS first where the model takes one).
    pub prefix: Vec<i32>,
    /// What the whole conversation adds after the prefix.
    pub request: Vec<i32>,
}

enum Fragment<'t> {
    Text(&'t str),
    Token(i32),
}
