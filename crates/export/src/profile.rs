//! What an export is compiled for, resolved once from its options ([`ExportProfile::resolve`]).
//! Both the compiler flags and the forms the emitter writes derive from the profile: a GPU
//! family's configured forms ([`GpuFamily::tuning`]), the argmax's form (CPU-only exports), our
//! kernel's machine code ([`ExportProfile::kernel_isa`]), and from the flags of each module
//! ([`FlagFacts`]) whether it is data-tiled (the softmax's form, the encoded archive), hoists
//! constants and fuses aggressively. So a new target is one new profile, not a flag tested in
//! several places by its spelling.

use crate::emit::{AttentionProducts, RowProducts, StreamProducts};
use crate::kernels::KernelIsa;
use crate::{ExportOptions, Target};

/// One compile target of an export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetProfile {
    /// IREE's llvm-cpu for a CPU LLVM names (`generic`, `x86-64-v3`), or for the CPU of a target
    /// triple (`--iree-llvmcpu-target-triple`, the Android presets): code that runs on every CPU
    /// of that kind.
    Cpu { cpu: String, triple: Option<String> },
    /// `--cpu host`: this machine's CPU, with what it was found to have. The code runs only on
    /// CPUs like it (the cache keys such exports by the CPU).
    CpuHost { features: HostFeatures },
    /// IREE's vulkan-spirv for `target` (`None`: IREE's portable baseline) of GPU family
    /// `family`.
    Vulkan { target: Option<String>, family: GpuFamily },
}

/// What the CPU running the export has, which `--cpu host` exports use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostFeatures {
    /// bf16 dot products (x86: AVX-512 BF16): bf16 matmul inputs pay ([`crate::host_has_bf16_dot`]).
    pub bf16_dot: bool,
    /// f16 conversion in hardware (x86 F16C, aarch64): f16 caches pay ([`crate::host_converts_f16`]).
    pub f16_convert: bool,
}

impl HostFeatures {
    /// This machine's.
    pub fn detect() -> HostFeatures {
        HostFeatures {
            bf16_dot: crate::host_has_bf16_dot(),
            f16_convert: crate::host_converts_f16(),
        }
    }
}

/// The kind of GPU a Vulkan target is, for what IREE needs told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuFamily {
    /// IREE's portable baseline (`vp_android_baseline_2022`): any driver, lavapipe included; no
    /// 16-bit storage, so weights are packed `i32` pairs.
    Portable,
    /// One of IREE 3.13's NVIDIA targets (architectures, `sm_NN`, products such as `rtx4090`):
    /// 32-wide subgroups, where the configured forms of [`GpuTuning::NVIDIA`] were measured.
    Nvidia,
    /// [`PORTABLE_16BIT`]: IREE's portable baseline with 16-bit storage buffers and 16-bit
    /// integers, so i16 weights load as they are; no subgroup operations and no vendor
    /// workgroup sizes, so one module serves every GPU whose driver reports 16-bit storage.
    Portable16,
    /// [`PORTABLE_SUBGROUPS`]`N`: IREE's portable limits with 16-bit storage and subgroup
    /// operations of subgroups `size` wide: the configured forms of [`GpuTuning::PORTABLE`]
    /// (single-pass reductions, no split stages), runnable on any GPU of that subgroup size.
    Subgroups { size: u32 },
    /// Any other named target (`valhall`, `adreno`, `rdna3`): 16-bit storage, IREE's own
    /// configuration.
    Named,
}

/// `--vulkan-target portable-16bit`: IREE's `vp_android_baseline_2022` with the SPIR-V
/// capabilities of 16-bit storage buffers added ([`PORTABLE_16BIT_FLAGS`]). Without them IREE
/// emulates 16-bit loads in 32-bit words (and read the wrong elements: `OptionsError::I16OnPortableVulkan`);
/// with them the kernels load `i16` directly. Needs the device's `storageBuffer16BitAccess` and
/// `shaderInt16` (most Mali and Adreno drivers, NVIDIA, lavapipe), which the runtime checks at
/// open.
pub const PORTABLE_16BIT: &str = "portable-16bit";

