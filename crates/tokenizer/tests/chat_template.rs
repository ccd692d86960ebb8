//! The two real models' chat templates (`templates/gemma3.jinja`, `templates/smollm2.jinja`,
//! their GGUF's `tokenizer.chat_template`; `goldens.rs` checks them against the files) rendered
//! with minijinja give what the hand-written formats they replace gave, and a template read from
//! a GGUF is the one used.

use gguf::{GgufFile, GgufWriter, Value, ValueType};
use tokenizer::{ChatTemplate, Message, TemplateSource, Tokenizer, GEMMA3_TEMPLATE, SMOLLM2_TEMPLATE};

const SMOLLM2_SYSTEM: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// The Gemma format as the tokenizer wrote it by hand before (the oracle): a system message
/// prefixes the first user turn, contents trimmed, `assistant` written `model`.
fn gemma_by_hand(messages: &[Message], add_generation_prompt: bool) -> String {
    let (prefix, rest) = match messages.first() {
        Some(m) if m.role == "system" => (format!("{}\n\n", m.content.trim()), &messages[1..]),
        _ => (String::new(), messages),
    };
    let mut out = String::new();
    for (i, m) in rest.iter().enumerate() {
        let role = if m.role == "assistant" { "model" } else { &m.role };
        let prefix = if i == 0 { prefix.as_str() } else { "" };
        out += &format!("<start_of_turn>{role}\n{prefix}{}<end_of_turn>\n", m.content.trim());
    }
    if add_generation_prompt {
        out += "<start_of_turn>model\n";
    }
    out
}

/// ChatML as written by hand before, with SmolLM2's default system prompt.
fn chatml_by_hand(messages: &[Message], default_system: Option<&str>, add_generation_prompt: bool) -> String {
    let mut out = String::new();
    if let (Some(sys), false) = (default_system, messages.first().is_some_and(|m| m.role == "system")) {
        out += &format!("<|im_start|>system\n{sys}<|im_end|>\n");
    }
    for m in messages {
        out += &format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content);
    }
    if add_generation_prompt {
        out += "<|im_start|>assistant\n";
    }
    out
}

fn conversations() -> Vec<Vec<Message>> {
    vec![
        vec![Message::user("Hi")],
        vec![Message::system("Be brief."), Message::user("  Hi  ")],
        vec![
            Message::user("What is 2+2?"),
            Message::assistant(" 4 "),
            Message::user("And 3+3?\n"),
        ],
        vec![
            Message::system("You answer in French."),
            Message::user("Hello"),
            Message::assistant("Bonjour"),
            Message::user("Thanks"),
        ],
        vec![Message::user("multi\nline\n\ncontent with {{ braces }} and {% tags %}")],
    ]
}

#[test]
fn gemma3_template_renders_as_the_hand_written_format() {
    let template = ChatTemplate::new(GEMMA3_TEMPLATE, TemplateSource::Builtin("gemma3"), "<bos>", "<eos>").unwrap();
    for messages in conversations() {
        for add_generation_prompt in [true, false] {
            assert_eq!(
                template.render(&messages, add_generation_prompt).unwrap(),
                format!("<bos>{}", gemma_by_hand(&messages, add_generation_prompt)),
                "{messages:?}, add_generation_prompt {add_generation_prompt}"
            );
        }
    }
    assert_eq!(template.end_of_turn(), Some("<end_of_turn>"));
}

#[test]
fn smollm2_template_renders_as_the_hand_written_format() {
    let template = ChatTemplate::new(
        SMOLLM2_TEMPLATE,
        TemplateSource::Builtin("smollm2"),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    for messages in conversations() {
        for add_generation_prompt in [true, false] {
            assert_eq!(
                template.render(&messages, add_generation_prompt).unwrap(),
                chatml_by_hand(&messages, Some(SMOLLM2_SYSTEM), add_generation_prompt),
                "{messages:?}, add_generation_prompt {add_generation_prompt}"
            );
        }
    }
    assert_eq!(template.end_of_turn(), Some("<|im_end|>"));
}

#[test]
fn gemma3_template_refuses_turns_out_of_order() {
    let template = ChatTemplate::new(GEMMA3_TEMPLATE, TemplateSource::Builtin("gemma3"), "<bos>", "<eos>").unwrap();
    for messages in [
        vec![Message::assistant("x")],
        vec![Message::user("a"), Message::user("b")],
    ] {
        let err = template.render(&messages, true).unwrap_err().to_string();
        assert!(err.contains("Conversation roles must alternate"), "{err}");
    }
}

/// A ChatML vocabulary whose file carries `template`.
fn chatml_vocabulary(template: Option<&str>) -> Tokenizer {
    let mut texts: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|t| t.to_string())
        .collect();
    let mut types = vec![Value::I32(3); texts.len()];
    for c in tokenizer::unicode::byte_to_char() {
        texts.push(c.to_string());
        types.push(Value::I32(1));
    }
    let mut w = GgufWriter::new();
    w.kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", Value::String("gpt2".into()))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, texts.into_iter().map(Value::String).collect()),
        )
        .kv("tokenizer.ggml.token_type", Value::Array(ValueType::I32, types))
        .kv("tokenizer.ggml.merges", Value::Array(ValueType::String, vec![]))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(0));
    if let Some(t) = template {
        w.kv("tokenizer.chat_template", Value::String(t.into()));
    }
    Tokenizer::from_gguf(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap()
}

#[test]
fn the_files_template_is_the_one_used() {
    let messages = [Message::user("Hi")];
    let smollm = chatml_vocabulary(Some(SMOLLM2_TEMPLATE));
    assert_eq!(smollm.chat_template().unwrap().source(), TemplateSource::File);
    assert_eq!(
        smollm.apply_chat(&messages).unwrap(),
        chatml_by_hand(&messages, Some(SMOLLM2_SYSTEM), true)
    );
    // Without one, the vocabulary's turn tokens pick plain ChatML (no default system prompt).
    let plain = chatml_vocabulary(None);
    assert_eq!(
        plain.chat_template().unwrap().source(),
        TemplateSource::Builtin("chatml")
    );
    assert_eq!(
        plain.apply_chat(&messages).unwrap(),
        chatml_by_hand(&messages, None, true)
    );
    assert_eq!(
        plain.apply_chat_with(&messages, false).unwrap(),
        chatml_by_hand(&messages, None, false)
    );
    assert_eq!(plain.eot(), plain.token_id("<|im_end|>"));

    // Any template works, Python string methods and `raise_exception` included.
    let custom = chatml_vocabulary(Some(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system: ' + m.content) }}{% endif %}\
         <|im_start|>{{ m.role.upper() }}: {{ m.content.strip() }}<|im_end|>{% endfor %}",
    ));
    assert_eq!(
        custom.apply_chat(&[Message::user("  hi  ")]).unwrap(),
        "<|im_start|>USER: hi<|im_end|>"
    );
    let err = custom.apply_chat(&[Message::system("x")]).unwrap_err().to_string();
    assert!(err.contains("no system: x"), "{err}");
}

#[test]
fn a_template_that_does_not_compile_fails_chat_only() {
    let tok = chatml_vocabulary(Some("{% for m in messages %}"));
    assert!(tok.chat_template().is_none());
    assert!(tok.encode("hi", false).len() == 2, "plain tokenizing still works");
    let err = tok.apply_chat(&[Message::user("hi")]).unwrap_err().to_string();
    assert!(err.contains("does not compile"), "{err}");
}
