//! The IREE backends: fixture models exported once per process (and cached on disk under
//! `.cache/artifacts`), opened on `local-task`, `local-sync` or `vulkan`.

use backend_iree::{IreeKvBackend, IreeOptions, IreeRedecodeBackend};
use export::{Layout, Target};
use kv_core::tolerance::Tolerance;
use kv_core::{Error, Result, WindowRule};

use crate::factory::BackendFactory;

/// Sessions on one IREE device, over artifacts of one layout.
pub struct IreeFactory {
    pub device: &'static str,
    pub layout: Layout,
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

/// The cached export of `model` (see `export::cached_export`).
pub fn artifacts(model: &str, target: &Target, layout: Layout) -> Result<std::path::PathBuf> {
    export::cached_export(model, target, layout).map_err(|e| Error::Backend {
        backend: "export",
        op: format!("export {model}"),
        message: e.to_string(),
    })
}

impl BackendFactory for IreeFactory {
    type Kv = IreeKvBackend;
    type Redecode = IreeRedecodeBackend;

    fn name(&self) -> String {
        format!("iree-{}", self.device)
    }

    fn kv(&self, model: &str, rule: WindowRule) -> Result<IreeKvBackend> {
        let dir = artifacts(model, &self.target(), self.layout)?;
        IreeKvBackend::open(
            &dir,
            IreeOptions {
                rule,
                ..IreeOptions::new(self.device)
            },
        )
    }

    fn redecode(&self, model: &str) -> Result<IreeRedecodeBackend> {
        let dir = artifacts(model, &self.target(), self.layout)?;
        IreeRedecodeBackend::open(&dir, IreeOptions::new(self.device))
    }

    fn tolerance(&self) -> Tolerance {
        Tolerance::CROSS_BACKEND
    }

    fn cases(&self) -> u32 {
        std::env::var("SKAINET_IREE_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(6)
    }
}
