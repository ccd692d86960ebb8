//! The conformance suite on the IREE runtime cross-built for aarch64 and run under qemu-user by
//! `scripts/test-arm.sh`: the fixtures' graphs compiled for the aarch64 target triple
//! (`conformance::iree::cpu_triple`), on `local-sync` and `local-task`, compared with the FP32
//! reference as on x86. Only built for aarch64 (on x86 `iree_local_task` covers the CPU; armv7
//! has no IREE runtime here, see docs/reliability.md).
#![cfg(all(feature = "iree", target_arch = "aarch64"))]

mod local_sync {
    conformance::conformance_suite!(conformance::iree::IreeFactory {
        device: "local-sync",
        layout: export::Layout::Shared,
        contract: 1,
        cache_type: kv_core::manifest::CacheType::F32
    });
}

mod local_task {
    conformance::conformance_suite!(conformance::iree::IreeFactory {
        device: "local-task",
        layout: export::Layout::Shared,
        contract: 1,
        cache_type: kv_core::manifest::CacheType::F32
    });
}
