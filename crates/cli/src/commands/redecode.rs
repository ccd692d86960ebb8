//! `skainet-kv redecode`: the fixed-length graph, re-run per token.

use anyhow::Result;
use clap::Args;
use kv_core::RedecodeDecoder;

use crate::backends::{self, BackendChoice, ModelSource};
use crate::report::{ids_to_string, parse_ids};

#[derive(Args)]
pub struct RedecodeArgs {
    #[arg(long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// The graph length SEQ (default: the manifest's `seq`).
    #[arg(long)]
    seq: Option<usize>,
    #[arg(long, value_parser = parse_ids, required = true)]
    ids: Vec<Vec<i32>>,
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    #[arg(long)]
    eos: Option<i32>,
    #[arg(long)]
    json: bool,
}

pub fn run(args: RedecodeArgs) -> Result<()> {
    let ids: Vec<i32> = args.ids.concat();
    let source = ModelSource {
        model: args.model.clone(),
        artifacts: args.artifacts.clone(),
    };
    let backend = backends::open_redecode(args.backend, &source, args.seq)?;
    let out = crate::with_redecode!(backend, b => RedecodeDecoder::new(b).generate(&ids, args.eos, args.max_new)?);
    if args.json {
        println!("{}", serde_json::json!({ "ids": out }));
    } else {
        println!("{}", ids_to_string(&out));
    }
    Ok(())
}
