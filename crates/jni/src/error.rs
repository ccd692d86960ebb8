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
}

pub type JniResult<T> = Result<T, JniError>;
