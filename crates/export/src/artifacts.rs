//! `export_artifacts`: source model (a directory or a fixture name) → `.mlir`, `.irpa`, `.vmfb`
//! per target and `manifest.json`.
//!
//! Layouts (CONTRACT §2, last point):
//! - [`Layout::Shared`]: one module `PREFIX.mlir` with every function, one archive `model.irpa`
//!   with the canonical names, one `.vmfb` per target.
//! - [`Layout::Three`]: the seed's layout. The prefill, chunk and step graphs each get their own
//!   module and their own archive whose keys are `p0..pN` in an order of that graph's own
//!   (`PREFIX-prefill.irpa`, ...); `parameters` maps each graph key to its file and
//!   `embeddingParameter` is the embedding's key **in the withPast archive**. The redecode graphs
//!   (if exported) live in `PREFIX-redecode.mlir` over `weights.irpa`, which keeps the canonical
//!   names and is also `parameters.weights` (what `backend-reference` reads). The key maps are
//!   in `provenance.parameterKeys` (JSON: graph key → archive key → canonical name).
//!
//! Compile flags ([`ExportOptions::compile_flags`] for every module, then
//! [`ExportOptions::graph_flags`] per graph) are one `iree-compile` run per module, so graphs of one
//! module need the same flags: graphs whose flags differ get modules of their own (in the shared
//! layout `PREFIX-GRAPH.mlir` per group of graphs with equal flags, all over the one
//! `model.irpa`; in the three layout the redecode pair is split the same way). The flags each
//! graph was compiled with are recorded in `provenance.compileFlags` (when every graph has the
//! same) and `provenance.graphCompileFlags` (JSON: graph key → flags, when any graph has its own).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kv_core::irpa::{IrpaArchive, IrpaWriter};
use kv_core::manifest::{CacheType, Functions, MatmulInput, Parameters, CONTRACT_V2, CONTRACT_VERSION};
use kv_core::params::{parameter_table, ParamInfo, TOKEN_EMBD};
use kv_core::quant::{QuantFormat, ScaleType};
use kv_core::{Graph, Manifest};

use crate::compile::{compile_with, Target, COMPILER_VERSION};
use crate::emit::{emit_module, EmitOptions, RowProducts, WeightFormat};
use crate::encode::{compile_encoded, wants_encoding};
use crate::{ExportError, Result};

/// Where the model comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A directory with `manifest.json` (with `architecture`) and its canonically named bf16 archive.
    Dir(PathBuf),
    /// A fixture name (`tiny-gemma3:7`), materialized through `fixtures::materialize`: only with
    /// the `fixtures` feature (the CLI and the test crates enable it), so that an exporter built
    /// without it carries no test models.
    Fixture(String),
}

impl Source {
    /// An existing directory, else a fixture name.
    pub fn parse(s: &str) -> Self {
        if Path::new(s).is_dir() {
            Source::Dir(s.into())
        } else {
            Source::Fixture(s.into())
        }
    }

    /// The model directory: the given one, or the fixture written into the fixture cache.
    pub fn dir(&self) -> Result<PathBuf> {
        match self {
            Source::Dir(d) => Ok(d.clone()),
            #[cfg(feature = "fixtures")]
            Source::Fixture(name) => Ok(fixtures::materialize(name)?),
            #[cfg(not(feature = "fixtures"))]
            Source::Fixture(name) => Err(ExportError::FixturesDisabled { name: name.clone() }),
        }
    }

