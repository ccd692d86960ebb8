//! `skainet-kv diverge`: two backends in lockstep on the same context. After the prompt, both
//! are fed the FIRST backend's token at every step (teacher forcing), so a divergence does not
//! change what later steps compare. Per step: both tokens, the top-1/top-2 logit gap of whichever
//! backend exposes logits (the reference), and per layer the largest K/V difference on the rows
//! both hold.

use anyhow::{bail, Context, Result};
use clap::Args;
use kv_core::decoder::feed_prompt;
use kv_core::tolerance::{max_diff, Tolerance};
use kv_core::KvBackend;
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::text::PromptArgs;

/// Below this top-1/top-2 logit gap of the reference a differing token is a near-tie: the
/// gap is within what the compiled kernels' reordered f32 arithmetic moves the logits by
/// (docs/benchmarks.md, "Divergence").
pub const NEAR_TIE_GAP: f32 = 2e-2;

#[derive(Args)]
pub struct DivergeArgs {
    #[arg(long)]
    model: String,
    /// Two backends, the first one the oracle whose tokens drive both (`reference,iree-cpu`).
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1, required = true)]
    backends: Vec<BackendChoice>,
    /// Exported artifacts for the IREE backend (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    /// A gap below this is reported as a near-tie.
    #[arg(long, default_value_t = NEAR_TIE_GAP)]
    near_tie: f32,
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Clone)]
pub struct LayerDiff {
    pub layer: usize,
    pub rows: usize,
    pub k_abs: f32,
    pub k_rel: f32,
    pub v_abs: f32,
    pub v_rel: f32,
    /// Every element within `Tolerance::CROSS_BACKEND`.
    pub within: bool,
}

#[derive(Serialize)]
pub struct Step {
    pub step: usize,
    /// Tokens in the context when this step's token was predicted.
    pub position: usize,
    pub token_a: i32,
    pub token_b: i32,
    /// Top-1 minus top-2 logit (of the backend with logits), if any has them.
    pub gap: Option<f32>,
    pub layers: Vec<LayerDiff>,
}

#[derive(Serialize)]
pub struct DivergeReport {
    pub model: String,
    pub backend_a: String,
    pub backend_b: String,
    pub prompt_tokens: usize,
    pub near_tie_threshold: f32,
    pub tolerance_abs: f32,
    pub tolerance_rel: f32,
    pub steps: Vec<Step>,
    /// The first step whose tokens differ.
    pub first_divergent_step: Option<usize>,
    /// `[step, layer]` of the first layer whose K/V leaves `Tolerance::CROSS_BACKEND`.
    pub first_layer_out_of_tolerance: Option<[usize; 2]>,
    /// Whether the first divergence has a gap below the threshold (None: no divergence or no logits).
    pub divergence_at_near_tie: Option<bool>,
    pub max_k_abs: f32,
    pub max_v_abs: f32,
}

fn top_gap(logits: &[f32]) -> Option<f32> {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > first {
            second = first;
            first = x;
        } else if x > second {
            second = x;
        }
    }
    (logits.len() >= 2).then_some(first - second)
}

fn layer_diffs<A: KvBackend, B: KvBackend>(a: &A, b: &B) -> Result<Vec<LayerDiff>> {
    let tol = Tolerance::CROSS_BACKEND;
    (0..a.spec().n_layers)
        .map(|layer| {
            let (la, lb) = (a.read_layer(layer)?, b.read_layer(layer)?);
            let from = la.first_position.max(lb.first_position);
            let end = (la.first_position + la.rows).min(lb.first_position + lb.rows);
            if from > end {
                bail!("layer {layer}: the backends hold disjoint rows");
            }
            let (ta, tb) = (la.tail_from(from), lb.tail_from(from));
            let n = (end - from) * ta.n_kv_heads * ta.head_dim;
            // Both tails end at the current position, so equal lengths; compare the common head.
            let (ka, kb, va, vb) = (&ta.k[..n], &tb.k[..n], &ta.v[..n], &tb.v[..n]);
            let (k_abs, k_rel) = max_diff(ka, kb);
            let (v_abs, v_rel) = max_diff(va, vb);
            let within = tol.mismatches(ka, kb, 1).is_empty() && tol.mismatches(va, vb, 1).is_empty();
            Ok(LayerDiff {
                layer,
                rows: end - from,
                k_abs,
                k_rel,
                v_abs,
                v_rel,
                within,
            })
        })
        .collect()
}

