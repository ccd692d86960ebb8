//! The decoders apps call: [`KvDecoder`] (prefix once, then restore + chunks + steps per
//! utterance) and [`RedecodeDecoder`] (pad, run, read one position, repeat).

use std::time::{Duration, Instant};

use crate::backend::{KvBackend, RedecodeBackend};
use crate::error::{Error, Result};

/// Where an utterance's time went.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageTiming {
    pub restore: Duration,
    pub chunk: Duration,
    pub chunk_calls: usize,
    pub decode: Duration,
    /// Step calls made (the first generated token comes from the last chunk call).
    pub decode_tokens: usize,
}

impl StageTiming {
    pub fn total(&self) -> Duration {
        self.restore + self.chunk + self.decode
    }
}

/// The ids generated for one utterance (without the eos that stopped it) and the stage timing.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub ids: Vec<i32>,
    pub stopped_at_eos: bool,
    pub timing: StageTiming,
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
        let (head, rest) = ids.split_at(ids.len().min(spec.seq));
        self.backend.prefill(head)?;
        for piece in rest.chunks(spec.chunk) {
            self.backend.chunk(piece)?;
        }
        self.backend.snapshot()
    }

    /// Restores `prefix`, feeds the utterance in chunk calls, then decodes greedily until `eos`
    /// or `max_new` ids. Checks the whole request before the first call, so a bad utterance
    /// leaves the session untouched.
    pub fn generate(
        &mut self,
        prefix: &B::Snapshot,
        utterance: &[i32],
        eos: Option<i32>,
        max_new: usize,
    ) -> Result<Generation> {
        let spec = self.backend.spec().clone();
        if utterance.is_empty() {
            return Err(Error::BadTokenCount {
                op: "generate",
                n: 0,
                min: 1,
                max: usize::MAX,
            });
        }
        spec.check_tokens("generate", utterance)?;
        // Room for the utterance and every step; the last generated id needs no step.
        let start = self.backend.snapshot_position(prefix);
        let needed = utterance.len().saturating_add(max_new.saturating_sub(1));
        if start.saturating_add(needed) > spec.max_positions {
            return Err(Error::ContextOverflow {
                op: "generate",
                position: start,
                n: needed,
                max: spec.max_positions,
            });
        }
        let mut timing = StageTiming::default();

        let t = Instant::now();
        self.backend.restore(prefix)?;
        timing.restore = t.elapsed();

        let t = Instant::now();
        let mut next = None;
        for piece in utterance.chunks(spec.chunk) {
            next = Some(self.backend.chunk(piece)?);
            timing.chunk_calls += 1;
        }
        timing.chunk = t.elapsed();

        // Not `with_capacity(max_new)`: a caller's bound, not a size; generation may stop at eos.
        let mut ids = Vec::new();
        let mut stopped_at_eos = false;
        let t = Instant::now();
        let mut token = next.unwrap_or_else(|| crate::error::invariant("non-empty utterance made no chunk call"));
        while ids.len() < max_new {
            if Some(token) == eos {
                stopped_at_eos = true;
                break;
            }
            ids.push(token);
            if ids.len() == max_new {
                break;
            }
            token = self.backend.step(token)?;
            timing.decode_tokens += 1;
        }
        timing.decode = t.elapsed();
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
    use crate::spec::KvSpec;

    /// Counts positions and calls; computes nothing.
    struct Counting {
        spec: KvSpec,
        position: usize,
        calls: usize,
    }

    impl KvBackend for Counting {
        type Snapshot = usize;
        fn spec(&self) -> &KvSpec {
            &self.spec
        }
        fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
            self.calls += 1;
            self.position = tokens.len();
            Ok(1)
        }
        fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
            self.calls += 1;
            self.position += tokens.len();
            Ok(1)
        }
        fn step(&mut self, _token: i32) -> Result<i32> {
            self.calls += 1;
            self.position += 1;
            Ok(1)
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
        fn name(&self) -> String {
            "counting".into()
        }
    }

    #[test]
    fn context_overflow_is_checked_before_the_restore() {
        let spec = KvSpec {
            max_positions: 40,
            ..KvSpec::default()
        };
        let mut decoder = KvDecoder::new(Counting {
            spec,
            position: 0,
            calls: 0,
        });
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
}
