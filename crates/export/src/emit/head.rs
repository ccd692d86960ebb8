//! The LM head: the final norm, the logits (the configured one-row i16 product on tuned GPUs)
//! and the argmax in the form the options choose.

use kv_core::param::Param;

use super::layer::Residual;
use super::FuncEmitter;
use crate::mlir::V;

impl FuncEmitter<'_> {
    /// `rmsnorm(x, output_norm) · Eᵀ` for every row of `x [R, hidden]`: `[R, vocab]`.
    pub(super) fn logits(&mut self, x: &V) -> V {
        let y = self.norm_param(x, &Param::OutputNorm.to_string());
        self.logits_of_normed(&y)
    }

    /// `y · Eᵀ` of rows already normed by the output norm.
    pub(super) fn logits_of_normed(&mut self, y: &V) -> V {
        let table = if self.arch.tied_output {
            Param::TokenEmbd
        } else {
            Param::Output
        }
        .to_string();
        match self.row_tuning().map(|t| t.head) {
            // One row of i16 weights: the widening in the product's own body, over (out, in),
            // with IREE's configuration given. The step's fused form of the same product was a
            // `vecmat` taking 820 µs of the H200's ~5 ms step; this form took 361 µs
            // (docs/journal, session 16). The step's other products stay fused: in this
            // form and configuration they were slower (640 outputs are too few workgroups).
            Some(config) if y.ty.static_dims()[0] == 1 => {
                let w = self.raw_param(&table);
                let info = config.compilation_info(w.ty.static_dims()[1]);
                self.b.row_contract_i16(y, &w, &info)
            }
            _ => self.proj(y, &table),
        }
    }

    /// The logits `[1, vocab]` of the row picked by the one-hot `select [1, R]` (or of the only row).
    pub(super) fn head_logits(&mut self, x: &V, select: Option<&V>) -> V {
        let row = match select {
            Some(s) => self.b.dot(s, x, (&[], &[]), (&[1], &[0])),
            None => x.clone(),
        };
        self.logits(&row)
    }

    /// [`Self::head_logits`] of a residual stream whose last post-norm addition is pending,
    /// made with the output norm in one pass where the profile carries it
    /// ([`Self::carried_norm`]); else settled, then normed.
    pub(super) fn head_logits_of(&mut self, x: &Residual, select: Option<&V>) -> V {
        let Some((_, normed)) = self.carried_norm(x, &Param::OutputNorm.to_string()) else {
            let x = self.settle(x);
            return self.head_logits(&x, select);
        };
        let row = match select {
            Some(s) => self.b.dot(s, &normed, (&[], &[]), (&[1], &[0])),
            None => normed,
        };
        self.logits_of_normed(&row)
    }

    /// The next token of the row picked by the one-hot `select [1, R]` (or of the only row): `[1] i32`.
    pub(super) fn head_token(&mut self, x: &V, select: Option<&V>) -> V {
        let logits = self.head_logits(x, select);
        self.argmax(&logits)
    }

    /// The index of each row's largest logit, lowest on ties, in the form the options choose.
    pub(super) fn argmax(&mut self, logits: &V) -> V {
        if self.options.argmax_by_max {
            self.b.argmax_rows_by_max(logits)
        } else {
            let n = logits.ty.static_dims()[1];
            let stages = match self.options.tuning.map(|t| t.argmax_width) {
                Some(width) => crate::mlir::argmax_stages_of_width(n, width),
                None => crate::mlir::argmax_stages(n),
            };
            self.b.argmax_rows_staged(logits, &stages)
        }
    }
}
