//! Snapshot files: a prefix's caches saved to disk and loaded back into a fresh session of the
//! same model, so the shared prefix (an app's tool catalog) is prefilled once per install instead
//! of once per launch.
//!
//! A file is self-describing and checked whole before anything is handed to a backend:
//!
//! ```text
//! offset  size  what
//! 0       8     magic b"SKVSNAP\0"
//! 8       4     format version, u32 LE (FORMAT_VERSION)
//! 12      4     header length H, u32 LE
//! 16      H     header, JSON (SnapshotHeader): contract, model fingerprint, spec, window rule,
//!               position, per-layer rows, data length, CRC-32 of the data
//! ..            zero padding to a multiple of 64
//! D       ..    data: per layer, K then V, LE `[nKvHeads, rows, headDim]` of the header's `dtype`
//!               (`f32`, or `f16` from sessions whose caches are f16: `CacheType`), each block
//!               starting at a multiple of 64 bytes
//! ```
//!
//! Loading maps the file and hands each layer's rows to the backend as byte slices of the mapping
//! with their element type ([`Block`]): no parsing per row, one upload per block, and no
//! conversion where the session's caches hold the file's type. A session writes its caches' own
//! type, so an f16 session's file holds its rows exactly in half the bytes; a file of either type
//! loads into a session of either type (f16 to f32 exactly, f32 to f16 rounded as the caches
//! round: `CacheType::round`). A file of another model (fingerprint), contract, window
//! rule or geometry, a truncated or corrupt one (length, CRC-32) is an [`Error::SnapshotFile`]
//! and the session is not touched: loading makes a new snapshot, it does not restore it.
//! Writes go to a temporary file in the same directory, renamed over the target once complete.
//! Every value is checked to be finite when loaded ([`Error::NonFiniteSnapshot`], naming the
//! layer and position): an intact file (its CRC matches) holding NaN or infinity sent sessions
//! into garbage. Only regular files are read or replaced ([`Error::NotRegularFile`]): a FIFO
//! would block the reader, and renaming over a device node would destroy it. [`verify`] checks a
//! file whole without a session (what `snapshot info` prints).
//!
//! Like the `.irpa` archives, a snapshot file must not be truncated while it is being loaded
//! (reading a truncated mapping raises SIGBUS); its length is checked when it is opened.
//!
//! # Example
//!
//! ```
//! use backend_reference::{ReferenceKv, ReferenceModel};
//! use kv_core::{snapshot_file, KvBackend, WindowRule};
//!
//! # fn main() -> kv_core::Result<()> {
//! let model = ReferenceModel::open(&fixtures::materialize("tiny-gemma3:7")?)?;
//! let mut session = ReferenceKv::new(model.clone(), WindowRule::Exact);
//! session.prefill(&[1, 2, 3, 4, 5])?;
//! let prefix = session.snapshot()?;
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("catalog.skvsnap");
//! snapshot_file::save(&session, &prefix, &path)?;
//! assert_eq!(snapshot_file::verify(&path)?.position, 5);
//!
//! // A fresh session of the same model (another process, in an app) loads it instead of
//! // prefilling, and continues as the session that saved it.
//! let mut fresh = ReferenceKv::new(model, WindowRule::Exact);
//! let loaded = snapshot_file::load(&fresh, &path)?;
//! fresh.restore(&loaded)?;
//! session.restore(&prefix)?;
//! assert_eq!(fresh.chunk(&[6, 7])?, session.chunk(&[6, 7])?);
//! # Ok(())
//! # }
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::backend::{KvBackend, LayerKv};
use crate::error::{Error, Result};
use crate::manifest::{CacheType, CONTRACT_VERSION};
use crate::spec::{KvSpec, LayerKind};
use crate::window::WindowRule;

pub const MAGIC: [u8; 8] = *b"SKVSNAP\0";
/// Bump when the layout above changes; older readers then refuse newer files by version.
pub const FORMAT_VERSION: u32 = 1;
/// Alignment of the header's end and of every data block.
const ALIGN: usize = 64;
/// A header longer than this is not a snapshot header (a guard against allocating from garbage).
const MAX_HEADER: usize = 1 << 20;
/// Embedding rows hashed into a [`ModelFingerprint`] (spread evenly over the vocabulary).
const FINGERPRINT_ROWS: usize = 257;

