//! Shared helpers of the reference's tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use backend_reference::{ReferenceKv, ReferenceModel};
use kv_core::tolerance::{assert_layers_close, Tolerance};
use kv_core::{KvBackend, WindowRule};

pub const ALL_FIXTURES: [&str; 5] = [
    "tiny-gemma3:7",
    "tiny-gemma3-gqa:7",
    "tiny-llama:7",
    "tiny-qwen2:7",
    "tiny-qwen3:7",
];

/// The fixture's directory. Serialised: `fixtures::materialize` names its temporary directory
/// by process id only, so two threads of one test binary writing the same fixture collide.
pub fn fixture_dir(name: &str) -> PathBuf {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    fixtures::materialize(name).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

pub fn model(name: &str) -> Arc<ReferenceModel> {
    let dir = fixture_dir(name);
    ReferenceModel::open(&dir).unwrap_or_else(|e| panic!("open {name}: {e}"))
}

pub fn session(name: &str) -> ReferenceKv {
    ReferenceKv::new(model(name), WindowRule::Exact)
}

/// Deterministic in-vocabulary tokens.
pub fn tokens(n: usize, vocab: usize, salt: u64) -> Vec<i32> {
    let mut state = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as i32
        })
        .collect()
}

/// Every layer of two sessions, on their common rows.
#[track_caller]
pub fn assert_sessions_close(what: &str, a: &impl KvBackend, b: &impl KvBackend, tol: Tolerance) {
    assert_eq!(a.position(), b.position(), "{what}: positions differ");
    for layer in 0..a.spec().n_layers {
        let (ka, kb) = (a.read_layer(layer).unwrap(), b.read_layer(layer).unwrap());
        assert_layers_close(&format!("{what} layer {layer}"), &ka, &kb, tol);
    }
}

/// Exact equality of every layer and the position (snapshots, restores, failed calls).
#[track_caller]
pub fn assert_same_state(what: &str, a: &impl KvBackend, b: &impl KvBackend) {
    assert_eq!(a.position(), b.position(), "{what}: positions differ");
    for layer in 0..a.spec().n_layers {
        assert_eq!(
            a.read_layer(layer).unwrap(),
            b.read_layer(layer).unwrap(),
            "{what}: layer {layer}"
        );
    }
    assert_eq!(a.last_logits(), b.last_logits(), "{what}: last logits differ");
}
