//! The conformance suite on IREE's `vulkan` device with the seed's layout: three modules, three
//! archives, three sessions on one device (lavapipe in CI). Until each device had one HAL group
//! shared by its sessions, the second session failed ("Vulkan queue frontier already assigned").
//! `prefill` runs as chunk calls from an empty cache here (`IreeFactory`: the shared layout's
//! suites run the prefill graph).
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "vulkan",
    layout: export::Layout::Three,
    contract: 1,
    cache_type: kv_core::manifest::CacheType::F32
});