    fn describe(&self) -> String {
        match self {
            Source::Dir(d) => d.display().to_string(),
            Source::Fixture(name) => name.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// One module and one archive for every graph.
    #[default]
    Shared,
    /// Three modules and three archives with their own key numbering (the seed's layout).
    Three,
}

#[derive(Clone, Debug)]
pub struct ExportOptions {
    pub targets: Vec<Target>,
    /// `C` of the chunk graph; `None` = the source's.
    pub chunk: Option<usize>,
    /// `SEQ` of the prefill graph; `None` = the source's. Contract 2: the rows of its prefill
    /// graph (`prefillChunk`); `None` = 128.
    pub prefill_seq: Option<usize>,
    /// `SEQ` of the redecode graphs; `None` = the prefill's.
    pub redecode_seq: Option<usize>,
    pub layout: Layout,
    /// Function-name prefix; `None` = the family's (`gemma`, `llama`).
    pub prefix: Option<String>,
    /// `--iree-vulkan-target` for Vulkan targets that name none.
    pub vulkan_target: Option<String>,
    pub weights: WeightFormat,
    /// The graphs to export (default: all five).
    pub graphs: Vec<Graph>,
    /// Extra `iree-compile` flags for every module, after [`weight_compile_flags`] (both recorded
    /// in the provenance).
    pub compile_flags: Vec<String>,
    /// Extra `iree-compile` flags of single graphs, after [`Self::compile_flags`]; graphs whose
    /// flags differ are compiled as separate modules (see the module docs).
    pub graph_flags: BTreeMap<Graph, Vec<String>>,
    /// The prefill, chunk and step graphs also return the best `top_k` logits of the last
    /// position and their ids (`topk.logits`, `topk.ids`), for sampling; 0 = they do not (the
    /// default: a reduction over the vocabulary per call is slow on some GPUs).
    pub top_k: usize,
    /// The graph contract: 1 (`shared/CONTRACT.md`, the default) or 2 (`docs/contract-v2.md`:
    /// static-shape chunk and step graphs over caches the runtime owns). Contract 2's prefill
    /// graph is a chunk graph of `prefillChunk` rows ([`Self::prefill_seq`] or 128, at most the
    /// sliding ring; none when that is not above the chunk); the redecode graphs are v1's.
    pub contract: u32,
    /// Contract 2: rows a sliding layer's ring holds beyond its window (`KvSpec::ring_rows`):
    /// how far a session may write past a snapshot before a write copies the ring. `None`: the
    /// default ([`kv_core::spec::DEFAULT_RING_SLACK`], rounded up to 64 rows); a slack that
    /// leaves the ring no smaller than `maxPositions`: a linear cache.
    pub ring_slack: Option<usize>,
    /// Contract 2: the spans of the prefill graph's token-less variants (`KvSpec::prefill_spans`);
    /// `None`: [`KvSpec::default_prefill_spans`]. The prefill graph's own span is always the
    /// default (`seq` rounded up to `prefillChunk`).
    pub prefill_spans: Option<Vec<usize>>,
    /// What the projections multiply ([`MatmulInput`]): `Bf16` rounds each projection's input to
    /// bf16 for bf16 × bf16 → f32 matmuls. Takes effect with [`WeightFormat::Bf16`] and weights
    /// that are not block-quantized, and is then recorded in the manifest (`matmulInput`);
    /// otherwise the graphs stay f32 and the manifest says so.
    pub matmul_input: MatmulInput,
    /// Contract 2: the element type of the KV caches ([`CacheType`]). `F16` takes effect for
    /// exports whose targets are all CPUs (the portable Vulkan target has no 16-bit storage) and
    /// is then recorded in the manifest (`cacheType`); otherwise the caches stay f32.
    pub cache_type: CacheType,
    /// Store each layer's Q/K/V projections, and its gate/up pair, as one matrix in the archive
    /// (`kv_core::params::FUSED_PROJECTIONS`, recorded as the manifest's `fusedProjections`), so
    /// that each group is one product in the graphs; `false`: the source's matrices as they are.
    pub fuse_projections: bool,
}

/// The `iree-compile` flags that the weight format needs.
///
/// Packed-i32 weights turn constant-expression hoisting off: with it IREE evaluates the unpacking
/// (i32 → two bf16 → f32) once at load and keeps an f32 copy of every weight per function, which
/// for FunctionGemma's geometry is one 5.36 GB initializer allocation: above every Vulkan
/// driver's single-allocation limit here (NVIDIA 4 GB, lavapipe 2 GB: the module does not open),
/// and 7.3 GB RSS on the CPU. bf16 weights keep hoisting on: what it hoists then is the CPU's
/// relayout of each bf16 weight into its matmul tiles, done once instead of on every call
/// (`gemma3-270m-shape:1`, x86-64-v3, 2 cores: decode 126 ms/token with hoisting, 403 without;
/// RSS 1.39 GB and 1.13 GB).
pub fn weight_compile_flags(weights: WeightFormat) -> &'static [&'static str] {
    match weights {
        WeightFormat::PackedI32 | WeightFormat::I16 => &["--iree-opt-const-expr-hoisting=false"],
        WeightFormat::Bf16 => &[],
    }
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            targets: vec![Target::cpu(), Target::vulkan()],
            chunk: None,
            prefill_seq: None,
            redecode_seq: None,
            layout: Layout::Shared,
            prefix: None,
            vulkan_target: None,
            weights: WeightFormat::PackedI32,
            graphs: vec![
                Graph::Prefill,
                Graph::Chunk,
                Graph::Step,
                Graph::Redecode,
                Graph::RedecodeAt,
            ],
            compile_flags: Vec::new(),
            graph_flags: BTreeMap::new(),
            top_k: 0,
            contract: kv_core::manifest::CONTRACT_VERSION,
            ring_slack: None,
            prefill_spans: None,
            matmul_input: MatmulInput::F32,
            cache_type: CacheType::F32,
            fuse_projections: true,
        }
    }
}

