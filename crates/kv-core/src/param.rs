//! Weight names as a type ([`Param`]), as graph arguments are [`crate::manifest::Name`]s. An
//! archive stores the GGUF spelling (`token_embd.weight`, `blk.3.attn_q.weight`) and, for a
//! quantized weight, its block scales beside it (`blk.3.attn_q.weight.scale`, [`scale_name`]);
//! the importer, the reference and the IREE backend name weights through these types, so a
//! spelling lives here once. `FromStr` takes only the spelling `Display` writes (`blk.03.…` is
//! refused), so a name read and written again keeps its bytes.
//!
//! This module is a leaf: it names things and imports nothing of the crate, so every other
//! module may use it.

use std::fmt;
use std::str::FromStr;

/// The suffix of a quantized weight's block scales entry ([`scale_name`]).
pub const SCALE_SUFFIX: &str = ".scale";

/// What a per-layer weight is (the GGUF name after `blk.{layer}.`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerWeight {
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnQNorm,
    AttnKNorm,
    AttnOutput,
    PostAttentionNorm,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    PostFfwNorm,
    /// Q, K and V as one matrix (an export's archive, `Manifest::fused_projections`).
    AttnQkv,
    AttnQkvBias,
    /// Gate and up as one matrix (an export's archive for the portable Vulkan profiles,
    /// `Manifest::fused_gate_up`).
    FfnGateUp,
}

impl LayerWeight {
    pub const ALL: [LayerWeight; 19] = [
        LayerWeight::AttnNorm,
        LayerWeight::AttnQ,
        LayerWeight::AttnK,
        LayerWeight::AttnV,
        LayerWeight::AttnQBias,
        LayerWeight::AttnKBias,
        LayerWeight::AttnVBias,
        LayerWeight::AttnQNorm,
        LayerWeight::AttnKNorm,
        LayerWeight::AttnOutput,
        LayerWeight::PostAttentionNorm,
        LayerWeight::FfnNorm,
        LayerWeight::FfnGate,
        LayerWeight::FfnUp,
        LayerWeight::FfnDown,
        LayerWeight::PostFfwNorm,
        LayerWeight::AttnQkv,
        LayerWeight::AttnQkvBias,
        LayerWeight::FfnGateUp,
    ];

    /// The GGUF suffix, e.g. `attn_q.weight`.
    pub fn suffix(self) -> &'static str {
        match self {
            LayerWeight::AttnNorm => "attn_norm.weight",
            LayerWeight::AttnQ => "attn_q.weight",
            LayerWeight::AttnK => "attn_k.weight",
            LayerWeight::AttnV => "attn_v.weight",
            LayerWeight::AttnQBias => "attn_q.bias",
            LayerWeight::AttnKBias => "attn_k.bias",
            LayerWeight::AttnVBias => "attn_v.bias",
            LayerWeight::AttnQNorm => "attn_q_norm.weight",
            LayerWeight::AttnKNorm => "attn_k_norm.weight",
            LayerWeight::AttnOutput => "attn_output.weight",
            LayerWeight::PostAttentionNorm => "post_attention_norm.weight",
            LayerWeight::FfnNorm => "ffn_norm.weight",
            LayerWeight::FfnGate => "ffn_gate.weight",
            LayerWeight::FfnUp => "ffn_up.weight",
            LayerWeight::FfnDown => "ffn_down.weight",
            LayerWeight::PostFfwNorm => "post_ffw_norm.weight",
            LayerWeight::AttnQkv => "attn_qkv.weight",
            LayerWeight::AttnQkvBias => "attn_qkv.bias",
            LayerWeight::FfnGateUp => "ffn_gate_up.weight",
        }
    }

    /// An RMS norm's weight (stored with Gemma's `1 + w` folded in).
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            LayerWeight::AttnNorm
                | LayerWeight::AttnQNorm
                | LayerWeight::AttnKNorm
                | LayerWeight::PostAttentionNorm
                | LayerWeight::FfnNorm
                | LayerWeight::PostFfwNorm
        )
    }
}

/// A weight of the model, by its archive name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Param {
    /// `token_embd.weight`: `[vocab, hidden]`, also the LM head of tied models.
    TokenEmbd,
    /// `output_norm.weight`: the final RMS norm.
    OutputNorm,
    /// `output.weight`: the LM head of untied models.
    Output,
    /// `blk.{layer}.{suffix}`.
    Layer(usize, LayerWeight),
}

