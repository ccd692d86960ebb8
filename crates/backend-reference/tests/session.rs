//! The KV session against itself: whole prefill versus prefix + chunks + steps, snapshots,
//! errors that leave the session usable, and the exact rows each layer holds.

mod common;

use std::sync::Arc;

use backend_reference::{full_forward_logits, ReferenceKv, ReferenceModel};
use common::*;
use kv_core::irpa::IrpaArchive;
use kv_core::tolerance::{assert_close, Tolerance};
use kv_core::{Error, KvBackend, LayerKind, LayerKv, Manifest, WindowRule};

/// How a sequence is fed after its prefill: chunk sizes, then single steps.
fn feed_in_pieces(s: &mut ReferenceKv, tokens: &[i32], prefill: usize, chunks: &[usize]) -> i32 {
    let mut next = s.prefill(&tokens[..prefill]).unwrap();
    let mut at = prefill;
    for &c in chunks {
        next = s.chunk(&tokens[at..at + c]).unwrap();
        at += c;
    }
    for &t in &tokens[at..] {
        next = s.step(t).unwrap();
    }
    next
}

#[test]
fn whole_prefill_equals_prefix_chunks_and_steps() {
    for name in ALL_FIXTURES {
        let model = model(name);
        let spec = model.spec().clone();
        let seq = tokens(45, spec.vocab_size, 1);
        let mut pieces = ReferenceKv::new(model.clone(), WindowRule::Exact);
        let mut whole = ReferenceKv::new(model.clone(), WindowRule::Exact);

        // Compare after every call, so a drift is caught where it starts.
        let check = |pieces: &ReferenceKv, whole: &mut ReferenceKv, got: i32| {
            let pos = pieces.position();
            let want = whole.prefill(&seq[..pos]).unwrap();
            assert_eq!(got, want, "{name}: token after {pos} positions");
            assert_close(
                &format!("{name} logits at {pos}"),
                pieces.last_logits().unwrap(),
                whole.last_logits().unwrap(),
                Tolerance::SAME_BACKEND,
            );
            assert_sessions_close(&format!("{name} at {pos}"), pieces, whole, Tolerance::SAME_BACKEND);
        };
        let got = pieces.prefill(&seq[..5]).unwrap();
        check(&pieces, &mut whole, got);
        let mut at = 5;
        for c in [spec.chunk, 3, 1, spec.chunk] {
            let got = pieces.chunk(&seq[at..at + c]).unwrap();
            at += c;
            check(&pieces, &mut whole, got);
        }
        for &t in &seq[at..] {
            let got = pieces.step(t).unwrap();
            check(&pieces, &mut whole, got);
        }
        assert_eq!(pieces.position(), seq.len());
    }
}

/// The rows each layer holds after each call, by hand (window 12, chunk 8).
#[test]
fn layers_hold_the_planned_rows() {
    let model = model("tiny-gemma3:7");
    let spec = model.spec().clone();
    assert_eq!((spec.sliding_window, spec.chunk), (12, 8));
    let sliding = spec.first_layer_of(LayerKind::Sliding).unwrap();
    let global = spec.first_layer_of(LayerKind::Global).unwrap();
    let rows = |s: &ReferenceKv, layer: usize| {
        let kv = s.read_layer(layer).unwrap();
        (kv.first_position, kv.rows)
    };
    let seq = tokens(40, spec.vocab_size, 2);

    for (rule, after_step, after_chunk, after_two_steps) in [
        // Exact: a step hands 11 past rows (12 keys); a chunk hands 12.
        (WindowRule::Exact, (9, 12), (9, 15), (14, 12)),
        // Seed: a step hands 12 past rows (13 keys).
        (WindowRule::SeedStep, (8, 13), (9, 15), (13, 13)),
    ] {
        let mut s = ReferenceKv::new(model.clone(), rule);
        s.prefill(&seq[..20]).unwrap();
        assert_eq!(rows(&s, sliding), (0, 20), "{rule:?} prefill");
        s.step(seq[20]).unwrap();
        assert_eq!(rows(&s, sliding), after_step, "{rule:?} step at 20");
        s.chunk(&seq[21..24]).unwrap();
        assert_eq!(rows(&s, sliding), after_chunk, "{rule:?} chunk of 3 at 21");
        s.step(seq[24]).unwrap();
        s.step(seq[25]).unwrap();
        assert_eq!(rows(&s, sliding), after_two_steps, "{rule:?} steps at 24, 25");
        assert_eq!(rows(&s, global), (0, 26), "{rule:?} global layer");
    }
}

