#!/usr/bin/env bash
# Runs on the lent GPU machine: `bench` of several (binary, export) pairs alternating in one run,
# then the greedy ids of `generate` and `diverge` against the FP32 reference, and (PROFILE) one
# profiled bare step per export at the bench's context (docs/journal, session 17).
#   PAIRS="label:binary:export ..."   binaries in .cache/device/bin, exports in .cache/device
#   ARCHIVE="export ..."   the exports whose archives this binary writes (twin_archive: one per
#                     contract); every other export in PAIRS gets the first one's (their modules
#                     differ, their parameters not)
#   ROUNDS (1), IDS (exports whose `generate` ids are printed), DIVERGE (exports checked against
#   the reference), PROFILE (exports profiled: `argmax.sh prepare` wrote their step-args-long.txt)
# Session 17's runs:
#   1. PAIRS="s16:skainet-kv-s16:i16-ampere-head one-wait:skainet-kv:i16-ampere-head
#      ahead:skainet-kv:i16-ampere-ahead" ARCHIVE=i16-ampere-ahead (session 16's binary kept
#      as bin/skainet-kv-s16; one-wait: the async call no longer host-waits; ahead: the next
#      step queued before the token is read), and v2 by both binaries
#   2. PAIRS="s64:skainet-kv:i16-ampere-ahead-s64 s16:skainet-kv:i16-ampere-ahead": the argmax
#      in three stages of 64 against five of 16
#   later: exports of one-off variants of the emitter (the attention's forms and configurations;
#      the code that made them was not kept, the kept forms are the emitter's), each exported
#      here into its own directory beside the kept export named in ARCHIVE
# Session 18's runs (docs/journal): each kept change's export beside the previous one,
#   e.g. PAIRS="v1:skainet-kv:i16-ampere-ahead v2prev:skainet-kv:i16-ampere-v2-prev
#   v2:skainet-kv:i16-ampere-v2" ARCHIVE="i16-ampere-v2 i16-ampere-ahead" ROUNDS=4
#   DIVERGE=i16-ampere-v2 PROFILE=i16-ampere-v2 (the previous export renamed before
#   prepare.sh re-exports; v1 and v2 archives of the twin are the same bytes, so ARCHIVE's first,
#   a v2 export, serves every other export)
# Session 19's runs (docs/journal): the previous revision's exports made by its binary
#   (BIN=/tmp/skv-base VARIANTS="i16-ampere-v2" prepare.sh, then renamed *-prev; the same for
#   i16-ampere-ahead), this revision's by prepare.sh, e.g. PAIRS="v2prev:skainet-kv:i16-ampere-v2-prev
#   v2:skainet-kv:i16-ampere-v2 v1prev:skainet-kv:i16-ampere-ahead-prev v1:skainet-kv:i16-ampere-ahead"
#   ARCHIVE="i16-ampere-v2 i16-ampere-ahead" ROUNDS=8; one-off variants exported by a build of
#   the emitter with the change (not kept) into their own directories, vmfb and manifest only.
#   Write the log under $OUT and grep it: the device tool returns only the output's last 12,000
#   characters. The first bench on a freshly started machine runs slow: read same-round pairs.
# Prepare (here): scripts/h200/prepare.sh with the VARIANTS named. Carry [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/device-env.sh"
stamp() { echo "-- $(date +%T) $*"; }
exports=$(for p in $PAIRS; do echo "${p##*:}"; done | sort -u)
for a in $ARCHIVE; do twin_archive "$a"; done
first=${ARCHIVE%% *}
for v in $exports; do
  case " $ARCHIVE " in *" $v "*) ;; *) ln -f "$D/$first/model.irpa" "$D/$v/model.irpa" ;; esac
done
# The GPU's clocks while the benches run (read only), summarized at the end.
nvidia-smi --query-gpu=clocks.sm,clocks.mem,pstate --format=csv,noheader,nounits -lms 100 >/tmp/clocks.txt 2>&1 &
clocks=$!
for round in $(seq "${ROUNDS:-1}"); do
  for p in $PAIRS; do
    IFS=: read -r label bin v <<<"$p"
    stamp "round $round, $label ($bin on $v)"
    timeout 200 "$D/bin/$bin" bench --backend iree-vulkan --model $TWIN --artifacts "$D/$v" --prefix-tokens 843 \
      --utterances 8 --repeat 2 2>&1 | grep -E "decode|per step|chunk call|utterance p50|first token|rror"
  done
done
kill $clocks
python3 - <<'PY'
rows = [l.split(", ") for l in open("/tmp/clocks.txt") if l[:1].isdigit()]
sm = sorted(int(r[0]) for r in rows)
if sm:
    states = sorted({r[2].strip() for r in rows})
    print(f"-- SM clock during the benches: min {sm[0]}, median {sm[len(sm) // 2]}, max {sm[-1]} MHz "
          f"({len(sm)} samples; states {' '.join(states)})")
PY
ids=$(python3 -c 'print(",".join(str((i * 37 + 11) % 5000 + 3) for i in range(400)))')
for v in ${IDS:-}; do
  stamp "generate, $v"
  timeout 120 $D/bin/skainet-kv generate --backend iree-vulkan --model $TWIN --artifacts "$D/$v" --ids "$ids" \
    --max-new 24 2>&1 | tail -2
done
for v in ${DIVERGE:-}; do
  stamp "diverge vs reference, 400-token prompt, $v"
  check_diverge "$v" 240 $D/bin/skainet-kv diverge --model $TWIN --backends reference,iree-vulkan --artifacts "$D/$v" \
    --ids "$ids" --max-new 12
done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for v in ${PROFILE:-}; do
  stamp "profiled step of $v at 860 / 511 rows"
  timeout 120 $D/tools/iree-run-module --device=vulkan --module="$(ls $D/$v/*.vmfb)" \
    --parameters=model=$D/$v/model.irpa --function=gemma_with_past $(cat $D/$v/step-args-long.txt) \
    --device_profiling_mode=dispatch-events --device_profiling_output=/tmp/$v.ireeprof >/dev/null 2>/tmp/$v.err ||
    tail -3 /tmp/$v.err
  $D/tools/iree-profile dispatch --format=jsonl /tmp/$v.ireeprof >"$OUT/$v-long.jsonl" 2>&1
  python3 scripts/h200/dispatch-summary.py "$OUT/$v-long.jsonl"
done
stamp end
diverge_verdict
