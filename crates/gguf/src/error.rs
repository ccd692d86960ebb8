//! The one error type of the crate.

use std::path::PathBuf;

use crate::ggml::GgmlType;

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Everything that can go wrong reading a GGUF file, dequantizing it or importing it.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// A file system operation failed.
    #[error("gguf: cannot {op} `{}`: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A structure runs past the end of the file.
    #[error("gguf: truncated file: {what} at offset {offset} needs {needed} bytes but the file is {len} bytes")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    /// The file does not start with `GGUF`.
    #[error("gguf: bad magic {found:#010x} (expected `GGUF`)")]
    BadMagic { found: u32 },
    /// Only versions 2 and 3 (64-bit counts) are read.
    #[error("gguf: unsupported version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// A value the format does not allow (bad type id, invalid UTF-8, misaligned offset, ...).
    #[error("gguf: corrupt file: {0}")]
    Corrupt(String),
    /// A metadata key the caller needs is absent.
    #[error("gguf: metadata key `{0}` is missing")]
    MissingKey(String),
    /// A metadata key holds a value of another type.
    #[error("gguf: metadata key `{key}` is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// A tensor is missing.
    #[error("gguf: tensor `{0}` is missing")]
    MissingTensor(String),
    /// A tensor type this crate cannot dequantize.
    #[error(
        "gguf: tensor `{tensor}` has type {}, which cannot be dequantized here (supported: {})",
        ty.name(),
        crate::ggml::DEQUANTIZABLE.map(|t| t.name()).join(", ")
    )]
    UnsupportedType { tensor: String, ty: GgmlType },
    /// The checkpoint is valid GGUF but not something the importer maps.
    #[error("gguf: cannot import: {0}")]
    Import(String),
    #[error(transparent)]
    Kv(#[from] kv_core::Error),
    #[error(transparent)]
    Irpa(#[from] kv_core::irpa::IrpaError),
}

impl GgufError {
    pub(crate) fn corrupt(detail: impl Into<String>) -> Self {
        GgufError::Corrupt(detail.into())
    }

    pub(crate) fn import(detail: impl Into<String>) -> Self {
        GgufError::Import(detail.into())
    }
}