/// The `iree-compile` flags of [`PORTABLE_16BIT`] modules, in place of `--iree-vulkan-target=NAME`.
/// `--iree-vulkan-target-features` replaces the profile's `spirv:v1.3,cap:Shader`; the
/// profile's limits (128 threads a workgroup, 16 KiB of shared memory, no subgroup operations)
/// stay.
pub const PORTABLE_16BIT_FLAGS: [&str; 2] = [
    "--iree-vulkan-target=vp_android_baseline_2022",
    "--iree-vulkan-target-features=spirv:v1.3,cap:Shader,cap:Int16,cap:StorageBuffer16BitAccess,ext:SPV_KHR_16bit_storage",
];

/// `--vulkan-target portable-sgN` (N one of [`SUBGROUP_SIZES`]): a portable target with the
/// subgroup operations (shuffle, arithmetic: reductions in one pass) and 16-bit storage that
/// most phone GPUs have, for GPUs whose subgroups are N wide (Mali 16, NVIDIA 32, Adreno 64).
/// IREE's SPIR-V code assumes one subgroup size (IREE's own note on its Android profile: "we
/// cannot have a fixed subgroup size to target a profile; need to have different targets for
/// different subgroup sizes"), so there is one module a size, and the runtime refuses a module
/// whose N is not the device's ([`GpuFamily::Subgroups`]). No vendor's workgroup constants:
/// the limits are the Android baseline's (128 threads a workgroup, 16 KiB of shared memory).
pub const PORTABLE_SUBGROUPS: &str = "portable-sg";

/// The subgroup sizes a [`PORTABLE_SUBGROUPS`] target may name.
/// (The configured forms' workgroups are 64 threads or a multiple: whole subgroups up to 64.)
pub const SUBGROUP_SIZES: [u32; 5] = [4, 8, 16, 32, 64];

/// The subgroup size of a [`PORTABLE_SUBGROUPS`] target name (`portable-sg32` → 32).
pub fn portable_subgroup_size(target: &str) -> Option<u32> {
    let size: u32 = target.strip_prefix(PORTABLE_SUBGROUPS)?.parse().ok()?;
    SUBGROUP_SIZES.contains(&size).then_some(size)
}

/// The `iree-compile` flags of a [`PORTABLE_SUBGROUPS`] module of subgroups `size` wide: the
/// whole device target as an attribute, since no `--iree-vulkan-target` name is both portable
/// and has subgroup operations.
pub fn portable_subgroup_flags(size: u32) -> Vec<String> {
    let features = "spirv:v1.3,cap:Shader,cap:Int16,cap:StorageBuffer16BitAccess,cap:GroupNonUniform,\
                    cap:GroupNonUniformArithmetic,cap:GroupNonUniformShuffle,ext:SPV_KHR_16bit_storage";
    let wgp = format!(
        "compute = fp32|int32|int16, storage = b32|b16, subgroup = shuffle|arithmetic, dot = none, mma = [], \
         subgroup_size_choices = [{size}, {size}], max_workgroup_sizes = [128, 128, 64], \
         max_thread_count_per_workgroup = 128, max_workgroup_memory_bytes = 16384, \
         max_workgroup_counts = [65535, 65535, 65535]"
    );
    vec![format!(
        "--iree-hal-target-device=#hal.device.target<\"vulkan\", [#hal.executable.target<\"vulkan-spirv\", \
         \"vulkan-spirv-fb\", {{iree_codegen.target_info = #iree_gpu.target<arch = \"\", features = \"{features}\", \
         wgp = <{wgp}>>}}>]> : !hal.device"
    )]
}

impl GpuFamily {
    /// The family of `--iree-vulkan-target` `target` (`None`: IREE's default).
    pub fn of(target: Option<&str>) -> GpuFamily {
        match target {
            None => GpuFamily::Portable,
            Some(PORTABLE_16BIT) => GpuFamily::Portable16,
            Some(name) if crate::nvidia_target(name) => GpuFamily::Nvidia,
            Some(name) => match portable_subgroup_size(name) {
                Some(size) => GpuFamily::Subgroups { size },
                None => GpuFamily::Named,
            },
        }
    }

    /// The configured forms of this family's modules; `None`: IREE configures everything.
    pub fn tuning(self) -> Option<GpuTuning> {
        match self {
            GpuFamily::Nvidia => Some(GpuTuning::NVIDIA),
            GpuFamily::Subgroups { .. } => Some(GpuTuning::PORTABLE),
            GpuFamily::Portable | GpuFamily::Portable16 | GpuFamily::Named => None,
        }
    }
}

