//! `jni-fixture OUTDIR`: exports the fixture model `tiny-gemma3:7` in the seed's three-archive
//! layout (cached), computes the ids the Rust API produces for a fixed prefix, utterances and
//! redecode prompt (`kv_core::KvDecoder` over `IreeKvBackend`, `RedecodeDecoder` over
//! `IreeRedecodeBackend`), and writes `OUTDIR/fixture.properties` for the JVM tests, plus a vmfb
//! whose result breaks the redecode contract (`nativeStep` must return null for it), the shared
//! layout's files, the three-archive layout compiled for Vulkan with its ids there, and with-past
//! archives holding two entries of the embedding's size (`OUTDIR/embeddings/`), and for the
//! app-level API (`Engine`, `Conversation`) the tool calls the Rust API (`engine` crate on IREE)
//! answers the quickstart with, and a catalog file of another model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use backend_iree::{IreeKvBackend, IreeOptions, IreeRedecodeBackend};
use backend_reference::{ReferenceKv, ReferenceModel};
use export::{cached_export, cached_export_with, ExportOptions, Layout, Target};
use kv_core::irpa::{IrpaArchive, IrpaWriter};
use kv_core::{Graph, KvBackend, KvDecoder, Manifest, RedecodeBackend, RedecodeDecoder, WindowRule};

const MODEL: &str = "tiny-gemma3:7";
/// Another model, whose catalog files the engine of MODEL must refuse.
const OTHER_MODEL: &str = "tiny-gemma3:8";
/// The quickstart's tools and requests (docs/android.md; `JniEngineTest.kt` runs them).
const TOOLS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tools/fixture-tools.json");
const REQUESTS: [&str; 3] = [
    "Turn on the kitchen lights.",
    "Set a timer for ten minutes.",
    "Dim the bedroom to 30 percent.",
];
const MAX_NEW: usize = 6;

fn ids(v: &[i32]) -> String {
    v.iter().map(i32::to_string).collect::<Vec<_>>().join(",")
}

