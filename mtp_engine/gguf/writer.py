"""Writing GGUF files: re-encode a model's matrices into another tensor type.

Used to produce every quant type of a model we only have in one (the trained fixture ships as
Q4_K_M), and later to write synthetic large models. K-quants cannot be produced here (gguf-py has
no quantizer for them); F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 can.
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gq

from ..errors import MTPEngineError

WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# llama.cpp keeps these in F32 whatever the file type
_KEEP_F32 = ("_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "enorm.weight", "hnorm.weight")


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: int | None) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if name == "general.file_type" and file_type is not None:
            writer.add_uint32(name, file_type)
            continue
        value = field.contents()
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)


def requantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str) -> None:
    """Writes `dst`: `src` with every matrix (except the ones llama.cpp keeps in F32) stored as `qtype`."""
    if qtype not in WRITABLE:
        raise MTPEngineError(f"cannot write {qtype!r}: expected one of {list(WRITABLE)}", field="qtype")
    target = GGMLQuantizationType[qtype]
    reader = GGUFReader(str(src), "r")
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer, None)
    block = gq.GGML_QUANT_SIZES[target][0]
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
        values = gq.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        keep = len(shape) < 2 or t.name.endswith(_KEEP_F32) or shape[-1] % block
        if keep:
            writer.add_tensor(t.name, values)
        elif target in (GGMLQuantizationType.F32,):
            writer.add_tensor(t.name, values)
        elif target == GGMLQuantizationType.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, gq.quantize(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
