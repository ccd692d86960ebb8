//! `export`: the graphs of the skainet-kv contract as StableHLO text, compiled with `iree-compile`,
//! packaged as `manifest.json` + `.irpa` + `.vmfb` artifacts.
//!
//! Design:
//! - **The math is `docs/forward.md`, op for op.** The emitter ([`emit`], [`emit_module`]) writes
//!   the same steps as `backend-reference`, with the RoPE tables and masks of `kv_core` (constants
//!   for the prefill and redecode graphs, arguments for the chunk and step graphs).
//! - **Signatures come from the manifest.** Arguments and results follow the manifest's name
//!   lists (`args_or_canonical`, `outputs_or_canonical`), so a reordered manifest gives a reordered
//!   signature and a runtime binding by name works with both.
//! - **Weights are external parameters** (`#flow.parameter.named<"model"::KEY>`), stored bf16.
//!   By default ([`WeightFormat::PackedI32`]) they are declared as `i32` pairs and widened in the
//!   graph: IREE 3.13's Vulkan code generator miscompiles bf16→f32 for 1024+ elements, and the
//!   packed form is exact on every target, so one `.mlir` serves CPU and Vulkan.
//! - **Dynamic past without dynamic reshapes.** IREE 3.13 cannot lower a `reshape` to a dynamic
//!   shape, and canonicalises unit dimensions of a `dot_general` into one; the attention is a
//!   batched `dot_general` over the query heads with the KV heads repeated by
//!   `dynamic_broadcast_in_dim`, unit dimensions are dropped with one-term reductions, and a KV
//!   head is cut out with `real_dynamic_slice`.
//! - **Contract v2** (`docs/contract-v2.md`, [`ExportOptions::contract`] `V2`): static shapes
//!   throughout. The chunk and step graphs (and the prefill graph, a chunk graph of
//!   `prefillChunk` rows) take `pos` and each layer's whole cache (`[P, nKV, d]`, a sliding
//!   layer's ring `[N, nKV, d]`), build their masks from `pos` (a row holding no position before
//!   it is never read), and return only the new rows. Attention stacks each KV head's query
//!   heads as rows against that head's cache and new rows, in one softmax.
//! - **Errors** ([`ExportError`]) name the function and the first compiler diagnostic; a missing
//!   compiler is an error with the places searched, never a silent skip.

mod artifacts;
mod binding;
pub mod bundle;
mod cache;
mod compile;
pub mod device;
mod emit;
pub mod encode;
pub mod kernels;
pub mod mlir;
mod plan;
pub mod presets;
pub mod profile;
pub mod quantized;
mod templates;

/// Test support: each fused form of the emitter alone (`tests/forms.rs`). Not a stable API.
#[doc(hidden)]
pub mod testing {
    pub use crate::emit::forms::{emit_form, Form, RMS_EPS};
}

pub use artifacts::{
    export_artifacts, nvidia_target, weight_compile_flags, ExportOptions, Layout, OptionsError, Source,
    QUANTIZED_COMPILE_FLAGS,
};
pub use binding::{check_binding, SOURCE_MANIFEST_KEY, SOURCE_WEIGHTS_KEY};
pub use cache::{
    cache_root, cached_export, cached_export_in, cached_export_noting, cached_export_noting_in, cached_export_with,
    entry_name, host_converts_f16, host_has_bf16_dot, is_cached, runtime_options, runtime_options_for,
    CPU_RUNTIME_FLAGS, CPU_RUNTIME_FLAGS_V2,
};
pub use compile::{compile, compile_with, find_compiler, Target, COMPILER_VERSION};
pub use emit::{emit, emit_module, EmitOptions, RowProducts, StreamProducts, WeightFormat};
pub use plan::ExportPlan;

use std::path::PathBuf;

/// Every failure of an export.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Core(#[from] kv_core::Error),
    #[error("emit: {0}")]
    Unsupported(String),
    /// Options the exporter refuses ([`OptionsError`]), before anything is emitted.
    #[error("export options: {0}")]
    Options(#[from] OptionsError),
    #[error("`{name}` is not a model directory, and fixture names need `export` built with its `fixtures` feature")]
    FixturesDisabled { name: String },
    #[error(
        "iree-compile not found (searched: {searched}); install it with `pip install iree-base-compiler==3.13.0` \
         (or `scripts/env.sh`), or set IREE_COMPILE"
    )]
    CompilerMissing { searched: String },
    #[error("iree-compile failed for {function} ({target}, {mlir}): {diagnostic}")]
    Compile {
        function: String,
        target: String,
        mlir: PathBuf,
        diagnostic: String,
    },
    #[error(
        "iree-encode-parameters not found (searched: {searched}); build it with `scripts/build-iree-tools.sh` \
         (run by `scripts/setup.sh`), or set IREE_ENCODE_PARAMETERS"
    )]
    EncoderMissing { searched: String },
    #[error("encoding the parameters of {module}: {diagnostic}")]
    Encode { module: PathBuf, diagnostic: String },
    /// Artifacts given for a model they were not exported from.
    #[error("{0}")]
    Binding(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
}

impl ExportError {
    pub(crate) fn io(what: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ExportError {
        let path = path.display().to_string();
        move |source| ExportError::Io { what, path, source }
    }
}

pub type Result<T, E = ExportError> = std::result::Result<T, E>;
