//! The model geometry (`KvSpec`) and the architecture facts the graphs and the reference share.
//! Keys and defaults follow CONTRACT §1: a missing geometry key takes FunctionGemma-270M's value.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::limits::{
    check, check_buffer, check_positions, too_large, MAX_CACHE_BYTES, MAX_HEADS, MAX_HEAD_DIM, MAX_HIDDEN, MAX_LAYERS,
    MAX_POSITIONS, MAX_VOCAB,
};

/// Which attention a layer uses. Decided by `globalLayerPeriod`, and only when a window exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LayerKind {
    Sliding,
    Global,
}

impl LayerKind {
    pub const ALL: [LayerKind; 2] = [LayerKind::Sliding, LayerKind::Global];

    /// The suffix of the manifest argument names (`cosSliding`, `maskGlobal`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Sliding => "Sliding",
            LayerKind::Global => "Global",
        }
    }
}

/// The geometry of a KV-cache graph set, as stored in `manifest.json`. Contract v2's cache
/// layout (ring rows, prefill graph) is [`crate::contract::V2Spec`], beside it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct KvSpec {
    pub n_layers: usize,
    pub head_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// Keys a sliding layer sees, counting the query itself; 0 = no sliding layers.
    pub sliding_window: usize,
    pub global_layer_period: usize,
    /// Fixed token count `C` of the chunk graph.
    pub chunk: usize,
    /// Fixed length of the prefill (and redecode) graph.
    pub seq: usize,
    pub max_positions: usize,
    pub sliding_rope_base: f32,
    pub global_rope_base: f32,
    /// Head dimension of the chunk mask: 0 = `nHeads`, 1 = broadcast over heads.
    pub mask_heads: usize,
}

/// Rows a default ring holds beyond the window (before rounding up to 64): how far a session may
/// write past a snapshot before it must copy the ring (an utterance and its answer, for
/// FunctionGemma's tool calls).
pub const DEFAULT_RING_SLACK: usize = 128;

impl Default for KvSpec {
    /// FunctionGemma-270M, the seed's model.
    fn default() -> Self {
        KvSpec {
            n_layers: 18,
            head_dim: 256,
            n_heads: 4,
            n_kv_heads: 1,
            hidden_size: 640,
            vocab_size: 262_144,
            sliding_window: 512,
            global_layer_period: 6,
            chunk: 32,
            seq: 1024,
            max_positions: 2048,
            sliding_rope_base: 10_000.0,
            global_rope_base: 1_000_000.0,
            mask_heads: 0,
        }
    }
}

impl KvSpec {
    /// Checks that the spec does not contradict itself and that every size is within
    /// [`crate::limits`] ([`Error::TooLarge`]); the error names the offending key.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("nLayers", self.n_layers),
            ("headDim", self.head_dim),
            ("nHeads", self.n_heads),
            ("nKvHeads", self.n_kv_heads),
            ("hiddenSize", self.hidden_size),
            ("vocabSize", self.vocab_size),
            ("globalLayerPeriod", self.global_layer_period),
            ("chunk", self.chunk),
            ("seq", self.seq),
            ("maxPositions", self.max_positions),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(Error::manifest(key, "must be positive"));
            }
        }
        check_limits(self)?;
        if self.head_dim % 2 != 0 {
            return Err(Error::manifest(
                "headDim",
                format!("{} is odd; split-half RoPE needs an even width", self.head_dim),
            ));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return Err(Error::manifest(
                "nKvHeads",
                format!(
                    "nHeads {} is not a multiple of nKvHeads {}",
                    self.n_heads, self.n_kv_heads
                ),
            ));
        }
        if self.sliding_window == 1 {
            return Err(Error::manifest(
                "slidingWindow",
                "a window of 1 leaves a step call no past rows; use 0 (none) or >= 2",
            ));
        }
        if self.mask_heads > 1 {
            return Err(Error::manifest(
                "maskHeads",
                format!("{} is neither 0 (nHeads) nor 1 (broadcast)", self.mask_heads),
            ));
        }
        if self.seq > self.max_positions {
            return Err(Error::manifest(
                "seq",
                format!("{} exceeds maxPositions {}", self.seq, self.max_positions),
            ));
        }
        for (key, base) in [
            ("slidingRopeBase", self.sliding_rope_base),
            ("globalRopeBase", self.global_rope_base),
        ] {
            if !(base.is_finite() && base > 1.0) {
                return Err(Error::manifest(key, format!("{base} is not a RoPE base > 1")));
            }
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(Error::manifest("vocabSize", "exceeds the i32 token range"));
        }
        Ok(())
    }

    /// The `slidingCacheRows` of a ring holding the window and `slack` rows more (`None`:
    /// [`DEFAULT_RING_SLACK`], rounded up to 64 rows, the GPU's softmax tiles), at least a
    /// chunk; 0 (a linear cache) without a window or when the ring would not be smaller.
    pub fn ring_rows(&self, slack: Option<usize>) -> usize {
        if self.sliding_window == 0 {
            return 0;
        }
        let rows = match slack {
            Some(slack) => self.sliding_window.saturating_add(slack.max(1)),
            None => (self.sliding_window + DEFAULT_RING_SLACK).div_ceil(64) * 64,
        }
        .max(self.chunk);
        if rows < self.max_positions {
            rows
        } else {
            0
        }
    }

    /// Layer `l` is global iff `l % period == period - 1`; without a window every layer is global.
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        if self.sliding_window == 0 || layer % self.global_layer_period == self.global_layer_period - 1 {
            LayerKind::Global
        } else {
            LayerKind::Sliding
        }
    }

    /// The window a layer of this kind applies, `None` for global layers.
    pub fn window(&self, kind: LayerKind) -> Option<usize> {
        match kind {
            LayerKind::Sliding => Some(self.sliding_window),
            LayerKind::Global => None,
        }
    }

    pub fn rope_base(&self, kind: LayerKind) -> f32 {
        match kind {
            LayerKind::Sliding => self.sliding_rope_base,
            LayerKind::Global => self.global_rope_base,
        }
    }

    /// The kinds present in this model, in the order their first layer appears.
    pub fn kinds_present(&self) -> Vec<LayerKind> {
        let mut kinds = Vec::with_capacity(2);
        for layer in 0..self.n_layers {
            let kind = self.layer_kind(layer);
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        kinds
    }

    /// The first layer of a kind, where the chunk and step graphs take that kind's tables.
    pub fn first_layer_of(&self, kind: LayerKind) -> Option<usize> {
        (0..self.n_layers).find(|&l| self.layer_kind(l) == kind)
    }

    /// Number of mask heads in the chunk graph's mask tensor.
    pub fn mask_head_count(&self) -> usize {
        if self.mask_heads == 0 {
            self.n_heads
        } else {
            1
        }
    }

    /// Checks token ids against the vocabulary; the error names the first bad one.
    pub fn check_tokens(&self, op: &'static str, tokens: &[i32]) -> Result<()> {
        match tokens.iter().position(|&t| t < 0 || t as usize >= self.vocab_size) {
            None => Ok(()),
            Some(index) => Err(Error::TokenOutOfRange {
                op,
                index,
                id: tokens[index] as i64,
                vocab: self.vocab_size,
            }),
        }
    }
}

