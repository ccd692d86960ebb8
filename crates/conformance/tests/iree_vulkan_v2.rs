//! The conformance suite on IREE's `vulkan` device (lavapipe in CI) with contract v2 graphs in
//! the seed's three-module layout (here: a chunk and a step module, each with its archive).
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "vulkan",
    layout: export::Layout::Three,
    contract: 2,
    cache_type: kv_core::manifest::CacheType::F32
});
