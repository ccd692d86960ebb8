//! Bad artifacts and bad calls on the IREE backend: each a clear error, and a session that still
//! works where one exists.

use std::path::{Path, PathBuf};

use backend_iree::{IreeKvBackend, IreeOptions, IreeRedecodeBackend};
use export::{cached_export, Layout, Target};
use kv_core::{Graph, KvBackend, Manifest};

fn artifacts(model: &str, layout: Layout) -> PathBuf {
    cached_export(model, &Target::cpu(), layout).expect("export (is iree-compile installed? run scripts/setup.sh)")
}

/// A copy of an artifact directory whose manifest we can edit.
fn copy_dir(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        // Without the export's digests: edited, it stands for artifacts put together by hand
        // (with them an edited manifest is refused before the checks these tests are about).
        if entry.file_name() == kv_core::digests::DIGESTS_FILE {
            continue;
        }
        std::fs::copy(entry.path(), to.path().join(entry.file_name())).unwrap();
    }
    to
}

fn open_error(dir: &Path, device: &str) -> kv_core::Error {
    match IreeKvBackend::open(dir, IreeOptions::new(device)) {
        Ok(_) => panic!("opening {} on {device} succeeded", dir.display()),
        Err(e) => e,
    }
}

fn open_err(dir: &Path, device: &str) -> String {
    open_error(dir, device).to_string()
}

#[test]
fn unknown_device_is_named() {
    let dir = artifacts("tiny-gemma3:1", Layout::Shared);
    let err = open_err(&dir, "cuda");
    assert!(
        err.contains("unknown device `cuda`") && err.contains("local-task"),
        "{err}"
    );
}

#[test]
fn a_device_without_modules_is_named() {
    let dir = artifacts("tiny-gemma3:1", Layout::Shared);
    let err = open_err(&dir, "vulkan");
    assert!(err.contains("no `vulkan` modules"), "{err}");
}

#[test]
fn missing_function_lists_what_the_module_exports() {
    let dir = copy_dir(&artifacts("tiny-gemma3:1", Layout::Shared));
    let mut m = Manifest::load(dir.path()).unwrap();
    m.functions.with_past = Some("module.nope_with_past".into());
    m.save(dir.path()).unwrap();
    let err = open_err(dir.path(), "local-task");
    assert!(
        err.contains("module.nope_with_past") && err.contains("module.gemma_with_past"),
        "{err}"
    );
}

