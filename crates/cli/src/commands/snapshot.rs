//! `skainet-kv snapshot`: save a prefilled prefix to a file (`save`) and describe one (`info`).
//! `generate` and `bench` load such a file with `--prefix-snapshot` instead of prefilling.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kv_core::snapshot_file::{self, PersistSnapshot};
use kv_core::{KvBackend, KvDecoder};
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::report::{ms, parse_ids};

#[derive(Args)]
pub struct SnapshotArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Prefill a prefix and save its snapshot to a file (written atomically).
    Save(Box<SaveArgs>),
    /// Check a snapshot file whole (length, CRC-32, every value finite) and print its header:
    /// model fingerprint, position, rows per layer. A damaged file is an error.
    Info {
        /// A snapshot file written by `snapshot save`.
        file: PathBuf,
        /// The header as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub struct SaveArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// or a model directory.
    #[arg(short = 'm', long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// The backend that runs the model.
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// The prefix as ids (`1,2,3`).
    #[arg(long, value_parser = parse_ids, required_unless_present_any = ["prefix_file", "system", "system_file", "tools"])]
    prefix_ids: Vec<Vec<i32>>,
    /// The prefix as a text file, tokenized with the model's tokenizer (BOS as its metadata
    /// says; special tokens written in it are parsed, so a chat turn can be written out).
    #[arg(long, conflicts_with = "prefix_ids")]
    prefix_file: Option<PathBuf>,
    /// The prefix as a conversation's system turn with tool declarations, rendered through the
    /// model's chat template; the file records their digest, and `generate --prefix-snapshot`
    /// refuses a request with other ones.
    #[command(flatten)]
    system: crate::conversation::SystemArgs,
    /// The snapshot file to write (atomically).
    #[arg(long)]
    out: PathBuf,
    /// Which keys a sliding layer sees: the exact rule, or the seed library's one key wider.
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    /// One JSON object (file, bytes, positions, timings) instead of a line.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct SaveReport {
    file: String,
    backend: String,
    prefix_tokens: usize,
    bytes: u64,
    prefill_ms: f64,
    save_ms: f64,
    model_fingerprint: String,
}

/// Loads `path` into a new snapshot of `backend` (not restored), timed.
pub fn load<B: PersistSnapshot>(backend: &B, path: &Path) -> Result<(B::Snapshot, Duration)> {
    let t = Instant::now();
    let snapshot =
        snapshot_file::load(backend, path).with_context(|| format!("loading --prefix-snapshot {}", path.display()))?;
    Ok((snapshot, t.elapsed()))
}

pub fn run(args: SnapshotArgs) -> Result<()> {
    match args.action {
        Action::Save(args) => save(*args),
        Action::Info { file, json } => info(&file, json),
    }
}

/// The prefix's ids, and its prompt digest where it is a rendered system turn.
fn prefix_of(args: &SaveArgs) -> Result<(Vec<i32>, Option<String>)> {
    if args.system.given() {
        if args.prefix_file.is_some() || !args.prefix_ids.is_empty() {
            bail!("--system / --tools make the prefix: give them or --prefix-ids / --prefix-file, not both");
        }
        let tok = crate::model::tokenizer(&args.model)?;
        let (ids, digest) = crate::conversation::prefix(&tok, args.system.system()?, args.system.catalog()?)?;
        return Ok((ids, Some(digest)));
    }
    let ids = match &args.prefix_file {
        Some(file) => {
            let text = crate::text::read_text_file("--prefix-file", file)?;
            let tok = crate::model::tokenizer(&args.model)?;
            tok.encode(&text, tok.add_bos_default())
        }
        None => args.prefix_ids.concat(),
    };
    if ids.is_empty() {
        bail!("the prefix is empty: give --prefix-ids 1,2,3 or a non-empty --prefix-file");
    }
    Ok((ids, None))
}

fn save(args: SaveArgs) -> Result<()> {
    // Before the prefill: a FIFO or a device as --out is refused now, not after the work.
    snapshot_file::check_target(&args.out).context("--out")?;
    let (prefix, digest) = prefix_of(&args)?;
    let source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let (backend, _) = backends::open_kv(args.backend, &source, args.window_rule)?;
    let report = crate::with_backend!(backend, b => {
        let name = b.name();
        let fingerprint = b.model_fingerprint()?.to_hex();
        let mut decoder = KvDecoder::new(b);
        let t = Instant::now();
        let snapshot = decoder.prefill_prefix(&prefix).context("prefilling the prefix")?;
        let prefill = t.elapsed();
        let t = Instant::now();
        let bytes = snapshot_file::save_with_digest(decoder.backend(), &snapshot, &args.out, digest.as_deref())
            .with_context(|| format!("saving {}", args.out.display()))?;
        SaveReport {
            file: args.out.display().to_string(),
            backend: name,
            prefix_tokens: prefix.len(),
            bytes,
            prefill_ms: ms(prefill),
            save_ms: ms(t.elapsed()),
            model_fingerprint: fingerprint,
        }
    });
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        crate::outln!(
            "saved {} tokens of prefix to {} ({:.1} MB) on {}: prefill {:.1} ms, save {:.1} ms",
            report.prefix_tokens,
            report.file,
            report.bytes as f64 / 1e6,
            report.backend,
            report.prefill_ms,
            report.save_ms
        )?;
    }
    Ok(())
}

fn info(file: &Path, json: bool) -> Result<()> {
    // The whole file (length, CRC, values), not just its header: a damaged file is an error
    // here as it is on load, not a header printed as if all were well.
    let header = snapshot_file::verify(file).with_context(|| format!("checking {}", file.display()))?;
    if json {
        crate::outln!("{}", serde_json::to_string(&header)?)?;
        return Ok(());
    }
    let spec = &header.spec;
    crate::outln!("{}", file.display())?;
    crate::outln!("  position        {}", header.position)?;
    crate::outln!("  model           {}", header.model)?;
    crate::outln!(
        "  geometry        {} layers, {} KV heads × {}, window {}, vocab {}",
        spec.n_layers,
        spec.n_kv_heads,
        spec.head_dim,
        spec.sliding_window,
        spec.vocab_size
    )?;
    crate::outln!("  window rule     {}", header.window_rule)?;
    crate::outln!("  contract        v{}", header.contract_version)?;
    crate::outln!("  saved by        {}", header.saved_by)?;
    if let Some(digest) = &header.prompt_digest {
        crate::outln!("  prompt digest   {digest} (system text, tools, template)")?;
    }
    crate::outln!("  data            {} bytes, {}", header.data_bytes, header.dtype)?;
    let rows: Vec<String> = header.layers.iter().map(|l| l.rows.to_string()).collect();
    crate::outln!("  rows per layer  {}", rows.join(" "))?;
    Ok(())
}
