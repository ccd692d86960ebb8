#!/usr/bin/env bash
# The decode step's argmax and attention at the bench's context, in dispatch timings (session 17).
#   bash scripts/h200/argmax.sh prepare ["exports"]   (here) argmax.py's micro-module, one
#       function per staging of the (value, index) reduction over 262144 logits, compiled for
#       `ampere` into .cache/device/argmax; the step's arguments at the bench's context (v1: global
#       layers 860 rows, sliding ones their 511; v2: position 860) beside each export
#       (default i16-ampere-ahead; prepare.sh first)
#   bash scripts/h200/argmax.sh run       (on the device, carry [".cache/device", ".gl"]) each
#       staging once with HAL dispatch-events profiling: its result (100003 is right) and its
#       dispatches' GPU time (the profiled steps: ab-bench.sh's PROFILE)
set -euo pipefail
cd "$(dirname "$0")/../.."
A=.cache/device/argmax
case ${1:-} in
prepare)
  source scripts/env.sh
  mkdir -p $A
  python3 scripts/h200/argmax.py $A >$A/functions.txt
  iree-compile --iree-input-type=stablehlo --iree-hal-target-device=vulkan --iree-vulkan-target=ampere \
    $A/argmax.mlir -o $A/argmax.vmfb
  for v in ${2:-i16-ampere-ahead}; do
    python3 - .cache/device/$v <<'PY'
import json, re, sys
d = sys.argv[1]
m = json.load(open(f"{d}/manifest.json"))
period = m["globalLayerPeriod"]
args = open(f"{d}/step-args.txt").read().split()
out = []
for name, arg in zip(m["withPastArgs"], args):
    l = re.match(r"l(\d+)\.[kv]$", name)
    if name == "pos":  # contract v2: the position; its caches are static
        arg = arg.replace("=200", "=860")
    elif l and m.get("contractVersion", 1) == 1:
        rows = 860 if (int(l.group(1)) + 1) % period == 0 else 511
        arg = arg.replace("x200x", f"x{rows}x")
    out.append(arg)
open(f"{d}/step-args-long.txt", "w").write(" ".join(out))
PY
  done
  du -sh $A ;;
run)
  set +e
  source scripts/h200/device-env.sh
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  for f in $(cat $A/functions.txt); do
    echo "== argmax $f"
    $D/tools/iree-run-module --device=vulkan --module=$A/argmax.vmfb --function=$f --input=@$A/logits.npy \
      --device_profiling_mode=dispatch-events --device_profiling_output=/tmp/argmax-$f.ireeprof 2>&1 | tail -1
    $D/tools/iree-profile dispatch --format=jsonl /tmp/argmax-$f.ireeprof >"$OUT/argmax-$f.jsonl" 2>&1
    python3 scripts/h200/dispatch-summary.py "$OUT/argmax-$f.jsonl"
  done
  ;;
*) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
