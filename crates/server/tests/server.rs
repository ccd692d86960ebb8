//! The server over HTTP on 127.0.0.1 (an ephemeral port), on the FP32 reference over the tiny
//! fixture `tiny-gemma3:7` with the fixture vocabulary (random weights: answers are arbitrary
//! ids, which is enough to compare them exactly; calls parse because they are decoded under the
//! tools' grammar). The client is a few lines over `TcpStream`, so that a test can leave
//! mid-answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use backend_reference::{ReferenceKv, ReferenceModel};
use kv_core::{Manifest, WindowRule};
use serde_json::{json, Value as Json};
use server::{RunningServer, ServerConfig, StartError};

const MODEL: &str = "tiny-gemma3:7";
const TOOLS: &str = include_str!("../../../data/tools/fixture-tools.json");

fn start(sessions: usize, config: ServerConfig) -> RunningServer {
    let dir: PathBuf = fixtures::materialize(MODEL).unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    let tok = engine::load_tokenizer(&dir, &manifest).unwrap();
    let model = ReferenceModel::open(&dir).unwrap();
    let backends = (0..sessions)
        .map(|_| ReferenceKv::new(model.clone(), WindowRule::Exact))
        .collect();
    server::start(backends, tok, MODEL, config).unwrap()
}

fn config() -> ServerConfig {
    ServerConfig {
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        prefix_block: Some(16),
        ..ServerConfig::default()
    }
}

struct Response {
    status: u16,
    head: String,
    body: String,
}

impl Response {
    fn json(&self) -> Json {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(String::from)
            .collect()
    }
}

fn send_raw(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Response {
    let mut s = send_raw(addr, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    Response {
        status,
        head: head.to_string(),
        body,
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
}

fn post(addr: SocketAddr, path: &str, body: &Json) -> Response {
    request(addr, "POST", path, body.to_string().as_bytes())
}

fn metrics(addr: SocketAddr) -> Json {
    request(addr, "GET", "/metrics", b"").json()
}

fn chat(user: &str) -> Json {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You control a smart home. Answer briefly."},
            {"role": "user", "content": user},
        ],
        "max_tokens": 24,
        "return_token_ids": true,
    })
}

fn with_tools(mut body: Json, choice: Json) -> Json {
    body["tools"] = serde_json::from_str(TOOLS).unwrap();
    body["tool_choice"] = choice;
    body["max_tokens"] = json!(96);
    body
}

fn ids(response: &Json) -> Vec<i64> {
    let c = &response["choices"][0];
    c["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {response}"))
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

fn error_code(r: &Response) -> String {
    let body = r.json();
    assert!(
        body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(body["error"]["type"].is_string(), "{body}");
    body["error"]["code"].as_str().unwrap_or_default().to_string()
}

#[test]
fn streamed_chat_is_the_whole_answer_in_pieces() {
    let server = start(1, config());
    let addr = server.addr();
    let whole = post(addr, "/v1/chat/completions", &chat("Turn on the kitchen lights."));
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    assert_eq!(whole["object"], "chat.completion");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let mut body = chat("Turn on the kitchen lights.");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let streamed = post(addr, "/v1/chat/completions", &body);
    assert_eq!(streamed.status, 200);
    assert!(
        streamed.head.to_ascii_lowercase().contains("text/event-stream"),
        "{}",
        streamed.head
    );
    let events = streamed.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let chunks: Vec<Json> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let pieces: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(pieces, content, "the pieces make the non-streamed answer");
    let finish: Vec<&Json> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish.len(), 1, "one finish reason: {chunks:?}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["completion_tokens"], whole["usage"]["completion_tokens"],
        "{usage}"
    );
    server.shutdown().unwrap();
}

#[test]
fn tool_calls_parse_in_whole_and_streamed_answers() {
    let server = start(1, config());
    let addr = server.addr();
    let body = with_tools(chat("Set a timer for ten minutes."), json!("required"));
    let r = post(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()));
    let name = call["function"]["name"].as_str().unwrap();
    assert!(["set_lights", "set_timer"].contains(&name), "{call}");
    let args: Json = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args.is_object(), "{args}");

    // A named function, streamed: the call arrives as a `tool_calls` delta.
    let mut body = with_tools(
        chat("Dim the bedroom."),
        json!({"type": "function", "function": {"name": "set_lights"}}),
    );
    body["stream"] = json!(true);
    let streamed = post(addr, "/v1/chat/completions", &body);
    let events = streamed.events();
    let calls: Vec<Json> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Json>(e).unwrap())
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "set_lights");
    let args: Json = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        args["room"].is_string() && args["on"].is_boolean(),
        "required arguments: {args}"
    );
    server.shutdown().unwrap();
}

