//! The graphs of the contract as StableHLO, computing exactly `docs/forward.md`.
//!
//! Shape choices forced by IREE 3.13 (see `shared/notes/TOOLCHAIN.md` and the crate docs):
//! - Attention is one batched `dot_general` over **all query heads**: `Q [nHeads, R, d]` against
//!   the keys repeated per query head `K [nHeads, T, d]`. A batch of size 1 or a unit dimension
//!   next to a dynamic one makes IREE insert a dynamic `reshape` that does not verify, so a KV
//!   head is taken out with `real_dynamic_slice` + a one-term reduce and repeated with
//!   `dynamic_broadcast_in_dim`; the per-head scores `[nHeads, R, T]` then take a per-head mask
//!   directly, or a head-shared one through a broadcast. With several KV heads of several query
//!   heads each (SmolLM2, Qwen, Llama GQA) that repeat copies the whole past per call, so there
//!   each KV head is attended on its own: its query heads stacked as rows `[group·R, d]` against
//!   its keys `[T, d]` (`grouped_attention`, static reshapes only).
//! - Weights are `util.global`s bound to external parameters; with [`WeightFormat::PackedI32`]
//!   a bf16 tensor `[.., n]` is declared as `[.., n/2] i32` and widened in the graph with shifts
//!   and bitcasts (no 16-bit type reaches the Vulkan code generator).
//! - RoPE tables of the prefill and redecode graphs (positions `0..SEQ`) are exact constants from
//!   `kv_core::rope`, the same tables the reference uses; their masks are built from `iota`s.
//!
//! Layout: one [`FuncEmitter`] per function, its methods split by concern (each file an
//! `impl FuncEmitter` block). This file holds the options, the module and the function's
//! signature and graph walk; [`weights`] the parameters (loading, widening, dequantization),
//! [`norms`] the RMS norms, [`rope`] the rotation and the Q/K norms fused with it, [`products`]
//! every `x · Wᵀ` form (the fused normed products and the q4 kernel's dispatch included),
//! [`attention`] contract v1's attention, [`attention_v2`] contract v2's (the tiled softmax split
//! and the tuned GPUs' one-row form), [`head`] the logits and the argmax, [`layer`] a transformer
//! block and the residual stream between blocks. A target-specific form sits in the module of
//! its concern, chosen there from [`EmitOptions`] (its tuning from [`crate::profile`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use kv_core::manifest::{CacheType, Name, V2Spec};
use kv_core::params::{archive_table, ParamInfo};
use kv_core::quant::BLOCK;
use kv_core::{Architecture, Graph, KvSpec, LayerKind, Manifest};

use crate::mlir::{Body, Dim, Elem, Ty, V};
use crate::ExportError;

mod attention;
mod attention_v2;
#[doc(hidden)]
pub mod forms;
mod head;
mod layer;
mod norms;
mod products;
mod rope;
mod weights;

pub use attention_v2::AttentionProducts;
pub use products::{RowProducts, StreamProducts};

use attention::MaskIn;
use layer::Residual;

/// How the weights are declared in the graph. The archive holds bf16 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// `tensor<..xbf16>` widened with `stablehlo.convert`. Miscompiles on IREE 3.13 Vulkan for
    /// tensors of 1024+ elements: CPU only.
    Bf16,
    /// `tensor<.., n/2 x i32>` (two bf16 per word, low half = even element), widened with
    /// shift / and / `bitcast_convert`. Exact on CPU and Vulkan: the default everywhere.
    #[default]
    PackedI32,
    /// `tensor<..xi16>`: the bf16 bits as integers, widened elementwise (sign-extend, shift into
    /// the high half, `bitcast_convert`). No interleave, so IREE can fuse the widening into the
    /// matmul that reads the weight instead of materialising an f32 copy per call.
    I16,
}

