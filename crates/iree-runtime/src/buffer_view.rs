use std::ptr::NonNull;

use iree_runtime_sys as sys;

use crate::device::Device;
use crate::error::{check, Error, Result};

/// Element types this crate creates and reads; anything else is reported as `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    F32,
    F16,
    /// Signless 32-bit integer (what `tensor<..xi32>` compiles to).
    I32,
    /// Any other `iree_hal_element_type_t`, raw.
    Other(u32),
}

impl ElementType {
    fn from_raw(raw: sys::iree_hal_element_type_t) -> ElementType {
        match raw {
            sys::IREE_HAL_ELEMENT_TYPE_FLOAT_32 => ElementType::F32,
            sys::IREE_HAL_ELEMENT_TYPE_FLOAT_16 => ElementType::F16,
            sys::IREE_HAL_ELEMENT_TYPE_INT_32 | sys::IREE_HAL_ELEMENT_TYPE_SINT_32 => ElementType::I32,
            other => ElementType::Other(other),
        }
    }

    fn to_raw(self) -> sys::iree_hal_element_type_t {
        match self {
            ElementType::F32 => sys::IREE_HAL_ELEMENT_TYPE_FLOAT_32,
            ElementType::F16 => sys::IREE_HAL_ELEMENT_TYPE_FLOAT_16,
            ElementType::I32 => sys::IREE_HAL_ELEMENT_TYPE_INT_32,
            ElementType::Other(raw) => raw,
        }
    }

    /// Bytes per element: IREE's bit count (the low byte of the raw type) rounded up to bytes.
    pub fn size(self) -> usize {
        let bits = (self.to_raw() & 0xff) as usize;
        bits.div_ceil(8)
    }
}

/// A shaped, typed view of a device buffer (`iree_hal_buffer_view_t`), dense row-major.
///
/// Buffers made here and returned by calls are device-local: contents move with explicit
/// transfers (`iree_hal_device_transfer_*`), never by mapping. `Clone` retains the same view
/// (no copy). Keeps its [`Device`] alive.
pub struct BufferView {
    raw: NonNull<sys::iree_hal_buffer_view_t>,
    device: Device,
}

// SAFETY: a buffer view is immutable after creation (shape, type, buffer reference) and
// reference counted atomically; the buffer behind it is only touched through device transfers,
// which HAL devices accept from any thread.
unsafe impl Send for BufferView {}
// SAFETY: as above; `&BufferView` methods only read the view or enqueue transfers on the device.
unsafe impl Sync for BufferView {}

impl Clone for BufferView {
    fn clone(&self) -> BufferView {
        // SAFETY: the view is live; the new reference is owned by the clone.
        unsafe { sys::iree_hal_buffer_view_retain(self.raw.as_ptr()) };
        BufferView {
            raw: self.raw,
            device: self.device.clone(),
        }
    }
}

impl Drop for BufferView {
    fn drop(&mut self) {
        // SAFETY: this value owns one reference.
        unsafe { sys::iree_hal_buffer_view_release(self.raw.as_ptr()) };
    }
}

fn device_local_params() -> sys::iree_hal_buffer_params_t {
    sys::iree_hal_buffer_params_t {
        usage: sys::IREE_HAL_BUFFER_USAGE_DEFAULT,
        access: sys::IREE_HAL_MEMORY_ACCESS_ALL as sys::iree_hal_memory_access_t,
        type_: sys::IREE_HAL_MEMORY_TYPE_DEVICE_LOCAL,
        queue_affinity: 0,
        min_alignment: 0,
    }
}

/// Inputs up to this size are written straight into host memory the device reads
/// ([`host_visible_params`]); larger ones are copied into device memory.
pub const HOST_VISIBLE_UPLOAD_MAX: usize = 64 * 1024;

