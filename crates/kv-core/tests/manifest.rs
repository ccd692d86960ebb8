use kv_core::manifest::{canonical_args, Graph, Manifest};
use kv_core::{Error, KvSpec};

fn small() -> KvSpec {
    KvSpec {
        n_layers: 4,
        sliding_window: 8,
        global_layer_period: 2,
        seq: 64,
        ..KvSpec::default()
    }
}

#[test]
fn canonical_chunk_args_follow_the_contract() {
    let args = canonical_args(Graph::Chunk, &small());
    let want = [
        "tokens",
        "emb",
        "cosSliding",
        "sinSliding",
        "l0.k",
        "l0.v",
        "maskSliding",
        "cosGlobal",
        "sinGlobal",
        "l1.k",
        "l1.v",
        "maskGlobal",
        "l2.k",
        "l2.v",
        "l3.k",
        "l3.v",
        "select",
    ];
    assert_eq!(args, want);
    let step = canonical_args(Graph::Step, &small());
    assert_eq!(&step[..6], ["token", "emb", "cosSliding", "sinSliding", "l0.k", "l0.v"]);
    assert!(!step.iter().any(|a| a.starts_with("mask")));
}

#[test]
fn round_trip_and_defaults() {
    let m = Manifest::new(small(), None, "gemma");
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(back, m);
    assert_eq!(back.functions.with_past.as_deref(), Some("module.gemma_with_past"));
    // Missing geometry keys fall back to FunctionGemma-270M; unknown keys are ignored.
    let m = Manifest::from_json(r#"{"contractVersion": 1, "nLayers": 18, "somethingNew": true}"#).unwrap();
    assert_eq!(m.spec, KvSpec::default());
}

#[test]
fn a_reordered_list_is_accepted() {
    let mut m = Manifest::new(small(), None, "gemma");
    m.prefill_with_past_args.as_mut().unwrap().reverse();
    Manifest::from_json(&m.to_json()).unwrap();
}

#[test]
fn malformed_manifests_name_the_key() {
    let cases = [
        (r#"{"nHeads": 4, "nKvHeads": 3}"#, "nKvHeads"),
        (r#"{"chunk": 0}"#, "chunk"),
        (r#"{"maskHeads": 2}"#, "maskHeads"),
        (r#"{"contractVersion": 2}"#, "contractVersion"),
        (r#"{"headDim": 255}"#, "headDim"),
        (r#"{"seq": 4096}"#, "seq"),
        (r#"{"withPastArgs": ["token"]}"#, "withPastArgs"),
    ];
    for (json, key) in cases {
        match Manifest::from_json(json) {
            Err(Error::Manifest { key: got, reason }) => assert_eq!(got, key, "{json}: {reason}"),
            other => panic!("{json}: expected a manifest error on {key}, got {other:?}"),
        }
    }
    let err = Manifest::from_json(r#"{"nLayers": "many"}"#).unwrap_err().to_string();
    assert!(err.contains("nLayers"), "{err}");
}

#[test]
fn top_k_outputs_are_the_one_optional_extra() {
    use kv_core::manifest::{TOPK_IDS, TOPK_LOGITS};
    let plain = Manifest::new(small(), None, "gemma");
    assert!(!plain.to_json().contains("topK"), "a manifest without top-k changed");
    let mut m = plain.clone();
    m.set_top_k(Some(64));
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(back, m);
    for g in Graph::KV {
        let out = back.outputs_or_canonical(g);
        assert_eq!(&out[out.len() - 3..], ["token", TOPK_LOGITS, TOPK_IDS]);
    }
    assert_eq!(back.outputs_or_canonical(Graph::Redecode), ["ids"]);
    // Without lists the canonical order carries them too.
    let mut bare = m.clone();
    bare.prefill_outputs = None;
    assert_eq!(
        bare.outputs_or_canonical(Graph::Prefill),
        m.outputs_or_canonical(Graph::Prefill)
    );
    // Switching it off again gives the plain manifest back.
    m.set_top_k(None);
    assert_eq!(m, plain);

    let refused = |edit: &dyn Fn(&mut Manifest), key: &str| {
        let mut m = plain.clone();
        m.set_top_k(Some(8));
        edit(&mut m);
        match Manifest::from_json(&m.to_json()) {
            Err(Error::Manifest { key: k, reason }) => assert_eq!(k, key, "{reason}"),
            other => panic!("expected an error on {key}, got {other:?}"),
        }
    };
    // Listed without `topK`, half of the pair, or `topK` without the lists' entries.
    refused(&|m| m.top_k = None, "prefillOutputs");
    refused(
        &|m| m.with_past_outputs.as_mut().unwrap().retain(|n| n != TOPK_IDS),
        "withPastOutputs",
    );
    refused(
        &|m| {
            m.prefill_with_past_outputs
                .as_mut()
                .unwrap()
                .retain(|n| n != TOPK_LOGITS && n != TOPK_IDS)
        },
        "prefillWithPastOutputs",
    );
    refused(&|m| m.top_k = Some(0), "topK");
    refused(&|m| m.top_k = Some(m.spec.vocab_size + 1), "topK");
}
