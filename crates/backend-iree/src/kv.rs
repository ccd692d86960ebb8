//! [`IreeKvBackend`]: the stateful KV session on an IREE device.

mod greedy;
mod storage;
mod v2;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use iree_runtime::{BufferView, Device, ElementType, Function, Profiling, Transfer};
use kv_core::allowed::AllowedTokens;
use kv_core::irpa::FileStamp;
use kv_core::manifest::{CacheType, Name};
use kv_core::snapshot_file::LayerRows;
use kv_core::window::{plan_chunk, plan_chunked_prefill, plan_prefill, plan_step, ChunkPlan, KindInputs};
use kv_core::{
    Contract, Error, Graph, KvBackend, KvSpec, LayerKind, LayerKv, Manifest, ModelFingerprint, PersistSnapshot, Result,
    SessionId, StepPhases, TopK, V2Spec, WindowRule,
};

use crate::convert::{contract_err, iree_err};
use crate::embedding::Embedding;
use crate::open::{check_arg_counts, declared_input, open_graphs, open_sessions, IreeOptions, Opened};
use crate::shared::SharedModule;

/// One layer's cache: a `[1, nKvHeads, rows, d]` view covering positions `first..first + rows`.
#[derive(Clone)]
struct LayerCache {
    k: BufferView,
    v: BufferView,
    /// Absolute position of row 0.
    first: usize,
    rows: usize,
}

impl LayerCache {
    /// Copies the rows to the host (one read per buffer).
    fn to_host(&self, spec: &KvSpec) -> Result<LayerKv> {
        Ok(LayerKv {
            first_position: self.first,
            rows: self.rows,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            k: self.k.to_f32_vec().map_err(iree_err("read K"))?,
            v: self.v.to_f32_vec().map_err(iree_err("read V"))?,
        })
    }
}

/// The `topk.logits` and `topk.ids` results of a call, left on the device until asked for.
#[derive(Clone)]
struct TopKViews {
    logits: BufferView,
    ids: BufferView,
}

/// A session's caches, by contract: what a call reads and what it replaces. The contract is
/// matched on this value, so a v1 session cannot hold a v2 set or the reverse, and no field
/// must stay empty under the other contract.
#[derive(Clone)]
enum Caches {
    /// Contract v1: each layer's rows as the last call returned them (none at position 0).
    V1(Vec<LayerCache>),
    /// Contract v2: the runtime-owned set the graphs read whole and the session writes the new
    /// rows into; `None` before the first prefill or restore.
    V2(Option<Arc<v2::CacheSet>>),
}

/// What a snapshot keeps of [`Caches`]: v1's layer views, or v2's pin on a set (which keeps the
/// rows before its position from being overwritten in place).
#[derive(Clone)]
enum Held {
    V1(Vec<LayerCache>),
    V2(Option<v2::Pin>),
}

impl Caches {
    /// No rows yet, under `manifest`'s contract.
    fn empty(manifest: &Manifest) -> Caches {
        match manifest.contract {
            Contract::V1 => Caches::V1(Vec::new()),
            Contract::V2(_) => Caches::V2(None),
        }
    }

    /// A hold on these caches at `position` (views and pins; nothing is copied).
    fn hold(&self, position: usize) -> Held {
        match self {
            Caches::V1(layers) => Held::V1(layers.clone()),
            Caches::V2(set) => Held::V2(set.as_ref().map(|set| set.pin(position))),
        }
    }

    /// The caches a snapshot holds, as the session's again.
    fn from_held(held: &Held) -> Caches {
        match held {
            Held::V1(layers) => Caches::V1(layers.clone()),
            Held::V2(pin) => Caches::V2(pin.as_ref().map(|pin| pin.set().clone())),
        }
    }

    /// Whether these are `held`'s device buffers themselves, not copies of them.
    fn are(&self, held: &Held) -> bool {
        match (self, held) {
            (Caches::V1(mine), Held::V1(theirs)) => {
                mine.len() == theirs.len()
                    && mine
                        .iter()
                        .zip(theirs)
                        .all(|(a, b)| a.k.is_same_view(&b.k) && a.v.is_same_view(&b.v))
            }
            (Caches::V2(Some(set)), Held::V2(Some(pin))) => Arc::ptr_eq(set, pin.set()),
            (Caches::V2(None), Held::V2(None)) => true,
            _ => false,
        }
    }
}

/// The caches at one position. Clones retain the device buffers; nothing is copied.
#[derive(Clone)]
pub struct IreeSnapshot {
    session: SessionId,
    position: usize,
    held: Held,
    top_k: Option<TopKViews>,
}

impl IreeSnapshot {
    pub fn position(&self) -> usize {
        self.position
    }
}

/// Which function of a graph a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    /// The graph's own function.
    Own,
    /// The prefill graph's token-less variant over that span (`V2Spec::prefill_spans`): its
    /// results are the prefill's but the token and top-k.
    Span(usize),
    /// The chunk graph's variant over `smallChunk` rows (`V2Spec::small_chunk`): the chunk
    /// graph's arguments and results over fewer rows.
    SmallChunk,
    /// The small chunk graph's variant over `smallChunkSpan` rows of each cache
    /// (`V2Spec::small_chunk_span`): the small graph's arguments (the caches' first rows) and
    /// results.
    SmallChunkSpan,
}

