//! The engine on the FP32 reference over the tiny fixture `tiny-gemma3:7` (random weights, the
//! fixture vocabulary): constrained calls parse whatever the weights say. The same API on IREE
//! runs from Kotlin in scripts/test-jni.sh.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use backend_reference::{ReferenceKv, ReferenceModel};
use engine::{CatalogSource, Conversation, ConversationConfig, Engine, Error, Finish, Sampling};
use kv_core::{Manifest, WindowRule};

const TOOLS: &str = include_str!("../../../data/tools/fixture-tools.json");
const REQUESTS: [&str; 3] = [
    "Turn on the kitchen lights.",
    "Set a timer for ten minutes.",
    "Dim the bedroom to 30 percent.",
];

fn open(model: &str) -> Arc<Engine<ReferenceKv>> {
    let dir: PathBuf = fixtures::materialize(model).unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    let tok = engine::load_tokenizer(&dir, &manifest).unwrap();
    let backend = ReferenceKv::new(ReferenceModel::open(&dir).unwrap(), WindowRule::Exact);
    Engine::new(backend, tok, model).unwrap()
}

fn config() -> ConversationConfig {
    ConversationConfig {
        system: Some("You control a smart home.".into()),
        tools_json: Some(TOOLS.into()),
        // Random weights left to choose would write text; a call is what the scenario checks.
        tool_choice: "required".into(),
        max_new_tokens: 96,
        ..ConversationConfig::default()
    }
}

#[test]
fn three_requests_give_three_parsed_calls_and_stream_text() {
    let engine = open("tiny-gemma3:7");
    let conversation = Conversation::new(&engine, &config()).unwrap();
    assert_eq!(conversation.catalog_source(), CatalogSource::Prefilled);
    for request in REQUESTS {
        let mut pieces = Vec::new();
        let reply = conversation
            .send(request, |p| {
                pieces.push(p.to_string());
                true
            })
            .unwrap();
        assert_eq!(reply.tool_calls.len(), 1, "{request}: {reply:?}");
        assert!(reply.invalid_tool_calls.is_empty(), "{reply:?}");
        assert_eq!(reply.finish, Finish::Stop, "{reply:?}");
        assert!(!pieces.is_empty(), "streamed no text");
        let streamed: String = pieces.concat();
        assert!(streamed.contains(&reply.tool_calls[0].name), "{streamed:?} {reply:?}");
    }
}

#[test]
fn conversations_share_the_catalog_and_the_model() {
    let engine = open("tiny-gemma3:7");
    let a = Conversation::new(&engine, &config()).unwrap();
    let b = Conversation::new(&engine, &config()).unwrap();
    assert_eq!(b.catalog_source(), CatalogSource::Memory);
    let other = ConversationConfig {
        system: Some("Another system text.".into()),
        ..config()
    };
    let c = Conversation::new(&engine, &other).unwrap();
    assert_eq!(c.catalog_source(), CatalogSource::Prefilled);
    // Interleaved: each conversation answers from its own turns, as when alone.
    let alone = Conversation::new(&engine, &config()).unwrap();
    let first = alone.send(REQUESTS[0], |_| true).unwrap();
    let second = alone.send(REQUESTS[1], |_| true).unwrap();
    let a1 = a.send(REQUESTS[0], |_| true).unwrap();
    c.send(REQUESTS[2], |_| true).unwrap();
    b.send(REQUESTS[2], |_| true).unwrap();
    let a2 = a.send(REQUESTS[1], |_| true).unwrap();
    assert_eq!(a1.tool_calls, first.tool_calls);
    assert_eq!(a2.tool_calls, second.tool_calls);
}

#[test]
fn cancel_from_another_thread_stops_the_answer_and_keeps_the_conversation() {
    let engine = open("tiny-gemma3:7");
    let conversation = Arc::new(Conversation::new(&engine, &config()).unwrap());
    let (piece_tx, piece_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let canceller = {
        let conversation = conversation.clone();
        std::thread::spawn(move || {
            piece_rx.recv().unwrap();
            conversation.cancel();
            go_tx.send(()).unwrap();
        })
    };
    let seen = AtomicUsize::new(0);
    let reply = conversation
        .send(REQUESTS[0], |_| {
            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                piece_tx.send(()).unwrap();
                go_rx.recv().unwrap();
            }
            true
        })
        .unwrap();
    canceller.join().unwrap();
    assert_eq!(reply.finish, Finish::Cancelled, "{reply:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 1, "no piece after the cancel");
    // Not part of the conversation: the next send answers as a fresh conversation's first.
    let fresh = Conversation::new(&engine, &config())
        .unwrap()
        .send(REQUESTS[1], |_| true)
        .unwrap();
    let next = conversation.send(REQUESTS[1], |_| true).unwrap();
    assert_eq!(next.tool_calls, fresh.tool_calls);
}

#[test]
fn a_catalog_file_is_reused_and_one_of_another_catalog_or_model_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("catalog.skvsnap");
    let with_file = ConversationConfig {
        catalog_file: Some(file.clone()),
        ..config()
    };
    let engine = open("tiny-gemma3:7");
    let first = Conversation::new(&engine, &with_file).unwrap();
    assert_eq!(first.catalog_source(), CatalogSource::Prefilled);
    assert!(file.exists());
    let expected = first.send(REQUESTS[0], |_| true).unwrap();

    let restarted = open("tiny-gemma3:7");
    let loaded = Conversation::new(&restarted, &with_file).unwrap();
    assert_eq!(loaded.catalog_source(), CatalogSource::File);
    assert_eq!(
        loaded.send(REQUESTS[0], |_| true).unwrap().tool_calls,
        expected.tool_calls
    );

    let other_catalog = ConversationConfig {
        system: Some("Another system text.".into()),
        ..with_file.clone()
    };
    let err = Conversation::new(&open("tiny-gemma3:7"), &other_catalog).err().unwrap();
    assert!(matches!(err, Error::Catalog { .. }), "{err:?}");
    let err = Conversation::new(&open("tiny-gemma3:8"), &with_file).err().unwrap();
    assert_eq!(err.kind(), "catalog", "{err:?}");
}

