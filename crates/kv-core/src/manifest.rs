//! `manifest.json`: the spec, function names, argument/result name lists, and the artifact files
//! (CONTRACT §1–2). A runtime binds graph arguments by these names, so a tracer that reorders
//! arguments does not break it; validation makes sure every name a graph needs is present once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use crate::contract::{Contract, ContractVersion, V2Spec};
use crate::error::{Error, Result};
use crate::spec::{Architecture, KvSpec, LayerKind};

/// The number contract v1 is stored as ([`Contract::V1`]).
pub const CONTRACT_VERSION: u32 = crate::contract::V1_VERSION;
pub const MANIFEST_FILE: &str = "manifest.json";

/// The graphs of the contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Graph {
    /// `prefill_at`: `[SEQ]` tokens from position 0.
    Prefill,
    /// `prefill_with_past`: `C` tokens after a dynamic `past`.
    Chunk,
    /// `with_past`: one token after a dynamic `past`.
    Step,
    /// Redecode: `[1, SEQ] → [SEQ]` next ids.
    Redecode,
    /// Redecode `_at`: `[1, SEQ]` and `select [1, SEQ]` → one `token [1]`.
    RedecodeAt,
}

impl Graph {
    pub const KV: [Graph; 3] = [Graph::Prefill, Graph::Chunk, Graph::Step];

    /// The key of this graph in `functions` and `parameters`.
    pub fn key(self) -> &'static str {
        match self {
            Graph::Prefill => "prefill",
            Graph::Chunk => "prefillWithPast",
            Graph::Step => "withPast",
            Graph::Redecode => "redecode",
            Graph::RedecodeAt => "redecodeAt",
        }
    }

    /// The default function name suffix after the family prefix.
    pub fn function_suffix(self) -> &'static str {
        match self {
            Graph::Prefill => "_prefill_at",
            Graph::Chunk => "_prefill_with_past",
            Graph::Step => "_with_past",
            Graph::Redecode => "",
            Graph::RedecodeAt => "_at",
        }
    }
}

/// A name in a graph's argument or result list (CONTRACT §2). The manifest stores the spelling
/// ([`Name`]'s `Display`); everything past parsing binds by this type, so no caller builds or
/// re-parses a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Name {
    /// `tokens`: the ids of a many-row call.
    Tokens,
    /// `token`: the id of a step call's input; the next id among the results.
    Token,
    /// `emb`: the gathered embedding rows.
    Emb,
    /// `select`: the one-hot row whose logits are read.
    Select,
    /// `cosSliding`, `cosGlobal`: RoPE tables of the first layer of a kind.
    Cos(LayerKind),
    Sin(LayerKind),
    /// `maskSliding`, `maskGlobal`: the chunk graph's additive masks.
    Mask(LayerKind),
    /// `l{n}.k`, `l{n}.v`: a layer's cache, in and out.
    K(usize),
    V(usize),
    /// `ids`: the redecode graph's next ids.
    Ids,
    /// `pos`: contract v2's `i32 [1]` absolute position of a call's first row.
    Pos,
    /// `topk.logits`, `topk.ids`: the optional results of the prefill, chunk and step graphs
    /// exported with a top-k (`Manifest::top_k`): the best `k` logits of the last position,
    /// `f32 [k]`, sorted descending, ties lowest id first, and their ids, `i32 [k]`. They follow
    /// `token` in the canonical order.
    TopKLogits,
    TopKIds,
    /// `allowed`: contract v2's `i32 [ceil(vocab/32)]` allowed-token bitmask (bit `id % 32` of
    /// word `id / 32`, `kv_core::allowed::AllowedTokens`), the last argument of the prefill,
    /// chunk and step graphs of manifests with `allowedMask`: the token and top-k are taken over
    /// the allowed ids only.
    Allowed,
}

impl Name {
    /// Whether the LM head computes this result (`token`, top-k): what a prefill graph's
    /// token-less variants (`V2Spec::prefill_spans`) do not return.
    pub fn from_head(self) -> bool {
        matches!(self, Name::Token | Name::TopKLogits | Name::TopKIds)
    }

    /// The layer of a cache name.
    pub fn layer(self) -> Option<usize> {
        match self {
            Name::K(l) | Name::V(l) => Some(l),
            _ => None,
        }
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Name::Tokens => f.write_str("tokens"),
            Name::Token => f.write_str("token"),
            Name::Emb => f.write_str("emb"),
            Name::Select => f.write_str("select"),
            Name::Cos(kind) => write!(f, "cos{}", kind.name()),
            Name::Sin(kind) => write!(f, "sin{}", kind.name()),
            Name::Mask(kind) => write!(f, "mask{}", kind.name()),
            Name::K(layer) => write!(f, "l{layer}.k"),
            Name::V(layer) => write!(f, "l{layer}.v"),
            Name::Ids => f.write_str("ids"),
            Name::Pos => f.write_str("pos"),
            Name::TopKLogits => f.write_str("topk.logits"),
            Name::TopKIds => f.write_str("topk.ids"),
            Name::Allowed => f.write_str("allowed"),
        }
    }
}

/// A string that is no [`Name`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a graph argument or result name")]
pub struct UnknownName(pub String);

impl std::str::FromStr for Name {
    type Err = UnknownName;

