//! Greedy decoding a step ahead of the host (`KvBackend::step_greedy` on Vulkan, lavapipe here):
//! the same tokens and caches as one step after the other, whichever prediction stops it, and
//! a session that goes on from there as if the step queued ahead had never run; under both
//! contracts (v2's steps write their rows into the caches, the step ahead too). One case runs
//! under a device profile, which changes no token and times each step.

use std::path::{Path, PathBuf};

use backend_iree::{IreeKvBackend, IreeOptions};
use export::{cached_export, cached_export_with, ExportOptions, Layout, Target};
use kv_core::backend::step_greedy_serially;
use kv_core::{Graph, KvBackend, Manifest};

const MODEL: &str = "tiny-gemma3:7";

fn artifacts() -> PathBuf {
    cached_export(MODEL, &Target::vulkan(), Layout::Shared).expect("export for Vulkan (run scripts/setup.sh)")
}

/// The contract v2 export the Vulkan conformance suite runs (`conformance::iree::artifacts_with`,
/// the same options: one cache entry): the chunk and step graphs in the three-module layout,
/// sliding rings of the window and 4 rows, which the steps below wrap, and fork from the
/// snapshot they restore.
fn artifacts_v2() -> PathBuf {
    let defaults = ExportOptions::default();
    let options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        ring_slack: Some(4),
        graphs: defaults
            .graphs
            .iter()
            .copied()
            .filter(|g| Graph::KV.contains(g))
            .collect(),
        targets: vec![Target::vulkan()],
        layout: Layout::Three,
        ..defaults
    };
    cached_export_with(MODEL, &options).expect("export v2 for Vulkan (run scripts/setup.sh)")
}

fn open(dir: &Path) -> IreeKvBackend {
    IreeKvBackend::open(dir, IreeOptions::new("vulkan")).unwrap()
}

/// A prompt longer than the fixture's sliding window (12) and its chunk (8).
fn prompt() -> Vec<i32> {
    (0..21).map(|i| (i * 37 + 11) % 200 + 3).collect()
}

/// Greedy from `token` until `stop_after` predictions or `max` steps: the predictions and the
/// step count, by `run`.
fn greedy<B: KvBackend>(
    backend: &mut B,
    token: i32,
    max: usize,
    stop_after: usize,
    run: impl Fn(&mut B, i32, usize, &mut dyn FnMut(i32) -> bool) -> kv_core::Result<usize>,
) -> (Vec<i32>, usize) {
    let mut seen = Vec::new();
    let mut more = |id: i32| {
        seen.push(id);
        seen.len() < stop_after
    };
    let steps = run(backend, token, max, &mut more).unwrap();
    (seen, steps)
}

#[test]
fn running_ahead_matches_stepping_and_leaves_no_trace() {
    matches_stepping(&artifacts());
}

#[test]
fn running_ahead_matches_stepping_and_leaves_no_trace_v2() {
    matches_stepping(&artifacts_v2());
}

fn matches_stepping(dir: &Path) {
    let manifest = Manifest::load(dir).unwrap();
    assert!(
        manifest.embed_function.is_some(),
        "a Vulkan export of a tied model has embedFunction"
    );
    let (mut ahead, mut serial) = (open(dir), open(dir));
    let first = ahead.prefill(&prompt()).unwrap();
    assert!(ahead.runs_ahead());
    assert_eq!(serial.prefill(&prompt()).unwrap(), first);
    let (start_a, start_s) = (ahead.snapshot().unwrap(), serial.snapshot().unwrap());
    // (max steps, stop after this many predictions): stopped by the reader at the first, in the
    // middle and at the last step; by `max`; a single step.
    let profile = tempfile::tempdir().unwrap();
    let profile = profile.path().join("steps.ireeprof");
    for (max, stop_after) in [(10, 1), (10, 4), (10, 10), (6, usize::MAX), (1, usize::MAX)] {
        ahead.restore(&start_a).unwrap();
        serial.restore(&start_s).unwrap();
        // One case runs under a device profile (`bench --device-profile`'s): it must change no
        // token, and the file names each step (checked below).
        let profiled = max == 6;
        if profiled {
            ahead.begin_device_profile(&profile).unwrap();
        }
        let got = greedy(&mut ahead, first, max, stop_after, |b, t, m, f| b.step_greedy(t, m, f));
        if profiled {
            ahead.end_device_profile().unwrap();
            // Ending again is no error.
            ahead.end_device_profile().unwrap();
        }
        let want = greedy(&mut serial, first, max, stop_after, |b, t, m, f| {
            step_greedy_serially(b, t, m, f)
        });
        let case = format!("max {max}, stop after {stop_after}");
        assert_eq!(got, want, "{case}");
        assert_eq!(got.1, max.min(stop_after), "{case}");
        assert_eq!(ahead.position(), serial.position(), "{case}");
        for l in 0..ahead.spec().n_layers {
            assert_eq!(
                ahead.read_layer(l).unwrap(),
                serial.read_layer(l).unwrap(),
                "{case}, layer {l}"
            );
        }
        // The step queued ahead of a stop is gone: the next step sees the kept position.
        let last = *got.0.last().unwrap();
        assert_eq!(
            ahead.step(last).unwrap(),
            serial.step(last).unwrap(),
            "{case}: the step after"
        );
    }
    let step_fn = manifest.functions.with_past.unwrap();
    let steps = profiled_submissions(&profile, step_fn.rsplit('.').next().unwrap());
    assert!(
        (6..=7).contains(&steps),
        "6 steps (and the one queued ahead), one queue submission each: {steps}"
    );
}

