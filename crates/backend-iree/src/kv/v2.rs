//! Contract v2 sessions (`docs/contract-v2.md`): the runtime owns fixed-capacity caches, the
//! graphs read them whole and return only the new rows, and the session copies those rows in.
//! Global layers keep `maxPositions` rows (position `p` in row `p`); sliding layers a ring of
//! `slidingCacheRows` rows (`kv_core::ring`), where a write wraps around.
//!
//! A snapshot is the cache set (shared) plus the position it was taken at, so taking and
//! restoring one is O(1). A write goes into the set in place unless it would overwrite a
//! position a live snapshot of the same set keeps (every position before it on global layers,
//! its window on sliding ones); then the session first forks the set (one device copy of what
//! the write leaves) and writes into its fork. The app's pattern (snapshot the prefix, then
//! restore → chunk → steps per utterance) does not fork while an utterance stays within the
//! ring's slack: it overwrites only positions after the prefix, and ring rows older than the
//! prefix's window.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use iree_runtime::{BufferView, Device, ElementType, Transfer};
use kv_core::allowed::AllowedTokens;
use kv_core::manifest::{CacheType, Name};
use kv_core::snapshot_file::{Block, LayerRows};
use kv_core::window::{plan_chunk_rows, plan_pieces, ChunkPlan};
use kv_core::{ring, Error, Graph, KvSpec, LayerKv, Result, V2Spec, WindowRule};

use super::{Caches, Held, IreeKvBackend, IreeSnapshot, Variant};
use crate::convert::{contract_err, iree_err};
use crate::PrefillRoute;

/// What a call reads of the caches: the first `span` rows of each (`V2Spec::span_rows`; at
/// least `maxPositions` = all of them), through the graph's own function or one of its variants
/// (the prefill graph's token-less variant over that span, the small chunk graph).
#[derive(Clone, Copy)]
struct Reads {
    span: usize,
    variant: Variant,
}

/// Every layer's K and V buffer, `[rows, nKV, d]` of the manifest's `cacheType`
/// (`V2Spec::cache_rows`), on one device.
pub(crate) struct CacheSet {
    ty: CacheType,
    k: Vec<BufferView>,
    v: Vec<BufferView>,
    /// Per layer, the first position that holds data (0, except for sliding layers loaded from
    /// a snapshot file, which keeps only their window).
    first: Vec<usize>,
    /// The positions of the live snapshots of this set.
    pins: Mutex<Vec<Weak<usize>>>,
    /// Every row a position at or past this one maps to, and no position before it, holds zeros
    /// (`0` for a zeroed set; raised by every write, before it is submitted): what a set taken
    /// up again for a prefill must zero ([`CacheSet::reuse`]).
    written: AtomicUsize,
}

/// A snapshot's hold on a set: rows before `position` must not change while it lives.
#[derive(Clone)]
pub(crate) struct Pin {
    set: Arc<CacheSet>,
    /// The position, counted in the set's `pins` while any clone of this pin lives.
    _position: Arc<usize>,
}

impl Pin {
    pub(crate) fn set(&self) -> &Arc<CacheSet> {
        &self.set
    }
}

fn row_elems(spec: &KvSpec) -> usize {
    spec.n_kv_heads * spec.head_dim
}

fn element(ty: CacheType) -> ElementType {
    match ty {
        CacheType::F32 => ElementType::F32,
        CacheType::F16 => ElementType::F16,
    }
}

impl CacheSet {
    /// A set of zeros (rows a call does not read must still be finite: a masked score has
    /// weight 0, and 0 × NaN would poison the sum).
    fn zeroed(device: &Device, spec: &KvSpec, layout: &V2Spec, ty: CacheType) -> Result<Arc<CacheSet>> {
        let set = Self::allocate(device, spec, layout, ty, vec![0; spec.n_layers])?;
        let ops: Vec<Transfer<'_>> = set
            .buffers()
            .map(|target| Transfer::Zero {
                target,
                offset: 0,
                length: target.byte_length(),
            })
            .collect();
        device.transfer(&ops).map_err(iree_err("zero the v2 caches"))?;
        Ok(Arc::new(set))
    }

