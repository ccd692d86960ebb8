//! The GGUF container (versions 2 and 3): header, metadata key/values, tensor infos, alignment and
//! the data section, read over a memory map.
//!
//! Layout (little-endian): magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count;
//! each metadata entry is a string key (`u64` length + UTF-8 bytes), a `u32` value type and the
//! value (arrays: `u32` element type, `u64` count, elements); each tensor info is a string name,
//! `u32` dimension count, `u64` dims (`ne0` first, the contiguous one), `u32` ggml type and a
//! `u64` offset relative to the data section, which starts at the end of the tensor infos rounded
//! up to `general.alignment` (default 32).
//!
//! Every read is bounds-checked with checked arithmetic when the file is opened, every tensor's
//! byte range is checked against the file, so a truncated or corrupt file is an error, never a
//! panic or a read outside the map.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{GgufError, Result};
pub use crate::ggml::GgmlType;

/// `GGUF` read as a little-endian `u32`.
pub const MAGIC: u32 = 0x4655_4747;
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Elements of one type (the GGUF array's element type, kept for round-trips).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// The value type ids of the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type takes (strings: their length prefix).
    fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl Value {
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(t, v) => format!("an array of {} {t:?}", v.len()),
            Value::String(_) => "a string".into(),
            other => format!("{other:?}"),
        }
    }

    /// Any integer as `u64` (negative values are `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer as `i64` (values past `i64::MAX` are `None`).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float (f32 or f64, narrowed) as `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor of the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` (`ne0`) is the contiguous dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Relative to the data section.
    pub offset: u64,
    /// Byte length, `None` for types of unknown layout.
    pub size: Option<u64>,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Checked at open for types of known layout; saturate for the others.
        self.dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// The row-major shape (`[ne1, ne0]` for a matrix): the same memory order, outermost first.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Backing {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. Tensor data is not copied: [`GgufFile::tensor_data`] slices the map.
pub struct GgufFile {
    path: Option<PathBuf>,
    backing: Backing,
    version: u32,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |op| {
            move |source| GgufError::Io {
                op,
                path: path.to_path_buf(),
                source,
            }
        };
        let file = File::open(path).map_err(io("open"))?;
        // SAFETY: the map is read-only; the file is not expected to change while it is open (the
        // same contract as every memory-mapped model loader).
        let map = unsafe { Mmap::map(&file) }.map_err(io("map"))?;
        let mut parsed = Self::parse(Backing::Map(map))?;
        parsed.path = Some(path.to_path_buf());
        Ok(parsed)
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Backing::Owned(bytes))
    }

    fn parse(backing: Backing) -> Result<Self> {
        let buf = backing.bytes();
        let mut r = Reader { buf, pos: 0 };
        let magic = r.u32("magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;

        let mut metadata = Vec::with_capacity(r.capacity_for(n_kv, 12));
        let mut metadata_index = HashMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::corrupt(format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => u64::from(*a),
            Some(other) => {
                return Err(GgufError::corrupt(format!(
                    "general.alignment must be a positive power of two u32, found {other:?}"
                )))
            }
        };

        let mut tensors = Vec::with_capacity(r.capacity_for(n_tensors, 24));
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor {i}"))?;
            let n_dims = r.u32(&format!("dimension count of `{name}`"))?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::corrupt(format!(
                    "tensor `{name}` has {n_dims} dimensions (at most {MAX_DIMS})"
                )));
            }
            let dims = (0..n_dims)
                .map(|d| r.u64(&format!("dimension {d} of `{name}`")))
                .collect::<Result<Vec<u64>>>()?;
            let ty = GgmlType::from_id(r.u32(&format!("type of `{name}`"))?);
            let offset = r.u64(&format!("offset of `{name}`"))?;
            let size = tensor_size(&name, &dims, ty)?;
            if offset % alignment != 0 {
                return Err(GgufError::corrupt(format!(
                    "tensor `{name}` offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::corrupt(format!("tensor `{name}` appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                size,
            });
        }

        let data_offset = r
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| GgufError::corrupt("data offset overflows"))?;
        let len = buf.len() as u64;
        for t in &tensors {
            let Some(size) = t.size else { continue };
            let start = data_offset
                .checked_add(t.offset)
                .ok_or_else(|| GgufError::corrupt(format!("offset of `{}` overflows", t.name)))?;
            let end = start
                .checked_add(size)
                .ok_or_else(|| GgufError::corrupt(format!("size of `{}` overflows", t.name)))?;
            if end > len {
                return Err(GgufError::Truncated {
                    what: format!("data of tensor `{}`", t.name),
                    offset: start,
                    needed: size,
                    len,
                });
            }
        }
        Ok(GgufFile {
            path: None,
            backing,
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Offset of the data section from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// Every metadata entry in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    fn wrong(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.into(),
            expected,
            found: found.type_name(),
        }
    }

    /// An integer key of any width as `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get_u64(key)?;
        usize::try_from(v).map_err(|_| GgufError::corrupt(format!("`{key}` = {v} overflows usize")))
    }

    /// An optional integer key.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        if self.get(key).is_some() {
            self.get_usize(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| self.wrong(key, "a float", v))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        if self.get(key).is_some() {
            self.get_f32(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong(key, "a bool", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "a string", v))
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.wrong(key, "an array", v))
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self.get_array(key)?;
        arr.iter()
            .map(|v| v.as_str().ok_or_else(|| self.wrong(key, "an array of strings", v)))
            .collect()
    }

    /// An array of floats.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let arr = self.get_array(key)?;
        arr.iter()
            .map(|v| v.as_f32().ok_or_else(|| self.wrong(key, "an array of floats", v)))
            .collect()
    }

    /// An array of integers as `i64`.
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let arr = self.get_array(key)?;
        arr.iter()
            .map(|v| v.as_i64().ok_or_else(|| self.wrong(key, "an array of integers", v)))
            .collect()
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// Every tensor in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.into()))
    }

    /// The raw bytes of a tensor (range checked at open).
    pub fn tensor_data(&self, info: &TensorInfo) -> Result<&[u8]> {
        let size = info.size.ok_or_else(|| GgufError::UnsupportedType {
            tensor: info.name.clone(),
            ty: info.ty,
        })?;
        let buf = self.backing.bytes();
        let start = self.data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(size));
        match (start, end) {
            (Some(s), Some(e)) if e <= buf.len() as u64 => Ok(&buf[s as usize..e as usize]),
            _ => Err(GgufError::Truncated {
                what: format!("data of tensor `{}`", info.name),
                offset: start.unwrap_or(u64::MAX),
                needed: size,
                len: buf.len() as u64,
            }),
        }
    }

    /// A tensor widened to f32, in its row-major memory order.
    pub fn dequantize(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        let bytes = self.tensor_data(info)?;
        let n = usize::try_from(info.n_elements())
            .map_err(|_| GgufError::corrupt(format!("tensor `{}` is too large", info.name)))?;
        crate::quant::dequantize(info.ty, bytes, n).map_err(|e| match e {
            GgufError::UnsupportedType { ty, .. } => GgufError::UnsupportedType {
                tensor: info.name.clone(),
                ty,
            },
            other => other,
        })
    }

    /// [`GgufFile::dequantize`] by name.
    pub fn dequantize_named(&self, name: &str) -> Result<Vec<f32>> {
        self.dequantize(self.require_tensor(name)?)
    }
}