    /// The inverse of `Display`; only the one spelling is accepted (`l01.k` and `l+1.k` are
    /// refused), so a manifest read and written again keeps its bytes.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let kind = |suffix: &str| LayerKind::ALL.into_iter().find(|k| k.name() == suffix);
        let layer = |digits: &str| digits.parse::<usize>().ok().filter(|n| n.to_string() == digits);
        let name = match s {
            "tokens" => Some(Name::Tokens),
            "token" => Some(Name::Token),
            "emb" => Some(Name::Emb),
            "select" => Some(Name::Select),
            "ids" => Some(Name::Ids),
            "pos" => Some(Name::Pos),
            "topk.logits" => Some(Name::TopKLogits),
            "topk.ids" => Some(Name::TopKIds),
            "allowed" => Some(Name::Allowed),
            _ => {
                if let Some(rest) = s.strip_prefix("cos") {
                    kind(rest).map(Name::Cos)
                } else if let Some(rest) = s.strip_prefix("sin") {
                    kind(rest).map(Name::Sin)
                } else if let Some(rest) = s.strip_prefix("mask") {
                    kind(rest).map(Name::Mask)
                } else if let Some(rest) = s.strip_prefix('l') {
                    match rest.rsplit_once('.') {
                        Some((digits, "k")) => layer(digits).map(Name::K),
                        Some((digits, "v")) => layer(digits).map(Name::V),
                        _ => None,
                    }
                } else {
                    None
                }
            }
        };
        name.ok_or_else(|| UnknownName(s.to_string()))
    }
}

impl Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = std::borrow::Cow::<str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The argument names of a graph in the contract's canonical order (CONTRACT §2).
pub fn canonical_args(graph: Graph, spec: &KvSpec) -> Vec<Name> {
    let mut args: Vec<Name> = Vec::new();
    match graph {
        Graph::Prefill => args.extend([Name::Tokens, Name::Emb, Name::Select]),
        Graph::Chunk | Graph::Step => {
            args.push(if graph == Graph::Chunk {
                Name::Tokens
            } else {
                Name::Token
            });
            args.push(Name::Emb);
            for layer in 0..spec.n_layers {
                let kind = spec.layer_kind(layer);
                let first = spec.first_layer_of(kind) == Some(layer);
                if first {
                    args.push(Name::Cos(kind));
                    args.push(Name::Sin(kind));
                }
                args.push(Name::K(layer));
                args.push(Name::V(layer));
                if first && graph == Graph::Chunk {
                    args.push(Name::Mask(kind));
                }
            }
            if graph == Graph::Chunk {
                args.push(Name::Select);
            }
        }
        Graph::Redecode => args.push(Name::Tokens),
        Graph::RedecodeAt => args.extend([Name::Tokens, Name::Select]),
    }
    args
}

/// The argument names of a contract v2 graph in canonical order (`docs/contract-v2.md`): the chunk
/// and step graphs take `pos` after the embedding rows, each layer's whole cache (no masks: they
/// are built in the graph from `pos`), and the chunk graph its `select` last. v2 has no prefill
/// graph (a prefill is chunk calls from position 0) and the redecode graphs are v1's.
pub fn canonical_args_v2(graph: Graph, spec: &KvSpec, v2: &V2Spec) -> Vec<Name> {
    match graph {
        Graph::Prefill if v2.prefill_chunk == 0 => Vec::new(),
        Graph::Prefill | Graph::Chunk | Graph::Step => {
            let mut args = vec![
                if graph != Graph::Step {
                    Name::Tokens
                } else {
                    Name::Token
                },
                Name::Emb,
                Name::Pos,
            ];
            for layer in 0..spec.n_layers {
                let kind = spec.layer_kind(layer);
                if spec.first_layer_of(kind) == Some(layer) {
                    args.push(Name::Cos(kind));
                    args.push(Name::Sin(kind));
                }
                args.push(Name::K(layer));
                args.push(Name::V(layer));
            }
            if graph != Graph::Step {
                args.push(Name::Select);
            }
            args
        }
        Graph::Redecode | Graph::RedecodeAt => canonical_args(graph, spec),
    }
}

/// The result names of a graph: every layer's K then V in layer order, the token last.
pub fn canonical_outputs(graph: Graph, spec: &KvSpec) -> Vec<Name> {
    match graph {
        Graph::Redecode => vec![Name::Ids],
        Graph::RedecodeAt => vec![Name::Token],
        Graph::Prefill | Graph::Chunk | Graph::Step => {
            let mut out: Vec<Name> = (0..spec.n_layers).flat_map(|l| [Name::K(l), Name::V(l)]).collect();
            out.push(Name::Token);
            out
        }
    }
}

/// Function names per graph key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Functions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_with_past: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub with_past: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redecode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redecode_at: Option<String>,
}

impl Functions {
    /// Module-qualified default names, e.g. `module.gemma_with_past`.
    pub fn with_prefix(prefix: &str) -> Self {
        let name = |g: Graph| Some(format!("module.{prefix}{}", g.function_suffix()));
        Functions {
            prefill: name(Graph::Prefill),
            prefill_with_past: name(Graph::Chunk),
            with_past: name(Graph::Step),
            redecode: name(Graph::Redecode),
            redecode_at: name(Graph::RedecodeAt),
        }
    }

    /// The prefill graph's token-less variant reading `span` rows of each cache
    /// (`V2Spec::prefill_spans`): `<prefill>_span<span>`, in the prefill graph's module.
    pub fn prefill_span(&self, span: usize) -> Option<String> {
        self.prefill.as_ref().map(|p| format!("{p}_span{span}"))
    }

