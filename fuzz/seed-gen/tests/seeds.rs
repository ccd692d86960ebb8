//! Writes the seed corpora: into `$SEED_GEN_OUT` when set (scripts/fuzz.sh), else into a
//! temporary directory, so that `cargo test` checks every target gets seeds from real inputs.

#[test]
fn every_target_gets_seeds() {
    let temp = tempfile::tempdir().unwrap();
    let out = std::env::var_os("SEED_GEN_OUT").map_or_else(|| temp.path().to_path_buf(), Into::into);
    let written = seed_gen::write_seeds(&out);
    assert_eq!(written.iter().map(|w| w.0).collect::<Vec<_>>(), seed_gen::TARGETS);
    for (target, n, bytes) in written {
        println!(
            "seed-gen: {target}: {n} seeds, {bytes} bytes in {}",
            out.join(target).display()
        );
        // The real inputs behind each corpus: a missing golden or model must not pass as a
        // near-empty corpus.
        assert!(n >= 4 && bytes > 1024, "{target}: only {n} seeds, {bytes} bytes");
    }
}
