//! `cargo run -p export --example export_fixture -- SOURCE OUT_DIR [shared|three] [SEQ]`: exports a
//! fixture name or model directory for CPU and Vulkan.
use export::{export_artifacts, ExportOptions, Layout, Source};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let layout = match args.get(3).map(String::as_str) {
        Some("three") => Layout::Three,
        _ => Layout::Shared,
    };
    let options = ExportOptions {
        layout,
        prefill_seq: args.get(4).map(|s| s.parse().unwrap()),
        ..Default::default()
    };
    let t = std::time::Instant::now();
    // A fixture name is materialized here: `export` itself reads fixtures only with its
    // `fixtures` feature.
    let source = match Source::parse(&args[1]) {
        Source::Fixture(name) => Source::Dir(fixtures::materialize(&name).expect("fixture")),
        dir => dir,
    };
    match export_artifacts(&source, std::path::Path::new(&args[2]), &options) {
        Ok(m) => println!("exported in {:.1} s: {:?}", t.elapsed().as_secs_f64(), m.modules),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
    }
}
