#!/usr/bin/env bash
# skainet-kv against llama.cpp doing the same tool-call job on this machine (issue 31; not CI).
#
# The job: the tool catalog's system turn prefilled once and its state saved, then for each of
# the 47 requests of data/tools/requests.json: the state restored, the request's ids fed, greedy
# decoding under a grammar of the same calls (`--tool-choice required`: every answer one call of
# data/tools/phone-assistant.json) until the call closes, the call parsed and validated.
#   - skainet-kv: `tool-eval --backend iree-cpu --tool-choice required --json` (llguidance's
#     grammar from crates/constrain, forced ids fed in chunk calls, the catalog a snapshot);
#   - llama.cpp: scripts/llamacpp/tool_calls.py under llama-cpp-python (the version and build
#     scripts/bench-vs-llamacpp.sh installs into .tools/llama-cpp), a GBNF grammar written from the
#     same catalog, the prefix's state saved and restored with llama_state_get/set_data.
# Both are fed the same ids (`tool-eval --print-ids`). llama.cpp runs two files: the GGUF the
# model store imported (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M: its own quantized
# kernels) and a BF16 GGUF written from it (scripts/llamacpp/gguf_to_bf16.py: the very values
# skainet-kv's bf16 import holds). The sides alternate within the run (odd runs skainet-kv
# first, even runs llama.cpp first), each process started with the 1-minute load average noted:
# the machine is shared, so read the ratios, which come from one run, not the absolute times.
#
# Prints per side and file: request-to-parsed-call median and p90 (ms), parse-and-validate rate,
# and how many calls (and answers, id for id) equal skainet-kv's; then the ratio skainet-kv /
# llama.cpp of the medians. The JSON of every process is kept in OUT (default
# target/bench-tool-calls/MODEL), e.g. for `tool-eval --backend reference --explain-against`.
#
# Usage: [MODELS="smollm2-135m gemma3-270m"] [RUNS=2] [WEIGHTS="bf16"] [LLAMA="native bf16"]
#        [LIMIT=N] [OUT=dir] [SKV_BIN=path/to/skainet-kv] [SKIP_INSTALL=1 (llama-cpp-python as
#        installed)] scripts/bench-tool-calls.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

MODELS="${MODELS:-smollm2-135m gemma3-270m}"
RUNS="${RUNS:-2}"
WEIGHTS="${WEIGHTS:-bf16}"
LLAMA="${LLAMA:-native bf16}"
CATALOG=data/tools/phone-assistant.json
LLAMA_PY="$SKAINET_KV_TOOLS/llama-cpp/venv/bin/python"
TOOLS_PY="$SKAINET_KV_TOOLS/venv/bin/python"
LIMIT_ARG=()
[ -n "${LIMIT:-}" ] && LIMIT_ARG=(--limit "$LIMIT")

log() { echo "bench-tool-calls: $*" >&2; }

# The one install of llama-cpp-python (pinned there; ~15 min of build once).
[ -n "${SKIP_INSTALL:-}" ] || scripts/bench-vs-llamacpp.sh --install-only

if [ -n "${SKV_BIN:-}" ]; then
    SKV="$(realpath "$SKV_BIN")"
else
    log "building skainet-kv (the dev profile is optimized)"
    cargo build -q -p skainet-kv
    SKV="$PWD/target/debug/skainet-kv"
fi

# The GGUF each model is imported from (the model store's copy, there after the first use).
gguf_of() {
    case "$1" in
        smollm2-135m) echo "$SKAINET_KV_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" ;;
        gemma3-270m) echo "$SKAINET_KV_CACHE/models/gemma-3-270m-q4_k_m.gguf" ;;
        *) echo "error: no GGUF known for $1" >&2; exit 1 ;;
    esac
}

