//! Block-quantized weights in `.irpa` archives (`q8`, `q4`), shared by the importer, the exporter,
//! the reference backend and the host-side embedding gather, so that every reader computes with
//! exactly the same dequantized values.
//!
//! A quantized `[out, in]` matrix `name` (`in` a multiple of [`BLOCK`]) is two archive entries:
//! - `name`: the values, row-major. [`QuantFormat::Q8`]: one `i8` per element (GGUF Q8_0's).
//!   [`QuantFormat::Q4`]: signed 4-bit (`-8..=7`), two per byte, element `2k` in the low nibble
//!   and `2k + 1` in the high one (IREE's packing of `i4` tensors; GGUF Q4_0's `q - 8`, its
//!   nibbles re-ordered: Q4_0 puts element `j` and `j + 16` of a block in one byte).
//! - `name.scale` ([`scale_name`]): one little-endian scale per block of [`BLOCK`] consecutive
//!   elements of a row, `[out, in / BLOCK]`, of the manifest's [`ScaleType`]: `f16` (GGUF Q8_0's
//!   and Q4_0's own, what the importer and the quantizer write) or `f32` (archives written before
//!   `f16`, and exports for Vulkan, whose code generator gets no 16-bit type).
//!
//! The value of element `i` is `f32(q[i]) * f32(scale[i / BLOCK])`: one rounding (the product;
//! widening an f16 is exact), so the graphs (`convert` + `multiply`, fused into the matmul) and
//! the host agree bit for bit on every weight. Vectors (norms, biases) stay bf16. Which parameters are quantized, and from what,
//! is the manifest's `quantization` ([`Quantization`]).

use std::path::Path;

use crate::error::{Error, Result};
use crate::irpa::{IrpaArchive, IrpaWriter};
use crate::manifest::Manifest;
use crate::param::ParamInfo;
use crate::params::parameter_table;

/// The archive entry holding the scales of quantized parameter `name`.
pub use crate::param::scale_name;

pub use crate::quantization::{QuantFormat, Quantization, ScaleType, BLOCK};

/// Whether a parameter of this shape is quantized by [`quantize_dir`] and the importer: matrices
/// whose rows are whole blocks.
pub fn quantizable(info: &ParamInfo) -> bool {
    info.shape.len() == 2 && info.shape[1] % BLOCK == 0
}

/// `values` quantized: (value bytes, scales as `scale_type` stores them). Q8 follows ggml's
/// `quantize_row_q8_0_ref` (`d = amax / 127`, `q = round(x / d)`), Q4 its
/// `quantize_row_q4_0_ref` (`d = max / -8`, the signed value of largest magnitude,
/// `q = min(15, trunc(x / d + 8.5)) - 8`); as in ggml the values are rounded with the f32 `d`
/// and the scale is then stored in its type (`GGML_FP32_TO_FP16(d)`).
pub fn quantize(format: QuantFormat, scale_type: ScaleType, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    assert!(values.len() % BLOCK == 0, "quantize: whole blocks only");
    let blocks = values.len() / BLOCK;
    let mut scales = Vec::with_capacity(blocks);
    let mut q = vec![0i8; values.len()];
    for (x, out) in values.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)) {
        match format {
            QuantFormat::Q8 => {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                for (o, v) in out.iter_mut().zip(x) {
                    *o = (v * id).round().clamp(-127.0, 127.0) as i8;
                }
                scales.push(scale_type.round(d));
            }
            QuantFormat::Q4 => {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in x {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                for (o, v) in out.iter_mut().zip(x) {
                    let u = ((v * id + 8.5) as i32).clamp(0, 15);
                    *o = (u - 8) as i8;
                }
                scales.push(scale_type.round(d));
            }
        }
    }
    (pack(format, &q), scales)
}

