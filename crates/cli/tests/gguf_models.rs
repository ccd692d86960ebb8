//! `--model PATH.gguf` on GGUF files the test writes itself: a fixture's weights in llama.cpp's
//! layout (Llama's Q/K rows permuted as its converter does; Qwen2 and Qwen3 as they are) with the
//! fixture vocabulary's tokenizer and chat template. The file, imported by the CLI, must decode
//! the same ids as the fixture it came from, and a file the importer cannot read must be refused
//! in one line naming what (architecture, tensor type, tokenizer model).

use std::path::{Path, PathBuf};
use std::process::Command;

use gguf::{GgmlType, GgufWriter, Value};
use kv_core::irpa::IrpaArchive;
use kv_core::params::parameter_table;
use kv_core::Manifest;

/// Runs the binary with its cache in `cache`: the imports of the test's files (one per path)
/// go with the test's temporary directory.
fn skainet(cache: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .env("SKAINET_KV_CACHE", cache)
        .args(args)
        .output()
        .expect("run skainet-kv");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The GGUF file of fixture `model` under architecture name `arch` (`llama`, `qwen2`,
/// `qwen3`), matrices as BF16 (Llama's permuted Q/K as F32), the rest F32.
fn gguf_of_fixture(model: &str, arch: &str) -> GgufWriter {
    let dir = fixtures::materialize(model).unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    let spec = &manifest.spec;
    let architecture = manifest.architecture.clone().unwrap();
    let archive = IrpaArchive::open(dir.join(manifest.weights_file().unwrap())).unwrap();
    let mut w = constrain::fixture::vocabulary(spec.vocab_size).unwrap();
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: usize| Value::U32(v as u32);
    w.kv("general.architecture", Value::String(arch.into()))
        .kv("general.name", Value::String(format!("{model} as {arch}")))
        .kv(k("block_count"), u(spec.n_layers))
        .kv(k("embedding_length"), u(spec.hidden_size))
        .kv(k("feed_forward_length"), u(architecture.ffn_size))
        .kv(k("attention.head_count"), u(spec.n_heads))
        .kv(k("attention.head_count_kv"), u(spec.n_kv_heads))
        .kv(k("attention.key_length"), u(spec.head_dim))
        .kv(k("attention.layer_norm_rms_epsilon"), Value::F32(architecture.rms_eps))
        .kv(k("rope.freq_base"), Value::F32(spec.global_rope_base));
    for p in parameter_table(spec, &architecture) {
        let bytes = archive.data(&p.name).unwrap();
        let dims: Vec<u64> = p.shape.iter().rev().map(|&d| d as u64).collect();
        let heads = match (arch, p.name.rsplit('.').nth(1)) {
            ("llama", Some("attn_q")) => Some(spec.n_heads),
            ("llama", Some("attn_k")) => Some(spec.n_kv_heads),
            _ => None,
        };
        let values = kv_core::bf16::bf16_bytes_to_f32(bytes).unwrap();
        match heads {
            Some(h) => w.tensor_f32(
                &p.name,
                &dims,
                &gguf::import::permute_rows(&values, h, spec.hidden_size),
            ),
            None if p.shape.len() == 2 => w.tensor(&p.name, &dims, GgmlType::BF16, bytes.to_vec()),
            None => w.tensor_f32(&p.name, &dims, &values),
        };
    }
    w
}

fn write(dir: &Path, name: &str, w: &GgufWriter) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

fn ids(json: &str) -> Vec<i64> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_i64().unwrap())
        .collect()
}

#[test]
fn a_gguf_file_decodes_as_the_fixture_it_was_written_from() {
    let dir = tempfile::tempdir().unwrap();
    for (model, arch) in [
        ("tiny-llama:3", "llama"),
        ("tiny-qwen2:7", "qwen2"),
        ("tiny-qwen3:7", "qwen3"),
    ] {
        let path = write(dir.path(), &format!("{arch}.gguf"), &gguf_of_fixture(model, arch));
        let file = path.to_str().unwrap();
        // The tokenizer comes from the file: text in, and the ids the fixture decodes from them.
        let (ok, prompt, err) = skainet(dir.path(), &["tokenize", "-m", file, "--text", "set time"]);
        assert!(ok, "{arch}: {err}");
        let prompt = prompt.trim().to_string();
        assert!(!prompt.is_empty(), "{arch}");
        let common = ["--backend", "reference", "-n", "12", "--eos=-1", "--json"];
        let (ok, from_file, err) = skainet(
            dir.path(),
            &[&["generate", "-m", file, "--ids", &prompt][..], &common].concat(),
        );
        assert!(ok, "{arch}: {err}");
        let (ok, from_fixture, err) = skainet(
            dir.path(),
            &[&["generate", "-m", model, "--ids", &prompt][..], &common].concat(),
        );
        assert!(ok, "{model}: {err}");
        assert_eq!(
            ids(&from_file),
            ids(&from_fixture),
            "{arch}: the GGUF decodes as {model}"
        );
        assert_eq!(ids(&from_file).len(), 12);
        // Text in, text out, from the file's tokenizer.
        let (ok, text, err) = skainet(
            dir.path(),
            &[
                "generate",
                "-m",
                file,
                "--backend",
                "reference",
                "-p",
                "set time",
                "-n",
                "4",
            ],
        );
        assert!(ok && !text.is_empty(), "{arch}: {err}");
        assert!(err.contains("tokens/s)"), "{arch}: the rate line: {err}");
    }
}

