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
    /// vectors). Our portable modules use no subgroup operations, so they do not depend on it.
    pub subgroup_size: u32,
}

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
}

/// Refuses modules of `target` that need a feature `device` lacks, before they are loaded (IREE
/// would fail later, at pipeline creation, with a driver message that names no feature).
pub(crate) fn check_target(device: &Device, target: &str) -> Result<()> {
    if target != PORTABLE_16BIT_TARGET {
        return Ok(());
    }
    let features = VulkanFeatures::of(device)?;
    if features.loads_16bit() {
        return Ok(());
    }
    Err(contract_err(
        "open",
        format!(
            "the `{target}` modules load 16-bit values, and this Vulkan device lacks {}: \
             export for the portable target (packed weights) instead",
            [
                (!features.storage_16bit).then_some("storageBuffer16BitAccess"),
                (!features.int16).then_some("shaderInt16"),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" and ")
        ),
    ))
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
    }
}