#[test]
fn a_prefix_cache_hit_answers_exactly_as_a_cold_run() {
    let warm = start(1, config());
    let cold = start(
        1,
        ServerConfig {
            prefix_cache_bytes: 0,
            ..config()
        },
    );
    let requests = [
        with_tools(chat("Turn on the kitchen lights."), json!("auto")),
        with_tools(chat("Set a timer for ten minutes."), json!("auto")),
        with_tools(chat("Turn on the kitchen lights."), json!("auto")),
        chat("What time is it?"),
        chat("What time is it now?"),
    ];
    let mut hits = 0;
    for (i, body) in requests.iter().enumerate() {
        // Sampled answers too: the same seed draws the same ids from the same logits.
        for sampled in [false, true] {
            let mut body = body.clone();
            if sampled {
                body["temperature"] = json!(0.9);
                body["top_p"] = json!(0.95);
                body["seed"] = json!(1234 + i);
            }
            let a = post(warm.addr(), "/v1/chat/completions", &body).json();
            let b = post(cold.addr(), "/v1/chat/completions", &body).json();
            let cached = a["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{b}");
            assert!(!ids(&a).is_empty());
            assert_eq!(
                ids(&a),
                ids(&b),
                "request {i} (sampled: {sampled}, {cached} ids cached)"
            );
            assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
            assert_eq!(a["prompt_token_ids"], b["prompt_token_ids"]);
            if cached > 0 {
                hits += 1;
                let t = &a["timings"];
                assert_eq!(t["cached_tokens"], cached);
                assert_eq!(
                    t["prompt_n"].as_u64().unwrap() + cached,
                    a["usage"]["prompt_tokens"].as_u64().unwrap()
                );
                assert!(t["saved_ms_estimate"].as_f64().unwrap() > 0.0, "{t}");
            }
        }
    }
    // Two misses: the first request, and the first without tools (its system turn renders no
    // declarations, so its first block differs). Every other shares at least the system turn's
    // blocks with one before it (the third repeats the first whole).
    assert_eq!(hits, requests.len() * 2 - 2);
    let m = metrics(warm.addr());
    let cache = &m["prefix_cache"];
    assert_eq!(cache["hits"], hits as u64, "{m}");
    assert_eq!(cache["misses"], 2, "{m}");
    assert!(cache["tokens_reused"].as_u64().unwrap() > 0);
    assert!(cache["entries"].as_u64().unwrap() > 0);
    assert!(cache["time_saved_ms_estimate"].as_f64().unwrap() > 0.0);
    assert_eq!(metrics(cold.addr())["prefix_cache"]["entries"], 0);
}

#[test]
fn a_small_cache_evicts_and_stays_exact() {
    // Room for a few blocks only: entries are evicted while requests keep coming.
    let tiny = ServerConfig {
        prefix_cache_bytes: server::snapshot_bytes(&fixture_spec(), 64),
        ..config()
    };
    let warm = start(1, tiny);
    let cold = start(
        1,
        ServerConfig {
            prefix_cache_bytes: 0,
            ..config()
        },
    );
    for user in [
        "Turn on the lights.",
        "Set a timer.",
        "Turn on the lights.",
        "Open the door.",
    ] {
        let body = with_tools(chat(user), json!("auto"));
        let a = post(warm.addr(), "/v1/chat/completions", &body).json();
        let b = post(cold.addr(), "/v1/chat/completions", &body).json();
        assert_eq!(ids(&a), ids(&b), "{user}");
    }
    let m = metrics(warm.addr());
    assert!(m["prefix_cache"]["evictions"].as_u64().unwrap() > 0, "{m}");
    assert!(
        m["prefix_cache"]["bytes_estimate"].as_u64().unwrap() <= server::snapshot_bytes(&fixture_spec(), 64) as u64,
        "{m}"
    );
}

fn fixture_spec() -> kv_core::KvSpec {
    Manifest::load(&fixtures::materialize(MODEL).unwrap()).unwrap().spec
}

#[test]
fn concurrent_requests_each_get_their_own_answer() {
    let server = start(2, config());
    let addr = server.addr();
    let users: Vec<String> = (0..6).map(|i| format!("Request number {i}, please.")).collect();
    let alone: Vec<Vec<i64>> = users
        .iter()
        .map(|u| ids(&post(addr, "/v1/chat/completions", &chat(u)).json()))
        .collect();
    let together: Vec<Vec<i64>> = std::thread::scope(|s| {
        let handles: Vec<_> = users
            .iter()
            .map(|u| s.spawn(move || post(addr, "/v1/chat/completions", &chat(u))))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let r = h.join().unwrap();
                assert_eq!(r.status, 200, "{}", r.body);
                ids(&r.json())
            })
            .collect()
    });
    assert_eq!(together, alone, "answers do not depend on what ran beside them");
    assert_eq!(metrics(addr)["requests"]["completed"], 12);
}

