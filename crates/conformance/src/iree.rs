//! The IREE backends: fixture models exported once per process (and cached on disk under
//! `.cache/artifacts`), opened on `local-task`, `local-sync` or `vulkan`.

use std::path::PathBuf;
use std::sync::Mutex;

use backend_iree::{IreeKvBackend, IreeOptions, IreeRedecodeBackend};
use export::{ExportOptions, Layout, Source, Target};
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

/// Exports `model` for `target` in `layout` unless a finished export is already cached.
pub fn artifacts(model: &str, target: &Target, layout: Layout) -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let root = fixtures::cache_root().join("../artifacts");
    let name = format!("{}-{}-{layout:?}", model.replace(':', "-"), target.key()).to_lowercase();
    let dir = root.join(&name);
    if dir.join(kv_core::manifest::MANIFEST_FILE).is_file() {
        return Ok(dir);
    }
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let options = ExportOptions {
        targets: vec![target.clone()],
        layout,
        ..ExportOptions::default()
    };
    export::export_artifacts(&Source::Fixture(model.into()), &tmp, &options).map_err(|e| Error::Backend {
        backend: "export",
        op: format!("export {model}"),
        message: e.to_string(),
    })?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|source| Error::Io {
        what: "installing artifacts",
        path: dir.display().to_string(),
        source,
    })?;
    Ok(dir)
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
