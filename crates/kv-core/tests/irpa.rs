//! `.irpa` reader/writer and bf16 conversions: IREE byte compatibility (golden file, IREE's
//! Python writer, `iree-dump-parameters`), round trips, and robustness against truncated and
//! corrupt archives.

use std::path::{Path, PathBuf};
use std::process::Command;

use kv_core::bf16::{
    bf16_bytes_to_f32, bf16_bytes_to_f32_into, f32_bytes_to_vec, f32_to_bf16_bytes, f32_to_bf16_bytes_into,
    ConvertError,
};
use kv_core::irpa::{IrpaArchive, IrpaEntryKind, IrpaError, IrpaWriter};
use proptest::prelude::*;

/// IREE's own archive (4 KiB, written by IREE's Python `ParameterIndex`), kept in the repository
/// so the test reads the same bytes on every checkout.
const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/irpa-golden.irpa");

fn golden_bytes() -> Vec<u8> {
    std::fs::read(GOLDEN).unwrap_or_else(|e| panic!("cannot read the golden archive {GOLDEN}: {e}"))
}

/// IREE's Python venv (iree-dump-parameters, iree.runtime): `SKAINET_IREE_VENV`, else
/// `$SKAINET_KV_TOOLS/venv` (scripts/env.sh sets it), else the checkout's `.tools/venv`.
fn venv_bin(tool: &str) -> PathBuf {
    let venv = std::env::var_os("SKAINET_IREE_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("SKAINET_KV_TOOLS").map(|t| PathBuf::from(t).join("venv")))
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tools/venv"));
    let path = venv.join("bin").join(tool);
    assert!(
        path.exists(),
        "{tool} not found at {}: install IREE's Python tools into .tools/venv (or point \
         SKAINET_IREE_VENV at a venv that has them); this test does not skip",
        path.display()
    );
    path
}

/// Deterministic pseudo-random bytes.
fn lcg_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u8
        })
        .collect()
}

/// An archive with odd sizes, metadata, splats, empty data and a non-ASCII name.
fn mixed_writer() -> IrpaWriter {
    let mut w = IrpaWriter::new();
    w.add_splat_with_metadata("zeros", &[0, 0, 0, 0], 4096, "TENSORv0:{}")
        .unwrap();
    w.add_data("a", vec![1u8, 2, 3]).unwrap();
    w.add_data_with_metadata("bb", lcg_bytes(1, 70), "meta for bb").unwrap();
    w.add_data("empty", Vec::new()).unwrap();
    w.add_splat("pat16", &(0u8..16).collect::<Vec<_>>(), 48).unwrap();
    w.add_data("blk.0.ffn_up.weight", lcg_bytes(2, 1000)).unwrap();
    w.add_data("ünïcode", lcg_bytes(3, 65)).unwrap();
    w.add_splat("one", &[0x7f], 3).unwrap();
    w.add_data("tail", lcg_bytes(4, 1)).unwrap();
    w
}

// ---------------------------------------------------------------------------------------------
// (a) the golden archive

