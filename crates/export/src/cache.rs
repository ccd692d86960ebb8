//! Exports kept on disk: a model exported for a target and layout once, reused afterwards (the
//! demo's embedded model, the conformance suite's fixtures).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kv_core::manifest::MANIFEST_FILE;

use crate::{export_artifacts, ExportError, ExportOptions, Layout, Result, Source, Target};

/// Beside a cached export: what it was made from, so a changed model (or a fixture whose
/// definition changed) is exported again instead of silently reused.
const FINGERPRINT_FILE: &str = "source.fingerprint";

/// The emitter's own version: bump when the graphs it writes change, so caches are refreshed.
const EMITTER_REVISION: u32 = 2;

/// A hash of the source manifest and weights (contents up to 64 MiB, length and mtime beyond).
fn source_fingerprint(model: &str) -> Result<String> {
    use std::hash::{Hash, Hasher};
    let dir = match Source::parse(model) {
        Source::Dir(dir) => dir,
        Source::Fixture(name) => fixtures::materialize(&name)?,
    };
    let manifest = kv_core::Manifest::load(&dir)?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (EMITTER_REVISION, crate::COMPILER_VERSION).hash(&mut hasher);
    let mut files = vec![dir.join(MANIFEST_FILE)];
    files.extend(manifest.weights_file().map(|w| dir.join(w)));
    for file in files {
        let meta = std::fs::metadata(&file).map_err(ExportError::io("reading", &file))?;
        meta.len().hash(&mut hasher);
        if meta.len() <= 64 << 20 {
            std::fs::read(&file)
                .map_err(ExportError::io("reading", &file))?
                .hash(&mut hasher);
        } else {
            meta.modified().ok().hash(&mut hasher);
        }
    }
    Ok(format!("{:016x}", hasher.finish()))
}

/// The export settings that run best on `target`, measured on FunctionGemma-270M's geometry
/// (docs/benchmarks.md): CPU modules take bf16 weights (IREE fuses the widening into the matmuls)
/// where Vulkan needs the packed form (IREE 3.13 miscompiles bf16 on Vulkan); and no module hoists
/// constant expressions, which otherwise materialises an f32 copy of the weights per function
/// (peak RSS 7.3 GB instead of 1.4 GB, 15 s to open instead of 0.8 s).
pub fn runtime_options(target: &Target) -> ExportOptions {
    ExportOptions {
        weights: match target {
            Target::Cpu { .. } => crate::WeightFormat::Bf16,
            Target::Vulkan { .. } => crate::WeightFormat::PackedI32,
        },
        compile_flags: vec!["--iree-opt-const-expr-hoisting=false".into()],
        ..ExportOptions::default()
    }
}

/// The default cache root: `$SKAINET_KV_CACHE/artifacts`, else `<workspace>/.cache/artifacts`.
pub fn cache_root() -> PathBuf {
    match std::env::var_os("SKAINET_KV_CACHE") {
        Some(dir) => PathBuf::from(dir).join("artifacts"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/artifacts"),
    }
}

/// The artifact directory of `model` (a fixture name or a model directory) for `target` and
/// `layout`, exporting it first unless a finished export is cached. Written beside the target and
/// renamed, so a crash never leaves half an artifact set that looks finished.
pub fn cached_export(model: &str, target: &Target, layout: Layout) -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let root = cache_root();
    let name = format!("{}-{}-{layout:?}", model.replace([':', '/'], "-"), target.key()).to_lowercase();
    let dir = root.join(&name);
    let fingerprint = source_fingerprint(model)?;
    let stamp = dir.join(FINGERPRINT_FILE);
    if dir.join(MANIFEST_FILE).is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == fingerprint) {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root).map_err(ExportError::io("creating artifact cache", &root))?;
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let options = ExportOptions {
        targets: vec![target.clone()],
        layout,
        ..ExportOptions::default()
    };
    export_artifacts(&Source::parse(model), &tmp, &options)?;
    let tmp_stamp = tmp.join(FINGERPRINT_FILE);
    std::fs::write(&tmp_stamp, &fingerprint).map_err(ExportError::io("writing fingerprint", &tmp_stamp))?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(ExportError::io("installing artifacts", &dir))?;
    Ok(dir)
}
