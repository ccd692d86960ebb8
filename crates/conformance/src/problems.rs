//! The problems, each a function of a backend factory. Each keeps its oracle next to it: a fresh
//! run on the same path, the independent [`crate::naive`] recompute, or the FP32 reference.

use kv_core::sampling::{SamplingConfig, DEFAULT_CANDIDATES};
use kv_core::tolerance::{assert_layers_close, Tolerance};
use kv_core::{DecodeOptions, Error, KvBackend, KvDecoder, LayerKv, RedecodeBackend, RedecodeDecoder, WindowRule};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};

use crate::divergence;
use crate::factory::{reference_model, BackendFactory, ReferenceFactory};
use crate::naive;

pub use crate::masked::masked_calls_match_the_reference;

/// Models every backend runs: both families, GQA, and three windows (12, 5, 3).
pub const MODELS: &[&str] = &[
    "tiny-gemma3:1",
    "tiny-gemma3:2:w5",
    "tiny-gemma3-gqa:3:w3",
    "tiny-llama:4",
];
/// The families beyond the default Gemma 3 layout. GQA Gemma and Llama are [`MODELS`]' own
/// fixtures: a suite exports each model once (10-20 s of `iree-compile` on 2 cores), and other
/// seeds of the same shapes (`tiny-gemma3-gqa:5`, `tiny-llama:6`, used here until session 27)
/// cost an export each in every suite and checked nothing more.
pub const FAMILIES: &[&str] = &["tiny-gemma3-gqa:3:w3", "tiny-llama:4", "tiny-qwen2:7", "tiny-qwen3:8"];

/// A logit gap below this is a near-tie that FP32 summation order may flip.
const NEAR_TIE: f32 = 1e-3;

/// The near-tie margin against the FP32 naive recompute for a backend that rounds its matmul
/// inputs to bf16 (`matmulInput: bf16`): its logits move at the rounding's scale, far beyond FP32
/// summation order. Measured on `iree_local_task_v2_host` (AVX-512 BF16), the naive gaps of the
/// tokens it chose where they differ: up to 4.6e-3 in 4 cases, 5.6e-3 over 2 seeds × 40 cases
/// of `cached_path_matches_naive_recompute`; none over the families.
const BF16_NEAR_TIE: f32 = 2e-2;

/// [`NEAR_TIE`], or [`BF16_NEAR_TIE`] where `factory` rounds its matmul inputs.
fn near_tie<F: BackendFactory>(factory: &F) -> f32 {
    if factory.rounding().matmul_input == kv_core::manifest::MatmulInput::Bf16 {
        BF16_NEAR_TIE
    } else {
        NEAR_TIE
    }
}

/// The run's seed: `SKAINET_CONFORMANCE_SEED` (or the older `SKAINET_PROPTEST_SEED`), else a
/// fresh one per process, so that each CI run draws other cases. Every random problem prints it
/// with the command that replays it ([`replay_line`]).
pub fn run_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        for var in ["SKAINET_CONFORMANCE_SEED", "SKAINET_PROPTEST_SEED"] {
            if let Ok(s) = std::env::var(var) {
                return s.parse().unwrap_or_else(|_| panic!("{var}={s}: not a u64"));
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        // Parallel suites start in the same nanosecond often enough: the process id parts them.
        splitmix(now ^ (u64::from(std::process::id()) << 32))
    })
}

/// The seed `problem` draws from: the run's mixed with the problem's name, so that problems draw
/// independent cases and one printed number replays any of them.
pub fn problem_seed(problem: &str) -> u64 {
    let fnv = problem.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    splitmix(run_seed() ^ fnv)
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The one-line command that runs the current test again with this run's seed: the suite is the
/// test binary's name, the test the thread's (libtest names each test's thread after it).
pub fn replay_line() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe
        .as_deref()
        .and_then(|p| p.file_stem())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let suite = stem.rsplit_once('-').map_or(stem.as_str(), |(name, _hash)| name);
    let test = std::thread::current().name().unwrap_or("").to_owned();
    let target = if cfg!(target_arch = "aarch64") {
        " --target aarch64-unknown-linux-gnu (with scripts/test-arm.sh's runner)"
    } else {
        ""
    };
    format!(
        "SKAINET_CONFORMANCE_SEED={} cargo test -p conformance{target} --test {suite} -- --exact {test} --include-ignored",
        run_seed()
    )
}

/// Runs `cases` cases of `strategy(model)` spread over `models`: an even share each, the cases
/// left over (all of them, where there are fewer cases than models) on the models that follow a
/// first one chosen by the seed. With at least one case per model every model runs; with fewer,
/// which ones run rotates from run to run. A random pick per case left some model out of some
/// problem on the suites with few cases, run after run.
fn run_cases<S: Strategy>(
    name: &str,
    cases: u32,
    models: &'static [&'static str],
    strategy: impl Fn(&'static str) -> S,
    test: impl Fn(S::Value),
) where
    S::Value: std::fmt::Debug,
{
    let seed = problem_seed(name);
    let n = models.len() as u32;
    let first = (seed % u64::from(n)) as u32;
    let share = |i: u32| cases / n + u32::from((i + n - first) % n < cases % n);
    let run: Vec<&str> = (0..n).filter(|&i| share(i) > 0).map(|i| models[i as usize]).collect();
    eprintln!(
        "{name}: seed {}, {cases} cases on {run:?}; replay: {}",
        run_seed(),
        replay_line()
    );
    for (i, model) in models.iter().enumerate() {
        let share = share(i as u32);
        if share == 0 {
            continue;
        }
        let mut runner = TestRunner::new(Config {
            cases: share,
            rng_seed: RngSeed::Fixed(splitmix(seed ^ i as u64)),
            failure_persistence: None,
            max_shrink_iters: 64,
            ..Config::default()
        });
        if let Err(e) = runner.run(&strategy(model), |value| {
            test(value);
            Ok(())
        }) {
            panic!("{name} on {model}: {e}\nreplay: {}", replay_line());
        }
    }
}

