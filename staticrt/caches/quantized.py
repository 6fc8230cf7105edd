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

import torch

from .base import KVCache, _nbytes
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

    def allocate_layer(self, layer_idx: int, shape: tuple[int, ...]) -> None:
        scales = (*shape[:-1], 1)
        for name in (f"key_{layer_idx}", f"value_{layer_idx}"):
            self.register_static(name, torch.zeros(shape, dtype=torch.int8, device=self.device))
            self.register_static(f"{name}_scale", torch.zeros(scales, dtype=self.dtype, device=self.device))

    def layer_layout(self, layer_idx: int) -> str:
        return f"{super().layer_layout(layer_idx)}-int8"

    def storage_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 K/V `[B, H_kv, L, D]` (their scales `[B, H_kv, L, 1]` beside them)."""
        return getattr(self, f"key_{layer_idx}"), getattr(self, f"value_{layer_idx}")

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"key_{layer_idx}_scale"), getattr(self, f"value_{layer_idx}_scale")

    def layer_bytes(self, layer_idx: int) -> int:
        return super().layer_bytes(layer_idx) + sum(_nbytes(scale) for scale in self.scales(layer_idx))

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V dequantized, `[B, H_kv, L, D]` in the cache's dtype: what attention reads."""
        pairs = zip(self.storage_buffers(layer_idx), self.scales(layer_idx))
        return tuple(values.to(self.dtype) * scale for values, scale in pairs)

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        write_index: torch.Tensor,
        num_new: torch.Tensor,
        after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the step's `key`/`value [B, H_kv, T, D]` and write values and scales in place, as
        the float layout writes (linear or rotating); return the layer's dequantized K/V."""
        for buf, scale_buf, new in zip(self.storage_buffers(layer_idx), self.scales(layer_idx), (key, value)):
            for target, part in zip((buf, scale_buf), quantize_int8(new)):
                self.write(layer_idx, target, part, write_index, num_new)
        return self.layer_buffers(layer_idx)


class StaticInt8Cache(Int8KV, StaticCache):
    kind = "static-int8"


class SlidingInt8Cache(Int8KV, SlidingWindowCache):
    kind = "sliding-int8"


class HybridInt8Cache(Int8KV, HybridCache):
    kind = "hybrid-int8"
