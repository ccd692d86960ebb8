use std::path::Path;
use std::ptr::NonNull;

use iree_runtime_sys as sys;

use crate::error::{check, Error, Result};
use crate::{path_str, string_view};

/// How a parameter file reaches the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParameterIo {
    /// Read through the file descriptor into device allocations: a second, private copy of
    /// every parameter the module loads. What Vulkan needs (see [`FileHandle::open_read`]).
    File,
    /// The file mapped read-only and each parameter imported as a buffer over the mapping (IREE's
    /// host-allocation import): no copy, pages come in as the kernels touch them, stay
    /// reclaimable page cache, and are shared by every process mapping the same file. For the
    /// CPU drivers, whose device memory is host memory.
    Mapped,
}

impl ParameterIo {
    /// [`ParameterIo::Mapped`] for the CPU drivers (`local-task`, `local-sync`), otherwise
    /// [`ParameterIo::File`].
    ///
    /// `SKAINET_KV_PARAMETER_IO=file|mapped` overrides the choice (for measuring one against the
    /// other).
    pub fn for_driver(driver: &str) -> ParameterIo {
        match std::env::var("SKAINET_KV_PARAMETER_IO").as_deref() {
            Ok("file") => return ParameterIo::File,
            Ok("mapped") => return ParameterIo::Mapped,
            _ => {}
        }
        if driver.starts_with("local-") {
            ParameterIo::Mapped
        } else {
            ParameterIo::File
        }
    }
}

/// An open parameter file (`iree_io_file_handle_t`): a descriptor opened
/// `READ | SHARE_READ | ASYNC` ([`FileHandle::open_read`]) or a read-only mapping
/// ([`FileHandle::map_read`]).
///
/// `ASYNC` is what lets the Vulkan driver stream parameters from the file (a plain `READ` handle
/// fails there with "Vulkan fd file transfers require a proactor-backed async file handle");
/// the CPU drivers accept it too.
pub struct FileHandle {
    raw: NonNull<sys::iree_io_file_handle_t>,
}

// SAFETY: file handles are immutable after open and reference counted atomically; IREE shares
// them across threads (the parameter index and the device's transfer threads read through them).
unsafe impl Send for FileHandle {}
// SAFETY: as above; no method mutates the handle.
unsafe impl Sync for FileHandle {}

impl Drop for FileHandle {
    fn drop(&mut self) {
        // SAFETY: we own one reference; indices that use the file hold their own.
        unsafe { sys::iree_io_file_handle_release(self.raw.as_ptr()) };
    }
}

impl FileHandle {
    pub fn open_read(path: &Path) -> Result<FileHandle> {
        const OP: &str = "open parameter file";
        if !path.is_file() {
            return Err(Error::FileNotFound {
                op: OP,
                path: path.to_owned(),
            });
        }
        let path_utf8 = path_str(path, OP)?;
        let mode = (sys::IREE_IO_FILE_MODE_READ | sys::IREE_IO_FILE_MODE_SHARE_READ | sys::IREE_IO_FILE_MODE_ASYNC)
            as sys::iree_io_file_mode_t;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the path view is valid for the call (IREE copies it); `raw` receives one
        // reference owned by the returned value.
        let status = unsafe {
            sys::iree_io_file_handle_open(mode, string_view(path_utf8), sys::iree_allocator_system(), &mut raw)
        };
        check(status, format!("{OP} {}", path.display()))?;
        Ok(FileHandle {
            raw: NonNull::new(raw).expect("iree_io_file_handle_open: OK and null"),
        })
    }

