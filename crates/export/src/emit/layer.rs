//! One transformer block: Q/K/V, attention, the output projection, the feed-forward block and
//! its gates (gelu-tanh, silu), and the residual stream between blocks ([`Residual`]: a post-norm
//! addition left pending for the next products to make).

use kv_core::param::{LayerWeight, Param};
use kv_core::Activation;

use super::rope::NORM_ROPE_MAX_ROWS;
use super::{FuncEmitter, MaskIn};
use crate::mlir::{Body, Elem, V};

/// The residual stream between a layer's blocks: `base`, and in the one-row step of NVIDIA
/// Vulkan exports and the few-row graphs of the portable ones the last block's post-norm
/// addition not yet made, `base + rmsnorm(delta, weight)` as `(delta, weight's name)`. NVIDIA's:
/// the next normed products take the sum apart ([`FuncEmitter::normed_products`]) and the next
/// product as wide as the stream writes it out ([`FuncEmitter::proj_settling`]), so that the
/// post-norm needs no dispatch of its own. The portable profiles': the next norm makes it
/// ([`FuncEmitter::carried_norm`]).
#[derive(Clone)]
pub(super) struct Residual {
    pub(super) base: V,
    pub(super) pending: Option<(V, String)>,
}

impl Residual {
    pub(super) fn settled(base: V) -> Self {
        Self { base, pending: None }
    }
}

