//! Properties of the shared math (kv-core's RoPE tables, chunk masks and window plans) against
//! straightforward definitions written here.

use kv_core::mask::{chunk_mask, prefill_mask, MASKED};
use kv_core::rope::{apply_rope, RopeTable};
use kv_core::window::{past_rows, PastCall};
use kv_core::{KvSpec, LayerKind, WindowRule};
use proptest::prelude::*;

fn spec(window: usize, chunk: usize) -> KvSpec {
    KvSpec {
        n_layers: 4,
        sliding_window: window,
        global_layer_period: 2,
        chunk,
        seq: 64,
        max_positions: 4096,
        ..KvSpec::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every cell is the angle `p · base^(-2i/d)`, split-half, sign folded into the first half.
    #[test]
    fn rope_table_cells(start in 0usize..5000, rows in 1usize..6, half in 1usize..33, base in prop::sample::select(vec![10_000.0f32, 1_000_000.0, 100_000.0])) {
        let d = 2 * half;
        let t = RopeTable::new(start, rows, d, base);
        for r in 0..rows {
            for i in 0..half {
                let angle = (start + r) as f64 * (base as f64).powf(-((2 * i) as f64) / d as f64);
                prop_assert!((t.cos_row(r)[i] as f64 - angle.cos()).abs() < 1e-6);
                prop_assert_eq!(t.cos_row(r)[i], t.cos_row(r)[i + half]);
                prop_assert!((t.sin_row(r)[i] as f64 + angle.sin()).abs() < 1e-6);
                prop_assert_eq!(t.sin_row(r)[i], -t.sin_row(r)[i + half]);
            }
        }
    }

    /// Applying a row equals the textbook `rotate_half` rotation, and keeps the norm.
    #[test]
    fn rope_application_is_a_rotation(p in 0usize..3000, x in prop::collection::vec(-2.0f32..2.0, 8)) {
        let t = RopeTable::new(p, 1, 8, 10_000.0);
        let mut y = x.clone();
        apply_rope(&mut y, t.cos_row(0), t.sin_row(0));
        for i in 0..4 {
            let theta = p as f64 / 10_000f64.powf(2.0 * i as f64 / 8.0);
            let (s, c) = (theta.sin() as f32, theta.cos() as f32);
            prop_assert!((y[i] - (x[i] * c - x[i + 4] * s)).abs() < 1e-5);
            prop_assert!((y[i + 4] - (x[i + 4] * c + x[i] * s)).abs() < 1e-5);
        }
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>().sqrt();
        prop_assert!((norm(&x) - norm(&y)).abs() < 1e-4);
    }

    /// Rotated dot products depend only on the distance between positions.
    #[test]
    fn rope_is_relative(p in 0usize..500, q in 0usize..500, shift in 0usize..500, a in prop::collection::vec(-1.0f32..1.0, 8), b in prop::collection::vec(-1.0f32..1.0, 8)) {
        let dot_at = |pa: usize, pb: usize| {
            let (ta, tb) = (RopeTable::new(pa, 1, 8, 10_000.0), RopeTable::new(pb, 1, 8, 10_000.0));
            let (mut x, mut y) = (a.clone(), b.clone());
            apply_rope(&mut x, ta.cos_row(0), ta.sin_row(0));
            apply_rope(&mut y, tb.cos_row(0), tb.sin_row(0));
            x.iter().zip(&y).map(|(u, v)| u * v).sum::<f32>()
        };
        prop_assert!((dot_at(p, q) - dot_at(p + shift, q + shift)).abs() < 1e-3);
    }

    /// Each cell of the chunk mask: the key's absolute position, and the rule written out.
    #[test]
    fn chunk_mask_cells(pos in 1usize..80, past_cut in 0usize..80, chunk in 1usize..10, n_cut in 0usize..10, window in prop::option::of(2usize..20), heads in 1usize..4) {
        let past = past_cut.min(pos);
        let n = 1 + n_cut % chunk;
        let m = chunk_mask(pos, past, n, chunk, window, heads);
        let cols = past + chunk;
        prop_assert_eq!(m.len(), heads * chunk * cols);
        for h in 0..heads {
            for i in 0..chunk {
                for j in 0..cols {
                    let cell = m[(h * chunk + i) * cols + j];
                    let open = if i >= n {
                        j == past + i
                    } else {
                        let query = pos + i;
                        let key = if j < past { pos - past + j } else { pos + (j - past) };
                        let is_padding_key = j >= past && j - past >= n;
                        let in_window = match window { Some(w) => query - key.min(query) < w, None => true };
                        !is_padding_key && key <= query && in_window
                    };
                    prop_assert_eq!(cell, if open { 0.0 } else { MASKED }, "head {} row {} col {}", h, i, j);
                }
            }
        }
    }

    /// A real chunk row sees exactly `min(a + 1, window)` keys when handed the chunk past.
    #[test]
    fn chunk_rows_see_the_window(pos in 1usize..200, window in 2usize..40, chunk in 1usize..12, n_cut in 0usize..12) {
        let s = spec(window, chunk);
        let n = 1 + n_cut % chunk;
        let past = past_rows(&s, LayerKind::Sliding, PastCall::Chunk, pos, WindowRule::Exact);
        let m = chunk_mask(pos, past, n, chunk, Some(window), 1);
        for i in 0..n {
            let a = pos + i;
            let open = m[i * (past + chunk)..(i + 1) * (past + chunk)].iter().filter(|&&c| c == 0.0).count();
            prop_assert_eq!(open, (a + 1).min(window), "row {} at {}", i, a);
        }
    }

    /// A step hands a sliding layer exactly the rows that complete its window (exact), or one more
    /// (the seed's rule); a global layer every row.
    #[test]
    fn step_rows(pos in 1usize..500, window in 2usize..64) {
        let s = spec(window, 8);
        let exact = past_rows(&s, LayerKind::Sliding, PastCall::Step, pos, WindowRule::Exact);
        let seed = past_rows(&s, LayerKind::Sliding, PastCall::Step, pos, WindowRule::SeedStep);
        prop_assert_eq!(exact + 1, (pos + 1).min(window));
        prop_assert_eq!(seed + 1, (pos + 1).min(window + 1));
        prop_assert_eq!(past_rows(&s, LayerKind::Global, PastCall::Step, pos, WindowRule::Exact), pos);
    }

    /// Over any sequence of calls, a sliding layer re-based on `past + n` rows always holds the
    /// rows the next call needs.
    #[test]
    fn sliding_cache_always_holds_the_next_window(window in 2usize..30, prefix in 1usize..64, calls in prop::collection::vec(0usize..=8, 1..60), seed_rule in any::<bool>()) {
        let s = spec(window, 8);
        let rule = if seed_rule { WindowRule::SeedStep } else { WindowRule::Exact };
        let (mut pos, mut held) = (prefix, prefix);
        for n in calls {
            let (call, n) = if n == 0 { (PastCall::Step, 1) } else { (PastCall::Chunk, n) };
            let past = past_rows(&s, LayerKind::Sliding, call, pos, rule);
            prop_assert!(past <= held, "needs {} rows, holds {}", past, held);
            held = past + n;
            pos += n;
            prop_assert!(held >= pos.min(window));
        }
    }

    /// The prefill mask is the causal band of width `window`.
    #[test]
    fn prefill_mask_band(seq in 1usize..40, window in prop::option::of(2usize..12)) {
        let m = prefill_mask(seq, window);
        for q in 0..seq {
            for k in 0..seq {
                let open = k <= q && window.is_none_or(|w| q - k < w);
                prop_assert_eq!(m[q * seq + k] == 0.0, open);
            }
        }
    }
}