/// IREE SPIR-V configurations the emitter gives a family's one-row forms, where IREE's own
/// choice left speed behind (each measured on the H200; docs/journal, sessions 16-19).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuTuning {
    /// The LM head's one-row i16 product (and the step's normed products): 4 rows a 64-thread
    /// workgroup, a subgroup a row, where IREE gave each row a workgroup of its own.
    pub head: RowProducts,
    /// The one-row products as wide as the residual stream (output and down projections)
    /// writing it out as well: a workgroup a row, as IREE configures them alone.
    pub stream: StreamProducts,
    /// The staged argmax reduces at most this many values a stage.
    pub argmax_width: usize,
    /// Contract 2's one-row attention products over the caches: a subgroup per output, 4 a
    /// 64-thread workgroup (IREE's matmuls of 2 to 5 workgroups took 15 of a 19.5 ms step).
    pub attention: AttentionProducts,
}

impl GpuTuning {
    pub const NVIDIA: GpuTuning = GpuTuning {
        head: RowProducts { workgroup: 64, rows: 4 },
        stream: StreamProducts {
            per_thread: 16,
            threads: (32, 1024),
        },
        argmax_width: 16,
        attention: AttentionProducts {
            workgroup: 64,
            keys: 4,
            outputs: 4,
        },
    };

    /// The same forms within the Android baseline's limits (128 threads a workgroup) and in
    /// workgroups of 64 threads or a multiple, whole subgroups of 8 to 64 lanes.
    pub const PORTABLE: GpuTuning = GpuTuning {
        stream: StreamProducts {
            per_thread: 16,
            threads: (64, 128),
        },
        ..GpuTuning::NVIDIA
    };
}

/// What a module's `iree-compile` flags turn on, read once, each by its last occurrence (as
/// iree-compile's options are: the last one given wins), in every spelling IREE 3.13 takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlagFacts {
    /// `--iree-global-opt-data-tiling` or `--iree-opt-data-tiling`: matmul operands laid out in
    /// the CPU's tiles. Such modules take the one-row softmax (IREE 3.13 does not compile the
    /// tiled one with it) and, on the CPU with hoisting on, an encoded archive.
    pub data_tiling: bool,
    /// `--iree-opt-const-expr-hoisting` (on unless turned off).
    pub const_hoisting: bool,
    /// Aggressive fusion: on from `--iree-opt-level=O2` unless
    /// `--iree-dispatch-creation-enable-aggressive-fusion=false` (needed to fuse a
    /// dequantization into a many-row matmul).
    pub aggressive_fusion: bool,
}

impl FlagFacts {
    pub fn of(flags: &[String]) -> FlagFacts {
        // The last value of any of `names`: `--name` alone is `true`, `--name=V` is V.
        let last_bool = |names: &[&str], default: bool| -> bool {
            flags
                .iter()
                .rev()
                .find_map(|f| {
                    names.iter().find_map(|n| match f.strip_prefix(n) {
                        Some("") => Some(true),
                        Some(rest) => rest.strip_prefix('=').map(|v| matches!(v, "true" | "1")),
                        None => None,
                    })
                })
                .unwrap_or(default)
        };
        let level = flags
            .iter()
            .rev()
            .find_map(|f| f.strip_prefix("--iree-opt-level=O"))
            .and_then(|l| l.parse::<u32>().ok())
            .unwrap_or(0);
        FlagFacts {
            data_tiling: last_bool(&["--iree-global-opt-data-tiling", "--iree-opt-data-tiling"], false),
            const_hoisting: last_bool(&["--iree-opt-const-expr-hoisting"], true),
            aggressive_fusion: level >= 2 && last_bool(&["--iree-dispatch-creation-enable-aggressive-fusion"], true),
        }
    }
}

/// Every target of an export, resolved from its options: see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportProfile {
    pub targets: Vec<TargetProfile>,
}

