#!/usr/bin/env bash
# Runs on the lent GPU machine: the one-row i16 products of the decode step (docs/benchmarks.md,
# session 16). First IREE's standalone benchmarks of each product shape in each form
# (`lm-head.sh run`), then `bench` of the step exports alternating in one run, and the greedy ids
# of a 400-token prompt against the FP32 reference:
#   i16-ampere        the widening apart, fused by IREE into a `vecmat` (before session 16)
#   i16-ampere-body   every one-row product widening in its own body (`Body::row_contract_i16`)
#   i16-ampere-64x4   and a SubgroupReduce configuration of 4 rows a 64-thread workgroup
#   i16-ampere-32x2   or of 2 rows a 32-thread workgroup
#   i16-ampere-v2, i16-ampere-v2-64x4   the first and the last for contract v2
# Prepare (here): `scripts/h200/lm-head.sh prepare`, then prepare.sh's variants under these names
# (each export by the code of its form). Carry [".cache/device", ".gl"]. PARTS picks parts.
set -u
source "$(dirname "$0")/device-env.sh"
B=$D/bin/skainet-kv
PARTS=${PARTS:-bench diverge}
ALL="i16-ampere i16-ampere-body i16-ampere-64x4 i16-ampere-32x2 i16-ampere-v2 i16-ampere-v2-64x4"
VARIANTS=$(for v in ${ONLY:-$ALL}; do [ -d $D/$v ] && echo $v; done)
stamp() { echo "-- $(date +%T) $*"; }
case " $PARTS " in *" micro "*)
  stamp micro
  bash scripts/h200/lm-head.sh run | grep -v "^NVIDIA" ;;
esac
case " $PARTS " in *" bench "*)
  # One archive per contract (the forms differ in their modules only), written by the export
  # whose MLIR this binary emits again (ROW_PRODUCTS: the configuration it was exported with).
  ROW_PRODUCTS=64x4 twin_archive i16-ampere-64x4
  for v in i16-ampere i16-ampere-body i16-ampere-32x2; do
    [ -d $D/$v ] && ln -f $D/i16-ampere-64x4/model.irpa $D/$v/model.irpa
  done
  ROW_PRODUCTS=64x4 twin_archive i16-ampere-v2-64x4 && ln -f $D/i16-ampere-v2-64x4/model.irpa $D/i16-ampere-v2/model.irpa
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
  for v in ${DIVERGE:-i16-ampere-64x4 i16-ampere-v2-64x4}; do
    [ -d $D/$v ] || continue
    stamp "diverge vs reference, 400-token prompt, $v"
    timeout 240 $B diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
      --ids "$ids" --max-new 12 2>&1 | tail -3
  done ;;
esac
stamp end
