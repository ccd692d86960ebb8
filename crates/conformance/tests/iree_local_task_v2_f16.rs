//! The conformance suite on IREE's `local-task` CPU device with contract v2 graphs over f16
//! caches (`cacheType`, what `--cpu host` exports keep on CPUs with F16C; `docs/contract-v2.md`),
//! against a reference that rounds the same K/V rows.
//!
//! In CI it runs the problems whose numbers the f16 caches change; the host-side checks and the
//! redecode graphs (contract 1's export, the same as `iree_local_task.rs`'s) are
//! `scripts/test-long.sh`'s here: `iree_local_task_v2.rs` runs them on the same host code. So is
//! the families problem: the cache's element type is the same code for every family, and its
//! four models are four more exports (their cost is the suite's in CI; issue 34).
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeFactory {
        device: "local-task",
        layout: export::Layout::Shared,
        contract: kv_core::ContractVersion::V2,
        cache_type: kv_core::manifest::CacheType::F16
    },
    ci: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        snapshots_branch_and_outlive_later_calls,
        kv_matches_reference_call_by_call,
        snapshot_files_continue_like_the_session,
        seeded_sampling_matches_the_reference
    ],
    long: [
        gqa_and_llama_families_match_naive,
        seed_step_rule_sees_one_key_more,
        bad_input_is_refused_and_session_survives,
        foreign_snapshot_is_refused,
        redecode_refuses_prompts_without_room,
        redecode_matches_kv_stream,
        masked_calls_match_the_reference
    ]
);
