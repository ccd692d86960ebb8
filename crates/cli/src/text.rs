//! Prompts as text or ids, and the stop tokens of a model.

use anyhow::{bail, Result};
use clap::Args;
use tokenizer::{Message, Tokenizer};

use crate::report::parse_ids;

/// `--prompt TEXT` | `--chat TEXT` | `--ids 1,2,3`: one of them.
#[derive(Args, Clone, Debug)]
pub struct PromptArgs {
    /// Text, tokenized with the model's tokenizer (BOS as its metadata says). Special tokens
    /// written in it (`<start_of_turn>`, `<|im_end|>`, ...) are parsed as control tokens, as
    /// llama.cpp's CLI does: give only text you control; use --chat for anyone else's words.
    #[arg(short = 'p', long, conflicts_with_all = ["chat", "ids"])]
    pub prompt: Option<String>,
    /// A user message, wrapped in the model's chat template. Only the template's turn markers
    /// become control tokens; the message is plain text, special-token look-alikes included.
    #[arg(long, conflicts_with = "ids")]
    pub chat: Option<String>,
    /// Token ids (`2,818,5279`), taken as they are.
    #[arg(long, value_parser = parse_ids)]
    pub ids: Vec<Vec<i32>>,
}

/// A prompt's ids, and the tokenizer when the model has one (real models).
pub struct Prompt {
    pub ids: Vec<i32>,
    pub tokenizer: Option<Tokenizer>,
}

impl PromptArgs {
    pub fn resolve(&self, model: &str) -> Result<Prompt> {
        let tokenizer = if crate::model::is_real_model(model) {
            Some(crate::model::tokenizer(model)?)
        } else {
            None
        };
        let ids = match (&self.prompt, &self.chat, &tokenizer) {
            (Some(text), _, Some(tok)) => tok.encode(text, tok.add_bos_default()),
            (_, Some(text), Some(tok)) => tok.encode_chat(&[Message::user(text.as_str())])?,
            (Some(_), _, None) | (_, Some(_), None) => bail!(
                "--prompt / --chat need a real model's tokenizer (gemma3-270m, smollm2-135m, or a PATH.gguf); give --ids for {model}"
            ),
            (None, None, _) => self.ids.concat(),
        };
        if ids.is_empty() {
            bail!("give a prompt: --prompt TEXT, --chat TEXT or --ids 1,2,3 (non-empty)");
        }
        Ok(Prompt { ids, tokenizer })
    }
}

impl Prompt {
    /// `--eos` when given, else the model's stop tokens (EOS, end-of-turn); none for fixtures.
    pub fn stops(&self, eos: Option<i32>) -> Vec<i32> {
        match (eos, &self.tokenizer) {
            (Some(e), _) => vec![e],
            (None, Some(tok)) => tok.stop_tokens(),
            (None, None) => Vec::new(),
        }
    }

    pub fn text(&self, ids: &[i32]) -> Option<String> {
        self.tokenizer.as_ref().map(|t| t.decode(ids))
    }
}

/// Prints decoded text as ids arrive: each time, the part of the whole decode beyond what was
/// printed (a token may complete a multi-byte character only with the next one). The decoder's
/// callback cannot fail, so a failed write is kept, printing stops, and [`Self::finish`]
/// returns it.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<i32>,
    printed: usize,
    failed: Option<anyhow::Error>,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            printed: 0,
            failed: None,
        }
    }

    pub fn push(&mut self, id: i32) {
        self.ids.push(id);
        if self.failed.is_some() {
            return;
        }
        let text = self.tokenizer.decode(&self.ids);
        if text.len() > self.printed && text.is_char_boundary(self.printed) && !text.ends_with('\u{fffd}') {
            if let Err(e) = print_now(&text[self.printed..]) {
                self.failed = Some(e);
            }
            self.printed = text.len();
        }
    }

    /// Prints what the stream held back (an incomplete character at the end) and ends the line;
    /// the first write that failed, if one did.
    pub fn finish(self) -> Result<()> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let text = self.tokenizer.decode(&self.ids);
        crate::outln!("{}", text.get(self.printed..).unwrap_or_default())
    }
}

/// Writes to stdout at once (no newline to wait for).
pub fn print_now(text: &str) -> Result<()> {
    crate::report::write_stdout(format_args!("{text}"))
}

/// The text of the file `path` that `flag` names. Opened without blocking and then read
/// blocking: a FIFO nobody writes to reads as empty (and is refused as such by the caller)
/// instead of hanging the command in `open`, while a pipe with a writer (`--tools <(cat
/// tools.json)`) is read whole.
pub fn read_text_file(flag: &str, path: &std::path::Path) -> Result<String> {
    use anyhow::Context;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let what = || format!("reading {flag} {}", path.display());
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(what)?;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is the open descriptor `file` owns; F_GETFL/F_SETFL only change its flags.
    let blocking = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) >= 0
    };
    if !blocking {
        return Err(std::io::Error::last_os_error()).with_context(what);
    }
    let mut text = String::new();
    file.read_to_string(&mut text).with_context(what)?;
    Ok(text)
}
