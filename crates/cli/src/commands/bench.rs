//! `skainet-kv bench`: stage medians of the KV session on one backend. Numbers come from here,
//! not from tests; quote medians, and compare ratios measured in one run.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use kv_core::snapshot_file::{self, PersistSnapshot};
use kv_core::{DecodeOptions, KvBackend, KvDecoder, KvSpec, RedecodeBackend, RedecodeDecoder};
use serde::Serialize;

use crate::backends::{self, BackendChoice, ModelSource, RuleChoice, TargetArgs};
use crate::commands::demo::demo_prefix;
use crate::report::{ids_to_string, ms};

#[derive(Args)]
pub struct BenchArgs {
    /// The backend timed.
    #[arg(long, value_enum, default_value = "reference")]
    backend: BackendChoice,
    /// A real model (`gemma3-270m`, `smollm2-135m`), a GGUF file (`PATH.gguf`), a fixture name
    /// or a model directory.
    #[arg(short = 'm', long, default_value = fixtures::DEFAULT_MODEL)]
    model: String,
    /// Exported artifacts for the IREE backends (default: export `--model` once, cached).
    #[arg(long)]
    artifacts: Option<std::path::PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// The shared prefix length (capped by the model's context; default 843 for real models,
    /// 200 for fixtures).
    #[arg(long)]
    prefix_tokens: Option<usize>,
    /// Utterances of 7–12 tokens, each restored, chunked and decoded.
    #[arg(long, default_value_t = 8)]
    utterances: usize,
    /// Ids generated at most (fewer when a stop id comes first).
    #[arg(short = 'n', long, default_value_t = 16)]
    max_new: usize,
    /// Repetitions of the prefix prefill and of the whole utterance set.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Also run the same utterances through the redecode session and report the speed ratio.
    #[arg(long)]
    redecode: bool,
    /// SEQ of the redecode graph (IREE: of the export made on demand; default 128 for real
    /// models, else the manifest's).
    #[arg(long)]
    redecode_seq: Option<usize>,
    /// A prefix saved by `snapshot save`: loaded instead of prefilled for the utterances (the
    /// prefix prefill is still timed, on a prefix of the same length, to compare).
    #[arg(long)]
    prefix_snapshot: Option<std::path::PathBuf>,
    /// Length of the short prompt whose first token is timed (fed from position 0, as a one-line
    /// request without a cached prefix).
    #[arg(long, default_value_t = 8)]
    prompt_tokens: usize,
    /// Real models: the prefix is this system text and catalog's rendered system turn (as
    /// `snapshot save --system/--tools` makes it) instead of `--prefix-tokens` synthetic ids.
    #[command(flatten)]
    system: crate::conversation::SystemArgs,
    /// Print the prefix's ids (`1,2,3`), the short prompt's and each utterance's, one line each,
    /// and exit: another runtime fed these ids runs on exactly the same tokens
    /// (`scripts/bench-vs-llamacpp.sh`).
    #[arg(long)]
    print_ids: bool,
    /// One JSON object (every stage's median and samples) instead of the table.
    #[arg(long)]
    json: bool,
    /// After the timed stages, run one more utterance (restore, chunk call, decode steps) with
    /// the device's dispatches recorded into this file: IREE's profile bundle, read by the
    /// wheel's `iree-profile dispatch FILE` / `iree-profile explain FILE`. IREE backends only.
    #[arg(long)]
    device_profile: Option<std::path::PathBuf>,
}

/// The prefix's snapshot as a file: written, then loaded into the session (median of repeats).
#[derive(Serialize)]
struct SnapshotFileReport {
    /// `--prefix-snapshot`, or a temporary file of the bench's own prefix.
    file: String,
    prefix_tokens: usize,
    mb: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    save_ms: Option<f64>,
    load_ms: f64,
}

#[derive(Serialize)]
struct Restore {
    short_prefix_tokens: usize,
    short_ms: f64,
    long_prefix_tokens: usize,
    long_ms: f64,
}

