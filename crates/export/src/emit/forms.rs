//! Each fused form alone: a module of one function `@form` that runs one of the emitter's forms
//! on its arguments, weights included (they are seeded into the emitter's loaded parameters, so
//! no archive is needed), for `tests/forms.rs` to compile for the CPU and compare with a plain
//! computation. Test support, not the exporter's API: reached through `export::testing`.
//!
//! The forms configured for a tuned GPU carry IREE's SPIR-V `compilation_info`, which IREE's CPU
//! backend refuses ("'func.func' op missing subgroup size"); [`emit_form`] drops those
//! attributes, which only schedule a dispatch and leave its arithmetic as it is.

use std::collections::{BTreeMap, HashMap};

use kv_core::param::{LayerWeight, Param};
use kv_core::{Activation, Architecture, KvSpec, Manifest};

use super::layer::Residual;
use super::products::{pair_splits, PAIR_LANES};
use super::{EmitOptions, FuncEmitter, WeightFormat};
use crate::mlir::{Elem, Ty, V};
use crate::profile::GpuTuning;

/// The RMS norms' epsilon in every form.
pub const RMS_EPS: f32 = 1e-6;

/// A fused form and the sizes to emit it at. Each variant lists the function's arguments, in
/// order, and its results.
#[derive(Clone, Copy, Debug)]
pub enum Form {
    /// `rmsnorm(x [rows, n], w [n])`, the factor in one reduction (`rms_factor`) or, with
    /// `parallel` (as for packed weights over few rows), in runs of 32 then across the runs
    /// (`rms_factor_parallel`; `n` a multiple of 32 above 32). Result `[rows, n]`.
    RmsNorm { rows: usize, n: usize, parallel: bool },
    /// `rmsnorm(x [1, n], norm [n]) · Wᵢᵀ` for `weights` i16 weights `Wᵢ [out, n]` (bf16 bits), the
    /// norm's sum of squares taken in the products' dispatch (`normed_products`). Arguments `x`,
    /// `norm`, then the weights; results `weights` × `[1, out]`.
    NormedProducts { n: usize, out: usize, weights: usize },
    /// [`Form::NormedProducts`] of a residual stream whose post-norm addition is pending:
    /// `h = x + rmsnorm(d, post)`, never written out. Arguments `x [1, n]`, `d [1, n]`,
    /// `post [n]`, `norm [n]`, then the weights `[out, n]` i16 (`out ≥ n`); results as there.
    CarriedNormedProducts { n: usize, out: usize, weights: usize },
    /// `x [1, inner] · Wᵀ` (`W [n, inner]` i16) and the stream `base + rmsnorm(d, post)` written
    /// out in the same dispatch (`proj_settling`). Arguments `x`, `W`, `base [1, n]`, `d [1, n]`,
    /// `post [n]`; results the product and the stream, `[1, n]` each.
    ProductSettling { n: usize, inner: usize },
    /// `x [rows, inner] · (q · s)ᵀ` of q4 blocks, dequantized in the contraction's body
    /// (`Body::block_contract_q`: the CPU's one-row q4 form without our kernel, and any row
    /// count's without fused dequantization). Arguments `x`, `q [out, inner/32,
    /// 32]` as i8 in `-8..8` (made i4 before the form), `s [out, inner/32]` f32; result
    /// `[rows, out]`.
    Q4Product { rows: usize, out: usize, inner: usize },
    /// The same product over q4 blocks packed in `i32` words (`Body::block_contract_words`, the
    /// Vulkan targets' form): `q [out, inner/32, 4]` i32, element `j` of a word in its bits
    /// `4j .. 4j + 4`, two's complement.
    Q4WordsProduct { rows: usize, out: usize, inner: usize },
    /// `x [rows, inner] · Wᵀ` of i16 weights `w [out, inner]` (bf16 bits), each widened in the
    /// contraction's body (`Body::contract_i16`: the i16 weight format's products). Result
    /// `[rows, out]`.
    ContractI16 { rows: usize, out: usize, inner: usize },
    /// The one-row form of the same product, `x [1, inner] · Wᵀ`, one reduction over `(out,
    /// in)` with NVIDIA's configuration (`Body::row_contract_i16`: the tuned GPUs' LM head).
    /// Result `[1, out]`.
    RowContractI16 { out: usize, inner: usize },
    /// A one-row attention product over a cache head with NVIDIA's configuration
    /// (`Body::configured_product`): with `scores`, `a [g, d] · cᵀ` of keys `c [rows, d]`,
    /// `[g, rows]`; else `a [g, rows] · c` of values `c [rows, d]`, `[g, d]`.
    ConfiguredProduct {
        g: usize,
        rows: usize,
        d: usize,
        scores: bool,
    },
    /// Contract v2's products of every KV head against a cache `c [rows, nkv, d]`
    /// (`kv_product`, a `dot_general` or with `by_reduce` a broadcast product reduced): with
    /// `scores`, queries `a [nkv, q, d]` against the keys, `[nkv, q, rows]`; else probabilities
    /// `a [nkv, q, rows]` against the values, `[nkv, q, d]`.
    KvProduct {
        nkv: usize,
        q: usize,
        rows: usize,
        d: usize,
        scores: bool,
        by_reduce: bool,
    },
    /// `x [rows, inner] · Wᵀ` of bf16 pairs packed in words, `w [out, inner/2]` i32 (element `2k`
    /// in the low half of word `k`), read in place in runs (`Body::contract_pairs_split`, as the
    /// portable Vulkan target's step does). Result `[rows, out]`.
    PairsProduct { rows: usize, out: usize, inner: usize },
    /// The gate and up products of one packed matrix `w [2·ff, inner/2]` i32 (gate's rows,
    /// then up's), each half's runs summed in one second reduction of two results
    /// (`Body::contract_pairs_gated`, the portable step's fused gate/up). Results the gate and
    /// the up product, `[rows, ff]` each.
    GatedPairsProduct { rows: usize, ff: usize, inner: usize },
    /// The same product with the words interleaved over [`PAIR_LANES`] lanes, then the lanes
    /// summed (`Body::contract_pairs_lanes`: the portable LM head, too wide to split into runs).
    /// `inner/2` a multiple of the lanes. Result `[rows, out]`.
    PairsProductLanes { rows: usize, out: usize, inner: usize },
    /// `rmsnorm(x [rows, n], w)` of a norm weight packed in pairs, `w [n/2]` i32 (element `2k` in
    /// the low half of word `k`), widened where the norm reads it (`widen`'s broadcast and
    /// select, fused into its reader). Result `[rows, n]`.
    PackedNorm { rows: usize, n: usize },
    /// A one-row attention product over a cache head in two reductions, for targets without
    /// subgroup operations (`mul_reduce_split`): with `scores`, `a [g, d] · cᵀ` of keys
    /// `c [p, d]` (`[g, p]`: the head dimension in 16 interleaved lanes where `g·p·16` is at
    /// most `PAIR_THREADS`); else `a [g, p] · c` of values `c [p, d]` (`[g, d]`: the keys in
    /// runs of `key_runs(g·d, p)`).
    SplitProduct { g: usize, p: usize, d: usize, scores: bool },
    /// One softmax over the keys of `sc [q, p]` (the cache's) and `sn [q, r]` (the call's), the
    /// cache's reduced in tiles of 64 keys with `tiled` (`softmax_split`). Results the two
    /// blocks of probabilities.
    SoftmaxSplit { q: usize, p: usize, r: usize, tiled: bool },
    /// One query row's attention over a cache head (`attention_row`, NVIDIA's one-row form):
    /// scores `sc [g, p]`, `sn [g, 1]`, values `vc [p, d]`, `vn [1, d]`; result `[g, d]`.
    AttentionRow { g: usize, p: usize, d: usize },
    /// One query row's attention for targets without subgroup operations
    /// (`attention_row_online`): the scores of KV head `head` of the cache and of the call's own
    /// row in lanes, the cache's keys in runs with an online softmax, the runs merged from the
    /// own row. Arguments `q [g, d]`, keys `kc [p, nkv, d]`, `kn [1, nkv, d]`, that
    /// head's values `vc [p, d]`, `vn [1, d]`, and the cache's mask `[g, p]` as i32 (0:
    /// masked); result `[g, d]`.
    AttentionRowOnline {
        g: usize,
        p: usize,
        d: usize,
        nkv: usize,
        head: usize,
    },
    /// `rope(rmsnorm(x, w))` of `x [rows, heads, d]` per head (Gemma's Q/K norms), the norm's
    /// factor applied after the rotation (`norm_rope`). Arguments `x`, `w [d]`, `cos [rows, d]`,
    /// `sin [rows, d]` (the rotation is `x·cos + swap_halves(x)·sin`); result `[rows, heads, d]`.
    NormRope { rows: usize, heads: usize, d: usize },
    /// The Q/K norms, rotation and query scale (`1/√d`, Gemma 3's) over a fused Q/K/V product
    /// `y [rows, nh + 2·nkv, d]` in one expression (`qkv_norm_rope`): query heads normed by
    /// `qw [d]`, rotated and scaled, key heads normed by `kw [d]` and rotated, value heads passed
    /// through. Arguments `y`, `qw`, `kw`, `cos [rows, d]`, `sin [rows, d]`; result as `y`. With
    /// `split` (`EmitOptions::split_reductions`) the norms' factor per element, in runs of 32
    /// then across them (`rms_factor_parallel`; `d` a multiple of 32 above 32).
    QkvNormRope {
        rows: usize,
        nh: usize,
        nkv: usize,
        d: usize,
        split: bool,
    },
    /// [`Form::QkvNormRope`] with `split` and the norm weights packed in pairs (the portable
    /// profile's): `qw`, `kw` `[d/2]` i32, the swapped halves taken as words. The factor is
    /// shaped as the widened pairs (`rms_factor_parallel_as`; `d` a multiple of 32 above 32).
    QkvNormRopePacked {
        rows: usize,
        nh: usize,
        nkv: usize,
        d: usize,
    },
    /// A residual stream with a post-norm addition pending, settled and normed by the next norm
    /// in one pass of sums (`carried_norm`, the portable profiles'): `h = x + rmsnorm(d, post)`
    /// and `rmsnorm(h, norm)`. Arguments `x`, `d` `[rows, n]`, `post`, `norm` packed words
    /// `[n/2]` i32 (`n` a multiple of 32 above 32); results `h` and the norm, `[rows, n]` each.
    CarriedNorm { rows: usize, n: usize },
    /// The feed-forward gate `activation(g [rows, n])`: gelu-tanh or silu. Result `[rows, n]`.
    Gate {
        activation: Activation,
        rows: usize,
        n: usize,
    },
}

