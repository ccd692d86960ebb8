//! Test support: `.npy` files, `iree-run-module`, and a small host-side session that drives the
//! exported graphs the way the runtime does (plans from `kv_core::window`, tails of the caches,
//! host-gathered embedding rows), so every call can be compared with `backend-reference`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kv_core::irpa::IrpaArchive;
use kv_core::manifest::Name;
use kv_core::tolerance::Tolerance;
use kv_core::window::{plan_chunk, plan_prefill, plan_step, KindInputs};
use kv_core::{Graph, KvBackend, LayerKv, Manifest, WindowRule};

// ---- .npy -------------------------------------------------------------------------------------

pub enum Array {
    F32(Vec<usize>, Vec<f32>),
    I32(Vec<usize>, Vec<i32>),
    I16(Vec<usize>, Vec<i16>),
    I8(Vec<usize>, Vec<i8>),
}

impl Array {
    pub fn shape(&self) -> &[usize] {
        match self {
            Array::F32(s, _) | Array::I32(s, _) | Array::I16(s, _) | Array::I8(s, _) => s,
        }
    }
    pub fn f32(&self) -> &[f32] {
        match self {
            Array::F32(_, v) => v,
            _ => panic!("expected an f32 array"),
        }
    }
    pub fn i32(&self) -> &[i32] {
        match self {
            Array::I32(_, v) => v,
            _ => panic!("expected an i32 array"),
        }
    }
}