    /// The chunk graph's variant over `rows` rows (`V2Spec::small_chunk`):
    /// `<chunk>_rows<rows>`, in the chunk graph's module, with its argument and result names.
    pub fn small_chunk(&self, rows: usize) -> Option<String> {
        self.prefill_with_past.as_ref().map(|c| format!("{c}_rows{rows}"))
    }

    /// The small chunk graph's variant reading `span` rows of each cache
    /// (`V2Spec::small_chunk_span`): `<chunk>_rows<rows>_span<span>`, beside it.
    pub fn small_chunk_span(&self, rows: usize, span: usize) -> Option<String> {
        self.small_chunk(rows).map(|c| format!("{c}_span{span}"))
    }

    pub fn get(&self, graph: Graph) -> Option<&str> {
        match graph {
            Graph::Prefill => self.prefill.as_deref(),
            Graph::Chunk => self.prefill_with_past.as_deref(),
            Graph::Step => self.with_past.as_deref(),
            Graph::Redecode => self.redecode.as_deref(),
            Graph::RedecodeAt => self.redecode_at.as_deref(),
        }
    }
}

/// The parameter scope of a module's encoded archive ([`Manifest::encoded_parameters`]).
pub const ENCODED_SCOPE: &str = "encoded";

/// Archive file(s): one shared by every graph, or one per graph key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Parameters {
    Shared(String),
    PerGraph(BTreeMap<String, String>),
}

/// The manifest. Unknown keys are ignored; missing geometry keys take FunctionGemma's values.
///
/// # Example
///
/// ```
/// use kv_core::manifest::{Graph, Manifest, Name};
///
/// // The seed's keys; what is missing takes FunctionGemma-270M's geometry.
/// let m = Manifest::from_json(r#"{"contractVersion": 1, "nLayers": 2, "chunk": 16}"#).unwrap();
/// m.validate().unwrap();
/// assert_eq!((m.spec.n_layers, m.spec.vocab_size), (2, 262144));
/// // Graph arguments are bound by name, in the order the compiled function takes them.
/// let step = m.args_or_canonical(Graph::Step);
/// assert_eq!(step[..2], [Name::Token, Name::Emb]);
/// assert_eq!(step.len(), 2 + 2 + 2 * 2); // token, emb; cos, sin of the sliding kind; K, V per layer
/// // A manifest that contradicts itself is an error, not a session that misreads memory.
/// let bad = Manifest::from_json(r#"{"nHeads": 4, "nKvHeads": 3}"#);
/// assert!(bad.and_then(|m| m.validate()).is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "wire::Manifest", try_from = "wire::Manifest")]
pub struct Manifest {
    /// `contractVersion`, and under v2 the cache layout (`slidingCacheRows`, `prefillChunk`,
    /// `prefillSpan`, `prefillSpans`, stored beside the geometry).
    pub contract: Contract,
    pub spec: KvSpec,
    pub functions: Functions,
    pub prefill_args: Option<Vec<Name>>,
    pub prefill_outputs: Option<Vec<Name>>,
    pub prefill_with_past_args: Option<Vec<Name>>,
    pub prefill_with_past_outputs: Option<Vec<Name>>,
    pub with_past_args: Option<Vec<Name>>,
    pub with_past_outputs: Option<Vec<Name>>,
    pub parameter_scope: String,
    pub parameters: Option<Parameters>,
    /// Archive entry of the `vocab × hidden` bf16 embedding table.
    pub embedding_parameter: Option<String>,
    /// Ours (contracts 1 and 2): a function of the step graph's module, `token [1] i32 → emb [1, hidden]
    /// f32`, that gathers the embedding row the host would (the same values): greedy decoding
    /// then feeds a step's token to the next step on the device, without a host read between
    /// them (`KvBackend::step_greedy`). Absent: every step's row is gathered on the host.
    pub embed_function: Option<String>,
    /// Ours: the prefill, chunk and step graphs also return [`Name::TopKLogits`] and [`Name::TopKIds`]
    /// of this many entries (for sampling); absent = they do not.
    pub top_k: Option<usize>,
    /// Ours, contract v2: the prefill, chunk and step graphs take [`Name::Allowed`] as their last
    /// argument and predict only allowed ids (`KvBackend::set_allowed`); absent: v2 exports made
    /// before the mask, which take no mask (re-export to constrain them).
    pub allowed_mask: bool,
    /// Ours: what a forward (the reference, the exporter) needs beyond the geometry.
    pub architecture: Option<Architecture>,
    /// Ours: which parameters of the archive are block-quantized (`crate::quant`); absent: all bf16.
    pub quantization: Option<crate::quantization::Quantization>,
    /// Ours: the type each projection's input (and the LM head's) is rounded to before its
    /// matmul ([`MatmulInput`]); absent: f32, no rounding.
    pub matmul_input: MatmulInput,
    /// Ours, contract v2: the element type of the KV caches and of the rows the graphs return
    /// for them ([`CacheType`]); absent: f32.
    pub cache_type: CacheType,
    /// Ours: the archive stores the projections that read one input as one matrix each
    /// ([`crate::params::FUSED_PROJECTIONS`], where their parts' formats agree); absent: apart.
    pub fused_projections: bool,
    /// Ours: the archive stores each layer's gate and up projections as one matrix
    /// ([`crate::params::FUSED_GATE_UP`]: the portable Vulkan profiles); absent: apart.
    pub fused_gate_up: bool,
    /// Ours: compiled modules, `target → graph key → .vmfb file`.
    pub modules: BTreeMap<String, BTreeMap<String, String>>,
    /// Ours: `.vmfb file → .irpa file` of the modules that read some weights already in the
    /// layout their kernels want (IREE's parameter encoder ran at export), under the scope
    /// [`ENCODED_SCOPE`], beside the archive of [`Self::parameters`] under [`Self::parameter_scope`].
    pub encoded_parameters: BTreeMap<String, String>,
    /// Ours: where the artifacts come from (compiler version, source checkpoint, ...).
    pub provenance: Provenance,
}