/// Options of [`emit`] / [`emit_module`].
#[derive(Clone, Debug, Default)]
pub struct EmitOptions {
    pub weights: WeightFormat,
    /// `SEQ` of the redecode graphs; `None` = the manifest's `seq`.
    pub redecode_seq: Option<usize>,
    /// Archive key of each canonical parameter name; `None` = the canonical names.
    pub keys: Option<BTreeMap<String, String>>,
    /// Contract v2: reduce the softmax over the cache's keys in tiles
    /// ([`FuncEmitter::softmax_split`]); `false` = one row per query, as v1.
    pub tiled_softmax: bool,
    /// The archive's block-quantized parameters (the source manifest's `quantization`): each is
    /// declared as its values `[out, in/32, 32]` (`i8` or `i4`) and scales `[out, in/32]` (f16,
    /// or f32) and dequantized where the matmul that reads it does (see [`Self::fused_dequant`]);
    /// [`Self::weights`] declares the rest.
    pub quantization: Option<kv_core::quant::Quantization>,
    /// Many-row projections of quantized weights take a separate dequantization feeding a
    /// `dot_general` over the blocks (`[R, nb, 32] · [O, nb, 32]`; q8), which CPU data tiling
    /// puts on the f32 `mmt4d` ukernels with the dequantization fused into the weight's packing,
    /// or a two-reduction contraction ([`crate::mlir::Body::block_contract`]; q4): one f32 copy
    /// of the weight per call either way, as IREE 3.13 materialises for any many-row form (only
    /// with aggressive fusion, on from `--iree-opt-level=O2`); `false` = every projection dequantizes
    /// in its contraction's body ([`crate::mlir::Body::block_contract_q`]), which never
    /// materialises a dequantized weight but is no matmul to IREE (slower for many rows).
    pub fused_dequant: bool,
    /// Round each projection's activation to bf16 and contract bf16 × bf16 → f32 (the weights'
    /// own type, [`WeightFormat::Bf16`] only), so that the CPU's bf16 matmul kernels serve the
    /// projections and the LM head; `false` = the weight is widened to f32 (f32 × f32). The
    /// manifest records it (`KvSpec::matmul_input`) and the reference rounds the same inputs.
    pub bf16_matmul_inputs: bool,
    /// Argmax as a maximum then the lowest index holding it ([`Body::argmax_rows_by_max`]):
    /// faster on the CPU, not compiled for SPIR-V by IREE 3.13; `false` = the staged two-operand
    /// reduce ([`Body::argmax_rows`]) that every target compiles.
    pub argmax_by_max: bool,
    /// One-row q4 products (the decode step's, the LM head's) call our AVX-512 kernel
    /// (`kernels/q4_matvec_x86_64.c`, [`crate::kernels`]) from a `flow.dispatch`, where IREE's
    /// own code for [`Body::block_contract_q`] took ~1.5× as long (docs/journal,
    /// session 15). x86-64 CPU exports for a CPU with AVX-512 BW and F16C, f16 scales only; the
    /// module must be compiled with the kernel's object on its search path.
    pub q4_kernel: bool,
    /// IREE's SPIR-V configurations of the one-row forms ([`crate::profile::GpuTuning`]: the LM
    /// head's and the step's normed i16 products, the products writing the residual stream out,
    /// the argmax's stage width, contract v2's attention products), for modules compiled only
    /// for one tuned GPU family ([`crate::profile::ExportProfile::gpu_tuning`]); `None` = every
    /// product in the form of the graph's other projections, configured by IREE.
    pub tuning: Option<crate::profile::GpuTuning>,
    /// Contract v2's one-row attention products in two reductions (runs, then across them:
    /// [`FuncEmitter::mul_reduce_split`]), for GPUs whose reductions IREE runs one thread an
    /// output (the portable profiles, [`crate::profile::ExportProfile::split_reductions`]);
    /// `false` = one reduction (the CPU's, and tuned GPUs configure theirs).
    pub split_reductions: bool,
    /// Also emit the chunk graph's variant reading this many rows of each cache
    /// (`<chunk function>_span<N>`, with its token: [`kv_core::contract::V2Spec::spanned`]);
    /// 0 = none. The plan sets it for the small chunk graph (`V2Spec::small_chunk_span`).
    pub chunk_span: usize,
    /// Contract v2's step graph and the embedding function write their results into buffers
    /// the caller passes after the tensors (`iree.abi.output = N`), and keep their transients
    /// in one more (`iree.abi.transients`): such a call allocates nothing on the device's
    /// queue, where each allocation made every Vulkan call wait on the host for the call
    /// before it (`iree_runtime::StorageSpec`; docs/journal/sessions-30-34.md, session 31).
    pub caller_storage: bool,
}

