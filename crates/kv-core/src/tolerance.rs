//! Documented tolerances for comparing K/V and logits across backends and paths.
//!
//! Two paths through the same FP32 math (a whole prefill versus prefix + chunks + steps) differ
//! only in summation order and in padding rows: errors stay at a few ulps of the activations.
//! A bf16-weights backend against the FP32 reference reading the same bf16 weights differs only in
//! accumulation order too, so the same bound applies; an FP32 reference against bf16 weights would
//! not, and is not what we compare.
//!
//! The asserts here are the one way tests compare values and caches: they print the first few
//! mismatches and the largest differences, and point at the caller (`#[track_caller]`).

use crate::LayerKv;

/// `|a - b| <= abs + rel * max(|a|, |b|)` elementwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub abs: f32,
    pub rel: f32,
}

impl Tolerance {
    /// Bit for bit: a replay of the same calls on one backend (a snapshot restored and fed the
    /// same pieces as a fresh session) runs the same kernels on the same inputs, so any
    /// difference is a bug (a restore that kept a stale row, a fork that copied the wrong one).
    pub const EXACT: Tolerance = Tolerance { abs: 0.0, rel: 0.0 };
    /// The same FP32 forward computed along two paths of one backend.
    pub const SAME_BACKEND: Tolerance = Tolerance { abs: 1e-4, rel: 1e-4 };
    /// Two paths of one backend whose caches hold f16 (manifest `cacheType`). A value the two
    /// paths compute a few f32 ulps apart rounds to neighbouring f16 values where it lies near a
    /// rounding boundary: one f16 ulp, up to 2⁻¹⁰ of the value. Every later layer then reads the
    /// other row, so the difference spreads at the rounding's scale to values far from any
    /// boundary. Measured (conformance `iree_local_task_v2_f16`, 16 cases): flips of one or two
    /// ulps (up to 1.95e-3 on values above 2) and spread differences up to 2.4e-4 on values of
    /// 0.002–0.13. So: two ulps relative and 1e-3 absolute, ~4x over the spread measured.
    pub const SAME_BACKEND_F16_CACHES: Tolerance = Tolerance {
        abs: 1e-3,
        rel: 1.0 / 512.0,
    };
    /// Two backends (host ndarray versus compiled IREE kernels) on the same weights.
    pub const CROSS_BACKEND: Tolerance = Tolerance { abs: 2e-3, rel: 2e-3 };
    /// Two backends that both round every projection input to bf16 (manifest `matmulInput`).
    /// Rounding is not continuous: an input within the backends' f32 disagreement of a rounding
    /// boundary goes to neighbouring bf16 values, one bf16 ulp (2⁻⁸ relative) apart, and from
    /// the first such input on the two differ at the scale of the rounding itself, not of the
    /// summation order (layer 0 of the 8-layer fixture agrees to 4e-7, the later layers to
    /// 3e-3–1.6e-2, `backend-iree/tests/v2.rs`). Neither is then further from the other than
    /// both are from the FP32 forward, which is the rounding's whole effect: at most 3.5e-2
    /// there (values of order 1). So: 4e-2, relative and absolute. It tells a wrong graph from a
    /// right one only coarsely; the test also checks layer 0 at [`Self::CROSS_BACKEND`] and that
    /// the mean difference stays far below the FP32 forward's. Not for comparing with the FP32
    /// forward: only tokens (up to near-ties) compare there.
    pub const BF16_MATMUL_INPUTS: Tolerance = Tolerance { abs: 4e-2, rel: 4e-2 };

    pub fn close(&self, a: f32, b: f32) -> bool {
        (a - b).abs() <= self.abs + self.rel * a.abs().max(b.abs())
    }

    /// Indices and values of the first `limit` elements outside the tolerance.
    pub fn mismatches(&self, a: &[f32], b: &[f32], limit: usize) -> Vec<(usize, f32, f32)> {
        a.iter()
            .zip(b)
            .enumerate()
            .filter(|(_, (x, y))| !self.close(**x, **y))
            .take(limit)
            .map(|(i, (x, y))| (i, *x, *y))
            .collect()
    }
}

/// Largest absolute and relative difference between two equally long slices.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    a.iter().zip(b).fold((0.0f32, 0.0f32), |(abs, rel), (x, y)| {
        let d = (x - y).abs();
        let scale = x.abs().max(y.abs()).max(1e-6);
        (abs.max(d), rel.max(d / scale))
    })
}

/// Asserts two slices agree within `tol`, printing the first few mismatches.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tolerance) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let bad = tol.mismatches(got, want, 5);
    if !bad.is_empty() {
        let (abs, rel) = max_diff(got, want);
        let count = got.iter().zip(want).filter(|(x, y)| !tol.close(**x, **y)).count();
        panic!(
            "{what}: {count} elements outside {tol:?} (max abs {abs:e}, max rel {rel:e}); first mismatches (index, got, want): {bad:?}"
        );
    }
}

/// Compares two layers on the positions both hold (a sliding layer may keep a different tail).
#[track_caller]
pub fn assert_layers_close(what: &str, got: &LayerKv, want: &LayerKv, tol: Tolerance) {
    let got_end = got.first_position + got.rows;
    let want_end = want.first_position + want.rows;
    assert_eq!(got_end, want_end, "{what}: layers end at different positions");
    let from = got.first_position.max(want.first_position);
    let (g, w) = (got.tail_from(from), want.tail_from(from));
    assert_close(&format!("{what} K"), &g.k, &w.k, tol);
    assert_close(&format!("{what} V"), &g.v, &w.v, tol);
}
