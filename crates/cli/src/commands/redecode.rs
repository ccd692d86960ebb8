//! `skainet-kv redecode`: the fixed-length graph, re-run per token.

use anyhow::Result;
use clap::Args;
use kv_core::RedecodeDecoder;

use crate::backends::{self, BackendChoice};
use crate::report::{ids_to_string, parse_ids};

#[derive(Args)]
pub struct RedecodeArgs {
    #[arg(long)]
    model: String,
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
    let dir = crate::model::resolve(&args.model)?;
    let out = match args.backend {
        BackendChoice::Reference => {
            let backend = backends::reference_redecode(backends::open_reference(&dir)?, args.seq)?;
            RedecodeDecoder::new(backend).generate(&ids, args.eos, args.max_new)?
        }
    };
    if args.json {
        println!("{}", serde_json::json!({ "ids": out }));
    } else {
        println!("{}", ids_to_string(&out));
    }
    Ok(())
}
