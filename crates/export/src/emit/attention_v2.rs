//! Contract v2's attention over whole static caches: the masks built from `pos`, each KV head's
//! query heads stacked as rows, one softmax split between the cache's keys and the call's rows
//! ([`FuncEmitter::softmax_split`], tiled over the cache), the f16 caches' batched form, and the
//! one-row form of tuned GPUs ([`FuncEmitter::attention_row`]: NVIDIA's configured products,
//! [`AttentionProducts`]).

use kv_core::LayerKind;

use super::products::{key_runs, PAIR_THREADS};
use super::{subgroup_reduce_info, FuncEmitter};
use crate::mlir::{Body, Elem, Reduce, Ty, V};

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
    pub(super) fn info(self, per_workgroup: usize, inner: usize) -> String {
        subgroup_reduce_info(&format!("[[1, {per_workgroup}], [0, 0, {inner}]]"), self.workgroup)
    }
}

/// `x [Q, P]` reduced over its last axis in tiles of `tile` keys, then across the tiles.
pub(super) fn tiled_reduce(b: &mut Body, x: &V, kind: Reduce, tile: usize) -> V {
    let [q, p] = x.ty.static_dims()[..] else {
        kv_core::error::invariant("scores are [Q, P]")
    };
    let x3 = b.reshape_static(x, &[q, p / tile, tile]);
    let partial = b.reduce(&x3, &[2], kind);
    b.reduce(&partial, &[1], kind)
}

/// Keys per tile of contract v2's softmax over the cache ([`FuncEmitter::softmax_split`]).
pub(super) const SOFTMAX_TILE: usize = 64;

