#!/usr/bin/env bash
# Prepares what the H200 runs in docs/benchmarks.md need, in .cache/device (ignored; < 64 MiB, so
# it travels with the device tool's `carry`): the release binary, FunctionGemma-geometry exports
# without their archive (the twin's weights are regenerated there, same bytes), the tiny demo's
# Vulkan export, IREE's benchmark tool, and the Vulkan loader debs in .gl.
# Then, with the device tool: run `bash scripts/h200/run.sh`, carry [".cache/device", ".gl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
D=.cache/device
TWIN=gemma3-270m-shape:1
cargo build --release -p skainet-kv
mkdir -p $D/bin $D/tools $D/cache/artifacts .gl
cp target/release/skainet-kv $D/bin/
cp .tools/venv/lib/python3.*/site-packages/iree/_runtime_libs/{iree-benchmark-module,iree-profile} $D/tools/
# iree-run-module and iree-profile from our IREE sources with our Vulkan allocator patch: the
# wheel's tools cannot allocate the 335 MB LM head on a GPU without resizable BAR (session 16).
scripts/build-iree-tools.sh vulkan
cp .tools/bin-vulkan/{iree-run-module,iree-profile} $D/tools/

# BIN: the binary that exports (another build's, for a before/after of the graphs).
BIN=${BIN:-./target/release/skainet-kv}
export_twin() { # name, then export flags
  local name=$1; shift
  local tmp; tmp=$(mktemp -d)
  $BIN export --model $TWIN --out "$tmp" "$@"
  rm -rf "${D:?}/$name" && mkdir -p "$D/$name"
  cp "$tmp"/*.vmfb "$tmp"/manifest.json "$D/$name/"
  # What the device needs to write an export's own archive (fused projections: not the twin's
  # source archive) with the same binary: the flags, and each module's MLIR digest
  # (carried-compiler.sh, device-env.sh's twin_archive).
  printf '%s\n' "$@" >"$D/$name/export-args.txt"
  for m in "$tmp"/*.vmfb; do
    local stem; stem=$(basename "$m" .vmfb)
    sha256sum "$tmp/${stem%%.*}.mlir" | cut -d' ' -f1 >"$D/$name/$stem.mlir.sha256"
  done
  rm -rf "$tmp"
}
# VARIANTS picks a subset (each export of the twin takes minutes on a small machine).
# The -v2 variants are contract v2 exports (docs/contract-v2.md) of the same graphs.
VARIANTS=${VARIANTS:-packed i16-ampere i16-ampere-v2 cpu cpu-v2}
for v in $VARIANTS; do
  case $v in
    packed) export_twin packed --targets vulkan ;;
    i16-ampere) export_twin i16-ampere --targets vulkan --weight-storage i16 --vulkan-target ampere ;;
    # The same, exported by this build (session 17: with the step module's embed_token, the
    # argmax in stages of 16).
    i16-ampere-ahead) export_twin i16-ampere-ahead --targets vulkan --weight-storage i16 --vulkan-target ampere ;;
    # Q/K/V apart in the archive, as the source stores them (`export --projections apart`).
    i16-ampere-apart) export_twin i16-ampere-apart --targets vulkan --weight-storage i16 --vulkan-target ampere --projections apart ;;
    i16-ampere-v2) export_twin i16-ampere-v2 --targets vulkan --weight-storage i16 --vulkan-target ampere --contract 2 ;;
    # The prefill graph without its token-less variants (prefill-spans.sh).
    i16-ampere-v2-nospans) export_twin i16-ampere-v2-nospans --targets vulkan --weight-storage i16 --vulkan-target ampere \
      --contract 2 --prefill-spans none ;;
    # The CPU runtime flags of each contract (export::CPU_RUNTIME_FLAGS, CPU_RUNTIME_FLAGS_V2).
    cpu) export_twin cpu --targets cpu --cpu x86-64-v3 --weight-storage bf16 \
      --compile-flag=--iree-opt-level=O3 --compile-flag=--iree-dispatch-creation-enable-aggressive-fusion=false ;;
    cpu-v2) export_twin cpu-v2 --targets cpu --cpu x86-64-v3 --weight-storage bf16 --contract 2 \
      --compile-flag=--iree-opt-level=O3 --compile-flag=--iree-global-opt-data-tiling --compile-flag=--iree-llvmcpu-enable-ukernels=all ;;
  esac
done

# The tiny demo model's Vulkan export, as the CLI caches it.
./target/release/skainet-kv demo --backend iree-vulkan >/dev/null
rm -rf $D/cache/artifacts/tiny-gemma3-7-vulkan-shared
cp -r "$SKAINET_KV_CACHE/artifacts/tiny-gemma3-7-vulkan-shared" $D/cache/artifacts/

# The seed's three-archive layout (three sessions on one Vulkan device, which did not open before
# each device had one HAL group): the tiny model, archives included (a few MB).
rm -rf $D/tiny-three
./target/release/skainet-kv export --model tiny-gemma3:7 --out $D/tiny-three --targets vulkan --layout three

# Arguments of each variant's bare step function for iree-benchmark-module: v1 with past = 200
# rows, v2 at pos = 200 (its caches are static, maxPositions rows).
python3 - "$D" <<'PY'
import glob, os, re, subprocess, sys
d = sys.argv[1]
for vmfb in sorted(glob.glob(f"{d}/*/gemma.*.vmfb")):
    dump = subprocess.run(["iree-dump-module", vmfb], capture_output=True, text=True).stdout
    # (`sync func` or, for async exports, `async func`)
    decl = next((l for l in dump.splitlines() if "sync func @gemma_with_past(" in l), None)
    if decl is None:
        continue
    inputs = decl.split("(", 1)[1].split(") ->")[0]
    args = []
    for i, m in enumerate(re.finditer(r"tensor<([^>]*)>", inputs)):
        t = m.group(1).replace("?", "200")
        if t.endswith("i32"):
            args.append(f"--input={t}=200" if i == 2 else f"--input={t}=7")
        else:
            args.append(f"--input={t}=0.01")
    open(os.path.join(os.path.dirname(vmfb), "step-args.txt"), "w").write(" ".join(args))
PY

# The device has NVIDIA's ICD but no loader: Debian's, unpacked there.
if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
  (cd .gl && apt-get download libvulkan1 libglvnd0 libegl1 libgl1 libglx0 libgles2 libopengl0)
fi
du -sh $D .gl
