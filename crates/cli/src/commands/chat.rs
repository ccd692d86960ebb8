//! `skainet-kv chat`: a multi-turn conversation in the terminal, streamed as it is decoded.
//!
//! Built on the engine's [`engine::Conversation`]: the catalog (system turn with the tools) is
//! prefilled once and restored from its snapshot at every turn; each turn feeds only the
//! conversation after it. Lines starting with `/` are commands (`/help`). Ctrl-C stops the reply
//! being decoded and keeps the session (the stopped reply is not part of the conversation); at
//! the prompt, a second Ctrl-C in a row ends it, as does Ctrl-D or `/quit`. When stdin is not a
//! terminal, each line is a message (or a command) and the replies are printed one per line, so
//! a session can be scripted: `printf 'hi\n/save c.json\n' | skainet-kv chat -m MODEL`.

use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use engine::{Conversation, ConversationConfig, Engine, Finish, Reply, Sampling};
use kv_core::snapshot_file::PersistSnapshot;
use serde_json::{json, Value as Json};
use tokenizer::Message;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::commands::generate::{Constrain, SamplingArgs};
use crate::conversation::SystemArgs;
use crate::text::print_now;

#[derive(Args)]
pub struct ChatArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// (its test vocabulary: replies are noise) or a model directory with `tokenizer.gguf`.
    #[arg(short = 'm', long)]
    model: String,
    /// Default: `iree-cpu` (compiled for this CPU) for real models; `reference` for fixtures and
    /// directories.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    system: SystemArgs,
    /// With `--tools`: `auto` | `required` | `none` | a tool's name, as OpenAI spells it.
    #[arg(long, default_value = "auto")]
    tool_choice: String,
    /// With `--tools`: `on` decodes under the tools' grammar (every call parses and validates;
    /// the backend must mask tokens), `off` decodes freely and parses afterwards.
    #[arg(long, value_enum, default_value = "on")]
    constrain: Constrain,
    /// Ids per reply at most.
    #[arg(short = 'n', long, default_value_t = 512)]
    max_new: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Start from a conversation saved with `/save` (JSON messages, OpenAI's shape).
    #[arg(long)]
    load: Option<PathBuf>,
    /// Which keys a sliding layer sees: the exact rule or the seed library's (one key wider).
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
}

const HELP: &str = "\
/reset        forget the turns (the system text and tools stay)
/save FILE    write the conversation as JSON messages (OpenAI's shape)
/load FILE    continue a conversation written by /save (its system text replaces this one's)
/help         this list
/quit         end (also /exit, Ctrl-D, or Ctrl-C twice at the prompt)
A line starting with // sends the rest with one /. Ctrl-C stops a reply; the session goes on.";

pub fn run(args: ChatArgs) -> Result<()> {
    kv_core::limits::check_positions("--max-new", args.max_new)?;
    let real = crate::model::is_real_model(&args.model);
    let sampling = args.sampling.config()?;
    let (choice, source) = backends::select(
        &args.model,
        args.backend,
        args.artifacts.as_deref(),
        &args.target,
        sampling.as_ref().map_or(0, |c| c.candidates),
    );
    // Read what can be wrong before a session (or an export) is paid for.
    let tools_json = match &args.system.tools {
        Some(file) => {
            let text = crate::text::read_text_file("--tools", file)?;
            tokenizer::tools::parse_catalog(&text).with_context(|| format!("--tools {}", file.display()))?;
            Some(text)
        }
        None => None,
    };
    let loaded = args
        .load
        .as_deref()
        .map(|f| read_conversation(f).with_context(|| format!("--load {}", f.display())))
        .transpose()?;
    let tokenizer = if real {
        Some(crate::model::tokenizer(&args.model)?)
    } else {
        None
    };
    let (backend, _) = backends::open_kv(choice, &source, args.window_rule)?;
    let backend_name = crate::with_backend!(&backend, b => kv_core::KvBackend::name(b).to_string());
    let config = ConversationConfig {
        system: args.system.system()?,
        tools_json,
        tool_choice: args.tool_choice.clone(),
        max_new_tokens: args.max_new,
        constrained: args.constrain == Constrain::On,
        sampling: sampling.map_or_else(Sampling::default, |c| Sampling {
            temperature: c.temperature,
            top_k: c.top_k,
            top_p: c.top_p,
            min_p: c.min_p,
            repetition_penalty: c.repetition_penalty,
            seed: c.seed,
        }),
        catalog_file: None,
    };
    crate::with_backend!(backend, b => {
        let tok = match tokenizer {
            Some(tok) => tok,
            None => text_tokenizer(&args.model, &source, kv_core::KvBackend::spec(&b).vocab_size)?,
        };
        let engine = Engine::new(b, tok, args.model.clone())?;
        Session::start(engine, config, &backend_name, loaded)?.run()
    })
}

/// The tokenizer of a fixture or a directory: the directory's `tokenizer.gguf` (an export of a
/// real model has one), else the fixture vocabulary when the model is a fixture.
fn text_tokenizer(model: &str, source: &ModelSource, vocab: usize) -> Result<tokenizer::Tokenizer> {
    let dir = source.model_dir()?;
    let manifest = kv_core::Manifest::load(&dir)?;
    engine::load_tokenizer(&dir, &manifest).with_context(|| {
        format!("--model {model}: chat needs a tokenizer (a real model, a PATH.gguf, a fixture or an export with tokenizer.gguf; {vocab} ids)")
    })
}

/// A saved conversation: the system text (first message, if a system one) and the turns.
struct Saved {
    system: Option<String>,
    turns: Vec<Message>,
}

fn read_conversation(file: &Path) -> Result<Saved> {
    let text = crate::text::read_text_file("the conversation", file)?;
    let mut turns = crate::conversation::parse_messages(&text)?;
    let system = match turns.first() {
        Some(m) if m.role == "system" => Some(turns.remove(0).content),
        _ => None,
    };
    Ok(Saved { system, turns })
}

/// `messages` as OpenAI's chat messages: an assistant's calls with their arguments as a JSON
/// string and an id each, a tool result naming its function (what [`read_conversation`] reads
/// back).
fn messages_json(messages: &[Message]) -> Json {
    let mut call = 0;
    let list: Vec<Json> = messages
        .iter()
        .map(|m| {
            let mut out = json!({"role": m.role, "content": m.content});
            if !m.tool_calls.is_empty() {
                let calls: Vec<Json> = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        call += 1;
                        json!({
                            "id": format!("call_{call}"),
                            "type": "function",
                            "function": {"name": c.name, "arguments": Json::Object(c.arguments.clone()).to_string()},
                        })
                    })
                    .collect();
                out["tool_calls"] = Json::Array(calls);
            }
            if let Some(name) = &m.name {
                out["name"] = json!(name);
            }
            out
        })
        .collect();
    Json::Array(list)
}

