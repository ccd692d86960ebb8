//! The forward of `docs/forward.md`, step by step. The numbered comments are that page's steps.

use kv_core::bf16::round_to_bf16;
use kv_core::manifest::MatmulInput;
use kv_core::mask::prefill_mask;
use kv_core::rope::{apply_rope, RopeTable};
use kv_core::{Activation, LayerKind, Result};
use ndarray::{concatenate, s, Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayView3, Axis};

use crate::model::ReferenceModel;

/// `x * rsqrt(mean(x²) + eps) * w` over the last axis of every row.
pub fn rmsnorm(x: ArrayView2<f32>, weight: ArrayView1<f32>, eps: f32) -> Array2<f32> {
    let mut out = x.to_owned();
    for mut row in out.rows_mut() {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        row.zip_mut_with(&weight, |v, w| *v = *v * inv * w);
    }
    out
}

/// `rmsnorm` of one vector, in place (per-head QK-norm).
fn rmsnorm_slice(x: &mut [f32], weight: &Array1<f32>, eps: f32) {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_square + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = *v * inv * w;
    }
}

/// `0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³)))`
pub fn gelu_tanh(g: f32) -> f32 {
    let sqrt_2_over_pi = (2.0 / std::f32::consts::PI).sqrt();
    0.5 * g * (1.0 + (sqrt_2_over_pi * (g + 0.044715 * g * g * g)).tanh())
}

/// `g / (1 + e^-g)`
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// Max-subtracted softmax, in place.
pub fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

/// Index of the largest value, the lowest index on ties (the graphs' `argmax`).
pub fn argmax_lowest(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// The additive mask of a block of query rows over the keys it is handed.
pub(crate) enum KeyMask<'a> {
    /// Every key handed in is visible: a step call, where the rows passed are the window.
    None,
    /// `[heads, rows, past + rows]`, 0 or `-1e30`; with one head it is shared by all query heads.
    Additive { mask: &'a [f32], heads: usize },
}

/// What one layer is handed besides the block's own rows.
pub(crate) struct LayerInputs<'a> {
    /// Post-RoPE K and V of the past rows, `[nKvHeads, past, d]`.
    pub past_k: ArrayView3<'a, f32>,
    pub past_v: ArrayView3<'a, f32>,
    /// One row per query row of the block, at its absolute position.
    pub rope: &'a RopeTable,
    pub mask: KeyMask<'a>,
}

/// The result of running a block of rows through every layer.
pub(crate) struct BlockOutput {
    /// The residual stream after the last layer, `[rows, hidden]`.
    pub x: Array2<f32>,
    /// Per layer, the block's own post-RoPE K and V, `[nKvHeads, rows, d]`.
    pub kv: Vec<(Array3<f32>, Array3<f32>)>,
}

impl ReferenceModel {
    /// `x = emb_row * embedScale` for every token (ids already validated).
    pub(crate) fn embed(&self, tokens: &[i32]) -> Array2<f32> {
        let rows: Vec<ArrayView1<f32>> = tokens.iter().map(|&t| self.embedding().row(t as usize)).collect();
        ndarray::stack(Axis(0), &rows).unwrap_or_else(|_| kv_core::error::invariant("embedding rows share one width"))
            * self.architecture().embed_scale
    }

    /// `logits = rmsnorm(x, output_norm) · Eᵀ` for every row of `x`.
    pub(crate) fn logits(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let y = rmsnorm(x, self.output_norm().view(), self.architecture().rms_eps);
        self.project(&y, self.output_projection(), None)
    }

