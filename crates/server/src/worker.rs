//! Sessions: each worker thread owns one backend (one KV session) and its prefix cache, and
//! answers the queued requests one at a time.
//!
//! A backend is `Send` but not shareable: every call moves its one position. The engine crate
//! guards its single session with a mutex; here each session belongs to one thread outright, so
//! nothing is locked per token, and the snapshots (which only their own session may restore)
//! never leave the thread that made them.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_core::decoder::TokenConstraint;
use kv_core::{DecodeOptions, KvBackend, KvDecoder, KvSpec, SamplingConfig};
use tokenizer::tools::{Tool, ToolCall, ToolChoice, ToolFormat};
use tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::ApiError;
use crate::metrics::Metrics;
use crate::prefix::PrefixCache;

/// What every session shares: the model's vocabulary, template, grammar engine and limits.
pub(crate) struct ModelInfo {
    pub name: String,
    pub tokenizer: Tokenizer,
    pub format: Option<ToolFormat>,
    /// Built where the vocabulary has a tool-call format.
    pub constrainer: Option<constrain::Constrainer>,
    /// Whether the backend masks ids (contract 2 exports, the reference): calls are then decoded
    /// under the tools' grammar and always parse.
    pub masks: bool,
    pub stops: Vec<i32>,
    pub spec: KvSpec,
    /// Logits the backend hands over per call; `None`: greedy only.
    pub top_k_capacity: Option<usize>,
}