#[derive(Serialize)]
struct BenchReport {
    backend: String,
    model: String,
    open_ms: f64,
    prefix_tokens: usize,
    prefix_prefill_ms: f64,
    snapshot_file: SnapshotFileReport,
    restore: Restore,
    chunk_call_ms: f64,
    /// An utterance's first token after the prefix is restored: restore + its chunk calls
    /// (median over utterances).
    restored_first_token_ms: f64,
    decode_ms_per_token: f64,
    /// A short prompt fed from position 0 (no prefix): the time to its first token.
    prompt_tokens: usize,
    prompt_first_token_ms: f64,
    utterance_p50_ms: f64,
    utterance_max_ms: f64,
    utterances_timed: usize,
    peak_rss_mb: Option<f64>,
    /// Utterance time over ids generated (restore + chunks + steps).
    kv_ms_per_generated_token: f64,
    /// Where the utterances' decode steps spent their time (backends that time it).
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_phases: Option<PhasesReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    redecode: Option<RedecodeReport>,
}

/// Means per step over every decode step of the timed utterances (`kv_core::StepPhases`).
#[derive(Serialize)]
struct PhasesReport {
    steps: u32,
    inputs_ms: f64,
    invoke_ms: f64,
    read_ms: f64,
    writes_ms: f64,
}

impl PhasesReport {
    fn of(p: kv_core::StepPhases) -> Option<Self> {
        let per = |d: Duration| ms(d) / p.steps as f64;
        (p.steps > 0).then(|| PhasesReport {
            steps: p.steps,
            inputs_ms: per(p.inputs),
            invoke_ms: per(p.invoke),
            read_ms: per(p.read),
            writes_ms: per(p.writes),
        })
    }
}

#[derive(Serialize)]
struct RedecodeReport {
    seq: usize,
    /// Median over utterances of the utterance's time over the ids it generated.
    ms_per_token: f64,
    utterance_p50_ms: f64,
    /// `ms_per_token` over the KV session's `kv_ms_per_generated_token`, same run.
    kv_speedup: f64,
    peak_rss_mb: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Peak resident set size of this process (Linux `VmHWM`).
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn utterance(spec: &KvSpec, i: usize) -> Vec<i32> {
    let usable = (spec.vocab_size - 3) as u64;
    let len = 7 + (i % 6) as u64;
    (0..len)
        .map(|j| (3 + (i as u64 * 977 + j * 4513 + 11) % usable) as i32)
        .collect()
}

/// Median restore time of `snapshot`, over many restores.
fn restore_median<B: KvBackend>(decoder: &mut KvDecoder<B>, snapshot: &B::Snapshot) -> Result<f64> {
    let mut times = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        decoder.backend_mut().restore(snapshot)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(times))
}

