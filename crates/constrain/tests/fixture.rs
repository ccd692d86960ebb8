//! Constrained tool calls on the tiny fixture (random weights, the reference backend, the
//! fixture vocabulary of `constrain::fixture`): whatever the weights prefer, every answer is a
//! call that parses and validates, forced ids ride along in chunk calls, and the tool choice
//! holds. Also the grammars on their own: what each format forces and refuses.

use backend_reference::{ReferenceKv, ReferenceModel};
use constrain::{CallStyle, Constrainer};
use kv_core::decoder::TokenConstraint;
use kv_core::sampling::SamplingConfig;
use kv_core::{DecodeOptions, Error, KvDecoder, WindowRule};
use tokenizer::tools::{parse_catalog, validate, Tool, ToolChoice};
use tokenizer::{Message, Tokenizer, ToolFormat};

const MODEL: &str = "tiny-gemma3:7";

const CATALOG: &str = r#"[
 {"type": "function", "function": {"name": "set_lights", "description": "Lights.",
  "parameters": {"type": "object", "properties": {
    "room": {"type": "string", "enum": ["living room", "kitchen"]},
    "on": {"type": "boolean"},
    "brightness": {"type": "integer", "minimum": 0, "maximum": 100}},
   "required": ["room", "on"]}}},
 {"type": "function", "function": {"name": "set_timer", "description": "Timer.",
  "parameters": {"type": "object", "properties": {
    "minutes": {"type": "integer", "minimum": 1, "maximum": 1440},
    "label": {"type": "string", "maxLength": 24}},
   "required": ["minutes"]}}}
]"#;

fn setup() -> (Tokenizer, Vec<Tool>, KvDecoder<ReferenceKv>) {
    let dir = fixtures::materialize(MODEL).unwrap();
    let model = ReferenceModel::open(&dir).unwrap();
    let tok = constrain::fixture::tokenizer(model.spec().vocab_size).unwrap();
    let tools = parse_catalog(CATALOG).unwrap();
    (tok, tools, KvDecoder::new(ReferenceKv::new(model, WindowRule::Exact)))
}

/// The request's answer: ids, then the parsed calls (each must parse and validate).
fn answer(
    tok: &Tokenizer,
    tools: &[Tool],
    kv: &mut KvDecoder<ReferenceKv>,
    constrainer: &Constrainer,
    choice: &ToolChoice,
    request: &str,
    options: &DecodeOptions,
) -> (kv_core::Generation, Vec<tokenizer::ToolCall>, String) {
    let messages = [Message::system("You are a phone assistant."), Message::user(request)];
    let split = tok.split_chat(&messages, tools).unwrap();
    let prefix = kv.prefill_prefix(&split.prefix).unwrap();
    let mut constraint = constrainer.constraint(tools, choice).unwrap().unwrap();
    let g = kv
        .generate_constrained(&prefix, &split.request, options, &mut constraint, |_| true)
        .unwrap();
    let text = tok.decode_with(&g.ids, true);
    let parsed = ToolFormat::FunctionGemma.parse(&text);
    let calls: Vec<_> = parsed
        .calls
        .into_iter()
        .map(|c| c.unwrap_or_else(|e| panic!("{request}: {e}: {text:?}")))
        .collect();
    for c in &calls {
        validate(c, tools).unwrap_or_else(|e| panic!("{request}: {e}: {text:?}"));
    }
    (g, calls, text)
}

#[test]
fn random_weights_still_write_calls_that_parse_and_validate() {
    let (tok, tools, mut kv) = setup();
    let constrainer = Constrainer::new(&tok).unwrap();
    assert_eq!(constrainer.style(), CallStyle::FunctionGemma { special_markers: true });
    let stops = tok.stop_tokens();
    let greedy = DecodeOptions::greedy(160, stops.clone());
    for request in ["Turn off the kitchen lights", "Set a timer for ten minutes", "hello"] {
        let (g, calls, text) = answer(
            &tok,
            &tools,
            &mut kv,
            &constrainer,
            &ToolChoice::Required,
            request,
            &greedy,
        );
        println!("{request}: {text:?} {:?}", g.timing);
        assert!(!calls.is_empty(), "{request}: no call in {text:?}");
        // `<start_function_call>call:` at least is forced before the first pick.
        assert!(g.timing.forced_tokens >= 2, "{:?}", g.timing);
        assert!(g.timing.steps_saved > 0);
        // Same path, same ids.
        let (again, _, _) = answer(
            &tok,
            &tools,
            &mut kv,
            &constrainer,
            &ToolChoice::Required,
            request,
            &greedy,
        );
        assert_eq!(again.ids, g.ids);
    }
    // A named tool: only its calls.
    let choice = ToolChoice::Function("set_timer".into());
    let (_, calls, _) = answer(&tok, &tools, &mut kv, &constrainer, &choice, "Lights on", &greedy);
    assert!(calls.iter().all(|c| c.name == "set_timer"), "{calls:?}");
    assert!(!calls.is_empty());
    // Sampled, several seeds: still valid.
    for seed in [1u64, 2, 3] {
        println!("sampling seed {seed}");
        let options = DecodeOptions {
            sampling: Some(SamplingConfig {
                temperature: 1.0,
                seed,
                ..SamplingConfig::default()
            }),
            ..greedy.clone()
        };
        let (_, calls, text) = answer(
            &tok,
            &tools,
            &mut kv,
            &constrainer,
            &ToolChoice::Required,
            "Dim the lights",
            &options,
        );
        assert!(!calls.is_empty(), "seed {seed}: {text:?}");
    }
}

