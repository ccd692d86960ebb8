//! `skainet-kv generate`: a prompt (text, chat or ids) prefilled, then greedy or sampled steps;
//! or, with `--prefix-ids`, a shared prefix prefilled and snapshotted and the prompt fed as the
//! utterance. Both go through `kv_core::KvDecoder`, the library's one decode loop; text is
//! printed as the tokens arrive.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kv_core::sampling::{SamplingConfig, DEFAULT_CANDIDATES};
use kv_core::{DecodeOptions, KvDecoder};
use serde::Serialize;

use crate::backends::{self, BackendChoice, RuleChoice, TargetArgs};
use crate::conversation::{self, Answer, Conversation, SystemArgs};
use crate::report::{ids_to_string, ms, parse_ids};
use crate::text::{Prompt, PromptArgs, TextStream};

#[derive(Args)]
pub struct GenerateArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// or a model directory.
    #[arg(short = 'm', long)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    /// Sampling needs artifacts exported with `--top-k`.
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// Default: `iree-cpu` (compiled for this CPU, as `demo`) for real models and GGUF files;
    /// `reference` (the FP32 ndarray forward, no compiler needed) for fixtures and directories.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// A shared prefix, prefilled once and snapshotted (`1,2,3`); the prompt is then the
    /// utterance, fed in chunk calls after a restore. Without it the prompt is prefilled.
    #[arg(long, value_parser = parse_ids)]
    prefix_ids: Vec<Vec<i32>>,
    /// A prefix saved by `snapshot save` (same model): loaded instead of prefilled, then the
    /// prompt is fed as the utterance, as with `--prefix-ids`.
    #[arg(long, conflicts_with = "prefix_ids")]
    prefix_snapshot: Option<std::path::PathBuf>,
    #[command(flatten)]
    prompt: PromptArgs,
    /// `--system`/`--system-file` and `--tools`: the conversation's shared prefix. With them a
    /// `--chat` or `--messages` request is cut after the system turn: the prefix is prefilled
    /// and snapshotted (or is `--prefix-snapshot`'s, which must have been saved with the same
    /// system text, tools and template), and only the rest is fed.
    #[command(flatten)]
    system: SystemArgs,
    /// An OpenAI-style message list (JSON) to continue: user, assistant (with `tool_calls`) and
    /// `tool` results, as `apply_chat_template` takes them.
    #[arg(long, conflicts_with_all = ["prompt", "chat", "ids"])]
    messages: Option<std::path::PathBuf>,
    /// `auto` | `required` | `none` | a tool's name, as OpenAI spells it. Under the grammar
    /// (`--constrain on`) it is enforced: `required` → calls only, a name → that tool's calls
    /// only, `auto` → calls or text; `none` renders no tools and decodes freely. With
    /// `--constrain off` it is checked on the output: `none` fails on a call, `required` when
    /// the output holds no valid call, a name when it does not call that tool (the output is
    /// printed first; the exit status is 1).
    #[arg(long, default_value = "auto")]
    tool_choice: String,
    /// With `--tools`: `on` decodes under a grammar of the tools' schemas and the tool choice
    /// (llguidance), so every call parses and validates, and ids the grammar forces are fed in
    /// chunk calls instead of steps; `off` decodes freely and parses afterwards. A backend that
    /// cannot mask tokens (IREE v1 graphs) refuses `on`.
    #[arg(long, value_enum, default_value = "on")]
    constrain: Constrain,
    /// Ids generated at most (fewer when a stop id comes first).
    #[arg(short = 'n', long, default_value_t = 16)]
    max_new: usize,
    /// Stop at this id (default: the model's stop tokens, EOS and end-of-turn; none for fixtures).
    #[arg(long)]
    eos: Option<i32>,
    /// Which keys a sliding layer sees: the exact rule, or the seed library's one key wider.
    #[arg(long, value_enum, default_value = "exact")]
    window_rule: RuleChoice,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// One JSON object: `{"ids": [...], "text": "...", ...}`; with `--tools`, `"tool_calls"`.
    #[arg(long)]
    json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Constrain {
    On,
    Off,
}

