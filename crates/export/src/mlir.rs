//! A small typed builder for StableHLO in MLIR's generic-free "pretty" text form.
//!
//! Every value carries its type, and every dynamic dimension carries the SSA name of a
//! `tensor<1xi32>` that holds its runtime size, so broadcasts over a dynamic length can build their
//! shape operand without re-deriving it. Helpers pick the static op when all shapes are static and
//! the `dynamic_*` op otherwise (IREE 3.13 rejects a `stablehlo.reshape` to a dynamic shape, so a
//! unit dimension of a dynamic tensor is removed with a one-term reduce instead).
//!
//! The hand-written MLIR of the fused forms (their `linalg.generic` bodies, the argmax's reducer)
//! is in `kernels/mlir/*.mlir`, filled by [`crate::templates`]; this file builds the ops around them.

use std::fmt::Write as _;

use crate::templates;

/// One dimension: static, or dynamic with the SSA name of its `tensor<1xi32>` size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    S(usize),
    D(String),
}

impl Dim {
    pub fn is_static(&self) -> bool {
        matches!(self, Dim::S(_))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    I32,
    I16,
    Bf16,
    I1,
    I8,
    I4,
}

impl Elem {
    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::I32 => "i32",
            Elem::I16 => "i16",
            Elem::Bf16 => "bf16",
            Elem::I1 => "i1",
            Elem::I8 => "i8",
            Elem::I4 => "i4",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ty {
    pub dims: Vec<Dim>,
    pub elem: Elem,
}

impl Ty {
    pub fn new(dims: Vec<Dim>, elem: Elem) -> Self {
        Ty { dims, elem }
    }
    pub fn fixed(dims: &[usize], elem: Elem) -> Self {
        Ty {
            dims: dims.iter().map(|&d| Dim::S(d)).collect(),
            elem,
        }
    }
    pub fn rank(&self) -> usize {
        self.dims.len()
    }
    pub fn is_static(&self) -> bool {
        self.dims.iter().all(Dim::is_static)
    }
    pub fn static_dims(&self) -> Vec<usize> {
        self.dims
            .iter()
            .map(|d| match d {
                Dim::S(n) => *n,
                Dim::D(_) => panic!("static_dims on a dynamic type"),
            })
            .collect()
    }
    pub fn with_elem(&self, elem: Elem) -> Ty {
        Ty {
            dims: self.dims.clone(),
            elem,
        }
    }
    /// The MLIR spelling, e.g. `tensor<1x2x?x16xf32>`.
    pub fn text(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            match d {
                Dim::S(n) => write!(s, "{n}x").unwrap(),
                Dim::D(_) => s.push_str("?x"),
            }
        }
        s.push_str(self.elem.name());
        s.push('>');
        s
    }
}

/// An SSA value with its type.
#[derive(Clone, Debug)]
pub struct V {
    pub name: String,
    pub ty: Ty,
}

/// Reduction bodies of [`Body::reduce`].
#[derive(Clone, Copy, Debug)]
pub enum Reduce {
    Add,
    Max,
}

/// The instructions of one function body.
#[derive(Default)]
pub struct Body {
    text: String,
    next: usize,
}

fn list(xs: &[usize]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// The tail of an `array<i64...>` literal: `: 1, 2` (empty for no elements).
fn i64_list(xs: &[usize]) -> String {
    if xs.is_empty() {
        String::new()
    } else {
        format!(": {}", list(xs))
    }
}

/// The number of tiles of a two-stage argmax over `n` values: a divisor of `n` at most `√n`
/// and at least half of it where there is one (no padding), else `√n` rounded (the last tile
/// padded); 1 (one reduce) below 64 values. `√n` balances the two stages.
pub fn argmax_tiles(n: usize) -> usize {
    if n < 64 {
        return 1;
    }
    let root = (n as f64).sqrt().round() as usize;
    (root.div_ceil(2)..=root).rev().find(|t| n % t == 0).unwrap_or(root)
}

/// The stages [`Body::argmax_rows`] reduces a row of `n` values in (their product covers `n`):
/// one below 64 values, two ([`argmax_tiles`] tiles) below 32768, else three of about `∛n`
/// each, exact divisors where there are some near the root (Gemma's 262144: 64 × 64 × 64,
/// SmolLM2's 49152: 32 × 32 × 48). On Vulkan a stage costs about its length in dependent loads
/// of one thread, so three short stages beat two long ones over a large vocabulary.
pub fn argmax_stages(n: usize) -> Vec<usize> {
    if n < 64 {
        return vec![n];
    }
    if n < 32_768 {
        let t = argmax_tiles(n);
        return vec![t, n.div_ceil(t)];
    }
    let root = (n as f64).cbrt().round() as usize;
    let first = (root.div_ceil(2)..=root).rev().find(|t| n % t == 0).unwrap_or(root);
    let rest = n.div_ceil(first);
    let second = argmax_tiles(rest);
    vec![first, second, rest.div_ceil(second)]
}

/// Stages of `width` values (the last one what is left, padded up) whose product covers `n`:
/// Gemma's 262144 in stages of 16 is 16 × 16 × 16 × 16 × 4. On the H200 over Vulkan the
/// five stages of 16 took 95 µs of the decode step's GPU time where [`argmax_stages`]' three of
/// 64 took 188 (28 against 44 µs alone; docs/journal, session 17): each stage's threads
/// run their loop serially, so short loops over many threads win while a dispatch costs a few
/// µs.
pub fn argmax_stages_of_width(n: usize, width: usize) -> Vec<usize> {
    assert!(width >= 2, "argmax stages of {width} values never end");
    let mut stages = Vec::new();
    let mut left = n;
    while left > width {
        stages.push(width);
        left = left.div_ceil(width);
    }
    stages.push(left.max(1));
    stages
}

/// `f32` as an exact MLIR hex literal.
pub fn f32_hex(x: f32) -> String {
    format!("0x{:08X}", x.to_bits())
}

/// The running maximum's start in [`Body::online_exp_values`]: below every score (a masked one is
/// `kv_core::mask::MASKED`, -1e30) yet finite, so that `e^(start - m)` is 0, never a NaN.
const ONLINE_MAX_INIT: &str = "-3.000000e+38";

/// `kv_core::mask::MASKED` as an MLIR float literal, for the masks applied inside a body.
const MASKED_LITERAL: &str = "-1.000000e+30";

impl Body {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn finish(self) -> String {
        self.text
    }

    pub(crate) fn fresh(&mut self) -> String {
        self.next += 1;
        format!("%v{}", self.next)
    }

    /// Appends `%vN = rhs` and returns the value.
    pub fn op(&mut self, ty: Ty, rhs: impl AsRef<str>) -> V {
        let name = self.fresh();
        writeln!(self.text, "    {name} = {}", rhs.as_ref()).unwrap();
        V { name, ty }
    }

    pub fn line(&mut self, text: impl AsRef<str>) {
        writeln!(self.text, "    {}", text.as_ref()).unwrap();
    }

    // ---- constants -------------------------------------------------------------------------

    pub fn scalar_f32(&mut self, x: f32) -> V {
        let ty = Ty::fixed(&[], Elem::F32);
        self.op(
            ty.clone(),
            format!("stablehlo.constant dense<{}> : {}", f32_hex(x), ty.text()),
        )
    }

    pub fn scalar_i32(&mut self, x: i32) -> V {
        let ty = Ty::fixed(&[], Elem::I32);
        self.op(ty.clone(), format!("stablehlo.constant dense<{x}> : {}", ty.text()))
    }

    /// A static f32 tensor from row-major values, as one exact hex blob.
    pub fn const_f32(&mut self, dims: &[usize], values: &[f32]) -> V {
        assert_eq!(
            dims.iter().product::<usize>(),
            values.len(),
            "const_f32: shape and data disagree"
        );
        let ty = Ty::fixed(dims, Elem::F32);
        let mut hex = String::with_capacity(values.len() * 8 + 4);
        hex.push_str("0x");
        for v in values {
            for b in v.to_le_bytes() {
                write!(hex, "{b:02X}").unwrap();
            }
        }
        self.op(
            ty.clone(),
            format!("stablehlo.constant dense<\"{hex}\"> : {}", ty.text()),
        )
    }

    /// A scalar broadcast to the shape of `like` (with `like`'s element type replaced by `elem`).
    pub fn splat_f32(&mut self, x: f32, like: &Ty) -> V {
        let s = self.scalar_f32(x);
        self.broadcast(&s, &[], &like.with_elem(Elem::F32))
    }

    pub fn splat_i32(&mut self, x: i32, like: &Ty) -> V {
        let s = self.scalar_i32(x);
        self.broadcast(&s, &[], &like.with_elem(Elem::I32))
    }

    // ---- shapes ----------------------------------------------------------------------------

    /// A `tensor<Nxi32>` holding the runtime shape of `dims`.
    pub fn shape_tensor(&mut self, dims: &[Dim]) -> V {
        let mut parts: Vec<V> = Vec::new();
        let mut run: Vec<usize> = Vec::new();
        let flush = |b: &mut Body, run: &mut Vec<usize>, parts: &mut Vec<V>| {
            if !run.is_empty() {
                let ty = Ty::fixed(&[run.len()], Elem::I32);
                let v = b.op(
                    ty.clone(),
                    format!("stablehlo.constant dense<[{}]> : {}", list(run), ty.text()),
                );
                parts.push(v);
                run.clear();
            }
        };
        for d in dims {
            match d {
                Dim::S(n) => run.push(*n),
                Dim::D(name) => {
                    flush(self, &mut run, &mut parts);
                    parts.push(V {
                        name: name.clone(),
                        ty: Ty::fixed(&[1], Elem::I32),
                    });
                }
            }
        }
        flush(self, &mut run, &mut parts);
        if parts.len() == 1 {
            return parts.pop().unwrap();
        }
        self.concat(&parts, 0)
    }

    /// The size of dimension `dim` of `x` as a [`Dim`] (queried at run time when dynamic).
    pub fn dim_of(&mut self, x: &V, dim: usize) -> Dim {
        match &x.ty.dims[dim] {
            Dim::S(n) => Dim::S(*n),
            Dim::D(_) => {
                let s = self.op(
                    Ty::fixed(&[], Elem::I32),
                    format!(
                        "stablehlo.get_dimension_size {}, dim = {dim} : ({}) -> tensor<i32>",
                        x.name,
                        x.ty.text()
                    ),
                );
                let r = self.reshape_static(&s, &[1]);
                Dim::D(r.name)
            }
        }
    }

    /// Re-reads every dynamic dimension of `x` from `x` itself (after an op that creates a new
    /// dynamic length, e.g. a concatenation).
    pub fn refresh_dims(&mut self, mut x: V) -> V {
        for i in 0..x.ty.rank() {
            if !x.ty.dims[i].is_static() {
                let d = self.dim_of(&x, i);
                x.ty.dims[i] = d;
            }
        }
        x
    }

    pub fn reshape_static(&mut self, x: &V, dims: &[usize]) -> V {
        assert!(
            x.ty.is_static(),
            "reshape of a dynamic tensor (IREE 3.13 rejects it): use reduce_unit"
        );
        let from: usize = x.ty.static_dims().iter().product();
        assert_eq!(
            from,
            dims.iter().product::<usize>(),
            "reshape changes the element count"
        );
        let ty = Ty::fixed(dims, x.ty.elem);
        self.op(
            ty.clone(),
            format!("stablehlo.reshape {} : ({}) -> {}", x.name, x.ty.text(), ty.text()),
        )
    }

    /// Removes unit dimensions `dims` of a possibly dynamic tensor with a one-term sum.
    pub fn reduce_unit(&mut self, x: &V, dims: &[usize]) -> V {
        for &d in dims {
            assert_eq!(
                x.ty.dims[d],
                Dim::S(1),
                "reduce_unit: dimension {d} is not a unit dimension"
            );
        }
        if x.ty.is_static() {
            let keep: Vec<usize> =
                x.ty.static_dims()
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !dims.contains(i))
                    .map(|(_, &n)| n)
                    .collect();
            return self.reshape_static(x, &keep);
        }
        self.reduce(x, dims, Reduce::Add)
    }

    pub fn transpose(&mut self, x: &V, perm: &[usize]) -> V {
        let ty = Ty::new(perm.iter().map(|&p| x.ty.dims[p].clone()).collect(), x.ty.elem);
        self.op(
            ty.clone(),
            format!(
                "stablehlo.transpose {}, dims = [{}] : ({}) -> {}",
                x.name,
                list(perm),
                x.ty.text(),
                ty.text()
            ),
        )
    }

    /// `x` with the order of its elements along `dims` reversed.
    pub fn reverse(&mut self, x: &V, dims: &[usize]) -> V {
        self.op(
            x.ty.clone(),
            format!(
                "stablehlo.reverse {}, dims = [{}] : {}",
                x.name,
                list(dims),
                x.ty.text()
            ),
        )
    }

    /// Static slice `[start, limit)` per dimension of a static tensor.
    pub fn slice(&mut self, x: &V, ranges: &[(usize, usize)]) -> V {
        assert!(x.ty.is_static(), "static slice of a dynamic tensor");
        let dims: Vec<usize> = ranges.iter().map(|(a, b)| b - a).collect();
        let ty = Ty::fixed(&dims, x.ty.elem);
        let r = ranges
            .iter()
            .map(|(a, b)| format!("{a}:{b}"))
            .collect::<Vec<_>>()
            .join(", ");
        self.op(
            ty.clone(),
            format!("stablehlo.slice {} [{r}] : ({}) -> {}", x.name, x.ty.text(), ty.text()),
        )
    }

    /// `real_dynamic_slice` along static dimension `dim` (`[start, limit)`), every other dimension whole.
    pub fn dyn_slice(&mut self, x: &V, dim: usize, start: usize, limit: usize) -> V {
        if x.ty.is_static() {
            let ranges: Vec<(usize, usize)> =
                x.ty.static_dims()
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| if i == dim { (start, limit) } else { (0, n) })
                    .collect();
            return self.slice(x, &ranges);
        }
        assert!(x.ty.dims[dim].is_static(), "dyn_slice along a dynamic dimension");
        let rank = x.ty.rank();
        let starts: Vec<Dim> = (0..rank).map(|i| Dim::S(if i == dim { start } else { 0 })).collect();
        let mut limits = x.ty.dims.clone();
        limits[dim] = Dim::S(limit);
        let mut out = x.ty.clone();
        out.dims[dim] = Dim::S(limit - start);
        let s = self.shape_tensor(&starts);
        let l = self.shape_tensor(&limits);
        let st = self.shape_tensor(&vec![Dim::S(1); rank]);
        self.op(
            out.clone(),
            format!(
                "stablehlo.real_dynamic_slice {}, {}, {}, {} : ({}, {}, {}, {}) -> {}",
                x.name,
                s.name,
                l.name,
                st.name,
                x.ty.text(),
                s.ty.text(),
                l.ty.text(),
                st.ty.text(),
                out.text()
            ),
        )
    }

