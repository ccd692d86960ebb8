//! Comparisons with a documented tolerance that print the first mismatches.

use kv_core::tolerance::{max_diff, Tolerance};
use kv_core::LayerKv;

/// Asserts two slices agree within `tol`, printing the first few mismatches.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tolerance) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let bad = tol.mismatches(got, want, 5);
    if !bad.is_empty() {
        let (abs, rel) = max_diff(got, want);
        panic!(
            "{what}: outside {tol:?} (max abs {abs:e}, max rel {rel:e}); first mismatches (index, got, want): {bad:?}"
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
