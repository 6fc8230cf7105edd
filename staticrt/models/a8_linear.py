"""Projections (and the head) as integer codes run by staticrt's int8-activation kernels
(a8_kernels.py): `Int8Linear` for quantize "int8-a8", `Int4Linear` for the projections of "int4-a8".
Each holds its codes and scales as buffers (what `bench` counts as a step's bytes) and computes in
float32; a fused projection's forward returns its parts."""

from __future__ import annotations

import torch
from torch import nn

from .a8_kernels import BLOCK, STEP
from .channel_groups import channel_groups


class A8Linear(nn.Module):
    """What both share: the bias (float32) and the parts of a fused projection."""

    def __init__(self, bias: torch.Tensor | None, parts: dict[str, int] | None) -> None:
        super().__init__()
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.parts = parts

    def finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The kernel's `[M, N]` as `[..., N]` for x `[..., K]`, with the bias, split into parts."""
        y = y.view(*x.shape[:-1], -1) if self.bias is None else y.view(*x.shape[:-1], -1) + self.bias
        return y if self.parts is None else y.split(list(self.parts.values()), dim=-1)


class Int8Linear(A8Linear):
    """int8 codes with float32 scales `[N]` (absmax / 127 of each output channel), the codes in the
    kernel's groups of 16 channels (`int8_groups`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: dict[str, int] | None = None):
        super().__init__(bias, parts)
        codes, scales = int8_codes(weight.detach().float())
        self.register_buffer("codes", int8_groups(codes))
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:  # x [..., K] -> [..., N]
        return self.finish(torch.ops.staticrt.int8_linear(x.reshape(-1, x.shape[-1]), self.codes, self.scales), x)


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` float32 -> (codes `[N, K]` int8 in -127..127, scales `[N]` float32): w ~ codes * scale."""
    scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scales


def int8_groups(codes: torch.Tensor) -> torch.Tensor:
    """`codes [..., N, K]` as `int8_linear` reads them: `[..., G, K / 4, 16, 4]`, 16 channels' next
    4 codes a 64-byte load (channel_groups.py)."""
    return channel_groups(codes, 4)


class Int4Linear(A8Linear):
    """int4 codes, two a byte `[N, K / 2]`, and float16 (d, d, m, m) `[N, K / 16]`: each block of
    32 weights of a channel is w = d * q + m, q in 0..15, d = (max - min) / 15 and m = min
    (llama.cpp's Q4_1), packed as the kernel reads them (a8_kernels.py's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: dict[str, int] | None = None):
        super().__init__(bias, parts)
        codes, dm = int4_blocks(weight.detach().float())
        self.register_buffer("codes", codes)
        self.register_buffer("dm", dm)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:  # x [..., K] -> [..., N]
        return self.finish(torch.ops.staticrt.int4_linear(x.reshape(-1, x.shape[-1]), self.codes, self.dm), x)


def int4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` float32 -> (codes `[N, K / 2]` uint8, dm `[N, K / 16]` float16). d and m are
    rounded to float16 first and q from them, so d * q + m is exactly what the kernel computes
    with. Packing, for 64 weights of a channel at a time: byte j holds q_j | q_j+32 << 4."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15).half()
    d = torch.where(d > 0, d, torch.ones_like(d))  # a constant block: every q is 0, w = m
    m = low.half()
    q = torch.round((blocks - m.float()[..., None]) / d.float()[..., None]).clamp(0, 15).to(torch.uint8)
    pairs = q.reshape(n, k // STEP, 2, BLOCK)  # [N, steps, (block 2c, block 2c+1), 32]
    codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2)
    dm = torch.stack([d.reshape(n, -1, 2), m.reshape(n, -1, 2)], dim=2).reshape(n, k // 16)  # (d, d, m, m) a step
    return codes.contiguous(), dm.contiguous()


def int4_weight(codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float32 weight `[N, K]` that `Int4Linear`'s codes and scales stand for (d * q + m)."""
    n = codes.shape[0]
    pairs = codes.reshape(n, -1, 1, BLOCK).to(torch.int32)  # ONNX's BitShift would mix uint8 and int8 types
    q = torch.cat([pairs & 15, pairs >> 4], dim=2).float()  # [N, steps, 2, 32]
    scales = dm.reshape(n, -1, 2, 2).float()  # [N, steps, (d, m), (block 2c, 2c+1)]
    return (q * scales[:, :, 0, :, None] + scales[:, :, 1, :, None]).reshape(n, -1)
