//! [`ExportPlan`]: an export decided before anything is written or compiled.
//!
//! Emitting the graphs is cheap (tens of milliseconds for a real model); compiling them is not
//! (minutes). So an export is planned first (the manifest it will save, each module's text and
//! flags, each archive's entries, each compile job) from the source's manifest alone, and the
//! cache keys the export by that plan's content ([`ExportPlan::key`]): a change of the emitter,
//! the flags, the compiler or our kernels is a new key by construction, with no revision number
//! to remember to bump.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kv_core::irpa::{IrpaArchive, IrpaWriter};
use kv_core::manifest::{CacheType, Functions, MatmulInput, Parameters, V2Spec};
use kv_core::param::{LayerWeight, Param};
use kv_core::params::{parameter_table, FusedParam, ParamInfo};
use kv_core::quant::{QuantFormat, Quantization, ScaleType};
use kv_core::ContractVersion;
use kv_core::{Graph, Manifest};
use sha2::{Digest, Sha256};

use crate::artifacts::flag_groups;
use crate::compile::{compile_with, Target, COMPILER_VERSION};
use crate::emit::{emit_module, EmitOptions, WeightFormat};
use crate::encode::{compile_encoded, wants_encoding};
use crate::profile::{ExportProfile, FlagFacts};
use crate::{ExportError, ExportOptions, Layout, Result, Source};

/// One module to write and compile.
struct ModulePlan {
    stem: String,
    graphs: Vec<Graph>,
    /// Every `iree-compile` flag of this module.
    flags: Vec<String>,
    archive: String,
    /// canonical name → archive key (`None` = identity).
    keys: Option<BTreeMap<String, String>>,
    /// The module's StableHLO text (emitted once every module is planned).
    text: String,
}

impl ModulePlan {
    fn new(
        stem: String,
        graphs: Vec<Graph>,
        flags: Vec<String>,
        archive: String,
        keys: Option<BTreeMap<String, String>>,
    ) -> ModulePlan {
        ModulePlan {
            stem,
            graphs,
            flags,
            archive,
            keys,
            text: String::new(),
        }
    }
}

/// `text`, the module of `graphs`, with the chunk graph's variant over `smallChunk` rows
/// (`V2Spec::small_chunk`, [`kv_core::manifest::Functions::small_chunk`]) added when the
/// manifest has one and the module holds the chunk graph.
///
/// The variant is the chunk graph emitted for a geometry whose `chunk` is `smallChunk`, under
/// its own name: its function text is taken from a module of its own and put before the end of
/// `text`. It reads the parameters the chunk graph reads, so its module's declarations
/// (parameter globals, kernel sources) are `text`'s already; one that is not is an error rather
/// than a module that does not verify. (The emitter takes its rows from the geometry; splicing
/// here keeps its text, and so every other function's, as it was.)
fn with_small_chunk(m: &Manifest, graphs: &[Graph], text: String, options: &EmitOptions) -> Result<String> {
    let rows = m.v2().map_or(0, |v2| v2.small_chunk);
    if rows == 0 || !graphs.contains(&Graph::Chunk) {
        return Ok(text);
    }
    let mut small = m.clone();
    small.spec.chunk = rows;
    if let Some(v2) = small.contract.v2_mut() {
        v2.small_chunk = 0;
    }
    small.functions.prefill_with_past = m.functions.small_chunk(rows);
    let options = EmitOptions {
        chunk_span: m.v2().map_or(0, |v2| v2.small_chunk_span),
        ..options.clone()
    };
    let small_text = emit_module(&small, &[Graph::Chunk], &options)?;
    let unexpected = |what: &str| {
        ExportError::Unsupported(format!(
            "the small chunk graph ({rows} rows) as a module of its own: {what}"
        ))
    };
    let funcs_at = small_text
        .find("\n  func.func ")
        .ok_or_else(|| unexpected("no function"))?
        + 1;
    let (head, funcs) = small_text.split_at(funcs_at);
    let funcs = funcs.strip_suffix("}\n").ok_or_else(|| unexpected("no module end"))?;
    if let Some(decl) = head.lines().skip(1).find(|line| !text.contains(line)) {
        return Err(unexpected(&format!(
            "a declaration the chunk graph's module lacks: {decl}"
        )));
    }
    let end = text
        .strip_suffix("}\n")
        .ok_or_else(|| unexpected("the chunk graph's module has no end"))?;
    Ok(format!("{end}{funcs}}}\n"))
}

