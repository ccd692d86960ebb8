//! A device profiling session written to a file: IREE's HAL-native profile bundle (`IRPF`),
//! which the wheel's `iree-profile` reads (`iree-profile dispatch FILE`, `iree-profile explain
//! FILE`). The same recorder `iree-benchmark-module --device_profiling_mode=dispatch-events`
//! drives, but around the calls a caller chooses: `bench` profiles one utterance of its own
//! session (restore, chunk call, decode steps), which `iree-benchmark-module`'s lone calls with
//! their inputs uploaded each time do not measure.

use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use iree_runtime_sys as sys;

use crate::device::Device;
use crate::error::{check, Result};
use crate::{path_str, string_view};

/// The data family of a dispatch timing profile on `device`: the GPU's timestamps of each
/// dispatch on Vulkan, the executing threads' spans on the CPU drivers (which record no device
/// timestamps: local-task refuses dispatch events). Either names each dispatch by its
/// executable's export and its queue submission, which is all `iree-profile dispatch` and
/// `scripts/h200/step-timeline.py` read.
///
/// On Vulkan the profile also asks for the queue's operations (when each was submitted and
/// released, and whether natively or held by the host until it observed the signals it waits
/// on; without the family IREE records only the held ones) and the memory events (the queue
/// allocations of each call and their pools' reservations). Session 30: every step's allocations were held by the host, so no
/// call ran ahead of it and the GPU idled between calls (`step-timeline.py`'s "between calls").
fn dispatch_families(device: &Device) -> sys::iree_hal_device_profiling_data_families_t {
    let families = match device.name() {
        "vulkan" => {
            sys::IREE_HAL_DEVICE_PROFILING_DATA_DISPATCH_EVENTS
                | sys::IREE_HAL_DEVICE_PROFILING_DATA_QUEUE_EVENTS
                | sys::IREE_HAL_DEVICE_PROFILING_DATA_MEMORY_EVENTS
        }
        _ => sys::IREE_HAL_DEVICE_PROFILING_DATA_HOST_EXECUTION_EVENTS,
    };
    families as sys::iree_hal_device_profiling_data_families_t
}

/// A profiling session on one device, recording into a file until [`Profiling::end`] (or drop,
/// which ends it and drops its error). One at a time per device: IREE refuses a nested begin.
#[must_use = "profiling records until the session is ended"]
pub struct Profiling {
    device: Device,
    sink: NonNull<sys::iree_hal_profile_sink_t>,
    path: PathBuf,
    ended: bool,
}

impl Profiling {
    /// Starts recording the timing of every dispatch `device` runs from now into `path`
    /// (created or truncated). Waits for the device's queued work first: IREE begins and ends
    /// sessions only between submissions.
    pub fn dispatches(device: &Device, path: &Path) -> Result<Profiling> {
        let op = "begin device profiling";
        let name = path_str(path, op)?;
        device.sync()?;
        let host = device.host_allocator();
        let mut file = std::ptr::null_mut();
        // SAFETY: `name` outlives the call; the handle is ours (released below: the sink keeps
        // its own reference).
        let status = unsafe {
            sys::iree_io_file_handle_create(
                sys::IREE_IO_FILE_MODE_WRITE as sys::iree_io_file_mode_t,
                string_view(name),
                0,
                host,
                &mut file,
            )
        };
        check(status, format!("{op}: create {}", path.display()))?;
        let mut sink = std::ptr::null_mut();
        // SAFETY: `file` is live; the sink retains it.
        let status = unsafe {
            let status = sys::iree_hal_profile_file_sink_create(file, host, &mut sink);
            sys::iree_io_file_handle_release(file);
            status
        };
        check(status, op)?;
        let sink = NonNull::new(sink).expect("IREE returned OK and a null profile sink");
        // SAFETY: all-zero options are IREE's documented defaults (no flags, a filter matching
        // every operation, no counters); the device copies what it keeps and retains the sink.
        let status = unsafe {
            let mut options: sys::iree_hal_device_profiling_options_t = std::mem::zeroed();
            options.data_families = dispatch_families(device);
            options.sink = sink.as_ptr();
            sys::iree_hal_device_profiling_begin(device.as_ptr(), &options)
        };
        if let Err(e) = check(status, format!("{op} on `{}`", device.name())) {
            // SAFETY: our reference from create.
            unsafe { sys::iree_hal_profile_sink_release(sink.as_ptr()) };
            return Err(e);
        }
        Ok(Profiling {
            device: device.clone(),
            sink,
            path: path.to_owned(),
            ended: false,
        })
    }

    /// Waits for the device's queued work, ends the session and completes the file.
    pub fn end(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.ended, true) {
            return Ok(());
        }
        let synced = self.device.sync();
        // SAFETY: the session begun in `begin` is still active (ended once, here).
        let status = unsafe { sys::iree_hal_device_profiling_end(self.device.as_ptr()) };
        // SAFETY: our reference from create; the device released its own at end.
        unsafe { sys::iree_hal_profile_sink_release(self.sink.as_ptr()) };
        synced?;
        check(status, format!("end device profiling into {}", self.path.display()))
    }
}

// SAFETY: the sink is touched only through its atomic reference count (released once, in
// `finish`, which takes `&mut self`); the device is thread-safe (see `Device`).
unsafe impl Send for Profiling {}

impl Drop for Profiling {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
