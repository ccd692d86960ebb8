#!/usr/bin/env bash
# Issue 15's lever, measured standalone: Gemma 3 270M's q4 LM head (262144 × 640, one row) as the
# exported graphs write it (`Body::block_contract_q`: a linalg.generic that IREE compiles) against
# our AVX-512 kernel (crates/export/kernels/q4_matvec_x86_64.c, which `--cpu host` q4 exports
# now call: export::kernels) linked into an IREE dispatch (`hal.executable.objects`, called from a
# `flow.dispatch`; ROWS=256 rows a workgroup). Same random inputs (f16 scales: the kernel reads
# them so, the graph's form gets them widened, as its fused producer does), both checked against
# numpy (float64), then
# `iree-benchmark-module` medians alternating ROUNDS times on local-task. The weights are
# function arguments: these dispatches are generic reductions and a custom call, which IREE
# neither data-tiles nor packs, so arguments stand for the graphs' globals.
#
#   scripts/q4-kernel.sh            (ROUNDS=3, ROWS=256, KERNEL=file.c; needs clang and AVX-512)
#
# Not part of CI: a measurement, and the machine must be quiet to mean anything.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ROUNDS=${ROUNDS:-3}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
O=262144 K=640 NB=20
ROWS=${ROWS:-256} # rows a workgroup
KERNEL=${KERNEL:-crates/export/kernels/q4_matvec_x86_64.c} # another version of it, to compare

python - "$W" <<'PY'
import sys
import numpy as np
w = sys.argv[1]
O, NB = 262144, 20
rng = np.random.default_rng(0)
rng.standard_normal(NB * 32).astype(np.float32).tofile(f"{w}/x.bin")
rng.integers(-128, 128, (O, NB, 16), dtype=np.int16).astype(np.int8).tofile(f"{w}/q.bin")
s = (rng.random((O, NB)) * 0.01).astype(np.float16)
s.tofile(f"{w}/s16.bin")
s.astype(np.float32).tofile(f"{w}/s.bin")
PY

# The graph's form.
cat >"$W/graph.mlir" <<EOF
func.func @head(%x: tensor<1x${NB}x32xf32>, %q: tensor<${O}x${NB}x32xi4>, %s: tensor<${O}x${NB}xf32>) -> tensor<1x${O}xf32> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<1x${O}xf32>
  %o = linalg.fill ins(%z : f32) outs(%e : tensor<1x${O}xf32>) -> tensor<1x${O}xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d1, d2)>, affine_map<(d0, d1, d2, d3) -> (d0, d1)>], iterator_types = ["parallel", "parallel", "reduction", "reduction"]} ins(%x, %q, %s : tensor<1x${NB}x32xf32>, tensor<${O}x${NB}x32xi4>, tensor<${O}x${NB}xf32>) outs(%o : tensor<1x${O}xf32>) {
    ^bb0(%a: f32, %qv: i4, %sc: f32, %acc: f32):
      %qf = arith.sitofp %qv : i4 to f32
      %w = arith.mulf %qf, %sc : f32
      %p = arith.mulf %a, %w : f32
      %sum = arith.addf %acc, %p : f32
      linalg.yield %sum : f32
  } -> tensor<1x${O}xf32>
  return %r : tensor<1x${O}xf32>
}
EOF

# The kernel, and the dispatch that calls it.
clang -target x86_64-unknown-unknown-eabi-elf -std=c11 -O3 -ffreestanding -fno-stack-protector -fPIC \
  -mavx512f -mavx512bw -mavx512vl -mfma -mf16c -c "$KERNEL" -o "$W/q4_matvec_x86_64.o"
Q=$((O * NB * 16)) S=$((O * NB))
cat >"$W/kernel.mlir" <<EOF
#x86 = #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64", {
  data_layout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-i128:128-f80:128-n8:16:32:64-S128",
  native_vector_size = 64 : index, target_triple = "x86_64-unknown-unknown-eabi-elf"}>
#layout = #hal.pipeline.layout<bindings = [
  #hal.pipeline.binding<storage_buffer, ReadOnly>, #hal.pipeline.binding<storage_buffer, ReadOnly>,
  #hal.pipeline.binding<storage_buffer, ReadOnly>, #hal.pipeline.binding<storage_buffer>]>
