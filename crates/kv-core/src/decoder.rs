//! The decoders apps call: [`KvDecoder`] (prefix once, then restore + chunks + steps per
//! utterance, or a whole prompt from position 0) and [`RedecodeDecoder`] (pad, run, read one
//! position, repeat).
//!
//! [`KvDecoder`] is the one decode loop of the workspace: the CLI, the demo, the benchmarks and
//! the conformance suite all generate through it, so stop tokens, sampling, streaming and the
//! stage timings behave the same everywhere.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::allowed::AllowedTokens;
use crate::backend::{KvBackend, RedecodeBackend};
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingConfig, TopK};

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
    /// Constrained generation ([`KvDecoder::generate_constrained`]): time in the grammar
    /// (masks, commits, forced tokens).
    pub constrain: Duration,
    /// Ids the grammar forced (each fed in a chunk call beside others, not stepped alone).
    pub forced_tokens: usize,
    /// Calls after the utterance that fed more than one id (a picked id and the ids forced
    /// after it), in [`Self::decode`] with the steps.
    pub forced_calls: usize,
    /// Calls a one-id-per-step decoder would have made that forcing saved.
    pub steps_saved: usize,
}

impl StageTiming {
    pub fn total(&self) -> Duration {
        self.prefill + self.restore + self.chunk + self.decode + self.sample + self.constrain
    }
}

/// A grammar driving [`KvDecoder::generate_constrained`]: which ids may come next, and which
/// it forces. Implemented outside this crate (the `constrain` crate, over llguidance), so that
/// the decode loop carries no grammar engine.
pub trait TokenConstraint {
    /// The ids allowed after everything committed so far (stop tokens included where the
    /// grammar may end there). Empty when the grammar has ended.
    fn allowed(&mut self) -> Result<AllowedTokens>;
    /// Advances past `id`; an id the grammar does not allow is [`Error::Constraint`].
    fn commit(&mut self, id: i32) -> Result<()>;
    /// The ids the grammar forces from here (the only continuation, as the tokenizer would
    /// write it), not yet committed; empty when there is a choice.
    fn forced(&mut self) -> Result<Vec<i32>>;
    /// Whether the grammar has ended: nothing may follow, not even a stop token.
    fn is_done(&self) -> bool;
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

/// Where a constrained request starts: after a restored prefix, or from position 0.
enum Start<'a, S> {
    Prefix(&'a S),
    Empty,
}

/// Calls `n` ids cost: chunk calls of at most `chunk` ids, or one step for a single id.
fn calls_for(n: usize, chunk: usize) -> usize {
    n.div_ceil(chunk.max(1))
}

/// The seed's `IreeKvDecoder`, over any backend.
pub struct KvDecoder<B: KvBackend> {
    backend: B,
}

impl<B: KvBackend> KvDecoder<B> {
    /// The backend's best `needed` logits of its last call, for a sampler; [`Error::NoTopK`]
    /// where it has fewer (or none).
    fn candidates(&self, needed: usize) -> Result<crate::sampling::TopK> {
        self.backend.last_top_k(needed)?.ok_or_else(|| Error::NoTopK {
            backend: self.backend.name(),
            needed,
            available: self.backend.top_k_capacity(),
        })
    }

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

    /// [`Self::generate_until`] under a grammar: before each call the backend's mask is set to
    /// what `constraint` allows next, so every id picked (greedy: the graph's masked argmax;
    /// sampled: a draw over the masked top-k) is one the grammar accepts. Where the grammar
    /// forces ids (llguidance's fast-forward tokens) they go in with the next call as one chunk
    /// instead of a step each, the ones forced before the first pick with the utterance's last
    /// chunk; they count as generated ids (handed to `on_token`, bounded by `max_new`).
    /// Generation ends at a stop token the grammar allows, when the grammar has ended, at
    /// `max_new`, or when `on_token` says so. A backend without a mask
    /// ([`KvBackend::set_allowed`]) is refused before any call, never decoded unconstrained;
    /// the mask is lifted again before returning.
    pub fn generate_constrained(
        &mut self,
        prefix: &B::Snapshot,
        utterance: &[i32],
        options: &DecodeOptions,
        constraint: &mut dyn TokenConstraint,
        on_token: impl FnMut(i32) -> bool,
    ) -> Result<Generation> {
        self.constrained(Start::Prefix(prefix), utterance, options, constraint, on_token)
    }

