//! The parameter table: every weight a model of a given spec and architecture has, with its
//! archive name and shape. Names follow GGUF (`blk.3.attn_q.weight`) so an imported checkpoint
//! keeps its names. Matrices are `[out, in]`, row-major (a projection is `x · Wᵀ`). Norm weights
//! are multiplied as stored: Gemma's `1 + w` is folded in before they are written.

pub use crate::param::{FusedParam, ParamInfo};
use crate::param::{LayerWeight, Param};
use crate::quantization::{QuantFormat, Quantization};
use crate::spec::{Architecture, KvSpec};

/// Every parameter in a fixed order (embedding first, then layers, then the head).
pub fn parameter_table(spec: &KvSpec, arch: &Architecture) -> Vec<ParamInfo> {
    let h = spec.hidden_size;
    let q = spec.n_heads * spec.head_dim;
    let kv = spec.n_kv_heads * spec.head_dim;
    let f = arch.ffn_size;
    let mut table = vec![ParamInfo {
        name: Param::TokenEmbd.to_string(),
        shape: vec![spec.vocab_size, h],
    }];
    for l in 0..spec.n_layers {
        let mut push = |weight: LayerWeight, shape: Vec<usize>| {
            table.push(ParamInfo {
                name: Param::Layer(l, weight).to_string(),
                shape,
            })
        };
        push(LayerWeight::AttnNorm, vec![h]);
        push(LayerWeight::AttnQ, vec![q, h]);
        push(LayerWeight::AttnK, vec![kv, h]);
        push(LayerWeight::AttnV, vec![kv, h]);
        if arch.attn_bias {
            push(LayerWeight::AttnQBias, vec![q]);
            push(LayerWeight::AttnKBias, vec![kv]);
            push(LayerWeight::AttnVBias, vec![kv]);
        }
        if arch.qk_norm {
            push(LayerWeight::AttnQNorm, vec![spec.head_dim]);
            push(LayerWeight::AttnKNorm, vec![spec.head_dim]);
        }
        push(LayerWeight::AttnOutput, vec![h, q]);
        if arch.post_norms {
            push(LayerWeight::PostAttentionNorm, vec![h]);
        }
        push(LayerWeight::FfnNorm, vec![h]);
        push(LayerWeight::FfnGate, vec![f, h]);
        push(LayerWeight::FfnUp, vec![f, h]);
        push(LayerWeight::FfnDown, vec![h, f]);
        if arch.post_norms {
            push(LayerWeight::PostFfwNorm, vec![h]);
        }
    }
    table.push(ParamInfo {
        name: Param::OutputNorm.to_string(),
        shape: vec![h],
    });
    if !arch.tied_output {
        table.push(ParamInfo {
            name: Param::Output.to_string(),
            shape: vec![spec.vocab_size, h],
        });
    }
    table
}

/// Per-layer projections that read the same input, and the one matrix (or bias) each group is
/// stored as in a fused archive (`Manifest::fused_projections`): the parts' rows one after the
/// other, in this order. One matrix is one product in the graphs: on a GPU's decode step, where
/// every dispatch costs ~14 µs whatever its size, two of a layer's seven projections fewer (and
/// Gemma's Q/K norms then one dispatch, `docs/journal`, session 14). The gate/up pair is fused
/// only where asked ([`FUSED_GATE_UP`]).
pub const FUSED_PROJECTIONS: &[(LayerWeight, &[LayerWeight])] = &[
    (
        LayerWeight::AttnQkv,
        &[LayerWeight::AttnQ, LayerWeight::AttnK, LayerWeight::AttnV],
    ),
    (
        LayerWeight::AttnQkvBias,
        &[LayerWeight::AttnQBias, LayerWeight::AttnKBias, LayerWeight::AttnVBias],
    ),
];

/// The gate and up projections as one matrix (`Manifest::fused_gate_up`): the portable Vulkan
/// profiles' step then runs both as one split product whose second stage sums the two and
/// applies the activation (two dispatches a layer fewer). Not for the tuned GPU profiles, whose
/// one product of two results the activation already joins (there, a fused product's two
/// slices cost the activation a dispatch of its own, session 14), nor for the CPU's.
pub const FUSED_GATE_UP: (LayerWeight, &[LayerWeight]) =
    (LayerWeight::FfnGateUp, &[LayerWeight::FfnGate, LayerWeight::FfnUp]);

