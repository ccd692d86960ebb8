//! What a Vulkan device can run, asked of the driver when a session opens (IREE's
//! `iree_hal_device_query_i64`, categories `vulkan.feature` and `vulkan.device`).

use iree_runtime::Device;
use kv_core::Result;

use crate::convert::{contract_err, iree_err};

/// The manifest key of modules compiled for `export --vulkan-target portable-16bit`: IREE's
/// portable profile with 16-bit storage buffers, whose kernels load `i16` weights directly.
/// They need [`VulkanFeatures::loads_16bit`]; a session refuses them on a device without it.
pub const PORTABLE_16BIT_TARGET: &str = "vulkan-portable-16bit";

/// The features of a Vulkan device that decide which of our modules it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VulkanFeatures {
    /// `storageBuffer16BitAccess`: 16-bit values in storage buffers.
    pub storage_16bit: bool,
    /// `shaderInt16`: 16-bit integers in shaders.
    pub int16: bool,
    /// The driver's subgroup size (NVIDIA 32, Mali 16, Adreno 64; lavapipe 4 to 16 by the CPU's
    /// vectors). The packed and `portable-16bit` modules use no subgroup operations and do not
    /// depend on it; a `portable-sgN` module runs only where it is N.
    pub subgroup_size: u32,
    /// The subgroup operations of the device's compute shaders (`VkSubgroupFeatureFlags`; 0:
    /// none), asked through our runtime build's `vulkan.device` / `subgroup_operations` key;
    /// `None` from a runtime that does not answer it (an IREE built without our patch).
    pub subgroup_operations: Option<u32>,
}

/// `VK_SUBGROUP_FEATURE_BASIC_BIT | ARITHMETIC_BIT | SHUFFLE_BIT`: what IREE's SPIR-V code of a
/// target with `subgroup = shuffle|arithmetic` (the `portable-sgN` modules) may use.
pub const SUBGROUP_REDUCTIONS: u32 = 0x1 | 0x4 | 0x10;

impl VulkanFeatures {
    /// Asks `device` (a `vulkan` device).
    pub fn of(device: &Device) -> Result<VulkanFeatures> {
        let ask = |category: &str, key: &str| {
            device
                .query_i64(category, key)
                .map_err(iree_err(format!("query {category}::{key}")))
        };
        Ok(VulkanFeatures {
            storage_16bit: ask("vulkan.feature", "storage_buffer_16bit_access")? != 0,
            int16: ask("vulkan.feature", "shader_int16")? != 0,
            subgroup_size: ask("vulkan.device", "subgroup_size")?.try_into().unwrap_or(0),
            subgroup_operations: device
                .query_i64("vulkan.device", "subgroup_operations")
                .ok()
                .map(|ops| ops as u32),
        })
    }

    /// The features of this machine's default Vulkan device (opens one).
    pub fn of_default_device() -> Result<VulkanFeatures> {
        let instance = iree_runtime::Instance::shared().map_err(iree_err("create instance"))?;
        let device = Device::open(&instance, "vulkan").map_err(iree_err("open device `vulkan`"))?;
        VulkanFeatures::of(&device)
    }

    /// Whether modules compiled with 16-bit storage ([`PORTABLE_16BIT_TARGET`], and the i16
    /// weights of named GPU targets) can load their `i16` values on this device.
    pub fn loads_16bit(&self) -> bool {
        self.storage_16bit && self.int16
    }

    /// Whether the device's compute shaders have the subgroup reductions and shuffles of the
    /// `portable-sgN` modules (true where the runtime cannot tell).
    pub fn reduces_in_subgroups(&self) -> bool {
        self.subgroup_operations
            .is_none_or(|ops| ops & SUBGROUP_REDUCTIONS == SUBGROUP_REDUCTIONS)
    }

    /// The `--vulkan-target` of the fastest portable module this device runs: `portable-sgN`
    /// (N its subgroup size) where it has 16-bit storage and subgroup reductions, else `None`
    /// (the portable target's packed module, which runs on every driver).
    pub fn portable_target(&self) -> Option<String> {
        let size = self.subgroup_size;
        (self.loads_16bit() && self.reduces_in_subgroups() && PORTABLE_SUBGROUP_SIZES.contains(&size))
            .then(|| format!("portable-sg{size}"))
    }
}

