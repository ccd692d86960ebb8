//! The window arithmetic against small hand-written tables of exact rows and positions.

use kv_core::mask::{attends, chunk_mask, MASKED};
use kv_core::window::{past_rows, plan_chunk, plan_chunked_prefill, plan_prefill, plan_step, step_keys, PastCall};
use kv_core::{ring, Error, KvSpec, LayerKind, V2Spec, WindowRule};
use proptest::prelude::*;

fn spec(window: usize) -> KvSpec {
    KvSpec {
        n_layers: 6,
        head_dim: 4,
        n_heads: 2,
        n_kv_heads: 1,
        hidden_size: 8,
        vocab_size: 10,
        sliding_window: window,
        global_layer_period: 3,
        chunk: 4,
        seq: 8,
        max_positions: 20,
        sliding_rope_base: 10_000.0,
        global_rope_base: 1_000_000.0,
        mask_heads: 0,
    }
}

#[test]
fn layer_kinds_follow_the_period() {
    let s = spec(4);
    let kinds: Vec<_> = (0..6).map(|l| s.layer_kind(l)).collect();
    use LayerKind::*;
    assert_eq!(kinds, [Sliding, Sliding, Global, Sliding, Sliding, Global]);
    assert_eq!(s.first_layer_of(Global), Some(2));
    // No window: every layer is global.
    assert!((0..6).all(|l| spec(0).layer_kind(l) == Global));
}

#[test]
fn past_rows_per_call_and_position() {
    let s = spec(4);
    // (position, chunk past, exact step past, seed step past) on a sliding layer of window 4.
    let table = [(1, 1, 1, 1), (3, 3, 3, 3), (4, 4, 3, 4), (5, 4, 3, 4), (17, 4, 3, 4)];
    for (pos, chunk, exact, seed) in table {
        assert_eq!(
            past_rows(&s, LayerKind::Sliding, PastCall::Chunk, pos, WindowRule::Exact),
            chunk,
            "chunk at {pos}"
        );
        assert_eq!(
            past_rows(&s, LayerKind::Sliding, PastCall::Step, pos, WindowRule::Exact),
            exact,
            "step at {pos}"
        );
        assert_eq!(
            past_rows(&s, LayerKind::Sliding, PastCall::Step, pos, WindowRule::SeedStep),
            seed,
            "seed step at {pos}"
        );
        assert_eq!(
            past_rows(&s, LayerKind::Global, PastCall::Step, pos, WindowRule::Exact),
            pos
        );
    }
    // Exact: a step at position 9 with window 4 sees keys 6, 7, 8 and itself.
    assert_eq!(step_keys(&s, LayerKind::Sliding, 9, WindowRule::Exact), 6..10);
    assert_eq!(step_keys(&s, LayerKind::Sliding, 9, WindowRule::SeedStep), 5..10);
}

#[test]
fn attends_counts_the_query_itself() {
    // Window 3 at query 5: keys 3, 4, 5.
    let seen: Vec<usize> = (0..8).filter(|&k| attends(5, k, Some(3))).collect();
    assert_eq!(seen, [3, 4, 5]);
    let seen: Vec<usize> = (0..8).filter(|&k| attends(5, k, None)).collect();
    assert_eq!(seen, [0, 1, 2, 3, 4, 5]);
}

#[test]
fn chunk_mask_by_hand() {
    // pos 5, past 3 (keys 2, 3, 4), chunk 3 with 2 real rows, window 3, one head.
    let m = chunk_mask(5, 3, 2, 3, Some(3), 1);
    let o = 0.0;
    let x = MASKED;
    #[rustfmt::skip]
    let want = [
        // keys: 2  3  4 | c0 c1 c2
        /* a=5 */ x, o, o,  o, x, x,
        /* a=6 */ x, x, o,  o, o, x,
        /* pad */ x, x, x,  x, x, o,
    ];
    assert_eq!(m, want);
    // Heads repeat the same rows.
    assert_eq!(chunk_mask(5, 3, 2, 3, Some(3), 2), [want, want].concat());
}

