//! `skainet-kv export`: a model's graphs as StableHLO, compiled with the pinned `iree-compile`.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use export::{ExportOptions, Layout, Source, Target, WeightFormat};

use crate::model::WeightsChoice;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LayoutChoice {
    /// One module and one archive shared by every function.
    Shared,
    /// Three modules and three archives with their own key numbering (the seed's layout).
    Three,
}

/// `--weight-storage`: how the graphs declare the weights' bf16 tensors (the matrices of a bf16
/// model; the norms and other unquantized tensors of a q8/q4 one).
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum StorageChoice {
    /// `packed` for bf16 weights (runs on every target); for `--weights q8|q4` `bf16` where every
    /// target is the CPU, `packed` otherwise.
    Auto,
    /// `bf16` tensors (CPU only: IREE 3.13 miscompiles bf16 on Vulkan).
    Bf16,
    /// Pairs of bf16 in `i32` words.
    Packed,
    /// The bf16 bits as `i16`, widened elementwise (fused into the decode step's matmuls: the
    /// fast form on GPUs with 16-bit storage; Vulkan needs `--vulkan-target`).
    I16,
}

/// The `--help` heading of the flags that tune what is exported (sizes, layout, graph forms).
const TUNING: &str = "Export tuning";

#[derive(Args)]
pub struct ExportArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// (`tiny-gemma3:7`) or a model directory (manifest.json with `architecture` + archive).
    #[arg(short = 'm', long)]
    model: String,
    /// The directory the artifacts are written to (manifest, modules, weights, files.json).
    #[arg(long)]
    out: PathBuf,
    /// Comma-separated: `cpu`, `vulkan`.
    #[arg(long, default_value = "cpu,vulkan", value_delimiter = ',')]
    targets: Vec<String>,
    /// Presets for an app, comma-separated, at most one CPU and one Vulkan: `android-arm64`
    /// (Armv8.2-A with dot product and fp16), `android-arm64-v9` (also i8mm and bf16),
    /// `vulkan-portable`, `vulkan-portable-16bit`, `vulkan-valhall` (Mali), `vulkan-adreno`
    /// (docs/android.md). They set
    /// the targets, CPU triple and features and Vulkan target, and leave in `--out` only what
    /// an app ships (`files.json` lists it); `--targets`, `--cpu` and `--vulkan-target` then
    /// cannot be given.
    #[arg(long = "target", value_delimiter = ',', conflicts_with_all = ["targets", "cpu", "vulkan_target"])]
    presets: Vec<String>,
    #[command(flatten)]
    target: crate::flags::TargetFlags,
    /// Ids per call of the chunk graph (default: the model's manifest).
    #[arg(help_heading = TUNING, long)]
    chunk: Option<usize>,
    /// Rows of the prefill graph: SEQ under contract 1 (default: the model's), under contract 2
    /// the rows of its prefill graph, a chunk graph over the caches (default 128, at most the
    /// sliding ring; none when not above `--chunk`).
    #[arg(help_heading = TUNING, long)]
    prefill_seq: Option<usize>,
    /// SEQ of the redecode graph (default: the prefill's).
    #[arg(help_heading = TUNING, long)]
    redecode_seq: Option<usize>,
    /// The graphs' modules: one module and archive for every function, or the seed's three.
    #[arg(help_heading = TUNING, long, value_enum, default_value = "shared")]
    layout: LayoutChoice,
    /// Function-name prefix (default: `gemma` for Gemma 3, `llama` for the Llama family).
    #[arg(help_heading = TUNING, long)]
    prefix: Option<String>,
    /// How the graphs declare the weights' bf16 tensors: `bf16` (CPU only), `packed` (pairs in
    /// i32 words, runs everywhere), `i16` (widened inside the decode step's matmuls: the fast
    /// form on GPUs with 16-bit storage; Vulkan needs `--vulkan-target`), or `auto` (the
    /// default): `packed` for bf16 weights, and for `--weights q8|q4` `bf16` where every target
    /// is the CPU, `packed` otherwise.
    #[arg(help_heading = TUNING, long, value_enum)]
    weight_storage: Option<StorageChoice>,
    /// An extra `iree-compile` flag for every module (repeatable), after those the weight format
    /// needs (packed weights: `--iree-opt-const-expr-hoisting=false`).
    #[arg(help_heading = TUNING, long = "compile-flag", allow_hyphen_values = true)]
    compile_flags: Vec<String>,
    /// Also return the best K logits of the last position and their ids from the prefill, chunk
    /// and step graphs (`topk.logits`, `topk.ids`), which sampling needs (`generate
    /// --temperature`, whose own `--top-k` must not exceed K); 0 = none. Off by default: a
    /// reduction over the vocabulary per call. (`--top-k` is the old spelling, kept as an alias.)
    #[arg(help_heading = TUNING, long = "top-k-outputs", alias = "top-k", default_value_t = 0)]
    top_k: usize,
    /// Contract 2: rows a sliding layer's ring cache holds beyond its window, i.e. how far a
    /// session may write past a snapshot before it copies the ring (default 128, the ring then
    /// rounded up to 64 rows; a slack reaching maxPositions keeps a linear cache).
    #[arg(help_heading = TUNING, long)]
    ring_slack: Option<usize>,
    /// Contract 2: the spans (cache rows read) of the prefill graph's token-less variants, which
    /// a long prefill's calls before its last run: comma-separated, or `none`. Default: twice
    /// the prefill graph's rows, doubling, below its own span (`seq` rounded up), at most two.
    #[arg(help_heading = TUNING, long, value_parser = parse_spans)]
    prefill_spans: Option<Spans>,
    /// Contract 2: rows of the small chunk graph beside the chunk graph, which runs the pieces
    /// of a feed of at most that many ids (a short prompt, an utterance's tail, grammar-forced
    /// ids) at a fraction of a chunk call's cost. Default 8 where the chunk has more rows; 0 =
    /// none.
    #[arg(help_heading = TUNING, long)]
    small_chunk: Option<usize>,
    /// How the archive stores each layer's Q/K/V projections: `fused`, one matrix (one product
    /// in the graphs: fewer GPU dispatches; the manifest says `fusedProjections`), or `apart`,
    /// the source's three.
    #[arg(help_heading = TUNING, long, value_enum, default_value = "fused")]
    projections: ProjectionsChoice,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ProjectionsChoice {
    Fused,
    Apart,
}