module @kernel {
  hal.executable private @q4 {
    hal.executable.variant public @x86_64 target(#x86) objects([#hal.executable.object<{path = "q4_matvec_x86_64.o"}>]) {
      hal.executable.export public @q4_matvec ordinal(0) layout(#layout) count(%device: !hal.device, %rows: index) -> (index, index, index) {
        %x = affine.apply affine_map<()[s0] -> (s0 ceildiv ${ROWS})>()[%rows]
        %c1 = arith.constant 1 : index
        hal.return %x, %c1, %c1 : index, index, index
      }
      builtin.module {
        func.func private @q4_matvec_workgroup(memref<${K}xf32>, memref<${Q}xi8>, memref<${S}xf16>, memref<${O}xf32>, index, index, index) attributes {hal.import.static}
        func.func @q4_matvec() {
          %c0 = arith.constant 0 : index
          %k = arith.constant ${K} : index
          %n = arith.constant ${ROWS} : index
          %wg = hal.interface.workgroup.id[0] : index
          %row0 = arith.muli %wg, %n : index
          %x = hal.interface.binding.subspan layout(#layout) binding(0) alignment(64) offset(%c0) flags(ReadOnly) : memref<${K}xf32>
          %q = hal.interface.binding.subspan layout(#layout) binding(1) alignment(64) offset(%c0) flags(ReadOnly) : memref<${Q}xi8>
          %s = hal.interface.binding.subspan layout(#layout) binding(2) alignment(64) offset(%c0) flags(ReadOnly) : memref<${S}xf16>
          %o = hal.interface.binding.subspan layout(#layout) binding(3) alignment(64) offset(%c0) : memref<${O}xf32>
          func.call @q4_matvec_workgroup(%x, %q, %s, %o, %k, %row0, %n) : (memref<${K}xf32>, memref<${Q}xi8>, memref<${S}xf16>, memref<${O}xf32>, index, index, index) -> ()
          return
        }
      }
    }
  }
  func.func @head(%x: tensor<${K}xf32>, %q: tensor<${Q}xi8>, %s: tensor<${S}xf16>) -> tensor<${O}xf32> {
    %rows = arith.constant ${O} : index
    %0 = flow.dispatch @q4::@x86_64::@q4_matvec[%rows](%x, %q, %s) : (tensor<${K}xf32>, tensor<${Q}xi8>, tensor<${S}xf16>) -> tensor<${O}xf32>
    return %0 : tensor<${O}xf32>
  }
}
EOF

CPU="--iree-hal-target-device=local --iree-hal-local-target-device-backends=llvm-cpu --iree-llvmcpu-target-cpu=host"
# shellcheck disable=SC2086
iree-compile "$W/graph.mlir" $CPU --iree-opt-level=O3 -o "$W/graph.vmfb"
# shellcheck disable=SC2086
iree-compile "$W/kernel.mlir" $CPU --iree-hal-executable-object-search-path="$W" -o "$W/kernel.vmfb" 2>/dev/null

GRAPH_IN=(--input="1x${NB}x32xf32=@$W/x.bin" --input="${O}x${NB}x32xi4=@$W/q.bin" --input="${O}x${NB}xf32=@$W/s.bin")
KERNEL_IN=(--input="${K}xf32=@$W/x.bin" --input="${Q}xi8=@$W/q.bin" --input="${S}xf16=@$W/s16.bin")
iree-run-module --device=local-task --module="$W/graph.vmfb" --function=head "${GRAPH_IN[@]}" --output="@$W/graph.npy" >/dev/null
iree-run-module --device=local-task --module="$W/kernel.vmfb" --function=head "${KERNEL_IN[@]}" --output="@$W/kernel.npy" >/dev/null
python - "$W" <<'PY'
import sys
import numpy as np
w = sys.argv[1]
O, NB = 262144, 20
x = np.fromfile(f"{w}/x.bin", np.float32).astype(np.float64)
q = np.fromfile(f"{w}/q.bin", np.int8).reshape(O, NB, 16).astype(np.int16)
s = np.fromfile(f"{w}/s.bin", np.float32).reshape(O, NB).astype(np.float64)
vals = np.empty((O, NB, 32))
vals[:, :, 0::2] = ((q & 0xF) ^ 8) - 8
vals[:, :, 1::2] = (((q >> 4) & 0xF) ^ 8) - 8
want = (vals * s[:, :, None]).reshape(O, NB * 32) @ x
for name in ("graph", "kernel"):
    got = np.load(f"{w}/{name}.npy").ravel()
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"q4-kernel: {name:6s} max |error| / max |value| = {err:.1e}")
    assert err < 1e-5, f"{name} disagrees with numpy"
PY

for round in $(seq 1 "$ROUNDS"); do
  for name in graph kernel; do
    if [ $name = graph ]; then args=("${GRAPH_IN[@]}"); else args=("${KERNEL_IN[@]}"); fi
    med=$(iree-benchmark-module --device=local-task --module="$W/$name.vmfb" --function=head "${args[@]}" \
      --benchmark_repetitions=5 2>/dev/null | awk '/_median/ {print $2, $3}')
    echo "q4-kernel: round $round $name: $med (median of 5)"
  done
done
echo "q4-kernel: load $(cut -d' ' -f1-3 /proc/loadavg)"
