//! Contract v2 (`docs/contract-v2.md`): the static-shape chunk and step graphs, compiled for CPU
//! and Vulkan and run with `iree-run-module` on `local-task` and `vulkan` (lavapipe in CI) over
//! host-held caches `[P, nKV, d]`, compared call by call with `backend-reference` (which v1's
//! graphs match within the same tolerance, `graphs.rs`): tokens equal, the new rows within
//! `Tolerance::CROSS_BACKEND`. Every cache row a call must not read holds large garbage, and the
//! masking is checked bit for bit: other garbage there gives the same results. A missing tool
//! fails, never skips.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use backend_reference::{ReferenceKv, ReferenceModel, ReferenceRedecode};
use common::{Array, GraphSession, Noise};
use export::{export_artifacts, ExportOptions, Layout, Source, Target};
use kv_core::allowed::AllowedTokens;
use kv_core::irpa::{IrpaArchive, IrpaWriter};
use kv_core::manifest::{Name, Parameters};
use kv_core::rope::RopeTable;
use kv_core::tolerance::{assert_layers_close, Tolerance};
use kv_core::{ring, Graph, KvBackend, LayerKv, Manifest, RedecodeBackend, WindowRule};

/// A fixture as a model directory, materialized here: `export` reads fixture names only with its
/// `fixtures` feature, which `cargo test -p export` does not turn on.
fn fixture_source(name: &str) -> Source {
    Source::Dir(fixtures::materialize(name).unwrap_or_else(|e| panic!("fixture {name}: {e}")))
}

fn tokens(n: usize, salt: usize, vocab: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as i32)
        .collect()
}

/// Per layer, K and V `[P, nKV, d]` row-major: row `r` holds position `r`.
type Caches = Vec<(Vec<f32>, Vec<f32>)>;

/// Values no real row has (±1e6): a call that reads such a row shows it in its results.
fn garbage(n: usize, seed: u64) -> Vec<f32> {
    Noise::new(seed).row(n).into_iter().map(|x| x * 2.5e5).collect()
}

/// What one v2 call returns: the token, the first `n` new rows of every layer (`[n, nKV, d]`
/// each) and the top-k results where exported.
struct Call {
    pos: usize,
    n: usize,
    token: i32,
    rows: Vec<(Vec<f32>, Vec<f32>)>,
    top_k: Option<(Vec<f32>, Vec<i32>)>,
}

/// Drives the v2 graphs like the runtime: it owns the caches, hands the graphs the position and
/// copies the new rows in after each call.
struct V2Session {
    /// Runs the graphs (arguments and results bound by the manifest's names).
    g: GraphSession,
    caches: Caches,
    position: usize,
    /// The allowed-token mask the calls take where the graphs have one; `None`: every id.
    allowed: Option<AllowedTokens>,
}

impl V2Session {
    /// A session whose every cache row holds garbage (seeded by `seed`).
    fn open(dir: &Path, target: &str, device: &str, seed: u64) -> Self {
        let g = GraphSession::open(dir, target, device, &dir.join(format!("work-{device}")));
        assert!(g.m.is_v2(), "{} is not a contract v2 export", dir.display());
        let spec = &g.m.spec;
        let len = spec.max_positions * spec.n_kv_heads * spec.head_dim;
        let caches = (0..spec.n_layers as u64)
            .map(|l| (garbage(len, seed + 2 * l + 1), garbage(len, seed + 2 * l + 2)))
            .collect();
        V2Session {
            g,
            caches,
            position: 0,
            allowed: None,
        }
    }

    fn row_len(&self) -> usize {
        self.g.m.spec.n_kv_heads * self.g.m.spec.head_dim
    }

