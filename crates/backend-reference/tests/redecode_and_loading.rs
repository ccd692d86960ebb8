//! Redecode against the KV path, loading the weights archive, and the small math helpers.

mod common;

use backend_reference::{
    argmax_lowest, full_forward_logits, gelu_tanh, rmsnorm, silu, ReferenceKv, ReferenceModel, ReferenceRedecode,
};
use common::*;
use kv_core::irpa::{IrpaArchive, IrpaWriter};
use kv_core::{Error, KvDecoder, Manifest, RedecodeBackend, RedecodeDecoder, WindowRule};
use ndarray::array;

#[test]
fn redecode_agrees_with_the_kv_token_stream() {
    for name in ALL_FIXTURES {
        let model = model(name);
        let vocab = model.spec().vocab_size;
        let prompt = tokens(10, vocab, 20);

        let mut kv = KvDecoder::new(ReferenceKv::new(model.clone(), WindowRule::Exact));
        let prefix = kv.prefill_prefix(&prompt[..6]).unwrap();
        let from_kv = kv.generate(&prefix, &prompt[6..], None, 30).unwrap().ids;

        let redecode = ReferenceRedecode::with_seq(model.clone(), 48).unwrap();
        let from_redecode = RedecodeDecoder::new(redecode).generate(&prompt, None, 30).unwrap();
        assert_eq!(from_kv, from_redecode, "{name}: KV and redecode streams");
    }
}

#[test]
fn redecode_checks_its_input() {
    let model = model("tiny-llama:7");
    let mut redecode = ReferenceRedecode::new(model.clone());
    assert_eq!(redecode.seq(), model.spec().seq);
    assert_eq!(redecode.name(), "reference-redecode");
    let err = redecode.run(&[1, 2, 3]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadTokenCount {
                op: "redecode",
                n: 3,
                ..
            }
        ),
        "got {err}"
    );
    let mut bad = vec![0; redecode.seq()];
    bad[5] = model.spec().vocab_size as i32;
    let err = redecode.run(&bad).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TokenOutOfRange {
                op: "redecode",
                index: 5,
                ..
            }
        ),
        "got {err}"
    );
    let ids = redecode.run(&vec![7; redecode.seq()]).unwrap();
    assert_eq!(ids.len(), redecode.seq());
    let err = ReferenceRedecode::with_seq(model, 0).unwrap_err();
    assert!(matches!(&err, Error::Manifest { key, .. } if key == "seq"), "{err:?}");
}

/// A redecode graph's SEQ decides each run's allocations (`seq × vocabSize` logits): one beyond
/// the model's context, or beyond `kv_core::limits`, is refused when the session is made, not
/// aborted on (4e9 asked for 256 GB and died of SIGABRT).
#[test]
fn redecode_seq_is_bounded_before_anything_is_allocated() {
    let model = model("tiny-gemma3:7");
    let max = model.spec().max_positions;
    ReferenceRedecode::with_seq(model.clone(), max).unwrap();
    for seq in [max + 1, 4_000_000_000, usize::MAX] {
        let err = ReferenceRedecode::with_seq(model.clone(), seq).unwrap_err();
        assert!(
            matches!(&err, Error::TooLarge { what, value, .. } if what == "redecode seq" && *value == seq as u128),
            "seq {seq}: {err}"
        );
    }
}

fn fixture_parts(name: &str) -> (Manifest, IrpaArchive) {
    let dir = fixture_dir(name);
    let manifest = Manifest::load(&dir).unwrap();
    let archive = IrpaArchive::open(dir.join(fixtures::WEIGHTS_FILE)).unwrap();
    (manifest, archive)
}

/// A copy of `archive` with `edit` deciding each entry: `None` drops it.
fn rewrite(archive: &IrpaArchive, edit: impl Fn(&str, &[u8], &mut IrpaWriter) -> bool) -> IrpaArchive {
    let mut writer = IrpaWriter::new();
    for entry in archive.entries() {
        let bytes = archive.entry_data(entry).unwrap();
        if !edit(entry.name(), bytes, &mut writer) {
            writer.add_data(entry.name(), bytes.to_vec()).unwrap();
        }
    }
    IrpaArchive::from_bytes(writer.to_bytes()).unwrap()
}