/// What a graph's projections multiply: the activation as it is (f32), or rounded to bf16 (to
/// nearest, ties to even) so that a bf16 weight meets a bf16 activation in the CPU's bf16 matmul
/// kernels (`vdpbf16ps`). The products of two bf16 are exact in f32 and are summed in f32, so
/// the rounding of the activation is the one difference from f32, and a forward that rounds the
/// same inputs (the reference, told by the manifest) computes the same values up to summation
/// order. Attention (QKᵀ, PV) and the norms stay f32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulInput {
    #[default]
    F32,
    Bf16,
}

impl MatmulInput {
    pub fn is_f32(&self) -> bool {
        *self == MatmulInput::F32
    }
}

/// The element type of contract v2's KV caches. With `f16`, each K and V row is rounded to f16
/// (to nearest, ties to even) where a layer computes it, before any attention reads it, so a
/// row attends the same whether it comes from the cache or from the call itself, and a forward
/// that rounds there too (the reference, told by the manifest) computes the same values. Half
/// the bytes of f32 for every cache read (the step reads every cache row) and every cache held
/// in memory; llama.cpp keeps its caches in f16 by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheType {
    #[default]
    F32,
    F16,
}

impl CacheType {
    pub fn is_f32(&self) -> bool {
        *self == CacheType::F32
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            CacheType::F32 => 4,
            CacheType::F16 => 2,
        }
    }

    /// `v` as a cache of this type holds it. f16: rounded to 10 mantissa bits (to nearest,
    /// ties to even), then ±inf beyond f16's largest finite value and ±0 below its smallest
    /// normal (2⁻¹⁴): XLA's `reduce_precision` to e5m10, what the graphs compute (it fuses into
    /// their dispatches where a `convert` pair does not). Subnormal f16 values are flushed: a
    /// K or V element that small (< 6.1e-5) is 0 in the cache.
    pub fn round(self, v: f32) -> f32 {
        match self {
            CacheType::F32 => v,
            CacheType::F16 => reduce_precision_e5m10(v),
        }
    }

    /// Little-endian elements of this type as f32 (exact). A ragged tail is an invariant
    /// violation: callers read whole rows.
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        let size = self.size();
        if bytes.len() % size != 0 {
            crate::error::invariant("cache bytes are whole elements");
        }
        match self {
            CacheType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            CacheType::F16 => {
                let halves: Vec<half::f16> = bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect();
                let mut out = vec![0f32; halves.len()];
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&halves[..], &mut out);
                out
            }
        }
    }

    /// `values` as little-endian elements of this type (f16: rounded to nearest, ties to even).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            CacheType::F32 => crate::bf16::f32_to_bytes(values),
            // (`round` first: the value is then an f16 exactly, or 0, or ±inf.)
            CacheType::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(self.round(v)).to_bits().to_le_bytes())
                .collect(),
        }
    }
}

/// XLA's `reduce_precision` of an f32 to 5 exponent and 10 mantissa bits (see
/// [`CacheType::round`]): the mantissa rounded to nearest even on the f32 bits, then the
/// exponent range checked on the rounded value.
fn reduce_precision_e5m10(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    const DROPPED: u32 = 23 - 10;
    let bits = v.to_bits();
    let half_ulp_minus_one = (1u32 << (DROPPED - 1)) - 1;
    let rounded = bits.wrapping_add(half_ulp_minus_one + ((bits >> DROPPED) & 1)) & !((1u32 << DROPPED) - 1);
    let r = f32::from_bits(rounded);
    if r.abs() > 65504.0 {
        f32::INFINITY.copysign(v)
    } else if r.abs() < f32::powi(2.0, -14) {
        0.0f32.copysign(v)
    } else {
        r
    }
}

/// What a forward rounds beyond FP32, as a manifest says: its `matmulInput` and `cacheType`. A
/// reference opened on a model's source directory takes an export's rounding with
/// [`Self::apply`], to compute what that export's graphs compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rounding {
    pub matmul_input: MatmulInput,
    pub cache_type: CacheType,
}

impl Rounding {
    /// No rounding: the FP32 forward.
    pub const FP32: Rounding = Rounding {
        matmul_input: MatmulInput::F32,
        cache_type: CacheType::F32,
    };

    pub fn of(manifest: &Manifest) -> Rounding {
        Rounding {
            matmul_input: manifest.matmul_input,
            cache_type: manifest.cache_type,
        }
    }

    /// `manifest` computing with this rounding.
    pub fn apply(self, manifest: &mut Manifest) {
        manifest.matmul_input = self.matmul_input;
        manifest.cache_type = self.cache_type;
    }

    pub fn is_fp32(self) -> bool {
        self == Rounding::FP32
    }
}