/// Skips nothing: a known divergence is still run, and must still fail, or its entry is stale.
fn check_known<F: BackendFactory>(factory: &F, problem: &str, body: impl FnOnce()) {
    let known = divergence::known(&factory.name(), problem);
    // The body's state is dropped on a panic, never observed again.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    match (outcome, known) {
        (Ok(()), None) => {}
        (Err(e), None) => std::panic::resume_unwind(e),
        (Err(_), Some(d)) => eprintln!("{problem} on {}: known divergence: {}", factory.name(), d.reason),
        (Ok(()), Some(d)) => panic!(
            "{problem} on {} passed but is listed as a known divergence ({}): remove the entry",
            factory.name(),
            d.reason
        ),
    }
}

fn spec_of(model: &str) -> kv_core::KvSpec {
    fixtures::Fixture::parse(model).expect("fixture name").manifest().spec
}

fn tokens(vocab: usize, len: usize) -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec(0..vocab as i32, len)
}

/// One call after the prefix: a chunk of tokens or a step.
#[derive(Clone, Debug)]
enum Piece {
    Chunk(Vec<i32>),
    Step(i32),
}

fn apply<B: KvBackend>(b: &mut B, piece: &Piece) -> i32 {
    match piece {
        Piece::Chunk(t) => b.chunk(t).unwrap_or_else(|e| panic!("chunk {t:?}: {e}")),
        Piece::Step(t) => b.step(*t).unwrap_or_else(|e| panic!("step {t}: {e}")),
    }
}

/// Splits `rest` into chunk calls (sizes from `sizes`, 0 meaning one step).
fn pieces(rest: &[i32], sizes: &[usize], chunk: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut i = 0;
    let mut s = sizes.iter().cycle();
    while i < rest.len() {
        let size = *s.next().unwrap_or(&1) % (chunk + 1);
        if size == 0 {
            out.push(Piece::Step(rest[i]));
            i += 1;
        } else {
            let end = (i + size).min(rest.len());
            out.push(Piece::Chunk(rest[i..end].to_vec()));
            i = end;
        }
    }
    out
}

fn layers<B: KvBackend>(b: &B) -> Vec<LayerKv> {
    (0..b.spec().n_layers)
        .map(|l| b.read_layer(l).expect("read_layer"))
        .collect()
}

/// Asserts `got == want`, or that the naive logits at `position` make them a near-tie.
#[track_caller]
fn assert_token(what: &str, model: &str, context: &[i32], got: i32, want: i32) {
    assert_token_within(what, model, context, got, want, NEAR_TIE);
}

/// [`assert_token`] with the near-tie margin `margin` ([`near_tie`]).
#[track_caller]
fn assert_token_within(what: &str, model: &str, context: &[i32], got: i32, want: i32, margin: f32) {
    if got == want {
        return;
    }
    let m = reference_model(model).expect("model");
    let spec = m.spec().clone();
    let logits = naive::logits(&m, context, &|_| spec.sliding_window);
    let last = logits.last().expect("non-empty context");
    let (gap_got, gap_want) = (naive::gap_to(last, got), naive::gap_to(last, want));
    assert!(
        (gap_got - gap_want).abs() < margin,
        "{what}: token {got}, expected {want} (naive logit gaps {gap_got:e} / {gap_want:e}: not a near-tie)"
    );
}

/// A whole prefill equals a prefix + chunk calls + steps: same token, the same K/V within the
/// backend's bound for two paths through different graphs (`BackendFactory::path_tolerance`:
/// bit for bit on the reference).
pub fn prefill_equals_prefix_chunks_and_steps<F: BackendFactory>(factory: &F) {
    let strategy = |model: &'static str| {
        Just(model).prop_flat_map(|model| {
            let spec = spec_of(model);
            let max_len = spec.seq.min(3 * spec.sliding_window.max(8) + 12);
            (2..=max_len).prop_flat_map(move |len| {
                (
                    Just(model),
                    tokens(spec.vocab_size, len),
                    1..len,
                    prop::collection::vec(0..=spec.chunk, 1..6),
                )
            })
        })
    };
    check_known(factory, "prefill_equals_prefix_chunks_and_steps", || {
        run_cases(
            "prefill_equals_prefix_chunks_and_steps",
            factory.cases(),
            MODELS,
            strategy,
            |(model, toks, split, sizes)| {
                let mut whole = factory.kv(model, WindowRule::Exact).unwrap();
                let want = whole.prefill(&toks).unwrap();
                let mut parts = factory.kv(model, WindowRule::Exact).unwrap();
                let mut got = parts.prefill(&toks[..split]).unwrap();
                for piece in pieces(&toks[split..], &sizes, parts.spec().chunk) {
                    got = apply(&mut parts, &piece);
                }
                assert_eq!(parts.position(), toks.len());
                assert_token("final token", model, &toks, got, want);
                for (l, (g, w)) in layers(&parts).iter().zip(layers(&whole).iter()).enumerate() {
                    assert_layers_close(&format!("{model} layer {l}"), g, w, factory.path_tolerance());
                }
            },
        )
    });
}

#[derive(Clone, Debug)]
enum TreeOp {
    Call(Piece),
    Snapshot,
    Restore(usize),
}