/// Host memory the device can read, mapped for the write that fills it: no queue transfer and no
/// wait. A decode step's inputs (a token, an embedding row, rotary rows) went through a
/// device-local buffer each, one host-to-device round trip apiece: ~1 ms each on the H200 over
/// Vulkan, 4.8 ms of a 12 ms step (`bench`'s `decode_phases`, docs/journal session 13).
/// The device reads them once per call, so where they live costs nothing measurable.
fn host_visible_params() -> sys::iree_hal_buffer_params_t {
    sys::iree_hal_buffer_params_t {
        usage: sys::IREE_HAL_BUFFER_USAGE_DEFAULT | sys::IREE_HAL_BUFFER_USAGE_MAPPING,
        access: sys::IREE_HAL_MEMORY_ACCESS_ALL as sys::iree_hal_memory_access_t,
        type_: sys::IREE_HAL_MEMORY_TYPE_HOST_LOCAL | sys::IREE_HAL_MEMORY_TYPE_DEVICE_VISIBLE,
        queue_affinity: 0,
        min_alignment: 0,
    }
}

impl BufferView {
    /// Takes over `raw`'s reference.
    ///
    /// # Safety
    /// `raw` must be a live buffer view whose reference the caller owns and gives up, with a
    /// buffer allocated by `device`.
    pub(crate) unsafe fn from_owned(raw: NonNull<sys::iree_hal_buffer_view_t>, device: Device) -> Self {
        BufferView { raw, device }
    }

    /// An `f32` tensor of `shape` holding `data` (row-major): in host memory the device reads
    /// up to [`HOST_VISIBLE_UPLOAD_MAX`] bytes, else copied into device memory.
    pub fn from_f32(device: &Device, shape: &[usize], data: &[f32]) -> Result<BufferView> {
        Self::from_bytes(device, shape, ElementType::F32, 4, bytes_of(data))
    }

    /// [`Self::from_f32`] for `i32`.
    pub fn from_i32(device: &Device, shape: &[usize], data: &[i32]) -> Result<BufferView> {
        Self::from_bytes(device, shape, ElementType::I32, 4, bytes_of(data))
    }

    /// A tensor of `shape` and `element_type` holding `bytes` (row-major, the elements'
    /// little-endian bytes), placed as [`Self::from_f32`] places its data.
    pub fn from_raw_bytes(
        device: &Device,
        shape: &[usize],
        element_type: ElementType,
        bytes: &[u8],
    ) -> Result<BufferView> {
        Self::from_bytes(device, shape, element_type, element_type.size(), bytes)
    }

    fn from_bytes(
        device: &Device,
        shape: &[usize],
        element_type: ElementType,
        element_size: usize,
        bytes: &[u8],
    ) -> Result<BufferView> {
        // Checked: shapes come from caller geometry (a Kotlin `IreeKvSpec`), and a product that
        // wraps (`usize` is 32 bits on armv7) could match a short `bytes` and make a view
        // larger than its data.
        let needed = shape
            .iter()
            .try_fold(element_size, |n, &d| n.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument {
                op: "create buffer view",
                reason: format!(
                    "shape {shape:?} of {element_size}-byte elements exceeds the address space ({}-bit)",
                    usize::BITS
                ),
            })?;
        if needed != bytes.len() {
            return Err(Error::InvalidArgument {
                op: "create buffer view",
                reason: format!(
                    "shape {shape:?} needs {} elements, got {}",
                    needed / element_size,
                    bytes.len() / element_size
                ),
            });
        }
        if bytes.len() <= HOST_VISIBLE_UPLOAD_MAX {
            return Self::from_bytes_mapped(device, shape, element_type, bytes);
        }
        let dims: Vec<sys::iree_hal_dim_t> = shape.iter().map(|&d| d as sys::iree_hal_dim_t).collect();
        let mut raw = std::ptr::null_mut();
        // SAFETY: device and its allocator are live; `dims` and `bytes` are valid for the call
        // (the data is copied into the new buffer before it returns); `raw` receives one
        // reference owned by the returned value.
        let status = unsafe {
            sys::iree_hal_buffer_view_allocate_buffer_copy(
                device.as_ptr(),
                device.allocator(),
                dims.len(),
                dims.as_ptr(),
                element_type.to_raw(),
                sys::IREE_HAL_ENCODING_TYPE_DENSE_ROW_MAJOR,
                device_local_params(),
                sys::iree_const_byte_span_t {
                    data: bytes.as_ptr(),
                    data_length: bytes.len(),
                },
                &mut raw,
            )
        };
        check(status, format!("create buffer view {shape:?} on `{}`", device.name()))?;
        let raw = NonNull::new(raw).expect("iree_hal_buffer_view_allocate_buffer_copy: null");
        // SAFETY: fresh view, our reference, allocated on `device`.
        Ok(unsafe { BufferView::from_owned(raw, device.clone()) })
    }

