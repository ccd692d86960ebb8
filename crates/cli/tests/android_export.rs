//! `export --target`: an app's export holds exactly the files `files.json` lists (with
//! `files.json` and `digests.json`), each of the size listed and covered by the digests; a real
//! model's carries its tokenizer and chat template (docs/android.md).
#![cfg(feature = "iree")]

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use kv_core::digests::{Digests, FileList, TOKENIZER_FILE};

fn skainet(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(args)
        .output()
        .expect("run skainet-kv");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// The directory is the list, the list's sizes are the files', and the digests hold.
fn check_listed(dir: &Path) -> FileList {
    let list = FileList::load(dir).unwrap().expect("files.json written");
    assert_eq!(
        listing(dir),
        list.assets().into_iter().collect::<BTreeSet<_>>(),
        "{}",
        dir.display()
    );
    for (name, size) in &list.files {
        assert_eq!(std::fs::metadata(dir.join(name)).unwrap().len(), *size, "{name}");
    }
    Digests::load(dir).unwrap().expect("digests.json").verify(dir).unwrap();
    list
}

/// The tiny fixture, q4 (the NEON kernel's object is built and linked, then removed with the
/// `.mlir` sources): manifest, one module, one archive; a fixture has no tokenizer.
#[test]
fn android_arm64_export_holds_exactly_the_listed_files() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("app");
    let dir_arg = dir.to_str().unwrap();
    let (ok, stderr) = skainet(&[
        "export",
        "--model",
        "tiny-llama:3",
        "--out",
        dir_arg,
        "--target",
        "android-arm64",
        "--weights",
        "q4",
    ]);
    assert!(ok, "{stderr}");
    let list = check_listed(&dir);
    assert_eq!(
        list.files.keys().map(String::as_str).collect::<Vec<_>>(),
        ["llama.llvm-cpu.vmfb", "manifest.json", "model.irpa"]
    );
    let manifest = kv_core::Manifest::load(&dir).unwrap();
    let flags = manifest.provenance.compile_flags.clone().unwrap_or_default();
    assert!(
        flags.contains("--iree-llvmcpu-target-triple=aarch64-none-linux-android30")
            && flags.contains("--iree-llvmcpu-target-cpu-features=+neon,+dotprod,+fullfp16"),
        "{flags}"
    );
    assert!(!dir.join(TOKENIZER_FILE).exists());
}

#[test]
fn target_presets_are_checked() {
    for (args, expected) in [
        (
            &["--target", "android-arm32"][..],
            "known: android-arm64, android-arm64-v9",
        ),
        (&["--target", "vulkan-valhall,vulkan-adreno"][..], "both Vulkan presets"),
        (
            &["--target", "android-arm64", "--cpu", "host"][..],
            "cannot be used with",
        ),
        (
            &["--target", "vulkan-adreno", "--weights", "q4"][..],
            "--weights q4 with --vulkan-target",
        ),
    ] {
        let mut all = vec![
            "export",
            "--model",
            "tiny-llama:3",
            "--out",
            "/nonexistent/never-written",
        ];
        all.extend_from_slice(args);
        let (ok, stderr) = skainet(&all);
        assert!(!ok && stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// A real model's app export: its tokenizer copied (vocabulary, stop ids, chat template), read
/// back by the runtime's tokenizer to the same ids as the GGUF's. Long: compiles SmolLM2-135M for
/// aarch64 (scripts/test-long.sh android).
#[test]
#[ignore = "long: a real model's aarch64 export (scripts/test-long.sh android)"]
fn real_model_export_carries_its_tokenizer() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("app");
    let (ok, stderr) = skainet(&[
        "export",
        "--model",
        "smollm2-135m",
        "--out",
        dir.to_str().unwrap(),
        "--target",
        "android-arm64",
        "--weights",
        "q4",
    ]);
    assert!(ok, "{stderr}");
    let list = check_listed(&dir);
    assert!(list.files.contains_key(TOKENIZER_FILE), "{:?}", list.files);
    let copy = tokenizer::Tokenizer::from_gguf(&gguf::GgufFile::open(dir.join(TOKENIZER_FILE)).unwrap()).unwrap();
    let source = gguf::GgufFile::open(model_store::ensure("smollm2-135m").unwrap()).unwrap();
    let source = tokenizer::Tokenizer::from_gguf(&source).unwrap();
    let chat = [tokenizer::Message::user("Turn off the kitchen lights")];
    assert_eq!(copy.encode_chat(&chat).unwrap(), source.encode_chat(&chat).unwrap());
    assert_eq!(copy.stop_tokens(), source.stop_tokens());
    // The file holds metadata only: far smaller than the model.
    assert!(list.files[TOKENIZER_FILE] < 4 << 20, "{}", list.files[TOKENIZER_FILE]);
}
