//! Where the runtime comes from, and which build tools to use. The search order (documented in
//! the crate README) lives in [`runtime_source`] and nowhere else.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::vars::{self, Vars};

/// The eerie-sys release whose IREE tree we build; must match the `=` pin in Cargo.toml.
const EERIE_SYS_DIR: &str = "eerie-sys-0.5.0";

pub enum RuntimeSource {
    /// A prefix with `lib/` and `include/` (IREE_RUNTIME_DIR): link it as it is.
    Prebuilt(PathBuf),
    /// An IREE source tree to build with CMake.
    Source { root: PathBuf, user_given: bool },
}

/// 1. `IREE_RUNTIME_DIR` (prebuilt prefix), 2. `IREE_SOURCE_DIR`, 3. the tree inside eerie-sys.
pub fn runtime_source(vars: &Vars) -> RuntimeSource {
    if let Some(dir) = &vars.runtime_dir {
        return RuntimeSource::Prebuilt(dir.clone());
    }
    if let Some(dir) = &vars.source_dir {
        if !is_iree_tree(dir) {
            fail(&format!(
                "{} = {} is not an IREE source tree: {} does not exist.",
                vars::IREE_SOURCE_DIR,
                dir.display(),
                dir.join("runtime/src/iree/runtime/api.h").display()
            ));
        }
        return RuntimeSource::Source {
            root: dir.clone(),
            user_given: true,
        };
    }
    let searched = eerie_sys_candidates(vars);
    match searched.iter().find(|dir| is_iree_tree(dir)) {
        Some(dir) => RuntimeSource::Source {
            root: dir.clone(),
            user_given: false,
        },
        None => {
            let list: Vec<String> = searched.iter().map(|p| format!("  {}", p.display())).collect();
            fail(&format!(
                "cannot find the IREE runtime source carried by the `{EERIE_SYS_DIR}` crate.\n\
                 Searched:\n{}\n\
                 Run `cargo fetch` (it downloads eerie-sys), or set {} to an IREE source tree, \
                 or {} to a prefix holding a prebuilt runtime (lib/ + include/).",
                list.join("\n"),
                vars::IREE_SOURCE_DIR,
                vars::IREE_RUNTIME_DIR
            ))
        }
    }
}

fn is_iree_tree(dir: &Path) -> bool {
    dir.join("runtime/src/iree/runtime/api.h").is_file()
}

/// eerie-sys has no `links` key, so cargo gives us no `DEP_*` path to it. It is unpacked next to
/// this crate when both come from a registry or a `cargo vendor` directory, and otherwise in the
/// registry cache under CARGO_HOME.
fn eerie_sys_candidates(vars: &Vars) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(parent) = vars.cargo.manifest_dir.parent() {
        out.push(parent.join(EERIE_SYS_DIR).join("iree"));
        out.push(parent.join("eerie-sys").join("iree"));
    }
    let cargo_home = vars
        .cargo_home
        .clone()
        .or_else(|| vars.home.as_ref().map(|h| h.join(".cargo")));
    if let Some(home) = cargo_home {
        let registry = home.join("registry/src");
        let mut found: Vec<PathBuf> = std::fs::read_dir(&registry)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path().join(EERIE_SYS_DIR).join("iree"))
            .collect();
        found.sort();
        if found.is_empty() {
            out.push(registry.join("*").join(EERIE_SYS_DIR).join("iree"));
        }
        out.extend(found);
    }
    out
}

/// cmake ≥ 3.26: `CMAKE`, else PATH, else `<workspace>/.tools/venv/bin/cmake`.
pub fn cmake(vars: &Vars) -> PathBuf {
    let ok = |p: &Path| cmake_version(p).is_some_and(|v| v >= (3, 26));
    if let Some(explicit) = &vars.cmake {
        if !ok(explicit) {
            fail(&format!(
                "{} = {} is not a working cmake ≥ 3.26 (found {:?}).",
                vars::CMAKE,
                explicit.display(),
                cmake_version(explicit)
            ));
        }
        return explicit.clone();
    }
    let candidates = tool_candidates(vars, "cmake");
    candidates.iter().find(|p| ok(p)).cloned().unwrap_or_else(|| {
        fail(&format!(
            "no cmake ≥ 3.26 found (IREE needs it; Debian 12 ships 3.25). Looked at: {}.\n\
             Run scripts/setup.sh (it installs cmake and ninja into .tools/venv), \
             or `pip install cmake ninja`, or set {} to a cmake executable.",
            describe(&candidates),
            vars::CMAKE
        ))
    })
}

/// `NINJA`, else PATH, else `<workspace>/.tools/venv/bin/ninja`.
pub fn ninja(vars: &Vars) -> PathBuf {
    if let Some(explicit) = &vars.ninja {
        return explicit.clone();
    }
    let candidates = tool_candidates(vars, "ninja");
    let runs = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    candidates.iter().find(|p| runs(p)).cloned().unwrap_or_else(|| {
        fail(&format!(
            "no ninja found. Looked at: {}.\nRun scripts/setup.sh, or `pip install ninja`, \
             or set {} to a ninja executable.",
            describe(&candidates),
            vars::NINJA
        ))
    })
}

fn tool_candidates(vars: &Vars, name: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = vars
        .path
        .as_ref()
        .map(|p| {
            std::env::split_paths(p)
                .map(|d| d.join(name))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    // The workspace's own tools, wherever the workspace root is above this crate.
    for dir in vars.cargo.manifest_dir.ancestors() {
        let tool = dir.join(".tools/venv/bin").join(name);
        if tool.is_file() {
            out.push(tool);
            break;
        }
    }
    out
}

fn describe(candidates: &[PathBuf]) -> String {
    if candidates.is_empty() {
        "nothing on PATH and no .tools/venv/bin above this crate".into()
    } else {
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn cmake_version(cmake: &Path) -> Option<(u32, u32)> {
    let out = Command::new(cmake).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.lines().next()?.strip_prefix("cmake version ")?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

/// Stops the build with a message for a person (cargo prints the script's stderr; a panic would
/// bury the message under a backtrace).
pub fn fail(message: &str) -> ! {
    eprintln!("\nerror: iree-runtime-sys: {message}\n");
    std::process::exit(1);
}
