//! The conformance suite on IREE's `vulkan` device with the seed's layout: three modules, three
//! archives, three sessions on one device (lavapipe in CI). Until each device had one HAL group
//! shared by its sessions, the second session failed ("Vulkan queue frontier already assigned").
//! `prefill` runs as chunk calls from an empty cache here (`IreeFactory`: the shared layout's
//! suites run the prefill graph).
//!
//! In CI this suite runs the problems whose path depends on the layout: calls across the three
//! modules and sessions, snapshots and restores between them, every family's graphs. The others
//! check host-side code that is the same in every layout (argument checks, snapshot headers and
//! files, the sampler over the top-k outputs, the window rule): `iree_vulkan.rs` runs them on this
//! device and `iree_local_task_three.rs` in this layout, so here they are `scripts/test-long.sh`'s
//! (on lavapipe they cost ~5 of this suite's ~8 minutes, a top-k export included).
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "vulkan",
        layout: export::Layout::Three,
        contract: 1,
        cache_type: kv_core::manifest::CacheType::F32
    },
    ci: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        gqa_and_llama_families_match_naive,
        snapshots_branch_and_outlive_later_calls,
        redecode_matches_kv_stream,
        kv_matches_reference_call_by_call
    ],
    long: [
        seed_step_rule_sees_one_key_more,
        bad_input_is_refused_and_session_survives,
        foreign_snapshot_is_refused,
        redecode_refuses_prompts_without_room,
        snapshot_files_continue_like_the_session,
        seeded_sampling_matches_the_reference,
        masked_calls_match_the_reference
    ]
);
