//! The `.irpa` reader on arbitrary bytes: parsing never panics or reads outside the input, every
//! data entry it accepts lies inside the archive, and whatever it accepts survives a round trip
//! through [`IrpaWriter`] unchanged (names, metadata, data bytes, splat patterns).
#![no_main]

use kv_core::irpa::{IrpaArchive, IrpaEntryKind, IrpaWriter};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(archive) = IrpaArchive::from_bytes(data.to_vec()) else {
        return;
    };
    let len = archive.file_len();
    let mut writer = IrpaWriter::new();
    let mut written = 0usize;
    for entry in archive.entries() {
        let stored = archive.entry_data(entry);
        match entry.kind() {
            IrpaEntryKind::Data { offset, length } => {
                let bytes = stored.expect("a data entry accepted at open is readable");
                assert_eq!(bytes.len() as u64, *length);
                assert!(offset.checked_add(*length).is_some_and(|end| end <= len));
            }
            _ => assert!(stored.is_err(), "only data entries have stored bytes"),
        }
        if matches!(entry.kind(), IrpaEntryKind::Skip) {
            continue;
        }
        let live = archive.get(entry.name()).expect("every live entry is found by name");
        assert_eq!(
            live.table_offset(),
            entry.table_offset(),
            "names of live entries are unique"
        );
        assert!(archive
            .find_by_size(entry.len())
            .iter()
            .any(|e| e.table_offset() == entry.table_offset()));
        let added = match entry.kind() {
            IrpaEntryKind::Data { .. } => writer
                .add_data_with_metadata(entry.name(), archive.data(entry.name()).unwrap(), entry.metadata())
                .is_ok(),
            IrpaEntryKind::Splat { pattern, length } => writer
                .add_splat_with_metadata(entry.name(), pattern, *length, entry.metadata())
                .is_ok(),
            _ => false,
        };
        written += usize::from(added);
    }
    if written == 0 {
        return;
    }
    let again = IrpaArchive::from_bytes(writer.to_bytes()).expect("the writer's archives parse");
    assert_eq!(again.live_count(), written);
    for entry in again.entries() {
        let before = archive.get(entry.name()).expect("round trip keeps names");
        assert_eq!(entry.kind().label(), before.kind().label());
        assert_eq!(entry.len(), before.len());
        assert_eq!(entry.metadata(), before.metadata());
        match (entry.kind(), before.kind()) {
            (IrpaEntryKind::Data { .. }, IrpaEntryKind::Data { .. }) => {
                assert_eq!(again.data(entry.name()).unwrap(), archive.data(entry.name()).unwrap())
            }
            (IrpaEntryKind::Splat { pattern: a, .. }, IrpaEntryKind::Splat { pattern: b, .. }) => assert_eq!(a, b),
            _ => unreachable!(),
        }
    }
});