/// A KV-cache session: prefill, chunk and step graphs on one device.
///
/// Calls take `&mut self`: they replace the per-layer caches and run IREE invocations, which
/// must not be concurrent on one context.
///
/// **The artifacts must not change while the session is open.** The `.irpa` archives are
/// memory-mapped (by IREE for the weights, by [`Embedding`] for the host gather): reading a
/// mapping whose file was truncated raises SIGBUS, which kills the process. Replace archives by
/// renaming a new file over the old one, then open a new session. Each call first checks every
/// archive's length, mtime, device and inode against those at open and fails with
/// [`kv_core::irpa::IrpaError::Changed`] instead of reading a changed file (a check, not a lock:
/// a truncation racing the call itself is not caught).
pub struct IreeKvBackend {
    id: SessionId,
    manifest: Manifest,
    options: IreeOptions,
    device: Device,
    sessions: Vec<Option<Arc<SharedModule>>>,
    /// Each session's parameter archive as it was at open (checked before each call).
    archives: Vec<Vec<FileStamp>>,
    functions: HashMap<Graph, (usize, Function)>,
    /// Contract v2: the prefill graph's token-less variants by span (`V2Spec::prefill_spans`),
    /// in the prefill graph's session.
    spans: Vec<(usize, Function)>,
    /// Contract v2: the chunk graph's variant over `smallChunk` rows (`V2Spec::small_chunk`).
    small: Option<Function>,
    /// Contract v2: the small chunk graph's variant over `smallChunkSpan` rows of each cache
    /// (`V2Spec::small_chunk_span`).
    small_span: Option<Function>,
    args: HashMap<Graph, Vec<Name>>,
    outputs: HashMap<Graph, Vec<Name>>,
    embedding: Embedding,
    target: String,
    /// Whether `release_prefill` removed the prefill graph (for the error of a later prefill).
    prefill_released: bool,
    caches: Caches,
    /// Contract v2: a set no snapshot holds, released by the last prefill or restore, that the
    /// next prefill takes up instead of allocating and zeroing one (`v2::CacheSet::reuse`);
    /// dropped with the prefill graph (`release_prefill`).
    spare: Option<v2::CacheSet>,
    position: usize,
    /// The top-k results of the last call, when the graphs have them (`Manifest::top_k`).
    last_top_k: Option<TopKViews>,
    /// Time of every call by phase since open (`inputs` unused); a step moves its share into
    /// `steps`.
    clock: StepPhases,
    /// The steps' phases since the last `take_step_phases`.
    steps: StepPhases,
    /// One-element host-mappable buffers a token is copied into (`Self::readback_slot`).
    readbacks: [Option<BufferView>; 2],
    /// The step module's `embed_token` (`Manifest::embed_function`), where it is async: greedy
    /// decoding then runs a step ahead of the host (`greedy`).
    embed: Option<Function>,
    /// Contract v2 with `allowedMask`: the mask every call takes (`Name::Allowed`), `all` while
    /// no restriction is set.
    mask: Option<v2::Mask>,
    /// The device profile being recorded (`begin_device_profile`), ended at drop at the latest.
    profiling: Option<Profiling>,
    /// The storage of each function that takes it from the caller (`storage`), by name.
    storage: HashMap<String, storage::StorageRing>,
}

impl IreeKvBackend {
    /// Opens the prefill, chunk and step graphs of the artifact directory `dir`.
    pub fn open(dir: &Path, options: IreeOptions) -> Result<Self> {
        Self::open_manifest(dir, Manifest::load(dir)?, options)
    }

    /// Opens the graphs a manifest built in memory names (the JNI's `nativeCreate` passes each
    /// graph's vmfb, archive and function explicitly); relative file names resolve against `dir`.
    /// A manifest without a prefill module opens without the prefill graph (`prefill` then fails).
    pub fn open_manifest(dir: &Path, manifest: Manifest, options: IreeOptions) -> Result<Self> {
        manifest.validate()?;
        let opened = open_graphs(dir, &manifest, manifest.kv_graphs(), &options)?;
        Self::from_opened(dir, manifest, options, opened)
    }

