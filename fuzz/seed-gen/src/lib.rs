//! Seed corpora for the fuzz targets, from real inputs: `seed-gen OUT` writes `OUT/<target>/*`.
//!
//! `scripts/fuzz.sh` runs it as the test `tests/seeds.rs` (`SEED_GEN_OUT=DIR cargo test
//! --workspace --test seeds`), not as this binary: `cargo run -p seed-gen` resolves the
//! dependencies' features for this package alone and so rebuilds most of the workspace after
//! `cargo test --workspace` (~4 min of CI), while the test reuses that build.
//!
//! - `irpa`: IREE's own golden archive (`crates/kv-core/tests/data/irpa-golden.irpa`), the fixtures' archives
//!   (`.cache/fixtures`, written here if missing; one whole, all with their tensors cut to 16
//!   bytes) and small archives of every entry kind;
//! - `gguf`: files of every metadata value type and every ggml block type (GgufWriter), a llama and
//!   a gemma3 header, and the header + tokenizer metadata of the two real models, cut down;
//! - `tokenizer_gguf`: the real vocabularies cut to their first tokens (scores, types, merges, chat
//!   template), and tiny SentencePiece / BPE vocabularies;
//! - `tokenizer_text`: the texts of llama.cpp's goldens (`crates/tokenizer/tests/data`).

use std::path::{Path, PathBuf};

use gguf::{GgmlType, GgufFile, GgufWriter, Value, ValueType};
use kv_core::irpa::{IrpaArchive, IrpaWriter};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn irpa_seeds(out: &Path) {
    let dir = out.join("irpa");
    let golden = workspace().join("crates/kv-core/tests/data/irpa-golden.irpa");
    match std::fs::read(&golden) {
        Ok(bytes) => write(&dir, "golden.irpa", &bytes),
        Err(e) => eprintln!("seed-gen: no {} ({e}); skipped", golden.display()),
    }
    for model in ["tiny-gemma3:7", "tiny-llama:3", "tiny-qwen3:1"] {
        let fixture = fixtures::materialize(model).unwrap();
        let bytes = std::fs::read(fixture.join("model.irpa")).unwrap();
        let name = model.replace(':', "-");
        if model == "tiny-llama:3" {
            // One whole archive (300 KB); the others cut down, so most inputs stay small.
            write(&dir, &format!("{name}.irpa"), &bytes);
        }
        // The same entry table (names, order, metadata) with every tensor cut to 16 bytes.
        let archive = IrpaArchive::from_bytes(bytes).unwrap();
        let mut cut = IrpaWriter::new();
        for entry in archive.entries() {
            let data = archive.entry_data(entry).unwrap();
            cut.add_data_with_metadata(entry.name(), &data[..data.len().min(16)], entry.metadata())
                .unwrap();
        }
        write(&dir, &format!("{name}-cut.irpa"), &cut.to_bytes());
    }
    let mut w = IrpaWriter::new();
    w.add_data("a", vec![1u8, 2, 3]).unwrap();
    w.add_data_with_metadata("b", vec![0u8; 70], b"TENSORv0:{}".to_vec())
        .unwrap();
    w.add_splat("zeros", &[0u8; 4], 4096).unwrap();
    w.add_splat_with_metadata("pattern", &[1u8, 2, 3, 4, 5, 6, 7, 8], 64, b"m".to_vec())
        .unwrap();
    w.add_data("", Vec::<u8>::new()).unwrap();
    write(&dir, "kinds.irpa", &w.to_bytes());
    write(&dir, "empty.irpa", &IrpaWriter::new().to_bytes());
    let mut one = IrpaWriter::new();
    one.add_f32("x", &[1.0, -2.0]).unwrap();
    write(&dir, "one.irpa", &one.to_bytes());
}

/// Bytes of `n` elements of `ty` (blocks of pseudo-random bytes; f16 scales kept finite).
fn tensor_bytes(ty: GgmlType, n: u64, salt: u8) -> Vec<u8> {
    let (block, size) = ty.block_layout().unwrap();
    let len = (n / block * size) as usize;
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(salt) & 0x3f)
        .collect()
}

