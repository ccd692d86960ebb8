//! IREE parameter archives (`.irpa`): a zero-copy reader and a byte-exact writer.
//!
//! The format is IREE's `runtime/src/iree/schemas/parameter_archive.h` (little-endian, packed):
//!
//! * an 88-byte header: magic `IRPA`, version `u16` major / minor (0.0), header size, next header
//!   offset (linked archives), flags, entry count, then `{offset, length}` pairs of the entry,
//!   metadata and storage segments, all relative to the header;
//! * the entry table: 16-byte aligned variable-size entries sharing a 60-byte header (entry size,
//!   `u32` type, flags, name and metadata references into the metadata segment, minimum
//!   alignment); splat entries add a length, a 16-byte pattern and its length (85 bytes), data
//!   entries a storage reference relative to the storage segment (76 bytes), external entries a
//!   path reference and an absolute range in another file (92 bytes);
//! * the metadata segment (names carry no NUL) and the storage segment.
//!
//! [`IrpaArchive`] maps the file and validates every offset and length with checked arithmetic
//! when it opens it: a truncated or corrupt archive is an [`IrpaError`], never a panic or a read
//! outside the file. [`IrpaWriter`] writes exactly what IREE's own builder
//! (`iree_io_build_parameter_archive`, used by `iree.runtime.save_archive_file`) writes for the
//! same entries: entries 16-byte aligned, data 64-byte aligned, the file padded to 4096 bytes.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;

/// `IRPA` read as a little-endian `u32`.
pub const MAGIC: u32 = 0x4150_5249;
/// Size of the v0 header (`iree_io_parameter_archive_header_v0_t`).
pub const HEADER_SIZE: u64 = 88;
/// Alignment of each entry in the entry table.
pub const ENTRY_ALIGNMENT: u64 = 16;
/// Alignment of data entries in the storage segment (IREE's default).
pub const DATA_ALIGNMENT: u64 = 64;
/// The whole file is padded to a multiple of this.
pub const FILE_ALIGNMENT: u64 = 4096;
/// Longest splat pattern.
pub const MAX_SPLAT_PATTERN: usize = 16;

const PREFIX_SIZE: u64 = 32;
const ENTRY_HEADER_SIZE: u64 = 60;
const SPLAT_ENTRY_SIZE: u64 = 85;
const DATA_ENTRY_SIZE: u64 = 76;
const EXTERNAL_ENTRY_SIZE: u64 = 92;

const TYPE_SKIP: u32 = 0;
const TYPE_SPLAT: u32 = 1;
const TYPE_DATA: u32 = 2;
const TYPE_EXTERNAL: u32 = 3;

/// Everything that can go wrong reading or writing an archive.
#[derive(Debug, thiserror::Error)]
pub enum IrpaError {
    /// A file system operation failed.
    #[error("irpa: cannot {op} `{}`: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A structure runs past the end of the archive.
    #[error(
        "irpa: truncated archive: {what} at offset {offset} needs {needed} bytes but the archive \
         is {len} bytes"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    /// The header at `offset` does not start with `IRPA`.
    #[error("irpa: bad magic {found:#010x} at offset {offset} (expected {MAGIC:#010x}, `IRPA`)")]
    BadMagic { offset: u64, found: u32 },
    /// The file changed since it was opened (truncated, rewritten in place, or replaced at its
    /// path): reading its mapping could raise SIGBUS or give other weights than the session's.
    #[error(
        "irpa: `{}` changed since it was opened ({detail}); archives are memory-mapped: never \
         modify one in place while a session uses it; replace it by renaming and open a new session",
        path.display()
    )]
    Changed { path: PathBuf, detail: String },
    /// A header version this reader does not understand (only 0.0 exists).
    #[error("irpa: unsupported archive version {major}.{minor} at offset {offset} (supported: 0.0)")]
    UnsupportedVersion { offset: u64, major: u16, minor: u16 },
    /// A structurally invalid field.
    #[error("irpa: corrupt {what}: {detail}")]
    Corrupt { what: String, detail: String },
    /// No (live) entry has this name.
    #[error("irpa: no entry named {name:?} (the archive has {available_count} entries)")]
    MissingEntry { name: String, available_count: usize },
    /// The entry exists but its bytes are not stored in this archive (splat or external).
    #[error("irpa: entry {name:?} is a {kind} entry, its bytes are not stored in this archive")]
    NotStored { name: String, kind: &'static str },
    /// The writer was given two entries with the same name.
    #[error("irpa writer: duplicate entry name {name:?}")]
    DuplicateEntry { name: String },
    /// The writer was given an invalid entry.
    #[error("irpa writer: invalid entry {name:?}: {detail}")]
    InvalidEntry { name: String, detail: String },
}