/// One request, ready to decode: the rendered prompt and everything that decides the answer.
pub(crate) struct Job {
    pub prompt: Vec<i32>,
    pub max_new: usize,
    pub ignore_eos: bool,
    pub sampling: Option<SamplingConfig>,
    /// Text that ends the answer (not part of it); text answers only.
    pub stop_strings: Vec<String>,
    /// Tools to parse the answer against (empty: a text answer).
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Hand text pieces over as they are decoded (streamed text answers).
    pub stream: bool,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

pub(crate) enum Event {
    Text(String),
    Done(Box<Outcome>),
    Failed(ApiError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    Stop,
    Length,
    ToolCalls,
}

impl Finish {
    pub fn name(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// Where a request's time went, in milliseconds (llama-server's `timings`, plus the cache's).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct Timings {
    pub queue_ms: f64,
    /// Prompt ids restored from the prefix cache (not computed).
    pub cached_tokens: usize,
    /// Prompt ids computed for this request.
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// The cached ids at this server's measured prefill cost per id.
    pub saved_ms_estimate: f64,
}

pub(crate) struct Outcome {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub invalid_tool_calls: Vec<String>,
    pub finish: Finish,
    pub ids: Vec<i32>,
    pub prompt_tokens: usize,
    pub timings: Timings,
}

/// Why a request ended without an answer.
enum Stopped {
    /// The client went away (its receiver is gone): nobody reads an answer. The ids decoded
    /// before that was seen.
    Gone(usize),
    Error(ApiError),
}

impl From<kv_core::Error> for Stopped {
    fn from(e: kv_core::Error) -> Self {
        Stopped::Error(kv_error(e))
    }
}

/// A kv-core failure as the client sees it: its fault (400) where the request was wrong,
/// ours (500) otherwise.
pub(crate) fn kv_error(e: kv_core::Error) -> ApiError {
    use kv_core::Error as K;
    match e {
        K::ContextOverflow { .. } | K::TooLarge { .. } => {
            ApiError::invalid("context_length_exceeded", None, e.to_string())
        }
        K::TokenOutOfRange { .. } | K::BadTokenCount { .. } | K::BadSampling { .. } | K::NoTopK { .. } => {
            ApiError::invalid("invalid_request", None, e.to_string())
        }
        other => ApiError::internal(other.to_string()),
    }
}

pub(crate) struct Worker<B: KvBackend> {
    pub index: usize,
    pub decoder: KvDecoder<B>,
    pub cache: PrefixCache<B::Snapshot>,
    pub model: Arc<ModelInfo>,
    pub metrics: Arc<Metrics>,
}

impl<B: KvBackend> Worker<B> {
    /// Answers jobs until the queue closes (the server shut down).
    pub fn serve(mut self, jobs: Arc<Mutex<Receiver<Job>>>) {
        loop {
            let job = {
                let rx = jobs.lock().unwrap_or_else(|e| e.into_inner());
                match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            };
            self.metrics.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.active.fetch_add(1, Ordering::SeqCst);
            let events = job.events.clone();
            // A bug in one request must not take the session down with it: every request starts
            // by restoring a snapshot or prefilling, so nothing of the failed one is reused.
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(&job))).unwrap_or_else(|_| {
                    Err(Stopped::Error(ApiError::internal(
                        "the session failed on this request (a bug); it is still serving",
                    )))
                });
            match result {
                Ok(outcome) => {
                    self.metrics.record_answer(&outcome);
                    let _ = events.send(Event::Done(Box::new(outcome)));
                }
                Err(Stopped::Gone(decoded)) => {
                    self.metrics.cancelled.fetch_add(1, Ordering::SeqCst);
                    self.metrics
                        .cancelled_tokens
                        .fetch_add(decoded as u64, Ordering::SeqCst);
                }
                Err(Stopped::Error(e)) => {
                    self.metrics.record_error(e.status);
                    let _ = events.send(Event::Failed(e));
                }
            }
            self.metrics.cache_entries[self.index].store(self.cache.entries(), Ordering::SeqCst);
            self.metrics.cache_bytes[self.index].store(self.cache.bytes(), Ordering::SeqCst);
            self.metrics.cache_evictions[self.index].store(self.cache.evictions() as usize, Ordering::SeqCst);
            self.metrics.active.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn run(&mut self, job: &Job) -> Result<Outcome, Stopped> {
        if job.events.is_closed() {
            return Err(Stopped::Gone(0));
        }
        let queue_ms = ms(job.enqueued.elapsed());
        let model = self.model.clone();
        let tok = &model.tokenizer;
        let prompt = &job.prompt[..];
        let chunk = model.spec.chunk;
        let block = self.cache.block();

        // The prompt's blocks: restored where the cache has them, computed (and kept) where not.
        // See `prefix`: the pieces are the same whatever the cache holds.
        let boundary = self.cache.boundary(prompt.len());
        let hit = self.cache.longest(&prompt[..boundary]);
        let cached = hit.positions;
        let mut current = hit.snapshot;
        let started = Instant::now();
        let mut at = cached;
        while at < boundary {
            if job.events.is_closed() {
                return Err(Stopped::Gone(0));
            }
            let ids = &prompt[at..at + block];
            let snapshot = match &current {
                None => self.decoder.prefill_prefix(ids)?,
                Some(s) => {
                    let backend = self.decoder.backend_mut();
                    backend.restore(s)?;
                    for piece in ids.chunks(chunk) {
                        backend.chunk(piece)?;
                    }
                    backend.snapshot()?
                }
            };
            at += block;
            current = Some(self.cache.insert(&prompt[..at], snapshot));
        }
        let blocks_time = started.elapsed();
        if boundary > cached {
            self.metrics.record_prefill(boundary - cached, blocks_time);
        }
        if boundary > 0 {
            self.metrics.record_lookup(cached);
        }

        let options = DecodeOptions {
            max_new: job.max_new,
            stop: match job.ignore_eos {
                true => BTreeSet::new(),
                false => model.stops.iter().copied().collect(),
            },
            sampling: job.sampling.clone(),
        };
        let mut constraint = match (&model.constrainer, model.masks && !job.tools.is_empty()) {
            (Some(c), true) => c
                .constraint(&job.tools, &job.choice)
                .map_err(|e| Stopped::Error(ApiError::invalid("invalid_tools", Some("tools"), e.to_string())))?,
            _ => None,
        };
        let mut text = TextOut {
            tok,
            // Stop strings end text answers; a call's own syntax may hold any of them.
            stops: if job.tools.is_empty() { &job.stop_strings } else { &[] },
            stream: job.stream && job.tools.is_empty(),
            events: &job.events,
            ids: Vec::new(),
            sent: 0,
            stop_at: None,
            gone: false,
        };
        let tail = &prompt[at..];
        let mut on_token = |id: i32| text.push(id);
        let generation = match (constraint.as_mut(), &current) {
            (Some(c), Some(s)) => {
                self.decoder
                    .generate_constrained(s, tail, &options, c as &mut dyn TokenConstraint, on_token)?
            }
            (Some(c), None) => {
                self.decoder
                    .complete_constrained(tail, &options, c as &mut dyn TokenConstraint, on_token)?
            }
            (None, Some(s)) => self.decoder.generate_until(s, tail, &options, on_token)?,
            (None, None) if tail.len() >= 2 => {
                // No whole block: the prompt but its last id as a prefix, so that the callback
                // can still end the answer early (`complete` cannot be stopped). A function of
                // the prompt alone, as the block pieces are.
                let head = self.decoder.prefill_prefix(&tail[..tail.len() - 1])?;
                self.decoder
                    .generate_until(&head, &tail[tail.len() - 1..], &options, on_token)?
            }
            (None, None) => self.decoder.complete(tail, &options, |id| {
                on_token(id);
            })?,
        };
        if text.gone || job.events.is_closed() {
            return Err(Stopped::Gone(generation.ids.len()));
        }
        let timing = &generation.timing;
        let predicted_ms = ms(timing.decode + timing.sample + timing.constrain);
        let prompt_ms = ms(blocks_time + timing.prefill + timing.restore + timing.chunk);
        let ids = generation.ids.clone();
        let ended_early = generation.stopped_at_eos || ids.len() < job.max_new;

        let (body, tool_calls, invalid) = if job.tools.is_empty() {
            let full = tok.decode(&ids);
            let cut = text.stop_at.unwrap_or(full.len());
            if job.stream && cut > text.sent {
                let _ = job.events.send(Event::Text(full[text.sent..cut].to_string()));
            }
            (full[..cut].to_string(), Vec::new(), Vec::new())
        } else {
            let answer = engine::parse_answer(tok, model.format, &model.stops, &job.tools, &ids);
            (answer.text, answer.calls, answer.invalid)
        };
        let finish = if !tool_calls.is_empty() {
            Finish::ToolCalls
        } else if text.stop_at.is_some() || ended_early {
            Finish::Stop
        } else {
            Finish::Length
        };
        Ok(Outcome {
            text: body,
            tool_calls,
            invalid_tool_calls: invalid,
            finish,
            prompt_tokens: prompt.len(),
            timings: Timings {
                queue_ms,
                cached_tokens: cached,
                prompt_n: prompt.len() - cached,
                prompt_ms,
                predicted_n: ids.len(),
                predicted_ms,
                saved_ms_estimate: self.metrics.prefill_ms_per_token() * cached as f64,
            },
            ids,
        })
    }
}

/// A text answer as it grows: stop strings found, pieces streamed, the client's departure seen.
struct TextOut<'a> {
    tok: &'a Tokenizer,
    stops: &'a [String],
    stream: bool,
    events: &'a UnboundedSender<Event>,
    ids: Vec<i32>,
    /// Bytes of the decoded text already sent.
    sent: usize,
    /// Where the first stop string starts.
    stop_at: Option<usize>,
    gone: bool,
}

impl TextOut<'_> {
    /// Takes the next id; `false` ends the generation.
    fn push(&mut self, id: i32) -> bool {
        self.ids.push(id);
        if self.events.is_closed() {
            self.gone = true;
            return false;
        }
        if self.stops.is_empty() && !self.stream {
            return true;
        }
        // Whole text each time: a piece may complete a character or a stop string that began
        // in an earlier id. Answers are short (max_tokens), so this stays cheap.
        let text = self.tok.decode(&self.ids);
        let found = self.stops.iter().filter_map(|s| text.find(s.as_str())).min();
        if let Some(at) = found {
            self.stop_at = Some(at);
            return false;
        }
        if self.stream {
            // Held back: an unfinished character, and any tail that may begin a stop string.
            let mut upto = text.len() - held_back(&text, self.stops);
            if text[..upto].ends_with('\u{FFFD}') {
                upto -= '\u{FFFD}'.len_utf8();
            }
            while !text.is_char_boundary(upto) {
                upto -= 1;
            }
            if upto > self.sent {
                if self
                    .events
                    .send(Event::Text(text[self.sent..upto].to_string()))
                    .is_err()
                {
                    self.gone = true;
                    return false;
                }
                self.sent = upto;
            }
        }
        true
    }
}

/// Bytes at the end of `text` that begin one of `stops` (so may still become it).
fn held_back(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|s| {
            (1..s.len())
                .rev()
                .filter(move |&n| s.is_char_boundary(n))
                .map(move |n| &s[..n])
        })
        .filter(|p| text.ends_with(p))
        .map(str::len)
        .max()
        .unwrap_or(0)
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_what_may_begin_a_stop_string() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(held_back("abc EN", &stops), 2);
        assert_eq!(held_back("abc E", &stops), 1);
        assert_eq!(held_back("abc\n", &stops), 1);
        assert_eq!(held_back("abc", &stops), 0);
        assert_eq!(held_back("é", &["éa".to_string()]), 2, "a whole character");
    }
}