/// Which groups of projections an archive stores as one matrix each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fusion {
    /// [`FUSED_PROJECTIONS`] (`Manifest::fused_projections`).
    pub projections: bool,
    /// [`FUSED_GATE_UP`] (`Manifest::fused_gate_up`).
    pub gate_up: bool,
}

impl Fusion {
    /// Nothing fused: the source's matrices as they are.
    pub const APART: Fusion = Fusion {
        projections: false,
        gate_up: false,
    };
    /// [`FUSED_PROJECTIONS`] only: every export's archive but the portable Vulkan ones.
    pub const PROJECTIONS: Fusion = Fusion {
        projections: true,
        gate_up: false,
    };

    fn groups(self) -> impl Iterator<Item = &'static (LayerWeight, &'static [LayerWeight])> {
        let projections: &'static [(LayerWeight, &'static [LayerWeight])] =
            if self.projections { FUSED_PROJECTIONS } else { &[] };
        projections.iter().chain(self.gate_up.then_some(&FUSED_GATE_UP))
    }
}

/// `table` with each group that `fusion` names whose parts are all present and stored alike
/// under `quant` (all unquantized, or all in one format) replaced by its fused parameter, at the
/// first part's place; and the fused parameters. Parts stored differently stay apart.
pub fn fuse_projections(
    table: &[ParamInfo],
    n_layers: usize,
    quant: Option<&Quantization>,
    fusion: Fusion,
) -> (Vec<ParamInfo>, Vec<FusedParam>) {
    let format = |name: &str| -> Option<QuantFormat> { quant.and_then(|q| q.format_of(name)) };
    let index: std::collections::HashMap<&str, usize> =
        table.iter().enumerate().map(|(i, p)| (p.name.as_str(), i)).collect();
    let mut replaced: std::collections::HashMap<usize, Option<ParamInfo>> = std::collections::HashMap::new();
    let mut fused = Vec::new();
    for l in 0..n_layers {
        for (name, parts) in fusion.groups() {
            let at: Option<Vec<usize>> = parts
                .iter()
                .map(|&w| index.get(Param::Layer(l, w).to_string().as_str()).copied())
                .collect();
            let Some(at) = at else { continue };
            let first = format(&table[at[0]].name);
            if at.iter().any(|&i| format(&table[i].name) != first) {
                continue;
            }
            let parts: Vec<ParamInfo> = at.iter().map(|&i| table[i].clone()).collect();
            let mut shape = parts[0].shape.clone();
            if parts.iter().any(|p| p.shape[1..] != shape[1..]) {
                continue;
            }
            shape[0] = parts.iter().map(|p| p.shape[0]).sum();
            let info = ParamInfo {
                name: Param::Layer(l, *name).to_string(),
                shape,
            };
            replaced.insert(at[0], Some(info.clone()));
            for &i in &at[1..] {
                replaced.insert(i, None);
            }
            fused.push(FusedParam {
                name: info.name,
                weight: *name,
                parts,
            });
        }
    }
    let out = table
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match replaced.get(&i) {
            None => Some(p.clone()),
            Some(r) => r.clone(),
        })
        .collect();
    (out, fused)
}

