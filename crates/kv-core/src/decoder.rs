//! The decoders apps call: [`KvDecoder`] (prefix once, then restore + chunks + steps per
//! utterance, or a whole prompt from position 0) and [`RedecodeDecoder`] (pad, run, read one
//! position, repeat).
//!
//! [`KvDecoder`] is the one decode loop of the workspace: the CLI, the demo, the benchmarks and
//! the conformance suite all generate through it, so stop tokens, sampling, streaming and the
//! stage timings behave the same everywhere.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::backend::{KvBackend, RedecodeBackend};
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingConfig};

/// Where a generation's time went. The stages do not overlap; [`Self::total`] is their sum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageTiming {
    /// A prompt fed from position 0 ([`KvDecoder::complete`]): the prefill call and the chunk
    /// calls past its SEQ.
    pub prefill: Duration,
    pub restore: Duration,
    /// The utterance's chunk calls after a restore ([`KvDecoder::generate_with`]).
    pub chunk: Duration,
    pub chunk_calls: usize,
    /// Step calls.
    pub decode: Duration,
    /// Step calls made (the first generated token comes from the last prefill or chunk call).
    pub decode_tokens: usize,
    /// Reading the candidates from the backend and sampling (zero when greedy).
    pub sample: Duration,
    /// From the start of the request until the first id was handed to the callback (`None`
    /// when no id was generated).
    pub first_token: Option<Duration>,
}

impl StageTiming {
    pub fn total(&self) -> Duration {
        self.prefill + self.restore + self.chunk + self.decode + self.sample
    }
}

/// The ids generated for one request (without the stop token that ended it) and the timing.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub ids: Vec<i32>,
    /// Whether a stop token ended it (rather than `max_new`).
    pub stopped_at_eos: bool,
    pub timing: StageTiming,
}

/// What a request generates and when it stops.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeOptions {
    /// At most this many ids.
    pub max_new: usize,
    /// Generation stops before any of these (EOS, end-of-turn); the stop token is not returned.
    pub stop: BTreeSet<i32>,
    /// `None` (or a greedy config) = the graphs' own argmax; otherwise the backend must hand over
    /// [`SamplingConfig::candidates`] logits per call ([`KvBackend::top_k_capacity`]).
    pub sampling: Option<SamplingConfig>,
}

impl DecodeOptions {
    /// Greedy, up to `max_new` ids, stopping before any of `stop`.
    pub fn greedy(max_new: usize, stop: impl IntoIterator<Item = i32>) -> Self {
        DecodeOptions {
            max_new,
            stop: stop.into_iter().collect(),
            sampling: None,
        }
    }
}

/// Feeds a whole prompt from position 0 (the prefill graph, then chunk calls past its SEQ) and
/// returns the token the graphs predict after it. Checks nothing beyond what each call checks.
pub fn feed_prompt<B: KvBackend + ?Sized>(backend: &mut B, prompt: &[i32]) -> Result<i32> {
    let spec = backend.spec().clone();
    let (head, rest) = prompt.split_at(prompt.len().min(spec.seq));
    let mut token = backend.prefill(head)?;
    for piece in rest.chunks(spec.chunk) {
        token = backend.chunk(piece)?;
    }
    Ok(token)
}

/// The seed's `IreeKvDecoder`, over any backend.
pub struct KvDecoder<B: KvBackend> {
    backend: B,
}

