//! The binary as a user runs it: JSON shapes, and errors as one line with a non-zero exit.

use std::process::Command;

fn skainet(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(args)
        .output()
        .expect("run skainet-kv");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn demo_json_has_the_documented_keys() {
    let (ok, stdout, stderr) = skainet(&["demo", "--json", "--max-new", "4"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // Exactly these: scripts read them, and the real-model scenario's additions stay out.
    let keys = |v: &serde_json::Value| {
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    assert_eq!(
        keys(&v),
        [
            "backend",
            "model",
            "open_ms",
            "prefix_prefill_ms",
            "prefix_tokens",
            "utterances"
        ],
        "{stdout}"
    );
    let utterances = v["utterances"].as_array().unwrap();
    assert_eq!(utterances.len(), 3);
    for u in utterances {
        assert_eq!(
            keys(u),
            [
                "chunk_calls",
                "chunk_ms",
                "decode_ms",
                "decode_tokens",
                "ids",
                "input",
                "ms_per_token",
                "restore_ms"
            ],
            "{u}"
        );
        assert_eq!(u["ids"].as_array().unwrap().len(), 4);
    }
    assert!(
        v["prefix_tokens"].as_u64().unwrap() > 12,
        "the prefix must be longer than the window"
    );
}

/// `bench --print-ids` gives another runtime the very ids the bench feeds (the prefix, the short
/// prompt, then each utterance); the bench times the first token of that short prompt.
#[test]
fn bench_prints_its_ids_and_times_a_short_prompt() {
    let (ok, stdout, stderr) = skainet(&[
        "bench",
        "--model",
        "tiny-llama:3",
        "--print-ids",
        "--prefix-tokens",
        "20",
        "--utterances",
        "3",
    ]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2 + 3, "{stdout}");
    let prefix: Vec<&str> = lines[0].split(',').collect();
    let prompt: Vec<&str> = lines[1].split(',').collect();
    assert_eq!((prefix.len(), prompt.len()), (20, 8), "{stdout}");
    assert_eq!(prompt[..], prefix[..8]);
    // The utterances of the bench's workload: 7, 8 and 9 ids, each a different one.
    let utterances: Vec<Vec<&str>> = lines[2..].iter().map(|l| l.split(',').collect()).collect();
    assert_eq!(
        utterances.iter().map(Vec::len).collect::<Vec<_>>(),
        [7, 8, 9],
        "{stdout}"
    );
    assert!(utterances[0][..] != utterances[1][..7], "{stdout}");

    let (ok, stdout, stderr) = skainet(&[
        "bench",
        "--model",
        "tiny-llama:3",
        "--prefix-tokens",
        "20",
        "--utterances",
        "1",
        "--repeat",
        "1",
        "--max-new",
        "2",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["prompt_tokens"], 8, "{stdout}");
    assert!(v["prompt_first_token_ms"].as_f64().unwrap() > 0.0, "{stdout}");
}

#[test]
fn generate_prints_ids_as_json_and_matches_the_library() {
    let (ok, stdout, stderr) = skainet(&[
        "generate",
        "--model",
        "tiny-llama:3",
        "--prefix-ids",
        "1,2,3",
        "--ids",
        "4,5",
        "--max-new",
        "5",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let ids: Vec<i32> = serde_json::from_value(v["ids"].clone()).unwrap();

    let model = backend_reference::ReferenceModel::open(&fixtures::materialize("tiny-llama:3").unwrap()).unwrap();
    let mut decoder = kv_core::KvDecoder::new(backend_reference::ReferenceKv::new(model, kv_core::WindowRule::Exact));
    let snap = decoder.prefill_prefix(&[1, 2, 3]).unwrap();
    assert_eq!(ids, decoder.generate(&snap, &[4, 5], None, 5).unwrap().ids);
}

#[test]
fn seeded_generate_is_reproducible_and_matches_the_library() {
    let args = [
        "generate",
        "--model",
        "tiny-llama:3",
        "--ids",
        "4,5,6",
        "--max-new",
        "8",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--json",
    ];
    let run = || {
        let (ok, stdout, stderr) = skainet(&args);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(v["seed"], 7, "{stdout}");
        serde_json::from_value::<Vec<i32>>(v["ids"].clone()).unwrap()
    };
    let ids = run();
    assert_eq!(ids, run());

    let model = backend_reference::ReferenceModel::open(&fixtures::materialize("tiny-llama:3").unwrap()).unwrap();
    let mut decoder = kv_core::KvDecoder::new(backend_reference::ReferenceKv::new(model, kv_core::WindowRule::Exact));
    let options = kv_core::DecodeOptions {
        max_new: 8,
        stop: Default::default(),
        sampling: Some(kv_core::SamplingConfig {
            temperature: 1.0,
            top_p: 0.9,
            seed: 7,
            ..Default::default()
        }),
    };
    let want = decoder.complete(&[4, 5, 6], &options, |_| {}).unwrap().ids;
    assert_eq!(ids, want);
    let greedy = decoder
        .complete(&[4, 5, 6], &kv_core::DecodeOptions::greedy(8, []), |_| {})
        .unwrap()
        .ids;
    assert_ne!(ids, greedy, "--temperature 1 decoded greedily");
}

#[test]
fn redecode_prints_ids() {
    let (ok, stdout, stderr) = skainet(&[
        "redecode",
        "--model",
        "tiny-llama:3",
        "--seq",
        "16",
        "--ids",
        "1,2,3",
        "--max-new",
        "3",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["ids"].as_array().unwrap().len(), 3);
}

#[test]
fn errors_are_one_line_and_fail() {
    let cases: &[(&[&str], &str)] = &[
        (&["demo", "--model", "no-such-model"], "neither a real model"),
        (&["demo", "--model", "tiny-gpt:1"], "unknown fixture family"),
        (
            &[
                "generate",
                "--model",
                "tiny-llama:3",
                "--prefix-ids",
                "1",
                "--ids",
                "4,999",
                "--max-new",
                "2",
            ],
            "outside the vocabulary",
        ),
        (
            &[
                "generate",
                "--model",
                "tiny-llama:3",
                "--prefix-ids",
                "1",
                "--ids",
                "4,x",
                "--max-new",
                "2",
            ],
            "not a token id",
        ),
        (
            &[
                "redecode",
                "--model",
                "tiny-llama:3",
                "--seq",
                "4",
                "--ids",
                "1,2,3,4",
                "--max-new",
                "2",
            ],
            "leaves no room",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--targets",
                "vulkan",
                "--weight-storage",
                "i16",
            ],
            "--weight-storage i16 for Vulkan needs --vulkan-target",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--targets",
                "cpu,vulkan",
                "--weight-storage",
                "bf16",
            ],
            "miscompiles bf16",
        ),
        // `--weights` is the weight format on every command; its old values on `export`
        // (how the graphs declare the weights) are refused naming the flag that took them.
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--weights",
                "packed",
            ],
            "`export --weight-storage packed`",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--weights",
                "i16",
            ],
            "`export --weight-storage i16`",
        ),
        (
            &["generate", "--model", "tiny-llama:3", "--ids", "1", "--weights", "i16"],
            "`export --weight-storage i16`",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--targets",
                "cpu",
                "--weights",
                "bf16",
            ],
            "`--weight-storage bf16` for what `--weights bf16` meant before",
        ),
        // `--cpu`: `host`, `generic` or a CPU name, one parser on every command.
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--cpu",
                "x86/64",
            ],
            "a CPU is `host`, `generic` or an LLVM CPU name",
        ),
        (
            &["generate", "--model", "tiny-llama:3", "--ids", "1", "--cpu", ""],
            "a CPU is `host`, `generic` or an LLVM CPU name",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--contract",
                "3",
            ],
            "[possible values: auto, 1, 2]",
        ),
        (
            &["generate", "--model", "tiny-llama:3", "--ids", "1", "--contract", "0"],
            "[possible values: auto, 1, 2]",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--targets",
                "cpu,vulkan",
                "--contract",
                "2",
                "--cache-type",
                "f16",
            ],
            "--cache-type f16 needs --contract 2 and CPU targets only",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--targets",
                "cpu",
                "--matmul-input",
                "bf16",
            ],
            "--matmul-input bf16 needs CPU targets only and weights declared bf16 (export --weight-storage bf16)",
        ),
        // `--matmul-input` and `--cache-type` take the same values on every command, and the
        // library's rules refuse the same combinations for an export made on demand.
        (
            &[
                "generate",
                "--model",
                "tiny-llama:3",
                "--ids",
                "1",
                "--backend",
                "iree-vulkan",
                "--matmul-input",
                "bf16",
            ],
            "--matmul-input bf16 needs CPU targets only",
        ),
        (
            &[
                "generate",
                "--model",
                "tiny-llama:3",
                "--ids",
                "1",
                "--backend",
                "iree-cpu",
                "--contract",
                "1",
                "--cache-type",
                "f16",
            ],
            "--cache-type f16 needs --contract 2 and CPU targets only",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--prefill-spans",
                "256",
            ],
            "--prefill-spans needs --contract 2",
        ),
        (
            &[
                "export",
                "--model",
                "tiny-llama:3",
                "--out",
                "/nonexistent/never-written",
                "--contract",
                "2",
                "--prefill-spans",
                "256,many",
            ],
            "`many`: invalid digit",
        ),
    ];
    for (args, needle) in cases {
        let (ok, _, stderr) = skainet(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
            "{args:?}: {stderr}"
        );
        // clap adds its own "try --help" hint to argument errors.
        if !stderr.contains("--help") {
            assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        }
    }
}

