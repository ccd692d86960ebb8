//! The conformance suite on `local-task` with the seed's layout: three modules, three archives
//! with their own key numbering, three sessions on one device.
//! `prefill` runs as chunk calls from an empty cache here (`IreeFactory`: the shared layout's
//! suites run the prefill graph).
//!
//! In CI every problem but the families one: the layout is the same code for every family, and
//! its four models are four more three-module exports, about 40% of this suite's CI time (issue
//! 34); `iree_local_task.rs` runs it with contract 1's graphs on this device.
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "local-task",
        layout: export::Layout::Three,
        contract: kv_core::ContractVersion::V1,
        cache_type: kv_core::manifest::CacheType::F32
    },
    ci: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        seed_step_rule_sees_one_key_more,
        bad_input_is_refused_and_session_survives,
        foreign_snapshot_is_refused,
        snapshots_branch_and_outlive_later_calls,
        redecode_matches_kv_stream,
        redecode_refuses_prompts_without_room,
        kv_matches_reference_call_by_call,
        snapshot_files_continue_like_the_session,
        seeded_sampling_matches_the_reference,
        masked_calls_match_the_reference
    ],
    long: [gqa_and_llama_families_match_naive]
);
