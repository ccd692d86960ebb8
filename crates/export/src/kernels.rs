//! Kernels of our own in IREE dispatches, where IREE's code generation leaves speed behind:
//! C compiled by clang for IREE's embedded ELF ABI and linked into the module (a
//! `hal.executable.source` with `objects`), called from the graph with `flow.dispatch`.
//!
//! The one-row q4 product (`x · dequant(W)ᵀ`, f16 block scales), the f32 arithmetic of
//! [`crate::mlir::Body::block_contract_q`] associated otherwise, in two machine codes
//! ([`KernelIsa`]): x86-64 with AVX-512 ([`Q4_MATVEC`]) and aarch64 with Armv8.0 Advanced SIMD
//! ([`Q4_MATVEC_AARCH64`]). On x86, standalone, Gemma 3 270M's LM head took ~6.1 ms against
//! 9.3–11.7 for IREE's code of the graph's form; in the exported step, decode 16.0/16.3 →
//! 11.1/10.4 ms/token (`scripts/q4-kernel.sh`, docs/journal, session 15). The aarch64 one
//! has been run only under qemu, where speed means nothing: docs/quantized-weights.md counts its
//! instructions per block instead.
//!
//! The sources live in `kernels/`: the C here, the MLIR executable that calls them (and the
//! graphs' other hand-written MLIR) in `kernels/mlir/`, filled by [`crate::templates`].

use std::path::Path;
use std::process::Command;

use crate::{ExportError, Result};

/// The x86-64 kernel's C source: `q4_matvec_workgroup`.
pub const Q4_MATVEC: &str = include_str!("../kernels/q4_matvec_x86_64.c");

/// The aarch64 kernel's C source: the same function, same arguments.
pub const Q4_MATVEC_AARCH64: &str = include_str!("../kernels/q4_matvec_aarch64.c");

/// The x86-64 object file [`build_objects`] writes and the modules name (found through
/// `--iree-hal-executable-object-search-path`).
pub const Q4_MATVEC_OBJECT: &str = "q4_matvec_x86_64.o";

/// Output rows a workgroup computes (the last one fewer when they do not divide).
const ROWS_PER_WORKGROUP: usize = 256;

/// The machine code of a kernel: which CPUs it runs on, how clang builds it and which IREE
/// executable format links it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelIsa {
    /// x86-64 with AVX-512 F/BW/VL, FMA and F16C.
    X86_64Avx512,
    /// aarch64, Armv8.0-A Advanced SIMD: every aarch64 CPU (Android's arm64-v8a ABI included).
    Aarch64Neon,
}

impl KernelIsa {
    pub const ALL: [KernelIsa; 2] = [KernelIsa::X86_64Avx512, KernelIsa::Aarch64Neon];

    /// The C source of the q4 kernel.
    pub fn source(self) -> &'static str {
        match self {
            KernelIsa::X86_64Avx512 => Q4_MATVEC,
            KernelIsa::Aarch64Neon => Q4_MATVEC_AARCH64,
        }
    }

    /// The object file's name in the export directory.
    pub fn object(self) -> &'static str {
        match self {
            KernelIsa::X86_64Avx512 => Q4_MATVEC_OBJECT,
            KernelIsa::Aarch64Neon => "q4_matvec_aarch64.o",
        }
    }

    /// IREE's executable format of an llvm-cpu module for this architecture (what the object is
    /// declared for: IREE links each object only into the variants of its format).
    pub fn iree_format(self) -> &'static str {
        match self {
            KernelIsa::X86_64Avx512 => "embedded-elf-x86_64",
            KernelIsa::Aarch64Neon => "embedded-elf-arm_64",
        }
    }

    /// clang's target and code-generation flags: IREE's embedded ELF is freestanding (no libc,
    /// no stack protector's guard symbol), position independent.
    pub(crate) fn clang_args(self) -> &'static [&'static str] {
        match self {
            KernelIsa::X86_64Avx512 => &[
                "-target",
                "x86_64-unknown-unknown-eabi-elf",
                "-mavx512f",
                "-mavx512bw",
                "-mavx512vl",
                "-mfma",
                "-mf16c",
            ],
            // x18 is the platform register (Android's shadow call stack): IREE's own aarch64
            // code leaves it alone, and so must ours. Hidden visibility: a default-visibility
            // symbol is called through a PLT slot (R_AARCH64_JUMP_SLOT), which IREE's embedded
            // ELF loader does not fill; the dispatch then jumped to nothing (SIGSEGV under qemu).
            KernelIsa::Aarch64Neon => &[
                "-target",
                "aarch64-unknown-unknown-eabi-elf",
                "-march=armv8-a",
                "-ffixed-x18",
                "-fvisibility=hidden",
            ],
        }
    }

    /// The q4 kernel an export's CPU modules call, by the LLVM target triple they are compiled
    /// for (`None`: iree-compile's default, this machine's) and their `--cpu` names: any aarch64
    /// triple (Advanced SIMD is part of the base architecture), and on x86-64 only modules for
    /// this very CPU (`--cpu host`) where it has AVX-512 (other x86 exports run on CPUs without
    /// it). None otherwise: the graph's own form.
    pub fn for_export(triple: Option<&str>, cpus: &[&str]) -> Option<KernelIsa> {
        let arch = match triple {
            Some(t) => t.split('-').next().unwrap_or(t),
            None => std::env::consts::ARCH,
        };
        match arch {
            "aarch64" | "arm64" => Some(KernelIsa::Aarch64Neon),
            "x86_64" if triple.is_none() && !cpus.is_empty() && cpus.iter().all(|c| *c == "host") => {
                host_runs_q4_matvec().then_some(KernelIsa::X86_64Avx512)
            }
            _ => None,
        }
    }
}

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