#[test]
fn plans_validate_before_anything_runs() {
    let s = spec(4);
    assert!(matches!(plan_chunk(&s, 0, &[1]), Err(Error::NotPrefilled { .. })));
    assert!(matches!(plan_chunk(&s, 3, &[]), Err(Error::BadTokenCount { n: 0, .. })));
    assert!(matches!(
        plan_chunk(&s, 3, &[1; 5]),
        Err(Error::BadTokenCount { n: 5, max: 4, .. })
    ));
    assert!(matches!(
        plan_chunk(&s, 3, &[1, 10]),
        Err(Error::TokenOutOfRange { index: 1, id: 10, .. })
    ));
    assert!(matches!(
        plan_chunk(&s, 3, &[-1]),
        Err(Error::TokenOutOfRange { id: -1, .. })
    ));
    assert!(matches!(
        plan_chunk(&s, 18, &[1, 2, 3]),
        Err(Error::ContextOverflow { .. })
    ));
    assert!(matches!(
        plan_step(&s, 20, 1, WindowRule::Exact),
        Err(Error::ContextOverflow { .. })
    ));
    let plan = plan_chunk(&s, 6, &[1, 2]).unwrap();
    assert_eq!(plan.tokens, [1, 2, 0, 0]);
    assert_eq!(plan.select, [0.0, 1.0, 0.0, 0.0]);
    assert_eq!(plan.kind(LayerKind::Sliding).past, 4);
    assert_eq!(plan.kind(LayerKind::Global).past, 6);
    assert_eq!(plan.kind(LayerKind::Global).mask.len(), 2 * 4 * (6 + 4));
    assert_eq!(plan.kind(LayerKind::Sliding).rope.start, 6);
}

/// A prefill fed as chunk calls from an empty cache: pieces of C tokens at positions 0, C, ...;
/// the first sees no past rows (a mask over its own rows only), later ones are exactly the plans
/// of ordinary chunk calls at their position.
#[test]
fn chunked_prefill_is_chunk_calls_from_an_empty_cache() {
    let s = spec(4);
    let tokens = [1, 2, 3, 4, 5, 6, 7];
    let plans = plan_chunked_prefill(&s, &tokens).unwrap();
    assert_eq!(plans.len(), 2);
    assert_eq!((plans[0].position, plans[0].n), (0, 4));
    assert_eq!((plans[1].position, plans[1].n), (4, 3));
    for k in &plans[0].kinds {
        assert_eq!(k.past, 0);
        assert_eq!(
            k.mask,
            chunk_mask(0, 0, 4, s.chunk, s.window(k.kind), s.mask_head_count())
        );
    }
    let later = plan_chunk(&s, 4, &tokens[4..]).unwrap();
    assert_eq!(plans[1].tokens, later.tokens);
    assert_eq!(plans[1].select, later.select);
    for (a, b) in plans[1].kinds.iter().zip(&later.kinds) {
        assert_eq!(
            (a.kind, a.past, &a.mask, &a.rope.cos),
            (b.kind, b.past, &b.mask, &b.rope.cos)
        );
    }
    // One token: one call whose select picks row 0.
    let one = plan_chunked_prefill(&s, &[9]).unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].select[0], 1.0);
    // It refuses exactly what a prefill refuses, before planning anything.
    for bad in [&[][..], &[1; 9][..], &[1, 10][..], &[-1][..]] {
        let chunked = plan_chunked_prefill(&s, bad).unwrap_err().to_string();
        assert_eq!(chunked, plan_prefill(&s, bad).unwrap_err().to_string());
    }
}

/// Contract v2's ring sizes: window 4, chunk 4, maxPositions 20.
#[test]
fn ring_rows_and_their_checks() {
    let s = spec(4);
    // 4 + 128 rounded to 64 is 192 >= 20: no ring; a slack of 3: 7 rows; of 0: 5 (one more than
    // the window); without a window: none.
    assert_eq!(s.ring_rows(None), 0);
    assert_eq!(s.ring_rows(Some(3)), 7);
    assert_eq!(s.ring_rows(Some(0)), 5);
    assert_eq!(spec(0).ring_rows(Some(3)), 0);
    assert_eq!(KvSpec::default().ring_rows(None), 640);
    let v = V2Spec {
        sliding_cache_rows: 7,
        ..V2Spec::default()
    };
    v.validate(&s).unwrap();
    assert_eq!(
        (
            v.cache_rows(&s, LayerKind::Sliding),
            v.cache_rows(&s, LayerKind::Global)
        ),
        (7, 20)
    );
    assert!(v.is_ring(&s, LayerKind::Sliding) && !v.is_ring(&s, LayerKind::Global));
    // No more rows than the window, fewer than a chunk, not below maxPositions, no window.
    for (rows, window, chunk) in [(4, 4, 4), (5, 4, 6), (20, 4, 4), (7, 0, 4)] {
        let geometry = KvSpec {
            sliding_window: window,
            chunk,
            ..s.clone()
        };
        let bad = V2Spec {
            sliding_cache_rows: rows,
            ..V2Spec::default()
        };
        match bad.validate(&geometry) {
            Err(Error::Manifest { key, .. }) => assert_eq!(key, "slidingCacheRows", "rows {rows}"),
            other => panic!("rows {rows}, window {window}: {other:?}"),
        }
    }
}

