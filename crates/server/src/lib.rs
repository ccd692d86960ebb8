//! An OpenAI-compatible local server over one model: `/v1/chat/completions` (JSON or server-sent
//! events, `tools`/`tool_choice` decoded under the tools' grammar), `/v1/completions`,
//! `/v1/models`, `/health` and `/metrics`, with automatic prefix caching.
//!
//! Design:
//! - **One model, a pool of sessions.** The caller opens `N` backends on one model (IREE shares
//!   the weights between sessions of a process; the reference shares its `Arc` model) and
//!   [`start`] gives each a worker thread that owns it ([`worker`]). Requests are rendered and
//!   checked on the HTTP side, then queued on a bounded channel; a full queue answers 429 at
//!   once rather than letting latency grow without bound.
//! - **Prefix caching is exact** ([`prefix`]): prompts are computed in fixed blocks whatever the
//!   cache holds, and snapshots are kept at block boundaries, so a hit changes how much is
//!   computed, never the answer.
//! - **The client leaving stops decoding.** A request's events go through a channel whose
//!   receiver the response owns; when the connection closes the response is dropped, and the
//!   worker, which checks the channel after every id, stops there.
//! - **Loopback unless asked.** A non-loopback address is refused without
//!   [`ServerConfig::allow_non_loopback`]: the server has no authentication.

pub mod api;
pub mod metrics;
pub mod prefix;
mod worker;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json as JsonBody, Router};
use kv_core::sampling::DEFAULT_CANDIDATES;
use kv_core::{KvBackend, KvDecoder, SamplingConfig};
use serde_json::{json, Value as Json};
use tokenizer::tools::{self, Tool, ToolChoice};
use tokenizer::{Message, Tokenizer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{ApiError, ChatMessage, ChatRequest, Common, CompletionRequest, Prompt};
use crate::metrics::Metrics;
use crate::prefix::PrefixCache;
use crate::worker::{Event, Job, ModelInfo, Outcome, Worker};

/// How the server listens and what it accepts.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// Bind an address other than loopback (the server has no authentication).
    pub allow_non_loopback: bool,
    /// Requests waiting for a session at most; one more is answered 429.
    pub queue_capacity: usize,
    /// Request bodies above this are answered 413.
    pub max_body_bytes: usize,
    /// `max_tokens` above this is refused (400).
    pub max_tokens_limit: usize,
    /// `max_tokens` when the request gives none (capped by the context left).
    pub default_max_tokens: usize,
    /// Ids per prefix-cache block; `None`: [`default_block`].
    pub prefix_block: Option<usize>,
    /// Estimated bytes of snapshots each session keeps; 0 turns the cache off.
    pub prefix_cache_bytes: usize,
    /// Temperature when a request gives none (0: greedy, which every export decodes).
    pub default_temperature: f32,
    /// How the backend stores snapshots, which decides what the cache's budget counts.
    pub snapshot_storage: SnapshotStorage,
}

/// What a kept snapshot costs, for the prefix cache's budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SnapshotStorage {
    /// Each snapshot holds its own rows (the reference; IREE contract 1, whose calls return new
    /// caches): a snapshot at position `p` costs its `p` rows.
    #[default]
    Copied,
    /// Snapshots along one prompt share the session's caches (IREE contract 2 pins a cache set
    /// and a position): a block's snapshot costs the rows it added. A request that branches off
    /// before a kept snapshot's end forks a whole cache set, which this does not count.
    Shared,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            allow_non_loopback: false,
            queue_capacity: 16,
            max_body_bytes: 1 << 20,
            max_tokens_limit: 2048,
            default_max_tokens: 256,
            prefix_block: None,
            prefix_cache_bytes: 512 << 20,
            default_temperature: 0.0,
            snapshot_storage: SnapshotStorage::Copied,
        }
    }
}

/// Ids per cache block: whole chunk calls, at least 32 ids (fewer, smaller snapshots cost more
/// bookkeeping than they save).
pub fn default_block(spec: &kv_core::KvSpec) -> usize {
    let chunk = spec.chunk.max(1);
    32usize.div_ceil(chunk) * chunk
}

