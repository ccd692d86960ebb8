//! How a backend is opened for a problem.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use backend_reference::{ReferenceKv, ReferenceModel, ReferenceRedecode};
use kv_core::manifest::Rounding;
use kv_core::tolerance::Tolerance;
use kv_core::{PersistSnapshot, RedecodeBackend, Result, WindowRule};

/// Opens sessions of one backend on fixture models (`tiny-gemma3:7`, `tiny-gemma3:7:w5`, ...).
pub trait BackendFactory {
    type Kv: PersistSnapshot;
    type Redecode: RedecodeBackend;

    fn name(&self) -> String;

    fn kv(&self, model: &str, rule: WindowRule) -> Result<Self::Kv>;

    /// A session that hands over at least `k` of the best logits per call
    /// ([`KvBackend::last_top_k`]): for compiled backends, graphs exported with a top-k.
    fn kv_with_top_k(&self, model: &str, k: usize) -> Result<Self::Kv>;

    /// A redecode session of the model's `seq`.
    fn redecode(&self, model: &str) -> Result<Self::Redecode>;

    /// How close this backend's K/V must be to the reference's.
    fn tolerance(&self) -> Tolerance;

    /// How close this backend's K/V must be to its own along another path through other graphs:
    /// a whole prefill against a prefix, chunk calls and steps (the prefill graph's SEQ rows, the
    /// chunk graph's and the step graph's: other tilings, so other summation orders). Measured on
    /// the IREE CPU (v1, v2) and lavapipe suites at most 8e-6 apart over f32 caches; over f16
    /// ones the two paths' roundings differ ([`Tolerance::SAME_BACKEND_F16_CACHES`]). Replays of
    /// the SAME calls are compared bit for bit instead
    /// ([`Tolerance::EXACT`]), whatever the backend.
    fn path_tolerance(&self) -> Tolerance {
        if self.rounding().cache_type.is_f32() {
            Tolerance::SAME_BACKEND
        } else {
            Tolerance::SAME_BACKEND_F16_CACHES
        }
    }

    /// Property-test cases per problem: the reference is cheap, compiled backends less so.
    fn cases(&self) -> u32;

    /// Whether sessions can run the seed's step rule (`WindowRule::SeedStep`); contract v2
    /// graphs build their masks with the exact rule only and refuse it at open.
    fn supports_seed_step_rule(&self) -> bool {
        true
    }

    /// Whether sessions take an allowed-token mask (`KvBackend::set_allowed`); contract v1
    /// graphs have no mask argument and refuse one.
    fn supports_allowed_mask(&self) -> bool {
        true
    }

    /// What this backend rounds beyond FP32 (its artifacts' `matmulInput` and `cacheType`): the
    /// problems compare it with a reference that rounds the same.
    fn rounding(&self) -> Rounding {
        Rounding::FP32
    }

    /// Whether this is the reference itself: a problem that compares a backend with
    /// [`ReferenceFactory::like`] would then compare the reference with itself, and needs
    /// another expectation there (the naive recompute).
    fn is_reference(&self) -> bool {
        false
    }
}

/// The reference: the FP32 forward, or one that rounds as some artifacts do (`rounding`).
/// Models are loaded once per process and rounding.
#[derive(Clone, Copy, Default)]
pub struct ReferenceFactory {
    pub rounding: Rounding,
}

impl ReferenceFactory {
    /// The reference that rounds as `factory`'s backend does.
    pub fn like<F: BackendFactory>(factory: &F) -> Self {
        ReferenceFactory {
            rounding: factory.rounding(),
        }
    }
}

/// The FP32 reference model.
pub fn reference_model(model: &str) -> Result<Arc<ReferenceModel>> {
    rounding_model(model, Rounding::FP32)
}

fn rounding_model(model: &str, rounding: Rounding) -> Result<Arc<ReferenceModel>> {
    type Cache = HashMap<(String, Rounding), Arc<ReferenceModel>>;
    static CACHE: Mutex<Option<Cache>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    let key = (model.to_string(), rounding);
    if let Some(m) = cache.get(&key) {
        return Ok(m.clone());
    }
    let loaded = ReferenceModel::open_with_rounding(&fixtures::materialize(model)?, Some(rounding))?;
    cache.insert(key, loaded.clone());
    Ok(loaded)
}

impl BackendFactory for ReferenceFactory {
    type Kv = ReferenceKv;
    type Redecode = ReferenceRedecode;

    fn name(&self) -> String {
        "reference".into()
    }

    fn kv(&self, model: &str, rule: WindowRule) -> Result<ReferenceKv> {
        Ok(ReferenceKv::new(rounding_model(model, self.rounding)?, rule))
    }

    /// The reference holds every logit: any `k` works.
    fn kv_with_top_k(&self, model: &str, _k: usize) -> Result<ReferenceKv> {
        self.kv(model, WindowRule::Exact)
    }

    fn redecode(&self, model: &str) -> Result<ReferenceRedecode> {
        Ok(ReferenceRedecode::new(rounding_model(model, self.rounding)?))
    }

    fn tolerance(&self) -> Tolerance {
        Tolerance::SAME_BACKEND
    }

    fn is_reference(&self) -> bool {
        true
    }

    /// The reference computes each row by the same host code whatever call it arrives in (one
    /// row of a prefill, of a chunk or a step: the same products in the same order), so its paths
    /// agree bit for bit.
    fn path_tolerance(&self) -> Tolerance {
        Tolerance::EXACT
    }

    fn rounding(&self) -> Rounding {
        self.rounding
    }

    fn cases(&self) -> u32 {
        24
    }
}
