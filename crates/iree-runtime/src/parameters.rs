use std::path::Path;
use std::ptr::NonNull;

use iree_runtime_sys as sys;

use crate::error::{check, Error, Result};
use crate::{path_str, string_view};

/// An open parameter file (`iree_io_file_handle_t`), opened `READ | SHARE_READ | ASYNC`.
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
}

impl FileHandle {
    /// The file memory-mapped (read-only) and wrapped as a host allocation. IREE's parameter
    /// provider *imports* entries of such a handle as device buffers on the CPU drivers (no
    /// copy: the weights stay file-backed pages, shared with the page cache and reclaimable),
    /// where an fd handle's entries are read into fresh anonymous allocations: Gemma 3 270M q8
    /// on `local-task` held 366 MB anonymous and 14 MB of the mapped archive before this, the
    /// reverse after. Not for Vulkan (its import of host memory is not what its parameter
    /// streaming expects; [`Self::open_read`] there).
    pub fn open_mapped(path: &Path) -> Result<FileHandle> {
        const OP: &str = "map parameter file";
        let fd = Self::open_read(path)?;
        // SAFETY: the system allocator is always valid.
        let allocator = unsafe { sys::iree_allocator_system() };
        let mut mapping = std::ptr::null_mut();
        // SAFETY: `fd` is live; the mapping keeps its own reference to the file while it lives.
        let status = unsafe {
            sys::iree_io_file_map_view(
                fd.raw.as_ptr(),
                sys::IREE_IO_FILE_ACCESS_READ as sys::iree_io_file_access_t,
                0,
                usize::MAX,
                0,
                allocator,
                &mut mapping,
            )
        };
        check(status, format!("{OP} {}", path.display()))?;
        // SAFETY: `mapping` is live until released by the callback below.
        let contents = unsafe { sys::iree_io_file_mapping_contents_ro(mapping) };
        let span = sys::iree_byte_span_t {
            // Read access only: IREE never writes through a READ handle.
            data: contents.data as *mut u8,
            data_length: contents.data_length,
        };
        unsafe extern "C" fn release(user_data: *mut std::ffi::c_void, _: sys::iree_io_file_handle_primitive_t) {
            // SAFETY: `user_data` is the mapping this handle owns, released exactly once here.
            unsafe { sys::iree_io_file_mapping_release(user_data as *mut sys::iree_io_file_mapping_t) };
        }
        let callback = sys::iree_io_file_handle_release_callback_t {
            fn_: Some(release),
            user_data: mapping as *mut std::ffi::c_void,
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: the span lives as long as the mapping, which the handle now owns (released
        // through the callback when the handle's last reference goes).
        let status = unsafe {
            sys::iree_io_file_handle_wrap_host_allocation(
                sys::IREE_IO_FILE_ACCESS_READ as sys::iree_io_file_access_t,
                span,
                callback,
                allocator,
                &mut raw,
            )
        };
        if let Err(e) = check(status, format!("{OP} {}", path.display())) {
            // SAFETY: the handle was not created, so the mapping is still ours.
            unsafe { sys::iree_io_file_mapping_release(mapping) };
            return Err(e);
        }
        Ok(FileHandle {
            raw: NonNull::new(raw).expect("iree_io_file_handle_wrap_host_allocation: OK and null"),
        })
    }
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
    /// Indexes every parameter of `files` under `scope`. Later files win on duplicate names.
    pub fn open(scope: &str, files: &[&Path]) -> Result<ParameterProvider> {
        Self::open_with(scope, files, false)
    }

    /// [`Self::open`] over memory-mapped files ([`FileHandle::open_mapped`]) when `mapped`: the
    /// CPU drivers then use the archive's pages instead of a copy of every weight.
    pub fn open_with(scope: &str, files: &[&Path], mapped: bool) -> Result<ParameterProvider> {
        // SAFETY: the system allocator is always valid.
        let allocator = unsafe { sys::iree_allocator_system() };
        let index = ParameterIndex::new()?;
        for file in files {
            let handle = if mapped {
                FileHandle::open_mapped(file)?
            } else {
                FileHandle::open_read(file)?
            };
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
