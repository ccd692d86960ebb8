use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use iree_runtime_sys as sys;

use crate::error::{check, Result};

/// An IREE runtime instance (`iree_runtime_instance_t`): the VM instance plus the registry of
/// every HAL driver linked in (local-sync, local-task, vulkan). Cheap to clone (shared).
#[derive(Clone)]
pub struct Instance {
    pub(crate) inner: Arc<InstanceInner>,
}

pub(crate) struct InstanceInner {
    pub(crate) raw: NonNull<sys::iree_runtime_instance_t>,
}

// SAFETY: iree_runtime_instance_t is documented thread-safe ("instances are thread-safe and may
// be shared across threads"): its state is immutable after creation apart from the atomic
// reference count, and its driver registry is internally synchronized.
unsafe impl Send for InstanceInner {}
// SAFETY: as above; every entry point we call takes the instance as shared state.
unsafe impl Sync for InstanceInner {}

impl Drop for InstanceInner {
    fn drop(&mut self) {
        // SAFETY: we own one reference, taken at creation; devices and sessions hold their own
        // (and an Arc to this value), so nothing uses the pointer after this.
        unsafe { sys::iree_runtime_instance_release(self.raw.as_ptr()) };
    }
}

impl Instance {
    /// The process-wide instance, created on first use with every HAL driver compiled into the
    /// runtime registered.
    ///
    /// There is deliberately no way to make a second one. Creating an IREE instance registers
    /// the HAL's VM types, and registration writes process-global type ids (first zeroing them,
    /// `iree_vm_instance_register_type`): a call running on another thread at that moment sees
    /// a zero id and fails with "ref type mismatch" (reproduced in a few milliseconds by
    /// creating instances in a loop beside a session making calls). One instance per process,
    /// created under a lock, keeps every later session, on any thread, safe.
    pub fn shared() -> Result<Instance> {
        static SHARED: Mutex<Option<Instance>> = Mutex::new(None);
        // A poisoned lock only means another thread panicked while holding it; the slot is
        // either empty or holds a complete instance, both of which are fine to use.
        let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(instance) = slot.as_ref() {
            return Ok(instance.clone());
        }
        let instance = Instance::create()?;
        *slot = Some(instance.clone());
        Ok(instance)
    }

    fn create() -> Result<Instance> {
        let mut options = sys::iree_runtime_instance_options_t::default();
        let mut raw = std::ptr::null_mut();
        // SAFETY: `options` is initialized by the first call before use; `raw` receives a new
        // instance with one reference owned by us on success.
        let status = unsafe {
            sys::iree_runtime_instance_options_initialize(&mut options);
            sys::iree_runtime_instance_options_use_all_available_drivers(&mut options);
            sys::iree_runtime_instance_create(&options, sys::iree_allocator_system(), &mut raw)
        };
        check(status, "create IREE instance")?;
        let raw = NonNull::new(raw).expect("iree_runtime_instance_create returned OK and null");
        Ok(Instance {
            inner: Arc::new(InstanceInner { raw }),
        })
    }

    /// Whether both handles are the same IREE instance.
    pub fn same_as(&self, other: &Instance) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::iree_runtime_instance_t {
        self.inner.raw.as_ptr()
    }

    pub(crate) fn host_allocator(&self) -> sys::iree_allocator_t {
        // SAFETY: the instance is live while `self` is.
        unsafe { sys::iree_runtime_instance_host_allocator(self.as_ptr()) }
    }
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance").field("raw", &self.inner.raw).finish()
    }
}
