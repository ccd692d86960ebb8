//! `skainet-kv diverge`: arguments and printing around [`kv_core::diverge::lockstep`], which
//! runs the two backends teacher-forced and judges tokens and K/V.
//!
//! The exit status is the verdict ([`DivergeReport::failures`]), so scripts can assert it: non-zero
//! where a step's token is not a near-tie of the reference (at any step), where two backends
//! without logits differ at all, and where a layer leaves the tolerance, unless the reference and
//! the artifacts round differently (an FP32 reference against bf16 matmul inputs or f16 caches:
//! K/V then differ by the rounding, which the run reports in a note instead).

use anyhow::{bail, Result};
use clap::Args;
use kv_core::diverge::{lockstep, sampled_lockstep, DivergeReport, LockstepOptions, SampledStep, NEAR_TIE_GAP};
use kv_core::manifest::{CacheType, MatmulInput, Rounding};
use kv_core::tolerance::Tolerance;
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::commands::generate::SamplingArgs;
use crate::text::PromptArgs;

#[derive(Args)]
pub struct DivergeArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// or a model directory.
    #[arg(short = 'm', long)]
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
    /// Ids generated at most (fewer when a stop id comes first).
    #[arg(short = 'n', long, default_value_t = 16)]
    max_new: usize,
    /// A differing token less than this below the reference's top logit is a near-tie (at any
    /// step); any other differing token fails the command.
    #[arg(long, default_value_t = NEAR_TIE_GAP)]
    near_tie: f32,
    /// The bound (absolute and relative) each layer's K/V must stay within, instead of the
    /// default: `Tolerance::CROSS_BACKEND`, or `BF16_MATMUL_INPUTS` for two forwards that both
    /// round matmul inputs to bf16.
    #[arg(long)]
    tolerance: Option<f32>,
    /// Which keys a sliding layer sees: the exact rule, or the seed library's one key wider.
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    /// What the reference rounds: `fp32` (nothing: the FP32 forward), or `artifacts` (what the
    /// IREE backend's artifacts round, manifest `matmulInput` and `cacheType`: where those round
    /// activations to bf16 or K/V rows to f16, the reference then rounds the same, and K/V
    /// compare at the cross-backend tolerance instead of differing by the rounding).
    #[arg(long, value_enum, default_value = "fp32")]
    reference_input: ReferenceInput,
    /// With `--temperature` > 0: seeded sampling in lockstep instead of greedy. Each step draws
    /// once from the seed's stream and picks a token from each backend's candidates with that
    /// draw; a differing pick must be explained by the two distributions (the draw lies within
    /// their cumulative shift of a boundary, or they rank the candidates differently), else the
    /// command fails.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// One JSON object (the report, per step) instead of the summary.
    #[arg(long)]
    json: bool,
}

/// `--json` of a sampled run.
#[derive(Serialize)]
struct SampledOutput<'a> {
    model: &'a str,
    backend_a: String,
    backend_b: String,
    seed: u64,
    steps: &'a [SampledStep],
    divergent_steps: usize,
    unexplained_steps: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ReferenceInput {
    Fp32,
    Artifacts,
}

/// The library's report with the model's name first, as the `--json` keys always were.
#[derive(Serialize)]
struct Output<'a> {
    model: &'a str,
    /// The IREE artifacts' `matmulInput` and `cacheType`, and what the reference did (absent
    /// without IREE).
    #[serde(skip_serializing_if = "Option::is_none")]
    iree_matmul_input: Option<MatmulInput>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reference_matmul_input: Option<MatmulInput>,
    #[serde(skip_serializing_if = "Option::is_none")]
    iree_cache_type: Option<CacheType>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reference_cache_type: Option<CacheType>,
    /// The IREE side's artifact directory: what its modules were compiled from (tests read
    /// whether they call our q4 kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    iree_artifacts: Option<std::path::PathBuf>,
    #[serde(flatten)]
    report: &'a DivergeReport,
}

