//! The in-graph argmax (`Body::argmax_rows`: two or three stages over a `[s0, s1, …]` layout of
//! each row) compiled alone for CPU and Vulkan and run with `iree-run-module` on `local-task` and
//! `vulkan` (lavapipe in CI): the index of the largest value, the **lowest index among equal
//! maxima**, whatever stage has to break the tie, with and without padding, against
//! `backend_reference::argmax_lowest`. The CPU's form (`Body::argmax_rows_by_max`: the maximum,
//! then the lowest index holding it) on the same cases, on `local-task`. A missing tool fails,
//! never skips.

mod common;

use std::path::Path;

use common::{run_module, with_values, Array, Noise};
use export::mlir::{argmax_stages, argmax_stages_of_width, argmax_tiles, Body, Elem, Ty, V};
use export::Target;

/// Which emitter of the argmax a module uses.
#[derive(Clone, Copy)]
enum Form<'a> {
    /// `argmax_rows_staged(stages)`; `None`: the default stages (`argmax_rows`).
    Staged(Option<&'a [usize]>),
    /// `argmax_rows_by_max` (CPU modules).
    ByMax,
}

/// `[rows, n]` → `[rows]` through the argmax of `form`.
fn module(rows: usize, n: usize, form: Form) -> String {
    let x = V {
        name: "%arg0".into(),
        ty: Ty::fixed(&[rows, n], Elem::F32),
    };
    let mut b = Body::new();
    let ids = match form {
        Form::Staged(Some(st)) => b.argmax_rows_staged(&x, st),
        Form::Staged(None) => b.argmax_rows(&x),
        Form::ByMax => b.argmax_rows_by_max(&x),
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

/// Rows that each have several equal maxima (the lowest index must win): for every stage, two
/// maxima that differ only along that stage's axis (so that stage breaks the tie), and two whose
/// lower index sits later along a later axis; plus ties at index 0, a row of all-equal values,
/// a row of all `-inf`, a row whose maximum is the last real index (next to the padding), and
/// seeded random rows.
fn cases(n: usize, stages: &[usize]) -> Vec<(String, Vec<f32>)> {
    let mut noise = Noise::new(0x2545_f491_4f6c_dd1d);
    let base = noise.row(n);
    let with = |at: &[usize], v: f32| with_values(&base, at, v);
    // The index step of one unit along axis k of the `[s0, s1, …]` layout.
    let stride = |k: usize| stages[k + 1..].iter().product::<usize>();
    let mut out = Vec::new();
    for k in 0..stages.len() {
        let (sk, step) = (stages[k], stride(k));
        if sk < 4 {
            continue;
        }
        // Same coordinates on every other axis: stage k + 1 must break the tie.
        let a = 2 % step;
        let b = a + 3 * step;
        if b < n {
            out.push((format!("tie along stage {}", k + 1), with(&[b, a], 9.5)));
        }
        // The lower index one unit earlier along axis k but later along the last axis.
        if k + 1 < stages.len() {
            let (low, high) = (step + 7, 2 * step + 1);
            if low < high && high < n {
                out.push((format!("tie across stage {} and later", k + 1), with(&[high, low], 9.5)));
            }
        }
    }
    out.extend([
        ("tie at index 0".to_string(), with(&[0, n / 2, n - 1], 9.5)),
        ("all equal".to_string(), vec![1.25; n]),
        ("all -inf".to_string(), vec![f32::NEG_INFINITY; n]),
        ("maximum at the last index".to_string(), with(&[n - 1], 9.5)),
        ("random".to_string(), base.clone()),
    ]);
    for i in 0..3 {
        out.push((format!("random {i}"), noise.row(n)));
    }
    out
}

/// Compiles the argmax of `[rows, n]` for both targets (the staged form) or the CPU (by
/// maximum) and checks every case on those devices. The tie cases follow the default stages of
/// `n` (or the explicit ones) for both forms.
fn check(rows: usize, n: usize, form: Form) {
    let st = match form {
        Form::Staged(Some(st)) => st.to_vec(),
        _ => argmax_stages(n),
    };
    let dir = tempfile::tempdir().unwrap();
    let mlir = dir.path().join("argmax.mlir");
    let text = module(rows, n, form);
    let targets = match form {
        Form::Staged(_) => {
            assert_eq!(text.matches("reducer(").count(), st.len(), "{st:?}:\n{text}");
            if st.iter().product::<usize>() > n {
                assert!(text.contains("stablehlo.concatenate"), "padded:\n{text}");
            }
            vec![(Target::cpu(), "local-task"), (Target::vulkan(), "vulkan")]
        }
        Form::ByMax => {
            assert_eq!(text.matches("stablehlo.reduce(").count(), 2, "{text}");
            assert!(!text.contains("reducer("), "{text}");
            vec![(Target::cpu(), "local-task")]
        }
    };
    std::fs::write(&mlir, text).unwrap();
    let cases = cases(n, &st);
    assert!(cases.len() >= 10, "{st:?}: {} cases", cases.len());
    for (target, device) in targets {
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
                    got[r],
                    want,
                    "{device}, [{rows}, {n}] ({}), row {r} ({name}): got {}, the lowest index of the maximum is {want}",
                    match form {
                        Form::Staged(_) => format!("in stages {st:?}"),
                        Form::ByMax => "by maximum".to_string(),
                    },
                    got[r]
                );
            }
        }
    }
}

