//! Exports kept on disk: a model exported for a target and layout once, reused afterwards (the
//! demo's embedded model, the conformance suite's fixtures).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kv_core::manifest::MANIFEST_FILE;

use crate::{export_artifacts, ExportError, ExportOptions, Layout, Result, Source, Target};

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
    if dir.join(MANIFEST_FILE).is_file() {
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
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(ExportError::io("installing artifacts", &dir))?;
    Ok(dir)
}
