//! Each fused form of the emitter on its own (`export::testing::emit_form`: one function running
//! the form on its arguments), compiled for the CPU and run with `iree-run-module` on
//! `local-task`, against the same arithmetic written plainly with ndarray. The graph tests
//! (`graphs.rs`, `v2.rs`) compare whole models, where a wrong fused form shows as a diverging
//! token far from its cause; here a failure names the form. The staged argmax has its own file
//! (`argmax.rs`, CPU and Vulkan).
//!
//! Inputs are seeded noise in [-4, 4); the seed is printed, and `SKAINET_FORMS_SEED` replays it.
//! Sizes are tiny (each module compiles in about a second). A missing tool fails, never skips.

mod common;

use approx::relative_eq;
use common::{run_module, Array, Noise};
use export::testing::{emit_form, Form, RMS_EPS};
use export::Target;
use kv_core::Activation;
use ndarray::{concatenate, s, Array1, Array2, Array3, ArrayView1, ArrayView2, Axis};

/// `|got - want| ≤ ABS`, or within `REL` of the larger magnitude: f32 sums of a few hundred
/// terms of size ≤ 16 in another order than ndarray's, and `exp`/`tanh`/`rsqrt` of IREE's math
/// library, which differs from Rust's in the last bits.
const ABS: f32 = 2e-4;
const REL: f32 = 2e-4;

fn seed() -> u64 {
    let seed = match std::env::var("SKAINET_FORMS_SEED") {
        Ok(s) => s.parse().expect("SKAINET_FORMS_SEED: a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    };
    // (xorshift stays at 0 from 0)
    let seed = seed | 1;
    eprintln!("SKAINET_FORMS_SEED={seed}");
    seed
}

/// `form`'s module compiled for the CPU and run on `inputs`: its `n_out` results.
fn run(form: Form, inputs: &[Array], n_out: usize) -> Vec<Array> {
    let dir = tempfile::tempdir().unwrap();
    let mlir = dir.path().join("form.mlir");
    let vmfb = dir.path().join("form.vmfb");
    std::fs::write(&mlir, emit_form(form)).unwrap();
    export::compile(&mlir, &Target::cpu(), &vmfb).unwrap_or_else(|e| panic!("{form:?}: {e}"));
    run_module(dir.path(), "local-task", &vmfb, &[], "form", inputs, n_out)
}

/// Every element within the tolerance, else a panic naming the first mismatches and the seed.
#[track_caller]
fn assert_close(what: &str, seed: u64, got: &Array, want: ArrayView2<f32>) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let want: Vec<f32> = want.iter().copied().collect();
    let bad: Vec<String> = got
        .f32()
        .iter()
        .zip(&want)
        .enumerate()
        .filter(|(_, (g, w))| !relative_eq!(**g, **w, epsilon = ABS, max_relative = REL))
        .map(|(i, (g, w))| format!("[{i}] got {g}, want {w}"))
        .collect();
    assert!(
        bad.is_empty(),
        "{what} (SKAINET_FORMS_SEED={seed}): {} of {} elements differ: {}",
        bad.len(),
        want.len(),
        bad[..bad.len().min(5)].join("; ")
    );
}

fn matrix(noise: &mut Noise, rows: usize, cols: usize) -> Array2<f32> {
    Array2::from_shape_vec((rows, cols), noise.row(rows * cols)).unwrap()
}

fn f32s(a: &Array2<f32>) -> Array {
    Array::F32(a.shape().to_vec(), a.iter().copied().collect())
}

fn vector(a: &Array1<f32>) -> Array {
    Array::F32(vec![a.len()], a.to_vec())
}

/// A weight as the archive holds it: bf16 bits (truncated from `noise`), and its values.
fn bf16_weight(noise: &mut Noise, rows: usize, cols: usize) -> (Vec<i16>, Array2<f32>) {
    let bits: Vec<i16> = noise
        .row(rows * cols)
        .iter()
        .map(|x| (x.to_bits() >> 16) as i16)
        .collect();
    let values = bits.iter().map(|&b| f32::from_bits((b as u16 as u32) << 16)).collect();
    (bits, Array2::from_shape_vec((rows, cols), values).unwrap())
}

/// `x · rsqrt(mean(x²) + eps) · w` per row.
fn rmsnorm(x: ArrayView2<f32>, w: ArrayView1<f32>) -> Array2<f32> {
    let mut y = x.to_owned();
    for mut row in y.rows_mut() {
        let factor = 1.0 / (row.mapv(|v| v * v).mean().unwrap() + RMS_EPS).sqrt();
        row.zip_mut_with(&w, |v, w| *v = *v * factor * w);
    }
    y
}

fn rms_norm(parallel: bool) {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, n) = (3, 96);
    let x = matrix(&mut noise, rows, n);
    let w = Array1::from(noise.row(n));
    let got = run(Form::RmsNorm { rows, n, parallel }, &[f32s(&x), vector(&w)], 1);
    assert_close("rmsnorm", seed, &got[0], rmsnorm(x.view(), w.view()).view());
}

