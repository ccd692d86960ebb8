//! `diverge::lockstep` against scripted fake backends: one that agrees, one whose token differs
//! at known positions (near-tie or not, by how far below the oracle's top logit the token it
//! picks sits), one whose K or V drifts past the tolerance from a known position in one layer.
//! The CLI's tests run the same library on the reference and IREE, where nothing diverges.

use kv_core::diverge::{below_top, lockstep, sampled_lockstep, top_gap, DivergeReport, LockstepOptions};
use kv_core::sampling::{Sampler, SamplingConfig, TopK};
use kv_core::{Error, KvBackend, KvSpec, LayerKv, Result};

/// Predicts a function of the last token and the position, and holds K/V rows that are a
/// function of (token, position, layer, head, index); each deviation is switched on by a field.
struct Scripted {
    spec: KvSpec,
    name: &'static str,
    fed: Vec<i32>,
    /// Rows `read_layer` hands over, counted back from the position (a sliding layer's tail).
    keep: Option<usize>,
    /// Positions whose prediction is another token than the script's.
    swaps: Vec<(usize, Swap)>,
    /// `(layer, first position, amount)` added to that layer's K rows from that position on.
    drift: Option<(usize, usize, f32)>,
    /// The same for V.
    drift_v: Option<(usize, usize, f32)>,
    /// With logits: the top-1/top-2 gap of every call.
    gap: Option<f32>,
    logits: Vec<f32>,
}

/// What a backend predicts instead of the scripted token `t`.
#[derive(Clone, Copy)]
enum Swap {
    /// `t + n` (mod 32): with logits, `t + 3` is the oracle's second at `1 - gap`, and every
    /// other token but `t` scores 0, 1 below its top, ranked 2nd.
    By(i32),
    /// This token.
    To(i32),
}

const LAYERS: usize = 3;

fn spec(n_layers: usize) -> KvSpec {
    KvSpec {
        n_layers,
        head_dim: 4,
        n_heads: 2,
        n_kv_heads: 2,
        hidden_size: 8,
        vocab_size: 32,
        sliding_window: 0,
        chunk: 4,
        seq: 8,
        max_positions: 64,
        ..KvSpec::default()
    }
}

impl Scripted {
    fn new(name: &'static str) -> Self {
        Scripted {
            spec: spec(LAYERS),
            name,
            fed: Vec::new(),
            keep: None,
            swaps: Vec::new(),
            drift: None,
            drift_v: None,
            gap: None,
            logits: Vec::new(),
        }
    }

    fn with_gap(self, gap: f32) -> Self {
        Scripted { gap: Some(gap), ..self }
    }

    fn scripted(last: i32, position: usize) -> i32 {
        (last * 7 + position as i32) % 32
    }

    fn feed(&mut self, tokens: &[i32]) -> Result<i32> {
        self.spec.check_tokens("feed", tokens)?;
        self.fed.extend_from_slice(tokens);
        let p = self.fed.len();
        let token = Self::scripted(*self.fed.last().unwrap(), p);
        // The logits are the script's: a swap is a backend picking another token than them.
        if let Some(gap) = self.gap {
            self.logits = vec![0.0; 32];
            self.logits[token as usize] = 1.0;
            self.logits[(token as usize + 3) % 32] = 1.0 - gap;
        }
        Ok(match self.swaps.iter().find(|(at, _)| *at == p) {
            Some((_, Swap::By(n))) => (token + n) % 32,
            Some((_, Swap::To(t))) => *t,
            None => token,
        })
    }

    fn value(token: i32, p: usize, layer: usize, head: usize, i: usize, which: usize) -> f32 {
        let x = token as usize * 31 + p * 17 + layer * 13 + head * 7 + i * 3 + which * 5;
        (x % 101) as f32 / 101.0 - 0.5
    }
}

