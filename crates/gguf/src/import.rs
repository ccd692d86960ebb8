//! GGUF checkpoint → skainet-kv artifact directory (`manifest.json` + `model.irpa`).
//!
//! GGUF tensor names are already ours (`token_embd.weight`, `blk.N.attn_q.weight`, ...). What the
//! importer does besides copying:
//! - **Shapes.** GGUF lists dims `ne0` first (`[in, out]` for a matrix); our row-major `[out, in]`
//!   is the same memory, so the dims are reversed and checked against
//!   [`kv_core::params::parameter_table`].
//! - **Llama Q/K un-permutation.** llama.cpp's converter (`LlamaModel.permute`) reorders the rows
//!   of every head of `attn_q`/`attn_k` so that RoPE rotates adjacent pairs; our tables rotate
//!   split halves (Hugging Face's `rotate_half`), so the import puts row `2i + s` of a head back
//!   at `s·d/2 + i`. Gemma GGUFs are NEOX-ordered (split halves) already and are copied as is.
//! - **Norms** are used as stored: Gemma's `1 + w` is already folded in by the converter.
//! - **Geometry** comes from the `<arch>.*` metadata; what is not in the file (Gemma 3's local
//!   RoPE base 10000 and its 6-layer global period) follows llama.cpp's constants.

use std::path::Path;

use kv_core::irpa::IrpaWriter;
use kv_core::manifest::{Manifest, Parameters};
use kv_core::params::{parameter_table, ParamInfo};
use kv_core::quant::{QuantFormat, Quantization, BLOCK};
use kv_core::{Architecture, Family, KvSpec, LayerWeight, Param};
use serde::{Deserialize, Serialize};

use crate::error::{GgufError, Result};
use crate::file::GgufFile;
use crate::ggml::GgmlType;

/// The archive the importer writes, relative to the output directory.
pub const WEIGHTS_FILE: &str = "model.irpa";

/// How the weights are stored in the archive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// Rounded to bf16 (nearest, ties to even): what the compiled graphs read.
    #[default]
    Bf16,
    /// The dequantized f32 values unchanged: an exact FP32 reference of the checkpoint.
    F32,
    /// Matrices as `kv_core::quant` q8 (i8, an f32 scale per block of 32): GGUF Q8_0 blocks
    /// copied, any other type re-quantized from its dequantized values; vectors bf16.
    Q8,
    /// Matrices as `kv_core::quant` q4 (signed 4-bit, an f32 scale per block of 32): GGUF Q4_0
    /// blocks copied, any other type re-quantized; vectors bf16.
    Q4,
}

impl WeightFormat {
    /// The block format of the matrices, if quantized.
    pub fn quant(self) -> Option<QuantFormat> {
        match self {
            WeightFormat::Q8 => Some(QuantFormat::Q8),
            WeightFormat::Q4 => Some(QuantFormat::Q4),
            WeightFormat::Bf16 | WeightFormat::F32 => None,
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::F32 => "f32",
            WeightFormat::Q8 => "q8",
            WeightFormat::Q4 => "q4",
        }
    }
}

/// The graph geometry the GGUF file does not decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImportOptions {
    /// Token count `C` of the chunk graph.
    pub chunk: usize,
    /// Length of the prefill (and redecode) graph.
    pub seq: usize,
    pub max_positions: usize,
    pub weights: WeightFormat,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            chunk: 32,
            seq: 1024,
            max_positions: 2048,
            weights: WeightFormat::Bf16,
        }
    }
}

/// Gemma 3's local (sliding-layer) RoPE base: not in the file (llama.cpp hard-codes it too).
pub const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;
/// Gemma 3: every 6th layer (5, 11, 17, ...) is global.
pub const GEMMA3_GLOBAL_LAYER_PERIOD: usize = 6;

