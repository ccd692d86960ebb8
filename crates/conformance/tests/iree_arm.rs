//! The conformance suite on the IREE runtime cross-built for aarch64 and run under qemu-user by
//! `scripts/test-arm.sh`: the fixtures' graphs compiled for the aarch64 target triple
//! (`conformance::iree::cpu_triple`), on `local-sync` and `local-task`, compared with the FP32
//! reference as on x86. Only built for aarch64 (on x86 `iree_local_task` covers the CPU; armv7
//! has no IREE runtime here, see docs/reliability.md).
#![cfg(all(feature = "iree", target_arch = "aarch64"))]

/// The machine code's problems on `local_sync` (but the families one: four more aarch64
/// exports and minutes of qemu for forms the x86 suites check); on `local_task` in CI only
/// those where the executor's threads meet the session's buffers (calls compared with the
/// reference, snapshots outliving later calls); the host-side checks and the sampler (pure
/// Rust: the x86 suites and armv7's reference tests run them) and the rest on both in
/// `scripts/test-long.sh`. Each problem costs minutes under qemu (CI time, issue 34).
mod local_sync {
    conformance::conformance_suite!(
        conformance::iree::IreeFactory {
            device: "local-sync",
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
            kv_matches_reference_call_by_call
        ],
        long: [
            gqa_and_llama_families_match_naive,
            bad_input_is_refused_and_session_survives,
            foreign_snapshot_is_refused,
            redecode_refuses_prompts_without_room,
            snapshot_files_continue_like_the_session,
            seeded_sampling_matches_the_reference,
            masked_calls_match_the_reference
        ]
    );
}

mod local_task {
    conformance::conformance_suite!(
        conformance::iree::IreeFactory {
            device: "local-task",
            layout: export::Layout::Shared,
            contract: kv_core::ContractVersion::V1,
            cache_type: kv_core::manifest::CacheType::F32
        },
        ci: [
            kv_matches_reference_call_by_call,
            snapshots_branch_and_outlive_later_calls,
            bad_input_is_refused_and_session_survives
        ],
        long: [
            prefill_equals_prefix_chunks_and_steps,
            snapshot_trees_replay_fresh_runs,
            cached_path_matches_naive_recompute,
            seed_step_rule_sees_one_key_more,
            gqa_and_llama_families_match_naive,
            redecode_matches_kv_stream,
            foreign_snapshot_is_refused,
            redecode_refuses_prompts_without_room,
            snapshot_files_continue_like_the_session,
            seeded_sampling_matches_the_reference,
            masked_calls_match_the_reference
        ]
    );
}

/// The NEON q4 kernel (`export::kernels::KernelIsa::Aarch64Neon`, issue 32): a q4 export of
/// Llama's grouped heads for the `android-arm64-v9` preset calls it for its one-row products, and its
/// tokens are the reference's, token for token, with every layer's K/V within the cross-backend
/// tolerance (the reference reads the same quantized archive and dequantizes on the host).
mod q4_kernel {
    use backend_iree::{IreeKvBackend, IreeOptions};
    use backend_reference::{ReferenceKv, ReferenceModel};
    use kv_core::diverge::{lockstep, LockstepOptions};
    use kv_core::manifest::Rounding;
    use kv_core::quant::QuantFormat;
    use kv_core::WindowRule;

    #[test]
    fn neon_q4_kernel_matches_the_reference_token_for_token() {
        let fixture = fixtures::materialize("tiny-llama:3").unwrap();
        let quantized = tempfile::tempdir().unwrap();
        kv_core::quant::quantize_dir(&fixture, quantized.path(), QuantFormat::Q4).unwrap();
        let out = tempfile::tempdir().unwrap();
        // The widest Android preset (Armv9-A features; qemu's default CPU has them all): its
        // triple chooses the kernel, and its modules run here. CPU-only quantized exports
        // declare the values as they are stored (what `export --weights q4` does).
        let mut options = export::ExportOptions {
            graphs: kv_core::Graph::KV.to_vec(),
            weights: export::WeightFormat::Bf16,
            ..export::ExportOptions::default()
        };
        export::presets::apply(&[export::presets::preset("android-arm64-v9").unwrap()], &mut options).unwrap();
        let source = export::Source::Dir(quantized.path().to_path_buf());
        let manifest = export::export_artifacts(&source, out.path(), &options).unwrap();
        let calls: usize = std::fs::read_dir(out.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "mlir"))
            .map(|p| {
                std::fs::read_to_string(p)
                    .unwrap()
                    .matches("flow.dispatch @q4_matvec_")
                    .count()
            })
            .sum();
        assert!(calls > 0, "no q4 kernel call in the aarch64 q4 export");
        assert!(out.path().join("q4_matvec_aarch64.o").is_file());

        let reference = ReferenceModel::open_with_rounding(out.path(), Some(Rounding::of(&manifest))).unwrap();
        for device in ["local-sync", "local-task"] {
            let mut reference = ReferenceKv::new(reference.clone(), WindowRule::Exact);
            let mut iree = IreeKvBackend::open(out.path(), IreeOptions::new(device)).unwrap();
            let report = lockstep(
                &mut reference,
                &mut iree,
                &[1, 5, 9, 2, 7, 3, 11],
                &LockstepOptions::new(24),
            )
            .unwrap();
            assert_eq!(report.failures(true), Vec::<String>::new(), "{device}");
            assert_eq!(report.divergent_steps, 0, "{device}: not token for token");
        }
    }
}
