//! End-to-end tests of the safe layer on every device: a tiny StableHLO module is compiled at
//! test time with `iree-compile` (llvm-cpu and vulkan targets), its parameter written to an
//! `.irpa` with IREE's Python API, and the numbers checked on local-task, local-sync and vulkan
//! (lavapipe on machines without a GPU).
//!
//! Needs the project tools: `source scripts/env.sh` (or `scripts/setup.sh` once). Missing tools
//! fail the tests with a message; nothing is skipped.

mod common;

use common::{assert_close, fixture, instance, open_session, W};
use iree_runtime::{
    BufferView, Device, ElementType, Error, ParameterIo, ParameterProvider, Profiling, Session, StorageSpec, Transfer,
};

/// Expands each test function of a device name into one `#[test]` per device.
macro_rules! device_tests {
    ($($test:ident),* $(,)?) => {
        mod local_task { $( #[test] fn $test() { super::$test("local-task") } )* }
        mod local_sync { $( #[test] fn $test() { super::$test("local-sync") } )* }
        mod vulkan { $( #[test] fn $test() { super::$test("vulkan") } )* }
    };
}

device_tests!(
    forward_uses_parameter,
    dynamic_shape_input,
    i32_round_trip,
    rows_of_single_head_result,
    rows_of_two_head_result,
    leading_rows_share_the_buffer,
    functions_share_one_session,
    missing_function_is_named,
    sessions_share_one_device,
    function_of_another_session_is_refused,
    function_outlives_its_session,
    transfers_copy_and_zero_in_one_submission,
    inputs_either_side_of_the_host_visible_limit,
    transfers_in_sequence_and_from_threads,
    calls_queue_behind_each_other_and_reads_wait,
    profiling_records_each_dispatch,
    caller_storage_holds_the_results,
);

fn forward_uses_parameter(device_name: &str) {
    let mut session = open_session(device_name);
    let forward = session.lookup("module.forward").unwrap();
    assert_eq!(forward.is_async(), device_name == "vulkan", "{forward:?}");
    assert_eq!(forward.argument_count(), 2, "{forward:?}");
    let device = session.device().clone();
    let x = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let y = BufferView::from_f32(&device, &[4], &[10.0, 20.0, 30.0, 40.0]).unwrap();
    let out = session.call("module.forward", &[&x, &y]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].shape(), vec![4]);
    assert_eq!(out[0].element_type(), ElementType::F32);
    let expected: Vec<f32> = (0..4).map(|i| (i + 1) as f32 * W[i] + 10.0 * (i + 1) as f32).collect();
    assert_close(&out[0].to_f32_vec().unwrap(), &expected);
}

fn dynamic_shape_input(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    for n in [1usize, 7, 64] {
        let data: Vec<f32> = (0..n).map(|i| i as f32 - 3.5).collect();
        let x = BufferView::from_f32(&device, &[n], &data).unwrap();
        let out = session.call("module.double_dynamic", &[&x]).unwrap();
        assert_eq!(out[0].shape(), vec![n]);
        let expected: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
        assert_close(&out[0].to_f32_vec().unwrap(), &expected);
    }
}

/// Small inputs are written into host-visible memory, larger ones copied into device memory;
/// a call reads both alike, and both read back.
fn inputs_either_side_of_the_host_visible_limit(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let at_limit = iree_runtime::HOST_VISIBLE_UPLOAD_MAX / 4;
    for n in [1, at_limit, at_limit + 1] {
        let data: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 - 3.5).collect();
        let x = BufferView::from_f32(&device, &[n], &data).unwrap();
        if n <= at_limit {
            assert!(x.is_host_visible(), "{n} f32 on {device_name}");
        }
        assert_eq!(x.to_f32_vec().unwrap(), data);
        let out = session.call("module.double_dynamic", &[&x]).unwrap();
        let expected: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
        assert_close(&out[0].to_f32_vec().unwrap(), &expected);
    }
}

fn i32_round_trip(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let x = BufferView::from_i32(&device, &[3], &[-1, 0, 41]).unwrap();
    assert_eq!(x.element_type(), ElementType::I32);
    let out = session.call("module.increment", &[&x]).unwrap();
    assert_eq!(out[0].element_type(), ElementType::I32);
    assert_eq!(out[0].to_i32_vec().unwrap(), vec![0, 1, 42]);
    assert!(matches!(out[0].to_f32_vec(), Err(Error::InvalidArgument { .. })));
}

/// `[1, H, R, D]` with value `1000 h + 10 r + d`, doubled by the module so the view under test
/// is a device-local call result.
fn kv_result(session: &mut Session, heads: usize) -> (BufferView, Vec<f32>) {
    let (rows, width) = (5, 3);
    let data: Vec<f32> = (0..heads * rows * width)
        .map(|i| (1000 * (i / (rows * width)) + 10 * (i / width % rows) + i % width) as f32)
        .collect();
    let device = session.device().clone();
    // double_kv is [1, 2, 5, 3]; the single-head case uses the first head of its result.
    let full: Vec<f32> = if heads == 1 {
        [data.clone(), data.clone()].concat()
    } else {
        data.clone()
    };
    let x = BufferView::from_f32(&device, &[1, 2, rows, width], &full).unwrap();
    let out = session.call("module.double_kv", &[&x]).unwrap().remove(0);
    let doubled: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
    if heads == 1 {
        // The module is [1, 2, 5, 3]: upload the first head of its result as a device-local
        // [1, 1, 5, 3] view.
        let host = out.to_f32_vec().unwrap();
        let one = BufferView::from_f32(&device, &[1, 1, rows, width], &host[..rows * width]).unwrap();
        (one, doubled)
    } else {
        (out, doubled)
    }
}

fn expected_rows(data: &[f32], heads: usize, r0: usize, r1: usize) -> Vec<f32> {
    let (rows, width) = (5, 3);
    (0..heads)
        .flat_map(|h| data[(h * rows + r0) * width..(h * rows + r1) * width].to_vec())
        .collect()
}

fn rows_of_single_head_result(device_name: &str) {
    let mut session = open_session(device_name);
    let (view, data) = kv_result(&mut session, 1);
    for (r0, r1) in [(0, 5), (1, 3), (4, 5), (2, 2)] {
        let rows = view.rows(r0, r1).unwrap();
        assert_eq!(rows.shape(), vec![1, 1, r1 - r0, 3]);
        assert_close(&rows.to_f32_vec().unwrap(), &expected_rows(&data, 1, r0, r1));
    }
    let err = view.rows(3, 6).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { .. }),
        "rows past R must be rejected: {err:?}"
    );
}

fn rows_of_two_head_result(device_name: &str) {
    let mut session = open_session(device_name);
    let (view, data) = kv_result(&mut session, 2);
    for (r0, r1) in [(0, 5), (1, 4), (4, 5)] {
        let rows = view.rows(r0, r1).unwrap();
        assert_eq!(rows.shape(), vec![1, 2, r1 - r0, 3]);
        assert_close(&rows.to_f32_vec().unwrap(), &expected_rows(&data, 2, r0, r1));
    }
    // The full range is a fresh copy with the same contents, usable as a call input again.
    let all = view.rows(0, 5).unwrap();
    let again = session.call("module.double_kv", &[&all]).unwrap().remove(0);
    let expected: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
    assert_close(&again.to_f32_vec().unwrap(), &expected);
}

fn leading_rows_share_the_buffer(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let data: Vec<f32> = (0..15).map(|i| i as f32 + 0.5).collect();
    let view = BufferView::from_f32(&device, &[5, 3], &data).unwrap();
    let lead = view.leading(2).unwrap();
    assert_eq!(lead.shape(), vec![2, 3]);
    assert_close(&lead.to_f32_vec().unwrap(), &data[..6]);
    // Zero-copy: a write through the whole view is seen through the leading one.
    device
        .transfer(&[Transfer::Zero {
            target: &view,
            offset: 0,
            length: 3 * 4,
        }])
        .unwrap();
    assert_close(&lead.to_f32_vec().unwrap(), &[0.0, 0.0, 0.0, 3.5, 4.5, 5.5]);
    // A call input like any other view.
    let flat = BufferView::from_f32(&device, &[6], &data[..6]).unwrap();
    let out = session
        .call("module.double_dynamic", &[&flat.leading(4).unwrap()])
        .unwrap();
    assert_close(&out[0].to_f32_vec().unwrap(), &[1.0, 3.0, 5.0, 7.0]);
    assert_eq!(view.leading(5).unwrap().shape(), vec![5, 3]);
    let err = view.leading(6).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { .. }),
        "rows past N must be rejected: {err:?}"
    );
}