    /// `bytes` (checked against `shape`) in a new host-visible buffer, written through a
    /// mapping.
    fn from_bytes_mapped(
        device: &Device,
        shape: &[usize],
        element_type: ElementType,
        bytes: &[u8],
    ) -> Result<BufferView> {
        const OP: &str = "create buffer view";
        let buffer = allocate_buffer(device, host_visible_params(), bytes.len().max(1), OP, shape)?;
        if !bytes.is_empty() {
            // SAFETY: the buffer is live, mappable and holds at least `bytes.len()` bytes;
            // `bytes` is valid for the call, which copies it before returning.
            let status = unsafe {
                sys::iree_hal_buffer_map_write(
                    buffer.0,
                    0,
                    bytes.as_ptr().cast(),
                    bytes.len() as sys::iree_device_size_t,
                )
            };
            check(status, format!("{OP} {shape:?}: write through a mapping"))?;
        }
        dense_view_of(&buffer, shape, element_type, device, OP)
    }

    /// A device-local `f32` tensor of `shape` with undefined contents (no host data moves):
    /// fill it with [`Device::transfer`](crate::Transfer) before reading.
    pub fn allocate_f32(device: &Device, shape: &[usize]) -> Result<BufferView> {
        Self::allocate(device, shape, ElementType::F32)
    }

