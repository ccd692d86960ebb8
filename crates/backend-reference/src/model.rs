//! Loading the weights: every entry of [`kv_core::params::parameter_table`], widened to f32
//! (block-quantized ones dequantized by [`kv_core::quant`], the values the graphs compute with).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kv_core::irpa::{IrpaArchive, IrpaEntryKind};
use kv_core::manifest::Rounding;
use kv_core::params::{archive_table, FusedParam, ParamInfo};
use kv_core::quant::Quantization;
use kv_core::{Architecture, Error, KvSpec, LayerWeight, Manifest, Param, Result};
use ndarray::{Array1, Array2};

/// The weights of one transformer block, f32. Matrices are `[out, in]` (a projection is `x · Wᵀ`).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Array1<f32>,
    pub attn_q: Array2<f32>,
    pub attn_k: Array2<f32>,
    pub attn_v: Array2<f32>,
    /// Present iff `attnBias`.
    pub attn_q_bias: Option<Array1<f32>>,
    pub attn_k_bias: Option<Array1<f32>>,
    pub attn_v_bias: Option<Array1<f32>>,
    /// Present iff `qkNorm`; `[headDim]`, shared by every head.
    pub attn_q_norm: Option<Array1<f32>>,
    pub attn_k_norm: Option<Array1<f32>>,
    pub attn_output: Array2<f32>,
    /// Present iff `postNorms`.
    pub post_attention_norm: Option<Array1<f32>>,
    pub ffn_norm: Array1<f32>,
    pub ffn_gate: Array2<f32>,
    pub ffn_up: Array2<f32>,
    pub ffn_down: Array2<f32>,
    /// Present iff `postNorms`.
    pub post_ffw_norm: Option<Array1<f32>>,
}

/// A model ready to run: the manifest's geometry and architecture and every weight in f32.
#[derive(Debug)]
pub struct ReferenceModel {
    manifest: Manifest,
    architecture: Architecture,
    /// `[vocab, hidden]`: the host-side gather source, and the output projection when tied.
    embedding: Array2<f32>,
    layers: Vec<LayerWeights>,
    output_norm: Array1<f32>,
    /// `[vocab, hidden]`, present iff the output is not tied.
    output: Option<Array2<f32>>,
}

impl ReferenceModel {
    /// Reads `dir/manifest.json` (which must carry `architecture`) and the weights archive it
    /// names, relative to `dir`.
    pub fn open(dir: &Path) -> Result<Arc<Self>> {
        Self::open_with_rounding(dir, None)
    }

    /// [`Self::open`], rounding as `rounding` says instead of as the manifest does (`None`: the
    /// manifest's): a reference that rounds what some compiled artifacts round, or the FP32
    /// forward of artifacts that round.
    pub fn open_with_rounding(dir: &Path, rounding: Option<Rounding>) -> Result<Arc<Self>> {
        let mut manifest = Manifest::load(dir)?;
        if let Some(rounding) = rounding {
            rounding.apply(&mut manifest);
        }
        let file = manifest
            .weights_file()
            .ok_or_else(|| Error::manifest("parameters", "names no weights archive; the reference needs one"))?;
        let archive = IrpaArchive::open(dir.join(file))?;
        Self::from_parts(manifest, &archive)
    }

