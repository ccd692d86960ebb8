#!/usr/bin/env bash
# Runs on the lent GPU machine: the decode step before and after the fused Q/K norm + rotation
# (`FuncEmitter::norm_rope`, 54 fewer dispatches per step; docs/journal, session 13), v1
# and v2, and where `bench`'s decode step spends its time (`decode_phases`: inputs, invoke,
# token read, row writes). Variants in .cache/device: `i16-ampere-old` / `i16-ampere-v2-nospans`
# (exported before the change) and `i16-ampere-nr` / `i16-ampere-v2-nr` (after); each: the bare
# step (`iree-benchmark-module`, median of 5) in two interleaved rounds, `bench` (843-token
# prefix, 8 utterances, twice), and the greedy ids of a 400-token prompt against the FP32
# reference. Prepare: `scripts/h200/prepare.sh` with those exports; carry [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/../device-env.sh"
VARIANTS=$(for v in i16-ampere-old i16-ampere-nr i16-ampere-v2-nospans i16-ampere-v2-nr; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do twin_archive $v; done
for round in 1 2; do
  for v in $VARIANTS; do
    printf 'round %s, %s, bare step: ' $round $v
    timeout 90 $D/tools/iree-benchmark-module --device=vulkan --module="$(ls $D/$v/*.vmfb)" --parameters=model=$D/$v/model.irpa \
      --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=20x 2>&1 \
      | grep -E "real_time_median|ERROR" | awk '{print $2, $3}'
  done
done
for v in $VARIANTS; do
  echo "== bench $TWIN vulkan $v"
  timeout 200 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
    --utterances 8 --repeat 2 2>&1 | tail -14
done
ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
for v in $VARIANTS; do
  case $v in *-nr) ;; *) continue ;; esac
  echo "== diverge vs reference, 400-token prompt, $v"
  check_diverge "$v" 240 $D/bin/skainet-kv diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
    --ids "$ids" --max-new 12
done
diverge_verdict
