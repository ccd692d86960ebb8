//! [`ReferenceKv`]: the KV-cache session of CONTRACT §2, executed on the host in f32.

use std::sync::Arc;

use kv_core::allowed::AllowedTokens;
use kv_core::manifest::CacheType;
use kv_core::snapshot_file::{Block, LayerRows};
use kv_core::window::{plan_chunk, plan_prefill, plan_step, KindInputs};
use kv_core::{
    Error, KvBackend, KvSpec, LayerKv, ModelFingerprint, PersistSnapshot, Result, SessionId, TopK, WindowRule,
};
use ndarray::{concatenate, s, Array3, ArrayView3, Axis};

use crate::forward::{argmax_lowest, KeyMask, LayerInputs};
use crate::model::ReferenceModel;

/// One layer's cached rows. Invariant: they cover the absolute positions
/// `first_position .. first_position + rows` and end at the session's position, so a call can
/// hand the layer any tail of them. Global layers start at 0; sliding layers start wherever the
/// rows of their last call started.
#[derive(Clone, Debug)]
struct LayerCache {
    first_position: usize,
    /// `[nKvHeads, rows, d]`, post-RoPE.
    k: Arc<Array3<f32>>,
    v: Arc<Array3<f32>>,
}

impl LayerCache {
    fn empty(spec: &KvSpec) -> Self {
        let empty = Arc::new(Array3::zeros((spec.n_kv_heads, 0, spec.head_dim)));
        LayerCache {
            first_position: 0,
            k: empty.clone(),
            v: empty,
        }
    }

    fn rows(&self) -> usize {
        self.k.dim().1
    }

    fn to_host(&self, spec: &KvSpec) -> LayerKv {
        LayerKv {
            first_position: self.first_position,
            rows: self.rows(),
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            k: self.k.iter().copied().collect(),
            v: self.v.iter().copied().collect(),
        }
    }

    /// The last `past` rows, as the graphs are handed them.
    fn tail(&self, past: usize) -> (ArrayView3<'_, f32>, ArrayView3<'_, f32>) {
        let rows = self.rows();
        if past > rows {
            kv_core::error::invariant("a layer is asked for more past rows than it holds");
        }
        (
            self.k.slice(s![.., rows - past.., ..]),
            self.v.slice(s![.., rows - past.., ..]),
        )
    }

    /// The tail of `past` rows followed by the first `keep` of a call's new rows.
    fn extended(&self, past: usize, new_k: &Array3<f32>, new_v: &Array3<f32>, keep: usize) -> Self {
        let (past_k, past_v) = self.tail(past);
        let join = |old: ArrayView3<f32>, new: &Array3<f32>| {
            Arc::new(
                concatenate(Axis(1), &[old, new.slice(s![.., ..keep, ..])])
                    .unwrap_or_else(|_| kv_core::error::invariant("new rows match the cache")),
            )
        };
        LayerCache {
            first_position: self.first_position + self.rows() - past,
            k: join(past_k, new_k),
            v: join(past_v, new_v),
        }
    }
}

/// An owned view of a session at one position: `Arc` clones of every layer's rows, no K/V copy.
#[derive(Clone, Debug)]
pub struct ReferenceSnapshot {
    session: SessionId,
    position: usize,
    caches: Vec<LayerCache>,
    last_logits: Option<Arc<[f32]>>,
    last_allowed: Option<Arc<AllowedTokens>>,
}

impl ReferenceSnapshot {
    pub fn position(&self) -> usize {
        self.position
    }

    pub fn session(&self) -> SessionId {
        self.session
    }
}

/// The FP32 KV-cache session. Its answers are what every other backend is checked against.
#[derive(Debug)]
pub struct ReferenceKv {
    model: Arc<ReferenceModel>,
    rule: WindowRule,
    session: SessionId,
    /// Tokens consumed since the last prefill; every layer cache ends here.
    position: usize,
    caches: Vec<LayerCache>,
    /// Logits of the last real row of the last successful call, unmasked.
    last_logits: Option<Arc<[f32]>>,
    /// The mask later calls predict under ([`KvBackend::set_allowed`]); `None`: every id.
    allowed: Option<Arc<AllowedTokens>>,
    /// The mask the last call predicted under: its top-k honours it even if the mask changed
    /// since, as a graph's top-k computed in the call would.
    last_allowed: Option<Arc<AllowedTokens>>,
}