    fn allocate(device: &Device, spec: &KvSpec, layout: &V2Spec, ty: CacheType, first: Vec<usize>) -> Result<CacheSet> {
        let buffers = |l: usize| {
            let shape = [
                layout.cache_rows(spec, spec.layer_kind(l)),
                spec.n_kv_heads,
                spec.head_dim,
            ];
            BufferView::allocate(device, &shape, element(ty)).map_err(iree_err("allocate a v2 cache"))
        };
        Ok(CacheSet {
            ty,
            k: (0..spec.n_layers).map(buffers).collect::<Result<_>>()?,
            v: (0..spec.n_layers).map(buffers).collect::<Result<_>>()?,
            first,
            pins: Mutex::new(Vec::new()),
            written: AtomicUsize::new(0),
        })
    }

    /// A set no snapshot holds any more, as [`Self::zeroed`] would make it: only the rows a
    /// position before its `written` mark maps to are zeroed again (a prefill after a short
    /// prompt zeroes a few rows, not the set), and no buffer is allocated.
    fn reuse(mut self, device: &Device, spec: &KvSpec, layout: &V2Spec) -> Result<Arc<CacheSet>> {
        let written = *self.written.get_mut();
        let row_bytes = row_elems(spec) * self.ty.size();
        let ops: Vec<Transfer<'_>> = (0..spec.n_layers)
            .flat_map(|l| {
                // Positions 0..written map to the first rows of a global cache and of a ring
                // (`ring::row`), all of a ring's once they wrap.
                let n = written.min(layout.cache_rows(spec, spec.layer_kind(l)));
                [&self.k[l], &self.v[l]].map(|target| Transfer::Zero {
                    target,
                    offset: 0,
                    length: n * row_bytes,
                })
            })
            .filter(|op| !matches!(op, Transfer::Zero { length: 0, .. }))
            .collect();
        if !ops.is_empty() {
            device
                .transfer(&ops)
                .map_err(iree_err("zero the v2 caches' written rows"))?;
        }
        drop(ops);
        self.first.fill(0);
        *self.written.get_mut() = 0;
        self.pins.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(Arc::new(self))
    }

    fn buffers(&self) -> impl Iterator<Item = &BufferView> {
        self.k.iter().chain(&self.v)
    }

    pub(super) fn pin(self: &Arc<Self>, position: usize) -> Pin {
        let position = Arc::new(position);
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.retain(|p| p.strong_count() > 0);
        pins.push(Arc::downgrade(&position));
        Pin {
            set: self.clone(),
            _position: position,
        }
    }

    /// Whether writing positions `writes` would overwrite a position a live snapshot keeps:
    /// on global layers every position before the snapshot's, on ring layers its window
    /// (`ring::kept`).
    fn overwritten_by(&self, spec: &KvSpec, layout: &V2Spec, writes: std::ops::Range<usize>) -> bool {
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.retain(|p| p.strong_count() > 0);
        let kinds = spec.kinds_present();
        pins.iter().filter_map(Weak::upgrade).any(|p| {
            kinds.iter().any(|&kind| {
                if layout.is_ring(spec, kind) {
                    let kept = ring::kept(spec.sliding_window, *p);
                    ring::overwrites(layout.cache_rows(spec, kind), kept, writes.clone())
                } else {
                    *p > writes.start
                }
            })
        })
    }

    /// One layer's rows in the host layout `[nKV, rows, d]`: positions `first..position` of a
    /// global layer, of a ring the window before `position` (what snapshots keep of it).
    fn layer_to_host(&self, spec: &KvSpec, layout: &V2Spec, layer: usize, position: usize) -> Result<LayerKv> {
        let kind = spec.layer_kind(layer);
        let mut first = self.first[layer].min(position);
        let row = row_elems(spec);
        let ring_rows = layout.is_ring(spec, kind).then(|| layout.cache_rows(spec, kind));
        if ring_rows.is_some() {
            first = first.max(ring::kept(spec.sliding_window, position).start);
        }
        let size = self.ty.size();
        let read = |view: &BufferView| -> Result<Vec<f32>> {
            let rows = match ring_rows {
                None => {
                    let bytes = view
                        .to_bytes_prefix(position * row * size)
                        .map_err(iree_err("read a v2 cache"))?;
                    self.ty.decode(&bytes[first * row * size..])
                }
                Some(n) => {
                    let bytes = view
                        .to_bytes_prefix(view.byte_length())
                        .map_err(iree_err("read a v2 ring cache"))?;
                    let all = self.ty.decode(&bytes);
                    (first..position)
                        .flat_map(|p| &all[ring::row(n, p) * row..][..row])
                        .copied()
                        .collect()
                }
            };
            Ok(to_head_major(&rows, spec.n_kv_heads, spec.head_dim))
        };
        Ok(LayerKv {
            first_position: first,
            rows: position - first,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            k: read(&self.k[layer])?,
            v: read(&self.v[layer])?,
        })
    }
}

