//! `export --target NAME`: the targets of an app's export, by phone rather than by compiler
//! flag. Each preset sets what `--targets`, `--cpu`, `--vulkan-target` and `--compile-flag` would
//! (docs/android.md lists them and what each was checked on).

use crate::{ExportError, ExportOptions, Result, Target};

/// The triple of Android's arm64-v8a ABI as IREE's llvm-cpu takes it. The modules are IREE's
/// embedded ELF (no libc, no Android API calls), so the API level only names the platform.
pub const ANDROID_ARM64_TRIPLE: &str = "aarch64-none-linux-android30";

/// One `--target` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    pub kind: PresetKind,
    /// What it is for, one line (`export --help`, docs/android.md).
    pub about: &'static str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PresetKind {
    /// IREE's llvm-cpu for `triple` with LLVM's CPU `features` (`+dotprod,...`).
    Cpu {
        triple: &'static str,
        features: &'static str,
    },
    /// vulkan-spirv for `--iree-vulkan-target` (`None`: IREE's `vp_android_baseline_2022`).
    Vulkan { target: Option<&'static str> },
}

/// Every preset. The CPU features are those IREE 3.13's llvm-cpu accepts for aarch64 (an
/// unknown one is only warned about, so each was checked by name): `+dotprod` and `+fullfp16`
/// (Armv8.2-A: Cortex-A55/A75 and later, phones since 2018), `+i8mm` and `+bf16` (Armv8.6-A and
/// Armv9-A: Cortex-A510/A710/X2 and later, phones since 2022). IREE uses them in its integer,
/// f16 and bf16 matmul microkernels; the f32 graphs' code is the baseline's where nothing
/// needs them. A module built with a feature the phone lacks may stop on an illegal
/// instruction, hence two CPU presets.
pub const PRESETS: [Preset; 9] = [
    Preset {
        name: "android-arm64",
        kind: PresetKind::Cpu {
            triple: ANDROID_ARM64_TRIPLE,
            features: "+neon,+dotprod,+fullfp16",
        },
        about: "arm64-v8a CPU, Armv8.2-A with dot product and fp16 (phones since 2018)",
    },
    Preset {
        name: "android-arm64-v9",
        kind: PresetKind::Cpu {
            triple: ANDROID_ARM64_TRIPLE,
            features: "+neon,+dotprod,+fullfp16,+i8mm,+bf16",
        },
        about: "arm64-v8a CPU, Armv9-A features: also int8 matrix multiply and bf16 (phones since 2022)",
    },
    Preset {
        name: "vulkan-portable",
        kind: PresetKind::Vulkan { target: None },
        about: "Vulkan, IREE's portable target (vp_android_baseline_2022: Android's 2022 baseline profile)",
    },
    Preset {
        name: "vulkan-portable-16bit",
        kind: PresetKind::Vulkan {
            target: Some(crate::profile::PORTABLE_16BIT),
        },
        about: "Vulkan, the portable target with 16-bit storage (--vulkan-target portable-16bit: GPUs whose driver \
                reports storageBuffer16BitAccess; give --weight-storage i16)",
    },
    Preset {
        name: "vulkan-portable-sg16",
        kind: PresetKind::Vulkan {
            target: Some("portable-sg16"),
        },
        about: "Vulkan with 16-bit storage and subgroup reductions, 16-lane subgroups (--vulkan-target \
                portable-sg16: drivers reporting subgroupSize 16, e.g. Arm Mali Valhall; i16 weights)",
    },
    Preset {
        name: "vulkan-portable-sg32",
        kind: PresetKind::Vulkan {
            target: Some("portable-sg32"),
        },
        about: "Vulkan with 16-bit storage and subgroup reductions, 32-lane subgroups (--vulkan-target \
                portable-sg32: drivers reporting subgroupSize 32, e.g. NVIDIA; i16 weights)",
    },
    Preset {
        name: "vulkan-portable-sg64",
        kind: PresetKind::Vulkan {
            target: Some("portable-sg64"),
        },
        about: "Vulkan with 16-bit storage and subgroup reductions, 64-lane subgroups (--vulkan-target \
                portable-sg64: drivers reporting subgroupSize 64, e.g. Qualcomm Adreno; i16 weights)",
    },
    Preset {
        name: "vulkan-valhall",
        kind: PresetKind::Vulkan {
            target: Some("valhall"),
        },
        about: "Vulkan for Arm Mali Valhall GPUs (--vulkan-target valhall)",
    },
    Preset {
        name: "vulkan-adreno",
        kind: PresetKind::Vulkan { target: Some("adreno") },
        about: "Vulkan for Qualcomm Adreno GPUs (--vulkan-target adreno)",
    },
];