impl ExportOptions {
    /// Every `iree-compile` flag of `graph`'s module: the weight format's, then
    /// [`Self::compile_flags`], then `graph`'s own.
    pub fn flags_of(&self, graph: Graph) -> Vec<String> {
        self.flags_for(graph, false)
    }

    /// [`Self::flags_of`] for a source whose archive is block-quantized (`quantized`), which
    /// also turns constant-expression hoisting off ([`QUANTIZED_COMPILE_FLAGS`]).
    pub fn flags_for(&self, graph: Graph, quantized: bool) -> Vec<String> {
        let mut flags: Vec<String> = weight_compile_flags(self.weights)
            .iter()
            .map(|f| f.to_string())
            .collect();
        if quantized {
            for f in QUANTIZED_COMPILE_FLAGS {
                if !flags.iter().any(|g| g == f) {
                    flags.push(f.to_string());
                }
            }
        }
        flags
            .into_iter()
            .chain(self.compile_flags.iter().cloned())
            .chain(self.graph_flags.get(&graph).into_iter().flatten().cloned())
            .collect()
    }
}

/// The `iree-compile` flags of modules over block-quantized weights: constant-expression hoisting
/// off. With it IREE 3.13 evaluates the many-row graphs' dequantization of every weight (not
/// fused into the matmul where aggressive fusion is off, v1's CPU flags) once at load and keeps
/// the f32 result: Gemma 3 270M q8 compiled to 182 initializers, each storing a dequantized
/// weight, i.e. an f32 copy of the model beside the archive.
pub const QUANTIZED_COMPILE_FLAGS: &[&str] = &["--iree-opt-const-expr-hoisting=false"];

/// Whether `iree-compile` with `flags` fuses aggressively (on from `--iree-opt-level=O2`, unless
/// turned off), which fusing a dequantization into a many-row matmul needs.
fn aggressive_fusion(flags: &[String]) -> bool {
    let level = flags
        .iter()
        .rev()
        .find_map(|f| f.strip_prefix("--iree-opt-level=O"))
        .and_then(|l| l.parse::<u32>().ok())
        .unwrap_or(0);
    let off = flags
        .iter()
        .rev()
        .find_map(|f| f.strip_prefix("--iree-dispatch-creation-enable-aggressive-fusion="))
        .is_some_and(|v| v == "false");
    level >= 2 && !off
}

/// `graphs` in groups of equal [`ExportOptions::flags_of`], in first-appearance order.
fn flag_groups(graphs: &[Graph], options: &ExportOptions, quantized: bool) -> Vec<(Vec<Graph>, Vec<String>)> {
    let mut groups: Vec<(Vec<Graph>, Vec<String>)> = Vec::new();
    for &g in graphs {
        let flags = options.flags_for(g, quantized);
        match groups.iter_mut().find(|(_, f)| *f == flags) {
            Some((gs, _)) => gs.push(g),
            None => groups.push((vec![g], flags)),
        }
    }
    groups
}

/// One module to write and compile.
struct ModulePlan {
    stem: String,
    graphs: Vec<Graph>,
    /// Every `iree-compile` flag of this module.
    flags: Vec<String>,
    archive: String,
    /// canonical name → archive key (`None` = identity).
    keys: Option<BTreeMap<String, String>>,
}