    /// Runs the rows of `tokens` through every layer; `inputs(layer)` says what the layer sees.
    pub(crate) fn forward_block<'a>(
        &self,
        tokens: &[i32],
        mut inputs: impl FnMut(usize) -> LayerInputs<'a>,
    ) -> BlockOutput {
        let mut x = self.embed(tokens);
        let mut kv = Vec::with_capacity(self.spec().n_layers);
        for layer in 0..self.spec().n_layers {
            let (next, k, v) = self.layer_forward(layer, &x, &inputs(layer));
            x = next;
            kv.push((k, v));
        }
        BlockOutput { x, kv }
    }

    /// One transformer block on `[rows, hidden]`: returns the new residual stream and the rows'
    /// post-RoPE K and V.
    fn layer_forward(
        &self,
        layer: usize,
        x: &Array2<f32>,
        inputs: &LayerInputs,
    ) -> (Array2<f32>, Array3<f32>, Array3<f32>) {
        let spec = self.spec();
        let arch = self.architecture();
        let w = self.layer(layer);
        let (rows, d) = (x.nrows(), spec.head_dim);
        let (n_heads, n_kv_heads) = (spec.n_heads, spec.n_kv_heads);
        let eps = arch.rms_eps;

        // 1. h = rmsnorm(x, attn_norm)
        let h = rmsnorm(x.view(), w.attn_norm.view(), eps);
        // 2. projections (+ biases)
        let mut q = self.project(&h, &w.attn_q, w.attn_q_bias.as_ref());
        let mut k = self.project(&h, &w.attn_k, w.attn_k_bias.as_ref());
        let v = self.project(&h, &w.attn_v, w.attn_v_bias.as_ref());
        // 3.–5. per head: QK-norm, RoPE at the row's position, query scale
        prepare_heads(&mut q, d, w.attn_q_norm.as_ref(), eps, inputs.rope, arch.query_scale);
        prepare_heads(&mut k, d, w.attn_k_norm.as_ref(), eps, inputs.rope, 1.0);
        // 6. the cache rows: [rows, nKv*d] -> [nKv, rows, d], as the cache type holds them
        //    (rounded where they are computed, before this block attends to them: `CacheType`)
        let cache = self.manifest().cache_type;
        let (k, v) = if cache.is_f32() {
            (k, v)
        } else {
            (k.mapv(|x| cache.round(x)), v.mapv(|x| cache.round(x)))
        };
        let k_new = to_heads_first(k, n_kv_heads, d);
        let v_new = to_heads_first(v, n_kv_heads, d);

        // 7. attention over the past rows then the block's own rows
        let keys = concatenate(Axis(1), &[inputs.past_k, k_new.view()])
            .unwrap_or_else(|_| kv_core::error::invariant("past K has the block's geometry"));
        let values = concatenate(Axis(1), &[inputs.past_v, v_new.view()])
            .unwrap_or_else(|_| kv_core::error::invariant("past V has the block's geometry"));
        let cols = keys.dim().1;
        let group = n_heads / n_kv_heads;
        let mut attn = Array2::<f32>::zeros((rows, n_heads * d));
        for head in 0..n_heads {
            let kv_head = head / group;
            let q_h = q.slice(s![.., head * d..(head + 1) * d]);
            let mut scores = q_h.dot(&keys.index_axis(Axis(0), kv_head).t());
            if let KeyMask::Additive { mask, heads } = inputs.mask {
                let per_head = rows * cols;
                if mask.len() != heads * per_head {
                    kv_core::error::invariant("mask shape matches [heads, rows, past + rows]");
                }
                let mask_head = if heads == 1 { 0 } else { head };
                let m = &mask[mask_head * per_head..(mask_head + 1) * per_head];
                scores += &ArrayView2::from_shape((rows, cols), m)
                    .unwrap_or_else(|_| kv_core::error::invariant("mask slice is rows x cols"));
            }
            for mut row in scores.rows_mut() {
                softmax_in_place(
                    row.as_slice_mut()
                        .unwrap_or_else(|| kv_core::error::invariant("score rows are contiguous")),
                );
            }
            let o_h = scores.dot(&values.index_axis(Axis(0), kv_head));
            attn.slice_mut(s![.., head * d..(head + 1) * d]).assign(&o_h);
        }

        // 8. output projection, post-norm, residual
        let mut a = self.project(&attn, &w.attn_output, None);
        if let Some(norm) = &w.post_attention_norm {
            a = rmsnorm(a.view(), norm.view(), eps);
        }
        let x = x + &a;

        // 9. MLP, post-norm, residual
        let h2 = rmsnorm(x.view(), w.ffn_norm.view(), eps);
        let act = match arch.activation {
            Activation::GeluTanh => gelu_tanh,
            Activation::Silu => silu,
        };
        let gate = self.project(&h2, &w.ffn_gate, None).mapv(act);
        let up = self.project(&h2, &w.ffn_up, None);
        let mut m = self.project(&(gate * up), &w.ffn_down, None);
        if let Some(norm) = &w.post_ffw_norm {
            m = rmsnorm(m.view(), norm.view(), eps);
        }
        (x + &m, k_new, v_new)
    }

    /// Rows `0..tokens.len()` from position 0 with the window mask on sliding layers: the prefill
    /// graph's real rows (its padding rows cannot reach them under the causal rule).
    pub(crate) fn forward_from_start(&self, tokens: &[i32]) -> BlockOutput {
        let spec = self.spec();
        let n = tokens.len();
        let per_kind: Vec<(LayerKind, RopeTable, Vec<f32>)> = spec
            .kinds_present()
            .into_iter()
            .map(|kind| {
                let rope = RopeTable::new(0, n, spec.head_dim, spec.rope_base(kind));
                (kind, rope, prefill_mask(n, spec.window(kind)))
            })
            .collect();
        let empty = Array3::<f32>::zeros((spec.n_kv_heads, 0, spec.head_dim));
        self.forward_block(tokens, |layer| {
            let kind = spec.layer_kind(layer);
            let (_, rope, mask) = per_kind
                .iter()
                .find(|(k, _, _)| *k == kind)
                .unwrap_or_else(|| kv_core::error::invariant("every layer's kind is present"));
            LayerInputs {
                past_k: empty.view(),
                past_v: empty.view(),
                rope,
                mask: KeyMask::Additive { mask, heads: 1 },
            }
        })
    }
}

