use kv_core::manifest::{canonical_args, Graph, Manifest, Name, Provenance, UnknownName, V2Spec};
use kv_core::LayerKind;
use kv_core::{Error, KvSpec};
use proptest::prelude::*;

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
    assert_eq!(spelled(&args), want);
    let step = canonical_args(Graph::Step, &small());
    assert_eq!(
        spelled(&step[..6]),
        ["token", "emb", "cosSliding", "sinSliding", "l0.k", "l0.v"]
    );
    assert!(!step.iter().any(|a| matches!(a, Name::Mask(_))));
}

#[test]
fn v2_lists_take_pos_and_no_masks_and_have_no_prefill() {
    let m = Manifest::new(small(), None, "gemma").into_v2(V2Spec::default());
    assert!(m.is_v2());
    assert_eq!(m.kv_graphs(), [Graph::Chunk, Graph::Step]);
    assert!(m.functions.prefill.is_none() && m.args(Graph::Prefill).is_none());
    let chunk = m.args_or_canonical(Graph::Chunk);
    assert_eq!(
        spelled(&chunk),
        [
            "tokens",
            "emb",
            "pos",
            "cosSliding",
            "sinSliding",
            "l0.k",
            "l0.v",
            "cosGlobal",
            "sinGlobal",
            "l1.k",
            "l1.v",
            "l2.k",
            "l2.v",
            "l3.k",
            "l3.v",
            "select",
        ]
    );
    assert_eq!(spelled(&m.args_or_canonical(Graph::Step)[..3]), ["token", "emb", "pos"]);
    // The outputs keep v1's names (the new rows come back under the cache names).
    assert_eq!(
        m.outputs_or_canonical(Graph::Step),
        Manifest::new(small(), None, "gemma").outputs_or_canonical(Graph::Step)
    );
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(back, m);
    // A v1 list in a v2 manifest (a mask, no pos) is refused by name.
    let mut mixed = m.clone();
    mixed.with_past_args = Some(canonical_args(Graph::Step, &small()));
    let err = Manifest::from_json(&mixed.to_json()).unwrap_err();
    assert!(
        matches!(&err, Error::Manifest { key, .. } if key == "withPastArgs"),
        "{err}"
    );
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
        (r#"{"contractVersion": 3}"#, "contractVersion"),
        (
            r#"{"contractVersion": 2, "functions": {"prefill": "module.gemma_prefill_at"}}"#,
            "functions.prefill",
        ),
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
    let plain = Manifest::new(small(), None, "gemma");
    assert!(!plain.to_json().contains("topK"), "a manifest without top-k changed");
    let mut m = plain.clone();
    m.set_top_k(Some(64));
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(back, m);
    for g in Graph::KV {
        let out = back.outputs_or_canonical(g);
        assert_eq!(spelled(&out[out.len() - 3..]), ["token", "topk.logits", "topk.ids"]);
    }
    assert_eq!(back.outputs_or_canonical(Graph::Redecode), [Name::Ids]);
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
        &|m| m.with_past_outputs.as_mut().unwrap().retain(|n| *n != Name::TopKIds),
        "withPastOutputs",
    );
    refused(
        &|m| {
            m.prefill_with_past_outputs
                .as_mut()
                .unwrap()
                .retain(|n| !matches!(n, Name::TopKLogits | Name::TopKIds))
        },
        "prefillWithPastOutputs",
    );
    refused(&|m| m.top_k = Some(0), "topK");
    refused(&|m| m.top_k = Some(m.spec.vocab_size + 1), "topK");
}

