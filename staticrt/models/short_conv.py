"""LFM2's gated short convolution, the token mixer of its layers that do not attend.

`in_proj` gives three gates b, c and x `[B*T, C]` each; b * x runs through a causal depthwise
convolution over the last K positions (K = `conv_kernel`, 3 in LFM2), and c gates its output
before `out_proj`. What a step needs of earlier positions is the K - 1 inputs b * x before it: the
cache keeps them (caches/conv_state.py), so a decode step reads K - 1 rows a layer, whatever the
sequence's length, and the graph's shapes never depend on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..caches.conv_state import ConvView
from ..config import ModelConfig
from ..rope import RopeStep


class ShortConv(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, width = config, config.hidden_size
        # nn.Conv1d for the checkpoint's names and shapes (`conv.weight [C, 1, K]`); forward calls F.conv1d
        self.conv = nn.Conv1d(width, width, c.conv_kernel, groups=width, bias=c.conv_bias)
        self.in_proj = nn.Linear(width, 3 * width, bias=c.conv_bias)
        self.out_proj = nn.Linear(width, width, bias=c.conv_bias)

    def forward(self, x: torch.Tensor, rope: RopeStep | None, view: ConvView) -> torch.Tensor:
        """`x [B*T, C]` -> `[B*T, C]`; `rope` is unused (the signature is the attention's)."""
        batch, seq_len = view.meta.batch, view.meta.seq_len
        b, c, inputs = self.in_proj(x).chunk(3, dim=-1)  # [B*T, C] each, in transformers' order
        out = causal_conv(view, (b * inputs).view(batch, seq_len, -1), self.conv)  # [B, T, C]
        return self.out_proj(c * out.reshape(batch * seq_len, -1))


def causal_conv(view: ConvView, inputs: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`inputs [B, T, C]` -> `[B, T, C]`: the depthwise convolution transformers' torch path runs
    (F.conv1d, no padding) over the inputs with their K - 1 before them from the cache (`view`), so
    output t reads inputs t - K + 1 .. t. LFM2's, Mamba2's and gated DeltaNet's."""
    window = view.inputs_with_history(inputs, conv.kernel_size[0])  # [B, K - 1 + T, C]
    return F.conv1d(window.transpose(1, 2), conv.weight, conv.bias, groups=inputs.shape[-1]).transpose(1, 2)
