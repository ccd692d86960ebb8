//! The target flags shared by `export` and the commands that export on demand (`generate`,
//! `bench`, `chat`, `serve`, ...): one type, one parser and one help text per flag, so a flag
//! means the same on every command. Where a default differs per command (`--cpu`,
//! `--contract`, `--matmul-input`, `--cache-type`), the field is an `Option` and the help says
//! which default each takes and why.

use clap::builder::{EnumValueParser, PossibleValue, TypedValueParser};
use clap::ValueEnum;
use kv_core::contract::ContractVersion;
use kv_core::manifest::{CacheType, MatmulInput};

use crate::model::WeightsChoice;

/// `--weights`, `--cpu`, `--vulkan-target`, `--contract`, `--matmul-input` and `--cache-type`,
/// flattened into every command that exports (under the heading of the flags around them).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TargetFlags {
    /// The model's weight format: `bf16` as imported (the default), or `q8` / `q4`
    /// block-quantized (int8 or signed 4-bit, an f16 scale per block of 32; a real model imported
    /// so from its GGUF blocks, a fixture or directory re-quantized once), dequantized inside the
    /// matmuls; every backend computes with the same dequantized values. (How `export` declares
    /// the weights in the graphs is `--weight-storage`.)
    #[arg(long, value_parser = WeightsParser)]
    pub weights: Option<WeightsChoice>,
    /// The CPU the CPU modules are compiled for (`--iree-llvmcpu-target-cpu`): `host`, every
    /// feature of this CPU (e.g. AVX-512 BF16; the artifacts run only on CPUs like it, so each
    /// CPU model and feature set gets its own cache entry); `generic`, any x86-64 / the portable
    /// baseline; or an LLVM CPU name (`x86-64-v3`: AVX2 + FMA, `znver4`, ...). Default: `generic`
    /// on `export` (artifacts that travel to other machines), `host` on the commands that export
    /// on demand (artifacts that run here).
    #[arg(long, value_parser = parse_cpu)]
    pub cpu: Option<CpuChoice>,
    /// The GPU the Vulkan modules are compiled for (`--iree-vulkan-target`: ampere, valhall,
    /// adreno, rdna3, ...); such modules run only on that GPU family (on lavapipe they compute
    /// wrong results). An export made on demand for it declares the weights i16, widened inside
    /// the decode step's matmuls, which needs the GPU's 16-bit storage (`export --weight-storage
    /// i16`), and NVIDIA targets get configured dispatches. `portable-sgN` (N = 4, 8, 16, 32,
    /// 64): the portable limits with 16-bit storage and subgroup reductions in subgroups of N
    /// lanes (Mali 16, NVIDIA 32, Adreno 64, lavapipe 4 to 16): i16 weights, the configured
    /// one-pass dispatches, no vendor constants; a session refuses it on a device of another
    /// subgroup size. `portable-16bit`: IREE's portable baseline with 16-bit storage (i16
    /// weights, no subgroup operations). `portable`: IREE's portable baseline
    /// (`vp_android_baseline_2022`) with packed weights, which runs on any driver. Default:
    /// `portable` on `export` (artifacts that travel); on the commands that export on demand,
    /// the fastest of these this machine's Vulkan device runs (`portable-sgN` for its subgroup
    /// size where it has 16-bit storage and subgroup reductions, else `portable`; `portable` for
    /// quantized `--weights`).
    #[arg(long)]
    pub vulkan_target: Option<String>,
    /// The graph contract: `1` (the seed's: dynamic past, a prefill graph), `2` (static shapes
    /// over caches the runtime owns, sliding layers on rings, a prefill graph of `--prefill-seq`
    /// rows, default 128, that takes the caches like the chunk graph; docs/contract-v2.md), or
    /// `auto`, the library's choice per target (`export::device::default_contract`): 2 on the CPU,
    /// IREE's portable Vulkan profiles (the default, `portable-16bit`) and NVIDIA
    /// `--vulkan-target`s, 1 on other named GPU families and under the seed's window rule; an export for several targets takes 1 where any target's is 1.
    /// Default: `1` on `export` (an export script's artifacts do not change under it), `auto` on
    /// the commands that export on demand. Artifacts given with `--artifacts` say their own.
    #[arg(long, value_enum)]
    pub contract: Option<ContractChoice>,
    /// What the projections multiply: `f32` (the FP32 forward), `bf16` (each projection's input
    /// rounded to bf16, bf16 × bf16 → f32 matmuls: the fast kernels of CPUs with bf16 dot
    /// products, e.g. AVX-512 BF16; needs weights declared bf16, as CPU targets' runtime settings
    /// and `export --weight-storage bf16` declare them, and CPU targets only; the manifest
    /// records it, and the reference then rounds the same inputs), or `auto`, the target's
    /// runtime setting: bf16 for contract 2 on a `--cpu host` that has bf16 dot products, else
    /// f32 (an export: bf16 only where every target's is and the weights are declared bf16).
    /// Default: `f32` on `export` (an export script's artifacts do not change under it), `auto`
    /// on the commands that export on demand.
    #[arg(long, value_enum)]
    pub matmul_input: Option<MatmulInputChoice>,
    /// The element type of contract 2's KV caches: `f32`, `f16` (half the bytes a step reads
    /// from its caches and half the memory a session and its snapshots hold; each K and V row
    /// rounded to f16 where it is computed; needs contract 2 and CPU targets only, and a CPU
    /// that converts f16 in hardware to be fast, x86 F16C or aarch64; the manifest records it,
    /// and the reference then rounds the same rows), or `auto`, the target's runtime setting:
    /// f16 for contract 2 on a `--cpu host` that converts f16 in hardware, else f32 (an export:
    /// f16 only where every target's is). Default: `f32` on `export`, `auto` on the commands
    /// that export on demand.
    #[arg(long, value_enum)]
    pub cache_type: Option<CacheTypeChoice>,
}

