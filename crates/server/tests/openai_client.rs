//! The real client: OpenAI's Python package (pinned in scripts/setup.sh, in the project's venv)
//! drives three servers on 127.0.0.1 over the tiny fixture through
//! scripts/openai-client-test.py: a streamed chat, tool calls, a prefix-cache hit equal to a cold
//! server's answer id for id, concurrent requests, oversized and malformed requests, 429 on a
//! full queue and a disconnect that cancels.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use backend_reference::{ReferenceKv, ReferenceModel};
use kv_core::{Manifest, WindowRule};
use server::{RunningServer, ServerConfig};

const MODEL: &str = "tiny-gemma3:7";

fn start(config: ServerConfig) -> RunningServer {
    let dir: PathBuf = fixtures::materialize(MODEL).unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    let tok = engine::load_tokenizer(&dir, &manifest).unwrap();
    let backend = ReferenceKv::new(ReferenceModel::open(&dir).unwrap(), WindowRule::Exact);
    server::start(vec![backend], tok, MODEL, config).unwrap()
}

#[test]
fn openai_python_client_drives_the_server() {
    let tools = std::env::var_os("SKAINET_KV_TOOLS")
        .map(PathBuf::from)
        .expect("SKAINET_KV_TOOLS is not set: `source scripts/env.sh` (and run scripts/setup.sh once)");
    let python = tools.join("venv/bin/python");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let has_client = Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_client,
        "{} cannot import openai: run scripts/setup.sh (it installs the pinned openai package)",
        python.display()
    );
    let base = ServerConfig {
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        prefix_block: Some(16),
        ..ServerConfig::default()
    };
    let warm = start(base.clone());
    let cold = start(ServerConfig {
        prefix_cache_bytes: 0,
        ..base.clone()
    });
    let busy = start(ServerConfig {
        queue_capacity: 1,
        ..base
    });
    let url = |s: &RunningServer| format!("http://{}", s.addr());
    let t = Instant::now();
    let out = Command::new(&python)
        .arg(root.join("scripts/openai-client-test.py"))
        .args([url(&warm), url(&cold), url(&busy)])
        .arg(root.join("data/tools/fixture-tools.json"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "the client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    println!("client run: {:.1} s", t.elapsed().as_secs_f64());
}
