//! Driving `iree-compile` (the pinned `iree-base-compiler` wheel) for CPU and Vulkan.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{ExportError, Result};

/// The compiler the artifacts are made with (recorded in the manifest's provenance).
pub const COMPILER_VERSION: &str = "iree-base-compiler 3.13.0";

/// A compilation target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `llvm-cpu` for `local-task` / `local-sync`; `cpu` is `--iree-llvmcpu-target-cpu`
    /// (`generic` travels; `x86-64-v3` is faster on this kind of machine; never `host` for
    /// artifacts that travel).
    Cpu { cpu: String },
    /// `vulkan-spirv`; `target` is `--iree-vulkan-target` (`None` = IREE's default,
    /// `vp_android_baseline_2022`; e.g. `valhall`, `adreno`).
    Vulkan { target: Option<String> },
}

impl Target {
    pub fn cpu() -> Self {
        Target::Cpu { cpu: "generic".into() }
    }

    pub fn vulkan() -> Self {
        Target::Vulkan { target: None }
    }

    /// The key of this target in the manifest's `modules` (`llvm-cpu`, `vulkan`, `vulkan-valhall`).
    pub fn key(&self) -> String {
        match self {
            Target::Cpu { cpu } if cpu == "generic" => "llvm-cpu".into(),
            Target::Cpu { cpu } => format!("llvm-cpu-{cpu}"),
            Target::Vulkan { target: None } => "vulkan".into(),
            Target::Vulkan { target: Some(t) } => format!("vulkan-{t}"),
        }
    }

    /// The runtime device that runs this target's modules.
    pub fn device(&self) -> &'static str {
        match self {
            Target::Cpu { .. } => "local-task",
            Target::Vulkan { .. } => "vulkan",
        }
    }

    pub fn flags(&self) -> Vec<String> {
        match self {
            Target::Cpu { cpu } => vec![
                "--iree-hal-target-device=local".into(),
                "--iree-hal-local-target-device-backends=llvm-cpu".into(),
                format!("--iree-llvmcpu-target-cpu={cpu}"),
            ],
            Target::Vulkan { target } => {
                // Async functions (a wait and a signal fence after the tensors): the runtime
                // passes fences on a semaphore that outlives the call, where a synchronous
                // function creates one per call (~0.65 ms each on the H200: docs/journal,
                // session 13). `iree_runtime::Session::call_function` tells them apart.
                let device = "--iree-hal-target-device=vulkan".to_string();
                let subgroups = target.as_deref().and_then(crate::profile::portable_subgroup_size);
                let (device, target_flags) = match (subgroups, target.as_deref()) {
                    (Some(size), _) => (crate::profile::portable_subgroup_flags(size), Vec::new()),
                    (None, Some(crate::profile::PORTABLE_16BIT)) => (
                        vec![device],
                        crate::profile::PORTABLE_16BIT_FLAGS
                            .iter()
                            .map(|s| s.to_string())
                            .collect(),
                    ),
                    (None, Some(t)) => (vec![device], vec![format!("--iree-vulkan-target={t}")]),
                    (None, None) => (vec![device], Vec::new()),
                };
                let mut f = device;
                f.push("--iree-execution-model=async-external".to_string());
                f.extend(target_flags);
                f
            }
        }
    }
}

/// `IREE_COMPILE`, else `iree-compile` on `PATH`, else `venv/bin/iree-compile` in the tools root
/// ([`kv_paths::Root::Tools`]: `$SKAINET_KV_TOOLS`, else the platform's data directory).
pub fn find_compiler() -> Result<PathBuf> {
    find_tool("IREE_COMPILE", "iree-compile", "venv/bin/iree-compile")
        .map_err(|searched| ExportError::CompilerMissing { searched })
}

/// The tool `name`: the file `env` names, else `name` on `PATH`, else `in_tools` under the tools
/// root. Errs with the places searched.
pub(crate) fn find_tool(env: &str, name: &str, in_tools: &str) -> std::result::Result<PathBuf, String> {
    let mut searched = Vec::new();
    if let Some(p) = std::env::var_os(env) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        searched.push(format!("{env}={}", p.display()));
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(p) = std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file()) {
            return Ok(p);
        }
    }
    searched.push("PATH".into());
    match kv_paths::Root::Tools.join(in_tools) {
        Ok(p) if p.is_file() => return Ok(p),
        Ok(p) => searched.push(p.display().to_string()),
        Err(e) => searched.push(e.to_string()),
    }
    Err(searched.join(", "))
}