/// Gemma 3's vocabulary in its default stages (64 × 64 × 64, no padding), one row (the step).
#[test]
fn gemma_vocabulary_one_row() {
    assert_eq!(argmax_stages(262_144), [64, 64, 64]);
    check(1, 262_144, Form::Staged(None));
}

/// Qwen2's vocabulary: three stages with padding (32 × 69 × 69 over 151936), two rows.
#[test]
fn padded_three_stages_two_rows() {
    assert_eq!(argmax_stages(151_936), [32, 69, 69]);
    check(2, 151_936, Form::Staged(None));
}

/// A prime length: two stages, the last tile padded (32 tiles of 32 over 1009 values).
#[test]
fn padded_tiles_several_rows() {
    assert_eq!(argmax_stages(1009), [32, 32]);
    check(3, 1009, Form::Staged(None));
}

/// An odd tiling with a one-element pad (7 tiles of 143 over 1000), several rows (redecode).
#[test]
fn explicit_tiling_one_padding_element() {
    check(4, 1000, Form::Staged(Some(&[7, 143])));
}

/// NVIDIA Vulkan exports' stages of 16 (`GpuTuning::argmax_width`): Gemma 3's vocabulary in
/// five stages, and Qwen2's padded.
#[test]
fn stages_of_sixteen() {
    let gemma = argmax_stages_of_width(262_144, 16);
    assert_eq!(gemma, [16, 16, 16, 16, 4]);
    check(1, 262_144, Form::Staged(Some(&gemma)));
    let qwen = argmax_stages_of_width(151_936, 16);
    assert_eq!(qwen, [16, 16, 16, 16, 3], "padded to 196608");
    check(2, 151_936, Form::Staged(Some(&qwen)));
}

/// The CPU's form on Gemma 3's vocabulary (the step) and on several rows of a prime length
/// (redecode's rows), with the same ties.
#[test]
fn by_maximum_on_the_cpu() {
    check(1, 262_144, Form::ByMax);
    check(3, 1009, Form::ByMax);
}

