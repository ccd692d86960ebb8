//! The crate's one error type, and [`check`], the single place where an `iree_status_t` becomes
//! a Rust value.

use std::path::PathBuf;

use iree_runtime_sys as sys;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from the IREE runtime and from argument checks done before calling into it.
///
/// Every variant names the operation that failed. Misuse that cannot be expressed as bad input
/// (e.g. a buffer view used with a device of another instance) is not an error but a panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// IREE returned a failing status; `message` is IREE's own formatted text.
    #[error("{op}: IREE {code}: {message}")]
    Iree {
        op: String,
        code: StatusCode,
        message: String,
    },

    #[error("open device: unknown device `{name}`; valid names: {}", valid.join(", "))]
    UnknownDevice {
        name: String,
        valid: &'static [&'static str],
    },

    #[error("look up function `{name}`: not exported by the session's modules; exported: [{}]", available.join(", "))]
    FunctionNotFound { name: String, available: Vec<String> },

    #[error("{op}: {path}: file not found")]
    FileNotFound { op: &'static str, path: PathBuf },

    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
}

/// An IREE status code (`iree_status_code_t`), printed with IREE's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StatusCode(pub u32);

impl std::fmt::Display for StatusCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: iree_status_code_string accepts any code and returns a static C string.
        let name = unsafe { std::ffi::CStr::from_ptr(sys::iree_status_code_string(self.0)) };
        f.write_str(&name.to_string_lossy())
    }
}

/// Takes ownership of `status`: `Ok(())` when it is OK, otherwise an [`Error::Iree`] carrying
/// IREE's formatted message (with its annotations and source locations), after freeing it.
///
/// `op` names what was being done, e.g. `"create session"`.
pub(crate) fn check(status: sys::iree_status_t, op: impl Into<String>) -> Result<()> {
    // `iree_status_code` is a C macro: the code lives in the low bits of the pointer value.
    let code = (status as usize & sys::IREE_STATUS_CODE_MASK as usize) as u32;
    if code == sys::IREE_STATUS_OK {
        return Ok(());
    }
    let message = format_status(status);
    // SAFETY: `status` is a failing status we own (callers pass each status once, straight from
    // the C call); iree_status_free releases its storage and never touches it again.
    unsafe { sys::iree_status_free(status) };
    Err(Error::Iree {
        op: op.into(),
        code: StatusCode(code),
        message,
    })
}

fn format_status(status: sys::iree_status_t) -> String {
    // SAFETY: the system allocator is always valid.
    let allocator = unsafe { sys::iree_allocator_system() };
    let mut buffer: *mut std::ffi::c_char = std::ptr::null_mut();
    let mut length: sys::iree_host_size_t = 0;
    // SAFETY: `status` is live (not yet freed); on success the buffer is allocated with
    // `allocator`, holds `length` bytes and is freed below with the same allocator.
    let ok = unsafe { sys::iree_status_to_string(status, &allocator, &mut buffer, &mut length) };
    if !ok || buffer.is_null() {
        return "(IREE could not format the status)".into();
    }
    // SAFETY: iree_status_to_string wrote `length` valid bytes at `buffer`.
    let bytes = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), length) };
    let message = String::from_utf8_lossy(bytes).into_owned();
    // SAFETY: `buffer` came from `allocator` and is not used after this.
    unsafe { sys::iree_allocator_free(allocator, buffer.cast()) };
    message
}
