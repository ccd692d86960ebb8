//! "The emitted MLIR is unchanged" as a test: the sha256 of every module text the exporter
//! writes for a fixed set of (fixture, targets, contract, options) combinations, against
//! `tests/golden/emitted-mlir.sha256`. Nothing is compiled (the texts come from
//! [`export::ExportPlan`]), so the whole set takes a second or two.
//!
//! A change of the emitter that is meant to change the graphs updates the file:
//! `SKAINET_UPDATE_GOLDEN=1 cargo test -p export --test golden`, and the diff of that file is
//! then part of the commit, naming every combination whose text moved.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use export::{ExportOptions, ExportPlan, Layout, Source, Target, WeightFormat};
use kv_core::manifest::{CacheType, MatmulInput};
use kv_core::quant::QuantFormat;
use kv_core::ContractVersion;
use sha2::{Digest, Sha256};

const GOLDEN: &str = "tests/golden/emitted-mlir.sha256";
const UPDATE_ENV: &str = "SKAINET_UPDATE_GOLDEN";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn vulkan(target: Option<&str>) -> Target {
    Target::Vulkan {
        target: target.map(str::to_string),
    }
}

/// The runtime settings of `target` and `contract` (what the CLI's on-demand exports take).
fn runtime(target: Target, contract: ContractVersion) -> ExportOptions {
    ExportOptions {
        targets: vec![target.clone()],
        ..export::runtime_options_for(&target, contract)
    }
}

fn quantized(name: &str, format: QuantFormat, tmp: &Path) -> PathBuf {
    let src = fixtures::materialize(name).unwrap();
    let dst = tmp.join(format!("{}-{}", name.replace(':', "-"), format.key()));
    if !dst.join(kv_core::manifest::MANIFEST_FILE).is_file() {
        kv_core::quant::quantize_dir(&src, &dst, format).unwrap();
    }
    dst
}