    /// Runs the chunk (several tokens) or step (one token, `step`) graph at `pos` over `caches`,
    /// changing nothing.
    fn run(&self, caches: &Caches, step: bool, pos: usize, toks: &[i32]) -> Call {
        let spec = &self.g.m.spec;
        let graph = if step { Graph::Step } else { Graph::Chunk };
        let rows = if step { 1 } else { spec.chunk };
        let n = toks.len();
        assert!((1..=rows).contains(&n), "{n} tokens for {rows} rows");
        let mut padded = toks.to_vec();
        padded.resize(rows, 0);
        let (d, nkv) = (spec.head_dim, spec.n_kv_heads);
        // The caches here are linear (`[P, nKV, d]`, position p in row p); a ring layer's
        // argument holds in row k the position `ring::position_of` says, as the runtime's ring
        // would, and a row holding none keeps the garbage of the linear row k.
        let view = |l: usize, cache: &[f32]| {
            let kind = spec.layer_kind(l);
            let layout = self.g.m.v2().expect("a v2 manifest");
            let rows = layout.cache_rows(spec, kind);
            if !layout.is_ring(spec, kind) {
                return Array::F32(vec![rows, nkv, d], cache.to_vec());
            }
            let row = nkv * d;
            let ring = (0..rows)
                .flat_map(|k| {
                    let p = ring::position_of(rows, pos, k).unwrap_or(k);
                    &cache[p * row..(p + 1) * row]
                })
                .copied()
                .collect();
            Array::F32(vec![rows, nkv, d], ring)
        };
        let named = |name: Name| -> Array {
            match name {
                Name::Tokens | Name::Token => Array::I32(vec![rows], padded.clone()),
                Name::Emb => self.g.emb(&padded),
                Name::Pos => Array::I32(vec![1], vec![pos as i32]),
                Name::Cos(kind) => Array::F32(vec![rows, d], RopeTable::new(pos, rows, d, spec.rope_base(kind)).cos),
                Name::Sin(kind) => Array::F32(vec![rows, d], RopeTable::new(pos, rows, d, spec.rope_base(kind)).sin),
                Name::K(l) => view(l, &caches[l].0),
                Name::V(l) => view(l, &caches[l].1),
                Name::Select => {
                    let mut s = vec![0.0; rows];
                    s[n - 1] = 1.0;
                    Array::F32(vec![1, rows], s)
                }
                Name::Allowed => {
                    let all = AllowedTokens::all(spec.vocab_size);
                    let words = self.allowed.as_ref().unwrap_or(&all).words();
                    Array::I32(vec![words.len()], words.iter().map(|&w| w as i32).collect())
                }
                other => panic!("v2 argument {other}"),
            }
        };
        let results = self.g.call(graph, &named);
        let keep = n * self.row_len();
        let rows_of = |a: &Array| {
            assert_eq!(a.shape(), [rows, nkv, d], "new rows of a v2 call");
            a.f32()[..keep].to_vec()
        };
        let token = results[&Name::Token].i32();
        assert_eq!(token.len(), 1);
        Call {
            pos,
            n,
            token: token[0],
            rows: (0..spec.n_layers)
                .map(|l| (rows_of(&results[&Name::K(l)]), rows_of(&results[&Name::V(l)])))
                .collect(),
            top_k: results
                .get(&Name::TopKLogits)
                .map(|v| (v.f32().to_vec(), results[&Name::TopKIds].i32().to_vec())),
        }
    }

    /// Copies a call's new rows into the caches at its position.
    fn commit(&mut self, call: &Call) {
        let row = self.row_len();
        let at = call.pos * row;
        for (cache, new) in self.caches.iter_mut().zip(&call.rows) {
            cache.0[at..at + new.0.len()].copy_from_slice(&new.0);
            cache.1[at..at + new.1.len()].copy_from_slice(&new.1);
        }
        self.position = call.pos + call.n;
    }

    fn chunk(&mut self, toks: &[i32]) -> Call {
        let call = self.run(&self.caches, false, self.position, toks);
        self.commit(&call);
        call
    }

    fn step(&mut self, token: i32) -> Call {
        let call = self.run(&self.caches, true, self.position, &[token]);
        self.commit(&call);
        call
    }

    /// Puts the rows another backend holds into the caches (the others keep their garbage) and
    /// continues at its position.
    fn load(&mut self, r: &ReferenceKv) {
        let (nkv, d) = (self.g.m.spec.n_kv_heads, self.g.m.spec.head_dim);
        for (l, cache) in self.caches.iter_mut().enumerate() {
            let layer = r.read_layer(l).unwrap();
            for p in layer.first_position..layer.first_position + layer.rows {
                for h in 0..nkv {
                    let at = (p * nkv + h) * d;
                    cache.0[at..at + d].copy_from_slice(layer.k_at(h, p).unwrap());
                    cache.1[at..at + d].copy_from_slice(layer.v_at(h, p).unwrap());
                }
            }
        }
        self.position = r.position();
    }
}

/// `[n, nKV, d]` → `[nKV, n, d]`.
fn heads_first(rows: &[f32], n: usize, nkv: usize, d: usize) -> Vec<f32> {
    (0..nkv)
        .flat_map(|h| (0..n).flat_map(move |r| rows[(r * nkv + h) * d..(r * nkv + h + 1) * d].iter().copied()))
        .collect()
}

/// The call's token is the reference's and its new rows are the reference's at those positions.
#[track_caller]
fn same_as_reference(what: &str, call: &Call, spec: &kv_core::KvSpec, r: &ReferenceKv) {
    let logits = r.last_logits().unwrap();
    let want = backend_reference::argmax_lowest(logits) as i32;
    assert_eq!(
        call.token, want,
        "{what}: token {} (logit {}), reference {want} (logit {})",
        call.token, logits[call.token as usize], logits[want as usize]
    );
    assert_eq!(call.pos + call.n, r.position(), "{what}: positions");
    let (nkv, d) = (spec.n_kv_heads, spec.head_dim);
    for (l, (k, v)) in call.rows.iter().enumerate() {
        let got = LayerKv {
            first_position: call.pos,
            rows: call.n,
            n_kv_heads: nkv,
            head_dim: d,
            k: heads_first(k, call.n, nkv, d),
            v: heads_first(v, call.n, nkv, d),
        };
        assert_layers_close(
            &format!("{what}: layer {l}"),
            &got,
            &r.read_layer(l).unwrap(),
            Tolerance::CROSS_BACKEND,
        );
    }
}

