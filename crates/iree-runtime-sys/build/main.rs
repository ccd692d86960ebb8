//! Build script of iree-runtime-sys: get a static IREE runtime (prebuilt, or built from source
//! with CMake + Ninja, cached beside cargo's build dir), link it, and generate bindings with bindgen.
//!
//! Every environment variable is read in `vars.rs`; the source search order is in `locate.rs`.

mod locate;
mod vars;

use std::path::{Path, PathBuf};
use std::process::Command;

use locate::{fail, RuntimeSource};
use vars::Vars;

/// Unified archive names we accept in a prefix, ours first. IREE's own `iree_runtime_unified`
/// lacks the io_parameters module unless it was built with it, but is accepted for prefixes
/// that were made another way.
const ARCHIVE_NAMES: &[&str] = &["iree_runtime_sys_unified", "iree_runtime_unified"];

fn main() {
    println!("cargo:rerun-if-changed=build");
    println!("cargo:rerun-if-changed=cmake/CMakeLists.txt");
    println!("cargo:rerun-if-changed=wrapper.h");
    let vars = Vars::read();

    let prefix = match locate::runtime_source(&vars) {
        RuntimeSource::Prebuilt(prefix) => prefix,
        RuntimeSource::Source { root, user_given } => {
            if user_given {
                // A user's tree may be edited; a registry tree never is (and scanning it costs).
                println!("cargo:rerun-if-changed={}", root.join("runtime/src").display());
            }
            build_with_cmake(&vars, &root)
        }
    };
    let (lib_dir, include_dir) = check_prefix(&prefix);

    // The static inline helpers (iree_allocator_system, iree_make_cstring_view, ...) have no
    // symbol in the archive; bindgen writes a C file of wrappers which is compiled here. It must
    // be linked before the runtime archive it calls into, so it comes first.
    generate_bindings(&vars, &include_dir);

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    let archive = ARCHIVE_NAMES
        .iter()
        .find(|name| lib_dir.join(format!("lib{name}.a")).is_file())
        .expect("checked by check_prefix");
    println!("cargo:rustc-link-lib=static={archive}");
    if lib_dir.join("libflatcc_parsing.a").is_file() {
        println!("cargo:rustc-link-lib=static=flatcc_parsing");
    }
    // Vulkan is not linked: IREE loads the Vulkan loader with dlopen at run time.
    match vars.cargo.target_os.as_str() {
        "android" => ["dl", "m", "log"]
            .iter()
            .for_each(|l| println!("cargo:rustc-link-lib={l}")),
        "linux" => ["pthread", "dl", "m"]
            .iter()
            .for_each(|l| println!("cargo:rustc-link-lib={l}")),
        _ => {}
    }
    // Exposed to dependents as DEP_IREE_RUNTIME_ROOT / DEP_IREE_RUNTIME_INCLUDE.
    println!("cargo:root={}", prefix.display());
    println!("cargo:include={}", include_dir.display());
}

/// Configures (when the arguments changed) and builds + installs the runtime into a prefix
/// under [`cmake_cache_root`]. Ninja makes a no-op build take well under a second.
fn build_with_cmake(vars: &Vars, iree_root: &Path) -> PathBuf {
    let cargo = &vars.cargo;
    if cargo.target != cargo.host
        && !vars
            .cmake_passthrough
            .iter()
            .any(|(k, _)| *k == vars::CMAKE_TOOLCHAIN_FILE)
    {
        fail(&format!(
            "cross-compiling from {} to {} needs a CMake toolchain file: set {} (and {} to a \
             directory with host `iree-flatcc-cli` and `iree-c-embed-data`, e.g. \
             .tools/venv/bin), or build the runtime yourself and set {} to its install prefix.",
            cargo.host,
            cargo.target,
            vars::CMAKE_TOOLCHAIN_FILE,
            vars::IREE_HOST_BIN_DIR,
            vars::IREE_RUNTIME_DIR
        ));
    }
    let cmake = locate::cmake(vars);
    let ninja = locate::ninja(vars);
    // Everything that decides the archive's contents; it names the build directory.
    let mut key_parts: Vec<String> = vec![
        cmake.display().to_string(),
        ninja.display().to_string(),
        iree_root.display().to_string(),
        cargo.target.clone(),
    ];
    key_parts.extend(
        vars.cmake_passthrough
            .iter()
            .map(|(k, v)| format!("{k}={}", v.to_string_lossy())),
    );
    let root = cmake_cache_root(&cargo.out_dir).join(format!("{:016x}", fnv1a(&key_parts.join("\n"))));
    let build_dir = root.join("build");
    let prefix = root.join("prefix");

    let mut configure: Vec<String> = vec![
        "-G".into(),
        "Ninja".into(),
        "-S".into(),
        cargo.manifest_dir.join("cmake").display().to_string(),
        "-B".into(),
        build_dir.display().to_string(),
        format!("-DCMAKE_MAKE_PROGRAM={}", ninja.display()),
        "-DCMAKE_BUILD_TYPE=Release".into(),
        format!("-DCMAKE_INSTALL_PREFIX={}", prefix.display()),
        format!("-DIREE_RUNTIME_SYS_SOURCE_DIR={}", iree_root.display()),
    ];
    for (name, value) in &vars.cmake_passthrough {
        configure.push(format!("-D{name}={}", value.to_string_lossy()));
    }
    // Reconfigure only when the arguments changed; Ninja re-runs CMake by itself when a
    // CMakeLists.txt changes.
    let stamp = build_dir.join("iree-runtime-sys.configure-args");
    let wanted = format!("{}\n{}", cmake.display(), configure.join("\n"));
    let cached =
        build_dir.join("CMakeCache.txt").is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted);
    if !cached {
        run(Command::new(&cmake).args(&configure), "configure IREE");
        std::fs::write(&stamp, wanted).expect("write the configure stamp");
    }
    run(
        Command::new(&cmake).arg("--build").arg(&build_dir).args([
            "--target",
            "install",
            "--parallel",
            &cargo.num_jobs,
        ]),
        "build IREE",
    );
    prefix
}

