//! The embedding table, gathered on the host from the archive.

use std::path::Path;

use kv_core::irpa::{IrpaArchive, IrpaEntry};
use kv_core::quant::{QuantFormat, ScaleType};
use kv_core::{Error, KvSpec, Param, Result};

/// Names the table goes by in archives without a manifest, tried in this order: llama.cpp's
/// GGUF name, Hugging Face's (`model.embed_tokens.weight`, ...), the seed's exporter. `*x*`
/// matches names containing `x`.
const WELL_KNOWN: [Known; 3] = [
    Known::Param(Param::TokenEmbd),
    Known::Containing("embed_tokens"),
    Known::Exact("embed"),
];

/// A way the embedding table may be named.
#[derive(Clone, Copy)]
enum Known {
    Param(Param),
    Containing(&'static str),
    Exact(&'static str),
}

impl std::fmt::Display for Known {
    /// As the error names the pattern: `*x*` for names containing `x`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Known::Param(param) => write!(f, "{param}"),
            Known::Containing(inner) => write!(f, "*{inner}*"),
            Known::Exact(exact) => f.write_str(exact),
        }
    }
}

fn well_known(pattern: Known, name: &str) -> bool {
    match pattern {
        Known::Param(param) => name.parse() == Ok(param),
        Known::Containing(inner) => name.contains(inner),
        Known::Exact(exact) => name == exact,
    }
}

/// The `vocab × hidden` bf16 table of an archive, read row by row, never copied as a whole.
///
/// The archive must not be truncated or rewritten while the table is open (it is mapped; see
/// [`IrpaArchive`]); [`Self::gather`] checks the file's length and identity first and refuses a
/// changed file instead of reading it.
pub struct Embedding {
    archive: IrpaArchive,
    name: String,
    vocab: usize,
    hidden: usize,
    /// `Some`: the table is block-quantized ([`kv_core::quant`]), its scales in `NAME.scale`
    /// (their type told by their size).
    format: Option<(QuantFormat, ScaleType)>,
}

impl Embedding {
    /// The table named `name`, or, without a name, the seed's resolution without a manifest
    /// (well-known names, then byte size; see [`Self::open_beside`]).
    pub fn open(path: &Path, name: Option<&str>, spec: &KvSpec) -> Result<Self> {
        match name {
            Some(name) => Self::named(IrpaArchive::open(path)?, path, name, spec, ""),
            None => Self::resolve(IrpaArchive::open(path)?, path, None, spec),
        }
    }

