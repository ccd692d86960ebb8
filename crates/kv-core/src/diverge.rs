//! Two backends in lockstep on one context, to find where they part ways (`skainet-kv diverge`).
//!
//! After the prompt both backends are fed the FIRST backend's token at every step (teacher
//! forcing): a differing token then does not change what the later steps compare, so one report
//! shows every step at which the second backend would pick another token and how far each
//! layer's K/V has drifted, not just the first difference and its consequences.
//!
//! Every differing token is judged, at every step, by the logits of whichever backend exposes
//! them (the reference): by how far the OTHER backend's token sits below the reference's top
//! logit ([`Step::below_top`]). Below [`NEAR_TIE_GAP`] it is a near-tie, which reordered f32
//! arithmetic can flip without either backend being wrong; further down it is a defect, however
//! closely the reference's own top two tie (a near-tie of the reference's first and second
//! tokens says nothing about a pick of its tenth). K/V are compared on the rows both backends
//! hold (a sliding layer may keep a different tail) against a [`Tolerance`].
//! [`DivergeReport::failures`] is the verdict the CLI's exit status and the tests share.

use serde::Serialize;

use crate::backend::KvBackend;
use crate::decoder::feed_prompt;
use crate::error::{Error, Result};
use crate::tolerance::{max_diff, Tolerance};

/// A differing token whose reference logit lies less than this below the reference's top logit
/// is a near-tie: the distance is within what the compiled kernels' reordered f32 arithmetic
/// moves the logits by (docs/benchmarks.md, "Divergence"), so either backend may rank the two
/// tokens first. Strictly below: a token exactly this far down is not a near-tie.
pub const NEAR_TIE_GAP: f32 = 2e-2;

/// What a lockstep run compares and for how long.
#[derive(Clone, Debug, PartialEq)]
pub struct LockstepOptions {
    /// Tokens of the first backend that end the run (the step that predicts one is reported).
    pub stops: Vec<i32>,
    /// Steps to report, counting the token predicted after the prompt; at least one is.
    pub max_new: usize,
    /// A differing token less than this below the reference's top logit is a near-tie.
    pub near_tie: f32,
    /// The bound each layer's K/V must stay within.
    pub tolerance: Tolerance,
}

impl LockstepOptions {
    /// `max_new` steps, no stop tokens, [`NEAR_TIE_GAP`] and [`Tolerance::CROSS_BACKEND`].
    pub fn new(max_new: usize) -> Self {
        LockstepOptions {
            stops: Vec::new(),
            max_new,
            near_tie: NEAR_TIE_GAP,
            tolerance: Tolerance::CROSS_BACKEND,
        }
    }
}

/// One layer's K/V difference on the rows both backends hold.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct LayerDiff {
    pub layer: usize,
    pub rows: usize,
    pub k_abs: f32,
    pub k_rel: f32,
    pub v_abs: f32,
    pub v_rel: f32,
    /// Every element within the run's tolerance.
    pub within: bool,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Step {
    pub step: usize,
    /// Tokens in the context when this step's token was predicted.
    pub position: usize,
    pub token_a: i32,
    pub token_b: i32,
    /// Top-1 minus top-2 logit (of the backend with logits), if any has them.
    pub gap: Option<f32>,
    /// How far the other backend's token sits below the top logit of the backend with logits:
    /// its top logit minus its logit of that token (0 where the other picked its top). The
    /// backend with logits is `a` where it has them (then the other token is `token_b`), else
    /// `b` (then it is `token_a`). What a divergent step is judged by.
    pub below_top: Option<f32>,
    /// That token's rank among the logits: how many tokens score strictly higher (0: the top).
    pub rank: Option<usize>,
    pub layers: Vec<LayerDiff>,
}

impl Step {
    pub fn diverges(&self) -> bool {
        self.token_a != self.token_b
    }

    /// For a divergent step with logits: whether the other backend's token lies less than
    /// `threshold` below the reference's top logit. `None` where the tokens agree or no backend
    /// has logits.
    pub fn near_tie(&self, threshold: f32) -> Option<bool> {
        if !self.diverges() {
            return None;
        }
        self.below_top.map(|d| d < threshold)
    }

