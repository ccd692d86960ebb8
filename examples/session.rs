//! A KV-cache session through the library, the app's path: open a model, create a session,
//! prefill a shared prefix once and snapshot it, then answer each utterance by restoring the
//! snapshot (no copy), feeding the utterance in chunk calls and decoding greedily; the same by
//! hand on the backend; and the prefix saved to a snapshot file and loaded by a fresh session.
//!
//! ```sh
//! cargo run -p skainet-kv-examples --example session                # the tiny fixture tiny-gemma3:7
//! cargo run -p skainet-kv-examples --example session -- MODEL_DIR   # a directory holding manifest.json
//!                                                                   # (e.g. .cache/models/gemma3-270m)
//! ```
//!
//! It runs on `backend-reference`, the FP32 forward. Every backend implements the same
//! [`KvBackend`], so the decoder code below is unchanged on IREE: the CLI opens
//! `backend_iree::IreeKvBackend` on exported artifacts (`skainet-kv generate --backend iree-cpu`
//! does what `answer` does here, with a tokenizer in front).

use std::error::Error;
use std::path::{Path, PathBuf};

use backend_reference::{ReferenceKv, ReferenceModel};
use kv_core::{snapshot_file, KvBackend, KvDecoder, WindowRule};

/// New ids per utterance.
const MAX_NEW: usize = 8;

fn main() -> Result<(), Box<dyn Error>> {
    let dir = match std::env::args_os().nth(1) {
        Some(dir) => PathBuf::from(dir),
        // Generated once from its seed into the cache (`$SKAINET_KV_CACHE/fixtures/`).
        None => fixtures::materialize("tiny-gemma3:7")?,
    };
    run(&dir, true)?;
    Ok(())
}

/// The ids each utterance was answered with.
fn run(dir: &Path, print: bool) -> Result<Vec<Vec<i32>>, Box<dyn Error>> {
    // The weights are read once; sessions share the model through the `Arc`.
    let model = ReferenceModel::open(dir)?;
    let spec = model.spec().clone();
    if print {
        println!(
            "{}: {} layers, vocab {}, chunk {}, context {}",
            dir.display(),
            spec.n_layers,
            spec.vocab_size,
            spec.chunk,
            spec.max_positions
        );
    }
    // Ids stand in for text here (a tokenizer would make them): a shared prefix (an app's tool
    // catalog) and three short utterances.
    let vocab = spec.vocab_size as i32;
    let ids = |from: i32, n: i32| -> Vec<i32> { (0..n).map(|i| (from + 7 * i) % vocab).collect() };
    let prefix = ids(3, 40);
    let utterances = [ids(101, 5), ids(202, 9), ids(303, 3)];

    // One session; the decoder owns it. The exact sliding-window rule (the default).
    let mut decoder = KvDecoder::new(ReferenceKv::new(model.clone(), WindowRule::Exact));
    // Prefill the prefix once: an owned snapshot of the caches at position 40.
    let snapshot = decoder.prefill_prefix(&prefix)?;

    // Each utterance: restore the snapshot, feed it in chunk calls, decode greedily.
    let mut answers = Vec::new();
    for utterance in &utterances {
        let generation = decoder.generate(&snapshot, utterance, None, MAX_NEW)?;
        if print {
            let t = &generation.timing;
            println!(
                "utterance {utterance:?} -> {:?}  (restore {:?}, {} chunk call(s) {:?}, {} steps {:?})",
                generation.ids, t.restore, t.chunk_calls, t.chunk, t.decode_tokens, t.decode
            );
        }
        answers.push(generation.ids);
    }

    // A snapshot stays valid after any later calls: the first utterance again, after the
    // others, gives the same answer.
    let again = decoder.generate(&snapshot, &utterances[0], None, MAX_NEW)?;
    assert_eq!(again.ids, answers[0], "a restored snapshot answers as before");

    // The same by hand on the backend: restore, one chunk call, then one step per token (each
    // call returns the next token, the graph's argmax).
    let backend = decoder.backend_mut();
    backend.restore(&snapshot)?;
    let mut next = backend.chunk(&utterances[0])?;
    let mut by_hand = Vec::new();
    while by_hand.len() < MAX_NEW {
        by_hand.push(next);
        if by_hand.len() < MAX_NEW {
            next = backend.step(next)?;
        }
    }
    assert_eq!(by_hand, answers[0], "the decoder is these calls");
    assert_eq!(backend.position(), prefix.len() + utterances[0].len() + MAX_NEW - 1);

    // The prefix as a file: saved once, loaded by a fresh session of the same model (another
    // process, in an app) instead of prefilled. A file of another model is refused.
    let file = std::env::temp_dir().join(format!("skainet-kv-example-{}.skvsnap", std::process::id()));
    let bytes = snapshot_file::save(decoder.backend(), &snapshot, &file)?;
    let fresh = ReferenceKv::new(model, WindowRule::Exact);
    let loaded = snapshot_file::load(&fresh, &file);
    std::fs::remove_file(&file)?;
    let mut fresh_decoder = KvDecoder::new(fresh);
    let from_file = fresh_decoder.generate(&loaded?, &utterances[1], None, MAX_NEW)?;
    assert_eq!(
        from_file.ids, answers[1],
        "a loaded snapshot answers as the prefilled one"
    );
    if print {
        println!("snapshot file: {bytes} bytes, loaded into a fresh session: the same answer");
    }
    Ok(answers)
}

#[cfg(test)]
mod tests {
    /// What CI runs (`cargo test` builds this example in test mode): the whole example on the
    /// tiny fixture, its answers fixed so that a change of the forward shows here too.
    #[test]
    fn the_session_example_runs_on_the_tiny_fixture() {
        let dir = fixtures::materialize("tiny-gemma3:7").unwrap();
        let answers = super::run(&dir, false).unwrap();
        assert_eq!(answers.len(), 3);
        assert!(answers.iter().all(|ids| ids.len() == super::MAX_NEW));
    }
}