/// The seed's step rule shows a sliding layer one key too many: same tokens, other logits.
#[test]
fn seed_step_rule_differs_only_past_the_window() {
    let model = model("tiny-gemma3:7");
    let seq = tokens(30, model.spec().vocab_size, 3);
    let mut exact = ReferenceKv::new(model.clone(), WindowRule::Exact);
    let mut seed = ReferenceKv::new(model.clone(), WindowRule::SeedStep);
    // Up to the window both rules hand every row.
    feed_in_pieces(&mut exact, &seq[..11], 4, &[]);
    feed_in_pieces(&mut seed, &seq[..11], 4, &[]);
    assert_same_state("before the window", &exact, &seed);
    feed_in_pieces(&mut exact, &seq, 4, &[]);
    feed_in_pieces(&mut seed, &seq, 4, &[]);
    let diff = kv_core::tolerance::max_diff(exact.last_logits().unwrap(), seed.last_logits().unwrap());
    assert!(
        diff.0 > 1e-4,
        "the seed rule should change the logits past the window: {diff:?}"
    );
}

#[test]
fn snapshot_restore_and_branching_reproduce() {
    for name in ["tiny-gemma3:7", "tiny-gemma3-gqa:7", "tiny-qwen3:7"] {
        let mut s = session(name);
        let vocab = s.spec().vocab_size;
        let prefix = tokens(20, vocab, 4);
        s.prefill(&prefix).unwrap();
        let snap = s.snapshot().unwrap();
        let before: Vec<LayerKv> = (0..s.spec().n_layers).map(|l| s.read_layer(l).unwrap()).collect();

        let branch = |s: &mut ReferenceKv, salt: u64| {
            s.restore(&snap).unwrap();
            assert_eq!(s.position(), 20);
            let mut out = vec![s.chunk(&tokens(5, vocab, salt)).unwrap()];
            for _ in 0..15 {
                out.push(s.step(*out.last().unwrap()).unwrap());
            }
            (out, s.last_logits().unwrap().to_vec())
        };
        let a = branch(&mut s, 5);
        let b = branch(&mut s, 6);
        let a_again = branch(&mut s, 5);
        assert_eq!(a, a_again, "{name}: branch A after branch B");
        assert_ne!(a.0, b.0, "{name}: different utterances should give different streams");

        // The snapshot was never disturbed by the calls after it.
        s.restore(&snap).unwrap();
        for (layer, kv) in before.iter().enumerate() {
            assert_eq!(&s.read_layer(layer).unwrap(), kv, "{name}: layer {layer} after restore");
        }
        // A snapshot of a snapshot-restored session still branches the same.
        assert_eq!(branch(&mut s, 5), a, "{name}: restore after restore");
    }
}

#[test]
fn foreign_snapshot_is_refused_and_the_session_still_works() {
    let model = model("tiny-gemma3:7");
    let vocab = model.spec().vocab_size;
    let mut mine = ReferenceKv::new(model.clone(), WindowRule::Exact);
    let mut other = ReferenceKv::new(model.clone(), WindowRule::Exact);
    let mut twin = ReferenceKv::new(model.clone(), WindowRule::Exact);
    for s in [&mut mine, &mut twin] {
        s.prefill(&tokens(15, vocab, 7)).unwrap();
    }
    other.prefill(&tokens(9, vocab, 8)).unwrap();
    let foreign = other.snapshot().unwrap();

    let err = mine.restore(&foreign).unwrap_err();
    assert!(matches!(err, Error::ForeignSnapshot { .. }), "got {err}");
    assert!(err.to_string().contains("belongs to session"), "message: {err}");
    assert_same_state("after a refused restore", &mine, &twin);
    assert_eq!(mine.step(3).unwrap(), twin.step(3).unwrap());
    assert_same_state("a step after the refused restore", &mine, &twin);
}

/// The reference runs no device: a device profile is `Unsupported`, and the session goes on.
#[test]
fn device_profile_is_unsupported_and_changes_nothing() {
    let model = model("tiny-gemma3:7");
    let vocab = model.spec().vocab_size;
    let (mut mine, mut twin) = (
        ReferenceKv::new(model.clone(), WindowRule::Exact),
        ReferenceKv::new(model.clone(), WindowRule::Exact),
    );
    for s in [&mut mine, &mut twin] {
        s.prefill(&tokens(9, vocab, 3)).unwrap();
    }
    let path = std::env::temp_dir().join(format!("skv-reference-{}.ireeprof", std::process::id()));
    let err = mine.begin_device_profile(&path).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Unsupported {
                op: "begin_device_profile",
                ..
            }
        ),
        "got {err}"
    );
    assert!(!path.exists(), "no file for a refused profile");
    mine.end_device_profile().unwrap();
    assert_same_state("after a refused profile", &mine, &twin);
    assert_eq!(mine.step(3).unwrap(), twin.step(3).unwrap());
}

/// Position, every layer's rows and the last logits: what a failed call must not change.
type State = (usize, Vec<LayerKv>, Option<Vec<f32>>);