/// Writes the artifacts of `source` into `out_dir` and returns the manifest written there.
pub fn export_artifacts(source: &Source, out_dir: &Path, options: &ExportOptions) -> Result<Manifest> {
    if options.contract != CONTRACT_VERSION && options.contract != CONTRACT_V2 {
        return Err(ExportError::Unsupported(format!(
            "contract {}: the exporter writes contracts {CONTRACT_VERSION} and {CONTRACT_V2}",
            options.contract
        )));
    }
    let v2 = options.contract == CONTRACT_V2;
    let mut graphs = options.graphs.clone();
    let src_dir = source.dir()?;
    let src = Manifest::load(&src_dir)?;
    let arch = src.require_architecture()?.clone();
    let weights_name = src
        .weights_file()
        .ok_or_else(|| kv_core::Error::manifest("parameters", "the source manifest names no weights archive"))?;
    let archive = IrpaArchive::open(src_dir.join(weights_name)).map_err(kv_core::Error::from)?;

    let mut m = src.clone();
    if let Some(c) = options.chunk {
        m.spec.chunk = c;
    }
    // v2's prefill graph is a chunk graph (`prefillChunk` rows); its `seq` only bounds prompts.
    if let (Some(s), false) = (options.prefill_seq, v2) {
        m.spec.seq = s;
    }
    let prefix = options
        .prefix
        .clone()
        .unwrap_or_else(|| arch.family.default_prefix().to_string());
    // v2's sliding layers keep a ring of rows, not `maxPositions` (`docs/contract-v2.md`).
    m.spec.sliding_cache_rows = if v2 { m.spec.ring_rows(options.ring_slack) } else { 0 };
    m.spec.prefill_chunk = if v2 && graphs.contains(&Graph::Prefill) {
        m.spec.prefill_chunk_rows(options.prefill_seq)
    } else {
        0
    };
    if v2 && m.spec.prefill_chunk == 0 {
        graphs.retain(|&g| g != Graph::Prefill);
    }
    // A prefill's calls read only the rows they can see (`KvSpec::prefill_span`).
    let (span, spans) = m.spec.default_prefill_spans();
    m.spec.prefill_span = span;
    m.spec.prefill_spans = options.prefill_spans.clone().unwrap_or(spans);
    if m.spec.prefill_chunk == 0 {
        m.spec.prefill_spans.clear();
    }
    if v2 {
        // v2's argument lists are its own (the source's, if reordered, are v1 lists): canonical
        // ones, with what the source says beyond the graphs kept.
        let mut fresh = Manifest::new(m.spec.clone(), Some(arch.clone()), &prefix).into_v2();
        fresh.parameter_scope = m.parameter_scope.clone();
        fresh.provenance = m.provenance.clone();
        fresh.quantization = m.quantization.clone();
        m = fresh;
    }
    m.set_top_k((options.top_k > 0).then_some(options.top_k));
    // Every v2 export takes the allowed-token mask: a session without a grammar passes one
    // resident all-ones buffer (no upload per call); the unpacking costs the argmax ~0.3 ms
    // over Gemma 3's vocabulary on the CPU (`Body::allowed_logits`), within a step's noise.
    m.set_allowed_mask(v2);
    m.matmul_input = if options.weights == WeightFormat::Bf16 && m.quantization.is_none() {
        options.matmul_input
    } else {
        MatmulInput::F32
    };
    let cpu_only = options.targets.iter().all(|t| matches!(t, Target::Cpu { .. }));
    m.cache_type = if v2 && cpu_only {
        options.cache_type
    } else {
        CacheType::F32
    };
    if !v2 {
        m.functions = Functions::with_prefix(&prefix);
    }
    // Greedy decoding on an async device feeds each step's token to the next on the device
    // (`Manifest::embed_function`): exports for Vulkan whose LM head is the embedding table,
    // so the function costs no second copy of the table on the device.
    let async_target = options.targets.iter().any(|t| matches!(t, Target::Vulkan { .. }));
    m.embed_function = (async_target && arch.tied_output && graphs.contains(&Graph::Step))
        .then(|| format!("module.{prefix}_embed_token"));
    m.modules.clear();
    m.encoded_parameters.clear();
    // The options' sizes, now in the manifest, are checked against `kv_core::limits` here
    // (`chunk` beyond `maxPositions` was accepted, and a session then asked for 40 GB).
    m.validate()?;
    if let Some(seq) = options.redecode_seq {
        kv_core::limits::check_redecode_seq("export option redecode_seq", &m.spec, seq)?;
    }

    let table = parameter_table(&m.spec, &arch);
    let mut quantization = src.quantization.clone();
    let quantized = quantization.is_some();
    // The source's scale type, and the export's: the Vulkan weight formats give the SPIR-V code
    // generator no 16-bit type, so their archives hold the f16 scales widened to f32 (exactly).
    let (from, to) = match quantization.as_mut() {
        Some(q) => {
            let from = q.scale_type;
            if options.weights != WeightFormat::Bf16 {
                q.scale_type = ScaleType::F32;
            }
            (from, q.scale_type)
        }
        None => (ScaleType::default(), ScaleType::default()),
    };
    let mut data: BTreeMap<String, Cow<[u8]>> = BTreeMap::new();
    // Scales of the quantized parameters, by the parameter's canonical name.
    let mut scales: BTreeMap<String, Cow<[u8]>> = BTreeMap::new();
    for p in &table {
        if let Some(format) = quantization.as_ref().and_then(|q| q.format_of(&p.name)) {
            let (values, s) = kv_core::quant::entries(&archive, &p.name)?;
            kv_core::quant::check_sizes(format, from, &p.name, p.numel(), values.len(), s.len())?;
            data.insert(p.name.clone(), Cow::Borrowed(values));
            let s = if from == to {
                Cow::Borrowed(s)
            } else {
                Cow::Owned(kv_core::quant::scales_to_bytes(
                    &kv_core::quant::scales_from_bytes(s, from),
                    to,
                ))
            };
            scales.insert(p.name.clone(), s);
            continue;
        }
        let bytes = archive
            .data(&p.name)
            .map_err(|e| kv_core::Error::parameter(&p.name, e.to_string()))?;
        if bytes.len() != p.numel() * 2 {
            return Err(kv_core::Error::parameter(
                &p.name,
                format!("{} bytes, expected {} (bf16 {:?})", bytes.len(), p.numel() * 2, p.shape),
            )
            .into());
        }
        data.insert(p.name.clone(), Cow::Borrowed(bytes));
    }
    // Each fused parameter's rows are its parts' one after the other: the values' and the
    // scales' bytes alike (both row-major over the output rows).
    let (table, fused) = if options.fuse_projections {
        kv_core::params::fuse_projections(&table, m.spec.n_layers, quantization.as_ref())
    } else {
        (table, Vec::new())
    };
    for f in &fused {
        let join = |map: &mut BTreeMap<String, Cow<[u8]>>| -> Option<Cow<'static, [u8]>> {
            let parts: Vec<Cow<[u8]>> = f.parts.iter().map(|p| map.remove(&p.name)).collect::<Option<_>>()?;
            Some(Cow::Owned(parts.concat()))
        };
        let values = join(&mut data).unwrap_or_else(|| kv_core::error::invariant("every part was read above"));
        data.insert(f.name.clone(), values);
        if let Some(s) = join(&mut scales) {
            scales.insert(f.name.clone(), s);
        }
    }
    if let Some(q) = quantization.as_mut() {
        q.fuse(&fused);
    }
    m.quantization = quantization.clone();
    m.fused_projections = !fused.is_empty();

    std::fs::create_dir_all(out_dir).map_err(ExportError::io("creating", out_dir))?;
    let kv: Vec<Graph> = graphs.iter().copied().filter(|g| Graph::KV.contains(g)).collect();
    let redecode: Vec<Graph> = graphs.iter().copied().filter(|g| !Graph::KV.contains(g)).collect();
    let mut plans = Vec::new();
    let mut key_maps: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    match options.layout {
        Layout::Shared => {
            let groups = flag_groups(&graphs, options, quantized);
            let split = groups.len() > 1;
            for (graphs, flags) in groups {
                plans.push(ModulePlan {
                    stem: if split {
                        format!("{prefix}-{}", graphs[0].key())
                    } else {
                        prefix.clone()
                    },
                    graphs,
                    flags,
                    archive: "model.irpa".into(),
                    keys: None,
                });
            }
            m.parameters = Some(Parameters::Shared("model.irpa".into()));
            m.embedding_parameter = Some(TOKEN_EMBD.into());
        }
        Layout::Three => {
            let mut files = BTreeMap::new();
            for (i, &g) in kv.iter().enumerate() {
                let keys = numbered_keys(&table, i);
                key_maps.insert(
                    g.key().into(),
                    keys.iter().map(|(c, k)| (k.clone(), c.clone())).collect(),
                );
                let archive = format!("{prefix}-{}.irpa", g.key());
                files.insert(g.key().to_string(), archive.clone());
                if g == Graph::Step {
                    m.embedding_parameter = Some(keys[TOKEN_EMBD].clone());
                }
                plans.push(ModulePlan {
                    stem: format!("{prefix}-{}", g.key()),
                    graphs: vec![g],
                    flags: options.flags_for(g, quantized),
                    archive,
                    keys: Some(keys),
                });
            }
            files.insert("weights".into(), "weights.irpa".into());
            for &g in &redecode {
                files.insert(g.key().into(), "weights.irpa".into());
            }
            let groups = flag_groups(&redecode, options, quantized);
            let split = groups.len() > 1;
            for (graphs, flags) in groups {
                plans.push(ModulePlan {
                    stem: if split {
                        format!("{prefix}-{}", graphs[0].key())
                    } else {
                        format!("{prefix}-redecode")
                    },
                    graphs,
                    flags,
                    archive: "weights.irpa".into(),
                    keys: None,
                });
            }
            write_archive(&table, &data, &scales, None, &out_dir.join("weights.irpa"))?;
            m.parameters = Some(Parameters::PerGraph(files));
            if !kv.contains(&Graph::Step) {
                m.embedding_parameter = Some(TOKEN_EMBD.into());
            }
        }
    }

    // IREE 3.13 does not compile v2's tiled softmax with `--iree-global-opt-data-tiling` ("expected
    // type to be 'tensor<2xf32>' or a rank-reduced version"); the CPU modules compiled with it
    // do not need the tiles (EmitOptions::tiled_softmax), so those get the one-row form.
    let bf16_matmul_inputs = m.matmul_input == MatmulInput::Bf16;
    // Our q4 kernel (`kernels::KernelIsa::for_export`): on x86-64 for exports to this very CPU
    // only (the module then runs nowhere without AVX-512, as any `--cpu host` module), on any
    // aarch64 triple. CPU-only exports: the module text serves every target.
    let triple = options
        .compile_flags
        .iter()
        .chain(options.graph_flags.values().flatten())
        .find_map(|f| f.strip_prefix("--iree-llvmcpu-target-triple="));
    let cpus: Option<Vec<&str>> = options
        .targets
        .iter()
        .map(|t| match t {
            Target::Cpu { cpu } => Some(cpu.as_str()),
            _ => None,
        })
        .collect();
    let q4_kernel = crate::kernels::q4_kernel_allowed()?
        && cpus.is_some_and(|cpus| crate::kernels::KernelIsa::for_export(triple, &cpus).is_some())
        && quantization
            .as_ref()
            .is_some_and(|q| q.scale_type == ScaleType::F16 && q.tensors.values().any(|f| *f == QuantFormat::Q4));
    if q4_kernel {
        crate::kernels::build_objects(out_dir)?;
    }
    // IREE's SPIR-V default gives each output row of the LM head a workgroup of its own; 4 rows
    // a 64-thread workgroup (a subgroup a row) measured best on the H200 (docs/journal,
    // session 16). Only where every target has 32-wide subgroups.
    let head_product = options
        .targets
        .iter()
        .all(|t| nvidia_vulkan(t, options.vulkan_target.as_deref()))
        .then_some(RowProducts { workgroup: 64, rows: 4 });
    // The products as wide as the residual stream (output and down projections) writing it out
    // as well: a workgroup a row, as IREE configures them alone (docs/journal, session 19).
    let stream_product = head_product.map(|_| crate::emit::StreamProducts { per_thread: 16 });
    // The same GPUs: the argmax in stages of 16 values (docs/journal, session 17).
    let argmax_width = head_product.map(|_| 16);
    // And contract v2's one-row attention products over the caches: IREE's own choice, matmuls
    // of 2 to 5 workgroups, took 15 of the step's 19.5 ms of GPU time; a subgroup per output,
    // 4 outputs a 64-thread workgroup, 0.9 (docs/journal, session 17).
    let attention_products = head_product.map(|_| crate::emit::AttentionProducts {
        workgroup: 64,
        keys: 4,
        outputs: 4,
    });
    // One module text serves every target of the export: forms only the CPU compiles need an
    // export for the CPU alone.
    let data_tiling = |flags: &[String]| flags.iter().any(|f| f.starts_with("--iree-global-opt-data-tiling"));
    let emit_opts = |keys: &Option<BTreeMap<String, String>>, flags: &[String]| EmitOptions {
        weights: options.weights,
        redecode_seq: options.redecode_seq,
        keys: keys.clone(),
        tiled_softmax: !data_tiling(flags),
        quantization: quantization.clone(),
        fused_dequant: aggressive_fusion(flags),
        bf16_matmul_inputs,
        argmax_by_max: cpu_only,
        q4_kernel,
        head_product,
        stream_product,
        argmax_width,
        attention_products,
    };
    let targets: Vec<Target> = options
        .targets
        .iter()
        .map(|t| match t {
            Target::Vulkan { target: None } if options.vulkan_target.is_some() => Target::Vulkan {
                target: options.vulkan_target.clone(),
            },
            other => other.clone(),
        })
        .collect();
    let mut jobs = Vec::new();
    let mut written = std::collections::BTreeSet::new();
    for plan in &plans {
        let text = emit_module(&m, &plan.graphs, &emit_opts(&plan.keys, &plan.flags))?;
        let mlir = out_dir.join(format!("{}.mlir", plan.stem));
        std::fs::write(&mlir, text).map_err(ExportError::io("writing", &mlir))?;
        let archive_path = out_dir.join(&plan.archive);
        // Each archive once per export (a shared `model.irpa` serves several modules when their
        // flags differ); the three layout's `weights.irpa` is written above.
        if plan.keys.is_some() || (options.layout == Layout::Shared && written.insert(plan.archive.clone())) {
            write_archive(&table, &data, &scales, plan.keys.as_ref(), &archive_path)?;
        }
        for target in &targets {
            let file = format!("{}.{}.vmfb", plan.stem, target.key());
            let encoded = wants_encoding(target, &plan.flags).then(|| {
                let encoded = format!("{}.{}.irpa", plan.stem, target.key());
                m.encoded_parameters.insert(file.clone(), encoded.clone());
                (archive_path.clone(), out_dir.join(encoded))
            });
            jobs.push(CompileJob {
                mlir: mlir.clone(),
                target: target.clone(),
                out: out_dir.join(&file),
                flags: plan.flags.clone(),
                encoded,
                objects: q4_kernel.then(|| out_dir.to_path_buf()),
            });
            let entry = m.modules.entry(target.key()).or_default();
            for g in &plan.graphs {
                entry.insert(g.key().to_string(), file.clone());
            }
        }
    }
    compile_all(&jobs, &m.parameter_scope)?;

    let source_name = src.provenance.source.clone().unwrap_or_else(|| source.describe());
    let p = &mut m.provenance;
    p.compiler = Some(COMPILER_VERSION.into());
    p.targets = Some(targets.iter().map(Target::key).collect::<Vec<_>>().join(","));
    p.source = Some(source_name);
    p.weight_format = Some(format!("{:?}", options.weights));
    p.layout = Some(format!("{:?}", options.layout));
    p.redecode_seq = Some(options.redecode_seq.unwrap_or(m.spec.seq));
    p.devices = Some(
        targets
            .iter()
            .map(|t| format!("{}={}", t.key(), t.device()))
            .collect::<Vec<_>>()
            .join(","),
    );
    let per_graph: BTreeMap<String, String> = graphs
        .iter()
        .map(|&g| (g.key().to_string(), options.flags_for(g, quantized).join(" ")))
        .collect();
    let distinct: Vec<&String> = per_graph
        .values()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    match distinct.as_slice() {
        [one] if one.is_empty() => {}
        [one] => p.compile_flags = Some(one.to_string()),
        _ => p.graph_compile_flags = Some(per_graph),
    }
    if !key_maps.is_empty() {
        p.parameter_keys = Some(key_maps);
    }
    crate::binding::record_source(p, &src_dir, weights_name)?;
    m.validate()?;
    m.save(out_dir)?;
    // Last: the digests cover the manifest as saved and every module and archive written.
    kv_core::digests::Digests::write(out_dir)?;
    Ok(m)
}