impl FuncEmitter<'_> {
    /// One softmax over the keys of two score blocks `[Q, P]` (the cache) and `[Q, R]` (the
    /// call's rows), returned as the same two blocks. The cache's `P` keys are reduced in tiles
    /// of [`SOFTMAX_TILE`] and then across the tiles: one softmax row over `P + R` = 2049 keys
    /// with only 4 rows (a step) was one dispatch of 648 µs on the H200 (IREE's SPIR-V path
    /// reduces a long row nearly serially; per-dispatch profile in `docs/journal`, session 6), 18 per
    /// step. The tiles only regroup the sums, so the result equals the one-row softmax up to
    /// float rounding.
    pub(super) fn softmax_split(&mut self, sc: &V, sn: &V, tiled: bool) -> (V, V) {
        let (ec, en, sum) = self.softmax_exps(sc, sn, tiled);
        let sbc = self.b.broadcast(&sum, &[0], &sc.ty);
        let sbn = self.b.broadcast(&sum, &[0], &sn.ty);
        (self.b.div(&ec, &sbc), self.b.div(&en, &sbn))
    }

    /// [`Self::softmax_split`] without its division: the exponentials of the two blocks and
    /// their sum per row `[Q]`. The portable step divides the attention's output (`[Q, d]`)
    /// instead of the probabilities (`[Q, P]`): the division over the probabilities was a
    /// dispatch of its own; at the end it joins the output's.
    pub(super) fn softmax_exps(&mut self, sc: &V, sn: &V, tiled: bool) -> (V, V, V) {
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
        (ec, en, self.b.add(&sum_c, &sum_n))
    }

    /// One query row's attention (the step) over a cache head's values `vc [P, d]` and the
    /// call's own row `vn [1, d]`, from the masked scores `sc [G, P]` and `sn [G, 1]`: the
    /// maximum ([`Body::configured_row_max`]), then the exponentials, their sum and their
    /// product with the values in one configured dispatch ([`Body::exp_product`]), the own row
    /// and the division elementwise. [`Self::softmax_split`] and two products took nine
    /// dispatches a layer (the exponentials and the probabilities each written out); this, four.
    pub(super) fn attention_row(&mut self, sc: &V, sn: &V, vc: &V, vn: &V, config: AttentionProducts) -> V {
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

    /// One query row's attention for targets without subgroup operations (the portable step,
    /// `r = 1`): the scores of the cache's keys and of the call's own row in [`SCORE_LANES`]
    /// lanes ([`Body::scores_in_lanes`]), the masked cache scores (their lanes summed as they
    /// are read) against the values `vc [P, d]` in runs with an online softmax
    /// ([`Body::online_exp_values`]), and the runs merged from the own row's score and value
    /// `vn [1, d]` ([`Body::online_merge`]), divided by the sum in the same dispatch: four
    /// dispatches where the own row's scores, the maximum, the exponentials, their sum and the
    /// two-stage values product were nine. `keys` is the layer's key cache `[P, nKV, d]`, the
    /// call's keys `[1, nKV, d]` and the KV head; `mask_c [G, P]` the cache's mask (one row's
    /// own key is always visible to it, so no mask of its own). `None` where the options or
    /// shapes do not apply (several rows, f16 caches, keys that make no runs).
    pub(super) fn attention_row_online(
        &mut self,
        q: &V,
        (kc, kn, head): (&V, &V, usize),
        (vc, vn): (&V, &V),
        mask_c: &V,
    ) -> Option<V> {
        let [g, d] = q.ty.static_dims()[..] else {
            kv_core::error::invariant("queries are [G, d]")
        };
        let p = kc.ty.static_dims()[0];
        let one_row = kn.ty.static_dims()[0] == 1;
        let runs = key_runs(g * d, p);
        let applies = self.options.split_reductions && self.options.tiled_softmax && one_row;
        if !applies || runs <= 1 || kc.ty.elem != Elem::F32 || vc.ty.elem != Elem::F32 {
            return None;
        }
        let (scores, own) = self.b.scores_in_lanes(q, kc, kn, head, SCORE_LANES);
        let mask = self.b.reshape_static(mask_c, &[g, runs, p / runs]);
        let v3 = self.b.reshape_static(vc, &[runs, p / runs, d]);
        let (m, acc, sum) = self.b.online_exp_values(&scores, &mask, &v3);
        let (_, acc, sum) = self.b.online_merge(&m, &acc, &sum, (&own, vn));
        Some(self.b.div(&acc, &sum))
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
    pub(super) fn v2_masks(&mut self, pos: &V, r: usize, kind: LayerKind) -> (V, V) {
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
    ///
    /// `factors` (the queries' `[R, nHeads]` and the new keys' `[R, nKV]`): `q` and the new keys
    /// are not yet scaled by their heads' norm factors ([`Self::qkv_rope_deferred`]), and the
    /// scores are, as they leave their products. Only the one-row configured form takes them.
    pub(super) fn attention_v2(
        &mut self,
        q: &V,
        cache: (&V, &V),
        new: (&V, &V),
        masks: (&V, &V),
        factors: Option<&(V, V)>,
    ) -> V {
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
            let vc = head(&mut self.b, cache.1, j);
            let vn = head(&mut self.b, new.1, j);
            let online = match factors {
                None => self.attention_row_online(&qj, (cache.0, new.0, j), (&vc, &vn), masks.0),
                Some(_) => None,
            };
            if let Some(o) = online {
                outs.push(self.b.reshape_static(&o, &[group, r, d]));
                continue;
            }
            let kc = head(&mut self.b, cache.0, j);
            let kn = head(&mut self.b, new.0, j);
            // One query row (the step): the cache's products as multiply-and-reduce. As a
            // `dot_general`, CPU data tiling packs the whole cache into tiles on every call (a
            // read and a write of every K and V row) for a matvec. (On the H200 either form is a
            // `matmul_like` dispatch; one product per query row cut their GPU time but added
            // dispatches, and the step's wall time follows the dispatch count there:
            // docs/journal, session 9.)
            let by_reduce = r == 1;
            // With `factors` (one query row): the query heads of KV head `j` are `fq`'s
            // `[group]` columns. The cache's scores are scaled as they leave their configured
            // product; the own row's score takes both factors inside its reduction
            // ([`Body::scaled_row_dot`]).
            let factors = factors.map(|(fq, fk)| {
                let fq = self.b.slice(fq, &[(0, 1), (j * group, (j + 1) * group)]);
                let fk = self.b.slice(fk, &[(0, 1), (j, j + 1)]);
                (self.b.reshape_static(&fq, &[group]), self.b.reshape_static(&fk, &[]))
            });
            let sc = self.head_product(&qj, &kc, true, by_reduce);
            let sc = match &factors {
                Some((fq, _)) => {
                    let fqc = self.b.broadcast(fq, &[0], &sc.ty);
                    self.b.mul(&sc, &fqc)
                }
                None => sc,
            };
            let sc = self.b.select(masks.0, &sc, &masked_cache);
            let sn = match &factors {
                Some((fq, fk)) => {
                    let k = self.b.reshape_static(&kn, &[d]);
                    let own = self.b.scaled_row_dot(&qj, &k, fq, fk);
                    self.b.reshape_static(&own, &[group, 1])
                }
                None => self.head_product(&qj, &kn, true, by_reduce),
            };
            let sn = self.b.select(masks.1, &sn, &masked_new);
            let configured = self.options.tuning.map(|t| t.attention).filter(|c| c.keys <= p);
            if let (Some(config), true, Elem::F32) = (configured, by_reduce, vc.ty.elem) {
                let o = self.attention_row(&sc, &sn, &vc, &vn, config);
                outs.push(self.b.reshape_static(&o, &[group, r, d]));
                continue;
            }
            if factors.is_some() {
                kv_core::error::invariant("deferred norm factors outside the configured one-row attention");
            }
            // The portable step divides the output by the sum (`softmax_exps`); the rest divide
            // the probabilities.
            let (pc, pn, sum) = if self.options.split_reductions && by_reduce && self.options.tiled_softmax {
                let (ec, en, sum) = self.softmax_exps(&sc, &sn, true);
                (ec, en, Some(sum))
            } else if self.options.tiled_softmax || by_reduce {
                // (no concatenation of the two scores, and so no copy of either)
                let (pc, pn) = self.softmax_split(&sc, &sn, self.options.tiled_softmax);
                (pc, pn, None)
            } else {
                let scores = self.b.concat(&[sc, sn], 1);
                let probs = self.softmax_last(&scores);
                (
                    self.b.slice(&probs, &[(0, group * r), (0, p)]),
                    self.b.slice(&probs, &[(0, group * r), (p, p + r)]),
                    None,
                )
            };
            let oc = self.head_product(&pc, &vc, false, by_reduce);
            let on = self.head_product(&pn, &vn, false, by_reduce);
            let mut o = self.b.add(&oc, &on);
            if let Some(sum) = sum {
                let sum = self.b.broadcast(&sum, &[0], &o.ty);
                o = self.b.div(&o, &sum);
            }
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
    pub(super) fn attention_v2_batched(&mut self, q: &V, cache: (&V, &V), new: (&V, &V), masks: (&V, &V)) -> V {
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
    pub(super) fn masked(&mut self, scores: &V, mask: &V) -> V {
        let mask = self.b.broadcast(mask, &[1, 2], &scores.ty.with_elem(Elem::I1));
        let fill = self.b.splat_f32(kv_core::mask::MASKED, &scores.ty);
        self.b.select(&mask, scores, &fill)
    }

    /// `a [nKV, Q, x]` against every KV head of `c [rows, nKV, d]`: with `scores` the queries
    /// against the keys (`x = d`, result `[nKV, Q, rows]`), else the probabilities against the
    /// values (`x = rows`, result `[nKV, Q, d]`). One query row (`by_reduce`): a broadcast product
    /// reduced over one axis of `[nKV, Q, rows, d]` (see [`Self::attention_v2`]); else a batched
    /// `dot_general`. `c` is widened to f32 after its broadcast, or before the `dot_general`.
    pub(super) fn kv_product(&mut self, a: &V, c: &V, scores: bool, by_reduce: bool) -> V {
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
    pub(super) fn head_product(&mut self, a: &V, c: &V, scores: bool, by_reduce: bool) -> V {
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
            (true, true) if self.options.split_reductions => self.mul_reduce_split(a, c, 2),
            (true, false) if self.options.split_reductions => self.mul_reduce_split(a, c, 1),
            (true, true) => self.mul_reduce(a, c, 2),
            (true, false) => self.mul_reduce(a, c, 1),
            (false, true) => self.b.dot(a, c, (&[], &[]), (&[1], &[1])),
            (false, false) => self.b.dot(a, c, (&[], &[]), (&[1], &[0])),
        }
    }

    /// `a [G, x]` against `c [P, d]` as a broadcast product reduced over one axis of `[G, P, d]`:
    /// `axis` 2 is `a · cᵀ` (`x = d`: `[G, P]`), `axis` 1 is `a · c` (`x = P`: `[G, d]`).
    pub(super) fn mul_reduce(&mut self, a: &V, c: &V, axis: usize) -> V {
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

    /// [`Self::mul_reduce`] in two reductions, for targets without subgroup operations (IREE's
    /// portable Vulkan baseline), where each output of a reduction is one thread's serial loop.
    /// The values (`a · c`, `G·d` outputs of `P` terms: 2,048 for a global layer): the keys in
    /// runs ([`key_runs`]: about `√P` runs of at least 16 keys), then
    /// across the runs. The scores (`a · cᵀ`, `G·P` outputs of `d` terms) where they are few
    /// (the call's own row: 4 outputs of 256 terms took 0.11 ms a layer): the head dimension
    /// interleaved over [`SCORE_LANES`] lanes, lane `j` summing terms `j, j + lanes, …`, so that
    /// neighbouring threads read neighbouring elements of a key; then across the lanes. The
    /// cache's scores (2,560 or 8,192 outputs) stay one reduction. Profiled on the H200
    /// (docs/benchmarks.md, portable): the values' runs cut a global layer's product from 1.70 ms
    /// to under 0.04; the cache's scores took 0.25 / 0.44 ms (sliding / global layer) in one
    /// reduction, 0.24 / 0.68 in lanes and 0.31 / 4.1 in contiguous runs.
    pub(super) fn mul_reduce_split(&mut self, a: &V, c: &V, axis: usize) -> V {
        let g = a.ty.static_dims()[0];
        let [p, d] = c.ty.static_dims()[..] else {
            kv_core::error::invariant("a cache head is [P, d]")
        };
        if axis == 2 {
            let lanes = SCORE_LANES;
            if d % lanes != 0 || d / lanes < 2 || g * p * lanes > PAIR_THREADS {
                return self.mul_reduce(a, c, axis);
            }
            // [G, P, d/lanes, lanes]: query row, key, term of a lane, lane.
            let full = Ty::fixed(&[g, p, d / lanes, lanes], Elem::F32);
            let a3 = self.b.reshape_static(a, &[g, d / lanes, lanes]);
            let c3 = self.b.reshape_static(c, &[p, d / lanes, lanes]);
            let ab = self.b.broadcast(&a3, &[0, 2, 3], &full);
            let cb = self.b.broadcast(&c3, &[1, 2, 3], &full);
            let prod = self.b.mul(&ab, &cb);
            let partial = self.b.reduce(&prod, &[2], Reduce::Add);
            return self.b.reduce(&partial, &[2], Reduce::Add);
        }
        let splits = key_runs(g * d, p);
        if splits <= 1 {
            return self.mul_reduce(a, c, axis);
        }
        let run = p / splits;
        // [G, splits, run, d]: query row, run, key in the run, output.
        let full = Ty::fixed(&[g, splits, run, d], Elem::F32);
        let a3 = self.b.reshape_static(a, &[g, splits, run]);
        let c3 = self.b.reshape_static(c, &[splits, run, d]);
        let ab = self.b.broadcast(&a3, &[0, 1, 2], &full);
        let cb = self.b.broadcast(&c3, &[1, 2, 3], &full);
        let prod = self.b.mul(&ab, &cb);
        let partial = self.b.reduce(&prod, &[2], Reduce::Add);
        self.b.reduce(&partial, &[1], Reduce::Add)
    }
}

/// Lanes of the scores' first reduction in [`FuncEmitter::mul_reduce_split`].
pub(super) const SCORE_LANES: usize = 16;
