//! Parameters as the graph reads them: `util.global`s bound to the archive's entries, bf16 /
//! i16 / packed pairs of bf16 widened to f32, block-quantized values and scales (packed in `i32`
//! words for Vulkan) dequantized, and the embedding rows gathered.

use kv_core::param::Param;
use kv_core::quant::{scale_name, QuantFormat, ScaleType, BLOCK};

use super::{FuncEmitter, WeightFormat};
use crate::mlir::{Elem, Ty, V};

/// Quantized elements per `i32` word.
pub(super) fn per_word(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q8 => 4,
        QuantFormat::Q4 => 8,
    }
}

pub(super) fn symbol(name: &str) -> String {
    let mut s = String::from("w_");
    s.extend(name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }));
    s
}

impl FuncEmitter<'_> {
    /// The archive key of the canonical parameter `name` (the three-archive layout numbers them).
    pub(super) fn archive_key(&self, name: &str) -> String {
        self.options
            .keys
            .as_ref()
            .and_then(|k| k.get(name))
            .cloned()
            .unwrap_or_else(|| name.to_string())
    }

    /// The parameter as declared (bf16 or packed i32), loaded from its global.
    pub(super) fn load_raw(&mut self, name: &str) -> V {
        let info = self
            .table
            .get(name)
            .unwrap_or_else(|| kv_core::error::invariant(&format!("no parameter `{name}`")));
        let key = self.archive_key(name);
        let ty = match self.options.weights {
            WeightFormat::Bf16 => Ty::fixed(&info.shape, Elem::Bf16),
            WeightFormat::I16 => Ty::fixed(&info.shape, Elem::I16),
            WeightFormat::PackedI32 => {
                let mut dims = info.shape.clone();
                *dims.last_mut().unwrap() /= 2;
                Ty::fixed(&dims, Elem::I32)
            }
        };
        self.load_global(symbol(name), &key, ty)
    }

    /// bf16 (or packed pairs of bf16) widened exactly to f32.
    pub(super) fn widen(&mut self, raw: &V) -> V {
        match raw.ty.elem {
            Elem::Bf16 => self.b.convert(raw, Elem::F32),
            Elem::I16 => {
                // The sign extension fills bits 16..32, which the shift discards.
                let wide = self.b.convert(raw, Elem::I32);
                let sixteen = self.b.splat_i32(16, &wide.ty);
                let bits = self.b.binary("shift_left", &wide, &sixteen);
                self.b.bitcast(&bits, Elem::F32)
            }
            Elem::I32 => {
                let both = self.widen_pairs(raw);
                let mut full = raw.ty.static_dims();
                *full.last_mut().unwrap() *= 2;
                self.b.reshape_static(&both, &full)
            }
            other => kv_core::error::invariant(&format!("widen of {other:?}")),
        }
    }

    /// Packed pairs of bf16 `raw [.., w] i32` widened exactly to f32 `[.., w, 2]` (element `j`
    /// of word `i` at `[i, j]`, the low half first).
    pub(super) fn widen_pairs(&mut self, raw: &V) -> V {
        // Each word broadcast to its pair, the pair's element picked by an index: all
        // elementwise, so IREE fuses the widening into the op that reads it. Two halves
        // joined by a `concatenate` were four dispatches of their own per use (a norm's
        // weight at every layer: ~430 of the portable step's 1,077 dispatches).
        let dims = raw.ty.static_dims();
        let rank = dims.len();
        let mut pair_dims = dims.clone();
        pair_dims.push(2);
        let pair_ty = Ty::fixed(&pair_dims, Elem::I32);
        let keep: Vec<usize> = (0..rank).collect();
        let words = self.b.broadcast(raw, &keep, &pair_ty);
        let element = self.b.iota(&pair_dims, rank, Elem::I32);
        let zero = self.b.splat_i32(0, &pair_ty);
        let low = self.b.compare("EQ", &element, &zero);
        let sixteen = self.b.splat_i32(16, &pair_ty);
        let lo = self.b.binary("shift_left", &words, &sixteen);
        let himask = self.b.splat_i32(-65536, &pair_ty);
        let hi = self.b.binary("and", &words, &himask);
        let bits = self.b.select(&low, &lo, &hi);
        self.b.bitcast(&bits, Elem::F32)
    }

    pub(super) fn quant_format(&self, name: &str) -> Option<QuantFormat> {
        self.options.quantization.as_ref().and_then(|q| q.format_of(name))
    }

    /// The global of archive entry `key` (bound to parameter `sym_name`'s symbol) with type `ty`, loaded.
    pub(super) fn load_global(&mut self, sym: String, key: &str, ty: Ty) -> V {
        self.globals.entry(sym.clone()).or_insert_with(|| {
            format!(
                "util.global private @{sym} = #flow.parameter.named<\"{}\"::\"{key}\"> : {}",
                self.scope,
                ty.text()
            )
        });
        self.b
            .op(ty.clone(), format!("util.global.load @{sym} : {}", ty.text()))
    }

    /// A block-quantized `[out, in]` parameter, loaded: values `[out, in/32, 32]` (`i8`, `i4`)
    /// and scales `[out, in/32]` as the archive stores them (f32 or f16, `kv_core::quant`).
    pub(super) fn load_quant(&mut self, name: &str, format: QuantFormat) -> (V, V) {
        let info = self
            .table
            .get(name)
            .unwrap_or_else(|| kv_core::error::invariant(&format!("no parameter `{name}`")));
        let (out, inner) = (info.shape[0], info.shape[1]);
        let nb = inner / BLOCK;
        let key = self.archive_key(name);
        let q = if self.packed_quant() {
            let words = BLOCK / per_word(format);
            self.load_global(symbol(name), &key, Ty::fixed(&[out, nb, words], Elem::I32))
        } else {
            let elem = match format {
                QuantFormat::Q8 => Elem::I8,
                QuantFormat::Q4 => Elem::I4,
            };
            self.load_global(symbol(name), &key, Ty::fixed(&[out, nb, BLOCK], elem))
        };
        (q, self.load_scales(name))
    }

    /// The block scales `[out, in/32]` of quantized parameter `name`, as the archive stores them.
    pub(super) fn load_scales(&mut self, name: &str) -> V {
        let shape = &self.table[name].shape;
        let (out, nb) = (shape[0], shape[1] / BLOCK);
        let key = self.archive_key(name);
        let scale_elem = match self.options.quantization.as_ref().map(|q| q.scale_type) {
            Some(ScaleType::F16) => Elem::F16,
            _ => Elem::F32,
        };
        self.load_global(
            format!("{}_scale", symbol(name)),
            &scale_name(&key),
            Ty::fixed(&[out, nb], scale_elem),
        )
    }

    /// Scales `s` as f32: f16 ones widened (exactly) by a `convert` of their own, which IREE fuses
    /// into the dispatch that reads them as it does the values' widening. Not inside a
    /// contraction's body: there the widening ran per element, and a one-row q8 matvec took
    /// 1.2–1.6× as long as with f32 scales on this CPU (`host` and `generic`); as a producer it
    /// takes as long as f32 scales (one dispatch, reading the f16 tensor).
    pub(super) fn scales_f32(&mut self, s: &V) -> V {
        if s.ty.elem == Elem::F16 {
            self.b.convert(s, Elem::F32)
        } else {
            s.clone()
        }
    }

    /// Whether quantized values are declared as `i32` words: with the Vulkan weight formats
    /// ([`WeightFormat::PackedI32`], [`WeightFormat::I16`]), so no 8- or 4-bit type reaches the
    /// SPIR-V code generator; the CPU's ([`WeightFormat::Bf16`]) declares `i8` / `i4`.
    pub(super) fn packed_quant(&self) -> bool {
        self.options.weights != WeightFormat::Bf16
    }

    /// Words `q [.., W] i32` of `format`'s values, unpacked (element `j` of word `w` is element
    /// `w·E + j`): `[.., W·E]` as f32, with i32 shifts only.
    pub(super) fn unpack_words(&mut self, q: &V, format: QuantFormat) -> V {
        let e = per_word(format);
        let bits = (32 / e) as i32;
        let mut dims = q.ty.static_dims();
        let rank = dims.len();
        dims.push(e);
        let wide = Ty::fixed(&dims, Elem::I32);
        let keep: Vec<usize> = (0..rank).collect();
        let words = self.b.broadcast(q, &keep, &wide);
        let j = self.b.iota(&dims, rank, Elem::I32);
        let step = self.b.splat_i32(bits, &wide);
        let top = self.b.splat_i32(32 - bits, &wide);
        let sh = self.b.mul(&j, &step);
        let left = self.b.sub(&top, &sh);
        let up = self.b.binary("shift_left", &words, &left);
        let v = self.b.binary("shift_right_arithmetic", &up, &top);
        let f = self.b.convert(&v, Elem::F32);
        let mut flat = q.ty.static_dims();
        *flat.last_mut().unwrap() *= e;
        self.b.reshape_static(&f, &flat)
    }

    /// `f32(q) * scale` of values `q [.., nb, 32]` and scales `s [.., nb]`: elementwise from a
    /// narrower type with the scales broadcast from a lower rank, so IREE clones it into every
    /// consumer dispatch instead of materialising it (a "bit-extend" op).
    pub(super) fn dequant_blocks(&mut self, q: &V, s: &V) -> V {
        let wide = if q.ty.elem == Elem::I32 {
            let format = if q.ty.static_dims().last() == Some(&(BLOCK / 4)) {
                QuantFormat::Q8
            } else {
                QuantFormat::Q4
            };
            self.unpack_words(q, format)
        } else {
            self.b.convert(q, Elem::F32)
        };
        let s = self.scales_f32(s);
        let keep: Vec<usize> = (0..s.ty.rank()).collect();
        let sb = self.b.broadcast(&s, &keep, &wide.ty);
        self.b.mul(&wide, &sb)
    }

    /// The dequantized `[out, in/32, 32]` f32 weight of a quantized parameter (once per function).
    pub(super) fn quant_param(&mut self, name: &str, format: QuantFormat) -> V {
        let key = format!("{name}#dequant");
        if let Some(v) = self.loaded.get(&key) {
            return v.clone();
        }
        let (q, s) = self.load_quant(name, format);
        let w = self.dequant_blocks(&q, &s);
        self.loaded.insert(key, w.clone());
        w
    }

    pub(super) fn param(&mut self, name: &str) -> V {
        if let Some(v) = self.loaded.get(name) {
            return v.clone();
        }
        if let Some(format) = self.quant_format(name) {
            // Only the projections read quantized parameters ([`Self::proj`]); a plain use gets
            // the whole dequantized matrix.
            let w = self.quant_param(name, format);
            let info = &self.table[name];
            let dims = info.shape.clone();
            let v = self.b.reshape_static(&w, &dims);
            self.loaded.insert(name.to_string(), v.clone());
            return v;
        }
        let raw = self.load_raw(name);
        let v = self.widen(&raw);
        self.loaded.insert(name.to_string(), v.clone());
        v
    }

    /// The parameter as declared, loaded once per function.
    pub(super) fn raw_param(&mut self, name: &str) -> V {
        let key = format!("{name}#raw");
        if let Some(v) = self.loaded.get(&key) {
            return v.clone();
        }
        let v = self.load_raw(name);
        self.loaded.insert(key, v.clone());
        v
    }

    /// The embedding rows of `tokens [n] i32`, f32 `[n, hidden]`, gathered in the graph.
    pub(super) fn embedding_rows(&mut self, tokens: &V) -> V {
        let table = Param::TokenEmbd.to_string();
        match self.quant_format(&table) {
            None => {
                let raw = self.load_raw(&table);
                let rows_raw = self.b.gather_rows(&raw, tokens);
                self.widen(&rows_raw)
            }
            Some(format) => {
                let (q, s) = self.load_quant(&table, format);
                let [vocab, nb, blk] = q.ty.static_dims()[..] else {
                    kv_core::error::invariant("quantized values are [out, nb, 32]")
                };
                let n = tokens.ty.static_dims()[0];
                let q2 = self.b.reshape_static(&q, &[vocab, nb * blk]);
                let rows_q = self.b.gather_rows(&q2, tokens);
                let rows_q = self.b.reshape_static(&rows_q, &[n, nb, blk]);
                // (words when packed: `blk` is then the words per block)
                let rows_s = self.b.gather_rows(&s, tokens);
                let rows = self.dequant_blocks(&rows_q, &rows_s);
                self.b.reshape_static(&rows, &[n, nb * BLOCK])
            }
        }
    }

    pub(super) fn embed_scale(&mut self, emb: &V) -> V {
        if self.arch.embed_scale == 1.0 {
            emb.clone()
        } else {
            self.b.scale(emb, self.arch.embed_scale)
        }
    }
}