fn functions_share_one_session(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let forward = session.lookup("module.forward").unwrap();
    // Two tensors, and on Vulkan (async) a wait and a signal fence.
    let convention = if device_name == "vulkan" { "0rrrr_r" } else { "0rr_r" };
    assert_eq!(forward.calling_convention, convention);
    let x = BufferView::from_f32(&device, &[4], &[0.0; 4]).unwrap();
    let y = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let y2 = y.clone();
    drop(y);
    for _ in 0..3 {
        let out = session.call_function(&forward, &[&x, &y2]).unwrap();
        assert_close(&out[0].to_f32_vec().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        let doubled = session.call("module.double_dynamic", &[&out[0]]).unwrap();
        assert_close(&doubled[0].to_f32_vec().unwrap(), &[2.0, 4.0, 6.0, 8.0]);
    }
}

/// Two sessions with their own modules on one device, called in turn (the seed's three
/// archives). Vulkan refused the second one: "Vulkan queue frontier already assigned".
fn sessions_share_one_device(device_name: &str) {
    let device = Device::open(&instance(), device_name).unwrap();
    let vmfb = common::vmfb_for(device_name);
    let parameters = [("model", fixture().irpa.as_path())];
    let mut first = Session::open(&device, vmfb, &parameters).expect("first session");
    let mut second = Session::open(&device, vmfb, &parameters).expect("second session on the same device");
    let x = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    for _ in 0..2 {
        let a = first.call("module.double_dynamic", &[&x]).unwrap().remove(0);
        // One session's result is the other's input: both use the device's memory.
        let b = second.call("module.double_dynamic", &[&a]).unwrap().remove(0);
        assert_close(&b.to_f32_vec().unwrap(), &[4.0, 8.0, 12.0, 16.0]);
    }
    drop(first);
    let again = second.call("module.double_dynamic", &[&x]).unwrap().remove(0);
    assert_close(&again.to_f32_vec().unwrap(), &[2.0, 4.0, 6.0, 8.0]);
}

fn function_of_another_session_is_refused(device_name: &str) {
    let mut session = open_session(device_name);
    let other = open_session(device_name);
    let foreign = other.lookup("module.double_dynamic").unwrap();
    let device = session.device().clone();
    let x = BufferView::from_f32(&device, &[2], &[1.0, 2.0]).unwrap();
    let err = session.call_function(&foreign, &[&x]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("another session"), "{err}");
    // The session is unharmed.
    let out = session.call("module.double_dynamic", &[&x]).unwrap().remove(0);
    assert_close(&out.to_f32_vec().unwrap(), &[2.0, 4.0]);
}

/// A function keeps its module alive: after its session is gone it is still a valid value, and
/// a new session (which may be allocated where the old one was) refuses it instead of running
/// a freed module.
fn function_outlives_its_session(device_name: &str) {
    let session = open_session(device_name);
    let stale = session.lookup("module.double_dynamic").unwrap();
    drop(session);
    for _ in 0..4 {
        let mut fresh = open_session(device_name);
        let device = fresh.device().clone();
        let x = BufferView::from_f32(&device, &[2], &[1.0, 2.0]).unwrap();
        let err = fresh.call_function(&stale, &[&x]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        let own = fresh.lookup("module.double_dynamic").unwrap();
        let out = fresh.call_function(&own, &[&x]).unwrap().remove(0);
        assert_close(&out.to_f32_vec().unwrap(), &[2.0, 4.0]);
    }
    let convention = if device_name == "vulkan" { "0rrr_r" } else { "0r_r" };
    assert_eq!(stale.calling_convention, convention);
}

fn missing_function_is_named(device_name: &str) {
    let mut session = open_session(device_name);
    let err = session.call("module.nope", &[]).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::FunctionNotFound { .. }), "{err:?}");
    assert!(message.contains("module.nope"), "{message}");
    assert!(
        message.contains("module.forward"),
        "exports should be listed: {message}"
    );
}

