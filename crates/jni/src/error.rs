//! Every failure a native method can report; all of them reach Java as
//! `java.lang.IllegalStateException` through [`crate::ffi::ThrowIllegalState`].

/// A failed native call.
#[derive(Debug, thiserror::Error)]
pub enum JniError {
    /// The session or its artifacts refused the request (IREE status, bad tokens, ...).
    #[error(transparent)]
    Kv(#[from] kv_core::Error),
    /// A JNI call failed (a missing `IreeKvSpec` field, an out-of-memory array, ...).
    #[error("JNI: {0}")]
    Jni(#[from] jni::errors::Error),
    /// A `jlong` handle that names no live object of the expected kind.
    #[error("{0}")]
    Handle(String),
    /// An argument the Java side got wrong before the session saw it (null, negative count).
    #[error("{0}")]
    Argument(String),
    /// An object whose lock an earlier call poisoned by panicking: a bug in this library, not
    /// the caller's mistake; the object stays unusable.
    #[error("internal error: {0}")]
    Poisoned(String),
    /// The app-level API (`Engine`, `Conversation`) refused the call.
    #[error(transparent)]
    Engine(#[from] engine::Error),
    /// A Kotlin listener threw; its exception is pending and propagates as it is.
    #[error("the listener threw; its exception propagates")]
    Listener,
}

impl JniError {
    /// The `[kind]` of an `EngineException` (see `engine::Error::kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            JniError::Kv(e) => engine::kv_kind(e),
            JniError::Jni(_) => "jni",
            JniError::Handle(_) => "bad_handle",
            JniError::Argument(_) => "bad_argument",
            JniError::Poisoned(_) => "internal",
            JniError::Engine(e) => e.kind(),
            JniError::Listener => "listener",
        }
    }
}

pub type JniResult<T> = Result<T, JniError>;