impl ReferenceModel {
    /// `x · Wᵀ (+ b)`, with `x` first rounded to bf16 when the manifest's graphs multiply bf16
    /// activations (`matmulInput`: the products are then the graphs' exactly).
    fn project(&self, x: &Array2<f32>, weight: &Array2<f32>, bias: Option<&Array1<f32>>) -> Array2<f32> {
        let mut y = match self.manifest().matmul_input {
            MatmulInput::F32 => x.dot(&weight.t()),
            MatmulInput::Bf16 => x.mapv(round_to_bf16).dot(&weight.t()),
        };
        if let Some(b) = bias {
            y += b;
        }
        y
    }
}

/// Per head vector of every row: optional RMSNorm, RoPE with the row's table row, then `scale`.
fn prepare_heads(m: &mut Array2<f32>, d: usize, norm: Option<&Array1<f32>>, eps: f32, rope: &RopeTable, scale: f32) {
    for (r, mut row) in m.rows_mut().into_iter().enumerate() {
        let row = row
            .as_slice_mut()
            .unwrap_or_else(|| kv_core::error::invariant("projection rows are contiguous"));
        for head in row.chunks_exact_mut(d) {
            if let Some(w) = norm {
                rmsnorm_slice(head, w, eps);
            }
            apply_rope(head, rope.cos_row(r), rope.sin_row(r));
            head.iter_mut().for_each(|v| *v *= scale);
        }
    }
}

/// `[rows, heads * d]` -> `[heads, rows, d]`, standard layout.
fn to_heads_first(m: Array2<f32>, heads: usize, d: usize) -> Array3<f32> {
    let rows = m.nrows();
    let split = m
        .into_shape_with_order((rows, heads, d))
        .unwrap_or_else(|_| kv_core::error::invariant("projection width is heads x d"));
    split.permuted_axes([1, 0, 2]).as_standard_layout().into_owned()
}

/// Logits `[n, vocab]` of every position of `tokens` from position 0: the full causal + window
/// forward with no cache (any length ≥ 1; no `seq` or `maxPositions` limit, so tests can run well
/// past the window and past the prefill graph).
pub fn full_forward_logits(model: &ReferenceModel, tokens: &[i32]) -> Result<Array2<f32>> {
    if tokens.is_empty() {
        return Err(kv_core::Error::BadTokenCount {
            op: "full_forward_logits",
            n: 0,
            min: 1,
            max: usize::MAX,
        });
    }
    model.spec().check_tokens("full_forward_logits", tokens)?;
    let out = model.forward_from_start(tokens);
    Ok(model.logits(out.x.view()))
}
