//! The backend traits. Every backend runs the same plans ([`crate::window`]) and is tested by the
//! same conformance suite; they differ only in where the cache lives and who computes.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::sampling::TopK;
use crate::spec::KvSpec;

/// Identity of a live session, so that a snapshot cannot be restored into a stranger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionId(u64);

impl SessionId {
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        SessionId(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    pub fn get(self) -> u64 {
        self.0
    }

    /// The error for restoring a snapshot of `other` into `self`, or `Ok` if they match.
    pub fn check_owner(self, other: SessionId) -> Result<()> {
        if self == other {
            Ok(())
        } else {
            Err(Error::ForeignSnapshot {
                session: self.0,
                snapshot_session: other.0,
            })
        }
    }
}

/// One layer's cached K and V copied to the host: `[nKvHeads, rows, headDim]` each, covering the
/// absolute positions `first_position .. first_position + rows`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerKv {
    pub first_position: usize,
    pub rows: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl LayerKv {
    /// A layer that holds no rows yet (a session before its first call).
    pub fn empty(spec: &KvSpec) -> Self {
        LayerKv {
            first_position: 0,
            rows: 0,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    /// The `[nKvHeads, head_dim]` K vectors at absolute position `p`, if held.
    pub fn k_at(&self, head: usize, p: usize) -> Option<&[f32]> {
        self.row(&self.k, head, p)
    }

    pub fn v_at(&self, head: usize, p: usize) -> Option<&[f32]> {
        self.row(&self.v, head, p)
    }

    fn row<'a>(&self, data: &'a [f32], head: usize, p: usize) -> Option<&'a [f32]> {
        if p < self.first_position || p >= self.first_position + self.rows || head >= self.n_kv_heads {
            return None;
        }
        let r = p - self.first_position;
        let start = (head * self.rows + r) * self.head_dim;
        Some(&data[start..start + self.head_dim])
    }

    /// The rows for absolute positions `from..first_position + rows` (a sliding layer may hold
    /// more than another backend; compare on the common tail).
    pub fn tail_from(&self, from: usize) -> LayerKv {
        assert!(
            from >= self.first_position && from <= self.first_position + self.rows,
            "tail_from out of range"
        );
        let skip = from - self.first_position;
        let rows = self.rows - skip;
        let take = |data: &[f32]| {
            (0..self.n_kv_heads)
                .flat_map(|h| {
                    let start = (h * self.rows + skip) * self.head_dim;
                    data[start..start + rows * self.head_dim].iter().copied()
                })
                .collect()
        };
        LayerKv {
            first_position: from,
            rows,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            k: take(&self.k),
            v: take(&self.v),
        }
    }
}

/// Where the wall time of a backend's decode steps went, summed over the steps since the last
/// [`KvBackend::take_step_phases`] (`bench` reports the means). A device backend's step is host
/// work around one device call, and on a GPU that work can cost as much as the call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases {
    pub steps: u32,
    /// Building the inputs: the embedding row, the rotary rows, their uploads.
    pub inputs: std::time::Duration,
    /// The graph's invocation, from the call until its results exist.
    pub invoke: std::time::Duration,
    /// Reading the token back to the host (alone: contract 1).
    pub read: std::time::Duration,
    /// Writing the new K/V rows into the caches (contract 2's runtime-owned caches), with the
    /// token's read-back in the same submission.
    pub writes: std::time::Duration,
}

/// A stateful KV-cache session (CONTRACT §2).
///
/// Calls take `&mut self` because they replace the per-layer caches; a session is used from one
/// thread at a time. Every method validates its input before touching state: on `Err` the session
/// is exactly as it was before the call.
///
/// # Example
///
/// The calls [`crate::KvDecoder`] makes, by hand on the reference backend:
///
/// ```
/// use backend_reference::{ReferenceKv, ReferenceModel};
/// use kv_core::{KvBackend, WindowRule};
///
/// # fn main() -> kv_core::Result<()> {
/// let model = ReferenceModel::open(&fixtures::materialize("tiny-gemma3:7")?)?;
/// let mut session = ReferenceKv::new(model, WindowRule::Exact);
/// session.prefill(&[1, 2, 3, 4])?; // from position 0; returns the next token
/// let prefix = session.snapshot()?; // owned: it does not borrow the session
/// let next = session.chunk(&[5, 6])?; // 1..=chunk tokens after the position
/// session.step(next)?; // one token
/// assert_eq!(session.position(), 7);
/// session.restore(&prefix)?; // back to position 4, no copy
/// assert_eq!(session.position(), 4);
/// assert_eq!(session.chunk(&[5, 6])?, next); // the same caches, the same token
/// // Bad input is an error and leaves the session as it was.
/// assert!(session.chunk(&[]).is_err());
/// assert!(session.step(i32::MAX).is_err());
/// assert_eq!(session.position(), 6);
/// # Ok(())
/// # }
/// ```
pub trait KvBackend {
    /// An owned, cheap handle on the caches at one position (tract's `FrozenState`): it does not
    /// borrow the session, stays valid across any later calls and restores, and can be restored
    /// any number of times (branching).
    type Snapshot: Clone;