/// Estimated bytes of a snapshot at `position`: the K and V rows it holds, at 4 bytes a value
/// (f16 caches hold half; IREE's contract 2 may pin a whole cache set, which is more: the budget
/// is an estimate, documented as such).
pub fn snapshot_bytes(spec: &kv_core::KvSpec, position: usize) -> usize {
    (0..spec.n_layers)
        .map(|l| {
            let rows = match spec.window(spec.layer_kind(l)) {
                Some(w) => position.min(w),
                None => position,
            };
            rows * spec.n_kv_heads * spec.head_dim * 2 * 4
        })
        .sum()
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0} is not a loopback address: the server has no authentication; allow it explicitly (--allow-non-loopback) to listen there")]
    NonLoopback(SocketAddr),
    #[error("binding {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("no session to serve with")]
    NoSessions,
    #[error("the model: {0}")]
    Model(String),
    #[error(transparent)]
    Kv(#[from] kv_core::Error),
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
}

/// A server listening in the background; [`RunningServer::shutdown`] stops it.
pub struct RunningServer {
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
    workers: Vec<JoinHandle<()>>,
}

impl RunningServer {
    /// Where it listens (the port the OS chose for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics(&self) -> Json {
        self.metrics.to_json()
    }

    /// Runs until the HTTP side ends (an I/O error).
    pub fn wait(mut self) -> std::io::Result<()> {
        let result = self.join_http();
        self.join_workers();
        result
    }

    /// Stops accepting, lets requests in flight finish, stops the sessions.
    pub fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let result = self.join_http();
        self.join_workers();
        result
    }

    fn join_http(&mut self) -> std::io::Result<()> {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(std::io::Error::other("the HTTP thread panicked")),
            None => Ok(()),
        }
    }

    /// The HTTP side dropped the queue's sender: each worker ends after its request.
    fn join_workers(&mut self) {
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = self.join_http();
        self.join_workers();
    }
}

struct Shared {
    model: Arc<ModelInfo>,
    jobs: SyncSender<Job>,
    metrics: Arc<Metrics>,
    config: ServerConfig,
    next_id: AtomicU64,
    sessions: usize,
    block: usize,
}

type AppState = Arc<Shared>;

/// Starts serving `backends` (sessions of one model, `tokenizer` its vocabulary and template)
/// as `name` on `config.addr`; returns once the address is bound.
pub fn start<B>(
    backends: Vec<B>,
    tokenizer: Tokenizer,
    name: &str,
    config: ServerConfig,
) -> Result<RunningServer, StartError>
where
    B: KvBackend + Send + 'static,
{
    if !config.addr.ip().is_loopback() && !config.allow_non_loopback {
        return Err(StartError::NonLoopback(config.addr));
    }
    let mut backends = backends;
    let first = backends.first_mut().ok_or(StartError::NoSessions)?;
    let spec = first.spec().clone();
    if tokenizer.vocab_size() > spec.vocab_size {
        return Err(StartError::Model(format!(
            "the tokenizer has {} ids, the graphs' vocabulary {}",
            tokenizer.vocab_size(),
            spec.vocab_size
        )));
    }
    // Asked once: a backend without a mask (contract 1 graphs) refuses one, and keeps none.
    let masks = first
        .set_allowed(Some(&kv_core::allowed::AllowedTokens::none(spec.vocab_size)))
        .is_ok();
    first.set_allowed(None)?;
    let top_k_capacity = first.top_k_capacity();
    let format = tokenizer.tool_format();
    let constrainer = match format {
        Some(_) => Some(constrain::Constrainer::new(&tokenizer).map_err(|e| StartError::Model(e.to_string()))?),
        None => None,
    };
    let mut stops = tokenizer.stop_tokens();
    if format == Some(tools::ToolFormat::FunctionGemma) {
        // FunctionGemma ends its turn after a call by opening the app's (as the engine stops).
        stops.extend(tokenizer.token_id(constrain::FG_RESPONSE_START));
    }
    let model = Arc::new(ModelInfo {
        name: name.to_string(),
        tokenizer,
        format,
        constrainer,
        masks,
        stops,
        spec: spec.clone(),
        top_k_capacity,
    });
    let block = config.prefix_block.unwrap_or_else(|| default_block(&spec)).max(1);
    let sessions = backends.len();
    let metrics = Arc::new(Metrics::new(sessions));
    let (jobs, rx) = sync_channel::<Job>(config.queue_capacity);
    let rx = Arc::new(Mutex::new(rx));
    let mut workers = Vec::with_capacity(sessions);
    for (index, backend) in backends.into_iter().enumerate() {
        let cost_spec = spec.clone();
        let storage = config.snapshot_storage;
        let cost = move |p: usize| match storage {
            SnapshotStorage::Copied => snapshot_bytes(&cost_spec, p),
            SnapshotStorage::Shared => {
                snapshot_bytes(&cost_spec, p) - snapshot_bytes(&cost_spec, p.saturating_sub(block))
            }
        };
        let (model, metrics, rx, budget) = (model.clone(), metrics.clone(), rx.clone(), config.prefix_cache_bytes);
        // Built on its thread: snapshots need not be `Send`, and never leave it.
        let serve = move || {
            Worker {
                index,
                decoder: KvDecoder::new(backend),
                cache: PrefixCache::new(block, budget, cost),
                model,
                metrics,
            }
            .serve(rx)
        };
        workers.push(
            std::thread::Builder::new()
                .name(format!("session-{index}"))
                .spawn(serve)
                .map_err(StartError::Runtime)?,
        );
    }

    let listener = std::net::TcpListener::bind(config.addr).map_err(|source| StartError::Bind {
        addr: config.addr,
        source,
    })?;
    let addr = listener.local_addr().map_err(StartError::Runtime)?;
    listener.set_nonblocking(true).map_err(StartError::Runtime)?;
    let state = Arc::new(Shared {
        model,
        jobs,
        metrics: metrics.clone(),
        config: config.clone(),
        next_id: AtomicU64::new(1),
        sessions,
        block,
    });
    let app = router(state, config.max_body_bytes);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("http")
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop_rx.await;
                    })
                    .await
            })
        })
        .map_err(StartError::Runtime)?;
    Ok(RunningServer {
        addr,
        metrics,
        shutdown: Some(stop_tx),
        thread: Some(thread),
        workers,
    })
}

