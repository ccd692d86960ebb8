//! Which backend a command runs on, and opening it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use backend_reference::{ReferenceKv, ReferenceModel, ReferenceRedecode};
use clap::ValueEnum;
use kv_core::WindowRule;

#[cfg(feature = "iree")]
use crate::flags::{CacheTypeChoice, MatmulInputChoice};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The FP32 ndarray reference (host).
    Reference,
    /// IREE on the CPU, `local-task` (multi-threaded).
    #[cfg(feature = "iree")]
    IreeCpu,
    /// IREE on the CPU, `local-sync` (the calling thread only).
    #[cfg(feature = "iree")]
    IreeCpuSync,
    /// IREE on `vulkan` (a GPU, or lavapipe).
    #[cfg(feature = "iree")]
    IreeVulkan,
}

impl BackendChoice {
    #[cfg(feature = "iree")]
    pub(crate) fn device(self) -> Option<&'static str> {
        match self {
            BackendChoice::Reference => None,
            BackendChoice::IreeCpu => Some("local-task"),
            BackendChoice::IreeCpuSync => Some("local-sync"),
            BackendChoice::IreeVulkan => Some("vulkan"),
        }
    }
}

/// `--window-rule`: the exact rule, or the seed library's one-key-wider steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum RuleChoice {
    #[default]
    Exact,
    Seed,
}

impl From<RuleChoice> for WindowRule {
    fn from(rule: RuleChoice) -> Self {
        match rule {
            RuleChoice::Exact => WindowRule::Exact,
            RuleChoice::Seed => WindowRule::SeedStep,
        }
    }
}

/// An opened KV session of any backend. [`with_kv!`] runs generic code on whichever it is.
pub enum AnyKv {
    Reference(ReferenceKv),
    #[cfg(feature = "iree")]
    Iree(Box<backend_iree::IreeKvBackend>),
}

/// An opened redecode session of any backend.
pub enum AnyRedecode {
    Reference(ReferenceRedecode),
    #[cfg(feature = "iree")]
    Iree(Box<backend_iree::IreeRedecodeBackend>),
}

/// Runs `$body` with `$b` bound to the concrete backend inside an [`AnyKv`] / [`AnyRedecode`].
#[macro_export]
macro_rules! with_backend {
    ($any:expr, $b:ident => $body:expr) => {
        match $any {
            $crate::backends::AnyKv::Reference($b) => $body,
            #[cfg(feature = "iree")]
            $crate::backends::AnyKv::Iree($b) => $body,
        }
    };
}

#[macro_export]
macro_rules! with_redecode {
    ($any:expr, $b:ident => $body:expr) => {
        match $any {
            $crate::backends::AnyRedecode::Reference($b) => $body,
            #[cfg(feature = "iree")]
            $crate::backends::AnyRedecode::Iree($b) => $body,
        }
    };
}

/// `--prefill`: how an IREE session runs a prompt from position 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum PrefillChoice {
    /// Chosen per device: on the CPU chunk calls from an empty cache for prompts
    /// of up to 8 chunks, the prefill graph above (contract 2: its prefill graph while more than
    /// two chunk calls are left); on Vulkan chunk calls only for one chunk.
    #[default]
    Auto,
    /// Always the prefill graph (all SEQ rows, whatever the prompt's length; contract 2: pieces
    /// of its prefill graph's rows).
    Graph,
    /// Always chunk calls from an empty cache.
    Chunks,
}

#[cfg(feature = "iree")]
impl PrefillChoice {
    fn route(self, device: &str) -> backend_iree::PrefillRoute {
        match self {
            PrefillChoice::Auto => backend_iree::PrefillRoute::auto_for(device),
            PrefillChoice::Graph => backend_iree::PrefillRoute::Graph,
            PrefillChoice::Chunks => backend_iree::PrefillRoute::Chunks,
        }
    }
}

/// What an export made on demand is compiled for (each choice has its own cache entry), and how
/// its prefill runs.
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "IREE artifacts made on demand")]
pub struct TargetArgs {
    /// How an IREE session runs a prompt from position 0: a short prompt need not pay for the
    /// prefill graph's SEQ rows.
    #[arg(long, value_enum, default_value = "auto")]
    pub prefill: PrefillChoice,
    #[command(flatten)]
    pub flags: crate::flags::TargetFlags,
}

/// The backend and the model source of a command that runs one `--model` on one `--backend`
/// (`chat`, `demo`, `generate`, `serve`): `--backend`, else [`default_backend`]; the source
/// with the command's target flags and the top-k logits its sampling needs (0: none).
pub fn select(
    model: &str,
    backend: Option<BackendChoice>,
    artifacts: Option<&Path>,
    target: &TargetArgs,
    top_k: usize,
) -> (BackendChoice, ModelSource) {
    let choice = backend.unwrap_or_else(|| default_backend(crate::model::is_real_model(model)));
    let source = ModelSource {
        top_k,
        ..ModelSource::new(model, artifacts.map(Path::to_path_buf)).with_targets(target)
    };
    (choice, source)
}