#[test]
fn the_allowed_mask_is_v2s_last_argument() {
    let plain = Manifest::new(small(), None, "gemma").into_v2(V2Spec::default());
    assert!(
        !plain.to_json().contains("allowed"),
        "a v2 manifest without the mask changed"
    );
    let mut m = plain.clone();
    m.set_allowed_mask(true);
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(back, m);
    for &g in back.kv_graphs() {
        assert_eq!(back.args_or_canonical(g).last(), Some(&Name::Allowed), "{}", g.key());
        assert_eq!(back.canonical_args(g).last(), Some(&Name::Allowed), "{}", g.key());
    }
    assert!(!back.canonical_args(Graph::Redecode).contains(&Name::Allowed));
    // A manifest made v2 with the key set lists it too.
    let mut v1 = Manifest::new(small(), None, "gemma");
    v1.allowed_mask = true;
    let v2 = v1.into_v2(V2Spec::default());
    assert_eq!(v2.with_past_args.as_ref().unwrap().last(), Some(&Name::Allowed));
    m.set_allowed_mask(false);
    assert_eq!(m, plain);

    let key_of = |m: &Manifest| match Manifest::from_json(&m.to_json()) {
        Err(Error::Manifest { key, .. }) => key,
        other => panic!("expected a manifest error, got {other:?}"),
    };
    // The key without the lists' entry, an entry without the key, or the key on contract 1.
    let mut keyed = plain.clone();
    keyed.allowed_mask = true;
    assert_eq!(key_of(&keyed), "prefillWithPastArgs");
    let mut listed = plain.clone();
    listed.set_allowed_mask(true);
    listed.allowed_mask = false;
    assert_eq!(key_of(&listed), "prefillWithPastArgs");
    let mut v1 = Manifest::new(small(), None, "gemma");
    v1.allowed_mask = true;
    assert_eq!(key_of(&v1), "allowedMask");
}

fn spelled(names: &[Name]) -> Vec<String> {
    names.iter().map(ToString::to_string).collect()
}

fn any_name() -> impl Strategy<Value = Name> {
    let kind = prop_oneof![Just(LayerKind::Sliding), Just(LayerKind::Global)];
    prop_oneof![
        Just(Name::Tokens),
        Just(Name::Token),
        Just(Name::Emb),
        Just(Name::Select),
        Just(Name::Ids),
        Just(Name::TopKLogits),
        Just(Name::TopKIds),
        Just(Name::Allowed),
        Just(Name::Pos),
        kind.clone().prop_map(Name::Cos),
        kind.clone().prop_map(Name::Sin),
        kind.prop_map(Name::Mask),
        any::<usize>().prop_map(Name::K),
        any::<usize>().prop_map(Name::V),
    ]
}

proptest! {
    #[test]
    fn names_round_trip(name in any_name()) {
        let text = name.to_string();
        prop_assert_eq!(text.parse::<Name>(), Ok(name));
        let json = serde_json::to_string(&name).unwrap();
        prop_assert_eq!(json, format!("\"{text}\""));
    }

    /// Whatever parses prints back as the same text: a manifest read and written keeps its bytes.
    #[test]
    fn only_the_one_spelling_parses(text in "(l|cos|sin|mask|topk\\.)?[A-Za-z0-9+.]{0,8}") {
        if let Ok(name) = text.parse::<Name>() {
            prop_assert_eq!(name.to_string(), text);
        }
    }
}

#[test]
fn other_spellings_are_refused() {
    for text in [
        "",
        "l1",
        "l.k",
        "l01.k",
        "l+1.k",
        "l1.q",
        "L1.k",
        "cos",
        "cosLocal",
        "masksliding",
        "Token",
        "topk",
    ] {
        let err = text.parse::<Name>().unwrap_err();
        assert_eq!(err, UnknownName(text.to_string()));
    }
}

#[test]
fn unknown_names_are_refused_with_the_key_named() {
    let mut m = Manifest::new(small(), None, "gemma");
    let json = m.to_json().replacen("\"l2.v\"", "\"l2.value\"", 1);
    match Manifest::from_json(&json) {
        Err(Error::Manifest { key, reason }) => {
            assert!(key.starts_with("prefillOutputs"), "{key}: {reason}");
            assert!(reason.contains("l2.value"), "{key}: {reason}");
        }
        other => panic!("expected a manifest error, got {other:?}"),
    }
    // A well-formed name of no such layer is refused by validation.
    m.with_past_args.as_mut().unwrap().push(Name::K(9));
    match Manifest::from_json(&m.to_json()) {
        Err(Error::Manifest { key, reason }) => {
            assert_eq!(key, "withPastArgs", "{reason}");
            assert!(reason.contains("l9.k"), "{reason}");
        }
        other => panic!("expected a manifest error, got {other:?}"),
    }
}

