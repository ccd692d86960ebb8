//! The importer on small synthetic checkpoints: llama's Q/K un-permutation, shapes, the
//! metadata → spec mapping, and artifact directories that `Manifest::load` and the reference load.

use backend_reference::ReferenceModel;
use gguf::import::{permute_rows, unpermute_rows};
use gguf::{import, GgufError, GgufWriter, ImportOptions, Value, ValueType, WeightFormat};
use kv_core::irpa::IrpaArchive;
use kv_core::params::parameter_table;
use kv_core::{Architecture, KvSpec, Manifest};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 16) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// A GGUF checkpoint of `arch` in llama.cpp's layout (dims reversed, llama Q/K permuted).
fn checkpoint(arch_name: &str, spec: &KvSpec, arch: &Architecture) -> (GgufWriter, Vec<(String, Vec<f32>)>) {
    let mut w = GgufWriter::new();
    let k = |s: &str| format!("{arch_name}.{s}");
    let u = |v: usize| Value::U32(v as u32);
    w.kv("general.architecture", Value::String(arch_name.into()))
        .kv(k("block_count"), u(spec.n_layers))
        .kv(k("embedding_length"), u(spec.hidden_size))
        .kv(k("feed_forward_length"), u(arch.ffn_size))
        .kv(k("attention.head_count"), u(spec.n_heads))
        .kv(k("attention.head_count_kv"), u(spec.n_kv_heads))
        .kv(k("attention.key_length"), u(spec.head_dim))
        .kv(k("attention.layer_norm_rms_epsilon"), Value::F32(arch.rms_eps))
        .kv(k("rope.freq_base"), Value::F32(spec.global_rope_base))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                (0..spec.vocab_size).map(|i| Value::String(format!("t{i}"))).collect(),
            ),
        );
    if spec.sliding_window > 0 {
        w.kv(k("attention.sliding_window"), u(spec.sliding_window));
    }
    let mut ours = Vec::new();
    for (i, p) in parameter_table(spec, arch).into_iter().enumerate() {
        let v = values(p.numel(), i as u32);
        let stored = match (arch_name, p.name.rsplit('.').nth(1)) {
            ("llama", Some("attn_q")) => permute_rows(&v, spec.n_heads, spec.hidden_size),
            ("llama", Some("attn_k")) => permute_rows(&v, spec.n_kv_heads, spec.hidden_size),
            _ => v.clone(),
        };
        let dims: Vec<u64> = p.shape.iter().rev().map(|&d| d as u64).collect();
        w.tensor_f32(&p.name, &dims, &stored);
        ours.push((p.name, v));
    }
    (w, ours)
}

fn small_spec() -> KvSpec {
    KvSpec {
        n_layers: 2,
        head_dim: 8,
        n_heads: 4,
        n_kv_heads: 2,
        hidden_size: 16,
        vocab_size: 24,
        sliding_window: 0,
        global_layer_period: 1,
        chunk: 4,
        seq: 8,
        max_positions: 16,
        sliding_rope_base: 10_000.0,
        global_rope_base: 10_000.0,
        mask_heads: 0,
    }
}

#[test]
fn unpermute_inverts_llama_cpp_permute_and_restores_split_halves() {
    // One head of d = 4 over one column: HF rows [a0 a1 | b0 b1] are stored [a0 b0 a1 b1].
    let hf = [0.0, 1.0, 10.0, 11.0];
    let stored = permute_rows(&hf, 1, 1);
    assert_eq!(stored, vec![0.0, 10.0, 1.0, 11.0]);
    assert_eq!(unpermute_rows(&stored, 1, 1), hf.to_vec());
    let w = values(3 * 8 * 5, 7);
    assert_eq!(unpermute_rows(&permute_rows(&w, 3, 5), 3, 5), w);
}