    /// As [`Self::open_manifest`] for a v1 manifest built without knowing the artifacts (the
    /// seed's JNI `nativeCreate` is told neither the contract nor SEQ): the contract is read from
    /// the step function's declared arguments (v2's third argument is `pos [1]`, v1's a RoPE
    /// table `[1, d]`), and with it
    /// - v1: `seq` from the prefill function's declared `tokens` shape (without a prefill module
    ///   the manifest's `seq` stays);
    /// - v2: `maxPositions` from a global layer's declared cache shape `[P, nKV, d]`, a sliding
    ///   layer's ring rows from its own, and `seq` = `P` (a prefill is chunk calls, as long as
    ///   the caches hold). The seed's ABI has no slot for v2's prefill graph (a chunk graph of
    ///   more rows): a prefill module passed with v2 graphs is refused.
    pub fn open_manifest_learning_seq(dir: &Path, mut manifest: Manifest, options: IreeOptions) -> Result<Self> {
        manifest.validate()?;
        let mut opened = open_sessions(dir, &manifest, manifest.kv_graphs(), &options)?;
        // A graph's function name and the dims and element type it declares for argument `name`.
        let declared = |opened: &Opened, graph: Graph, name: Name, manifest: &Manifest| {
            let (_, function) = opened.functions.get(&graph)?;
            let index = manifest.canonical_args(graph).iter().position(|&a| a == name)?;
            Some((function.name.clone(), declared_input(function, index)))
        };
        let step_pos = declared(&opened, Graph::Step, Name::Cos(manifest.spec.layer_kind(0)), &manifest);
        if let Some((_, Some((dims, _)))) = &step_pos {
            if dims.as_slice() == [Some(1)] {
                if let Some((_, prefill)) = opened.functions.get(&Graph::Prefill) {
                    return Err(contract_err(
                        "open",
                        format!(
                            "the step and chunk graphs are contract v2, which has no prefill graph; pass no prefill module (got {})",
                            prefill.name
                        ),
                    ));
                }
                // The ring's rows are learned below; the seed's ABI has no prefill graph.
                manifest = manifest.into_v2(V2Spec::default());
                let rows_of = |layer: usize, manifest: &Manifest| -> Result<usize> {
                    match declared(&opened, Graph::Step, Name::K(layer), manifest) {
                        Some((_, Some((dims, _)))) => match dims.as_slice() {
                            &[Some(p), Some(kv), Some(d)]
                                if kv == manifest.spec.n_kv_heads && d == manifest.spec.head_dim =>
                            {
                                Ok(p)
                            }
                            other => Err(contract_err(
                                "open",
                                format!("a v2 step's cache is declared {other:?}, expected [P, nKvHeads, headDim]"),
                            )),
                        },
                        _ => Err(contract_err("open", "cannot read the v2 step's declared cache shape")),
                    }
                };
                // Global layers hold every position; sliding ones may read a view of theirs.
                let spec = &manifest.spec;
                let global = spec.first_layer_of(LayerKind::Global).ok_or_else(|| {
                    contract_err(
                        "open",
                        "a v2 step without a global layer does not declare its cache capacity",
                    )
                })?;
                let capacity = rows_of(global, &manifest)?;
                // The caches' element type, as the step declares them (`cacheType`).
                let element = declared(&opened, Graph::Step, Name::K(global), &manifest)
                    .and_then(|(_, input)| input)
                    .map(|(_, element)| element);
                manifest.cache_type = match element.as_deref() {
                    Some("f32") => CacheType::F32,
                    Some("f16") => CacheType::F16,
                    other => {
                        return Err(contract_err(
                            "open",
                            format!("a v2 step's cache is declared of element type {other:?}, expected f32 or f16"),
                        ))
                    }
                };
                let sliding = match spec.first_layer_of(LayerKind::Sliding) {
                    Some(l) => rows_of(l, &manifest)?,
                    None => capacity,
                };
                if let Some(layout) = manifest.contract.v2_mut() {
                    layout.sliding_cache_rows = if sliding == capacity { 0 } else { sliding };
                }
                manifest.spec.max_positions = capacity;
                manifest.spec.seq = capacity;
                // Exports with the allowed-token mask take it last (`allowedMask`); the seed's
                // ABI never sets one, so these sessions pass the resident all-ones mask.
                if let Some((_, step)) = opened.functions.get(&Graph::Step) {
                    let n = manifest.canonical_args(Graph::Step).len();
                    let words = AllowedTokens::words_for(manifest.spec.vocab_size);
                    if step.argument_count() == n + 1
                        && declared_input(step, n) == Some((vec![Some(words)], "i32".to_string()))
                    {
                        manifest.set_allowed_mask(true);
                    }
                }
                manifest.validate()?;
            }
        }
        if let Some((name, input)) = declared(&opened, Graph::Prefill, Name::Tokens, &manifest) {
            let seq = match input.as_ref().map(|(dims, _)| dims.as_slice()) {
                Some(&[Some(seq)]) => seq,
                other => {
                    return Err(contract_err(
                        "prefill",
                        format!(
                            "cannot learn SEQ from {name}: its `tokens` argument is declared {other:?}, expected one fixed dimension"
                        ),
                    ))
                }
            };
            manifest.spec.seq = seq;
            manifest.spec.max_positions = manifest.spec.max_positions.max(seq);
            manifest.validate()?;
        }
        opened.functions.retain(|g, _| manifest.kv_graphs().contains(g));
        check_arg_counts(&manifest, &opened)?;
        Self::from_opened(dir, manifest, options, opened)
    }

