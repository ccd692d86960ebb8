#!/usr/bin/env bash
# Runs on the lent GPU machine: synchronous against async (`--iree-execution-model=async-external`)
# Vulkan functions, the same runtime binary (`bin/skainet-kv`, session 13: a semaphore per device for its
# transfers and async calls), alternating: `i16-ampere-nr` / `i16-ampere-v2-nr` (sync) against
# `i16-ampere-as` / `i16-ampere-v2-as` (async); then the greedy ids of a 400-token prompt against
# the FP32 reference on the async exports (docs/journal, session 13).
# Carry [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/../device-env.sh"
B=$D/bin/skainet-kv
VARIANTS=$(for v in i16-ampere-nr i16-ampere-as i16-ampere-v2-nr i16-ampere-v2-as; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do twin_archive $v; done
for round in 1 2; do
  for v in $VARIANTS; do
    echo "== round $round, $v"
    timeout 200 $B bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
      --utterances 8 --repeat 2 2>&1 | grep -E "decode|per step|chunk call|utterance p50|first token|prefix prefill|peak RSS"
  done
done
ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
for v in i16-ampere-as i16-ampere-v2-as; do
  [ -d $D/$v ] || continue
  echo "== diverge vs reference, 400-token prompt, $v"
  check_diverge "$v" 240 $B diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
    --ids "$ids" --max-new 12
done
diverge_verdict
