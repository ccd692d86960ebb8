use std::path::Path;
use std::ptr::NonNull;

use iree_runtime_sys as sys;

use crate::buffer_view::BufferView;
use crate::device::Device;
use crate::error::{check, Error, Result};
use crate::parameters::{ParameterIo, ParameterProvider};
use crate::storage::{CallStorage, StorageSpec};
use crate::{from_string_view, path_str, string_view};

/// Modules the runtime adds by itself; their exports are not listed in lookup errors.
const BUILTIN_MODULES: &[&str] = &["hal", "io_parameters"];

/// A session: one VM context holding the HAL module, an optional `io_parameters` module and one
/// bytecode module (`.vmfb`), bound to one [`Device`].
///
/// All exported functions of the module share the session (and so the module's globals, e.g. a
/// KV cache kept in `util.global`s): call them by their module-qualified names.
///
/// The context is assembled here rather than by `iree_runtime_session_create_with_device`,
/// because that function makes a HAL device group per session, and a Vulkan device accepts only
/// one: the HAL module of every session binds the device's own group ([`Device`]).
///
/// Threading: `Send` but not `Sync`. A VM context is not safe for concurrent invocations, so a
/// session is used from one thread at a time; calls take `&mut self` because they may mutate the
/// module's state.
pub struct Session {
    context: Context,
    device: Device,
}

/// One reference to a VM context (the modules and their state), released on drop.
struct Context(NonNull<sys::iree_vm_context_t>);

impl Clone for Context {
    fn clone(&self) -> Context {
        // SAFETY: the context is live (we hold a reference); the clone owns the new one.
        unsafe { sys::iree_vm_context_retain(self.0.as_ptr()) };
        Context(self.0)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: our own reference. Buffer views returned by calls hold references to their
        // buffers, and the HAL module's state holds the device group, so nothing dangles.
        unsafe { sys::iree_vm_context_release(self.0.as_ptr()) };
    }
}

// SAFETY: contexts carry no thread-affine state; reference counting is atomic. Invocations
// (the one non-thread-safe use) need `&mut Session`.
unsafe impl Send for Context {}
// SAFETY: through `&Context` only the pointer's identity and atomic retain are reachable.
unsafe impl Sync for Context {}

/// A function exported by a session's module, found by [`Session::lookup`].
///
/// It holds a reference to its session's VM context, so the module it points into lives as long
/// as it does, even after its session is dropped, and no later session can reuse the context's
/// address while it exists: a function of another session is always told apart, and refused.
#[derive(Clone)]
pub struct Function {
    /// The module-qualified name, e.g. `module.forward`.
    pub name: String,
    /// The VM calling convention, e.g. `0rr_r` (two refs in, one ref out).
    pub calling_convention: String,
    /// Reflection attributes (e.g. `iree.abi.declaration`), in module order.
    pub attributes: Vec<(String, String)>,
    /// Compiled with `--iree-execution-model=async-external` (`iree.abi.model` `coarse-fences`):
    /// its last two arguments are a wait and a signal fence, which [`Session::call_function`]
    /// passes on the device's timeline semaphore.
    coarse_fences: bool,
    /// Storage the caller supplies after the tensors ([`StorageSpec`]).
    storage: Option<StorageSpec>,
    raw: sys::iree_vm_function_t,
    context: Context,
}

impl Function {
    /// The tensors the function takes: its VM arguments but the two fences of an async one and
    /// the storage a caller supplies ([`Self::storage`]).
    pub fn argument_count(&self) -> usize {
        let refs = self
            .calling_convention
            .split('_')
            .next()
            .unwrap_or("")
            .trim_start_matches('0')
            .chars()
            .filter(|&c| c == 'r')
            .count();
        let fences = if self.coarse_fences { 2 } else { 0 };
        refs.saturating_sub(fences + self.storage.as_ref().map_or(0, StorageSpec::argument_count))
    }

    /// The storage a call supplies (results written into given buffers, a transients buffer),
    /// where the function was compiled to take it: [`Session::call_function_with`].
    pub fn storage(&self) -> Option<&StorageSpec> {
        self.storage.as_ref()
    }

    /// Whether the function is async (`iree.abi.model` `coarse-fences`): a call passes it a
    /// wait and a signal fence.
    pub fn is_async(&self) -> bool {
        self.coarse_fences
    }
}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function")
            .field("name", &self.name)
            .field("calling_convention", &self.calling_convention)
            .field("attributes", &self.attributes)
            .finish()
    }
}

