#!/usr/bin/env bash
# Runs on the lent GPU machine: what a host round trip costs in a decode step. `bin/skainet-kv-spin`
# (the token read-back build with SKAINET_KV_SPIN_US: poll the transfer's semaphore that long
# before blocking; SKAINET_KV_TRACE_TRANSFER: per-transfer record / submit / wait times) against
# `bin/skainet-kv-rb`, on `i16-ampere-nr` (v1) and `i16-ampere-v2-nr` (v2). Carry
# [".cache/device", ".gl"].
set -u
source "$(dirname "$0")/device-env.sh"
VARIANTS=$(for v in i16-ampere-nr i16-ampere-v2-nr; do [ -d $D/$v ] && echo $v; done)
for v in $VARIANTS; do ln -f $D/cache/fixtures/gemma3-270m-shape-1/model.irpa $D/$v/model.irpa; done
b() { timeout 200 "$@" bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 --utterances 8 --repeat 2; }
for round in 1 2; do
  for v in $VARIANTS; do
    echo "== round $round, $v, rb"; b $D/bin/skainet-kv-rb 2>&1 | grep -E "^  decode|per step|utterance p50"
    for sem in fresh reused; do
      echo "== round $round, $v, $sem semaphore"
      if [ $sem = fresh ]; then export SKAINET_KV_FRESH_SEM=1; else unset SKAINET_KV_FRESH_SEM; fi
      SKAINET_KV_TRACE_TRANSFER=1 b $D/bin/skainet-kv-spin >/tmp/o.txt 2>/tmp/e.txt
      grep -E "^  decode|per step|utterance p50" /tmp/o.txt
      grep TRACE /tmp/e.txt | tail -200 | python3 -c '
import sys, statistics as st
rows=[dict(kv.split("=") for kv in l.split()[2:]) for l in sys.stdin]
for k in ("record_us","sem_submit_us","wait_us"):
    print("   ", k, "median", st.median(int(r[k]) for r in rows), "of", len(rows))'
    done
  done
done
