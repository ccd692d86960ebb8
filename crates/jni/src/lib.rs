//! The JNI layer of skainet-kv (CONTRACT §5): everything behind `libskainet_iree_kv.so` and
//! `libskainet_iree_redecode.so` except the `Java_...` symbols themselves, which live in the two
//! thin cdylib crates `kv/` and `redecode/` so that each library exports exactly its class's ABI.
//!
//! Design:
//! - **One wrapper per export.** Every native method body runs inside [`ffi::call`]: jni's
//!   `with_env` catches panics, and the one error policy [`ffi::ThrowIllegalState`] logs the
//!   formatted error (logcat tag `skainet_iree_kv` on Android, stderr elsewhere) and throws
//!   `java.lang.IllegalStateException` with it. No other path reaches Java.
//! - **One macro writes the exports.** [`java_exports!`] expands, inside each cdylib crate, a
//!   class's `Java_...` symbols from one line per method: the JNI name, the `(JNIEnv*, jclass)`
//!   head and the forwarding call are written once, so no export can drift from the others.
//! - **Handles are registry keys, never pointers.** A `jlong` names an owned Rust object in a
//!   typed [`handle::Registry`]; 0, a destroyed or released value, a value never issued and a
//!   handle of the wrong kind are errors, not undefined behaviour. Values are never reused.
//! - **One call at a time per session.** A session sits behind a `Mutex`; kv-core sessions are
//!   `&mut self` per call and IREE invocations on one context must not overlap.
//! - **Failures leave the session usable.** kv-core validates every request before it changes
//!   state, so after an exception the same session keeps working.

/// `jni`, for the expansion of [`java_exports!`] in the cdylib crates.
pub use jni;

pub mod app;
pub mod error;
pub mod ffi;
pub mod handle;
pub mod kv;
pub mod log;
pub mod redecode;

pub use error::{JniError, JniResult};

/// The `Java_sk_ainet_transformers_iree_android_<Class>_<method>` exports of one class, each
/// forwarding `env` and its arguments to a function of this crate (which runs the body through
/// [`ffi::call`]). Expanded in the cdylib crate that owns the class, so each library exports
/// exactly its class's ABI. `$l` names the lifetime the argument types use.
///
/// ```ignore
/// skainet_jni::java_exports! { 'l, IreeKvSession;
///     nativeStep(h: jlong, token: jint) -> jint = skainet_jni::kv::native_step;
/// }
/// ```
#[macro_export]
macro_rules! java_exports {
    ($l:lifetime, $class:ident; $( $method:ident ( $( $arg:ident : $ty:ty ),* ) $( -> $ret:ty )? = $target:path; )*) => {
        $(
            #[export_name = concat!(
                "Java_sk_ainet_transformers_iree_android_", stringify!($class), "_", stringify!($method)
            )]
            #[allow(non_snake_case, clippy::too_many_arguments)]
            pub extern "system" fn $method<$l>(
                env: $crate::jni::EnvUnowned<$l>,
                _class: $crate::jni::objects::JClass<$l>,
                $( $arg: $ty ),*
            ) $( -> $ret )? {
                $target(env, $( $arg ),*)
            }
        )*
    };
}
