//! CI smoke test on a real model: Gemma 3 270M (installed from PyPI, imported, exported for the
//! CPU once and cached) answers the same greedy ids on the FP32 reference and on IREE's CPU.

use std::process::Command;

fn skainet(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(args)
        .output()
        .expect("run skainet-kv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

const PROMPT: &str = "The capital of France is";

fn generate(backend: &str) -> (Vec<i32>, String) {
    let v = skainet(&[
        "generate",
        "--model",
        "gemma3-270m",
        "--backend",
        backend,
        "--prompt",
        PROMPT,
        "--max-new",
        "4",
        "--json",
    ]);
    (
        serde_json::from_value(v["ids"].clone()).unwrap(),
        v["text"].as_str().unwrap_or_default().to_string(),
    )
}

#[test]
fn gemma3_270m_reference_and_iree_cpu_agree() {
    let (ref_ids, ref_text) = generate("reference");
    assert_eq!(ref_ids.len(), 4, "{ref_ids:?}");
    assert!(!ref_text.trim().is_empty(), "empty text for {ref_ids:?}");

    #[cfg(feature = "iree")]
    {
        let (cpu_ids, cpu_text) = generate("iree-cpu");
        if cpu_ids != ref_ids {
            // Allowed only where the reference itself nearly ties.
            let report = skainet(&[
                "diverge",
                "--model",
                "gemma3-270m",
                "--backends",
                "reference,iree-cpu",
                "--prompt",
                PROMPT,
                "--max-new",
                "4",
                "--json",
            ]);
            assert_eq!(
                report["divergence_at_near_tie"],
                serde_json::Value::Bool(true),
                "iree-cpu {cpu_ids:?} vs reference {ref_ids:?}: {report}"
            );
        } else {
            assert_eq!(cpu_text, ref_text);
        }
    }
}