struct Session<B: PersistSnapshot> {
    engine: Arc<Engine<B>>,
    config: ConversationConfig,
    conversation: Conversation<B>,
    interactive: bool,
    /// stderr is a terminal: the banner, hints and the per-reply tokens/s line go there.
    chatty: bool,
}

impl<B: PersistSnapshot> Session<B> {
    fn start(
        engine: Arc<Engine<B>>,
        mut config: ConversationConfig,
        backend: &str,
        loaded: Option<Saved>,
    ) -> Result<Self> {
        let turns = match loaded {
            Some(saved) => {
                if saved.system.is_some() {
                    config.system = saved.system;
                }
                saved.turns
            }
            None => Vec::new(),
        };
        let conversation = Conversation::new(&engine, &config)?;
        conversation.set_history(turns)?;
        let session = Session {
            interactive: std::io::stdin().is_terminal(),
            chatty: std::io::stderr().is_terminal(),
            engine,
            config,
            conversation,
        };
        session.note(format_args!(
            "skainet-kv chat: {} on {backend}; catalog {} ids ({}){}. /help lists commands; Ctrl-C stops a reply, Ctrl-D ends.",
            session.engine.name(),
            session.conversation.catalog_tokens(),
            session.conversation.catalog_source().name(),
            match session.conversation.history().len() {
                0 => String::new(),
                n => format!(", {n} turns loaded"),
            },
        ));
        Ok(session)
    }

