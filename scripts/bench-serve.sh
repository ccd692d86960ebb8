#!/usr/bin/env bash
# A bounded load test of `skainet-kv serve` (crates/server/examples/load.rs as the client):
# agent-shaped traffic (one system prompt and tool catalog, each request its own words), run
# against the server with prefix caching and again without, each for two rounds, on one
# machine in one run, so the two can be compared. Prints one JSON line per round (requests/s,
# p50/p99 latency, statuses, prefix-cache hit rate and tokens reused) with the server's RSS
# after startup and after each round (flat: no growth from round to round).
#
#   scripts/bench-serve.sh [MODEL]     MODEL: tiny-gemma3:7 (default, offline) | smollm2-135m | ...
#   env: REQUESTS (100) CONCURRENCY (4) MAX_TOKENS (16) SESSIONS (1) PREFIX_CACHE_MB (512)
#        NO_IREE=1 builds the CLI without IREE (fixtures on the reference only)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
model="${1:-tiny-gemma3:7}"
requests="${REQUESTS:-100}" concurrency="${CONCURRENCY:-4}" max_tokens="${MAX_TOKENS:-16}"
sessions="${SESSIONS:-1}" cache_mb="${PREFIX_CACHE_MB:-512}"
case "$model" in
    tiny-*) tools=data/tools/fixture-tools.json ;;
    *) tools=data/tools/phone-assistant.json ;;
esac
cargo build -q -p skainet-kv ${NO_IREE:+--no-default-features}
cargo build -q -p skainet-server --example load
bin="${CARGO_TARGET_DIR:-target}/debug/skainet-kv"
load="${CARGO_TARGET_DIR:-target}/debug/examples/load"
rss() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }
echo "bench-serve: $model, $requests requests x $concurrency clients, max_tokens $max_tokens, $sessions session(s), $(nproc) CPUs"
for mb in "$cache_mb" 0; do
    log=$(mktemp)
    "$bin" serve --model "$model" --port 0 --sessions "$sessions" --prefix-cache-mb "$mb" \
        --queue $((requests + concurrency)) >"$log" 2>&1 &
    pid=$!
    trap 'kill $pid 2>/dev/null || true' EXIT
    for _ in $(seq 1 1800); do
        grep -q "on http://" "$log" && break
        kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
        sleep 0.5
    done
    url=$(grep -o "http://[0-9.:]*" "$log" | head -1)
    rss0=$(rss $pid)
    for round in 1 2; do
        figures=$("$load" --url "$url" --requests "$requests" --concurrency "$concurrency" --max-tokens "$max_tokens" --tools "$tools")
        echo "bench-serve: prefix_cache_mb=$mb round=$round rss_start_kib=$rss0 rss_after_kib=$(rss $pid) $figures"
    done
    kill $pid
    wait $pid 2>/dev/null || true
    trap - EXIT
    rm -f "$log"
done