fn all_value_types(w: &mut GgufWriter) {
    w.kv("u8", Value::U8(200))
        .kv("i8", Value::I8(-5))
        .kv("u16", Value::U16(60000))
        .kv("i16", Value::I16(-30000))
        .kv("u32", Value::U32(4_000_000_000))
        .kv("i32", Value::I32(-2_000_000_000))
        .kv("f32", Value::F32(1.5))
        .kv("bool", Value::Bool(true))
        .kv("u64", Value::U64(u64::MAX))
        .kv("i64", Value::I64(i64::MIN))
        .kv("f64", Value::F64(-2.25))
        .kv("s", Value::String("▁héllo".into()))
        .kv(
            "strings",
            Value::Array(
                ValueType::String,
                vec![Value::String("a".into()), Value::String("▁b".into())],
            ),
        )
        .kv(
            "floats",
            Value::Array(ValueType::F32, vec![Value::F32(0.5), Value::F32(-1.0)]),
        )
        .kv(
            "nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(2)])],
            ),
        )
        .kv("empty", Value::Array(ValueType::U8, vec![]));
}

fn model_header(w: &mut GgufWriter, arch: &str) {
    let k = |s: &str| format!("{arch}.{s}");
    w.kv("general.architecture", Value::String(arch.into()))
        .kv(k("embedding_length"), Value::U32(64))
        .kv(k("block_count"), Value::U32(2))
        .kv(k("attention.head_count"), Value::U32(4))
        .kv(k("attention.head_count_kv"), Value::U32(2))
        .kv(k("attention.key_length"), Value::U32(16))
        .kv(k("attention.value_length"), Value::U32(16))
        .kv(k("feed_forward_length"), Value::U32(128))
        .kv(k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6))
        .kv(k("rope.freq_base"), Value::F32(10000.0))
        .kv(k("attention.sliding_window"), Value::U32(8))
        .kv(k("vocab_size"), Value::U32(300));
}

/// The tokenizer keys of `file`, the vocabulary cut to its first `n` tokens and merges.
fn cut_vocab(file: &GgufFile, w: &mut GgufWriter, n: usize) {
    for (key, value) in file.metadata() {
        if !key.starts_with("tokenizer.") && !key.starts_with("general.architecture") {
            continue;
        }
        let value = match value {
            Value::Array(t, items) => Value::Array(*t, items.iter().take(n).cloned().collect()),
            other => other.clone(),
        };
        w.kv(key.clone(), value);
    }
}

fn spm_vocab(w: &mut GgufWriter) {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![2i32, 3, 3, 3, 3];
    for b in 0..=255u32 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for t in [
        "▁", "h", "e", "l", "o", "▁h", "he", "ll", "llo", "hello", "▁hello", "w", "r", "d", "▁w",
    ] {
        tokens.push(t.into());
        types.push(1);
    }
    let scores: Vec<Value> = (0..tokens.len()).map(|i| Value::F32(-(i as f32))).collect();
    w.kv("tokenizer.ggml.model", Value::String("llama".into()))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, tokens.into_iter().map(Value::String).collect()),
        )
        .kv("tokenizer.ggml.scores", Value::Array(ValueType::F32, scores))
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        )
        .kv("tokenizer.ggml.bos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(2))
        .kv("tokenizer.ggml.add_space_prefix", Value::Bool(true))
        .kv(
            "tokenizer.chat_template",
            Value::String("{{ '<start_of_turn>' }}".into()),
        );
}

fn bpe_vocab(w: &mut GgufWriter) {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
    let mut types = vec![3i32, 3, 3];
    for c in "abcdefghijklmnopqrstuvwxyzĠĊ0123456789!'".chars() {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ a", "i n", "e r"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    w.kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", Value::String("smollm".into()))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, tokens.into_iter().map(Value::String).collect()),
        )
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        )
        .kv(
            "tokenizer.ggml.merges",
            Value::Array(
                ValueType::String,
                merges.iter().map(|m| Value::String(m.to_string())).collect(),
            ),
        )
        .kv("tokenizer.ggml.eos_token_id", Value::U32(0))
        .kv("tokenizer.chat_template", Value::String("<|im_start|>".into()));
}

