//! One model, many sessions: every KV and redecode session of a process that opens the same
//! module with the same archive on the same device shares one IREE context, so the weights (the
//! archive's mapping, and whatever the module's initializers build from them) exist once, and a
//! further session costs only its own caches (LiteRT-LM's engine/session split, llama.cpp's
//! model/context). Sessions on one device also share the device (one executor, one allocator).
//! On the CPU drivers only, for now: see [`shareable`].
//!
//! A context's calls are serialised by a mutex: module globals are read-only after
//! initialisation, so sharing is safe, but IREE invocations on one context must not overlap.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use iree_runtime::{Device, Instance, Session};
use kv_core::manifest::ENCODED_SCOPE;
use kv_core::{Error, Result};

use crate::convert::iree_err;

/// What makes two devices the same: the driver name and the worker count asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeviceKey {
    pub name: String,
    pub workers: Option<usize>,
}

/// A file by path and identity: a file renamed over the old one is another module.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FileKey {
    path: PathBuf,
    identity: (u64, u64, u64, i64, i64),
}

impl FileKey {
    fn of(path: &Path) -> Result<FileKey> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(|source| Error::Io {
            what: "reading artifact metadata",
            path: path.display().to_string(),
            source,
        })?;
        Ok(FileKey {
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            identity: (meta.dev(), meta.ino(), meta.len(), meta.mtime(), meta.mtime_nsec()),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ModuleKey {
    device: DeviceKey,
    vmfb: FileKey,
    archive: FileKey,
    scope: String,
    encoded: Option<FileKey>,
}

/// An IREE context shared by every session that opened the same module, archive and device.
pub(crate) struct SharedModule {
    key: ModuleKey,
    device: Device,
    session: Mutex<Session>,
}

impl SharedModule {
    /// The context, for one call at a time.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Session> {
        // A panic in another session's call leaves the context as IREE left it: still usable.
        self.session.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The live shared modules; entries whose sessions all closed are pruned on each open.
static OPEN: Mutex<Vec<Weak<SharedModule>>> = Mutex::new(Vec::new());

fn live() -> MutexGuard<'static, Vec<Weak<SharedModule>>> {
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    open.retain(|m| m.strong_count() > 0);
    open
}

/// Whether sessions of different callers may share a device of this driver. Not Vulkan: with
/// one `VkDevice` used by sessions on several threads at once, lavapipe lost the device
/// (`VK_ERROR_DEVICE_LOST` in `vkWaitSemaphores`, the conformance suites on two threads, v1 and
/// v2 alike); each Vulkan session keeps a device of its own (its graphs still share it).
fn shareable(key: &DeviceKey) -> bool {
    key.name != "vulkan"
}

/// The device a live module already uses, or a new one.
pub(crate) fn device(key: &DeviceKey) -> Result<Device> {
    if !shareable(key) {
        return open_device(key);
    }
    if let Some(device) = live()
        .iter()
        .filter_map(Weak::upgrade)
        .find(|m| &m.key.device == key)
        .map(|m| m.device.clone())
    {
        return Ok(device);
    }
    open_device(key)
}

fn open_device(key: &DeviceKey) -> Result<Device> {
    let instance = Instance::shared().map_err(iree_err("create instance"))?;
    match (key.name.as_str(), key.workers) {
        ("local-task", Some(workers)) => Device::open_local_task(&instance, workers),
        (name, _) => Device::open(&instance, name),
    }
    .map_err(iree_err(format!("open device `{}`", key.name)))
}

/// The live context of `vmfb` with `archive` (under `scope`) and its `encoded` archive (under
/// [`ENCODED_SCOPE`], if it has one) on `device`, or a new one. The registry stays locked while a
/// new context opens, so two sessions opening the same model at once get one. `verify` runs
/// before a module is loaded (the files' digests), not when a live context is reused.
pub(crate) fn module(
    device: &Device,
    device_key: &DeviceKey,
    vmfb: &Path,
    archive: &Path,
    scope: &str,
    encoded: Option<&Path>,
    verify: impl FnOnce() -> Result<()>,
) -> Result<Arc<SharedModule>> {
    let key = ModuleKey {
        device: device_key.clone(),
        vmfb: FileKey::of(vmfb)?,
        archive: FileKey::of(archive)?,
        scope: scope.to_string(),
        encoded: encoded.map(FileKey::of).transpose()?,
    };
    let mut open = live();
    // The device too: two threads opening at once may each have made a device for one key.
    if let Some(module) = open
        .iter()
        .filter_map(Weak::upgrade)
        .find(|m| m.key == key && m.device.same_as(device))
    {
        return Ok(module);
    }
    // Only where the module is loaded: a live context was checked when it was.
    verify()?;
    let mut parameters = vec![(scope, archive)];
    parameters.extend(encoded.map(|e| (ENCODED_SCOPE, e)));
    let session = Session::open(device, vmfb, &parameters).map_err(iree_err(format!(
        "open `{}` with parameters `{}`{}",
        vmfb.display(),
        archive.display(),
        encoded.map(|e| format!(" and `{}`", e.display())).unwrap_or_default()
    )))?;
    let module = Arc::new(SharedModule {
        key,
        device: device.clone(),
        session: Mutex::new(session),
    });
    open.push(Arc::downgrade(&module));
    Ok(module)
}

/// How many contexts are open in this process (tests check sharing with it).
pub fn open_module_count() -> usize {
    live().len()
}
