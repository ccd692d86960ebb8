//! Greedy decoding one step ahead of the host ([`KvBackend::step_greedy`] on an async device).
//!
//! A step's token is the next step's input. Read on the host first, every step would wait for
//! the device, then the device for the host (the embedding row, the inputs, recording the
//! call): ~0.9 ms a step on the H200 (docs/journal, session 16). Here the next step is
//! queued before the host reads the token: its embedding row is gathered on the device by the
//! step module's `embed_token` function (`Manifest::embed_function`) from the token the
//! device holds, so the host reads step `n`'s token while step `n + 1` runs. When the reader
//! says stop, the step queued ahead is dropped. Contract v1 calls return new caches, so it
//! changed nothing the session keeps. A contract v2 step writes its rows into the caches: the
//! step queued ahead writes position `p + 1` of a session left at `p + 1`, a row no call reads
//! before the next step overwrites it (masked on global layers; on a ring, the slot of position
//! `p + 1 - rows`, outside every window from `p + 1` on), and a row no live snapshot keeps (the
//! step forks the caches first, as any step, and a dropped step's fork is dropped with it).

use std::collections::HashMap;
use std::time::Instant;

use iree_runtime::{BufferView, ElementType, Queued, Transfer};
use kv_core::manifest::Name;
use kv_core::window::plan_step;
use kv_core::{Error, Graph, Result};

use super::{Caches, IreeKvBackend, TopKViews, Variant};
use crate::convert::{contract_err, iree_err};

/// What a step is fed: a token the host knows, or the token a queued step will compute.
enum Fed {
    Host(i32),
    Device(BufferView),
}

/// A step on the device's queue whose token the host has not read.
struct Ahead {
    /// The caches after the step: contract v1's returned ones, or the v2 set it wrote into.
    caches: Caches,
    token: BufferView,
    top_k: Option<TopKViews>,
    /// Where the token is read: a host-mappable copy queued after the step.
    readback: BufferView,
    done: Queued,
}

impl IreeKvBackend {
    /// Whether greedy decoding ([`KvBackend::step_greedy`](kv_core::KvBackend::step_greedy))
    /// runs a step ahead of the host: with the step module's embedding function, which is
    /// looked up only where it is async (Vulkan); under contract v2 once the session has
    /// caches (after a prefill or a restore).
    pub fn runs_ahead(&self) -> bool {
        self.embed.is_some() && !matches!(self.caches, Caches::V2(None))
    }

    /// [`KvBackend::step_greedy`](kv_core::KvBackend::step_greedy) with one step queued ahead.
    pub(super) fn step_greedy_ahead(
        &mut self,
        token: i32,
        max: usize,
        more: &mut dyn FnMut(i32) -> bool,
    ) -> Result<usize> {
        if max == 0 {
            return Ok(0);
        }
        let started = Instant::now();
        let before = self.clock;
        let caches = self.caches.clone();
        let mut current = self.queue_step(Fed::Host(token), &caches, self.position, 0)?;
        let mut steps = 0;
        let result = loop {
            // (Where the step after `current` would not fit the context, none is queued; it is
            // then asked for one step at a time below, which fails as it would have.)
            let fits = self.position + 2 <= self.manifest.spec.max_positions;
            let ahead = if steps + 1 < max && fits {
                let fed = Fed::Device(current.token.clone());
                match self.queue_step(fed, &current.caches, self.position + 1, (steps + 1) % 2) {
                    Ok(ahead) => Some(ahead),
                    Err(e) => break Err(e),
                }
            } else {
                None
            };
            let t = Instant::now();
            let token = self.read_ahead(&current);
            self.clock.read += t.elapsed();
            let token = match token {
                Ok(token) => token,
                Err(e) => break Err(e),
            };
            self.caches = current.caches;
            self.position += 1;
            self.last_top_k = current.top_k;
            steps += 1;
            if !more(token) {
                break Ok(steps);
            }
            match ahead {
                Some(next) => current = next,
                None if steps < max => {
                    break kv_core::backend::step_greedy_serially(self, token, max - steps, more).map(|n| steps + n)
                }
                None => break Ok(steps),
            }
        };
        self.count_steps(steps, started, before);
        result
    }