pub fn run(args: ExportArgs) -> Result<()> {
    check_sizes(&args)?;
    let weights = args.target.weights();
    if args.target.weights.is_some() && weights == WeightsChoice::Bf16 && args.weight_storage.is_none() {
        // Before `--weights` named the format, `export --weights bf16` declared bf16 tensors;
        // `auto` now declares bf16 weights packed, so the old spelling is refused, not reread.
        bail!(
            "--weights bf16: --weights is the weight format now (bf16 is the default); how export declares \
             bf16 weights in the graphs is --weight-storage: `--weight-storage bf16` for what `--weights bf16` \
             meant before, `packed` or `auto` for the default"
        );
    }
    if crate::model::resolve(&args.model).is_err() && !std::path::Path::new(&args.model).is_dir() {
        crate::model::resolve(&args.model)?;
    }
    let presets = args
        .presets
        .iter()
        .map(|name| export::presets::preset(name.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    // `--vulkan-target portable-sg16,portable-sg64`: a module a subgroup size, one text and one
    // archive (only those targets share a text); a session opens its device's.
    let vulkan_targets = args.target.export_vulkan_targets()?;
    let mut targets = Vec::new();
    for t in &args.targets {
        match t.trim() {
            "cpu" => targets.push(Target::Cpu {
                cpu: args.target.cpu.as_ref().map_or("generic", |c| c.name()).into(),
            }),
            "vulkan" => targets.extend(
                vulkan_targets
                    .iter()
                    .map(|target| Target::Vulkan { target: target.clone() }),
            ),
            other => bail!("--targets: unknown target `{other}` (cpu, vulkan)"),
        }
    }
    // The presets in place of --targets/--cpu/--vulkan-target (clap refuses those beside them),
    // their flags before the --compile-flag ones.
    let mut vulkan_target = match &vulkan_targets[..] {
        [one] => one.clone(),
        _ => None,
    };
    let mut compile_flags = args.compile_flags.clone();
    if !presets.is_empty() {
        let mut chosen = ExportOptions::default();
        export::presets::apply(&presets, &mut chosen)?;
        targets = chosen.targets;
        vulkan_target = chosen.vulkan_target;
        compile_flags = chosen.compile_flags.into_iter().chain(compile_flags).collect();
    }
    let source = match weights {
        WeightsChoice::Q8 | WeightsChoice::Q4 => Source::Dir(crate::model::resolve_with(&args.model, weights)?),
        // A real model's name is the store's (installed and imported as bf16 on first use), not
        // a fixture's FAMILY:SEED.
        WeightsChoice::Bf16 if crate::model::is_real_model(&args.model) => {
            Source::Dir(crate::model::resolve(&args.model)?)
        }
        WeightsChoice::Bf16 => Source::parse(&args.model),
    };
    let cpu_only = targets.iter().all(|t| matches!(t, Target::Cpu { .. }));
    let contract = crate::flags::export_contract(args.target.contract, &targets);
    let storage = match (args.weight_storage.unwrap_or(StorageChoice::Auto), weights) {
        (StorageChoice::Bf16, _) => WeightFormat::Bf16,
        (StorageChoice::Packed, _) => WeightFormat::PackedI32,
        (StorageChoice::I16, _) => WeightFormat::I16,
        // `portable-sgN` modules are made for i16 weights (their configured products read them).
        (StorageChoice::Auto, WeightsChoice::Bf16)
            if targets.iter().any(|t| {
                matches!(t, Target::Vulkan { target: Some(name) }
                    if export::profile::portable_subgroup_size(name).is_some())
            }) =>
        {
            WeightFormat::I16
        }
        (StorageChoice::Auto, WeightsChoice::Bf16) => WeightFormat::PackedI32,
        (StorageChoice::Auto, WeightsChoice::Q8 | WeightsChoice::Q4) if cpu_only => WeightFormat::Bf16,
        (StorageChoice::Auto, WeightsChoice::Q8 | WeightsChoice::Q4) => WeightFormat::PackedI32,
    };
    let (matmul_input, cache_type) = crate::flags::export_rounding(&args.target, &targets, contract, storage);
    // The rules of valid combinations (bf16 or q4 on Vulkan, i16 on the portable target, bf16
    // matmul inputs, f16 caches, prefill spans) are the library's (`export::OptionsError`),
    // checked before anything is emitted; this command only parses.
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
        vulkan_target,
        weights: storage,
        compile_flags,
        top_k: args.top_k,
        contract,
        ring_slack: args.ring_slack,
        prefill_spans: args.prefill_spans.map(|s| s.0),
        small_chunk: args.small_chunk,
        matmul_input,
        cache_type,
        fuse_projections: args.projections == ProjectionsChoice::Fused,
        ..ExportOptions::default()
    };
    let manifest = export::export_artifacts(&source, &args.out, &options).map_err(|e| match e {
        export::ExportError::Options(rule) => anyhow::anyhow!("{}: {rule}", flags_of(&rule)),
        other => other.into(),
    })?;
    if crate::model::is_real_model(&args.model) {
        write_tokenizer(&args.model, &args.out)?;
    }
    let files = export::bundle::finish(&args.out, !presets.is_empty())?;
    crate::outln!("exported {} to {}", args.model, args.out.display())?;
    for (target, modules) in &manifest.modules {
        crate::outln!(
            "  {target}: {}",
            modules
                .iter()
                .map(|(g, f)| format!("{g}={f}"))
                .collect::<Vec<_>>()
                .join(" ")
        )?;
    }
    let bytes: u64 = files.files.values().sum();
    crate::outln!(
        "  files.json: {} files, {bytes} bytes (with files.json and digests.json: what an app ships)",
        files.files.len()
    )?;
    Ok(())
}

/// The flags a refused combination of export options comes from, as this command spells them.
pub(crate) fn flags_of(rule: &export::OptionsError) -> &'static str {
    use export::OptionsError as E;
    match rule {
        E::Bf16OnVulkan => "--weight-storage bf16 with a Vulkan target",
        E::I16OnPortableVulkan => "--weight-storage i16 for Vulkan needs --vulkan-target",
        E::Q4OnNamedVulkan(_) => "--weights q4 with --vulkan-target",
        E::Bf16MatmulInputs => {
            "--matmul-input bf16 needs CPU targets only and weights declared bf16 (export --weight-storage bf16)"
        }
        E::PrefillSpansNeedContract2 => "--prefill-spans needs --contract 2",
        E::F16Caches => "--cache-type f16 needs --contract 2 and CPU targets only",
    }
}