#[test]
fn golden_reads_with_sensible_values_and_rewrites_byte_for_byte() {
    let golden = golden_bytes();
    assert_eq!(golden.len(), 4096);
    let ar = IrpaArchive::open(GOLDEN).unwrap();
    assert_eq!(ar.path(), Some(Path::new(GOLDEN)));
    assert_eq!(ar.file_len(), 4096);
    let names: Vec<_> = ar.entries().iter().map(|e| e.name()).collect();
    assert_eq!(names, ["w", "g", "emb"]);
    let expect = [("w", 384, 64), ("g", 448, 32), ("emb", 512, 1024)];
    for (e, (name, offset, length)) in ar.entries().iter().zip(expect) {
        assert_eq!(e.name(), name);
        assert_eq!(e.kind(), &IrpaEntryKind::Data { offset, length });
        assert!(e.metadata().is_empty(), "save_archive_file writes no metadata");
        assert_eq!(e.minimum_alignment(), 64);
    }

    // w: 4x8 bf16 and emb: 32x16 bf16, standard-normal-ish; g: 8 f32 norm gains near 1.
    let w = bf16_bytes_to_f32(ar.data("w").unwrap()).unwrap();
    let g = f32_bytes_to_vec(ar.data("g").unwrap()).unwrap();
    let emb = bf16_bytes_to_f32(ar.data("emb").unwrap()).unwrap();
    assert_eq!((w.len(), g.len(), emb.len()), (32, 8, 512));
    assert_eq!(w[..4], [0.125_976_56, -0.131_835_94, 0.640_625, 0.104_980_47]);
    assert_eq!(g[0], 0.984_077_5);
    for x in w.iter().chain(&emb) {
        assert!(x.is_finite() && x.abs() < 8.0, "implausible bf16 weight {x}");
    }
    for x in &g {
        assert!((0.8..1.2).contains(x), "implausible norm gain {x}");
    }
    let mean = emb.iter().sum::<f32>() / 512.0;
    let std = (emb.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / 512.0).sqrt();
    assert!(
        mean.abs() < 0.2 && (0.7..1.3).contains(&std),
        "emb mean {mean} std {std}"
    );
    // Reading the bytes as bf16 twice is lossless, so the re-encoding is exact.
    assert_eq!(f32_to_bf16_bytes(&w), ar.data("w").unwrap());

    let mut wr = IrpaWriter::new();
    wr.add_bf16_from_f32("w", &w).unwrap();
    wr.add_f32("g", &g).unwrap();
    wr.add_bf16_from_f32("emb", &emb).unwrap();
    let ours = wr.to_bytes();
    assert_eq!(ours.len(), golden.len());
    if let Some(i) = ours.iter().zip(&golden).position(|(a, b)| a != b) {
        panic!("first difference from the golden archive at byte {i}");
    }
    // Lookup helpers.
    assert_eq!(ar.find_by_size(1024).len(), 1);
    assert_eq!(ar.find_by_size(1024)[0].name(), "emb");
    assert!(ar.find_by_size(7).is_empty());
    assert_eq!(ar.get("g").unwrap().len(), 32);
}

// ---------------------------------------------------------------------------------------------
// Byte compatibility with IREE's own writer and reader