    fn spec(&self) -> &KvSpec;

    /// Starts over: runs the prefill graph on `1..=SEQ` tokens from position 0 and returns the
    /// token predicted after the last one.
    fn prefill(&mut self, tokens: &[i32]) -> Result<i32>;

    /// Feeds `1..=chunk` tokens after the current position; returns the next token.
    fn chunk(&mut self, tokens: &[i32]) -> Result<i32>;

    /// Feeds one token; returns the next one.
    fn step(&mut self, token: i32) -> Result<i32>;

    /// Greedy decoding on the graphs' own argmax: steps on `token`, then on each token a step
    /// predicts, handing every prediction to `more` in order, until `more` returns `false` or
    /// `max` steps ran. Returns the steps made; the session is then at the position after the
    /// last of them, exactly as after that many [`Self::step`] calls.
    ///
    /// A backend may queue a step before `more` saw the token it feeds on (the IREE backend does
    /// on an async device: the host then never waits between steps); such a step is dropped
    /// when `more` says stop, and leaves no trace. An error leaves the session after the last
    /// step `more` was handed.
    fn step_greedy(&mut self, token: i32, max: usize, more: &mut dyn FnMut(i32) -> bool) -> Result<usize> {
        step_greedy_serially(self, token, max, more)
    }

    fn snapshot(&self) -> Result<Self::Snapshot>;

    /// Swaps the snapshot's caches back in. A snapshot of another session is an error.
    fn restore(&mut self, snapshot: &Self::Snapshot) -> Result<()>;

    /// The position `snapshot` holds, so that a caller can check a request before it restores.
    fn snapshot_position(&self, snapshot: &Self::Snapshot) -> usize;

    /// Tokens consumed since the last prefill.
    fn position(&self) -> usize;

    /// Copies one layer's cached rows to the host (conformance and divergence work; slow).
    fn read_layer(&self, layer: usize) -> Result<LayerKv>;

    /// Logits of the last position of the last call, where the backend has them (the reference).
    fn last_logits(&self) -> Option<&[f32]> {
        None
    }

    /// How many of the best logits [`Self::last_top_k`] can hand over: the `k` a graph was
    /// exported with, the vocabulary for a backend that holds the full logits; `None` = none
    /// (greedy decoding only).
    fn top_k_capacity(&self) -> Option<usize> {
        None
    }

    /// The best `k` logits of the last position of the last call and their ids, sorted by logit
    /// descending, ties lowest id first (the argmax's order); `None` when the backend has none or
    /// fewer than `k` ([`Self::top_k_capacity`]), or before the first call. A backend reads them
    /// only here, so greedy decoding never pays for the transfer.
    fn last_top_k(&self, k: usize) -> Result<Option<TopK>> {
        let _ = k;
        Ok(None)
    }

    /// Restricts the token every later call predicts (the argmax of `prefill`, `chunk`, `step`,
    /// `step_greedy`) and its [`Self::last_top_k`] to `allowed`, until the next call of this;
    /// `None` (or an all-allowed set) lifts it. A constrained decoder sets its grammar's mask
    /// before each call. Where nothing is allowed, the predicted token is unspecified: the caller
    /// must not ask (a grammar that allows nothing has ended). A backend that cannot apply a mask
    /// (v1 graphs) answers [`crate::Error::GraphUnavailable`] and keeps its previous mask.
    fn set_allowed(&mut self, allowed: Option<&crate::allowed::AllowedTokens>) -> Result<()> {
        let _ = allowed;
        Err(crate::Error::GraphUnavailable {
            backend: "kv-backend",
            op: "set_allowed",
            reason: "this backend has no allowed-token mask (v1 graphs); export with contract 2",
        })
    }