    /// Finds the table of seed artifacts, which do not name it, as a user would expect: the
    /// `embeddingParameter` of a `manifest.json` beside `vmfb` when there is one, else a
    /// well-known name (`token_embd.weight`, `*embed_tokens*`, `embed`) of the table's size, else
    /// the one entry of that size. An ambiguity is an error that says what to write where.
    pub fn open_beside(path: &Path, vmfb: &Path, spec: &KvSpec) -> Result<Self> {
        let manifest = vmfb.parent().unwrap_or(Path::new("")).join("manifest.json");
        let archive = IrpaArchive::open(path)?;
        if manifest.is_file() {
            let text = std::fs::read_to_string(&manifest).map_err(|source| Error::Io {
                what: "read",
                path: manifest.display().to_string(),
                source,
            })?;
            let value: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::ManifestParse {
                path: manifest.display().to_string(),
                source,
            })?;
            match value.get("embeddingParameter") {
                Some(serde_json::Value::String(name)) => {
                    let by = format!(" (named by `embeddingParameter` in {})", manifest.display());
                    return Self::named(archive, path, name, spec, &by);
                }
                Some(other) => {
                    return Err(Error::manifest(
                        "embeddingParameter",
                        format!("{other} in {} is not a string", manifest.display()),
                    ))
                }
                None => {}
            }
        }
        Self::resolve(archive, path, Some((vmfb, manifest.as_path())), spec)
    }

    /// `by` says where the name came from, for errors.
    fn named(archive: IrpaArchive, path: &Path, name: &str, spec: &KvSpec, by: &str) -> Result<Self> {
        let bytes = table_bytes(spec)?;
        let entry = archive
            .get(name)
            .ok_or_else(|| Error::parameter(name, format!("not in {}{by}", path.display())))?;
        if let Some(format) = quantized_format(&archive, name, entry.len(), spec) {
            return Self::new(archive, name.to_string(), spec, Some(format));
        }
        if entry.len() != bytes {
            return Err(Error::parameter(
                name,
                format!(
                    "{} bytes, expected vocab {} x hidden {} bf16 = {bytes}{by}",
                    entry.len(),
                    spec.vocab_size,
                    spec.hidden_size
                ),
            ));
        }
        Self::new(archive, name.to_string(), spec, None)
    }

    /// Well-known names, then size. `beside` is the vmfb and the manifest path an error points
    /// to (none when the caller has no vmfb to put a manifest beside).
    fn resolve(archive: IrpaArchive, path: &Path, beside: Option<(&Path, &Path)>, spec: &KvSpec) -> Result<Self> {
        let bytes = table_bytes(spec)?;
        let sized = archive.find_by_size(bytes);
        let names = |entries: &[&IrpaEntry]| entries.iter().map(|e| e.name()).collect::<Vec<_>>().join(", ");
        for pattern in WELL_KNOWN {
            let found: Vec<&IrpaEntry> = sized
                .iter()
                .copied()
                .filter(|e| well_known(pattern, e.name()))
                .collect();
            match found.as_slice() {
                [] => continue,
                [one] => {
                    let name = one.name().to_string();
                    return Self::new(archive, name, spec, None);
                }
                many => {
                    return Err(ambiguous(
                        format!("{} entries named like `{pattern}` ({})", many.len(), names(many)),
                        bytes,
                        path,
                        beside,
                    ))
                }
            }
        }
        match sized.as_slice() {
            [one] => {
                let name = one.name().to_string();
                Self::new(archive, name, spec, None)
            }
            [] => Err(Error::parameter(
                "<embedding>",
                format!(
                    "no entry of {bytes} bytes (vocab {} x hidden {} bf16) in {}",
                    spec.vocab_size,
                    spec.hidden_size,
                    path.display()
                ),
            )),
            many => Err(ambiguous(
                format!("{} entries ({})", many.len(), names(many)),
                bytes,
                path,
                beside,
            )),
        }
    }

    fn new(
        archive: IrpaArchive,
        name: String,
        spec: &KvSpec,
        format: Option<(QuantFormat, ScaleType)>,
    ) -> Result<Self> {
        archive.data(&name)?;
        if format.is_some() {
            archive.data(&kv_core::quant::scale_name(&name))?;
        }
        Ok(Embedding {
            archive,
            name,
            vocab: spec.vocab_size,
            hidden: spec.hidden_size,
            format,
        })
    }

    /// The table's block-quantized format (`None`: bf16).
    pub fn format(&self) -> Option<QuantFormat> {
        self.format.map(|(f, _)| f)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `[tokens.len(), hidden]` f32 rows. Token ids are checked by the caller's plan.
    ///
    /// Errs, before reading, when the archive file changed since it was opened.
    pub fn gather(&self, tokens: &[i32]) -> Result<Vec<f32>> {
        self.archive.check_unchanged()?;
        // The row's bytes (and its block scales) are read, not borrowed from the mapping: see
        // IrpaArchive::read_into.
        let scale_name = self.format.map(|_| kv_core::quant::scale_name(&self.name));
        let row_bytes = match self.format {
            Some((format, _)) => format.value_bytes(self.hidden),
            None => self.hidden * 2,
        };
        let mut bytes = vec![0u8; row_bytes];
        let scale_bytes = self.format.map_or(0, |(_, ty)| ty.scale_bytes(self.hidden));
        let mut scales = vec![0u8; scale_bytes];
        let len = tokens.len().checked_mul(self.hidden).ok_or_else(|| {
            Error::parameter(
                &self.name,
                format!("{} rows of {} exceed the address space", tokens.len(), self.hidden),
            )
        })?;
        let mut out = vec![0.0f32; len];
        for (row, &t) in out.chunks_exact_mut(self.hidden).zip(tokens) {
            let t = t as usize;
            if t >= self.vocab {
                kv_core::error::invariant("embedding gather of an unchecked token id");
            }
            self.archive.read_into(&self.name, (t * row_bytes) as u64, &mut bytes)?;
            match (self.format, &scale_name) {
                // The same values as the graphs' dequantization (`f32(q) * scale`).
                (Some((format, ty)), Some(scale_name)) => {
                    self.archive
                        .read_into(scale_name, (t * scale_bytes) as u64, &mut scales)?;
                    kv_core::quant::dequantize_range(format, ty, &bytes, &scales, 0, row)
                }
                _ => kv_core::bf16::bf16_bytes_to_f32_into(&bytes, row)
                    .unwrap_or_else(|_| kv_core::error::invariant("embedding row length")),
            }
        }
        Ok(out)
    }
}

