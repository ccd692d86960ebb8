//! `jlong` handles: keys into typed registries of owned Rust objects (STYLE 14).
//!
//! A handle is `kind << 48 | serial`, the serial drawn from one process-wide counter and never
//! reused, so a destroyed handle stays invalid forever instead of naming a newer object, and a
//! handle of one kind passed where another is expected is named as such.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use jni::sys::jlong;

use crate::error::{JniError, JniResult};

const KIND_SHIFT: u32 = 48;
const SERIAL_MASK: u64 = (1 << KIND_SHIFT) - 1;

static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// The kinds of object a handle can name; the value is stored in the handle's top bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    KvSession = 1,
    KvSnapshot = 2,
    RedecodeSession = 3,
    Engine = 4,
    Conversation = 5,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::KvSession => "IreeKvSession",
            Kind::KvSnapshot => "IreeKvSession snapshot",
            Kind::RedecodeSession => "IreeRedecodeSession",
            Kind::Engine => "Engine",
            Kind::Conversation => "Conversation",
        }
    }

    fn from_bits(bits: u64) -> Option<Kind> {
        [
            Kind::KvSession,
            Kind::KvSnapshot,
            Kind::RedecodeSession,
            Kind::Engine,
            Kind::Conversation,
        ]
        .into_iter()
        .find(|k| *k as u64 == bits)
    }
}

/// Live objects of one kind, by handle.
pub struct Registry<T> {
    kind: Kind,
    live: Mutex<BTreeMap<u64, Arc<T>>>,
}

impl<T> Registry<T> {
    pub const fn new(kind: Kind) -> Self {
        Registry {
            kind,
            live: Mutex::new(BTreeMap::new()),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<T>>> {
        // The map is consistent after any panic (inserts and removes are single calls).
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes ownership of `value` and returns its new handle.
    pub fn insert(&self, value: T) -> jlong {
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        if serial > SERIAL_MASK {
            kv_core::error::invariant("JNI handle serials exhausted");
        }
        let key = (self.kind as u64) << KIND_SHIFT | serial;
        self.live().insert(key, Arc::new(value));
        key as jlong
    }

    /// The object `handle` names; it stays alive while the caller holds the `Arc`, even if the
    /// handle is destroyed meanwhile.
    pub fn get(&self, handle: jlong) -> JniResult<Arc<T>> {
        let key = self.check(handle)?;
        self.live().get(&key).cloned().ok_or_else(|| self.gone(handle))
    }

    /// Removes `handle`; later uses of it are errors.
    pub fn remove(&self, handle: jlong) -> JniResult<Arc<T>> {
        let key = self.check(handle)?;
        self.live().remove(&key).ok_or_else(|| self.gone(handle))
    }

    pub fn len(&self) -> usize {
        self.live().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check(&self, handle: jlong) -> JniResult<u64> {
        let name = self.kind.name();
        if handle == 0 {
            return Err(JniError::Handle(format!(
                "{name} handle is 0 (never created, or already closed)"
            )));
        }
        let key = handle as u64;
        match Kind::from_bits(key >> KIND_SHIFT) {
            Some(kind) if kind == self.kind => Ok(key),
            Some(kind) => Err(JniError::Handle(format!(
                "handle {handle:#x} names an object of kind `{}`, not `{name}`",
                kind.name()
            ))),
            None => Err(JniError::Handle(format!(
                "{handle:#x} is not a handle of kind `{name}`"
            ))),
        }
    }

    fn gone(&self, handle: jlong) -> JniError {
        JniError::Handle(format!(
            "{} handle {handle:#x} is closed (destroyed or released) or was never issued",
            self.kind.name()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(e: JniError) -> String {
        e.to_string()
    }

    #[test]
    fn handles_are_checked_and_never_reused() {
        let sessions: Registry<&str> = Registry::new(Kind::KvSession);
        let snapshots: Registry<&str> = Registry::new(Kind::KvSnapshot);
        let a = sessions.insert("a");
        assert_eq!(*sessions.get(a).unwrap(), "a");
        assert!(message(sessions.get(0).unwrap_err()).contains("is 0"));
        assert!(message(snapshots.get(a).unwrap_err()).contains("kind `IreeKvSession`, not"));
        assert!(message(sessions.get(12345).unwrap_err()).contains("not a handle of kind `IreeKvSession`"));
        let held = sessions.get(a).unwrap();
        sessions.remove(a).unwrap();
        assert_eq!(*held, "a", "a caller's Arc outlives the handle");
        assert!(message(sessions.get(a).unwrap_err()).contains("closed"));
        assert!(message(sessions.remove(a).unwrap_err()).contains("closed"));
        let b = sessions.insert("b");
        assert_ne!(a, b);
        let stale = sessions.get(a).unwrap_err();
        assert!(
            matches!(&stale, JniError::Handle(m) if m.contains("closed")),
            "a stale handle does not name the newer object: {stale:?}"
        );
        assert_eq!(sessions.len(), 1);
        let forged = ((Kind::KvSession as u64) << KIND_SHIFT | SERIAL_MASK) as jlong;
        let err = sessions.get(forged).unwrap_err();
        assert!(
            matches!(&err, JniError::Handle(m) if m.contains("never issued")),
            "{err:?}"
        );
    }
}