/// Identifies a model's math: the geometry that shapes the caches and a sample of its weights.
///
/// Two sessions of the same model agree whatever their backend, target or weight format: it is
/// computed from the geometry and the embedding rows rounded to bf16 (the archives' format, so a
/// backend holding f32 copies of bf16 weights gets the same bits), not from files. A sample, not
/// a hash of every weight: fine-tunes of one base that kept its embedding table bit for bit on
/// the sampled rows would not be told apart.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelFingerprint([u8; 32]);

impl ModelFingerprint {
    /// The fingerprint of the model with geometry `spec` whose embedding rows `rows` returns
    /// (`rows(ids)` → `ids.len() × hiddenSize` values, as the backend's gather gives them).
    pub fn compute(spec: &KvSpec, rows: impl FnOnce(&[i32]) -> Result<Vec<f32>>) -> Result<Self> {
        let vocab = spec.vocab_size;
        let mut ids: Vec<i32> = (0..FINGERPRINT_ROWS)
            .map(|i| (i * (vocab - 1) / (FINGERPRINT_ROWS - 1)) as i32)
            .collect();
        ids.dedup();
        let values = rows(&ids)?;
        if values.len() != ids.len() * spec.hidden_size {
            crate::error::invariant("an embedding gather returned the wrong number of values");
        }
        let mut hash = Sha256::new();
        hash.update(b"skainet-kv model fingerprint 1\n");
        hash.update(
            serde_json::to_vec(&Geometry::of(spec)).unwrap_or_else(|e| crate::error::invariant(&e.to_string())),
        );
        hash.update(crate::bf16::f32_to_bf16_bytes(&values));
        Ok(ModelFingerprint(hash.finalize().into()))
    }

    pub fn to_hex(self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Debug for ModelFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelFingerprint({})", self.to_hex())
    }
}

/// The spec's keys that decide what the caches hold; `seq`, `chunk`, `maxPositions` and
/// `maskHeads` shape the graphs, not the rows, so a file loads into sessions that differ there.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Geometry {
    n_layers: usize,
    head_dim: usize,
    n_heads: usize,
    n_kv_heads: usize,
    hidden_size: usize,
    vocab_size: usize,
    sliding_window: usize,
    global_layer_period: usize,
    sliding_rope_base: f32,
    global_rope_base: f32,
}

impl Geometry {
    fn of(spec: &KvSpec) -> Self {
        Geometry {
            n_layers: spec.n_layers,
            head_dim: spec.head_dim,
            n_heads: spec.n_heads,
            n_kv_heads: spec.n_kv_heads,
            hidden_size: spec.hidden_size,
            vocab_size: spec.vocab_size,
            sliding_window: spec.sliding_window,
            global_layer_period: spec.global_layer_period,
            sliding_rope_base: spec.sliding_rope_base,
            global_rope_base: spec.global_rope_base,
        }
    }
}

/// One layer's rows as stored, borrowed from a loaded file: `[nKvHeads, rows, headDim]` each,
/// covering the absolute positions `first_position .. first_position + rows`.
#[derive(Clone, Copy, Debug)]
pub struct LayerRows<'a> {
    pub first_position: usize,
    pub rows: usize,
    pub k: Block<'a>,
    pub v: Block<'a>,
}

/// A K or V block as stored: little-endian elements of `ty`, borrowed from the file.
#[derive(Clone, Copy, Debug)]
pub struct Block<'a> {
    pub ty: CacheType,
    pub bytes: &'a [u8],
}

impl Block<'_> {
    /// The values (exact: f16 widens without rounding).
    pub fn to_f32(&self) -> Vec<f32> {
        self.ty.decode(self.bytes)
    }

    /// The elements as `ty` holds them: the stored bytes when the types agree, else converted
    /// (f32 to f16 rounds as [`CacheType::round`]).
    pub fn to_bytes_of(&self, ty: CacheType) -> std::borrow::Cow<'_, [u8]> {
        if ty == self.ty {
            std::borrow::Cow::Borrowed(self.bytes)
        } else {
            std::borrow::Cow::Owned(ty.encode(&self.to_f32()))
        }
    }
}

/// A session whose snapshots can be saved to files and loaded back. Beside [`KvBackend`] rather
/// than in it: test doubles of the trait need not implement files.
pub trait PersistSnapshot: KvBackend {
    /// The fingerprint of this session's model ([`ModelFingerprint::compute`]).
    fn model_fingerprint(&self) -> Result<ModelFingerprint>;

