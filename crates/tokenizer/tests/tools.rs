//! Tools through the chat templates on small synthetic vocabularies (no download): the family's
//! tool template where the file's has no tool syntax, calls and results in a conversation, and
//! the prefix cut that a snapshot of the catalog is made of.

use gguf::{GgufFile, GgufWriter, Value, ValueType};
use tokenizer::tools::{parse_catalog, ToolCall};
use tokenizer::{Error, Message, Tokenizer, ToolFormat, CHATML_TEMPLATE, GEMMA3_TEMPLATE, SMOLLM2_TEMPLATE};

const CONTROL: i32 = 3;
const BYTE: i32 = 6;
const NORMAL: i32 = 1;

fn strings(v: &[String]) -> Value {
    Value::Array(ValueType::String, v.iter().cloned().map(Value::String).collect())
}

fn vocabulary(model: &str, tokens: Vec<(String, i32)>, extra: &[(&str, Value)]) -> Tokenizer {
    let mut w = GgufWriter::new();
    let (texts, types): (Vec<String>, Vec<i32>) = tokens.into_iter().unzip();
    w.kv("tokenizer.ggml.model", Value::String(model.into()))
        .kv("tokenizer.ggml.tokens", strings(&texts))
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        );
    for (k, v) in extra {
        w.kv(*k, v.clone());
    }
    Tokenizer::from_gguf(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap()
}

/// Gemma 3 270M's situation: Gemma's turn tokens and its template (`{{ bos_token }}` first), a BOS
/// the tokenizer adds, no function-call tokens.
fn gemma_like() -> Tokenizer {
    let mut tokens: Vec<(String, i32)> = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
        .iter()
        .map(|t| (t.to_string(), CONTROL))
        .collect();
    tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), BYTE)));
    tokens.extend(
        ["user", "model", "developer", "\n"]
            .iter()
            .map(|t| (t.to_string(), NORMAL)),
    );
    vocabulary(
        "llama",
        tokens,
        &[
            ("tokenizer.ggml.bos_token_id", Value::U32(2)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
            ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
            ("tokenizer.chat_template", Value::String(GEMMA3_TEMPLATE.into())),
        ],
    )
}

/// SmolLM2's situation: ChatML, its template with a default system turn, BOS = `<|im_start|>`.
fn smollm2_like() -> Tokenizer {
    chatml_with(SMOLLM2_TEMPLATE)
}

fn chatml_with(template: &str) -> Tokenizer {
    let mut tokens: Vec<(String, i32)> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|t| (t.to_string(), CONTROL))
        .collect();
    tokens.extend(
        tokenizer::unicode::byte_to_char()
            .iter()
            .map(|c| (c.to_string(), NORMAL)),
    );
    vocabulary(
        "gpt2",
        tokens,
        &[
            ("tokenizer.ggml.pre", Value::String("gpt2".into())),
            ("tokenizer.ggml.merges", strings(&[])),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
            ("tokenizer.chat_template", Value::String(template.into())),
        ],
    )
}

const CATALOG: &str = r#"[{"type": "function", "function": {"name": "set_timer", "description": "Start a timer.",
  "parameters": {"type": "object", "properties": {"seconds": {"type": "integer"}, "label": {"type": "string"}},
  "required": ["seconds"]}}}]"#;

fn timer_call() -> ToolCall {
    ToolCall {
        name: "set_timer".into(),
        arguments: serde_json::json!({"seconds": 600, "label": "pasta"})
            .as_object()
            .unwrap()
            .clone(),
    }
}

/// The text of `ids`, control tokens rendered; the synthetic SentencePiece vocabulary has no `▁`.
fn shown(tok: &Tokenizer, ids: &[i32]) -> String {
    tok.decode_with(ids, true).replace('\u{2581}', " ")
}