/// How the next token is picked: greedy (the graphs' argmax) unless `--temperature` > 0 or
/// `--repeat-penalty` != 1. Sampling looks at the best 64 logits of each call (more with a larger
/// `--top-k`); IREE backends need graphs exported with that many (`export --top-k`; on-demand
/// exports get them).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the best K candidates (0 = all 64 looked at).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of candidates whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop candidates below P times the best one's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise ids of the prompt and of the output so far (1 = off; 1.1 is common).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// The sampler's seed: the same seed, settings and prompt give the same ids (default: from
    /// the clock, reported in `--json`).
    #[arg(short = 's', long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler's settings; `None` when greedy.
    pub fn config(&self) -> Result<Option<SamplingConfig>> {
        kv_core::limits::check_top_k("--top-k", self.top_k)?;
        let config = SamplingConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            seed: self.seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            }),
            candidates: self.top_k.max(DEFAULT_CANDIDATES),
        };
        config.validate()?;
        Ok((!config.is_greedy()).then_some(config))
    }
}

#[derive(Serialize)]
struct GenerateReport {
    ids: Vec<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    prompt_tokens: usize,
    stopped_at_eos: bool,
    prefill_ms: f64,
    /// `--prefix-snapshot`: the file's load, instead of a prefix prefill.
    #[serde(skip_serializing_if = "Option::is_none")]
    prefix_load_ms: Option<f64>,
    restore_ms: f64,
    chunk_ms: f64,
    chunk_calls: usize,
    decode_ms: f64,
    decode_tokens: usize,
    /// Reading candidates and sampling (0 when greedy).
    sample_ms: f64,
    /// The sampler's seed (absent when greedy).
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    /// Decoded under the tools' grammar (`--constrain on` with tools).
    constrained: bool,
    /// Ids the grammar forced, fed in chunk calls with others instead of a step each.
    forced_tokens: usize,
    /// Calls a one-id-per-step decoder would have made that forcing saved.
    steps_saved: usize,
    /// Time in the grammar (masks, commits).
    constrain_ms: f64,
    /// `--tools`: the answer's calls (`text` is then the text outside them).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    answer: Option<Answer>,
}

/// Where the request's shared prefix comes from, for `--chat` / `--messages`.
enum ChatPrefix {
    /// No prefix: the whole conversation is the prompt.
    None,
    /// `--prefix-ids` or `--prefix-snapshot` (checked against `digest`), or the conversation's
    /// own prefix (`prefill`) to prefill and snapshot.
    Cut {
        prefill: Option<Vec<i32>>,
        digest: Option<String>,
    },
}

/// A conversation request: the ids to feed, and how to read the answer.
struct ChatRequest {
    prefix: ChatPrefix,
    tools: Vec<tokenizer::Tool>,
    format: Option<tokenizer::ToolFormat>,
    choice: tokenizer::ToolChoice,
}

/// `--chat` / `--messages` with `--system`/`--tools` or after a prefix: the conversation cut
/// after its system turn (tested at token level), so a request never repeats the system turn
/// or puts a BOS mid-sequence. `None` where the old paths serve (`--prompt`, `--ids`, a lone
/// `--chat`).
fn chat_request(args: &GenerateArgs) -> Result<Option<(Prompt, ChatRequest)>> {
    let choice: tokenizer::ToolChoice = args.tool_choice.parse()?;
    let after_prefix = !args.prefix_ids.is_empty() || args.prefix_snapshot.is_some();
    let conversational = args.messages.is_some() || args.prompt.chat.is_some();
    if !conversational {
        if args.system.given() || choice != tokenizer::ToolChoice::Auto {
            anyhow::bail!(
                "--system, --tools and --tool-choice take a conversation: give --chat TEXT or --messages FILE"
            );
        }
        return Ok(None);
    }
    if !after_prefix && !args.system.given() && args.messages.is_none() && choice == tokenizer::ToolChoice::Auto {
        return Ok(None);
    }
    if !crate::model::is_real_model(&args.model) {
        anyhow::bail!("--chat / --messages need a real model's tokenizer (gemma3-270m, smollm2-135m, or a PATH.gguf)");
    }
    if !args.prefix_ids.is_empty() && args.system.given() {
        anyhow::bail!("--prefix-ids is a raw prefix: --system / --tools make the prefix themselves; give one");
    }
    let tok = crate::model::tokenizer(&args.model)?;
    let messages = match (&args.messages, &args.prompt.chat) {
        (Some(file), _) => conversation::read_messages(file)?,
        (None, Some(text)) => vec![tokenizer::Message::user(text.as_str())],
        (None, None) => unreachable!("checked above"),
    };
    let tools = args.system.catalog()?;
    let rendered_tools = if choice == tokenizer::ToolChoice::None {
        Vec::new()
    } else {
        tools.clone()
    };
    if let tokenizer::ToolChoice::Function(name) = &choice {
        if !tools.iter().any(|t| &t.name == name) {
            anyhow::bail!("--tool-choice {name}: no such tool in --tools");
        }
    }
    let conversation = Conversation::new(args.system.system()?, rendered_tools, messages)?;
    let format = (!tools.is_empty())
        .then(|| conversation::format_of(&tok, &args.model))
        .transpose()?;
    let (ids, prefix) = if after_prefix || args.system.given() {
        let split = conversation.split(&tok)?;
        let digest = if args.system.given() {
            Some(conversation.digest(&tok)?)
        } else {
            None
        };
        let prefill = (!after_prefix).then_some(split.prefix);
        (split.request, ChatPrefix::Cut { prefill, digest })
    } else {
        (conversation.ids(&tok)?, ChatPrefix::None)
    };
    Ok(Some((
        Prompt {
            ids,
            tokenizer: Some(tok),
        },
        ChatRequest {
            prefix,
            tools,
            format,
            choice,
        },
    )))
}

