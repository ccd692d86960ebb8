//! Allowed-token masks (`KvBackend::set_allowed`, issue 31): a constrained decoder restricts
//! what each call predicts, and every backend must predict what the FP32 reference's logits,
//! masked on the host (`AllowedTokens::argmax`, `mask_logits`), give: the same token and top-k
//! for prefill, chunk, step and greedy steps, under masks of several densities (down to one id,
//! and two ids whose logits nearly tie), and the plain argmax again once the mask is lifted.
//! Backends without masks (contract v1 graphs) refuse one with `GraphUnavailable` and stay usable.

use kv_core::allowed::AllowedTokens;
use kv_core::sampling::{TopK, DEFAULT_CANDIDATES};
use kv_core::tolerance::assert_close;
use kv_core::{Error, KvBackend, WindowRule};

use crate::factory::{BackendFactory, ReferenceFactory};

/// A logit gap below this is a near-tie that FP32 summation order may flip (as in `problems`).
const NEAR_TIE: f32 = 1e-3;

/// splitmix64: the masks' ids, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The masks a call can be made under, cycled through by [`masked_calls_match_the_reference`].
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `set_allowed(None)`.
    Lifted,
    /// Every id, as a set: no restriction.
    All,
    /// Each id with probability `1/n`, never the unmasked argmax.
    Density(usize),
    /// One id, not the unmasked argmax.
    Single,
    /// The two ids (the unmasked argmax excluded) whose logits are closest: a near-tie the
    /// lowest-index rule must settle the same way wherever the logits agree.
    Tie,
}

const KINDS: [Kind; 8] = [
    Kind::Density(2),
    Kind::Single,
    Kind::Tie,
    Kind::Density(20),
    Kind::All,
    Kind::Density(4),
    Kind::Lifted,
    Kind::Tie,
];

/// The mask of `kind` for a call whose unmasked logits are `logits`.
fn mask_for(kind: Kind, logits: &[f32], rng: &mut Rng) -> Option<AllowedTokens> {
    let vocab = logits.len();
    let top = kv_core::allowed::AllowedTokens::all(vocab)
        .argmax(logits)
        .expect("a vocabulary") as usize;
    let other = |rng: &mut Rng| (top + 1 + rng.below(vocab - 1)) % vocab;
    let ids: Vec<i32> = match kind {
        Kind::Lifted => return None,
        Kind::All => return Some(AllowedTokens::all(vocab)),
        Kind::Density(n) => {
            let mut ids: Vec<i32> = (0..vocab)
                .filter(|&i| i != top && rng.below(n) == 0)
                .map(|i| i as i32)
                .collect();
            if ids.is_empty() {
                ids.push(other(rng) as i32);
            }
            ids
        }
        Kind::Single => vec![other(rng) as i32],
        Kind::Tie => {
            let mut order: Vec<usize> = (0..vocab).filter(|&i| i != top).collect();
            order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
            let at = (1..order.len())
                .min_by(|&i, &j| {
                    let gap = |i: usize| logits[order[i]] - logits[order[i - 1]];
                    gap(i).total_cmp(&gap(j))
                })
                .expect("a vocabulary of three ids or more");
            vec![order[at - 1] as i32, order[at] as i32]
        }
    };
    Some(AllowedTokens::from_ids(vocab, &ids).expect("ids of the vocabulary"))
}

/// `got` is the masked argmax of the reference's `logits`, or a near-tie of it among the allowed
/// ids; a disallowed id never passes.
#[track_caller]
fn assert_masked_token(what: &str, got: i32, logits: &[f32], mask: Option<&AllowedTokens>) {
    let all = AllowedTokens::all(logits.len());
    let mask = mask.unwrap_or(&all);
    assert!(
        mask.allows(got),
        "{what}: predicted id {got}, which the mask does not allow"
    );
    let want = mask.argmax(logits).expect("a mask that allows some id");
    let gap = logits[want as usize] - logits[got as usize];
    assert!(
        got == want || gap < NEAR_TIE,
        "{what}: token {got}, expected {want} (reference logit gap {gap:e}: not a near-tie)"
    );
}

