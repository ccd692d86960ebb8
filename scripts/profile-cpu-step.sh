#!/usr/bin/env bash
# Where a CPU decode step's time goes: runs the bare step (`<prefix>_with_past`, contract 2, at
# pos 200 over caches of 0.01; FUNCTION=prefill (128 rows) or prefillWithPast (a chunk): the
# manifest's key of another graph) of one or more exported artifact folders on `local-task` with
# IREE's host-execution profile (every dispatch's wall time, on the CPU too), ROUNDS times each,
# alternating between the folders, and prints per round the dispatches per step and the
# milliseconds per step by dispatch kind (mmt4d = the data-tiled matmuls, matmul_like = the
# attention products, reduction = norms / softmax / argmax, other). The sums are the step's
# dispatch time without the gaps between dispatches; compare kinds across folders measured in
# the same run (this machine's memory bandwidth moves the mmt4d sums by ±15% from run to run).
#
#   scripts/profile-cpu-step.sh DIR [DIR...]     (ROUNDS=4, KEEP=folder for the .ireeprof files,
#                                                 FUNCTION=withPast, TOP=N: the N costliest dispatch keys)
#
# DIR: `skainet-kv export --targets cpu --contract 2 ... --out DIR` (one module, `model.irpa`,
# and for data-tiled exports the encoded archive the manifest names). The top dispatches of the
# last round of each folder: `iree-profile explain KEEP/NAME-ROUND.ireeprof`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
[ $# -ge 1 ] || { sed -n 2,16p "$0"; exit 2; }
ROUNDS=${ROUNDS:-4}
FUNCTION=${FUNCTION:-withPast}
TOP=${TOP:-0}
KEEP=${KEEP:-$(mktemp -d)}
mkdir -p "$KEEP"

step_args() { # DIR -> the --function and --input flags of the step, from the module's signature
  local dir=$1 vmfb
  vmfb=$(ls "$dir"/*.vmfb | head -1)
  iree-dump-module "$vmfb" 2>/dev/null | python3 -c '
import json, re, sys
name = json.load(open(sys.argv[1] + "/manifest.json"))["functions"][sys.argv[2]].rsplit(".", 1)[-1]
sig = next((l for l in sys.stdin if "iree.abi.declaration: sync func @%s(" % name in l), None)
if sig is None:
    sys.exit("no function %s in the module" % name)
flags = ["--function=" + name]
for i, t in re.findall(r"%input(\d+): tensor<([^>]+)>", sig.split("->")[0]):
    # input 2 is the position under contract 2 (tokens, emb, pos, ...)
    flags.append("--input=%s=%s" % (t, "200" if i == "2" else "7" if t.endswith("i32") else "0.01"))
print(" ".join(flags))' "$dir" "$FUNCTION"
}

params() { # DIR -> --parameters flags: the model archive and the encoded one, if any
  local dir=$1
  echo "--parameters=model=$dir/model.irpa"
  python3 - "$dir" <<'PY'
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
for archive in sorted(set((m.get("encodedParameters") or {}).values())):
    print("--parameters=encoded=%s/%s" % (sys.argv[1], archive))
PY
}

summarize() { # PROFILE -> one line
  iree-profile dispatch --format=jsonl "$1" | python3 -c '
import collections, json, sys
kinds, keys, count = collections.Counter(), collections.Counter(), 0
for line in sys.stdin:
    d = json.loads(line)
    if d.get("type") != "host_dispatch_group":
        continue
    k = d["key"]
    kind = next((x for x in ("mmt4d", "matmul_like", "reduction", "pack") if x in k), "other")
    kinds[kind] += d["total_ns"]
    keys[k] += d["total_ns"]
    count += d["count"]
steps = int(sys.argv[1])
per = {k: round(v / steps / 1e6, 2) for k, v in sorted(kinds.items())}
print("%d dispatches/step, ms/step %s, sum %.2f" % (count // steps, per, sum(kinds.values()) / steps / 1e6))
for k, ns in keys.most_common(int(sys.argv[2])):
    print("    %8.3f ms  %s" % (ns / steps / 1e6, k))' 10 "$TOP"
}

for round in $(seq 1 "$ROUNDS"); do
  for dir in "$@"; do
    name=$(basename "$dir")
    prof="$KEEP/$name-$round.ireeprof"
    # shellcheck disable=SC2046
    iree-benchmark-module --device=local-task --module="$(ls "$dir"/*.vmfb | head -1)" $(params "$dir") \
      $(step_args "$dir") --benchmark_min_time=10x \
      --device_profiling_mode=host-execution --device_profiling_output="$prof" >/dev/null
    echo "round $round $name: $(summarize "$prof")"
  done
done
echo "profiles in $KEEP (load: $(cut -d' ' -f1-3 /proc/loadavg))"
