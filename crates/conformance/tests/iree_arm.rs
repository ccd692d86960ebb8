//! The conformance suite on the IREE runtime cross-built for aarch64 and run under qemu-user by
//! `scripts/test-arm.sh`: the fixtures' graphs compiled for the aarch64 target triple
//! (`conformance::iree::cpu_triple`), on `local-sync` and `local-task`, compared with the FP32
//! reference as on x86. Only built for aarch64 (on x86 `iree_local_task` covers the CPU; armv7
//! has no IREE runtime here, see docs/reliability.md).
#![cfg(all(feature = "iree", target_arch = "aarch64"))]

/// The machine code's problems on both executors; the host-side checks and the sampler (pure
/// Rust, run under qemu by the reference suite too) on `local_task` only in CI, both in
/// `scripts/test-long.sh`.
mod local_sync {
    conformance::conformance_suite!(
        conformance::iree::IreeFactory {
            device: "local-sync",
            layout: export::Layout::Shared,
            contract: 1,
            cache_type: kv_core::manifest::CacheType::F32
        },
        ci: [
            prefill_equals_prefix_chunks_and_steps,
            snapshot_trees_replay_fresh_runs,
            cached_path_matches_naive_recompute,
            seed_step_rule_sees_one_key_more,
            gqa_and_llama_families_match_naive,
            snapshots_branch_and_outlive_later_calls,
            redecode_matches_kv_stream,
            kv_matches_reference_call_by_call
        ],
        long: [
            bad_input_is_refused_and_session_survives,
            foreign_snapshot_is_refused,
            redecode_refuses_prompts_without_room,
            snapshot_files_continue_like_the_session,
            seeded_sampling_matches_the_reference
        ]
    );
}

mod local_task {
    conformance::conformance_suite!(conformance::iree::IreeFactory {
        device: "local-task",
        layout: export::Layout::Shared,
        contract: 1,
        cache_type: kv_core::manifest::CacheType::F32
    });
}