/// `--matmul-input`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MatmulInputChoice {
    /// The target's runtime setting.
    Auto,
    /// The FP32 forward: activations enter the matmuls unrounded.
    F32,
    /// Each projection's input rounded to bf16.
    Bf16,
}

impl MatmulInputChoice {
    /// The rounding asked for; `None` for `auto`.
    pub fn asked(self) -> Option<MatmulInput> {
        match self {
            MatmulInputChoice::Auto => None,
            MatmulInputChoice::F32 => Some(MatmulInput::F32),
            MatmulInputChoice::Bf16 => Some(MatmulInput::Bf16),
        }
    }
}

/// `--cache-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CacheTypeChoice {
    /// The target's runtime setting.
    Auto,
    /// f32 caches.
    F32,
    /// f16 caches.
    F16,
}

impl CacheTypeChoice {
    /// The element type asked for; `None` for `auto`.
    pub fn asked(self) -> Option<CacheType> {
        match self {
            CacheTypeChoice::Auto => None,
            CacheTypeChoice::F32 => Some(CacheType::F32),
            CacheTypeChoice::F16 => Some(CacheType::F16),
        }
    }
}

/// `--vulkan-target portable`: IREE's portable target (`vp_android_baseline_2022`, packed
/// weights), named so that the commands exporting on demand can be given it.
pub const PORTABLE_VULKAN_TARGET: &str = "portable";

impl TargetFlags {
    /// `--weights`, `bf16` when not given.
    pub fn weights(&self) -> WeightsChoice {
        self.weights.unwrap_or_default()
    }

    /// The `--iree-vulkan-target`s of `export`'s Vulkan modules: `--vulkan-target`, IREE's
    /// portable target (`None`) where not given or `portable`; several, comma-separated, only
    /// of `portable-sgN` targets (a module a subgroup size sharing one text and archive).
    #[cfg(feature = "iree")]
    pub fn export_vulkan_targets(&self) -> anyhow::Result<Vec<Option<String>>> {
        let Some(given) = &self.vulkan_target else {
            return Ok(vec![None]);
        };
        let targets: Vec<Option<String>> = given
            .split(',')
            .map(str::trim)
            .map(|t| (t != PORTABLE_VULKAN_TARGET).then(|| t.to_string()))
            .collect();
        let sized = |t: &Option<String>| {
            t.as_deref()
                .is_some_and(|t| export::profile::portable_subgroup_size(t).is_some())
        };
        if targets.len() > 1 && !targets.iter().all(sized) {
            anyhow::bail!(
                "--vulkan-target {given}: several targets only of portable-sgN (one module a subgroup size); \
                 export the others one at a time"
            );
        }
        Ok(targets)
    }
}

/// `--cpu`: the CPU the IREE CPU modules are compiled for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpuChoice {
    /// Every feature of the CPU compiling.
    Host,
    /// Any x86-64 / the portable baseline.
    Generic,
    /// An LLVM CPU name (`x86-64-v3`, `znver4`, ...), passed to `iree-compile` as it is.
    Named(String),
}