    /// A line for the person at the terminal (nothing when stderr is not one).
    fn note(&self, line: std::fmt::Arguments) {
        if self.chatty {
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    }

    fn run(mut self) -> Result<()> {
        let mut input = Input::new(self.interactive);
        loop {
            if self.interactive {
                print_now("> ")?;
            }
            let line = match input.line()? {
                Line::Text(line) => line,
                Line::Eof => {
                    if self.interactive {
                        crate::outln!()?;
                    }
                    return Ok(());
                }
                Line::Quit => {
                    crate::outln!()?;
                    return Ok(());
                }
            };
            let line = line.trim_end_matches(['\r', '\n']);
            if line.trim().is_empty() {
                continue;
            }
            let outcome = match line.strip_prefix('/') {
                Some(rest) if !rest.starts_with('/') => match self.command(rest) {
                    Ok(Flow::Quit) => return Ok(()),
                    Ok(Flow::Go) => Ok(()),
                    Err(e) => Err(e),
                },
                Some(rest) => self.reply(rest),
                None => self.reply(line),
            };
            if let Err(e) = outcome {
                if crate::report::is_closed_stdout(&e) || !self.interactive {
                    // A script's session stops at its first failure, with the error as exit.
                    return Err(e);
                }
                let _ = writeln!(std::io::stderr(), "error: {}", crate::report::one_line(&e));
            }
        }
    }

    fn command(&mut self, text: &str) -> Result<Flow> {
        let (name, arg) = match text.split_once(char::is_whitespace) {
            Some((n, a)) => (n, a.trim()),
            None => (text, ""),
        };
        let file = || -> Result<&Path> {
            match arg {
                "" => bail!("/{name} needs a file: /{name} FILE"),
                f => Ok(Path::new(f)),
            }
        };
        match name {
            "quit" | "exit" => return Ok(Flow::Quit),
            "help" | "?" => crate::outln!("{HELP}")?,
            "reset" => {
                self.conversation.set_history(Vec::new())?;
                self.note(format_args!("(the conversation starts over)"));
            }
            "save" => {
                let path = file()?;
                let messages: Vec<Message> = self
                    .conversation
                    .system()
                    .map(Message::system)
                    .into_iter()
                    .chain(self.conversation.history())
                    .collect();
                let text = serde_json::to_string_pretty(&messages_json(&messages))?;
                std::fs::write(path, text + "\n").with_context(|| format!("/save {}", path.display()))?;
                self.note(format_args!(
                    "(saved {} messages to {})",
                    messages.len(),
                    path.display()
                ));
            }
            "load" => {
                let path = file()?;
                let saved = read_conversation(path).with_context(|| format!("/load {}", path.display()))?;
                let n = saved.turns.len();
                // Another system text is another catalog: a new conversation (its catalog is
                // prefilled once, then kept by the engine like this one's).
                let conversation = if saved.system.as_deref() != self.conversation.system() {
                    let config = ConversationConfig {
                        system: saved.system.clone(),
                        ..self.config.clone()
                    };
                    let conversation = Conversation::new(&self.engine, &config)?;
                    conversation.set_history(saved.turns)?;
                    self.config = config;
                    Some(conversation)
                } else {
                    self.conversation.set_history(saved.turns)?;
                    None
                };
                if let Some(c) = conversation {
                    self.conversation = c;
                }
                self.note(format_args!("(loaded {n} turns from {})", path.display()));
            }
            other => bail!("unknown command /{other} (/help lists them; // sends a line starting with /)"),
        }
        Ok(Flow::Go)
    }

    fn reply(&mut self, text: &str) -> Result<()> {
        signals::take();
        let mut failed = None;
        let reply = self.conversation.send(text, |piece| {
            if failed.is_none() {
                if let Err(e) = print_now(piece) {
                    failed = Some(e);
                }
            }
            failed.is_none() && !signals::take()
        });
        let reply: Reply = match reply {
            Ok(reply) => reply,
            Err(e) if e.kind() == "context_full" => {
                return Err(anyhow::Error::new(e)
                    .context("the conversation no longer fits the model's context (/reset starts over)"))
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(e) = failed {
            return Err(e);
        }
        crate::outln!()?;
        for call in &reply.tool_calls {
            crate::outln!("[tool call] {}", call.to_json())?;
        }
        for invalid in &reply.invalid_tool_calls {
            let _ = writeln!(std::io::stderr(), "skainet-kv: invalid tool call: {invalid}");
        }
        match reply.finish {
            Finish::Cancelled | Finish::Callback => {
                let _ = writeln!(
                    std::io::stderr(),
                    "[stopped: this reply is not part of the conversation]"
                );
            }
            Finish::MaxTokens => self.note(format_args!("[cut at --max-new {}]", reply.tokens)),
            Finish::Stop => {}
        }
        self.note(format_args!(
            "{}",
            crate::report::rate_line(reply.tokens, reply.elapsed)
        ));
        Ok(())
    }
}

enum Flow {
    Go,
    Quit,
}

enum Line {
    Text(String),
    Eof,
    /// Ctrl-C twice at the prompt.
    Quit,
}

/// Lines from stdin. On a terminal, reads wait in `poll` so that a Ctrl-C at the prompt is seen
/// at once (the first prints a hint, the second ends the session); elsewhere plain lines.
struct Input {
    interactive: bool,
    pending: Vec<u8>,
    eof: bool,
}

impl Input {
    fn new(interactive: bool) -> Self {
        if interactive {
            signals::install();
        }
        Input {
            interactive,
            pending: Vec::new(),
            eof: false,
        }
    }

    fn line(&mut self) -> Result<Line> {
        if !self.interactive {
            let mut line = String::new();
            let n = std::io::stdin().read_line(&mut line).context("reading stdin")?;
            return Ok(if n == 0 { Line::Eof } else { Line::Text(line) });
        }
        signals::take();
        let mut armed = false;
        loop {
            if let Some(at) = self.pending.iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(at + 1);
                let line = std::mem::replace(&mut self.pending, rest);
                return Ok(Line::Text(String::from_utf8_lossy(&line).into_owned()));
            }
            if self.eof {
                if self.pending.is_empty() {
                    return Ok(Line::Eof);
                }
                let line = std::mem::take(&mut self.pending);
                return Ok(Line::Text(String::from_utf8_lossy(&line).into_owned()));
            }
            match signals::read_stdin(Duration::from_millis(100))? {
                signals::Read::Bytes(bytes) if bytes.is_empty() => self.eof = true,
                signals::Read::Bytes(bytes) => {
                    armed = false;
                    self.pending.extend(bytes);
                }
                signals::Read::Nothing => {}
                signals::Read::Interrupted if armed => return Ok(Line::Quit),
                signals::Read::Interrupted => {
                    armed = true;
                    // The terminal dropped what was typed on this line.
                    self.pending.clear();
                    print_now("\n(Ctrl-C again to quit; /quit or Ctrl-D also end)\n> ")?;
                }
            }
        }
    }
}

/// SIGINT as a counter: the handler only counts (async-signal-safe); the decode loop and the
/// prompt read it. `SA_RESTART`, so other system calls (IREE's threads') are not interrupted.
#[cfg(unix)]
mod signals {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    static SIGINTS: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn count(_: libc::c_int) {
        SIGINTS.fetch_add(1, Ordering::SeqCst);
    }

    pub fn install() {
        // SAFETY: a handler that only touches an atomic, installed once before any thread of
        // ours reads the counter.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = count as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
        }
    }

    /// Whether a Ctrl-C came since the last call.
    pub fn take() -> bool {
        SIGINTS.swap(0, Ordering::SeqCst) > 0
    }

    pub enum Read {
        /// What one read returned (empty: end of input).
        Bytes(Vec<u8>),
        /// Nothing within the wait.
        Nothing,
        Interrupted,
    }

    /// Waits up to `wait` for stdin, then reads what is there; a Ctrl-C ends the wait.
    pub fn read_stdin(wait: Duration) -> std::io::Result<Read> {
        if take() {
            return Ok(Read::Interrupted);
        }
        let mut fd = libc::pollfd {
            fd: 0,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut fd, 1, wait.as_millis() as libc::c_int) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::Interrupted => Ok(if take() { Read::Interrupted } else { Read::Nothing }),
                _ => Err(e),
            };
        }
        if take() {
            return Ok(Read::Interrupted);
        }
        if ready == 0 {
            return Ok(Read::Nothing);
        }
        let mut buf = vec![0u8; 4096];
        // SAFETY: reads at most buf.len() bytes into buf.
        let n = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::Interrupted => Ok(Read::Interrupted),
                _ => Err(e),
            };
        }
        buf.truncate(n as usize);
        Ok(Read::Bytes(buf))
    }
}

