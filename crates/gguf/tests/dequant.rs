//! The dequantizers against the Python `gguf` package (ggml's reference semantics), bit for bit,
//! on the blocks of `data/dequant_goldens.bin` (written by `data/gen_dequant_goldens.py`).

use gguf::quant::{dequantize, SUPPORTED};
use gguf::{GgmlType, GgufError};

fn goldens() -> Vec<(GgmlType, Vec<u8>, Vec<f32>)> {
    let data = include_bytes!("data/dequant_goldens.bin");
    let mut at = 0;
    let u32_at = |at: &mut usize| {
        let v = u32::from_le_bytes(data[*at..*at + 4].try_into().unwrap());
        *at += 4;
        v as usize
    };
    let mut out = Vec::new();
    while at < data.len() {
        let ty = GgmlType::from_id(u32_at(&mut at) as u32);
        let n = u32_at(&mut at);
        let nbytes = u32_at(&mut at);
        let bytes = data[at..at + nbytes].to_vec();
        at += nbytes;
        let values = data[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += 4 * n;
        out.push((ty, bytes, values));
    }
    out
}

#[test]
fn every_supported_type_matches_python_gguf_bit_for_bit() {
    let goldens = goldens();
    for ty in SUPPORTED {
        let cases: Vec<_> = goldens.iter().filter(|(t, ..)| *t == ty).collect();
        assert!(!cases.is_empty(), "no golden for {ty:?}");
        for (_, bytes, want) in cases {
            let got = dequantize(ty, bytes, want.len()).unwrap();
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{} element {i}: {g} vs {w}", ty.name());
            }
        }
    }
}

#[test]
fn wrong_lengths_and_unsupported_types_are_errors() {
    let corrupt = |r: Result<Vec<f32>, GgufError>, says: &str| match r {
        Err(GgufError::Corrupt(m)) if m.contains(says) => {}
        other => panic!("expected a corrupt-length error saying {says:?}: {other:?}"),
    };
    corrupt(dequantize(GgmlType::Q8_0, &[0u8; 33], 32), "take 34 bytes, got 33");
    corrupt(
        dequantize(GgmlType::Q8_0, &[0u8; 34], 31),
        "not a whole number of Q8_0 blocks",
    );
    corrupt(
        dequantize(GgmlType::Q4K, &[0u8; 144], 128),
        "not a whole number of Q4_K blocks",
    );
    for ty in [GgmlType::Q2K, GgmlType::Other(99)] {
        let err = dequantize(ty, &[0u8; 84], 256).unwrap_err();
        assert!(
            matches!(err, GgufError::UnsupportedType { ty: t, .. } if t == ty),
            "{err:?}"
        );
    }
    assert_eq!(dequantize(GgmlType::Q6K, &[], 0).unwrap(), Vec::<f32>::new());
}