#[test]
fn provenance_keeps_its_spellings() {
    let old = r#"{"provenance": {
        "compiler": "iree-base-compiler 3.13.0",
        "parameterKeys": "{\"prefill\":{\"p0\":\"token_embd.weight\"}}",
        "redecodeSeq": "12",
        "someoneElse": "kept"
    }}"#;
    let m = Manifest::from_json(old).unwrap();
    let p = &m.provenance;
    assert_eq!(p.redecode_seq, Some(12));
    assert_eq!(p.parameter_keys.as_ref().unwrap()["prefill"]["p0"], "token_embd.weight");
    assert_eq!(p.other["someoneElse"], "kept");
    let written: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
    let original: serde_json::Value = serde_json::from_str(old).unwrap();
    assert_eq!(written["provenance"], original["provenance"], "written as it was read");
    // The object and number forms are read too.
    let m = Manifest::from_json(r#"{"provenance": {"parameterKeys": {"prefill": {"p0": "x"}}, "redecodeSeq": 7}}"#)
        .unwrap();
    assert_eq!(m.provenance.redecode_seq, Some(7));
    assert_eq!(m.provenance.parameter_keys.unwrap()["prefill"]["p0"], "x");
    let err = Manifest::from_json(r#"{"provenance": {"redecodeSeq": "seven"}}"#).unwrap_err();
    assert!(
        matches!(&err, Error::Manifest { key, reason } if key == "provenance.redecodeSeq" && reason.contains("seven")),
        "{err:?}"
    );
    assert!(Manifest::new(small(), None, "gemma").provenance == Provenance::default());
    assert!(!Manifest::new(small(), None, "gemma").to_json().contains("provenance"));
}

/// `encodedParameters` names modules of `modules`, and the model archive's scope is not the
/// encoded archives' one: anything else is refused at load with the key named.
#[test]
fn encoded_parameters_must_name_a_module() {
    let mut m = Manifest::new(small(), None, "gemma");
    m.modules
        .entry("llvm-cpu".into())
        .or_default()
        .insert("withPast".into(), "gemma.llvm-cpu.vmfb".into());
    m.encoded_parameters
        .insert("gemma.llvm-cpu.vmfb".into(), "gemma.llvm-cpu.irpa".into());
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(
        back.encoded_parameter_file("gemma.llvm-cpu.vmfb"),
        Some("gemma.llvm-cpu.irpa")
    );
    assert_eq!(back.encoded_parameter_file("other.vmfb"), None);

    let mut stray = m.clone();
    stray.encoded_parameters.insert("other.vmfb".into(), "x.irpa".into());
    let err = Manifest::from_json(&stray.to_json()).unwrap_err().to_string();
    assert!(err.contains("encodedParameters") && err.contains("other.vmfb"), "{err}");

    let mut clash = m.clone();
    clash.parameter_scope = kv_core::manifest::ENCODED_SCOPE.into();
    let err = Manifest::from_json(&clash.to_json()).unwrap_err().to_string();
    assert!(err.contains("parameterScope"), "{err}");
}

/// Contract v2's ring and prefill graph: the prefill graph takes the chunk graph's arguments
/// and round-trips; each key is refused by name where it does not fit (a v1 manifest, a prefill
/// graph no wider than a chunk or wider than the ring, a v2 prefill list without `prefillChunk`).
/// A v1 manifest cannot hold the layout in Rust ([`Contract::V1`] has none), so it is refused
/// where it is read: from a file that says contract 1 beside v2 keys.
#[test]
fn v2_ring_and_prefill_chunk_are_checked_by_key() {
    let layout = V2Spec {
        sliding_cache_rows: 40,
        prefill_chunk: 40,
        ..V2Spec::default()
    };
    let m = Manifest::new(small(), None, "gemma").into_v2(layout.clone());
    m.validate().unwrap();
    assert_eq!(m.kv_graphs(), Graph::KV);
    assert_eq!(m.args_or_canonical(Graph::Prefill), m.args_or_canonical(Graph::Chunk));
    assert_eq!(Manifest::from_json(&m.to_json()).unwrap(), m);
    let key_of = |m: &Manifest| match m.validate() {
        Err(Error::Manifest { key, .. }) => key,
        other => panic!("{other:?}"),
    };
    let read_key = |json: &str| match Manifest::from_json(json) {
        Err(Error::Manifest { key, .. }) => key,
        other => panic!("{other:?}"),
    };
    let as_v1 = |m: &Manifest| m.to_json().replace("\"contractVersion\": 2", "\"contractVersion\": 1");
    assert!(as_v1(&m).contains("\"contractVersion\": 1"));
    assert_eq!(read_key(&as_v1(&m)), "slidingCacheRows");
    let chunk_only = V2Spec {
        sliding_cache_rows: 0,
        ..layout.clone()
    };
    let v1_chunk = as_v1(&Manifest::new(small(), None, "gemma").into_v2(chunk_only));
    assert_eq!(read_key(&v1_chunk), "prefillChunk");
    assert_eq!(
        read_key(&m.to_json().replace("\"contractVersion\": 2", "\"contractVersion\": 3")),
        "contractVersion"
    );
    for rows in [small().chunk, 41] {
        let bad = V2Spec {
            prefill_chunk: rows,
            ..layout.clone()
        };
        assert_eq!(
            key_of(&Manifest::new(small(), None, "gemma").into_v2(bad)),
            "prefillChunk",
            "{rows} rows"
        );
    }
    let mut stray = Manifest::new(small(), None, "gemma").into_v2(V2Spec {
        prefill_chunk: 0,
        ..layout
    });
    stray.functions.prefill = Some("module.gemma_prefill_at".into());
    assert_eq!(key_of(&stray), "functions.prefill");
}

/// `cacheType`: absent means f32 (and is not written), `"f16"` round-trips, a contract v1
/// manifest with compiled modules is refused by key (its caches are f32 graph inputs), and a
/// source manifest (no modules) may carry it for a reference that rounds as an export does.
#[test]
fn cache_type_round_trips_and_is_v2s() {
    use kv_core::manifest::{CacheType, Rounding};
    let plain = Manifest::new(small(), None, "gemma").into_v2(V2Spec::default());
    assert!(!plain.to_json().contains("cacheType"));
    assert_eq!(
        Manifest::from_json(&plain.to_json()).unwrap().cache_type,
        CacheType::F32
    );
    let mut f16 = plain.clone();
    f16.cache_type = CacheType::F16;
    assert!(f16.to_json().contains("\"cacheType\": \"f16\""), "{}", f16.to_json());
    assert_eq!(Manifest::from_json(&f16.to_json()).unwrap(), f16);

    let mut v1 = Manifest::new(small(), None, "gemma");
    v1.cache_type = CacheType::F16;
    v1.validate().unwrap();
    v1.modules
        .entry("llvm-cpu".into())
        .or_default()
        .insert("withPast".into(), "gemma.llvm-cpu.vmfb".into());
    match v1.validate() {
        Err(Error::Manifest { key, .. }) => assert_eq!(key, "cacheType"),
        other => panic!("{other:?}"),
    }

    let mut source = Manifest::new(small(), None, "gemma");
    Rounding::of(&f16).apply(&mut source);
    assert_eq!(source.cache_type, CacheType::F16);
    Rounding::FP32.apply(&mut source);
    assert_eq!(Rounding::of(&source), Rounding::FP32);
}

/// f16 cache elements: `round` is what an f16 cache holds (the graphs' `reduce_precision`; its
/// edge cases against the compiled graph are `export/tests/cache_rounding.rs`), `encode` and
/// `decode` carry exactly those values in two bytes each, and f32 is the identity.
#[test]
fn cache_elements_encode_what_round_says() {
    use kv_core::manifest::CacheType;
    let values = [
        0.0f32,
        -1.5,
        1.0 + 2f32.powi(-11),
        3.0e-5,
        65504.0,
        70000.0,
        0.1,
        -123.456,
    ];
    let f16 = CacheType::F16;
    let bytes = f16.encode(&values);
    assert_eq!(bytes.len(), 2 * values.len());
    let back = f16.decode(&bytes);
    for (&x, &y) in values.iter().zip(&back) {
        assert_eq!(y.to_bits(), f16.round(x).to_bits(), "{x}");
    }
    assert_eq!(f16.round(1.0 + 2f32.powi(-11)), 1.0, "a tie rounds to even");
    assert_eq!(f16.round(3.0e-5), 0.0, "below the smallest normal: flushed");
    assert_eq!(f16.round(70000.0), f32::INFINITY);
    assert!((f16.round(0.1) - 0.1).abs() < 1e-4 && f16.round(0.1) != 0.1);
    let f32s = CacheType::F32.decode(&CacheType::F32.encode(&values));
    assert_eq!(f32s, values);
}

/// Every size a manifest gives is bounded before anything is allocated from it
/// (`kv_core::limits`): the error names the key, the value and the limit. `chunk` beyond
/// `maxPositions` was accepted, and a session then asked for a 40 GB mask.
#[test]
fn sizes_beyond_the_limits_are_refused_naming_the_key() {
    let plain = Manifest::new(small(), None, "gemma");
    Manifest::from_json(&plain.to_json()).unwrap();
    let refused = |edit: &dyn Fn(&mut serde_json::Value), key: &str, value: u128| {
        let mut json: serde_json::Value = serde_json::from_str(&plain.to_json()).unwrap();
        edit(&mut json);
        match Manifest::from_json(&json.to_string()) {
            Err(e @ Error::TooLarge { .. }) => {
                let Error::TooLarge { what, value: v, .. } = &e else {
                    unreachable!()
                };
                assert!(what.contains(key), "{key}: {e}");
                assert_eq!(*v, value, "{e}");
                assert!(e.to_string().contains("exceeds the limit"), "{e}");
            }
            // On a 32-bit target (armv7 under qemu, scripts/test-arm.sh) a value past usize::MAX
            // does not parse into the field: refused by the reader, naming the key.
            Err(Error::Manifest { key: k, .. }) if value > usize::MAX as u128 && k == key => {}
            other => panic!("expected TooLarge on {key}, got {other:?}"),
        }
    };
    let spec_key = |key: &'static str, value: u64| {
        move |j: &mut serde_json::Value| {
            let spec = if j.get("spec").is_some() { &mut j["spec"] } else { j };
            spec[key] = value.into();
        }
    };
    refused(&spec_key("chunk", 100_000), "chunk", 100_000);
    refused(&spec_key("maxPositions", 4_000_000_000), "maxPositions", 4_000_000_000);
    refused(&spec_key("vocabSize", 2_000_000_000), "vocabSize", 2_000_000_000);
    refused(&spec_key("nLayers", 1 << 40), "nLayers", 1 << 40);
    refused(&spec_key("headDim", 1 << 20), "headDim", 1 << 20);
    refused(&spec_key("nKvHeads", 1 << 20), "nKvHeads", 1 << 20);
    refused(&spec_key("slidingWindow", 1 << 40), "slidingWindow", 1 << 40);
    // Each within its own limit, together a cache beyond MAX_BUFFER_BYTES.
    let big = |j: &mut serde_json::Value| {
        spec_key("maxPositions", 1 << 20)(j);
        spec_key("headDim", 4096)(j);
        spec_key("nKvHeads", 4)(j);
        spec_key("nHeads", 4)(j);
    };
    let mut json: serde_json::Value = serde_json::from_str(&plain.to_json()).unwrap();
    big(&mut json);
    match Manifest::from_json(&json.to_string()) {
        Err(Error::TooLarge { what, bound, .. }) => {
            assert!(
                what.contains("a layer's cache") && bound.contains("MAX_BUFFER_BYTES"),
                "{what}"
            )
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

/// The manifest stores contract v2's layout among the geometry's keys, as before [`V2Spec`]
/// existed: a stored v2 manifest reads into `Contract::V2` and is written back byte for byte
/// (the key order included), and a v1 manifest writes none of the v2 keys.
#[test]
fn the_stored_contract_keeps_its_bytes() {
    let stored = r#"{
  "contractVersion": 2,
  "nLayers": 4,
  "headDim": 256,
  "nHeads": 4,
  "nKvHeads": 1,
  "hiddenSize": 640,
  "vocabSize": 262144,
  "slidingWindow": 8,
  "globalLayerPeriod": 2,
  "chunk": 32,
  "seq": 64,
  "maxPositions": 2048,
  "slidingRopeBase": 10000.0,
  "globalRopeBase": 1000000.0,
  "maskHeads": 0,
  "slidingCacheRows": 64,
  "prefillChunk": 64,
  "prefillSpan": 128,
  "prefillSpans": [
    64
  ],
  "functions": {
    "prefill": "module.gemma_prefill_at"
  },
  "parameterScope": "model"
}"#;
    let m = Manifest::from_json(stored).unwrap();
    assert_eq!(
        m.contract,
        kv_core::Contract::V2(V2Spec {
            sliding_cache_rows: 64,
            prefill_chunk: 64,
            prefill_span: 128,
            prefill_spans: vec![64],
            small_chunk: 0,
            small_chunk_span: 0,
        })
    );
    assert_eq!(m.to_json(), stored);
    let v1 = Manifest::new(small(), None, "gemma");
    assert_eq!(v1.contract, kv_core::Contract::V1);
    let text = v1.to_json();
    assert!(
        text.starts_with("{\n  \"contractVersion\": 1,\n  \"nLayers\": 4,"),
        "{text}"
    );
    for key in ["slidingCacheRows", "prefillChunk", "prefillSpan", "smallChunk"] {
        assert!(!text.contains(key), "{key} in a v1 manifest");
    }
}

/// `smallChunk` (the small chunk graph's rows) is stored after the other v2 keys and read back;
/// a manifest without it has none (0); it must be fewer than `chunk`, name a chunk graph, and
/// is contract v2's only.
#[test]
fn small_chunk_is_stored_and_checked_by_key() {
    let key_of = |e: Error| match e {
        Error::Manifest { key, .. } => key,
        other => panic!("{other:?}"),
    };
    let mut m = Manifest::new(small(), None, "gemma").into_v2(V2Spec {
        small_chunk: 3,
        ..V2Spec::default()
    });
    m.validate().unwrap();
    let text = m.to_json();
    assert!(text.contains("\"smallChunk\": 3"), "{text}");
    let back = Manifest::from_json(&text).unwrap();
    assert_eq!(back.v2().unwrap().small_chunk, 3);
    assert_eq!(
        back.functions.small_chunk(3).as_deref(),
        Some("module.gemma_prefill_with_past_rows3")
    );
    let chunk = m.spec.chunk;
    m.contract.v2_mut().unwrap().small_chunk = chunk;
    assert_eq!(key_of(m.validate().unwrap_err()), "smallChunk");
    m.contract.v2_mut().unwrap().small_chunk = 3;
    m.functions.prefill_with_past = None;
    assert_eq!(key_of(m.validate().unwrap_err()), "smallChunk");
    let v1 = text.replace("\"contractVersion\": 2", "\"contractVersion\": 1");
    assert_eq!(key_of(Manifest::from_json(&v1).unwrap_err()), "smallChunk");
}
