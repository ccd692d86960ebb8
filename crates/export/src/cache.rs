//! Exports kept on disk: a model exported for a target and layout once, reused afterwards (the
//! demo's embedded model, the conformance suite's fixtures).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kv_core::manifest::MANIFEST_FILE;

use crate::{export_artifacts, ExportError, ExportOptions, Layout, Result, Source, Target};

/// Beside a cached export: what it was made from, so a changed model (or a fixture whose
/// definition changed) is exported again instead of silently reused.
const FINGERPRINT_FILE: &str = "source.fingerprint";

/// The emitter's own version: bump when the graphs it writes change, so caches are refreshed.
const EMITTER_REVISION: u32 = 5;

/// A hash of the source manifest and weights (contents up to 64 MiB, length and mtime beyond).
fn source_fingerprint(model: &str) -> Result<String> {
    use std::hash::{Hash, Hasher};
    let dir = match Source::parse(model) {
        Source::Dir(dir) => dir,
        Source::Fixture(name) => fixtures::materialize(&name)?,
    };
    let manifest = kv_core::Manifest::load(&dir)?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (EMITTER_REVISION, crate::COMPILER_VERSION).hash(&mut hasher);
    let mut files = vec![dir.join(MANIFEST_FILE)];
    files.extend(manifest.weights_file().map(|w| dir.join(w)));
    for file in files {
        let meta = std::fs::metadata(&file).map_err(ExportError::io("reading", &file))?;
        meta.len().hash(&mut hasher);
        if meta.len() <= 64 << 20 {
            std::fs::read(&file)
                .map_err(ExportError::io("reading", &file))?
                .hash(&mut hasher);
        } else {
            meta.modified().ok().hash(&mut hasher);
        }
    }
    Ok(format!("{:016x}", hasher.finish()))
}

/// The export settings that run best on `target`, measured on FunctionGemma-270M's geometry
/// (docs/benchmarks.md): CPU modules take bf16 weights (IREE fuses the widening into the matmuls
/// and, hoisting, lays the weights out for its matmul tiles once at load) where Vulkan needs the
/// packed form on IREE's portable baseline (IREE 3.13 miscompiles bf16 on Vulkan; the packed
/// widening must not be hoisted, [`crate::weight_compile_flags`]) and i16 on a named GPU target
/// (fused into the decode step's matmuls; needs the 16-bit storage such targets have). CPU
/// modules are compiled with [`CPU_RUNTIME_FLAGS`].
pub fn runtime_options(target: &Target) -> ExportOptions {
    ExportOptions {
        weights: match target {
            Target::Cpu { .. } => crate::WeightFormat::Bf16,
            Target::Vulkan { target: None } => crate::WeightFormat::PackedI32,
            Target::Vulkan { target: Some(_) } => crate::WeightFormat::I16,
        },
        compile_flags: match target {
            Target::Cpu { .. } => CPU_RUNTIME_FLAGS.iter().map(|f| f.to_string()).collect(),
            Target::Vulkan { .. } => Vec::new(),
        },
        ..ExportOptions::default()
    }
}

/// The `iree-compile` flags of CPU runtime exports, the same for every graph so that all graphs
/// stay in one module (graphs with flags of their own get modules of their own, and each CPU
/// module hoists its own relayout of every weight it reads: a second 536 MB for Gemma 3 270M).
///
/// - `--iree-opt-level=O3`: IREE's default is O0. Every graph compiles at O3 with the two-stage
///   argmax (`mlir::Body::argmax_rows`) except the chunk graph. At O3 the matmuls read the bf16
///   weights in the archive's layout: nothing is hoisted (at O0 the step alone hoisted 127
///   transposed weight copies), so Gemma 3 270M's peak RSS in `bench` fell from 1,347–1,556 MB to
///   914–1,029 MB. Speed on a 2-core AMD EPYC (Zen 4, AVX-512 BF16) under heavy load, CPU time
///   per call in `iree-benchmark-module`: step within noise (134–150 ms against 138–152 ms),
///   chunk 197–207 ms against 222–245 ms, redecode (SEQ 128) 1.15 s against 1.25 s; on an AVX2
///   EPYC the step alone went from 116 to 45 ms at O3 (`shared/notes/PERFORMANCE.md`).
/// - `--iree-dispatch-creation-enable-aggressive-fusion=false`: the one O3 option (of those it
///   turns on: assertions stripped, outer-dim concatenation, aggressive fusion, generalised
///   matmuls, reassociated FP reductions, transposes propagated) the chunk graph fails with:
///   "'vector.maskedstore' op write affecting operations on global resources are restricted to
///   workgroup distributed contexts", on the one-term reduce that drops the unit dimension of the
///   per-head mask, fused into the attention dispatch (Gemma 3 270M geometry, 6+ layers).
///   Without it the chunk graph compiles at O3; the step measured the same with and without it.
///
/// Not used: `--iree-opt-data-tiling --iree-llvmcpu-enable-ukernels=all` fails on the step
/// ("'affine.delinearize_index' op no basis element may be statically non-positive", the
/// attention `dot_general` over the dynamic past) and on the prefill ("exceeded stack allocation
/// limit of 32768 bytes"); it compiles for the chunk graph alone (CPU time per call 157–171 ms
/// against 197–215 ms without it), which would then need a module of its own holding a hoisted,
/// data-tiled copy of every weight (+536 MB).
pub const CPU_RUNTIME_FLAGS: &[&str] = &[
    "--iree-opt-level=O3",
    "--iree-dispatch-creation-enable-aggressive-fusion=false",
];