impl FuncEmitter<'_> {
    /// One transformer block over `x [R, hidden]`; returns the new `x` and the layer's full
    /// `K, V [1, nKV, past + R, d]` (the past rows, then the new ones), or under contract v2
    /// (`mask` is [`MaskIn::V2`], `past` the whole caches `[P, nKV, d]`) only the new rows
    /// `[R, nKV, d]`.
    pub(super) fn layer(
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
        let p = |w: LayerWeight| Param::Layer(l, w).to_string();
        let fused = self.table.contains_key(&p(LayerWeight::AttnQkv));
        // The last block's post-norm and this norm in one pass where the profile carries it.
        let (x, normed) = match self.carried_norm(x, &p(LayerWeight::AttnNorm)) {
            Some((stream, h)) => (Residual::settled(stream), Some(h)),
            None => (x.clone(), None),
        };
        let x = &x;
        // The one-row step of a tuned GPU's contract 2 (its attention's configured products, f32
        // caches): each head's norm factor left to the scores ([`Self::qkv_rope_deferred`]).
        let defer = match (self.options.tuning, &mask, &past) {
            (Some(tuning), MaskIn::V2 { .. }, Some((ck, _))) => {
                r == 1
                    && !self.options.split_reductions
                    && ck.ty.elem == Elem::F32
                    && ck.ty.static_dims()[0] >= tuning.attention.keys
            }
            _ => false,
        };
        let mut factors = None;
        let (q, k, v) = if fused && arch.qk_norm && !arch.attn_bias && r <= NORM_ROPE_MAX_ROWS {
            let (norm, qkv) = (p(LayerWeight::AttnNorm), p(LayerWeight::AttnQkv));
            let products = match &normed {
                Some(_) => None,
                None => self.normed_products(x, &norm, &[&qkv]),
            };
            let y = match products {
                Some(mut y) => y.remove(0),
                None => {
                    let h = match &normed {
                        Some(h) => h.clone(),
                        None => self.settled_norm(x, &norm),
                    };
                    self.proj(&h, &qkv)
                }
            };
            let y = self.b.reshape_static(&y, &[r, nh + 2 * nkv, d]);
            let z = if defer {
                let (z, f) = self.qkv_rope_deferred(&y, l, cos, sin);
                let fq = self.b.slice(&f, &[(0, r), (0, nh)]);
                let fk = self.b.slice(&f, &[(0, r), (nh, nh + nkv)]);
                factors = Some((fq, fk));
                z
            } else {
                self.qkv_norm_rope(&y, l, cos, sin)
            };
            let mut heads = |from: usize, n: usize| self.b.slice(&z, &[(0, r), (from, from + n), (0, d)]);
            (heads(0, nh), heads(nh, nkv), heads(nh + nkv, nkv))
        } else {
            let h = match &normed {
                Some(h) => h.clone(),
                None => self.settled_norm(x, &p(LayerWeight::AttnNorm)),
            };
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
                let o = self.attention_v2(&q, (&ck, &cv), (&k, &v), (&cache, &new), factors.as_ref());
                // The new keys as the cache holds them: scaled by their heads' factors.
                let k = match &factors {
                    Some((_, fk)) => {
                        let fk = self.b.broadcast(fk, &[0, 1], &k.ty);
                        self.b.mul(&k, &fk)
                    }
                    None => k,
                };
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
        let (a, x) = self.proj_settling(&o, &p(LayerWeight::AttnOutput), x);
        let x = self.add_block(x, a, &p(LayerWeight::PostAttentionNorm));
        // Fused in the portable profiles' archives only (`kv_core::params::FUSED_GATE_UP`).
        let (gate, up) = (p(LayerWeight::FfnGate), p(LayerWeight::FfnUp));
        let (x, normed) = match self.carried_norm(&x, &p(LayerWeight::FfnNorm)) {
            Some((stream, h)) => (Residual::settled(stream), Some(h)),
            None => (x, None),
        };
        let products = match &normed {
            Some(_) => None,
            None => self.normed_products(&x, &p(LayerWeight::FfnNorm), &[&gate, &up]),
        };
        let (g, u) = match products.as_deref() {
            Some([g, u]) => (g.clone(), u.clone()),
            _ => {
                let h2 = match normed {
                    Some(h) => h,
                    None => self.settled_norm(&x, &p(LayerWeight::FfnNorm)),
                };
                self.gate_up(&h2, l)
            }
        };
        let act = match arch.activation {
            Activation::GeluTanh => self.gelu_tanh(&g),
            Activation::Silu => self.silu(&g),
        };
        let gu = self.b.mul(&act, &u);
        let (m, x) = self.proj_settling(&gu, &p(LayerWeight::FfnDown), &x);
        let x = self.add_block(x, m, &p(LayerWeight::PostFfwNorm));
        (x, k_out, v_out)
    }

    /// The residual stream `x` plus a block's output `y` (RMS-normed by `post_norm` where the
    /// architecture has post-norms): the addition left pending where the next products can
    /// make it ([`Residual`]: the one-row step where [`EmitOptions::tuning`] says how
    /// the products writing the stream out run, with i16 weights) or the next norm
    /// ([`Self::carries_post_norms`]).
    pub(super) fn add_block(&mut self, x: V, y: V, post_norm: &str) -> Residual {
        if !self.arch.post_norms {
            return Residual::settled(self.b.add(&x, &y));
        }
        let one_row = y.ty.is_static() && y.ty.static_dims()[0] == 1;
        if (one_row && self.row_tuning().is_some()) || self.carries_post_norms(&y) {
            return Residual {
                base: x,
                pending: Some((y, post_norm.to_string())),
            };
        }
        let y = self.norm_param(&y, post_norm);
        Residual::settled(self.b.add(&x, &y))
    }

    /// `rmsnorm(x, norm)` of the stream written out first ([`Self::settle`]).
    pub(super) fn settled_norm(&mut self, x: &Residual, norm: &str) -> V {
        let x = self.settle(x);
        self.norm_param(&x, norm)
    }

    /// The residual stream written out: `base + rmsnorm(delta, weight)` where an addition is
    /// pending.
    pub(super) fn settle(&mut self, x: &Residual) -> V {
        match &x.pending {
            None => x.base.clone(),
            Some((d, post)) => {
                let y = self.norm_param(d, post);
                self.b.add(&x.base, &y)
            }
        }
    }

    /// The layer's scaled, rotated queries `[R, nHeads, d]`, keys and values `[R, nKV, d]` from
    /// the normalized input `h`, each projection apart (or sliced from a fused one).
    pub(super) fn qkv_apart(&mut self, h: &V, l: usize, cos: &V, sin: &V) -> (V, V, V) {
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let arch = self.arch;
        let r = h.ty.static_dims()[0];
        let p = |w: LayerWeight| Param::Layer(l, w).to_string();
        use LayerWeight::{AttnK, AttnKBias, AttnQ, AttnQBias, AttnQkv, AttnQkvBias, AttnV, AttnVBias};
        let biases = arch
            .attn_bias
            .then_some((AttnQkvBias, [AttnQBias, AttnKBias, AttnVBias].as_slice()));
        let qkv = self.projections(
            h,
            l,
            (AttnQkv, &[AttnQ, AttnK, AttnV]),
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
                self.norm_rope(&q, &p(LayerWeight::AttnQNorm), cos, sin),
                self.norm_rope(&k, &p(LayerWeight::AttnKNorm), cos, sin),
            )
        } else if arch.qk_norm {
            let q = self.norm_param(&q, &p(LayerWeight::AttnQNorm));
            let k = self.norm_param(&k, &p(LayerWeight::AttnKNorm));
            (self.rope(&q, cos, sin), self.rope(&k, cos, sin))
        } else {
            (self.rope(&q, cos, sin), self.rope(&k, cos, sin))
        };
        let q = self.b.scale(&q, arch.query_scale);
        (q, k, v)
    }

    /// `0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³)))`
    pub(super) fn gelu_tanh(&mut self, g: &V) -> V {
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
    pub(super) fn silu(&mut self, g: &V) -> V {
        let neg = self.b.unary("negate", g);
        let e = self.b.unary("exponential", &neg);
        let one = self.b.splat_f32(1.0, &e.ty);
        let den = self.b.add(&one, &e);
        self.b.div(g, &den)
    }
}
