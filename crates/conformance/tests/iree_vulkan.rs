//! The conformance suite on IREE's `vulkan` device (lavapipe in CI, a GPU where there is one).
//!
//! In CI it runs the problems that reach the device with contract 1's graphs (calls, prefill,
//! the seed's window rule, snapshots held, branched, replayed and written to files). The
//! families' forms (four exports, ~60 s on lavapipe) are long-only here: CI runs them on this
//! device with the default contract (`iree_vulkan_v2.rs`) and with contract 1 on the CPU
//! (session 26, CI time). The host-side ones are `scripts/test-long.sh`'s here: arguments
//! refused before any call and the context-overflow walk (about 40% of this suite's time on lavapipe: every chunk
//! call up to maxPositions), another model's snapshot, redecode's room check, the sampler, and
//! the mask (contract 1 has none, so the check is the refusal); `iree_local_task.rs` runs them
//! with the same graphs and host code on the CPU (CI time, issue 34).
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "vulkan",
        layout: export::Layout::Shared,
        contract: kv_core::ContractVersion::V1,
        cache_type: kv_core::manifest::CacheType::F32
    },
    ci: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        seed_step_rule_sees_one_key_more,
        snapshots_branch_and_outlive_later_calls,
        redecode_matches_kv_stream,
        kv_matches_reference_call_by_call,
        snapshot_files_continue_like_the_session
    ],
    long: [
        bad_input_is_refused_and_session_survives,
        foreign_snapshot_is_refused,
        redecode_refuses_prompts_without_room,
        seeded_sampling_matches_the_reference,
        masked_calls_match_the_reference,
        gqa_and_llama_families_match_naive
    ]
);
