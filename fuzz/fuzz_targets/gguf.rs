//! The GGUF reader on arbitrary bytes: parsing never panics or reads outside the input; every
//! typed metadata accessor and every tensor slice, dequantization and the model-config reader of
//! the importer either succeed within the file's bounds or return an error.
#![no_main]

use gguf::{GgufFile, ImportOptions};
use libfuzzer_sys::fuzz_target;

/// Dequantized output is at most this many f32s per tensor (the input bounds it anyway: at most
/// ~7 f32 per input byte for the densest quant format).
const MAX_ELEMENTS: u64 = 1 << 22;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let len = file.file_len();
    assert!(file.data_offset() <= len.next_multiple_of(file.alignment()));
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some());
        let _ = (
            value.as_u64(),
            value.as_i64(),
            value.as_f32(),
            value.as_bool(),
            value.as_str(),
        );
        let _ = (
            file.get_usize(key),
            file.get_f32(key),
            file.get_bool(key),
            file.get_str(key),
        );
        let _ = (
            file.get_str_array(key),
            file.get_f32_array(key),
            file.get_i64_array(key),
        );
        let _ = value.type_name();
    }
    let _ = file.architecture();
    for info in file.tensors() {
        assert!(file.tensor(&info.name).is_some());
        let _ = (info.n_elements(), info.ty.name(), info.ty.id());
        let Ok(bytes) = file.tensor_data(info) else {
            assert!(
                info.size.is_none(),
                "a tensor of known layout was range-checked at open"
            );
            continue;
        };
        assert_eq!(Some(bytes.len() as u64), info.size);
        if info.n_elements() <= MAX_ELEMENTS {
            if let Ok(values) = file.dequantize(info) {
                assert_eq!(values.len() as u64, info.n_elements());
            }
        }
    }
    let _ = gguf::model_config(&file, &ImportOptions::default());
});
