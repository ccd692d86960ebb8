//! The one wrapper every export goes through (STYLE 13), and argument conversion.

use std::any::Any;
use std::sync::{Mutex, MutexGuard};

use jni::errors::ErrorPolicy;
use jni::objects::{JIntArray, JString};
use jni::strings::JNIString;
use jni::{jni_str, Env, EnvUnowned};

use crate::error::{JniError, JniResult};

/// Runs a native method body: a panic or an `Err` becomes a logged
/// `java.lang.IllegalStateException` and the method returns `T::default()` (0, null).
pub fn call<'local, T, F>(mut env: EnvUnowned<'local>, method: &'static str, body: F) -> T
where
    T: Default,
    F: FnOnce(&mut Env<'local>) -> JniResult<T>,
{
    env.with_env(body).resolve_with::<ThrowIllegalState, _>(|| method)
}

/// The error policy of every export: log, then throw `IllegalStateException("method: error")`.
pub struct ThrowIllegalState;

impl ThrowIllegalState {
    fn throw(env: &mut Env<'_>, method: &str, what: String) -> jni::errors::Result<()> {
        // A JNI call that failed left a Java exception pending; ours replaces it, and says so.
        let pending = if env.exception_check() {
            env.exception_describe();
            env.exception_clear();
            " (a pending Java exception was replaced; see its description on stderr)"
        } else {
            ""
        };
        let message = format!("{method}: {what}{pending}");
        crate::log::error(&message);
        match env.throw_new(jni_str!("java/lang/IllegalStateException"), JNIString::from(message)) {
            Err(jni::errors::Error::JavaException) | Ok(()) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl<T: Default> ErrorPolicy<T, JniError> for ThrowIllegalState {
    type Captures<'unowned_env_local: 'native_method, 'native_method> = &'static str;

    fn on_error<'unowned_env_local: 'native_method, 'native_method>(
        env: &mut Env<'unowned_env_local>,
        method: &mut &'static str,
        err: JniError,
    ) -> jni::errors::Result<T> {
        Self::throw(env, method, err.to_string())?;
        Ok(T::default())
    }

    fn on_panic<'unowned_env_local: 'native_method, 'native_method>(
        env: &mut Env<'unowned_env_local>,
        method: &mut &'static str,
        payload: Box<dyn Any + Send + 'static>,
    ) -> jni::errors::Result<T> {
        let text = match payload.downcast::<String>() {
            Ok(s) => *s,
            Err(payload) => match payload.downcast::<&'static str>() {
                Ok(s) => (*s).to_string(),
                // Dropping an unknown payload could panic again; leak it instead.
                Err(payload) => {
                    std::mem::forget(payload);
                    "non-string panic payload".into()
                }
            },
        };
        Self::throw(env, method, format!("panic: {text}"))?;
        Ok(T::default())
    }

    fn on_internal_jni_error<'unowned_env_local: 'native_method, 'native_method>(
        method: &mut &'static str,
        err: jni::errors::Error,
    ) -> T {
        crate::log::error(&format!("{method}: could not throw the error to Java: {err}"));
        T::default()
    }

    fn on_internal_panic<'unowned_env_local: 'native_method, 'native_method>(
        method: &mut &'static str,
        payload: Box<dyn Any + Send + 'static>,
    ) -> T {
        std::mem::forget(payload);
        crate::log::error(&format!("{method}: panic while throwing an error to Java"));
        T::default()
    }
}

/// Runs a native method of the app-level API (`Engine`, `Conversation`): as [`call`], but a
/// failure throws `sk.ainet.transformers.iree.android.EngineException` (an
/// `IllegalStateException`) whose message starts with `[kind]` ([`JniError::kind`]), so Kotlin
/// tells the kinds apart without parsing prose. An exception the listener threw is left to
/// propagate as it is.
pub fn call_engine<'local, T, F>(mut env: EnvUnowned<'local>, method: &'static str, body: F) -> T
where
    T: Default,
    F: FnOnce(&mut Env<'local>) -> JniResult<T>,
{
    env.with_env(body).resolve_with::<ThrowEngineException, _>(|| method)
}

/// The error policy of [`call_engine`].
pub struct ThrowEngineException;

impl<T: Default> ErrorPolicy<T, JniError> for ThrowEngineException {
    type Captures<'unowned_env_local: 'native_method, 'native_method> = &'static str;

    fn on_error<'unowned_env_local: 'native_method, 'native_method>(
        env: &mut Env<'unowned_env_local>,
        method: &mut &'static str,
        err: JniError,
    ) -> jni::errors::Result<T> {
        if matches!(err, JniError::Listener) && env.exception_check() {
            crate::log::error(&format!("{method}: {err}"));
            return Ok(T::default());
        }
        let message = format!("[{}] {method}: {err}", err.kind());
        throw_as(
            env,
            jni_str!("sk/ainet/transformers/iree/android/EngineException"),
            message,
        )?;
        Ok(T::default())
    }

    fn on_panic<'unowned_env_local: 'native_method, 'native_method>(
        env: &mut Env<'unowned_env_local>,
        method: &mut &'static str,
        payload: Box<dyn Any + Send + 'static>,
    ) -> jni::errors::Result<T> {
        let message = format!("[internal] {method}: panic: {}", panic_text(payload));
        throw_as(
            env,
            jni_str!("sk/ainet/transformers/iree/android/EngineException"),
            message,
        )?;
        Ok(T::default())
    }

    fn on_internal_jni_error<'unowned_env_local: 'native_method, 'native_method>(
        method: &mut &'static str,
        err: jni::errors::Error,
    ) -> T {
        <ThrowIllegalState as ErrorPolicy<T, JniError>>::on_internal_jni_error(method, err)
    }

    fn on_internal_panic<'unowned_env_local: 'native_method, 'native_method>(
        method: &mut &'static str,
        payload: Box<dyn Any + Send + 'static>,
    ) -> T {
        <ThrowIllegalState as ErrorPolicy<T, JniError>>::on_internal_panic(method, payload)
    }
}

