#!/usr/bin/env bash
# Runs on the lent GPU machine (after `scripts/h200/prepare.sh`, which also copies iree-profile):
# an in-context HAL dispatch-events profile of the bare step (`gemma_with_past`, v1 at past 200 /
# v2 at pos 200) of each Vulkan variant in .cache/device, to tell GPU time from gaps between
# submissions. Run with the device tool: `bash scripts/h200/profile-step.sh`, carry
# [".cache/device", ".gl"]; profiles and summaries land in $OUT. VARIANTS picks the variants.
set -u
source "$(dirname "$0")/device-env.sh"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for v in ${VARIANTS:-i16-ampere i16-ampere-v2}; do
  [ -d $D/$v ] || continue
  twin_archive $v
  M=$(ls $D/$v/*.vmfb)
  echo "== $v: bare step, median of 5"
  timeout 90 $D/tools/iree-benchmark-module --device=vulkan --module="$M" --parameters=model=$D/$v/model.irpa \
    --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=20x 2>&1 \
    | grep -E "real_time_median|ERROR"
  echo "== $v: dispatch-events profile of 5 steps"
  timeout 120 $D/tools/iree-benchmark-module --device=vulkan --module="$M" --parameters=model=$D/$v/model.irpa \
    --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_min_time=5x \
    --device_profiling_mode=dispatch-events --device_profiling_output="$OUT/$v-step.ireeprof" >"$OUT/$v-hal.log" 2>&1
  echo "exit $?"
  if [ -s "$OUT/$v-step.ireeprof" ]; then
    $D/tools/iree-profile summary "$OUT/$v-step.ireeprof" >"$OUT/$v-summary.txt" 2>&1
    $D/tools/iree-profile dispatch --format=jsonl "$OUT/$v-step.ireeprof" >"$OUT/$v-dispatch.jsonl" 2>&1
    $D/tools/iree-profile explain "$OUT/$v-step.ireeprof" >"$OUT/$v-explain.txt" 2>&1
    head -60 "$OUT/$v-explain.txt"
  fi
done
