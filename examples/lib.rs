//! Runnable examples of the skainet-kv library (nothing to link against here).
//!
//! - `session.rs`: open a model (the tiny fixture, or a model directory from the store), create a
//!   KV session, prefill a shared prefix once and snapshot it, answer utterances by restoring
//!   the snapshot, feeding them in chunk calls and decoding greedily (`kv_core::KvDecoder`), the
//!   same by hand through `kv_core::KvBackend`, and the prefix saved to a snapshot file and
//!   loaded into a fresh session.
//!
//! ```sh
//! cargo run -p skainet-kv-examples --example session                 # tiny-gemma3:7, generated once into the cache
//! cargo run -p skainet-kv-examples --example session -- MODEL_DIR    # e.g. .cache/models/gemma3-270m (a manifest.json + archive)
//! cargo test -p skainet-kv-examples                                  # what CI runs: each example's test on the fixture
//! ```
