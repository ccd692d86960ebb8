//! `seed-gen OUT_DIR`: the fuzz targets' seed corpora (see the library's documentation).

fn main() {
    let out = std::env::args().nth(1).expect("usage: seed-gen OUT_DIR");
    for (target, n, bytes) in seed_gen::write_seeds(std::path::Path::new(&out)) {
        println!("seed-gen: {target}: {n} seeds, {bytes} bytes in {out}/{target}");
    }
}
