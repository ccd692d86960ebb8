//! `skainet-kv export`: a model's graphs as StableHLO, compiled with the pinned `iree-compile`.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use export::{ExportOptions, Layout, Source, Target, WeightFormat};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LayoutChoice {
    /// One module and one archive shared by every function.
    Shared,
    /// Three modules and three archives with their own key numbering (the seed's layout).
    Three,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A fixture name (`tiny-gemma3:7`) or a model directory (manifest.json with `architecture` + archive).
    #[arg(long)]
    model: String,
    #[arg(long)]
    out: PathBuf,
    /// Comma-separated: `cpu`, `vulkan`.
    #[arg(long, default_value = "cpu,vulkan", value_delimiter = ',')]
    targets: Vec<String>,
    /// `--iree-llvmcpu-target-cpu` for the CPU target (`generic` travels; `x86-64-v3` is faster here).
    #[arg(long, default_value = "generic")]
    cpu: String,
    /// `--iree-vulkan-target` (default: IREE's `vp_android_baseline_2022`; e.g. `valhall` for Mali).
    #[arg(long)]
    vulkan_target: Option<String>,
    #[arg(long)]
    chunk: Option<usize>,
    #[arg(long)]
    prefill_seq: Option<usize>,
    #[arg(long)]
    redecode_seq: Option<usize>,
    #[arg(long, value_enum, default_value = "shared")]
    layout: LayoutChoice,
    /// Function-name prefix (default: `gemma` for Gemma 3, `llama` for the Llama family).
    #[arg(long)]
    prefix: Option<String>,
    /// Declare weights as bf16 instead of packed i32 pairs (CPU only: IREE 3.13 Vulkan miscompiles bf16).
    #[arg(long)]
    bf16_weights: bool,
    /// An extra `iree-compile` flag for every module (repeatable), e.g.
    /// `--compile-flag=--iree-opt-const-expr-hoisting=false`.
    #[arg(long = "compile-flag", allow_hyphen_values = true)]
    compile_flags: Vec<String>,
}

pub fn run(args: ExportArgs) -> Result<()> {
    if crate::model::resolve(&args.model).is_err() && !std::path::Path::new(&args.model).is_dir() {
        crate::model::resolve(&args.model)?;
    }
    let mut targets = Vec::new();
    for t in &args.targets {
        targets.push(match t.trim() {
            "cpu" => Target::Cpu { cpu: args.cpu.clone() },
            "vulkan" => Target::Vulkan {
                target: args.vulkan_target.clone(),
            },
            other => bail!("--targets: unknown target `{other}` (cpu, vulkan)"),
        });
    }
    if args.bf16_weights && targets.iter().any(|t| matches!(t, Target::Vulkan { .. })) {
        bail!("--bf16-weights: IREE 3.13 miscompiles bf16→f32 on Vulkan for tensors of 1024+ elements; export Vulkan with packed weights");
    }
    let options = ExportOptions {
        targets,
        chunk: args.chunk,
        prefill_seq: args.prefill_seq,
        redecode_seq: args.redecode_seq,
        layout: match args.layout {
            LayoutChoice::Shared => Layout::Shared,
            LayoutChoice::Three => Layout::Three,
        },
        prefix: args.prefix,
        vulkan_target: args.vulkan_target,
        weights: if args.bf16_weights {
            WeightFormat::Bf16
        } else {
            WeightFormat::PackedI32
        },
        ..ExportOptions::default()
    };
    let manifest = export::export_artifacts(&Source::parse(&args.model), &args.out, &options)?;
    println!("exported {} to {}", args.model, args.out.display());
    for (target, modules) in &manifest.modules {
        println!(
            "  {target}: {}",
            modules
                .iter()
                .map(|(g, f)| format!("{g}={f}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}