    /// Loads every parameter of the manifest's spec and architecture from `archive`. The archive
    /// is not kept: the weights are widened to f32 copies.
    pub fn from_parts(manifest: Manifest, archive: &IrpaArchive) -> Result<Arc<Self>> {
        manifest.validate()?;
        let architecture = manifest.require_architecture()?.clone();
        let spec = &manifest.spec;
        let quant = manifest.quantization.as_ref();
        let (table, fused) = archive_table(spec, &architecture, quant, manifest.fusion());
        let mut store = ParamStore::load(archive, &table, quant)?;
        store.split(&fused);

        let layers = (0..spec.n_layers)
            .map(|l| {
                let mut vector = |w: LayerWeight| store.vector(Param::Layer(l, w));
                let attn_norm = vector(LayerWeight::AttnNorm);
                let ffn_norm = vector(LayerWeight::FfnNorm);
                let (attn_q_bias, attn_k_bias, attn_v_bias) = if architecture.attn_bias {
                    (
                        Some(vector(LayerWeight::AttnQBias)),
                        Some(vector(LayerWeight::AttnKBias)),
                        Some(vector(LayerWeight::AttnVBias)),
                    )
                } else {
                    (None, None, None)
                };
                let (attn_q_norm, attn_k_norm) = if architecture.qk_norm {
                    (
                        Some(vector(LayerWeight::AttnQNorm)),
                        Some(vector(LayerWeight::AttnKNorm)),
                    )
                } else {
                    (None, None)
                };
                let (post_attention_norm, post_ffw_norm) = if architecture.post_norms {
                    (
                        Some(vector(LayerWeight::PostAttentionNorm)),
                        Some(vector(LayerWeight::PostFfwNorm)),
                    )
                } else {
                    (None, None)
                };
                let mut matrix = |w: LayerWeight| store.matrix(Param::Layer(l, w));
                LayerWeights {
                    attn_norm,
                    attn_q: matrix(LayerWeight::AttnQ),
                    attn_k: matrix(LayerWeight::AttnK),
                    attn_v: matrix(LayerWeight::AttnV),
                    attn_q_bias,
                    attn_k_bias,
                    attn_v_bias,
                    attn_q_norm,
                    attn_k_norm,
                    attn_output: matrix(LayerWeight::AttnOutput),
                    post_attention_norm,
                    ffn_norm,
                    ffn_gate: matrix(LayerWeight::FfnGate),
                    ffn_up: matrix(LayerWeight::FfnUp),
                    ffn_down: matrix(LayerWeight::FfnDown),
                    post_ffw_norm,
                }
            })
            .collect();
        let embedding = store.matrix(Param::TokenEmbd);
        let output_norm = store.vector(Param::OutputNorm);
        let output = (!architecture.tied_output).then(|| store.matrix(Param::Output));
        Ok(Arc::new(ReferenceModel {
            manifest,
            architecture,
            embedding,
            layers,
            output_norm,
            output,
        }))
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn spec(&self) -> &KvSpec {
        &self.manifest.spec
    }

    pub fn architecture(&self) -> &Architecture {
        &self.architecture
    }

    /// The `[vocab, hidden]` embedding table, f32.
    pub fn embedding(&self) -> &Array2<f32> {
        &self.embedding
    }

    pub fn layer(&self, layer: usize) -> &LayerWeights {
        &self.layers[layer]
    }

    pub fn output_norm(&self) -> &Array1<f32> {
        &self.output_norm
    }

    /// The `[vocab, hidden]` output projection: the embedding table when tied.
    pub fn output_projection(&self) -> &Array2<f32> {
        self.output.as_ref().unwrap_or(&self.embedding)
    }
}

/// Every parameter of the table, loaded and size-checked up front, then handed out by name.
struct ParamStore {
    params: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl ParamStore {
    fn load(archive: &IrpaArchive, table: &[ParamInfo], quant: Option<&Quantization>) -> Result<Self> {
        let params = table
            .iter()
            .map(|info| {
                let values = match quant.and_then(|q| Some((q.format_of(&info.name)?, q.scale_type))) {
                    // Exactly the graphs' values: `f32(q) * f32(scale)` (kv_core::quant).
                    Some((format, ty)) => {
                        let (bytes, scales) = kv_core::quant::entries(archive, &info.name)?;
                        kv_core::quant::dequantize(format, ty, &info.name, info.numel(), bytes, scales)?
                    }
                    None => load_param(archive, info)?,
                };
                Ok((info.name.clone(), (info.shape.clone(), values)))
            })
            .collect::<Result<_>>()?;
        Ok(ParamStore { params })
    }

    /// Each of `fused` (an export's archive, `Manifest::fused_projections`) as its parts again:
    /// consecutive rows.
    fn split(&mut self, fused: &[FusedParam]) {
        for f in fused {
            let (_, values) = self.take(&f.name);
            let mut rest = &values[..];
            for part in &f.parts {
                let (mine, next) = rest.split_at(part.numel());
                self.params
                    .insert(part.name.clone(), (part.shape.clone(), mine.to_vec()));
                rest = next;
            }
        }
    }

    fn take(&mut self, name: &str) -> (Vec<usize>, Vec<f32>) {
        self.params
            .remove(name)
            .unwrap_or_else(|| kv_core::error::invariant(&format!("parameter `{name}` is not in the parameter table")))
    }

    fn vector(&mut self, param: Param) -> Array1<f32> {
        let name = param.to_string();
        let (shape, values) = self.take(&name);
        match shape[..] {
            [n] => Array1::from_shape_vec(n, values)
                .unwrap_or_else(|_| kv_core::error::invariant("loaded vector has its table size")),
            _ => kv_core::error::invariant(&format!("parameter `{name}` is not a vector")),
        }
    }

    fn matrix(&mut self, param: Param) -> Array2<f32> {
        let name = param.to_string();
        let (shape, values) = self.take(&name);
        match shape[..] {
            [rows, cols] => Array2::from_shape_vec((rows, cols), values)
                .unwrap_or_else(|_| kv_core::error::invariant("loaded matrix has its table size")),
            _ => kv_core::error::invariant(&format!("parameter `{name}` is not a matrix")),
        }
    }
}

/// One entry as f32. The byte length decides the element type: `numel * 2` is bf16 (widened
/// exactly), `numel * 4` is f32. Splat entries (IREE's constant fill) are expanded.
fn load_param(archive: &IrpaArchive, info: &ParamInfo) -> Result<Vec<f32>> {
    let entry = archive.get(&info.name).ok_or_else(|| {
        Error::parameter(
            &info.name,
            format!(
                "missing from the weights archive ({} live entries)",
                archive.live_count()
            ),
        )
    })?;
    let expanded;
    let bytes: &[u8] = match entry.kind() {
        IrpaEntryKind::Splat { pattern, length } => {
            expanded = pattern
                .iter()
                .copied()
                .cycle()
                .take(*length as usize)
                .collect::<Vec<u8>>();
            &expanded
        }
        _ => archive.entry_data(entry)?,
    };
    let numel = info.numel();
    let converted = if bytes.len() == numel * 2 {
        kv_core::bf16::bf16_bytes_to_f32(bytes)
    } else if bytes.len() == numel * 4 {
        kv_core::bf16::f32_bytes_to_vec(bytes)
    } else {
        return Err(Error::parameter(
            &info.name,
            format!(
                "shape {:?} needs {} bytes (bf16) or {} bytes (f32), found {} bytes",
                info.shape,
                numel * 2,
                numel * 4,
                bytes.len()
            ),
        ));
    };
    converted.map_err(|e| Error::parameter(&info.name, e.to_string()))
}