impl ExportProfile {
    /// `options`' targets with the export's `vulkan_target` given to Vulkan targets that name
    /// none, and the triple of its flags (the presets') to its CPU targets.
    pub fn resolve(options: &ExportOptions) -> ExportProfile {
        let triple = options
            .compile_flags
            .iter()
            .chain(options.graph_flags.values().flatten())
            .find_map(|f| f.strip_prefix("--iree-llvmcpu-target-triple="))
            .map(str::to_string);
        let targets = options
            .targets
            .iter()
            .map(|t| match t {
                Target::Cpu { cpu } if cpu == "host" && triple.is_none() => TargetProfile::CpuHost {
                    features: HostFeatures::detect(),
                },
                Target::Cpu { cpu } => TargetProfile::Cpu {
                    cpu: cpu.clone(),
                    triple: triple.clone(),
                },
                Target::Vulkan { target } => {
                    let target = target.clone().or_else(|| options.vulkan_target.clone());
                    TargetProfile::Vulkan {
                        family: GpuFamily::of(target.as_deref()),
                        target,
                    }
                }
            })
            .collect();
        ExportProfile { targets }
    }

    /// The compiler's targets, in the options' order.
    pub fn compile_targets(&self) -> Vec<Target> {
        self.targets.iter().map(TargetProfile::target).collect()
    }

    /// Whether every target is a CPU: forms only IREE's CPU backend compiles (the argmax as a
    /// maximum then an index) are then written, f16 caches allowed.
    pub fn cpu_only(&self) -> bool {
        self.targets.iter().all(TargetProfile::is_cpu)
    }

    /// Whether any target is Vulkan: modules run asynchronously there (the step's `embed_token`).
    pub fn has_vulkan(&self) -> bool {
        !self.targets.iter().all(TargetProfile::is_cpu)
    }

    /// The configured forms of the export's modules: one module text serves every target, so
    /// only when every target is of one tuned family.
    pub fn gpu_tuning(&self) -> Option<GpuTuning> {
        let mut families = self.targets.iter().map(|t| match t {
            TargetProfile::Vulkan { family, .. } => family.tuning(),
            _ => None,
        });
        let first = families.next()??;
        families.all(|t| t == Some(first)).then_some(first)
    }

    /// Whether the emitter splits the one-row attention products into runs
    /// ([`crate::emit::EmitOptions::split_reductions`]): when every target is a portable Vulkan
    /// profile, whose reductions IREE gives one thread an output (no subgroup operations). The
    /// CPU's are vectorised as they are, and tuned GPU families configure their own.
    pub fn split_reductions(&self) -> bool {
        !self.targets.is_empty()
            && self.targets.iter().all(|t| {
                matches!(
                    t,
                    TargetProfile::Vulkan {
                        family: GpuFamily::Portable | GpuFamily::Portable16,
                        ..
                    }
                )
            })
    }

    /// Whether a target is `--cpu host` (code for this machine's CPU only).
    pub fn has_host_cpu(&self) -> bool {
        self.targets.iter().any(|t| matches!(t, TargetProfile::CpuHost { .. }))
    }

    /// The machine code of our q4 kernel the export's modules may call
    /// ([`KernelIsa::for_export`]): CPU-only exports for an aarch64 triple, or for this very
    /// x86-64 CPU where it has AVX-512.
    pub fn kernel_isa(&self) -> Option<KernelIsa> {
        if !self.cpu_only() {
            return None;
        }
        let triple = self.targets.iter().find_map(|t| match t {
            TargetProfile::Cpu { triple, .. } => triple.as_deref(),
            _ => None,
        });
        let cpus: Vec<&str> = self
            .targets
            .iter()
            .map(|t| match t {
                TargetProfile::Cpu { cpu, .. } => cpu.as_str(),
                _ => "host",
            })
            .collect();
        KernelIsa::for_export(triple, &cpus)
    }
}

impl TargetProfile {
    /// `target` alone (no export-wide Vulkan target or triple): `host` is this machine's CPU.
    pub fn of(target: &Target) -> TargetProfile {
        match target {
            Target::Cpu { cpu } if cpu == "host" => TargetProfile::CpuHost {
                features: HostFeatures::detect(),
            },
            Target::Cpu { cpu } => TargetProfile::Cpu {
                cpu: cpu.clone(),
                triple: None,
            },
            Target::Vulkan { target } => TargetProfile::Vulkan {
                family: GpuFamily::of(target.as_deref()),
                target: target.clone(),
            },
        }
    }

    /// The compiler's target.
    pub fn target(&self) -> Target {
        match self {
            TargetProfile::Cpu { cpu, .. } => Target::Cpu { cpu: cpu.clone() },
            TargetProfile::CpuHost { .. } => Target::Cpu { cpu: "host".into() },
            TargetProfile::Vulkan { target, .. } => Target::Vulkan { target: target.clone() },
        }
    }

