"""A mixture of experts' float32 stacks laid out for a decode step that reads each token's k
experts in place (`f32_experts`, packed_gemv_source.py), on the CPU graphs of a packed model
(packed_linear.py's `pack`).

Gathered, a decode step copies the k chosen experts' weights (`[T, k, N, K]`) and reads the copy
again: three passes over the experts' bytes where one would do. An expert's `[N, K]` weight is
held in blocks of 16 channels, `[G, K, 16]` (channel_groups.py; G = N / 16 rounded up):
channel n's weight k at `[n // 16, k, n % 16]`, so each k is one 64-byte load of 16 channels'
weights times x[k] (f32_packed_linear's order, whose block kernel it runs). Worked example, K =
1024: channel 17's weight 3 is float 1 * 1024 * 16 + 3 * 16 + 1 = 16433 of the expert's. A step
of many rows (prefill) multiplies every expert densely (moe.py), each expert's weight laid back
out as `[N, K]` first. One MoE layer at one row, eager: 2.4 -> 0.39 ms; a compiled decode step
1.01-1.06x (inductor's gathered graph was already close; docs/measurements.md).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import packed_gemv
from .channel_groups import channel_groups, channel_ungrouped
from .moe import Experts, expert_rows


class PackedStack(nn.Module):
    """One float32 stack `[E, N, K]` as `blocks [E, G, K, 16]`, multiplied in place by
    `f32_experts`; `kernel` marks it as Experts.project's to call, as QuantizedStack does."""

    kernel = True

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.shape = tuple(weight.shape[1:])  # (N, K)
        blocks = channel_groups(weight.detach(), 1).flatten(-2)  # [E, G, K, 16]
        self.blocks = nn.Parameter(blocks, requires_grad=False)

    def gather(self, index: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
        """The experts at `index` (any shape, or one expert) laid back out: `[*index, N, K]` in `dtype`."""
        return channel_ungrouped(self.blocks[index].unsqueeze(-1), self.shape[0]).to(dtype)

    def project(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """`x [T, K]` (a token's input to each of its experts) or `[T, k, K]` (one a chosen
        expert) through the experts `chosen [T, k]`: `[T, k, N]`."""
        tokens, k = chosen.shape
        rows = expert_rows(x, chosen)  # [T * k, K]
        out = torch.ops.staticrt.f32_experts(rows, self.blocks, chosen.reshape(-1))  # [T * k, G * 16]
        return out[:, : self.shape[0]].view(tokens, k, -1)


def packed_experts(experts: Experts, twin: bool) -> Experts:
    """`experts` with its float32 stacks as `PackedStack`s: a twin sharing the biases (`twin`), or
    the module itself, each float stack let go. Unchanged where the kernel cannot run here or the
    stacks are not float32."""
    if experts.gate_up_proj.dtype != torch.float32 or not packed_gemv.usable():
        return experts
    target = copy.copy(experts) if twin else experts  # a copy: a new __dict__ over the same tensors
    target._parameters, target._modules = dict(experts._parameters), dict(experts._modules)
    for name in ("gate_up_proj", "down_proj"):
        stack = PackedStack(getattr(experts, name))
        del target._parameters[name]
        target._modules[name] = stack
    return target