    fn from_opened(dir: &Path, manifest: Manifest, options: IreeOptions, opened: Opened) -> Result<Self> {
        let Opened {
            device,
            sessions,
            archives,
            functions,
            spans,
            small,
            small_span,
            target,
        } = opened;
        // The seed reads the table from the with-past archive; its key there is `embeddingParameter`.
        let archive = manifest
            .parameter_file(Graph::Step)
            .ok_or_else(|| Error::manifest("parameters", "no archive for `withPast`"))?;
        let archive = dir.join(archive);
        let step_vmfb = manifest.modules.get(&target).and_then(|m| m.get(Graph::Step.key()));
        let embedding = match (&manifest.embedding_parameter, step_vmfb) {
            (Some(name), _) => Embedding::open(&archive, Some(name), &manifest.spec)?,
            // Seed artifacts (the JNI's in-memory manifest) do not name the table.
            (None, Some(vmfb)) => Embedding::open_beside(&archive, &dir.join(vmfb), &manifest.spec)?,
            (None, None) => Embedding::open(&archive, None, &manifest.spec)?,
        };
        let embed = match (&manifest.embed_function, functions.get(&Graph::Step)) {
            (Some(name), Some((index, _))) => {
                let session = sessions[*index]
                    .as_ref()
                    .unwrap_or_else(|| kv_core::error::invariant("the step graph's session at open"));
                let function = session.lock().lookup(name).map_err(|e| {
                    contract_err(
                        "embedFunction",
                        format!("the manifest names `{name}`, which the step graph's module does not hold: {e}"),
                    )
                })?;
                function.is_async().then_some(function)
            }
            _ => None,
        };
        let args = manifest
            .kv_graphs()
            .iter()
            .map(|&g| (g, manifest.args_or_canonical(g)))
            .collect();
        let outputs = manifest
            .kv_graphs()
            .iter()
            .map(|&g| (g, manifest.outputs_or_canonical(g)))
            .collect();
        let caches = Caches::empty(&manifest);
        let mut backend = IreeKvBackend {
            id: SessionId::fresh(),
            manifest,
            options,
            device,
            sessions,
            archives,
            functions,
            spans,
            small,
            small_span,
            args,
            outputs,
            embedding,
            target,
            prefill_released: false,
            caches,
            spare: None,
            position: 0,
            last_top_k: None,
            clock: StepPhases::default(),
            steps: StepPhases::default(),
            readbacks: [None, None],
            embed,
            mask: None,
            profiling: None,
            storage: HashMap::new(),
        };
        if backend.manifest.is_v2() {
            backend.v2_check_rule()?;
            backend.mask = v2::Mask::resident(&backend.device, &backend.manifest)?;
        }
        Ok(backend)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The `modules` key this session runs (`llvm-cpu`, `vulkan`, ...).
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Releases the prefill graph, whatever the layout: later `prefill` calls fail with an error
    /// that says so (restore a snapshot and continue with chunk and step calls). Its session is
    /// dropped when no other graph uses it (the seed's three-archive layout: its module and
    /// weights are freed once the prefix snapshot exists); in one shared module nothing can be
    /// freed. Returns whether a session was freed.
    pub fn release_prefill(&mut self) -> bool {
        if let Caches::V2(_) = self.caches {
            // No prefill graph: prefills are chunk calls, refused from now on all the same.
            self.prefill_released = true;
            self.spare = None;
            return false;
        }
        let Some((index, _)) = self.functions.remove(&Graph::Prefill) else {
            return false;
        };
        self.prefill_released = true;
        let shared = self.functions.values().any(|&(i, _)| i == index);
        !shared && self.sessions[index].take().is_some()
    }

    /// The error for a graph this session does not have (only the prefill graph can be missing).
    fn missing(&self, graph: Graph) -> Error {
        Error::GraphUnavailable {
            backend: "iree",
            op: graph.key(),
            reason: match self.prefill_released {
                true => "the prefill graph was released (release_prefill); restore a snapshot and continue with chunk and step calls",
                false => "this session was opened without a prefill module; restore a snapshot and continue with chunk and step calls",
            },
        }
    }

    fn f32_view(&self, shape: &[usize], data: &[f32]) -> Result<BufferView> {
        BufferView::from_f32(&self.device, shape, data).map_err(iree_err("upload f32 input"))
    }

    fn i32_view(&self, shape: &[usize], data: &[i32]) -> Result<BufferView> {
        BufferView::from_i32(&self.device, shape, data).map_err(iree_err("upload i32 input"))
    }

    /// Calls `graph` with its arguments bound by manifest name; checks every result's shape and
    /// type; returns the results by name.
    fn call(
        &mut self,
        graph: Graph,
        inputs: HashMap<Name, BufferView>,
        expect: &dyn Fn(Name) -> (Vec<usize>, ElementType),
    ) -> Result<HashMap<Name, BufferView>> {
        self.call_variant(graph, Variant::Own, inputs, expect)
    }

    /// [`Self::call`] of `graph`'s own function or of one of its variants ([`Variant`]).
    fn call_variant(
        &mut self,
        graph: Graph,
        variant: Variant,
        mut inputs: HashMap<Name, BufferView>,
        expect: &dyn Fn(Name) -> (Vec<usize>, ElementType),
    ) -> Result<HashMap<Name, BufferView>> {
        let (index, own) = self.functions.get(&graph).ok_or_else(|| self.missing(graph))?;
        let function = match variant {
            Variant::Own => own,
            Variant::Span(span) => match self.spans.iter().find(|(s, _)| *s == span) {
                Some((_, f)) => f,
                None => kv_core::error::invariant("a prefill variant the session did not open"),
            },
            Variant::SmallChunk => match &self.small {
                Some(f) => f,
                None => kv_core::error::invariant("a small chunk graph the session did not open"),
            },
            Variant::SmallChunkSpan => match &self.small_span {
                Some(f) => f,
                None => kv_core::error::invariant("a small chunk graph's span variant the session did not open"),
            },
        };
        let span = match variant {
            Variant::Span(span) => Some(span),
            _ => None,
        };
        let ordered: Vec<BufferView> = self.args[&graph]
            .iter()
            .map(|name| {
                inputs
                    .remove(name)
                    .ok_or_else(|| contract_err(graph.key(), format!("no value for argument `{name}`")))
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&BufferView> = ordered.iter().collect();
        for archive in &self.archives[*index] {
            archive.check()?;
        }
        let session = self.sessions[*index]
            .as_ref()
            .unwrap_or_else(|| kv_core::error::invariant("function of a released session"));
        // Contract v1 keeps results (its caches) across calls: those get fresh storage a call.
        let storage = match &self.caches {
            Caches::V2(_) => {
                let keep: Vec<&BufferView> = self.last_top_k.iter().map(|top| &top.logits).collect();
                storage::next_set(&mut self.storage, &self.device, function, &keep)?
            }
            Caches::V1(_) => None,
        };
        let t = Instant::now();
        let results = match &storage {
            Some(set) => session.lock().call_function_with(function, &refs, Some(set)),
            None => session.lock().call_function(function, &refs),
        };
        self.clock.invoke += t.elapsed();
        let results = results.map_err(iree_err(format!("call {}", function.name)))?;
        let names: Vec<Name> = self.outputs[&graph]
            .iter()
            .copied()
            .filter(|n| span.is_none() || !n.from_head())
            .collect();
        if results.len() != names.len() {
            return Err(contract_err(
                graph.key(),
                format!(
                    "{} returned {} results, the contract has {}",
                    function.name,
                    results.len(),
                    names.len()
                ),
            ));
        }
        let mut out = HashMap::with_capacity(names.len());
        for (name, view) in names.iter().zip(results) {
            let k = self.manifest.top_k.unwrap_or(0);
            let (shape, element) = match name {
                Name::TopKLogits => (vec![k], ElementType::F32),
                Name::TopKIds => (vec![k], ElementType::I32),
                _ => expect(*name),
            };
            if view.shape() != shape || view.element_type() != element {
                return Err(contract_err(
                    graph.key(),
                    format!(
                        "result `{name}` of {} is {:?} {:?}, the contract says {:?} {:?}: a vmfb of another contract?",
                        function.name,
                        view.element_type(),
                        view.shape(),
                        element,
                        shape
                    ),
                ));
            }
            out.insert(*name, view);
        }
        Ok(out)
    }

    /// The session's one-element, host-mappable buffer `slot` (0 or 1) a token is copied into
    /// ([`Self::submit_and_read_token`] reads through slot 0); made at its first use.
    fn readback_slot(&mut self, slot: usize) -> Result<BufferView> {
        if let Some(r) = &self.readbacks[slot] {
            return Ok(r.clone());
        }
        let r = self.i32_view(&[1], &[0])?;
        if !r.is_mappable() {
            kv_core::error::invariant("a small input the host cannot map");
        }
        self.readbacks[slot] = Some(r.clone());
        Ok(r)
    }

    /// Submits `ops` (contract 2's row writes, or nothing) and reads `token`: where it lies
    /// when the host can map it (a CPU device), else copied into `readback` by the same
    /// submission. On the H200 over Vulkan the host read IREE offers
    /// (`iree_hal_device_transfer_d2h`: a staging buffer of its own, a submission and a wait
    /// of its own) cost 1.1–1.3 ms a step.
    fn submit_and_read_token<'a>(
        &self,
        token: &'a BufferView,
        readback: &'a BufferView,
        mut ops: Vec<Transfer<'a>>,
    ) -> Result<i32> {
        let source = if token.is_mappable() {
            token
        } else {
            ops.push(Transfer::Copy {
                source: token,
                source_offset: 0,
                target: readback,
                target_offset: 0,
                length: 4,
            });
            readback
        };
        self.device
            .transfer(&ops)
            .map_err(iree_err("write the new rows and read the token"))?;
        Ok(source.to_i32_vec().map_err(iree_err("read token"))?[0])
    }

    /// The call's token alone ([`Self::submit_and_read_token`] with nothing else to submit).
    fn read_token(&mut self, results: &HashMap<Name, BufferView>) -> Result<i32> {
        let readback = self.readback_slot(0)?;
        let t = Instant::now();
        let token = self.submit_and_read_token(&results[&Name::Token], &readback, Vec::new());
        self.clock.read += t.elapsed();
        token
    }

    /// The last top-k results as a snapshot keeps them: copied (on the queue) out of a step's
    /// storage, which a later step overwrites (`storage`), else the views themselves.
    fn owned_top_k(&self) -> Result<Option<TopKViews>> {
        let Some(top) = &self.last_top_k else {
            return Ok(None);
        };
        if !self
            .storage
            .values()
            .any(|ring| ring.holds(&top.logits) || ring.holds(&top.ids))
        {
            return Ok(Some(top.clone()));
        }
        let copy = |view: &BufferView| {
            BufferView::allocate(&self.device, &view.shape(), view.element_type())
                .map_err(iree_err("allocate a snapshot's top-k"))
        };
        let (logits, ids) = (copy(&top.logits)?, copy(&top.ids)?);
        fn whole<'a>(source: &'a BufferView, target: &'a BufferView) -> Transfer<'a> {
            Transfer::Copy {
                source,
                source_offset: 0,
                target,
                target_offset: 0,
                length: source.byte_length(),
            }
        }
        // Not waited for: a read of these views (`last_top_k`) waits for what was queued.
        let _copied = (self.device)
            .transfer_queued(&[whole(&top.logits, &logits), whole(&top.ids, &ids)])
            .map_err(iree_err("copy a snapshot's top-k"))?;
        Ok(Some(TopKViews { logits, ids }))
    }

    /// A call's top-k results (views; nothing is read from the device here).
    fn top_k_views(results: &HashMap<Name, BufferView>) -> Option<TopKViews> {
        Some(TopKViews {
            logits: results.get(&Name::TopKLogits)?.clone(),
            ids: results.get(&Name::TopKIds)?.clone(),
        })
    }

    /// The last `past` rows of a layer's cache.
    fn tail(cache: &LayerCache, past: usize) -> Result<(BufferView, BufferView)> {
        if past == cache.rows {
            return Ok((cache.k.clone(), cache.v.clone()));
        }
        if past > cache.rows {
            kv_core::error::invariant("a layer holds fewer rows than the window plan needs");
        }
        let r0 = cache.rows - past;
        let k = cache.k.rows(r0, cache.rows).map_err(iree_err("take window rows"))?;
        let v = cache.v.rows(r0, cache.rows).map_err(iree_err("take window rows"))?;
        Ok((k, v))
    }

    fn kind_inputs(
        &self,
        inputs: &mut HashMap<Name, BufferView>,
        kinds: &[KindInputs],
        rows: usize,
        with_mask: bool,
    ) -> Result<()> {
        let spec = &self.manifest.spec;
        for k in kinds {
            inputs.insert(Name::Cos(k.kind), self.f32_view(&[rows, spec.head_dim], &k.rope.cos)?);
            inputs.insert(Name::Sin(k.kind), self.f32_view(&[rows, spec.head_dim], &k.rope.sin)?);
            if with_mask {
                let shape = [1, spec.mask_head_count(), rows, k.past + rows];
                inputs.insert(Name::Mask(k.kind), self.f32_view(&shape, &k.mask)?);
            }
        }
        Ok(())
    }

    /// [`KvBackend::step`] without its timing.
    fn step_inner(&mut self, token: i32) -> Result<i32> {
        let spec = self.manifest.spec.clone();
        // A v2 session runs the exact rule only (refused otherwise at open).
        let plan = plan_step(&spec, self.position, token, self.options.rule)?;
        let mut inputs = HashMap::new();
        inputs.insert(Name::Token, self.i32_view(&[1], &[token])?);
        inputs.insert(
            Name::Emb,
            self.f32_view(&[1, spec.hidden_size], &self.embedding.gather(&[token])?)?,
        );
        self.kind_inputs(&mut inputs, &plan.kinds, 1, false)?;
        match self.caches {
            Caches::V1(_) => {
                let pasts: Vec<usize> = (0..spec.n_layers).map(|l| plan.kind(spec.layer_kind(l)).past).collect();
                self.advance(Graph::Step, inputs, &pasts, 1, 1)
            }
            Caches::V2(_) => self.v2_advance(Graph::Step, inputs, 1, 1),
        }
    }

    /// Contract v1's layer caches; only v1 paths ask.
    fn v1_layers(&self) -> &[LayerCache] {
        match &self.caches {
            Caches::V1(layers) => layers,
            Caches::V2(_) => kv_core::error::invariant("a contract v1 path in a v2 session"),
        }
    }

    fn kv_shape(spec: &KvSpec, rows: usize) -> (Vec<usize>, ElementType) {
        (vec![1, spec.n_kv_heads, rows, spec.head_dim], ElementType::F32)
    }
}

impl KvBackend for IreeKvBackend {
    type Snapshot = IreeSnapshot;

    fn spec(&self) -> &KvSpec {
        &self.manifest.spec
    }

    fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        if let Caches::V2(_) = self.caches {
            return self.v2_prefill(tokens);
        }
        let spec = self.manifest.spec.clone();
        // Whatever the route, a session without the prefill graph (released, or opened without
        // it) refuses prefills, as the seed does: one behaviour for every layout.
        if !self.functions.contains_key(&Graph::Prefill) {
            return Err(self.missing(Graph::Prefill));
        }
        if self.options.prefill.by_chunks(tokens.len(), spec.chunk) {
            return self.prefill_by_chunks(tokens);
        }
        let plan = plan_prefill(&spec, tokens)?;
        let inputs = self.token_inputs(&plan.tokens, &plan.select)?;
        let results = self.call(Graph::Prefill, inputs, &|name| match name {
            Name::Token => (vec![1], ElementType::I32),
            _ => Self::kv_shape(&spec, spec.seq),
        })?;
        let token = self.read_token(&results)?;
        self.caches = Caches::V1(
            (0..spec.n_layers)
                .map(|l| Self::kept(&results, l, 0, spec.seq, plan.n))
                .collect::<Result<_>>()?,
        );
        self.position = plan.n;
        self.last_top_k = Self::top_k_views(&results);
        Ok(token)
    }

    fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        match self.caches {
            Caches::V1(_) => {
                let plan = plan_chunk(&self.manifest.spec, self.position, tokens)?;
                self.run_chunk(&plan)
            }
            Caches::V2(_) => self.v2_chunk(tokens),
        }
    }

