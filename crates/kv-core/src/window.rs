//! Window arithmetic: how many past rows each layer is handed on each call, and the inputs a
//! call needs (tables, masks, padded tokens). Backends execute plans; they never redo this math.
//!
//! A layer's cache is a run of rows covering absolute positions `[position - held, position)`.
//! Global layers hold every row since 0. Sliding layers are re-based on every call to the rows
//! they were handed plus the new ones, so they hold at least `min(position, window)` rows.

use crate::contract::V2Spec;
use crate::error::{Error, Result};
use crate::mask::chunk_mask;
use crate::rope::RopeTable;
use crate::spec::{KvSpec, LayerKind};

/// How many rows a sliding layer is given on a step call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WindowRule {
    /// `window - 1` past rows, so the new token sees exactly `window` keys counting itself.
    #[default]
    Exact,
    /// The seed's C runtime: `window` past rows on steps too (`window + 1` keys), kept so an app
    /// can reproduce the old library's outputs.
    SeedStep,
}

/// The call kinds that take a past.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PastCall {
    Chunk,
    Step,
}

/// Past rows handed to a layer of `kind` on a call at `position`.
///
/// Chunk calls on sliding layers get `window` rows: row 0 of the chunk needs `window - 1` of them
/// and the mask drops the oldest, as the seed does. Step calls carry no mask, so the rows passed
/// *are* the window.
pub fn past_rows(spec: &KvSpec, kind: LayerKind, call: PastCall, position: usize, rule: WindowRule) -> usize {
    match (spec.window(kind), call) {
        (None, _) => position,
        (Some(w), PastCall::Chunk) => position.min(w),
        (Some(w), PastCall::Step) => match rule {
            WindowRule::Exact => position.min(w - 1),
            WindowRule::SeedStep => position.min(w),
        },
    }
}

/// The absolute key positions a step at `position` shows a layer of `kind` (half-open range).
pub fn step_keys(spec: &KvSpec, kind: LayerKind, position: usize, rule: WindowRule) -> std::ops::Range<usize> {
    let past = past_rows(spec, kind, PastCall::Step, position, rule);
    position - past..position + 1
}

/// Inputs of one layer kind for a chunk or step call.
#[derive(Clone, Debug)]
pub struct KindInputs {
    pub kind: LayerKind,
    /// Past rows every layer of this kind receives.
    pub past: usize,
    pub rope: RopeTable,
    /// `[1, maskHeads, C, past + C]` for chunk calls, empty for steps.
    pub mask: Vec<f32>,
}

/// Everything a prefill call needs besides the embedding rows.
#[derive(Clone, Debug)]
pub struct PrefillPlan {
    /// Real tokens.
    pub n: usize,
    /// `[SEQ]`, padded with 0.
    pub tokens: Vec<i32>,
    /// `[1, SEQ]`, one-hot at `n - 1`.
    pub select: Vec<f32>,
}

/// Everything a chunk call needs besides the embedding rows and the caches.
#[derive(Clone, Debug)]
pub struct ChunkPlan {
    pub position: usize,
    pub n: usize,
    /// `[C]`, padded with 0.
    pub tokens: Vec<i32>,
    /// `[1, C]`, one-hot at `n - 1`.
    pub select: Vec<f32>,
    /// One entry per kind present, in order of first appearance.
    pub kinds: Vec<KindInputs>,
}

/// Everything a step call needs besides the embedding row and the caches.
#[derive(Clone, Debug)]
pub struct StepPlan {
    pub position: usize,
    pub token: i32,
    pub kinds: Vec<KindInputs>,
}

impl ChunkPlan {
    pub fn kind(&self, kind: LayerKind) -> &KindInputs {
        find_kind(&self.kinds, kind)
    }
}

impl StepPlan {
    pub fn kind(&self, kind: LayerKind) -> &KindInputs {
        find_kind(&self.kinds, kind)
    }
}

fn find_kind(kinds: &[KindInputs], kind: LayerKind) -> &KindInputs {
    kinds
        .iter()
        .find(|k| k.kind == kind)
        .unwrap_or_else(|| crate::error::invariant("plan lacks a layer kind the spec has"))
}

fn one_hot(len: usize, at: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    v[at] = 1.0;
    v
}

fn padded(tokens: &[i32], len: usize) -> Vec<i32> {
    let mut v = tokens.to_vec();
    v.resize(len, 0);
    v
}

/// Validates a prefill (1..=SEQ in-vocabulary tokens from position 0) and plans it.
pub fn plan_prefill(spec: &KvSpec, tokens: &[i32]) -> Result<PrefillPlan> {
    let n = tokens.len();
    if n == 0 || n > spec.seq {
        return Err(Error::BadTokenCount {
            op: "prefill",
            n,
            min: 1,
            max: spec.seq,
        });
    }
    spec.check_tokens("prefill", tokens)?;
    Ok(PrefillPlan {
        n,
        tokens: padded(tokens, spec.seq),
        select: one_hot(spec.seq, n - 1),
    })
}

