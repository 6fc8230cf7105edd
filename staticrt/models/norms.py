"""RMSNorm, in each family's rounding."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm in float32. `offset` 0 is Llama's `w * x`; 1 is Gemma's `(1 + w) * x`.
    `weight_in_float32`: multiply by the weight before casting back (Gemma, OLMo 2), where Llama
    casts first; the families round differently in bfloat16."""

    def __init__(self, dim: int, eps: float, offset: float, weight_in_float32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight_in_float32 = weight_in_float32 or bool(offset)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).type_as(x)
        if self.weight_in_float32:
            return (self.weight.float() * xf).type_as(x)
        return self.weight * xf.to(x.dtype)
