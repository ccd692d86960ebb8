//! Little-endian bf16 / f32 byte conversions.
//!
//! These run on the hot path (embedding rows are gathered from the `.irpa` mmap and widened on
//! every token), so the `_into` variants write into caller-owned buffers and no function
//! allocates per element. bf16 → f32 is exact (a 16-bit shift, which is what [`half::bf16`]
//! does); f32 → bf16 rounds to nearest, ties to even, via [`half::bf16::from_f32`] (NaN stays
//! NaN).

use half::bf16;

/// A byte buffer that does not hold a whole number of elements, or an output buffer of the
/// wrong size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// `len` bytes is not a multiple of the element size.
    #[error("{what}: {len} bytes is not a whole number of {elem_size}-byte elements")]
    RaggedLength {
        what: &'static str,
        len: usize,
        elem_size: usize,
    },
    /// The output buffer does not have exactly one slot per input element.
    #[error("{what}: input holds {input_elems} elements but the output has room for {output_elems}")]
    LengthMismatch {
        what: &'static str,
        input_elems: usize,
        output_elems: usize,
    },
}

fn check_ragged(what: &'static str, len: usize, elem_size: usize) -> Result<usize, ConvertError> {
    if len % elem_size != 0 {
        return Err(ConvertError::RaggedLength { what, len, elem_size });
    }
    Ok(len / elem_size)
}

/// Decodes little-endian bf16 bytes into f32 values. Odd lengths are an error.
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Result<Vec<f32>, ConvertError> {
    let n = check_ragged("bf16_bytes_to_f32", bytes.len(), 2)?;
    let mut out = vec![0.0f32; n];
    decode_bf16(bytes, &mut out);
    Ok(out)
}

/// Decodes little-endian bf16 bytes into `out`, which must hold exactly `bytes.len() / 2`
/// values.
pub fn bf16_bytes_to_f32_into(bytes: &[u8], out: &mut [f32]) -> Result<(), ConvertError> {
    let n = check_ragged("bf16_bytes_to_f32_into", bytes.len(), 2)?;
    if n != out.len() {
        return Err(ConvertError::LengthMismatch {
            what: "bf16_bytes_to_f32_into",
            input_elems: n,
            output_elems: out.len(),
        });
    }
    decode_bf16(bytes, out);
    Ok(())
}

#[inline]
fn decode_bf16(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 2);
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *dst = bf16::from_bits(u16::from_le_bytes([src[0], src[1]])).to_f32();
    }
}

/// `v` rounded to the nearest bf16 (ties to even), as f32: what a graph's `f32 → bf16` convert
/// computes (NaN stays NaN, overflow goes to ±inf).
#[inline]
pub fn round_to_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Encodes f32 values as little-endian bf16 bytes (round to nearest, ties to even).
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * 2];
    encode_bf16(values, &mut out);
    out
}

/// Encodes f32 values as little-endian bf16 bytes into `out` (exactly `2 * values.len()`
/// bytes).
pub fn f32_to_bf16_bytes_into(values: &[f32], out: &mut [u8]) -> Result<(), ConvertError> {
    let n = check_ragged("f32_to_bf16_bytes_into", out.len(), 2)?;
    if n != values.len() {
        return Err(ConvertError::LengthMismatch {
            what: "f32_to_bf16_bytes_into",
            input_elems: values.len(),
            output_elems: n,
        });
    }
    encode_bf16(values, out);
    Ok(())
}

#[inline]
fn encode_bf16(values: &[f32], out: &mut [u8]) {
    debug_assert_eq!(out.len(), values.len() * 2);
    for (dst, &v) in out.chunks_exact_mut(2).zip(values) {
        dst.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
    }
}

/// Decodes little-endian f32 bytes. Lengths that are not a multiple of 4 are an error.
pub fn f32_bytes_to_vec(bytes: &[u8]) -> Result<Vec<f32>, ConvertError> {
    let n = check_ragged("f32_bytes_to_vec", bytes.len(), 4)?;
    let mut out = vec![0.0f32; n];
    decode_f32(bytes, &mut out);
    Ok(out)
}

/// Decodes little-endian f32 bytes into `out` (exactly `bytes.len() / 4` values).
pub fn f32_bytes_to_f32_into(bytes: &[u8], out: &mut [f32]) -> Result<(), ConvertError> {
    let n = check_ragged("f32_bytes_to_f32_into", bytes.len(), 4)?;
    if n != out.len() {
        return Err(ConvertError::LengthMismatch {
            what: "f32_bytes_to_f32_into",
            input_elems: n,
            output_elems: out.len(),
        });
    }
    decode_f32(bytes, out);
    Ok(())
}

#[inline]
fn decode_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 4);
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
    }
}

/// Encodes f32 values as little-endian bytes.
pub fn f32_to_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * 4];
    for (dst, v) in out.chunks_exact_mut(4).zip(values) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_lengths_are_errors() {
        assert!(matches!(
            bf16_bytes_to_f32(&[1, 2, 3]),
            Err(ConvertError::RaggedLength { len: 3, .. })
        ));
        assert!(matches!(
            f32_bytes_to_vec(&[0; 6]),
            Err(ConvertError::RaggedLength {
                len: 6,
                elem_size: 4,
                ..
            })
        ));
        let mut out = [0.0f32; 2];
        assert!(matches!(
            bf16_bytes_to_f32_into(&[0; 6], &mut out),
            Err(ConvertError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn known_values() {
        // 1.0 = 0x3F80, -2.0 = 0xC000
        assert_eq!(bf16_bytes_to_f32(&[0x80, 0x3f, 0x00, 0xc0]).unwrap(), vec![1.0, -2.0]);
        assert_eq!(f32_to_bf16_bytes(&[1.0, -2.0]), vec![0x80, 0x3f, 0x00, 0xc0]);
        // 1 + 2^-8 is a tie between 1.0 and 1 + 2^-7: even mantissa (1.0) wins.
        assert_eq!(f32_to_bf16_bytes(&[1.0 + 1.0 / 256.0]), vec![0x80, 0x3f]);
    }
}
