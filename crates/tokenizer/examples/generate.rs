//! `cargo run -p tokenizer --example generate -- <gemma3-270m|smollm2-135m> <n> [--chat] <prompt>`:
//! greedy decoding with the FP32 reference on the cached imported artifacts (bf16 weights).

use backend_reference::{argmax_lowest, full_forward_logits, ReferenceModel};
use tokenizer::{Message, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, n, rest @ ..] = &args[..] else {
        return Err("usage: generate <model> <n> [--chat] <prompt>".into());
    };
    let (chat, prompt) = match rest {
        [flag, p] if flag == "--chat" => (true, p),
        [p] => (false, p),
        _ => return Err("usage: generate <model> <n> [--chat] <prompt>".into()),
    };
    let path = model_store::ensure(name)?;
    let tok = Tokenizer::from_gguf(&gguf::GgufFile::open(&path)?)?;
    let mut ids = if chat {
        tok.encode_chat(&[Message::user(prompt.as_str())])?
    } else {
        tok.encode(prompt, tok.add_bos_default())
    };
    println!("prompt ids {ids:?}");
    let dir = model_store::ensure_artifacts(name, gguf::ImportOptions::default())?;
    let model = ReferenceModel::open(&dir)?;
    let start = ids.len();
    let t0 = std::time::Instant::now();
    for _ in 0..n.parse::<usize>()? {
        let logits = full_forward_logits(&model, &ids)?;
        let next = argmax_lowest(&logits.row(ids.len() - 1).to_vec()) as i32;
        ids.push(next);
        if tok.stop_tokens().contains(&next) {
            break;
        }
    }
    println!("generated {:?} in {:.1?}", &ids[start..], t0.elapsed());
    println!("{}", tok.decode(&ids[start..]));
    Ok(())
}
