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
