//! Resolving `--model`: a fixture name (`tiny-gemma3:7`) or a directory with `manifest.json`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

pub fn resolve(model: &str) -> Result<PathBuf> {
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
    bail!("--model {model}: neither a fixture name (tiny-gemma3:SEED, tiny-gemma3-gqa:SEED, tiny-llama:SEED, tiny-qwen2:SEED, tiny-qwen3:SEED) nor a directory holding manifest.json")
}
