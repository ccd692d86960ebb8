//! RoPE tables, split-half with the sign folded into the first half (CONTRACT §2). The graphs
//! compute `x·cos + swap_halves(x)·sin`, so for `i < d/2` and angle `a = p · base^(-2i/d)`:
//! `cos[i] = cos[i + d/2] = cos a`, `sin[i] = -sin a`, `sin[i + d/2] = +sin a`.

/// `[n, d]` cosine and sine tables for the absolute positions `start .. start + n`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub start: usize,
    pub rows: usize,
    pub head_dim: usize,
    /// Row-major `[rows, head_dim]`.
    pub cos: Vec<f32>,
    /// Row-major `[rows, head_dim]`, sign folded.
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(start: usize, rows: usize, head_dim: usize, base: f32) -> Self {
        assert!(
            head_dim % 2 == 0,
            "split-half RoPE needs an even head width, got {head_dim}"
        );
        let half = head_dim / 2;
        // The angle in f64: positions reach the thousands, and the tables are the one place where
        // every backend's rotation comes from, so they are computed as exactly as we can.
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| (base as f64).powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        let mut cos = vec![0.0f32; rows * head_dim];
        let mut sin = vec![0.0f32; rows * head_dim];
        for r in 0..rows {
            let p = (start + r) as f64;
            let row = r * head_dim;
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, c) = (p * f).sin_cos();
                cos[row + i] = c as f32;
                cos[row + i + half] = c as f32;
                sin[row + i] = -s as f32;
                sin[row + i + half] = s as f32;
            }
        }
        RopeTable {
            start,
            rows,
            head_dim,
            cos,
            sin,
        }
    }

    pub fn cos_row(&self, r: usize) -> &[f32] {
        &self.cos[r * self.head_dim..(r + 1) * self.head_dim]
    }

    pub fn sin_row(&self, r: usize) -> &[f32] {
        &self.sin[r * self.head_dim..(r + 1) * self.head_dim]
    }
}

/// Applies a table row to one head vector in place: `x·cos + swap_halves(x)·sin`.
pub fn apply_rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}