    /// The rule this session's steps follow; a file made under another rule holds other rows.
    fn window_rule(&self) -> WindowRule;

    /// A host copy of layer `layer` of `snapshot` (one at a time, so that saving holds one
    /// layer's f32 copy, not every layer's).
    fn snapshot_layer(&self, snapshot: &Self::Snapshot, layer: usize) -> Result<LayerKv>;

    /// The element type this session's caches hold, which its files are written in (every
    /// value exactly). Default: f32.
    fn cache_type(&self) -> CacheType {
        CacheType::F32
    }

    /// A snapshot of this session holding `layers` (every layer, in order) at `position`, as if
    /// a prefix had been fed and snapshotted. The caller has checked the rows ([`check_layers`]);
    /// the session's own state is not touched (restore the snapshot to continue from it). The
    /// rows are handed over one layer at a time, and a layer's slices must not be used once the
    /// next is asked for (the loader then releases the mapped pages behind them).
    fn snapshot_from_layers<'a>(
        &self,
        position: usize,
        layers: &mut dyn Iterator<Item = LayerRows<'a>>,
    ) -> Result<Self::Snapshot>;
}

impl<B: PersistSnapshot + ?Sized> PersistSnapshot for Box<B> {
    fn model_fingerprint(&self) -> Result<ModelFingerprint> {
        (**self).model_fingerprint()
    }
    fn window_rule(&self) -> WindowRule {
        (**self).window_rule()
    }
    fn snapshot_layer(&self, snapshot: &Self::Snapshot, layer: usize) -> Result<LayerKv> {
        (**self).snapshot_layer(snapshot, layer)
    }
    fn cache_type(&self) -> CacheType {
        (**self).cache_type()
    }
    fn snapshot_from_layers<'a>(
        &self,
        position: usize,
        layers: &mut dyn Iterator<Item = LayerRows<'a>>,
    ) -> Result<Self::Snapshot> {
        (**self).snapshot_from_layers(position, layers)
    }
}

/// The JSON header of a snapshot file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotHeader {
    pub contract_version: u32,
    /// [`ModelFingerprint::to_hex`] of the model that made it.
    pub model: String,
    pub spec: KvSpec,
    /// `exact` or `seed-step`.
    pub window_rule: String,
    pub position: usize,
    /// Element type of the data: `f32` or `f16` ([`CacheType`]'s spelling).
    pub dtype: String,
    pub layers: Vec<LayerHeader>,
    pub data_bytes: u64,
    pub data_crc32: u32,
    /// The backend that saved it (informational).
    #[serde(default)]
    pub saved_by: String,
    /// What the prefix is, where it is a rendered conversation prefix: a digest of its system
    /// text, tools and chat template (`tokenizer::Tokenizer::prefix_digest`). A request whose
    /// digest differs is answered from the wrong catalog, so callers refuse it. Absent for raw
    /// prefixes and in files written before it existed (readers of those ignore the key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_digest: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LayerHeader {
    pub first_position: usize,
    pub rows: usize,
}

fn dtype_name(ty: CacheType) -> &'static str {
    match ty {
        CacheType::F32 => "f32",
        CacheType::F16 => "f16",
    }
}

fn rule_name(rule: WindowRule) -> &'static str {
    match rule {
        WindowRule::Exact => "exact",
        WindowRule::SeedStep => "seed-step",
    }
}