/// The spec and architecture a GGUF file describes, with the caller's graph geometry.
pub fn model_config(file: &GgufFile, opts: &ImportOptions) -> Result<(KvSpec, Architecture)> {
    let arch = file.architecture()?.to_string();
    // Qwen2 and Qwen3 are Llama blocks with Q/K/V biases or per-head Q/K norms; their GGUFs keep
    // Hugging Face's row order (NEOX RoPE), unlike `llama`'s (see `permuted_heads`).
    let family = match arch.as_str() {
        "gemma3" => Family::Gemma3,
        "llama" | "qwen2" | "qwen3" => Family::Llama,
        other => {
            return Err(GgufError::import(format!(
                "architecture `{other}` is not supported (gemma3, llama, qwen2, qwen3)"
            )))
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = file.get_usize(&key("embedding_length"))?;
    let n_layers = file.get_usize(&key("block_count"))?;
    let n_heads = file.get_usize(&key("attention.head_count"))?;
    let n_kv_heads = file.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(n_heads);
    if n_heads == 0 {
        return Err(GgufError::import("attention.head_count is 0"));
    }
    let head_dim = file
        .opt_usize(&key("attention.key_length"))?
        .unwrap_or(hidden / n_heads);
    if let Some(v) = file.opt_usize(&key("attention.value_length"))? {
        if v != head_dim {
            return Err(GgufError::import(format!(
                "value_length {v} differs from key_length {head_dim}"
            )));
        }
    }
    if let Some(rot) = file.opt_usize(&key("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(GgufError::import(format!(
                "partial rotary embeddings (rope.dimension_count {rot} < head {head_dim}) are not supported"
            )));
        }
    }
    if let Some(v) = file.get(&key("rope.scaling.type")) {
        if v.as_str() != Some("none") {
            return Err(GgufError::import(format!("RoPE scaling {v:?} is not supported")));
        }
    }
    let ffn = file.get_usize(&key("feed_forward_length"))?;
    let eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
    let rope_base = file.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    let vocab = match file.get("tokenizer.ggml.tokens") {
        Some(_) => file.get_array("tokenizer.ggml.tokens")?.len(),
        None => file.get_usize(&key("vocab_size"))?,
    };
    let (sliding_window, period, sliding_base) = match family {
        Family::Gemma3 => (
            file.opt_usize(&key("attention.sliding_window"))?.unwrap_or(0),
            GEMMA3_GLOBAL_LAYER_PERIOD,
            GEMMA3_LOCAL_ROPE_BASE,
        ),
        // No sliding layers: every layer is global; the sliding base is unused but must validate.
        Family::Llama => (0, 1, rope_base),
    };
    let spec = KvSpec {
        n_layers,
        head_dim,
        n_heads,
        n_kv_heads,
        hidden_size: hidden,
        vocab_size: vocab,
        sliding_window,
        global_layer_period: period,
        chunk: opts.chunk,
        seq: opts.seq,
        max_positions: opts.max_positions,
        sliding_rope_base: sliding_base,
        global_rope_base: rope_base,
        mask_heads: 0,
    };
    let mut architecture = match family {
        Family::Gemma3 => Architecture::gemma3(&spec, ffn),
        Family::Llama => Architecture::llama(&spec, ffn),
    };
    architecture.attn_bias = arch == "qwen2";
    architecture.qk_norm = family == Family::Gemma3 || arch == "qwen3";
    architecture.rms_eps = eps;
    architecture.tied_output = file.tensor(&Param::Output.to_string()).is_none();
    spec.validate()?;
    architecture.validate()?;
    Ok((spec, architecture))
}

/// Undoes llama.cpp's `permute` of a `[heads · d, in]` Q or K matrix.
pub fn unpermute_rows(weights: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    move_rows(weights, heads, cols, |permuted, standard| (permuted, standard))
}

/// llama.cpp's `permute` (the converter's direction), for tests.
pub fn permute_rows(weights: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    move_rows(weights, heads, cols, |permuted, standard| (standard, permuted))
}

