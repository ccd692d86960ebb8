//! A vocabulary for the tiny fixture models (which ship none): Gemma's turn tokens and
//! template, FunctionGemma's function tokens as control tokens, byte-fallback pieces for every
//! byte and a few words, padded with unused ids to the fixture's vocabulary size. With it the
//! fixtures run the whole tool-calling path offline: catalog rendered, calls constrained,
//! decoded, parsed and validated.

use gguf::{GgufFile, GgufWriter, Value, ValueType};
use kv_core::{Error, Result};
use tokenizer::{Tokenizer, GEMMA3_TEMPLATE};

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

const CONTROLS: [&str; 12] = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_function_declaration>",
    "<end_function_declaration>",
    "<start_function_call>",
    "<end_function_call>",
    "<start_function_response>",
    "<end_function_response>",
    "<escape>",
];

/// Pieces a SentencePiece merge can reach (every prefix of a word is a piece too).
const WORDS: [&str; 8] = ["call", "user", "model", "developer", "true", "false", "set", "time"];

/// The vocabulary for a fixture of `vocab_size` ids; at least the controls, the 256 bytes and
/// the words' pieces must fit.
pub fn tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    let w = vocabulary(vocab_size)?;
    let file = GgufFile::from_bytes(w.to_bytes()).map_err(|e| Error::Constraint {
        op: "fixture vocabulary",
        reason: e.to_string(),
    })?;
    Tokenizer::from_gguf(&file).map_err(|e| Error::Constraint {
        op: "fixture vocabulary",
        reason: e.to_string(),
    })
}

/// [`tokenizer`]'s `tokenizer.*` GGUF keys: tests write them beside a fixture's weights to make
/// a whole GGUF model of it.
pub fn vocabulary(vocab_size: usize) -> Result<GgufWriter> {
    let mut tokens: Vec<(String, i32, f32)> = CONTROLS.iter().map(|t| (t.to_string(), CONTROL, 0.0)).collect();
    tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), BYTE, 0.0)));
    let mut pieces: Vec<String> = Vec::new();
    for w in WORDS {
        for end in 1..=w.len() {
            let p = w[..end].to_string();
            if !pieces.contains(&p) {
                pieces.push(p);
            }
        }
    }
    // `▁` as a piece: SentencePiece writes a space as it, and without the piece its byte
    // fallback would be the three bytes of `▁`, not a space.
    for p in ["\u{2581}", "\n", ":", "{", "}", ","] {
        pieces.push(p.to_string());
    }
    // Longer pieces score higher, so merges run to whole words.
    tokens.extend(pieces.into_iter().map(|p| {
        let score = p.len() as f32;
        (p, NORMAL, score)
    }));
    if tokens.len() > vocab_size {
        return Err(Error::Constraint {
            op: "fixture vocabulary",
            reason: format!("{} ids needed, the model has {vocab_size}", tokens.len()),
        });
    }
    let mut i = 0;
    while tokens.len() < vocab_size {
        tokens.push((format!("<unused{i}>"), UNUSED, 0.0));
        i += 1;
    }
    let texts = Value::Array(
        ValueType::String,
        tokens.iter().map(|t| Value::String(t.0.clone())).collect(),
    );
    let types = Value::Array(ValueType::I32, tokens.iter().map(|t| Value::I32(t.1)).collect());
    let scores = Value::Array(ValueType::F32, tokens.iter().map(|t| Value::F32(t.2)).collect());
    let mut w = GgufWriter::new();
    w.kv("tokenizer.ggml.model", Value::String("llama".into()))
        .kv("tokenizer.ggml.tokens", texts)
        .kv("tokenizer.ggml.token_type", types)
        .kv("tokenizer.ggml.scores", scores)
        .kv("tokenizer.ggml.bos_token_id", Value::U32(2))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.add_bos_token", Value::Bool(true))
        .kv("tokenizer.ggml.add_space_prefix", Value::Bool(false))
        .kv("tokenizer.chat_template", Value::String(GEMMA3_TEMPLATE.into()));
    Ok(w)
}