    fn step(&mut self, token: i32) -> Result<i32> {
        let (start, before) = (Instant::now(), self.clock);
        let result = self.step_inner(token);
        self.count_steps(1, start, before);
        result
    }

    fn step_greedy(&mut self, token: i32, max: usize, more: &mut dyn FnMut(i32) -> bool) -> Result<usize> {
        if self.runs_ahead() {
            self.step_greedy_ahead(token, max, more)
        } else {
            kv_core::backend::step_greedy_serially(self, token, max, more)
        }
    }

    fn take_step_phases(&mut self) -> Option<StepPhases> {
        Some(std::mem::take(&mut self.steps))
    }

    fn begin_device_profile(&mut self, path: &Path) -> Result<()> {
        // One recording at a time per device: the earlier one's file is completed first.
        self.end_device_profile()?;
        let profiling = Profiling::dispatches(&self.device, path)
            .map_err(iree_err(format!("begin a device profile into {}", path.display())))?;
        self.profiling = Some(profiling);
        Ok(())
    }

    fn end_device_profile(&mut self) -> Result<()> {
        match self.profiling.take() {
            Some(p) => p.end().map_err(iree_err("end the device profile")),
            None => Ok(()),
        }
    }

    fn snapshot(&self) -> Result<IreeSnapshot> {
        Ok(IreeSnapshot {
            session: self.id,
            position: self.position,
            held: self.caches.hold(self.position),
            top_k: self.owned_top_k()?,
        })
    }

