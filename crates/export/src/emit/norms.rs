//! RMS norms: the factor `rsqrt(mean(x²) + eps)` in one reduction, in two with parallel outputs
//! ([`FuncEmitter::rms_factor_parallel`], for targets without subgroup operations), or from a sum
//! of squares taken elsewhere ([`FuncEmitter::rms_from_sum`], the fused normed products').

use super::layer::Residual;
use super::{FuncEmitter, WeightFormat};
use crate::mlir::{Elem, Reduce, Ty, V};

impl FuncEmitter<'_> {
    /// `rsqrt(mean(x²) + eps)` over the last axis of `x`: one factor per row.
    pub(super) fn rms_factor(&mut self, x: &V) -> V {
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
    pub(super) fn rms_factor_parallel(&mut self, x: &V) -> Option<V> {
        let n = *x.ty.static_dims().last()?;
        self.rms_factor_parallel_as(x, &[n])
    }

    /// [`Self::rms_factor_parallel`] shaped `[.., tail]` (`tail` a factoring of `n`, e.g. the
    /// `[n/2, 2]` of packed pairs), so that what multiplies it is written in the same shape: a
    /// reshape between the factor's reduction and its consumer kept IREE from fusing them (the
    /// portable norms were three dispatches and a copy).
    pub(super) fn rms_factor_parallel_as(&mut self, x: &V, tail: &[usize]) -> Option<V> {
        let dims = x.ty.static_dims();
        let last = dims.len() - 1;
        let n = dims[last];
        if n % 32 != 0 || n <= 32 || tail.iter().product::<usize>() != n {
            return None;
        }
        // Reshaped before it is squared: a square of the flat row, then reshaped, was a
        // dispatch of its own (`elementwise_640`) beside the runs' reduction.
        let mut runs = dims.clone();
        runs[last] = n / 32;
        runs.push(32);
        let xr = self.b.reshape_static(x, &runs);
        let sq = self.b.mul(&xr, &xr);
        let partial = self.b.reduce(&sq, &[last + 1], Reduce::Add);
        let mut each: Vec<usize> = dims[..last].to_vec();
        each.extend_from_slice(tail);
        each.push(n / 32);
        let keep: Vec<usize> = (0..last).chain([each.len() - 1]).collect();
        let spread = self.b.broadcast(&partial, &keep, &Ty::fixed(&each, Elem::F32));
        let sum = self.b.reduce(&spread, &[each.len() - 1], Reduce::Add);
        Some(self.rms_from_sum(&sum, n))
    }

    /// `rsqrt(sum / n + eps)`: the RMS norm's factor from the sum of `n` squares.
    pub(super) fn rms_from_sum(&mut self, sum: &V, n: usize) -> V {
        let count = self.b.splat_f32(n as f32, &sum.ty);
        let mean = self.b.div(sum, &count);
        let eps = self.b.splat_f32(self.arch.rms_eps, &mean.ty);
        let var = self.b.add(&mean, &eps);
        self.b.unary("rsqrt", &var)
    }

    /// `x * rsqrt(mean(x²) + eps) * w` over the last axis; `w` is broadcast along the last axis.
    pub(super) fn rmsnorm(&mut self, x: &V, w: &V) -> V {
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

    /// [`Self::rmsnorm`] with a weight of packed pairs `raw [n/2] i32`, over few rows
    /// ([`Self::pairs_in_place`]): the factor, the row and the widened weight all shaped
    /// `[.., n/2, 2]` (the widening's own shape), so that the factor's last reduction, the
    /// products and whatever reads the result elementwise (a residual addition) are one
    /// dispatch.
    pub(super) fn rmsnorm_pairs(&mut self, x: &V, raw: &V) -> V {
        let dims = x.ty.static_dims();
        let last = dims.len() - 1;
        let n = dims[last];
        let mut paired: Vec<usize> = dims[..last].to_vec();
        paired.extend([n / 2, 2]);
        let pty = Ty::fixed(&paired, Elem::F32);
        let factor = match self.rms_factor_parallel_as(x, &[n / 2, 2]) {
            Some(f) => f,
            None => {
                let r = self.rms_factor(x);
                let keep: Vec<usize> = (0..last).collect();
                self.b.broadcast(&r, &keep, &pty)
            }
        };
        let xp = self.b.reshape_static(x, &paired);
        let y = self.b.mul(&xp, &factor);
        let w = self.widen_pairs(raw);
        let wb = self.b.broadcast(&w, &[last, last + 1], &pty);
        let y = self.b.mul(&y, &wb);
        self.b.reshape_static(&y, &dims)
    }

    /// Whether a block's post-norm addition is left pending ([`Residual`]) for the next norm to
    /// make ([`Self::carried_norm`]): the portable profiles' few-row graphs with packed weights,
    /// rows a multiple of 32 wide.
    pub(super) fn carries_post_norms(&self, y: &V) -> bool {
        if !y.ty.is_static() {
            return false;
        }
        let dims = y.ty.static_dims();
        let (rows, n) = (dims[0], dims[dims.len() - 1]);
        self.options.split_reductions
            && self.options.weights == WeightFormat::PackedI32
            && self.pairs_in_place(rows)
            && n % 32 == 0
            && n > 32
    }

    /// The residual stream `x` settled and normed by `norm`, as `(stream, normed)`, where `x`
    /// has a post-norm addition pending that this profile carries ([`Self::carries_post_norms`]):
    /// `h = base + rmsnorm(d, post)` and `rmsnorm(h, norm)` from one pass of sums in runs
    /// ([`Body::carried_sums_in_runs`]: `Σ d²`, and `Σ h²` taken apart as the tuned normed
    /// products do) and one spreading them to every element, where the post-norm, its
    /// addition and the next norm were four dispatches. `None` elsewhere.
    ///
    /// [`Body::carried_sums_in_runs`]: crate::mlir::Body::carried_sums_in_runs
    pub(super) fn carried_norm(&mut self, x: &Residual, norm: &str) -> Option<(V, V)> {
        let (d, post) = x.pending.as_ref()?;
        if !self.carries_post_norms(d) || self.quant_format(post).is_some() || self.quant_format(norm).is_some() {
            return None;
        }
        let dims = d.ty.static_dims();
        let [r, n] = dims[..] else { return None };
        let runs = n / 32;
        let in_runs = |e: &mut Self, v: &V| e.b.reshape_static(v, &[r, runs, 16, 2]);
        let (xb, db) = (in_runs(self, &x.base), in_runs(self, d));
        let post_raw = self.raw_param(post);
        let post_words = self.b.reshape_static(&post_raw, &[runs, 16]);
        let partials = self.b.carried_sums_in_runs(&xb, &db, &post_words);
        let pty = Ty::fixed(&[r, n / 2, 2], Elem::F32);
        let sums = self.b.spread_sums(&partials, &pty);
        let paired = |e: &mut Self, v: &V| e.b.reshape_static(v, &[r, n / 2, 2]);
        let (xp, dp) = (paired(self, &x.base), paired(self, d));
        let norm_raw = self.raw_param(norm);
        let eps = self.arch.rms_eps;
        let (h, normed) = self
            .b
            .carried_norm_outputs(&sums, (&xp, &dp), (&post_raw, &norm_raw), eps);
        Some((self.b.reshape_static(&h, &dims), self.b.reshape_static(&normed, &dims)))
    }

    pub(super) fn norm_param(&mut self, x: &V, name: &str) -> V {
        let dims = x.ty.static_dims();
        let n = dims.last().copied().unwrap_or(0);
        let pairs = self.pairs_in_place(dims[0]) && self.quant_format(name).is_none() && n % 2 == 0;
        if pairs && dims.len() >= 2 {
            let raw = self.raw_param(name);
            return self.rmsnorm_pairs(x, &raw);
        }
        let w = self.param(name);
        self.rmsnorm(x, &w)
    }
}