/// The backend of a command given no `--backend`: `iree-cpu` (compiled for this CPU) for a real
/// model, `reference` for fixtures and directories (and in a build without IREE).
pub fn default_backend(real: bool) -> BackendChoice {
    #[cfg(feature = "iree")]
    if real {
        return BackendChoice::IreeCpu;
    }
    let _ = real;
    BackendChoice::Reference
}

/// Where the model and its compiled artifacts are.
pub struct ModelSource {
    /// `--model` as given (a real model, a fixture name or a directory).
    pub model: String,
    /// `--artifacts`: an exported artifact directory for the IREE backends.
    pub artifacts: Option<PathBuf>,
    /// The target flags of an export made on demand.
    pub target: TargetArgs,
    /// `SEQ` of the redecode graphs of an export made on demand (`None`: the prefill's).
    pub redecode_seq: Option<usize>,
    /// Top-k results an export made on demand must have (sampling); 0 = none needed.
    pub top_k: usize,
    /// What the reference rounds; `None`: what its manifest says (the model's own: nothing,
    /// the FP32 forward). `diverge --reference-input artifacts` sets the IREE artifacts'.
    pub reference_input: Option<kv_core::manifest::Rounding>,
}

impl ModelSource {
    pub fn new(model: &str, artifacts: Option<PathBuf>) -> Self {
        ModelSource {
            model: model.into(),
            artifacts,
            target: TargetArgs::default(),
            redecode_seq: None,
            top_k: 0,
            reference_input: None,
        }
    }

    pub fn with_targets(mut self, target: &TargetArgs) -> Self {
        self.target = target.clone();
        self
    }

    /// The directory with the weights and `architecture` (the reference reads it).
    pub fn model_dir(&self) -> Result<PathBuf> {
        match (
            &self.artifacts,
            crate::model::resolve_with(&self.model, self.target.flags.weights()),
        ) {
            (_, Ok(dir)) => Ok(dir),
            (Some(dir), Err(_)) => Ok(dir.clone()),
            (None, Err(e)) => Err(e),
        }
    }

    /// The compile target of an export made on demand for `device`: `--cpu` for the CPU drivers,
    /// `--vulkan-target` for `vulkan` (`portable`: IREE's portable target, packed weights),
    /// and without one the fastest portable module this machine's Vulkan device runs
    /// ([`backend_iree::VulkanFeatures::portable_target`]: `portable-sgN` where the driver has
    /// 16-bit storage and subgroup reductions in subgroups of N, the packed portable module
    /// elsewhere and for quantized weights), as `--cpu host` is this machine's CPU.
    #[cfg(feature = "iree")]
    fn target_for(&self, device: &str) -> export::Target {
        if device == "vulkan" {
            let target = match self.target.flags.vulkan_target.as_deref() {
                Some(crate::flags::PORTABLE_VULKAN_TARGET) => None,
                Some(named) => Some(named.to_string()),
                None if self.target.flags.weights().quant().is_some() => None,
                None => this_vulkan_device_target(),
            };
            export::Target::Vulkan { target }
        } else {
            export::Target::Cpu {
                cpu: self.target.flags.cpu.as_ref().map_or("host", |c| c.name()).into(),
            }
        }
    }

    /// The contract of an export made on demand for `device` under `rule`: `--contract 1|2`,
    /// else (`auto`, the default here) the library's default for the target
    /// ([`export::device::default_contract`]: 2 on the CPU drivers, NVIDIA and portable Vulkan
    /// targets, 1 on other named GPU families and under the seed's window rule).
    #[cfg(feature = "iree")]
    pub fn contract_for(&self, device: &str, rule: RuleChoice) -> kv_core::ContractVersion {
        self.target
            .flags
            .contract
            .and_then(crate::flags::ContractChoice::version)
            .unwrap_or_else(|| export::device::default_contract(&self.target_for(device), rule == RuleChoice::Seed))
    }

