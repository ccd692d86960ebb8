//! The conformance suite on IREE's `local-task` CPU device with contract v2 graphs over f16
//! caches (`cacheType`, what `--cpu host` exports keep on CPUs with F16C; `docs/contract-v2.md`),
//! against a reference that rounds the same K/V rows.
#![cfg(feature = "iree")]
conformance::conformance_suite!(conformance::iree::IreeFactory {
    device: "local-task",
    layout: export::Layout::Shared,
    contract: 2,
    cache_type: kv_core::manifest::CacheType::F16
});