impl KvBackend for Scripted {
    type Snapshot = Vec<i32>;
    fn spec(&self) -> &KvSpec {
        &self.spec
    }
    fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        self.fed.clear();
        self.feed(tokens)
    }
    fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        self.feed(tokens)
    }
    fn step(&mut self, token: i32) -> Result<i32> {
        self.feed(&[token])
    }
    fn snapshot(&self) -> Result<Vec<i32>> {
        Ok(self.fed.clone())
    }
    fn restore(&mut self, snapshot: &Vec<i32>) -> Result<()> {
        self.fed = snapshot.clone();
        Ok(())
    }
    fn snapshot_position(&self, snapshot: &Vec<i32>) -> usize {
        snapshot.len()
    }
    fn position(&self) -> usize {
        self.fed.len()
    }
    fn read_layer(&self, layer: usize) -> Result<LayerKv> {
        let end = self.fed.len();
        let first = end - self.keep.unwrap_or(end).min(end);
        let (heads, dim) = (self.spec.n_kv_heads, self.spec.head_dim);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..heads {
            for p in first..end {
                let drift = |d: Option<(usize, usize, f32)>| match d {
                    Some((l, from, by)) if l == layer && p >= from => by,
                    _ => 0.0,
                };
                for i in 0..dim {
                    k.push(Self::value(self.fed[p], p, layer, h, i, 0) + drift(self.drift));
                    v.push(Self::value(self.fed[p], p, layer, h, i, 1) + drift(self.drift_v));
                }
            }
        }
        Ok(LayerKv {
            first_position: first,
            rows: end - first,
            n_kv_heads: heads,
            head_dim: dim,
            k,
            v,
        })
    }
    fn last_logits(&self) -> Option<&[f32]> {
        self.gap.map(|_| &self.logits[..])
    }
    fn top_k_capacity(&self) -> Option<usize> {
        self.gap.map(|_| 32)
    }
    fn last_top_k(&self, k: usize) -> Result<Option<TopK>> {
        Ok(self
            .last_logits()
            .filter(|l| k <= l.len())
            .map(|l| TopK::of_logits(l, k)))
    }
    fn name(&self) -> String {
        self.name.into()
    }
}

/// Ten tokens: the prefill graph's 8, then a chunk call.
const PROMPT: [i32; 10] = [1, 5, 9, 13, 17, 21, 25, 29, 2, 6];

fn run(mut a: Scripted, mut b: Scripted, max_new: usize) -> DivergeReport {
    lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(max_new)).unwrap()
}

#[test]
fn agreeing_backends_report_no_divergence_on_the_rows_both_hold() {
    let b = Scripted {
        keep: Some(3),
        ..Scripted::new("b")
    };
    let r = run(Scripted::new("a").with_gap(0.5), b, 6);
    assert_eq!((r.backend_a.as_str(), r.backend_b.as_str()), ("a", "b"));
    assert_eq!(r.prompt_tokens, 10);
    assert_eq!(r.steps.len(), 6);
    for (i, s) in r.steps.iter().enumerate() {
        assert_eq!((s.step, s.position), (i, 10 + i), "{s:?}");
        assert_eq!(s.token_a, s.token_b, "{s:?}");
        assert!((s.gap.unwrap() - 0.5).abs() < 1e-6, "{s:?}");
        assert_eq!(s.layers.len(), LAYERS);
        for l in &s.layers {
            assert_eq!(l.rows, 3, "compared beyond the common tail: {l:?}");
            assert!(l.within && l.k_abs == 0.0 && l.v_abs == 0.0, "{l:?}");
        }
    }
    // Each step's token is what the script predicts after the previous one.
    let mut last = *PROMPT.last().unwrap();
    for s in &r.steps {
        assert_eq!(s.token_a, Scripted::scripted(last, s.position));
        last = s.token_a;
    }
    assert_eq!(r.first_divergent_step, None);
    assert_eq!(r.divergence_at_near_tie, None);
    assert_eq!((r.divergent_steps, r.first_not_near_tie), (0, None));
    assert_eq!(r.first_layer_out_of_tolerance, None);
    assert_eq!((r.max_k_abs, r.max_v_abs), (0.0, 0.0));
    assert!(r.failures(true).is_empty(), "{:?}", r.failures(true));
    // b's token is a's top at every step.
    assert!(
        r.steps.iter().all(|s| s.below_top == Some(0.0) && s.rank == Some(0)),
        "{r:?}"
    );
    assert_eq!(r.steps[0].near_tie(0.02), None, "judged a step that does not diverge");
}

/// `b` predicts the token after the script's at position 13 (step 3), 1 below the oracle's top
/// whatever the oracle's own top-1/top-2 gap; the oracle `a` has the given gap.
fn swapped(gap_a: Option<f32>) -> DivergeReport {
    swapped_at(gap_a, vec![(13, Swap::By(1))], LockstepOptions::new(8))
}

