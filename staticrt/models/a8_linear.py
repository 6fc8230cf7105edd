"""Projections (and the head) as integer codes run by staticrt's int8-activation kernels
(a8_kernels.py): `Int8Linear` for quantize "int8-a8", `Int4Linear` for the projections of "int4-a8".
Each holds its codes and scales as buffers (what `bench` counts as a step's bytes) and computes in
float32; a fused projection's forward returns its parts."""

from __future__ import annotations

import torch
from torch import nn

from .a8_kernels import BLOCK
from .channel_groups import GROUP, channel_groups, channel_ungrouped


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
    """int4 codes and float16 scales and minimums, each block of 32 weights of a channel w = d * q +
    m, q in 0..15, d = (max - min) / 15 and m = min (llama.cpp's Q4_1), in the kernel's groups of 16
    channels (`int4_groups`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: dict[str, int] | None = None):
        super().__init__(bias, parts)
        self.out_features = weight.shape[0]
        codes, dm = int4_groups(*int4_blocks(weight.detach().float()))
        self.register_buffer("codes", codes)
        self.register_buffer("dm", dm)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:  # x [..., K] -> [..., N]
        y = torch.ops.staticrt.int4_linear(x.reshape(-1, x.shape[-1]), self.codes, self.dm, self.out_features)
        return self.finish(y, x)


def int4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., N, K]` float32 -> (codes `[..., N, K / 2]` uint8, dm `[..., N, K / 32, 2]` float16,
    a block's (d, m)). d and m are rounded to float16 first and q from them, so d * q + m is
    exactly what the kernel computes with. Packing, 8 weights of a channel at a time: byte 4t + j
    holds q_8t+j (low nibble) and q_8t+4+j (high), j < 4."""
    *lead, k = w.shape
    blocks = w.reshape(*lead, k // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15).half()
    d = torch.where(d > 0, d, torch.ones_like(d))  # a constant block: every q is 0, w = m
    m = low.half()
    q = torch.round((blocks - m.float()[..., None]) / d.float()[..., None]).clamp(0, 15).to(torch.uint8)
    eights = q.reshape(*lead, k // 8, 2, 4)  # [..., N, K / 8, (low, high), 4]
    codes = (eights[..., 0, :] | (eights[..., 1, :] << 4)).reshape(*lead, k // 2)
    return codes.contiguous(), torch.stack([d, m], dim=-1).contiguous()


def int4_weight(codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float32 weight `[..., N, K]` that `int4_blocks`' codes and scales stand for (d * q + m)."""
    *lead, half = codes.shape
    fours = codes.reshape(*lead, half // 4, 1, 4).to(torch.int32)  # ONNX's BitShift would mix uint8 and int8 types
    q = torch.cat([fours & 15, fours >> 4], dim=-2).float().reshape(*lead, half * 2 // BLOCK, BLOCK)
    return (q * dm[..., 0, None].float() + dm[..., 1, None].float()).reshape(*lead, half * 2)


def int4_groups(codes: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_blocks`' codes and dm as `int4_linear` reads them: codes `[..., G, K / 8, 16, 4]`, 16
    channels' next 8 codes (4 bytes) a 64-byte load (channel_groups.py), and dm `[..., G, K / 32,
    2, 16]`, a block's 16 scales then 16 minimums (channels past N: codes, d and m zero)."""
    *lead, n, blocks, _ = dm.shape
    padded = torch.nn.functional.pad(dm, (0, 0, 0, 0, 0, -n % GROUP))
    grouped = padded.view(*lead, -1, GROUP, blocks, 2).permute(*range(len(lead)), -4, -2, -1, -3)
    return channel_groups(codes, 4), grouped.contiguous()


def int4_ungrouped(codes: torch.Tensor, dm: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_groups`' layout back to `int4_blocks`' for its N channels."""
    *lead, g, blocks, _, _ = dm.shape
    flat = dm.permute(*range(len(lead)), -4, -1, -3, -2).reshape(*lead, g * GROUP, blocks, 2)[..., :n, :, :]
    return channel_ungrouped(codes, n), flat