// SAFETY: `raw` points into a module that `context` keeps alive; it is only dereferenced by an
// invocation on the session owning that same context (checked in `call_function`).
unsafe impl Send for Function {}
// SAFETY: as above; nothing is reachable through `&Function` except owned strings and `Context`.
unsafe impl Sync for Function {}

impl Session {
    /// Creates a session on `device`, appends an `io_parameters` module serving
    /// `parameters` (`(scope, file)` pairs; files of the same scope share one provider; mapped
    /// on the CPU drivers, read on the others: [`ParameterIo::for_driver`]) and then the
    /// bytecode module at `vmfb`. The parameters module must come first so the
    /// bytecode module's imports resolve against it.
    pub fn open(device: &Device, vmfb: &Path, parameters: &[(&str, &Path)]) -> Result<Session> {
        let mut scopes: Vec<(&str, Vec<&Path>)> = Vec::new();
        for (scope, path) in parameters {
            match scopes.iter_mut().find(|(s, _)| s == scope) {
                Some((_, files)) => files.push(path),
                None => scopes.push((scope, vec![path])),
            }
        }
        let providers = scopes
            .iter()
            .map(|(scope, files)| ParameterProvider::open(scope, files, ParameterIo::for_driver(device.name())))
            .collect::<Result<Vec<_>>>()?;
        Session::open_with_providers(device, vmfb, &providers)
    }

    /// Like [`Session::open`] with providers made beforehand, so that several sessions (e.g.
    /// a prefill and a decode module) can share one index of the same files.
    pub fn open_with_providers(device: &Device, vmfb: &Path, providers: &[ParameterProvider]) -> Result<Session> {
        let session = Session::create(device)?;
        if !providers.is_empty() {
            session.append_parameters_module(providers)?;
        }
        session.append_bytecode_module(vmfb)?;
        Ok(session)
    }

    fn create(device: &Device) -> Result<Session> {
        let op = format!("create session on `{}`", device.name());
        let instance = device.instance();
        let host = instance.host_allocator();
        let mut raw = std::ptr::null_mut();
        // SAFETY: the instance is live; `raw` receives one reference owned by the returned value.
        let status = unsafe {
            let vm_instance = sys::iree_runtime_instance_vm_instance(instance.as_ptr());
            sys::iree_vm_context_create(vm_instance, sys::IREE_VM_CONTEXT_FLAG_NONE, host, &mut raw)
        };
        check(status, op.clone())?;
        let session = Session {
            context: Context(NonNull::new(raw).expect("iree_vm_context_create: OK and null")),
            device: device.clone(),
        };
        let mut hal = std::ptr::null_mut();
        // SAFETY: instance and group are live; the module retains the group, and `hal` gets one
        // reference, which the context retains on registration and we release right after.
        let status = unsafe {
            sys::iree_hal_module_create(
                sys::iree_runtime_instance_vm_instance(instance.as_ptr()),
                sys::iree_hal_module_device_policy_default(),
                device.group(),
                sys::IREE_HAL_MODULE_FLAG_NONE,
                sys::iree_hal_module_debug_sink_null(),
                host,
                &mut hal,
            )
        };
        check(status, op.clone())?;
        session.register(hal, &op)?;
        Ok(session)
    }

    /// Registers `module` in the context and releases the caller's reference to it.
    fn register(&self, module: *mut sys::iree_vm_module_t, op: &str) -> Result<()> {
        let mut modules = [module];
        // SAFETY: context and module are live; registration retains the module.
        let status = unsafe { sys::iree_vm_context_register_modules(self.context.0.as_ptr(), 1, modules.as_mut_ptr()) };
        // SAFETY: our reference; the context holds its own if registration succeeded.
        unsafe { sys::iree_vm_module_release(module) };
        check(status, op)
    }

    fn append_parameters_module(&self, providers: &[ParameterProvider]) -> Result<()> {
        let raw_providers: Vec<_> = providers.iter().map(ParameterProvider::as_ptr).collect();
        let instance = self.device.instance();
        let mut module = std::ptr::null_mut();
        // SAFETY: the providers are live for the call and retained by the module; `module`
        // gets one reference, handed to `register`.
        let status = unsafe {
            let vm_instance = sys::iree_runtime_instance_vm_instance(instance.as_ptr());
            sys::iree_io_parameters_module_create(
                vm_instance,
                raw_providers.len(),
                raw_providers.as_ptr(),
                instance.host_allocator(),
                &mut module,
            )
        };
        check(status, "create io_parameters module")?;
        self.register(module, "append io_parameters module")
    }

