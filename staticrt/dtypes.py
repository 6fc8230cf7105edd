"""The one map between dtype names (CLI options, recipes, manifests) and torch dtypes."""

from __future__ import annotations

import torch

from .errors import ArtifactError, CheckpointError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}  # what a model computes in
# what a manifest records: lengths, int8 K/V, quantized weights' data (int8, packed int4 as uint8 or int32)
RECORDED = {**DTYPES, **{name: getattr(torch, name) for name in ("int64", "int32", "int8", "uint8")}}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A model's dtype from its name (or itself); anything but these floats is refused with the choices."""
    found = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(dtype)
    if found not in DTYPES.values():
        raise CheckpointError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return found


def recorded_dtype(name: str) -> torch.dtype:
    """The dtype an artifact's manifest names for a buffer."""
    if name not in RECORDED:
        raise ArtifactError(f"the manifest names dtype {name!r}, which this staticrt does not know; re-export")
    return RECORDED[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest records: "float32", "bfloat16", "int64", ..."""
    return str(dtype).removeprefix("torch.")
