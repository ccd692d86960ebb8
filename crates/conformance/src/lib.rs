//! The conformance suite: the same problems on every backend, compared by token stream and
//! per-layer K/V against the FP32 reference and against an independent no-cache recompute.
//!
//! - [`problems`]: each problem is a function of a [`BackendFactory`]; [`conformance_suite!`]
//!   expands every problem into `#[test]`s for one backend (`tests/reference.rs`, and one file per
//!   IREE device), so a backend cannot be skipped silently.
//! - [`naive`]: a plain, loop-by-loop forward with no cache, written independently of
//!   `backend-reference` (its own RoPE, its own masks); the oracle of the cached path.
//! - [`divergence`]: known divergences, as data keyed by backend with their reason.
//! - Comparisons use `kv_core::tolerance`'s asserts, shared with every crate's tests.

#[cfg(any(target_os = "linux", target_os = "android"))]
pub mod crash;
pub mod divergence;
pub mod factory;
#[cfg(feature = "iree")]
pub mod iree;
pub mod masked;
pub mod naive;
pub mod problems;

pub use factory::{BackendFactory, ReferenceFactory};

/// [`crash::report_fatal_signals`] where the platform has it (Linux, Android), else nothing.
pub fn report_fatal_signals() {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    crash::report_fatal_signals();
}

/// Every problem of [`problems`], by name: what each suite must expand.
pub const PROBLEMS: &[&str] = &[
    "prefill_equals_prefix_chunks_and_steps",
    "snapshot_trees_replay_fresh_runs",
    "cached_path_matches_naive_recompute",
    "seed_step_rule_sees_one_key_more",
    "gqa_and_llama_families_match_naive",
    "bad_input_is_refused_and_session_survives",
    "foreign_snapshot_is_refused",
    "snapshots_branch_and_outlive_later_calls",
    "redecode_matches_kv_stream",
    "redecode_refuses_prompts_without_room",
    "kv_matches_reference_call_by_call",
    "snapshot_files_continue_like_the_session",
    "seeded_sampling_matches_the_reference",
    "masked_calls_match_the_reference",
];

/// Expands every problem of [`problems`] into a `#[test]` for the factory expression `$factory`.
///
/// `conformance_suite!(FACTORY, ci: [p, ...], long: [q, ...])` splits them: the `long` ones are
/// `#[ignore]`d in CI's run, for a suite where another suite runs them on the same code path (its
/// file says which); `scripts/test-long.sh` runs them (`-- --include-ignored`), and `cargo test`
/// lists them as ignored. A generated test checks that the two lists name every problem once.
#[macro_export]
macro_rules! conformance_suite {
    ($factory:expr) => {
        $crate::conformance_suite!($factory, ci: [
            prefill_equals_prefix_chunks_and_steps,
            snapshot_trees_replay_fresh_runs,
            cached_path_matches_naive_recompute,
            seed_step_rule_sees_one_key_more,
            gqa_and_llama_families_match_naive,
            bad_input_is_refused_and_session_survives,
            foreign_snapshot_is_refused,
            snapshots_branch_and_outlive_later_calls,
            redecode_matches_kv_stream,
            redecode_refuses_prompts_without_room,
            kv_matches_reference_call_by_call,
            snapshot_files_continue_like_the_session,
            seeded_sampling_matches_the_reference,
            masked_calls_match_the_reference
        ], long: []);
    };
    ($factory:expr, ci: [$($ci:ident),* $(,)?], long: [$($long:ident),* $(,)?]) => {
        fn factory() -> impl $crate::BackendFactory {
            $factory
        }
        $(
            #[test]
            fn $ci() {
                $crate::report_fatal_signals();
                $crate::problems::$ci(&factory());
            }
        )*
        $(
            #[test]
            #[ignore = "run by scripts/test-long.sh: another suite runs it on the same path in CI"]
            fn $long() {
                $crate::report_fatal_signals();
                $crate::problems::$long(&factory());
            }
        )*
        #[test]
        fn the_suite_names_every_problem_once() {
            let mut named = vec![$(stringify!($ci),)* $(stringify!($long),)*];
            named.sort_unstable();
            let mut all = $crate::PROBLEMS.to_vec();
            all.sort_unstable();
            assert_eq!(named, all, "a problem is missing from this suite or named twice");
        }
    };
}
