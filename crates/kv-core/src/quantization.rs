//! The manifest's `quantization` and the formats it names ([`QuantFormat`], [`ScaleType`]):
//! data only, so the manifest reads it without the quantizer's arithmetic and archive code
//! (`crate::quant`, which re-exports these names and itself reads manifests).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Elements per block (one scale each), along the input dimension.
pub const BLOCK: usize = 32;

/// The element type of an archive's scales (the manifest's `quantization.scaleType`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleType {
    /// Little-endian f32: what archives held before f16, and what Vulkan exports declare.
    F32,
    /// Little-endian IEEE f16 (GGUF's block scales): half the bytes of `F32`, 1/16 B per weight.
    #[default]
    F16,
}

impl ScaleType {
    /// Bytes of one scale.
    pub fn size(self) -> usize {
        match self {
            ScaleType::F32 => 4,
            ScaleType::F16 => 2,
        }
    }

    /// Bytes of the scales of `numel` elements.
    pub fn scale_bytes(self, numel: usize) -> usize {
        numel / BLOCK * self.size()
    }

    /// `x` as this type stores it (f16: rounded to nearest even), widened back to f32.
    pub fn round(self, x: f32) -> f32 {
        match self {
            ScaleType::F32 => x,
            ScaleType::F16 => half::f16::from_f32(x).to_f32(),
        }
    }

    /// Scale `i` of `bytes`, widened (exactly) to f32.
    #[inline]
    pub fn read(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            ScaleType::F32 => f32::from_le_bytes([bytes[i * 4], bytes[i * 4 + 1], bytes[i * 4 + 2], bytes[i * 4 + 3]]),
            ScaleType::F16 => half::f16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32(),
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            ScaleType::F32 => "f32",
            ScaleType::F16 => "f16",
        }
    }
}

/// A weight format of the archive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantFormat {
    /// `i8` values, a scale per block of 32 (GGUF Q8_0).
    Q8,
    /// Signed 4-bit values, a scale per block of 32 (GGUF Q4_0).
    Q4,
}

impl QuantFormat {
    pub fn key(self) -> &'static str {
        match self {
            QuantFormat::Q8 => "q8",
            QuantFormat::Q4 => "q4",
        }
    }

    /// Bytes of the values of `numel` elements.
    pub fn value_bytes(self, numel: usize) -> usize {
        match self {
            QuantFormat::Q8 => numel,
            QuantFormat::Q4 => numel / 2,
        }
    }
}

impl std::str::FromStr for QuantFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "q8" => Ok(QuantFormat::Q8),
            "q4" => Ok(QuantFormat::Q4),
            other => Err(Error::manifest(
                "quantization.format",
                format!("`{other}` is not a weight format (q8, q4)"),
            )),
        }
    }
}

/// The manifest's `quantization`: which parameters of the archive are block-quantized.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Quantization {
    /// Elements per scale, along the input dimension: always [`BLOCK`].
    pub block: usize,
    /// Element type of the scales.
    pub scale_type: ScaleType,
    /// Each quantized parameter: its format.
    pub tensors: BTreeMap<String, QuantFormat>,
    /// Each quantized parameter: where its values came from, e.g. `gguf Q8_0` (the file's blocks
    /// copied), `requantized from Q4_K`, `requantized from bf16`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub origin: BTreeMap<String, String>,
}

impl Default for Quantization {
    fn default() -> Self {
        Quantization {
            block: BLOCK,
            scale_type: ScaleType::default(),
            tensors: BTreeMap::new(),
            origin: BTreeMap::new(),
        }
    }
}

impl Quantization {
    pub fn format_of(&self, name: &str) -> Option<QuantFormat> {
        self.tensors.get(name).copied()
    }

    /// The formats of an archive whose `fused` parameters replace their parts (each fused one
    /// in its parts' common format, `crate::params::fuse_projections`).
    pub fn fuse(&mut self, fused: &[crate::param::FusedParam]) {
        for f in fused {
            let format = self.tensors.remove(&f.parts[0].name);
            for p in &f.parts[1..] {
                self.tensors.remove(&p.name);
            }
            if let Some(format) = format {
                self.tensors.insert(f.name.clone(), format);
            }
            let mut origins: Vec<String> = f.parts.iter().filter_map(|p| self.origin.remove(&p.name)).collect();
            origins.dedup();
            if !origins.is_empty() {
                self.origin.insert(f.name.clone(), origins.join("; "));
            }
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.block != BLOCK {
            return Err(Error::manifest(
                "quantization.block",
                format!("{} (only {BLOCK} is supported)", self.block),
            ));
        }
        Ok(())
    }
}