/// Without POSIX signals: no Ctrl-C handling; stdin read as it comes.
#[cfg(not(unix))]
mod signals {
    use std::io::Read as _;
    use std::time::Duration;

    pub fn install() {}

    pub fn take() -> bool {
        false
    }

    pub enum Read {
        Bytes(Vec<u8>),
        #[allow(dead_code)]
        Nothing,
        #[allow(dead_code)]
        Interrupted,
    }

    pub fn read_stdin(_wait: Duration) -> std::io::Result<Read> {
        let mut buf = vec![0u8; 4096];
        let n = std::io::stdin().read(&mut buf)?;
        buf.truncate(n);
        Ok(Read::Bytes(buf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_messages_read_back_with_calls_and_results() {
        let mut args = serde_json::Map::new();
        args.insert("on".into(), json!(true));
        let messages = vec![
            Message::system("sys"),
            Message::user("lights on"),
            Message::assistant_calls(
                "",
                vec![tokenizer::ToolCall {
                    name: "set_lights".into(),
                    arguments: args,
                }],
            ),
            Message {
                name: Some("set_lights".into()),
                ..Message::new("tool", "{\"ok\": true}")
            },
        ];
        let text = messages_json(&messages).to_string();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        std::fs::write(&path, text).unwrap();
        let saved = read_conversation(&path).unwrap();
        assert_eq!(saved.system.as_deref(), Some("sys"));
        assert_eq!(saved.turns, messages[1..].to_vec());
    }
}