/// `toks` as chunk calls from position 0 on both: the first over caches holding nothing but
/// garbage (what a v1 prefill computes from nothing), each later one over the rows before it.
fn chunked_prefill(label: &str, s: &mut V2Session, r: &mut ReferenceKv, toks: &[i32]) -> i32 {
    let spec = s.g.m.spec.clone();
    let mut token = 0;
    for (i, piece) in toks.chunks(spec.chunk).enumerate() {
        let call = s.chunk(piece);
        if i == 0 {
            r.prefill(piece).unwrap();
        } else {
            r.chunk(piece).unwrap();
        }
        same_as_reference(
            &format!("{label}: chunk of {} at {}", piece.len(), call.pos),
            &call,
            &spec,
            r,
        );
        token = call.token;
    }
    token
}

/// Whether two calls returned the same bits.
fn identical(a: &Call, b: &Call) -> bool {
    a.token == b.token && a.rows == b.rows && a.top_k == b.top_k
}

/// At the session's position (past the window): rows the call must not read (at or after the
/// position; on sliding layers, before every query row's window) replaced by other garbage give
/// the same bits, for a chunk and for a step; the oldest row a sliding layer's window still holds
/// replaced does change the results (so the first check could fail).
fn masked_rows_are_not_read(label: &str, s: &V2Session) {
    let spec = &s.g.m.spec;
    let w = spec.sliding_window;
    let pos = s.position;
    assert!(
        w > 0 && pos > w,
        "{label}: needs a sliding layer and a position past its window"
    );
    let row = s.row_len();
    let toks = tokens(spec.chunk - 1, 9, spec.vocab_size);
    for step in [false, true] {
        let what = format!("{label}: {} at {pos}", if step { "step" } else { "chunk" });
        let base = s.run(&s.caches, step, pos, if step { &toks[..1] } else { &toks });
        let mut other = s.caches.clone();
        // Query row `i` (position pos + i) sees a sliding row j iff pos + i - j < w: rows up to
        // pos - w are outside every row's window.
        let outside = (pos + 1 - w) * row;
        for (l, (k, v)) in other.iter_mut().enumerate() {
            let seed = 1000 + 2 * l as u64;
            let tail = k.len() - pos * row;
            k[pos * row..].copy_from_slice(&garbage(tail, seed));
            v[pos * row..].copy_from_slice(&garbage(tail, seed + 1));
            if spec.window(spec.layer_kind(l)).is_some() {
                k[..outside].copy_from_slice(&garbage(outside, seed + 7));
                v[..outside].copy_from_slice(&garbage(outside, seed + 8));
            }
        }
        let again = s.run(&other, step, pos, if step { &toks[..1] } else { &toks });
        assert!(
            identical(&base, &again),
            "{what}: rows it must not read changed its results"
        );
        if step {
            let sliding = (0..spec.n_layers)
                .find(|&l| spec.window(spec.layer_kind(l)).is_some())
                .unwrap();
            let mut seen = s.caches.clone();
            let oldest = (pos + 1 - w) * row;
            seen[sliding].1[oldest..oldest + row].copy_from_slice(&garbage(row, 77));
            let changed = s.run(&seen, step, pos, &toks[..1]);
            assert!(
                !identical(&base, &changed),
                "{what}: the oldest row of layer {sliding}'s window did not count"
            );
        }
    }
}

const DEVICES: [(&str, &str); 2] = [("llvm-cpu", "local-task"), ("vulkan", "vulkan")];