    /// [`Self::allocate_f32`] for any element type.
    pub fn allocate(device: &Device, shape: &[usize], element_type: ElementType) -> Result<BufferView> {
        const OP: &str = "allocate buffer view";
        let bytes = shape
            .iter()
            .try_fold(element_type.size(), |n, &d| n.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "shape {shape:?} of {element_type:?} exceeds the address space ({}-bit)",
                    usize::BITS
                ),
            })?;
        let buffer = allocate_buffer(device, device_local_params(), bytes, OP, shape)?;
        dense_view_of(&buffer, shape, element_type, device, OP)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn shape(&self) -> Vec<usize> {
        // SAFETY: the view is live; dims points at `rank` entries owned by the view.
        unsafe {
            let rank = sys::iree_hal_buffer_view_shape_rank(self.as_ptr());
            let dims = sys::iree_hal_buffer_view_shape_dims(self.as_ptr());
            if rank == 0 {
                return Vec::new();
            }
            // iree_hal_dim_t is size_t by default but configurable (IREE_DEVICE_SIZE_T).
            #[allow(clippy::unnecessary_cast)]
            std::slice::from_raw_parts(dims, rank)
                .iter()
                .map(|&d| d as usize)
                .collect()
        }
    }

    pub fn element_type(&self) -> ElementType {
        // SAFETY: the view is live.
        ElementType::from_raw(unsafe { sys::iree_hal_buffer_view_element_type(self.as_ptr()) })
    }

    /// Whether the host can map the view's memory (small inputs: [`HOST_VISIBLE_UPLOAD_MAX`]).
    pub fn is_host_visible(&self) -> bool {
        // SAFETY: the view and its buffer are live.
        let memory = unsafe { sys::iree_hal_buffer_memory_type(sys::iree_hal_buffer_view_buffer(self.as_ptr())) };
        memory & sys::IREE_HAL_MEMORY_TYPE_HOST_VISIBLE == sys::IREE_HAL_MEMORY_TYPE_HOST_VISIBLE
    }

    /// Size of the view's contents in bytes.
    pub fn byte_length(&self) -> usize {
        // SAFETY: the view is live.
        unsafe { sys::iree_hal_buffer_view_byte_length(self.as_ptr()) as usize }
    }

    /// Copies the contents to the host (device → host transfer; waits for it).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        self.expect_type(ElementType::F32, "read buffer view as f32")?;
        let mut out = vec![0f32; self.byte_length() / 4];
        self.read_into(bytes_of_mut(&mut out))?;
        Ok(out)
    }

    /// Copies the contents to the host (device → host transfer; waits for it).
    pub fn to_i32_vec(&self) -> Result<Vec<i32>> {
        self.expect_type(ElementType::I32, "read buffer view as i32")?;
        let mut out = vec![0i32; self.byte_length() / 4];
        self.read_into(bytes_of_mut(&mut out))?;
        Ok(out)
    }

    /// Reads a host-mappable view ([`Self::is_mappable`]) as soon as the submission that
    /// returned `written` is done, not waiting for what was queued after it (the views' other
    /// reads wait for everything on the device).
    pub fn to_i32_vec_when(&self, written: crate::Queued) -> Result<Vec<i32>> {
        const OP: &str = "read mapped buffer view as i32";
        self.expect_type(ElementType::I32, OP)?;
        if !self.is_mappable() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "the view is not host-mappable".into(),
            });
        }
        self.device.wait(written)?;
        let mut out = vec![0i32; self.byte_length() / 4];
        self.map_read(bytes_of_mut(&mut out))?;
        Ok(out)
    }

    /// Copies the first `count` elements to the host (one device → host transfer; waits).
    pub fn to_f32_vec_prefix(&self, count: usize) -> Result<Vec<f32>> {
        self.expect_type(ElementType::F32, "read buffer view prefix as f32")?;
        if count > self.byte_length() / 4 {
            return Err(Error::InvalidArgument {
                op: "read buffer view prefix as f32",
                reason: format!("{count} elements asked of a view holding {}", self.byte_length() / 4),
            });
        }
        let mut out = vec![0f32; count];
        self.read_into(bytes_of_mut(&mut out))?;
        Ok(out)
    }

    /// Copies the first `length` bytes to the host, whatever the element type (one device →
    /// host transfer; waits).
    pub fn to_bytes_prefix(&self, length: usize) -> Result<Vec<u8>> {
        if length > self.byte_length() {
            return Err(Error::InvalidArgument {
                op: "read buffer view prefix as bytes",
                reason: format!("{length} bytes asked of a view holding {}", self.byte_length()),
            });
        }
        let mut out = vec![0u8; length];
        self.read_into(&mut out)?;
        Ok(out)
    }

    fn expect_type(&self, wanted: ElementType, op: &'static str) -> Result<()> {
        let actual = self.element_type();
        if actual == wanted {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                op,
                reason: format!("the view holds {actual:?}"),
            })
        }
    }

    /// Whether the host may map the view's buffer: host-visible memory allocated for mapping
    /// (this crate's small inputs and read-back buffers; on a CPU device also results, where
    /// IREE allows it).
    pub fn is_mappable(&self) -> bool {
        // SAFETY: the view and its buffer are live.
        let usage = unsafe { sys::iree_hal_buffer_allowed_usage(sys::iree_hal_buffer_view_buffer(self.as_ptr())) };
        self.is_host_visible()
            && usage & sys::IREE_HAL_BUFFER_USAGE_MAPPING_SCOPED == sys::IREE_HAL_BUFFER_USAGE_MAPPING_SCOPED
    }

    fn read_into(&self, target: &mut [u8]) -> Result<()> {
        // Async calls return before their results are written.
        self.device.sync()?;
        if self.is_mappable() {
            return self.map_read(target);
        }
        // SAFETY: view, buffer and device are live; `target` has exactly `byte_length` bytes
        // and the call returns only after the transfer completed (infinite timeout).
        let status = unsafe {
            sys::iree_hal_device_transfer_d2h(
                self.device.as_ptr(),
                sys::iree_hal_buffer_view_buffer(self.as_ptr()),
                0,
                target.as_mut_ptr().cast(),
                target.len() as sys::iree_device_size_t,
                sys::IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT,
                sys::iree_infinite_timeout(),
            )
        };
        check(status, format!("read buffer view from `{}`", self.device.name()))
    }

    /// A mapped read: no queue submission and no wait (the caller has waited for whatever wrote
    /// the buffer).
    fn map_read(&self, target: &mut [u8]) -> Result<()> {
        // SAFETY: view and buffer are live; `target` holds `target.len()` bytes, at most the
        // view's length (the callers size it from the view).
        let status = unsafe {
            sys::iree_hal_buffer_map_read(
                sys::iree_hal_buffer_view_buffer(self.as_ptr()),
                0,
                target.as_mut_ptr().cast(),
                target.len() as sys::iree_device_size_t,
            )
        };
        check(
            status,
            format!("read buffer view from `{}` (mapped)", self.device.name()),
        )
    }

    /// Whether `other` is this very view (a clone of it), not a copy of its contents.
    pub fn is_same_view(&self, other: &BufferView) -> bool {
        self.raw == other.raw
    }

    /// Whether `other` views the same allocation as this view (the same buffer, or a subspan
    /// of it): what a call's result written into caller-supplied storage shares with it.
    pub fn shares_buffer(&self, other: &BufferView) -> bool {
        // SAFETY: both views are live; the buffers they hold outlive the calls.
        unsafe {
            let a = sys::iree_hal_buffer_allocated_buffer(sys::iree_hal_buffer_view_buffer(self.as_ptr()));
            let b = sys::iree_hal_buffer_allocated_buffer(sys::iree_hal_buffer_view_buffer(other.as_ptr()));
            a == b
        }
    }

    /// Rows `r0..r1` of a `[1, H, R, D]` view (axis 2), as a `[1, H, r1 - r0, D]` view.
    ///
    /// With `H == 1` the rows are contiguous and the result is a zero-copy subspan sharing the
    /// buffer. With `H > 1` they are not, so the result is a new device buffer filled by one
    /// device → device copy per head.
    pub fn rows(&self, r0: usize, r1: usize) -> Result<BufferView> {
        const OP: &str = "take rows of buffer view";
        let shape = self.shape();
        let [1, heads, rows, width] = shape[..] else {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("expected a [1, H, R, D] view, got {shape:?}"),
            });
        };
        if r0 > r1 || r1 > rows {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("rows {r0}..{r1} out of 0..{rows}"),
            });
        }
        let element_size = self.byte_length() / (heads * rows * width).max(1);
        let row_bytes = (width * element_size) as sys::iree_device_size_t;
        let taken = (r1 - r0) as sys::iree_device_size_t;
        let head_stride = rows as sys::iree_device_size_t * row_bytes;
        let new_shape = [1, heads, r1 - r0, width];
        let host = self.device.host_allocator();
        // SAFETY: the view is live; its buffer is borrowed (not retained) for this call.
        let source = unsafe { sys::iree_hal_buffer_view_buffer(self.as_ptr()) };

        let mut buffer = std::ptr::null_mut();
        let status = if heads == 1 {
            // SAFETY: the range lies inside the buffer (checked above); the subspan retains
            // the source buffer and its reference goes to `buffer`.
            unsafe {
                sys::iree_hal_buffer_subspan(
                    source,
                    r0 as sys::iree_device_size_t * row_bytes,
                    taken * row_bytes,
                    host,
                    &mut buffer,
                )
            }
        } else {
            // SAFETY: allocator live; `buffer` receives one reference.
            unsafe {
                sys::iree_hal_allocator_allocate_buffer(
                    self.device.allocator(),
                    device_local_params(),
                    heads as sys::iree_device_size_t * taken * row_bytes,
                    &mut buffer,
                )
            }
        };
        check(status, OP)?;
        let buffer = OwnedBuffer(buffer);
        if heads > 1 {
            // The copies below are not ordered after async calls that may write the source.
            self.device.sync()?;
            for head in 0..heads as sys::iree_device_size_t {
                // SAFETY: both ranges are in bounds and in different buffers; the call waits.
                let status = unsafe {
                    sys::iree_hal_device_transfer_d2d(
                        self.device.as_ptr(),
                        source,
                        head * head_stride + r0 as sys::iree_device_size_t * row_bytes,
                        buffer.0,
                        head * taken * row_bytes,
                        taken * row_bytes,
                        sys::IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT,
                        sys::iree_infinite_timeout(),
                    )
                };
                check(status, format!("{OP}: copy head {head}"))?;
            }
        }
        self.view_like(&buffer, &new_shape, OP)
    }

    /// The first `n` entries of axis 0 (`[n, ...]` of a `[N, ...]` view): a zero-copy subspan
    /// sharing the buffer, so writes through either are seen by both.
    pub fn leading(&self, n: usize) -> Result<BufferView> {
        const OP: &str = "take leading rows of buffer view";
        let mut shape = self.shape();
        let Some(&rows) = shape.first() else {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "a scalar view has no rows".into(),
            });
        };
        if n > rows {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("{n} rows of {rows}"),
            });
        }
        let row_bytes = self.byte_length() / rows.max(1);
        shape[0] = n;
        // SAFETY: the view is live; its buffer is borrowed (not retained) for this call.
        let source = unsafe { sys::iree_hal_buffer_view_buffer(self.as_ptr()) };
        let mut buffer = std::ptr::null_mut();
        // SAFETY: the range lies inside the buffer (checked above); the subspan retains the
        // source buffer and its reference goes to `buffer`.
        let status = unsafe {
            sys::iree_hal_buffer_subspan(
                source,
                0,
                (n * row_bytes) as sys::iree_device_size_t,
                self.device.host_allocator(),
                &mut buffer,
            )
        };
        check(status, OP)?;
        self.view_like(&OwnedBuffer(buffer), &shape, OP)
    }

    /// A view of `shape` over `buffer` with this view's element type and encoding.
    fn view_like(&self, buffer: &OwnedBuffer, shape: &[usize], op: &'static str) -> Result<BufferView> {
        // SAFETY: the view is live.
        let (element_type, encoding) = unsafe {
            (
                sys::iree_hal_buffer_view_element_type(self.as_ptr()),
                sys::iree_hal_buffer_view_encoding_type(self.as_ptr()),
            )
        };
        view_of(buffer, shape, element_type, encoding, &self.device, op)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::iree_hal_buffer_view_t {
        self.raw.as_ptr()
    }
}

