//! The app-level API: one model opened from an export directory, many conversations over it.
//!
//! [`Engine`] owns the one session ([`KvDecoder`] over a [`KvBackend`]: one copy of the
//! weights), the tokenizer with its chat template and stop ids, and the grammar engine for tool
//! calls. [`Conversation`] holds a system prompt, a tool catalog, sampling options and the turns
//! so far; [`Conversation::send`] streams text pieces to a callback and returns a [`Reply`] with
//! the final text and the parsed, validated tool calls. The JNI layer (`crates/jni`,
//! `Engine`/`Conversation` in Kotlin) is a thin shell over this crate; a server can be another.
//!
//! Design:
//! - **Everything comes from the export directory.** The manifest (spec, function names,
//!   files), `tokenizer.gguf` (vocabulary, chat template, stop ids) that `export` copies from the
//!   model's GGUF; a fixture export has no tokenizer and gets the fixture vocabulary
//!   ([`constrain::fixture`]) because its manifest says it is a fixture. Nothing is typed in.
//! - **Catalogs are snapshots keyed by what decides them.** The prefix of a conversation (system
//!   turn with the tool declarations) depends only on the system text, the tools and the
//!   template ([`Tokenizer::prefix_digest`]). The engine prefills each distinct prefix once and
//!   keeps its snapshot; every conversation with the same system text and tools restores it. A
//!   snapshot file records the digest, so a file of another catalog or another model is refused.
//! - **One session, calls in turn.** The backend sits behind one `Mutex`: conversations answer
//!   one after the other (each restores its catalog and feeds its turns, so they do not see each
//!   other's state). A conversation re-feeds its earlier turns on each send (kept as messages,
//!   not as cache), which keeps conversations independent at the cost of chunk calls.
//! - **Cancel is a flag, not a lock.** [`Conversation::cancel`] sets an atomic the decode loop
//!   reads after every id, so it works from any thread while `send` holds the locks; a cancelled
//!   turn is not added to the conversation.
//! - **Bad input leaves everything usable.** Requests are checked before the session moves
//!   (kv-core checks ids, room and sampling first); a failed or cancelled send adds nothing to the
//!   conversation. A closed engine or conversation refuses every call with [`Error::Closed`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use kv_core::decoder::{DecodeOptions, TokenConstraint};
use kv_core::digests::TOKENIZER_FILE;
use kv_core::sampling::{SamplingConfig, DEFAULT_CANDIDATES};
use kv_core::snapshot_file::{self, PersistSnapshot};
use kv_core::{KvBackend, KvDecoder, Manifest};
use tokenizer::tools::{self, Tool, ToolCall, ToolChoice, ToolError, ToolFormat};
use tokenizer::{Message, Tokenizer};

/// Everything the engine refuses, grouped by what the caller can do about it ([`Error::kind`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine or conversation was closed; nothing works on it any more.
    #[error("{0} is closed")]
    Closed(&'static str),
    /// A second `send` on a conversation that is still answering.
    #[error("this conversation is already answering (one send at a time; cancel() stops it)")]
    Busy,
    /// An argument that cannot work (tools that do not parse, an unknown tool choice, bad
    /// sampling settings, an empty message).
    #[error("{what}: {reason}")]
    BadArgument { what: &'static str, reason: String },
    /// A catalog file that belongs to another system text, tool list or model.
    #[error("catalog file {path}: {reason}")]
    Catalog { path: String, reason: String },
    /// The export directory lacks what the engine reads.
    #[error("export {dir}: {reason}")]
    Model { dir: String, reason: String },
    #[error(transparent)]
    Kv(#[from] kv_core::Error),
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::Error),
    #[error("tools: {0}")]
    Tools(#[from] ToolError),
}

impl Error {
    /// A stable name for the kind of failure (the JNI layer puts it in the Kotlin exception).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Closed(_) => "closed",
            Error::Busy => "busy",
            Error::BadArgument { .. } | Error::Tools(_) => "bad_argument",
            Error::Catalog { .. } => "catalog",
            Error::Model { .. } | Error::Tokenizer(_) => "model",
            Error::Kv(e) => kv_kind(e),
        }
    }
}