    fn restore(&mut self, snapshot: &IreeSnapshot) -> Result<()> {
        self.id.check_owner(snapshot.session)?;
        let released = std::mem::replace(&mut self.caches, Caches::from_held(&snapshot.held));
        self.v2_keep_spare(released);
        self.position = snapshot.position;
        self.last_top_k = snapshot.top_k.clone();
        Ok(())
    }

    fn snapshot_position(&self, snapshot: &IreeSnapshot) -> usize {
        snapshot.position
    }

    fn position(&self) -> usize {
        self.position
    }

    fn read_layer(&self, layer: usize) -> Result<LayerKv> {
        let spec = &self.manifest.spec;
        if layer >= spec.n_layers {
            return Err(Error::LayerOutOfRange {
                layer,
                n_layers: spec.n_layers,
            });
        }
        match &self.caches {
            Caches::V1(layers) => match layers.get(layer) {
                Some(cache) => cache.to_host(spec),
                None => Ok(LayerKv::empty(spec)),
            },
            Caches::V2(set) => self.v2_read_layer(set.as_ref(), layer, self.position),
        }
    }

    fn top_k_capacity(&self) -> Option<usize> {
        self.manifest.top_k
    }

    /// Reads the last call's `k`-entry results from the device (two small transfers).
    fn last_top_k(&self, k: usize) -> Result<Option<TopK>> {
        let Some(views) = &self.last_top_k else {
            return Ok(None);
        };
        if self.manifest.top_k.is_none_or(|have| have < k) {
            return Ok(None);
        }
        let logits = views.logits.to_f32_vec().map_err(iree_err("read topk.logits"))?;
        let ids = views.ids.to_i32_vec().map_err(iree_err("read topk.ids"))?;
        let top = TopK::from_pairs(&ids, &logits)
            .unwrap_or_else(|| kv_core::error::invariant("top-k results of checked equal shapes"));
        Ok(Some(top.truncated(k)))
    }