/// The backend's top-k against the reference's logits masked on the host: the same ids (up to
/// swapped near-ties), the allowed ones' logits within `factory`'s tolerance, the rest `-inf`.
#[track_caller]
fn assert_masked_top_k<F: BackendFactory>(
    factory: &F,
    what: &str,
    got: &TopK,
    logits: &[f32],
    mask: Option<&AllowedTokens>,
) {
    let mut masked = logits.to_vec();
    if let Some(mask) = mask {
        mask.mask_logits(&mut masked);
    }
    let want = TopK::of_logits(&masked, got.ids().len());
    let finite = |t: &TopK| t.logits().iter().take_while(|l| l.is_finite()).count();
    let n = finite(&want);
    assert_eq!(
        finite(got),
        n,
        "{what}: allowed entries of the top-k (got {:?})",
        got.ids()
    );
    assert!(
        got.logits()[n..].iter().all(|&l| l == f32::NEG_INFINITY),
        "{what}: masked top-k entries must be -inf: {:?}",
        &got.logits()[n..]
    );
    for (i, (&g, &w)) in got.ids()[..n].iter().zip(&want.ids()[..n]).enumerate() {
        let swapped = (masked[w as usize] - masked[g as usize]).abs() < NEAR_TIE;
        assert!(g == w || swapped, "{what}: top-k entry {i} is id {g}, expected {w}");
        assert!(
            mask.is_none_or(|m| m.allows(g)),
            "{what}: top-k holds disallowed id {g}"
        );
    }
    assert_close(
        &format!("{what}: allowed top-k logits"),
        &got.logits()[..n],
        &want.logits()[..n],
        factory.tolerance(),
    );
}