fn swapped_at(gap_a: Option<f32>, swaps: Vec<(usize, Swap)>, options: LockstepOptions) -> DivergeReport {
    let mut a = Scripted {
        gap: gap_a,
        ..Scripted::new("a")
    };
    let mut b = Scripted {
        swaps,
        ..Scripted::new("b")
    };
    lockstep(&mut a, &mut b, &PROMPT, &options).unwrap()
}

#[test]
fn a_token_divergence_is_found_at_its_step_and_teacher_forcing_realigns() {
    let r = swapped(Some(0.5));
    assert_eq!(r.first_divergent_step, Some(3), "{r:?}");
    for s in &r.steps {
        if s.step == 3 {
            assert_eq!(s.token_b, (s.token_a + 1) % 32, "{s:?}");
        } else {
            assert_eq!(
                s.token_a, s.token_b,
                "after the divergence b was not fed a's token: {s:?}"
            );
        }
        // Fed a's tokens, b's cache stays a's: a divergence leaves no K/V trace.
        assert!(s.layers.iter().all(|l| l.within && l.k_abs == 0.0), "{s:?}");
    }
    assert_eq!(r.first_layer_out_of_tolerance, None);
}

#[test]
fn a_divergence_is_a_near_tie_only_where_the_chosen_token_is_near_the_top() {
    // b picks the oracle's second, 0.01 < NEAR_TIE_GAP (0.02) below its top: a near-tie.
    let r = swapped_at(Some(0.01), vec![(13, Swap::By(3))], LockstepOptions::new(8));
    let s = &r.steps[3];
    assert!(s.diverges());
    assert!((s.below_top.unwrap() - 0.01).abs() < 1e-6, "{s:?}");
    assert_eq!((s.rank, s.near_tie(0.02)), (Some(1), Some(true)), "{s:?}");
    assert_eq!(r.divergence_at_near_tie, Some(true), "{r:?}");
    assert_eq!((r.divergent_steps, r.first_not_near_tie), (1, None));
    assert!(r.failures(true).is_empty(), "{:?}", r.failures(true));

    // The oracle's own top two tie within 0.01, but b picks a token 1 below its top: not a
    // near-tie. The top-1/top-2 gap alone called this one a near-tie.
    let r = swapped(Some(0.01));
    let s = &r.steps[3];
    assert!((s.gap.unwrap() - 0.01).abs() < 1e-6, "{s:?}");
    assert_eq!((s.below_top, s.rank), (Some(1.0), Some(2)), "{s:?}");
    assert_eq!(r.divergence_at_near_tie, Some(false), "{r:?}");
    assert_eq!(r.first_not_near_tie, Some(3));
    let failures = r.failures(false);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].starts_with("step 3:") && failures[0].contains("rank 2"),
        "{failures:?}"
    );
    assert_eq!(swapped(Some(0.5)).divergence_at_near_tie, Some(false));

    // Without logits a divergence is found but not judged, and fails: nothing shows it is a
    // near-tie.
    let blind = swapped(None);
    assert_eq!(blind.first_divergent_step, Some(3));
    assert_eq!(blind.divergence_at_near_tie, None, "judged without logits");
    assert_eq!(blind.first_not_near_tie, None);
    assert!(blind
        .steps
        .iter()
        .all(|s| s.gap.is_none() && s.below_top.is_none() && s.rank.is_none()));
    let failures = blind.failures(false);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(failures[0].contains("neither backend has logits"), "{failures:?}");

    // Only b has logits: a's token is judged against them.
    let mut a = Scripted {
        swaps: vec![(13, Swap::By(3))],
        ..Scripted::new("a")
    };
    let mut b = Scripted::new("b").with_gap(0.01);
    let r = lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(8)).unwrap();
    assert_eq!(
        (r.steps[3].rank, r.divergence_at_near_tie),
        (Some(1), Some(true)),
        "{r:?}"
    );
    let mut a = Scripted {
        swaps: vec![(13, Swap::By(1))],
        ..Scripted::new("a")
    };
    let mut b = Scripted::new("b").with_gap(0.01);
    let r = lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(8)).unwrap();
    assert_eq!(
        (r.steps[3].rank, r.divergence_at_near_tie),
        (Some(2), Some(false)),
        "{r:?}"
    );

    // A custom threshold is the one applied, strictly: 0.5 below the top is not within 0.5.
    let options = |near_tie| LockstepOptions {
        near_tie,
        ..LockstepOptions::new(8)
    };
    let r = swapped_at(Some(0.01), vec![(13, Swap::By(3))], options(0.005));
    assert_eq!((r.near_tie_threshold, r.divergence_at_near_tie), (0.005, Some(false)));
    let r = swapped_at(Some(0.5), vec![(13, Swap::By(3))], options(0.5));
    assert_eq!(r.steps[3].below_top, Some(0.5));
    assert_eq!((r.divergence_at_near_tie, r.first_not_near_tie), (Some(false), Some(3)));
    assert_eq!(r.failures(false).len(), 1);
    let r = swapped_at(Some(0.25), vec![(13, Swap::By(3))], options(0.5));
    assert_eq!(r.divergence_at_near_tie, Some(true));
}