/// Copies whole rows between llama.cpp's adjacent-pair order and the split-half order: row
/// `h·d + 2·(j mod d/2) + j div d/2` of the permuted matrix is row `h·d + j` of the standard one.
/// `direction(permuted, standard)` returns `(source, destination)`.
fn move_rows<T: Copy + Default>(
    weights: &[T],
    heads: usize,
    cols: usize,
    direction: fn(usize, usize) -> (usize, usize),
) -> Vec<T> {
    let rows = weights.len() / cols;
    let d = rows / heads;
    let half = d / 2;
    let mut out = vec![T::default(); weights.len()];
    for h in 0..heads {
        for j in 0..d {
            let (src, dst) = direction(h * d + 2 * (j % half) + j / half, h * d + j);
            out[dst * cols..(dst + 1) * cols].copy_from_slice(&weights[src * cols..(src + 1) * cols]);
        }
    }
    out
}

/// The Q/K heads whose rows llama.cpp permuted in parameter `name`: only its `llama`
/// architecture's converter permutes (Gemma, Qwen2 and Qwen3 keep split halves).
fn permuted_heads(file: &GgufFile, name: &str, spec: &KvSpec, arch: &Architecture) -> Option<usize> {
    if arch.family != Family::Llama || file.architecture().ok() != Some("llama") {
        None
    } else {
        match name.parse::<Param>().ok().and_then(Param::weight) {
            Some(LayerWeight::AttnQ) => Some(spec.n_heads),
            Some(LayerWeight::AttnK) => Some(spec.n_kv_heads),
            _ => None,
        }
    }
}

