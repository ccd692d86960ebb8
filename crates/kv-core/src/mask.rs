//! Which key a query attends to, and the chunk graph's additive mask built from that rule.
//! One rule for every path: the prefill graph applies it in-graph, the chunk mask encodes it, and
//! the step call encodes it through the rows it passes (see [`crate::window`]).

/// Additive mask value of a masked key (CONTRACT §2).
pub const MASKED: f32 = -1e30;

/// A query at absolute position `query` sees key `key` iff `key <= query` and, with a window,
/// `key > query - window` (`window` keys counting itself, as Hugging Face and llama.cpp define it).
pub fn attends(query: usize, key: usize, window: Option<usize>) -> bool {
    key <= query && window.is_none_or(|w| key + w > query)
}

/// The chunk graph's mask, `[1, heads, chunk, past + chunk]`, row-major.
///
/// Row `i` has absolute position `pos + i`. Column `j < past` is the key at absolute
/// `pos - past + j`; column `j >= past` is chunk row `j - past`. A real row (`i < n`) attends
/// by [`attends`]; a padding row (`i >= n`) attends only to itself, so its softmax stays finite.
pub fn chunk_mask(pos: usize, past: usize, n: usize, chunk: usize, window: Option<usize>, heads: usize) -> Vec<f32> {
    assert!(past <= pos, "chunk_mask: past {past} rows exceed position {pos}");
    assert!(n <= chunk, "chunk_mask: {n} real rows exceed chunk {chunk}");
    let cols = past + chunk;
    let mut head = vec![MASKED; chunk * cols];
    for i in 0..chunk {
        let row = &mut head[i * cols..(i + 1) * cols];
        if i >= n {
            row[past + i] = 0.0;
            continue;
        }
        let query = pos + i;
        for (j, cell) in row.iter_mut().enumerate() {
            let key = pos - past + j;
            let real_key = j < past || j - past < n;
            if real_key && attends(query, key, window) {
                *cell = 0.0;
            }
        }
    }
    let mut mask = Vec::with_capacity(heads * head.len());
    for _ in 0..heads {
        mask.extend_from_slice(&head);
    }
    mask
}

/// The prefill graph's mask over `[seq, seq]` (positions `0..seq`), additive, one head. Padding
/// rows attend causally like real rows: the graph does not know `n`, and the causal rule keeps
/// real rows independent of them.
pub fn prefill_mask(seq: usize, window: Option<usize>) -> Vec<f32> {
    let mut mask = vec![MASKED; seq * seq];
    for q in 0..seq {
        for k in 0..seq {
            if attends(q, k, window) {
                mask[q * seq + k] = 0.0;
            }
        }
    }
    mask
}