// Read by the IREE backends' on-demand exports and `export`, both behind the `iree` feature.
#[cfg_attr(not(feature = "iree"), allow(dead_code))]
impl CpuChoice {
    /// The name `iree-compile` and the cache keys take.
    pub fn name(&self) -> &str {
        match self {
            CpuChoice::Host => "host",
            CpuChoice::Generic => "generic",
            CpuChoice::Named(name) => name,
        }
    }
}

/// `--cpu`'s parser: `host`, `generic`, or a CPU name of letters, digits, `-`, `_` and `.` (it
/// becomes part of a compiler flag and of a cache key).
pub fn parse_cpu(text: &str) -> Result<CpuChoice, String> {
    match text {
        "host" => Ok(CpuChoice::Host),
        "generic" => Ok(CpuChoice::Generic),
        name if !name.is_empty()
            && !name.starts_with('-')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) =>
        {
            Ok(CpuChoice::Named(name.into()))
        }
        other => Err(format!(
            "`{other}`: a CPU is `host`, `generic` or an LLVM CPU name of letters, digits, `-`, `_` and `.` \
             (e.g. `x86-64-v3`)"
        )),
    }
}

/// `--contract`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ContractChoice {
    /// The library's choice per target.
    Auto,
    /// Contract 1.
    #[value(name = "1")]
    V1,
    /// Contract 2.
    #[value(name = "2")]
    V2,
}

#[cfg_attr(not(feature = "iree"), allow(dead_code))]
impl ContractChoice {
    /// The version asked for; `None` for `auto`.
    pub fn version(self) -> Option<ContractVersion> {
        match self {
            ContractChoice::Auto => None,
            ContractChoice::V1 => Some(ContractVersion::V1),
            ContractChoice::V2 => Some(ContractVersion::V2),
        }
    }
}

/// `--weights`' parser: the formats `bf16`, `q8`, `q4`; the values `--weights` took on `export`
/// before it named the format (`packed`, `i16`: how the graphs declare the weights) are refused
/// naming the flag that took them over, rather than read as something else.
#[derive(Clone)]
pub struct WeightsParser;

impl TypedValueParser for WeightsParser {
    type Value = WeightsChoice;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<WeightsChoice, clap::Error> {
        if let Some(old @ ("packed" | "i16")) = value.to_str() {
            return Err(clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!(
                    "--weights {old}: --weights is the weight format (bf16, q8, q4); how export declares the \
                     weights in the graphs is `export --weight-storage {old}`\n"
                ),
            )
            .with_cmd(cmd));
        }
        EnumValueParser::<WeightsChoice>::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(
            WeightsChoice::value_variants()
                .iter()
                .filter_map(ValueEnum::to_possible_value),
        ))
    }
}

/// The contract of an export for `targets` under `choice` (`None`: `export`'s default, 1):
/// `auto` takes the library's default of each target and 1 where any is 1, since the targets
/// share one manifest and one contract.
#[cfg(feature = "iree")]
pub fn export_contract(choice: Option<ContractChoice>, targets: &[export::Target]) -> ContractVersion {
    match choice.unwrap_or(ContractChoice::V1).version() {
        Some(version) => version,
        None => targets
            .iter()
            .map(|t| export::device::default_contract(t, false))
            .min()
            .unwrap_or(ContractVersion::V1),
    }
}

