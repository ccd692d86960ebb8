//! The conformance suite on `local-task` with the seed's layout: three modules, three archives
//! with their own key numbering, three sessions on one device.
//! `prefill` runs as chunk calls from an empty cache here (`IreeFactory`: the shared layout's
//! suites run the prefill graph).
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "local-task",
    layout: export::Layout::Three,
    contract: 1,
    cache_type: kv_core::manifest::CacheType::F32
});
