//! GGUF for skainet-kv: a bounds-checked, memory-mapped reader of GGUF v2/v3 files ([`GgufFile`]),
//! dequantizers of the common ggml block formats to f32 ([`quant`]), the importer of `gemma3` and
//! `llama` checkpoints into an artifact directory (`manifest.json` + `model.irpa`, [`import()`]).
//! Installing the real models (pip, sha256, progress) is the `model-store` crate's job.
//!
//! Design:
//! - **Corrupt input is an error.** Every offset and length is checked with checked arithmetic
//!   when the file is opened; tensor data is sliced from the map only within checked ranges.
//! - **Exact dequantization.** The block decoders follow ggml's reference `dequantize_row_*`
//!   operation by operation; tests compare them bit for bit with the Python `gguf` package.
//! - **Our names are GGUF's names.** The importer only reverses dims (same memory), undoes
//!   llama.cpp's Q/K row permutation for llama, and checks every shape against
//!   [`kv_core::params::parameter_table`].

pub mod error;
pub mod file;
pub mod ggml;
pub mod import;
pub mod quant;
pub mod writer;

pub use error::{GgufError, Result};
pub use file::{GgmlType, GgufFile, TensorInfo, Value, ValueType};
pub use import::{import, import_file, import_file_with, model_config, ImportOptions, WeightFormat};
pub use writer::GgufWriter;
