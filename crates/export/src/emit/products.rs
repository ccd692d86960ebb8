//! Products of activations with weights (`x · Wᵀ`) in every weight format: plain and fused
//! projections, packed pairs read in place, the quantized forms (the q4 kernel's dispatch
//! included), and the configured one-row forms of tuned GPUs ([`RowProducts`], [`StreamProducts`]):
//! the normed products ([`FuncEmitter::normed_products`]: the RMS norm's sum of squares taken in
//! the products' dispatch) and the products that write the residual stream out
//! ([`FuncEmitter::proj_settling`]).

use kv_core::param::{LayerWeight, Param};
use kv_core::quant::{QuantFormat, BLOCK};

use super::weights::{per_word, symbol};
use super::{subgroup_reduce_info, FuncEmitter, Residual, WeightFormat};
use crate::mlir::{Elem, Reduce, Ty, V};

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
    pub(crate) fn compilation_info(self, inner: usize) -> String {
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
    /// The fewest and most threads a workgroup: the fewest is also the multiple taken (whole
    /// subgroups).
    pub threads: (usize, usize),
}

impl StreamProducts {
    pub(crate) fn compilation_info(self, inner: usize) -> String {
        let (least, most) = self.threads;
        let threads = (inner / self.per_thread).next_multiple_of(least).clamp(least, most);
        subgroup_reduce_info(&format!("[[1], [0, {inner}]]"), threads)
    }
}

