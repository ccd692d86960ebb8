//! Contract v1's attention over a dynamic past `[1, nKV, T, d]`: the grouped form (several KV
//! heads of several query heads), the repeated-KV form, the single-row form of one KV head, the
//! causal mask and the softmax.

use super::FuncEmitter;
use crate::mlir::{Dim, Elem, Reduce, Ty, V};

/// Additive attention mask of a layer.
pub(super) enum MaskIn {
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

impl FuncEmitter<'_> {
    /// `[1, nKV, T, d]` → `[nHeads, T, d]`: query head `h` gets KV head `h / (nHeads / nKV)`.
    pub(super) fn repeat_kv(&mut self, kv: &V) -> V {
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
    pub(super) fn softmax_last(&mut self, scores: &V) -> V {
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
    pub(super) fn causal_mask(&mut self, r: usize, t: usize, window: Option<usize>) -> V {
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
    pub(super) fn grouped_attention(&mut self, q: &V, k: &V, v: &V, mask: MaskIn) -> V {
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

    /// Attention of `q [R, nHeads, d]` (scaled, rotated) over `k, v [1, nKV, T, d]`: `[R, nHeads·d]`.
    pub(super) fn attention(&mut self, q: &V, k: &V, v: &V, mask: MaskIn) -> V {
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
    pub(super) fn single_row_attention(&mut self, q: &V, k: &V, v: &V) -> V {
        let (nh, d) = (self.spec.n_heads, self.spec.head_dim);
        let q4 = self.b.reshape_static(q, &[1, 1, nh, d]);
        let scores = self.b.dot(&q4, k, (&[0, 1], &[0, 1]), (&[3], &[3]));
        let p = self.softmax_last(&scores);
        let o = self.b.dot(&p, v, (&[0, 1], &[0, 1]), (&[3], &[2]));
        self.b.reshape_static(&o, &[1, nh * d])
    }
}
