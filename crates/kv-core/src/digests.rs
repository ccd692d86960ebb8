//! What an export wrote, by content: `digests.json` beside `manifest.json`, written by the
//! exporter and checked before a module runs. IREE runs a module's native code, so a module
//! damaged on disk (one flipped byte gave SIGILL, SIGTRAP or wrong tokens) must be refused, not
//! run, and a manifest edited by hand (a RoPE base) must not silently change the output.
//!
//! Each file has its size and sha256; archives (`.irpa`, hundreds of MB) also a stamp: the
//! sha256 of their size and of their first and last MiB (the whole file when it is smaller). At
//! open ([`Digests::check_open`]) `manifest.json` and the modules a session loads are hashed in
//! full and its archives checked by stamp; [`Digests::verify`] (`skainet-kv verify`) hashes
//! every file in full.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::manifest::MANIFEST_FILE;

/// The digests' file in an artifact directory.
pub const DIGESTS_FILE: &str = "digests.json";

/// What the stamp of an archive reads at each end.
const STAMP_SPAN: u64 = 1 << 20;

/// `digests.json`: file name (relative to the artifact directory) → its digests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Digests {
    pub version: u32,
    pub files: BTreeMap<String, FileDigest>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub size: u64,
    pub sha256: String,
    /// Archives only: [`stamp`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// A file that is not what `digests.json` says: one line naming it, and what to do.
fn damaged(path: &Path, what: String) -> Error {
    Error::Io {
        what: "refusing damaged artifact",
        path: path.display().to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what}: changed after export (damaged or edited); re-export the model"),
        ),
    }
}

/// The sha256 of a whole file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(io("reading", path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io("reading", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// The cheap identity of a large file: the sha256 of its size and of its first and last MiB.
pub fn stamp(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(io("reading", path))?;
    let size = file.metadata().map_err(io("reading", path))?.len();
    let mut hasher = Sha256::new();
    hasher.update(size.to_le_bytes());
    let mut read_at = |offset: u64, len: u64| -> std::io::Result<()> {
        let mut buf = vec![0u8; len as usize];
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(&mut buf)?;
        hasher.update(&buf);
        Ok(())
    };
    if size <= 2 * STAMP_SPAN {
        read_at(0, size).map_err(io("reading", path))?;
    } else {
        read_at(0, STAMP_SPAN).map_err(io("reading", path))?;
        read_at(size - STAMP_SPAN, STAMP_SPAN).map_err(io("reading", path))?;
    }
    Ok(hex(&hasher.finalize()))
}

fn is_archive(name: &str) -> bool {
    name.ends_with(".irpa")
}

/// Whether `name` is covered: the manifest, modules, archives, the tokenizer and the file list
/// (not the `.mlir` sources or kernel objects, which nothing loads at run time).
fn is_covered(name: &str) -> bool {
    name == MANIFEST_FILE || name == TOKENIZER_FILE || name == FILES_FILE || name.ends_with(".vmfb") || is_archive(name)
}

/// The export's file list ([`FileList`]) beside `manifest.json`.
pub const FILES_FILE: &str = "files.json";

/// The model's tokenizer and chat template in an export directory: a GGUF file holding only the
/// source GGUF's `tokenizer.*` metadata (no tensors), read by `tokenizer::Tokenizer::from_gguf`.
pub const TOKENIZER_FILE: &str = "tokenizer.gguf";

/// `files.json`: every file a session of the export reads (the manifest, modules, archives, the
/// tokenizer when the source had one) with its size in bytes: the assets an app ships, with
/// `files.json` and [`DIGESTS_FILE`] themselves (which covers this list). Written after the
/// manifest, before the digests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileList {
    pub version: u32,
    pub files: BTreeMap<String, u64>,
}