/// Every combination: its name in the golden file, the model directory and the options. Only
/// settings whose text does not depend on the machine (no `--cpu host`: its matmul inputs,
/// cache type and kernel follow this CPU).
fn combinations(tmp: &Path) -> Vec<(String, PathBuf, ExportOptions)> {
    let fixture = |name: &str| fixtures::materialize(name).unwrap();
    let gemma = fixture("tiny-gemma3:7");
    let mut out = Vec::new();
    for contract in [ContractVersion::V1, ContractVersion::V2] {
        for (label, target) in [
            ("cpu", Target::cpu()),
            ("vulkan", vulkan(None)),
            ("vulkan-ampere", vulkan(Some("ampere"))),
            ("vulkan-valhall", vulkan(Some("valhall"))),
            ("vulkan-portable-sg16", vulkan(Some("portable-sg16"))),
        ] {
            out.push((
                format!("tiny-gemma3:7 {label} c{contract}"),
                gemma.clone(),
                runtime(target, contract),
            ));
        }
        out.push((
            format!("tiny-gemma3:7 default c{contract}"),
            gemma.clone(),
            ExportOptions {
                contract,
                ..ExportOptions::default()
            },
        ));
        for name in ["tiny-llama:3", "tiny-qwen2:4", "tiny-qwen3:5", "tiny-gemma3-gqa:6"] {
            out.push((
                format!("{name} cpu c{contract}"),
                fixture(name),
                runtime(Target::cpu(), contract),
            ));
        }
        out.push((
            format!("tiny-gemma3-gqa:6 vulkan-ampere c{contract}"),
            fixture("tiny-gemma3-gqa:6"),
            runtime(vulkan(Some("ampere")), contract),
        ));
        out.push((
            format!("tiny-gemma3:7 cpu three c{contract}"),
            gemma.clone(),
            ExportOptions {
                layout: Layout::Three,
                ..runtime(Target::cpu(), contract)
            },
        ));
        out.push((
            format!("tiny-gemma3:7 cpu top-k apart c{contract}"),
            gemma.clone(),
            ExportOptions {
                top_k: 8,
                fuse_projections: false,
                ..runtime(Target::cpu(), contract)
            },
        ));
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            let dir = quantized("tiny-gemma3:7", format, tmp);
            out.push((
                format!("tiny-gemma3:7-{} cpu c{contract}", format.key()),
                dir.clone(),
                runtime(Target::cpu(), contract),
            ));
            out.push((
                format!("tiny-gemma3:7-{} vulkan c{contract}", format.key()),
                dir.clone(),
                runtime(vulkan(None), contract),
            ));
            // The preset's aarch64 triple takes the q4 kernel on any machine.
            let mut arm = runtime(Target::cpu(), contract);
            export::presets::apply(&[export::presets::preset("android-arm64").unwrap()], &mut arm).unwrap();
            arm.compile_flags = export::runtime_options_for(&Target::cpu(), contract)
                .compile_flags
                .into_iter()
                .chain(arm.compile_flags)
                .collect();
            out.push((
                format!("tiny-gemma3:7-{} android-arm64 c{contract}", format.key()),
                dir,
                arm,
            ));
        }
    }
    out.push((
        "tiny-gemma3:7 cpu bf16-inputs f16-caches c2".into(),
        gemma.clone(),
        ExportOptions {
            matmul_input: MatmulInput::Bf16,
            cache_type: CacheType::F16,
            ..runtime(Target::cpu(), ContractVersion::V2)
        },
    ));
    for (label, layout) in [("", Layout::Shared), (" three", Layout::Three)] {
        out.push((
            format!("tiny-gemma3:7 cpu{label} small-chunk c2"),
            gemma.clone(),
            ExportOptions {
                layout,
                small_chunk: Some(3),
                ..runtime(Target::cpu(), ContractVersion::V2)
            },
        ));
    }
    out.push((
        "tiny-gemma3:7 vulkan-ampere i16 packed c2".into(),
        gemma,
        ExportOptions {
            weights: WeightFormat::PackedI32,
            ..runtime(vulkan(Some("ampere")), ContractVersion::V2)
        },
    ));
    out
}

/// `name file sha256` per module of each combination, in file order.
fn digests() -> BTreeMap<String, String> {
    let tmp = tempfile::tempdir().unwrap();
    let mut lines = BTreeMap::new();
    for (name, dir, options) in combinations(tmp.path()) {
        let plan = ExportPlan::new(&Source::Dir(dir), &options).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (file, text) in plan.module_texts() {
            lines.insert(format!("{name} {file}"), hex(&Sha256::digest(text.as_bytes())));
        }
    }
    lines
}

fn parse(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (key, digest) = l.rsplit_once(' ').unwrap_or_else(|| panic!("{GOLDEN}: bad line `{l}`"));
            (key.to_string(), digest.to_string())
        })
        .collect()
}

#[test]
fn emitted_mlir_matches_the_golden_digests() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    let got = digests();
    if std::env::var_os(UPDATE_ENV).is_some_and(|v| v == "1") {
        let mut text = format!(
            "# sha256 of each emitted module text: combination, module file, digest (tests/golden.rs).\n\
             # Regenerate on an intended change: {UPDATE_ENV}=1 cargo test -p export --test golden\n"
        );
        for (key, digest) in &got {
            text.push_str(&format!("{key} {digest}\n"));
        }
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        eprintln!("wrote {} ({} modules)", path.display(), got.len());
        return;
    }
    let want = parse(&std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; write it with {UPDATE_ENV}=1 cargo test -p export --test golden",
            path.display()
        )
    }));
    let problems = compare(&want, &got);
    assert!(
        problems.is_empty(),
        "{} of {} emitted modules differ from {GOLDEN}:\n  {}\n(an intended change: {UPDATE_ENV}=1 cargo test -p export --test golden)",
        problems.len(),
        want.len(),
        problems.join("\n  ")
    );
}

