"""The gated feed-forward of every family: `down(act(gate(x)) * up(x))`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .fused_linear import FusedLinear, name_fused_parts_apart


def uses_tanh_gelu(config: ModelConfig) -> bool:
    """Whether the gate's activation is gelu's tanh approximation (Gemma's), else silu."""
    return config.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh")


def activate(gate: torch.Tensor, tanh_gelu: bool) -> torch.Tensor:
    """The gate's activation, as config.ACTIVATIONS names them: one place for the dense MLP and the experts."""
    return F.gelu(gate, approximate="tanh") if tanh_gelu else F.silu(gate)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, bias = config, config.mlp_bias
        self.gate_up_proj = FusedLinear(
            c.hidden_size, {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}, bias
        )
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=bias)
        self.tanh_gelu = uses_tanh_gelu(c)
        self.gate_multiplier, self.out_multiplier = c.mlp_multipliers  # Falcon-H1's µP; 1 elsewhere
        name_fused_parts_apart(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = self.down_proj(activate(gate, self.tanh_gelu) * up)
        return out if self.out_multiplier == 1.0 else out * self.out_multiplier
