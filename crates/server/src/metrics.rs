//! Counters behind `/metrics` (JSON): requests, the prefix cache's hits and what they saved, the
//! queue.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value as Json};

use crate::worker::Outcome;

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub client_errors: AtomicU64,
    pub server_errors: AtomicU64,
    /// Refused with 429: the queue was full.
    pub rejected: AtomicU64,
    /// Stopped because the client went away.
    pub cancelled: AtomicU64,
    /// Ids the cancelled requests decoded before the worker saw the client gone.
    pub cancelled_tokens: AtomicU64,
    pub queued: AtomicUsize,
    pub active: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Requests whose prompt had at least one whole block (could hit).
    pub lookups: AtomicU64,
    pub hits: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// Block computations: ids and microseconds, for the cost per id that prices a hit.
    pub prefill_tokens: AtomicU64,
    pub prefill_us: AtomicU64,
    pub saved_us: AtomicU64,
    pub cache_entries: Vec<AtomicUsize>,
    pub cache_bytes: Vec<AtomicUsize>,
    pub cache_evictions: Vec<AtomicUsize>,
}

impl Metrics {
    pub fn new(sessions: usize) -> Self {
        let zeros = || (0..sessions).map(|_| AtomicUsize::new(0)).collect();
        Metrics {
            cache_entries: zeros(),
            cache_bytes: zeros(),
            cache_evictions: zeros(),
            ..Metrics::default()
        }
    }

    pub(crate) fn record_prefill(&self, tokens: usize, took: Duration) {
        self.prefill_tokens.fetch_add(tokens as u64, Ordering::SeqCst);
        self.prefill_us.fetch_add(took.as_micros() as u64, Ordering::SeqCst);
    }

    pub(crate) fn record_lookup(&self, cached: usize) {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        if cached > 0 {
            self.hits.fetch_add(1, Ordering::SeqCst);
            self.cached_tokens.fetch_add(cached as u64, Ordering::SeqCst);
        }
    }

    /// Measured block prefill cost per id (0 before any block was computed).
    pub(crate) fn prefill_ms_per_token(&self) -> f64 {
        let tokens = self.prefill_tokens.load(Ordering::SeqCst);
        match tokens {
            0 => 0.0,
            n => self.prefill_us.load(Ordering::SeqCst) as f64 / 1e3 / n as f64,
        }
    }

    pub(crate) fn record_answer(&self, outcome: &Outcome) {
        self.completed.fetch_add(1, Ordering::SeqCst);
        self.prompt_tokens
            .fetch_add(outcome.prompt_tokens as u64, Ordering::SeqCst);
        self.generated_tokens
            .fetch_add(outcome.ids.len() as u64, Ordering::SeqCst);
        self.saved_us
            .fetch_add((outcome.timings.saved_ms_estimate * 1e3) as u64, Ordering::SeqCst);
    }

    pub(crate) fn record_error(&self, status: StatusCode) {
        match status.is_client_error() {
            true => self.client_errors.fetch_add(1, Ordering::SeqCst),
            false => self.server_errors.fetch_add(1, Ordering::SeqCst),
        };
    }

    pub fn to_json(&self) -> Json {
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        let sum = |v: &[AtomicUsize]| v.iter().map(|a| a.load(Ordering::SeqCst)).sum::<usize>();
        let lookups = get(&self.lookups);
        let hits = get(&self.hits);
        json!({
            "requests": {
                "total": get(&self.requests),
                "completed": get(&self.completed),
                "client_errors": get(&self.client_errors),
                "server_errors": get(&self.server_errors),
                "rejected_queue_full": get(&self.rejected),
                "cancelled": get(&self.cancelled),
                "cancelled_after_tokens": get(&self.cancelled_tokens),
            },
            "queue": {
                "depth": self.queued.load(Ordering::SeqCst),
                "active": self.active.load(Ordering::SeqCst),
            },
            "tokens": {
                "prompt": get(&self.prompt_tokens),
                "generated": get(&self.generated_tokens),
            },
            "prefix_cache": {
                "lookups": lookups,
                "hits": hits,
                "misses": lookups - hits,
                "hit_rate": if lookups == 0 { 0.0 } else { hits as f64 / lookups as f64 },
                "tokens_reused": get(&self.cached_tokens),
                "tokens_prefilled": get(&self.prefill_tokens),
                "prefill_ms_per_token": self.prefill_ms_per_token(),
                "time_saved_ms_estimate": get(&self.saved_us) as f64 / 1e3,
                "entries": sum(&self.cache_entries),
                "bytes_estimate": sum(&self.cache_bytes),
                "evictions": sum(&self.cache_evictions),
            },
        })
    }
}