fn router(state: AppState, max_body: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        "no such endpoint",
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        "this endpoint does not take that method",
    )
}

async fn health(State(s): State<AppState>) -> JsonBody<Json> {
    JsonBody(json!({
        "status": "ok",
        "model": s.model.name,
        "sessions": s.sessions,
        "queue": {"depth": s.metrics.queued.load(Ordering::SeqCst), "capacity": s.config.queue_capacity},
    }))
}

async fn models(State(s): State<AppState>) -> JsonBody<Json> {
    JsonBody(json!({
        "object": "list",
        "data": [{
            "id": s.model.name,
            "object": "model",
            "created": 0,
            "owned_by": "skainet-kv",
            "context_length": s.model.spec.max_positions,
        }],
    }))
}

async fn metrics(State(s): State<AppState>) -> JsonBody<Json> {
    let mut body = s.metrics.to_json();
    body["prefix_cache"]["block"] = json!(s.block);
    body["prefix_cache"]["budget_bytes_per_session"] = json!(s.config.prefix_cache_bytes);
    body["sessions"] = json!(s.sessions);
    JsonBody(body)
}

/// The request body, or the reason there is none to read (too large: 413).
fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            "the request body is larger than this server accepts (--max-body-bytes)",
        ),
        status => ApiError::new(
            status,
            "invalid_request_error",
            "unreadable_body",
            rejection.body_text(),
        ),
    })
}

async fn chat(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    s.metrics.requests.fetch_add(1, Ordering::SeqCst);
    let prepared = body_bytes(body).and_then(|b| prepare_chat(&s, &b));
    respond(&s, prepared, Kind::Chat).await
}

