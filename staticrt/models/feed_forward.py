"""The gated feed-forward of every family: `down(act(gate(x)) * up(x))`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .fused_linear import FusedLinear, name_fused_parts_apart


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, bias = config, config.mlp_bias
        self.gate_up_proj = FusedLinear(
            c.hidden_size, {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}, bias
        )
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=bias)
        self.tanh_gelu = c.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh")
        name_fused_parts_apart(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * up)