fn state(s: &ReferenceKv) -> State {
    let layers = (0..s.spec().n_layers).map(|l| s.read_layer(l).unwrap()).collect();
    (s.position(), layers, s.last_logits().map(<[f32]>::to_vec))
}

/// The gemma fixture with a short context, to reach the limit in a few calls.
fn short_context_model() -> Arc<ReferenceModel> {
    let dir = fixture_dir("tiny-gemma3:7");
    let mut manifest = Manifest::load(&dir).unwrap();
    manifest.spec.seq = 16;
    manifest.spec.max_positions = 26;
    let archive = IrpaArchive::open(dir.join(fixtures::WEIGHTS_FILE)).unwrap();
    ReferenceModel::from_parts(manifest, &archive).unwrap()
}

#[test]
fn bad_calls_are_clear_errors_and_change_nothing() {
    let model = short_context_model();
    let spec = model.spec().clone();
    let vocab = spec.vocab_size as i32;
    let mut s = ReferenceKv::new(model.clone(), WindowRule::Exact);
    let mut twin = ReferenceKv::new(model.clone(), WindowRule::Exact);

    // Before any prefill.
    let err = s.step(1).unwrap_err();
    assert!(matches!(err, Error::NotPrefilled { op: "step" }), "got {err}");
    let err = s.chunk(&[1, 2]).unwrap_err();
    assert!(matches!(err, Error::NotPrefilled { op: "chunk" }), "got {err}");
    assert!(err.to_string().contains("prefill first"), "message: {err}");
    assert_eq!(s.position(), 0);

    let ok = tokens(16, spec.vocab_size, 9);
    let expect_err = |s: &mut ReferenceKv, call: &dyn Fn(&mut ReferenceKv) -> kv_core::Result<i32>| {
        let before = state(s);
        let err = call(s).expect_err("call should fail");
        assert_eq!(state(s), before, "state changed by a failed call ({err})");
        err
    };

    for s in [&mut s, &mut twin] {
        s.prefill(&ok[..10]).unwrap();
    }
    let prefill_bad = |t: Vec<i32>| move |s: &mut ReferenceKv| s.prefill(&t);
    let err = expect_err(&mut s, &prefill_bad(vec![1, vocab, 2]));
    assert!(
        matches!(
            err,
            Error::TokenOutOfRange {
                op: "prefill",
                index: 1,
                ..
            }
        ),
        "got {err}"
    );
    let err = expect_err(&mut s, &prefill_bad(vec![-1]));
    assert!(
        matches!(
            err,
            Error::TokenOutOfRange {
                op: "prefill",
                index: 0,
                id: -1,
                ..
            }
        ),
        "got {err}"
    );
    let err = expect_err(&mut s, &prefill_bad(vec![]));
    assert!(
        matches!(
            err,
            Error::BadTokenCount {
                op: "prefill",
                n: 0,
                ..
            }
        ),
        "got {err}"
    );
    let err = expect_err(&mut s, &prefill_bad(vec![1; spec.seq + 1]));
    assert!(
        matches!(
            err,
            Error::BadTokenCount {
                op: "prefill",
                n: 17,
                max: 16,
                ..
            }
        ),
        "got {err}"
    );

    let err = expect_err(&mut s, &|s| s.chunk(&[]));
    assert!(
        matches!(
            err,
            Error::BadTokenCount {
                op: "chunk",
                n: 0,
                min: 1,
                max: 8
            }
        ),
        "got {err}"
    );
    let err = expect_err(&mut s, &|s| s.chunk(&[1; 9]));
    assert!(
        matches!(err, Error::BadTokenCount { op: "chunk", n: 9, .. }),
        "got {err}"
    );
    let err = expect_err(&mut s, &|s| s.chunk(&[1, 2, -5]));
    assert!(
        matches!(
            err,
            Error::TokenOutOfRange {
                op: "chunk",
                index: 2,
                ..
            }
        ),
        "got {err}"
    );
    let err = expect_err(&mut s, &|s| s.step(vocab));
    assert!(matches!(err, Error::TokenOutOfRange { op: "step", .. }), "got {err}");
    assert!(err.to_string().contains("outside the vocabulary"), "message: {err}");
    let err = expect_err(&mut s, &|s| s.step(i32::MIN));
    assert!(matches!(err, Error::TokenOutOfRange { op: "step", .. }), "got {err}");
    let err = expect_err(&mut s, &|s| s.read_layer(spec.n_layers).map(|_| 0));
    assert!(matches!(err, Error::LayerOutOfRange { .. }), "got {err}");

    // Fill to the limit (26): 10 + 8 + 7 = 25, then one step.
    for s in [&mut s, &mut twin] {
        s.chunk(&ok[..8]).unwrap();
        s.chunk(&ok[..7]).unwrap();
    }
    let err = expect_err(&mut s, &|s| s.chunk(&[1, 2]));
    assert!(
        matches!(
            err,
            Error::ContextOverflow {
                op: "chunk",
                position: 25,
                n: 2,
                max: 26
            }
        ),
        "got {err}"
    );
    assert_same_state("after the errors", &s, &twin);
    assert_eq!(s.step(4).unwrap(), twin.step(4).unwrap());
    let err = expect_err(&mut s, &|s| s.step(4));
    assert!(
        matches!(
            err,
            Error::ContextOverflow {
                op: "step",
                position: 26,
                ..
            }
        ),
        "got {err}"
    );
    assert!(err.to_string().contains("maxPositions 26"), "message: {err}");

    // A prefill starts over from any state.
    assert_eq!(s.prefill(&ok).unwrap(), twin.prefill(&ok).unwrap());
    assert_same_state("after a new prefill", &s, &twin);
}

