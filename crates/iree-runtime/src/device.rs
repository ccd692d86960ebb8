use std::ptr::NonNull;
use std::sync::Arc;

use iree_runtime_sys as sys;

use crate::error::{check, Error, Result};
use crate::instance::Instance;
use crate::string_view;

/// The HAL drivers linked into the runtime, by the names [`Device::open`] accepts.
pub const DEVICE_NAMES: &[&str] = &["local-task", "local-sync", "vulkan"];

/// A HAL device (`iree_hal_device_t`). Cheap to clone (shared); keeps its [`Instance`] alive.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    raw: NonNull<sys::iree_hal_device_t>,
    /// The single-device group every session on this device binds its HAL module to. Making a
    /// group assigns the device's queues their topology (Vulkan: a frontier per queue, which can
    /// be assigned once), so one group per device, made at open, is what lets several sessions
    /// (the seed's three archives) share a Vulkan device. `iree_runtime_session_create_with_device`
    /// makes a group per session, and the second one failed with "Vulkan queue frontier already
    /// assigned".
    group: NonNull<sys::iree_hal_device_group_t>,
    name: String,
    pub(crate) instance: Instance,
    /// The semaphore [`Device::transfer`](crate::Transfer) and the calls of async functions
    /// (`Session::call_function`) signal and wait on; made at first use, dropped after a failure
    /// (a failed semaphore stays failed). One per device, not one per transfer or call: on the
    /// H200 over Vulkan creating one cost ~0.65 ms.
    pub(crate) timeline: std::sync::Mutex<Timeline>,
}

/// A semaphore reference (null before the first transfer), the value the last submission will
/// signal, and the value the host has seen it reach.
///
/// Async calls return without waiting (`value` runs ahead of `reached`), so the next submission
/// queues behind them on the device instead of after a host round trip; every host access to
/// device data waits first ([`Device::sync`]).
pub(crate) struct Timeline {
    pub(crate) semaphore: *mut sys::iree_hal_semaphore_t,
    pub(crate) value: u64,
    pub(crate) reached: u64,
    /// How many semaphores this device had before the current one: a [`Queued`] of an earlier
    /// one can no longer be waited for.
    pub(crate) epoch: u64,
}

/// A point on a device's timeline that a queued submission will signal
/// ([`Device::transfer_queued`]); [`Device::wait`] waits for it.
#[must_use = "a queued transfer is not done until it is waited for"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    pub(crate) epoch: u64,
    pub(crate) value: u64,
}

impl Timeline {
    /// Releases the semaphore (a failed one, or at device drop); the next transfer makes another.
    pub(crate) fn reset(&mut self) {
        // SAFETY: our reference, or null, which IREE ignores.
        unsafe { sys::iree_hal_semaphore_release(self.semaphore) };
        self.semaphore = std::ptr::null_mut();
        self.value = 0;
        self.reached = 0;
        self.epoch += 1;
    }

    /// Waits until the semaphore reaches `value` (at most the last submitted); on failure the
    /// timeline is reset, because a failed semaphore stays failed.
    pub(crate) fn wait(&mut self, value: u64, op: &str) -> Result<()> {
        if value <= self.reached || self.semaphore.is_null() {
            return Ok(());
        }
        // SAFETY: the semaphore is live (the timeline holds it).
        let status =
            unsafe { sys::iree_hal_semaphore_wait(self.semaphore, value, sys::iree_infinite_timeout(), 0 as _) };
        match check(status, format!("{op}: wait for the device")) {
            Ok(()) => {
                self.reached = value;
                Ok(())
            }
            Err(e) => {
                self.reset();
                Err(e)
            }
        }
    }
}

// SAFETY: HAL devices are thread-safe by contract (iree/hal/device.h: "thread-safe"); allocation,
// transfers and queue submission may be issued from any thread. Only the atomic reference count
// changes on retain/release.
unsafe impl Send for DeviceInner {}
// SAFETY: as above.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let timeline = self.timeline.get_mut().unwrap_or_else(|e| e.into_inner());
        // Async calls return before they ran: let the last one finish before the device goes
        // (a failure there is no caller's to report any more).
        let last = timeline.value;
        let _ = timeline.wait(last, "release the device");
        timeline.reset();
        // SAFETY: we own both references taken at creation; buffer views and sessions made on the
        // device hold an Arc to this value, so they are gone (or hold their own IREE
        // references) by now. The group retains the device, so it goes first.
        unsafe {
            sys::iree_hal_device_group_release(self.group.as_ptr());
            sys::iree_hal_device_release(self.raw.as_ptr());
        }
    }
}