    /// The layer with the largest K or V difference.
    pub fn worst_layer(&self) -> Option<&LayerDiff> {
        self.layers
            .iter()
            .max_by(|x, y| x.k_abs.max(x.v_abs).total_cmp(&y.k_abs.max(y.v_abs)))
    }

    pub fn max_k_abs(&self) -> f32 {
        self.layers.iter().map(|l| l.k_abs).fold(0.0, f32::max)
    }

    pub fn max_v_abs(&self) -> f32 {
        self.layers.iter().map(|l| l.v_abs).fold(0.0, f32::max)
    }
}

/// The whole run; the field names are the CLI's `--json` keys.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct DivergeReport {
    pub backend_a: String,
    pub backend_b: String,
    pub prompt_tokens: usize,
    pub near_tie_threshold: f32,
    pub tolerance_abs: f32,
    pub tolerance_rel: f32,
    pub steps: Vec<Step>,
    /// The first step whose tokens differ.
    pub first_divergent_step: Option<usize>,
    /// `[step, layer]` of the first layer whose K/V leaves the tolerance.
    pub first_layer_out_of_tolerance: Option<[usize; 2]>,
    /// Whether EVERY divergent step is a near-tie ([`Step::near_tie`]): `Some(false)` as soon
    /// as one is not, at any step; `None` with no divergence or no logits to judge it by.
    pub divergence_at_near_tie: Option<bool>,
    /// How many steps' tokens differ.
    pub divergent_steps: usize,
    /// The first divergent step that is not a near-tie.
    pub first_not_near_tie: Option<usize>,
    pub max_k_abs: f32,
    pub max_v_abs: f32,
}

impl DivergeReport {
    /// Why the run fails, one line each; empty: it passes. A divergent step fails unless it is
    /// a near-tie, and one that cannot be judged (no backend has logits) fails too: nothing shows
    /// it is one. With `check_layers` a layer out of tolerance fails as well; the caller passes
    /// `false` only where the two backends are known to round differently (an FP32 reference
    /// against bf16 matmul inputs or f16 caches), so their K/V differ by more than the tolerance
    /// without either being wrong.
    pub fn failures(&self, check_layers: bool) -> Vec<String> {
        let mut out = Vec::new();
        for s in self.steps.iter().filter(|s| s.diverges()) {
            match (s.near_tie(self.near_tie_threshold), s.below_top, s.rank) {
                (Some(true), ..) => {}
                (Some(false), Some(below), Some(rank)) => out.push(format!(
                    "step {}: {} chose {} and {} chose {}, {below:e} below the reference's top logit (rank {rank}), \
                     not a near-tie (< {:e})",
                    s.step, self.backend_a, s.token_a, self.backend_b, s.token_b, self.near_tie_threshold
                )),
                _ => out.push(format!(
                    "step {}: {} chose {} and {} chose {}, and neither backend has logits to judge it by",
                    s.step, self.backend_a, s.token_a, self.backend_b, s.token_b
                )),
            }
        }
        if let (true, Some([step, layer])) = (check_layers, self.first_layer_out_of_tolerance) {
            out.push(format!(
                "layer {layer} at step {step}: K/V outside the tolerance (abs {:e}, rel {:e})",
                self.tolerance_abs, self.tolerance_rel
            ));
        }
        out
    }
}

/// Top-1 minus top-2 of `logits` (0 for a tie); `None` for fewer than two.
pub fn top_gap(logits: &[f32]) -> Option<f32> {
    if logits.len() < 2 {
        return None;
    }
    let mut sorted = logits.to_vec();
    sorted.sort_unstable_by(|x, y| y.total_cmp(x));
    Some(sorted[0] - sorted[1])
}

/// How far `token` sits below the top of `logits` (top minus its logit) and its rank (how many
/// logits are strictly larger); `None` where `token` indexes no logit.
pub fn below_top(logits: &[f32], token: i32) -> Option<(f32, usize)> {
    let x = *logits.get(usize::try_from(token).ok()?)?;
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    Some((top - x, logits.iter().filter(|&&y| y > x).count()))
}