    /// The artifact directory for an IREE device: `--artifacts`, or what the library picks for
    /// the model and the device ([`export::device::artifacts_for_device`]: a `--model` directory
    /// that has modules for the device, else a cached export, made now if missing).
    #[cfg(feature = "iree")]
    pub fn artifacts_for(&self, device: &str, rule: RuleChoice) -> Result<PathBuf> {
        if let Some(dir) = &self.artifacts {
            self.check_artifacts(dir)?;
            return Ok(dir.clone());
        }
        let weights = self.target.flags.weights();
        let dir = crate::model::resolve_with(&self.model, weights)?;
        let target = self.target_for(device);
        let model = if fixtures::Fixture::is_fixture_name(&self.model) && weights.quant().is_none() {
            self.model.clone()
        } else {
            dir.display().to_string()
        };
        // Real models get a redecode graph that fits a prompt (SEQ 1024 would time padding);
        // `--redecode-seq` chooses another.
        let redecode_seq = match (self.redecode_seq, crate::model::is_real_model(&self.model)) {
            (Some(seq), _) => Some(seq),
            (None, true) => Some(REAL_MODEL_REDECODE_SEQ),
            (None, false) => None,
        };
        let request = export::device::DeviceRequest {
            target: target.clone(),
            contract: Some(self.contract_for(device, rule)),
            seed_rule: rule == RuleChoice::Seed,
            top_k: self.top_k,
            redecode_seq,
            matmul_input: self.target.flags.matmul_input.and_then(MatmulInputChoice::asked),
            cache_type: self.target.flags.cache_type.and_then(CacheTypeChoice::asked),
        };
        let root = export::cache_root()?;
        // Said once per process and only by the one that exports: the others wait for it.
        let progress = ExportProgress::default();
        let mut notify = |event| match event {
            kv_paths::FillEvent::Waiting => progress.phase(format!(
                "waiting for another process exporting {} for {}",
                self.model,
                target.key()
            )),
            kv_paths::FillEvent::Building => progress.phase(format!(
                "exporting {} for {} (once; cached under {})",
                self.model,
                target.key(),
                root.display()
            )),
        };
        let dir = export::device::artifacts_for_device(&model, &request, &mut notify);
        progress.finish();
        dir.map_err(|e| match e {
            export::ExportError::Options(rule) => {
                anyhow::anyhow!("{}: {rule}", crate::commands::export::flags_of(&rule))
            }
            other => other.into(),
        })
    }

    /// `--artifacts DIR` must be an export of `--model` (its manifest records the source's
    /// digests: `export::check_binding`), else the run would print another model's tokens. An
    /// export without digests (made before they were written) runs with a warning: nothing
    /// can check its modules.
    #[cfg(feature = "iree")]
    fn check_artifacts(&self, dir: &Path) -> Result<()> {
        let model_dir = crate::model::resolve_with(&self.model, self.target.flags.weights()).with_context(|| {
            format!(
                "--model {}: needed to check --artifacts {} against it",
                self.model,
                dir.display()
            )
        })?;
        export::check_binding(dir, &model_dir, &self.model)?;
        if !dir.join(kv_core::digests::DIGESTS_FILE).is_file() {
            say(format_args!(
                "skainet-kv: warning: --artifacts {} has no {} (exported before digests were written): its modules run \
                 unverified; re-export to have them checked",
                dir.display(),
                kv_core::digests::DIGESTS_FILE
            ));
        }
        Ok(())
    }
}

/// An on-demand export's phase on stderr: on a terminal a spinner with the phase and the time
/// spent (an export takes a minute or more), then one line with the total; elsewhere the phase
/// as one line, as a log wants it.
#[cfg(feature = "iree")]
#[derive(Default)]
struct ExportProgress(std::cell::RefCell<Option<(indicatif::ProgressBar, String)>>);

#[cfg(feature = "iree")]
impl ExportProgress {
    fn phase(&self, message: String) {
        use std::io::IsTerminal as _;
        if !std::io::stderr().is_terminal() {
            say(format_args!("skainet-kv: {message}"));
            return;
        }
        let mut current = self.0.borrow_mut();
        let bar = match current.take() {
            Some((bar, _)) => bar,
            None => {
                let bar = indicatif::ProgressBar::new_spinner().with_style(
                    indicatif::ProgressStyle::with_template("{spinner} skainet-kv: {msg} [{elapsed}]")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                );
                bar.enable_steady_tick(Duration::from_millis(120));
                bar
            }
        };
        bar.set_message(message.clone());
        *current = Some((bar, message));
    }

    fn finish(&self) {
        if let Some((bar, message)) = self.0.borrow_mut().take() {
            let took = bar.elapsed();
            bar.finish_and_clear();
            say(format_args!(
                "skainet-kv: {message}: done in {:.1} s",
                took.as_secs_f64()
            ));
        }
    }
}

/// A notice on stderr; a closed stderr is no reason to fail the run (`eprintln!` would panic).
#[cfg(feature = "iree")]
fn say(line: std::fmt::Arguments) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The redecode graph's SEQ of a real model's on-demand export: a prompt + 16 new tokens fit.
pub const REAL_MODEL_REDECODE_SEQ: usize = 128;

pub fn open_reference(dir: &Path) -> Result<std::sync::Arc<ReferenceModel>> {
    ReferenceModel::open(dir).with_context(|| format!("opening {}", dir.display()))
}