/// Tiny Gemma 3 (one KV head, per-head v1 masks) with a window of 5 under the chunk of 8, so a
/// chunk's own rows are windowed too: a chunked prefill from nothing, steps past the window, the
/// masking, and a chunk and a step over rows loaded from the reference with garbage elsewhere.
/// Also the v2 manifest: validated on load, no prefill function, module or list.
#[test]
fn tiny_gemma3_small_window() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        graphs: vec![Graph::Chunk, Graph::Step],
        ring_slack: Some(3),
        ..ExportOptions::default()
    };
    let m = export_artifacts(&fixture_source("tiny-gemma3:7:w5"), out, &options).unwrap();
    let loaded = Manifest::load(out).unwrap();
    assert_eq!(loaded, m);
    assert!(m.is_v2());
    assert_eq!((m.spec.n_kv_heads, m.spec.sliding_window, m.spec.chunk), (1, 5, 8));
    // Sliding layers keep a ring of the window and 3 rows more (the chunk's 8 then, at least):
    // the calls below wrap it twice.
    assert_eq!(m.v2().map(|v2| v2.sliding_cache_rows), Some(8));
    assert_eq!(m.functions.prefill, None);
    assert_eq!((&m.prefill_args, &m.prefill_outputs), (&None, &None));
    for modules in m.modules.values() {
        let keys: BTreeSet<&str> = modules.keys().map(String::as_str).collect();
        assert_eq!(keys, BTreeSet::from(["prefillWithPast", "withPast"]));
    }
    assert!(m.with_past_args.as_ref().unwrap().contains(&Name::Pos));
    let err = export::emit(&m, Graph::Prefill, &export::EmitOptions::default()).unwrap_err();
    assert!(err.to_string().contains("no prefill graph"), "{err}");

    let model = ReferenceModel::open(out).unwrap();
    let spec = m.spec.clone();
    for (target, device) in DEVICES {
        let label = device.to_string();
        let mut s = V2Session::open(out, target, device, 1);
        let mut r = ReferenceKv::new(model.clone(), WindowRule::Exact);
        let prompt = tokens(2 * spec.chunk + 3, 1, spec.vocab_size);
        let mut token = chunked_prefill(&label, &mut s, &mut r, &prompt);
        for _ in 0..2 {
            let call = s.step(token);
            r.step(token).unwrap();
            same_as_reference(&format!("{label}: step at {}", call.pos), &call, &spec, &r);
            token = call.token;
        }
        masked_rows_are_not_read(&label, &s);

        // Rows from elsewhere (the reference's prefill; a sliding layer holds only its window's).
        let mut r = ReferenceKv::new(model.clone(), WindowRule::Exact);
        r.prefill(&tokens(13, 2, spec.vocab_size)).unwrap();
        let mut s = V2Session::open(out, target, device, 50);
        s.load(&r);
        let piece = tokens(spec.chunk - 3, 3, spec.vocab_size);
        let call = s.chunk(&piece);
        r.chunk(&piece).unwrap();
        same_as_reference(&format!("{label}: loaded rows, chunk at 13"), &call, &spec, &r);
        let token = call.token;
        let call = s.step(token);
        r.step(token).unwrap();
        same_as_reference(&format!("{label}: loaded rows, step at 18"), &call, &spec, &r);
    }
}

/// Tiny Llama (two KV heads of two query heads each, all global) in the three layout with a
/// top-k and the redecode graphs: only the chunk and step get archives of their own, the key maps
/// cover those two, and every call agrees with the reference (top-k included).
#[test]
fn tiny_llama_three_layout_top_k() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let k = 8;
    // Without the v2 prefill graph (a chunk graph of more rows, checked against v1 and chunk
    // calls in `backend-iree/tests/v2.rs` and by the v2 conformance suites).
    let options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        layout: Layout::Three,
        redecode_seq: Some(16),
        top_k: k,
        graphs: vec![Graph::Chunk, Graph::Step, Graph::Redecode, Graph::RedecodeAt],
        ..ExportOptions::default()
    };
    let m = export_artifacts(&fixture_source("tiny-llama:7"), out, &options).unwrap();
    assert!(m.is_v2());
    assert_eq!((m.spec.n_kv_heads, m.spec.n_heads), (2, 4));
    let Some(Parameters::PerGraph(files)) = &m.parameters else {
        panic!("three layout without per-graph archives: {:?}", m.parameters)
    };
    let keys: BTreeSet<&str> = files.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        BTreeSet::from(["prefillWithPast", "withPast", "weights", "redecode", "redecodeAt"])
    );
    let archives: BTreeSet<&String> = files.values().collect();
    assert_eq!(archives.len(), 3, "chunk, step and weights: {files:?}");
    let key_maps = m.provenance.parameter_keys.clone().unwrap();
    assert_eq!(
        key_maps.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        BTreeSet::from(["prefillWithPast", "withPast"])
    );
    for (graph, map) in &key_maps {
        let archive = IrpaArchive::open(out.join(&files[graph])).unwrap();
        for key in map.keys() {
            assert!(archive.get(key).is_some(), "{graph}: {key} not in {}", files[graph]);
        }
    }
    let irpas = std::fs::read_dir(out)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "irpa"))
        .count();
    assert_eq!(irpas, 3, "no prefill archive");

    let model = ReferenceModel::open(out).unwrap();
    let spec = m.spec.clone();
    let check_top_k = |what: &str, call: &Call, r: &ReferenceKv| {
        let (logits, ids) = call.top_k.clone().expect("no top-k results");
        let want = r.last_top_k(k).unwrap().unwrap();
        assert_eq!(ids, want.ids(), "{what}: top-k ids ({:?})", want.logits());
        for (got, want) in logits.iter().zip(want.logits()) {
            assert!((got - want).abs() <= 1e-3, "{what}: logit {got} against {want}");
        }
        assert_eq!(call.token, ids[0], "{what}: the token leads the top-k");
    };
    for (target, device) in DEVICES {
        let mut s = V2Session::open(out, target, device, 3);
        let mut r = ReferenceKv::new(model.clone(), WindowRule::Exact);
        let prompt = tokens(spec.chunk + 5, 4, spec.vocab_size);
        let mut token = chunked_prefill(device, &mut s, &mut r, &prompt);
        for _ in 0..3 {
            let call = s.step(token);
            r.step(token).unwrap();
            let what = format!("{device}: step at {}", call.pos);
            same_as_reference(&what, &call, &spec, &r);
            check_top_k(&what, &call, &r);
            token = call.token;
        }
        // The redecode graphs are v1's, over their own archive.
        let g = GraphSession::open(out, target, device, &out.join(format!("redecode-{device}")));
        let prompt = &prompt[..12];
        let mut padded = prompt.to_vec();
        padded.resize(16, 0);
        let want = ReferenceRedecode::with_seq(model.clone(), 16)
            .unwrap()
            .run(&padded)
            .unwrap();
        assert_eq!(g.redecode(prompt, 16), want, "{device}: redecode ids");
    }
}