/// The manifest's `provenance`: facts about how the artifacts were made, for people and caches;
/// only [`Self::redecode_seq`] changes how they are run.
///
/// The spellings are those of the string map this replaces, so manifests written before and after
/// are the same bytes: every value is a JSON string (`redecodeSeq` is `"7"`, and the two maps are
/// JSON text inside a string), and the fields are declared in the alphabetical order of their keys
/// (the order the map wrote). Reading also takes a number or an object where this writes text.
/// Keys this runtime does not know are kept in [`Self::other`] and written back after the others.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Provenance {
    /// The `iree-compile` flags of every graph, when all graphs have the same (space-separated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile_flags: Option<String>,
    /// The compiler the modules were made with, e.g. `iree-base-compiler 3.13.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compiler: Option<String>,
    /// `target=device` pairs, comma-separated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<String>,
    /// The generator revision of a fixture model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixture_revision: Option<String>,
    /// Graph key → its `iree-compile` flags, when some graph has flags of its own.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "json_text")]
    pub graph_compile_flags: Option<BTreeMap<String, String>>,
    /// Who wrote the weights archive from a checkpoint (`gguf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub importer: Option<String>,
    /// The export layout (`Shared`, `Three`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// The three layout's archive keys: graph key → archive key → canonical parameter name.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "json_text")]
    pub parameter_keys: Option<BTreeMap<String, BTreeMap<String, String>>>,
    /// The fixed `SEQ` of the redecode graphs, when they were exported (else `seq`).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "decimal_text")]
    pub redecode_seq: Option<usize>,
    /// The model the artifacts were made from (a fixture name or a path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The checkpoint file an import read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_file: Option<String>,
    /// The checkpoint's own name (`general.name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_name: Option<String>,
    /// The compile targets, comma-separated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<String>,
    /// The exporter's weight format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_format: Option<String>,
    /// The importer's weight format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
    /// Keys of other writers, kept as they were.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

impl Provenance {
    pub fn is_empty(&self) -> bool {
        *self == Provenance::default()
    }
}

/// A value written as JSON text inside a string; read from that or from the value itself.
mod json_text {
    use serde::de::{DeserializeOwned, Error as _};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize, S: Serializer>(value: &Option<T>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => {
                let text = serde_json::to_string(value).map_err(serde::ser::Error::custom)?;
                serializer.serialize_str(&text)
            }
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(deserializer: D) -> Result<Option<T>, D::Error> {
        match Option::<serde_json::Value>::deserialize(deserializer)? {
            None => Ok(None),
            Some(serde_json::Value::String(text)) => serde_json::from_str(&text).map(Some).map_err(D::Error::custom),
            Some(value) => serde_json::from_value(value).map(Some).map_err(D::Error::custom),
        }
    }
}

/// A length written as a decimal string (`"7"`); read from that or from a number.
mod decimal_text {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<usize>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(n) => serializer.collect_str(n),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<usize>, D::Error> {
        match Option::<serde_json::Value>::deserialize(deserializer)? {
            None => Ok(None),
            Some(serde_json::Value::String(text)) => text
                .parse()
                .map(Some)
                .map_err(|_| D::Error::custom(format!("`{text}` is not a length"))),
            Some(value) => serde_json::from_value(value).map(Some).map_err(D::Error::custom),
        }
    }
}

/// The manifest as stored: `contractVersion` a number and contract v2's layout keys among the
/// geometry's (their order and spellings are what this runtime has always written, so a
/// manifest read and saved again keeps its bytes). [`super::Manifest`] converts from it, which
/// refuses a v2 key in a v1 manifest and a version this runtime does not speak.
mod wire {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    use super::{
        default_contract_version, default_scope, Architecture, CacheType, Functions, MatmulInput, Name, Parameters,
        Provenance,
    };
    use crate::contract::{Contract, V2Spec};
    use crate::spec::KvSpec;

