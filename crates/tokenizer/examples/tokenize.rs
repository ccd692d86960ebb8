//! `cargo run -p tokenizer --example tokenize -- <gemma3-270m|smollm2-135m|file.gguf> [text...]`:
//! prints the ids of each text argument (one per line on stdin when none), as JSON lines.

use std::io::BufRead;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args.next().ok_or("usage: tokenize <model|file.gguf> [text...]")?;
    let path = if model.ends_with(".gguf") {
        model.into()
    } else {
        model_store::ensure(&model)?
    };
    let file = gguf::GgufFile::open(&path)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let texts: Vec<String> = args.collect();
    let texts = if texts.is_empty() {
        // One JSON string per line.
        std::io::stdin()
            .lock()
            .lines()
            .map(|l| l.map(|l| serde_json_unescape(&l)))
            .collect::<Result<_, _>>()?
    } else {
        texts
    };
    for t in texts {
        let ids = tok.encode(&t, false);
        println!("{ids:?}");
    }
    Ok(())
}

/// Lines are plain text with `\n` and `\\` escapes.
fn serde_json_unescape(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(o) => out.push(o),
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}
