"""Writes dequant_goldens.bin: blocks of every type the Rust dequantizer supports, with the values
the Python `gguf` package (ggml's reference semantics in numpy) dequantizes them to.

Record: u32 ggml type id, u32 element count, u32 byte count, the bytes, then count f32 values.
Simple types come from `gguf.quants.quantize` of random normals; K-quants (no Python quantizer)
from random bytes with finite, moderate f16 scales patched in.
Run: .tools/venv/bin/python crates/gguf/tests/data/gen_dequant_goldens.py
"""
import struct, sys, os
import numpy as np
from gguf import GGMLQuantizationType as T, quants
from gguf.constants import GGML_QUANT_SIZES

rng = np.random.default_rng(1234)
out = bytearray()

def record(t, raw: np.ndarray, n: int):
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    vals = quants.dequantize(raw, t).astype(np.float32).reshape(-1)
    assert vals.size == n, (t, vals.size, n)
    out.extend(struct.pack('<III', int(t), n, raw.size))
    out.extend(raw.tobytes())
    out.extend(vals.tobytes())

def f16(x):
    return np.array([x], dtype=np.float16).view(np.uint8)

# F32 / F16 / BF16: raw values, including specials.
x = rng.standard_normal(64).astype(np.float32)
x[:6] = [0.0, -0.0, np.inf, -np.inf, 1e-40, 65504.0]
record(T.F32, x.view(np.uint8), 64)
record(T.F16, x.astype(np.float16).view(np.uint8), 64)
record(T.BF16, quants.quantize(x, T.BF16), 64)

for t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
    n = 32 * 16
    x = (rng.standard_normal(n) * rng.uniform(0.01, 3.0)).astype(np.float32)
    x[:32] = 0.0  # an all-zero block
    record(t, quants.quantize(x.reshape(4, -1), t), n)

for t in (T.Q4_K, T.Q5_K, T.Q6_K):
    block, size = GGML_QUANT_SIZES[t]
    nb = 8
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for b in range(nb):
        d = f16(rng.uniform(-0.05, 0.05))
        if t == T.Q6_K:
            raw[b, 208:210] = d
        else:
            raw[b, 0:2] = d
            raw[b, 2:4] = f16(rng.uniform(-0.05, 0.05))
    record(t, raw, nb * block)

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'dequant_goldens.bin')
open(path, 'wb').write(out)
print(path, len(out))
