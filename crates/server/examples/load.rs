//! A bounded load test for `skainet-kv serve` (scripts/bench-serve.sh runs it): `--requests N`
//! chat requests from `--concurrency C` threads, agent traffic shaped (every request the same
//! system prompt and tool catalog, its own user words), then one JSON line of figures:
//! requests/s, latency p50/p99, statuses, and the server's prefix-cache hit rate from
//! `/metrics` before and after.
//!
//!   cargo run --release -p skainet-server --example load -- --url http://127.0.0.1:8080 \
//!       --requests 200 --concurrency 4 --max-tokens 16 [--tools FILE] [--no-tools]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};

struct Args {
    host: String,
    requests: usize,
    concurrency: usize,
    max_tokens: usize,
    tools: Option<Json>,
    system: String,
}

fn args() -> Args {
    let mut a = Args {
        host: "127.0.0.1:8080".into(),
        requests: 100,
        concurrency: 4,
        max_tokens: 16,
        tools: None,
        system: "You are a phone assistant. Call the tool the request asks for; answer briefly otherwise.".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => a.host = value().trim_start_matches("http://").trim_end_matches('/').to_string(),
            "--requests" => a.requests = value().parse().expect("--requests N"),
            "--concurrency" => a.concurrency = value().parse().expect("--concurrency N"),
            "--max-tokens" => a.max_tokens = value().parse().expect("--max-tokens N"),
            "--tools" => {
                let text = std::fs::read_to_string(value()).expect("reading --tools");
                a.tools = Some(serde_json::from_str(&text).expect("--tools: JSON"));
            }
            "--system" => a.system = value(),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// One HTTP/1.1 exchange (Connection: close); the status and the body.
fn exchange(host: &str, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

fn metrics(host: &str) -> Json {
    let (_, body) = exchange(host, "GET", "/metrics", "").expect("GET /metrics");
    serde_json::from_str(&body).expect("/metrics: JSON")
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn main() {
    let a = args();
    const ASKS: [&str; 8] = [
        "Turn on the kitchen lights.",
        "Set a timer for ten minutes.",
        "What is the weather in Paris?",
        "Call my mother.",
        "Dim the bedroom to 30 percent.",
        "Send a message to Sam saying I am late.",
        "Play some jazz.",
        "Remind me to buy milk at six.",
    ];
    let before = metrics(&a.host);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(u16, f64, u64)>> = Mutex::new(Vec::with_capacity(a.requests));
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..a.concurrency {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= a.requests {
                    return;
                }
                let mut body = json!({
                    "messages": [
                        {"role": "system", "content": a.system},
                        {"role": "user", "content": format!("{} (request {i})", ASKS[i % ASKS.len()])},
                    ],
                    "max_tokens": a.max_tokens,
                });
                if let Some(tools) = &a.tools {
                    body["tools"] = tools.clone();
                }
                let t = Instant::now();
                let (status, text) =
                    exchange(&a.host, "POST", "/v1/chat/completions", &body.to_string()).unwrap_or((0, String::new()));
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let cached = serde_json::from_str::<Json>(&text)
                    .ok()
                    .and_then(|r| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64())
                    .unwrap_or(0);
                results.lock().unwrap().push((status, ms, cached));
            });
        }
    });
    let wall = started.elapsed().as_secs_f64();
    let after = metrics(&a.host);
    let results = results.into_inner().unwrap();
    let mut ok: Vec<f64> = results.iter().filter(|r| r.0 == 200).map(|r| r.1).collect();
    ok.sort_by(f64::total_cmp);
    let mut statuses = std::collections::BTreeMap::new();
    for r in &results {
        *statuses.entry(r.0.to_string()).or_insert(0usize) += 1;
    }
    let d = |key: &str| {
        after["prefix_cache"][key].as_u64().unwrap_or(0) - before["prefix_cache"][key].as_u64().unwrap_or(0)
    };
    let lookups = d("lookups");
    let report = json!({
        "requests": a.requests,
        "concurrency": a.concurrency,
        "max_tokens": a.max_tokens,
        "tools": a.tools.as_ref().map_or(0, |t| t.as_array().map_or(0, Vec::len)),
        "wall_s": wall,
        "requests_per_s": ok.len() as f64 / wall,
        "p50_ms": percentile(&ok, 0.50),
        "p99_ms": percentile(&ok, 0.99),
        "max_ms": ok.last().copied().unwrap_or(0.0),
        "statuses": statuses,
        "prefix_cache": {
            "lookups": lookups,
            "hits": d("hits"),
            "hit_rate": if lookups == 0 { 0.0 } else { d("hits") as f64 / lookups as f64 },
            "tokens_reused": d("tokens_reused"),
            "tokens_prefilled": d("tokens_prefilled"),
            "mean_cached_tokens": results.iter().map(|r| r.2).sum::<u64>() as f64 / results.len().max(1) as f64,
            "entries": after["prefix_cache"]["entries"],
            "bytes_estimate": after["prefix_cache"]["bytes_estimate"],
            "time_saved_ms_estimate": after["prefix_cache"]["time_saved_ms_estimate"].as_f64().unwrap_or(0.0)
                - before["prefix_cache"]["time_saved_ms_estimate"].as_f64().unwrap_or(0.0),
        },
    });
    println!("{report}");
}
