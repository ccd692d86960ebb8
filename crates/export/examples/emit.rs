//! Writes the StableHLO of some graphs of a model without compiling it (for exploring compiler
//! flags by hand with `iree-compile`):
//!
//! `cargo run -p export --example emit -- MODEL GRAPHS OUT.mlir [--weight-storage bf16|packed|i16]
//! [--layers N] [--seq N] [--redecode-seq N] [--contract 1|2] [--fused-dequant true|false]`
//!
//! MODEL is a fixture name (only its manifest is read, nothing is materialized) or a directory
//! holding `manifest.json`; GRAPHS is a comma-separated list of graph keys (`prefill`,
//! `withPast`, `prefillWithPast`, `redecode`, `redecodeAt`); `--layers` keeps the first N layers
//! (the weights are never read, so a cut model still emits).

use std::path::Path;

use export::{emit_module, EmitOptions, WeightFormat};
use kv_core::{Graph, Manifest};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!(
            "usage: emit MODEL GRAPHS OUT.mlir [--weight-storage bf16|packed|i16] [--layers N] [--seq N] [--redecode-seq N] [--contract 1|2] [--tiled-softmax true|false] [--fused-dequant true|false]"
        );
        std::process::exit(2);
    }
    if let Some(rest) = args[0].strip_prefix("argmax:") {
        // `argmax:ROWS:N[:TILES]`: a module holding only the argmax of `[ROWS, N]` logits.
        let p: Vec<usize> = rest
            .split(':')
            .map(|x| x.parse().expect("argmax:ROWS:N[:TILES]"))
            .collect();
        let x = export::mlir::V {
            name: "%arg0".into(),
            ty: export::mlir::Ty::fixed(&[p[0], p[1]], export::mlir::Elem::F32),
        };
        let mut b = export::mlir::Body::new();
        let ids = match p.get(2) {
            Some(&t) => b.argmax_rows_tiled(&x, t),
            None => b.argmax_rows(&x),
        };
        let text = format!(
            "module @module {{\n  func.func @argmax(%arg0: {}) -> {} {{\n{}    return {} : {}\n  }}\n}}\n",
            x.ty.text(),
            ids.ty.text(),
            b.finish(),
            ids.name,
            ids.ty.text()
        );
        std::fs::write(&args[2], text).expect("writing the module");
        return;
    }
    let mut m = if Path::new(&args[0]).is_dir() {
        Manifest::load(Path::new(&args[0])).expect("manifest")
    } else {
        fixtures::Fixture::parse(&args[0]).expect("fixture name").manifest()
    };
    let graphs: Vec<Graph> = args[1]
        .split(',')
        .map(|k| {
            [
                Graph::Prefill,
                Graph::Chunk,
                Graph::Step,
                Graph::Redecode,
                Graph::RedecodeAt,
            ]
            .into_iter()
            .find(|g| g.key() == k)
            .unwrap_or_else(|| panic!("unknown graph `{k}`"))
        })
        .collect();
    // A quantized model directory's matrices are emitted as its export would (dequantized in
    // the contractions; `--fused-dequant true` for the form of modules with aggressive fusion).
    let mut options = EmitOptions {
        weights: WeightFormat::Bf16,
        quantization: m.quantization.clone(),
        ..EmitOptions::default()
    };
    let mut rest = args[3..].iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().expect("flag value");
        match flag.as_str() {
            "--tiled-softmax" => options.tiled_softmax = value == "true",
            "--fused-dequant" => options.fused_dequant = value == "true",
            "--weight-storage" => {
                options.weights = match value.as_str() {
                    "bf16" => WeightFormat::Bf16,
                    "packed" => WeightFormat::PackedI32,
                    "i16" => WeightFormat::I16,
                    other => panic!("unknown weight format `{other}`"),
                }
            }
            "--layers" => {
                m.spec.n_layers = value.parse().expect("--layers N");
                for list in [
                    &mut m.prefill_args,
                    &mut m.prefill_outputs,
                    &mut m.prefill_with_past_args,
                    &mut m.prefill_with_past_outputs,
                    &mut m.with_past_args,
                    &mut m.with_past_outputs,
                ] {
                    *list = None;
                }
            }
            "--seq" => m.spec.seq = value.parse().expect("--seq N"),
            "--contract" => {
                if value.as_str() == "2" {
                    m = m.into_v2(kv_core::V2Spec::default());
                }
            }
            "--redecode-seq" => options.redecode_seq = Some(value.parse().expect("--redecode-seq N")),
            other => panic!("unknown flag `{other}`"),
        }
    }
    let text = emit_module(&m, &graphs, &options).expect("emit");
    std::fs::write(&args[2], text).expect("writing the module");
}