fn file_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::SnapshotFile {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

fn aligned(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Bytes of one K or V block of `rows` rows of `ty`.
fn block_bytes(spec: &KvSpec, ty: CacheType, rows: usize) -> Option<usize> {
    spec.n_kv_heads
        .checked_mul(rows)?
        .checked_mul(spec.head_dim)?
        .checked_mul(ty.size())
}

/// Offsets of every layer's K and V blocks from the start of the data, and the data's length.
fn data_layout(spec: &KvSpec, ty: CacheType, layers: &[LayerHeader]) -> Option<(Vec<(usize, usize)>, usize)> {
    let mut offset = 0usize;
    let mut offsets = Vec::with_capacity(layers.len());
    for layer in layers {
        let bytes = aligned(block_bytes(spec, ty, layer.rows)?);
        let v = offset.checked_add(bytes)?;
        offsets.push((offset, v));
        offset = v.checked_add(bytes)?;
    }
    Some((offsets, offset))
}

/// Checks that `layers` are what a session at `position` may hold: every layer ends at
/// `position`, a global layer holds every row since 0, a sliding layer at least the
/// `min(position, window)` rows the next call may ask of it (see [`crate::window`]).
pub fn check_layers(spec: &KvSpec, position: usize, layers: &[LayerHeader]) -> std::result::Result<(), String> {
    if position > spec.max_positions {
        return Err(format!(
            "position {position} exceeds this session's maxPositions {}",
            spec.max_positions
        ));
    }
    if layers.len() != spec.n_layers {
        return Err(format!("{} layers, the model has {}", layers.len(), spec.n_layers));
    }
    for (l, layer) in layers.iter().enumerate() {
        if layer.first_position.checked_add(layer.rows) != Some(position) {
            return Err(format!(
                "layer {l} holds positions {}..{}+{}, not ending at the snapshot's position {position}",
                layer.first_position, layer.first_position, layer.rows
            ));
        }
        let kind = spec.layer_kind(l);
        let needed = match spec.window(kind) {
            None => position,
            Some(w) => position.min(w),
        };
        if layer.rows < needed {
            return Err(format!(
                "layer {l} ({}) holds {} rows, a session at position {position} needs at least {needed}",
                match kind {
                    LayerKind::Sliding => "sliding",
                    LayerKind::Global => "global",
                },
                layer.rows
            ));
        }
    }
    Ok(())
}

/// Saves `snapshot` of `backend` to `path`, atomically (a temporary file beside it, renamed).
/// Returns the number of bytes written.
pub fn save<B: PersistSnapshot + ?Sized>(backend: &B, snapshot: &B::Snapshot, path: &Path) -> Result<u64> {
    save_with_digest(backend, snapshot, path, None)
}

/// [`save`], recording the prefix's [`SnapshotHeader::prompt_digest`].
pub fn save_with_digest<B: PersistSnapshot + ?Sized>(
    backend: &B,
    snapshot: &B::Snapshot,
    path: &Path,
    prompt_digest: Option<&str>,
) -> Result<u64> {
    check_target(path)?;
    let spec = backend.spec().clone();
    let position = backend.snapshot_position(snapshot);
    let ty = backend.cache_type();
    // Layer by layer, each encoded as soon as it is read: the encoded blocks are all held (the
    // header, with their CRC, comes first), the f32 copies one at a time.
    let mut headers = Vec::with_capacity(spec.n_layers);
    let mut crc = crc32fast::Hasher::new();
    let mut blocks: Vec<Vec<u8>> = Vec::with_capacity(2 * spec.n_layers);
    for l in 0..spec.n_layers {
        let layer = backend.snapshot_layer(snapshot, l)?;
        // A sliding layer may hold more rows than any later call reads (a prefill keeps them
        // all): only the window's are written, a third less for Gemma 3 at 843 tokens.
        let layer = match spec.window(spec.layer_kind(l)) {
            Some(w) if layer.rows > position.min(w) => layer.tail_from(position - position.min(w)),
            _ => layer,
        };
        headers.push(LayerHeader {
            first_position: layer.first_position,
            rows: layer.rows,
        });
        for values in [&layer.k, &layer.v] {
            let mut bytes = ty.encode(values);
            bytes.resize(aligned(bytes.len()), 0);
            crc.update(&bytes);
            blocks.push(bytes);
        }
    }
    check_layers(&spec, position, &headers)
        .unwrap_or_else(|reason| crate::error::invariant(&format!("a backend's own snapshot is invalid: {reason}")));
    let (_, data_bytes) =
        data_layout(&spec, ty, &headers).unwrap_or_else(|| crate::error::invariant("a held snapshot's size overflows"));
    let header = SnapshotHeader {
        contract_version: CONTRACT_VERSION,
        model: backend.model_fingerprint()?.to_hex(),
        spec,
        window_rule: rule_name(backend.window_rule()).into(),
        position,
        dtype: dtype_name(ty).into(),
        layers: headers,
        data_bytes: data_bytes as u64,
        data_crc32: crc.finalize(),
        saved_by: backend.name(),
        prompt_digest: prompt_digest.map(String::from),
    };
    let json = serde_json::to_vec(&header).unwrap_or_else(|e| crate::error::invariant(&e.to_string()));
    let data_start = aligned(16 + json.len());

    let tmp = temp_path(path);
    let write = || -> std::io::Result<u64> {
        let mut out = BufWriter::new(File::create(&tmp)?);
        out.write_all(&MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_le_bytes())?;
        out.write_all(&(json.len() as u32).to_le_bytes())?;
        out.write_all(&json)?;
        out.write_all(&vec![0; data_start - 16 - json.len()])?;
        for block in &blocks {
            out.write_all(block)?;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok((data_start + data_bytes) as u64)
    };
    let written = write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err("writing snapshot", &tmp)(e)
    })?;
    // Checked again: the layers took a while, and the rename would replace whatever is there.
    if let Err(e) = check_target(path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err("renaming snapshot into place", path)(e)
    })?;
    Ok(written)
}

