//! `skainet-kv tokenize`: a real model's ids for a text.

use anyhow::Result;
use clap::Args;
use tokenizer::Message;

use crate::report::ids_to_string;

#[derive(Args)]
pub struct TokenizeArgs {
    /// A real model (`gemma3-270m`, `smollm2-135m`) or a GGUF file (`PATH.gguf`).
    #[arg(short = 'm', long)]
    model: String,
    /// The text. Special tokens written in it (`<start_of_turn>`, `<|im_end|>`, ...) are parsed
    /// as control tokens, as llama.cpp's CLI does, unless --chat.
    #[arg(long)]
    text: String,
    /// Wrap the text in the chat template as a user message: only the template's turn markers
    /// become control tokens; the text is plain text, special-token look-alikes included.
    #[arg(long)]
    chat: bool,
    /// Never add BOS (default: as the model's metadata says).
    #[arg(long)]
    no_bos: bool,
    /// One JSON object (`ids`, each id's `pieces`, `bos`, `stop`) instead of the ids separated by
    /// commas.
    #[arg(long)]
    json: bool,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let tok = crate::model::tokenizer(&args.model)?;
    let ids = if args.chat {
        tok.encode_chat(&[Message::user(args.text.as_str())])?
    } else {
        tok.encode(&args.text, tok.add_bos_default() && !args.no_bos)
    };
    if args.json {
        let pieces: Vec<String> = ids.iter().map(|&id| tok.decode_with(&[id], true)).collect();
        crate::outln!(
            "{}",
            serde_json::json!({ "ids": ids, "pieces": pieces, "bos": tok.bos(), "stop": tok.stop_tokens() })
        )?;
    } else {
        crate::outln!("{}", ids_to_string(&ids))?;
    }
    Ok(())
}
