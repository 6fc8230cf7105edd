"""The one map between dtype names (CLI options, recipes, manifests) and torch dtypes."""

from __future__ import annotations

import torch

from .errors import CheckpointError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "int64": torch.int64,
}  # int64: cache lengths, in artifact manifests


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from its name (or itself); an unknown name is refused with the choices."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        choices = ", ".join(name for name, value in DTYPES.items() if value.is_floating_point)
        raise CheckpointError(f"dtype {dtype!r} is not supported; choose one of {choices}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest records: "float32", "bfloat16", "int64", ..."""
    return str(dtype).removeprefix("torch.")