#[test]
fn misuse_is_refused_and_leaves_things_usable() {
    let engine = open("tiny-gemma3:7");
    let bad_choice = ConversationConfig {
        tool_choice: "open_door".into(),
        ..config()
    };
    let err = Conversation::new(&engine, &bad_choice).err().unwrap();
    assert_eq!(err.kind(), "bad_argument", "{err:?}");
    let bad_tools = ConversationConfig {
        tools_json: Some("[{\"name\": 3}]".into()),
        ..config()
    };
    assert_eq!(
        Conversation::new(&engine, &bad_tools).err().unwrap().kind(),
        "bad_argument"
    );
    let hot = ConversationConfig {
        sampling: Sampling {
            top_p: 0.0,
            ..Sampling::default()
        },
        ..config()
    };
    assert_eq!(Conversation::new(&engine, &hot).err().unwrap().kind(), "bad_argument");

    let conversation = Conversation::new(&engine, &config()).unwrap();
    assert_eq!(conversation.send("  ", |_| true).unwrap_err().kind(), "bad_argument");
    let long = "kitchen ".repeat(2000);
    assert_eq!(conversation.send(&long, |_| true).unwrap_err().kind(), "context_full");
    let reply = conversation.send(REQUESTS[0], |_| true).unwrap();
    assert_eq!(reply.tool_calls.len(), 1);

    conversation.close();
    assert!(matches!(
        conversation.send(REQUESTS[0], |_| true),
        Err(Error::Closed(_))
    ));
    let open_one = Conversation::new(&engine, &config()).unwrap();
    engine.close();
    assert!(engine.is_closed());
    assert_eq!(open_one.send(REQUESTS[0], |_| true).unwrap_err().kind(), "closed");
    assert_eq!(Conversation::new(&engine, &config()).err().unwrap().kind(), "closed");
}

#[test]
fn sampling_draws_calls_that_still_parse() {
    let engine = open("tiny-gemma3:7");
    for seed in [1, 2] {
        let sampled = ConversationConfig {
            sampling: Sampling {
                temperature: 0.8,
                top_k: 16,
                seed,
                ..Sampling::default()
            },
            ..config()
        };
        let reply = Conversation::new(&engine, &sampled)
            .unwrap()
            .send(REQUESTS[1], |_| true)
            .unwrap();
        assert_eq!(reply.tool_calls.len(), 1, "{reply:?}");
    }
}

/// A conversation's turns carried to another (what `chat`'s /save and /load do): the second
/// answers the next request exactly as the first does; `[]` starts over like a fresh one; a
/// system message in the turns is refused and the turns stay.
#[test]
fn history_moves_between_conversations_and_bad_history_is_refused() {
    let engine = open("tiny-gemma3:7");
    let first = Conversation::new(&engine, &config()).unwrap();
    first.send(REQUESTS[0], |_| true).unwrap();
    first.send(REQUESTS[1], |_| true).unwrap();
    let history = first.history();
    assert_eq!(history.len(), 4, "{history:?}");
    assert_eq!(first.system(), Some("You control a smart home."));

    let second = Conversation::new(&engine, &config()).unwrap();
    second.set_history(history.clone()).unwrap();
    assert_eq!(second.history(), history);
    let a = first.send(REQUESTS[2], |_| true).unwrap();
    let b = second.send(REQUESTS[2], |_| true).unwrap();
    assert_eq!((a.tool_calls, a.tokens), (b.tool_calls, b.tokens));

    let fresh = Conversation::new(&engine, &config())
        .unwrap()
        .send(REQUESTS[1], |_| true)
        .unwrap();
    second.set_history(Vec::new()).unwrap();
    let again = second.send(REQUESTS[1], |_| true).unwrap();
    assert_eq!((again.tool_calls, again.tokens), (fresh.tool_calls, fresh.tokens));

    let kept = second.history();
    let system = vec![tokenizer::Message::system("another"), tokenizer::Message::user("hi")];
    let err = second.set_history(system).unwrap_err();
    assert_eq!(err.kind(), "bad_argument", "{err}");
    assert_eq!(second.history(), kept, "a refused history leaves the turns");
}
