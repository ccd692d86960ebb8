//! One model, many sessions: sessions on the same files and device share one IREE context (the
//! weights once), keep their own caches, and a changed file is a new context. Its own test binary:
//! the count of open contexts is process-wide.

use backend_iree::{open_module_count, IreeKvBackend, IreeOptions, IreeRedecodeBackend};
use export::{cached_export, Layout, Target};
use kv_core::{KvBackend, RedecodeBackend};

#[test]
fn sessions_on_one_model_share_its_context_and_keep_their_caches() {
    let dir = cached_export("tiny-gemma3:7", &Target::cpu(), Layout::Shared).expect("export (run scripts/setup.sh)");
    let open = || IreeKvBackend::open(&dir, IreeOptions::new("local-task")).unwrap();
    let mut sessions: Vec<IreeKvBackend> = (0..4).map(|_| open()).collect();
    assert_eq!(
        open_module_count(),
        1,
        "four sessions on one model opened more than one context"
    );
    let mut redecode = IreeRedecodeBackend::open(&dir, IreeOptions::new("local-task")).unwrap();
    assert_eq!(
        open_module_count(),
        1,
        "the redecode session did not share the model's context"
    );

    // Each session its own caches: different prompts, interleaved calls, the same tokens as a
    // session that ran alone.
    let prompts: Vec<Vec<i32>> = (0..4)
        .map(|i| (0..9 + i).map(|t| (t * 31 + i * 7 + 3) % 200).collect())
        .collect();
    let mut tokens: Vec<i32> = sessions
        .iter_mut()
        .zip(&prompts)
        .map(|(s, p)| s.prefill(p).unwrap())
        .collect();
    for _ in 0..3 {
        for (s, t) in sessions.iter_mut().zip(tokens.iter_mut()) {
            *t = s.step(*t).unwrap();
        }
    }
    drop(sessions);
    for (p, want) in prompts.iter().zip(&tokens) {
        let mut alone = open();
        let mut t = alone.prefill(p).unwrap();
        for _ in 0..3 {
            t = alone.step(t).unwrap();
        }
        assert_eq!(t, *want);
    }
    let mut ids = vec![5; redecode.seq()];
    ids[0] = 2;
    redecode.run(&ids).unwrap();

    // Once every session of it closed, the context goes.
    drop(redecode);
    assert_eq!(open_module_count(), 0);

    // A file renamed over the archive is another model: a new context, not the old one's weights.
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
    }
    let first = IreeKvBackend::open(copy.path(), IreeOptions::new("local-task")).unwrap();
    let manifest = kv_core::Manifest::load(copy.path()).unwrap();
    let archive = copy.path().join(manifest.weights_file().unwrap());
    let replacement = copy.path().join("replacement.irpa");
    std::fs::copy(&archive, &replacement).unwrap();
    std::fs::rename(&replacement, &archive).unwrap();
    let second = IreeKvBackend::open(copy.path(), IreeOptions::new("local-task")).unwrap();
    assert_eq!(open_module_count(), 2);
    drop((first, second));
}