/// `[rows, nKV, d]` → `[nKV, rows, d]`.
fn to_head_major(rows: &[f32], heads: usize, d: usize) -> Vec<f32> {
    let n = rows.len() / (heads * d);
    let mut out = Vec::with_capacity(rows.len());
    for h in 0..heads {
        for r in 0..n {
            out.extend_from_slice(&rows[(r * heads + h) * d..][..d]);
        }
    }
    out
}

/// Rows `skip..` of `src` (`[nKV, n, d]` elements of `size` bytes) written into `target`
/// (`[rows', nKV, d]`): source row `skip + r` to row `at(r)`.
fn from_head_major(
    target: &mut [u8],
    src: &[u8],
    skip: usize,
    at: impl Fn(usize) -> usize,
    (heads, d, size): (usize, usize, usize),
) {
    let n = src.len() / (heads * d * size);
    let width = d * size;
    for h in 0..heads {
        for r in 0..n - skip {
            target[(at(r) * heads + h) * width..][..width].copy_from_slice(&src[(h * n + skip + r) * width..][..width]);
        }
    }
}

/// The allowed-token mask a v2 session's calls take (`Name::Allowed`, `i32 [ceil(vocab/32)]`).
pub(crate) struct Mask {
    /// Every id allowed, uploaded at open: what a session without a grammar passes, so greedy
    /// decoding pays no upload per call.
    all: BufferView,
    /// The restriction set by `set_allowed` and its buffer; `None`: [`Self::all`].
    set: Option<(AllowedTokens, BufferView)>,
}

impl Mask {
    /// The all-allowed mask of a manifest whose graphs take one; `None` for exports made before
    /// the mask (`allowedMask` absent).
    pub(crate) fn resident(device: &Device, manifest: &kv_core::Manifest) -> Result<Option<Mask>> {
        if !manifest.allowed_mask {
            return Ok(None);
        }
        let all = upload_mask(device, &AllowedTokens::all(manifest.spec.vocab_size))?;
        Ok(Some(Mask { all, set: None }))
    }

    fn view(&self) -> &BufferView {
        self.set.as_ref().map_or(&self.all, |(_, view)| view)
    }
}

fn upload_mask(device: &Device, allowed: &AllowedTokens) -> Result<BufferView> {
    // The graphs take the words as i32: the same bits.
    let words: Vec<i32> = allowed.words().iter().map(|&w| w as i32).collect();
    BufferView::from_i32(device, &[words.len()], &words).map_err(iree_err("upload the allowed-token mask"))
}

impl IreeKvBackend {
    /// [`kv_core::KvBackend::set_allowed`]: see its implementation's doc in `kv.rs`.
    pub(super) fn v2_set_allowed(&mut self, allowed: Option<&AllowedTokens>) -> Result<()> {
        let vocab = self.manifest.spec.vocab_size;
        let restricts = allowed.filter(|a| !a.is_all());
        let Some(mask) = &mut self.mask else {
            // Lifting a mask that cannot be set changes nothing.
            if restricts.is_none() && allowed.is_none_or(|a| a.vocab() == vocab) {
                return Ok(());
            }
            return Err(Error::GraphUnavailable {
                backend: "iree",
                op: "set_allowed",
                reason: match self.manifest.is_v2() {
                    true => "this contract v2 export predates the allowed-token mask (no `allowedMask` in its manifest): re-export it",
                    false => "contract 1 graphs take no allowed-token mask: export with contract 2",
                },
            });
        };
        if let Some(a) = allowed {
            a.check_vocab(vocab)?;
        }
        match restricts {
            None => mask.set = None,
            Some(a) if mask.set.as_ref().is_some_and(|(have, _)| have == a) => {}
            Some(a) => {
                let view = upload_mask(&self.device, a)?;
                mask.set = Some((a.clone(), view));
            }
        }
        Ok(())
    }

    /// The session's contract v2 layout; only v2 paths ask.
    pub(super) fn layout(&self) -> &V2Spec {
        self.manifest
            .v2()
            .unwrap_or_else(|| kv_core::error::invariant("a contract v2 path in a v1 session"))
    }

