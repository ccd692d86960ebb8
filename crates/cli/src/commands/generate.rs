//! `skainet-kv generate`: a prompt (text, chat or ids) prefilled, then greedy or sampled steps;
//! or, with `--prefix-ids`, a shared prefix prefilled and snapshotted and the prompt fed as the
//! utterance. Both go through `kv_core::KvDecoder`, the library's one decode loop; text is
//! printed as the tokens arrive.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kv_core::sampling::{SamplingConfig, DEFAULT_CANDIDATES};
use kv_core::{DecodeOptions, KvDecoder};
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::report::{ids_to_string, ms, parse_ids};
use crate::text::{PromptArgs, TextStream};

#[derive(Args)]
pub struct GenerateArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a fixture name or a model directory.
    #[arg(long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    /// Sampling needs artifacts exported with `--top-k`.
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
    /// A prefix saved by `snapshot save` (same model): loaded instead of prefilled, then the
    /// prompt is fed as the utterance, as with `--prefix-ids`.
    #[arg(long, conflicts_with = "prefix_ids")]
    prefix_snapshot: Option<std::path::PathBuf>,
    #[command(flatten)]
    prompt: PromptArgs,
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    /// Stop at this id (default: the model's stop tokens, EOS and end-of-turn; none for fixtures).
    #[arg(long)]
    eos: Option<i32>,
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// One JSON object: `{"ids": [...], "text": "...", ...}`.
    #[arg(long)]
    json: bool,
}

/// How the next token is picked: greedy (the graphs' argmax) unless `--temperature` > 0 or
/// `--repeat-penalty` != 1. Sampling looks at the best 64 logits of each call (more with a larger
/// `--top-k`); IREE backends need graphs exported with that many (`export --top-k`; on-demand
/// exports get them).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the best K candidates (0 = all 64 looked at).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of candidates whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop candidates below P times the best one's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise ids of the prompt and of the output so far (1 = off; 1.1 is common).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// The sampler's seed: the same seed, settings and prompt give the same ids (default: from
    /// the clock, reported in `--json`).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler's settings; `None` when greedy.
    pub fn config(&self) -> Result<Option<SamplingConfig>> {
        kv_core::limits::check_top_k("--top-k", self.top_k)?;
        let config = SamplingConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            seed: self.seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            }),
            candidates: self.top_k.max(DEFAULT_CANDIDATES),
        };
        config.validate()?;
        Ok((!config.is_greedy()).then_some(config))
    }
}

#[derive(Serialize)]
struct GenerateReport {
    ids: Vec<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    prompt_tokens: usize,
    stopped_at_eos: bool,
    prefill_ms: f64,
    /// `--prefix-snapshot`: the file's load, instead of a prefix prefill.
    #[serde(skip_serializing_if = "Option::is_none")]
    prefix_load_ms: Option<f64>,
    restore_ms: f64,
    chunk_ms: f64,
    chunk_calls: usize,
    decode_ms: f64,
    decode_tokens: usize,
    /// Reading candidates and sampling (0 when greedy).
    sample_ms: f64,
    /// The sampler's seed (absent when greedy).
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    kv_core::limits::check_positions("--max-new", args.max_new)?;
    let prefix: Vec<i32> = args.prefix_ids.concat();
    let prompt = args.prompt.resolve(&args.model)?;
    let sampling = args.sampling.config()?;
    let options = DecodeOptions {
        max_new: args.max_new,
        stop: prompt.stops(args.eos).into_iter().collect(),
        sampling: sampling.clone(),
    };
    let mut source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    source.top_k = sampling.as_ref().map_or(0, |c| c.candidates);
    let (backend, _) = backends::open_kv(args.backend, &source, args.window_rule)?;
    let mut stream = match (&prompt.tokenizer, args.json) {
        (Some(tokenizer), false) => Some(TextStream::new(tokenizer)),
        _ => None,
    };
    let on_token = |id: i32| {
        if let Some(s) = stream.as_mut() {
            s.push(id);
        }
    };
    let explicit = args.artifacts.as_ref().map(|d| d.display().to_string());
    let context = move || match &explicit {
        Some(dir) => format!("generating with --artifacts {dir}"),
        None => "generating".to_string(),
    };
    let (g, prefill_ms, prefix_load_ms) = crate::with_backend!(backend, b => {
        let mut decoder = KvDecoder::new(b);
        if let Some(file) = &args.prefix_snapshot {
            let (snapshot, load) = crate::commands::snapshot::load(decoder.backend(), file)?;
            let g = decoder
                .generate_with(&snapshot, &prompt.ids, &options, on_token)
                .with_context(context)?;
            (g, 0.0, Some(ms(load)))
        } else if prefix.is_empty() {
            let g = decoder.complete(&prompt.ids, &options, on_token).with_context(context)?;
            let prefill_ms = ms(g.timing.prefill);
            (g, prefill_ms, None)
        } else {
            let t = Instant::now();
            let snapshot = decoder.prefill_prefix(&prefix).context("prefilling --prefix-ids")?;
            let prefill_ms = ms(t.elapsed());
            let g = decoder
                .generate_with(&snapshot, &prompt.ids, &options, on_token)
                .with_context(context)?;
            (g, prefill_ms, None)
        }
    });
    let t = &g.timing;
    let report = GenerateReport {
        text: prompt.text(&g.ids),
        prompt_tokens: prompt.ids.len(),
        stopped_at_eos: g.stopped_at_eos,
        prefill_ms,
        prefix_load_ms,
        restore_ms: ms(t.restore),
        chunk_ms: ms(t.chunk),
        chunk_calls: t.chunk_calls,
        decode_ms: ms(t.decode),
        decode_tokens: t.decode_tokens,
        sample_ms: ms(t.sample),
        seed: sampling.map(|c| c.seed),
        ids: g.ids,
    };
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else if let Some(stream) = stream {
        stream.finish()?;
    } else {
        crate::outln!("{}", ids_to_string(&report.ids))?;
    }
    Ok(())
}
