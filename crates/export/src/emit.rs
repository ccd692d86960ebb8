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

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use kv_core::manifest::{CacheType, Name, V2Spec};
use kv_core::params::{archive_table, layer_param, ParamInfo, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use kv_core::quant::{scale_name, QuantFormat, ScaleType, BLOCK};
use kv_core::rope::RopeTable;
use kv_core::{Activation, Architecture, Graph, KvSpec, LayerKind, Manifest};

use crate::mlir::{Body, Dim, Elem, Reduce, Ty, V};
use crate::ExportError;

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
}

/// How IREE's SPIR-V code runs contract v2's one-row attention products against a cache head
/// `[P, d]` (SubgroupReduce: each output reduced by one subgroup): the scores, `keys` keys a
/// workgroup of `workgroup` threads, each reduced over `d`; the probabilities against the values,
/// `outputs` of the `d` outputs a workgroup, each reduced over the cache's `P` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionProducts {
    pub workgroup: usize,
    pub keys: usize,
    pub outputs: usize,
}

impl AttentionProducts {
    /// The `compilation_info` of a product over `(query row, output, reduced)` whose outputs go
    /// `per_workgroup` a workgroup, each reduced over `inner`.
    fn info(self, per_workgroup: usize, inner: usize) -> String {
        subgroup_reduce_info(&format!("[[1, {per_workgroup}], [0, 0, {inner}]]"), self.workgroup)
    }
}

/// A `compilation_info` for IREE's SPIR-V SubgroupReduce pipeline (each output reduced by one
/// subgroup): the op's `tile_sizes` (a workgroup's outputs, then the reduction's tile) and the
/// threads of a workgroup.
fn subgroup_reduce_info(tile_sizes: &str, workgroup: usize) -> String {
    format!(
        "#iree_codegen.compilation_info<lowering_config = #iree_codegen.lowering_config<tile_sizes = {tile_sizes}>, \
         translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.spirv_pipeline<SubgroupReduce> workgroup_size = [{workgroup}, 1, 1]>>"
    )
}

/// How IREE's SPIR-V code runs a one-row product `x [in] · W [out, in]ᵀ` (SubgroupReduce:
/// each output row reduced by one subgroup): `rows` output rows a workgroup of `workgroup`
/// threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowProducts {
    pub workgroup: usize,
    pub rows: usize,
}

impl RowProducts {
    /// The `compilation_info` attribute of a product whose rows are `inner` long.
    fn compilation_info(self, inner: usize) -> String {
        subgroup_reduce_info(&format!("[[{}], [0, {inner}]]", self.rows), self.workgroup)
    }
}

/// How IREE's SPIR-V code runs the one-row products as wide as the residual stream where they
/// also write the stream out (`FuncEmitter::proj_settling`): an output row a workgroup,
/// `per_thread` values of the row a thread (as IREE configures those products itself on NVIDIA
/// targets: 64 threads for rows of 1,024, 128 for 2,048).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamProducts {
    pub per_thread: usize,
}

impl StreamProducts {
    fn compilation_info(self, inner: usize) -> String {
        let threads = (inner / self.per_thread).next_multiple_of(32).clamp(32, 1024);
        subgroup_reduce_info(&format!("[[1], [0, {inner}]]"), threads)
    }
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
    let (table, _) = archive_table(&spec, &arch, options.quantization.as_ref(), manifest.fused_projections);
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

/// Quantized elements per `i32` word.
fn per_word(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q8 => 4,
        QuantFormat::Q4 => 8,
    }
}

/// The most rows a call may have for Gemma's Q/K norms and the rotation to be emitted as one
/// dispatch each ([`FuncEmitter::norm_rope`]): IREE 3.13's SPIR-V path fails on that form over
/// 1,024 rows ("failed to legalize operation 'memref.alloc'", a redecode graph of FunctionGemma's
/// geometry); it compiles at 128. Larger calls keep the norm, then the rotation.
const NORM_ROPE_MAX_ROWS: usize = 128;

/// `x [Q, P]` reduced over its last axis in tiles of `tile` keys, then across the tiles.
fn tiled_reduce(b: &mut Body, x: &V, kind: Reduce, tile: usize) -> V {
    let [q, p] = x.ty.static_dims()[..] else {
        kv_core::error::invariant("scores are [Q, P]")
    };
    let x3 = b.reshape_static(x, &[q, p / tile, tile]);
    let partial = b.reduce(&x3, &[2], kind);
    b.reduce(&partial, &[1], kind)
}

/// Keys per tile of contract v2's softmax over the cache ([`FuncEmitter::softmax_split`]).
const SOFTMAX_TILE: usize = 64;

/// Additive attention mask of a layer.
enum MaskIn {
    /// Causal (and windowed) over positions `0..R`, built in the graph.
    InGraph(Option<usize>),
    /// `[1, maskHeads, R, T]` handed in.
    Arg(V),
    /// The rows handed in are exactly the keys (step).
    None,
    /// Contract v2: which keys each stacked query row (`[group·R]`, row `g·R + i` is query row
    /// `i`) sees among the cache rows `[group·R, P]` and among the call's own rows
    /// `[group·R, R]`, as `i1`; built in the graph from `pos`.
    V2 { cache: V, new: V },
}

/// The residual stream between a layer's blocks: `base`, and in the one-row step of NVIDIA
/// Vulkan exports the last block's post-norm addition not yet made, `base + rmsnorm(delta,
/// weight)` as `(delta, weight's name)`. The next normed products take the sum apart
/// ([`FuncEmitter::normed_products`]) and the next product as wide as the stream writes it
/// out ([`FuncEmitter::proj_settling`]), so that the post-norm needs no dispatch of its own.
#[derive(Clone)]
struct Residual {
    base: V,
    pending: Option<(V, String)>,
}

