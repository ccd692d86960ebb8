//! The reference's allowed-token mask (`KvBackend::set_allowed`) and the decoder's constrained
//! loop over it (`KvDecoder::generate_constrained`): every pick within the grammar's mask, the
//! forced ids fed in chunk calls, and the same ids as an unconstrained replay of the same calls
//! picks by the masked argmax of its logits.

mod common;

use backend_reference::ReferenceKv;
use common::*;
use kv_core::allowed::AllowedTokens;
use kv_core::decoder::TokenConstraint;
use kv_core::sampling::SamplingConfig;
use kv_core::{DecodeOptions, Error, KvBackend, KvDecoder, Result, WindowRule};

const MODEL: &str = "tiny-gemma3:7";

/// Every third id (shifted by `salt`) and `extra`.
fn mask(vocab: usize, salt: usize, extra: &[i32]) -> AllowedTokens {
    let mut ids: Vec<i32> = (0..vocab as i32).filter(|id| (*id as usize + salt) % 3 == 0).collect();
    ids.extend_from_slice(extra);
    AllowedTokens::from_ids(vocab, &ids).unwrap()
}

#[test]
fn prefill_chunk_and_step_predict_the_masked_argmax() {
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(10, vocab, 11);
    let mut plain = ReferenceKv::new(model.clone(), WindowRule::Exact);
    let mut masked = ReferenceKv::new(model, WindowRule::Exact);
    for (i, call) in [&prompt[..6], &prompt[6..9], &prompt[9..]].into_iter().enumerate() {
        let allowed = mask(vocab, i, &[]);
        masked.set_allowed(Some(&allowed)).unwrap();
        let (p, m) = match i {
            0 => (plain.prefill(call).unwrap(), masked.prefill(call).unwrap()),
            1 => (plain.chunk(call).unwrap(), masked.chunk(call).unwrap()),
            _ => (plain.step(call[0]).unwrap(), masked.step(call[0]).unwrap()),
        };
        let logits = plain.last_logits().unwrap();
        assert_eq!(m, allowed.argmax(logits).unwrap(), "call {i}");
        assert!(allowed.allows(m));
        // The logits stay unmasked; the mask touches the pick and the top-k only.
        assert_eq!(masked.last_logits().unwrap(), logits, "call {i}");
        let top = masked.last_top_k(vocab).unwrap().unwrap();
        let n = allowed.count();
        assert!(top.ids()[..n].iter().all(|&id| allowed.allows(id)), "call {i}");
        assert!(top.logits()[n..].iter().all(|l| *l == f32::NEG_INFINITY), "call {i}");
        assert_eq!(top.ids()[0], m);
        if i == 0 {
            assert_eq!(p, plain.last_top_k(1).unwrap().unwrap().ids()[0]);
        }
    }
    // Lifted: the plain argmax again.
    masked.set_allowed(None).unwrap();
    let t = tokens(1, vocab, 12)[0];
    assert_eq!(masked.step(t).unwrap(), plain.step(t).unwrap());
}

#[test]
fn ties_go_to_the_lowest_allowed_id() {
    // Two ids allowed, one of them the unmasked argmax: the pick follows the mask, and with the
    // argmax allowed twice over (it and a lower id of the same logit cannot be built from a
    // model) the lowest-id rule is AllowedTokens::argmax's, which the reference uses as is.
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(5, vocab, 13);
    let mut kv = ReferenceKv::new(model, WindowRule::Exact);
    let best = kv.prefill(&prompt).unwrap();
    let logits = kv.last_logits().unwrap().to_vec();
    let other = (0..vocab as i32).find(|&id| id != best).unwrap();
    let allowed = AllowedTokens::from_ids(vocab, &[other, best]).unwrap();
    kv.set_allowed(Some(&allowed)).unwrap();
    assert_eq!(kv.prefill(&prompt).unwrap(), best);
    let only_other = AllowedTokens::from_ids(vocab, &[other]).unwrap();
    kv.set_allowed(Some(&only_other)).unwrap();
    assert_eq!(kv.prefill(&prompt).unwrap(), other);
    assert_eq!(kv.last_logits().unwrap(), &logits[..], "a mask changed the logits");
}