/// The product's promise on the embedded model: every backend prints the reference's ids.
#[cfg(feature = "iree")]
#[test]
fn demo_ids_are_the_same_on_every_backend() {
    let ids = |backend: &str| {
        let (ok, stdout, stderr) = skainet(&["demo", "--json", "--backend", backend]);
        assert!(ok, "{backend}: {stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        v["utterances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["ids"].clone())
            .collect::<Vec<_>>()
    };
    let reference = ids("reference");
    for backend in ["iree-cpu", "iree-cpu-sync", "iree-vulkan"] {
        assert_eq!(ids(backend), reference, "{backend} differs from the reference");
    }
}

/// A prefix saved by one process and loaded by another continues with the tokens of a prefix
/// prefilled in one process, on every backend; a damaged file is one clear error.
#[test]
fn a_saved_prefix_continues_in_another_process() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = (1..=20)
        .map(|i| (i * 7 % 500).to_string())
        .collect::<Vec<_>>()
        .join(",");
    for backend in ["reference", "iree-cpu", "iree-vulkan"] {
        let file = dir.path().join(format!("{backend}.skvsnap"));
        let file = file.to_str().unwrap();
        let common = ["--model", "tiny-gemma3:7", "--backend", backend];
        let (ok, _, stderr) = skainet(
            &[
                &["snapshot", "save"][..],
                &common,
                &["--prefix-ids", &prefix, "--out", file],
            ]
            .concat(),
        );
        assert!(ok, "{backend}: {stderr}");
        let run = |how: &[&str]| {
            let (ok, stdout, stderr) = skainet(
                &[
                    &["generate"][..],
                    &common,
                    how,
                    &["--ids", "4,5,6", "--max-new", "6", "--json"],
                ]
                .concat(),
            );
            assert!(ok, "{backend}: {stderr}");
            serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
        };
        let loaded = run(&["--prefix-snapshot", file]);
        let prefilled = run(&["--prefix-ids", &prefix]);
        assert_eq!(loaded["ids"], prefilled["ids"], "{backend}");
        assert!(loaded["prefix_load_ms"].as_f64().is_some(), "{loaded}");
    }
    // Truncated: refused in one line, naming the file.
    let file = dir.path().join("reference.skvsnap");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 10]).unwrap();
    let (ok, _, stderr) = skainet(&[
        "generate",
        "--model",
        "tiny-gemma3:7",
        "--prefix-snapshot",
        file.to_str().unwrap(),
        "--ids",
        "4",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("truncated") && stderr.contains("reference.skvsnap"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}
