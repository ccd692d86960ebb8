//! Exports kept on disk: a model exported for a target and layout once, reused afterwards (the
//! demo's embedded model, the conformance suite's fixtures).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kv_core::manifest::{CacheType, MatmulInput, MANIFEST_FILE};
use kv_core::ContractVersion;

use sha2::{Digest, Sha256};

use crate::profile::{GpuFamily, TargetProfile};
use crate::{ExportError, ExportOptions, ExportPlan, Layout, Result, Source, Target, WeightFormat};

/// Beside a cached export: the key of what it was made from ([`crate::ExportPlan::key`]: the
/// emitted text, flags, compiler, kernels and source), so a change of any is exported again
/// instead of silently reused.
const FINGERPRINT_FILE: &str = "source.fingerprint";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The export settings that run best on `target`, measured on FunctionGemma-270M's geometry
/// (docs/journal, session 2): CPU modules take bf16 weights (IREE fuses the widening into the matmuls
/// and, hoisting, lays the weights out for its matmul tiles once at load) where Vulkan needs the
/// packed form on IREE's portable baseline (IREE 3.13 miscompiles bf16 on Vulkan; the packed
/// widening must not be hoisted, [`crate::weight_compile_flags`]) and i16 on a named GPU target
/// (fused into the decode step's matmuls; needs the 16-bit storage such targets have). CPU
/// modules are compiled with [`CPU_RUNTIME_FLAGS`].
pub fn runtime_options(target: &Target) -> ExportOptions {
    runtime_options_for(target, ContractVersion::V1)
}

/// [`runtime_options`] for graph contract `contract` (v1 or v2). Contract 2's CPU modules are
/// compiled with [`CPU_RUNTIME_FLAGS_V2`], and on a `host` CPU with bf16 dot products
/// ([`host_has_bf16_dot`]) multiply bf16 activations ([`MatmulInput::Bf16`]). Real Gemma 3
/// 270M, `bench`, the same binary with the two exports alternating (3 rounds, 2-core AMD EPYC
/// Zen 5, load 0.5–1.3): 843-token prefill 833–1,093 → 637–742 ms, chunk call 44–47 → 31–35
/// ms, decode 16.9–19.0 → 15.4–16.1 ms/token, first token of an 8-token prompt 49–60 → 38–40
/// ms, peak RSS the same (690 MB); the greedy tokens of the real-model prompts the same.
pub fn runtime_options_for(target: &Target, contract: ContractVersion) -> ExportOptions {
    let profile = TargetProfile::of(target);
    let v2 = matches!(contract, ContractVersion::V2);
    let cpu_flags = |flags: &[&str]| flags.iter().map(|f| f.to_string()).collect();
    let host = match &profile {
        TargetProfile::CpuHost { features } => Some(*features),
        _ => None,
    };
    ExportOptions {
        contract,
        weights: match &profile {
            TargetProfile::Cpu { .. } | TargetProfile::CpuHost { .. } => WeightFormat::Bf16,
            TargetProfile::Vulkan {
                family: GpuFamily::Portable,
                ..
            } => WeightFormat::PackedI32,
            TargetProfile::Vulkan { .. } => WeightFormat::I16,
        },
        compile_flags: match (profile.is_cpu(), v2) {
            (true, false) => cpu_flags(CPU_RUNTIME_FLAGS),
            (true, true) => cpu_flags(CPU_RUNTIME_FLAGS_V2),
            (false, _) => Vec::new(),
        },
        matmul_input: match host {
            Some(h) if v2 && h.bf16_dot => MatmulInput::Bf16,
            _ => MatmulInput::F32,
        },
        cache_type: match host {
            Some(h) if v2 && h.f16_convert => CacheType::F16,
            _ => CacheType::F32,
        },
        ..ExportOptions::default()
    }
}