#[test]
fn rms_norm_in_one_reduction() {
    rms_norm(false);
}

#[test]
fn rms_norm_in_runs_of_32() {
    rms_norm(true);
}

/// `normed_products`, plain and with a pending post-norm addition, against the norm of the
/// stream (made explicit) times each weight.
fn normed_products(carried: bool) {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (n, out, weights) = (64, 96, 2);
    let x = matrix(&mut noise, 1, n);
    let d = matrix(&mut noise, 1, n);
    let post = Array1::from(noise.row(n));
    let norm = Array1::from(noise.row(n));
    let ws: Vec<(Vec<i16>, Array2<f32>)> = (0..weights).map(|_| bf16_weight(&mut noise, out, n)).collect();
    let mut inputs = vec![f32s(&x)];
    let h = if carried {
        inputs.extend([f32s(&d), vector(&post)]);
        &x + &rmsnorm(d.view(), post.view())
    } else {
        x.clone()
    };
    inputs.push(vector(&norm));
    inputs.extend(ws.iter().map(|(bits, _)| Array::I16(vec![out, n], bits.clone())));
    let form = match carried {
        false => Form::NormedProducts { n, out, weights },
        true => Form::CarriedNormedProducts { n, out, weights },
    };
    let got = run(form, &inputs, weights);
    let normed = rmsnorm(h.view(), norm.view());
    for (i, (_, w)) in ws.iter().enumerate() {
        assert_close(
            &format!("{form:?}, product {i}"),
            seed,
            &got[i],
            normed.dot(&w.t()).view(),
        );
    }
}

#[test]
fn normed_products_one_dispatch() {
    normed_products(false);
}

#[test]
fn normed_products_of_a_pending_stream() {
    normed_products(true);
}

#[test]
fn product_writing_the_stream_out() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (n, inner) = (64, 128);
    let x = matrix(&mut noise, 1, inner);
    let (bits, w) = bf16_weight(&mut noise, n, inner);
    let base = matrix(&mut noise, 1, n);
    let d = matrix(&mut noise, 1, n);
    let post = Array1::from(noise.row(n));
    let inputs = [
        f32s(&x),
        Array::I16(vec![n, inner], bits),
        f32s(&base),
        f32s(&d),
        vector(&post),
    ];
    let got = run(Form::ProductSettling { n, inner }, &inputs, 2);
    assert_close("product", seed, &got[0], x.dot(&w.t()).view());
    assert_close(
        "stream",
        seed,
        &got[1],
        (&base + &rmsnorm(d.view(), post.view())).view(),
    );
}

/// q4 blocks: values in -8..8 and scales `[out, inner/32]`, with the dequantized weight.
fn q4_weight(noise: &mut Noise, out: usize, inner: usize) -> (Vec<i8>, Array2<f32>, Array2<f32>) {
    let q: Vec<i8> = noise
        .row(out * inner)
        .iter()
        .map(|v| (v * 2.0).floor().clamp(-8.0, 7.0) as i8)
        .collect();
    let scales = matrix(noise, out, inner / 32).mapv(|s| s / 8.0);
    let w = Array2::from_shape_fn((out, inner), |(o, k)| q[o * inner + k] as f32 * scales[[o, k / 32]]);
    (q, scales, w)
}

