//! An export directory as an app ships it: the files a session reads, listed with their sizes
//! in `files.json` (`kv_core::digests::FileList`), the exporter's intermediates (the `.mlir`
//! sources, the kernels' C and objects) removed on request, the digests rewritten to cover the
//! list and the tokenizer (docs/android.md).

use std::collections::BTreeSet;
use std::path::Path;

use kv_core::digests::{Digests, FileList, TOKENIZER_FILE};
use kv_core::manifest::{Parameters, MANIFEST_FILE};
use kv_core::Manifest;

use crate::{ExportError, Result};

/// The files of `manifest` a session may read: the manifest, every module, every archive and
/// encoded archive, and `tokenizer.gguf` when `dir` has one.
pub fn runtime_files(dir: &Path, manifest: &Manifest) -> BTreeSet<String> {
    let mut files = BTreeSet::from([MANIFEST_FILE.to_string()]);
    files.extend(manifest.modules.values().flat_map(|m| m.values().cloned()));
    match &manifest.parameters {
        Some(Parameters::Shared(file)) => {
            files.insert(file.clone());
        }
        Some(Parameters::PerGraph(map)) => files.extend(map.values().cloned()),
        None => {}
    }
    files.extend(manifest.encoded_parameters.values().cloned());
    if dir.join(TOKENIZER_FILE).is_file() {
        files.insert(TOKENIZER_FILE.to_string());
    }
    files
}

/// Whether `name` is one of the exporter's intermediates: what `iree-compile` and clang read,
/// never a session.
fn is_intermediate(name: &str) -> bool {
    [".mlir", ".c", ".o"].iter().any(|ext| name.ends_with(ext))
}

/// Writes `dir/files.json` over [`runtime_files`] (after removing the intermediates when
/// `strip` is set) and the digests again, last, so they cover it. Call it after everything else
/// is in `dir` (the tokenizer included).
pub fn finish(dir: &Path, strip: bool) -> Result<FileList> {
    let manifest = Manifest::load(dir)?;
    let files = runtime_files(dir, &manifest);
    if strip {
        let entries = std::fs::read_dir(dir).map_err(ExportError::io("listing", dir))?;
        for entry in entries {
            let entry = entry.map_err(ExportError::io("listing", dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_intermediate(&name) && !files.contains(&name) && entry.file_type().is_ok_and(|t| t.is_file()) {
                let path = entry.path();
                std::fs::remove_file(&path).map_err(ExportError::io("removing", &path))?;
            }
        }
    }
    let list = FileList::write(dir, files.iter().map(String::as_str))?;
    Digests::write(dir)?;
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intermediates_are_the_compilers_inputs_only() {
        for name in ["model.mlir", "q4_matvec_aarch64.c", "q4_matvec_aarch64.o"] {
            assert!(is_intermediate(name), "{name}");
        }
        for name in [
            "model.llvm-cpu.vmfb",
            "model.irpa",
            "tokenizer.gguf",
            "manifest.json",
            "files.json",
        ] {
            assert!(!is_intermediate(name), "{name}");
        }
    }
}
