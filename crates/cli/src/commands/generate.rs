//! `skainet-kv generate`: one prefix, one utterance, greedy ids.

use anyhow::{Context, Result};
use clap::Args;
use kv_core::KvDecoder;
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice};
use crate::report::{ids_to_string, ms, parse_ids};

#[derive(Args)]
pub struct GenerateArgs {
    #[arg(long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// The shared prefix, prefilled once (`1,2,3`).
    #[arg(long, value_parser = parse_ids, required = true)]
    prefix_ids: Vec<Vec<i32>>,
    /// The utterance, fed in chunk calls.
    #[arg(long, value_parser = parse_ids, required = true)]
    ids: Vec<Vec<i32>>,
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    #[arg(long)]
    eos: Option<i32>,
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct GenerateReport {
    ids: Vec<i32>,
    stopped_at_eos: bool,
    restore_ms: f64,
    chunk_ms: f64,
    chunk_calls: usize,
    decode_ms: f64,
    decode_tokens: usize,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let prefix: Vec<i32> = args.prefix_ids.concat();
    let ids: Vec<i32> = args.ids.concat();
    anyhow::ensure!(
        !prefix.is_empty(),
        "--prefix-ids: give at least one id (the prefix is prefilled once)"
    );
    anyhow::ensure!(!ids.is_empty(), "--ids: give at least one id");
    let source = ModelSource {
        model: args.model.clone(),
        artifacts: args.artifacts.clone(),
    };
    let (backend, _) = backends::open_kv(args.backend, &source, args.window_rule)?;
    let generation = crate::with_backend!(backend, b => {
        let mut decoder = KvDecoder::new(b);
        let snapshot = decoder.prefill_prefix(&prefix).context("prefilling --prefix-ids")?;
        decoder.generate(&snapshot, &ids, args.eos, args.max_new)?
    });
    if args.json {
        let t = &generation.timing;
        let report = GenerateReport {
            ids: generation.ids,
            stopped_at_eos: generation.stopped_at_eos,
            restore_ms: ms(t.restore),
            chunk_ms: ms(t.chunk),
            chunk_calls: t.chunk_calls,
            decode_ms: ms(t.decode),
            decode_tokens: t.decode_tokens,
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", ids_to_string(&generation.ids));
    }
    Ok(())
}
