"""Hybrid cache: the config decides per layer (Gemma2's alternation, `layer_types`, Qwen2's
`max_window_layers`): sliding layers get a rotating buffer of `window` slots, global layers a
linear one of `max_cache_len`."""

from __future__ import annotations

from ..config import ModelConfig
from .base import KVCache
from .spec import sliding_layers


class HybridCache(KVCache):
    kind = "hybrid"

    @classmethod
    def rotating_layers(cls, config: ModelConfig) -> list[bool]:
        window_layers = set(sliding_layers(config, cls.kind))
        return [i in window_layers for i in range(len(config.layer_types))]