/// Every difference between the golden digests and the texts' (`want`, `got`), one line each.
fn compare(want: &BTreeMap<String, String>, got: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    for (key, digest) in want {
        match got.get(key) {
            None => problems.push(format!("missing now: {key}")),
            Some(d) if d != digest => problems.push(format!("changed: {key} (was {digest}, now {d})")),
            Some(_) => {}
        }
    }
    for key in got.keys().filter(|k| !want.contains_key(*k)) {
        problems.push(format!("new: {key}"));
    }
    problems
}

/// The comparison can fail: a changed, a missing and a new module are each named.
#[test]
fn changed_missing_and_new_modules_are_named() {
    let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    };
    let want = map(&[("a x.mlir", "01"), ("b x.mlir", "02"), ("c x.mlir", "03")]);
    let got = map(&[("a x.mlir", "01"), ("b x.mlir", "ff"), ("d x.mlir", "04")]);
    assert_eq!(
        compare(&want, &got),
        vec![
            "changed: b x.mlir (was 02, now ff)".to_string(),
            "missing now: c x.mlir".to_string(),
            "new: d x.mlir".to_string(),
        ]
    );
    assert!(compare(&want, &want).is_empty());
}

/// A small chunk graph (`smallChunk`) adds its function and its span variant's
/// (`smallChunkSpan`) to the chunk graph's module, at its end, and moves no other text: every
/// module without it is the export's without, byte for byte.
#[test]
fn small_chunk_adds_its_functions_and_moves_no_other_text() {
    let gemma = fixtures::materialize("tiny-gemma3:7").unwrap();
    for layout in [Layout::Shared, Layout::Three] {
        let plan = |small_chunk| {
            let options = ExportOptions {
                layout,
                small_chunk: Some(small_chunk),
                ..runtime(Target::cpu(), ContractVersion::V2)
            };
            ExportPlan::new(&Source::Dir(gemma.clone()), &options).unwrap()
        };
        let (without, with) = (plan(0), plan(3));
        let chunk = with.manifest().functions.prefill_with_past.clone().unwrap();
        let small = with.manifest().functions.small_chunk(3).unwrap();
        assert_eq!(small, format!("{chunk}_rows3"));
        assert_eq!(with.manifest().v2().unwrap().small_chunk, 3);
        assert_eq!(without.manifest().v2().unwrap().small_chunk, 0);
        let span = with.manifest().v2().unwrap().small_chunk_span;
        assert_eq!(span, kv_core::contract::DEFAULT_SMALL_CHUNK_SPAN);
        let spanned = with.manifest().functions.small_chunk_span(3, span).unwrap();
        assert_eq!(spanned, format!("{small}_span{span}"));
        let func = small.rsplit_once('.').unwrap().1;
        let spanned_func = spanned.rsplit_once('.').unwrap().1;
        let mut added = 0;
        for ((file, old), (file_with, new)) in without.module_texts().zip(with.module_texts()) {
            assert_eq!(file, file_with);
            if old == new {
                continue;
            }
            added += 1;
            let head = old.strip_suffix("}\n").unwrap();
            let tail = new
                .strip_prefix(head)
                .unwrap_or_else(|| panic!("{layout:?} {file}: the text before the new function moved"));
            assert!(
                tail.starts_with(&format!("  func.func @{func}(")),
                "{layout:?} {file}: {}",
                &tail[..80]
            );
            let later: Vec<&str> = tail.split("\n  func.func @").skip(1).collect();
            assert_eq!(later.len(), 1, "{layout:?} {file}: two functions added");
            assert!(
                later[0].starts_with(&format!("{spanned_func}(")),
                "{layout:?} {file}: {}",
                &later[0][..80]
            );
        }
        assert_eq!(
            added, 1,
            "{layout:?}: the chunk graph's module alone gains the function"
        );
    }
}