#[test]
fn unknown_device_lists_valid_names() {
    let err = Device::open(&instance(), "cuda").unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::UnknownDevice { .. }), "{err:?}");
    for name in ["cuda", "local-task", "local-sync", "vulkan"] {
        assert!(message.contains(name), "{message}");
    }
}

/// The Vulkan driver reports the device's features (lavapipe here: 16-bit storage buffers and
/// 16-bit integers, a subgroup of at least 4 lanes with basic, arithmetic and shuffle operations
/// in compute shaders, the last through our build's `subgroup_operations` key); a key it does
/// not know is an error naming it.
#[test]
fn vulkan_reports_its_features() {
    let device = Device::open(&instance(), "vulkan").unwrap();
    for key in ["storage_buffer_16bit_access", "shader_int16"] {
        assert_eq!(device.query_i64("vulkan.feature", key).unwrap(), 1, "{key}");
    }
    let subgroup = device.query_i64("vulkan.device", "subgroup_size").unwrap();
    assert!(subgroup >= 4 && (subgroup as u64).is_power_of_two(), "{subgroup}");
    // VK_SUBGROUP_FEATURE_BASIC_BIT | ARITHMETIC_BIT | SHUFFLE_BIT.
    let operations = device.query_i64("vulkan.device", "subgroup_operations").unwrap();
    assert_eq!(operations & 0x15, 0x15, "{operations:#x}");
    let err = device.query_i64("vulkan.feature", "no_such_feature").unwrap_err();
    assert!(err.to_string().contains("no_such_feature"), "{err}");
}