/// Throws `class(message)` after logging it, replacing (and describing) a pending exception.
fn throw_as(env: &mut Env<'_>, class: &jni::strings::JNIStr, message: String) -> jni::errors::Result<()> {
    let message = if env.exception_check() {
        env.exception_describe();
        env.exception_clear();
        format!("{message} (a pending Java exception was replaced; see its description on stderr)")
    } else {
        message
    };
    crate::log::error(&message);
    match env.throw_new(class, JNIString::from(message)) {
        Err(jni::errors::Error::JavaException) | Ok(()) => Ok(()),
        Err(e) => Err(e),
    }
}

fn panic_text(payload: Box<dyn Any + Send + 'static>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => (*s).to_string(),
            // Dropping an unknown payload could panic again; leak it instead.
            Err(payload) => {
                std::mem::forget(payload);
                "non-string panic payload".into()
            }
        },
    }
}

/// A Java string argument that must not be null.
pub fn string(env: &Env<'_>, value: &JString<'_>, name: &str) -> JniResult<String> {
    optional_string(env, value)?.ok_or_else(|| JniError::Argument(format!("`{name}` is null")))
}

pub fn optional_string(env: &Env<'_>, value: &JString<'_>) -> JniResult<Option<String>> {
    if value.is_null() {
        return Ok(None);
    }
    Ok(Some(value.try_to_string(env)?))
}

/// The first `n` ints of `array` (`0 <= n <= array.length`).
pub fn ints(env: &Env<'_>, array: &JIntArray<'_>, n: i32, name: &str) -> JniResult<Vec<i32>> {
    if array.is_null() {
        return Err(JniError::Argument(format!("`{name}` is null")));
    }
    let len = array.len(env)?;
    let n = usize::try_from(n)
        .ok()
        .filter(|&n| n <= len)
        .ok_or_else(|| JniError::Argument(format!("n = {n} is outside 0..={len} (`{name}`.length)")))?;
    let mut out = vec![0; n];
    array.get_region(env, 0, &mut out)?;
    Ok(out)
}

/// Every int of `array`.
pub fn all_ints(env: &Env<'_>, array: &JIntArray<'_>, name: &str) -> JniResult<Vec<i32>> {
    if array.is_null() {
        return Err(JniError::Argument(format!("`{name}` is null")));
    }
    let len = array.len(env)?;
    ints(env, array, len as i32, name)
}

pub fn new_ints<'local>(env: &mut Env<'local>, values: &[i32]) -> JniResult<JIntArray<'local>> {
    let array = JIntArray::new(env, values.len())?;
    array.set_region(env, 0, values)?;
    Ok(array)
}

/// Locks a session; a session poisoned by a panic (a broken invariant) stays unusable.
pub fn lock<'a, T>(session: &'a Mutex<T>, what: &str) -> JniResult<MutexGuard<'a, T>> {
    session.lock().map_err(|_| {
        JniError::Poisoned(format!(
            "{what} is unusable: an earlier call panicked inside the native library (a bug; the \
             panic was reported by that call); destroy it and open a new one"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_an_internal_error_not_a_bad_argument() {
        let session = std::sync::Arc::new(Mutex::new(0));
        let held = session.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock().unwrap();
            panic!("a broken invariant");
        })
        .join();
        let err = lock(&session, "this IreeKvSession").expect_err("the lock is poisoned");
        assert!(matches!(err, JniError::Poisoned(_)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with("internal error: this IreeKvSession is unusable") && text.contains("panicked"),
            "{text}"
        );
    }
}
