"""Linear weights packed once for oneDNN's CPU GEMM, one copy that every stored CPU graph reads.

Inductor's freezing packs a decode graph's weights too, but each frozen graph then holds its own
packed copy, and an AOTInductor library holding them is mapped from its file and copied into the
runner's memory at load: SmolLM2's 666 MB of packed weights counted twice at a warm start, beside
the 517 MB of float weights prefill reads (2.23 GB peak against the eager backend's 0.99 GB). A
packed twin of the model instead holds each packed matrix as a parameter: a graph traced over it
calls oneDNN's linear on that parameter, AOTInductor stores the graph without weights, and every
loaded graph is handed the twin's tensors (graph_store.py), so decode and verify graphs share them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .decoder import Decoder

# oneDNN lays a weight out for the rows it expects; every count from 2 up gives one layout, which
# multiplies one row as fast as the 1-row layout does (60 matrices of 1536x576, 2 threads, AMD
# EPYC: 1 row 4.9 against 5.5 ms; 8 rows 5.6 against 8.8 ms), so decode, verify and prefill
# graphs can all read the same copy.
PACKED_ROWS = 2


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run oneDNN's linear on packed `dtype` weights (bfloat16 only
    where oneDNN computes it, as inductor's own packing asks)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A linear layer over oneDNN's packed copy of a weight (`weight` is an opaque mkldnn tensor of
    the logical shape [out, in]); a fused projection's `parts` split its output as FusedLinear's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: dict[str, int] | None) -> None:
        super().__init__()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = bias
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")  # [..., in] -> [..., out]
        return y if self.parts is None else y.split(list(self.parts.values()), dim=-1)


def _twin(module: nn.Module) -> nn.Module:
    """`module` with each linear layer below it packed; every other tensor is the original's."""
    twin = copy.copy(module)  # a new __dict__ over the same parameter and buffer dicts
    twin._modules = {
        name: (
            PackedLinear(child.weight, child.bias, getattr(child, "parts", None))
            if isinstance(child, nn.Linear)
            else None
            if child is None
            else _twin(child)
        )
        for name, child in module._modules.items()
    }
    return twin


def packed_twin(model: Decoder) -> Decoder:
    """`model` as a CPU graph built over packed weights sees it: its linear layers, and a tied
    head as a layer of its own, read packed copies; the embedding table, norms and rotary
    frequencies are the model's own tensors. A float model only (quantized weights keep their
    kernels' layouts)."""
    assert model.quantization is None, "a quantized model's linear layers are its kernels' own"
    twin = _twin(model)
    if model.lm_head is None:  # tied: the table stays for the lookup, the head reads a packed copy
        twin.lm_head = PackedLinear(model.embed_tokens.weight, None, None)
    return twin
