//! The conformance suite on IREE's `vulkan` device (lavapipe in CI) with contract v2 graphs in
//! the seed's three-module layout (here: a chunk and a step module, each with its archive).
//!
//! In CI it runs the problems that reach the device; those of host-side checks alone (arguments
//! refused before any call, another model's snapshot, the seed's window rule that contract 2 does
//! not run) are `scripts/test-long.sh`'s here: `iree_local_task_v2.rs` runs them on the same
//! contract 2 host code and `iree_vulkan.rs` on this device.
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "vulkan",
        layout: export::Layout::Three,
        contract: kv_core::ContractVersion::V2,
        cache_type: kv_core::manifest::CacheType::F32
    },
    ci: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        gqa_and_llama_families_match_naive,
        snapshots_branch_and_outlive_later_calls,
        redecode_matches_kv_stream,
        kv_matches_reference_call_by_call,
        snapshot_files_continue_like_the_session,
        seeded_sampling_matches_the_reference,
        masked_calls_match_the_reference
    ],
    long: [
        seed_step_rule_sees_one_key_more,
        bad_input_is_refused_and_session_survives,
        foreign_snapshot_is_refused,
        redecode_refuses_prompts_without_room
    ]
);
