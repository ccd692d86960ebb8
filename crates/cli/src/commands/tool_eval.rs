//! `skainet-kv tool-eval`: a request set with expected calls (`data/tools/requests.json`) run
//! on a model the app's way: the system turn with the catalog prefilled once and snapshotted,
//! each request restored, fed and decoded until its call closes. Reports parse-and-validate,
//! correct-function and exact-argument rates and the time from request to parsed call.
//! Constrained by default (the tools' grammar, `constrain`), unconstrained with `--constrain
//! off`, both side by side with `--constrain both` (docs/tool-calling.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kv_core::decoder::TokenConstraint;
use kv_core::{DecodeOptions, Generation, KvBackend, KvDecoder};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use tokenizer::{Message, Tokenizer, Tool, ToolChoice, ToolFormat};

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::conversation::{self, Answer, Conversation, SystemArgs};
use crate::report::ms;

/// The system text the demo and the evaluation use unless `--system` says otherwise.
pub const DEFAULT_SYSTEM: &str = "You are the assistant of a phone. When a tool fits the user's request, call it with \
     the arguments the user gave; when none fits, answer briefly in plain text.";

#[derive(Args)]
pub struct ToolEvalArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`) or a GGUF file (`PATH.gguf`).
    #[arg(short = 'm', long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// The backend that runs the model.
    #[arg(long, value_enum, default_value = "iree-cpu")]
    backend: BackendChoice,
    /// The request set: `{"requests": [{"request", "expected": {"name", "arguments"} | null}]}`.
    #[arg(long, default_value = "data/tools/requests.json")]
    requests: PathBuf,
    /// `--tools` defaults to `data/tools/phone-assistant.json`, `--system` to the demo's.
    #[command(flatten)]
    system: SystemArgs,
    /// Ids generated per request at most (decoding also stops when a call closes; under the
    /// grammar a call's strings are bounded, and this leaves room for the longest).
    #[arg(long, default_value_t = 256)]
    max_new: usize,
    /// Only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// `on`: decode under the tools' grammar; `off`: freely; `both`: each request both ways,
    /// reported side by side.
    #[arg(long, value_enum, default_value = "on")]
    constrain: EvalConstrain,
    /// The grammar's tool choice (`auto`: a call or text; `required`: a call; a tool's name).
    #[arg(long, default_value = "auto")]
    tool_choice: String,
    /// Which keys a sliding layer sees: the exact rule, or the seed library's one key wider.
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    /// One JSON object with every request's outcome.
    #[arg(long)]
    json: bool,
    /// Print the ids each request is fed (the catalog prefix once, then each request's ids
    /// after it) and the stop ids as one JSON object, and run nothing: what another runtime
    /// needs to answer the same requests from the same tokens (scripts/bench-tool-calls.sh).
    #[arg(long, conflicts_with_all = ["explain_against", "json"])]
    print_ids: bool,
    /// Another run's `--json` report (another backend's tool-eval, or llama.cpp's driver in
    /// scripts/llamacpp/): for every request whose answer ids differ from this run's, replay
    /// this run's answer up to the first differing id and judge that pick by this backend's
    /// logits under the grammar's mask (the gap between the best two allowed ids, and how far
    /// the other run's id lies below the best). Needs a backend that exposes its logits (the
    /// reference) and the grammar (`--constrain on`).
    #[arg(long)]
    explain_against: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalConstrain {
    On,
    Off,
    Both,
}

#[derive(Deserialize)]
struct RequestSet {
    requests: Vec<Case>,
}

#[derive(Clone, Deserialize)]
struct Case {
    request: String,
    expected: Option<Expected>,
}

/// The part of another run's report `--explain-against` reads.
#[derive(Deserialize)]
struct OtherReport {
    outcomes: Vec<OtherOutcome>,
}

#[derive(Deserialize)]
struct OtherOutcome {
    request: String,
    ids: Vec<i32>,
}

/// Where this run's answer and another run's part, judged by this backend's logits.
#[derive(Serialize)]
struct Divergence {
    /// Index (in the answer's ids) of the first id that differs.
    at: usize,
    this_id: i32,
    other_id: i32,
    this_piece: String,
    other_piece: String,
    /// Ids the grammar allowed there.
    allowed: usize,
    /// This backend's masked argmax on the replay equals this run's pick (a replay fed the
    /// answer so far in chunk calls, where the run made steps: a mismatch says the two paths'
    /// arithmetic differs at this position, and the gaps below are the replay's).
    replay_matches: bool,
    /// The best allowed logit minus the second best.
    top_two_gap: f32,
    /// The best allowed logit minus the other run's pick's logit (0 where the other pick is
    /// the best on the replay).
    other_below_top: f32,
    /// The other run's pick's rank among the allowed ids (0 = best).
    other_rank: usize,
    /// `other_below_top` under `kv_core::diverge::NEAR_TIE_GAP` (reordered f32 arithmetic's
    /// reach): a near-tie.
    near_tie: bool,
}

#[derive(Clone, Deserialize, Serialize)]
struct Expected {
    name: String,
    arguments: serde_json::Map<String, Json>,
}

/// The context of a constrained request's error: a backend without a mask is the likely cause.
pub const CONSTRAINED_CONTEXT: &str = "generating under the tools' grammar (the backend must mask tokens, as the \
     reference and IREE graphs exported with the allowed-token mask do; --constrain off decodes without it)";

/// One request answered: the ids, the parsed answer, and when the first valid call was complete.
pub struct Answered {
    pub generation: Generation,
    pub answer: Answer,
    /// From the restore to the id that closed the first call (`None`: no call closed).
    pub call_time: Option<Duration>,
    pub total: Duration,
}

/// Restores `prefix`, feeds `ids`, decodes until a stop token, `max_new` ids or the first call's
/// closing delimiter, and parses the answer; under `constraint` when given (a fresh one per
/// request: it holds the grammar's state).
#[allow(clippy::too_many_arguments)]
pub fn answer_request<B: KvBackend>(
    decoder: &mut KvDecoder<B>,
    prefix: &B::Snapshot,
    ids: &[i32],
    tok: &Tokenizer,
    format: ToolFormat,
    tools: &[Tool],
    options: &DecodeOptions,
    constraint: Option<&mut dyn TokenConstraint>,
    mut on_token: impl FnMut(i32),
) -> Result<Answered> {
    let close = format.delimiters().1;
    let constrained = constraint.is_some();
    let mut out = Vec::new();
    let mut call_time = None;
    let started = Instant::now();
    let until = |id| {
        on_token(id);
        out.push(id);
        // Only the newest ids can complete the delimiter: decode a short tail, not the whole.
        let tail = &out[out.len().saturating_sub(8)..];
        if tok.decode_with(tail, true).contains(close) && tok.decode_with(&out, true).contains(close) {
            call_time = Some(started.elapsed());
            return false;
        }
        true
    };
    let generation = match constraint {
        Some(c) => decoder.generate_constrained(prefix, ids, options, c, until),
        None => decoder.generate_until(prefix, ids, options, until),
    }
    .with_context(|| if constrained { CONSTRAINED_CONTEXT } else { "generating" })?;
    let total = started.elapsed();
    let answer = conversation::parse_answer(tok, format, &generation.ids, tools, &ToolChoice::Auto);
    // A call the stop token cut before its delimiter still counts, at the end of the answer.
    if call_time.is_none() && !answer.calls.is_empty() {
        call_time = Some(total);
    }
    Ok(Answered {
        generation,
        answer,
        call_time,
        total,
    })
}

#[derive(Serialize)]
struct Outcome {
    request: String,
    expected: Option<Expected>,
    /// The whole answer, control tokens rendered.
    output: String,
    text: String,
    tool_calls: Vec<Json>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    invalid_tool_calls: Vec<String>,
    parsed_and_valid: bool,
    correct_function: bool,
    exact_arguments: bool,
    call_ms: Option<f64>,
    total_ms: f64,
    tokens: usize,
    /// The answer opens a call (its delimiter is in the output).
    tried_call: bool,
    /// The answer's ids (forced ids included, the stop token not).
    ids: Vec<i32>,
    /// With `--explain-against`: where the other run's answer parts from this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    divergence: Option<Divergence>,
    /// Calls made after the utterance's chunk calls (steps, and chunk calls carrying forced ids).
    decode_calls: usize,
    forced_tokens: usize,
    steps_saved: usize,
}

#[derive(Serialize)]
struct EvalReport {
    model: String,
    backend: String,
    format: &'static str,
    constrained: bool,
    tool_choice: String,
    requests: usize,
    prefix_tokens: usize,
    prefix_prefill_ms: f64,
    /// Requests that expect a call whose answer holds one that parses and validates.
    parse_and_validate_rate: f64,
    /// Requests answered with the expected function (no call where none fits).
    correct_function_rate: f64,
    /// Requests that expect a call answered with its exact arguments.
    exact_arguments_rate: f64,
    /// Median and 90th percentile from the request to its parsed call, over answers with one.
    call_ms_median: Option<f64>,
    call_ms_p90: Option<f64>,
    /// Median from the request to the end of its answer, every request.
    total_ms_median: f64,
    /// Answers that open a call whose calls all parse and validate (the grammar's promise).
    tried_calls: usize,
    tried_calls_valid_rate: f64,
    /// Per request (means): calls after the utterance, forced ids, calls saved by forcing.
    decode_calls_mean: f64,
    forced_tokens_mean: f64,
    steps_saved_mean: f64,
    /// Per request answered with a valid call (means).
    decode_calls_per_call: Option<f64>,
    forced_tokens_per_call: Option<f64>,
    outcomes: Vec<Outcome>,
}

/// Strings compared trimmed and case-insensitively; everything else exactly.
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::String(x), Json::String(y)) => x.trim().eq_ignore_ascii_case(y.trim()),
        (Json::Number(x), Json::Number(y)) => x.as_f64() == y.as_f64(),
        (Json::Object(x), Json::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        (Json::Array(x), Json::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(v, w)| same(v, w)),
        _ => a == b,
    }
}

fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    Some(v[((v.len() - 1) as f64 * p).round() as usize])
}

pub fn run(args: ToolEvalArgs) -> Result<()> {
    if !crate::model::is_real_model(&args.model) {
        bail!("tool-eval runs a real model (gemma3-270m, smollm2-135m)");
    }
    kv_core::limits::check_positions("--max-new", args.max_new)?;
    let choice: ToolChoice = args.tool_choice.parse()?;
    if choice == ToolChoice::None {
        bail!("--tool-choice none renders no tools: nothing to evaluate");
    }
    let text = crate::text::read_text_file("--requests", &args.requests)?;
    let set: RequestSet =
        serde_json::from_str(&text).with_context(|| format!("--requests {}", args.requests.display()))?;
    let cases: Vec<Case> = set
        .requests
        .into_iter()
        .take(args.limit.unwrap_or(usize::MAX))
        .collect();
    let tools = match &args.system.tools {
        Some(_) => args.system.catalog()?,
        None => conversation::read_catalog(std::path::Path::new("data/tools/phone-assistant.json"))?,
    };
    let system = args.system.system()?.unwrap_or_else(|| DEFAULT_SYSTEM.to_string());
    let tok = crate::model::tokenizer(&args.model)?;
    let format = conversation::format_of(&tok, &args.model)?;
    let (prefix, _) = conversation::prefix(&tok, Some(system.clone()), tools.clone())?;
    let inputs = cases
        .iter()
        .map(|c| {
            let conv = Conversation::new(
                Some(system.clone()),
                tools.clone(),
                vec![Message::user(c.request.as_str())],
            )?;
            let split = conv.split(&tok)?;
            if split.prefix != prefix {
                bail!("{:?}: the conversation's prefix is not the catalog's", c.request);
            }
            Ok(split.request)
        })
        .collect::<Result<Vec<_>>>()?;
    if args.print_ids {
        let style = constrain::call_style(&tok)?;
        let value = serde_json::json!({
            "model": args.model,
            "format": format.name(),
            // What the grammar writes, for a runtime that builds its own grammar of the same calls.
            "call_style": format!("{style:?}"),
            "tool_choice": args.tool_choice,
            "lark": constrain::grammar::lark(style, &tools, &choice).map_err(anyhow::Error::msg)?,
            "system": system,
            "prefix_ids": prefix,
            "stop_ids": conversation::stops(&tok, Some(format)),
            "requests": cases.iter().zip(&inputs).map(|(c, ids)| serde_json::json!({
                "request": c.request,
                "expected": c.expected,
                "ids": ids,
            })).collect::<Vec<_>>(),
        });
        crate::outln!("{}", serde_json::to_string(&value)?)?;
        return Ok(());
    }
    let other = match &args.explain_against {
        Some(path) => {
            if args.constrain != EvalConstrain::On {
                bail!("--explain-against judges picks under the grammar: it needs --constrain on");
            }
            let text = crate::text::read_text_file("--explain-against", path)?;
            let report: OtherReport =
                serde_json::from_str(&text).with_context(|| format!("--explain-against {}", path.display()))?;
            Some(report)
        }
        None => None,
    };
    let passes: &[bool] = match args.constrain {
        EvalConstrain::On => &[true],
        EvalConstrain::Off => &[false],
        EvalConstrain::Both => &[true, false],
    };
    // Built once: the trie over the vocabulary and the catalog's grammar; cloned per request.
    let grammar = if passes.contains(&true) {
        let t = Instant::now();
        let c = constrain::Constrainer::new(&tok)?
            .constraint(&tools, &choice)?
            .context("the tool choice leaves no grammar")?;
        if !args.json {
            crate::outln!("grammar for {} tools built in {:.0} ms", tools.len(), ms(t.elapsed()))?;
        }
        Some(c)
    } else {
        None
    };
    let options = DecodeOptions::greedy(args.max_new, conversation::stops(&tok, Some(format)));
    let source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    let (backend, _) = backends::open_kv(args.backend, &source, args.window_rule)?;
    let (open, _) = format.delimiters();
    let reports = crate::with_backend!(backend, b => {
        let name = b.name();
        let mut decoder = KvDecoder::new(b);
        let t = Instant::now();
        let snapshot = decoder.prefill_prefix(&prefix).context("prefilling the catalog")?;
        let prefill = t.elapsed();
        let mut reports = Vec::new();
        for &constrained in passes {
            let mut outcomes = Vec::new();
            for (case, ids) in cases.iter().zip(&inputs) {
                let mut fresh = grammar.clone().filter(|_| constrained);
                let a = answer_request(
                    &mut decoder,
                    &snapshot,
                    ids,
                    &tok,
                    format,
                    &tools,
                    &options,
                    fresh.as_mut().map(|c| c as &mut dyn TokenConstraint),
                    |_| {},
                )?;
                let first = a.answer.calls.first();
                let parsed_and_valid = first.is_some();
                let (correct_function, exact_arguments) = match (&case.expected, first) {
                    (None, None) => (a.answer.invalid_tool_calls.is_empty(), false),
                    (Some(e), Some(c)) => (
                        c.name == e.name,
                        c.name == e.name
                            && same(&Json::Object(c.arguments.clone()), &Json::Object(e.arguments.clone())),
                    ),
                    _ => (false, false),
                };
                let output = tok.decode_with(&a.generation.ids, true);
                if !args.json {
                    crate::outln!(
                        "{:>3} {} {} {:<48} -> {}",
                        outcomes.len() + 1,
                        if correct_function { "✓" } else { "✗" },
                        if exact_arguments { "=" } else { " " },
                        case.request,
                        match first {
                            Some(c) => c.to_json().to_string(),
                            None => format!("{:?}", a.answer.text.chars().take(60).collect::<String>()),
                        }
                    )?;
                }
                let divergence = match (&other, &grammar) {
                    (Some(o), Some(g)) => {
                        let theirs = o.outcomes.iter().find(|x| x.request == case.request).with_context(|| {
                            format!("--explain-against has no answer to {:?}", case.request)
                        })?;
                        explain(&mut decoder, &snapshot, ids, &a.generation.ids, &theirs.ids, g, &tok)?
                    }
                    _ => None,
                };
                let timing = &a.generation.timing;
                outcomes.push(Outcome {
                    request: case.request.clone(),
                    expected: case.expected.clone(),
                    tried_call: output.contains(open),
                    ids: a.generation.ids.clone(),
                    divergence,
                    output,
                    text: a.answer.text.clone(),
                    tool_calls: a.answer.tool_calls.clone(),
                    invalid_tool_calls: a.answer.invalid_tool_calls.clone(),
                    parsed_and_valid,
                    correct_function,
                    exact_arguments,
                    call_ms: a.call_time.filter(|_| parsed_and_valid).map(ms),
                    total_ms: ms(a.total),
                    tokens: a.generation.ids.len(),
                    decode_calls: timing.decode_tokens + timing.forced_calls,
                    forced_tokens: timing.forced_tokens,
                    steps_saved: timing.steps_saved,
                });
            }
            reports.push(summarize(&args, &name, format, constrained, prefix.len(), prefill, outcomes));
        }
        reports
    });
    if args.json {
        let value = match &reports[..] {
            [one] => serde_json::to_value(one)?,
            many => serde_json::json!({ "passes": many }),
        };
        crate::outln!("{}", serde_json::to_string(&value)?)?;
        return Ok(());
    }
    for report in &reports {
        print_summary(report)?;
    }
    Ok(())
}

/// Replays `ours` up to its first id that differs from `theirs` and judges that pick by the
/// backend's logits under the grammar's mask there; `None` where the answers agree (or one is a
/// prefix of the other: no pick differs).
fn explain<B: KvBackend>(
    decoder: &mut KvDecoder<B>,
    prefix: &B::Snapshot,
    request: &[i32],
    ours: &[i32],
    theirs: &[i32],
    grammar: &constrain::Constraint,
    tok: &Tokenizer,
) -> Result<Option<Divergence>> {
    let Some(at) = ours.iter().zip(theirs).position(|(a, b)| a != b) else {
        return Ok(None);
    };
    let mut g = grammar.clone();
    for &id in &ours[..at] {
        g.commit(id)?;
    }
    let allowed = g.allowed()?;
    let b = decoder.backend_mut();
    b.restore(prefix)?;
    let fed: Vec<i32> = request.iter().chain(&ours[..at]).copied().collect();
    for piece in fed.chunks(b.spec().chunk.max(1)) {
        b.chunk(piece)?;
    }
    let logits = b.last_logits().with_context(|| {
        format!(
            "--explain-against needs this backend's logits, and {} exposes none (use --backend reference)",
            b.name()
        )
    })?;
    let mut ranked: Vec<(i32, f32)> = allowed.ids().map(|id| (id, logits[id as usize])).collect();
    // Best first, the lowest id first among equals (the graphs' tie rule).
    ranked.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
    let (this_id, other_id) = (ours[at], theirs[at]);
    let top = ranked.first().map_or(f32::NAN, |r| r.1);
    let other_rank = ranked.iter().position(|r| r.0 == other_id).unwrap_or(ranked.len());
    let other_logit = ranked.get(other_rank).map_or(f32::NEG_INFINITY, |r| r.1);
    let other_below_top = top - other_logit;
    Ok(Some(Divergence {
        at,
        this_id,
        other_id,
        this_piece: tok.decode_with(&[this_id], true),
        other_piece: tok.decode_with(&[other_id], true),
        allowed: ranked.len(),
        replay_matches: ranked.first().is_some_and(|r| r.0 == this_id),
        top_two_gap: match &ranked[..] {
            [a, b, ..] => a.1 - b.1,
            _ => f32::INFINITY,
        },
        other_below_top,
        other_rank,
        near_tie: other_below_top < kv_core::diverge::NEAR_TIE_GAP,
    }))
}

fn summarize(
    args: &ToolEvalArgs,
    backend: &str,
    format: ToolFormat,
    constrained: bool,
    prefix_tokens: usize,
    prefill: Duration,
    outcomes: Vec<Outcome>,
) -> EvalReport {
    let expecting: Vec<&Outcome> = outcomes.iter().filter(|o| o.expected.is_some()).collect();
    let rate = |n: usize, of: usize| if of == 0 { 0.0 } else { n as f64 / of as f64 };
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let calls: Vec<f64> = outcomes.iter().filter_map(|o| o.call_ms).collect();
    let totals: Vec<f64> = outcomes.iter().map(|o| o.total_ms).collect();
    let tried: Vec<&Outcome> = outcomes.iter().filter(|o| o.tried_call).collect();
    let with_call: Vec<&Outcome> = outcomes.iter().filter(|o| o.parsed_and_valid).collect();
    let field = |os: &[&Outcome], f: fn(&Outcome) -> usize| os.iter().map(|o| f(o) as f64).collect::<Vec<_>>();
    let all: Vec<&Outcome> = outcomes.iter().collect();
    EvalReport {
        model: args.model.clone(),
        backend: backend.to_string(),
        format: format.name(),
        constrained,
        tool_choice: args.tool_choice.clone(),
        requests: outcomes.len(),
        prefix_tokens,
        prefix_prefill_ms: ms(prefill),
        parse_and_validate_rate: rate(expecting.iter().filter(|o| o.parsed_and_valid).count(), expecting.len()),
        correct_function_rate: rate(outcomes.iter().filter(|o| o.correct_function).count(), outcomes.len()),
        exact_arguments_rate: rate(expecting.iter().filter(|o| o.exact_arguments).count(), expecting.len()),
        call_ms_median: percentile(&calls, 0.5),
        call_ms_p90: percentile(&calls, 0.9),
        total_ms_median: percentile(&totals, 0.5).unwrap_or(0.0),
        tried_calls: tried.len(),
        tried_calls_valid_rate: rate(
            tried
                .iter()
                .filter(|o| o.parsed_and_valid && o.invalid_tool_calls.is_empty())
                .count(),
            tried.len(),
        ),
        decode_calls_mean: mean(&field(&all, |o| o.decode_calls)).unwrap_or(0.0),
        forced_tokens_mean: mean(&field(&all, |o| o.forced_tokens)).unwrap_or(0.0),
        steps_saved_mean: mean(&field(&all, |o| o.steps_saved)).unwrap_or(0.0),
        decode_calls_per_call: mean(&field(&with_call, |o| o.decode_calls)),
        forced_tokens_per_call: mean(&field(&with_call, |o| o.forced_tokens)),
        outcomes,
    }
}

fn print_summary(report: &EvalReport) -> Result<()> {
    let pct = |r: f64| format!("{:.1}%", 100.0 * r);
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    crate::outln!()?;
    crate::outln!(
        "{} on {} ({} format, {}, tool choice {}): {} requests, catalog prefix {} tokens prefilled in {:.0} ms",
        report.model,
        report.backend,
        report.format,
        if report.constrained {
            "constrained"
        } else {
            "unconstrained"
        },
        report.tool_choice,
        report.requests,
        report.prefix_tokens,
        report.prefix_prefill_ms
    )?;
    crate::outln!("  parse-and-validate  {}", pct(report.parse_and_validate_rate))?;
    crate::outln!(
        "  answers opening a call: {}, their calls valid {}",
        report.tried_calls,
        pct(report.tried_calls_valid_rate)
    )?;
    crate::outln!("  correct function    {}", pct(report.correct_function_rate))?;
    crate::outln!("  exact arguments     {}", pct(report.exact_arguments_rate))?;
    crate::outln!(
        "  per answer with a call: {} decode calls, {} forced ids; per request: {:.1} decode calls, {:.1} forced ids, {:.1} steps saved",
        opt(report.decode_calls_per_call),
        opt(report.forced_tokens_per_call),
        report.decode_calls_mean,
        report.forced_tokens_mean,
        report.steps_saved_mean
    )?;
    crate::outln!(
        "  request -> parsed call  median {} ms, p90 {} ms ({} calls); request -> end of answer median {:.1} ms",
        opt(report.call_ms_median),
        opt(report.call_ms_p90),
        report.outcomes.iter().filter(|o| o.call_ms.is_some()).count(),
        report.total_ms_median
    )?;
    let parted: Vec<&Divergence> = report.outcomes.iter().filter_map(|o| o.divergence.as_ref()).collect();
    if !parted.is_empty() {
        crate::outln!(
            "  answers that part from the other run's: {}, at a near-tie of this backend's logits: {}",
            parted.len(),
            parted.iter().filter(|d| d.near_tie).count()
        )?;
        for (o, d) in report
            .outcomes
            .iter()
            .filter_map(|o| o.divergence.as_ref().map(|d| (o, d)))
        {
            crate::outln!(
                "    {:?}: id {} {:?} here, {:?} there: {:.4} below the best allowed (rank {}), top two {:.4} apart{}",
                o.request,
                d.at,
                d.this_piece,
                d.other_piece,
                d.other_below_top,
                d.other_rank,
                d.top_two_gap,
                if d.replay_matches {
                    ""
                } else {
                    " (the replay picks another id)"
                }
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_set_names_the_catalogs_tools_with_valid_arguments() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tools/");
        let tools = conversation::read_catalog(std::path::Path::new(&format!("{root}phone-assistant.json"))).unwrap();
        assert!((5..=8).contains(&tools.len()));
        let set: RequestSet =
            serde_json::from_str(&std::fs::read_to_string(format!("{root}requests.json")).unwrap()).unwrap();
        assert!(set.requests.len() >= 40);
        assert!(set.requests.iter().filter(|c| c.expected.is_none()).count() >= 3);
        for tool in &tools {
            let phrasings = set
                .requests
                .iter()
                .filter(|c| c.expected.as_ref().is_some_and(|e| e.name == tool.name))
                .count();
            assert!(phrasings >= 3, "{}: {phrasings} phrasings", tool.name);
        }
        for case in &set.requests {
            if let Some(e) = &case.expected {
                let call = tokenizer::ToolCall {
                    name: e.name.clone(),
                    arguments: e.arguments.clone(),
                };
                tokenizer::tools::validate(&call, &tools).unwrap_or_else(|err| panic!("{}: {err}", case.request));
            }
        }
    }

    /// The tiny fixture on the reference, offline: an answer under the grammar, then the same
    /// answer with its first free pick replaced by the second-best allowed id. `explain` must
    /// find that position, replay it to the reference's own pick, and measure the replaced id
    /// exactly as far below the best as the best two are apart; identical answers part nowhere.
    #[test]
    fn explain_judges_the_first_differing_pick_by_the_masked_logits() {
        let source = ModelSource::new("tiny-gemma3:7", None);
        let (backend, _) = backends::open_kv(BackendChoice::Reference, &source, RuleChoice::Exact).unwrap();
        let crate::backends::AnyKv::Reference(b) = backend else {
            panic!("the reference was asked for")
        };
        let tok = constrain::fixture::tokenizer(b.spec().vocab_size).unwrap();
        let tools = conversation::read_catalog(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/tools/fixture-tools.json"
        )))
        .unwrap();
        let grammar = constrain::Constrainer::new(&tok)
            .unwrap()
            .constraint(&tools, &ToolChoice::Required)
            .unwrap()
            .unwrap();
        let system = Some("You are a phone.".to_string());
        let (prefix, _) = conversation::prefix(&tok, system.clone(), tools.clone()).unwrap();
        let conv = Conversation::new(system, tools.clone(), vec![Message::user("Turn on the kitchen lights")]).unwrap();
        let request = conv.split(&tok).unwrap().request;
        let mut decoder = KvDecoder::new(b);
        let snapshot = decoder.prefill_prefix(&prefix).unwrap();
        let mut c = grammar.clone();
        let options = DecodeOptions::greedy(64, conversation::stops(&tok, Some(ToolFormat::FunctionGemma)));
        let ours = decoder
            .generate_constrained(&snapshot, &request, &options, &mut c, |_| true)
            .unwrap()
            .ids;
        assert!(explain(&mut decoder, &snapshot, &request, &ours, &ours, &grammar, &tok)
            .unwrap()
            .is_none());
        // The first pick the grammar leaves open (more than one id allowed).
        let mut g = grammar.clone();
        let mut at = None;
        for (i, &id) in ours.iter().enumerate() {
            if g.allowed().unwrap().count() > 1 {
                at = Some(i);
                break;
            }
            g.commit(id).unwrap();
        }
        let at = at.expect("the fixture's answer has a free pick");
        let allowed = g.allowed().unwrap();
        decoder.backend_mut().restore(&snapshot).unwrap();
        let fed: Vec<i32> = request.iter().chain(&ours[..at]).copied().collect();
        let chunk = decoder.backend().spec().chunk;
        for piece in fed.chunks(chunk) {
            decoder.backend_mut().chunk(piece).unwrap();
        }
        let logits = decoder.backend().last_logits().unwrap().to_vec();
        let mut ranked: Vec<i32> = allowed.ids().collect();
        ranked.sort_by(|x, y| logits[*y as usize].total_cmp(&logits[*x as usize]).then(x.cmp(y)));
        assert_eq!(ranked[0], ours[at], "the replay picks what the run picked");
        let mut theirs = ours[..at].to_vec();
        theirs.push(ranked[1]);
        let d = explain(&mut decoder, &snapshot, &request, &ours, &theirs, &grammar, &tok)
            .unwrap()
            .expect("the answers part");
        assert_eq!(
            (d.at, d.this_id, d.other_id, d.other_rank),
            (at, ours[at], ranked[1], 1)
        );
        assert!(d.replay_matches);
        assert_eq!(d.allowed, allowed.count());
        let gap = logits[ranked[0] as usize] - logits[ranked[1] as usize];
        assert_eq!((d.top_two_gap, d.other_below_top), (gap, gap));
        assert_eq!(d.near_tie, gap < kv_core::diverge::NEAR_TIE_GAP);
    }

    #[test]
    fn arguments_compare_exactly_but_for_case_and_spaces() {
        assert!(same(
            &serde_json::json!({"a": " Paris", "n": 3}),
            &serde_json::json!({"n": 3.0, "a": "paris"})
        ));
        assert!(!same(
            &serde_json::json!({"a": "x"}),
            &serde_json::json!({"a": "x", "b": 1})
        ));
    }
}