    /// Maps `path` read-only and wraps the mapping as a host allocation, which the parameter
    /// provider imports as device buffers without copying ([`ParameterIo::Mapped`]). The mapping
    /// lives until IREE releases the last reference to the handle (buffers imported from it
    /// included). Like every read-only mapping it assumes the file is not truncated while mapped;
    /// the export cache replaces entries by renaming new files in, never by rewriting.
    pub fn map_read(path: &Path) -> Result<FileHandle> {
        const OP: &str = "map parameter file";
        if !path.is_file() {
            return Err(Error::FileNotFound {
                op: OP,
                path: path.to_owned(),
            });
        }
        let io_err = |e: std::io::Error| Error::InvalidArgument {
            op: OP,
            reason: format!("{}: {e}", path.display()),
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        // SAFETY: read-only mapping of a file the caller does not modify while it is mapped (see
        // above); nothing in this process writes through it (IREE is given READ access only).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
        let map = Box::new(map);
        let span = sys::iree_byte_span_t {
            // IREE's span type is mutable; the handle's access is READ, so nothing writes.
            data: map.as_ptr().cast_mut(),
            data_length: map.len(),
        };
        let release = sys::iree_io_file_handle_release_callback_t {
            fn_: Some(release_mapping),
            user_data: Box::into_raw(map).cast(),
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: the span stays valid until `release_mapping` runs, which IREE calls exactly
        // once when the handle's last reference goes (also when this call fails, see below).
        let status = unsafe {
            sys::iree_io_file_handle_wrap_host_allocation(
                sys::IREE_IO_FILE_ACCESS_READ as sys::iree_io_file_access_t,
                span,
                release,
                sys::iree_allocator_system(),
                &mut raw,
            )
        };
        if let Err(e) = check(status, format!("{OP} {}", path.display())) {
            // On failure IREE never took ownership: free the mapping ourselves.
            // SAFETY: `user_data` came from Box::into_raw above and was not released by IREE.
            drop(unsafe { Box::from_raw(release.user_data.cast::<memmap2::Mmap>()) });
            return Err(e);
        }
        Ok(FileHandle {
            raw: NonNull::new(raw).expect("iree_io_file_handle_wrap_host_allocation: OK and null"),
        })
    }

    fn open(path: &Path, io: ParameterIo) -> Result<FileHandle> {
        match io {
            ParameterIo::File => FileHandle::open_read(path),
            ParameterIo::Mapped => FileHandle::map_read(path),
        }
    }
}

/// Unmaps a [`FileHandle::map_read`] mapping once IREE drops the handle.
unsafe extern "C" fn release_mapping(
    user_data: *mut std::ffi::c_void,
    _primitive: sys::iree_io_file_handle_primitive_t,
) {
    // SAFETY: `user_data` is the Box<Mmap> leaked in `map_read`; IREE calls this once.
    drop(unsafe { Box::from_raw(user_data.cast::<memmap2::Mmap>()) });
}

/// A parameter provider (`iree_io_parameter_provider_t`) serving every parameter of some
/// files under one scope (the `"model"` in `#flow.parameter.named<"model"::"w">`).
///
/// The formats are recognised by extension: `.irpa`, `.gguf`, `.safetensors`.
pub struct ParameterProvider {
    raw: NonNull<sys::iree_io_parameter_provider_t>,
    scope: String,
}

// SAFETY: providers are designed to be shared by sessions on many threads: the index is
// immutable once built and the provider's own state is internally synchronized.
unsafe impl Send for ParameterProvider {}
// SAFETY: as above.
unsafe impl Sync for ParameterProvider {}

impl Drop for ParameterProvider {
    fn drop(&mut self) {
        // SAFETY: we own one reference; io_parameters modules made from it hold their own.
        unsafe { sys::iree_io_parameter_provider_release(self.raw.as_ptr()) };
    }
}

impl ParameterProvider {
    /// Indexes every parameter of `files` under `scope`, each file opened as `io` says. Later
    /// files win on duplicate names.
    pub fn open(scope: &str, files: &[&Path], io: ParameterIo) -> Result<ParameterProvider> {
        // SAFETY: the system allocator is always valid.
        let allocator = unsafe { sys::iree_allocator_system() };
        let index = ParameterIndex::new()?;
        for file in files {
            let handle = FileHandle::open(file, io)?;
            let path_utf8 = path_str(file, "index parameter file")?;
            // SAFETY: index and handle are live; the index retains the handle for each entry.
            let status = unsafe {
                sys::iree_io_parse_file_index(
                    string_view(path_utf8),
                    handle.raw.as_ptr(),
                    index.raw.as_ptr(),
                    allocator,
                )
            };
            check(status, format!("index parameter file {}", file.display()))?;
        }
        let mut raw = std::ptr::null_mut();
        // SAFETY: `scope` is copied by IREE; the provider retains the index.
        let status = unsafe {
            sys::iree_io_parameter_index_provider_create(
                string_view(scope),
                index.raw.as_ptr(),
                sys::IREE_IO_PARAMETER_INDEX_PROVIDER_DEFAULT_MAX_CONCURRENT_OPERATIONS as usize,
                allocator,
                &mut raw,
            )
        };
        check(status, format!("create parameter provider `{scope}`"))?;
        Ok(ParameterProvider {
            raw: NonNull::new(raw).expect("iree_io_parameter_index_provider_create: OK and null"),
            scope: scope.to_owned(),
        })
    }

    pub fn scope(&self) -> &str {
        &self.scope
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::iree_io_parameter_provider_t {
        self.raw.as_ptr()
    }
}

impl std::fmt::Debug for ParameterProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParameterProvider").field("scope", &self.scope).finish()
    }
}

/// `iree_io_parameter_index_t`: only needed while a provider is built (the provider retains it).
struct ParameterIndex {
    raw: NonNull<sys::iree_io_parameter_index_t>,
}

impl ParameterIndex {
    fn new() -> Result<ParameterIndex> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` receives one reference owned by the returned value.
        let status = unsafe { sys::iree_io_parameter_index_create(sys::iree_allocator_system(), &mut raw) };
        check(status, "create parameter index")?;
        Ok(ParameterIndex {
            raw: NonNull::new(raw).expect("iree_io_parameter_index_create: null"),
        })
    }
}

impl Drop for ParameterIndex {
    fn drop(&mut self) {
        // SAFETY: we own one reference; providers made from the index hold their own.
        unsafe { sys::iree_io_parameter_index_release(self.raw.as_ptr()) };
    }
}