/// The bug a first-divergence judge misses: a near-tie first, a token far below the top later.
#[test]
fn every_divergent_step_is_judged_not_only_the_first() {
    let r = swapped_at(
        Some(0.01),
        vec![(13, Swap::By(3)), (14, Swap::By(3)), (16, Swap::By(1))],
        LockstepOptions::new(8),
    );
    assert_eq!(r.first_divergent_step, Some(3));
    assert_eq!(r.divergent_steps, 3);
    assert_eq!(
        r.steps
            .iter()
            .map(|s| s.near_tie(r.near_tie_threshold))
            .collect::<Vec<_>>(),
        [None, None, None, Some(true), Some(true), None, Some(false), None]
    );
    assert_eq!(r.divergence_at_near_tie, Some(false), "{r:?}");
    assert_eq!(r.first_not_near_tie, Some(6));
    let failures = r.failures(true);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(failures[0].starts_with("step 6:"), "{failures:?}");

    // Two far tokens: both named.
    let r = swapped_at(
        Some(0.01),
        vec![(13, Swap::By(1)), (16, Swap::By(1))],
        LockstepOptions::new(8),
    );
    assert_eq!(r.first_not_near_tie, Some(3));
    let failures = r.failures(true);
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(failures[1].starts_with("step 6:"), "{failures:?}");
}

#[test]
fn a_token_outside_the_oracle_s_logits_is_refused() {
    for bad in [32, -1] {
        let mut a = Scripted::new("a").with_gap(0.5);
        let mut b = Scripted {
            swaps: vec![(13, Swap::To(bad))],
            ..Scripted::new("b")
        };
        let err = lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(8)).unwrap_err();
        assert!(matches!(err, Error::Incomparable { op: "diverge", .. }), "{err}");
        assert!(
            err.to_string()
                .contains(&format!("token {bad} lies outside a's 32 logits")),
            "{err}"
        );
    }
}

/// `b`'s layer 2 K drifts by `by` from position 12, first held at position 13 (step 3).
fn drifted(by: f32) -> DivergeReport {
    let b = Scripted {
        drift: Some((2, 12, by)),
        ..Scripted::new("b")
    };
    run(Scripted::new("a").with_gap(0.5), b, 6)
}

#[test]
fn the_worst_layer_and_the_largest_v_difference_are_reported() {
    // K of layer 2 drifts by 0.05 from step 3, V of layer 1 by `v` from step 4.
    let report = |v: f32| {
        let b = Scripted {
            drift: Some((2, 12, 0.05)),
            drift_v: Some((1, 13, v)),
            ..Scripted::new("b")
        };
        run(Scripted::new("a").with_gap(0.5), b, 6)
    };
    let r = report(0.07);
    let calm = r.steps[2].worst_layer().unwrap();
    assert_eq!((calm.k_abs, calm.v_abs), (0.0, 0.0), "{calm:?}");
    assert_eq!(r.steps[3].worst_layer().unwrap().layer, 2, "{:?}", r.steps[3]);
    assert_eq!(
        r.steps[4].worst_layer().unwrap().layer,
        1,
        "V 0.07 > K 0.05: {:?}",
        r.steps[4]
    );
    assert!((r.steps[4].max_v_abs() - 0.07).abs() < 1e-6);
    assert!((r.steps[4].max_k_abs() - 0.05).abs() < 1e-6);
    assert_eq!((r.steps[3].max_v_abs(), r.steps[2].max_k_abs()), (0.0, 0.0));
    assert!(
        (r.max_v_abs - 0.07).abs() < 1e-6 && (r.max_k_abs - 0.05).abs() < 1e-6,
        "{r:?}"
    );
    assert!(r.steps[4].layers[1].v_rel > 0.0 && r.steps[4].layers[1].k_abs == 0.0);
    assert_eq!(r.first_layer_out_of_tolerance, Some([3, 2]));
    let r = report(0.03);
    assert_eq!(
        r.steps[4].worst_layer().unwrap().layer,
        2,
        "K 0.05 > V 0.03: {:?}",
        r.steps[4]
    );
    let mut a = Scripted::new("a");
    a.spec = spec(0);
    let mut b = Scripted::new("b");
    b.spec = spec(0);
    let r = lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(2)).unwrap();
    assert_eq!(r.steps[0].worst_layer(), None, "no layers");
}