/// The arguments through which a function takes its results' storage and its transients'
/// buffer from the caller ([`EmitOptions::caller_storage`]), after its `inputs` tensors.
fn storage_args(inputs: usize, results: &[String]) -> Vec<String> {
    let mut args: Vec<String> = results
        .iter()
        .enumerate()
        .map(|(i, ty)| format!("%arg{}: {ty} {{iree.abi.output = {i} : index}}", inputs + i))
        .collect();
    args.push(format!(
        "%arg{}: !hal.buffer {{iree.abi.transients}}",
        inputs + results.len()
    ));
    args
}

/// A `compilation_info` for IREE's SPIR-V SubgroupReduce pipeline (each output reduced by one
/// subgroup): the op's `tile_sizes` (a workgroup's outputs, then the reduction's tile) and the
/// threads of a workgroup.
fn subgroup_reduce_info(tile_sizes: &str, workgroup: usize) -> String {
    crate::templates::SUBGROUP_REDUCE_INFO.fill(&[("TILE_SIZES", tile_sizes), ("WORKGROUP", &workgroup.to_string())])
}

/// The MLIR module with the single function of `graph`.
pub fn emit(manifest: &Manifest, graph: Graph, options: &EmitOptions) -> Result<String, ExportError> {
    emit_module(manifest, &[graph], options)
}

