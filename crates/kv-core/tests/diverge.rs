//! `diverge::lockstep` against scripted fake backends: one that agrees, one whose token differs
//! at a known position (near-tie or not, by the oracle's logit gap), one whose K drifts past the
//! tolerance from a known position in one layer. The CLI's tests run the same library on the
//! reference and IREE, where nothing diverges.

use kv_core::diverge::{lockstep, top_gap, DivergeReport, LockstepOptions};
use kv_core::{Error, KvBackend, KvSpec, LayerKv, Result};

/// Predicts a function of the last token and the position, and holds K/V rows that are a
/// function of (token, position, layer, head, index); each deviation is switched on by a field.
struct Scripted {
    spec: KvSpec,
    name: &'static str,
    fed: Vec<i32>,
    /// Rows `read_layer` hands over, counted back from the position (a sliding layer's tail).
    keep: Option<usize>,
    /// The position whose prediction is the scripted token + 1.
    swap_at: Option<usize>,
    /// `(layer, first position, amount)` added to that layer's K rows from that position on.
    drift: Option<(usize, usize, f32)>,
    /// With logits: the top-1/top-2 gap of every call.
    gap: Option<f32>,
    logits: Vec<f32>,
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
            swap_at: None,
            drift: None,
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
        let mut token = Self::scripted(*self.fed.last().unwrap(), p);
        if self.swap_at == Some(p) {
            token = (token + 1) % 32;
        }
        if let Some(gap) = self.gap {
            self.logits = vec![0.0; 32];
            self.logits[token as usize] = 1.0;
            self.logits[(token as usize + 3) % 32] = 1.0 - gap;
        }
        Ok(token)
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
                let drift = match self.drift {
                    Some((l, from, by)) if l == layer && p >= from => by,
                    _ => 0.0,
                };
                for i in 0..dim {
                    k.push(Self::value(self.fed[p], p, layer, h, i, 0) + drift);
                    v.push(Self::value(self.fed[p], p, layer, h, i, 1));
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
    assert_eq!(r.first_layer_out_of_tolerance, None);
    assert_eq!((r.max_k_abs, r.max_v_abs), (0.0, 0.0));
}

/// `b` predicts another token at position 13 (step 3); the oracle `a` has the given gap.
fn swapped(gap_a: Option<f32>) -> DivergeReport {
    let a = Scripted {
        gap: gap_a,
        ..Scripted::new("a")
    };
    let b = Scripted {
        swap_at: Some(13),
        ..Scripted::new("b")
    };
    run(a, b, 8)
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
fn a_divergence_is_a_near_tie_only_below_the_threshold() {
    // 0.01 < NEAR_TIE_GAP (0.02) < 0.5
    assert_eq!(swapped(Some(0.01)).divergence_at_near_tie, Some(true));
    assert_eq!(swapped(Some(0.5)).divergence_at_near_tie, Some(false));
    let blind = swapped(None);
    assert_eq!(blind.first_divergent_step, Some(3));
    assert_eq!(blind.divergence_at_near_tie, None, "judged without logits");
    assert!(blind.steps.iter().all(|s| s.gap.is_none()));

    // The gap may come from the second backend when only it has logits.
    let b = Scripted {
        swap_at: Some(13),
        ..Scripted::new("b").with_gap(0.01)
    };
    let r = run(Scripted::new("a"), b, 8);
    assert_eq!(r.divergence_at_near_tie, Some(true));

    // A custom threshold is the one applied.
    let mut a = Scripted::new("a").with_gap(0.01);
    let mut b = Scripted {
        swap_at: Some(13),
        ..Scripted::new("b")
    };
    let options = LockstepOptions {
        near_tie: 0.005,
        ..LockstepOptions::new(8)
    };
    let r = lockstep(&mut a, &mut b, &PROMPT, &options).unwrap();
    assert_eq!((r.near_tie_threshold, r.divergence_at_near_tie), (0.005, Some(false)));
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

    // Below the tolerance (abs 2e-3) the drift is measured but not flagged.
    let r = drifted(1e-3);
    assert_eq!(r.first_layer_out_of_tolerance, None, "{r:?}");
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
}