#[test]
fn a_mask_of_another_vocabulary_is_refused_and_the_old_one_kept() {
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(5, vocab, 14);
    let mut kv = ReferenceKv::new(model, WindowRule::Exact);
    let allowed = mask(vocab, 1, &[]);
    kv.set_allowed(Some(&allowed)).unwrap();
    let err = kv.set_allowed(Some(&AllowedTokens::all(vocab + 1))).unwrap_err();
    assert!(matches!(err, Error::BadTokenCount { n, .. } if n == vocab + 1), "{err}");
    let id = kv.prefill(&prompt).unwrap();
    assert!(allowed.allows(id), "the refused mask replaced the old one");
}

/// A scripted grammar: pick `n` may be any id with `(id + n) % 3 == 0` or a stop id; after an
/// even pick it forces two ids; it ends after `len` committed ids. Records what it allowed.
struct Script {
    vocab: usize,
    len: usize,
    picks: usize,
    committed: Vec<i32>,
    queue: Vec<i32>,
    stops: Vec<i32>,
    /// (position in `committed` where the mask applied, the mask).
    masks: Vec<(usize, AllowedTokens)>,
    forced_at: Vec<usize>,
}

impl Script {
    fn new(vocab: usize, len: usize, stops: &[i32], force_first: bool) -> Self {
        Script {
            vocab,
            len,
            picks: 0,
            committed: Vec::new(),
            queue: if force_first { vec![3, 4] } else { Vec::new() },
            stops: stops.to_vec(),
            masks: Vec::new(),
            forced_at: Vec::new(),
        }
    }
}

impl TokenConstraint for Script {
    fn allowed(&mut self) -> Result<AllowedTokens> {
        let m = if self.is_done() {
            AllowedTokens::none(self.vocab)
        } else {
            mask(self.vocab, self.picks, &self.stops)
        };
        self.masks.push((self.committed.len(), m.clone()));
        Ok(m)
    }

    fn commit(&mut self, id: i32) -> Result<()> {
        if let Some(&head) = self.queue.first() {
            if id != head {
                return Err(Error::Constraint {
                    op: "commit",
                    reason: format!("{id} is not the forced {head}"),
                });
            }
            self.queue.remove(0);
            self.forced_at.push(self.committed.len());
        } else {
            if (id as usize + self.picks) % 3 != 0 {
                return Err(Error::Constraint {
                    op: "commit",
                    reason: format!("{id} not allowed at pick {}", self.picks),
                });
            }
            self.picks += 1;
            if id % 2 == 0 {
                let v = self.vocab as i32;
                self.queue = vec![(id * 7 + 1) % v, (id * 7 + 2) % v];
            }
        }
        self.committed.push(id);
        Ok(())
    }

    fn forced(&mut self) -> Result<Vec<i32>> {
        Ok(self.queue.clone())
    }

    fn is_done(&self) -> bool {
        self.committed.len() >= self.len
    }
}