async fn completions(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    s.metrics.requests.fetch_add(1, Ordering::SeqCst);
    let prepared = body_bytes(body).and_then(|b| prepare_completion(&s, &b));
    respond(&s, prepared, Kind::Completion).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// A checked request: the job for a session, and how to answer.
struct Prepared {
    job: Job,
    rx: UnboundedReceiver<Event>,
    model: String,
    stream: bool,
    include_usage: bool,
    return_ids: bool,
}

fn prepare_chat(s: &Shared, body: &[u8]) -> Result<Prepared, ApiError> {
    let request: ChatRequest = api::parse_body(body)?;
    if request.messages.is_empty() {
        return Err(ApiError::invalid(
            "invalid_messages",
            Some("messages"),
            "messages is empty",
        ));
    }
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| to_message(i, m, &request.messages[..i]))
        .collect::<Result<Vec<_>, _>>()?;
    let tools = match request.tools.as_deref() {
        None | Some([]) => Vec::new(),
        Some(list) => tools::parse_catalog(&Json::Array(list.to_vec()).to_string())
            .map_err(|e| ApiError::invalid("invalid_tools", Some("tools"), e.to_string()))?,
    };
    let choice_text = api::tool_choice(request.tool_choice.as_ref())?;
    let choice: ToolChoice = choice_text
        .parse()
        .map_err(|e: tools::ToolError| ApiError::invalid("invalid_tool_choice", Some("tool_choice"), e.to_string()))?;
    if let ToolChoice::Function(name) = &choice {
        if !tools.iter().any(|t| &t.name == name) {
            return Err(ApiError::invalid(
                "invalid_tool_choice",
                Some("tool_choice"),
                format!("tool_choice names `{name}`, which is not in tools"),
            ));
        }
    }
    if choice == ToolChoice::Required && tools.is_empty() {
        return Err(ApiError::invalid(
            "invalid_tool_choice",
            Some("tool_choice"),
            "tool_choice is \"required\" but no tools are given",
        ));
    }
    if !tools.is_empty() && s.model.format.is_none() {
        return Err(ApiError::invalid(
            "tools_unsupported",
            Some("tools"),
            format!(
                "{}'s chat template and vocabulary have no tool-call syntax",
                s.model.name
            ),
        ));
    }
    // `none` renders no tools (as the engine's conversations): the answer is text.
    let tools: Vec<Tool> = if choice == ToolChoice::None { Vec::new() } else { tools };
    let prompt = s
        .model
        .tokenizer
        .encode_chat_with_tools(&messages, &tools)
        .map_err(|e| ApiError::invalid("invalid_messages", Some("messages"), e.to_string()))?;
    prepare(s, request.common, prompt, tools, choice)
}

fn prepare_completion(s: &Shared, body: &[u8]) -> Result<Prepared, ApiError> {
    let request: CompletionRequest = api::parse_body(body)?;
    let tok = &s.model.tokenizer;
    let prompt = match request.prompt {
        Prompt::Text(text) => tok.encode(&text, tok.add_bos_default()),
        Prompt::Texts(texts) if texts.len() == 1 => tok.encode(&texts[0], tok.add_bos_default()),
        Prompt::Texts(_) => {
            return Err(ApiError::invalid(
                "unsupported_batch",
                Some("prompt"),
                "one prompt per request (send the others as requests of their own)",
            ))
        }
        Prompt::Ids(ids) => {
            let vocab = s.model.spec.vocab_size as i64;
            match ids.iter().find(|&&id| !(0..vocab).contains(&id)) {
                Some(id) => {
                    return Err(ApiError::invalid(
                        "invalid_prompt",
                        Some("prompt"),
                        format!("token id {id} is outside the vocabulary (0..{vocab})"),
                    ))
                }
                None => ids.into_iter().map(|id| id as i32).collect(),
            }
        }
    };
    prepare(s, request.common, prompt, Vec::new(), ToolChoice::Auto)
}