/// The signed values and f32 scales of a GGUF tensor whose blocks are `format`'s (Q8_0 for q8,
/// Q4_0 for q4, whose `q - 8` they are), in our row order; `None` for any other type.
fn gguf_blocks(
    file: &GgufFile,
    info: &ParamInfo,
    format: QuantFormat,
    spec: &KvSpec,
    arch: &Architecture,
) -> Result<Option<(Vec<i8>, Vec<f32>)>> {
    let tensor = file.require_tensor(&info.name)?;
    let (block_bytes, ty) = match format {
        QuantFormat::Q8 => (34, GgmlType::Q8_0),
        QuantFormat::Q4 => (18, GgmlType::Q4_0),
    };
    if tensor.ty != ty || info.shape.len() != 2 || info.shape[1] % BLOCK != 0 {
        return Ok(None);
    }
    let bytes = file.tensor_data(tensor)?;
    let n = info.numel();
    if bytes.len() != n / BLOCK * block_bytes {
        return Err(GgufError::corrupt(format!(
            "tensor `{}`: {} bytes for {n} {} elements",
            info.name,
            bytes.len(),
            ty.name()
        )));
    }
    let mut q = vec![0i8; n];
    let mut scales = Vec::with_capacity(n / BLOCK);
    for (b, out) in bytes.chunks_exact(block_bytes).zip(q.chunks_exact_mut(BLOCK)) {
        scales.push(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
        match format {
            QuantFormat::Q8 => out.iter_mut().zip(&b[2..34]).for_each(|(o, &v)| *o = v as i8),
            QuantFormat::Q4 => {
                for j in 0..16 {
                    out[j] = (b[2 + j] & 0x0f) as i8 - 8;
                    out[j + 16] = (b[2 + j] >> 4) as i8 - 8;
                }
            }
        }
    }
    if let Some(heads) = permuted_heads(file, &info.name, spec, arch) {
        let cols = info.shape[1];
        q = move_rows(&q, heads, cols, |permuted, standard| (permuted, standard));
        scales = move_rows(&scales, heads, cols / BLOCK, |permuted, standard| (permuted, standard));
    }
    Ok(Some((q, scales)))
}

/// Every parameter of the model as f32 in our layout, in parameter-table order.
pub fn load_parameters(
    file: &GgufFile,
    spec: &KvSpec,
    arch: &Architecture,
    mut each: impl FnMut(&str, Vec<f32>) -> Result<()>,
) -> Result<()> {
    for info in parameter_table(spec, arch) {
        let tensor = file.require_tensor(&info.name)?;
        if tensor.shape() != info.shape {
            return Err(GgufError::import(format!(
                "tensor `{}` has GGUF dims {:?} (row-major {:?}), the spec needs {:?}",
                info.name,
                tensor.dims,
                tensor.shape(),
                info.shape
            )));
        }
        let mut values = file.dequantize(tensor)?;
        if let Some(heads) = permuted_heads(file, &info.name, spec, arch) {
            values = unpermute_rows(&values, heads, spec.hidden_size);
        }
        each(&info.name, values)?;
    }
    Ok(())
}

/// Imports the GGUF file at `gguf_path` into `out_dir` (created if needed).
pub fn import(gguf_path: &Path, out_dir: &Path, opts: ImportOptions) -> Result<Manifest> {
    let file = GgufFile::open(gguf_path)?;
    import_file(&file, out_dir, opts)
}

/// [`import`] of an opened file.
pub fn import_file(file: &GgufFile, out_dir: &Path, opts: ImportOptions) -> Result<Manifest> {
    import_file_with(file, out_dir, opts, &mut |_, _| {})
}

/// [`import_file`] that reports `(converted, total)` tensors to `progress` after each tensor
/// (drawing it is the caller's business: a library prints nothing).
pub fn import_file_with(
    file: &GgufFile,
    out_dir: &Path,
    opts: ImportOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Manifest> {
    let (spec, arch) = model_config(file, &opts)?;
    let total = parameter_table(&spec, &arch).len() as u64;
    let mut done = 0;
    let mut writer = IrpaWriter::new();
    let mut quantization = opts.weights.quant().map(|_| Quantization::default());
    let table: std::collections::HashMap<String, ParamInfo> = parameter_table(&spec, &arch)
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect();
    load_parameters(file, &spec, &arch, |name, values| {
        let info = &table[name];
        match (opts.weights.quant(), quantization.as_mut()) {
            (Some(format), Some(quant)) if kv_core::quant::quantizable(info) => {
                let source_ty = file.require_tensor(name)?.ty.name();
                let (bytes, scales, origin) = match gguf_blocks(file, info, format, &spec, &arch)? {
                    Some((q, scales)) => (
                        kv_core::quant::pack(format, &q),
                        scales,
                        format!("gguf {source_ty} blocks"),
                    ),
                    None => {
                        let (bytes, scales) = kv_core::quant::quantize(format, quant.scale_type, &values);
                        (bytes, scales, format!("requantized from {source_ty}"))
                    }
                };
                writer.add_data(name, bytes)?;
                writer.add_data(
                    kv_core::quant::scale_name(name),
                    // GGUF's f16 scales stay exact (widened, then stored back as f16).
                    kv_core::quant::scales_to_bytes(&scales, quant.scale_type),
                )?;
                quant.tensors.insert(name.to_string(), format);
                quant.origin.insert(name.to_string(), origin);
            }
            _ => match opts.weights {
                WeightFormat::F32 => {
                    writer.add_f32(name, &values)?;
                }
                _ => {
                    writer.add_bf16_from_f32(name, &values)?;
                }
            },
        }
        done += 1;
        progress(done, total);
        Ok(())
    })?;
    std::fs::create_dir_all(out_dir).map_err(|source| GgufError::Io {
        op: "create",
        path: out_dir.to_path_buf(),
        source,
    })?;
    writer.write(out_dir.join(WEIGHTS_FILE))?;

    let mut manifest = Manifest::new(spec, Some(arch.clone()), arch.family.default_prefix());
    manifest.parameters = Some(Parameters::Shared(WEIGHTS_FILE.into()));
    // The contract's embedding entry is bf16 (or, in a quantized archive, q8 / q4 with its
    // scales); an f32 archive is for the reference only.
    if opts.weights != WeightFormat::F32 {
        manifest.embedding_parameter = Some(Param::TokenEmbd.to_string());
    }
    manifest.quantization = quantization;
    let p = &mut manifest.provenance;
    p.importer = Some("gguf".into());
    if let Some(path) = file.path().and_then(|p| p.file_name()) {
        p.source_file = Some(path.to_string_lossy().into_owned());
    }
    if let Ok(name) = file.get_str("general.name") {
        p.source_name = Some(name.into());
    }
    p.weights = Some(opts.weights.key().into());
    manifest.save(out_dir)?;
    Ok(Manifest::load(out_dir)?)
}