/// One MLIR module holding the functions of `graphs`, all sharing one set of parameter globals.
pub fn emit_module(manifest: &Manifest, graphs: &[Graph], options: &EmitOptions) -> Result<String, ExportError> {
    let arch = manifest.require_architecture().map_err(ExportError::Core)?.clone();
    let spec = manifest.spec.clone();
    spec.validate().map_err(ExportError::Core)?;
    let (table, _) = archive_table(&spec, &arch, options.quantization.as_ref(), manifest.fusion());
    let table: HashMap<String, ParamInfo> = table.into_iter().map(|p| (p.name.clone(), p)).collect();
    if options.weights == WeightFormat::PackedI32 {
        if let Some(p) = table.values().find(|p| p.shape.last().is_some_and(|n| n % 2 != 0)) {
            return Err(ExportError::Unsupported(format!(
                "parameter `{}` {:?} has an odd last dimension; PackedI32 needs pairs of bf16 (use WeightFormat::Bf16)",
                p.name, p.shape
            )));
        }
    }
    if let Some(q) = &options.quantization {
        for name in q.tensors.keys() {
            match table.get(name) {
                Some(p) if kv_core::quant::quantizable(p) => {}
                other => {
                    return Err(ExportError::Unsupported(format!(
                        "quantized parameter `{name}` {:?}: only [out, in] matrices with in a multiple of {BLOCK} are",
                        other.map(|p| &p.shape)
                    )))
                }
            }
        }
    }
    let mut module_name: Option<String> = None;
    let mut globals: BTreeMap<String, String> = BTreeMap::new();
    let mut funcs = String::new();
    for &graph in graphs {
        let qualified = manifest
            .functions
            .get(graph)
            .map(str::to_string)
            .unwrap_or_else(|| format!("module.{}{}", arch.family.default_prefix(), graph.function_suffix()));
        // v2's prefill graph reads `prefillSpan` rows of each cache, its token-less variants
        // their own spans (`KvSpec::prefill_spans`).
        let mut variants = vec![(qualified.clone(), 0, true)];
        if let (Graph::Prefill, Some(v2)) = (graph, manifest.v2()) {
            variants[0].1 = v2.prefill_span;
            for &s in &v2.prefill_spans {
                variants.push((format!("{qualified}_span{s}"), s, false));
            }
        }
        if let (Graph::Chunk, Some(_), s @ 1..) = (graph, manifest.v2(), options.chunk_span) {
            variants.push((format!("{qualified}_span{s}"), s, true));
        }
        for (qualified, span, token) in variants {
            let (module, func) = qualified.rsplit_once('.').unwrap_or(("module", qualified.as_str()));
            match &module_name {
                None => module_name = Some(module.to_string()),
                Some(m) if m != module => {
                    return Err(ExportError::Unsupported(format!(
                        "functions of one module must share the module name: `{m}` and `{module}`"
                    )))
                }
                _ => {}
            }
            let (spanned, layout) = match manifest.v2() {
                Some(v2) if span != 0 => {
                    let (spec, layout) = v2.spanned(&spec, span);
                    (spec, Some(layout))
                }
                v2 => (spec.clone(), v2.cloned()),
            };
            let fuse_widening = rows_of(&spec, manifest.v2(), graph, options) == 1;
            let mut f = FuncEmitter::new(
                &spanned,
                layout.as_ref(),
                &arch,
                options,
                &table,
                manifest,
                fuse_widening,
                &mut globals,
            );
            let text = f.function(manifest, graph, func, token)?;
            funcs.push_str(&text);
        }
    }
    if let (true, Some(qualified)) = (graphs.contains(&Graph::Step), &manifest.embed_function) {
        let (module, func) = qualified.rsplit_once('.').unwrap_or(("module", qualified.as_str()));
        if module_name.as_deref().is_some_and(|m| m != module) {
            return Err(ExportError::Unsupported(format!(
                "embedFunction `{qualified}`: a function of the step graph's module"
            )));
        }
        let mut f = FuncEmitter::new(
            &spec,
            manifest.v2(),
            &arch,
            options,
            &table,
            manifest,
            true,
            &mut globals,
        );
        funcs.push_str(&f.embed_function(func));
    }
    let mut out = String::new();
    writeln!(out, "module @{} {{", module_name.unwrap_or_else(|| "module".into())).unwrap();
    for decl in globals.values() {
        writeln!(out, "  {decl}").unwrap();
    }
    out.push_str(&funcs);
    out.push_str("}\n");
    Ok(out)
}

/// The sequence length of a graph's fixed-size token axis (rows `R`).
fn rows_of(spec: &KvSpec, v2: Option<&V2Spec>, graph: Graph, options: &EmitOptions) -> usize {
    match (graph, v2) {
        // Contract v2's prefill is a chunk graph of `prefillChunk` rows.
        (Graph::Prefill, Some(v2)) if v2.prefill_chunk > 0 => v2.prefill_chunk,
        _ => rows_of_v1(spec, graph, options),
    }
}

fn rows_of_v1(spec: &KvSpec, graph: Graph, options: &EmitOptions) -> usize {
    match graph {
        Graph::Prefill => spec.seq,
        Graph::Chunk => spec.chunk,
        Graph::Step => 1,
        Graph::Redecode | Graph::RedecodeAt => options.redecode_seq.unwrap_or(spec.seq),
    }
}

fn dyn_dim() -> Dim {
    Dim::D(String::new())
}