/// Architecture families the reference and the exporter implement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Gemma 3: sliding and global layers, QK-norm, pre- and post-norms, GeGLU, embeddings x sqrt(hidden).
    Gemma3,
    /// Llama: SmolLM2; with `attnBias` Qwen2, with `qkNorm` Qwen3.
    Llama,
}

impl Family {
    /// The default function-name prefix (`gemma` keeps the artifacts drop-in for the seed's Kotlin).
    pub fn default_prefix(self) -> &'static str {
        match self {
            Family::Gemma3 => "gemma",
            Family::Llama => "llama",
        }
    }
}

/// The feed-forward activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `gelu(gate, tanh approximation) * up`
    GeluTanh,
    /// `silu(gate) * up`
    Silu,
}

/// The facts beyond the cache geometry that a forward needs. Ours, not the seed's: seed manifests
/// lack it, and a backend that only runs compiled graphs does not need it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Architecture {
    pub family: Family,
    pub ffn_size: usize,
    pub rms_eps: f32,
    /// Multiplies the queries before the dot product (Gemma 3 270M: 1/16; Llama: 1/sqrt(headDim)).
    pub query_scale: f32,
    /// Multiplies the gathered embedding rows inside the graph (Gemma: sqrt(hidden); Llama: 1).
    pub embed_scale: f32,
    pub activation: Activation,
    /// Per-head RMSNorm of queries and keys before RoPE (Gemma 3, Qwen3).
    pub qk_norm: bool,
    /// Biases on the q/k/v projections (Qwen2).
    pub attn_bias: bool,
    /// Norms after attention and after the MLP, before the residual add (Gemma 3).
    pub post_norms: bool,
    /// The output projection is the embedding table.
    pub tied_output: bool,
}

impl Architecture {
    pub fn gemma3(spec: &KvSpec, ffn_size: usize) -> Self {
        Architecture {
            family: Family::Gemma3,
            ffn_size,
            rms_eps: 1e-6,
            query_scale: 1.0 / (spec.head_dim as f32).sqrt(),
            embed_scale: (spec.hidden_size as f32).sqrt(),
            activation: Activation::GeluTanh,
            qk_norm: true,
            attn_bias: false,
            post_norms: true,
            tied_output: true,
        }
    }

    pub fn llama(spec: &KvSpec, ffn_size: usize) -> Self {
        Architecture {
            family: Family::Llama,
            ffn_size,
            rms_eps: 1e-5,
            query_scale: 1.0 / (spec.head_dim as f32).sqrt(),
            embed_scale: 1.0,
            activation: Activation::Silu,
            qk_norm: false,
            attn_bias: false,
            post_norms: false,
            tied_output: true,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.ffn_size == 0 {
            return Err(Error::manifest("architecture.ffnSize", "must be positive"));
        }
        crate::limits::check(
            "manifest `architecture.ffnSize`",
            self.ffn_size,
            crate::limits::MAX_FFN,
            "kv_core::limits::MAX_FFN",
        )?;
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(Error::manifest("architecture.rmsEps", "must be a positive number"));
        }
        Ok(())
    }
}