/// The model's tokenizer and chat template as `out/tokenizer.gguf`: every `tokenizer.*` key of
/// its GGUF (and `general.architecture`/`general.name`), no tensors; read back with the
/// runtime's tokenizer, which must see the same vocabulary, stop tokens and template.
fn write_tokenizer(model: &str, out: &std::path::Path) -> Result<()> {
    use anyhow::Context;
    let file = crate::model::gguf_file(model)?;
    let mut writer = gguf::GgufWriter::new();
    for (key, value) in file.metadata() {
        if key.starts_with("tokenizer.") || key == "general.architecture" || key == "general.name" {
            writer.kv(key.clone(), value.clone());
        }
    }
    let path = out.join(kv_core::digests::TOKENIZER_FILE);
    std::fs::write(&path, writer.to_bytes()).with_context(|| format!("writing {}", path.display()))?;
    let source = tokenizer::Tokenizer::from_gguf(&file).with_context(|| format!("reading {model}'s tokenizer"))?;
    let copy = gguf::GgufFile::open(&path)
        .map_err(anyhow::Error::from)
        .and_then(|f| tokenizer::Tokenizer::from_gguf(&f).map_err(anyhow::Error::from))
        .with_context(|| format!("reading back {}", path.display()))?;
    if copy.vocab_size() != source.vocab_size()
        || copy.stop_tokens() != source.stop_tokens()
        || copy.chat_template().is_some() != source.chat_template().is_some()
    {
        bail!("{}: the copied tokenizer differs from {model}'s", path.display());
    }
    Ok(())
}

