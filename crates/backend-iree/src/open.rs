//! Opening a manifest's artifacts on a device: one IREE session per distinct (module, archive).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use iree_runtime::{Device, Function};
use kv_core::irpa::FileStamp;
use kv_core::{Error, Graph, Manifest, Result, WindowRule};

use crate::convert::iree_err;
use crate::shared::{self, DeviceKey, SharedModule};

/// The device names a session can be opened on: the runtime's list.
pub use iree_runtime::DEVICE_NAMES as DEVICES;

/// How to open a session.
#[derive(Clone, Debug)]
pub struct IreeOptions {
    /// `local-task`, `local-sync` or `vulkan`.
    pub device: String,
    /// Key of `modules` to run (`llvm-cpu`, `vulkan`, `vulkan-valhall`); `None` picks the first
    /// one made for the device, or on Vulkan the `vulkan-portable-sgN` modules of the device's
    /// subgroup size where the manifest has them ([`crate::VulkanFeatures::pick`]).
    pub target: Option<String>,
    /// Worker count of the local-task executor (`None` = IREE's default).
    pub workers: Option<usize>,
    pub rule: WindowRule,
    pub prefill: PrefillRoute,
}

impl IreeOptions {
    pub fn new(device: &str) -> Self {
        IreeOptions {
            device: device.into(),
            target: None,
            workers: None,
            rule: WindowRule::Exact,
            prefill: PrefillRoute::auto_for(device),
        }
    }
}

/// How [`crate::IreeKvBackend`]'s `prefill` runs a prompt.
///
/// The prefill graph always computes all `SEQ` rows, so a one-line prompt costs as much as a
/// full one (3.7 s for Gemma 3 270M's SEQ 1024 on a 2-core CPU). Chunk calls from an empty cache
/// cost per `C` tokens, each reading every weight once. Both give the same cache and token (the
/// conformance suite runs both routes against the reference).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillRoute {
    /// Always the prefill graph (one call of `SEQ` rows).
    Graph,
    /// Always chunk calls from an empty cache (`ceil(n / C)` calls).
    Chunks,
    /// Chunk calls while the prompt needs at most this many of them, the graph above.
    ChunksUpTo(usize),
}

/// The most chunk calls [`PrefillRoute::auto_for`] a CPU device spends on a prefill.
pub const DEFAULT_CHUNKED_PREFILL_CALLS: usize = 8;

impl PrefillRoute {
    /// The route measured best on `device` (an [`IreeOptions::new`] default).
    ///
    /// - CPU (`local-task`, `local-sync`): chunks up to 8 calls. On Gemma 3 270M a chunk call costs
    ///   a small fraction of the SEQ 1024 prefill graph (both read every weight once; the graph
    ///   then computes 1024 rows), so a short prompt's first token comes an order of magnitude
    ///   sooner (docs/journal, session 3).
    /// - Vulkan: one chunk call at most. On the H200 (i16 weights) a chunk call costs as much as
    ///   the whole prefill graph (0.43 vs 0.48 s for an 8-token prompt; 843 tokens: 22 s in
    ///   chunks against 0.47 s), because both materialise the widened weights per call; one call
    ///   of C rows is never slower than one of SEQ rows.
    pub fn auto_for(device: &str) -> PrefillRoute {
        match device {
            "vulkan" => PrefillRoute::ChunksUpTo(1),
            _ => PrefillRoute::ChunksUpTo(DEFAULT_CHUNKED_PREFILL_CALLS),
        }
    }

    /// Whether a prompt of `n` tokens goes through chunk calls of `chunk` tokens.
    pub fn by_chunks(self, n: usize, chunk: usize) -> bool {
        match self {
            PrefillRoute::Graph => false,
            PrefillRoute::Chunks => true,
            PrefillRoute::ChunksUpTo(calls) => n.div_ceil(chunk) <= calls,
        }
    }
}

