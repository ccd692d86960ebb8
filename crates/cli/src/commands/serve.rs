//! `skainet-kv serve`: the OpenAI-compatible local server (`crates/server`) over one model,
//! opened as `demo` and `generate` open it (a fixture offline by default, a real model by name).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kv_core::KvBackend;
use tokenizer::Tokenizer;

use crate::backends::{self, AnyKv, BackendChoice, ModelSource, RuleChoice, TargetArgs};

#[derive(Args)]
pub struct ServeArgs {
    /// The model: a real model's name (`smollm2-135m`, `gemma3-270m`), a fixture name (its
    /// fixture vocabulary: runs offline) or an export directory holding `tokenizer.gguf`.
    #[arg(short = 'm', long, default_value = fixtures::DEFAULT_MODEL)]
    model: String,
    /// Default: `reference` for fixtures and directories, `iree-cpu` for real models.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// The address to listen on; anything but loopback also needs `--allow-non-loopback`.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// The port (0: one the OS picks, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Listen on a non-loopback address: the server has no authentication, so anyone who can
    /// reach the port can use the model.
    #[arg(long)]
    allow_non_loopback: bool,
    /// Sessions answering at once (each its own KV caches and prefix cache; IREE shares the
    /// weights between them, the reference loads them per session).
    #[arg(long, default_value_t = 1)]
    sessions: usize,
    /// Requests waiting for a session at most; one more is answered 429.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// Request bodies above this many bytes are answered 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// `max_tokens` above this is refused.
    #[arg(long, default_value_t = 2048)]
    max_tokens_limit: usize,
    /// `max_tokens` of a request that gives none (capped by the context left).
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Ids per prefix-cache block (default: whole chunk calls, at least 32).
    #[arg(long)]
    prefix_block: Option<usize>,
    /// Estimated MiB of prefix snapshots each session keeps (least recently used evicted
    /// first); 0 turns prefix caching off.
    #[arg(long, default_value_t = 512)]
    prefix_cache_mb: usize,
    /// Temperature of requests that give none (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k logits an on-demand export hands over, for requests that sample (temperature
    /// above 0); 0: greedy only, sampled requests are refused.
    #[arg(long, default_value_t = kv_core::sampling::DEFAULT_CANDIDATES)]
    top_k: usize,
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.sessions == 0 {
        bail!("--sessions must be at least 1");
    }
    let addr = SocketAddr::new(args.host, args.port);
    if !args.host.is_loopback() && !args.allow_non_loopback {
        bail!("--host {}: not a loopback address; the server has no authentication, so give --allow-non-loopback to listen there", args.host);
    }
    let real = crate::model::is_real_model(&args.model);
    // Tokenizer first: a model without one fails before an export or a session is paid for.
    let tokenizer = if real {
        Some(crate::model::tokenizer(&args.model)?)
    } else {
        None
    };
    let (choice, source) = backends::select(
        &args.model,
        args.backend,
        args.artifacts.as_deref(),
        &args.target,
        args.top_k,
    );
    let mut sessions = Vec::with_capacity(args.sessions);
    for _ in 0..args.sessions {
        sessions.push(backends::open_kv(choice, &source, RuleChoice::Exact)?.0);
    }
    let tokenizer = match tokenizer {
        Some(t) => t,
        None => fixture_or_export_tokenizer(&args, &source, &sessions[0])?,
    };
    let config = server::ServerConfig {
        addr,
        allow_non_loopback: args.allow_non_loopback,
        queue_capacity: args.queue,
        max_body_bytes: args.max_body_bytes,
        max_tokens_limit: args.max_tokens_limit,
        default_max_tokens: args.default_max_tokens,
        prefix_block: args.prefix_block,
        prefix_cache_bytes: args.prefix_cache_mb << 20,
        default_temperature: args.temperature,
        snapshot_storage: server::SnapshotStorage::Copied,
    };
    #[cfg(feature = "iree")]
    let config = server::ServerConfig {
        snapshot_storage: match &sessions[0] {
            AnyKv::Iree(b) if b.manifest().is_v2() => server::SnapshotStorage::Shared,
            _ => server::SnapshotStorage::Copied,
        },
        ..config
    };
    let name = args.model.clone();
    let backend_name =
        clap::ValueEnum::to_possible_value(&choice).map_or_else(String::new, |v| v.get_name().to_string());
    let running = match sessions.remove(0) {
        AnyKv::Reference(first) => {
            let rest = sessions.into_iter().map(|s| match s {
                AnyKv::Reference(b) => b,
                #[cfg(feature = "iree")]
                AnyKv::Iree(_) => unreachable!("every session opened with one backend choice"),
            });
            start(std::iter::once(first).chain(rest).collect(), tokenizer, &name, config)?
        }
        #[cfg(feature = "iree")]
        AnyKv::Iree(first) => {
            let rest = sessions.into_iter().map(|s| match s {
                AnyKv::Iree(b) => *b,
                AnyKv::Reference(_) => unreachable!("every session opened with one backend choice"),
            });
            start(std::iter::once(*first).chain(rest).collect(), tokenizer, &name, config)?
        }
    };
    crate::outln!(
        "skainet-kv serve: {name} on http://{} ({} session(s), {}; OpenAI API at /v1, metrics at /metrics)",
        running.addr(),
        args.sessions,
        backend_name
    )?;
    running.wait().context("serving")?;
    Ok(())
}

fn start<B: KvBackend + Send + 'static>(
    backends: Vec<B>,
    tokenizer: Tokenizer,
    name: &str,
    config: server::ServerConfig,
) -> Result<server::RunningServer> {
    Ok(server::start(backends, tokenizer, name, config)?)
}

/// A fixture's vocabulary (its manifest names the fixture), or the `tokenizer.gguf` an export
/// directory holds.
fn fixture_or_export_tokenizer(args: &ServeArgs, source: &ModelSource, session: &AnyKv) -> Result<Tokenizer> {
    let spec = crate::with_backend!(session, b => b.spec().clone());
    let dir = source.model_dir()?;
    let manifest = kv_core::Manifest::load(&dir).with_context(|| format!("reading {}", dir.display()))?;
    if manifest.provenance.fixture_revision.is_some() {
        return Ok(constrain::fixture::tokenizer(spec.vocab_size)?);
    }
    for dir in args.artifacts.iter().chain([&dir]) {
        let path = dir.join(kv_core::digests::TOKENIZER_FILE);
        if path.is_file() {
            let file = gguf::GgufFile::open(&path).with_context(|| format!("reading {}", path.display()))?;
            return Tokenizer::from_gguf(&file).with_context(|| format!("reading {}", path.display()));
        }
    }
    bail!(
        "--model {}: no tokenizer (a real model's name, a fixture, or an export directory holding {})",
        args.model,
        kv_core::digests::TOKENIZER_FILE
    )
}