#[test]
fn q4_product_dequantized_in_its_body() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, out, inner) = (3, 16, 96);
    let x = matrix(&mut noise, rows, inner);
    let (q, scales, w) = q4_weight(&mut noise, out, inner);
    let inputs = [f32s(&x), Array::I8(vec![out, inner / 32, 32], q), f32s(&scales)];
    let got = run(Form::Q4Product { rows, out, inner }, &inputs, 1);
    assert_close("q4 product", seed, &got[0], x.dot(&w.t()).view());
}

#[test]
fn q4_product_of_packed_words() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, out, inner) = (2, 16, 96);
    let x = matrix(&mut noise, rows, inner);
    let (q, scales, w) = q4_weight(&mut noise, out, inner);
    let words: Vec<i32> = q
        .chunks(8)
        .map(|e| {
            e.iter()
                .enumerate()
                .fold(0u32, |word, (j, &v)| word | ((v as u32 & 0xF) << (4 * j))) as i32
        })
        .collect();
    let inputs = [f32s(&x), Array::I32(vec![out, inner / 32, 4], words), f32s(&scales)];
    let got = run(Form::Q4WordsProduct { rows, out, inner }, &inputs, 1);
    assert_close("q4 words product", seed, &got[0], x.dot(&w.t()).view());
}

/// bf16 bits packed in pairs, element `2k` in the low half of word `k`.
fn pack_pairs(bits: &[i16]) -> Vec<i32> {
    bits.chunks(2)
        .map(|p| ((p[1] as u16 as u32) << 16 | p[0] as u16 as u32) as i32)
        .collect()
}

#[test]
fn packed_pairs_read_in_place() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, out, inner) = (1, 8, 128);
    let x = matrix(&mut noise, rows, inner);
    let (bits, w) = bf16_weight(&mut noise, out, inner);
    let inputs = [f32s(&x), Array::I32(vec![out, inner / 2], pack_pairs(&bits))];
    let got = run(Form::PairsProduct { rows, out, inner }, &inputs, 1);
    assert_close("packed pairs product", seed, &got[0], x.dot(&w.t()).view());
}

#[test]
fn gate_and_up_of_one_packed_matrix() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    // 64 words a row: 4 runs of 16 (`pair_splits`), two rows as a chunk call has.
    let (rows, ff, inner) = (2, 12, 128);
    let x = matrix(&mut noise, rows, inner);
    let (bits, w) = bf16_weight(&mut noise, 2 * ff, inner);
    let inputs = [f32s(&x), Array::I32(vec![2 * ff, inner / 2], pack_pairs(&bits))];
    let got = run(Form::GatedPairsProduct { rows, ff, inner }, &inputs, 2);
    let want = x.dot(&w.t());
    assert_close("gate of the fused matrix", seed, &got[0], want.slice(s![.., ..ff]));
    assert_close("up of the fused matrix", seed, &got[1], want.slice(s![.., ff..]));
}

#[test]
fn packed_pairs_in_interleaved_lanes() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    // 96 words: 6 a lane over 16 lanes.
    let (rows, out, inner) = (2, 24, 192);
    let x = matrix(&mut noise, rows, inner);
    let (bits, w) = bf16_weight(&mut noise, out, inner);
    let inputs = [f32s(&x), Array::I32(vec![out, inner / 2], pack_pairs(&bits))];
    let got = run(Form::PairsProductLanes { rows, out, inner }, &inputs, 1);
    assert_close("packed pairs product in lanes", seed, &got[0], x.dot(&w.t()).view());
}

