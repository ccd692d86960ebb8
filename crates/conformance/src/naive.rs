//! An independent forward with no cache: every position recomputed from the token list, loop by
//! loop, with its own RoPE (`rotate_half`, angles in f64) and its own visibility rule. It shares
//! only the weights with `backend-reference`, so a mistake in the shared tables, masks or window
//! plans shows up as a disagreement here.

use backend_reference::ReferenceModel;
use kv_core::{Activation, LayerKind};
use ndarray::{Array1, Array2};

/// Which keys the query at `query` sees on a sliding layer: the window to apply at that query.
/// The exact rule is the model's window everywhere; the seed's step rule widens it by one on
/// positions that were fed by step calls.
pub type WindowAt<'a> = &'a dyn Fn(usize) -> usize;

fn matvec(w: &Array2<f32>, x: &[f32]) -> Vec<f32> {
    w.rows()
        .into_iter()
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms(x: &[f32], w: &Array1<f32>, eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w.iter()).map(|(v, g)| v * r * g).collect()
}

fn rotate(x: &mut [f32], position: usize, base: f32) {
    let d = x.len();
    let h = d / 2;
    for i in 0..h {
        let theta = position as f64 / (base as f64).powf(2.0 * i as f64 / d as f64);
        let (s, c) = (theta.sin() as f32, theta.cos() as f32);
        let (a, b) = (x[i], x[i + h]);
        x[i] = a * c - b * s;
        x[i + h] = b * c + a * s;
    }
}

/// Logits at every position of `tokens`, computed from scratch.
pub fn logits(model: &ReferenceModel, tokens: &[i32], window_at: WindowAt) -> Vec<Vec<f32>> {
    let spec = model.spec();
    let arch = model.architecture();
    let (d, nh, nkv) = (spec.head_dim, spec.n_heads, spec.n_kv_heads);
    let group = nh / nkv;
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            model
                .embedding()
                .row(t as usize)
                .iter()
                .map(|v| v * arch.embed_scale)
                .collect()
        })
        .collect();
    for l in 0..spec.n_layers {
        let w = model.layer(l);
        let kind = spec.layer_kind(l);
        let base = spec.rope_base(kind);
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, x) in xs.iter().enumerate() {
            let h = rms(x, &w.attn_norm, arch.rms_eps);
            let add = |mut v: Vec<f32>, b: &Option<Array1<f32>>| {
                if let Some(b) = b {
                    v.iter_mut().zip(b.iter()).for_each(|(a, c)| *a += c);
                }
                v
            };
            let q = add(matvec(&w.attn_q, &h), &w.attn_q_bias);
            let k = add(matvec(&w.attn_k, &h), &w.attn_k_bias);
            let v = add(matvec(&w.attn_v, &h), &w.attn_v_bias);
            let heads = |flat: Vec<f32>, n: usize, norm: &Option<Array1<f32>>, scale: f32| -> Vec<Vec<f32>> {
                (0..n)
                    .map(|i| {
                        let mut head = flat[i * d..(i + 1) * d].to_vec();
                        if let Some(g) = norm {
                            head = rms(&head, g, arch.rms_eps);
                        }
                        rotate(&mut head, p, base);
                        head.iter().map(|x| x * scale).collect()
                    })
                    .collect()
            };
            qs.push(heads(q, nh, &w.attn_q_norm, arch.query_scale));
            ks.push(heads(k, nkv, &w.attn_k_norm, 1.0));
            vs.push((0..nkv).map(|i| v[i * d..(i + 1) * d].to_vec()).collect::<Vec<_>>());
        }
        let mut next = Vec::with_capacity(xs.len());
        for (p, x) in xs.iter().enumerate() {
            let mut concat = Vec::with_capacity(nh * d);
            for (head, q) in qs[p].iter().enumerate() {
                let kvh = head / group;
                let visible: Vec<usize> = (0..=p)
                    .filter(|&key| match kind {
                        LayerKind::Global => true,
                        LayerKind::Sliding => p - key < window_at(p),
                    })
                    .collect();
                let scores: Vec<f32> = visible
                    .iter()
                    .map(|&key| q.iter().zip(&ks[key][kvh]).map(|(a, b)| a * b).sum())
                    .collect();
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = exps.iter().sum();
                let mut out = vec![0.0f32; d];
                for (e, &key) in exps.iter().zip(&visible) {
                    for (o, v) in out.iter_mut().zip(&vs[key][kvh]) {
                        *o += e / total * v;
                    }
                }
                concat.extend(out);
            }
            let mut a = matvec(&w.attn_output, &concat);
            if let Some(g) = &w.post_attention_norm {
                a = rms(&a, g, arch.rms_eps);
            }
            let x1: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
            let h2 = rms(&x1, &w.ffn_norm, arch.rms_eps);
            let gate = matvec(&w.ffn_gate, &h2);
            let up = matvec(&w.ffn_up, &h2);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| {
                    let a = match arch.activation {
                        Activation::GeluTanh => {
                            0.5 * g * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
                        }
                        Activation::Silu => g / (1.0 + (-g).exp()),
                    };
                    a * u
                })
                .collect();
            let mut m = matvec(&w.ffn_down, &act);
            if let Some(g) = &w.post_ffw_norm {
                m = rms(&m, g, arch.rms_eps);
            }
            next.push(x1.iter().zip(&m).map(|(x, m)| x + m).collect());
        }
        xs = next;
    }
    xs.iter()
        .map(|x| matvec(model.output_projection(), &rms(x, model.output_norm(), arch.rms_eps)))
        .collect()
}

/// The greedy choice, lowest index on ties.
pub fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as i32
}

/// The gap between the best logit and `token`'s: 0 when `token` is the argmax. Used to tell a
/// real disagreement from a near-tie that FP32 summation order may flip.
pub fn gap_to(logits: &[f32], token: i32) -> f32 {
    logits[argmax(logits) as usize] - logits[token as usize]
}
