//! Storage a caller supplies to a function: buffers its results are written into
//! (`iree.abi.output = N` on an argument) and the buffer its transients live in
//! (`iree.abi.transients`).
//!
//! Why: a function that allocates its results or transients does so with a queue allocation,
//! which IREE's Vulkan queue holds on the host until the work before it has signalled; the
//! command buffer that binds the memory cannot be recorded before it exists. So every such call
//! waited for the call before it, and the GPU idled while the host recorded: 1.8 ms of a 4.5 ms
//! decode step on an H100 (docs/journal/sessions-30-34.md). With the storage given, a call
//! allocates nothing on the queue and the host records it while the previous one runs.

use crate::buffer_view::{BufferView, ElementType};
use crate::device::Device;
use crate::error::{Error, Result};

/// What a function compiled with caller-supplied storage takes after its tensors (and before
/// the fences of an async function), read from its reflection (`iree.abi.declaration`,
/// `iree.abi.transients.size.constant`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageSpec {
    /// Each tied result's shape and element type, in argument order.
    pub results: Vec<(Vec<usize>, ElementType)>,
    /// Bytes of the transients' buffer, where the function takes one.
    pub transients: Option<usize>,
}

impl StorageSpec {
    /// The storage `declaration` (an `iree.abi.declaration`, e.g. `async func @f(%input0:
    /// tensor<1xi32>, %input1: tensor<1x4xf32> {iree.abi.output = 0 : index}, %input2:
    /// !hal.buffer {iree.abi.transients}) -> ..`) declares; `Ok(None)` where it declares none.
    pub(crate) fn parse(attributes: &[(String, String)], function: &str) -> Result<Option<StorageSpec>> {
        let Some(declaration) = attributes.iter().find(|(k, _)| k == "iree.abi.declaration") else {
            return Ok(None);
        };
        let bad = |reason: String| Error::InvalidArgument {
            op: "read a function's declaration",
            reason: format!("`{function}`: {reason}"),
        };
        let text = declaration.1.as_str();
        let args = text
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(") ->").or_else(|| rest.rsplit_once(')')))
            .map_or("", |(args, _)| args);
        let mut results = Vec::new();
        let mut transients = None;
        for arg in args.split(", %") {
            let ty = arg.split_once(": ").map_or("", |(_, ty)| ty);
            if ty.contains("iree.abi.output") {
                let Some(tensor) = ty.strip_prefix("tensor<").and_then(|t| t.split_once('>')) else {
                    return Err(bad(format!("a tied result that is not a tensor: `{ty}`")));
                };
                let mut parts: Vec<&str> = tensor.0.split('x').collect();
                let element = match parts.pop() {
                    Some("f32") => ElementType::F32,
                    Some("f16") => ElementType::F16,
                    Some("i32") => ElementType::I32,
                    other => return Err(bad(format!("a tied result of element type {other:?}"))),
                };
                let shape = parts
                    .iter()
                    .map(|d| d.parse().ok())
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(|| bad(format!("a tied result of dynamic or unreadable shape `{ty}`")))?;
                results.push((shape, element));
            } else if ty.contains("iree.abi.transients") {
                let size = attributes
                    .iter()
                    .find(|(k, _)| k == "iree.abi.transients.size.constant")
                    .and_then(|(_, v)| v.split(' ').next()?.parse().ok())
                    .ok_or_else(|| bad("transients of no constant size".into()))?;
                transients = Some(size);
            }
        }
        Ok((!results.is_empty() || transients.is_some()).then_some(StorageSpec { results, transients }))
    }

    /// How many arguments the storage takes.
    pub fn argument_count(&self) -> usize {
        self.results.len() + usize::from(self.transients.is_some())
    }

    /// Device-local buffers for one call's results and, where the function has transients, a
    /// buffer for them.
    pub fn allocate(&self, device: &Device) -> Result<CallStorage> {
        self.allocate_results(device, None)
    }

    /// Buffers for one call's results, sharing `transients` (from [`CallStorage::transients`]
    /// of an earlier set): calls on one device's timeline run one after another, so one
    /// transients buffer serves every call of a function.
    pub fn allocate_results(&self, device: &Device, transients: Option<&BufferView>) -> Result<CallStorage> {
        let results = self
            .results
            .iter()
            .map(|(shape, element)| BufferView::allocate(device, shape, *element))
            .collect::<Result<_>>()?;
        let transients = match (self.transients, transients) {
            (Some(_), Some(view)) => Some(view.clone()),
            (Some(bytes), None) => Some(allocate_transients(device, bytes)?),
            (None, _) => None,
        };
        Ok(CallStorage { results, transients })
    }

    /// Whether `storage` fits: results of these shapes and types, transients of at least this
    /// size, all on `device`.
    pub(crate) fn check(&self, storage: &CallStorage, device: &Device, function: &str) -> Result<()> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "call",
            reason: format!("storage for `{function}`: {reason}"),
        };
        if storage.results.len() != self.results.len() {
            return Err(bad(format!(
                "{} result buffers, the function ties {}",
                storage.results.len(),
                self.results.len()
            )));
        }
        for (i, (view, (shape, element))) in storage.results.iter().zip(&self.results).enumerate() {
            if view.shape() != *shape || view.element_type() != *element {
                return Err(bad(format!(
                    "result {i} is {:?} {:?}, the function writes {shape:?} {element:?}",
                    view.shape(),
                    view.element_type()
                )));
            }
        }
        match (self.transients, &storage.transients) {
            (Some(bytes), Some(view)) if view.byte_length() < bytes => {
                return Err(bad(format!(
                    "transients of {} bytes, it needs {bytes}",
                    view.byte_length()
                )))
            }
            (Some(bytes), None) => return Err(bad(format!("no transients buffer (it needs {bytes} bytes)"))),
            _ => {}
        }
        let views = storage.results.iter().chain(&storage.transients);
        if let Some(view) = views.into_iter().find(|v| !v.device().same_as(device)) {
            return Err(bad(format!("a buffer of device `{}`", view.device().name())));
        }
        Ok(())
    }
}

fn allocate_transients(device: &Device, bytes: usize) -> Result<BufferView> {
    BufferView::allocate(
        device,
        &[bytes.max(1)],
        ElementType::Other(iree_runtime_sys::IREE_HAL_ELEMENT_TYPE_INT_8),
    )
}

/// One call's storage ([`StorageSpec::allocate`]). A call made with it returns its tied results
/// as views of these buffers: they are overwritten by the next call given the same storage, so
/// a caller keeps as many sets as it keeps results alive.
#[derive(Debug, Clone)]
pub struct CallStorage {
    results: Vec<BufferView>,
    transients: Option<BufferView>,
}

impl CallStorage {
    /// The result buffers, in the function's result order.
    pub fn results(&self) -> &[BufferView] {
        &self.results
    }

    /// The transients' buffer, to share with [`StorageSpec::allocate_results`].
    pub fn transients(&self) -> Option<&BufferView> {
        self.transients.as_ref()
    }

    /// Whether `view` is (a view of) one of this set's result buffers.
    pub fn holds(&self, view: &BufferView) -> bool {
        self.results.iter().any(|r| r.shares_buffer(view))
    }
}
