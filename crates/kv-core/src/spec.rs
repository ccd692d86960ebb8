//! The model geometry (`KvSpec`) and the architecture facts the graphs and the reference share.
//! Keys and defaults follow CONTRACT §1: a missing geometry key takes FunctionGemma-270M's value.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

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

/// The geometry of a KV-cache graph set, as stored in `manifest.json`.
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
    /// Contract v2: a sliding layer's cache is a ring of this many rows (position `p` in row
    /// `p mod rows`, [`crate::ring`]); 0 = a linear cache of `maxPositions` rows like a global
    /// layer's.
    #[serde(skip_serializing_if = "is_zero")]
    pub sliding_cache_rows: usize,
    /// Contract v2: the rows of its prefill graph, a chunk graph that long prefills run in
    /// pieces of this size before the chunk graph takes the rest; 0 = none (a prefill is chunk
    /// calls only).
    #[serde(skip_serializing_if = "is_zero")]
    pub prefill_chunk: usize,
    /// Contract v2: the rows of each cache the prefill graph reads, from row 0
    /// ([`Self::span_rows`]); 0 = every row. The prefill graph runs only in a prefill, whose
    /// calls start at position 0 and end at or before `seq` rounded up to `prefillChunk`, so
    /// the rows after that hold no position any of its calls sees (checked per call).
    #[serde(skip_serializing_if = "is_zero")]
    pub prefill_span: usize,
    /// Contract v2: ascending spans of the prefill graph's token-less variants
    /// (`<prefill function>_span<S>`, the new K/V rows only): a prefill call other than its
    /// last, ending at or before `S`, runs the smallest that holds it and so reads `S` rows of
    /// each cache (not all of them) and skips the LM head.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefill_spans: Vec<usize>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Rows a default ring holds beyond the window (before rounding up to 64): how far a session may
/// write past a snapshot before it must copy the ring (an utterance and its answer, for
/// FunctionGemma's tool calls).
pub const DEFAULT_RING_SLACK: usize = 128;

/// Rows of contract v2's prefill graph by default: per row, a call of 128 rows costs 0.7× one of
/// 32 on the CPU (the weights are read once per call), and 256 no less (`docs/journal`, session 8).
pub const DEFAULT_PREFILL_CHUNK: usize = 128;