/// Both ways of serving a parameter file give the same numbers on the CPU drivers (the sessions
/// of local-task/local-sync map theirs by default), and a mapped file outlives the provider and
/// session that imported buffers from it until the last buffer goes.
#[test]
fn mapped_and_read_parameters_agree() {
    let device = Device::open(&instance(), "local-task").unwrap();
    let mut results = Vec::new();
    for io in [ParameterIo::File, ParameterIo::Mapped] {
        let provider = ParameterProvider::open("model", &[fixture().irpa.as_path()], io).unwrap();
        let mut session = Session::open_with_providers(&device, &fixture().cpu_vmfb, &[provider]).unwrap();
        let x = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let y = BufferView::from_f32(&device, &[4], &[10.0, 20.0, 30.0, 40.0]).unwrap();
        let out = session.call("module.forward", &[&x, &y]).unwrap();
        drop(session);
        results.push(out[0].to_f32_vec().unwrap());
    }
    let expected: Vec<f32> = (0..4).map(|i| (i + 1) as f32 * W[i] + 10.0 * (i + 1) as f32).collect();
    assert_close(&results[0], &expected);
    assert_eq!(results[0], results[1], "mapped parameters differ from read ones");
    assert_eq!(ParameterIo::for_driver("local-sync"), ParameterIo::Mapped);
    assert_eq!(ParameterIo::for_driver("vulkan"), ParameterIo::File);
}

#[test]
fn missing_parameter_file_is_an_error() {
    let device = Device::open(&instance(), "local-sync").unwrap();
    let missing = fixture().irpa.with_file_name("absent.irpa");
    let err = Session::open(&device, &fixture().cpu_vmfb, &[("model", &missing)]).unwrap_err();
    assert!(err.to_string().contains("absent.irpa"), "{err}");
}

#[test]
fn missing_vmfb_is_an_error() {
    let device = Device::open(&instance(), "local-sync").unwrap();
    let missing = fixture().cpu_vmfb.with_file_name("absent.vmfb");
    let err = Session::open(&device, &missing, &[("model", &fixture().irpa)]).unwrap_err();
    assert!(err.to_string().contains("absent.vmfb"), "{err}");
}