/// `SKAINET_KV_Q4_KERNEL`: `off` keeps CPU exports on IREE's own q4 products even where they
/// would call our kernel, so that tests run both paths on one machine (`cli/tests/diverge.rs`);
/// unset or `auto`: the kernel wherever the export's CPU runs it. Exports made with `off` are
/// cached apart (`q4Kernel` in their settings).
pub const Q4_KERNEL_ENV: &str = "SKAINET_KV_Q4_KERNEL";

/// Whether [`Q4_KERNEL_ENV`] leaves exports free to call the kernel. Another value is refused:
/// a typo would silently test the path it meant to avoid.
pub fn q4_kernel_allowed() -> Result<bool> {
    let value = match std::env::var_os(Q4_KERNEL_ENV) {
        None => return Ok(true),
        Some(value) => value,
    };
    match value.to_str() {
        Some("auto") => Ok(true),
        Some("off") => Ok(false),
        _ => Err(ExportError::Unsupported(format!(
            "{Q4_KERNEL_ENV}={value:?}: give `auto` or `off`"
        ))),
    }
}

/// Compiles the q4 kernel of every [`KernelIsa`] into `dir/` (their [`KernelIsa::object`]) with
/// clang (`CLANG`, else `clang` on `PATH`): the executables name all of them, and IREE links the
/// one of the module's target.
pub fn build_objects(dir: &Path) -> Result<()> {
    for isa in KernelIsa::ALL {
        build_object(dir, isa)?;
    }
    Ok(())
}

