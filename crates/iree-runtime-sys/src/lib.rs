//! Raw bindings to the IREE C runtime (`iree/runtime/api.h`, the HAL and VM APIs, the
//! `io_parameters` module and the `.irpa` / `.gguf` / `.safetensors` parameter parsers).
//!
//! Use the safe `iree-runtime` crate instead unless you need something it does not wrap.
//!
//! # Where the runtime comes from
//!
//! The build script looks, in this order, at:
//!
//! 1. `IREE_RUNTIME_DIR`: a prefix holding a prebuilt static runtime
//!    (`lib/libiree_runtime_sys_unified.a`, optionally `lib/libflatcc_parsing.a`, and `include/`).
//!    Nothing is built. This is how a runtime cross-built with the Android NDK is linked; make
//!    the prefix with `cmake/CMakeLists.txt` of this crate and `--target install`.
//! 2. `IREE_SOURCE_DIR`: an IREE source tree (the directory holding `runtime/src/iree`), built
//!    with CMake.
//! 3. The IREE runtime tree carried by the `eerie-sys = "=0.5.0"` crate (IREE 3.13.0.dev), found
//!    next to this crate (registry or `cargo vendor` layout) or in
//!    `$CARGO_HOME/registry/src/*/eerie-sys-0.5.0` (`CARGO_HOME` defaults to `~/.cargo`).
//!
//! A source build uses `CMAKE` / `NINJA` when set, else `cmake` (≥ 3.26) and `ninja` on `PATH`,
//! else `<workspace>/.tools/venv/bin` (installed by `scripts/setup.sh`). It is a Release build of
//! the local-sync, local-task and vulkan HAL drivers, cached in
//! `target/<profile>/iree-runtime-sys/<config hash>/` so that the differing `OUT_DIR`s cargo uses
//! for `build`, `test` and `clippy` share one build (a cold build takes under a minute on 2
//! cores). For cross builds set `CMAKE_TOOLCHAIN_FILE` (plus
//! `ANDROID_ABI` / `ANDROID_PLATFORM` for the NDK) and `IREE_HOST_BIN_DIR` (host
//! `iree-flatcc-cli` and `iree-c-embed-data`; the iree-base-runtime wheel ships both); they are
//! passed to CMake as they are. `CC`, `CXX`, `CFLAGS` and `CXXFLAGS` are read by CMake itself.
//!
//! Vulkan is not linked: IREE opens the Vulkan loader with `dlopen` when a vulkan device is made.
//!
//! # Naming
//!
//! Only `iree_*` / `IREE_*` items are bound. Enum constants keep their C names
//! (`IREE_HAL_ELEMENT_TYPE_FLOAT_32`). C `static inline` helpers (`iree_allocator_system`,
//! `iree_make_cstring_view`, ...) are bound under their C names too: bindgen writes a C wrapper
//! `<name>__extern` for each, compiled by the build script and linked via `#[link_name]`. Macros
//! that are not constants (`iree_status_code`, `iree_status_is_ok`) are not bound.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case)]
#![allow(clippy::all)]
#![allow(rustdoc::broken_intra_doc_links, rustdoc::bare_urls, rustdoc::invalid_html_tags)]

// Keeps the source carrier in the dependency graph; it compiles to nothing without features.
use eerie_sys as _;

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