/// An OpenAI message as the template takes it: text content (parts joined), an assistant's
/// calls, a tool result's function name (given, or found by `tool_call_id` among the calls
/// before it).
fn to_message(i: usize, m: &ChatMessage, before: &[ChatMessage]) -> Result<Message, ApiError> {
    let bad =
        |reason: String| ApiError::invalid("invalid_messages", Some("messages"), format!("messages[{i}]: {reason}"));
    if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
        return Err(bad(format!("unknown role `{}`", m.role)));
    }
    let content = match &m.content {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Json::as_str),
                    p.get("text").and_then(Json::as_str),
                ) {
                    (Some("text") | None, Some(t)) => text.push_str(t),
                    (Some(other), _) => {
                        return Err(bad(format!(
                            "content parts of type `{other}` are not supported (text only)"
                        )))
                    }
                    (None, None) => return Err(bad("a content part without text".into())),
                }
            }
            text
        }
        Some(other) => return Err(bad(format!("content {other} is not text"))),
    };
    let mut message = Message::new(m.role.clone(), content);
    for call in m.tool_calls.iter().flatten() {
        let f = call.get("function").unwrap_or(call);
        let name = f
            .get("name")
            .and_then(Json::as_str)
            .ok_or_else(|| bad("a tool call without a name".into()))?;
        let arguments = match f.get("arguments") {
            None | Some(Json::Null) => serde_json::Map::new(),
            Some(Json::Object(o)) => o.clone(),
            Some(Json::String(text)) => match serde_json::from_str(text) {
                Ok(Json::Object(o)) => o,
                _ => return Err(bad(format!("the arguments of `{name}` are not a JSON object"))),
            },
            Some(other) => return Err(bad(format!("the arguments of `{name}` are {other}, not an object"))),
        };
        message.tool_calls.push(tools::ToolCall {
            name: name.to_string(),
            arguments,
        });
    }
    if m.role == "tool" {
        let by_id = m.tool_call_id.as_deref().and_then(|id| {
            before.iter().rev().find_map(|b| {
                b.tool_calls.iter().flatten().find_map(|c| {
                    (c.get("id").and_then(Json::as_str) == Some(id))
                        .then(|| c.get("function").unwrap_or(c).get("name").and_then(Json::as_str))
                        .flatten()
                        .map(String::from)
                })
            })
        });
        let name = m
            .name
            .clone()
            .or(by_id)
            .ok_or_else(|| bad("a tool result needs `name` or the `tool_call_id` of an earlier call".into()))?;
        message.name = Some(name);
    }
    Ok(message)
}

/// Limits, sampling and stops of a request with `prompt` rendered: its job, queued.
fn prepare(
    s: &Shared,
    common: Common,
    prompt: Vec<i32>,
    tools: Vec<Tool>,
    choice: ToolChoice,
) -> Result<Prepared, ApiError> {
    let spec = &s.model.spec;
    let config = &s.config;
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "unsupported_n",
            Some("n"),
            "n must be 1 (one answer per request)",
        ));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "invalid_prompt",
            Some("prompt"),
            "the prompt is empty",
        ));
    }
    if prompt.len() >= spec.max_positions {
        return Err(ApiError::invalid(
            "context_length_exceeded",
            Some("messages"),
            format!(
                "the prompt is {} tokens; this model's context is {} (room is needed for the answer)",
                prompt.len(),
                spec.max_positions
            ),
        ));
    }
    let room = spec.max_positions - prompt.len();
    let max_new = match common.max_completion_tokens.or(common.max_tokens) {
        Some(0) => {
            return Err(ApiError::invalid(
                "invalid_max_tokens",
                Some("max_tokens"),
                "max_tokens must be at least 1",
            ))
        }
        Some(n) if n > config.max_tokens_limit => {
            return Err(ApiError::invalid(
                "invalid_max_tokens",
                Some("max_tokens"),
                format!(
                    "max_tokens {n} is above this server's limit of {}",
                    config.max_tokens_limit
                ),
            ))
        }
        Some(n) if n > room => {
            return Err(ApiError::invalid(
                "context_length_exceeded",
                Some("max_tokens"),
                format!(
                    "the prompt ({} tokens) and max_tokens {n} exceed this model's context of {} tokens",
                    prompt.len(),
                    spec.max_positions
                ),
            ))
        }
        Some(n) => n,
        None => config.default_max_tokens.min(room),
    };
    let temperature = common.temperature.unwrap_or(config.default_temperature);
    let sampling = if temperature == 0.0 {
        None
    } else {
        let Some(capacity) = s.model.top_k_capacity else {
            return Err(ApiError::invalid(
                "sampling_unsupported",
                Some("temperature"),
                "this export hands over no top-k logits, so it decodes greedily only (temperature 0); export it with \
                 `--top-k N` (serve --top-k) to sample",
            ));
        };
        let seed = common.seed.unwrap_or_else(|| {
            // OpenAI samples afresh without a seed.
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
                ^ s.next_id.load(Ordering::SeqCst).rotate_left(32)
        });
        let config = SamplingConfig {
            temperature,
            top_p: common.top_p.unwrap_or(1.0),
            seed,
            candidates: capacity.min(DEFAULT_CANDIDATES),
            ..SamplingConfig::default()
        };
        config
            .validate()
            .map_err(|e| ApiError::invalid("invalid_sampling", Some("temperature"), e.to_string()))?;
        Some(config)
    };
    let stop_strings = common.stop.map(api::Stop::into_vec).unwrap_or_default();
    if stop_strings.len() > 4 || stop_strings.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "invalid_stop",
            Some("stop"),
            "stop takes up to 4 non-empty strings",
        ));
    }
    let (events, rx) = unbounded_channel();
    let job = Job {
        prompt,
        max_new,
        ignore_eos: common.ignore_eos,
        sampling,
        stop_strings,
        tools,
        choice,
        stream: common.stream,
        events,
        enqueued: Instant::now(),
    };
    Ok(Prepared {
        job,
        rx,
        model: common.model.unwrap_or_else(|| s.model.name.clone()),
        stream: common.stream,
        include_usage: common.stream_options.is_some_and(|o| o.include_usage),
        return_ids: common.return_token_ids,
    })
}