/// The type of a named argument of `graph` (CONTRACT §2, §3; `docs/contract-v2.md` when `v2`).
/// `spec` and `layout`: the manifest's, or the geometry and layout of a graph reading a span of
/// each cache ([`V2Spec::spanned`]).
fn arg_type(
    manifest: &Manifest,
    spec: &KvSpec,
    layout: Option<&V2Spec>,
    graph: Graph,
    name: Name,
    rows: usize,
) -> Result<Ty, ExportError> {
    let v2 = layout.is_some();
    let (h, d, nkv) = (spec.hidden_size, spec.head_dim, spec.n_kv_heads);
    let ty = match name {
        Name::Pos if v2 => Ty::fixed(&[1], Elem::I32),
        Name::K(l) | Name::V(l) if v2 => Ty::fixed(
            &[
                layout.map_or(spec.max_positions, |v| v.cache_rows(spec, spec.layer_kind(l))),
                nkv,
                d,
            ],
            cache_elem(manifest.cache_type),
        ),
        Name::Tokens if graph == Graph::Redecode || graph == Graph::RedecodeAt => Ty::fixed(&[1, rows], Elem::I32),
        Name::Tokens | Name::Token => Ty::fixed(&[rows], Elem::I32),
        Name::Emb => Ty::fixed(&[rows, h], Elem::F32),
        Name::Select => Ty::fixed(&[1, rows], Elem::F32),
        Name::Allowed if v2 => Ty::fixed(
            &[kv_core::allowed::AllowedTokens::words_for(spec.vocab_size)],
            Elem::I32,
        ),
        Name::Cos(_) | Name::Sin(_) => Ty::fixed(&[rows, d], Elem::F32),
        Name::Mask(_) if !v2 => Ty::new(
            vec![Dim::S(1), Dim::S(spec.mask_head_count()), Dim::S(rows), dyn_dim()],
            Elem::F32,
        ),
        Name::K(_) | Name::V(_) => Ty::new(vec![Dim::S(1), Dim::S(nkv), dyn_dim(), Dim::S(d)], Elem::F32),
        other @ (Name::Ids | Name::Pos | Name::Mask(_) | Name::TopKLogits | Name::TopKIds | Name::Allowed) => {
            return Err(ExportError::Unsupported(format!(
                "unknown argument `{other}` of graph {}",
                graph.key()
            )))
        }
    };
    Ok(ty)
}

/// The graph element type of a contract v2 cache.
fn cache_elem(ty: CacheType) -> Elem {
    match ty {
        CacheType::F32 => Elem::F32,
        CacheType::F16 => Elem::F16,
    }
}

struct FuncEmitter<'a> {
    spec: &'a KvSpec,
    /// Contract v2's cache layout of the graph being emitted (spanned as `spec` is); `None`: v1.
    v2: Option<&'a V2Spec>,
    arch: &'a Architecture,
    options: &'a EmitOptions,
    table: &'a HashMap<String, ParamInfo>,
    scope: &'a str,
    b: Body,
    /// Widened (f32) weights already loaded in this function.
    loaded: HashMap<String, V>,
    /// Whether the i16 widening may be fused into the matmuls that read a weight: only in
    /// one-row graphs (the step), where IREE makes it a vector-matrix product that streams the
    /// 16-bit weights. In the many-row graphs a fused widening takes IREE 3.13's SPIR-V matmul
    /// pipeline minutes per dispatch to compile, so there each projection widens inside its own
    /// contraction's body ([`Body::contract_i16`]). (Widening each weight apart, behind an
    /// `optimization_barrier`, cost one host round trip per weight on Vulkan: 236 per chunk
    /// call, ~700 of its ~800 ms on the H200, `docs/journal` session 9.)
    fuse_widening: bool,
    globals: &'a mut BTreeMap<String, String>,
}

impl<'a> FuncEmitter<'a> {
    /// The tuning of the configured one-row forms that read the weights as i16 (the LM head's,
    /// the step's normed products, the products writing the stream out): the one place that
    /// says "a tuned GPU family, with i16 weights"; packed weights keep IREE's forms.
    fn row_tuning(&self) -> Option<crate::profile::GpuTuning> {
        self.options
            .tuning
            .filter(|_| self.options.weights == WeightFormat::I16)
    }

    /// An emitter of one function of the module whose parameter globals are `globals`.
    #[allow(clippy::too_many_arguments)]
    fn new(
        spec: &'a KvSpec,
        v2: Option<&'a V2Spec>,
        arch: &'a Architecture,
        options: &'a EmitOptions,
        table: &'a HashMap<String, ParamInfo>,
        manifest: &'a Manifest,
        fuse_widening: bool,
        globals: &'a mut BTreeMap<String, String>,
    ) -> Self {
        FuncEmitter {
            spec,
            v2,
            arch,
            options,
            table,
            scope: &manifest.parameter_scope,
            b: Body::new(),
            loaded: HashMap::new(),
            fuse_widening,
            globals,
        }
    }