impl std::fmt::Debug for BufferView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferView")
            .field("shape", &self.shape())
            .field("element_type", &self.element_type())
            .field("device", &self.device.name())
            .finish()
    }
}

/// A new view of `shape` over `buffer` (which the view retains), allocated by `device`.
/// A new buffer of `bytes` bytes with `params` (`op` and `shape` name it in the error).
fn allocate_buffer(
    device: &Device,
    params: sys::iree_hal_buffer_params_t,
    bytes: usize,
    op: &'static str,
    shape: &[usize],
) -> Result<OwnedBuffer> {
    let mut buffer = std::ptr::null_mut();
    // SAFETY: allocator live; `buffer` receives one reference, released by the guard.
    let status = unsafe {
        sys::iree_hal_allocator_allocate_buffer(
            device.allocator(),
            params,
            bytes as sys::iree_device_size_t,
            &mut buffer,
        )
    };
    check(status, format!("{op} {shape:?} on `{}`", device.name()))?;
    Ok(OwnedBuffer(buffer))
}

/// [`view_of`] a row-major `element_type` tensor.
fn dense_view_of(
    buffer: &OwnedBuffer,
    shape: &[usize],
    element_type: ElementType,
    device: &Device,
    op: &'static str,
) -> Result<BufferView> {
    view_of(
        buffer,
        shape,
        element_type.to_raw(),
        sys::IREE_HAL_ENCODING_TYPE_DENSE_ROW_MAJOR,
        device,
        op,
    )
}