/// Any tree of snapshots and restores reproduces a fresh run along the same path, bit for bit:
/// the same calls run the same kernels on the same inputs, so a difference of any size is a
/// restore or fork that handed back other rows.
pub fn snapshot_trees_replay_fresh_runs<F: BackendFactory>(factory: &F) {
    let strategy = |model: &'static str| {
        Just(model).prop_flat_map(|model| {
            let spec = spec_of(model);
            let vocab = spec.vocab_size as i32;
            let op = prop_oneof![
                3 => prop::collection::vec(0..vocab, 1..=spec.chunk).prop_map(|t| TreeOp::Call(Piece::Chunk(t))),
                3 => (0..vocab).prop_map(|t| TreeOp::Call(Piece::Step(t))),
                2 => Just(TreeOp::Snapshot),
                2 => (0..8usize).prop_map(TreeOp::Restore),
            ];
            (
                Just(model),
                tokens(spec.vocab_size, 1 + spec.sliding_window.max(4)),
                prop::collection::vec(op, 1..14),
            )
        })
    };
    check_known(factory, "snapshot_trees_replay_fresh_runs", || {
        run_cases(
            "snapshot_trees_replay_fresh_runs",
            factory.cases().div_ceil(2),
            MODELS,
            strategy,
            |(model, prefix, ops)| {
                let mut s = factory.kv(model, WindowRule::Exact).unwrap();
                s.prefill(&prefix).unwrap();
                let mut snapshots = vec![(s.snapshot().unwrap(), Vec::<Piece>::new())];
                let mut path: Vec<Piece> = Vec::new();
                let mut outputs: Vec<(Vec<Piece>, i32)> = Vec::new();
                for op in &ops {
                    match op {
                        TreeOp::Call(piece) => {
                            path.push(piece.clone());
                            outputs.push((path.clone(), apply(&mut s, piece)));
                        }
                        TreeOp::Snapshot => snapshots.push((s.snapshot().unwrap(), path.clone())),
                        TreeOp::Restore(i) => {
                            let (snap, snap_path) = &snapshots[i % snapshots.len()];
                            s.restore(snap).unwrap();
                            path = snap_path.clone();
                            assert_eq!(s.position(), prefix.len() + path.iter().map(piece_len).sum::<usize>());
                        }
                    }
                }
                for (path, token) in outputs {
                    let mut fresh = factory.kv(model, WindowRule::Exact).unwrap();
                    fresh.prefill(&prefix).unwrap();
                    let mut want = 0;
                    for piece in &path {
                        want = apply(&mut fresh, piece);
                    }
                    assert_eq!(token, want, "{model}: output after {path:?} differs from a fresh run");
                }
                // The live state equals a fresh run of its path, K/V included.
                let mut fresh = factory.kv(model, WindowRule::Exact).unwrap();
                fresh.prefill(&prefix).unwrap();
                for piece in &path {
                    apply(&mut fresh, piece);
                }
                for (l, (g, w)) in layers(&s).iter().zip(layers(&fresh).iter()).enumerate() {
                    assert_layers_close(&format!("{model} layer {l} after the tree"), g, w, Tolerance::EXACT);
                }
            },
        )
    });
}

fn piece_len(p: &Piece) -> usize {
    match p {
        Piece::Chunk(t) => t.len(),
        Piece::Step(_) => 1,
    }
}

/// Feeds `stream` as prefix + pieces and checks every returned token against the naive
/// recompute with the given window per query.
fn check_against_naive<F: BackendFactory>(
    factory: &F,
    model: &str,
    rule: WindowRule,
    prefix_len: usize,
    stream: &[i32],
    sizes: &[usize],
) {
    let m = reference_model(model).unwrap();
    let spec = m.spec().clone();
    let window = spec.sliding_window;
    let mut s = factory.kv(model, rule).unwrap();
    let mut outputs = vec![(prefix_len, s.prefill(&stream[..prefix_len]).unwrap())];
    let mut stepped = vec![false; stream.len()];
    let mut fed = prefix_len;
    for piece in pieces(&stream[prefix_len..], sizes, spec.chunk) {
        if matches!(piece, Piece::Step(_)) {
            stepped[fed] = true;
        }
        let token = apply(&mut s, &piece);
        fed += piece_len(&piece);
        outputs.push((fed, token));
    }
    let window_at = |q: usize| {
        if rule == WindowRule::SeedStep && stepped[q] {
            window + 1
        } else {
            window
        }
    };
    let logits = naive::logits(&m, stream, &window_at);
    let near_tie = near_tie(factory);
    for (fed, token) in outputs {
        let want = &logits[fed - 1];
        let gap = naive::gap_to(want, token);
        assert!(
            gap < near_tie,
            "{model} ({rule:?}): after {fed} tokens the backend chose {token}, the naive recompute {} (gap {gap:e})",
            naive::argmax(want)
        );
    }
}

/// The cached path agrees with a full no-cache recompute, well past the sliding window.
pub fn cached_path_matches_naive_recompute<F: BackendFactory>(factory: &F) {
    let strategy = |model: &'static str| {
        Just(model).prop_flat_map(|model| {
            let spec = spec_of(model);
            let len = 3 * spec.sliding_window.max(8) + 9;
            (
                Just(model),
                tokens(spec.vocab_size, len),
                1..spec.sliding_window.max(8) + 4,
                prop::collection::vec(0..=spec.chunk, 1..6),
            )
        })
    };
    check_known(factory, "cached_path_matches_naive_recompute", || {
        run_cases(
            "cached_path_matches_naive_recompute",
            factory.cases().div_ceil(2),
            MODELS,
            strategy,
            |(model, stream, prefix, sizes)| {
                check_against_naive(factory, model, WindowRule::Exact, prefix, &stream, &sizes);
            },
        )
    });
}