/// [`Error::kind`] of a kv-core error.
pub fn kv_kind(e: &kv_core::Error) -> &'static str {
    use kv_core::Error as K;
    match e {
        K::TokenOutOfRange { .. } | K::BadTokenCount { .. } | K::BadSampling { .. } | K::NoTopK { .. } => {
            "bad_argument"
        }
        K::ContextOverflow { .. } | K::TooLarge { .. } => "context_full",
        K::SnapshotFile { .. } | K::NonFiniteSnapshot { .. } | K::NotRegularFile { .. } => "catalog",
        K::Io { .. } => "io",
        K::Manifest { .. } | K::ManifestParse { .. } | K::Irpa(_) | K::Parameter { .. } => "model",
        K::Constraint { .. } => "constraint",
        _ => "backend",
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn bad(what: &'static str, reason: impl ToString) -> Error {
    Error::BadArgument {
        what,
        reason: reason.to_string(),
    }
}

/// The vocabulary, chat template and stop ids of the export in `dir`: its `tokenizer.gguf`, or
/// for a fixture export (its manifest names the fixture revision) the fixture vocabulary.
pub fn load_tokenizer(dir: &Path, manifest: &Manifest) -> Result<Tokenizer> {
    let path = dir.join(TOKENIZER_FILE);
    let model_err = |reason: String| Error::Model {
        dir: dir.display().to_string(),
        reason,
    };
    if path.is_file() {
        let file = gguf::GgufFile::open(&path).map_err(|e| model_err(format!("{TOKENIZER_FILE}: {e}")))?;
        let tok = Tokenizer::from_gguf(&file)?;
        if tok.vocab_size() > manifest.spec.vocab_size {
            return Err(model_err(format!(
                "{TOKENIZER_FILE} has {} ids, the graphs' vocabulary {}: the file belongs to another model",
                tok.vocab_size(),
                manifest.spec.vocab_size
            )));
        }
        return Ok(tok);
    }
    if manifest.provenance.fixture_revision.is_some() {
        return Ok(constrain::fixture::tokenizer(manifest.spec.vocab_size)?);
    }
    Err(model_err(format!(
        "no {TOKENIZER_FILE} (a real model's export writes it: `skainet-kv export --target ...`; copy \
         every file that files.json lists)"
    )))
}

/// How a conversation's catalog snapshot was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatalogSource {
    /// Prefilled now.
    Prefilled,
    /// Another conversation's, kept by the engine.
    Memory,
    /// Loaded from the catalog file (no prefill).
    File,
}

impl CatalogSource {
    pub fn name(self) -> &'static str {
        match self {
            CatalogSource::Prefilled => "prefilled",
            CatalogSource::Memory => "memory",
            CatalogSource::File => "file",
        }
    }
}

/// A model and its session. Shared (`Arc`) by its conversations.
pub struct Engine<B: KvBackend> {
    /// `None` once closed: the backend (weights, caches) is dropped at close.
    decoder: Mutex<Option<KvDecoder<B>>>,
    /// Catalog snapshots by prefix digest; cleared at close.
    catalogs: Mutex<HashMap<String, Arc<B::Snapshot>>>,
    tokenizer: Tokenizer,
    format: Option<ToolFormat>,
    /// Built where the vocabulary has a tool-call format; `None`: no constrained decoding.
    constrainer: Option<constrain::Constrainer>,
    stops: Vec<i32>,
    name: String,
}