#[test]
fn vmfb_of_another_contract_is_refused_at_open() {
    // The llama model's chunk graph has another layer count: its argument list does not match.
    let dir = copy_dir(&artifacts("tiny-gemma3:1", Layout::Three));
    let other = artifacts("tiny-llama:4", Layout::Three);
    let m = Manifest::load(dir.path()).unwrap();
    let chunk_vmfb = &m.modules["llvm-cpu"][Graph::Chunk.key()];
    let other_m = Manifest::load(&other).unwrap();
    std::fs::copy(
        other.join(&other_m.modules["llvm-cpu"][Graph::Chunk.key()]),
        dir.path().join(chunk_vmfb),
    )
    .unwrap();
    let other_params = other_m.parameter_file(Graph::Chunk).unwrap();
    std::fs::copy(
        other.join(other_params),
        dir.path().join(m.parameter_file(Graph::Chunk).unwrap()),
    )
    .unwrap();
    let mut m = m;
    m.functions.prefill_with_past = other_m.functions.prefill_with_past.clone();
    m.save(dir.path()).unwrap();
    let err = open_error(dir.path(), "local-task");
    assert!(matches!(err, kv_core::Error::ContractMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("another contract"), "{err}");
}

#[test]
fn missing_parameter_archive_and_entry() {
    let dir = copy_dir(&artifacts("tiny-gemma3:1", Layout::Shared));
    let m = Manifest::load(dir.path()).unwrap();
    let archive = dir.path().join(m.parameter_file(Graph::Step).unwrap());
    std::fs::remove_file(&archive).unwrap();
    let err = open_err(dir.path(), "local-task");
    assert!(
        err.contains(&archive.display().to_string()) || err.contains("not found"),
        "{err}"
    );

    // An archive that lacks one weight: IREE reports the parameter when the module initialises.
    let dir = copy_dir(&artifacts("tiny-gemma3:1", Layout::Shared));
    let file = dir.path().join(m.parameter_file(Graph::Step).unwrap());
    let full = kv_core::irpa::IrpaArchive::open(&file).unwrap();
    let mut writer = kv_core::irpa::IrpaWriter::new();
    for entry in full.entries() {
        if entry.name() != "blk.1.ffn_up.weight" {
            writer
                .add_data(entry.name(), full.entry_data(entry).unwrap().to_vec())
                .unwrap();
        }
    }
    drop(full);
    writer.write(&file).unwrap();
    let err = open_error(dir.path(), "local-task");
    assert!(err.to_string().contains("blk.1.ffn_up.weight"), "{err}");
    // The IREE status survives as the error's source, not only as text.
    let code = backend_iree::iree_status(&err).unwrap_or_else(|| panic!("no IREE status behind {err:?}"));
    assert!(err.to_string().contains(&code.to_string()), "{code} in {err}");
    let source = std::error::Error::source(&err).expect("a source");
    assert!(source.downcast_ref::<iree_runtime::Error>().is_some(), "{source:?}");
}

#[test]
fn truncated_embedding_archive_is_an_error() {
    let dir = copy_dir(&artifacts("tiny-gemma3:1", Layout::Shared));
    let m = Manifest::load(dir.path()).unwrap();
    let file = dir.path().join(m.parameter_file(Graph::Step).unwrap());
    let bytes = std::fs::read(&file).unwrap();
    let cut = bytes.len() / 3;
    std::fs::write(&file, &bytes[..cut]).unwrap();
    // IREE's own archive parser refuses it when the module's parameters are indexed, with
    // OUT_OF_RANGE (11) and the file's size: not a crash, and not some other failure.
    let err = open_error(dir.path(), "local-task");
    assert_eq!(
        backend_iree::iree_status(&err),
        Some(iree_runtime::StatusCode(11)),
        "{err:?}"
    );
    assert!(err.to_string().contains(&format!("file_size={cut}")), "{err}");
}

#[test]
fn released_prefill_is_an_error_and_the_session_keeps_decoding() {
    let dir = artifacts("tiny-gemma3:1", Layout::Three);
    let mut s = IreeKvBackend::open(&dir, IreeOptions::new("local-task")).unwrap();
    let mut control = IreeKvBackend::open(&dir, IreeOptions::new("local-task")).unwrap();
    s.prefill(&[1, 2, 3, 4]).unwrap();
    control.prefill(&[1, 2, 3, 4]).unwrap();
    let snap = s.snapshot().unwrap();
    assert!(
        s.release_prefill(),
        "the three-archive layout has a separate prefill session"
    );
    assert!(!s.release_prefill(), "released once");
    let err = s.prefill(&[1, 2]).unwrap_err();
    assert!(matches!(err, kv_core::Error::GraphUnavailable { .. }), "{err:?}");
    let err = err.to_string();
    assert!(err.contains("released"), "{err}");
    assert_eq!(s.position(), 4);
    assert_eq!(s.chunk(&[5, 6]).unwrap(), control.chunk(&[5, 6]).unwrap());
    s.restore(&snap).unwrap();
    assert_eq!(s.step(9).unwrap(), {
        let mut c = IreeKvBackend::open(&dir, IreeOptions::new("local-task")).unwrap();
        c.prefill(&[1, 2, 3, 4]).unwrap();
        c.step(9).unwrap()
    });

    // One shared module: nothing can be freed, but prefill is released all the same.
    let shared = artifacts("tiny-gemma3:1", Layout::Shared);
    let mut s = IreeKvBackend::open(&shared, IreeOptions::new("local-task")).unwrap();
    let mut control = IreeKvBackend::open(&shared, IreeOptions::new("local-task")).unwrap();
    s.prefill(&[1, 2, 3, 4]).unwrap();
    control.prefill(&[1, 2, 3, 4]).unwrap();
    assert!(!s.release_prefill(), "one shared module frees nothing");
    let err = s.prefill(&[1, 2]).unwrap_err().to_string();
    assert!(err.contains("prefill graph was released"), "{err}");
    assert_eq!(s.position(), 4);
    assert_eq!(s.chunk(&[5, 6]).unwrap(), control.chunk(&[5, 6]).unwrap());
    assert_eq!(s.step(9).unwrap(), control.step(9).unwrap());

    // Without a prefill module the error says that instead.
    let mut m = Manifest::load(&dir).unwrap();
    for modules in m.modules.values_mut() {
        modules.remove(Graph::Prefill.key());
    }
    let mut s = IreeKvBackend::open_manifest(&dir, m, IreeOptions::new("local-task")).unwrap();
    let err = s.prefill(&[1, 2]).unwrap_err().to_string();
    assert!(err.contains("opened without a prefill module"), "{err}");
}

#[test]
fn an_archive_changed_after_open_is_an_error_not_a_sigbus() {
    for layout in [Layout::Shared, Layout::Three] {
        let dir = copy_dir(&artifacts("tiny-gemma3:1", layout));
        let m = Manifest::load(dir.path()).unwrap();
        let mut s = IreeKvBackend::open(dir.path(), IreeOptions::new("local-task")).unwrap();
        s.prefill(&[1, 2, 3, 4]).unwrap();
        let with_past = dir.path().join(m.parameter_file(Graph::Step).unwrap());
        let len = std::fs::metadata(&with_past).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&with_past)
            .unwrap()
            .set_len(len / 4)
            .unwrap();
        for err in [s.step(9).unwrap_err(), s.chunk(&[5, 6]).unwrap_err()] {
            let err = err.to_string();
            assert!(
                err.contains("changed since it was opened") && err.contains(&with_past.display().to_string()),
                "{layout:?}: {err}"
            );
        }
        assert_eq!(s.position(), 4);
    }

    // The chunk graph's own archive (three archives): IREE maps it; checked before the call.
    let dir = copy_dir(&artifacts("tiny-gemma3:1", Layout::Three));
    let m = Manifest::load(dir.path()).unwrap();
    let mut s = IreeKvBackend::open(dir.path(), IreeOptions::new("local-task")).unwrap();
    s.prefill(&[1, 2, 3, 4]).unwrap();
    let chunk = dir.path().join(m.parameter_file(Graph::Chunk).unwrap());
    let replacement = dir.path().join("replacement.irpa");
    std::fs::copy(&chunk, &replacement).unwrap();
    std::fs::rename(&replacement, &chunk).unwrap();
    let err = s.chunk(&[5, 6]).unwrap_err().to_string();
    assert!(
        err.contains("replaced") && err.contains(&chunk.display().to_string()),
        "{err}"
    );
    s.step(9).unwrap();
}

