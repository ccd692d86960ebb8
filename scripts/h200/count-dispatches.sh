#!/usr/bin/env bash
# Dispatches per call of one function of a Vulkan export (portable or tuned), counted here (no device):
# `iree-compile --compile-to=flow` with the export's flags, then the `flow.dispatch` ops inside
# `util.func public @FN`, by kind; and how many executables still carry a `compilation_info`
# (IREE drops it when it rewrites a configured op, e.g. fusing a producer into it: check this
# before spending device time on a configured form).
#   scripts/h200/count-dispatches.sh EXPORT_DIR [FN (gemma_with_past)] [extra iree-compile flags]
# LEVELS=1 also compiles to `hal` (about a minute at the twin's size) and counts the barriers of
# FN's memoized command buffer: the dependent levels of its chain, which bound a GPU step more
# than the dispatch count does (session 28: 369 dispatches in 332 levels for the portable twin,
# 333 in 314 after gate/up fused; tuned 225 in 171).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
dir=$1
fn=${2:-gemma_with_past}
shift $(( $# >= 2 ? 2 : 1 ))
mlir=$(ls "$dir"/*.mlir | head -1)
target=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["provenance"]["targets"])' "$dir/manifest.json")
flags=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["provenance"].get("compileFlags",""))' "$dir/manifest.json")
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086
# The bare `vulkan` target is the portable export: IREE's Android baseline profile.
vk=${target#vulkan}; vk=${vk#-}; vk=${vk:-vp_android_baseline_2022}
iree-compile --iree-input-type=stablehlo --iree-hal-target-device=vulkan --iree-vulkan-target="$vk" \
  --iree-execution-model=async-external $flags "$@" --compile-to=flow "$mlir" -o "$tmp"
python3 - "$tmp" "$fn" <<'PY'
import collections, re, sys
lines = open(sys.argv[1]).read().splitlines()
fn = sys.argv[2]
start = next(i for i, l in enumerate(lines) if re.match(rf"\s*util\.func public @{fn}\(", l))
indent = len(lines[start]) - len(lines[start].lstrip())
end = next(i for i in range(start + 1, len(lines)) if lines[i] == " " * indent + "}")
kinds = collections.Counter()
for l in lines[start:end]:
    m = re.search(r"flow\.dispatch @\w+::@(\w+)", l)
    if m:
        kinds[re.sub(r"^.*?dispatch_\d+_", "", m.group(1))] += 1
print(f"{sum(kinds.values())} dispatches a call of {fn}")
for k, n in kinds.most_common():
    print(f"  {n:4d} {k}")
configured = sum("compilation_info" in l for l in lines)
print(f"{configured} ops in the module's executables carry a compilation_info")
PY
if [ "${LEVELS:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  iree-compile --iree-input-type=stablehlo --iree-hal-target-device=vulkan --iree-vulkan-target="$vk" \
    --iree-execution-model=async-external $flags "$@" --compile-to=hal "$mlir" -o "$tmp"
  python3 - "$tmp" "$fn" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
fn = sys.argv[2]
head = re.compile(rf"\s*util\.func private @__{fn}_memoize_apply\(")
start = next((i for i, l in enumerate(lines) if head.match(l)), None)
if start is None:
    sys.exit(f"no memoized command buffer for @{fn} (a dynamic shape records it per call)")
indent = len(lines[start]) - len(lines[start].lstrip())
end = next(i for i in range(start + 1, len(lines)) if lines[i] == " " * indent + "}")
body = lines[start:end]
dispatches = sum("hal.command_buffer.dispatch" in l for l in body)
barriers = sum("hal.command_buffer.execution_barrier" in l for l in body)
print(f"{fn}'s command buffer: {dispatches} dispatches in {barriers} barriers (dependent levels)")
PY
fi
