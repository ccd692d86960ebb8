#!/usr/bin/env bash
# Runs on the lent GPU machine as .cache/prof-device/run.sh (scripts/h200/profile-chunk.sh puts it
# there):
# the bare chunk and step functions of the v2 twin export, an in-context HAL dispatch profile of
# the chunk function (where the Vulkan driver gives one), then each dumped dispatch benchmark of
# the chunk function. Logs and the profile bundle go to $OUT (when set).
set -u
cd "$(dirname "$0")"
for f in gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export XDG_RUNTIME_DIR=/tmp
export SKAINET_KV_CACHE=$PWD/cache
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
B=tools/iree-benchmark-module
M=$(ls chunk/*.vmfb)
BATCH=${BATCH:-20}
BUDGET_S=${BUDGET_S:-450} # stop starting dispatch benchmarks after this many seconds
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
bin/skainet-kv inspect --model gemma3-270m-shape:1 >/dev/null # generates the twin's archive
ln -f cache/fixtures/gemma3-270m-shape-1/model.irpa model.irpa
echo "== bare chunk function (gemma_prefill_with_past, 32 rows, pos 200), median of 5"
timeout 150 $B --device=vulkan --module="$M" --parameters=model=model.irpa --function=gemma_prefill_with_past \
  $(cat chunk/chunk-args.txt) --benchmark_repetitions=5 --benchmark_min_time=3x 2>&1 | grep -E "median|mean|ERROR|rror"
echo "== bare step function (gemma_with_past, pos 200), median of 5"
timeout 90 $B --device=vulkan --module="$M" --parameters=model=model.irpa --function=gemma_with_past \
  $(cat chunk/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=20x 2>&1 | grep -E "median|ERROR|rror"
echo "== HAL dispatch-events profile of 3 chunk calls (in context)"
timeout 120 $B --device=vulkan --module="$M" --parameters=model=model.irpa --function=gemma_prefill_with_past \
  $(cat chunk/chunk-args.txt) --benchmark_min_time=3x \
  --device_profiling_mode=dispatch-events --device_profiling_output="$OUT/chunk.ireeprof" >"$OUT/hal-profile.log" 2>&1
echo "exit $?; $(tail -2 "$OUT/hal-profile.log")"
if [ -s "$OUT/chunk.ireeprof" ]; then
  tools/iree-profile summary "$OUT/chunk.ireeprof" >"$OUT/profile-summary.txt" 2>&1
  tools/iree-profile dispatch --format=jsonl "$OUT/chunk.ireeprof" >"$OUT/profile-dispatch.jsonl" 2>&1
  tools/iree-profile explain "$OUT/chunk.ireeprof" >"$OUT/profile-explain.txt" 2>&1
  head -40 "$OUT/profile-explain.txt"
fi
echo "== HAL dispatch-events profile of 3 calls of the 128-row prefill graph (gemma_prefill_at, pos 0)"
timeout 120 $B --device=vulkan --module="$M" --parameters=model=model.irpa --function=gemma_prefill_at \
  $(sed 's/--input=1xi32=200/--input=1xi32=0/' chunk/prefill-args.txt) --benchmark_min_time=3x \
  --device_profiling_mode=dispatch-events --device_profiling_output="$OUT/prefill.ireeprof" 2>&1 | grep -E "real_time|rror"
echo "== dispatch benchmarks (--batch_size=$BATCH, 3 repetitions, median per dispatch)"
n=0
for f in dispatch/*.vmfb; do
  if [ $SECONDS -gt "$BUDGET_S" ]; then echo "budget reached after $n files: stopping"; break; fi
  n=$((n + 1))
  # No --function: every function of the module without inputs (the dumped benchmarks) runs.
  timeout 90 $B --device=vulkan --module="$f" --batch_size=$BATCH --benchmark_repetitions=3 \
    --benchmark_min_time=0.2s --time_unit=us 2>&1 | grep -E "_median|ERROR|rror" | sed "s|^|$(basename "$f" .vmfb) |" | tee -a "$OUT/dispatch.txt"
done
echo "== done in $SECONDS s"