impl FileList {
    /// Lists `names` (relative to `dir`) with their sizes and writes `dir/files.json`.
    pub fn write<'a>(dir: &Path, names: impl IntoIterator<Item = &'a str>) -> Result<FileList> {
        let mut files = BTreeMap::new();
        for name in names {
            let path = dir.join(name);
            let size = std::fs::metadata(&path).map_err(io("reading", &path))?.len();
            files.insert(name.to_string(), size);
        }
        let list = FileList { version: 1, files };
        let path = dir.join(FILES_FILE);
        let text = serde_json::to_string_pretty(&list).unwrap_or_default();
        std::fs::write(&path, text + "\n").map_err(io("writing", &path))?;
        Ok(list)
    }

    /// `dir`'s `files.json`, `None` when it has none (exports made before it).
    pub fn load(dir: &Path) -> Result<Option<FileList>> {
        let path = dir.join(FILES_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("reading", &path)(e)),
        };
        let list: FileList = serde_json::from_str(&text).map_err(|e| damaged(&path, format!("not valid ({e})")))?;
        if list.version != 1 {
            return Err(damaged(&path, format!("version {} (this build reads 1)", list.version)));
        }
        Ok(Some(list))
    }

    /// What an app copies: the listed files, `files.json` and `digests.json`, sorted.
    pub fn assets(&self) -> Vec<String> {
        let mut names: Vec<String> = self.files.keys().cloned().collect();
        names.extend([FILES_FILE.to_string(), DIGESTS_FILE.to_string()]);
        names.sort();
        names
    }
}