    /// Contract v2 exports with `allowedMask`: the words are uploaded once per change (an
    /// all-allowed set or `None` goes back to the resident all-ones buffer, no upload). Each
    /// mask is a buffer of its own, never written after its upload, so a step queued ahead
    /// (`step_greedy`) keeps reading the mask it was queued with.
    fn set_allowed(&mut self, allowed: Option<&AllowedTokens>) -> Result<()> {
        self.v2_set_allowed(allowed)
    }

    fn name(&self) -> String {
        format!("iree-{}", self.options.device)
    }
}

impl IreeKvBackend {
    /// Whether this session's caches are `snapshot`'s device views themselves (what a restore
    /// leaves behind), not copies of them.
    pub fn holds_views_of(&self, snapshot: &IreeSnapshot) -> bool {
        self.caches.are(&snapshot.held)
    }
}

impl IreeKvBackend {
    fn run_chunk(&mut self, plan: &ChunkPlan) -> Result<i32> {
        let spec = self.manifest.spec.clone();
        let inputs = self.chunk_inputs(plan)?;
        let pasts: Vec<usize> = (0..spec.n_layers).map(|l| plan.kind(spec.layer_kind(l)).past).collect();
        self.advance(Graph::Chunk, inputs, &pasts, spec.chunk, plan.n)
    }

    /// A chunk call's inputs but the caches (and `pos`: v2 graphs take no masks but the position).
    fn chunk_inputs(&self, plan: &ChunkPlan) -> Result<HashMap<Name, BufferView>> {
        let mut inputs = self.token_inputs(&plan.tokens, &plan.select)?;
        let masks = !self.manifest.is_v2();
        self.kind_inputs(&mut inputs, &plan.kinds, plan.tokens.len(), masks)?;
        Ok(inputs)
    }

    /// `tokens`, their gathered `emb` rows and the one-hot `select` of a many-row call (prefill
    /// or chunk: as many rows as `tokens`, padding included).
    fn token_inputs(&self, tokens: &[i32], select: &[f32]) -> Result<HashMap<Name, BufferView>> {
        let rows = tokens.len();
        let mut inputs = HashMap::new();
        inputs.insert(Name::Tokens, self.i32_view(&[rows], tokens)?);
        inputs.insert(
            Name::Emb,
            self.f32_view(&[rows, self.manifest.spec.hidden_size], &self.embedding.gather(tokens)?)?,
        );
        inputs.insert(Name::Select, self.f32_view(&[1, rows], select)?);
        Ok(inputs)
    }

    /// A prefill as chunk calls from an empty cache ([`crate::PrefillRoute`]). The session's
    /// caches are put back if any call fails, so an error leaves it as it was.
    fn prefill_by_chunks(&mut self, tokens: &[i32]) -> Result<i32> {
        let plans = plan_chunked_prefill(&self.manifest.spec, tokens)?;
        let empty = Caches::V1(Vec::new());
        let before = (
            std::mem::replace(&mut self.caches, empty),
            self.position,
            self.last_top_k.clone(),
        );
        self.position = 0;
        let result = self
            .first_chunk(&plans[0])
            .and_then(|first| plans[1..].iter().try_fold(first, |_, plan| self.run_chunk(plan)));
        if result.is_err() {
            (self.caches, self.position, self.last_top_k) = before;
        }
        result
    }

    /// The first chunk of a prefill, at position 0 with no past. Vulkan refuses a dispatch
    /// bound to an empty buffer, so every layer is handed one row of zeros whose mask column is
    /// masked for every query: its softmax weight is exactly 0 (exp(-1e30) underflows), so the
    /// results equal a call without it. The row is dropped from the kept cache.
    fn first_chunk(&mut self, plan: &ChunkPlan) -> Result<i32> {
        let spec = self.manifest.spec.clone();
        let heads = spec.mask_head_count();
        let mut widened = plan.clone();
        for kind in &mut widened.kinds {
            debug_assert_eq!(kind.past, 0);
            kind.past = 1;
            kind.mask = kind
                .mask
                .chunks(spec.chunk)
                .flat_map(|row| std::iter::once(kv_core::mask::MASKED).chain(row.iter().copied()))
                .collect();
            debug_assert_eq!(kind.mask.len(), heads * spec.chunk * (spec.chunk + 1));
        }
        let zero = self.f32_view(
            &[1, spec.n_kv_heads, 1, spec.head_dim],
            &vec![0.0; spec.n_kv_heads * spec.head_dim],
        )?;
        let mut inputs = self.chunk_inputs(&widened)?;
        for l in 0..spec.n_layers {
            inputs.insert(Name::K(l), zero.clone());
            inputs.insert(Name::V(l), zero.clone());
        }
        let results = self.call(Graph::Chunk, inputs, &|name| match name {
            Name::Token => (vec![1], ElementType::I32),
            _ => Self::kv_shape(&spec, 1 + spec.chunk),
        })?;
        let token = self.read_token(&results)?;
        let layers = (0..spec.n_layers)
            .map(|l| {
                let (k, v) = (&results[&Name::K(l)], &results[&Name::V(l)]);
                Ok(LayerCache {
                    k: k.rows(1, 1 + plan.n).map_err(iree_err("drop the placeholder row"))?,
                    v: v.rows(1, 1 + plan.n).map_err(iree_err("drop the placeholder row"))?,
                    first: 0,
                    rows: plan.n,
                })
            })
            .collect::<Result<_>>()?;
        self.caches = Caches::V1(layers);
        self.position = plan.n;
        self.last_top_k = Self::top_k_views(&results);
        Ok(token)
    }