    pub fn concat(&mut self, xs: &[V], dim: usize) -> V {
        assert!(!xs.is_empty());
        let mut dims = xs[0].ty.dims.clone();
        let all_static = xs.iter().all(|x| x.ty.dims[dim].is_static());
        dims[dim] = if all_static {
            Dim::S(
                xs.iter()
                    .map(|x| if let Dim::S(n) = x.ty.dims[dim] { n } else { 0 })
                    .sum(),
            )
        } else {
            Dim::D(String::new()) // filled in by refresh below
        };
        let ty = Ty::new(dims, xs[0].ty.elem);
        let names = xs.iter().map(|x| x.name.as_str()).collect::<Vec<_>>().join(", ");
        let types = xs.iter().map(|x| x.ty.text()).collect::<Vec<_>>().join(", ");
        let v = self.op(
            ty.clone(),
            format!(
                "stablehlo.concatenate {names}, dim = {dim} : ({types}) -> {}",
                ty.text()
            ),
        );
        if all_static {
            v
        } else {
            let d = self.dim_of(&v, dim);
            let mut v = v;
            v.ty.dims[dim] = d;
            v
        }
    }

    /// Broadcasts `x` into `target` (`map[i]` = target dimension of `x`'s dimension `i`).
    pub fn broadcast(&mut self, x: &V, map: &[usize], target: &Ty) -> V {
        let ty = target.with_elem(x.ty.elem);
        if ty.is_static() && x.ty.is_static() {
            return self.op(
                ty.clone(),
                format!(
                    "stablehlo.broadcast_in_dim {}, dims = [{}] : ({}) -> {}",
                    x.name,
                    list(map),
                    x.ty.text(),
                    ty.text()
                ),
            );
        }
        // Every operand dimension keeps its size (we only add dimensions): saying so is what
        // lets IREE 3.13 legalise the op at all.
        let shape = self.shape_tensor(&ty.dims);
        let keep: Vec<usize> = (0..x.ty.rank()).collect();
        self.op(
            ty.clone(),
            format!(
                "\"stablehlo.dynamic_broadcast_in_dim\"({}, {}) {{broadcast_dimensions = array<i64{}>, known_nonexpanding_dimensions = array<i64{}>}} : ({}, {}) -> {}",
                x.name,
                shape.name,
                i64_list(map),
                i64_list(&keep),
                x.ty.text(),
                shape.ty.text(),
                ty.text()
            ),
        )
    }

    // ---- elementwise -----------------------------------------------------------------------

    pub fn unary(&mut self, op: &str, x: &V) -> V {
        self.op(x.ty.clone(), format!("stablehlo.{op} {} : {}", x.name, x.ty.text()))
    }

    pub fn binary(&mut self, op: &str, a: &V, b: &V) -> V {
        assert_eq!(a.ty.text(), b.ty.text(), "binary {op}: operand types differ");
        self.op(
            a.ty.clone(),
            format!("stablehlo.{op} {}, {} : {}", a.name, b.name, a.ty.text()),
        )
    }

    pub fn add(&mut self, a: &V, b: &V) -> V {
        self.binary("add", a, b)
    }
    pub fn sub(&mut self, a: &V, b: &V) -> V {
        self.binary("subtract", a, b)
    }
    pub fn mul(&mut self, a: &V, b: &V) -> V {
        self.binary("multiply", a, b)
    }
    pub fn div(&mut self, a: &V, b: &V) -> V {
        self.binary("divide", a, b)
    }

    /// `x * c` for a scalar constant.
    pub fn scale(&mut self, x: &V, c: f32) -> V {
        let s = self.splat_f32(c, &x.ty);
        self.mul(x, &s)
    }

    pub fn compare(&mut self, dir: &str, a: &V, b: &V) -> V {
        assert_eq!(a.ty.text(), b.ty.text(), "compare: operand types differ");
        self.op(
            a.ty.with_elem(Elem::I1),
            format!(
                "stablehlo.compare {dir}, {}, {} : ({}, {}) -> {}",
                a.name,
                b.name,
                a.ty.text(),
                b.ty.text(),
                a.ty.with_elem(Elem::I1).text()
            ),
        )
    }

    pub fn select(&mut self, p: &V, a: &V, b: &V) -> V {
        self.op(
            a.ty.clone(),
            format!(
                "stablehlo.select {}, {}, {} : {}, {}",
                p.name,
                a.name,
                b.name,
                p.ty.text(),
                a.ty.text()
            ),
        )
    }

    pub fn convert(&mut self, x: &V, elem: Elem) -> V {
        let ty = x.ty.with_elem(elem);
        self.op(
            ty.clone(),
            format!("stablehlo.convert {} : ({}) -> {}", x.name, x.ty.text(), ty.text()),
        )
    }

    /// `x` (f32) rounded to the precision of a float with `exponent` and `mantissa` bits, kept
    /// f32: to nearest even, then beyond the largest finite value ±inf and below the smallest
    /// normal ±0 (XLA's semantics, which IREE implements as plain arithmetic: it fuses like any
    /// elementwise op, where a `convert` pair is a bit-extend that IREE dispatches alone).
    pub fn reduce_precision(&mut self, x: &V, exponent: u32, mantissa: u32) -> V {
        self.op(
            x.ty.clone(),
            format!(
                "stablehlo.reduce_precision {}, format = e{exponent}m{mantissa} : {}",
                x.name,
                x.ty.text()
            ),
        )
    }

    /// [`Self::convert`] unless `x` already holds `elem`.
    pub fn convert_if(&mut self, x: &V, elem: Elem) -> V {
        if x.ty.elem == elem {
            x.clone()
        } else {
            self.convert(x, elem)
        }
    }

    pub fn bitcast(&mut self, x: &V, elem: Elem) -> V {
        let ty = x.ty.with_elem(elem);
        self.op(
            ty.clone(),
            format!(
                "stablehlo.bitcast_convert {} : ({}) -> {}",
                x.name,
                x.ty.text(),
                ty.text()
            ),
        )
    }

    pub fn iota(&mut self, dims: &[usize], dim: usize, elem: Elem) -> V {
        let ty = Ty::fixed(dims, elem);
        self.op(ty.clone(), format!("stablehlo.iota dim = {dim} : {}", ty.text()))
    }

    // ---- reductions and contractions -------------------------------------------------------

    pub fn reduce(&mut self, x: &V, dims: &[usize], kind: Reduce) -> V {
        let init = match kind {
            Reduce::Add => 0.0,
            Reduce::Max => f32::NEG_INFINITY,
        };
        assert_eq!(x.ty.elem, Elem::F32, "reduce: f32 only");
        let z = self.scalar_f32(init);
        let ty = Ty::new(
            x.ty.dims
                .iter()
                .enumerate()
                .filter(|(i, _)| !dims.contains(i))
                .map(|(_, d)| d.clone())
                .collect(),
            x.ty.elem,
        );
        let op = match kind {
            Reduce::Add => "stablehlo.add",
            Reduce::Max => "stablehlo.maximum",
        };
        self.op(
            ty.clone(),
            format!(
                "stablehlo.reduce({} init: {}) applies {op} across dimensions = [{}] : ({}, tensor<f32>) -> {}",
                x.name,
                z.name,
                list(dims),
                x.ty.text(),
                ty.text()
            ),
        )
    }

    /// `dot_general`; the result is batch dims, then lhs free dims, then rhs free dims.
    pub fn dot(&mut self, a: &V, b: &V, batch: (&[usize], &[usize]), contract: (&[usize], &[usize])) -> V {
        let mut dims: Vec<Dim> = batch.0.iter().map(|&i| a.ty.dims[i].clone()).collect();
        for (i, d) in a.ty.dims.iter().enumerate() {
            if !batch.0.contains(&i) && !contract.0.contains(&i) {
                dims.push(d.clone());
            }
        }
        for (i, d) in b.ty.dims.iter().enumerate() {
            if !batch.1.contains(&i) && !contract.1.contains(&i) {
                dims.push(d.clone());
            }
        }
        let ty = Ty::new(dims, Elem::F32);
        let batching = if batch.0.is_empty() {
            String::new()
        } else {
            format!("batching_dims = [{}] x [{}], ", list(batch.0), list(batch.1))
        };
        self.op(
            ty.clone(),
            format!(
                "stablehlo.dot_general {}, {}, {batching}contracting_dims = [{}] x [{}] : ({}, {}) -> {}",
                a.name,
                b.name,
                list(contract.0),
                list(contract.1),
                a.ty.text(),
                b.ty.text(),
                ty.text()
            ),
        )
    }