impl<B: PersistSnapshot> Engine<B> {
    /// An engine over `backend` (opened on an export) with `tokenizer` ([`load_tokenizer`]).
    /// `name` says which model it is in messages.
    pub fn new(backend: B, tokenizer: Tokenizer, name: impl Into<String>) -> Result<Arc<Self>> {
        let vocab = backend.spec().vocab_size;
        if tokenizer.vocab_size() > vocab {
            return Err(bad(
                "tokenizer",
                format!("{} ids, the graphs' vocabulary {vocab}", tokenizer.vocab_size()),
            ));
        }
        let format = tokenizer.tool_format();
        let constrainer = match format {
            Some(_) => Some(constrain::Constrainer::new(&tokenizer)?),
            None => None,
        };
        // FunctionGemma ends its turn after a call with `<start_function_response>` (the app's
        // turn): a stop, so the model does not invent the result.
        let mut stops = tokenizer.stop_tokens();
        if format == Some(ToolFormat::FunctionGemma) {
            stops.extend(tokenizer.token_id(constrain::FG_RESPONSE_START));
        }
        Ok(Arc::new(Engine {
            decoder: Mutex::new(Some(KvDecoder::new(backend))),
            catalogs: Mutex::new(HashMap::new()),
            tokenizer,
            format,
            constrainer,
            stops,
            name: name.into(),
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// How the model writes tool calls; `None`: it has no tool syntax (text answers only).
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.format
    }

    /// The ids that end an answer (EOS, end of turn, FunctionGemma's function response).
    pub fn stop_ids(&self) -> &[i32] {
        &self.stops
    }

    /// Frees the session and every catalog snapshot; later calls on the engine and its
    /// conversations fail with [`Error::Closed`]. Waits for a send in progress to finish.
    pub fn close(&self) {
        let mut decoder = lock(&self.decoder);
        lock(&self.catalogs).clear();
        *decoder = None;
    }

    /// The graphs' geometry and limits (`maxPositions`: the longest conversation).
    pub fn spec(&self) -> Result<kv_core::KvSpec> {
        let session = self.session()?;
        let decoder = session.as_ref().unwrap_or_else(|| unreachable!("checked by session()"));
        Ok(decoder.backend().spec().clone())
    }

    pub fn is_closed(&self) -> bool {
        lock(&self.decoder).is_none()
    }

    /// Starts recording the device's dispatches into `path` until [`Self::end_device_profile`]:
    /// IREE's profile bundle (`iree-profile dispatch FILE`, `scripts/h200/step-timeline.py FILE`),
    /// each dispatch's GPU timestamps on Vulkan. What an app developer can send from a phone's
    /// GPU, which no machine of ours has. Waits for a send in progress; a second begin completes
    /// the first file.
    pub fn begin_device_profile(&self, path: &Path) -> Result<()> {
        let mut session = self.session()?;
        let decoder = session.as_mut().unwrap_or_else(|| unreachable!("checked by session()"));
        Ok(decoder.backend_mut().begin_device_profile(path)?)
    }

    /// Ends [`Self::begin_device_profile`]'s recording and completes its file; no error where
    /// none was started.
    pub fn end_device_profile(&self) -> Result<()> {
        let mut session = self.session()?;
        let decoder = session.as_mut().unwrap_or_else(|| unreachable!("checked by session()"));
        Ok(decoder.backend_mut().end_device_profile()?)
    }

    fn session(&self) -> Result<MutexGuard<'_, Option<KvDecoder<B>>>> {
        let guard = lock(&self.decoder);
        match guard.is_some() {
            true => Ok(guard),
            false => Err(Error::Closed("the engine")),
        }
    }

    /// The snapshot of the prefix `digest` names, `prefix` its ids: kept, else loaded from
    /// `file` when one exists there, else prefilled (and saved to `file` when given).
    fn catalog(&self, digest: &str, prefix: &[i32], file: Option<&Path>) -> Result<CatalogSource> {
        let mut session = self.session()?;
        let decoder = session.as_mut().unwrap_or_else(|| unreachable!("checked by session()"));
        if lock(&self.catalogs).contains_key(digest) {
            return Ok(CatalogSource::Memory);
        }
        let (snapshot, source) = match file.filter(|f| f.exists()) {
            Some(path) => (
                load_catalog(decoder.backend(), path, digest, prefix.len())?,
                CatalogSource::File,
            ),
            None => {
                let snapshot = decoder.prefill_prefix(prefix)?;
                if let Some(path) = file {
                    snapshot_file::save_with_digest(decoder.backend(), &snapshot, path, Some(digest))?;
                }
                (snapshot, CatalogSource::Prefilled)
            }
        };
        lock(&self.catalogs).insert(digest.to_string(), Arc::new(snapshot));
        Ok(source)
    }

    /// Writes the catalog `digest` names to `path` (atomically); the bytes written.
    fn save_catalog(&self, digest: &str, path: &Path) -> Result<u64> {
        let session = self.session()?;
        let decoder = session.as_ref().unwrap_or_else(|| unreachable!("checked by session()"));
        let catalog = lock(&self.catalogs)
            .get(digest)
            .cloned()
            .unwrap_or_else(|| kv_core::error::invariant("a live conversation's catalog is kept"));
        Ok(snapshot_file::save_with_digest(
            decoder.backend(),
            &catalog,
            path,
            Some(digest),
        )?)
    }
}

/// A catalog file's snapshot, after checking that it holds this very prefix: its digest (system
/// text, tools, template) and its length; the fingerprint check of [`snapshot_file::load`]
/// refuses another model's file.
fn load_catalog<B: PersistSnapshot>(backend: &B, path: &Path, digest: &str, tokens: usize) -> Result<B::Snapshot> {
    let header = snapshot_file::read_header(path)?;
    let refuse = |reason: String| Error::Catalog {
        path: path.display().to_string(),
        reason,
    };
    match header.prompt_digest.as_deref() {
        Some(d) if d == digest => {}
        Some(_) => {
            return Err(refuse(
                "it holds the catalog of another system prompt, tool list or chat template; delete it \
                 (or give another file) to prefill this one"
                    .into(),
            ))
        }
        None => {
            return Err(refuse(
                "it records no catalog digest (not written by a conversation)".into(),
            ))
        }
    }
    let snapshot = snapshot_file::load(backend, path)?;
    let position = backend.snapshot_position(&snapshot);
    if position != tokens {
        return Err(refuse(format!(
            "it holds {position} positions, the catalog has {tokens} ids"
        )));
    }
    Ok(snapshot)
}

/// Locks a mutex whose data stays consistent after a panic elsewhere (the decoder validates
/// before it moves; the catalog map is changed by single calls).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sampling settings of a conversation; the default is greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (the graphs' argmax); above 0 needs an export with top-k results.
    pub temperature: f32,
    /// 0 = every candidate the export hands over.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        let d = SamplingConfig::default();
        Sampling {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            min_p: d.min_p,
            repetition_penalty: d.repetition_penalty,
            seed: d.seed,
        }
    }
}