proptest! {
    /// The ring against a linear cache: after writing positions `0..position` in calls of up to
    /// `chunk` rows, every row holds `ring::position_of`, every key a query of the next call may
    /// see (`attends`) is held, and `overwrites` says exactly whether a write destroyed a
    /// position a snapshot keeps.
    #[test]
    fn ring_matches_a_linear_cache(
        window in 2usize..24,
        slack in 0usize..20,
        position in 0usize..120,
        chunk in 1usize..12,
        kept_at in 0usize..120,
        write_len in 1usize..12,
    ) {
        let rows = window + slack.max(1);
        prop_assume!(chunk <= rows && write_len <= rows);
        let written = |position: usize| {
            let mut ring = vec![None; rows];
            let mut at = 0;
            while at < position {
                let end = (at + chunk).min(position);
                for q in at..end {
                    ring[ring::row(rows, q)] = Some(q);
                }
                at = end;
            }
            ring
        };
        let ring = written(position);
        for (r, held) in ring.iter().enumerate() {
            prop_assert_eq!(*held, ring::position_of(rows, position, r));
        }
        for i in 0..chunk {
            for key in 0..position {
                if attends(position + i, key, Some(window)) {
                    prop_assert_eq!(ring[ring::row(rows, key)], Some(key));
                }
            }
        }
        // A snapshot at kept_at <= position keeps its window; then a write of write_len.
        let s = kept_at.min(position);
        let kept = ring::kept(window, s);
        let writes = s..s + write_len;
        let mut after = written(s);
        for q in writes.clone() {
            after[ring::row(rows, q)] = Some(q);
        }
        // Positions in `kept` stay intact iff their rows still hold them and were not rewritten.
        let destroyed = kept.clone().any(|p| after[ring::row(rows, p)] != Some(p) || writes.contains(&p));
        prop_assert_eq!(ring::overwrites(rows, kept, writes.clone()), destroyed);
        let taken = ring::runs(rows, writes.clone());
        let rest = ring::complement(rows, &taken);
        let covered: usize = taken.iter().chain(&rest).map(|r| r.len()).sum();
        prop_assert_eq!(covered, rows);
    }
}

/// What a cache row holds before a call at `position` in `spec`'s geometry and `v2`'s layout
/// for `kind`.
fn held(spec: &KvSpec, v2: &V2Spec, kind: LayerKind, position: usize, row: usize) -> Option<usize> {
    if v2.is_ring(spec, kind) {
        ring::position_of(v2.cache_rows(spec, kind), position, row)
    } else {
        (row < position).then_some(row)
    }
}

/// Contract v2's prefill spans: defaults, and the checks by key (window 4, chunk 4,
/// maxPositions 20, seq 8).
#[test]
fn prefill_spans_and_their_checks() {
    let s = KvSpec {
        max_positions: 40,
        seq: 12,
        ..spec(4)
    };
    let v = V2Spec {
        sliding_cache_rows: 7,
        prefill_chunk: 5,
        ..V2Spec::default()
    };
    // seq 12 in calls of 5 ends by 15; variants at 10 (twice 5), below 15.
    assert_eq!(v.default_prefill_spans(&s), (15, vec![10]));
    let long = KvSpec { seq: 40, ..s.clone() };
    // A prefill may reach maxPositions: the graph reads every row; the two largest of 10, 20.
    assert_eq!(v.default_prefill_spans(&long), (0, vec![10, 20]));
    assert_eq!(V2Spec::default().default_prefill_spans(&spec(4)), (0, vec![]));
    let ok = V2Spec {
        prefill_span: 15,
        prefill_spans: vec![5, 10],
        ..v.clone()
    };
    ok.validate(&s).unwrap();
    assert_eq!(ok.prefill_graph_span(&s), 15);
    assert_eq!(
        (
            ok.span_rows(&s, LayerKind::Sliding, 5),
            ok.span_rows(&s, LayerKind::Global, 5)
        ),
        (5, 5)
    );
    assert_eq!(
        (
            ok.span_rows(&s, LayerKind::Sliding, 15),
            ok.span_rows(&s, LayerKind::Global, 15)
        ),
        (7, 15)
    );
    for (span, spans, key) in [
        (10, vec![], "prefillSpan"), // a prefill of 12 in calls of 5 ends at 15
        (40, vec![], "prefillSpan"), // not below maxPositions
        (15, vec![10, 5], "prefillSpans"),
        (15, vec![4], "prefillSpans"),  // below a call
        (15, vec![15], "prefillSpans"), // not below the graph's own
        (0, vec![40], "prefillSpans"),
    ] {
        let bad = V2Spec {
            prefill_span: span,
            prefill_spans: spans.clone(),
            ..v.clone()
        };
        match bad.validate(&s) {
            Err(Error::Manifest { key: k, .. }) => assert_eq!(k, key, "{span} {spans:?}"),
            other => panic!("{span} {spans:?}: {other:?}"),
        }
    }
    let none = V2Spec {
        prefill_chunk: 0,
        prefill_spans: vec![10],
        ..v.clone()
    };
    assert!(matches!(none.validate(&s), Err(Error::Manifest { key, .. }) if key == "prefillSpans"));
}