pub fn run(args: DivergeArgs) -> Result<()> {
    let [first, second] = args.backends[..] else {
        bail!("--backends: give exactly two, e.g. reference,iree-cpu");
    };
    if let Some(bound) = args.tolerance {
        if bound.is_nan() || bound < 0.0 {
            bail!("--tolerance {bound}: give a bound of 0 or more");
        }
    }
    let prompt = args.prompt.resolve(&args.model)?;
    let stops = prompt.stops(None);
    let mut source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let sampling = args.sampling.config()?;
    if let Some(config) = &sampling {
        source.top_k = config.candidates;
    }
    let (a, _) = backends::open_kv(first, &source, args.window_rule)?;
    let (b, _) = backends::open_kv(second, &source, args.window_rule)?;
    // The IREE side's rounding, whichever of the two it is.
    let rounding = [&a, &b].iter().find_map(|any| match any {
        #[cfg(feature = "iree")]
        backends::AnyKv::Iree(b) => Some(Rounding::of(b.manifest())),
        _ => None,
    });
    let reference_rounding = rounding.map(|r| match args.reference_input {
        ReferenceInput::Artifacts => r,
        ReferenceInput::Fp32 => Rounding::FP32,
    });
    let bf16_inputs = rounding.is_some_and(|r| r.matmul_input == MatmulInput::Bf16);
    // K/V are held to the tolerance only where both sides round alike (or neither runs IREE).
    let check_layers = rounding == reference_rounding;
    let (a, b) = match (args.reference_input, rounding) {
        (ReferenceInput::Artifacts, Some(input)) => {
            source.reference_input = Some(input);
            let reopen = |choice, any| match choice {
                BackendChoice::Reference => backends::open_kv(choice, &source, args.window_rule).map(|(kv, _)| kv),
                _ => Ok(any),
            };
            (reopen(first, a)?, reopen(second, b)?)
        }
        (ReferenceInput::Artifacts, None) => bail!("--reference-input artifacts: neither backend runs IREE artifacts"),
        (ReferenceInput::Fp32, _) => (a, b),
    };
    if let Some(config) = &sampling {
        let name_a = crate::with_backend!(&a, x => kv_core::KvBackend::name(x));
        let name_b = crate::with_backend!(&b, x => kv_core::KvBackend::name(x));
        let steps = crate::with_backend!(a, a => {
            let mut a = a;
            crate::with_backend!(b, b => {
                let mut b = b;
                sampled_lockstep(&mut a, &mut b, &prompt.ids, config, args.max_new, &stops)?
            })
        });
        return report_sampled(&args, name_a, name_b, config.seed, &steps);
    }
    let options = LockstepOptions {
        stops,
        max_new: args.max_new,
        near_tie: args.near_tie,
        // Two forwards that both round the matmul inputs part at the rounding's scale, not the
        // summation order's (`Tolerance::BF16_MATMUL_INPUTS`).
        tolerance: if let Some(bound) = args.tolerance {
            Tolerance { abs: bound, rel: bound }
        } else if bf16_inputs && args.reference_input == ReferenceInput::Artifacts {
            Tolerance::BF16_MATMUL_INPUTS
        } else {
            Tolerance::CROSS_BACKEND
        },
    };
    let report = crate::with_backend!(a, a => {
        let mut a = a;
        crate::with_backend!(b, b => {
            let mut b = b;
            lockstep(&mut a, &mut b, &prompt.ids, &options)?
        })
    });
    if args.json {
        // Cached by now: this only finds the entry again.
        #[cfg(not(feature = "iree"))]
        let iree_artifacts = None;
        #[cfg(feature = "iree")]
        let iree_artifacts = [first, second]
            .iter()
            .find_map(|c| c.device())
            .map(|device| source.artifacts_for(device, args.window_rule))
            .transpose()?;
        let output = Output {
            model: &args.model,
            iree_matmul_input: rounding.map(|r| r.matmul_input),
            reference_matmul_input: reference_rounding.map(|r| r.matmul_input),
            iree_cache_type: rounding.map(|r| r.cache_type),
            reference_cache_type: reference_rounding.map(|r| r.cache_type),
            iree_artifacts,
            report: &report,
        };
        println!("{}", serde_json::to_string(&output)?);
        return verdict(&report, check_layers);
    }
    let r = &report;
    println!(
        "skainet-kv diverge: {} on {} vs {} ({} prompt tokens; tolerance abs {} rel {}; near-tie gap < {})",
        args.model, r.backend_a, r.backend_b, r.prompt_tokens, r.tolerance_abs, r.tolerance_rel, r.near_tie_threshold
    );
    println!(
        "  {:>4} {:>5} {:>8} {:>8} {:>9} {:>9} {:>5} {:>10} {:>10}  worst layer",
        "step", "pos", "a", "b", "gap", "below top", "rank", "max K abs", "max V abs"
    );
    for s in &r.steps {
        let text = prompt
            .tokenizer
            .as_ref()
            .map(|t| format!(" {:?}", t.decode(&[s.token_a])))
            .unwrap_or_default();
        println!(
            "  {:>4} {:>5} {:>8} {:>8} {:>9} {:>9} {:>5} {:>10.2e} {:>10.2e}  {}{}{}",
            s.step,
            s.position,
            s.token_a,
            s.token_b,
            s.gap.map(|g| format!("{g:.4}")).unwrap_or_else(|| "-".into()),
            s.below_top.map(|g| format!("{g:.4}")).unwrap_or_else(|| "-".into()),
            s.rank.map(|g| g.to_string()).unwrap_or_else(|| "-".into()),
            s.max_k_abs(),
            s.max_v_abs(),
            s.worst_layer().map(|l| l.layer.to_string()).unwrap_or_default(),
            match s.near_tie(r.near_tie_threshold) {
                None if s.diverges() => "  DIVERGES (no logits to judge it)",
                None => "",
                Some(true) => "  DIVERGES (a near-tie)",
                Some(false) => "  DIVERGES (NOT a near-tie)",
            },
            text
        );
    }
    match r.first_divergent_step {
        None => println!("  no divergence: the same token at every step"),
        Some(i) => println!(
            "  first divergence at step {i}, {} divergent step(s){}",
            r.divergent_steps,
            match (r.divergence_at_near_tie, r.first_not_near_tie) {
                (Some(true), _) => ", every one a near-tie".to_string(),
                (_, Some(step)) => format!(", step {step} the first NOT a near-tie"),
                _ => " (no logits to judge them)".to_string(),
            }
        ),
    }
    match r.first_layer_out_of_tolerance {
        None => println!("  every layer's K/V within tolerance at every step"),
        Some([step, layer]) => println!(
            "  first layer out of tolerance: layer {layer} at step {step}{}",
            if check_layers {
                ""
            } else {
                " (not asserted: the two round differently, see the notes)"
            }
        ),
    }
    if bf16_inputs && args.reference_input == ReferenceInput::Fp32 {
        println!(
            "  note: the IREE graphs round matmul inputs to bf16 (manifest matmulInput), the FP32 reference does not: \
             K/V differ by that rounding; --reference-input artifacts compares against a reference that rounds the same"
        );
    }
    if rounding.is_some_and(|r| !r.cache_type.is_f32()) && args.reference_input == ReferenceInput::Fp32 {
        println!(
            "  note: the IREE graphs keep f16 caches (manifest cacheType), the FP32 reference f32 ones: K/V differ by \
             that rounding too"
        );
    }
    verdict(&report, check_layers)
}