/// A long answer (end-of-turn ids ignored) streamed; returns once its first piece arrived, so
/// its session is busy.
fn busy_stream(addr: SocketAddr, max_tokens: usize) -> TcpStream {
    let mut body = chat("Tell me a long story.");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(max_tokens);
    body["ignore_eos"] = json!(true);
    let mut s = send_raw(addr, "POST", "/v1/chat/completions", body.to_string().as_bytes());
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // The role chunk, then a content chunk: decoding has started.
    while String::from_utf8_lossy(&seen).matches("data: ").count() < 2 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

fn wait_for(addr: SocketAddr, what: &str, test: impl Fn(&Json) -> bool) -> Json {
    let t = Instant::now();
    loop {
        let m = metrics(addr);
        if test(&m) {
            return m;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{what}: {m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_full_queue_answers_429_and_a_disconnect_cancels() {
    const LONG: usize = 900;
    let server = start(
        1,
        ServerConfig {
            queue_capacity: 1,
            ..config()
        },
    );
    let addr = server.addr();
    let running = busy_stream(addr, LONG);
    // One waits in the queue...
    let queued = std::thread::spawn(move || post(addr, "/v1/chat/completions", &chat("Second.")));
    wait_for(addr, "the second request queued", |m| m["queue"]["depth"] == 1);
    // ...so the next is refused at once.
    let refused = post(addr, "/v1/chat/completions", &chat("Third."));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(error_code(&refused), "queue_full");
    assert!(
        refused.head.to_ascii_lowercase().contains("retry-after"),
        "{}",
        refused.head
    );

    // The streaming client leaves: its session stops decoding and takes the queued request.
    drop(running);
    let m = wait_for(addr, "the stream cancelled", |m| m["requests"]["cancelled"] == 1);
    let decoded = m["requests"]["cancelled_after_tokens"].as_u64().unwrap();
    assert!(
        decoded < LONG as u64,
        "decoded {decoded} of {LONG} ids after the client left"
    );
    assert_eq!(queued.join().unwrap().status, 200);
    assert_eq!(metrics(addr)["requests"]["rejected_queue_full"], 1);

    // A non-streamed request whose client leaves is cancelled too.
    let mut body = chat("Another long one.");
    body["max_tokens"] = json!(LONG);
    body["ignore_eos"] = json!(true);
    let s = send_raw(addr, "POST", "/v1/chat/completions", body.to_string().as_bytes());
    wait_for(addr, "the request running", |m| m["queue"]["active"] == 1);
    drop(s);
    let m = wait_for(addr, "the whole request cancelled", |m| m["requests"]["cancelled"] == 2);
    let decoded = m["requests"]["cancelled_after_tokens"].as_u64().unwrap();
    assert!(decoded < 2 * LONG as u64, "{m}");
    server.shutdown().unwrap();
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_stays_usable() {
    let server = start(
        1,
        ServerConfig {
            max_body_bytes: 4096,
            max_tokens_limit: 64,
            ..config()
        },
    );
    let addr = server.addr();
    let path = "/v1/chat/completions";
    let cases: Vec<(&str, Response, u16, &str)> = vec![
        (
            "oversized",
            post(addr, path, &chat(&"x".repeat(8000))),
            413,
            "request_too_large",
        ),
        (
            "not JSON",
            request(addr, "POST", path, b"{\"messages\": ["),
            400,
            "invalid_json",
        ),
        ("empty body", request(addr, "POST", path, b""), 400, "invalid_json"),
        (
            "no messages",
            post(addr, path, &json!({"model": MODEL})),
            400,
            "invalid_request",
        ),
        (
            "messages not a list",
            post(addr, path, &json!({"messages": "hi"})),
            400,
            "invalid_request",
        ),
        (
            "empty messages",
            post(addr, path, &json!({"messages": []})),
            400,
            "invalid_messages",
        ),
        (
            "unknown role",
            post(addr, path, &json!({"messages": [{"role": "wizard", "content": "hi"}]})),
            400,
            "invalid_messages",
        ),
        (
            "n = 2",
            post(addr, path, &{
                let mut b = chat("hi");
                b["n"] = json!(2);
                b
            }),
            400,
            "unsupported_n",
        ),
        (
            "max_tokens over the limit",
            post(addr, path, &{
                let mut b = chat("hi");
                b["max_tokens"] = json!(65);
                b
            }),
            400,
            "invalid_max_tokens",
        ),
        (
            "max_tokens 0",
            post(addr, path, &{
                let mut b = chat("hi");
                b["max_tokens"] = json!(0);
                b
            }),
            400,
            "invalid_max_tokens",
        ),
        (
            "a tool choice not in tools",
            post(
                addr,
                path,
                &with_tools(chat("hi"), json!({"type": "function", "function": {"name": "fly"}})),
            ),
            400,
            "invalid_tool_choice",
        ),
        (
            "tools that do not parse",
            post(addr, path, &{
                let mut b = chat("hi");
                b["tools"] = json!([{"type": "function", "function": {"name": "a b"}}]);
                b
            }),
            400,
            "invalid_tools",
        ),
        (
            "negative temperature",
            post(addr, path, &{
                let mut b = chat("hi");
                b["temperature"] = json!(-1.0);
                b
            }),
            400,
            "invalid_sampling",
        ),
        (
            "five stop strings",
            post(addr, path, &{
                let mut b = chat("hi");
                b["stop"] = json!(["a", "b", "c", "d", "e"]);
                b
            }),
            400,
            "invalid_stop",
        ),
        (
            "a token id outside the vocabulary",
            post(addr, "/v1/completions", &json!({"prompt": [1, 2, 99999]})),
            400,
            "invalid_prompt",
        ),
        (
            "no such endpoint",
            request(addr, "GET", "/v2/nothing", b""),
            404,
            "not_found",
        ),
        (
            "GET on a POST endpoint",
            request(addr, "GET", path, b""),
            405,
            "method_not_allowed",
        ),
    ];
    for (what, response, status, code) in &cases {
        assert_eq!(response.status, *status, "{what}: {}", response.body);
        assert_eq!(error_code(response), *code, "{what}: {}", response.body);
    }
    let m = metrics(addr);
    assert_eq!(m["requests"]["completed"], 0);
    let ok = post(addr, path, &chat("Still there?"));
    assert_eq!(ok.status, 200, "{}", ok.body);
    // An oversized body is left unread, so its connection cannot carry another request: on a
    // keep-alive connection the 413 says `connection: close`, or a client sends its next request
    // into a connection the server then drops (the openai client's "Server disconnected without
    // sending a response" after its 413, seen in CI).
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = chat(&"x".repeat(8000)).to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer and close before the whole body is sent.
    let _ = s.write_all(body.as_bytes());
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !raw.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 413"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    server.shutdown().unwrap();
}

#[test]
fn completions_models_health_and_stop_strings() {
    let server = start(1, config());
    let addr = server.addr();
    let models = request(addr, "GET", "/v1/models", b"").json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(request(addr, "GET", "/health", b"").json()["status"], "ok");

    let body = json!({"prompt": "call set time", "max_tokens": 12, "return_token_ids": true, "ignore_eos": true});
    let whole = post(addr, "/v1/completions", &body).json();
    assert_eq!(whole["object"], "text_completion");
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(ids(&whole).len(), 12);

    // A stop string taken from the answer cuts it there, streamed or not.
    let cut = text.char_indices().nth(text.chars().count() / 2).map_or(0, |(i, _)| i);
    let stop: String = text[cut..].chars().take(2).collect();
    if !stop.is_empty() {
        let expected = &text[..text.find(&stop).unwrap()];
        let mut stopped = body.clone();
        stopped["stop"] = json!(stop);
        let r = post(addr, "/v1/completions", &stopped).json();
        assert_eq!(r["choices"][0]["text"], expected, "stop {stop:?} in {text:?}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        stopped["stream"] = json!(true);
        let events = post(addr, "/v1/completions", &stopped).events();
        let pieces: String = events
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| {
                serde_json::from_str::<Json>(e).unwrap()["choices"][0]["text"]
                    .as_str()
                    .map(String::from)
            })
            .collect();
        assert_eq!(pieces, expected, "streamed, {stop:?} held back and cut");
    }
    server.shutdown().unwrap();
}

#[test]
fn a_non_loopback_address_needs_the_explicit_flag() {
    let dir = fixtures::materialize(MODEL).unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    let tok = engine::load_tokenizer(&dir, &manifest).unwrap();
    let backend = ReferenceKv::new(ReferenceModel::open(&dir).unwrap(), WindowRule::Exact);
    let config = ServerConfig {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        ..config()
    };
    // Refused before anything is bound.
    match server::start(vec![backend], tok, MODEL, config) {
        Err(StartError::NonLoopback(addr)) => assert_eq!(addr.ip().to_string(), "0.0.0.0"),
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("bound a non-loopback address without the flag"),
    }
}