/// The format of a block-quantized table `name` of `len` value bytes and its scales' type: its
/// `NAME.scale` entry exists and both have the sizes of a `vocab × hidden` q8 or q4 table (rows
/// of whole blocks) with f32 or f16 scales.
fn quantized_format(archive: &IrpaArchive, name: &str, len: u64, spec: &KvSpec) -> Option<(QuantFormat, ScaleType)> {
    if spec.hidden_size % kv_core::quant::BLOCK != 0 {
        return None;
    }
    let numel = spec.vocab_size.checked_mul(spec.hidden_size)?;
    let scales = archive.get(&kv_core::quant::scale_name(name))?;
    let ty = [ScaleType::F32, ScaleType::F16]
        .into_iter()
        .find(|ty| ty.scale_bytes(numel) as u64 == scales.len())?;
    [QuantFormat::Q8, QuantFormat::Q4]
        .into_iter()
        .find(|f| f.value_bytes(numel) as u64 == len)
        .map(|f| (f, ty))
}

/// Bytes of a `vocab × hidden` bf16 table. Checked: the geometry is the caller's (a Kotlin
/// `IreeKvSpec`), and on 32-bit ARM the product of two valid ints wraps `usize`; rows are
/// addressed in memory, so the table must fit `usize`.
fn table_bytes(spec: &KvSpec) -> Result<u64> {
    spec.vocab_size
        .checked_mul(spec.hidden_size)
        .and_then(|n| n.checked_mul(2))
        .map(|n| n as u64)
        .ok_or_else(|| {
            Error::parameter(
                "<embedding>",
                format!(
                    "vocab {} x hidden {} bf16 exceeds the address space ({}-bit)",
                    spec.vocab_size,
                    spec.hidden_size,
                    usize::BITS
                ),
            )
        })
}

