//! The optional top-k results (`ExportOptions::top_k`): `Body::top_k` (CHLO's `top_k`) compiled
//! alone for CPU and Vulkan and run with `iree-run-module` on `local-task` and `vulkan`
//! (lavapipe in CI), equal values **lowest index first** as the argmax; and a fixture exported
//! with a top-k, whose prefill, chunk and step graphs return the reference's best logits.
//! A missing tool fails, never skips.

mod common;

use std::path::Path;

use backend_reference::{ReferenceKv, ReferenceModel};
use common::{run_module, with_values, Array, GraphSession, Noise};
use export::mlir::{Body, Elem, Ty, V};
use export::{export_artifacts, ExportOptions, Source, Target};
use kv_core::manifest::Name;
use kv_core::{Graph, KvBackend, TopK, WindowRule};

/// `[rows, n]` → the values `[rows, k]` and indices `[rows, k]` of `Body::top_k`.
fn module(rows: usize, n: usize, k: usize) -> String {
    let x = V {
        name: "%arg0".into(),
        ty: Ty::fixed(&[rows, n], Elem::F32),
    };
    let mut b = Body::new();
    let (values, ids) = b.top_k(&x, k);
    format!(
        "module @module {{\n  func.func @topk(%arg0: {}) -> ({}, {}) {{\n{}    return {}, {} : {}, {}\n  }}\n}}\n",
        x.ty.text(),
        values.ty.text(),
        ids.ty.text(),
        b.finish(),
        values.name,
        ids.name,
        values.ty.text(),
        ids.ty.text()
    )
}

fn run(dir: &Path, vmfb: &Path, device: &str, rows: usize, n: usize, values: &[f32]) -> (Vec<f32>, Vec<i32>) {
    let input = Array::F32(vec![rows, n], values.to_vec());
    let [values, ids] = &run_module(dir, device, vmfb, &[], "topk", &[input], 2)[..] else {
        unreachable!("two outputs asked for")
    };
    (values.f32().to_vec(), ids.i32().to_vec())
}

/// Rows with equal values straddling the k-th place, equal maxima far apart, all equal, and noise.
fn cases(n: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut noise = Noise::new(0x9e37_79b9_7f4a_7c15);
    let base = noise.row(n);
    let with = |at: &[usize], v: f32| with_values(&base, at, v);
    vec![
        (
            "equal maxima, the lowest last in memory order",
            with(&[n - 1, 700, 3, 350], 9.5),
        ),
        // Ten equal values for the last three places: the three lowest indices must win.
        (
            "a tie across the k-th place",
            with(&[990, 10, 500, 20, 900, 30, 40, 800, 50, 60], 6.0),
        ),
        ("all equal", vec![1.25; n]),
        ("noise", base.clone()),
    ]
}

#[test]
fn top_k_op_breaks_ties_lowest_index_first_on_cpu_and_vulkan() {
    let (rows, n, k) = (1, 1000, 8);
    let dir = tempfile::tempdir().unwrap();
    let mlir = dir.path().join("topk.mlir");
    std::fs::write(&mlir, module(rows, n, k)).unwrap();
    for (target, device) in [(Target::cpu(), "local-task"), (Target::vulkan(), "vulkan")] {
        let vmfb = dir.path().join(format!("topk.{}.vmfb", target.key()));
        export::compile(&mlir, &target, &vmfb).unwrap_or_else(|e| panic!("{e}"));
        for (name, row) in cases(n) {
            let (values, ids) = run(dir.path(), &vmfb, device, rows, n, &row);
            let want = TopK::of_logits(&row, k);
            assert_eq!(ids, want.ids(), "{device}, {name}: ids");
            assert_eq!(values, want.logits(), "{device}, {name}: values");
        }
    }
}

/// How close the graphs' top logits must be to the reference's (the tokens' own tolerance is
/// exact equality; these are f32 logits of a different summation order).
const LOGIT_TOLERANCE: f32 = 1e-3;

#[test]
fn exported_graphs_return_the_reference_top_k() {
    let k = 16;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("artifacts");
    let options = ExportOptions {
        prefill_seq: Some(32),
        graphs: Graph::KV.to_vec(),
        // Halves compile time; hoisting is covered by `graphs.rs`.
        compile_flags: vec!["--iree-opt-const-expr-hoisting=false".into()],
        top_k: k,
        ..ExportOptions::default()
    };
    let m = export_artifacts(
        &Source::Dir(fixtures::materialize("tiny-gemma3:7").unwrap()),
        &out,
        &options,
    )
    .unwrap();
    assert_eq!(m.top_k, Some(k));
    for g in Graph::KV {
        let outputs = m.outputs_or_canonical(g);
        assert_eq!(
            &outputs[outputs.len() - 2..],
            [Name::TopKLogits, Name::TopKIds],
            "{g:?}"
        );
    }
    let model = ReferenceModel::open(&out).unwrap();
    let vocab = m.spec.vocab_size as i32;
    let prompt: Vec<i32> = (0..20).map(|i| (i * 37 + 5) % vocab).collect();
    for (target, device) in [("llvm-cpu", "local-task"), ("vulkan", "vulkan")] {
        let mut g = GraphSession::open(&out, target, device, &out.join(format!("work-{device}")));
        let mut r = ReferenceKv::new(model.clone(), WindowRule::Exact);
        let check = |what: &str, token: i32, g: &GraphSession, r: &ReferenceKv| {
            let (logits, ids) = g.last_top_k.clone().expect("no top-k results");
            let want = r.last_top_k(k).unwrap().unwrap();
            assert_eq!(
                ids,
                want.ids(),
                "{device} {what}: ids (near-tied logits? {:?})",
                want.logits()
            );
            for (got, want) in logits.iter().zip(want.logits()) {
                assert!(
                    (got - want).abs() <= LOGIT_TOLERANCE,
                    "{device} {what}: logit {got} against {want}"
                );
            }
            assert_eq!(
                token, ids[0],
                "{device} {what}: the token is not the first of the top-k"
            );
        };
        let token = g.prefill(&prompt);
        r.prefill(&prompt).unwrap();
        check("prefill", token, &g, &r);
        let token = g.chunk(&prompt[..5]);
        r.chunk(&prompt[..5]).unwrap();
        check("chunk", token, &g, &r);
        let token = g.step(token);
        r.step(r.last_top_k(1).unwrap().unwrap().ids()[0]).unwrap();
        check("step", token, &g, &r);
    }
}
