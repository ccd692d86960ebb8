//! The one error type of `kv-core`, shared by every backend through [`Error::Backend`].

use crate::irpa::IrpaError;

/// Every failure a caller can cause or a backend can report. A violated internal invariant is a
/// panic (see [`crate::invariant`]), not a variant here.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- bad input: the session is left exactly as it was ---
    #[error("{op}: token id {id} at index {index} is outside the vocabulary [0, {vocab})")]
    TokenOutOfRange {
        op: &'static str,
        index: usize,
        id: i64,
        vocab: usize,
    },
    #[error("{op}: got {n} tokens, expected {min}..={max}")]
    BadTokenCount {
        op: &'static str,
        n: usize,
        min: usize,
        max: usize,
    },
    #[error("{op}: context overflow: position {position} + {n} tokens exceeds maxPositions {max}")]
    ContextOverflow {
        op: &'static str,
        position: usize,
        n: usize,
        max: usize,
    },
    #[error("{op}: the session holds no prefix yet; call prefill first")]
    NotPrefilled { op: &'static str },
    #[error("restore: the snapshot belongs to session {snapshot_session}, not to this session ({session})")]
    ForeignSnapshot { session: u64, snapshot_session: u64 },
    #[error("snapshot file {path}: {reason}")]
    SnapshotFile { path: String, reason: String },
    /// A snapshot file whose rows hold a NaN or an infinity: intact (its CRC matches) but not
    /// what a forward writes; a session fed it decodes garbage (token 0 forever, or an id
    /// outside the vocabulary from a GPU's argmax).
    #[error(
        "snapshot file {path}: layer {layer} {tensor} at position {position} (KV head {head}) holds {value}, not a finite number"
    )]
    NonFiniteSnapshot {
        path: String,
        layer: usize,
        /// `K` or `V`.
        tensor: &'static str,
        position: usize,
        head: usize,
        value: f32,
    },
    /// A path that exists but is not a regular file (a FIFO, a device node, a directory, a
    /// socket), refused where a file is read or replaced: opening a FIFO blocks, and replacing
    /// a device node (`--out /dev/null` as root) would destroy it.
    #[error("{what} {path}: a {kind}, not a regular file")]
    NotRegularFile {
        what: &'static str,
        path: String,
        kind: &'static str,
    },
    #[error("read_layer: layer {layer} out of range (nLayers {n_layers})")]
    LayerOutOfRange { layer: usize, n_layers: usize },
    #[error("redecode: prompt of {len} tokens leaves no room in a graph of SEQ {seq} (need 1..{seq})")]
    PromptDoesNotFit { len: usize, seq: usize },
    /// Two sessions a comparison needs to agree (on the model, on the rows held) do not.
    #[error("{op}: {reason}")]
    Incomparable { op: &'static str, reason: String },
    /// A size from a caller, a manifest or a file above its bound ([`crate::limits`]), refused
    /// before anything of that size is allocated. `what` names the flag or field (`--seq`,
    /// ``spec `vocabSize` ``) or the buffer it implies, `bound` the limit's name.
    #[error("{what} {value} exceeds the limit {limit} ({bound})")]
    TooLarge {
        what: String,
        value: u128,
        limit: u128,
        bound: String,
    },
    #[error("sampling: {key}: {reason}")]
    BadSampling { key: &'static str, reason: String },
    #[error(
        "sampling: needs the best {needed} logits of each call, but {backend} {}",
        match available {
            Some(k) => format!("has only {k} (its graphs were exported with top-k {k}; export with a larger --top-k)"),
            None => "has none (its graphs were exported without top-k outputs; export with --top-k)".to_string(),
        }
    )]
    NoTopK {
        backend: String,
        needed: usize,
        available: Option<usize>,
    },

    // --- bad artifacts ---
    #[error("manifest: key `{key}`: {reason}")]
    Manifest { key: String, reason: String },
    #[error("manifest {path}: {source}")]
    ManifestParse { path: String, source: serde_json::Error },
    #[error(transparent)]
    Irpa(#[from] IrpaError),
    #[error("parameter `{name}`: {reason}")]
    Parameter { name: String, reason: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },

    // --- a backend's own failure (IREE status, driver error, ...) ---
    /// The backend's runtime failed. `source` is the runtime's own error, kept whole (for IREE
    /// an `iree_runtime::Error` with its status code: downcast it); its text is part of this
    /// message because callers (the CLI, the JNI's exceptions) show one line.
    #[error("{backend}: {op}: {source}")]
    Backend {
        backend: &'static str,
        op: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// An artifact breaks the contract it was opened under: a graph returns other results than
    /// the contract says, takes other arguments, or declares another shape (a vmfb of another
    /// contract or model). Not a runtime failure: the call itself succeeded.
    #[error("{backend}: {op}: {message}")]
    ContractMismatch {
        backend: &'static str,
        op: String,
        message: String,
    },
    /// The session holds no graph for this call (released, or opened without it); it is left
    /// as it was.
    #[error("{backend}: {op}: {reason}")]
    GraphUnavailable {
        backend: &'static str,
        op: &'static str,
        reason: &'static str,
    },
    /// The backend has no such facility (a device profiler on the FP32 reference); nothing
    /// changed.
    #[error("{backend}: {op}: not available on this backend ({reason})")]
    Unsupported {
        backend: String,
        op: &'static str,
        reason: &'static str,
    },
    /// A grammar (a [`crate::decoder::TokenConstraint`]) refused to build, refused a token, or
    /// failed inside its engine.
    #[error("constraint: {op}: {reason}")]
    Constraint { op: &'static str, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn manifest(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Manifest {
            key: key.into(),
            reason: reason.into(),
        }
    }

    pub fn parameter(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Parameter {
            name: name.into(),
            reason: reason.into(),
        }
    }
}

/// A broken internal invariant: a bug in this crate or a backend, never a caller's mistake.
#[cold]
#[track_caller]
pub fn invariant(message: &str) -> ! {
    panic!("skainet-kv internal invariant violated: {message}")
}