fn build_object(dir: &Path, isa: KernelIsa) -> Result<()> {
    let clang = crate::compile::find_tool("CLANG", "clang", "bin/clang")
        .map_err(|searched| ExportError::Unsupported(format!("the q4 kernel needs clang (searched: {searched})")))?;
    let object = dir.join(isa.object());
    let source = object.with_extension("c");
    std::fs::write(&source, isa.source()).map_err(ExportError::io("writing the q4 kernel", &source))?;
    let output = Command::new(&clang)
        .args(isa.clang_args())
        .args([
            "-std=c11",
            "-O3",
            "-ffreestanding",
            "-fno-stack-protector",
            "-fPIC",
            "-c",
        ])
        .arg(&source)
        .arg("-o")
        .arg(&object)
        .output()
        .map_err(ExportError::io("running clang", &clang))?;
    if !output.status.success() {
        return Err(ExportError::Unsupported(format!(
            "clang could not compile the {isa:?} q4 kernel: {}",
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
    // Every architecture's object: IREE links the one whose format is the module's target's.
    let objects = KernelIsa::ALL
        .iter()
        .map(|isa| crate::templates::Q4_MATVEC_OBJECT.fill(&[("FORMAT", isa.iree_format()), ("OBJECT", isa.object())]))
        .collect::<Vec<_>>()
        .join(", ");
    // A source, not a variant: IREE makes the variant for the module's own CPU target, so the
    // executable is linked with the generated ones (a variant with a target of its own became a
    // library of its own, and the generated dispatches were then looked up in the wrong one).
    let text = crate::templates::Q4_MATVEC_EXECUTABLE.fill(&[
        ("NAME", &name),
        ("OBJECTS", &objects),
        ("LAYOUT", &layout),
        ("ROWS", &rows.to_string()),
        ("MEMREFS", &memrefs),
        ("INNER", &inner.to_string()),
        ("OUT", &out.to_string()),
        ("BYTES", &bytes.to_string()),
        ("SCALES", &scales.to_string()),
    ]);
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

    /// clang is installed by scripts/setup.sh; each object must come out for its architecture's
    /// embedded ELF ABI whatever CPU builds it (ELF `e_machine`: 62 x86-64, 183 aarch64).
    #[test]
    fn the_kernels_compile() {
        let dir = tempfile::tempdir().unwrap();
        build_objects(dir.path()).unwrap();
        for (isa, machine) in [(KernelIsa::X86_64Avx512, 62u16), (KernelIsa::Aarch64Neon, 183)] {
            let object = std::fs::read(dir.path().join(isa.object())).unwrap();
            assert_eq!(&object[..4], b"\x7fELF", "{isa:?}");
            assert_eq!(u16::from_le_bytes([object[18], object[19]]), machine, "{isa:?}");
        }
    }

    /// The `st_other` visibility of `name` in the ELF64 object `elf`'s symbol table.
    fn symbol_visibility(elf: &[u8], name: &str) -> Option<u8> {
        let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
        let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap()) as usize;
        let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap()) as usize;
        let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
        let section = |i: usize| shoff + i * shentsize;
        let symtab = (0..shnum).map(section).find(|&h| u32_at(h + 4) == 2)?;
        let strtab = u64_at(section(u32_at(symtab + 40)) + 24);
        let (symbols, size) = (u64_at(symtab + 24), u64_at(symtab + 32));
        (symbols..symbols + size).step_by(24).find_map(|sym| {
            let start = strtab + u32_at(sym);
            let end = start + elf[start..].iter().position(|&b| b == 0)?;
            (&elf[start..end] == name.as_bytes()).then_some(elf[sym + 5] & 3)
        })
    }

    /// A default-visibility kernel is called through a PLT slot, which IREE's embedded ELF
    /// loader leaves empty: the aarch64 export crashed under qemu until the symbol was hidden
    /// (STV_HIDDEN = 2).
    #[test]
    fn the_aarch64_kernel_is_hidden() {
        let dir = tempfile::tempdir().unwrap();
        build_objects(dir.path()).unwrap();
        let object = std::fs::read(dir.path().join(KernelIsa::Aarch64Neon.object())).unwrap();
        assert_eq!(symbol_visibility(&object, "q4_matvec_workgroup"), Some(2));
    }

    #[test]
    fn executables_name_every_architecture_s_object() {
        let e = q4_matvec_executable(64, 32);
        for isa in KernelIsa::ALL {
            let declared = format!(
                r#"#hal.executable.target<"llvm-cpu", "{}"> = [#hal.executable.object<{{path = "{}"}}>]"#,
                isa.iree_format(),
                isa.object()
            );
            assert!(e.text.contains(&declared), "{isa:?} missing in {}", e.text);
        }
    }

    #[test]
    fn the_triple_chooses_the_kernel() {
        for triple in [
            "aarch64-unknown-linux-gnu",
            "aarch64-linux-android",
            "arm64-apple-macos",
        ] {
            assert_eq!(
                KernelIsa::for_export(Some(triple), &["generic"]),
                Some(KernelIsa::Aarch64Neon),
                "{triple}"
            );
        }
        // x86 modules for other CPUs than this one, and 32-bit ARM, keep the graph's form.
        assert_eq!(KernelIsa::for_export(Some("x86_64-unknown-linux-gnu"), &["host"]), None);
        assert_eq!(
            KernelIsa::for_export(Some("armv7a-linux-androideabi"), &["generic"]),
            None
        );
        if cfg!(target_arch = "x86_64") {
            assert_eq!(KernelIsa::for_export(None, &["x86-64-v3"]), None);
            assert_eq!(KernelIsa::for_export(None, &["host", "generic"]), None);
            assert_eq!(
                KernelIsa::for_export(None, &["host"]),
                host_runs_q4_matvec().then_some(KernelIsa::X86_64Avx512)
            );
        }
    }
}