/// What a conversation is made of.
#[derive(Clone, Debug)]
pub struct ConversationConfig {
    pub system: Option<String>,
    /// A tool catalog as JSON (a list of `{"type": "function", "function": {...}}`:
    /// docs/tool-calling.md); `None` or empty: no tools.
    pub tools_json: Option<String>,
    /// `auto`, `required`, `none` or a tool's name.
    pub tool_choice: String,
    pub max_new_tokens: usize,
    /// Decode under the tools' grammar (calls always parse and validate).
    pub constrained: bool,
    pub sampling: Sampling,
    /// Where the catalog snapshot lives across app starts: loaded when the file exists (refused
    /// when it is another catalog's or another model's), else written after the prefill.
    pub catalog_file: Option<std::path::PathBuf>,
}

impl Default for ConversationConfig {
    fn default() -> Self {
        ConversationConfig {
            system: None,
            tools_json: None,
            tool_choice: "auto".into(),
            max_new_tokens: 96,
            constrained: true,
            sampling: Sampling::default(),
            catalog_file: None,
        }
    }
}

/// Why an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop id, or the grammar ended (a complete call).
    Stop,
    /// `max_new_tokens` ids.
    MaxTokens,
    /// [`Conversation::cancel`].
    Cancelled,
    /// The callback asked to stop (the JNI layer: the listener threw).
    Callback,
}

impl Finish {
    pub fn name(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::MaxTokens => "max_tokens",
            Finish::Cancelled => "cancelled",
            Finish::Callback => "callback",
        }
    }
}

/// One answer.
#[derive(Clone, Debug)]
pub struct Reply {
    /// The text outside tool calls (trimmed).
    pub text: String,
    /// The calls that parse and validate against the catalog.
    pub tool_calls: Vec<ToolCall>,
    /// Calls that do not parse or validate, and why (none when constrained).
    pub invalid_tool_calls: Vec<String>,
    pub finish: Finish,
    /// Ids generated.
    pub tokens: usize,
    /// Ids fed after the catalog (this turn and the earlier ones).
    pub request_tokens: usize,
    pub elapsed: Duration,
}

