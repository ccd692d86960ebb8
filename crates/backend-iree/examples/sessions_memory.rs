//! What a further session on one model costs in memory: opens `N` KV sessions on one artifact
//! directory, prefills each with its own prompt, and prints the process's resident memory after
//! each (`VmRSS`, and the peak `VmHWM`, from `/proc/self/status`). Sessions on the same files and
//! CPU device share one IREE context (`backend_iree::shared`), so they should add only their
//! caches. Run once per `N` (the peak is per process):
//!
//! ```sh
//! cargo run --release -p backend-iree --example sessions_memory -- DIR N [PREFIX_TOKENS] [separate]
//! ```
//!
//! `separate` gives each session a local-task device of its own (another worker count), so
//! nothing is shared: what sessions cost without `backend_iree::shared`.

use std::path::PathBuf;

use backend_iree::{open_module_count, IreeKvBackend, IreeOptions};
use kv_core::KvBackend;

fn status_mb(key: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir: PathBuf = args
        .next()
        .ok_or("usage: sessions_memory DIR N [PREFIX_TOKENS]")?
        .into();
    let n: usize = args
        .next()
        .ok_or("usage: sessions_memory DIR N [PREFIX_TOKENS]")?
        .parse()?;
    let prefix_tokens: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(200);
    let separate = args.next().as_deref() == Some("separate");
    let mut sessions = Vec::with_capacity(n);
    for i in 0..n {
        let options = IreeOptions {
            workers: separate.then_some(2 + i),
            ..IreeOptions::new("local-task")
        };
        let mut s = IreeKvBackend::open(&dir, options)?;
        let vocab = s.spec().vocab_size as u64;
        let prompt: Vec<i32> = (0..prefix_tokens as u64)
            .map(|t| (1 + (t * 7919 + i as u64 * 104_729) % (vocab - 1)) as i32)
            .collect();
        s.prefill(&prompt)?;
        sessions.push(s);
        println!(
            "sessions {:>2}  contexts {}  VmRSS {:>8.1} MB  VmHWM {:>8.1} MB",
            i + 1,
            open_module_count(),
            status_mb("VmRSS:"),
            status_mb("VmHWM:")
        );
    }
    Ok(())
}