fn ambiguous(what: String, bytes: u64, path: &Path, beside: Option<(&Path, &Path)>) -> Error {
    let fix = match beside {
        Some((vmfb, manifest)) if manifest.is_file() => format!(
            "add `\"embeddingParameter\": \"<entry name>\"` to {} (beside {})",
            manifest.display(),
            vmfb.display()
        ),
        Some((vmfb, manifest)) => format!(
            "write `{{\"embeddingParameter\": \"<entry name>\"}}` into {} (a manifest.json beside {})",
            manifest.display(),
            vmfb.display()
        ),
        None => "name it with the manifest's `embeddingParameter`".to_string(),
    };
    Error::parameter(
        "<embedding>",
        format!(
            "cannot tell the embedding table of {}: {what} have its size ({bytes} bytes, vocab x hidden bf16); {fix}",
            path.display()
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use kv_core::irpa::IrpaWriter;

    use super::*;

    const VOCAB: usize = 8;
    const HIDDEN: usize = 4;

    fn spec() -> KvSpec {
        KvSpec {
            vocab_size: VOCAB,
            hidden_size: HIDDEN,
            ..KvSpec::default()
        }
    }

    /// Row `t` of table `k` holds `k * 100 + t` in every column.
    fn table(k: usize) -> Vec<f32> {
        (0..VOCAB * HIDDEN).map(|i| (k * 100 + i / HIDDEN) as f32).collect()
    }

    /// An archive of `entries` (name, table number) and a vmfb path beside it, in a fresh dir.
    fn archive(entries: &[(&str, usize)]) -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let mut w = IrpaWriter::new();
        w.add_f32("norm", &[1.0; HIDDEN]).unwrap();
        for &(name, k) in entries {
            w.add_bf16_from_f32(name, &table(k)).unwrap();
        }
        let path = dir.path().join("with_past.irpa");
        w.write(&path).unwrap();
        let vmfb = dir.path().join("with_past.vmfb");
        (dir, path, vmfb)
    }

    fn found(entries: &[(&str, usize)]) -> String {
        let (_dir, path, vmfb) = archive(entries);
        Embedding::open_beside(&path, &vmfb, &spec())
            .unwrap()
            .name()
            .to_string()
    }

    fn error(path: &Path, vmfb: &Path) -> String {
        match Embedding::open_beside(path, vmfb, &spec()) {
            Ok(e) => panic!("found `{}`", e.name()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn seed_tables_are_found_by_well_known_names_then_size() {
        assert_eq!(found(&[("p3", 0)]), "p3");
        assert_eq!(
            found(&[("output.weight", 1), ("token_embd.weight", 0)]),
            "token_embd.weight"
        );
        assert_eq!(
            found(&[("lm_head.weight", 1), ("model.embed_tokens.weight", 0)]),
            "model.embed_tokens.weight"
        );
        assert_eq!(found(&[("out", 1), ("embed", 0)]), "embed");
        // A well-known name of another size does not count.
        let (_dir, path, vmfb) = archive(&[("p1", 0)]);
        let mut w = IrpaWriter::new();
        w.add_f32("token_embd.weight", &[0.0; 3]).unwrap();
        w.add_bf16_from_f32("p1", &table(0)).unwrap();
        w.write(&path).unwrap();
        assert_eq!(Embedding::open_beside(&path, &vmfb, &spec()).unwrap().name(), "p1");
    }

    #[test]
    fn a_manifest_beside_the_vmfb_names_the_table() {
        let (dir, path, vmfb) = archive(&[("p1", 1), ("p2", 0), ("token_embd.weight", 2)]);
        let manifest = dir.path().join("manifest.json");
        std::fs::write(&manifest, r#"{"contractVersion": 1, "embeddingParameter": "p2"}"#).unwrap();
        let e = Embedding::open_beside(&path, &vmfb, &spec()).unwrap();
        assert_eq!(e.name(), "p2");
        assert_eq!(e.gather(&[3]).unwrap(), vec![3.0; HIDDEN]);

        std::fs::write(&manifest, r#"{"embeddingParameter": "nope"}"#).unwrap();
        let err = error(&path, &vmfb);
        assert!(
            err.contains("nope") && err.contains(&manifest.display().to_string()),
            "{err}"
        );
        std::fs::write(&manifest, r#"{"embeddingParameter": "norm"}"#).unwrap();
        let err = error(&path, &vmfb);
        assert!(err.contains("bytes, expected vocab 8 x hidden 4"), "{err}");
        std::fs::write(&manifest, "{").unwrap();
        assert!(error(&path, &vmfb).contains("manifest.json"));
        // A manifest without the key: well-known names decide.
        std::fs::write(&manifest, r#"{"contractVersion": 1}"#).unwrap();
        assert_eq!(
            Embedding::open_beside(&path, &vmfb, &spec()).unwrap().name(),
            "token_embd.weight"
        );
    }

    #[test]
    fn an_ambiguous_table_says_what_to_write_where() {
        let (dir, path, vmfb) = archive(&[("p1", 1), ("p2", 0)]);
        let manifest = dir.path().join("manifest.json");
        let err = error(&path, &vmfb);
        assert!(
            err.contains("2 entries (p1, p2)")
                && err.contains(&format!(
                    "into {} (a manifest.json beside {})",
                    manifest.display(),
                    vmfb.display()
                )),
            "{err}"
        );
        std::fs::write(&manifest, r#"{"contractVersion": 1}"#).unwrap();
        let err = error(&path, &vmfb);
        assert!(
            err.contains(&format!(
                "add `\"embeddingParameter\": \"<entry name>\"` to {}",
                manifest.display()
            )),
            "{err}"
        );
        let (_dir, path, vmfb) = archive(&[("a.embed_tokens", 1), ("b.embed_tokens", 0)]);
        let err = error(&path, &vmfb);
        assert!(err.contains("2 entries named like `*embed_tokens*`"), "{err}");
        let (_dir, path, vmfb) = archive(&[]);
        assert!(error(&path, &vmfb).contains("no entry of 64 bytes"));
    }

    #[test]
    fn a_table_larger_than_the_address_space_is_an_error() {
        let (_dir, path, _) = archive(&[("token_embd.weight", 0)]);
        for (vocab, hidden) in [(usize::MAX / 2 + 1, 1), (1 << 40, 1 << 40), (usize::MAX, usize::MAX)] {
            let spec = KvSpec {
                vocab_size: vocab,
                hidden_size: hidden,
                ..spec()
            };
            for name in [Some("token_embd.weight"), None] {
                let err = match Embedding::open(&path, name, &spec) {
                    Ok(_) => panic!("opened a {vocab} x {hidden} table"),
                    Err(e) => e.to_string(),
                };
                assert!(err.contains("exceeds the address space"), "{vocab} x {hidden}: {err}");
            }
        }
    }

    #[test]
    fn a_changed_archive_is_an_error_before_the_gather() {
        let (dir, path, _) = archive(&[("token_embd.weight", 0)]);
        let e = Embedding::open(&path, Some("token_embd.weight"), &spec()).unwrap();
        assert_eq!(e.gather(&[1, 7]).unwrap()[HIDDEN..], [7.0; HIDDEN]);
        // Truncated under the mapping: reading the table would raise SIGBUS.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        let err = e.gather(&[7]).unwrap_err().to_string();
        assert!(
            err.contains("changed since it was opened") && err.contains("bytes at open"),
            "{err}"
        );

        // Replaced by a rename: the session's table is no longer the file's.
        let (_d, fresh, _) = archive(&[("token_embd.weight", 1)]);
        let path = dir.path().join("replaced.irpa");
        std::fs::copy(&fresh, &path).unwrap();
        let e = Embedding::open(&path, None, &spec()).unwrap();
        std::fs::rename(&fresh, &path).unwrap();
        let err = e.gather(&[0]).unwrap_err().to_string();
        assert!(err.contains("replaced"), "{err}");
    }

    /// A block-quantized table (values + `NAME.scale`) named by the manifest is gathered as the
    /// graphs dequantize it: `f32(q) * scale`, for q8 and q4.
    #[test]
    fn quantized_tables_gather_dequantized_rows() {
        let spec = KvSpec {
            vocab_size: 3,
            hidden_size: 64,
            ..KvSpec::default()
        };
        let values: Vec<f32> = (0..3 * 64).map(|i| ((i * 37 % 23) as f32 - 11.0) / 17.0).collect();
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            for ty in [ScaleType::F32, ScaleType::F16] {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("model.irpa");
                let mut w = IrpaWriter::new();
                kv_core::quant::add_quantized(&mut w, format, ty, "token_embd.weight", &values).unwrap();
                w.write(&path).unwrap();
                let e = Embedding::open(&path, Some("token_embd.weight"), &spec).unwrap();
                assert_eq!(e.format, Some((format, ty)));
                let archive = IrpaArchive::open(&path).unwrap();
                let (q, sc) = kv_core::quant::entries(&archive, "token_embd.weight").unwrap();
                let all = kv_core::quant::dequantize(format, ty, "t", 3 * 64, q, sc).unwrap();
                let got = e.gather(&[2, 0]).unwrap();
                assert_eq!(&got[..64], &all[128..], "{format:?} {ty:?}");
                assert_eq!(&got[64..], &all[..64], "{format:?} {ty:?}");
            }
        }
    }
}