proptest! {
    /// A call of `rows` at `position` ending by `span` sees through [`V2Spec::spanned`] the
    /// same keys in the same rows as through the whole caches: every row holding a key one of
    /// its queries attends lies within the span, and holds there the position the spanned
    /// geometry (linear, or a smaller ring) says.
    #[test]
    fn a_span_holds_every_row_a_call_sees(
        window in 2usize..24,
        slack in 1usize..20,
        extra in 1usize..60,
        position in 0usize..100,
        rows in 1usize..12,
        beyond in 0usize..40,
    ) {
        let ring_rows = window + slack;
        let s = KvSpec {
            sliding_window: window,
            chunk: 1,
            max_positions: ring_rows + extra,
            seq: 1,
            ..spec(window)
        };
        let v = V2Spec {
            sliding_cache_rows: ring_rows,
            ..V2Spec::default()
        };
        let span = position + rows + beyond;
        prop_assume!(span <= s.max_positions);
        let (spanned, spanned_v2) = v.spanned(&s, span);
        for kind in [LayerKind::Sliding, LayerKind::Global] {
            let n = v.span_rows(&s, kind, span);
            prop_assert_eq!(spanned_v2.cache_rows(&spanned, kind), n);
            for row in 0..v.cache_rows(&s, kind) {
                let full = held(&s, &v, kind, position, row);
                let seen = |p: Option<usize>| {
                    p.filter(|&p| (0..rows).any(|i| attends(position + i, p, s.window(kind))))
                };
                if row >= n {
                    prop_assert_eq!(seen(full), None, "row {} past the span {}", row, n);
                } else {
                    prop_assert_eq!(seen(full), seen(held(&spanned, &spanned_v2, kind, position, row)), "row {}", row);
                }
            }
        }
    }
}

/// Contract v2's prefill planning: pieces of `prefillChunk` rows while `big` says so, then
/// chunk calls, the last of the small chunk graph's rows where it holds what is left. Only
/// IREE's v2 backend plans wide or small pieces, so nothing else here would notice a piece
/// planned with the chunk's width.
#[test]
fn plan_pieces_takes_prefill_chunk_rows_while_big() {
    use kv_core::window::plan_pieces;
    let v2 = spec(3);
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    let shape = |plans: &[kv_core::window::ChunkPlan]| {
        plans
            .iter()
            .map(|p| (p.position, p.n, p.tokens.len()))
            .collect::<Vec<_>>()
    };
    let layout = |prefill_chunk, small_chunk| V2Spec {
        prefill_chunk,
        small_chunk,
        ..V2Spec::default()
    };
    let wide = plan_pieces(&v2, &layout(6, 0), &tokens, |left| left >= 6).unwrap();
    assert_eq!(shape(&wide), [(0, 6, 6), (6, 2, 4)]);
    assert_eq!(wide[0].tokens, [1, 2, 3, 4, 5, 6]);
    assert_eq!(wide[1].tokens, [7, 8, 0, 0]);
    let narrow = plan_pieces(&v2, &layout(6, 0), &tokens, |_| false).unwrap();
    assert_eq!(shape(&narrow), [(0, 4, 4), (4, 4, 4)]);
    // Without a prefill chunk the spec has no wide pieces, whatever `big` says.
    let none = plan_pieces(&spec(3), &layout(0, 0), &tokens, |_| true).unwrap();
    assert_eq!(shape(&none), [(0, 4, 4), (4, 4, 4)]);
    // A small chunk graph of 2 rows takes what is left when it holds it, padded to its rows.
    let small = plan_pieces(&v2, &layout(6, 2), &tokens, |left| left >= 6).unwrap();
    assert_eq!(shape(&small), [(0, 6, 6), (6, 2, 2)]);
    assert_eq!(small[1].tokens, [7, 8]);
    assert_eq!(small[1].select, [0.0, 1.0]);
    let tail = plan_pieces(&v2, &layout(0, 2), &tokens[..7], |_| false).unwrap();
    assert_eq!(shape(&tail), [(0, 4, 4), (4, 3, 4)]);
    let one = plan_pieces(&v2, &layout(0, 2), &tokens[..5], |_| false).unwrap();
    assert_eq!(shape(&one), [(0, 4, 4), (4, 1, 2)]);
    assert_eq!(one[1].tokens, [5, 0]);
}