impl Residual {
    fn settled(base: V) -> Self {
        Self { base, pending: None }
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

fn symbol(name: &str) -> String {
    let mut s = String::from("w_");
    s.extend(name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }));
    s
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
                let x = self.settle(&x);
                let select = match graph {
                    Graph::Step => None,
                    _ => Some(arg(Name::Select)?),
                };
                let logits = self.head_logits(&x, select.as_ref());
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
        format!(
            "  func.func @{func}(%arg0: {arg}) -> {ret} {{\n{body}    return {} : {ret}\n  }}\n",
            row.name
        )
    }

    // ---- weights ---------------------------------------------------------------------------

    /// The archive key of the canonical parameter `name` (the three-archive layout numbers them).
    fn archive_key(&self, name: &str) -> String {
        self.options
            .keys
            .as_ref()
            .and_then(|k| k.get(name))
            .cloned()
            .unwrap_or_else(|| name.to_string())
    }

    /// The parameter as declared (bf16 or packed i32), loaded from its global.
    fn load_raw(&mut self, name: &str) -> V {
        let info = self
            .table
            .get(name)
            .unwrap_or_else(|| kv_core::error::invariant(&format!("no parameter `{name}`")));
        let key = self.archive_key(name);
        let ty = match self.options.weights {
            WeightFormat::Bf16 => Ty::fixed(&info.shape, Elem::Bf16),
            WeightFormat::I16 => Ty::fixed(&info.shape, Elem::I16),
            WeightFormat::PackedI32 => {
                let mut dims = info.shape.clone();
                *dims.last_mut().unwrap() /= 2;
                Ty::fixed(&dims, Elem::I32)
            }
        };
        self.load_global(symbol(name), &key, ty)
    }

    /// bf16 (or packed pairs of bf16) widened exactly to f32.
    fn widen(&mut self, raw: &V) -> V {
        match raw.ty.elem {
            Elem::Bf16 => self.b.convert(raw, Elem::F32),
            Elem::I16 => {
                // The sign extension fills bits 16..32, which the shift discards.
                let wide = self.b.convert(raw, Elem::I32);
                let sixteen = self.b.splat_i32(16, &wide.ty);
                let bits = self.b.binary("shift_left", &wide, &sixteen);
                self.b.bitcast(&bits, Elem::F32)
            }
            Elem::I32 => {
                let dims = raw.ty.static_dims();
                let sixteen = self.b.splat_i32(16, &raw.ty);
                let lo = self.b.binary("shift_left", raw, &sixteen);
                let himask = self.b.splat_i32(-65536, &raw.ty);
                let hi = self.b.binary("and", raw, &himask);
                let lo = self.b.bitcast(&lo, Elem::F32);
                let hi = self.b.bitcast(&hi, Elem::F32);
                let mut pair_dims = dims.clone();
                pair_dims.push(1);
                let lo = self.b.reshape_static(&lo, &pair_dims);
                let hi = self.b.reshape_static(&hi, &pair_dims);
                let both = self.b.concat(&[lo, hi], dims.len());
                let mut full = dims;
                *full.last_mut().unwrap() *= 2;
                self.b.reshape_static(&both, &full)
            }
            other => kv_core::error::invariant(&format!("widen of {other:?}")),
        }
    }

    fn quant_format(&self, name: &str) -> Option<QuantFormat> {
        self.options.quantization.as_ref().and_then(|q| q.format_of(name))
    }

    /// The global of archive entry `key` (bound to parameter `sym_name`'s symbol) with type `ty`, loaded.
    fn load_global(&mut self, sym: String, key: &str, ty: Ty) -> V {
        self.globals.entry(sym.clone()).or_insert_with(|| {
            format!(
                "util.global private @{sym} = #flow.parameter.named<\"{}\"::\"{key}\"> : {}",
                self.scope,
                ty.text()
            )
        });
        self.b
            .op(ty.clone(), format!("util.global.load @{sym} : {}", ty.text()))
    }

    /// A block-quantized `[out, in]` parameter, loaded: values `[out, in/32, 32]` (`i8`, `i4`)
    /// and scales `[out, in/32]` as the archive stores them (f32 or f16, `kv_core::quant`).
    fn load_quant(&mut self, name: &str, format: QuantFormat) -> (V, V) {
        let info = self
            .table
            .get(name)
            .unwrap_or_else(|| kv_core::error::invariant(&format!("no parameter `{name}`")));
        let (out, inner) = (info.shape[0], info.shape[1]);
        let nb = inner / BLOCK;
        let key = self.archive_key(name);
        let q = if self.packed_quant() {
            let words = BLOCK / per_word(format);
            self.load_global(symbol(name), &key, Ty::fixed(&[out, nb, words], Elem::I32))
        } else {
            let elem = match format {
                QuantFormat::Q8 => Elem::I8,
                QuantFormat::Q4 => Elem::I4,
            };
            self.load_global(symbol(name), &key, Ty::fixed(&[out, nb, BLOCK], elem))
        };
        (q, self.load_scales(name))
    }

    /// The block scales `[out, in/32]` of quantized parameter `name`, as the archive stores them.
    fn load_scales(&mut self, name: &str) -> V {
        let shape = &self.table[name].shape;
        let (out, nb) = (shape[0], shape[1] / BLOCK);
        let key = self.archive_key(name);
        let scale_elem = match self.options.quantization.as_ref().map(|q| q.scale_type) {
            Some(ScaleType::F16) => Elem::F16,
            _ => Elem::F32,
        };
        self.load_global(
            format!("{}_scale", symbol(name)),
            &scale_name(&key),
            Ty::fixed(&[out, nb], scale_elem),
        )
    }

    /// Scales `s` as f32: f16 ones widened (exactly) by a `convert` of their own, which IREE fuses
    /// into the dispatch that reads them as it does the values' widening. Not inside a
    /// contraction's body: there the widening ran per element, and a one-row q8 matvec took
    /// 1.2–1.6× as long as with f32 scales on this CPU (`host` and `generic`); as a producer it
    /// takes as long as f32 scales (one dispatch, reading the f16 tensor).
    fn scales_f32(&mut self, s: &V) -> V {
        if s.ty.elem == Elem::F16 {
            self.b.convert(s, Elem::F32)
        } else {
            s.clone()
        }
    }

    /// Whether quantized values are declared as `i32` words: with the Vulkan weight formats
    /// ([`WeightFormat::PackedI32`], [`WeightFormat::I16`]), so no 8- or 4-bit type reaches the
    /// SPIR-V code generator; the CPU's ([`WeightFormat::Bf16`]) declares `i8` / `i4`.
    fn packed_quant(&self) -> bool {
        self.options.weights != WeightFormat::Bf16
    }

    /// Words `q [.., W] i32` of `format`'s values, unpacked (element `j` of word `w` is element
    /// `w·E + j`): `[.., W·E]` as f32, with i32 shifts only.
    fn unpack_words(&mut self, q: &V, format: QuantFormat) -> V {
        let e = per_word(format);
        let bits = (32 / e) as i32;
        let mut dims = q.ty.static_dims();
        let rank = dims.len();
        dims.push(e);
        let wide = Ty::fixed(&dims, Elem::I32);
        let keep: Vec<usize> = (0..rank).collect();
        let words = self.b.broadcast(q, &keep, &wide);
        let j = self.b.iota(&dims, rank, Elem::I32);
        let step = self.b.splat_i32(bits, &wide);
        let top = self.b.splat_i32(32 - bits, &wide);
        let sh = self.b.mul(&j, &step);
        let left = self.b.sub(&top, &sh);
        let up = self.b.binary("shift_left", &words, &left);
        let v = self.b.binary("shift_right_arithmetic", &up, &top);
        let f = self.b.convert(&v, Elem::F32);
        let mut flat = q.ty.static_dims();
        *flat.last_mut().unwrap() *= e;
        self.b.reshape_static(&f, &flat)
    }

    /// `f32(q) * scale` of values `q [.., nb, 32]` and scales `s [.., nb]`: elementwise from a
    /// narrower type with the scales broadcast from a lower rank, so IREE clones it into every
    /// consumer dispatch instead of materialising it (a "bit-extend" op).
    fn dequant_blocks(&mut self, q: &V, s: &V) -> V {
        let wide = if q.ty.elem == Elem::I32 {
            let format = if q.ty.static_dims().last() == Some(&(BLOCK / 4)) {
                QuantFormat::Q8
            } else {
                QuantFormat::Q4
            };
            self.unpack_words(q, format)
        } else {
            self.b.convert(q, Elem::F32)
        };
        let s = self.scales_f32(s);
        let keep: Vec<usize> = (0..s.ty.rank()).collect();
        let sb = self.b.broadcast(&s, &keep, &wide.ty);
        self.b.mul(&wide, &sb)
    }

    /// The dequantized `[out, in/32, 32]` f32 weight of a quantized parameter (once per function).
    fn quant_param(&mut self, name: &str, format: QuantFormat) -> V {
        let key = format!("{name}#dequant");
        if let Some(v) = self.loaded.get(&key) {
            return v.clone();
        }
        let (q, s) = self.load_quant(name, format);
        let w = self.dequant_blocks(&q, &s);
        self.loaded.insert(key, w.clone());
        w
    }

    fn param(&mut self, name: &str) -> V {
        if let Some(v) = self.loaded.get(name) {
            return v.clone();
        }
        if let Some(format) = self.quant_format(name) {
            // Only the projections read quantized parameters ([`Self::proj`]); a plain use gets
            // the whole dequantized matrix.
            let w = self.quant_param(name, format);
            let info = &self.table[name];
            let dims = info.shape.clone();
            let v = self.b.reshape_static(&w, &dims);
            self.loaded.insert(name.to_string(), v.clone());
            return v;
        }
        let raw = self.load_raw(name);
        let v = self.widen(&raw);
        self.loaded.insert(name.to_string(), v.clone());
        v
    }

    /// The parameter as declared, loaded once per function.
    fn raw_param(&mut self, name: &str) -> V {
        let key = format!("{name}#raw");
        if let Some(v) = self.loaded.get(&key) {
            return v.clone();
        }
        let v = self.load_raw(name);
        self.loaded.insert(key, v.clone());
        v
    }

    /// The embedding rows of `tokens [n] i32`, f32 `[n, hidden]`, gathered in the graph.
    fn embedding_rows(&mut self, tokens: &V) -> V {
        match self.quant_format(TOKEN_EMBD) {
            None => {
                let raw = self.load_raw(TOKEN_EMBD);
                let rows_raw = self.b.gather_rows(&raw, tokens);
                self.widen(&rows_raw)
            }
            Some(format) => {
                let (q, s) = self.load_quant(TOKEN_EMBD, format);
                let [vocab, nb, blk] = q.ty.static_dims()[..] else {
                    kv_core::error::invariant("quantized values are [out, nb, 32]")
                };
                let n = tokens.ty.static_dims()[0];
                let q2 = self.b.reshape_static(&q, &[vocab, nb * blk]);
                let rows_q = self.b.gather_rows(&q2, tokens);
                let rows_q = self.b.reshape_static(&rows_q, &[n, nb, blk]);
                // (words when packed: `blk` is then the words per block)
                let rows_s = self.b.gather_rows(&s, tokens);
                let rows = self.dequant_blocks(&rows_q, &rows_s);
                self.b.reshape_static(&rows, &[n, nb * BLOCK])
            }
        }
    }

    // ---- building blocks -------------------------------------------------------------------

    fn embed_scale(&mut self, emb: &V) -> V {
        if self.arch.embed_scale == 1.0 {
            emb.clone()
        } else {
            self.b.scale(emb, self.arch.embed_scale)
        }
    }

    fn const_rope(&mut self, kind: LayerKind, rows: usize) -> (V, V) {
        let d = self.spec.head_dim;
        let t = RopeTable::new(0, rows, d, self.spec.rope_base(kind));
        (
            self.b.const_f32(&[rows, d], &t.cos),
            self.b.const_f32(&[rows, d], &t.sin),
        )
    }

    /// `rsqrt(mean(x²) + eps)` over the last axis of `x`: one factor per row.
    fn rms_factor(&mut self, x: &V) -> V {
        let last = x.ty.rank() - 1;
        let n = x.ty.static_dims()[last];
        let sq = self.b.mul(x, x);
        let sum = self.b.reduce(&sq, &[last], Reduce::Add);
        self.rms_from_sum(&sum, n)
    }

    /// [`Self::rms_factor`] for each element of `x [.., n]` (the same within a row), summed in
    /// two reductions that each give IREE parallel outputs: runs of 32 squares (`[.., n/32]`),
    /// then, for every element, the runs of its row (`[.., n]`). On a target without subgroup
    /// operations IREE runs a reduction to one value, and whatever is fused after it, on one
    /// thread: a 640-wide norm took 240 µs on the H200 as one loop; here no loop is longer
    /// than 32. `None` where `n` has no runs to make.
    fn rms_factor_parallel(&mut self, x: &V) -> Option<V> {
        let dims = x.ty.static_dims();
        let last = dims.len() - 1;
        let n = dims[last];
        if n % 32 != 0 || n <= 32 {
            return None;
        }
        let sq = self.b.mul(x, x);
        let mut runs = dims.clone();
        runs[last] = n / 32;
        runs.push(32);
        let sq = self.b.reshape_static(&sq, &runs);
        let partial = self.b.reduce(&sq, &[last + 1], Reduce::Add);
        let mut each = dims.clone();
        each.push(n / 32);
        let keep: Vec<usize> = (0..last).chain([last + 1]).collect();
        let spread = self.b.broadcast(&partial, &keep, &Ty::fixed(&each, Elem::F32));
        let sum = self.b.reduce(&spread, &[last + 1], Reduce::Add);
        Some(self.rms_from_sum(&sum, n))
    }

    /// `rsqrt(sum / n + eps)`: the RMS norm's factor from the sum of `n` squares.
    fn rms_from_sum(&mut self, sum: &V, n: usize) -> V {
        let count = self.b.splat_f32(n as f32, &sum.ty);
        let mean = self.b.div(sum, &count);
        let eps = self.b.splat_f32(self.arch.rms_eps, &mean.ty);
        let var = self.b.add(&mean, &eps);
        self.b.unary("rsqrt", &var)
    }

    /// `x * rsqrt(mean(x²) + eps) * w` over the last axis; `w` is broadcast along the last axis.
    fn rmsnorm(&mut self, x: &V, w: &V) -> V {
        let rank = x.ty.rank();
        let parallel = self.pairs_in_place(x.ty.static_dims()[0]);
        let rb = match parallel.then(|| self.rms_factor_parallel(x)).flatten() {
            Some(r) => r,
            None => {
                let r = self.rms_factor(x);
                let keep: Vec<usize> = (0..rank - 1).collect();
                self.b.broadcast(&r, &keep, &x.ty)
            }
        };
        let y = self.b.mul(x, &rb);
        let wb = self.b.broadcast(w, &[rank - 1], &x.ty);
        self.b.mul(&y, &wb)
    }

    fn norm_param(&mut self, x: &V, name: &str) -> V {
        let w = self.param(name);
        self.rmsnorm(x, &w)
    }

    /// Whether a product of `rows` rows reads packed pairs in place ([`Body::contract_pairs_split`])
    /// rather than widening the weight first: the step, and the chunk graph's few rows, whose
    /// products IREE's default Vulkan target runs as reductions; the many-row graphs keep the
    /// widened weight, which its matmul pipeline tiles.
    fn pairs_in_place(&self, rows: usize) -> bool {
        self.options.weights == WeightFormat::PackedI32 && rows <= PAIR_ROWS_MAX
    }

    /// `x · Wᵀ` for `x [R, in]`, `W [out, in]`.
    fn proj(&mut self, x: &V, weight: &str) -> V {
        if let Some(format) = self.quant_format(weight) {
            let [r, inner] = x.ty.static_dims()[..] else {
                kv_core::error::invariant("a projection's input is [R, in]")
            };
            let x3 = self.b.reshape_static(x, &[r, inner / BLOCK, BLOCK]);
            if self.packed_quant() {
                let e = per_word(format);
                let x4 = self.b.reshape_static(x, &[r, inner / BLOCK, BLOCK / e, e]);
                let (q, s) = self.load_quant(weight, format);
                self.b.block_contract_words(&x4, &q, &s, (32 / e) as u32)
            } else if r == 1 && format == QuantFormat::Q4 && self.options.q4_kernel {
                self.q4_kernel_product(x, weight)
            } else if r == 1 || !self.options.fused_dequant {
                // A vector-matrix product (the step, every head): the dequantization in the
                // contraction's own body, one dispatch whatever the fusion flags.
                let (q, s) = self.load_quant(weight, format);
                let s = self.scales_f32(&s);
                self.b.block_contract_q(&x3, &q, &s)
            } else {
                // Many rows: a matmul to IREE. q8 as a `dot_general` over the blocks: data
                // tiling runs it on the mmt4d ukernels with the dequantization fused into the
                // weight's pack (Gemma 3 270M, bench, 3 rounds alternating: chunk call 68–74 →
                // 56–72 ms, utterance p50 304–345 → 267–314 ms). q4 keeps the two-reduction
                // generic (a generic matmul after a separate dequantization): the i4 unpacking
                // in the pack made its chunk calls 76–82 → 130–188 ms. Both write an f32 copy
                // of the weight per call (docs/journal, session 11).
                let w = self.quant_param(weight, format);
                match format {
                    QuantFormat::Q8 => self.b.dot(&x3, &w, (&[], &[]), (&[1, 2], &[1, 2])),
                    QuantFormat::Q4 => self.b.block_contract(&x3, &w),
                }
            }
        } else if self.options.bf16_matmul_inputs && self.options.weights == WeightFormat::Bf16 {
            // bf16 × bf16 products are exact in f32, so this differs from f32 × f32 only by the
            // rounding of `x` (and the summation order).
            let w = self.raw_param(weight);
            let xb = self.b.convert(x, Elem::Bf16);
            self.b.dot(&xb, &w, (&[], &[]), (&[1], &[1]))
        } else if self.options.weights == WeightFormat::I16 && !self.fuse_widening {
            let w = self.raw_param(weight);
            self.b.contract_i16(x, &w)
        } else if self.pairs_in_place(x.ty.static_dims()[0]) {
            // Few rows (the step, chunk calls): the words read inside the product, in runs.
            let w = self.raw_param(weight);
            let [o, words] = w.ty.static_dims()[..] else {
                kv_core::error::invariant("a packed weight is [out, in/2]")
            };
            self.b.contract_pairs_split(x, &w, pair_splits(o, words))
        } else {
            let w = self.param(weight);
            self.b.dot(x, &w, (&[], &[]), (&[1], &[1]))
        }
    }

    /// `x [1, in] · dequant(W)ᵀ` of a q4 parameter `[out, in]` by [`crate::kernels::Q4_MATVEC`]:
    /// the archive's values as bytes and its f16 scales, flattened, passed to an executable of
    /// this shape (declared once per module, beside the globals).
    fn q4_kernel_product(&mut self, x: &V, weight: &str) -> V {
        let shape = &self.table[weight].shape;
        let (out, inner) = (shape[0], shape[1]);
        let key = self.archive_key(weight);
        let bytes = out * inner / 2;
        let q = self.load_global(format!("{}_bytes", symbol(weight)), &key, Ty::fixed(&[bytes], Elem::I8));
        let s = self.load_scales(weight);
        let scales = out * inner / BLOCK;
        let s = self.b.reshape_static(&s, &[scales]);
        let xv = self.b.reshape_static(x, &[inner]);
        let executable = crate::kernels::q4_matvec_executable(out, inner);
        // In the module-level map beside the globals ("~" sorts it after their names).
        self.globals
            .entry(format!("~{}", executable.name))
            .or_insert(executable.text);
        let ty = Ty::fixed(&[out], Elem::F32);
        let rows = self.b.fresh();
        self.b.line(format!("{rows} = arith.constant {out} : index"));
        let o = self.b.op(
            ty.clone(),
            format!(
                "flow.dispatch {}[{rows}]({}, {}, {}) : ({}, {}, {}) -> {}",
                executable.entry,
                xv.name,
                q.name,
                s.name,
                xv.ty.text(),
                q.ty.text(),
                s.ty.text(),
                ty.text()
            ),
        );
        self.b.reshape_static(&o, &[1, out])
    }

    /// `x [R, in]` through layer `l`'s projections `parts` (of `rows` output rows each) and, when
    /// `biases` names them, their biases: one product when the archive holds the parts fused as
    /// `fused` (`kv_core::params::FUSED_PROJECTIONS`), its columns then split; `[R, rows]` each.
    fn projections(
        &mut self,
        x: &V,
        l: usize,
        (fused, parts): (&str, &[&str]),
        rows: &[usize],
        biases: Option<(&str, &[&str])>,
    ) -> Vec<V> {
        let fused_bias = biases
            .map(|(f, _)| layer_param(l, f))
            .filter(|b| self.table.contains_key(b));
        let fused_weight = layer_param(l, fused);
        if !self.table.contains_key(&fused_weight) {
            return parts
                .iter()
                .enumerate()
                .map(|(i, part)| {
                    let y = self.proj(x, &layer_param(l, part));
                    match (&fused_bias, biases) {
                        (None, Some((_, names))) => self.add_bias(&y, &layer_param(l, names[i])),
                        // The weights' formats differ (not fused), the biases' never do.
                        (Some(b), _) => {
                            let start: usize = rows[..i].iter().sum();
                            let bv = self.param(b);
                            let bv = self.b.slice(&bv, &[(start, start + rows[i])]);
                            let bb = self.b.broadcast(&bv, &[1], &y.ty);
                            self.b.add(&y, &bb)
                        }
                        (None, None) => y,
                    }
                })
                .collect();
        }
        let mut y = self.proj(x, &fused_weight);
        match (&fused_bias, biases) {
            (Some(b), _) => y = self.add_bias(&y, b),
            // (biases are never quantized, so a fused archive fuses them with any weights)
            (None, Some(_)) => kv_core::error::invariant("fused projections with their biases apart"),
            (None, None) => {}
        }
        let r = x.ty.static_dims()[0];
        let mut start = 0;
        rows.iter()
            .map(|&n| {
                let part = self.b.slice(&y, &[(0, r), (start, start + n)]);
                start += n;
                part
            })
            .collect()
    }

    fn add_bias(&mut self, y: &V, bias: &str) -> V {
        let bv = self.param(bias);
        let bb = self.b.broadcast(&bv, &[1], &y.ty);
        self.b.add(y, &bb)
    }

    /// `x·cos + swap_halves(x)·sin` on `x [R, heads, d]` with tables `[R, d]`.
    fn rope(&mut self, x: &V, cos: &V, sin: &V) -> V {
        let cb = self.b.broadcast(cos, &[0, 2], &x.ty);
        let sb = self.b.broadcast(sin, &[0, 2], &x.ty);
        let swapped = self.swap_halves(x);
        let a = self.b.mul(x, &cb);
        let s = self.b.mul(&swapped, &sb);
        self.b.add(&a, &s)
    }

    /// `x [R, heads, d]` with the two halves of each head exchanged. A `reverse` over the halves
    /// (an elementwise read at another index, which IREE fuses into the consumer), not slices
    /// and a `concatenate`, which were two copy dispatches per call site (`slow_memcpy`).
    fn swap_halves(&mut self, x: &V) -> V {
        let [r, h, d] = x.ty.static_dims()[..] else {
            kv_core::error::invariant("rotary inputs are [R, heads, d]")
        };
        let halves = self.b.reshape_static(x, &[r, h, 2, d / 2]);
        let swapped = self.b.reverse(&halves, &[2]);
        self.b.reshape_static(&swapped, &[r, h, d])
    }

    /// `rope(rmsnorm(x, w))` on `x [R, heads, d]` (Gemma's per-head Q/K norms), with the norm's
    /// per-head factor `rsqrt(mean(x²) + eps)` applied last: it is constant within a head, so
    /// it commutes with the rotation. Then the rotation reads only `x` and the weight, and IREE
    /// forms the reduction and everything after it as one dispatch (the rotation of the
    /// normalized tensor was three: the normalization, a copy of it, the rotation). Equal to
    /// the two steps up to float rounding.
    fn norm_rope(&mut self, x: &V, w: &str, cos: &V, sin: &V) -> V {
        let w = self.param(w);
        let d = x.ty.static_dims()[2];
        let r = self.rms_factor(x);
        // rope(x·w) = x·w·cos + swap(x)·swap(w)·sin: each factor read from an input of the
        // dispatch (a swap of an intermediate product is materialised first).
        let halves = self.b.reshape_static(&w, &[2, d / 2]);
        let w_swapped = self.b.reverse(&halves, &[0]);
        let w_swapped = self.b.reshape_static(&w_swapped, &[d]);
        let wb = self.b.broadcast(&w, &[2], &x.ty);
        let wsb = self.b.broadcast(&w_swapped, &[2], &x.ty);
        let cb = self.b.broadcast(cos, &[0, 2], &x.ty);
        let sb = self.b.broadcast(sin, &[0, 2], &x.ty);
        let xw = self.b.mul(x, &wb);
        let a = self.b.mul(&xw, &cb);
        let swapped = self.swap_halves(x);
        let sw = self.b.mul(&swapped, &wsb);
        let s = self.b.mul(&sw, &sb);
        let rotated = self.b.add(&a, &s);
        let rb = self.b.broadcast(&r, &[0, 1], &x.ty);
        self.b.mul(&rotated, &rb)
    }

    /// `[1, nKV, T, d]` → `[nHeads, T, d]`: query head `h` gets KV head `h / (nHeads / nKV)`.
    fn repeat_kv(&mut self, kv: &V) -> V {
        let (nh, nkv) = (self.spec.n_heads, self.spec.n_kv_heads);
        let group = nh / nkv;
        let t = kv.ty.dims[2].clone();
        let d = self.spec.head_dim;
        let heads = self.b.reduce_unit(kv, &[0]);
        let target = Ty::new(vec![Dim::S(group), t.clone(), Dim::S(d)], Elem::F32);
        if nkv == 1 {
            let one = self.b.reduce_unit(&heads, &[0]);
            let full = Ty::new(vec![Dim::S(nh), t, Dim::S(d)], Elem::F32);
            return self.b.broadcast(&one, &[1, 2], &full);
        }
        let mut parts = Vec::with_capacity(nkv);
        for j in 0..nkv {
            let s = self.b.dyn_slice(&heads, 0, j, j + 1);
            let one = self.b.reduce_unit(&s, &[0]);
            parts.push(self.b.broadcast(&one, &[1, 2], &target));
        }
        self.b.concat(&parts, 0)
    }

    /// Softmax over the last axis (the keys), shifted by the row maximum.
    fn softmax_last(&mut self, scores: &V) -> V {
        let last = scores.ty.rank() - 1;
        let rows: Vec<usize> = (0..last).collect();
        let max = self.b.reduce(scores, &[last], Reduce::Max);
        let maxb = self.b.broadcast(&max, &rows, &scores.ty);
        let shifted = self.b.sub(scores, &maxb);
        let e = self.b.unary("exponential", &shifted);
        let sum = self.b.reduce(&e, &[last], Reduce::Add);
        let sumb = self.b.broadcast(&sum, &rows, &scores.ty);
        self.b.div(&e, &sumb)
    }

    /// The additive causal (and windowed) mask `[R, T]` of query rows `0..R` over keys `0..T`.
    fn causal_mask(&mut self, r: usize, t: usize, window: Option<usize>) -> V {
        let qpos = self.b.iota(&[r, t], 0, Elem::I32);
        let kpos = self.b.iota(&[r, t], 1, Elem::I32);
        let mut attend = self.b.compare("LE", &kpos, &qpos);
        if let Some(w) = window {
            let wv = self.b.splat_i32(w as i32, &kpos.ty);
            let shifted = self.b.add(&kpos, &wv);
            let inside = self.b.compare("GT", &shifted, &qpos);
            attend = self.b.binary("and", &attend, &inside);
        }
        let zero = self.b.splat_f32(0.0, &qpos.ty);
        let masked = self.b.splat_f32(kv_core::mask::MASKED, &qpos.ty);
        self.b.select(&attend, &zero, &masked)
    }

    /// Attention for grouped queries (several KV heads, several query heads each): per KV head,
    /// its query heads stacked as rows `[group·R, d]` against that head's keys `[T, d]`, so keys
    /// and values are read in place instead of copied once per query head (the copy made
    /// SmolLM2's decode 4.5× slower at 843 past rows than at 20). Static reshapes only: IREE 3.13
    /// rejects dynamic ones. Same inputs and result as [`Self::attention`].
    fn grouped_attention(&mut self, q: &V, k: &V, v: &V, mask: MaskIn) -> V {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let group = nh / nkv;
        let r = q.ty.static_dims()[0];
        let qh = self.b.transpose(q, &[1, 0, 2]);
        let kh = self.b.reduce_unit(k, &[0]);
        let vh = self.b.reduce_unit(v, &[0]);
        // The mask rows every query head shares, `[R, T]`; per-head masks are sliced per group.
        let shared = match &mask {
            MaskIn::InGraph(window) => {
                let t = kh.ty.static_dims()[1];
                Some(self.causal_mask(r, t, *window))
            }
            MaskIn::Arg(m) if self.spec.mask_head_count() == 1 => Some(self.b.reduce_unit(m, &[0, 1])),
            _ => None,
        };
        let per_head = match &mask {
            MaskIn::Arg(m) if shared.is_none() => Some(self.b.reduce_unit(m, &[0])),
            _ => None,
        };
        let mut outs = Vec::with_capacity(nkv);
        for j in 0..nkv {
            let qj = self.b.slice(&qh, &[(j * group, (j + 1) * group), (0, r), (0, d)]);
            let qj = self.b.reshape_static(&qj, &[group * r, d]);
            let kj = self.b.dyn_slice(&kh, 0, j, j + 1);
            let kj = self.b.reduce_unit(&kj, &[0]);
            let vj = self.b.dyn_slice(&vh, 0, j, j + 1);
            let vj = self.b.reduce_unit(&vj, &[0]);
            let scores = self.b.dot(&qj, &kj, (&[], &[]), (&[1], &[1]));
            // Row g·R + i of this group is query head j·group + g at query row i.
            let rows = match (&shared, &per_head) {
                (Some(rt), _) => Some(self.b.concat(&vec![rt.clone(); group], 0)),
                (None, Some(m3)) => {
                    let parts: Vec<V> = (0..group)
                        .map(|g| {
                            let h = self.b.dyn_slice(m3, 0, j * group + g, j * group + g + 1);
                            self.b.reduce_unit(&h, &[0])
                        })
                        .collect();
                    Some(self.b.concat(&parts, 0))
                }
                (None, None) => None,
            };
            let scores = match rows {
                // Same static type as the scores; the dynamic length is the mask's own
                // (`past + C`), equal to the keys' at run time.
                Some(rows) => {
                    let rows = V {
                        name: rows.name,
                        ty: scores.ty.clone(),
                    };
                    self.b.add(&scores, &rows)
                }
                None => scores,
            };
            let p = self.softmax_last(&scores);
            let o = self.b.dot(&p, &vj, (&[], &[]), (&[1], &[0]));
            outs.push(self.b.reshape_static(&o, &[group, r, d]));
        }
        let o = self.b.concat(&outs, 0);
        let o = self.b.transpose(&o, &[1, 0, 2]);
        self.b.reshape_static(&o, &[r, nh * d])
    }

    /// One softmax over the keys of two score blocks `[Q, P]` (the cache) and `[Q, R]` (the
    /// call's rows), returned as the same two blocks. The cache's `P` keys are reduced in tiles
    /// of [`SOFTMAX_TILE`] and then across the tiles: one softmax row over `P + R` = 2049 keys
    /// with only 4 rows (a step) was one dispatch of 648 µs on the H200 (IREE's SPIR-V path
    /// reduces a long row nearly serially; per-dispatch profile in `docs/journal`, session 6), 18 per
    /// step. The tiles only regroup the sums, so the result equals the one-row softmax up to
    /// float rounding.
    fn softmax_split(&mut self, sc: &V, sn: &V, tiled: bool) -> (V, V) {
        let [_, p] = sc.ty.static_dims()[..] else {
            kv_core::error::invariant("cache scores are [Q, P]")
        };
        let tile = if tiled && p % SOFTMAX_TILE == 0 {
            SOFTMAX_TILE
        } else {
            p
        };
        let tiled = |b: &mut Body, x: &V, kind: Reduce| tiled_reduce(b, x, kind, tile);
        let mc = tiled(&mut self.b, sc, Reduce::Max);
        let mn = self.b.reduce(sn, &[1], Reduce::Max);
        let m = self.b.binary("maximum", &mc, &mn);
        let mbc = self.b.broadcast(&m, &[0], &sc.ty);
        let mbn = self.b.broadcast(&m, &[0], &sn.ty);
        let dc = self.b.sub(sc, &mbc);
        let ec = self.b.unary("exponential", &dc);
        let dn = self.b.sub(sn, &mbn);
        let en = self.b.unary("exponential", &dn);
        let sum_c = tiled(&mut self.b, &ec, Reduce::Add);
        let sum_n = self.b.reduce(&en, &[1], Reduce::Add);
        let sum = self.b.add(&sum_c, &sum_n);
        let sbc = self.b.broadcast(&sum, &[0], &sc.ty);
        let sbn = self.b.broadcast(&sum, &[0], &sn.ty);
        (self.b.div(&ec, &sbc), self.b.div(&en, &sbn))
    }

    /// One query row's attention (the step) over a cache head's values `vc [P, d]` and the
    /// call's own row `vn [1, d]`, from the masked scores `sc [G, P]` and `sn [G, 1]`: the
    /// maximum ([`Body::configured_row_max`]), then the exponentials, their sum and their
    /// product with the values in one configured dispatch ([`Body::exp_product`]), the own row
    /// and the division elementwise. [`Self::softmax_split`] and two products took nine
    /// dispatches a layer (the exponentials and the probabilities each written out); this, four.
    fn attention_row(&mut self, sc: &V, sn: &V, vc: &V, vn: &V, config: AttentionProducts) -> V {
        let [g, p] = sc.ty.static_dims()[..] else {
            kv_core::error::invariant("cache scores are [G, P]")
        };
        let d = vc.ty.static_dims()[1];
        // The maximum in one dispatch: a subgroup a row, two rows a 64-thread workgroup.
        let mc = self
            .b
            .configured_row_max(sc, &subgroup_reduce_info(&format!("[[2], [0, {p}]]"), 64));
        let mn = self.b.reduce(sn, &[1], Reduce::Max);
        let m = self.b.binary("maximum", &mc, &mn);
        let (acc, sum) = self.b.exp_product(sc, &m, vc, &config.info(config.outputs, p));
        let mbn = self.b.broadcast(&m, &[0], &sn.ty);
        let dn = self.b.sub(sn, &mbn);
        let en = self.b.unary("exponential", &dn);
        let en = self.b.reshape_static(&en, &[g]);
        let out = Ty::fixed(&[g, d], Elem::F32);
        let en = self.b.broadcast(&en, &[0], &out);
        let vn = self.b.reshape_static(vn, &[d]);
        let vn = self.b.broadcast(&vn, &[1], &out);
        let own = self.b.mul(&en, &vn);
        let num = self.b.add(&acc, &own);
        let den = self.b.add(&sum, &en);
        self.b.div(&num, &den)
    }

    /// Contract v2's masks of one layer kind for a call of `r` rows at position `pos [1]`: query
    /// row `i` (position `pos + i`) sees the cache row holding position `j` iff `j < pos` and,
    /// with a window, `pos + i - j < window`, and the call's own row `i'` iff `i' <= i` and,
    /// with a window, `i - i' < window` (only binding when a chunk is longer than the window).
    /// Row `k` of a linear cache holds position `k`; of a ring of `n` rows, the latest position
    /// before `pos` congruent to `k` mod `n` (`kv_core::ring::position_of`), if any. Laid out
    /// for [`Self::attention_v2`]'s stacked query rows: `[group·R, rows]` and `[group·R, R]`,
    /// `i1`. Rows holding no position before `pos` are masked by this alone: their contents are
    /// never read.
    fn v2_masks(&mut self, pos: &V, r: usize, kind: LayerKind) -> (V, V) {
        let window = self.spec.window(kind);
        let group = self.spec.n_heads / self.spec.n_kv_heads;
        let layout = self
            .v2
            .unwrap_or_else(|| kv_core::error::invariant("contract v2's masks in a v1 graph"));
        let p = layout.cache_rows(self.spec, kind);
        let cache_dims = [group, r, p];
        let at = self.b.reshape_static(pos, &[]);
        let at = self.b.broadcast(&at, &[], &Ty::fixed(&cache_dims, Elem::I32));
        let row = self.b.iota(&cache_dims, 1, Elem::I32);
        let mut key = self.b.iota(&cache_dims, 2, Elem::I32);
        let mut cache = if layout.is_ring(self.spec, kind) {
            // key = pos - 1 - ((pos - 1 - k + n) mod n); the dividend is never negative (k < n).
            let one = self.b.splat_i32(1, &key.ty);
            let n = self.b.splat_i32(p as i32, &key.ty);
            let last = self.b.sub(&at, &one);
            let t = self.b.sub(&last, &key);
            let t = self.b.add(&t, &n);
            let back = self.b.binary("remainder", &t, &n);
            key = self.b.sub(&last, &back);
            let zero = self.b.splat_i32(0, &key.ty);
            self.b.compare("GE", &key, &zero)
        } else {
            self.b.compare("LT", &key, &at)
        };
        if let Some(w) = window {
            let query = self.b.add(&row, &at);
            let wv = self.b.splat_i32(w as i32, &key.ty);
            let reach = self.b.add(&key, &wv);
            let inside = self.b.compare("GT", &reach, &query);
            cache = self.b.binary("and", &cache, &inside);
        }
        let new_dims = [group, r, r];
        let row = self.b.iota(&new_dims, 1, Elem::I32);
        let key = self.b.iota(&new_dims, 2, Elem::I32);
        let mut new = self.b.compare("LE", &key, &row);
        if let Some(w) = window {
            let wv = self.b.splat_i32(w as i32, &key.ty);
            let reach = self.b.add(&key, &wv);
            let inside = self.b.compare("GT", &reach, &row);
            new = self.b.binary("and", &new, &inside);
        }
        (
            self.b.reshape_static(&cache, &[group * r, p]),
            self.b.reshape_static(&new, &[group * r, r]),
        )
    }

    /// Contract v2's attention of `q [R, nHeads, d]` (scaled, rotated) over a layer's cache
    /// arguments `[rows, nKV, d]` and the call's own rows `[R, nKV, d]`: `[R, nHeads·d]`. Per KV head,
    /// its query heads are stacked as rows `[group·R, d]` against that head's keys, so no KV head
    /// is repeated per query head (Gemma's single KV head included). The scores over the cache
    /// and over the new rows are masked with `select` (not an added `-1e30`: a cache row past
    /// `pos` may hold anything, and an infinite score plus `-1e30` stays infinite), joined along
    /// the key axis into one softmax, and the two parts of the probabilities meet their values
    /// in two products, so the cache is never copied to append the new rows.
    fn attention_v2(&mut self, q: &V, cache: (&V, &V), new: (&V, &V), masks: (&V, &V)) -> V {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let group = nh / nkv;
        let r = q.ty.static_dims()[0];
        let p = cache.0.ty.static_dims()[0];
        let qh = self.b.transpose(q, &[1, 0, 2]);
        let head = |b: &mut Body, x: &V, j: usize| {
            let rows = x.ty.static_dims()[0];
            let one = if nkv == 1 {
                x.clone()
            } else {
                b.slice(x, &[(0, rows), (j, j + 1), (0, d)])
            };
            b.reshape_static(&one, &[rows, d])
        };
        let masked_cache = self.b.splat_f32(kv_core::mask::MASKED, &masks.0.ty);
        let masked_new = self.b.splat_f32(kv_core::mask::MASKED, &masks.1.ty);
        let mut outs = Vec::with_capacity(nkv);
        for j in 0..nkv {
            let qj = if nkv == 1 {
                qh.clone()
            } else {
                self.b.slice(&qh, &[(j * group, (j + 1) * group), (0, r), (0, d)])
            };
            let qj = self.b.reshape_static(&qj, &[group * r, d]);
            let kc = head(&mut self.b, cache.0, j);
            let vc = head(&mut self.b, cache.1, j);
            let kn = head(&mut self.b, new.0, j);
            let vn = head(&mut self.b, new.1, j);
            // One query row (the step): the cache's products as multiply-and-reduce. As a
            // `dot_general`, CPU data tiling packs the whole cache into tiles on every call (a
            // read and a write of every K and V row) for a matvec. (On the H200 either form is a
            // `matmul_like` dispatch; one product per query row cut their GPU time but added
            // dispatches, and the step's wall time follows the dispatch count there:
            // docs/journal, session 9.)
            let by_reduce = r == 1;
            let sc = self.head_product(&qj, &kc, true, by_reduce);
            let sc = self.b.select(masks.0, &sc, &masked_cache);
            let sn = self.head_product(&qj, &kn, true, by_reduce);
            let sn = self.b.select(masks.1, &sn, &masked_new);
            let configured = self.options.tuning.map(|t| t.attention).filter(|c| c.keys <= p);
            if let (Some(config), true, Elem::F32) = (configured, by_reduce, vc.ty.elem) {
                let o = self.attention_row(&sc, &sn, &vc, &vn, config);
                outs.push(self.b.reshape_static(&o, &[group, r, d]));
                continue;
            }
            let (pc, pn) = if self.options.tiled_softmax || by_reduce {
                // (no concatenation of the two scores, and so no copy of either)
                self.softmax_split(&sc, &sn, self.options.tiled_softmax)
            } else {
                let scores = self.b.concat(&[sc, sn], 1);
                let probs = self.softmax_last(&scores);
                (
                    self.b.slice(&probs, &[(0, group * r), (0, p)]),
                    self.b.slice(&probs, &[(0, group * r), (p, p + r)]),
                )
            };
            let oc = self.head_product(&pc, &vc, false, by_reduce);
            let on = self.head_product(&pn, &vn, false, by_reduce);
            let o = self.b.add(&oc, &on);
            outs.push(self.b.reshape_static(&o, &[group, r, d]));
        }
        let o = if nkv == 1 {
            outs.pop().unwrap()
        } else {
            self.b.concat(&outs, 0)
        };
        let o = self.b.transpose(&o, &[1, 0, 2]);
        self.b.reshape_static(&o, &[r, nh * d])
    }

    /// [`Self::attention_v2`] over f16 caches (`CacheType::F16`), all KV heads in each product:
    /// the caches enter the products as the function's arguments, whole. IREE widens an f16
    /// tensor inside the dispatch that reads it only when the `convert` reads an argument (or a
    /// global) directly; after the per-head `slice`/`reshape` of [`Self::attention_v2`] the
    /// convert was a dispatch of its own that wrote an f32 copy of every cache on every call
    /// (544 dispatches a step instead of 472, and more bytes than f32 caches). `new` holds the
    /// call's rows as the cache will (f32 values on the f16 grid).
    fn attention_v2_batched(&mut self, q: &V, cache: (&V, &V), new: (&V, &V), masks: (&V, &V)) -> V {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let group = nh / nkv;
        let r = q.ty.static_dims()[0];
        let p = cache.0.ty.static_dims()[0];
        let gr = group * r;
        // [R, nh, d] -> [nKV, group·R, d]: KV head j's query heads stacked as rows.
        let qh = self.b.transpose(q, &[1, 0, 2]);
        let qh = self.b.reshape_static(&qh, &[nkv, gr, d]);
        let by_reduce = r == 1;
        let sc = self.kv_product(&qh, cache.0, true, by_reduce);
        let sn = self.kv_product(&qh, new.0, true, by_reduce);
        let sc = self.masked(&sc, masks.0);
        let sn = self.masked(&sn, masks.1);
        // The softmax takes 2-D blocks: every KV head's rows one after another.
        let sc = self.b.reshape_static(&sc, &[nkv * gr, p]);
        let sn = self.b.reshape_static(&sn, &[nkv * gr, r]);
        let (pc, pn) = self.softmax_split(&sc, &sn, self.options.tiled_softmax);
        let pc = self.b.reshape_static(&pc, &[nkv, gr, p]);
        let pn = self.b.reshape_static(&pn, &[nkv, gr, r]);
        let oc = self.kv_product(&pc, cache.1, false, by_reduce);
        let on = self.kv_product(&pn, new.1, false, by_reduce);
        let o = self.b.add(&oc, &on);
        // [nKV, group·R, d] -> [nh, R, d] -> [R, nh·d]
        let o = self.b.reshape_static(&o, &[nh, r, d]);
        let o = self.b.transpose(&o, &[1, 0, 2]);
        self.b.reshape_static(&o, &[r, nh * d])
    }

    /// Scores `[nKV, Q, rows]` masked by `mask [Q, rows]` (the same for every KV head).
    fn masked(&mut self, scores: &V, mask: &V) -> V {
        let mask = self.b.broadcast(mask, &[1, 2], &scores.ty.with_elem(Elem::I1));
        let fill = self.b.splat_f32(kv_core::mask::MASKED, &scores.ty);
        self.b.select(&mask, scores, &fill)
    }

    /// `a [nKV, Q, x]` against every KV head of `c [rows, nKV, d]`: with `scores` the queries
    /// against the keys (`x = d`, result `[nKV, Q, rows]`), else the probabilities against the
    /// values (`x = rows`, result `[nKV, Q, d]`). One query row (`by_reduce`): a broadcast product
    /// reduced over one axis of `[nKV, Q, rows, d]` (see [`Self::attention_v2`]); else a batched
    /// `dot_general`. `c` is widened to f32 after its broadcast, or before the `dot_general`.
    fn kv_product(&mut self, a: &V, c: &V, scores: bool, by_reduce: bool) -> V {
        let [nkv, q, _] = a.ty.static_dims()[..] else {
            kv_core::error::invariant("a per-KV-head operand is [nKV, Q, x]")
        };
        let [rows, _, d] = c.ty.static_dims()[..] else {
            kv_core::error::invariant("a cache is [rows, nKV, d]")
        };
        if !by_reduce {
            let c = self.b.convert_if(c, Elem::F32);
            let contract: &[usize] = if scores { &[2] } else { &[0] };
            return self.b.dot(a, &c, (&[0], &[1]), (&[2], contract));
        }
        let full = Ty::fixed(&[nkv, q, rows, d], Elem::F32);
        let ab = self.b.broadcast(a, if scores { &[0, 1, 3] } else { &[0, 1, 2] }, &full);
        let cb = self.b.broadcast(c, &[2, 0, 3], &full.with_elem(c.ty.elem));
        let cb = self.b.convert_if(&cb, Elem::F32);
        let prod = self.b.mul(&ab, &cb);
        self.b.reduce(&prod, &[if scores { 3 } else { 2 }], Reduce::Add)
    }

    /// `a · cᵀ` (`scores`: queries against keys) or `a · c` (probabilities against values) of
    /// `a [G, x]` and a cache head `c [P, d]`: a `dot_general`, or with `by_reduce`
    /// [`Self::mul_reduce`].
    fn head_product(&mut self, a: &V, c: &V, scores: bool, by_reduce: bool) -> V {
        let [rows, d] = c.ty.static_dims()[..] else {
            kv_core::error::invariant("a cache head is [P, d]")
        };
        match self.options.tuning.map(|t| t.attention) {
            // (The call's own rows stay IREE's: fewer than a workgroup's keys.)
            Some(config) if by_reduce && c.ty.elem == Elem::F32 && rows >= config.keys => {
                let info = if scores {
                    config.info(config.keys, d)
                } else {
                    config.info(config.outputs, rows)
                };
                return self.b.configured_product(a, c, scores, &info);
            }
            _ => {}
        }
        match (by_reduce, scores) {
            (true, true) => self.mul_reduce(a, c, 2),
            (true, false) => self.mul_reduce(a, c, 1),
            (false, true) => self.b.dot(a, c, (&[], &[]), (&[1], &[1])),
            (false, false) => self.b.dot(a, c, (&[], &[]), (&[1], &[0])),
        }
    }

    /// `a [G, x]` against `c [P, d]` as a broadcast product reduced over one axis of `[G, P, d]`:
    /// `axis` 2 is `a · cᵀ` (`x = d`: `[G, P]`), `axis` 1 is `a · c` (`x = P`: `[G, d]`).
    fn mul_reduce(&mut self, a: &V, c: &V, axis: usize) -> V {
        let g = a.ty.static_dims()[0];
        let [p, d] = c.ty.static_dims()[..] else {
            kv_core::error::invariant("a cache head is [P, d]")
        };
        let full = Ty::fixed(&[g, p, d], Elem::F32);
        let ab = self.b.broadcast(a, &[0, if axis == 2 { 2 } else { 1 }], &full);
        let cb = self.b.broadcast(c, &[1, 2], &full);
        let prod = self.b.mul(&ab, &cb);
        self.b.reduce(&prod, &[axis], Reduce::Add)
    }

    /// Attention of `q [R, nHeads, d]` (scaled, rotated) over `k, v [1, nKV, T, d]`: `[R, nHeads·d]`.
    fn attention(&mut self, q: &V, k: &V, v: &V, mask: MaskIn) -> V {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        if nkv >= 2 && nh / nkv >= 2 {
            return self.grouped_attention(q, k, v, mask);
        }
        let r = q.ty.static_dims()[0];
        let qh = self.b.transpose(q, &[1, 0, 2]);
        let kr = self.repeat_kv(k);
        let scores = self.b.dot(&qh, &kr, (&[0], &[0]), (&[2], &[2]));
        let scores = match mask {
            MaskIn::None => scores,
            MaskIn::V2 { .. } => kv_core::error::invariant("a contract v2 mask reached the v1 attention"),
            MaskIn::InGraph(window) => {
                let t = scores.ty.static_dims()[2];
                let add = self.causal_mask(r, t, window);
                let addb = self.b.broadcast(&add, &[1, 2], &scores.ty);
                self.b.add(&scores, &addb)
            }
            MaskIn::Arg(m) => {
                let addb = if self.spec.mask_head_count() == 1 {
                    let m2 = self.b.reduce_unit(&m, &[0, 1]);
                    self.b.broadcast(&m2, &[1, 2], &scores.ty)
                } else {
                    let m3 = self.b.reduce_unit(&m, &[0]);
                    // Same static type as the scores; the dynamic length is the mask's own
                    // (`past + C`), equal to the keys' at run time.
                    V {
                        name: m3.name,
                        ty: scores.ty.clone(),
                    }
                };
                self.b.add(&scores, &addb)
            }
        };
        let p = self.softmax_last(&scores);
        let vr = self.repeat_kv(v);
        let o = self.b.dot(&p, &vr, (&[0], &[0]), (&[2], &[1]));
        let o = self.b.transpose(&o, &[1, 0, 2]);
        self.b.reshape_static(&o, &[r, nh * d])
    }

    /// [`Self::attention`] of one query row `q [1, nHeads, d]` over a single KV head's `k, v
    /// [1, 1, T, d]`, every row visible (Gemma 3 270M's decode step): the heads are the rows of a product
    /// batched over the two unit dimensions, so no unit dimension of the dynamic cache is
    /// dropped. Dropping them (a one-term sum: dynamic reshapes do not lower) made IREE build
    /// each layer's `past + 1` concatenation twice, the returned cache and a summed copy for the
    /// attention: 36 of a step's dispatches on FunctionGemma's geometry.
    fn single_row_attention(&mut self, q: &V, k: &V, v: &V) -> V {
        let (nh, d) = (self.spec.n_heads, self.spec.head_dim);
        let q4 = self.b.reshape_static(q, &[1, 1, nh, d]);
        let scores = self.b.dot(&q4, k, (&[0, 1], &[0, 1]), (&[3], &[3]));
        let p = self.softmax_last(&scores);
        let o = self.b.dot(&p, v, (&[0, 1], &[0, 1]), (&[3], &[2]));
        self.b.reshape_static(&o, &[1, nh * d])
    }

    /// One transformer block over `x [R, hidden]`; returns the new `x` and the layer's full
    /// `K, V [1, nKV, past + R, d]` (the past rows, then the new ones), or under contract v2
    /// (`mask` is [`MaskIn::V2`], `past` the whole caches `[P, nKV, d]`) only the new rows
    /// `[R, nKV, d]`.
    fn layer(
        &mut self,
        l: usize,
        x: &Residual,
        cos: &V,
        sin: &V,
        past: Option<(V, V)>,
        mask: MaskIn,
    ) -> (Residual, V, V) {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let arch = self.arch;
        let r = x.base.ty.static_dims()[0];
        let p = |s: &str| layer_param(l, s);
        let fused = self.table.contains_key(&p("attn_qkv.weight"));
        let (q, k, v) = if fused && arch.qk_norm && !arch.attn_bias && r <= NORM_ROPE_MAX_ROWS {
            let (norm, qkv) = (p("attn_norm.weight"), p("attn_qkv.weight"));
            let y = match self.normed_products(x, &norm, &[&qkv]) {
                Some(mut y) => y.remove(0),
                None => {
                    let x = self.settle(x);
                    let h = self.norm_param(&x, &norm);
                    self.proj(&h, &qkv)
                }
            };
            let y = self.b.reshape_static(&y, &[r, nh + 2 * nkv, d]);
            let z = self.qkv_norm_rope(&y, l, cos, sin);
            let mut heads = |from: usize, n: usize| self.b.slice(&z, &[(0, r), (from, from + n), (0, d)]);
            (heads(0, nh), heads(nh, nkv), heads(nh + nkv, nkv))
        } else {
            let x = self.settle(x);
            let h = self.norm_param(&x, &p("attn_norm.weight"));
            self.qkv_apart(&h, l, cos, sin)
        };
        let (o, k_out, v_out) = if let MaskIn::V2 { cache, new } = mask {
            let (ck, cv) = past.unwrap_or_else(|| kv_core::error::invariant("a contract v2 layer without its cache"));
            if ck.ty.elem == Elem::F16 {
                // The new rows as the cache will hold them, and attended so (`CacheType::F16`).
                let k = self.b.reduce_precision(&k, 5, 10);
                let v = self.b.reduce_precision(&v, 5, 10);
                let o = self.attention_v2_batched(&q, (&ck, &cv), (&k, &v), (&cache, &new));
                (o, self.b.convert(&k, Elem::F16), self.b.convert(&v, Elem::F16))
            } else {
                let o = self.attention_v2(&q, (&ck, &cv), (&k, &v), (&cache, &new));
                (o, k, v)
            }
        } else {
            let to_cache = |b: &mut Body, x: &V| {
                let t = b.transpose(x, &[1, 0, 2]);
                b.reshape_static(&t, &[1, nkv, r, d])
            };
            let k_new = to_cache(&mut self.b, &k);
            let v_new = to_cache(&mut self.b, &v);
            let (k_all, v_all) = match past {
                None => (k_new, v_new),
                Some((pk, pv)) => (self.b.concat(&[pk, k_new], 2), self.b.concat(&[pv, v_new], 2)),
            };
            let o = if nkv == 1 && r == 1 && !k_all.ty.is_static() && matches!(mask, MaskIn::None) {
                self.single_row_attention(&q, &k_all, &v_all)
            } else {
                self.attention(&q, &k_all, &v_all, mask)
            };
            (o, k_all, v_all)
        };
        let (a, x) = self.proj_settling(&o, &p("attn_output.weight"), x);
        let x = self.add_block(x, a, &p("post_attention_norm.weight"));
        // (Not fused like Q/K/V: see `kv_core::params::FUSED_PROJECTIONS`.)
        let (gate, up) = (p("ffn_gate.weight"), p("ffn_up.weight"));
        let (g, u) = match self
            .normed_products(&x, &p("ffn_norm.weight"), &[&gate, &up])
            .as_deref()
        {
            Some([g, u]) => (g.clone(), u.clone()),
            _ => {
                let x = self.settle(&x);
                let h2 = self.norm_param(&x, &p("ffn_norm.weight"));
                (self.proj(&h2, &gate), self.proj(&h2, &up))
            }
        };
        let act = match arch.activation {
            Activation::GeluTanh => self.gelu_tanh(&g),
            Activation::Silu => self.silu(&g),
        };
        let gu = self.b.mul(&act, &u);
        let (m, x) = self.proj_settling(&gu, &p("ffn_down.weight"), &x);
        let x = self.add_block(x, m, &p("post_ffw_norm.weight"));
        (x, k_out, v_out)
    }

    /// The residual stream `x` plus a block's output `y` (RMS-normed by `post_norm` where the
    /// architecture has post-norms): the addition left pending where the next products can
    /// make it ([`Residual`]: the one-row step where [`EmitOptions::tuning`] says how
    /// the products writing the stream out run, with i16 weights).
    fn add_block(&mut self, x: V, y: V, post_norm: &str) -> Residual {
        if !self.arch.post_norms {
            return Residual::settled(self.b.add(&x, &y));
        }
        let one_row = y.ty.is_static() && y.ty.static_dims()[0] == 1;
        if one_row && self.row_tuning().is_some() {
            return Residual {
                base: x,
                pending: Some((y, post_norm.to_string())),
            };
        }
        let y = self.norm_param(&y, post_norm);
        Residual::settled(self.b.add(&x, &y))
    }

    /// The residual stream written out: `base + rmsnorm(delta, weight)` where an addition is
    /// pending.
    fn settle(&mut self, x: &Residual) -> V {
        match &x.pending {
            None => x.base.clone(),
            Some((d, post)) => {
                let y = self.norm_param(d, post);
                self.b.add(&x.base, &y)
            }
        }
    }

    /// `x · Wᵀ` (a layer's output or down projection) and the residual stream `res` written out,
    /// as `(product, stream)`; with an addition pending, both in one configured dispatch
    /// ([`Body::row_product_settling_i16`]).
    fn proj_settling(&mut self, x: &V, weight: &str, res: &Residual) -> (V, V) {
        if let (Some((d, post)), Some(config)) = (&res.pending, self.row_tuning().map(|t| t.stream)) {
            if self.quant_format(weight).is_none() {
                let w = self.raw_param(weight);
                let [hidden, inner] = w.ty.static_dims()[..] else {
                    kv_core::error::invariant("a weight is [out, in]")
                };
                let post = self.param(post);
                // `Σ d²` once more, a dispatch of its own: the normed products took it too, but
                // a second reader of their sums keeps IREE from fusing the products' epilogue
                // into their dispatch. This one depends on `d` alone, so it runs beside them.
                let sq = self.b.mul(d, d);
                let sum = self.b.reduce(&sq, &[1], Reduce::Add);
                let sum = self.b.reshape_static(&sum, &[]);
                let info = config.compilation_info(inner);
                let eps = self.arch.rms_eps;
                return self
                    .b
                    .row_product_settling_i16(x, &w, (&res.base, d, &post), &sum, (hidden, eps), &info);
            }
        }
        let y = self.proj(x, weight);
        (y, self.settle(res))
    }

    /// [`Self::qkv_apart`]'s Q/K norms, rotation and query scale as one expression over the
    /// fused product `y [R, nHeads + 2·nKV, d]` (query heads, key heads, value heads), the value
    /// heads passed through. IREE makes it a reduction dispatch and an elementwise one: on the
    /// H200 ~20 µs a layer, where the queries and keys apart took ~54 (three dispatches; the
    /// keys' norm and rotation fused into one, which IREE's SPIR-V code runs at the reduction's
    /// parallelism), and a form it fused into one dispatch took 51 (`docs/journal`,
    /// session 14).
    fn qkv_norm_rope(&mut self, y: &V, l: usize, cos: &V, sin: &V) -> V {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let [r, heads, _] = y.ty.static_dims()[..] else {
            kv_core::error::invariant("the fused product is [R, heads, d]")
        };
        let rows = Ty::fixed(&[r, heads], Elem::F32);
        let norm = self.rms_factor(y);
        // Per head: below `nh` a query head, below `nh + nKV` a key head, else a value head.
        let head = self.b.iota(&[r, heads], 1, Elem::I32);
        let below = |b: &mut Body, n: usize| {
            let bound = b.splat_i32(n as i32, &head.ty);
            b.compare("LT", &head, &bound)
        };
        let is_q = below(&mut self.b, nh);
        let rotated_heads = below(&mut self.b, nh + nkv);
        let one = self.b.splat_f32(1.0, &rows);
        let scale = self.b.splat_f32(self.arch.query_scale, &rows);
        let scale = self.b.select(&is_q, &scale, &one);
        let norm = self.b.select(&rotated_heads, &norm, &one);
        let factor = self.b.mul(&norm, &scale);
        // rope(x·w) = x·w·cos + swap(x)·swap(w)·sin, as in `norm_rope`; a value head is `y`.
        // Every select picks between terms that read `y`: a select between the weights' (or the
        // constant rotary tables') broadcasts alone is a constant expression, which IREE
        // hoisted per function and row count (`[128, 6, 256]` f32: ~100 MB more RSS on the CPU).
        let wide = |b: &mut Body, m: &V| b.broadcast(m, &[0, 1], &y.ty.with_elem(Elem::I1));
        let (is_q, rotated) = (wide(&mut self.b, &is_q), wide(&mut self.b, &rotated_heads));
        let zeros = self.b.splat_f32(0.0, &y.ty);
        let swapped = self.swap_halves(y);
        let weighted = |this: &mut Self, x: &V, swapped_weights: bool, value_head: &V| {
            let mut times = |name: &str| {
                let w = this.param(&layer_param(l, name));
                let w = if swapped_weights {
                    let halves = this.b.reshape_static(&w, &[2, d / 2]);
                    let w = this.b.reverse(&halves, &[0]);
                    this.b.reshape_static(&w, &[d])
                } else {
                    w
                };
                let wb = this.b.broadcast(&w, &[2], &y.ty);
                this.b.mul(x, &wb)
            };
            let xq = times("attn_q_norm.weight");
            let xk = times("attn_k_norm.weight");
            let xk = this.b.select(&rotated, &xk, value_head);
            this.b.select(&is_q, &xq, &xk)
        };
        let yw = weighted(self, y, false, y);
        let sw = weighted(self, &swapped, true, &zeros);
        let cb = self.b.broadcast(cos, &[0, 2], &y.ty);
        let sb = self.b.broadcast(sin, &[0, 2], &y.ty);
        let a = self.b.mul(&yw, &cb);
        let a = self.b.select(&rotated, &a, &yw);
        let s = self.b.mul(&sw, &sb);
        let sum = self.b.add(&a, &s);
        let fb = self.b.broadcast(&factor, &[0, 1], &y.ty);
        self.b.mul(&sum, &fb)
    }

    /// The layer's scaled, rotated queries `[R, nHeads, d]`, keys and values `[R, nKV, d]` from
    /// the normalized input `h`, each projection apart (or sliced from a fused one).
    fn qkv_apart(&mut self, h: &V, l: usize, cos: &V, sin: &V) -> (V, V, V) {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let arch = self.arch;
        let r = h.ty.static_dims()[0];
        let p = |s: &str| layer_param(l, s);
        let biases = arch.attn_bias.then_some((
            "attn_qkv.bias",
            ["attn_q.bias", "attn_k.bias", "attn_v.bias"].as_slice(),
        ));
        let qkv = self.projections(
            h,
            l,
            ("attn_qkv.weight", &["attn_q.weight", "attn_k.weight", "attn_v.weight"]),
            &[nh * d, nkv * d, nkv * d],
            biases,
        );
        let [q, k, v] = &qkv[..] else {
            kv_core::error::invariant("three attention projections")
        };
        let q = self.b.reshape_static(q, &[r, nh, d]);
        let k = self.b.reshape_static(k, &[r, nkv, d]);
        let v = self.b.reshape_static(v, &[r, nkv, d]);
        let (q, k) = if arch.qk_norm && r <= NORM_ROPE_MAX_ROWS {
            (
                self.norm_rope(&q, &p("attn_q_norm.weight"), cos, sin),
                self.norm_rope(&k, &p("attn_k_norm.weight"), cos, sin),
            )
        } else if arch.qk_norm {
            let q = self.norm_param(&q, &p("attn_q_norm.weight"));
            let k = self.norm_param(&k, &p("attn_k_norm.weight"));
            (self.rope(&q, cos, sin), self.rope(&k, cos, sin))
        } else {
            (self.rope(&q, cos, sin), self.rope(&k, cos, sin))
        };
        let q = self.b.scale(&q, arch.query_scale);
        (q, k, v)
    }

    /// `0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³)))`
    fn gelu_tanh(&mut self, g: &V) -> V {
        let g2 = self.b.mul(g, g);
        let g3 = self.b.mul(&g2, g);
        let c3 = self.b.scale(&g3, 0.044715);
        let inner = self.b.add(g, &c3);
        let scaled = self.b.scale(&inner, (2.0f64 / std::f64::consts::PI).sqrt() as f32);
        let t = self.b.unary("tanh", &scaled);
        let one = self.b.splat_f32(1.0, &t.ty);
        let onep = self.b.add(&one, &t);
        let half = self.b.scale(g, 0.5);
        self.b.mul(&half, &onep)
    }

    /// `g / (1 + e^-g)`
    fn silu(&mut self, g: &V) -> V {
        let neg = self.b.unary("negate", g);
        let e = self.b.unary("exponential", &neg);
        let one = self.b.splat_f32(1.0, &e.ty);
        let den = self.b.add(&one, &e);
        self.b.div(g, &den)
    }

    /// `rmsnorm(x, norm) · Wᵀ` for each of `weights` (`x [1, hidden]`, weights of one output
    /// size), where one row of i16 weights runs on the GPUs [`RowProducts`] suits (the step):
    /// all products and the norm's sum of squares in one configured dispatch
    /// ([`Body::normed_row_products_i16`]: `Σ (x·w)·W`, then scaled by `rsqrt(mean(x²) + eps)`), where
    /// IREE ran the norm as a dispatch of its own and each product as a `vecmat`; a stream
    /// whose post-norm addition is pending ([`Residual`]) is normed as the sum it stands for,
    /// never written out ([`Body::carried_row_products_i16`]). `None` elsewhere.
    fn normed_products(&mut self, x: &Residual, norm: &str, weights: &[&str]) -> Option<Vec<V>> {
        let config = self.row_tuning()?.head;
        let one_row = x.base.ty.is_static() && x.base.ty.static_dims()[0] == 1;
        let plain = |e: &Self, n: &str| e.quant_format(n).is_none();
        if !one_row || !plain(self, norm) || !weights.iter().all(|w| plain(self, w)) {
            return None;
        }
        let n = self.param(norm);
        let ws: Vec<V> = weights.iter().map(|w| self.raw_param(w)).collect();
        let ws: Vec<&V> = ws.iter().collect();
        let [out, inner] = ws[0].ty.static_dims()[..] else {
            kv_core::error::invariant("a weight is [out, in]")
        };
        let info = config.compilation_info(inner);
        let Some((d, post)) = &x.pending else {
            let mut parts = self.b.normed_row_products_i16(&x.base, &n, &ws, &info);
            let sum = parts
                .pop()
                .unwrap_or_else(|| kv_core::error::invariant("the sum of squares comes last"));
            let r = self.rms_from_sum(&sum, inner);
            return Some(parts.iter().map(|p| self.b.mul(p, &r)).collect());
        };
        // `h = x + c·u` (`u = d·post`): `Σ h² = Σ x² + 2c·Σ x·u + c²·Σ u²` and `h·W = x·W + c·(u·W)`,
        // every sum taken in the one dispatch.
        if out < inner || !plain(self, post) {
            return None;
        }
        let post = self.param(post);
        let mut parts = self.b.carried_row_products_i16(&x.base, d, &post, &n, &ws, &info);
        let sums = parts.split_off(2 * ws.len());
        let [sxx, sxu, suu, sdd] = <[V; 4]>::try_from(sums).unwrap_or_else(|_| kv_core::error::invariant("four sums"));
        let c = self.rms_from_sum(&sdd, inner);
        let two_c = self.b.add(&c, &c);
        let cross = self.b.mul(&two_c, &sxu);
        let c2 = self.b.mul(&c, &c);
        let square = self.b.mul(&c2, &suu);
        let ss = self.b.add(&sxx, &cross);
        let ss = self.b.add(&ss, &square);
        let r = self.rms_from_sum(&ss, inner);
        let products = parts
            .chunks(2)
            .map(|pair| {
                let cu = self.b.mul(&c, &pair[1]);
                let h = self.b.add(&pair[0], &cu);
                self.b.mul(&h, &r)
            })
            .collect();
        Some(products)
    }

    /// `rmsnorm(x, output_norm) · Eᵀ` for every row of `x [R, hidden]`: `[R, vocab]`.
    fn logits(&mut self, x: &V) -> V {
        let y = self.norm_param(x, OUTPUT_NORM);
        let table = if self.arch.tied_output { TOKEN_EMBD } else { OUTPUT };
        match self.row_tuning().map(|t| t.head) {
            // One row of i16 weights: the widening in the product's own body, over (out, in),
            // with IREE's configuration given. The step's fused form of the same product was a
            // `vecmat` taking 820 µs of the H200's ~5 ms step; this form took 361 µs
            // (docs/journal, session 16). The step's other products stay fused: in this
            // form and configuration they were slower (640 outputs are too few workgroups).
            Some(config) if y.ty.static_dims()[0] == 1 => {
                let w = self.raw_param(table);
                let info = config.compilation_info(w.ty.static_dims()[1]);
                self.b.row_contract_i16(&y, &w, &info)
            }
            _ => self.proj(&y, table),
        }
    }

    /// The logits `[1, vocab]` of the row picked by the one-hot `select [1, R]` (or of the only row).
    fn head_logits(&mut self, x: &V, select: Option<&V>) -> V {
        let row = match select {
            Some(s) => self.b.dot(s, x, (&[], &[]), (&[1], &[0])),
            None => x.clone(),
        };
        self.logits(&row)
    }

    /// The next token of the row picked by the one-hot `select [1, R]` (or of the only row): `[1] i32`.
    fn head_token(&mut self, x: &V, select: Option<&V>) -> V {
        let logits = self.head_logits(x, select);
        self.argmax(&logits)
    }

    /// The index of each row's largest logit, lowest on ties, in the form the options choose.
    fn argmax(&mut self, logits: &V) -> V {
        if self.options.argmax_by_max {
            self.b.argmax_rows_by_max(logits)
        } else {
            let n = logits.ty.static_dims()[1];
            let stages = match self.options.tuning.map(|t| t.argmax_width) {
                Some(width) => crate::mlir::argmax_stages_of_width(n, width),
                None => crate::mlir::argmax_stages(n),
            };
            self.b.argmax_rows_staged(logits, &stages)
        }
    }
}

