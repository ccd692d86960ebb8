//! The IREE backends: fixture models exported once per process (and cached on disk under
//! `.cache/artifacts`), opened on `local-task`, `local-sync` or `vulkan`.

use backend_iree::{IreeKvBackend, IreeOptions, IreeRedecodeBackend, PrefillRoute};
use export::{Layout, Target};
use kv_core::manifest::{CacheType, MatmulInput, Rounding};
use kv_core::tolerance::Tolerance;
use kv_core::{ContractVersion, Error, Result, WindowRule};

use crate::factory::BackendFactory;

/// Sessions on one IREE device, over artifacts of one layout.
///
/// How `prefill` runs follows the layout, so that both routes face every problem: the shared
/// layout's suites run the prefill graph, the three-archive ones chunk calls from an empty cache.
pub struct IreeFactory {
    pub device: &'static str,
    pub layout: Layout,
    /// The graph contract of the exports: v1 (`shared/CONTRACT.md`) or v2 (`docs/contract-v2.md`).
    pub contract: ContractVersion,
    /// The caches' element type (contract 2 on the CPU may keep f16 ones: `CacheType`); the
    /// problems then compare with a reference that rounds the same K/V rows.
    pub cache_type: CacheType,
}

impl IreeFactory {
    fn target(&self) -> Target {
        if self.device == "vulkan" {
            Target::vulkan()
        } else {
            Target::cpu()
        }
    }
}

/// The LLVM target triple the CPU modules are compiled for: `$SKAINET_IREE_CPU_TRIPLE`, else
/// `aarch64-unknown-linux-gnu` when this binary is an aarch64 one (the suite cross-built and run
/// under qemu-user, `scripts/test-arm.sh`), else none (`iree-compile`'s default, the host's).
pub fn cpu_triple() -> Option<String> {
    match std::env::var("SKAINET_IREE_CPU_TRIPLE") {
        Ok(t) if !t.is_empty() => Some(t),
        _ if cfg!(target_arch = "aarch64") => Some("aarch64-unknown-linux-gnu".into()),
        _ => None,
    }
}

/// The cached export of `model` (see `export::cached_export`); CPU modules for [`cpu_triple`]
/// (its own cache entry: the flag is part of the options' key).
pub fn artifacts(model: &str, target: &Target, layout: Layout) -> Result<std::path::PathBuf> {
    artifacts_with(model, target, layout, 0, ContractVersion::V1, CacheType::F32)
}

/// [`artifacts`] with `top_k` results (`0`: none; only the KV graphs then, to keep the extra
/// export short) and the graphs of `contract`.
pub fn artifacts_with(
    model: &str,
    target: &Target,
    layout: Layout,
    top_k: usize,
    contract: ContractVersion,
    cache_type: CacheType,
) -> Result<std::path::PathBuf> {
    let defaults = export::ExportOptions::default();
    let v2 = matches!(contract, ContractVersion::V2);
    // v2 exports only its chunk and step graphs (the exporter drops the prefill graph, which v2
    // has none of): the redecode graphs are v1's (`IreeFactory::redecode` opens the v1 export's).
    let kv_only = top_k > 0 || v2;
    let options = export::ExportOptions {
        top_k,
        contract,
        // Sliding rings of the window and 4 rows more: the problems wrap them many times, and
        // a restored snapshot's next call often forks.
        ring_slack: v2.then_some(4),
        // A small chunk graph of 3 rows beside the fixtures' chunk graph of 8: every feed's
        // piece of 1 to 3 ids runs it (contract 2's default is 8 rows, none for a chunk of 8).
        small_chunk: v2.then_some(3),
        cache_type,
        graphs: defaults
            .graphs
            .iter()
            .copied()
            .filter(|g| !kv_only || kv_core::Graph::KV.contains(g))
            .collect(),
        targets: vec![target.clone()],
        layout,
        compile_flags: match (target, cpu_triple()) {
            (Target::Cpu { .. }, Some(triple)) => vec![format!("--iree-llvmcpu-target-triple={triple}")],
            _ => Vec::new(),
        },
        ..defaults
    };
    export::cached_export_with(model, &options).map_err(|e| Error::Backend {
        backend: "export",
        op: format!("export {model}"),
        source: Box::new(e),
    })
}

impl IreeFactory {
    fn open_kv(&self, dir: &std::path::Path, rule: WindowRule) -> Result<IreeKvBackend> {
        IreeKvBackend::open(
            dir,
            IreeOptions {
                rule,
                prefill: match self.layout {
                    Layout::Shared => PrefillRoute::Graph,
                    Layout::Three => PrefillRoute::Chunks,
                },
                ..IreeOptions::new(self.device)
            },
        )
    }
}

impl BackendFactory for IreeFactory {
    type Kv = IreeKvBackend;
    type Redecode = IreeRedecodeBackend;

    fn name(&self) -> String {
        let caches = if self.cache_type.is_f32() { "" } else { "-f16" };
        match self.contract {
            ContractVersion::V1 => format!("iree-{}", self.device),
            c @ ContractVersion::V2 => format!("iree-{}-v{c}{caches}", self.device),
        }
    }

    fn kv(&self, model: &str, rule: WindowRule) -> Result<IreeKvBackend> {
        self.open_kv(
            &artifacts_with(model, &self.target(), self.layout, 0, self.contract, self.cache_type)?,
            rule,
        )
    }