    #[derive(Clone, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(super) struct Manifest {
        #[serde(default = "default_contract_version")]
        pub(super) contract_version: u32,
        #[serde(flatten)]
        pub(super) spec: KvSpec,
        #[serde(flatten)]
        pub(super) v2: V2Spec,
        #[serde(default)]
        pub(super) functions: Functions,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) prefill_args: Option<Vec<Name>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) prefill_outputs: Option<Vec<Name>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) prefill_with_past_args: Option<Vec<Name>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) prefill_with_past_outputs: Option<Vec<Name>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) with_past_args: Option<Vec<Name>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) with_past_outputs: Option<Vec<Name>>,
        #[serde(default = "default_scope")]
        pub(super) parameter_scope: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) parameters: Option<Parameters>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) embedding_parameter: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) embed_function: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) top_k: Option<usize>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub(super) allowed_mask: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) architecture: Option<Architecture>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(super) quantization: Option<crate::quantization::Quantization>,
        #[serde(default, skip_serializing_if = "MatmulInput::is_f32")]
        pub(super) matmul_input: MatmulInput,
        #[serde(default, skip_serializing_if = "CacheType::is_f32")]
        pub(super) cache_type: CacheType,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub(super) fused_projections: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub(super) fused_gate_up: bool,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub(super) modules: BTreeMap<String, BTreeMap<String, String>>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub(super) encoded_parameters: BTreeMap<String, String>,
        #[serde(default, skip_serializing_if = "Provenance::is_empty")]
        pub(super) provenance: Provenance,
    }

    /// The two conversions, which move every field but the contract as it is: `$field` lists
    /// them once (each struct literal must name every field, so one added to either struct and
    /// not here does not compile).
    macro_rules! conversions {
        ($($field:ident),* $(,)?) => {
            impl From<super::Manifest> for Manifest {
                fn from(m: super::Manifest) -> Self {
                    Manifest {
                        contract_version: m.contract.version().number(),
                        v2: m.contract.v2().cloned().unwrap_or_default(),
                        $($field: m.$field,)*
                    }
                }
            }

            impl TryFrom<Manifest> for super::Manifest {
                type Error = crate::Error;

                /// The version and the v2 keys become a [`Contract`]; everything else moves as it is.
                fn try_from(m: Manifest) -> crate::Result<Self> {
                    Ok(super::Manifest {
                        contract: contract(m.contract_version, m.v2)?,
                        $($field: m.$field,)*
                    })
                }
            }
        };
    }

    conversions!(
        spec,
        functions,
        prefill_args,
        prefill_outputs,
        prefill_with_past_args,
        prefill_with_past_outputs,
        with_past_args,
        with_past_outputs,
        parameter_scope,
        parameters,
        embedding_parameter,
        embed_function,
        top_k,
        allowed_mask,
        architecture,
        quantization,
        matmul_input,
        cache_type,
        fused_projections,
        fused_gate_up,
        modules,
        encoded_parameters,
        provenance,
    );

    /// `contractVersion` and the v2 keys as a [`Contract`]: a v2 key in a v1 manifest and a
    /// version this runtime does not speak are refused.
    fn contract(version: u32, v2: V2Spec) -> crate::Result<Contract> {
        use crate::contract::ContractVersion;
        match ContractVersion::try_from(version) {
            Ok(ContractVersion::V1) => match v2.first_key_set() {
                None => Ok(Contract::V1),
                Some(key) => Err(crate::Error::manifest(
                    key,
                    "contract v2's (contract v1 graphs take the rows a call needs: no ring, no prefill chunk or spans)",
                )),
            },
            Ok(ContractVersion::V2) => Ok(Contract::V2(v2)),
            Err(crate::contract::UnknownContractVersion(other)) => Err(crate::Error::manifest(
                "contractVersion",
                format!(
                    "{other} is not supported (this runtime speaks {} and {})",
                    ContractVersion::V1,
                    ContractVersion::V2
                ),
            )),
        }
    }
}

fn default_contract_version() -> u32 {
    CONTRACT_VERSION
}
fn default_scope() -> String {
    "model".into()
}

impl Manifest {
    /// A manifest with the canonical name lists and default function names.
    pub fn new(spec: KvSpec, architecture: Option<Architecture>, prefix: &str) -> Self {
        let lists = |g| (Some(canonical_args(g, &spec)), Some(canonical_outputs(g, &spec)));
        let (prefill_args, prefill_outputs) = lists(Graph::Prefill);
        let (prefill_with_past_args, prefill_with_past_outputs) = lists(Graph::Chunk);
        let (with_past_args, with_past_outputs) = lists(Graph::Step);
        Manifest {
            contract: Contract::V1,
            spec,
            functions: Functions::with_prefix(prefix),
            prefill_args,
            prefill_outputs,
            prefill_with_past_args,
            prefill_with_past_outputs,
            with_past_args,
            with_past_outputs,
            parameter_scope: default_scope(),
            parameters: None,
            embedding_parameter: None,
            embed_function: None,
            top_k: None,
            allowed_mask: false,
            architecture,
            quantization: None,
            matmul_input: MatmulInput::F32,
            cache_type: CacheType::F32,
            fused_projections: false,
            fused_gate_up: false,
            modules: BTreeMap::new(),
            encoded_parameters: BTreeMap::new(),
            provenance: Provenance::default(),
        }
    }

    pub fn from_json(text: &str) -> Result<Self> {
        parse(text, "<string>")
    }

