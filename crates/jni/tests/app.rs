//! The Rust side of the app-level JNI exports (`skainet_jni::app::open`, the `engine` crate on
//! `IreeKvBackend`), without a JVM: the quickstart's three requests, cancellation from another
//! thread and a catalog file, on the fixture's contract 2 export. On aarch64 (scripts/test-arm.sh,
//! under qemu) the export is `android-arm64`'s, the module a phone runs; on the host, the same
//! export for the generic x86-64 CPU (an aarch64 module cannot run there).

use std::sync::mpsc;
use std::sync::Arc;

use engine::{CatalogSource, Conversation, ConversationConfig, Finish};
use export::{cached_export_with, ExportOptions, Target};

const TOOLS: &str = include_str!("../../../data/tools/fixture-tools.json");
const REQUESTS: [&str; 3] = [
    "Turn on the kitchen lights.",
    "Set a timer for ten minutes.",
    "Dim the bedroom to 30 percent.",
];

fn export_dir() -> std::path::PathBuf {
    let mut options = ExportOptions {
        contract: kv_core::ContractVersion::V2,
        graphs: kv_core::Graph::KV.to_vec(),
        ..ExportOptions::default()
    };
    if cfg!(target_arch = "aarch64") {
        export::presets::apply(&[export::presets::preset("android-arm64").unwrap()], &mut options).unwrap();
    } else {
        options.targets = vec![Target::cpu()];
    }
    cached_export_with("tiny-gemma3:7", &options).unwrap()
}

fn config(catalog_file: Option<std::path::PathBuf>) -> ConversationConfig {
    ConversationConfig {
        system: Some("You control a smart home.".into()),
        tools_json: Some(TOOLS.into()),
        tool_choice: "required".into(),
        catalog_file,
        ..ConversationConfig::default()
    }
}

#[test]
fn the_quickstart_cancel_and_a_catalog_file_through_the_jni_layer() {
    let dir = export_dir();
    let files = tempfile::tempdir().unwrap();
    let catalog = files.path().join("catalog.skvsnap");
    let engine = skainet_jni::app::open(&dir, "local-sync").unwrap();
    let conversation = Arc::new(Conversation::new(&engine, &config(Some(catalog.clone()))).unwrap());
    assert_eq!(conversation.catalog_source(), CatalogSource::Prefilled);
    let mut answers = Vec::new();
    for request in REQUESTS {
        let mut pieces = 0;
        let reply = conversation
            .send(request, |_| {
                pieces += 1;
                true
            })
            .unwrap();
        assert_eq!(reply.tool_calls.len(), 1, "{request}: {reply:?}");
        assert_eq!(reply.finish, Finish::Stop, "{reply:?}");
        assert!(pieces > 1, "streamed {pieces} pieces");
        let strings = skainet_jni::app::reply_strings(&reply);
        assert_eq!(strings[5], "1", "the JNI layout counts one call: {strings:?}");
        answers.push(reply.tool_calls);
    }

    // Cancelled from another thread after the first piece: nothing more, and not kept.
    let (first_tx, first_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let canceller = {
        let conversation = conversation.clone();
        std::thread::spawn(move || {
            first_rx.recv().unwrap();
            conversation.cancel();
            done_tx.send(()).unwrap();
        })
    };
    let mut pieces = 0;
    let reply = conversation
        .send(REQUESTS[0], |_| {
            pieces += 1;
            if pieces == 1 {
                first_tx.send(()).unwrap();
                done_rx.recv().unwrap();
            }
            true
        })
        .unwrap();
    canceller.join().unwrap();
    assert_eq!((reply.finish, pieces), (Finish::Cancelled, 1), "{reply:?}");
    engine.close();
    assert_eq!(conversation.send(REQUESTS[0], |_| true).unwrap_err().kind(), "closed");

    // A new engine (an app's next start) loads the catalog file and answers the same.
    let restarted = skainet_jni::app::open(&dir, "local-sync").unwrap();
    let loaded = Conversation::new(&restarted, &config(Some(catalog))).unwrap();
    assert_eq!(loaded.catalog_source(), CatalogSource::File);
    assert_eq!(loaded.send(REQUESTS[0], |_| true).unwrap().tool_calls, answers[0]);
}