pub fn write_npy(path: &Path, a: &Array) {
    let (descr, shape, bytes): (&str, &[usize], Vec<u8>) = match a {
        Array::F32(s, v) => ("<f4", s, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Array::I32(s, v) => ("<i4", s, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Array::I16(s, v) => ("<i2", s, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Array::I8(s, v) => ("|i1", s, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    let dims = match shape.len() {
        0 => String::new(),
        1 => format!("{},", shape[0]),
        _ => shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(bytes);
    std::fs::write(path, out).unwrap();
}

pub fn read_npy(path: &Path) -> Array {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert_eq!(&data[..6], b"\x93NUMPY", "{} is not .npy", path.display());
    let (hlen, start) = if data[6] == 1 {
        (u16::from_le_bytes([data[8], data[9]]) as usize, 10)
    } else {
        (u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize, 12)
    };
    let header = std::str::from_utf8(&data[start..start + hlen]).unwrap();
    let body = &data[start + hlen..];
    let shape_text = &header[header.find("'shape': (").unwrap() + 10..];
    let shape_text = &shape_text[..shape_text.find(')').unwrap()];
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    if header.contains("'<f4'") {
        Array::F32(
            shape,
            body.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    } else if header.contains("'<i4'") {
        Array::I32(
            shape,
            body.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    } else {
        panic!("unsupported npy header {header}")
    }
}

// ---- test rows --------------------------------------------------------------------------------

/// Deterministic values in [-4, 4) (xorshift64), so a failing row can be reproduced.
pub struct Noise(u64);

impl Noise {
    pub fn new(seed: u64) -> Self {
        Noise(seed)
    }

    pub fn row(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
            })
            .collect()
    }
}

/// `row` with the elements at `at` set to `v`.
pub fn with_values(row: &[f32], at: &[usize], v: f32) -> Vec<f32> {
    let mut row = row.to_vec();
    for &i in at {
        row[i] = v;
    }
    row
}

// ---- iree-run-module --------------------------------------------------------------------------

pub fn iree_tool(name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join(name).is_file() {
                return dir.join(name);
            }
        }
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.tools/venv/bin")
        .join(name);
    assert!(
        p.is_file(),
        "{name} not found on PATH nor at {}: install the pinned IREE wheels (`pip install iree-base-compiler==3.13.0 \
         iree-base-runtime==3.13.0`, see scripts/env.sh); these tests never skip",
        p.display()
    );
    p
}

/// Runs `function` of `vmfb` on `device`, with `parameters` (`(scope, archive)`) where the
/// module has any; returns the results.
pub fn run_module(
    work: &Path,
    device: &str,
    vmfb: &Path,
    parameters: &[(&str, &Path)],
    function: &str,
    inputs: &[Array],
    n_out: usize,
) -> Vec<Array> {
    let mut cmd = Command::new(iree_tool("iree-run-module"));
    cmd.env(
        "XDG_RUNTIME_DIR",
        std::env::var_os("XDG_RUNTIME_DIR").unwrap_or_else(|| "/tmp".into()),
    );
    cmd.arg(format!("--device={device}"))
        .arg(format!("--module={}", vmfb.display()))
        .arg(format!("--function={function}"));
    for (scope, irpa) in parameters {
        cmd.arg(format!("--parameters={scope}={}", irpa.display()));
    }
    for (i, a) in inputs.iter().enumerate() {
        let p = work.join(format!("in{i}.npy"));
        write_npy(&p, a);
        cmd.arg(format!("--input=@{}", p.display()));
    }
    cmd.args(storage_inputs(vmfb, function));
    let outs: Vec<PathBuf> = (0..n_out).map(|i| work.join(format!("out{i}.npy"))).collect();
    for p in &outs {
        let _ = std::fs::remove_file(p);
        cmd.arg(format!("--output=@{}", p.display()));
    }
    // No retry: a failure that passes on a second try is a bug of its own (a lavapipe flake
    // was once retried here and hid for weeks). The status (a signal shows there), the command
    // and both streams are what the next occurrence needs to be understood.
    let output = cmd.output().expect("spawning iree-run-module");
    assert!(
        output.status.success(),
        "iree-run-module {function} on {device} failed ({}): {cmd:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    outs.iter().map(|p| read_npy(p)).collect()
}

/// The `--input`s of the storage `function` of `vmfb` takes from its caller (Vulkan exports'
/// step and embedding, `EmitOptions::caller_storage`): a buffer view of each tied result's type
/// and the transients' buffer (`&` makes a bare buffer), read from the module's reflection
/// with `iree-dump-module` (once per module and function).
fn storage_inputs(vmfb: &Path, function: &str) -> Vec<String> {
    static SEEN: std::sync::Mutex<Vec<(PathBuf, String, Vec<String>)>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, inputs)) = seen.iter().find(|(p, f, _)| p == vmfb && f == function) {
        return inputs.clone();
    }
    let dump = Command::new(iree_tool("iree-dump-module"))
        .arg(vmfb)
        .output()
        .expect("run iree-dump-module");
    assert!(dump.status.success(), "iree-dump-module {}", vmfb.display());
    let text = String::from_utf8_lossy(&dump.stdout);
    let attrs: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains(&format!("] {function}(")))
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('['))
        .collect();
    let attr = |key: &str| attrs.iter().find_map(|l| l.trim().strip_prefix(key));
    let mut inputs = Vec::new();
    let declaration = attr("iree.abi.declaration: ").unwrap_or("");
    let args = declaration.split_once(") ->").map_or(declaration, |(a, _)| a);
    for arg in args.split(", %") {
        if arg.contains("iree.abi.output") {
            let ty = arg
                .split_once("tensor<")
                .and_then(|(_, t)| t.split_once('>'))
                .unwrap()
                .0;
            inputs.push(format!("--input={ty}"));
        } else if arg.contains("iree.abi.transients") {
            let bytes = attr("iree.abi.transients.size.constant: ").expect("a constant transients size");
            inputs.push(format!("--input=&{}xi8", bytes.trim()));
        }
    }
    seen.push((vmfb.to_path_buf(), function.to_string(), inputs.clone()));
    inputs
}

// ---- a host session over the exported graphs --------------------------------------------------

struct Layer {
    first_position: usize,
    rows: usize,
    /// `[nKV, rows, d]`
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Drives the exported prefill / chunk / step graphs on one device, like the runtime: arguments
/// bound by the manifest's names, results read by the manifest's names.
pub struct GraphSession {
    pub dir: PathBuf,
    pub m: Manifest,
    pub device: String,
    target: String,
    work: PathBuf,
    embedding: Vec<f32>,
    layers: Vec<Layer>,
    pub position: usize,
    /// `topk.logits` and `topk.ids` of the last prefill, chunk or step call, when exported.
    pub last_top_k: Option<(Vec<f32>, Vec<i32>)>,
}

impl GraphSession {
    pub fn open(dir: &Path, target: &str, device: &str, work: &Path) -> Self {
        let m = Manifest::load(dir).unwrap();
        let archive = IrpaArchive::open(dir.join(m.parameter_file(Graph::Step).unwrap())).unwrap();
        let emb_key = m.embedding_parameter.clone().unwrap();
        let embedding = kv_core::bf16::bf16_bytes_to_f32(archive.data(&emb_key).unwrap()).unwrap();
        assert_eq!(embedding.len(), m.spec.vocab_size * m.spec.hidden_size);
        std::fs::create_dir_all(work).unwrap();
        GraphSession {
            dir: dir.to_path_buf(),
            m,
            device: device.into(),
            target: target.into(),
            work: work.to_path_buf(),
            embedding,
            layers: Vec::new(),
            position: 0,
            last_top_k: None,
        }
    }

    /// The embedding rows of `tokens`, `[n, hidden]` (the host gather the runtime does).
    pub fn emb(&self, tokens: &[i32]) -> Array {
        let h = self.m.spec.hidden_size;
        let mut rows = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            rows.extend_from_slice(&self.embedding[t as usize * h..(t as usize + 1) * h]);
        }
        Array::F32(vec![tokens.len(), h], rows)
    }

    pub fn call(&self, graph: Graph, named: &dyn Fn(Name) -> Array) -> std::collections::HashMap<Name, Array> {
        let vmfb_file = &self.m.modules[&self.target][graph.key()];
        let vmfb = self.dir.join(vmfb_file);
        let irpa = self.dir.join(self.m.parameter_file(graph).unwrap());
        // A data-tiled CPU module reads its packed weights from its encoded archive too.
        let encoded = self.m.encoded_parameter_file(vmfb_file).map(|e| self.dir.join(e));
        let mut parameters = vec![(self.m.parameter_scope.as_str(), irpa.as_path())];
        parameters.extend(encoded.as_deref().map(|e| (kv_core::manifest::ENCODED_SCOPE, e)));
        // iree-run-module looks functions up inside its one module: no `module.` qualifier.
        let qualified = self.m.functions.get(graph).unwrap();
        let function = qualified.rsplit_once('.').map_or(qualified, |(_, f)| f);
        let args = match graph {
            Graph::Redecode => vec![Name::Tokens],
            Graph::RedecodeAt => vec![Name::Tokens, Name::Select],
            g => self.m.args_or_canonical(g),
        };
        let outs = match graph {
            Graph::Redecode => vec![Name::Ids],
            Graph::RedecodeAt => vec![Name::Token],
            g => self.m.outputs_or_canonical(g),
        };
        let inputs: Vec<Array> = args.iter().map(|&a| named(a)).collect();
        let results = run_module(
            &self.work,
            &self.device,
            &vmfb,
            &parameters,
            function,
            &inputs,
            outs.len(),
        );
        outs.into_iter().zip(results).collect()
    }

    fn tail_of(&self, layer: usize, past: usize, k: bool) -> Array {
        let (nkv, d) = (self.m.spec.n_kv_heads, self.m.spec.head_dim);
        let l = &self.layers[layer];
        assert!(past <= l.rows, "layer {layer} holds {} rows, {past} requested", l.rows);
        let data = if k { &l.k } else { &l.v };
        let mut out = Vec::with_capacity(nkv * past * d);
        for h in 0..nkv {
            let start = (h * l.rows + l.rows - past) * d;
            out.extend_from_slice(&data[start..start + past * d]);
        }
        Array::F32(vec![1, nkv, past, d], out)
    }

    fn top_k_of(results: &std::collections::HashMap<Name, Array>) -> Option<(Vec<f32>, Vec<i32>)> {
        let logits = results.get(&Name::TopKLogits)?.f32().to_vec();
        let ids = results[&Name::TopKIds].i32().to_vec();
        Some((logits, ids))
    }

    fn token(results: &std::collections::HashMap<Name, Array>) -> i32 {
        let t = results[&Name::Token].i32();
        assert_eq!(t.len(), 1, "token result of {} elements", t.len());
        t[0]
    }

    pub fn prefill(&mut self, tokens: &[i32]) -> i32 {
        let plan = plan_prefill(&self.m.spec, tokens).unwrap();
        let emb = self.emb(&plan.tokens);
        let seq = self.m.spec.seq;
        let named = |name: Name| match name {
            Name::Tokens => Array::I32(vec![seq], plan.tokens.clone()),
            Name::Emb => match &emb {
                Array::F32(s, v) => Array::F32(s.clone(), v.clone()),
                _ => unreachable!(),
            },
            Name::Select => Array::F32(vec![1, seq], plan.select.clone()),
            other => panic!("prefill argument {other}"),
        };
        let r = self.call(Graph::Prefill, &named);
        self.last_top_k = Self::top_k_of(&r);
        self.layers = Vec::new();
        let n = plan.n;
        self.keep_rows(&r, |_| (0, n));
        self.position = n;
        Self::token(&r)
    }

    /// Keeps, per layer, `(first_position, rows)` of each result.
    fn keep_rows(&mut self, results: &std::collections::HashMap<Name, Array>, which: impl Fn(usize) -> (usize, usize)) {
        let (nkv, d) = (self.m.spec.n_kv_heads, self.m.spec.head_dim);
        let mut layers = Vec::new();
        for l in 0..self.m.spec.n_layers {
            let (first, keep) = which(l);
            let take = |a: &Array| {
                let shape = a.shape();
                assert_eq!(
                    (shape.len(), shape[0], shape[1], shape[3]),
                    (4, 1, nkv, d),
                    "K/V result shape {shape:?}"
                );
                let rows = shape[2];
                assert!(keep <= rows, "keep {keep} of {rows} rows");
                (0..nkv)
                    .flat_map(|h| a.f32()[h * rows * d..(h * rows + keep) * d].to_vec())
                    .collect::<Vec<f32>>()
            };
            layers.push(Layer {
                first_position: first,
                rows: keep,
                k: take(&results[&Name::K(l)]),
                v: take(&results[&Name::V(l)]),
            });
        }
        self.layers = layers;
    }

    fn kind_inputs<'a>(&self, kinds: &'a [KindInputs], layer: usize) -> &'a KindInputs {
        let kind = self.m.spec.layer_kind(layer);
        kinds.iter().find(|k| k.kind == kind).unwrap()
    }

    fn past_args(&self, kinds: &[KindInputs], name: Name) -> Option<Array> {
        let spec = &self.m.spec;
        for l in 0..spec.n_layers {
            let past = self.kind_inputs(kinds, l).past;
            if name == Name::K(l) {
                return Some(self.tail_of(l, past, true));
            }
            if name == Name::V(l) {
                return Some(self.tail_of(l, past, false));
            }
        }
        None
    }

    pub fn chunk(&mut self, tokens: &[i32]) -> i32 {
        let spec = self.m.spec.clone();
        let plan = plan_chunk(&spec, self.position, tokens).unwrap();
        let c = spec.chunk;
        let (d, mh) = (spec.head_dim, spec.mask_head_count());
        let named = |name: Name| -> Array {
            if let Some(a) = self.past_args(&plan.kinds, name) {
                return a;
            }
            for k in &plan.kinds {
                if name == Name::Cos(k.kind) {
                    return Array::F32(vec![c, d], k.rope.cos.clone());
                }
                if name == Name::Sin(k.kind) {
                    return Array::F32(vec![c, d], k.rope.sin.clone());
                }
                if name == Name::Mask(k.kind) {
                    return Array::F32(vec![1, mh, c, k.past + c], k.mask.clone());
                }
            }
            match name {
                Name::Tokens => Array::I32(vec![c], plan.tokens.clone()),
                Name::Emb => self.emb(&plan.tokens),
                Name::Select => Array::F32(vec![1, c], plan.select.clone()),
                other => panic!("chunk argument {other}"),
            }
        };
        let r = self.call(Graph::Chunk, &named);
        self.last_top_k = Self::top_k_of(&r);
        let pos = self.position;
        let pasts: Vec<usize> = (0..spec.n_layers)
            .map(|l| self.kind_inputs(&plan.kinds, l).past)
            .collect();
        self.keep_rows(&r, |l| (pos - pasts[l], pasts[l] + plan.n));
        self.position += plan.n;
        Self::token(&r)
    }

    pub fn step(&mut self, token: i32) -> i32 {
        let spec = self.m.spec.clone();
        let plan = plan_step(&spec, self.position, token, WindowRule::Exact).unwrap();
        let d = spec.head_dim;
        let named = |name: Name| -> Array {
            if let Some(a) = self.past_args(&plan.kinds, name) {
                return a;
            }
            for k in &plan.kinds {
                if name == Name::Cos(k.kind) {
                    return Array::F32(vec![1, d], k.rope.cos.clone());
                }
                if name == Name::Sin(k.kind) {
                    return Array::F32(vec![1, d], k.rope.sin.clone());
                }
            }
            match name {
                Name::Token => Array::I32(vec![1], vec![token]),
                Name::Emb => self.emb(&[token]),
                other => panic!("step argument {other}"),
            }
        };
        let r = self.call(Graph::Step, &named);
        self.last_top_k = Self::top_k_of(&r);
        let pos = self.position;
        let pasts: Vec<usize> = (0..spec.n_layers)
            .map(|l| self.kind_inputs(&plan.kinds, l).past)
            .collect();
        self.keep_rows(&r, |l| (pos - pasts[l], pasts[l] + 1));
        self.position += 1;
        Self::token(&r)
    }

    pub fn layer(&self, l: usize) -> LayerKv {
        let x = &self.layers[l];
        LayerKv {
            first_position: x.first_position,
            rows: x.rows,
            n_kv_heads: self.m.spec.n_kv_heads,
            head_dim: self.m.spec.head_dim,
            k: x.k.clone(),
            v: x.v.clone(),
        }
    }

    /// Redecode `[1, seq] → [seq]` over `tokens` padded with 0.
    pub fn redecode(&self, tokens: &[i32], seq: usize) -> Vec<i32> {
        let mut padded = tokens.to_vec();
        padded.resize(seq, 0);
        let r = self.call(Graph::Redecode, &|_| Array::I32(vec![1, seq], padded.clone()));
        assert_eq!(r[&Name::Ids].shape(), &[seq]);
        r[&Name::Ids].i32().to_vec()
    }

    pub fn redecode_at(&self, tokens: &[i32], seq: usize) -> i32 {
        let mut padded = tokens.to_vec();
        padded.resize(seq, 0);
        let mut select = vec![0.0; seq];
        select[tokens.len() - 1] = 1.0;
        let r = self.call(Graph::RedecodeAt, &|name| match name {
            Name::Tokens => Array::I32(vec![1, seq], padded.clone()),
            _ => Array::F32(vec![1, seq], select.clone()),
        });
        Self::token(&r)
    }
}

/// Compares every layer's K/V on the rows both hold.
#[track_caller]
pub fn assert_layers_close(what: &str, graph: &GraphSession, reference: &impl KvBackend) {
    for l in 0..graph.m.spec.n_layers {
        kv_core::tolerance::assert_layers_close(
            &format!("{what}: layer {l}"),
            &graph.layer(l),
            &reference.read_layer(l).unwrap(),
            Tolerance::CROSS_BACKEND,
        );
    }
}
