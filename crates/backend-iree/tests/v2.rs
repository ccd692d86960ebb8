//! Contract v2 sessions (`docs/contract-v2.md`) against v1 sessions of the same model: the same
//! tokens and caches, snapshots that hold the set without copying it, writes in place where no
//! snapshot needs the rows, and a fork where one does.

use std::path::PathBuf;

use backend_iree::{IreeKvBackend, IreeOptions};
use backend_reference::{ReferenceKv, ReferenceModel};
use export::{cached_export, cached_export_with, runtime_options_for, ExportOptions, Layout, Target, WeightFormat};
use kv_core::diverge::{lockstep, LockstepOptions};
use kv_core::manifest::{CacheType, MatmulInput, Rounding};
use kv_core::tolerance::{assert_layers_close, max_diff, Tolerance};
use kv_core::{Error, Graph, KvBackend, KvSpec, WindowRule};

const MODEL: &str = "tiny-gemma3:7";

fn v1() -> PathBuf {
    cached_export(MODEL, &Target::cpu(), Layout::Shared).expect("export v1 (run scripts/setup.sh)")
}

fn v2() -> PathBuf {
    let options = ExportOptions {
        targets: vec![Target::cpu()],
        layout: Layout::Shared,
        contract: kv_core::ContractVersion::V2,
        ..ExportOptions::default()
    };
    cached_export_with(MODEL, &options).expect("export v2 (run scripts/setup.sh)")
}

/// v2 with f16 caches (`cacheType`), compiled as the runtime compiles CPU modules.
fn v2_f16() -> PathBuf {
    let options = ExportOptions {
        targets: vec![Target::cpu()],
        layout: Layout::Shared,
        cache_type: CacheType::F16,
        ..runtime_options_for(&Target::cpu(), kv_core::ContractVersion::V2)
    };
    cached_export_with(MODEL, &options).expect("export v2 with f16 caches")
}

fn open(dir: &std::path::Path) -> IreeKvBackend {
    IreeKvBackend::open(dir, IreeOptions::new("local-task")).unwrap()
}

/// A prompt longer than the fixture's sliding window (12) and its chunk (8).
fn prompt(n: i32) -> Vec<i32> {
    (0..n).map(|i| (i * 37 + 11) % 200 + 3).collect()
}

/// Restore, one chunk, then `steps` greedy steps: the tokens.
fn utterance<B: KvBackend>(s: &mut B, snapshot: &B::Snapshot, words: &[i32], steps: usize) -> Vec<i32> {
    s.restore(snapshot).unwrap();
    let mut out = vec![s.chunk(words).unwrap()];
    for _ in 0..steps {
        out.push(s.step(*out.last().unwrap()).unwrap());
    }
    out
}

/// Every layer on the rows both hold (a v1 sliding layer holds only its window). Not a replay of
/// one path: v1 and v2 are other graphs (v2 attends over the whole cache set under a mask and
/// writes its rows in place, v1 over a window it returns), so their f32 sums run in other
/// orders; but the same FP32 forward on the same device, so the same-backend bound, not the
/// 20x looser cross-backend one (measured: at most 4.8e-6 apart, in the three tests that
/// call this).
fn same_caches<A: KvBackend, B: KvBackend>(a: &A, b: &B) {
    for l in 0..a.spec().n_layers {
        let (got, want) = (b.read_layer(l).unwrap(), a.read_layer(l).unwrap());
        assert_layers_close(
            &format!("layer {l}, v2 against v1"),
            &got,
            &want,
            Tolerance::SAME_BACKEND,
        );
    }
}