/// Deterministic ids in `1..vocab`.
fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<i32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (1 + (x >> 33) % (vocab as u64 - 1)) as i32
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out: PathBuf = std::env::args().nth(1).ok_or("usage: jni-fixture OUTDIR")?.into();
    std::fs::create_dir_all(&out)?;
    let dir = cached_export(MODEL, &Target::cpu(), Layout::Three)?;
    let manifest = Manifest::load(&dir)?;
    let spec = manifest.spec.clone();
    let target = manifest.modules.keys().next().ok_or("no modules")?.clone();
    let mut p: BTreeMap<String, String> = BTreeMap::new();
    let abs = |name: &str| dir.join(name).display().to_string();
    graph_files(&mut p, "", &dir, &manifest)?;
    for (key, value) in [
        ("nLayers", spec.n_layers),
        ("headDim", spec.head_dim),
        ("nKvHeads", spec.n_kv_heads),
        ("nHeads", spec.n_heads),
        ("hiddenSize", spec.hidden_size),
        ("vocabSize", spec.vocab_size),
        ("slidingWindow", spec.sliding_window),
        ("globalLayerPeriod", spec.global_layer_period),
        ("chunk", spec.chunk),
        ("maskHeads", spec.mask_heads),
        ("seq", spec.seq),
    ] {
        p.insert(format!("spec.{key}"), value.to_string());
    }
    p.insert("spec.slidingRopeBase".into(), spec.sliding_rope_base.to_string());
    p.insert("spec.globalRopeBase".into(), spec.global_rope_base.to_string());

    // One shared module for all three graphs: `releasePrefill` must still disable prefill.
    let shared = cached_export(MODEL, &Target::cpu(), Layout::Shared)?;
    graph_files(&mut p, "shared.", &shared, &Manifest::load(&shared)?)?;

    // Seed artifacts whose with-past archive holds a second entry of the embedding's size (as an
    // untied model's output table would): `embeddings/<case>/` hold a copy of the with-past
    // vmfb and such an archive; `named` adds a manifest.json naming the table, `well-known` a
    // copy of the table named `token_embd.weight`, `bare` neither (an error must say where to
    // write the name).
    let embedding = manifest.embedding_parameter.as_deref().ok_or("no embeddingParameter")?;
    let with_past_vmfb = dir.join(&manifest.modules[&target][Graph::Step.key()]);
    let with_past_irpa = dir.join(manifest.parameter_file(Graph::Step).ok_or("no archive")?);
    for case in ["bare", "named", "well-known"] {
        let case_dir = out.join("embeddings").join(case);
        std::fs::create_dir_all(&case_dir)?;
        let vmfb = case_dir.join("with_past.vmfb");
        std::fs::copy(&with_past_vmfb, &vmfb)?;
        let archive = IrpaArchive::open(&with_past_irpa)?;
        let mut writer = IrpaWriter::new();
        for entry in archive.entries() {
            writer.add_data(entry.name(), archive.entry_data(entry)?.to_vec())?;
        }
        let table = archive.data(embedding)?;
        writer.add_data("output_table", vec![0u8; table.len()])?;
        match case {
            "named" => std::fs::write(
                case_dir.join("manifest.json"),
                format!("{{\"embeddingParameter\": \"{embedding}\"}}\n"),
            )?,
            "well-known" => {
                writer.add_data("token_embd.weight", table.to_vec())?;
            }
            _ => {}
        }
        let irpa = case_dir.join("with_past.irpa");
        writer.write(&irpa)?;
        p.insert(format!("embeddings.{case}.vmfb"), vmfb.display().to_string());
        p.insert(format!("embeddings.{case}.irpa"), irpa.display().to_string());
    }

    // The ids the JVM must reproduce, through the Rust API on the same artifacts.
    let mut decoder = KvDecoder::new(IreeKvBackend::open(&dir, IreeOptions::new("local-task"))?);
    let prefix = tokens(1, 30, spec.vocab_size);
    let utterances = [
        tokens(2, 5, spec.vocab_size),
        tokens(3, spec.chunk * 2 + 3, spec.vocab_size),
        tokens(4, spec.chunk, spec.vocab_size),
    ];
    let snapshot = decoder.prefill_prefix(&prefix)?;
    p.insert("prefix".into(), ids(&prefix));
    p.insert("prefix.position".into(), decoder.backend().position().to_string());
    p.insert("maxNew".into(), MAX_NEW.to_string());
    p.insert("utterances".into(), utterances.len().to_string());
    for (i, utterance) in utterances.iter().enumerate() {
        let generation = decoder.generate(&snapshot, utterance, None, MAX_NEW)?;
        p.insert(format!("utterance.{i}"), ids(utterance));
        p.insert(format!("expected.{i}"), ids(&generation.ids));
    }
    // The seed's three-archive layout on Vulkan (lavapipe here), and the ids the Rust API gives
    // there: a JVM session must open it and reproduce them.
    let vulkan = cached_export(MODEL, &Target::vulkan(), Layout::Three)?;
    graph_files(&mut p, "vulkan.", &vulkan, &Manifest::load(&vulkan)?)?;
    let mut on_vulkan = KvDecoder::new(IreeKvBackend::open(&vulkan, IreeOptions::new("vulkan"))?);
    let vulkan_snapshot = on_vulkan.prefill_prefix(&prefix)?;
    for (i, utterance) in utterances.iter().enumerate() {
        let generation = on_vulkan.generate(&vulkan_snapshot, utterance, None, MAX_NEW)?;
        p.insert(format!("vulkan.expected.{i}"), ids(&generation.ids));
    }
    drop(on_vulkan);

    // Contract v2 files (docs/contract-v2.md) behind the same ABI: the JVM opens them without a
    // prefill module (v2 has none; the library reads the contract from the step function) and
    // must reproduce the Rust API's ids on them.
    let v2 = cached_export_with(
        MODEL,
        &ExportOptions {
            targets: vec![Target::cpu()],
            layout: Layout::Three,
            contract: kv_core::ContractVersion::V2,
            ..ExportOptions::default()
        },
    )?;
    graph_files(&mut p, "v2.", &v2, &Manifest::load(&v2)?)?;
    let mut on_v2 = KvDecoder::new(IreeKvBackend::open(&v2, IreeOptions::new("local-task"))?);
    let v2_snapshot = on_v2.prefill_prefix(&prefix)?;
    for (i, utterance) in utterances.iter().enumerate() {
        let generation = on_v2.generate(&v2_snapshot, utterance, None, MAX_NEW)?;
        p.insert(format!("v2.expected.{i}"), ids(&generation.ids));
    }
    drop(on_v2);

    // Contract 1 graphs take no allowed-token mask: Engine must refuse constrained tools there.
    p.insert("engine.v1Dir".into(), dir.display().to_string());
    engine_fixture(&mut p, &out, &v2)?;

    // One prefill's first token on its own, for the raw-session test.
    let first = decoder.backend_mut().prefill(&prefix)?;
    p.insert("prefix.firstToken".into(), first.to_string());

    let redecode_vmfb = &manifest.modules[&target][Graph::Redecode.key()];
    let weights = manifest.weights_file().ok_or("no weights archive")?;
    let redecode_fn = manifest.functions.get(Graph::Redecode).ok_or("no redecode function")?;
    let mut redecode = RedecodeDecoder::new(IreeRedecodeBackend::open_files(
        "local-task",
        &dir.join(redecode_vmfb),
        &dir.join(weights),
        redecode_fn,
        None,
        spec.vocab_size,
        None,
    )?);
    let prompt = tokens(5, 9, spec.vocab_size);
    p.insert("redecode.vmfb".into(), abs(redecode_vmfb));
    p.insert("redecode.irpa".into(), abs(weights));
    p.insert("redecode.function".into(), redecode_fn.into());
    p.insert("redecode.prompt".into(), ids(&prompt));
    p.insert(
        "redecode.expected".into(),
        ids(&redecode.generate(&prompt, None, MAX_NEW)?),
    );
    let seq = redecode.backend_mut().seq();
    p.insert("redecode.seq".into(), seq.to_string());
    p.insert(
        "redecode.mismatch.vmfb".into(),
        mismatch_module(&out, seq)?.display().to_string(),
    );
    p.insert("redecode.mismatch.function".into(), "module.wrong_rank".into());

    let text: String = p.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    std::fs::write(out.join("fixture.properties"), text)?;
    println!("{}", out.join("fixture.properties").display());
    Ok(())
}

