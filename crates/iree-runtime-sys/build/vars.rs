//! Every environment variable this build script reads, in one place.
//!
//! Each is declared with `cargo:rerun-if-env-changed` by [`Vars::read`], so changing any of them
//! re-runs the build script (and nothing else does, apart from the files named in `main.rs`).

use std::env;
use std::ffi::OsString;
use std::path::PathBuf;

/// A prefix holding a prebuilt runtime: `lib/libiree_runtime_sys_unified.a` (or
/// `lib/libiree_runtime_unified.a`), optionally `lib/libflatcc_parsing.a`, and `include/`.
/// When set, no CMake build happens. This is how a cross-built (e.g. Android NDK) runtime is linked.
pub const IREE_RUNTIME_DIR: &str = "IREE_RUNTIME_DIR";
/// An IREE source tree (the directory holding `runtime/src/iree`) to build instead of the one
/// carried by the `eerie-sys` crate.
pub const IREE_SOURCE_DIR: &str = "IREE_SOURCE_DIR";
/// The `cmake` executable (≥ 3.26). Otherwise `cmake` on PATH, then `<workspace>/.tools/venv/bin`.
pub const CMAKE: &str = "CMAKE";
/// The `ninja` executable. Otherwise `ninja` on PATH, then `<workspace>/.tools/venv/bin`.
pub const NINJA: &str = "NINJA";
/// Where cargo keeps the registry sources (default `~/.cargo`); searched for `eerie-sys-0.5.0`.
pub const CARGO_HOME: &str = "CARGO_HOME";
/// Only used to default `CARGO_HOME`.
pub const HOME: &str = "HOME";
/// Passed to CMake for cross builds (e.g. the NDK's `android.toolchain.cmake`).
pub const CMAKE_TOOLCHAIN_FILE: &str = "CMAKE_TOOLCHAIN_FILE";
/// Passed to CMake with the NDK toolchain file.
pub const ANDROID_ABI: &str = "ANDROID_ABI";
/// Passed to CMake with the NDK toolchain file.
pub const ANDROID_PLATFORM: &str = "ANDROID_PLATFORM";
/// Directory holding host builds of `iree-flatcc-cli` and `iree-c-embed-data`, which IREE needs
/// when cross-compiling (the iree-base-runtime wheel ships both).
pub const IREE_HOST_BIN_DIR: &str = "IREE_HOST_BIN_DIR";
/// Read by CMake itself to pick the C / C++ compilers; listed so a change rebuilds.
pub const CC: &str = "CC";
pub const CXX: &str = "CXX";
pub const CFLAGS: &str = "CFLAGS";
pub const CXXFLAGS: &str = "CXXFLAGS";

const ALL: &[&str] = &[
    IREE_RUNTIME_DIR,
    IREE_SOURCE_DIR,
    CMAKE,
    NINJA,
    CARGO_HOME,
    HOME,
    CMAKE_TOOLCHAIN_FILE,
    ANDROID_ABI,
    ANDROID_PLATFORM,
    IREE_HOST_BIN_DIR,
    CC,
    CXX,
    CFLAGS,
    CXXFLAGS,
];

/// Variables cargo sets for build scripts (not user input; no rerun needed).
pub struct Cargo {
    pub out_dir: PathBuf,
    pub manifest_dir: PathBuf,
    pub target: String,
    pub host: String,
    pub target_os: String,
    pub num_jobs: String,
}

pub struct Vars {
    pub runtime_dir: Option<PathBuf>,
    pub source_dir: Option<PathBuf>,
    pub cmake: Option<PathBuf>,
    pub ninja: Option<PathBuf>,
    pub cargo_home: Option<PathBuf>,
    pub home: Option<PathBuf>,
    /// `(name, value)` pairs handed to CMake as `-Dname=value` when set.
    pub cmake_passthrough: Vec<(&'static str, OsString)>,
    /// Read only to look tools up; not a rerun trigger (a changed PATH alone must not rebuild).
    pub path: Option<OsString>,
    pub cargo: Cargo,
}

fn var_os(name: &str) -> Option<OsString> {
    env::var_os(name).filter(|v| !v.is_empty())
}

fn cargo_var(name: &str) -> String {
    env::var(name).unwrap_or_else(|_| panic!("cargo did not set {name} for the build script"))
}

impl Vars {
    pub fn read() -> Vars {
        for name in ALL {
            println!("cargo:rerun-if-env-changed={name}");
        }
        let cmake_passthrough = [CMAKE_TOOLCHAIN_FILE, ANDROID_ABI, ANDROID_PLATFORM, IREE_HOST_BIN_DIR]
            .into_iter()
            .filter_map(|name| var_os(name).map(|v| (name, v)))
            .collect();
        Vars {
            runtime_dir: var_os(IREE_RUNTIME_DIR).map(PathBuf::from),
            source_dir: var_os(IREE_SOURCE_DIR).map(PathBuf::from),
            cmake: var_os(CMAKE).map(PathBuf::from),
            ninja: var_os(NINJA).map(PathBuf::from),
            cargo_home: var_os(CARGO_HOME).map(PathBuf::from),
            home: var_os(HOME).map(PathBuf::from),
            cmake_passthrough,
            path: var_os("PATH"),
            cargo: Cargo {
                out_dir: PathBuf::from(cargo_var("OUT_DIR")),
                manifest_dir: PathBuf::from(cargo_var("CARGO_MANIFEST_DIR")),
                target: cargo_var("TARGET"),
                host: cargo_var("HOST"),
                target_os: cargo_var("CARGO_CFG_TARGET_OS"),
                num_jobs: env::var("NUM_JOBS").unwrap_or_else(|_| "1".into()),
            },
        }
    }
}