impl ReferenceKv {
    /// A fresh session. `rule` picks the rows a sliding layer sees on a step call:
    /// [`WindowRule::Exact`] (the FP32 model) or [`WindowRule::SeedStep`] (the seed's runtime).
    pub fn new(model: Arc<ReferenceModel>, rule: WindowRule) -> Self {
        let caches = (0..model.spec().n_layers)
            .map(|_| LayerCache::empty(model.spec()))
            .collect();
        ReferenceKv {
            model,
            rule,
            session: SessionId::fresh(),
            position: 0,
            caches,
            last_logits: None,
            allowed: None,
            last_allowed: None,
        }
    }

    pub fn model(&self) -> &Arc<ReferenceModel> {
        &self.model
    }

    pub fn rule(&self) -> WindowRule {
        self.rule
    }

    pub fn session_id(&self) -> SessionId {
        self.session
    }

    /// Runs a block of rows after the caches' tails: layer `l` is handed the last `past` rows of
    /// its kind, keeps them plus the first `keep` new rows, and the logits of row `keep - 1` are
    /// the call's answer. Only assigns state once everything is computed.
    fn run_with_past(&mut self, tokens: &[i32], kinds: &[KindInputs], chunk_mask: bool, keep: usize) -> i32 {
        let spec = self.model.spec();
        let kind_of = |layer: usize| {
            let kind = spec.layer_kind(layer);
            kinds
                .iter()
                .find(|k| k.kind == kind)
                .unwrap_or_else(|| kv_core::error::invariant("plan covers every layer kind"))
        };
        let mask_heads = spec.mask_head_count();
        let out = self.model.forward_block(tokens, |layer| {
            let inputs = kind_of(layer);
            let (past_k, past_v) = self.caches[layer].tail(inputs.past);
            let mask = if chunk_mask {
                KeyMask::Additive {
                    mask: &inputs.mask,
                    heads: mask_heads,
                }
            } else {
                KeyMask::None
            };
            LayerInputs {
                past_k,
                past_v,
                rope: &inputs.rope,
                mask,
            }
        });
        let caches: Vec<LayerCache> = out
            .kv
            .iter()
            .enumerate()
            .map(|(layer, (k, v))| self.caches[layer].extended(kind_of(layer).past, k, v, keep))
            .collect();
        let logits = self.model.logits(out.x.slice(s![keep - 1..keep, ..]));
        self.finish(caches, self.position + keep, logits.iter().copied().collect())
    }

    fn finish(&mut self, caches: Vec<LayerCache>, position: usize, logits: Arc<[f32]>) -> i32 {
        self.caches = caches;
        self.position = position;
        // Nothing allowed: unspecified by the trait; 0 keeps the call total.
        let token = match &self.allowed {
            Some(allowed) => allowed.argmax(&logits).unwrap_or(0),
            None => argmax_lowest(&logits) as i32,
        };
        self.last_logits = Some(logits);
        self.last_allowed = self.allowed.clone();
        token
    }
}

impl KvBackend for ReferenceKv {
    type Snapshot = ReferenceSnapshot;

    fn spec(&self) -> &KvSpec {
        self.model.spec()
    }