#[test]
fn writer_matches_iree_python_writer() {
    use serde_json::json;
    let python = venv_bin("python");
    let dir = tempfile::tempdir().unwrap();
    let mut cases: Vec<(IrpaWriter, serde_json::Value)> = Vec::new();

    // The mixed archive, mirrored as a spec for the Python side.
    let data = |name: &str, bytes: Vec<u8>, meta: &str| json!({"kind": "data", "name": name, "hex": hex(&bytes), "meta": meta});
    let splat = |name: &str, pattern: &[u8], length: u64, meta: &str| json!({"kind": "splat", "name": name, "hex": hex(pattern), "length": length, "meta": meta});
    let spec_mixed = vec![
        splat("zeros", &[0; 4], 4096, "TENSORv0:{}"),
        data("a", vec![1, 2, 3], ""),
        data("bb", lcg_bytes(1, 70), "meta for bb"),
        data("empty", Vec::new(), ""),
        splat("pat16", &(0u8..16).collect::<Vec<_>>(), 48, ""),
        data("blk.0.ffn_up.weight", lcg_bytes(2, 1000), ""),
        data("ünïcode", lcg_bytes(3, 65), ""),
        splat("one", &[0x7f], 3, ""),
        data("tail", lcg_bytes(4, 1), ""),
    ];
    cases.push((mixed_writer(), json!(spec_mixed)));

    // Empty archive, splats only, one empty data entry, many odd sizes crossing 4096.
    cases.push((IrpaWriter::new(), json!([])));
    let mut w = IrpaWriter::new();
    w.add_splat("s1", &[1, 2], 10).unwrap();
    w.add_splat("s2", &[9; 8], 64).unwrap();
    let s = vec![splat("s1", &[1, 2], 10, ""), splat("s2", &[9; 8], 64, "")];
    cases.push((w, json!(s)));
    let mut w = IrpaWriter::new();
    w.add_data("z", Vec::new()).unwrap();
    cases.push((w, json!([data("z", Vec::new(), "")])));
    let mut w = IrpaWriter::new();
    let mut s = Vec::new();
    for i in 0..40usize {
        let bytes = lcg_bytes(100 + i as u64, (i * 37) % 301);
        let name = format!("t{i}{}", "x".repeat(i % 5));
        s.push(data(&name, bytes.clone(), ""));
        w.add_data(name, bytes).unwrap();
    }
    cases.push((w, json!(s)));

    let script = r#"
import json, sys
import iree.runtime as rt
for spec_path, out_path in zip(sys.argv[1::2], sys.argv[2::2]):
    idx = rt.ParameterIndex()
    for e in json.load(open(spec_path)):
        meta = e["meta"] or None
        data = bytes.fromhex(e["hex"])
        if e["kind"] == "data":
            idx.add_buffer(e["name"], data, metadata=meta)
        else:
            idx.add_splat(e["name"], data, e["length"], metadata=meta)
    idx.create_archive_file(out_path)
"#;
    let mut cmd = Command::new(&python);
    cmd.arg("-c").arg(script);
    for (i, (_, spec)) in cases.iter().enumerate() {
        let sp = dir.path().join(format!("spec{i}.json"));
        std::fs::write(&sp, spec.to_string()).unwrap();
        cmd.arg(sp).arg(dir.path().join(format!("py{i}.irpa")));
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "IREE's Python writer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (i, (w, _)) in cases.iter().enumerate() {
        let theirs = std::fs::read(dir.path().join(format!("py{i}.irpa"))).unwrap();
        let ours = w.to_bytes();
        assert_eq!(ours.len(), theirs.len(), "case {i}: length");
        if let Some(b) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("case {i}: first difference from IREE's writer at byte {b}");
        }
        // And our reader reads theirs.
        let ar = IrpaArchive::from_bytes(theirs).unwrap();
        assert_eq!(ar.entries().len(), w.len());
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn iree_dump_parameters_accepts_our_archive() {
    let tool = venv_bin("iree-dump-parameters");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ours.irpa");
    let w = mixed_writer();
    w.write(&path).unwrap();
    let extracted = dir.path().join("ffn.bin");
    let out = Command::new(&tool)
        .arg("--parameter_mode=preload")
        .arg(format!("--parameters={}", path.display()))
        .arg(format!("--extract=blk.0.ffn_up.weight={}", extracted.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "iree-dump-parameters rejected our archive:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in [
        "zeros",
        "a",
        "bb",
        "empty",
        "pat16",
        "blk.0.ffn_up.weight",
        "one",
        "tail",
    ] {
        assert!(stdout.contains(&format!("`{name}`")), "{name} missing from:\n{stdout}");
    }
    assert!(stdout.contains("(9 entries"), "unexpected summary:\n{stdout}");
    assert_eq!(std::fs::read(&extracted).unwrap(), lcg_bytes(2, 1000));
}

// ---------------------------------------------------------------------------------------------
// (b) round trips

#[test]
fn round_trip_many_odd_entries() {
    let mut w = IrpaWriter::new();
    let mut expect = Vec::new();
    for i in 0..200usize {
        let len = (i * i * 7 + i) % 997;
        let bytes = lcg_bytes(i as u64, len);
        let name = format!("layer.{i}.{}", "w".repeat(i % 7));
        if i % 9 == 4 {
            w.add_splat(name.clone(), &[i as u8, 1], len as u64 * 2).unwrap();
            expect.push((name, None, len as u64 * 2));
        } else if i % 5 == 1 {
            w.add_data_with_metadata(name.clone(), bytes.clone(), format!("m{i}"))
                .unwrap();
            expect.push((name, Some(bytes), len as u64));
        } else {
            w.add_data(name.clone(), bytes.clone()).unwrap();
            expect.push((name, Some(bytes), len as u64));
        }
    }
    let bytes = w.to_bytes();
    assert_eq!(bytes.len() % 4096, 0);
    let mut streamed = Vec::new();
    assert_eq!(w.write_to(&mut streamed).unwrap(), bytes.len() as u64);
    assert_eq!(streamed, bytes);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rt.irpa");
    w.write(&path).unwrap();
    w.write(&path).unwrap(); // replacing is fine
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "temporary files left behind");

    let ar = IrpaArchive::open(&path).unwrap();
    assert_eq!(ar.entries().len(), 200);
    for (i, (e, (name, data, len))) in ar.entries().iter().zip(&expect).enumerate() {
        assert_eq!(e.name(), name);
        assert_eq!(e.len(), *len);
        assert_eq!(e.table_offset() % 16, 0);
        match data {
            Some(d) => {
                assert_eq!(ar.data(name).unwrap(), &d[..]);
                if let IrpaEntryKind::Data { offset, length } = e.kind() {
                    assert!(*length == 0 || offset % 64 == 0, "data {i} misaligned");
                } else {
                    panic!("entry {i} is not data");
                }
                let want_meta = if i % 5 == 1 { format!("m{i}") } else { String::new() };
                assert_eq!(e.metadata(), want_meta.as_bytes());
            }
            None => {
                assert_eq!(
                    e.kind(),
                    &IrpaEntryKind::Splat {
                        pattern: vec![i as u8, 1],
                        length: *len
                    }
                );
                assert!(matches!(ar.data(name), Err(IrpaError::NotStored { kind: "splat", .. })));
            }
        }
    }
    // A re-write of what we read is identical.
    let mut again = IrpaWriter::new();
    for e in ar.entries() {
        match e.kind() {
            IrpaEntryKind::Splat { pattern, length } => {
                again
                    .add_splat_with_metadata(e.name(), pattern, *length, e.metadata())
                    .unwrap();
            }
            _ => {
                again
                    .add_data_with_metadata(e.name(), ar.data(e.name()).unwrap(), e.metadata())
                    .unwrap();
            }
        }
    }
    assert_eq!(again.to_bytes(), bytes);
}

#[test]
fn writer_rejects_duplicates_and_bad_splats() {
    let mut w = IrpaWriter::new();
    w.add_f32("x", &[1.0]).unwrap();
    let err = w.add_data("x", vec![0u8]).unwrap_err();
    assert!(matches!(&err, IrpaError::DuplicateEntry { name } if name == "x"));
    assert!(err.to_string().contains("\"x\""));
    let err = w.add_splat("x", &[1], 4).unwrap_err();
    assert!(
        matches!(&err, IrpaError::DuplicateEntry { name } if name == "x"),
        "{err:?}"
    );
    for bad in [0usize, 3, 5, 17, 32] {
        let err = w.add_splat("s", &vec![0u8; bad], 64).unwrap_err();
        assert!(matches!(err, IrpaError::InvalidEntry { .. }), "{bad}");
    }
    assert_eq!(w.len(), 1);
}

#[test]
fn reader_rejects_duplicate_names() {
    let mut w = IrpaWriter::new();
    w.add_data("a", vec![1u8]).unwrap();
    w.add_data("b", vec![2u8]).unwrap();
    let mut bytes = w.to_bytes();
    // Metadata segment "ab" follows the entry table (96 + 80 + 76 = 252).
    assert_eq!(&bytes[252..254], b"ab");
    bytes[253] = b'a';
    let err = IrpaArchive::from_bytes(bytes).unwrap_err();
    assert!(err.to_string().contains("duplicate entry name \"a\""), "{err}");
}

// ---------------------------------------------------------------------------------------------
// (c) truncation and corruption

/// End of the last structure the archive references (segments; everything after is padding).
fn required_len(bytes: &[u8]) -> usize {
    let u = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
    [(40, 48), (56, 64), (72, 80)]
        .iter()
        .map(|&(o, l)| if u(l) == 0 { 88 } else { u(o) + u(l) })
        .max()
        .unwrap()
}

fn check_every_truncation(bytes: &[u8]) {
    let full = IrpaArchive::from_bytes(bytes.to_vec()).unwrap();
    let need = required_len(bytes);
    assert!(need < bytes.len());
    for n in 0..bytes.len() {
        let r = IrpaArchive::from_bytes(bytes[..n].to_vec());
        if n < need {
            // Truncated, naming the cut length: not a bad magic or a corrupt field read from
            // bytes past the end.
            match r {
                Err(IrpaError::Truncated { len, .. }) if len == n as u64 => {}
                other => panic!("prefix of {n} bytes (needs {need}): {:?}", other.map(|_| "parsed")),
            }
        } else {
            // Only the trailing padding is missing: IREE accepts that too.
            let ar = r.unwrap_or_else(|e| panic!("prefix of {n} bytes: {e}"));
            assert_eq!(ar.entries(), full.entries());
        }
    }
}

#[test]
fn every_truncation_of_the_golden_is_an_error() {
    let golden = golden_bytes();
    assert_eq!(required_len(&golden), 1536);
    check_every_truncation(&golden);
    let r = IrpaArchive::from_bytes(golden[..100].to_vec()).unwrap_err();
    assert!(matches!(r, IrpaError::Truncated { .. }), "{r}");
}

#[test]
fn every_truncation_of_a_mixed_archive_is_an_error() {
    check_every_truncation(&mixed_writer().to_bytes());
}

#[test]
fn open_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.irpa");
    let err = IrpaArchive::open(&missing).unwrap_err();
    assert!(matches!(err, IrpaError::Io { op: "open", .. }));
    assert!(err.to_string().contains("missing.irpa"), "{err}");

    let empty = dir.path().join("empty.irpa");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(IrpaArchive::open(&empty), Err(IrpaError::Truncated { .. })));

    let cut = dir.path().join("cut.irpa");
    std::fs::write(&cut, &golden_bytes()[..1535]).unwrap();
    let err = IrpaArchive::open(&cut).unwrap_err();
    assert!(err.to_string().contains("storage segment"), "{err}");

    let mut bad = golden_bytes();
    bad[0] = b'X';
    assert!(matches!(
        IrpaArchive::from_bytes(bad),
        Err(IrpaError::BadMagic { offset: 0, .. })
    ));
    let mut v1 = golden_bytes();
    v1[6] = 1;
    assert!(matches!(
        IrpaArchive::from_bytes(v1),
        Err(IrpaError::UnsupportedVersion { major: 0, minor: 1, .. })
    ));
}

