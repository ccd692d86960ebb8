//! The two real vocabularies (Gemma 3's SentencePiece, SmolLM2's byte-level BPE; installed once
//! into `.cache/models` by `model_store::ensure`) on arbitrary text: encoding never panics, ids
//! are in range, and decoding gives the text back (control tokens rendered), as llama.cpp does,
//! whenever the vocabulary can spell every byte of it (SmolLM2's byte-level alphabet lacks a few
//! control bytes, e.g. 0x13, which llama.cpp drops too).
//!
//! Input: the first byte picks the vocabulary (bit 0), `parse_special` (bit 1) and whether the
//! text is also encoded as a user turn of the chat template (bit 2); the rest is the text (invalid
//! UTF-8 replaced).
#![no_main]

use std::sync::OnceLock;

use gguf::GgufFile;
use libfuzzer_sys::fuzz_target;
use tokenizer::{Kind, Message, Tokenizer};

struct Vocab {
    tok: Tokenizer,
    /// For byte-level BPE: which bytes the vocabulary spells (GPT-2's byte → char is a token).
    spelled: [bool; 256],
}

fn vocabularies() -> &'static [Vocab; 2] {
    static VOCABS: OnceLock<[Vocab; 2]> = OnceLock::new();
    VOCABS.get_or_init(|| {
        ["gemma3-270m", "smollm2-135m"].map(|name| {
            let path = model_store::ensure(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            let tok = Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
            let chars = tokenizer::unicode::byte_to_char();
            let spelled = std::array::from_fn(|b| tok.token_id(&chars[b].to_string()).is_some());
            Vocab { tok, spelled }
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, text)) = data.split_first() else {
        return;
    };
    let Vocab { tok, spelled } = &vocabularies()[usize::from(flags & 1)];
    let parse_special = flags & 2 != 0;
    let text = String::from_utf8_lossy(text);
    let n = tok.vocab_size();
    let ids = tok.encode_with(&text, false, parse_special);
    assert!(
        ids.iter().all(|&id| id >= 0 && (id as usize) < n),
        "{ids:?} outside 0..{n}"
    );
    let back = tok.decode_with(&ids, true);
    // SentencePiece spells spaces as U+2581, so a literal U+2581 comes back as a space.
    let expected = match tok.kind() {
        Kind::Spm => Some(text.replace('\u{2581}', " ")),
        Kind::Bpe(_) => text.bytes().all(|b| spelled[usize::from(b)]).then(|| text.to_string()),
    };
    if let Some(expected) = expected {
        assert_eq!(
            back, expected,
            "round trip (parse_special {parse_special}) gave {ids:?}"
        );
    }
    if flags & 4 != 0 {
        if let Ok(ids) = tok.encode_chat(&[Message::user(text.to_string())]) {
            assert!(
                ids.iter().all(|&id| id >= 0 && (id as usize) < n),
                "{ids:?} outside 0..{n}"
            );
        }
    }
});