/// Whether this CPU multiplies bf16 pairs into f32 sums in hardware (x86: AVX-512 BF16's
/// `vdpbf16ps`), where contract 2's data-tiled bf16 × bf16 matmuls run on IREE's bf16 ukernels.
/// Without it IREE emulates them, far slower than f32 × f32 (a 262144 × 640 matvec took 667 ms
/// against 38.5 ms on an AVX2 EPYC, `shared/notes/PERFORMANCE.md`): there the graphs stay f32.
pub fn host_has_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU converts f16 to f32 in hardware (x86: F16C; every aarch64 CPU), so that a
/// graph reading f16 caches widens them with one instruction per 8 or 16 values instead of a
/// software routine per value. Where it does, contract 2's `host` exports keep f16 caches
/// ([`CacheType::F16`]).
pub fn host_converts_f16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(target_arch = "aarch64")]
    {
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
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

/// The `iree-compile` flags of CPU runtime exports of contract 2, where every shape is static,
/// so data tiling compiles: each matmul's operands are laid out in the CPU's tiles (the weights
/// once, at load, by hoisted initializers; the caches on each call).
///
/// Measured on `gemma3-270m-shape:1` (bf16 weights, `--iree-llvmcpu-target-cpu=host`, a 2-vCPU
/// AMD EPYC Zen 5 shared with builds, load average 3–3.7), `iree-benchmark-module
/// --device=local-task`, medians of 5 repetitions in 3 interleaved rounds, CPU time per call:
/// - step (v1 at past 200, v2 at pos 200 of P 2048): v1 with [`CPU_RUNTIME_FLAGS`] 78–92 ms;
///   v2 at O3 alone 76–101 ms; v2 with these flags 36–40 ms. Ukernels `all`, `mmt4d` or none
///   measured the same within noise (35–42 ms): the data tiling is what counts.
/// - chunk (C 32 at past / pos 200): v1 119–124 ms, v2 at O3 159–174 ms (it attends over all
///   P rows), v2 with these flags 108–115 ms.
/// - the cost, peak RSS (`/usr/bin/time -v`, the step's benchmark): v1 566 MB, v2 at O3 613 MB
///   (the caches' host copies), v2 with these flags 1,061 MB (803 MB after load): the tiled copy
///   of every weight is built at load beside the archive's.
///
/// `--iree-global-opt-data-tiling`, not `--iree-opt-data-tiling`: in IREE 3.13 the latter takes
/// the dispatch-creation path, which fails on this attention ("exceeded stack allocation limit
/// of 32768 bytes" on FunctionGemma's step; that, "large vector sizes" or "map_store ... workgroup
/// distributed contexts" on the tiny fixtures' chunk graphs, whichever way the softmax is
/// written); the global-optimization path compiles every graph and fixture tried. Aggressive
/// fusion (v1's exception) stays on: the v2 chunk graph has no per-head mask reduce.
pub const CPU_RUNTIME_FLAGS_V2: &[&str] = &[
    "--iree-opt-level=O3",
    "--iree-global-opt-data-tiling",
    "--iree-llvmcpu-enable-ukernels=all",
];

/// The default cache root: `artifacts/` in the project's cache ([`kv_paths::Root::Cache`]:
/// `$SKAINET_KV_CACHE`, else the platform's cache directory). [`cached_export_in`] takes an
/// explicit root instead.
pub fn cache_root() -> Result<PathBuf> {
    kv_paths::Root::Cache
        .join("artifacts")
        .map_err(ExportError::io("locating the export cache", Path::new("artifacts/")))
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

/// [`cached_export_in`] the default [`cache_root`].
pub fn cached_export_with(model: &str, options: &ExportOptions) -> Result<PathBuf> {
    cached_export_in(&cache_root()?, model, options)
}

/// [`cached_export_noting_in`] the default [`cache_root`].
pub fn cached_export_noting(
    model: &str,
    options: &ExportOptions,
    notify: &mut dyn FnMut(kv_paths::FillEvent),
) -> Result<PathBuf> {
    cached_export_noting_in(&cache_root()?, model, options, notify)
}

/// The artifact directory of `model` exported with `options` in the cache at `root`, exporting it
/// first unless a finished export with the same options and source is cached. Entries are named
/// `<model>-<targets>-<layout>` for the default options and get a hash of the options otherwise
/// ([`entry_name`]), so that, e.g., a redecode graph of another SEQ or bf16 weights live beside
/// the default.
pub fn cached_export_in(root: &Path, model: &str, options: &ExportOptions) -> Result<PathBuf> {
    cached_export_noting_in(root, model, options, &mut |_| {})
}

/// [`cached_export_in`], telling `notify` when this caller waits for another process exporting
/// the same entry ([`kv_paths::FillEvent::Waiting`]) and when it exports (`Building`).
///
/// The entry is filled through [`kv_paths::fill_entry`]: one process exports while the others
/// wait on the entry's lock, then reuse it (without the lock the second would rename its copy
/// over an entry the first has already opened, which the first's sessions see as archives
/// replaced under them). An entry is reused only while the key of what it would be made of
/// matches ([`crate::ExportPlan::key`]: planning emits every module, which is cheap, and
/// compiles nothing) and its files match their digests ([`kv_core::digests`]: modules in full, archives by stamp), so a
/// damaged entry is exported again, under the lock, rather than run or failing on every run.
pub fn cached_export_noting_in(
    root: &Path,
    model: &str,
    options: &ExportOptions,
    notify: &mut dyn FnMut(kv_paths::FillEvent),
) -> Result<PathBuf> {
    // One export at a time per process, as before the file lock: each `iree-compile` already uses
    // every core, and test binaries ask for many entries from parallel threads.
    static EXPORTS: Mutex<()> = Mutex::new(());
    let _one = EXPORTS.lock().unwrap_or_else(|e| e.into_inner());
    let entry = Entry::of(root, model, options)?;
    let build = |tmp: &Path| -> Result<()> {
        entry.plan.write(tmp)?;
        let stamp = tmp.join(FINGERPRINT_FILE);
        std::fs::write(&stamp, &entry.fingerprint).map_err(ExportError::io("writing fingerprint", &stamp))
    };
    kv_paths::fill_entry(&entry.dir, |dir| entry.is_fresh_at(dir), build, notify)
        .map_err(|e| e.into_error(|what, path, source| ExportError::io(what, &path)(source)))
}

/// Whether [`cached_export_with`] would reuse a finished export (no compile).
pub fn is_cached(model: &str, options: &ExportOptions) -> Result<bool> {
    Ok(Entry::of(&cache_root()?, model, options)?.is_fresh())
}

/// Where an export lives in the cache, what must match for it to be reused, and how to make it.
struct Entry {
    dir: PathBuf,
    fingerprint: String,
    plan: ExportPlan,
}

/// What identifies this machine's CPU for `--iree-llvmcpu-target-cpu=host` code: the model name
/// and feature flags the kernel reports (LLVM derives `host` from the same), else the architecture.
pub(crate) fn host_cpu() -> String {
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

fn layout_key(layout: Layout) -> &'static str {
    match layout {
        Layout::Shared => "shared",
        Layout::Three => "three",
    }
}

fn weights_key(weights: WeightFormat) -> &'static str {
    match weights {
        WeightFormat::Bf16 => "bf16",
        WeightFormat::PackedI32 => "packed-i32",
        WeightFormat::I16 => "i16",
    }
}

/// Every setting of `options` but the targets and the layout (both in the entry's name), plus the
/// host CPU where a target is `host`, as JSON with sorted keys and stable spellings: the canonical
/// form the entry's hash is taken of (never Rust's `Debug` output, which may change between
/// compiler releases).
fn settings(options: &ExportOptions) -> serde_json::Value {
    let graph_flags: serde_json::Map<String, serde_json::Value> = options
        .graph_flags
        .iter()
        .map(|(g, flags)| (g.key().to_string(), serde_json::json!(flags)))
        .collect();
    let mut settings = serde_json::json!({
        "chunk": options.chunk,
        "compileFlags": options.compile_flags,
        "graphFlags": graph_flags,
        "graphs": options.graphs.iter().map(|g| g.key()).collect::<Vec<_>>(),
        "prefillSeq": options.prefill_seq,
        "prefix": options.prefix,
        "redecodeSeq": options.redecode_seq,
        "vulkanTarget": options.vulkan_target,
        "weights": weights_key(options.weights),
    });
    // Off by default, and then absent: exports without top-k keep the names they had before it.
    if options.top_k != 0 {
        settings["topK"] = serde_json::json!(options.top_k);
    }
    // Absent for contract 1, for the same reason.
    match options.contract {
        ContractVersion::V1 => {}
        ContractVersion::V2 => settings["contract"] = serde_json::json!(options.contract.number()),
    }
    if let Some(slack) = options.ring_slack {
        settings["ringSlack"] = serde_json::json!(slack);
    }
    if let Some(spans) = &options.prefill_spans {
        settings["prefillSpans"] = serde_json::json!(spans);
    }
    if let Some(rows) = options.small_chunk {
        settings["smallChunk"] = serde_json::json!(rows);
    }
    if !options.matmul_input.is_f32() {
        settings["matmulInput"] = serde_json::json!(options.matmul_input);
    }
    if !options.cache_type.is_f32() {
        settings["cacheType"] = serde_json::json!(options.cache_type);
    }
    if !options.fuse_projections {
        settings["projections"] = serde_json::json!("apart");
    }
    // `host` means this machine's CPU: each CPU its own entry, so a cache moved to (or shared
    // with) another machine never runs code built for instructions that one lacks.
    if options
        .targets
        .iter()
        .any(|t| matches!(t, Target::Cpu { cpu } if cpu == "host"))
    {
        settings["hostCpu"] = serde_json::json!(host_cpu());
    }
    // A module without the kernel beside the one with it, not in its place.
    if matches!(crate::kernels::q4_kernel_allowed(), Ok(false)) {
        settings["q4Kernel"] = serde_json::json!("off");
    }
    settings
}

/// `settings` as compact JSON text with every object's keys sorted here, so that serde_json's
/// `preserve_order` feature (which any crate in a build may turn on) cannot reorder them.
fn canonical(settings: &serde_json::Value) -> String {
    fn sorted(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(m) => {
                let mut keys: Vec<_> = m.keys().collect();
                keys.sort();
                let mut out = serde_json::Map::new();
                for k in keys {
                    out.insert(k.clone(), sorted(&m[k]));
                }
                serde_json::Value::Object(out)
            }
            serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(settings).to_string()
}

/// The cache entry's name: `<model>-<targets>-<layout>`, then `-v<contract>` for a contract other
/// than 1, and for settings other than that contract's defaults the first 8 hex digits of the
/// sha256 of their canonical form.
pub fn entry_name(model: &str, options: &ExportOptions) -> String {
    let targets: Vec<String> = options.targets.iter().map(Target::key).collect();
    let mut name = format!(
        "{}-{}-{}",
        model.replace([':', '/'], "-"),
        targets.join("+"),
        layout_key(options.layout)
    );
    match options.contract {
        ContractVersion::V1 => {}
        ContractVersion::V2 => name = format!("{name}-v{}", options.contract.number()),
    }
    let defaults = ExportOptions {
        targets: Vec::new(),
        layout: options.layout,
        contract: options.contract,
        ..ExportOptions::default()
    };
    let settings = canonical(&settings(options));
    if settings != canonical(&self::settings(&defaults)) {
        let digest = Sha256::digest(settings.as_bytes());
        name = format!("{name}-{}", &hex(&digest)[..8]);
    }
    name.to_lowercase()
}

impl Entry {
    /// Plans the export (emitting every module, which is cheap) to key it by what it would
    /// compile; nothing is compiled here.
    fn of(root: &Path, model: &str, options: &ExportOptions) -> Result<Entry> {
        // Refused here too, not only where an export starts: a cached entry would hide the typo.
        crate::kernels::q4_kernel_allowed()?;
        let plan = ExportPlan::new(&Source::parse(model), options)?;
        Ok(Entry {
            dir: root.join(entry_name(model, options)),
            fingerprint: format!("{}\n", plan.key()?),
            plan,
        })
    }

    fn is_fresh(&self) -> bool {
        self.is_fresh_at(&self.dir)
    }

    /// Made from this source with these options, and intact: an entry without digests (made
    /// before they were written) or with a file that no longer matches them is stale.
    fn is_fresh_at(&self, dir: &Path) -> bool {
        dir.join(MANIFEST_FILE).is_file()
            && std::fs::read_to_string(dir.join(FINGERPRINT_FILE)).is_ok_and(|s| s == self.fingerprint)
            && kv_core::digests::Digests::load(dir).is_ok_and(|d| {
                d.is_some_and(|d| {
                    let files = d.files.keys().filter(|f| *f != MANIFEST_FILE).map(String::as_str);
                    d.check_open(dir, files).is_ok()
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_core::Graph;

    /// Pinned: a change of this name means every cache entry of these options is exported again
    /// (and, if unintended, that the key no longer depends on the options alone).
    #[test]
    fn entry_names_are_pinned() {
        let default = ExportOptions {
            targets: vec![Target::cpu()],
            ..ExportOptions::default()
        };
        assert_eq!(entry_name("tiny-gemma3:7", &default), "tiny-gemma3-7-llvm-cpu-shared");
        let three = ExportOptions {
            layout: Layout::Three,
            ..default.clone()
        };
        assert_eq!(entry_name("tiny-gemma3:7", &three), "tiny-gemma3-7-llvm-cpu-three");
        let mut tuned = ExportOptions {
            targets: vec![Target::cpu(), Target::vulkan()],
            redecode_seq: Some(128),
            weights: WeightFormat::Bf16,
            compile_flags: vec!["--iree-opt-level=O3".into()],
            ..ExportOptions::default()
        };
        tuned.graph_flags.insert(Graph::Chunk, vec!["--x".into()]);
        assert_eq!(
            entry_name("tiny-llama:3", &tuned),
            "tiny-llama-3-llvm-cpu+vulkan-shared-178e85dd"
        );
    }

    /// bf16 matmul inputs are their own entry; f32 (the default) keeps the names it had.
    #[test]
    fn matmul_input_is_part_of_the_key() {
        let f32_inputs = runtime_options_for(&Target::cpu(), ContractVersion::V2);
        assert_eq!(f32_inputs.matmul_input, MatmulInput::F32, "a generic CPU gets f32");
        let bf16_inputs = ExportOptions {
            matmul_input: MatmulInput::Bf16,
            ..f32_inputs.clone()
        };
        assert!(!canonical(&settings(&f32_inputs)).contains("matmulInput"));
        assert_ne!(
            entry_name("tiny-gemma3:7", &f32_inputs),
            entry_name("tiny-gemma3:7", &bf16_inputs)
        );
        let host = runtime_options_for(&Target::Cpu { cpu: "host".into() }, ContractVersion::V2);
        let want = if host_has_bf16_dot() {
            MatmulInput::Bf16
        } else {
            MatmulInput::F32
        };
        assert_eq!(host.matmul_input, want);
        assert_eq!(
            runtime_options_for(&Target::Cpu { cpu: "host".into() }, ContractVersion::V1).matmul_input,
            MatmulInput::F32
        );
    }

    /// Contract 2 is named (`-v2`) and hashed beside contract 1's entries, whose names do not
    /// change; its default graph list (the prefill dropped or not) is one entry.
    #[test]
    fn contract_2_entries_are_named_apart() {
        let v1 = ExportOptions {
            targets: vec![Target::cpu()],
            ..ExportOptions::default()
        };
        let v2 = ExportOptions {
            contract: ContractVersion::V2,
            ..v1.clone()
        };
        assert_eq!(entry_name("tiny-gemma3:7", &v1), "tiny-gemma3-7-llvm-cpu-shared");
        assert_eq!(entry_name("tiny-gemma3:7", &v2), "tiny-gemma3-7-llvm-cpu-shared-v2");
        assert_ne!(canonical(&settings(&v1)), canonical(&settings(&v2)));
        let runtime = runtime_options_for(&Target::cpu(), ContractVersion::V2);
        assert_eq!(runtime.contract, ContractVersion::V2);
        assert!(
            runtime.graphs.contains(&Graph::Prefill),
            "v2's prefill graph is a chunk graph"
        );
        assert_eq!(
            entry_name(
                "tiny-gemma3:7",
                &runtime_options_for(&Target::cpu(), ContractVersion::V1)
            ),
            entry_name("tiny-gemma3:7", &runtime_options(&Target::cpu()))
        );
    }

    #[test]
    fn every_setting_changes_the_name() {
        let base = ExportOptions::default();
        let name = |o: &ExportOptions| entry_name("m", o);
        let variants = [
            ExportOptions {
                chunk: Some(4),
                ..base.clone()
            },
            ExportOptions {
                prefill_seq: Some(32),
                ..base.clone()
            },
            ExportOptions {
                redecode_seq: Some(32),
                ..base.clone()
            },
            ExportOptions {
                prefix: Some("p".into()),
                ..base.clone()
            },
            ExportOptions {
                vulkan_target: Some("valhall".into()),
                ..base.clone()
            },
            ExportOptions {
                weights: WeightFormat::I16,
                ..base.clone()
            },
            ExportOptions {
                graphs: vec![Graph::Step],
                ..base.clone()
            },
            ExportOptions {
                compile_flags: vec!["--f".into()],
                ..base.clone()
            },
            ExportOptions {
                graph_flags: [(Graph::Step, vec!["--f".into()])].into(),
                ..base.clone()
            },
            ExportOptions {
                targets: vec![Target::Cpu { cpu: "host".into() }],
                ..base.clone()
            },
            ExportOptions {
                top_k: 64,
                ..base.clone()
            },
            ExportOptions {
                contract: ContractVersion::V2,
                ..base.clone()
            },
        ];
        let mut names: Vec<String> = variants.iter().map(name).collect();
        names.push(name(&base));
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count, "{names:?}");
    }

    #[test]
    fn canonical_form_sorts_keys() {
        let v = serde_json::json!({"b": 1, "a": {"d": [2, {"f": 3, "e": 4}], "c": null}});
        assert_eq!(canonical(&v), r#"{"a":{"c":null,"d":[2,{"e":4,"f":3}]},"b":1}"#);
    }
}
