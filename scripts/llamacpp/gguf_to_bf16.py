"""Writes a BF16 GGUF from a quantized one: every tensor dequantized, then stored as llama.cpp's
`convert_hf_to_gguf.py --outtype bf16` stores a model (matrices BF16, 1-D tensors such as norms
F32), metadata copied. So llama.cpp BF16 runs the very weights skainet-kv imports (our importer
dequantizes the same file to bf16).

Usage: python gguf_to_bf16.py IN.gguf OUT.gguf   (the `gguf` package of .tools/venv)
"""

import os
import sys

import gguf
import numpy as np


def main(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = dst + ".partial"
    writer = gguf.GGUFWriter(tmp, arch=arch)
    for field in reader.fields.values():
        # Virtual fields and the ones GGUFWriter writes itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = gguf.LlamaFileType.MOSTLY_BF16
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if data.ndim >= 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # Renamed only when whole: an interrupted run never leaves a file the script would reuse.
    os.replace(tmp, dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_bf16.py IN.gguf OUT.gguf")
    main(sys.argv[1], sys.argv[2])
