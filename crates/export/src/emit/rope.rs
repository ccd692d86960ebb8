//! The rotary embedding, and Gemma's per-head Q/K norms fused with it: per tensor
//! ([`FuncEmitter::norm_rope`]) and over the fused Q/K/V product ([`FuncEmitter::qkv_norm_rope`]).

use kv_core::param::{LayerWeight, Param};
use kv_core::rope::RopeTable;
use kv_core::LayerKind;

use super::{FuncEmitter, WeightFormat};
use crate::mlir::{Body, Elem, Ty, V};

/// The most rows a call may have for Gemma's Q/K norms and the rotation to be emitted as one
/// dispatch each ([`FuncEmitter::norm_rope`]): IREE 3.13's SPIR-V path fails on that form over
/// 1,024 rows ("failed to legalize operation 'memref.alloc'", a redecode graph of FunctionGemma's
/// geometry); it compiles at 128. Larger calls keep the norm, then the rotation.
pub(super) const NORM_ROPE_MAX_ROWS: usize = 128;

impl FuncEmitter<'_> {
    pub(super) fn const_rope(&mut self, kind: LayerKind, rows: usize) -> (V, V) {
        let d = self.spec.head_dim;
        let t = RopeTable::new(0, rows, d, self.spec.rope_base(kind));
        (
            self.b.const_f32(&[rows, d], &t.cos),
            self.b.const_f32(&[rows, d], &t.sin),
        )
    }

    /// `x·cos + swap_halves(x)·sin` on `x [R, heads, d]` with tables `[R, d]`.
    pub(super) fn rope(&mut self, x: &V, cos: &V, sin: &V) -> V {
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
    pub(super) fn swap_halves(&mut self, x: &V) -> V {
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
    pub(super) fn norm_rope(&mut self, x: &V, w: &str, cos: &V, sin: &V) -> V {
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

    /// [`Self::qkv_apart`]'s Q/K norms, rotation and query scale as one expression over the
    /// fused product `y [R, nHeads + 2·nKV, d]` (query heads, key heads, value heads), the value
    /// heads passed through. IREE makes it a reduction dispatch and an elementwise one: on the
    /// H200 ~20 µs a layer, where the queries and keys apart took ~54 (three dispatches; the
    /// keys' norm and rotation fused into one, which IREE's SPIR-V code runs at the reduction's
    /// parallelism), and a form it fused into one dispatch took 51 (`docs/journal`,
    /// session 14).
    pub(super) fn qkv_norm_rope(&mut self, y: &V, l: usize, cos: &V, sin: &V) -> V {
        let (rotated, factor) = self.qkv_rope_factor(y, l, cos, sin, false);
        match factor {
            QkvFactor::Applied => rotated,
            QkvFactor::PerHead(_) => kv_core::error::invariant("the factor applied where not deferred"),
        }
    }

    /// [`Self::qkv_norm_rope`] with each head's factor (the norm's `rsqrt(mean(x²) + eps)`, the
    /// query scale; 1 for value heads) left to the consumers: `(rope(x·w) [R, heads, d], factor
    /// [R, heads])`. The rotation then reads only the product, so it runs beside the norm's
    /// reduction instead of after it, one dependent dispatch fewer a layer; the attention
    /// scales its scores by the factor ([`Self::attention_v2`]), and the cache's new keys take
    /// theirs elementwise. Only where each head's factor is one reduction (no
    /// [`EmitOptions::split_reductions`](super::EmitOptions::split_reductions)).
    pub(super) fn qkv_rope_deferred(&mut self, y: &V, l: usize, cos: &V, sin: &V) -> (V, V) {
        match self.qkv_rope_factor(y, l, cos, sin, true) {
            (rotated, QkvFactor::PerHead(factor)) => (rotated, factor),
            (_, QkvFactor::Applied) => kv_core::error::invariant("a deferred factor per head"),
        }
    }

    fn qkv_rope_factor(&mut self, y: &V, l: usize, cos: &V, sin: &V, defer: bool) -> (V, QkvFactor) {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let [r, heads, _] = y.ty.static_dims()[..] else {
            kv_core::error::invariant("the fused product is [R, heads, d]")
        };
        let rows = Ty::fixed(&[r, heads], Elem::F32);
        // Without subgroup operations, each head's sum of squares in runs of 32 and then for
        // every element ([`Self::rms_factor_parallel`]): one reduction gave a row's 6 heads 6
        // threads (`reduction_6x256`, ~0.1 ms a layer on the H200's portable profile).
        let spread = if self.options.split_reductions {
            // Shaped as the packed weights' widening reads them, `[.., d/2, 2]`: IREE writes
            // the rotation's elementwise dispatch in that shape, and a factor of another shape
            // was a dispatch of its own.
            let d = self.spec.head_dim;
            let tail = if self.options.weights == WeightFormat::PackedI32 && d % 4 == 0 {
                vec![d / 2, 2]
            } else {
                vec![d]
            };
            self.rms_factor_parallel_as(y, &tail)
                .map(|f| self.b.reshape_static(&f, &y.ty.static_dims()))
        } else {
            None
        };
        let norm = spread.is_none().then(|| self.rms_factor(y));
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
        let factor = norm.map(|norm| {
            let norm = self.b.select(&rotated_heads, &norm, &one);
            self.b.mul(&norm, &scale)
        });
        // rope(x·w) = x·w·cos + swap(x)·swap(w)·sin, as in `norm_rope`; a value head is `y`.
        // Every select picks between terms that read `y`: a select between the weights' (or the
        // constant rotary tables') broadcasts alone is a constant expression, which IREE
        // hoisted per function and row count (`[128, 6, 256]` f32: ~100 MB more RSS on the CPU).
        let wide = |b: &mut Body, m: &V| b.broadcast(m, &[0, 1], &y.ty.with_elem(Elem::I1));
        let (is_q, rotated) = (wide(&mut self.b, &is_q), wide(&mut self.b, &rotated_heads));
        let zeros = self.b.splat_f32(0.0, &y.ty);
        let swapped = self.swap_halves(y);
        let weighted = |this: &mut Self, x: &V, swapped_weights: bool, value_head: &V| {
            let mut times = |weight: LayerWeight| {
                let name = Param::Layer(l, weight).to_string();
                let in_words = this.options.split_reductions
                    && this.options.weights == WeightFormat::PackedI32
                    && d % 4 == 0
                    && this.quant_format(&name).is_none();
                let w = if swapped_weights && in_words {
                    // The halves swapped as words, then widened where the product reads them
                    // (`widen` is elementwise): a `reverse` of the widened weight was a
                    // dispatch of its own, and so was the widening feeding it.
                    let raw = this.raw_param(&name);
                    let halves = this.b.reshape_static(&raw, &[2, d / 4]);
                    let swapped = this.b.reverse(&halves, &[0]);
                    let swapped = this.b.reshape_static(&swapped, &[d / 2]);
                    this.widen(&swapped)
                } else {
                    this.param(&name)
                };
                let w = if swapped_weights && !in_words {
                    let halves = this.b.reshape_static(&w, &[2, d / 2]);
                    let w = this.b.reverse(&halves, &[0]);
                    this.b.reshape_static(&w, &[d])
                } else {
                    w
                };
                let wb = this.b.broadcast(&w, &[2], &y.ty);
                this.b.mul(x, &wb)
            };
            let xq = times(LayerWeight::AttnQNorm);
            let xk = times(LayerWeight::AttnKNorm);
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
        if defer {
            return match factor {
                Some(factor) => (sum, QkvFactor::PerHead(factor)),
                None => kv_core::error::invariant("a deferred factor needs one reduction a head"),
            };
        }
        let fb = match (factor, spread) {
            (Some(factor), _) => self.b.broadcast(&factor, &[0, 1], &y.ty),
            (None, Some(norm)) => {
                let ones = self.b.splat_f32(1.0, &y.ty);
                let norm = self.b.select(&rotated, &norm, &ones);
                let scale = self.b.broadcast(&scale, &[0, 1], &y.ty);
                self.b.mul(&norm, &scale)
            }
            (None, None) => kv_core::error::invariant("a norm factor, per head or per element"),
        };
        (self.b.mul(&sum, &fb), QkvFactor::Applied)
    }
}

/// What [`FuncEmitter::qkv_rope_factor`] did with each head's factor.
enum QkvFactor {
    Applied,
    PerHead(V),
}
