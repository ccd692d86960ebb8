//! Contract v2 sessions (`docs/contract-v2.md`): the runtime owns fixed-capacity caches, the
//! graphs read them whole and return only the new rows, and the session copies those rows in.
//!
//! A snapshot is the cache set (shared) plus the position it was taken at, so taking and
//! restoring one is O(1). A write at row `r` goes into the set in place unless a live snapshot
//! of the same set still needs rows at or after `r`; then the session first forks the set (one
//! device copy of the rows before `r`) and writes into its fork. The app's pattern (snapshot the
//! prefix, then restore → chunk → steps per utterance) never forks: each utterance overwrites
//! only rows after the prefix, which the prefix snapshot does not need.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use iree_runtime::{BufferView, Device, ElementType, Transfer};
use kv_core::manifest::Name;
use kv_core::snapshot_file::LayerRows;
use kv_core::window::{plan_chunk, plan_chunked_prefill, ChunkPlan};
use kv_core::{Error, Graph, KvSpec, LayerKv, Result, WindowRule};

use super::{IreeKvBackend, IreeSnapshot};
use crate::convert::{contract_err, iree_err};

/// Every layer's K and V buffer, `[maxPositions, nKV, d]` f32, on one device.
pub(crate) struct CacheSet {
    k: Vec<BufferView>,
    v: Vec<BufferView>,
    /// Per layer, the first row that holds data (0, except for sliding layers loaded from a
    /// snapshot file, which keeps only their window). Rows before it are zeros.
    first: Vec<usize>,
    /// The positions of the live snapshots of this set.
    pins: Mutex<Vec<Weak<usize>>>,
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

impl CacheSet {
    /// A set of zeros (rows a call does not read must still be finite: a masked score has
    /// weight 0, and 0 × NaN would poison the sum).
    fn zeroed(device: &Device, spec: &KvSpec) -> Result<Arc<CacheSet>> {
        let set = Self::allocate(device, spec, vec![0; spec.n_layers])?;
        let bytes = spec.max_positions * row_elems(spec) * 4;
        let ops: Vec<Transfer<'_>> = set
            .buffers()
            .map(|target| Transfer::Zero {
                target,
                offset: 0,
                length: bytes,
            })
            .collect();
        device.transfer(&ops).map_err(iree_err("zero the v2 caches"))?;
        Ok(Arc::new(set))
    }

    fn allocate(device: &Device, spec: &KvSpec, first: Vec<usize>) -> Result<CacheSet> {
        let shape = [spec.max_positions, spec.n_kv_heads, spec.head_dim];
        let buffers = |_| BufferView::allocate_f32(device, &shape).map_err(iree_err("allocate a v2 cache"));
        Ok(CacheSet {
            k: (0..spec.n_layers).map(buffers).collect::<Result<_>>()?,
            v: (0..spec.n_layers).map(buffers).collect::<Result<_>>()?,
            first,
            pins: Mutex::new(Vec::new()),
        })
    }

    fn buffers(&self) -> impl Iterator<Item = &BufferView> {
        self.k.iter().chain(&self.v)
    }

    fn pin(self: &Arc<Self>, position: usize) -> Pin {
        let position = Arc::new(position);
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.retain(|p| p.strong_count() > 0);
        pins.push(Arc::downgrade(&position));
        Pin {
            set: self.clone(),
            _position: position,
        }
    }

    /// Whether a live snapshot needs a row at or after `row` to stay as it is.
    fn needed_from(&self, row: usize) -> bool {
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.retain(|p| p.strong_count() > 0);
        pins.iter().filter_map(Weak::upgrade).any(|p| *p > row)
    }

