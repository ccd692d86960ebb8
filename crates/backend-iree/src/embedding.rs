//! The embedding table, gathered on the host from the memory-mapped archive.

use std::path::Path;

use kv_core::irpa::IrpaArchive;
use kv_core::{Error, KvSpec, Result};

/// The `vocab × hidden` bf16 table of an archive, mapped, never copied as a whole.
pub struct Embedding {
    archive: IrpaArchive,
    name: String,
    vocab: usize,
    hidden: usize,
}

impl Embedding {
    /// Finds the table by name, or (seed artifacts without `embeddingParameter`) by its byte size,
    /// refusing an ambiguous size.
    pub fn open(path: &Path, name: Option<&str>, spec: &KvSpec) -> Result<Self> {
        let archive = IrpaArchive::open(path)?;
        let bytes = (spec.vocab_size * spec.hidden_size * 2) as u64;
        let name = match name {
            Some(name) => {
                let entry = archive
                    .get(name)
                    .ok_or_else(|| Error::parameter(name, format!("not in {}", path.display())))?;
                if entry.len() != bytes {
                    return Err(Error::parameter(
                        name,
                        format!(
                            "{} bytes, expected vocab {} x hidden {} bf16 = {bytes}",
                            entry.len(),
                            spec.vocab_size,
                            spec.hidden_size
                        ),
                    ));
                }
                name.to_string()
            }
            None => {
                let found = archive.find_by_size(bytes);
                match found.as_slice() {
                    [one] => one.name().to_string(),
                    [] => {
                        return Err(Error::parameter(
                            "<embedding>",
                            format!("no entry of {bytes} bytes (vocab x hidden bf16) in {}", path.display()),
                        ))
                    }
                    many => {
                        let names: Vec<_> = many.iter().map(|e| e.name()).collect();
                        return Err(Error::parameter(
                            "<embedding>",
                            format!(
                                "{} entries have the embedding's size ({}); name one with `embeddingParameter`",
                                names.len(),
                                names.join(", ")
                            ),
                        ));
                    }
                }
            }
        };
        archive.data(&name)?;
        Ok(Embedding {
            archive,
            name,
            vocab: spec.vocab_size,
            hidden: spec.hidden_size,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `[tokens.len(), hidden]` f32 rows. Token ids are checked by the caller's plan.
    pub fn gather(&self, tokens: &[i32]) -> Result<Vec<f32>> {
        let table = self.archive.data(&self.name)?;
        let row_bytes = self.hidden * 2;
        let mut out = vec![0.0f32; tokens.len() * self.hidden];
        for (row, &t) in out.chunks_exact_mut(self.hidden).zip(tokens) {
            let t = t as usize;
            if t >= self.vocab {
                kv_core::error::invariant("embedding gather of an unchecked token id");
            }
            kv_core::bf16::bf16_bytes_to_f32_into(&table[t * row_bytes..(t + 1) * row_bytes], row)
                .unwrap_or_else(|_| kv_core::error::invariant("embedding row length"));
        }
        Ok(out)
    }
}