/// The seed's step rule hands a sliding layer `window` rows: the step sees `window + 1` keys.
pub fn seed_step_rule_sees_one_key_more<F: BackendFactory>(factory: &F) {
    check_known(factory, "seed_step_rule_sees_one_key_more", || {
        let model = "tiny-gemma3:2:w5";
        let spec = spec_of(model);
        let stream: Vec<i32> = (0..30).map(|i| (i * 37 + 11) % spec.vocab_size as i32).collect();
        // Prefill 7 (past the window), then steps only, then a chunk, then steps.
        if factory.supports_seed_step_rule() {
            check_against_naive(
                factory,
                model,
                WindowRule::SeedStep,
                7,
                &stream,
                &[0, 0, 0, 0, 0, 0, 3, 0],
            );
        } else {
            match factory.kv(model, WindowRule::SeedStep) {
                Err(Error::ContractMismatch { .. }) => {}
                Err(e) => panic!(
                    "{}: the seed's step rule refused with the wrong error: {e}",
                    factory.name()
                ),
                Ok(_) => panic!(
                    "{}: a session without the seed's step rule opened with it",
                    factory.name()
                ),
            }
        }
        check_against_naive(factory, model, WindowRule::Exact, 7, &stream, &[0, 0, 0, 0, 0, 0, 3, 0]);
    });
}

/// GQA Gemma, Llama, Qwen2 biases and Qwen3 QK-norm, each against the naive recompute.
pub fn gqa_and_llama_families_match_naive<F: BackendFactory>(factory: &F) {
    check_known(factory, "gqa_and_llama_families_match_naive", || {
        for model in FAMILIES {
            let spec = spec_of(model);
            let len = 2 * spec.sliding_window.max(10) + 7;
            let stream: Vec<i32> = (0..len as i32)
                .map(|i| (i * 101 + 7) % spec.vocab_size as i32)
                .collect();
            check_against_naive(factory, model, WindowRule::Exact, 9, &stream, &[3, 0, 8, 0, 0, 5]);
        }
    });
}

/// Every bad input is a clear error, and the session then behaves as if it never happened.
pub fn bad_input_is_refused_and_session_survives<F: BackendFactory>(factory: &F) {
    check_known(factory, "bad_input_is_refused_and_session_survives", || {
        let model = "tiny-gemma3:1";
        let spec = spec_of(model);
        let vocab = spec.vocab_size as i32;
        let prefix: Vec<i32> = (1..=20).collect();
        let mut fresh = factory.kv(model, WindowRule::Exact).unwrap();
        assert!(
            matches!(fresh.step(3), Err(Error::NotPrefilled { .. })),
            "step before prefill"
        );
        assert!(
            matches!(fresh.chunk(&[3]), Err(Error::NotPrefilled { .. })),
            "chunk before prefill"
        );

        let mut s = factory.kv(model, WindowRule::Exact).unwrap();
        let mut control = factory.kv(model, WindowRule::Exact).unwrap();
        s.prefill(&prefix).unwrap();
        control.prefill(&prefix).unwrap();
        let too_long = vec![1; spec.chunk + 1];
        let (chunk, seq, id) = (spec.chunk, spec.seq, i64::from(vocab));
        type BadCall<B> = Box<dyn Fn(&mut B) -> kv_core::Result<i32>>;
        // Each with the error it must be, named by variant and fields: any other error (a
        // backend's own failure, another check firing first) is a bug.
        type Expected = Box<dyn Fn(&Error) -> bool>;
        let cases: Vec<(&str, BadCall<F::Kv>, Expected)> = vec![
            (
                "empty chunk",
                Box::new(|b| b.chunk(&[])),
                Box::new(|e| {
                    matches!(
                        e,
                        Error::BadTokenCount {
                            op: "chunk",
                            n: 0,
                            min: 1,
                            ..
                        }
                    )
                }),
            ),
            (
                "oversized chunk",
                Box::new(move |b| b.chunk(&too_long)),
                Box::new(
                    move |e| matches!(e, &Error::BadTokenCount { op: "chunk", n, max, .. } if n == chunk + 1 && max == chunk),
                ),
            ),
            (
                "id = vocab in chunk",
                Box::new(move |b| b.chunk(&[1, vocab])),
                Box::new(move |e| matches!(e, &Error::TokenOutOfRange { op: "chunk", index: 1, id: i, .. } if i == id)),
            ),
            (
                "negative id in chunk",
                Box::new(|b| b.chunk(&[-1])),
                Box::new(|e| {
                    matches!(
                        e,
                        Error::TokenOutOfRange {
                            op: "chunk",
                            index: 0,
                            id: -1,
                            ..
                        }
                    )
                }),
            ),
            (
                "id = vocab in step",
                Box::new(move |b| b.step(vocab)),
                Box::new(move |e| matches!(e, &Error::TokenOutOfRange { op: "step", index: 0, id: i, .. } if i == id)),
            ),
            (
                "negative id in step",
                Box::new(|b| b.step(-5)),
                Box::new(|e| matches!(e, Error::TokenOutOfRange { op: "step", id: -5, .. })),
            ),
            (
                "empty prefill",
                Box::new(|b| b.prefill(&[])),
                Box::new(|e| {
                    matches!(
                        e,
                        Error::BadTokenCount {
                            op: "prefill",
                            n: 0,
                            min: 1,
                            ..
                        }
                    )
                }),
            ),
            (
                "prefill longer than SEQ",
                Box::new(move |b| b.prefill(&vec![1; seq + 1])),
                Box::new(
                    move |e| matches!(e, &Error::BadTokenCount { op: "prefill", n, max, .. } if n == seq + 1 && max == seq),
                ),
            ),
            (
                "id = vocab in prefill",
                Box::new(move |b| b.prefill(&[2, vocab])),
                Box::new(
                    move |e| matches!(e, &Error::TokenOutOfRange { op: "prefill", index: 1, id: i, .. } if i == id),
                ),
            ),
        ];
        for (what, call, expected) in &cases {
            let err = call(&mut s).expect_err(what);
            assert!(expected(&err), "{what}: the wrong error: {err:?}");
            assert_eq!(s.position(), prefix.len(), "{what} moved the position");
        }
        let err = s.read_layer(spec.n_layers).expect_err("layer out of range");
        assert!(matches!(err, Error::LayerOutOfRange { .. }), "{err}");
        // Still usable, and exactly as a session that never saw the bad input.
        assert_eq!(s.chunk(&[5, 6, 7]).unwrap(), control.chunk(&[5, 6, 7]).unwrap());
        assert_eq!(s.step(9).unwrap(), control.step(9).unwrap());

        // Context overflow: walk up to the limit with full chunks, then one token too many. On
        // the smallest fixture of the suite (4 layers, 512 positions: 56 chunk calls, not
        // Gemma's 96 over 8 layers, which took 60-125 s on lavapipe); the positions' arithmetic
        // is the same, and sliding rings wrap many times in the other problems.
        let walk_model = "tiny-llama:4";
        let walk_spec = spec_of(walk_model);
        let mut walker = factory.kv(walk_model, WindowRule::Exact).unwrap();
        walker.prefill(&vec![4; walk_spec.seq]).unwrap();
        while walker.position() + walk_spec.chunk <= walk_spec.max_positions {
            walker.chunk(&vec![7; walk_spec.chunk]).unwrap();
        }
        let room = walk_spec.max_positions - walker.position();
        let err = walker.chunk(&vec![7; room + 1]).expect_err("chunk past maxPositions");
        assert!(matches!(err, Error::ContextOverflow { .. }), "{err}");
        for _ in 0..room {
            walker.step(7).unwrap();
        }
        assert_eq!(walker.position(), walk_spec.max_positions);
        assert!(matches!(walker.step(7), Err(Error::ContextOverflow { .. })));
        // A decoder refuses a request that cannot fit before making any call: the session is
        // left where it was (not even restored to the prefix, which it has moved past here).
        let mut decoder = KvDecoder::new(factory.kv(model, WindowRule::Exact).unwrap());
        let snap = decoder.prefill_prefix(&prefix).unwrap();
        decoder.backend_mut().chunk(&[5, 6, 7]).unwrap();
        let before = layers(decoder.backend());
        let err = decoder.generate(&snap, &[1, 2], None, spec.max_positions).unwrap_err();
        assert!(matches!(err, Error::ContextOverflow { .. }), "{err}");
        assert_eq!(
            decoder.backend().position(),
            prefix.len() + 3,
            "a refused generate moved the session"
        );
        assert_eq!(
            layers(decoder.backend()),
            before,
            "a refused generate changed the cache"
        );
        assert!(decoder.generate(&snap, &[1, 2], None, 3).is_ok());
    });
}

