#!/usr/bin/env bash
# Runs on the lent GPU machine: contract v2's prefill spans on Vulkan (docs/journal,
# session 12). The FunctionGemma twin's v2 exports, alternating: `i16-ampere-v2-old` (exported
# before prefill spans: every call reads every cache row), `i16-ampere-v2-nospans` (the prefill
# graph reads `prefillSpan` rows, no variants) and `i16-ampere-v2` (the default: variants over
# 256 and 512 rows); each: the bench's 843-token prefix prefill (median of 5 warm repeats), then
# 8 utterances, and the greedy ids of a 400-token prompt against the FP32 reference.
# Prepare: `VARIANTS="i16-ampere-v2 i16-ampere-v2-nospans" scripts/h200/prepare.sh`; carry
# [".cache/device", ".gl"]. Variants missing from .cache/device are skipped.
set -u
source "$(dirname "$0")/../device-env.sh"
VARIANTS=$(for v in i16-ampere-v2-old i16-ampere-v2-nospans i16-ampere-v2; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do twin_archive $v; done
ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
for round in 1 2; do
  for v in $VARIANTS; do
    printf 'round %s, %s: prefix 843: ' $round $v
    timeout 150 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $D/$v \
      --prefix-tokens 843 --utterances 1 --max-new 2 --repeat 5 --json 2>&1 | tail -1 |
      python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["prefix_prefill_ms"], "ms")'
  done
done
for v in $VARIANTS; do
  echo "== bench $TWIN vulkan $v"
  timeout 240 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
    --utterances 8 --repeat 2 2>&1 | tail -14
  echo "== diverge vs reference, 400-token prompt, $v"
  check_diverge "$v" 300 $D/bin/skainet-kv diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
    --ids "$ids" --max-new 12
done
diverge_verdict
