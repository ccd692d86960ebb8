//! Safe layer over the IREE C runtime (`iree-runtime-sys`).
//!
//! ## Design
//!
//! - **One struct per IREE object** ([`Instance`], [`Device`], [`Session`], [`BufferView`],
//!   [`ParameterProvider`], [`FileHandle`]), each holding a `NonNull` to the C object and
//!   releasing its reference in `Drop`. Children keep their parents alive: a device holds its
//!   instance, a session and every buffer view hold their device (shared through `Arc`).
//! - **Errors**: everything IREE reports becomes [`Error::Iree`] through one function
//!   (`error::check`) that takes ownership of the `iree_status_t`, formats IREE's full message
//!   and frees it. Bad arguments caught before calling IREE (unknown device names, missing
//!   files, shape/data mismatches) have their own variants. Mixing objects of different
//!   sessions (a function looked up on one, called on another) is an [`Error::InvalidArgument`].
//! - **Threading**: instances, devices, buffer views and parameter providers are `Send + Sync`
//!   (IREE makes them thread-safe). A [`Session`] is `Send` but not `Sync`: one thread at a
//!   time, and calls take `&mut self` because they may change the module's globals.
//! - **Memory**: buffers are device-local. Host data goes in with a host → device copy when a
//!   view is created and comes out with an explicit device → host transfer; nothing is mapped
//!   (results on Vulkan are not mappable).
//! - **Ordering**: a device has one timeline semaphore. Async functions (`coarse-fences`) and
//!   [`Device::transfer`] queue behind everything submitted before them on it; an async call
//!   returns before the device ran it, and every host read of a view waits first
//!   ([`Device::sync`]), so callers see results in program order and the host never waits
//!   between two submissions ([`Device::transfer_queued`] + [`Device::wait`] to wait for one).
//! - **Parameters**: a session gets an `io_parameters` module (one provider per scope) *before*
//!   the bytecode module; parameter files are opened `READ | SHARE_READ | ASYNC`, which Vulkan
//!   needs.

mod buffer_view;
mod device;
mod error;
mod instance;
mod parameters;
mod profiling;
mod session;
mod storage;
mod transfer;

use std::path::Path;

pub use buffer_view::{BufferView, ElementType, HOST_VISIBLE_UPLOAD_MAX};
pub use device::{Device, Queued, DEVICE_NAMES};
pub use error::{Error, Result, StatusCode};
pub use instance::Instance;
pub use parameters::{FileHandle, ParameterIo, ParameterProvider};
pub use profiling::Profiling;
pub use session::{Function, Session};
pub use storage::{CallStorage, StorageSpec};
pub use transfer::Transfer;

/// Re-export of the raw bindings, for what this crate does not wrap.
pub use iree_runtime_sys as sys;

/// A view of `s` for IREE. The view borrows `s`: use it only during the call it is passed to.
pub(crate) fn string_view(s: &str) -> sys::iree_string_view_t {
    sys::iree_string_view_t {
        data: s.as_ptr().cast(),
        size: s.len(),
    }
}

/// Copies an IREE string view into a `String` (lossy on invalid UTF-8).
pub(crate) fn from_string_view(view: sys::iree_string_view_t) -> String {
    if view.data.is_null() || view.size == 0 {
        return String::new();
    }
    // SAFETY: IREE string views point at `size` readable bytes for as long as their owner
    // lives; callers pass views of live objects and we copy immediately.
    let bytes = unsafe { std::slice::from_raw_parts(view.data.cast::<u8>(), view.size) };
    String::from_utf8_lossy(bytes).into_owned()
}

pub(crate) fn path_str<'a>(path: &'a Path, op: &'static str) -> Result<&'a str> {
    path.to_str().ok_or_else(|| Error::InvalidArgument {
        op,
        reason: format!("{} is not valid UTF-8", path.display()),
    })
}