    /// [`Self::complete`] under a grammar, as [`Self::generate_constrained`] decodes.
    pub fn complete_constrained(
        &mut self,
        prompt: &[i32],
        options: &DecodeOptions,
        constraint: &mut dyn TokenConstraint,
        on_token: impl FnMut(i32) -> bool,
    ) -> Result<Generation> {
        self.constrained(Start::Empty, prompt, options, constraint, on_token)
    }

    fn constrained(
        &mut self,
        start: Start<'_, B::Snapshot>,
        input: &[i32],
        options: &DecodeOptions,
        constraint: &mut dyn TokenConstraint,
        on_token: impl FnMut(i32) -> bool,
    ) -> Result<Generation> {
        let (op, position) = match start {
            Start::Prefix(s) => ("generate", self.backend.snapshot_position(s)),
            Start::Empty => ("complete", 0),
        };
        self.check_request(op, position, input, options)?;
        let sampler = self.sampler(options)?;
        // Lifting the mask changes nothing on a backend that has one and asks the others now,
        // before the session moves.
        self.backend.set_allowed(None)?;
        let result = self.constrained_inner(start, input, options, sampler, constraint, on_token);
        let lifted = self.backend.set_allowed(None);
        let generation = result?;
        lifted?;
        Ok(generation)
    }

    #[allow(clippy::too_many_arguments)]
    fn constrained_inner(
        &mut self,
        start: Start<'_, B::Snapshot>,
        input: &[i32],
        options: &DecodeOptions,
        mut sampler: Option<Sampler>,
        constraint: &mut dyn TokenConstraint,
        mut on_token: impl FnMut(i32) -> bool,
    ) -> Result<Generation> {
        let started = Instant::now();
        let mut timing = StageTiming::default();
        let chunk = self.backend.spec().chunk;
        let mut ids: Vec<i32> = Vec::new();
        let mut history = input.to_vec();
        let mut stopped_at_eos = false;
        // Hands `id` over; false = generation is over (the caller's word or max_new).
        let mut emit = |id: i32, ids: &mut Vec<i32>, history: &mut Vec<i32>, timing: &mut StageTiming| {
            ids.push(id);
            history.push(id);
            timing.first_token.get_or_insert_with(|| started.elapsed());
            on_token(id) && ids.len() < options.max_new
        };

        // Ids forced before the first pick join the input.
        let t = Instant::now();
        let forced = self.take_forced(constraint, options.max_new)?;
        timing.constrain += t.elapsed();
        let mut going = options.max_new > 0;
        for &id in &forced {
            going = emit(id, &mut ids, &mut history, &mut timing) && going;
            timing.forced_tokens += 1;
        }
        let mut pending: Vec<i32> = input.iter().copied().chain(forced.iter().copied()).collect();
        timing.steps_saved +=
            (calls_for(input.len(), chunk) + forced.len()).saturating_sub(calls_for(pending.len(), chunk));
        if !going || constraint.is_done() {
            // Nothing is left to pick; the forced ids still enter the cache so that the
            // session ends where the ids do, as after any generation.
            let t = Instant::now();
            match start {
                Start::Prefix(s) => {
                    self.backend.restore(s)?;
                    timing.restore = t.elapsed();
                    let t = Instant::now();
                    for piece in pending.chunks(chunk) {
                        self.backend.chunk(piece)?;
                        timing.chunk_calls += 1;
                    }
                    timing.chunk = t.elapsed();
                }
                Start::Empty => {
                    feed_prompt(&mut self.backend, &pending)?;
                    timing.prefill = t.elapsed();
                }
            }
            return Ok(Generation {
                ids,
                stopped_at_eos,
                timing,
            });
        }

        let mut first = true;
        loop {
            let t = Instant::now();
            let allowed = constraint.allowed()?;
            timing.constrain += t.elapsed();
            if allowed.is_empty() {
                break;
            }
            self.backend.set_allowed(Some(&allowed))?;
            let predicted = if first {
                first = false;
                let t = Instant::now();
                match start {
                    Start::Prefix(s) => {
                        self.backend.restore(s)?;
                        timing.restore = t.elapsed();
                        let t = Instant::now();
                        let mut next = None;
                        for piece in pending.chunks(chunk) {
                            next = Some(self.backend.chunk(piece)?);
                            timing.chunk_calls += 1;
                        }
                        timing.chunk = t.elapsed();
                        next.unwrap_or_else(|| crate::error::invariant("non-empty input made no chunk call"))
                    }
                    Start::Empty => {
                        let next = feed_prompt(&mut self.backend, &pending)?;
                        timing.prefill = t.elapsed();
                        next
                    }
                }
            } else {
                let t = Instant::now();
                let next = if pending.len() == 1 {
                    timing.decode_tokens += 1;
                    self.backend.step(pending[0])?
                } else {
                    let mut next = 0;
                    for piece in pending.chunks(chunk) {
                        next = self.backend.chunk(piece)?;
                        timing.forced_calls += 1;
                    }
                    timing.steps_saved += pending.len() - calls_for(pending.len(), chunk);
                    next
                };
                timing.decode += t.elapsed();
                next
            };
            let token = self.pick_allowed(predicted, &allowed, &history, sampler.as_mut(), &mut timing)?;
            if options.stop.contains(&token) {
                stopped_at_eos = true;
                break;
            }
            let t = Instant::now();
            constraint.commit(token)?;
            timing.constrain += t.elapsed();
            if !emit(token, &mut ids, &mut history, &mut timing) || constraint.is_done() {
                break;
            }
            let t = Instant::now();
            let forced = self.take_forced(constraint, options.max_new - ids.len())?;
            timing.constrain += t.elapsed();
            pending.clear();
            pending.push(token);
            let mut going = true;
            for &id in &forced {
                going = emit(id, &mut ids, &mut history, &mut timing) && going;
                timing.forced_tokens += 1;
                pending.push(id);
            }
            if !going || constraint.is_done() {
                break;
            }
        }
        Ok(Generation {
            ids,
            stopped_at_eos,
            timing,
        })
    }