    /// Reads and validates `dir/manifest.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            what: "reading manifest",
            path: path.display().to_string(),
            source,
        })?;
        parse(&text, &path.display().to_string())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| crate::error::invariant(&format!("manifest serialises: {e}")))
    }

    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(MANIFEST_FILE);
        std::fs::write(&path, self.to_json()).map_err(|source| Error::Io {
            what: "writing manifest",
            path: path.display().to_string(),
            source,
        })?;
        Ok(path)
    }

    pub fn validate(&self) -> Result<()> {
        self.spec.validate()?;
        match &self.contract {
            Contract::V1 => {
                if !self.cache_type.is_f32() && !self.modules.is_empty() {
                    return Err(Error::manifest(
                        "cacheType",
                        "contract v2's (the caches of contract v1 graphs are f32 inputs and outputs)",
                    ));
                }
                if self.allowed_mask {
                    return Err(Error::manifest(
                        "allowedMask",
                        "contract v2's (contract v1 graphs take no allowed-token mask)",
                    ));
                }
            }
            Contract::V2(v2) => {
                if v2.prefill_chunk == 0
                    && (self.functions.prefill.is_some()
                        || self.prefill_args.is_some()
                        || self.prefill_outputs.is_some())
                {
                    return Err(Error::manifest(
                        "functions.prefill",
                        "this contract v2 manifest has no prefill graph (no prefillChunk: a prefill is chunk calls from position 0)",
                    ));
                }
                if !v2.prefill_spans.is_empty() && self.functions.prefill.is_none() {
                    return Err(Error::manifest(
                        "prefillSpans",
                        "variants of a prefill graph this manifest does not name (functions.prefill)",
                    ));
                }
                if v2.small_chunk != 0 && self.functions.prefill_with_past.is_none() {
                    return Err(Error::manifest(
                        "smallChunk",
                        "a variant of a chunk graph this manifest does not name (functions.prefillWithPast)",
                    ));
                }
                v2.validate(&self.spec)?;
            }
        }
        if let Some(q) = &self.quantization {
            q.validate()?;
        }
        if let Some(arch) = &self.architecture {
            arch.validate()?;
        }
        if let Some(k) = self.top_k {
            if k == 0 || k > self.spec.vocab_size {
                return Err(Error::manifest(
                    "topK",
                    format!("{k} must be in 1..={} (the vocabulary)", self.spec.vocab_size),
                ));
            }
            crate::limits::check_top_k("manifest `topK`", k)?;
        }
        for &graph in self.kv_graphs() {
            let (args_key, outputs_key) = list_keys(graph);
            if let Some(args) = self.args(graph) {
                check_same_names(args_key, args, &self.canonical_args(graph))?;
            }
            if let Some(outputs) = self.outputs(graph) {
                if self.top_k.is_none() {
                    if let Some(extra) = outputs.iter().find(|n| matches!(n, Name::TopKLogits | Name::TopKIds)) {
                        return Err(Error::manifest(
                            outputs_key,
                            format!("`{extra}` is listed but `topK` is not set"),
                        ));
                    }
                }
                check_same_names(outputs_key, outputs, &self.canonical_outputs(graph))?;
            }
        }
        if self.parameter_scope.is_empty() {
            return Err(Error::manifest("parameterScope", "must not be empty"));
        }
        if self.parameter_scope == ENCODED_SCOPE && !self.encoded_parameters.is_empty() {
            return Err(Error::manifest(
                "parameterScope",
                format!("`{ENCODED_SCOPE}` is the scope of the encoded archives"),
            ));
        }
        let vmfbs: std::collections::BTreeSet<&String> = self.modules.values().flat_map(|m| m.values()).collect();
        if let Some(stray) = self.encoded_parameters.keys().find(|v| !vmfbs.contains(v)) {
            return Err(Error::manifest(
                "encodedParameters",
                format!("`{stray}` is not a module of `modules`"),
            ));
        }
        Ok(())
    }

    /// Whether the graphs follow contract v2 (`docs/contract-v2.md`).
    pub fn is_v2(&self) -> bool {
        matches!(self.contract, Contract::V2(_))
    }

    /// Contract v2's cache layout; `None` under v1.
    pub fn v2(&self) -> Option<&V2Spec> {
        self.contract.v2()
    }

    /// The KV graphs of this manifest's contract: v1 has a prefill graph, v2 one only with a
    /// `prefillChunk` (a chunk graph of that many rows).
    pub fn kv_graphs(&self) -> &'static [Graph] {
        match &self.contract {
            Contract::V2(v2) if v2.prefill_chunk == 0 => &[Graph::Chunk, Graph::Step],
            _ => &Graph::KV,
        }
    }

    /// The canonical argument names of a graph under this manifest's contract.
    pub fn canonical_args(&self, graph: Graph) -> Vec<Name> {
        match &self.contract {
            Contract::V1 => canonical_args(graph, &self.spec),
            Contract::V2(v2) => {
                let mut args = canonical_args_v2(graph, &self.spec, v2);
                if self.allowed_mask && !args.is_empty() && Graph::KV.contains(&graph) {
                    args.push(Name::Allowed);
                }
                args
            }
        }
    }

    /// This manifest turned into contract v2 with the layout `v2`: the v2 argument lists
    /// (outputs keep their names: v2 returns the new rows under the cache names), and no
    /// prefill function or lists unless the layout has a `prefillChunk`.
    pub fn into_v2(mut self, v2: V2Spec) -> Self {
        let prefill = v2.prefill_chunk != 0;
        self.contract = Contract::V2(v2);
        if !prefill {
            self.functions.prefill = None;
            self.prefill_args = None;
        } else {
            self.prefill_args = Some(self.canonical_args(Graph::Prefill));
        }
        self.prefill_outputs = None;
        self.prefill_with_past_args = Some(self.canonical_args(Graph::Chunk));
        self.with_past_args = Some(self.canonical_args(Graph::Step));
        self
    }

    /// The argument names of a graph, in the order the compiled function takes them.
    pub fn args(&self, graph: Graph) -> Option<&[Name]> {
        match graph {
            Graph::Prefill => self.prefill_args.as_deref(),
            Graph::Chunk => self.prefill_with_past_args.as_deref(),
            Graph::Step => self.with_past_args.as_deref(),
            _ => None,
        }
    }

    /// The argument names, falling back to the canonical order when the manifest has no list.
    pub fn args_or_canonical(&self, graph: Graph) -> Vec<Name> {
        self.args(graph)
            .map(<[Name]>::to_vec)
            .unwrap_or_else(|| self.canonical_args(graph))
    }

    pub fn outputs(&self, graph: Graph) -> Option<&[Name]> {
        match graph {
            Graph::Prefill => self.prefill_outputs.as_deref(),
            Graph::Chunk => self.prefill_with_past_outputs.as_deref(),
            Graph::Step => self.with_past_outputs.as_deref(),
            _ => None,
        }
    }

    pub fn outputs_or_canonical(&self, graph: Graph) -> Vec<Name> {
        self.outputs(graph)
            .map(<[Name]>::to_vec)
            .unwrap_or_else(|| self.canonical_outputs(graph))
    }

    /// [`canonical_outputs`], then the top-k results where [`Self::top_k`] is set.
    pub fn canonical_outputs(&self, graph: Graph) -> Vec<Name> {
        let mut out = canonical_outputs(graph, &self.spec);
        if self.top_k.is_some() && Graph::KV.contains(&graph) {
            out.extend([Name::TopKLogits, Name::TopKIds]);
        }
        out
    }

    /// Sets [`Self::top_k`] and adds (or removes) the top-k results at the end of the prefill,
    /// chunk and step output lists the manifest has.
    pub fn set_top_k(&mut self, k: Option<usize>) {
        self.top_k = k;
        for list in [
            &mut self.prefill_outputs,
            &mut self.prefill_with_past_outputs,
            &mut self.with_past_outputs,
        ]
        .into_iter()
        .flatten()
        {
            list.retain(|n| !matches!(n, Name::TopKLogits | Name::TopKIds));
            if k.is_some() {
                list.extend([Name::TopKLogits, Name::TopKIds]);
            }
        }
    }

    /// Sets [`Self::allowed_mask`] and adds (or removes) [`Name::Allowed`] at the end of the
    /// prefill, chunk and step argument lists the manifest has.
    pub fn set_allowed_mask(&mut self, on: bool) {
        self.allowed_mask = on;
        for list in [
            &mut self.prefill_args,
            &mut self.prefill_with_past_args,
            &mut self.with_past_args,
        ]
        .into_iter()
        .flatten()
        {
            list.retain(|n| *n != Name::Allowed);
            if on {
                list.push(Name::Allowed);
            }
        }
    }

    /// The encoded archive `vmfb` (a file name of [`Self::modules`]) reads under [`ENCODED_SCOPE`],
    /// if it has one.
    pub fn encoded_parameter_file(&self, vmfb: &str) -> Option<&str> {
        self.encoded_parameters.get(vmfb).map(String::as_str)
    }

    /// The archive file holding a graph's parameters, if the manifest names one.
    pub fn parameter_file(&self, graph: Graph) -> Option<&str> {
        match self.parameters.as_ref()? {
            Parameters::Shared(file) => Some(file),
            Parameters::PerGraph(map) => map.get(graph.key()).map(String::as_str),
        }
    }

    /// The groups of projections the archive stores as one matrix each.
    pub fn fusion(&self) -> crate::params::Fusion {
        crate::params::Fusion {
            projections: self.fused_projections,
            gate_up: self.fused_gate_up,
        }
    }

    /// The archive holding the full, canonically named weights (the reference reads it).
    pub fn weights_file(&self) -> Option<&str> {
        match self.parameters.as_ref()? {
            Parameters::Shared(file) => Some(file),
            Parameters::PerGraph(map) => map
                .get("weights")
                .or_else(|| map.get(Graph::Step.key()))
                .map(String::as_str),
        }
    }

    pub fn require_architecture(&self) -> Result<&Architecture> {
        self.architecture
            .as_ref()
            .ok_or_else(|| Error::manifest("architecture", "missing; this backend needs the architecture facts"))
    }
}