#[test]
fn garbage_vmfb_reports_iree_message() {
    let device = Device::open(&instance(), "local-sync").unwrap();
    let garbage = fixture().irpa.with_file_name("garbage.vmfb");
    std::fs::write(&garbage, b"not a flatbuffer at all").unwrap();
    let err = Session::open(&device, &garbage, &[("model", &fixture().irpa)]).unwrap_err();
    assert!(matches!(err, Error::Iree { .. }), "{err:?}");
    assert!(err.to_string().contains("garbage.vmfb"), "{err}");
}

#[test]
fn missing_parameter_module_is_an_error() {
    // The module imports io_parameters: without parameters the session cannot be made.
    let device = Device::open(&instance(), "local-sync").unwrap();
    let err = Session::open(&device, &fixture().cpu_vmfb, &[]).unwrap_err();
    assert!(matches!(err, Error::Iree { .. }), "{err:?}");
}

#[test]
fn shape_and_data_must_agree() {
    let device = Device::open(&instance(), "local-sync").unwrap();
    let err = BufferView::from_f32(&device, &[2, 3], &[0.0; 5]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
}

#[test]
fn shape_overflowing_the_address_space_is_an_error() {
    let device = Device::open(&instance(), "local-sync").unwrap();
    // 2^62 elements of 4 bytes wrap to 0 bytes on 64 bits: equal to the empty data.
    let shapes: [&[usize]; 3] = [&[1 << 62], &[usize::MAX, 2], &[1 << 31, 1 << 31, 4]];
    for shape in shapes {
        let err = BufferView::from_f32(&device, shape, &[]).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("exceeds the address space")),
            "{shape:?}: {err:?}"
        );
    }
    let err = BufferView::from_i32(&device, &[1 << 62], &[]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
}

#[test]
fn local_task_with_explicit_workers() {
    for workers in [1, 2] {
        let device = Device::open_local_task(&instance(), workers).unwrap();
        let mut session = Session::open(&device, &fixture().cpu_vmfb, &[("model", &fixture().irpa)]).unwrap();
        let x = BufferView::from_f32(&device, &[4], &[1.0; 4]).unwrap();
        let y = BufferView::from_f32(&device, &[4], &[0.0; 4]).unwrap();
        let out = session.call("module.forward", &[&x, &y]).unwrap();
        assert_close(&out[0].to_f32_vec().unwrap(), &W);
    }
}

#[test]
fn views_outlive_session_and_device_handles() {
    let out = {
        let mut session = open_session("local-task");
        let device = session.device().clone();
        let x = BufferView::from_f32(&device, &[3], &[1.0, 2.0, 3.0]).unwrap();
        session.call("module.double_dynamic", &[&x]).unwrap().remove(0)
    };
    assert_close(&out.to_f32_vec().unwrap(), &[2.0, 4.0, 6.0]);
    let moved = std::thread::spawn(move || out.to_f32_vec().unwrap()).join().unwrap();
    assert_close(&moved, &[2.0, 4.0, 6.0]);
}

/// What a contract v2 session does per call: copy a call's new rows into rows of a
/// runtime-owned buffer, and fork a buffer by copying it whole, all in one submission.
/// Async calls return before they ran (Vulkan): a chain of calls, each fed the previous one's
/// result, a transfer of a result in the middle of the chain, and the reads at the end all
/// see every call before them done.
fn calls_queue_behind_each_other_and_reads_wait(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let increment = session.lookup("module.increment").unwrap();
    let mut value = BufferView::from_i32(&device, &[3], &[1, -5, 100]).unwrap();
    let midway = BufferView::allocate(&device, &[3], ElementType::I32).unwrap();
    for i in 1..=60 {
        value = session.call_function(&increment, &[&value]).unwrap().remove(0);
        if i == 30 {
            device
                .transfer(&[Transfer::Copy {
                    source: &value,
                    source_offset: 0,
                    target: &midway,
                    target_offset: 0,
                    length: 12,
                }])
                .unwrap();
        }
    }
    let last = value.to_i32_vec().unwrap();
    assert_eq!(last, [61, 55, 160], "after 60 calls on {device_name}");
    assert_eq!(
        midway.to_i32_vec().unwrap(),
        [31, 25, 130],
        "after 30 calls on {device_name}"
    );
    device.sync().unwrap();
}

