//! Kernels of our own in IREE dispatches, where IREE's code generation leaves speed behind:
//! C compiled by clang for IREE's embedded ELF ABI and linked into the module (a
//! `hal.executable.source` with `objects`), called from the graph with `flow.dispatch`.
//!
//! [`Q4_MATVEC`]: the one-row q4 product (`x · dequant(W)ᵀ`, f16 block scales), the f32
//! arithmetic of [`crate::mlir::Body::block_contract_q`] associated otherwise. Standalone,
//! Gemma 3 270M's LM head took ~6.1 ms against 9.3–11.7 for IREE's code of the graph's form;
//! in the exported step, decode 16.0/16.3 → 11.1/10.4 ms/token (`scripts/q4-kernel.sh`,
//! docs/journal, session 15).

use std::path::Path;
use std::process::Command;

use crate::{ExportError, Result};

/// The kernel's C source: `q4_matvec_workgroup`.
pub const Q4_MATVEC: &str = include_str!("../kernels/q4_matvec_x86_64.c");

/// The object file [`build_objects`] writes and the modules name (found through
/// `--iree-hal-executable-object-search-path`).
pub const Q4_MATVEC_OBJECT: &str = "q4_matvec_x86_64.o";

/// Output rows a workgroup computes (the last one fewer when they do not divide).
const ROWS_PER_WORKGROUP: usize = 256;

/// Whether the CPU running the export can run [`Q4_MATVEC`] (x86-64 with AVX-512 F/BW/VL, FMA,
/// F16C): the condition for `--cpu host` exports to call it.
pub fn host_runs_q4_matvec() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Compiles [`Q4_MATVEC`] into `dir/`[`Q4_MATVEC_OBJECT`] with clang (`CLANG`, else `clang` on
/// `PATH`).
pub fn build_objects(dir: &Path) -> Result<()> {
    let clang = crate::compile::find_tool("CLANG", "clang", "bin/clang")
        .map_err(|searched| ExportError::Unsupported(format!("the q4 kernel needs clang (searched: {searched})")))?;
    let source = dir.join("q4_matvec_x86_64.c");
    std::fs::write(&source, Q4_MATVEC).map_err(ExportError::io("writing the q4 kernel", &source))?;
    let object = dir.join(Q4_MATVEC_OBJECT);
    let output = Command::new(&clang)
        .args([
            "-target",
            "x86_64-unknown-unknown-eabi-elf",
            "-std=c11",
            "-O3",
            "-ffreestanding",
            "-fno-stack-protector",
            "-fPIC",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mfma",
            "-mf16c",
            "-c",
        ])
        .arg(&source)
        .arg("-o")
        .arg(&object)
        .output()
        .map_err(ExportError::io("running clang", &clang))?;
    if !output.status.success() {
        return Err(ExportError::Unsupported(format!(
            "clang could not compile the q4 kernel: {}",
            String::from_utf8_lossy(&output.stderr).lines().next().unwrap_or("")
        )));
    }
    Ok(())
}

/// An executable calling the kernel for one weight shape, as module-level text.
pub struct Executable {
    /// The executable's symbol.
    pub name: String,
    /// `@executable::@export`, what `flow.dispatch` names.
    pub entry: String,
    pub text: String,
}

/// The executable of [`Q4_MATVEC`] for weights `[out, inner]`: bindings x `[inner]` f32, the
/// values' bytes `[out·inner/2]` i8, the scales `[out·inner/32]` f16, the result `[out]` f32;
/// workload = `out`, one workgroup per [`ROWS_PER_WORKGROUP`] rows.
pub fn q4_matvec_executable(out: usize, inner: usize) -> Executable {
    let name = format!("q4_matvec_{out}x{inner}");
    let (bytes, scales, rows) = (out * inner / 2, out * inner / 32, ROWS_PER_WORKGROUP);
    let memrefs = format!("memref<{inner}xf32>, memref<{bytes}xi8>, memref<{scales}xf16>, memref<{out}xf32>");
    let read = "#hal.pipeline.binding<storage_buffer, ReadOnly>";
    let layout =
        format!("#hal.pipeline.layout<bindings = [{read}, {read}, {read}, #hal.pipeline.binding<storage_buffer>]>");
    // A source, not a variant: IREE makes the variant for the module's own CPU target, so the
    // executable is linked with the generated ones (a variant with a target of its own became a
    // library of its own, and the generated dispatches were then looked up in the wrong one).
    let text = format!(
        r#"hal.executable.source private @{name} <objects = <{{#hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{Q4_MATVEC_OBJECT}"}}>]}}>> {{
    hal.executable.export public @{name} ordinal(0) layout({layout}) count(%device: !hal.device, %rows: index) -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {rows})>()[%rows]
      %c1 = arith.constant 1 : index
      hal.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @q4_matvec_workgroup({memrefs}, index, index, index) attributes {{hal.import.static}}
      func.func @{name}() {{
        %c0 = arith.constant 0 : index
        %inner = arith.constant {inner} : index
        %per = arith.constant {rows} : index
        %out = arith.constant {out} : index
        %wg = hal.interface.workgroup.id[0] : index
        %row0 = arith.muli %wg, %per : index
        %left = arith.subi %out, %row0 : index
        %n = arith.minui %left, %per : index
        %x = hal.interface.binding.subspan layout({layout}) binding(0) alignment(64) offset(%c0) flags(ReadOnly) : memref<{inner}xf32>
        %q = hal.interface.binding.subspan layout({layout}) binding(1) alignment(64) offset(%c0) flags(ReadOnly) : memref<{bytes}xi8>
        %s = hal.interface.binding.subspan layout({layout}) binding(2) alignment(64) offset(%c0) flags(ReadOnly) : memref<{scales}xf16>
        %o = hal.interface.binding.subspan layout({layout}) binding(3) alignment(64) offset(%c0) : memref<{out}xf32>
        func.call @q4_matvec_workgroup(%x, %q, %s, %o, %inner, %row0, %n) : ({memrefs}, index, index, index) -> ()
        return
      }}
    }}
  }}"#
    );
    Executable {
        entry: format!("@{name}::@{name}"),
        name,
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executables_are_named_by_shape_and_cover_every_row() {
        let e = q4_matvec_executable(640, 2048);
        assert_eq!(e.entry, "@q4_matvec_640x2048::@q4_matvec_640x2048");
        // 640 rows: three workgroups of up to 256, the last one clamped to the 128 left.
        assert!(e.text.contains("ceildiv 256"));
        assert!(e.text.contains("arith.minui %left, %per"));
        assert!(e
            .text
            .contains("memref<2048xf32>, memref<655360xi8>, memref<40960xf16>, memref<640xf32>"));
    }

    /// clang is installed by scripts/setup.sh; the object must come out for the x86-64 embedded
    /// ELF ABI whatever CPU builds it.
    #[test]
    fn the_kernel_compiles() {
        let dir = tempfile::tempdir().unwrap();
        build_objects(dir.path()).unwrap();
        let object = std::fs::read(dir.path().join(Q4_MATVEC_OBJECT)).unwrap();
        assert_eq!(&object[..4], b"\x7fELF");
    }
}