/// The manifest keys of modules compiled for `export --vulkan-target portable-sgN`: 16-bit
/// storage and subgroup operations in subgroups of N lanes (`vulkan-portable-sg32`).
pub const PORTABLE_SUBGROUPS_TARGET: &str = "vulkan-portable-sg";

/// The subgroup sizes of the `portable-sgN` modules the exporter makes
/// (`export::profile::SUBGROUP_SIZES`; the exporter is not a dependency of the runtime).
pub const PORTABLE_SUBGROUP_SIZES: [u32; 5] = [4, 8, 16, 32, 64];

/// The subgroup size a `vulkan-portable-sgN` module key names.
pub fn subgroups_of(target: &str) -> Option<u32> {
    target.strip_prefix(PORTABLE_SUBGROUPS_TARGET)?.parse().ok()
}

impl VulkanFeatures {
    /// The modules a Vulkan session on this device opens when none is named: among `keys` (a
    /// manifest's), the `vulkan-portable-sgN` ones of its subgroup size where the manifest has
    /// them (an export for several GPUs' subgroups, one archive), else `default`.
    pub fn pick<'a>(&self, keys: impl IntoIterator<Item = &'a String>, default: String) -> String {
        keys.into_iter()
            .find(|k| subgroups_of(k) == Some(self.subgroup_size))
            .cloned()
            .unwrap_or(default)
    }

    /// Refuses modules of `target` that need a feature this device lacks, before they are loaded
    /// (IREE would fail later, at pipeline creation, with a driver message that names no
    /// feature; a module of another subgroup size would load and compute wrong). Modules of
    /// [`PORTABLE_16BIT_TARGET`] need 16-bit loads; `vulkan-portable-sgN` modules need subgroups of N lanes with
    /// reductions and 16-bit loads; every other module runs on any Vulkan device.
    pub fn check(&self, target: &str) -> Result<()> {
        let subgroups = subgroups_of(target);
        if let Some(size) = subgroups.filter(|&n| n != self.subgroup_size) {
            return Err(contract_err(
                "open",
                format!(
                    "the `{target}` modules assume subgroups of {size} lanes and this Vulkan device's \
                     are {}: export for `--vulkan-target portable-sg{}` (or the portable target)",
                    self.subgroup_size, self.subgroup_size
                ),
            ));
        }
        if subgroups.is_some() && !self.reduces_in_subgroups() {
            return Err(contract_err(
                "open",
                format!(
                    "the `{target}` modules reduce in subgroups (arithmetic and shuffles), which this \
                     Vulkan device's compute shaders lack (VkSubgroupFeatureFlags {:#x}): export for \
                     the portable target instead",
                    self.subgroup_operations.unwrap_or(0)
                ),
            ));
        }
        if (target != PORTABLE_16BIT_TARGET && subgroups.is_none()) || self.loads_16bit() {
            return Ok(());
        }
        Err(contract_err(
            "open",
            format!(
                "the `{target}` modules load 16-bit values, and this Vulkan device lacks {}: \
                 export for the portable target (packed weights) instead",
                [
                    (!self.storage_16bit).then_some("storageBuffer16BitAccess"),
                    (!self.int16).then_some("shaderInt16"),
                ]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" and ")
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key the runtime checks is the one the exporter writes for that target.
    #[test]
    fn the_16bit_key_is_the_exporter_s() {
        let target = export::Target::Vulkan {
            target: Some(export::profile::PORTABLE_16BIT.to_string()),
        };
        assert_eq!(target.key(), PORTABLE_16BIT_TARGET);
        for size in export::profile::SUBGROUP_SIZES {
            let target = export::Target::Vulkan {
                target: Some(format!("{}{size}", export::profile::PORTABLE_SUBGROUPS)),
            };
            assert_eq!(subgroups_of(&target.key()), Some(size));
        }
        assert_eq!(subgroups_of(PORTABLE_16BIT_TARGET), None);
        assert_eq!(PORTABLE_SUBGROUP_SIZES, export::profile::SUBGROUP_SIZES);
    }

    /// What each module needs of a device, and which of a manifest's modules a device opens.
    #[test]
    fn each_module_needs_its_features() {
        let device = VulkanFeatures {
            storage_16bit: true,
            int16: true,
            subgroup_size: 32,
            subgroup_operations: Some(0x7f),
        };
        let no_16bit = VulkanFeatures {
            storage_16bit: false,
            ..device
        };
        let no_reductions = VulkanFeatures {
            subgroup_operations: Some(0x1 | 0x10),
            ..device
        };
        let refused = |features: &VulkanFeatures, target: &str, needle: &str| match features.check(target) {
            Err(kv_core::Error::ContractMismatch { op, message, .. }) => {
                assert_eq!(op, "open");
                assert!(message.contains(needle), "{target}: {message}");
            }
            other => panic!("{target} on {features:?}: {other:?}"),
        };
        for target in ["vulkan", "vulkan-ampere", "vulkan-portable-sg32", PORTABLE_16BIT_TARGET] {
            assert!(device.check(target).is_ok(), "{target}");
        }
        assert!(
            no_16bit.check("vulkan").is_ok(),
            "the packed module needs no 16-bit storage"
        );
        assert!(no_reductions.check(PORTABLE_16BIT_TARGET).is_ok());
        refused(&no_16bit, PORTABLE_16BIT_TARGET, "storageBuffer16BitAccess");
        refused(&no_16bit, "vulkan-portable-sg32", "storageBuffer16BitAccess");
        refused(
            &VulkanFeatures { int16: false, ..device },
            "vulkan-portable-sg32",
            "shaderInt16",
        );
        refused(
            &device,
            "vulkan-portable-sg16",
            "subgroups of 16 lanes and this Vulkan device's are 32",
        );
        refused(&no_reductions, "vulkan-portable-sg32", "VkSubgroupFeatureFlags 0x11");

        let keys: Vec<String> = ["vulkan-portable-sg16", "vulkan-portable-sg32", "vulkan-portable-sg64"]
            .map(String::from)
            .to_vec();
        assert_eq!(device.pick(&keys, keys[0].clone()), "vulkan-portable-sg32");
        let mali = VulkanFeatures {
            subgroup_size: 16,
            ..device
        };
        assert_eq!(mali.pick(&keys, "vulkan".into()), "vulkan-portable-sg16");
        let other = VulkanFeatures {
            subgroup_size: 8,
            ..device
        };
        assert_eq!(
            other.pick(&keys, keys[2].clone()),
            "vulkan-portable-sg64",
            "none of its size"
        );
        assert_eq!(device.pick(&["vulkan".to_string()], "vulkan".into()), "vulkan");
    }

    /// The module a device gets: `portable-sgN` only with 16-bit storage, subgroup reductions
    /// and a size the exporter makes; the packed module otherwise.
    #[test]
    fn the_portable_target_follows_the_device() {
        let device = VulkanFeatures {
            storage_16bit: true,
            int16: true,
            subgroup_size: 16,
            subgroup_operations: Some(0x7f),
        };
        assert_eq!(device.portable_target().as_deref(), Some("portable-sg16"));
        let unknown_ops = VulkanFeatures {
            subgroup_operations: None,
            ..device
        };
        assert_eq!(unknown_ops.portable_target().as_deref(), Some("portable-sg16"));
        for other in [
            VulkanFeatures {
                storage_16bit: false,
                ..device
            },
            VulkanFeatures { int16: false, ..device },
            VulkanFeatures {
                subgroup_operations: Some(0x1 | 0x10),
                ..device
            },
            VulkanFeatures {
                subgroup_operations: Some(0),
                ..device
            },
            VulkanFeatures {
                subgroup_size: 2,
                ..device
            },
            VulkanFeatures {
                subgroup_size: 128,
                ..device
            },
        ] {
            assert_eq!(other.portable_target(), None, "{other:?}");
        }
    }
}