/// One call after the prefill: a chunk or a step.
enum Call<'a> {
    Prefill(&'a [i32]),
    Chunk(&'a [i32]),
    Step(i32),
}

fn call<B: KvBackend>(b: &mut B, c: &Call<'_>) -> i32 {
    match c {
        Call::Prefill(t) => b.prefill(t).unwrap_or_else(|e| panic!("prefill {t:?}: {e}")),
        Call::Chunk(t) => b.chunk(t).unwrap_or_else(|e| panic!("chunk {t:?}: {e}")),
        Call::Step(t) => b.step(*t).unwrap_or_else(|e| panic!("step {t}: {e}")),
    }
}

/// Under random masks (the run's seed printed with its replay command) every call predicts the
/// reference's masked argmax and top-k: a prefill, chunks and steps, each under its own mask
/// (several densities, one id, a near-tied pair, every id, none), then greedy steps
/// (`step_greedy`, a step ahead on async devices) under one mask. A mask of another vocabulary
/// is `BadTokenCount` and keeps the mask in force. Where the backend has no masks
/// (`BackendFactory::supports_allowed_mask`: contract v1 graphs), a mask is `GraphUnavailable`,
/// lifting it is no error, and the session goes on predicting the plain argmax.
pub fn masked_calls_match_the_reference<F: BackendFactory>(factory: &F) {
    let model = "tiny-gemma3:1";
    let k = DEFAULT_CANDIDATES;
    let seed = crate::problems::problem_seed("masked_calls_match_the_reference");
    eprintln!(
        "masked_calls_match_the_reference on {}: seed {seed}; replay: {}",
        factory.name(),
        crate::problems::replay_line()
    );
    let mut rng = Rng(seed);
    let mut backend = factory.kv_with_top_k(model, k).unwrap();
    // The oracle runs unmasked: its logits, masked on the host, say what a masked call predicts.
    let mut reference = ReferenceFactory::like(factory).kv(model, WindowRule::Exact).unwrap();
    let vocab = backend.spec().vocab_size;
    let stream: Vec<i32> = (0..40).map(|i| ((i * 97 + 11) % vocab) as i32).collect();
    let chunk = backend.spec().chunk;

    if !factory.supports_allowed_mask() {
        let mask = AllowedTokens::from_ids(vocab, &[3]).unwrap();
        match backend.set_allowed(Some(&mask)) {
            Err(Error::GraphUnavailable { op: "set_allowed", .. }) => {}
            other => panic!("a mask on {}: expected GraphUnavailable, got {other:?}", factory.name()),
        }
        backend.set_allowed(None).expect("lifting no mask");
        for c in [
            Call::Prefill(&stream[..13]),
            Call::Chunk(&stream[13..16]),
            Call::Step(stream[16]),
        ] {
            let got = call(&mut backend, &c);
            call(&mut reference, &c);
            assert_masked_token("after a refused mask", got, reference.last_logits().unwrap(), None);
        }
        return;
    }

    let mut calls = vec![Call::Prefill(&stream[..13])];
    let mut at = 13;
    for size in [5, 0, 0, chunk, 1, 0, 3, 0] {
        match size {
            0 => {
                calls.push(Call::Step(stream[at]));
                at += 1;
            }
            n => {
                calls.push(Call::Chunk(&stream[at..at + n]));
                at += n;
            }
        }
    }
    for (i, c) in calls.iter().enumerate() {
        let kind = KINDS[i % KINDS.len()];
        // The reference first: the near-tie mask is built from this call's logits.
        call(&mut reference, c);
        let logits = reference.last_logits().unwrap().to_vec();
        let mask = mask_for(kind, &logits, &mut rng);
        backend.set_allowed(mask.as_ref()).unwrap();
        let got = call(&mut backend, c);
        let what = format!(
            "{} call {i} ({}) under {kind:?} ({} ids allowed)",
            factory.name(),
            match c {
                Call::Prefill(_) => "prefill",
                Call::Chunk(_) => "chunk",
                Call::Step(_) => "step",
            },
            mask.as_ref().map_or(vocab, AllowedTokens::count)
        );
        assert_masked_token(&what, got, &logits, mask.as_ref());
        let top = backend.last_top_k(k).unwrap().expect("a session with top-k");
        assert_masked_top_k(factory, &what, &top, &logits, mask.as_ref());
    }

    // A mask of another vocabulary is refused; the one in force stays.
    let mut kept = AllowedTokens::none(vocab);
    for _ in 0..vocab / 10 {
        kept.insert(rng.below(vocab) as i32).unwrap();
    }
    backend.set_allowed(Some(&kept)).unwrap();
    match backend.set_allowed(Some(&AllowedTokens::all(vocab + 1))) {
        Err(Error::BadTokenCount { n, min, .. }) if n == vocab + 1 && min == vocab => {}
        other => panic!("a mask of {} ids: expected BadTokenCount, got {other:?}", vocab + 1),
    }

    // Greedy steps under that mask: the reference's masked argmax fed back each step.
    let first = stream[at];
    let (backend_before, reference_before) = (backend.snapshot().unwrap(), reference.snapshot().unwrap());
    let mut got = Vec::new();
    backend
        .step_greedy(first, 8, &mut |t| {
            got.push(t);
            true
        })
        .unwrap();
    assert_eq!(got.len(), 8, "greedy steps taken");
    let mut fed = first;
    for (i, &g) in got.iter().enumerate() {
        reference.step(fed).unwrap();
        let logits = reference.last_logits().unwrap();
        assert_masked_token(&format!("greedy step {i}"), g, logits, Some(&kept));
        if g != kept.argmax(logits).unwrap() {
            // A near-tie flipped: the streams part here.
            break;
        }
        fed = g;
    }

    // Lifted, from the same position: the plain argmax again.
    backend.restore(&backend_before).unwrap();
    reference.restore(&reference_before).unwrap();
    backend.set_allowed(None).unwrap();
    let got = backend.step(first).unwrap();
    reference.step(first).unwrap();
    assert_masked_token(
        "a step after the mask is lifted",
        got,
        reference.last_logits().unwrap(),
        None,
    );
}