    /// Queues a step at `position` on `fed` over `caches` (under contract v2 with its row
    /// writes), and the copy of its token into read-back buffer `slot` (two, so that the copy of
    /// the step ahead never writes the one being read).
    fn queue_step(&mut self, fed: Fed, caches: &Caches, position: usize, slot: usize) -> Result<Ahead> {
        let spec = self.manifest.spec.clone();
        // A token on the device is an argmax (in range); the plan checks a host one.
        let checked = match fed {
            Fed::Host(token) => token,
            Fed::Device(_) => 0,
        };
        let plan = plan_step(&spec, position, checked, self.options.rule)?;
        let (token, emb) = match fed {
            Fed::Host(token) => (
                self.i32_view(&[1], &[token])?,
                self.f32_view(&[1, spec.hidden_size], &self.embedding.gather(&[token])?)?,
            ),
            Fed::Device(token) => {
                let emb = self.embed_on_device(&token)?;
                (token, emb)
            }
        };
        let mut inputs = HashMap::new();
        inputs.insert(Name::Token, token);
        inputs.insert(Name::Emb, emb);
        self.kind_inputs(&mut inputs, &plan.kinds, 1, false)?;
        let readback = self.readback_slot(slot)?;
        let (results, after, done) = match caches {
            Caches::V1(layers) => {
                let pasts: Vec<usize> = (0..spec.n_layers).map(|l| plan.kind(spec.layer_kind(l)).past).collect();
                let (results, layers) = self.call_after(Graph::Step, inputs, layers, position, &pasts, 1, 1)?;
                let done = self.queue_token_copy(&results, &readback, Vec::new())?;
                (results, Caches::V1(layers), done)
            }
            Caches::V2(None) => kv_core::error::invariant("a step queued ahead before the v2 caches exist"),
            Caches::V2(Some(set)) => {
                self.v2_cache_inputs(&mut inputs, set, position, spec.max_positions)?;
                let results = self.v2_call(Graph::Step, Variant::Own, inputs, set, 1)?;
                let writes = position..position + 1;
                let fork = self.v2_fork_for(set, writes.clone())?;
                let ops = self.v2_row_writes(set, fork.as_deref(), &results, writes);
                let t = Instant::now();
                let done = self.queue_token_copy(&results, &readback, ops);
                self.clock.writes += t.elapsed();
                (results, Caches::V2(Some(fork.unwrap_or_else(|| set.clone()))), done?)
            }
        };
        Ok(Ahead {
            caches: after,
            top_k: Self::top_k_views(&results),
            token: results[&Name::Token].clone(),
            readback,
            done,
        })
    }

    /// Queues `ops` and the copy of a call's token into `readback`, in one submission.
    fn queue_token_copy<'a>(
        &self,
        results: &'a HashMap<Name, BufferView>,
        readback: &'a BufferView,
        mut ops: Vec<Transfer<'a>>,
    ) -> Result<Queued> {
        ops.push(Transfer::Copy {
            source: &results[&Name::Token],
            source_offset: 0,
            target: readback,
            target_offset: 0,
            length: 4,
        });
        self.device
            .transfer_queued(&ops)
            .map_err(iree_err("queue a step's row writes and the copy of its token"))
    }

    /// The embedding row of the token `token` holds, gathered on the device.
    fn embed_on_device(&mut self, token: &BufferView) -> Result<BufferView> {
        let (Some(embed), Some((index, _))) = (&self.embed, self.functions.get(&Graph::Step)) else {
            kv_core::error::invariant("a step ahead without the embedding function");
        };
        let session = self.sessions[*index]
            .as_ref()
            .unwrap_or_else(|| kv_core::error::invariant("the step graph's session was released"));
        // Its row is read only by the step queued after it: any set but the last call's will do.
        let storage = super::storage::next_set(&mut self.storage, &self.device, embed, &[])?;
        let t = Instant::now();
        let results = session.lock().call_function_with(embed, &[token], storage.as_ref());
        self.clock.invoke += t.elapsed();
        let mut results = results.map_err(iree_err(format!("call {}", embed.name)))?;
        let shape = [1, self.manifest.spec.hidden_size];
        match results.pop() {
            Some(row) if results.is_empty() && row.shape() == shape && row.element_type() == ElementType::F32 => {
                Ok(row)
            }
            _ => Err(contract_err(
                "embedFunction",
                format!("{} must return one f32 {shape:?} row", embed.name),
            )),
        }
    }

    /// Waits for `ahead`'s token and reads it.
    fn read_ahead(&self, ahead: &Ahead) -> Result<i32> {
        let token = ahead
            .readback
            .to_i32_vec_when(ahead.done)
            .map_err(iree_err("read a step's token"))?[0];
        let vocab = self.manifest.spec.vocab_size;
        if token < 0 || token as usize >= vocab {
            return Err(Error::ContractMismatch {
                backend: "iree",
                op: Graph::Step.key().into(),
                message: format!("the step predicted id {token}, outside the vocabulary of {vocab}"),
            });
        }
        Ok(token)
    }
}