#[test]
fn kv_drift_past_the_tolerance_is_found_at_its_layer_and_step() {
    let r = drifted(0.05);
    assert_eq!(r.first_layer_out_of_tolerance, Some([3, 2]), "{r:?}");
    assert_eq!(r.first_divergent_step, None, "K drift changed no token");
    for s in &r.steps {
        for l in &s.layers {
            let drifted = l.layer == 2 && s.step >= 3;
            assert_eq!(l.within, !drifted, "{s:?}");
            assert_eq!(l.v_abs, 0.0);
            if drifted {
                assert!((l.k_abs - 0.05).abs() < 1e-6, "{l:?}");
                assert!(l.k_rel > 0.0);
            } else {
                assert_eq!(l.k_abs, 0.0, "{l:?}");
            }
        }
    }
    assert!((r.max_k_abs - 0.05).abs() < 1e-6);

    // Out of tolerance fails where the caller asserts the layers.
    let failures = r.failures(true);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(failures[0].starts_with("layer 2 at step 3:"), "{failures:?}");
    assert!(r.failures(false).is_empty());

    // Below the tolerance (abs 2e-3) the drift is measured but not flagged.
    let r = drifted(1e-3);
    assert_eq!(r.first_layer_out_of_tolerance, None, "{r:?}");
    assert!(r.failures(true).is_empty());
    assert!((r.max_k_abs - 1e-3).abs() < 1e-6, "{}", r.max_k_abs);
    assert_eq!((r.tolerance_abs, r.tolerance_rel), (2e-3, 2e-3));
}

#[test]
fn a_stop_token_of_the_first_backend_ends_the_run_at_its_step() {
    let full = run(Scripted::new("a"), Scripted::new("b"), 8);
    let stop = full.steps[4].token_a;
    assert!(full.steps[..4].iter().all(|s| s.token_a != stop), "pick another step");
    let (mut a, mut b) = (Scripted::new("a"), Scripted::new("b"));
    let options = LockstepOptions {
        stops: vec![stop],
        ..LockstepOptions::new(8)
    };
    let r = lockstep(&mut a, &mut b, &PROMPT, &options).unwrap();
    assert_eq!(r.steps, full.steps[..5]);
    assert_eq!(a.position(), 14, "a step was made after the stop token");

    // max_new 0 and 1 both report the token after the prompt and make no step.
    for max_new in [0, 1] {
        let (mut a, mut b) = (Scripted::new("a"), Scripted::new("b"));
        let r = lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(max_new)).unwrap();
        assert_eq!(r.steps.len(), 1);
        assert_eq!((a.position(), b.position()), (10, 10));
    }
}

#[test]
fn backends_of_different_models_are_refused_before_any_call() {
    let mut a = Scripted::new("a");
    let mut b = Scripted {
        spec: spec(LAYERS + 1),
        ..Scripted::new("b")
    };
    let err = lockstep(&mut a, &mut b, &PROMPT, &LockstepOptions::new(4)).unwrap_err();
    assert!(matches!(err, Error::Incomparable { .. }), "{err}");
    assert!(err.to_string().contains("different models"), "{err}");
    assert_eq!((a.position(), b.position()), (0, 0));
}

#[test]
fn a_bad_prompt_is_the_backend_s_error() {
    let (mut a, mut b) = (Scripted::new("a"), Scripted::new("b"));
    let err = lockstep(&mut a, &mut b, &[1, 99], &LockstepOptions::new(4)).unwrap_err();
    assert!(matches!(err, Error::TokenOutOfRange { id: 99, .. }), "{err}");
}

#[test]
fn top_gap_is_first_minus_second() {
    assert_eq!(top_gap(&[1.0, 3.0, 2.5]), Some(0.5));
    assert_eq!(top_gap(&[2.0, 2.0, 1.0]), Some(0.0), "a tie has gap 0");
    assert_eq!(top_gap(&[4.0]), None);
    assert_eq!(top_gap(&[]), None);
    assert_eq!(top_gap(&[-1.0, -3.0]), Some(2.0));
}