/// Refuses a snapshot file whose prefix is not the request's: another system text, tools or
/// template (digests differ), or a rendered prefix given to a raw request and back.
fn check_digest(file: &std::path::Path, expected: Option<&str>) -> Result<()> {
    let header = kv_core::snapshot_file::read_header(file)
        .with_context(|| format!("reading --prefix-snapshot {}", file.display()))?;
    match (header.prompt_digest.as_deref(), expected) {
        (a, b) if a == b => Ok(()),
        (Some(_), None) => anyhow::bail!(
            "--prefix-snapshot {} holds a system text / tools prefix: give the same --system / --system-file and --tools",
            file.display()
        ),
        (None, Some(_)) => anyhow::bail!(
            "--prefix-snapshot {} holds a raw prefix (saved without --system / --tools); save it with them to use them",
            file.display()
        ),
        _ => anyhow::bail!(
            "--prefix-snapshot {} was saved with another system text, tools or chat template than this request's",
            file.display()
        ),
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    kv_core::limits::check_positions("--max-new", args.max_new)?;
    let mut prefix: Vec<i32> = args.prefix_ids.concat();
    let chat = chat_request(&args)?;
    let (prompt, chat) = match chat {
        Some((prompt, chat)) => (prompt, Some(chat)),
        None => (args.prompt.resolve(&args.model)?, None),
    };
    if let Some(ChatPrefix::Cut { prefill, digest }) = chat.as_ref().map(|c| &c.prefix) {
        if let Some(file) = &args.prefix_snapshot {
            check_digest(file, digest.as_deref())?;
        }
        if let Some(ids) = prefill {
            prefix = ids.clone();
        }
    }
    let parse_tools = chat.as_ref().is_some_and(|c| c.format.is_some());
    let sampling = args.sampling.config()?;
    let options = DecodeOptions {
        max_new: args.max_new,
        stop: match (&chat, &prompt.tokenizer, args.eos) {
            (Some(c), Some(tok), None) => conversation::stops(tok, c.format).into_iter().collect(),
            _ => prompt.stops(args.eos).into_iter().collect(),
        },
        sampling: sampling.clone(),
    };
    let mut constraint = match (&chat, &prompt.tokenizer, args.constrain) {
        (
            Some(ChatRequest {
                format: Some(_),
                tools,
                choice,
                ..
            }),
            Some(tok),
            Constrain::On,
        ) => constrain::Constrainer::new(tok)?.constraint(tools, choice)?,
        _ => None,
    };
    let constrained = constraint.is_some();
    let (choice, source) = backends::select(
        &args.model,
        args.backend,
        args.artifacts.as_deref(),
        &args.target,
        sampling.as_ref().map_or(0, |c| c.candidates),
    );
    let (backend, _) = backends::open_kv(choice, &source, args.window_rule)?;
    // Calls are printed parsed, once the answer is complete.
    let mut stream = match (&prompt.tokenizer, args.json || parse_tools) {
        (Some(tokenizer), false) => Some(TextStream::new(tokenizer)),
        _ => None,
    };
    let on_token = |id: i32| {
        if let Some(s) = stream.as_mut() {
            s.push(id);
        }
    };
    let explicit = args.artifacts.as_ref().map(|d| d.display().to_string());
    let context = move || {
        let what = match &explicit {
            Some(dir) => format!("generating with --artifacts {dir}"),
            None => "generating".to_string(),
        };
        if constrained {
            format!(
                "{what} under the tools' grammar (--constrain on: the backend must mask tokens, as the \
                 reference and IREE graphs exported with the allowed-token mask do; --constrain off \
                 decodes without it)"
            )
        } else {
            what
        }
    };
    let (g, prefill_ms, prefix_load_ms) = crate::with_backend!(backend, b => {
        let mut decoder = KvDecoder::new(b);
        let mut on_token = on_token;
        let mut generate = |decoder: &mut KvDecoder<_>, snapshot: &_| match constraint.as_mut() {
            Some(c) => decoder.generate_constrained(snapshot, &prompt.ids, &options, c, |id| {
                on_token(id);
                true
            }),
            None => decoder.generate_with(snapshot, &prompt.ids, &options, &mut on_token),
        };
        if let Some(file) = &args.prefix_snapshot {
            let (snapshot, load) = crate::commands::snapshot::load(decoder.backend(), file)?;
            let g = generate(&mut decoder, &snapshot).with_context(context)?;
            (g, 0.0, Some(ms(load)))
        } else if prefix.is_empty() {
            let g = match constraint.as_mut() {
                Some(c) => decoder.complete_constrained(&prompt.ids, &options, c, |id| {
                    on_token(id);
                    true
                }),
                None => decoder.complete(&prompt.ids, &options, &mut on_token),
            }
            .with_context(context)?;
            let prefill_ms = ms(g.timing.prefill);
            (g, prefill_ms, None)
        } else {
            let t = Instant::now();
            let snapshot = decoder.prefill_prefix(&prefix).context("prefilling the prefix")?;
            let prefill_ms = ms(t.elapsed());
            let g = generate(&mut decoder, &snapshot).with_context(context)?;
            (g, prefill_ms, None)
        }
    });
    let t = &g.timing;
    let answer = match (&chat, &prompt.tokenizer) {
        (
            Some(ChatRequest {
                format: Some(format),
                tools,
                choice,
                ..
            }),
            Some(tok),
        ) => Some(conversation::parse_answer(tok, *format, &g.ids, tools, choice)),
        _ => None,
    };
    let report = GenerateReport {
        // With tools the answer carries `text` (outside the calls).
        text: answer.is_none().then(|| prompt.text(&g.ids)).flatten(),
        answer,
        prompt_tokens: prompt.ids.len(),
        stopped_at_eos: g.stopped_at_eos,
        prefill_ms,
        prefix_load_ms,
        restore_ms: ms(t.restore),
        chunk_ms: ms(t.chunk),
        chunk_calls: t.chunk_calls,
        decode_ms: ms(t.decode),
        decode_tokens: t.decode_tokens,
        sample_ms: ms(t.sample),
        seed: sampling.map(|c| c.seed),
        constrained,
        forced_tokens: t.forced_tokens,
        steps_saved: t.steps_saved,
        constrain_ms: ms(t.constrain),
        ids: g.ids,
    };
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else if let Some(answer) = &report.answer {
        for call in &answer.tool_calls {
            crate::outln!("{call}")?;
        }
        if !answer.text.is_empty() {
            crate::outln!("{}", answer.text)?;
        }
        for invalid in &answer.invalid_tool_calls {
            eprintln!("skainet-kv: {invalid}");
        }
    } else if let Some(stream) = stream {
        stream.finish()?;
    } else {
        crate::outln!("{}", ids_to_string(&report.ids))?;
    }
    if !args.json {
        // After the text, on stderr: what a script reads from stdout stays the model's output.
        // The prompt's time: its prefill (or the prefix's) plus the restore and chunk calls
        // that fed it after a prefix; the rate is the ids decoded after it.
        let prompt = t.restore + t.chunk + std::time::Duration::from_secs_f64(prefill_ms / 1e3);
        let line = crate::report::rate_line(report.ids.len(), t.decode + t.sample + t.constrain);
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!(
                "{line}; prompt {} tokens in {:.2} s\n",
                report.prompt_tokens,
                prompt.as_secs_f64()
            ),
        );
    }
    if let Some(e) = report.answer.as_ref().and_then(|a| a.tool_choice_error.as_ref()) {
        anyhow::bail!("{e}");
    }
    Ok(())
}