impl FuncEmitter<'_> {
    /// Whether a product of `rows` rows reads packed pairs in place ([`Body::contract_pairs_split`])
    /// rather than widening the weight first: the step, and the chunk graph's few rows, whose
    /// products IREE's default Vulkan target runs as reductions; the many-row graphs keep the
    /// widened weight, which its matmul pipeline tiles.
    pub(super) fn pairs_in_place(&self, rows: usize) -> bool {
        self.options.weights == WeightFormat::PackedI32 && rows <= PAIR_ROWS_MAX
    }

    /// `x · Wᵀ` for `x [R, in]`, `W [out, in]`.
    pub(super) fn proj(&mut self, x: &V, weight: &str) -> V {
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
            match pair_splits(o, words) {
                1 if self.options.split_reductions => self.b.contract_pairs_lanes(x, &w, PAIR_LANES),
                splits => self.b.contract_pairs_split(x, &w, splits),
            }
        } else {
            let w = self.param(weight);
            self.b.dot(x, &w, (&[], &[]), (&[1], &[1]))
        }
    }

    /// Layer `l`'s gate and up projections of `x [R, in]`, `[R, ff]` each, from the archive's
    /// fused matrix ([`kv_core::params::FUSED_GATE_UP`]) when it has one: packed pairs read in
    /// place as one split product whose second stage sums both halves
    /// ([`Body::contract_pairs_gated`]: the activation then joins that stage, one dispatch for
    /// all of it), any other format as one product sliced; apart, two products.
    pub(super) fn gate_up(&mut self, x: &V, l: usize) -> (V, V) {
        let name = |w: LayerWeight| Param::Layer(l, w).to_string();
        let fused = name(LayerWeight::FfnGateUp);
        let Some(info) = self.table.get(&fused) else {
            // Two products, not one of two results: IREE vectorizes a reduction of one result
            // on the portable target and not one of several (session 26, H100: the one product
            // of two results had the same decode and a 1.2x slower chunk call).
            let (gate, up) = (name(LayerWeight::FfnGate), name(LayerWeight::FfnUp));
            return (self.proj(x, &gate), self.proj(x, &up));
        };
        let ff = info.shape[0] / 2;
        let r = x.ty.static_dims()[0];
        if self.quant_format(&fused).is_none() && self.pairs_in_place(r) {
            let w = self.raw_param(&fused);
            let words = w.ty.static_dims()[1];
            return self.b.contract_pairs_gated(x, &w, pair_splits(ff, words));
        }
        let mut y = self.projections(
            x,
            l,
            (LayerWeight::FfnGateUp, &[LayerWeight::FfnGate, LayerWeight::FfnUp]),
            &[ff, ff],
            None,
        );
        let up = y.pop();
        match (y.pop(), up) {
            (Some(gate), Some(up)) => (gate, up),
            _ => kv_core::error::invariant("two parts of the gate/up product"),
        }
    }

    /// `x [1, in] · dequant(W)ᵀ` of a q4 parameter `[out, in]` by [`crate::kernels::Q4_MATVEC`]:
    /// the archive's values as bytes and its f16 scales, flattened, passed to an executable of
    /// this shape (declared once per module, beside the globals).
    pub(super) fn q4_kernel_product(&mut self, x: &V, weight: &str) -> V {
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
    pub(super) fn projections(
        &mut self,
        x: &V,
        l: usize,
        (fused, parts): (LayerWeight, &[LayerWeight]),
        rows: &[usize],
        biases: Option<(LayerWeight, &[LayerWeight])>,
    ) -> Vec<V> {
        let name = |w: LayerWeight| Param::Layer(l, w).to_string();
        let fused_bias = biases.map(|(f, _)| name(f)).filter(|b| self.table.contains_key(b));
        let fused_weight = name(fused);
        if !self.table.contains_key(&fused_weight) {
            return parts
                .iter()
                .enumerate()
                .map(|(i, part)| {
                    let y = self.proj(x, &name(*part));
                    match (&fused_bias, biases) {
                        (None, Some((_, names))) => self.add_bias(&y, &name(names[i])),
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

    pub(super) fn add_bias(&mut self, y: &V, bias: &str) -> V {
        let bv = self.param(bias);
        let bb = self.b.broadcast(&bv, &[1], &y.ty);
        self.b.add(y, &bb)
    }

    /// `x · Wᵀ` (a layer's output or down projection) and the residual stream `res` written out,
    /// as `(product, stream)`; with an addition pending, both in one configured dispatch
    /// ([`Body::row_product_settling_i16`]).
    pub(super) fn proj_settling(&mut self, x: &V, weight: &str, res: &Residual) -> (V, V) {
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

    /// `rmsnorm(x, norm) · Wᵀ` for each of `weights` (`x [1, hidden]`, weights of one output
    /// size), where one row of i16 weights runs on the GPUs [`RowProducts`] suits (the step):
    /// all products and the norm's sum of squares in one configured dispatch
    /// ([`Body::normed_row_products_i16`]: `Σ (x·w)·W`, then scaled by `rsqrt(mean(x²) + eps)`), where
    /// IREE ran the norm as a dispatch of its own and each product as a `vecmat`; a stream
    /// whose post-norm addition is pending ([`Residual`]) is normed as the sum it stands for,
    /// never written out ([`Body::carried_row_products_i16`]). `None` elsewhere.
    pub(super) fn normed_products(&mut self, x: &Residual, norm: &str, weights: &[&str]) -> Option<Vec<V>> {
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
}

/// The most rows of a product that reads packed pairs in place ([`FuncEmitter::pairs_in_place`]).
pub(super) const PAIR_ROWS_MAX: usize = 32;

/// Lanes of a packed-pairs product too wide to split into runs ([`Body::contract_pairs_lanes`]).
///
/// [`Body::contract_pairs_lanes`]: crate::mlir::Body::contract_pairs_lanes
pub(super) const PAIR_LANES: usize = 16;

/// The most lanes' partial sums of the portable attention's split scores (`G·P·lanes`, in
/// `FuncEmitter::mul_reduce_split`); more stay one reduction.
pub(super) const PAIR_THREADS: usize = 16_384;

/// The most partial sums (`out · splits`) a split product or values pass writes
/// ([`pair_splits`], [`key_runs`]): the LM head's 262,144 rows are not split (they take
/// [`PAIR_LANES`]). Until session 28 the splits aimed at 16,384 partial sums whatever the run
/// length (the H200 decoded within 3% of 1,048,576 then, at 785 dispatches a step).
pub(super) const SPLIT_OUTPUTS_MAX: usize = 65_536;

/// Runs of a packed-pairs product ([`Body::contract_pairs_split`]): about `√(2·words)` (the
/// largest power of two whose square is at most twice the words), each run at least 16 words,
/// dividing `words`, at most [`SPLIT_OUTPUTS_MAX`] partial sums. Each of the two reductions is
/// one thread's serial loop an output (no subgroup operations), over a run's words and then
/// over the runs, and the step of either costs about a microsecond on an H100, the first's
/// (a weight word from memory, widened) more than the second's (a partial sum): profiled
/// (session 28), the down product in 16 runs of 64 words took 74 µs and in 32 of 32 45 µs, the
/// output product in 16 of 32 42 µs and in 32 of 16 27 µs, each second stage 10–16 µs.
///
/// [`Body::contract_pairs_split`]: crate::mlir::Body::contract_pairs_split
pub(super) fn pair_splits(out: usize, words: usize) -> usize {
    runs_of(out, words)
}

/// Runs of the keys in the portable attention's values pass ([`FuncEmitter::attention_row_online`]
/// and the split values product): as [`pair_splits`], about `√(2·keys)`, each run at least 16
/// keys. (Until the merge summed the call's own score lanes at its first run only, it re-summed
/// them at every run and fewer runs paid: session 28, H100, a sliding layer's 640 keys in 32
/// runs took 51 µs in the values pass and 71 in that merge, in 16 runs 86 and 41.)
pub(super) fn key_runs(out: usize, keys: usize) -> usize {
    runs_of(out, keys)
}

/// The largest power of two `S` with `S² ≤ 2·terms` that divides `terms` into runs of at least
/// 16, with `out·S ≤ SPLIT_OUTPUTS_MAX` (1: no split).
fn runs_of(out: usize, terms: usize) -> usize {
    let mut splits = 1;
    loop {
        let next = splits * 2;
        if next * next > 2 * terms || terms % next != 0 || terms / next < 16 || out * next > SPLIT_OUTPUTS_MAX {
            return splits;
        }
        splits = next;
    }
}

#[cfg(test)]
mod pair_tests {
    use super::{key_runs, pair_splits, SPLIT_OUTPUTS_MAX};

    #[test]
    fn packed_products_split_into_about_the_square_root_of_their_words() {
        // Gemma 3 270M's one-row products: down, gate/up, fused Q/K/V, output, the LM head.
        assert_eq!(pair_splits(640, 1024), 32);
        assert_eq!(pair_splits(2048, 320), 16);
        assert_eq!(pair_splits(1536, 320), 16);
        assert_eq!(pair_splits(640, 512), 32);
        assert_eq!(pair_splits(262_144, 320), 1);
        // The attention's values pass: a sliding layer's 640 keys, a global one's 2,048.
        assert_eq!(key_runs(1024, 640), 32);
        assert_eq!(key_runs(1024, 2048), 64);
        // Short rows are not split below 16 words, odd word counts not at all.
        assert_eq!(pair_splits(8, 32), 2);
        assert_eq!(pair_splits(8, 31), 1);
        for out in [1, 8, 100, 640, 2048, 100_000] {
            for words in 1..3000 {
                let s = pair_splits(out, words);
                assert_eq!(key_runs(out, words), s);
                assert!(s.is_power_of_two() && words % s == 0, "{out} x {words}: {s}");
                let bounded = words / s >= 16 && s * s <= 2 * words && out * s <= SPLIT_OUTPUTS_MAX;
                assert!(s == 1 || bounded, "{out} x {words}: {s}");
            }
        }
    }
}