/// Checks every size of `spec` against [`crate::limits`], each key before anything is computed
/// from it, then the buffers the geometry implies. Called by [`KvSpec::validate`].
fn check_limits(spec: &KvSpec) -> Result<()> {
    let key = |k: &str| format!("spec `{k}`");
    let m = "kv_core::limits::";
    for (k, value, limit, bound) in [
        ("nLayers", spec.n_layers, MAX_LAYERS, "MAX_LAYERS"),
        ("nHeads", spec.n_heads, MAX_HEADS, "MAX_HEADS"),
        ("nKvHeads", spec.n_kv_heads, MAX_HEADS, "MAX_HEADS"),
        ("headDim", spec.head_dim, MAX_HEAD_DIM, "MAX_HEAD_DIM"),
        ("hiddenSize", spec.hidden_size, MAX_HIDDEN, "MAX_HIDDEN"),
        ("vocabSize", spec.vocab_size, MAX_VOCAB, "MAX_VOCAB"),
        ("maxPositions", spec.max_positions, MAX_POSITIONS, "MAX_POSITIONS"),
    ] {
        check(key(k), value, limit, &format!("{m}{bound}"))?;
    }
    for (k, value) in [
        ("seq", spec.seq),
        ("chunk", spec.chunk),
        ("slidingWindow", spec.sliding_window),
        ("globalLayerPeriod", spec.global_layer_period),
    ] {
        check_positions(key(k), value)?;
    }
    // A chunk call holds `chunk` new positions: more than the context can never be fed (the
    // other counts' relations to maxPositions are `KvSpec::validate`'s).
    check(key("chunk"), spec.chunk, spec.max_positions, "the spec's maxPositions")?;
    // Every factor is bounded above, so these products fit u128.
    let [layers, heads, kv, d, hidden, vocab, positions, seq, chunk] = [
        spec.n_layers,
        spec.n_heads,
        spec.n_kv_heads,
        spec.head_dim,
        spec.hidden_size,
        spec.vocab_size,
        spec.max_positions,
        spec.seq,
        spec.chunk,
    ]
    .map(|n| n as u128);
    let cache = positions * kv * d;
    check_buffer(
        format!("a layer's cache (maxPositions {positions} × nKvHeads {kv} × headDim {d})"),
        cache,
    )?;
    let all = cache * 2 * layers * 4;
    if all > MAX_CACHE_BYTES as u128 {
        return Err(too_large(
            &format!("the session's caches (2 × nLayers {layers} × maxPositions {positions} × nKvHeads {kv} × headDim {d}, bytes)"),
            all,
            MAX_CACHE_BYTES as u128,
            "kv_core::limits::MAX_CACHE_BYTES",
        ));
    }
    check_buffer(
        format!("a chunk call's scores (nHeads {heads} × chunk {chunk} × (maxPositions {positions} + chunk))"),
        heads * chunk * (positions + chunk),
    )?;
    check_buffer(
        format!("a prefill's scores (nHeads {heads} × seq {seq} × seq)"),
        heads * seq * seq,
    )?;
    check_buffer(
        format!("the embedding table (vocabSize {vocab} × hiddenSize {hidden})"),
        vocab * hidden,
    )?;
    Ok(())
}

impl KvSpec {
    /// A redecode graph of `seq` rows on this spec: at most the context, and its scores and
    /// per-row logits (`seq × vocabSize`) within [`crate::limits::MAX_BUFFER_BYTES`]. `what` names where
    /// `seq` came from.
    pub fn check_redecode_seq(&self, what: impl AsRef<str>, seq: usize) -> Result<()> {
        check_redecode_seq(what, self, seq)
    }
}

fn check_redecode_seq(what: impl AsRef<str>, spec: &KvSpec, seq: usize) -> Result<()> {
    let what = what.as_ref();
    check_positions(what, seq)?;
    check(what, seq, spec.max_positions, "the model's maxPositions")?;
    let (s, heads, vocab) = (seq as u128, spec.n_heads as u128, spec.vocab_size as u128);
    check_buffer(format!("{what}: the logits (seq {s} × vocabSize {vocab})"), s * vocab)?;
    check_buffer(
        format!("{what}: the scores (nHeads {heads} × seq {s} × seq)"),
        heads * s * s,
    )
}

#[cfg(test)]
mod limit_tests {
    use super::*;

    #[test]
    fn the_default_spec_is_far_inside_the_limits() {
        check_limits(&KvSpec::default()).unwrap();
    }

    #[test]
    fn sizes_whose_product_overflows_are_refused_not_wrapped() {
        let spec = KvSpec {
            max_positions: MAX_POSITIONS,
            seq: MAX_POSITIONS,
            chunk: MAX_POSITIONS,
            n_heads: MAX_HEADS,
            ..KvSpec::default()
        };
        let e = check_limits(&spec).unwrap_err();
        assert!(
            matches!(&e, Error::TooLarge { bound, .. } if bound.contains("MAX_BUFFER_BYTES")),
            "{e}"
        );
    }
}