fn bench<B: PersistSnapshot>(backend: B, args: &BenchArgs, open: Duration) -> Result<BenchReport> {
    let spec = backend.spec().clone();
    let name = backend.name();
    let prefix = bench_prefix(args, &spec)?;
    let long = prefix.len();
    let short = (long / 8).max(1);
    // The fresh session's state (position 0, no caches): restored before each prefix prefill,
    // before the file loads and before the short prompt, as an app prefills its prefix at launch
    // (or loads it) in a session that holds nothing, so that each stage holds the caches the
    // app it stands for would hold and no more (peak RSS is the largest stage's).
    let empty = backend.snapshot()?;
    let mut decoder = KvDecoder::new(backend);

    let short_snapshot = decoder.prefill_prefix(&prefix[..short])?;
    let short_ms = restore_median(&mut decoder, &short_snapshot)?;
    drop(short_snapshot);
    let mut prefill = Vec::new();
    let mut snapshot = None;
    for _ in 0..args.repeat.max(1) {
        // Each repeat replaces the last: an app holds one prefix, not one per try.
        drop(snapshot.take());
        decoder.backend_mut().restore(&empty)?;
        let t = Instant::now();
        snapshot = Some(decoder.prefill_prefix(&prefix)?);
        prefill.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let snapshot = match snapshot {
        Some(s) => s,
        None => decoder.prefill_prefix(&prefix)?,
    };
    let restore = Restore {
        short_prefix_tokens: short,
        short_ms,
        long_prefix_tokens: long,
        long_ms: restore_median(&mut decoder, &snapshot)?,
    };
    let (snapshot, snapshot_file) = snapshot_file_stage(&mut decoder, snapshot, &empty, args)?;
    let (mut chunk, mut decode, mut totals, mut per_token) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut restored_first = Vec::new();
    decoder.backend_mut().take_step_phases();
    for _ in 0..args.repeat.max(1) {
        for i in 0..args.utterances {
            let g = decoder.generate(&snapshot, &utterance(&spec, i), None, args.max_new)?;
            let t = &g.timing;
            chunk.push(ms(t.chunk) / t.chunk_calls.max(1) as f64);
            if let Some(first) = t.first_token {
                restored_first.push(ms(first));
            }
            if t.decode_tokens > 0 {
                decode.push(ms(t.decode) / t.decode_tokens as f64);
            }
            totals.push(ms(t.total()));
            per_token.push(ms(t.total()) / g.ids.len().max(1) as f64);
        }
    }
    let phases = decoder.backend_mut().take_step_phases();
    if let Some(path) = &args.device_profile {
        // Untimed: recording adds work to every dispatch.
        decoder.backend_mut().begin_device_profile(path)?;
        let profiled = decoder.generate(&snapshot, &utterance(&spec, 0), None, args.max_new);
        decoder.backend_mut().end_device_profile()?;
        let g = profiled?;
        eprintln!(
            "device profile of one utterance ({} ids: restore, chunk call, {} steps): {}",
            g.ids.len(),
            g.timing.decode_tokens,
            path.display()
        );
    }
    let max = totals.iter().cloned().fold(0.0, f64::max);
    // A prompt without a prefix: the stage of an app that keeps none.
    drop(snapshot);
    decoder.backend_mut().restore(&empty)?;
    let prompt = short_prompt(&spec, args.prompt_tokens);
    let mut first_token = Vec::new();
    for _ in 0..args.repeat.max(1) {
        let g = decoder.complete(&prompt, &DecodeOptions::greedy(1, []), |_| {})?;
        first_token.push(ms(g.timing.first_token.unwrap_or(g.timing.prefill)));
    }
    Ok(BenchReport {
        backend: name,
        model: args.model.clone(),
        open_ms: ms(open),
        prefix_tokens: long,
        prefix_prefill_ms: median(prefill),
        snapshot_file,
        restore,
        chunk_call_ms: median(chunk),
        restored_first_token_ms: median(restored_first),
        decode_ms_per_token: median(decode),
        prompt_tokens: prompt.len(),
        prompt_first_token_ms: median(first_token),
        utterances_timed: totals.len(),
        utterance_p50_ms: median(totals),
        utterance_max_ms: max,
        peak_rss_mb: peak_rss_mb(),
        kv_ms_per_generated_token: median(per_token),
        decode_phases: phases.and_then(PhasesReport::of),
        redecode: None,
    })
}

/// Saves the prefix's snapshot to a temporary file (or takes `--prefix-snapshot`) and loads it
/// `repeat` times; the utterances then run from the loaded snapshot, as an app's would.
fn snapshot_file_stage<B: PersistSnapshot>(
    decoder: &mut KvDecoder<B>,
    prefilled: B::Snapshot,
    empty: &B::Snapshot,
    args: &BenchArgs,
) -> Result<(B::Snapshot, SnapshotFileReport)> {
    let backend = decoder.backend();
    let dir = tempfile::tempdir()?;
    let (path, save_ms) = match &args.prefix_snapshot {
        Some(path) => (path.clone(), None),
        None => {
            let path = dir.path().join("prefix.skvsnap");
            let t = Instant::now();
            snapshot_file::save(backend, &prefilled, &path)?;
            (path, Some(ms(t.elapsed())))
        }
    };
    // From here on the file is the prefix, as after an app's restart.
    drop(prefilled);
    decoder.backend_mut().restore(empty)?;
    let backend = decoder.backend();
    let mut loads = Vec::new();
    let mut loaded = None;
    for _ in 0..args.repeat.max(1) {
        drop(loaded.take());
        let (snapshot, took) = crate::commands::snapshot::load(backend, &path)?;
        loads.push(ms(took));
        loaded = Some(snapshot);
    }
    let loaded = loaded.unwrap_or_else(|| unreachable!("at least one load"));
    let report = SnapshotFileReport {
        file: path.display().to_string(),
        prefix_tokens: backend.snapshot_position(&loaded),
        mb: std::fs::metadata(&path)?.len() as f64 / 1e6,
        save_ms,
        load_ms: median(loads),
    };
    Ok((loaded, report))
}

/// The short prompt: the prefix's first ids (any ids time the same; these are printed by
/// `--print-ids` too).
fn short_prompt(spec: &KvSpec, len: usize) -> Vec<i32> {
    demo_prefix(spec, len.clamp(1, spec.max_positions))
}

/// `--print-ids`: the ids the bench feeds, from the model's manifest (no session, no export):
/// the prefix, the short prompt, then each utterance on a line of its own.
fn print_ids(args: &BenchArgs, source: &ModelSource) -> Result<()> {
    let spec = kv_core::Manifest::load(&source.model_dir()?)?.spec;
    crate::outln!("{}", ids_to_string(&bench_prefix(args, &spec)?))?;
    crate::outln!("{}", ids_to_string(&short_prompt(&spec, args.prompt_tokens)))?;
    for i in 0..args.utterances {
        crate::outln!("{}", ids_to_string(&utterance(&spec, i)))?;
    }
    Ok(())
}

/// The shared prefix: `--system`/`--tools`' rendered system turn, else `--prefix-tokens`
/// synthetic ids.
fn bench_prefix(args: &BenchArgs, spec: &KvSpec) -> Result<Vec<i32>> {
    if !args.system.given() {
        return Ok(demo_prefix(spec, prefix_tokens(args).clamp(2, spec.max_positions / 2)));
    }
    if args.prefix_tokens.is_some() || !crate::model::is_real_model(&args.model) {
        anyhow::bail!("--system / --tools make the prefix of a real model's chat template: without --prefix-tokens");
    }
    let tok = crate::model::tokenizer(&args.model)?;
    let (ids, _) = crate::conversation::prefix(&tok, args.system.system()?, args.system.catalog()?)?;
    if ids.len() < 2 || ids.len() > spec.max_positions / 2 {
        anyhow::bail!(
            "the rendered prefix has {} ids; the bench needs 2 to {}",
            ids.len(),
            spec.max_positions / 2
        );
    }
    Ok(ids)
}

fn prefix_tokens(args: &BenchArgs) -> usize {
    args.prefix_tokens
        .unwrap_or(if crate::model::is_real_model(&args.model) {
            843
        } else {
            200
        })
}

/// The sizes of `args`, before anything is opened: counts of tokens within the context limit,
/// repetitions within theirs, and at least one utterance (the medians are over utterances:
/// none printed NaN).
fn check_sizes(args: &BenchArgs) -> Result<()> {
    use kv_core::limits::{check_positions, check_repeats};
    if args.utterances == 0 {
        anyhow::bail!("--utterances 0: the bench times utterances; give at least 1");
    }
    check_repeats("--utterances", args.utterances)?;
    check_repeats("--repeat", args.repeat)?;
    check_positions("--max-new", args.max_new)?;
    check_positions("--prompt-tokens", args.prompt_tokens)?;
    for (flag, value) in [
        ("--prefix-tokens", args.prefix_tokens),
        ("--redecode-seq", args.redecode_seq),
    ] {
        if let Some(value) = value {
            check_positions(flag, value)?;
        }
    }
    Ok(())
}

/// The same utterances, each a whole prompt of the redecode session (the prefix does not fit a
/// redecode graph sized for an utterance; that is the point of the KV session).
fn bench_redecode<B: RedecodeBackend>(
    backend: B,
    spec: &KvSpec,
    args: &BenchArgs,
) -> Result<(usize, Vec<f64>, Vec<f64>)> {
    let seq = backend.seq();
    let mut decoder = RedecodeDecoder::new(backend);
    let (mut per_token, mut totals) = (Vec::new(), Vec::new());
    for _ in 0..args.repeat.max(1) {
        for i in 0..args.utterances {
            let t = Instant::now();
            let ids = decoder.generate(&utterance(spec, i), None, args.max_new)?;
            let elapsed = ms(t.elapsed());
            totals.push(elapsed);
            per_token.push(elapsed / ids.len().max(1) as f64);
        }
    }
    Ok((seq, per_token, totals))
}

pub fn run(args: BenchArgs) -> Result<()> {
    check_sizes(&args)?;
    let mut source = ModelSource::new(&args.model, args.artifacts.clone()).with_targets(&args.target);
    if args.print_ids {
        return print_ids(&args, &source);
    }
    let is_reference = args.backend == BackendChoice::Reference;
    if !is_reference {
        source.redecode_seq = args.redecode_seq;
    }
    if is_reference && args.device_profile.is_some() {
        // Before the minutes of timed stages, not after them.
        anyhow::bail!("--device-profile: the reference backend runs no device; pick an IREE backend");
    }
    let (backend, open) = backends::open_kv(args.backend, &source, RuleChoice::Exact)?;
    let spec = crate::with_backend!(&backend, b => b.spec().clone());
    let mut report = crate::with_backend!(backend, b => bench(b, &args, open)?);
    if args.redecode {
        let seq = match (is_reference, args.redecode_seq) {
            (true, Some(seq)) => Some(seq),
            (true, None) if crate::model::is_real_model(&args.model) => Some(backends::REAL_MODEL_REDECODE_SEQ),
            _ => None,
        };
        let redecode = backends::open_redecode(args.backend, &source, seq)?;
        let (seq, per_token, totals) = crate::with_redecode!(redecode, b => bench_redecode(b, &spec, &args)?);
        let ms_per_token = median(per_token);
        report.redecode = Some(RedecodeReport {
            seq,
            ms_per_token,
            utterance_p50_ms: median(totals),
            kv_speedup: ms_per_token / report.kv_ms_per_generated_token,
            peak_rss_mb: peak_rss_mb(),
        });
    }
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
        return Ok(());
    }
    let r = &report;
    crate::outln!(
        "skainet-kv bench: {} on {} (medians; {} utterances timed)",
        r.model,
        r.backend,
        r.utterances_timed
    )?;
    crate::outln!("  open                        {:>10.3} ms", r.open_ms)?;
    crate::outln!(
        "  prefix prefill ({:>5} tok)  {:>10.3} ms",
        r.prefix_tokens,
        r.prefix_prefill_ms
    )?;
    let f = &r.snapshot_file;
    if let Some(save) = f.save_ms {
        crate::outln!("  snapshot file save          {save:>10.3} ms  ({:.1} MB)", f.mb)?;
    }
    crate::outln!(
        "  snapshot file load ({:>5} tok) {:>7.3} ms  (instead of the prefill)",
        f.prefix_tokens,
        f.load_ms
    )?;
    crate::outln!(
        "  restore ({:>5} tok prefix)  {:>10.4} ms",
        r.restore.short_prefix_tokens,
        r.restore.short_ms
    )?;
    crate::outln!(
        "  restore ({:>5} tok prefix)  {:>10.4} ms",
        r.restore.long_prefix_tokens,
        r.restore.long_ms
    )?;
    crate::outln!("  chunk call (7-12 tokens)    {:>10.3} ms", r.chunk_call_ms)?;
    crate::outln!("  first token after restore   {:>10.3} ms", r.restored_first_token_ms)?;
    crate::outln!("  decode                      {:>10.3} ms/token", r.decode_ms_per_token)?;
    if let Some(p) = &r.decode_phases {
        crate::outln!(
            "    per step (mean of {}): inputs {:.3}, invoke {:.3}, token read {:.3}, row writes {:.3} ms",
            p.steps,
            p.inputs_ms,
            p.invoke_ms,
            p.read_ms,
            p.writes_ms
        )?;
    }
    crate::outln!(
        "  first token ({:>3} tok prompt) {:>9.3} ms  (from position 0)",
        r.prompt_tokens,
        r.prompt_first_token_ms
    )?;
    crate::outln!(
        "  utterance p50 / max         {:>10.3} / {:.3} ms",
        r.utterance_p50_ms,
        r.utterance_max_ms
    )?;
    if let Some(rss) = r.peak_rss_mb {
        crate::outln!("  peak RSS                    {rss:>10.1} MB")?;
    }
    crate::outln!(
        "  KV utterance / generated id {:>10.3} ms/token",
        r.kv_ms_per_generated_token
    )?;
    if let Some(rd) = &r.redecode {
        crate::outln!(
            "  redecode (SEQ {:>4})         {:>10.3} ms/token  (utterance p50 {:.3} ms)",
            rd.seq,
            rd.ms_per_token,
            rd.utterance_p50_ms
        )?;
        crate::outln!("  KV speed-up over redecode   {:>10.2}x", rd.kv_speedup)?;
        if let Some(rss) = rd.peak_rss_mb {
            crate::outln!("  peak RSS with redecode      {rss:>10.1} MB")?;
        }
    }
    Ok(())
}