/// A conversation: system prompt, tools, options and its turns. `Sync`: `cancel` is called from
/// another thread while `send` runs.
pub struct Conversation<B: KvBackend> {
    engine: Arc<Engine<B>>,
    system: Option<String>,
    tools: Vec<Tool>,
    choice: ToolChoice,
    constrained: bool,
    options: DecodeOptions,
    digest: String,
    catalog_tokens: usize,
    catalog_source: CatalogSource,
    /// The turns after the system message; locked for the whole of a send.
    turns: Mutex<Vec<Message>>,
    cancel: AtomicBool,
    closed: AtomicBool,
}

impl<B: PersistSnapshot> Conversation<B> {
    /// A conversation on `engine`: the catalog (system turn with the tools) is prefilled once per
    /// engine, or loaded from `config.catalog_file`.
    pub fn new(engine: &Arc<Engine<B>>, config: &ConversationConfig) -> Result<Self> {
        let tools = match config.tools_json.as_deref().map(str::trim) {
            None | Some("") => Vec::new(),
            Some(text) => tools::parse_catalog(text)?,
        };
        let choice: ToolChoice = config.tool_choice.parse()?;
        if let ToolChoice::Function(name) = &choice {
            if !tools.iter().any(|t| &t.name == name) {
                return Err(bad("tool choice", format!("`{name}` is not in the tools")));
            }
        }
        if !tools.is_empty() && engine.format.is_none() {
            return Err(bad(
                "tools",
                format!(
                    "{}'s chat template and vocabulary have no tool-call syntax",
                    engine.name
                ),
            ));
        }
        let constrained = config.constrained && !tools.is_empty() && choice != ToolChoice::None;
        let capacity = {
            let mut session = engine.session()?;
            let backend = session
                .as_mut()
                .unwrap_or_else(|| unreachable!("checked by session()"))
                .backend_mut();
            if constrained {
                // Asked now, not at the first send: a mask that restricts, then lifted. A backend
                // without one (contract 1 graphs) refuses the first and keeps none.
                let vocab = backend.spec().vocab_size;
                let probe = kv_core::allowed::AllowedTokens::none(vocab);
                if let Err(e) = backend.set_allowed(Some(&probe)) {
                    return Err(bad(
                        "constrained decoding",
                        format!("{e} (or give constrained = false: calls may then not parse)"),
                    ));
                }
                backend.set_allowed(None)?;
            }
            backend.top_k_capacity()
        };
        let s = &config.sampling;
        let sampling = SamplingConfig {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
            // What the export hands over, at most the default unless top_k asks for more
            // (validate refuses a top_k beyond the export's).
            candidates: capacity.map_or(DEFAULT_CANDIDATES, |c| c.min(DEFAULT_CANDIDATES.max(s.top_k))),
        };
        sampling.validate()?;
        if !sampling.is_greedy() && capacity.is_none() {
            return Err(bad(
                "sampling",
                "this export hands over no top-k logits, so it decodes greedily only (temperature 0, \
                 repetition penalty 1); export it with `--top-k N` to sample",
            ));
        }
        let options = DecodeOptions {
            max_new: config.max_new_tokens,
            stop: engine.stops.iter().copied().collect(),
            sampling: (!sampling.is_greedy()).then_some(sampling),
        };
        if options.max_new == 0 {
            return Err(bad("max new tokens", "must be at least 1"));
        }
        let tok = &engine.tokenizer;
        let system = config.system.clone().filter(|s| !s.is_empty());
        let tools_for_prompt = if choice == ToolChoice::None {
            &[][..]
        } else {
            &tools[..]
        };
        let digest = tok.prefix_digest(system.as_deref(), tools_for_prompt)?;
        let probe: Vec<Message> = system
            .iter()
            .map(|s| Message::system(s.clone()))
            .chain([Message::user("-")])
            .collect();
        let prefix = tok.split_chat(&probe, tools_for_prompt)?.prefix;
        let catalog_source = engine.catalog(&digest, &prefix, config.catalog_file.as_deref())?;
        Ok(Conversation {
            engine: engine.clone(),
            system,
            tools,
            choice,
            constrained,
            options,
            digest,
            catalog_tokens: prefix.len(),
            catalog_source,
            turns: Mutex::new(Vec::new()),
            cancel: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        })
    }

    pub fn catalog_source(&self) -> CatalogSource {
        self.catalog_source
    }

