//! The conformance suite on the IREE runtime cross-built for ARM (aarch64, armv7) and run under
//! qemu-user by `scripts/test-arm.sh`: the fixtures' graphs compiled for the ARM target triple
//! (`conformance::iree::cpu_triple`), on `local-sync` and `local-task`, compared with the FP32
//! reference as on x86. Only built for ARM targets (on x86 `iree_local_task` covers the CPU).
#![cfg(all(feature = "iree", any(target_arch = "aarch64", target_arch = "arm")))]

mod local_sync {
    conformance::conformance_suite!(conformance::iree::IreeFactory {
        device: "local-sync",
        layout: export::Layout::Shared
    });
}

mod local_task {
    conformance::conformance_suite!(conformance::iree::IreeFactory {
        device: "local-task",
        layout: export::Layout::Shared
    });
}