    /// Index of the largest value along the last axis of a rank-2 `[rows, n]` f32 tensor, the
    /// lowest index on ties, as `[rows]` i32, in the stages of [`argmax_stages`]`(n)`
    /// ([`Self::argmax_rows_staged`]).
    pub fn argmax_rows(&mut self, x: &V) -> V {
        let n = x.ty.static_dims()[1];
        self.argmax_rows_staged(x, &argmax_stages(n))
    }

    /// [`Self::argmax_rows`] in two stages: `tiles` tiles of `w = ceil(n / tiles)` values
    /// ([`Self::argmax_rows_staged`] with stages `[tiles, w]`); `tiles` ≤ 1 is the single reduce.
    pub fn argmax_rows_tiled(&mut self, x: &V, tiles: usize) -> V {
        let n = x.ty.static_dims()[1];
        if tiles <= 1 {
            return self.argmax_rows_staged(x, &[n]);
        }
        self.argmax_rows_staged(x, &[tiles, n.div_ceil(tiles)])
    }

    /// [`Self::argmax_rows`] in `stages.len()` reduces. Each row of `n` values is padded with
    /// `-inf` at indices `>= n` to `s0 · s1 · … ` values and laid out as `[s0, s1, …]` (row
    /// major); stage one reduces axis `s0` (for every position `j` of the other axes, the values
    /// at `j`, `S + j`, `2S + j`, … with `S = s1 · s2 · …`) to its (value, global index) winner, stage two
    /// axis `s1` of those winners, and so on, with the same two-operand reducer (larger value,
    /// else lower index) in every stage. Same result as one reduce over the row, lowest index
    /// among equal maxima: the reducer is associative and commutative and a padding element
    /// loses to every real one (its value is `-inf`, its index the highest). IREE runs each
    /// (value, index) reduction on one thread on Vulkan, so a stage costs about its axis's
    /// length in dependent loads: one reduce over 262144 logits took 19 ms on the H200, two
    /// stages of 512 took 0.66 ms for the first, three of 64 are three loops of 64. On the CPU
    /// the strided (column) form took 0.8–1.1 ms against 2.8–3.1 ms for contiguous rows (and
    /// 2.0–2.6 ms for one reduce) over 262144 values.
    pub fn argmax_rows_staged(&mut self, x: &V, stages: &[usize]) -> V {
        assert_eq!(x.ty.rank(), 2);
        let dims = x.ty.static_dims();
        let (rows, n) = (dims[0], dims[1]);
        let padded: usize = stages.iter().product();
        assert!(
            padded >= n && !stages.is_empty(),
            "argmax stages {stages:?} do not cover {n} values"
        );
        if stages.len() == 1 {
            let iota = self.iota(&dims, 1, Elem::I32);
            return self.argmax_reduce(x, &iota, 1).1;
        }
        let x = if padded > n {
            let pad = self.splat_f32(f32::NEG_INFINITY, &Ty::fixed(&[rows, padded - n], Elem::F32));
            self.concat(&[x.clone(), pad], 1)
        } else {
            x.clone()
        };
        let mut shape = vec![rows];
        shape.extend_from_slice(stages);
        let iota = self.iota(&[rows, padded], 1, Elem::I32);
        let (mut best, mut at) = (self.reshape_static(&x, &shape), self.reshape_static(&iota, &shape));
        for _ in stages {
            (best, at) = self.argmax_reduce(&best, &at, 1);
        }
        at
    }

    /// [`Self::argmax_rows`] as two plain reductions: each row's maximum, then the lowest index
    /// holding it (`min` over `select(x == max, iota, i32::MAX)`). Same result, lowest index
    /// among equal maxima; a row whose maximum is NaN matches no index and gives `i32::MAX`,
    /// which no vocabulary holds. Both reductions vectorize on the CPU, where IREE runs the
    /// two-operand (value, index) reduce element by element: 0.17 against 0.36 ms over 262144
    /// logits here (Zen 5), 0.56 ms of the decode step. Not for SPIR-V: IREE 3.13 fails to
    /// compile it for `--iree-vulkan-target=ampere` ("failed to legalize operation
    /// 'memref.alloc'" of a workgroup `index` buffer).
    pub fn argmax_rows_by_max(&mut self, x: &V) -> V {
        assert_eq!(x.ty.rank(), 2);
        let dims = x.ty.static_dims();
        let max = self.reduce(x, &[1], Reduce::Max);
        let maxb = self.broadcast(&max, &[0], &x.ty);
        let hit = self.compare("EQ", x, &maxb);
        let iota = self.iota(&dims, 1, Elem::I32);
        let none = self.splat_i32(i32::MAX, &x.ty);
        let candidates = self.select(&hit, &iota, &none);
        let init = self.scalar_i32(i32::MAX);
        let ty = Ty::fixed(&[dims[0]], Elem::I32);
        self.op(
            ty.clone(),
            format!(
                "stablehlo.reduce({} init: {}) applies stablehlo.minimum across dimensions = [1] : ({}, tensor<i32>) -> {}",
                candidates.name,
                init.name,
                candidates.ty.text(),
                ty.text()
            ),
        )
    }

    /// `logits [1, n]` with every id the mask `allowed [ceil(n/32)] i32` does not allow (bit
    /// `id % 32` of word `id / 32` clear) set to `-inf`, as `AllowedTokens::mask_logits` does:
    /// an allowed finite logit then beats every masked one in each argmax form, and ties among
    /// allowed ids keep the lowest-index rule. Elementwise over the logits: on the CPU it took the
    /// argmax over 262,144 logits from 0.23 to 0.47–0.52 ms (`tests/argmax.rs`,
    /// `mask_cost_of_the_cpu_argmax`); a form that selects in the words' `[words, 32]` layout
    /// measured the same.
    pub fn allowed_logits(&mut self, logits: &V, allowed: &V) -> V {
        let n = logits.ty.static_dims()[1];
        let words = allowed.ty.static_dims()[0];
        let spread = Ty::fixed(&[words, 32], Elem::I32);
        let w = self.broadcast(allowed, &[0], &spread);
        let bit = self.iota(&[words, 32], 1, Elem::I32);
        let shifted = self.binary("shift_right_logical", &w, &bit);
        let one = self.splat_i32(1, &spread);
        let bits = self.binary("and", &shifted, &one);
        let flat = self.reshape_static(&bits, &[1, words * 32]);
        let bits = match words * 32 > n {
            true => self.slice(&flat, &[(0, 1), (0, n)]),
            false => flat,
        };
        let zero = self.splat_i32(0, &bits.ty);
        let keep = self.compare("NE", &bits, &zero);
        let ninf = self.splat_f32(f32::NEG_INFINITY, &logits.ty);
        self.select(&keep, logits, &ninf)
    }

    /// The `k` largest values along the last axis of a static `[rows, n]` f32 tensor and their
    /// indices, `[rows, k]` f32 and i32, sorted descending, equal values lowest index first
    /// (CHLO's `top_k` is stable, as the argmax's reducer). IREE lowers it to its own `topk` op on
    /// every target.
    pub fn top_k(&mut self, x: &V, k: usize) -> (V, V) {
        assert_eq!(x.ty.rank(), 2);
        let dims = x.ty.static_dims();
        assert!(k >= 1 && k <= dims[1], "top_k: k {k} outside 1..={}", dims[1]);
        let values = Ty::fixed(&[dims[0], k], Elem::F32);
        let indices = Ty::fixed(&[dims[0], k], Elem::I32);
        let name = self.fresh();
        writeln!(
            self.text,
            "    {name}:2 = chlo.top_k({}, k = {k}) : {} -> ({}, {})",
            x.name,
            x.ty.text(),
            values.text(),
            indices.text()
        )
        .unwrap();
        results2(&name, values, indices)
    }

