//! The conformance suite on IREE's `vulkan` device with the seed's layout: three modules, three
//! archives, three sessions on one device (lavapipe in CI). Until each device had one HAL group
//! shared by its sessions, the second session failed ("Vulkan queue frontier already assigned").
//! `prefill` runs as chunk calls from an empty cache here (`IreeFactory`: the shared layout's
//! suites run the prefill graph).
//!
//! In CI this suite runs the problems whose path depends on this layout with contract 1's graphs:
//! snapshots taken in one session and restored, branched and outliving calls in the others, the
//! redecode module beside the KV ones, and every call compared with the reference. The rest are
//! `scripts/test-long.sh`'s here because two other lavapipe suites run each of them in CI on the
//! same path but one axis: `iree_vulkan.rs` (contract 1's graphs on this device) and
//! `iree_vulkan_v2.rs` (this three-module layout on this device), and `iree_local_task_three.rs`
//! runs them all in this layout on the CPU. Host-side checks (arguments, snapshot headers and
//! files, the sampler, the window rule) are long here too. Moving the four layout-independent
//! device problems out cut this suite's CI share by about half (CI time, issue 34).
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "vulkan",
        layout: export::Layout::Three,
        contract: kv_core::ContractVersion::V1,
        cache_type: kv_core::manifest::CacheType::F32
    },
    ci: [
        snapshots_branch_and_outlive_later_calls,
        redecode_matches_kv_stream,
        kv_matches_reference_call_by_call
    ],
    long: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        gqa_and_llama_families_match_naive,
        seed_step_rule_sees_one_key_more,
        bad_input_is_refused_and_session_survives,
        foreign_snapshot_is_refused,
        redecode_refuses_prompts_without_room,
        snapshot_files_continue_like_the_session,
        seeded_sampling_matches_the_reference,
        masked_calls_match_the_reference
    ]
);
