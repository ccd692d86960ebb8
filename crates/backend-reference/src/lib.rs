//! The FP32 oracle of skainet-kv: a plain ndarray forward of every supported architecture
//! (`docs/forward.md`), behind the same [`kv_core::KvBackend`] and [`kv_core::RedecodeBackend`]
//! traits as the compiled backends, which are all checked against it.
//!
//! Design:
//! - **Plain over fast.** Every step of `docs/forward.md` is one readable line or loop here; only
//!   the matrix products go through ndarray's `dot` so tests stay fast. Weights are widened from
//!   bf16 (or read as f32) once, at load.
//! - **kv-core decides, we execute.** Validation, RoPE tables, chunk masks and the number of past
//!   rows each layer is handed come from [`kv_core::window`] plans; the prefill mask comes from
//!   [`kv_core::mask`]. Nothing about positions is re-derived here.
//! - **State changes only after success.** Every call plans (and so validates) first, computes the
//!   new caches into fresh arrays, and only then swaps them in, so an `Err` leaves the session as
//!   it was.
//! - **Snapshots are `Arc` clones.** A layer cache is an immutable `Arc`'d K/V pair plus the
//!   absolute position of its first row; a call builds new arrays (like a graph's fresh output
//!   buffers), so a snapshot never copies K/V and is never disturbed by later calls.

mod forward;
mod kv;
mod model;
mod redecode;

pub use forward::{argmax_lowest, full_forward_logits, gelu_tanh, rmsnorm, silu, softmax_in_place};
pub use kv::{ReferenceKv, ReferenceSnapshot};
pub use model::{LayerWeights, ReferenceModel};
pub use redecode::ReferenceRedecode;