/// Every layer's K/V difference between `a` and `b` at their current position.
pub fn layer_diffs<A: KvBackend, B: KvBackend>(a: &A, b: &B, tol: Tolerance) -> Result<Vec<LayerDiff>> {
    (0..a.spec().n_layers)
        .map(|layer| {
            let (la, lb) = (a.read_layer(layer)?, b.read_layer(layer)?);
            let (end_a, end_b) = (la.first_position + la.rows, lb.first_position + lb.rows);
            let from = la.first_position.max(lb.first_position);
            // Both backends are at the same position, so both hold rows up to it.
            if end_a != end_b {
                return Err(incomparable(format!(
                    "layer {layer}: {} holds positions {}..{end_a}, {} holds {}..{end_b}",
                    a.name(),
                    la.first_position,
                    b.name(),
                    lb.first_position
                )));
            }
            if (la.n_kv_heads, la.head_dim) != (lb.n_kv_heads, lb.head_dim) {
                return Err(incomparable(format!("layer {layer}: the backends' K/V shapes differ")));
            }
            let (ta, tb) = (la.tail_from(from), lb.tail_from(from));
            let (k_abs, k_rel) = max_diff(&ta.k, &tb.k);
            let (v_abs, v_rel) = max_diff(&ta.v, &tb.v);
            let within = tol.mismatches(&ta.k, &tb.k, 1).is_empty() && tol.mismatches(&ta.v, &tb.v, 1).is_empty();
            Ok(LayerDiff {
                layer,
                rows: end_a - from,
                k_abs,
                k_rel,
                v_abs,
                v_rel,
                within,
            })
        })
        .collect()
}

fn incomparable(reason: String) -> Error {
    Error::Incomparable { op: "diverge", reason }
}

/// Runs `a` and `b` in lockstep: the prompt, then up to `max_new - 1` steps, both fed `a`'s
/// tokens. Two backends of different models are refused before either is called.
pub fn lockstep<A: KvBackend, B: KvBackend>(
    a: &mut A,
    b: &mut B,
    prompt: &[i32],
    options: &LockstepOptions,
) -> Result<DivergeReport> {
    let (sa, sb) = (a.spec(), b.spec());
    if (sa.n_layers, sa.vocab_size) != (sb.n_layers, sb.vocab_size) {
        return Err(incomparable(format!(
            "{} has {} layers and {} tokens, {} has {} and {}: different models",
            a.name(),
            sa.n_layers,
            sa.vocab_size,
            b.name(),
            sb.n_layers,
            sb.vocab_size
        )));
    }
    let (mut ta, mut tb) = (feed_prompt(a, prompt)?, feed_prompt(b, prompt)?);
    let mut steps = Vec::new();
    for step in 0.. {
        // The reference judges the other backend's token.
        let judged = match (a.last_logits(), b.last_logits()) {
            (Some(logits), _) => Some((logits, tb, a.name())),
            (None, Some(logits)) => Some((logits, ta, b.name())),
            (None, None) => None,
        };
        let (below, rank) = match judged {
            Some((logits, token, ref holder)) => {
                let Some((below, rank)) = below_top(logits, token) else {
                    return Err(incomparable(format!(
                        "step {step}: token {token} lies outside {holder}'s {} logits",
                        logits.len()
                    )));
                };
                (Some(below), Some(rank))
            }
            None => (None, None),
        };
        steps.push(Step {
            step,
            position: a.position(),
            token_a: ta,
            token_b: tb,
            gap: judged.and_then(|(logits, ..)| top_gap(logits)),
            below_top: below,
            rank,
            layers: layer_diffs(a, b, options.tolerance)?,
        });
        if step + 1 >= options.max_new || options.stops.contains(&ta) {
            break;
        }
        let teacher = ta;
        ta = a.step(teacher)?;
        tb = b.step(teacher)?;
    }
    let first_divergent_step = steps.iter().position(Step::diverges);
    let steps_diverging = steps.iter().filter(|s| s.diverges()).count();
    let first_layer_out_of_tolerance = steps
        .iter()
        .find_map(|s| s.layers.iter().find(|l| !l.within).map(|l| [s.step, l.layer]));
    let first_not_near_tie = steps
        .iter()
        .find(|s| s.near_tie(options.near_tie) == Some(false))
        .map(|s| s.step);
    let divergence_at_near_tie = first_divergent_step
        .and_then(|i| steps[i].below_top)
        .map(|_| first_not_near_tie.is_none());
    Ok(DivergeReport {
        backend_a: a.name(),
        backend_b: b.name(),
        prompt_tokens: prompt.len(),
        near_tie_threshold: options.near_tie,
        tolerance_abs: options.tolerance.abs,
        tolerance_rel: options.tolerance.rel,
        max_k_abs: steps.iter().map(Step::max_k_abs).fold(0.0, f32::max),
        max_v_abs: steps.iter().map(Step::max_v_abs).fold(0.0, f32::max),
        steps,
        first_divergent_step,
        first_layer_out_of_tolerance,
        divergence_at_near_tie,
        divergent_steps: steps_diverging,
        first_not_near_tie,
    })
}

