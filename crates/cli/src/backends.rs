//! Which backend a command runs on.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use backend_reference::{ReferenceKv, ReferenceModel, ReferenceRedecode};
use clap::ValueEnum;
use kv_core::WindowRule;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The FP32 ndarray reference (host).
    Reference,
}

/// `--window-rule`: the exact rule, or the seed library's one-key-wider steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum RuleChoice {
    #[default]
    Exact,
    Seed,
}

impl From<RuleChoice> for WindowRule {
    fn from(rule: RuleChoice) -> Self {
        match rule {
            RuleChoice::Exact => WindowRule::Exact,
            RuleChoice::Seed => WindowRule::SeedStep,
        }
    }
}

pub fn open_reference(dir: &Path) -> Result<Arc<ReferenceModel>> {
    Ok(ReferenceModel::open(dir)?)
}

pub fn reference_kv(model: Arc<ReferenceModel>, rule: RuleChoice) -> ReferenceKv {
    ReferenceKv::new(model, rule.into())
}

pub fn reference_redecode(model: Arc<ReferenceModel>, seq: Option<usize>) -> Result<ReferenceRedecode> {
    Ok(match seq {
        Some(seq) => ReferenceRedecode::with_seq(model, seq)?,
        None => ReferenceRedecode::new(model),
    })
}