/// Replays `ids` on a plain session with the calls the constrained loop made (the utterance and
/// the first forced run in chunks, then each pick with the ids forced after it) and checks that
/// every pick is the masked argmax of the replay's logits.
fn replay_matches(model_ids: &[i32], script: &Script, prefix_ids: &[i32], utterance: &[i32]) {
    let mut plain = session(MODEL);
    let chunk = plain.spec().chunk;
    plain.prefill(prefix_ids).unwrap();
    let mut groups: Vec<Vec<i32>> = vec![utterance.to_vec()];
    for (i, &id) in model_ids.iter().enumerate() {
        if script.forced_at.contains(&i) {
            groups.last_mut().unwrap().push(id);
        } else {
            groups.push(vec![id]);
        }
    }
    let picks: Vec<usize> = (0..model_ids.len()).filter(|i| !script.forced_at.contains(i)).collect();
    for (g, group) in groups.iter().enumerate() {
        if group.len() == 1 && g > 0 {
            plain.step(group[0]).unwrap();
        } else {
            for piece in group.chunks(chunk) {
                plain.chunk(piece).unwrap();
            }
        }
        let Some(&at) = picks.get(g) else { break };
        let (_, allowed) = script.masks.iter().find(|(pos, _)| *pos == at).unwrap();
        let want = allowed.argmax(plain.last_logits().unwrap()).unwrap();
        assert_eq!(model_ids[at], want, "pick at {at} (group {g})");
    }
}

#[test]
fn constrained_greedy_equals_its_replay_and_feeds_forced_ids_in_chunks() {
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(14, vocab, 15);
    let (prefix_ids, utterance) = prompt.split_at(8);
    for force_first in [false, true] {
        let mut kv = KvDecoder::new(ReferenceKv::new(model.clone(), WindowRule::Exact));
        let prefix = kv.prefill_prefix(prefix_ids).unwrap();
        let options = DecodeOptions::greedy(16, []);
        let mut script = Script::new(vocab, 16, &[], force_first);
        let mut streamed = Vec::new();
        let g = kv
            .generate_constrained(&prefix, utterance, &options, &mut script, |id| {
                streamed.push(id);
                true
            })
            .unwrap();
        assert_eq!(streamed, g.ids);
        assert_eq!(g.ids, script.committed, "the decoder and the grammar disagree");
        assert_eq!(g.ids.len(), 16);
        assert_eq!(g.timing.forced_tokens, script.forced_at.len());
        assert!(g.timing.forced_tokens > 0, "the script forced nothing: {:?}", g.ids);
        // One call per pick after the first: a step, or a chunk call carrying forced ids.
        let picks = g.ids.len() - g.timing.forced_tokens;
        assert_eq!(g.timing.decode_tokens + g.timing.forced_calls, picks - 1);
        assert_eq!(
            g.timing.steps_saved, g.timing.forced_tokens,
            "each forced id rode along with another (runs shorter than the chunk)"
        );
        replay_matches(&g.ids, &script, prefix_ids, utterance);
        // Same path, same ids, bit for bit; and the mask is lifted afterwards.
        let mut again = Script::new(vocab, 16, &[], force_first);
        let g2 = kv
            .generate_constrained(&prefix, utterance, &options, &mut again, |_| true)
            .unwrap();
        assert_eq!(g2.ids, g.ids);
        let after = kv.generate(&prefix, utterance, None, 4).unwrap();
        let mut fresh = KvDecoder::new(ReferenceKv::new(model.clone(), WindowRule::Exact));
        let fresh_prefix = fresh.prefill_prefix(prefix_ids).unwrap();
        let want = fresh.generate(&fresh_prefix, utterance, None, 4).unwrap();
        assert_eq!(after.ids, want.ids, "the mask outlived the constrained request");
    }
}

