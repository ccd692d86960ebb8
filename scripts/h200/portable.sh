#!/usr/bin/env bash
# The portable Vulkan export (the default: packed weights, IREE's vp_android_baseline_2022) beside
# the tuned one (i16 + ampere) on the H200, alternating in one run (docs/benchmarks.md,
# "Portable"). Two halves:
#
#   scripts/h200/portable.sh prepare      # here: release build, the twin's exports, the wheel's tools
#   bash scripts/h200/portable.sh run     # there, with the device tool, carry [".cache/device", ".gl"]
#
# VARIANTS picks exports (default "packed i16-ampere"; also packed-v2 (the portable target under
# contract 2), i16-p16 / i16-p16-v2 (`--vulkan-target portable-16bit`: the portable profile with
# 16-bit storage, i16 weights), i16-ampere-v2, i16-sg32-v2 (`--vulkan-target portable-sg32`:
# the portable limits with subgroup reductions, session 32), i16-sgall-v2 (one export for
# subgroups of 16, 32 and 64: the session opens its device's), and i16-valhall, i16-adreno,
# which load on NVIDIA but assume another subgroup size: their diverge fails there). Mind the 64 MiB carry: ~10 MB a
# variant, 13 MB the binary. ROUNDS (default 3) alternations of the bare step and bench;
# PROFILE="variant ..." adds a device profile of one utterance of each one's session (`bench
# --device-profile`), summarized by scripts/h200/step-timeline.py ($OUT/<variant>-timeline.txt:
# each call's span, busy and idle time, levels, heaviest dispatches). The run fails if any
# diverge does.
#
# Session 23 (issue 36) left this run; session 24 made it (docs/benchmarks.md, "Portable"):
#   VARIANTS="packed packed-v2 i16-p16-v2 i16-ampere-v2" scripts/h200/portable.sh prepare
#   ROUNDS=2 PROFILE="packed packed-v2" bash scripts/h200/portable.sh run
# Session 26 (docs/benchmarks.md, "Portable"): several builds' exports of the same flags, each
# exported with BIN=<that build's binary> VARIANTS=packed-v2 ... prepare and its directory
# renamed (packed-v2-<name>), this build's last; list this build's first in VARIANTS (twin_archive
# writes its archive with the carried binary, the others share it). More than ~4 variants
# exceed the 64 MiB carry: carry them as one archive instead,
#   tar -cf - .cache/device | xz -T2 -6 >.cache/dev.tar.xz     # 5 variants: 67 -> 11 MB
# with carry [".cache/dev.tar.xz", ".gl"] and, on the device,
#   tar -xJf .cache/dev.tar.xz && ROUNDS=2 PROFILE="packed-v2" \
#     VARIANTS="packed-v2 packed-v2-old i16-ampere-v2" OUT=$OUT bash scripts/h200/portable.sh run
# Session 32: VARIANTS="i16-sgall-v2 packed-v2 i16-ampere-v2" prepare (76 MB: carried as
# .cache/dev4.tar.xz, 11 MB), then on the device
#   rm -rf .cache/device && tar -xJf .cache/dev4.tar.xz && ROUNDS=4 BARE=0 \
#     VARIANTS="i16-sgall-v2 packed-v2 i16-ampere-v2" OUT=$OUT bash scripts/h200/portable.sh run
# Builds whose archives differ (session 28: gate/up fused for the portable profile) cannot share
# one: copy the binary that exported a variant into its directory ($D/<variant>/skainet-kv) and
# twin_archive writes that variant's archive with it. BARE=0 skips the bare step.
set -euo pipefail
cd "$(dirname "$0")/../.."
VARIANTS=${VARIANTS:-packed i16-ampere}
export_args() {
  case $1 in
    packed) echo "--targets vulkan" ;;
    packed-v2) echo "--targets vulkan --contract 2" ;;
    # The same flags, for an A/B of two builds' forms: `packed-v2` exported by the build before
    # (BIN=<its binary> ... prepare), this one by the build carried (twin_archive shares the archive).
    packed-v2-new) echo "--targets vulkan --contract 2" ;;
    i16-p16) echo "--targets vulkan --weight-storage i16 --vulkan-target portable-16bit --contract 1" ;;
    i16-p16-v2) echo "--targets vulkan --weight-storage i16 --vulkan-target portable-16bit --contract 2" ;;
    i16-ampere-v2) echo "--targets vulkan --weight-storage i16 --vulkan-target ampere --contract 2" ;;
    i16-ampere) echo "--targets vulkan --weight-storage i16 --vulkan-target ampere --contract 1" ;;
    # The portable target with subgroup operations and 16-bit storage, for 32-lane subgroups
    # (session 32: the module a GPU whose driver reports subgroups of 32 gets; no vendor constants).
    i16-sg32-v2) echo "--targets vulkan --weight-storage i16 --vulkan-target portable-sg32 --contract 2" ;;
    # One export for the subgroups of Mali, NVIDIA and Adreno: the session opens its device's.
    i16-sgall-v2) echo "--targets vulkan --weight-storage i16 --vulkan-target portable-sg16,portable-sg32,portable-sg64 --contract 2" ;;
    i16-valhall) echo "--targets vulkan --weight-storage i16 --vulkan-target valhall" ;;
    i16-adreno) echo "--targets vulkan --weight-storage i16 --vulkan-target adreno" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
  esac
}
if [ "${1:-}" = prepare ]; then
  # What `run` needs, in prepare.sh's layout: the binary, the wheel's benchmark and profile tools
  # (the run allocates no buffer that needs prepare.sh's patched IREE build, and `iree-profile
  # explain` reads a capture offline), the loader debs. A fresh machine prepares in minutes.
  source scripts/env.sh
  D=.cache/device
  cargo build --release -p skainet-kv
  mkdir -p $D/bin $D/tools .gl
  cp target/release/skainet-kv $D/bin/ && strip $D/bin/skainet-kv
  cp .tools/venv/lib/python3.*/site-packages/iree/_runtime_libs/{iree-benchmark-module,iree-profile} $D/tools/
  if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
    (cd .gl && apt-get download libvulkan1 libglvnd0 libegl1 libgl1 libglx0 libgles2 libopengl0)
  fi
  for v in $VARIANTS; do
    tmp=$(mktemp -d)
    # shellcheck disable=SC2046
    ${BIN:-./target/release/skainet-kv} export --model gemma3-270m-shape:1 --out "$tmp" $(export_args $v) >/dev/null
    rm -rf "${D:?}/$v" && mkdir -p "$D/$v"
    cp "$tmp"/*.vmfb "$tmp"/manifest.json "$D/$v/"
    export_args $v | tr ' ' '\n' >"$D/$v/export-args.txt"
    for m in "$tmp"/*.vmfb; do
      stem=$(basename "$m" .vmfb)
      sha256sum "$tmp/${stem%%.*}.mlir" | cut -d' ' -f1 >"$D/$v/$stem.mlir.sha256"
    done
    rm -rf "$tmp"
    echo "exported $v"
  done
  # The bare step's arguments at past 200, read from the module (prepare.sh's recipe).
  for v in $VARIANTS; do
    python3 - "$D/$v" <<'PY'
import glob, re, subprocess, sys
d = sys.argv[1]
vmfb = glob.glob(f"{d}/*.vmfb")[0]
dump = subprocess.run(["iree-dump-module", vmfb], capture_output=True, text=True).stdout
decl = next((l for l in dump.splitlines() if "sync func @gemma_with_past(" in l), "")
args = []
# A step that takes its results' storage and transients (contract 2 on Vulkan since session 31):
# a buffer view per tied result, a bare buffer (`&`) of the reflected size for the transients.
size = re.search(r"iree.abi.transients.size.constant: (\d+)", dump[dump.find(decl):]) if decl else None
for i, arg in enumerate(decl.split("(", 1)[-1].split(") ->")[0].split(", %")):
    m = re.search(r"tensor<([^>]*)>", arg)
    t = m.group(1).replace("?", "200") if m else ""
    if "iree.abi.output" in arg:
        args.append(f"--input={t}")
    elif "iree.abi.transients" in arg:
        args.append(f"--input=&{size.group(1)}xi8")
    elif t.endswith("i32"):
        args.append(f"--input={t}=200" if i == 2 else f"--input={t}=7")
    else:
        args.append(f"--input={t}=0.01")
open(f"{d}/step-args.txt", "w").write(" ".join(args))
PY
  done
  du -sh $D .gl
  exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 prepare|run" >&2; exit 2; }
set +e
source scripts/h200/device-env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for v in $VARIANTS; do twin_archive $v; done
ids=2,818,5279,529,7001,563,11,107,3689,1234,99,4242
for v in $VARIANTS; do
  echo "== diverge vs reference, $v"
  check_diverge "$v" 150 $D/bin/skainet-kv diverge --model $TWIN --backends reference,iree-vulkan --artifacts $D/$v --ids $ids --max-new 12
done
for round in $(seq "${ROUNDS:-3}"); do
  for v in $VARIANTS; do
    # BARE=0 skips the bare step: its inputs (the caches) travel with every call, so it
    # measures transfers as much as the step (14 ms where bench decodes in 8, session 28).
    if [ "${BARE:-1}" = 1 ]; then
      echo "== round $round: bare step, $v"
      timeout 90 $D/tools/iree-benchmark-module --device=vulkan --module="$(ls $D/$v/*.vmfb)" --parameters=model=$D/$v/model.irpa \
        --function=gemma_with_past $(cat $D/$v/step-args.txt) --benchmark_repetitions=5 --benchmark_min_time=10x 2>&1 | grep -E "real_time_median|ERROR"
    fi
    echo "== round $round: bench, $v"
    timeout 150 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 --utterances 4 --repeat 1 2>&1 | tail -9
  done
done
for v in ${PROFILE:-}; do
  # Our own session's calls (bench --device-profile: one utterance after the timed stages),
  # not iree-benchmark-module's lone step, whose caches travel as inputs every call.
  timeout 150 $D/bin/skainet-kv bench --backend iree-vulkan --model $TWIN --artifacts $D/$v --prefix-tokens 843 \
    --utterances 2 --repeat 1 --device-profile "/tmp/$v-session.ireeprof" >"/tmp/$v-profiled-bench.log" 2>&1
  echo "== device profile of one utterance (restore, chunk call, 15 steps), $v"
  # Into the file first: `tee | head` would cut the file where head stops reading.
  python3 scripts/h200/step-timeline.py "/tmp/$v-session.ireeprof" --iree-profile $D/tools/iree-profile --top 24 \
    >"$OUT/$v-timeline.txt" 2>&1
  head -40 "$OUT/$v-timeline.txt"
  # Every kind of the session's dispatches (only text comes back: $OUT returns at most 8 files).
  $D/tools/iree-profile dispatch "/tmp/$v-session.ireeprof" 2>&1 | head -c 400000 >"$OUT/$v-dispatch.txt"
done
diverge_verdict
