//! RMS norms: the factor `rsqrt(mean(x²) + eps)` in one reduction, in two with parallel outputs
//! ([`FuncEmitter::rms_factor_parallel`], for targets without subgroup operations), or from a sum
//! of squares taken elsewhere ([`FuncEmitter::rms_from_sum`], the fused normed products').

use super::FuncEmitter;
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
        let dims = x.ty.static_dims();
        let last = dims.len() - 1;
        let n = dims[last];
        if n % 32 != 0 || n <= 32 {
            return None;
        }
        let sq = self.b.mul(x, x);
        let mut runs = dims.clone();
        runs[last] = n / 32;
        runs.push(32);
        let sq = self.b.reshape_static(&sq, &runs);
        let partial = self.b.reduce(&sq, &[last + 1], Reduce::Add);
        let mut each = dims.clone();
        each.push(n / 32);
        let keep: Vec<usize> = (0..last).chain([last + 1]).collect();
        let spread = self.b.broadcast(&partial, &keep, &Ty::fixed(&each, Elem::F32));
        let sum = self.b.reduce(&spread, &[last + 1], Reduce::Add);
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

    pub(super) fn norm_param(&mut self, x: &V, name: &str) -> V {
        let w = self.param(name);
        self.rmsnorm(x, &w)
    }
}
