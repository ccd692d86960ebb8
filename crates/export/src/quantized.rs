//! Quantized copies of a model directory (`export --weights q8|q4` of a fixture or a bf16
//! directory): [`kv_core::quant::quantize_dir`] run once into `quantized/` in the cache and
//! reused while its key matches.
//!
//! The key is what the copy is made of, not a revision number: the source's manifest and
//! weights ([`crate::plan::source_digest`]), the format, the scale type, and the quantizer's
//! behaviour ([`quantizer_digest`]: its output on a fixed probe, and its choice of which of the
//! source's parameters it quantizes). A change of the quantizer's arithmetic, rounding, packing
//! or selection is a new key without anyone bumping anything; a change that leaves every probe
//! block and every selection alike but differs elsewhere (the copy's manifest fields) is not
//! caught here, but reaches the export cache anyway, whose key hashes the copy's manifest.

use std::path::{Path, PathBuf};

use kv_core::params::parameter_table;
use kv_core::quant::{QuantFormat, ScaleType};
use sha2::{Digest, Sha256};

use crate::{ExportError, Result};

/// Beside a quantized copy: the key it was made with.
const STAMP_FILE: &str = "quantized-from.txt";

/// The quantizer's behaviour as a sha256 (hex): [`kv_core::quant::quantize`] of `format` over
/// a fixed probe (blocks of zeros, of one value, of mixed signs and magnitudes, with ties and a
/// block whose largest magnitude is negative), values and scales bytes, plus the default scale
/// type.
pub fn quantizer_digest(format: QuantFormat) -> String {
    const BLOCK: usize = kv_core::quant::BLOCK;
    let mut probe: Vec<f32> = Vec::new();
    probe.extend(std::iter::repeat_n(0.0, BLOCK));
    probe.extend(std::iter::repeat_n(0.75, BLOCK));
    // Mixed magnitudes from a fixed LCG (reproducible everywhere: integer arithmetic only).
    let mut state: u32 = 0x2545_f491;
    for _ in 0..6 * BLOCK {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let unit = (state >> 8) as f32 / (1u32 << 24) as f32; // [0, 1)
        probe.push((unit - 0.5) * 6.0);
    }
    // Halfway values (rounding ties) and a block whose extreme is negative (Q4 keeps the sign).
    probe.extend((0..BLOCK).map(|i| (i as f32 - 16.0) * 0.5));
    probe.extend((0..BLOCK).map(|i| if i == 3 { -9.0 } else { i as f32 * 0.25 }));
    let scale_type = ScaleType::default();
    let (values, scales) = kv_core::quant::quantize(format, scale_type, &probe);
    let mut h = Sha256::new();
    h.update(format.key().as_bytes());
    h.update(scale_type.key().as_bytes());
    h.update(&values);
    h.update(kv_core::quant::scales_to_bytes(&scales, scale_type));
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key of `src` quantized to `format`: see the module docs.
fn copy_key(src: &Path, format: QuantFormat) -> Result<String> {
    let manifest = kv_core::Manifest::load(src)?;
    let weights = manifest
        .weights_file()
        .ok_or_else(|| kv_core::Error::manifest("parameters", "the source manifest names no weights archive"))?;
    let arch = manifest.require_architecture()?;
    let chosen: Vec<String> = parameter_table(&manifest.spec, arch)
        .iter()
        .filter(|p| kv_core::quant::quantizable(p))
        .map(|p| p.name.to_string())
        .collect();
    Ok(format!(
        "source {}\nformat {}\nscales {}\nquantizer {}\nquantized {}\n",
        crate::plan::source_digest(src, weights)?,
        format.key(),
        ScaleType::default().key(),
        quantizer_digest(format),
        chosen.join(",")
    ))
}

/// `src` quantized to `format` in the cache at `root` (its own directory per source and
/// format), made now (under the cache's lock: processes quantizing the same model at once wait
/// for the first) unless a copy with this key is there. A source that is already quantized is
/// returned as it is.
pub fn quantized_copy_in(root: &Path, src: &Path, format: QuantFormat) -> Result<PathBuf> {
    let manifest = kv_core::Manifest::load(src)?;
    if manifest.quantization.is_some() {
        return Ok(src.to_path_buf());
    }
    let key = copy_key(src, format)?;
    let src_abs = std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf());
    let label: String = src_abs
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let dir = root.join(format!("{}-{}", label.trim_matches('-'), format.key()));
    let fresh = |dir: &Path| {
        std::fs::read_to_string(dir.join(STAMP_FILE)).is_ok_and(|s| s == key) && kv_core::Manifest::load(dir).is_ok()
    };
    let build = |tmp: &Path| -> Result<()> {
        kv_core::quant::quantize_dir(src, tmp, format)?;
        let stamp = tmp.join(STAMP_FILE);
        std::fs::write(&stamp, &key).map_err(ExportError::io("writing", &stamp))
    };
    kv_paths::fill_entry(&dir, fresh, build, &mut |_| {})
        .map_err(|e| e.into_error(|what, path, source| ExportError::io(what, &path)(source)))
}

