"""The layout staticrt's CPU kernels read a weight in: its channels in groups of 16, interleaved a
unit of inputs at a time, so that one 64-byte load holds 16 channels' next unit (4 int8 codes for
`int8_linear`, a8_linear.py; 1 float32 for `f32_experts`, packed_experts.py) and a thread streams
its groups from one address on.
"""

from __future__ import annotations

import torch

GROUP = 16  # channels a group: one 64-byte load of 16 channels' 4 int8 codes or 1 float32


def channel_groups(w: torch.Tensor, unit: int) -> torch.Tensor:
    """`w [..., N, K]` -> `[..., G, K / unit, 16, unit]`, G = N / 16 rounded up (the channels past
    N zero): channel 16g + c's inputs unit * t .. unit * t + unit - 1 at `[g, t, c]`. Worked
    example, unit 4, K = 8: channel 17's inputs 4..7 are at `[1, 1, 1]`, elements 68..71 (t * 64 +
    c * 4) of group 1."""
    *lead, n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, 0, 0, -n % GROUP))
    return padded.view(*lead, -1, GROUP, k // unit, unit).transpose(-3, -2).contiguous()


def channel_ungrouped(groups: torch.Tensor, n: int) -> torch.Tensor:
    """`channel_groups`' `[..., G, K / unit, 16, unit]` back to its N channels `[..., N, K]`."""
    *lead, g, steps, _, unit = groups.shape
    return groups.transpose(-3, -2).reshape(*lead, g * GROUP, steps * unit)[..., :n, :]
