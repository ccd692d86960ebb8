//! Tokenizers built from arbitrary GGUF metadata: `Tokenizer::from_gguf` never panics, and a
//! vocabulary it accepts encodes and decodes text (ids in range) without panicking.
#![no_main]

use gguf::GgufFile;
use libfuzzer_sys::fuzz_target;
use tokenizer::{Message, Tokenizer};

const TEXTS: [&str; 4] = [
    "Hello world! It's 2024, isn't it?",
    "  spaces\tand\nnewlines  ",
    "<start_of_turn>user\nhi<end_of_turn>\n<|im_start|>ünïcödé 日本語 🙂<|im_end|>",
    "\u{2581}x<0x41>",
];

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let Ok(tok) = Tokenizer::from_gguf(&file) else {
        return;
    };
    let n = tok.vocab_size();
    for text in TEXTS {
        for parse_special in [false, true] {
            let ids = tok.encode_with(text, true, parse_special);
            assert!(
                ids.iter().all(|&id| id >= 0 && (id as usize) < n),
                "{ids:?} outside 0..{n}"
            );
            let _ = tok.decode_with(&ids, true);
            let _ = tok.decode(&ids);
        }
    }
    let _ = tok.decode(&[-1, 0, 1, n as i32, i32::MAX, i32::MIN]);
    let _ = (tok.bos(), tok.eos(), tok.eot(), tok.stop_tokens());
    let _ = tok.encode_chat(&[Message::user(TEXTS[2])]);
});