/// One draw of [`sampled_lockstep`].
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct SampledStep {
    pub step: usize,
    pub draw: crate::sampling::DrawAgreement,
    /// The largest difference between the two backends' logits of a candidate both returned.
    pub max_logit_diff: f32,
}

/// Seeded sampling on `a` and `b` in lockstep: after the prompt, each step draws once from the
/// shared stream of `config`'s seed, picks a token from each backend's candidates with that draw,
/// and feeds both `a`'s token (teacher forcing), up to `max_new` draws or a stop token of `a`.
/// Both backends must return candidates (`KvBackend::last_top_k`). Whether every step is
/// [`DrawAgreement::explained`](crate::sampling::DrawAgreement::explained) is the cross-backend
/// claim of seeded sampling.
pub fn sampled_lockstep<A: KvBackend, B: KvBackend>(
    a: &mut A,
    b: &mut B,
    prompt: &[i32],
    config: &crate::sampling::SamplingConfig,
    max_new: usize,
    stops: &[i32],
) -> Result<Vec<SampledStep>> {
    use crate::sampling::{distribution, DrawAgreement, Sampler};
    if (a.spec().n_layers, a.spec().vocab_size) != (b.spec().n_layers, b.spec().vocab_size) {
        return Err(incomparable(format!("{} and {}: different models", a.name(), b.name())));
    }
    let mut sampler = Sampler::new(config.clone())?;
    feed_prompt(a, prompt)?;
    feed_prompt(b, prompt)?;
    let mut history = prompt.to_vec();
    let mut steps = Vec::new();
    for step in 0..max_new {
        let (ka, kb) = (candidates(a, config.candidates)?, candidates(b, config.candidates)?);
        let max_logit_diff = ka
            .ids()
            .iter()
            .zip(ka.logits())
            .filter_map(|(id, la)| {
                let j = kb.ids().iter().position(|x| x == id)?;
                Some((la - kb.logits()[j]).abs())
            })
            .fold(0.0, f32::max);
        let u = sampler.draw();
        let (pa, pb) = (distribution(config, &ka, &history), distribution(config, &kb, &history));
        let Some(draw) = DrawAgreement::of(&pa, &pb, u) else {
            return Err(incomparable("a backend returned no candidates".into()));
        };
        let teacher = draw.token_a;
        steps.push(SampledStep {
            step,
            draw,
            max_logit_diff,
        });
        if step + 1 == max_new || stops.contains(&teacher) {
            break;
        }
        history.push(teacher);
        a.step(teacher)?;
        b.step(teacher)?;
    }
    Ok(steps)
}

fn candidates<B: KvBackend>(backend: &B, k: usize) -> Result<crate::sampling::TopK> {
    backend.last_top_k(k)?.ok_or_else(|| Error::NoTopK {
        backend: backend.name(),
        needed: k,
        available: backend.top_k_capacity(),
    })
}