    /// Ids of the catalog (the shared prefix).
    pub fn catalog_tokens(&self) -> usize {
        self.catalog_tokens
    }

    /// Writes the catalog snapshot to `path` (atomically); the bytes written.
    pub fn save_catalog(&self, path: &Path) -> Result<u64> {
        self.check_open()?;
        self.engine.save_catalog(&self.digest, path)
    }

    /// The system text (the catalog's), if any.
    pub fn system(&self) -> Option<&str> {
        self.system.as_deref()
    }

    /// The turns so far, after the system message: each answered message and its answer (with
    /// its calls), and any turns set by [`Self::set_history`]. Waits for a send in progress.
    pub fn history(&self) -> Vec<Message> {
        lock(&self.turns).clone()
    }

    /// Replaces the turns after the system message: a saved conversation continued, or none to
    /// start over (the catalog stays). The turns are rendered with a probe message first, so a
    /// list the chat template refuses (a role it does not know, a second system message) is
    /// refused here, naming why, and the conversation keeps the turns it had.
    pub fn set_history(&self, turns: Vec<Message>) -> Result<()> {
        self.check_open()?;
        if let Some(m) = turns.iter().find(|m| m.role == "system" || m.role == "developer") {
            return Err(bad(
                "history",
                format!(
                    "a `{}` message: the system text is the conversation's own (start another conversation for another)",
                    m.role
                ),
            ));
        }
        let mut current = match self.turns.try_lock() {
            Ok(t) => t,
            Err(TryLockError::WouldBlock) => return Err(Error::Busy),
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
        };
        if !turns.is_empty() {
            let tools = if self.choice == ToolChoice::None {
                &[][..]
            } else {
                &self.tools[..]
            };
            let probe: Vec<Message> = self
                .system
                .iter()
                .map(|s| Message::system(s.clone()))
                .chain(turns.iter().cloned())
                .chain([Message::user("-")])
                .collect();
            self.engine.tokenizer.split_chat(&probe, tools)?;
        }
        *current = turns;
        Ok(())
    }

    /// Stops the send running now after the id being decoded; does nothing when none runs.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Later calls fail with [`Error::Closed`]; a send in progress is cancelled. The catalog
    /// stays with the engine for other conversations.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.cancel();
    }

    fn check_open(&self) -> Result<()> {
        match self.closed.load(Ordering::SeqCst) {
            true => Err(Error::Closed("the conversation")),
            false => Ok(()),
        }
    }

    /// Answers `text`: feeds the conversation after its catalog, decodes (under the tools'
    /// grammar when constrained), calls `on_text` with each new piece of visible text (it returns
    /// `false` to stop), and returns the answer parsed into text and tool calls. A complete
    /// answer (not cancelled, not stopped by the callback) becomes part of the conversation.
    pub fn send(&self, text: &str, mut on_text: impl FnMut(&str) -> bool) -> Result<Reply> {
        self.check_open()?;
        if text.trim().is_empty() {
            return Err(bad("message", "is empty"));
        }
        let mut turns = match self.turns.try_lock() {
            Ok(t) => t,
            Err(TryLockError::WouldBlock) => return Err(Error::Busy),
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
        };
        self.cancel.store(false, Ordering::SeqCst);
        let started = Instant::now();
        let engine = &*self.engine;
        let tok = &engine.tokenizer;
        let tools = if self.choice == ToolChoice::None {
            &[][..]
        } else {
            &self.tools[..]
        };
        let messages: Vec<Message> = self
            .system
            .iter()
            .map(|s| Message::system(s.clone()))
            .chain(turns.iter().cloned())
            .chain([Message::user(text)])
            .collect();
        let request = tok.split_chat(&messages, tools)?.request;
        let mut constraint = match (&engine.constrainer, self.constrained) {
            (Some(c), true) => c.constraint(&self.tools, &self.choice)?,
            _ => None,
        };

        let mut session = engine.session()?;
        let decoder = session.as_mut().unwrap_or_else(|| unreachable!("checked by session()"));
        let catalog = lock(&engine.catalogs)
            .get(&self.digest)
            .cloned()
            .unwrap_or_else(|| kv_core::error::invariant("an open engine keeps its catalogs"));
        let mut stream = TextStream::default();
        let mut finish = None;
        let on_token = |id: i32| {
            stream.ids.push(id);
            if self.cancel.load(Ordering::SeqCst) {
                finish = Some(Finish::Cancelled);
                return false;
            }
            match stream.next_piece(tok) {
                Some(piece) if !on_text(&piece) => {
                    finish = Some(Finish::Callback);
                    false
                }
                _ => true,
            }
        };
        let generation = match constraint.as_mut() {
            Some(c) => decoder.generate_constrained(
                &catalog,
                &request,
                &self.options,
                c as &mut dyn TokenConstraint,
                on_token,
            )?,
            None => decoder.generate_until(&catalog, &request, &self.options, on_token)?,
        };
        drop(session);
        let finish = finish.unwrap_or(
            match generation.stopped_at_eos || generation.ids.len() < self.options.max_new {
                true => Finish::Stop,
                false => Finish::MaxTokens,
            },
        );
        let reply = self.parse(&generation.ids, finish, request.len(), started.elapsed());
        if matches!(finish, Finish::Stop | Finish::MaxTokens) {
            turns.push(Message::user(text));
            turns.push(Message::assistant_calls(reply.text.clone(), reply.tool_calls.clone()));
        }
        Ok(reply)
    }

    fn parse(&self, ids: &[i32], finish: Finish, request_tokens: usize, elapsed: Duration) -> Reply {
        let tok = &self.engine.tokenizer;
        let mut reply = Reply {
            text: String::new(),
            tool_calls: Vec::new(),
            invalid_tool_calls: Vec::new(),
            finish,
            tokens: ids.len(),
            request_tokens,
            elapsed,
        };
        let answer = parse_answer(tok, self.engine.format, &self.engine.stops, &self.tools, ids);
        reply.text = if self.tools.is_empty() {
            answer.text.trim().to_string()
        } else {
            answer.text
        };
        reply.tool_calls = answer.calls;
        reply.invalid_tool_calls = answer.invalid;
        reply
    }
}