/// A device's transfers signal one semaphore at increasing values: many in a row, and from
/// several threads at once, each see their own copy done when they return.
fn transfers_in_sequence_and_from_threads(device_name: &str) {
    let device = open_session(device_name).device().clone();
    let copy_through = |seed: i32| {
        let data: Vec<i32> = (0..64).map(|i| i * 7 + seed).collect();
        let source = BufferView::from_i32(&device, &[64], &data).unwrap();
        let target = BufferView::allocate(&device, &[64], ElementType::I32).unwrap();
        device
            .transfer(&[Transfer::Copy {
                source: &source,
                source_offset: 0,
                target: &target,
                target_offset: 0,
                length: 64 * 4,
            }])
            .unwrap();
        assert_eq!(target.to_i32_vec().unwrap(), data, "transfer {seed} on {device_name}");
    };
    for seed in 0..20 {
        copy_through(seed);
    }
    std::thread::scope(|s| {
        for t in 0..4 {
            let copy_through = &copy_through;
            s.spawn(move || (0..10).for_each(|i| copy_through(100 * (t + 1) + i)));
        }
    });
}

fn transfers_copy_and_zero_in_one_submission(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let (result, data) = kv_result(&mut session, 2);
    let cache = BufferView::allocate_f32(&device, &[8, 3]).unwrap();
    let fork = BufferView::allocate_f32(&device, &[8, 3]).unwrap();
    let row = 3 * 4;
    device
        .transfer(&[
            Transfer::Zero {
                target: &cache,
                offset: 0,
                length: 8 * row,
            },
            // Rows 1..3 of the call's result into rows 4..6 of the cache.
            Transfer::Copy {
                source: &result,
                source_offset: row,
                target: &cache,
                target_offset: 4 * row,
                length: 2 * row,
            },
            Transfer::Copy {
                source: &cache,
                source_offset: 0,
                target: &fork,
                target_offset: 0,
                length: 8 * row,
            },
        ])
        .unwrap();
    let mut want = vec![0.0f32; 24];
    want[12..18].copy_from_slice(&data[3..9]);
    assert_close(&cache.to_f32_vec().unwrap(), &want);
    assert_close(&fork.to_f32_vec().unwrap(), &want);
    assert_close(&cache.to_f32_vec_prefix(15).unwrap(), &want[..15]);

    // Out of bounds: refused before anything is submitted, the target keeps its contents.
    let err = device
        .transfer(&[
            Transfer::Zero {
                target: &fork,
                offset: 0,
                length: 8 * row,
            },
            Transfer::Copy {
                source: &result,
                source_offset: 0,
                target: &cache,
                target_offset: 7 * row,
                length: 2 * row,
            },
        ])
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_close(&fork.to_f32_vec().unwrap(), &want);
    let err = cache.to_f32_vec_prefix(25).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");

    // A view of another device is refused.
    let other = Device::open(&common::instance(), device_name).unwrap();
    let foreign = BufferView::allocate_f32(&other, &[8, 3]).unwrap();
    let err = device
        .transfer(&[Transfer::Zero {
            target: &foreign,
            offset: row,
            length: row,
        }])
        .unwrap_err();
    assert!(err.to_string().contains("a view of device"), "{err}");
}

/// `(key, valid)` of every dispatch event in a profile bundle, as the wheel's `iree-profile`
/// reads it (device timestamps on Vulkan, the executing threads' spans on the CPU drivers).
fn profiled_dispatches(path: &std::path::Path) -> Vec<(String, bool)> {
    iree_profile(&["dispatch", "--dispatch_events", "--format=jsonl"], path)
        .lines()
        .filter(|l| l.contains("dispatch_event\""))
        .map(|l| {
            let key = l
                .split("\"key\":\"")
                .nth(1)
                .and_then(|k| k.split('"').next())
                .unwrap_or("");
            (key.to_owned(), l.contains("\"valid\":true"))
        })
        .collect()
}

