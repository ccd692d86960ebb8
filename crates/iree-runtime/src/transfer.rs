//! Device-side copies and fills batched into one command buffer.
//!
//! `iree_hal_device_transfer_d2d` submits and waits once per copy; a KV session that appends a
//! row to every layer's K and V would pay that 2 × layers times per token (a queue submission
//! and a host wait each on Vulkan). [`Device::transfer`] records all of a call's copies in one
//! one-shot command buffer, submits it once and waits once.

use iree_runtime_sys as sys;

use crate::buffer_view::BufferView;
use crate::device::{Device, Queued, Timeline};
use crate::error::{check, Error, Result};

/// One operation of [`Device::transfer`]. Offsets and lengths are in bytes.
#[derive(Clone, Copy, Debug)]
pub enum Transfer<'a> {
    /// `length` bytes from `source[source_offset..]` to `target[target_offset..]`.
    Copy {
        source: &'a BufferView,
        source_offset: usize,
        target: &'a BufferView,
        target_offset: usize,
        length: usize,
    },
    /// `length` bytes of `target` from `offset` set to zero (both multiples of 4).
    Zero {
        target: &'a BufferView,
        offset: usize,
        length: usize,
    },
}

const OP: &str = "device transfer";

/// `IREE_HAL_QUEUE_AFFINITY_ANY`, a C macro (`(iree_hal_queue_affinity_t)(-1)`) bindgen skips.
const QUEUE_AFFINITY_ANY: sys::iree_hal_queue_affinity_t = !0;

fn in_bounds(view: &BufferView, offset: usize, length: usize, what: &str) -> Result<()> {
    match offset.checked_add(length) {
        Some(end) if end <= view.byte_length() => Ok(()),
        _ => Err(Error::InvalidArgument {
            op: OP,
            reason: format!(
                "{what} range {offset}..{offset}+{length} is outside its {} bytes",
                view.byte_length()
            ),
        }),
    }
}

/// A command buffer reference released on drop.
struct OwnedCommandBuffer(*mut sys::iree_hal_command_buffer_t);

impl Drop for OwnedCommandBuffer {
    fn drop(&mut self) {
        // SAFETY: our reference (or null, which IREE ignores).
        unsafe { sys::iree_hal_command_buffer_release(self.0) };
    }
}

fn buffer_ref(view: &BufferView, offset: usize, length: usize) -> sys::iree_hal_buffer_ref_t {
    sys::iree_hal_buffer_ref_t {
        // SAFETY: the view is live; the buffer is borrowed for as long as the caller holds it.
        buffer: unsafe { sys::iree_hal_buffer_view_buffer(view.as_ptr()) },
        offset: offset as sys::iree_device_size_t,
        length: length as sys::iree_device_size_t,
        ..Default::default()
    }
}