/// A snapshot of another session is refused, and both sessions keep working.
pub fn foreign_snapshot_is_refused<F: BackendFactory>(factory: &F) {
    check_known(factory, "foreign_snapshot_is_refused", || {
        let model = "tiny-gemma3:1";
        let mut a = factory.kv(model, WindowRule::Exact).unwrap();
        let mut b = factory.kv(model, WindowRule::Exact).unwrap();
        a.prefill(&[1, 2, 3]).unwrap();
        b.prefill(&[1, 2, 3, 4, 5]).unwrap();
        let from_a = a.snapshot().unwrap();
        let err = b.restore(&from_a).expect_err("foreign snapshot");
        assert!(matches!(err, Error::ForeignSnapshot { .. }), "{err}");
        assert_eq!(b.position(), 5);
        let mut control = factory.kv(model, WindowRule::Exact).unwrap();
        control.prefill(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!(b.step(8).unwrap(), control.step(8).unwrap());
        a.restore(&from_a).unwrap();
    });
}

/// One prefix, many continuations: a snapshot restores the same state after any later calls.
pub fn snapshots_branch_and_outlive_later_calls<F: BackendFactory>(factory: &F) {
    check_known(factory, "snapshots_branch_and_outlive_later_calls", || {
        let model = "tiny-gemma3:1";
        let prefix: Vec<i32> = (0..40).map(|i| (i * 13 + 5) % 500).collect();
        let mut decoder = KvDecoder::new(factory.kv(model, WindowRule::Exact).unwrap());
        let snap = decoder.prefill_prefix(&prefix).unwrap();
        let first = decoder
            .generate(&snap, &[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], None, 12)
            .unwrap();
        let kv_first = layers(decoder.backend());
        let other = decoder.generate(&snap, &[200, 201], None, 20).unwrap();
        assert_eq!(other.timing.chunk_calls, 1);
        let again = decoder
            .generate(&snap, &[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], None, 12)
            .unwrap();
        assert_eq!(first.ids, again.ids);
        assert_eq!(first.timing.chunk_calls, 2, "10 tokens in chunks of 8");
        assert_eq!(first.ids.len(), 12);
        assert_eq!(first.timing.decode_tokens, 11);
        for (l, (g, w)) in layers(decoder.backend()).iter().zip(kv_first.iter()).enumerate() {
            assert_layers_close(
                &format!("layer {l} on the replayed branch"),
                g,
                w,
                kv_core::tolerance::Tolerance::SAME_BACKEND,
            );
        }
        // The snapshot position is the prefix.
        decoder.backend_mut().restore(&snap).unwrap();
        assert_eq!(decoder.backend().position(), prefix.len());
        // eos stops generation without emitting it.
        let eos = first.ids[3];
        let cut = decoder
            .generate(&snap, &[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], Some(eos), 12)
            .unwrap();
        let until = first.ids.iter().position(|&t| t == eos).unwrap();
        assert_eq!(cut.ids, first.ids[..until]);
        assert!(cut.stopped_at_eos);
    });
}

/// The redecode graph's greedy stream equals the KV session's.
pub fn redecode_matches_kv_stream<F: BackendFactory>(factory: &F) {
    check_known(factory, "redecode_matches_kv_stream", || {
        for model in ["tiny-gemma3:1", "tiny-llama:4"] {
            let prompt: Vec<i32> = (0..17).map(|i| (i * 29 + 3) % 300).collect();
            let redecoded = RedecodeDecoder::new(factory.redecode(model).unwrap())
                .generate(&prompt, None, 6)
                .unwrap();
            let mut kv = factory.kv(model, WindowRule::Exact).unwrap();
            let mut stream = vec![kv.prefill(&prompt).unwrap()];
            while stream.len() < 6 {
                stream.push(kv.step(*stream.last().unwrap()).unwrap());
            }
            let mut context = prompt.clone();
            for (i, (&r, &k)) in redecoded.iter().zip(&stream).enumerate() {
                assert_token(&format!("{model} token {i}"), model, &context, r, k);
                context.push(k);
            }
            assert_eq!(redecoded.len(), 6);
        }
    });
}

/// Redecode needs `1 <= prompt < SEQ` and in-vocabulary ids.
pub fn redecode_refuses_prompts_without_room<F: BackendFactory>(factory: &F) {
    check_known(factory, "redecode_refuses_prompts_without_room", || {
        let model = "tiny-llama:4";
        let mut decoder = RedecodeDecoder::new(factory.redecode(model).unwrap());
        let seq = decoder.backend_mut().seq();
        for prompt in [vec![], vec![1; seq]] {
            let err = decoder.generate(&prompt, None, 2).unwrap_err();
            assert!(matches!(err, Error::PromptDoesNotFit { .. }), "{err}");
        }
        let err = decoder.generate(&[1, 100_000], None, 2).unwrap_err();
        assert!(matches!(err, Error::TokenOutOfRange { .. }), "{err}");
        // Generation stops when the graph is full.
        let near_full: Vec<i32> = (0..seq as i32 - 2).map(|i| i % 50).collect();
        assert_eq!(decoder.generate(&near_full, None, 10).unwrap().len(), 2);
        let err = decoder
            .backend_mut()
            .run(&[1, 2])
            .expect_err("run with fewer than SEQ ids");
        assert!(
            matches!(err, Error::BadTokenCount { n: 2, min, max, .. } if min == seq && max == seq),
            "run with fewer than SEQ ids: {err:?}"
        );
    });
}

/// Call by call against the FP32 reference: tokens equal, K/V within the backend's tolerance.
/// On the reference itself that comparison is with itself; there each call's logits are held
/// against the naive recompute's instead (its own RoPE, visibility and loops: what the reference
/// shares with the IREE backends, `kv_core`'s window plans, masks and RoPE tables, is not in it).
pub fn kv_matches_reference_call_by_call<F: BackendFactory>(factory: &F) {
    check_known(factory, "kv_matches_reference_call_by_call", || {
        let against_naive = factory.is_reference() && factory.rounding() == kv_core::manifest::Rounding::FP32;
        for model in MODELS {
            let naive_model = reference_model(model).unwrap();
            let check_logits = |backend: &F::Kv, context: &[i32]| {
                if !against_naive {
                    return;
                }
                let window = naive_model.spec().sliding_window;
                let want = naive::logits(&naive_model, context, &|_| window);
                let got = backend.last_logits().expect("the reference keeps its logits");
                // Two FP32 forwards in other summation orders: measured at most 2.4e-6 apart
                // over this problem's 59 calls, so the same-backend bound holds with ~40x room.
                kv_core::tolerance::assert_close(
                    &format!(
                        "{model} logits after {} tokens against the naive recompute",
                        context.len()
                    ),
                    got,
                    want.last().unwrap(),
                    Tolerance::SAME_BACKEND,
                );
            };
            let spec = spec_of(model);
            let stream: Vec<i32> = (0..60).map(|i| (i * 53 + 1) % spec.vocab_size as i32).collect();
            let mut backend = factory.kv(model, WindowRule::Exact).unwrap();
            let mut reference = ReferenceFactory::like(factory).kv(model, WindowRule::Exact).unwrap();
            let prefix = 2 * spec.sliding_window.max(4) + 1;
            let mut context = stream[..prefix].to_vec();
            let (got, want) = (backend.prefill(&context).unwrap(), reference.prefill(&context).unwrap());
            assert_token("prefill", model, &context, got, want);
            check_logits(&backend, &context);
            for piece in pieces(&stream[prefix..], &[5, 0, 8, 3, 0, 0], spec.chunk) {
                let (got, want) = (apply(&mut backend, &piece), apply(&mut reference, &piece));
                match &piece {
                    Piece::Chunk(t) => context.extend(t),
                    Piece::Step(t) => context.push(*t),
                }
                assert_token(
                    &format!("{model} after {} tokens", context.len()),
                    model,
                    &context,
                    got,
                    want,
                );
                check_logits(&backend, &context);
                for (l, (g, w)) in layers(&backend).iter().zip(layers(&reference).iter()).enumerate() {
                    assert_layers_close(
                        &format!("{model} layer {l} at {}", context.len()),
                        g,
                        w,
                        factory.tolerance(),
                    );
                }
            }
            // Feeds of every length from one id to past two chunks, after a restore, in chunk
            // calls of at most `chunk` ids as `KvDecoder` feeds them: each piece runs the
            // smallest chunk graph that holds it where a backend has several (contract 2's
            // small chunk graph), so both graphs meet the reference across the boundary.
            let (here, there) = (backend.snapshot().unwrap(), reference.snapshot().unwrap());
            let feed: Vec<i32> = (0..2 * spec.chunk + 1)
                .map(|i| (i as i32 * 31 + 7) % spec.vocab_size as i32)
                .collect();
            for n in 1..=feed.len().min(spec.max_positions - context.len()) {
                backend.restore(&here).unwrap();
                reference.restore(&there).unwrap();
                let mut fed = context.clone();
                for piece in feed[..n].chunks(spec.chunk) {
                    let (got, want) = (backend.chunk(piece).unwrap(), reference.chunk(piece).unwrap());
                    fed.extend(piece);
                    let what = format!("{model} feed of {n} ids, a piece of {}", piece.len());
                    // Against the FP32 recompute at the backend's own margin: a backend that
                    // rounds its matmul inputs to bf16 and the reference that rounds the same
                    // part at the rounding's scale (5.4e-3 measured on the host suite, tiny-gemma3:1,
                    // a feed of 16).
                    assert_token_within(&what, model, &fed, got, want, near_tie(factory));
                }
                for (l, (g, w)) in layers(&backend).iter().zip(layers(&reference).iter()).enumerate() {
                    assert_layers_close(
                        &format!("{model} layer {l} after a feed of {n}"),
                        g,
                        w,
                        factory.tolerance(),
                    );
                }
            }
        }
    });
}

/// A snapshot saved to a file and loaded into a fresh session continues exactly like the session
/// that saved it, branches like any snapshot, and a file saved by the reference continues here
/// like the reference; a file of another model is refused and leaves the session usable.
pub fn snapshot_files_continue_like_the_session<F: BackendFactory>(factory: &F) {
    use kv_core::snapshot_file;
    check_known(factory, "snapshot_files_continue_like_the_session", || {
        let model = "tiny-gemma3:1";
        let spec = spec_of(model);
        let prefix: Vec<i32> = (0..40).map(|i| (i * 17 + 3) % 500).collect();
        let utterance = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31];
        let dir = tempfile::tempdir().expect("temp dir");

        // Continues `b` from its current position: the utterance in chunks, then 6 steps.
        fn continue_from<B: KvBackend>(b: &mut B, utterance: &[i32]) -> (Vec<i32>, Vec<LayerKv>) {
            let mut ids = Vec::new();
            for piece in utterance.chunks(b.spec().chunk) {
                ids.push(b.chunk(piece).expect("chunk"));
            }
            for _ in 0..6 {
                let next = b.step(*ids.last().expect("a token")).expect("step");
                ids.push(next);
            }
            (ids, layers(b))
        }
        fn prefilled<B: KvBackend>(b: &mut B, prefix: &[i32]) -> B::Snapshot {
            let spec = b.spec().clone();
            let (head, rest) = prefix.split_at(spec.seq.min(prefix.len()));
            b.prefill(head).expect("prefill");
            for piece in rest.chunks(spec.chunk) {
                b.chunk(piece).expect("chunk");
            }
            b.snapshot().expect("snapshot")
        }

        let mut original = factory.kv(model, WindowRule::Exact).unwrap();
        let snap = prefilled(&mut original, &prefix);
        let path = dir.path().join("prefix.skvsnap");
        snapshot_file::save(&original, &snap, &path).expect("save");
        let (want, want_layers) = continue_from(&mut original, &utterance);

        let mut fresh = factory.kv(model, WindowRule::Exact).unwrap();
        let loaded = snapshot_file::load(&fresh, &path).expect("load");
        assert_eq!(fresh.position(), 0, "loading must not restore");
        assert_eq!(fresh.snapshot_position(&loaded), prefix.len());
        fresh.restore(&loaded).expect("restore");
        let (got, got_layers) = continue_from(&mut fresh, &utterance);
        assert_eq!(got, want, "tokens after a loaded snapshot");
        for (l, (g, w)) in got_layers.iter().zip(&want_layers).enumerate() {
            assert_layers_close(
                &format!("layer {l} after a loaded snapshot"),
                g,
                w,
                kv_core::tolerance::Tolerance::SAME_BACKEND,
            );
        }
        // It branches: another utterance from the same loaded snapshot, then the first again.
        original.restore(&snap).unwrap();
        let (other_want, _) = continue_from(&mut original, &utterance[..3]);
        fresh.restore(&loaded).unwrap();
        assert_eq!(continue_from(&mut fresh, &utterance[..3]).0, other_want);
        fresh.restore(&loaded).unwrap();
        assert_eq!(continue_from(&mut fresh, &utterance).0, want);

        // A file saved by the reference continues here as the reference continues.
        let mut reference = ReferenceFactory::like(factory).kv(model, WindowRule::Exact).unwrap();
        let reference_snap = prefilled(&mut reference, &prefix);
        let from_reference = dir.path().join("reference.skvsnap");
        snapshot_file::save(&reference, &reference_snap, &from_reference).expect("save reference");
        let (reference_ids, _) = continue_from(&mut reference, &utterance);
        let mut loaded_here = factory.kv(model, WindowRule::Exact).unwrap();
        let snap_here = snapshot_file::load(&loaded_here, &from_reference).expect("load the reference's file");
        loaded_here.restore(&snap_here).unwrap();
        let (ids_here, _) = continue_from(&mut loaded_here, &utterance);
        let mut context = prefix.clone();
        context.extend_from_slice(&utterance);
        for (i, (&g, &w)) in ids_here
            .iter()
            .zip(&reference_ids)
            .enumerate()
            .skip(utterance.len().div_ceil(spec.chunk) - 1)
        {
            assert_token(&format!("token {i} after the reference's file"), model, &context, g, w);
            context.push(w);
        }

        // Another model's file: refused, the session unchanged and usable.
        let other = "tiny-gemma3:2:w5";
        let mut stranger = factory.kv(other, WindowRule::Exact).unwrap();
        stranger.prefill(&[1, 2, 3]).unwrap();
        let Err(err) = snapshot_file::load(&stranger, &path) else {
            panic!("another model's file was loaded");
        };
        assert!(matches!(err, Error::SnapshotFile { .. }), "{err}");
        assert_eq!(stranger.position(), 3);
        let mut control = factory.kv(other, WindowRule::Exact).unwrap();
        control.prefill(&[1, 2, 3]).unwrap();
        assert_eq!(stranger.step(9).unwrap(), control.step(9).unwrap());
    });
}