/// One archive file to write: [`ExportPlan::write`] writes each once.
struct ArchivePlan {
    file: String,
    /// canonical name → archive key (`None` = identity).
    keys: Option<BTreeMap<String, String>>,
}

/// One `iree-compile` of a module for a target; paths relative to the export directory.
struct CompileJob {
    mlir: String,
    target: Target,
    out: String,
    flags: Vec<String>,
    /// (model archive, encoded archive to write) when the module reads encoded weights
    /// ([`crate::encode`]).
    encoded: Option<(String, String)>,
    /// Whether the module calls our kernels ([`crate::kernels`]), whose objects are then in the
    /// export directory.
    objects: bool,
}

/// Everything an export writes, decided from the source's manifest and the options: see the
/// module docs. [`crate::export_artifacts`] is `ExportPlan::new(..)?.write(..)`.
pub struct ExportPlan {
    source: Source,
    src_dir: PathBuf,
    weights_name: String,
    /// The manifest as [`Self::write`] saves it, but for the source binding
    /// (`crate::binding::record_source`, read from the source files when writing).
    manifest: Manifest,
    /// The source's parameters as read (before fusion), and how the source stores them.
    source_table: Vec<ParamInfo>,
    source_quantization: Option<Quantization>,
    /// The block scales' element type in the source and in the export's archives.
    scale_types: (ScaleType, ScaleType),
    /// The archives' parameters (after fusion) and the fused ones' parts.
    table: Vec<ParamInfo>,
    fused: Vec<FusedParam>,
    modules: Vec<ModulePlan>,
    archives: Vec<ArchivePlan>,
    jobs: Vec<CompileJob>,
    q4_kernel: bool,
    /// Whether a target is `--cpu host`: the compiled code is this machine's CPU's.
    host_cpu: bool,
}