fn view_of(
    buffer: &OwnedBuffer,
    shape: &[usize],
    element_type: sys::iree_hal_element_type_t,
    encoding: sys::iree_hal_encoding_type_t,
    device: &Device,
    op: &'static str,
) -> Result<BufferView> {
    let dims: Vec<sys::iree_hal_dim_t> = shape.iter().map(|&d| d as _).collect();
    let mut raw = std::ptr::null_mut();
    // SAFETY: buffer live; the new view retains it; `raw` receives one reference.
    let status = unsafe {
        sys::iree_hal_buffer_view_create(
            buffer.0,
            dims.len(),
            dims.as_ptr(),
            element_type,
            encoding,
            device.host_allocator(),
            &mut raw,
        )
    };
    check(status, op)?;
    let raw = NonNull::new(raw).expect("iree_hal_buffer_view_create: OK and null");
    // SAFETY: fresh view, our reference, buffer from `device`.
    Ok(unsafe { BufferView::from_owned(raw, device.clone()) })
}

/// A buffer reference released on drop (null allowed).
struct OwnedBuffer(*mut sys::iree_hal_buffer_t);

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        // SAFETY: our reference (or null, which IREE ignores); views made from it retain it.
        unsafe { sys::iree_hal_buffer_release(self.0) };
    }
}

/// Element types whose values are plain bytes: no padding, every bit pattern valid.
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for i32 {}

fn bytes_of<T: Plain>(data: &[T]) -> &[u8] {
    // SAFETY: `T: Plain` has no padding; the length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

fn bytes_of_mut<T: Plain>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: `T: Plain` accepts every bit pattern, so any bytes written keep `data` valid.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}