#[test]
fn gemma_family_gets_functiongemma_declarations_calls_and_responses() {
    let tok = gemma_like();
    assert_eq!(tok.tool_format(), Some(ToolFormat::FunctionGemma));
    let tools = parse_catalog(CATALOG).unwrap();
    let messages = [
        Message::system("Be brief."),
        Message::user("Ten minutes for the pasta"),
        Message::assistant_calls("", vec![timer_call()]),
        Message::tool("set_timer", r#"{"ok": true}"#),
        Message::assistant("Timer set."),
        Message::user("Thanks"),
    ];
    let text = shown(&tok, &tok.encode_chat_with_tools(&messages, &tools).unwrap());
    assert_eq!(
        text,
        "<bos><start_of_turn>developer\nBe brief.<start_function_declaration>declaration:set_timer{description:<escape>Start a timer.<escape>,\
         parameters:{properties:{label:{type:<escape>STRING<escape>},seconds:{type:<escape>INTEGER<escape>}},\
         required:[<escape>seconds<escape>],type:<escape>OBJECT<escape>}}<end_function_declaration><end_of_turn>\n\
         <start_of_turn>user\nTen minutes for the pasta<end_of_turn>\n\
         <start_of_turn>model\n<start_function_call>call:set_timer{label:<escape>pasta<escape>,seconds:600}<end_function_call>\
         <start_function_response>response:set_timer{ok:true}<end_function_response>Timer set.<end_of_turn>\n\
         <start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n"
    );
    // Without tools the file's own template renders, as before.
    let plain = tok.decode_with(&tok.encode_chat(&[Message::user("hi")]).unwrap(), true);
    assert_eq!(
        plain,
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    );
}

#[test]
fn chatml_family_gets_hermes_tool_calls_and_responses() {
    let tok = chatml_with(CHATML_TEMPLATE);
    assert_eq!(tok.tool_format(), Some(ToolFormat::Hermes));
    let tools = parse_catalog(CATALOG).unwrap();
    let messages = [
        Message::user("Ten minutes"),
        Message::assistant_calls("", vec![timer_call()]),
        Message::tool("set_timer", "done"),
    ];
    let text = tok.decode_with(&tok.encode_chat_with_tools(&messages, &tools).unwrap(), true);
    assert!(
        text.starts_with("<|im_start|>system\n# Tools\n\nYou may call one or more functions"),
        "{text}"
    );
    assert!(
        text.contains("<tools>\n{\"function\": {\"description\": \"Start a timer.\", \"name\": \"set_timer\""),
        "{text}"
    );
    assert!(
        text.ends_with(
            "<|im_start|>user\nTen minutes<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"set_timer\", \
             \"arguments\": {\"label\": \"pasta\", \"seconds\": 600}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        ),
        "{text}"
    );
}

/// SmolLM2-Instruct gets its model card's prompt and writes calls as a list.
#[test]
fn smollm2_gets_its_own_list_of_calls_format() {
    let tok = smollm2_like();
    let tools = parse_catalog(CATALOG).unwrap();
    let messages = [
        Message::user("Ten minutes"),
        Message::assistant_calls("", vec![timer_call()]),
    ];
    let text = tok.decode_with(&tok.encode_chat_with_tools(&messages, &tools).unwrap(), true);
    assert!(
        text.starts_with("<|im_start|>system\nYou are an expert in composing functions."),
        "{text}"
    );
    assert!(
        text.contains("<tools>[{\"function\": {\"description\": \"Start a timer.\""),
        "{text}"
    );
    let call =
        "<tool_call>[{\"name\": \"set_timer\", \"arguments\": {\"label\": \"pasta\", \"seconds\": 600}}]</tool_call>";
    assert!(
        text.ends_with(&format!(
            "<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>assistant\n"
        )),
        "{text}"
    );
    assert_eq!(ToolFormat::Hermes.parse(call).calls, vec![Ok(timer_call())]);
    // Without tools, its own template: the default system turn.
    let plain = tok.decode_with(&tok.encode_chat(&[Message::user("hi")]).unwrap(), true);
    assert!(
        plain.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"),
        "{plain}"
    );
}

/// The bug the split fixes: a request after a prefix was the whole rendered conversation, so
/// SmolLM2's default system turn was written again and Gemma's BOS landed mid-sequence.
#[test]
fn the_request_after_a_prefix_has_no_second_system_turn_and_no_bos() {
    let tok = smollm2_like();
    let split = tok.split_chat(&[Message::user("hi")], &[]).unwrap();
    let request = tok.decode_with(&split.request, true);
    assert_eq!(request, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    assert!(tok
        .decode_with(&split.prefix, true)
        .starts_with("<|im_start|>system\nYou are a helpful AI assistant"));

    let tok = gemma_like();
    let split = tok.split_chat(&[Message::user("hi")], &[]).unwrap();
    assert_eq!(split.prefix, vec![2], "the prefix is the BOS alone");
    assert!(
        !split.request.contains(&2),
        "no BOS in the request: {:?}",
        split.request
    );
    // Gemma 3 writes the system text inside the first user turn: the cut is at the user's words.
    let split = tok
        .split_chat(&[Message::system("Be brief."), Message::user("hi")], &[])
        .unwrap();
    assert_eq!(shown(&tok, &split.prefix), "<bos><start_of_turn>user\nBe brief.\n\n");
    assert_eq!(
        tok.decode_with(&split.request, true),
        "hi<end_of_turn>\n<start_of_turn>model\n"
    );
}

#[test]
fn the_prefix_is_the_system_turn_with_the_catalog_whatever_the_request() {
    let tools = parse_catalog(CATALOG).unwrap();
    for tok in [gemma_like(), smollm2_like()] {
        let a = tok
            .split_chat(&[Message::system("S"), Message::user("alpha")], &tools)
            .unwrap();
        let b = tok
            .split_chat(
                &[
                    Message::system("S"),
                    Message::user("two"),
                    Message::assistant("x"),
                    Message::user("y"),
                ],
                &tools,
            )
            .unwrap();
        assert_eq!(a.prefix, b.prefix);
        let prefix = tok.decode_with(&a.prefix, true);
        assert!(prefix.contains("set_timer") && !prefix.contains("alpha"), "{prefix}");
        let request = tok.decode_with(&a.request, true);
        assert!(
            request.starts_with("<start_of_turn>user\nalpha") || request.starts_with("<|im_start|>user\nalpha"),
            "{request}"
        );
        let digest = tok.prefix_digest(Some("S"), &tools).unwrap();
        assert_eq!(digest, tok.prefix_digest(Some("S"), &tools).unwrap());
        assert_ne!(digest, tok.prefix_digest(Some("T"), &tools).unwrap());
        assert_ne!(digest, tok.prefix_digest(Some("S"), &[]).unwrap());
    }
}

#[test]
fn a_conversation_without_a_request_does_not_split() {
    let tok = smollm2_like();
    assert!(matches!(
        tok.split_chat(&[Message::system("S")], &[]),
        Err(Error::PromptSplit(_))
    ));
}