#[test]
fn restore_is_independent_of_the_prefix_length() {
    // Snapshots retain views: restoring a long prefix costs what restoring a short one does
    // (behaviour, not timing): after a restore the session holds the snapshot's own device
    // views, so a restore that copied the cache (O(prefix)) fails here.
    let dir = artifacts("tiny-gemma3:1", Layout::Shared);
    let mut s = IreeKvBackend::open(&dir, IreeOptions::new("local-task")).unwrap();
    s.prefill(&(0..200).collect::<Vec<_>>()).unwrap();
    let long = s.snapshot().unwrap();
    s.prefill(&[1, 2]).unwrap();
    let short = s.snapshot().unwrap();
    assert!(!s.holds_views_of(&long), "a prefill makes new caches");
    s.restore(&long).unwrap();
    assert!(s.holds_views_of(&long), "restore of 200 positions copied the cache");
    assert_eq!(s.position(), 200);
    assert_eq!(
        s.read_layer(3).unwrap().first_position + s.read_layer(3).unwrap().rows,
        200
    );
    s.restore(&short).unwrap();
    assert!(s.holds_views_of(&short), "restore of 2 positions copied the cache");
    assert_eq!(s.position(), 2);
    // A call replaces the views; the snapshot keeps its own.
    s.step(5).unwrap();
    assert!(!s.holds_views_of(&short));
    s.restore(&short).unwrap();
    assert!(s.holds_views_of(&short));
}

#[test]
fn redecode_checks_the_result_shape() {
    let dir = artifacts("tiny-llama:4", Layout::Shared);
    let m = Manifest::load(&dir).unwrap();
    // Point the redecode backend at the `_at` function: one token out instead of SEQ.
    let mut edited = m.clone();
    edited.functions.redecode = m.functions.redecode_at.clone();
    let copy = copy_dir(&dir);
    edited.save(copy.path()).unwrap();
    let err = match IreeRedecodeBackend::open(copy.path(), IreeOptions::new("local-task")) {
        Ok(_) => panic!("a two-argument function opened as redecode"),
        Err(e) => e,
    };
    assert!(matches!(err, kv_core::Error::ContractMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("another contract"), "{err}");
}

/// `portable-sgN` modules assume subgroups of N lanes: one export for this Vulkan device's size
/// and another opens the device's module when none is named, whichever the manifest lists first;
/// the other size named is refused at open as a contract mismatch naming both sizes (it would
/// load and compute wrong), and the device's own still opens after that.
#[test]
fn a_module_of_another_subgroup_size_is_refused_and_the_device_s_is_picked() {
    let features = backend_iree::VulkanFeatures::of_default_device().expect("lavapipe");
    let own = features
        .portable_target()
        .expect("lavapipe has 16-bit storage and subgroup reductions");
    let size = features.subgroup_size;
    let other = if size == 16 { 32 } else { 16 };
    let sized = |n: u32| Target::Vulkan {
        target: Some(format!("portable-sg{n}")),
    };
    let mut options = export::runtime_options_for(&sized(size), kv_core::ContractVersion::V2);
    options.targets = vec![sized(other), sized(size)];
    let dir = export::cached_export_with("tiny-gemma3:7", &options).expect("export");
    assert!(IreeKvBackend::open(&dir, IreeOptions::new("vulkan")).is_ok());
    let named = |target: String| IreeOptions {
        target: Some(target),
        ..IreeOptions::new("vulkan")
    };
    let err = IreeKvBackend::open(&dir, named(format!("vulkan-portable-sg{other}")))
        .err()
        .expect("a module of another subgroup size opened");
    assert!(
        matches!(&err, kv_core::Error::ContractMismatch { op, message, .. }
            if op == "open" && message.contains(&format!("subgroups of {other} lanes"))
                && message.contains(&format!("are {size}"))),
        "{err}"
    );
    assert!(IreeKvBackend::open(&dir, named(format!("vulkan-{own}"))).is_ok());
}