/// The most rows of a product that reads packed pairs in place ([`FuncEmitter::pairs_in_place`]).
const PAIR_ROWS_MAX: usize = 32;

/// The outputs (`out · splits`) a one-row packed-pairs product aims for. Measured on the H200
/// (docs/benchmarks.md, portable Vulkan): 16,384 and 1,048,576 decode within 3% of each other;
/// the smaller writes fewer partial sums, which matters more on a phone's few cores.
const PAIR_THREADS: usize = 16_384;

/// Runs of a packed-pairs product ([`Body::contract_pairs_split`]): enough for about
/// [`PAIR_THREADS`] outputs (`out · splits`), each run at least 16 words, a power of two
/// dividing `words`.
fn pair_splits(out: usize, words: usize) -> usize {
    let mut splits = 1;
    while out * splits * 2 <= PAIR_THREADS && words % (splits * 2) == 0 && words / (splits * 2) >= 16 {
        splits *= 2;
    }
    splits
}

#[cfg(test)]
mod pair_tests {
    use super::pair_splits;

    #[test]
    fn packed_products_split_into_runs_of_at_least_16_words() {
        // Gemma 3 270M's one-row products: down, gate/up, fused Q/K/V, the LM head.
        assert_eq!(pair_splits(640, 1024), 16);
        assert_eq!(pair_splits(2048, 320), 8);
        assert_eq!(pair_splits(1536, 320), 8);
        assert_eq!(pair_splits(262_144, 320), 1);
        // Short rows are not split below 16 words, odd word counts not at all.
        assert_eq!(pair_splits(8, 32), 2);
        assert_eq!(pair_splits(8, 31), 1);
        for (out, words) in [(640, 1024), (2048, 320), (8, 32), (100, 96)] {
            let s = pair_splits(out, words);
            assert!(words % s == 0 && (s == 1 || words / s >= 16), "{out} x {words}: {s}");
        }
    }
}
