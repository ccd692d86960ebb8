#!/usr/bin/env bash
# The decode step's one-row i16 products on the GPU (FunctionGemma: the 262144 × 640 LM head and
# each layer's projections; SHAPES= picks) as standalone dispatch benchmarks: IREE's own (`--iree-hal-dump-executable-benchmarks-to`, which
# allocates its buffers on the device, so nothing of the 335 MB travels) for several graph forms,
# and the row-major form with its SPIR-V configuration edited by hand (workgroup size, rows per
# workgroup, another pipeline). Which form and configuration reads the weights fastest, before any
# of it goes into the emitter (docs/journal, session 14: the LM head is 0.79 ms of the
# step's ~5 ms GPU time, ~430 GB/s; IREE gives every output row a workgroup of 160 threads).
#
#   scripts/h200/archive/lm-head.sh prepare   here: writes the modules and their list to .cache/device/lm-head
#   bash scripts/h200/archive/lm-head.sh run  on the device (carry .cache/device and .gl): median per module
#
# The hand-edited configurations compile but are not checked for correct results here: a form
# worth keeping goes into the emitter and through `diverge` like any other. Results of session 16
# in docs/journal, session 16 (a dispatch and its barrier cost ~40 µs here, so only the LM head's numbers
# say anything; the wheel's iree-benchmark-module cannot allocate it on a GPU without resizable
# BAR). KEEP_SRC=1 keeps the MLIR in .cache/device/lm-head/src.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=.cache/device/lm-head

