//! The caller-supplied storage of contract v2's step and embedding functions
//! (`iree_runtime::StorageSpec`): results written into buffers the session keeps, so that a
//! Vulkan call allocates nothing on the device's queue (with an allocation, each call waited on
//! the host for the one before it: decode 4.46 → 2.20 ms/token on an H100 for the NVIDIA-tuned
//! export, 6.69 → 4.46 for the portable one; docs/journal/sessions-30-34.md, session 31).
//!
//! A call's tied results are views of the set it was given, overwritten when that set is given
//! again. What reads them: the queue (row writes, the token's copy, the next call's inputs:
//! calls and transfers run in submission order on the device's one timeline, so a later call
//! never overwrites what an earlier queued op still has to read) and the host, for the top-k
//! results (`last_top_k`) and a token read directly. So a call never gets the set of the call
//! before it (a step queued ahead reads its token from there) nor a set holding a result the
//! session still keeps (the caller names those: the last top-k); snapshots copy the top-k they
//! keep ([`super::IreeKvBackend::owned_top_k`]). Three sets always leave one free. The
//! transients' buffer is one per function: its calls run one after another.

use std::collections::HashMap;

use iree_runtime::{BufferView, CallStorage, Device, Function, StorageSpec};

use crate::convert::iree_err;

/// The set for `function`'s next call from its ring in `rings` ([`StorageRing::next`]), `None`
/// for a function that allocates its own results.
pub(super) fn next_set(
    rings: &mut HashMap<String, StorageRing>,
    device: &Device,
    function: &Function,
    keep: &[&BufferView],
) -> kv_core::Result<Option<CallStorage>> {
    let Some(spec) = function.storage() else {
        return Ok(None);
    };
    let ring = rings
        .entry(function.name.clone())
        .or_insert_with(|| StorageRing::new(spec.clone()));
    let set = ring.next(device, keep);
    set.map(Some)
        .map_err(iree_err(format!("allocate the results of {}", function.name)))
}

/// Storage sets of one function, used in turn.
pub(super) struct StorageRing {
    spec: StorageSpec,
    sets: [Option<CallStorage>; 3],
    /// The set the last call was given.
    last: Option<usize>,
}

impl StorageRing {
    pub(super) fn new(spec: StorageSpec) -> StorageRing {
        StorageRing {
            spec,
            sets: [None, None, None],
            last: None,
        }
    }

    /// The set for the next call: not the last call's, and none holding a view of `keep`
    /// (allocated on first use).
    pub(super) fn next(&mut self, device: &Device, keep: &[&BufferView]) -> iree_runtime::Result<CallStorage> {
        let free = (0..self.sets.len())
            .find(|&i| {
                Some(i) != self.last
                    && self.sets[i]
                        .as_ref()
                        .is_none_or(|set| !keep.iter().any(|view| set.holds(view)))
            })
            .unwrap_or_else(|| kv_core::error::invariant("three storage sets and at most two taken"));
        if self.sets[free].is_none() {
            let transients = self.sets.iter().flatten().find_map(CallStorage::transients).cloned();
            self.sets[free] = Some(self.spec.allocate_results(device, transients.as_ref())?);
        }
        self.last = Some(free);
        Ok(self.sets[free].clone().expect("allocated above"))
    }

    /// Whether `view` is a result held in one of the sets.
    pub(super) fn holds(&self, view: &BufferView) -> bool {
        self.sets.iter().flatten().any(|set| set.holds(view))
    }
}

#[cfg(test)]
mod tests {
    use iree_runtime::{BufferView, Device, ElementType, Instance, StorageSpec};

    use super::StorageRing;

    fn ring() -> (Device, StorageRing) {
        let device = Device::open(&Instance::shared().unwrap(), "local-sync").unwrap();
        let spec = StorageSpec {
            results: vec![(vec![2], ElementType::F32), (vec![1], ElementType::I32)],
            transients: Some(64),
        };
        (device, StorageRing::new(spec))
    }

    /// Which of `sets` (in allocation order) holds `set`'s first result.
    fn index(sets: &[iree_runtime::CallStorage], set: &iree_runtime::CallStorage) -> usize {
        sets.iter().position(|s| s.holds(&set.results()[0])).unwrap()
    }

    #[test]
    fn a_call_never_gets_the_last_set_nor_one_holding_a_kept_result() {
        let (device, mut ring) = ring();
        let a = ring.next(&device, &[]).unwrap();
        let b = ring.next(&device, &[]).unwrap();
        assert!(!a.holds(&b.results()[0]), "the last call's set is not given again");
        // Nothing kept: two sets in turn.
        let again = ring.next(&device, &[]).unwrap();
        assert!(again.holds(&a.results()[0]));
        // The last call's set (`again` = a) and one holding a kept result (b's top-k, say) are
        // both taken: a third set.
        let kept: &BufferView = &b.results()[1];
        let c = ring.next(&device, &[kept]).unwrap();
        let sets = [a.clone(), b.clone(), c.clone()];
        assert_eq!(index(&sets, &c), 2);
        assert!(ring.holds(kept) && ring.holds(&c.results()[0]));
        assert!(!ring.holds(&BufferView::from_f32(&device, &[2], &[0.0, 1.0]).unwrap()));
        // Every set shares one transients buffer: the function's calls run one after another.
        let t = |s: &iree_runtime::CallStorage| s.transients().unwrap().clone();
        assert!(t(&a).shares_buffer(&t(&b)) && t(&b).shares_buffer(&t(&c)));
        assert!(t(&a).byte_length() >= 64);
        // With the kept result released, the ring goes back to alternating.
        let d = ring.next(&device, &[]).unwrap();
        assert_ne!(index(&sets, &d), 2);
    }
}
