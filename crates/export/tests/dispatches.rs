//! The decode step's dispatches and dependent levels, per Vulkan profile, as a test: what bounds
//! the GPU step is the chain of dispatches (docs/benchmarks.md, "Portable"), and a change of the
//! emitter that keeps IREE from fusing (a reshape between a reduction and its consumer, a `slice`
//! of a dispatch's result) adds dispatches silently: the tokens stay right and only the device
//! shows it. Each fixture's step is compiled to IREE's `stream` level (the compiler, no device;
//! a few seconds each) and counted against `EXPECTED`: its `stream.cmd.dispatch` ops, and its
//! levels, the serial steps of its `stream.cmd.execute` regions (a dispatch, a copy, or a
//! `stream.cmd.concurrent` group), between which the command buffer has its barriers. On a GPU
//! each level costs a launch and a barrier whatever it holds (sessions 26-28: 18-24 µs on an
//! H100's portable step), so the levels, not the dispatches, are what a form must cut.
//!
//! A change meant to move a count updates `EXPECTED`, naming the new counts in its commit
//! (`scripts/h200/count-dispatches.sh` gives the breakdown by kind, at the twin's size too).

use export::{ExportOptions, ExportPlan, Source, Target};
use kv_core::ContractVersion;

/// `(fixture, profile, dispatches a call of the step, its levels)`: the portable profile (no
/// subgroup operations, contract 2 by default) and the NVIDIA-tuned one. Session 25: the portable
/// step of `tiny-gemma3:7` was 273 before its norms, gate/up, attention and carried post-norms
/// fused, then 143; session 26 gave back one a layer on purpose: the gate and up as two products,
/// each vectorized by IREE, where one product of two results was a scalar loop (same decode, a
/// 1.2x faster chunk call on an H100); session 27 one more a layer and KV head: the own row's
/// scores in lanes of their own, where the cache's went from one scalar loop a score to 16
/// vectorized lanes (167 -> 43 us a sliding layer on an H100, decode 2.5-5.5% faster); session
/// 28 two fewer a layer: gate and up as one matrix, one split product whose second stage sums
/// both halves and joins the activation (the barriers between them one fewer a layer). Levels
/// counted since session 30, when the tuned step gave one dispatch a layer for one level fewer:
/// the Q/K norms' factors left to the scores, the rotation beside the norms' sums (the new keys
/// scaled in a dispatch of their own, beside the values).
const EXPECTED: &[(&str, Option<&str>, usize, usize)] = &[
    ("tiny-gemma3:7", None, 151, 143),
    ("tiny-gemma3-gqa:7", None, 183, 159),
    ("tiny-gemma3:7", Some("ampere"), 110, 71),
    ("tiny-gemma3-gqa:7", Some("ampere"), 142, 87),
];

/// The lines of `util.func public @func` in a module's text.
fn function_lines<'a>(module: &'a str, func: &str) -> Vec<&'a str> {
    let head = format!("util.func public @{func}(");
    let mut lines = module.lines().skip_while(|l| !l.trim_start().starts_with(&head));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no function @{func} in the module"));
    let indent = first.len() - first.trim_start().len();
    let close = format!("{}}}", " ".repeat(indent));
    lines.take_while(|l| *l != close).collect()
}

/// `(dispatches, levels)` of `func` in a `--compile-to=stream` module: its `stream.cmd.dispatch`
/// ops, and the ops directly inside its `stream.cmd.execute` regions (a dispatch, a copy, or a
/// concurrent group of them), each one level of the chain.
fn dispatches_and_levels(stream: &str, func: &str) -> (usize, usize) {
    let lines = function_lines(stream, func);
    let dispatches = lines
        .iter()
        .filter(|l| l.trim_start().starts_with("stream.cmd.dispatch @"))
        .count();
    let mut levels = 0;
    let mut execute: Option<usize> = None;
    for l in lines {
        let indent = l.len() - l.trim_start().len();
        let op = l.trim_start();
        match execute {
            None if op.contains("= stream.cmd.execute ") && op.ends_with('{') => execute = Some(indent),
            Some(at) if indent == at && op.starts_with('}') => execute = None,
            Some(at) if indent == at + 2 && op.starts_with("stream.cmd.") => levels += 1,
            _ => {}
        }
    }
    (dispatches, levels)
}

fn step_dispatches(fixture: &str, vulkan_target: Option<&str>) -> (usize, usize) {
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
    let (mlir, stream) = (tmp.path().join("step.mlir"), tmp.path().join("step.stream.mlir"));
    std::fs::write(&mlir, text).unwrap();
    let flags = [
        "--iree-opt-const-expr-hoisting=false".to_string(),
        "--compile-to=stream".to_string(),
    ];
    export::compile_with(&mlir, &target, &stream, &flags).unwrap_or_else(|e| panic!("{fixture}: {e}"));
    dispatches_and_levels(&std::fs::read_to_string(&stream).unwrap(), "gemma_with_past")
}

#[test]
fn the_decode_step_has_the_dispatches_it_had() {
    let mut wrong = Vec::new();
    for &(fixture, vulkan_target, want, want_levels) in EXPECTED {
        let (got, levels) = step_dispatches(fixture, vulkan_target);
        let profile = vulkan_target.unwrap_or("portable");
        eprintln!("{fixture} {profile}: {got} dispatches a step in {levels} levels");
        if (got, levels) != (want, want_levels) {
            wrong.push(format!(
                "{fixture} {profile}: {got} dispatches a step in {levels} levels, expected {want} in {want_levels}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn counting_stops_at_the_function_s_end() {
    let stream = "  util.func public @a(%x) {
    %0 = stream.cmd.execute on(#d) with(%x as %y: !r) {
      stream.cmd.dispatch @e::@one {
      }
      stream.cmd.concurrent {
        stream.cmd.dispatch @e::@two {
        }
        stream.cmd.copy %y[%c0], %y[%c4], %c4 : !r -> !r
      }
      stream.cmd.dispatch @e::@three {
      }
    } => !stream.timepoint
    %1 = stream.cmd.execute on(#d) with(%x as %y: !r) {
      stream.cmd.copy %y[%c0], %y[%c4], %c4 : !r -> !r
    } => !stream.timepoint
  }
  util.func public @b() {
    %0 = stream.cmd.execute on(#d) with(%x as %y: !r) {
      stream.cmd.dispatch @e::@four {
      }
    } => !stream.timepoint
  }
";
    assert_eq!(dispatches_and_levels(stream, "a"), (3, 4));
    assert_eq!(dispatches_and_levels(stream, "b"), (1, 1));
}