impl Device {
    /// Opens the default device of the driver `name`: one of [`DEVICE_NAMES`].
    ///
    /// `vulkan` needs a Vulkan loader and ICD at run time (IREE `dlopen`s it); without one the
    /// error carries IREE's explanation.
    pub fn open(instance: &Instance, name: &str) -> Result<Device> {
        if !DEVICE_NAMES.contains(&name) {
            return Err(Error::UnknownDevice {
                name: name.to_owned(),
                valid: DEVICE_NAMES,
            });
        }
        let mut raw = std::ptr::null_mut();
        // SAFETY: the instance is live; `name` outlives the call (IREE copies what it keeps).
        let status = unsafe {
            sys::iree_runtime_instance_try_create_default_device(instance.as_ptr(), string_view(name), &mut raw)
        };
        check(status, format!("open device `{name}`"))?;
        Device::from_raw(raw, name, instance)
    }

    /// Opens a `local-task` device whose task executor has `workers` worker threads
    /// (one topology group each, no affinity). `workers == 0` means only the calling thread works.
    pub fn open_local_task(instance: &Instance, workers: usize) -> Result<Device> {
        let host = instance.host_allocator();
        let driver = create_local_task_driver(workers, host)?;
        let op = "open device `local-task` with explicit workers";
        let mut pool = std::ptr::null_mut();
        // SAFETY: NULL node ids with a node count is the documented default; `pool` gets one
        // reference that we release below.
        let status = unsafe {
            sys::iree_async_proactor_pool_create(
                sys::iree_numa_node_count(),
                std::ptr::null(),
                sys::iree_async_proactor_pool_options_default(),
                host,
                &mut pool,
            )
        };
        let result = check(status, op).and_then(|()| {
            let mut raw = std::ptr::null_mut();
            // SAFETY: `driver` and `pool` are live; the device retains the pool itself.
            let status = unsafe {
                let mut params = sys::iree_hal_device_create_params_default();
                params.proactor_pool = pool;
                sys::iree_hal_driver_create_default_device(driver.as_ptr(), &params, host, &mut raw)
            };
            check(status, op).map(|()| raw)
        });
        // SAFETY: both references are ours; the device (if made) retains what it needs.
        unsafe {
            if !pool.is_null() {
                sys::iree_async_proactor_pool_release(pool);
            }
            sys::iree_hal_driver_release(driver.as_ptr());
        }
        Device::from_raw(result?, "local-task", instance)
    }

    /// Takes ownership of `raw` (one reference) and makes the device's group.
    fn from_raw(raw: *mut sys::iree_hal_device_t, name: &str, instance: &Instance) -> Result<Device> {
        let raw = NonNull::new(raw).expect("IREE returned OK and a null device");
        let host = instance.host_allocator();
        let mut tracker = std::ptr::null_mut();
        let mut group = std::ptr::null_mut();
        // SAFETY: the device is live; the group retains the device and the tracker, so our
        // tracker reference is released right after (null-safe on failure).
        let status = unsafe {
            let status = sys::iree_async_frontier_tracker_create(
                sys::iree_async_frontier_tracker_options_default(),
                host,
                &mut tracker,
            );
            let status = if status.is_null() {
                sys::iree_hal_device_group_create_from_device(raw.as_ptr(), tracker, host, &mut group)
            } else {
                status
            };
            sys::iree_async_frontier_tracker_release(tracker);
            status
        };
        if let Err(e) = check(status, format!("make the device group of `{name}`")) {
            // SAFETY: the reference handed to us; nothing else has seen the device.
            unsafe { sys::iree_hal_device_release(raw.as_ptr()) };
            return Err(e);
        }
        Ok(Device {
            inner: Arc::new(DeviceInner {
                raw,
                group: NonNull::new(group).expect("iree_hal_device_group_create_from_device: OK and null"),
                name: name.to_owned(),
                instance: instance.clone(),
                timeline: std::sync::Mutex::new(Timeline {
                    semaphore: std::ptr::null_mut(),
                    value: 0,
                    reached: 0,
                    epoch: 0,
                }),
            }),
        })
    }

    /// The driver name this device was opened with (`local-task`, `local-sync`, `vulkan`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn instance(&self) -> &Instance {
        &self.inner.instance
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::iree_hal_device_t {
        self.inner.raw.as_ptr()
    }

    pub(crate) fn group(&self) -> *mut sys::iree_hal_device_group_t {
        self.inner.group.as_ptr()
    }

    pub(crate) fn allocator(&self) -> *mut sys::iree_hal_allocator_t {
        // SAFETY: the device is live; the allocator is owned by it (not retained here).
        unsafe { sys::iree_hal_device_allocator(self.as_ptr()) }
    }

    pub(crate) fn host_allocator(&self) -> sys::iree_allocator_t {
        self.inner.instance.host_allocator()
    }