/// Refuses `path` as a place to save a snapshot when something other than a regular file is
/// there (following symbolic links): the rename that completes a save would replace it, and a
/// device node or a FIFO replaced by a file is destroyed (`--out /dev/null` as root). A missing
/// path is fine. Callers that do expensive work before saving check first.
pub fn check_target(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(meta) => require_regular("snapshot target", path, &meta),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("checking snapshot target", path)(e)),
    }
}

/// The kind of a file that is not a regular one, for the error.
fn special_kind(meta: &std::fs::Metadata) -> Option<&'static str> {
    let t = meta.file_type();
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some("directory");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some("FIFO");
        }
        if t.is_char_device() {
            return Some("character device");
        }
        if t.is_block_device() {
            return Some("block device");
        }
        if t.is_socket() {
            return Some("socket");
        }
    }
    Some("special file")
}

fn require_regular(what: &'static str, path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    match special_kind(meta) {
        None => Ok(()),
        Some(kind) => Err(Error::NotRegularFile {
            what,
            path: path.display().to_string(),
            kind,
        }),
    }
}

/// Opens a snapshot file for reading, refusing anything but a regular file before opening it:
/// opening a FIFO blocks until a writer comes (`snapshot info FIFO` hung).
fn open_regular(path: &Path) -> Result<File> {
    let what = "snapshot";
    let meta = std::fs::metadata(path).map_err(io_err("opening snapshot", path))?;
    require_regular(what, path, &meta)?;
    let file = File::open(path).map_err(io_err("opening snapshot", path))?;
    // What was opened, in case the path was replaced in between.
    let meta = file.metadata().map_err(io_err("opening snapshot", path))?;
    require_regular(what, path, &meta)?;
    Ok(file)
}

fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp{}", std::process::id()))
}

/// Reads a snapshot file's header (magic, version, JSON) without reading any rows: cheap, but
/// it says nothing of the data; [`verify`] checks the whole file.
pub fn read_header(path: &Path) -> Result<SnapshotHeader> {
    let file = open_regular(path)?;
    // SAFETY: the mapping is read-only and dropped before returning; see the module note on
    // files truncated under a mapping (the length is checked first).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err("mapping snapshot", path))?;
    Ok(parse_header(path, &map)?.0)
}

