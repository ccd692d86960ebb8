//! The IREE backends: fixture models exported once per process (and cached on disk under
//! `.cache/artifacts`), opened on `local-task`, `local-sync` or `vulkan`.

use backend_iree::{IreeKvBackend, IreeOptions, IreeRedecodeBackend, PrefillRoute};
use export::{Layout, Target};
use kv_core::manifest::{CacheType, Rounding};
use kv_core::tolerance::Tolerance;
use kv_core::{Error, Result, WindowRule};

use crate::factory::BackendFactory;

/// Sessions on one IREE device, over artifacts of one layout.
///
/// How `prefill` runs follows the layout, so that both routes face every problem: the shared
/// layout's suites run the prefill graph, the three-archive ones chunk calls from an empty cache.
pub struct IreeFactory {
    pub device: &'static str,
    pub layout: Layout,
    /// The graph contract of the exports: 1 (`shared/CONTRACT.md`) or 2 (`docs/contract-v2.md`).
    pub contract: u32,
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
    artifacts_with(model, target, layout, 0, 1, CacheType::F32)
}

/// [`artifacts`] with `top_k` results (`0`: none; only the KV graphs then, to keep the extra
/// export short) and the graphs of `contract`.
pub fn artifacts_with(
    model: &str,
    target: &Target,
    layout: Layout,
    top_k: usize,
    contract: u32,
    cache_type: CacheType,
) -> Result<std::path::PathBuf> {
    let defaults = export::ExportOptions::default();
    // v2 exports only its chunk and step graphs (the exporter drops the prefill graph, which v2
    // has none of): the redecode graphs are v1's (`IreeFactory::redecode` opens the v1 export's).
    let kv_only = top_k > 0 || contract == 2;
    let options = export::ExportOptions {
        top_k,
        contract,
        // Sliding rings of the window and 4 rows more: the problems wrap them many times, and
        // a restored snapshot's next call often forks.
        ring_slack: (contract == 2).then_some(4),
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
            1 => format!("iree-{}", self.device),
            c => format!("iree-{}-v{c}{caches}", self.device),
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

    /// `SKAINET_IREE_CASES`, else 6; 3 for contract v2 on Vulkan, whose calls on lavapipe attend
    /// over every cache row (the slowest suite in CI: 270–310 s on 2 cores with 6).
    fn cases(&self) -> u32 {
        std::env::var("SKAINET_IREE_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(if self.contract == 2 && self.device == "vulkan" {
                3
            } else {
                6
            })
    }

    fn supports_seed_step_rule(&self) -> bool {
        self.contract == 1
    }

    fn rounding(&self) -> Rounding {
        Rounding {
            cache_type: self.cache_type,
            ..Rounding::FP32
        }
    }
}