/// `{prefix}withPast.vmfb`, `.irpa`, `.function` and the same for `chunk` and `prefill` (when
/// the manifest has a prefill graph: contract v2 has none).
fn graph_files(
    p: &mut BTreeMap<String, String>,
    prefix: &str,
    dir: &Path,
    manifest: &Manifest,
) -> Result<(), Box<dyn std::error::Error>> {
    let target = manifest.modules.keys().next().ok_or("no modules")?;
    let abs = |name: &str| dir.join(name).display().to_string();
    for (key, graph) in [
        ("withPast", Graph::Step),
        ("chunk", Graph::Chunk),
        ("prefill", Graph::Prefill),
    ] {
        let Some(vmfb) = manifest.modules[target].get(graph.key()) else {
            continue;
        };
        p.insert(format!("{prefix}{key}.vmfb"), abs(vmfb));
        p.insert(
            format!("{prefix}{key}.irpa"),
            abs(manifest.parameter_file(graph).ok_or("no archive")?),
        );
        p.insert(
            format!("{prefix}{key}.function"),
            manifest.functions.get(graph).ok_or("no function")?.into(),
        );
    }
    Ok(())
}

/// A module whose function takes the redecode input but returns `[1, SEQ]` instead of `[SEQ]`.
fn mismatch_module(out: &Path, seq: usize) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let mlir = out.join("wrong_rank.mlir");
    let vmfb = out.join("wrong_rank.vmfb");
    std::fs::write(
        &mlir,
        format!(
            "func.func @wrong_rank(%t: tensor<1x{seq}xi32>) -> tensor<1x{seq}xi32> {{\n  return %t : tensor<1x{seq}xi32>\n}}\n"
        ),
    )?;
    export::compile(&mlir, &Target::cpu(), &vmfb)?;
    Ok(vmfb)
}

/// `engine.*`: the export `Engine.open` takes (`v2`, the contract v2 export above: it has the
/// allowed-token mask constrained decoding needs, and no top-k results, so sampling is refused
/// there), the tools file, the quickstart's calls through the Rust API on that export (the JVM
/// must reproduce them), and a catalog file of the same system prompt and tools made by another
/// model (on the reference: no export to pay for), which the engine must refuse.
fn engine_fixture(p: &mut BTreeMap<String, String>, out: &Path, v2: &Path) -> Result<(), Box<dyn std::error::Error>> {
    p.insert("engine.dir".into(), v2.display().to_string());
    let tools = std::fs::canonicalize(TOOLS)?;
    p.insert("engine.tools".into(), tools.display().to_string());
    let config = engine::ConversationConfig {
        system: Some("You control a smart home.".into()),
        tools_json: Some(std::fs::read_to_string(&tools)?),
        tool_choice: "required".into(),
        ..engine::ConversationConfig::default()
    };
    let engine = skainet_jni::app::open(v2, "local-task")?;
    p.insert("engine.requests".into(), REQUESTS.len().to_string());
    // A conversation per request, as the quickstart has it.
    for (i, request) in REQUESTS.iter().enumerate() {
        let reply = engine::Conversation::new(&engine, &config)?.send(request, |_| true)?;
        let calls: Vec<String> = reply
            .tool_calls
            .iter()
            .map(|c| format!("{} {}", c.name, serde_json::Value::Object(c.arguments.clone())))
            .collect();
        p.insert(format!("engine.request.{i}"), request.to_string());
        p.insert(format!("engine.expected.{i}"), calls.join(" | "));
    }
    engine.close();

    let other_dir = fixtures::materialize(OTHER_MODEL)?;
    let other_manifest = Manifest::load(&other_dir)?;
    let other = engine::Engine::new(
        ReferenceKv::new(ReferenceModel::open(&other_dir)?, WindowRule::Exact),
        engine::load_tokenizer(&other_dir, &other_manifest)?,
        OTHER_MODEL,
    )?;
    let file = out.join("other-model.skvsnap");
    if file.exists() {
        std::fs::remove_file(&file)?;
    }
    let with_file = engine::ConversationConfig {
        catalog_file: Some(file.clone()),
        ..config
    };
    engine::Conversation::new(&other, &with_file)?;
    p.insert(
        "engine.otherModelCatalog".into(),
        std::fs::canonicalize(&file)?.display().to_string(),
    );
    Ok(())
}