pub(crate) struct Opened {
    pub device: Device,
    /// Contexts shared with every other session of this process on the same files and device.
    pub sessions: Vec<Option<Arc<SharedModule>>>,
    /// The parameter archive of each session as it was at open: IREE maps it, so a call on a
    /// session whose archive changed could raise SIGBUS; callers check before each call.
    /// The archives each session reads (its own and its encoded one), by session index.
    pub archives: Vec<Vec<FileStamp>>,
    /// Graph → (index into `sessions`, function).
    pub functions: HashMap<Graph, (usize, Function)>,
    /// The prefill graph's token-less variants by span (`V2Spec::prefill_spans`), in its
    /// session; empty without a prefill graph.
    pub spans: Vec<(usize, Function)>,
    /// The chunk graph's variant over `smallChunk` rows (`V2Spec::small_chunk`), in its
    /// session; `None` without one.
    pub small: Option<Function>,
    /// The small chunk graph's variant over `smallChunkSpan` rows of each cache
    /// (`V2Spec::small_chunk_span`), in its session; `None` without one.
    pub small_span: Option<Function>,
    pub target: String,
}

fn target_for(manifest: &Manifest, options: &IreeOptions) -> Result<String> {
    if !DEVICES.contains(&options.device.as_str()) {
        // Before any module is read, with the runtime's own error (what `Device::open` says).
        return Err(iree_err("open")(iree_runtime::Error::UnknownDevice {
            name: options.device.clone(),
            valid: DEVICES,
        }));
    }
    let family = if options.device == "vulkan" {
        "vulkan"
    } else {
        "llvm-cpu"
    };
    if let Some(target) = &options.target {
        return match manifest.modules.contains_key(target) {
            true => Ok(target.clone()),
            false => Err(Error::manifest("modules", format!("no modules for target `{target}`"))),
        };
    }
    manifest
        .modules
        .keys()
        .find(|k| k.starts_with(family))
        .cloned()
        .ok_or_else(|| {
            let have: Vec<_> = manifest.modules.keys().cloned().collect();
            Error::manifest(
                "modules",
                format!(
                    "no `{family}` modules for device `{}` (have: {})",
                    options.device,
                    have.join(", ")
                ),
            )
        })
}

/// The dimensions (`None` for `?`) of input `index` as the function's `iree.abi.declaration`
/// reflection spells them (`sync func @f(%input0: tensor<1x24xi32>) -> ...`); `None` when the
/// module carries no such declaration.
pub fn declared_input_dims(function: &Function, index: usize) -> Option<Vec<Option<usize>>> {
    declared_input(function, index).map(|(dims, _)| dims)
}

/// [`declared_input_dims`] and the declared element type (`"f32"`, `"f16"`, ...).
pub fn declared_input(function: &Function, index: usize) -> Option<(Vec<Option<usize>>, String)> {
    let (_, declaration) = function.attributes.iter().find(|(k, _)| k == "iree.abi.declaration")?;
    let inputs = declaration
        .split_once('(')?
        .1
        .split_once(") ->")
        .map_or(declaration.as_str(), |p| p.0);
    let input = inputs.split("%input").nth(index + 1)?;
    let shape = input.split_once("tensor<")?.1.split_once('>')?.0;
    let mut dims: Vec<&str> = shape.split('x').collect();
    let element = dims.pop()?.to_string();
    let dims = dims
        .iter()
        .map(|d| match *d {
            "?" => Some(None),
            d => d.parse().ok().map(Some),
        })
        .collect::<Option<Vec<_>>>()?;
    Some((dims, element))
}

/// Opens `graphs` and checks each function's argument count against the manifest's contract.
pub(crate) fn open_graphs(dir: &Path, manifest: &Manifest, graphs: &[Graph], options: &IreeOptions) -> Result<Opened> {
    let opened = open_sessions(dir, manifest, graphs, options)?;
    check_arg_counts(manifest, &opened)?;
    Ok(opened)
}