#[test]
fn norm_of_a_packed_weight_widened() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, n) = (3, 96);
    let x = matrix(&mut noise, rows, n);
    let (bits, w) = bf16_weight(&mut noise, 1, n);
    let inputs = [f32s(&x), Array::I32(vec![n / 2], pack_pairs(&bits))];
    let got = run(Form::PackedNorm { rows, n }, &inputs, 1);
    assert_close(
        "norm of packed pairs",
        seed,
        &got[0],
        rmsnorm(x.view(), w.row(0)).view(),
    );
}

/// The portable profiles' pending post-norm made by the next norm: two rows, 96 wide (three
/// runs of 32), the stream ~50 times the block's output as in a real model's residual.
#[test]
fn pending_post_norm_settled_by_the_next_norm() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, n) = (2, 96);
    let x = matrix(&mut noise, rows, n).mapv(|v| v * 50.0);
    let d = matrix(&mut noise, rows, n);
    let (post_bits, post) = bf16_weight(&mut noise, 1, n);
    let (norm_bits, norm) = bf16_weight(&mut noise, 1, n);
    let inputs = [
        f32s(&x),
        f32s(&d),
        Array::I32(vec![n / 2], pack_pairs(&post_bits)),
        Array::I32(vec![n / 2], pack_pairs(&norm_bits)),
    ];
    let got = run(Form::CarriedNorm { rows, n }, &inputs, 2);
    let h = &x + &rmsnorm(d.view(), post.row(0));
    assert_close("the stream settled", seed, &got[0], h.view());
    assert_close(
        "the stream normed",
        seed,
        &got[1],
        rmsnorm(h.view(), norm.row(0)).view(),
    );
}

#[test]
fn i16_product_widened_in_its_body() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, out, inner) = (3, 48, 96);
    let x = matrix(&mut noise, rows, inner);
    let (bits, w) = bf16_weight(&mut noise, out, inner);
    let inputs = [f32s(&x), Array::I16(vec![out, inner], bits)];
    let got = run(Form::ContractI16 { rows, out, inner }, &inputs, 1);
    assert_close("i16 product", seed, &got[0], x.dot(&w.t()).view());
}

#[test]
fn one_row_i16_product_configured() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (out, inner) = (40, 128);
    let x = matrix(&mut noise, 1, inner);
    let (bits, w) = bf16_weight(&mut noise, out, inner);
    let inputs = [f32s(&x), Array::I16(vec![out, inner], bits)];
    let got = run(Form::RowContractI16 { out, inner }, &inputs, 1);
    assert_close("one-row i16 product", seed, &got[0], x.dot(&w.t()).view());
}

#[test]
fn attention_products_configured() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (g, rows, d) = (4, 64, 16);
    for scores in [true, false] {
        let a = matrix(&mut noise, g, if scores { d } else { rows });
        let c = matrix(&mut noise, rows, d);
        let got = run(Form::ConfiguredProduct { g, rows, d, scores }, &[f32s(&a), f32s(&c)], 1);
        let want = if scores { a.dot(&c.t()) } else { a.dot(&c) };
        let what = if scores {
            "configured scores"
        } else {
            "configured values"
        };
        assert_close(what, seed, &got[0], want.view());
    }
}

/// `mul_reduce_split` against `a · cᵀ` / `a · c`: the scores (`g·p·16 ≤ 16,384`) in 16
/// interleaved lanes of the head dimension, the values in runs of the keys (`key_runs(g·d, p)`
/// = 8 runs of 16 here). Above the lanes' threshold the scores are `mul_reduce`, tested by
/// `per_kv_head_products_over_a_cache`.
fn split_product(scores: bool) {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (g, p, d) = if scores { (4, 24, 64) } else { (4, 128, 16) };
    let a = matrix(&mut noise, g, if scores { d } else { p });
    let c = matrix(&mut noise, p, d);
    let got = run(Form::SplitProduct { g, p, d, scores }, &[f32s(&a), f32s(&c)], 1);
    let want = if scores { a.dot(&c.t()) } else { a.dot(&c) };
    let what = if scores { "scores in lanes" } else { "values in runs" };
    assert_close(what, seed, &got[0], want.view());
}

