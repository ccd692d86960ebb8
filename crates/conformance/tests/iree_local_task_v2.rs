//! The conformance suite on IREE's `local-task` CPU device with contract v2 graphs
//! (`docs/contract-v2.md`): static shapes, runtime-owned caches, prefills as chunk calls.
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "local-task",
    layout: export::Layout::Shared,
    contract: kv_core::ContractVersion::V2,
    cache_type: kv_core::manifest::CacheType::F32
});
