//! The in-graph argmax (`Body::argmax_rows`, two stages over a `[tiles, w]` layout of each row)
//! compiled alone for CPU and Vulkan and run with `iree-run-module` on `local-task` and `vulkan`
//! (lavapipe in CI): the index of the largest value, the **lowest index among equal maxima**,
//! whatever tile and column the tied values sit in, with and without padding of the last tile,
//! against `backend_reference::argmax_lowest`. A missing tool fails, never skips.

mod common;

use std::path::Path;

use common::{run_module, with_values, Array, Noise};
use export::mlir::{argmax_tiles, Body, Elem, Ty, V};
use export::Target;

/// `[rows, n]` → `[rows]` through `argmax_rows_tiled(tiles)` (`None`: the default tiling).
fn module(rows: usize, n: usize, tiles: Option<usize>) -> String {
    let x = V {
        name: "%arg0".into(),
        ty: Ty::fixed(&[rows, n], Elem::F32),
    };
    let mut b = Body::new();
    let ids = match tiles {
        Some(t) => b.argmax_rows_tiled(&x, t),
        None => b.argmax_rows(&x),
    };
    format!(
        "module @module {{\n  func.func @argmax(%arg0: {}) -> {} {{\n{}    return {} : {}\n  }}\n}}\n",
        x.ty.text(),
        ids.ty.text(),
        b.finish(),
        ids.name,
        ids.ty.text()
    )
}

fn run(dir: &Path, vmfb: &Path, device: &str, rows: usize, n: usize, values: &[f32]) -> Vec<i32> {
    let input = Array::F32(vec![rows, n], values.to_vec());
    run_module(dir, device, vmfb, &[], "argmax", &[input], 1)[0]
        .i32()
        .to_vec()
}

/// Rows that each have several equal maxima (the lowest index must win), placed so that the
/// lowest one is in a later column or an earlier tile than a higher one; plus a row of all-equal
/// values, a row of all `-inf`, a row whose maximum is the last real index (next to the padding),
/// and seeded random rows.
fn cases(n: usize, w: usize) -> Vec<(String, Vec<f32>)> {
    let mut noise = Noise::new(0x2545_f491_4f6c_dd1d);
    let base = noise.row(n);
    let with = |at: &[usize], v: f32| with_values(&base, at, v);
    let mut out = vec![
        // Lowest in a higher column of an earlier tile than the other: stage two must break the tie.
        (
            "tie across tiles and columns".to_string(),
            with(&[w + 7, 5 * w + 3], 9.5),
        ),
        // Both in one column: stage one must break the tie.
        ("tie within a column".to_string(), with(&[2, 3 * w + 2], 9.5)),
        // Three equal maxima, the first at the very start.
        ("tie at index 0".to_string(), with(&[0, w - 1, n - 1], 9.5)),
        ("all equal".to_string(), vec![1.25; n]),
        ("all -inf".to_string(), vec![f32::NEG_INFINITY; n]),
        ("maximum at the last index".to_string(), with(&[n - 1], 9.5)),
        ("random".to_string(), base.clone()),
    ];
    for i in 0..3 {
        out.push((format!("random {i}"), noise.row(n)));
    }
    out
}

/// Compiles the argmax of `[rows, n]` for both targets and checks every case on both devices.
fn check(rows: usize, n: usize, tiles: Option<usize>) {
    let t = tiles.unwrap_or_else(|| argmax_tiles(n));
    let w = n.div_ceil(t.max(1));
    assert!(n >= 6 * w, "the cases need at least six tiles: n {n}, tiles {t}");
    let dir = tempfile::tempdir().unwrap();
    let mlir = dir.path().join("argmax.mlir");
    let text = module(rows, n, tiles);
    assert_eq!(text.matches("reducer(").count(), 2, "two stages:\n{text}");
    if t * w > n {
        assert!(text.contains("stablehlo.concatenate"), "padded:\n{text}");
    }
    std::fs::write(&mlir, text).unwrap();
    let cases = cases(n, w);
    for (target, device) in [(Target::cpu(), "local-task"), (Target::vulkan(), "vulkan")] {
        let vmfb = dir.path().join(format!("argmax.{}.vmfb", target.key()));
        export::compile(&mlir, &target, &vmfb).unwrap_or_else(|e| panic!("{e}"));
        // `rows` cases per call, the last call wrapping around to the first cases.
        for batch in 0..cases.len().div_ceil(rows) {
            let picked: Vec<&(String, Vec<f32>)> =
                (0..rows).map(|r| &cases[(batch * rows + r) % cases.len()]).collect();
            let values: Vec<f32> = picked.iter().flat_map(|(_, v)| v.iter().copied()).collect();
            let got = run(dir.path(), &vmfb, device, rows, n, &values);
            for (r, (name, row)) in picked.iter().enumerate() {
                let want = backend_reference::argmax_lowest(row) as i32;
                assert_eq!(
                    got[r], want,
                    "{device}, [{rows}, {n}] in {t} tiles of {w}, row {r} ({name}): got {}, the lowest index of the maximum is {want}",
                    got[r]
                );
            }
        }
    }
}

/// Gemma 3's vocabulary in its default tiling (512 × 512, no padding), one row (the step).
#[test]
fn gemma_vocabulary_one_row() {
    assert_eq!(argmax_tiles(262_144), 512);
    check(1, 262_144, None);
}

/// A prime length: the default tiling pads the last tile (32 tiles of 32 over 1009 values).
#[test]
fn padded_tiles_several_rows() {
    assert_eq!(argmax_tiles(1009), 32);
    check(3, 1009, None);
}

/// An odd tiling with a one-element pad (7 tiles of 143 over 1000), several rows (redecode).
#[test]
fn explicit_tiling_one_padding_element() {
    check(4, 1000, Some(7));
}

#[test]
fn tiling_rule() {
    assert_eq!(argmax_tiles(512), 16, "tiny fixtures: 16 × 32");
    assert_eq!(argmax_tiles(384), 16, "tiny fixtures: 16 × 24");
    assert_eq!(argmax_tiles(49_152), 192, "SmolLM2: 192 × 256");
    assert_eq!(argmax_tiles(63), 1, "short rows: one reduce");
    assert_eq!(argmax_tiles(151_936), 390, "Qwen2: no divisor near the root, padded");
}
