//! Documented tolerances for comparing K/V and logits across backends and paths.
//!
//! Two paths through the same FP32 math (a whole prefill versus prefix + chunks + steps) differ
//! only in summation order and in padding rows: errors stay at a few ulps of the activations.
//! A bf16-weights backend against the FP32 reference reading the same bf16 weights differs only in
//! accumulation order too, so the same bound applies; an FP32 reference against bf16 weights would
//! not, and is not what we compare.

/// `|a - b| <= abs + rel * max(|a|, |b|)` elementwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub abs: f32,
    pub rel: f32,
}

impl Tolerance {
    /// The same FP32 forward computed along two paths of one backend.
    pub const SAME_BACKEND: Tolerance = Tolerance { abs: 1e-4, rel: 1e-4 };
    /// Two backends (host ndarray versus compiled IREE kernels) on the same weights.
    pub const CROSS_BACKEND: Tolerance = Tolerance { abs: 2e-3, rel: 2e-3 };

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