/// [`quantized_copy_in`] `quantized/` in the project's cache ([`kv_paths::Root::Cache`]).
pub fn quantized_copy(src: &Path, format: QuantFormat) -> Result<PathBuf> {
    let root = kv_paths::Root::Cache
        .join("quantized")
        .map_err(ExportError::io("locating the quantized cache", Path::new("quantized/")))?;
    quantized_copy_in(&root, src, format)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned: the probe's digest changes exactly when the quantizer's output does. A deliberate
    /// change of the quantizer updates these (and re-quantizes every cached copy once).
    #[test]
    fn quantizer_digests_are_pinned() {
        assert_eq!(quantizer_digest(QuantFormat::Q8), quantizer_digest(QuantFormat::Q8));
        assert_ne!(quantizer_digest(QuantFormat::Q8), quantizer_digest(QuantFormat::Q4));
        assert_eq!(quantizer_digest(QuantFormat::Q8), Q8_DIGEST, "q8");
        assert_eq!(quantizer_digest(QuantFormat::Q4), Q4_DIGEST, "q4");
    }

    const Q8_DIGEST: &str = "ee5a222d2ccee983d361e6341852a42de341f7ed76f91722b0732f902f5065f0";
    const Q4_DIGEST: &str = "905517c9947f363d0036cee4bc9fe2e6cee65aa8b59b720836e8847b25b67b41";

    /// A copy is made once, reused while its key holds, and made again when the source changes.
    #[test]
    fn copies_are_reused_until_the_source_changes() {
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("src");
        copy_fixture(&src);
        let cache = root.path().join("cache");
        let first = quantized_copy_in(&cache, &src, QuantFormat::Q8).unwrap();
        let stamp = std::fs::read_to_string(first.join(STAMP_FILE)).unwrap();
        let mtime = std::fs::metadata(first.join(STAMP_FILE)).unwrap().modified().unwrap();
        assert!(stamp.contains(&quantizer_digest(QuantFormat::Q8)), "{stamp}");
        let again = quantized_copy_in(&cache, &src, QuantFormat::Q8).unwrap();
        assert_eq!(again, first);
        assert_eq!(
            std::fs::metadata(first.join(STAMP_FILE)).unwrap().modified().unwrap(),
            mtime,
            "reused, not rewritten"
        );
        // A quantized source is its own copy.
        assert_eq!(quantized_copy_in(&cache, &first, QuantFormat::Q4).unwrap(), first);
        // The source's weights change: the key does, and the copy is made again.
        let manifest = kv_core::Manifest::load(&src).unwrap();
        let weights = src.join(manifest.weights_file().unwrap());
        let mut bytes = std::fs::read(&weights).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        std::fs::write(&weights, bytes).unwrap();
        let changed = quantized_copy_in(&cache, &src, QuantFormat::Q8).unwrap();
        assert_eq!(changed, first, "same directory");
        assert_ne!(std::fs::read_to_string(changed.join(STAMP_FILE)).unwrap(), stamp);
    }

    fn copy_fixture(to: &Path) {
        let from = fixtures::materialize("tiny-llama:3").unwrap();
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}