#[test]
fn v2_matches_v1_and_restores_without_copies() {
    let (mut one, mut two) = (open(&v1()), open(&v2()));
    assert!(two.manifest().is_v2() && !one.manifest().is_v2());
    let prefix = prompt(21);
    assert_eq!(one.prefill(&prefix).unwrap(), two.prefill(&prefix).unwrap());
    assert_eq!(two.position(), 21);
    same_caches(&one, &two);

    let (p1, p2) = (one.snapshot().unwrap(), two.snapshot().unwrap());
    let words = [5, 17, 99, 42, 7];
    let want = utterance(&mut one, &p1, &words, 14);
    let got = utterance(&mut two, &p2, &words, 14);
    assert_eq!(got, want);
    same_caches(&one, &two);
    // The utterance wrote after the prefix, in place: no snapshot needed those rows.
    assert!(
        two.holds_views_of(&p2),
        "an utterance after a restore forked the caches"
    );

    // Again from the same snapshot: rows the first utterance left behind are overwritten.
    let other = [60, 61, 62];
    assert_eq!(utterance(&mut two, &p2, &other, 6), utterance(&mut one, &p1, &other, 6));
    assert!(two.holds_views_of(&p2));

    // A later snapshot pins rows after the prefix: writing there again forks.
    let (l1, l2) = (one.snapshot().unwrap(), two.snapshot().unwrap());
    let next_one = one.step(3).unwrap();
    let next_two = two.step(3).unwrap();
    assert_eq!(next_two, next_one);
    let got = utterance(&mut two, &p2, &words, 3);
    assert!(
        !two.holds_views_of(&p2),
        "a write below a live later snapshot did not fork"
    );
    assert_eq!(got, utterance(&mut one, &p1, &words, 3));
    // ... and the later snapshot still holds what it held.
    two.restore(&l2).unwrap();
    one.restore(&l1).unwrap();
    assert!(two.holds_views_of(&l2));
    same_caches(&one, &two);
    assert_eq!(two.step(3).unwrap(), next_one);
    // Once the later snapshots are gone, a write after the prefix is in place again.
    drop((l1, l2));
    utterance(&mut two, &p2, &words, 2);
    assert!(two.holds_views_of(&p2));
}

