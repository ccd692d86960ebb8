#!/usr/bin/env bash
# Runs on the lent GPU machine: `bench`'s decode step with its small inputs uploaded through a
# device-local buffer each (`bin/skainet-kv`, before) and written into host-visible memory
# (`bin/skainet-kv-up`, after; `iree_runtime::HOST_VISIBLE_UPLOAD_MAX`), alternating, on the
# `i16-ampere-nr` (v1) and `i16-ampere-v2-nr` (v2) exports; then the greedy ids of a 400-token
# prompt against the FP32 reference with the new binary (docs/journal, session 13).
# BINS names the two binaries in .cache/device/bin to compare (default: the upload change; the
# token read-back change was `BINS="skainet-kv-up skainet-kv-rb"`), the last one runs `diverge`.
# Carry [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/../device-env.sh"
BINS=${BINS:-skainet-kv skainet-kv-up}
LAST=${BINS##* }
VARIANTS=$(for v in i16-ampere-nr i16-ampere-v2-nr; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do twin_archive $v; done
for round in 1 2; do
  for v in $VARIANTS; do
    for bin in $BINS; do
      echo "== round $round, $v, $bin"
      timeout 200 $D/bin/$bin bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
        --utterances 8 --repeat 2 2>&1 | grep -E "decode|per step|chunk call|utterance p50|first token|prefix prefill"
    done
  done
done
ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
for v in $VARIANTS; do
  echo "== diverge vs reference, 400-token prompt, $v, $LAST"
  check_diverge "$v" 240 $D/bin/$LAST diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v \
    --ids "$ids" --max-new 12
done
diverge_verdict