#[test]
fn missing_and_missized_parameters_are_named() {
    let (manifest, archive) = fixture_parts("tiny-qwen2:7");
    let missing = "blk.2.attn_k.bias";
    let without = rewrite(&archive, |name, _, _| name == missing);
    let err = ReferenceModel::from_parts(manifest.clone(), &without).unwrap_err();
    match &err {
        Error::Parameter { name, reason } => {
            assert_eq!(name, missing);
            assert!(reason.contains("missing"), "reason: {reason}");
        }
        other => panic!("expected a parameter error, got {other}"),
    }

    let short = rewrite(&archive, |name, _, w| {
        name == kv_core::Param::OutputNorm.to_string() && w.add_data(name, vec![0u8; 100]).is_ok()
    });
    let err = ReferenceModel::from_parts(manifest.clone(), &short).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, Error::Parameter { name, .. } if *name == kv_core::Param::OutputNorm.to_string()),
        "got {text}"
    );
    // hidden 64: 128 bytes as bf16, 256 as f32, 100 found.
    for n in ["128", "256", "100"] {
        assert!(text.contains(n), "message should name {n}: {text}");
    }

    // A manifest whose fusion the archive does not hold (`fusedGateUp` over an archive of the
    // parts apart, as a portable Vulkan manifest beside another export's archive would be):
    // the fused matrix is named missing, not read from the wrong bytes.
    let mut fused = manifest.clone();
    fused.fused_gate_up = true;
    let err = ReferenceModel::from_parts(fused, &archive).unwrap_err();
    assert!(
        matches!(&err, Error::Parameter { name, reason } if name == "blk.0.ffn_gate_up.weight" && reason.contains("missing")),
        "got {err}"
    );

    let mut no_arch = manifest;
    no_arch.architecture = None;
    let err = ReferenceModel::from_parts(no_arch, &archive).unwrap_err();
    assert!(
        matches!(&err, Error::Manifest { key, .. } if key == "architecture"),
        "got {err}"
    );
}

#[test]
fn f32_and_splat_entries_load_like_bf16() {
    let (manifest, archive) = fixture_parts("tiny-gemma3:7");
    let bf16 = ReferenceModel::from_parts(manifest.clone(), &archive).unwrap();
    let widened = rewrite(&archive, |name, bytes, w| {
        let values = kv_core::bf16::bf16_bytes_to_f32(bytes).unwrap();
        w.add_f32(name, &values).is_ok()
    });
    let f32_model = ReferenceModel::from_parts(manifest.clone(), &widened).unwrap();
    let seq = tokens(20, manifest.spec.vocab_size, 21);
    assert_eq!(
        full_forward_logits(&bf16, &seq).unwrap(),
        full_forward_logits(&f32_model, &seq).unwrap(),
        "f32 entries holding the same values give the same forward"
    );

    // bf16 1.0 = 0x3F80, little-endian.
    let splat = rewrite(&archive, |name, bytes, w| {
        name == kv_core::Param::OutputNorm.to_string() && w.add_splat(name, &[0x80, 0x3f], bytes.len() as u64).is_ok()
    });
    let ones = ReferenceModel::from_parts(manifest, &splat).unwrap();
    assert!(ones.output_norm().iter().all(|&v| v == 1.0));
}

#[test]
fn math_helpers() {
    assert_eq!(argmax_lowest(&[1.0, 3.0, 3.0, 2.0]), 1, "lowest index on ties");
    assert_eq!(argmax_lowest(&[-1.0]), 0);
    assert_eq!(silu(0.0), 0.0);
    assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
    assert_eq!(gelu_tanh(0.0), 0.0);
    assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
    assert!((gelu_tanh(-3.0) + 0.003_637_4).abs() < 1e-5);
    let x = array![[3.0f32, 4.0], [0.0, 0.0]];
    let y = rmsnorm(x.view(), array![1.0f32, 2.0].view(), 0.0);
    // rms of (3, 4) is sqrt(12.5)
    let r = 12.5f32.sqrt();
    assert!((y[[0, 0]] - 3.0 / r).abs() < 1e-6 && (y[[0, 1]] - 8.0 / r).abs() < 1e-6);
    assert!(y.row(1).iter().all(|v| v.is_nan()), "0/0 without eps");
}
