//! skainet-kv on the IREE runtime (CONTRACT §2–4): the Rust counterpart of the seed's
//! `iree_kv_jni.c` and `iree_redecode_jni.c`.
//!
//! Design:
//! - **Artifacts come from the manifest.** Each graph's module (`modules[target][graph]`),
//!   archive (`parameters`) and function name (`functions`) are read from `manifest.json`; graphs
//!   that share a module and an archive share one IREE session (the shared layout), otherwise each
//!   gets its own on the one device (the seed's three-archive layout).
//! - **Arguments are bound by name** from the manifest's lists, and every result's rank, shape and
//!   element type is checked before it is read, so a vmfb of another contract fails loudly.
//! - **The cache lives on the device.** Each layer is a `[1, nKvHeads, rows, d]` buffer view; a
//!   call's outputs become the new caches (trimmed to the real rows by a view); sliding layers are
//!   handed tail views under the window rule of `kv_core::window`. With `nKvHeads == 1` every view
//!   is a zero-copy subspan; with more heads rows are not contiguous and a view is a
//!   device-to-device copy (as upstream does).
//! - **Snapshots retain views**: O(layers), independent of the prefix length, no copy.
//! - **Errors keep their cause.** A failed IREE call is `kv_core::Error::Backend` whose source is
//!   the `iree_runtime::Error` (status code included, see [`iree_status`]); an artifact that
//!   breaks the contract is `Error::ContractMismatch`, told apart without parsing text.
//! - **Embeddings are gathered on the host** from the memory-mapped archive (bf16 → f32), because
//!   IREE's SPIR-V backend cannot lower the in-graph gather.

mod convert;
mod embedding;
mod features;
mod kv;
mod open;
mod redecode;
mod shared;

pub use convert::iree_status;
pub use embedding::Embedding;
pub use features::{VulkanFeatures, PORTABLE_16BIT_TARGET};
pub use iree_runtime::StatusCode;
pub use kv::{IreeKvBackend, IreeSnapshot};
pub use open::{declared_input_dims, IreeOptions, PrefillRoute, DEFAULT_CHUNKED_PREFILL_CALLS, DEVICES};
pub use redecode::IreeRedecodeBackend;
pub use shared::open_module_count;