/// Opens a KV session and reports how long opening took (artifact export excluded).
pub fn open_kv(choice: BackendChoice, source: &ModelSource, rule: RuleChoice) -> Result<(AnyKv, Duration)> {
    #[cfg(feature = "iree")]
    if let Some(device) = choice.device() {
        let dir = source.artifacts_for(device, rule)?;
        let t = Instant::now();
        let options = backend_iree::IreeOptions {
            rule: rule.into(),
            prefill: source.target.prefill.route(device),
            ..backend_iree::IreeOptions::new(device)
        };
        let backend = backend_iree::IreeKvBackend::open(&dir, options)?;
        return Ok((AnyKv::Iree(Box::new(backend)), t.elapsed()));
    }
    let _ = choice;
    let dir = source.model_dir()?;
    let t = Instant::now();
    let model = ReferenceModel::open_with_rounding(&dir, source.reference_input)
        .with_context(|| format!("opening {}", dir.display()))?;
    Ok((AnyKv::Reference(ReferenceKv::new(model, rule.into())), t.elapsed()))
}

pub fn open_redecode(choice: BackendChoice, source: &ModelSource, seq: Option<usize>) -> Result<AnyRedecode> {
    #[cfg(feature = "iree")]
    if let Some(device) = choice.device() {
        anyhow::ensure!(
            seq.is_none(),
            "--seq: an IREE redecode graph has the SEQ it was exported with; re-export with --redecode-seq"
        );
        let dir = source.artifacts_for(device, RuleChoice::Exact)?;
        return Ok(AnyRedecode::Iree(Box::new(backend_iree::IreeRedecodeBackend::open(
            &dir,
            backend_iree::IreeOptions::new(device),
        )?)));
    }
    let _ = choice;
    let model = open_reference(&source.model_dir()?)?;
    Ok(AnyRedecode::Reference(match seq {
        Some(seq) => ReferenceRedecode::with_seq(model, seq)?,
        None => ReferenceRedecode::new(model),
    }))
}

/// The `--vulkan-target` of this machine's Vulkan device (`VulkanFeatures::portable_target`),
/// asked once a process; `None` (the packed portable module) where no device opens.
#[cfg(feature = "iree")]
fn this_vulkan_device_target() -> Option<String> {
    static TARGET: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    TARGET
        .get_or_init(|| {
            backend_iree::VulkanFeatures::of_default_device()
                .ok()
                .and_then(|f| f.portable_target())
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "iree")]
    #[test]
    fn contract_defaults_to_2_on_the_cpu_nvidia_and_portable_vulkan() {
        use kv_core::ContractVersion::{V1, V2};
        let mut source = ModelSource::new("tiny-gemma3:7", None);
        assert_eq!(source.contract_for("local-task", RuleChoice::Exact), V2);
        assert_eq!(source.contract_for("local-sync", RuleChoice::Exact), V2);
        assert_eq!(
            source.contract_for("vulkan", RuleChoice::Exact),
            V2,
            "the portable profile"
        );
        assert_eq!(source.contract_for("vulkan", RuleChoice::Seed), V1);
        source.target.flags.vulkan_target = Some("ampere".into());
        assert_eq!(source.contract_for("vulkan", RuleChoice::Exact), V2, "NVIDIA targets");
        assert_eq!(source.contract_for("vulkan", RuleChoice::Seed), V1);
        source.target.flags.vulkan_target = Some("valhall".into());
        assert_eq!(source.contract_for("vulkan", RuleChoice::Exact), V1);
        source.target.flags.vulkan_target = Some("portable-sg16".into());
        assert_eq!(source.contract_for("vulkan", RuleChoice::Exact), V2, "portable-sgN");
        source.target.flags.vulkan_target = Some(crate::flags::PORTABLE_VULKAN_TARGET.into());
        assert_eq!(source.contract_for("vulkan", RuleChoice::Exact), V2, "packed portable");
        source.target.flags.vulkan_target = None;
        // Contract 2 does not run the seed's step rule.
        assert_eq!(source.contract_for("local-task", RuleChoice::Seed), V1);
        // Contract 2 has a prefill graph too (a chunk graph of more rows).
        source.target.prefill = PrefillChoice::Graph;
        assert_eq!(source.contract_for("local-task", RuleChoice::Exact), V2);
        source.target.flags.contract = Some(crate::flags::ContractChoice::Auto);
        assert_eq!(source.contract_for("vulkan", RuleChoice::Seed), V1);
        source.target.flags.contract = Some(crate::flags::ContractChoice::V1);
        assert_eq!(source.contract_for("local-task", RuleChoice::Exact), V1);
        source.target.flags.contract = Some(crate::flags::ContractChoice::V2);
        assert_eq!(source.contract_for("vulkan", RuleChoice::Exact), V2);
    }
}