/// The header and the offset of the data.
fn parse_header(path: &Path, bytes: &[u8]) -> Result<(SnapshotHeader, usize)> {
    if bytes.len() < 16 || bytes[..8] != MAGIC {
        return Err(file_err(path, "not a skainet-kv snapshot file (bad magic)"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_else(|_| unreachable!()));
    if version != FORMAT_VERSION {
        return Err(file_err(
            path,
            format!("format version {version}; this runtime reads version {FORMAT_VERSION}"),
        ));
    }
    let header_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap_or_else(|_| unreachable!())) as usize;
    if header_len > MAX_HEADER || 16 + header_len > bytes.len() {
        return Err(file_err(
            path,
            format!("truncated: a header of {header_len} bytes in a file of {}", bytes.len()),
        ));
    }
    let header: SnapshotHeader = serde_json::from_slice(&bytes[16..16 + header_len])
        .map_err(|e| file_err(path, format!("corrupt header: {e}")))?;
    Ok((header, aligned(16 + header_len)))
}

/// Loads the snapshot file at `path` into a new snapshot of `backend` (restore it to continue).
/// Everything is checked before the backend sees a row; the session is not touched either way.
pub fn load<B: PersistSnapshot + ?Sized>(backend: &B, path: &Path) -> Result<B::Snapshot> {
    if cfg!(target_endian = "big") {
        return Err(file_err(
            path,
            "snapshot files are little-endian; this host is big-endian",
        ));
    }
    let file = open_regular(path)?;
    // SAFETY: read-only; the length is checked against the header before any data is read, and
    // the rows are copied to the backend before the mapping is dropped.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err("mapping snapshot", path))?;
    let (header, data_start) = parse_header(path, &map)?;

    if header.contract_version != CONTRACT_VERSION {
        return Err(file_err(
            path,
            format!(
                "made for contract version {}; this session runs version {CONTRACT_VERSION}",
                header.contract_version
            ),
        ));
    }
    let spec = backend.spec();
    let fingerprint = backend.model_fingerprint()?.to_hex();
    if header.model != fingerprint {
        return Err(file_err(
            path,
            format!(
                "made by another model (fingerprint {}…, this session's model is {}…)",
                &header.model.get(..12).unwrap_or(&header.model),
                &fingerprint[..12]
            ),
        ));
    }
    let rule = rule_name(backend.window_rule());
    if header.window_rule != rule {
        return Err(file_err(
            path,
            format!(
                "made under the `{}` window rule; this session uses `{rule}`",
                header.window_rule
            ),
        ));
    }
    let ty = dtype_of(path, &header)?;
    // The fingerprint covers the geometry, so the header's spec can only disagree if edited.
    check_layers(spec, header.position, &header.layers).map_err(|reason| file_err(path, reason))?;
    let offsets = check_data(path, spec, ty, &header, &map, data_start)?;
    let data = &map[data_start..];
    let release = |offset: usize, len: usize| release_pages(&map, data_start + offset, len);
    let block = |offset: usize, rows: usize| {
        let len = block_bytes(spec, ty, rows).unwrap_or_else(|| crate::error::invariant("checked by data_layout"));
        Block {
            ty,
            bytes: &data[offset..offset + len],
        }
    };
    let mut previous: Option<(usize, usize)> = None;
    let mut rows = header.layers.iter().zip(&offsets).map(|(layer, &(k, v))| {
        // Asked for the next layer: the backend is done with the previous one.
        if let Some((offset, len)) = previous.take() {
            release(offset, len);
        }
        let rows = LayerRows {
            first_position: layer.first_position,
            rows: layer.rows,
            k: block(k, layer.rows),
            v: block(v, layer.rows),
        };
        previous = Some((k, v - k + rows.v.bytes.len()));
        rows
    });
    backend.snapshot_from_layers(header.position, &mut rows)
}

/// Checks a whole snapshot file without a session: the header (its spec within
/// [`crate::limits`], the rows it describes), the length, the CRC-32 and that every value is
/// finite. Returns the header; what `snapshot info` prints. Whether the file suits a session
/// (model, contract, window rule) is [`load`]'s to say.
pub fn verify(path: &Path) -> Result<SnapshotHeader> {
    if cfg!(target_endian = "big") {
        return Err(file_err(
            path,
            "snapshot files are little-endian; this host is big-endian",
        ));
    }
    let file = open_regular(path)?;
    // SAFETY: as in `load`: read-only, the length checked before any data is read.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err("mapping snapshot", path))?;
    let (header, data_start) = parse_header(path, &map)?;
    header
        .spec
        .validate()
        .map_err(|e| file_err(path, format!("corrupt header: {e}")))?;
    let ty = dtype_of(path, &header)?;
    check_layers(&header.spec, header.position, &header.layers).map_err(|reason| file_err(path, reason))?;
    check_data(path, &header.spec, ty, &header, &map, data_start)?;
    Ok(header)
}

fn dtype_of(path: &Path, header: &SnapshotHeader) -> Result<CacheType> {
    match header.dtype.as_str() {
        "f32" => Ok(CacheType::F32),
        "f16" => Ok(CacheType::F16),
        other => Err(file_err(
            path,
            format!("dtype `{other}`; this runtime reads f32 and f16"),
        )),
    }
}

/// Drops the pages of `map[offset..offset + len]` from the process once read.
fn release_pages(map: &memmap2::Mmap, offset: usize, len: usize) {
    // SAFETY: a read-only private file mapping: dropped pages are read again from the file
    // when touched (memmap2 widens the range to whole pages, which may reach into a
    // neighbour: it is read again too). Failing only costs the memory.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
}

/// Checks the data of a file whose header parsed and whose layers suit `spec`: the declared and
/// actual lengths, the CRC-32, and that every K and V value is finite. Returns each layer's K
/// and V offsets from the start of the data.
fn check_data(
    path: &Path,
    spec: &KvSpec,
    ty: CacheType,
    header: &SnapshotHeader,
    map: &memmap2::Mmap,
    data_start: usize,
) -> Result<Vec<(usize, usize)>> {
    let (offsets, data_bytes) =
        data_layout(spec, ty, &header.layers).ok_or_else(|| file_err(path, "layer sizes overflow"))?;
    if header.data_bytes != data_bytes as u64 {
        return Err(file_err(
            path,
            format!(
                "corrupt header: {} data bytes declared, the layers need {data_bytes}",
                header.data_bytes
            ),
        ));
    }
    let expected = data_start
        .checked_add(data_bytes)
        .ok_or_else(|| file_err(path, "layer sizes overflow"))?;
    if map.len() != expected {
        return Err(file_err(
            path,
            format!(
                "{} bytes, the header describes {expected}: {}",
                map.len(),
                if map.len() < expected {
                    "truncated"
                } else {
                    "trailing bytes"
                }
            ),
        ));
    }
    let data = &map[data_start..];
    // One pass over the data for the CRC and the values, a block (K or V of a layer, padded) at
    // a time, each block's pages leaving the process once read: a load holds no more of the
    // file than one layer (a whole mapping counted 20 MB of Gemma 3 270M's bench peak RSS).
    // Blocks follow each other from offset 0 to `data_bytes`, so their CRC is the data's.
    let mut crc = crc32fast::Hasher::new();
    let mut bad: Option<Error> = None;
    for (l, (layer, &(k, v))) in header.layers.iter().zip(&offsets).enumerate() {
        let len =
            block_bytes(spec, ty, layer.rows).unwrap_or_else(|| crate::error::invariant("checked by data_layout"));
        for (tensor, offset) in [("K", k), ("V", v)] {
            let padded = aligned(len);
            crc.update(&data[offset..offset + padded]);
            if bad.is_none() {
                if let Some(i) = first_non_finite(ty, &data[offset..offset + len]) {
                    let row_len = spec.head_dim;
                    let value = ty.decode(&data[offset + i * ty.size()..offset + (i + 1) * ty.size()])[0];
                    bad = Some(Error::NonFiniteSnapshot {
                        path: path.display().to_string(),
                        layer: l,
                        tensor,
                        position: layer.first_position + (i / row_len) % layer.rows,
                        head: i / (row_len * layer.rows),
                        value,
                    });
                }
            }
            release_pages(map, data_start + offset, padded);
        }
    }
    if crc.finalize() != header.data_crc32 {
        return Err(file_err(path, "corrupt: the data's CRC-32 does not match the header"));
    }
    match bad {
        Some(e) => Err(e),
        None => Ok(offsets),
    }
}

/// The index of the first element of `bytes` (LE elements of `ty`) that is NaN or infinite:
/// the check every load makes of every value (public so that its cost can be timed on its own,
/// `examples/snapshot_check_cost.rs`).
pub fn first_non_finite(ty: CacheType, bytes: &[u8]) -> Option<usize> {
    // All exponent bits set is NaN or infinity in both types. Whole groups are tested without
    // branching (the common case: none), the element found only in a group that has one.
    const GROUP: usize = 64;
    fn find<const N: usize>(bytes: &[u8], bad: impl Fn([u8; N]) -> bool) -> Option<usize> {
        let element = |b: &[u8]| -> [u8; N] { b.try_into().unwrap_or_else(|_| unreachable!()) };
        for (g, group) in bytes.chunks(GROUP * N).enumerate() {
            if group.chunks_exact(N).fold(false, |any, b| any | bad(element(b))) {
                let i = group.chunks_exact(N).position(|b| bad(element(b)))?;
                return Some(g * GROUP + i);
            }
        }
        None
    }
    match ty {
        CacheType::F32 => find::<4>(bytes, |b| u32::from_le_bytes(b) & 0x7f80_0000 == 0x7f80_0000),
        CacheType::F16 => find::<2>(bytes, |b| u16::from_le_bytes(b) & 0x7c00 == 0x7c00),
    }
}
