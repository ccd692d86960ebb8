//! What a graph's f16 cache holds of a K or V value (`Body::reduce_precision` to e5m10, compiled
//! for the CPU and run on `local-task`) against the reference's `CacheType::F16.round`, element
//! for element: ties at the tenth mantissa bit (to even), the subnormal range (flushed to zero),
//! the overflow boundary (65504 stays, 65520 goes to inf), signed zeros, and seeded random
//! values over the range K and V take. A missing tool fails, never skips.

mod common;

use common::{run_module, Array, Noise};
use export::mlir::{Body, Elem, Ty, V};
use export::Target;
use kv_core::manifest::CacheType;

fn values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        // 1 + half an f16 ulp (a tie: stays 1) and 1 + 1.5 ulps (a tie: goes up to 1 + 2 ulps)
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-11) + 2f32.powi(-20),
        -1.0 - 3.0 * 2f32.powi(-11),
        // around f16's smallest normal, 2^-14
        2f32.powi(-14),
        -2f32.powi(-14),
        2f32.powi(-14) * (1.0 - 2f32.powi(-12)),
        2f32.powi(-14) * (1.0 - 2f32.powi(-10)),
        3e-5,
        -2.5e-6,
        6e-8,
        1e-30,
        // around the largest finite f16
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        1e6,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let mut noise = Noise::new(7);
    for scale in [1e-3f32, 1.0, 30.0, 3000.0] {
        v.extend(noise.row(200).iter().map(|x| x * scale));
    }
    v
}

#[test]
fn graph_rounding_equals_the_references() {
    let values = values();
    let n = values.len();
    let x = V {
        name: "%arg0".into(),
        ty: Ty::fixed(&[n], Elem::F32),
    };
    let mut b = Body::new();
    let r = b.reduce_precision(&x, 5, 10);
    let mlir = format!(
        "module @module {{\n  func.func @round(%arg0: {ty}) -> {ty} {{\n{}    return {} : {ty}\n  }}\n}}\n",
        b.finish(),
        r.name,
        ty = x.ty.text(),
    );
    let dir = tempfile::tempdir().unwrap();
    let (source, vmfb) = (dir.path().join("round.mlir"), dir.path().join("round.vmfb"));
    std::fs::write(&source, mlir).unwrap();
    export::compile(&source, &Target::cpu(), &vmfb).unwrap_or_else(|e| panic!("{e}"));
    let got = run_module(
        dir.path(),
        "local-task",
        &vmfb,
        &[],
        "round",
        &[Array::F32(vec![n], values.clone())],
        1,
    );
    for (i, (&x, &g)) in values.iter().zip(got[0].f32()).enumerate() {
        let want = CacheType::F16.round(x);
        assert!(
            g.to_bits() == want.to_bits(),
            "value {i} ({x:e}): the graph holds {g:e}, the reference {want:e}"
        );
        // What a cache of f16 elements stores of it: exactly that value.
        let stored = CacheType::F16.decode(&CacheType::F16.encode(&[x]))[0];
        assert!(
            stored.to_bits() == want.to_bits() || (stored == 0.0 && want == 0.0),
            "value {i} ({x:e}): stored {stored:e}"
        );
    }
}
