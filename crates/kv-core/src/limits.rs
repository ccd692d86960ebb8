//! Upper bounds on every size a caller, a manifest or a file can ask for.
//!
//! Sizes from flags (`--seq`, `--chunk`, `--max-new`, ...), from a manifest (`maxPositions`,
//! `vocabSize`, ...) or from a snapshot header decide allocations later: caches of `maxPositions`
//! rows, masks and attention scores of `chunk × (maxPositions + chunk)`, redecode logits of
//! `seq × vocabSize`. An allocation Rust cannot make aborts the process instead of returning an
//! error (`redecode --seq 4000000000` asked for 256 GB and died of SIGABRT), so every such size
//! is checked here, before it is used, and a size out of bounds is an [`Error::TooLarge`] naming
//! the field, its value and the limit. The CLI checks its flags with the same functions under the
//! flags' names; the library checks again wherever a size enters it, so JNI callers are bounded
//! too.
//!
//! The bounds are sanity limits far above any model this runtime serves (Gemma 3 270M: 18
//! layers, 4 heads of 256, vocabulary 262,144, 32,768 positions), not a memory budget: a size
//! under them may still be more than a device has, which then fails as that device fails.
//!
//! | what | limit |
//! | --- | --- |
//! | `nLayers` | [`MAX_LAYERS`] |
//! | `nHeads`, `nKvHeads` | [`MAX_HEADS`] |
//! | `headDim` | [`MAX_HEAD_DIM`] |
//! | `hiddenSize` | [`MAX_HIDDEN`] |
//! | `architecture.ffnSize` | [`MAX_FFN`] |
//! | `vocabSize` | [`MAX_VOCAB`] |
//! | `maxPositions`, and every count of positions or tokens (`seq`, `chunk`, `slidingWindow`, a prefix, `--max-new`, ...) | [`MAX_POSITIONS`] |
//! | `topK`, `--top-k` | [`MAX_TOP_K`] |
//! | a benchmark's `--utterances`, `--repeat` | [`MAX_REPEATS`] |
//! | one buffer a geometry implies (a layer's cache, a chunk call's scores, a prefill's scores, redecode logits, the embedding table) | [`MAX_BUFFER_BYTES`] |
//! | every layer's caches together | [`MAX_CACHE_BYTES`] |
//!
//! The checks of a whole geometry are `KvSpec::validate`'s and `KvSpec::check_redecode_seq`'s
//! (in `spec`), so this module imports nothing but the error type.

use crate::error::{Error, Result};

/// Layers of a model.
pub const MAX_LAYERS: usize = 1024;
/// Query heads and KV heads of a layer.
pub const MAX_HEADS: usize = 1024;
/// Width of one attention head.
pub const MAX_HEAD_DIM: usize = 4096;
/// Width of the residual stream.
pub const MAX_HIDDEN: usize = 1 << 16;
/// Width of the feed-forward layer.
pub const MAX_FFN: usize = 1 << 18;
/// Tokens of a vocabulary (the largest served today has 262,144).
pub const MAX_VOCAB: usize = 1 << 22;
/// Positions of a context, and so of anything counted in tokens: a graph's rows (`seq`,
/// `chunk`, `prefillChunk`), a window, a ring, a prefix, a prompt, the tokens to generate.
pub const MAX_POSITIONS: usize = 1 << 20;
/// Logits a graph returns per call for sampling (`topK`).
pub const MAX_TOP_K: usize = 1 << 16;
/// Repetitions a caller asks for (a benchmark's utterances and repeats): each keeps a timing.
pub const MAX_REPEATS: usize = 1 << 20;
/// Bytes of the largest single buffer a geometry implies, counted in f32.
pub const MAX_BUFFER_BYTES: u64 = 16 << 30;
/// Bytes of one session's caches, every layer's K and V, counted in f32.
pub const MAX_CACHE_BYTES: u64 = 64 << 30;

/// `value` of `what` (a flag such as `--seq`, or a field such as ``spec `seq` ``) must not exceed
/// `limit`, which `bound` names (`kv_core::limits::MAX_POSITIONS`, `the model's maxPositions`).
pub fn check(what: impl AsRef<str>, value: usize, limit: usize, bound: &str) -> Result<()> {
    if value > limit {
        return Err(too_large(what.as_ref(), value as u128, limit as u128, bound));
    }
    Ok(())
}

/// [`check`] against [`MAX_POSITIONS`]: for any count of tokens or positions.
pub fn check_positions(what: impl AsRef<str>, value: usize) -> Result<()> {
    check(what, value, MAX_POSITIONS, "kv_core::limits::MAX_POSITIONS")
}

/// [`check`] against [`MAX_REPEATS`]: for counts of repetitions.
pub fn check_repeats(what: impl AsRef<str>, value: usize) -> Result<()> {
    check(what, value, MAX_REPEATS, "kv_core::limits::MAX_REPEATS")
}

/// A buffer of `elements` f32 values (computed without overflow by the caller as a product of
/// checked sizes) must fit [`MAX_BUFFER_BYTES`]; `what` says which buffer and its shape.
pub fn check_buffer(what: impl AsRef<str>, elements: u128) -> Result<()> {
    let bytes = elements.saturating_mul(4);
    if bytes > MAX_BUFFER_BYTES as u128 {
        return Err(too_large(
            &format!("{} (bytes)", what.as_ref()),
            bytes,
            MAX_BUFFER_BYTES as u128,
            "kv_core::limits::MAX_BUFFER_BYTES",
        ));
    }
    Ok(())
}

pub(crate) fn too_large(what: &str, value: u128, limit: u128, bound: &str) -> Error {
    Error::TooLarge {
        what: what.to_string(),
        value,
        limit,
        bound: bound.to_string(),
    }
}

/// `topK` of a manifest or `--top-k` of a caller: within [`MAX_TOP_K`].
pub fn check_top_k(what: impl AsRef<str>, k: usize) -> Result<()> {
    check(what, k, MAX_TOP_K, "kv_core::limits::MAX_TOP_K")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_over_its_limit_names_it_the_value_and_the_limit() {
        let e = check_positions("--seq", 4_000_000_000).unwrap_err();
        assert!(
            matches!(&e, Error::TooLarge { what, value: 4_000_000_000, limit, .. }
                if what == "--seq" && *limit == MAX_POSITIONS as u128),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("--seq") && text.contains("4000000000") && text.contains("1048576"),
            "{text}"
        );
        assert!(!text.contains('\n'));
    }
}
