//! Dequantization to f32 of the ggml block formats, transcribed from ggml's `ggml-common.h` (block
//! layouts) and `ggml-quants.c` (`dequantize_row_*`). Every scale is an IEEE f16 widened exactly;
//! the float operations are done in the order of the reference code (and of the Python `gguf`
//! package's numpy version), so results are bit-exact against it.

use half::f16;

use crate::error::{GgufError, Result};
use crate::ggml::GgmlType;

/// Elements per super-block of the K-quants (`QK_K`).
pub const QK_K: usize = 256;

/// The types [`dequantize`] handles.
pub use crate::ggml::DEQUANTIZABLE as SUPPORTED;

/// Widens `n` elements of type `ty` stored in `bytes` (exactly `n / block * block_bytes` long).
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; n];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// [`dequantize`] into a caller's buffer; `out.len()` is the element count.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let unsupported = || GgufError::UnsupportedType {
        tensor: String::new(),
        ty,
    };
    if !SUPPORTED.contains(&ty) {
        return Err(unsupported());
    }
    let (block, block_bytes) = ty.block_layout().ok_or_else(unsupported)?;
    let (block, block_bytes) = (block as usize, block_bytes as usize);
    let n = out.len();
    if n % block != 0 {
        return Err(GgufError::corrupt(format!(
            "{n} elements are not a whole number of {} blocks of {block}",
            ty.name()
        )));
    }
    let need = n / block * block_bytes;
    if bytes.len() != need {
        return Err(GgufError::corrupt(format!(
            "{n} {} elements take {need} bytes, got {}",
            ty.name(),
            bytes.len()
        )));
    }
    let blocks = bytes.chunks_exact(block_bytes).zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = half(b, 0)),
        GgmlType::BF16 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
        }
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
        _ => return Err(unsupported()),
    }
    Ok(())
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// `block_q8_0 { ggml_half d; int8_t qs[32]; }`
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

/// `block_q4_0 { ggml_half d; uint8_t qs[16]; }`: low nibbles are elements 0..16, high 16..32.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = f32::from((qs[j] & 0x0F) as i8 - 8) * d;
        y[j + 16] = f32::from((qs[j] >> 4) as i8 - 8) * d;
    }
}

/// `block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }`
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0x0F) * d + m;
        y[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

/// The fifth bits of a Q5 block: bit `j` for element `j`, bit `j + 16` for element `j + 16`.
fn fifth_bits(qh: u32, j: usize) -> (u8, u8) {
    let h0 = (((qh >> j) << 4) & 0x10) as u8;
    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
    (h0, h1)
}

/// `block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }`
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = f32::from(((qs[j] & 0x0F) | h0) as i8 - 16) * d;
        y[j + 16] = f32::from(((qs[j] >> 4) | h1) as i8 - 16) * d;
    }
}

/// `block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }`
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = f32::from((qs[j] & 0x0F) | h0) * d + m;
        y[j + 16] = f32::from((qs[j] >> 4) | h1) * d + m;
    }
}

/// `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }`
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (k, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        for l in 0..32 {
            y[l] = d1 * f32::from(q[l] & 0x0F) - m1;
            y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

/// `block_q5_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }`
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (k, (ql, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (u1, u2) = (1u8 << (2 * k), 2u8 << (2 * k));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * f32::from((ql[l] & 0x0F) + h1) - m1;
            y[l + 32] = d2 * f32::from((ql[l] >> 4) + h2) - m2;
        }
    }
}

/// `block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }`
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            let s = |i: usize| d * f32::from(sc[i] as i8);
            y[l] = s(is) * f32::from(q1);
            y[l + 32] = s(is + 2) * f32::from(q2);
            y[l + 64] = s(is + 4) * f32::from(q3);
            y[l + 96] = s(is + 6) * f32::from(q4);
        }
    }
}