/// How an entry's bytes are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IrpaEntryKind {
    /// An erased entry; ignored by IREE (and by [`IrpaArchive::get`]).
    Skip,
    /// `length` bytes filled by repeating `pattern` (1..=16 bytes, little-endian).
    Splat { pattern: Vec<u8>, length: u64 },
    /// `length` bytes at absolute `offset` in the archive file (`offset` is 0 when `length` is).
    Data { offset: u64, length: u64 },
    /// `length` bytes at absolute `offset` in another file. Not supported by IREE's parser;
    /// reported here, but [`IrpaArchive::data`] refuses it.
    External { path: String, offset: u64, length: u64 },
}

impl IrpaEntryKind {
    /// `"skip"`, `"splat"`, `"data"` or `"external"`.
    pub fn label(&self) -> &'static str {
        match self {
            IrpaEntryKind::Skip => "skip",
            IrpaEntryKind::Splat { .. } => "splat",
            IrpaEntryKind::Data { .. } => "data",
            IrpaEntryKind::External { .. } => "external",
        }
    }
}

/// One entry of the entry table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IrpaEntry {
    name: String,
    kind: IrpaEntryKind,
    metadata: Vec<u8>,
    flags: u64,
    minimum_alignment: u64,
    table_offset: u64,
}

impl IrpaEntry {
    /// The entry's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// How the bytes are stored.
    pub fn kind(&self) -> &IrpaEntryKind {
        &self.kind
    }
    /// Logical length in bytes (0 for skip entries).
    pub fn len(&self) -> u64 {
        match &self.kind {
            IrpaEntryKind::Skip => 0,
            IrpaEntryKind::Splat { length, .. }
            | IrpaEntryKind::Data { length, .. }
            | IrpaEntryKind::External { length, .. } => *length,
        }
    }
    /// Whether the logical length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The metadata blob (empty when absent). IREE's Python API stores `TENSORv0:{json}` here
    /// when given numpy arrays through `parameter_index_add_numpy_ndarray`.
    pub fn metadata(&self) -> &[u8] {
        &self.metadata
    }
    /// The entry flags (reserved, 0 in every archive IREE writes).
    pub fn flags(&self) -> u64 {
        self.flags
    }
    /// Minimum alignment the entry asks for (64 for data entries IREE writes, 0 for splats).
    pub fn minimum_alignment(&self) -> u64 {
        self.minimum_alignment
    }
    /// Absolute offset of the entry's header in the entry table.
    pub fn table_offset(&self) -> u64 {
        self.table_offset
    }
}

enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed `.irpa` archive. The bytes are memory-mapped (or owned, for [`Self::from_bytes`]);
/// [`Self::data`] borrows from them without copying.
///
/// **The file must not change while the archive is open.** Reading the mapping of a file that
/// was truncated raises SIGBUS, which kills the process; a file rewritten in place changes the
/// bytes under the borrow. Replace archives by renaming a new file over the old one (as
/// [`IrpaWriter::write`] does), then open them again. [`Self::check_unchanged`] detects the usual
/// violations (length, mtime, device and inode differ from those at open) before a read; it
/// cannot close the window between that check and the read.
pub struct IrpaArchive {
    path: Option<PathBuf>,
    stamp: Option<FileStamp>,
    backing: Backing,
    entries: Vec<IrpaEntry>,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for IrpaArchive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IrpaArchive")
            .field("path", &self.path)
            .field("file_len", &self.file_len())
            .field("entries", &self.entries)
            .finish()
    }
}