#[test]
fn grammars_force_the_markers_and_refuse_what_breaks_a_schema() {
    let (tok, tools, _) = setup();
    let constrainer = Constrainer::new(&tok).unwrap();
    let mut c = constrainer.constraint(&tools, &ToolChoice::Required).unwrap().unwrap();
    let forced = c.forced().unwrap();
    assert_eq!(tok.decode_with(&forced, true), "<start_function_call>call:set_");
    for &id in &forced {
        c.commit(id).unwrap();
    }
    let ids = tok.encode("lights{on:true,room:<escape>kitchen<escape>}<end_function_call>", false);
    for &id in &ids {
        assert!(c.allowed().unwrap().allows(id), "{:?}", tok.token_text(id));
        c.commit(id).unwrap();
    }
    assert!(c.is_accepting());
    // After the call: a stop token only, FunctionGemma's response marker included (what it
    // writes after a call); no second call, so max_new never cuts one.
    // llguidance ends the grammar right there (nothing but a stop could follow).
    let allowed = c.allowed().unwrap();
    let mut stops = tok.stop_tokens();
    stops.extend(tok.token_id("<start_function_response>"));
    assert!(
        c.is_done() && allowed.is_empty() || allowed.ids().all(|id| stops.contains(&id)),
        "{:?}",
        allowed.ids().collect::<Vec<_>>()
    );

    // A brightness above the maximum, a room outside the enum, a missing required key: refused.
    for bad in [
        "lights{brightness:101",
        "lights{brightness:5,on:true,room:<escape>garage",
        "lights{on:true}",
        "timer{label:<escape>x<escape>}",
    ] {
        let mut c = constrainer.constraint(&tools, &ToolChoice::Required).unwrap().unwrap();
        for id in c.forced().unwrap() {
            c.commit(id).unwrap();
        }
        let mut refused = None;
        for id in tok.encode(bad, false) {
            if !c.allowed().unwrap().allows(id) {
                refused = Some(c.commit(id).unwrap_err());
                break;
            }
            c.commit(id).unwrap();
        }
        let e = refused.unwrap_or_else(|| panic!("{bad} was accepted"));
        assert!(matches!(e, Error::Constraint { op: "commit", .. }), "{e}");
    }
    // `none`: no grammar; an unknown name: an error naming it.
    assert!(constrainer.constraint(&tools, &ToolChoice::None).unwrap().is_none());
    let e = constrainer
        .constraint(&tools, &ToolChoice::Function("fly".into()))
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Constraint { op: "grammar", reason } if reason.contains("`fly`")),
        "{e}"
    );
}

#[test]
fn hermes_grammars_hold_json_calls() {
    let (tok, tools, _) = setup();
    for style in [CallStyle::HermesObject, CallStyle::HermesList] {
        let constrainer = Constrainer::with_style(&tok, style).unwrap();
        let mut c = constrainer.constraint(&tools, &ToolChoice::Required).unwrap().unwrap();
        let call = r#"{"name": "set_timer", "arguments": {"minutes": 10}}"#;
        let text = match style {
            CallStyle::HermesList => format!("<tool_call>[{call}]</tool_call>"),
            _ => format!("<tool_call>\n{call}\n</tool_call>"),
        };
        let mut ids = tok.encode(&text, false);
        let forced = c.forced().unwrap();
        assert!(!forced.is_empty(), "{style:?}: nothing forced");
        assert_eq!(ids[..forced.len()], forced[..], "{style:?}");
        for id in ids.drain(..) {
            c.commit(id).unwrap_or_else(|e| panic!("{style:?}: {e}"));
        }
        assert!(c.is_accepting(), "{style:?}");
        let parsed = ToolFormat::Hermes.parse(&text);
        validate(parsed.calls[0].as_ref().unwrap(), &tools).unwrap();
        // A key the tool does not declare is refused.
        let mut c = constrainer.constraint(&tools, &ToolChoice::Required).unwrap().unwrap();
        let extra = text.replace("10}", "10, \"type\": \"integer\"}");
        assert!(
            !tok.encode(&extra, false).into_iter().all(|id| c.commit(id).is_ok()),
            "{extra}"
        );
        // A minute count past the maximum is refused.
        let mut c = constrainer.constraint(&tools, &ToolChoice::Required).unwrap().unwrap();
        let bad = text.replace("10", "1441");
        let ok = tok.encode(&bad, false).into_iter().all(|id| c.commit(id).is_ok());
        assert!(!ok, "{style:?}: {bad} accepted");
    }
}