    /// The grammar's forced ids, at most `room`, committed to it.
    fn take_forced(&self, constraint: &mut dyn TokenConstraint, room: usize) -> Result<Vec<i32>> {
        let mut forced = constraint.forced()?;
        forced.truncate(room);
        self.backend.spec().check_tokens("forced tokens", &forced)?;
        for &id in &forced {
            constraint.commit(id)?;
        }
        Ok(forced)
    }

    /// [`Self::pick`] within `allowed`: the greedy id is checked against the mask (a backend
    /// that ignored it is an error, never an unconstrained id), the sampled one is drawn from
    /// the allowed candidates only.
    fn pick_allowed(
        &self,
        predicted: i32,
        allowed: &AllowedTokens,
        history: &[i32],
        sampler: Option<&mut Sampler>,
        timing: &mut StageTiming,
    ) -> Result<i32> {
        let mismatch = |what: &str, id: i32| Error::ContractMismatch {
            backend: "decoder",
            op: "constrained decoding".into(),
            message: format!(
                "{} {what} {id}, which the grammar's mask does not allow: the backend ignored set_allowed",
                self.backend.name()
            ),
        };
        let Some(sampler) = sampler else {
            if !allowed.allows(predicted) {
                return Err(mismatch("predicted", predicted));
            }
            return Ok(predicted);
        };
        let t = Instant::now();
        let top = self.candidates(sampler.config().candidates)?;
        // Masked candidates come last at -inf; they must not be drawn even where rounding
        // leaves the cumulative sum short of the draw.
        let (ids, logits): (Vec<i32>, Vec<f32>) = top
            .ids()
            .iter()
            .zip(top.logits())
            .filter(|(id, _)| allowed.allows(**id))
            .map(|(&id, &l)| (id, l))
            .unzip();
        if ids.is_empty() {
            return Err(mismatch(
                "offered no allowed candidate; its best was",
                top.ids().first().copied().unwrap_or(-1),
            ));
        }
        let top = TopK::from_pairs(&ids, &logits).unwrap_or_else(|| crate::error::invariant("ids and logits pair up"));
        let id = sampler.sample(&top, history);
        timing.sample += t.elapsed();
        Ok(id)
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
        let top = self.candidates(sampler.config().candidates)?;
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