/// Validates a chunk call (1..=C tokens after a prefix, within maxPositions) and plans it.
pub fn plan_chunk(spec: &KvSpec, position: usize, tokens: &[i32]) -> Result<ChunkPlan> {
    if position == 0 {
        return Err(Error::NotPrefilled { op: "chunk" });
    }
    chunk_at(spec, position, tokens)
}

/// [`plan_chunk`] for a chunk graph of `rows` rows (`V2Spec::chunk_rows`: the small chunk
/// graph's or the chunk graph's): the tokens, select row, tables and masks padded to `rows`. A
/// piece longer than `rows` is refused as longer than the chunk.
pub fn plan_chunk_rows(spec: &KvSpec, rows: usize, position: usize, tokens: &[i32]) -> Result<ChunkPlan> {
    if position == 0 {
        return Err(Error::NotPrefilled { op: "chunk" });
    }
    chunk_at(&with_rows(spec, rows), position, tokens)
}

fn with_rows(spec: &KvSpec, rows: usize) -> KvSpec {
    KvSpec {
        chunk: rows,
        ..spec.clone()
    }
}

/// Validates a prefill (as [`plan_prefill`]) and plans it as chunk calls from an empty cache:
/// the first at position 0 with no past rows, each later one after the previous. A short prompt
/// then costs `ceil(n / C)` chunk calls instead of one call over all `SEQ` rows. Every piece is
/// planned (and so validated) before the caller runs any.
pub fn plan_chunked_prefill(spec: &KvSpec, tokens: &[i32]) -> Result<Vec<ChunkPlan>> {
    plan_pieces(spec, &V2Spec::default(), tokens, |_| false)
}

/// Contract v2's prefill from position 0: while `big(remaining tokens)` says so, pieces of
/// `layout.prefill_chunk` rows (the last padded), the rest chunk calls, each of the smallest
/// chunk graph that holds what is left (`V2Spec::chunk_rows`: the small chunk graph's rows for
/// the last piece when it holds it). A plan of `prefill_chunk` rows is one for the prefill graph
/// (more rows than a chunk: `V2Spec::validate`), of `small_chunk` rows one for the small chunk
/// graph (fewer); 0 = no such graph.
pub fn plan_pieces(
    spec: &KvSpec,
    layout: &V2Spec,
    tokens: &[i32],
    big: impl Fn(usize) -> bool,
) -> Result<Vec<ChunkPlan>> {
    plan_prefill(spec, tokens)?;
    let wide = with_rows(spec, layout.prefill_chunk);
    let small = with_rows(spec, layout.small_chunk);
    let mut plans = Vec::new();
    let mut at = 0;
    while at < tokens.len() {
        let left = tokens.len() - at;
        let spec = if layout.prefill_chunk > 0 && big(left) {
            &wide
        } else if layout.chunk_rows(spec, left) == layout.small_chunk {
            &small
        } else {
            spec
        };
        let n = left.min(spec.chunk);
        plans.push(chunk_at(spec, at, &tokens[at..at + n])?);
        at += n;
    }
    Ok(plans)
}

fn chunk_at(spec: &KvSpec, position: usize, tokens: &[i32]) -> Result<ChunkPlan> {
    let n = tokens.len();
    if n == 0 || n > spec.chunk {
        return Err(Error::BadTokenCount {
            op: "chunk",
            n,
            min: 1,
            max: spec.chunk,
        });
    }
    spec.check_tokens("chunk", tokens)?;
    if position + n > spec.max_positions {
        return Err(Error::ContextOverflow {
            op: "chunk",
            position,
            n,
            max: spec.max_positions,
        });
    }
    let kinds = spec
        .kinds_present()
        .into_iter()
        .map(|kind| {
            let past = past_rows(spec, kind, PastCall::Chunk, position, WindowRule::Exact);
            KindInputs {
                kind,
                past,
                rope: RopeTable::new(position, spec.chunk, spec.head_dim, spec.rope_base(kind)),
                mask: chunk_mask(position, past, n, spec.chunk, spec.window(kind), spec.mask_head_count()),
            }
        })
        .collect();
    Ok(ChunkPlan {
        position,
        n,
        tokens: padded(tokens, spec.chunk),
        select: one_hot(spec.chunk, n - 1),
        kinds,
    })
}

/// Validates a step call (one in-vocabulary token after a prefix, within maxPositions) and plans it.
pub fn plan_step(spec: &KvSpec, position: usize, token: i32, rule: WindowRule) -> Result<StepPlan> {
    if position == 0 {
        return Err(Error::NotPrefilled { op: "step" });
    }
    spec.check_tokens("step", &[token])?;
    if position + 1 > spec.max_positions {
        return Err(Error::ContextOverflow {
            op: "step",
            position,
            n: 1,
            max: spec.max_positions,
        });
    }
    let kinds = spec
        .kinds_present()
        .into_iter()
        .map(|kind| KindInputs {
            kind,
            past: past_rows(spec, kind, PastCall::Step, position, rule),
            rope: RopeTable::new(position, 1, spec.head_dim, spec.rope_base(kind)),
            mask: Vec::new(),
        })
        .collect();
    Ok(StepPlan { position, token, kinds })
}
