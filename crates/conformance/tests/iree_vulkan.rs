//! The conformance suite on IREE's `vulkan` device (lavapipe in CI, a GPU where there is one).
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "vulkan",
    layout: export::Layout::Shared,
    contract: 1,
    cache_type: kv_core::manifest::CacheType::F32
});