#[test]
fn split_scores_in_lanes() {
    split_product(true);
}

#[test]
fn split_values_in_runs() {
    split_product(false);
}

#[test]
fn per_kv_head_products_over_a_cache() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (nkv, q, rows, d) = (2, 3, 16, 8);
    for scores in [true, false] {
        for by_reduce in [false, true] {
            let a = array3(&mut noise, (nkv, q, if scores { d } else { rows }));
            let c = array3(&mut noise, (rows, nkv, d));
            let form = Form::KvProduct {
                nkv,
                q,
                rows,
                d,
                scores,
                by_reduce,
            };
            let got = run(form, &[f32s3(&a), f32s3(&c)], 1);
            let n = if scores { rows } else { d };
            let mut want = Array2::zeros((nkv * q, n));
            for h in 0..nkv {
                let (ah, ch) = (a.slice(s![h, .., ..]), c.slice(s![.., h, ..]));
                let y = if scores { ah.dot(&ch.t()) } else { ah.dot(&ch) };
                want.slice_mut(s![h * q..(h + 1) * q, ..]).assign(&y);
            }
            let got = Array::F32(vec![nkv * q, n], got[0].f32().to_vec());
            let what = format!("kv product (scores {scores}, by reduce {by_reduce})");
            assert_close(&what, seed, &got, want.view());
        }
    }
}

/// Softmax of each row of `[sc | sn]`.
fn softmax_rows(sc: &Array2<f32>, sn: &Array2<f32>) -> Array2<f32> {
    let mut all = concatenate![Axis(1), *sc, *sn];
    for mut row in all.rows_mut() {
        let max = row.fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        row.mapv_inplace(|v| (v - max).exp());
        let sum = row.sum();
        row.mapv_inplace(|v| v / sum);
    }
    all
}

fn softmax_split(tiled: bool) {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (q, p, r) = (4, 128, 3);
    // Scores of a few units apart, as attention's are, and one key far ahead of the rest.
    let mut sc = matrix(&mut noise, q, p).mapv(|v| v * 2.0);
    sc[[1, 77]] = 30.0;
    let sn = matrix(&mut noise, q, r).mapv(|v| v * 2.0);
    let got = run(Form::SoftmaxSplit { q, p, r, tiled }, &[f32s(&sc), f32s(&sn)], 2);
    let want = softmax_rows(&sc, &sn);
    assert_close("cache probabilities", seed, &got[0], want.slice(s![.., ..p]));
    assert_close("own probabilities", seed, &got[1], want.slice(s![.., p..]));
}

#[test]
fn softmax_split_in_tiles() {
    softmax_split(true);
}

#[test]
fn softmax_split_untiled() {
    softmax_split(false);
}

#[test]
fn attention_of_one_row() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (g, p, d) = (4, 64, 16);
    let sc = matrix(&mut noise, g, p).mapv(|v| v * 2.0);
    let sn = matrix(&mut noise, g, 1).mapv(|v| v * 2.0);
    let vc = matrix(&mut noise, p, d);
    let vn = matrix(&mut noise, 1, d);
    let inputs = [f32s(&sc), f32s(&sn), f32s(&vc), f32s(&vn)];
    let got = run(Form::AttentionRow { g, p, d }, &inputs, 1);
    let probs = softmax_rows(&sc, &sn);
    let want = probs.dot(&concatenate![Axis(0), vc, vn]);
    assert_close("attention row", seed, &got[0], want.view());
}