/// Seeded sampling picks the reference's tokens: the same seed and settings give the same ids on
/// this backend as on the reference (whose candidates come from its full logits), over a whole
/// prompt and over a restored prefix, and the same ids again on a second run. Both backends draw
/// from the same ChaCha8 stream, so they can differ only where a draw falls within their logits'
/// difference of a boundary; the fixtures' prompts here were checked to keep clear of that
/// ([`NEAR_TIE`] is the tokens' own margin).
pub fn seeded_sampling_matches_the_reference<F: BackendFactory>(factory: &F) {
    check_known(factory, "seeded_sampling_matches_the_reference", || {
        let model = "tiny-gemma3:1";
        let k = DEFAULT_CANDIDATES;
        let prompt: Vec<i32> = (0..21).map(|i| (i * 31 + 7) % 500).collect();
        let configs = [
            SamplingConfig {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                ..SamplingConfig::default()
            },
            SamplingConfig {
                temperature: 1.3,
                min_p: 0.02,
                repetition_penalty: 1.3,
                ..SamplingConfig::default()
            },
        ];
        // A snapshot keeps the top-k of the call before it, whatever runs after it: what a draw
        // right after its restore samples from. (Compiled Vulkan steps write their results into
        // storage the session reuses, which later steps overwrite.)
        let mut session = factory.kv_with_top_k(model, k).unwrap();
        let token = session.prefill(&prompt[..13]).unwrap();
        let token = session.step(token).unwrap();
        let at = session.snapshot().unwrap();
        let kept = session.last_top_k(k).unwrap().expect("top-k of a step");
        assert_eq!(kept.ids()[0], token, "the first candidate is the step's token");
        session.step_greedy(token, 5, &mut |_| true).unwrap();
        session.step(prompt[14]).unwrap();
        assert_ne!(
            session.last_top_k(k).unwrap().as_ref(),
            Some(&kept),
            "later steps' top-k"
        );
        session.restore(&at).unwrap();
        assert_eq!(
            session.last_top_k(k).unwrap(),
            Some(kept),
            "the restored snapshot's top-k"
        );
        drop(session);
        let mut backend = KvDecoder::new(factory.kv_with_top_k(model, k).unwrap());
        let mut oracle = KvDecoder::new(ReferenceFactory::like(factory).kv(model, WindowRule::Exact).unwrap());
        let prefix = backend.prefill_prefix(&prompt[..13]).unwrap();
        let oracle_prefix = oracle.prefill_prefix(&prompt[..13]).unwrap();
        for (c, config) in configs.iter().enumerate() {
            for seed in [1u64, 2, 3] {
                let options = DecodeOptions {
                    max_new: 12,
                    stop: Default::default(),
                    sampling: Some(SamplingConfig { seed, ..config.clone() }),
                };
                let what = format!("{} config {c} seed {seed}", factory.name());
                let got = backend.complete(&prompt, &options, |_| {}).unwrap();
                let want = oracle.complete(&prompt, &options, |_| {}).unwrap();
                assert_eq!(got.ids, want.ids, "{what}: whole prompt");
                assert!(
                    got.timing.sample > std::time::Duration::ZERO,
                    "{what}: nothing was sampled"
                );
                let again = backend.complete(&prompt, &options, |_| {}).unwrap();
                assert_eq!(again.ids, got.ids, "{what}: a second run");
                let got = backend.generate_with(&prefix, &prompt[13..], &options, |_| {}).unwrap();
                let want = oracle
                    .generate_with(&oracle_prefix, &prompt[13..], &options, |_| {})
                    .unwrap();
                assert_eq!(got.ids, want.ids, "{what}: after a restored prefix");
            }
        }
        // Sampling is not greedy here: some draw left the argmax.
        let greedy = oracle
            .complete(&prompt, &DecodeOptions::greedy(12, []), |_| {})
            .unwrap();
        let sampled = oracle
            .complete(
                &prompt,
                &DecodeOptions {
                    max_new: 12,
                    stop: Default::default(),
                    sampling: Some(SamplingConfig {
                        seed: 1,
                        ..configs[1].clone()
                    }),
                },
                |_| {},
            )
            .unwrap();
        assert_ne!(greedy.ids, sampled.ids, "sampling drew the greedy tokens");
    });
}
