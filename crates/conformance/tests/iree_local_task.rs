//! The conformance suite on IREE's `local-task` CPU device, one module and archive for all graphs.
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "local-task",
    layout: export::Layout::Shared,
    contract: kv_core::ContractVersion::V1,
    cache_type: kv_core::manifest::CacheType::F32
});