    /// v2 has one window rule: the masks are built in the graph with the exact one.
    pub(super) fn v2_check_rule(&self) -> Result<()> {
        match self.options.rule {
            WindowRule::Exact => Ok(()),
            WindowRule::SeedStep => Err(Error::ContractMismatch {
                backend: "iree",
                op: "open".into(),
                message: "contract v2 graphs build their masks in the graph with the exact window rule; the seed's step rule (WindowRule::SeedStep) needs contract v1 artifacts".into(),
            }),
        }
    }

    /// A prefill from position 0 into a fresh set (a zeroed one, or the set the last prefill
    /// released, its written rows zeroed again: [`CacheSet::reuse`]): calls of the prefill graph (a chunk graph of
    /// `prefillChunk` rows) while more than two chunk calls are left (the route permitting),
    /// then chunk calls. The session keeps its set and position if any call fails (the fresh set
    /// is dropped).
    pub(super) fn v2_prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        if self.prefill_released {
            return Err(self.missing(Graph::Prefill));
        }
        let spec = self.manifest.spec.clone();
        let wide = self.functions.contains_key(&Graph::Prefill);
        // A call of 128 rows costs about three of 32 on the CPU (docs/journal, session 7).
        let big = |left: usize| {
            wide && match self.options.prefill {
                PrefillRoute::Graph => true,
                PrefillRoute::Chunks => false,
                PrefillRoute::ChunksUpTo(_) => left > 2 * spec.chunk,
            }
        };
        let plans = plan_pieces(&spec, self.layout(), tokens, big)?;
        let fresh = match self.spare.take() {
            Some(set) => set.reuse(&self.device, &spec, self.layout())?,
            None => CacheSet::zeroed(&self.device, &spec, self.layout(), self.manifest.cache_type)?,
        };
        let before = (
            std::mem::replace(&mut self.caches, Caches::V2(Some(fresh))),
            self.position,
            self.last_top_k.clone(),
        );
        self.position = 0;
        let last = plans.len() - 1;
        let result = plans
            .iter()
            .enumerate()
            .try_fold(None, |_, (i, plan)| self.v2_run_piece(plan, i == last))
            .map(|t| t.unwrap_or_else(|| kv_core::error::invariant("a prefill's last call returns its token")));
        let released = match result.is_err() {
            true => std::mem::replace(&mut self.caches, before.0),
            false => before.0,
        };
        if result.is_err() {
            (self.position, self.last_top_k) = (before.1, before.2);
        }
        // The set this prefill replaced (or its own, if it failed).
        self.v2_keep_spare(released);
        result
    }

    /// Keeps `released`, caches the session no longer holds, for the next prefill where no
    /// snapshot holds them: a prefill then allocates nothing and zeroes only the rows the set's
    /// calls wrote (llama.cpp sizes its KV once per context). Not once the prefill graph is
    /// released (no prefill will take it up).
    pub(super) fn v2_keep_spare(&mut self, released: Caches) {
        if let Caches::V2(Some(set)) = released {
            if let Ok(set) = Arc::try_unwrap(set) {
                if !self.prefill_released {
                    self.spare = Some(set);
                }
            }
        }
    }

    /// A chunk call through the smallest chunk graph that holds `tokens` (`V2Spec::chunk_rows`).
    pub(super) fn v2_chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        let spec = &self.manifest.spec;
        let rows = self.layout().chunk_rows(spec, tokens.len());
        let plan = plan_chunk_rows(spec, rows, self.position, tokens)?;
        self.v2_advance(Graph::Chunk, self.chunk_inputs(&plan)?, plan.tokens.len(), plan.n)
    }

    /// One piece of a prefill: a chunk call, or a call of the prefill graph over the rows of
    /// each cache its span holds; a piece before the prefill's `last` runs the smallest
    /// token-less variant whose span holds it, if any (`V2Spec::prefill_spans`), and returns
    /// no token.
    fn v2_run_piece(&mut self, plan: &ChunkPlan, last: bool) -> Result<Option<i32>> {
        let inputs = self.chunk_inputs(plan)?;
        let rows = plan.tokens.len();
        let spec = &self.manifest.spec;
        if rows == spec.chunk || rows == self.layout().small_chunk {
            return self.v2_advance(Graph::Chunk, inputs, rows, plan.n).map(Some);
        }
        let end = self.position + rows;
        let variant = match last {
            true => None,
            false => self.layout().prefill_spans.iter().copied().find(|&s| end <= s),
        };
        let span = variant.unwrap_or_else(|| self.layout().prefill_graph_span(spec));
        let variant = variant.map_or(Variant::Own, Variant::Span);
        if end > span {
            return Err(contract_err(
                "prefill",
                format!(
                    "a prefill graph call over positions {}..{end} reaches past the {span} rows it reads (prefillSpan)",
                    self.position
                ),
            ));
        }
        let reads = Reads { span, variant };
        self.v2_advance_reading(Graph::Prefill, reads, inputs, rows, plan.n)
    }

    /// [`Self::v2_advance_reading`] over every cache row of `graph`'s own function, or for a
    /// chunk call of `smallChunk` rows of the small chunk graph.
    pub(super) fn v2_advance(
        &mut self,
        graph: Graph,
        inputs: HashMap<Name, BufferView>,
        rows: usize,
        real: usize,
    ) -> Result<i32> {
        let spec = &self.manifest.spec;
        let small = self.layout().small_chunk;
        let reads = match graph == Graph::Chunk && rows == small {
            // Within its span, the small graph's variant reading the caches' first rows.
            true => match self.layout().small_chunk_reads(spec, self.position, rows) {
                span if span < spec.max_positions => Reads {
                    span,
                    variant: Variant::SmallChunkSpan,
                },
                span => Reads {
                    span,
                    variant: Variant::SmallChunk,
                },
            },
            false => Reads {
                span: spec.max_positions,
                variant: Variant::Own,
            },
        };
        self.v2_advance_reading(graph, reads, inputs, rows, real)?
            .ok_or_else(|| kv_core::error::invariant("a graph's own function returns its token"))
    }

    /// Calls `graph` at the session's position over its set, then writes the `real` first of
    /// the `rows` new rows into the set (or into a fork of it, when a snapshot needs the rows
    /// being overwritten). Nothing changes if the call or a result check fails.
    fn v2_advance_reading(
        &mut self,
        graph: Graph,
        reads: Reads,
        mut inputs: HashMap<Name, BufferView>,
        rows: usize,
        real: usize,
    ) -> Result<Option<i32>> {
        let position = self.position;
        let set = match &self.caches {
            Caches::V2(Some(set)) => set.clone(),
            _ => kv_core::error::invariant("a v2 call past position 0 without caches"),
        };
        self.v2_cache_inputs(&mut inputs, &set, position, reads.span)?;
        let results = self.v2_call(graph, reads.variant, inputs, &set, rows)?;
        // The token is read by the submission that writes the rows (one round trip, not two).
        let readback = match reads.variant {
            Variant::Span(_) => None,
            Variant::Own | Variant::SmallChunk | Variant::SmallChunkSpan => Some(self.readback_slot(0)?),
        };
        let writes = position..position + real;
        let fork = self.v2_fork_for(&set, writes.clone())?;
        let ops = self.v2_row_writes(&set, fork.as_deref(), &results, writes);
        let t = std::time::Instant::now();
        let token = match &readback {
            Some(readback) => self
                .submit_and_read_token(&results[&Name::Token], readback, ops)
                .map(Some),
            None => self
                .device
                .transfer(&ops)
                .map_err(iree_err("write the new rows"))
                .map(|()| None),
        };
        self.clock.writes += t.elapsed();
        let token = token?;
        if let Some(fork) = fork {
            self.caches = Caches::V2(Some(fork));
        }
        self.position += real;
        self.last_top_k = Self::top_k_views(&results);
        Ok(token)
    }

    /// The position and the caches a call at `position` reads: the first `span` rows of each of
    /// `set`'s buffers (`V2Spec::span_rows`).
    pub(super) fn v2_cache_inputs(
        &self,
        inputs: &mut HashMap<Name, BufferView>,
        set: &CacheSet,
        position: usize,
        span: usize,
    ) -> Result<()> {
        let spec = &self.manifest.spec;
        inputs.insert(Name::Pos, self.i32_view(&[1], &[position as i32])?);
        if let Some(mask) = &self.mask {
            inputs.insert(Name::Allowed, mask.view().clone());
        }
        for l in 0..spec.n_layers {
            let kind = spec.layer_kind(l);
            let n = self.layout().span_rows(spec, kind, span);
            for (name, cache) in [(Name::K(l), &set.k[l]), (Name::V(l), &set.v[l])] {
                let view = match n == self.layout().cache_rows(spec, kind) {
                    true => cache.clone(),
                    false => cache.leading(n).map_err(iree_err("take the rows a span reads"))?,
                };
                inputs.insert(name, view);
            }
        }
        Ok(())
    }

    /// Calls `graph` (or its prefill variant) over `set`, checking that it returns `rows` new
    /// rows of each layer in the set's type.
    pub(super) fn v2_call(
        &mut self,
        graph: Graph,
        variant: Variant,
        inputs: HashMap<Name, BufferView>,
        set: &CacheSet,
        rows: usize,
    ) -> Result<HashMap<Name, BufferView>> {
        let spec = self.manifest.spec.clone();
        self.call_variant(graph, variant, inputs, &|name| match name {
            Name::Token => (vec![1], ElementType::I32),
            _ => (vec![rows, spec.n_kv_heads, spec.head_dim], element(set.ty)),
        })
    }

    /// A fresh set to write positions `writes` into instead of `set`, when a live snapshot of
    /// `set` keeps what they would overwrite (filled by [`Self::v2_row_writes`]).
    pub(super) fn v2_fork_for(&self, set: &CacheSet, writes: std::ops::Range<usize>) -> Result<Option<Arc<CacheSet>>> {
        let spec = &self.manifest.spec;
        if !set.overwritten_by(spec, self.layout(), writes) {
            return Ok(None);
        }
        CacheSet::allocate(&self.device, spec, self.layout(), set.ty, set.first.clone())
            .map(|fork| Some(Arc::new(fork)))
    }

    /// The transfers that write the new rows of `results` at positions `writes` into `set`, or
    /// into `fork` ([`Self::v2_fork_for`]) with the rest of `set` the write leaves.
    pub(super) fn v2_row_writes<'a>(
        &self,
        set: &'a CacheSet,
        fork: Option<&'a CacheSet>,
        results: &'a HashMap<Name, BufferView>,
        writes: std::ops::Range<usize>,
    ) -> Vec<Transfer<'a>> {
        let spec = &self.manifest.spec;
        let row_bytes = row_elems(spec) * set.ty.size();
        let target = fork.unwrap_or(set);
        // A fork holds the rows of `set` the write leaves (or zeros), and the new ones.
        let kept = fork.map_or(0, |_| set.written.load(Ordering::Relaxed));
        target.written.fetch_max(kept.max(writes.end), Ordering::Relaxed);
        let mut ops = Vec::with_capacity(6 * spec.n_layers);
        for l in 0..spec.n_layers {
            let kind = spec.layer_kind(l);
            let rows = self.layout().cache_rows(spec, kind);
            let is_ring = self.layout().is_ring(spec, kind);
            // Where the new rows go: one run, or two where a ring wraps.
            let runs = if is_ring {
                ring::runs(rows, writes.clone())
            } else {
                vec![writes.clone()]
            };
            for (old, new, name) in [
                (&set.k[l], &target.k[l], Name::K(l)),
                (&set.v[l], &target.v[l], Name::V(l)),
            ] {
                let mut from = 0;
                for run in &runs {
                    ops.push(Transfer::Copy {
                        source: &results[&name],
                        source_offset: from * row_bytes,
                        target: new,
                        target_offset: run.start * row_bytes,
                        length: run.len() * row_bytes,
                    });
                    from += run.len();
                }
                if fork.is_none() {
                    continue;
                }
                // The fork: a linear cache's rows before the position copied, those after it
                // zeroed; a ring's rows the write leaves copied. No row is written twice.
                if is_ring {
                    for keep in ring::complement(rows, &runs) {
                        ops.push(Transfer::Copy {
                            source: old,
                            source_offset: keep.start * row_bytes,
                            target: new,
                            target_offset: keep.start * row_bytes,
                            length: keep.len() * row_bytes,
                        });
                    }
                } else {
                    ops.push(Transfer::Copy {
                        source: old,
                        source_offset: 0,
                        target: new,
                        target_offset: 0,
                        length: writes.start * row_bytes,
                    });
                    ops.push(Transfer::Zero {
                        target: new,
                        offset: writes.end * row_bytes,
                        length: (rows - writes.end) * row_bytes,
                    });
                }
            }
        }
        ops.retain(|op| !matches!(op, Transfer::Copy { length: 0, .. } | Transfer::Zero { length: 0, .. }));
        ops
    }

    /// Every byte of layer `layer`'s K and V buffers of a v2 session's set, the rows past its
    /// position too (tests: a set taken up again must equal a fresh one); `None` before the
    /// first call.
    #[doc(hidden)]
    pub fn v2_cache_bytes(&self, layer: usize) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        let Caches::V2(Some(set)) = &self.caches else {
            return Ok(None);
        };
        let read = |view: &BufferView| {
            view.to_bytes_prefix(view.byte_length())
                .map_err(iree_err("read a v2 cache"))
        };
        Ok(Some((read(&set.k[layer])?, read(&set.v[layer])?)))
    }

    pub(super) fn v2_read_layer(
        &self,
        pin_set: Option<&Arc<CacheSet>>,
        layer: usize,
        position: usize,
    ) -> Result<LayerKv> {
        let spec = &self.manifest.spec;
        match pin_set {
            Some(set) if position > 0 => set.layer_to_host(spec, self.layout(), layer, position),
            _ => Ok(LayerKv::empty(spec)),
        }
    }

    /// A snapshot holding a file's rows: one upload per buffer.
    pub(super) fn v2_from_layers<'a>(
        &self,
        position: usize,
        layers: &mut dyn Iterator<Item = LayerRows<'a>>,
    ) -> Result<IreeSnapshot> {
        let spec = &self.manifest.spec;
        let ty = self.manifest.cache_type;
        let pin = if position == 0 {
            None
        } else {
            let (heads, d) = (spec.n_kv_heads, spec.head_dim);
            let mut k = Vec::with_capacity(spec.n_layers);
            let mut v = Vec::with_capacity(spec.n_layers);
            let mut first = Vec::with_capacity(spec.n_layers);
            for (index, l) in layers.enumerate() {
                if l.first_position + l.rows > spec.max_positions {
                    return Err(contract_err("load snapshot", "a layer's rows end past maxPositions"));
                }
                let kind = spec.layer_kind(index);
                let rows = self.layout().cache_rows(spec, kind);
                let ring = self.layout().is_ring(spec, kind);
                // A ring keeps the file's last rows that fit it (at least the window).
                let skip = if ring { l.rows.saturating_sub(rows) } else { 0 };
                let start = l.first_position + skip;
                first.push(start);
                let size = ty.size();
                let upload = |block: &Block<'_>| -> Result<BufferView> {
                    // The file's bytes where it holds the caches' type (else converted).
                    let stored = block.to_bytes_of(ty);
                    let mut host = vec![0u8; rows * heads * d * size];
                    let at = |r: usize| if ring { ring::row(rows, start + r) } else { start + r };
                    from_head_major(&mut host, &stored, skip, at, (heads, d, size));
                    BufferView::from_raw_bytes(&self.device, &[rows, heads, d], element(ty), &host)
                        .map_err(iree_err("upload a snapshot's caches"))
                };
                k.push(upload(&l.k)?);
                v.push(upload(&l.v)?);
            }
            let set = Arc::new(CacheSet {
                ty,
                k,
                v,
                first,
                pins: Mutex::new(Vec::new()),
                // Rows written anywhere, as far as a reuse knows.
                written: AtomicUsize::new(usize::MAX),
            });
            Some(set.pin(position))
        };
        Ok(IreeSnapshot {
            session: self.id,
            position,
            held: Held::V2(pin),
            top_k: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_major_round_trip() {
        let (heads, d, n) = (3, 2, 4);
        let rows: Vec<f32> = (0..n * heads * d).map(|i| i as f32).collect();
        let hm = to_head_major(&rows, heads, d);
        // Row 1, head 2 of the row-major input is [1*6 + 2*2, +1] = [10, 11].
        assert_eq!(&hm[(2 * n + 1) * d..][..d], &[10.0, 11.0]);
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut back = vec![0u8; (n + 2) * heads * d * 4];
        from_head_major(&mut back, &bytes(&hm), 0, |r| r + 2, (heads, d, 4));
        assert_eq!(&back[2 * heads * d * 4..], &bytes(&rows)[..]);
        assert!(back[..2 * heads * d * 4].iter().all(|&x| x == 0));
        // Skipping the first source row: row 1 lands at row 0.
        let mut tail = vec![0u8; n * heads * d * 4];
        from_head_major(&mut tail, &bytes(&hm), 1, |r| r, (heads, d, 4));
        assert_eq!(&tail[..(n - 1) * heads * d * 4], &bytes(&rows[heads * d..])[..]);
    }
}