fn gguf_seeds(out: &Path, real: &[(&str, GgufFile)]) {
    let dir = out.join("gguf");
    let mut w = GgufWriter::new();
    all_value_types(&mut w);
    w.tensor_f32("a", &[4, 2], &[0., 1., 2., 3., 4., 5., 6., 7.]);
    write(&dir, "values.gguf", &w.to_bytes());

    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
    ];
    for (i, ty) in types.into_iter().enumerate() {
        let mut w = GgufWriter::new();
        w.kv("general.alignment", Value::U32(if i % 2 == 0 { 32 } else { 64 }));
        w.tensor(
            format!("t.{}", ty.name()),
            &[256, 2],
            ty,
            tensor_bytes(ty, 512, i as u8),
        );
        write(&dir, &format!("type-{}.gguf", ty.name()), &w.to_bytes());
    }
    let mut w = GgufWriter::new();
    w.tensor("unknown", &[7], GgmlType::Other(99), vec![0; 7]);
    write(&dir, "type-unknown.gguf", &w.to_bytes());

    for arch in ["llama", "gemma3"] {
        let mut w = GgufWriter::new();
        model_header(&mut w, arch);
        w.tensor_f32("token_embd.weight", &[64, 4], &[0.25; 256]);
        write(&dir, &format!("{arch}-header.gguf"), &w.to_bytes());
    }
    for (name, file) in real {
        let mut w = GgufWriter::new();
        for (key, value) in file.metadata() {
            if key.starts_with("tokenizer.") {
                continue;
            }
            w.kv(key.clone(), value.clone());
        }
        cut_vocab(file, &mut w, 64);
        // The first two tensors of the real file, with their real bytes, when small.
        for info in file
            .tensors()
            .iter()
            .filter(|t| t.size.is_some_and(|s| s <= 1 << 16))
            .take(2)
        {
            w.tensor(
                info.name.clone(),
                &info.dims,
                info.ty,
                file.tensor_data(info).unwrap().to_vec(),
            );
        }
        write(&dir, &format!("{name}-header.gguf"), &w.to_bytes());
    }
}

fn tokenizer_gguf_seeds(out: &Path, real: &[(&str, GgufFile)]) {
    let dir = out.join("tokenizer_gguf");
    let mut w = GgufWriter::new();
    spm_vocab(&mut w);
    write(&dir, "spm-tiny.gguf", &w.to_bytes());
    let mut w = GgufWriter::new();
    bpe_vocab(&mut w);
    write(&dir, "bpe-tiny.gguf", &w.to_bytes());
    for (name, file) in real {
        for n in [300, 1000] {
            let mut w = GgufWriter::new();
            cut_vocab(file, &mut w, n);
            write(&dir, &format!("{name}-vocab{n}.gguf"), &w.to_bytes());
        }
    }
}

fn tokenizer_text_seeds(out: &Path) {
    let dir = out.join("tokenizer_text");
    let goldens = workspace().join("crates/tokenizer/tests/data/llama_cpp_goldens.json");
    let all: serde_json::Value = serde_json::from_slice(&std::fs::read(&goldens).unwrap()).unwrap();
    let mut i = 0;
    for (vocab, cases) in all.as_object().unwrap() {
        let pick = u8::from(vocab.contains("smol"));
        for case in cases.as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let special = case["parseSpecial"].as_bool().unwrap();
            let mut bytes = vec![pick | (u8::from(special) << 1) | (u8::from(i % 2 == 0) << 2)];
            bytes.extend(text.as_bytes());
            write(&dir, &format!("golden-{i:03}"), &bytes);
            i += 1;
        }
    }
}

/// Writes every target's seeds under `out/<target>/` and returns, per target, the number of
/// seeds and their total size.
pub fn write_seeds(out: &Path) -> Vec<(&'static str, usize, u64)> {
    let real: Vec<(&str, GgufFile)> = ["gemma3-270m", "smollm2-135m"]
        .into_iter()
        .map(|name| {
            let path = model_store::ensure(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, GgufFile::open(path).unwrap())
        })
        .collect();
    irpa_seeds(out);
    gguf_seeds(out, &real);
    tokenizer_gguf_seeds(out, &real);
    tokenizer_text_seeds(out);
    TARGETS
        .iter()
        .map(|&target| {
            let (n, bytes) = std::fs::read_dir(out.join(target))
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().len())
                .fold((0, 0), |(n, b), l| (n + 1, b + l));
            (target, n, bytes)
        })
        .collect()
}

/// The fuzz targets (fuzz/fuzz_targets), one seed directory each.
pub const TARGETS: [&str; 4] = ["irpa", "gguf", "tokenizer_gguf", "tokenizer_text"];
