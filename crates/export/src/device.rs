//! Choosing (and making) the artifacts of a model for a runtime device: the one function the
//! CLI's on-demand exports and an app's side (the JNI) call, so the contract a device gets, the
//! runtime settings of its target and the reuse of a model directory that already holds modules
//! are decided in one place ([`artifacts_for_device`]).

use std::path::{Path, PathBuf};

use kv_core::manifest::{CacheType, MatmulInput};
use kv_core::ContractVersion;

use crate::profile::{GpuFamily, TargetProfile};
use crate::{ExportOptions, Result, Target};

/// What a session on a device needs of an export made on demand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRequest {
    /// The compile target (`Cpu { cpu: "host" }` for this machine, `Vulkan { target }`).
    pub target: Target,
    /// The graph contract; `None`: [`default_contract`].
    pub contract: Option<ContractVersion>,
    /// The session runs the seed's window rule, which contract 2 does not.
    pub seed_rule: bool,
    /// The graphs must return at least this many top logits (sampling); 0: none needed.
    pub top_k: usize,
    /// `SEQ` of the redecode graphs; `None`: the prefill's.
    pub redecode_seq: Option<usize>,
    /// `Some(F32)` keeps the FP32 forward where the runtime settings would round matmul inputs
    /// to bf16 ([`crate::runtime_options_for`]); `None`: the runtime settings.
    pub matmul_input: Option<MatmulInput>,
    /// `Some(F32)` keeps f32 caches where the runtime settings would take f16; `None`: theirs.
    pub cache_type: Option<CacheType>,
}

impl DeviceRequest {
    /// The runtime settings of `target`, nothing else asked.
    pub fn new(target: Target) -> DeviceRequest {
        DeviceRequest {
            target,
            contract: None,
            seed_rule: false,
            top_k: 0,
            redecode_seq: None,
            matmul_input: None,
            cache_type: None,
        }
    }

    /// The contract this request gets: its own, else [`default_contract`].
    pub fn contract(&self) -> ContractVersion {
        self.contract
            .unwrap_or_else(|| default_contract(&self.target, self.seed_rule))
    }

    /// The export options of this request: [`crate::runtime_options_for`] its target and
    /// contract, with its top-k, redecode SEQ and the FP32 choices it makes.
    pub fn options(&self) -> ExportOptions {
        let runtime = crate::runtime_options_for(&self.target, self.contract());
        ExportOptions {
            targets: vec![self.target.clone()],
            redecode_seq: self.redecode_seq,
            top_k: self.top_k,
            matmul_input: self.matmul_input.unwrap_or(runtime.matmul_input),
            cache_type: self.cache_type.unwrap_or(runtime.cache_type),
            ..runtime
        }
    }
}

/// The contract a device gets when none is asked for: v2 on the CPU, on NVIDIA Vulkan targets
/// and on IREE's portable profiles (the default Vulkan export a phone gets; all measured faster
/// there: docs/benchmarks.md), 1 on other named GPU families (`valhall`, `adreno`: not measured,
/// they need their own GPU) and under the seed's window rule, which contract 2 does not run.
pub fn default_contract(target: &Target, seed_rule: bool) -> ContractVersion {
    let v2 = !seed_rule
        && match TargetProfile::of(target) {
            TargetProfile::Vulkan { family, .. } => {
                matches!(
                    family,
                    GpuFamily::Nvidia | GpuFamily::Portable | GpuFamily::Portable16 | GpuFamily::Subgroups { .. }
                )
            }
            TargetProfile::Cpu { .. } | TargetProfile::CpuHost { .. } => true,
        };
    if v2 {
        ContractVersion::V2
    } else {
        ContractVersion::V1
    }
}

/// The artifact directory for `request` of the model `model` (a fixture name, or a model
/// directory): the directory itself where it already holds modules for the target with the
/// contract and top-k asked (and no redecode SEQ is asked), else the cached export of the
/// request's options, made now under the cache's lock unless cached ([`crate::cached_export_noting`]),
/// telling `notify` when this caller waits or builds.
pub fn artifacts_for_device(
    model: &str,
    request: &DeviceRequest,
    notify: &mut dyn FnMut(kv_paths::FillEvent),
) -> Result<PathBuf> {
    if request.redecode_seq.is_none() && holds_modules_for(Path::new(model), request) {
        return Ok(PathBuf::from(model));
    }
    crate::cached_export_noting(model, &request.options(), notify)
}

/// Whether the model directory `dir` is itself an export with modules for the request.
fn holds_modules_for(dir: &Path, request: &DeviceRequest) -> bool {
    kv_core::Manifest::load(dir).is_ok_and(|m| {
        m.modules.contains_key(&request.target.key())
            && m.top_k.unwrap_or(0) >= request.top_k
            && m.contract.version() == request.contract()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_2_on_the_cpu_nvidia_and_portable_vulkan() {
        let vulkan = |t: Option<&str>| Target::Vulkan {
            target: t.map(String::from),
        };
        use ContractVersion::{V1, V2};
        assert_eq!(default_contract(&Target::cpu(), false), V2);
        assert_eq!(default_contract(&Target::Cpu { cpu: "host".into() }, false), V2);
        assert_eq!(default_contract(&vulkan(None), false), V2, "the portable profile");
        assert_eq!(
            default_contract(&vulkan(Some(crate::profile::PORTABLE_16BIT)), false),
            V2
        );
        assert_eq!(default_contract(&vulkan(None), true), V1, "the seed's rule");
        assert_eq!(default_contract(&vulkan(Some("ampere")), false), V2, "NVIDIA targets");
        assert_eq!(default_contract(&vulkan(Some("valhall")), false), V1);
        assert_eq!(default_contract(&Target::cpu(), true), V1, "the seed's rule");
        assert_eq!(default_contract(&vulkan(Some("ampere")), true), V1);
        let asked = DeviceRequest {
            contract: Some(V1),
            ..DeviceRequest::new(Target::cpu())
        };
        assert_eq!(asked.contract(), V1);
    }

    /// The request's choices on top of the runtime settings, which pass the library's rules.
    #[test]
    fn options_are_the_runtime_settings_with_the_request_s_choices() {
        let host = Target::Cpu { cpu: "host".into() };
        let plain = DeviceRequest::new(host.clone()).options();
        let runtime = crate::runtime_options_for(&host, ContractVersion::V2);
        assert_eq!(plain.targets, vec![host.clone()]);
        assert_eq!(
            (plain.matmul_input, plain.cache_type, plain.contract),
            (runtime.matmul_input, runtime.cache_type, ContractVersion::V2)
        );
        let fp32 = DeviceRequest {
            top_k: 8,
            redecode_seq: Some(128),
            matmul_input: Some(MatmulInput::F32),
            cache_type: Some(CacheType::F32),
            ..DeviceRequest::new(host)
        }
        .options();
        assert_eq!(
            (fp32.matmul_input, fp32.cache_type, fp32.top_k, fp32.redecode_seq),
            (MatmulInput::F32, CacheType::F32, 8, Some(128))
        );
        for target in [
            Target::cpu(),
            Target::vulkan(),
            Target::Vulkan {
                target: Some("ampere".into()),
            },
        ] {
            let request = DeviceRequest::new(target.clone());
            assert_eq!(request.options().check(None), Ok(()), "{target:?}");
        }
    }
}