/// The CPU runtime settings of contract 2 (`export::runtime_options_for`: bf16 weights and the
/// flags chosen there) compile and agree with the reference, with two KV heads and a window.
#[test]
fn cpu_runtime_options() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let mut options = export::runtime_options_for(&Target::cpu(), kv_core::ContractVersion::V2);
    options.targets = vec![Target::cpu()];
    options.graphs = vec![Graph::Chunk, Graph::Step];
    let m = export_artifacts(&fixture_source("tiny-gemma3-gqa:5"), out, &options).unwrap();
    let flags = m.provenance.compile_flags.clone().unwrap_or_default();
    for flag in &options.compile_flags {
        assert!(flags.contains(flag.as_str()), "{flag} in {flags}");
    }
    // Data tiling: the packed weights are read from an encoded archive (export::encode).
    for vmfb in m.modules["llvm-cpu"].values() {
        let encoded = m
            .encoded_parameter_file(vmfb)
            .unwrap_or_else(|| panic!("{vmfb} has no encoded archive"));
        let archive = kv_core::irpa::IrpaArchive::open(out.join(encoded)).unwrap();
        assert!(archive.live_count() > 0, "{encoded} is empty");
    }
    let model = ReferenceModel::open(out).unwrap();
    let spec = m.spec.clone();
    let mut s = V2Session::open(out, "llvm-cpu", "local-task", 5);
    let mut r = ReferenceKv::new(model, WindowRule::Exact);
    let prompt = tokens(spec.sliding_window + 6, 6, spec.vocab_size);
    let mut token = chunked_prefill("runtime options", &mut s, &mut r, &prompt);
    for _ in 0..2 {
        let call = s.step(token);
        r.step(token).unwrap();
        same_as_reference(&format!("runtime options: step at {}", call.pos), &call, &spec, &r);
        token = call.token;
    }
    masked_rows_are_not_read("runtime options", &s);
}

/// `WeightFormat::I16` (fused into the step's matmuls) under contract 2, on the CPU (lavapipe
/// cannot run i16 weights, `graphs.rs`): the calls agree with the reference.
#[test]
fn i16_weights_on_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        targets: vec![Target::cpu()],
        weights: export::WeightFormat::I16,
        graphs: vec![Graph::Chunk, Graph::Step],
        ..ExportOptions::default()
    };
    let m = export_artifacts(&fixture_source("tiny-qwen3:5"), out, &options).unwrap();
    let model = ReferenceModel::open(out).unwrap();
    let spec = m.spec.clone();
    let mut s = V2Session::open(out, "llvm-cpu", "local-task", 9);
    let mut r = ReferenceKv::new(model, WindowRule::Exact);
    let prompt = tokens(spec.chunk + 2, 10, spec.vocab_size);
    let token = chunked_prefill("i16", &mut s, &mut r, &prompt);
    let call = s.step(token);
    r.step(token).unwrap();
    same_as_reference(&format!("i16: step at {}", call.pos), &call, &spec, &r);
}

