//! What checking a snapshot file costs on load, on files of Gemma 3 270M's geometry: the whole
//! check (`snapshot_file::verify`: length, CRC-32 and every value finite, in one pass), the CRC
//! pass alone and the finiteness scan alone, medians of repeated runs over a file in the page
//! cache.
//!
//! `cargo run --release -p kv-core --example snapshot_check_cost [REPEATS]`

use std::io::Write;
use std::time::Instant;

use kv_core::manifest::{CacheType, CONTRACT_VERSION};
use kv_core::snapshot_file::{self, LayerHeader, SnapshotHeader, FORMAT_VERSION, MAGIC};
use kv_core::KvSpec;

fn gemma3_270m() -> KvSpec {
    KvSpec {
        n_layers: 18,
        head_dim: 256,
        n_heads: 4,
        n_kv_heads: 1,
        hidden_size: 640,
        vocab_size: 262_144,
        sliding_window: 512,
        global_layer_period: 6,
        chunk: 32,
        seq: 1024,
        max_positions: 2048,
        ..KvSpec::default()
    }
}

/// A valid file at `position` (each layer holding what a session there must: every row on a
/// global layer, the window on a sliding one), values a deterministic finite pattern.
fn write_file(path: &std::path::Path, spec: &KvSpec, position: usize, ty: CacheType) -> u64 {
    let layers: Vec<LayerHeader> = (0..spec.n_layers)
        .map(|l| {
            let rows = match spec.window(spec.layer_kind(l)) {
                Some(w) => position.min(w),
                None => position,
            };
            LayerHeader {
                first_position: position - rows,
                rows,
            }
        })
        .collect();
    let mut data = Vec::new();
    let mut x = 0x2545_f491u32;
    for layer in &layers {
        for _ in 0..2 {
            let values: Vec<f32> = (0..spec.n_kv_heads * layer.rows * spec.head_dim)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 20_000) as f32 / 1000.0 - 10.0
                })
                .collect();
            let mut bytes = ty.encode(&values);
            bytes.resize(bytes.len().div_ceil(64) * 64, 0);
            data.extend(bytes);
        }
    }
    let header = SnapshotHeader {
        contract_version: CONTRACT_VERSION,
        model: "0".repeat(64),
        spec: spec.clone(),
        window_rule: "exact".into(),
        position,
        dtype: if ty == CacheType::F32 { "f32" } else { "f16" }.into(),
        layers,
        data_bytes: data.len() as u64,
        data_crc32: crc32fast::hash(&data),
        saved_by: "snapshot_check_cost".into(),
        prompt_digest: None,
    };
    let json = serde_json::to_vec(&header).unwrap();
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    file.write_all(&MAGIC).unwrap();
    file.write_all(&FORMAT_VERSION.to_le_bytes()).unwrap();
    file.write_all(&(json.len() as u32).to_le_bytes()).unwrap();
    file.write_all(&json).unwrap();
    file.write_all(&vec![0; (16 + json.len()).div_ceil(64) * 64 - 16 - json.len()])
        .unwrap();
    file.write_all(&data).unwrap();
    file.flush().unwrap();
    data.len() as u64
}

fn median_ms(repeats: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[repeats / 2]
}

fn main() {
    let repeats: usize = std::env::args().nth(1).map_or(31, |s| s.parse().unwrap());
    let spec = gemma3_270m();
    let dir = tempfile::tempdir().unwrap();
    println!("file                     data MB   verify ms   CRC ms   finite ms   finite MB/s");
    for (position, ty) in [
        (843, CacheType::F32),
        (2048, CacheType::F32),
        (843, CacheType::F16),
        (2048, CacheType::F16),
    ] {
        let path = dir.path().join("s.skvsnap");
        let data_bytes = write_file(&path, &spec, position, ty);
        snapshot_file::verify(&path).expect("the file is valid");
        let bytes = std::fs::read(&path).unwrap();
        let data = &bytes[bytes.len() - data_bytes as usize..];
        let verify = median_ms(repeats, || {
            std::hint::black_box(snapshot_file::verify(&path).unwrap());
        });
        let crc = median_ms(repeats, || {
            std::hint::black_box(crc32fast::hash(std::hint::black_box(data)));
        });
        let finite = median_ms(repeats, || {
            assert!(snapshot_file::first_non_finite(ty, std::hint::black_box(data)).is_none());
        });
        println!(
            "{:>4} tokens {:>3}  {:>13.1} {:>11.3} {:>8.3} {:>11.3} {:>13.0}",
            position,
            if ty == CacheType::F32 { "f32" } else { "f16" },
            data_bytes as f64 / 1e6,
            verify,
            crc,
            finite,
            data_bytes as f64 / 1e6 / (finite / 1e3)
        );
    }
}