/// Parses and validates; a type error names the key it sits under.
fn parse(text: &str, origin: &str) -> Result<Manifest> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|source| Error::ManifestParse {
        path: origin.into(),
        source,
    })?;
    let keyed = |e: serde_path_to_error::Error<serde_json::Error>| {
        let key = e.path().to_string();
        Error::manifest(key, format!("{} (in {origin})", e.into_inner()))
    };
    // The geometry is flattened into the manifest, where serde forgets the key of a type error:
    // read it on its own first so the error names the key.
    serde_path_to_error::deserialize::<_, KvSpec>(&value).map_err(keyed)?;
    serde_path_to_error::deserialize::<_, V2Spec>(&value).map_err(keyed)?;
    let stored: wire::Manifest = serde_path_to_error::deserialize(&value).map_err(keyed)?;
    let manifest = Manifest::try_from(stored)?;
    manifest.validate()?;
    Ok(manifest)
}

fn list_keys(graph: Graph) -> (&'static str, &'static str) {
    match graph {
        Graph::Prefill => ("prefillArgs", "prefillOutputs"),
        Graph::Chunk => ("prefillWithPastArgs", "prefillWithPastOutputs"),
        Graph::Step => ("withPastArgs", "withPastOutputs"),
        Graph::Redecode => ("redecodeArgs", "redecodeOutputs"),
        Graph::RedecodeAt => ("redecodeAtArgs", "redecodeAtOutputs"),
    }
}

/// The manifest may order names as it likes, but must hold exactly the contract's names once.
fn check_same_names(key: &str, got: &[Name], want: &[Name]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for name in got {
        if !seen.insert(*name) {
            return Err(Error::manifest(key, format!("`{name}` is listed twice")));
        }
        if !want.contains(name) {
            return Err(Error::manifest(
                key,
                format!("`{name}` is not an argument of this graph for this spec"),
            ));
        }
    }
    if let Some(missing) = want.iter().find(|n| !seen.contains(*n)) {
        return Err(Error::manifest(key, format!("`{missing}` is missing")));
    }
    Ok(())
}
