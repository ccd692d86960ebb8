//! `verify DIR`: every file of an export hashed in full against its `digests.json`
//! (`kv_core::digests`); opening a session checks only the modules it loads in full and its
//! archives by a stamp of their ends, so damage in the middle of an archive is found here.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, Result};
use clap::Args;
use kv_core::digests::{Digests, DIGESTS_FILE};

/// Hash every file of an export (manifest, modules, archives) against its digests.json; with
/// --model, also check that it is that model's export.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The artifact directory (written by `export`, or an entry of the cache's `artifacts/`).
    dir: PathBuf,
    /// The model the artifacts must have been exported from (as `generate --model`).
    #[arg(long)]
    model: Option<String>,
    /// The model's weight format, with --model (`bf16`, `q8`, `q4`: as `--weights` of the other
    /// commands).
    #[arg(long, value_parser = crate::flags::WeightsParser, default_value = "bf16", requires = "model")]
    weights: crate::model::WeightsChoice,
}

pub fn run(args: VerifyArgs) -> Result<()> {
    let dir = &args.dir;
    let digests = Digests::load(dir)?.ok_or_else(|| {
        anyhow!(
            "{}: no {DIGESTS_FILE} (not an export, or exported before digests were written): re-export it to verify it",
            dir.display()
        )
    })?;
    let t = Instant::now();
    digests.verify(dir)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    #[cfg(feature = "iree")]
    if let Some(model) = &args.model {
        let model_dir = crate::model::resolve_with(model, args.weights)?;
        export::check_binding(dir, &model_dir, model)?;
    }
    #[cfg(not(feature = "iree"))]
    if args.model.is_some() {
        anyhow::bail!("--model: this build has no exporter (feature `iree`) to check bindings with");
    }
    let bytes: u64 = digests.files.values().map(|f| f.size).sum();
    let bound = args
        .model
        .as_deref()
        .map(|m| format!(", exported from {m}"))
        .unwrap_or_default();
    writeln!(
        std::io::stdout(),
        "{}: {} files, {bytes} bytes match {DIGESTS_FILE} ({ms:.0} ms){bound}",
        dir.display(),
        digests.files.len()
    )?;
    Ok(())
}