/// Token-less prefill variants an export makes at most ([`KvSpec::default_prefill_spans`]):
/// the largest spans are kept, as they serve most calls of a long prefill.
pub const MAX_PREFILL_SPANS: usize = 2;

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
            sliding_cache_rows: 0,
            prefill_chunk: 0,
            prefill_span: 0,
            prefill_spans: Vec::new(),
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
        crate::limits::check_spec(self)?;
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
        self.validate_ring()?;
        let rows = self.prefill_chunk;
        if rows != 0
            && (rows <= self.chunk
                || rows > self.max_positions
                || (self.sliding_cache_rows != 0 && rows > self.sliding_cache_rows))
        {
            return Err(Error::manifest(
                "prefillChunk",
                format!(
                    "{rows} rows must exceed chunk {} and fit maxPositions {} and a sliding ring ({} rows)",
                    self.chunk, self.max_positions, self.sliding_cache_rows
                ),
            ));
        }
        self.validate_spans()
    }

    fn validate_spans(&self) -> Result<()> {
        let rows = self.prefill_chunk;
        let span = self.prefill_span;
        if span != 0 {
            let needed = self.seq.div_ceil(rows.max(1)) * rows;
            if rows == 0 || span < needed || span >= self.max_positions {
                return Err(Error::manifest(
                    "prefillSpan",
                    format!(
                        "{span} must hold a prefill of seq {} in calls of prefillChunk {rows} ({needed} rows) and stay below maxPositions {}",
                        self.seq, self.max_positions
                    ),
                ));
            }
        }
        let top = self.prefill_graph_span();
        let mut below = 0;
        for &s in &self.prefill_spans {
            if rows == 0 || s < rows || s <= below || s >= top {
                return Err(Error::manifest(
                    "prefillSpans",
                    format!(
                        "{:?}: ascending spans of at least prefillChunk {rows}, each below the prefill graph's span {top}",
                        self.prefill_spans
                    ),
                ));
            }
            below = s;
        }
        Ok(())
    }

    /// Contract v2: the span of the prefill graph itself (`prefillSpan`, or `maxPositions`).
    pub fn prefill_graph_span(&self) -> usize {
        match self.prefill_span {
            0 => self.max_positions,
            span => span,
        }
    }

    /// Contract v2: the rows of a layer kind's cache that a graph reading `span` rows takes
    /// (its first `span` rows, or all of a smaller cache).
    pub fn span_rows(&self, kind: LayerKind, span: usize) -> usize {
        self.cache_rows(kind).min(span)
    }

    /// The geometry a graph reading `span` rows of each cache sees, for calls that end at or
    /// before position `span`: every cache has [`Self::span_rows`] rows, and a ring of at
    /// least `span` rows reads as a linear cache (no call so far has wrapped it, so row `k`
    /// holds position `k`, which the linear masks say too). A smaller ring stays a ring of its
    /// own rows. `span` at or above `maxPositions` changes nothing.
    pub fn spanned(&self, span: usize) -> KvSpec {
        let mut spec = self.clone();
        if span < self.max_positions {
            spec.max_positions = span;
            if spec.sliding_cache_rows >= span {
                spec.sliding_cache_rows = 0;
            }
        }
        spec.prefill_span = 0;
        spec.prefill_spans.clear();
        spec
    }

    /// The spans an export gives the prefill graph by default: the graph's own (`seq` rounded
    /// up to `prefillChunk`, if below `maxPositions`) and token-less variants at twice
    /// `prefillChunk`, doubling, below it (at most [`MAX_PREFILL_SPANS`] of them: each is one
    /// more function to compile). `(0, [])` without a prefill graph.
    pub fn default_prefill_spans(&self) -> (usize, Vec<usize>) {
        let rows = self.prefill_chunk;
        if rows == 0 {
            return (0, Vec::new());
        }
        let needed = self.seq.div_ceil(rows) * rows;
        let span = if needed < self.max_positions { needed } else { 0 };
        let top = if span == 0 { self.max_positions } else { span };
        let mut spans: Vec<usize> = std::iter::successors(Some(2 * rows), |s| Some(s * 2))
            .take_while(|&s| s < top)
            .collect();
        let extra = spans.len().saturating_sub(MAX_PREFILL_SPANS);
        spans.drain(..extra);
        (span, spans)
    }

    /// The rows contract v2's prefill graph would have for `rows` requested (`None`:
    /// [`DEFAULT_PREFILL_CHUNK`]): at most the sliding ring, 0 (none) when that is not more than
    /// a chunk.
    pub fn prefill_chunk_rows(&self, rows: Option<usize>) -> usize {
        let mut rows = rows.unwrap_or(DEFAULT_PREFILL_CHUNK).min(self.max_positions);
        if self.sliding_cache_rows != 0 {
            rows = rows.min(self.sliding_cache_rows);
        }
        if rows > self.chunk {
            rows
        } else {
            0
        }
    }

    fn validate_ring(&self) -> Result<()> {
        let rows = self.sliding_cache_rows;
        if rows == 0 {
            return Ok(());
        }
        let (w, c, p) = (self.sliding_window, self.chunk, self.max_positions);
        let problem = if w == 0 {
            Some("set without a sliding window".to_string())
        } else if rows <= w || rows < c || rows >= p {
            Some(format!(
                "a ring of {rows} rows must exceed slidingWindow {w}, hold a chunk ({c}) and stay below maxPositions {p}"
            ))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::manifest("slidingCacheRows", problem)),
            None => Ok(()),
        }
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

    /// Contract v2: the rows of a layer kind's cache (`[rows, nKV, d]`).
    pub fn cache_rows(&self, kind: LayerKind) -> usize {
        match kind {
            LayerKind::Sliding if self.sliding_cache_rows > 0 => self.sliding_cache_rows,
            _ => self.max_positions,
        }
    }

    /// Contract v2: whether a layer kind's cache is a ring ([`crate::ring`]).
    pub fn is_ring(&self, kind: LayerKind) -> bool {
        self.cache_rows(kind) != self.max_positions
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
