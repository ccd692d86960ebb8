#!/usr/bin/env bash
# Runs on the lent GPU machine (see prepare.sh): the tables of docs/benchmarks.md "NVIDIA H200".
set -u
source "$(dirname "$0")/device-env.sh"
VARIANTS=$(for v in packed i16-ampere i16-ampere-v2 cpu cpu-v2; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do twin_archive $v; done
echo "== demo, tiny model, vulkan then reference"
$D/bin/skainet-kv demo --backend iree-vulkan 2>&1 | tail -4
$D/bin/skainet-kv demo --backend reference 2>&1 | tail -4
for v in $(echo "$VARIANTS" | grep -v cpu); do
  echo "== bench $TWIN vulkan $v"
  timeout 240 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 --utterances 8 --repeat 2 2>&1 | tail -14
  echo "(exit ${PIPESTATUS[0]})"
  echo "== iree-benchmark-module, bare step, $v"
  timeout 120 $D/tools/iree-benchmark-module --device=vulkan --module="$(ls $D/$v/*.vmfb)" --parameters=model=$D/$v/model.irpa \
    --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=20x 2>&1 | grep -E "median|ERROR"
  echo "== diverge vs reference, $v"
  check_diverge "$v" 200 $D/bin/skainet-kv diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
    --ids 2,818,5279,529,7001,563,11,107,3689,1234,99,4242 --max-new 12
done
echo "== three-archive layout (three sessions on one Vulkan device), tiny model, vulkan then reference"
$D/bin/skainet-kv demo --backend iree-vulkan --artifacts $D/tiny-three --json 2>&1 | tail -1
$D/bin/skainet-kv demo --backend reference --json 2>&1 | tail -1
echo "== prefill by route (bench's prefix prefill, median of 5 warm repeats): 8 and 843 tokens"
for n in 8 843; do
  for route in graph chunks v2; do
    # v2 on its own route: calls of its 128-row prefill graph, then chunk calls.
    arts=$D/i16-ampere; [ $route = v2 ] && { arts=$D/i16-ampere-v2; [ -d $arts ] || continue; }
    printf 'prefix %s, %s: ' $n $route
    timeout 150 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $arts --prefill ${route/v2/auto} \
      --prefix-tokens $n --utterances 1 --max-new 2 --repeat 5 --json 2>&1 | tail -1 | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["prefix_prefill_ms"], "ms")'
  done
done
for v in $(echo "$VARIANTS" | grep cpu); do
  echo "== bench $TWIN $v (host cores)"
  timeout 200 $D/bin/skainet-kv bench --backend iree-cpu --model $TWIN --artifacts $D/$v --prefix-tokens 843 --utterances 8 --repeat 2 2>&1 | tail -10
  echo "== iree-benchmark-module, bare step, $v (host cores)"
  timeout 120 $D/tools/iree-benchmark-module --device=local-task --module="$(ls $D/$v/*.vmfb)" --parameters=model=$D/$v/model.irpa \
    --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=10x 2>&1 | grep -E "median|ERROR"
done
diverge_verdict
