//! Sessions used on several threads of one process at once — what an app does when it opens a
//! KV session and a redecode session from different threads. Its own test binary, so that the
//! threads below are the first to ask for the process-wide instance, all at the same moment.

mod common;

use std::sync::{Arc, Barrier};

use common::{fixture, vmfb_for, W};
use iree_runtime::{BufferView, Device, Instance, Session};

const THREADS: usize = 6;

/// Each thread makes its own device and session and checks every result. Before the instance
/// was process-wide, a thread creating its instance while another was calling failed that call
/// with "ref type mismatch" within the first few hundred calls.
fn concurrent_sessions(device_name: &'static str, calls: usize) {
    fixture(); // compile once, before the threads race
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                let instance = Instance::shared().expect("shared instance");
                let device = Device::open(&instance, device_name).expect("open device");
                let mut session =
                    Session::open(&device, vmfb_for(device_name), &[("model", &fixture().irpa)]).expect("open session");
                for call in 0..calls {
                    let x: Vec<f32> = (0..4).map(|i| (t * calls + call + i) as f32).collect();
                    let y = [1.0, -1.0, 0.5, 0.0];
                    let xv = BufferView::from_f32(&device, &[4], &x).unwrap();
                    let yv = BufferView::from_f32(&device, &[4], &y).unwrap();
                    let out = session
                        .call("module.forward", &[&xv, &yv])
                        .unwrap_or_else(|e| panic!("thread {t}, call {call}: {e}"))
                        .remove(0)
                        .to_f32_vec()
                        .unwrap();
                    let want: Vec<f32> = (0..4).map(|i| x[i] * W[i] + y[i]).collect();
                    assert_eq!(out, want, "thread {t}, call {call}");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a session thread failed");
    }
}

#[test]
fn local_task_sessions_on_many_threads() {
    concurrent_sessions("local-task", 300);
}

#[test]
fn local_sync_sessions_on_many_threads() {
    concurrent_sessions("local-sync", 300);
}

#[test]
fn instance_is_one_per_process() {
    let a = Instance::shared().unwrap();
    let b = std::thread::spawn(|| Instance::shared().unwrap()).join().unwrap();
    assert!(a.same_as(&b));
}

#[test]
fn vulkan_sessions_on_many_threads() {
    // Fewer calls: lavapipe is slow, and the race was in instance creation, not in the driver.
    concurrent_sessions("vulkan", 40);
}

/// Devices opened on one thread while a session calls on another — what the JNI does when an app
/// opens sessions from several threads. Opening a local device used to create a VM instance for
/// the VMVX executable loader, and creating a VM instance rewrites process-global type ids
/// (zeroing them first): the calling thread then failed with "ref type mismatch" (found by the JNI
/// stress test, about once in 10,000 session openings). The runtime is now built without the
/// VMVX loader (`iree-runtime-sys/cmake/CMakeLists.txt`).
#[test]
fn devices_opened_beside_running_calls() {
    fixture();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opener = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let instance = Instance::shared().unwrap();
            let mut opened = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for name in ["local-task", "local-sync"] {
                    drop(Device::open(&instance, name).expect("open device"));
                }
                opened += 2;
            }
            opened
        })
    };
    let device = Device::open(&Instance::shared().unwrap(), "local-sync").unwrap();
    let mut session = Session::open(&device, vmfb_for("local-sync"), &[("model", &fixture().irpa)]).unwrap();
    let x = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let y = BufferView::from_f32(&device, &[4], &[0.0; 4]).unwrap();
    let want: Vec<f32> = (0..4).map(|i| (i + 1) as f32 * W[i]).collect();
    let started = std::time::Instant::now();
    let mut calls = 0;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while started.elapsed() < std::time::Duration::from_secs(5) {
            let out = session
                .call("module.forward", &[&x, &y])
                .unwrap_or_else(|e| panic!("call {calls}: {e}"));
            assert_eq!(out[0].to_f32_vec().unwrap(), want);
            calls += 1;
        }
    }));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let opened = opener.join().expect("the opening thread failed");
    assert!(opened > 0 && calls > 0, "{opened} devices opened, {calls} calls");
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