/// The parameters an archive written for `spec`, `arch` and `quant` holds: [`parameter_table`],
/// with the groups `fusion` names fused ([`fuse_projections`]; `Manifest::fusion`). `quant` may be
/// the source's, which names the parts, or the fused archive's ([`Quantization::fuse`]): both
/// give the same groups.
pub fn archive_table(
    spec: &KvSpec,
    arch: &Architecture,
    quant: Option<&Quantization>,
    fusion: Fusion,
) -> (Vec<ParamInfo>, Vec<FusedParam>) {
    let table = parameter_table(spec, arch);
    fuse_projections(&table, spec.n_layers, quant, fusion)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The archive name of layer `l`'s weight `w`.
    fn layer_param(l: usize, w: LayerWeight) -> String {
        Param::Layer(l, w).to_string()
    }

    fn info(name: String, shape: &[usize]) -> ParamInfo {
        ParamInfo {
            name,
            shape: shape.to_vec(),
        }
    }

    /// Two layers of 8 wide, 2 query heads and 1 KV head of 4, with biases.
    fn table() -> Vec<ParamInfo> {
        let mut t = vec![info(Param::TokenEmbd.to_string(), &[16, 8])];
        for l in 0..2 {
            for (w, shape) in [
                (LayerWeight::AttnNorm, &[8][..]),
                (LayerWeight::AttnQ, &[8, 8]),
                (LayerWeight::AttnK, &[4, 8]),
                (LayerWeight::AttnV, &[4, 8]),
                (LayerWeight::AttnQBias, &[8]),
                (LayerWeight::AttnKBias, &[4]),
                (LayerWeight::AttnVBias, &[4]),
                (LayerWeight::FfnGate, &[12, 8]),
                (LayerWeight::FfnUp, &[12, 8]),
            ] {
                t.push(info(layer_param(l, w), shape));
            }
        }
        t
    }

    fn names(t: &[ParamInfo]) -> Vec<&str> {
        t.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn each_group_becomes_one_parameter_at_its_first_part() {
        let (fused_table, fused) = fuse_projections(&table(), 2, None, Fusion::PROJECTIONS);
        let mut want = vec![Param::TokenEmbd.to_string()];
        for l in 0..2 {
            for w in [
                LayerWeight::AttnNorm,
                LayerWeight::AttnQkv,
                LayerWeight::AttnQkvBias,
                LayerWeight::FfnGate,
                LayerWeight::FfnUp,
            ] {
                want.push(layer_param(l, w));
            }
        }
        assert_eq!(names(&fused_table), want);
        assert_eq!(fused_table[2].shape, [16, 8]);
        assert_eq!(fused_table[3].shape, [16]);
        assert_eq!(fused.len(), 4);
        assert_eq!(
            names(&fused[0].parts),
            ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]
        );
    }

    #[test]
    fn parts_stored_differently_stay_apart_and_the_formats_follow_the_fused() {
        let mut q = Quantization::default();
        for l in 0..2 {
            q.tensors.insert(layer_param(l, LayerWeight::AttnQ), QuantFormat::Q8);
            q.tensors.insert(layer_param(l, LayerWeight::AttnK), QuantFormat::Q8);
            q.origin.insert(layer_param(l, LayerWeight::AttnQ), "gguf Q8_0".into());
        }
        // Layer 1's value projection in the same format as its query and key ones, layer 0's not.
        q.tensors.insert(layer_param(1, LayerWeight::AttnV), QuantFormat::Q8);
        let (t, fused) = fuse_projections(&table(), 2, Some(&q), Fusion::PROJECTIONS);
        let n = names(&t);
        assert!(n.contains(&"blk.0.attn_q.weight") && n.contains(&"blk.0.attn_v.weight"));
        assert!(!n.contains(&"blk.0.attn_qkv.weight"));
        assert!(n.contains(&"blk.0.attn_qkv.bias"), "the biases are never quantized");
        assert!(n.contains(&"blk.1.attn_qkv.weight") && !n.contains(&"blk.1.attn_q.weight"));

        let mut fused_q = q.clone();
        fused_q.fuse(&fused);
        assert_eq!(fused_q.format_of("blk.1.attn_qkv.weight"), Some(QuantFormat::Q8));
        assert_eq!(fused_q.format_of("blk.1.attn_q.weight"), None);
        assert_eq!(
            fused_q.format_of("blk.0.attn_q.weight"),
            Some(QuantFormat::Q8),
            "layer 0 stays apart"
        );
        assert_eq!(fused_q.origin["blk.1.attn_qkv.weight"], "gguf Q8_0");
        // The fused archive's own formats give the same table.
        let (again, _) = fuse_projections(&table(), 2, Some(&fused_q), Fusion::PROJECTIONS);
        assert_eq!(again, t);
        assert!(!fused_q.tensors.contains_key("blk.1.attn_v.weight"));
    }

    #[test]
    fn gate_and_up_fuse_only_when_asked_and_keep_their_order() {
        let (t, fused) = fuse_projections(
            &table(),
            2,
            None,
            Fusion {
                projections: false,
                gate_up: true,
            },
        );
        let n = names(&t);
        assert!(n.contains(&"blk.0.attn_q.weight") && !n.contains(&"blk.0.attn_qkv.weight"));
        assert!(n.contains(&"blk.1.ffn_gate_up.weight"));
        assert!(!n.contains(&"blk.1.ffn_gate.weight") && !n.contains(&"blk.1.ffn_up.weight"));
        let at = n.iter().position(|&x| x == "blk.0.ffn_gate_up.weight").unwrap();
        assert_eq!(t[at].shape, [24, 8]);
        assert_eq!(fused.len(), 2);
        assert_eq!(names(&fused[0].parts), ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]);
        let (apart, none) = fuse_projections(&table(), 2, None, Fusion::APART);
        assert_eq!((apart, none.len()), (table(), 0));
    }
}
