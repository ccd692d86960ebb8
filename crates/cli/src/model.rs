//! Resolving `--model`: a real model (`gemma3-270m`, `smollm2-135m`: installed from PyPI and
//! imported once into `.cache/models/`), a fixture name (`tiny-gemma3:7`), or a directory with
//! `manifest.json`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

/// Whether `model` names one of the real models the gguf crate knows.
pub fn is_real_model(model: &str) -> bool {
    gguf::models::MODELS.iter().any(|m| m.name == model)
}

pub fn resolve(model: &str) -> Result<PathBuf> {
    if is_real_model(model) {
        return gguf::models::ensure_artifacts(model, gguf::ImportOptions::default())
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
    let path = gguf::models::ensure(model).with_context(|| format!("installing {model}"))?;
    let file = gguf::GgufFile::open(&path).with_context(|| format!("reading {}", path.display()))?;
    tokenizer::Tokenizer::from_gguf(&file).with_context(|| format!("reading {model}'s tokenizer"))
}
