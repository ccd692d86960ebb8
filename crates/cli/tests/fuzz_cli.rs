//! The binary under random argument vectors and damaged artifacts, as an adversarial user drives
//! it: no panic, no signal, no hang, every failure one `error:` line, and never exit 0 with
//! output that is not the model's own.
//!
//! The flags of each command are read from its own `--help`, so new flags are fuzzed without
//! editing this file. Values come from a pool of the kinds that broke things before: huge sizes,
//! zero, negatives, garbage, special files (a FIFO, a character device), missing paths, another
//! model's artifacts.
//!
//! - `SKAINET_CLI_FUZZ_SEED`: replay a run (each run prints its seed and the one-line replay);
//! - `SKAINET_CLI_FUZZ_CASES`: random argument vectors per run (default 24; `scripts/fuzz-cli.sh`
//!   runs hundreds);
//! - `SKAINET_CLI_FUZZ_DAMAGE`: damaged-artifact cases per run (default 12).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A run that takes longer than this is a hang (the slowest legal case, an export of a fixture
/// for a target not yet in the test's cache, takes well under a minute on 2 cores).
const CASE_TIMEOUT: Duration = Duration::from_secs(180);

/// The commands fuzzed (`snapshot` has its own sub-commands). Real model names never enter the
/// pool: they would download from PyPI.
const COMMANDS: &[&[&str]] = &[
    &["generate"],
    &["redecode"],
    &["diverge"],
    &["inspect"],
    &["bench"],
    &["export"],
    &["snapshot", "save"],
    &["snapshot", "info"],
    &["tokenize"],
    &["demo"],
];

/// Fixtures whose on-demand exports the cases share (few, so the compile cost stays bounded).
const MODELS: &[&str] = &["tiny-gemma3:7", "tiny-llama:3"];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn seed() -> u64 {
    env_u64(
        "SKAINET_CLI_FUZZ_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    )
}

/// A flag of a command as its `--help` lists it.
#[derive(Debug, Clone)]
struct Flag {
    name: String,
    takes_value: bool,
    /// The `Possible values:` clap lists, if any.
    choices: Vec<String>,
}

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_skainet-kv")
}

/// The flags `skainet-kv COMMAND --help` lists (help and version aside).
fn flags_of(command: &[&str]) -> Vec<Flag> {
    let out = Command::new(binary())
        .args(command)
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(out.status.success(), "{command:?} --help failed");
    let help = String::from_utf8_lossy(&out.stdout);
    let mut flags: Vec<Flag> = Vec::new();
    let mut in_choices = false;
    for line in help.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(rest) = trimmed.strip_prefix("--").or_else(|| {
            // `-x, --long`
            trimmed
                .strip_prefix('-')
                .and_then(|r| r.split_once(", --"))
                .map(|(_, r)| r)
        }) {
            if indent <= 6 {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                let takes_value = rest[name.len()..].trim_start().starts_with('<');
                in_choices = false;
                if name != "help" && name != "version" {
                    flags.push(Flag {
                        name,
                        takes_value,
                        choices: Vec::new(),
                    });
                }
                continue;
            }
        }
        if trimmed == "Possible values:" {
            in_choices = true;
            continue;
        }
        if in_choices {
            if let Some(choice) = trimmed.strip_prefix("- ") {
                let choice = choice.split(':').next().unwrap_or("").trim();
                if let Some(flag) = flags.last_mut() {
                    flag.choices.push(choice.to_string());
                }
                continue;
            }
            if !trimmed.is_empty() {
                in_choices = false;
            }
        }
    }
    assert!(!flags.is_empty(), "no flags parsed from {command:?} --help:\n{help}");
    flags
}

/// The flags `COMMAND --help`'s usage line marks as required (`--model <MODEL>` outside `[...]`).
fn required_of(command: &[&str]) -> Vec<String> {
    let out = Command::new(binary())
        .args(command)
        .arg("--help")
        .output()
        .expect("run --help");
    let help = String::from_utf8_lossy(&out.stdout);
    let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap_or("");
    usage
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .map(|w| w.trim_end_matches(']').to_string())
        .collect()
}

/// Files the values point at, made once per run in a private directory.
struct Playground {
    dir: tempfile::TempDir,
    fifo: PathBuf,
    device: Option<PathBuf>,
    garbage: PathBuf,
    empty: PathBuf,
}