    fn kv_with_top_k(&self, model: &str, k: usize) -> Result<IreeKvBackend> {
        self.open_kv(
            &artifacts_with(model, &self.target(), self.layout, k, self.contract, self.cache_type)?,
            WindowRule::Exact,
        )
    }

    fn redecode(&self, model: &str) -> Result<IreeRedecodeBackend> {
        let dir = artifacts(model, &self.target(), self.layout)?;
        IreeRedecodeBackend::open(&dir, IreeOptions::new(self.device))
    }

    fn tolerance(&self) -> Tolerance {
        Tolerance::CROSS_BACKEND
    }

    /// `SKAINET_IREE_CASES`, else 8 on the CPU: the problems that run half their cases then run
    /// each of the four main models ([`crate::problems::MODELS`]) every run, for about a second
    /// more per suite. On Vulkan (lavapipe: seconds to a minute a case) 6, and 3 for contract v2,
    /// whose calls attend over every cache row (the slowest suite in CI: 270–310 s on 2 cores
    /// with 6): there the models a problem meets rotate with the seed.
    fn cases(&self) -> u32 {
        std::env::var("SKAINET_IREE_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(match (self.device, self.contract) {
                ("vulkan", ContractVersion::V2) => 3,
                ("vulkan", _) => 6,
                _ => 8,
            })
    }

    fn supports_seed_step_rule(&self) -> bool {
        matches!(self.contract, ContractVersion::V1)
    }

    fn supports_allowed_mask(&self) -> bool {
        matches!(self.contract, ContractVersion::V2)
    }

    fn rounding(&self) -> Rounding {
        Rounding {
            cache_type: self.cache_type,
            ..Rounding::FP32
        }
    }
}

/// Contract 2 exported as the runtime exports it for this very CPU
/// ([`export::runtime_options_for`] with `--cpu host`): data tiling and ukernels, bf16 matmul
/// inputs where the CPU has bf16 dot products ([`export::host_has_bf16_dot`]), f16 caches where
/// it converts f16 ([`export::host_converts_f16`]). The other CPU suites export for IREE's
/// generic CPU, so without this one the forms only `host` exports take never met the problems.
/// Compared with a reference that rounds the same ([`BackendFactory::rounding`]); redecode
/// opens the generic v1 export, as the v2 suites do.
pub struct IreeHostFactory;

impl IreeHostFactory {
    fn artifacts(&self, model: &str, top_k: usize) -> Result<std::path::PathBuf> {
        let target = Target::Cpu { cpu: "host".into() };
        let runtime = export::runtime_options_for(&target, ContractVersion::V2);
        let options = export::ExportOptions {
            targets: vec![target],
            top_k,
            ring_slack: Some(4),
            graphs: kv_core::Graph::KV.to_vec(),
            ..runtime
        };
        export::cached_export_with(model, &options).map_err(|e| Error::Backend {
            backend: "export",
            op: format!("export {model} for the host CPU"),
            source: Box::new(e),
        })
    }

    fn open(&self, dir: &std::path::Path, rule: WindowRule) -> Result<IreeKvBackend> {
        IreeKvBackend::open(
            dir,
            IreeOptions {
                rule,
                prefill: PrefillRoute::Graph,
                ..IreeOptions::new("local-task")
            },
        )
    }
}

impl BackendFactory for IreeHostFactory {
    type Kv = IreeKvBackend;
    type Redecode = IreeRedecodeBackend;

    fn name(&self) -> String {
        "iree-local-task-v2-host".into()
    }

    fn kv(&self, model: &str, rule: WindowRule) -> Result<IreeKvBackend> {
        self.open(&self.artifacts(model, 0)?, rule)
    }

    fn kv_with_top_k(&self, model: &str, k: usize) -> Result<IreeKvBackend> {
        self.open(&self.artifacts(model, k)?, WindowRule::Exact)
    }

    fn redecode(&self, model: &str) -> Result<IreeRedecodeBackend> {
        let dir = artifacts(model, &Target::cpu(), Layout::Shared)?;
        IreeRedecodeBackend::open(&dir, IreeOptions::new("local-task"))
    }

    /// Against a reference rounding the same matmul inputs: two forwards that both round part at
    /// the rounding's scale ([`Tolerance::BF16_MATMUL_INPUTS`]).
    fn tolerance(&self) -> Tolerance {
        if self.rounding().matmul_input == MatmulInput::Bf16 {
            Tolerance::BF16_MATMUL_INPUTS
        } else {
            Tolerance::CROSS_BACKEND
        }
    }

    /// Two paths through other graphs round other sums to bf16 before the next product.
    fn path_tolerance(&self) -> Tolerance {
        if self.rounding().matmul_input == MatmulInput::Bf16 {
            Tolerance::BF16_MATMUL_INPUTS
        } else if self.rounding().cache_type.is_f32() {
            Tolerance::SAME_BACKEND
        } else {
            Tolerance::SAME_BACKEND_F16_CACHES
        }
    }

    /// As the generic CPU suites ([`IreeFactory`]): `SKAINET_IREE_CASES`, else 8.
    fn cases(&self) -> u32 {
        std::env::var("SKAINET_IREE_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(8)
    }

    fn supports_seed_step_rule(&self) -> bool {
        false
    }

    fn rounding(&self) -> Rounding {
        let runtime = export::runtime_options_for(&Target::Cpu { cpu: "host".into() }, ContractVersion::V2);
        Rounding {
            matmul_input: runtime.matmul_input,
            cache_type: runtime.cache_type,
        }
    }
}