    /// The function `func` of `graph`; without `token`, its results but the token and top-k (a
    /// prefill's token-less variant: the LM head is never computed).
    fn function(&mut self, manifest: &Manifest, graph: Graph, func: &str, token: bool) -> Result<String, ExportError> {
        let spec = self.spec;
        let v2 = manifest.is_v2();
        if graph == Graph::Prefill && self.v2.is_some_and(|l| l.prefill_chunk == 0) {
            return Err(ExportError::Unsupported(
                "this contract v2 spec has no prefill graph (no prefillChunk: a prefill is chunk calls from position 0)".into(),
            ));
        }
        // v2's prefill graph is a chunk graph with more rows.
        let from_nothing = graph == Graph::Prefill && !v2;
        if !v2 && matches!(graph, Graph::Chunk | Graph::Step) && spec.n_heads < 2 {
            return Err(ExportError::Unsupported(
                "nHeads == 1: IREE 3.13 cannot compile the unit-batch attention over a dynamic past".into(),
            ));
        }
        let rows = rows_of(spec, self.v2, graph, self.options);
        let arg_names = manifest.args_or_canonical(graph);
        let mut out_names = manifest.outputs_or_canonical(graph);
        if !token {
            out_names.retain(|n| !n.from_head());
        }
        let mut args: HashMap<Name, V> = HashMap::new();
        let mut sig = Vec::new();
        for (i, name) in arg_names.iter().enumerate() {
            let ty = arg_type(manifest, spec, self.v2, graph, *name, rows)?;
            sig.push(format!("%arg{i}: {}", ty.text()));
            let v = V {
                name: format!("%arg{i}"),
                ty,
            };
            let v = self.b.refresh_dims(v);
            args.insert(*name, v);
        }
        let arg = |name: Name| -> Result<V, ExportError> {
            args.get(&name)
                .cloned()
                .ok_or_else(|| ExportError::Unsupported(format!("graph {} lacks argument `{name}`", graph.key())))
        };

        let mut outs: HashMap<Name, V> = HashMap::new();
        match graph {
            Graph::Prefill | Graph::Chunk | Graph::Step => {
                let emb = arg(Name::Emb)?;
                let mut x = Residual::settled(self.embed_scale(&emb));
                let mut tables: HashMap<LayerKind, (V, V)> = HashMap::new();
                let mut masks: HashMap<LayerKind, V> = HashMap::new();
                let mut masks_v2: HashMap<LayerKind, (V, V)> = HashMap::new();
                let pos = if v2 { Some(arg(Name::Pos)?) } else { None };
                for kind in spec.kinds_present() {
                    let t = if from_nothing {
                        self.const_rope(kind, rows)
                    } else {
                        (arg(Name::Cos(kind))?, arg(Name::Sin(kind))?)
                    };
                    tables.insert(kind, t);
                    if let Some(pos) = &pos {
                        masks_v2.insert(kind, self.v2_masks(pos, rows, kind));
                    } else if graph == Graph::Chunk {
                        masks.insert(kind, arg(Name::Mask(kind))?);
                    }
                }
                for l in 0..spec.n_layers {
                    let kind = spec.layer_kind(l);
                    let past = if from_nothing {
                        None
                    } else {
                        Some((arg(Name::K(l))?, arg(Name::V(l))?))
                    };
                    let mask = match graph {
                        _ if v2 => {
                            let (cache, new) = masks_v2[&kind].clone();
                            MaskIn::V2 { cache, new }
                        }
                        Graph::Prefill => MaskIn::InGraph(spec.window(kind)),
                        Graph::Chunk => MaskIn::Arg(masks[&kind].clone()),
                        _ => MaskIn::None,
                    };
                    let (cos, sin) = tables[&kind].clone();
                    let (nx, k, v) = self.layer(l, &x, &cos, &sin, past, mask);
                    x = nx;
                    outs.insert(Name::K(l), k);
                    outs.insert(Name::V(l), v);
                }
                let select = match graph {
                    Graph::Step => None,
                    _ => Some(arg(Name::Select)?),
                };
                let logits = self.head_logits_of(&x, select.as_ref());
                // Every argmax and top-k form below reads the masked logits, so none of them
                // needs a masked variant of its own (the NVIDIA head product, the staged argmax).
                let logits = match args.get(&Name::Allowed) {
                    Some(allowed) => self.b.allowed_logits(&logits, allowed),
                    None => logits,
                };
                let token = self.argmax(&logits);
                outs.insert(Name::Token, token);
                // Opt-in: a reduction over the vocabulary per call, slow on some GPUs.
                if let Some(k) = manifest.top_k {
                    let (values, ids) = self.b.top_k(&logits, k);
                    let values = self.b.reshape_static(&values, &[k]);
                    let ids = self.b.reshape_static(&ids, &[k]);
                    outs.insert(Name::TopKLogits, values);
                    outs.insert(Name::TopKIds, ids);
                }
            }
            Graph::Redecode | Graph::RedecodeAt => {
                let tokens = arg(Name::Tokens)?;
                let flat = self.b.reshape_static(&tokens, &[rows]);
                let emb = self.embedding_rows(&flat);
                let mut x = Residual::settled(self.embed_scale(&emb));
                let mut tables: HashMap<LayerKind, (V, V)> = HashMap::new();
                for kind in spec.kinds_present() {
                    let t = self.const_rope(kind, rows);
                    tables.insert(kind, t);
                }
                for l in 0..spec.n_layers {
                    let kind = spec.layer_kind(l);
                    let (cos, sin) = tables[&kind].clone();
                    let (nx, _, _) = self.layer(l, &x, &cos, &sin, None, MaskIn::InGraph(spec.window(kind)));
                    x = nx;
                }
                let x = self.settle(&x);
                if graph == Graph::RedecodeAt {
                    let select = arg(Name::Select)?;
                    let token = self.head_token(&x, Some(&select));
                    outs.insert(Name::Token, token);
                } else {
                    let logits = self.logits(&x);
                    let ids = self.argmax(&logits);
                    outs.insert(Name::Ids, ids);
                }
            }
        }

        let mut ret_vals = Vec::new();
        let mut ret_types = Vec::new();
        for name in &out_names {
            let v = outs
                .get(name)
                .ok_or_else(|| ExportError::Unsupported(format!("graph {} has no result `{name}`", graph.key())))?;
            ret_vals.push(v.name.clone());
            ret_types.push(v.ty.text());
        }
        if graph == Graph::Step && self.v2.is_some() && self.options.caller_storage {
            sig.extend(storage_args(sig.len(), &ret_types));
        }
        let body = std::mem::take(&mut self.b).finish();
        let mut text = String::new();
        writeln!(
            text,
            "  func.func @{func}({}) -> ({}) {{",
            sig.join(", "),
            ret_types.join(", ")
        )
        .unwrap();
        text.push_str(&body);
        writeln!(text, "    return {} : {}", ret_vals.join(", "), ret_types.join(", ")).unwrap();
        text.push_str("  }\n");
        Ok(text)
    }

    /// `func(token [1] i32) -> [1, hidden] f32`: the embedding row of a token, as the host
    /// gathers it (`Manifest::embed_function`).
    fn embed_function(&mut self, func: &str) -> String {
        let token = V {
            name: "%arg0".into(),
            ty: Ty::fixed(&[1], Elem::I32),
        };
        let row = self.embedding_rows(&token);
        let body = std::mem::take(&mut self.b).finish();
        let (arg, ret) = (token.ty.text(), row.ty.text());
        let mut sig = vec![format!("%arg0: {arg}")];
        if self.v2.is_some() && self.options.caller_storage {
            sig.extend(storage_args(1, std::slice::from_ref(&ret)));
        }
        format!(
            "  func.func @{func}({}) -> {ret} {{\n{body}    return {} : {ret}\n  }}\n",
            sig.join(", "),
            row.name
        )
    }
}