    pub fn is_cpu(&self) -> bool {
        !matches!(self, TargetProfile::Vulkan { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(flags: &[&str]) -> Vec<String> {
        flags.iter().map(|f| f.to_string()).collect()
    }

    /// Every spelling of data tiling counts, the last occurrence wins; `=false` turns it off
    /// (the flag text test before this counted `--iree-global-opt-data-tiling=false` as on).
    #[test]
    fn flag_facts_read_every_spelling_and_the_last_value() {
        let facts = |f: &[&str]| FlagFacts::of(&strings(f));
        assert!(!facts(&[]).data_tiling);
        assert!(facts(&["--iree-global-opt-data-tiling"]).data_tiling);
        assert!(facts(&["--iree-opt-data-tiling"]).data_tiling);
        assert!(facts(&["--iree-global-opt-data-tiling=true"]).data_tiling);
        assert!(!facts(&["--iree-global-opt-data-tiling=false"]).data_tiling);
        assert!(!facts(&["--iree-opt-data-tiling", "--iree-opt-data-tiling=false"]).data_tiling);
        assert!(facts(&[]).const_hoisting);
        assert!(!facts(&["--iree-opt-const-expr-hoisting=false"]).const_hoisting);
        assert!(!facts(&["--iree-opt-level=O1"]).aggressive_fusion);
        assert!(facts(&["--iree-opt-level=O3"]).aggressive_fusion);
        assert!(
            !facts(crate::CPU_RUNTIME_FLAGS).aggressive_fusion,
            "contract 1's CPU flags turn it off"
        );
        let v2 = facts(crate::CPU_RUNTIME_FLAGS_V2);
        assert!(v2.data_tiling && v2.const_hoisting && v2.aggressive_fusion);
    }

    #[test]
    fn vulkan_targets_resolve_to_their_family() {
        let profile = |targets: Vec<Target>, default: Option<&str>| {
            ExportProfile::resolve(&ExportOptions {
                targets,
                vulkan_target: default.map(str::to_string),
                ..ExportOptions::default()
            })
        };
        let vulkan = |t: Option<&str>| Target::Vulkan {
            target: t.map(str::to_string),
        };
        for name in ["ampere", "ada", "sm_80", "rtx3090"] {
            assert_eq!(
                profile(vec![vulkan(Some(name))], None).gpu_tuning(),
                Some(GpuTuning::NVIDIA),
                "{name}"
            );
            assert_eq!(
                profile(vec![vulkan(None)], Some(name)).gpu_tuning(),
                Some(GpuTuning::NVIDIA),
                "{name} as the export's default"
            );
        }
        for name in ["valhall", "adreno", "rdna3", "vp_android_baseline_2022"] {
            assert_eq!(profile(vec![vulkan(Some(name))], None).gpu_tuning(), None, "{name}");
        }
        assert_eq!(profile(vec![vulkan(None)], None).gpu_tuning(), None, "IREE's default");
        assert_eq!(
            profile(vec![vulkan(Some("valhall"))], Some("ampere")).gpu_tuning(),
            None,
            "a named target wins"
        );
        assert_eq!(
            profile(vec![Target::cpu(), vulkan(Some("ampere"))], None).gpu_tuning(),
            None,
            "one text serves the CPU too"
        );
        assert_eq!(
            profile(vec![vulkan(None)], Some("ampere")).compile_targets(),
            vec![vulkan(Some("ampere"))]
        );
        // The portable profile with 16-bit storage: its own family, IREE's configuration, and
        // the baseline's flags with the 16-bit capabilities in place of a GPU's name.
        assert_eq!(GpuFamily::of(Some(PORTABLE_16BIT)), GpuFamily::Portable16);
        assert_eq!(profile(vec![vulkan(Some(PORTABLE_16BIT))], None).gpu_tuning(), None);
        let flags = vulkan(Some(PORTABLE_16BIT)).flags();
        assert!(flags.ends_with(&strings(&PORTABLE_16BIT_FLAGS)), "{flags:?}");
        assert!(
            !flags.iter().any(|f| f == "--iree-vulkan-target=portable-16bit"),
            "{flags:?}"
        );
        assert_eq!(vulkan(Some(PORTABLE_16BIT)).key(), "vulkan-portable-16bit");
    }

    /// `portable-sgN`: a family per subgroup size, the portable forms (not split: one pass in
    /// subgroups), contract 2, and the whole device target as the flag, with N as IREE's only
    /// subgroup size and the Android baseline's limits; other spellings are named targets.
    #[test]
    fn portable_subgroup_targets_name_their_size() {
        let profile = |targets: Vec<Target>| {
            ExportProfile::resolve(&ExportOptions {
                targets,
                ..ExportOptions::default()
            })
        };
        let vulkan = |t: Option<&str>| Target::Vulkan {
            target: t.map(str::to_string),
        };
        for size in SUBGROUP_SIZES {
            let name = format!("{PORTABLE_SUBGROUPS}{size}");
            assert_eq!(portable_subgroup_size(&name), Some(size));
            assert_eq!(GpuFamily::of(Some(&name)), GpuFamily::Subgroups { size });
            let p = profile(vec![vulkan(Some(&name))]);
            assert_eq!(p.gpu_tuning(), Some(GpuTuning::PORTABLE), "{name}");
            assert!(!p.split_reductions(), "{name}");
            assert_eq!(
                crate::device::default_contract(&vulkan(Some(&name)), false),
                kv_core::ContractVersion::V2
            );
            let flags = vulkan(Some(&name)).flags();
            let device = flags
                .iter()
                .find_map(|f| f.strip_prefix("--iree-hal-target-device="))
                .expect("a device target");
            assert!(device.starts_with("#hal.device.target<\"vulkan\""), "{device}");
            for part in [
                format!("subgroup_size_choices = [{size}, {size}]"),
                "subgroup = shuffle|arithmetic".into(),
                "max_thread_count_per_workgroup = 128".into(),
                "cap:StorageBuffer16BitAccess".into(),
            ] {
                assert!(device.contains(&part), "{part} in {device}");
            }
            assert!(
                !flags.iter().any(|f| f.starts_with("--iree-vulkan-target")),
                "{flags:?}"
            );
            assert!(flags.contains(&"--iree-execution-model=async-external".to_string()));
            assert_eq!(vulkan(Some(&name)).key(), format!("vulkan-portable-sg{size}"));
        }
        for name in ["portable-sg", "portable-sg12", "portable-sg128", "portable-sgx"] {
            assert_eq!(portable_subgroup_size(name), None, "{name}");
            assert_eq!(GpuFamily::of(Some(name)), GpuFamily::Named, "{name}");
        }
    }

    /// The portable tuning keeps every configured workgroup within the baseline's 128 threads
    /// and in whole subgroups of up to 64 lanes, however wide the stream (NVIDIA's go to 1,024).
    #[test]
    fn portable_tuning_stays_within_the_baseline() {
        let t = GpuTuning::PORTABLE;
        assert!(t.head.workgroup <= 128 && t.head.workgroup % 64 == 0);
        assert!(t.attention.workgroup <= 128 && t.attention.workgroup % 64 == 0);
        for inner in [256, 640, 1024, 2048, 3072, 8192] {
            let info = t.stream.compilation_info(inner);
            let threads: usize = info
                .split("workgroup_size = [")
                .nth(1)
                .and_then(|r| r.split(',').next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("no workgroup size in {info}"));
            assert!((64..=128).contains(&threads) && threads % 64 == 0, "{inner}: {threads}");
        }
        let nvidia = GpuTuning::NVIDIA.stream.compilation_info(8192);
        assert!(nvidia.contains("workgroup_size = [512, 1, 1]"), "{nvidia}");
    }

    #[test]
    fn the_triple_makes_a_cpu_target_portable_and_chooses_the_kernel() {
        let mut options = ExportOptions {
            targets: vec![Target::Cpu { cpu: "host".into() }],
            ..ExportOptions::default()
        };
        let host = ExportProfile::resolve(&options);
        assert!(host.has_host_cpu() && host.cpu_only());
        options.compile_flags = strings(&["--iree-llvmcpu-target-triple=aarch64-none-linux-android30"]);
        let arm = ExportProfile::resolve(&options);
        assert!(
            !arm.has_host_cpu(),
            "`host` of another architecture's triple is not this CPU"
        );
        assert_eq!(arm.kernel_isa(), Some(KernelIsa::Aarch64Neon));
        options.targets.push(Target::vulkan());
        assert_eq!(
            ExportProfile::resolve(&options).kernel_isa(),
            None,
            "CPU-only exports only"
        );
    }
}