/// One `iree-compile` of a module for a target.
struct CompileJob {
    mlir: PathBuf,
    target: Target,
    out: PathBuf,
    flags: Vec<String>,
    /// (model archive, encoded archive to write) when the module reads encoded weights
    /// ([`crate::encode`]).
    encoded: Option<(PathBuf, PathBuf)>,
    /// Where the object files of our kernels are ([`crate::kernels`]), when the module calls them.
    objects: Option<PathBuf>,
}

impl CompileJob {
    fn run(&self, scope: &str) -> Result<()> {
        let mut flags = self.flags.clone();
        if let Some(dir) = &self.objects {
            flags.push(format!("--iree-hal-executable-object-search-path={}", dir.display()));
        }
        match &self.encoded {
            None => compile_with(&self.mlir, &self.target, &self.out, &flags),
            Some((archive, encoded)) => {
                compile_encoded(&self.mlir, &self.target, &self.out, &flags, archive, scope, encoded).map(|_| ())
            }
        }
    }
}

/// Runs the compilations on as many threads as the machine has cores; the first failure (in job
/// order) is the error.
fn compile_all(jobs: &[CompileJob], scope: &str) -> Result<()> {
    let width = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .max(1);
    for batch in jobs.chunks(width) {
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = batch.iter().map(|job| s.spawn(move || job.run(scope))).collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| kv_core::error::invariant("compile thread panicked"))
                })
                .collect()
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
    }
    Ok(())
}