/// The flags' sizes within `kv_core::limits`, named by flag, before the model is read;
/// `export::export_artifacts` then checks them against the model (`chunk` within
/// `maxPositions`, ...) before anything is compiled.
fn check_sizes(args: &ExportArgs) -> Result<()> {
    use kv_core::limits::check_positions;
    for (flag, value) in [
        ("--chunk", args.chunk),
        ("--prefill-seq", args.prefill_seq),
        ("--redecode-seq", args.redecode_seq),
        ("--ring-slack", args.ring_slack),
        ("--small-chunk", args.small_chunk),
    ] {
        if let Some(value) = value {
            check_positions(flag, value)?;
        }
    }
    check_positions("--prefill-spans", args.prefill_spans.as_ref().map_or(0, |s| s.0.len()))?;
    for &span in args.prefill_spans.iter().flat_map(|s| &s.0) {
        check_positions("--prefill-spans", span)?;
    }
    kv_core::limits::check_top_k("--top-k-outputs", args.top_k)?;
    Ok(())
}

/// `--prefill-spans`: a list of row counts, or `none`.
#[derive(Clone, Debug)]
struct Spans(Vec<usize>);

fn parse_spans(text: &str) -> Result<Spans, String> {
    if text == "none" {
        return Ok(Spans(Vec::new()));
    }
    text.split(',')
        .map(|s| s.trim().parse::<usize>().map_err(|e| format!("`{s}`: {e}")))
        .collect::<Result<_, _>>()
        .map(Spans)
}