/// Every opened function takes as many arguments as `manifest`'s contract says: a vmfb of another
/// contract or shape fails here, at open, not in a call.
pub(crate) fn check_arg_counts(manifest: &Manifest, opened: &Opened) -> Result<()> {
    for (&graph, (_, function)) in &opened.functions {
        let want = match graph {
            Graph::Redecode => 1,
            Graph::RedecodeAt => 2,
            _ => manifest.args_or_canonical(graph).len(),
        };
        check_arg_count(function, graph, want)?;
    }
    let prefill = manifest.args_or_canonical(Graph::Prefill).len();
    for (_, function) in &opened.spans {
        check_arg_count(function, Graph::Prefill, prefill)?;
    }
    for function in opened.small.iter().chain(&opened.small_span) {
        check_arg_count(function, Graph::Chunk, manifest.args_or_canonical(Graph::Chunk).len())?;
    }
    Ok(())
}

fn check_arg_count(function: &Function, graph: Graph, want: usize) -> Result<()> {
    let got = function.argument_count();
    if got != want {
        return Err(Error::ContractMismatch {
            backend: "iree",
            op: format!("open `{}`", function.name),
            message: format!(
                "the module's function takes {got} arguments but the `{}` contract for this manifest has {want}: a vmfb of another contract or shape",
                graph.key()
            ),
        });
    }
    Ok(())
}

/// The digests of the directories an open loads files from, each read once. A directory without
/// `digests.json` (artifacts exported before digests were written, the seed's, files put
/// together by hand) is not checked: the CLI warns about such `--artifacts`, and its cache
/// re-exports entries without digests.
#[derive(Default)]
struct Integrity {
    dirs: HashMap<PathBuf, Option<kv_core::digests::Digests>>,
}

impl Integrity {
    fn of(&mut self, dir: &Path) -> Result<Option<&kv_core::digests::Digests>> {
        if !self.dirs.contains_key(dir) {
            let digests = kv_core::digests::Digests::load(dir)?;
            self.dirs.insert(dir.to_path_buf(), digests);
        }
        Ok(self.dirs.get(dir).and_then(Option::as_ref))
    }

    /// Each file against the digests of its own directory: modules in full, archives by stamp.
    fn check<'a>(&mut self, files: impl IntoIterator<Item = &'a Path>) -> Result<()> {
        for file in files {
            let dir = match file.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if let Some(digests) = self.of(dir)? {
                digests.check_files(dir, [name.as_str()])?;
            }
        }
        Ok(())
    }
}

