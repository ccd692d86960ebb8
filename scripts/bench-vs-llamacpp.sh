#!/usr/bin/env bash
# skainet-kv against llama.cpp on this machine, same model, same tokens (not part of CI).
#
# Installs llama-cpp-python 0.3.36 under .tools/llama-cpp/ (built from source with pip, ~15 min
# once on 2 cores; skipped when installed), writes a BF16 GGUF from the Q4_K_M GGUF file Gemma 3
# 270M is imported from (the model store's copy), then runs, twice each:
#   - llama.cpp on the BF16 and on the Q4_K_M file (all cores, greedy),
#   - `skainet-kv bench --model gemma3-270m --backend iree-cpu` on its defaults, once per graph
#     contract named in CONTRACTS (default "1 2": docs/contract-v2.md) and weight format named in
#     WEIGHTS (default "bf16 q8 q4": `--weights`, block-quantized matrices dequantized inside the
#     matmuls),
# on the same 843-token prefix, 8-token prompt and 7–12-token utterances, whose ids come from
# `skainet-kv bench --print-ids` (llama.cpp is fed ids, so both runtimes see identical tokens).
# Prints one table (prefix prefill, decode, first token of the 8-token prompt, first token of an
# utterance after the prefix is restored: the bench's restore + chunk call against llama.cpp's
# `load_state` + eval, median over the utterances; peak RSS; the ratios skainet-kv /
# llama.cpp BF16 from the better of the two runs of each), the CPU and the load average, and
# whether llama.cpp BF16 and skainet-kv decode the same 16 greedy ids after a text prompt.
#
# The machine should be otherwise idle: before each timed process the script waits (up to
# QUIET_WAIT seconds, default 600) for the 1-minute load average to drop below QUIET_LOAD
# (default 1.0), and prints the loads it ran under either way.
#
# Usage: [CONTRACTS="1 2"] [WEIGHTS="bf16 q8 q4"] [RUNS=2] [SKV_BIN=path/to/skainet-kv (no release
#        build)] scripts/bench-vs-llamacpp.sh [--install-only]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

LLAMA_VERSION=0.3.36
# Without AMX: on this machine's Xeon (AMX tiles reported by the CPU) the native build's AMX
# matmul (ggml_backend_amx_mul_mat) segfaults in the first llama_decode of a quantized GGUF
# (Q4_K_M, Q4_1); explicit -mno-amx-* win over GGML_NATIVE's -march=native, the AVX-512
# (VNNI, BF16) kernels and the repacked layouts are kept.
LLAMA_CMAKE_ARGS='-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"'
LLAMA_ROOT="$SKAINET_KV_TOOLS/llama-cpp"
LLAMA_PY="$LLAMA_ROOT/venv/bin/python"
TOOLS_PY="$SKAINET_KV_TOOLS/venv/bin/python"
NEW_TOKENS=16
CONTRACTS="${CONTRACTS:-1 2}"
WEIGHTS="${WEIGHTS:-bf16 q8 q4}"
RUNS="${RUNS:-2}"
CHECK_TEXT="The capital of France is"

log() { echo "bench-vs-llamacpp: $*" >&2; }

install_llama_cpp() {
    if "$LLAMA_PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION')" 2>/dev/null \
        && [ "$(cat "$LLAMA_ROOT/cmake-args" 2>/dev/null)" = "$LLAMA_CMAKE_ARGS" ]; then
        return
    fi
    [ -x "$TOOLS_PY" ] || { echo "error: $TOOLS_PY missing: run scripts/setup.sh first" >&2; exit 1; }
    log "building llama-cpp-python $LLAMA_VERSION from source into $LLAMA_ROOT (~15 min on 2 cores, once)"
    "$TOOLS_PY" -m venv "$LLAMA_ROOT/venv"
    # Built for this CPU (llama.cpp's default GGML_NATIVE), as a user's own build would be.
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$LLAMA_ROOT/venv/bin/pip" install --no-cache-dir \
        --force-reinstall --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" >"$LLAMA_ROOT/install.log" 2>&1 || {
        echo "error: building llama-cpp-python failed; see $LLAMA_ROOT/install.log" >&2
        exit 1
    }
    echo "$LLAMA_CMAKE_ARGS" >"$LLAMA_ROOT/cmake-args"
    "$LLAMA_PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" >&2
}

mkdir -p "$LLAMA_ROOT"
install_llama_cpp
[ "${1:-}" = "--install-only" ] && exit 0

if [ -n "${SKV_BIN:-}" ]; then
    SKV="$(realpath "$SKV_BIN")"
else
    log "building skainet-kv (release)"
    cargo build --release -q -p skainet-kv
    SKV="$PWD/target/release/skainet-kv"
fi

# Also installs and imports the model on first use, so the Q4_K_M file is in the store after it.
IDS="$("$SKV" bench --model gemma3-270m --print-ids)"
PREFIX_IDS="$(sed -n 1p <<<"$IDS")"
PROMPT_IDS="$(sed -n 2p <<<"$IDS")"
UTTERANCE_IDS="$(sed -n '3,$p' <<<"$IDS" | paste -sd';')"
Q4="$SKAINET_KV_CACHE/models/gemma-3-270m-q4_k_m.gguf"
[ -f "$Q4" ] || { echo "error: $Q4 missing after installing gemma3-270m" >&2; exit 1; }
BF16="$SKAINET_KV_CACHE/models/gemma-3-270m-bf16.gguf"
if [ ! -f "$BF16" ]; then
    log "writing $BF16 from $Q4"
    "$TOOLS_PY" scripts/llamacpp/gguf_to_bf16.py "$Q4" "$BF16"
fi