impl<B: KvBackend> KvDecoder<B> {
    pub fn new(backend: B) -> Self {
        KvDecoder { backend }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    pub fn into_inner(self) -> B {
        self.backend
    }

    /// Prefills a shared prefix once and snapshots it. A prefix longer than the prefill graph's
    /// SEQ continues in chunk calls.
    pub fn prefill_prefix(&mut self, ids: &[i32]) -> Result<B::Snapshot> {
        let spec = self.backend.spec().clone();
        spec.check_tokens("prefill_prefix", ids)?;
        if ids.len() > spec.max_positions {
            return Err(Error::ContextOverflow {
                op: "prefill_prefix",
                position: 0,
                n: ids.len(),
                max: spec.max_positions,
            });
        }
        feed_prompt(&mut self.backend, ids)?;
        self.backend.snapshot()
    }

    /// [`Self::generate_with`], greedy, stopping at `eos`, without a callback.
    pub fn generate(
        &mut self,
        prefix: &B::Snapshot,
        utterance: &[i32],
        eos: Option<i32>,
        max_new: usize,
    ) -> Result<Generation> {
        self.generate_with(prefix, utterance, &DecodeOptions::greedy(max_new, eos), |_| {})
    }

    /// Restores `prefix`, feeds the utterance in chunk calls, then decodes until a stop token or
    /// `max_new` ids, calling `on_token` with each id as it is generated. The repetition penalty
    /// sees the utterance and the ids generated. Checks the whole request (ids, room, sampling
    /// settings, the backend's candidates) before the first call, so a bad request leaves the
    /// session untouched.
    pub fn generate_with(
        &mut self,
        prefix: &B::Snapshot,
        utterance: &[i32],
        options: &DecodeOptions,
        mut on_token: impl FnMut(i32),
    ) -> Result<Generation> {
        self.generate_until(prefix, utterance, options, |id| {
            on_token(id);
            true
        })
    }

    /// [`Self::generate_with`], where `on_token` returning `false` ends the generation after
    /// that id (a caller that has read what it wanted: a complete tool call). `stopped_at_eos`
    /// is then false.
    pub fn generate_until(
        &mut self,
        prefix: &B::Snapshot,
        utterance: &[i32],
        options: &DecodeOptions,
        on_token: impl FnMut(i32) -> bool,
    ) -> Result<Generation> {
        let start = self.backend.snapshot_position(prefix);
        self.check_request("generate", start, utterance, options)?;
        let sampler = self.sampler(options)?;
        let started = Instant::now();
        let mut timing = StageTiming::default();

        let t = Instant::now();
        self.backend.restore(prefix)?;
        timing.restore = t.elapsed();

        let t = Instant::now();
        let mut next = None;
        for piece in utterance.chunks(self.backend.spec().chunk) {
            next = Some(self.backend.chunk(piece)?);
            timing.chunk_calls += 1;
        }
        timing.chunk = t.elapsed();
        let next = next.unwrap_or_else(|| crate::error::invariant("non-empty utterance made no chunk call"));
        self.decode(next, utterance, options, sampler, timing, started, on_token)
    }

    /// Feeds `prompt` from position 0 (prefill, then chunk calls past SEQ) and decodes as
    /// [`Self::generate_with`] does. The repetition penalty sees the prompt and the ids generated.
    pub fn complete(
        &mut self,
        prompt: &[i32],
        options: &DecodeOptions,
        on_token: impl FnMut(i32),
    ) -> Result<Generation> {
        self.check_request("complete", 0, prompt, options)?;
        let sampler = self.sampler(options)?;
        let started = Instant::now();
        let mut timing = StageTiming::default();
        let t = Instant::now();
        let next = feed_prompt(&mut self.backend, prompt)?;
        timing.prefill = t.elapsed();
        let mut on_token = on_token;
        self.decode(next, prompt, options, sampler, timing, started, |id| {
            on_token(id);
            true
        })
    }

    /// The checks every request passes before its first call: some valid ids, and room from
    /// `start` for them and every step (the last generated id needs no step).
    fn check_request(&self, op: &'static str, start: usize, ids: &[i32], options: &DecodeOptions) -> Result<()> {
        let spec = self.backend.spec();
        if ids.is_empty() {
            return Err(Error::BadTokenCount {
                op,
                n: 0,
                min: 1,
                max: usize::MAX,
            });
        }
        spec.check_tokens(op, ids)?;
        let needed = ids.len().saturating_add(options.max_new.saturating_sub(1));
        if start.saturating_add(needed) > spec.max_positions {
            return Err(Error::ContextOverflow {
                op,
                position: start,
                n: needed,
                max: spec.max_positions,
            });
        }
        Ok(())
    }

    /// The sampler of a request; `None` for greedy. A backend without enough candidates is an
    /// error here, before any call.
    fn sampler(&self, options: &DecodeOptions) -> Result<Option<Sampler>> {
        let Some(config) = &options.sampling else {
            return Ok(None);
        };
        config.validate()?;
        if config.is_greedy() {
            return Ok(None);
        }
        let available = self.backend.top_k_capacity();
        if available.is_none_or(|k| k < config.candidates) {
            return Err(Error::NoTopK {
                backend: self.backend.name(),
                needed: config.candidates,
                available,
            });
        }
        Sampler::new(config.clone()).map(Some)
    }

    /// The token after the last call: the graph's `predicted` when greedy, else a draw from the
    /// backend's candidates.
    fn pick(
        &self,
        predicted: i32,
        history: &[i32],
        sampler: Option<&mut Sampler>,
        timing: &mut StageTiming,
    ) -> Result<i32> {
        let Some(sampler) = sampler else {
            return Ok(predicted);
        };
        let t = Instant::now();
        let needed = sampler.config().candidates;
        let top = self.backend.last_top_k(needed)?.ok_or_else(|| Error::NoTopK {
            backend: self.backend.name(),
            needed,
            available: self.backend.top_k_capacity(),
        })?;
        let id = sampler.sample(&top, history);
        timing.sample += t.elapsed();
        Ok(id)
    }

    /// The loop after the input is fed: `predicted` is the last call's token.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        predicted: i32,
        fed: &[i32],
        options: &DecodeOptions,
        mut sampler: Option<Sampler>,
        mut timing: StageTiming,
        started: Instant,
        mut on_token: impl FnMut(i32) -> bool,
    ) -> Result<Generation> {
        // Not `with_capacity(max_new)`: a caller's bound, not a size; generation may stop early.
        let mut ids = Vec::new();
        let mut history = fed.to_vec();
        let mut stopped_at_eos = false;
        let mut token = self.pick(predicted, &history, sampler.as_mut(), &mut timing)?;
        if sampler.is_none() {
            // Greedy: the backend may run ahead of the host (KvBackend::step_greedy).
            if options.max_new == 0 {
                // Nothing to hand over.
            } else if options.stop.contains(&token) {
                stopped_at_eos = true;
            } else {
                ids.push(token);
                timing.first_token.get_or_insert_with(|| started.elapsed());
                if on_token(token) {
                    let t = Instant::now();
                    let mut more = |predicted: i32| {
                        if options.stop.contains(&predicted) {
                            stopped_at_eos = true;
                            return false;
                        }
                        ids.push(predicted);
                        on_token(predicted) && ids.len() < options.max_new
                    };
                    let steps = self.backend.step_greedy(token, options.max_new - 1, &mut more)?;
                    timing.decode += t.elapsed();
                    timing.decode_tokens += steps;
                }
            }
            return Ok(Generation {
                ids,
                stopped_at_eos,
                timing,
            });
        }
        while ids.len() < options.max_new {
            if options.stop.contains(&token) {
                stopped_at_eos = true;
                break;
            }
            ids.push(token);
            history.push(token);
            timing.first_token.get_or_insert_with(|| started.elapsed());
            if !on_token(token) || ids.len() == options.max_new {
                break;
            }
            let t = Instant::now();
            let predicted = self.backend.step(token)?;
            timing.decode += t.elapsed();
            timing.decode_tokens += 1;
            token = self.pick(predicted, &history, sampler.as_mut(), &mut timing)?;
        }
        Ok(Generation {
            ids,
            stopped_at_eos,
            timing,
        })
    }
}

