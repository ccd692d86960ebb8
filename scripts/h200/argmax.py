"""Writes the argmax micro-module of scripts/h200/argmax.sh: one function per staging of the
(value, index) reduction over 262144 logits, in the emitter's form (`Body::argmax_rows_staged`:
the row padded with -inf, laid out as [s0, s1, ...], axis s0 reduced first), and an input whose
largest value sits at two indices (the lower one must win)."""
import sys

import numpy as np

N = 262144
STAGINGS = {
    "s64x3": [64, 64, 64],
    "s8x6": [8] * 6,
    "s16x5": [16, 16, 16, 16, 4],
    "s32x4": [32, 32, 16, 16],
    "s512x2": [512, 512],
    "s4x9": [4] * 9,
}
REDUCER = """      reducer(%a: tensor<f32>, %b: tensor<f32>) (%ai: tensor<i32>, %bi: tensor<i32>) {
        %gt = stablehlo.compare GT, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
        %eq = stablehlo.compare EQ, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
        %lt = stablehlo.compare LT, %ai, %bi : (tensor<i32>, tensor<i32>) -> tensor<i1>
        %tie = stablehlo.and %eq, %lt : tensor<i1>
        %pick = stablehlo.or %gt, %tie : tensor<i1>
        %x = stablehlo.select %pick, %a, %b : tensor<i1>, tensor<f32>
        %y = stablehlo.select %pick, %ai, %bi : tensor<i1>, tensor<i32>
        stablehlo.return %x, %y : tensor<f32>, tensor<i32>
      }
"""


def ty(dims, elem):
    return f"tensor<{'x'.join(map(str, dims))}x{elem}>"


def function(name, stages):
    assert np.prod(stages) == N
    shape = [1] + stages
    lines = [
        f"  func.func @{name}(%logits: {ty([1, N], 'f32')}) -> tensor<1xi32> {{",
        "    %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>",
        "    %zero = stablehlo.constant dense<0> : tensor<i32>",
        f"    %v = stablehlo.reshape %logits : ({ty([1, N], 'f32')}) -> {ty(shape, 'f32')}",
        f"    %iota = stablehlo.iota dim = 1 : {ty([1, N], 'i32')}",
        f"    %i = stablehlo.reshape %iota : ({ty([1, N], 'i32')}) -> {ty(shape, 'i32')}",
    ]
    value, index = "%v", "%i"
    for k in range(len(stages)):
        rest = [1] + stages[k + 1:]
        lines.append(
            f"    %r{k}:2 = stablehlo.reduce({value} init: %ninf), ({index} init: %zero) across dimensions = [1] : "
            f"({ty(shape, 'f32')}, {ty(shape, 'i32')}, tensor<f32>, tensor<i32>) -> ({ty(rest, 'f32')}, {ty(rest, 'i32')})"
        )
        lines.append(REDUCER.rstrip("\n"))
        value, index, shape = f"%r{k}#0", f"%r{k}#1", rest
    lines += [f"    return {index} : tensor<1xi32>", "  }"]
    return "\n".join(lines) + "\n"


out = sys.argv[1]
with open(f"{out}/argmax.mlir", "w") as f:
    f.write("module @argmax {\n")
    for name, stages in STAGINGS.items():
        f.write(function(name, stages))
    f.write("}\n")
rng = np.random.default_rng(7)
x = rng.standard_normal(N).astype(np.float32)
x[[200001, 100003]] = 9.5
np.save(f"{out}/logits.npy", x.reshape(1, N))
print(" ".join(STAGINGS))
