//! The decode step's dispatch count, per Vulkan profile, as a test: what bounds the GPU step is
//! the chain of dispatches (docs/benchmarks.md, "Portable"), and a change of the emitter that
//! keeps IREE from fusing (a reshape between a reduction and its consumer, a `slice` of a
//! dispatch's result) adds dispatches silently: the tokens stay right and only the device shows
//! it. Each fixture's step is compiled to IREE's `flow` level (the compiler, no device; a second
//! or two each) and its `flow.dispatch` ops counted against `EXPECTED`.
//!
//! A change meant to move a count updates `EXPECTED`, naming the new counts in its commit
//! (`scripts/h200/count-dispatches.sh` gives the breakdown by kind, at the twin's size too).

use export::{ExportOptions, ExportPlan, Source, Target};
use kv_core::ContractVersion;

/// `(fixture, profile, dispatches a call of the step)`: the portable profile (no subgroup
/// operations, contract 2 by default) and the NVIDIA-tuned one. Session 25: the portable step of
/// `tiny-gemma3:7` was 273 before its norms, gate/up, attention and carried post-norms fused,
/// then 143; session 26 gave back one a layer on purpose: the gate and up as two products, each
/// vectorized by IREE, where one product of two results was a scalar loop (same decode, a 1.2x
/// faster chunk call on an H100); session 27 one more a layer and KV head: the own row's
/// scores in lanes of their own, where the cache's went from one scalar loop a score to 16
/// vectorized lanes (167 -> 43 us a sliding layer on an H100, decode 2.5-5.5% faster); session
/// 28 two fewer a layer: gate and up as one matrix, one split product whose second stage sums
/// both halves and joins the activation (the barriers between them one fewer a layer).
const EXPECTED: &[(&str, Option<&str>, usize)] = &[
    ("tiny-gemma3:7", None, 151),
    ("tiny-gemma3-gqa:7", None, 183),
    ("tiny-gemma3:7", Some("ampere"), 102),
    ("tiny-gemma3-gqa:7", Some("ampere"), 134),
];

/// `flow.dispatch` ops inside `util.func public @fn` of a `--compile-to=flow` module.
fn dispatches_in(flow: &str, func: &str) -> usize {
    let head = format!("util.func public @{func}(");
    let mut lines = flow.lines().skip_while(|l| !l.trim_start().starts_with(&head));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no function @{func} in the flow module"));
    let indent = first.len() - first.trim_start().len();
    let close = format!("{}}}", " ".repeat(indent));
    lines
        .take_while(|l| *l != close)
        .filter(|l| l.contains("flow.dispatch @"))
        .count()
}

fn step_dispatches(fixture: &str, vulkan_target: Option<&str>) -> usize {
    let dir = fixtures::materialize(fixture).unwrap();
    let target = Target::Vulkan {
        target: vulkan_target.map(str::to_string),
    };
    let mut options = ExportOptions {
        targets: vec![target.clone()],
        ..export::runtime_options_for(&target, ContractVersion::V2)
    };
    if vulkan_target.is_some() {
        options.weights = export::WeightFormat::I16;
    }
    let plan = ExportPlan::new(&Source::Dir(dir), &options).unwrap();
    let (_, text) = plan
        .module_texts()
        .next()
        .unwrap_or_else(|| panic!("{fixture}: no module"));
    let tmp = tempfile::tempdir().unwrap();
    let (mlir, flow) = (tmp.path().join("step.mlir"), tmp.path().join("step.flow.mlir"));
    std::fs::write(&mlir, text).unwrap();
    let flags = [
        "--iree-opt-const-expr-hoisting=false".to_string(),
        "--compile-to=flow".to_string(),
    ];
    export::compile_with(&mlir, &target, &flow, &flags).unwrap_or_else(|e| panic!("{fixture}: {e}"));
    dispatches_in(&std::fs::read_to_string(&flow).unwrap(), "gemma_with_past")
}

#[test]
fn the_decode_step_has_the_dispatches_it_had() {
    let mut wrong = Vec::new();
    for &(fixture, vulkan_target, want) in EXPECTED {
        let got = step_dispatches(fixture, vulkan_target);
        let profile = vulkan_target.unwrap_or("portable");
        eprintln!("{fixture} {profile}: {got} dispatches a step");
        if got != want {
            wrong.push(format!("{fixture} {profile}: {got} dispatches a step, expected {want}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn counting_stops_at_the_function_s_end() {
    let flow = "  util.func public @a(%x) {\n    flow.dispatch @e::@one\n  }\n  util.func public @b() {\n    flow.dispatch @e::@two\n    flow.dispatch @e::@three\n  }\n";
    assert_eq!(dispatches_in(flow, "a"), 1);
    assert_eq!(dispatches_in(flow, "b"), 2);
}
