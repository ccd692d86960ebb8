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
            // Allowed only where, at EVERY step of a teacher-forced run, IREE's token sits less
            // than the near-tie threshold below the reference's top logit; `diverge` exits
            // non-zero otherwise (and on K/V out of tolerance, except where this CPU's export
            // rounds matmul inputs or caches, which the FP32 reference does not).
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
            assert!(report["first_not_near_tie"].is_null(), "{report}");
        } else {
            assert_eq!(cpu_text, ref_text);
        }
    }
}

/// The app's scenario on SmolLM2-135M-Instruct, on the demo's default backend for real models
/// (IREE CPU, exported for this CPU once): the prefix is the system turn with the shipped
/// catalog's declarations, the fed ids are exactly what each conversation adds after it, each
/// answer is its ids' text (parsed into calls where it holds any), and the streamed table output
/// prints the same answers. Needs the model from PyPI like the test
/// above: without network it fails, saying so, rather than passing.
#[test]
fn demo_answers_three_requests_over_a_snapshotted_tool_catalog() {
    const MAX_NEW: usize = 24;
    let max_new = MAX_NEW.to_string();
    let args = ["demo", "--model", "smollm2-135m", "--max-new", &max_new];
    let v = skainet(&[&args[..], &["--json"]].concat());
    #[cfg(feature = "iree")]
    assert!(v["backend"].as_str().unwrap().contains("local-task"), "{v}");

    let store = model_store::Store::from_env().unwrap();
    let gguf = store.ensure("smollm2-135m", &model_store::Silent).unwrap();
    let tok = tokenizer::Tokenizer::from_gguf(&gguf::GgufFile::open(&gguf).unwrap()).unwrap();
    let system = v["system_prompt"].as_str().unwrap();
    let tools: Vec<String> = serde_json::from_value(v["tools"].clone()).unwrap();
    assert_eq!(tools.len(), 7, "{v}");
    let catalog = tokenizer::tools::parse_catalog(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/tools/phone-assistant.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let prefix_tokens = v["prefix_tokens"].as_u64().unwrap() as usize;
    assert!(v["snapshot_ms"].as_f64().is_some(), "{v}");

    let utterances = v["utterances"].as_array().unwrap();
    assert_eq!(utterances.len(), 3);
    let mut prefixes = Vec::new();
    let mut answers = Vec::new();
    for u in utterances {
        let request = u["request"].as_str().unwrap();
        let input: Vec<i32> = serde_json::from_value(u["input"].clone()).unwrap();
        let ids: Vec<i32> = serde_json::from_value(u["ids"].clone()).unwrap();
        let split = tok
            .split_chat(
                &[tokenizer::Message::system(system), tokenizer::Message::user(request)],
                &catalog,
            )
            .unwrap();
        assert_eq!(split.prefix.len(), prefix_tokens, "{request}: prefix");
        assert_eq!(split.request, input, "{request}: fed ids");
        assert!(u["tool_calls"].is_array(), "{request}: {u}");
        prefixes.push(split.prefix);

        assert!(!ids.is_empty(), "{request}: no answer");
        // A closed call also ends the answer.
        assert!(
            u["stopped_at_eos"] == serde_json::Value::Bool(true) || ids.len() == MAX_NEW || u["call_ms"].is_number(),
            "{request}: {u}"
        );
        let text = u["text"].as_str().unwrap();
        assert_eq!(text, tok.decode(&ids), "{request}");
        assert!(
            u["first_token_ms"].as_f64().unwrap() <= u["total_ms"].as_f64().unwrap(),
            "{u}"
        );
        answers.push((request.to_string(), text.to_string()));
    }
    assert!(
        prefixes.iter().all(|p| *p == prefixes[0]),
        "the requests share one prefix"
    );
    assert!(
        tok.decode_with(&prefixes[0], true).contains("set_timer"),
        "the catalog is in the prefix"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(args)
        .output()
        .expect("run skainet-kv");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for (request, text) in &answers {
        assert!(
            stdout.contains(&format!("user> {request}\nassistant> {text}\n")),
            "{request}: {text:?} not streamed in:\n{stdout}"
        );
    }
    for stage in ["prefix prefill", "snapshot", "restore ms", "first token ms", "total ms"] {
        assert!(stdout.contains(stage), "no {stage} in:\n{stdout}");
    }
}