impl Playground {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        // A character device like /dev/null, but ours: a writer that replaces it harms nothing.
        let device = dir.path().join("null");
        let device = Command::new("mknod")
            .arg(&device)
            .args(["c", "1", "3"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
            .then_some(device);
        let garbage = dir.path().join("garbage.bin");
        std::fs::write(&garbage, b"SKVS\x01\x00not a snapshot, not a manifest\xff\xfe").unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        Playground {
            dir,
            fifo,
            device,
            garbage,
            empty,
        }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

fn value_for(flag: &Flag, rng: &mut Rng, play: &Playground) -> String {
    if !flag.choices.is_empty() && rng.chance(92) {
        return rng.pick(&flag.choices).clone();
    }
    let name = flag.name.as_str();
    if name == "model" {
        return match rng.below(10) {
            0 => "tiny-gpt:1".into(),
            1 => "tiny-gemma3:".into(),
            2 => play.garbage.display().to_string(),
            3 => play.dir.path().display().to_string(),
            _ => rng.pick(MODELS).to_string(),
        };
    }
    let paths = || {
        let mut p = vec![
            play.fifo.display().to_string(),
            play.garbage.display().to_string(),
            play.empty.display().to_string(),
            play.path("missing/never/here"),
            play.path(&format!("out-{}", rng_free_name(name))),
            play.dir.path().display().to_string(),
        ];
        p.extend(play.device.iter().map(|d| d.display().to_string()));
        p
    };
    let is_path = ["out", "artifacts", "prefix-file", "prefix-snapshot", "file", "dir"]
        .iter()
        .any(|k| name.contains(k));
    if is_path || (name == "path") {
        return rng.pick(&paths()).clone();
    }
    let numbers = [
        "-1",
        "4000000000",
        "100000",
        "18446744073709551616",
        "0.5",
        "1e9",
        "nan",
        "inf",
        "",
        "abc",
    ];
    let ids = [
        "1,2,3",
        "4,5",
        "1",
        "",
        "1,,2",
        "0",
        "-1",
        "999999",
        "1,2,x",
        "2147483647",
    ];
    if name.contains("ids") || name == "eos" {
        let n = if rng.chance(60) { 3 } else { ids.len() };
        return rng.pick(&ids[..n]).to_string();
    }
    if ["prompt", "chat", "text"].iter().any(|k| name.contains(k)) {
        return rng
            .pick(&["hello", "", "<start_of_turn>user\nhi", "\u{1}\u{7f}é"])
            .to_string();
    }
    if name == "backends" {
        return rng
            .pick(&["reference,iree-cpu", "reference,reference", "iree-cpu", "", "x,y"])
            .to_string();
    }
    if name == "targets" {
        return rng.pick(&["cpu", "vulkan", "cpu,vulkan", "", "gpu"]).to_string();
    }
    if name == "vulkan-target" {
        return rng
            .pick(&["ampere", "valhall", "adreno", "rdna3", "not-a-gpu"])
            .to_string();
    }
    if name.contains("flag") {
        return rng.pick(&["--iree-opt-level=O0", "--not-a-flag", ""]).to_string();
    }
    // Mostly values a user would give, so that runs reach past clap; the rest are the sizes and
    // spellings that broke things before.
    let plain = ["0", "1", "2", "3", "4", "7", "8", "16", "32", "64"];
    if rng.chance(70) {
        return rng.pick(&plain).to_string();
    }
    rng.pick(&numbers).to_string()
}

fn rng_free_name(flag: &str) -> String {
    flag.chars().filter(|c| c.is_ascii_alphanumeric()).collect()
}

/// One run of the binary, killed at `CASE_TIMEOUT`.
struct Outcome {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
    timed_out: bool,
}

fn run(args: &[String], cache: &Path) -> Outcome {
    use std::os::unix::process::ExitStatusExt;
    let start = Instant::now();
    let mut child = Command::new(binary())
        .args(args)
        .env("SKAINET_KV_CACHE", cache)
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn skainet-kv");
    // Drained on threads, so a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        s
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > CASE_TIMEOUT {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        signal: status.signal(),
        stdout: String::from_utf8_lossy(&out.join().unwrap()).into(),
        stderr: String::from_utf8_lossy(&err.join().unwrap()).into(),
        elapsed: start.elapsed(),
        timed_out,
    }
}

/// What every run must satisfy, whatever its arguments; `None` if it does.
fn violation(o: &Outcome) -> Option<String> {
    if o.timed_out {
        return Some(format!("no answer after {:?} (hang)", o.elapsed));
    }
    if let Some(sig) = o.signal {
        return Some(format!("killed by signal {sig}"));
    }
    let code = o.code.unwrap_or(-1);
    for bad in ["internal bug", "panicked", "stack backtrace", "RUST_BACKTRACE"] {
        if o.stderr.contains(bad) {
            return Some(format!("stderr mentions `{bad}` (exit {code})"));
        }
    }
    match code {
        0 => None,
        // clap's usage errors: several lines, starting with `error:`.
        2 => (!o.stderr.trim_start().starts_with("error:")).then(|| "exit 2 without a usage error".into()),
        1 => {
            let errors: Vec<&str> = o.stderr.lines().filter(|l| l.starts_with("error:")).collect();
            if errors.len() != 1 {
                return Some(format!("exit 1 with {} `error:` lines", errors.len()));
            }
            let line = errors[0];
            if line.matches("(os error").count() > 1 {
                return Some("an OS error printed twice".into());
            }
            (line.trim() == "error:").then(|| "an empty error".into())
        }
        other => Some(format!("exit {other}")),
    }
}

fn replay_hint(test: &str, seed: u64) -> String {
    format!("SKAINET_CLI_FUZZ_SEED={seed} cargo test -p skainet-kv --test fuzz_cli {test} -- --nocapture")
}

/// Random argument vectors: each command with a random subset of its flags, random values,
/// sometimes a flag twice or an unknown one.
#[test]
fn random_argument_vectors_fail_cleanly() {
    let seed = seed();
    let cases = env_u64("SKAINET_CLI_FUZZ_CASES", 24);
    eprintln!(
        "fuzz_cli: seed {seed}, {cases} cases; replay: {}",
        replay_hint("random_argument_vectors", seed)
    );
    let mut rng = Rng(seed);
    let play = Playground::new();
    let cache = tempfile::tempdir().unwrap();
    let flags: Vec<(&[&str], Vec<Flag>, Vec<String>)> =
        COMMANDS.iter().map(|c| (*c, flags_of(c), required_of(c))).collect();
    let mut failures = Vec::new();
    let mut codes = std::collections::BTreeMap::<i32, u32>::new();
    for case in 0..cases {
        let (command, command_flags, required) = rng.pick(&flags);
        let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
        let mut used = std::collections::BTreeSet::new();
        // Most cases give the required flags, a fixture and a short run, so that they reach past
        // argument parsing.
        if command_flags.iter().any(|f| f.name == "model") && rng.chance(85) {
            args.extend(["--model".into(), rng.pick(MODELS).to_string()]);
            used.insert("model".to_string());
        }
        for name in required {
            if !used.contains(name) && rng.chance(90) {
                let flag = command_flags.iter().find(|f| &f.name == name).unwrap();
                args.push(format!("--{name}"));
                args.push(value_for(flag, &mut rng, &play));
                used.insert(name.clone());
            }
        }
        if command_flags.iter().any(|f| f.name == "max-new") && rng.chance(70) {
            args.extend(["--max-new".into(), "3".into()]);
            used.insert("max-new".to_string());
        }
        if command_flags.iter().any(|f| f.name == "ids") && rng.chance(75) {
            args.extend(["--ids".into(), "1,2,3".into()]);
            used.insert("ids".to_string());
        }
        if command == &["snapshot", "info"] || rng.chance(3) {
            // A positional argument: `snapshot info FILE`, or a stray one elsewhere.
            args.push(
                rng.pick(&[play.fifo.clone(), play.garbage.clone(), play.empty.clone()])
                    .display()
                    .to_string(),
            );
        }
        for _ in 0..rng.below(4) {
            let flag = rng.pick(command_flags);
            // A flag twice is clap's to refuse; once in a while is enough.
            if !used.insert(flag.name.clone()) && rng.chance(90) {
                continue;
            }
            args.push(format!("--{}", flag.name));
            if flag.takes_value {
                args.push(value_for(flag, &mut rng, &play));
            }
        }
        if rng.chance(5) {
            args.push("--no-such-flag".into());
        }
        let outcome = run(&args, cache.path());
        let code = outcome.code.unwrap_or(-1);
        *codes.entry(code).or_default() += 1;
        eprintln!(
            "fuzz_cli: case {case}: exit {code} in {:.1} s: skainet-kv {}",
            outcome.elapsed.as_secs_f64(),
            shell_words(&args)
        );
        if let Some(why) = violation(&outcome) {
            failures.push(format!(
                "case {case}: {why}: skainet-kv {}\n--- stderr (tail) ---\n{}",
                shell_words(&args),
                tail(&outcome.stderr, 15)
            ));
        }
    }
    eprintln!("fuzz_cli: exit codes {codes:?}");
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed (seed {seed}; replay: {}):\n{}",
        failures.len(),
        replay_hint("random_argument_vectors", seed),
        failures.join("\n\n")
    );
}

/// How one damage was done, for the failure message (read through `Debug`).
#[derive(Debug)]
#[allow(dead_code)]
enum Damage {
    FlipByte { file: String, offset: u64 },
    Truncate { file: String, len: u64 },
    Remove { file: String },
    EditManifest { key: String },
}

fn damage(dir: &Path, rng: &mut Rng) -> Damage {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let file = rng.pick(&files).clone();
    let name = file.file_name().unwrap().to_string_lossy().to_string();
    let len = std::fs::metadata(&file).unwrap().len();
    match rng.below(4) {
        0 if len > 0 => {
            let offset = rng.next() % len;
            let mut bytes = std::fs::read(&file).unwrap();
            bytes[offset as usize] ^= 1 << rng.below(8);
            std::fs::write(&file, bytes).unwrap();
            Damage::FlipByte { file: name, offset }
        }
        1 if len > 0 => {
            let keep = rng.next() % len;
            std::fs::OpenOptions::new()
                .write(true)
                .open(&file)
                .unwrap()
                .set_len(keep)
                .unwrap();
            Damage::Truncate { file: name, len: keep }
        }
        2 => {
            std::fs::remove_file(&file).unwrap();
            Damage::Remove { file: name }
        }
        _ => {
            // A value a user might "tune" by hand: the output changes if it is believed.
            let path = dir.join("manifest.json");
            let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let mut numbers = Vec::new();
            collect_numbers(&v, String::new(), &mut numbers);
            let key = rng.pick(&numbers).clone();
            let slot = v.pointer_mut(&key).unwrap();
            let old = slot.as_f64().unwrap_or(0.0);
            *slot = serde_json::json!(if old == 0.0 { 1.0 } else { old * 2.0 });
            std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
            Damage::EditManifest { key }
        }
    }
}

fn collect_numbers(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Number(_) => out.push(at),
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                collect_numbers(v, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                collect_numbers(v, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// An export given with `--artifacts`, damaged one way at a time (a flipped byte in any file, a
/// truncation, a missing file, a manifest value edited): the run refuses it in one line or, where
/// the damage cannot change what runs, prints exactly the undamaged export's ids. Exit 0 with other
/// ids is the failure this exists for.
#[test]
fn damaged_artifacts_are_refused_or_give_the_right_ids() {
    let seed = seed();
    let cases = env_u64("SKAINET_CLI_FUZZ_DAMAGE", 12);
    eprintln!(
        "fuzz_cli: seed {seed}, {cases} damaged exports; replay: {}",
        replay_hint("damaged_artifacts", seed)
    );
    let mut rng = Rng(seed);
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("cache");
    let clean = work.path().join("clean");
    let model = "tiny-gemma3:7";
    let export = run(
        &[
            "export",
            "--model",
            model,
            "--out",
            &clean.display().to_string(),
            "--targets",
            "cpu",
        ]
        .map(String::from),
        &cache,
    );
    assert_eq!(export.code, Some(0), "export failed: {}", export.stderr);
    let generate = |dir: &Path| {
        run(
            &[
                "generate",
                "--model",
                model,
                "--backend",
                "iree-cpu",
                "--artifacts",
                &dir.display().to_string(),
                "--ids",
                "3,1,4,1,5,9,2,6",
                "--max-new",
                "6",
                "--json",
            ]
            .map(String::from),
            &cache,
        )
    };
    let ids = |o: &Outcome| -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(&o.stdout).map_or(serde_json::Value::Null, |v| v["ids"].clone())
    };
    let baseline = generate(&clean);
    assert_eq!(baseline.code, Some(0), "{}", baseline.stderr);
    let want = ids(&baseline);
    assert!(want.is_array(), "{}", baseline.stdout);
    let mut failures = Vec::new();
    let mut refused = 0;
    for case in 0..cases {
        let dir = work.path().join(format!("case-{case}"));
        copy_dir(&clean, &dir);
        let how = damage(&dir, &mut rng);
        let o = generate(&dir);
        let verdict = match (violation(&o), o.code) {
            (Some(why), _) => Some(why),
            (None, Some(0)) if ids(&o) != want => Some(format!("exit 0 with ids {} instead of {want}", ids(&o))),
            (None, Some(0)) => None,
            (None, _) => {
                refused += 1;
                None
            }
        };
        eprintln!(
            "fuzz_cli: damage {case}: {how:?}: exit {:?}: {}",
            o.code,
            o.stderr.trim()
        );
        if let Some(why) = verdict {
            failures.push(format!("case {case}: {how:?}: {why}\n{}", tail(&o.stderr, 10)));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    eprintln!("fuzz_cli: {refused} of {cases} damaged exports refused, the rest gave the right ids");
    assert!(
        failures.is_empty(),
        "{} of {cases} damaged exports misbehaved (seed {seed}; replay: {}):\n{}",
        failures.len(),
        replay_hint("damaged_artifacts", seed),
        failures.join("\n\n")
    );
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_.,:/=".contains(c)) {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