/// Signed values (`-128..=127` for Q8, `-8..=7` for Q4) as the archive stores them.
pub fn pack(format: QuantFormat, q: &[i8]) -> Vec<u8> {
    match format {
        QuantFormat::Q8 => q.iter().map(|&v| v as u8).collect(),
        QuantFormat::Q4 => q
            .chunks_exact(2)
            .map(|p| ((p[0] as u8) & 0x0f) | (((p[1] as u8) & 0x0f) << 4))
            .collect(),
    }
}

/// The signed value of element `i` of `bytes`.
#[inline]
fn value(format: QuantFormat, bytes: &[u8], i: usize) -> i8 {
    match format {
        QuantFormat::Q8 => bytes[i] as i8,
        QuantFormat::Q4 => {
            let b = bytes[i / 2];
            let nibble = if i % 2 == 0 { b << 4 } else { b & 0xf0 };
            (nibble as i8) >> 4
        }
    }
}

/// Scales stored as `ty`, widened to f32.
pub fn scales_from_bytes(bytes: &[u8], ty: ScaleType) -> Vec<f32> {
    (0..bytes.len() / ty.size()).map(|i| ty.read(bytes, i)).collect()
}

/// `scales` stored as `ty` (f16: each rounded to nearest even; exact for scales that
/// [`quantize`] made for `ty` or that came from f16).
pub fn scales_to_bytes(scales: &[f32], ty: ScaleType) -> Vec<u8> {
    match ty {
        ScaleType::F32 => scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ScaleType::F16 => scales
            .iter()
            .flat_map(|&s| half::f16::from_f32(s).to_bits().to_le_bytes())
            .collect(),
    }
}

/// Elements `first..first + out.len()` dequantized into `out` (`first` and the length whole
/// blocks): `f32(q) * f32(scale)`, exactly what the graphs compute.
pub fn dequantize_range(
    format: QuantFormat,
    ty: ScaleType,
    bytes: &[u8],
    scales: &[u8],
    first: usize,
    out: &mut [f32],
) {
    debug_assert!(first % BLOCK == 0 && out.len() % BLOCK == 0);
    for (b, block) in out.chunks_exact_mut(BLOCK).enumerate() {
        let bi = first / BLOCK + b;
        let s = ty.read(scales, bi);
        for (j, o) in block.iter_mut().enumerate() {
            *o = f32::from(value(format, bytes, bi * BLOCK + j)) * s;
        }
    }
}

/// Every element of a quantized parameter, checked against its size.
pub fn dequantize(
    format: QuantFormat,
    ty: ScaleType,
    name: &str,
    numel: usize,
    bytes: &[u8],
    scales: &[u8],
) -> Result<Vec<f32>> {
    check_sizes(format, ty, name, numel, bytes.len(), scales.len())?;
    let mut out = vec![0.0f32; numel];
    dequantize_range(format, ty, bytes, scales, 0, &mut out);
    Ok(out)
}

/// Errs unless the value and scale entries have the sizes `numel` elements need.
pub fn check_sizes(
    format: QuantFormat,
    ty: ScaleType,
    name: &str,
    numel: usize,
    values: usize,
    scales: usize,
) -> Result<()> {
    if numel % BLOCK != 0 {
        return Err(Error::parameter(
            name,
            format!("{numel} elements are not whole blocks of {BLOCK}"),
        ));
    }
    let (want_v, want_s) = (format.value_bytes(numel), ty.scale_bytes(numel));
    if values != want_v || scales != want_s {
        return Err(Error::parameter(
            name,
            format!(
                "{} of {numel} elements needs {want_v} value bytes and {want_s} scale bytes ({}), found {values} and {scales}",
                format.key(),
                ty.key()
            ),
        ));
    }
    Ok(())
}

