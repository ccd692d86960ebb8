//! `skainet-kv inspect`: what a model directory holds.

use anyhow::Result;
use clap::Args;
use kv_core::manifest::Graph;
use kv_core::Manifest;

#[derive(Args)]
pub struct InspectArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// or a model directory.
    #[arg(short = 'm', long)]
    model: String,
    /// The manifest as JSON instead of the summary.
    #[arg(long)]
    json: bool,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let dir = crate::model::resolve(&args.model)?;
    let manifest = Manifest::load(&dir)?;
    if args.json {
        crate::outln!("{}", manifest.to_json())?;
        return Ok(());
    }
    let s = &manifest.spec;
    crate::outln!("{}", dir.display())?;
    crate::outln!(
        "  layers {} (period {}, window {}), heads {}/{} x {}, hidden {}, vocab {}",
        s.n_layers,
        s.global_layer_period,
        s.sliding_window,
        s.n_heads,
        s.n_kv_heads,
        s.head_dim,
        s.hidden_size,
        s.vocab_size
    )?;
    crate::outln!(
        "  chunk {}, seq {}, maxPositions {}, maskHeads {}",
        s.chunk,
        s.seq,
        s.max_positions,
        s.mask_heads
    )?;
    if let Some(arch) = &manifest.architecture {
        crate::outln!(
            "  architecture {:?}, ffn {}, qkNorm {}, attnBias {}",
            arch.family,
            arch.ffn_size,
            arch.qk_norm,
            arch.attn_bias
        )?;
    }
    for graph in [
        Graph::Prefill,
        Graph::Chunk,
        Graph::Step,
        Graph::Redecode,
        Graph::RedecodeAt,
    ] {
        if let Some(name) = manifest.functions.get(graph) {
            crate::outln!(
                "  {:<16} {name}  params {}",
                graph.key(),
                manifest.parameter_file(graph).unwrap_or("-")
            )?;
        }
    }
    for (target, modules) in &manifest.modules {
        crate::outln!(
            "  modules[{target}]: {}",
            modules
                .iter()
                .map(|(g, f)| format!("{g}={f}"))
                .collect::<Vec<_>>()
                .join(" ")
        )?;
    }
    Ok(())
}
