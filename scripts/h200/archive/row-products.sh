#!/usr/bin/env bash
# Runs on the lent GPU machine: the LM head of the decode step (docs/journal, session 16).
# `bench` of the step exports alternating in one run (ROUNDS), the greedy ids of a 400-token
# prompt against the FP32 reference, and one profiled bare step per variant (dispatch timings,
# by iree-run-module / iree-profile built from our IREE sources, `build-iree-tools.sh vulkan`):
#   i16-ampere       (i16 + ampere, before session 16) the LM head a `vecmat` with the widening
#                    fused in by IREE, like the step's other products
#   i16-ampere-head  the LM head widening in its own body over (vocab, hidden), 4 rows a 64-thread
#                    workgroup (`RowProducts`); the rest unchanged
#   i16-ampere-v2, i16-ampere-v2-head   the same for contract v2
# PARTS=micro adds IREE's standalone dispatch benchmarks (`lm-head.sh prepare` first; they need
# the wheel's iree-benchmark-module, which cannot allocate the LM head on a GPU without resizable
# BAR). Prepare (here): prepare.sh's variants, the old ones exported by a session-15 build (BIN=),
# renamed. Carry [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/../device-env.sh"
B=$D/bin/skainet-kv
PARTS=${PARTS:-bench diverge}
ALL="i16-ampere i16-ampere-head i16-ampere-v2 i16-ampere-v2-head"
VARIANTS=$(for v in ${ONLY:-$ALL}; do [ -d $D/$v ] && echo $v; done)
stamp() { echo "-- $(date +%T) $*"; }
case " $PARTS " in *" micro "*)
  stamp micro
  bash scripts/h200/archive/lm-head.sh run | grep -v "^NVIDIA" ;;
esac
case " $PARTS " in *" bench "*)
  # One archive per contract (the forms differ in their modules only), written by the export
  # whose MLIR this binary emits again: the kept form's.
  twin_archive i16-ampere-head && ln -f $D/i16-ampere-head/model.irpa $D/i16-ampere/model.irpa
  twin_archive i16-ampere-v2-head && ln -f $D/i16-ampere-v2-head/model.irpa $D/i16-ampere-v2/model.irpa
  for round in $(seq ${ROUNDS:-1}); do
    for v in $VARIANTS; do
      stamp "round $round, $v"
      timeout 200 $B bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
        --utterances 8 --repeat 2 2>&1 | grep -E "decode|per step|chunk call|utterance p50|first token|prefix prefill|peak RSS|rror"
    done
  done ;;
esac
case " $PARTS " in *" diverge "*)
  ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
  for v in ${DIVERGE:-i16-ampere-head i16-ampere-v2-head}; do
    [ -d $D/$v ] || continue
    stamp "diverge vs reference, 400-token prompt, $v"
    check_diverge "$v" 240 $B diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
      --ids "$ids" --max-new 12
  done ;;
esac
case " $PARTS " in *" profile "*)
  # One invocation of the bare step per variant with dispatch timings, by iree-run-module and
  # iree-profile built from our IREE sources with our allocator patch (`scripts/build-iree-tools.sh
  # vulkan`; the wheel's tools cannot load the archive on a GPU without resizable BAR).
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  for v in ${PROFILE:-i16-ampere i16-ampere-head}; do
    [ -f $D/$v/model.irpa ] || continue
    stamp "profile, $v"
    timeout 120 $D/tools/iree-run-module --device=vulkan --module="$(ls $D/$v/*.vmfb)" --parameters=model=$D/$v/model.irpa \
      --function=gemma_with_past $(cat $D/$v/step-args.txt) --device_profiling_mode=dispatch-events \
      --device_profiling_output="$OUT/$v.ireeprof" >/dev/null 2>"$OUT/$v.err" || tail -3 "$OUT/$v.err"
    $D/tools/iree-profile dispatch --format=jsonl "$OUT/$v.ireeprof" >"$OUT/$v-dispatch.jsonl" 2>&1
    $D/tools/iree-profile explain "$OUT/$v.ireeprof" 2>&1 | grep -m1 active_dispatch_ns
  done ;;
esac
stamp end
diverge_verdict