#[test]
fn tiling_rule() {
    assert_eq!(argmax_stages_of_width(16, 16), [16], "one stage of the width");
    assert_eq!(argmax_stages_of_width(17, 16), [16, 2], "padded to 32");
    assert_eq!(argmax_stages_of_width(1, 16), [1]);
    for n in [2usize, 100, 4096, 49_152, 151_936, 262_144] {
        let st = argmax_stages_of_width(n, 16);
        assert!(
            st.iter().all(|&s| s <= 16) && st.iter().product::<usize>() >= n,
            "{n}: {st:?}"
        );
        assert!(
            st.iter().product::<usize>() / st[st.len() - 1] < n || st.len() == 1,
            "{n}: one stage too many: {st:?}"
        );
    }
    assert_eq!(argmax_stages(49_152), [32, 32, 48], "SmolLM2: three stages, exact");
    assert_eq!(argmax_stages(32_767), [151, 217], "below 32768: two stages");
    assert_eq!(argmax_stages(63), [63], "short rows: one reduce");
    assert_eq!(argmax_tiles(512), 16, "tiny fixtures: 16 × 32");
    assert_eq!(argmax_tiles(384), 16, "tiny fixtures: 16 × 24");
    assert_eq!(argmax_tiles(49_152), 192, "SmolLM2: 192 × 256");
    assert_eq!(argmax_tiles(63), 1, "short rows: one reduce");
    assert_eq!(argmax_tiles(151_936), 390, "Qwen2: no divisor near the root, padded");
}

/// What the allowed-token mask (`Body::allowed_logits`) adds to the CPU's argmax over Gemma 3's
/// 262,144 logits: the two forms compiled with the v2 CPU flags and timed by
/// `iree-benchmark-module` on `local-task` (medians of 20 repetitions, printed). A measurement,
/// for docs/contract-v2.md: `cargo test -p export --test argmax -- --ignored --nocapture mask_cost`.
#[test]
#[ignore = "a measurement"]
fn mask_cost_of_the_cpu_argmax() {
    let n = 262_144;
    let words = n / 32;
    let logits = V {
        name: "%arg0".into(),
        ty: Ty::fixed(&[1, n], Elem::F32),
    };
    let allowed = V {
        name: "%arg1".into(),
        ty: Ty::fixed(&[words], Elem::I32),
    };
    let dir = tempfile::tempdir().unwrap();
    for masked in [false, true] {
        let mut b = Body::new();
        let (args, x) = match masked {
            true => (
                format!("%arg0: {}, %arg1: {}", logits.ty.text(), allowed.ty.text()),
                b.allowed_logits(&logits, &allowed),
            ),
            false => (format!("%arg0: {}", logits.ty.text()), logits.clone()),
        };
        let ids = b.argmax_rows_by_max(&x);
        let text = format!(
            "module @module {{\n  func.func @argmax({args}) -> {} {{\n{}    return {} : {}\n  }}\n}}\n",
            ids.ty.text(),
            b.finish(),
            ids.name,
            ids.ty.text()
        );
        let mlir = dir.path().join(format!("argmax-{masked}.mlir"));
        std::fs::write(&mlir, text).unwrap();
        let vmfb = dir.path().join(format!("argmax-{masked}.vmfb"));
        let mut flags: Vec<String> = export::CPU_RUNTIME_FLAGS_V2.iter().map(|s| s.to_string()).collect();
        flags.push("--iree-llvmcpu-target-cpu=host".into());
        export::compile_with(&mlir, &Target::cpu(), &vmfb, &flags).unwrap();
        let mut cmd = std::process::Command::new("iree-benchmark-module");
        cmd.arg(format!("--module={}", vmfb.display()))
            .arg("--device=local-task")
            .arg("--function=argmax")
            .arg(format!("--input=1x{n}xf32=0"))
            .arg("--benchmark_repetitions=20")
            .arg("--benchmark_report_aggregates_only=true");
        if masked {
            cmd.arg(format!("--input={words}xi32=-1431655766"));
        }
        let out = cmd.output().expect("iree-benchmark-module (run scripts/setup.sh)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        for line in String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("median"))
        {
            println!("mask {masked}: {line}");
        }
    }
}
