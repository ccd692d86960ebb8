//! ggml's tensor types: ids, block layouts, names, and which of them this crate dequantizes.
//! A leaf of the crate (it imports nothing of it), so the file reader, the dequantizers and the
//! error type all name types through it without importing one another.

/// ggml tensor types (`enum ggml_type`). Types this crate does not know keep their id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
    Other(u32),
}

impl GgmlType {
    pub fn from_id(id: u32) -> Self {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            other => Other(other),
        }
    }

    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            BF16 => 30,
            Other(id) => id,
        }
    }

    /// `(elements per block, bytes per block)` per ggml's type traits; `None` for unknown types.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        use GgmlType::*;
        Some(match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            Other(_) => return None,
        })
    }

    /// The name ggml and the Python `gguf` package use (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> String {
        use GgmlType::*;
        match self {
            Q2K => "Q2_K".into(),
            Q3K => "Q3_K".into(),
            Q4K => "Q4_K".into(),
            Q5K => "Q5_K".into(),
            Q6K => "Q6_K".into(),
            Q8K => "Q8_K".into(),
            Other(id) => format!("type{id}"),
            other => format!("{other:?}"),
        }
    }
}

/// The types [`crate::quant::dequantize`] handles (its error for any other names them).
pub const DEQUANTIZABLE: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];