impl Device {
    /// Runs `ops` on this device as one command buffer, after everything submitted to the device
    /// before (async calls return without waiting), and waits for them.
    ///
    /// Every view must live on this device and every range must lie inside its view; nothing
    /// is submitted when one does not. The ops are recorded without barriers, so the HAL may
    /// run them in any order or at once: no op may touch bytes another op of the same call
    /// writes (the caller's contract; not checked).
    pub fn transfer(&self, ops: &[Transfer<'_>]) -> Result<()> {
        let queued = self.transfer_queued(ops)?;
        self.wait(queued)
    }

    /// [`Self::transfer`] without the wait: the ops run after everything queued before and
    /// before everything queued after; [`Device::wait`] the returned point before reading what
    /// they wrote through a mapping (reads of views wait for everything by themselves). No ops:
    /// the point of the last submission.
    pub fn transfer_queued(&self, ops: &[Transfer<'_>]) -> Result<Queued> {
        if ops.is_empty() {
            let timeline = self.inner.timeline.lock().unwrap_or_else(|e| e.into_inner());
            return Ok(Queued {
                epoch: timeline.epoch,
                value: timeline.value,
            });
        }
        for op in ops {
            let views: &[&BufferView] = match op {
                Transfer::Copy { source, target, .. } => &[*source, *target],
                Transfer::Zero { target, .. } => &[*target],
            };
            if let Some(foreign) = views.iter().find(|v| !v.device().same_as(self)) {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!(
                        "a view of device `{}` in a transfer on `{}`",
                        foreign.device().name(),
                        self.name()
                    ),
                });
            }
            if let Transfer::Copy {
                source,
                source_offset,
                target,
                target_offset,
                length,
            } = *op
            {
                in_bounds(source, source_offset, length, "source")?;
                in_bounds(target, target_offset, length, "target")?;
            }
            if let Transfer::Zero { target, offset, length } = *op {
                in_bounds(target, offset, length, "fill")?;
                if offset % 4 != 0 || length % 4 != 0 {
                    return Err(Error::InvalidArgument {
                        op: OP,
                        reason: format!("fill range {offset}+{length} is not 4-byte aligned"),
                    });
                }
            }
        }

        let mut command_buffer = OwnedCommandBuffer(std::ptr::null_mut());
        // SAFETY: the device is live; the command buffer's reference goes to the guard.
        check(
            unsafe {
                sys::iree_hal_command_buffer_create(
                    self.as_ptr(),
                    sys::IREE_HAL_COMMAND_BUFFER_MODE_ONE_SHOT as _,
                    sys::IREE_HAL_COMMAND_CATEGORY_TRANSFER as _,
                    QUEUE_AFFINITY_ANY,
                    0,
                    &mut command_buffer.0,
                )
            },
            format!("{OP}: create command buffer on `{}`", self.name()),
        )?;
        let cb = command_buffer.0;
        // SAFETY: the command buffer is live and recorded by this thread only; the buffers
        // behind the references are live (the caller holds their views) until the wait below.
        unsafe {
            check(sys::iree_hal_command_buffer_begin(cb), format!("{OP}: begin"))?;
            for op in ops {
                match *op {
                    Transfer::Copy {
                        source,
                        source_offset,
                        target,
                        target_offset,
                        length,
                    } => check(
                        sys::iree_hal_command_buffer_copy_buffer(
                            cb,
                            buffer_ref(source, source_offset, length),
                            buffer_ref(target, target_offset, length),
                            sys::IREE_HAL_COPY_FLAG_NONE as _,
                        ),
                        format!("{OP}: record a copy of {length} bytes"),
                    )?,
                    Transfer::Zero { target, offset, length } => {
                        let zero = 0u32;
                        check(
                            sys::iree_hal_command_buffer_fill_buffer(
                                cb,
                                buffer_ref(target, offset, length),
                                (&zero as *const u32).cast(),
                                std::mem::size_of::<u32>(),
                                sys::IREE_HAL_FILL_FLAG_NONE as _,
                            ),
                            format!("{OP}: record a fill of {length} bytes"),
                        )?
                    }
                }
            }
            check(sys::iree_hal_command_buffer_end(cb), format!("{OP}: end"))?;
        }

        let mut timeline = self.inner.timeline.lock().unwrap_or_else(|e| e.into_inner());
        match self.submit(&mut timeline, cb) {
            Ok(()) => Ok(Queued {
                epoch: timeline.epoch,
                value: timeline.value,
            }),
            Err(e) => {
                timeline.reset();
                Err(e)
            }
        }
    }

    /// Creates the timeline's semaphore if it has none (first use, or after a failure).
    pub(crate) fn ensure_timeline(&self, timeline: &mut Timeline) -> Result<()> {
        if !timeline.semaphore.is_null() {
            return Ok(());
        }
        // SAFETY: device live; the semaphore's reference goes to the timeline.
        check(
            unsafe {
                sys::iree_hal_semaphore_create(
                    self.as_ptr(),
                    QUEUE_AFFINITY_ANY,
                    0,
                    sys::IREE_HAL_SEMAPHORE_FLAG_NONE as _,
                    &mut timeline.semaphore,
                )
            },
            format!("{OP}: create semaphore"),
        )
    }

    /// Submits `cb` after everything already on the device's timeline (async calls return
    /// without waiting), signalling its next value: a call and the transfer that reads its
    /// result cost one host wait.
    fn submit(&self, timeline: &mut Timeline, cb: *mut sys::iree_hal_command_buffer_t) -> Result<()> {
        self.ensure_timeline(timeline)?;
        let before = timeline.value;
        let next = before + 1;
        let mut semaphores = [timeline.semaphore];
        let mut signal_values = [next];
        let signal = sys::iree_hal_semaphore_list_t {
            count: 1,
            semaphores: semaphores.as_mut_ptr(),
            payload_values: signal_values.as_mut_ptr(),
        };
        let mut wait_semaphores = [timeline.semaphore];
        let mut wait_values = [before];
        let wait = sys::iree_hal_semaphore_list_t {
            count: 1,
            semaphores: wait_semaphores.as_mut_ptr(),
            payload_values: wait_values.as_mut_ptr(),
        };
        // SAFETY: everything passed is live until the wait returns; the lists point at locals
        // that outlive the call (IREE copies what it keeps).
        let submitted = check(
            unsafe {
                sys::iree_hal_device_queue_execute(
                    self.as_ptr(),
                    QUEUE_AFFINITY_ANY,
                    wait,
                    signal,
                    cb,
                    sys::iree_hal_buffer_binding_table_t {
                        count: 0,
                        bindings: std::ptr::null(),
                    },
                    sys::IREE_HAL_EXECUTE_FLAG_NONE as _,
                )
            },
            format!("{OP}: submit on `{}`", self.name()),
        );
        if let Err(e) = submitted {
            let _ = timeline.wait(before, OP);
            return Err(e);
        }
        timeline.value = next;
        Ok(())
    }
}
