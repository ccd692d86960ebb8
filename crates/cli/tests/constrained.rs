//! The demo's tool-calling path offline: a fixture model (random weights, the reference
//! backend) with `constrain::fixture`'s vocabulary and a small catalog. Under the grammar every
//! answer is a call that parses and validates, whatever the weights prefer.

use std::process::Command;

const CATALOG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tools/fixture-tools.json");

#[test]
fn the_fixture_demo_answers_every_request_with_a_valid_call() {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args([
            "demo",
            "--model",
            "tiny-gemma3:7",
            "--tools",
            CATALOG,
            "--tool-choice",
            "required",
            "--json",
        ])
        .output()
        .expect("run skainet-kv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let utterances = v["utterances"].as_array().unwrap();
    assert_eq!(utterances.len(), 3, "{v}");
    for u in utterances {
        let calls = u["tool_calls"].as_array().unwrap_or_else(|| panic!("{u}"));
        assert!(!calls.is_empty(), "no call: {u}");
        assert!(u.get("invalid_tool_calls").is_none(), "{u}");
        assert!(u["forced_tokens"].as_u64().unwrap() > 0, "{u}");
        assert!(u["call_ms"].is_number(), "{u}");
    }
}