/// The exit status: an error naming every failing step (the report is printed first).
fn verdict(report: &DivergeReport, check_layers: bool) -> Result<()> {
    let failures = report.failures(check_layers);
    if !failures.is_empty() {
        bail!(
            "diverge: {} and {} part ways:\n  {}",
            report.backend_a,
            report.backend_b,
            failures.join("\n  ")
        );
    }
    Ok(())
}

fn report_sampled(args: &DivergeArgs, a: String, b: String, seed: u64, steps: &[SampledStep]) -> Result<()> {
    let divergent = steps.iter().filter(|s| s.draw.token_a != s.draw.token_b).count();
    let unexplained: Vec<&SampledStep> = steps.iter().filter(|s| !s.draw.explained()).collect();
    if args.json {
        let output = SampledOutput {
            model: &args.model,
            backend_a: a.clone(),
            backend_b: b.clone(),
            seed,
            steps,
            divergent_steps: divergent,
            unexplained_steps: unexplained.len(),
        };
        println!("{}", serde_json::to_string(&output)?);
    } else {
        println!(
            "skainet-kv diverge: {} sampled with seed {seed} on {a} vs {b}",
            args.model
        );
        println!(
            "  {:>4} {:>8} {:>8} {:>8} {:>10} {:>10} {:>12}",
            "step", "draw", "a", "b", "margin", "shift", "max logit Δ"
        );
        for s in steps {
            let d = &s.draw;
            println!(
                "  {:>4} {:>8.5} {:>8} {:>8} {:>10.2e} {:>10.2e} {:>12.2e}{}",
                s.step,
                d.u,
                d.token_a,
                d.token_b,
                d.margin,
                d.shift,
                s.max_logit_diff,
                match (d.token_a == d.token_b, d.explained()) {
                    (true, _) => "",
                    (false, true) if !d.same_order => "  DIVERGES (candidates ranked differently)",
                    (false, true) => "  DIVERGES (draw within the shift of a boundary)",
                    (false, false) => "  DIVERGES, UNEXPLAINED",
                }
            );
        }
        println!("  {divergent} of {} draws picked different tokens", steps.len());
    }
    if let Some(s) = unexplained.first() {
        bail!(
            "seeded sampling: step {} picked {} on {a} and {} on {b} with a draw {:.2e} clear of every boundary, \
             more than the distributions' shift {:.2e}: not explained by the logits",
            s.step,
            s.draw.token_a,
            s.draw.token_b,
            s.draw.margin,
            s.draw.shift
        );
    }
    Ok(())
}