#[test]
fn a_file_changed_under_the_mapping_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.irpa");
    let open = || {
        mixed_writer().write(&path).unwrap();
        let archive = IrpaArchive::open(&path).unwrap();
        archive.check_unchanged().unwrap();
        archive
    };
    let changed = |archive: &IrpaArchive, needle: &str| {
        let err = archive.check_unchanged().unwrap_err();
        assert!(matches!(err, IrpaError::Changed { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("a.irpa") && text.contains(needle), "{text}");
    };

    let archive = open();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(archive.file_len() / 2).unwrap();
    changed(&archive, "bytes at open");
    drop(archive);

    // Same length, rewritten in place: only the mtime tells.
    let archive = open();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    changed(&archive, "modified in place");
    drop(archive);

    // Replaced by a rename: the mapping is intact, but the session's weights are not the file's.
    let archive = open();
    let new = dir.path().join("new.irpa");
    mixed_writer().write(&new).unwrap();
    std::fs::rename(&new, &path).unwrap();
    changed(&archive, "replaced");
    drop(archive);

    // Removed: what is mapped is still the file that was opened.
    let archive = open();
    std::fs::remove_file(&path).unwrap();
    archive.check_unchanged().unwrap();
    assert!(IrpaArchive::from_bytes(mixed_writer().to_bytes())
        .unwrap()
        .check_unchanged()
        .is_ok());
}

/// Parses `bytes`; on success every reported slice must lie inside the archive.
fn parse_never_escapes(bytes: Vec<u8>) {
    let len = bytes.len();
    let Ok(ar) = IrpaArchive::from_bytes(bytes) else {
        return;
    };
    let base = ar.as_bytes().as_ptr() as usize;
    for e in ar.entries() {
        if let IrpaEntryKind::Data { offset, length } = e.kind() {
            assert!(offset.checked_add(*length).is_some_and(|end| end <= len as u64));
        }
        if let Ok(d) = ar.entry_data(e) {
            let p = d.as_ptr() as usize;
            assert!(d.is_empty() || (p >= base && p + d.len() <= base + len));
        }
        let _ = ar.data(e.name());
    }
    let _ = ar.find_by_size(64);
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX - 15),
        Just(1 << 63),
        0u64..5000,
        any::<u64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_byte_corruption_never_panics(
        which in 0usize..2,
        edits in prop::collection::vec((0usize..400, any::<u8>()), 1..8),
    ) {
        let mut bytes = if which == 0 { golden_bytes() } else { mixed_writer().to_bytes() };
        for (at, v) in edits {
            bytes[at] = v;
        }
        parse_never_escapes(bytes);
    }

    #[test]
    fn random_field_corruption_never_panics(
        which in 0usize..2,
        edits in prop::collection::vec((0usize..392, interesting_u64()), 1..4),
        cut in prop::option::of(0usize..4096),
    ) {
        let mut bytes = if which == 0 { golden_bytes() } else { mixed_writer().to_bytes() };
        for (at, v) in edits {
            bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        if let Some(cut) = cut {
            bytes.truncate(cut);
        }
        parse_never_escapes(bytes);
    }

    #[test]
    fn random_writer_contents_round_trip(
        entries in prop::collection::vec((prop::collection::vec(any::<u8>(), 0..300), any::<bool>()), 0..12),
    ) {
        let mut w = IrpaWriter::new();
        for (i, (data, with_meta)) in entries.iter().enumerate() {
            let meta = if *with_meta { format!("meta{i}") } else { String::new() };
            w.add_data_with_metadata(format!("e{i}"), data.clone(), meta).unwrap();
        }
        let ar = IrpaArchive::from_bytes(w.to_bytes()).unwrap();
        prop_assert_eq!(ar.entries().len(), entries.len());
        for (i, (data, _)) in entries.iter().enumerate() {
            prop_assert_eq!(ar.data(&format!("e{i}")).unwrap(), &data[..]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (d) missing entries

#[test]
fn missing_entry_error_names_it() {
    let ar = IrpaArchive::open(GOLDEN).unwrap();
    let err = ar.data("token_embd.weight").unwrap_err();
    assert!(matches!(&err, IrpaError::MissingEntry { name, available_count: 3 } if name == "token_embd.weight"));
    let msg = err.to_string();
    assert!(msg.contains("token_embd.weight") && msg.contains('3'), "{msg}");
    assert!(ar.get("token_embd.weight").is_none());
    // Skip entries are invisible to lookups.
    let mut bytes = golden_bytes();
    bytes[0x68] = 0; // entry `w` becomes a skip entry
    let ar = IrpaArchive::from_bytes(bytes).unwrap();
    assert_eq!(ar.entries()[0].kind(), &IrpaEntryKind::Skip);
    assert!(matches!(
        ar.data("w"),
        Err(IrpaError::MissingEntry { available_count: 2, .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// (e) bf16

#[test]
fn bf16_decode_matches_half_for_every_bit_pattern() {
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    let decoded = bf16_bytes_to_f32(&bytes).unwrap();
    let mut into = vec![0.0f32; 65536];
    bf16_bytes_to_f32_into(&bytes, &mut into).unwrap();
    for (bits, (a, b)) in (0..=u16::MAX).zip(decoded.iter().zip(&into)) {
        let want = half::bf16::from_bits(bits).to_f32();
        assert_eq!(a.to_bits(), want.to_bits(), "{bits:#06x}");
        assert_eq!(b.to_bits(), want.to_bits(), "{bits:#06x}");
        // Widening is exact, so narrowing back is the identity (NaN stays NaN).
        let back = f32_to_bf16_bytes(&[*a]);
        let back = u16::from_le_bytes([back[0], back[1]]);
        if a.is_nan() {
            assert!(half::bf16::from_bits(back).is_nan());
        } else {
            assert_eq!(back, bits);
        }
    }
}

#[test]
fn bf16_length_errors() {
    assert!(matches!(
        bf16_bytes_to_f32(&[0; 5]),
        Err(ConvertError::RaggedLength { len: 5, .. })
    ));
    let mut out = [0.0f32; 3];
    assert!(matches!(
        bf16_bytes_to_f32_into(&[0; 4], &mut out),
        Err(ConvertError::LengthMismatch {
            input_elems: 2,
            output_elems: 3,
            ..
        })
    ));
    let mut out8 = [0u8; 3];
    assert!(matches!(
        f32_to_bf16_bytes_into(&[1.0], &mut out8),
        Err(ConvertError::RaggedLength {
            len: 3,
            elem_size: 2,
            ..
        })
    ));
    assert!(matches!(
        f32_bytes_to_vec(&[0; 7]),
        Err(ConvertError::RaggedLength {
            len: 7,
            elem_size: 4,
            ..
        })
    ));
    assert_eq!(f32_bytes_to_vec(&1.5f32.to_le_bytes()).unwrap(), vec![1.5]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5000, ..ProptestConfig::default() })]

    #[test]
    fn f32_to_bf16_rounds_to_nearest_even(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        let ours = f32_to_bf16_bytes(&[x]);
        let ours = u16::from_le_bytes([ours[0], ours[1]]);
        prop_assert_eq!(ours, half::bf16::from_f32(x).to_bits());
        if x.is_nan() {
            prop_assert!(half::bf16::from_bits(ours).is_nan());
        } else {
            // Independent reference: integer round-to-nearest-even on the top 16 bits.
            let rne = ((bits as u64 + 0x7fff + ((bits as u64 >> 16) & 1)) >> 16) as u16;
            prop_assert_eq!(ours, rne);
            // And it is the nearest representable value.
            let back = half::bf16::from_bits(ours).to_f64();
            let err = (back - x as f64).abs();
            for n in [ours.wrapping_sub(1), ours.wrapping_add(1)] {
                let other = half::bf16::from_bits(n).to_f64();
                if other.is_finite() && back.is_finite() {
                    prop_assert!(err <= (other - x as f64).abs());
                }
            }
        }
        let mut buf = [0u8; 2];
        f32_to_bf16_bytes_into(&[x], &mut buf).unwrap();
        prop_assert_eq!(u16::from_le_bytes(buf), ours);
    }
}