impl Param {
    /// The layer of a per-layer weight.
    pub fn layer(self) -> Option<usize> {
        match self {
            Param::Layer(l, _) => Some(l),
            _ => None,
        }
    }

    /// What a per-layer weight is.
    pub fn weight(self) -> Option<LayerWeight> {
        match self {
            Param::Layer(_, w) => Some(w),
            _ => None,
        }
    }

    /// An RMS norm's weight.
    pub fn is_norm(self) -> bool {
        match self {
            Param::OutputNorm => true,
            Param::Layer(_, w) => w.is_norm(),
            Param::TokenEmbd | Param::Output => false,
        }
    }

    /// The archive entry of this weight's block scales, when it is quantized.
    pub fn scale_name(self) -> String {
        scale_name(&self.to_string())
    }
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Param::TokenEmbd => f.write_str("token_embd.weight"),
            Param::OutputNorm => f.write_str("output_norm.weight"),
            Param::Output => f.write_str("output.weight"),
            Param::Layer(l, w) => write!(f, "blk.{l}.{}", w.suffix()),
        }
    }
}

/// A string that is no [`Param`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a weight name of this runtime")]
pub struct UnknownParam(pub String);

impl FromStr for Param {
    type Err = UnknownParam;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || UnknownParam(s.to_string());
        match s {
            "token_embd.weight" => return Ok(Param::TokenEmbd),
            "output_norm.weight" => return Ok(Param::OutputNorm),
            "output.weight" => return Ok(Param::Output),
            _ => {}
        }
        let rest = s.strip_prefix("blk.").ok_or_else(unknown)?;
        let (digits, suffix) = rest.split_once('.').ok_or_else(unknown)?;
        let layer = digits
            .parse::<usize>()
            .ok()
            .filter(|n| n.to_string() == digits)
            .ok_or_else(unknown)?;
        let weight = LayerWeight::ALL
            .into_iter()
            .find(|w| w.suffix() == suffix)
            .ok_or_else(unknown)?;
        Ok(Param::Layer(layer, weight))
    }
}

/// One weight of the model: its archive name and shape (`[out, in]` for a matrix).
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

/// A fused parameter of an archive's table (`crate::params::fuse_projections`): its name, the
/// fused weight it is (which group: Q/K/V, gate/up) and its parts, in row order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedParam {
    pub name: String,
    pub weight: LayerWeight,
    pub parts: Vec<ParamInfo>,
}

/// The archive entry of the block scales of the quantized weight stored as `name`.
pub fn scale_name(name: &str) -> String {
    format!("{name}{SCALE_SUFFIX}")
}

/// The weight whose block scales are stored as `entry`, if it is a scales entry.
pub fn scaled_weight(entry: &str) -> Option<&str> {
    entry.strip_suffix(SCALE_SUFFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_and_only_its_spelling_parses() {
        let mut names = vec![Param::TokenEmbd, Param::OutputNorm, Param::Output];
        names.extend(LayerWeight::ALL.into_iter().map(|w| Param::Layer(17, w)));
        for p in names {
            assert_eq!(p.to_string().parse::<Param>(), Ok(p), "{p}");
        }
        assert_eq!(Param::Layer(3, LayerWeight::AttnQ).to_string(), "blk.3.attn_q.weight");
        assert_eq!(
            Param::Layer(3, LayerWeight::AttnQ).scale_name(),
            "blk.3.attn_q.weight.scale"
        );
        for bad in [
            "blk.03.attn_q.weight",
            "blk.+3.attn_q.weight",
            "blk.3.attn_q",
            "blk.attn_q.weight",
            "p0",
            "",
        ] {
            assert_eq!(bad.parse::<Param>(), Err(UnknownParam(bad.into())), "{bad}");
        }
        assert_eq!(scaled_weight("blk.1.ffn_up.weight.scale"), Some("blk.1.ffn_up.weight"));
        assert_eq!(scaled_weight("blk.1.ffn_up.weight"), None);
        assert!(Param::OutputNorm.is_norm() && !Param::Layer(0, LayerWeight::FfnUp).is_norm());
    }
}