    /// A short name for reports (`reference`, `iree-local-task`, ...).
    fn name(&self) -> String;

    /// The phases of the steps since the last take, and starts a new sum; `None` for a backend
    /// that does not time them.
    fn take_step_phases(&mut self) -> Option<StepPhases> {
        None
    }

    /// Starts recording the device's work (each dispatch's start and end) into `path`, a
    /// profile bundle that IREE's `iree-profile` reads, until [`Self::end_device_profile`]. A
    /// backend without a device profiler answers [`crate::Error::Unsupported`]; a second begin
    /// completes the first recording's file before it starts the next.
    fn begin_device_profile(&mut self, path: &std::path::Path) -> Result<()> {
        let _ = path;
        Err(crate::Error::Unsupported {
            backend: self.name(),
            op: "begin_device_profile",
            reason: "no device profiler",
        })
    }

    /// Ends the recording [`Self::begin_device_profile`] started and completes its file; no
    /// error where none was started.
    fn end_device_profile(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A fixed-length graph re-run per token (CONTRACT §3).
pub trait RedecodeBackend {
    /// The fixed length `SEQ`.
    fn seq(&self) -> usize;

    fn vocab_size(&self) -> usize;

    /// Runs the graph on exactly `SEQ` tokens and returns the predicted next id at every position.
    fn run(&mut self, tokens: &[i32]) -> Result<Vec<i32>>;

    fn name(&self) -> String;
}

/// [`KvBackend::step_greedy`] as [`KvBackend::step`] calls, one after the other (the default,
/// and the fallback of a backend that pipelines only some sessions).
pub fn step_greedy_serially<B: KvBackend + ?Sized>(
    backend: &mut B,
    mut token: i32,
    max: usize,
    more: &mut dyn FnMut(i32) -> bool,
) -> Result<usize> {
    let mut steps = 0;
    while steps < max {
        token = backend.step(token)?;
        steps += 1;
        if !more(token) {
            break;
        }
    }
    Ok(steps)
}

/// A boxed backend is a backend (callers keep large sessions behind a pointer).
impl<B: KvBackend + ?Sized> KvBackend for Box<B> {
    type Snapshot = B::Snapshot;

    fn spec(&self) -> &KvSpec {
        (**self).spec()
    }
    fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        (**self).prefill(tokens)
    }
    fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        (**self).chunk(tokens)
    }
    fn step(&mut self, token: i32) -> Result<i32> {
        (**self).step(token)
    }
    fn step_greedy(&mut self, token: i32, max: usize, more: &mut dyn FnMut(i32) -> bool) -> Result<usize> {
        (**self).step_greedy(token, max, more)
    }
    fn snapshot(&self) -> Result<Self::Snapshot> {
        (**self).snapshot()
    }
    fn restore(&mut self, snapshot: &Self::Snapshot) -> Result<()> {
        (**self).restore(snapshot)
    }
    fn snapshot_position(&self, snapshot: &Self::Snapshot) -> usize {
        (**self).snapshot_position(snapshot)
    }
    fn position(&self) -> usize {
        (**self).position()
    }
    fn read_layer(&self, layer: usize) -> Result<LayerKv> {
        (**self).read_layer(layer)
    }
    fn last_logits(&self) -> Option<&[f32]> {
        (**self).last_logits()
    }
    fn top_k_capacity(&self) -> Option<usize> {
        (**self).top_k_capacity()
    }
    fn last_top_k(&self, k: usize) -> Result<Option<TopK>> {
        (**self).last_top_k(k)
    }
    fn name(&self) -> String {
        (**self).name()
    }
    fn take_step_phases(&mut self) -> Option<StepPhases> {
        (**self).take_step_phases()
    }
    fn begin_device_profile(&mut self, path: &std::path::Path) -> Result<()> {
        (**self).begin_device_profile(path)
    }
    fn end_device_profile(&mut self) -> Result<()> {
        (**self).end_device_profile()
    }
    fn set_allowed(&mut self, allowed: Option<&crate::allowed::AllowedTokens>) -> Result<()> {
        (**self).set_allowed(allowed)
    }
}

impl<B: RedecodeBackend + ?Sized> RedecodeBackend for Box<B> {
    fn seq(&self) -> usize {
        (**self).seq()
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn run(&mut self, tokens: &[i32]) -> Result<Vec<i32>> {
        (**self).run(tokens)
    }
    fn name(&self) -> String {
        (**self).name()
    }
}
