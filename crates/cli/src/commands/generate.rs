//! `skainet-kv generate`: a prompt (text, chat or ids) prefilled, then greedy steps; or, with
//! `--prefix-ids`, a shared prefix prefilled and snapshotted and the prompt fed as the utterance.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kv_core::{KvBackend, KvDecoder};
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::report::{ids_to_string, ms, parse_ids};
use crate::text::PromptArgs;

#[derive(Args)]
pub struct GenerateArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a fixture name or a model directory.
    #[arg(long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// A shared prefix, prefilled once and snapshotted (`1,2,3`); the prompt is then the
    /// utterance, fed in chunk calls after a restore. Without it the prompt is prefilled.
    #[arg(long, value_parser = parse_ids)]
    prefix_ids: Vec<Vec<i32>>,
    #[command(flatten)]
    prompt: PromptArgs,
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    /// Stop at this id (default: the model's stop tokens, EOS and end-of-turn; none for fixtures).
    #[arg(long)]
    eos: Option<i32>,
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    /// One JSON object: `{"ids": [...], "text": "...", ...}`.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct GenerateReport {
    ids: Vec<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    prompt_tokens: usize,
    stopped_at_eos: bool,
    prefill_ms: f64,
    restore_ms: f64,
    chunk_ms: f64,
    chunk_calls: usize,
    decode_ms: f64,
    decode_tokens: usize,
}

/// Ids generated greedily from a prompt (prefill, chunks past SEQ, then steps), stopping before
/// any of `stops`.
pub struct Greedy {
    pub ids: Vec<i32>,
    pub stopped: bool,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub steps: usize,
}

/// Feeds a whole prompt from position 0 and returns the token predicted after it.
pub fn feed_prompt<B: KvBackend>(backend: &mut B, prompt: &[i32]) -> Result<i32> {
    let spec = backend.spec().clone();
    let (head, rest) = prompt.split_at(prompt.len().min(spec.seq));
    let mut token = backend.prefill(head).context("prefilling the prompt")?;
    for piece in rest.chunks(spec.chunk) {
        token = backend.chunk(piece)?;
    }
    Ok(token)
}

pub fn greedy<B: KvBackend>(backend: &mut B, prompt: &[i32], stops: &[i32], max_new: usize) -> Result<Greedy> {
    let t = Instant::now();
    let mut token = feed_prompt(backend, prompt)?;
    let prefill_ms = ms(t.elapsed());
    let t = Instant::now();
    let (mut ids, mut stopped, mut steps) = (Vec::new(), false, 0);
    while ids.len() < max_new {
        if stops.contains(&token) {
            stopped = true;
            break;
        }
        ids.push(token);
        if ids.len() == max_new {
            break;
        }
        token = backend.step(token)?;
        steps += 1;
    }
    Ok(Greedy {
        ids,
        stopped,
        prefill_ms,
        decode_ms: ms(t.elapsed()),
        steps,
    })
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let prefix: Vec<i32> = args.prefix_ids.concat();
    let prompt = args.prompt.resolve(&args.model)?;
    let stops = prompt.stops(args.eos);
    let source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let (backend, _) = backends::open_kv(args.backend, &source, args.window_rule)?;
    let report = crate::with_backend!(backend, b => {
        let mut b = b;
        if prefix.is_empty() {
            let g = greedy(&mut b, &prompt.ids, &stops, args.max_new)?;
            GenerateReport {
                text: prompt.text(&g.ids),
                ids: g.ids,
                prompt_tokens: prompt.ids.len(),
                stopped_at_eos: g.stopped,
                prefill_ms: g.prefill_ms,
                restore_ms: 0.0,
                chunk_ms: 0.0,
                chunk_calls: 0,
                decode_ms: g.decode_ms,
                decode_tokens: g.steps,
            }
        } else {
            let mut decoder = KvDecoder::new(b);
            let t = Instant::now();
            let snapshot = decoder.prefill_prefix(&prefix).context("prefilling --prefix-ids")?;
            let prefill_ms = ms(t.elapsed());
            let mut g = decoder.generate(&snapshot, &prompt.ids, stops.first().copied(), args.max_new)?;
            if let Some(cut) = g.ids.iter().position(|id| stops.contains(id)) {
                g.ids.truncate(cut);
                g.stopped_at_eos = true;
            }
            let t = &g.timing;
            GenerateReport {
                text: prompt.text(&g.ids),
                prompt_tokens: prompt.ids.len(),
                stopped_at_eos: g.stopped_at_eos,
                prefill_ms,
                restore_ms: ms(t.restore),
                chunk_ms: ms(t.chunk),
                chunk_calls: t.chunk_calls,
                decode_ms: ms(t.decode),
                decode_tokens: t.decode_tokens,
                ids: g.ids,
            }
        }
    });
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else if let Some(text) = &report.text {
        println!("{text}");
    } else {
        println!("{}", ids_to_string(&report.ids));
    }
    Ok(())
}