/// The byte length of a tensor, checked: `ne0` must be a whole number of blocks.
fn tensor_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<Option<u64>> {
    let Some((block, bytes)) = ty.block_layout() else {
        return Ok(None);
    };
    let ne0 = dims.first().copied().unwrap_or(1);
    if ne0 % block != 0 {
        return Err(GgufError::corrupt(format!(
            "tensor `{name}`: ne0 = {ne0} is not a multiple of the {} block size {block}",
            ty.name()
        )));
    }
    let overflow = || GgufError::corrupt(format!("tensor `{name}`: size of dims {dims:?} overflows"));
    let rows = dims
        .iter()
        .skip(1)
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(overflow)?;
    let size = (ne0 / block)
        .checked_mul(bytes)
        .and_then(|row| row.checked_mul(rows))
        .ok_or_else(overflow)?;
    Ok(Some(size))
}

/// A bounds-checked cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: u64,
}

/// Arrays and strings nest at most this deep (the format allows arrays of arrays).
const MAX_NESTING: u32 = 8;

impl Reader<'_> {
    fn take(&mut self, n: u64, what: &str) -> Result<&[u8]> {
        let len = self.buf.len() as u64;
        match self.pos.checked_add(n) {
            Some(end) if end <= len => {
                let s = &self.buf[self.pos as usize..end as usize];
                self.pos = end;
                Ok(s)
            }
            _ => Err(GgufError::Truncated {
                what: what.into(),
                offset: self.pos,
                needed: n,
                len,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A capacity for `count` items of at least `min` bytes each that the rest of the file can hold.
    fn capacity_for(&self, count: u64, min: u64) -> usize {
        let left = (self.buf.len() as u64).saturating_sub(self.pos) / min.max(1);
        count.min(left) as usize
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let at = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| GgufError::corrupt(format!("{what} at offset {at} is not UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let vt =
            ValueType::from_id(ty).ok_or_else(|| GgufError::corrupt(format!("`{key}` has unknown value type {ty}")))?;
        let what = || format!("value of `{key}`");
        Ok(match vt {
            ValueType::U8 => Value::U8(self.array::<1>(&what())?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what())?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what())?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what())?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            ValueType::Bool => match self.array::<1>(&what())?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::corrupt(format!("`{key}` holds bool byte {b}"))),
            },
            ValueType::String => Value::String(self.string(&what())?),
            ValueType::Array => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::corrupt(format!("`{key}` nests arrays too deep")));
                }
                let et = self.u32(&format!("element type of `{key}`"))?;
                let elem = ValueType::from_id(et)
                    .ok_or_else(|| GgufError::corrupt(format!("`{key}` has unknown element type {et}")))?;
                let count = self.u64(&format!("length of `{key}`"))?;
                let left = (self.buf.len() as u64).saturating_sub(self.pos);
                if count.checked_mul(elem.min_size()).is_none_or(|need| need > left) {
                    return Err(GgufError::Truncated {
                        what: format!("{count} elements of `{key}`"),
                        offset: self.pos,
                        needed: count.saturating_mul(elem.min_size()),
                        len: self.buf.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(et, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