async fn respond(s: &AppState, prepared: Result<Prepared, ApiError>, kind: Kind) -> Response {
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => {
            s.metrics.record_error(e.status);
            return e.into_response();
        }
    };
    let Prepared {
        job,
        rx,
        model,
        stream,
        include_usage,
        return_ids,
    } = prepared;
    let prompt_ids = return_ids.then(|| job.prompt.clone());
    s.metrics.queued.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = s.jobs.try_send(job) {
        s.metrics.queued.fetch_sub(1, Ordering::SeqCst);
        let e = match e {
            TrySendError::Full(_) => {
                s.metrics.rejected.fetch_add(1, Ordering::SeqCst);
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "queue_full",
                    format!(
                        "all {} sessions are busy and {} requests are waiting; retry later",
                        s.sessions, s.config.queue_capacity
                    ),
                )
            }
            TrySendError::Disconnected(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "shutting_down",
                "the server is stopping",
            ),
        };
        return e.into_response();
    }
    let id = s.next_id.fetch_add(1, Ordering::SeqCst);
    let reply = Reply {
        id: match kind {
            Kind::Chat => format!("chatcmpl-{id}"),
            Kind::Completion => format!("cmpl-{id}"),
        },
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model,
        kind,
        prompt_ids,
    };
    if stream {
        return sse(reply, rx, include_usage).into_response();
    }
    let mut rx = rx;
    loop {
        match rx.recv().await {
            Some(Event::Text(_)) => continue,
            Some(Event::Done(outcome)) => return JsonBody(reply.whole(&outcome)).into_response(),
            Some(Event::Failed(e)) => return e.into_response(),
            None => return ApiError::internal("the session ended without an answer").into_response(),
        }
    }
}

/// What every response of one request repeats.
struct Reply {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    prompt_ids: Option<Vec<i32>>,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn usage(o: &Outcome) -> Json {
        json!({
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.ids.len(),
            "total_tokens": o.prompt_tokens + o.ids.len(),
            "prompt_tokens_details": {"cached_tokens": o.timings.cached_tokens},
        })
    }