    /// One layer's rows `first..position` in the host layout `[nKV, rows, d]`.
    fn layer_to_host(&self, spec: &KvSpec, layer: usize, position: usize) -> Result<LayerKv> {
        let first = self.first[layer].min(position);
        let row = row_elems(spec);
        let read = |view: &BufferView| -> Result<Vec<f32>> {
            let all = view
                .to_f32_vec_prefix(position * row)
                .map_err(iree_err("read a v2 cache"))?;
            Ok(to_head_major(&all[first * row..], spec.n_kv_heads, spec.head_dim))
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

/// `[nKV, rows, d]` written into `target` (`[P, nKV, d]`) from row `first`.
fn from_head_major(target: &mut [f32], src: &[f32], first: usize, heads: usize, d: usize) {
    let n = src.len() / (heads * d);
    for h in 0..heads {
        for r in 0..n {
            target[((first + r) * heads + h) * d..][..d].copy_from_slice(&src[(h * n + r) * d..][..d]);
        }
    }
}

impl IreeKvBackend {
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

    /// A prefill as chunk calls from position 0 into a fresh set. The session keeps its set and
    /// position if any call fails (the fresh set is dropped).
    pub(super) fn v2_prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        if self.prefill_released {
            return Err(self.missing(Graph::Prefill));
        }
        let spec = self.manifest.spec.clone();
        let plans = plan_chunked_prefill(&spec, tokens)?;
        let fresh = CacheSet::zeroed(&self.device, &spec)?;
        let before = (self.v2.replace(fresh), self.position, self.last_top_k.clone());
        self.position = 0;
        let result = plans
            .iter()
            .try_fold(None, |_, plan| self.v2_run_chunk(plan).map(Some))
            .map(|t| t.unwrap_or_else(|| kv_core::error::invariant("a prefill plans one chunk at least")));
        if result.is_err() {
            (self.v2, self.position, self.last_top_k) = before;
        }
        result
    }

    pub(super) fn v2_chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        let plan = plan_chunk(&self.manifest.spec, self.position, tokens)?;
        self.v2_run_chunk(&plan)
    }

    fn v2_run_chunk(&mut self, plan: &ChunkPlan) -> Result<i32> {
        let inputs = self.chunk_inputs(plan)?;
        self.v2_advance(Graph::Chunk, inputs, self.manifest.spec.chunk, plan.n)
    }

    /// Calls `graph` at the session's position over its set, then writes the `real` first of
    /// the `rows` new rows into the set (or into a fork of it, when a snapshot needs the rows
    /// being overwritten). Nothing changes if the call or a result check fails.
    pub(super) fn v2_advance(
        &mut self,
        graph: Graph,
        mut inputs: HashMap<Name, BufferView>,
        rows: usize,
        real: usize,
    ) -> Result<i32> {
        let spec = self.manifest.spec.clone();
        let position = self.position;
        let set = self
            .v2
            .clone()
            .unwrap_or_else(|| kv_core::error::invariant("a v2 call past position 0 without caches"));
        inputs.insert(Name::Pos, self.i32_view(&[1], &[position as i32])?);
        for l in 0..spec.n_layers {
            let kind = spec.layer_kind(l);
            let rows = spec.cache_rows(kind);
            let view = |whole: &BufferView| -> Result<BufferView> {
                if rows == spec.max_positions {
                    return Ok(whole.clone());
                }
                let base = spec.cache_view_base(kind, position);
                whole.leading_rows(base, base + rows).map_err(iree_err("view a sliding cache"))
            };
            inputs.insert(Name::K(l), view(&set.k[l])?);
            inputs.insert(Name::V(l), view(&set.v[l])?);
        }
        let results = self.call(graph, inputs, &|name| match name {
            Name::Token => (vec![1], ElementType::I32),
            _ => (vec![rows, spec.n_kv_heads, spec.head_dim], ElementType::F32),
        })?;
        let token = Self::read_token(&results)?;

        let row_bytes = row_elems(&spec) * 4;
        let (start, end) = (position * row_bytes, (position + real) * row_bytes);
        let fork = if set.needed_from(position) {
            Some(Arc::new(CacheSet::allocate(&self.device, &spec, set.first.clone())?))
        } else {
            None
        };
        let target = fork.as_ref().unwrap_or(&set);
        let mut ops = Vec::with_capacity(6 * spec.n_layers);
        for l in 0..spec.n_layers {
            for (old, new, name) in [
                (&set.k[l], &target.k[l], Name::K(l)),
                (&set.v[l], &target.v[l], Name::V(l)),
            ] {
                ops.push(Transfer::Copy {
                    source: &results[&name],
                    source_offset: 0,
                    target: new,
                    target_offset: start,
                    length: end - start,
                });
                if fork.is_some() {
                    // The fork: the rows before the position copied, those after it zeroed.
                    ops.push(Transfer::Copy {
                        source: old,
                        source_offset: 0,
                        target: new,
                        target_offset: 0,
                        length: start,
                    });
                    ops.push(Transfer::Zero {
                        target: new,
                        offset: end,
                        length: spec.max_positions * row_bytes - end,
                    });
                }
            }
        }
        ops.retain(|op| !matches!(op, Transfer::Copy { length: 0, .. } | Transfer::Zero { length: 0, .. }));
        self.device.transfer(&ops).map_err(iree_err("write the new rows"))?;
        if let Some(fork) = fork {
            self.v2 = Some(fork);
        }
        self.position += real;
        self.last_top_k = Self::top_k_views(&results);
        Ok(token)
    }

    pub(super) fn v2_snapshot(&self) -> IreeSnapshot {
        IreeSnapshot {
            session: self.id,
            position: self.position,
            layers: Vec::new(),
            pin: self.v2.as_ref().map(|set| set.pin(self.position)),
            top_k: self.last_top_k.clone(),
        }
    }

    pub(super) fn v2_restore(&mut self, snapshot: &IreeSnapshot) {
        self.v2 = snapshot.pin.as_ref().map(|pin| pin.set.clone());
        self.position = snapshot.position;
        self.last_top_k = snapshot.top_k.clone();
    }

    pub(super) fn v2_read_layer(
        &self,
        pin_set: Option<&Arc<CacheSet>>,
        layer: usize,
        position: usize,
    ) -> Result<LayerKv> {
        let spec = &self.manifest.spec;
        match pin_set {
            Some(set) if position > 0 => set.layer_to_host(spec, layer, position),
            _ => Ok(LayerKv::empty(spec)),
        }
    }

    /// A snapshot holding a file's rows: one upload per buffer.
    pub(super) fn v2_from_layers(&self, position: usize, layers: &[LayerRows<'_>]) -> Result<IreeSnapshot> {
        let spec = &self.manifest.spec;
        let pin = if position == 0 {
            None
        } else {
            let (heads, d) = (spec.n_kv_heads, spec.head_dim);
            let shape = [spec.max_positions, heads, d];
            let mut host = vec![0f32; spec.max_positions * heads * d];
            let mut upload = |rows: &[f32], first: usize| -> Result<BufferView> {
                host.fill(0.0);
                from_head_major(&mut host, rows, first, heads, d);
                self.f32_view(&shape, &host)
            };
            let mut k = Vec::with_capacity(layers.len());
            let mut v = Vec::with_capacity(layers.len());
            for l in layers {
                if l.first_position + l.rows > spec.max_positions {
                    return Err(contract_err("load snapshot", "a layer's rows end past maxPositions"));
                }
                k.push(upload(l.k, l.first_position)?);
                v.push(upload(l.v, l.first_position)?);
            }
            let set = Arc::new(CacheSet {
                k,
                v,
                first: layers.iter().map(|l| l.first_position).collect(),
                pins: Mutex::new(Vec::new()),
            });
            Some(set.pin(position))
        };
        Ok(IreeSnapshot {
            session: self.id,
            position,
            layers: Vec::new(),
            pin,
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
        let mut back = vec![0.0; (n + 2) * heads * d];
        from_head_major(&mut back, &hm, 2, heads, d);
        assert_eq!(&back[2 * heads * d..], &rows[..]);
        assert!(back[..2 * heads * d].iter().all(|&x| x == 0.0));
    }
}
