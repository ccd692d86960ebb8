//! `skainet-kv demo`: the main job on an embedded default model.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use kv_core::{KvBackend, KvDecoder, KvSpec};
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::report::{ids_to_string, ms};

#[derive(Args)]
pub struct DemoArgs {
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// A fixture name or an artifact directory.
    #[arg(long, default_value = fixtures::DEFAULT_MODEL)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// Length of the shared prefix (default: 200, capped by the model's context).
    #[arg(long)]
    prefix_tokens: Option<usize>,
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
pub struct DemoReport {
    pub backend: String,
    pub model: String,
    pub open_ms: f64,
    pub prefix_tokens: usize,
    pub prefix_prefill_ms: f64,
    pub utterances: Vec<UtteranceReport>,
}

#[derive(Serialize)]
pub struct UtteranceReport {
    pub input: Vec<i32>,
    pub ids: Vec<i32>,
    pub restore_ms: f64,
    pub chunk_ms: f64,
    pub chunk_calls: usize,
    pub decode_ms: f64,
    pub decode_tokens: usize,
    pub ms_per_token: f64,
}

/// A deterministic stand-in for a tool catalog: ids spread over the vocabulary.
pub fn demo_prefix(spec: &KvSpec, len: usize) -> Vec<i32> {
    let usable = (spec.vocab_size - 3) as u64;
    (0..len as u64).map(|i| (3 + (i * 7919 + 13) % usable) as i32).collect()
}

/// Three utterances of 5, 9 and 12 tokens: one chunk call, and two with padding rows.
pub fn demo_utterances(spec: &KvSpec) -> Vec<Vec<i32>> {
    let usable = (spec.vocab_size - 3) as u64;
    [(5u64, 101u64), (9, 211), (12, 307)]
        .iter()
        .map(|&(len, salt)| (0..len).map(|i| (3 + (salt * 31 + i * 4513) % usable) as i32).collect())
        .collect()
}

pub fn run_demo<B: KvBackend>(
    backend: B,
    model: &str,
    open: Duration,
    prefix_tokens: Option<usize>,
    max_new: usize,
) -> Result<DemoReport> {
    let spec = backend.spec().clone();
    let name = backend.name();
    let prefix_len = prefix_tokens.unwrap_or(200).min(spec.max_positions / 2).max(1);
    let prefix = demo_prefix(&spec, prefix_len);
    let mut decoder = KvDecoder::new(backend);
    let t = Instant::now();
    let snapshot = decoder.prefill_prefix(&prefix)?;
    let prefix_prefill = t.elapsed();
    let mut utterances = Vec::new();
    for input in demo_utterances(&spec) {
        let generation = decoder.generate(&snapshot, &input, None, max_new)?;
        let timing = &generation.timing;
        utterances.push(UtteranceReport {
            input,
            ids: generation.ids,
            restore_ms: ms(timing.restore),
            chunk_ms: ms(timing.chunk),
            chunk_calls: timing.chunk_calls,
            decode_ms: ms(timing.decode),
            decode_tokens: timing.decode_tokens,
            ms_per_token: if timing.decode_tokens == 0 {
                0.0
            } else {
                ms(timing.decode) / timing.decode_tokens as f64
            },
        });
    }
    Ok(DemoReport {
        backend: name,
        model: model.into(),
        open_ms: ms(open),
        prefix_tokens: prefix.len(),
        prefix_prefill_ms: ms(prefix_prefill),
        utterances,
    })
}

pub fn run(args: DemoArgs) -> Result<()> {
    let source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let (backend, open) = backends::open_kv(args.backend, &source, args.window_rule)?;
    let report = crate::with_backend!(backend, b => run_demo(b, &args.model, open, args.prefix_tokens, args.max_new)?);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &DemoReport) {
    println!("skainet-kv demo: model {} on {}", r.model, r.backend);
    println!("  open                 {:>10.3} ms", r.open_ms);
    println!(
        "  prefix prefill       {:>10.3} ms  ({} tokens, once)",
        r.prefix_prefill_ms, r.prefix_tokens
    );
    println!();
    println!(
        "  {:<3} {:>10} {:>10} {:>6} {:>10} {:>7} {:>9}  ids",
        "#", "restore ms", "chunk ms", "calls", "decode ms", "tokens", "ms/token"
    );
    for (i, u) in r.utterances.iter().enumerate() {
        println!(
            "  {:<3} {:>10.3} {:>10.3} {:>6} {:>10.3} {:>7} {:>9.3}  {}",
            i + 1,
            u.restore_ms,
            u.chunk_ms,
            u.chunk_calls,
            u.decode_ms,
            u.decode_tokens,
            u.ms_per_token,
            ids_to_string(&u.ids)
        );
    }
}