/// The MLIR module of `form` alone: `@form` in `module @module`.
pub fn emit_form(form: Form) -> String {
    let mut spec = KvSpec::default();
    if let Form::QkvNormRope { nh, nkv, d, .. } | Form::QkvNormRopePacked { nh, nkv, d, .. } = form {
        (spec.n_heads, spec.n_kv_heads, spec.head_dim) = (nh, nkv, d);
    }
    let arch = Architecture {
        rms_eps: RMS_EPS,
        ..Architecture::gemma3(&spec, 4 * spec.hidden_size)
    };
    let manifest = Manifest::new(spec.clone(), Some(arch.clone()), "form");
    let weights = match form {
        Form::RmsNorm { parallel: true, .. }
        | Form::PairsProduct { .. }
        | Form::GatedPairsProduct { .. }
        | Form::PairsProductLanes { .. }
        | Form::PackedNorm { .. }
        | Form::QkvNormRopePacked { .. }
        | Form::CarriedNorm { .. } => WeightFormat::PackedI32,
        Form::RmsNorm { parallel: false, .. } => WeightFormat::Bf16,
        _ => WeightFormat::I16,
    };
    // The forms for targets without subgroup operations are emitted as for the portable
    // profiles: reductions split, no tuned family.
    let split = matches!(
        form,
        Form::SplitProduct { .. }
            | Form::QkvNormRope { split: true, .. }
            | Form::QkvNormRopePacked { .. }
            | Form::PairsProductLanes { .. }
            | Form::AttentionRowOnline { .. }
            | Form::CarriedNorm { .. }
    );
    let options = EmitOptions {
        weights,
        tuning: (!split).then_some(GpuTuning::NVIDIA),
        tiled_softmax: matches!(
            form,
            Form::SoftmaxSplit { tiled: true, .. } | Form::AttentionRowOnline { .. }
        ),
        split_reductions: split,
        ..EmitOptions::default()
    };
    let table = HashMap::new();
    let mut globals = BTreeMap::new();
    let mut f = FuncEmitter::new(&spec, None, &arch, &options, &table, &manifest, true, &mut globals);
    let mut args: Vec<V> = Vec::new();
    let mut arg = |dims: &[usize], elem: Elem| {
        let v = V {
            name: format!("%arg{}", args.len()),
            ty: Ty::fixed(dims, elem),
        };
        args.push(v.clone());
        v
    };
    let results: Vec<V> = match form {
        Form::RmsNorm { rows, n, .. } => {
            let x = arg(&[rows, n], Elem::F32);
            let w = arg(&[n], Elem::F32);
            vec![f.rmsnorm(&x, &w)]
        }
        Form::NormedProducts { n, out, weights } | Form::CarriedNormedProducts { n, out, weights } => {
            let carried = matches!(form, Form::CarriedNormedProducts { .. });
            let x = arg(&[1, n], Elem::F32);
            let residual = if carried {
                let d = arg(&[1, n], Elem::F32);
                f.loaded.insert("post".into(), arg(&[n], Elem::F32));
                Residual {
                    base: x,
                    pending: Some((d, "post".into())),
                }
            } else {
                Residual::settled(x)
            };
            f.loaded.insert("norm".into(), arg(&[n], Elem::F32));
            let names: Vec<String> = (0..weights).map(|i| format!("w{i}")).collect();
            for name in &names {
                f.loaded.insert(format!("{name}#raw"), arg(&[out, n], Elem::I16));
            }
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            f.normed_products(&residual, "norm", &names)
                .unwrap_or_else(|| panic!("{form:?}: the normed products do not apply"))
        }
        Form::ProductSettling { n, inner } => {
            let x = arg(&[1, inner], Elem::F32);
            f.loaded.insert("w#raw".into(), arg(&[n, inner], Elem::I16));
            let base = arg(&[1, n], Elem::F32);
            let d = arg(&[1, n], Elem::F32);
            f.loaded.insert("post".into(), arg(&[n], Elem::F32));
            let residual = Residual {
                base,
                pending: Some((d, "post".into())),
            };
            let (product, stream) = f.proj_settling(&x, "w", &residual);
            vec![product, stream]
        }
        Form::Q4Product { rows, out, inner } => {
            let x = arg(&[rows, inner], Elem::F32);
            let q = arg(&[out, inner / 32, 32], Elem::I8);
            let s = arg(&[out, inner / 32], Elem::F32);
            let q = f.b.convert(&q, Elem::I4);
            let x3 = f.b.reshape_static(&x, &[rows, inner / 32, 32]);
            vec![f.b.block_contract_q(&x3, &q, &s)]
        }
        Form::Q4WordsProduct { rows, out, inner } => {
            let x = arg(&[rows, inner], Elem::F32);
            let q = arg(&[out, inner / 32, 4], Elem::I32);
            let s = arg(&[out, inner / 32], Elem::F32);
            let x4 = f.b.reshape_static(&x, &[rows, inner / 32, 4, 8]);
            vec![f.b.block_contract_words(&x4, &q, &s, 4)]
        }
        Form::ContractI16 { rows, out, inner } => {
            let x = arg(&[rows, inner], Elem::F32);
            let w = arg(&[out, inner], Elem::I16);
            vec![f.b.contract_i16(&x, &w)]
        }
        Form::RowContractI16 { out, inner } => {
            let x = arg(&[1, inner], Elem::F32);
            let w = arg(&[out, inner], Elem::I16);
            let info = GpuTuning::NVIDIA.head.compilation_info(inner);
            vec![f.b.row_contract_i16(&x, &w, &info)]
        }
        Form::ConfiguredProduct { g, rows, d, scores } => {
            let a = arg(&[g, if scores { d } else { rows }], Elem::F32);
            let c = arg(&[rows, d], Elem::F32);
            let config = GpuTuning::NVIDIA.attention;
            let info = if scores {
                config.info(config.keys, d)
            } else {
                config.info(config.outputs, rows)
            };
            vec![f.b.configured_product(&a, &c, scores, &info)]
        }
        Form::KvProduct {
            nkv,
            q,
            rows,
            d,
            scores,
            by_reduce,
        } => {
            let a = arg(&[nkv, q, if scores { d } else { rows }], Elem::F32);
            let c = arg(&[rows, nkv, d], Elem::F32);
            vec![f.kv_product(&a, &c, scores, by_reduce)]
        }
        Form::PairsProduct { rows, out, inner } => {
            let x = arg(&[rows, inner], Elem::F32);
            let w = arg(&[out, inner / 2], Elem::I32);
            vec![f.b.contract_pairs_split(&x, &w, pair_splits(out, inner / 2))]
        }
        Form::GatedPairsProduct { rows, ff, inner } => {
            let x = arg(&[rows, inner], Elem::F32);
            let w = arg(&[2 * ff, inner / 2], Elem::I32);
            let (gate, up) = f.b.contract_pairs_gated(&x, &w, pair_splits(ff, inner / 2));
            vec![gate, up]
        }
        Form::PairsProductLanes { rows, out, inner } => {
            let x = arg(&[rows, inner], Elem::F32);
            let w = arg(&[out, inner / 2], Elem::I32);
            vec![f.b.contract_pairs_lanes(&x, &w, PAIR_LANES)]
        }
        Form::PackedNorm { rows, n } => {
            let x = arg(&[rows, n], Elem::F32);
            let raw = arg(&[n / 2], Elem::I32);
            vec![f.rmsnorm_pairs(&x, &raw)]
        }
        Form::SplitProduct { g, p, d, scores } => {
            let a = arg(&[g, if scores { d } else { p }], Elem::F32);
            let c = arg(&[p, d], Elem::F32);
            vec![f.mul_reduce_split(&a, &c, if scores { 2 } else { 1 })]
        }
        Form::SoftmaxSplit { q, p, r, tiled } => {
            let sc = arg(&[q, p], Elem::F32);
            let sn = arg(&[q, r], Elem::F32);
            let (pc, pn) = f.softmax_split(&sc, &sn, tiled);
            vec![pc, pn]
        }
        Form::AttentionRow { g, p, d } => {
            let sc = arg(&[g, p], Elem::F32);
            let sn = arg(&[g, 1], Elem::F32);
            let vc = arg(&[p, d], Elem::F32);
            let vn = arg(&[1, d], Elem::F32);
            vec![f.attention_row(&sc, &sn, &vc, &vn, GpuTuning::NVIDIA.attention)]
        }
        Form::AttentionRowOnline { g, p, d, nkv, head } => {
            let q = arg(&[g, d], Elem::F32);
            let kc = arg(&[p, nkv, d], Elem::F32);
            let kn = arg(&[1, nkv, d], Elem::F32);
            let vc = arg(&[p, d], Elem::F32);
            let vn = arg(&[1, d], Elem::F32);
            let mask = arg(&[g, p], Elem::I32);
            let zero = f.b.splat_i32(0, &mask.ty);
            let mask = f.b.compare("NE", &mask, &zero);
            vec![f
                .attention_row_online(&q, (&kc, &kn, head), (&vc, &vn), &mask)
                .unwrap_or_else(|| panic!("{form:?}: does not apply"))]
        }
        Form::NormRope { rows, heads, d } => {
            let x = arg(&[rows, heads, d], Elem::F32);
            f.loaded.insert("w".into(), arg(&[d], Elem::F32));
            let cos = arg(&[rows, d], Elem::F32);
            let sin = arg(&[rows, d], Elem::F32);
            vec![f.norm_rope(&x, "w", &cos, &sin)]
        }
        Form::QkvNormRope { rows, nh, nkv, d, .. } => {
            let y = arg(&[rows, nh + 2 * nkv, d], Elem::F32);
            f.loaded.insert(
                Param::Layer(0, LayerWeight::AttnQNorm).to_string(),
                arg(&[d], Elem::F32),
            );
            f.loaded.insert(
                Param::Layer(0, LayerWeight::AttnKNorm).to_string(),
                arg(&[d], Elem::F32),
            );
            let cos = arg(&[rows, d], Elem::F32);
            let sin = arg(&[rows, d], Elem::F32);
            vec![f.qkv_norm_rope(&y, 0, &cos, &sin)]
        }
        Form::QkvNormRopePacked { rows, nh, nkv, d } => {
            let y = arg(&[rows, nh + 2 * nkv, d], Elem::F32);
            for weight in [LayerWeight::AttnQNorm, LayerWeight::AttnKNorm] {
                let name = Param::Layer(0, weight).to_string();
                let raw = arg(&[d / 2], Elem::I32);
                let wide = f.widen(&raw);
                f.loaded.insert(format!("{name}#raw"), raw);
                f.loaded.insert(name, wide);
            }
            let cos = arg(&[rows, d], Elem::F32);
            let sin = arg(&[rows, d], Elem::F32);
            vec![f.qkv_norm_rope(&y, 0, &cos, &sin)]
        }
        Form::CarriedNorm { rows, n } => {
            let x = arg(&[rows, n], Elem::F32);
            let d = arg(&[rows, n], Elem::F32);
            f.loaded.insert("post#raw".into(), arg(&[n / 2], Elem::I32));
            f.loaded.insert("norm#raw".into(), arg(&[n / 2], Elem::I32));
            let residual = Residual {
                base: x,
                pending: Some((d, "post".into())),
            };
            let (h, normed) = f
                .carried_norm(&residual, "norm")
                .unwrap_or_else(|| panic!("{form:?}: does not apply"));
            vec![h, normed]
        }
        Form::Gate { activation, rows, n } => {
            let g = arg(&[rows, n], Elem::F32);
            vec![match activation {
                Activation::GeluTanh => f.gelu_tanh(&g),
                Activation::Silu => f.silu(&g),
            }]
        }
    };
    let body = std::mem::take(&mut f.b).finish();
    let sig: Vec<String> = args.iter().map(|a| format!("{}: {}", a.name, a.ty.text())).collect();
    let names: Vec<&str> = results.iter().map(|r| r.name.as_str()).collect();
    let types: Vec<String> = results.iter().map(|r| r.ty.text()).collect();
    let text = format!(
        "module @module {{\n  func.func @form({}) -> ({}) {{\n{body}    return {} : {}\n  }}\n}}\n",
        sig.join(", "),
        types.join(", "),
        names.join(", "),
        types.join(", ")
    );
    without_compilation_info(&text)
}

/// `text` without its ` attrs = {compilation_info = …}` (whose text holds no braces).
fn without_compilation_info(text: &str) -> String {
    const ATTRS: &str = " attrs = {compilation_info = ";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(ATTRS) {
        out.push_str(&rest[..i]);
        let end = rest[i..]
            .find('}')
            .unwrap_or_else(|| kv_core::error::invariant("an attribute dictionary is closed"));
        rest = &rest[i + end + 1..];
    }
    out.push_str(rest);
    out
}
