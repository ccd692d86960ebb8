//! The conformance suite on IREE's `local-task` CPU device, one module and archive for all graphs.
//!
//! In CI every problem but the families one, whose Qwen fixtures are two exports of this
//! suite's own (~25 s on 2 cores): `iree_local_task_v2.rs` and `iree_vulkan_v2.rs` run it on
//! contract 2 (the families differ in the layers' projections and norms, which both contracts
//! share), `scripts/test-long.sh` here.
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "local-task",
        layout: export::Layout::Shared,
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