/// An answer's text and tool calls ([`parse_answer`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedAnswer {
    /// The text around the calls (all of it without tools or a call format).
    pub text: String,
    /// The calls that parse and validate against the tools.
    pub calls: Vec<ToolCall>,
    /// Calls that do not parse or validate, and why.
    pub invalid: Vec<String>,
}

/// Splits the ids of an answer into text and tool calls the way a [`Conversation`]'s reply is
/// (the server's replies too): without tools or a call format, the decoded text; else control
/// tokens rendered so that the format's call markers are seen, the `stops`' and BOS text
/// removed, and each call validated against `tools`.
pub fn parse_answer(
    tok: &Tokenizer,
    format: Option<ToolFormat>,
    stops: &[i32],
    tools: &[Tool],
    ids: &[i32],
) -> ParsedAnswer {
    let Some(format) = format.filter(|_| !tools.is_empty()) else {
        return ParsedAnswer {
            text: tok.decode(ids),
            ..ParsedAnswer::default()
        };
    };
    let mut decoded = tok.decode_with(ids, true);
    for id in stops.iter().copied().chain(tok.bos()) {
        if let Some(t) = tok.token_text(id).filter(|t| !t.is_empty()) {
            decoded = decoded.replace(t, "");
        }
    }
    let parsed = format.parse(&decoded);
    let mut answer = ParsedAnswer {
        text: parsed.text,
        ..ParsedAnswer::default()
    };
    for call in parsed.calls {
        match call.and_then(|c| tools::validate(&c, tools).map(|()| c)) {
            Ok(c) => answer.calls.push(c),
            Err(e) => answer.invalid.push(e.to_string()),
        }
    }
    answer
}

/// Visible text of the ids so far, handed out as it grows. A piece is held back while the text
/// ends inside a character (a byte-fallback id of a multi-byte character).
#[derive(Default)]
struct TextStream {
    ids: Vec<i32>,
    sent: usize,
}

impl TextStream {
    fn next_piece(&mut self, tok: &Tokenizer) -> Option<String> {
        let text = tok.decode(&self.ids);
        if text.ends_with('\u{FFFD}') || text.len() <= self.sent || !text.is_char_boundary(self.sent) {
            return None;
        }
        let piece = text[self.sent..].to_string();
        self.sent = text.len();
        Some(piece)
    }
}