/// The smallest chunk graph that holds a piece (`V2Spec::chunk_rows`), and a plan over it:
/// padded to its rows, refused past the chunk graph's like any chunk call.
#[test]
fn chunk_rows_pick_the_small_graph_up_to_its_rows() {
    use kv_core::window::plan_chunk_rows;
    let s = spec(3);
    let layout = V2Spec {
        small_chunk: 2,
        ..V2Spec::default()
    };
    let rows: Vec<usize> = (1..=4).map(|n| layout.chunk_rows(&s, n)).collect();
    assert_eq!(rows, [2, 2, 4, 4]);
    assert_eq!(V2Spec::default().chunk_rows(&s, 1), 4);
    let plan = plan_chunk_rows(&s, 2, 5, &[9]).unwrap();
    assert_eq!(
        (plan.position, plan.n, plan.tokens.len(), plan.select.len()),
        (5, 1, 2, 2)
    );
    assert_eq!(plan.kinds[0].rope.rows, 2);
    assert!(matches!(
        plan_chunk_rows(&s, layout.chunk_rows(&s, 5), 5, &[1; 5]),
        Err(Error::BadTokenCount { n: 5, max: 4, .. })
    ));
    assert!(matches!(
        plan_chunk_rows(&s, 2, 0, &[1]),
        Err(Error::NotPrefilled { .. })
    ));
    assert!(matches!(
        plan_chunk_rows(&s, 2, 5, &[]),
        Err(Error::BadTokenCount { n: 0, .. })
    ));
    assert_eq!(
        V2Spec::small_chunk_rows(&s, None),
        0,
        "8 rows are not fewer than a chunk of 4"
    );
    assert_eq!(V2Spec::small_chunk_rows(&s, Some(2)), 2);
    assert_eq!(V2Spec::small_chunk_rows(&s, Some(4)), 0);
}

/// The small chunk graph's span variant (`V2Spec::small_chunk_span`): taken by small calls
/// ending within it, the full small graph after; the default is the small graph's rows (none
/// without a small graph or at `maxPositions`), and the manifest refuses a span without a small
/// graph, below its rows or at `maxPositions`.
#[test]
fn small_chunk_span_serves_calls_ending_within_it() {
    let s = spec(3);
    let layout = V2Spec {
        small_chunk: 2,
        small_chunk_span: 4,
        ..V2Spec::default()
    };
    layout.validate(&s).unwrap();
    let reads: Vec<usize> = (0..4).map(|p| layout.small_chunk_reads(&s, p, 2)).collect();
    assert_eq!(reads, [4, 4, 4, s.max_positions]);
    let none = V2Spec {
        small_chunk: 2,
        ..V2Spec::default()
    };
    assert_eq!(none.small_chunk_reads(&s, 0, 2), s.max_positions);
    assert_eq!(
        none.default_small_chunk_span(&s),
        kv_core::contract::DEFAULT_SMALL_CHUNK_SPAN
    );
    assert_eq!(V2Spec::default().default_small_chunk_span(&s), 0);
    let short = KvSpec {
        max_positions: kv_core::contract::DEFAULT_SMALL_CHUNK_SPAN,
        ..spec(3)
    };
    assert_eq!(none.default_small_chunk_span(&short), 0);
    for bad in [
        V2Spec {
            small_chunk_span: 4,
            ..V2Spec::default()
        },
        V2Spec {
            small_chunk: 2,
            small_chunk_span: 1,
            ..V2Spec::default()
        },
        V2Spec {
            small_chunk: 2,
            small_chunk_span: s.max_positions,
            ..V2Spec::default()
        },
    ] {
        assert!(
            matches!(bad.validate(&s), Err(Error::Manifest { ref key, .. }) if key == "smallChunkSpan"),
            "{bad:?}: {:?}",
            bad.validate(&s)
        );
    }
}
