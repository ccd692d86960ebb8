//! What the allowed-token mask costs a decode step (issue 31): median step times of v2 exports
//! named by `SKAINET_MASK_COST` (artifact directories, `:`-separated; exports made before the
//! mask run unmasked only), in interleaved rounds: no mask (the resident all-ones buffer), one
//! mask set once, and a new mask before every step (one upload each, as a grammar does).
//!
//! `SKAINET_MASK_COST=DIR[:DIR...] cargo test -p backend-iree --test mask_cost -- --ignored --nocapture`

use std::time::{Duration, Instant};

use backend_iree::{IreeKvBackend, IreeOptions};
use kv_core::allowed::AllowedTokens;
use kv_core::KvBackend;

const STEPS: usize = 24;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Per-step times of `STEPS` steps after a 40-token prefill, under `masks` (cycled: one mask
/// each step; none at all when empty).
fn steps(dir: &std::path::Path, masks: &[AllowedTokens]) -> Vec<Duration> {
    let mut s = IreeKvBackend::open(dir, IreeOptions::new("local-task")).unwrap();
    let prompt: Vec<i32> = (0..40).map(|i| (i * 977 + 5) % 20_000 + 2).collect();
    let mut token = s.prefill(&prompt).unwrap();
    let mut times = Vec::with_capacity(STEPS);
    for i in 0..STEPS {
        let t = Instant::now();
        if !masks.is_empty() {
            s.set_allowed(Some(&masks[i % masks.len()])).unwrap();
        }
        token = s.step(token).unwrap();
        times.push(t.elapsed());
        assert!(masks.is_empty() || masks[i % masks.len()].allows(token));
    }
    times
}

#[test]
#[ignore = "a measurement: SKAINET_MASK_COST=DIR[:DIR...]"]
fn mask_step_cost() {
    let dirs = std::env::var("SKAINET_MASK_COST").expect("SKAINET_MASK_COST=DIR[:DIR...]");
    let dirs: Vec<std::path::PathBuf> = dirs.split(':').map(Into::into).collect();
    for round in 0..3 {
        for dir in &dirs {
            let m = kv_core::Manifest::load(dir).unwrap();
            let vocab = m.spec.vocab_size;
            let every = |n: i32, from: i32| {
                let ids: Vec<i32> = (from..vocab as i32).step_by(n as usize).collect();
                AllowedTokens::from_ids(vocab, &ids).unwrap()
            };
            let mut modes: Vec<(&str, Vec<AllowedTokens>)> = vec![("no mask", Vec::new())];
            if m.allowed_mask {
                modes.push(("one mask, set once", vec![every(3, 0)]));
                modes.push(("a new mask each step", vec![every(3, 0), every(3, 1), every(5, 2)]));
            }
            for (name, masks) in modes {
                let t = median(steps(dir, &masks));
                println!(
                    "round {round} {} (allowedMask {}): {name}: median step {:.2} ms",
                    dir.display(),
                    m.allowed_mask,
                    t.as_secs_f64() * 1e3
                );
            }
        }
    }
}