/// Opens the sessions of `graphs` and looks their functions up (no contract check).
pub(crate) fn open_sessions(
    dir: &Path,
    manifest: &Manifest,
    graphs: &[Graph],
    options: &IreeOptions,
) -> Result<Opened> {
    let mut target = target_for(manifest, options)?;
    let device_key = DeviceKey {
        name: options.device.clone(),
        workers: options.workers,
    };
    let device = shared::device(&device_key)?;
    if options.device == "vulkan" {
        let features = crate::features::VulkanFeatures::of(&device)?;
        if options.target.is_none() {
            target = features.pick(manifest.modules.keys(), target);
        }
        features.check(&target)?;
    }

    // What IREE runs must be what the exporter wrote (`kv_core::digests`): the manifest of an
    // artifact directory here, each module and archive below before it is loaded.
    let mut integrity = Integrity::default();
    if !dir.as_os_str().is_empty() {
        if let Some(digests) = integrity.of(dir)? {
            digests.check_open(dir, [])?;
        }
    }
    let mut sessions: Vec<Option<Arc<SharedModule>>> = Vec::new();
    let mut archives = Vec::new();
    let mut by_files: HashMap<(PathBuf, PathBuf), usize> = HashMap::new();
    let mut functions = HashMap::new();
    for &graph in graphs {
        let module = manifest.modules.get(&target).and_then(|m| m.get(graph.key()));
        if module.is_none() && graph == Graph::Prefill {
            // Optional, as the seed's nullable `vmfbPrefill`: a session can start from a snapshot.
            continue;
        }
        let vmfb = module
            .ok_or_else(|| Error::manifest("modules", format!("no `{}` module for target `{target}`", graph.key())))?;
        let irpa = manifest
            .parameter_file(graph)
            .ok_or_else(|| Error::manifest("parameters", format!("no archive for `{}`", graph.key())))?;
        let encoded = manifest.encoded_parameter_file(vmfb).map(|e| dir.join(e));
        let (vmfb, irpa) = (dir.join(vmfb), dir.join(irpa));
        let index = match by_files.get(&(vmfb.clone(), irpa.clone())) {
            Some(&i) => i,
            None => {
                let module = shared::module(
                    &device,
                    &device_key,
                    &vmfb,
                    &irpa,
                    &manifest.parameter_scope,
                    encoded.as_deref(),
                    || integrity.check([vmfb.as_path(), irpa.as_path()].into_iter().chain(encoded.as_deref())),
                )?;
                sessions.push(Some(module));
                let mut stamps = vec![FileStamp::open(&irpa)?];
                if let Some(encoded) = &encoded {
                    stamps.push(FileStamp::open(encoded)?);
                }
                archives.push(stamps);
                by_files.insert((vmfb, irpa), sessions.len() - 1);
                sessions.len() - 1
            }
        };
        let name = manifest
            .functions
            .get(graph)
            .ok_or_else(|| Error::manifest("functions", format!("no function name for `{}`", graph.key())))?;
        let session = sessions[index]
            .as_ref()
            .unwrap_or_else(|| kv_core::error::invariant("session just opened"));
        let function = session
            .lock()
            .lookup(name)
            .map_err(iree_err(format!("look up `{}` function", graph.key())))?;
        functions.insert(graph, (index, function));
    }
    let mut spans = Vec::new();
    if let Some((index, _)) = functions.get(&Graph::Prefill) {
        let session = sessions[*index]
            .as_ref()
            .unwrap_or_else(|| kv_core::error::invariant("session just opened"));
        for &span in manifest.v2().map_or(&[][..], |v2| &v2.prefill_spans) {
            let Some(name) = manifest.functions.prefill_span(span) else {
                kv_core::error::invariant("a validated manifest with prefill spans names its prefill graph")
            };
            let function = session.lock().lookup(&name).map_err(iree_err(format!(
                "look up the prefill graph's variant over {span} rows (prefillSpans)"
            )))?;
            spans.push((span, function));
        }
    }
    let small_rows = manifest.v2().map_or(0, |v2| v2.small_chunk);
    let small = match (small_rows, functions.get(&Graph::Chunk)) {
        (0, _) | (_, None) => None,
        (rows, Some((index, _))) => {
            let session = sessions[*index]
                .as_ref()
                .unwrap_or_else(|| kv_core::error::invariant("session just opened"));
            let Some(name) = manifest.functions.small_chunk(rows) else {
                kv_core::error::invariant("a validated manifest with a small chunk names its chunk graph")
            };
            let function = session.lock().lookup(&name).map_err(iree_err(format!(
                "look up the chunk graph's variant over {rows} rows (smallChunk)"
            )))?;
            Some((index, function))
        }
    };
    let small_span = match (manifest.v2().map_or(0, |v2| v2.small_chunk_span), &small) {
        (0, _) | (_, None) => None,
        (span, Some((index, _))) => {
            let session = sessions[**index]
                .as_ref()
                .unwrap_or_else(|| kv_core::error::invariant("session just opened"));
            let Some(name) = manifest.functions.small_chunk_span(small_rows, span) else {
                kv_core::error::invariant("a validated manifest with a small chunk names its chunk graph")
            };
            let function = session.lock().lookup(&name).map_err(iree_err(format!(
                "look up the small chunk graph's variant over {span} rows of each cache (smallChunkSpan)"
            )))?;
            Some(function)
        }
    };
    let small = small.map(|(_, f)| f);
    Ok(Opened {
        device,
        sessions,
        archives,
        functions,
        spans,
        small,
        small_span,
        target,
    })
}