#[test]
fn v2_errors_leave_the_session_as_it_was() {
    let dir = v2();
    let mut s = open(&dir);
    assert!(matches!(s.chunk(&[1]), Err(Error::NotPrefilled { .. })));
    let first = s.prefill(&prompt(9)).unwrap();
    let snap = s.snapshot().unwrap();
    let spec = s.spec().clone();
    let err = s.chunk(&[]).unwrap_err();
    assert!(matches!(err, Error::BadTokenCount { op: "chunk", n: 0, .. }), "{err:?}");
    let err = s.chunk(&vec![1; spec.chunk + 1]).unwrap_err();
    assert!(
        matches!(err, Error::BadTokenCount { op: "chunk", n, max, .. } if n == spec.chunk + 1 && max == spec.chunk),
        "{err:?}"
    );
    let err = s.step(spec.vocab_size as i32).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TokenOutOfRange {
                op: "step",
                index: 0,
                ..
            }
        ),
        "{err:?}"
    );
    let err = s.prefill(&[]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadTokenCount {
                op: "prefill",
                n: 0,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(s.position(), 9);
    assert!(s.holds_views_of(&snap));
    let mut fresh = open(&dir);
    assert_eq!(fresh.prefill(&prompt(9)).unwrap(), first);
    assert_eq!(s.step(first).unwrap(), fresh.step(first).unwrap());

    // v2 builds its masks with the exact window rule only.
    let err = match IreeKvBackend::open(
        &dir,
        IreeOptions {
            rule: WindowRule::SeedStep,
            ..IreeOptions::new("local-task")
        },
    ) {
        Ok(_) => panic!("a v2 session opened with the seed's step rule"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::ContractMismatch { .. }), "{err}");
    assert!(err.to_string().contains("exact window rule"), "{err}");

    // v2 has no prefill graph to release; prefills are refused afterwards all the same.
    assert!(!s.release_prefill());
    assert!(matches!(s.prefill(&[1, 2]), Err(Error::GraphUnavailable { .. })));
    s.restore(&snap).unwrap();
    let mut again = open(&dir);
    again.prefill(&prompt(9)).unwrap();
    assert_eq!(s.chunk(&[4, 5]).unwrap(), again.chunk(&[4, 5]).unwrap());
}

/// The seed's JNI builds a v1 manifest from the spec and the files it is handed; the contract
/// (and v2's capacity) is read from the step function's declared arguments.
#[test]
fn a_v1_built_manifest_opens_v2_files_as_v2() {
    learns_v2_from_the_signatures(v2());
    // (Not `v2_f16()`: the runtime's flags encode some weights into a second archive, which the
    // seed's ABI has no slot for.)
    let f16 = ExportOptions {
        targets: vec![Target::cpu()],
        layout: Layout::Shared,
        contract: kv_core::ContractVersion::V2,
        cache_type: CacheType::F16,
        ..ExportOptions::default()
    };
    learns_v2_from_the_signatures(cached_export_with(MODEL, &f16).expect("export v2 with f16 caches"));
}

fn learns_v2_from_the_signatures(dir: PathBuf) {
    use kv_core::manifest::Parameters;
    let real = kv_core::Manifest::load(&dir).unwrap();
    let files = |graph: Graph| {
        let module = real.modules["llvm-cpu"][graph.key()].clone();
        let archive = real.parameter_file(graph).unwrap().to_string();
        (module, archive)
    };
    let built = |prefill: bool| {
        let spec = KvSpec {
            seq: real.spec.chunk,
            // What a JNI session declares (`jni::kv::MAX_POSITIONS`): the largest the limits allow.
            max_positions: kv_core::limits::MAX_POSITIONS,
            // Kotlin's IreeKvSpec knows none of these: the ring comes from the declared cache
            // shapes, and the seed's ABI has no prefill graph for v2 (nor its spans).
            ..real.spec.clone()
        };
        let mut m = kv_core::Manifest::new(spec, None, "jni");
        let mut modules = std::collections::BTreeMap::new();
        let mut archives = std::collections::BTreeMap::new();
        let graphs: &[Graph] = if prefill {
            &[Graph::Step, Graph::Chunk, Graph::Prefill]
        } else {
            &[Graph::Step, Graph::Chunk]
        };
        for &g in graphs {
            // The prefill slot gets the chunk module: what a caller passing a path there would do.
            let (module, archive) = files(if g == Graph::Prefill { Graph::Chunk } else { g });
            modules.insert(g.key().to_string(), dir.join(module).display().to_string());
            archives.insert(g.key().to_string(), dir.join(archive).display().to_string());
        }
        m.functions.with_past = real.functions.with_past.clone();
        m.functions.prefill_with_past = real.functions.prefill_with_past.clone();
        m.functions.prefill = prefill.then(|| real.functions.prefill_with_past.clone().unwrap());
        m.modules.insert("jni".into(), modules);
        m.parameters = Some(Parameters::PerGraph(archives));
        m
    };
    let options = IreeOptions {
        target: Some("jni".into()),
        ..IreeOptions::new("local-task")
    };
    let mut s =
        IreeKvBackend::open_manifest_learning_seq(std::path::Path::new(""), built(false), options.clone()).unwrap();
    assert!(s.manifest().is_v2());
    assert_eq!(s.spec().max_positions, real.spec.max_positions);
    // The caches' element type, from their declared type.
    assert_eq!(s.manifest().cache_type, real.cache_type);
    // The sliding layers' views, from their declared cache shape.
    let ring = |m: &kv_core::Manifest| m.v2().map(|v2| v2.sliding_cache_rows);
    assert!(ring(&real).is_some_and(|rows| rows > 0));
    assert_eq!(ring(s.manifest()), ring(&real));
    // The allowed-token mask, from the step's declared last argument (`allowedMask`).
    assert_eq!(s.manifest().allowed_mask, real.allowed_mask);
    let mut want = open(&dir);
    let p = prompt(30);
    assert_eq!(s.prefill(&p).unwrap(), want.prefill(&p).unwrap());
    assert_eq!(s.step(9).unwrap(), want.step(9).unwrap());

    let err = match IreeKvBackend::open_manifest_learning_seq(std::path::Path::new(""), built(true), options) {
        Ok(_) => panic!("v2 graphs opened with a prefill module"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("no prefill graph"), "{err}");
}

/// A ring of 16 rows on the sliding layers (window 12 and a slack of 4) and a prefill graph of
/// 16 rows: the same tokens and caches as v1 while the ring wraps many times, an utterance of up to 4 tokens after the prefix
/// snapshot written in place, a longer one forking (it would overwrite the prefix's window), and
/// the snapshot still right afterwards.
#[test]
fn ring_wraps_and_forks_only_past_its_slack() {
    let options = ExportOptions {
        targets: vec![Target::cpu()],
        layout: Layout::Shared,
        contract: kv_core::ContractVersion::V2,
        ring_slack: Some(4),
        ..ExportOptions::default()
    };
    let dir = cached_export_with(MODEL, &options).expect("export v2 (run scripts/setup.sh)");
    let (mut one, mut two) = (open(&v1()), open(&dir));
    // The prefill graph: a chunk graph of the ring's 16 rows, run while more than two chunk
    // calls are left (45 = 16 + 16 + 8 + 5); a session on chunk calls alone agrees.
    let layout = two.manifest().v2().unwrap();
    assert_eq!((layout.sliding_cache_rows, layout.prefill_chunk), (16, 16));
    let mut chunks_only = IreeKvBackend::open(
        &dir,
        IreeOptions {
            prefill: backend_iree::PrefillRoute::Chunks,
            ..IreeOptions::new("local-task")
        },
    )
    .unwrap();
    let prefix = prompt(45);
    assert_eq!(one.prefill(&prefix).unwrap(), two.prefill(&prefix).unwrap());
    assert_eq!(chunks_only.prefill(&prefix).unwrap(), two.prefill(&prefix).unwrap());
    same_caches(&one, &two);
    same_caches(&chunks_only, &two);
    let (p1, p2) = (one.snapshot().unwrap(), two.snapshot().unwrap());

    let short = [5, 17, 99];
    assert_eq!(utterance(&mut two, &p2, &short, 1), utterance(&mut one, &p1, &short, 1));
    assert!(two.holds_views_of(&p2), "4 rows after the prefix forked the ring");
    same_caches(&one, &two);

    let long = [5, 17, 99, 42, 7];
    assert_eq!(utterance(&mut two, &p2, &long, 30), utterance(&mut one, &p1, &long, 30));
    assert!(
        !two.holds_views_of(&p2),
        "a write over the prefix's window did not fork"
    );
    same_caches(&one, &two);

    two.restore(&p2).unwrap();
    one.restore(&p1).unwrap();
    same_caches(&one, &two);
    assert_eq!(
        utterance(&mut two, &p2, &short, 20),
        utterance(&mut one, &p1, &short, 20)
    );
}

/// The largest and the mean K/V difference of two sessions over every layer's common rows,
/// from layer `from_layer` on.
fn cache_diff<A: KvBackend, B: KvBackend>(a: &A, b: &B, layers: std::ops::Range<usize>) -> (f32, f64) {
    let (mut worst, mut sum, mut n) = (0.0f32, 0.0f64, 0usize);
    for l in layers {
        let (x, y) = (a.read_layer(l).unwrap(), b.read_layer(l).unwrap());
        let from = x.first_position.max(y.first_position);
        let (x, y) = (x.tail_from(from), y.tail_from(from));
        for (p, q) in [(&x.k, &y.k), (&x.v, &y.v)] {
            worst = worst.max(max_diff(p, q).0);
            sum += p
                .iter()
                .zip(q.iter())
                .map(|(u, v)| f64::from((u - v).abs()))
                .sum::<f64>();
            n += p.len();
        }
    }
    (worst, sum / n.max(1) as f64)
}

/// Every layer within `tol`, labelled.
/// An IREE session on `dir`, the reference opened on the export's own manifest (rounding as its
/// graphs do; the model is returned too) and the FP32 reference, all prefilled with `prefix`
/// (the rounding reference to the same token).
fn prefilled_with_references(
    dir: &std::path::Path,
    prefix: &[i32],
) -> (IreeKvBackend, std::sync::Arc<ReferenceModel>, ReferenceKv, ReferenceKv) {
    let rounding = ReferenceModel::open(dir).unwrap();
    let plain = ReferenceModel::open_with_rounding(dir, Some(Rounding::FP32)).unwrap();
    let (mut iree, mut reference) = (open(dir), ReferenceKv::new(rounding.clone(), WindowRule::Exact));
    let mut fp32 = ReferenceKv::new(plain, WindowRule::Exact);
    assert_eq!(iree.prefill(prefix).unwrap(), reference.prefill(prefix).unwrap());
    fp32.prefill(prefix).unwrap();
    (iree, rounding, reference, fp32)
}

/// The FP32 reference is measurably further from `iree` on average than the rounding one:
/// the rounding happens, and in both.
fn rounding_happens_in_both(iree: &IreeKvBackend, reference: &ReferenceKv, fp32: &ReferenceKv) {
    let layers = 0..iree.spec().n_layers;
    let (_, mean_rounding) = cache_diff(iree, reference, layers.clone());
    let (_, mean_fp32) = cache_diff(iree, fp32, layers);
    assert!(
        mean_fp32 > 3.0 * mean_rounding,
        "mean K/V difference: FP32 reference {mean_fp32:e}, rounding reference {mean_rounding:e}"
    );
}

fn caches_within<A: KvBackend, B: KvBackend>(what: &str, a: &A, b: &B, tol: Tolerance) {
    for l in 0..a.spec().n_layers {
        let (got, want) = (a.read_layer(l).unwrap(), b.read_layer(l).unwrap());
        assert_layers_close(&format!("{what}, layer {l}"), &got, &want, tol);
    }
}

/// Contract 2 with bf16 matmul inputs (`matmulInput`: what `--cpu host` exports use on CPUs with
/// AVX-512 BF16), compiled with the runtime's CPU flags (data tiling, ukernels), against the
/// reference opened on the export's own manifest, which rounds the same inputs. Layer 0's K/V
/// (no rounding upstream of them can land differently) agree at the cross-backend tolerance,
/// the rest at `Tolerance::BF16_MATMUL_INPUTS`, and the tokens are the same through a prefill, a
/// snapshot and utterances. The plain FP32 reference is measurably further away at layer 0 and
/// on average, so the rounding happens, and in both.
#[test]
fn bf16_matmul_inputs_match_a_reference_that_rounds_the_same() {
    let options = ExportOptions {
        targets: vec![Target::cpu()],
        layout: Layout::Shared,
        weights: WeightFormat::Bf16,
        matmul_input: MatmulInput::Bf16,
        ..runtime_options_for(&Target::cpu(), kv_core::ContractVersion::V2)
    };
    let dir = cached_export_with(MODEL, &options).expect("export v2 with bf16 matmul inputs");
    let (iree, rounding, reference, fp32) = prefilled_with_references(&dir, &prompt(21));
    assert_eq!(iree.manifest().matmul_input, MatmulInput::Bf16);
    assert_eq!(rounding.manifest().matmul_input, MatmulInput::Bf16);
    let (layer0_rounding, _) = cache_diff(&iree, &reference, 0..1);
    let (layer0_fp32, _) = cache_diff(&iree, &fp32, 0..1);
    assert_layers_close(
        "layer 0 against the rounding reference",
        &iree.read_layer(0).unwrap(),
        &reference.read_layer(0).unwrap(),
        Tolerance::CROSS_BACKEND,
    );
    assert!(
        layer0_fp32 > 10.0 * layer0_rounding.max(1e-6),
        "layer 0: the FP32 reference ({layer0_fp32:e}) is not further than the rounding one ({layer0_rounding:e})"
    );
    rounding_happens_in_both(&iree, &reference, &fp32);
    caches_within("after the prefill", &iree, &reference, Tolerance::BF16_MATMUL_INPUTS);

    // Teacher-forced from a fresh start (a flip can turn a near-tie either way; the real
    // models' streams are `diverge`'s to judge): every step's K/V within the tolerance, and a
    // differing token only at a near-tie of the reference.
    let (mut iree, mut reference) = (
        open(&dir),
        ReferenceKv::new(ReferenceModel::open(&dir).unwrap(), WindowRule::Exact),
    );
    let options = LockstepOptions {
        tolerance: Tolerance::BF16_MATMUL_INPUTS,
        ..LockstepOptions::new(16)
    };
    let report = lockstep(&mut reference, &mut iree, &prompt(21), &options).unwrap();
    // Every step: its K/V within the tolerance, its token the reference's or a near-tie of it.
    assert_eq!(report.failures(true), Vec::<String>::new(), "{report:?}");
}

/// Contract 2 with f16 caches (`cacheType`: what `--cpu host` exports keep on CPUs that convert
/// f16 in hardware) against the reference opened on the export's own manifest, which rounds each
/// K and V row the same way (`CacheType::round`). The caches hold f16 values (every element read
/// back is its own rounding), the tokens and K/V agree with the rounding reference at the
/// cross-backend tolerance through a prefill and 16 teacher-forced steps, the FP32 reference is
/// measurably further away, and a snapshot saved to a file and loaded into a fresh session
/// answers an utterance as the in-memory snapshot does.
#[test]
fn f16_caches_match_a_reference_that_rounds_the_same() {
    let dir = v2_f16();
    let (mut iree, rounding, reference, fp32) = prefilled_with_references(&dir, &prompt(21));
    assert_eq!(iree.manifest().cache_type, CacheType::F16);
    assert_eq!(rounding.manifest().cache_type, CacheType::F16);
    for l in 0..iree.spec().n_layers {
        let layer = iree.read_layer(l).unwrap();
        for (what, values) in [("K", &layer.k), ("V", &layer.v)] {
            let off = values.iter().find(|&&x| CacheType::F16.round(x) != x);
            assert_eq!(off, None, "layer {l} {what}: a value off the f16 grid");
        }
    }
    caches_within("after the prefill", &iree, &reference, Tolerance::CROSS_BACKEND);
    rounding_happens_in_both(&iree, &reference, &fp32);

    // A snapshot through a file into a fresh session: the same utterance.
    let snapshot = iree.snapshot().unwrap();
    let file = tempfile::tempdir().unwrap();
    let path = file.path().join("prefix.skvsnap");
    kv_core::snapshot_file::save(&iree, &snapshot, &path).unwrap();
    let mut fresh = open(&dir);
    let loaded = kv_core::snapshot_file::load(&fresh, &path).unwrap();
    let words = prompt(5);
    let want = utterance(&mut iree, &snapshot, &words, 6);
    assert_eq!(utterance(&mut fresh, &loaded, &words, 6), want);

    let (mut iree, mut reference) = (
        open(&dir),
        ReferenceKv::new(ReferenceModel::open(&dir).unwrap(), WindowRule::Exact),
    );
    let report = lockstep(&mut reference, &mut iree, &prompt(21), &LockstepOptions::new(16)).unwrap();
    assert_eq!(report.failures(true), Vec::<String>::new(), "{report:?}");
}

/// The prefill graph and its token-less variants read only the rows their calls see
/// (`V2Spec::prefill_spans`): a prefill through every variant (ring of 16 rows, calls of 16:
/// ending by 32, 64 and 128, then past them) answers and caches as v1 and as an export
/// without variants do; a manifest naming a variant its module lacks fails at open.
#[test]
fn prefill_spans_read_what_their_calls_see() {
    let export = |spans: Vec<usize>| {
        let options = ExportOptions {
            targets: vec![Target::cpu()],
            layout: Layout::Shared,
            contract: kv_core::ContractVersion::V2,
            ring_slack: Some(4),
            prefill_spans: Some(spans),
            ..ExportOptions::default()
        };
        cached_export_with(MODEL, &options).expect("export v2 (run scripts/setup.sh)")
    };
    let (spanned, plain) = (export(vec![32, 64, 128]), export(vec![]));
    let (mut one, mut two, mut three) = (open(&v1()), open(&spanned), open(&plain));
    let layout = |s: &IreeKvBackend| s.manifest().v2().unwrap().clone();
    assert_eq!(layout(&two).prefill_spans, [32, 64, 128]);
    assert_eq!((layout(&two).prefill_span, layout(&three).prefill_span), (256, 256));
    // 150 = 9 calls of 16 (ending at 16, 32 | 48, 64 | 80 … 128 | 144) and one chunk call.
    let prefix = prompt(150);
    let token = one.prefill(&prefix).unwrap();
    assert_eq!(two.prefill(&prefix).unwrap(), token);
    assert_eq!(three.prefill(&prefix).unwrap(), token);
    same_caches(&one, &two);
    same_caches(&three, &two);
    let (p1, p2) = (one.snapshot().unwrap(), two.snapshot().unwrap());
    let words = [5, 17, 99];
    assert_eq!(utterance(&mut two, &p2, &words, 6), utterance(&mut one, &p1, &words, 6));

    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&plain).unwrap() {
        let path = entry.unwrap().path();
        // Without the digests, which the edited manifest would no longer match.
        if path.ends_with(kv_core::digests::DIGESTS_FILE) {
            continue;
        }
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let mut manifest = kv_core::Manifest::load(dir.path()).unwrap();
    manifest.contract.v2_mut().unwrap().prefill_spans = vec![64];
    manifest.save(dir.path()).unwrap();
    match IreeKvBackend::open(dir.path(), IreeOptions::new("local-task")) {
        Err(e) => assert!(e.to_string().contains("prefillSpans"), "{e}"),
        Ok(_) => panic!("a manifest naming a variant its module lacks opened"),
    }
}

/// A v2 export made before the allowed-token mask (graphs without the `allowed` argument, no
/// `allowedMask` in the manifest) still opens and decodes as the new export does without a mask;
/// a mask there is `GraphUnavailable` naming the fix, lifting one is no error. The new export
/// restricts its tokens, and keeps its mask when a mask of another vocabulary is refused.
#[test]
#[ignore = "run by scripts/test-long.sh masks: a module compiled for it (40 s on 2 cores)"]
fn v2_exports_before_the_mask_open_and_refuse_one() {
    use kv_core::allowed::AllowedTokens;
    let new = v2();
    let mut m = kv_core::Manifest::load(&new).unwrap();
    assert!(m.allowed_mask, "v2 exports take the mask");
    let old = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&new).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, old.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    // The graphs as the emitter wrote them before the mask: the same manifest without the key.
    m.set_allowed_mask(false);
    let text = export::emit_module(&m, &Graph::KV, &export::EmitOptions::default()).unwrap();
    assert!(!text.contains("shift_right_logical"), "graphs without the mask");
    let mlir = old.path().join("before-the-mask.mlir");
    std::fs::write(&mlir, text).unwrap();
    let vmfb = &m.modules["llvm-cpu"][Graph::Step.key()];
    for graph in Graph::KV {
        assert_eq!(vmfb, &m.modules["llvm-cpu"][graph.key()], "one shared module");
    }
    let flags: Vec<String> = export::weight_compile_flags(WeightFormat::PackedI32)
        .iter()
        .map(|f| f.to_string())
        .collect();
    export::compile_with(&mlir, &Target::cpu(), &old.path().join(vmfb), &flags).unwrap();
    m.save(old.path()).unwrap();
    std::fs::remove_file(old.path().join("digests.json")).ok();

    let mut before = open(old.path());
    let mut current = open(&new);
    let vocab = current.spec().vocab_size;
    let p = prompt(20);
    assert_eq!(before.prefill(&p).unwrap(), current.prefill(&p).unwrap());
    let mask = AllowedTokens::from_ids(vocab, &[7, 91, 150]).unwrap();
    match before.set_allowed(Some(&mask)) {
        Err(Error::GraphUnavailable {
            op: "set_allowed",
            reason,
            ..
        }) => {
            assert!(reason.contains("re-export"), "{reason}")
        }
        other => panic!("a mask on a v2 export before the mask: {other:?}"),
    }
    before.set_allowed(None).unwrap();
    before.set_allowed(Some(&AllowedTokens::all(vocab))).unwrap();
    assert_eq!(
        before.step(9).unwrap(),
        current.step(9).unwrap(),
        "usable after the refusal"
    );

    // The new export: every token of greedy steps under the mask is allowed, and a mask of
    // another vocabulary is refused without lifting it.
    current.set_allowed(Some(&mask)).unwrap();
    match current.set_allowed(Some(&AllowedTokens::all(vocab - 1))) {
        Err(Error::BadTokenCount { n, min, .. }) => assert_eq!((n, min), (vocab - 1, vocab)),
        other => panic!("a mask of another vocabulary: {other:?}"),
    }
    let mut tokens = Vec::new();
    current
        .step_greedy(9, 6, &mut |t| {
            tokens.push(t);
            true
        })
        .unwrap();
    assert!(
        tokens.iter().all(|&t| mask.allows(t)),
        "{tokens:?} under {:?}",
        mask.ids().collect::<Vec<_>>()
    );
}

/// A prefill takes up the set the last prefill released where no snapshot holds it, zeroing
/// again only the rows its calls wrote: it must be a fresh set all the same. Two sets alternate
/// (a prefill keeps the session's set until it succeeds), so each of the two is taken up once,
/// dirtied by a prompt that wrapped the ring and steps past it: the same tokens and every byte
/// of every cache, the rows past the position too, as a fresh session's. A snapshot's set is
/// never taken up: its rows and its continuation are unchanged by later prefills.
#[test]
fn a_prefill_that_reuses_a_set_matches_a_fresh_session() {
    let dir = v2();
    let run = |s: &mut IreeKvBackend, words: &[i32], steps: usize| {
        let mut out = vec![s.prefill(words).unwrap()];
        for _ in 0..steps {
            out.push(s.step(*out.last().unwrap()).unwrap());
        }
        out
    };
    let bytes = |s: &IreeKvBackend| -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..s.spec().n_layers)
            .map(|l| s.v2_cache_bytes(l).unwrap().expect("a set"))
            .collect()
    };
    let short = prompt(5);
    let mut fresh = open(&dir);
    let want = run(&mut fresh, &short, 3);
    let want_bytes = bytes(&fresh);

    let mut s = open(&dir);
    let empty = s.snapshot().unwrap();
    run(&mut s, &prompt(30), 8);
    run(&mut s, &prompt(21), 4);
    for round in 0..3 {
        // Round 0 takes up the first set (30 + 8 positions), round 1 the second (21 + 4), round
        // 2 the one a restore released (round 1's, the second's).
        if round == 2 {
            run(&mut s, &prompt(33), 2);
            s.restore(&empty).unwrap();
        }
        assert_eq!(run(&mut s, &short, 3), want, "round {round}: tokens");
        assert!(
            bytes(&s) == want_bytes,
            "round {round}: a reused set differs from a fresh one"
        );
        for l in 0..s.spec().n_layers {
            assert_eq!(s.read_layer(l).unwrap(), fresh.read_layer(l).unwrap());
        }
    }

    // A snapshot pins its set: later prefills allocate rather than take it up.
    let mut t = open(&dir);
    let first = t.prefill(&prompt(19)).unwrap();
    let snapshot = t.snapshot().unwrap();
    let rows: Vec<_> = (0..t.spec().n_layers).map(|l| t.read_layer(l).unwrap()).collect();
    let mut after = vec![t.step(first).unwrap()];
    after.push(t.step(after[0]).unwrap());
    run(&mut t, &prompt(30), 6);
    run(&mut t, &prompt(27), 2);
    run(&mut t, &short, 0);
    t.restore(&snapshot).unwrap();
    for (l, want) in rows.iter().enumerate() {
        assert_eq!(&t.read_layer(l).unwrap(), want, "layer {l} of the snapshot");
    }
    let mut again = vec![t.step(first).unwrap()];
    again.push(t.step(again[0]).unwrap());
    assert_eq!(again, after);
    // The restore released the short prompt's set, not the snapshot's; the session now holds
    // the snapshot's (forked by the steps or not), which a prefill must not take up either.
    t.restore(&snapshot).unwrap();
    run(&mut t, &prompt(25), 1);
    run(&mut t, &short, 0);
    t.restore(&snapshot).unwrap();
    for (l, want) in rows.iter().enumerate() {
        assert_eq!(&t.read_layer(l).unwrap(), want, "layer {l} of the snapshot, again");
    }
    let mut third = vec![t.step(first).unwrap()];
    third.push(t.step(third[0]).unwrap());
    assert_eq!(third, after);
}
