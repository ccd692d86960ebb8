#!/usr/bin/env bash
# Runs on the lent GPU machine: session 14's decode-step graphs against session 13's, alternating
# in one run (docs/journal, session 14): `i16-ampere-s13` / `i16-ampere-v2-s13` (exported by
# session 13's code), `i16-ampere-apart` (a single KV head's step attends its returned cache;
# `--projections apart`), `i16-ampere` / `i16-ampere-v2` (and Q/K/V fused in the archive, Gemma's
# Q/K norms over the fused product). Then the bare steps and the greedy ids of a 400-token prompt
# against the FP32 reference. Prepare with (here):
#   BIN=<session 13 build> VARIANTS="i16-ampere i16-ampere-v2" scripts/h200/prepare.sh, renamed *-s13;
#   VARIANTS="i16-ampere i16-ampere-v2 i16-ampere-apart" scripts/h200/prepare.sh
# Carry [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/../device-env.sh"
B=$D/bin/skainet-kv
ALL="i16-ampere-s13 i16-ampere-apart i16-ampere i16-ampere-v2-s13 i16-ampere-v2"
VARIANTS=$(for v in $ALL; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do twin_archive $v || echo "== $v: no archive"; done
for round in $(seq ${ROUNDS:-2}); do
  for v in $VARIANTS; do
    echo "== round $round, $v"
    timeout 200 $B bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
      --utterances 8 --repeat 2 2>&1 | grep -E "decode|per step|chunk call|utterance p50|first token|prefix prefill|peak RSS|rror"
  done
done
for v in $VARIANTS; do
  echo "== iree-benchmark-module, bare step, $v"
  timeout 100 $D/tools/iree-benchmark-module --device=vulkan --module="$(ls $D/$v/*.vmfb)" --parameters=model=$D/$v/model.irpa \
    --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=20x 2>&1 | grep -E "median|ERROR"
done
ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
for v in i16-ampere i16-ampere-v2; do
  [ -d $D/$v ] || continue
  echo "== diverge vs reference, 400-token prompt, $v"
  check_diverge "$v" 240 $B diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
    --ids "$ids" --max-new 12
done
diverge_verdict