/// `p0..pN` over the parameters in an order of graph `index`'s own: graph 0 in table order,
/// graph 1 reversed, graph 2 rotated by half, so no two archives share a numbering (as the seed's).
fn numbered_keys(table: &[ParamInfo], index: usize) -> BTreeMap<String, String> {
    let mut order: Vec<&ParamInfo> = table.iter().collect();
    match index % 3 {
        0 => {}
        1 => order.reverse(),
        _ => order.rotate_left(table.len() / 2),
    }
    order
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.clone(), format!("p{i}")))
        .collect()
}

/// The archive of `table` under `keys` (canonical names when `None`); a quantized parameter's
/// scales (in `scales`) follow as `KEY.scale` (`kv_core::quant::scale_name`).
fn write_archive(
    table: &[ParamInfo],
    data: &BTreeMap<String, Cow<[u8]>>,
    scales: &BTreeMap<String, Cow<[u8]>>,
    keys: Option<&BTreeMap<String, String>>,
    path: &Path,
) -> Result<()> {
    let mut entries: Vec<(String, &[u8])> = Vec::new();
    for p in table {
        let key = keys.map(|k| k[&p.name].clone()).unwrap_or_else(|| p.name.clone());
        if let Some(s) = scales.get(&p.name) {
            entries.push((kv_core::quant::scale_name(&key), s.as_ref()));
        }
        entries.push((key, data[&p.name].as_ref()));
    }
    if keys.is_some() {
        entries.sort_by_key(|(k, _)| {
            k[1..]
                .split('.')
                .next()
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(usize::MAX)
        });
    }
    let mut w = IrpaWriter::new();
    for (k, bytes) in entries {
        w.add_data(k, bytes.to_vec()).map_err(kv_core::Error::from)?;
    }
    w.write(path).map_err(kv_core::Error::from)?;
    Ok(())
}

