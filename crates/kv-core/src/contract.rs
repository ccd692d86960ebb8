//! Which graph contract an artifact set follows, as a type: [`Contract::V1`] (the seed's:
//! dynamic `past`, each call returns whole new caches) or [`Contract::V2`] (static shapes over
//! caches the runtime owns, `docs/contract-v2.md`) with the cache layout only v2 has
//! ([`V2Spec`]). A v1 manifest has no ring, no prefill chunk and no prefill spans by
//! construction, where these were fields of [`KvSpec`] that had to be zero under v1.
//!
//! The manifest still stores `contractVersion` and the v2 keys beside the geometry, as before
//! (`manifest::wire` converts at the boundary), so existing artifacts load unchanged.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::spec::{KvSpec, LayerKind};

/// The version number contract v1 is stored as (`contractVersion`).
pub const V1_VERSION: u32 = 1;
/// The version number contract v2 is stored as.
pub const V2_VERSION: u32 = 2;

/// Rows of contract v2's prefill graph by default: per row, a call of 128 rows costs 0.7× one of
/// 32 on the CPU (the weights are read once per call), and 256 no less (`docs/journal`, session 8).
pub const DEFAULT_PREFILL_CHUNK: usize = 128;

/// Rows of contract v2's small chunk graph by default, where the chunk graph has more: a chunk
/// call's cost falls with its rows down to the LM head's (one row), and feeds of a few ids (a
/// short prompt, an utterance after a restore, grammar-forced ids) are most calls
/// (`docs/contract-v2.md`, "The small chunk graph").
pub const DEFAULT_SMALL_CHUNK: usize = 8;

/// The span of the small chunk graph's variant by default ([`V2Spec::small_chunk_span`]): the
/// small graph's own rows, so that a prompt of that many ids fed from position 0 (a session's
/// first request) reads no cache row beyond its own. The full graph packs every cache row into
/// the CPU's tiles on each call (a read and a write of every K and V row) and attends over them.
pub const DEFAULT_SMALL_CHUNK_SPAN: usize = DEFAULT_SMALL_CHUNK;

/// Token-less prefill variants an export makes at most ([`V2Spec::default_prefill_spans`]):
/// the largest spans are kept, as they serve most calls of a long prefill.
pub const MAX_PREFILL_SPANS: usize = 2;

/// Which contract, without v2's layout: what an export is asked for (`ExportOptions::contract`,
/// `--contract`) and what [`Contract::version`] says. The manifest stores it as a number
/// ([`Self::number`]; [`TryFrom<u32>`] at that boundary).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ContractVersion {
    /// Contract v1, stored as [`V1_VERSION`].
    #[default]
    V1,
    /// Contract v2, stored as [`V2_VERSION`].
    V2,
}

impl ContractVersion {
    /// The number the manifest stores (`contractVersion`).
    pub const fn number(self) -> u32 {
        match self {
            ContractVersion::V1 => V1_VERSION,
            ContractVersion::V2 => V2_VERSION,
        }
    }
}

impl std::fmt::Display for ContractVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}

/// A `contractVersion` this runtime does not speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("contract {0} is not supported (this runtime speaks {V1_VERSION} and {V2_VERSION})")]
pub struct UnknownContractVersion(pub u32);

impl TryFrom<u32> for ContractVersion {
    type Error = UnknownContractVersion;

    fn try_from(number: u32) -> std::result::Result<Self, UnknownContractVersion> {
        match number {
            V1_VERSION => Ok(ContractVersion::V1),
            V2_VERSION => Ok(ContractVersion::V2),
            other => Err(UnknownContractVersion(other)),
        }
    }
}

/// The graph contract of an artifact set.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Contract {
    /// The seed's graphs: dynamic `past`, whole caches in and out.
    #[default]
    V1,
    /// Static-shape graphs over runtime-owned caches, laid out as the [`V2Spec`] says.
    V2(V2Spec),
}

