//! `skainet-kv redecode`: the fixed-length graph, re-run per token.

use anyhow::Result;
use clap::Args;
use kv_core::RedecodeDecoder;

use crate::backends::{self, BackendChoice, ModelSource, TargetArgs};
use crate::report::ids_to_string;
use crate::text::PromptArgs;

#[derive(Args)]
pub struct RedecodeArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// or a model directory.
    #[arg(short = 'm', long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// The backend that runs the redecode graph.
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// The graph length SEQ (default: the manifest's `seq`).
    #[arg(long)]
    seq: Option<usize>,
    #[command(flatten)]
    prompt: PromptArgs,
    /// Ids generated at most (fewer when a stop id comes first).
    #[arg(short = 'n', long, default_value_t = 16)]
    max_new: usize,
    /// Stop at this id (default: the model's stop tokens; none for fixtures).
    #[arg(long)]
    eos: Option<i32>,
    /// One JSON object (ids, timings) instead of the ids or text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: RedecodeArgs) -> Result<()> {
    // Before the model is opened; the reference then checks the seq against its context.
    if let Some(seq) = args.seq {
        kv_core::limits::check_positions("--seq", seq)?;
    }
    kv_core::limits::check_positions("--max-new", args.max_new)?;
    let prompt = args.prompt.resolve(&args.model)?;
    let stops = prompt.stops(args.eos);
    let source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let backend = backends::open_redecode(args.backend, &source, args.seq)?;
    let mut out = crate::with_redecode!(backend, b => RedecodeDecoder::new(b).generate(&prompt.ids, stops.first().copied(), args.max_new)?);
    if let Some(cut) = out.iter().position(|id| stops.contains(id)) {
        out.truncate(cut);
    }
    let text = prompt.text(&out);
    if args.json {
        crate::outln!("{}", serde_json::json!({ "ids": out, "text": text }))?;
    } else if let Some(text) = text {
        crate::outln!("{text}")?;
    } else {
        crate::outln!("{}", ids_to_string(&out))?;
    }
    Ok(())
}
