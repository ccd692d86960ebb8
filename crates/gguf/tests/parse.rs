//! The container parser: every value type round-trips, and a truncated or corrupt file is an
//! `Err`, never a panic.

use gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Value::String("llama".into()))
        .kv("u8", Value::U8(200))
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
    w.tensor_f32("a", &[4, 2], &[0., 1., 2., 3., 4., 5., 6., 7.]);
    let q8: Vec<u8> = [0x00u8, 0x3c].into_iter().chain((0..32).map(|i| i as u8)).collect(); // d = 1.0
    w.tensor("q", &[32], GgmlType::Q8_0, q8);
    w.tensor_f32("v", &[3], &[9., 8., 7.]);
    w
}

#[test]
fn every_value_type_and_tensor_round_trips() {
    let f = GgufFile::from_bytes(sample().to_bytes()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get("u8"), Some(&Value::U8(200)));
    assert_eq!(f.get("i8"), Some(&Value::I8(-5)));
    assert_eq!(f.get_u64("u16").unwrap(), 60000);
    assert_eq!(f.get("i16"), Some(&Value::I16(-30000)));
    assert_eq!(f.get_u64("u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get("i32").unwrap().as_i64(), Some(-2_000_000_000));
    assert_eq!(f.get_f32("f32").unwrap(), 1.5);
    assert!(f.get_bool("bool").unwrap());
    assert_eq!(f.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(f.get("i64").unwrap().as_i64(), Some(i64::MIN));
    assert_eq!(f.get_f32("f64").unwrap(), -2.25);
    assert_eq!(f.get_str_array("strings").unwrap(), vec!["a", "▁b"]);
    assert_eq!(f.get_f32_array("floats").unwrap(), vec![0.5, -1.0]);
    assert_eq!(f.get_array("nested").unwrap()[0].as_array().unwrap().len(), 2);
    assert_eq!(f.get_array("empty").unwrap().len(), 0);
    assert!(matches!(f.get_u64("i8"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_str("nope"), Err(GgufError::MissingKey(_))));

    let a = f.tensor("a").unwrap();
    assert_eq!(a.dims, vec![4, 2]);
    assert_eq!(a.shape(), vec![2, 4]);
    assert_eq!(f.dequantize(a).unwrap(), vec![0., 1., 2., 3., 4., 5., 6., 7.]);
    let q = f.dequantize_named("q").unwrap();
    assert_eq!(q, (0..32).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(f.dequantize_named("v").unwrap(), vec![9., 8., 7.]);
    assert!(matches!(f.dequantize_named("zz"), Err(GgufError::MissingTensor(_))));
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = sample();
    w.kv("general.alignment", Value::U32(64));
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.dequantize_named("v").unwrap(), vec![9., 8., 7.]);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = sample().to_bytes();
    for len in 0..bytes.len() {
        // Truncated, with the cut length: not another error a wrong offset could also raise.
        match GgufFile::from_bytes(bytes[..len].to_vec()) {
            Err(GgufError::Truncated { len: l, .. }) if l == len as u64 => {}
            other => panic!(
                "a file cut at {len} of {} bytes: {:?}",
                bytes.len(),
                other.map(|_| "parsed")
            ),
        }
    }
    assert!(GgufFile::from_bytes(bytes).is_ok());
}

#[test]
fn corrupt_bytes_never_panic() {
    let bytes = sample().to_bytes();
    // Flip every byte of the header and metadata region to a few hostile values.
    let header_end = GgufFile::from_bytes(bytes.clone()).unwrap().data_offset() as usize;
    for at in 0..header_end {
        for v in [0x00u8, 0xff, 0x7f, 0x80, 0x09] {
            let mut b = bytes.clone();
            b[at] = v;
            if let Ok(f) = GgufFile::from_bytes(b) {
                for t in f.tensors().to_vec() {
                    let _ = f.dequantize(&t);
                }
            }
        }
    }
}

fn with(patch: impl FnOnce(&mut Vec<u8>)) -> Result<GgufFile, GgufError> {
    let mut b = sample().to_bytes();
    patch(&mut b);
    GgufFile::from_bytes(b)
}

#[test]
fn specific_corruptions_are_named() {
    assert!(matches!(with(|b| b[0] = b'X'), Err(GgufError::BadMagic { .. })));
    assert!(matches!(with(|b| b[4] = 1), Err(GgufError::UnsupportedVersion(1))));
    // A tensor count far beyond the file.
    let err = with(|b| b[8..16].copy_from_slice(&u64::MAX.to_le_bytes())).unwrap_err();
    assert!(
        matches!(&err, GgufError::Truncated { what, .. } if what.starts_with("name of tensor")),
        "{err:?}"
    );
    // A metadata count far beyond the file.
    let err = with(|b| b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes())).unwrap_err();
    assert!(
        matches!(&err, GgufError::Truncated { what, .. } if what.starts_with("metadata key")),
        "{err:?}"
    );
    // The first key's length past the end.
    assert!(matches!(
        with(|b| b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes())),
        Err(GgufError::Truncated { .. })
    ));
    // An unaligned tensor offset and an out-of-range one.
    let mut w = GgufWriter::new();
    w.tensor_f32("a", &[2], &[1.0, 2.0]);
    let good = w.to_bytes();
    let name_end = 24 + 8 + 1; // count fields, name length, "a"
    let offset_field = name_end + 4 + 8 + 4;
    let mut b = good.clone();
    b[offset_field..offset_field + 8].copy_from_slice(&4u64.to_le_bytes());
    assert!(matches!(GgufFile::from_bytes(b), Err(GgufError::Corrupt(_))));
    let mut b = good.clone();
    b[offset_field..offset_field + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(&err, GgufError::Truncated { what, .. } if what == "data of tensor `a`"),
        "{err:?}"
    );
    // A Q8_0 row that is not a whole block.
    let mut w = GgufWriter::new();
    w.tensor("q", &[31], GgmlType::Q8_0, vec![0; 34]);
    assert!(matches!(GgufFile::from_bytes(w.to_bytes()), Err(GgufError::Corrupt(_))));
    // Too many dimensions.
    let mut w = GgufWriter::new();
    w.tensor_f32("t", &[1, 1, 1, 1, 1], &[1.0]);
    assert!(matches!(GgufFile::from_bytes(w.to_bytes()), Err(GgufError::Corrupt(_))));
    // A bad alignment.
    let mut w = GgufWriter::new();
    w.kv("general.alignment", Value::U32(3));
    assert!(matches!(GgufFile::from_bytes(w.to_bytes()), Err(GgufError::Corrupt(_))));
}