    /// Waits for every async call and transfer submitted to this device so far. Reads of
    /// buffer views do it themselves; an error of an async call surfaces here (or at the next
    /// read), the device's timeline then starts anew.
    pub fn sync(&self) -> Result<()> {
        let mut timeline = self.inner.timeline.lock().unwrap_or_else(|e| e.into_inner());
        let value = timeline.value;
        timeline.wait(value, "sync")
    }

    /// Waits until the submission that returned `point` is done. A point of a timeline that
    /// failed since (an error was returned then) is an error.
    pub fn wait(&self, point: Queued) -> Result<()> {
        let mut timeline = self.inner.timeline.lock().unwrap_or_else(|e| e.into_inner());
        if timeline.epoch != point.epoch {
            return Err(Error::InvalidArgument {
                op: "wait",
                reason: format!(
                    "the submission was queued on `{}` before an error reset its timeline",
                    self.name()
                ),
            });
        }
        timeline.wait(point.value, "wait")
    }

    /// A value the driver reports under `category` / `key` (`iree_hal_device_query_i64`). The
    /// Vulkan driver answers, among others, `vulkan.feature` / `storage_buffer_16bit_access`,
    /// `shader_int16`, `shader_float16` (1 where the feature is enabled on this device: IREE
    /// enables each one the physical device reports) and `vulkan.device` / `subgroup_size`; a
    /// key the driver does not know is an error.
    pub fn query_i64(&self, category: &str, key: &str) -> Result<i64> {
        let mut value = 0i64;
        // SAFETY: the device is live; both views outlive the call; `value` is written by IREE.
        let status = unsafe {
            sys::iree_hal_device_query_i64(self.as_ptr(), string_view(category), string_view(key), &mut value)
        };
        check(status, format!("query {category}::{key} of `{}`", self.name()))?;
        Ok(value)
    }

    /// Whether `other` is this very device (a clone of it), not another device of the driver.
    pub fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.inner.name).finish()
    }
}

/// What `iree_hal_local_task_driver_module_register`'s factory does, with the topology given
/// by `workers` instead of by command-line flags.
fn create_local_task_driver(workers: usize, host: sys::iree_allocator_t) -> Result<NonNull<sys::iree_hal_driver_t>> {
    let op = "create local-task driver";
    let mut executor = std::ptr::null_mut();
    let mut plugin_manager = std::ptr::null_mut();
    let mut loaders = [std::ptr::null_mut(); 8];
    let mut loader_count = 0;
    let mut device_allocator = std::ptr::null_mut();
    let mut driver = std::ptr::null_mut();
    // SAFETY: each out-pointer is written only on success; every object created here is
    // released at the end of this block (the driver retains what it keeps), and each status is
    // checked once, in order, so later steps run only after earlier ones succeeded.
    let result = unsafe {
        let mut topology = sys::iree_task_topology_t::default();
        sys::iree_task_topology_initialize_from_group_count(workers, &mut topology);
        let mut options = sys::iree_task_executor_options_t::default();
        sys::iree_task_executor_options_initialize(&mut options);
        let status = sys::iree_task_executor_create(options, &topology, host, &mut executor);
        sys::iree_task_topology_deinitialize(&mut topology);
        check(status, op)
            .and_then(|()| {
                let status = sys::iree_hal_executable_plugin_manager_create_from_flags(host, &mut plugin_manager);
                check(status, op)
            })
            .and_then(|()| {
                let status = sys::iree_hal_create_all_available_executable_loaders(
                    plugin_manager,
                    loaders.len(),
                    &mut loader_count,
                    loaders.as_mut_ptr(),
                    host,
                );
                check(status, op)
            })
            .and_then(|()| {
                let status =
                    sys::iree_hal_allocator_create_heap(string_view("local"), host, host, &mut device_allocator);
                check(status, op)
            })
            .and_then(|()| {
                let mut params = sys::iree_hal_task_device_params_t::default();
                sys::iree_hal_task_device_params_initialize(&mut params);
                let status = sys::iree_hal_task_driver_create(
                    string_view("local-task"),
                    &params,
                    1,
                    &executor,
                    loader_count,
                    loaders.as_mut_ptr(),
                    device_allocator,
                    host,
                    &mut driver,
                );
                check(status, op)
            })
    };
    // SAFETY: releasing our own references (IREE's release functions accept null).
    unsafe {
        sys::iree_task_executor_release(executor);
        for loader in &loaders[..loader_count] {
            sys::iree_hal_executable_loader_release(*loader);
        }
        sys::iree_hal_executable_plugin_manager_release(plugin_manager);
        sys::iree_hal_allocator_release(device_allocator);
    }
    result?;
    Ok(NonNull::new(driver).expect("iree_hal_task_driver_create returned OK and null"))
}
