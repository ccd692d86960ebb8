//! `KvDecoder::generate_until`: a caller that has read what it wanted (a closed tool call) ends
//! the generation after that id; what came before is what `generate_with` gives.

mod common;

use backend_reference::ReferenceKv;
use common::*;
use kv_core::sampling::SamplingConfig;
use kv_core::{DecodeOptions, KvDecoder, WindowRule};

#[test]
fn the_callback_ends_generation_after_its_id() {
    let name = "tiny-gemma3:7";
    let model = model(name);
    let prompt = tokens(12, model.spec().vocab_size, 5);
    let greedy = DecodeOptions::greedy(12, []);
    let sampled = DecodeOptions {
        sampling: Some(SamplingConfig {
            temperature: 0.8,
            seed: 3,
            ..SamplingConfig::default()
        }),
        ..greedy.clone()
    };
    for options in [greedy, sampled] {
        let mut kv = KvDecoder::new(ReferenceKv::new(model.clone(), WindowRule::Exact));
        let prefix = kv.prefill_prefix(&prompt[..6]).unwrap();
        let full = kv.generate_with(&prefix, &prompt[6..], &options, |_| {}).unwrap();
        assert_eq!(full.ids.len(), 12);
        let mut seen = 0;
        let cut = kv
            .generate_until(&prefix, &prompt[6..], &options, |_| {
                seen += 1;
                seen < 5
            })
            .unwrap();
        assert_eq!(cut.ids, full.ids[..5], "{options:?}");
        assert!(!cut.stopped_at_eos);
        assert_eq!(cut.timing.decode_tokens, 4, "no step after the last id");
    }
}
