use std::path::Path;
use std::ptr::NonNull;

use iree_runtime_sys as sys;

use crate::buffer_view::BufferView;
use crate::device::Device;
use crate::error::{check, Error, Result};
use crate::parameters::ParameterProvider;
use crate::{from_string_view, path_str, string_view};

/// Modules the runtime adds by itself; their exports are not listed in lookup errors.
const BUILTIN_MODULES: &[&str] = &["hal", "io_parameters"];

/// A runtime session (`iree_runtime_session_t`): one VM context holding the HAL module, an
/// optional `io_parameters` module and one bytecode module (`.vmfb`), bound to one [`Device`].
///
/// All exported functions of the module share the session (and so the module's globals, e.g. a
/// KV cache kept in `util.global`s): call them by their module-qualified names.
///
/// Threading: `Send` but not `Sync`. A VM context is not safe for concurrent invocations, so a
/// session is used from one thread at a time; calls take `&mut self` because they may mutate the
/// module's state.
pub struct Session {
    raw: NonNull<sys::iree_runtime_session_t>,
    device: Device,
}

// SAFETY: the session holds no thread-affine state (no TLS, no thread ids); IREE only requires
// that calls into one context are not concurrent, which `!Sync` plus `&mut self` calls ensure.
unsafe impl Send for Session {}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: we own the session's only Rust-side reference; buffer views returned by calls
        // hold their own references to their buffers, and `self.device` (dropped after this)
        // keeps the device alive until the session is gone.
        unsafe { sys::iree_runtime_session_release(self.raw.as_ptr()) };
    }
}

/// A function exported by a session's module, found by [`Session::lookup`].
#[derive(Clone, Debug)]
pub struct Function {
    /// The module-qualified name, e.g. `module.forward`.
    pub name: String,
    /// The VM calling convention, e.g. `0rr_r` (two refs in, one ref out).
    pub calling_convention: String,
    /// Reflection attributes (e.g. `iree.abi.declaration`), in module order.
    pub attributes: Vec<(String, String)>,
    raw: sys::iree_vm_function_t,
    session: *const sys::iree_runtime_session_t,
}

// SAFETY: a Function is plain data; its pointers are only dereferenced by the Session it came
// from (checked by identity in `call_function`), under that session's own rules.
unsafe impl Send for Function {}
// SAFETY: as above; nothing is reachable through `&Function` except the owned strings.
unsafe impl Sync for Function {}

impl Session {
    /// Creates a session on `device`, appends an `io_parameters` module serving
    /// `parameters` (`(scope, file)` pairs; files of the same scope share one provider) and
    /// then the bytecode module at `vmfb`. The parameters module must come first so the
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
            .map(|(scope, files)| ParameterProvider::open(scope, files))
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
        let instance = device.instance();
        let mut options = sys::iree_runtime_session_options_t::default();
        let mut raw = std::ptr::null_mut();
        // SAFETY: options are initialized before use; instance and device are live and retained
        // by the session; `raw` receives one reference owned by the returned value.
        let status = unsafe {
            sys::iree_runtime_session_options_initialize(&mut options);
            sys::iree_runtime_session_create_with_device(
                instance.as_ptr(),
                &options,
                device.as_ptr(),
                instance.host_allocator(),
                &mut raw,
            )
        };
        check(status, format!("create session on `{}`", device.name()))?;
        Ok(Session {
            raw: NonNull::new(raw).expect("iree_runtime_session_create_with_device: null"),
            device: device.clone(),
        })
    }

    fn append_parameters_module(&self, providers: &[ParameterProvider]) -> Result<()> {
        let raw_providers: Vec<_> = providers.iter().map(ParameterProvider::as_ptr).collect();
        let instance = self.device.instance();
        let mut module = std::ptr::null_mut();
        // SAFETY: the providers are live for the call and retained by the module; `module`
        // gets one reference, which the session retains on append and we release right after.
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
        // SAFETY: session and module are live; append retains the module.
        let status = unsafe { sys::iree_runtime_session_append_module(self.as_ptr(), module) };
        // SAFETY: our reference from create; the session holds its own if append succeeded.
        unsafe { sys::iree_vm_module_release(module) };
        check(status, "append io_parameters module")
    }

    fn append_bytecode_module(&self, vmfb: &Path) -> Result<()> {
        const OP: &str = "load bytecode module";
        if !vmfb.is_file() {
            return Err(Error::FileNotFound {
                op: OP,
                path: vmfb.to_owned(),
            });
        }
        let path = std::ffi::CString::new(path_str(vmfb, OP)?).map_err(|_| Error::InvalidArgument {
            op: OP,
            reason: format!("{} contains NUL", vmfb.display()),
        })?;
        // SAFETY: the session is live; the path is a NUL-terminated string valid for the call
        // (the file is memory-mapped and kept by the module).
        let status =
            unsafe { sys::iree_runtime_session_append_bytecode_module_from_file(self.as_ptr(), path.as_ptr()) };
        check(status, format!("{OP} {}", vmfb.display()))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Finds an exported function by module-qualified name (`module.forward`).
    pub fn lookup(&self, name: &str) -> Result<Function> {
        let mut raw = sys::iree_vm_function_t::default();
        // SAFETY: session live; `name` valid for the call; `raw` written on success.
        let status = unsafe { sys::iree_runtime_session_lookup_function(self.as_ptr(), string_view(name), &mut raw) };
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
        Ok(Function {
            name: name.to_owned(),
            calling_convention,
            attributes,
            raw,
            session: self.raw.as_ptr(),
        })
    }

    /// Module-qualified names of the functions exported by the session's own modules (not the
    /// runtime's `hal` / `io_parameters`), without internal `__` functions.
    pub fn exported_functions(&self) -> Vec<String> {
        let mut names = Vec::new();
        // SAFETY: the context and its modules are owned by the live session; every view read
        // here points into module storage and is copied before returning.
        unsafe {
            let context = sys::iree_runtime_session_context(self.as_ptr());
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

    /// [`Session::call`] without the name lookup.
    ///
    /// # Panics
    /// If `function` was looked up on another session.
    pub fn call_function(&mut self, function: &Function, inputs: &[&BufferView]) -> Result<Vec<BufferView>> {
        assert!(
            std::ptr::eq(function.session, self.raw.as_ptr()),
            "Function `{}` belongs to another Session",
            function.name
        );
        let op = format!("call `{}`", function.name);
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
        let host = self.device.host_allocator();
        let input_list = VmList::new(inputs.len(), host)?;
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
        let output_list = VmList::new(4, host)?;
        // SAFETY: session, function (checked to be of this session) and both lists are live.
        let status = unsafe {
            sys::iree_runtime_session_call(
                self.as_ptr(),
                &function.raw,
                input_list.raw.as_ptr(),
                output_list.raw.as_ptr(),
            )
        };
        check(status, op.clone())?;
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

    fn as_ptr(&self) -> *mut sys::iree_runtime_session_t {
        self.raw.as_ptr()
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("device", &self.device).finish()
    }
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
