//! The JNI layer of skainet-kv (CONTRACT §5): everything behind `libskainet_iree_kv.so` and
//! `libskainet_iree_redecode.so` except the `Java_...` symbols themselves, which live in the two
//! thin cdylib crates `kv/` and `redecode/` so that each library exports exactly its class's ABI.
//!
//! Design:
//! - **One wrapper per export.** Every native method body runs inside [`ffi::call`]: jni's
//!   `with_env` catches panics, and the one error policy [`ffi::ThrowIllegalState`] logs the
//!   formatted error (logcat tag `skainet_iree_kv` on Android, stderr elsewhere) and throws
//!   `java.lang.IllegalStateException` with it. No other path reaches Java.
//! - **Handles are registry keys, never pointers.** A `jlong` names an owned Rust object in a
//!   typed [`handle::Registry`]; 0, a destroyed or released value, a value never issued and a
//!   handle of the wrong kind are errors, not undefined behaviour. Values are never reused.
//! - **One call at a time per session.** A session sits behind a `Mutex`; kv-core sessions are
//!   `&mut self` per call and IREE invocations on one context must not overlap.
//! - **Failures leave the session usable.** kv-core validates every request before it changes
//!   state, so after an exception the same session keeps working.

pub mod error;
pub mod ffi;
pub mod handle;
pub mod kv;
pub mod log;
pub mod redecode;

pub use error::{JniError, JniResult};