/// How many queue submissions ran dispatches of the function `function` in the device profile
/// at `path`, read by the wheel's `iree-profile`; every event timed.
fn profiled_submissions(path: &Path, function: &str) -> usize {
    let tool = std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("iree-profile"))
                .find(|p| p.is_file())
        })
        .expect("iree-profile on PATH (source scripts/env.sh; scripts/setup.sh installs it)");
    let listed = std::process::Command::new(tool)
        .args(["dispatch", "--dispatch_events", "--format=jsonl"])
        .arg(path)
        .output()
        .unwrap();
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let text = String::from_utf8(listed.stdout).unwrap();
    let mut submissions = std::collections::BTreeSet::new();
    for line in text
        .lines()
        .filter(|l| l.contains(&format!("\"key\":\"{function}_dispatch_")))
    {
        assert!(line.contains("\"valid\":true"), "{line}");
        let id = line
            .split("\"submission_id\":")
            .nth(1)
            .and_then(|t| t.split(',').next())
            .unwrap();
        submissions.insert(id.to_owned());
    }
    submissions.len()
}

/// Steps past the context: the same tokens as one step at a time, then the same error, and both
/// sessions at the last position (the step queued ahead was never queued, not half done).
#[test]
fn running_out_of_context_is_the_same_error_at_the_same_step() {
    // The export with a context of SEQ (256) positions, so that a prefill leaves 16 steps.
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(artifacts()).unwrap() {
        let entry = entry.unwrap();
        // Without the digests, which the edited manifest would no longer match.
        if entry.file_name() == kv_core::digests::DIGESTS_FILE {
            continue;
        }
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
    }
    let mut manifest = Manifest::load(copy.path()).unwrap();
    manifest.spec.max_positions = manifest.spec.seq;
    manifest.save(copy.path()).unwrap();
    let (mut ahead, mut serial) = (open(copy.path()), open(copy.path()));
    let long: Vec<i32> = (0..manifest.spec.seq as i32 - 16)
        .map(|i| (i * 37 + 11) % 200 + 3)
        .collect();
    let first = ahead.prefill(&long).unwrap();
    serial.prefill(&long).unwrap();
    let room = ahead.spec().max_positions - ahead.position();
    assert_eq!(room, 16);
    let run = |b: &mut IreeKvBackend, serially: bool| {
        let mut seen = Vec::new();
        let mut more = |id: i32| {
            seen.push(id);
            true
        };
        let result = if serially {
            step_greedy_serially(b, first, room + 5, &mut more)
        } else {
            b.step_greedy(first, room + 5, &mut more)
        };
        (result.map_err(|e| e.to_string()), seen, b.position())
    };
    let (got, want) = (run(&mut ahead, false), run(&mut serial, true));
    assert_eq!(got, want);
    assert!(got.0.as_ref().is_err_and(|e| e.contains("context overflow")), "{got:?}");
    assert_eq!(got.1.len(), room, "every step that fits");
    assert_eq!(got.2, ahead.spec().max_positions);
}

#[test]
fn a_missing_embedding_function_is_named_at_open() {
    let dir = artifacts();
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        // Without the digests, which the edited manifest would no longer match.
        if entry.file_name() == kv_core::digests::DIGESTS_FILE {
            continue;
        }
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
    }
    let path = copy.path().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("_embed_token\"", "_embed_nothing\"")).unwrap();
    let err = match IreeKvBackend::open(copy.path(), IreeOptions::new("vulkan")) {
        Ok(_) => panic!("opened a manifest naming a function the module lacks"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("embedFunction") && err.contains("_embed_nothing"), "{err}");
}