case ${1:-} in
prepare)
  source scripts/env.sh
  rm -rf $OUT && mkdir -p $OUT/src
  # body NAME V K MAPS(x, w, out over d0 d1 d2; d2 the reduction) X_TYPE W_TYPE OUT_TYPE: the
  # widening inside the contraction's body (`Body::contract_i16`).
  body() {
    cat >"$OUT/src/$1.mlir" <<MLIR
func.func @head(%x: $5, %w: $6) -> $7 {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : $7
  %o = linalg.fill ins(%z : f32) outs(%e : $7) -> $7
  %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> ($4)>, affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>], iterator_types = ["parallel", "parallel", "reduction"]} ins(%x, %w : $5, $6) outs(%o : $7) {
    ^bb0(%a: f32, %b: i16, %acc: f32):
      %wide = arith.extsi %b : i16 to i32
      %c16 = arith.constant 16 : i32
      %up = arith.shli %wide, %c16 : i32
      %wf = arith.bitcast %up : i32 to f32
      %p = arith.mulf %a, %wf : f32
      %s = arith.addf %acc, %p : f32
      linalg.yield %s : f32
  } -> $7
  return %r : $7
}
MLIR
  }
  # fused NAME V K: the step's form before session 16, a widening apart that IREE fuses into
  # the product as a transposed producer (`vecmat_VxK_f32`).
  fused() {
    local w="tensor<$2x$3xi16>" wi="tensor<$2x$3xi32>" wf="tensor<$2x$3xf32>"
    cat >"$OUT/src/$1.mlir" <<MLIR
func.func @head(%x: tensor<1x$3xf32>, %w: $w) -> tensor<1x$2xf32> {
  %e = stablehlo.convert %w : ($w) -> $wi
  %c = stablehlo.constant dense<16> : $wi
  %s = stablehlo.shift_left %e, %c : $wi
  %f = stablehlo.bitcast_convert %s : ($wi) -> $wf
  %r = stablehlo.dot_general %x, %f, contracting_dims = [1] x [1] : (tensor<1x$3xf32>, $wf) -> tensor<1x$2xf32>
  return %r : tensor<1x$2xf32>
}
MLIR
  }
  bench_of() { # NAME: IREE's dispatch benchmark of src/NAME.mlir
    iree-compile "$OUT/src/$1.mlir" --iree-input-type=stablehlo --iree-hal-target-device=vulkan --iree-vulkan-target=ampere \
      --iree-hal-dump-executable-benchmarks-to="$OUT/src/$1" -o /dev/null
    cp "$OUT/src/$1"/*_benchmark.mlir "$OUT/src/$1.bench.mlir"
  }
  # edit NAME FROM PIPELINE WORKGROUP ROOT_TILES [FILL_TILES]: FROM's benchmark with IREE's
  # configuration (any pipeline and workgroup, root tiles [[1], [0, K]]) replaced. Without
  # FILL_TILES the fill's own configuration goes (it must not differ from the root's).
  edit() {
    python3 - "$OUT/src/$2.bench.mlir" "$OUT/src/$1.bench.mlir" "$3" "$4" "$5" "${6:-}" <<'PY'
import re, sys
src, dst, pipe, wg, root, fill = sys.argv[1:]
t = open(src).read()
t = re.sub(r"spirv_pipeline<\w+> workgroup_size = \[[0-9, ]*\]", f"spirv_pipeline<{pipe}> workgroup_size = [{wg}, 1, 1]", t)
t = re.sub(r"tile_sizes = \[\[1\], \[0, \d+\]\]", f"tile_sizes = {root}", t)
if fill:
    t = re.sub(r"tile_sizes = \[\[\], \[0, \d+\]\]", f"tile_sizes = {fill}", t)
else:
    t = re.sub(r" ?\{lowering_config = #iree_codegen.lowering_config<tile_sizes = \[\[\], \[0, \d+\]\]>\}", "", t)
open(dst, "w").write(t)
PY
  }
  # Every one-row product of the FunctionGemma step: LM head, Q/K/V, gate and up, down, output.
  for shape in ${SHAPES:-262144x640 1536x640 2048x640 640x2048 640x1024}; do
    V=${shape%x*} K=${shape#*x} n=$shape
    fused "$n-fused" $V $K && bench_of "$n-fused"
    body "$n-body" $V $K "d0, d2" "tensor<1x${K}xf32>" "tensor<${V}x${K}xi16>" "tensor<1x${V}xf32>" && bench_of "$n-body"
    edit "$n-wg32rows2" "$n-body" SubgroupReduce 32 "[[2], [0, $K]]" "[[], [0, $K]]"
    edit "$n-wg64rows4" "$n-body" SubgroupReduce 64 "[[4], [0, $K]]" "[[], [0, $K]]"
    edit "$n-wg64rows2" "$n-body" SubgroupReduce 64 "[[2], [0, $K]]" "[[], [0, $K]]"
    edit "$n-wg128rows4" "$n-body" SubgroupReduce 128 "[[4], [0, $K]]" "[[], [0, $K]]"
    edit "$n-rows4" "$n-body" SubgroupReduce 160 "[[4], [0, $K]]" "[[], [0, $K]]"
    edit "$n-rowloop32" "$n-body" BaseVectorize 32 "[[32, 0], [1, 0], [0, 8]]"
  done
  # The LM head's table stored transposed, [hidden, vocab] (the embedding gather would read
  # columns): neighbouring threads read neighbouring columns (coalesced), K a loop.
  body transposed 262144 640 "d0, d2" "tensor<1x640xf32>" "tensor<640x262144xi16>" "tensor<1x262144xf32>"
  sed -i 's/affine_map<(d0, d1, d2) -> (d1, d2)>/affine_map<(d0, d1, d2) -> (d2, d1)>/' $OUT/src/transposed.mlir
  bench_of transposed
  edit tcols64k8 transposed BaseVectorize 64 "[[256, 0], [4, 0], [0, 8]]"
  edit tcols128k8 transposed BaseVectorize 128 "[[512, 0], [4, 0], [0, 8]]"

  : >"$OUT/list.txt"
  for src in "$OUT"/src/*.bench.mlir; do
    name=$(basename "$src" .bench.mlir)
    if iree-compile "$src" -o "$OUT/$name.vmfb" 2>"$OUT/src/$name.err"; then
      fn=$(iree-dump-module "$OUT/$name.vmfb" | grep -o "func @head_dispatch[a-z0-9_]*" | head -1 | sed 's/func @//')
      echo "$name $fn" >>"$OUT/list.txt"
    else
      echo "lm-head: $name does not compile: $(grep -m1 error "$OUT/src/$name.err")" >&2
    fi
  done
  [ -n "${KEEP_SRC:-}" ] || rm -rf "$OUT/src"
  echo "lm-head: $(wc -l <"$OUT/list.txt") modules in $OUT ($(du -sh $OUT | cut -f1))"
  ;;
run)
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  export XDG_RUNTIME_DIR=/tmp
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  while read -r name fn; do
    out=$(.cache/device/tools/iree-benchmark-module --device=vulkan --module="$OUT/$name.vmfb" --function="$fn" \
      --batch_size=20 --benchmark_repetitions=3 --benchmark_min_warmup_time=0.1 2>&1) || true
    echo "$name: $(echo "$out" | awk '/_median/ {print $2, $3}') per dispatch (median of 3)"; echo "$out" | grep -m1 -E "ERROR|INVALID|error" || true
  done <"$OUT/list.txt"
  ;;
*)
  sed -n 2,15p "$0"
  exit 2
  ;;
esac