    /// Runs a with-past graph: hands layer `l` the last `pasts[l]` rows of its cache, calls
    /// `graph` on `rows` new rows of which `real` are kept, and advances the position by `real`.
    /// The caches are replaced only after every result checked out.
    fn advance(
        &mut self,
        graph: Graph,
        inputs: HashMap<Name, BufferView>,
        pasts: &[usize],
        rows: usize,
        real: usize,
    ) -> Result<i32> {
        let layers = self.v1_layers().to_vec();
        let (results, layers) = self.call_after(graph, inputs, &layers, self.position, pasts, rows, real)?;
        let token = self.read_token(&results)?;
        self.caches = Caches::V1(layers);
        self.position += real;
        self.last_top_k = Self::top_k_views(&results);
        Ok(token)
    }

    /// Calls with-past `graph` at `position` over `layers` (layer `l` handing its last
    /// `pasts[l]` rows) on `rows` new rows of which `real` are kept: the results and the caches
    /// after the call. Changes nothing of the session's.
    #[allow(clippy::too_many_arguments)]
    fn call_after(
        &mut self,
        graph: Graph,
        mut inputs: HashMap<Name, BufferView>,
        layers: &[LayerCache],
        position: usize,
        pasts: &[usize],
        rows: usize,
        real: usize,
    ) -> Result<(HashMap<Name, BufferView>, Vec<LayerCache>)> {
        let spec = self.manifest.spec.clone();
        for (l, cache) in layers.iter().enumerate() {
            let (k, v) = Self::tail(cache, pasts[l])?;
            inputs.insert(Name::K(l), k);
            inputs.insert(Name::V(l), v);
        }
        let results = self.call(graph, inputs, &|name| match name {
            Name::Token => (vec![1], ElementType::I32),
            Name::K(l) | Name::V(l) if l < pasts.len() => Self::kv_shape(&spec, pasts[l] + rows),
            _ => (vec![], ElementType::F32),
        })?;
        let layers = (0..spec.n_layers)
            .map(|l| Self::kept(&results, l, position - pasts[l], pasts[l] + rows, pasts[l] + real))
            .collect::<Result<_>>()?;
        Ok((results, layers))
    }

    /// Moves the phases of the steps run since `before` (the clock then) and `started` into
    /// the step sums: what the clock did not time is the inputs' share.
    fn count_steps(&mut self, steps: usize, started: Instant, before: StepPhases) {
        let c = self.clock;
        let (invoke, read, writes) = (c.invoke - before.invoke, c.read - before.read, c.writes - before.writes);
        self.steps.steps += steps as u32;
        self.steps.inputs += started.elapsed().saturating_sub(invoke + read + writes);
        self.steps.invoke += invoke;
        self.steps.read += read;
        self.steps.writes += writes;
    }

    /// Layer `l`'s new cache from a call's results: the first `keep` of `total` rows (padding
    /// rows of a fixed-size call are dropped by a view).
    fn kept(
        results: &HashMap<Name, BufferView>,
        l: usize,
        first: usize,
        total: usize,
        keep: usize,
    ) -> Result<LayerCache> {
        let (k, v) = (&results[&Name::K(l)], &results[&Name::V(l)]);
        let (k, v) = if keep == total {
            (k.clone(), v.clone())
        } else {
            (
                k.rows(0, keep).map_err(iree_err("trim padding rows"))?,
                v.rows(0, keep).map_err(iree_err("trim padding rows"))?,
            )
        };
        Ok(LayerCache {
            k,
            v,
            first,
            rows: keep,
        })
    }
}

impl PersistSnapshot for IreeKvBackend {
    fn model_fingerprint(&self) -> Result<ModelFingerprint> {
        ModelFingerprint::compute(&self.manifest.spec, |ids| self.embedding.gather(ids))
    }

    fn window_rule(&self) -> WindowRule {
        self.options.rule
    }

    /// Copies every layer's rows to the host (one read per buffer).
    fn snapshot_layer(&self, snapshot: &IreeSnapshot, layer: usize) -> Result<LayerKv> {
        self.id.check_owner(snapshot.session)?;
        let spec = &self.manifest.spec;
        if layer >= spec.n_layers {
            return Err(contract_err(
                "save snapshot",
                format!("no layer {layer} in a model of {}", spec.n_layers),
            ));
        }
        match &snapshot.held {
            Held::V1(layers) => match layers.get(layer) {
                Some(cache) => cache.to_host(spec),
                None => Ok(LayerKv::empty(spec)),
            },
            Held::V2(pin) => self.v2_read_layer(pin.as_ref().map(v2::Pin::set), layer, snapshot.position),
        }
    }

    fn cache_type(&self) -> CacheType {
        self.manifest.cache_type
    }

    /// One upload per K and V buffer (v2: straight from the mapped file's bytes where it holds
    /// the caches' type and one KV head).
    fn snapshot_from_layers<'a>(
        &self,
        position: usize,
        layers: &mut dyn Iterator<Item = LayerRows<'a>>,
    ) -> Result<IreeSnapshot> {
        if let Caches::V2(_) = self.caches {
            return self.v2_from_layers(position, layers);
        }
        let spec = &self.manifest.spec;
        // A session at position 0 holds no buffers (Vulkan refuses empty ones).
        let layers = if position == 0 {
            Vec::new()
        } else {
            layers
                .map(|l| {
                    let shape = [1, spec.n_kv_heads, l.rows, spec.head_dim];
                    Ok(LayerCache {
                        k: self.f32_view(&shape, &l.k.to_f32())?,
                        v: self.f32_view(&shape, &l.v.to_f32())?,
                        first: l.first_position,
                        rows: l.rows,
                    })
                })
                .collect::<Result<_>>()?
        };
        Ok(IreeSnapshot {
            session: self.id,
            position,
            held: Held::V1(layers),
            top_k: None,
        })
    }
}