/// The cached path against the cache-free forward, teacher-forced, far past the window.
#[test]
fn cached_path_equals_full_forward_past_the_window() {
    for name in ALL_FIXTURES {
        let model = model(name);
        let spec = model.spec().clone();
        let seq = tokens(96, spec.vocab_size, 10);
        let full = full_forward_logits(&model, &seq).unwrap();
        let mut s = ReferenceKv::new(model.clone(), WindowRule::Exact);
        let check = |s: &ReferenceKv, got: i32| {
            let row = full.row(s.position() - 1).to_vec();
            let want = backend_reference::argmax_lowest(&row) as i32;
            assert_eq!(got, want, "{name}: token after {} positions", s.position());
            let what = format!("{name}: logits after {} positions", s.position());
            assert_close(&what, s.last_logits().unwrap(), &row, Tolerance::SAME_BACKEND);
        };
        let mut at = 7;
        let got = s.prefill(&seq[..at]).unwrap();
        check(&s, got);
        // Alternate chunks of varying size with runs of steps.
        let mut size = 1;
        while at < seq.len() {
            let c = size.min(spec.chunk).min(seq.len() - at);
            let got = s.chunk(&seq[at..at + c]).unwrap();
            at += c;
            check(&s, got);
            for _ in 0..3.min(seq.len() - at) {
                let got = s.step(seq[at]).unwrap();
                at += 1;
                check(&s, got);
            }
            size = size % spec.chunk + 3;
        }
    }
}

/// Greedy decoding through the cache equals the argmax of the full forward of its own stream.
#[test]
fn greedy_stream_is_self_consistent() {
    for name in ["tiny-gemma3:7", "tiny-llama:7"] {
        let model = model(name);
        let mut s = ReferenceKv::new(model.clone(), WindowRule::Exact);
        let mut stream = tokens(6, model.spec().vocab_size, 11);
        let mut next = s.prefill(&stream).unwrap();
        for _ in 0..50 {
            stream.push(next);
            next = s.step(next).unwrap();
        }
        stream.push(next);
        let full = full_forward_logits(&model, &stream[..stream.len() - 1]).unwrap();
        for p in 5..stream.len() - 1 {
            let want = backend_reference::argmax_lowest(&full.row(p).to_vec()) as i32;
            assert_eq!(stream[p + 1], want, "{name}: greedy token after position {p}");
        }
    }
}

#[test]
fn top_k_is_the_best_logits_led_by_the_returned_token_and_follows_restore() {
    let model = model("tiny-gemma3:7");
    let vocab = model.spec().vocab_size;
    let mut s = ReferenceKv::new(model, WindowRule::Exact);
    assert_eq!(s.last_top_k(8).unwrap(), None, "a top-k before any call");
    assert_eq!(s.top_k_capacity(), Some(vocab));
    let token = s.prefill(&[1, 2, 3]).unwrap();
    let top = s.last_top_k(8).unwrap().unwrap();
    assert_eq!(top.len(), 8);
    assert_eq!(top.ids()[0], token, "the argmax leads the top-k");
    let logits = s.last_logits().unwrap().to_vec();
    for (&id, &logit) in top.ids().iter().zip(top.logits()) {
        assert_eq!(logits[id as usize], logit);
    }
    let eighth = top.logits()[7];
    assert_eq!(logits.iter().filter(|&&l| l > eighth).count(), 7, "not the best 8");
    assert!(s.last_top_k(vocab + 1).unwrap().is_none());

    let snapshot = s.snapshot().unwrap();
    s.step(token).unwrap();
    assert_ne!(s.last_top_k(8).unwrap().unwrap(), top);
    s.restore(&snapshot).unwrap();
    assert_eq!(
        s.last_top_k(8).unwrap().unwrap(),
        top,
        "restore brings back the snapshot's top-k"
    );
}