/// Compiles `mlir` for `target` into `out`. A failure names the function holding the first
/// `error:` diagnostic (or the module's functions) and quotes that line.
pub fn compile(mlir: &Path, target: &Target, out: &Path) -> Result<()> {
    compile_with(mlir, target, out, &[])
}

/// [`compile`] with extra `iree-compile` flags (e.g. `--iree-opt-const-expr-hoisting=false`,
/// which halves compile time at the price of widening the weights on every call instead of once
/// at load).
pub fn compile_with(mlir: &Path, target: &Target, out: &Path, extra: &[String]) -> Result<()> {
    let compiler = find_compiler()?;
    let output = Command::new(&compiler)
        .arg("--iree-input-type=stablehlo")
        .args(target.flags())
        .args(extra)
        .arg(mlir)
        .arg("-o")
        .arg(out)
        .output()
        .map_err(ExportError::io("running iree-compile", &compiler))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let first = stderr
        .lines()
        .find(|l| l.contains("error:"))
        .map(str::to_string)
        .unwrap_or_else(|| {
            format!(
                "exit status {}; {}",
                output.status,
                stderr.lines().last().unwrap_or("no diagnostic")
            )
        });
    let text = std::fs::read_to_string(mlir).unwrap_or_default();
    let function = function_at(&text, diagnostic_line(&first, mlir)).unwrap_or_else(|| {
        let names = function_names(&text);
        if names.is_empty() {
            "<no function>".into()
        } else {
            names.join(", ")
        }
    });
    Err(ExportError::Compile {
        function,
        target: target.key(),
        mlir: mlir.to_path_buf(),
        diagnostic: first,
    })
}

/// `path:LINE:COL: error: ...` → LINE.
fn diagnostic_line(diag: &str, mlir: &Path) -> Option<usize> {
    let name = mlir.file_name()?.to_str()?;
    let rest = &diag[diag.find(name)? + name.len()..];
    rest.strip_prefix(':')?.split(':').next()?.parse().ok()
}

fn function_names(text: &str) -> Vec<String> {
    text.lines().filter_map(func_name).collect()
}

fn func_name(line: &str) -> Option<String> {
    let rest = &line[line.find("func.func @")? + "func.func @".len()..];
    Some(rest.split('(').next()?.to_string())
}

/// The function enclosing 1-based line `line`.
fn function_at(text: &str, line: Option<usize>) -> Option<String> {
    let line = line?;
    text.lines().take(line).filter_map(func_name).last()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diagnostic_maps_to_function() {
        let text = "module {\n  func.func @a() {\n  }\n  func.func @b(%x: f32) {\n    bad\n  }\n}\n";
        let d = "/tmp/m.mlir:5:5: error: custom op 'bad' is unknown";
        assert_eq!(diagnostic_line(d, Path::new("/tmp/m.mlir")), Some(5));
        assert_eq!(function_at(text, Some(5)).as_deref(), Some("b"));
    }
}

#[cfg(test)]
mod compiler_tests {
    use super::*;

    /// Needs the compiler: a missing `iree-compile` fails here with the install hint.
    #[test]
    fn failed_compile_names_function_and_first_error() {
        let dir = tempfile::tempdir().unwrap();
        let mlir = dir.path().join("bad.mlir");
        std::fs::write(
            &mlir,
            "module @module {\n  func.func @ok(%a: tensor<2xf32>) -> tensor<2xf32> {\n    return %a : tensor<2xf32>\n  }\n  \
             func.func @broken(%a: tensor<2xf32>) -> tensor<3xf32> {\n    %b = stablehlo.add %a, %a : tensor<3xf32>\n    \
             return %b : tensor<3xf32>\n  }\n}\n",
        )
        .unwrap();
        let err = compile(&mlir, &Target::cpu(), &dir.path().join("bad.vmfb")).unwrap_err();
        match &err {
            ExportError::Compile {
                function, diagnostic, ..
            } => {
                assert_eq!(function, "broken", "{err}");
                assert!(diagnostic.contains("error:"), "{err}");
            }
            other => panic!("expected a compile error, got: {other}"),
        }
    }
}
