//! [`ReferenceRedecode`]: the redecode graph of CONTRACT §3, executed on the host in f32.

use std::sync::Arc;

use kv_core::{Error, RedecodeBackend, Result};
use ndarray::Axis;

use crate::forward::{argmax_lowest, full_forward_logits};
use crate::model::ReferenceModel;

/// The full causal + window forward over exactly `seq` tokens from position 0, returning the
/// predicted next id at every position.
#[derive(Debug, Clone)]
pub struct ReferenceRedecode {
    model: Arc<ReferenceModel>,
    seq: usize,
}

impl ReferenceRedecode {
    /// A graph of the spec's `seq`.
    pub fn new(model: Arc<ReferenceModel>) -> Self {
        let seq = model.spec().seq;
        ReferenceRedecode { model, seq }
    }

    /// A graph of another fixed length (redecode graphs are often exported shorter than prefill):
    /// 1 up to the model's `maxPositions`, its logits and scores within `kv_core::limits`
    /// (`Error::TooLarge`), checked here because each run allocates them.
    pub fn with_seq(model: Arc<ReferenceModel>, seq: usize) -> Result<Self> {
        if seq == 0 {
            return Err(Error::manifest("seq", "a redecode graph needs seq >= 1"));
        }
        model.spec().check_redecode_seq("redecode seq", seq)?;
        Ok(ReferenceRedecode { model, seq })
    }
}

impl RedecodeBackend for ReferenceRedecode {
    fn seq(&self) -> usize {
        self.seq
    }

    fn vocab_size(&self) -> usize {
        self.model.spec().vocab_size
    }

    fn run(&mut self, tokens: &[i32]) -> Result<Vec<i32>> {
        if tokens.len() != self.seq {
            return Err(Error::BadTokenCount {
                op: "redecode",
                n: tokens.len(),
                min: self.seq,
                max: self.seq,
            });
        }
        self.model.spec().check_tokens("redecode", tokens)?;
        let logits = full_forward_logits(&self.model, tokens)?;
        Ok(logits
            .axis_iter(Axis(0))
            .map(|row| argmax_lowest(&row.to_vec()) as i32)
            .collect())
    }

    fn name(&self) -> String {
        "reference-redecode".into()
    }
}