/// Runs `a` and `b` in lockstep: the prompt, then `max_new - 1` steps fed `a`'s tokens.
pub fn lockstep<A: KvBackend, B: KvBackend>(
    a: &mut A,
    b: &mut B,
    prompt: &[i32],
    stops: &[i32],
    max_new: usize,
    near_tie: f32,
) -> Result<DivergeReport> {
    if a.spec().n_layers != b.spec().n_layers || a.spec().vocab_size != b.spec().vocab_size {
        bail!("the two backends run different models");
    }
    let (mut ta, mut tb) = (
        feed_prompt(a, prompt).context("prefilling the prompt")?,
        feed_prompt(b, prompt).context("prefilling the prompt")?,
    );
    let mut steps = Vec::new();
    for step in 0..max_new.max(1) {
        let gap = a.last_logits().or(b.last_logits()).and_then(top_gap);
        steps.push(Step {
            step,
            position: a.position(),
            token_a: ta,
            token_b: tb,
            gap,
            layers: layer_diffs(a, b)?,
        });
        if step + 1 == max_new || stops.contains(&ta) {
            break;
        }
        let next = ta;
        ta = a.step(next)?;
        tb = b.step(next)?;
    }
    let first_divergent_step = steps.iter().find(|s| s.token_a != s.token_b).map(|s| s.step);
    let first_layer_out_of_tolerance = steps
        .iter()
        .find_map(|s| s.layers.iter().find(|l| !l.within).map(|l| [s.step, l.layer]));
    let divergence_at_near_tie = first_divergent_step.and_then(|i| steps[i].gap.map(|g| g < near_tie));
    let all = steps.iter().flat_map(|s| s.layers.iter());
    let max_k_abs = all.clone().map(|l| l.k_abs).fold(0.0, f32::max);
    let max_v_abs = all.map(|l| l.v_abs).fold(0.0, f32::max);
    Ok(DivergeReport {
        model: String::new(),
        backend_a: a.name(),
        backend_b: b.name(),
        prompt_tokens: prompt.len(),
        near_tie_threshold: near_tie,
        tolerance_abs: Tolerance::CROSS_BACKEND.abs,
        tolerance_rel: Tolerance::CROSS_BACKEND.rel,
        steps,
        first_divergent_step,
        first_layer_out_of_tolerance,
        divergence_at_near_tie,
        max_k_abs,
        max_v_abs,
    })
}

pub fn run(args: DivergeArgs) -> Result<()> {
    let [first, second] = args.backends[..] else {
        bail!("--backends: give exactly two, e.g. reference,iree-cpu");
    };
    let prompt = args.prompt.resolve(&args.model)?;
    let stops = prompt.stops(None);
    let source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let (a, _) = backends::open_kv(first, &source, args.window_rule)?;
    let (b, _) = backends::open_kv(second, &source, args.window_rule)?;
    let mut report = crate::with_backend!(a, a => {
        let mut a = a;
        crate::with_backend!(b, b => {
            let mut b = b;
            lockstep(&mut a, &mut b, &prompt.ids, &stops, args.max_new, args.near_tie)?
        })
    });
    report.model = args.model.clone();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let r = &report;
    println!(
        "skainet-kv diverge: {} on {} vs {} ({} prompt tokens; tolerance abs {} rel {}; near-tie gap < {})",
        r.model, r.backend_a, r.backend_b, r.prompt_tokens, r.tolerance_abs, r.tolerance_rel, r.near_tie_threshold
    );
    println!(
        "  {:>4} {:>5} {:>8} {:>8} {:>9} {:>10} {:>10}  worst layer",
        "step", "pos", "a", "b", "gap", "max K abs", "max V abs"
    );
    for s in &r.steps {
        let worst = s
            .layers
            .iter()
            .max_by(|x, y| x.k_abs.max(x.v_abs).total_cmp(&y.k_abs.max(y.v_abs)));
        let text = prompt
            .tokenizer
            .as_ref()
            .map(|t| format!(" {:?}", t.decode(&[s.token_a])))
            .unwrap_or_default();
        println!(
            "  {:>4} {:>5} {:>8} {:>8} {:>9} {:>10.2e} {:>10.2e}  {}{}{}",
            s.step,
            s.position,
            s.token_a,
            s.token_b,
            s.gap.map(|g| format!("{g:.4}")).unwrap_or_else(|| "-".into()),
            s.layers.iter().map(|l| l.k_abs).fold(0.0, f32::max),
            s.layers.iter().map(|l| l.v_abs).fold(0.0, f32::max),
            worst.map(|l| l.layer.to_string()).unwrap_or_default(),
            if s.token_a != s.token_b { "  DIVERGES" } else { "" },
            text
        );
    }
    match r.first_divergent_step {
        None => println!("  no divergence: the same token at every step"),
        Some(i) => println!(
            "  first divergence at step {i}{}",
            match r.divergence_at_near_tie {
                Some(true) => " (a near-tie)",
                Some(false) => " (NOT a near-tie)",
                None => " (no logits to judge the gap)",
            }
        ),
    }
    match r.first_layer_out_of_tolerance {
        None => println!("  every layer's K/V within tolerance at every step"),
        Some([step, layer]) => println!("  first layer out of tolerance: layer {layer} at step {step}"),
    }
    Ok(())
}