#[test]
fn below_top_is_the_distance_from_the_top_and_the_rank() {
    let logits = [1.0, 3.0, 2.5, 3.0, -1.0];
    assert_eq!(below_top(&logits, 1), Some((0.0, 0)));
    assert_eq!(below_top(&logits, 3), Some((0.0, 0)), "a tie for the top ranks 0");
    assert_eq!(below_top(&logits, 2), Some((0.5, 2)));
    assert_eq!(below_top(&logits, 0), Some((2.0, 3)));
    assert_eq!(below_top(&logits, 4), Some((4.0, 4)));
    assert_eq!(below_top(&[-2.0, -5.0], 1), Some((3.0, 1)), "all logits negative");
    assert_eq!(below_top(&logits, 5), None);
    assert_eq!(below_top(&logits, -1), None);
}

fn sampling(seed: u64) -> SamplingConfig {
    SamplingConfig {
        temperature: 0.7,
        seed,
        candidates: 8,
        ..SamplingConfig::default()
    }
}

/// Seeded sampling in lockstep: one draw of the seed's stream per step, both fed a's pick.
#[test]
fn sampled_lockstep_draws_the_seed_s_stream_and_teacher_forces() {
    let config = sampling(5);
    let (mut a, mut b) = (Scripted::new("a").with_gap(0.01), Scripted::new("b").with_gap(0.3));
    let steps = sampled_lockstep(&mut a, &mut b, &PROMPT, &config, 6, &[]).unwrap();
    assert_eq!(steps.len(), 6);
    let mut stream = Sampler::new(config.clone()).unwrap();
    for (i, s) in steps.iter().enumerate() {
        assert_eq!((s.step, s.draw.u), (i, stream.draw()), "{s:?}");
        // The two share every candidate's logit but the second's: 1 - 0.01 against 1 - 0.3.
        assert!((s.max_logit_diff - 0.29).abs() < 1e-6, "{s:?}");
    }
    // Six draws, five steps after the prompt: none after the last draw.
    assert_eq!((a.position(), b.position()), (PROMPT.len() + 5, PROMPT.len() + 5));
    assert_eq!(a.fed, b.fed, "b was not fed a's picks");
    let picks: Vec<i32> = steps.iter().map(|s| s.draw.token_a).collect();
    assert_eq!(&a.fed[PROMPT.len()..], &picks[..5]);

    // Against itself: the same picks, nothing to explain.
    let (mut a, mut b) = (Scripted::new("a").with_gap(0.3), Scripted::new("b").with_gap(0.3));
    let same = sampled_lockstep(&mut a, &mut b, &PROMPT, &config, 6, &[]).unwrap();
    assert!(same
        .iter()
        .all(|s| s.draw.token_a == s.draw.token_b && s.max_logit_diff == 0.0));

    // A stop token of a ends the run at its draw.
    let stop = same[2].draw.token_a;
    assert!(same[..2].iter().all(|s| s.draw.token_a != stop), "pick another seed");
    let (mut a, mut b) = (Scripted::new("a").with_gap(0.3), Scripted::new("b").with_gap(0.3));
    let stopped = sampled_lockstep(&mut a, &mut b, &PROMPT, &config, 6, &[stop]).unwrap();
    assert_eq!(stopped, same[..3]);
    assert_eq!(a.position(), PROMPT.len() + 2, "a step was made after the stop token");
}

#[test]
fn sampled_lockstep_refuses_other_models_and_backends_without_candidates() {
    let config = sampling(1);
    let mut a = Scripted::new("a").with_gap(0.3);
    let mut b = Scripted {
        spec: spec(LAYERS + 1),
        ..Scripted::new("b").with_gap(0.3)
    };
    let err = sampled_lockstep(&mut a, &mut b, &PROMPT, &config, 4, &[]).unwrap_err();
    assert!(matches!(err, Error::Incomparable { op: "diverge", .. }), "{err}");
    assert_eq!((a.position(), b.position()), (0, 0));

    let (mut a, mut b) = (Scripted::new("a").with_gap(0.3), Scripted::new("b"));
    let err = sampled_lockstep(&mut a, &mut b, &PROMPT, &config, 4, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::NoTopK { backend, needed: 8, available: None } if backend == "b"),
        "{err}"
    );
}