CHECK_IDS="$("$SKV" tokenize --model gemma3-270m --text "$CHECK_TEXT")"

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
# Also the exports, before timing anything, so no compile runs beside a measured run.
for contract in $CONTRACTS; do
    for w in $WEIGHTS; do
        log "skainet-kv contract $contract, $w weights: greedy ids after \"$CHECK_TEXT\" (imports and exports for this CPU once)"
        "$SKV" generate --model gemma3-270m --backend iree-cpu --contract "$contract" --weights "$w" --ids "$CHECK_IDS" \
            --max-new "$NEW_TOKENS" --json >"$OUT/skainet-ids-$w-$contract.json"
    done
done

# Each timed process starts only once the machine is quiet (or after QUIET_WAIT seconds); the
# 1-minute load average at each start is reported with the table.
wait_quiet() {
    local waited=0
    while awk -v max="${QUIET_LOAD:-1.0}" '{ exit !($1 >= max) }' /proc/loadavg && [ "$waited" -lt "${QUIET_WAIT:-600}" ]; do
        [ "$waited" -eq 0 ] && log "waiting for the load average ($(cut -d' ' -f1 /proc/loadavg)) to drop below ${QUIET_LOAD:-1.0}"
        sleep 10
        waited=$((waited + 10))
    done
    cut -d' ' -f1 /proc/loadavg >>"$OUT/loads"
}

for run in $(seq "$RUNS"); do
    for quant in bf16 q4_k_m; do
        model="$BF16"
        [ "$quant" = q4_k_m ] && model="$Q4"
        wait_quiet
        log "run $run: llama.cpp $quant"
        "$LLAMA_PY" scripts/llamacpp/run_llama.py "$model" "$PREFIX_IDS" "$PROMPT_IDS" "$CHECK_IDS" "$NEW_TOKENS" 3 "$UTTERANCE_IDS" >"$OUT/llama-$quant-$run.json"
    done
    for contract in $CONTRACTS; do
        for w in $WEIGHTS; do
            wait_quiet
            log "run $run: skainet-kv bench, contract $contract, $w weights"
            "$SKV" bench --model gemma3-270m --backend iree-cpu --contract "$contract" --weights "$w" --json \
                >"$OUT/skainet-$w-$contract-$run.json"
        done
    done
done
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

"$TOOLS_PY" - "$OUT" "$RUNS" "$LOAD_AFTER" "$CHECK_TEXT" "$CONTRACTS" "$WEIGHTS" <<'EOF'
import json, os, sys

out, runs, load_after, check_text = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
contracts = sys.argv[5].split()
weights = sys.argv[6].split()
rows = [(c, w) for c in contracts for w in weights]
read = lambda name: json.load(open(os.path.join(out, name)))
engines = [
    ("llama.cpp BF16", [read(f"llama-bf16-{r}.json") for r in range(1, runs + 1)]),
    ("llama.cpp Q4_K_M", [read(f"llama-q4_k_m-{r}.json") for r in range(1, runs + 1)]),
] + [
    (f"skainet-kv iree-cpu ({w}), contract {c}", [read(f"skainet-{w}-{c}-{r}.json") for r in range(1, runs + 1)])
    for c, w in rows
]
columns = [
    ("prefix prefill, {} tokens (ms)", "prefix_prefill_ms", "prefix_tokens"),
    ("decode (ms/token)", "decode_ms_per_token", None),
    ("first token, {}-token prompt (ms)", "prompt_first_token_ms", "prompt_tokens"),
    ("first token after restore, 7–12-token utterance (ms)", "restored_first_token_ms", None),
    ("peak RSS (MB)", "peak_rss_mb", None),
]
first = engines[0][1][0]
heads = [title.format(first[n]) if n else title for title, _, n in columns]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
loads = open(os.path.join(out, "loads")).read().split()
print(f"CPU: {cpu}, {os.cpu_count()} cores; 1-min load average at the start of each timed process:"
      f" {', '.join(loads)}; after the last (1/5/15 min): {load_after}")
print(f"llama-cpp-python {first['llama_cpp_python']}, {first['threads']} threads; each cell: the {runs} runs, ' / '-separated (medians within a run)")
print()
print("| | " + " | ".join(heads) + " |")
print("|---" * (len(heads) + 1) + "|")
fmt = lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
for name, rs in engines:
    print(f"| {name} | " + " | ".join(" / ".join(fmt(r[key]) for r in rs) for _, key, _ in columns) + " |")
best = lambda rs, key: min(r[key] for r in rs)
bf16, q4km = engines[0][1], engines[1][1]
for (c, w), (_, skv) in zip(rows, engines[2:]):
    # bf16 against llama.cpp's BF16, the quantized formats against its Q4_K_M.
    base, base_name = (bf16, "BF16") if w == "bf16" else (q4km, "Q4_K_M")
    print(f"| {w}, contract {c} / llama.cpp {base_name} (best of each) | "
          + " | ".join(f"{best(skv, key) / best(base, key):.2f}×" for _, key, _ in columns) + " |")
theirs = bf16[0]["check_ids"]
print()
for c, w in rows:
    ours = read(f"skainet-ids-{w}-{c}.json")["ids"]
    if w != "bf16":
        print(f"{w}, contract {c}: greedy ids after {check_text!r}: {ours} (other weights than llama.cpp BF16's)")
        continue
    differ = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if differ is None and len(ours) == len(theirs):
        print(f"contract {c}: greedy ids after {check_text!r}: the same {len(ours)} on skainet-kv and llama.cpp BF16")
    else:
        print(f"contract {c}: greedy ids after {check_text!r} differ from step {differ}: skainet-kv {ours}, llama.cpp BF16 {theirs}"
              " (llama.cpp rounds activations to bf16 for BF16 weights: at a near-tie the two may part; `skainet-kv diverge` tells)")
EOF