/// The default cache root: `$SKAINET_KV_CACHE/artifacts`, else `<workspace>/.cache/artifacts`.
pub fn cache_root() -> PathBuf {
    match std::env::var_os("SKAINET_KV_CACHE") {
        Some(dir) => PathBuf::from(dir).join("artifacts"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/artifacts"),
    }
}

/// The artifact directory of `model` (a fixture name or a model directory) for `target` and
/// `layout` with the default options, exporting it first unless a finished export is cached.
pub fn cached_export(model: &str, target: &Target, layout: Layout) -> Result<PathBuf> {
    let options = ExportOptions {
        targets: vec![target.clone()],
        layout,
        ..ExportOptions::default()
    };
    cached_export_with(model, &options)
}

/// The artifact directory of `model` exported with `options`, exporting it first unless a
/// finished export with the same options and source is cached. Entries are named
/// `<model>-<targets>-<layout>` for the default options and get a hash of the options otherwise,
/// so that, e.g., a redecode graph of another SEQ or bf16 weights live beside the default.
/// Written beside the entry and renamed, so a crash never leaves half an artifact set that looks
/// finished.
pub fn cached_export_with(model: &str, options: &ExportOptions) -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let entry = Entry::of(model, options)?;
    if entry.is_fresh() {
        return Ok(entry.dir);
    }
    let (root, name, dir, fingerprint) = (cache_root(), entry.name, entry.dir, entry.fingerprint);
    std::fs::create_dir_all(&root).map_err(ExportError::io("creating artifact cache", &root))?;
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    export_artifacts(&Source::parse(model), &tmp, options)?;
    let tmp_stamp = tmp.join(FINGERPRINT_FILE);
    std::fs::write(&tmp_stamp, &fingerprint).map_err(ExportError::io("writing fingerprint", &tmp_stamp))?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(ExportError::io("installing artifacts", &dir))?;
    Ok(dir)
}

/// Whether [`cached_export_with`] would reuse a finished export (no compile).
pub fn is_cached(model: &str, options: &ExportOptions) -> Result<bool> {
    Ok(Entry::of(model, options)?.is_fresh())
}

/// Where an export lives in the cache and what must match for it to be reused.
struct Entry {
    name: String,
    dir: PathBuf,
    fingerprint: String,
}

/// What identifies this machine's CPU for `--iree-llvmcpu-target-cpu=host` code: the model name
/// and feature flags the kernel reports (LLVM derives `host` from the same), else the architecture.
fn host_cpu() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_default()
    };
    // x86 names these `model name` / `flags`, ARM `CPU part` / `Features`.
    format!(
        "{} {} | {}{}",
        std::env::consts::ARCH,
        field("model name"),
        field("flags"),
        field("Features") + &field("CPU part")
    )
}

impl Entry {
    fn of(model: &str, options: &ExportOptions) -> Result<Entry> {
        use std::hash::{Hash, Hasher};
        let targets: Vec<String> = options.targets.iter().map(Target::key).collect();
        let mut name = format!(
            "{}-{}-{:?}",
            model.replace([':', '/'], "-"),
            targets.join("+"),
            options.layout
        );
        let defaults = ExportOptions {
            targets: Vec::new(),
            layout: options.layout,
            ..ExportOptions::default()
        };
        // Every field but targets and layout (in the name already) decides the entry.
        let mut settings = format!(
            "{:?}",
            ExportOptions {
                targets: Vec::new(),
                ..options.clone()
            }
        );
        // `host` means this machine's CPU: each CPU its own entry, so a cache moved to (or shared
        // with) another machine never runs code built for instructions that one lacks.
        if options
            .targets
            .iter()
            .any(|t| matches!(t, Target::Cpu { cpu } if cpu == "host"))
        {
            settings.push_str(&format!("\nhost cpu: {}", host_cpu()));
        }
        if settings != format!("{defaults:?}") {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            settings.hash(&mut hasher);
            name = format!("{name}-{:08x}", hasher.finish() as u32);
        }
        let name = name.to_lowercase();
        Ok(Entry {
            dir: cache_root().join(&name),
            name,
            fingerprint: format!("{}\n{settings}\n", source_fingerprint(model)?),
        })
    }

    fn is_fresh(&self) -> bool {
        self.dir.join(MANIFEST_FILE).is_file()
            && std::fs::read_to_string(self.dir.join(FINGERPRINT_FILE)).is_ok_and(|s| s == self.fingerprint)
    }
}