#[test]
fn a_gguf_file_the_importer_cannot_read_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let base = gguf_of_fixture("tiny-qwen2:7", "qwen2");
    let file = gguf::GgufFile::from_bytes(base.to_bytes()).unwrap();
    // Rebuilt key by key: a writer refuses a key twice.
    let rebuild = |skip_key: &str, extra: &[(&str, Value)], retype: Option<&str>| {
        let mut w = GgufWriter::new();
        for (k, v) in file.metadata() {
            if k != skip_key {
                w.kv(k.clone(), v.clone());
            }
        }
        for (k, v) in extra {
            w.kv(*k, v.clone());
        }
        for t in file.tensors() {
            if Some(t.name.as_str()) == retype {
                // 32 elements per Q8_1 block of 36 bytes: the right size, a type not imported.
                let n = t.dims.iter().product::<u64>() as usize;
                w.tensor(&t.name, &t.dims, GgmlType::Q8_1, vec![0u8; n / 32 * 36]);
            } else {
                w.tensor_f32(&t.name, &t.dims, &file.dequantize(t).unwrap());
            }
        }
        w
    };
    let phi = rebuild(
        "general.architecture",
        &[("general.architecture", Value::String("phi3".into()))],
        None,
    );
    let bert = rebuild(
        "tokenizer.ggml.model",
        &[("tokenizer.ggml.model", Value::String("bert".into()))],
        None,
    );
    let q81 = rebuild("", &[], Some("blk.0.ffn_up.weight"));
    for (name, w, expect) in [
        ("phi3.gguf", &phi, "architecture `phi3` is not supported"),
        ("bert.gguf", &bert, "tokenizer model `bert`"),
        ("q81.gguf", &q81, "has type Q8_1"),
    ] {
        let path = write(dir.path(), name, w);
        let (ok, _, err) = skainet(
            dir.path(),
            &[
                "generate",
                "-m",
                path.to_str().unwrap(),
                "--backend",
                "reference",
                "--ids",
                "2,3",
            ],
        );
        assert!(!ok, "{name} was taken");
        assert_eq!(err.lines().count(), 1, "{name}: {err}");
        assert!(err.starts_with("error: ") && err.contains(expect), "{name}: {err}");
    }
    let (ok, _, err) = skainet(dir.path(), &["generate", "-m", "/no/such/model.gguf", "--ids", "2"]);
    assert!(!ok && err.contains("/no/such/model.gguf"), "{err}");
}

/// Long (scripts/test-long.sh gguf): real GGUF files by a path the project does not name (the
/// model store's SmolLM2-135M and Gemma 3 270M files, linked under other names): a scripted
/// chat on the default backend (IREE CPU, exported on first use) answers two questions, and the
/// Gemma file decodes the ids its store name does.
#[test]
#[ignore]
fn real_gguf_files_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let cache = std::path::PathBuf::from(std::env::var("SKAINET_KV_CACHE").expect("source scripts/env.sh"));
    let link = |name: &str, store_name: &str| {
        let path = dir.path().join(name);
        std::os::unix::fs::symlink(model_store::ensure(store_name).unwrap(), &path).unwrap();
        path.to_str().unwrap().to_string()
    };
    let smol = link("some-chat-model.gguf", "smollm2-135m");
    let mut child = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(["chat", "-m", &smol, "-n", "40"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\nAnd of Italy?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].contains("Paris") && lines[1].contains("Rome"), "{text}");

    let gemma = link("another-model.gguf", "gemma3-270m");
    let args = [
        "--backend",
        "reference",
        "-p",
        "The capital of France is",
        "-n",
        "6",
        "--json",
    ];
    let (ok, by_path, err) = skainet(&cache, &[&["generate", "-m", &gemma][..], &args].concat());
    assert!(ok, "{err}");
    let (ok, by_name, err) = skainet(&cache, &[&["generate", "-m", "gemma3-270m"][..], &args].concat());
    assert!(ok, "{err}");
    assert_eq!(ids(&by_path), ids(&by_name));
}
