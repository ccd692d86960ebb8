//! What the runtime tests share: the module compiled at test time, its parameter archive and
//! the process-wide instance.

#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use iree_runtime::{Device, Instance, Session};

pub const MODULE: &str = r#"
module @module {
  util.global private @w = #flow.parameter.named<"model"::"w"> : tensor<4xf32>
  func.func @forward(%x: tensor<4xf32>, %y: tensor<4xf32>) -> tensor<4xf32> {
    %w = util.global.load @w : tensor<4xf32>
    %0 = stablehlo.multiply %x, %w : tensor<4xf32>
    %1 = stablehlo.add %0, %y : tensor<4xf32>
    return %1 : tensor<4xf32>
  }
  func.func @double_dynamic(%x: tensor<?xf32>) -> tensor<?xf32> {
    %0 = stablehlo.add %x, %x : tensor<?xf32>
    return %0 : tensor<?xf32>
  }
  func.func @double_kv(%x: tensor<1x2x5x3xf32>) -> tensor<1x2x5x3xf32> {
    %0 = stablehlo.add %x, %x : tensor<1x2x5x3xf32>
    return %0 : tensor<1x2x5x3xf32>
  }
  func.func @forward_into(%x: tensor<4xf32>, %y: tensor<4xf32>,
      %out: tensor<4xf32> {iree.abi.output = 0 : index}, %n: tensor<1xi32> {iree.abi.output = 1 : index},
      %t: !hal.buffer {iree.abi.transients}) -> (tensor<4xf32>, tensor<1xi32>) {
    %w = util.global.load @w : tensor<4xf32>
    %0 = stablehlo.multiply %x, %w : tensor<4xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %s = stablehlo.reduce(%0 init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4xf32>, tensor<f32>) -> tensor<f32>
    %b = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %1 = stablehlo.add %0, %y : tensor<4xf32>
    %2 = stablehlo.add %1, %b : tensor<4xf32>
    %c = stablehlo.convert %s : (tensor<f32>) -> tensor<i32>
    %r = stablehlo.reshape %c : (tensor<i32>) -> tensor<1xi32>
    return %2, %r : tensor<4xf32>, tensor<1xi32>
  }
  func.func @increment_into(%x: tensor<3xi32>, %out: tensor<3xi32> {iree.abi.output = 0 : index}) -> tensor<3xi32> {
    %c = stablehlo.constant dense<1> : tensor<3xi32>
    %0 = stablehlo.add %x, %c : tensor<3xi32>
    return %0 : tensor<3xi32>
  }
  func.func @increment(%x: tensor<3xi32>) -> tensor<3xi32> {
    %c = stablehlo.constant dense<1> : tensor<3xi32>
    %0 = stablehlo.add %x, %c : tensor<3xi32>
    return %0 : tensor<3xi32>
  }
}
"#;

/// The parameter `model::w` stored in the archive.
pub const W: [f32; 4] = [1.5, -2.0, 0.25, 4.0];

pub struct Fixture {
    pub cpu_vmfb: PathBuf,
    pub vulkan_vmfb: PathBuf,
    pub irpa: PathBuf,
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `name` on PATH, else in `<workspace>/.tools/venv/bin`; panics with what to do otherwise.
pub fn tool(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
        .unwrap_or_default();
    let local = workspace_root().join(".tools/venv/bin").join(name);
    on_path.or_else(|| local.is_file().then_some(local)).unwrap_or_else(|| {
        panic!(
            "`{name}` not found on PATH nor in .tools/venv/bin: run scripts/setup.sh and \
             `source scripts/env.sh` (these tests compile their module with the IREE tools)"
        )
    })
}

pub fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("iree-runtime-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mlir = dir.join("module.mlir");
        std::fs::write(&mlir, MODULE).unwrap();
        let compile = |out: &Path, target: &[&str]| {
            run(Command::new(tool("iree-compile"))
                .arg("--iree-input-type=stablehlo")
                .args(target)
                .arg(&mlir)
                .arg("-o")
                .arg(out));
        };
        let fixture = Fixture {
            cpu_vmfb: dir.join("module-cpu.vmfb"),
            vulkan_vmfb: dir.join("module-vulkan.vmfb"),
            irpa: dir.join("params.irpa"),
        };
        compile(
            &fixture.cpu_vmfb,
            &[
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=generic",
            ],
        );
        // Async functions on Vulkan, as the exporter compiles them: the `vulkan` tests call
        // through fences, the CPU ones synchronously.
        compile(
            &fixture.vulkan_vmfb,
            &[
                "--iree-hal-target-device=vulkan",
                "--iree-execution-model=async-external",
            ],
        );
        let script = format!(
            "import iree.runtime as rt, numpy as np, sys; \
             rt.save_archive_file({{'w': np.array({W:?}, dtype=np.float32)}}, sys.argv[1])"
        );
        run(Command::new(tool("python")).arg("-c").arg(script).arg(&fixture.irpa));
        fixture
    })
}

pub fn instance() -> Instance {
    Instance::shared().expect("create instance")
}

pub fn vmfb_for(device: &str) -> &'static Path {
    match device {
        "vulkan" => &fixture().vulkan_vmfb,
        _ => &fixture().cpu_vmfb,
    }
}

pub fn open_session(device_name: &str) -> Session {
    let device = Device::open(&instance(), device_name).expect("open device");
    Session::open(&device, vmfb_for(device_name), &[("model", &fixture().irpa)]).expect("open session")
}

#[track_caller]
pub fn assert_close(actual: &[f32], expected: &[f32]) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "lengths differ: {actual:?} vs {expected:?}"
    );
    let bad: Vec<_> = actual
        .iter()
        .zip(expected)
        .enumerate()
        .filter(|(_, (a, e))| (**a - **e).abs() > 1e-6 * e.abs().max(1.0))
        .take(5)
        .collect();
    assert!(bad.is_empty(), "first mismatches (index, (actual, expected)): {bad:?}");
}