    fn tool_calls(&self, o: &Outcome, streamed: bool) -> Json {
        Json::Array(
            o.tool_calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut call = json!({
                        "id": format!("call_{}_{i}", self.id),
                        "type": "function",
                        "function": {"name": c.name, "arguments": Json::Object(c.arguments.clone()).to_string()},
                    });
                    if streamed {
                        call["index"] = json!(i);
                    }
                    call
                })
                .collect(),
        )
    }

    /// The non-streamed response.
    fn whole(&self, o: &Outcome) -> Json {
        let mut choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({
                    "role": "assistant",
                    "content": if o.text.is_empty() && !o.tool_calls.is_empty() { Json::Null } else { json!(o.text) },
                });
                if !o.tool_calls.is_empty() {
                    message["tool_calls"] = self.tool_calls(o, false);
                }
                json!({"index": 0, "message": message, "logprobs": null, "finish_reason": o.finish.name()})
            }
            Kind::Completion => json!({"index": 0, "text": o.text, "logprobs": null, "finish_reason": o.finish.name()}),
        };
        if self.prompt_ids.is_some() {
            choice["token_ids"] = json!(o.ids);
        }
        let mut body = json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": Self::usage(o),
            "timings": o.timings,
        });
        if !o.invalid_tool_calls.is_empty() {
            body["invalid_tool_calls"] = json!(o.invalid_tool_calls);
        }
        if let Some(ids) = &self.prompt_ids {
            body["prompt_token_ids"] = json!(ids);
        }
        body
    }

    /// One chunk of a stream, `choice` its one choice (`None`: the usage chunk's empty list).
    fn chunk(&self, choice: Option<Json>) -> Json {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choice.map_or_else(Vec::new, |c| vec![c]),
        })
    }

    fn delta(&self, delta: Json, finish: Option<&str>) -> Json {
        match self.kind {
            Kind::Chat => self.chunk(Some(
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            )),
            Kind::Completion => self.chunk(Some(json!({
                "index": 0,
                "text": delta.get("content").and_then(Json::as_str).unwrap_or_default(),
                "logprobs": null,
                "finish_reason": finish,
            }))),
        }
    }

    /// The chunks that end a stream: text not streamed (a tool answer's), the calls, the finish
    /// reason (with the timings and, when asked, the ids), the usage when asked.
    fn last_chunks(&self, o: &Outcome, include_usage: bool) -> Vec<Json> {
        let mut out = Vec::new();
        let streamed_text = o.tool_calls.is_empty() && o.invalid_tool_calls.is_empty();
        if self.kind == Kind::Chat && !o.tool_calls.is_empty() {
            if !o.text.is_empty() {
                out.push(self.delta(json!({"content": o.text}), None));
            }
            out.push(self.delta(json!({"tool_calls": self.tool_calls(o, true)}), None));
        } else if !streamed_text && !o.text.is_empty() {
            out.push(self.delta(json!({"content": o.text}), None));
        }
        let mut last = self.delta(json!({}), Some(o.finish.name()));
        last["timings"] = serde_json::to_value(&o.timings).unwrap_or(Json::Null);
        if self.prompt_ids.is_some() {
            last["choices"][0]["token_ids"] = json!(o.ids);
        }
        out.push(last);
        if include_usage {
            let mut usage = self.chunk(None);
            usage["usage"] = Self::usage(o);
            out.push(usage);
        }
        out
    }
}

/// The stream of a request: its receiver is owned by the response body, so a client that
/// leaves drops it, and the worker stops at its next id. Keep-alive comments make a silent
/// stream (a tool answer is sent whole at the end) write, which is how a closed connection is
/// noticed.
fn sse(
    reply: Reply,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct State {
        reply: Reply,
        rx: UnboundedReceiver<Event>,
        pending: std::collections::VecDeque<SseEvent>,
        started: bool,
        done: bool,
    }
    let data = |v: Json| SseEvent::default().data(v.to_string());
    let state = State {
        reply,
        rx,
        pending: Default::default(),
        started: false,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(event) = st.pending.pop_front() {
                return Some((Ok(event), st));
            }
            if st.done {
                return None;
            }
            if !st.started {
                st.started = true;
                if st.reply.kind == Kind::Chat {
                    let first = st.reply.delta(json!({"role": "assistant", "content": ""}), None);
                    st.pending.push_back(data(first));
                }
                continue;
            }
            match st.rx.recv().await {
                Some(Event::Text(piece)) => {
                    let chunk = st.reply.delta(json!({"content": piece}), None);
                    st.pending.push_back(data(chunk));
                }
                Some(Event::Done(outcome)) => {
                    for chunk in st.reply.last_chunks(&outcome, include_usage) {
                        st.pending.push_back(data(chunk));
                    }
                    st.pending.push_back(SseEvent::default().data("[DONE]"));
                    st.done = true;
                }
                Some(Event::Failed(e)) => {
                    st.pending.push_back(data(e.body()));
                    st.pending.push_back(SseEvent::default().data("[DONE]"));
                    st.done = true;
                }
                None => {
                    let e = ApiError::internal("the session ended without an answer");
                    st.pending.push_back(data(e.body()));
                    st.done = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_millis(500)))
}