    fn append_bytecode_module(&self, vmfb: &Path) -> Result<()> {
        const OP: &str = "load bytecode module";
        if !vmfb.is_file() {
            return Err(Error::FileNotFound {
                op: OP,
                path: vmfb.to_owned(),
            });
        }
        let path = path_str(vmfb, OP)?;
        let op = format!("{OP} {}", vmfb.display());
        let instance = self.device.instance();
        let host = instance.host_allocator();
        let mut contents = std::ptr::null_mut();
        // SAFETY: `path` is valid for the call; `contents` receives an owned copy of the file.
        let status = unsafe { sys::iree_io_file_contents_read(string_view(path), host, &mut contents) };
        check(status, op.clone())?;
        let mut module = std::ptr::null_mut();
        // SAFETY: `contents` is live; on success the module owns it through the deallocator,
        // on failure `iree_vm_bytecode_module_create` leaves it to us.
        let status = unsafe {
            let status = sys::iree_vm_bytecode_module_create(
                sys::iree_runtime_instance_vm_instance(instance.as_ptr()),
                sys::IREE_VM_BYTECODE_MODULE_FLAG_NONE,
                (*contents).__bindgen_anon_1.const_buffer,
                sys::iree_io_file_contents_deallocator(contents),
                host,
                &mut module,
            );
            if !status.is_null() {
                sys::iree_io_file_contents_free(contents);
            }
            status
        };
        check(status, op.clone())?;
        self.register(module, &op)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Finds an exported function by module-qualified name (`module.forward`).
    pub fn lookup(&self, name: &str) -> Result<Function> {
        let mut raw = sys::iree_vm_function_t::default();
        // SAFETY: session live; `name` valid for the call; `raw` written on success.
        let status =
            unsafe { sys::iree_vm_context_resolve_function(self.context.0.as_ptr(), string_view(name), &mut raw) };
        match check(status, format!("look up function `{name}`")) {
            Ok(()) => {}
            Err(Error::Iree { code, .. }) if code.0 == sys::IREE_STATUS_NOT_FOUND => {
                return Err(Error::FunctionNotFound {
                    name: name.to_owned(),
                    available: self.exported_functions(),
                });
            }
            Err(e) => return Err(e),
        }
        // SAFETY: `raw` is a valid function of a module retained by the session's context.
        let calling_convention = from_string_view(unsafe { sys::iree_vm_function_signature(&raw) }.calling_convention);
        let mut attributes = Vec::new();
        for index in 0.. {
            let mut pair = sys::iree_string_pair_t::default();
            // SAFETY: as above; out-of-range indices return a failing status (freed by check).
            let status = unsafe { sys::iree_vm_function_get_attr(raw, index, &mut pair) };
            if check(status, "read function attribute").is_err() {
                break;
            }
            // SAFETY: both union arms are the same two string views (key/value == first/second).
            let (key, value) = unsafe { (pair.__bindgen_anon_1.key, pair.__bindgen_anon_2.value) };
            if key.size == 0 {
                break;
            }
            attributes.push((from_string_view(key), from_string_view(value)));
        }
        let coarse_fences = attributes
            .iter()
            .any(|(k, v)| k == "iree.abi.model" && v == "coarse-fences");
        let storage = StorageSpec::parse(&attributes, name)?;
        Ok(Function {
            name: name.to_owned(),
            calling_convention,
            attributes,
            coarse_fences,
            storage,
            raw,
            context: self.context.clone(),
        })
    }

    /// Module-qualified names of the functions exported by the session's own modules (not the
    /// runtime's `hal` / `io_parameters`), without internal `__` functions.
    pub fn exported_functions(&self) -> Vec<String> {
        let mut names = Vec::new();
        // SAFETY: the context and its modules are owned by the live session; every view read
        // here points into module storage and is copied before returning.
        unsafe {
            let context = self.context.0.as_ptr();
            for i in 0..sys::iree_vm_context_module_count(context) {
                let module = sys::iree_vm_context_module_at(context, i);
                let module_name = from_string_view(sys::iree_vm_module_name(module));
                if BUILTIN_MODULES.contains(&module_name.as_str()) {
                    continue;
                }
                let count = sys::iree_vm_module_signature(module).export_function_count;
                for ordinal in 0..count {
                    let mut function = sys::iree_vm_function_t::default();
                    let status = sys::iree_vm_module_lookup_function_by_ordinal(
                        module,
                        sys::IREE_VM_FUNCTION_LINKAGE_EXPORT,
                        ordinal,
                        &mut function,
                    );
                    if check(status, "list exports").is_ok() {
                        let name = from_string_view(sys::iree_vm_function_name(&function));
                        if !name.starts_with("__") {
                            names.push(format!("{module_name}.{name}"));
                        }
                    }
                }
            }
        }
        names
    }

    /// Calls `name` (module-qualified) with buffer-view arguments; every result must be a
    /// buffer view. Results stay on the device (device-local); read them with
    /// [`BufferView::to_f32_vec`] and friends.
    pub fn call(&mut self, name: &str, inputs: &[&BufferView]) -> Result<Vec<BufferView>> {
        let function = self.lookup(name)?;
        self.call_function(&function, inputs)
    }

    /// [`Session::call`] without the name lookup. A function looked up on another session is
    /// refused ([`Error::InvalidArgument`]). A function that takes caller-supplied storage
    /// ([`Function::storage`]) gets a fresh set each call; [`Self::call_function_with`] reuses
    /// one.
    pub fn call_function(&mut self, function: &Function, inputs: &[&BufferView]) -> Result<Vec<BufferView>> {
        let storage = match &function.storage {
            Some(spec) => Some(spec.allocate(&self.device)?),
            None => None,
        };
        self.call_function_with(function, inputs, storage.as_ref())
    }

    /// [`Self::call_function`] with the storage of a function compiled to take it: the tied
    /// results come back as views of `storage`'s buffers (overwritten by the next call given
    /// the same set), and the call allocates nothing on the device's queue. Storage for a
    /// function that takes none, or of other shapes, or none for one that does, is refused
    /// ([`Error::InvalidArgument`]).
    pub fn call_function_with(
        &mut self,
        function: &Function,
        inputs: &[&BufferView],
        storage: Option<&CallStorage>,
    ) -> Result<Vec<BufferView>> {
        let op = format!("call `{}`", function.name);
        if function.context.0 != self.context.0 {
            return Err(Error::InvalidArgument {
                op: "call",
                reason: format!("function `{}` was looked up on another session", function.name),
            });
        }
        if let Some(view) = inputs.iter().find(|v| !v.device().same_as(&self.device)) {
            return Err(Error::InvalidArgument {
                op: "call",
                reason: format!(
                    "an input was made on device `{}` (another Device than the session's `{}`)",
                    view.device().name(),
                    self.device.name()
                ),
            });
        }
        match (&function.storage, storage) {
            (Some(spec), Some(storage)) => spec.check(storage, &self.device, &function.name)?,
            (None, None) => {}
            (Some(_), None) => {
                return Err(Error::InvalidArgument {
                    op: "call",
                    reason: format!("`{}` takes its results' storage; none was given", function.name),
                })
            }
            (None, Some(_)) => {
                return Err(Error::InvalidArgument {
                    op: "call",
                    reason: format!("`{}` takes no storage; some was given", function.name),
                })
            }
        }
        let host = self.device.host_allocator();
        let extra = storage.map_or(0, |s| s.results().len() + usize::from(s.transients().is_some()));
        let input_list = VmList::new(inputs.len() + extra + 2, host)?;
        for view in inputs {
            // SAFETY: the list is live; retain_ref adds a reference that push_ref_move hands
            // to the list (on failure the ref is still ours, so release it).
            let status = unsafe {
                let mut value = sys::iree_hal_buffer_view_retain_ref(view.as_ptr());
                let status = sys::iree_vm_list_push_ref_move(input_list.raw.as_ptr(), &mut value);
                if !status.is_null() {
                    sys::iree_vm_ref_release(&mut value);
                }
                status
            };
            check(status, format!("{op}: pass argument"))?;
        }
        if let Some(storage) = storage {
            let results = storage.results().iter().map(|view| (view, false));
            for (view, whole_buffer) in results.chain(storage.transients().map(|view| (view, true))) {
                // SAFETY: as above. The transients go as their buffer (`!hal.buffer`), the
                // results as views.
                let status = unsafe {
                    let mut value = if whole_buffer {
                        sys::iree_hal_buffer_retain_ref(sys::iree_hal_buffer_view_buffer(view.as_ptr()))
                    } else {
                        sys::iree_hal_buffer_view_retain_ref(view.as_ptr())
                    };
                    let status = sys::iree_vm_list_push_ref_move(input_list.raw.as_ptr(), &mut value);
                    if !status.is_null() {
                        sys::iree_vm_ref_release(&mut value);
                    }
                    status
                };
                check(status, format!("{op}: pass its storage"))?;
            }
        }
        let output_list = VmList::new(4, host)?;
        let invoke = || {
            // SAFETY: context, function (checked to be of this context) and both lists are live.
            let status = unsafe {
                sys::iree_vm_invoke(
                    self.context.0.as_ptr(),
                    function.raw,
                    sys::IREE_VM_INVOCATION_FLAG_NONE,
                    std::ptr::null(),
                    input_list.raw.as_ptr(),
                    output_list.raw.as_ptr(),
                    host,
                )
            };
            check(status, op.clone())
        };
        let mut timeline = self.device.inner.timeline.lock().unwrap_or_else(|e| e.into_inner());
        if function.coarse_fences {
            // The call waits (on the device) for the timeline's current value and signals the
            // next; the host does not wait for it: whatever reads a result waits then
            // ([`Device::sync`]), so the next submission queues behind this one without a host
            // round trip between them. One semaphore for all calls, where a synchronous function
            // creates one per call (~0.65 ms each on the H200 over Vulkan, docs/journal
            // session 13).
            self.device.ensure_timeline(&mut timeline)?;
            let before = timeline.value;
            let next = before + 1;
            let result = [before, next]
                .into_iter()
                .try_for_each(|value| push_fence(&input_list, timeline.semaphore, value, host, &op))
                .and_then(|()| invoke());
            if let Err(e) = result {
                // What was queued before still signals; once it has, start a new timeline (a
                // failed call may leave its signal unsignalled forever).
                let _ = timeline.wait(before, &op);
                timeline.reset();
                return Err(e);
            }
            timeline.value = next;
        } else {
            // A synchronous call orders nothing against the timeline: earlier async work that
            // made its inputs must be finished first.
            let value = timeline.value;
            timeline.wait(value, &op)?;
            drop(timeline);
            invoke()?;
        }
        // SAFETY: the output list is live and owned by us.
        let count = unsafe { sys::iree_vm_list_size(output_list.raw.as_ptr()) };
        (0..count)
            .map(|i| {
                // SAFETY: `i` is in range; a non-buffer-view element yields null.
                let raw = unsafe { sys::iree_vm_list_get_buffer_view_retain(output_list.raw.as_ptr(), i) };
                match NonNull::new(raw) {
                    // SAFETY: `raw` carries the reference taken by `_retain`.
                    Some(raw) => Ok(unsafe { BufferView::from_owned(raw, self.device.clone()) }),
                    None => Err(Error::InvalidArgument {
                        op: "read call results",
                        reason: format!("result {i} of `{}` is not a buffer view", function.name),
                    }),
                }
            })
            .collect()
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("device", &self.device).finish()
    }
}

/// Appends a fence at `value` of `semaphore` to `list`.
fn push_fence(
    list: &VmList,
    semaphore: *mut sys::iree_hal_semaphore_t,
    value: u64,
    host: sys::iree_allocator_t,
    op: &str,
) -> Result<()> {
    let mut fence = std::ptr::null_mut();
    // SAFETY: the semaphore is live; the fence retains it and its reference moves into the list
    // (released here if the push fails).
    let status = unsafe {
        let status = sys::iree_hal_fence_create_at(semaphore, value, host, &mut fence);
        if !status.is_null() {
            status
        } else {
            let mut value = sys::iree_hal_fence_move_ref(fence);
            let status = sys::iree_vm_list_push_ref_move(list.raw.as_ptr(), &mut value);
            if !status.is_null() {
                sys::iree_vm_ref_release(&mut value);
            }
            status
        }
    };
    check(status, format!("{op}: pass a fence"))
}

/// An `iree_vm_list_t` of any element type, released on drop.
struct VmList {
    raw: NonNull<sys::iree_vm_list_t>,
}

impl VmList {
    fn new(capacity: usize, host: sys::iree_allocator_t) -> Result<VmList> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` receives one reference owned by the returned value.
        let status =
            unsafe { sys::iree_vm_list_create(sys::iree_vm_make_undefined_type_def(), capacity, host, &mut raw) };
        check(status, "create VM list")?;
        Ok(VmList {
            raw: NonNull::new(raw).expect("iree_vm_list_create: OK and null"),
        })
    }
}

impl Drop for VmList {
    fn drop(&mut self) {
        // SAFETY: our reference; releasing the list releases the refs it holds.
        unsafe { sys::iree_vm_list_release(self.raw.as_ptr()) };
    }
}
