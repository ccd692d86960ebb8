//! Which model an export belongs to. An export records in its provenance what it was made from
//! (the sha256 of the source's `manifest.json`, the stamp of its weights archive); a runtime given
//! artifacts and a model checks the one against the other ([`check_binding`]), so artifacts of
//! another model are refused instead of printing that model's tokens (or a false divergence).
//! Cheap by design: the source manifest is a few KB and the archive's stamp reads 2 MiB
//! (`kv_core::digests::stamp`), where hashing a 500 MB archive per run would not be.

use std::path::Path;

use kv_core::digests::{sha256_file, stamp, Digests};
use kv_core::manifest::{Provenance, MANIFEST_FILE};
use kv_core::Manifest;

use crate::{ExportError, Result};

/// Provenance key: the sha256 of the source model's `manifest.json`.
pub const SOURCE_MANIFEST_KEY: &str = "sourceManifestSha256";
/// Provenance key: [`stamp`] of the source model's weights archive.
pub const SOURCE_WEIGHTS_KEY: &str = "sourceWeightsStamp";

/// Records in `p` what the export of the model in `src_dir` (weights `weights`) is made from.
pub(crate) fn record_source(p: &mut Provenance, src_dir: &Path, weights: &str) -> Result<()> {
    let manifest = sha256_file(&src_dir.join(MANIFEST_FILE))?;
    let archive = stamp(&src_dir.join(weights))?;
    p.other.insert(SOURCE_MANIFEST_KEY.into(), serde_json::json!(manifest));
    p.other.insert(SOURCE_WEIGHTS_KEY.into(), serde_json::json!(archive));
    Ok(())
}

fn recorded<'a>(p: &'a Provenance, key: &str) -> Option<&'a str> {
    p.other.get(key).and_then(|v| v.as_str())
}

/// Why artifacts are not the model's: one line naming both.
fn mismatch(artifacts: &Path, from: &str, model: &str, detail: String) -> ExportError {
    ExportError::Binding(format!(
        "--artifacts {} were exported from {from}, not from --model {model} ({detail}); pass this model's export or \
         re-export it (skainet-kv export --model {model})",
        artifacts.display()
    ))
}

/// Whether the artifacts in `artifacts` were exported from the model in `model_dir` (named
/// `model` in errors). The export's own manifest is first checked against its digests (when it
/// has them), so a hand-edited manifest is reported as such, not as another model.
///
/// Exports that record their source (this exporter's) are bound by the source manifest's sha256
/// and the archive's stamp. Older ones are compared by what they kept of the source: the
/// architecture, the model's dimensions and RoPE bases, and the source's name where both have one.
pub fn check_binding(artifacts: &Path, model_dir: &Path, model: &str) -> Result<()> {
    let same = |a: &Path, b: &Path| match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(artifacts, model_dir) {
        return Ok(());
    }
    if let Some(digests) = Digests::load(artifacts)? {
        digests.check_open(artifacts, [])?;
    }
    let art = Manifest::load(artifacts)?;
    let src = Manifest::load(model_dir)?;
    let from = art
        .provenance
        .source
        .clone()
        .unwrap_or_else(|| "an unnamed model".into());
    if let Some(want) = recorded(&art.provenance, SOURCE_MANIFEST_KEY) {
        let got = sha256_file(&model_dir.join(MANIFEST_FILE))?;
        if got != want {
            return Err(mismatch(
                artifacts,
                &from,
                model,
                format!(
                    "source manifest sha256 {}…, {model}'s is {}…",
                    want.get(..12).unwrap_or(want),
                    &got[..12]
                ),
            ));
        }
        if let (Some(want), Some(weights)) = (recorded(&art.provenance, SOURCE_WEIGHTS_KEY), src.weights_file()) {
            let path = model_dir.join(weights);
            let got = stamp(&path)?;
            if got != want {
                return Err(mismatch(
                    artifacts,
                    &from,
                    model,
                    format!("{model}'s weights {} changed since the export", path.display()),
                ));
            }
        }
        return Ok(());
    }
    // An export made before sources were recorded: what it kept of its source must agree.
    let dims = |m: &Manifest| {
        let s = &m.spec;
        format!(
            "{} layers, hidden {}, {} heads / {} KV of {}, vocab {}, window {}/{}, rope {}/{}",
            s.n_layers,
            s.hidden_size,
            s.n_heads,
            s.n_kv_heads,
            s.head_dim,
            s.vocab_size,
            s.sliding_window,
            s.global_layer_period,
            s.sliding_rope_base,
            s.global_rope_base
        )
    };
    if dims(&art) != dims(&src) {
        return Err(mismatch(
            artifacts,
            &from,
            model,
            format!("{} against {}", dims(&art), dims(&src)),
        ));
    }
    if art.architecture != src.architecture {
        return Err(mismatch(artifacts, &from, model, "another architecture".into()));
    }
    for (what, a, s) in [
        ("source", &art.provenance.source, &src.provenance.source),
        ("weights", &art.provenance.weights, &src.provenance.weights),
        ("checkpoint", &art.provenance.source_name, &src.provenance.source_name),
    ] {
        if let (Some(a), Some(s)) = (a, s) {
            if a != s {
                return Err(mismatch(artifacts, &from, model, format!("{what} `{a}` against `{s}`")));
            }
        }
    }
    Ok(())
}