impl IrpaArchive {
    /// Maps and parses the archive at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, IrpaError> {
        let path = path.as_ref();
        let io_err = |op: &'static str| {
            move |source| IrpaError::Io {
                op,
                path: path.to_path_buf(),
                source,
            }
        };
        let file = File::open(path).map_err(io_err("open"))?;
        let stamp = FileStamp::of_file(file, path).map_err(io_err("stat"))?;
        let backing = if stamp.identity.len == 0 {
            // Mapping an empty file is not portable; an empty archive is truncated anyway.
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only; as documented on the type, the file must not be
            // modified while the archive is open.
            Backing::Mmap(unsafe { Mmap::map(&stamp.file) }.map_err(io_err("memory-map"))?)
        };
        Self::parse(Some(path.to_path_buf()), Some(stamp), backing)
    }

    /// Parses an archive held in memory (no path).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, IrpaError> {
        Self::parse(None, None, Backing::Owned(bytes))
    }

    /// Errs when the file no longer is the one this archive mapped (see the type's notes);
    /// always `Ok` for [`Self::from_bytes`]. Two `stat` calls: cheap enough before every read
    /// of a session's embedding rows.
    pub fn check_unchanged(&self) -> Result<(), IrpaError> {
        match &self.stamp {
            Some(stamp) => stamp.check(),
            None => Ok(()),
        }
    }

    fn parse(path: Option<PathBuf>, stamp: Option<FileStamp>, backing: Backing) -> Result<Self, IrpaError> {
        let entries = parse_entries(backing.bytes())?;
        let mut by_name = HashMap::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            if e.kind == IrpaEntryKind::Skip {
                continue;
            }
            if let Some(&first) = by_name.get(&e.name) {
                let first: &IrpaEntry = &entries[first];
                return Err(IrpaError::Corrupt {
                    what: format!("entry table (entry at offset {})", e.table_offset),
                    detail: format!(
                        "duplicate entry name {:?} (first at offset {})",
                        e.name, first.table_offset
                    ),
                });
            }
            by_name.insert(e.name.clone(), i);
        }
        Ok(IrpaArchive {
            path,
            stamp,
            backing,
            entries,
            by_name,
        })
    }

    /// The file this archive was opened from (`None` for [`Self::from_bytes`]).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Size of the whole archive in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// The whole archive.
    pub fn as_bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Every entry in table order (linked headers in chain order), skip entries included.
    pub fn entries(&self) -> &[IrpaEntry] {
        &self.entries
    }

    /// The live (non-skip) entry named `name`.
    pub fn get(&self, name: &str) -> Option<&IrpaEntry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }

    /// Number of live (non-skip) entries.
    pub fn live_count(&self) -> usize {
        self.by_name.len()
    }

    /// The stored bytes of entry `name`, borrowed from the archive.
    pub fn data(&self, name: &str) -> Result<&[u8], IrpaError> {
        let entry = self.get(name).ok_or_else(|| IrpaError::MissingEntry {
            name: name.to_owned(),
            available_count: self.live_count(),
        })?;
        self.entry_data(entry)
    }

    /// Copies `buf.len()` bytes of entry `name`, from `offset` within it, into `buf`. From a file,
    /// a positioned read (`pread`) rather than through the mapping: reading scattered rows
    /// (embedding lookups) through the mapping leaves every page they touched, and the pages
    /// the kernel faults in around them, in the process's resident set; page-cache reads do not.
    pub fn read_into(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<(), IrpaError> {
        let data = self.data(name)?;
        let what = || format!("{} bytes at {offset} of entry {name:?}", buf.len());
        let range = checked_slice(data, offset, buf.len() as u64, what)?;
        #[cfg(unix)]
        if let (Some(stamp), Backing::Mmap(map)) = (&self.stamp, &self.backing) {
            use std::os::unix::fs::FileExt;
            // The entry's position in the file is its position in the mapping.
            let at = range.as_ptr() as u64 - map.as_ptr() as u64;
            return stamp.file.read_exact_at(buf, at).map_err(|source| IrpaError::Io {
                op: "read",
                path: stamp.path.clone(),
                source,
            });
        }
        buf.copy_from_slice(range);
        Ok(())
    }

    /// The stored bytes of `entry` (one of [`Self::entries`]), borrowed from the archive.
    pub fn entry_data(&self, entry: &IrpaEntry) -> Result<&[u8], IrpaError> {
        match entry.kind {
            IrpaEntryKind::Data { offset, length } => {
                let what = || format!("data of entry {:?}", entry.name);
                checked_slice(self.backing.bytes(), offset, length, what)
            }
            ref other => Err(IrpaError::NotStored {
                name: entry.name.clone(),
                kind: other.label(),
            }),
        }
    }

    /// Live entries whose logical length is `len` bytes, in table order (callers that locate a
    /// tensor by size must refuse more than one match).
    pub fn find_by_size(&self, len: u64) -> Vec<&IrpaEntry> {
        self.entries
            .iter()
            .filter(|e| e.kind != IrpaEntryKind::Skip && e.len() == len)
            .collect()
    }
}

/// A file as it was when opened: its length, mtime and (on Unix) device and inode, with the file
/// kept open so that a replaced path does not hide changes to the file still mapped.
#[derive(Debug)]
pub struct FileStamp {
    path: PathBuf,
    file: File,
    identity: Identity,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    len: u64,
    modified: Option<std::time::SystemTime>,
    /// Device and inode (0, 0 where the platform has none).
    id: (u64, u64),
}

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        let id = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let id = (0, 0);
        Identity {
            len: meta.len(),
            modified: meta.modified().ok(),
            id,
        }
    }
}