#[test]
fn llama_import_unpermutes_q_and_k_and_loads_in_the_reference() {
    let spec = small_spec();
    let arch = Architecture::llama(&spec, 32);
    let (w, ours) = checkpoint("llama", &spec, &arch);
    let src = tempfile::tempdir().unwrap();
    let gguf_path = src.path().join("m.gguf");
    std::fs::write(&gguf_path, w.to_bytes()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let opts = ImportOptions {
        chunk: 4,
        seq: 8,
        max_positions: 16,
        weights: WeightFormat::F32,
    };
    let manifest = import(&gguf_path, out.path(), opts).unwrap();
    assert_eq!(manifest.spec, spec);
    assert_eq!(manifest.architecture.as_ref(), Some(&arch));
    assert_eq!(Manifest::load(out.path()).unwrap(), manifest);
    let archive = IrpaArchive::open(out.path().join("model.irpa")).unwrap();
    for (name, v) in &ours {
        let got = kv_core::bf16::f32_bytes_to_vec(archive.data(name).unwrap()).unwrap();
        assert_eq!(&got, v, "{name}");
    }
    ReferenceModel::open(out.path()).unwrap();

    // bf16 by default, with the embedding named for the graphs.
    let out = tempfile::tempdir().unwrap();
    let manifest = import(
        &gguf_path,
        out.path(),
        ImportOptions {
            weights: WeightFormat::Bf16,
            ..opts
        },
    )
    .unwrap();
    assert_eq!(manifest.embedding_parameter.as_deref(), Some("token_embd.weight"));
    let archive = IrpaArchive::open(out.path().join("model.irpa")).unwrap();
    assert_eq!(archive.data("token_embd.weight").unwrap().len(), 24 * 16 * 2);
    ReferenceModel::open(out.path()).unwrap();
}

#[test]
fn gemma3_import_keeps_q_k_and_norms_as_stored() {
    let mut spec = small_spec();
    spec.n_layers = 6;
    spec.sliding_window = 4;
    spec.global_layer_period = 6;
    spec.global_rope_base = 1_000_000.0;
    let mut arch = Architecture::gemma3(&spec, 32);
    arch.rms_eps = 1e-6;
    let (w, ours) = checkpoint("gemma3", &spec, &arch);
    let file = gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let opts = ImportOptions {
        chunk: 4,
        seq: 8,
        max_positions: 16,
        weights: WeightFormat::F32,
    };
    let manifest = gguf::import_file(&file, out.path(), opts).unwrap();
    assert_eq!(manifest.spec, spec);
    assert_eq!(manifest.architecture.as_ref(), Some(&arch));
    let archive = IrpaArchive::open(out.path().join("model.irpa")).unwrap();
    for (name, v) in &ours {
        assert_eq!(
            &kv_core::bf16::f32_bytes_to_vec(archive.data(name).unwrap()).unwrap(),
            v,
            "{name}"
        );
    }
    ReferenceModel::open(out.path()).unwrap();
}

/// Qwen2 (Q/K/V biases) and Qwen3 (per-head Q/K norms, a head wider than hidden / heads) are
/// Llama blocks whose GGUFs keep Hugging Face's row order: imported unpermuted, every tensor
/// as written, the flags set, and the reference opens them.
#[test]
fn qwen2_and_qwen3_import_unpermuted_with_their_biases_and_norms() {
    for name in ["qwen2", "qwen3"] {
        let mut spec = small_spec();
        // No sliding layers: the unused sliding base is the global one, as for `llama`.
        spec.global_rope_base = 1_000_000.0;
        spec.sliding_rope_base = 1_000_000.0;
        if name == "qwen3" {
            spec.head_dim = 12;
        }
        let mut arch = Architecture::llama(&spec, 32);
        arch.attn_bias = name == "qwen2";
        arch.qk_norm = name == "qwen3";
        arch.rms_eps = 1e-6;
        let (w, ours) = checkpoint(name, &spec, &arch);
        let extra = if name == "qwen2" {
            "attn_q.bias"
        } else {
            "attn_q_norm.weight"
        };
        assert!(
            ours.iter().any(|(n, _)| n.ends_with(extra)),
            "{name}: the table has the family's extra tensors"
        );
        let file = gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
        let out = tempfile::tempdir().unwrap();
        let opts = ImportOptions {
            chunk: 4,
            seq: 8,
            max_positions: 16,
            weights: WeightFormat::F32,
        };
        let manifest = gguf::import_file(&file, out.path(), opts).unwrap();
        assert_eq!(manifest.spec, spec, "{name}");
        assert_eq!(manifest.architecture.as_ref(), Some(&arch), "{name}");
        let archive = IrpaArchive::open(out.path().join("model.irpa")).unwrap();
        for (tensor, v) in &ours {
            let got = kv_core::bf16::f32_bytes_to_vec(archive.data(tensor).unwrap()).unwrap();
            assert_eq!(&got, v, "{name} {tensor}: stored as written, not unpermuted");
        }
        ReferenceModel::open(out.path()).unwrap();
    }
}

/// An architecture the runtime has no graphs for is refused by name, listing what is imported.
#[test]
fn an_unsupported_architecture_is_named() {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Value::String("phi3".into()));
    let file = gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let err = gguf::import_file(&file, out.path(), ImportOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, GgufError::Import(_)), "{err:?}");
    assert!(text.contains("`phi3`") && text.contains("qwen2, qwen3"), "{text}");
}