impl Contract {
    /// Which contract this is (the manifest stores its [`ContractVersion::number`]).
    pub fn version(&self) -> ContractVersion {
        match self {
            Contract::V1 => ContractVersion::V1,
            Contract::V2(_) => ContractVersion::V2,
        }
    }

    pub fn v2(&self) -> Option<&V2Spec> {
        match self {
            Contract::V1 => None,
            Contract::V2(v2) => Some(v2),
        }
    }

    pub fn v2_mut(&mut self) -> Option<&mut V2Spec> {
        match self {
            Contract::V1 => None,
            Contract::V2(v2) => Some(v2),
        }
    }
}

/// Contract v2's cache layout and prefill graph, beyond the geometry ([`KvSpec`]). Stored in the
/// manifest under the keys named on each field, each omitted when 0 (or empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct V2Spec {
    /// `slidingCacheRows`: a sliding layer's cache is a ring of this many rows (position `p` in
    /// row `p mod rows`, [`crate::ring`]); 0 = a linear cache of `maxPositions` rows like a
    /// global layer's.
    #[serde(skip_serializing_if = "is_zero")]
    pub sliding_cache_rows: usize,
    /// `prefillChunk`: the rows of its prefill graph, a chunk graph that long prefills run in
    /// pieces of this size before the chunk graph takes the rest; 0 = none (a prefill is chunk
    /// calls only).
    #[serde(skip_serializing_if = "is_zero")]
    pub prefill_chunk: usize,
    /// `prefillSpan`: the rows of each cache the prefill graph reads, from row 0
    /// ([`Self::span_rows`]); 0 = every row. The prefill graph runs only in a prefill, whose
    /// calls start at position 0 and end at or before `seq` rounded up to `prefillChunk`, so
    /// the rows after that hold no position any of its calls sees (checked per call).
    #[serde(skip_serializing_if = "is_zero")]
    pub prefill_span: usize,
    /// `prefillSpans`: ascending spans of the prefill graph's token-less variants
    /// (`<prefill function>_span<S>`, the new K/V rows only): a prefill call other than its
    /// last, ending at or before `S`, runs the smallest that holds it and so reads `S` rows of
    /// each cache (not all of them) and skips the LM head.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefill_spans: Vec<usize>,
    /// `smallChunk`: the rows of a second chunk graph beside the `chunk`-row one
    /// (`<chunk function>_rows<S>`, the chunk graph's arguments and results over `S` rows): a
    /// feed's piece of at most `S` ids runs it instead ([`Self::chunk_rows`]); 0 = none.
    #[serde(skip_serializing_if = "is_zero")]
    pub small_chunk: usize,
    /// `smallChunkSpan`: the span of the small chunk graph's variant
    /// (`<chunk function>_rows<S>_span<N>`, the small graph's arguments and results with `N`
    /// rows of each cache, [`Self::span_rows`]): a small chunk call ending at or before
    /// position `N` runs it, and so reads `N` rows of each cache, not all of them; 0 = none.
    #[serde(skip_serializing_if = "is_zero")]
    pub small_chunk_span: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl V2Spec {
    /// Whether every key is 0 or empty: what a v1 manifest must hold.
    pub fn is_empty(&self) -> bool {
        *self == V2Spec::default()
    }

    /// The first key that is set, for the error of a v1 manifest that sets one.
    pub(crate) fn first_key_set(&self) -> Option<&'static str> {
        [
            ("slidingCacheRows", self.sliding_cache_rows != 0),
            ("prefillChunk", self.prefill_chunk != 0),
            ("prefillSpan", self.prefill_span != 0),
            ("prefillSpans", !self.prefill_spans.is_empty()),
            ("smallChunk", self.small_chunk != 0),
            ("smallChunkSpan", self.small_chunk_span != 0),
        ]
        .into_iter()
        .find_map(|(key, set)| set.then_some(key))
    }

    /// The layout of a v2 export of `spec`: a ring of `spec.ring_rows(ring_slack)` rows, a
    /// prefill graph of [`Self::prefill_chunk_rows`] (`prefill_rows`) rows when `prefill`, and
    /// its default spans ([`Self::default_prefill_spans`]) unless `spans` are given, and a small
    /// chunk graph of [`Self::small_chunk_rows`] (`small_rows`) rows.
    pub fn for_export(
        spec: &KvSpec,
        ring_slack: Option<usize>,
        prefill: bool,
        prefill_rows: Option<usize>,
        spans: Option<Vec<usize>>,
        small_rows: Option<usize>,
    ) -> V2Spec {
        let mut v2 = V2Spec {
            sliding_cache_rows: spec.ring_rows(ring_slack),
            small_chunk: Self::small_chunk_rows(spec, small_rows),
            ..V2Spec::default()
        };
        v2.small_chunk_span = v2.default_small_chunk_span(spec);
        if prefill {
            v2.prefill_chunk = v2.prefill_chunk_rows(spec, prefill_rows);
        }
        if v2.prefill_chunk != 0 {
            let (span, default_spans) = v2.default_prefill_spans(spec);
            v2.prefill_span = span;
            v2.prefill_spans = spans.unwrap_or(default_spans);
        }
        v2
    }

    /// Checks the layout against the geometry (which [`KvSpec::validate`] checked); the error
    /// names the offending key.
    pub fn validate(&self, spec: &KvSpec) -> Result<()> {
        self.check_limits()?;
        self.validate_ring(spec)?;
        let rows = self.prefill_chunk;
        if rows != 0
            && (rows <= spec.chunk
                || rows > spec.max_positions
                || (self.sliding_cache_rows != 0 && rows > self.sliding_cache_rows))
        {
            return Err(Error::manifest(
                "prefillChunk",
                format!(
                    "{rows} rows must exceed chunk {} and fit maxPositions {} and a sliding ring ({} rows)",
                    spec.chunk, spec.max_positions, self.sliding_cache_rows
                ),
            ));
        }
        if self.small_chunk >= spec.chunk {
            return Err(Error::manifest(
                "smallChunk",
                format!("{} rows must be fewer than chunk {}", self.small_chunk, spec.chunk),
            ));
        }
        let span = self.small_chunk_span;
        if span != 0 && (self.small_chunk == 0 || span < self.small_chunk || span >= spec.max_positions) {
            return Err(Error::manifest(
                "smallChunkSpan",
                format!(
                    "{span} rows must hold the small chunk graph's {} (0 = none) and be fewer than maxPositions {}",
                    self.small_chunk, spec.max_positions
                ),
            ));
        }
        self.validate_spans(spec)
    }

    /// Every count bounded by [`crate::limits`] before anything is computed from it.
    fn check_limits(&self) -> Result<()> {
        let key = |k: &str| format!("spec `{k}`");
        for (k, value) in [
            ("slidingCacheRows", self.sliding_cache_rows),
            ("prefillChunk", self.prefill_chunk),
            ("prefillSpan", self.prefill_span),
            ("prefillSpans", self.prefill_spans.len()),
            ("smallChunk", self.small_chunk),
            ("smallChunkSpan", self.small_chunk_span),
        ] {
            crate::limits::check_positions(key(k), value)?;
        }
        for &s in &self.prefill_spans {
            crate::limits::check_positions(key("prefillSpans"), s)?;
        }
        Ok(())
    }

    fn validate_ring(&self, spec: &KvSpec) -> Result<()> {
        let rows = self.sliding_cache_rows;
        if rows == 0 {
            return Ok(());
        }
        let (w, c, p) = (spec.sliding_window, spec.chunk, spec.max_positions);
        let problem = if w == 0 {
            Some("set without a sliding window".to_string())
        } else if rows <= w || rows < c || rows >= p {
            Some(format!(
                "a ring of {rows} rows must exceed slidingWindow {w}, hold a chunk ({c}) and stay below maxPositions {p}"
            ))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::manifest("slidingCacheRows", problem)),
            None => Ok(()),
        }
    }

    fn validate_spans(&self, spec: &KvSpec) -> Result<()> {
        let rows = self.prefill_chunk;
        let span = self.prefill_span;
        if span != 0 {
            let needed = spec.seq.div_ceil(rows.max(1)) * rows;
            if rows == 0 || span < needed || span >= spec.max_positions {
                return Err(Error::manifest(
                    "prefillSpan",
                    format!(
                        "{span} must hold a prefill of seq {} in calls of prefillChunk {rows} ({needed} rows) and stay below maxPositions {}",
                        spec.seq, spec.max_positions
                    ),
                ));
            }
        }
        let top = self.prefill_graph_span(spec);
        let mut below = 0;
        for &s in &self.prefill_spans {
            if rows == 0 || s < rows || s <= below || s >= top {
                return Err(Error::manifest(
                    "prefillSpans",
                    format!(
                        "{:?}: ascending spans of at least prefillChunk {rows}, each below the prefill graph's span {top}",
                        self.prefill_spans
                    ),
                ));
            }
            below = s;
        }
        Ok(())
    }

    /// The span of the prefill graph itself (`prefillSpan`, or `maxPositions`).
    pub fn prefill_graph_span(&self, spec: &KvSpec) -> usize {
        match self.prefill_span {
            0 => spec.max_positions,
            span => span,
        }
    }

    /// The rows of a layer kind's cache (`[rows, nKV, d]`).
    pub fn cache_rows(&self, spec: &KvSpec, kind: LayerKind) -> usize {
        match kind {
            LayerKind::Sliding if self.sliding_cache_rows > 0 => self.sliding_cache_rows,
            _ => spec.max_positions,
        }
    }

    /// Whether a layer kind's cache is a ring ([`crate::ring`]).
    pub fn is_ring(&self, spec: &KvSpec, kind: LayerKind) -> bool {
        self.cache_rows(spec, kind) != spec.max_positions
    }

    /// The rows of a layer kind's cache that a graph reading `span` rows takes (its first
    /// `span` rows, or all of a smaller cache).
    pub fn span_rows(&self, spec: &KvSpec, kind: LayerKind, span: usize) -> usize {
        self.cache_rows(spec, kind).min(span)
    }

    /// The geometry and layout a graph reading `span` rows of each cache sees, for calls that
    /// end at or before position `span`: every cache has [`Self::span_rows`] rows, and a ring
    /// of at least `span` rows reads as a linear cache (no call so far has wrapped it, so row
    /// `k` holds position `k`, which the linear masks say too). A smaller ring stays a ring of
    /// its own rows. `span` at or above `maxPositions` changes nothing but the spans.
    pub fn spanned(&self, spec: &KvSpec, span: usize) -> (KvSpec, V2Spec) {
        let mut spec = spec.clone();
        let mut v2 = self.clone();
        if span < spec.max_positions {
            spec.max_positions = span;
            if v2.sliding_cache_rows >= span {
                v2.sliding_cache_rows = 0;
            }
        }
        v2.prefill_span = 0;
        v2.prefill_spans.clear();
        (spec, v2)
    }

    /// The spans an export gives the prefill graph by default: the graph's own (`seq` rounded
    /// up to `prefillChunk`, if below `maxPositions`) and token-less variants at twice
    /// `prefillChunk`, doubling, below it (at most [`MAX_PREFILL_SPANS`] of them: each is one
    /// more function to compile). `(0, [])` without a prefill graph.
    pub fn default_prefill_spans(&self, spec: &KvSpec) -> (usize, Vec<usize>) {
        let rows = self.prefill_chunk;
        if rows == 0 {
            return (0, Vec::new());
        }
        let needed = spec.seq.div_ceil(rows) * rows;
        let span = if needed < spec.max_positions { needed } else { 0 };
        let top = if span == 0 { spec.max_positions } else { span };
        let mut spans: Vec<usize> = std::iter::successors(Some(2 * rows), |s| Some(s * 2))
            .take_while(|&s| s < top)
            .collect();
        let extra = spans.len().saturating_sub(MAX_PREFILL_SPANS);
        spans.drain(..extra);
        (span, spans)
    }

    /// The rows of the smallest chunk graph that holds a piece of `n` ids: the small chunk
    /// graph's (`smallChunk`) when it holds them, else the chunk graph's (`chunk`; a piece of
    /// more is refused by the plan).
    pub fn chunk_rows(&self, spec: &KvSpec, n: usize) -> usize {
        match self.small_chunk {
            0 => spec.chunk,
            small if n <= small => small,
            _ => spec.chunk,
        }
    }

    /// The span of the small chunk graph's variant an export makes by default:
    /// [`DEFAULT_SMALL_CHUNK_SPAN`] rounded up to the small graph's rows, 0 (none) without a
    /// small graph or where the span would not be fewer than `maxPositions`.
    pub fn default_small_chunk_span(&self, spec: &KvSpec) -> usize {
        match DEFAULT_SMALL_CHUNK_SPAN.max(self.small_chunk) {
            _ if self.small_chunk == 0 => 0,
            span if span < spec.max_positions => span,
            _ => 0,
        }
    }

    /// The span a small chunk call at `position` of `rows` rows reads: the small graph's
    /// variant's ([`Self::small_chunk_span`]) when the call ends within it, else every row
    /// (`maxPositions`).
    pub fn small_chunk_reads(&self, spec: &KvSpec, position: usize, rows: usize) -> usize {
        match self.small_chunk_span {
            span if span != 0 && position + rows <= span => span,
            _ => spec.max_positions,
        }
    }

    /// The rows the small chunk graph would have for `rows` requested (`None`:
    /// [`DEFAULT_SMALL_CHUNK`]): 0 (none) unless fewer than a chunk's.
    pub fn small_chunk_rows(spec: &KvSpec, rows: Option<usize>) -> usize {
        match rows.unwrap_or(DEFAULT_SMALL_CHUNK) {
            rows if rows < spec.chunk => rows,
            _ => 0,
        }
    }

    /// The rows the prefill graph would have for `rows` requested (`None`:
    /// [`DEFAULT_PREFILL_CHUNK`]): at most the sliding ring, 0 (none) when that is not more than
    /// a chunk.
    pub fn prefill_chunk_rows(&self, spec: &KvSpec, rows: Option<usize>) -> usize {
        let mut rows = rows.unwrap_or(DEFAULT_PREFILL_CHUNK).min(spec.max_positions);
        if self.sliding_cache_rows != 0 {
            rows = rows.min(self.sliding_cache_rows);
        }
        if rows > spec.chunk {
            rows
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The version's number is what the manifest stores, and only the numbers of the two
    /// contracts read back.
    #[test]
    fn versions_round_trip_through_their_numbers() {
        for version in [ContractVersion::V1, ContractVersion::V2] {
            assert_eq!(ContractVersion::try_from(version.number()), Ok(version));
            assert_eq!(version.to_string(), version.number().to_string());
        }
        assert_eq!(ContractVersion::V1.number(), V1_VERSION);
        assert_eq!(ContractVersion::V2.number(), V2_VERSION);
        assert_eq!(ContractVersion::default(), ContractVersion::V1);
        assert!(
            ContractVersion::V1 < ContractVersion::V2,
            "`auto` takes the least of several targets'"
        );
        for bad in [0, 3, u32::MAX] {
            assert_eq!(ContractVersion::try_from(bad), Err(UnknownContractVersion(bad)));
        }
        assert_eq!(Contract::V1.version(), ContractVersion::V1);
        assert_eq!(Contract::V2(V2Spec::default()).version(), ContractVersion::V2);
    }
}