/// `--matmul-input` and `--cache-type` of an export for `targets` under `contract` whose
/// weights are declared `weights` (`None`: `export`'s default, f32): `auto` takes the targets'
/// runtime settings ([`export::runtime_options_for`]) where they all agree on the rounding
/// and, for bf16 inputs, the weights are declared bf16; f32 otherwise.
#[cfg(feature = "iree")]
pub fn export_rounding(
    flags: &TargetFlags,
    targets: &[export::Target],
    contract: ContractVersion,
    weights: export::WeightFormat,
) -> (MatmulInput, CacheType) {
    let runtime: Vec<export::ExportOptions> = targets
        .iter()
        .map(|t| export::runtime_options_for(t, contract))
        .collect();
    let every = |f: &dyn Fn(&export::ExportOptions) -> bool| !runtime.is_empty() && runtime.iter().all(f);
    let matmul_input = match flags.matmul_input.unwrap_or(MatmulInputChoice::F32).asked() {
        Some(asked) => asked,
        None if weights == export::WeightFormat::Bf16 && every(&|o| o.matmul_input == MatmulInput::Bf16) => {
            MatmulInput::Bf16
        }
        None => MatmulInput::F32,
    };
    let cache_type = match flags.cache_type.unwrap_or(CacheTypeChoice::F32).asked() {
        Some(asked) => asked,
        None if every(&|o| o.cache_type == CacheType::F16) => CacheType::F16,
        None => CacheType::F32,
    };
    (matmul_input, cache_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_are_host_generic_or_a_name() {
        assert_eq!(parse_cpu("host"), Ok(CpuChoice::Host));
        assert_eq!(parse_cpu("generic"), Ok(CpuChoice::Generic));
        assert_eq!(
            parse_cpu("x86-64-v3").map(|c| c.name().to_string()),
            Ok("x86-64-v3".into())
        );
        assert_eq!(parse_cpu("znver4"), Ok(CpuChoice::Named("znver4".into())));
        for bad in ["", "-x", "a b", "a/b", "x86;rm"] {
            assert!(parse_cpu(bad).unwrap_err().contains("LLVM CPU name"), "{bad:?}");
        }
    }

    #[cfg(feature = "iree")]
    #[test]
    fn an_export_s_auto_contract_is_1_where_any_target_s_is() {
        use ContractVersion::{V1, V2};
        let ampere = export::Target::Vulkan {
            target: Some("ampere".into()),
        };
        let cpu = export::Target::cpu();
        let auto = Some(ContractChoice::Auto);
        assert_eq!(
            export_contract(None, std::slice::from_ref(&cpu)),
            V1,
            "export's default"
        );
        assert_eq!(export_contract(auto, std::slice::from_ref(&cpu)), V2);
        assert_eq!(export_contract(auto, &[cpu.clone(), ampere.clone()]), V2);
        // The portable Vulkan profile is 2 since session 24; a named non-NVIDIA family is 1.
        assert_eq!(export_contract(auto, &[cpu.clone(), export::Target::vulkan()]), V2);
        let valhall = export::Target::Vulkan {
            target: Some("valhall".into()),
        };
        assert_eq!(export_contract(auto, &[cpu.clone(), valhall]), V1);
        assert_eq!(export_contract(auto, &[ampere]), V2);
        assert_eq!(
            export_contract(Some(ContractChoice::V2), &[export::Target::vulkan()]),
            V2
        );
        assert_eq!(export_contract(Some(ContractChoice::V1), &[cpu]), V1);
    }

    /// `auto` on an export: the runtime settings where every target has them (f32 on a
    /// generic CPU and on Vulkan whatever the host is); the explicit values as they are.
    #[cfg(feature = "iree")]
    #[test]
    fn an_export_s_auto_rounding_is_the_targets_runtime_settings() {
        use export::{Target, WeightFormat};
        let auto = TargetFlags {
            matmul_input: Some(MatmulInputChoice::Auto),
            cache_type: Some(CacheTypeChoice::Auto),
            ..TargetFlags::default()
        };
        let f32s = (MatmulInput::F32, CacheType::F32);
        assert_eq!(
            export_rounding(
                &TargetFlags::default(),
                &[Target::cpu()],
                ContractVersion::V2,
                WeightFormat::Bf16
            ),
            f32s
        );
        assert_eq!(
            export_rounding(&auto, &[Target::cpu()], ContractVersion::V2, WeightFormat::Bf16),
            f32s
        );
        let host = Target::Cpu { cpu: "host".into() };
        let runtime = export::runtime_options_for(&host, ContractVersion::V2);
        assert_eq!(
            export_rounding(
                &auto,
                std::slice::from_ref(&host),
                ContractVersion::V2,
                WeightFormat::Bf16
            ),
            (runtime.matmul_input, runtime.cache_type)
        );
        assert_eq!(
            export_rounding(
                &auto,
                std::slice::from_ref(&host),
                ContractVersion::V2,
                WeightFormat::PackedI32
            )
            .0,
            MatmulInput::F32,
            "bf16 inputs need bf16 weight declarations"
        );
        assert_eq!(
            export_rounding(
                &auto,
                &[host.clone(), Target::vulkan()],
                ContractVersion::V2,
                WeightFormat::Bf16
            ),
            f32s
        );
        assert_eq!(
            export_rounding(
                &auto,
                std::slice::from_ref(&host),
                ContractVersion::V1,
                WeightFormat::Bf16
            ),
            f32s
        );
        let asked = TargetFlags {
            matmul_input: Some(MatmulInputChoice::Bf16),
            cache_type: Some(CacheTypeChoice::F16),
            ..TargetFlags::default()
        };
        assert_eq!(
            export_rounding(
                &asked,
                &[Target::vulkan()],
                ContractVersion::V1,
                WeightFormat::PackedI32
            ),
            (MatmulInput::Bf16, CacheType::F16),
            "asked for, then refused by the library's rules"
        );
    }
}
