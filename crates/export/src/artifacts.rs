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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kv_core::manifest::{CacheType, MatmulInput};
use kv_core::{ContractVersion, Graph, Manifest};

use crate::compile::Target;
use crate::emit::WeightFormat;
use crate::Result;

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
            Source::Fixture(name) => Err(crate::ExportError::FixturesDisabled { name: name.clone() }),
        }
    }

    pub(crate) fn describe(&self) -> String {
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
    /// The graph contract: v1 (`shared/CONTRACT.md`, the default) or v2 (`docs/contract-v2.md`:
    /// static-shape chunk and step graphs over caches the runtime owns). Contract 2's prefill
    /// graph is a chunk graph of `prefillChunk` rows ([`Self::prefill_seq`] or 128, at most the
    /// sliding ring; none when that is not above the chunk); the redecode graphs are v1's.
    pub contract: ContractVersion,
    /// Contract 2: rows a sliding layer's ring holds beyond its window (`KvSpec::ring_rows`):
    /// how far a session may write past a snapshot before a write copies the ring. `None`: the
    /// default ([`kv_core::spec::DEFAULT_RING_SLACK`], rounded up to 64 rows); a slack that
    /// leaves the ring no smaller than `maxPositions`: a linear cache.
    pub ring_slack: Option<usize>,
    /// Contract 2: the spans of the prefill graph's token-less variants (`KvSpec::prefill_spans`);
    /// `None`: [`KvSpec::default_prefill_spans`]. The prefill graph's own span is always the
    /// default (`seq` rounded up to `prefillChunk`).
    pub prefill_spans: Option<Vec<usize>>,
    /// Contract 2: the rows of the small chunk graph beside the chunk graph (`smallChunk`,
    /// `V2Spec::small_chunk`), which runs a feed's pieces of at most that many ids; `None`:
    /// [`kv_core::contract::DEFAULT_SMALL_CHUNK`] (8) where the chunk has more rows; `Some(0)`
    /// or a count not below the chunk's: none.
    pub small_chunk: Option<usize>,
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
            contract: ContractVersion::V1,
            ring_slack: None,
            prefill_spans: None,
            small_chunk: None,
            matmul_input: MatmulInput::F32,
            cache_type: CacheType::F32,
            fuse_projections: true,
        }
    }
}

/// A combination of [`ExportOptions`] the exporter refuses, and why. [`crate::ExportPlan::new`]
/// checks the options ([`ExportOptions::check`]) against the source before anything is emitted,
/// so every caller (the CLI, the JNI side, tests) gets the same rules.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    #[error(
        "bf16 weights with a Vulkan target: IREE 3.13 miscompiles bf16→f32 on Vulkan for tensors of 1024+ elements; \
         Vulkan takes packed (any GPU) or i16 (a named GPU target) weights"
    )]
    Bf16OnVulkan,
    #[error(
        "i16 weights for IREE's portable Vulkan target: its 16-bit loads are emulated and read the wrong elements; \
         name a target with 16-bit storage (portable-16bit, ampere, valhall, adreno, ...) or take packed weights"
    )]
    I16OnPortableVulkan,
    #[error(
        "q4 weights for Vulkan target `{0}`: the q4 graphs compiled for a named GPU target (ampere) computed wrong \
         tokens on the H200 (docs/quantized-weights.md); export Vulkan q4 for IREE's portable target, or q8"
    )]
    Q4OnNamedVulkan(String),
    #[error("bf16 matmul inputs need bf16 weights and CPU targets only (the bf16 matmuls read the weights as bf16)")]
    Bf16MatmulInputs,
    #[error("prefill spans need contract 2 (contract 1's prefill graph reads no caches)")]
    PrefillSpansNeedContract2,
    #[error("f16 caches need contract 2 and CPU targets only (IREE's portable Vulkan target has no 16-bit storage)")]
    F16Caches,
}