/// Where CMake builds go: `<target>/<profile>/iree-runtime-sys/`, next to cargo's own `build/`.
///
/// Not OUT_DIR itself: cargo gives the build script a new OUT_DIR whenever the resolved features
/// of its build-dependencies change (e.g. `cargo build` vs `cargo test` vs `cargo clippy`, or
/// another workspace crate adding a dependency), and each would rebuild IREE from scratch. Runs
/// are serialized by cargo's lock on the target directory. Falls back to OUT_DIR when the layout
/// is not cargo's usual `<profile>/build/<pkg>-<hash>/out`.
fn cmake_cache_root(out_dir: &Path) -> PathBuf {
    let build = out_dir.parent().and_then(Path::parent);
    match build.and_then(|b| Some((b.file_name()?, b.parent()?))) {
        Some((name, profile_dir)) if name == "build" => profile_dir.join("iree-runtime-sys"),
        _ => out_dir.join("cmake"),
    }
}

/// FNV-1a, 64 bit: a hash that stays the same across Rust releases (unlike `DefaultHasher`).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf29ce484222325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x100000001b3)
    })
}

fn run(command: &mut Command, what: &str) {
    eprintln!("running {command:?}");
    match command.status() {
        Ok(status) if status.success() => {}
        Ok(status) => fail(&format!(
            "`{command:?}` failed ({status}) trying to {what}; its output is above."
        )),
        Err(e) => fail(&format!("cannot run `{command:?}` to {what}: {e}")),
    }
}

/// `(lib dir, include dir)` of a prefix, or a message saying what is missing.
fn check_prefix(prefix: &Path) -> (PathBuf, PathBuf) {
    let include_dir = prefix.join("include");
    if !include_dir.join("iree/runtime/api.h").is_file() {
        fail(&format!(
            "{} has no include/iree/runtime/api.h; an IREE runtime prefix needs include/ with \
             the runtime headers (see crates/iree-runtime-sys/README.md).",
            prefix.display()
        ));
    }
    let lib_dir = ["lib", "lib64"]
        .iter()
        .map(|d| prefix.join(d))
        .find(|d| ARCHIVE_NAMES.iter().any(|n| d.join(format!("lib{n}.a")).is_file()))
        .unwrap_or_else(|| {
            fail(&format!(
                "{} has no lib/lib{{{}}}.a; an IREE runtime prefix needs one static archive \
                 (see crates/iree-runtime-sys/README.md).",
                prefix.display(),
                ARCHIVE_NAMES.join(",")
            ))
        });
    (lib_dir, include_dir)
}

fn generate_bindings(vars: &Vars, include_dir: &Path) {
    let out_dir = &vars.cargo.out_dir;
    let wrappers = out_dir.join("inline_wrappers");
    let bindings = bindgen::Builder::default()
        .header(vars.cargo.manifest_dir.join("wrapper.h").display().to_string())
        .clang_arg(format!("-I{}", include_dir.display()))
        .allowlist_function("iree_.*")
        .allowlist_type("iree_.*")
        .allowlist_var("(iree_|IREE_).*")
        .prepend_enum_name(false)
        .derive_default(true)
        .size_t_is_usize(true)
        .layout_tests(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrappers)
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen failed on wrapper.h: {e}")));
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .expect("write bindings.rs in OUT_DIR");

    cc::Build::new()
        .file(wrappers.with_extension("c"))
        .include(include_dir)
        .include(&vars.cargo.manifest_dir)
        .flag_if_supported("-std=gnu11")
        .warnings(false)
        .compile("iree_runtime_sys_inline");
}