#[test]
fn bad_checkpoints_are_errors() {
    let spec = small_spec();
    let arch = Architecture::llama(&spec, 32);
    let opts = ImportOptions {
        chunk: 4,
        seq: 8,
        max_positions: 16,
        weights: WeightFormat::F32,
    };
    let out = tempfile::tempdir().unwrap();
    let (w, _) = checkpoint("llama", &spec, &arch);

    let mut other = w.clone();
    other.kv("general.architecture", Value::String("mamba".into()));
    // A duplicate key is itself corrupt; build a fresh one instead.
    let err = gguf::GgufFile::from_bytes(other.to_bytes()).unwrap_err();
    assert!(
        matches!(&err, gguf::GgufError::Corrupt(m) if m.contains("appears twice")),
        "{err:?}"
    );

    let (mut w2, _) = checkpoint("llama", &spec, &arch);
    w2.tensor_f32("blk.0.attn_q.weight", &[16, 32], &[0.0; 512]);
    let err = gguf::GgufFile::from_bytes(w2.to_bytes()).unwrap_err();
    assert!(
        matches!(&err, gguf::GgufError::Corrupt(m) if m.contains("tensor `blk.0.attn_q.weight` appears twice")),
        "duplicate tensor: {err:?}"
    );

    // A tensor with the wrong shape.
    let mut bad = GgufWriter::new();
    let file = gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
    for (k, v) in file.metadata() {
        bad.kv(k, v.clone());
    }
    for t in file.tensors() {
        let data = file.dequantize(t).unwrap();
        let dims = if t.name == "blk.1.ffn_up.weight" {
            vec![t.dims[1], t.dims[0]]
        } else {
            t.dims.clone()
        };
        bad.tensor_f32(&t.name, &dims, &data);
    }
    let bad = gguf::GgufFile::from_bytes(bad.to_bytes()).unwrap();
    assert!(matches!(
        gguf::import_file(&bad, out.path(), opts),
        Err(GgufError::Import(_))
    ));

    // A missing tensor.
    let mut missing = GgufWriter::new();
    for (k, v) in file.metadata() {
        missing.kv(k, v.clone());
    }
    for t in file.tensors().iter().filter(|t| t.name != "blk.0.ffn_down.weight") {
        missing.tensor_f32(&t.name, &t.dims, &file.dequantize(t).unwrap());
    }
    let missing = gguf::GgufFile::from_bytes(missing.to_bytes()).unwrap();
    assert!(matches!(
        gguf::import_file(&missing, out.path(), opts),
        Err(GgufError::MissingTensor(_))
    ));

    // An unsupported architecture and a missing geometry key.
    let mut mamba = GgufWriter::new();
    mamba.kv("general.architecture", Value::String("mamba".into()));
    let mamba = gguf::GgufFile::from_bytes(mamba.to_bytes()).unwrap();
    assert!(matches!(
        gguf::import_file(&mamba, out.path(), opts),
        Err(GgufError::Import(_))
    ));
    let mut nokey = GgufWriter::new();
    nokey.kv("general.architecture", Value::String("llama".into()));
    let nokey = gguf::GgufFile::from_bytes(nokey.to_bytes()).unwrap();
    assert!(matches!(
        gguf::import_file(&nokey, out.path(), opts),
        Err(GgufError::MissingKey(_))
    ));
}

/// GGUF Q8_0 blocks of `v` (`d` = amax / 127 as f16).
fn q8_0_blocks(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for x in v.chunks_exact(32) {
        let amax = x.iter().fold(0.0f32, |m, a| m.max(a.abs()));
        let d = half::f16::from_f32(amax / 127.0);
        let id = if d.to_f32() != 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        out.extend(d.to_bits().to_le_bytes());
        out.extend(x.iter().map(|a| (a * id).round().clamp(-127.0, 127.0) as i8 as u8));
    }
    out
}