/// The seed's `IreeRedecodeDecoder`: the prompt padded to SEQ, one graph call per new token.
pub struct RedecodeDecoder<B: RedecodeBackend> {
    backend: B,
}

impl<B: RedecodeBackend> RedecodeDecoder<B> {
    pub fn new(backend: B) -> Self {
        RedecodeDecoder { backend }
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Greedy ids after `prompt` (eos not included). Needs `1 <= prompt.len() < SEQ`.
    pub fn generate(&mut self, prompt: &[i32], eos: Option<i32>, max_new: usize) -> Result<Vec<i32>> {
        let seq = self.backend.seq();
        if prompt.is_empty() || prompt.len() >= seq {
            return Err(Error::PromptDoesNotFit { len: prompt.len(), seq });
        }
        let vocab = self.backend.vocab_size();
        if let Some(index) = prompt.iter().position(|&t| t < 0 || t as usize >= vocab) {
            return Err(Error::TokenOutOfRange {
                op: "redecode",
                index,
                id: prompt[index] as i64,
                vocab,
            });
        }
        let mut buffer = prompt.to_vec();
        buffer.resize(seq, 0);
        let mut len = prompt.len();
        let mut out = Vec::new();
        while out.len() < max_new && len < seq {
            let next = self.backend.run(&buffer)?;
            if next.len() != seq {
                return Err(Error::ContractMismatch {
                    backend: "redecode",
                    op: "run".into(),
                    message: format!("graph returned {} ids, expected SEQ {seq}", next.len()),
                });
            }
            let token = next[len - 1];
            if Some(token) == eos {
                break;
            }
            out.push(token);
            buffer[len] = token;
            len += 1;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LayerKv;
    use crate::sampling::TopK;
    use crate::spec::KvSpec;

    /// Counts positions and calls; predicts `position % 50` and, when it has a top-k, offers that
    /// id and three fixed others with close logits.
    struct Counting {
        spec: KvSpec,
        position: usize,
        calls: usize,
        prefills: usize,
        top_k: Option<usize>,
    }

    impl Counting {
        fn new(spec: KvSpec) -> Self {
            Counting {
                spec,
                position: 0,
                calls: 0,
                prefills: 0,
                top_k: None,
            }
        }

        fn predicted(&self) -> i32 {
            (self.position % 50) as i32
        }
    }

    impl KvBackend for Counting {
        type Snapshot = usize;
        fn spec(&self) -> &KvSpec {
            &self.spec
        }
        fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
            self.calls += 1;
            self.prefills += 1;
            self.position = tokens.len();
            Ok(self.predicted())
        }
        fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
            self.calls += 1;
            self.position += tokens.len();
            Ok(self.predicted())
        }
        fn step(&mut self, _token: i32) -> Result<i32> {
            self.calls += 1;
            self.position += 1;
            Ok(self.predicted())
        }
        fn snapshot(&self) -> Result<usize> {
            Ok(self.position)
        }
        fn restore(&mut self, snapshot: &usize) -> Result<()> {
            self.calls += 1;
            self.position = *snapshot;
            Ok(())
        }
        fn snapshot_position(&self, snapshot: &usize) -> usize {
            *snapshot
        }
        fn position(&self) -> usize {
            self.position
        }
        fn read_layer(&self, _layer: usize) -> Result<LayerKv> {
            unimplemented!()
        }
        fn top_k_capacity(&self) -> Option<usize> {
            self.top_k
        }
        fn last_top_k(&self, k: usize) -> Result<Option<TopK>> {
            Ok(self.top_k.filter(|&cap| cap >= k).map(|_| {
                TopK::from_pairs(&[self.predicted(), 60, 61, 62], &[1.0, 0.9, 0.8, 0.7])
                    .unwrap()
                    .truncated(k)
            }))
        }
        fn name(&self) -> String {
            "counting".into()
        }
    }

    fn small() -> KvSpec {
        KvSpec {
            max_positions: 40,
            seq: 8,
            chunk: 4,
            vocab_size: 100,
            ..KvSpec::default()
        }
    }

    #[test]
    fn context_overflow_is_checked_before_the_restore() {
        let mut decoder = KvDecoder::new(Counting::new(small()));
        let long = decoder.prefill_prefix(&[1; 35]).unwrap();
        decoder.backend_mut().chunk(&[1; 3]).unwrap();
        let calls = decoder.backend().calls;
        // 35 + 4 utterance + 2 steps > 40, while the session itself (at 38) is not restored.
        let err = decoder.generate(&long, &[1; 4], None, 3).unwrap_err();
        assert!(
            matches!(err, Error::ContextOverflow { position: 35, n: 6, .. }),
            "{err}"
        );
        assert_eq!(decoder.backend().position(), 38, "the session moved");
        assert_eq!(decoder.backend().calls, calls, "a call was made");
        // What fits still runs.
        let generation = decoder.generate(&long, &[1; 4], None, 2).unwrap();
        assert_eq!(generation.ids.len(), 2);
        // A request whose size overflows usize is an overflow, not a wrap.
        let err = decoder.generate(&long, &[1], None, usize::MAX).unwrap_err();
        assert!(matches!(err, Error::ContextOverflow { .. }), "{err}");
    }

    #[test]
    fn stops_before_the_first_stop_token_and_streams_every_id_kept() {
        let mut decoder = KvDecoder::new(Counting::new(small()));
        let prefix = decoder.prefill_prefix(&[1; 5]).unwrap();
        // After the 3-token utterance the session is at 8, then 9, 10, 11, ...: predictions 8, 9, ...
        let options = DecodeOptions::greedy(10, [11, 10]);
        let mut streamed = Vec::new();
        let g = decoder
            .generate_with(&prefix, &[2, 3, 4], &options, |id| streamed.push(id))
            .unwrap();
        assert_eq!(g.ids, vec![8, 9]);
        assert!(g.stopped_at_eos);
        assert_eq!(streamed, g.ids, "the callback saw other ids than returned");
        assert_eq!(g.timing.chunk_calls, 1);
        // Steps after 8 and 9; the one predicting the stop token was made, none after it.
        assert_eq!(g.timing.decode_tokens, 2);
        assert!(g.timing.first_token.is_some());
        assert_eq!(g.timing.prefill, Duration::ZERO);
        assert_eq!(g.timing.sample, Duration::ZERO, "greedy sampled");
        assert!(g.timing.total() >= g.timing.decode);

        // max_new ends it when no stop token comes; the last id needs no step.
        let g = decoder
            .generate_with(&prefix, &[2, 3, 4], &DecodeOptions::greedy(3, []), |_| {})
            .unwrap();
        assert_eq!(
            (g.ids, g.stopped_at_eos, g.timing.decode_tokens),
            (vec![8, 9, 10], false, 2)
        );

        // A stop token first: nothing generated, no step, no callback.
        let mut called = false;
        let g = decoder
            .generate_with(&prefix, &[2, 3, 4], &DecodeOptions::greedy(3, [8]), |_| called = true)
            .unwrap();
        assert!(g.ids.is_empty() && g.stopped_at_eos && !called);
        assert_eq!((g.timing.decode_tokens, g.timing.first_token), (0, None));
    }

    #[test]
    fn a_prompt_longer_than_seq_is_prefilled_then_chunked() {
        let mut decoder = KvDecoder::new(Counting::new(small()));
        let g = decoder
            .complete(&[1; 13], &DecodeOptions::greedy(2, []), |_| {})
            .unwrap();
        // 8 prefilled, 4 + 1 in two chunk calls: position 13, then one step.
        assert_eq!(g.ids, vec![13, 14]);
        assert_eq!(decoder.backend().prefills, 1);
        assert_eq!(decoder.backend().calls, 4);
        assert_eq!(g.timing.chunk_calls, 0, "prompt chunks count as the prefill stage");
        let err = decoder
            .complete(&[], &DecodeOptions::greedy(2, []), |_| {})
            .unwrap_err();
        assert!(matches!(err, Error::BadTokenCount { .. }), "{err}");
        let err = decoder
            .complete(&[100], &DecodeOptions::greedy(2, []), |_| {})
            .unwrap_err();
        assert!(matches!(err, Error::TokenOutOfRange { .. }), "{err}");
    }

    fn sampled(seed: u64) -> DecodeOptions {
        DecodeOptions {
            max_new: 12,
            stop: BTreeSet::new(),
            sampling: Some(SamplingConfig {
                temperature: 1.0,
                seed,
                candidates: 4,
                ..SamplingConfig::default()
            }),
        }
    }

    #[test]
    fn sampling_needs_candidates_and_asks_before_any_call() {
        let mut decoder = KvDecoder::new(Counting::new(small()));
        let prefix = decoder.prefill_prefix(&[1; 5]).unwrap();
        let calls = decoder.backend().calls;
        let err = decoder.generate_with(&prefix, &[2], &sampled(1), |_| {}).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::NoTopK {
                    needed: 4,
                    available: None,
                    ..
                }
            ),
            "{err}"
        );
        decoder.backend_mut().top_k = Some(3);
        let err = decoder.complete(&[2], &sampled(1), |_| {}).unwrap_err();
        assert!(matches!(&err, Error::NoTopK { available: Some(3), .. }), "{err}");
        let mut bad = sampled(1);
        bad.sampling.as_mut().unwrap().top_p = 2.0;
        let err = decoder.complete(&[2], &bad, |_| {}).unwrap_err();
        assert!(matches!(&err, Error::BadSampling { key: "top_p", .. }), "{err}");
        assert_eq!(decoder.backend().calls, calls, "a refused request made a call");
        assert_eq!(decoder.backend().position(), 5);
        // A greedy config needs no candidates.
        let greedy = DecodeOptions {
            sampling: Some(SamplingConfig::default()),
            ..sampled(1)
        };
        decoder.backend_mut().top_k = None;
        let g = decoder.generate_with(&prefix, &[2], &greedy, |_| {}).unwrap();
        assert_eq!(g.ids[..3], [6, 7, 8]);
    }

    #[test]
    fn seeded_sampling_through_the_decoder_is_reproducible() {
        let mut decoder = KvDecoder::new(Counting::new(small()));
        decoder.backend_mut().top_k = Some(4);
        let prefix = decoder.prefill_prefix(&[1; 5]).unwrap();
        let run = |decoder: &mut KvDecoder<Counting>, seed| {
            let mut streamed = Vec::new();
            let g = decoder
                .generate_with(&prefix, &[2], &sampled(seed), |id| streamed.push(id))
                .unwrap();
            assert_eq!(streamed, g.ids);
            g.ids
        };
        let a = run(&mut decoder, 3);
        assert_eq!(a, run(&mut decoder, 3));
        assert_ne!(a, run(&mut decoder, 4));
        // Not the greedy path: ids off the argmax were drawn.
        assert!(a.iter().any(|id| (60..=62).contains(id)), "{a:?}");
    }
}
