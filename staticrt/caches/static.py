"""Static cache: slot j holds position j, for every layer, up to `max_cache_len`."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..ops import cache_write
from .base import CacheSpec, KVCache


class StaticCache(KVCache):
    kind = "static"

    def __init__(
        self, config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config, spec, [spec.max_cache_len] * config.num_layers, dtype, device)
        slot_positions = torch.arange(spec.max_cache_len, device=device)
        self.register_buffer("slot_positions", slot_positions, persistent=False)

    def attention_mask(self, layer_kind: str, positions: torch.Tensor) -> torch.Tensor:
        key_pos = self.slot_positions[None, None, :]  # [1, 1, L]
        query_pos = positions[:, :, None]  # [B, T, 1]
        # Every slot at or before the query's position has been written by now (this step or
        # earlier), so causality alone keeps stale and padded slots out of sight.
        visible = key_pos <= query_pos
        if layer_kind == "sliding_attention":
            visible = visible & (query_pos - key_pos < self.config.sliding_window)
        return visible[:, None]  # [B, 1, T, L]

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, write_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_buf, value_buf = self.layer_buffers(layer_idx)
        cache_write(key_buf, key, write_index)
        cache_write(value_buf, value, write_index)
        return key_buf, value_buf
