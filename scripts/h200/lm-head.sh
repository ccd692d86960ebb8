#!/usr/bin/env bash
# The decode step's LM head on the GPU (FunctionGemma: 262144 × 640 i16 weights, one row) as
# standalone dispatch benchmarks: IREE's own (`--iree-hal-dump-executable-benchmarks-to`, which
# allocates its buffers on the device, so nothing of the 335 MB travels) for several graph forms,
# and the row-major form with its SPIR-V configuration edited by hand (workgroup size, rows per
# workgroup, another pipeline). Which form and configuration reads the weights fastest, before any
# of it goes into the emitter (docs/benchmarks.md, session 14: the LM head is 0.79 ms of the
# step's ~5 ms GPU time, ~430 GB/s; IREE gives every output row a workgroup of 160 threads).
#
#   scripts/h200/lm-head.sh prepare   here: writes the modules and their list to .cache/device/lm-head
#   bash scripts/h200/lm-head.sh run  on the device (carry .cache/device and .gl): median per module
#
# The hand-edited configurations compile but are not checked for correct results here: a form
# worth keeping goes into the emitter and through `diverge` like any other.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.cache/device/lm-head
V=262144
K=640

case ${1:-} in
prepare)
  source scripts/env.sh
  rm -rf $OUT && mkdir -p $OUT/src
  # One form: NAME X_TYPE W_TYPE OUT_TYPE MAPS(x, w, out over d0 d1 d2; d2 the reduction)
  form() {
    cat >"$OUT/src/$1.mlir" <<EOF
func.func @head(%x: $2, %w: $3) -> $4 {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : $4
  %o = linalg.fill ins(%z : f32) outs(%e : $4) -> $4
  %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> ($5)>, affine_map<(d0, d1, d2) -> ($6)>, affine_map<(d0, d1, d2) -> ($7)>], iterator_types = ["parallel", "parallel", "reduction"]} ins(%x, %w : $2, $3) outs(%o : $4) {
    ^bb0(%a: f32, %b: i16, %acc: f32):
      %wide = arith.extsi %b : i16 to i32
      %c16 = arith.constant 16 : i32
      %up = arith.shli %wide, %c16 : i32
      %wf = arith.bitcast %up : i32 to f32
      %p = arith.mulf %a, %wf : f32
      %s = arith.addf %acc, %p : f32
      linalg.yield %s : f32
  } -> $4
  return %r : $4
}
EOF
    iree-compile "$OUT/src/$1.mlir" --iree-hal-target-device=vulkan --iree-vulkan-target=ampere \
      --iree-hal-dump-executable-benchmarks-to="$OUT/src/$1" -o /dev/null
    cp "$OUT/src/$1"/*_benchmark.mlir "$OUT/src/$1.bench.mlir"
  }
  # The emitter's form (`Body::contract_i16`): rows of the [vocab, hidden] table.
  form rowmajor "tensor<1x${K}xf32>" "tensor<${V}x${K}xi16>" "tensor<1x${V}xf32>" "d0, d2" "d1, d2" "d0, d1"
  # The table stored transposed, [hidden, vocab] (the embedding gather would read columns).
  form transposed "tensor<1x${K}xf32>" "tensor<${K}x${V}xi16>" "tensor<1x${V}xf32>" "d0, d2" "d2, d1" "d0, d1"
  # Split K: ten partial products of 64 (a reduction over the ten to follow).
  form splitk10 "tensor<10x64xf32>" "tensor<${V}x10x64xi16>" "tensor<10x${V}xf32>" "d0, d2" "d1, d0, d2" "d0, d1"
  form splitk2 "tensor<2x320xf32>" "tensor<${V}x2x320xi16>" "tensor<2x${V}xf32>" "d0, d2" "d1, d0, d2" "d0, d1"

  # NAME FROM PIPELINE WORKGROUP ROOT_TILES [FILL_TILES]: FROM's benchmark with its configuration
  # replaced (IREE's choice: SubgroupReduce, 160 threads, tiles [[1], [0, 640]]). Without
  # FILL_TILES the fill's own configuration goes (it must not differ from the root's).
  edit() {
    local fill
    if [ -n "${6:-}" ]; then fill="s/tile_sizes = \[\[\], \[0, 640\]\]/tile_sizes = $6/"
    else fill="s/{lowering_config = #iree_codegen.lowering_config<tile_sizes = \[\[\], \[0, 640\]\]>}//"; fi
    sed -e "s/spirv_pipeline<SubgroupReduce> workgroup_size = \[160, 1, 1\]/spirv_pipeline<$3> workgroup_size = [$4, 1, 1]/" \
      -e "s/tile_sizes = \[\[1\], \[0, 640\]\]/tile_sizes = $5/" -e "$fill" \
      "$OUT/src/$2.bench.mlir" >"$OUT/src/$1.bench.mlir"
  }
  edit rows2 rowmajor SubgroupReduce 160 "[[2], [0, 640]]" "[[], [0, 640]]"
  edit rows4 rowmajor SubgroupReduce 160 "[[4], [0, 640]]" "[[], [0, 640]]"
  edit wg32 rowmajor SubgroupReduce 32 "[[1], [0, 640]]" "[[], [0, 640]]"
  edit wg64 rowmajor SubgroupReduce 64 "[[1], [0, 640]]" "[[], [0, 640]]"
  edit wg80 rowmajor SubgroupReduce 80 "[[1], [0, 640]]" "[[], [0, 640]]"
  edit wg32k128 rowmajor SubgroupReduce 32 "[[1], [0, 128]]" "[[], [0, 128]]"
  edit wg64k256 rowmajor SubgroupReduce 64 "[[1], [0, 256]]" "[[], [0, 256]]"
  # A thread per output row, the reduction a loop (row-major: each thread walks its own row).
  edit rowloop32 rowmajor BaseVectorize 32 "[[32, 0], [1, 0], [0, 8]]"
  edit rowloop64 rowmajor BaseVectorize 64 "[[64, 0], [1, 0], [0, 8]]"
  edit rowloop128 rowmajor BaseVectorize 128 "[[128, 0], [1, 0], [0, 8]]"
  # Transposed: neighbouring threads read neighbouring columns (coalesced), K a loop.
  edit tcols64 transposed BaseVectorize 64 "[[256, 0], [4, 0], [0, 4]]"
  edit tcols64k8 transposed BaseVectorize 64 "[[256, 0], [4, 0], [0, 8]]"
  edit tcols128 transposed BaseVectorize 128 "[[512, 0], [4, 0], [0, 4]]"
  edit tcols256 transposed BaseVectorize 256 "[[1024, 0], [4, 0], [0, 4]]"
  edit tcol1 transposed BaseVectorize 64 "[[64, 0], [1, 0], [0, 4]]"
  edit tdist transposed BaseDistribute 64 "[[64, 0], [1, 0], [0, 1]]"

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
  rm -rf "$OUT/src"
  echo "lm-head: $(wc -l <"$OUT/list.txt") modules in $OUT ($(du -sh $OUT | cut -f1))"
  ;;
run)
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  export XDG_RUNTIME_DIR=/tmp
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  while read -r name fn; do
    out=$(.cache/device/tools/iree-benchmark-module --device=vulkan --module="$OUT/$name.vmfb" --function="$fn" \
      --input=20 --batch_size=20 --benchmark_repetitions=5 --benchmark_min_warmup_time=0.2 2>&1) || true
    echo "$name: $(echo "$out" | awk '/_median/ {print $2, $3}') per dispatch (median of 5)"
  done <"$OUT/list.txt"
  ;;
*)
  sed -n 2,15p "$0"
  exit 2
  ;;
esac