/// bf16 matmul inputs (`matmulInput`): with bf16 weights every projection and the LM head
/// contract bf16 × bf16 → f32 and nothing else does; with packed weights the exporter refuses
/// them (the graphs widen those weights to f32 and multiply f32).
#[test]
fn bf16_matmul_inputs_only_where_they_apply() {
    let dir = fixture_source("tiny-gemma3:7").dir().unwrap();
    let m = kv_core::Manifest::load(&dir).unwrap();
    let options = export::EmitOptions {
        weights: export::WeightFormat::Bf16,
        bf16_matmul_inputs: true,
        ..export::EmitOptions::default()
    };
    let text = export::emit(&m, Graph::Step, &options).unwrap();
    let bf16_dots = text
        .lines()
        .filter(|l| l.contains("stablehlo.dot_general") && l.contains("xbf16>, tensor<"))
        .count();
    // q, k, v, output, gate, up, down per layer, and the tied LM head.
    assert_eq!(bf16_dots, 7 * m.spec.n_layers + 1, "{text}");
    let plain = export::emit(
        &m,
        Graph::Step,
        &export::EmitOptions {
            weights: export::WeightFormat::Bf16,
            ..export::EmitOptions::default()
        },
    )
    .unwrap();
    assert!(!plain.lines().any(|l| l.contains("dot_general") && l.contains("xbf16>")));

    let out = tempfile::tempdir().unwrap();
    let options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        targets: vec![Target::cpu()],
        graphs: vec![Graph::Step],
        matmul_input: kv_core::manifest::MatmulInput::Bf16,
        ..ExportOptions::default()
    };
    let err = export_artifacts(&fixture_source("tiny-gemma3:7"), out.path(), &options).unwrap_err();
    assert!(
        matches!(
            err,
            export::ExportError::Options(export::OptionsError::Bf16MatmulInputs)
        ),
        "{err}"
    );
    assert!(
        !out.path().join("manifest.json").exists(),
        "refused before anything is written"
    );
}

/// f16 caches (`cacheType`): the v2 graphs declare every cache argument and new-row result f16
/// and round the new rows once per K and V (`reduce_precision`, which the caches then hold); the
/// exporter refuses them with a Vulkan target (no 16-bit storage on the portable target) and
/// under contract 1.
#[test]
fn f16_caches_only_where_they_apply() {
    use kv_core::manifest::CacheType;
    let dir = fixture_source("tiny-gemma3:7").dir().unwrap();
    let mut m = kv_core::Manifest::load(&dir)
        .unwrap()
        .into_v2(kv_core::V2Spec::default());
    m.cache_type = CacheType::F16;
    let text = export::emit(&m, Graph::Step, &export::EmitOptions::default()).unwrap();
    let signature = text.lines().find(|l| l.contains("func.func")).unwrap();
    let (args, results) = signature.split_once(") -> (").unwrap();
    let n = m.spec.n_layers;
    assert_eq!(args.matches("xf16>").count(), 2 * n, "{signature}");
    assert_eq!(results.matches("xf16>").count(), 2 * n, "{signature}");
    assert_eq!(text.matches("stablehlo.reduce_precision").count(), 2 * n);
    m.cache_type = CacheType::F32;
    let plain = export::emit(&m, Graph::Step, &export::EmitOptions::default()).unwrap();
    assert!(!plain.contains("xf16>") && !plain.contains("reduce_precision"));

    for (contract, targets) in [
        (kv_core::ContractVersion::V2, vec![Target::cpu(), Target::vulkan()]),
        (kv_core::ContractVersion::V1, vec![Target::cpu()]),
    ] {
        let out = tempfile::tempdir().unwrap();
        let options = ExportOptions {
            contract,
            targets,
            graphs: vec![Graph::Step],
            cache_type: CacheType::F16,
            ..ExportOptions::default()
        };
        let err = export_artifacts(&fixture_source("tiny-gemma3:7"), out.path(), &options).unwrap_err();
        assert!(
            matches!(err, export::ExportError::Options(export::OptionsError::F16Caches)),
            "contract {contract}: {err}"
        );
    }
}

/// `fixture` with token `copy`'s embedding row written over token `into`'s, in a directory of
/// its own: a tied LM head then gives the two ids bit-identical logits on every backend (the
/// same products in the same order), an exact tie for the argmax's lowest-index rule.
fn fixture_with_tied_rows(fixture: &str, copy: usize, into: usize, dir: &Path) {
    let src = fixtures::materialize(fixture).unwrap();
    let m = Manifest::load(&src).unwrap();
    assert!(
        m.require_architecture().unwrap().tied_output,
        "{fixture}: the LM head must be the embedding"
    );
    let archive = IrpaArchive::open(src.join(fixtures::WEIGHTS_FILE)).unwrap();
    let h = m.spec.hidden_size;
    let mut writer = IrpaWriter::new();
    for entry in archive.entries() {
        let name = entry.name();
        let mut values = kv_core::bf16::bf16_bytes_to_f32(archive.data(name).unwrap()).unwrap();
        if name == kv_core::Param::TokenEmbd.to_string() {
            values.copy_within(copy * h..(copy + 1) * h, into * h);
        }
        writer.add_bf16_from_f32(name, &values).unwrap();
    }
    writer.write(dir.join(fixtures::WEIGHTS_FILE)).unwrap();
    m.save(dir).unwrap();
}

