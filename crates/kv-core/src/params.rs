//! The parameter table: every weight a model of a given spec and architecture has, with its
//! archive name and shape. Names follow GGUF (`blk.3.attn_q.weight`) so an imported checkpoint
//! keeps its names. Matrices are `[out, in]`, row-major (a projection is `x · Wᵀ`). Norm weights
//! are multiplied as stored: Gemma's `1 + w` is folded in before they are written.

use crate::spec::{Architecture, KvSpec};

pub const TOKEN_EMBD: &str = "token_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT: &str = "output.weight";

/// One weight of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<usize>,
}

impl ParamInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The archive name of a per-layer weight, e.g. `layer_param(3, "attn_q.weight")`.
pub fn layer_param(layer: usize, suffix: &str) -> String {
    format!("blk.{layer}.{suffix}")
}

/// Every parameter in a fixed order (embedding first, then layers, then the head).
pub fn parameter_table(spec: &KvSpec, arch: &Architecture) -> Vec<ParamInfo> {
    let h = spec.hidden_size;
    let q = spec.n_heads * spec.head_dim;
    let kv = spec.n_kv_heads * spec.head_dim;
    let f = arch.ffn_size;
    let mut table = vec![ParamInfo {
        name: TOKEN_EMBD.into(),
        shape: vec![spec.vocab_size, h],
    }];
    for l in 0..spec.n_layers {
        let mut push = |suffix: &str, shape: Vec<usize>| {
            table.push(ParamInfo {
                name: layer_param(l, suffix),
                shape,
            })
        };
        push("attn_norm.weight", vec![h]);
        push("attn_q.weight", vec![q, h]);
        push("attn_k.weight", vec![kv, h]);
        push("attn_v.weight", vec![kv, h]);
        if arch.attn_bias {
            push("attn_q.bias", vec![q]);
            push("attn_k.bias", vec![kv]);
            push("attn_v.bias", vec![kv]);
        }
        if arch.qk_norm {
            push("attn_q_norm.weight", vec![spec.head_dim]);
            push("attn_k_norm.weight", vec![spec.head_dim]);
        }
        push("attn_output.weight", vec![h, q]);
        if arch.post_norms {
            push("post_attention_norm.weight", vec![h]);
        }
        push("ffn_norm.weight", vec![h]);
        push("ffn_gate.weight", vec![f, h]);
        push("ffn_up.weight", vec![f, h]);
        push("ffn_down.weight", vec![h, f]);
        if arch.post_norms {
            push("post_ffw_norm.weight", vec![h]);
        }
    }
    table.push(ParamInfo {
        name: OUTPUT_NORM.into(),
        shape: vec![h],
    });
    if !arch.tied_output {
        table.push(ParamInfo {
            name: OUTPUT.into(),
            shape: vec![spec.vocab_size, h],
        });
    }
    table
}
