//! Contract v2's ring caches (`docs/contract-v2.md`): a sliding layer keeps `rows` rows, more
//! than its window, and position `p` lives in row `p mod rows`. A call at `position` reads the
//! whole ring (each row holds the latest position before `position` with its residue) and the
//! runtime writes the call's new rows after it, wrapping around. These functions are that
//! arithmetic, shared by the graphs' masks, the runtime and the tests.

use std::ops::Range;

/// The ring row of `position`.
pub fn row(rows: usize, position: usize) -> usize {
    position % rows
}

/// The position row `row` holds before a call at `position`: the latest `p < position` with
/// `p ≡ row (mod rows)`; `None` if there is none (`p` would be negative).
pub fn position_of(rows: usize, position: usize, row: usize) -> Option<usize> {
    debug_assert!(row < rows);
    let last = position.checked_sub(1)?;
    let back = (last + rows - row) % rows;
    last.checked_sub(back)
}

/// The ring rows that positions `span` occupy: one run, or two when it wraps. `span` must not be
/// longer than the ring.
pub fn runs(rows: usize, span: Range<usize>) -> Vec<Range<usize>> {
    let n = span.len();
    assert!(n <= rows, "{n} positions do not fit a ring of {rows} rows");
    let start = row(rows, span.start);
    let end = start + n;
    [start..end.min(rows), 0..end.saturating_sub(rows)]
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect()
}

/// The positions a snapshot at `position` needs a sliding layer to keep: the `window` before it
/// (what a contract v1 chunk call hands a sliding layer; a query needs `window - 1`).
pub fn kept(window: usize, position: usize) -> Range<usize> {
    position.saturating_sub(window)..position
}

/// Whether writing positions `writes` into a ring of `rows` rows overwrites one of positions
/// `kept` (each in its row): a write of `q` replaces whatever row `q mod rows` holds, so it
/// destroys a kept `p` iff `p ≡ q (mod rows)`, `p == q` included (a rewrite may differ).
pub fn overwrites(rows: usize, kept: Range<usize>, writes: Range<usize>) -> bool {
    if kept.is_empty() || writes.is_empty() {
        return false;
    }
    if kept.len() >= rows || writes.len() >= rows {
        return true;
    }
    let (w, k) = (runs(rows, writes), runs(rows, kept));
    w.iter().any(|a| k.iter().any(|b| a.start < b.end && b.start < a.end))
}

/// The ring rows outside `taken` (disjoint runs of `0..rows`), in order: what a fork copies from
/// the old ring so that it never writes a row twice in one submission.
pub fn complement(rows: usize, taken: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut sorted: Vec<Range<usize>> = taken.iter().filter(|r| !r.is_empty()).cloned().collect();
    sorted.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut at = 0;
    for r in sorted {
        if r.start > at {
            out.push(at..r.start);
        }
        at = at.max(r.end);
    }
    if at < rows {
        out.push(at..rows);
    }
    out
}

#[cfg(test)]
// The expected values are lists of runs, one-run lists included.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn by_hand() {
        // A ring of 5: before a call at 7, rows hold positions 5, 6, 2, 3, 4.
        let held: Vec<_> = (0..5).map(|r| position_of(5, 7, r)).collect();
        assert_eq!(held, [Some(5), Some(6), Some(2), Some(3), Some(4)]);
        // Before a call at 2 only rows 0 and 1 hold anything.
        let held: Vec<_> = (0..5).map(|r| position_of(5, 2, r)).collect();
        assert_eq!(held, [Some(0), Some(1), None, None, None]);
        assert_eq!(runs(5, 3..7), [3..5, 0..2]);
        assert_eq!(runs(5, 5..10), [0..5]);
        assert!(runs(5, 4..4).is_empty());
        assert_eq!(kept(3, 7), 4..7);
        assert_eq!(kept(3, 2), 0..2);
        // Writing 7..9 (rows 2, 3) destroys 2 and 3, not 4..7.
        assert!(!overwrites(5, 4..7, 7..9));
        assert!(overwrites(5, 3..7, 7..9));
        // Rewriting a kept position counts.
        assert!(overwrites(5, 4..7, 6..7));
        assert_eq!(complement(5, &[3..5, 0..1]), [1..3]);
        assert_eq!(complement(5, &[]), [0..5]);
    }
}
