//! `skainet-kv`: the user's entry to the runtime. Commands parse arguments, open backends and
//! print; the logic they run lives in the library crates.

mod backends;
mod commands;
mod conversation;
mod flags;
mod model;
mod report;
mod text;

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "skainet-kv",
    version,
    about = "Stateful KV-cache LLM sessions through IREE, with an FP32 reference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prefill a shared prefix once, snapshot it, answer three utterances; print ids and timings
    /// (a real model, `--model smollm2-135m`: a tool catalog and three requests answered in text).
    Demo(commands::demo::DemoArgs),
    /// Greedy text or ids: prefill the prompt (`--prompt`, `--chat`, `--ids`) and decode; with
    /// `--prefix-ids`, prefill that prefix and feed the prompt in chunk calls.
    Generate(commands::generate::GenerateArgs),
    /// A multi-turn conversation, streamed: `--system`, `--tools`, /commands (/help); the
    /// catalog restored from its snapshot at every turn; Ctrl-C stops a reply.
    Chat(commands::chat::ChatArgs),
    /// The redecode session: one fixed-length graph re-run per token.
    Redecode(commands::redecode::RedecodeArgs),
    /// Print a real model's token ids for a text.
    Tokenize(commands::tokenize::TokenizeArgs),
    /// Run two backends in lockstep on one context; report where tokens and K/V part ways.
    Diverge(commands::diverge::DivergeArgs),
    /// Print a model's manifest summary.
    Inspect(commands::inspect::InspectArgs),
    /// Emit the contract graphs as StableHLO and compile them for CPU and Vulkan.
    #[cfg(feature = "iree")]
    Export(commands::export::ExportArgs),
    /// Stage medians: open, prefix prefill, restore (at two prefix lengths), chunk, decode, the
    /// first token of a short prompt.
    Bench(commands::bench::BenchArgs),
    /// Save a prefilled prefix to a file (`save`), describe one (`info`); load it with
    /// `--prefix-snapshot` on `generate` and `bench`.
    Snapshot(commands::snapshot::SnapshotArgs),
    /// An OpenAI-compatible local server (/v1/chat/completions with streaming and tools,
    /// /v1/completions, /v1/models, /health, /metrics) with automatic prefix caching.
    Serve(commands::serve::ServeArgs),
    /// A request set with expected tool calls on a real model: parse-and-validate, correct
    /// function and exact-argument rates, time from request to parsed call (unconstrained).
    ToolEval(commands::tool_eval::ToolEvalArgs),
    Verify(commands::verify::VerifyArgs),
}

fn main() -> ExitCode {
    // A bug must still read as one line, not a trace: users see errors, not our internals.
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        // `println!` panics when stdout is gone; commands print through `outln!`, which returns
        // the error, but one left behind must still not read as a bug: a closed pipe ends
        // quietly, a full disk in one line.
        if let Some(io) = message.strip_prefix("failed printing to stdout: ") {
            #[cfg(unix)]
            if io == std::io::Error::from_raw_os_error(32).to_string() {
                std::process::exit(report::CLOSED_STDOUT_EXIT.into());
            }
            let _ = writeln!(std::io::stderr(), "error: writing to stdout: {io}");
            std::process::exit(1);
        }
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let _ = writeln!(std::io::stderr(), "error: internal bug: {message}{location}");
    }));
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => commands::demo::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Chat(args) => commands::chat::run(args),
        Command::Redecode(args) => commands::redecode::run(args),
        Command::Tokenize(args) => commands::tokenize::run(args),
        Command::Diverge(args) => commands::diverge::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        #[cfg(feature = "iree")]
        Command::Export(args) => commands::export::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Snapshot(args) => commands::snapshot::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::ToolEval(args) => commands::tool_eval::run(args),
        Command::Verify(args) => commands::verify::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`| head`): what it wanted it has; nothing to say.
        Err(error) if report::is_closed_stdout(&error) => ExitCode::from(report::CLOSED_STDOUT_EXIT),
        Err(error) => {
            // Not `eprintln!`: it panics on a closed stderr.
            let _ = writeln!(std::io::stderr(), "error: {}", report::one_line(&error));
            ExitCode::FAILURE
        }
    }
}