/// The portable form (the scores in 16 lanes, `d` 48 so that a lane loops three times, summed
/// where they are read; runs of 16 keys, an online softmax) over KV head 1 of 2, with masked
/// keys as the graphs mask them: a whole run of them (the cache past `pos`), scattered ones, and
/// one query row whose every cache key is masked (the first token), where only the call's own
/// row counts. Scores up to ±~100, so that a run's maximum is far from the others'.
#[test]
fn attention_of_one_row_in_runs_with_an_online_softmax() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (g, p, d, nkv, head) = (4, 128, 48, 2, 1);
    let q = matrix(&mut noise, g, d).mapv(|v| v * 1.5);
    let kc = array3(&mut noise, (p, nkv, d));
    let kn = array3(&mut noise, (1, nkv, d));
    let vc = matrix(&mut noise, p, d);
    let vn = matrix(&mut noise, 1, d);
    let mut mask_c = Array2::<i32>::ones((g, p));
    mask_c.slice_mut(s![.., 96..]).fill(0);
    for k in (0..96).step_by(7) {
        mask_c[[1, k]] = 0;
    }
    mask_c.row_mut(3).fill(0);
    let inputs = [
        f32s(&q),
        f32s3(&kc),
        f32s3(&kn),
        f32s(&vc),
        f32s(&vn),
        Array::I32(vec![g, p], mask_c.iter().copied().collect()),
    ];
    let form = Form::AttentionRowOnline { g, p, d, nkv, head };
    let got = run(form, &inputs, 1);
    let keys = kc.slice(s![.., head, ..]);
    let sc = q.dot(&keys.t());
    let sc = ndarray::Zip::from(&sc)
        .and(&mask_c)
        .map_collect(|&s, &m| if m == 0 { kv_core::mask::MASKED } else { s });
    let sn = q.dot(&kn.slice(s![0, head, ..]).insert_axis(Axis(1)));
    let probs = softmax_rows(&sc, &sn);
    let want = probs.dot(&concatenate![Axis(0), vc, vn]);
    assert_close(&format!("{form:?}"), seed, &got[0], want.view());
}

fn array3(noise: &mut Noise, dims: (usize, usize, usize)) -> Array3<f32> {
    Array3::from_shape_vec(dims, noise.row(dims.0 * dims.1 * dims.2)).unwrap()
}

fn f32s3(a: &Array3<f32>) -> Array {
    Array::F32(a.shape().to_vec(), a.iter().copied().collect())
}

/// `rope(rmsnorm(x, w)) · scale` of one head's row `x [d]` at the tables' row `cos`, `sin`:
/// `n·cos + swap_halves(n)·sin` of the normed `n`.
fn norm_rope_row(
    x: ArrayView1<f32>,
    w: ArrayView1<f32>,
    cos: ArrayView1<f32>,
    sin: ArrayView1<f32>,
    scale: f32,
) -> Array1<f32> {
    let d = x.len();
    let factor = 1.0 / (x.mapv(|v| v * v).mean().unwrap() + RMS_EPS).sqrt();
    let n = &x * &w * factor;
    Array1::from_shape_fn(d, |i| (n[i] * cos[i] + n[(i + d / 2) % d] * sin[i]) * scale)
}

#[test]
fn norm_then_rotation_per_head() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, heads, d) = (3, 2, 16);
    let x = array3(&mut noise, (rows, heads, d));
    let w = Array1::from(noise.row(d));
    let (cos, sin) = (matrix(&mut noise, rows, d), matrix(&mut noise, rows, d));
    let inputs = [f32s3(&x), vector(&w), f32s(&cos), f32s(&sin)];
    let got = run(Form::NormRope { rows, heads, d }, &inputs, 1);
    let mut want = Array2::zeros((rows * heads, d));
    for r in 0..rows {
        for h in 0..heads {
            let row = norm_rope_row(x.slice(s![r, h, ..]), w.view(), cos.row(r), sin.row(r), 1.0);
            want.row_mut(r * heads + h).assign(&row);
        }
    }
    let got = Array::F32(vec![rows * heads, d], got[0].f32().to_vec());
    assert_close("norm_rope", seed, &got, want.view());
}