/// The preset named `name`; an unknown name is refused with the list.
pub fn preset(name: &str) -> Result<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        ExportError::Unsupported(format!(
            "--target {name}: unknown (known: {})",
            PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// `options`' targets set by `presets`: at most one CPU and one Vulkan preset (one module text
/// serves both; an export has one triple and one Vulkan target), except that the
/// `vulkan-portable-sgN` presets may be given together: their modules share one text and one
/// archive, and a session opens the one of its device's subgroup size. The CPU preset's triple
/// and features are added to every module's flags.
pub fn apply(presets: &[&Preset], options: &mut ExportOptions) -> Result<()> {
    let cpus: Vec<&&Preset> = presets
        .iter()
        .filter(|p| matches!(p.kind, PresetKind::Cpu { .. }))
        .collect();
    let gpus: Vec<&&Preset> = presets
        .iter()
        .filter(|p| matches!(p.kind, PresetKind::Vulkan { .. }))
        .collect();
    let subgroup_sizes = gpus.iter().all(|p| {
        matches!(p.kind, PresetKind::Vulkan { target: Some(t) } if crate::profile::portable_subgroup_size(t).is_some())
    });
    for (kind, chosen) in [("CPU", &cpus), ("Vulkan", &gpus)] {
        if chosen.len() > 1 && !(kind == "Vulkan" && subgroup_sizes) {
            return Err(ExportError::Unsupported(format!(
                "--target: {} are both {kind} presets; an export has one {kind} target",
                chosen.iter().map(|p| p.name).collect::<Vec<_>>().join(" and ")
            )));
        }
    }
    if presets.is_empty() {
        return Err(ExportError::Unsupported("--target: no preset given".into()));
    }
    options.targets.clear();
    options.vulkan_target = None;
    for p in presets {
        match p.kind {
            PresetKind::Cpu { triple, features } => {
                options.targets.push(Target::cpu());
                options
                    .compile_flags
                    .push(format!("--iree-llvmcpu-target-triple={triple}"));
                options
                    .compile_flags
                    .push(format!("--iree-llvmcpu-target-cpu-features={features}"));
            }
            PresetKind::Vulkan { target } => {
                options.targets.push(Target::Vulkan {
                    target: target.map(str::to_string),
                });
                options.vulkan_target = (gpus.len() == 1).then(|| target.map(str::to_string)).flatten();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn android_arm64_sets_the_triple_and_features() {
        let mut options = ExportOptions::default();
        apply(&[preset("android-arm64").unwrap()], &mut options).unwrap();
        assert_eq!(options.targets, vec![Target::cpu()]);
        assert_eq!(
            options.compile_flags,
            vec![
                "--iree-llvmcpu-target-triple=aarch64-none-linux-android30".to_string(),
                "--iree-llvmcpu-target-cpu-features=+neon,+dotprod,+fullfp16".to_string(),
            ]
        );
        // The q4 kernel's choice reads that triple: aarch64's.
        assert_eq!(
            crate::kernels::KernelIsa::for_export(Some(ANDROID_ARM64_TRIPLE), &["generic"]),
            Some(crate::kernels::KernelIsa::Aarch64Neon)
        );
    }

    #[test]
    fn vulkan_presets_map_to_vulkan_targets() {
        for (name, target) in [
            ("vulkan-portable", None),
            ("vulkan-portable-16bit", Some("portable-16bit")),
            ("vulkan-portable-sg16", Some("portable-sg16")),
            ("vulkan-portable-sg64", Some("portable-sg64")),
            ("vulkan-valhall", Some("valhall")),
            ("vulkan-adreno", Some("adreno")),
        ] {
            let mut options = ExportOptions::default();
            apply(&[preset(name).unwrap()], &mut options).unwrap();
            let target = target.map(str::to_string);
            assert_eq!(
                options.targets,
                vec![Target::Vulkan { target: target.clone() }],
                "{name}"
            );
            assert_eq!(options.vulkan_target, target, "{name}");
            assert!(options.compile_flags.is_empty(), "{name}");
        }
    }

    #[test]
    fn one_cpu_and_one_vulkan_preset_at_most() {
        let mut options = ExportOptions::default();
        apply(
            &[preset("android-arm64").unwrap(), preset("vulkan-adreno").unwrap()],
            &mut options,
        )
        .unwrap();
        assert_eq!(options.targets.len(), 2);
        let err = apply(
            &[preset("vulkan-valhall").unwrap(), preset("vulkan-adreno").unwrap()],
            &mut ExportOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, ExportError::Unsupported(m) if m.contains("both Vulkan presets")),
            "{err}"
        );
        // The portable-sgN presets together: one module a subgroup size, one text.
        let mut options = ExportOptions::default();
        apply(
            &[
                preset("vulkan-portable-sg16").unwrap(),
                preset("vulkan-portable-sg64").unwrap(),
            ],
            &mut options,
        )
        .unwrap();
        assert_eq!(
            options.targets,
            vec![
                Target::Vulkan {
                    target: Some("portable-sg16".into())
                },
                Target::Vulkan {
                    target: Some("portable-sg64".into())
                },
            ]
        );
        assert_eq!(options.vulkan_target, None);
        assert_eq!(
            crate::profile::ExportProfile::resolve(&options).gpu_tuning(),
            Some(crate::profile::GpuTuning::PORTABLE)
        );
        let err = apply(
            &[
                preset("vulkan-portable-sg16").unwrap(),
                preset("vulkan-adreno").unwrap(),
            ],
            &mut ExportOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, ExportError::Unsupported(m) if m.contains("both Vulkan presets")),
            "{err}"
        );
        let err = preset("android-arm32").unwrap_err();
        assert!(
            matches!(&err, ExportError::Unsupported(m) if m.contains("known: android-arm64")),
            "{err}"
        );
    }
}
