//! `cargo run -p export --example emit_fixture -- tiny-gemma3:7 OUT_DIR [SEQ]`: emits each graph of a
//! fixture into its own `.mlir` (no compile), for looking at and compiling by hand.
use kv_core::{Graph, Manifest};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = fixtures::materialize(&args[1]).expect("fixture");
    let out = std::path::PathBuf::from(&args[2]);
    std::fs::create_dir_all(&out).unwrap();
    let mut m = Manifest::load(&dir).unwrap();
    if let Some(seq) = args.get(3) {
        m.spec.seq = seq.parse().unwrap();
    }
    for g in [
        Graph::Prefill,
        Graph::Chunk,
        Graph::Step,
        Graph::Redecode,
        Graph::RedecodeAt,
    ] {
        let text = export::emit(&m, g, &export::EmitOptions::default()).unwrap();
        std::fs::write(out.join(format!("{}.mlir", g.key())), text).unwrap();
    }
    println!("{}", dir.display());
}