for model in $MODELS; do
    out="${OUT:-target/bench-tool-calls/$model}"
    mkdir -p "$out"
    rm -f "$out"/loads
    # Also installs and imports the model on first use.
    "$SKV" tool-eval --model "$model" --tool-choice required --print-ids "${LIMIT_ARG[@]}" >"$out/ids.json"
    native="$(gguf_of "$model")"
    [ -f "$native" ] || { echo "error: $native missing after installing $model" >&2; exit 1; }
    bf16="${native%.gguf}"
    bf16="${bf16%[.-][Qq]4_[0-9K]*}-bf16.gguf"
    case "$model" in gemma3-270m) bf16="$SKAINET_KV_CACHE/models/gemma-3-270m-bf16.gguf" ;; esac
    if [ ! -f "$bf16" ]; then
        log "writing $bf16 from $native"
        "$TOOLS_PY" scripts/llamacpp/gguf_to_bf16.py "$native" "$bf16"
    fi
    # The exports for this CPU, made on first use, before anything is timed.
    for w in $WEIGHTS; do
        log "$model: skainet-kv iree-cpu $w, one request (exports on first use)"
        "$SKV" tool-eval --model "$model" --backend iree-cpu --weights "$w" --tool-choice required --limit 1 --json >/dev/null
    done

    ours() {
        for w in $WEIGHTS; do
            echo "skainet-kv-$w $(cut -d' ' -f1 /proc/loadavg)" >>"$out/loads"
            log "$model run $1: skainet-kv iree-cpu $w"
            "$SKV" tool-eval --model "$model" --backend iree-cpu --weights "$w" --tool-choice required --json \
                "${LIMIT_ARG[@]}" >"$out/skainet-kv-$w-$1.json"
        done
    }
    theirs() {
        for f in $LLAMA; do
            file="$native"
            [ "$f" = bf16 ] && file="$bf16"
            echo "llama.cpp-$f $(cut -d' ' -f1 /proc/loadavg)" >>"$out/loads"
            log "$model run $1: llama.cpp $(basename "$file")"
            "$LLAMA_PY" scripts/llamacpp/tool_calls.py "$file" "$out/ids.json" "$CATALOG" >"$out/llama.cpp-$f-$1.json"
        done
    }
    for run in $(seq "$RUNS"); do
        if [ $((run % 2)) -eq 1 ]; then ours "$run"; theirs "$run"; else theirs "$run"; ours "$run"; fi
    done

    "$TOOLS_PY" - "$out" "$RUNS" "$WEIGHTS" "$LLAMA" "$model" "$native" "$bf16" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'EOF'
import json, os, statistics, sys

out, runs, weights, llama, model, native, bf16, load_after = sys.argv[1:9]
runs, weights, llama = int(runs), weights.split(), llama.split()
read = lambda name: json.load(open(os.path.join(out, name)))
q = lambda v, p: sorted(v)[round((len(v) - 1) * p)] if v else float("nan")
first = lambda o: o["tool_calls"][0] if o["tool_calls"] else None
sides = [(f"skainet-kv iree-cpu ({w})", f"skainet-kv-{w}") for w in weights] + [
    (f"llama.cpp {os.path.basename(native if f == 'native' else bf16)}", f"llama.cpp-{f}") for f in llama
]
ours_ref = {r: read(f"skainet-kv-{weights[0]}-{r}.json") for r in range(1, runs + 1)}
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
loads = [l.split() for l in open(os.path.join(out, "loads"))]
print(f"{model}: CPU {cpu}, {os.cpu_count()} cores; 1-min load average at each process start: "
      + ", ".join(f"{n} {v}" for n, v in loads) + f"; after the last (1/5/15 min): {load_after}")
print(f"request -> parsed call over {runs} runs (the sides alternate: odd runs skainet-kv first); "
      f"'same' = against skainet-kv ({weights[0]}) in the same run")
print()
print("| side | median ms (per run) | p90 ms | parse + validate | same call | same ids |")
print("|---|---|---|---|---|---|")
medians = {}
for name, stem in sides:
    reports = [read(f"{stem}-{r}.json") for r in range(1, runs + 1)]
    calls = [o["call_ms"] for rep in reports for o in rep["outcomes"] if o["call_ms"] is not None]
    per_run = [q([o["call_ms"] for o in rep["outcomes"] if o["call_ms"] is not None], 0.5) for rep in reports]
    n = sum(len(rep["outcomes"]) for rep in reports)
    valid = sum(o["parsed_and_valid"] for rep in reports for o in rep["outcomes"])
    same_call = same_ids = 0
    for r, rep in zip(range(1, runs + 1), reports):
        mine = {o["request"]: o for o in ours_ref[r]["outcomes"]}
        for o in rep["outcomes"]:
            m = mine[o["request"]]
            same_call += first(o) is not None and first(o) == first(m)
            same_ids += o["ids"] == m["ids"]
    medians[name] = (statistics.median(calls) if calls else float("nan"), per_run)
    print(f"| {name} | {medians[name][0]:.0f} ({' / '.join(f'{m:.0f}' for m in per_run)}) | {q(calls, 0.9):.0f} "
          f"| {valid}/{n} | {same_call}/{n} | {same_ids}/{n} |")
print()
for name, _ in sides[: len(weights)]:
    for other, _ in sides[len(weights):]:
        a, b = medians[name], medians[other]
        print(f"{name} / {other}: {a[0] / b[0]:.2f}x (per run: "
              + ", ".join(f"{x / y:.2f}x" for x, y in zip(a[1], b[1])) + ")")
EOF
done