/// Whether `target` is Vulkan for one of IREE 3.13's NVIDIA targets (`default` stands in for a
/// target that names none): GPUs whose subgroups are 32 wide, which [`RowProducts`]' workgroups
/// assume. (IREE's names: architectures, `sm_NN`, and products such as `rtx4090`.)
fn nvidia_vulkan(target: &Target, default: Option<&str>) -> bool {
    let Target::Vulkan { target: named } = target else {
        return false;
    };
    named.as_deref().or(default).is_some_and(nvidia_target)
}

/// Whether `--iree-vulkan-target` `name` is one of IREE 3.13's NVIDIA targets (architectures,
/// `sm_NN`, products such as `rtx4090`).
pub fn nvidia_target(name: &str) -> bool {
    ["volta", "turing", "ampere", "ada"].contains(&name) || name.starts_with("sm_") || name.starts_with("rtx")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_products_are_configured_for_nvidia_vulkan_targets_only() {
        let vulkan = |t: Option<&str>| Target::Vulkan {
            target: t.map(String::from),
        };
        for name in ["ampere", "ada", "sm_80", "rtx3090"] {
            assert!(nvidia_vulkan(&vulkan(Some(name)), None), "{name}");
            assert!(
                nvidia_vulkan(&vulkan(None), Some(name)),
                "{name} as the export's default"
            );
        }
        for name in ["valhall", "adreno", "rdna3", "vp_android_baseline_2022"] {
            assert!(!nvidia_vulkan(&vulkan(Some(name)), None), "{name}");
        }
        assert!(!nvidia_vulkan(&vulkan(None), None), "IREE's default target");
        assert!(
            !nvidia_vulkan(&vulkan(Some("valhall")), Some("ampere")),
            "a named target wins"
        );
        assert!(!nvidia_vulkan(&Target::cpu(), Some("ampere")));
    }

    /// Without the `fixtures` feature a fixture name is a clear error, never a lookup elsewhere.
    #[test]
    fn fixture_names_need_the_feature() {
        let got = Source::parse("tiny-llama:3").dir();
        if cfg!(feature = "fixtures") {
            let dir = got.unwrap();
            assert!(
                dir.join(kv_core::manifest::MANIFEST_FILE).is_file(),
                "{}",
                dir.display()
            );
        } else {
            let err = got.unwrap_err();
            assert!(
                matches!(err, ExportError::FixturesDisabled { ref name } if name == "tiny-llama:3"),
                "{err}"
            );
        }
    }
}