/// GGUF Q4_0 blocks of `v`: element `j` in the low nibble of byte `j`, `j + 16` in its high one.
fn q4_0_blocks(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for x in v.chunks_exact(32) {
        let max = x.iter().fold(0.0f32, |m, &a| if a.abs() > m.abs() { a } else { m });
        let d = half::f16::from_f32(max / -8.0);
        let id = if d.to_f32() != 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        let q: Vec<u8> = x.iter().map(|a| ((a * id + 8.5) as i32).clamp(0, 15) as u8).collect();
        out.extend(d.to_bits().to_le_bytes());
        out.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
    }
    out
}

/// q8 / q4 imports copy the GGUF blocks of their own type (Q8_0, Q4_0), un-permuting llama's
/// Q/K rows, so the archive dequantizes to exactly the file's values; other types are
/// re-quantized; the manifest records which; the reference loads the result.
#[test]
fn quantized_imports_copy_matching_blocks_and_requantize_the_rest() {
    let spec = KvSpec {
        hidden_size: 32,
        ..small_spec()
    };
    let arch = Architecture::llama(&spec, 64);
    let mut w = checkpoint("llama", &spec, &arch).0;
    // Re-store Q (permuted, Q8_0) and K (permuted, Q4_0) of layer 0 as blocks.
    let q_vals = permute_rows(&values(32 * 32, 101), spec.n_heads, 32);
    let k_vals = permute_rows(&values(16 * 32, 102), spec.n_kv_heads, 32);
    w.remove_tensor("blk.0.attn_q.weight")
        .remove_tensor("blk.0.attn_k.weight");
    w.tensor(
        "blk.0.attn_q.weight",
        &[32, 32],
        gguf::GgmlType::Q8_0,
        q8_0_blocks(&q_vals),
    );
    w.tensor(
        "blk.0.attn_k.weight",
        &[32, 16],
        gguf::GgmlType::Q4_0,
        q4_0_blocks(&k_vals),
    );
    let src = tempfile::tempdir().unwrap();
    let gguf_path = src.path().join("m.gguf");
    std::fs::write(&gguf_path, w.to_bytes()).unwrap();
    let file = gguf::GgufFile::open(&gguf_path).unwrap();
    let file_values = |name: &str, heads: usize| {
        let t = file.require_tensor(name).unwrap();
        unpermute_rows(&file.dequantize(t).unwrap(), heads, 32)
    };
    let q_want = file_values("blk.0.attn_q.weight", spec.n_heads);
    let k_want = file_values("blk.0.attn_k.weight", spec.n_kv_heads);

    for (weights, format, direct, requantized) in [
        (
            WeightFormat::Q8,
            kv_core::quant::QuantFormat::Q8,
            "blk.0.attn_q.weight",
            "blk.0.attn_k.weight",
        ),
        (
            WeightFormat::Q4,
            kv_core::quant::QuantFormat::Q4,
            "blk.0.attn_k.weight",
            "blk.0.attn_q.weight",
        ),
    ] {
        let out = tempfile::tempdir().unwrap();
        let opts = ImportOptions {
            chunk: 4,
            seq: 8,
            max_positions: 16,
            weights,
        };
        let manifest = import(&gguf_path, out.path(), opts).unwrap();
        let q = manifest.quantization.as_ref().unwrap();
        assert_eq!(q.format_of(direct), Some(format));
        assert_eq!(q.format_of("token_embd.weight"), Some(format));
        assert_eq!(q.format_of("blk.0.attn_norm.weight"), None, "vectors stay bf16");
        let origin = |n: &str| q.origin[n].clone();
        assert!(origin(direct).starts_with("gguf"), "{}", origin(direct));
        assert!(
            origin(requantized).starts_with("requantized from"),
            "{}",
            origin(requantized)
        );
        let archive = IrpaArchive::open(out.path().join("model.irpa")).unwrap();
        let (bytes, scales) = kv_core::quant::entries(&archive, direct).unwrap();
        let n = if direct.contains("attn_q") { 32 * 32 } else { 16 * 32 };
        // The file's own f16 block scales, stored as they were (2 bytes a block).
        let ty = manifest.quantization.as_ref().unwrap().scale_type;
        assert_eq!(ty, kv_core::quant::ScaleType::F16);
        assert_eq!(scales.len(), n / kv_core::quant::BLOCK * 2, "{direct}");
        let got = kv_core::quant::dequantize(format, ty, direct, n, bytes, scales).unwrap();
        let want = if direct.contains("attn_q") { &q_want } else { &k_want };
        assert_eq!(&got, want, "{direct}: the file's values exactly");
        assert_eq!(Manifest::load(out.path()).unwrap(), manifest);
        ReferenceModel::open(out.path()).unwrap();
    }
}