/// The values and scale entries of quantized parameter `name` in `archive`.
pub fn entries<'a>(archive: &'a IrpaArchive, name: &str) -> Result<(&'a [u8], &'a [u8])> {
    let values = archive.data(name).map_err(|e| Error::parameter(name, e.to_string()))?;
    let scale = scale_name(name);
    let scales = archive
        .data(&scale)
        .map_err(|e| Error::parameter(&scale, e.to_string()))?;
    Ok((values, scales))
}

/// Adds `name` quantized from `values` to `writer`, its scales stored as `ty`.
pub fn add_quantized(
    writer: &mut IrpaWriter,
    format: QuantFormat,
    ty: ScaleType,
    name: &str,
    values: &[f32],
) -> Result<()> {
    let (bytes, scales) = quantize(format, ty, values);
    writer.add_data(name, bytes)?;
    writer.add_data(scale_name(name), scales_to_bytes(&scales, ty))?;
    Ok(())
}

/// Writes into `dst` the model of `src` (a directory with `manifest.json` and its bf16 or f32
/// weights archive) with every [`quantizable`] matrix re-quantized to `format` from its stored
/// values; the manifest records the choice (`quantization`, `provenance.weights`). A source that
/// is already quantized is refused.
pub fn quantize_dir(src: &Path, dst: &Path, format: QuantFormat) -> Result<Manifest> {
    let manifest = Manifest::load(src)?;
    if manifest.quantization.is_some() {
        return Err(Error::manifest(
            "quantization",
            format!("{} is already quantized", src.display()),
        ));
    }
    let arch = manifest.require_architecture()?.clone();
    let file = manifest
        .weights_file()
        .ok_or_else(|| Error::manifest("parameters", "the source manifest names no weights archive"))?;
    let archive = IrpaArchive::open(src.join(file))?;
    let mut writer = IrpaWriter::new();
    let mut quant = Quantization::default();
    for info in parameter_table(&manifest.spec, &arch) {
        let bytes = archive
            .data(&info.name)
            .map_err(|e| Error::parameter(&info.name, e.to_string()))?;
        let numel = info.numel();
        let (values, from) = if bytes.len() == numel * 2 {
            (
                crate::bf16::bf16_bytes_to_f32(bytes).map_err(|e| Error::parameter(&info.name, e.to_string()))?,
                "bf16",
            )
        } else if bytes.len() == numel * 4 {
            (
                crate::bf16::f32_bytes_to_vec(bytes).map_err(|e| Error::parameter(&info.name, e.to_string()))?,
                "f32",
            )
        } else {
            return Err(Error::parameter(
                &info.name,
                format!("{} bytes are neither bf16 nor f32 of {:?}", bytes.len(), info.shape),
            ));
        };
        if quantizable(&info) {
            add_quantized(&mut writer, format, quant.scale_type, &info.name, &values)?;
            quant.tensors.insert(info.name.clone(), format);
            quant
                .origin
                .insert(info.name.clone(), format!("requantized from {from}"));
        } else {
            writer.add_bf16_from_f32(info.name.as_str(), &values)?;
        }
    }
    std::fs::create_dir_all(dst).map_err(|source| Error::Io {
        what: "creating",
        path: dst.display().to_string(),
        source,
    })?;
    writer.write(dst.join(file))?;
    let mut out = manifest;
    out.quantization = Some(quant);
    out.provenance.weights = Some(format.key().into());
    out.save(dst)?;
    Manifest::load(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.3).collect()
    }

    #[test]
    fn q8_round_trip_is_within_half_a_step() {
        let x = sample(4 * BLOCK);
        for ty in [ScaleType::F32, ScaleType::F16] {
            let (bytes, scales) = quantize(QuantFormat::Q8, ty, &x);
            let stored = scales_to_bytes(&scales, ty);
            assert_eq!(stored.len(), ty.scale_bytes(x.len()));
            assert_eq!(
                scales_from_bytes(&stored, ty),
                scales,
                "{ty:?} scales are what is stored"
            );
            let y = dequantize(QuantFormat::Q8, ty, "w", x.len(), &bytes, &stored).unwrap();
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                // Half a step, plus the f16 rounding of the scale (2^-11 relative) over 127 steps.
                let slack = if ty == ScaleType::F16 {
                    scales[i / BLOCK] * 127.0 / 2048.0
                } else {
                    0.0
                };
                assert!(
                    (a - b).abs() <= scales[i / BLOCK] * 0.5 + slack + 1e-7,
                    "{ty:?} {i}: {a} {b}"
                );
            }
        }
    }

    #[test]
    fn f16_scales_are_gguf_halves() {
        // 0.1 is not an f16: stored as the nearest one, 0x2E66, and read back as exactly that.
        let stored = scales_to_bytes(&[0.1, -2.5, 0.0], ScaleType::F16);
        assert_eq!(stored, vec![0x66, 0x2e, 0x00, 0xc1, 0x00, 0x00]);
        let back = scales_from_bytes(&stored, ScaleType::F16);
        assert_eq!(back, vec![half::f16::from_bits(0x2e66).to_f32(), -2.5, 0.0]);
        assert_eq!(ScaleType::F16.round(0.1), back[0]);
        // The manifest spells them as the contract does.
        assert_eq!(serde_json::to_string(&ScaleType::F16).unwrap(), "\"f16\"");
        assert_eq!(serde_json::from_str::<ScaleType>("\"f32\"").unwrap(), ScaleType::F32);
        let err = serde_json::from_str::<ScaleType>("\"f64\"").unwrap_err();
        assert!(err.to_string().contains("unknown variant `f64`"), "{err}");
    }

    #[test]
    fn q4_packs_low_nibble_first_and_round_trips() {
        assert_eq!(pack(QuantFormat::Q4, &[-8, 7, 1, -1]), vec![0x78, 0xf1]);
        let bytes = pack(QuantFormat::Q4, &[-8, 7, 1, -1]);
        let got: Vec<i8> = (0..4).map(|i| value(QuantFormat::Q4, &bytes, i)).collect();
        assert_eq!(got, vec![-8, 7, 1, -1]);
        let x = sample(2 * BLOCK);
        let (bytes, scales) = quantize(QuantFormat::Q4, ScaleType::F32, &x);
        let y = dequantize(
            QuantFormat::Q4,
            ScaleType::F32,
            "w",
            x.len(),
            &bytes,
            &scales_to_bytes(&scales, ScaleType::F32),
        )
        .unwrap();
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            // Half a step, except on the side opposite the largest magnitude, which clips at +7·|d|.
            assert!((a - b).abs() <= scales[i / BLOCK].abs() + 1e-6, "{i}: {a} {b}");
        }
    }

    #[test]
    fn sizes_are_checked() {
        let f32s = ScaleType::F32;
        let sizes = |r: Result<Vec<f32>>, found: &str| match r {
            Err(Error::Parameter { name, reason }) if name == "w" && reason.ends_with(found) => {}
            other => panic!("expected a size error ending {found:?}: {:?}", other.map(|v| v.len())),
        };
        sizes(
            dequantize(QuantFormat::Q8, f32s, "w", 64, &[0; 63], &[0; 8]),
            "found 63 and 8",
        );
        sizes(
            dequantize(QuantFormat::Q4, f32s, "w", 64, &[0; 32], &[0; 4]),
            "found 32 and 4",
        );
        assert!(dequantize(QuantFormat::Q4, f32s, "w", 64, &[0; 32], &[0; 8]).is_ok());
        // f16 scales: two bytes a block, and f32-sized scales are refused.
        assert!(dequantize(QuantFormat::Q4, ScaleType::F16, "w", 64, &[0; 32], &[0; 4]).is_ok());
        sizes(
            dequantize(QuantFormat::Q4, ScaleType::F16, "w", 64, &[0; 32], &[0; 8]),
            "4 scale bytes (f16), found 32 and 8",
        );
    }
}