    /// Starts over from position 0; every layer keeps all `n` rows (the prefill graph's first `n`).
    fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        let plan = plan_prefill(self.model.spec(), tokens)?;
        let out = self.model.forward_from_start(&plan.tokens[..plan.n]);
        let caches = out
            .kv
            .into_iter()
            .map(|(k, v)| LayerCache {
                first_position: 0,
                k: Arc::new(k),
                v: Arc::new(v),
            })
            .collect();
        let logits = self.model.logits(out.x.slice(s![plan.n - 1..plan.n, ..]));
        Ok(self.finish(caches, plan.n, logits.iter().copied().collect()))
    }

    /// Computes all `C` rows of the padded chunk (padding rows see only themselves, as in the
    /// graph) and keeps the `n` real ones.
    fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        let plan = plan_chunk(self.model.spec(), self.position, tokens)?;
        Ok(self.run_with_past(&plan.tokens, &plan.kinds, true, plan.n))
    }

    /// No mask: the rows handed to a sliding layer are its window (per the session's rule).
    fn step(&mut self, token: i32) -> Result<i32> {
        let plan = plan_step(self.model.spec(), self.position, token, self.rule)?;
        Ok(self.run_with_past(&[plan.token], &plan.kinds, false, 1))
    }

    fn snapshot(&self) -> Result<ReferenceSnapshot> {
        Ok(ReferenceSnapshot {
            session: self.session,
            position: self.position,
            caches: self.caches.clone(),
            last_logits: self.last_logits.clone(),
            last_allowed: self.last_allowed.clone(),
        })
    }

    fn restore(&mut self, snapshot: &ReferenceSnapshot) -> Result<()> {
        self.session.check_owner(snapshot.session)?;
        self.position = snapshot.position;
        self.caches = snapshot.caches.clone();
        self.last_logits = snapshot.last_logits.clone();
        self.last_allowed = snapshot.last_allowed.clone();
        Ok(())
    }

    fn snapshot_position(&self, snapshot: &ReferenceSnapshot) -> usize {
        snapshot.position
    }

    fn position(&self) -> usize {
        self.position
    }

    fn read_layer(&self, layer: usize) -> Result<LayerKv> {
        let cache = self.caches.get(layer).ok_or(Error::LayerOutOfRange {
            layer,
            n_layers: self.caches.len(),
        })?;
        Ok(cache.to_host(self.model.spec()))
    }

    fn last_logits(&self) -> Option<&[f32]> {
        self.last_logits.as_deref()
    }

    /// Every logit is at hand, so any `k` up to the vocabulary.
    fn top_k_capacity(&self) -> Option<usize> {
        Some(self.model.spec().vocab_size)
    }

    /// Under a mask, disallowed ids rank last at `-inf` (as the graphs' masked top-k has them).
    fn last_top_k(&self, k: usize) -> Result<Option<TopK>> {
        Ok(self
            .last_logits
            .as_deref()
            .filter(|logits| k <= logits.len())
            .map(|logits| match &self.last_allowed {
                Some(allowed) => {
                    let mut masked = logits.to_vec();
                    allowed.mask_logits(&mut masked);
                    TopK::of_logits(&masked, k)
                }
                None => TopK::of_logits(logits, k),
            }))
    }

    /// Applied on the host to the full logits: the masked argmax keeps the lowest-id tie rule.
    fn set_allowed(&mut self, allowed: Option<&AllowedTokens>) -> Result<()> {
        let vocab = self.model.spec().vocab_size;
        if let Some(a) = allowed {
            a.check_vocab(vocab)?;
        }
        self.allowed = allowed.filter(|a| !a.is_all()).map(|a| Arc::new(a.clone()));
        Ok(())
    }

    fn name(&self) -> String {
        "reference".into()
    }
}

impl PersistSnapshot for ReferenceKv {
    fn model_fingerprint(&self) -> Result<ModelFingerprint> {
        let table = self.model.embedding();
        ModelFingerprint::compute(self.model.spec(), |ids| {
            Ok(ids.iter().flat_map(|&id| table.row(id as usize).to_vec()).collect())
        })
    }

    fn window_rule(&self) -> WindowRule {
        self.rule
    }

    fn snapshot_layer(&self, snapshot: &ReferenceSnapshot, layer: usize) -> Result<LayerKv> {
        self.session.check_owner(snapshot.session)?;
        let spec = self.model.spec();
        if layer >= spec.n_layers {
            return Err(Error::Backend {
                backend: "reference",
                op: "save snapshot".into(),
                source: format!("no layer {layer} in a model of {}", spec.n_layers).into(),
            });
        }
        // A snapshot at position 0 holds no layers.
        Ok(snapshot
            .caches
            .get(layer)
            .map_or_else(|| LayerKv::empty(spec), |cache| cache.to_host(spec)))
    }

    fn cache_type(&self) -> CacheType {
        self.model.manifest().cache_type
    }

    /// The loaded snapshot has no logits of a last call (`last_logits` is `None` after restoring
    /// it until the next call).
    fn snapshot_from_layers<'a>(
        &self,
        position: usize,
        layers: &mut dyn Iterator<Item = LayerRows<'a>>,
    ) -> Result<ReferenceSnapshot> {
        let spec = self.model.spec();
        // The values as this session's caches hold them (a file of another type converts).
        let ty = self.model.manifest().cache_type;
        let array = |rows: usize, data: &Block<'_>| {
            Array3::from_shape_vec((spec.n_kv_heads, rows, spec.head_dim), ty.decode(&data.to_bytes_of(ty)))
                .map(Arc::new)
                .map_err(|e| Error::Backend {
                    backend: "reference",
                    op: "load snapshot".into(),
                    source: e.into(),
                })
        };
        let caches = layers
            .map(|l| {
                Ok(LayerCache {
                    first_position: l.first_position,
                    k: array(l.rows, &l.k)?,
                    v: array(l.rows, &l.v)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(ReferenceSnapshot {
            session: self.session,
            position,
            caches,
            last_logits: None,
            last_allowed: None,
        })
    }
}