impl ExportPlan {
    /// Plans the export of `source` with `options`: reads the source's manifest (not its
    /// weights), checks the options against it and emits every module. Nothing is written.
    pub fn new(source: &Source, options: &ExportOptions) -> Result<ExportPlan> {
        let v2 = matches!(options.contract, ContractVersion::V2);
        let mut graphs = options.graphs.clone();
        let src_dir = source.dir()?;
        let src = Manifest::load(&src_dir)?;
        let arch = src.require_architecture()?.clone();
        options.check(src.quantization.as_ref())?;
        let weights_name = src
            .weights_file()
            .ok_or_else(|| kv_core::Error::manifest("parameters", "the source manifest names no weights archive"))?
            .to_string();

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
        // v2's sliding layers keep a ring of rows, not `maxPositions` (`docs/contract-v2.md`), and
        // a prefill's calls read only the rows they can see (`V2Spec::prefill_span`).
        let layout = v2.then(|| {
            V2Spec::for_export(
                &m.spec,
                options.ring_slack,
                graphs.contains(&Graph::Prefill),
                options.prefill_seq,
                options.prefill_spans.clone(),
                options.small_chunk,
            )
        });
        if layout.as_ref().is_some_and(|l| l.prefill_chunk == 0) {
            graphs.retain(|&g| g != Graph::Prefill);
        }
        if let Some(layout) = layout {
            // v2's argument lists are its own (the source's, if reordered, are v1 lists): canonical
            // ones, with what the source says beyond the graphs kept.
            let mut fresh = Manifest::new(m.spec.clone(), Some(arch.clone()), &prefix).into_v2(layout);
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
        let profile = ExportProfile::resolve(options);
        let cpu_only = profile.cpu_only();
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
        m.embed_function = (profile.has_vulkan() && arch.tied_output && graphs.contains(&Graph::Step))
            .then(|| format!("module.{prefix}_embed_token"));
        m.modules.clear();
        m.encoded_parameters.clear();
        // The options' sizes, now in the manifest, are checked against `kv_core::limits` here
        // (`chunk` beyond `maxPositions` was accepted, and a session then asked for 40 GB).
        m.validate()?;
        if let Some(seq) = options.redecode_seq {
            m.spec.check_redecode_seq("export option redecode_seq", seq)?;
        }

        let source_table = parameter_table(&m.spec, &arch);
        let source_quantization = src.quantization.clone();
        let mut quantization = source_quantization.clone();
        let quantized = quantization.is_some();
        // The source's scale type, and the export's: the Vulkan weight formats give the SPIR-V
        // code generator no 16-bit type, so their archives hold the f16 scales widened to f32
        // (exactly).
        let scale_types = match quantization.as_mut() {
            Some(q) => {
                let from = q.scale_type;
                if options.weights != WeightFormat::Bf16 {
                    q.scale_type = ScaleType::F32;
                }
                (from, q.scale_type)
            }
            None => (ScaleType::default(), ScaleType::default()),
        };
        // Each fused parameter's rows are its parts' one after the other: the values' and the
        // scales' bytes alike (both row-major over the output rows).
        // The portable Vulkan profiles also store gate and up as one matrix: one split product
        // for both, the activation in its second stage (`Body::contract_pairs_gated`).
        let fusion = kv_core::params::Fusion {
            projections: options.fuse_projections,
            gate_up: options.fuse_projections && profile.split_reductions(),
        };
        let (table, fused) =
            kv_core::params::fuse_projections(&source_table, m.spec.n_layers, quantization.as_ref(), fusion);
        if let Some(q) = quantization.as_mut() {
            q.fuse(&fused);
        }
        m.quantization = quantization.clone();
        m.fused_projections = fused.iter().any(|f| f.weight != LayerWeight::FfnGateUp);
        m.fused_gate_up = fused.iter().any(|f| f.weight == LayerWeight::FfnGateUp);

        let kv: Vec<Graph> = graphs.iter().copied().filter(|g| Graph::KV.contains(g)).collect();
        let redecode: Vec<Graph> = graphs.iter().copied().filter(|g| !Graph::KV.contains(g)).collect();
        let mut planned: Vec<ModulePlan> = Vec::new();
        let mut archives = Vec::new();
        let mut key_maps: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        match options.layout {
            Layout::Shared => {
                let groups = flag_groups(&graphs, options, quantized);
                let split = groups.len() > 1;
                for (graphs, flags) in groups {
                    let stem = if split {
                        format!("{prefix}-{}", graphs[0].key())
                    } else {
                        prefix.clone()
                    };
                    planned.push(ModulePlan::new(stem, graphs, flags, "model.irpa".into(), None));
                }
                // A shared `model.irpa` serves every module, whatever their flags.
                archives.push(ArchivePlan {
                    file: "model.irpa".into(),
                    keys: None,
                });
                m.parameters = Some(Parameters::Shared("model.irpa".into()));
                m.embedding_parameter = Some(Param::TokenEmbd.to_string());
            }
            Layout::Three => {
                let mut files = BTreeMap::new();
                // `weights.irpa` first, as the exporter always wrote it.
                archives.push(ArchivePlan {
                    file: "weights.irpa".into(),
                    keys: None,
                });
                for (i, &g) in kv.iter().enumerate() {
                    let keys = numbered_keys(&table, i);
                    key_maps.insert(
                        g.key().into(),
                        keys.iter().map(|(c, k)| (k.clone(), c.clone())).collect(),
                    );
                    let archive = format!("{prefix}-{}.irpa", g.key());
                    files.insert(g.key().to_string(), archive.clone());
                    if g == Graph::Step {
                        m.embedding_parameter = Some(keys[&Param::TokenEmbd.to_string()].clone());
                    }
                    archives.push(ArchivePlan {
                        file: archive.clone(),
                        keys: Some(keys.clone()),
                    });
                    planned.push(ModulePlan::new(
                        format!("{prefix}-{}", g.key()),
                        vec![g],
                        options.flags_for(g, quantized),
                        archive,
                        Some(keys),
                    ));
                }
                files.insert("weights".into(), "weights.irpa".into());
                for &g in &redecode {
                    files.insert(g.key().into(), "weights.irpa".into());
                }
                let groups = flag_groups(&redecode, options, quantized);
                let split = groups.len() > 1;
                for (graphs, flags) in groups {
                    let stem = if split {
                        format!("{prefix}-{}", graphs[0].key())
                    } else {
                        format!("{prefix}-redecode")
                    };
                    planned.push(ModulePlan::new(stem, graphs, flags, "weights.irpa".into(), None));
                }
                m.parameters = Some(Parameters::PerGraph(files));
                if !kv.contains(&Graph::Step) {
                    m.embedding_parameter = Some(Param::TokenEmbd.to_string());
                }
            }
        }

        let bf16_matmul_inputs = m.matmul_input == MatmulInput::Bf16;
        // Our q4 kernel (`ExportProfile::kernel_isa`): on x86-64 for exports to this very CPU
        // only (the module then runs nowhere without AVX-512, as any `--cpu host` module), on
        // any aarch64 triple. CPU-only exports: the module text serves every target.
        let q4_kernel = crate::kernels::q4_kernel_allowed()?
            && profile.kernel_isa().is_some()
            && quantization
                .as_ref()
                .is_some_and(|q| q.scale_type == ScaleType::F16 && q.tensors.values().any(|f| *f == QuantFormat::Q4));
        let tuning = profile.gpu_tuning();
        // One module text serves every target of the export: forms only the CPU compiles need an
        // export for the CPU alone.
        let emit_opts = |keys: &Option<BTreeMap<String, String>>, flags: &[String]| {
            let facts = FlagFacts::of(flags);
            EmitOptions {
                weights: options.weights,
                redecode_seq: options.redecode_seq,
                keys: keys.clone(),
                // IREE 3.13 does not compile v2's tiled softmax with data tiling ("expected type
                // to be 'tensor<2xf32>' or a rank-reduced version"); the modules compiled with it
                // do not need the tiles, so those get the one-row form.
                tiled_softmax: !facts.data_tiling,
                quantization: quantization.clone(),
                fused_dequant: facts.aggressive_fusion,
                bf16_matmul_inputs,
                argmax_by_max: cpu_only,
                q4_kernel,
                tuning,
                split_reductions: profile.split_reductions(),
                chunk_span: 0,
                caller_storage: profile.has_vulkan(),
            }
        };
        let targets = profile.compile_targets();
        let mut modules = Vec::new();
        let mut jobs = Vec::new();
        for mut module in planned {
            let emit = emit_opts(&module.keys, &module.flags);
            module.text = with_small_chunk(&m, &module.graphs, emit_module(&m, &module.graphs, &emit)?, &emit)?;
            let ModulePlan {
                stem,
                graphs,
                flags,
                archive,
                ..
            } = &module;
            for target in &targets {
                let file = format!("{stem}.{}.vmfb", target.key());
                let encoded = wants_encoding(target, flags).then(|| {
                    let encoded = format!("{stem}.{}.irpa", target.key());
                    m.encoded_parameters.insert(file.clone(), encoded.clone());
                    (archive.clone(), encoded)
                });
                jobs.push(CompileJob {
                    mlir: format!("{stem}.mlir"),
                    target: target.clone(),
                    out: file.clone(),
                    flags: flags.clone(),
                    encoded,
                    objects: q4_kernel,
                });
                let entry = m.modules.entry(target.key()).or_default();
                for g in graphs {
                    entry.insert(g.key().to_string(), file.clone());
                }
            }
            modules.push(module);
        }

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
        let host_cpu = targets
            .iter()
            .any(|t| matches!(t, Target::Cpu { cpu } if cpu == "host"));
        Ok(ExportPlan {
            source: source.clone(),
            src_dir,
            weights_name,
            manifest: m,
            source_table,
            source_quantization,
            scale_types,
            table,
            fused,
            modules,
            archives,
            jobs,
            q4_kernel,
            host_cpu,
        })
    }

    /// The manifest the export saves (less the source binding, added when writing).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Each module's file name (`gemma.mlir`) and StableHLO text, in the order they are written.
    pub fn module_texts(&self) -> impl Iterator<Item = (String, &str)> {
        self.modules
            .iter()
            .map(|p| (format!("{}.mlir", p.stem), p.text.as_str()))
    }

    /// What the artifacts are made of, as a sha256 (hex): the manifest as planned, each
    /// module's text, graphs and archive, each compile job's target, flags and outputs, each
    /// archive's entries (keys, fused parts, scale types), the source's manifest and weights
    /// ([`source_digest`]), the compiler's own `--version`, and where they take part our kernels'
    /// sources and clang's version, the parameter encoder's binary and this CPU
    /// (`--cpu host`). Two plans with one key compile to the same artifacts; a change of any of
    /// these is a new key, so no revision number needs bumping by hand.
    pub fn key(&self) -> Result<String> {
        let mut h = Sha256::new();
        let mut put = |label: &str, bytes: &[u8]| {
            // Length-prefixed, so no two different sequences of parts hash alike.
            h.update(label.as_bytes());
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        put("manifest", self.manifest.to_json().as_bytes());
        for p in &self.modules {
            put("module", p.stem.as_bytes());
            put("text", p.text.as_bytes());
            put("graphs", graph_keys(&p.graphs).as_bytes());
            put("flags", p.flags.join("\n").as_bytes());
            put("archive", p.archive.as_bytes());
        }
        for j in &self.jobs {
            put("job", format!("{} {} {}", j.mlir, j.target.key(), j.out).as_bytes());
            put("target flags", j.target.flags().join("\n").as_bytes());
            put("flags", j.flags.join("\n").as_bytes());
            put(
                "encoded",
                j.encoded
                    .as_ref()
                    .map_or(String::new(), |(a, e)| format!("{a} {e}"))
                    .as_bytes(),
            );
            put("objects", &[j.objects as u8]);
        }
        for a in &self.archives {
            put("archive file", a.file.as_bytes());
            for (key, what) in self.archive_entries(a.keys.as_ref()) {
                put("entry", format!("{key} {what:?}").as_bytes());
            }
        }
        for f in &self.fused {
            let parts: Vec<&str> = f.parts.iter().map(|p| p.name.as_str()).collect();
            put("fused", format!("{} = {}", f.name, parts.join(" + ")).as_bytes());
        }
        put(
            "scale types",
            format!("{} {}", self.scale_types.0.key(), self.scale_types.1.key()).as_bytes(),
        );
        put("source", source_digest(&self.src_dir, &self.weights_name)?.as_bytes());
        put("compiler", tool_identity::compiler()?.as_bytes());
        if self.jobs.iter().any(|j| j.encoded.is_some()) {
            put("encoder", tool_identity::encoder()?.as_bytes());
        }
        if self.q4_kernel {
            for isa in crate::kernels::KernelIsa::ALL {
                put("kernel", isa.source().as_bytes());
                put("clang args", isa.clang_args().join(" ").as_bytes());
            }
            put("clang", tool_identity::clang()?.as_bytes());
        }
        if self.host_cpu {
            put("host cpu", crate::cache::host_cpu().as_bytes());
        }
        Ok(hex(&h.finalize()))
    }

    /// `(archive key, what it holds)` of an archive under `keys`, in the order they are written.
    fn archive_entries(&self, keys: Option<&BTreeMap<String, String>>) -> Vec<(String, Entry)> {
        let quantization = self.manifest.quantization.as_ref();
        let mut entries = Vec::new();
        for p in &self.table {
            let key = keys.map(|k| k[&p.name].clone()).unwrap_or_else(|| p.name.clone());
            if quantization.and_then(|q| q.format_of(&p.name)).is_some() {
                entries.push((kv_core::quant::scale_name(&key), Entry::Scales(p.name.clone())));
            }
            entries.push((key, Entry::Values(p.name.clone())));
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
        entries
    }

    /// Writes the artifacts into `out_dir` (created) and returns the manifest saved there: reads
    /// the source's weights, writes the archives, module texts and our kernels' objects,
    /// compiles every module and records the digests last.
    pub fn write(&self, out_dir: &Path) -> Result<Manifest> {
        let archive = IrpaArchive::open(self.src_dir.join(&self.weights_name)).map_err(kv_core::Error::from)?;
        let (from, to) = self.scale_types;
        let mut data: BTreeMap<String, Cow<[u8]>> = BTreeMap::new();
        // Scales of the quantized parameters, by the parameter's canonical name.
        let mut scales: BTreeMap<String, Cow<[u8]>> = BTreeMap::new();
        for p in &self.source_table {
            if let Some(format) = self.source_quantization.as_ref().and_then(|q| q.format_of(&p.name)) {
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
        for f in &self.fused {
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

        std::fs::create_dir_all(out_dir).map_err(ExportError::io("creating", out_dir))?;
        for a in &self.archives {
            let mut w = IrpaWriter::new();
            for (key, what) in self.archive_entries(a.keys.as_ref()) {
                let bytes = match &what {
                    Entry::Values(name) => &data[name],
                    Entry::Scales(name) => &scales[name],
                };
                w.add_data(key, bytes.to_vec()).map_err(kv_core::Error::from)?;
            }
            w.write(out_dir.join(&a.file)).map_err(kv_core::Error::from)?;
        }
        if self.q4_kernel {
            crate::kernels::build_objects(out_dir)?;
        }
        for p in &self.modules {
            let mlir = out_dir.join(format!("{}.mlir", p.stem));
            std::fs::write(&mlir, &p.text).map_err(ExportError::io("writing", &mlir))?;
        }
        compile_all(&self.jobs, out_dir, &self.manifest.parameter_scope)?;

        let mut m = self.manifest.clone();
        crate::binding::record_source(&mut m.provenance, &self.src_dir, &self.weights_name)?;
        m.validate()?;
        m.save(out_dir)?;
        // Last: the digests cover the manifest as saved and every module and archive written.
        kv_core::digests::Digests::write(out_dir)?;
        Ok(m)
    }

    /// The model this plan exports (as given).
    pub fn source(&self) -> &Source {
        &self.source
    }
}

/// What an archive entry holds: a parameter's values (bf16, or quantized values), or its block
/// scales.
#[derive(Debug)]
enum Entry {
    Values(String),
    Scales(String),
}

fn graph_keys(graphs: &[Graph]) -> String {
    graphs.iter().map(|g| g.key()).collect::<Vec<_>>().join(",")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A sha256 (hex) of the source model's manifest and weights archive: contents up to 64 MiB,
/// the length and mtime of a larger archive (hashing 500 MB on every cache lookup would cost
/// more than it protects: a real model's directory is written once by the importer).
pub(crate) fn source_digest(dir: &Path, weights: &str) -> Result<String> {
    let mut hasher = Sha256::new();
    for file in [dir.join(kv_core::manifest::MANIFEST_FILE), dir.join(weights)] {
        let meta = std::fs::metadata(&file).map_err(ExportError::io("reading", &file))?;
        hasher.update(meta.len().to_le_bytes());
        if meta.len() <= 64 << 20 {
            hasher.update(std::fs::read(&file).map_err(ExportError::io("reading", &file))?);
        } else {
            let mtime_ns = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            hasher.update(mtime_ns.to_le_bytes());
        }
    }
    Ok(hex(&hasher.finalize()))
}

/// The tools' identities in a key, each found once per process: what they print for
/// `--version` (the compiler's names its release and commit), or for a tool without one, a
/// sha256 of its binary.
mod tool_identity {
    use std::path::Path;
    use std::process::Command;
    use std::sync::OnceLock;

    use crate::{ExportError, Result};

    fn version_of(tool: &Path) -> Result<String> {
        let out = Command::new(tool)
            .arg("--version")
            .output()
            .map_err(ExportError::io("running", tool))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    }

    fn once(cell: &'static OnceLock<String>, find: impl FnOnce() -> Result<String>) -> Result<String> {
        if let Some(v) = cell.get() {
            return Ok(v.clone());
        }
        let v = find()?;
        Ok(cell.get_or_init(|| v).clone())
    }

    /// `iree-compile --version`: the release and the commit it was built from.
    pub fn compiler() -> Result<String> {
        static ID: OnceLock<String> = OnceLock::new();
        once(&ID, || version_of(&crate::compile::find_compiler()?))
    }

    /// `iree-encode-parameters` is built here from IREE's sources (`scripts/build-iree-tools.sh`)
    /// and prints no version: its binary's sha256.
    pub fn encoder() -> Result<String> {
        static ID: OnceLock<String> = OnceLock::new();
        once(&ID, || {
            let path = crate::encode::find_encoder()?;
            Ok(kv_core::digests::sha256_file(&path)?)
        })
    }

    /// `clang --version`, which builds our kernels.
    pub fn clang() -> Result<String> {
        static ID: OnceLock<String> = OnceLock::new();
        once(&ID, || {
            let clang = crate::compile::find_tool("CLANG", "clang", "bin/clang").map_err(|searched| {
                ExportError::Unsupported(format!("the q4 kernel needs clang (searched: {searched})"))
            })?;
            version_of(&clang)
        })
    }
}

/// Runs the compilations on as many threads as the machine has cores; the first failure (in job
/// order) is the error.
fn compile_all(jobs: &[CompileJob], dir: &Path, scope: &str) -> Result<()> {
    let run = |job: &CompileJob| -> Result<()> {
        let mut flags = job.flags.clone();
        if job.objects {
            flags.push(format!("--iree-hal-executable-object-search-path={}", dir.display()));
        }
        let (mlir, out) = (dir.join(&job.mlir), dir.join(&job.out));
        match &job.encoded {
            None => compile_with(&mlir, &job.target, &out, &flags),
            Some((archive, encoded)) => compile_encoded(
                &mlir,
                &job.target,
                &out,
                &flags,
                &dir.join(archive),
                scope,
                &dir.join(encoded),
            )
            .map(|_| ()),
        }
    };
    let width = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .max(1);
    for batch in jobs.chunks(width) {
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = batch.iter().map(|job| s.spawn(move || run(job))).collect();
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
