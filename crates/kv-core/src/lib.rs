//! The skainet-kv contract: everything about a KV-cache session that is not a backend.
//!
//! Design:
//! - **One source of truth for the math.** RoPE tables ([`rope`]), chunk masks ([`mask`]) and
//!   the rows each layer is handed ([`window`]) are computed here and only here; backends execute
//!   [`window::ChunkPlan`]s and [`window::StepPlan`]s, they do not re-derive positions.
//! - **Errors versus bugs.** Anything a caller or an artifact can get wrong (token ids, chunk
//!   sizes, context overflow, a foreign snapshot, a malformed manifest, a truncated archive) is an
//!   [`Error`], checked before any state changes, so the session stays usable. A broken internal
//!   invariant panics through [`error::invariant`]. Every size from a caller or a file is
//!   bounded by [`limits`] before anything of that size is allocated.
//! - **Snapshots are owned values.** A backend's `Snapshot` holds its own references to the
//!   per-layer caches (views, not copies), carries the [`backend::SessionId`] of its session, and
//!   outlives any later call.
//! - **Snapshot files.** [`snapshot_file`] saves a snapshot's rows with the model's fingerprint
//!   and loads them back into a fresh session of the same model ([`PersistSnapshot`]).
//! - **Threading.** A session is `&mut self` per call and used from one thread at a time;
//!   wrappers that share one (JNI) serialise calls with a lock.
//! - **Comparing backends.** [`diverge::lockstep`] runs two backends teacher-forced on one
//!   context and reports per step the tokens, the reference's top-1/top-2 gap and each layer's
//!   K/V difference; it lives here, next to [`tolerance`], so any caller (the CLI, tests, an app
//!   checking a new driver) gets the same judgement.
//! - **Artifacts.** [`manifest::Manifest`] names graphs, arguments (bound by [`manifest::Name`],
//!   parsed once when the manifest is read) and archives; [`irpa`] reads archives zero-copy
//!   through `memmap2` and writes IREE-identical ones.
//!
//! # Example
//!
//! A session on the tiny fixture model through the FP32 reference backend (`backend-reference`;
//! IREE's `IreeKvBackend` is the same [`KvBackend`]): a shared prefix prefilled once, then each
//! utterance answered from its snapshot by [`KvDecoder`]. `examples/session.rs` does more.
//!
//! ```
//! use backend_reference::{ReferenceKv, ReferenceModel};
//! use kv_core::{KvDecoder, WindowRule};
//!
//! # fn main() -> kv_core::Result<()> {
//! let dir = fixtures::materialize("tiny-gemma3:7")?; // written once into the cache
//! let model = ReferenceModel::open(&dir)?;
//! let mut decoder = KvDecoder::new(ReferenceKv::new(model, WindowRule::Exact));
//! let prefix = decoder.prefill_prefix(&[1, 2, 3, 4, 5, 6])?;
//! // Restore the snapshot, feed the utterance in chunk calls, decode greedily.
//! let answer = decoder.generate(&prefix, &[7, 8, 9], None, 4)?;
//! assert_eq!(answer.ids.len(), 4);
//! assert_eq!(answer.timing.chunk_calls, 1);
//! // The snapshot stays valid after later calls: the same utterance, the same answer.
//! decoder.generate(&prefix, &[10, 11], None, 4)?;
//! assert_eq!(decoder.generate(&prefix, &[7, 8, 9], None, 4)?.ids, answer.ids);
//! # Ok(())
//! # }
//! ```

pub mod allowed;
pub mod backend;
pub mod bf16;
pub mod contract;
pub mod decoder;
pub mod digests;
pub mod diverge;
pub mod error;
pub mod irpa;
pub mod limits;
pub mod manifest;
pub mod mask;
pub mod param;
pub mod params;
pub mod quant;
pub mod quantization;
pub mod ring;
pub mod rope;
pub mod sampling;
pub mod snapshot_file;
pub mod spec;
pub mod tolerance;
pub mod window;

pub use backend::{KvBackend, LayerKv, RedecodeBackend, SessionId, StepPhases};
pub use contract::{Contract, ContractVersion, V2Spec};
pub use decoder::{DecodeOptions, Generation, KvDecoder, RedecodeDecoder, StageTiming};
pub use error::{Error, Result};
pub use manifest::{Graph, Manifest};
pub use param::{LayerWeight, Param};
pub use sampling::{Sampler, SamplingConfig, TopK};
pub use snapshot_file::{ModelFingerprint, PersistSnapshot};
pub use spec::{Activation, Architecture, Family, KvSpec, LayerKind};
pub use window::WindowRule;
