"""Quantized caches: K and V stored as int8 with one scale per token and head, in the same fixed
buffers and layouts as the float caches (static, sliding, hybrid).

A step's new entries are quantized as they are written (symmetric, scale = max |x| / 127 over the
head dimension, so each token's keys keep their own range; RoPE has already rotated them) and the
layer's buffers are dequantized where attention reads them, inside the graph. Nothing runs on the
host and nothing is re-quantized: unlike transformers' QuantizedCache there is no growing
full-precision residual, so the buffers keep their shapes and addresses and the step compiles.

Bytes a token and layer: 2 * H_kv * (D + scale bytes), against 2 * H_kv * D * dtype bytes: with
D = 64, 26.6% of a float32 cache and 51.6% of a bfloat16 one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import KVCache
from .hybrid import HybridCache
from .sliding import SlidingWindowCache
from .static import StaticCache

INT8_MAX = 127


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [B, H, T, D]` -> int8 values `[B, H, T, D]` and scales `[B, H, T, 1]` in x's dtype."""
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    values = torch.round(x / scale.clamp(min=torch.finfo(x.dtype).tiny)).clamp(-INT8_MAX, INT8_MAX)
    return values.to(torch.int8), scale


class Int8KV(KVCache):
    """What the int8 kinds add to a float layout: int8 storage with scales, dequantized on read."""

    parts = ("key", "value", "key_scale", "value_scale")

    def part_layout(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """int8 K and V `[B, H_kv, L, D]`, then their scales `[B, H_kv, L, 1]` in the cache's dtype."""
        scales = (*shape[:-1], 1)
        return list(zip(self.parts, (shape, shape, scales, scales), (torch.int8, torch.int8, self.dtype, self.dtype)))

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        (key_q, key_scale), (value_q, value_scale) = quantize_int8(key), quantize_int8(value)
        return key_q, value_q, key_scale, value_scale

    def decode(self, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, H_kv, L, D]` in the cache's dtype: values times their token's scale."""
        key, value, key_scale, value_scale = parts
        return key.to(self.dtype) * key_scale, value.to(self.dtype) * value_scale

    def layer_layout(self, layer_idx: int) -> str:
        return f"{super().layer_layout(layer_idx)}-int8"

    def step_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """The int8 K/V `[B, H_kv, L, D]` and their scales `[B, H_kv, L, 1]`."""
        return tuple(getattr(self, f"{part}_{layer_idx}") for part in self.parts)

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V dequantized, `[B, H_kv, L, D]` in the cache's dtype: what attention reads."""
        return self.decode(self.step_buffers(layer_idx))


class StaticInt8Cache(Int8KV, StaticCache):
    kind = "static-int8"


class SlidingInt8Cache(Int8KV, SlidingWindowCache):
    kind = "sliding-int8"


class HybridInt8Cache(Int8KV, HybridCache):
    kind = "hybrid-int8"