impl Digests {
    /// Hashes the manifest, every module and every archive in `dir` and writes `digests.json`.
    pub fn write(dir: &Path) -> Result<Digests> {
        let mut files = BTreeMap::new();
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map_err(io("listing", dir))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_covered(n))
            .collect();
        names.sort();
        for name in names {
            let path = dir.join(&name);
            let size = std::fs::metadata(&path).map_err(io("reading", &path))?.len();
            let digest = FileDigest {
                size,
                sha256: sha256_file(&path)?,
                stamp: is_archive(&name).then(|| stamp(&path)).transpose()?,
            };
            files.insert(name, digest);
        }
        let digests = Digests { version: 1, files };
        let path = dir.join(DIGESTS_FILE);
        let text = serde_json::to_string_pretty(&digests).unwrap_or_default();
        std::fs::write(&path, text + "\n").map_err(io("writing", &path))?;
        Ok(digests)
    }

    /// `dir`'s `digests.json`, `None` when it has none (an export made before digests were
    /// written, or artifacts put together by hand). An unreadable file is an error.
    pub fn load(dir: &Path) -> Result<Option<Digests>> {
        let path = dir.join(DIGESTS_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("reading", &path)(e)),
        };
        let digests: Digests = serde_json::from_str(&text).map_err(|e| damaged(&path, format!("not valid ({e})")))?;
        if digests.version != 1 {
            return Err(damaged(
                &path,
                format!("version {} (this build reads 1)", digests.version),
            ));
        }
        Ok(Some(digests))
    }

    fn entry(&self, dir: &Path, name: &str) -> Result<(PathBuf, &FileDigest)> {
        let path = dir.join(name);
        let digest = self
            .files
            .get(name)
            .ok_or_else(|| damaged(&path, format!("not listed in {DIGESTS_FILE}")))?;
        let size = std::fs::metadata(&path).map_err(io("reading", &path))?.len();
        if size != digest.size {
            return Err(damaged(
                &path,
                format!("{size} bytes, {DIGESTS_FILE} says {}", digest.size),
            ));
        }
        Ok((path, digest))
    }

    fn check_full(&self, dir: &Path, name: &str) -> Result<()> {
        let (path, digest) = self.entry(dir, name)?;
        let got = sha256_file(&path)?;
        if got != digest.sha256 {
            return Err(damaged(
                &path,
                format!("sha256 {}…, {DIGESTS_FILE} says {}…", &got[..12], short(&digest.sha256)),
            ));
        }
        Ok(())
    }

    /// The check before a session runs: `manifest.json` and the modules in `files` hashed in
    /// full, the archives in `files` by size and stamp. `files` are relative to `dir`.
    pub fn check_open<'a>(&self, dir: &Path, files: impl IntoIterator<Item = &'a str>) -> Result<()> {
        self.check_full(dir, MANIFEST_FILE)?;
        self.check_files(dir, files)
    }

    /// [`Self::check_open`] without the manifest.
    pub fn check_files<'a>(&self, dir: &Path, files: impl IntoIterator<Item = &'a str>) -> Result<()> {
        for name in files {
            if !is_archive(name) {
                self.check_full(dir, name)?;
                continue;
            }
            let (path, digest) = self.entry(dir, name)?;
            let got = stamp(&path)?;
            if digest.stamp.as_deref() != Some(got.as_str()) {
                return Err(damaged(
                    &path,
                    format!(
                        "its first and last MiB hash to {}…, {DIGESTS_FILE} says {}…",
                        &got[..12],
                        short(digest.stamp.as_deref().unwrap_or("nothing"))
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every listed file hashed in full (and present): what `skainet-kv verify` runs.
    pub fn verify(&self, dir: &Path) -> Result<()> {
        if !self.files.contains_key(MANIFEST_FILE) {
            return Err(damaged(&dir.join(DIGESTS_FILE), format!("lists no {MANIFEST_FILE}")));
        }
        for name in self.files.keys() {
            self.check_full(dir, name)?;
        }
        Ok(())
    }
}

fn short(s: &str) -> &str {
    s.get(..12).unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export_like() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(MANIFEST_FILE), r#"{"globalRopeBase": 10000}"#).unwrap();
        std::fs::write(dir.path().join("m.llvm-cpu.vmfb"), vec![7u8; 5000]).unwrap();
        let big: Vec<u8> = (0..3 * STAMP_SPAN as usize).map(|i| i as u8).collect();
        std::fs::write(dir.path().join("model.irpa"), big).unwrap();
        std::fs::write(dir.path().join("m.mlir"), "text").unwrap();
        Digests::write(dir.path()).unwrap();
        dir
    }

    fn flip(path: &Path, at: usize) {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[at] ^= 1;
        std::fs::write(path, bytes).unwrap();
    }

    const OPEN: [&str; 2] = ["m.llvm-cpu.vmfb", "model.irpa"];

    /// The file list records sizes, round-trips, and the digests cover it and the tokenizer
    /// (an edited list or tokenizer is refused like an edited module).
    #[test]
    fn file_list_is_written_and_covered() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(MANIFEST_FILE), "{}").unwrap();
        std::fs::write(dir.path().join(TOKENIZER_FILE), vec![1u8; 300]).unwrap();
        std::fs::write(dir.path().join("m.llvm-cpu.vmfb"), vec![7u8; 5000]).unwrap();
        let list = FileList::write(dir.path(), [MANIFEST_FILE, TOKENIZER_FILE, "m.llvm-cpu.vmfb"]).unwrap();
        assert_eq!(list.files[TOKENIZER_FILE], 300);
        assert_eq!(list.files["m.llvm-cpu.vmfb"], 5000);
        assert_eq!(FileList::load(dir.path()).unwrap(), Some(list.clone()));
        assert_eq!(
            list.assets(),
            [
                "digests.json",
                "files.json",
                "m.llvm-cpu.vmfb",
                "manifest.json",
                "tokenizer.gguf"
            ]
        );
        let digests = Digests::write(dir.path()).unwrap();
        assert!(digests.files.contains_key(FILES_FILE) && digests.files.contains_key(TOKENIZER_FILE));
        flip(&dir.path().join(TOKENIZER_FILE), 10);
        let err = digests.verify(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::Io { what: "refusing damaged artifact", path, .. } if path.ends_with(TOKENIZER_FILE)),
            "{err}"
        );
        assert_eq!(FileList::load(&dir.path().join("none")).unwrap(), None);
    }

    #[test]
    fn an_intact_export_passes_both_checks() {
        let dir = export_like();
        let d = Digests::load(dir.path()).unwrap().unwrap();
        assert_eq!(d.files.len(), 3, "the .mlir is not covered: {:?}", d.files.keys());
        d.check_open(dir.path(), OPEN).unwrap();
        d.verify(dir.path()).unwrap();
    }

    /// A flipped byte in the module or manifest fails at open, naming the file; one in the
    /// middle of an archive only `verify` sees (the stamp reads its ends).
    #[test]
    fn damage_is_named() {
        for (file, at, at_open) in [
            ("m.llvm-cpu.vmfb", 4999, true),
            (MANIFEST_FILE, 20, true),
            ("model.irpa", 10, true),
            ("model.irpa", 3 * STAMP_SPAN as usize - 1, true),
            ("model.irpa", STAMP_SPAN as usize + 5, false),
        ] {
            let dir = export_like();
            flip(&dir.path().join(file), at);
            let d = Digests::load(dir.path()).unwrap().unwrap();
            let open = d.check_open(dir.path(), OPEN);
            assert_eq!(open.is_err(), at_open, "{file} at {at}: {open:?}");
            let err = d.verify(dir.path()).unwrap_err().to_string();
            assert!(
                err.contains(file) && err.contains("re-export") && !err.contains('\n'),
                "{err}"
            );
        }
    }

    #[test]
    fn truncation_unlisted_files_and_bad_digest_files_are_errors() {
        let dir = export_like();
        let vmfb = dir.path().join("m.llvm-cpu.vmfb");
        std::fs::write(&vmfb, vec![7u8; 10]).unwrap();
        let d = Digests::load(dir.path()).unwrap().unwrap();
        assert!(d
            .check_open(dir.path(), OPEN)
            .unwrap_err()
            .to_string()
            .contains("10 bytes"));
        assert!(d
            .check_open(dir.path(), ["other.vmfb"])
            .unwrap_err()
            .to_string()
            .contains("not listed"));
        std::fs::write(dir.path().join(DIGESTS_FILE), "{").unwrap();
        assert!(Digests::load(dir.path())
            .unwrap_err()
            .to_string()
            .contains(DIGESTS_FILE));
        std::fs::remove_file(dir.path().join(DIGESTS_FILE)).unwrap();
        assert_eq!(Digests::load(dir.path()).unwrap(), None);
    }

    /// The cost at open on real sizes (Gemma 3 270M: a 2.1–4 MB CPU vmfb, a 536 MB bf16
    /// archive; a 16 MB module for margin), cold page cache excluded (each file is read once
    /// before timing). `cargo test -p kv-core --lib digests::tests::cost_at_open -- --ignored
    /// --nocapture`; figures in docs/reliability.md.
    #[test]
    #[ignore = "a measurement: writes 560 MB"]
    fn cost_at_open() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(MANIFEST_FILE), vec![b' '; 4096]).unwrap();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng as u8
                })
                .collect()
        };
        std::fs::write(dir.path().join("m4.vmfb"), bytes(4 << 20)).unwrap();
        std::fs::write(dir.path().join("m16.vmfb"), bytes(16 << 20)).unwrap();
        std::fs::write(dir.path().join("model.irpa"), bytes(536 << 20)).unwrap();
        let d = Digests::write(dir.path()).unwrap();
        for files in [vec!["m4.vmfb", "model.irpa"], vec!["m16.vmfb", "model.irpa"]] {
            let mut times = Vec::new();
            for _ in 0..7 {
                let t = std::time::Instant::now();
                d.check_open(dir.path(), files.iter().copied()).unwrap();
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            times.sort_by(f64::total_cmp);
            eprintln!(
                "check_open {files:?}: median {:.2} ms (min {:.2}, max {:.2})",
                times[3], times[0], times[6]
            );
        }
        let t = std::time::Instant::now();
        d.verify(dir.path()).unwrap();
        eprintln!("verify (556 MB in full): {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    }
}