impl ExportOptions {
    /// Whether the exporter writes these options for a source quantized as `quantization`
    /// (`None`: bf16): see [`OptionsError`]. bf16 matmul inputs over a block-quantized source
    /// are not refused but take no effect (the manifest then says f32): `runtime_options_for`
    /// asks for them on every `host` CPU with bf16 dot products, whatever the source.
    pub fn check(&self, quantization: Option<&kv_core::quant::Quantization>) -> Result<(), OptionsError> {
        use crate::profile::{ExportProfile, GpuFamily, TargetProfile};
        let profile = ExportProfile::resolve(self);
        let gpus = || {
            profile.targets.iter().filter_map(|t| match t {
                TargetProfile::Vulkan { target, family } => Some((target.as_deref(), *family)),
                _ => None,
            })
        };
        if self.weights == WeightFormat::Bf16 && profile.has_vulkan() {
            return Err(OptionsError::Bf16OnVulkan);
        }
        if self.weights == WeightFormat::I16 && gpus().any(|(_, family)| family == GpuFamily::Portable) {
            return Err(OptionsError::I16OnPortableVulkan);
        }
        let q4 = quantization.is_some_and(|q| q.tensors.values().any(|f| *f == kv_core::quant::QuantFormat::Q4));
        if let Some((Some(target), _)) = gpus().find(|(target, _)| q4 && target.is_some()) {
            return Err(OptionsError::Q4OnNamedVulkan(target.to_string()));
        }
        if self.matmul_input == MatmulInput::Bf16 && !(self.weights == WeightFormat::Bf16 && profile.cpu_only()) {
            return Err(OptionsError::Bf16MatmulInputs);
        }
        let v2 = matches!(self.contract, ContractVersion::V2);
        if self.prefill_spans.is_some() && !v2 {
            return Err(OptionsError::PrefillSpansNeedContract2);
        }
        if self.cache_type == CacheType::F16 && !(v2 && profile.cpu_only()) {
            return Err(OptionsError::F16Caches);
        }
        Ok(())
    }

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

/// `graphs` in groups of equal [`ExportOptions::flags_of`], in first-appearance order.
pub(crate) fn flag_groups(
    graphs: &[Graph],
    options: &ExportOptions,
    quantized: bool,
) -> Vec<(Vec<Graph>, Vec<String>)> {
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

/// Writes the artifacts of `source` into `out_dir` and returns the manifest written there:
/// [`ExportPlan::new`], then [`ExportPlan::write`].
pub fn export_artifacts(source: &Source, out_dir: &Path, options: &ExportOptions) -> Result<Manifest> {
    crate::plan::ExportPlan::new(source, options)?.write(out_dir)
}

/// Whether `--iree-vulkan-target` `name` is one of IREE 3.13's NVIDIA targets (architectures,
/// `sm_NN`, products such as `rtx4090`).
pub fn nvidia_target(name: &str) -> bool {
    ["volta", "turing", "ampere", "ada"].contains(&name) || name.starts_with("sm_") || name.starts_with("rtx")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each refused combination names its rule; the runtime settings of every target pass.
    #[test]
    fn refused_combinations_name_their_rule() {
        use kv_core::quant::{QuantFormat, Quantization};
        let quantized = |format| Quantization {
            tensors: [(
                kv_core::Param::Layer(0, kv_core::LayerWeight::AttnQ).to_string(),
                format,
            )]
            .into(),
            ..Quantization::default()
        };
        let (q4, q8) = (quantized(QuantFormat::Q4), quantized(QuantFormat::Q8));
        let vulkan = |t: Option<&str>| Target::Vulkan {
            target: t.map(String::from),
        };
        let cpu = ExportOptions {
            targets: vec![Target::cpu()],
            weights: WeightFormat::Bf16,
            ..ExportOptions::default()
        };
        let gpu = |t: Option<&str>, weights| ExportOptions {
            targets: vec![vulkan(t)],
            weights,
            ..ExportOptions::default()
        };
        type Case<'a> = (
            &'a str,
            ExportOptions,
            Option<&'a Quantization>,
            Result<(), OptionsError>,
        );
        let cases: Vec<Case> = vec![
            ("cpu bf16", cpu.clone(), None, Ok(())),
            (
                "bf16 on vulkan",
                gpu(None, WeightFormat::Bf16),
                None,
                Err(OptionsError::Bf16OnVulkan),
            ),
            (
                "i16 portable",
                gpu(None, WeightFormat::I16),
                None,
                Err(OptionsError::I16OnPortableVulkan),
            ),
            (
                "i16 on the portable target with 16-bit storage",
                gpu(Some(crate::profile::PORTABLE_16BIT), WeightFormat::I16),
                None,
                Ok(()),
            ),
            (
                "i16 with the export's vulkan target",
                ExportOptions {
                    vulkan_target: Some("ampere".into()),
                    ..gpu(None, WeightFormat::I16)
                },
                None,
                Ok(()),
            ),
            (
                "q4 ampere",
                gpu(Some("ampere"), WeightFormat::PackedI32),
                Some(&q4),
                Err(OptionsError::Q4OnNamedVulkan("ampere".into())),
            ),
            (
                "q8 ampere",
                gpu(Some("ampere"), WeightFormat::PackedI32),
                Some(&q8),
                Ok(()),
            ),
            ("q4 portable", gpu(None, WeightFormat::PackedI32), Some(&q4), Ok(())),
            (
                "bf16 inputs, packed weights",
                ExportOptions {
                    weights: WeightFormat::PackedI32,
                    matmul_input: MatmulInput::Bf16,
                    ..cpu.clone()
                },
                None,
                Err(OptionsError::Bf16MatmulInputs),
            ),
            (
                "bf16 inputs over q8 (no effect, not refused)",
                ExportOptions {
                    matmul_input: MatmulInput::Bf16,
                    ..cpu.clone()
                },
                Some(&q8),
                Ok(()),
            ),
            (
                "prefill spans c1",
                ExportOptions {
                    prefill_spans: Some(vec![64]),
                    ..cpu.clone()
                },
                None,
                Err(OptionsError::PrefillSpansNeedContract2),
            ),
            (
                "f16 caches c1",
                ExportOptions {
                    cache_type: CacheType::F16,
                    ..cpu.clone()
                },
                None,
                Err(OptionsError::F16Caches),
            ),
            (
                "f16 caches with vulkan",
                ExportOptions {
                    contract: ContractVersion::V2,
                    cache_type: CacheType::F16,
                    ..gpu(None, WeightFormat::PackedI32)
                },
                None,
                Err(OptionsError::F16Caches),
            ),
            (
                "f16 caches c2 cpu",
                ExportOptions {
                    contract: ContractVersion::V2,
                    cache_type: CacheType::F16,
                    ..cpu.clone()
                },
                None,
                Ok(()),
            ),
        ];
        for (name, options, quant, want) in cases {
            assert_eq!(options.check(quant), want, "{name}");
        }
        for target in [
            Target::cpu(),
            Target::Cpu { cpu: "host".into() },
            vulkan(None),
            vulkan(Some("ampere")),
            vulkan(Some("valhall")),
        ] {
            for contract in [ContractVersion::V1, ContractVersion::V2] {
                let options = ExportOptions {
                    targets: vec![target.clone()],
                    ..crate::runtime_options_for(&target, contract)
                };
                assert_eq!(options.check(None), Ok(()), "{target:?} c{contract}");
            }
        }
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
                matches!(err, crate::ExportError::FixturesDisabled { ref name } if name == "tiny-llama:3"),
                "{err}"
            );
        }
    }
}