const TIE_LOW: usize = 5;
const TIE_HIGH: usize = 300;

/// Chunk and step graphs of `tiny-gemma3:7` with ids [`TIE_LOW`] and [`TIE_HIGH`] tied, a top-k
/// of 8, i16 weights, for `targets`, into `tmp/name`: the manifest.
fn tied_export(tmp: &Path, name: &str, targets: Vec<Target>, weights: export::WeightFormat) -> Manifest {
    let src = tmp.join("src");
    if !src.join("manifest.json").is_file() {
        std::fs::create_dir_all(&src).unwrap();
        fixture_with_tied_rows("tiny-gemma3:7", TIE_LOW, TIE_HIGH, &src);
    }
    let options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        graphs: vec![Graph::Chunk, Graph::Step],
        top_k: 8,
        weights,
        compile_flags: vec!["--iree-opt-const-expr-hoisting=false".into()],
        targets,
        ..ExportOptions::default()
    };
    let m = export_artifacts(&Source::Dir(src), &tmp.join(name), &options).unwrap();
    assert!(m.allowed_mask && m.with_past_args.as_ref().unwrap().last() == Some(&Name::Allowed));
    m
}

/// Under masks built from each call's reference logits (every id; all but the best; the worst
/// alone; the exact tie and a worse id; every 7th id), a chunk and a step of the export in `dir`
/// predict the reference's best allowed id, the lower tied id on the tie, and return the masked
/// logits' top-k (disallowed ids `-inf`).
fn masks_hold(label: &str, dir: &Path, target: &str, device: &str) {
    let model = ReferenceModel::open(&dir.parent().unwrap().join("src")).unwrap();
    let mut s = V2Session::open(dir, target, device, 11);
    let spec = s.g.m.spec.clone();
    let k = s.g.m.top_k.unwrap();
    let mut r = ReferenceKv::new(model, WindowRule::Exact);
    chunked_prefill(label, &mut s, &mut r, &tokens(spec.chunk + 3, 6, spec.vocab_size));
    let (pos, at) = (s.position, r.snapshot().unwrap());
    let piece = tokens(3, 8, spec.vocab_size);
    let vocab = spec.vocab_size;
    for step in [true, false] {
        let toks = if step { &piece[..1] } else { &piece[..] };
        r.restore(&at).unwrap();
        if step {
            r.step(toks[0]).unwrap();
        } else {
            r.chunk(toks).unwrap();
        }
        let logits = r.last_logits().unwrap().to_vec();
        assert_eq!(logits[TIE_LOW], logits[TIE_HIGH], "tied embedding rows tie exactly");
        let mut order: Vec<i32> = (0..vocab as i32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let (best, worst) = (order[0], order[vocab - 1]);
        let masks = [
            ("every id", AllowedTokens::all(vocab)),
            ("all but the best", AllowedTokens::from_ids(vocab, &order[1..]).unwrap()),
            ("the worst id", AllowedTokens::from_ids(vocab, &[worst]).unwrap()),
            (
                "an exact tie and a worse id",
                AllowedTokens::from_ids(vocab, &[TIE_HIGH as i32, worst, TIE_LOW as i32]).unwrap(),
            ),
            (
                "every 7th id",
                AllowedTokens::from_ids(vocab, &(3..vocab as i32).step_by(7).collect::<Vec<_>>()).unwrap(),
            ),
        ];
        for (name, mask) in masks {
            s.allowed = Some(mask.clone());
            let call = s.run(&s.caches, step, pos, toks);
            let what = format!("{label}: {} under `{name}`", if step { "step" } else { "chunk" });
            let want = mask.argmax(&logits).unwrap();
            assert_eq!(call.token, want, "{what}: token");
            match name {
                "all but the best" => assert_ne!(want, best, "{what}: the mask changed nothing"),
                "an exact tie and a worse id" if worst != TIE_LOW as i32 => {
                    assert_eq!(want, TIE_LOW as i32, "{what}: the lower of the tied ids")
                }
                _ => {}
            }
            let mut masked = logits.clone();
            mask.mask_logits(&mut masked);
            let want_top = kv_core::sampling::TopK::of_logits(&masked, k);
            let (got_logits, got_ids) = call.top_k.clone().expect("top-k results");
            let finite = want_top.logits().iter().filter(|l| l.is_finite()).count();
            assert_eq!(&got_ids[..finite], &want_top.ids()[..finite], "{what}: top-k ids");
            for (g, w) in got_logits.iter().zip(want_top.logits()) {
                let both_masked = *g == f32::NEG_INFINITY && *w == f32::NEG_INFINITY;
                assert!(
                    (g - w).abs() <= 1e-3 || both_masked,
                    "{what}: top-k logit {g} against {w}"
                );
            }
        }
    }
}

/// The module of the `ampere` export in `dir` (manifest `m`), its SPIR-V configurations
/// (`compilation_info`) taken out, compiled for the CPU into the same module files, which the
/// manifest then names for `llvm-cpu`: the NVIDIA forms run on `local-task` (lavapipe runs no
/// GPU-target module).
fn nvidia_forms_for_cpu(dir: &Path, m: &mut Manifest) {
    let mlir = std::fs::read_to_string(dir.join("gemma.mlir")).unwrap();
    assert!(
        mlir.contains("compilation_info"),
        "an NVIDIA export configures its products"
    );
    let mut cpu_text = String::with_capacity(mlir.len());
    for line in mlir.lines() {
        match line.find(" attrs = {compilation_info = ") {
            Some(at) => {
                let end = at + line[at..].find('}').unwrap() + 1;
                cpu_text.push_str(&line[..at]);
                cpu_text.push_str(&line[end..]);
            }
            None => cpu_text.push_str(line),
        }
        cpu_text.push('\n');
    }
    let cpu_mlir = dir.join("gemma-nvidia-forms.mlir");
    std::fs::write(&cpu_mlir, cpu_text).unwrap();
    let (_, modules) = m.modules.pop_first().expect("the export's Vulkan modules");
    assert!(m.modules.is_empty(), "one target: {:?}", m.modules.keys());
    for vmfb in modules.values().collect::<BTreeSet<_>>() {
        let flags = ["--iree-opt-const-expr-hoisting=false".to_string()];
        export::compile_with(&cpu_mlir, &Target::cpu(), &dir.join(vmfb), &flags).unwrap();
    }
    m.modules.insert("llvm-cpu".into(), modules);
    m.save(dir).unwrap();
}

/// A chunked prefill, then `steps` steps of the export in `dir` (CPU modules) from the model in
/// `src`, each step judged against the reference with its new K/V rows: each step's new key
/// rows (scaled by their norm factors after the rotation in the NVIDIA forms,
/// `FuncEmitter::qkv_rope_deferred`) are the next step's cache.
fn steps_agree(label: &str, dir: &Path, src: &Path, steps: usize) {
    let model = ReferenceModel::open(src).unwrap();
    let mut s = V2Session::open(dir, "llvm-cpu", "local-task", 12);
    let spec = s.g.m.spec.clone();
    let mut r = ReferenceKv::new(model, WindowRule::Exact);
    let mut token = chunked_prefill(label, &mut s, &mut r, &tokens(spec.chunk + 2, 9, spec.vocab_size));
    for _ in 0..steps {
        let call = s.step(token);
        r.step(token).unwrap();
        same_as_reference(&format!("{label}: step at {}", call.pos), &call, &spec, &r);
        token = call.token;
    }
}

/// The allowed-token mask (`allowed`, issue 31) in the NVIDIA Vulkan forms (`GpuTuning::NVIDIA`:
/// the head, stream and attention products, the argmax's width), run on the CPU
/// ([`nvidia_forms_for_cpu`]) under masks ([`masks_hold`]), as `graphs.rs` runs contract 1's
/// forms; then steps, each against the reference with its new rows.
#[test]
fn allowed_mask_in_nvidia_forms_on_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let ampere = Target::Vulkan {
        target: Some("ampere".into()),
    };
    let mut m = tied_export(tmp.path(), "nvidia", vec![ampere], export::WeightFormat::I16);
    let dir = tmp.path().join("nvidia");
    nvidia_forms_for_cpu(&dir, &mut m);
    masks_hold("NVIDIA forms on the CPU", &dir, "llvm-cpu", "local-task");
    steps_agree("NVIDIA forms on the CPU", &dir, &tmp.path().join("src"), 3);
}

/// [`masks_hold`] in the portable staged argmax (lavapipe) and the CPU's maximum-then-index
/// (`argmax_by_max`), with the exact tie the conformance suites' random masks do not make.
/// `scripts/test-long.sh export`: the v2 conformance suites run masks on both in CI.
#[test]
#[ignore = "run by scripts/test-long.sh: the v2 conformance suites run masks on both paths in CI"]
fn allowed_mask_on_lavapipe_and_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    tied_export(
        tmp.path(),
        "portable",
        vec![Target::vulkan()],
        export::WeightFormat::PackedI32,
    );
    tied_export(tmp.path(), "cpu", vec![Target::cpu()], export::WeightFormat::I16);
    masks_hold(
        "lavapipe, staged argmax",
        &tmp.path().join("portable"),
        "vulkan",
        "vulkan",
    );
    masks_hold(
        "CPU, argmax by maximum",
        &tmp.path().join("cpu"),
        "llvm-cpu",
        "local-task",
    );
}