    /// The variadic (value, index) reduce of `x` and its indices `idx` (same shape) over `dim`:
    /// the larger value, the lower index among equal values.
    fn argmax_reduce(&mut self, x: &V, idx: &V, dim: usize) -> (V, V) {
        let ninf = self.scalar_f32(f32::NEG_INFINITY);
        let zero = self.scalar_i32(0);
        let kept: Vec<Dim> =
            x.ty.dims
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != dim)
                .map(|(_, d)| d.clone())
                .collect();
        let out_f = Ty::new(kept.clone(), Elem::F32);
        let out_i = Ty::new(kept, Elem::I32);
        let name = self.fresh();
        let text = templates::ARGMAX_REDUCE.fill(&[
            ("NAME", &name),
            ("X", &x.name),
            ("NINF", &ninf.name),
            ("IDX", &idx.name),
            ("ZERO", &zero.name),
            ("DIM", &dim.to_string()),
            ("X_TY", &x.ty.text()),
            ("IDX_TY", &idx.ty.text()),
            ("OUT_F", &out_f.text()),
            ("OUT_I", &out_i.text()),
        ]);
        writeln!(self.text, "{text}").unwrap();
        results2(&name, out_f, out_i)
    }

    /// A zero-filled f32 tensor of type `ty` (`linalg.fill` of a scalar `arith.constant`): the
    /// accumulator of a `linalg.generic` contraction.
    fn zeros(&mut self, ty: &Ty) -> V {
        self.filled(ty, "0.000000e+00")
    }

    /// An f32 tensor of type `ty` filled with `value` (an MLIR float literal).
    fn filled(&mut self, ty: &Ty, value: &str) -> V {
        // A scalar `f32` (not a tensor): the fill's operand.
        let zero = self.op(Ty::fixed(&[], Elem::F32), format!("arith.constant {value} : f32"));
        let empty = self.op(ty.clone(), format!("tensor.empty() : {}", ty.text()));
        self.op(
            ty.clone(),
            format!(
                "linalg.fill ins({} : f32) outs({} : {}) -> {}",
                zero.name,
                empty.name,
                ty.text(),
                ty.text()
            ),
        )
    }

    /// A contraction `[R, O]` f32 as one `linalg.generic` over `(d0 = R, d1 = O, d2 …)`, the
    /// last `reductions` dimensions reduced: `ins` with indexing `maps` (the output's is
    /// `(d0, d1)`), the block given its arguments' names (one per input, then the accumulator)
    /// by `body`, which returns its ops (one per line) and the value to accumulate into.
    fn contraction(
        &mut self,
        ins: &[&V],
        o: usize,
        maps: &[&str],
        reductions: usize,
        body: impl FnOnce(&mut Self, &[String]) -> (String, String),
    ) -> V {
        let r = ins[0].ty.static_dims()[0];
        let ty = Ty::fixed(&[r, o], Elem::F32);
        self.reduction_generic(ins, ty, maps, reductions, "", body)
    }

    /// The `linalg.generic` of [`Self::contraction`] for an f32 result of type `ty`: its
    /// dimensions are the parallel ones (`d0 …`, the result's map) then `reductions` reduced
    /// ones; `attrs` is written after `outs` (empty, or ` attrs = {…}`).
    fn reduction_generic(
        &mut self,
        ins: &[&V],
        ty: Ty,
        maps: &[&str],
        reductions: usize,
        attrs: &str,
        body: impl FnOnce(&mut Self, &[String]) -> (String, String),
    ) -> V {
        let init = self.zeros(&ty);
        let out_map: Vec<String> = (0..ty.rank()).map(|i| format!("d{i}")).collect();
        let out_map = out_map.join(", ");
        let ins: Vec<(&V, &str)> = ins.iter().copied().zip(maps.iter().copied()).collect();
        let mut results = self.generic(&ins, &[(&init, &out_map)], reductions, attrs, |b, args| {
            let (ops, sum) = body(b, args);
            (ops, vec![sum])
        });
        results
            .pop()
            .unwrap_or_else(|| kv_core::error::invariant("a generic of one output"))
    }

    /// One `linalg.generic`: `ins` and the outputs' initial values `outs`, each with its indexing
    /// map over `(d0 …)` (the outputs' rank of parallel dimensions, then `reductions` reduced
    /// ones); `attrs` is written after `outs` (empty, or ` attrs = {…}`). `body` gets the block's
    /// argument names (one per input, then one per output) and returns its ops (one per line)
    /// and the values to yield, one per output. The results have `outs`' types.
    fn generic(
        &mut self,
        ins: &[(&V, &str)],
        outs: &[(&V, &str)],
        reductions: usize,
        attrs: &str,
        body: impl FnOnce(&mut Self, &[String]) -> (String, Vec<String>),
    ) -> Vec<V> {
        let parallel = outs[0].0.ty.rank();
        let name = self.fresh();
        let operands: Vec<&V> = ins.iter().chain(outs).map(|(v, _)| *v).collect();
        let args: Vec<String> = operands.iter().map(|_| self.fresh()).collect();
        let (ops, yields) = body(self, &args);
        let dims: Vec<String> = (0..parallel + reductions).map(|i| format!("d{i}")).collect();
        let dims = dims.join(", ");
        let map_list = ins
            .iter()
            .chain(outs)
            .map(|(_, m)| format!("affine_map<({dims}) -> ({m})>"))
            .collect::<Vec<_>>()
            .join(", ");
        let iterators = std::iter::repeat_n("\"parallel\"", parallel)
            .chain(std::iter::repeat_n("\"reduction\"", reductions))
            .collect::<Vec<_>>()
            .join(", ");
        let block_args = operands
            .iter()
            .zip(&args)
            .map(|(v, a)| format!("{a}: {}", v.ty.elem.name()))
            .collect::<Vec<_>>()
            .join(", ");
        let list = |vs: &[(&V, &str)], f: fn(&V) -> String| vs.iter().map(|(v, _)| f(v)).collect::<Vec<_>>().join(", ");
        let (in_names, in_types) = (list(ins, |v| v.name.clone()), list(ins, |v| v.ty.text()));
        let (out_names, out_types) = (list(outs, |v| v.name.clone()), list(outs, |v| v.ty.text()));
        let yield_types = list(outs, |v| v.ty.elem.name().to_string());
        let (head, result) = match outs.len() {
            1 => (name.clone(), out_types.clone()),
            n => (format!("{name}:{n}"), format!("({out_types})")),
        };
        let mut text = format!(
            "    {head} = linalg.generic {{indexing_maps = [{map_list}], iterator_types = [{iterators}]}} ins({in_names} : {in_types}) outs({out_names} : {out_types}){attrs} {{\n    ^bb0({block_args}):\n"
        );
        for line in ops.lines() {
            writeln!(text, "      {line}").unwrap();
        }
        writeln!(
            text,
            "      linalg.yield {} : {yield_types}\n    }} -> {result}",
            yields.join(", ")
        )
        .unwrap();
        self.text.push_str(&text);
        match outs {
            [(out, _)] => vec![V {
                name,
                ty: out.ty.clone(),
            }],
            _ => outs
                .iter()
                .enumerate()
                .map(|(i, (out, _))| V {
                    name: format!("{name}#{i}"),
                    ty: out.ty.clone(),
                })
                .collect(),
        }
    }

    /// `x [R, nb, blk] · w [O, nb, blk]` contracted over both block axes: `[R, O]` f32, as one
    /// `linalg.generic` with two reduction dimensions: the q4 many-row projections'. IREE 3.13
    /// runs it as a generic matmul after a separate dequantization of `w` (an f32 copy of the
    /// weight per call); as a `dot_general` over the blocks (q8's form, on the mmt4d ukernels)
    /// the i4 unpacking inside the weight's pack made Gemma 3 270M's q4 chunk calls 1.6–2.5×
    /// slower (docs/journal, session 11).
    pub fn block_contract(&mut self, x: &V, w: &V) -> V {
        let o = w.ty.static_dims()[0];
        self.contraction(&[x, w], o, &["d0, d2, d3", "d1, d2, d3"], 2, Self::f32_product)
    }

    /// `x [R, nb, blk] · (f32(q) * s) [O, nb, blk]` for block-quantized values `q [O, nb, blk]`
    /// (`i8`, `i4`) and scales `s [O, nb]`: `[R, O]` f32, one `linalg.generic` whose body
    /// dequantizes (shark-ai's `mmt_block_scaled_q8_0` form). Nothing is left for IREE to fuse or
    /// hoist, so it is one dispatch reading the narrow values whatever the fusion flags (v1's CPU
    /// flags turn aggressive fusion off, which splits a separate dequantization from the matmul
    /// reading it). As fast as the fused form for one row (Gemma's 262144 × 640 head, q8:
    /// 12.8 against 12.2 ms here); for 32 rows 2.7× slower (it is not a matmul to IREE), so the
    /// many-row graphs take a `dot_general` over the blocks (q8) or [`Self::block_contract`] (q4).
    pub fn block_contract_q(&mut self, x: &V, q: &V, s: &V) -> V {
        let (o, qe) = (q.ty.static_dims()[0], q.ty.elem.name());
        let maps = ["d0, d2, d3", "d1, d2, d3", "d1, d2"];
        self.contraction(&[x, q, s], o, &maps, 2, |b, args| {
            let [a, qv, sc, acc] = args else {
                kv_core::error::invariant("a block argument per input, then the accumulator")
            };
            let [qf, w, p, sum] = std::array::from_fn(|_| b.fresh());
            let ops = templates::DEQUANT_PRODUCT.fill(&[
                ("QF", &qf),
                ("QV", qv),
                ("QE", qe),
                ("SC", sc),
                ("W", &w),
                ("A", a),
                ("P", &p),
                ("ACC", acc),
                ("SUM", &sum),
            ]);
            (ops, sum)
        })
    }

    /// `x · Wᵀ` of `x [R, in]` f32 and `w [out, in]` i16 holding bf16 bits, widened inside the
    /// contraction's body (sign-extend, shift into the high half, bitcast): no f32 copy of the
    /// weight exists, and IREE keeps the product one dispatch without fusing a separate
    /// widening into a matmul (which takes its SPIR-V matmul pipeline minutes to compile).
    pub fn contract_i16(&mut self, x: &V, w: &V) -> V {
        let o = w.ty.static_dims()[0];
        self.contraction(&[x, w], o, &["d0, d2", "d1, d2"], 1, Self::widened_product)
    }

    /// `x [R, in] · Wᵀ` of a weight stored as packed pairs of bf16, `w [out, in/2] i32` (element
    /// `2k` in the low half of word `k`, `2k + 1` in the high half), as one contraction over the
    /// words and the pair: `x` viewed as `[R, in/2, 2]`, each element's half shifted into the
    /// high bits in the body. The widened-then-interleaved form ([`WeightFormat::PackedI32`]'s
    /// `widen`: two halves, `concatenate`, `reshape`) is one IREE cannot fuse into the product,
    /// so every call wrote every weight to a transient f32 buffer (1.68 GB per step of Gemma 3
    /// 270M); this form reads each word where it multiplies it, on targets with 32-bit storage
    /// only (IREE's default Vulkan target, `vp_android_baseline_2022`).
    ///
    /// [`WeightFormat::PackedI32`]: crate::emit::WeightFormat::PackedI32
    pub fn contract_pairs(&mut self, x: &V, w: &V) -> V {
        let [r, inner] = x.ty.static_dims()[..] else {
            kv_core::error::invariant("a product's input is [R, in]")
        };
        let o = w.ty.static_dims()[0];
        let x3 = self.reshape_static(x, &[r, inner / 2, 2]);
        self.contraction(&[&x3, w], o, &["d0, d2, d3", "d1, d2"], 2, Self::pair_product(3))
    }

    /// [`Self::contract_pairs`] of one row, `x [1, in]`, in two reductions: the words in
    /// `splits` runs (`partial [out, splits]`), then the runs. On a target without subgroup
    /// operations (IREE's default Vulkan target) IREE gives each output of a reduction one
    /// thread, whose loads wait on each other: 640 outputs of 2,048 terms took 555 µs on the
    /// H200. The runs give `out · splits` threads short loops; the second reduction is short.
    pub fn contract_pairs_split(&mut self, x: &V, w: &V, splits: usize) -> V {
        let [_, words] = w.ty.static_dims()[..] else {
            kv_core::error::invariant("a packed weight is [out, in/2]")
        };
        if splits <= 1 || words % splits != 0 {
            return self.contract_pairs(x, w);
        }
        self.contract_pairs_in_parts(x, w, splits, false)
    }

    /// [`Self::contract_pairs`] in two reductions with the words interleaved over `lanes`: lane
    /// `j` of output `o` sums words `j, j + lanes, …` (`partial [R, out, lanes]`), then the
    /// lanes. For products with too many outputs to split into runs ([`Self::contract_pairs_split`]:
    /// the LM head's 262,144) on targets without subgroup operations: one thread an output read
    /// its row's 320 words alone, neighbouring threads a row apart; here neighbouring threads
    /// read neighbouring words.
    pub fn contract_pairs_lanes(&mut self, x: &V, w: &V, lanes: usize) -> V {
        let [_, words] = w.ty.static_dims()[..] else {
            kv_core::error::invariant("a packed weight is [out, in/2]")
        };
        if lanes <= 1 || words % lanes != 0 {
            return self.contract_pairs(x, w);
        }
        self.contract_pairs_in_parts(x, w, lanes, true)
    }

    /// The gate and up products of one packed matrix `w [2·ff, words]` (gate's rows, then
    /// up's) in two reductions: the words in `parts` runs as [`Self::contract_pairs_split`]
    /// (one dispatch for both halves, twice the outputs), then one generic of two results that
    /// sums each half's runs, `[R, ff]` each. An elementwise consumer of both (the activation
    /// times up) joins that second dispatch: two dispatches where the halves apart took four.
    pub fn contract_pairs_gated(&mut self, x: &V, w: &V, parts: usize) -> (V, V) {
        let [o, words] = w.ty.static_dims()[..] else {
            kv_core::error::invariant("a packed weight is [out, in/2]")
        };
        let parts = if parts >= 1 && words % parts == 0 { parts } else { 1 };
        let r = x.ty.static_dims()[0];
        let ff = o / 2;
        let partial = self.pairs_partial_sums(x, w, parts, false);
        let halves = self.reshape_static(&partial, &[r, 2, ff, parts]);
        let ty = Ty::fixed(&[r, ff], Elem::F32);
        let (gate, up) = (self.zeros(&ty), self.zeros(&ty));
        let mut sums = self.generic(
            &[(&halves, "d0, 0, d1, d2"), (&halves, "d0, 1, d1, d2")],
            &[(&gate, "d0, d1"), (&up, "d0, d1")],
            1,
            "",
            |b, args| {
                let [g, u, g_acc, u_acc] = args else {
                    kv_core::error::invariant("two inputs, then two accumulators")
                };
                let (g_sum, u_sum) = (b.fresh(), b.fresh());
                let ops = format!("{g_sum} = arith.addf {g_acc}, {g} : f32\n{u_sum} = arith.addf {u_acc}, {u} : f32\n");
                (ops, vec![g_sum, u_sum])
            },
        );
        match (sums.pop(), sums.pop()) {
            (Some(up), Some(gate)) => (gate, up),
            _ => kv_core::error::invariant("a generic of two outputs"),
        }
    }

    /// A packed-pairs product whose words are summed in `parts` partial sums
    /// (`partial [R, out, parts]`), then across them: part `j` holds the `j`-th run of
    /// `words / parts` words ([`Self::contract_pairs_split`]) or, `interleaved`, words
    /// `j, j + parts, …` ([`Self::contract_pairs_lanes`]).
    fn contract_pairs_in_parts(&mut self, x: &V, w: &V, parts: usize, interleaved: bool) -> V {
        let partial = self.pairs_partial_sums(x, w, parts, interleaved);
        self.reduce(&partial, &[2], Reduce::Add)
    }

    /// The first reduction of [`Self::contract_pairs_in_parts`]: `partial [R, out, parts]`.
    fn pairs_partial_sums(&mut self, x: &V, w: &V, parts: usize, interleaved: bool) -> V {
        let [o, words] = w.ty.static_dims()[..] else {
            kv_core::error::invariant("a packed weight is [out, in/2]")
        };
        let r = x.ty.static_dims()[0];
        let each = words / parts;
        // Loop dimensions: d0 row, d1 output, d2 part, d3 word within the part.
        let (w3, maps) = if interleaved {
            (
                self.reshape_static(w, &[o, each, parts]),
                ["d0, d3, d2", "d0, d3, d2", "d1, d3, d2"],
            )
        } else {
            (
                self.reshape_static(w, &[o, parts, each]),
                ["d0, d2, d3", "d0, d2, d3", "d1, d2, d3"],
            )
        };
        let grid = if interleaved { [each, parts] } else { [parts, each] };
        let (lo, hi) = self.pair_halves(x, grid);
        let ty = Ty::fixed(&[r, o, parts], Elem::F32);
        self.reduction_generic(&[&lo, &hi, &w3], ty, &maps, 1, "", Self::pair_halves_product)
    }

    /// The even and odd elements of `x [R, 2·a·b]` (the low and high halves of a packed pair
    /// meet them), each `[R, a, b]`: the packed products read them as two inputs, so their body
    /// needs no loop index to pick a word's half. With the index (a pair dimension) IREE's
    /// SPIR-V code for the portable target was a scalar loop that loads and stores its
    /// accumulator in the output buffer at every step; without it, `vector<4xf32>` loads and the
    /// accumulator in registers (`iree-compile --compile-to=executable-targets`, session 25).
    fn pair_halves(&mut self, x: &V, [a, b]: [usize; 2]) -> (V, V) {
        let r = x.ty.static_dims()[0];
        let x4 = self.reshape_static(x, &[r, a, b, 2]);
        let mut half = |j: usize| {
            let h = self.slice(&x4, &[(0, r), (0, a), (0, b), (j, j + 1)]);
            self.reshape_static(&h, &[r, a, b])
        };
        (half(0), half(1))
    }

    /// The body of a packed-pairs product over the halves of `x` ([`Self::pair_halves`]; block
    /// arguments the even element, the odd one, the word, the accumulator).
    fn pair_halves_product(&mut self, args: &[String]) -> (String, String) {
        let [a, b, word, acc] = args else {
            kv_core::error::invariant("the halves, the word, then the accumulator")
        };
        let [c16, up, mask, hi, lof, hif, p, q, pq, sum]: [String; 10] = std::array::from_fn(|_| self.fresh());
        let ops = templates::PAIR_HALVES_PRODUCT.fill(&[
            ("C16", &c16),
            ("UP", &up),
            ("WORD", word),
            ("MASK", &mask),
            ("HI", &hi),
            ("LOF", &lof),
            ("HIF", &hif),
            ("A", a),
            ("B", b),
            ("P", &p),
            ("Q", &q),
            ("PQ", &pq),
            ("ACC", acc),
            ("SUM", &sum),
        ]);
        (ops, sum)
    }

    /// The four sums a residual stream's pending post-norm needs (`h = x + c·u`, `u = d·post`,
    /// `c = rsqrt(mean(d²) + eps)`), in runs of 32 elements: `x`, `d` `[R, runs, 16, 2]` (rows
    /// in runs of 16 pairs), `post` the post-norm's packed words `[runs, 16]` (widened in the
    /// body). Results `Σ d²`, `Σ x²`, `Σ x·u`, `Σ u²` per run, `[R, runs]` each, from which
    /// `Σ h² = Σ x² + 2c·Σ x·u + c²·Σ u²` without `h` written out first.
    pub fn carried_sums_in_runs(&mut self, x: &V, d: &V, post: &V) -> Vec<V> {
        let [r, runs, _, _] = x.ty.static_dims()[..] else {
            kv_core::error::invariant("a stream in runs of pairs is [R, runs, 16, 2]")
        };
        let ty = Ty::fixed(&[r, runs], Elem::F32);
        let inits: Vec<V> = (0..4).map(|_| self.zeros(&ty)).collect();
        // d0 row, d1 run, d2 word in the run, d3 pair element.
        let ins = [(x, "d0, d1, d2, d3"), (d, "d0, d1, d2, d3"), (post, "d1, d2")];
        let outs: Vec<(&V, &str)> = inits.iter().map(|v| (v, "d0, d1")).collect();
        self.generic(&ins, &outs, 2, "", |b, args| {
            let [xa, da, word, sdd, sxx, sxu, suu] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            let [j, ji, c16, zero, low, up, mask, hi, bits, w, u] = std::array::from_fn(|_| b.fresh());
            let mut ops = String::new();
            writeln!(ops, "{j} = linalg.index 3 : index").unwrap();
            writeln!(ops, "{ji} = arith.index_cast {j} : index to i32").unwrap();
            writeln!(ops, "{c16} = arith.constant 16 : i32").unwrap();
            writeln!(ops, "{zero} = arith.constant 0 : i32").unwrap();
            writeln!(ops, "{low} = arith.cmpi eq, {ji}, {zero} : i32").unwrap();
            writeln!(ops, "{up} = arith.shli {word}, {c16} : i32").unwrap();
            writeln!(ops, "{mask} = arith.constant -65536 : i32").unwrap();
            writeln!(ops, "{hi} = arith.andi {word}, {mask} : i32").unwrap();
            writeln!(ops, "{bits} = arith.select {low}, {up}, {hi} : i32").unwrap();
            writeln!(ops, "{w} = arith.bitcast {bits} : i32 to f32").unwrap();
            writeln!(ops, "{u} = arith.mulf {da}, {w} : f32").unwrap();
            let mut yields = Vec::with_capacity(4);
            for (a, c, acc) in [(da, da, sdd), (xa, xa, sxx), (xa, &u, sxu), (&u, &u, suu)] {
                let (prod, sum) = (b.fresh(), b.fresh());
                writeln!(ops, "{prod} = arith.mulf {a}, {c} : f32").unwrap();
                writeln!(ops, "{sum} = arith.addf {acc}, {prod} : f32").unwrap();
                yields.push(sum);
            }
            (ops, yields)
        })
    }

    /// The stream and its norm from [`Self::carried_sums_in_runs`]'s four sums spread to every
    /// element (`sums`, `[R, n/2, 2]` each: `Σ d²`, `Σ x²`, `Σ x·u`, `Σ u²`), as one
    /// elementwise generic of two results: `h = x + c·d·post` and `h · rsqrt(mean(h²) + eps) ·
    /// norm` (`x`, `d` `[R, n/2, 2]`; `post`, `norm` packed words `[n/2]`, widened in the body).
    /// Written as one op because IREE fused the stablehlo form's ops into two elementwise
    /// dispatches after the sums' instead of into theirs.
    pub fn carried_norm_outputs(&mut self, sums: &[V], (x, d): (&V, &V), (post, norm): (&V, &V), eps: f32) -> (V, V) {
        let [_, half, _] = x.ty.static_dims()[..] else {
            kv_core::error::invariant("a stream in pairs is [R, n/2, 2]")
        };
        let n = half * 2;
        let ty = x.ty.clone();
        let (h0, y0) = (self.zeros(&ty), self.zeros(&ty));
        let mut ins: Vec<(&V, &str)> = sums.iter().map(|v| (v, "d0, d1, d2")).collect();
        ins.extend([(x, "d0, d1, d2"), (d, "d0, d1, d2"), (post, "d1"), (norm, "d1")]);
        let outs = [(&h0, "d0, d1, d2"), (&y0, "d0, d1, d2")];
        let parts = self.generic(&ins, &outs, 0, "", |b, args| {
            let [sdd, sxx, sxu, suu, xa, da, pw, nw, _, _] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            let [j, ji, c16, zero, low, mask, count, epsv] = std::array::from_fn(|_| b.fresh());
            let mut ops = String::new();
            writeln!(ops, "{j} = linalg.index 2 : index").unwrap();
            writeln!(ops, "{ji} = arith.index_cast {j} : index to i32").unwrap();
            writeln!(ops, "{c16} = arith.constant 16 : i32").unwrap();
            writeln!(ops, "{zero} = arith.constant 0 : i32").unwrap();
            writeln!(ops, "{low} = arith.cmpi eq, {ji}, {zero} : i32").unwrap();
            writeln!(ops, "{mask} = arith.constant -65536 : i32").unwrap();
            writeln!(ops, "{count} = arith.constant {} : f32", f32_hex(n as f32)).unwrap();
            writeln!(ops, "{epsv} = arith.constant {} : f32", f32_hex(eps)).unwrap();
            let widen = |b: &mut Self, ops: &mut String, word: &str| {
                let [up, hi, bits, w] = std::array::from_fn(|_| b.fresh());
                writeln!(ops, "{up} = arith.shli {word}, {c16} : i32").unwrap();
                writeln!(ops, "{hi} = arith.andi {word}, {mask} : i32").unwrap();
                writeln!(ops, "{bits} = arith.select {low}, {up}, {hi} : i32").unwrap();
                writeln!(ops, "{w} = arith.bitcast {bits} : i32 to f32").unwrap();
                w
            };
            let wp = widen(b, &mut ops, pw);
            let wn = widen(b, &mut ops, nw);
            let rsqrt_mean = |b: &mut Self, ops: &mut String, sum: &str| {
                let [mean, var, rs] = std::array::from_fn(|_| b.fresh());
                writeln!(ops, "{mean} = arith.divf {sum}, {count} : f32").unwrap();
                writeln!(ops, "{var} = arith.addf {mean}, {epsv} : f32").unwrap();
                writeln!(ops, "{rs} = math.rsqrt {var} : f32").unwrap();
                rs
            };
            let c = rsqrt_mean(b, &mut ops, sdd);
            let [two_c, cross, c2, square, s1, shh] = std::array::from_fn(|_| b.fresh());
            writeln!(ops, "{two_c} = arith.addf {c}, {c} : f32").unwrap();
            writeln!(ops, "{cross} = arith.mulf {two_c}, {sxu} : f32").unwrap();
            writeln!(ops, "{c2} = arith.mulf {c}, {c} : f32").unwrap();
            writeln!(ops, "{square} = arith.mulf {c2}, {suu} : f32").unwrap();
            writeln!(ops, "{s1} = arith.addf {sxx}, {cross} : f32").unwrap();
            writeln!(ops, "{shh} = arith.addf {s1}, {square} : f32").unwrap();
            let rh = rsqrt_mean(b, &mut ops, &shh);
            let [cd, u, h, hr, y] = std::array::from_fn(|_| b.fresh());
            writeln!(ops, "{cd} = arith.mulf {da}, {c} : f32").unwrap();
            writeln!(ops, "{u} = arith.mulf {cd}, {wp} : f32").unwrap();
            writeln!(ops, "{h} = arith.addf {xa}, {u} : f32").unwrap();
            writeln!(ops, "{hr} = arith.mulf {h}, {rh} : f32").unwrap();
            writeln!(ops, "{y} = arith.mulf {hr}, {wn} : f32").unwrap();
            (ops, vec![h, y])
        });
        let [h, y] = <[V; 2]>::try_from(parts).unwrap_or_else(|_| kv_core::error::invariant("two outputs"));
        (h, y)
    }

    /// Per-run sums `[R, runs]` each summed across the runs for every element of a row shaped
    /// `[R, tail..]` (`ty`): `[R, tail..]` each, the same within a row. The second half of a
    /// norm's factor on targets without subgroup operations (no loop longer than the runs),
    /// several sums in one dispatch.
    pub fn spread_sums(&mut self, partials: &[V], ty: &Ty) -> Vec<V> {
        let run = format!("d0, d{}", ty.rank());
        let inits: Vec<V> = partials.iter().map(|_| self.zeros(ty)).collect();
        let ins: Vec<(&V, &str)> = partials.iter().map(|p| (p, run.as_str())).collect();
        let each: Vec<String> = (0..ty.rank()).map(|i| format!("d{i}")).collect();
        let each = each.join(", ");
        let outs: Vec<(&V, &str)> = inits.iter().map(|v| (v, each.as_str())).collect();
        let n = partials.len();
        self.generic(&ins, &outs, 1, "", |b, args| {
            let (parts, accs) = args.split_at(n);
            let mut body = String::new();
            let mut yields = Vec::with_capacity(n);
            for (part, acc) in parts.iter().zip(accs) {
                let sum = b.fresh();
                writeln!(body, "{sum} = arith.addf {acc}, {part} : f32").unwrap();
                yields.push(sum);
            }
            (body, yields)
        })
    }

    /// The body of a packed-pairs product (block arguments `x`, the word, the accumulator; the
    /// pair element `j` is loop dimension `pair_dim`): element `j` of the word shifted into the
    /// high half, the low half cleared, bitcast, multiplied, accumulated.
    fn pair_product(pair_dim: usize) -> impl FnOnce(&mut Self, &[String]) -> (String, String) {
        move |b: &mut Self, args: &[String]| {
            let [a, word, acc] = args else {
                kv_core::error::invariant("a block argument per input, then the accumulator")
            };
            let [j, ji, c16, sh, left, up, mask, bits, wf, p, sum]: [String; 11] = std::array::from_fn(|_| b.fresh());
            let ops = templates::PAIR_PRODUCT.fill(&[
                ("J", &j),
                ("PAIR_DIM", &pair_dim.to_string()),
                ("JI", &ji),
                ("C16", &c16),
                ("SH", &sh),
                ("LEFT", &left),
                ("UP", &up),
                ("WORD", word),
                ("MASK", &mask),
                ("BITS", &bits),
                ("WF", &wf),
                ("A", a),
                ("P", &p),
                ("ACC", acc),
                ("SUM", &sum),
            ]);
            (ops, sum)
        }
    }

    /// [`Self::contract_i16`] of one row, `x [1, in]`, as a product over `(d0 = out, d1 = in)`
    /// of `x` viewed as `[in]`, carrying `compilation_info` (IREE's configuration of the
    /// dispatch, a `#iree_codegen.compilation_info<…>`, which must suit every target the module
    /// is compiled for): IREE folds a unit dimension away by rewriting the op, which drops its
    /// attributes, so only this form keeps it.
    pub fn row_contract_i16(&mut self, x: &V, w: &V, compilation_info: &str) -> V {
        let [o, inner] = w.ty.static_dims()[..] else {
            kv_core::error::invariant("a weight is [out, in]")
        };
        let xv = self.reshape_static(x, &[inner]);
        let attrs = format!(" attrs = {{compilation_info = {compilation_info}}}");
        let ty = Ty::fixed(&[o], Elem::F32);
        let product = self.reduction_generic(&[&xv, w], ty, &["d1", "d0, d1"], 1, &attrs, Self::widened_product);
        self.reshape_static(&product, &[1, o])
    }

    /// `a [G, x]` against `c` (f32) as one `linalg.generic` carrying `compilation_info` (see
    /// [`Self::row_contract_i16`]): with `scores`, `c [P, x]` and `[G, P]` (`a · cᵀ`: a query's
    /// scores against a cache's keys), else `c [x, n]` and `[G, n]` (`a · c`: probabilities
    /// against a cache's values, reduced over the cache's rows).
    pub fn configured_product(&mut self, a: &V, c: &V, scores: bool, compilation_info: &str) -> V {
        let g = a.ty.static_dims()[0];
        let [rows, cols] = c.ty.static_dims()[..] else {
            kv_core::error::invariant("a cache head is [P, d]")
        };
        let (n, maps) = if scores {
            (rows, ["d0, d2", "d1, d2"])
        } else {
            (cols, ["d0, d2", "d2, d1"])
        };
        let attrs = format!(" attrs = {{compilation_info = {compilation_info}}}");
        let ty = Ty::fixed(&[g, n], Elem::F32);
        self.reduction_generic(&[a, c], ty, &maps, 1, &attrs, Self::f32_product)
    }

    /// One-row products of `x [1, in] · scale [in]` against i16 weights `ws`, each `[out, in]`
    /// (the bf16 bits, as [`Self::row_contract_i16`]), and `Σ x²`, in one `linalg.generic` over
    /// `(out, in)` carrying `compilation_info`: `[1, out]` each, the products in order, then the
    /// sum (every column the same): an RMS norm's sum of squares, taken in the products' own
    /// dispatch.
    pub fn normed_row_products_i16(&mut self, x: &V, scale: &V, ws: &[&V], compilation_info: &str) -> Vec<V> {
        let [o, inner] = ws[0].ty.static_dims()[..] else {
            kv_core::error::invariant("a weight is [out, in]")
        };
        let xv = self.reshape_static(x, &[inner]);
        let ty = Ty::fixed(&[o], Elem::F32);
        let inits: Vec<V> = (0..=ws.len()).map(|_| self.zeros(&ty)).collect();
        let mut ins: Vec<(&V, &str)> = vec![(&xv, "d1"), (scale, "d1")];
        ins.extend(ws.iter().map(|w| (*w, "d0, d1")));
        let outs: Vec<(&V, &str)> = inits.iter().map(|v| (v, "d0")).collect();
        let attrs = format!(" attrs = {{compilation_info = {compilation_info}}}");
        let products = self.generic(&ins, &outs, 1, &attrs, |b, args| {
            let (xa, sa) = (&args[0], &args[1]);
            let (was, accs) = args[2..].split_at(ws.len());
            let mut body = String::new();
            let xs = b.fresh();
            writeln!(body, "{}", templates::MULF.fill(&[("OUT", &xs), ("A", xa), ("B", sa)])).unwrap();
            let mut yields = Vec::with_capacity(accs.len());
            for (w, acc) in was.iter().zip(accs) {
                let (ops, sum) = b.widened_product(&[xs.clone(), w.clone(), acc.clone()]);
                writeln!(body, "{ops}").unwrap();
                yields.push(sum);
            }
            let (ops, sum) = b.f32_product(&[xa.clone(), xa.clone(), accs[ws.len()].clone()]);
            writeln!(body, "{ops}").unwrap();
            yields.push(sum);
            (body, yields)
        });
        products.iter().map(|v| self.reshape_static(v, &[1, o])).collect()
    }

    /// [`Self::normed_row_products_i16`] of a residual stream `h = x + c·u` whose last
    /// addition is still pending (`u = d·post`, `c = rsqrt(mean(d²) + eps)`; `x`, `d` `[1, in]`,
    /// `post`, `scale` `[in]`), `h` never written out: per weight `Σ (x·scale)·W` and
    /// `Σ (u·scale)·W`, then `Σ x²`, `Σ x·u`, `Σ u²` and `Σ d²` (`[1, out]` each, every column of
    /// a sum the same), from which the caller forms `c`, `Σ h² = Σ x² + 2c·Σ x·u + c²·Σ u²` and
    /// the products of `h`: the RMS norm after one product and before the next without a
    /// dispatch of its own.
    pub fn carried_row_products_i16(&mut self, x: &V, d: &V, post: &V, scale: &V, ws: &[&V], info: &str) -> Vec<V> {
        let [o, inner] = ws[0].ty.static_dims()[..] else {
            kv_core::error::invariant("a weight is [out, in]")
        };
        let xv = self.reshape_static(x, &[inner]);
        let dv = self.reshape_static(d, &[inner]);
        let ty = Ty::fixed(&[o], Elem::F32);
        let inits: Vec<V> = (0..2 * ws.len() + 4).map(|_| self.zeros(&ty)).collect();
        let mut ins: Vec<(&V, &str)> = vec![(&xv, "d1"), (&dv, "d1"), (post, "d1"), (scale, "d1")];
        ins.extend(ws.iter().map(|w| (*w, "d0, d1")));
        let outs: Vec<(&V, &str)> = inits.iter().map(|v| (v, "d0")).collect();
        let attrs = format!(" attrs = {{compilation_info = {info}}}");
        let parts = self.generic(&ins, &outs, 1, &attrs, |b, args| {
            let (xa, da, pa, sa) = (&args[0], &args[1], &args[2], &args[3]);
            let (was, accs) = args[4..].split_at(ws.len());
            let [xs, u, us] = std::array::from_fn(|_| b.fresh());
            let mut body = String::new();
            for (out, l, r) in [(&xs, xa, sa), (&u, da, pa), (&us, &u, sa)] {
                writeln!(body, "{}", templates::MULF.fill(&[("OUT", out), ("A", l), ("B", r)])).unwrap();
            }
            let mut yields = Vec::with_capacity(accs.len());
            for (w, acc) in was.iter().zip(accs.chunks(2)) {
                let (ops, wf) = b.widened(w);
                writeln!(body, "{ops}").unwrap();
                for (a, acc) in [&xs, &us].into_iter().zip(acc) {
                    let (ops, sum) = b.f32_product(&[a.clone(), wf.clone(), acc.clone()]);
                    writeln!(body, "{ops}").unwrap();
                    yields.push(sum);
                }
            }
            for ((l, r), acc) in [(xa, xa), (xa, &u), (&u, &u), (da, da)]
                .into_iter()
                .zip(&accs[2 * ws.len()..])
            {
                let (ops, sum) = b.f32_product(&[l.clone(), r.clone(), acc.clone()]);
                writeln!(body, "{ops}").unwrap();
                yields.push(sum);
            }
            (body, yields)
        });
        parts.iter().map(|v| self.reshape_static(v, &[1, o])).collect()
    }

    /// `x [1, in] · Wᵀ` for i16 `w [out, in]` (as [`Self::row_contract_i16`]) and, in the same
    /// configured dispatch, a residual stream's pending addition made:
    /// `base + d·rsqrt(dsum / n + eps)·post` (`base`, `d` `[1, out]`; `post [out]`; `dsum` the
    /// 0-d `Σ d²` over `n` values). Returns both `[1, out]`. The second is the maximum of a value
    /// the same at every step of the reduction: a reduction with a combiner, as IREE's
    /// vectorizer needs.
    pub fn row_product_settling_i16(
        &mut self,
        x: &V,
        w: &V,
        (base, d, post): (&V, &V, &V),
        dsum: &V,
        (n, eps): (usize, f32),
        info: &str,
    ) -> (V, V) {
        let [o, inner] = w.ty.static_dims()[..] else {
            kv_core::error::invariant("a weight is [out, in]")
        };
        let xv = self.reshape_static(x, &[inner]);
        let bv = self.reshape_static(base, &[o]);
        let dv = self.reshape_static(d, &[o]);
        let ty = Ty::fixed(&[o], Elem::F32);
        let (acc0, max0) = (self.zeros(&ty), self.filled(&ty, "0xFF800000"));
        let attrs = format!(" attrs = {{compilation_info = {info}}}");
        let ins = [
            (&xv, "d1"),
            (w, "d0, d1"),
            (&bv, "d0"),
            (&dv, "d0"),
            (post, "d0"),
            (dsum, ""),
        ];
        let outs = [(&acc0, "d0"), (&max0, "d0")];
        let parts = self.generic(&ins, &outs, 1, &attrs, |b, args| {
            let [xa, wa, ba, da, pa, sa, acc, max] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            let (ops, sum) = b.widened_product(&[xa.clone(), wa.clone(), acc.clone()]);
            let [count, mean, eps_c, var, c, t, t2, h, m] = std::array::from_fn(|_| b.fresh());
            let settle = templates::SETTLE_STREAM.fill(&[
                ("COUNT", &count),
                ("N_BITS", &f32_hex(n as f32)),
                ("MEAN", &mean),
                ("SUM_SQ", sa),
                ("EPS_C", &eps_c),
                ("EPS_BITS", &f32_hex(eps)),
                ("VAR", &var),
                ("C", &c),
                ("T", &t),
                ("D", da),
                ("T2", &t2),
                ("POST", pa),
                ("H", &h),
                ("BASE", ba),
                ("M", &m),
                ("MAX", max),
            ]);
            (format!("{ops}\n{settle}"), vec![sum, m])
        });
        let [product, settled] = <[V; 2]>::try_from(parts).unwrap_or_else(|_| kv_core::error::invariant("two outputs"));
        (
            self.reshape_static(&product, &[1, o]),
            self.reshape_static(&settled, &[1, o]),
        )
    }

    /// The maximum of each row of `x [G, P]` (f32): `[G]`, one `linalg.generic` carrying
    /// `compilation_info` (see [`Self::row_contract_i16`]).
    pub fn configured_row_max(&mut self, x: &V, compilation_info: &str) -> V {
        let g = x.ty.static_dims()[0];
        let init = self.filled(&Ty::fixed(&[g], Elem::F32), "0xFF800000");
        let attrs = format!(" attrs = {{compilation_info = {compilation_info}}}");
        let mut max = self.generic(&[(x, "d0, d1")], &[(&init, "d0")], 1, &attrs, |b, args| {
            let [a, acc] = args else {
                kv_core::error::invariant("a block argument for the input and the accumulator")
            };
            let m = b.fresh();
            (templates::ROW_MAX.fill(&[("M", &m), ("ACC", acc), ("A", a)]), vec![m])
        });
        max.pop()
            .unwrap_or_else(|| kv_core::error::invariant("a generic of one output"))
    }

    /// One query row's unnormalized attention over a cache head, as one `linalg.generic` over
    /// `(query row, output, key)` carrying `compilation_info` (see [`Self::row_contract_i16`]):
    /// `e = exp(scores [G, P] - max [G])` against the values `v [P, d]`, returning `Σ e·v` and
    /// `Σ e` (`[G, d]` each; every output column holds the same sum). The exponentials are never
    /// written out, and the sum needs no reduction of its own.
    pub fn exp_product(&mut self, scores: &V, max: &V, v: &V, compilation_info: &str) -> (V, V) {
        let g = scores.ty.static_dims()[0];
        let d = v.ty.static_dims()[1];
        let ty = Ty::fixed(&[g, d], Elem::F32);
        let (acc0, sum0) = (self.zeros(&ty), self.zeros(&ty));
        let attrs = format!(" attrs = {{compilation_info = {compilation_info}}}");
        let ins = [(scores, "d0, d2"), (max, "d0"), (v, "d2, d1")];
        let outs = [(&acc0, "d0, d1"), (&sum0, "d0, d1")];
        let parts = self.generic(&ins, &outs, 1, &attrs, |b, args| {
            let [s, m, x, acc, sum] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            let [diff, e, p, acc1, sum1] = std::array::from_fn(|_| b.fresh());
            let ops = templates::EXP_PRODUCT.fill(&[
                ("DIFF", &diff),
                ("S", s),
                ("MAX", m),
                ("E", &e),
                ("P", &p),
                ("X", x),
                ("ACC1", &acc1),
                ("ACC", acc),
                ("SUM1", &sum1),
                ("SUM", sum),
            ]);
            (ops, vec![acc1, sum1])
        });
        let [acc, sum] = <[V; 2]>::try_from(parts).unwrap_or_else(|_| kv_core::error::invariant("two outputs"));
        (acc, sum)
    }

    /// `fq[g]·fk · Σ_d q[g, d]·k[d]` of `q [G, d]`, `k [d]`, `fq [G]`, `fk []`: `[G]`, one
    /// reduction whose body applies both factors to each term. As a product and a
    /// multiplication after it, IREE fused the multiplication, and whatever read it next, into
    /// the product's dispatch; with any factor made before it, the factor was a dispatch of
    /// its own.
    pub fn scaled_row_dot(&mut self, q: &V, k: &V, fq: &V, fk: &V) -> V {
        let g = q.ty.static_dims()[0];
        let init = self.zeros(&Ty::fixed(&[g], Elem::F32));
        let ins = [(q, "d0, d1"), (k, "d1"), (fq, "d0"), (fk, "")];
        let mut parts = self.generic(&ins, &[(&init, "d0")], 1, "", |b, args| {
            let [qa, ka, fqa, fka, acc] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            let [p, t, u, sum] = std::array::from_fn(|_| b.fresh());
            let ops = format!(
                "{p} = arith.mulf {qa}, {ka} : f32\n{t} = arith.mulf {p}, {fqa} : f32\n{u} = arith.mulf {t}, {fka} : f32\n{sum} = arith.addf {acc}, {u} : f32\n"
            );
            (ops, vec![sum])
        });
        parts
            .pop()
            .unwrap_or_else(|| kv_core::error::invariant("a generic of one output"))
    }

    /// One query row's scores against KV head `head` of a cache `cache [P, nKV, d]` and against
    /// the call's own row `new [1, nKV, d]`, left in `lanes` partial sums each (lane `l` sums
    /// elements `l, l + lanes, …` of `q [G, d]` times a key): `[G, P, lanes]` and `[G, lanes]`,
    /// summed across the lanes where [`Self::online_exp_values`] and [`Self::online_merge`]
    /// read them. As one reduction a score IREE gave each one thread looping over all of `d`
    /// with its sum in memory: 2,564 threads for a sliding layer of the FunctionGemma twin, the
    /// step's slowest dispatch (167 µs on an H100). The lanes' products are plain reductions of
    /// two inputs (no `tensor.extract`, no `linalg.index`) with `math.fma` bodies, which IREE
    /// vectorizes over the lanes (`BaseVectorize`; a `mulf`/`addf` body is taken for a batch
    /// matmul whose threads read keys 8 rows apart): 43 µs. Summed in their readers, not in a
    /// dispatch of their own: on the H100 the portable step costs about 20 µs a dispatch
    /// whatever it holds, and forms with one or two such dispatches a layer more decoded no
    /// faster; the own row's lanes written beside the cache's were copied, two dispatches more
    /// (session 27, `docs/benchmarks.md`).
    pub fn scores_in_lanes(&mut self, q: &V, cache: &V, new: &V, head: usize, lanes: usize) -> (V, V) {
        let [g, d] = q.ty.static_dims()[..] else {
            kv_core::error::invariant("queries are [G, d]")
        };
        let [p, n_kv, _] = cache.ty.static_dims()[..] else {
            kv_core::error::invariant("caches are [P, nKV, d]")
        };
        let lanes = if d % lanes == 0 { lanes } else { 1 };
        let q3 = self.reshape_static(q, &[g, d / lanes, lanes]);
        let lane_sums = |b: &mut Self, keys: &V, rows: usize| {
            let keys = if n_kv == 1 {
                keys.clone()
            } else {
                b.slice(keys, &[(0, rows), (head, head + 1), (0, d)])
            };
            let k3 = b.reshape_static(&keys, &[rows, d / lanes, lanes]);
            let init = b.zeros(&Ty::fixed(&[g, rows, lanes], Elem::F32));
            // d0 query row, d1 key, d2 lane, d3 the lane's step.
            let mut parts = b.generic(
                &[(&q3, "d0, d3, d2"), (&k3, "d1, d3, d2")],
                &[(&init, "d0, d1, d2")],
                1,
                "",
                |b, args| {
                    let [qa, ka, acc] = args else {
                        kv_core::error::invariant("a block argument per input and output")
                    };
                    let sum = b.fresh();
                    (format!("{sum} = math.fma {qa}, {ka}, {acc} : f32\n"), vec![sum])
                },
            );
            parts
                .pop()
                .unwrap_or_else(|| kv_core::error::invariant("a generic of one output"))
        };
        let scores = lane_sums(self, cache, p);
        let own = lane_sums(self, new, 1);
        let own = self.reshape_static(&own, &[g, lanes]);
        (scores, own)
    }

    /// One query row's attention over a cache head in runs, with an online softmax, for targets
    /// without subgroup operations: the cache's scores in lanes `scores [G, P, lanes]` of
    /// [`Self::scores_in_lanes`] (read with `tensor.extract` and summed across the lanes),
    /// masked by `mask [G, runs, run]` (`i1`, false: masked) in the body, against values
    /// `v [runs, run, d]`. Each output `(g, run, j)` is one thread's loop over its run keeping
    /// the run's maximum `m`, `Σ e^(s-m)·v` and `Σ e^(s-m)`
    /// (rescaled as the maximum grows). No maximum over all keys first: the two reductions of
    /// that maximum, the exponentials written out and their tiled sum were four dispatches a
    /// layer of their own. Results `(m, acc, sum)`, `[G, runs, d]` each (`m` the same along
    /// `d`). A run whose every key is masked keeps `m` at `MASKED`, which the merge's own row
    /// outweighs.
    pub fn online_exp_values(&mut self, scores: &V, mask: &V, v: &V) -> (V, V, V) {
        let [g, runs, run] = mask.ty.static_dims()[..] else {
            kv_core::error::invariant("masks in runs are [G, runs, run]")
        };
        let d = v.ty.static_dims()[2];
        let ty = Ty::fixed(&[g, runs, d], Elem::F32);
        let m0 = self.filled(&ty, ONLINE_MAX_INIT);
        let (a0, s0) = (self.zeros(&ty), self.zeros(&ty));
        // d0 query row, d1 run, d2 output, d3 key in the run.
        let ins = [(mask, "d0, d1, d3"), (v, "d1, d3, d2")];
        let outs = [(&m0, "d0, d1, d2"), (&a0, "d0, d1, d2"), (&s0, "d0, d1, d2")];
        let parts = self.generic(&ins, &outs, 1, "", |b, args| {
            let [keep, x, m, acc, sum] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            let [row, r, k, len, base, t, masked, sc] = std::array::from_fn(|_| b.fresh());
            let mut ops = String::new();
            writeln!(ops, "{row} = linalg.index 0 : index").unwrap();
            writeln!(ops, "{r} = linalg.index 1 : index").unwrap();
            writeln!(ops, "{k} = linalg.index 3 : index").unwrap();
            writeln!(ops, "{len} = arith.constant {run} : index").unwrap();
            writeln!(ops, "{base} = arith.muli {r}, {len} : index").unwrap();
            writeln!(ops, "{t} = arith.addi {base}, {k} : index").unwrap();
            let raw = b.sum_of_lanes(&mut ops, scores, &[&row, &t]);
            writeln!(ops, "{masked} = arith.constant {MASKED_LITERAL} : f32").unwrap();
            writeln!(ops, "{sc} = arith.select {keep}, {raw}, {masked} : f32").unwrap();
            let (step, yields) = b.online_softmax_step((m, &sc), (x, None), (acc, sum));
            (format!("{ops}{step}"), yields)
        });
        let [m, acc, sum] = <[V; 3]>::try_from(parts).unwrap_or_else(|_| kv_core::error::invariant("three outputs"));
        (m, acc, sum)
    }

    /// The runs of [`Self::online_exp_values`] merged (`[G, runs, d]` each → `[G, d]`): the
    /// largest maximum `M`, and the runs' sums rescaled to it, `Σ e^(m-M)·acc`, `Σ e^(m-M)·sum`,
    /// the call's own row merged first (`own`: its score's lanes `[G, lanes]` of
    /// [`Self::scores_in_lanes`], summed here, and its value `[1, d]`, weight 1, read with
    /// `tensor.extract`), so that nothing is left to join after the merge but the division.
    pub fn online_merge(&mut self, m: &V, acc: &V, sum: &V, (own, value): (&V, &V)) -> (V, V, V) {
        let [g, _, d] = m.ty.static_dims()[..] else {
            kv_core::error::invariant("runs are [G, runs, d]")
        };
        let ty = Ty::fixed(&[g, d], Elem::F32);
        let m0 = self.filled(&ty, ONLINE_MAX_INIT);
        let (a0, s0) = (self.zeros(&ty), self.zeros(&ty));
        let (v_name, v_ty) = (value.name.clone(), value.ty.text());
        // d0 query row, d1 output, d2 run.
        let ins = [(m, "d0, d2, d1"), (acc, "d0, d2, d1"), (sum, "d0, d2, d1")];
        let outs = [(&m0, "d0, d1"), (&a0, "d0, d1"), (&s0, "d0, d1")];
        let parts = self.generic(&ins, &outs, 1, "", |b, args| {
            let [mr, ar, sr, m, acc, sum] = args else {
                kv_core::error::invariant("a block argument per input and output")
            };
            // The own row at the first run only, under an `scf.if`: its 16 lanes summed at every
            // run (a score of `MASKED` at the others) made the merge's loop step cost as much as
            // the values pass's (session 28, H100: 32 runs, 71 µs against 41 for 16), and the runs
            // could not be balanced. Whatever order a thread visits the runs in, run 0 is one of
            // them, once; the merge is order-free.
            let [row, col, r, zero, first, vn, one, own_state] = std::array::from_fn(|_| b.fresh());
            let mut ops = String::new();
            writeln!(ops, "{row} = linalg.index 0 : index").unwrap();
            writeln!(ops, "{col} = linalg.index 1 : index").unwrap();
            writeln!(ops, "{r} = linalg.index 2 : index").unwrap();
            writeln!(ops, "{zero} = arith.constant 0 : index").unwrap();
            writeln!(ops, "{first} = arith.cmpi eq, {r}, {zero} : index").unwrap();
            let mut then = String::new();
            let sn = b.sum_of_lanes(&mut then, own, &[&row]);
            writeln!(then, "{vn} = tensor.extract {v_name}[{zero}, {col}] : {v_ty}").unwrap();
            writeln!(then, "{one} = arith.constant 1.0 : f32").unwrap();
            let (own_step, own_yields) = b.online_softmax_step((m, &sn), (&vn, Some(&one)), (acc, sum));
            let [m1, acc1, sum1] = &own_yields[..] else {
                kv_core::error::invariant("three running values")
            };
            writeln!(ops, "{own_state}:3 = scf.if {first} -> (f32, f32, f32) {{").unwrap();
            ops.push_str(&then);
            ops.push_str(&own_step);
            writeln!(ops, "scf.yield {m1}, {acc1}, {sum1} : f32, f32, f32").unwrap();
            writeln!(ops, "}} else {{").unwrap();
            writeln!(ops, "scf.yield {m}, {acc}, {sum} : f32, f32, f32").unwrap();
            writeln!(ops, "}}").unwrap();
            let (m1, acc1, sum1) = (
                format!("{own_state}#0"),
                format!("{own_state}#1"),
                format!("{own_state}#2"),
            );
            let (run_step, yields) = b.online_softmax_step((&m1, mr), (ar, Some(sr)), (&acc1, &sum1));
            (format!("{ops}{run_step}"), yields)
        });
        let [m, acc, sum] = <[V; 3]>::try_from(parts).unwrap_or_else(|_| kv_core::error::invariant("three outputs"));
        (m, acc, sum)
    }

    /// Body ops (appended to `ops`) summing the lanes of `lanes [.., L]` at `index` (the
    /// leading indices' names), in order, by `tensor.extract`; returns the sum's name.
    fn sum_of_lanes(&mut self, ops: &mut String, lanes: &V, index: &[&String]) -> String {
        let (name, ty) = (&lanes.name, lanes.ty.text());
        let n = *lanes.ty.static_dims().last().unwrap_or(&1);
        let lead = index.iter().map(|i| i.as_str()).collect::<Vec<_>>().join(", ");
        let mut total: Option<String> = None;
        for l in 0..n {
            let [at, part] = std::array::from_fn(|_| self.fresh());
            writeln!(ops, "{at} = arith.constant {l} : index").unwrap();
            writeln!(ops, "{part} = tensor.extract {name}[{lead}, {at}] : {ty}").unwrap();
            total = Some(match total {
                None => part,
                Some(prev) => {
                    let sum = self.fresh();
                    writeln!(ops, "{sum} = arith.addf {prev}, {part} : f32").unwrap();
                    sum
                }
            });
        }
        total.unwrap_or_else(|| kv_core::error::invariant("at least one lane"))
    }

    /// The body of one online-softmax step: the running maximum `m` meets `x` (a score, or a
    /// run's maximum), the running sums are rescaled by `e^(m - m')` and gain `e^(x - m')` times
    /// `(value, weight)` (a value and, where `weight` is `None`, 1; or a run's two sums).
    fn online_softmax_step(
        &mut self,
        (m, x): (&String, &String),
        (value, weight): (&String, Option<&String>),
        (acc, sum): (&String, &String),
    ) -> (String, Vec<String>) {
        let [m1, dm, c, dx, e, ac, ev, acc1, sc, sum1] = std::array::from_fn(|_| self.fresh());
        let mut ops = String::new();
        writeln!(ops, "{m1} = arith.maximumf {m}, {x} : f32").unwrap();
        writeln!(ops, "{dm} = arith.subf {m}, {m1} : f32").unwrap();
        writeln!(ops, "{c} = math.exp {dm} : f32").unwrap();
        writeln!(ops, "{dx} = arith.subf {x}, {m1} : f32").unwrap();
        writeln!(ops, "{e} = math.exp {dx} : f32").unwrap();
        writeln!(ops, "{ac} = arith.mulf {acc}, {c} : f32").unwrap();
        writeln!(ops, "{ev} = arith.mulf {e}, {value} : f32").unwrap();
        writeln!(ops, "{acc1} = arith.addf {ac}, {ev} : f32").unwrap();
        writeln!(ops, "{sc} = arith.mulf {sum}, {c} : f32").unwrap();
        match weight {
            Some(weight) => {
                let ew = self.fresh();
                writeln!(ops, "{ew} = arith.mulf {e}, {weight} : f32").unwrap();
                writeln!(ops, "{sum1} = arith.addf {sc}, {ew} : f32").unwrap();
            }
            None => writeln!(ops, "{sum1} = arith.addf {sc}, {e} : f32").unwrap(),
        }
        (ops, vec![m1, acc1, sum1])
    }

    /// The body of an f32 × f32 product (block arguments `x`, `y`, the accumulator): multiply,
    /// accumulate.
    fn f32_product(&mut self, args: &[String]) -> (String, String) {
        let [x, y, acc] = args else {
            kv_core::error::invariant("a block argument per input, then the accumulator")
        };
        let (p, sum) = (self.fresh(), self.fresh());
        let ops = templates::F32_PRODUCT.fill(&[("P", &p), ("X", x), ("Y", y), ("ACC", acc), ("SUM", &sum)]);
        (ops, sum)
    }

    /// The body of an i16 × f32 product (block arguments `x`, the weight's bf16 bits, the
    /// accumulator): sign-extend, shift into the high half, bitcast, multiply, accumulate.
    fn widened_product(&mut self, args: &[String]) -> (String, String) {
        let [a, bits, acc] = args else {
            kv_core::error::invariant("a block argument per input, then the accumulator")
        };
        let (widen, wf) = self.widened(bits);
        let (product, sum) = self.f32_product(&[a.clone(), wf, acc.clone()]);
        (format!("{widen}\n{product}"), sum)
    }

    /// The ops widening a block argument of bf16 bits in `i16` to `f32` (sign-extend, shift into
    /// the high half, bitcast), and the widened value's name.
    fn widened(&mut self, bits: &str) -> (String, String) {
        let [wide, c16, up, wf] = std::array::from_fn(|_| self.fresh());
        let ops =
            templates::WIDEN_I16.fill(&[("WIDE", &wide), ("BITS", bits), ("C16", &c16), ("UP", &up), ("WF", &wf)]);
        (ops, wf)
    }

    /// [`Self::block_contract_q`] over values packed in `i32` words: `x [R, nb, W, E]`, `q [O, nb,
    /// W]` (word `w` holds elements `w·E .. w·E + E` of its block, `bits` wide, two's complement,
    /// little-endian: the archive's bytes viewed as words), `s [O, nb]`. The body takes element
    /// `j` of a word with two shifts. For IREE 3.13's portable Vulkan target, which miscompiles
    /// loads of 8-bit tensors of a few thousand elements or more (a 2048 × 640 q8 matvec was off
    /// by up to 48 on lavapipe; the same product over `i32` words is exact).
    pub fn block_contract_words(&mut self, x: &V, q: &V, s: &V, bits: u32) -> V {
        let o = q.ty.static_dims()[0];
        let top = 32 - bits;
        let maps = ["d0, d2, d3, d4", "d1, d2, d3", "d1, d2"];
        self.contraction(&[x, q, s], o, &maps, 3, |b, args| {
            let [a, word, sc, acc] = args else {
                kv_core::error::invariant("a block argument per input, then the accumulator")
            };
            let [j, ji, cb, ctop, sh, left, up, qv, qf, w, p, sum]: [String; 12] = std::array::from_fn(|_| b.fresh());
            let ops = templates::WORD_DEQUANT_PRODUCT.fill(&[
                ("J", &j),
                ("JI", &ji),
                ("CB", &cb),
                ("BITS", &bits.to_string()),
                ("CTOP", &ctop),
                ("TOP", &top.to_string()),
                ("SH", &sh),
                ("LEFT", &left),
                ("UP", &up),
                ("WORD", word),
                ("QV", &qv),
                ("QF", &qf),
                ("W", &w),
                ("SC", sc),
                ("A", a),
                ("P", &p),
                ("ACC", acc),
                ("SUM", &sum),
            ]);
            (ops, sum)
        })
    }

    /// Rows `indices [n] i32` of a static `[rows, width]` table: `[n, width]`.
    pub fn gather_rows(&mut self, table: &V, indices: &V) -> V {
        let td = table.ty.static_dims();
        let n = indices.ty.static_dims()[0];
        let idx = self.reshape_static(indices, &[n, 1]);
        let ty = Ty::fixed(&[n, td[1]], table.ty.elem);
        self.op(
            ty.clone(),
            format!(
                "\"stablehlo.gather\"({}, {}) {{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, {}>}} : ({}, {}) -> {}",
                table.name,
                idx.name,
                td[1],
                table.ty.text(),
                idx.ty.text(),
                ty.text()
            ),
        )
    }
}

/// The two results `%name#0` and `%name#1` of an op written `%name:2 = ...`.
fn results2(name: &str, first: Ty, second: Ty) -> (V, V) {
    (
        V {
            name: format!("{name}#0"),
            ty: first,
        },
        V {
            name: format!("{name}#1"),
            ty: second,
        },
    )
}