impl FileStamp {
    /// Opens `path` and records what it is now.
    pub fn open(path: &Path) -> Result<Self, IrpaError> {
        let io_err = |op| {
            move |source| IrpaError::Io {
                op,
                path: path.to_path_buf(),
                source,
            }
        };
        let file = File::open(path).map_err(io_err("open"))?;
        Self::of_file(file, path).map_err(io_err("stat"))
    }

    fn of_file(file: File, path: &Path) -> io::Result<Self> {
        let identity = Identity::of(&file.metadata()?);
        Ok(FileStamp {
            path: path.to_path_buf(),
            file,
            identity,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Errs when the open file changed length or mtime (truncated or rewritten in place), or
    /// the path now names another file (replaced). A path that no longer exists is fine: the
    /// open file, which is what is mapped, is checked.
    pub fn check(&self) -> Result<(), IrpaError> {
        let changed = |detail: String| IrpaError::Changed {
            path: self.path.clone(),
            detail,
        };
        let io_err = |source| IrpaError::Io {
            op: "stat",
            path: self.path.clone(),
            source,
        };
        let was = self.identity;
        let now = Identity::of(&self.file.metadata().map_err(io_err)?);
        if now.len != was.len {
            return Err(changed(format!("{} bytes at open, {} now", was.len, now.len)));
        }
        if now.modified != was.modified {
            return Err(changed("modified in place".into()));
        }
        match std::fs::metadata(&self.path) {
            Ok(meta) if Identity::of(&meta).id != was.id => {
                Err(changed("replaced: the path now names another file".into()))
            }
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing

fn checked_slice(buf: &[u8], offset: u64, needed: u64, what: impl FnOnce() -> String) -> Result<&[u8], IrpaError> {
    let len = buf.len() as u64;
    match offset.checked_add(needed) {
        Some(end) if end <= len => Ok(&buf[offset as usize..end as usize]),
        _ => Err(IrpaError::Truncated {
            what: what(),
            offset,
            needed,
            len,
        }),
    }
}

/// Little-endian field reader over one fixed-size structure that was bounds-checked as a whole.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes(self.0[at..at + 2].try_into().expect("2 bytes"))
    }
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.0[at..at + 4].try_into().expect("4 bytes"))
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().expect("8 bytes"))
    }
    fn range(&self, at: usize) -> Range {
        Range {
            offset: self.u64(at),
            length: self.u64(at + 8),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Range {
    offset: u64,
    length: u64,
}

fn overflow(what: String, detail: impl Into<String>) -> IrpaError {
    IrpaError::Corrupt {
        what,
        detail: detail.into(),
    }
}

fn align_up(value: u64, alignment: u64) -> Option<u64> {
    debug_assert!(alignment.is_power_of_two());
    value.checked_add(alignment - 1).map(|v| v & !(alignment - 1))
}

struct HeaderV0 {
    base: u64,
    entry_count: u64,
    entries: Range,
    metadata: Range,
    storage: Range,
}

impl HeaderV0 {
    /// Resolves a reference into the metadata segment to absolute bytes.
    fn metadata_bytes<'a>(&self, buf: &'a [u8], r: Range, what: impl Fn() -> String) -> Result<&'a [u8], IrpaError> {
        if r.length == 0 {
            return Ok(&[]);
        }
        match r.offset.checked_add(r.length) {
            Some(end) if end <= self.metadata.length => {}
            _ => {
                return Err(IrpaError::Corrupt {
                    what: what(),
                    detail: format!(
                        "metadata reference {}+{} outside the {}-byte metadata segment",
                        r.offset, r.length, self.metadata.length
                    ),
                })
            }
        }
        let abs = self
            .base
            .checked_add(self.metadata.offset)
            .and_then(|v| v.checked_add(r.offset))
            .ok_or_else(|| overflow(what(), "metadata offset overflows"))?;
        checked_slice(buf, abs, r.length, what)
    }

    /// Resolves a storage reference to an absolute (offset, length) inside the file.
    fn storage_range(&self, buf: &[u8], r: Range, what: impl Fn() -> String) -> Result<(u64, u64), IrpaError> {
        if r.length == 0 {
            return Ok((0, 0));
        }
        match r.offset.checked_add(r.length) {
            Some(end) if end <= self.storage.length => {}
            _ => {
                return Err(IrpaError::Corrupt {
                    what: what(),
                    detail: format!(
                        "storage reference {}+{} outside the {}-byte storage segment",
                        r.offset, r.length, self.storage.length
                    ),
                })
            }
        }
        let abs = self
            .base
            .checked_add(self.storage.offset)
            .and_then(|v| v.checked_add(r.offset))
            .ok_or_else(|| overflow(what(), "storage offset overflows"))?;
        // Redundant with the segment check, but cheap: the slice is known to be in the file.
        checked_slice(buf, abs, r.length, what)?;
        Ok((abs, r.length))
    }
}

fn parse_header(buf: &[u8], base: u64) -> Result<(HeaderV0, u64), IrpaError> {
    let file_len = buf.len() as u64;
    let prefix = Fields(checked_slice(buf, base, PREFIX_SIZE, || {
        "archive header prefix".to_owned()
    })?);
    let magic = prefix.u32(0);
    if magic != MAGIC {
        return Err(IrpaError::BadMagic {
            offset: base,
            found: magic,
        });
    }
    let (major, minor) = (prefix.u16(4), prefix.u16(6));
    if major != 0 || minor != 0 {
        return Err(IrpaError::UnsupportedVersion {
            offset: base,
            major,
            minor,
        });
    }
    let header_size = prefix.u64(8);
    if header_size != HEADER_SIZE {
        return Err(IrpaError::Corrupt {
            what: format!("archive header at offset {base}"),
            detail: format!("v0 header size is {header_size}, expected {HEADER_SIZE}"),
        });
    }
    let next_header_offset = prefix.u64(16);
    let h = Fields(checked_slice(buf, base, HEADER_SIZE, || "archive header".to_owned())?);
    let header = HeaderV0 {
        base,
        entry_count: h.u64(32),
        entries: h.range(40),
        metadata: h.range(56),
        storage: h.range(72),
    };
    for (name, seg) in [
        ("entry segment", header.entries),
        ("metadata segment", header.metadata),
        ("storage segment", header.storage),
    ] {
        if seg.length == 0 {
            continue;
        }
        let start = base
            .checked_add(seg.offset)
            .ok_or_else(|| overflow(name.to_owned(), "offset overflows"))?;
        checked_slice(buf, start, seg.length, || name.to_owned())?;
    }
    // Every entry needs at least a common header; this also bounds the entry vector.
    if header.entry_count > header.entries.length / ENTRY_HEADER_SIZE {
        return Err(IrpaError::Corrupt {
            what: format!("archive header at offset {base}"),
            detail: format!(
                "{} entries cannot fit in a {}-byte entry segment",
                header.entry_count, header.entries.length
            ),
        });
    }
    let next = if next_header_offset == 0 {
        0
    } else {
        let next = base
            .checked_add(next_header_offset)
            .ok_or_else(|| overflow("next header offset".to_owned(), "overflows"))?;
        if next >= file_len {
            return Err(IrpaError::Truncated {
                what: "linked archive header".to_owned(),
                offset: next,
                needed: PREFIX_SIZE,
                len: file_len,
            });
        }
        next
    };
    Ok((header, next))
}

fn parse_entries(buf: &[u8]) -> Result<Vec<IrpaEntry>, IrpaError> {
    let mut entries = Vec::new();
    let mut base = 0u64;
    loop {
        let (header, next) = parse_header(buf, base)?;
        parse_entry_table(buf, &header, &mut entries)?;
        if next == 0 {
            return Ok(entries);
        }
        // `next > base` always (offsets are unsigned and non-zero), so this terminates.
        base = next;
    }
}

fn parse_entry_table(buf: &[u8], header: &HeaderV0, out: &mut Vec<IrpaEntry>) -> Result<(), IrpaError> {
    let mut offset = header
        .base
        .checked_add(header.entries.offset)
        .ok_or_else(|| overflow("entry segment".to_owned(), "offset overflows"))?;
    let mut remaining = header.entries.length;
    out.reserve(header.entry_count as usize);
    for index in 0..header.entry_count {
        let at = offset;
        let what = move || format!("entry #{index} at offset {at}");
        if remaining < ENTRY_HEADER_SIZE {
            return Err(IrpaError::Corrupt {
                what: what(),
                detail: format!("entry table has only {remaining} bytes left for a 60-byte header"),
            });
        }
        let common = Fields(checked_slice(buf, offset, ENTRY_HEADER_SIZE, what)?);
        let entry_size = common.u64(0);
        let ty = common.u32(8);
        let flags = common.u64(12);
        let name_ref = common.range(20);
        let meta_ref = common.range(36);
        let minimum_alignment = common.u64(52);
        if entry_size < ENTRY_HEADER_SIZE || entry_size > remaining {
            return Err(IrpaError::Corrupt {
                what: what(),
                detail: format!(
                    "entry size {entry_size} outside [{ENTRY_HEADER_SIZE}, {remaining}] (bytes \
                     left in the entry table)"
                ),
            });
        }
        let entry = Fields(checked_slice(buf, offset, entry_size, what)?);

        let name_bytes = header.metadata_bytes(buf, name_ref, || format!("name of {}", what()))?;
        let name = std::str::from_utf8(name_bytes)
            .map_err(|e| IrpaError::Corrupt {
                what: format!("name of {}", what()),
                detail: format!("not UTF-8: {e}"),
            })?
            .to_owned();
        let what_named = || format!("entry #{index} {name:?} at offset {at}");
        let metadata = header
            .metadata_bytes(buf, meta_ref, || format!("metadata of {}", what_named()))?
            .to_vec();
        let need = |size: u64, label: &str| {
            if entry_size < size {
                Err(IrpaError::Corrupt {
                    what: what_named(),
                    detail: format!("{label} entry needs {size} bytes, entry size is {entry_size}"),
                })
            } else {
                Ok(())
            }
        };
        let kind = match ty {
            TYPE_SKIP => IrpaEntryKind::Skip,
            TYPE_SPLAT => {
                need(SPLAT_ENTRY_SIZE, "splat")?;
                let length = entry.u64(60);
                let pattern_length = entry.0[84] as usize;
                if pattern_length > MAX_SPLAT_PATTERN || (pattern_length == 0 && length != 0) {
                    return Err(IrpaError::Corrupt {
                        what: what_named(),
                        detail: format!("splat pattern length {pattern_length} (must be 1..=16)"),
                    });
                }
                IrpaEntryKind::Splat {
                    pattern: entry.0[68..68 + pattern_length].to_vec(),
                    length,
                }
            }
            TYPE_DATA => {
                need(DATA_ENTRY_SIZE, "data")?;
                let (offset, length) =
                    header.storage_range(buf, entry.range(60), || format!("storage of {}", what_named()))?;
                IrpaEntryKind::Data { offset, length }
            }
            TYPE_EXTERNAL => {
                need(EXTERNAL_ENTRY_SIZE, "external")?;
                let path =
                    header.metadata_bytes(buf, entry.range(60), || format!("external path of {}", what_named()))?;
                let path = String::from_utf8_lossy(path).into_owned();
                let range = entry.range(76);
                IrpaEntryKind::External {
                    path,
                    offset: range.offset,
                    length: range.length,
                }
            }
            other => {
                return Err(IrpaError::Corrupt {
                    what: what_named(),
                    detail: format!("unknown entry type {other}"),
                })
            }
        };
        out.push(IrpaEntry {
            name,
            kind,
            metadata,
            flags,
            minimum_alignment,
            table_offset: at,
        });

        let step = align_up(entry_size, ENTRY_ALIGNMENT).ok_or_else(|| overflow(what(), "entry size overflows"))?;
        offset = offset
            .checked_add(step)
            .ok_or_else(|| overflow(what(), "entry offset overflows"))?;
        // The last entry need not be padded to the alignment.
        remaining = remaining.saturating_sub(step);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writing

#[derive(Debug, Clone)]
enum Pending {
    Data(Vec<u8>),
    Splat {
        pattern: [u8; MAX_SPLAT_PATTERN],
        pattern_length: u8,
        length: u64,
    },
}

#[derive(Debug, Clone)]
struct PendingEntry {
    name: String,
    metadata: Vec<u8>,
    body: Pending,
}

/// Builds an archive byte for byte like IREE's `iree_io_build_parameter_archive` (what
/// `iree.runtime.save_archive_file` and `ParameterIndex.create_archive_file` call), entries in
/// insertion order.
#[derive(Debug, Clone, Default)]
pub struct IrpaWriter {
    entries: Vec<PendingEntry>,
    names: HashSet<String>,
}

/// Computed placement of every structure, relative to the start of the file.
struct Layout {
    /// Header, entry table and metadata segment, zero-padded up to the storage segment.
    prefix: Vec<u8>,
    storage_offset: u64,
    /// Offset of each data entry in the storage segment (`None` for splats).
    data_offsets: Vec<Option<u64>>,
    total: u64,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl IrpaWriter {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of entries added.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn push(&mut self, name: String, metadata: Vec<u8>, body: Pending) -> Result<&mut Self, IrpaError> {
        if self.names.contains(&name) {
            return Err(IrpaError::DuplicateEntry { name });
        }
        self.names.insert(name.clone());
        self.entries.push(PendingEntry { name, metadata, body });
        Ok(self)
    }

    /// Adds a data entry holding `bytes` (no metadata, like `save_archive_file`).
    pub fn add_data(&mut self, name: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Result<&mut Self, IrpaError> {
        self.push(name.into(), Vec::new(), Pending::Data(bytes.into()))
    }

    /// Adds a data entry with a metadata blob (like `ParameterIndex.add_buffer(..., metadata=)`).
    pub fn add_data_with_metadata(
        &mut self,
        name: impl Into<String>,
        bytes: impl Into<Vec<u8>>,
        metadata: impl Into<Vec<u8>>,
    ) -> Result<&mut Self, IrpaError> {
        self.push(name.into(), metadata.into(), Pending::Data(bytes.into()))
    }

    /// Adds little-endian f32 values.
    pub fn add_f32(&mut self, name: impl Into<String>, values: &[f32]) -> Result<&mut Self, IrpaError> {
        self.add_data(name, crate::bf16::f32_to_bytes(values))
    }

    /// Adds f32 values rounded to bf16 (nearest, ties to even), little-endian.
    pub fn add_bf16_from_f32(&mut self, name: impl Into<String>, values: &[f32]) -> Result<&mut Self, IrpaError> {
        self.add_data(name, crate::bf16::f32_to_bf16_bytes(values))
    }

    /// Adds a splat entry: `length` bytes repeating `pattern` (1, 2, 4, 8 or 16 bytes).
    pub fn add_splat(&mut self, name: impl Into<String>, pattern: &[u8], length: u64) -> Result<&mut Self, IrpaError> {
        self.add_splat_with_metadata(name, pattern, length, Vec::new())
    }

    /// [`Self::add_splat`] with a metadata blob.
    pub fn add_splat_with_metadata(
        &mut self,
        name: impl Into<String>,
        pattern: &[u8],
        length: u64,
        metadata: impl Into<Vec<u8>>,
    ) -> Result<&mut Self, IrpaError> {
        let name = name.into();
        if !(pattern.len().is_power_of_two() && pattern.len() <= MAX_SPLAT_PATTERN) {
            return Err(IrpaError::InvalidEntry {
                name,
                detail: format!(
                    "splat pattern length {} invalid; must be 1, 2, 4, 8 or 16 bytes",
                    pattern.len()
                ),
            });
        }
        let mut p = [0u8; MAX_SPLAT_PATTERN];
        p[..pattern.len()].copy_from_slice(pattern);
        let body = Pending::Splat {
            pattern: p,
            pattern_length: pattern.len() as u8,
            length,
        };
        self.push(name, metadata.into(), body)
    }

    fn layout(&self) -> Layout {
        // Sizes, exactly as iree_io_parameter_archive_builder_add_*_entry accumulates them.
        let mut entry_segment_size = 0u64;
        let mut metadata_segment_size = 0u64;
        let mut storage_segment_size = 0u64;
        let mut storage_alignment = 0u64;
        let mut data_offsets = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let size = match e.body {
                Pending::Splat { .. } => SPLAT_ENTRY_SIZE,
                Pending::Data(_) => DATA_ENTRY_SIZE,
            };
            entry_segment_size = align_up(entry_segment_size, ENTRY_ALIGNMENT).expect("size") + size;
            metadata_segment_size += (e.name.len() + e.metadata.len()) as u64;
            match &e.body {
                Pending::Splat { .. } => data_offsets.push(None),
                Pending::Data(bytes) => {
                    let off = align_up(storage_segment_size, DATA_ALIGNMENT).expect("size");
                    storage_segment_size = off + bytes.len() as u64;
                    data_offsets.push(Some(off));
                    if storage_alignment == 0 {
                        // The first data entry sets the base alignment.
                        storage_alignment = DATA_ALIGNMENT;
                    }
                }
            }
        }
        let storage_alignment = storage_alignment.max(1);
        let entry_segment = Range {
            offset: align_up(HEADER_SIZE, ENTRY_ALIGNMENT).expect("const"),
            length: entry_segment_size,
        };
        let metadata_segment = Range {
            offset: entry_segment.offset + entry_segment.length,
            length: metadata_segment_size,
        };
        let storage_segment = Range {
            offset: align_up(metadata_segment.offset + metadata_segment.length, storage_alignment).expect("size"),
            length: storage_segment_size,
        };
        let total = align_up(storage_segment.offset + storage_segment.length, FILE_ALIGNMENT).expect("size");

        let mut p = Vec::with_capacity(storage_segment.offset as usize);
        let put_range = |p: &mut Vec<u8>, r: Range| {
            p.extend_from_slice(&r.offset.to_le_bytes());
            p.extend_from_slice(&r.length.to_le_bytes());
        };
        p.extend_from_slice(&MAGIC.to_le_bytes());
        p.extend_from_slice(&0u16.to_le_bytes());
        p.extend_from_slice(&0u16.to_le_bytes());
        p.extend_from_slice(&HEADER_SIZE.to_le_bytes());
        p.extend_from_slice(&0u64.to_le_bytes()); // next header
        p.extend_from_slice(&0u64.to_le_bytes()); // flags
        p.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        put_range(&mut p, entry_segment);
        put_range(&mut p, metadata_segment);
        put_range(&mut p, storage_segment);
        debug_assert_eq!(p.len() as u64, HEADER_SIZE);
        p.resize(entry_segment.offset as usize, 0);

        let mut metadata_offset = 0u64;
        for (e, data_offset) in self.entries.iter().zip(&data_offsets) {
            p.resize(align_up(p.len() as u64, ENTRY_ALIGNMENT).expect("size") as usize, 0);
            let name_ref = Range {
                offset: metadata_offset,
                length: e.name.len() as u64,
            };
            metadata_offset += name_ref.length;
            let meta_ref = Range {
                offset: if e.metadata.is_empty() { 0 } else { metadata_offset },
                length: e.metadata.len() as u64,
            };
            metadata_offset += meta_ref.length;
            let (size, ty, min_align) = match e.body {
                Pending::Splat { .. } => (SPLAT_ENTRY_SIZE, TYPE_SPLAT, 0u64),
                Pending::Data(_) => (DATA_ENTRY_SIZE, TYPE_DATA, DATA_ALIGNMENT),
            };
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&ty.to_le_bytes());
            p.extend_from_slice(&0u64.to_le_bytes()); // flags
            put_range(&mut p, name_ref);
            put_range(&mut p, meta_ref);
            p.extend_from_slice(&min_align.to_le_bytes());
            match &e.body {
                Pending::Splat {
                    pattern,
                    pattern_length,
                    length,
                } => {
                    p.extend_from_slice(&length.to_le_bytes());
                    p.extend_from_slice(pattern);
                    p.push(*pattern_length);
                }
                Pending::Data(bytes) => put_range(
                    &mut p,
                    Range {
                        offset: data_offset.expect("data entries have an offset"),
                        length: bytes.len() as u64,
                    },
                ),
            }
        }
        debug_assert_eq!(p.len() as u64, metadata_segment.offset);
        for e in &self.entries {
            p.extend_from_slice(e.name.as_bytes());
            p.extend_from_slice(&e.metadata);
        }
        p.resize(storage_segment.offset as usize, 0);
        Layout {
            prefix: p,
            storage_offset: storage_segment.offset,
            data_offsets,
            total,
        }
    }

    /// Total size of the archive in bytes.
    pub fn total_len(&self) -> u64 {
        self.layout().total
    }

    /// The whole archive in memory.
    pub fn to_bytes(&self) -> Vec<u8> {
        let layout = self.layout();
        let mut out = layout.prefix;
        out.resize(layout.total as usize, 0);
        for (e, off) in self.entries.iter().zip(&layout.data_offsets) {
            if let (Pending::Data(bytes), Some(off)) = (&e.body, off) {
                let at = (layout.storage_offset + off) as usize;
                out[at..at + bytes.len()].copy_from_slice(bytes);
            }
        }
        out
    }

    /// Streams the archive to `w`; returns the number of bytes written.
    pub fn write_to<W: Write>(&self, w: &mut W) -> io::Result<u64> {
        const ZEROS: [u8; 4096] = [0; 4096];
        fn pad<W: Write>(w: &mut W, mut n: u64) -> io::Result<()> {
            while n > 0 {
                let k = n.min(ZEROS.len() as u64);
                w.write_all(&ZEROS[..k as usize])?;
                n -= k;
            }
            Ok(())
        }
        let layout = self.layout();
        w.write_all(&layout.prefix)?;
        let mut pos = layout.storage_offset;
        for (e, off) in self.entries.iter().zip(&layout.data_offsets) {
            if let (Pending::Data(bytes), Some(off)) = (&e.body, off) {
                let at = layout.storage_offset + off;
                pad(w, at - pos)?;
                w.write_all(bytes)?;
                pos = at + bytes.len() as u64;
            }
        }
        pad(w, layout.total - pos)?;
        Ok(layout.total)
    }

    /// Writes the archive to `path` atomically: a temporary file in the same directory, synced,
    /// then renamed over `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), IrpaError> {
        let path = path.as_ref();
        let file_name = path.file_name().ok_or_else(|| IrpaError::Io {
            op: "write archive to",
            path: path.to_path_buf(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"),
        })?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let tmp = dir.join(format!(
            ".{}.tmp-{}-{}",
            file_name.to_string_lossy(),
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| -> io::Result<()> {
            let file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            self.write_to(&mut w)?;
            let file = w.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()
        })();
        if let Err(source) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(IrpaError::Io {
                op: "write temporary archive",
                path: tmp,
                source,
            });
        }
        std::fs::rename(&tmp, path).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            IrpaError::Io {
                op: "rename temporary archive onto",
                path: path.to_path_buf(),
                source,
            }
        })
    }
}