#[test]
fn a_stop_token_the_grammar_allows_ends_it_and_max_new_bounds_forced_ids() {
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(10, vocab, 16);
    let mut kv = KvDecoder::new(ReferenceKv::new(model.clone(), WindowRule::Exact));
    let prefix = kv.prefill_prefix(&prompt[..6]).unwrap();
    // Find what the first pick would be and make it a stop token.
    let mut probe = Script::new(vocab, 8, &[], false);
    let first = kv
        .generate_constrained(&prefix, &prompt[6..], &DecodeOptions::greedy(1, []), &mut probe, |_| {
            true
        })
        .unwrap()
        .ids[0];
    let mut script = Script::new(vocab, 8, &[first], false);
    let g = kv
        .generate_constrained(
            &prefix,
            &prompt[6..],
            &DecodeOptions::greedy(8, [first]),
            &mut script,
            |_| true,
        )
        .unwrap();
    assert!(g.ids.is_empty() && g.stopped_at_eos);
    // max_new 1 with two ids forced first: one id, no call past the utterance's.
    let mut script = Script::new(vocab, 8, &[], true);
    let g = kv
        .generate_constrained(
            &prefix,
            &prompt[6..],
            &DecodeOptions::greedy(1, []),
            &mut script,
            |_| true,
        )
        .unwrap();
    assert_eq!(g.ids, vec![3]);
    assert_eq!((g.timing.chunk_calls, g.timing.decode_tokens), (1, 0));
    assert_eq!(kv.backend().position(), 6 + 4 + 1);
}

#[test]
fn constrained_sampling_draws_only_allowed_ids_and_replays_by_seed() {
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(10, vocab, 17);
    let seed = 0x5eed_u64;
    println!("sampling seed {seed}");
    let options = DecodeOptions {
        max_new: 14,
        stop: Default::default(),
        sampling: Some(SamplingConfig {
            temperature: 1.5,
            seed,
            ..SamplingConfig::default()
        }),
    };
    let mut kv = KvDecoder::new(ReferenceKv::new(model, WindowRule::Exact));
    let prefix = kv.prefill_prefix(&prompt[..6]).unwrap();
    let mut run = || {
        let mut script = Script::new(vocab, 14, &[], false);
        let g = kv
            .generate_constrained(&prefix, &prompt[6..], &options, &mut script, |_| true)
            .unwrap();
        assert_eq!(g.ids, script.committed);
        g.ids
    };
    let a = run();
    assert_eq!(a.len(), 14);
    assert_eq!(a, run(), "seed {seed}");
}

#[test]
fn a_backend_without_a_mask_is_refused_before_any_call() {
    /// The reference without its mask: the trait's default answer.
    struct NoMask(ReferenceKv);
    impl KvBackend for NoMask {
        type Snapshot = <ReferenceKv as KvBackend>::Snapshot;
        fn spec(&self) -> &kv_core::KvSpec {
            self.0.spec()
        }
        fn prefill(&mut self, t: &[i32]) -> Result<i32> {
            self.0.prefill(t)
        }
        fn chunk(&mut self, t: &[i32]) -> Result<i32> {
            self.0.chunk(t)
        }
        fn step(&mut self, t: i32) -> Result<i32> {
            self.0.step(t)
        }
        fn snapshot(&self) -> Result<Self::Snapshot> {
            self.0.snapshot()
        }
        fn restore(&mut self, s: &Self::Snapshot) -> Result<()> {
            self.0.restore(s)
        }
        fn snapshot_position(&self, s: &Self::Snapshot) -> usize {
            self.0.snapshot_position(s)
        }
        fn position(&self) -> usize {
            self.0.position()
        }
        fn read_layer(&self, l: usize) -> Result<kv_core::LayerKv> {
            self.0.read_layer(l)
        }
        fn name(&self) -> String {
            "no-mask".into()
        }
    }
    let model = model(MODEL);
    let vocab = model.spec().vocab_size;
    let prompt = tokens(10, vocab, 18);
    let mut kv = KvDecoder::new(NoMask(ReferenceKv::new(model, WindowRule::Exact)));
    let prefix = kv.prefill_prefix(&prompt[..6]).unwrap();
    let mut script = Script::new(vocab, 8, &[], false);
    let err = kv
        .generate_constrained(
            &prefix,
            &prompt[6..],
            &DecodeOptions::greedy(8, []),
            &mut script,
            |_| true,
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::GraphUnavailable { op: "set_allowed", .. }),
        "{err}"
    );
    assert_eq!(kv.backend().position(), 6, "the refused request moved the session");
    assert!(script.committed.is_empty());
}