/// `qkv_norm_rope`, the norms' factor per head (one reduction) or, with `split`, per element
/// (runs of 32, then across them: `d` 64).
fn qk_norms_and_rotation(split: bool) {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, nh, nkv, d) = (2, 4, 2, if split { 64 } else { 16 });
    let heads = nh + 2 * nkv;
    let y = array3(&mut noise, (rows, heads, d));
    let (qw, kw) = (Array1::from(noise.row(d)), Array1::from(noise.row(d)));
    let (cos, sin) = (matrix(&mut noise, rows, d), matrix(&mut noise, rows, d));
    let inputs = [f32s3(&y), vector(&qw), vector(&kw), f32s(&cos), f32s(&sin)];
    let form = Form::QkvNormRope {
        rows,
        nh,
        nkv,
        d,
        split,
    };
    let got = run(form, &inputs, 1);
    let mut want = Array2::zeros((rows * heads, d));
    for r in 0..rows {
        for h in 0..heads {
            let x = y.slice(s![r, h, ..]);
            let row = if h < nh {
                norm_rope_row(x, qw.view(), cos.row(r), sin.row(r), 1.0 / (d as f32).sqrt())
            } else if h < nh + nkv {
                norm_rope_row(x, kw.view(), cos.row(r), sin.row(r), 1.0)
            } else {
                x.to_owned()
            };
            want.row_mut(r * heads + h).assign(&row);
        }
    }
    let got = Array::F32(vec![rows * heads, d], got[0].f32().to_vec());
    assert_close(&format!("{form:?}"), seed, &got, want.view());
}

/// The portable form: the norm weights as packed pairs, `d` 64 (runs of 32).
#[test]
fn qk_norms_and_rotation_of_packed_weights() {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, nh, nkv, d) = (2, 4, 1, 64);
    let heads = nh + 2 * nkv;
    let y = array3(&mut noise, (rows, heads, d));
    let (qbits, qw) = bf16_weight(&mut noise, 1, d);
    let (kbits, kw) = bf16_weight(&mut noise, 1, d);
    let (cos, sin) = (matrix(&mut noise, rows, d), matrix(&mut noise, rows, d));
    let inputs = [
        f32s3(&y),
        Array::I32(vec![d / 2], pack_pairs(&qbits)),
        Array::I32(vec![d / 2], pack_pairs(&kbits)),
        f32s(&cos),
        f32s(&sin),
    ];
    let form = Form::QkvNormRopePacked { rows, nh, nkv, d };
    let got = run(form, &inputs, 1);
    let mut want = Array2::zeros((rows * heads, d));
    for r in 0..rows {
        for h in 0..heads {
            let x = y.slice(s![r, h, ..]);
            let row = if h < nh {
                norm_rope_row(x, qw.row(0), cos.row(r), sin.row(r), 1.0 / (d as f32).sqrt())
            } else if h < nh + nkv {
                norm_rope_row(x, kw.row(0), cos.row(r), sin.row(r), 1.0)
            } else {
                x.to_owned()
            };
            want.row_mut(r * heads + h).assign(&row);
        }
    }
    let got = Array::F32(vec![rows * heads, d], got[0].f32().to_vec());
    assert_close(&format!("{form:?}"), seed, &got, want.view());
}

#[test]
fn qk_norms_and_rotation_over_the_fused_product() {
    qk_norms_and_rotation(false);
}

#[test]
fn qk_norms_and_rotation_with_split_reductions() {
    qk_norms_and_rotation(true);
}

fn gate(activation: Activation) {
    let seed = seed();
    let mut noise = Noise::new(seed);
    let (rows, n) = (2, 64);
    let g = matrix(&mut noise, rows, n);
    let got = run(Form::Gate { activation, rows, n }, &[f32s(&g)], 1);
    let want = g.mapv(|v| match activation {
        Activation::GeluTanh => {
            0.5 * v * (1.0 + ((2.0f32 / std::f32::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
        }
        Activation::Silu => v / (1.0 + (-v).exp()),
    });
    assert_close(&format!("{activation:?}"), seed, &got[0], want.view());
}

#[test]
fn gelu_tanh_gate() {
    gate(Activation::GeluTanh);
}

#[test]
fn silu_gate() {
    gate(Activation::Silu);
}
