//! Contract 2 as exported for this very CPU (`conformance::iree::IreeHostFactory`: bf16 matmul
//! inputs and f16 caches where the CPU has them, data tiling): the forms the generic-CPU suites
//! never build. CI runs the problems over the four main models' exports only (no top-k, no
//! families, no redecode: each would be more exports for this CPU alone); the rest run in
//! scripts/test-long.sh, and on the generic CPU's v2 suites in CI.
#![cfg(feature = "iree")]
conformance::conformance_suite!(
    conformance::iree::IreeHostFactory,
    ci: [
        prefill_equals_prefix_chunks_and_steps,
        snapshot_trees_replay_fresh_runs,
        cached_path_matches_naive_recompute,
        kv_matches_reference_call_by_call,
        snapshots_branch_and_outlive_later_calls,
        bad_input_is_refused_and_session_survives
    ],
    long: [
        seed_step_rule_sees_one_key_more,
        gqa_and_llama_families_match_naive,
        foreign_snapshot_is_refused,
        redecode_matches_kv_stream,
        redecode_refuses_prompts_without_room,
        snapshot_files_continue_like_the_session,
        seeded_sampling_matches_the_reference,
        masked_calls_match_the_reference
    ]
);