fn profiling_records_each_dispatch(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("profiles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let x = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let y = BufferView::from_f32(&device, &[4], &[10.0, 20.0, 30.0, 40.0]).unwrap();
    let expected: Vec<f32> = (0..4).map(|i| (i + 1) as f32 * W[i] + 10.0 * (i + 1) as f32).collect();
    let forward = |session: &mut Session| {
        session.call("module.forward", &[&x, &y]).unwrap()[0]
            .to_f32_vec()
            .unwrap()
    };
    let unprofiled = forward(&mut session);
    // A file that cannot be created: refused, nothing recording, the device still runs.
    let err = Profiling::dispatches(&device, &dir.join("missing/p.ireeprof"))
        .err()
        .expect("a profile in a missing directory");
    assert!(matches!(err, Error::Iree { .. }), "{err:?}");
    assert_eq!(forward(&mut session), unprofiled);

    let path = dir.join(format!("{device_name}.ireeprof"));
    let profiling = Profiling::dispatches(&device, &path).unwrap();
    for _ in 0..3 {
        // Recording changes no result.
        assert_eq!(forward(&mut session), unprofiled);
    }
    profiling.end().unwrap();
    assert_close(&unprofiled, &expected);
    let events = profiled_dispatches(&path);
    let forwards: Vec<_> = events
        .iter()
        .filter(|(k, _)| k.starts_with("forward_dispatch_"))
        .collect();
    assert!(
        !forwards.is_empty() && forwards.len() % 3 == 0 && forwards.iter().all(|(_, valid)| *valid),
        "3 calls of `forward`, each dispatch timed once: {events:?}"
    );
    // One recording at a time: a second session begins once the first ended, and records
    // only what ran after it began.
    let again = dir.join(format!("{device_name}-again.ireeprof"));
    let profiling = Profiling::dispatches(&device, &again).unwrap();
    assert_eq!(forward(&mut session), unprofiled);
    drop(profiling);
    let once = profiled_dispatches(&again)
        .into_iter()
        .filter(|(k, _)| k.starts_with("forward_dispatch_"))
        .count();
    assert_eq!(once * 3, forwards.len(), "one call recorded after the second begin");
    // Vulkan's profile also holds each call's queue allocations (their results), which show
    // whether the host held a call back (session 30: every step's were software-deferred).
    let allocas = queue_allocations(&path);
    if device_name == "vulkan" {
        assert!(allocas >= 3, "a queue allocation a call: {allocas}");
    }
}

/// `forward_into` (the results of `forward` plus the sum of `x * w`, and that sum as an i32)
/// of inputs `x`, `y`.
fn forward_into_expected(x: &[f32; 4], y: &[f32; 4]) -> (Vec<f32>, i32) {
    let xw: Vec<f32> = (0..4).map(|i| x[i] * W[i]).collect();
    let sum: f32 = xw.iter().sum();
    ((0..4).map(|i| xw[i] + y[i] + sum).collect(), sum as i32)
}

/// A function compiled with `iree.abi.output` / `iree.abi.transients` arguments: its storage is
/// read from the reflection, a plain call gets fresh storage, a given set holds the results
/// (and is overwritten by the next call given it), a set that does not fit is refused and the
/// session goes on, and on Vulkan such calls allocate nothing on the queue.
fn caller_storage_holds_the_results(device_name: &str) {
    let mut session = open_session(device_name);
    let device = session.device().clone();
    let into = session.lookup("module.forward_into").unwrap();
    let spec = into.storage().expect("forward_into takes its storage").clone();
    assert_eq!(
        spec.results,
        vec![(vec![4], ElementType::F32), (vec![1], ElementType::I32)]
    );
    assert!(spec.transients.is_some_and(|bytes| bytes > 0), "{spec:?}");
    assert_eq!(
        into.argument_count(),
        2,
        "the storage is not a tensor the caller passes"
    );
    let forward = session.lookup("module.forward").unwrap();
    assert!(forward.storage().is_none());
    // A tied result without transients: storage all the same.
    let increment = session.lookup("module.increment_into").unwrap();
    let only_results = StorageSpec {
        results: vec![(vec![3], ElementType::I32)],
        transients: None,
    };
    assert_eq!(increment.storage(), Some(&only_results));
    let ids = BufferView::from_i32(&device, &[3], &[1, 2, 3]).unwrap();
    let set = only_results.allocate(&device).unwrap();
    let out = session.call_function_with(&increment, &[&ids], Some(&set)).unwrap();
    assert!(set.holds(&out[0]));
    assert_eq!(out[0].to_i32_vec().unwrap(), [2, 3, 4]);

    let (xa, ya) = ([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]);
    let (xb, yb) = ([-1.0, 0.5, 8.0, 2.0], [0.0, 1.0, 2.0, 3.0]);
    let view = |data: &[f32; 4]| BufferView::from_f32(&device, &[4], data).unwrap();
    let (xa, ya, xb, yb, data) = (view(&xa), view(&ya), view(&xb), view(&yb), (xa, ya, xb, yb));
    let read = |results: &[BufferView]| (results[0].to_f32_vec().unwrap(), results[1].to_i32_vec().unwrap()[0]);
    let (a, b) = (
        forward_into_expected(&data.0, &data.1),
        forward_into_expected(&data.2, &data.3),
    );

    let fresh = session.call_function(&into, &[&xa, &ya]).unwrap();
    let (values, n) = read(&fresh);
    assert_close(&values, &a.0);
    assert_eq!(n, a.1);

    let set = spec.allocate(&device).unwrap();
    let first = session.call_function_with(&into, &[&xa, &ya], Some(&set)).unwrap();
    assert!(
        first.iter().all(|r| set.holds(r)),
        "the results are views of the storage"
    );
    assert!(!fresh.iter().any(|r| set.holds(r)));
    assert_eq!(read(&first), read(&fresh));
    let second = session.call_function_with(&into, &[&xb, &yb], Some(&set)).unwrap();
    let (values, n) = read(&second);
    assert_close(&values, &b.0);
    assert_eq!(n, b.1);
    assert_eq!(read(&first), read(&second), "the first call's results were overwritten");
    assert_eq!(read(&fresh).1, a.1, "fresh storage is the call's own");

    // Sets that do not fit, storage for a function that takes none, none for one that does:
    // refused by name, and the session still computes.
    let wrong = StorageSpec {
        results: vec![(vec![5], ElementType::F32), (vec![1], ElementType::I32)],
        transients: spec.transients,
    };
    let small = StorageSpec {
        transients: Some(1),
        ..spec.clone()
    };
    let none = StorageSpec {
        transients: None,
        ..spec.clone()
    };
    for bad in [&wrong, &small, &none].map(|s| s.allocate(&device).unwrap()) {
        let err = session.call_function_with(&into, &[&xa, &ya], Some(&bad)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { op: "call", .. }), "{err:?}");
    }
    let err = session.call_function_with(&into, &[&xa, &ya], None).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("none was given")),
        "{err:?}"
    );
    let err = session
        .call_function_with(&forward, &[&xa, &ya], Some(&set))
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("takes no storage")),
        "{err:?}"
    );
    let again = session.call_function_with(&into, &[&xa, &ya], Some(&set)).unwrap();
    assert_eq!(read(&again), read(&fresh));

    // No queue allocation: what lets a Vulkan call be recorded while the one before it runs.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("profiles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{device_name}-storage.ireeprof"));
    let profiling = Profiling::dispatches(&device, &path).unwrap();
    for _ in 0..3 {
        session.call_function_with(&into, &[&xb, &yb], Some(&set)).unwrap();
    }
    assert_eq!(read(&first), read(&second));
    profiling.end().unwrap();
    assert_eq!(
        queue_allocations(&path),
        0,
        "calls given their storage allocate nothing on the queue"
    );
}

/// The queue allocations `iree-profile memory` reads from the profile at `path`.
fn queue_allocations(path: &std::path::Path) -> usize {
    iree_profile(&["memory", "--format=jsonl"], path)
        .lines()
        .filter(|l| l.contains("\"event_type\":\"queue_alloca\""))
        .count()
}

/// What the wheel's `iree-profile ARGS PATH` prints (it must succeed).
fn iree_profile(args: &[&str], path: &std::path::Path) -> String {
    let out = std::process::Command::new(common::tool("iree-profile"))
        .args(args)
        .arg(path)
        .output()
        .expect("run iree-profile");
    assert!(
        out.status.success(),
        "iree-profile: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
