"""Tensor primitives shared by every cache. The cache write has the semantics of ONNX
`TensorScatter` (opset 24) so that one eager implementation maps onto one ONNX op."""

from __future__ import annotations

import torch


def cache_write(buffer: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, circular: bool = False) -> None:
    """Write `new [B, H, T, D]` into `buffer [B, H, L, D]` in place at rows' slots
    `write_index[b] .. write_index[b] + T - 1` (TensorScatter mode `linear`), or those slots
    modulo L (mode `circular`).

    In linear mode the caller guarantees `write_index[b] + T <= L`; a compiled graph cannot raise
    on data, so the bound is checked on the host before the step. In circular mode T <= L keeps
    the slots distinct.
    """
    batch, _, steps, _ = new.shape
    rows = torch.arange(batch, device=buffer.device)[:, None]  # [B, 1]
    slots = write_index[:, None] + torch.arange(steps, device=buffer.device)  # [B, T]
    if circular:
        slots = torch.remainder(slots, buffer.shape[2])
    # Advanced indices on dims 0 and 2 with a slice between put the indexed dims first: [B, T, H, D].
    buffer[rows, :, slots] = new.transpose(1, 2)
